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

/// The request's id: the client's `x-request-id` when sane (1..=128
/// bytes of visible ASCII), else 128 random bits as 32 hex digits.
pub fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(&X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .map_or_else(|| hex128(fastrand::u128(..)), str::to_owned)
}

/// `n` as 32 lower-case hex digits (this runs for every request).
fn hex128(n: u128) -> String {
    let mut out = [0u8; 32];
    meshless_trace::context::hex(&mut out, n);
    // Hex digits are ASCII: one allocation of the right size, no
    // `char` at a time.
    std::str::from_utf8(&out).map_or_else(|_| String::new(), str::to_owned)
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

/// Removes hop-by-hop headers, and those the `Connection` header names
/// (but never `Host`, `Content-Length` or `Transfer-Encoding`: a client
/// may not unname what the message is routed or framed by); keeps
/// `Connection: upgrade` and `Upgrade` for a protocol switch. A message
/// with `Transfer-Encoding` also loses its `Content-Length` (RFC 9112
/// 6.3: the coding decided the framing, and the length is stale). One
/// pass over the names present, then only what is there is removed (each
/// `remove` hashes: this runs on every request and response).
pub fn strip_hop_by_hop(headers: &mut HeaderMap, upgrading: bool) {
    if headers.contains_key(header::CONNECTION) {
        // Cloned (shared bytes, no copy) so that `headers` can be changed;
        // the first two on the stack (a message nearly always has one
        // `Connection` field: no allocation per request).
        let mut first: [Option<HeaderValue>; 2] = [None, None];
        let mut more: Vec<HeaderValue> = Vec::new();
        for (i, v) in headers.get_all(header::CONNECTION).iter().enumerate() {
            match first.get_mut(i) {
                Some(slot) => *slot = Some(v.clone()),
                None => more.push(v.clone()),
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
            if !(kept || switch) {
                // A `&str` key is parsed on the stack; an invalid name
                // matches nothing.
                headers.remove(token);
            }
        }
    }
    let mut present = [false; HOP_BY_HOP_COUNT];
    let mut upgrade = false;
    for name in headers.keys() {
        if let Some(i) = HOP_BY_HOP.iter().position(|h| h == name) {
            present[i] = true;
        }
        upgrade |= name == header::UPGRADE;
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
    pub request_id: &'a str,
    pub upgrading: bool,
    pub forwarding: &'a Forwarding,
    /// The upstream speaks HTTP/2: `TE: trailers` is kept.
    pub http2: bool,
    /// The request was forwarded by a peer proxy (ahead-of-time
    /// placement, its marker trusted): `X-Forwarded-For` and
    /// `X-Forwarded-Proto` are kept as that proxy set them, so the
    /// endpoint sees the original client, not the peer hop.
    pub hop: bool,
}

/// The headers sent upstream, made from the client's in place:
/// hop-by-hop removed, forwarding headers set.
pub fn forwarded_headers(mut headers: HeaderMap, f: &Forward<'_>) -> HeaderMap {
    let trailers = f.http2 && wants_trailers(&headers);
    let xff = match f.peer.to_str() {
        _ if f.hop => None,
        Ok(ip) if f.forwarding.x_forwarded_for == XffMode::Append => {
            // Every line, in order (RFC 9110 5.3: the lines of one field
            // combine with commas); a line that is not visible ASCII is
            // left out, as before.
            let mut joined = String::new();
            for line in headers
                .get_all(&X_FORWARDED_FOR)
                .iter()
                .filter_map(|v| v.to_str().ok())
            {
                joined.push_str(line);
                joined.push_str(", ");
            }
            joined.push_str(ip);
            HeaderValue::from_str(&joined)
                .ok()
                .or_else(|| Some(f.peer.clone()))
        }
        _ => Some(f.peer.clone()),
    };
    strip_hop_by_hop(&mut headers, f.upgrading);
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
    if let Ok(v) = HeaderValue::from_str(f.request_id) {
        headers.insert(X_REQUEST_ID.clone(), v);
    }
    headers
}

/// The request to endpoint `index` of `cluster`: its target is the
/// client's (shared, not parsed again) with the endpoint's authority.
pub fn build_request(
    parts: &http::request::Parts,
    headers: HeaderMap,
    cluster: &UpstreamCluster,
    index: usize,
    body: UpstreamBody,
) -> Result<Request<UpstreamBody>, http::Error> {
    let path = parts
        .uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    let mut target = http::uri::Parts::default();
    // HTTP/1.1 in origin form; HTTP/2 takes `:scheme` and `:authority` from it.
    let http2 = cluster.config.upstream_protocol == crate::config::UpstreamProtocol::Http2;
    if http2 {
        target.scheme = Some(if cluster.config.tls.is_some() {
            Scheme::HTTPS
        } else {
            Scheme::HTTP
        });
        // The client's host, as Envoy sends it (RFC 9113 8.3.1: `:authority`
        // instead of `Host`, and a server may refuse the two disagreeing):
        // its `Host`, else its own `:authority`, else the endpoint's address.
        let host = headers
            .get(header::HOST)
            .and_then(|v| Authority::try_from(v.as_bytes()).ok());
        target.authority = Some(
            host.or_else(|| parts.uri.authority().cloned())
                .unwrap_or_else(|| cluster.authorities[index].clone()),
        );
    }
    target.path_and_query = Some(path);
    let mut req = Request::new(body);
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = Uri::from_parts(target)?;
    *req.headers_mut() = headers;
    // Between proxies only (ahead-of-time placement's one-hop marker).
    req.headers_mut().remove(crate::placement::FORWARDED_BY);
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
    Ok(req)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn forward(forwarding: &Forwarding, http2: bool) -> Forward<'_> {
        Forward {
            peer: &PEER,
            secure: false,
            request_id: "id-1",
            upgrading: false,
            forwarding,
            http2,
            hop: false,
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
            assert_eq!(hex128(n), format!("{n:032x}"));
        }
    }

    #[test]
    fn request_ids_are_kept_when_sane() {
        let mut h = HeaderMap::new();
        assert_eq!(request_id(&h).len(), 32);
        h.insert(&X_REQUEST_ID, HeaderValue::from_static("abc"));
        assert_eq!(request_id(&h), "abc");
        let long = "a".repeat(129);
        h.insert(&X_REQUEST_ID, HeaderValue::from_str(&long).expect("value"));
        assert_eq!(request_id(&h).len(), 32);
    }
}
