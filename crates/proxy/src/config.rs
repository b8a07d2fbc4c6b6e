//! The proxy's YAML configuration: every field, its default, and the
//! validation that rejects a bad file with the file, the field path and the
//! reason. Documented field by field in `docs/config.md`.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use meshless_balance::{
    BalancerConfig, ClusterConfig as BalanceClusterConfig, ConfigError, HashKind, HealthConfig,
    LocalityConfig, LocalityMode, OutlierConfig, PolicyKind,
};
use meshless_model::{AtPath, Endpoint, FieldError};
use serde::{Deserialize, Serialize};

use meshless_model::serde_duration as duration;

/// The whole proxy configuration file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyConfig {
    /// The admin HTTP server.
    #[serde(default)]
    pub admin: AdminConfig,
    /// Where this proxy runs, for locality.
    #[serde(default)]
    pub node: NodeConfig,
    /// Where JSON access-log lines go.
    #[serde(default)]
    pub access_log: AccessLog,
    /// On SIGTERM/SIGINT, how long in-flight requests may take to finish.
    #[serde(default = "default_drain_timeout", with = "duration")]
    pub drain_timeout: Duration,
    /// On SIGTERM/SIGINT, how long `/ready` fails while listeners still
    /// serve, before they stop accepting and drain.
    #[serde(default, with = "duration")]
    pub drain_delay: Duration,
    /// Ports the proxy accepts requests on.
    #[serde(default)]
    pub listeners: Vec<ListenerConfig>,
    /// Groups of endpoints requests are balanced over.
    #[serde(default)]
    pub clusters: Vec<ClusterConfig>,
    /// The control plane that serves `service:` clusters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control: Option<ControlLink>,
}

/// Where the control plane's distribution stream is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlLink {
    /// gRPC address of the control plane, `host:port`.
    pub address: String,
    /// File holding the bearer token the control plane requires.
    #[serde(default)]
    pub token_file: Option<std::path::PathBuf>,
}

fn default_drain_timeout() -> Duration {
    Duration::from_secs(10)
}

/// The admin HTTP server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Listen address; loopback by default.
    #[serde(default = "default_admin_address")]
    pub address: SocketAddr,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            address: default_admin_address(),
        }
    }
}

fn default_admin_address() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9901))
}

/// This proxy's place in the cluster.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Node name, matched against endpoint `node`.
    #[serde(default)]
    pub name: Option<String>,
    /// Zone, matched against endpoint `zone`.
    #[serde(default)]
    pub zone: Option<String>,
}

/// Access-log destination: `stdout`, `off`, or a file path (appended to).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum AccessLog {
    /// One JSON line per request on standard output.
    Stdout,
    /// No access log.
    #[default]
    Off,
    /// Appended to this file.
    File(String),
}

impl From<String> for AccessLog {
    fn from(s: String) -> Self {
        match s.as_str() {
            "stdout" => AccessLog::Stdout,
            "off" => AccessLog::Off,
            _ => AccessLog::File(s),
        }
    }
}

impl From<AccessLog> for String {
    fn from(a: AccessLog) -> Self {
        match a {
            AccessLog::Stdout => "stdout".into(),
            AccessLog::Off => "off".into(),
            AccessLog::File(f) => f,
        }
    }
}

/// One listening port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    /// Unique name, used in metrics and logs.
    pub name: String,
    /// Address to bind.
    pub address: SocketAddr,
    /// Only `http` (HTTP/1.1 and h2c on the same port).
    #[serde(default)]
    pub protocol: ListenerProtocol,
    /// Routes, matched in order; the first match wins.
    pub routes: Vec<RouteConfig>,
    /// Downstream connections served at once; more wait in the kernel's
    /// accept backlog until one closes.
    #[serde(default = "crate::limits::default_max_connections")]
    pub max_connections: u32,
    /// Request-head size limits.
    #[serde(default)]
    pub limits: crate::limits::HeadLimits,
    /// Downstream timeouts.
    #[serde(default)]
    pub timeouts: crate::limits::ListenerTimeouts,
    /// `TRACE`: `refuse` (405) or `forward`. `CONNECT` is always refused (501).
    #[serde(default)]
    pub trace: crate::limits::TracePolicy,
    /// Path normalisation before routing.
    #[serde(default)]
    pub paths: crate::limits::PathSettings,
    /// `X-Forwarded-For` handling.
    #[serde(default)]
    pub forwarding: crate::limits::Forwarding,
}

