//! What the proxy understands of gRPC (over HTTP/2, `content-type:
//! application/grpc`, `+...` or `;...`; not gRPC-Web): the `grpc-timeout` deadline, the `grpc-status` of a
//! response (in its headers for a trailers-only answer, else in its
//! trailers) and how it maps to an HTTP status for outlier detection and
//! metrics (Envoy's `Grpc::Utility::grpcToHttpStatus`), retry conditions
//! on status codes, and the proxy's own answers in gRPC form.

use std::time::Duration;

use http::StatusCode;
use http::header::{HeaderMap, HeaderName, HeaderValue};

use crate::config::RetryOn;

pub static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
pub static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
static GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// gRPC status codes (grpc/doc/statuscodes.md) the proxy names.
pub mod code {
    pub const OK: u32 = 0;
    pub const CANCELLED: u32 = 1;
    pub const UNKNOWN: u32 = 2;
    pub const DEADLINE_EXCEEDED: u32 = 4;
    pub const PERMISSION_DENIED: u32 = 7;
    pub const RESOURCE_EXHAUSTED: u32 = 8;
    pub const UNIMPLEMENTED: u32 = 12;
    pub const INTERNAL: u32 = 13;
    pub const UNAVAILABLE: u32 = 14;
    pub const UNAUTHENTICATED: u32 = 16;
}

/// Whether a request (or response) is native gRPC: `content-type:
/// application/grpc`, or it followed by `+` (`application/grpc+proto`) or
/// `;` (Envoy's `hasGrpcContentType`). gRPC-Web (`application/grpc-web`,
/// `application/grpc-web+proto`, `application/grpc-web-text`) is not: its
/// status is in a trailer frame inside the body, never in HTTP/2 trailers,
/// so the proxy treats it as plain HTTP (status, timeouts, local answers).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| is_grpc_type(v.as_bytes()))
}

fn is_grpc_type(v: &[u8]) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    let Some(head) = v.get(..GRPC.len()) else {
        return false;
    };
    head.eq_ignore_ascii_case(GRPC) && matches!(v.get(GRPC.len()), None | Some(b'+' | b';'))
}

