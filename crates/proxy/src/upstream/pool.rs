//! A cluster's upstream connections, one [`EndpointPool`] per endpoint
//! (its own lock: no lock shared by the endpoints on the request path).
//!
//! Invariants:
//! - an HTTP/1.1 connection serves one request at a time: it is taken out
//!   of the idle stack (LIFO: the most recently used first, so the others
//!   age out) and pushed back when its [`Lease`] drops after the response;
//! - an HTTP/2 connection is shared while its open streams are below the
//!   peer's `SETTINGS_MAX_CONCURRENT_STREAMS`; a full one is passed over;
//! - at most `max_idle_per_endpoint` idle HTTP/1.1 connections are kept;
//!   idle ones are closed between `timeouts.idle` and 1.5x that;
//! - open connections never exceed `max_connections` (a slot is reserved
//!   before connecting, see `connect.rs`), pre-connected ones included;
//! - an endpoint's connections close once no snapshot and no request
//!   holds its pool (the endpoint left the cluster).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use http::{Request, Response};
use hyper::client::conn::{http1, http2};
use tokio::sync::Notify;

use super::connect::{self, ConnectError, OpenSlot, Sender, StreamLimit};
use super::h1::{self, ExchangeError};
use super::tls::TlsClient;
use super::{ClusterCounters, ResponseBody, UpstreamBody};
use crate::config::{Http1Client, UpstreamProtocol};

/// The settings every connection of a pool is opened and kept with.
#[derive(Debug)]
pub struct Settings {
    pub protocol: UpstreamProtocol,
    /// The HTTP/1.1 client (`clusters[].http1`).
    pub http1: Http1Client,
    /// TCP connect and TLS handshake, each.
    pub connect: Duration,
    /// Idle connections are closed after this.
    pub idle: Duration,
    pub max_idle: usize,
    /// Connections wanted per request in flight, in thousandths (1000:
    /// none ahead).
    pub preconnect_milli: u32,
    pub tls: Option<TlsClient>,
    /// HTTP/2 keep-alive PING interval (`None`: off) and timeout.
    pub keepalive: (Option<Duration>, Duration),
}

/// Why an exchange got no response.
#[derive(Debug)]
pub enum SendError {
    /// No connection: the limit, a connect or a TLS failure.
    Connect(ConnectError),
    /// The connection failed after the request was handed to it.
    Http(hyper::Error),
    /// meshless's own HTTP/1.1 exchange failed before the response head.
    Exchange(ExchangeError),
    /// The HTTP/2 endpoint refused the stream (RST_STREAM REFUSED_STREAM):
    /// it did not process the request, which is always safe to retry.
    Refused,
}

/// The reason of an HTTP/2 stream reset behind `e` (RST_STREAM, from the
/// peer or ours), if that is what it is: an error of one stream, not of
/// its connection (GOAWAY, I/O).
fn stream_reset(e: &hyper::Error) -> Option<h2::Reason> {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if let Some(h2) = c.downcast_ref::<h2::Error>() {
            return h2.reason().filter(|_| h2.is_reset() && !h2.is_go_away());
        }
        cause = c.source();
    }
    None
}

/// A cluster's pools, by endpoint address.
#[derive(Debug, Clone)]
pub struct Pool {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    settings: Settings,
    counters: Arc<ClusterCounters>,
    endpoints: Mutex<HashMap<SocketAddr, Weak<EndpointPool>>>,
    sweeping: AtomicBool,
}

impl Pool {
    /// An empty pool; counts its connections in `counters`.
    pub fn new(settings: Settings, counters: Arc<ClusterCounters>) -> Self {
        Self {
            shared: Arc::new(Shared {
                settings,
                counters,
                endpoints: Mutex::default(),
                sweeping: AtomicBool::new(false),
            }),
        }
    }