impl ListenerConfig {
    /// The settings a running listener takes from this block.
    pub fn settings(&self) -> crate::limits::ListenerSettings {
        crate::limits::ListenerSettings {
            max_connections: self.max_connections,
            limits: self.limits.clone(),
            timeouts: self.timeouts.clone(),
            trace: self.trace,
            paths: self.paths.clone(),
            forwarding: self.forwarding.clone(),
        }
    }
}

/// Listener protocols.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ListenerProtocol {
    /// HTTP/1.1 and HTTP/2 with prior knowledge, cleartext.
    #[default]
    Http,
}

/// One route: a match and where matching requests go.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Name for logs and metrics; defaults to the route's position.
    #[serde(default)]
    pub name: Option<String>,
    /// Conditions, all of which must hold; empty matches everything.
    #[serde(rename = "match", default)]
    pub matcher: MatchConfig,
    /// Send to this cluster...
    #[serde(default)]
    pub cluster: Option<String>,
    /// ...or split across these clusters by weight.
    #[serde(default)]
    pub weighted_clusters: Option<Vec<WeightedCluster>>,
    /// `Upgrade` protocols passed through (case-insensitive); others are
    /// stripped and the request forwarded as a plain one. `h2c` never.
    #[serde(default = "crate::limits::default_upgrades")]
    pub upgrades: Vec<String>,
}

/// Request conditions.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatchConfig {
    /// Host (without port), exact, or `*.example.com` for any subdomain.
    #[serde(default)]
    pub host: Option<String>,
    /// Exact path.
    #[serde(default)]
    pub path: Option<String>,
    /// Path prefix.
    #[serde(default)]
    pub path_prefix: Option<String>,
    /// Headers that must be present (and equal `value`, when given).
    #[serde(default)]
    pub headers: Vec<HeaderMatch>,
}

/// One header condition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderMatch {
    /// Header name (case-insensitive).
    pub name: String,
    /// Exact value; absent = the header only has to be present.
    #[serde(default)]
    pub value: Option<String>,
}

/// A cluster and its share of a route's traffic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightedCluster {
    /// Cluster name.
    pub cluster: String,
    /// Relative weight (e.g. percent).
    pub weight: u32,
}

/// A cluster of endpoints and how to reach and balance them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Unique name, referenced by routes.
    pub name: String,
    /// Static endpoints.
    #[serde(default)]
    pub endpoints: Vec<EndpointConfig>,
    /// Endpoints from the control plane: `NAMESPACE/NAME` (instead of `endpoints`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// Algorithm and affinity key.
    #[serde(default)]
    pub balancer: BalancerYaml,
    /// Prefer this proxy's node, then zone.
    #[serde(default)]
    pub locality: Option<LocalityYaml>,
    /// Protocol to the endpoints.
    #[serde(default)]
    pub upstream_protocol: UpstreamProtocol,
    /// Timeouts.
    #[serde(default)]
    pub timeouts: Timeouts,
    /// Retries and their budget.
    #[serde(default)]
    pub retries: Retries,
    /// Limits that shed load instead of queueing forever.
    #[serde(default)]
    pub circuit_breakers: CircuitBreakers,
    /// Active health checks; absent = off.
    #[serde(default)]
    pub health_check: Option<HealthCheck>,
    /// Passive outlier ejection.
    #[serde(default)]
    pub outlier_detection: OutlierDetection,
    /// The answer when no endpoint is usable, instead of a bare 503.
    #[serde(default)]
    pub fallback: Option<Fallback>,
    /// Hold requests while the service has no ready instance (scale from zero).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation: Option<Activation>,
    /// Panic mode on or off (off = `panic_threshold: 0`).
    #[serde(default = "default_panic_mode")]
    pub panic_mode: bool,
    /// Below this percent of endpoints available, spread over all of them
    /// (Envoy's `healthy_panic_threshold`, default 50; 0 disables).
    #[serde(default = "default_panic_threshold")]
    pub panic_threshold: u8,
}

