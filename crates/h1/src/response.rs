//! The upstream hop: a response head parsed from a borrowed buffer (by
//! httparse, framed by [`crate::framing::response`]), and the encoders of
//! the heads meshless writes — a response head downstream, a request head
//! upstream.

use bytes::BufMut;
use http::{Method, StatusCode, Version};
use httparse::Header;

use crate::error::{Error, from_httparse};
use crate::framing::{self, Framing};
use crate::request::Parsed;

/// The limits of a response head; the defaults are hyper's client's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseLimits {
    /// Bytes of a whole head (hyper: its read buffer, 8 KiB + 400 KiB).
    pub max_head_bytes: usize,
    /// Header fields (hyper: 100).
    pub max_headers: usize,
}

impl Default for ResponseLimits {
    fn default() -> Self {
        Self {
            max_head_bytes: 8192 + 4096 * 100,
            max_headers: 100,
        }
    }
}

/// A parsed response head; its fields borrow the input buffer.
#[derive(Debug)]
pub struct ResponseHead<'h, 'b> {
    pub version: Version,
    pub status: StatusCode,
    pub reason: &'b str,
    pub headers: &'h [Header<'b>],
    pub framing: Framing,
}

/// Parses the response head at the start of `buf` (to a request with
/// `method`) into `slots` (give `limits.max_headers`). A `1xx` other than
/// `101` comes back with `framing.informational`: forward it and parse
/// again after it.
pub fn parse<'h, 'b>(
    buf: &'b [u8],
    slots: &'h mut [Header<'b>],
    method: &Method,
    limits: &ResponseLimits,
) -> Result<Parsed<ResponseHead<'h, 'b>>, Error> {
    let mut res = httparse::Response::new(slots);
    let consumed = match res.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() >= limits.max_head_bytes => {
            return Err(Error::HeadTooLarge);
        }
        Ok(httparse::Status::Partial) => return Ok(Parsed::Incomplete),
        Err(e) => return Err(from_httparse(e)),
    };
    if consumed > limits.max_head_bytes {
        return Err(Error::HeadTooLarge);
    }
    let (Some(minor), Some(code), Some(reason)) = (res.version, res.code, res.reason) else {
        return Err(Error::Status);
    };
    let status = StatusCode::from_u16(code).map_err(|_| Error::Status)?;
    let version = if minor == 1 {
        Version::HTTP_11
    } else {
        Version::HTTP_10
    };
    let headers: &'h [Header<'b>] = res.headers;
    let framing = framing::response(version, status, method, headers)?;
    Ok(Parsed::Complete {
        head: ResponseHead {
            version,
            status,
            reason,
            headers,
            framing,
        },
        consumed,
    })
}

/// A header field the encoders refuse to write: a name that is empty or
/// holds a separator, or a value with CR, LF or NUL (header injection).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("header field cannot be written: {0}")]
pub struct Unwritable(pub String);

/// The bytes a field name may hold (RFC 9110 `tchar`): visible ASCII but
/// the separators. A table: it is checked for every byte of every field
/// written.
const TCHAR: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = b'!';
    while b < 0x7f {
        t[b as usize] = true;
        b += 1;
    }
    let separators = b"\":(),/;<=>?@[\\]{}";
    let mut i = 0;
    while i < separators.len() {
        t[separators[i] as usize] = false;
        i += 1;
    }
    t
};

/// Checks one field before it is written.
fn writable(name: &[u8], value: &[u8]) -> Result<(), Unwritable> {
    // No early exit: the table lookups of a name run without a branch each.
    let bad_name = name.is_empty() || !name.iter().fold(true, |ok, &b| ok & TCHAR[b as usize]);
    if bad_name || injects(value) {
        return Err(Unwritable(String::from_utf8_lossy(name).into_owned()));
    }
    Ok(())
}

/// A byte a field value may not hold: it would end the line (CR, LF) or
/// the string (NUL).
fn injecting(b: &u8) -> bool {
    matches!(*b, b'\r' | b'\n' | 0)
}

/// Whether `value` holds a CR, LF or NUL. Eight bytes at a time: a word
/// with no byte below 0x0e cannot hold one (nearly every value: tab is
/// the only control byte a valid field holds); a word with such a byte
/// is checked byte by byte, so the answer is the byte loop's.
fn injects(value: &[u8]) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let mut words = value.chunks_exact(8);
    for word in &mut words {
        // Always 8 bytes; were it not, 0 sends the word to the byte loop.
        let w = <[u8; 8]>::try_from(word).map_or(0, u64::from_le_bytes);
        // Non-zero exactly when some byte is below 0x0e (the bit trick
        // `hasless(w, 0x0e)`): with none, no byte borrows and no byte
        // keeps a high bit in both `w - 0x0e..` and `!w`; the lowest such
        // byte wraps to >= 0xf2 with its own high bit clear.
        let below = w.wrapping_sub(ONES * 0x0e) & !w & HIGH;
        if below != 0 && word.iter().any(injecting) {
            return true;
        }
    }
    words.remainder().iter().any(injecting)
}

fn version_bytes(version: Version) -> &'static [u8] {
    if version == Version::HTTP_10 {
        b"HTTP/1.0"
    } else {
        b"HTTP/1.1"
    }
}

fn write_fields<'a, I>(dst: &mut impl BufMut, headers: I) -> Result<(), Unwritable>
where
    I: IntoIterator<Item = (&'a [u8], &'a [u8])>,
{
    for (name, value) in headers {
        writable(name, value)?;
        dst.put_slice(name);
        dst.put_slice(b": ");
        dst.put_slice(value);
        dst.put_slice(b"\r\n");
    }
    dst.put_slice(b"\r\n");
    Ok(())
}

