//! An immutable snapshot of a cluster's endpoints, as the algorithms see it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use meshless_model::Endpoint;

use crate::state::{ClusterShared, EndpointState};

/// The endpoints of one cluster snapshot, with their live state.
///
/// Invariant: `endpoints`, `states` and `weights` have the same length and
/// index `i` of each describes the same endpoint.
#[derive(Debug)]
pub struct EndpointSet {
    pub(crate) endpoints: Vec<Endpoint>,
    pub(crate) states: Vec<Arc<EndpointState>>,
    pub(crate) weights: Vec<u32>,
    /// Sum of `weights`.
    pub(crate) total_weight: u64,
    pub(crate) shared: Arc<ClusterShared>,
    /// Availability of the whole set, cached per availability epoch.
    pub(crate) availability: AvailabilityCache,
}

impl EndpointSet {
    /// Number of endpoints.
    pub fn len(&self) -> usize {
        self.endpoints.len()
    }

    /// True when the set has no endpoint.
    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }

    /// The endpoint at `index`.
    pub fn endpoint(&self, index: usize) -> Option<&Endpoint> {
        self.endpoints.get(index)
    }

    /// Requests in flight at `index`.
    #[inline]
    pub fn load(&self, index: usize) -> u32 {
        self.states[index].load()
    }

    /// Weight at `index`.
    #[inline]
    pub fn weight(&self, index: usize) -> u32 {
        self.weights[index]
    }

    /// Neither unhealthy nor ejected.
    #[inline]
    pub fn is_available(&self, index: usize) -> bool {
        self.states[index].is_available()
    }

    /// Requests in flight across the cluster (including endpoints that left
    /// but still finish requests).
    pub fn total_in_flight(&self) -> u64 {
        self.shared.total_in_flight.load(Ordering::Relaxed)
    }

    /// Requests in flight on the published snapshot's available endpoints:
    /// the total bounded load divides among them. Requests still running
    /// on ejected, unhealthy or removed endpoints are not in it.
    pub fn eligible_in_flight(&self) -> u64 {
        self.shared.eligible_in_flight()
    }

    /// `(count, weight)` of the available endpoints, for tests and admin.
    pub fn available(&self) -> (u64, u64) {
        let a = self.available_all();
        (a.count, a.weight)
    }

    /// `(count, weight)` of the available endpoints among all.
    pub(crate) fn available_all(&self) -> Availability {
        self.availability.get(self, 0..self.len() as u32)
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.shared.availability_epoch.load(Ordering::Acquire)
    }
}

/// Count and total weight of available endpoints of some member list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Availability {
    pub(crate) count: u64,
    pub(crate) weight: u64,
}

/// A lock-free cache of [`Availability`], recomputed when the cluster's
/// availability epoch moves.
///
/// A sequence lock keeps the three words (epoch, count, weight) consistent:
/// a writer makes `seq` odd, stores, then makes it even again; a reader
/// accepts the words only if `seq` was the same even value before and after
/// reading them, else it computes the answer itself. So a reader never sees
/// the count of one epoch with the weight of another. A writer that finds
/// the lock taken skips caching (no waiting on the pick path).
#[derive(Debug)]
pub(crate) struct AvailabilityCache {
    seq: AtomicU64,
    epoch: AtomicU64,
    count: AtomicU64,
    weight: AtomicU64,
}

impl AvailabilityCache {
    pub(crate) fn new() -> Self {
        Self {
            seq: AtomicU64::new(0),
            epoch: AtomicU64::new(u64::MAX),
            count: AtomicU64::new(0),
            weight: AtomicU64::new(0),
        }
    }

    pub(crate) fn get(
        &self,
        set: &EndpointSet,
        members: impl IntoIterator<Item = u32>,
    ) -> Availability {
        let now = set.epoch();
        if let Some(a) = self.read(now) {
            return a;
        }
        let (mut count, mut weight) = (0u64, 0u64);
        for i in members {
            let i = i as usize;
            if set.is_available(i) {
                count += 1;
                weight += u64::from(set.weight(i));
            }
        }
        // Another availability change since `now` makes this value stale:
        // it is still returned (it was true at `now`) but cached under `now`.
        let a = Availability { count, weight };
        self.write(now, a);
        a
    }

    fn read(&self, epoch: u64) -> Option<Availability> {
        let s1 = self.seq.load(Ordering::Acquire);
        if s1 & 1 == 1 {
            return None;
        }
        let e = self.epoch.load(Ordering::Relaxed);
        let count = self.count.load(Ordering::Relaxed);
        let weight = self.weight.load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        let s2 = self.seq.load(Ordering::Relaxed);
        (s1 == s2 && e == epoch).then_some(Availability { count, weight })
    }

    fn write(&self, epoch: u64, a: Availability) {
        let s = self.seq.load(Ordering::Relaxed);
        if s & 1 == 1
            || self
                .seq
                .compare_exchange(s, s + 1, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        fence(Ordering::Release);
        self.epoch.store(epoch, Ordering::Relaxed);
        self.count.store(a.count, Ordering::Relaxed);
        self.weight.store(a.weight, Ordering::Relaxed);
        self.seq.store(s + 2, Ordering::Release);
    }
}
