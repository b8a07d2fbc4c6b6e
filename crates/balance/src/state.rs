//! Per-endpoint state that outlives any one endpoint set: load, health,
//! outlier ejection and counters. Keyed by endpoint identity, so a rebuilt
//! cluster carries the state of endpoints that stay.

use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use meshless_model::EndpointId;

use crate::clock::Clock;
use crate::health::{HealthConfig, OutlierConfig};
use crate::outcome::Outcome;

const UNHEALTHY: u8 = 1;
const EJECTED: u8 = 2;

/// Live state of one endpoint. All fields are atomics: the pick path only
/// loads them.
#[derive(Debug)]
pub(crate) struct EndpointState {
    pub(crate) id: EndpointId,
    /// Requests sent and not yet finished.
    pub(crate) in_flight: AtomicU32,
    /// `UNHEALTHY | EJECTED` bits; zero means available.
    flags: AtomicU8,
    requests: AtomicU64,
    failures: AtomicU64,
    latency_micros_total: AtomicU64,
    consecutive_5xx: AtomicU32,
    consecutive_gateway: AtomicU32,
    check_passes: AtomicU32,
    check_failures: AtomicU32,
    times_ejected: AtomicU32,
    /// Ejection ends at this clock time (nanoseconds); meaningful while EJECTED.
    ejected_until: AtomicU64,
    /// Whether this endpoint was ejected during the current tick interval.
    ejected_this_interval: AtomicU8,
}

impl EndpointState {
    pub(crate) fn new(id: EndpointId, healthy: bool) -> Self {
        Self {
            id,
            in_flight: AtomicU32::new(0),
            flags: AtomicU8::new(if healthy { 0 } else { UNHEALTHY }),
            requests: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            latency_micros_total: AtomicU64::new(0),
            consecutive_5xx: AtomicU32::new(0),
            consecutive_gateway: AtomicU32::new(0),
            check_passes: AtomicU32::new(0),
            check_failures: AtomicU32::new(0),
            times_ejected: AtomicU32::new(0),
            ejected_until: AtomicU64::new(0),
            ejected_this_interval: AtomicU8::new(0),
        }
    }

    /// Neither unhealthy nor ejected.
    #[inline]
    pub(crate) fn is_available(&self) -> bool {
        self.flags.load(Ordering::Relaxed) == 0
    }

    #[inline]
    pub(crate) fn load(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub(crate) fn is_healthy(&self) -> bool {
        self.flags.load(Ordering::Relaxed) & UNHEALTHY == 0
    }

    pub(crate) fn is_ejected(&self) -> bool {
        self.flags.load(Ordering::Relaxed) & EJECTED != 0
    }

    pub(crate) fn snapshot(&self) -> EndpointStats {
        EndpointStats {
            in_flight: self.load(),
            requests: self.requests.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            latency_micros_total: self.latency_micros_total.load(Ordering::Relaxed),
            healthy: self.is_healthy(),
            ejected: self.is_ejected(),
            times_ejected: self.times_ejected.load(Ordering::Relaxed),
        }
    }
}

/// A point-in-time copy of one endpoint's state, for admin pages and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointStats {
    /// Requests in flight now.
    pub in_flight: u32,
    /// Requests finished since the endpoint joined.
    pub requests: u64,
    /// Of those, 5xx or gateway failures.
    pub failures: u64,
    /// Sum of finished requests' latency, in microseconds.
    pub latency_micros_total: u64,
    /// Passing active health checks (or never checked).
    pub healthy: bool,
    /// Currently ejected by outlier detection.
    pub ejected: bool,
    /// How many times outlier detection ejected it.
    pub times_ejected: u32,
}

/// State shared by every snapshot of one cluster: survives rebuilds.
#[derive(Debug)]
pub(crate) struct ClusterShared {
    pub(crate) clock: Arc<dyn Clock>,
    /// Sum of `in_flight` over every endpoint ever in the cluster that still has requests.
    pub(crate) total_in_flight: AtomicU64,
    /// Bumped on every availability change, so cached counts know they are stale.
    pub(crate) availability_epoch: AtomicU64,
    /// Copies of the outlier thresholds, read without the lock on each failure.
    eject_after_5xx: AtomicU32,
    eject_after_gateway: AtomicU32,
    pub(crate) inner: Mutex<SharedInner>,
}

