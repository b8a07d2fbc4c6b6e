//! Per-endpoint state that outlives any one endpoint set: load, health,
//! outlier ejection and counters. Keyed by endpoint identity, so a rebuilt
//! cluster carries the state of endpoints that stay.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use std::net::IpAddr;

use meshless_model::{Endpoint, EndpointId};

use crate::clock::Clock;
use crate::health::{HealthConfig, OutlierConfig};
use crate::outcome::Outcome;

/// Flag bits, stored above the 32-bit in-flight count in one atomic word.
const UNHEALTHY: u64 = 1 << 32;
const EJECTED: u64 = 2 << 32;
/// Not a member of the published snapshot (new in an unpublished build, or
/// removed): its requests do not count in the eligible total.
const DETACHED: u64 = 4 << 32;
const LOAD_MASK: u64 = 0xFFFF_FFFF;
const FLAG_MASK: u64 = !LOAD_MASK;

#[inline]
fn load_of(word: u64) -> u32 {
    (word & LOAD_MASK) as u32
}

#[inline]
fn available(word: u64) -> bool {
    word & (UNHEALTHY | EJECTED) == 0
}

/// Counted in [`ClusterShared::eligible_in_flight`]: available and published.
#[inline]
fn counted(word: u64) -> bool {
    word & FLAG_MASK == 0
}

/// Where an endpoint is reached: its addresses (sorted, without
/// duplicates, so a reordering is no move) and port. An id whose location
/// changes is a new host (Envoy keys hosts by address): it gets new state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Location {
    addresses: Vec<IpAddr>,
    port: u16,
}

impl Location {
    pub(crate) fn of(e: &Endpoint) -> Self {
        let mut addresses = e.addresses.clone();
        addresses.sort_unstable();
        addresses.dedup();
        Self {
            addresses,
            port: e.port,
        }
    }
}

