//! `meshless fake-kube`: a cluster to try the Kubernetes source on without
//! one. The fake API server serves namespace `demo`:
//! - Service `web` and Deployment `web` (3 pods), rolled (one pod replaced
//!   at a time, surge first) every `roll_every`;
//! - Service `lazy` and Deployment `lazy` at 0 replicas: the control
//!   plane's `scaler: kubernetes` scales it from zero on the first request.
//!   Its pods start [`LAZY_START`] after a scale (standing for the
//!   ReplicaSet controller and the scheduler); Pods created through the
//!   API on Node `node-a` (node-local activation) start at once.
//!
//! Every pod is a real `meshless-backend` on 127.0.0.1.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::fake_api::FakeApiServer;
use crate::fake_api::kubelet::{self, Kubelets};
use crate::fake_api::workloads::{self, Workload, deployment};
use crate::objects::{node, service};

/// What the demo cluster does.
#[derive(Debug, Clone)]
pub struct DemoSettings {
    pub listen: SocketAddr,
    /// Where the kubeconfig pointing at the fake is written.
    pub kubeconfig: std::path::PathBuf,
    /// Roll `demo/web` this often; `None`: never.
    pub roll_every: Option<Duration>,
}

/// How long `demo/lazy`'s Deployment takes to start a pod after a scale.
pub const LAZY_START: Duration = Duration::from_secs(2);

fn workload(name: &str, start_after: Duration) -> Workload {
    Workload {
        namespace: "demo".into(),
        deployment: name.into(),
        service: name.into(),
        start_after,
        ready_after: Duration::from_millis(500),
        drain: Duration::from_secs(1),
    }
}

/// The kubelets running the Pods of Service `name` created through the API.
fn kubelets(name: &str) -> Kubelets {
    Kubelets {
        namespace: "demo".into(),
        service: name.into(),
        selector: [("app".to_owned(), name.to_owned())].into(),
        ready_after: Duration::from_millis(500),
        drain: Duration::from_secs(1),
    }
}

/// Starts the fake and its workloads; runs until `stop`.
pub async fn run(settings: DemoSettings, stop: watch::Receiver<bool>) -> std::io::Result<()> {
    let fake = Arc::new(FakeApiServer::start(settings.listen).await?);
    write_kubeconfig(&fake, &settings.kubeconfig)?;
    // Annotated: proxies hash `x-user` over a Maglev table for it.
    let mut web = service("demo", "web", &[("http", 80)]);
    web.metadata.annotations = Some(
        [
            ("meshless.io/policy", "maglev"),
            ("meshless.io/hash-key", "header:x-user"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect(),
    );
    fake.apply(&web);
    fake.apply(&deployment("demo", "web", 3));
    fake.apply(&service("demo", "lazy", &[("http", 80)]));
    fake.apply(&deployment("demo", "lazy", 0));
    fake.apply(&node("node-a", "zone-a"));
    tracing::info!(url = %fake.url(), kubeconfig = %settings.kubeconfig.display(), "fake API server: namespace demo, Services web (3 pods) and lazy (0 pods), Node node-a");
    let mut tasks = vec![
        tokio::spawn(workloads::follow(
            Arc::clone(&fake),
            workload("web", Duration::ZERO),
            stop.clone(),
        )),
        tokio::spawn(workloads::follow(
            Arc::clone(&fake),
            workload("lazy", LAZY_START),
            stop.clone(),
        )),
        tokio::spawn(kubelet::run(
            Arc::clone(&fake),
            kubelets("lazy"),
            stop.clone(),
        )),
    ];
    if let Some(every) = settings.roll_every {
        tasks.push(tokio::spawn(roll(Arc::clone(&fake), every, stop.clone())));
    }
    for t in tasks {
        let _ = t.await;
    }
    Ok(())
}

fn write_kubeconfig(fake: &FakeApiServer, path: &Path) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    fake.write_kubeconfig(path)
}

/// A rollout as the Deployment controller does it with `maxSurge: 1,
/// maxUnavailable: 0`, reduced to what the endpoints see: one more pod,
/// then one fewer (the oldest goes, as a new ReplicaSet replaces the old),
/// until every pod has been replaced.
async fn roll(fake: Arc<FakeApiServer>, every: Duration, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = crate::stopped(&mut stop) => return,
        }
        tracing::info!("fake API server: rolling demo/web");
        // Scale up by one then down by one, three times: the follower
        // starts a new pod, then retires the newest beyond the count;
        // the Deployment's replicas end where they were.
        for _ in 0..3 {
            fake.apply(&deployment("demo", "web", 4));
            tokio::time::sleep(Duration::from_secs(1)).await;
            fake.apply(&deployment("demo", "web", 3));
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }
}
