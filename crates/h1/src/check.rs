//! The codec over a whole byte stream, with its invariants asserted: what
//! the fuzz targets (`fuzz/`), the corpus test and the differential test
//! run. It copies bodies out to compare them; the serving path would not.
//!
//! Invariants (a panic means a bug): every `consumed` and data range lies
//! inside the input; a head parsed from a buffer parses the same from the
//! buffer cut right after it, and not at all from one byte less; a head
//! written back out by the encoder parses to the same head; a chunked body
//! decodes the same whether its bytes arrive at once or in two reads.

use http::{Method, Version};
use httparse::Header;

use crate::chunked::{self, Decoder, Step};
use crate::error::Error;
use crate::framing::Body;
use crate::request::{self, Limits, Parsed};
use crate::response::{self, ResponseLimits};

/// One message as the codec framed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `METHOD target HTTP/1.x`, or `HTTP/1.x code` for a response.
    pub line: String,
    /// The forwarded fields, names lowercased, in wire order.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    /// Trailer fields, names lowercased.
    pub trailers: Vec<(String, Vec<u8>)>,
    /// How the body ended.
    pub end: BodyEnd,
}

/// How a message body ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyEnd {
    Complete,
    /// The input ended inside it.
    Truncated,
    /// It broke the framing.
    Invalid(Error),
}

/// How a stream ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// After a whole message, with nothing left (or the connection closes
    /// after a message that does not keep it alive).
    Clean,
    /// Inside a head.
    Truncated,
    /// A head refused, or a body that broke its framing.
    Rejected(Error),
    /// A `CONNECT` request (the proxy's screen refuses it, `501`), or an
    /// upgrading response: the rest is not HTTP/1.
    Upgrade,
}

/// A stream's messages and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stream {
    pub messages: Vec<Message>,
    pub end: End,
}

fn fields(headers: &[&Header<'_>]) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
        .collect()
}

/// Parses `input` as the requests a client sent on one connection, with
/// the default listener limits.
pub fn request_stream(input: &[u8]) -> Stream {
    request_stream_with(input, &Limits::default())
}

/// As [`request_stream`], with `limits`.
pub fn request_stream_with(input: &[u8], limits: &Limits) -> Stream {
    let mut slots = vec![httparse::EMPTY_HEADER; limits.slots()];
    let mut messages = Vec::new();
    let mut pos = 0;
    let end = loop {
        let rest = &input[pos..];
        if rest.is_empty() {
            break End::Clean;
        }
        let (head, consumed) = match request::parse(rest, &mut slots, limits) {
            Err(e) => break End::Rejected(e),
            Ok(Parsed::Incomplete) if request::only_empty_lines(rest) => break End::Clean,
            Ok(Parsed::Incomplete) => break End::Truncated,
            Ok(Parsed::Complete { head, consumed }) => (head, consumed),
        };
        assert!(
            consumed > 0 && consumed <= rest.len(),
            "consumed {consumed}"
        );
        let forwarded: Vec<&Header<'_>> = head.framing.forwarded(head.headers).collect();
        let line = format!("{} {} {}", head.method, head.uri, version(head.version));
        check_request_reparse(rest, consumed, &head, &forwarded, limits);
        if head.method == Method::CONNECT {
            break End::Upgrade;
        }
        let (mut message, used) = body(&rest[consumed..], head.framing.body, limits.slots());
        message.line = line;
        message.headers = fields(&forwarded);
        pos += consumed + used;
        let failed = message.end.clone();
        messages.push(message);
        match failed {
            BodyEnd::Complete if head.framing.keep_alive => {}
            BodyEnd::Complete => break End::Clean,
            BodyEnd::Truncated => break End::Truncated,
            BodyEnd::Invalid(e) => break End::Rejected(e),
        }
    };
    Stream { messages, end }
}

/// Parses `input` as the responses to requests with `method` on one
/// connection, with hyper's client limits. `1xx` heads are messages too.
pub fn response_stream(input: &[u8], method: &Method) -> Stream {
    let limits = ResponseLimits::default();
    let mut slots = vec![httparse::EMPTY_HEADER; limits.max_headers];
    let mut messages = Vec::new();
    let mut pos = 0;
    let end = loop {
        let rest = &input[pos..];
        if rest.is_empty() {
            break End::Clean;
        }
        let (head, consumed) = match response::parse(rest, &mut slots, method, &limits) {
            Err(e) => break End::Rejected(e),
            Ok(Parsed::Incomplete) => break End::Truncated,
            Ok(Parsed::Complete { head, consumed }) => (head, consumed),
        };
        assert!(
            consumed > 0 && consumed <= rest.len(),
            "consumed {consumed}"
        );
        check_response_reparse(rest, consumed, &head, method);
        let forwarded: Vec<&Header<'_>> = head.framing.forwarded(head.headers).collect();
        let (mut message, used) = body(&rest[consumed..], head.framing.body, limits.max_headers);
        message.line = format!("{} {}", version(head.version), head.status.as_u16());
        message.headers = fields(&forwarded);
        pos += consumed + used;
        let failed = message.end.clone();
        messages.push(message);
        let f = head.framing;
        match failed {
            BodyEnd::Complete if f.upgrade => break End::Upgrade,
            BodyEnd::Complete if f.keep_alive || f.informational => {}
            BodyEnd::Complete => break End::Clean,
            BodyEnd::Truncated => break End::Truncated,
            BodyEnd::Invalid(e) => break End::Rejected(e),
        }
    };
    Stream { messages, end }
}

fn version(v: Version) -> &'static str {
    if v == Version::HTTP_10 {
        "HTTP/1.0"
    } else {
        "HTTP/1.1"
    }
}

