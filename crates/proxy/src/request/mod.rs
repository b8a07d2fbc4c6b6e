//! The request path as named stages, composed in [`handle`]:
//!
//! ```text
//! screen   -> limits of the request head, refused methods (a local reply)
//!            and paths normalised (dot-segments, merged slashes)
//! route    -> which route and cluster (or a local reply)
//! admit    -> breaker slots (requests, pending) and the retry budget: RAII guards
//! activate -> hold while the service is at zero; probe; release
//! attempt  -> pick an endpoint, send, classify; RetryPolicy owns budget and tried set
//! respond  -> stream the response, or one local-reply builder for every local status
//! ```
//!
//! Every counter, gauge or flag raised on the way is lowered by a guard's
//! `Drop`: a client may vanish at any `.await` (h1 close, h2 `RST_STREAM`,
//! timeout), the future is dropped mid-stage, and nothing leaks. The
//! request's record ([`Completion`]) is itself such a guard: dropped before
//! the response ends, it logs and counts the request as `client_abort`.

pub mod activate;
pub mod admit;
pub mod attempt;
pub mod body;
pub mod downstream;
pub mod grpc;
pub mod h1_body;
pub mod headers;
pub mod path;
pub mod peer;
pub mod replay;
pub mod respond;
pub mod route;
pub mod screen;
pub mod trace;
pub mod tunnel;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use crate::upstream::ResponseBody;
use http::Response;
use http_body_util::BodyExt;
use meshless_balance::{InFlight, PickContext};
use meshless_model::probe_backoff::ProbeBackoff;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::limits::ListenerSettings;
use crate::request::body::{Completion, ProxyBody};
use crate::snapshot::{Snapshot, UpstreamCluster};
use crate::state::ProxyState;
use crate::upstream::{Lease, UpstreamBody};
use admit::Slot;
use attempt::RetryPolicy;
use downstream::{ClientFault, DownstreamBody, Source};
use replay::RequestBody;
use respond::LocalReply;
use tunnel::Tunnels;

/// What a request handler knows of the listener it came in on.
#[derive(Debug)]
pub struct Downstream {
    pub name: Arc<str>,
    pub state: Arc<ProxyState>,
    pub tunnels: Arc<Tunnels>,
    settings: arc_swap::ArcSwap<ListenerSettings>,
    /// This listener's `proxy_request_duration_seconds` series by cluster
    /// name: the family's lookup hashes both labels, once per cluster
    /// here rather than once per request. At most [`DURATIONS_KEPT`].
    durations: std::sync::RwLock<Vec<(Arc<str>, Histogram)>>,
    /// This listener's `proxy_downstream_connections` series, looked up
    /// once here rather than once per connection. Kept, so the listener
    /// families are never to be cleared or have a series removed (the
    /// cluster and endpoint ones are, on every scrape: not these).
    pub connections: Gauge,
    /// This listener's `proxy_http1_buffers_lent` series, looked up by its
    /// first connection that borrows a read buffer (any plain-text one, for
    /// its first read: `connection::serve`; a TLS one served by meshless's
    /// HTTP/1), then kept as `connections` is.
    http1_buffers: std::sync::OnceLock<Gauge>,
    /// When a request on a connection not yet registered with the
    /// reactor starts watching for its client leaving (ticked by the
    /// accept loop's clock task).
    pub watch_clock: Arc<crate::watch_clock::WatchClock>,
}

/// Clusters whose duration series a listener keeps at hand; past it (a
/// config renamed clusters that often), requests look theirs up.
const DURATIONS_KEPT: usize = 64;

impl Downstream {
    /// The listener `name`, serving with `settings`.
    pub fn new(name: Arc<str>, state: Arc<ProxyState>, settings: ListenerSettings) -> Self {
        Self {
            connections: state.metrics.downstream_connections(&name),
            http1_buffers: std::sync::OnceLock::new(),
            name,
            state,
            tunnels: Arc::default(),
            settings: arc_swap::ArcSwap::from_pointee(settings),
            durations: std::sync::RwLock::default(),
            watch_clock: Arc::default(),
        }
    }

