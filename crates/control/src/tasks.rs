//! Background work of the control plane: TTL expiry and compaction of
//! quiet services once a second, and, with a batch period, one
//! reconcile-and-publish per period.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::state::PlaneState;

/// How often TTLs are checked and quiet services compacted.
pub const HOUSEKEEPING_PERIOD: Duration = Duration::from_secs(1);

/// One housekeeping round at `now`: removes endpoints whose TTL ran out
/// (a grouped write, published as any write is) and compacts services
/// quiet for `compact_after`.
pub async fn housekeep(state: &Arc<PlaneState>, now: Instant) {
    match state.write_grouped(move |r| r.expire(now)).await {
        Ok((0, _)) => {}
        Ok((n, _)) => {
            state.metrics.expired.inc_by(n as u64);
            tracing::info!(expired = n, "endpoints removed: TTL ran out");
        }
        Err(e) => tracing::error!(error = %e, "TTL expiry failed"),
    }
    // Compaction writes the store (an fsync) under the registry lock: off
    // the executor's threads.
    state
        .with_registry_offloaded(move |state, reg| {
            let (deltas, stored) = reg.compact_quiet(state.config.compact_after);
            for d in deltas {
                state.distributor.publish(&d, now);
            }
            if let Err(e) = stored {
                tracing::error!(error = %e, "compaction failed");
            }
        })
        .await;
}

/// [`housekeep`] every [`HOUSEKEEPING_PERIOD`] until `stop` changes.
pub async fn housekeeping(state: Arc<PlaneState>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(HOUSEKEEPING_PERIOD);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        housekeep(&state, Instant::now()).await;
    }
}

/// With a batch period: reconcile and publish what changed, once per period.
pub async fn batches(state: Arc<PlaneState>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(state.config.batch_period);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        // A reconcile writes slices to the store: off the executor.
        state
            .with_registry_offloaded(|state, reg| {
                if let Err(e) = state.flush(reg, Instant::now()) {
                    tracing::error!(error = %e, "reconcile failed");
                }
            })
            .await;
    }
}