/// The body at the start of `input`, and the bytes it took.
fn body(input: &[u8], body: Body, max_trailers: usize) -> (Message, usize) {
    let mut m = Message {
        line: String::new(),
        headers: Vec::new(),
        body: Vec::new(),
        trailers: Vec::new(),
        end: BodyEnd::Complete,
    };
    let used = match body {
        Body::Empty => 0,
        Body::CloseDelimited => {
            m.body = input.to_vec();
            input.len()
        }
        Body::Length(n) => {
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            if n > input.len() {
                m.end = BodyEnd::Truncated;
            }
            let used = n.min(input.len());
            m.body = input[..used].to_vec();
            used
        }
        Body::Chunked => {
            let whole = chunked_body(input, input.len(), max_trailers);
            let split = chunked_body(input, input.len() / 2, max_trailers);
            // The same data, end and bytes used (which error is found
            // first may depend on the reads; that one is found does not).
            let erase = |d: &Decoded| {
                let end = match &d.3 {
                    BodyEnd::Invalid(_) => BodyEnd::Invalid(Error::Chunked("")),
                    other => other.clone(),
                };
                (d.0, d.1.clone(), d.2.clone(), end)
            };
            assert_eq!(
                erase(&whole),
                erase(&split),
                "chunked decoding depends on read boundaries"
            );
            let (used, data, trailers, end) = whole;
            (m.body, m.trailers, m.end) = (data, trailers, end);
            used
        }
    };
    (m, used)
}

type Decoded = (usize, Vec<u8>, Vec<(String, Vec<u8>)>, BodyEnd);

/// Decodes a chunked body from `input`, whose first `first` bytes arrive
/// in a first read and the rest in a second.
fn chunked_body(input: &[u8], first: usize, max_trailers: usize) -> Decoded {
    let mut decoder = Decoder::new(max_trailers);
    let mut data = Vec::new();
    let (mut pos, mut avail) = (0, first);
    loop {
        let window = &input[pos..avail];
        match decoder.decode(window) {
            // Where an error shows depends on the reads; what is used up
            // after one does not matter (the connection closes).
            Err(e) => return (input.len(), data, Vec::new(), BodyEnd::Invalid(e)),
            Ok(Step::Data(r)) => {
                assert!(r.start < r.end && r.end <= window.len(), "{r:?}");
                data.extend_from_slice(&window[r.clone()]);
                pos += r.end;
            }
            Ok(Step::Incomplete { consumed }) => {
                assert!(consumed <= window.len());
                pos += consumed;
                if avail == input.len() {
                    return (pos, data, Vec::new(), BodyEnd::Truncated);
                }
                avail = input.len();
            }
            Ok(Step::Done { consumed, trailers }) => {
                assert!(consumed <= window.len() && trailers.end <= consumed);
                assert!(decoder.is_done());
                let mut slots = vec![httparse::EMPTY_HEADER; max_trailers];
                let parsed = chunked::parse_trailers(&window[trailers], &mut slots);
                let parsed = parsed.expect("a trailer section the decoder took parses");
                let refs: Vec<&Header<'_>> = parsed.iter().collect();
                return (pos + consumed, data, fields(&refs), BodyEnd::Complete);
            }
        }
    }
}