fn default_panic_threshold() -> u8 {
    meshless_balance::DEFAULT_PANIC_THRESHOLD
}

fn default_panic_mode() -> bool {
    true
}

/// One static endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// IP address and port (no DNS names).
    pub address: SocketAddr,
    /// Relative weight, 1..=10000.
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Zone of the endpoint.
    #[serde(default)]
    pub zone: Option<String>,
    /// Node of the endpoint.
    #[serde(default)]
    pub node: Option<String>,
}

fn default_weight() -> u32 {
    1
}

/// `balancer:` block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BalancerYaml {
    /// round_robin, random, least_request, p2c, ring_hash, maglev, bounded_load.
    /// A name, checked by validation (not by serde, whose error would not
    /// name the policies there are).
    #[serde(default = "default_policy")]
    pub policy: String,
    /// Where the affinity key comes from (hash policies).
    #[serde(default)]
    pub hash_key: Option<HashKey>,
    /// Bounded-load factor c >= 1.0.
    #[serde(default = "default_load_factor")]
    pub load_factor: f64,
    /// Draws per pick for p2c.
    #[serde(default = "default_choices")]
    pub choices: usize,
    /// Maglev table size (prime).
    #[serde(default = "default_table_size")]
    pub table_size: usize,
    /// Ring size; absent = 160 points per endpoint.
    #[serde(default)]
    pub ring_size: Option<usize>,
    /// Hash under bounded_load: maglev or ring_hash.
    #[serde(default = "default_over")]
    pub over: String,
}

impl Default for BalancerYaml {
    fn default() -> Self {
        Self {
            policy: default_policy(),
            hash_key: None,
            load_factor: default_load_factor(),
            choices: default_choices(),
            table_size: default_table_size(),
            ring_size: None,
            over: default_over(),
        }
    }
}

// The balancer's defaults are the balance crate's, defined there once.
fn default_policy() -> String {
    BalancerConfig::default().policy.name().to_owned()
}
fn default_load_factor() -> f64 {
    BalancerConfig::default().load_factor
}
fn default_choices() -> usize {
    BalancerConfig::default().choices
}
fn default_table_size() -> usize {
    BalancerConfig::default().table_size
}
fn default_over() -> String {
    BalancerConfig::default().over.name().to_owned()
}

impl BalancerYaml {
    /// The policy named by `policy`; the error names the policies there are.
    pub fn policy_kind(&self) -> Result<PolicyKind, FieldError> {
        self.policy.parse().map_err(|_| {
            let names: Vec<&str> = PolicyKind::ALL.iter().map(|p| p.name()).collect();
            FieldError::new(
                "policy",
                format!(
                    "unknown policy {:?} (expected one of {})",
                    self.policy,
                    names.join(", ")
                ),
            )
        })
    }

    /// The hash named by `over`.
    pub fn over_kind(&self) -> Result<HashKind, FieldError> {
        self.over.parse().map_err(|_| {
            FieldError::new(
                "over",
                format!("expected maglev or ring_hash, got {:?}", self.over),
            )
        })
    }
}

/// The source of a request's affinity key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum HashKey {
    /// A request header's value.
    Header(String),
    /// A cookie's value.
    Cookie(String),
    /// A query parameter's value.
    Query(String),
    /// The request path.
    Path,
    /// The client's IP address.
    ClientAddress,
}

/// `locality:` block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalityYaml {
    /// On or off.
    #[serde(default = "default_locality_enabled")]
    pub enabled: bool,
    /// prefer (default), proportional (Envoy zone-aware) or local_only
    /// (node only, no spill).
    #[serde(default)]
    pub mode: LocalityMode,
    /// prefer: spill to the next tier below this available share (0.0..=1.0).
    #[serde(default = "default_min_healthy_share")]
    pub min_healthy_share: f64,
    /// proportional: no locality below this many endpoints (Envoy: 6).
    #[serde(default = "default_min_cluster_size")]
    pub min_cluster_size: usize,
}

fn default_locality_enabled() -> bool {
    true
}
fn default_min_healthy_share() -> f64 {
    meshless_balance::DEFAULT_MIN_HEALTHY_SHARE
}
fn default_min_cluster_size() -> usize {
    meshless_balance::DEFAULT_MIN_CLUSTER_SIZE
}

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
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: default_connect(),
            request: default_request(),
            idle: default_idle(),
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

