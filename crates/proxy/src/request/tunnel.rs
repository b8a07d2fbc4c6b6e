//! Upgraded connections (WebSocket): bytes copied both ways between the
//! client and the endpoint. A tunnel counts as a request for as long as it
//! is open (its `max_requests` slot and in-flight guard are held), closes
//! after `stream_idle` without a byte either way, and closes when its
//! listener's drain ends.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{Notify, watch};

use crate::metrics::OpenConnection;
use crate::request::body::{Completion, End};

/// The guards of one open downstream connection: its
/// `downstream_connections` gauge and its `max_connections` slot. Its task
/// holds them, and a tunnel opened on it takes them too ([`spawn`]): an
/// upgraded connection counts, and keeps its slot, until its tunnel closes
/// (the HTTP/1 server's task ends at the `101`).
#[derive(Debug)]
pub struct ConnectionGuards {
    _open: OpenConnection,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

impl ConnectionGuards {
    pub fn new(open: OpenConnection, slot: tokio::sync::OwnedSemaphorePermit) -> Self {
        Self {
            _open: open,
            _slot: slot,
        }
    }
}

/// The open tunnels of one listener.
#[derive(Debug)]
pub struct Tunnels {
    open: AtomicUsize,
    changed: Notify,
    closing: watch::Sender<bool>,
}

impl Default for Tunnels {
    fn default() -> Self {
        Self {
            open: AtomicUsize::new(0),
            changed: Notify::new(),
            closing: watch::channel(false).0,
        }
    }
}

impl Tunnels {
    /// Tunnels open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Resolves once no tunnel is open.
    pub async fn idle(&self) {
        loop {
            let changed = self.changed.notified();
            if self.open() == 0 {
                return;
            }
            changed.await;
        }
    }

    /// Closes every open tunnel and connection of the listener (the end
    /// of a drain).
    pub fn close_all(&self) {
        self.closing.send_replace(true);
    }

    /// Resolves once [`Tunnels::close_all`] was called.
    pub fn closed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut closing = self.closing.subscribe();
        async move {
            let _ = closing.wait_for(|c| *c).await;
        }
    }
}

/// One open tunnel; lowers the count when dropped.
struct Open(Arc<Tunnels>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
        self.0.changed.notify_waiters();
    }
}

/// Splices `down` and `up` once both upgrades complete; `record` (with its
/// slot and in-flight guard) and `connection` (the downstream connection's
/// gauge and `max_connections` slot) are dropped when the tunnel closes.
pub fn spawn(
    tunnels: &Arc<Tunnels>,
    down: OnUpgrade,
    up: OnUpgrade,
    record: Box<Completion>,
    connection: Option<Arc<ConnectionGuards>>,
    idle: Duration,
) {
    tunnels.open.fetch_add(1, Ordering::AcqRel);
    let open = Open(Arc::clone(tunnels));
    let closed = tunnels.closed();
    tokio::spawn(async move {
        // Moved whole (not just the field assigned below): its guards stay
        // held for as long as the tunnel is open.
        let mut record = record;
        let _open = open;
        let _connection = connection;
        let (Ok(down), Ok(up)) = (down.await, up.await) else {
            return;
        };
        let seen = Arc::new(AtomicU64::new(0));
        let start = Instant::now();
        let mut down = Watched::new(TokioIo::new(down), &seen, start);
        let mut up = Watched::new(TokioIo::new(up), &seen, start);
        let copy = tokio::io::copy_bidirectional(&mut down, &mut up);
        tokio::select! {
            _ = copy => {}
            () = idle_for(&seen, start, idle) => {}
            () = closed => {}
        }
        record.end = End::Complete;
    });
}

/// Resolves once no byte moved for `idle`.
async fn idle_for(seen: &AtomicU64, start: Instant, idle: Duration) {
    loop {
        let last = start + Duration::from_millis(seen.load(Ordering::Relaxed));
        let Some(deadline) = last.checked_add(idle) else {
            return std::future::pending().await;
        };
        if Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep_until(deadline.into()).await;
    }
}

/// An upgraded stream that notes when bytes last moved (ms since `start`).
struct Watched<T> {
    inner: T,
    seen: Arc<AtomicU64>,
    start: Instant,
}

impl<T> Watched<T> {
    fn new(inner: T, seen: &Arc<AtomicU64>, start: Instant) -> Self {
        Self {
            inner,
            seen: Arc::clone(seen),
            start,
        }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.seen.store(ms, Ordering::Relaxed);
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.touch();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
