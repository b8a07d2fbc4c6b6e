//! Prometheus metrics of the proxy, in one explicit registry (no globals).

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

pub use crate::endpoint_labels::{EndpointLabels, RequestLabels};

/// Labels of a request duration.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub listener: Arc<str>,
    pub cluster: Arc<str>,
}

/// Labels naming one cluster.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClusterLabels {
    pub cluster: String,
}

/// Labels of a shed request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OverflowLabels {
    pub cluster: String,
    /// `max_requests`, `max_pending`, `max_connections` or `retry_budget`.
    pub limit: String,
}

/// Labels of a reload.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    /// `success` or `failure`.
    pub result: String,
}

/// Labels of a response the proxy made itself.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LocalReplyLabels {
    pub listener: String,
    /// `no_route`, `no_endpoint`, `connect_failed`, `reset`, `timeout`, `overflow`.
    pub reason: String,
}

/// Labels of an activation phase, measured from the moment a request was held.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// `announced` (an instance appeared), `probe_success`, `ready` (the
    /// request can be sent), `response` (its response headers arrived).
    pub phase: &'static str,
}

/// Labels of an activation's end.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActivationLabels {
    /// `sent`, `queue_full`, `start_failed`, `timeout`, `forwarded`,
    /// `peer_unreachable`, `reconnected`.
    pub result: &'static str,
}

/// Labels naming one listener.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabels {
    pub listener: String,
}

/// Labels of a TLS handshake.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandshakeLabels {
    pub listener: String,
    /// `full`, `resumed`, `failed` or `timeout`.
    pub result: &'static str,
}

/// An open downstream connection; lowers the gauge when dropped.
#[derive(Debug)]
pub struct OpenConnection(Gauge);

