//! Stage 3, activate: a request for a `service:` cluster with no ready
//! endpoint (or none under its `container_concurrency`) is held in a
//! bounded per-cluster queue while the control plane starts an instance.
//! The proxy asks for one at once, and sends the request the moment an
//! instance is ready: announced ready on the stream (the control plane
//! forwards the instance's own `READY=1` at once), or accepting the
//! proxy's own probe of an address announced as starting (waits from
//! 200 µs doubling to `probe_interval`, [`ProbeBackoff`]) — no extra hop,
//! no wait for a readiness cycle.
//!
//! Everything a held request raises is a guard: its place in the queue
//! ([`Slot`]) and its turn as the service's prober ([`crate::state::ProbeTurn`]). A held
//! request dropped at any point (client gone, mid-probe) leaves neither a
//! queued count nor a service stuck in `probing`.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use http::StatusCode;
use meshless_balance::InFlight;
use meshless_model::probe_backoff::ProbeBackoff;
use meshless_model::{Conditions, Endpoint};

use crate::config::Activation;
use crate::metrics::{ActivationLabels, PhaseLabels};
use crate::request::admit::{Gauge, Slot, overflow};
use crate::request::respond::LocalReply;
use crate::request::trace::RequestTrace;
use crate::snapshot::UpstreamCluster;
use crate::state::ProxyState;
use crate::upstream::ClusterCounters;

/// Whether this pick must wait for activation: the cluster activates, this
/// is not a retry, and there is no endpoint, or the picked one is over
/// `container_concurrency` (the pick already counts in its load), or a
/// held burst is being released and its room was `full` when this request
/// asked for a ticket ([`join_release`]): a new request then queues
/// behind it.
pub fn needed(
    cluster: &UpstreamCluster,
    picked: Option<&InFlight>,
    retrying: bool,
    full: bool,
) -> bool {
    let Some(act) = cluster.config.activation.as_ref() else {
        return false;
    };
    if retrying || cluster.config.service.is_none() {
        return false;
    }
    let Some(g) = picked else {
        return true;
    };
    if act.container_concurrency > 0 {
        return cluster.lb.set().load(g.index()) > act.container_concurrency;
    }
    full
}

/// With `container_concurrency`, a pick over the limit moves to the least
/// loaded available endpoint under it, when there is one (Knative's
/// activator sends a request to an instance with a free slot). Without
/// this, a policy whose pick follows the request (a hash key, or one seed
/// per request: `random`, `p2c`) picks the same full endpoint after every
/// hold, and a hold ends at once while any endpoint has room: a loop that
/// never waits. The load checks here are the ones [`hold`] ends on, so a
/// hold that ended finds its endpoint here.
pub fn within_limit(cluster: &UpstreamCluster, picked: InFlight) -> InFlight {
    let Some(act) = cluster.config.activation.as_ref() else {
        return picked;
    };
    let (limit, set) = (act.container_concurrency, cluster.lb.set());
    if limit == 0 || set.load(picked.index()) <= limit {
        return picked;
    }
    let free = with_room(cluster, limit).min_by_key(|&i| set.load(i));
    match free.and_then(|i| cluster.lb.start(i)) {
        Some(other) if set.load(other.index()) <= limit => {
            picked.finish(meshless_balance::Outcome::Cancelled);
            other
        }
        Some(other) => {
            // Taken meanwhile by another request: wait as picked.
            other.finish(meshless_balance::Outcome::Cancelled);
            picked
        }
        None => picked,
    }
}

/// How many released requests may wait for their response headers at
/// once: `release_concurrency` per available instance.
fn release_room(c: &UpstreamCluster, act: &Activation) -> u64 {
    let set = c.lb.set();
    let available = (0..set.len()).filter(|&i| set.is_available(i)).count();
    u64::from(act.release_concurrency) * available as u64
}

