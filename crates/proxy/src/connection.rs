//! One accepted downstream connection: its protocol told by its first
//! bytes (the HTTP/2 preface, or else HTTP/1.1), then served by our HTTP/1
//! connection, or hyper's HTTP/1 or HTTP/2 connection, and shut down
//! gracefully when its listener drains.
//!
//! The first bytes are read, not peeked: into a read buffer borrowed from
//! the worker's pool once the socket is readable (so a connection that has
//! sent nothing holds no buffer), which our HTTP/1 connection goes on
//! parsing. HTTP/2 and `http1: hyper` have them replayed ([`Prefixed`]).
//! A peek followed by the read costs a system call more per connection.
//!
//! Why not hyper-util's `auto` connection: it reads only as many bytes as
//! the preface has before handing them to HTTP/1 as a separate short read,
//! and hyper then grows its 8 KiB read buffer to 16 KiB for the rest of
//! the head, which every idle keep-alive connection keeps. The first read
//! here takes all that has arrived (up to the pooled buffer's room, at
//! least 8 KiB): a head sent in one piece reaches hyper in one read, and
//! the copy replayed is freed once read.
//!
//! A client that sends a part of the preface and stalls holds a pooled
//! buffer until `timeouts.request_headers`, as a partial HTTP/1 head does.

use std::future::{Future, poll_fn};
use std::net::SocketAddr;
use std::sync::{Arc, Weak};

use bytes::Bytes;
use hyper::server::conn::http2;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::watch;

pub use crate::drain::Drain;
use crate::h1serve::Prefixed;
use crate::h1serve::pool::Lent;
use crate::h2_streams::StreamExecutor;
use crate::lazy_tcp::LazyTcpStream;
use crate::limits::{Http1Server, ListenerSettings};
use crate::pooled_future::PooledFuture;
use crate::request::downstream::Source;
use crate::request::tunnel::ConnectionGuards;
use crate::request::{Downstream, Peer};
use crate::tls::{Handshake, ListenerTls};

/// What an HTTP/2 client with prior knowledge sends first (RFC 9113 3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The protocol a connection speaks, told from its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Http1,
    Http2,
}

/// The protocol of a connection whose first bytes are `head` (at most 24):
/// `None` while `head` is empty or could still become the preface.
pub fn classify(head: &[u8]) -> Option<Protocol> {
    if head.is_empty() {
        None
    } else if head == PREFACE {
        Some(Protocol::Http2)
    } else if PREFACE.starts_with(head) {
        None
    } else {
        Some(Protocol::Http1)
    }
}

/// Reads the first bytes of `stream` until they tell its protocol: `None`
/// if the client closed (or the read failed) first, a partial preface
/// included. The buffer is borrowed once `stream` is readable, counted in
/// `gauge`; bytes are read until they are not a beginning of the preface
/// (a preface sent in pieces is waited for, not polled).
async fn first_bytes(stream: &mut LazyTcpStream, gauge: &Gauge) -> Option<(Protocol, Lent)> {
    let mut buf = None;
    loop {
        let read = poll_fn(|cx| crate::h1serve::poll_fill(stream, &mut buf, gauge, cx)).await;
        let (Ok(1..), Some(b)) = (read, buf.as_ref()) else {
            return None;
        };
        let head = &b[..b.len().min(PREFACE.len())];
        if let Some(protocol) = classify(head) {
            return buf.map(|b| (protocol, b));
        }
    }
}

