//! Upstream connection pools: hyper's pooled client over a connector that
//! counts connections and enforces the cluster's `max_connections`.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::Uri;
use http_body_util::combinators::BoxBody;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;

use crate::config::{ClusterConfig, UpstreamProtocol};

/// Body type sent upstream.
pub type UpstreamBody = BoxBody<Bytes, hyper::Error>;

/// A pooled client for one cluster.
pub type UpstreamClient = Client<CountingConnector, UpstreamBody>;

/// Live counters of one cluster, kept across reloads.
#[derive(Debug, Default)]
pub struct ClusterCounters {
    /// Open upstream connections.
    pub connections: AtomicU64,
    /// The `max_connections` in force.
    pub max_connections: AtomicU32,
    /// Requests active (until their response body ends).
    pub active_requests: AtomicU64,
    /// Requests waiting for response headers.
    pub pending: AtomicU64,
    /// Retry attempts under way.
    pub active_retries: AtomicU64,
    /// Requests held waiting for an instance (activation).
    pub queued: AtomicU64,
}

/// Raised by the connector when `max_connections` is reached.
#[derive(Debug, thiserror::Error)]
#[error("circuit breaker: max_connections reached")]
pub struct ConnectionLimit;

/// Settings that require a new pool when they change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolKey {
    protocol: UpstreamProtocol,
    connect: Duration,
    idle: Duration,
}

impl PoolKey {
    pub fn of(c: &ClusterConfig) -> Self {
        Self {
            protocol: c.upstream_protocol,
            connect: c.timeouts.connect,
            idle: c.timeouts.idle,
        }
    }
}

/// Builds the pooled client of a cluster.
pub fn client(key: &PoolKey, counters: Arc<ClusterCounters>) -> UpstreamClient {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(key.connect));
    http.set_nodelay(true);
    http.enforce_http(true);
    let connector = CountingConnector {
        inner: http,
        counters,
    };
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(key.idle)
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .http2_only(key.protocol == UpstreamProtocol::Http2)
        .build(connector)
}

/// An [`HttpConnector`] that counts the connections it opens.
#[derive(Debug, Clone)]
pub struct CountingConnector {
    inner: HttpConnector,
    counters: Arc<ClusterCounters>,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<Uri> for CountingConnector {
    type Response = CountedStream;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<CountedStream, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let counters = Arc::clone(&self.counters);
        let max = u64::from(counters.max_connections.load(Ordering::Relaxed));
        if counters.connections.load(Ordering::Relaxed) >= max {
            return Box::pin(async { Err(Box::new(ConnectionLimit) as BoxError) });
        }
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            let stream = connecting.await?;
            counters.connections.fetch_add(1, Ordering::Relaxed);
            Ok(CountedStream { stream, counters })
        })
    }
}

/// A TCP stream that lowers the connection count when closed.
#[derive(Debug)]
pub struct CountedStream {
    stream: TokioIo<TcpStream>,
    counters: Arc<ClusterCounters>,
}

impl Drop for CountedStream {
    fn drop(&mut self) {
        self.counters.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Connection for CountedStream {
    fn connected(&self) -> Connected {
        self.stream.connected()
    }
}

impl hyper::rt::Read for CountedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for CountedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }
}

/// Whether a client error came from the connection limit.
pub fn is_connection_limit(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if e.is::<ConnectionLimit>() {
            return true;
        }
        cur = e.source();
    }
    false
}