/// The `grpc-timeout` header: 1 to 8 digits and a unit (`H`, `M`, `S`,
/// `m`, `u`, `n`), as the gRPC over HTTP/2 spec defines it; `None` when
/// absent or malformed (a malformed one is ignored, as Envoy does).
pub fn timeout(headers: &HeaderMap) -> Option<Duration> {
    let v = headers.get(&GRPC_TIMEOUT)?.to_str().ok()?;
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The `grpc-status` in `headers` (response headers or trailers).
pub fn status(headers: &HeaderMap) -> Option<u32> {
    headers.get(&GRPC_STATUS)?.to_str().ok()?.parse().ok()
}

/// The HTTP status a gRPC status stands for: Envoy's `grpcToHttpStatus`,
/// so outlier detection counts UNAVAILABLE (503) and DEADLINE_EXCEEDED
/// (504) as gateway failures, INTERNAL and UNKNOWN (500) as 5xx, and
/// RESOURCE_EXHAUSTED (429) as neither.
pub fn http_status(code: u32) -> u16 {
    match code {
        0 => 200,
        1 => 499,
        3 | 9 | 11 => 400,
        4 => 504,
        5 => 404,
        6 | 10 => 409,
        7 => 403,
        8 => 429,
        12 => 501,
        14 => 503,
        16 => 401,
        _ => 500,
    }
}

/// The retry condition a gRPC status matches (Envoy's `retry_on` gRPC
/// names), if any.
pub fn retry_on(code: u32) -> Option<RetryOn> {
    match code {
        code::CANCELLED => Some(RetryOn::Cancelled),
        code::DEADLINE_EXCEEDED => Some(RetryOn::DeadlineExceeded),
        code::INTERNAL => Some(RetryOn::Internal),
        code::RESOURCE_EXHAUSTED => Some(RetryOn::ResourceExhausted),
        code::UNAVAILABLE => Some(RetryOn::Unavailable),
        _ => None,
    }
}

/// The gRPC status of a local reply: by its reason where one says more
/// than the HTTP status (shed load is RESOURCE_EXHAUSTED, a timeout
/// DEADLINE_EXCEEDED), else Envoy's `httpToGrpcStatus` of the status.
pub fn local_code(status: StatusCode, reason: &str) -> u32 {
    match reason {
        "overflow" | "queue_full" => return code::RESOURCE_EXHAUSTED,
        "timeout" | "activation_timeout" => return code::DEADLINE_EXCEEDED,
        "no_endpoint" | "fallback" | "connect_failed" | "reset" | "start_failed" | "draining" => {
            return code::UNAVAILABLE;
        }
        "no_route" | "no_cluster" => return code::UNIMPLEMENTED,
        _ => {}
    }
    match status.as_u16() {
        400 => code::INTERNAL,
        401 => code::UNAUTHENTICATED,
        403 => code::PERMISSION_DENIED,
        404 => code::UNIMPLEMENTED,
        429 | 502..=504 => code::UNAVAILABLE,
        _ => code::UNKNOWN,
    }
}

/// `grpc-status: code` and `grpc-message: message` (percent-encoded as the
/// spec asks: bytes outside printable ASCII, and `%`).
pub fn status_headers(code: u32, message: &str) -> HeaderMap {
    let mut h = HeaderMap::with_capacity(2);
    h.insert(GRPC_STATUS.clone(), HeaderValue::from(code));
    let mut encoded = String::with_capacity(message.len());
    for b in message.trim_end().bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            encoded.push(char::from(b));
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    if let Ok(v) = HeaderValue::from_str(&encoded) {
        h.insert(GRPC_MESSAGE.clone(), v);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_timeout(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(&GRPC_TIMEOUT, HeaderValue::from_str(v).expect("value"));
        h
    }

    #[test]
    fn grpc_web_is_not_native_grpc() {
        let ct = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static(v));
            is_grpc(&h)
        };
        for yes in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc;x=1",
            "Application/GRPC",
        ] {
            assert!(ct(yes), "{yes}");
        }
        for no in [
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grpc-web-text",
            "application/grpcx",
            "application/json",
            "",
        ] {
            assert!(!ct(no), "{no}");
        }
    }

    #[test]
    fn grpc_timeout_follows_the_spec() {
        let t = |v| timeout(&with_timeout(v));
        assert_eq!(t("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(t("2M"), Some(Duration::from_secs(120)));
        assert_eq!(t("3S"), Some(Duration::from_secs(3)));
        assert_eq!(t("250m"), Some(Duration::from_millis(250)));
        assert_eq!(t("7u"), Some(Duration::from_micros(7)));
        assert_eq!(t("99999999n"), Some(Duration::from_nanos(99_999_999)));
        // More than 8 digits, no digits, no or unknown unit, signs: ignored.
        for bad in ["123456789S", "S", "5", "5s", "-5S", "+5S", "5 S", ""] {
            assert_eq!(t(bad), None, "{bad:?}");
        }
        assert_eq!(timeout(&HeaderMap::new()), None);
    }

    proptest::proptest! {
        /// Every value the spec allows (1-8 digits, any unit) parses to
        /// its duration; 9 digits or more never do.
        #[test]
        fn grpc_timeout_parses_every_valid_value(n in 0u64..100_000_000, unit in 0usize..6, lead in 1u64..10) {
            let units = [("H", 3_600_000_000_000u128), ("M", 60_000_000_000), ("S", 1_000_000_000), ("m", 1_000_000), ("u", 1_000), ("n", 1)];
            let (u, nanos_per_unit) = units[unit];
            let total = u128::from(n) * nanos_per_unit;
            let expected = Duration::new(
                u64::try_from(total / 1_000_000_000).expect("fits"),
                u32::try_from(total % 1_000_000_000).expect("fits"),
            );
            proptest::prop_assert_eq!(timeout(&with_timeout(&format!("{n}{u}"))), Some(expected));
            let nine_digits = format!("{lead}{n:08}{u}");
            proptest::prop_assert_eq!(timeout(&with_timeout(&nine_digits)), None);
        }
    }

    #[test]
    fn gateway_failures_are_the_ones_envoy_counts() {
        let gateway = |c| matches!(http_status(c), 502..=504);
        assert!(gateway(code::UNAVAILABLE) && gateway(code::DEADLINE_EXCEEDED));
        assert_eq!(http_status(code::INTERNAL), 500);
        assert_eq!(http_status(code::UNKNOWN), 500);
        assert_eq!(http_status(code::RESOURCE_EXHAUSTED), 429);
        assert_eq!(http_status(code::OK), 200);
        assert_eq!(http_status(code::CANCELLED), 499);
        // Codes past the table (17+) are unknown errors.
        assert_eq!(http_status(99), 500);
    }

    #[test]
    fn local_replies_name_the_right_code() {
        let c = |s: u16, r| local_code(StatusCode::from_u16(s).expect("status"), r);
        assert_eq!(c(503, "no_endpoint"), code::UNAVAILABLE);
        assert_eq!(c(503, "overflow"), code::RESOURCE_EXHAUSTED);
        assert_eq!(c(504, "timeout"), code::DEADLINE_EXCEEDED);
        assert_eq!(c(503, "activation_timeout"), code::DEADLINE_EXCEEDED);
        assert_eq!(c(404, "no_route"), code::UNIMPLEMENTED);
        assert_eq!(c(400, "client_error"), code::INTERNAL);
        assert_eq!(c(431, "headers_too_large"), code::UNKNOWN);
    }

    #[test]
    fn messages_are_percent_encoded() {
        let h = status_headers(14, "50% down: caf\u{e9}\n");
        assert_eq!(h[&GRPC_STATUS], "14");
        assert_eq!(h[&GRPC_MESSAGE], "50%25 down: caf%C3%A9");
    }
}
