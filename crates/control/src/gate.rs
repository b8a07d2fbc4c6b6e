//! Streams polled only after their own wake-up, all sharing the one waker
//! of the task that polls them: a task that waits on several sources at
//! once (a `select!` over them) polls every one of them on each of its
//! wake-ups, and some sources cost to poll while idle (an HTTP/2 receive
//! stream takes its connection's lock and clones the waker; a `watch`
//! receiver's `changed()` made afresh registers a waiter and removes it
//! again). A subscriber's task wakes once per delta, so behind a [`Gate`]
//! each idle source costs one atomic read per delta; the task's waker is
//! registered once per poll for all of them ([`Wakes::registered`]), not
//! once per source.
//!
//! Invariant: a gate's inner stream is polled on the first poll, after it
//! yielded an item, and otherwise only after it woke the gate; no wake-up
//! is lost: a source's bit is raised before the task's waker is woken, the
//! task's waker is registered before any gate of the poll looks at its
//! bit, and a bit is taken down before the inner stream is polled.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use tokio_stream::Stream;

/// The wake-ups of one task's gated sources: a bit per source, and the
/// task's waker.
#[derive(Debug)]
pub(crate) struct Wakes {
    /// Bit `i`: source `i` woke since its gate last looked.
    woken: AtomicU32,
    /// Sources given a bit so far (each gate takes the next).
    sources: AtomicU32,
    outer: AtomicWaker,
}

impl Wakes {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            woken: AtomicU32::new(0),
            sources: AtomicU32::new(0),
            outer: AtomicWaker::new(),
        })
    }

    /// Registers the polling task's waker for every gate of `self`, then
    /// stays pending: the first branch of a `biased` `select!` over the
    /// gates, so the registration comes before any gate looks at its bit.
    pub(crate) fn registered(&self) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(|cx| {
            self.outer.register(cx.waker());
            Poll::Pending
        })
    }
}

/// The waker a gated source gets: raises its bit, then wakes the task.
#[derive(Debug)]
struct SourceWaker {
    wakes: Arc<Wakes>,
    bit: u32,
}

impl Wake for SourceWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wakes.woken.fetch_or(self.bit, Ordering::AcqRel);
        self.wakes.outer.wake();
    }
}

/// `inner`, polled only when it may have something. Its task must have
/// registered with [`Wakes::registered`] in the same poll, before this.
#[derive(Debug)]
pub(crate) struct Gate<S> {
    inner: S,
    wakes: Arc<Wakes>,
    bit: u32,
    /// Polled at once the next time (first poll, or after an item).
    again: bool,
    /// The waker the inner stream gets (made once).
    waker: Waker,
}

impl<S> Gate<S> {
    /// The next source of `wakes` (at most 32), with a bit of its own.
    pub(crate) fn new(inner: S, wakes: &Arc<Wakes>) -> Self {
        let index = wakes.sources.fetch_add(1, Ordering::Relaxed);
        assert!(index < 32, "a Wakes has 32 sources");
        let bit = 1 << index;
        let waker = Waker::from(Arc::new(SourceWaker {
            wakes: Arc::clone(wakes),
            bit,
        }));
        Self {
            inner,
            wakes: Arc::clone(wakes),
            bit,
            again: true,
            waker,
        }
    }

    /// The inner stream, to read from it directly (what it yields then is
    /// not seen by the gate, which polls it again only after a wake-up).
    pub(crate) fn inner_mut(&mut self) -> &mut S {
        &mut self.inner
    }
}

impl<S: Stream + Unpin> Stream for Gate<S> {
    type Item = S::Item;

    fn poll_next(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let this = self.get_mut();
        let woken = this.wakes.woken.load(Ordering::Acquire) & this.bit != 0;
        if !woken && !this.again {
            return Poll::Pending;
        }
        if woken {
            this.wakes.woken.fetch_and(!this.bit, Ordering::AcqRel);
        }
        this.again = false;
        let mut inner_cx = Context::from_waker(&this.waker);
        let polled = Pin::new(&mut this.inner).poll_next(&mut inner_cx);
        // More may be ready at once: look again on the next poll.
        this.again = polled.is_ready();
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
    wakes: &Arc<Wakes>,
) -> Gated {
    let changes = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.changed().await.ok()?;
        Some(((), rx))
    });
    Gate::new(Box::pin(changes), wakes)
}