/// Serves `stream` from `client` until it closes, or until `draining`
/// turns true and its requests in flight are done. The protocol must show
/// within `timeouts.request_headers` of the accept, or the connection is
/// closed (as hyper closes one whose request head does not arrive).
///
/// Every plain connection's task holds this future for its whole life:
/// meshless's HTTP/1 is served inline, hyper's HTTP/1 and HTTP/2 boxed
/// (once per connection). A function returning an async block, as an
/// `async fn` would store its arguments twice.
#[allow(clippy::manual_async_fn)] // see above: arguments stored once
pub fn serve(
    downstream: Arc<Downstream>,
    mut stream: LazyTcpStream,
    client: SocketAddr,
    connection: Weak<ConnectionGuards>,
    mut draining: watch::Receiver<Drain>,
) -> impl Future<Output = ()> + Send + 'static {
    async move {
        let settings = downstream.settings();
        let first = tokio::select! {
            f = tokio::time::timeout(
                settings.timeouts.request_headers,
                first_bytes(&mut stream, downstream.http1_buffers()),
            ) => f,
            _ = draining.wait_for(|d| *d == Drain::Now) => return,
        };
        let Ok(Some((protocol, first))) = first else {
            return;
        };
        let peer = Peer::new(client).on(connection);
        match protocol {
            Protocol::Http1 if settings.http1 == Http1Server::Meshless => {
                crate::h1serve::serve(downstream, stream, Some(first), peer, draining).await;
            }
            // One box per connection each: inline, either would size
            // every connection's future (and so the box each idle HTTP/1
            // connection holds). Replayed from a copy: the borrowed
            // buffer goes back to the pool at once.
            Protocol::Http1 => {
                let io = Prefixed::new(Bytes::copy_from_slice(&first), stream);
                drop(first);
                Box::pin(crate::hyper_h1::serve(downstream, io, peer, draining)).await;
            }
            Protocol::Http2 => {
                let io = Prefixed::new(Bytes::copy_from_slice(&first), stream);
                drop(first);
                Box::pin(serve_h2(downstream, io, peer, draining)).await;
            }
        }
    }
}

/// Serves a TLS connection: the handshake (up to its timeout, counted in
/// `meshless_proxy_tls_handshakes_total`), then HTTP/2 when ALPN chose
/// `h2`, else HTTP/1.1, as [`serve`] does.
pub async fn serve_tls(
    downstream: Arc<Downstream>,
    tls: Arc<ListenerTls>,
    stream: TcpStream,
    client: SocketAddr,
    connection: Weak<ConnectionGuards>,
    mut draining: watch::Receiver<Drain>,
) {
    let handshake = tokio::select! {
        h = tls.handshake(stream) => h,
        _ = draining.wait_for(|d| *d == Drain::Now) => return,
    };
    drop(tls);
    let metrics = &downstream.state.metrics;
    metrics.tls_handshake(&downstream.name, handshake.result());
    let stream = match handshake {
        Handshake::Done(stream) => stream,
        Handshake::Failed(e) => {
            tracing::debug!(listener = %downstream.name, %client, error = %e, "TLS handshake failed");
            return;
        }
        Handshake::TimedOut => return,
    };
    let protocol = if crate::tls::negotiated_h2(&stream) {
        Protocol::Http2
    } else {
        Protocol::Http1
    };
    serve_http(
        downstream,
        *stream,
        Peer::new(client).secure().on(connection),
        protocol,
        draining,
    )
    .await;
}

/// Serves HTTP on `io` (plain or TLS) with `protocol` until it closes or
/// drains.
async fn serve_http<I>(
    downstream: Arc<Downstream>,
    io: I,
    peer: Peer,
    protocol: Protocol,
    draining: watch::Receiver<Drain>,
) where
    I: AsyncRead + AsyncWrite + crate::h1serve::WaitRead + Unpin + Send + 'static,
{
    let settings = downstream.settings();
    match protocol {
        Protocol::Http1 if settings.http1 == Http1Server::Meshless => {
            crate::h1serve::serve(downstream, io, None, peer, draining).await;
        }
        // Boxed (once per connection): hyper's HTTP/1 connection is large,
        // and inline it would size every meshless-path connection's task.
        Protocol::Http1 => Box::pin(crate::hyper_h1::serve(downstream, io, peer, draining)).await,
        Protocol::Http2 => serve_h2(downstream, io, peer, draining).await,
    }
}