    /// The `proxy_request_duration_seconds` series of this listener and
    /// `cluster` (the family's own: a series is never removed from it).
    pub fn duration_series(&self, cluster: &Arc<str>) -> Histogram {
        use std::sync::PoisonError;
        let same = |(c, _): &&(Arc<str>, Histogram)| **c == **cluster;
        let kept = self
            .durations
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some((_, h)) = kept.iter().find(same) {
            return h.clone();
        }
        // Full: looked up each time, without taking the write lock (which
        // every request of the listener would queue behind).
        let full = kept.len() >= DURATIONS_KEPT;
        drop(kept);
        let labels = crate::metrics::RouteLabels {
            listener: Arc::clone(&self.name),
            cluster: Arc::clone(cluster),
        };
        let h = self
            .state
            .metrics
            .request_duration
            .get_or_create_owned(&labels);
        if full {
            return h;
        }
        let mut kept = self
            .durations
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if kept.len() < DURATIONS_KEPT && !kept.iter().any(|e| same(&e)) {
            kept.push((Arc::clone(cluster), h.clone()));
        }
        h
    }

    /// The gauge of read buffers lent to this listener's `http1:
    /// meshless` connections.
    pub fn http1_buffers(&self) -> &Gauge {
        let name = &self.name;
        self.http1_buffers
            .get_or_init(|| self.state.metrics.http1_buffers(name))
    }

    /// The listener's settings now.
    pub fn settings(&self) -> Arc<ListenerSettings> {
        self.settings.load_full()
    }

    /// Applies reloaded settings to the requests that start from now on.
    pub fn update(&self, settings: ListenerSettings) {
        self.settings.store(Arc::new(settings));
    }
}

/// The client end of a downstream connection, made once per connection.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    /// The address as an `X-Forwarded-For` entry (formatted once, shared).
    pub xff: http::HeaderValue,
    /// Whether the connection is TLS (`x-forwarded-proto: https`).
    pub secure: bool,
    /// The connection's guards (gauge, `max_connections` slot), held by
    /// its task; a tunnel takes them for as long as it is open. Weak: a
    /// clone of the peer kept elsewhere never holds a connection open.
    pub connection: std::sync::Weak<tunnel::ConnectionGuards>,
}

impl Peer {
    /// The peer at `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        let xff = headers::ip_value(addr.ip());
        Self {
            addr,
            xff,
            secure: false,
            connection: std::sync::Weak::new(),
        }
    }

    /// The same peer, on the connection whose guards are `connection`.
    pub fn on(self, connection: std::sync::Weak<tunnel::ConnectionGuards>) -> Self {
        Self { connection, ..self }
    }

    /// The same peer on a TLS connection.
    pub fn secure(self) -> Self {
        Self {
            secure: true,
            ..self
        }
    }
}

