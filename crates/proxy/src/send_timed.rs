//! `timeouts.send` for connections hyper's HTTP/1 server serves
//! (`http1: hyper`, and the upgrade requests meshless's own server hands
//! to it): the I/O hyper writes to, with a bound on each write.
//!
//! As nginx's `send_timeout` and meshless's own server: the bound is on
//! the time between two writes that move bytes, not on a whole response,
//! so a client that reads slowly but steadily is never cut. A write or
//! flush that moves nothing for that long fails with `TimedOut` (hyper
//! then closes the connection, and the request's future is dropped with
//! it), counted in `meshless_proxy_downstream_send_timeouts_total`.
//!
//! Invariants:
//! - The timer is armed by the first write that waits, and re-armed from
//!   that moment by the first one that waits after a write that moved
//!   bytes; it is one allocation per connection, made on the first stall.
//! - Once the connection is upgraded ([`SendTimed::upgraded`] set, when
//!   the request is answered `101`), no new wait is bounded: a tunnel's
//!   idle time is `stream_idle`'s. A wait already under way when it is
//!   set (the socket full of earlier pipelined answers, the `101` behind
//!   them) is still cut at its bound.
//! - Shutting the connection down is bounded as a write is (over TLS it
//!   writes a `close_notify`).
//! - Reads pass through untouched.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::request::Downstream;
use crate::wait_read::WaitRead;

/// `io` with each write bounded by `send` (see the module).
pub struct SendTimed<I> {
    io: I,
    send: Duration,
    /// Armed on a stall; `None` until the first.
    stall: Option<Pin<Box<Sleep>>>,
    /// Whether `stall` counts down for the write waiting now (false after
    /// a write that moved bytes: the next stall starts a new wait).
    armed: bool,
    /// The socket's count of bytes taken when `stall` was last armed
    /// ([`WaitRead::sent`]): over TLS a flush waits while rustls's records
    /// reach the socket, and bytes reaching it are progress.
    sent: u64,
    /// Set when the connection's request was answered `101`: no bound
    /// from then on.
    upgraded: Arc<AtomicBool>,
    downstream: Arc<Downstream>,
}

impl<I> SendTimed<I> {
    /// `io` of a connection of `downstream`, its writes bounded by `send`.
    pub fn new(io: I, send: Duration, downstream: Arc<Downstream>) -> Self {
        Self {
            io,
            send,
            stall: None,
            armed: false,
            sent: 0,
            upgraded: Arc::new(AtomicBool::new(false)),
            downstream,
        }
    }

