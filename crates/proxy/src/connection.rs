//! One accepted downstream connection: its protocol told by peeking at the
//! first bytes (the HTTP/2 preface, or else HTTP/1.1), then served by
//! hyper's HTTP/1 or HTTP/2 connection directly on the socket, and shut
//! down gracefully when its listener drains.
//!
//! Why not hyper-util's `auto` connection: it reads the first bytes into a
//! buffer of its own and hands them to HTTP/1 as a separate short read, and
//! hyper then grows its 8 KiB read buffer to 16 KiB for the rest of the
//! head, which every idle keep-alive connection keeps. Peeking leaves the
//! bytes in the socket; no hyper state (buffers included) exists until the
//! first bytes arrive.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::h1serve::Http1Server;
use crate::limits::ListenerSettings;
use crate::request::downstream::Source;
use crate::request::{Downstream, Peer};
use crate::tls::{Handshake, ListenerTls};

/// What an HTTP/2 client with prior knowledge sends first (RFC 9113 3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How long to wait before peeking again at a head that is a part of the
/// preface (an HTTP/2 client whose preface arrived in pieces).
const PEEK_AGAIN: Duration = Duration::from_millis(5);

/// What a listener asks of its connections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Drain {
    /// Serve on.
    #[default]
    Serving,
    /// Finish what is in flight, then close: an idle HTTP/1 connection
    /// closes at once, a busy one after its response (`connection:
    /// close`); HTTP/2 gets a GOAWAY.
    Now,
    /// As `Now` for HTTP/2; HTTP/1 keeps its connection and answers its
    /// next request with `connection: close`, then closes (Envoy's drain,
    /// HAProxy's `idle-close-on-response`): a keep-alive client never sees
    /// a close racing the request it is sending. A connection accepted
    /// but not yet speaking is served the same way. Idle ones close when
    /// the drain ends.
    OnNextResponse,
}

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

/// Waits for the first bytes and tells the protocol; `None` if the client
/// closed before sending any.
async fn sniff(stream: &TcpStream) -> io::Result<Option<Protocol>> {
    let mut head = [0u8; PREFACE.len()];
    loop {
        let n = stream.peek(&mut head).await?;
        if n == 0 {
            return Ok(None);
        }
        if let Some(p) = classify(&head[..n]) {
            return Ok(Some(p));
        }
        // Peeked bytes stay readable: wait a little instead of spinning.
        tokio::time::sleep(PEEK_AGAIN).await;
    }
}

/// Serves `stream` from `client` until it closes, or until `draining`
/// turns true and its requests in flight are done. The protocol must show
/// within `timeouts.request_headers` of the accept, or the connection is
/// closed (as hyper closes one whose request head does not arrive).
pub async fn serve(
    downstream: Arc<Downstream>,
    stream: TcpStream,
    client: SocketAddr,
    mut draining: watch::Receiver<Drain>,
) {
    let settings = downstream.settings();
    let sniffed = tokio::select! {
        s = tokio::time::timeout(settings.timeouts.request_headers, sniff(&stream)) => s,
        _ = draining.wait_for(|d| *d == Drain::Now) => return,
    };
    let Ok(Ok(Some(protocol))) = sniffed else {
        return;
    };
    serve_http(downstream, stream, Peer::new(client), protocol, draining).await;
}

/// Serves a TLS connection: the handshake (up to its timeout, counted in
/// `meshless_proxy_tls_handshakes_total`), then HTTP/2 when ALPN chose
/// `h2`, else HTTP/1.1, as [`serve`] does.
pub async fn serve_tls(
    downstream: Arc<Downstream>,
    tls: Arc<ListenerTls>,
    stream: TcpStream,
    client: SocketAddr,
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
        Peer::new(client).secure(),
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
            crate::h1serve::serve(downstream, io, peer, draining).await;
        }
        Protocol::Http1 => serve_hyper_http1(downstream, io, peer, draining).await,
        Protocol::Http2 => {
            let io = TokioIo::new(io);
            let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                crate::request::handle(
                    Arc::clone(&downstream),
                    peer.clone(),
                    req.map(Source::Hyper),
                )
            });
            // Boxed: the common HTTP/1 connection's task stays small.
            let conn = Box::pin(http2_builder(&settings).serve_connection(io, service));
            drive(conn, draining, None, |c| {
                c.get_mut().as_mut().graceful_shutdown()
            })
            .await;
        }
    }
}