/// Handles one downstream request received by `downstream`: its head
/// `parts`, its `body`.
///
/// A function returning an async block, not an `async fn`: an `async fn`
/// stores its arguments in its future and then moves them into the
/// body's own locals, a copy of the head (hundreds of bytes) per request;
/// the block uses what it captured in place.
#[allow(clippy::manual_async_fn)] // see above: the head is not copied
pub fn handle(
    downstream: Arc<Downstream>,
    peer: Peer,
    mut parts: http::request::Parts,
    body: Source,
) -> impl Future<Output = Result<Response<ProxyBody>, std::convert::Infallible>> + Send + 'static {
    async move {
        let client = peer.addr;
        let state = &downstream.state;
        let snapshot = state.snapshot.load_full();
        let carried = headers::Carried::of(&parts.headers);
        let mut record = Completion::new(
            Arc::clone(state),
            Arc::clone(&downstream.name),
            &parts,
            carried,
        );
        record.client = Some(client.ip());
        let settings = downstream.settings();
        if let Some(reply) = screen::screen(&settings, &parts) {
            return Ok(reply.respond(record));
        }
        if let Some(reply) = path::apply(&settings.paths, &mut parts) {
            return Ok(reply.respond(record));
        }
        let hop_client = carried
            .forwarded_by
            .then(|| peer::hop(state, &mut parts.headers, client))
            .flatten();
        let hop = hop_client.is_some();
        let client_ip = hop_client
            .unwrap_or_else(|| headers::client_ip(&parts.headers, client, &settings.forwarding));
        record.client = Some(client_ip);
        let routed = match route::route(&snapshot, &record.listener, client_ip, &parts) {
            Ok(r) => r,
            Err(reply) => return Ok(reply.respond(record)),
        };
        record.route = Arc::clone(&routed.route);
        record.cluster = Arc::clone(&routed.cluster.name);
        record.duration = Some(downstream.duration_series(&record.cluster));
        match admit::admit(state, &routed.cluster) {
            Ok(slot) => record.active = Some(slot),
            Err(reply) => return Ok(reply.respond(record)),
        }
        if routed.upgrade == Some(false) {
            state.metrics.upgrade_refused(&downstream.name);
        }
        let upgrade = match routed.upgrade {
            Some(true) => parts.extensions.remove::<hyper::upgrade::OnUpgrade>(),
            _ => None,
        };
        let forward = headers::Forward {
            peer: &peer.xff,
            secure: peer.secure,
            request_id: record.request_id.value(),
            upgrading: upgrade.is_some(),
            forwarding: &settings.forwarding,
            http2: routed.cluster.config.upstream_protocol
                == crate::config::UpstreamProtocol::Http2,
            hop,
            carried,
        };
        // Made once, moved into the last attempt (cloned only for retries).
        let mut upstream_headers =
            headers::forwarded_headers(std::mem::take(&mut parts.headers), &forward);
        upstream_headers.insert(
            headers::TRACEPARENT.clone(),
            headers::traceparent_value(&record.trace.context),
        );
        let exchange = Exchange {
            state,
            snapshot: &snapshot,
            parts: &parts,
            upgrading: upgrade.is_some(),
            marked: carried.forwarded_by,
        };
        // Not boxed here: HTTP/1 boxes the whole request future once
        // (`connection::serve_http`), and HTTP/2 runs each stream as its own task.
        let sent = exchange
            .forward(&routed, body, upstream_headers, &mut record)
            .await;
        Ok(match sent {
            Ok((resp, guard, lease)) => {
                record.guard = guard;
                record.upstream = Some(lease);
                respond::proxied(resp, upgrade, record, &downstream, &peer)
            }
            Err(reply) => reply.respond(record),
        })
    }
}

/// How long the exchange may take: `timeouts.request`, or for a gRPC call
/// the `grpc-timeout` it `asked` for, capped by `timeouts.grpc_max` (`None`:
/// no limit, a stream may last as long as it lives).
fn budget(
    cluster: &UpstreamCluster,
    grpc: bool,
    asked: Option<std::time::Duration>,
) -> Option<std::time::Duration> {
    let t = &cluster.config.timeouts;
    if !grpc {
        return Some(t.request);
    }
    let cap = (!t.grpc_max.is_zero()).then_some(t.grpc_max);
    match (asked, cap) {
        (Some(asked), Some(cap)) => Some(asked.min(cap)),
        (asked, cap) => asked.or(cap),
    }
}

/// Before an attempt to endpoint `index` of `cluster` (picked from
/// `base`): counts it, and the first one sets the deadline, which covers
/// the exchange from the first send (not the activation hold) to the last
/// response byte. Returns whether another attempt may follow this one:
/// attempts are left, or it is told to `keep` the headers (a held request
/// may connect again).
fn begin(
    policy: &mut RetryPolicy,
    (base, cluster): (&UpstreamCluster, &UpstreamCluster),
    index: usize,
    (headers, keep): (&Option<http::HeaderMap>, bool),
    record: &mut Completion,
) -> bool {
    if record.deadline.is_none() && !policy.retrying() {
        // Only a gRPC call's `grpc-timeout` counts (`budget`): no lookup
        // for the others.
        let asked = headers
            .as_ref()
            .filter(|_| record.grpc)
            .and_then(grpc::timeout);
        record.deadline =
            budget(base, record.grpc, asked).and_then(|d| Instant::now().checked_add(d));
    }
    policy.record(index);
    record.attempts = policy.attempts();
    record.endpoint = Arc::clone(&cluster.endpoint_labels[index]);
    record.series = Some(cluster.series(index, &record.state.metrics.endpoint_series));
    !policy.last() || keep
}

