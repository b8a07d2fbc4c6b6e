//! Stage 0, screen: what the proxy refuses before routing — request heads
//! over the listener's limits (`431`, `414`), `CONNECT` (`501`), `TRACE`
//! (`405` unless forwarded), and a `Host` that disagrees with the
//! absolute-form target or HTTP/2 `:authority` (`400`, RFC 9112 3.2.2).
//! hyper has already rejected what it cannot parse.

use http::header::{self, HeaderMap};
use http::{Method, StatusCode};

use crate::limits::{HeadLimits, ListenerSettings, TracePolicy};
use crate::request::respond::LocalReply;

/// Bytes a header field takes on the wire as `name: value\r\n`.
fn field_bytes(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum()
}

/// The reply refusing `parts` on `listener`, if it is refused.
pub fn screen(listener: &ListenerSettings, parts: &http::request::Parts) -> Option<LocalReply> {
    let mut refused = refusal(listener, parts)?;
    refused.close = true;
    Some(refused)
}

fn refusal(listener: &ListenerSettings, parts: &http::request::Parts) -> Option<LocalReply> {
    let limits = &listener.limits;
    let target = parts.uri.path_and_query().map_or(0, |p| p.as_str().len());
    if target > limits.max_uri_bytes as usize {
        return Some(uri_too_long(limits));
    }
    if parts.headers.len() > limits.max_headers as usize
        || field_bytes(&parts.headers) > limits.max_header_bytes as usize
    {
        return Some(headers_too_large(limits));
    }
    if parts.method == Method::CONNECT {
        return Some(LocalReply::text(
            StatusCode::NOT_IMPLEMENTED,
            "CONNECT is not supported\n",
            "method_refused",
        ));
    }
    if parts.method == Method::TRACE && listener.trace == TracePolicy::Refuse {
        let mut r = LocalReply::text(
            StatusCode::METHOD_NOT_ALLOWED,
            "TRACE is refused\n",
            "method_refused",
        );
        r.allow = true;
        return Some(r);
    }
    host_mismatch(parts)
}

/// `414`: the request target is over `max_uri_bytes` (also what
/// `http1: meshless` answers when its codec refuses a head for it).
pub fn uri_too_long(limits: &HeadLimits) -> LocalReply {
    LocalReply::text(
        StatusCode::URI_TOO_LONG,
        format!("request target over {} bytes\n", limits.max_uri_bytes),
        "uri_too_long",
    )
}

/// `431`: the header fields are over `max_headers` or `max_header_bytes`.
pub fn headers_too_large(limits: &HeadLimits) -> LocalReply {
    LocalReply::text(
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        format!(
            "request headers over {} fields or {} bytes\n",
            limits.max_headers, limits.max_header_bytes
        ),
        "headers_too_large",
    )
}

/// `400` when there is more than one `Host`, or it disagrees with the
/// target's authority.
fn host_mismatch(parts: &http::request::Parts) -> Option<LocalReply> {
    let hosts = parts.headers.get_all(header::HOST);
    let several = hosts.iter().nth(1).is_some();
    let disagree = parts.uri.authority().is_some_and(|authority| {
        hosts.iter().any(|h| {
            !h.as_bytes()
                .eq_ignore_ascii_case(authority.as_str().as_bytes())
        })
    });
    (several || disagree).then(|| {
        LocalReply::text(
            StatusCode::BAD_REQUEST,
            "more than one Host, or Host disagrees with the request target\n",
            "host_mismatch",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn listener() -> ListenerSettings {
        let yaml = crate::config::ONE_LISTENER_YAML;
        let cfg = crate::ProxyConfig::parse(yaml, "t.yaml").expect("config");
        cfg.listeners[0].settings()
    }

    fn status(l: &ListenerSettings, req: Request<()>) -> Option<StatusCode> {
        screen(l, &req.into_parts().0).map(|r| r.status)
    }

    #[test]
    fn defaults_refuse_what_nginx_and_haproxy_refuse() {
        let l = listener();
        let long = format!("/{}", "a".repeat(9000));
        assert_eq!(
            status(&l, Request::get(long).body(()).expect("req")),
            Some(StatusCode::URI_TOO_LONG)
        );
        let big = "v".repeat(17 * 1024);
        assert_eq!(
            status(
                &l,
                Request::get("/")
                    .header("x-big", big)
                    .body(())
                    .expect("req")
            ),
            Some(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        );
        let mut many = Request::get("/");
        for i in 0..101 {
            many = many.header(format!("x-h{i}"), "1");
        }
        assert_eq!(
            status(&l, many.body(()).expect("req")),
            Some(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        );
        assert_eq!(
            status(
                &l,
                Request::get("/ok")
                    .header("host", "a")
                    .body(())
                    .expect("req")
            ),
            None
        );
    }

    #[test]
    fn connect_and_trace_are_refused_trace_configurably() {
        let mut l = listener();
        let trace = || {
            Request::builder()
                .method(Method::TRACE)
                .uri("/")
                .body(())
                .expect("req")
        };
        assert_eq!(status(&l, trace()), Some(StatusCode::METHOD_NOT_ALLOWED));
        l.trace = TracePolicy::Forward;
        assert_eq!(status(&l, trace()), None);
        let connect = Request::builder()
            .method(Method::CONNECT)
            .uri("example.com:443")
            .body(())
            .expect("req");
        assert_eq!(status(&l, connect), Some(StatusCode::NOT_IMPLEMENTED));
    }

    #[test]
    fn host_must_agree_with_an_absolute_target() {
        let l = listener();
        let req = |host: &str| {
            Request::get("http://a.example/x")
                .header("host", host)
                .body(())
                .expect("req")
        };
        assert_eq!(status(&l, req("a.example")), None);
        assert_eq!(status(&l, req("A.EXAMPLE")), None);
        assert_eq!(status(&l, req("b.example")), Some(StatusCode::BAD_REQUEST));
    }
}
