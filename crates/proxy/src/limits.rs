//! Edge limits of a listener: connections, request heads, timeouts, the
//! methods and upgrades let through. Defaults are no looser than nginx's
//! and HAProxy's (see docs/config.md, "Listener limits").

use std::time::Duration;

use serde::{Deserialize, Serialize};

use meshless_model::FieldError;
use meshless_model::serde_duration as duration;

/// The settings of a running listener, updated in place on reload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerSettings {
    pub max_connections: u32,
    pub limits: HeadLimits,
    pub timeouts: ListenerTimeouts,
    pub trace: TracePolicy,
    pub paths: PathSettings,
    pub forwarding: Forwarding,
    pub protocol: crate::protocol::ListenerProtocol,
    /// Where flows go, on a `tcp` listener.
    pub tcp: Option<crate::protocol::TcpProxy>,
    /// Deny rules, checked at accept.
    pub deny: Vec<crate::deny::DenyRule>,
    /// PROXY protocol accepted from trusted peers.
    pub proxy_protocol: Option<crate::proxy_protocol::ProxyProtocolAccept>,
    /// Options of accepted sockets (those of the listening one apply at bind).
    pub socket: crate::sockopt::SocketOptions,
    /// What serves HTTP/1.1 downstream.
    pub http1: Http1Server,
    /// HTTP/2 stream-reset limits (rapid reset, CVE-2023-44487).
    pub http2: Http2Limits,
}

/// Downstream connections a listener serves at once by default.
/// `now + after`, or, when that overflows the clock, a deadline 30 years
/// away (never reached): a long timeout must not panic a connection's task.
pub fn deadline_after(now: tokio::time::Instant, after: Duration) -> tokio::time::Instant {
    const FAR: Duration = Duration::from_secs(30 * 365 * 24 * 60 * 60);
    now.checked_add(after)
        .or_else(|| now.checked_add(FAR))
        .unwrap_or(now)
}

pub fn default_max_connections() -> u32 {
    4096
}

/// `listeners[].limits:` the size of a request head.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeadLimits {
    /// Request-header bytes (each `name: value\r\n` line); more is `431`.
    #[serde(default = "default_max_header_bytes")]
    pub max_header_bytes: u32,
    /// Header fields; more is `431`.
    #[serde(default = "default_max_headers")]
    pub max_headers: u32,
    /// Request-target bytes (path and query); more is `414`.
    #[serde(default = "default_max_uri_bytes")]
    pub max_uri_bytes: u32,
}

impl Default for HeadLimits {
    fn default() -> Self {
        Self {
            max_header_bytes: default_max_header_bytes(),
            max_headers: default_max_headers(),
            max_uri_bytes: default_max_uri_bytes(),
        }
    }
}

fn default_max_header_bytes() -> u32 {
    16 * 1024
}
fn default_max_headers() -> u32 {
    100
}
fn default_max_uri_bytes() -> u32 {
    8 * 1024
}

/// `listeners[].timeouts:` downstream timeouts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTimeouts {
    /// Time to receive a whole request head, counted from the moment the
    /// connection waits for one — so it also closes an HTTP/1 keep-alive
    /// connection idle that long.
    #[serde(default = "default_request_headers", with = "duration")]
    pub request_headers: Duration,
    /// HTTP/2: a keep-alive PING every `idle`; a connection whose peer does
    /// not answer within `request_headers` is closed.
    #[serde(default = "default_idle", with = "duration")]
    pub idle: Duration,
    /// An upgraded tunnel (WebSocket) with no byte either way for this long
    /// is closed.
    #[serde(default = "default_stream_idle", with = "duration")]
    pub stream_idle: Duration,
    /// HTTP/1 (both servers; on `http1: hyper` through `send_timed`): a
    /// client that takes no byte of what the proxy writes to it (a response, a `100 Continue`, a refusal) for
    /// this long is closed (nginx's `send_timeout`), whether or not the
    /// response's body is still coming.
    #[serde(default = "default_send", with = "duration")]
    pub send: Duration,
}

impl Default for ListenerTimeouts {
    fn default() -> Self {
        Self {
            request_headers: default_request_headers(),
            idle: default_idle(),
            stream_idle: default_stream_idle(),
            send: default_send(),
        }
    }
}

fn default_request_headers() -> Duration {
    Duration::from_secs(10)
}
fn default_idle() -> Duration {
    Duration::from_secs(60)
}
fn default_stream_idle() -> Duration {
    Duration::from_secs(300)
}
fn default_send() -> Duration {
    Duration::from_secs(60)
}

/// `listeners[].http2:` limits on streams a downstream HTTP/2 client
/// resets (CVE-2023-44487, "rapid reset"): a connection past any of them
/// gets a GOAWAY.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Http2Limits {
    /// Streams reset by the client before they were accepted, pending at
    /// once (h2's `max_pending_accept_reset_streams`; hyper's default 20).
    #[serde(default = "default_max_pending_accept_reset_streams")]
    pub max_pending_accept_reset_streams: u32,
    /// Streams the proxy reset for protocol errors of the client (h2's
    /// `max_local_error_reset_streams`; hyper's default 1024).
    #[serde(default = "default_max_local_error_reset_streams")]
    pub max_local_error_reset_streams: u32,
    /// Streams the client reset before their response head, on one
    /// connection: once this many and more than half of its streams were,
    /// the connection gets a GOAWAY (Envoy's premature-reset rule, its
    /// `premature_reset_total_stream_count` 100).
    #[serde(default = "default_max_premature_resets")]
    pub max_premature_resets: u32,
}

