//! How a cluster's endpoints are reached and judged: protocol, timeouts,
//! retries, circuit breakers, health checks and outlier detection.

use std::time::Duration;

use meshless_balance::OutlierConfig;
use meshless_model::serde_duration as duration;
use serde::{Deserialize, Serialize};

/// Protocol spoken to endpoints.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamProtocol {
    /// HTTP/1.1 with keep-alive.
    #[default]
    Http1,
    /// HTTP/2 over cleartext (prior knowledge), multiplexed.
    Http2,
}

/// `clusters[].http1`: which HTTP/1.1 client speaks to the endpoints
/// (with `upstream_protocol: http1`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Http1Client {
    /// hyper's client connection, driven by a task of its own per
    /// connection (a channel and a oneshot per request).
    Hyper,
    /// meshless's own (`crate::upstream::h1`, the default): the request's
    /// task writes the request and reads the response itself. Requests
    /// that ask to upgrade still go through hyper.
    #[default]
    Meshless,
}

/// `timeouts:` block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Timeouts {
    /// TCP connect.
    #[serde(default = "default_connect", with = "duration")]
    pub connect: Duration,
    /// From sending the request to the last response byte, every attempt
    /// included (Envoy's route timeout); an activation hold does not count.
    #[serde(default = "default_request", with = "duration")]
    pub request: Duration,
    /// Idle pooled connections are closed after this.
    #[serde(default = "default_idle", with = "duration")]
    pub idle: Duration,
    /// gRPC requests: `request` does not apply (a stream may last hours);
    /// their deadline is the client's `grpc-timeout`, capped by this; `0s`
    /// = no cap, and no deadline without `grpc-timeout` (Envoy's
    /// `max_stream_duration.grpc_timeout_header_max`).
    #[serde(default = "default_grpc_max", with = "duration")]
    pub grpc_max: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: default_connect(),
            request: default_request(),
            idle: default_idle(),
            grpc_max: default_grpc_max(),
        }
    }
}

fn default_connect() -> Duration {
    Duration::from_secs(1)
}
fn default_request() -> Duration {
    Duration::from_secs(15)
}
fn default_idle() -> Duration {
    Duration::from_secs(60)
}
fn default_grpc_max() -> Duration {
    Duration::ZERO
}

/// The largest `retries.count` accepted (Envoy's and HAProxy's users
/// retry 1 to 5 times; more only multiplies the load on a failing
/// endpoint).
pub const MAX_RETRIES: u32 = 10;

/// `retries:` block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Retries {
    /// Retries after the first attempt, 0..=[`MAX_RETRIES`]; 0 = off.
    #[serde(default = "default_retry_count")]
    pub count: u32,
    /// Failures that are retried.
    #[serde(default = "default_retry_on")]
    pub on: Vec<RetryOn>,
    /// Retry non-idempotent methods (POST, PATCH) too.
    #[serde(default)]
    pub all_methods: bool,
    /// Retries in flight may be at most this percent of active requests...
    #[serde(default = "default_budget_percent")]
    pub budget_percent: u32,
    /// ...but this many are always allowed.
    #[serde(default = "default_min_retries")]
    pub min_concurrent: u32,
}

impl Default for Retries {
    fn default() -> Self {
        Self {
            count: default_retry_count(),
            on: default_retry_on(),
            all_methods: false,
            budget_percent: default_budget_percent(),
            min_concurrent: default_min_retries(),
        }
    }
}

fn default_retry_count() -> u32 {
    1
}
fn default_retry_on() -> Vec<RetryOn> {
    vec![RetryOn::ConnectFailure]
}
fn default_budget_percent() -> u32 {
    20
}
fn default_min_retries() -> u32 {
    3
}

/// A retryable failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryOn {
    /// The connection could not be opened (the request never left).
    ConnectFailure,
    /// The connection broke before a response.
    Reset,
    /// HTTP/2: the endpoint refused the stream (REFUSED_STREAM; it did not
    /// process the request). Always retried when a retry is possible,
    /// listed or not.
    RefusedStream,
    /// A 5xx response.
    #[serde(rename = "5xx")]
    FiveXx,
    /// gRPC: a response whose headers carry `grpc-status` CANCELLED (1).
    Cancelled,
    /// gRPC: DEADLINE_EXCEEDED (4) in the response headers.
    DeadlineExceeded,
    /// gRPC: INTERNAL (13) in the response headers.
    Internal,
    /// gRPC: RESOURCE_EXHAUSTED (8) in the response headers.
    ResourceExhausted,
    /// gRPC: UNAVAILABLE (14) in the response headers.
    Unavailable,
}

/// `circuit_breakers:` block (Envoy's defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CircuitBreakers {
    /// Open upstream connections across the cluster.
    #[serde(default = "default_limit")]
    pub max_connections: u32,
    /// Requests sent and waiting for response headers.
    #[serde(default = "default_limit")]
    pub max_pending: u32,
    /// Requests active (until their response body ends).
    #[serde(default = "default_limit")]
    pub max_requests: u32,
}

