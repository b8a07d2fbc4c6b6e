//! `scaler: kubernetes`: sets a Deployment's or StatefulSet's replicas
//! through its `scale` subresource (a merge patch of `spec.replicas`, as
//! `kubectl scale` sends), only while this replica leads ([`crate::lease`]).
//! The pods it asks for arrive through the source as not-ready endpoints,
//! which proxies holding requests probe directly.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use kube::Api;
use kube::api::{Patch, PatchParams};
use meshless_control::kubernetes::{
    KubernetesMetrics, ReplicaScaler, ScaleFuture, ScaleOutcome, ScaleTarget,
};

/// The Kubernetes [`ReplicaScaler`].
#[derive(Clone)]
pub struct KubeScaler {
    client: kube::Client,
    leader: Arc<AtomicBool>,
    metrics: KubernetesMetrics,
}

impl std::fmt::Debug for KubeScaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeScaler")
            .field("leader", &self.leader.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl KubeScaler {
    /// Scales through `client` while `leader` is true.
    pub fn new(client: kube::Client, leader: Arc<AtomicBool>, metrics: KubernetesMetrics) -> Self {
        Self {
            client,
            leader,
            metrics,
        }
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
    fn scale<'a>(
        &'a self,
        namespace: &'a str,
        target: &'a ScaleTarget,
        replicas: u32,
    ) -> ScaleFuture<'a> {
        Box::pin(async move {
            if !self.leader.load(Ordering::SeqCst) {
                return Ok(ScaleOutcome::NotLeader);
            }
            self.patch(namespace, target, replicas)
                .await
                .map_err(|e| e.to_string())?;
            self.metrics.scale_writes.inc();
            Ok(ScaleOutcome::Scaled)
        })
    }
}
