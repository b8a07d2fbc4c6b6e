//! Opening one upstream connection: a `max_connections` slot reserved
//! first, TCP connect (timeout, `TCP_NODELAY`), TLS when the cluster asks,
//! hyper's HTTP/1.1 or HTTP/2 handshake, and the connection's task. The
//! slot is held by the socket and given back when the socket closes.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use super::pool::Settings;
use super::tls::TlsFault;
use super::{ClusterCounters, UpstreamBody};
use crate::config::{Http1Client, UpstreamProtocol};

/// Why no connection could be opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectError {
    /// The cluster's `max_connections` is reached.
    Limit,
    /// TCP connect failed or timed out, or the HTTP handshake failed.
    Connect,
    /// The TLS handshake failed.
    Tls(TlsFault),
}

/// One of the cluster's `max_connections`, held from before the connect
/// until the socket closes.
#[derive(Debug)]
pub struct OpenSlot {
    counters: Arc<ClusterCounters>,
}

impl OpenSlot {
    /// Reserves a slot, or `Limit` when every one is taken.
    pub fn reserve(counters: &Arc<ClusterCounters>) -> Result<Self, ConnectError> {
        let max = u64::from(counters.max_connections.load(Ordering::Relaxed));
        counters
            .connections
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|_| ConnectError::Limit)?;
        Ok(Self {
            counters: Arc::clone(counters),
        })
    }
}

impl Drop for OpenSlot {
    fn drop(&mut self) {
        self.counters.connections.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A connection's request sender.
#[derive(Debug)]
pub enum Sender {
    Http1(http1::SendRequest<UpstreamBody>),
    /// With the peer's `SETTINGS_MAX_CONCURRENT_STREAMS`.
    Http2(http2::SendRequest<UpstreamBody>, StreamLimit),
    /// An HTTP/1.1 connection of meshless's own (`clusters[].http1:
    /// meshless`): no task, the exchange drives it.
    Own(super::h1::Conn),
}

/// Opens a connection to `addr` in `slot` and spawns its task (none for
/// a connection of meshless's own, unless `hyper` asks for hyper's, as an
/// upgrading request does). `streams_hint` is the endpoint's last known HTTP/2 stream limit (0:
/// none yet): a new connection is taken to allow no more until its peer's
/// SETTINGS say otherwise (before them hyper assumes 100).
pub async fn open(
    addr: SocketAddr,
    settings: &Settings,
    slot: OpenSlot,
    streams_hint: &Arc<AtomicUsize>,
    hyper: bool,
) -> Result<Sender, ConnectError> {
    let tcp = tokio::time::timeout(settings.connect, tcp_connect(addr))
        .await
        .map_err(|_| ConnectError::Connect)?
        .map_err(|_| ConnectError::Connect)?;
    // Best effort: a socket that refuses the option still works.
    let _ = tcp.set_nodelay(true);
    let io = match &settings.tls {
        Some(tls) => {
            let handshake = tls.handshake(tcp);
            let stream = tokio::time::timeout(settings.connect, handshake)
                .await
                .map_err(|_| ConnectError::Tls(TlsFault::Handshake))?
                .map_err(ConnectError::Tls)?;
            Io::Tls(Box::new(stream))
        }
        None => Io::Plain(tcp),
    };
    let socket = Socket {
        io,
        fresh: true,
        _slot: slot,
    };
    if settings.protocol == UpstreamProtocol::Http1
        && settings.http1 == Http1Client::Meshless
        && !hyper
    {
        return Ok(Sender::Own(super::h1::Conn::new(socket)));
    }
    let io = TokioIo::new(socket);
    match settings.protocol {
        UpstreamProtocol::Http1 => {
            let (sender, conn) = http1::handshake(io)
                .await
                .map_err(|_| ConnectError::Connect)?;
            tokio::spawn(async move {
                // Its errors reach the request that was using it.
                let _ = conn.with_upgrades().await;
            });
            Ok(Sender::Http1(sender))
        }
        UpstreamProtocol::Http2 => {
            let (interval, timeout) = settings.keepalive;
            let (sender, conn) = http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .keep_alive_interval(interval)
                .keep_alive_timeout(timeout)
                .keep_alive_while_idle(true)
                .handshake(io)
                .await
                .map_err(|_| ConnectError::Connect)?;
            let limit = StreamLimit::new(conn, streams_hint);
            let task = limit.clone();
            tokio::spawn(std::future::poll_fn(move |cx| task.poll(cx)));
            Ok(Sender::Http2(sender, limit))
        }
    }
}

/// Opens a TCP connection to `addr`. When the handshake completed inside
/// `connect(2)` (a peer on the same host: loopback, or a pod's veth,
/// where the SYN-ACK is processed before the call returns), the stream is
/// returned at once, without waiting for the writable event of a
/// readiness turn (Tokio's `TcpStream::connect` always waits for one:
/// on a multi-threaded runtime that can be a wake-up of the worker that
/// holds the reactor). Otherwise it waits for the handshake as Tokio does.
async fn tcp_connect(addr: SocketAddr) -> io::Result<TcpStream> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_nonblocking(true)?;
    match socket.connect(&addr.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INPROGRESS.raw_os_error()) => {}
        Err(e) => return Err(e),
    }
    let stream = TcpStream::from_std(std::net::TcpStream::from(socket))?;
    // Established: `peer_addr` answers only then (`ENOTCONN` before).
    if stream.peer_addr().is_ok() {
        return Ok(stream);
    }
    // As Tokio's own connect: writable once the handshake ended, well or not.
    stream.writable().await?;
    match stream.take_error()? {
        Some(e) => Err(e),
        None => Ok(stream),
    }
}

