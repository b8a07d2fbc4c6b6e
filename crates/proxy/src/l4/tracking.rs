//! Connection tracking for endpoints that leave: a flow's endpoint that is
//! no longer in its cluster (removed, or terminating while others are
//! ready) gets no new flows, and its open flows are closed once
//! `drain_timeout` has passed since it left. Woken by every change of the
//! running snapshot (`ProxyState::endpoints_changed`: reloads and
//! control-plane updates).

use std::pin::pin;

use meshless_model::EndpointId;

use crate::snapshot::Snapshot;
use crate::state::ProxyState;

/// Whether `endpoint` is still one that `cluster` sends new flows to.
pub fn serving(snapshot: &Snapshot, cluster: &str, endpoint: &EndpointId) -> bool {
    snapshot.clusters.get(cluster).is_some_and(|c| {
        c.lb.endpoints()
            .iter()
            .any(|e| e.id == *endpoint && !e.conditions.terminating)
    })
}

/// Resolves once `endpoint` has been out of `cluster` for the running
/// config's `drain_timeout` (never while it stays in; an endpoint that
/// comes back before the end of its drain is kept).
pub async fn until_drained(state: &ProxyState, cluster: &str, endpoint: &EndpointId) {
    loop {
        let drain = loop {
            let mut changed = pin!(state.endpoints_changed.notified());
            changed.as_mut().enable();
            let snapshot = state.snapshot.load();
            if !serving(&snapshot, cluster, endpoint) {
                break snapshot.config.drain_timeout;
            }
            changed.await;
        };
        tracing::debug!(%cluster, %endpoint, ?drain, "endpoint left: its flows drain");
        tokio::time::sleep(drain).await;
        if !serving(&state.snapshot.load(), cluster, endpoint) {
            return;
        }
    }
}
