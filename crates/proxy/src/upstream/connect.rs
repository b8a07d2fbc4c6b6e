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
use crate::config::UpstreamProtocol;

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
    /// With the peer's `SETTINGS_MAX_CONCURRENT_STREAMS`, kept current by
    /// the connection's task.
    Http2(http2::SendRequest<UpstreamBody>, Arc<AtomicUsize>),
}

/// Opens a connection to `addr` in `slot` and spawns its task.
pub async fn open(
    addr: SocketAddr,
    settings: &Settings,
    slot: OpenSlot,
) -> Result<Sender, ConnectError> {
    let tcp = tokio::time::timeout(settings.connect, TcpStream::connect(addr))
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
    let io = TokioIo::new(Socket { io, _slot: slot });
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
            let (sender, conn) = http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .handshake(io)
                .await
                .map_err(|_| ConnectError::Connect)?;
            let max = Arc::new(AtomicUsize::new(conn.current_max_send_streams()));
            let seen = Arc::clone(&max);
            let mut conn = Box::pin(conn);
            tokio::spawn(std::future::poll_fn(move |cx| {
                let polled = conn.as_mut().poll(cx);
                seen.store(conn.current_max_send_streams(), Ordering::Relaxed);
                polled.map(|_| ())
            }));
            Ok(Sender::Http2(sender, max))
        }
    }
}

/// The socket under a connection, with its `max_connections` slot.
struct Socket {
    io: Io,
    _slot: OpenSlot,
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
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, b),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, b),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
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
