//! A per-worker pool of read buffers for HTTP/1 connections (and for the
//! first read of every plain-text connection, which tells its protocol:
//! `connection::serve`). A connection
//! borrows one only while bytes are pending (a head being read, a body
//! being fed, a pipelined request) and gives it back as soon as it has
//! none, so an idle keep-alive connection holds no buffer (as HAProxy's
//! buffer pools do). Every lent buffer is counted in a gauge
//! (`proxy_http1_buffers_lent`) that its [`Lent`] guard lowers on drop.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

use bytes::BytesMut;
use prometheus_client::metrics::gauge::Gauge;

/// Bytes of a fresh buffer; a larger head grows it, up to the listener's
/// head limit.
pub const BUF_SIZE: usize = 8 * 1024;

/// The largest buffer kept for reuse: one grown for a large head is freed.
const KEEP_MAX: usize = 4 * BUF_SIZE;

/// Free buffers kept per worker thread; more are freed.
const FREE_MAX: usize = 64;

thread_local! {
    static FREE: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
}

/// A buffer lent by the pool, counted in its gauge until dropped (then it
/// goes back to the pool of the thread that drops it).
#[derive(Debug)]
pub struct Lent {
    buf: BytesMut,
    gauge: Gauge,
}

impl Lent {
    /// Borrows an empty buffer with room for at least [`BUF_SIZE`] bytes.
    pub fn borrow(gauge: &Gauge) -> Self {
        let mut buf = crate::free_list::take(&FREE).unwrap_or_default();
        buf.reserve(BUF_SIZE);
        gauge.inc();
        Self {
            buf,
            gauge: gauge.clone(),
        }
    }
}

impl Deref for Lent {
    type Target = BytesMut;
    fn deref(&self) -> &BytesMut {
        &self.buf
    }
}

impl DerefMut for Lent {
    fn deref_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.gauge.dec();
        let buf = std::mem::take(&mut self.buf);
        // Memory still shared with body data sent on, an allocation grown
        // past `KEEP_MAX` (whatever room is left past its cursor), or one
        // too small to be worth keeping is not pooled: only a buffer that
        // can take a whole `BUF_SIZE` again without allocating.
        if let Some(buf) = crate::free_list::reusable_buffer(buf, KEEP_MAX, BUF_SIZE) {
            crate::free_list::give(&FREE, buf, FREE_MAX);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gauge_counts_buffers_until_they_are_dropped() {
        let g = Gauge::default();
        let a = Lent::borrow(&g);
        let mut b = Lent::borrow(&g);
        assert_eq!(g.get(), 2);
        assert!(a.capacity() >= BUF_SIZE);
        b.extend_from_slice(b"abc");
        drop(a);
        drop(b);
        assert_eq!(g.get(), 0);
    }

    #[test]
    fn a_buffer_shared_with_sent_data_is_not_pooled() {
        let g = Gauge::default();
        FREE.with(|f| f.borrow_mut().clear());
        let mut a = Lent::borrow(&g);
        a.extend_from_slice(&[1u8; 100]);
        let sent = a.split_to(50).freeze();
        drop(a);
        assert_eq!(FREE.with(|f| f.borrow().len()), 0, "shared: not kept");
        drop(sent);
        let b = Lent::borrow(&g);
        drop(b);
        assert_eq!(FREE.with(|f| f.borrow().len()), 1, "unique: kept");
        // One grown for a large head is freed, not kept (it took the
        // pooled one).
        let mut big = Lent::borrow(&g);
        big.reserve(KEEP_MAX + 1);
        drop(big);
        assert_eq!(FREE.with(|f| f.borrow().len()), 0, "grown: not kept");
        // Grown, then advanced past most of it (a large head consumed):
        // the allocation counts, not the room left.
        let mut big = Lent::borrow(&g);
        big.reserve(256 * 1024);
        let n = big.capacity() - KEEP_MAX / 2;
        big.extend_from_slice(&vec![1u8; n]);
        bytes::Buf::advance(&mut *big, n);
        drop(big);
        assert_eq!(FREE.with(|f| f.borrow().len()), 0, "grown: not kept");
    }
}
