//! The bytes of one flow: both directions copied by
//! `tokio::io::copy_bidirectional` (an end of stream on one side is
//! passed on as a write shutdown on the other, so a half-closed flow keeps
//! its other direction open), with bytes counted and the last activity
//! kept for the idle timeout.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

/// When a flow last moved a byte, in nanoseconds since it began, and the
/// bytes it moved each way.
#[derive(Debug)]
pub struct Activity {
    began: Instant,
    last: AtomicU64,
    /// Read from the client (and written to the endpoint).
    received: AtomicU64,
    /// Read from the endpoint (and written to the client).
    sent: AtomicU64,
}

/// The side of a flow a [`Metered`] stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The client's connection.
    Downstream,
    /// The endpoint's connection.
    Upstream,
}

impl Activity {
    /// A flow beginning now.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            began: Instant::now(),
            last: AtomicU64::new(0),
            received: AtomicU64::new(0),
            sent: AtomicU64::new(0),
        })
    }

    /// Bytes read from the client and from the endpoint so far.
    pub fn bytes(&self) -> (u64, u64) {
        (
            self.received.load(Ordering::Relaxed),
            self.sent.load(Ordering::Relaxed),
        )
    }

    fn touch(&self) {
        let nanos = u64::try_from(self.began.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last.store(nanos, Ordering::Relaxed);
    }

    /// When the flow began.
    pub fn began(&self) -> Instant {
        self.began
    }

    /// When the flow last moved a byte.
    pub fn last(&self) -> Instant {
        self.began + Duration::from_nanos(self.last.load(Ordering::Relaxed))
    }

    /// Resolves once no byte has moved for `idle` (never if `idle` is 0).
    pub async fn idle_for(&self, idle: Duration) {
        if idle.is_zero() {
            return std::future::pending().await;
        }
        loop {
            let Some(due) = self.last().checked_add(idle) else {
                return std::future::pending().await;
            };
            if Instant::now() >= due {
                return;
            }
            tokio::time::sleep_until(due).await;
        }
    }
}

/// A stream whose reads are counted in `bytes` and in `activity` (as
/// read from its `side`) and touch `activity`.
#[derive(Debug)]
pub struct Metered<S> {
    inner: S,
    bytes: Counter,
    activity: Arc<Activity>,
    side: Side,
}

impl<S> Metered<S> {
    /// Wraps `inner`, the flow's `side`.
    pub fn new(inner: S, bytes: Counter, activity: Arc<Activity>, side: Side) -> Self {
        Self {
            inner,
            bytes,
            activity,
            side,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Metered<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0 {
            self.bytes.inc_by(n as u64);
            let flow = match self.side {
                Side::Downstream => &self.activity.received,
                Side::Upstream => &self.activity.sent,
            };
            flow.fetch_add(n as u64, Ordering::Relaxed);
            self.activity.touch();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Metered<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn idle_counts_from_the_last_byte() {
        let activity = Activity::new();
        let (a, mut b) = tokio::io::duplex(64);
        let mut a = Metered::new(a, Counter::default(), Arc::clone(&activity), Side::Upstream);
        tokio::time::advance(Duration::from_secs(3)).await;
        b.write_all(b"hello").await.unwrap();
        let mut buf = [0u8; 5];
        a.read_exact(&mut buf).await.unwrap();
        assert_eq!(a.bytes.get(), 5);
        assert_eq!(activity.bytes(), (0, 5));
        let started = tokio::time::Instant::now();
        activity.idle_for(Duration::from_secs(10)).await;
        // Paused time: the wait is exactly the idle time after the last byte.
        assert_eq!(started.elapsed(), Duration::from_secs(10));
    }
}
