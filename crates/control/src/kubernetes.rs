//! What the control plane knows of its Kubernetes source: the `kubernetes:`
//! section of the file and the source's metrics. The source itself (the
//! watches, the slice cache) lives in the `meshless-kubernetes` crate, so
//! kube's dependency tree stays out of this crate; these types are plain
//! data so both crates and the binary can share them.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use meshless_model::serde_duration as duration;

use meshless_model::FieldError;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

/// `kubernetes:` of the control plane's file: watch a cluster's Services
/// and EndpointSlices and serve them as read-only services.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesSource {
    /// A kubeconfig file; absent = the pod's service account (in-cluster),
    /// else `$KUBECONFIG` or `~/.kube/config`.
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context; absent = its current context.
    #[serde(default)]
    pub context: Option<String>,
    /// Namespaces watched; empty = every namespace.
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// Only Services (and their slices, which copy the Service's labels)
    /// matching this selector, e.g. `meshless.io/enabled=true`.
    #[serde(default)]
    pub label_selector: Option<String>,
    /// The Lease that elects the one replica allowed to scale (used when a
    /// service has `scaler: kubernetes`); every replica serves the stream.
    #[serde(default)]
    pub leader_election: LeaderElection,
}

/// `kubernetes.leader_election`: a `coordination.k8s.io/v1` Lease, with
/// client-go's default timings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaderElection {
    #[serde(default = "default_lease_name")]
    pub lease_name: String,
    /// Absent = `$POD_NAMESPACE`, else `default`.
    #[serde(default)]
    pub namespace: Option<String>,
    /// This replica's name in the Lease; absent = `$POD_NAME`, else `$HOSTNAME`.
    #[serde(default)]
    pub identity: Option<String>,
    /// `HOST:PORT` at which the other replicas reach this one's
    /// registration API (written in the Lease while it leads; followers
    /// forward their proxies' load and activation requests there).
    /// Absent: the bound `api_address`, or `$POD_IP` with its port when it
    /// is bound to every interface.
    #[serde(default)]
    pub advertise_address: Option<String>,
    /// A holder that has not renewed for this long may be replaced.
    #[serde(default = "default_lease_duration", with = "duration")]
    pub lease_duration: Duration,
    /// How often the holder renews and the others try (below `lease_duration`).
    #[serde(default = "default_retry_period", with = "duration")]
    pub retry_period: Duration,
}

fn default_lease_name() -> String {
    "meshless-control".into()
}
fn default_lease_duration() -> Duration {
    Duration::from_secs(15)
}
fn default_retry_period() -> Duration {
    Duration::from_secs(2)
}

impl Default for LeaderElection {
    fn default() -> Self {
        Self {
            lease_name: default_lease_name(),
            namespace: None,
            identity: None,
            advertise_address: None,
            lease_duration: default_lease_duration(),
            retry_period: default_retry_period(),
        }
    }
}

impl KubernetesSource {
    /// Checks namespace names (RFC 1123 labels) and a non-empty selector.
    pub fn validate(&self) -> Result<(), FieldError> {
        for (i, ns) in self.namespaces.iter().enumerate() {
            let ok = !ns.is_empty()
                && ns.len() <= 63
                && ns
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !ns.starts_with('-')
                && !ns.ends_with('-');
            if !ok {
                return Err(FieldError::new(
                    format!("namespaces[{i}]"),
                    format!("{ns:?} is not a namespace name (lowercase RFC 1123 label)"),
                ));
            }
        }
        let le = &self.leader_election;
        if le.retry_period.is_zero() || le.retry_period >= le.lease_duration {
            return Err(FieldError::new(
                "leader_election.retry_period",
                "must be above zero and below lease_duration",
            ));
        }
        if self.label_selector.as_deref().is_some_and(str::is_empty) {
            return Err(FieldError::new(
                "label_selector",
                "must not be empty (leave it out to watch everything)",
            ));
        }
        Ok(())
    }
}

