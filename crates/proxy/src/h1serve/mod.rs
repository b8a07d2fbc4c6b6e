//! Downstream HTTP/1.1 served by a connection state machine of our own on
//! meshless-h1 (`listeners[].http1: meshless`), instead of hyper's:
//!
//! ```text
//! wait for a head -> parse (buffer borrowed) -> request::handle polled
//!   here, body fed on demand -> response written -> next head or close
//! ```
//!
//! Invariants:
//! - An idle keep-alive connection holds no buffer: a read buffer is
//!   borrowed from the worker's pool ([`pool`]) only for a read that
//!   returns bytes, and given back whenever none are pending.
//! - The request's future is polled by this task; a client that closes
//!   (mid-head, mid-body, while the upstream answers, mid-response) ends
//!   the exchange and drops the future, so every guard in it runs.
//! - Framing is meshless-h1's (hyper's decisions, proven by its
//!   differential test); a refused head is answered as the screen stage
//!   answers what it refuses (its status, a reason in the body, counted in
//!   `local_replies_total`, `connection: close`) and the connection closed.
//! - A connection closed while the client may still be sending (a refused
//!   head, a request body left unread) closes as nginx's `lingering_close`
//!   does: the write side is shut, then what comes is read and discarded
//!   until the client closes, for at most [`LINGER`]; closing with unread
//!   bytes would send a reset, which can cost the client the response.
//! - Anything rare stays on hyper: a request with `Upgrade` or `CONNECT`
//!   hands the connection over to hyper's HTTP/1 server for the rest of
//!   its life, the bytes already read replayed first ([`Prefixed`]).

mod head;
pub mod pool;
mod prefixed;
mod write;

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::BytesMut;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tokio::time::Instant;

pub use crate::request::h1_body::RequestBody;
pub use prefixed::Prefixed;

use crate::drain::Drain;
use crate::limits::ListenerSettings;
use crate::pooled_future::PooledFuture;
use crate::request::body::ProxyBody;
use crate::request::downstream::Source;
use crate::request::h1_body::{Feeder, Need};
use crate::request::{Downstream, Peer};
use head::Head;
use pool::Lent;
use write::{Answering, Writer};

pub use crate::limits::Http1Server;
pub use crate::wait_read::WaitRead;

/// Most bytes of a request body left unread after its response that are
/// read and discarded to keep the connection; a longer rest closes it.
const DRAIN_MAX: u64 = 64 * 1024;

/// How long the first request of a connection not yet registered with the
/// reactor (one whose reads and writes have not had to wait:
/// [`WaitRead::registered`]) waits on its upstream before its client is
/// watched for leaving: at least this, at most twice this (the listener's
/// [`WatchClock`] ticks once per period). Registering costs two system
/// calls and an allocation that a new connection answered sooner never
/// needs. A registered connection, and any later request, is watched at
/// once.
///
/// [`WatchClock`]: crate::watch_clock::WatchClock
pub const WATCH_AFTER: std::time::Duration = std::time::Duration::from_millis(10);

/// The longest a closing connection reads and discards what its client
/// still sends (lingering close; nginx's `lingering_time` is 30 s, with 5 s
/// between reads): long enough for a response to reach a client that is
/// still sending, short enough that a client that never stops costs little.
pub const LINGER: std::time::Duration = std::time::Duration::from_secs(2);

/// What a request handler's future gives.
type Handled = Result<http::Response<ProxyBody>, std::convert::Infallible>;

/// One downstream HTTP/1 connection.
struct Conn<I> {
    io: I,
    /// Bytes read and not yet used; `None` whenever there are none.
    buf: Option<Lent>,
    gauge: Gauge,
    draining: watch::Receiver<Drain>,
    drain: Drain,
    /// The listener drains: the next response closes the connection.
    close_after: bool,
    /// The client ended its side with requests still buffered (pipelined,
    /// then a half-close): they are answered, then the connection closes.
    eof: bool,
    /// The connection closes while the client may still be sending: read
    /// and discard before closing ([`LINGER`]).
    linger: bool,
    /// The wait for a head's timer ([`Conn::next_head`]), made on the
    /// first wait and kept: armed at some earlier wait's deadline, at or
    /// before the current one, it is moved on only when it fires early.
    /// Not one timer registered and removed per request.
    head_timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// No exchange has ended on this connection yet: only the first
    /// request's watch for the client leaving waits [`WATCH_AFTER`] on a
    /// connection not yet registered; a kept connection is registered
    /// (once) by the watch of its next request.
    first_exchange: bool,
}

