//! Prometheus metrics of the control plane.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::kubernetes::KubernetesMetrics;
use crate::notify::NotifyCounters;

/// How an instance was seen ready: `notify` (`READY=1` on its
/// notification socket) or `probe` (its port accepted a connection).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReadyLabels {
    pub via: &'static str,
}

/// Every control-plane metric.
#[derive(Debug)]
pub struct ControlMetrics {
    pub registry: Registry,
    pub subscribers: Gauge,
    /// Subsetted subscriptions held (one per stream and subsetted service).
    pub subset_subscriptions: Gauge,
    pub deltas: Counter,
    pub bytes_sent: Counter,
    pub messages_sent: Counter,
    /// Batches handed to subscribers' streams (one write each, at most).
    pub stream_writes: Counter,
    pub coalesced: Counter,
    pub snapshots: Counter,
    pub propagation: Histogram,
    pub writes: Counter,
    pub rejected_writes: Counter,
    pub slice_writes: Counter,
    pub commit_groups: Counter,
    pub renewals: Counter,
    /// API calls that found the registry locked (a commit in progress)
    /// and waited for it on the blocking pool, not on an executor thread.
    pub registry_waits_offloaded: Counter,
    /// 1 while the data store refuses writes (the last commit failed, or
    /// memory waits for the store to read again), else 0.
    pub store_failing: Gauge,
    /// Commits the data store refused.
    pub store_write_failures: Counter,
    pub expired: Counter,
    pub instance_start: Histogram,
    pub instance_start_failures: Counter,
    /// Scaler webhook calls that failed: refused, unreachable or timed out.
    pub webhook_failures: Counter,
    pub activation_to_spawn: Histogram,
    /// `Activate` messages received from proxies.
    pub activation_requests: Counter,
    /// Instances seen ready, by how.
    pub instances_ready: Family<ReadyLabels, Counter>,
    /// Datagrams of the instances' notification sockets.
    pub notify: NotifyCounters,
    /// The Kubernetes source (`meshless-kubernetes`).
    pub kubernetes: KubernetesMetrics,
}

impl Default for ControlMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ControlMetrics {
    /// After a commit: `refused` when the store refused it, `broken` when
    /// memory waits for the store to read again.
    pub fn record_store(&self, refused: bool, broken: bool) {
        if refused {
            self.store_write_failures.inc();
        }
        self.store_failing.set(i64::from(refused || broken));
    }

    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("meshless_control");
        let subscribers = Gauge::default();
        registry.register(
            "subscribers",
            "Proxies connected to the distribution stream",
            subscribers.clone(),
        );
        let subset_subscriptions = Gauge::default();
        registry.register(
            "subset_subscriptions",
            "Subsetted subscriptions held (one per stream and subsetted service)",
            subset_subscriptions.clone(),
        );
        let stream_writes = Counter::default();
        registry.register(
            "stream_writes",
            "Batches of messages handed to subscribers' streams (each written in one go)",
            stream_writes.clone(),
        );
        let deltas = Counter::default();
        registry.register(
            "deltas",
            "Deltas published (each encoded once)",
            deltas.clone(),
        );
        let bytes_sent = Counter::default();
        registry.register(
            "bytes_sent",
            "Delta bytes written to subscribers",
            bytes_sent.clone(),
        );
        let messages_sent = Counter::default();
        registry.register(
            "messages_sent",
            "Messages written to subscribers",
            messages_sent.clone(),
        );
        let coalesced = Counter::default();
        registry.register(
            "coalesced",
            "Times a lagging subscriber's pending deltas were replaced by one reset per service",
            coalesced.clone(),
        );
        let snapshots = Counter::default();
        registry.register(
            "snapshots",
            "Snapshots sent (new or too-old subscribers)",
            snapshots.clone(),
        );
        let propagation = Histogram::new(exponential_buckets(0.0001, 2.0, 18));
        registry.register(
            "propagation_seconds",
            "From a write's commit to its delta being handed to a subscriber's stream",
            propagation.clone(),
        );
        let writes = Counter::default();
        registry.register("api_writes", "Accepted registration writes", writes.clone());
        let rejected_writes = Counter::default();
        registry.register(
            "api_rejected_writes",
            "Rejected registration writes",
            rejected_writes.clone(),
        );
        let slice_writes = Counter::default();
        registry.register(
            "slice_writes",
            "Slices created, updated or deleted",
            slice_writes.clone(),
        );
        let commit_groups = Counter::default();
        registry.register(
            "commit_groups",
            "Groups of registration writes committed together (one store transaction and fsync each)",
            commit_groups.clone(),
        );
        let renewals = Counter::default();
        registry.register(
            "renewals",
            "TTL renewals (in-memory lease extensions, never a store write)",
            renewals.clone(),
        );
        let store_failing = Gauge::default();
        registry.register(
            "store_failing",
            "1 while the data store refuses writes",
            store_failing.clone(),
        );
        let store_write_failures = Counter::default();
        registry.register(
            "store_write_failures",
            "Commits the data store refused",
            store_write_failures.clone(),
        );
        let registry_waits_offloaded = Counter::default();
        registry.register(
            "registry_waits_offloaded",
            "API calls that found the registry locked by a commit and waited on the blocking pool",
            registry_waits_offloaded.clone(),
        );
        let expired = Counter::default();
        registry.register(
            "expired_endpoints",
            "Endpoints removed because their TTL ran out",
            expired.clone(),
        );
        let instance_start = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register(
            "instance_start_seconds",
            "Cold start, control side: from spawning an instance to its port accepting",
            instance_start.clone(),
        );
        let webhook_failures = Counter::default();
        registry.register(
            "scaler_webhook_failures",
            "Scaler webhook calls that failed: refused, unreachable or timed out",
            webhook_failures.clone(),
        );
        let instance_start_failures = Counter::default();
        registry.register(
            "instance_start_failures",
            "Instances that exited or timed out before accepting connections",
            instance_start_failures.clone(),
        );
        let activation_to_spawn = Histogram::new(exponential_buckets(0.0001, 2.0, 16));
        registry.register(
            "activation_to_spawn_seconds",
            "Cold start, control side: from a proxy's activation request to the spawn",
            activation_to_spawn.clone(),
        );
        let activation_requests = Counter::default();
        registry.register(
            "activation_requests",
            "Activate messages received from proxies (one per service per burst of held requests)",
            activation_requests.clone(),
        );
        let instances_ready = Family::<ReadyLabels, Counter>::default();
        registry.register(
            "instances_ready",
            "Instances seen ready, by how: notify (READY=1 on NOTIFY_SOCKET) or probe (port accepted)",
            instances_ready.clone(),
        );
        let notify = NotifyCounters::default();
        registry.register(
            "notify_ready",
            "READY=1 datagrams received on instances' notification sockets",
            notify.ready.clone(),
        );
        registry.register(
            "notify_ignored",
            "Datagrams on instances' notification sockets ignored because they do not parse",
            notify.ignored.clone(),
        );
        let kubernetes = KubernetesMetrics::default();
        kubernetes.register(&mut registry);
        Self {
            instances_ready,
            notify,
            registry,
            kubernetes,
            instance_start,
            instance_start_failures,
            webhook_failures,
            activation_to_spawn,
            activation_requests,
            subscribers,
            subset_subscriptions,
            deltas,
            bytes_sent,
            messages_sent,
            stream_writes,
            coalesced,
            snapshots,
            propagation,
            writes,
            rejected_writes,
            slice_writes,
            commit_groups,
            renewals,
            store_failing,
            store_write_failures,
            registry_waits_offloaded,
            expired,
        }
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
