//! The published deltas, in order, read by every subscriber at a cursor
//! of its own (what `tokio::sync::broadcast` did here before, for less per
//! message).
//!
//! A reader's waker stays registered between reads; a reader that finds
//! nothing new arms its slot (one atomic store, no lock, no registration
//! unless its task's waker changed) and a publication wakes each armed
//! reader once, disarming it: a reader woken and not yet back, or not
//! reading at all for a while (a paused stream), is not woken again. The
//! broadcast ring took its tail lock and queued a waiter on every empty
//! receive, and the publisher unlinked each waiter again under that lock,
//! on another thread.
//!
//! Invariants: sequence numbers start at 0 and grow by one per
//! publication; the log keeps the last `capacity` deltas; a reader whose
//! cursor fell below the oldest kept is told it lagged (once) and goes on
//! from the newest. No wake-up is lost: the publisher counts the delta
//! (`published`) before it disarms and wakes readers, a reader arms before
//! it looks at the count again, all four in one total order (`SeqCst`),
//! so either the reader sees the delta or the publisher sees it armed.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::task::{Context, Poll, Waker};

use tokio_stream::Stream;

/// What a read found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TryRecvError {
    /// Nothing published since the reader's last read.
    #[error("nothing new")]
    Empty,
    /// The reader fell more than the log's capacity behind: this many
    /// deltas were dropped before it read them. Its cursor is now at the
    /// newest delta's end (the next read waits for a new one).
    #[error("lagged behind by {0} deltas")]
    Lagged(u64),
}

#[derive(Debug)]
struct Kept<T> {
    items: VecDeque<T>,
    /// Sequence number of `items[0]`.
    first: u64,
}

/// One reader's wake-up: whether it waits (armed) and its task's waker.
#[derive(Debug)]
struct Slot {
    armed: Arc<AtomicBool>,
    waker: Option<Waker>,
}

/// Readers' wake-ups, by slot; freed slots are reused.
#[derive(Debug, Default)]
struct Wakers {
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
}

/// An ordered log of the last `capacity` items, each read by every reader.
#[derive(Debug)]
pub struct DeltaLog<T> {
    kept: RwLock<Kept<T>>,
    /// Items published so far (the next item's sequence number).
    published: AtomicU64,
    capacity: usize,
    wakers: Mutex<Wakers>,
}

impl<T: Clone> DeltaLog<T> {
    /// A log keeping the last `capacity` items (at least 1).
    pub fn new(capacity: usize) -> Arc<Self> {
        let capacity = capacity.max(1);
        Arc::new(Self {
            kept: RwLock::new(Kept {
                items: VecDeque::with_capacity(capacity),
                first: 0,
            }),
            published: AtomicU64::new(0),
            capacity,
            wakers: Mutex::new(Wakers::default()),
        })
    }

    /// Appends `item` (dropping the oldest past the capacity) and wakes
    /// every armed reader.
    pub fn publish(&self, item: T) {
        {
            let mut kept = self.kept.write().unwrap_or_else(PoisonError::into_inner);
            if kept.items.len() == self.capacity {
                kept.items.pop_front();
                kept.first += 1;
            }
            kept.items.push_back(item);
            self.published
                .store(kept.first + kept.items.len() as u64, Ordering::SeqCst);
        }
        // Woken under the lock, which only a reader's subscription, drop
        // or first registration takes (rare): no copy of the wakers.
        let wakers = self.wakers.lock().unwrap_or_else(PoisonError::into_inner);
        for slot in wakers.slots.iter().flatten() {
            if slot.armed.load(Ordering::SeqCst)
                && slot.armed.swap(false, Ordering::SeqCst)
                && let Some(w) = &slot.waker
            {
                w.wake_by_ref();
            }
        }
    }