/// `scaler: { kubernetes: ... }` of an autoscaled service: the object whose
/// `scale` subresource (`autoscaling/v1` Scale) sets its replicas.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScaleTarget {
    /// `deployments` (default) or `statefulsets` (group `apps/v1`).
    #[serde(default = "default_resource")]
    pub resource: String,
    pub name: String,
    /// Absent = the service's namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Node-local activation (Deployments only): from zero, also create
    /// one Pod from the Deployment's template bound to the node of the
    /// proxy that asked (`spec.nodeName`), until the Deployment's own Pod
    /// is ready. Needs RBAC for Pods (create, list, delete), Deployments
    /// (get) and Nodes (get).
    #[serde(default)]
    pub node_local: bool,
}

fn default_resource() -> String {
    "deployments".into()
}

impl ScaleTarget {
    /// Checks the resource kind and the name.
    pub fn validate(&self) -> Result<(), FieldError> {
        if !matches!(self.resource.as_str(), "deployments" | "statefulsets") {
            return Err(FieldError::new(
                "resource",
                "must be deployments or statefulsets",
            ));
        }
        if self.name.is_empty() {
            return Err(FieldError::new("name", "must not be empty"));
        }
        if self.node_local && self.resource != "deployments" {
            return Err(FieldError::new(
                "node_local",
                "only for deployments (a StatefulSet's pods have fixed identities)",
            ));
        }
        Ok(())
    }
}

/// What a [`ReplicaScaler`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleOutcome {
    /// The replicas were set.
    Scaled,
    /// Another control-plane replica leads: nothing was done.
    NotLeader,
}

/// A boxed scale call.
pub type ScaleFuture<'a> = Pin<Box<dyn Future<Output = Result<ScaleOutcome, String>> + Send + 'a>>;

/// One scale decision for a [`ReplicaScaler`].
#[derive(Debug, Clone, Copy)]
pub struct ScaleRequest<'a> {
    /// The autoscaled service, `NS/NAME` (whose endpoints are the workload's pods).
    pub service: &'a str,
    /// The workload's namespace.
    pub namespace: &'a str,
    pub target: &'a ScaleTarget,
    pub replicas: u32,
    /// From zero only: the node of the proxy that asked for an instance
    /// (node-local activation); `None` otherwise. A scaler may ignore it.
    pub node: Option<&'a str>,
}

/// Sets replicas through the Kubernetes API (implemented by the
/// `meshless-kubernetes` crate, which also elects the one replica that may).
pub trait ReplicaScaler: Send + Sync + std::fmt::Debug {
    /// Sets the target's replicas (and, with `node_local`, starts the
    /// first instance on the asking node).
    fn scale<'a>(&'a self, request: ScaleRequest<'a>) -> ScaleFuture<'a>;

    /// Whether this replica decides the scale now (holds the Lease): a
    /// replica that does not observes afresh once it does.
    fn leads(&self) -> bool {
        true
    }

    /// While another replica leads: its registration API address (from
    /// the Lease) and this replica's identity, to forward load and
    /// activation requests to it. `None` while this one leads or no
    /// leader is known.
    fn leader_api(&self) -> Option<(String, String)> {
        None
    }
}

/// Labels of `meshless_control_kubernetes_node_local_pods`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLocalLabels {
    /// `created`, `adopted` (found after a restart), `handed_over`
    /// (deleted once the Deployment's pod was ready) or `deleted` (scale to zero).
    pub event: String,
}

/// Labels of `meshless_control_kubernetes_node_local_fallbacks`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FallbackLabels {
    /// `node_unknown`, `node_lookup`, `forbidden`, `conflict`,
    /// `invalid`, `no_template` or `error`.
    pub reason: String,
}

/// Labels of `meshless_control_kubernetes_events`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabels {
    /// `service` or `endpointslice`.
    pub resource: String,
    /// `apply` (added or modified), `delete`, or `relist`.
    pub event: String,
}

/// Labels of `meshless_control_kubernetes_annotation_errors`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AnnotationLabels {
    /// The annotation at fault, e.g. `meshless.io/policy`.
    pub annotation: String,
}