/// Whether an attempt sends a copy of the headers (the next attempt may
/// need them after this one made its request), rather than taking them
/// when its request is made: when another attempt may follow (`spare`),
/// unless the request is made over meshless's own HTTP/1.1 connections
/// without an upgrade and no retry can follow a made request (only
/// `connect_failure` listed, the default): there a later attempt follows
/// only a failure to connect, and that leaves the headers untouched. The
/// copy is a map, its index and a reference per value: about 1,800
/// instructions per request, made and dropped.
fn copies_headers(
    spare: bool,
    policy: &RetryPolicy,
    pool: &crate::upstream::EndpointPool,
    upgrade: bool,
) -> bool {
    spare && !(pool.makes_once_connected() && !upgrade && !policy.retries_once_sent())
}

/// Waits the retry back-off ([`RetryPolicy::backoff`]), never past the
/// request's deadline.
async fn back_off(policy: &RetryPolicy, record: &Completion) {
    let mut wait = policy.backoff();
    if let Some(deadline) = record.deadline {
        wait = wait.min(deadline.saturating_duration_since(Instant::now()));
    }
    tokio::time::sleep(wait).await;
}

/// What every attempt of one request shares.
struct Exchange<'a> {
    state: &'a ProxyState,
    snapshot: &'a Snapshot,
    /// The request head, its headers taken out (see `forward`).
    parts: &'a http::request::Parts,
    upgrading: bool,
    /// The client's map held the placement marker (removed before an
    /// endpoint sees the request).
    marked: bool,
}

/// The longest wait before a released request connects again to its
/// instance (the waits start at 200 µs and double, [`ProbeBackoff`]).
const RECONNECT_MAX_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// A request's time held for activation, whether a peer proxy was tried
/// (once per request), and its place among the released requests.
struct Held {
    /// When the request arrived, if it was ever held.
    at: Option<Instant>,
    /// When the last hold ended.
    released: Option<Instant>,
    peer_tried: bool,
    /// A released request's place among those awaiting headers.
    ticket: Option<activate::Ticket>,
    /// The waits between reconnects to a fresh instance.
    reconnects: ProbeBackoff,
}

impl Held {
    fn new() -> Self {
        Self {
            at: None,
            released: None,
            peer_tried: false,
            ticket: None,
            reconnects: ProbeBackoff::new(RECONNECT_MAX_WAIT),
        }
    }

    /// Counts a request that was not held in the room of a burst being
    /// released, if there is one ([`activate::join_release`]); true when
    /// that room is full (the request must wait its turn).
    fn room_full(&mut self, base: &UpstreamCluster, cluster: &UpstreamCluster) -> bool {
        if self.ticket.is_some() {
            return false;
        }
        match activate::join_release(base, cluster) {
            Ok(ticket) => {
                self.ticket = ticket;
                false
            }
            Err(()) => true,
        }
    }

    /// After an attempt: unless it was a released request that could not
    /// connect (a reconnect keeps its place), the next held request may go.
    fn attempted<T>(&mut self, sent: &Result<T, attempt::Failure>) {
        if !(self.at.is_some() && sent.as_ref().err() == Some(&attempt::Failure::ConnectFailed)) {
            drop(self.ticket.take());
        }
    }

    /// Records the response of a request that was held (a no-op if it was
    /// never held).
    fn answered(&self, state: &ProxyState, record: &Completion, status: u16) {
        if let (Some(at), Some(free)) = (self.at, self.released) {
            activate::answered(state, (at, free), record, status);
        }
    }
}

