//! Header rules of a forwarding hop (RFC 9110 7.6): hop-by-hop headers
//! removed, forwarding headers added, the upstream request built.

use std::net::{IpAddr, SocketAddr};

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Request, Uri};

use crate::limits::{Forwarding, XffMode};
use crate::snapshot::UpstreamCluster;
use crate::upstream::UpstreamBody;

/// Headers that describe one hop and are never forwarded (RFC 9110 7.6.1).
/// `Trailer` is not one (RFC 9110 6.6.2: it announces the trailer fields
/// end to end, and an HTTP/1.1 encoder sends only the trailers it names).
const HOP_BY_HOP_COUNT: usize = 8;
static HOP_BY_HOP: [HeaderName; HOP_BY_HOP_COUNT] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRANSFER_ENCODING,
    // Only meaningful with `Upgrade: h2c`, which is never passed through.
    HeaderName::from_static("http2-settings"),
];

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// A request's id, kept as the `x-request-id` value it is forwarded
/// with: the client's (a reference to the bytes of its head) or 32 hex
/// digits made once. Forwarding it takes a reference: no copy, no
/// allocation.
#[derive(Debug, Clone)]
pub struct RequestId(HeaderValue);

impl RequestId {
    /// The id as text (visible ASCII: checked when it was taken).
    pub fn as_str(&self) -> &str {
        self.0.to_str().unwrap_or_default()
    }

    /// The id as the header value it is forwarded with.
    pub fn value(&self) -> &HeaderValue {
        &self.0
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl RequestId {
    /// A new id: 128 random bits as 32 hex digits.
    pub fn random() -> Self {
        Self(hex128(fastrand::u128(..)))
    }
}

/// The request's id: the client's `x-request-id` when sane (1..=128
/// bytes of visible ASCII), else [`RequestId::random`].
pub fn request_id(headers: &HeaderMap) -> RequestId {
    let sane = headers
        .get(&X_REQUEST_ID)
        .filter(|v| v.to_str().is_ok() && !v.is_empty() && v.len() <= 128);
    sane.map_or_else(RequestId::random, |v| RequestId(v.clone()))
}

/// Which of the fields the request path looks up by name a client's
/// request carries, found in one pass over its map. A lookup hashes its
/// name even when the map lacks it, and these names are not standard
/// ones, so they are hashed byte by byte (about 140 instructions for
/// `x-forwarded-for`): most requests carry none of them, and the pass
/// (a comparison per name, of lengths and then bytes) costs less than
/// the lookups it spares.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Carried {
    pub request_id: bool,
    pub traceparent: bool,
    /// `x-meshless-forwarded-by`, ahead-of-time placement's marker.
    pub forwarded_by: bool,
    pub forwarded_for: bool,
}

impl Carried {
    /// As if every one were there: each is looked up.
    pub const ANY: Self = Self {
        request_id: true,
        traceparent: true,
        forwarded_by: true,
        forwarded_for: true,
    };

    /// What `headers` carries (one visit per name).
    pub fn of(headers: &HeaderMap) -> Self {
        let mut carried = Self::default();
        for name in headers.keys() {
            if *name == X_REQUEST_ID {
                carried.request_id = true;
            } else if *name == TRACEPARENT {
                carried.traceparent = true;
            } else if *name == crate::placement::FORWARDED_BY {
                carried.forwarded_by = true;
            } else if *name == X_FORWARDED_FOR {
                carried.forwarded_for = true;
            }
        }
        carried
    }
}

/// `traceparent` as a name made once: a `&str` key makes (and allocates)
/// a new name on every insert.
pub static TRACEPARENT: HeaderName = HeaderName::from_static(meshless_trace::context::TRACEPARENT);

/// The `traceparent` a request is forwarded with, its bytes in this
/// thread's chunk of small strings (`byte_arena`: no allocation).
pub fn traceparent_value(context: &meshless_trace::context::TraceParent) -> HeaderValue {
    HeaderValue::from_maybe_shared(crate::byte_arena::copy(&context.header_text()))
        .unwrap_or_else(|_| context.header_value())
}

/// `n` as 32 lower-case hex digits (this runs for every request).
fn hex128(n: u128) -> HeaderValue {
    let mut out = [0u8; 32];
    meshless_trace::context::hex(&mut out, n);
    // Copied into this thread's chunk of small strings: no allocation of
    // its own, and clones count references.
    HeaderValue::from_maybe_shared(crate::byte_arena::copy(&out))
        .unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// Methods a retry may repeat (RFC 9110 9.2.2).
pub fn is_idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}

/// Whether the request asks for a protocol switch (`Connection: upgrade`
/// with an `Upgrade` header).
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE) && connection_tokens(headers).any(|t| t == "upgrade")
}