impl Default for CircuitBreakers {
    fn default() -> Self {
        Self {
            max_connections: default_limit(),
            max_pending: default_limit(),
            max_requests: default_limit(),
        }
    }
}

fn default_limit() -> u32 {
    1024
}

/// `health_check:` block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthCheck {
    /// HTTP path probed with GET; 2xx and 3xx pass (absent:
    /// [`DEFAULT_HEALTH_PATH`]; see [`HealthCheck::path`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Check with `grpc.health.v1.Health/Check` over HTTP/2 instead of
    /// `path` (Envoy's `grpc_health_check`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<GrpcHealthCheck>,
    /// Check by opening a TCP connection only (passes when it connects;
    /// Envoy's `tcp_health_check` with no payload, HAProxy's `check`
    /// without `option httpchk`): for clusters of `tcp` listeners.
    #[serde(default)]
    pub tcp: bool,
    /// Time between checks of one endpoint.
    #[serde(default = "default_health_interval", with = "duration")]
    pub interval: Duration,
    /// Up to this much more between two checks, drawn afresh for each
    /// wait (Envoy's `interval_jitter`), so proxies started together do
    /// not check the same endpoints in step. 0 (default): none.
    #[serde(default, with = "duration")]
    pub interval_jitter: Duration,
    /// A check slower than this fails.
    #[serde(default = "default_health_timeout", with = "duration")]
    pub timeout: Duration,
    /// Passes that make an unhealthy endpoint healthy (HAProxy rise).
    #[serde(default = "default_rise")]
    pub healthy_threshold: u32,
    /// Failures that make a healthy endpoint unhealthy (HAProxy fall).
    #[serde(default = "default_fall")]
    pub unhealthy_threshold: u32,
}

/// `health_check.grpc:` block: passes when the answer is `SERVING`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrpcHealthCheck {
    /// The `service` asked about; `""` (default) is the server as a whole.
    #[serde(default)]
    pub service: String,
}

/// The path HTTP checks probe when `path` is absent.
pub const DEFAULT_HEALTH_PATH: &str = "/healthz";

impl HealthCheck {
    /// The path HTTP checks probe.
    pub fn path(&self) -> &str {
        self.path.as_deref().unwrap_or(DEFAULT_HEALTH_PATH)
    }
}
fn default_health_interval() -> Duration {
    Duration::from_secs(5)
}
fn default_health_timeout() -> Duration {
    Duration::from_secs(1)
}
fn default_rise() -> u32 {
    2
}
fn default_fall() -> u32 {
    3
}

/// `outlier_detection:` block (Envoy's defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutlierDetection {
    /// Consecutive 5xx (and gateway errors) that eject; 0 = off.
    #[serde(default = "default_consecutive_5xx")]
    pub consecutive_5xx: u32,
    /// Consecutive 502/503/504, connect failures, resets, timeouts that eject; 0 = off.
    #[serde(default = "default_consecutive_gateway_errors")]
    pub consecutive_gateway_errors: u32,
    /// How often ejections are reviewed.
    #[serde(default = "default_outlier_interval", with = "duration")]
    pub interval: Duration,
    /// Ejection time, times the number of ejections.
    #[serde(default = "default_base_ejection", with = "duration")]
    pub base_ejection_time: Duration,
    /// Longest ejection.
    #[serde(default = "default_max_ejection", with = "duration")]
    pub max_ejection_time: Duration,
    /// Largest share of the cluster ejected at once, 0..=100.
    #[serde(default = "default_max_ejection_percent")]
    pub max_ejection_percent: u8,
}

impl Default for OutlierDetection {
    fn default() -> Self {
        Self {
            consecutive_5xx: default_consecutive_5xx(),
            consecutive_gateway_errors: default_consecutive_gateway_errors(),
            interval: default_outlier_interval(),
            base_ejection_time: default_base_ejection(),
            max_ejection_time: default_max_ejection(),
            max_ejection_percent: default_max_ejection_percent(),
        }
    }
}

// Outlier defaults are the balance crate's (Envoy's), defined there once.
fn default_consecutive_5xx() -> u32 {
    OutlierConfig::default().consecutive_5xx
}
fn default_consecutive_gateway_errors() -> u32 {
    OutlierConfig::default().consecutive_gateway_errors
}
fn default_outlier_interval() -> Duration {
    OutlierConfig::default().interval
}
fn default_base_ejection() -> Duration {
    OutlierConfig::default().base_ejection_time
}
fn default_max_ejection() -> Duration {
    OutlierConfig::default().max_ejection_time
}
fn default_max_ejection_percent() -> u8 {
    OutlierConfig::default().max_ejection_percent
}