/// How a wait for an endpoint ended. Not boxed: made and moved once per
/// held request.
#[allow(clippy::large_enum_variant)]
enum Waited {
    /// The cluster (as of then) can take the request.
    Ready(Arc<UpstreamCluster>),
    /// A peer proxy answered it.
    Answered(Response<ResponseBody>, Lease),
}

impl Exchange<'_> {
    /// Activation, attempts and retries, until a response to stream or a
    /// local reply. Returns the response with its endpoint's guard (none
    /// when a peer proxy answered: the endpoint is its).
    async fn forward(
        &self,
        routed: &route::Routed,
        body: Source,
        headers: http::HeaderMap,
        record: &mut Completion,
    ) -> Result<(Response<ResponseBody>, Option<InFlight>, Lease), LocalReply> {
        let mut headers = Some(headers);
        let base = &routed.cluster;
        let node = &self.snapshot.config.node;
        let mut ctx = PickContext::new().with_locality(node.name.as_deref(), node.zone.as_deref());
        ctx.key = routed.key;
        let (mut policy, mut body) = self.policy_and_body(base, body, record);
        let mut next = body.attempt();
        let mut cluster = Arc::clone(base);
        let mut held = Held::new();
        let mut retry: Option<Slot> = None;
        loop {
            let picked = policy
                .pick(&cluster, &ctx)
                .map(|g| activate::within_limit(&cluster, g));
            let full = picked.is_some() && held.room_full(base, &cluster);
            if activate::needed(&cluster, picked.as_ref(), policy.retrying(), full) {
                if picked.is_some() {
                    // The key's endpoint is full: after the wait, pick by load.
                    ctx.key = None;
                }
                drop(picked);
                // Boxed: a rare path, kept out of the size of every
                // request's future (a future is moved by copying its bytes).
                let waited = self.wait(base, headers.as_ref(), &mut next, &mut held, record);
                match Box::pin(waited).await? {
                    Waited::Answered(resp, lease) => {
                        body.seal();
                        return Ok((resp, None, lease));
                    }
                    Waited::Ready(ready) => cluster = ready,
                }
                continue;
            }
            let Some(mut guard) = picked else {
                return Err(LocalReply::no_endpoint(cluster.config.fallback.as_ref()));
            };
            // A held request's headers stay for a reconnect (`reconnect`).
            let keep = held.at.is_some();
            let spare = begin(
                &mut policy,
                (base, &cluster),
                guard.index(),
                (&headers, keep),
                record,
            );
            if policy.last() {
                // No retry can follow: the copy is not needed past what
                // this attempt replays (a reconnect sends nothing twice).
                body.seal();
            }
            let sent = self
                .attempt(
                    (&cluster, guard.index()),
                    next.take(),
                    (&mut headers, spare, &policy),
                    record,
                )
                .await;
            drop(retry.take());
            held.attempted(&sent);
            match sent {
                Ok((resp, lease)) => {
                    let (status, on) = attempt::judge(&resp, record.grpc);
                    retry = self.retry(&policy, on, &mut body, &cluster, &mut next);
                    if retry.is_none() {
                        body.seal();
                        guard.set_outcome(status);
                        record.capacity = activate::CapacityNotice::of(&cluster);
                        held.answered(self.state, record, resp.status().as_u16());
                        return Ok((resp, Some(guard), lease));
                    }
                    guard.finish(status);
                    drop(lease);
                    drop(resp);
                    // Boxed: a rare path (see `wait` above).
                    Box::pin(back_off(&policy, record)).await;
                }
                Err(failure) => {
                    if matches!(failure, attempt::Failure::ConnectionLimit) {
                        admit::overflow(self.state, &cluster, "max_connections");
                    }
                    if let Some(again) = self.reconnect(&failure, &mut body, record, base, &held) {
                        // Not the instance's fault, nor an attempt.
                        guard.finish(meshless_balance::Outcome::Cancelled);
                        policy.forget_last();
                        next = Some(again);
                        tokio::time::sleep(held.reconnects.next_wait()).await;
                        // The cluster as it is now: an instance gone
                        // meanwhile sends the request back to the hold.
                        if let Some(now) = self.state.snapshot.load().clusters.get(&*base.name) {
                            cluster = Arc::clone(now);
                        }
                        continue;
                    }
                    guard.finish(failure.outcome());
                    retry = self.retry(&policy, failure.retry_on(), &mut body, &cluster, &mut next);
                    if retry.is_none() {
                        return Err(failure.reply());
                    }
                    Box::pin(back_off(&policy, record)).await;
                }
            }
        }
    }

    /// The request's retry policy, and its body as attempts take it: kept
    /// for replay (up to `replay::REPLAY_LIMIT`) when a retry may need it,
    /// or a reconnect: a request held for activation may find the fresh
    /// instance's accept queue full (see `reconnect`).
    fn policy_and_body(
        &self,
        base: &UpstreamCluster,
        body: Source,
        record: &mut Completion,
    ) -> (RetryPolicy, RequestBody) {
        let replayable = !self.upgrading
            && (base.config.retries.all_methods || headers::is_idempotent(&self.parts.method));
        let policy = RetryPolicy::new(&base.config.retries, replayable);
        // An HTTP/2 request's declared length is checked by the HTTP/2
        // layer only as its DATA arrive: the frame completing it waits
        // for the stream's end (see `DownstreamBody::hold_last`).
        let declared = match &body {
            Source::Hyper(b) if self.parts.version == http::Version::HTTP_2 => {
                http_body::Body::size_hint(b).exact().filter(|n| *n > 0)
            }
            _ => None,
        };
        // A body that had ended on arrival never fails: no flag for it.
        let fault = if http_body::Body::is_end_stream(&body) {
            ClientFault::default()
        } else {
            record.fault.share()
        };
        let downstream = DownstreamBody::new(body, fault);
        let downstream = match declared {
            Some(n) => downstream.hold_last(n),
            None => downstream,
        }
        .boxed();
        let activating = base.config.activation.is_some() && !self.upgrading;
        let keep = if replayable && base.config.retries.count > 0 {
            replay::Keep::Retries
        } else if activating {
            replay::Keep::Reconnect
        } else {
            replay::Keep::No
        };
        (policy, RequestBody::new(downstream, keep))
    }

    /// No endpoint can take the request yet: hands it to the peer proxy
    /// placed for the service (once per request), else holds it until the
    /// cluster can take it.
    async fn wait(
        &self,
        base: &Arc<UpstreamCluster>,
        headers: Option<&http::HeaderMap>,
        next: &mut Option<UpstreamBody>,
        held: &mut Held,
        record: &mut Completion,
    ) -> Result<Waited, LocalReply> {
        let node = self.snapshot.config.node.name.as_deref();
        if !std::mem::replace(&mut held.peer_tried, true)
            && let Some(h) = headers
            && let Some(target) = peer::target(self.state, base, h, node)
        {
            let limit = self.peer_limit(base);
            let h = h.clone();
            match peer::forward(base, &target, self.parts, h, next, limit, record).await {
                peer::Forwarded::Answered(resp, lease) => return Ok(Waited::Answered(resp, lease)),
                peer::Forwarded::Failed(reply) => return Err(reply),
                peer::Forwarded::Unreachable => {}
            }
        }
        drop(held.ticket.take());
        let (cluster, ticket) = activate::hold(self.state, base, &record.trace).await?;
        held.ticket = ticket;
        held.at.get_or_insert(record.started);
        held.released = Some(Instant::now());
        Ok(Waited::Ready(cluster))
    }
    /// The body to send again after a request released from an activation
    /// hold could not connect to its instance (`failure`), or `None` when
    /// it may not be tried again: it was never held, it failed otherwise,
    /// it is past its deadline (from the first send; without one,
    /// `activation.queue_timeout` after its release), or its body outgrew
    /// the replay copy.
    ///
    /// Safe because nothing was sent: the connection never opened. A burst
    /// released to a fresh instance that accepts slowly fills its accept
    /// queue, and the kernel drops the SYNs past it (the connect times
    /// out): such a request connects again after a short wait
    /// ([`RECONNECT_MAX_WAIT`]) instead of failing with 502, counted as
    /// `activations_total{result="reconnected"}`.
    fn reconnect(
        &self,
        failure: &attempt::Failure,
        body: &mut RequestBody,
        record: &Completion,
        base: &UpstreamCluster,
        held: &Held,
    ) -> Option<UpstreamBody> {
        if held.at.is_none() || *failure != attempt::Failure::ConnectFailed {
            return None;
        }
        let released = held.released.unwrap_or(record.started);
        let until = record.deadline.or_else(|| {
            let act = base.config.activation.as_ref()?;
            released.checked_add(act.queue_timeout)
        })?;
        if Instant::now() + RECONNECT_MAX_WAIT >= until {
            return None;
        }
        let again = body.attempt()?;
        activate::count(self.state, "reconnected");
        Some(again)
    }

    /// How long a request forwarded to a peer proxy may wait for its
    /// response headers: that proxy's hold (`activation.queue_timeout`),
    /// then the request (`timeouts.request`).
    fn peer_limit(&self, cluster: &UpstreamCluster) -> std::time::Duration {
        let hold = cluster
            .config
            .activation
            .as_ref()
            .map(|a| a.queue_timeout)
            .unwrap_or_default();
        hold + cluster.config.timeouts.request
    }

    /// After an attempt that failed `on` (`None`: not retryable): the next
    /// attempt's body and its retry-budget slot, or `None` when there is
    /// no retry (not allowed, the body can no longer be replayed, or the
    /// budget is spent).
    fn retry(
        &self,
        policy: &RetryPolicy,
        on: Option<crate::config::RetryOn>,
        body: &mut RequestBody,
        cluster: &UpstreamCluster,
        next: &mut Option<UpstreamBody>,
    ) -> Option<Slot> {
        if !on.is_some_and(|on| policy.may_retry(on)) {
            return None;
        }
        next_attempt(body, next, || admit::retry(self.state, cluster))
    }

    /// One attempt to endpoint `index`, holding a `max_pending` slot until
    /// its response headers arrive. It sends a copy of the headers when
    /// `spare` says another attempt may follow and that one could need
    /// them after this request was made ([`copies_headers`]); else its
    /// request takes them once it is made, and an attempt that could not
    /// connect leaves them for the next.
    async fn attempt(
        &self,
        (cluster, index): (&UpstreamCluster, usize),
        body: Option<UpstreamBody>,
        (headers, spare, policy): (&mut Option<http::HeaderMap>, bool, &RetryPolicy),
        record: &Completion,
    ) -> Result<(Response<ResponseBody>, Lease), attempt::Failure> {
        let _pending =
            admit::pending(self.state, cluster).map_err(|_| attempt::Failure::Pending)?;
        // `None` only if the body could not be kept for this retry.
        let mut body = body.ok_or(attempt::Failure::BadRequest)?;
        // Taken by the last attempt's request only: none follows it.
        debug_assert!(headers.is_some(), "an attempt after the last one");
        let mut target = headers::target(self.parts, headers.as_ref(), cluster, index)
            .map_err(|_| attempt::Failure::BadRequest)?;
        let pool = &cluster.endpoint_pools[index];
        let upgrade = headers
            .as_ref()
            .is_some_and(|h| crate::upstream::EndpointPool::upgrading_head(&self.parts.method, h));
        let mut copy = if copies_headers(spare, policy, pool, upgrade) {
            headers.clone()
        } else {
            None
        };
        // Borrows what it takes, which stays in this future: the closure
        // is a few pointers, moved through every layer of the send. Owning
        // them, it was 232 bytes, copied at each layer.
        let make = || {
            let h = copy.take().or_else(|| headers.take()).unwrap_or_default();
            let (target, body) = (std::mem::take(&mut target), std::mem::take(&mut body));
            headers::build_request(self.parts, target, (h, self.marked), cluster, index, body)
        };
        let deadline = record.deadline.map(tokio::time::Instant::from_std);
        attempt::send(cluster, index, (make, upgrade), deadline, &record.fault).await
    }
}

