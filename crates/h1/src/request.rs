//! A request head parsed from a borrowed buffer: the grammar is
//! httparse's, the limits the listener's (`max_header_bytes`,
//! `max_headers`, `max_uri_bytes` of `listeners[].limits`), the framing
//! [`crate::framing::request`]'s. Header fields are slices of the buffer;
//! nothing is kept between calls, so an idle connection needs no buffer.

use http::{Method, Uri, Version};
use httparse::Header;

use crate::error::{Error, from_httparse};
use crate::framing::{self, Framing};

/// hyper's own bound on a request target (`MAX_URI_LEN`), answered `414`.
const HYPER_MAX_URI: usize = u16::MAX as usize - 1;

/// hyper's default number of header fields parsed on the stack.
const HYPER_DEFAULT_HEADERS: usize = 100;

/// The size limits of a request head, with the semantics of the proxy's
/// listener limits (and its defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of the header fields, each counted as `name: value\r\n`,
    /// after the framing dropped repeated `Content-Length`s; more is `431`.
    pub max_header_bytes: usize,
    /// Header fields (counted the same way); more is `431`.
    pub max_headers: usize,
    /// Bytes of the target's path and query; more is `414`.
    pub max_uri_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_header_bytes: 16 * 1024,
            max_headers: 100,
            max_uri_bytes: 8 * 1024,
        }
    }
}

impl Limits {
    /// The most bytes a whole head may take (request line, fields, blank
    /// line): the proxy's hyper read buffer, `max_header_bytes +
    /// max_uri_bytes + 1024`, at least 8 KiB. A longer head is `431`.
    pub fn max_head_bytes(&self) -> usize {
        (self.max_header_bytes + self.max_uri_bytes + 1024).max(8192)
    }

    /// The header slots to give [`parse`]: as many as the proxy's hyper
    /// parses — its default 100 up to `max_headers: 100`, else one more
    /// than `max_headers` (crates/proxy/src/hyper_h1.rs). More raw
    /// fields than slots is `431` even when some would be dropped.
    pub fn slots(&self) -> usize {
        if self.max_headers <= HYPER_DEFAULT_HEADERS {
            HYPER_DEFAULT_HEADERS
        } else {
            self.max_headers + 1
        }
    }
}

/// A parsed request head; its fields borrow the input buffer.
#[derive(Debug)]
pub struct RequestHead<'h, 'b> {
    pub method: Method,
    /// The request target as sent.
    pub target: &'b str,
    /// The target parsed as `http` parses it (hyper's check).
    pub uri: Uri,
    pub version: Version,
    /// Every field as sent, in order; forward [`Framing::forwarded`].
    pub headers: &'h [Header<'b>],
    pub framing: Framing,
}

/// The outcome of parsing from the start of a buffer.
#[derive(Debug)]
pub enum Parsed<T> {
    /// No whole head yet (and under the limits so far): read more.
    Incomplete,
    /// A head, taking the first `consumed` bytes (leading empty lines
    /// included); the body, if any, starts right after.
    Complete { head: T, consumed: usize },
}

/// Parses the request head at the start of `buf` into `slots` (give
/// [`Limits::slots`] of them; fewer refuse smaller heads).
pub fn parse<'h, 'b>(
    buf: &'b [u8],
    slots: &'h mut [Header<'b>],
    limits: &Limits,
) -> Result<Parsed<RequestHead<'h, 'b>>, Error> {
    let mut req = httparse::Request::new(slots);
    let consumed = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() >= limits.max_head_bytes() => {
            return Err(Error::HeadTooLarge);
        }
        Ok(httparse::Status::Partial) => return Ok(Parsed::Incomplete),
        Err(httparse::Error::Version) => return refused_version(buf, limits),
        Err(e) => return Err(from_httparse(e)),
    };
    if consumed > limits.max_head_bytes() {
        return Err(Error::HeadTooLarge);
    }
    let (Some(method), Some(target), Some(minor)) = (req.method, req.path, req.version) else {
        return Err(Error::Head("incomplete request line"));
    };
    let version = if minor == 1 {
        Version::HTTP_11
    } else {
        Version::HTTP_10
    };
    let method = Method::from_bytes(method.as_bytes()).map_err(|_| Error::Head("method"))?;
    if target.len() > HYPER_MAX_URI {
        return Err(Error::UriTooLong);
    }
    let uri = Uri::try_from(target).map_err(|_| Error::Head("request target"))?;
    let headers: &'h [Header<'b>] = req.headers;
    let framing = framing::request(version, &method, headers)?;
    check_limits(&uri, headers, &framing, limits)?;
    Ok(Parsed::Complete {
        head: RequestHead {
            method,
            target,
            uri,
            version,
            headers,
            framing,
        },
        consumed,
    })
}