impl OpenConnection {
    /// Counts an open connection in `gauge` until the guard drops.
    pub fn new(gauge: &Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Every metric the proxy exports.
#[derive(Debug)]
pub struct Metrics {
    pub registry: Registry,
    /// Spans exported, dropped (queue full) and failed (`tracing:`).
    pub trace: meshless_trace::TraceCounters,
    pub requests: Family<RequestLabels, Counter>,
    pub request_duration: Family<RouteLabels, Histogram>,
    pub local_replies: Family<LocalReplyLabels, Counter>,
    pub retries: Family<ClusterLabels, Counter>,
    pub overflows: Family<OverflowLabels, Counter>,
    pub upstream_connections: Family<ClusterLabels, Gauge>,
    pub upstream_idle_connections: Family<ClusterLabels, Gauge>,
    /// 1 while the cluster is in panic mode (set at each scrape).
    pub cluster_panic: Family<ClusterLabels, Gauge>,
    pub endpoint_in_flight: Family<EndpointLabels, Gauge>,
    pub endpoint_healthy: Family<EndpointLabels, Gauge>,
    pub endpoint_ejected: Family<EndpointLabels, Gauge>,
    pub health_checks: Family<EndpointLabels, Counter>,
    pub health_check_failures: Family<EndpointLabels, Counter>,
    pub reloads: Family<ReloadLabels, Counter>,
    pub activation_phase: Family<PhaseLabels, Histogram>,
    pub activations: Family<ActivationLabels, Counter>,
    /// 1 while a stream to the control plane is open, else 0.
    pub control_connected: Gauge,
    /// Streams to the control plane that ended in an error (unreachable,
    /// refused, cut).
    pub control_stream_failures: Counter,
    pub downstream_connections: Family<ListenerLabels, Gauge>,
    pub connections_at_limit: Family<ListenerLabels, Counter>,
    /// HTTP/1 connections closed because their client took no byte for
    /// `timeouts.send`.
    pub send_timeouts: Family<ListenerLabels, Counter>,
    pub upgrades_refused: Family<ListenerLabels, Counter>,
    /// Read buffers lent to HTTP/1 connections (`http1: meshless`).
    pub http1_buffers_lent: Family<ListenerLabels, Gauge>,
    pub access_log_dropped: Counter,
    /// Deny rules, PROXY protocol and TCP flows.
    pub edge: crate::edge_metrics::EdgeMetrics,
    pub tls_handshakes: Family<HandshakeLabels, Counter>,
    /// Every series labelled by endpoint is made through this table, and
    /// removed when its endpoint is gone ([`crate::endpoint_series`]).
    pub endpoint_series: crate::endpoint_series::SeriesTable,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// All metrics, registered under the `meshless` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("meshless");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "proxy_requests",
            "Requests finished, by listener, cluster, endpoint and status class",
            requests.clone(),
        );
        let request_duration = Family::<RouteLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0005, 2.0, 16))
        });
        registry.register(
            "proxy_request_duration_seconds",
            "Time from request received to response body end",
            request_duration.clone(),
        );
        let local_replies = Family::<LocalReplyLabels, Counter>::default();
        registry.register(
            "proxy_local_replies",
            "Responses the proxy generated itself, by reason",
            local_replies.clone(),
        );
        let retries = Family::<ClusterLabels, Counter>::default();
        registry.register("proxy_retries", "Retry attempts", retries.clone());
        let overflows = Family::<OverflowLabels, Counter>::default();
        registry.register(
            "proxy_overflows",
            "Requests shed by a circuit breaker or the retry budget",
            overflows.clone(),
        );
        let upstream_connections = Family::<ClusterLabels, Gauge>::default();
        registry.register(
            "proxy_upstream_connections",
            "Open upstream connections",
            upstream_connections.clone(),
        );
        let upstream_idle_connections = Family::<ClusterLabels, Gauge>::default();
        registry.register(
            "proxy_upstream_idle_connections",
            "Idle upstream HTTP/1.1 connections kept for reuse",
            upstream_idle_connections.clone(),
        );
        let cluster_panic = Family::<ClusterLabels, Gauge>::default();
        registry.register(
            "proxy_cluster_panic",
            "1 while fewer than panic_threshold percent of the cluster's endpoints are available and picks spread over all of them",
            cluster_panic.clone(),
        );
        let endpoint_in_flight = Family::<EndpointLabels, Gauge>::default();
        registry.register(
            "proxy_endpoint_in_flight",
            "Requests in flight per endpoint",
            endpoint_in_flight.clone(),
        );
        let endpoint_healthy = Family::<EndpointLabels, Gauge>::default();
        registry.register(
            "proxy_endpoint_healthy",
            "1 when the endpoint passes active health checks",
            endpoint_healthy.clone(),
        );
        let endpoint_ejected = Family::<EndpointLabels, Gauge>::default();
        registry.register(
            "proxy_endpoint_ejected",
            "1 while outlier detection ejects the endpoint",
            endpoint_ejected.clone(),
        );
        let health_checks = Family::<EndpointLabels, Counter>::default();
        registry.register(
            "proxy_health_checks",
            "Active health checks run",
            health_checks.clone(),
        );
        let health_check_failures = Family::<EndpointLabels, Counter>::default();
        registry.register(
            "proxy_health_check_failures",
            "Active health checks failed",
            health_check_failures.clone(),
        );
        let reloads = Family::<ReloadLabels, Counter>::default();
        registry.register(
            "proxy_reloads",
            "Configuration reloads, by result",
            reloads.clone(),
        );
        let activation_phase = Family::<PhaseLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 16))
        });
        registry.register(
            "proxy_activation_phase_seconds",
            "Cold start: time from a request being held to each phase",
            activation_phase.clone(),
        );
        let activations = Family::<ActivationLabels, Counter>::default();
        registry.register(
            "proxy_activations",
            "Held requests, by how they ended",
            activations.clone(),
        );
        let control_connected = Gauge::default();
        registry.register(
            "proxy_control_connected",
            "1 while a stream to the control plane is open",
            control_connected.clone(),
        );
        let control_stream_failures = Counter::default();
        registry.register(
            "proxy_control_stream_failures",
            "Streams to the control plane that ended in an error",
            control_stream_failures.clone(),
        );
        let downstream_connections = Family::<ListenerLabels, Gauge>::default();
        registry.register(
            "proxy_downstream_connections",
            "Open downstream connections, by listener",
            downstream_connections.clone(),
        );
        let connections_at_limit = Family::<ListenerLabels, Counter>::default();
        registry.register(
            "proxy_downstream_connections_at_limit",
            "Times a listener reached max_connections and left new connections in the backlog",
            connections_at_limit.clone(),
        );
        let send_timeouts = Family::<ListenerLabels, Counter>::default();
        registry.register(
            "proxy_downstream_send_timeouts",
            "HTTP/1 connections closed because their client took no byte of what was written to it for timeouts.send",
            send_timeouts.clone(),
        );
        let http1_buffers_lent = Family::<ListenerLabels, Gauge>::default();
        registry.register(
            "proxy_http1_buffers_lent",
            "Read buffers downstream connections hold now: `http1: meshless` ones while bytes are pending (idle ones hold none), every plain-text connection for its first read",
            http1_buffers_lent.clone(),
        );
        let upgrades_refused = Family::<ListenerLabels, Counter>::default();
        registry.register(
            "proxy_upgrades_refused",
            "Upgrade requests whose protocol the route does not allow (forwarded without Upgrade)",
            upgrades_refused.clone(),
        );
        let access_log_dropped = Counter::default();
        registry.register(
            "proxy_access_log_dropped",
            "Access-log lines dropped because the writer fell behind",
            access_log_dropped.clone(),
        );
        let tls_handshakes = Family::<HandshakeLabels, Counter>::default();
        registry.register(
            "proxy_tls_handshakes",
            "Downstream TLS handshakes, by listener and result (full, resumed, failed, timeout)",
            tls_handshakes.clone(),
        );
        let edge = crate::edge_metrics::EdgeMetrics::default();
        edge.register(&mut registry);
        let trace = meshless_trace::TraceCounters::default();
        registry.register(
            "proxy_trace_spans_exported",
            "Spans exported over OTLP",
            trace.exported.clone(),
        );
        registry.register(
            "proxy_trace_spans_dropped",
            "Spans dropped because the export queue was full",
            trace.dropped.clone(),
        );
        registry.register(
            "proxy_trace_spans_failed",
            "Spans in export requests that failed",
            trace.failed.clone(),
        );
        let endpoint_series =
            crate::endpoint_series::SeriesTable::new(crate::endpoint_series::EndpointFamilies {
                requests: requests.clone(),
                health_checks: health_checks.clone(),
                health_check_failures: health_check_failures.clone(),
                connect_failures: edge.connect_failures.clone(),
            });
        Self {
            registry,
            endpoint_series,
            edge,
            tls_handshakes,
            trace,
            downstream_connections,
            connections_at_limit,
            send_timeouts,
            upgrades_refused,
            http1_buffers_lent,
            access_log_dropped,
            requests,
            activation_phase,
            activations,
            control_connected,
            control_stream_failures,
            request_duration,
            local_replies,
            retries,
            overflows,
            upstream_connections,
            upstream_idle_connections,
            cluster_panic,
            endpoint_in_flight,
            endpoint_healthy,
            endpoint_ejected,
            health_checks,
            health_check_failures,
            reloads,
        }
    }

    /// Counts a locally generated reply.
    pub fn local_reply(&self, listener: &str, reason: &str) {
        self.local_replies
            .get_or_create(&LocalReplyLabels {
                listener: listener.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    fn listener(name: &str) -> ListenerLabels {
        ListenerLabels {
            listener: name.to_owned(),
        }
    }

    /// The gauge of `listener`'s open downstream connections (raised by
    /// [`OpenConnection::new`]).
    pub fn downstream_connections(&self, listener: &str) -> Gauge {
        self.downstream_connections
            .get_or_create(&Self::listener(listener))
            .clone()
    }

    /// The gauge of read buffers lent to `listener`'s HTTP/1 connections.
    pub fn http1_buffers(&self, listener: &str) -> Gauge {
        self.http1_buffers_lent
            .get_or_create(&Self::listener(listener))
            .clone()
    }

    /// Counts a listener pausing at `max_connections`.
    pub fn connections_at_limit(&self, listener: &str) {
        self.connections_at_limit
            .get_or_create(&Self::listener(listener))
            .inc();
    }

    /// Counts an HTTP/1 connection closed at `timeouts.send`.
    pub fn send_timeout(&self, listener: &str) {
        self.send_timeouts
            .get_or_create(&Self::listener(listener))
            .inc();
    }

    /// Counts an upgrade forwarded without its `Upgrade` header.
    pub fn upgrade_refused(&self, listener: &str) {
        self.upgrades_refused
            .get_or_create(&Self::listener(listener))
            .inc();
    }

    /// Counts a TLS handshake that ended with `result`.
    pub fn tls_handshake(&self, listener: &str, result: &'static str) {
        self.tls_handshakes
            .get_or_create(&HandshakeLabels {
                listener: listener.to_owned(),
                result,
            })
            .inc();
    }

    /// The registry in Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