/// The next attempt's body (into `next`) and the retry-budget slot
/// `budget` gives, or `None` (and no new attempt: a refused retry leaves
/// the attempt under way the newest, so a seal drops the copy) when the
/// body cannot be sent again or the budget is spent.
fn next_attempt(
    body: &mut RequestBody,
    next: &mut Option<UpstreamBody>,
    budget: impl FnOnce() -> Option<Slot>,
) -> Option<Slot> {
    if !body.replayable() {
        return None;
    }
    let slot = budget()?;
    *next = Some(body.attempt()?);
    Some(slot)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body::Frame;
    use http_body_util::StreamBody;

    fn body() -> RequestBody {
        let frames: Vec<Result<Frame<Bytes>, body::BodyError>> = [&b"ab"[..], b"cd", b"ef"]
            .iter()
            .map(|c| Ok(Frame::data(Bytes::from_static(c))))
            .collect();
        let source = StreamBody::new(tokio_stream::iter(frames)).boxed();
        RequestBody::new(source, replay::Keep::Retries)
    }

    /// A listener keeps at most [`DURATIONS_KEPT`] clusters' series; past
    /// it, each request still records under its own labels.
    #[test]
    fn duration_series_are_the_familys_own_kept_or_not() {
        let yaml = crate::config::ONE_LISTENER_YAML;
        let state = Arc::new(ProxyState::for_tests(yaml, Arc::default()));
        let settings = state.snapshot.load().config.listeners[0].settings();
        let down = Downstream::new(Arc::from("web"), Arc::clone(&state), settings);
        let names: Vec<Arc<str>> = (0..DURATIONS_KEPT + 6)
            .map(|i| Arc::from(format!("c{i}")))
            .collect();
        for _ in 0..2 {
            for name in &names {
                down.duration_series(name).observe(0.001);
            }
        }
        let kept = down.durations.read().map(|k| k.len()).unwrap_or(0);
        assert_eq!(kept, DURATIONS_KEPT);
        let mut text = String::new();
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register("d", "", state.metrics.request_duration.clone());
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encoded");
        for name in &names {
            let line = format!("d_count{{listener=\"web\",cluster=\"{name}\"}} 2");
            assert!(text.contains(&line), "{line} in {text}");
        }
    }

    /// A retry the budget refused: the response of the attempt under way
    /// is chosen, and the seal drops the copy at once.
    #[tokio::test]
    async fn a_retry_refused_by_the_budget_keeps_no_copy() {
        let mut b = body();
        let mut first = b.attempt().expect("first");
        first.frame().await.expect("frame").expect("ok");
        let mut next = None;
        assert!(next_attempt(&mut b, &mut next, || None).is_none());
        assert!(next.is_none());
        b.seal();
        assert_eq!(b.kept_bytes(), 0, "the copy goes with the seal");
        first.frame().await.expect("frame").expect("ok");
        assert_eq!(b.kept_bytes(), 0, "and nothing more is copied");
    }

    #[tokio::test]
    async fn a_retry_the_budget_allows_replays_the_body() {
        let counters = Arc::new(crate::upstream::ClusterCounters::default());
        let mut b = body();
        let mut first = b.attempt().expect("first");
        first.frame().await.expect("frame").expect("ok");
        let mut next = None;
        let slot = next_attempt(&mut b, &mut next, || {
            Slot::acquire(&counters, admit::Gauge::Retries, 1)
        });
        assert!(slot.is_some());
        let sent = next.expect("a body").collect().await.expect("body");
        assert_eq!(sent.to_bytes(), &b"abcdef"[..]);
    }
}