    /// A reader of what is published from now on.
    pub fn subscribe(self: &Arc<Self>) -> LogReader<T> {
        let armed = Arc::new(AtomicBool::new(false));
        let new = Slot {
            armed: Arc::clone(&armed),
            waker: None,
        };
        let mut wakers = self.wakers.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = match wakers.free.pop() {
            Some(i) => {
                wakers.slots[i] = Some(new);
                i
            }
            None => {
                wakers.slots.push(Some(new));
                wakers.slots.len() - 1
            }
        };
        drop(wakers);
        LogReader {
            log: Arc::clone(self),
            next: self.published.load(Ordering::SeqCst),
            slot,
            armed,
            registered: None,
        }
    }

    /// Readers subscribed now.
    #[cfg(test)]
    pub fn reader_count(&self) -> usize {
        let wakers = self.wakers.lock().unwrap_or_else(PoisonError::into_inner);
        wakers.slots.len() - wakers.free.len()
    }
}

/// One reader's cursor in a [`DeltaLog`]. As a [`Stream`], it yields each
/// item (or `Err(Lagged)`) and never ends.
#[derive(Debug)]
pub struct LogReader<T> {
    log: Arc<DeltaLog<T>>,
    /// Sequence number of the next item to read.
    next: u64,
    /// This reader's slot in the log's wakers.
    slot: usize,
    /// Set while this reader waits for a publication (shared with its slot).
    armed: Arc<AtomicBool>,
    /// The waker last registered in the slot (compared, not re-registered).
    registered: Option<Waker>,
}

impl<T: Clone> LogReader<T> {
    /// Whether nothing was published since the last read.
    pub fn is_empty(&self) -> bool {
        self.log.published.load(Ordering::SeqCst) <= self.next
    }

    /// The next item, without waiting.
    pub fn try_recv(&mut self) -> Result<T, TryRecvError> {
        if self.is_empty() {
            return Err(TryRecvError::Empty);
        }
        let kept = self.log.kept.read().unwrap_or_else(PoisonError::into_inner);
        if self.next < kept.first {
            let missed = kept.first - self.next;
            self.next = kept.first + kept.items.len() as u64;
            return Err(TryRecvError::Lagged(missed));
        }
        // `next` is below `published`, so the item is kept.
        let index = usize::try_from(self.next - kept.first).unwrap_or(usize::MAX);
        match kept.items.get(index) {
            Some(item) => {
                self.next += 1;
                Ok(item.clone())
            }
            None => Err(TryRecvError::Empty),
        }
    }

    /// The next item, waiting for one.
    #[cfg(test)]
    pub async fn recv(&mut self) -> Result<T, TryRecvError> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// The next item, or `Pending` with `cx`'s waker registered and the
    /// reader armed: woken once by the next publication.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<T, TryRecvError>> {
        match self.try_recv() {
            Err(TryRecvError::Empty) => {}
            got => return Poll::Ready(got),
        }
        if !self
            .registered
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            let waker = cx.waker().clone();
            let mut wakers = self
                .log
                .wakers
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if let Some(Some(slot)) = wakers.slots.get_mut(self.slot) {
                slot.waker = Some(waker.clone());
            }
            drop(wakers);
            self.registered = Some(waker);
        }
        self.armed.store(true, Ordering::SeqCst);
        // Published before the arming: the publisher may have passed this
        // reader by.
        match self.try_recv() {
            Err(TryRecvError::Empty) => Poll::Pending,
            got => Poll::Ready(got),
        }
    }
}

impl<T: Clone> Stream for LogReader<T> {
    type Item = Result<T, TryRecvError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_recv(cx).map(Some)
    }
}

