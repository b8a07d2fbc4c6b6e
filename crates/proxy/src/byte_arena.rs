//! Small byte strings copied into a per-thread chunk and shared from it:
//! a request's head, its response's head, its generated id and
//! `traceparent`. Each copy is a reference into the chunk, not an
//! allocation of its own: a `Bytes` copied from a slice is one
//! allocation, and its first clone (the head's field values are slices
//! of it) a second.
//!
//! Only for what lives as long as its request at most: a copy keeps its
//! whole chunk allocated. Body data is never copied here: a slow client
//! can keep thousands of small frames queued, and each could hold a chunk
//! of its own (1 KiB for a few bytes).
//!
//! Invariants:
//! - A chunk is [`CHUNK`] bytes, within the allocator's per-thread
//!   cache; a copy longer than [`MAX_SHARED`] gets an allocation of its
//!   own, so one copy never holds more than its own bytes plus a chunk.
//! - A chunk stays allocated while any copy from it is alive; when every
//!   copy from the current chunk is gone it is reused in place, else a
//!   new one is taken.
//! - A copy made while the thread's locals are torn down gets its own
//!   allocation.

use std::cell::RefCell;

use bytes::{Bytes, BytesMut};

/// Bytes per chunk (within glibc's 1,032-byte thread cache).
pub const CHUNK: usize = 1024;

/// Longest copy taken from a chunk.
pub const MAX_SHARED: usize = 512;

thread_local! {
    /// The room left in this thread's current chunk.
    static CURRENT: RefCell<BytesMut> = RefCell::new(BytesMut::new());
}

/// `bytes` copied: from this thread's chunk when short enough.
pub fn copy(bytes: &[u8]) -> Bytes {
    if bytes.len() > MAX_SHARED {
        return Bytes::copy_from_slice(bytes);
    }
    CURRENT
        .try_with(|current| {
            let mut room = current.borrow_mut();
            // Reclaimed in place when nothing else holds the chunk.
            if !room.try_reclaim(bytes.len()) {
                *room = BytesMut::with_capacity(CHUNK);
            }
            room.extend_from_slice(bytes);
            room.split().freeze()
        })
        .unwrap_or_else(|_| Bytes::copy_from_slice(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_own_thread(test: impl FnOnce() + Send + 'static) {
        std::thread::spawn(test).join().expect("test thread");
    }

    #[test]
    fn copies_hold_their_bytes_and_share_a_chunk() {
        on_own_thread(|| {
            let a = copy(b"GET / HTTP/1.1\r\n\r\n");
            let b = copy(b"HTTP/1.1 200 OK\r\n\r\n");
            assert_eq!(&a[..], b"GET / HTTP/1.1\r\n\r\n");
            assert_eq!(&b[..], b"HTTP/1.1 200 OK\r\n\r\n");
            // Adjacent in one chunk.
            assert_eq!(a.as_ptr() as usize + a.len(), b.as_ptr() as usize);
            // A slice of a copy outlives it, its bytes intact.
            let tail = b.slice(9..12);
            drop(b);
            assert_eq!(&tail[..], b"200");
            assert_eq!(&a[..], b"GET / HTTP/1.1\r\n\r\n");
        });
    }

    #[test]
    fn a_full_chunk_is_replaced_and_an_unheld_one_reused() {
        on_own_thread(|| {
            let first = copy(&[1; 500]);
            let start = first.as_ptr() as usize;
            let second = copy(&[2; 500]);
            // 1,000 of 1,024 bytes used: the next does not fit.
            let third = copy(&[3; 100]);
            assert!(
                !(start..start + CHUNK).contains(&(third.as_ptr() as usize)),
                "a new chunk"
            );
            assert!(first.iter().all(|&b| b == 1) && second.iter().all(|&b| b == 2));
            assert!(third.iter().all(|&b| b == 3));
            let at = third.as_ptr() as usize;
            let fourth = copy(&[4; 500]);
            assert_eq!(fourth.as_ptr() as usize, at + 100);
            // 600 used, 424 left: 500 more do not fit. With a copy alive
            // the chunk is replaced; with none, reused from its start.
            drop(third);
            drop(fourth);
            let fifth = copy(&[5; 500]);
            assert_eq!(fifth.as_ptr() as usize, at, "reused in place");
            let sixth = copy(&[6; 500]);
            assert_eq!(sixth.as_ptr() as usize, at + 500);
            let seventh = copy(&[7; 500]);
            assert!(
                !(at..at + CHUNK).contains(&(seventh.as_ptr() as usize)),
                "held: a new chunk"
            );
            assert!(fifth.iter().all(|&b| b == 5) && sixth.iter().all(|&b| b == 6));
            assert!(seventh.iter().all(|&b| b == 7));
            assert!(
                first.iter().all(|&b| b == 1),
                "the old chunk's copies intact"
            );
        });
    }

    #[test]
    fn a_long_copy_gets_its_own_allocation() {
        on_own_thread(|| {
            let small = copy(b"x");
            let long = copy(&[7; MAX_SHARED + 1]);
            let next = copy(b"y");
            assert_eq!(long.len(), MAX_SHARED + 1);
            assert!(long.iter().all(|&b| b == 7));
            assert_eq!(small.as_ptr() as usize + 1, next.as_ptr() as usize);
            assert_eq!(&copy(b"")[..], b"");
        });
    }

    /// Many copies over many chunks, dropped in any order: each keeps its
    /// bytes.
    #[test]
    fn copies_kept_and_dropped_out_of_order_keep_their_bytes() {
        on_own_thread(|| {
            let mut kept: Vec<(u8, Bytes)> = Vec::new();
            for i in 0..2000u32 {
                let n = (i % 251) as u8;
                let len = (i as usize * 37) % (MAX_SHARED + 40);
                kept.push((n, copy(&vec![n; len])));
                if i % 3 == 0 {
                    let at = (i as usize * 7) % kept.len();
                    kept.swap_remove(at);
                }
            }
            for (n, b) in &kept {
                assert!(b.iter().all(|x| x == n));
            }
        });
    }
}
