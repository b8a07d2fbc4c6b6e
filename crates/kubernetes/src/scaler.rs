//! `scaler: kubernetes`: sets a Deployment's or StatefulSet's replicas
//! through its `scale` subresource (a merge patch of `spec.replicas`, as
//! `kubectl scale` sends), only while this replica leads ([`crate::lease`]).
//! The pods it asks for arrive through the source as not-ready endpoints,
//! which proxies holding requests probe directly. With `node_local`, it
//! also starts the first instance on the asking proxy's node
//! ([`crate::node_local`]), alongside the scale.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use kube::Api;
use kube::api::{Patch, PatchParams};
use meshless_control::kubernetes::{
    KubernetesMetrics, ReplicaScaler, ScaleFuture, ScaleOutcome, ScaleRequest, ScaleTarget,
};
use meshless_control::state::PlaneState;
use tokio::sync::watch;

use crate::node_local::NodeLocal;

/// The Kubernetes [`ReplicaScaler`].
#[derive(Clone)]
pub struct KubeScaler {
    client: kube::Client,
    leader: Arc<AtomicBool>,
    metrics: KubernetesMetrics,
    node_local: Arc<NodeLocal>,
    /// The leader's API address while another replica leads (from the Lease).
    leader_api: Arc<Mutex<Option<String>>>,
    /// This replica's Lease identity.
    identity: String,
}

impl std::fmt::Debug for KubeScaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeScaler")
            .field("leader", &self.leader.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl KubeScaler {
    /// Scales through `client` while `leader` is true; node-local
    /// handovers read `state`'s registry until `stop`.
    pub fn new(
        client: kube::Client,
        leader: Arc<AtomicBool>,
        metrics: KubernetesMetrics,
        state: Arc<PlaneState>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        let node_local = NodeLocal::new(
            client.clone(),
            Arc::clone(&leader),
            metrics.clone(),
            state,
            stop,
        );
        Self {
            client,
            leader,
            metrics,
            node_local: Arc::new(node_local),
            leader_api: Arc::new(Mutex::new(None)),
            identity: String::new(),
        }
    }

    /// Forwards to the leader whose address `leader_api` holds (the
    /// elector keeps it), as `identity`.
    pub fn with_leader_api(
        mut self,
        leader_api: Arc<Mutex<Option<String>>>,
        identity: String,
    ) -> Self {
        self.leader_api = leader_api;
        self.identity = identity;
        self
    }

    async fn patch(
        &self,
        namespace: &str,
        target: &ScaleTarget,
        replicas: u32,
    ) -> Result<(), kube::Error> {
        let patch = Patch::Merge(serde_json::json!({ "spec": { "replicas": replicas } }));
        let params = PatchParams::default();
        match target.resource.as_str() {
            "statefulsets" => {
                let api: Api<StatefulSet> = Api::namespaced(self.client.clone(), namespace);
                api.patch_scale(&target.name, &params, &patch).await?;
            }
            _ => {
                let api: Api<Deployment> = Api::namespaced(self.client.clone(), namespace);
                api.patch_scale(&target.name, &params, &patch).await?;
            }
        }
        Ok(())
    }
}

impl ReplicaScaler for KubeScaler {
    fn scale<'a>(&'a self, request: ScaleRequest<'a>) -> ScaleFuture<'a> {
        Box::pin(async move {
            if !self.leader.load(Ordering::SeqCst) {
                return Ok(ScaleOutcome::NotLeader);
            }
            let (namespace, target) = (request.namespace, request.target);
            let patch = self.patch(namespace, target, request.replicas);
            // The bridge Pod and the scale go out together: the Deployment's
            // Pod is the fallback if the bridge fails, and its successor.
            let patched = match (target.node_local, request.replicas) {
                (false, _) => patch.await,
                (true, 0) => tokio::join!(patch, self.node_local.remove(&request)).0,
                (true, _) => tokio::join!(patch, self.node_local.ensure(&request)).0,
            };
            patched.map_err(|e| e.to_string())?;
            self.metrics.scale_writes.inc();
            Ok(ScaleOutcome::Scaled)
        })
    }

    fn leads(&self) -> bool {
        self.leader.load(Ordering::SeqCst)
    }

    fn leader_api(&self) -> Option<(String, String)> {
        if self.leads() {
            return None;
        }
        let address = self
            .leader_api
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()?;
        Some((address, self.identity.clone()))
    }
}