    /// The flag that turns the bound off once set (the connection was
    /// upgraded).
    pub fn upgraded(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.upgraded)
    }

    /// A write is waiting: `Ready(TimedOut)` once it has waited `send`
    /// since the wait began, counted; `Pending` otherwise. The clock is
    /// read only when a wait begins (as `h1serve`'s own bound does).
    fn poll_stalled(&mut self, cx: &mut Context<'_>) -> Poll<io::Error>
    where
        I: WaitRead,
    {
        let sent = self.io.sent();
        if sent != self.sent {
            // The socket took bytes since the wait began: a new wait.
            self.sent = sent;
            self.armed = false;
        }
        if !self.armed {
            if self.upgraded.load(Ordering::Acquire) {
                return Poll::Pending;
            }
            let until = crate::limits::deadline_after(Instant::now(), self.send);
            match &mut self.stall {
                Some(stall) => stall.as_mut().reset(until),
                None => self.stall = Some(Box::pin(tokio::time::sleep_until(until))),
            }
            self.armed = true;
        }
        let Some(stall) = self.stall.as_mut() else {
            unreachable!("armed above")
        };
        ready!(stall.as_mut().poll(cx));
        self.downstream
            .state
            .metrics
            .send_timeout(&self.downstream.name);
        Poll::Ready(io::Error::new(
            io::ErrorKind::TimedOut,
            "the client took no byte within timeouts.send",
        ))
    }

    /// `polled`, a write's result, with the bound applied.
    fn bounded<T>(
        &mut self,
        polled: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>>
    where
        I: WaitRead,
    {
        match polled {
            Poll::Pending => self.poll_stalled(cx).map(Err),
            ready => {
                // Moved bytes (or failed): the next stall is a new wait.
                self.armed = false;
                ready
            }
        }
    }
}

impl<I> std::fmt::Debug for SendTimed<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendTimed")
            .field("send", &self.send)
            .field("armed", &self.armed)
            .field("upgraded", &self.upgraded.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for SendTimed<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + WaitRead + Unpin> AsyncWrite for SendTimed<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        this.bounded(polled, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.bounded(polled, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_flush(cx);
        this.bounded(polled, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_shutdown(cx);
        this.bounded(polled, cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::ProxyState;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    const SEND: Duration = Duration::from_secs(5);

    /// A stream whose peer reads nothing until told, 64 bytes of room.
    fn timed() -> (SendTimed<DuplexStream>, DuplexStream, Arc<Downstream>) {
        let yaml = crate::config::ONE_LISTENER_YAML;
        let state = Arc::new(ProxyState::for_tests(yaml, Arc::default()));
        let settings = state.snapshot.load().config.listeners[0].settings();
        let down = Arc::new(Downstream::new(Arc::from("web"), state, settings));
        let (ours, theirs) = tokio::io::duplex(64);
        (SendTimed::new(ours, SEND, Arc::clone(&down)), theirs, down)
    }

    fn timeouts(down: &Downstream) -> u64 {
        let labels = crate::metrics::ListenerLabels {
            listener: down.name.to_string(),
        };
        down.state
            .metrics
            .send_timeouts
            .get_or_create(&labels)
            .get()
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_that_moves_nothing_for_send_fails_and_is_counted() {
        let (mut io, _peer, down) = timed();
        io.write_all(&[0; 64]).await.expect("room for 64 bytes");
        let started = Instant::now();
        let e = io.write_all(b"more").await.expect_err("stalled");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), SEND);
        assert_eq!(timeouts(&down), 1);
    }

    /// The bound is on each wait, not on the whole: a reader that takes
    /// a little every `SEND - 1 s` is never cut, however long it takes.
    #[tokio::test(start_paused = true)]
    async fn a_slow_but_steady_reader_is_not_cut() {
        let (mut io, mut peer, down) = timed();
        let reader = tokio::spawn(async move {
            let mut buf = [0; 16];
            let mut total = 0;
            while total < 64 * 20 {
                tokio::time::sleep(SEND - Duration::from_secs(1)).await;
                total += peer.read(&mut buf).await.expect("read");
            }
            total
        });
        let started = Instant::now();
        io.write_all(&[1; 64 * 20]).await.expect("written at last");
        assert!(started.elapsed() > SEND * 10, "{:?}", started.elapsed());
        assert_eq!(timeouts(&down), 0);
        reader.abort();
    }

    /// The `101` queued behind earlier answers the client never took:
    /// the wait under way when the flag is set keeps its bound.
    #[tokio::test(start_paused = true)]
    async fn a_wait_under_way_when_upgraded_keeps_its_bound() {
        let (mut io, _peer, down) = timed();
        io.write_all(&[0; 64]).await.expect("room for 64 bytes");
        let upgraded = io.upgraded();
        let started = Instant::now();
        let write = tokio::spawn(async move { io.write_all(b"HTTP/1.1 101").await });
        tokio::time::sleep(SEND / 2).await;
        upgraded.store(true, Ordering::Release);
        let e = write.await.expect("task").expect_err("cut");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), SEND);
        assert_eq!(timeouts(&down), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn an_upgraded_connection_waits_without_a_bound() {
        let (mut io, _peer, down) = timed();
        io.upgraded().store(true, Ordering::Release);
        io.write_all(&[0; 64]).await.expect("room for 64 bytes");
        let waited = tokio::time::timeout(SEND * 10, io.write_all(b"more")).await;
        assert!(waited.is_err(), "still waiting for the client");
        assert_eq!(timeouts(&down), 0);
    }
}
