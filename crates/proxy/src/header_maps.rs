//! A per-worker free list of header maps for the HTTP/1 paths of our own
//! (`http1: meshless`, downstream and upstream): a request's map is made
//! when its head is parsed and dropped once the upstream head is written,
//! a response's made when its head is read and dropped once the
//! downstream head is written. Taken from here and given back there, a
//! map's two allocations (its index and its entries, often above the
//! allocator's small sizes) are made once per worker instead of twice per
//! request and response.
//!
//! Bounded: at most [`FREE_MAX`] maps per worker thread, each of at most
//! [`KEEP_MAX`] fields' room (a map grown for a large head is freed).
//! Imports nothing of the crate but [`crate::free_list`]: both the
//! listener side and the upstream side use it.

use std::cell::RefCell;

use http::HeaderMap;

/// Free maps kept per worker thread; more are freed.
const FREE_MAX: usize = 32;

/// Largest room (in fields) of a map worth keeping.
const KEEP_MAX: usize = 96;

thread_local! {
    static FREE: RefCell<Vec<HeaderMap>> = const { RefCell::new(Vec::new()) };
}

/// An empty map with room for at least `fields` fields: a free one of
/// this worker if there is one.
pub fn with_capacity(fields: usize) -> HeaderMap {
    // `try_`: room beyond what a map can hold is not reserved (appending
    // past it fails, see `h1serve::head`) rather than a panic.
    match crate::free_list::take(&FREE) {
        Some(mut map) => {
            let _ = map.try_reserve(fields);
            map
        }
        None => HeaderMap::try_with_capacity(fields).unwrap_or_default(),
    }
}

/// Gives `map` back, emptied, for a head to come (freed if it holds no
/// room, too much — more than [`KEEP_MAX`] fields' room, or more than
/// that many values, whose store for repeated fields `clear` keeps — or
/// this worker keeps enough, or its thread is exiting).
pub fn recycle(mut map: HeaderMap) {
    let room = map.capacity();
    if room == 0 || room > KEEP_MAX || map.len() > KEEP_MAX {
        return;
    }
    map.clear();
    crate::free_list::give(&FREE, map, FREE_MAX);
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn a_map_given_back_comes_back_empty_with_its_room() {
        FREE.with(|f| f.borrow_mut().clear());
        let mut m = with_capacity(10);
        m.insert("x-a", HeaderValue::from_static("1"));
        m.append("x-a", HeaderValue::from_static("2"));
        let room = m.capacity();
        recycle(m);
        assert_eq!(FREE.with(|f| f.borrow().len()), 1);
        let again = with_capacity(4);
        assert!(again.is_empty() && again.get("x-a").is_none());
        assert_eq!(again.capacity(), room);
        assert_eq!(FREE.with(|f| f.borrow().len()), 0);
        // No room, or too much: not kept.
        recycle(HeaderMap::new());
        recycle(HeaderMap::with_capacity(KEEP_MAX * 2));
        assert_eq!(FREE.with(|f| f.borrow().len()), 0);
        // Few fields but many repeated values (their store outlives
        // `clear`): not kept either.
        let mut repeated = HeaderMap::with_capacity(4);
        for _ in 0..=KEEP_MAX {
            repeated.append("set-cookie", HeaderValue::from_static("a=b"));
        }
        assert!(repeated.capacity() <= KEEP_MAX);
        recycle(repeated);
        assert_eq!(FREE.with(|f| f.borrow().len()), 0);
    }
}
