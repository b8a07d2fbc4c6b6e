//! Connection tracking for endpoints that leave: a flow waits on its
//! endpoint's entry in [`crate::flows::Flows`] and ends once the endpoint
//! has been out of its cluster for `drain_timeout`.

use std::sync::atomic::Ordering;

use meshless_model::EndpointId;

use crate::flows::Presence;
pub use crate::flows::serving;
use crate::state::ProxyState;

/// Resolves once `endpoint` has been out of `cluster` for the running
/// config's `drain_timeout`, counted from when it left: a reload that
/// shortens the timeout shortens drains under way, and an endpoint that
/// comes back before the end of its drain is kept. Never while it stays in.
pub async fn until_drained(state: &ProxyState, cluster: &str, endpoint: &EndpointId) {
    let tracked = state.flows.track(&state.snapshot, cluster, endpoint);
    let mut presence = tracked.subscribe();
    loop {
        let now = *presence.borrow_and_update();
        match now {
            Presence::Serving => {
                // The sender lives in `tracked`, held here: never closed.
                let _ = presence.changed().await;
            }
            Presence::Left {
                since,
                drain_timeout,
            } => {
                tokio::select! {
                    () = tokio::time::sleep_until(crate::limits::deadline_after(since, drain_timeout)) => return,
                    _ = presence.changed() => {}
                }
            }
        }
        state.flows.wakeups.fetch_add(1, Ordering::Relaxed);
    }
}
