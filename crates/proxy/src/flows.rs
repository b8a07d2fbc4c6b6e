//! The endpoints that open L4 flows wait on: a flow's endpoint that is
//! no longer in its cluster gets no new flows, and its open flows close
//! once `drain_timeout` has passed since it left
//! ([`crate::l4::tracking::until_drained`]).
//!
//! Flows wait on their endpoint's entry in [`Flows`], not on every change:
//! after each swap of the running snapshot (reloads, control-plane
//! updates) [`Flows::update`] compares each tracked endpoint with the new
//! snapshot (O(E + T): E endpoints of the clusters concerned, T endpoints
//! with open flows) and wakes the flows of those whose presence changed
//! only (left, came back, or the drain timeout of one gone changed). A
//! delta that touches endpoint B wakes no flow of endpoint A.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::watch;
use tokio::time::Instant;

use meshless_model::EndpointId;

use crate::snapshot::Snapshot;

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

/// Where a tracked endpoint stands for its flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// In its cluster: its flows stay.
    Serving,
    /// Out since `since`: its flows close at `since + drain_timeout`.
    Left {
        since: Instant,
        drain_timeout: Duration,
    },
}

impl Presence {
    /// The presence in `snapshot`, given the one before (`None`: untracked).
    fn next(before: Option<Presence>, in_cluster: bool, snapshot: &Snapshot) -> Presence {
        if in_cluster {
            return Presence::Serving;
        }
        let since = match before {
            Some(Presence::Left { since, .. }) => since,
            _ => Instant::now(),
        };
        Presence::Left {
            since,
            drain_timeout: snapshot.config.drain_timeout,
        }
    }
}

/// One endpoint's open flows share it; they wait for its presence to change.
#[derive(Debug)]
pub struct Tracked {
    presence: watch::Sender<Presence>,
}

impl Tracked {
    /// Follows the endpoint's presence.
    pub fn subscribe(&self) -> watch::Receiver<Presence> {
        self.presence.subscribe()
    }
}

type Key = (Arc<str>, EndpointId);

/// The endpoints with open flows, by cluster and endpoint id.
#[derive(Debug, Default)]
pub struct Flows {
    tracked: Mutex<HashMap<Key, Weak<Tracked>>>,
    /// Flows woken by a change of their endpoint's presence, ever.
    pub wakeups: AtomicU64,
}

impl Flows {
    /// The entry of `endpoint` in `cluster` for a flow to hold while open;
    /// its presence is read from the running snapshot under the lock that
    /// [`Flows::update`] takes, so no swap between them is missed.
    pub fn track(
        &self,
        running: &ArcSwap<Snapshot>,
        cluster: &str,
        endpoint: &EndpointId,
    ) -> Arc<Tracked> {
        let mut tracked = self.tracked.lock().unwrap_or_else(PoisonError::into_inner);
        let key: Key = (Arc::from(cluster), endpoint.clone());
        if let Some(t) = tracked.get(&key).and_then(Weak::upgrade) {
            return t;
        }
        let snapshot = running.load();
        let presence = Presence::next(None, serving(&snapshot, cluster, endpoint), &snapshot);
        let t = Arc::new(Tracked {
            presence: watch::Sender::new(presence),
        });
        tracked.insert(key, Arc::downgrade(&t));
        t
    }

    /// After a swap of the running snapshot: wakes the flows of the
    /// tracked endpoints whose presence changed, and only those.
    pub fn update(&self, running: &ArcSwap<Snapshot>) {
        let mut tracked = self.tracked.lock().unwrap_or_else(PoisonError::into_inner);
        tracked.retain(|_, t| t.strong_count() > 0);
        let snapshot = running.load();
        let mut tables: HashMap<&str, HashSet<&EndpointId>> = HashMap::new();
        for ((cluster, endpoint), t) in tracked.iter() {
            let Some(t) = t.upgrade() else { continue };
            let ids = tables.entry(cluster).or_insert_with(|| {
                snapshot
                    .clusters
                    .get(&**cluster)
                    .map_or_else(HashSet::new, |c| {
                        c.lb.endpoints().iter().map(|e| &e.id).collect()
                    })
            });
            let before = *t.presence.borrow();
            let now = Presence::next(Some(before), ids.contains(endpoint), &snapshot);
            if now != before {
                tracing::debug!(%cluster, %endpoint, ?now, "endpoint of open flows changed");
                t.presence.send_replace(now);
            }
        }
    }

    /// Flows woken by a change of their endpoint's presence so far.
    pub fn wakeups(&self) -> u64 {
        self.wakeups.load(Ordering::Relaxed)
    }

    /// Endpoints with open flows now.
    pub fn tracked(&self) -> usize {
        let tracked = self.tracked.lock().unwrap_or_else(PoisonError::into_inner);
        tracked.values().filter(|t| t.strong_count() > 0).count()
    }
}