/// What waiting for a head gave: what the head was made into
/// ([`Conn::next_head`]'s `start`), so that the head itself is not moved
/// through this (a few hundred bytes, copied at each move).
enum Next<S> {
    Started(S),
    /// A refused head, answered as the codec's error says and closed.
    Refused(meshless_h1::Error),
    /// The client closed, the head timed out, or the listener drained.
    Closed,
}

/// What a head is made into: the exchange that serves it, or, for a
/// request to upgrade, the head itself for hyper (boxed: rare).
enum Started<S> {
    Serving(S),
    Upgrade(Box<Head>),
}

/// Serves HTTP/1.1 on `io` until the connection closes or its listener
/// drains; `first` holds bytes already read from `io`, if any.
///
/// This future is the connection task's for its whole life, idle
/// included, so it is kept small: what an exchange needs lives in a box
/// made per request ([`Conn::begin`]), a hand-over is boxed, and this is a
/// function returning an async block (an `async fn` would store its
/// arguments twice).
#[allow(clippy::manual_async_fn)] // see above: arguments stored once
pub fn serve<I>(
    downstream: Arc<Downstream>,
    io: I,
    first: Option<Lent>,
    peer: Peer,
    draining: watch::Receiver<Drain>,
) -> impl Future<Output = ()> + Send + 'static
where
    I: AsyncRead + AsyncWrite + WaitRead + Unpin + Send + 'static,
{
    let gauge = downstream.http1_buffers().clone();
    let drain = *draining.borrow();
    let mut conn = Conn {
        io,
        buf: first,
        gauge,
        draining,
        drain,
        close_after: drain != Drain::Serving,
        eof: false,
        linger: false,
        head_timer: None,
        first_exchange: true,
    };
    async move {
        let refused = loop {
            let settings = downstream.settings();
            let start = |conn: &mut Conn<I>, head: Head| {
                if head.framing.upgrade {
                    // Rare: boxed, so the common case moves a pointer.
                    Started::Upgrade(Box::new(head))
                } else {
                    Started::Serving(conn.begin(&downstream, &peer, head, &settings))
                }
            };
            let mut serving = match conn.next_head(&settings, start).await {
                Next::Started(Started::Serving(serving)) => serving,
                Next::Started(Started::Upgrade(head)) => {
                    Box::pin(conn.hand_over(downstream, peer, *head)).await;
                    return;
                }
                Next::Refused(e) => break Some(e),
                Next::Closed => break None,
            };
            // A drain that starts meanwhile is seen when the response head
            // is made and when it ends (`draining_now`): no waiter per
            // request.
            let keep = poll_fn(|cx| conn.poll_serving(serving.as_mut(), cx)).await;
            let ex = serving.as_mut().project().ex;
            if ex.send_timed_out {
                downstream.state.metrics.send_timeout(&downstream.name);
            }
            if !keep {
                conn.linger = conn.client_may_send(ex);
            }
            conn.end(ex);
            drop(serving);
            if !keep {
                break None;
            }
        };
        if let Some(e) = refused {
            // Made before the write: only its bytes are held across it.
            let out = refusal(&downstream, &peer, e);
            let send_for = downstream.settings().timeouts.send;
            conn.linger = match tokio::time::timeout(send_for, conn.io.write_all(&out)).await {
                Ok(written) => written.is_ok(),
                Err(_) => {
                    downstream.state.metrics.send_timeout(&downstream.name);
                    false
                }
            };
        }
        drop(conn.buf.take());
        let bound = downstream.settings().timeouts.request_headers;
        let shut = tokio::time::timeout(bound, conn.io.shutdown()).await;
        if conn.linger && matches!(shut, Ok(Ok(()))) {
            // Boxed: rare, and inline it would size every connection's task.
            Box::pin(conn.linger()).await;
        }
    }
}