/// The tokens of every `Connection` header, lower-cased.
fn connection_tokens(headers: &HeaderMap) -> impl Iterator<Item = String> + '_ {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
}

/// Which of [`HOP_BY_HOP`] `name` is, if any: a match on the name's text
/// (a length, then a comparison), not a comparison with each of them.
fn hop_by_hop(name: &str) -> Option<usize> {
    Some(match name {
        "connection" => 0,
        "keep-alive" => 1,
        "proxy-connection" => 2,
        "proxy-authenticate" => 3,
        "proxy-authorization" => 4,
        "te" => 5,
        "transfer-encoding" => 6,
        "http2-settings" => 7,
        _ => return None,
    })
}

/// Removes hop-by-hop headers, and those the `Connection` header names
/// (but never `Host`, `Content-Length` or `Transfer-Encoding`: a client
/// may not unname what the message is routed or framed by); keeps
/// `Connection: upgrade` and `Upgrade` for a protocol switch. A message
/// with `Transfer-Encoding` also loses its `Content-Length` (RFC 9112
/// 6.3: the coding decided the framing, and the length is stale).
///
/// One pass over the fields finds the hop-by-hop ones and the
/// `Connection` values; a name a `Connection` token gives is removed only
/// when a field has it (a second pass over the names, only for a token
/// that is none of the above: `close`, say); then only what is there is
/// removed. This runs on every request and response, and each `remove`
/// (or lookup) hashes the name.
pub fn strip_hop_by_hop(headers: &mut HeaderMap, upgrading: bool) {
    let mut present = [false; HOP_BY_HOP_COUNT];
    let mut upgrade = false;
    // Cloned (shared bytes, no copy) so that `headers` can be changed;
    // the first two on the stack (a message nearly always has at most one
    // `Connection` field: no allocation per request).
    let mut first: [Option<HeaderValue>; 2] = [None, None];
    let mut more: Vec<HeaderValue> = Vec::new();
    let mut listed = 0;
    for (name, value) in headers.iter() {
        let name = name.as_str();
        match hop_by_hop(name) {
            Some(i) => {
                present[i] = true;
                if i == 0 {
                    match first.get_mut(listed) {
                        Some(slot) => *slot = Some(value.clone()),
                        None => more.push(value.clone()),
                    }
                    listed += 1;
                }
            }
            None => upgrade |= name == "upgrade",
        }
    }
    let tokens = first
        .iter()
        .flatten()
        .chain(&more)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim);
    for token in tokens {
        let kept = ["host", "content-length", "transfer-encoding"]
            .iter()
            .any(|k| token.eq_ignore_ascii_case(k));
        let switch = upgrading && token.eq_ignore_ascii_case("upgrade");
        // A hop-by-hop name (and `Upgrade`, unless switching) goes below
        // anyway, whether a token names it or not.
        let below = token.eq_ignore_ascii_case("upgrade")
            || HOP_BY_HOP
                .iter()
                .any(|h| token.eq_ignore_ascii_case(h.as_str()));
        if kept || switch || below {
            continue;
        }
        if headers
            .keys()
            .any(|n| n.as_str().eq_ignore_ascii_case(token))
        {
            // A `&str` key is parsed on the stack.
            headers.remove(token);
        }
    }
    for (name, _) in HOP_BY_HOP.iter().zip(present).filter(|(_, p)| *p) {
        if *name == header::TRANSFER_ENCODING {
            headers.remove(header::CONTENT_LENGTH);
        }
        headers.remove(name);
    }
    if upgrading {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    } else if upgrade {
        headers.remove(header::UPGRADE);
    }
}

