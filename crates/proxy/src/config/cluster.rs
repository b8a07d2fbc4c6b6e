//! `clusters:` groups of endpoints, their validation and the settings the
//! balancer is built from.

use std::collections::HashSet;
use std::net::SocketAddr;

use meshless_balance::{
    BalancerConfig, ClusterConfig as BalanceClusterConfig, ConfigError, HealthConfig,
    LocalityConfig, OutlierConfig,
};
use meshless_model::{AtPath, Endpoint, FieldError};
use serde::{Deserialize, Serialize};

use super::activation::{Activation, Fallback};
use super::balancer::{BalancerYaml, HashKey, LocalityYaml};
use super::pool::{ConnectionPool, UpstreamTls};
use super::upstream::{
    CircuitBreakers, HealthCheck, Http1Client, MAX_RETRIES, OutlierDetection, Retries, Timeouts,
    UpstreamProtocol,
};

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
    /// Follow a deterministic subset of the service's endpoints (with
    /// `service` only; absent: every endpoint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subset: Option<SubsetConfig>,
    /// Algorithm and affinity key.
    #[serde(default)]
    pub balancer: BalancerYaml,
    /// Prefer this proxy's node, then zone.
    #[serde(default)]
    pub locality: Option<LocalityYaml>,
    /// Protocol to the endpoints.
    #[serde(default)]
    pub upstream_protocol: UpstreamProtocol,
    /// The HTTP/1.1 client to the endpoints: `hyper` (default) or `meshless`.
    #[serde(default)]
    pub http1: Http1Client,
    /// Timeouts.
    #[serde(default)]
    pub timeouts: Timeouts,
    /// Idle connections kept and connections opened ahead of demand.
    #[serde(default)]
    pub connection_pool: ConnectionPool,
    /// TLS to the endpoints; absent = cleartext.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<UpstreamTls>,
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
    /// Send a PROXY protocol header first on every connection (clusters of
    /// `tcp` listeners only; Envoy's `proxy_protocol` upstream transport
    /// socket, HAProxy's `send-proxy-v2`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_protocol: Option<crate::proxy_protocol::ProxyProtocolVersion>,
    /// Options of connections to the endpoints (flows of `tcp` listeners).
    #[serde(default)]
    pub socket: crate::sockopt::SocketOptions,
}

fn default_panic_threshold() -> u8 {
    meshless_balance::DEFAULT_PANIC_THRESHOLD
}

fn default_panic_mode() -> bool {
    true
}

/// `subset:` of a `service:` cluster: the control plane streams this proxy
/// `size` of the service's endpoints (deterministic subsetting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubsetConfig {
    /// Endpoints in the subset, 1..=[`MAX_SUBSET_SIZE`].
    pub size: u32,
    /// Prefer endpoints in this proxy's zone (`node.zone`): the subset is
    /// taken from the zone's endpoints when it holds at least `size`, else
    /// it is all of them plus the rest from other zones. Off by default;
    /// without a zone the subset is an ordinary one.
    #[serde(default)]
    pub zone_aware: bool,
}

/// The largest `subset.size` accepted.
pub const MAX_SUBSET_SIZE: u32 = 100_000;

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

/// Checks one cluster; the error's path is relative to the cluster.
pub(super) fn validate_cluster(c: &ClusterConfig, control: bool) -> Result<(), FieldError> {
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
    if let Some(subset) = &c.subset {
        if c.service.is_none() {
            return fail(
                "subset".to_owned(),
                "needs `service` (static endpoints are never subset)".into(),
            );
        }
        if !(1..=MAX_SUBSET_SIZE).contains(&subset.size) {
            return fail(
                "subset.size".to_owned(),
                format!("must be 1..={MAX_SUBSET_SIZE}, got {}", subset.size),
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
        if !hc.path().starts_with('/') {
            return fail(
                "health_check.path".to_owned(),
                format!("must start with '/', got {:?}", hc.path()),
            );
        }
        // One kind of check: `tcp`, `grpc` or an HTTP `path`.
        if hc.tcp && hc.grpc.is_some() {
            return fail(
                "health_check.grpc".to_owned(),
                "a check is `tcp: true` or `grpc`, not both".into(),
            );
        }
        if (hc.tcp || hc.grpc.is_some()) && hc.path.is_some() {
            let kind = if hc.tcp { "`tcp: true`" } else { "`grpc`" };
            return fail(
                "health_check.path".to_owned(),
                format!("an HTTP check's path; a {kind} check has none"),
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
        for (field, d) in [("interval", hc.interval), ("timeout", hc.timeout)] {
            if d.is_zero() {
                return fail(format!("health_check.{field}"), "must be above zero".into());
            }
        }
    }
    if let Some(a) = &c.activation {
        a.validate().at("activation")?;
    }
    if c.outlier_detection.interval.is_zero() {
        return fail(
            "outlier_detection.interval".to_owned(),
            "must be above zero".into(),
        );
    }
    if let Some(f) = &c.fallback {
        // A final answer: 1xx are interim (a client waits on past them).
        if !(200..=599).contains(&f.status) {
            return fail(
                "fallback.status".to_owned(),
                format!("must be 200..=599, got {}", f.status),
            );
        }
        if matches!(f.status, 204 | 304) && !f.body.is_empty() {
            return fail(
                "fallback.body".to_owned(),
                format!("status {} has no body; remove `body`", f.status),
            );
        }
    }
    if let Some(f) = &c.fallback
        && http::HeaderValue::from_str(&f.content_type).is_err()
    {
        return fail(
            "fallback.content_type".to_owned(),
            "not a valid header value".into(),
        );
    }
    for (field, d) in [
        ("connect", c.timeouts.connect),
        ("request", c.timeouts.request),
    ] {
        if d.is_zero() {
            return fail(format!("timeouts.{field}"), "must be above zero".into());
        }
    }
    c.connection_pool.validate().at("connection_pool")?;
    if let Some(tls) = &c.tls {
        tls.validate().at("tls")?;
    }
    if c.retries.count > MAX_RETRIES {
        return fail(
            "retries.count".to_owned(),
            format!("must be 0..={MAX_RETRIES}, got {}", c.retries.count),
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
        let health = self.health_check.as_ref().map_or_else(
            || HealthConfig {
                active: false,
                ..HealthConfig::default()
            },
            |h| HealthConfig {
                rise: h.healthy_threshold,
                fall: h.unhealthy_threshold,
                initially_healthy: true,
                active: true,
            },
        );
        let o = &self.outlier_detection;
        Ok(BalanceClusterConfig {
            balancer: BalancerConfig {
                policy,
                choices: b.choices,
                ring_size: b.ring_size,
                table_size: b.table_size,
                max_table_size: b.max_table_size,
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