/// `retries:` block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Retries {
    /// Retries after the first attempt; 0 = off.
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
    /// A 5xx response.
    #[serde(rename = "5xx")]
    FiveXx,
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
    /// HTTP path probed with GET; 2xx and 3xx pass.
    #[serde(default = "default_health_path")]
    pub path: String,
    /// Time between checks of one endpoint.
    #[serde(default = "default_health_interval", with = "duration")]
    pub interval: Duration,
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

fn default_health_path() -> String {
    "/healthz".into()
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

/// `activation:` block: requests for a `service:` cluster with no ready
/// endpoint are held while the control plane starts an instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Activation {
    /// Requests held at once per cluster; past it, 503 with `Retry-After`.
    #[serde(default = "default_max_queued")]
    pub max_queued: u32,
    /// A held request waits at most this long, then 504.
    #[serde(default = "default_queue_timeout", with = "duration")]
    pub queue_timeout: Duration,
    /// How often a starting instance's address is probed (TCP connect).
    #[serde(default = "default_probe_interval", with = "duration")]
    pub probe_interval: Duration,
    /// Hard limit of requests in flight per instance; 0 = none.
    #[serde(default)]
    pub container_concurrency: u32,
}

fn default_max_queued() -> u32 {
    10_000
}
fn default_queue_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_probe_interval() -> Duration {
    Duration::from_millis(5)
}

/// `fallback:` block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fallback {
    /// Status code.
    #[serde(default = "default_fallback_status")]
    pub status: u16,
    /// Body.
    #[serde(default)]
    pub body: String,
    /// Content-Type of the body.
    #[serde(default = "default_content_type")]
    pub content_type: String,
}

fn default_fallback_status() -> u16 {
    503
}
fn default_content_type() -> String {
    "text/plain; charset=utf-8".into()
}

/// A rejected configuration: the file, the field path and the reason.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    /// The file could not be read.
    #[error("{file}: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    /// A field is missing, unknown or out of range.
    #[error("{file}: {path}: {reason}")]
    Invalid {
        file: String,
        path: String,
        reason: String,
    },
}

impl ProxyConfig {
    /// Reads and validates `file`.
    pub fn load(file: &Path) -> Result<Self, ConfigFileError> {
        let name = file.display().to_string();
        let text = std::fs::read_to_string(file).map_err(|source| ConfigFileError::Read {
            file: name.clone(),
            source,
        })?;
        Self::parse(&text, &name)
    }

    /// Parses and validates YAML `text`; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Self, ConfigFileError> {
        let config: ProxyConfig =
            meshless_model::yaml::from_str(text).map_err(|FieldError { path, reason }| {
                ConfigFileError::Invalid {
                    file: file.to_owned(),
                    path,
                    reason,
                }
            })?;
        config
            .validate()
            .map_err(|FieldError { path, reason }| ConfigFileError::Invalid {
                file: file.to_owned(),
                path,
                reason,
            })?;
        Ok(config)
    }

    /// Checks what the types alone cannot: names, references, ranges.
    pub fn validate(&self) -> Result<(), FieldError> {
        let err = |path: String, reason: &str| Err(FieldError::new(path, reason));
        let mut names = HashSet::new();
        let mut addresses = HashSet::new();
        // Port 0 means "any free port": such addresses never collide.
        if self.admin.address.port() != 0
            && self
                .listeners
                .iter()
                .any(|l| l.address == self.admin.address)
        {
            return err("admin.address".into(), "is also a listener's address");
        }
        let clusters: HashSet<&str> = self.clusters.iter().map(|c| c.name.as_str()).collect();
        for (i, l) in self.listeners.iter().enumerate() {
            let at = format!("listeners[{i}]");
            if l.name.is_empty() {
                return err(format!("{at}.name"), "must not be empty");
            }
            if !names.insert(l.name.as_str()) {
                return err(
                    format!("{at}.name"),
                    &format!("duplicate listener name {:?}", l.name),
                );
            }
            if l.address.port() != 0 && !addresses.insert(l.address) {
                return err(
                    format!("{at}.address"),
                    &format!("{} is used by another listener", l.address),
                );
            }
            if l.routes.is_empty() {
                return err(format!("{at}.routes"), "at least one route is required");
            }
            crate::limits::validate(l.max_connections, &l.limits, &l.timeouts).at(&at)?;
            for (j, r) in l.routes.iter().enumerate() {
                let route = format!("{at}.routes[{j}]");
                validate_route(r, &clusters).at(&route)?;
                crate::limits::validate_upgrades(&r.upgrades).at(&route)?;
            }
        }
        let mut cluster_names = HashSet::new();
        for (i, c) in self.clusters.iter().enumerate() {
            let at = format!("clusters[{i}]");
            if c.name.is_empty() {
                return err(format!("{at}.name"), "must not be empty");
            }
            if !cluster_names.insert(c.name.as_str()) {
                return err(
                    format!("{at}.name"),
                    &format!("duplicate cluster name {:?}", c.name),
                );
            }
            validate_cluster(c, self.control.is_some()).at(&at)?;
            let local_only = c
                .locality
                .as_ref()
                .is_some_and(|l| l.enabled && l.mode == LocalityMode::LocalOnly);
            if local_only && self.node.name.is_none() {
                return err(
                    format!("{at}.locality.mode"),
                    "local_only needs this proxy's node.name (it sends only to endpoints on that node)",
                );
            }
        }
        Ok(())
    }
}