/// The endpoints of `c` that can take a request now: available, under the
/// per-instance limit when there is one (0: none). A hold ends on these,
/// and [`within_limit`] picks among them: the same test on both sides.
fn with_room(c: &UpstreamCluster, limit: u32) -> impl Iterator<Item = usize> + '_ {
    let set = c.lb.set();
    (0..set.len()).filter(move |&i| set.is_available(i) && (limit == 0 || set.load(i) < limit))
}

/// Whether `c` can take a request now ([`with_room`]).
fn has_capacity(c: &UpstreamCluster, limit: u32) -> bool {
    with_room(c, limit).next().is_some()
}

/// A request released from an activation hold, until its response
/// headers arrive (or it fails): one of `release_concurrency` per
/// available instance. So a burst reaches a fresh instance that many at a
/// time, its accept queue (its listen backlog) never takes the whole
/// burst, and long-lived responses (streams) do not keep the next ones
/// waiting once their headers came. Dropping it wakes one held request.
#[derive(Debug)]
pub struct Ticket {
    slot: Option<Slot>,
    /// Set for a request that was held (counted in `released`).
    held: Option<Slot>,
    counters: Arc<ClusterCounters>,
}

impl Ticket {
    /// A ticket for `c` for a request that was `held` or not: `Ok(None)`
    /// when releases are not limited, `Err` when the room is full.
    fn take(
        base: &UpstreamCluster,
        c: &UpstreamCluster,
        act: &Activation,
        held: bool,
    ) -> Result<Option<Self>, ()> {
        if act.release_concurrency == 0 || act.container_concurrency > 0 {
            return Ok(None);
        }
        let slot =
            Slot::acquire(&base.counters, Gauge::Releasing, release_room(c, act)).ok_or(())?;
        let held = held
            .then(|| Slot::acquire(&base.counters, Gauge::Released, u64::MAX))
            .flatten();
        Ok(Some(Self {
            slot: Some(slot),
            held,
            counters: Arc::clone(&base.counters),
        }))
    }
}

/// A ticket for a request that was not held but comes while a burst is
/// being released to `cluster` (requests held, or released ones still
/// awaiting their headers): it counts in the room like the released
/// ones, so new requests do not reach a fresh instance past
/// `release_concurrency` (nor ahead of the held ones). `Ok(None)` when no
/// burst is being released (none held, and every released one got its
/// headers or failed) or releases are not limited; `Err` when the room
/// is full: the request must then wait its turn ([`needed`]). Taking the
/// ticket is the check (one atomic step), so two requests cannot both see
/// the last place free. Such a ticket does not itself keep tickets in
/// force (steady traffic after a burst is not paced).
pub(crate) fn join_release(
    base: &UpstreamCluster,
    cluster: &UpstreamCluster,
) -> Result<Option<Ticket>, ()> {
    let Some(act) = cluster.config.activation.as_ref() else {
        return Ok(None);
    };
    let c = &base.counters;
    if c.queued.load(Ordering::Acquire) == 0 && c.released.load(Ordering::Acquire) == 0 {
        return Ok(None);
    }
    Ticket::take(base, cluster, act, false)
}

impl Drop for Ticket {
    fn drop(&mut self) {
        drop(self.slot.take());
        drop(self.held.take());
        if self.counters.queued.load(Ordering::Relaxed) > 0 {
            self.counters.capacity_freed.notify_one();
        }
    }
}

/// Held by the record of a request sent to a cluster with
/// `container_concurrency`: when the request ends (after its endpoint's
/// in-flight count was lowered), wakes one held request, which may now
/// fit under the limit.
#[derive(Debug)]
pub struct CapacityNotice(Arc<ClusterCounters>);

impl CapacityNotice {
    /// A notice for requests of `cluster`, if it limits them per instance.
    pub fn of(cluster: &UpstreamCluster) -> Option<Self> {
        let act = cluster.config.activation.as_ref()?;
        (act.container_concurrency > 0).then(|| Self(Arc::clone(&cluster.counters)))
    }
}

impl Drop for CapacityNotice {
    fn drop(&mut self) {
        if self.0.queued.load(Ordering::Relaxed) > 0 {
            self.0.capacity_freed.notify_one();
        }
    }
}

