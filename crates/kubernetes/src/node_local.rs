//! Node-local activation for `scaler: kubernetes` with `node_local: true`:
//! from zero, besides scaling the Deployment, the scaler creates one Pod
//! from the Deployment's Pod template bound to the node of the proxy that
//! asked (`spec.nodeName`: no scheduler, no ReplicaSet controller in the
//! way). It is a bridge until the Deployment's own Pod is ready:
//!
//! - **Owned** by the Deployment: an `ownerReferences` entry with
//!   `controller: true`, so deleting the Deployment deletes it (the
//!   garbage collector) and no ReplicaSet adopts it although it carries
//!   the template's labels (a ReplicaSet adopts only orphans): the
//!   Deployment's replica count never includes it.
//! - **Handed over**: deleted once the service has a ready endpoint that
//!   is not a bridge (the Deployment's Pod, seen through the
//!   EndpointSlices the control plane already watches); until then it
//!   serves. The Deployment stays the only steady-state owner of the
//!   workload (rollouts, disruption budgets, resource accounting).
//! - **Adopted** after a restart: every scale call above zero lists the
//!   Pods labelled `meshless.io/activated-for=<deployment>` first; one
//!   found is taken over (its handover resumes), never doubled.
//! - **Cleaned up** on scale to zero: every Pod of that label is deleted.
//!
//! Any failure (node unknown, the API refusing the Pod) leaves the
//! Deployment's own scale-up, which runs alongside, as the only path:
//! counted in `meshless_control_kubernetes_node_local_fallbacks_total{reason}`.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use meshless_control::kubernetes::{
    FallbackLabels, KubernetesMetrics, NodeLocalLabels, ScaleRequest,
};
use meshless_control::state::PlaneState;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The label marking a bridge Pod, valued with its Deployment's name.
pub const ACTIVATED_FOR: &str = "meshless.io/activated-for";

/// How often a handover looks for the Deployment's ready Pod (in the
/// control plane's own registry: no API call).
const HANDOVER_CHECK: Duration = Duration::from_millis(50);

/// Why node-local activation fell back to the Deployment alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// No Node of that name (404).
    NodeUnknown,
    /// The Node could not be read (another error).
    NodeLookup,
    /// 403: RBAC or an admission policy.
    Forbidden,
    /// 409: the name exists.
    Conflict,
    /// 422: the Pod is invalid (or a label value would be).
    Invalid,
    /// The Deployment has no Pod template or no uid.
    NoTemplate,
    /// Any other API error.
    Error,
}

impl Fallback {
    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Self::NodeUnknown => "node_unknown",
            Self::NodeLookup => "node_lookup",
            Self::Forbidden => "forbidden",
            Self::Conflict => "conflict",
            Self::Invalid => "invalid",
            Self::NoTemplate => "no_template",
            Self::Error => "error",
        }
    }

    /// The fallback an API error on a Pod call stands for.
    fn of(e: &kube::Error) -> Self {
        match e {
            kube::Error::Api(s) if s.code == 403 => Self::Forbidden,
            kube::Error::Api(s) if s.code == 409 => Self::Conflict,
            kube::Error::Api(s) if s.code == 422 => Self::Invalid,
            _ => Self::Error,
        }
    }
}

/// The bridge Pod for `deployment` on `node`: its template's labels (plus
/// [`ACTIVATED_FOR`]), annotations and spec with `nodeName`, owned by the
/// Deployment; named `<deployment>-act-<suffix>`.
pub fn bridge_pod(deployment: &Deployment, node: &str, suffix: &str) -> Result<Pod, Fallback> {
    let name = deployment
        .metadata
        .name
        .clone()
        .ok_or(Fallback::NoTemplate)?;
    let uid = deployment
        .metadata
        .uid
        .clone()
        .ok_or(Fallback::NoTemplate)?;
    // A label value is at most 63 characters; the API would answer 422.
    if name.len() > 63 {
        return Err(Fallback::Invalid);
    }
    let template = &deployment
        .spec
        .as_ref()
        .ok_or(Fallback::NoTemplate)?
        .template;
    let mut spec = template.spec.clone().ok_or(Fallback::NoTemplate)?;
    spec.node_name = Some(node.to_owned());
    let meta = template.metadata.clone().unwrap_or_default();
    let mut labels = meta.labels.unwrap_or_default();
    labels.insert(ACTIVATED_FOR.to_owned(), name.clone());
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(format!("{name}-act-{suffix}")),
            namespace: deployment.metadata.namespace.clone(),
            labels: Some(labels),
            annotations: meta.annotations,
            owner_references: Some(vec![OwnerReference {
                api_version: "apps/v1".into(),
                kind: "Deployment".into(),
                name,
                uid,
                controller: Some(true),
                block_owner_deletion: None,
            }]),
            ..ObjectMeta::default()
        },
        spec: Some(spec),
        status: None,
    })
}

/// Five characters as the API server's `generateName` draws them.
fn suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| char::from(ALPHABET[fastrand::usize(..ALPHABET.len())]))
        .collect()
}