/// Checks one route; the error's path is relative to the route.
fn validate_route(r: &RouteConfig, clusters: &HashSet<&str>) -> Result<(), FieldError> {
    let fail = |path: String, reason: String| Err(FieldError::new(path, reason));
    match (&r.cluster, &r.weighted_clusters) {
        (Some(c), None) => {
            if !clusters.contains(c.as_str()) {
                return fail("cluster".to_owned(), format!("unknown cluster {c:?}"));
            }
        }
        (None, Some(list)) => {
            if list.is_empty() || list.iter().all(|w| w.weight == 0) {
                return fail(
                    "weighted_clusters".to_owned(),
                    "needs at least one cluster with weight > 0".into(),
                );
            }
            for (k, w) in list.iter().enumerate() {
                if !clusters.contains(w.cluster.as_str()) {
                    return fail(
                        format!("weighted_clusters[{k}].cluster"),
                        format!("unknown cluster {:?}", w.cluster),
                    );
                }
            }
        }
        _ => {
            return fail(
                String::new(),
                "exactly one of `cluster` or `weighted_clusters` is required".into(),
            );
        }
    }
    if r.matcher.path.is_some() && r.matcher.path_prefix.is_some() {
        return fail(
            "match".to_owned(),
            "use `path` or `path_prefix`, not both".into(),
        );
    }
    for (field, p) in [
        ("path", &r.matcher.path),
        ("path_prefix", &r.matcher.path_prefix),
    ] {
        if let Some(p) = p
            && !p.starts_with('/')
        {
            return fail(
                format!("match.{field}"),
                format!("must start with '/', got {p:?}"),
            );
        }
    }
    for (k, h) in r.matcher.headers.iter().enumerate() {
        if http::HeaderName::from_bytes(h.name.as_bytes()).is_err() {
            return fail(
                format!("match.headers[{k}].name"),
                format!("not a valid header name: {:?}", h.name),
            );
        }
    }
    Ok(())
}

