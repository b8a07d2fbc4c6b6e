//! Upstream connections: a pool of our own per cluster over hyper's
//! low-level `client::conn` (HTTP/1.1 and HTTP/2), driven from the
//! request's task: no dispatch task of a pooled client between them.
//!
//! - `pool.rs`: per-endpoint pools, idle reuse, HTTP/2 sharing, pre-connect;
//! - `connect.rs`: opening one connection within `max_connections`;
//! - `h1.rs`: an HTTP/1.1 connection of meshless's own (`clusters[].http1:
//!   meshless`), driven by the request's task: no task, no channel;
//! - `tls.rs`: TLS to endpoints (rustls, aws-lc-rs).

mod connect;
pub mod h1;
mod pool;
mod tls;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;

use crate::config::{ClusterConfig, Http1Client, UpstreamProtocol, UpstreamTls};
pub use connect::ConnectError;
pub use pool::{EndpointPool, Lease, Pool, SendError, Settings};
pub use tls::{TlsClient, TlsConfigError, TlsFault, read_ca};

/// Body type sent upstream; its error is any (a downstream body's
/// failure, whichever server read it).
pub type UpstreamBody = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// Live counters of one cluster, kept across reloads.
#[derive(Debug, Default)]
pub struct ClusterCounters {
    /// Open upstream connections (connecting ones included).
    pub connections: AtomicU64,
    /// Idle upstream HTTP/1.1 connections kept for reuse.
    pub idle_connections: AtomicU64,
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
    /// Of `active_requests`, those forwarded to the chosen node's proxy
    /// (ahead-of-time placement): that proxy reports them as its load.
    pub forwarded: AtomicU64,
    /// Requests released from an activation hold still waiting for their
    /// response headers (what `release_concurrency` bounds).
    pub releasing: AtomicU64,
    /// Of `releasing`, those that were held (not new requests that took a
    /// ticket while a burst was released): while any is there, new
    /// requests take a ticket too.
    pub released: AtomicU64,
    /// Woken (one waiter each time) when a request of an activating
    /// cluster ends or a released one gets its response headers while
    /// others are held: room under `container_concurrency` or
    /// `release_concurrency` may be free.
    pub capacity_freed: tokio::sync::Notify,
}

/// Settings that require a new pool when they change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolKey {
    protocol: UpstreamProtocol,
    http1: Http1Client,
    connect: Duration,
    idle: Duration,
    max_idle: u32,
    /// `preconnect_ratio` in thousandths.
    preconnect_milli: u32,
    tls: Option<UpstreamTls>,
    /// The contents of `tls.ca_file` when the key was made: a CA file
    /// rewritten at the same path is a new pool.
    ca: Option<CaBundle>,
    /// HTTP/2 keep-alive PING interval (`None`: off) and timeout.
    keepalive: (Option<Duration>, Duration),
}

/// The bytes of a `tls.ca_file`, compared by contents.
#[derive(Clone, PartialEq, Eq)]
pub struct CaBundle(pub Arc<[u8]>);

impl std::fmt::Debug for CaBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CaBundle({} bytes)", self.0.len())
    }
}

impl PoolKey {
    /// The key of `c`'s pool; `ca`: the contents of its `tls.ca_file`
    /// (none without `tls`).
    /// The `tls.ca_file` contents this key was made with.
    pub fn ca(&self) -> Option<&CaBundle> {
        self.ca.as_ref()
    }

    pub fn of(c: &ClusterConfig, ca: Option<CaBundle>) -> Self {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let preconnect_milli = (c.connection_pool.preconnect_ratio * 1000.0).round() as u32;
        Self {
            protocol: c.upstream_protocol,
            http1: c.http1,
            connect: c.timeouts.connect,
            idle: c.timeouts.idle,
            max_idle: c.connection_pool.max_idle_per_endpoint,
            preconnect_milli,
            tls: c.tls.clone(),
            ca: c.tls.as_ref().and(ca),
            keepalive: {
                let k = &c.connection_pool.connection_keepalive;
                ((!k.interval.is_zero()).then_some(k.interval), k.timeout)
            },
        }
    }
}

/// Builds the pool of a cluster; reads the `tls.ca_file`, if any.
pub fn pool(key: &PoolKey, counters: Arc<ClusterCounters>) -> Result<Pool, TlsConfigError> {
    let tls = key
        .tls
        .as_ref()
        .map(|t| {
            let ca = key.ca.as_ref().map_or(&[][..], |c| &c.0[..]);
            tls::TlsClient::new(t, ca, key.protocol)
        })
        .transpose()?;
    let settings = Settings {
        protocol: key.protocol,
        http1: key.http1,
        connect: key.connect,
        idle: key.idle,
        max_idle: key.max_idle as usize,
        preconnect_milli: key.preconnect_milli,
        tls,
        keepalive: key.keepalive,
    };
    Ok(Pool::new(settings, counters))
}

/// A response body from upstream: hyper's, or one read by meshless's own
/// HTTP/1.1 connection ([`h1::ResponseBody`]).
#[derive(Debug)]
pub enum ResponseBody {
    Hyper(hyper::body::Incoming),
    Own(h1::ResponseBody),
}

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    type Error = h1::BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, h1::BoxError>>> {
        match self.get_mut() {
            ResponseBody::Hyper(b) => std::pin::Pin::new(b).poll_frame(cx).map_err(Into::into),
            ResponseBody::Own(b) => std::pin::Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Hyper(b) => b.is_end_stream(),
            ResponseBody::Own(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            ResponseBody::Hyper(b) => b.size_hint(),
            ResponseBody::Own(b) => b.size_hint(),
        }
    }
}