/// The handover watching one workload's bridge Pods.
#[derive(Debug)]
struct Handover {
    pods: BTreeSet<String>,
    task: JoinHandle<()>,
}

/// Creates, adopts, hands over and deletes bridge Pods.
pub struct NodeLocal {
    client: kube::Client,
    leader: Arc<AtomicBool>,
    metrics: KubernetesMetrics,
    state: Arc<PlaneState>,
    /// The Kubernetes side stops: handovers end.
    stop: watch::Receiver<bool>,
    /// Per workload `(namespace, deployment)`.
    handovers: Mutex<HashMap<(String, String), Handover>>,
}

impl std::fmt::Debug for NodeLocal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeLocal").finish_non_exhaustive()
    }
}

impl Drop for NodeLocal {
    fn drop(&mut self) {
        for h in self.handovers().values() {
            h.task.abort();
        }
    }
}

impl NodeLocal {
    /// Bridges through `client` while `leader`; handovers read `state`'s
    /// registry until `stop`.
    pub fn new(
        client: kube::Client,
        leader: Arc<AtomicBool>,
        metrics: KubernetesMetrics,
        state: Arc<PlaneState>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        Self {
            client,
            leader,
            metrics,
            state,
            stop,
            handovers: Mutex::new(HashMap::new()),
        }
    }

    fn handovers(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Handover>> {
        self.handovers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn count(&self, event: &str, n: usize) {
        self.metrics
            .node_local_pods
            .get_or_create(&NodeLocalLabels {
                event: event.into(),
            })
            .inc_by(n as u64);
    }

    fn fell_back(&self, request: &ScaleRequest<'_>, why: Fallback, error: &str) {
        self.metrics
            .node_local_fallbacks
            .get_or_create(&FallbackLabels {
                reason: why.label().into(),
            })
            .inc();
        tracing::warn!(service = request.service, deployment = %request.target.name,
            node = request.node, reason = why.label(), error,
            "node-local activation fell back to the Deployment alone");
    }

    fn pods(&self, namespace: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), namespace)
    }

    /// The bridge Pods of `deployment` not being deleted, by name.
    async fn bridges(&self, namespace: &str, deployment: &str) -> Result<Vec<String>, kube::Error> {
        let params = ListParams::default().labels(&format!("{ACTIVATED_FOR}={deployment}"));
        let list = self.pods(namespace).list(&params).await?;
        Ok(list
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| p.metadata.name)
            .collect())
    }

    /// Above zero: adopts the workload's bridge Pods, or (with a node)
    /// creates one; falls back (counted, logged) on any failure. The list
    /// of bridges and the reads the new Pod needs go out together: two
    /// round trips to the API before the Pod exists.
    pub async fn ensure(&self, request: &ScaleRequest<'_>) {
        let (namespace, deployment) = (request.namespace, request.target.name.as_str());
        let prepare = async {
            match request.node {
                Some(node) => Some(self.prepare(namespace, deployment, node).await),
                None => None,
            }
        };
        let (found, prepared) = tokio::join!(self.bridges(namespace, deployment), prepare);
        let found = match found {
            Ok(found) => found,
            Err(e) => {
                if request.node.is_some() {
                    self.fell_back(request, Fallback::of(&e), &e.to_string());
                }
                return;
            }
        };
        if !found.is_empty() {
            self.adopt(request, found);
            return;
        }
        let created = match prepared {
            None => return,
            Some(Ok(pod)) => self
                .pods(namespace)
                .create(&PostParams::default(), &pod)
                .await
                .map_err(|e| (Fallback::of(&e), e.to_string())),
            Some(Err(e)) => Err(e),
        };
        match created {
            Ok(pod) => {
                let pod = pod.metadata.name.unwrap_or_default();
                self.count("created", 1);
                tracing::info!(
                    service = request.service,
                    node = request.node,
                    pod,
                    "node-local Pod created"
                );
                self.hand_over(request, BTreeSet::from([pod]));
            }
            Err((why, error)) => self.fell_back(request, why, &error),
        }
    }

    /// Takes over bridge Pods found in the API (counted once each).
    fn adopt(&self, request: &ScaleRequest<'_>, found: Vec<String>) {
        let key = (request.namespace.to_owned(), request.target.name.clone());
        // Pods of a handover still running; one that ended (its delete
        // failed, or the leadership moved) is taken over again.
        let known = self
            .handovers()
            .get(&key)
            .filter(|h| !h.task.is_finished())
            .map(|h| h.pods.clone())
            .unwrap_or_default();
        let new = found.iter().filter(|p| !known.contains(*p)).count();
        if new > 0 {
            self.count("adopted", new);
            tracing::info!(service = request.service, pods = ?found, "node-local Pods adopted");
            self.hand_over(request, found.into_iter().collect());
        }
    }

    /// The bridge Pod of `deployment` on `node`, once the Node is known
    /// to exist (the Node and the Deployment are read together).
    async fn prepare(
        &self,
        namespace: &str,
        deployment: &str,
        node: &str,
    ) -> Result<Pod, (Fallback, String)> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), namespace);
        let (n, d) = tokio::join!(nodes.get(node), deployments.get(deployment));
        match n {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {
                return Err((Fallback::NodeUnknown, s.message));
            }
            Err(e) => return Err((Fallback::NodeLookup, e.to_string())),
        }
        let d = d.map_err(|e| (Fallback::of(&e), e.to_string()))?;
        bridge_pod(&d, node, &suffix())
            .map_err(|why| (why, "the Deployment cannot make a Pod".to_owned()))
    }

    /// Watches the service until it has a ready endpoint other than
    /// `pods`, then deletes `pods` (while this replica leads).
    fn hand_over(&self, request: &ScaleRequest<'_>, pods: BTreeSet<String>) {
        let key = (request.namespace.to_owned(), request.target.name.clone());
        let (state, leader, api, metrics) = (
            Arc::clone(&self.state),
            Arc::clone(&self.leader),
            self.pods(request.namespace),
            self.metrics.clone(),
        );
        let service = request.service.to_owned();
        let bridges = pods.clone();
        let mut stop = self.stop.clone();
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(HANDOVER_CHECK) => {}
                    _ = crate::stopped(&mut stop) => return,
                }
                let others_ready = state.lock().view(&service).is_some_and(|v| {
                    v.endpoints
                        .iter()
                        .any(|e| e.conditions.ready && !bridges.contains(&e.id))
                });
                if others_ready && leader.load(Ordering::SeqCst) {
                    break;
                }
            }
            let deleted = delete_all(&api, &bridges).await;
            metrics
                .node_local_pods
                .get_or_create(&NodeLocalLabels {
                    event: "handed_over".into(),
                })
                .inc_by(deleted as u64);
            tracing::info!(%service, pods = ?bridges, "node-local Pods handed over to the Deployment");
        });
        if let Some(old) = self.handovers().insert(key, Handover { pods, task }) {
            old.task.abort();
        }
    }

    /// At zero: stops the handover and deletes every bridge Pod of the
    /// workload (listed, so Pods of an earlier incarnation go too).
    pub async fn remove(&self, request: &ScaleRequest<'_>) {
        let key = (request.namespace.to_owned(), request.target.name.clone());
        if let Some(h) = self.handovers().remove(&key) {
            h.task.abort();
        }
        match self.bridges(request.namespace, &request.target.name).await {
            Ok(found) => {
                let names: BTreeSet<String> = found.into_iter().collect();
                let deleted = delete_all(&self.pods(request.namespace), &names).await;
                self.count("deleted", deleted);
            }
            Err(e) => {
                tracing::warn!(service = request.service, error = %e, "cannot list node-local Pods to delete them");
            }
        }
    }
}

