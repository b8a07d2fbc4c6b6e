//! The Kubernetes side of `meshless control` and `meshless up`.

use std::time::Duration;

use anyhow::{Context, Result};
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
