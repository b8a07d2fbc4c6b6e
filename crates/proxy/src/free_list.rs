//! Per-worker free lists: buffers and maps given back after a request,
//! for the next one on the same thread to reuse. Each list is bounded by
//! its owner's `max`; what does not fit is dropped, and so is anything
//! given back while the thread's locals are torn down (a body dropped at
//! thread exit). Imports nothing of the crate.

use std::cell::RefCell;
use std::thread::LocalKey;

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

#[cfg(test)]
mod tests {
    use super::*;

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