/// A request head parses the same from the buffer cut right after it, not
/// at all from one byte less, and the same again once re-encoded.
fn check_request_reparse(
    rest: &[u8],
    consumed: usize,
    head: &request::RequestHead<'_, '_>,
    forwarded: &[&Header<'_>],
    limits: &Limits,
) {
    let mut slots = vec![httparse::EMPTY_HEADER; limits.slots()];
    match request::parse(&rest[..consumed], &mut slots, limits) {
        Ok(Parsed::Complete {
            consumed: again, ..
        }) => assert_eq!(again, consumed),
        other => panic!("head not parsed again from its own bytes: {other:?}"),
    }
    let short = request::parse(&rest[..consumed - 1], &mut slots, limits);
    assert!(!matches!(short, Ok(Parsed::Complete { .. })), "{short:?}");
    let mut out = Vec::new();
    let pairs = forwarded.iter().map(|h| (h.name.as_bytes(), h.value));
    let written =
        response::write_request_head(&mut out, &head.method, head.target, head.version, pairs);
    written.expect("a parsed head can be written");
    // Written fields may take a byte more each (`name: value`).
    let roomier = Limits {
        max_uri_bytes: limits.max_uri_bytes + limits.slots() + consumed,
        ..*limits
    };
    match request::parse(&out, &mut slots, &roomier) {
        Ok(Parsed::Complete {
            head: again,
            consumed,
        }) => {
            assert_eq!(consumed, out.len());
            assert_eq!((&again.method, again.target), (&head.method, head.target));
            assert_eq!(again.version, head.version);
            let again_fields: Vec<&Header<'_>> = again.framing.forwarded(again.headers).collect();
            assert_eq!(fields(&again_fields), fields(forwarded));
            assert_eq!(again.framing.body, head.framing.body);
        }
        other => panic!("re-encoded head not parsed: {other:?}"),
    }
}

/// As [`check_request_reparse`], for a response head.
fn check_response_reparse(
    rest: &[u8],
    consumed: usize,
    head: &response::ResponseHead<'_, '_>,
    method: &Method,
) {
    let limits = ResponseLimits::default();
    let mut slots = vec![httparse::EMPTY_HEADER; limits.max_headers];
    match response::parse(&rest[..consumed], &mut slots, method, &limits) {
        Ok(Parsed::Complete {
            consumed: again, ..
        }) => assert_eq!(again, consumed),
        other => panic!("head not parsed again from its own bytes: {other:?}"),
    }
    let short = response::parse(&rest[..consumed - 1], &mut slots, method, &limits);
    assert!(!matches!(short, Ok(Parsed::Complete { .. })), "{short:?}");
    let mut out = Vec::new();
    let pairs = head.headers.iter().map(|h| (h.name.as_bytes(), h.value));
    let written = response::write_response_head(&mut out, head.version, head.status, "", pairs);
    written.expect("a parsed head can be written");
    let roomier = ResponseLimits {
        max_head_bytes: limits.max_head_bytes * 2,
        ..limits
    };
    match response::parse(&out, &mut slots, method, &roomier) {
        Ok(Parsed::Complete {
            head: again,
            consumed,
        }) => {
            assert_eq!(consumed, out.len());
            assert_eq!((again.version, again.status), (head.version, head.status));
            let a: Vec<&Header<'_>> = again.headers.iter().collect();
            let b: Vec<&Header<'_>> = head.headers.iter().collect();
            assert_eq!(fields(&a), fields(&b));
            assert_eq!(again.framing, head.framing);
        }
        other => panic!("re-encoded head not parsed: {other:?}"),
    }
}

/// The `h1_request` fuzz target: the input's first byte picks the limits
/// (odd: small ones, so the limit paths are reached too), the rest is the
/// stream.
pub fn fuzz_request(data: &[u8]) {
    let Some((&pick, stream)) = data.split_first() else {
        return;
    };
    request_stream_with(stream, &fuzz_limits(pick));
}

/// The limits a fuzz input's first byte `pick` chooses: small ones when
/// odd (so the limit paths are reached too), else the defaults.
pub fn fuzz_limits(pick: u8) -> Limits {
    if pick & 1 == 1 {
        Limits {
            max_header_bytes: 1024,
            max_headers: 8,
            max_uri_bytes: 256,
        }
    } else {
        Limits::default()
    }
}

/// The `h1_response` fuzz target: the first byte picks the request method
/// (`GET`, `HEAD`, `CONNECT`, `POST`), the rest is the stream.
pub fn fuzz_response(data: &[u8]) {
    let Some((&pick, stream)) = data.split_first() else {
        return;
    };
    let method = match pick % 4 {
        0 => Method::GET,
        1 => Method::HEAD,
        2 => Method::CONNECT,
        _ => Method::POST,
    };
    response_stream(stream, &method);
}