/// The answer to a head the codec refused, counted in
/// `local_replies_total`: `414` and `431` as the screen stage answers them
/// (`http1: hyper` passes heads within its buffer to it), `505` for a
/// well-formed version of another major (`HTTP/2.0`), and `400` naming the
/// cause for the rest.
fn refusal(downstream: &Downstream, peer: &Peer, e: meshless_h1::Error) -> Vec<u8> {
    let reply = refusal_reply(&e, &downstream.settings().limits);
    let state = &downstream.state;
    state.metrics.local_reply(&downstream.name, reply.reason);
    // One access-log line, as for every request (`http1: hyper` logs the
    // heads that reach its service too): nothing of the request is known
    // but the peer, so method and path are `-`.
    let logger = state.access_log.load();
    if logger.enabled() {
        let client = peer.addr.ip().to_string();
        let record = crate::access_log::AccessRecord {
            time: crate::access_log::now(),
            listener: &downstream.name,
            client: &client,
            route: "-",
            cluster: "-",
            endpoint: "-",
            method: "-",
            path: "-",
            status: reply.status.as_u16(),
            bytes: reply.body.len() as u64,
            duration_ms: 0.0,
            request_id: "-",
            attempts: 0,
            fault: Some("client_error"),
            cut: None,
            grpc_status: None,
        };
        logger.log(&record, &state.metrics.access_log_dropped);
    }
    write::refusal(&reply)
}

fn refusal_reply(
    e: &meshless_h1::Error,
    limits: &crate::limits::HeadLimits,
) -> crate::request::respond::LocalReply {
    use crate::request::respond::LocalReply;
    use crate::request::screen;
    match e {
        meshless_h1::Error::UriTooLong => screen::uri_too_long(limits),
        meshless_h1::Error::HeadTooLarge => screen::headers_too_large(limits),
        meshless_h1::Error::Version => LocalReply::text(
            http::StatusCode::HTTP_VERSION_NOT_SUPPORTED,
            "HTTP version not supported: HTTP/1.1 and HTTP/1.0 are\n",
            "version_not_supported",
        ),
        other => LocalReply::text(other.status(), format!("{other}\n"), "malformed_request"),
    }
}

/// The codec's limits from the listener's.
fn limits(settings: &ListenerSettings) -> meshless_h1::Limits {
    let l = &settings.limits;
    meshless_h1::Limits {
        max_header_bytes: l.max_header_bytes as usize,
        max_headers: l.max_headers as usize,
        max_uri_bytes: l.max_uri_bytes as usize,
    }
}

/// Reads into `buf`, borrowing one once `io` is ready and giving it back
/// if the read found nothing: `Ready(Ok(0))` is the end of the stream.
pub(crate) fn poll_fill<I: AsyncRead + WaitRead + Unpin>(
    io: &mut I,
    buf: &mut Option<Lent>,
    gauge: &Gauge,
    cx: &mut Context<'_>,
) -> Poll<std::io::Result<usize>> {
    if buf.is_none() {
        ready!(io.poll_read_ready(cx))?;
    }
    let b = buf.get_or_insert_with(|| Lent::borrow(gauge));
    if b.capacity() - b.len() < 1024 {
        b.reserve(pool::BUF_SIZE);
    }
    let polled = tokio_util::io::poll_read_buf(Pin::new(io), cx, &mut **b);
    if b.is_empty() && !matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
        *buf = None;
    }
    polled
}

/// Waits for the listener to ask more of its connections than `now`:
/// `Now` once the drain ends (or the listener is gone).
async fn drained(rx: &mut watch::Receiver<Drain>, now: Drain) -> Drain {
    match now {
        Drain::Serving => rx
            .wait_for(|d| *d != Drain::Serving)
            .await
            .map_or(Drain::Now, |d| *d),
        Drain::OnNextResponse => {
            let _ = rx.wait_for(|d| *d == Drain::Now).await;
            Drain::Now
        }
        Drain::Now => std::future::pending().await,
    }
}

