//! Per-worker free lists: buffers and maps given back after a request,
//! for the next one on the same thread to reuse (`pooled_future` keeps
//! futures' boxes in lists of its own, one per future type). Each list is
//! bounded by its owner's `max`; what does not fit is dropped, and so is
//! anything given back while the thread's locals are torn down (a body
//! dropped at thread exit). Imports nothing of the crate.

use std::cell::RefCell;
use std::thread::LocalKey;

use bytes::BytesMut;

/// A thread's free list of `T`.
pub type FreeList<T> = LocalKey<RefCell<Vec<T>>>;

/// A free item of this thread, if there is one (none while the thread's
/// locals are torn down).
pub fn take<T: 'static>(list: &'static FreeList<T>) -> Option<T> {
    list.try_with(|f| f.borrow_mut().pop()).ok().flatten()
}

/// Keeps `item` for this thread's next taker if its list holds fewer than
/// `max`; drops it otherwise.
pub fn give<T: 'static>(list: &'static FreeList<T>, item: T, max: usize) {
    let _ = list.try_with(|f| {
        let mut free = f.borrow_mut();
        if free.len() < max {
            free.push(item);
        }
    });
}

/// `buf` emptied and ready for reuse, or `None` when it is not worth
/// keeping: its allocation (not the room left past its cursor, which a
/// consumed head shrinks) is larger than `keep_max`, memory of it is still
/// shared with data split off it and sent on, or it cannot take `min`
/// bytes without allocating.
pub fn reusable_buffer(mut buf: BytesMut, keep_max: usize, min: usize) -> Option<BytesMut> {
    buf.clear();
    if buf.capacity() > keep_max {
        return None;
    }
    // With nothing held, `try_reclaim` succeeds exactly when the handle is
    // the allocation's only one and the allocation can give that much
    // (it moves the cursor back to the start if it has to).
    if buf.try_reclaim(keep_max + 1) {
        // An allocation grown past `keep_max`.
        return None;
    }
    if !buf.try_reclaim(buf.capacity() + 1) {
        // Shared, or already spanning its whole (small) allocation: only
        // a unique one converts back without a copy.
        buf = buf.freeze().try_into_mut().ok()?;
    }
    buf.try_reclaim(min).then_some(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Buf;

    #[test]
    fn a_buffer_is_judged_by_its_allocation_and_kept_only_unshared() {
        const KEEP: usize = 32 * 1024;
        const MIN: usize = 8 * 1024;
        // A fresh one, and one advanced past most of it.
        let b = reusable_buffer(BytesMut::with_capacity(MIN), KEEP, MIN).expect("kept");
        assert!(b.capacity() >= MIN);
        let mut b = BytesMut::with_capacity(KEEP);
        b.extend_from_slice(&[1; KEEP - 100]);
        b.advance(KEEP - 100);
        let b = reusable_buffer(b, KEEP, MIN).expect("kept, its room reclaimed");
        assert!(b.capacity() >= MIN);
        // Grown for a large head (256 KiB), the head consumed: 16 KiB left
        // past the cursor, but the allocation is what counts.
        let mut big = BytesMut::with_capacity(256 * 1024);
        big.extend_from_slice(&vec![1; 240 * 1024]);
        big.advance(240 * 1024);
        assert!(big.capacity() <= KEEP);
        assert!(reusable_buffer(big, KEEP, MIN).is_none(), "grown: freed");
        // The same with data split off it still alive (a data frame sent
        // on), and more than MIN left.
        let mut big = BytesMut::with_capacity(256 * 1024);
        big.extend_from_slice(&vec![1; 240 * 1024]);
        let sent = big.split_to(240 * 1024).freeze();
        assert!(
            reusable_buffer(big, KEEP, MIN).is_none(),
            "grown and shared"
        );
        drop(sent);
        // A small one shared with a live frame, room left past it.
        let mut small = BytesMut::with_capacity(KEEP);
        small.extend_from_slice(&[1; 100]);
        let sent = small.split_to(50).freeze();
        assert!(small.capacity() >= MIN);
        assert!(reusable_buffer(small, KEEP, MIN).is_none(), "shared: freed");
        drop(sent);
        // Too small to take MIN.
        assert!(reusable_buffer(BytesMut::with_capacity(100), KEEP, MIN).is_none());
    }

    thread_local! {
        static LIST: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    }

    #[test]
    fn a_list_keeps_at_most_its_max_and_hands_them_back() {
        for i in 0..5 {
            give(&LIST, i, 3);
        }
        assert_eq!(LIST.with(|l| l.borrow().len()), 3);
        assert_eq!(take(&LIST), Some(2));
        assert_eq!(take(&LIST), Some(1));
        assert_eq!(take(&LIST), Some(0));
        assert_eq!(take(&LIST), None);
    }
}