/// Endpoints of `service` announced as starting (not ready only because
/// they are still starting: [`Endpoint::starting`], set by the scaler that
/// runs them). An endpoint not ready for another reason (a pod failing its
/// readiness probe, one registered not ready) is never probed nor
/// promoted: only its source makes it ready.
fn starting(state: &ProxyState, service: &str) -> Vec<Endpoint> {
    let services = state
        .services
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    services
        .get(service)
        .map(|eps| {
            eps.endpoints
                .iter()
                .filter(|e| e.starting && !e.conditions.ready && !e.conditions.terminating)
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// Marks an endpoint ready on the proxy's own probe, before the control
/// plane says so, and rebuilds the service's clusters.
fn promote(state: &ProxyState, service: &str, id: &meshless_model::EndpointId) {
    let mut services = state
        .services
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let Some(e) = services
        .get_mut(service)
        .and_then(|eps| eps.endpoints.iter_mut().find(|e| &e.id == id))
    else {
        return;
    };
    e.conditions = Conditions::READY;
    let current = state.snapshot.load_full();
    if let Ok(next) = current.with_service(service, &services) {
        state.snapshot.store(Arc::new(next));
    }
    drop(services);
    state.endpoints_swapped();
}

/// Probes the starting endpoints of `service` once; true if one accepted.
async fn probe_once(state: &ProxyState, service: &str, timeout: Duration) -> bool {
    for e in starting(state, service) {
        let Some(addr) = e.socket_addr() else {
            continue;
        };
        if probe(addr, timeout).await {
            promote(state, service, &e.id);
            return true;
        }
    }
    false
}

async fn probe(addr: SocketAddr, timeout: Duration) -> bool {
    matches!(
        tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await,
        Ok(Ok(_))
    )
}

pub(crate) fn count(state: &ProxyState, result: &'static str) {
    state
        .metrics
        .activations
        .get_or_create(&ActivationLabels { result })
        .inc();
}

fn phase(state: &ProxyState, phase: &'static str, since: Instant) {
    state
        .metrics
        .activation_phase
        .get_or_create(&PhaseLabels { phase })
        .observe(since.elapsed().as_secs_f64());
}

/// Why the wait ends without a cluster to send to, if it does now.
fn refusal(
    state: &ProxyState,
    service: &str,
    act: &Activation,
    held: Instant,
) -> Option<LocalReply> {
    let failure = state
        .activation_errors
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(service)
        .filter(|(_, at)| *at >= held)
        .map(|(reason, _)| reason.clone());
    if let Some(reason) = failure {
        count(state, "start_failed");
        tracing::warn!(service, error = %reason, "held requests fail: instance failed to start");
        let text = format!("{service}: instance failed to start: {reason}\n");
        return Some(LocalReply::text(
            StatusCode::SERVICE_UNAVAILABLE,
            text,
            "start_failed",
        ));
    }
    if held.elapsed() >= act.queue_timeout {
        count(state, "timeout");
        let text = format!(
            "{service}: no instance ready within {:?}\n",
            act.queue_timeout
        );
        return Some(LocalReply::text(
            StatusCode::GATEWAY_TIMEOUT,
            text,
            "activation_timeout",
        ));
    }
    None
}

/// The span of a hold, recorded when the hold ends however it ends (a
/// client gone mid-hold drops it: `cancelled`).
struct HeldSpan<'a> {
    state: &'a ProxyState,
    trace: &'a RequestTrace,
    name: &'static str,
    start: Instant,
    result: &'static str,
}

impl Drop for HeldSpan<'_> {
    fn drop(&mut self) {
        let result = [("meshless.result", self.result)];
        self.trace
            .child(self.state, self.name, self.start, Instant::now(), &result);
    }
}

/// Holds a request until `base`'s cluster can take it; returns that
/// cluster (from the snapshot current then) or the reply that refuses it.
/// With tracing on, records the phases as children of `trace`'s span.
///
/// A request that finds an instance ready but no room (a [`Ticket`]) is
/// *paced*: it waits its turn (woken as tickets are given back) without
/// asking for an instance again, is not counted as an activation, and
/// its span is `activation.paced`.
pub async fn hold(
    state: &ProxyState,
    base: &UpstreamCluster,
    trace: &RequestTrace,
) -> Result<(Arc<UpstreamCluster>, Option<Ticket>), LocalReply> {
    let (Some(act), Some(service)) = (&base.config.activation, base.config.service.as_deref())
    else {
        return Err(LocalReply::no_endpoint(base.config.fallback.as_ref()));
    };
    let held = Instant::now();
    let mut paced = pacing_only(state.snapshot.load().clusters.get(&*base.name), act);
    let mut span = HeldSpan {
        state,
        trace,
        name: if paced {
            "activation.paced"
        } else {
            "activation.held"
        },
        start: held,
        result: "cancelled",
    };
    let _queued = enqueue(state, base, act, &mut span)?;
    let mut activated = false;
    let mut announced: Option<Instant> = None;
    let mut probed = false;
    let mut backoff = ProbeBackoff::new(act.probe_interval);
    loop {
        // Registered before the checks below: a change that lands between
        // them and the wait still wakes this request (`notify_waiters`
        // wakes only registered waiters; a change missed here would wait
        // for the probe backoff, up to `probe_interval`).
        let changed = state.endpoints_changed.notified();
        let freed = base.counters.capacity_freed.notified();
        tokio::pin!(changed, freed);
        changed.as_mut().enable();
        freed.as_mut().enable();
        let snap = state.snapshot.load_full();
        // A paced burst whose instances left needs one like any hold.
        paced = paced && pacing_only(snap.clusters.get(&*base.name), act);
        if !paced && !std::mem::replace(&mut activated, true) {
            let _ = state.activate.send(service.to_owned());
            trace.child(state, "activation.sent", held, Instant::now(), &[]);
        }
        if let Some(c) = snap.clusters.get(&*base.name)
            && has_capacity(c, act.container_concurrency)
            && let Ok(ticket) = Ticket::take(base, c, act, true)
        {
            if !paced {
                released(state, trace, (held, announced), probed);
            }
            span.result = "sent";
            return Ok((Arc::clone(c), ticket));
        }
        if let Some(reply) = refusal(state, service, act, held) {
            span.result = "refused";
            return Err(reply);
        }
        if announced.is_none() && !starting(state, service).is_empty() {
            let now = Instant::now();
            announced = Some(now);
            backoff.reset();
            phase(state, "announced", held);
            trace.child(state, "instance.announced", held, now, &[]);
        }
        // One held request per service probes (with the backoff); the
        // others wait for a change, a request that ends, or at most
        // `WAITER_WAIT` (to take over the probing if the prober is gone).
        let wait = if paced {
            WAITER_WAIT
        } else {
            match probe_turn(state, (service, act), held, &mut probed, &mut backoff).await {
                Some(wait) => wait,
                None => continue,
            }
        };
        let remaining = act.queue_timeout.saturating_sub(held.elapsed());
        tokio::select! {
            () = &mut changed => {}
            () = &mut freed => {}
            () = tokio::time::sleep(wait.min(remaining)) => {}
        }
    }
}

/// Whether the cluster (as in the current snapshot) has an instance
/// already, so that a hold only paces the release of a burst (no instance
/// to activate): only without a `container_concurrency` limit, which holds
/// requests at capacity instead.
fn pacing_only(cluster: Option<&Arc<UpstreamCluster>>, act: &Activation) -> bool {
    act.container_concurrency == 0 && cluster.is_some_and(|c| has_capacity(c, 0))
}

/// Takes a place in `base`'s activation queue (`max_queued`), or the 503
/// that refuses it.
fn enqueue(
    state: &ProxyState,
    base: &UpstreamCluster,
    act: &Activation,
    span: &mut HeldSpan<'_>,
) -> Result<Slot, LocalReply> {
    if let Some(queued) = Slot::acquire(&base.counters, Gauge::Queued, u64::from(act.max_queued)) {
        return Ok(queued);
    }
    count(state, "queue_full");
    span.result = "queue_full";
    overflow(state, base, "max_queued");
    let text = format!("activation queue full ({} held)\n", act.max_queued);
    let reply = LocalReply::text(StatusCode::SERVICE_UNAVAILABLE, text, "queue_full");
    Err(reply.retry_after(Some(1)))
}

/// The service's prober (one held request per service at a time) probes
/// its starting instances once. Returns how long to wait before looking
/// again, or `None` when a probe just succeeded for the first time (look
/// again at once). A request that is not the prober waits at most
/// `WAITER_WAIT`.
async fn probe_turn(
    state: &ProxyState,
    (service, act): (&str, &Activation),
    held: Instant,
    probed: &mut bool,
    backoff: &mut ProbeBackoff,
) -> Option<Duration> {
    let Some(turn) = state.probing.turn(service) else {
        return Some(WAITER_WAIT);
    };
    let timeout = act.probe_interval.max(Duration::from_millis(50));
    let ok = probe_once(state, service, timeout).await;
    drop(turn);
    if ok && !*probed {
        *probed = true;
        phase(state, "probe_success", held);
        tracing::info!(
            service,
            held_to_probe_success_ms = held.elapsed().as_millis() as u64,
            "activation: instance answered the proxy's probe"
        );
        return None;
    }
    Some(backoff.next_wait())
}

/// The longest a held request that is not the service's prober sleeps
/// between checks: changes and ended requests wake it at once; this only
/// bounds how long probing pauses when the prober's client goes away.
/// (Waking every held request at the probe backoff made a burst of
/// thousands cost the proxy's lock on the services table many times a
/// millisecond.)
const WAITER_WAIT: Duration = Duration::from_millis(50);

/// Counts a held request released to a ready instance and records its
/// `instance.ready` span (from `announced`, else from `held`).
fn released(
    state: &ProxyState,
    trace: &RequestTrace,
    (held, announced): (Instant, Option<Instant>),
    probed: bool,
) {
    phase(state, "ready", held);
    count(state, "sent");
    let via = [(
        "meshless.ready_via",
        if probed { "probe" } else { "stream" },
    )];
    trace.child(
        state,
        "instance.ready",
        announced.unwrap_or(held),
        Instant::now(),
        &via,
    );
}

/// Records the cold-start timeline of a held request whose response
/// headers arrived: `(held, released)` are when the hold began and ended.
pub fn answered(
    state: &ProxyState,
    (held, released): (Instant, Instant),
    record: &crate::request::body::Completion,
    status: u16,
) {
    phase(state, "response", held);
    let status_text = status.to_string();
    let attributes = [("http.response.status_code", status_text.as_str())];
    record.trace.child(
        state,
        "upstream.response",
        released,
        Instant::now(),
        &attributes,
    );
    tracing::info!(
        cluster = %record.cluster,
        endpoint = %record.endpoint,
        request_id = %record.request_id,
        status,
        held_to_response_ms = held.elapsed().as_millis() as u64,
        "activation: held request answered"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Probing;

    #[test]
    fn one_prober_per_service_and_the_turn_is_given_back() {
        let p = Probing::default();
        let a = p.turn("ns/a").expect("first turn");
        assert!(p.turn("ns/a").is_none());
        let b = p.turn("ns/b").expect("another service");
        drop(a);
        assert!(!p.is_probing("ns/a") && p.is_probing("ns/b"));
        drop(b);
        assert!(p.turn("ns/a").is_some());
    }

    #[test]
    fn a_turn_dropped_mid_probe_frees_the_service() {
        let p = Arc::new(Probing::default());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let p2 = Arc::clone(&p);
            let probing = async move {
                let _turn = p2.turn("ns/a");
                std::future::pending::<()>().await;
            };
            let _ = tokio::time::timeout(Duration::from_millis(1), probing).await;
        });
        assert!(!p.is_probing("ns/a"));
    }
}
