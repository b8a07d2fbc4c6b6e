//! A stream polled only after its own wake-up: a task that waits on several
//! sources at once (a `select!` over them) polls every one of them on each
//! of its wake-ups, and some sources cost to poll while idle (an HTTP/2
//! receive stream takes its connection's lock and clones the waker; a
//! `watch` receiver's `changed()` made afresh registers a waiter and
//! removes it again). A subscriber's task wakes once per delta, so behind a
//! [`Gate`] each idle source costs an atomic swap per delta instead.
//!
//! Invariant: the inner stream is polled on the first poll, after it
//! yielded an item, and otherwise only after it woke the gate; no wake-up
//! is lost: the flag is raised before the outer task is woken, and taken
//! down before the inner stream is polled.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use tokio_stream::Stream;

/// The gate's waker: raises the flag, then wakes the task polling the gate.
#[derive(Debug)]
struct Signal {
    woken: AtomicBool,
    outer: AtomicWaker,
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.outer.wake();
    }
}

/// `inner`, polled only when it may have something.
#[derive(Debug)]
pub(crate) struct Gate<S> {
    inner: S,
    signal: Arc<Signal>,
    /// The waker the inner stream gets (made once).
    waker: Waker,
}

impl<S> Gate<S> {
    pub(crate) fn new(inner: S) -> Self {
        let signal = Arc::new(Signal {
            woken: AtomicBool::new(true),
            outer: AtomicWaker::new(),
        });
        let waker = Waker::from(Arc::clone(&signal));
        Self {
            inner,
            signal,
            waker,
        }
    }
}

impl<S: Stream + Unpin> Stream for Gate<S> {
    type Item = S::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let this = self.get_mut();
        this.signal.outer.register(cx.waker());
        if !this.signal.woken.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        let mut inner_cx = Context::from_waker(&this.waker);
        let polled = Pin::new(&mut this.inner).poll_next(&mut inner_cx);
        if polled.is_ready() {
            // More may be ready at once: look again on the next poll.
            this.signal.woken.store(true, Ordering::Release);
        }
        polled
    }
}

/// A source of unit items behind a gate, boxed.
pub(crate) type Gated = Gate<Pin<Box<dyn Stream<Item = ()> + Send>>>;

/// The changes of `rx`, one item per change seen (several changes between
/// two polls are one item); ends when the sender is gone. The `changed()`
/// future stays registered between polls.
pub(crate) fn watch_changes<T: Send + Sync + 'static>(
    rx: tokio::sync::watch::Receiver<T>,
) -> Gated {
    let changes = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.changed().await.ok()?;
        Some(((), rx))
    });
    Gate::new(Box::pin(changes))
}

/// The ticks of `interval`, gated.
pub(crate) fn ticks(interval: tokio::time::Interval) -> Gated {
    let ticks = tokio_stream::wrappers::IntervalStream::new(interval);
    Gate::new(Box::pin(tokio_stream::StreamExt::map(ticks, |_| ())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use tokio_stream::StreamExt;

    /// Counts its polls; yields what the channel holds.
    struct Counted {
        rx: tokio::sync::mpsc::UnboundedReceiver<u32>,
        polls: Arc<AtomicUsize>,
    }

    impl Stream for Counted {
        type Item = u32;
        fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<u32>> {
            self.polls.fetch_add(1, Ordering::SeqCst);
            self.rx.poll_recv(cx)
        }
    }

    /// Idle, the inner stream is not polled again however often the gate
    /// is; a send wakes it and every item arrives, in order.
    #[tokio::test]
    async fn an_idle_source_is_polled_once_and_no_item_is_lost() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let polls = Arc::new(AtomicUsize::new(0));
        let mut gate = Gate::new(Counted {
            rx,
            polls: Arc::clone(&polls),
        });
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..100 {
            assert!(Pin::new(&mut gate).poll_next(&mut cx).is_pending());
        }
        assert_eq!(polls.load(Ordering::SeqCst), 1, "polled once, then gated");
        for i in 0..3 {
            tx.send(i).expect("send");
        }
        let got: Vec<u32> = (&mut gate).take(3).collect().await;
        assert_eq!(got, [0, 1, 2]);
        drop(tx);
        assert_eq!(gate.next().await, None, "the end passes through");
    }

    /// A wake-up between the flag's swap and the inner poll is not lost:
    /// the next poll of the gate polls the inner stream again.
    #[tokio::test]
    async fn a_send_racing_the_poll_is_seen() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut gate = Gate::new(Counted {
            rx,
            polls: Arc::default(),
        });
        let sender = tokio::spawn(async move {
            for i in 0..1000u32 {
                tx.send(i).expect("send");
                tokio::task::yield_now().await;
            }
        });
        let mut want = 0;
        while let Some(i) = gate.next().await {
            assert_eq!(i, want);
            want += 1;
        }
        assert_eq!(want, 1000);
        sender.await.expect("sender");
    }
}
