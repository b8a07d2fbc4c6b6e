//! A request head taken from the read buffer: parsed by meshless-h1 (the
//! grammar httparse's, the framing decided as hyper decides it), then
//! turned into `http::request::Parts` whose header values are slices of
//! the head's bytes (no copy per field, as hyper does).

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue};
use meshless_h1::{Error, Framing, Limits, Parsed};

/// Header slots parsed on the stack (hyper's default); more use the heap.
const STACK_SLOTS: usize = 100;

/// A request head, owned.
#[derive(Debug)]
pub struct Head {
    pub parts: http::request::Parts,
    pub framing: Framing,
    /// The head's bytes as received (replayed to hyper on a hand-over).
    pub raw: Bytes,
}

/// Takes the request head at the start of `buf` (leading empty lines
/// included) out of it; `Ok(None)` when it is not whole yet.
///
/// One function from the parse to the owned head, its fields made
/// straight from the parsed ones (no list of where they lie in between,
/// and no value made first and then moved into the head: each would be a
/// copy of hundreds of bytes per request).
pub fn take(buf: &mut BytesMut, limits: &Limits) -> Result<Option<Head>, Error> {
    let wanted = limits.slots();
    let mut stack;
    let mut heap;
    let slots: &mut [httparse::Header<'_>] = if wanted <= STACK_SLOTS {
        stack = [httparse::EMPTY_HEADER; STACK_SLOTS];
        &mut stack
    } else {
        heap = vec![httparse::EMPTY_HEADER; wanted];
        &mut heap
    };
    let Parsed::Complete { head, consumed } = meshless_h1::request::parse(buf, slots, limits)?
    else {
        return Ok(None);
    };
    // Copied out (a short head into this thread's chunk of small strings,
    // `byte_arena`), not split off: the values point into the copy alone,
    // so the read buffer stays unshared and goes back to the pool when the
    // connection has no bytes pending (a split would keep all of it alive,
    // and a new buffer be allocated, per request).
    let raw = crate::byte_arena::copy(&buf[..consumed]);
    let base = buf.as_ptr() as usize;
    let (mut parts, ()) = http::Request::new(()).into_parts();
    parts.method = head.method;
    parts.uri = head.uri;
    parts.version = head.version;
    // Room for the fields the proxy adds before forwarding it
    // (`x-forwarded-*`, `x-request-id`, `traceparent`): no regrowth.
    parts.headers = crate::header_maps::with_capacity(head.headers.len() + 6);
    for h in head.framing.forwarded(head.headers) {
        let name =
            HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| Error::Head("header name"))?;
        let at = h.value.as_ptr() as usize - base;
        let value = HeaderValue::from_maybe_shared(raw.slice(at..at + h.value.len()))
            .map_err(|_| Error::Head("header value"))?;
        // A map holds at most 32768 fields (`limits.max_headers` is
        // bounded well below): more is a head too large, never a panic.
        parts
            .headers
            .try_append(name, value)
            .map_err(|_| Error::HeadTooLarge)?;
    }
    let framing = head.framing;
    buf.advance(consumed);
    Ok(Some(Head {
        parts,
        framing,
        raw,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_head_leaves_its_body_and_the_next_request_in_the_buffer() {
        let mut buf = BytesMut::from(
            &b"POST /a?b HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 2\r\nX-A: v\r\n\r\nhiGET / HTTP/1.1\r\n"[..],
        );
        let head = take(&mut buf, &Limits::default())
            .expect("valid")
            .expect("whole");
        assert_eq!(&buf[..], b"hiGET / HTTP/1.1\r\n");
        assert_eq!(head.parts.uri, "/a?b");
        assert_eq!(
            head.parts.headers.get_all("content-length").iter().count(),
            1
        );
        assert_eq!(head.parts.headers["x-a"], "v");
        assert_eq!(head.framing.body, meshless_h1::Body::Length(2));
        assert!(head.raw.ends_with(b"\r\n\r\n"));
    }

    /// The fields point into a copy of the head: the read buffer is left
    /// unshared, so it can go back to the pool while they live.
    #[test]
    fn the_read_buffer_is_not_shared_with_the_head() {
        let mut buf = BytesMut::with_capacity(4096);
        buf.extend_from_slice(b"GET / HTTP/1.1\r\nHost: t\r\nX-A: v\r\n\r\n");
        let head = take(&mut buf, &Limits::default())
            .expect("valid")
            .expect("whole");
        assert!(buf.is_empty());
        assert!(buf.try_reclaim(4096), "the buffer is its own again");
        assert_eq!(head.parts.headers["x-a"], "v");
    }

    #[test]
    fn a_partial_head_is_left_alone_and_a_bad_one_refused() {
        let mut buf = BytesMut::from(&b"GET / HTTP/1.1\r\nHost:"[..]);
        assert!(matches!(take(&mut buf, &Limits::default()), Ok(None)));
        assert_eq!(buf.len(), 21);
        let mut bad = BytesMut::from(&b"GET / HTTP/1.1\r\nX-A: a\0b\r\n\r\n"[..]);
        assert!(take(&mut bad, &Limits::default()).is_err());
    }
}
