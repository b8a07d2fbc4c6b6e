//! The control plane's Kubernetes side, kept in its own crate so kube's
//! dependency tree stays out of the other crates' builds:
//! - [`source`]: Services and EndpointSlices watched and merged per
//!   service ([`slices_cache`]) into the registry as read-only services;
//! - [`fake_api`]: an in-process API server for tests and the demo;
//! - [`objects`]: builders of the objects it serves.
//!
//! Its settings and metrics are plain types in `meshless_control::kubernetes`.

pub mod client;
pub mod fake_api;
pub mod objects;
pub mod slices_cache;
pub mod source;

use std::sync::Arc;

use meshless_control::kubernetes::KubernetesSource;
use meshless_control::plane::PlaneState;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use client::ClientError;

/// Connects to the cluster `cfg` names and starts watching it; the task
/// ends when `stop` turns true.
pub async fn start(
    state: Arc<PlaneState>,
    cfg: KubernetesSource,
    stop: watch::Receiver<bool>,
) -> Result<JoinHandle<()>, ClientError> {
    let client = client::client(&cfg).await?;
    let source = source::Source::new(state);
    Ok(tokio::spawn(source.run(client, cfg, stop)))
}