/// Deletes `pods`; how many were deleted (a Pod already gone is not counted).
async fn delete_all(api: &Api<Pod>, pods: &BTreeSet<String>) -> usize {
    let mut deleted = 0;
    for pod in pods {
        match api.delete(pod, &DeleteParams::default()).await {
            Ok(_) => deleted += 1,
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => tracing::warn!(pod, error = %e, "cannot delete a node-local Pod"),
        }
    }
    deleted
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake_api::workloads::deployment;

    #[test]
    fn a_bridge_is_the_template_on_the_node_owned_by_the_deployment() {
        let mut d = deployment("shop", "lazy", 0);
        d.metadata.uid = Some("uid-7".into());
        let pod = bridge_pod(&d, "node-b", "x2b4z").expect("a pod");
        assert_eq!(pod.metadata.name.as_deref(), Some("lazy-act-x2b4z"));
        assert_eq!(pod.metadata.namespace.as_deref(), Some("shop"));
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels.get("app").map(String::as_str), Some("lazy"));
        assert_eq!(labels.get(ACTIVATED_FOR).map(String::as_str), Some("lazy"));
        let owner = &pod.metadata.owner_references.clone().unwrap_or_default()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("Deployment", "lazy", "uid-7")
        );
        assert_eq!(owner.controller, Some(true), "no ReplicaSet adopts it");
        let spec = pod.spec.expect("spec");
        assert_eq!(spec.node_name.as_deref(), Some("node-b"));
        assert_eq!(spec.containers[0].name, "app", "the template's containers");
    }

    #[test]
    fn a_deployment_without_uid_template_or_short_name_makes_no_bridge() {
        let d = deployment("shop", "lazy", 0);
        assert_eq!(bridge_pod(&d, "n", "s").err(), Some(Fallback::NoTemplate));
        let mut long = deployment("shop", &"a".repeat(64), 0);
        long.metadata.uid = Some("u".into());
        assert_eq!(bridge_pod(&long, "n", "s").err(), Some(Fallback::Invalid));
        let s = suffix();
        assert_eq!(s.len(), 5);
        assert!(
            s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        );
    }
}