impl Default for Http2Limits {
    fn default() -> Self {
        Self {
            max_pending_accept_reset_streams: default_max_pending_accept_reset_streams(),
            max_local_error_reset_streams: default_max_local_error_reset_streams(),
            max_premature_resets: default_max_premature_resets(),
        }
    }
}

impl Http2Limits {
    /// Each limit is at least 1 (none can be turned off).
    pub fn validate(&self) -> Result<(), FieldError> {
        if self.max_pending_accept_reset_streams == 0
            || self.max_local_error_reset_streams == 0
            || self.max_premature_resets == 0
        {
            return Err(FieldError::new(
                "",
                "max_pending_accept_reset_streams, max_local_error_reset_streams and max_premature_resets must be at least 1",
            ));
        }
        Ok(())
    }
}

fn default_max_pending_accept_reset_streams() -> u32 {
    20
}
fn default_max_local_error_reset_streams() -> u32 {
    1024
}
fn default_max_premature_resets() -> u32 {
    100
}

/// What a listener does with `TRACE` (RFC 9110 9.3.8: it echoes the
/// request, cookies and credentials included).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TracePolicy {
    /// Answered `405 Method Not Allowed`.
    #[default]
    Refuse,
    /// Forwarded like any other method.
    Forward,
}

/// What happens to `.` and `..` path segments before routing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DotSegments {
    /// Removed (RFC 3986 5.2.4); the endpoint gets the normalised path.
    #[default]
    Remove,
    /// The request is answered `400`.
    Reject,
    /// Left as sent.
    Keep,
}

/// `listeners[].paths:` path normalisation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathSettings {
    #[serde(default)]
    pub dot_segments: DotSegments,
    /// Merge runs of `/` into one (nginx's `merge_slashes`, Envoy's).
    #[serde(default)]
    pub merge_slashes: bool,
}

/// What the proxy does with `X-Forwarded-For`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum XffMode {
    /// The peer's address is appended to what the client sent.
    #[default]
    Append,
    /// Replaced by the peer's address (what a client sent is dropped).
    Overwrite,
}

/// `listeners[].forwarding:` forwarding headers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Forwarding {
    #[serde(default)]
    pub x_forwarded_for: XffMode,
    /// Proxies in front of this one that are trusted to append to
    /// `X-Forwarded-For` (Envoy's `xff_num_trusted_hops`): the client's
    /// address is the `trusted_hops`-th from the right of the header as
    /// received, instead of the peer's. Used by `hash_key: client_address`.
    #[serde(default)]
    pub trusted_hops: u32,
}

/// Upgrade protocols a route lets through by default.
pub fn default_upgrades() -> Vec<String> {
    vec!["websocket".to_owned()]
}

/// The largest `limits.max_headers` accepted: well below what a header map
/// can hold (32768 fields, less the few the proxy adds), so no head within
/// the limit can overflow one.
pub const MAX_HEADERS_BOUND: u32 = 10_000;

/// Checks one listener's limits; the error's path is relative to the listener.
pub fn validate(
    max_connections: u32,
    head: &HeadLimits,
    timeouts: &ListenerTimeouts,
) -> Result<(), FieldError> {
    if max_connections == 0 {
        return Err(FieldError::new("max_connections", "must be at least 1"));
    }
    for (field, value, least) in [
        ("max_header_bytes", head.max_header_bytes, 1024),
        ("max_uri_bytes", head.max_uri_bytes, 256),
        ("max_headers", head.max_headers, 1),
    ] {
        if value < least {
            return Err(FieldError::new(
                format!("limits.{field}"),
                format!("must be at least {least}, got {value}"),
            ));
        }
    }
    if head.max_headers > MAX_HEADERS_BOUND {
        return Err(FieldError::new(
            "limits.max_headers",
            format!(
                "must be at most {MAX_HEADERS_BOUND} (a header map holds at most 32768 fields), got {}",
                head.max_headers
            ),
        ));
    }
    for (field, d) in [
        ("request_headers", timeouts.request_headers),
        ("idle", timeouts.idle),
        ("stream_idle", timeouts.stream_idle),
        ("send", timeouts.send),
    ] {
        if d.is_zero() {
            return Err(FieldError::new(
                format!("timeouts.{field}"),
                "must be above zero",
            ));
        }
    }
    Ok(())
}

/// Checks a route's upgrade allowlist; the error's path is relative to the route.
pub fn validate_upgrades(upgrades: &[String]) -> Result<(), FieldError> {
    for (i, u) in upgrades.iter().enumerate() {
        let at = format!("upgrades[{i}]");
        if u.eq_ignore_ascii_case("h2c") {
            return Err(FieldError::new(
                at,
                "h2c upgrades are never passed through (they would carry HTTP/2 past routing and limits)",
            ));
        }
        if u.is_empty() || !u.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(FieldError::new(at, "not a protocol token"));
        }
    }
    Ok(())
}

/// What serves HTTP/1.1 downstream (`listeners[].http1`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Http1Server {
    /// hyper's HTTP/1 server connection.
    Hyper,
    /// meshless's own connection state machine (`crate::h1serve`): the
    /// default (no buffer held by an idle connection; CPU per request at
    /// or below hyper's, BENCHMARKS.md).
    #[default]
    Meshless,
}

#[cfg(test)]
mod deadline_tests {
    use super::*;

    #[test]
    fn a_deadline_past_the_clock_is_far_away_instead_of_a_panic() {
        let now = tokio::time::Instant::now();
        assert_eq!(
            deadline_after(now, Duration::from_secs(5)),
            now + Duration::from_secs(5)
        );
        assert!(deadline_after(now, Duration::MAX) > now + Duration::from_secs(365 * 24 * 3600));
    }
}
