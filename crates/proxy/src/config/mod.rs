//! The proxy's YAML configuration: every field, its default, and the
//! validation that rejects a bad file with the file, the field path and the
//! reason. Documented field by field in `docs/config.md`.

mod activation;
mod balancer;
mod cluster;
mod control;
mod listener;
mod pool;
mod route;
mod service_settings;
mod upstream;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use meshless_balance::LocalityMode;
use meshless_model::{AtPath, FieldError};
use serde::{Deserialize, Serialize};

use meshless_model::serde_duration as duration;

pub use crate::protocol::{FlowKey, ListenerProtocol, TcpProxy};
pub use activation::{Activation, Fallback};
pub use balancer::{BalancerYaml, HashKey, LocalityYaml};
pub use cluster::{ClusterConfig, EndpointConfig, SubsetConfig};
pub use control::ControlLink;
pub use listener::ListenerConfig;
pub use pool::{ConnectionPool, UpstreamTls};
pub use route::{HeaderMatch, MatchConfig, RouteConfig, WeightedCluster};
pub use upstream::{
    CircuitBreakers, GrpcHealthCheck, HealthCheck, Http1Client, MAX_RETRIES, OutlierDetection,
    Retries, RetryOn, Timeouts, UpstreamProtocol,
};

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
    /// Spans exported over OTLP/HTTP (off when absent). Read at start;
    /// a reload does not change it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracing: Option<meshless_trace::TracingConfig>,
}

/// The longest `drain_timeout` and `drain_delay`.
const MAX_DRAIN: Duration = Duration::from_secs(3600);

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

/// This proxy's place in the cluster. In a pod, the downward API sets
/// `MESHLESS_NODE_NAME` (and the DaemonSet `MESHLESS_ZONE`): a name or
/// zone the file leaves out is read from the variable `name_env` /
/// `zone_env` names, these by default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Node name, matched against endpoint `node`.
    #[serde(default)]
    pub name: Option<String>,
    /// Zone, matched against endpoint `zone`.
    #[serde(default)]
    pub zone: Option<String>,
    /// Environment variable holding the node name when `name` is absent.
    #[serde(default = "default_name_env")]
    pub name_env: String,
    /// Environment variable holding the zone when `zone` is absent.
    #[serde(default = "default_zone_env")]
    pub zone_env: String,
}

fn default_name_env() -> String {
    "MESHLESS_NODE_NAME".into()
}
fn default_zone_env() -> String {
    "MESHLESS_ZONE".into()
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            name: None,
            zone: None,
            name_env: default_name_env(),
            zone_env: default_zone_env(),
        }
    }
}

impl NodeConfig {
    /// Fills an absent name or zone from `env` (non-empty values only).
    pub fn resolve(&mut self, env: impl Fn(&str) -> Option<String>) {
        let read = |var: &str| env(var).filter(|v| !v.is_empty());
        if self.name.is_none() {
            self.name = read(&self.name_env);
        }
        if self.zone.is_none() {
            self.zone = read(&self.zone_env);
        }
    }
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
    /// The node's name and zone the file leaves out come from the process
    /// environment ([`NodeConfig::resolve`]).
    pub fn parse(text: &str, file: &str) -> Result<Self, ConfigFileError> {
        let mut config: ProxyConfig =
            meshless_model::yaml::from_str(text).map_err(|FieldError { path, reason }| {
                ConfigFileError::Invalid {
                    file: file.to_owned(),
                    path,
                    reason,
                }
            })?;
        config.node.resolve(|var| std::env::var(var).ok());
        config
            .validate()
            .map_err(|FieldError { path, reason }| ConfigFileError::Invalid {
                file: file.to_owned(),
                path,
                reason,
            })?;
        Ok(config)
    }

    /// Every certificate and key file the listeners' `tls` blocks name,
    /// then the CA file of every cluster's `tls` (what `--watch` watches
    /// besides the config file: a reload such a file failed is retried
    /// once it changes).
    pub fn tls_files(&self) -> Vec<std::path::PathBuf> {
        let mut files = Vec::new();
        for tls in self.listeners.iter().filter_map(|l| l.tls.as_ref()) {
            let d = &tls.default_certificate;
            files.extend([d.certificate.clone(), d.key.clone()]);
            for c in &tls.certificates {
                files.extend([c.certificate.clone(), c.key.clone()]);
            }
        }
        for tls in self.clusters.iter().filter_map(|c| c.tls.as_ref()) {
            files.push(tls.ca_file.clone());
        }
        files
    }