/// Live state of one endpoint. All fields are atomics: the pick path only
/// loads them.
///
/// Invariant: in-flight count and flags live in one word (`word`), so every
/// change of either knows, atomically, whether the endpoint's requests count
/// in the cluster's eligible total and by how much that total must move.
#[derive(Debug)]
pub(crate) struct EndpointState {
    pub(crate) id: EndpointId,
    /// Where this state's requests go; fixed for the state's life.
    pub(crate) location: Location,
    /// Bits 0..32: requests sent and not yet finished; above: flags.
    word: AtomicU64,
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
    /// A new endpoint, detached until a snapshot holding it is published.
    pub(crate) fn new(id: EndpointId, location: Location, healthy: bool) -> Self {
        Self {
            id,
            location,
            word: AtomicU64::new(DETACHED | if healthy { 0 } else { UNHEALTHY }),
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
        available(self.word.load(Ordering::Relaxed))
    }

    #[inline]
    pub(crate) fn load(&self) -> u32 {
        load_of(self.word.load(Ordering::Relaxed))
    }

    pub(crate) fn is_healthy(&self) -> bool {
        self.word.load(Ordering::Relaxed) & UNHEALTHY == 0
    }

    pub(crate) fn is_ejected(&self) -> bool {
        self.word.load(Ordering::Relaxed) & EJECTED != 0
    }

    /// Starts one request unconditionally.
    fn begin(&self, shared: &ClusterShared) {
        let old = self.word.fetch_add(1, Ordering::AcqRel);
        shared.total_in_flight.fetch_add(1, Ordering::Relaxed);
        if counted(old) {
            shared.eligible_in_flight.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Starts one request only if the endpoint is available and
    /// `fits(load before)` holds, atomically (no other pick can slip in
    /// between the check and the increment).
    pub(crate) fn try_reserve(&self, shared: &ClusterShared, fits: impl Fn(u32) -> bool) -> bool {
        let r = self
            .word
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (available(w) && load_of(w) < u32::MAX && fits(load_of(w))).then_some(w + 1)
            });
        match r {
            Ok(old) => {
                shared.total_in_flight.fetch_add(1, Ordering::Relaxed);
                if counted(old) {
                    shared.eligible_in_flight.fetch_add(1, Ordering::Relaxed);
                }
                true
            }
            Err(_) => false,
        }
    }

    /// Ends one request.
    fn end(&self, shared: &ClusterShared) {
        let old = self.word.fetch_sub(1, Ordering::AcqRel);
        shared.total_in_flight.fetch_sub(1, Ordering::Relaxed);
        if counted(old) {
            shared.eligible_in_flight.fetch_sub(1, Ordering::Relaxed);
        }
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
    /// Sum of `in_flight` over the published members that are available:
    /// the `T` of bounded load. Each change is derived from one atomic
    /// change of an endpoint's word, so the sum never drifts; it may be
    /// transiently off by the few changes in progress (read it clamped at 0).
    pub(crate) eligible_in_flight: AtomicI64,
    /// Bumped on every availability change, so cached counts know they are stale.
    pub(crate) availability_epoch: AtomicU64,
    /// Generation of the last published snapshot.
    published: AtomicU64,
    /// Source of snapshot generations.
    generations: AtomicU64,
    /// Copies of the outlier thresholds, read without the lock on each failure.
    eject_after_5xx: AtomicU32,
    eject_after_gateway: AtomicU32,
    pub(crate) inner: Mutex<SharedInner>,
}

#[derive(Debug)]
pub(crate) struct SharedInner {
    /// The members of the published snapshot, in its order.
    pub(crate) members: Vec<Arc<EndpointState>>,
    /// Endpoints that left the cluster while ejected (not ready for a
    /// while, then back): a returning endpoint gets its state back, so a
    /// flap does not forget an ejection. Dropped once the ejection is over.
    pub(crate) departed: HashMap<EndpointId, Arc<EndpointState>>,
    pub(crate) outlier: OutlierConfig,
    pub(crate) health: HealthConfig,
}

impl ClusterShared {
    pub(crate) fn new(clock: Arc<dyn Clock>, outlier: OutlierConfig, health: HealthConfig) -> Self {
        Self {
            clock,
            total_in_flight: AtomicU64::new(0),
            eligible_in_flight: AtomicI64::new(0),
            availability_epoch: AtomicU64::new(0),
            published: AtomicU64::new(0),
            generations: AtomicU64::new(0),
            eject_after_5xx: AtomicU32::new(outlier.consecutive_5xx),
            eject_after_gateway: AtomicU32::new(outlier.consecutive_gateway_errors),
            inner: Mutex::new(SharedInner {
                members: Vec::new(),
                departed: HashMap::new(),
                outlier,
                health,
            }),
        }
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, SharedInner> {
        // The guarded data stays consistent across a panic (plain replacements).
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The eligible total `T`, clamped at zero.
    #[inline]
    pub(crate) fn eligible_in_flight(&self) -> u64 {
        self.eligible_in_flight.load(Ordering::Relaxed).max(0) as u64
    }

    /// A generation for a new snapshot, newer than every earlier one.
    pub(crate) fn next_generation(&self) -> u64 {
        self.generations.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Whether a snapshot of generation `g` (or a newer one) is published.
    #[inline]
    pub(crate) fn is_published(&self, g: u64) -> bool {
        self.published.load(Ordering::Acquire) >= g
    }

    /// The live states a build may reuse for `ids` (ids its previous
    /// snapshot lacks): a member of the published snapshot (which an
    /// unpublished snapshot built in between may lack), else one that left
    /// while ejected (ejection remembered). One lock; reads only.
    pub(crate) fn remembered<'i>(
        &self,
        ids: impl IntoIterator<Item = &'i EndpointId>,
    ) -> HashMap<EndpointId, Arc<EndpointState>> {
        let wanted: HashSet<&EndpointId> = ids.into_iter().collect();
        if wanted.is_empty() {
            return HashMap::new();
        }
        let inner = self.lock();
        let published = inner.members.iter().filter(|m| wanted.contains(&m.id));
        let departed = inner.departed.values().filter(|d| wanted.contains(&d.id));
        // A published member's id is never departed (publish removes it).
        published
            .chain(departed)
            .map(|s| (s.id.clone(), Arc::clone(s)))
            .collect()
    }

    /// Makes the snapshot of generation `g` with `members` and settings the
    /// current one, unless a newer one already is: members that left are
    /// detached (their requests leave the eligible total), new ones attached.
    pub(crate) fn publish(
        &self,
        g: u64,
        members: &[Arc<EndpointState>],
        outlier: OutlierConfig,
        health: HealthConfig,
    ) {
        let mut inner = self.lock();
        if self.published.load(Ordering::Acquire) >= g {
            return;
        }
        let staying: HashSet<*const EndpointState> = members.iter().map(Arc::as_ptr).collect();
        for old in std::mem::take(&mut inner.members) {
            if !staying.contains(&Arc::as_ptr(&old)) {
                self.set_flag(&old, DETACHED, true);
                if old.is_ejected() {
                    inner.departed.insert(old.id.clone(), old);
                }
            }
        }
        for m in members {
            self.set_flag(m, DETACHED, false);
            inner.departed.remove(&m.id);
        }
        inner.members = members.to_vec();
        if !health.active {
            // No check left to clear a mark: every endpoint is healthy
            // (Envoy drops the active-check flags with the checker).
            for m in &inner.members {
                m.check_passes.store(0, Ordering::Relaxed);
                m.check_failures.store(0, Ordering::Relaxed);
                self.set_flag(m, UNHEALTHY, false);
            }
        }
        if outlier.consecutive_5xx == 0 && outlier.consecutive_gateway_errors == 0 {
            // Detection off: nothing stays ejected (Envoy un-ejects every
            // host when outlier detection goes away).
            for m in inner.members.iter().chain(inner.departed.values()) {
                m.times_ejected.store(0, Ordering::Relaxed);
                m.ejected_until.store(0, Ordering::Relaxed);
                self.set_flag(m, EJECTED, false);
            }
            inner.departed.clear();
        }
        inner.outlier = outlier;
        inner.health = health;
        self.eject_after_5xx
            .store(outlier.consecutive_5xx, Ordering::Relaxed);
        self.eject_after_gateway
            .store(outlier.consecutive_gateway_errors, Ordering::Relaxed);
        self.published.store(g, Ordering::Release);
    }

    /// Sets or clears `flag`, moving the eligible total by the endpoint's
    /// load at that instant when its counted-ness changes.
    fn set_flag(&self, state: &EndpointState, flag: u64, on: bool) {
        let old = if on {
            state.word.fetch_or(flag, Ordering::AcqRel)
        } else {
            state.word.fetch_and(!flag, Ordering::AcqRel)
        };
        let new = if on { old | flag } else { old & !flag };
        let load = i64::from(load_of(old));
        match (counted(old), counted(new)) {
            (true, false) => {
                self.eligible_in_flight.fetch_sub(load, Ordering::Relaxed);
            }
            (false, true) => {
                self.eligible_in_flight.fetch_add(load, Ordering::Relaxed);
            }
            _ => {}
        }
        if available(old) != available(new) {
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

    /// Ejects `state` unless it already is (a racing failure decided first),
    /// or that would exceed `max_ejection_percent` or leave the cluster
    /// without an available endpoint. Caller holds the lock, so each
    /// decision sees every earlier one.
    fn try_eject(&self, inner: &SharedInner, state: &EndpointState) {
        if state.is_ejected() {
            return;
        }
        state.consecutive_5xx.store(0, Ordering::Relaxed);
        state.consecutive_gateway.store(0, Ordering::Relaxed);
        let members = &inner.members;
        if !members.iter().any(|m| std::ptr::eq(m.as_ref(), state)) {
            return; // Not in the published snapshot: nothing to eject from.
        }
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
    /// Departed endpoints whose ejection is over are forgotten.
    pub(crate) fn tick(&self) {
        let now = self.clock.now_nanos();
        let mut inner = self.lock();
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
        inner
            .departed
            .retain(|_, m| now < m.ejected_until.load(Ordering::Relaxed));
    }

    /// Applies one active health-check result with rise/fall thresholds.
    pub(crate) fn record_check(&self, state: &EndpointState, passed: bool) {
        let health = self.lock().health;
        if !health.active {
            return;
        }
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
    /// The outcome was recorded already ([`InFlight::report_now`]): the
    /// drop only ends the request.
    reported: bool,
}

impl InFlight {
    /// Starts a request on `state` and returns its guard.
    pub(crate) fn start(
        state: &Arc<EndpointState>,
        shared: &Arc<ClusterShared>,
        index: usize,
    ) -> Self {
        state.begin(shared);
        Self::adopt(state, shared, index)
    }

    /// The guard of a request already counted (by [`EndpointState::try_reserve`]).
    pub(crate) fn adopt(
        state: &Arc<EndpointState>,
        shared: &Arc<ClusterShared>,
        index: usize,
    ) -> Self {
        Self {
            state: Arc::clone(state),
            shared: Arc::clone(shared),
            index,
            started_nanos: shared.clock.now_nanos(),
            outcome: Outcome::Cancelled,
            reported: false,
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

    /// Records `outcome` (and the latency so far) for outlier detection
    /// now, while the request goes on holding its load until the guard
    /// drops; the drop then records nothing more. For a TCP flow, whose
    /// success is its connection (Envoy's `LocalOriginConnectSuccess`):
    /// recorded at the end, a long flow's success would land after
    /// failures that happened meanwhile and let them eject the endpoint.
    pub fn report_now(&mut self, outcome: Outcome) {
        if self.reported {
            return;
        }
        self.reported = true;
        let latency = self
            .shared
            .clock
            .now_nanos()
            .saturating_sub(self.started_nanos);
        self.shared.record(&self.state, outcome, latency);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.end(&self.shared);
        if self.reported {
            return;
        }
        let latency = self
            .shared
            .clock
            .now_nanos()
            .saturating_sub(self.started_nanos);
        self.shared.record(&self.state, self.outcome, latency);
    }
}

/// Releases a reservation made by a pick that does not start a request
/// (lookaside), so it leaves no load behind.
pub(crate) fn release(state: &EndpointState, shared: &ClusterShared) {
    state.end(shared);
}
