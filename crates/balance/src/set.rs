//! An immutable snapshot of a cluster's endpoints, as the algorithms see it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

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
/// availability epoch moves. Races can only make a reader see a value one
/// change old, which balancing tolerates.
#[derive(Debug)]
pub(crate) struct AvailabilityCache {
    epoch: AtomicU64,
    count: AtomicU64,
    weight: AtomicU64,
}

impl AvailabilityCache {
    pub(crate) fn new() -> Self {
        Self {
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
        if self.epoch.load(Ordering::Acquire) == now {
            return Availability {
                count: self.count.load(Ordering::Relaxed),
                weight: self.weight.load(Ordering::Relaxed),
            };
        }
        let (mut count, mut weight) = (0u64, 0u64);
        for i in members {
            let i = i as usize;
            if set.is_available(i) {
                count += 1;
                weight += u64::from(set.weight(i));
            }
        }
        self.count.store(count, Ordering::Relaxed);
        self.weight.store(weight, Ordering::Relaxed);
        self.epoch.store(now, Ordering::Release);
        Availability { count, weight }
    }
}