    /// Checks what the types alone cannot: names, references, ranges.
    pub fn validate(&self) -> Result<(), FieldError> {
        let err = |path: String, reason: &str| Err(FieldError::new(path, reason));
        // A shutdown must end: a second signal cuts it, but a supervisor
        // sends one signal and waits.
        for (field, value) in [
            ("drain_timeout", self.drain_timeout),
            ("drain_delay", self.drain_delay),
        ] {
            if value > MAX_DRAIN {
                return err(field.into(), "must be at most 1h");
            }
        }
        if let Some(Err((field, reason))) = self.tracing.as_ref().map(|t| t.check()) {
            return err(format!("tracing.{field}"), &reason);
        }
        let mut names = HashSet::new();
        let mut addresses = std::collections::HashMap::new();
        if self.admin.address.port() != 0
            && self
                .listeners
                .iter()
                .any(|l| l.address == self.admin.address)
        {
            return err("admin.address".into(), "is also a listener's address");
        }
        let clusters: HashSet<&str> = self.clusters.iter().map(|c| c.name.as_str()).collect();
        let congestion = self
            .wants_congestion_control()
            .then(crate::sockopt::available_congestion_control)
            .flatten();
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
            // Port 0 never collides; SO_REUSEPORT listeners may share an address.
            let shared = l.socket.reuse_port;
            let clash = l.address.port() != 0
                && addresses
                    .insert(l.address, shared)
                    .is_some_and(|before| !(before && shared));
            if clash {
                return err(
                    format!("{at}.address"),
                    &format!(
                        "{} is used by another listener (listeners sharing one need socket.reuse_port)",
                        l.address
                    ),
                );
            }
            listener::validate_listener(l, &clusters, congestion.as_deref()).at(&at)?;
            crate::limits::validate(l.max_connections, &l.limits, &l.timeouts).at(&at)?;
            l.http2.validate().at(format!("{at}.http2"))?;
            if let Some(tls) = &l.tls {
                tls.validate().at(format!("{at}.tls"))?;
            }
            for (j, r) in l.routes.iter().enumerate() {
                let route = format!("{at}.routes[{j}]");
                route::validate_route(r, &clusters).at(&route)?;
                crate::limits::validate_upgrades(&r.upgrades).at(&route)?;
            }
        }
        if let Some(link) = &self.control {
            link.validate_peer(&self.listeners)?;
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
            cluster::validate_cluster(c, self.control.is_some()).at(&at)?;
            c.socket
                .validate(false, congestion.as_deref())
                .at(format!("{at}.socket"))?;
            if c.proxy_protocol.is_some() && self.http_clusters().contains(c.name.as_str()) {
                return err(
                    format!("{at}.proxy_protocol"),
                    "only for clusters of `protocol: tcp` listeners (HTTP routes use this cluster)",
                );
            }
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

impl ProxyConfig {
    /// Whether some listener or cluster sets `socket.congestion_control`.
    fn wants_congestion_control(&self) -> bool {
        self.listeners
            .iter()
            .map(|l| &l.socket)
            .chain(self.clusters.iter().map(|c| &c.socket))
            .any(|s| s.congestion_control.is_some())
    }

    /// Clusters HTTP listeners send requests to (routes, splits, default).
    fn http_clusters(&self) -> HashSet<&str> {
        let mut out = HashSet::new();
        for l in &self.listeners {
            out.extend(l.default_cluster.as_deref());
            for r in &l.routes {
                out.extend(r.cluster.as_deref());
                for w in r.weighted_clusters.iter().flatten() {
                    out.insert(w.cluster.as_str());
                }
            }
        }
        out
    }
}

/// A config of one listener `web` routing everything to one cluster `c`
/// of one endpoint (for unit tests).
#[cfg(test)]
pub(crate) const ONE_LISTENER_YAML: &str = "listeners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{ cluster: c }]\nclusters:\n  - name: c\n    endpoints: [{ address: \"127.0.0.1:1\" }]\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_name_and_zone_come_from_the_environment_when_the_file_leaves_them_out() {
        let env = |var: &str| match var {
            "MESHLESS_NODE_NAME" => Some("node-7".to_owned()),
            "MESHLESS_ZONE" => Some(String::new()),
            "MY_ZONE" => Some("zone-b".to_owned()),
            _ => None,
        };
        let mut n = NodeConfig::default();
        n.resolve(env);
        assert_eq!(
            (n.name.as_deref(), n.zone.as_deref()),
            (Some("node-7"), None),
            "empty is absent"
        );
        let mut n = NodeConfig {
            name: Some("from-file".into()),
            zone_env: "MY_ZONE".into(),
            ..NodeConfig::default()
        };
        n.resolve(env);
        assert_eq!(
            (n.name.as_deref(), n.zone.as_deref()),
            (Some("from-file"), Some("zone-b"))
        );
    }

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
    fn a_peer_listener_must_be_a_plain_http_listener_other_proxies_can_dial() {
        let with =
            |control: &str| format!("control: {{ address: \"127.0.0.1:9401\"{control} }}\n{GOOD}");
        let ok = ProxyConfig::parse(&with(", peer_listener: web"), "proxy.yaml").expect("valid");
        assert_eq!(ok.control.and_then(|c| c.peer_listener), Some("web".into()));
        let e = invalid(&with(", peer_listener: nope"));
        assert!(
            e.contains("control.peer_listener: no listener named"),
            "{e}"
        );
        let e = invalid(&with(", peer_address: \"10.0.0.1:80\""));
        assert!(
            e.contains("control.peer_address: needs control.peer_listener"),
            "{e}"
        );
        let any = with(", peer_listener: web").replace("127.0.0.1:8080", "0.0.0.0:8080");
        let e = invalid(&any);
        assert!(e.contains("control.peer_address: required"), "{e}");
        let named = any.replace(
            "peer_listener: web",
            "peer_listener: web, peer_address: \"10.0.0.1:8080\"",
        );
        ProxyConfig::parse(&named, "proxy.yaml").expect("an address to announce");
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
    fn activation_settings_that_hold_nothing_or_probe_without_a_pause_are_refused() {
        let with = |activation: &str| {
            format!(
                "control: {{ address: \"127.0.0.1:9401\" }}\nlisteners:\n  - name: web\n    address: 127.0.0.1:8080\n    routes: [{{ cluster: hello }}]\nclusters:\n  - name: hello\n    service: demo/hello\n    activation: {{ {activation} }}\n"
            )
        };
        ProxyConfig::parse(&with("probe_interval: 200us"), "proxy.yaml").expect("valid");
        for (field, bad) in [
            ("probe_interval", "probe_interval: 0s"),
            ("probe_interval", "probe_interval: 100us"),
            ("queue_timeout", "queue_timeout: 0s"),
            ("max_queued", "max_queued: 0"),
        ] {
            let e = invalid(&with(bad));
            assert!(
                e.contains(&format!("clusters[0].activation.{field}: must be")),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn a_retry_count_above_the_bound_is_refused_with_its_field() {
        let with = |count: &str| {
            GOOD.replace(
                "health_check: { path: /healthz, interval: 2s }",
                &format!("retries: {{ count: {count} }}"),
            )
        };
        let ok = ProxyConfig::parse(&with("10"), "proxy.yaml").expect("10 retries");
        assert_eq!(ok.clusters[0].retries.count, MAX_RETRIES);
        for bad in ["11", "4294967295"] {
            let e = invalid(&with(bad));
            assert!(
                e.contains("clusters[0].retries.count: must be 0..=10"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn durations_that_would_overflow_a_deadline_are_refused_with_their_field() {
        const H: &str = "18446744073709551615s";
        for (edit, field) in [
            (
                ("interval: 2s", format!("interval: {H}")),
                "clusters[0].health_check.interval",
            ),
            (
                (
                    "interval: 2s",
                    format!("interval: 2s, interval_jitter: {H}"),
                ),
                "clusters[0].health_check.interval_jitter",
            ),
            (
                (
                    "balancer: { policy: p2c,",
                    format!("timeouts: {{ idle: {H} }}\n    balancer: {{ policy: p2c,"),
                ),
                "clusters[1].timeouts.idle",
            ),
            (
                (
                    "    routes:\n",
                    format!("    timeouts: {{ request_headers: {H} }}\n    routes:\n"),
                ),
                "listeners[0].timeouts.request_headers",
            ),
            (
                (
                    "listeners:\n",
                    "drain_timeout: 1000000d\nlisteners:\n".to_owned(),
                ),
                "drain_timeout",
            ),
            (
                (
                    "balancer: { policy: p2c,",
                    "outlier_detection: { base_ejection_time: 366d }\n    balancer: { policy: p2c,"
                        .to_owned(),
                ),
                "clusters[1].outlier_detection.base_ejection_time",
            ),
        ] {
            let text = GOOD.replacen(edit.0, &edit.1, 1);
            assert_ne!(text, GOOD, "{field}");
            let e = invalid(&text);
            assert!(
                e.contains(&format!("{field}: ")) && e.contains("must be at most 365d"),
                "{field}: {e}"
            );
        }
    }

    /// E2, E8: each refusal names the field at fault; contradictory check
    /// kinds and answers a client cannot take are refused.
    #[test]
    fn refusals_name_the_exact_field() {
        let hc = "health_check: { path: /healthz, interval: 2s }";
        for (edit, field) in [
            (
                (hc, "health_check: { path: /h, timeout: 0s }"),
                "clusters[0].health_check.timeout: must be above zero",
            ),
            (
                (hc, "health_check: { interval: 0s }"),
                "clusters[0].health_check.interval: must be above zero",
            ),
            (
                (hc, "health_check: { path: /h, tcp: true }"),
                "clusters[0].health_check.path: an HTTP check's path",
            ),
            (
                (hc, "health_check: { path: /h, grpc: { service: \"\" } }"),
                "clusters[0].health_check.path: an HTTP check's path",
            ),
            (
                (hc, "health_check: { tcp: true, grpc: { service: \"\" } }"),
                "clusters[0].health_check.grpc: a check is",
            ),
            (
                (hc, "timeouts: { connect: 0s }"),
                "clusters[0].timeouts.connect: must be above zero",
            ),
            (
                (hc, "timeouts: { request: 0s }"),
                "clusters[0].timeouts.request: must be above zero",
            ),
            (
                (hc, "fallback: { status: 100 }"),
                "clusters[0].fallback.status: must be 200..=599, got 100",
            ),
            (
                (hc, "fallback: { status: 101 }"),
                "clusters[0].fallback.status: must be 200..=599, got 101",
            ),
            (
                (hc, "fallback: { status: 204, body: hi }"),
                "clusters[0].fallback.body: status 204 has no body",
            ),
            (
                (hc, "fallback: { status: 304, body: hi }"),
                "clusters[0].fallback.body: status 304 has no body",
            ),
            (
                ("    routes:\n", "    timeouts: { idle: 0s }\n    routes:\n"),
                "listeners[0].timeouts.idle: must be above zero",
            ),
            (
                (
                    "    routes:\n",
                    "    limits: { max_uri_bytes: 10 }\n    routes:\n",
                ),
                "listeners[0].limits.max_uri_bytes: must be at least 256, got 10",
            ),
        ] {
            let text = GOOD.replacen(edit.0, edit.1, 1);
            assert_ne!(text, GOOD, "{field}");
            let e = invalid(&text);
            assert!(e.contains(field), "want {field:?}, got {e}");
        }
        for ok in [
            "health_check: { tcp: true }",
            "health_check: { grpc: { service: x } }",
            "fallback: { status: 204 }",
            "fallback: { status: 200, body: hi }",
        ] {
            ProxyConfig::parse(&GOOD.replacen(hc, ok, 1), "proxy.yaml").expect(ok);
        }
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
        let e = invalid(&GOOD.replace("policy: p2c,", "policy: bounded_load, over: nope,"));
        assert!(
            e.contains("clusters[1].balancer.over: expected maglev or ring_hash, got \"nope\""),
            "{e}"
        );
        let e = invalid(&GOOD.replace("policy: p2c,", "policy: maglev, table_size: 4,"));
        assert!(
            e.contains("clusters[1].balancer.table_size: must be prime, got 4"),
            "{e}"
        );
        let e = invalid(&GOOD.replace(
            "balancer: { policy: p2c,",
            "subset: { size: 3 }\n    balancer: { policy: p2c,",
        ));
        assert!(e.contains("clusters[1].subset: needs `service`"), "{e}");
        let e = invalid(&GOOD.replace("cluster: api\n", "\n"));
        assert!(
            e.contains("listeners[0].routes[0]: exactly one of `cluster` or `weighted_clusters`"),
            "{e}"
        );
    }
}