/// The Kubernetes source's metrics (all zero when it is not configured).
#[derive(Debug, Clone, Default)]
pub struct KubernetesMetrics {
    /// Watch events applied, by resource and kind.
    pub events: Family<EventLabels, Counter>,
    /// Full lists (the first one, and each after `410 Gone` or a broken watch).
    pub relists: Counter,
    /// Watch or list errors (each followed by a backoff).
    pub errors: Counter,
    /// Unix time in seconds of the last list or event received: the age of
    /// the state served is `time() - this`.
    pub last_sync_timestamp: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Services whose state the source holds.
    pub services: Gauge,
    /// Endpoints skipped: FQDN address type, no address, no matching port.
    pub skipped_endpoints: Counter,
    /// Scale-subresource writes that succeeded.
    pub scale_writes: Counter,
    /// 1 while this replica holds the leader Lease.
    pub leader: Gauge,
    /// Bad `meshless.io/*` settings annotations seen (each distinct error
    /// once per service); the service kept its previous settings.
    pub annotation_errors: Family<AnnotationLabels, Counter>,
    /// Node-local Pods created, adopted, handed over, deleted.
    pub node_local_pods: Family<NodeLocalLabels, Counter>,
    /// Node-local activations that fell back to the Deployment alone, by reason.
    pub node_local_fallbacks: Family<FallbackLabels, Counter>,
}

impl KubernetesMetrics {
    /// Registers every metric under `kubernetes_` in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("kubernetes");
        r.register(
            "events",
            "Watch events applied from the API server",
            self.events.clone(),
        );
        r.register(
            "relists",
            "Full lists of a resource (start, 410 Gone, broken watch)",
            self.relists.clone(),
        );
        r.register(
            "errors",
            "List or watch errors, each followed by a backoff",
            self.errors.clone(),
        );
        r.register(
            "last_sync_timestamp_seconds",
            "Unix time of the last list or event received from the API server",
            self.last_sync_timestamp.clone(),
        );
        r.register(
            "services",
            "Kubernetes Services served as read-only services",
            self.services.clone(),
        );
        r.register(
            "skipped_endpoints",
            "Slice endpoints skipped (FQDN, no address, or no port matching the Service)",
            self.skipped_endpoints.clone(),
        );
        r.register(
            "scale_writes",
            "Replicas set through the scale subresource",
            self.scale_writes.clone(),
        );
        r.register(
            "annotation_errors",
            "Bad meshless.io settings annotations on Services (the service kept its previous settings)",
            self.annotation_errors.clone(),
        );
        r.register(
            "node_local_pods",
            "Node-local Pods (node-local activation) by event: created, adopted, handed_over, deleted",
            self.node_local_pods.clone(),
        );
        r.register(
            "node_local_fallbacks",
            "Node-local activations that fell back to scaling the Deployment alone, by reason",
            self.node_local_fallbacks.clone(),
        );
        r.register(
            "leader",
            "1 while this control-plane replica holds the leader Lease",
            self.leader.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_local_is_for_deployments_only_and_off_by_default() {
        let parse =
            |json: &str| -> ScaleTarget { serde_json::from_str(json).expect("a scale target") };
        let plain = parse(r#"{"name": "web"}"#);
        assert!(!plain.node_local, "off by default");
        assert_eq!(plain.validate(), Ok(()));
        assert_eq!(
            parse(r#"{"name": "web", "node_local": true}"#).validate(),
            Ok(())
        );
        let sts = parse(r#"{"name": "db", "resource": "statefulsets", "node_local": true}"#);
        assert_eq!(sts.validate().expect_err("refused").path, "node_local");
    }

    #[test]
    fn namespaces_and_selector_are_checked_with_their_path() {
        let ok = KubernetesSource {
            namespaces: vec!["default".into(), "team-a".into()],
            label_selector: Some("app=web".into()),
            ..KubernetesSource::default()
        };
        assert_eq!(ok.validate(), Ok(()));
        let bad = KubernetesSource {
            namespaces: vec!["default".into(), "Team_A".into()],
            ..KubernetesSource::default()
        };
        assert_eq!(bad.validate().expect_err("bad").path, "namespaces[1]");
        let empty = KubernetesSource {
            label_selector: Some(String::new()),
            ..KubernetesSource::default()
        };
        assert_eq!(empty.validate().expect_err("empty").path, "label_selector");
    }
}