impl<I: AsyncRead + AsyncWrite + WaitRead + Unpin + Send + 'static> Conn<I> {
    /// Whether the listener asks this connection to close after its
    /// response (a drain of either kind started; the listener gone).
    fn draining_now(&mut self) -> bool {
        if !self.close_after && self.draining.has_changed().unwrap_or(true) {
            let d = *self.draining.borrow_and_update();
            if d != Drain::Serving || self.draining.has_changed().is_err() {
                self.drain = if d == Drain::Serving { Drain::Now } else { d };
                self.close_after = true;
            }
        }
        self.close_after
    }

    fn pending_bytes(&self) -> bool {
        self.buf.as_ref().is_some_and(|b| !b.is_empty())
    }

    /// Whether the client may still be sending when the exchange `ex`
    /// closes the connection after its response: its body was left unread
    /// or its framing broke, or bytes follow it (nginx's heuristics for a
    /// lingering close). Not when the client closed or half-closed.
    fn client_may_send(&self, ex: &Exchange) -> bool {
        if !ex.written || self.eof || (ex.read_closed && !ex.broken) {
            return false;
        }
        ex.broken || ex.feeder.as_ref().is_some_and(|f| !f.finished()) || self.pending_bytes()
    }

    /// Lingering close, after the write side is shut: reads and discards
    /// what the client still sends until it closes (or fails), [`LINGER`]
    /// passes, or the listener's drain starts (or turns to `Now`)
    /// meanwhile: bounded, so a drain waits for it 2 s at most.
    async fn linger(mut self) {
        let until = Instant::now() + LINGER;
        let mut sink = Lent::borrow(&self.gauge);
        loop {
            sink.clear();
            let read = tokio::io::AsyncReadExt::read_buf(&mut self.io, &mut *sink);
            tokio::select! {
                r = tokio::time::timeout_at(until, read) => match r {
                    Ok(Ok(n)) if n > 0 => {}
                    _ => return,
                },
                _ = drained(&mut self.draining, self.drain) => return,
            }
        }
    }

    /// Reads until a whole head is buffered, within
    /// `timeouts.request_headers` of starting to wait (so an idle
    /// keep-alive connection closes after it too, as with hyper).
    /// The head is handed to `start` at once, and what it makes returned.
    async fn next_head<S>(
        &mut self,
        settings: &ListenerSettings,
        start: impl FnOnce(&mut Self, Head) -> S,
    ) -> Next<S> {
        let deadline =
            crate::limits::deadline_after(Instant::now(), settings.timeouts.request_headers);
        let limits = limits(settings);
        loop {
            if let Some(buf) = self.buf.as_mut().filter(|b| !b.is_empty()) {
                match head::take(buf, &limits) {
                    Ok(Some(h)) => return Next::Started(start(self, h)),
                    Ok(None) => {}
                    Err(e) => return Next::Refused(e),
                }
            }
            if self.eof {
                // Nothing more will come: a partial head is dropped.
                return Next::Closed;
            }
            let read = poll_fn(|cx| poll_fill(&mut self.io, &mut self.buf, &self.gauge, cx));
            let timer = self
                .head_timer
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
            if timer.deadline() > deadline {
                // The settings shortened the wait since it was armed.
                timer.as_mut().reset(deadline);
            }
            tokio::select! {
                // Read first: bytes that are there win over a deadline
                // that passed meanwhile, as with `timeout_at`.
                biased;
                r = read => match r {
                    Ok(n) if n > 0 => {}
                    // Failed, or closed (mid-head or not).
                    _ => return Next::Closed,
                },
                () = timer.as_mut() => {
                    if Instant::now() >= deadline {
                        return Next::Closed;
                    }
                    // Armed for an earlier wait: on to this one's deadline.
                    timer.as_mut().reset(deadline);
                }
                d = drained(&mut self.draining, self.drain) => {
                    self.drain = d;
                    self.close_after = true;
                    if d == Drain::Now && !self.pending_bytes() {
                        return Next::Closed;
                    }
                }
            }
        }
    }

    /// Starts serving the request of `head`: its handler's future (polled
    /// by [`Conn::poll_exchange`]), its body fed as it is wanted, its
    /// response written. Boxed ([`Serving`]): the exchange (with its
    /// response writer) is several hundred bytes that an idle
    /// connection's task would otherwise carry. The handler's future,
    /// kilobytes, is in a box of its own reused per worker thread
    /// ([`PooledFuture`]): one of its size costs the allocator about
    /// twenty times a small one's.
    fn begin(
        &mut self,
        downstream: &Arc<Downstream>,
        peer: &Peer,
        head: Head,
        settings: &ListenerSettings,
    ) -> Pin<Box<Serving<impl Future<Output = Handled> + Send + use<I>>>> {
        let Head { parts, framing, .. } = head;
        let (feeder, body) = if framing.body == meshless_h1::Body::Empty {
            (None, RequestBody::empty())
        } else {
            let (f, b) = Feeder::new(&framing, limits(settings).slots());
            (Some(f), b)
        };
        let answering = Answering {
            method: parts.method.clone(),
            version: parts.version,
            keep_alive: framing.keep_alive,
        };
        // Made in its allocation (`Box::write` into a box taken first),
        // which lets the compiler build it there: `Box::new` of a value
        // built before it copies the whole of it.
        let serving = Box::write(
            Box::new_uninit(),
            Serving {
                ex: Exchange::new(
                    feeder,
                    answering,
                    Lent::borrow(&self.gauge),
                    limits(settings).max_head_bytes(),
                    (settings.timeouts.request_headers, settings.timeouts.send),
                ),
                fut: Some(PooledFuture::new(|| {
                    crate::request::handle(
                        Arc::clone(downstream),
                        peer.clone(),
                        parts,
                        Source::H1(body),
                    )
                })),
            },
        );
        let mut serving = Box::into_pin(serving);
        if self.first_exchange && !self.io.registered() {
            let clock = Arc::clone(&downstream.watch_clock);
            let due = clock.ticks() + 2;
            serving.as_mut().project().ex.late_watch = Some(LateWatch {
                clock,
                due,
                queued: None,
            });
        }
        serving
    }

    /// After an exchange: the write buffer goes back to the pool, and so
    /// does the read buffer unless it holds what follows.
    fn end(&mut self, ex: &mut Exchange) {
        self.first_exchange = false;
        if let (Some(w), Some(mut out)) = (ex.writer.take(), ex.out.take()) {
            *out = w.into_buffer();
        }
        // Empty lines after a message (old clients send CRLF after a
        // body) are ignored before the next head (RFC 9112 2.2): they do
        // not keep the buffer of an idle connection.
        let empty_lines = self
            .buf
            .as_ref()
            .is_some_and(|b| meshless_h1::request::only_empty_lines(b));
        if !self.pending_bytes() || empty_lines {
            drop(self.buf.take());
        }
    }

    /// Drives one request under way; `Ready(keep_alive)` when it is over.
    fn poll_serving<F: Future<Output = Handled>>(
        &mut self,
        serving: Pin<&mut Serving<F>>,
        cx: &mut Context<'_>,
    ) -> Poll<bool> {
        let this = serving.project();
        self.poll_exchange(this.ex, this.fut, cx)
    }

    /// Drives one exchange and its handler's future `fut`;
    /// `Ready(keep_alive)` when it is over.
    fn poll_exchange<F: Future<Output = Handled>>(
        &mut self,
        ex: &mut Exchange,
        mut fut: Pin<&mut Option<F>>,
        cx: &mut Context<'_>,
    ) -> Poll<bool> {
        loop {
            let mut progress = false;
            match self.poll_continue(ex, cx) {
                Poll::Ready(Err(())) => return Poll::Ready(false),
                Poll::Ready(Ok(())) | Poll::Pending => {}
            }
            match self.poll_feed(ex, cx) {
                Poll::Ready(()) => progress = true,
                Poll::Pending => {}
            }
            if let Some(f) = fut.as_mut().as_pin_mut()
                && let Poll::Ready(Ok(resp)) = f.poll(cx)
            {
                fut.set(None);
                let out = ex
                    .out
                    .as_mut()
                    .map(|o| std::mem::take(&mut **o))
                    .unwrap_or_default();
                // Say `connection: close` when the connection will close
                // after this answer anyway (RFC 9112 9.6): a body the
                // client was never told to send (`100 Continue` owed) or
                // with more declared bytes left than are ever discarded
                // to keep it (as `after_response` decides).
                let unread = ex.feeder.as_ref().is_some_and(|f| {
                    !f.finished()
                        && (f.continue_due
                            || f.length_left()
                                .is_some_and(|l| f.discarded.saturating_add(l) > DRAIN_MAX))
                });
                let close = self.draining_now() || unread;
                let writer = Writer::new(resp, &ex.answering, close, out).or_else(|refused| {
                    // Not a connection closed with no byte (a client
                    // would take it for a stale keep-alive one and
                    // retry): a 502 in its place.
                    tracing::debug!(error = %refused.error, "response head not writable");
                    let (resp, out) = refused.bad_gateway();
                    Writer::new(resp, &ex.answering, close, out)
                });
                match writer {
                    Ok(w) => ex.writer = Some(w),
                    Err(_) => return Poll::Ready(false),
                }
                progress = true;
            }
            // The interim line is finished before any byte of the response.
            let interim_out = !ex.continue_out.is_empty();
            if let Some(w) = ex.writer.as_mut().filter(|_| !ex.written && !interim_out) {
                match w.poll_write(&mut self.io, cx) {
                    Poll::Ready(Ok(())) => {
                        ex.written = true;
                        progress = true;
                    }
                    Poll::Ready(Err(_)) => return Poll::Ready(false),
                    Poll::Pending => {}
                }
            }
            if ex.written {
                match self.after_response(ex) {
                    After::Done(keep) => return Poll::Ready(keep),
                    After::Discard { started } => {
                        if started {
                            let until = tokio::time::sleep(ex.discard_for);
                            ex.discard_until = Some(Box::pin(until));
                        }
                        progress |= started;
                    }
                }
                if let Some(until) = ex.discard_until.as_mut()
                    && until.as_mut().poll(cx).is_ready()
                {
                    return Poll::Ready(false);
                }
            } else if !ex.read_closed
                && !self.eof
                && ex.feeder.as_ref().is_none_or(Feeder::finished)
            {
                // Waiting on the upstream: watch for the client leaving.
                match self.poll_watch(ex, cx) {
                    Poll::Ready(Ok(())) => progress = true,
                    Poll::Ready(Err(())) => return Poll::Ready(false),
                    Poll::Pending => {}
                }
            }
            if !progress {
                if self.poll_stall(ex, cx).is_ready() {
                    ex.send_timed_out = true;
                    return Poll::Ready(false);
                }
                return Poll::Pending;
            }
        }
    }

    /// Bounds a write the client takes no byte of: `Ready` once the `100
    /// Continue` or the response has waited `timeouts.send` with nothing
    /// moving (nginx's `send_timeout`: the time between two writes that
    /// move bytes, not the whole response's). A response whose body is
    /// still coming is bounded too: its deadline may be far, or none.
    fn poll_stall(&mut self, ex: &mut Exchange, cx: &mut Context<'_>) -> Poll<()> {
        // Progress is the interim line's bytes left or the response's
        // drains that moved bytes, and the bytes the socket took (under
        // TLS, rustls takes what is written before the client does).
        let sent = self.io.sent();
        let mark = if !ex.continue_out.is_empty() || ex.continue_flushing {
            (true, ex.continue_out.len() as u64, sent)
        } else if let Some(w) = ex.writer.as_ref().filter(|w| w.stalled && !ex.written) {
            (false, w.moved, sent)
        } else {
            return Poll::Pending;
        };
        // The clock is read only when the timer is armed or moved on.
        let send_for = ex.send_for;
        let deadline = || crate::limits::deadline_after(Instant::now(), send_for);
        let stall = match &mut ex.stall {
            Some(t) => {
                if ex.stall_mark != mark {
                    t.as_mut().reset(deadline());
                }
                t
            }
            None => ex
                .stall
                .insert(Box::pin(tokio::time::sleep_until(deadline()))),
        };
        ex.stall_mark = mark;
        stall.as_mut().poll(cx)
    }

    /// Once the response is written: whether to keep the connection, or
    /// to discard the rest of a body left unread first.
    fn after_response(&mut self, ex: &mut Exchange) -> After {
        let closing = ex.broken || ex.read_closed || ex.writer.as_ref().is_none_or(|w| w.close);
        // A drain that began after this response's head was made: `Now`
        // closes at once (as hyper's graceful shutdown does); on
        // `OnNextResponse` the connection stays, as the head promised, and
        // the next response says `connection: close`.
        self.draining_now();
        if closing || self.drain == Drain::Now {
            return After::Done(false);
        }
        let Some(f) = ex.feeder.as_mut() else {
            return After::Done(true);
        };
        if f.finished() {
            return After::Done(true);
        }
        // The client was never told to send it (no `100 Continue`), or
        // too much is left: close rather than read it.
        if f.continue_due || f.discarded > DRAIN_MAX {
            return After::Done(false);
        }
        let started = !f.discarding;
        f.abandon();
        After::Discard { started }
    }

    /// Writes `100 Continue` once the body is first wanted, before any
    /// response. `Err` when the client is gone.
    fn poll_continue(&mut self, ex: &mut Exchange, cx: &mut Context<'_>) -> Poll<Result<(), ()>> {
        if let Some(f) = ex.feeder.as_mut()
            && f.continue_due
            && ex.writer.is_none()
            && f.wanted()
        {
            f.continue_due = false;
            ex.continue_out = b"HTTP/1.1 100 Continue\r\n\r\n";
        }
        while !ex.continue_out.is_empty() {
            match Pin::new(&mut self.io).poll_write(cx, ex.continue_out) {
                Poll::Ready(Ok(n)) if n > 0 => ex.continue_out = &ex.continue_out[n..],
                Poll::Ready(_) => return Poll::Ready(Err(())),
                Poll::Pending => return Poll::Pending,
            }
        }
        if ex.writer.is_none() {
            // Flushed before the body is read (TLS buffers writes).
            ex.continue_flushing = Pin::new(&mut self.io).poll_flush(cx).is_pending();
        } else {
            ex.continue_flushing = false;
        }
        Poll::Ready(Ok(()))
    }

    /// Feeds the request body from the buffer and the connection;
    /// `Ready` when something was read or handed over.
    fn poll_feed(&mut self, ex: &mut Exchange, cx: &mut Context<'_>) -> Poll<()> {
        let Some(f) = ex.feeder.as_mut() else {
            return Poll::Pending;
        };
        // A body dropped unread is discarded up to a bound while the
        // response is pending too; past it, nothing more is read and the
        // connection closes after the response (`after_response`).
        if f.finished() || ex.read_closed || (f.discarding && f.discarded > DRAIN_MAX) {
            return Poll::Pending;
        }
        let mut none = BytesMut::new();
        let buf = self.buf.as_deref_mut().unwrap_or(&mut none);
        match f.feed(buf, cx) {
            Ok(Need::Nothing) | Ok(Need::Done) => Poll::Pending,
            Err(_) => {
                // Framing is lost: nothing more can be read.
                ex.broken = true;
                ex.read_closed = true;
                Poll::Ready(())
            }
            Ok(Need::Bytes) => match poll_fill(&mut self.io, &mut self.buf, &self.gauge, cx) {
                Poll::Ready(Ok(n)) if n > 0 => Poll::Ready(()),
                Poll::Ready(Ok(_)) => {
                    f.cut("the client closed the connection");
                    ex.read_closed = true;
                    Poll::Ready(())
                }
                Poll::Ready(Err(_)) => {
                    f.cut("the connection failed");
                    ex.read_closed = true;
                    Poll::Ready(())
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    /// While the response is awaited with the whole body read: reads what
    /// comes next (a pipelined request, up to a head's worth) so that a
    /// client that closes is seen. `Err` when it closed with nothing
    /// buffered (the request is dropped, as hyper drops it); a close after
    /// pipelined bytes is a half-close (`eof`): those are served first.
    fn poll_watch(&mut self, ex: &mut Exchange, cx: &mut Context<'_>) -> Poll<Result<(), ()>> {
        if self
            .buf
            .as_ref()
            .is_some_and(|b| b.len() >= ex.max_buffered)
        {
            return Poll::Pending;
        }
        if let Some(late) = ex.late_watch.as_mut()
            && !self.io.registered()
        {
            // Watching an unregistered socket would register it: an
            // upstream that answers within WATCH_AFTER spares that.
            let now = late.clock.ticks();
            if now < late.due {
                if late.queued != Some(now) {
                    late.queued = Some(now);
                    late.clock.wake_after_tick(cx.waker());
                }
                return Poll::Pending;
            }
        }
        match poll_fill(&mut self.io, &mut self.buf, &self.gauge, cx) {
            Poll::Ready(Ok(n)) if n > 0 => Poll::Ready(Ok(())),
            Poll::Ready(Ok(_)) if self.pending_bytes() => {
                self.eof = true;
                Poll::Ready(Ok(()))
            }
            Poll::Ready(_) => Poll::Ready(Err(())),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Hands the connection to hyper's HTTP/1 server, `head` and what
    /// follows it in the buffer replayed first.
    async fn hand_over(mut self, downstream: Arc<Downstream>, peer: Peer, head: Head) {
        let prefix = match self.buf.take() {
            Some(rest) if !rest.is_empty() => {
                let mut all = BytesMut::with_capacity(head.raw.len() + rest.len());
                all.extend_from_slice(&head.raw);
                all.extend_from_slice(&rest);
                all.freeze()
            }
            _ => head.raw,
        };
        let io = Prefixed::new(prefix, self.io);
        crate::hyper_h1::serve(downstream, io, peer, self.draining).await;
    }
}

/// What follows a written response.
enum After {
    /// The exchange is over: keep the connection or not.
    Done(bool),
    /// The rest of the request body is being discarded (`started` now).
    Discard { started: bool },
}

pin_project_lite::pin_project! {
    /// One request under way on a connection: its handler's future beside
    /// the exchange's state, one allocation (they were two boxes).
    struct Serving<F> {
        ex: Exchange,
        #[pin]
        fut: Option<F>,
    }
}

/// The state of one request under way on a connection.
struct Exchange {
    writer: Option<Writer>,
    feeder: Option<Feeder>,
    answering: Answering,
    /// The write buffer, lent until the exchange ends.
    out: Option<Lent>,
    continue_out: &'static [u8],
    /// The client's side ended (closed, failed, or its framing broke).
    read_closed: bool,
    /// The request body's framing broke: the connection closes.
    broken: bool,
    /// The whole response has been written.
    written: bool,
    /// Most bytes buffered ahead while waiting on the upstream.
    max_buffered: usize,
    /// How long the rest of an unread body may take to arrive once the
    /// response is out (`timeouts.request_headers`): a client that stops
    /// sending is closed, not waited for.
    discard_for: std::time::Duration,
    /// Armed when discarding starts.
    discard_until: Option<Pin<Box<tokio::time::Sleep>>>,
    /// How long a write may wait for the client to take a byte
    /// (`timeouts.send`).
    send_for: std::time::Duration,
    /// Armed at the first stalled write ([`Conn::poll_stall`]), moved on
    /// when a later stall follows progress: not made while the client reads.
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Where the write stood when `stall` was last armed: the interim
    /// line or the response, its own count, the socket's ([`WaitRead::sent`]).
    stall_mark: (bool, u64, u64),
    /// The interim line was handed over but its flush waits (TLS).
    continue_flushing: bool,
    /// Closed for `timeouts.send` (counted by the connection's task).
    send_timed_out: bool,
    /// On the first request of a connection not yet registered: when its
    /// watch for the client leaving starts ([`WATCH_AFTER`]).
    late_watch: Option<LateWatch>,
}

/// The late start of a request's watch for its client leaving.
struct LateWatch {
    clock: Arc<crate::watch_clock::WatchClock>,
    /// The clock's tick from which the watch starts: two ticks after the
    /// request began, so it has waited at least one whole period.
    due: u64,
    /// The tick at which a waker was last handed to the clock.
    queued: Option<u64>,
}

impl Exchange {
    fn new(
        feeder: Option<Feeder>,
        answering: Answering,
        out: Lent,
        max_buffered: usize,
        (discard_for, send_for): (std::time::Duration, std::time::Duration),
    ) -> Self {
        Self {
            writer: None,
            feeder,
            answering,
            out: Some(out),
            continue_out: &[],
            read_closed: false,
            broken: false,
            written: false,
            max_buffered,
            discard_for,
            discard_until: None,
            send_for,
            stall: None,
            stall_mark: (false, 0, 0),
            continue_flushing: false,
            send_timed_out: false,
            late_watch: None,
        }
    }
}

#[cfg(test)]
mod tests;
