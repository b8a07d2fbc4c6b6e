//! Metrics of the edge filters and TCP flows, registered into the proxy's
//! registry; each gauge raised is lowered by a guard's `Drop`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// A listener and the cluster its flows go to.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FlowLabels {
    pub listener: String,
    pub cluster: String,
}

/// How a flow ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FlowEndLabels {
    pub listener: String,
    pub cluster: String,
    /// `closed`, `error`, `idle_timeout`, `endpoint_drained`,
    /// `listener_drained`, `no_endpoint`.
    pub end: String,
}

/// Bytes of a listener's flows, by direction.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BytesLabels {
    pub listener: String,
    /// `downstream_rx` (from clients) or `downstream_tx` (to clients).
    pub direction: String,
}

/// A cluster's failed connects, by endpoint.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnectLabels {
    pub cluster: String,
    pub endpoint: String,
}

/// A connection refused by a deny rule.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DenyLabels {
    pub listener: String,
    pub rule: String,
    pub action: String,
}

/// A connection refused by the PROXY-protocol check.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProxyProtocolLabels {
    pub listener: String,
    /// `untrusted`, `missing`, `malformed`.
    pub reason: String,
}

/// The edge metrics.
#[derive(Debug, Default)]
pub struct EdgeMetrics {
    pub flows_active: Family<FlowLabels, Gauge>,
    pub flows_ended: Family<FlowEndLabels, Counter>,
    pub flow_bytes: Family<BytesLabels, Counter>,
    pub connect_failures: Family<ConnectLabels, Counter>,
    pub denied: Family<DenyLabels, Counter>,
    pub proxy_protocol_refused: Family<ProxyProtocolLabels, Counter>,
}

impl EdgeMetrics {
    /// Registers every family into `registry` (prefix `meshless_`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "proxy_tcp_flows_active",
            "TCP flows open now",
            self.flows_active.clone(),
        );
        registry.register(
            "proxy_tcp_flows_ended",
            "TCP flows ended, by how",
            self.flows_ended.clone(),
        );
        registry.register(
            "proxy_tcp_bytes",
            "Bytes copied by TCP flows",
            self.flow_bytes.clone(),
        );
        registry.register(
            "proxy_tcp_connect_failures",
            "Connections to an endpoint that failed or timed out",
            self.connect_failures.clone(),
        );
        registry.register(
            "proxy_denied_connections",
            "Connections refused by a deny rule",
            self.denied.clone(),
        );
        registry.register(
            "proxy_proxy_protocol_refused",
            "Connections closed by the PROXY protocol check",
            self.proxy_protocol_refused.clone(),
        );
    }

    /// Counts an open flow until the guard drops.
    pub fn flow_opened(&self, listener: &str, cluster: &str) -> ActiveFlow {
        let g = self
            .flows_active
            .get_or_create(&FlowLabels {
                listener: listener.to_owned(),
                cluster: cluster.to_owned(),
            })
            .clone();
        g.inc();
        ActiveFlow(g)
    }

    /// Counts a flow's end.
    pub fn flow_ended(&self, listener: &str, cluster: &str, end: &str) {
        self.flows_ended
            .get_or_create(&FlowEndLabels {
                listener: listener.to_owned(),
                cluster: cluster.to_owned(),
                end: end.to_owned(),
            })
            .inc();
    }

    /// The byte counter of `listener` in `direction`.
    pub fn bytes(&self, listener: &str, direction: &str) -> Counter {
        self.flow_bytes
            .get_or_create(&BytesLabels {
                listener: listener.to_owned(),
                direction: direction.to_owned(),
            })
            .clone()
    }
}

/// An open flow; lowers the gauge when dropped.
#[derive(Debug)]
pub struct ActiveFlow(Gauge);

impl Drop for ActiveFlow {
    fn drop(&mut self) {
        self.0.dec();
    }
}