type H2Connection = http2::Connection<TokioIo<Socket>, UpstreamBody, TokioExecutor>;

/// An HTTP/2 connection's stream limit, read from the connection itself
/// (hyper drives the h2 state in a task of its own, so the value changes
/// without this connection's task being polled). The connection's task
/// polls it under the same lock.
#[derive(Clone)]
pub struct StreamLimit {
    /// `None` once over: dropped then, which closes its request channel
    /// (hyper hands back requests it never sent only then).
    conn: Arc<std::sync::Mutex<Option<Pin<Box<H2Connection>>>>>,
    /// The value before the peer's SETTINGS (hyper's default, 100).
    initial: usize,
    /// The endpoint's last known limit, shared by its connections.
    hint: Arc<AtomicUsize>,
    /// The last value read, for when the lock is busy.
    cached: Arc<AtomicUsize>,
}

impl std::fmt::Debug for StreamLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamLimit")
            .field("cached", &self.cached)
            .finish()
    }
}

impl StreamLimit {
    fn new(conn: H2Connection, hint: &Arc<AtomicUsize>) -> Self {
        let initial = conn.current_max_send_streams();
        let limit = Self {
            conn: Arc::new(std::sync::Mutex::new(Some(Box::pin(conn)))),
            initial,
            hint: Arc::clone(hint),
            cached: Arc::new(AtomicUsize::new(initial)),
        };
        limit.cached.store(limit.of(initial), Ordering::Relaxed);
        limit
    }

    /// Streams the peer allows now: its announced limit, or before it is
    /// known, the endpoint's last known one.
    pub fn get(&self) -> usize {
        let Ok(conn) = self.conn.try_lock() else {
            return self.cached.load(Ordering::Relaxed);
        };
        let Some(conn) = conn.as_ref() else {
            return self.cached.load(Ordering::Relaxed);
        };
        let now = self.of(conn.current_max_send_streams());
        self.cached.store(now, Ordering::Relaxed);
        now
    }

    fn of(&self, current: usize) -> usize {
        if current != self.initial {
            self.hint.store(current, Ordering::Relaxed);
            return current;
        }
        match self.hint.load(Ordering::Relaxed) {
            0 => current,
            hint => current.min(hint),
        }
    }

    fn poll(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut conn = self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(c) = conn.as_mut() else {
            return Poll::Ready(());
        };
        // Its errors reach the requests that were using it.
        let polled = c.as_mut().poll(cx).map(|_| ());
        if polled.is_ready() {
            *conn = None;
        }
        polled
    }
}

/// The socket under a connection, with its `max_connections` slot.
pub struct Socket {
    io: Io,
    /// Nothing written yet. The first write on a plain socket goes to the
    /// socket at once ([`Socket::write_fresh`]), so a request written right
    /// after the connect leaves without waiting for the reactor's first
    /// writable event.
    fresh: bool,
    _slot: OpenSlot,
}

impl Socket {
    /// The first write on a fresh plain socket, straight to the socket:
    /// `None` when it is not fresh (or TLS), or when the socket cannot
    /// take the bytes now (`WouldBlock`: the caller then waits through
    /// the reactor as for any write; Tokio's readiness state is untouched
    /// by this write, so no event is lost).
    fn write_fresh(&mut self, bufs: &[io::IoSlice<'_>]) -> Option<io::Result<usize>> {
        if bufs.iter().all(|b| b.is_empty()) || !std::mem::replace(&mut self.fresh, false) {
            return None;
        }
        let Io::Plain(s) = &self.io else {
            return None;
        };
        match socket2::SockRef::from(s).send_vectored(bufs) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
            done => Some(done),
        }
    }
}

impl std::fmt::Debug for Socket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Socket").finish_non_exhaustive()
    }
}

enum Io {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Socket {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Some(done) = this.write_fresh(&[io::IoSlice::new(b)]) {
            return Poll::Ready(done);
        }
        match &mut this.io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, b),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, b),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Some(done) = this.write_fresh(bufs) {
            return Poll::Ready(done);
        }
        match &mut this.io {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn socket(tcp: TcpStream) -> Socket {
        let counters = Arc::new(ClusterCounters::default());
        counters.max_connections.store(1, Ordering::Relaxed);
        let slot = OpenSlot::reserve(&counters).expect("a slot");
        Socket {
            io: Io::Plain(tcp),
            fresh: true,
            _slot: slot,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_fresh_connection_carries_every_write_in_order() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (client, accepted) = tokio::join!(tcp_connect(addr), listener.accept());
        let mut s = socket(client.expect("connected"));
        let (mut server, _) = accepted.expect("accepted");
        // The first write goes to the socket directly, the next ones
        // through the reactor; an empty one first changes nothing.
        s.write_all(b"").await.expect("empty write");
        s.write_all(b"GET / HTTP/1.1\r\n")
            .await
            .expect("first write");
        s.write_all(b"host: a\r\n\r\n").await.expect("second write");
        s.flush().await.expect("flush");
        let mut got = vec![0u8; 27];
        server.read_exact(&mut got).await.expect("read");
        assert_eq!(got, b"GET / HTTP/1.1\r\nhost: a\r\n\r\n");
        server.write_all(b"ok").await.expect("answer");
        let mut back = [0u8; 2];
        s.read_exact(&mut back).await.expect("read back");
        assert_eq!(&back, b"ok");
    }

    #[tokio::test]
    async fn a_refused_connect_is_an_error_not_a_stream() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let refused = tcp_connect(SocketAddr::from(([127, 0, 0, 1], port))).await;
        assert!(refused.is_err(), "{refused:?}");
    }
}