/// Checks one cluster; the error's path is relative to the cluster.
fn validate_cluster(c: &ClusterConfig, control: bool) -> Result<(), FieldError> {
    let fail = |path: String, reason: String| Err(FieldError::new(path, reason));
    if let Some(service) = &c.service {
        let ok = service
            .split_once('/')
            .is_some_and(|(ns, name)| !ns.is_empty() && !name.is_empty() && !name.contains('/'));
        if !ok {
            return fail(
                "service".to_owned(),
                format!("expected NAMESPACE/NAME, got {service:?}"),
            );
        }
        if !c.endpoints.is_empty() {
            return fail(
                "endpoints".to_owned(),
                "use `endpoints` or `service`, not both".into(),
            );
        }
        if !control {
            return fail(
                "service".to_owned(),
                "needs the top-level `control` block".into(),
            );
        }
    }
    if let Some(HashKey::Header(h)) = &c.balancer.hash_key
        && http::HeaderName::from_bytes(h.as_bytes()).is_err()
    {
        return fail(
            "balancer.hash_key.header".to_owned(),
            format!("not a valid header name: {h:?}"),
        );
    }
    if let Some(hc) = &c.health_check {
        if !hc.path.starts_with('/') {
            return fail(
                "health_check.path".to_owned(),
                format!("must start with '/', got {:?}", hc.path),
            );
        }
        if hc.healthy_threshold == 0 {
            return fail(
                "health_check.healthy_threshold".to_owned(),
                "must be at least 1".into(),
            );
        }
        if hc.unhealthy_threshold == 0 {
            return fail(
                "health_check.unhealthy_threshold".to_owned(),
                "must be at least 1".into(),
            );
        }
        if hc.interval.is_zero() || hc.timeout.is_zero() {
            return fail(
                "health_check.interval".to_owned(),
                "interval and timeout must be above zero".into(),
            );
        }
    }
    if c.outlier_detection.interval.is_zero() {
        return fail(
            "outlier_detection.interval".to_owned(),
            "must be above zero".into(),
        );
    }
    if let Some(f) = &c.fallback
        && !(100..=599).contains(&f.status)
    {
        return fail(
            "fallback.status".to_owned(),
            format!("must be 100..=599, got {}", f.status),
        );
    }
    if let Some(f) = &c.fallback
        && http::HeaderValue::from_str(&f.content_type).is_err()
    {
        return fail(
            "fallback.content_type".to_owned(),
            "not a valid header value".into(),
        );
    }
    if c.timeouts.connect.is_zero() || c.timeouts.request.is_zero() {
        return fail(
            "timeouts".to_owned(),
            "connect and request timeouts must be above zero".into(),
        );
    }
    if c.retries.budget_percent > 100 {
        return fail(
            "retries.budget_percent".to_owned(),
            format!("must be 0..=100, got {}", c.retries.budget_percent),
        );
    }
    for (field, v) in [
        ("max_connections", c.circuit_breakers.max_connections),
        ("max_pending", c.circuit_breakers.max_pending),
        ("max_requests", c.circuit_breakers.max_requests),
    ] {
        if v == 0 {
            return fail(
                format!("circuit_breakers.{field}"),
                "must be at least 1".into(),
            );
        }
    }
    let endpoints = c.endpoints_model();
    for (k, e) in endpoints.iter().enumerate() {
        if let Err(e) = e.validate() {
            return fail(format!("endpoints[{k}]"), e.to_string());
        }
    }
    let mut ids = HashSet::new();
    if let Some(dup) = endpoints.iter().find(|e| !ids.insert(&e.id)) {
        return fail(
            "endpoints".to_owned(),
            format!("duplicate endpoint {}", dup.id),
        );
    }
    // The settings alone, without building a balancer (a Maglev table is
    // 65,537 entries by default).
    let routable = meshless_model::routable_endpoints(&endpoints).len();
    c.balance_config()?
        .validate_for(routable)
        .map_err(|e| match e {
            ConfigError::Field { field, reason } => FieldError::new(field, reason),
            other => FieldError::new("", other.to_string()),
        })
}

impl ClusterConfig {
    /// The endpoints as model values; the id of a static endpoint is its address.
    pub fn endpoints_model(&self) -> Vec<Endpoint> {
        self.endpoints
            .iter()
            .map(|e| {
                let mut m = Endpoint::new(e.address.to_string(), e.address).with_weight(e.weight);
                m.zone = e.zone.clone();
                m.node = e.node.clone();
                m
            })
            .collect()
    }