/// A request line httparse refused for its version: [`Error::Version`]
/// (`505`) when it is `method SP target SP HTTP/x.y` with a major version
/// other than 1 (RFC 9110 15.6.6: the server does not support the major
/// version of the request), else a malformed head (`400`): a version that
/// is not `HTTP/DIGIT.DIGIT`, and `HTTP/1.2` and up too (RFC 9112 2.3 asks
/// a server to read those as HTTP/1.1, which httparse does not parse; 505
/// would say major version 1 is not supported). Incomplete while the line
/// has not ended and may still turn out well-formed.
fn refused_version<T>(buf: &[u8], limits: &Limits) -> Result<Parsed<T>, Error> {
    let malformed = Err(Error::Head("HTTP version"));
    // httparse skips empty lines before the request line.
    let start = buf
        .iter()
        .position(|&b| b != b'\r' && b != b'\n')
        .unwrap_or(buf.len());
    let rest = &buf[start..];
    let (line, whole) = match rest.iter().position(|&b| b == b'\n') {
        Some(end) => (&rest[..end], true),
        None => (rest, false),
    };
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let mut parts = line.split(|&b| b == b' ');
    let (Some(_), Some(_), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return malformed;
    };
    const SHAPE: &[u8; 8] = b"HTTP/D.D";
    let fits = version.len() <= SHAPE.len()
        && version.iter().zip(SHAPE).all(|(&b, &want)| {
            if want == b'D' {
                b.is_ascii_digit()
            } else {
                b == want
            }
        });
    if !fits {
        return malformed;
    }
    if !whole {
        if buf.len() >= limits.max_head_bytes() {
            return Err(Error::HeadTooLarge);
        }
        return Ok(Parsed::Incomplete);
    }
    if version.len() == SHAPE.len() && version[5] != b'1' {
        Err(Error::Version)
    } else {
        malformed
    }
}

/// Whether the bytes left when a client closes its side are only empty
/// lines (CR and LF in any order): hyper then closes cleanly, as after a
/// last whole message; anything else left is a truncated head.
pub fn only_empty_lines(rest: &[u8]) -> bool {
    rest.iter().all(|&b| b == b'\r' || b == b'\n')
}

/// The proxy's screen limits: the path and query against
/// `max_uri_bytes`, the forwarded fields against `max_headers` and
/// `max_header_bytes`.
fn check_limits(
    uri: &Uri,
    headers: &[Header<'_>],
    framing: &Framing,
    limits: &Limits,
) -> Result<(), Error> {
    let target = uri.path_and_query().map_or(0, |p| p.as_str().len());
    if target > limits.max_uri_bytes {
        return Err(Error::UriTooLong);
    }
    let (count, bytes) = framing.forwarded(headers).fold((0, 0), |(n, b), h| {
        (n + 1, b + h.name.len() + h.value.len() + 4)
    });
    if count > limits.max_headers || bytes > limits.max_header_bytes {
        return Err(Error::HeadTooLarge);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::framing::Body;

    fn parse_one(raw: &[u8]) -> Result<Option<(usize, Body, usize)>, Error> {
        let limits = Limits::default();
        let mut slots = vec![httparse::EMPTY_HEADER; limits.slots()];
        Ok(match parse(raw, &mut slots, &limits)? {
            Parsed::Incomplete => None,
            Parsed::Complete { head, consumed } => {
                Some((consumed, head.framing.body, head.headers.len()))
            }
        })
    }

    #[test]
    fn a_head_its_length_and_its_body() {
        let raw = b"POST /a HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc";
        assert_eq!(
            parse_one(raw),
            Ok(Some((raw.len() - 3, Body::Length(3), 2)))
        );
        assert_eq!(parse_one(&raw[..20]), Ok(None));
    }

    #[test]
    fn limits_map_to_their_statuses() {
        let long = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(8192));
        assert_eq!(
            parse_one(long.as_bytes()).map_err(|e| e.status().as_u16()),
            Err(414)
        );
        let mut many = String::from("GET / HTTP/1.1\r\n");
        for i in 0..101 {
            many.push_str(&format!("x-{i}: 1\r\n"));
        }
        many.push_str("\r\n");
        assert_eq!(parse_one(many.as_bytes()), Err(Error::HeadTooLarge));
        let big = format!("GET / HTTP/1.1\r\nx: {}\r\n\r\n", "v".repeat(17 * 1024));
        assert_eq!(parse_one(big.as_bytes()), Err(Error::HeadTooLarge));
        // Incomplete but already over the head limit.
        let partial = format!("GET / HTTP/1.1\r\nx: {}", "v".repeat(30 * 1024));
        assert_eq!(parse_one(partial.as_bytes()), Err(Error::HeadTooLarge));
        assert_eq!(
            parse_one(b"GET / HTTP/2.0\r\n\r\n").map_err(|e| e.status().as_u16()),
            Err(505)
        );
    }

    /// RFC 9110 15.6.6: `505` for a well-formed version of a major other
    /// than 1; `400` for a malformed one and for `HTTP/1.2` (major 1 is
    /// supported); undecided until the request line ends.
    #[test]
    fn unsupported_versions_are_505_and_malformed_ones_400() {
        let status = |raw: &str| parse_one(raw.as_bytes()).map_err(|e| e.status().as_u16());
        for v in ["HTTP/2.0", "HTTP/3.0", "HTTP/0.9", "HTTP/9.9"] {
            assert_eq!(
                status(&format!("GET / {v}\r\nHost: t\r\n\r\n")),
                Err(505),
                "{v}"
            );
            assert_eq!(status(&format!("\r\nGET /a?b {v}\n\n")), Err(505), "{v}");
        }
        for v in [
            "HTTP/1.2",
            "HTTP/1.9",
            "HTTP/2",
            "HTTP/2.0x",
            "HTTP/20.0",
            "http/2.0",
            "HTTP/2.0 ",
        ] {
            assert_eq!(
                status(&format!("GET / {v}\r\nHost: t\r\n\r\n")),
                Err(400),
                "{v}"
            );
        }
        assert_eq!(status("GET / x HTTP/2.0\r\n\r\n"), Err(400));
        // The line has not ended: it may still be `HTTP/2.0`, or not.
        assert_eq!(status("GET / HTTP/2"), Ok(None));
        assert_eq!(status("GET / HTTP/2.0\r"), Ok(None));
        assert_eq!(status("GET / HTTP/2x"), Err(400));
        assert_eq!(status("GET / HTTP/1.1"), Ok(None));
    }
}