/// Serves HTTP/2 on `io` with hyper's connection (boxed: the common
/// HTTP/1 connection's task stays small) until it closes or drains.
async fn serve_h2<I>(
    downstream: Arc<Downstream>,
    io: I,
    peer: Peer,
    mut draining: watch::Receiver<Drain>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let settings = downstream.settings();
    let io = TokioIo::new(io);
    let resets = crate::rapid_reset::ResetWatch::new(settings.http2.max_premature_resets);
    let watch = Arc::clone(&resets);
    let name = Arc::clone(&downstream.name);
    let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
        // hyper drops the answer's future when the client resets the
        // stream: its upstream attempt ends with it. Boxed, and built in
        // its box: hyper moves the service's future into its stream's
        // future, and `StreamExecutor` moves that into a box of its own,
        // and the request's future is kilobytes: unboxed, every one of
        // those moves copies the whole of it. The box is reused per
        // worker thread ([`PooledFuture`]).
        let (parts, body) = req.into_parts();
        watch.track(PooledFuture::new(|| {
            crate::request::handle(
                Arc::clone(&downstream),
                peer.clone(),
                parts,
                Source::Hyper(body),
            )
        }))
    });
    // The streams run in this task, beside the connection (`h2_streams`).
    let exec = StreamExecutor::default();
    let conn = Box::pin(http2_builder(&settings, exec.clone()).serve_connection(io, service));
    // A connection past its premature-reset limit drains as if its
    // listener did: GOAWAY, the streams in flight finish.
    let (drain_tx, drain_rx) = watch::channel(Drain::Serving);
    let forward = async move {
        let mode = tokio::select! {
            d = draining.wait_for(|d| *d != Drain::Serving) => d.map_or(Drain::Now, |d| *d),
            () = resets.tripped() => {
                tracing::warn!(
                    listener = %name,
                    premature_resets = resets.premature(),
                    "HTTP/2 client resets most of its streams early (rapid reset): GOAWAY"
                );
                Drain::Now
            }
        };
        let _ = drain_tx.send(mode);
        // Keeps the sender: a closed channel would read as a drain.
        std::future::pending::<()>().await;
    };
    let driven = crate::drain::drive(conn, drain_rx, None, |c| {
        c.get_mut().as_mut().graceful_shutdown()
    });
    tokio::select! {
        () = crate::h2_streams::run(driven, exec) => {}
        () = forward => {}
    }
}

fn http2_builder(
    settings: &ListenerSettings,
    exec: StreamExecutor,
) -> http2::Builder<StreamExecutor> {
    let t = &settings.timeouts;
    let l = &settings.limits;
    let mut b = http2::Builder::new(exec);
    b.timer(TokioTimer::new())
        .keep_alive_interval(t.idle)
        .keep_alive_timeout(t.request_headers)
        .max_header_list_size(l.max_header_bytes + l.max_uri_bytes)
        .max_pending_accept_reset_streams(settings.http2.max_pending_accept_reset_streams as usize)
        .max_local_error_reset_streams(settings.http2.max_local_error_reset_streams as usize);
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preface_is_told_from_http1_by_its_first_bytes() {
        assert_eq!(classify(b""), None);
        assert_eq!(classify(b"P"), None);
        assert_eq!(classify(b"PRI * HTTP/2.0\r\n"), None);
        assert_eq!(classify(PREFACE), Some(Protocol::Http2));
        assert_eq!(classify(b"GET / HTTP/1.1\r\n"), Some(Protocol::Http1));
        assert_eq!(classify(b"POST"), Some(Protocol::Http1));
        // `PRI` as an HTTP/1 method is HTTP/1 (and refused by hyper).
        assert_eq!(classify(b"PRI / HTTP/1.1\r\n\r\n"), Some(Protocol::Http1));
        assert_eq!(classify(b"PUT / HTTP/1.1\r\n"), Some(Protocol::Http1));
    }

    /// Brute force over the preface with any one byte changed (and the
    /// preface itself): a decision taken on the first `k` bytes is the one
    /// the whole 24 would give, and 24 bytes always decide.
    #[test]
    fn an_early_decision_is_never_contradicted_by_later_bytes() {
        let mut heads = vec![*PREFACE];
        for at in 0..PREFACE.len() {
            for byte in 0..=255u8 {
                let mut h = *PREFACE;
                h[at] = byte;
                heads.push(h);
            }
        }
        for h in heads {
            let whole = if &h == PREFACE {
                Protocol::Http2
            } else {
                Protocol::Http1
            };
            assert_eq!(classify(&h), Some(whole));
            for k in 1..h.len() {
                if let Some(early) = classify(&h[..k]) {
                    assert_eq!(early, whole, "{:?} after {k} bytes", &h[..k]);
                }
            }
        }
    }
}
