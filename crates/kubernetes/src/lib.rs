//! The control plane's Kubernetes side, kept in its own crate so kube's
//! dependency tree stays out of the other crates' builds:
//! - [`source`]: Services and EndpointSlices watched and merged per
//!   service ([`slices_cache`]) into the registry as read-only services;
//! - [`scaler`]: `scaler: kubernetes` through the `scale` subresource,
//!   only on the replica that holds the [`lease`], with [`node_local`]
//!   Pods bound to the asking proxy's node;
//! - [`fake_api`]: an in-process API server for tests and the demo;
//! - [`objects`]: builders of the objects it serves;
//! - [`demo`]: a fake cluster to try it on (`meshless fake-kube`).
//!
//! Its settings and metrics are plain types in `meshless_control::kubernetes`.

pub mod client;
pub mod demo;
pub mod fake_api;
pub mod lease;
pub mod node_local;
pub mod objects;
pub mod scaler;
pub mod slices_cache;
pub mod source;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use meshless_control::config::ScalerConfig;
use meshless_control::kubernetes::KubernetesSource;
use meshless_control::plane::PlaneState;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use client::ClientError;

/// Connects to the cluster `cfg` names and starts watching it; when a
/// service of `state`'s file has `scaler: kubernetes`, also starts leader
/// election and connects the scaler. The tasks end when `stop` turns true.
pub async fn start(
    state: Arc<PlaneState>,
    cfg: KubernetesSource,
    stop: watch::Receiver<bool>,
) -> Result<Vec<JoinHandle<()>>, ClientError> {
    let client = client::client(&cfg).await?;
    let mut tasks = Vec::new();
    let scales = state.config.services.iter().any(|s| {
        s.autoscaling
            .as_ref()
            .is_some_and(|a| matches!(a.scaler, ScalerConfig::Kubernetes(_)))
    });
    if scales {
        let leader = Arc::new(AtomicBool::new(false));
        let leader_api = Arc::new(Mutex::new(None));
        let metrics = state.metrics.kubernetes.clone();
        let le = cfg.leader_election.clone();
        let identity = le.identity.clone().unwrap_or_else(default_identity);
        let scaler = scaler::KubeScaler::new(
            client.clone(),
            Arc::clone(&leader),
            metrics.clone(),
            Arc::clone(&state),
            stop.clone(),
        )
        .with_leader_api(Arc::clone(&leader_api), identity.clone());
        let _ = state.replica_scaler.set(Arc::new(scaler));
        let namespace = le
            .namespace
            .clone()
            .or_else(|| std::env::var("POD_NAMESPACE").ok())
            .unwrap_or_else(|| "default".into());
        let advertise = advertise_address(&le, state.api_address.get().copied());
        let elector = lease::Elector::new(
            kube::Api::namespaced(client.clone(), &namespace),
            le,
            identity,
        )
        .with_addresses(advertise, leader_api);
        tasks.push(tokio::spawn(elector.run(
            leader,
            metrics.leader,
            stop.clone(),
        )));
    }
    let source = source::Source::new(state);
    tasks.push(tokio::spawn(source.run(client, cfg, stop)));
    Ok(tasks)
}

/// Where followers reach this replica's API: the configured address, else
/// the bound one, or `$POD_IP` with its port when bound to every interface.
fn advertise_address(
    le: &meshless_control::kubernetes::LeaderElection,
    bound: Option<std::net::SocketAddr>,
) -> Option<String> {
    if let Some(a) = &le.advertise_address {
        return Some(a.clone());
    }
    let bound = bound?;
    if !bound.ip().is_unspecified() {
        return Some(bound.to_string());
    }
    let ip: std::net::IpAddr = std::env::var("POD_IP").ok()?.parse().ok()?;
    Some(std::net::SocketAddr::new(ip, bound.port()).to_string())
}

/// `$POD_NAME`, else `$HOSTNAME`, else a name made from the process id.
fn default_identity() -> String {
    std::env::var("POD_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| format!("meshless-control-{}", std::process::id()))
}

/// Resolves once `stop` is true (or its sender is gone).
pub(crate) async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}
