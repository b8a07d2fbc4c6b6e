//! A request's or a connection's future in an allocation reused per
//! worker thread.
//!
//! The handler's future (`request::handle`) is about 5 KiB. glibc's
//! allocator keeps no per-thread cache for blocks over 1,032 bytes: such
//! a block comes from its bins, about 600 instructions to allocate and
//! as many to free, once per request (callgrind, BENCHMARKS.md). A
//! connection's future is boxed for another reason: tokio copies a
//! task's future whole when it spawns and ends it, so a boxed one makes
//! those copies a pointer's (`listener::serve_connection`). A
//! [`PooledFuture`] takes its box from this thread's free list of its
//! type when there is one, and gives it back when it is dropped.
//!
//! Invariants:
//! - A box in a free list holds no future: the future is dropped in place
//!   when it finishes, and when the [`PooledFuture`] is dropped before
//!   (cancelled), before its box is given back. Nothing a request owned
//!   outlives it in a list.
//! - A thread keeps at most [`MAX_FREE`] boxes of each future type; a box
//!   given back to a full list is freed. A burst of one kind of future
//!   does not push out the boxes of another.
//! - A box given back while the thread's locals are torn down is freed.

use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Most boxes a thread keeps of one future type (64 handler futures:
/// about 350 KiB).
pub const MAX_FREE: usize = 64;

/// A box for a future of type `F`: `None` while it is free.
type Slot<F> = Pin<Box<Option<F>>>;

/// Free boxes of one future type: each a `Slot<F>` of the `F` whose
/// `Slot<F>` has this `TypeId`.
struct FreeOfType {
    of: TypeId,
    boxes: Vec<Box<dyn Any>>,
}

thread_local! {
    /// This thread's free boxes, one list per future type (a handful of
    /// types: a linear search finds one).
    static FREE: RefCell<Vec<FreeOfType>> = const { RefCell::new(Vec::new()) };
}

/// A future in a reused box. Moving it moves a pointer.
pub struct PooledFuture<F: Future + 'static> {
    /// Always `Some` until dropped.
    slot: Option<Slot<F>>,
}

impl<F: Future + 'static> PooledFuture<F> {
    /// The future `make` returns, in a free box of this thread if there
    /// is one, in a new one otherwise. `make` runs where the future is
    /// stored, which lets the compiler build it in place.
    pub fn new(make: impl FnOnce() -> F) -> Self {
        let slot = match take::<F>() {
            Some(mut slot) => {
                slot.set(Some(make()));
                slot
            }
            None => Box::into_pin(Box::write(Box::new_uninit(), Some(make()))),
        };
        Self { slot: Some(slot) }
    }
}

impl<F: Future + 'static> Future for PooledFuture<F> {
    type Output = F::Output;

    /// # Panics
    ///
    /// When polled again after it returned `Ready`, as an `async fn`'s
    /// future does.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        let Some(slot) = this.slot.as_mut() else {
            unreachable!("a PooledFuture holds its box until dropped")
        };
        let Some(fut) = slot.as_mut().as_pin_mut() else {
            panic!("PooledFuture polled after it finished");
        };
        let out = std::task::ready!(fut.poll(cx));
        // Finished: what it holds goes now, not when this is dropped.
        slot.set(None);
        Poll::Ready(out)
    }
}

impl<F: Future + 'static> Drop for PooledFuture<F> {
    fn drop(&mut self) {
        if let Some(mut slot) = self.slot.take() {
            // Dropped in place (cancelled if unfinished) before the box is
            // given back; no borrow of the list is held meanwhile, so a
            // future holding other pooled futures gives those back too.
            slot.set(None);
            give(slot);
        }
    }
}

impl<F: Future + 'static> std::fmt::Debug for PooledFuture<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let running = self.slot.as_ref().is_some_and(|s| s.is_some());
        f.debug_struct("PooledFuture")
            .field("running", &running)
            .finish()
    }
}