/// Serves HTTP/1.1 on `io` with hyper's server connection (upgrades
/// included) until it closes or drains.
pub(crate) async fn serve_hyper_http1<I>(
    downstream: Arc<Downstream>,
    io: I,
    peer: Peer,
    draining: watch::Receiver<Drain>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let settings = downstream.settings();
    let io = TokioIo::new(io);
    {
        {
            let closing = Arc::new(AtomicBool::new(false));
            let close = Arc::clone(&closing);
            // Boxed, once per request: hyper keeps the service's future in a
            // slot of every connection, which at hundreds of connections is
            // cold memory on each request, and idle memory between requests;
            // a fresh allocation is the one the last request just freed.
            let service = service_fn(move |req| {
                let (downstream, peer) = (Arc::clone(&downstream), peer.clone());
                let close = Arc::clone(&close);
                // The request's future is made inside the block: made
                // outside and moved in, it would take room twice.
                Box::pin(async move {
                    let req = req.map(Source::Hyper);
                    let mut resp = crate::request::handle(downstream, peer, req).await?;
                    if close.load(Ordering::Acquire)
                        && resp.status() != http::StatusCode::SWITCHING_PROTOCOLS
                    {
                        resp.headers_mut().insert(
                            http::header::CONNECTION,
                            http::HeaderValue::from_static("close"),
                        );
                    }
                    Ok::<_, std::convert::Infallible>(resp)
                })
            });
            let conn = http1_builder(&settings)
                .serve_connection(io, service)
                .with_upgrades();
            drive(conn, draining, Some(&closing), |c| c.graceful_shutdown()).await;
        }
    }
}

/// Polls `conn` to its end. Once `draining` asks (or its listener is
/// gone), asks it to `shutdown` gracefully and polls on; or, for
/// [`Drain::OnNextResponse`] on HTTP/1 (`closing` given), raises `closing`
/// so that its next response says `connection: close`, and polls on.
async fn drive<C: Future>(
    conn: C,
    mut draining: watch::Receiver<Drain>,
    closing: Option<&AtomicBool>,
    shutdown: impl FnOnce(Pin<&mut C>),
) {
    let mut conn = pin!(conn);
    let mode = tokio::select! {
        _ = conn.as_mut() => return,
        d = draining.wait_for(|d| *d != Drain::Serving) => d.map_or(Drain::Now, |d| *d),
    };
    match (mode, closing) {
        (Drain::OnNextResponse, Some(closing)) => closing.store(true, Ordering::Release),
        _ => shutdown(conn.as_mut()),
    }
    conn.await;
}

fn http1_builder(settings: &ListenerSettings) -> http1::Builder {
    let mut b = http1::Builder::new();
    b.timer(TokioTimer::new())
        .header_read_timeout(settings.timeouts.request_headers)
        .max_buf_size(head_buffer(settings));
    if let Some(n) = hyper_max_headers(settings.limits.max_headers) {
        b.max_headers(n);
    }
    b
}

fn http2_builder(settings: &ListenerSettings) -> http2::Builder<TokioExecutor> {
    let t = &settings.timeouts;
    let l = &settings.limits;
    let mut b = http2::Builder::new(TokioExecutor::new());
    b.timer(TokioTimer::new())
        .keep_alive_interval(t.idle)
        .keep_alive_timeout(t.request_headers)
        .max_header_list_size(l.max_header_bytes + l.max_uri_bytes);
    b
}

/// hyper's own header-count limit, when its default (100, parsed on the
/// stack) does not do: the screen stage answers `431` with its reason for
/// more than `max_headers`, so hyper must parse one more. Up to 100, hyper's
/// default lets the screen see every count it refuses, and more than 100
/// hyper refuses itself (also `431`). Set, hyper allocates two arrays of
/// that many entries on the heap for every request head it parses.
fn hyper_max_headers(max_headers: u32) -> Option<usize> {
    const HYPER_DEFAULT: usize = 100;
    let n = max_headers as usize + 1;
    (n > HYPER_DEFAULT + 1).then_some(n)
}

/// hyper's read buffer for a request head: the header and target limits
/// plus room for the request line; hyper answers `431` past it.
fn head_buffer(s: &ListenerSettings) -> usize {
    let want = s.limits.max_header_bytes as usize + s.limits.max_uri_bytes as usize + 1024;
    want.max(8192)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyper_parses_on_the_stack_up_to_its_default() {
        assert_eq!(hyper_max_headers(10), None);
        assert_eq!(hyper_max_headers(100), None);
        assert_eq!(hyper_max_headers(101), Some(102));
    }

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
