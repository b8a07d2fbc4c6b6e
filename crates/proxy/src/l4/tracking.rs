//! Connection tracking for endpoints that leave: a flow's endpoint that is
//! no longer in its cluster (removed, or terminating while others are
//! ready) gets no new flows, and its open flows are closed once
//! `drain_timeout` has passed since it left. Woken by every change of the
//! running snapshot (`ProxyState::endpoints_changed`: reloads and
//! control-plane updates).

use std::pin::pin;

use tokio::time::Instant;

use meshless_model::EndpointId;

use crate::snapshot::Snapshot;
use crate::state::ProxyState;

/// Whether `endpoint` is still one that `cluster` sends new flows to: it is
/// in the cluster's table, which holds the routable endpoints only
/// (`meshless_model::routable_endpoints`: the ready ones, or, while none is
/// ready, the serving and terminating ones). So a terminating endpoint
/// drains while others are ready, and keeps its flows while it is all the
/// service has (a rollout whose new pods are not ready yet).
pub fn serving(snapshot: &Snapshot, cluster: &str, endpoint: &EndpointId) -> bool {
    snapshot
        .clusters
        .get(cluster)
        .is_some_and(|c| c.lb.endpoints().iter().any(|e| e.id == *endpoint))
}

/// Resolves once `endpoint` has been out of `cluster` for the running
/// config's `drain_timeout`, counted from when it left: a reload that
/// shortens the timeout shortens drains under way, and an endpoint that
/// comes back before the end of its drain is kept. Never while it stays in.
pub async fn until_drained(state: &ProxyState, cluster: &str, endpoint: &EndpointId) {
    let mut left: Option<Instant> = None;
    loop {
        let mut changed = pin!(state.endpoints_changed.notified());
        changed.as_mut().enable();
        let snapshot = state.snapshot.load_full();
        if serving(&snapshot, cluster, endpoint) {
            left = None;
            changed.await;
            continue;
        }
        let since = *left.get_or_insert_with(|| {
            tracing::debug!(%cluster, %endpoint, "endpoint left: its flows drain");
            Instant::now()
        });
        let deadline = since + snapshot.config.drain_timeout;
        tokio::select! {
            () = tokio::time::sleep_until(deadline) => return,
            () = changed => {}
        }
    }
}
