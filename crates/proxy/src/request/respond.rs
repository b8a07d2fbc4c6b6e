//! Stage 5, respond: stream the upstream response downstream, or build the
//! proxy's own answer. Every local status goes through [`LocalReply`].

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use crate::body::{Completion, ProxyBody};
use crate::config::Fallback;
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
    pub fn respond(self, mut record: Completion) -> Response<ProxyBody> {
        record
            .state
            .metrics
            .local_reply(&record.listener, self.reason);
        record.status = self.status.as_u16();
        let mut resp = Response::new(ProxyBody::full(self.body, Some(record)));
        *resp.status_mut() = self.status;
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, self.content_type);
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

/// The upstream response, sent downstream: hop-by-hop headers removed; on
/// `101 Switching Protocols` the two upgraded connections are spliced.
pub fn proxied(
    mut resp: Response<Incoming>,
    downstream_upgrade: Option<hyper::upgrade::OnUpgrade>,
    mut record: Completion,
) -> Response<ProxyBody> {
    let status = resp.status();
    record.status = status.as_u16();
    let switching = status == StatusCode::SWITCHING_PROTOCOLS;
    if switching && let Some(down) = downstream_upgrade {
        let up = hyper::upgrade::on(&mut resp);
        tokio::spawn(splice_upgrade(down, up));
    }
    strip_hop_by_hop(resp.headers_mut(), switching);
    let (parts, body) = resp.into_parts();
    Response::from_parts(parts, ProxyBody::new(body.boxed(), Some(record)))
}

/// Copies bytes both ways between an upgraded downstream and upstream.
async fn splice_upgrade(down: hyper::upgrade::OnUpgrade, up: hyper::upgrade::OnUpgrade) {
    let (Ok(down), Ok(up)) = (down.await, up.await) else {
        return;
    };
    let mut down = TokioIo::new(down);
    let mut up = TokioIo::new(up);
    let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
}

#[cfg(test)]
mod tests {
    use super::*;

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