/// The ticks of `interval`, gated.
pub(crate) fn ticks(interval: tokio::time::Interval, wakes: &Arc<Wakes>) -> Gated {
    let ticks = tokio_stream::wrappers::IntervalStream::new(interval);
    Gate::new(Box::pin(tokio_stream::StreamExt::map(ticks, |_| ())), wakes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

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

    /// The next item of `gate`, registering first as the subscriber's
    /// `select!` does.
    async fn next<S: Stream + Unpin>(wakes: &Wakes, gate: &mut Gate<S>) -> Option<S::Item> {
        std::future::poll_fn(|cx| {
            wakes.outer.register(cx.waker());
            Pin::new(&mut *gate).poll_next(cx)
        })
        .await
    }

    fn counted(
        wakes: &Arc<Wakes>,
    ) -> (
        tokio::sync::mpsc::UnboundedSender<u32>,
        Gate<Counted>,
        Arc<AtomicUsize>,
    ) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let polls = Arc::new(AtomicUsize::new(0));
        let gate = Gate::new(
            Counted {
                rx,
                polls: Arc::clone(&polls),
            },
            wakes,
        );
        (tx, gate, polls)
    }

    /// Idle, the inner stream is not polled again however often the gate
    /// is; a send wakes it and every item arrives, in order.
    #[tokio::test]
    async fn an_idle_source_is_polled_once_and_no_item_is_lost() {
        let wakes = Wakes::new();
        let (tx, mut gate, polls) = counted(&wakes);
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..100 {
            assert!(Pin::new(&mut gate).poll_next(&mut cx).is_pending());
        }
        assert_eq!(polls.load(Ordering::SeqCst), 1, "polled once, then gated");
        for i in 0..3 {
            tx.send(i).expect("send");
        }
        let mut got = Vec::new();
        for _ in 0..3 {
            got.push(next(&wakes, &mut gate).await.expect("item"));
        }
        assert_eq!(got, [0, 1, 2]);
        drop(tx);
        assert_eq!(
            next(&wakes, &mut gate).await,
            None,
            "the end passes through"
        );
    }

    /// Sources sharing one `Wakes`: a wake-up of one polls only that one.
    #[tokio::test]
    async fn a_wake_up_polls_only_its_own_source() {
        let wakes = Wakes::new();
        let (tx_a, mut a, polls_a) = counted(&wakes);
        let (_tx_b, mut b, polls_b) = counted(&wakes);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(Pin::new(&mut a).poll_next(&mut cx).is_pending());
        assert!(Pin::new(&mut b).poll_next(&mut cx).is_pending());
        tx_a.send(7).expect("send");
        assert_eq!(next(&wakes, &mut a).await, Some(7));
        assert!(Pin::new(&mut b).poll_next(&mut cx).is_pending());
        assert_eq!(polls_a.load(Ordering::SeqCst), 2);
        assert_eq!(polls_b.load(Ordering::SeqCst), 1, "b did not wake");
    }

    /// A wake-up between the bit's check and the inner poll is not lost:
    /// the next poll of the gate polls the inner stream again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_send_racing_the_poll_is_seen() {
        let wakes = Wakes::new();
        let (tx, mut gate, _) = counted(&wakes);
        let sender = tokio::spawn(async move {
            for i in 0..1000u32 {
                tx.send(i).expect("send");
                tokio::task::yield_now().await;
            }
        });
        let mut want = 0;
        while let Some(i) = next(&wakes, &mut gate).await {
            assert_eq!(i, want);
            want += 1;
        }
        assert_eq!(want, 1000);
        sender.await.expect("sender");
    }
}