/// A free box for an `F` of this thread, if there is one.
fn take<F: 'static>() -> Option<Slot<F>> {
    let of = TypeId::of::<Slot<F>>();
    FREE.try_with(|free| {
        let mut free = free.borrow_mut();
        let list = free.iter_mut().find(|l| l.of == of)?;
        list.boxes.pop()?.downcast::<Slot<F>>().ok().map(|b| *b)
    })
    .ok()
    .flatten()
}

/// Keeps the empty `slot` for this thread's next `F` if its list has
/// room; frees it otherwise, and while the thread's locals are torn down.
fn give<F: 'static>(slot: Slot<F>) {
    let of = TypeId::of::<Slot<F>>();
    let _ = FREE.try_with(|free| {
        let mut free = free.borrow_mut();
        let at = match free.iter().position(|l| l.of == of) {
            Some(at) => at,
            None => {
                free.push(FreeOfType {
                    of,
                    boxes: Vec::new(),
                });
                free.len() - 1
            }
        };
        let boxes = &mut free[at].boxes;
        if boxes.len() < MAX_FREE {
            boxes.push(Box::new(slot));
        }
    });
}

/// Boxes this thread keeps, of all types.
#[cfg(test)]
fn free_boxes() -> usize {
    FREE.with(|f| f.borrow().iter().map(|l| l.boxes.len()).sum())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::task::Waker;

    /// A future of about the handler's size that waits for `open` and
    /// returns its `n`, holding `held` meanwhile.
    async fn big(n: u32, open: Arc<std::sync::atomic::AtomicBool>, held: Arc<()>) -> u32 {
        let room = [n as u8; 4096];
        std::future::poll_fn(|_| {
            if open.load(std::sync::atomic::Ordering::Acquire) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        drop(held);
        n + u32::from(room[4095] == n as u8)
    }

    fn address<F: Future + 'static>(f: &PooledFuture<F>) -> usize {
        let slot = f.slot.as_ref().expect("held");
        std::ptr::from_ref::<Option<F>>(slot.as_ref().get_ref()) as usize
    }

    fn poll_once<F: Future + 'static>(f: &mut PooledFuture<F>) -> Poll<F::Output> {
        Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
    }

    /// Run on a thread of its own: the free list is this thread's.
    fn on_own_thread(test: impl FnOnce() + Send + 'static) {
        std::thread::spawn(test).join().expect("test thread");
    }

    #[test]
    fn a_finished_futures_box_is_reused_by_the_next() {
        on_own_thread(|| {
            let open = Arc::new(std::sync::atomic::AtomicBool::new(true));
            let held = Arc::new(());
            let mut first = PooledFuture::new(|| big(1, Arc::clone(&open), Arc::clone(&held)));
            let at = address(&first);
            assert_eq!(poll_once(&mut first), Poll::Ready(2));
            // Finished: what it held is gone before the future is dropped.
            assert_eq!(Arc::strong_count(&held), 1);
            assert_eq!(free_boxes(), 0);
            drop(first);
            assert_eq!(free_boxes(), 1);
            let mut second = PooledFuture::new(|| big(7, Arc::clone(&open), Arc::clone(&held)));
            assert_eq!(address(&second), at, "the same box");
            assert_eq!(free_boxes(), 0);
            assert_eq!(poll_once(&mut second), Poll::Ready(8));
        });
    }

    #[test]
    fn a_cancelled_future_is_dropped_before_its_box_is_kept() {
        on_own_thread(|| {
            let shut = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let held = Arc::new(());
            let mut f = PooledFuture::new(|| big(1, Arc::clone(&shut), Arc::clone(&held)));
            assert_eq!(poll_once(&mut f), Poll::Pending);
            assert_eq!(Arc::strong_count(&held), 2, "held while it runs");
            drop(f);
            assert_eq!(Arc::strong_count(&held), 1, "dropped with it");
            assert_eq!(free_boxes(), 1);
        });
    }

    #[test]
    fn a_thread_keeps_at_most_max_free_boxes() {
        on_own_thread(|| {
            let open = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let held = Arc::new(());
            let many: Vec<_> = (0..MAX_FREE + 10)
                .map(|i| PooledFuture::new(|| big(i as u32, Arc::clone(&open), Arc::clone(&held))))
                .collect();
            assert_eq!(free_boxes(), 0);
            drop(many);
            assert_eq!(free_boxes(), MAX_FREE);
            assert_eq!(Arc::strong_count(&held), 1);
        });
    }

    #[test]
    fn a_burst_of_one_type_keeps_no_box_of_another_out() {
        on_own_thread(|| {
            async fn small(n: u8) -> u8 {
                n
            }
            let smalls: Vec<_> = (0..3).map(|n| PooledFuture::new(|| small(n))).collect();
            let open = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let bigs: Vec<_> = (0..MAX_FREE + 5)
                .map(|i| PooledFuture::new(|| big(i as u32, Arc::clone(&open), Arc::new(()))))
                .collect();
            drop(bigs);
            assert_eq!(free_boxes(), MAX_FREE, "the big ones' list is full");
            drop(smalls);
            assert_eq!(
                free_boxes(),
                MAX_FREE + 3,
                "the small ones kept beside them"
            );
            let again: Vec<_> = (0..4).map(|n| PooledFuture::new(|| small(n))).collect();
            assert_eq!(free_boxes(), MAX_FREE, "three reused, one new");
            drop(again);
            assert_eq!(free_boxes(), MAX_FREE + 4);
        });
    }

    #[test]
    fn a_box_goes_only_to_a_future_of_its_type() {
        on_own_thread(|| {
            // One function: one future type (each `async` block is a type).
            async fn small(n: u8) -> u8 {
                n
            }
            drop(PooledFuture::new(|| small(5)));
            assert_eq!(free_boxes(), 1);
            let open = Arc::new(std::sync::atomic::AtomicBool::new(true));
            let mut f = PooledFuture::new(|| big(3, open, Arc::new(())));
            assert_eq!(free_boxes(), 1, "the other type's box stays");
            assert_eq!(poll_once(&mut f), Poll::Ready(4));
            drop(f);
            assert_eq!(free_boxes(), 2);
            let mut s = PooledFuture::new(|| small(6));
            assert_eq!(free_boxes(), 1);
            assert_eq!(poll_once(&mut s), Poll::Ready(6));
        });
    }

    #[test]
    fn a_future_holding_pooled_futures_gives_them_all_back() {
        on_own_thread(|| {
            let inner = PooledFuture::new(std::future::pending::<()>);
            let outer = PooledFuture::new(move || async move {
                inner.await;
            });
            drop(outer);
            assert_eq!(free_boxes(), 2);
        });
    }

    #[test]
    #[should_panic(expected = "polled after it finished")]
    fn polling_after_the_end_panics() {
        let mut f = PooledFuture::new(|| async { 1u8 });
        assert_eq!(poll_once(&mut f), Poll::Ready(1));
        let _ = poll_once(&mut f);
    }

    thread_local! {
        static LATE: RefCell<Option<PooledFuture<std::future::Pending<()>>>> =
            const { RefCell::new(None) };
    }

    /// Dropped by another thread local's destructor, before or after the
    /// free list's own: freed or kept, never a panic.
    #[test]
    fn a_future_dropped_at_thread_exit_is_freed_quietly() {
        on_own_thread(|| {
            // The free list made first, then the late future's local.
            let _ = free_boxes();
            LATE.with(|l| *l.borrow_mut() = Some(PooledFuture::new(std::future::pending)));
        });
        on_own_thread(|| {
            LATE.with(|l| *l.borrow_mut() = Some(PooledFuture::new(std::future::pending)));
            let _ = free_boxes();
        });
    }
}
