//! Stage 5, respond: stream the upstream response downstream, or build the
//! proxy's own answer. Every local status goes through [`LocalReply`].

use crate::upstream::ResponseBody;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::BodyExt;

use crate::config::Fallback;
use crate::request::Downstream;
use crate::request::body::{Completion, ProxyBody};
use crate::request::grpc;
use crate::request::headers::strip_hop_by_hop;

/// A response the proxy makes itself, and the reason it is counted under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: StatusCode,
    pub body: Bytes,
    /// Label of `proxy_local_replies` (`no_route`, `overflow`, `timeout`, ...).
    pub reason: &'static str,
    pub content_type: HeaderValue,
    /// Seconds for a `Retry-After` header.
    pub retry_after: Option<u32>,
    /// Adds `Allow` (the methods forwarded), for a `405`.
    pub allow: bool,
    /// Closes the HTTP/1 connection after the reply: what follows a
    /// refused head cannot be trusted to be framed as the client meant.
    pub close: bool,
}

impl LocalReply {
    /// A plain-text reply.
    pub fn text(status: StatusCode, text: impl Into<Bytes>, reason: &'static str) -> Self {
        Self {
            status,
            body: text.into(),
            reason,
            content_type: HeaderValue::from_static("text/plain; charset=utf-8"),
            retry_after: None,
            allow: false,
            close: false,
        }
    }

