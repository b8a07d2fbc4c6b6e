//! The Kubernetes side of `meshless control` and `meshless up`, and
//! `meshless fake-kube`, a fake cluster to try it on.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use meshless_control::plane::ControlPlane;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The running source (and scaler), when the file has `kubernetes:`.
#[derive(Debug)]
pub struct KubeSide {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl KubeSide {
    /// Starts watching the cluster the plane's file names, if any.
    pub async fn start(plane: &ControlPlane) -> Result<Option<Self>> {
        let Some(cfg) = plane.state.config.kubernetes.clone() else {
            return Ok(None);
        };
        let (stop, stopped) = watch::channel(false);
        let tasks = meshless_kubernetes::start(plane.state.clone(), cfg, stopped)
            .await
            .context("kubernetes")?;
        Ok(Some(Self { stop, tasks }))
    }

    /// Stops watching (and releases the leader Lease).
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(3), t).await;
        }
    }
}

/// Arguments of `meshless fake-kube`.
#[derive(Debug, Args)]
pub struct FakeKubeArgs {
    /// Address of the fake API server.
    #[arg(long, default_value = "127.0.0.1:6443")]
    pub listen: SocketAddr,
    /// Where to write a kubeconfig pointing at it.
    #[arg(long, default_value = "/tmp/meshless-fake-kubeconfig")]
    pub kubeconfig: PathBuf,
    /// Roll Deployment demo/web this often (e.g. 30s); 0 = never.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub roll_every: Duration,
}

/// Runs the fake cluster until SIGINT or SIGTERM.
pub fn fake_kube(args: FakeKubeArgs) -> Result<()> {
    let settings = meshless_kubernetes::demo::DemoSettings {
        listen: args.listen,
        kubeconfig: args.kubeconfig,
        roll_every: (!args.roll_every.is_zero()).then_some(args.roll_every),
    };
    crate::serve::runtime(None)?.block_on(async {
        let (stop, stopped) = watch::channel(false);
        let demo = tokio::spawn(meshless_kubernetes::demo::run(settings, stopped));
        crate::serve::terminated().await?;
        let _ = stop.send(true);
        demo.await.context("fake-kube")?.context("fake-kube")?;
        Ok(())
    })
}