    /// The pools of `addrs`, the live ones reused (a snapshot holds them;
    /// pools no snapshot holds are gone, their connections closed).
    pub fn endpoints(&self, addrs: &[SocketAddr]) -> Vec<Arc<EndpointPool>> {
        let mut map = lock(&self.shared.endpoints);
        map.retain(|_, w| w.strong_count() > 0);
        addrs
            .iter()
            .map(|&addr| {
                if let Some(p) = map.get(&addr).and_then(Weak::upgrade) {
                    return p;
                }
                let p = Arc::new(EndpointPool {
                    addr,
                    shared: Arc::clone(&self.shared),
                    conns: Mutex::default(),
                    connected: Notify::new(),
                    streams_hint: Arc::default(),
                });
                map.insert(addr, Arc::downgrade(&p));
                p
            })
            .collect()
    }
}

/// Locks, going on with the data of a thread that panicked holding it
/// (each change below leaves the lists consistent).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The connections to one endpoint.
#[derive(Debug)]
pub struct EndpointPool {
    addr: SocketAddr,
    shared: Arc<Shared>,
    conns: Mutex<Conns>,
    /// Woken when an HTTP/2 connect ends (requests wait for it, not open more).
    connected: Notify,
    /// The endpoint's HTTP/2 stream limit last announced (0: unknown).
    streams_hint: Arc<AtomicUsize>,
}

#[derive(Debug, Default)]
struct Conns {
    /// Idle HTTP/1.1 connections, the most recently used last.
    idle: Vec<Idle>,
    /// HTTP/2 connections.
    h2: Vec<H2>,
    /// HTTP/1.1 connections leased.
    busy: usize,
    /// Connects under way.
    connecting: usize,
}

#[derive(Debug)]
struct Idle {
    conn: IdleConn,
    since: Instant,
    _gauge: IdleGauge,
}

/// An idle HTTP/1.1 connection: hyper's, or meshless's own.
#[derive(Debug)]
enum IdleConn {
    Hyper(http1::SendRequest<UpstreamBody>),
    Own(h1::Conn),
}

impl IdleConn {
    /// Whether it can take a request now.
    fn usable(&mut self) -> bool {
        match self {
            IdleConn::Hyper(s) => s.is_ready(),
            IdleConn::Own(c) => c.reusable(),
        }
    }
}

#[derive(Debug)]
struct H2 {
    sender: http2::SendRequest<UpstreamBody>,
    /// Streams open on it now.
    streams: Arc<AtomicUsize>,
    /// The peer's limit.
    max: StreamLimit,
    /// When it was last used.
    used: Instant,
}

/// Counts an idle connection while it is in the idle stack.
#[derive(Debug)]
struct IdleGauge(Arc<ClusterCounters>);

impl IdleGauge {
    fn new(counters: &Arc<ClusterCounters>) -> Self {
        counters.idle_connections.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(counters))
    }
}