    /// A request shed by a circuit breaker or budget.
    pub fn overflow(limit: &'static str) -> Self {
        Self::text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("overflow: {limit}\n"),
            "overflow",
        )
    }

    /// The cluster's fallback answer, or a plain 503, when no endpoint is usable.
    pub fn no_endpoint(fallback: Option<&Fallback>) -> Self {
        let Some(f) = fallback else {
            return Self::text(
                StatusCode::SERVICE_UNAVAILABLE,
                "no healthy upstream\n",
                "no_endpoint",
            );
        };
        let status = StatusCode::from_u16(f.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        let mut r = Self::text(status, f.body.clone(), "fallback");
        if let Ok(v) = HeaderValue::from_str(&f.content_type) {
            r.content_type = v;
        }
        r
    }

    /// Adds `Retry-After: secs`.
    pub fn retry_after(mut self, secs: Option<u32>) -> Self {
        self.retry_after = secs;
        self
    }

    /// The response, counted and recorded in `record`.
    pub fn respond(self, mut record: Box<Completion>) -> Response<ProxyBody> {
        record
            .state
            .metrics
            .local_reply(&record.listener, self.reason);
        record.status = self.status.as_u16();
        // A local body is complete at once: no deadline cuts it. Its
        // answer is whole (a gRPC one carries its status), so no status
        // is still due from an upstream response it replaces.
        record.deadline = None;
        record.grpc_status_due = false;
        if record.grpc {
            return self.respond_grpc(record);
        }
        self.plain(Some(record))
    }

    /// The response alone, for a request with no record (nothing counted).
    pub fn unrecorded(self) -> Response<ProxyBody> {
        self.plain(None)
    }

    /// The plain-HTTP response: the status, the text, its headers.
    fn plain(self, record: Option<Box<Completion>>) -> Response<ProxyBody> {
        let mut resp = Response::new(ProxyBody::full(self.body, record));
        *resp.status_mut() = self.status;
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, self.content_type);
        if self.close {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if self.allow {
            resp.headers_mut().insert(
                header::ALLOW,
                HeaderValue::from_static("GET, HEAD, POST, PUT, DELETE, OPTIONS, PATCH"),
            );
        }
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

impl LocalReply {
    /// The reply to a gRPC request, as Envoy makes it: HTTP 200, trailers
    /// only (`grpc-status`, `grpc-message` in the headers, no body), so the
    /// client reports the status rather than a protocol error. The record
    /// keeps the HTTP status the reply stands for (metrics, access log).
    fn respond_grpc(self, mut record: Box<Completion>) -> Response<ProxyBody> {
        let code = grpc::local_code(self.status, self.reason);
        record.grpc_code = Some(code);
        let message = String::from_utf8_lossy(&self.body);
        let mut resp = Response::new(ProxyBody::full(Bytes::new(), Some(record)));
        *resp.headers_mut() = grpc::status_headers(code, &message);
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        if self.close {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

/// The upstream response, sent downstream: hop-by-hop headers removed. On
/// `101 Switching Protocols` the two upgraded connections are spliced in a
/// tunnel that keeps `record` (and so its slot and guard) until it closes.
pub fn proxied(
    mut resp: Response<ResponseBody>,
    upgrade: Option<hyper::upgrade::OnUpgrade>,
    mut record: Box<Completion>,
    downstream: &Downstream,
    peer: &crate::request::Peer,
) -> Response<ProxyBody> {
    let status = resp.status();
    record.status = status.as_u16();
    record.grpc_response(status, resp.headers());
    record.grpc_outcome(resp.headers());
    let switching = status == StatusCode::SWITCHING_PROTOCOLS;
    strip_hop_by_hop(resp.headers_mut(), switching);
    one_content_length(status, resp.headers_mut());
    if switching && let Some(down) = upgrade {
        let up = hyper::upgrade::on(&mut resp);
        let idle = downstream.settings().timeouts.stream_idle;
        // The connection is alive (it carries this response): its guards
        // go with the tunnel, which outlives the HTTP/1 connection's task.
        let connection = peer.connection.upgrade();
        crate::request::tunnel::spawn(&downstream.tunnels, down, up, record, connection, idle);
        let (parts, body) = resp.into_parts();
        return Response::from_parts(parts, ProxyBody::new(body.boxed(), None));
    }
    let (parts, body) = resp.into_parts();
    Response::from_parts(parts, ProxyBody::new(body.boxed(), Some(record)))
}

/// At most one `Content-Length`, with one number: a repeated one (two
/// lines, or `3, 3`: the upstream client already checked they agree) is
/// sent once, and none on a `1xx` or `204` (RFC 9110 8.6). An HTTP/2
/// client refuses anything else (RFC 9113 8.1.1).
fn one_content_length(status: StatusCode, h: &mut http::HeaderMap) {
    if status.is_informational() || status == StatusCode::NO_CONTENT {
        h.remove(http::header::CONTENT_LENGTH);
        return;
    }
    let mut lines = h.get_all(http::header::CONTENT_LENGTH).iter();
    let Some(first) = lines.next() else {
        return;
    };
    if lines.next().is_none() && !first.as_bytes().contains(&b',') {
        return;
    }
    let n = first
        .to_str()
        .ok()
        .and_then(|v| v.split(',').next())
        .and_then(|n| n.trim().parse::<u64>().ok());
    match n {
        Some(n) => {
            h.insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(n));
        }
        None => {
            h.remove(http::header::CONTENT_LENGTH);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_carries_one_content_length_and_none_on_204() {
        let mut h = http::HeaderMap::new();
        h.append("content-length", http::HeaderValue::from_static("3"));
        h.append("content-length", http::HeaderValue::from_static("3"));
        one_content_length(StatusCode::OK, &mut h);
        let all: Vec<_> = h.get_all("content-length").iter().collect();
        assert_eq!(all, ["3"]);
        let mut h = http::HeaderMap::new();
        h.append("content-length", http::HeaderValue::from_static("3, 3"));
        one_content_length(StatusCode::OK, &mut h);
        assert_eq!(
            h.get_all("content-length").iter().collect::<Vec<_>>(),
            ["3"]
        );
        let mut h = http::HeaderMap::new();
        h.append("content-length", http::HeaderValue::from_static("5"));
        one_content_length(StatusCode::NO_CONTENT, &mut h);
        assert!(h.get("content-length").is_none());
        one_content_length(StatusCode::NOT_MODIFIED, &mut h);
        let mut h = http::HeaderMap::new();
        h.append("content-length", http::HeaderValue::from_static("5"));
        one_content_length(StatusCode::NOT_MODIFIED, &mut h);
        assert_eq!(
            h.get_all("content-length").iter().collect::<Vec<_>>(),
            ["5"]
        );
    }

    #[test]
    fn fallback_replaces_the_plain_503() {
        let plain = LocalReply::no_endpoint(None);
        assert_eq!(plain.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(plain.reason, "no_endpoint");
        let f = Fallback {
            status: 200,
            body: "sorry".into(),
            content_type: "text/html".into(),
        };
        let r = LocalReply::no_endpoint(Some(&f));
        assert_eq!(
            (r.status, r.reason, &r.body[..]),
            (StatusCode::OK, "fallback", &b"sorry"[..])
        );
        assert_eq!(r.content_type, "text/html");
    }

    #[test]
    fn overflow_names_the_limit() {
        let r = LocalReply::overflow("max_pending");
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(&r.body[..], b"overflow: max_pending\n");
    }
}