#[derive(Debug)]
pub(crate) struct SharedInner {
    /// The current members, in the current snapshot's order.
    pub(crate) members: Vec<Arc<EndpointState>>,
    pub(crate) outlier: OutlierConfig,
    pub(crate) health: HealthConfig,
}

impl ClusterShared {
    pub(crate) fn new(clock: Arc<dyn Clock>, outlier: OutlierConfig, health: HealthConfig) -> Self {
        Self {
            clock,
            total_in_flight: AtomicU64::new(0),
            availability_epoch: AtomicU64::new(0),
            eject_after_5xx: AtomicU32::new(outlier.consecutive_5xx),
            eject_after_gateway: AtomicU32::new(outlier.consecutive_gateway_errors),
            inner: Mutex::new(SharedInner {
                members: Vec::new(),
                outlier,
                health,
            }),
        }
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, SharedInner> {
        // The guarded data stays consistent across a panic (plain replacements).
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Replaces the outlier and health settings (on a cluster rebuild).
    pub(crate) fn configure(
        &self,
        inner: &mut SharedInner,
        outlier: OutlierConfig,
        health: HealthConfig,
    ) {
        inner.outlier = outlier;
        inner.health = health;
        self.eject_after_5xx
            .store(outlier.consecutive_5xx, Ordering::Relaxed);
        self.eject_after_gateway
            .store(outlier.consecutive_gateway_errors, Ordering::Relaxed);
    }

    fn set_flag(&self, state: &EndpointState, flag: u8, on: bool) {
        let old = if on {
            state.flags.fetch_or(flag, Ordering::Relaxed)
        } else {
            state.flags.fetch_and(!flag, Ordering::Relaxed)
        };
        if (old & flag != 0) != on {
            self.availability_epoch.fetch_add(1, Ordering::Release);
        }
    }

    /// Records a request's outcome and ejects the endpoint if it crossed a
    /// threshold and the ejection limits allow it.
    pub(crate) fn record(&self, state: &EndpointState, outcome: Outcome, latency_nanos: u64) {
        if outcome == Outcome::Cancelled {
            return;
        }
        state.requests.fetch_add(1, Ordering::Relaxed);
        state
            .latency_micros_total
            .fetch_add(latency_nanos / 1_000, Ordering::Relaxed);
        if outcome.is_success() {
            state.consecutive_5xx.store(0, Ordering::Relaxed);
            state.consecutive_gateway.store(0, Ordering::Relaxed);
            return;
        }
        state.failures.fetch_add(1, Ordering::Relaxed);
        let n5 = state.consecutive_5xx.fetch_add(1, Ordering::Relaxed) + 1;
        let ngw = if outcome.is_gateway_error() {
            state.consecutive_gateway.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            state.consecutive_gateway.store(0, Ordering::Relaxed);
            0
        };
        let after_5xx = self.eject_after_5xx.load(Ordering::Relaxed);
        let after_gateway = self.eject_after_gateway.load(Ordering::Relaxed);
        let tripped =
            (after_5xx > 0 && n5 >= after_5xx) || (after_gateway > 0 && ngw >= after_gateway);
        if tripped && !state.is_ejected() {
            let inner = self.lock();
            self.try_eject(&inner, state);
        }
    }

    /// Ejects `state` unless that would exceed `max_ejection_percent` or leave
    /// the cluster without an available endpoint. Caller holds the lock.
    fn try_eject(&self, inner: &SharedInner, state: &EndpointState) {
        state.consecutive_5xx.store(0, Ordering::Relaxed);
        state.consecutive_gateway.store(0, Ordering::Relaxed);
        let members = &inner.members;
        let n = members.len();
        let ejected = members.iter().filter(|m| m.is_ejected()).count();
        let others_available = members
            .iter()
            .filter(|m| !std::ptr::eq(m.as_ref(), state) && m.is_available())
            .count();
        let pct_allowed = n * usize::from(inner.outlier.max_ejection_percent.min(100)) / 100;
        let allowed = pct_allowed.max(1).min(n.saturating_sub(1));
        if ejected + 1 > allowed || others_available == 0 {
            return;
        }
        let times = state.times_ejected.fetch_add(1, Ordering::Relaxed) + 1;
        let until = self
            .clock
            .now_nanos()
            .saturating_add(inner.outlier.ejection_nanos(times));
        state.ejected_until.store(until, Ordering::Relaxed);
        state.ejected_this_interval.store(1, Ordering::Relaxed);
        self.set_flag(state, EJECTED, true);
    }

    /// Returns ejected endpoints whose time is up, and lowers the ejection
    /// multiplier of endpoints that stayed in for a whole interval (Envoy).
    pub(crate) fn tick(&self) {
        let now = self.clock.now_nanos();
        let inner = self.lock();
        for m in &inner.members {
            if m.is_ejected() {
                if now >= m.ejected_until.load(Ordering::Relaxed) {
                    self.set_flag(m, EJECTED, false);
                }
            } else if m.ejected_this_interval.swap(0, Ordering::Relaxed) == 0 {
                let _ = m
                    .times_ejected
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| t.checked_sub(1));
            }
        }
    }

    /// Applies one active health-check result with rise/fall thresholds.
    pub(crate) fn record_check(&self, state: &EndpointState, passed: bool) {
        let health = self.lock().health;
        if passed {
            state.check_failures.store(0, Ordering::Relaxed);
            let passes = state.check_passes.fetch_add(1, Ordering::Relaxed) + 1;
            if !state.is_healthy() && passes >= health.rise {
                self.set_flag(state, UNHEALTHY, false);
            }
        } else {
            state.check_passes.store(0, Ordering::Relaxed);
            let fails = state.check_failures.fetch_add(1, Ordering::Relaxed) + 1;
            if state.is_healthy() && fails >= health.fall {
                self.set_flag(state, UNHEALTHY, true);
            }
        }
    }
}

/// Load guard: one request in flight to one endpoint.
///
/// Taken by [`crate::Cluster::pick`]; dropping it ends the request, lowers
/// the endpoint's load and records the outcome set with
/// [`InFlight::set_outcome`] (default [`Outcome::Cancelled`], which counts
/// for nothing) and the latency since the pick.
#[derive(Debug)]
pub struct InFlight {
    state: Arc<EndpointState>,
    shared: Arc<ClusterShared>,
    index: usize,
    started_nanos: u64,
    outcome: Outcome,
}

impl InFlight {
    pub(crate) fn start(
        state: &Arc<EndpointState>,
        shared: &Arc<ClusterShared>,
        index: usize,
    ) -> Self {
        state.in_flight.fetch_add(1, Ordering::Relaxed);
        shared.total_in_flight.fetch_add(1, Ordering::Relaxed);
        Self {
            state: Arc::clone(state),
            shared: Arc::clone(shared),
            index,
            started_nanos: shared.clock.now_nanos(),
            outcome: Outcome::Cancelled,
        }
    }

    /// Position of the endpoint in the cluster snapshot it was picked from.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Identity of the endpoint.
    pub fn endpoint_id(&self) -> &EndpointId {
        &self.state.id
    }

    /// Sets the outcome recorded when the guard drops.
    pub fn set_outcome(&mut self, outcome: Outcome) {
        self.outcome = outcome;
    }

    /// Ends the request now with `outcome`.
    pub fn finish(mut self, outcome: Outcome) {
        self.outcome = outcome;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.shared.total_in_flight.fetch_sub(1, Ordering::Relaxed);
        let latency = self
            .shared
            .clock
            .now_nanos()
            .saturating_sub(self.started_nanos);
        self.shared.record(&self.state, self.outcome, latency);
    }
}