/// The client's address: the peer's, or with `trusted_hops` the one that
/// many entries from the right of `X-Forwarded-For` (Envoy's
/// `xff_num_trusted_hops`); the peer's when that entry is missing or not an
/// address.
pub fn client_ip(headers: &HeaderMap, peer: SocketAddr, forwarding: &Forwarding) -> IpAddr {
    let hops = forwarding.trusted_hops as usize;
    if hops == 0 {
        return peer.ip();
    }
    let entries: Vec<&str> = headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect();
    entries
        .len()
        .checked_sub(hops)
        .and_then(|i| entries[i].parse().ok())
        .unwrap_or_else(|| peer.ip())
}

/// Whether the client offered `TE: trailers` (gRPC needs it on HTTP/2).
fn wants_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("trailers"))
}

/// How the upstream request's headers are made.
#[derive(Debug, Clone, Copy)]
pub struct Forward<'a> {
    /// The peer's address as an `X-Forwarded-For` entry.
    pub peer: &'a HeaderValue,
    /// The client came over TLS: `X-Forwarded-Proto: https`.
    pub secure: bool,
    pub request_id: &'a HeaderValue,
    pub upgrading: bool,
    pub forwarding: &'a Forwarding,
    /// The upstream speaks HTTP/2: `TE: trailers` is kept.
    pub http2: bool,
    /// The request was forwarded by a peer proxy (ahead-of-time
    /// placement, its marker trusted): `X-Forwarded-For` and
    /// `X-Forwarded-Proto` are kept as that proxy set them, so the
    /// endpoint sees the original client, not the peer hop.
    pub hop: bool,
    /// What the client's map carries ([`Carried::ANY`]: look each up).
    pub carried: Carried,
}

/// `ip` as a field value (an `X-Forwarded-For` entry), as `Display`
/// writes it. An IPv4 address's digits are written here: the formatting
/// machinery took about 1,200 instructions per connection.
pub fn ip_value(ip: IpAddr) -> HeaderValue {
    let IpAddr::V4(v4) = ip else {
        return HeaderValue::from_str(&ip.to_string())
            .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
    };
    // At most "255.255.255.255".
    let mut text = [0u8; 15];
    let mut len = 0;
    let mut put = |b: u8| {
        text[len] = b;
        len += 1;
    };
    for (i, octet) in v4.octets().into_iter().enumerate() {
        if i > 0 {
            put(b'.');
        }
        if octet >= 100 {
            put(b'0' + octet / 100);
        }
        if octet >= 10 {
            put(b'0' + octet / 10 % 10);
        }
        put(b'0' + octet % 10);
    }
    HeaderValue::from_bytes(&text[..len]).unwrap_or_else(|_| HeaderValue::from_static("unknown"))
}