/// Writes the last chunk of a chunked body with its trailer `fields`:
/// `0`, the fields, the blank line. On an error `dst` may hold part of
/// it: discard it.
pub fn write_last_chunk<'a, I>(dst: &mut impl BufMut, fields: I) -> Result<(), Unwritable>
where
    I: IntoIterator<Item = (&'a [u8], &'a [u8])>,
{
    dst.put_slice(b"0\r\n");
    write_fields(dst, fields)
}

/// Writes a response head: `HTTP/1.x <code> <reason>`, the fields as
/// given, the blank line. `reason` empty writes the canonical one. On an
/// error `dst` may hold part of the head: discard it.
pub fn write_response_head<'a, I>(
    dst: &mut impl BufMut,
    version: Version,
    status: StatusCode,
    reason: &str,
    headers: I,
) -> Result<(), Unwritable>
where
    I: IntoIterator<Item = (&'a [u8], &'a [u8])>,
{
    let reason = if reason.is_empty() {
        status.canonical_reason().unwrap_or("")
    } else {
        reason
    };
    if reason.bytes().any(|b| matches!(b, b'\r' | b'\n' | 0)) {
        return Err(Unwritable("reason phrase".into()));
    }
    dst.put_slice(version_bytes(version));
    dst.put_u8(b' ');
    dst.put_slice(status.as_str().as_bytes());
    dst.put_u8(b' ');
    dst.put_slice(reason.as_bytes());
    dst.put_slice(b"\r\n");
    write_fields(dst, headers)
}

/// Writes a request head: `<method> <target> HTTP/1.x`, the fields as
/// given, the blank line. On an error `dst` may hold part of the head.
pub fn write_request_head<'a, I>(
    dst: &mut impl BufMut,
    method: &Method,
    target: &str,
    version: Version,
    headers: I,
) -> Result<(), Unwritable>
where
    I: IntoIterator<Item = (&'a [u8], &'a [u8])>,
{
    if target.is_empty() || target.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(Unwritable("request target".into()));
    }
    dst.put_slice(method.as_str().as_bytes());
    dst.put_u8(b' ');
    dst.put_slice(target.as_bytes());
    dst.put_u8(b' ');
    dst.put_slice(version_bytes(version));
    dst.put_slice(b"\r\n");
    write_fields(dst, headers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::framing::Body;

    #[test]
    fn a_response_head_round_trips() {
        let mut out = Vec::new();
        let fields: [(&[u8], &[u8]); 2] = [(b"content-length", b"2"), (b"x-a", b"b c")];
        write_response_head(&mut out, Version::HTTP_11, StatusCode::OK, "", fields)
            .expect("written");
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-a: b c\r\n\r\n"
        );
        let mut slots = [httparse::EMPTY_HEADER; 4];
        let parsed = parse(&out, &mut slots, &Method::GET, &ResponseLimits::default());
        let Ok(Parsed::Complete { head, consumed }) = parsed else {
            panic!("not parsed");
        };
        assert_eq!(consumed, out.len());
        assert_eq!(head.framing.body, Body::Length(2));
        assert!(head.framing.keep_alive);
    }

    /// The table says what the definition says, for every byte.
    #[test]
    fn the_name_table_is_tchar() {
        for b in 0..=255u8 {
            let tchar = b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
            assert_eq!(TCHAR[b as usize], tchar, "byte {b}");
        }
    }

    /// The word-at-a-time check answers as the byte loop, for every byte
    /// at every position of words and of the tail.
    #[test]
    fn the_value_check_is_the_byte_loop() {
        for len in 0..24 {
            for at in 0..len {
                for b in 0..=255u8 {
                    let mut v = vec![b'a'; len];
                    v[at] = b;
                    assert_eq!(injects(&v), v.iter().any(injecting), "{b} at {at} of {len}");
                    // Below it, every byte that borrows or not.
                    v.iter_mut().take(at).for_each(|x| *x = 0x0e);
                    assert_eq!(injects(&v), v.iter().any(injecting), "{b} at {at} of {len}");
                    v.iter_mut().take(at).for_each(|x| *x = 0xff);
                    assert_eq!(injects(&v), v.iter().any(injecting), "{b} at {at} of {len}");
                }
            }
        }
        assert!(!injects(b"text/html; charset=utf-8\tand obs-text \x80\xff"));
        assert!(injects(
            b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r"
        ));
    }

    /// Every name is checked, a `HeaderName` too: h2 makes the names it
    /// decodes with `HeaderName::from_lowercase`, whose table lets `"`
    /// through, which is not a token byte.
    #[test]
    fn a_header_name_that_is_no_token_is_refused_whatever_made_it() {
        let name = http::HeaderName::from_lowercase(b"x\"y").expect("h2's table takes it");
        let value = http::HeaderValue::from_static("1");
        let fields = [(name.as_str().as_bytes(), value.as_bytes())];
        let mut out = Vec::new();
        let m = Method::GET;
        assert!(write_request_head(&mut out, &m, "/", Version::HTTP_11, fields).is_err());
        let s = StatusCode::OK;
        assert!(write_response_head(&mut out, Version::HTTP_11, s, "", fields).is_err());
    }

    #[test]
    fn injection_is_refused() {
        let mut out = Vec::new();
        let bad: [(&[u8], &[u8]); 1] = [(b"x", b"a\r\nset-cookie: b")];
        assert!(write_response_head(&mut out, Version::HTTP_11, StatusCode::OK, "", bad).is_err());
        let bad: [(&[u8], &[u8]); 1] = [(b"x y", b"a")];
        let m = Method::GET;
        assert!(write_request_head(&mut out, &m, "/", Version::HTTP_11, bad).is_err());
        assert!(write_request_head(&mut out, &m, "/ x", Version::HTTP_11, []).is_err());
    }
}