impl Drop for IdleGauge {
    fn drop(&mut self) {
        self.0.idle_connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection held by one exchange until its response ends.
#[derive(Debug)]
pub struct Lease {
    pool: Arc<EndpointPool>,
    held: Held,
}

#[derive(Debug)]
enum Held {
    Http1(Option<http1::SendRequest<UpstreamBody>>),
    /// A connection of meshless's own: the response body holds it (and
    /// gives it back); the lease counts it as leased until it drops.
    Own,
    /// A stream of a shared connection: its count of open streams.
    Http2(http2::SendRequest<UpstreamBody>, Arc<AtomicUsize>),
}

impl Drop for Lease {
    fn drop(&mut self) {
        match &mut self.held {
            Held::Http1(sender) => self.pool.checkin(sender.take()),
            Held::Own => lock(&self.pool.conns).busy -= 1,
            Held::Http2(_, streams) => {
                streams.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

impl Lease {
    /// Sends on the leased connection; a request it never wrote comes back.
    async fn send(
        &mut self,
        req: Request<UpstreamBody>,
    ) -> Result<
        Response<hyper::body::Incoming>,
        hyper::client::conn::TrySendError<Request<UpstreamBody>>,
    > {
        match &mut self.held {
            Held::Http1(Some(s)) => s.try_send_request(req).await,
            Held::Http1(None) | Held::Own => {
                unreachable!("a lease's sender is taken only on drop; own leases never send")
            }
            Held::Http2(s, _) => s.try_send_request(req).await,
        }
    }

    /// Takes the connection out of the pool (it failed): an HTTP/1.1 one
    /// is dropped instead of pooled; an HTTP/2 one gets no new stream (one
    /// that received GOAWAY is not closed while its streams finish), and
    /// closes when they are done.
    fn discard(&mut self) {
        match &mut self.held {
            Held::Http1(s) => {
                s.take();
            }
            Held::Own => {}
            Held::Http2(_, streams) => {
                lock(&self.pool.conns)
                    .h2
                    .retain(|h| !Arc::ptr_eq(&h.streams, streams));
            }
        }
    }
}

impl EndpointPool {
    /// Sends `req` on an idle or shared connection, else a new one; a
    /// request a pooled connection never wrote (it was closing) is sent
    /// again on the next one, as hyper-util's pool does.
    pub async fn send(
        self: &Arc<Self>,
        req: Request<UpstreamBody>,
    ) -> Result<(Response<ResponseBody>, Lease), SendError> {
        if self.own() && upgrading(&req) {
            // Straight to a new hyper connection: none of ours is opened
            // for it (and left idle) first.
            return self.send_hyper(|| req, true).await;
        }
        self.send_once_connected(|| req).await
    }

    /// As [`EndpointPool::send`], the request made by `make` only once a
    /// connection is there: when none can be had, `make` is never called
    /// (a body it would take stays with the caller). On meshless's own
    /// HTTP/1.1 connections ([`EndpointPool::makes_once_connected`]), a
    /// request that does not ask to upgrade is made only after the last
    /// connect: a failure to connect means it was never made. hyper's
    /// client may give a made request back and connect again.
    ///
    /// A function returning its async block, with the exchange over a
    /// connection of meshless's own written out in it (not a future of
    /// its own awaited here): each future layer copies the one below it
    /// whole, hundreds of bytes per request, when it starts it.
    #[allow(clippy::manual_async_fn)] // see above
    pub fn send_once_connected(
        self: &Arc<Self>,
        make: impl FnOnce() -> Request<UpstreamBody>,
    ) -> impl Future<Output = Result<(Response<ResponseBody>, Lease), SendError>> {
        async move {
            if !self.own() {
                return self.send_hyper(make, false).await;
            }
            // Over a connection of meshless's own, driven by this task;
            // the response body gives the connection back when it may be
            // reused. A request that asks to upgrade goes through hyper
            // instead.
            let (conn, _) = self
                .checkout_http1(false)
                .await
                .map_err(SendError::Connect)?;
            let lease = Lease {
                pool: Arc::clone(self),
                held: Held::Own,
            };
            let conn = match conn {
                IdleConn::Own(c) => c,
                other => {
                    // Unused: back to the pool as it was. The request is
                    // made once the new connection is there, as every
                    // request a connection of ours takes: a failure to
                    // connect means it was never made.
                    lock(&self.conns).push_idle(other, &self.shared);
                    drop(lease);
                    return self.send_hyper(make, true).await;
                }
            };
            let req = make();
            if upgrading(&req) {
                // Unused: back to the pool as it was.
                lock(&self.conns).push_idle(IdleConn::Own(conn), &self.shared);
                drop(lease);
                return self.send_hyper(|| req, true).await;
            }
            match h1::exchange(conn, req, Arc::clone(self)).await {
                Ok(resp) => Ok((resp.map(ResponseBody::Own), lease)),
                Err(e) => Err(SendError::Exchange(e)),
            }
        }
    }

    /// Whether a request that does not ask to upgrade, sent by
    /// [`EndpointPool::send_once_connected`], is made only after the last
    /// connect (meshless's own HTTP/1.1 connections): then a failure to
    /// connect means that it was never made.
    pub fn makes_once_connected(&self) -> bool {
        self.own()
    }

    /// Whether a request with this head asks to upgrade (or is a
    /// `CONNECT`): such a request goes through hyper's client.
    pub fn upgrading_head(method: &http::Method, headers: &http::HeaderMap) -> bool {
        method == http::Method::CONNECT || headers.contains_key(http::header::UPGRADE)
    }

    /// The TLS client its connections are opened with (`tls:`), if any.
    pub fn tls(&self) -> Option<&TlsClient> {
        self.shared.settings.tls.as_ref()
    }

    /// Whether HTTP/1.1 exchanges go over meshless's own connections.
    fn own(&self) -> bool {
        let s = &self.shared.settings;
        s.protocol == UpstreamProtocol::Http1 && s.http1 == Http1Client::Meshless
    }

    /// Through hyper's client connection; on a new one when `fresh` (an
    /// upgrade in a pool of meshless's own connections).
    async fn send_hyper(
        self: &Arc<Self>,
        make: impl FnOnce() -> Request<UpstreamBody>,
        fresh_only: bool,
    ) -> Result<(Response<ResponseBody>, Lease), SendError> {
        let (mut lease, mut fresh) = self
            .checkout(fresh_only)
            .await
            .map_err(SendError::Connect)?;
        let mut req = make();
        if self.shared.settings.protocol == UpstreamProtocol::Http1 {
            super::h1::chunk_unsized_get(&mut req);
        }
        loop {
            match lease.send(req).await {
                Ok(resp) => return Ok((resp.map(ResponseBody::Hyper), lease)),
                Err(mut e) => {
                    // One stream's reset leaves its HTTP/2 connection to
                    // the other streams; anything else takes it out.
                    let reset = stream_reset(e.error());
                    if reset.is_none() {
                        lease.discard();
                    }
                    match e.take_message() {
                        Some(back) if !fresh => req = back,
                        _ if reset == Some(h2::Reason::REFUSED_STREAM) => {
                            return Err(SendError::Refused);
                        }
                        _ => return Err(SendError::Http(e.into_error())),
                    }
                }
            }
            (lease, fresh) = self
                .checkout(fresh_only)
                .await
                .map_err(SendError::Connect)?;
        }
    }

    /// Gives back a connection of meshless's own whose exchange ended
    /// cleanly (its lease still counts it until it drops).
    pub(super) fn checkin_own(&self, conn: h1::Conn) {
        lock(&self.conns).push_idle(IdleConn::Own(conn), &self.shared);
    }

    /// A hyper connection for one exchange, and whether it is new
    /// (`fresh_only`: always a new one).
    async fn checkout(self: &Arc<Self>, fresh_only: bool) -> Result<(Lease, bool), ConnectError> {
        self.start_sweeper();
        match self.shared.settings.protocol {
            UpstreamProtocol::Http1 => {
                let (conn, fresh) = self.checkout_http1(fresh_only).await?;
                match conn {
                    IdleConn::Hyper(s) => Ok((self.lease1(s), fresh)),
                    // Only a pool of meshless's own connections opens
                    // these, and it sends hyper nothing but upgrades on
                    // new connections (`fresh_only`).
                    IdleConn::Own(_) => {
                        lock(&self.conns).busy -= 1;
                        Err(ConnectError::Connect)
                    }
                }
            }
            UpstreamProtocol::Http2 => self.checkout_http2().await,
        }
    }

    /// An idle HTTP/1.1 connection (unless `fresh_only`) or a new one,
    /// counted as leased, and whether it is new.
    async fn checkout_http1(
        self: &Arc<Self>,
        fresh_only: bool,
    ) -> Result<(IdleConn, bool), ConnectError> {
        self.start_sweeper();
        let reused = if fresh_only {
            None
        } else {
            let mut c = lock(&self.conns);
            let mut found = None;
            while let Some(mut i) = c.idle.pop() {
                if i.conn.usable() {
                    found = Some(i.conn);
                    break;
                }
            }
            if found.is_some() {
                c.busy += 1;
            }
            found
        };
        if let Some(conn) = reused {
            self.preconnect();
            return Ok((conn, false));
        }
        let connecting = Connecting::start(self);
        // Boxed: opening is the rare path, and the connect's state would
        // otherwise take room in every request's future.
        let opened = Box::pin(connect::open(
            self.addr,
            &self.shared.settings,
            connecting.slot()?,
            &self.streams_hint,
            fresh_only,
        ))
        .await;
        drop(connecting);
        let conn = match opened {
            Ok(Sender::Http1(s)) => IdleConn::Hyper(s),
            Ok(Sender::Own(c)) => IdleConn::Own(c),
            Ok(Sender::Http2(..)) => return Err(ConnectError::Connect),
            Err(e) => return Err(e),
        };
        lock(&self.conns).busy += 1;
        self.preconnect();
        Ok((conn, true))
    }

    fn lease1(self: &Arc<Self>, s: http1::SendRequest<UpstreamBody>) -> Lease {
        Lease {
            pool: Arc::clone(self),
            held: Held::Http1(Some(s)),
        }
    }

    async fn checkout_http2(self: &Arc<Self>) -> Result<(Lease, bool), ConnectError> {
        loop {
            let wait = {
                let mut c = lock(&self.conns);
                c.h2.retain(|h| !h.sender.is_closed());
                if let Some(h) =
                    c.h2.iter_mut()
                        .rev()
                        .find(|h| h.streams.load(Ordering::Acquire) < h.max.get().max(1))
                {
                    h.streams.fetch_add(1, Ordering::AcqRel);
                    h.used = Instant::now();
                    let held = Held::Http2(h.sender.clone(), Arc::clone(&h.streams));
                    drop(c);
                    self.preconnect();
                    let pool = Arc::clone(self);
                    return Ok((Lease { pool, held }, false));
                }
                if c.connecting == 0 {
                    break;
                }
                let mut wait = Box::pin(self.connected.notified());
                wait.as_mut().enable();
                wait
            };
            // A connect under way: wait for it instead of opening another.
            if tokio::time::timeout(self.shared.settings.connect, wait)
                .await
                .is_err()
            {
                break;
            }
        }
        let connecting = Connecting::start(self);
        // Boxed: opening is the rare path, and the connect's state would
        // otherwise take room in every request's future.
        let opened = Box::pin(connect::open(
            self.addr,
            &self.shared.settings,
            connecting.slot()?,
            &self.streams_hint,
            false,
        ))
        .await;
        let Ok(Sender::Http2(sender, max)) = opened else {
            return Err(opened.err().unwrap_or(ConnectError::Connect));
        };
        let streams = Arc::new(AtomicUsize::new(1));
        let held = Held::Http2(sender.clone(), Arc::clone(&streams));
        lock(&self.conns).h2.push(H2 {
            sender,
            streams,
            max,
            used: Instant::now(),
        });
        drop(connecting);
        Ok((
            Lease {
                pool: Arc::clone(self),
                held,
            },
            true,
        ))
    }

    /// Ends a lease of an HTTP/1.1 connection and puts the connection
    /// back: at once when it is ready for another request, else when it
    /// becomes so (its response is still being read off the socket);
    /// closed ones, and those over `max_idle_per_endpoint`, are dropped
    /// (and in a pool of meshless's own connections, hyper's, which only
    /// upgrades use).
    fn checkin(self: &Arc<Self>, sender: Option<http1::SendRequest<UpstreamBody>>) {
        let own = self.own();
        let waiting = {
            let mut c = lock(&self.conns);
            c.busy -= 1;
            match sender {
                Some(s) if s.is_ready() && !own => {
                    c.push_idle(IdleConn::Hyper(s), &self.shared);
                    None
                }
                Some(s) if !s.is_closed() && !own => Some(s),
                _ => None,
            }
        };
        let Some(mut sender) = waiting else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let pool = Arc::clone(self);
        rt.spawn(async move {
            if sender.ready().await.is_ok() {
                lock(&pool.conns).push_idle(IdleConn::Hyper(sender), &pool.shared);
            }
        });
    }

    /// Opens connections in the background until there are
    /// `ceil(preconnect_ratio x in use)` (Envoy's
    /// `per_upstream_preconnect_ratio`): HTTP/1.1 connections per leased
    /// one, HTTP/2 stream room per open stream.
    fn preconnect(self: &Arc<Self>) {
        let ratio = self.shared.settings.preconnect_milli;
        if ratio <= 1000 {
            return;
        }
        let missing = {
            let mut c = lock(&self.conns);
            let n = c.missing(ratio, self.shared.settings.protocol);
            c.connecting += n;
            n
        };
        for _ in 0..missing {
            let connecting = Connecting {
                pool: Arc::clone(self),
            };
            // Each guard uncounts its connect, the refused ones too.
            let Ok(slot) = connecting.slot() else {
                continue;
            };
            tokio::spawn(async move {
                let pool = &connecting.pool;
                let opened = connect::open(
                    pool.addr,
                    &pool.shared.settings,
                    slot,
                    &pool.streams_hint,
                    false,
                );
                match opened.await {
                    // Pooled only once its connection task has taken it
                    // up: until then `is_ready` is false, and a sweep or a
                    // checkout would take it for a closed one.
                    Ok(Sender::Http1(mut s)) => {
                        if s.ready().await.is_ok() {
                            lock(&pool.conns).push_idle(IdleConn::Hyper(s), &pool.shared);
                        }
                    }
                    Ok(Sender::Own(c)) => {
                        lock(&pool.conns).push_idle(IdleConn::Own(c), &pool.shared);
                    }
                    Ok(Sender::Http2(sender, max)) => lock(&pool.conns).h2.push(H2 {
                        sender,
                        streams: Arc::default(),
                        max,
                        used: Instant::now(),
                    }),
                    Err(_) => {}
                }
                drop(connecting);
            });
        }
    }

    /// Closes idle connections older than `timeouts.idle`, and HTTP/2
    /// connections without a stream for that long.
    fn sweep(&self, now: Instant) {
        let idle = self.shared.settings.idle;
        let mut c = lock(&self.conns);
        c.idle
            .retain_mut(|i| now.duration_since(i.since) < idle && i.conn.usable());
        c.h2.retain(|h| {
            !h.sender.is_closed()
                && (h.streams.load(Ordering::Acquire) > 0 || now.duration_since(h.used) < idle)
        });
    }

    /// Starts the pool's sweeper once, on the runtime of the first request.
    fn start_sweeper(&self) {
        if self.shared.sweeping.load(Ordering::Relaxed)
            || self.shared.sweeping.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let shared = Arc::downgrade(&self.shared);
        // At least every second: an idle connection of meshless's own has
        // no task reading it, so one its upstream closed (a keep-alive
        // timeout) is found closed here (`usable`), and closed, within a
        // second instead of sitting in CLOSE-WAIT until the idle timeout.
        // The period stays far from where `Instant + period` overflows.
        let every = (self.shared.settings.idle / 2).clamp(Duration::from_millis(10), SWEEP_MAX);
        tokio::spawn(async move {
            // The first sweep one period from now, not at once.
            let start = crate::limits::deadline_after(tokio::time::Instant::now(), every);
            let mut tick = tokio::time::interval_at(start, every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                let pools: Vec<_> = lock(&shared.endpoints)
                    .values()
                    .filter_map(Weak::upgrade)
                    .collect();
                drop(shared);
                let now = Instant::now();
                for p in pools {
                    p.sweep(now);
                }
            }
        });
    }
}

impl Conns {
    fn push_idle(&mut self, conn: IdleConn, shared: &Shared) {
        if self.idle.len() < shared.settings.max_idle {
            self.idle.push(Idle {
                conn,
                since: Instant::now(),
                _gauge: IdleGauge::new(&shared.counters),
            });
        }
    }

    /// Connections to open so that there are `ratio` x those in use:
    /// HTTP/1.1 connections per leased one; for HTTP/2, stream room per
    /// open stream, one connection at a time (a new one's room is unknown
    /// until its peer's settings arrive).
    fn missing(&self, ratio: u32, protocol: UpstreamProtocol) -> usize {
        let (in_use, have) = match protocol {
            UpstreamProtocol::Http1 => (self.busy, self.busy + self.idle.len() + self.connecting),
            UpstreamProtocol::Http2 => {
                if self.connecting > 0 {
                    return 0;
                }
                let streams = self.h2.iter().map(|h| h.streams.load(Ordering::Relaxed));
                let room = self.h2.iter().map(|h| h.max.get());
                (streams.sum(), room.sum())
            }
        };
        let missing = to_open(ratio, in_use, have);
        match protocol {
            UpstreamProtocol::Http1 => missing,
            UpstreamProtocol::Http2 => usize::from(missing > 0),
        }
    }
}

/// Envoy's pre-connect rule: with `in_use` connections (or streams) in
/// use and `have` open or opening, how many to open so that there are
/// `ceil(ratio x in_use)`, in integers (`ratio_milli` is the ratio in
/// thousandths): no float rounding up past the exact product.
fn to_open(ratio_milli: u32, in_use: usize, have: usize) -> usize {
    let wanted = (ratio_milli as usize * in_use).div_ceil(1000);
    wanted.saturating_sub(have)
}

/// A connect under way, counted while it lasts; the pool's waiters are
/// woken when it ends, however it ends.
#[derive(Debug)]
struct Connecting {
    pool: Arc<EndpointPool>,
}

impl Connecting {
    fn start(pool: &Arc<EndpointPool>) -> Self {
        lock(&pool.conns).connecting += 1;
        Self {
            pool: Arc::clone(pool),
        }
    }

    /// A `max_connections` slot for this connect.
    fn slot(&self) -> Result<OpenSlot, ConnectError> {
        OpenSlot::reserve(&self.pool.shared.counters)
    }
}

impl Drop for Connecting {
    fn drop(&mut self) {
        lock(&self.pool.conns).connecting -= 1;
        self.pool.connected.notify_waiters();
    }
}

/// The longest time between two sweeps of a pool's idle connections.
const SWEEP_MAX: Duration = Duration::from_secs(1);

/// Whether `req` asks to switch protocols (`Upgrade`, `CONNECT`): hyper
/// carries those, on a connection of its own.
fn upgrading<B>(req: &Request<B>) -> bool {
    EndpointPool::upgrading_head(req.method(), req.headers())
}

#[cfg(test)]
mod tests {
    use super::to_open;
    use proptest::prelude::*;

    proptest! {
        /// The fewest connections that bring the total to at least
        /// `ratio x in use`, stated in thousandths:
        /// `1000 x total >= ratio_milli x in_use`.
        #[test]
        fn preconnect_opens_the_fewest_that_reach_the_ratio(
            milli in 1000u32..=3000, in_use in 0usize..500, extra in 0usize..500,
        ) {
            let have = in_use + extra;
            let n = to_open(milli, in_use, have);
            let enough = |total: usize| 1000 * total >= milli as usize * in_use;
            prop_assert!(enough(have + n));
            prop_assert!(n == 0 || !enough(have + n - 1));
        }
    }

    #[test]
    fn a_ratio_of_one_opens_nothing_ahead() {
        for busy in 0..100 {
            assert_eq!(to_open(1000, busy, busy), 0);
        }
        assert_eq!(to_open(1500, 2, 2), 1);
        assert_eq!(to_open(3000, 1, 1), 2);
        assert_eq!(to_open(1100, 10, 10), 1);
    }
}