impl<T> Drop for LogReader<T> {
    fn drop(&mut self) {
        let mut wakers = self
            .log
            .wakers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = wakers.slots.get_mut(self.slot) {
            *slot = None;
            wakers.free.push(self.slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    struct Counter(AtomicUsize);
    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counting() -> (Arc<Counter>, Waker) {
        let c = Arc::new(Counter(AtomicUsize::new(0)));
        (Arc::clone(&c), Waker::from(c))
    }

    #[test]
    fn every_reader_reads_every_item_in_order_from_its_subscription() {
        let log = DeltaLog::new(8);
        log.publish(0);
        let mut a = log.subscribe();
        log.publish(1);
        let mut b = log.subscribe();
        log.publish(2);
        assert_eq!(a.try_recv(), Ok(1));
        assert_eq!(a.try_recv(), Ok(2));
        assert_eq!(a.try_recv(), Err(TryRecvError::Empty));
        assert_eq!(b.try_recv(), Ok(2));
        assert!(b.is_empty());
    }

    #[test]
    fn a_reader_past_the_capacity_lags_once_then_reads_what_follows() {
        let log = DeltaLog::new(4);
        let mut r = log.subscribe();
        for i in 0..10 {
            log.publish(i);
        }
        // 10 published, 6..10 kept: 0..6 missed.
        assert_eq!(r.try_recv(), Err(TryRecvError::Lagged(6)));
        assert_eq!(r.try_recv(), Err(TryRecvError::Empty));
        log.publish(10);
        assert_eq!(r.try_recv(), Ok(10));
    }

    #[test]
    fn a_waiting_reader_is_woken_once_until_it_reads_again() {
        let log = DeltaLog::new(4);
        let mut r = log.subscribe();
        let (count, waker) = counting();
        let mut cx = Context::from_waker(&waker);
        assert!(r.poll_recv(&mut cx).is_pending());
        log.publish(1);
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert_eq!(r.poll_recv(&mut cx), Poll::Ready(Ok(1)));
        assert!(r.poll_recv(&mut cx).is_pending());
        log.publish(2);
        log.publish(3);
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            2,
            "woken by the first publication after its read, not the second"
        );
        // Another waker replaces the first.
        let (other, waker2) = counting();
        let mut cx2 = Context::from_waker(&waker2);
        assert_eq!(r.poll_recv(&mut cx2), Poll::Ready(Ok(2)));
        assert_eq!(r.poll_recv(&mut cx2), Poll::Ready(Ok(3)));
        assert!(r.poll_recv(&mut cx2).is_pending());
        log.publish(4);
        assert_eq!(other.0.load(Ordering::SeqCst), 1);
        assert_eq!(count.0.load(Ordering::SeqCst), 2);
    }

    /// A reader that stops reading (a paused stream) costs the publisher
    /// one wake-up, not one per publication.
    #[test]
    fn a_woken_reader_not_polled_again_is_not_woken_again() {
        let log = DeltaLog::new(8);
        let mut r = log.subscribe();
        let (count, waker) = counting();
        assert!(r.poll_recv(&mut Context::from_waker(&waker)).is_pending());
        for i in 0..5 {
            log.publish(i);
        }
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        // Reading with `try_recv` does not arm it either.
        assert_eq!(r.try_recv(), Ok(0));
        log.publish(5);
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_dropped_readers_slot_is_reused_and_no_longer_woken() {
        let log = DeltaLog::new(4);
        let mut r = log.subscribe();
        let (count, waker) = counting();
        assert!(r.poll_recv(&mut Context::from_waker(&waker)).is_pending());
        drop(r);
        assert_eq!(log.reader_count(), 0);
        log.publish(1);
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        let _again = log.subscribe();
        assert_eq!(log.reader_count(), 1);
        assert_eq!(log.wakers.lock().expect("lock").slots.len(), 1);
    }

    /// Two threads: a publisher and a reader waiting on each item; every
    /// item arrives, in order, none waited for forever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_on_another_thread_misses_no_wake_up() {
        let log = DeltaLog::new(4096);
        let mut r = log.subscribe();
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            while got.len() < 2000 {
                got.push(r.recv().await.expect("no lag"));
            }
            got
        });
        for i in 0..2000u32 {
            log.publish(i);
            if i % 7 == 0 {
                tokio::task::yield_now().await;
            }
        }
        let got = reader.await.expect("reader");
        assert_eq!(got, (0..2000).collect::<Vec<_>>());
    }
}