/// The headers sent upstream, made from the client's in place:
/// hop-by-hop removed, forwarding headers set.
pub fn forwarded_headers(mut headers: HeaderMap, f: &Forward<'_>) -> HeaderMap {
    // Read before the strip: `TE` is hop-by-hop.
    let trailers = f.http2 && wants_trailers(&headers);
    // First: an `X-Forwarded-For` the client's `Connection` names is
    // hop-by-hop (RFC 9110 7.6.1), gone before its lines are read.
    strip_hop_by_hop(&mut headers, f.upgrading);
    let xff = match f.peer.to_str() {
        _ if f.hop => None,
        Ok(ip) if f.forwarding.x_forwarded_for == XffMode::Append => {
            // Every line, in order (RFC 9110 5.3: the lines of one field
            // combine with commas); a line that is not visible ASCII is
            // left out, as before. With none, the peer's value is shared
            // as it is (no string made and checked per request), and
            // none is looked up when the map carries none.
            let mut lines = f
                .carried
                .forwarded_for
                .then(|| headers.get_all(&X_FORWARDED_FOR).iter())
                .into_iter()
                .flatten()
                .filter_map(|v| v.to_str().ok())
                .peekable();
            if lines.peek().is_none() {
                Some(f.peer.clone())
            } else {
                let mut joined = String::new();
                for line in lines {
                    joined.push_str(line);
                    joined.push_str(", ");
                }
                joined.push_str(ip);
                HeaderValue::from_str(&joined)
                    .ok()
                    .or_else(|| Some(f.peer.clone()))
            }
        }
        _ => Some(f.peer.clone()),
    };
    if trailers {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
    if let Some(v) = xff {
        headers.insert(X_FORWARDED_FOR.clone(), v);
    }
    if !(f.hop && headers.contains_key(&X_FORWARDED_PROTO)) {
        let proto = if f.secure { "https" } else { "http" };
        headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static(proto));
    }
    headers.insert(X_REQUEST_ID.clone(), f.request_id.clone());
    headers
}

/// The target of the request to endpoint `index` of `cluster`: the
/// client's (shared, not parsed again) with the endpoint's authority.
/// Apart from [`build_request`] so that a failure is known before a
/// connection is asked for (the request is made only once one is there).
/// `headers`: the forwarded ones (toward an HTTP/2 upstream their `Host`
/// is the `:authority`).
pub fn target(
    parts: &http::request::Parts,
    headers: Option<&HeaderMap>,
    cluster: &UpstreamCluster,
    index: usize,
) -> Result<Uri, http::Error> {
    let path = parts
        .uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    let mut target = http::uri::Parts::default();
    // HTTP/1.1 in origin form; HTTP/2 takes `:scheme` and `:authority` from it.
    if is_http2(cluster) {
        target.scheme = Some(if cluster.config.tls.is_some() {
            Scheme::HTTPS
        } else {
            Scheme::HTTP
        });
        // The client's host, as Envoy sends it (RFC 9113 8.3.1: `:authority`
        // instead of `Host`, and a server may refuse the two disagreeing):
        // its `Host`, else its own `:authority`, else the endpoint's address.
        let host = headers
            .and_then(|h| h.get(header::HOST))
            .and_then(|v| Authority::try_from(v.as_bytes()).ok());
        target.authority = Some(
            host.or_else(|| parts.uri.authority().cloned())
                .unwrap_or_else(|| cluster.authorities[index].clone()),
        );
    }
    target.path_and_query = Some(path);
    Ok(Uri::from_parts(target)?)
}

fn is_http2(cluster: &UpstreamCluster) -> bool {
    cluster.config.upstream_protocol == crate::config::UpstreamProtocol::Http2
}