    /// The balancing settings, or the name that is no policy or hash;
    /// their ranges are checked by [`BalanceClusterConfig::validate`].
    pub fn balance_config(&self) -> Result<BalanceClusterConfig, FieldError> {
        let b = &self.balancer;
        let policy = b.policy_kind().at("balancer")?;
        let over = b.over_kind().at("balancer")?;
        let health = self
            .health_check
            .as_ref()
            .map_or_else(HealthConfig::default, |h| HealthConfig {
                rise: h.healthy_threshold,
                fall: h.unhealthy_threshold,
                initially_healthy: true,
            });
        let o = &self.outlier_detection;
        Ok(BalanceClusterConfig {
            balancer: BalancerConfig {
                policy,
                choices: b.choices,
                ring_size: b.ring_size,
                table_size: b.table_size,
                load_factor: b.load_factor,
                over,
            },
            locality: self
                .locality
                .as_ref()
                .filter(|l| l.enabled)
                .map(|l| LocalityConfig {
                    mode: l.mode,
                    min_healthy_share: l.min_healthy_share,
                    min_cluster_size: l.min_cluster_size,
                }),
            outlier: OutlierConfig {
                consecutive_5xx: o.consecutive_5xx,
                consecutive_gateway_errors: o.consecutive_gateway_errors,
                interval: o.interval,
                base_ejection_time: o.base_ejection_time,
                max_ejection_time: o.max_ejection_time,
                max_ejection_percent: o.max_ejection_percent,
            },
            health,
            panic_threshold: if self.panic_mode {
                self.panic_threshold
            } else {
                0
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
listeners:
  - name: web
    address: 127.0.0.1:8080
    routes:
      - match: { path_prefix: /api }
        cluster: api
      - weighted_clusters:
          - { cluster: api, weight: 90 }
          - { cluster: canary, weight: 10 }
clusters:
  - name: api
    endpoints:
      - address: 127.0.0.1:9001
      - { address: "[::1]:9002", weight: 2, zone: z1, node: n1 }
    balancer: { policy: bounded_load, hash_key: { header: x-user }, load_factor: 1.5 }
    health_check: { path: /healthz, interval: 2s }
  - name: canary
    endpoints: [{ address: 127.0.0.1:9003 }]
    balancer: { policy: p2c, hash_key: client_address }
"#;

    fn invalid(text: &str) -> String {
        ProxyConfig::parse(text, "proxy.yaml")
            .expect_err("invalid")
            .to_string()
    }

    #[test]
    fn parses_with_defaults() {
        let c = ProxyConfig::parse(GOOD, "proxy.yaml").expect("valid");
        assert_eq!(c.admin.address.port(), 9901);
        assert_eq!(
            c.clusters[0].balancer.hash_key,
            Some(HashKey::Header("x-user".into()))
        );
        assert_eq!(
            c.clusters[1].balancer.hash_key,
            Some(HashKey::ClientAddress)
        );
        assert_eq!(
            c.clusters[0].health_check.as_ref().map(|h| h.interval),
            Some(Duration::from_secs(2))
        );
        assert_eq!(c.clusters[0].timeouts.connect, Duration::from_secs(1));
        assert_eq!(c.clusters[0].retries.count, 1);
    }

    #[test]
    fn errors_name_file_field_and_reason() {
        let e = invalid(&GOOD.replace("load_factor: 1.5", "load_factor: 0.5"));
        assert!(
            e.starts_with("proxy.yaml: clusters[0].balancer.load_factor: must be"),
            "{e}"
        );
        let e = invalid(&GOOD.replace("policy: p2c", "policy: p3c"));
        assert!(
            e.starts_with("proxy.yaml: clusters[1].balancer.policy:"),
            "{e}"
        );
        let e = invalid(&GOOD.replace("interval: 2s", "interval: 2 parsecs"));
        assert!(e.contains("clusters[0].health_check.interval"), "{e}");
        let e = invalid(&GOOD.replace("cluster: canary", "cluster: nope"));
        assert!(
            e.contains("listeners[0].routes[1].weighted_clusters[1].cluster: unknown cluster"),
            "{e}"
        );
        let e = invalid(&GOOD.replace(
            "hash_key: { header: x-user }",
            "hash_kee: { header: x-user }",
        ));
        assert!(
            e.contains("clusters[0].balancer") && e.contains("hash_kee"),
            "{e}"
        );
        let e = invalid(&GOOD.replace("address: 127.0.0.1:9003", "address: localhost:9003"));
        assert!(e.contains("clusters[1].endpoints[0].address"), "{e}");
        let e = invalid(&GOOD.replace("weight: 2,", "weight: 0,"));
        assert!(
            e.contains("clusters[0].endpoints[1]: endpoint [::1]:9002: weight"),
            "{e}"
        );
        let e = invalid(&GOOD.replace("\"[::1]:9002\"", "127.0.0.1:9001"));
        assert!(e.contains("clusters[0].endpoints: duplicate"), "{e}");
    }
}
