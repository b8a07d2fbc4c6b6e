//! Stage 2, admit: the cluster's breaker slots as RAII guards. A slot is
//! taken atomically below its limit and given back when dropped, so a
//! request dropped at any `.await` (client gone, h2 `RST_STREAM`, timeout)
//! leaves every gauge as it found it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::metrics::OverflowLabels;
use crate::request::respond::LocalReply;
use crate::snapshot::UpstreamCluster;
use crate::state::ProxyState;
use crate::upstream::ClusterCounters;

/// Which gauge of [`ClusterCounters`] a slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gauge {
    /// `active_requests`: until the response body ends (`max_requests`).
    Active,
    /// `pending`: sent, waiting for response headers (`max_pending`).
    Pending,
    /// `active_retries`: a retry attempt under way (the retry budget).
    Retries,
    /// `queued`: held for activation (`max_queued`).
    Queued,
    /// `forwarded`: sent to a peer proxy, until the response body ends.
    Forwarded,
    /// `releasing`: released from an activation hold, until its response
    /// headers (`release_concurrency`).
    Releasing,
    /// `released`: of `releasing`, a request that was held.
    Released,
}

impl Gauge {
    fn of(self, c: &ClusterCounters) -> &AtomicU64 {
        match self {
            Gauge::Active => &c.active_requests,
            Gauge::Pending => &c.pending,
            Gauge::Retries => &c.active_retries,
            Gauge::Queued => &c.queued,
            Gauge::Forwarded => &c.forwarded,
            Gauge::Releasing => &c.releasing,
            Gauge::Released => &c.released,
        }
    }
}

/// One unit of a cluster gauge, lowered when dropped.
#[derive(Debug)]
pub struct Slot {
    counters: Arc<ClusterCounters>,
    gauge: Gauge,
}

impl Slot {
    /// Raises `gauge` if it is below `limit`; `None` (nothing raised) when
    /// it is not. Atomic: concurrent callers never take more than `limit`.
    pub fn acquire(counters: &Arc<ClusterCounters>, gauge: Gauge, limit: u64) -> Option<Self> {
        gauge
            .of(counters)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()
            .map(|_| Self {
                counters: Arc::clone(counters),
                gauge,
            })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gauge.of(&self.counters).fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counts a request shed by `limit` (`max_requests`, `max_pending`,
/// `max_connections`, `retry_budget`, `max_queued`).
pub fn overflow(state: &ProxyState, cluster: &UpstreamCluster, limit: &str) {
    state
        .metrics
        .overflows
        .get_or_create(&OverflowLabels {
            cluster: cluster.name.to_string(),
            limit: limit.to_owned(),
        })
        .inc();
}

fn shed(state: &ProxyState, cluster: &UpstreamCluster, limit: &'static str) -> LocalReply {
    overflow(state, cluster, limit);
    LocalReply::overflow(limit)
}

/// Admits a request to `cluster`: a `max_requests` slot, held until the
/// response body ends.
pub fn admit(state: &ProxyState, cluster: &UpstreamCluster) -> Result<Slot, LocalReply> {
    let limit = u64::from(cluster.config.circuit_breakers.max_requests);
    Slot::acquire(&cluster.counters, Gauge::Active, limit)
        .ok_or_else(|| shed(state, cluster, "max_requests"))
}

/// A `max_pending` slot, held while an attempt waits for response headers.
pub fn pending(state: &ProxyState, cluster: &UpstreamCluster) -> Result<Slot, LocalReply> {
    let limit = u64::from(cluster.config.circuit_breakers.max_pending);
    Slot::acquire(&cluster.counters, Gauge::Pending, limit)
        .ok_or_else(|| shed(state, cluster, "max_pending"))
}

/// A retry-budget slot: retries in flight stay under `budget_percent` of
/// active requests, with `min_concurrent` always allowed (Envoy's retry
/// budget). `None` (and counted as `retry_budget`) when spent.
pub fn retry(state: &ProxyState, cluster: &UpstreamCluster) -> Option<Slot> {
    let r = &cluster.config.retries;
    let active = cluster.counters.active_requests.load(Ordering::Acquire);
    let budget = (active * u64::from(r.budget_percent) / 100).max(u64::from(r.min_concurrent));
    let slot = Slot::acquire(&cluster.counters, Gauge::Retries, budget);
    match &slot {
        Some(_) => {
            state
                .metrics
                .retries
                .get_or_create(&crate::metrics::ClusterLabels {
                    cluster: cluster.name.to_string(),
                })
                .inc();
        }
        None => overflow(state, cluster, "retry_budget"),
    }
    slot
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_given_back_when_dropped() {
        let c = Arc::new(ClusterCounters::default());
        let a = Slot::acquire(&c, Gauge::Pending, 2).expect("first");
        let b = Slot::acquire(&c, Gauge::Pending, 2).expect("second");
        assert!(Slot::acquire(&c, Gauge::Pending, 2).is_none());
        assert_eq!(c.pending.load(Ordering::Relaxed), 2);
        drop(a);
        let again = Slot::acquire(&c, Gauge::Pending, 2).expect("freed");
        drop((b, again));
        assert_eq!(c.pending.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_refused_slot_raises_nothing() {
        let c = Arc::new(ClusterCounters::default());
        assert!(Slot::acquire(&c, Gauge::Active, 0).is_none());
        assert_eq!(c.active_requests.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn concurrent_takers_never_exceed_the_limit() {
        let c = Arc::new(ClusterCounters::default());
        let taken: Vec<Vec<Slot>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        (0..1000)
                            .filter_map(|_| Slot::acquire(&c, Gauge::Queued, 10))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        assert_eq!(taken.iter().map(Vec::len).sum::<usize>(), 10);
        drop(taken);
        assert_eq!(c.queued.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_dropped_future_gives_its_slot_back() {
        let c = Arc::new(ClusterCounters::default());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let held = {
                let c = Arc::clone(&c);
                async move {
                    let _slot = Slot::acquire(&c, Gauge::Pending, 1);
                    std::future::pending::<()>().await;
                }
            };
            let _ = tokio::time::timeout(std::time::Duration::from_millis(1), held).await;
        });
        assert_eq!(c.pending.load(Ordering::Relaxed), 0);
    }
}