/// The request to endpoint `index` of `cluster`, to `target` (see
/// [`target`]); `marked`: the headers may hold the placement marker
/// (`Carried::forwarded_by`), which is removed (a peer hop reads it in
/// them, up to here).
pub fn build_request(
    parts: &http::request::Parts,
    target: Uri,
    (headers, marked): (HeaderMap, bool),
    cluster: &UpstreamCluster,
    index: usize,
    body: UpstreamBody,
) -> Request<UpstreamBody> {
    let http2 = is_http2(cluster);
    let mut req = Request::new(body);
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = target;
    *req.headers_mut() = headers;
    // Between proxies only (ahead-of-time placement's one-hop marker).
    if marked {
        req.headers_mut().remove(crate::placement::FORWARDED_BY);
    }
    if http2 {
        // `:authority` says it.
        req.headers_mut().remove(header::HOST);
    } else if !req.headers().contains_key(header::HOST) {
        let host = match parts.uri.authority() {
            Some(a) => HeaderValue::from_str(a.as_str()).ok(),
            // What hyper-util's client did: the endpoint's address.
            None => HeaderValue::from_str(cluster.authorities[index].as_str()).ok(),
        };
        if let Some(v) = host {
            req.headers_mut().insert(header::HOST, v);
        }
    }
    req
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value from the shared chunk is the one the trace crate writes,
    /// and a request id is 32 hex digits, however many are made.
    #[test]
    fn generated_values_from_the_shared_chunk_are_whole() {
        for _ in 0..200 {
            let p = meshless_trace::context::TraceParent::random();
            assert_eq!(traceparent_value(&p), p.header_value());
            let id = RequestId::random();
            assert_eq!(id.as_str().len(), 32);
            assert!(id.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
        }
    }

    #[test]
    fn every_connection_field_names_what_is_removed() {
        let mut h = HeaderMap::new();
        for (i, v) in ["x-a", "x-b, x-c", "x-d", "X-E"].into_iter().enumerate() {
            h.append(header::CONNECTION, HeaderValue::from_static(v));
            h.insert(
                ["x-a", "x-b", "x-d", "x-e"][i],
                HeaderValue::from_static("1"),
            );
        }
        h.insert("x-c", HeaderValue::from_static("1"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h, false);
        let left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["x-kept"]);
    }

    #[test]
    fn the_name_match_is_the_list() {
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_by_hop(name.as_str()), Some(i), "{name}");
        }
        for other in [
            "upgrade",
            "host",
            "trailer",
            "content-length",
            "connectio",
            "",
        ] {
            assert_eq!(hop_by_hop(other), None, "{other}");
        }
    }

    /// The removal as it was before the one pass: a `remove` per token and
    /// a comparison of every name with each hop-by-hop one.
    fn strip_reference(headers: &mut HeaderMap, upgrading: bool) {
        let values: Vec<HeaderValue> = headers
            .get_all(header::CONNECTION)
            .iter()
            .cloned()
            .collect();
        let tokens = values
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim);
        for token in tokens {
            let kept = ["host", "content-length", "transfer-encoding"]
                .iter()
                .any(|k| token.eq_ignore_ascii_case(k));
            let switch = upgrading && token.eq_ignore_ascii_case("upgrade");
            if !(kept || switch) {
                headers.remove(token);
            }
        }
        let mut upgrade = false;
        let mut present = Vec::new();
        for name in headers.keys() {
            if HOP_BY_HOP.contains(name) {
                present.push(name.clone());
            }
            upgrade |= name == header::UPGRADE;
        }
        for name in present {
            if name == header::TRANSFER_ENCODING {
                headers.remove(header::CONTENT_LENGTH);
            }
            headers.remove(name);
        }
        if upgrading {
            headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        } else if upgrade {
            headers.remove(header::UPGRADE);
        }
    }

    /// Each name with its values in order, names sorted: removals may
    /// leave the entries in another order, which no encoder depends on.
    fn by_name(h: &HeaderMap) -> Vec<(String, Vec<Vec<u8>>)> {
        let mut out: Vec<(String, Vec<Vec<u8>>)> = h
            .keys()
            .map(|n| {
                let values = h.get_all(n).iter().map(|v| v.as_bytes().to_vec()).collect();
                (n.as_str().to_owned(), values)
            })
            .collect();
        out.sort();
        out
    }

    const NAMES: [&str; 16] = [
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "transfer-encoding",
        "http2-settings",
        "upgrade",
        "host",
        "content-length",
        "trailer",
        "close",
        "x-a",
        "x-b",
        "x-c",
    ];

    const TOKENS: [&str; 12] = [
        "keep-alive",
        "close",
        "Upgrade",
        "x-a",
        "X-B",
        "host",
        "Content-Length",
        "transfer-encoding",
        "TE",
        "",
        "not a name",
        "trailer",
    ];

    #[test]
    fn every_octet_is_written_as_display_writes_it() {
        for o in 0..=255u8 {
            for ip in [[o, 0, 0, 1], [10, o, 255, o], [o, o, o, o]] {
                let ip = IpAddr::from(ip);
                assert_eq!(ip_value(ip).as_bytes(), ip.to_string().as_bytes());
            }
        }
    }

    proptest::proptest! {
        /// An address's field value is its `Display` text, IPv4 (written
        /// here) and IPv6 (mapped ones included) alike.
        #[test]
        fn an_address_value_is_its_display_text(v4: u32, v6: u128, mapped: u32) {
            let mapped = std::net::Ipv4Addr::from(mapped).to_ipv6_mapped();
            for ip in [IpAddr::from(v4.to_be_bytes()), IpAddr::from(v6.to_be_bytes()), mapped.into()] {
                let (value, text) = (ip_value(ip), ip.to_string());
                proptest::prop_assert_eq!(value.as_bytes(), text.as_bytes());
            }
        }
    }

    proptest::proptest! {
        /// The one pass removes what the remove per token and per name did.
        #[test]
        fn one_pass_removes_what_a_remove_per_name_did(
            fields in proptest::collection::vec((0..NAMES.len(), 0..4usize), 0..12),
            lists in proptest::collection::vec(
                proptest::collection::vec(0..TOKENS.len(), 0..4), 0..3),
            upgrading: bool,
        ) {
            let mut h = HeaderMap::new();
            for (n, v) in fields {
                let value = HeaderValue::from_str(&format!("v{v}")).expect("value");
                h.append(HeaderName::from_static(NAMES[n]), value);
            }
            for list in lists {
                let text: Vec<&str> = list.iter().map(|&t| TOKENS[t]).collect();
                let value = HeaderValue::from_str(&text.join(", ")).expect("value");
                h.append(header::CONNECTION, value);
            }
            let mut reference = h.clone();
            strip_reference(&mut reference, upgrading);
            strip_hop_by_hop(&mut h, upgrading);
            proptest::prop_assert_eq!(by_name(&h), by_name(&reference));
        }
    }

    proptest::proptest! {
        /// Fields left out on arrival change nothing the strip leaves:
        /// the map made without them and stripped is the full one
        /// stripped.
        #[test]
        fn fields_dropped_on_arrival_are_what_the_strip_removes(
            fields in proptest::collection::vec((0..NAMES.len(), 0..4usize), 0..12),
            lists in proptest::collection::vec(
                proptest::collection::vec(0..TOKENS.len(), 0..4), 0..3),
            upgrading: bool,
        ) {
            let mut all: Vec<(&str, String)> = fields
                .into_iter()
                .map(|(n, v)| (NAMES[n], format!("v{v}")))
                .collect();
            for list in lists {
                let text: Vec<&str> = list.iter().map(|&t| TOKENS[t]).collect();
                all.push(("connection", text.join(", ")));
            }
            let map = |keep: &dyn Fn(&str, &str) -> bool| {
                let mut h = HeaderMap::new();
                for (name, value) in all.iter().filter(|(n, v)| keep(n, v)) {
                    let value = HeaderValue::from_str(value).expect("value");
                    h.append(HeaderName::from_static(name), value);
                }
                strip_hop_by_hop(&mut h, upgrading);
                by_name(&h)
            };
            let full = map(&|_, _| true);
            let arrived = map(&|n, v| !crate::hop_fields::dropped_on_arrival(n, v.as_bytes()));
            proptest::prop_assert_eq!(arrived, full);
        }
    }

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert("x-kept", HeaderValue::from_static("1"));
        let fwd = Forwarding::default();
        let f = forward(&fwd, false);
        let out = forwarded_headers(h, &f);
        assert!(out.get("x-secret").is_none() && out.get("keep-alive").is_none());
        assert!(
            out.get(header::CONNECTION).is_none() && out.get(header::TRANSFER_ENCODING).is_none()
        );
        assert_eq!(out.get("x-kept").map(|v| v.as_bytes()), Some(&b"1"[..]));
        assert_eq!(
            out.get("x-forwarded-for").map(|v| v.as_bytes()),
            Some(&b"10.0.0.9"[..])
        );
        assert_eq!(
            out.get("x-request-id").map(|v| v.as_bytes()),
            Some(&b"id-1"[..])
        );
    }

    static PEER: HeaderValue = HeaderValue::from_static("10.0.0.9");
    static ID: HeaderValue = HeaderValue::from_static("id-1");

    fn forward(forwarding: &Forwarding, http2: bool) -> Forward<'_> {
        Forward {
            peer: &PEER,
            secure: false,
            request_id: &ID,
            upgrading: false,
            forwarding,
            http2,
            hop: false,
            carried: Carried::ANY,
        }
    }

    const CARRIED_NAMES: [&str; 8] = [
        "x-forwarded-for",
        "x-meshless-forwarded-by",
        "x-request-id",
        "traceparent",
        "x-forwarded-proto",
        "connection",
        "host",
        "x-a",
    ];

    #[test]
    fn carried_names_each_field_looked_up_by_name() {
        let mut h = HeaderMap::new();
        assert_eq!(Carried::of(&h), Carried::default());
        for name in &CARRIED_NAMES[..4] {
            h.append(*name, HeaderValue::from_static("v"));
        }
        h.append("x-forwarded-for", HeaderValue::from_static("w"));
        assert_eq!(Carried::of(&h), Carried::ANY);
    }

    proptest::proptest! {
        /// The upstream's fields made with what the map carries are the
        /// ones made looking every name up.
        #[test]
        fn what_is_carried_spares_lookups_and_changes_nothing(
            fields in proptest::collection::vec((0..CARRIED_NAMES.len(), 0..3usize), 0..10),
            mode_overwrite: bool,
            hop: bool,
        ) {
            let values = ["1.1.1.1", "node-z", "x-a, x-request-id"];
            let mut h = HeaderMap::new();
            for (n, v) in fields {
                h.append(CARRIED_NAMES[n], HeaderValue::from_static(values[v]));
            }
            let mut fwd = Forwarding::default();
            if mode_overwrite {
                fwd.x_forwarded_for = XffMode::Overwrite;
            }
            let every = Forward { hop, ..forward(&fwd, false) };
            let spared = Forward { carried: Carried::of(&h), ..every };
            proptest::prop_assert_eq!(
                by_name(&forwarded_headers(h.clone(), &spared)),
                by_name(&forwarded_headers(h, &every))
            );
        }
    }

    #[test]
    fn a_peer_hop_keeps_the_forwarding_proxys_headers() {
        let mut h = HeaderMap::new();
        h.insert(
            "x-forwarded-for",
            HeaderValue::from_static("1.1.1.1, 2.2.2.2"),
        );
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        let fwd = Forwarding::default();
        let f = Forward {
            hop: true,
            ..forward(&fwd, false)
        };
        let out = forwarded_headers(h.clone(), &f);
        assert_eq!(out["x-forwarded-for"], "1.1.1.1, 2.2.2.2");
        assert_eq!(out["x-forwarded-proto"], "https");
        h.remove("x-forwarded-proto");
        h.insert("x-forwarded-for", HeaderValue::from_static("garbage"));
        let out = forwarded_headers(h, &f);
        assert_eq!(out["x-forwarded-proto"], "http", "set when missing");
        assert_eq!(
            out["x-forwarded-for"], "garbage",
            "kept as the peer sent it"
        );
    }

    #[test]
    fn xff_appends_or_overwrites() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", HeaderValue::from_static("1.1.1.1"));
        let mut fwd = Forwarding::default();
        let out = forwarded_headers(h.clone(), &forward(&fwd, false));
        assert_eq!(out["x-forwarded-for"], "1.1.1.1, 10.0.0.9");
        fwd.x_forwarded_for = XffMode::Overwrite;
        let out = forwarded_headers(h.clone(), &forward(&fwd, false));
        assert_eq!(out["x-forwarded-for"], "10.0.0.9");
    }

    #[test]
    fn forwarded_proto_says_https_for_a_tls_client_whatever_it_sent() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        let fwd = Forwarding::default();
        let out = forwarded_headers(h.clone(), &forward(&fwd, false));
        assert_eq!(out["x-forwarded-proto"], "http");
        let secure = Forward {
            secure: true,
            ..forward(&fwd, false)
        };
        let out = forwarded_headers(HeaderMap::new(), &secure);
        assert_eq!(out["x-forwarded-proto"], "https");
    }

    #[test]
    fn trusted_hops_pick_the_client_from_the_right() {
        let mut h = HeaderMap::new();
        h.insert(
            "x-forwarded-for",
            HeaderValue::from_static("9.9.9.9, 2.2.2.2, 3.3.3.3"),
        );
        let peer: SocketAddr = "10.0.0.9:1".parse().expect("addr");
        let hops = |n| Forwarding {
            trusted_hops: n,
            ..Forwarding::default()
        };
        assert_eq!(client_ip(&h, peer, &hops(0)).to_string(), "10.0.0.9");
        assert_eq!(client_ip(&h, peer, &hops(1)).to_string(), "3.3.3.3");
        assert_eq!(client_ip(&h, peer, &hops(3)).to_string(), "9.9.9.9");
        assert_eq!(client_ip(&h, peer, &hops(4)).to_string(), "10.0.0.9");
    }

    #[test]
    fn te_trailers_is_kept_only_toward_http2() {
        let mut h = HeaderMap::new();
        h.insert(header::TE, HeaderValue::from_static("trailers, deflate"));
        let fwd = Forwarding::default();
        assert!(
            forwarded_headers(h.clone(), &forward(&fwd, false))
                .get(header::TE)
                .is_none()
        );
        assert_eq!(
            forwarded_headers(h.clone(), &forward(&fwd, true))[header::TE],
            "trailers"
        );
    }

    #[test]
    fn upgrade_needs_both_headers() {
        let mut h = HeaderMap::new();
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(!is_upgrade(&h));
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        assert!(is_upgrade(&h));
    }

    #[test]
    fn hex_ids_match_the_formatter() {
        for n in [0, 1, 0xabc, u128::MAX, u128::MAX / 3, 1 << 127] {
            assert_eq!(hex128(n), format!("{n:032x}").as_str());
        }
    }

    #[test]
    fn request_ids_are_kept_when_sane() {
        let mut h = HeaderMap::new();
        assert_eq!(request_id(&h).as_str().len(), 32);
        h.insert(&X_REQUEST_ID, HeaderValue::from_static("abc"));
        assert_eq!(request_id(&h).as_str(), "abc");
        let long = "a".repeat(129);
        h.insert(&X_REQUEST_ID, HeaderValue::from_str(&long).expect("value"));
        assert_eq!(request_id(&h).as_str().len(), 32);
        h.insert(&X_REQUEST_ID, HeaderValue::from_static("a\tb"));
        assert_eq!(request_id(&h).as_str(), "a\tb", "a tab is visible enough");
        let bad = HeaderValue::from_bytes(b"caf\xc3\xa9").expect("value");
        h.insert(&X_REQUEST_ID, bad);
        assert_eq!(request_id(&h).as_str().len(), 32, "not ASCII: replaced");
    }
}
