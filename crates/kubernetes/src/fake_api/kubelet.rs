//! The fake cluster's kubelets, for the Pods created through the API (the
//! Deployment's own pods are run by [`super::workloads::follow`]): every
//! Pod of one namespace that matches a Service's selector and is bound to
//! a node (`spec.nodeName` naming a Node object) runs as a real
//! `meshless-backend` on 127.0.0.1, port 0, named after the Pod. The
//! kubelet writes the Pod's status (`Running`, `podIP`, `hostIP`, the
//! `Ready` condition after `ready_after`) and, as the EndpointSlice
//! controller would, one slice of the Service per Pod whose endpoint
//! carries the Pod's node and the Node's zone. A deleted Pod's endpoint
//! turns terminating, its slice is deleted after `drain` and its process
//! stopped after another `drain`. A Pod naming no known node stays
//! `Pending` with no process (no kubelet runs it).
//!
//! Reacts to every change of the fake at once: no watch latency, no
//! scheduler, no image pull is modelled.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod, PodCondition, PodIP, PodStatus};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use meshless_backend::Backend;
use tokio::sync::watch;
use tokio::time::Instant;

use super::FakeApiServer;
use super::workloads::{Placement, sleep_until, slice_of, start_pod};
use crate::objects::{PodState, ZONE_LABEL};

/// The kubelets of every node, for one Service's Pods.
#[derive(Debug, Clone)]
pub struct Kubelets {
    pub namespace: String,
    /// The Service whose slices list the Pods.
    pub service: String,
    /// The Service's selector: Pods carrying all these labels are its.
    pub selector: BTreeMap<String, String>,
    /// From start to ready (the readiness probe's first success).
    pub ready_after: Duration,
    /// From terminating to the slice's deletion, and on to the stop.
    pub drain: Duration,
}

/// One Pod running on its node.
struct Running {
    backend: Backend,
    node: String,
    zone: String,
    /// When it turns ready; `None` once it is.
    ready_at: Option<Instant>,
}

impl Kubelets {
    fn selects(&self, pod: &Pod) -> bool {
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        self.selector.iter().all(|(k, v)| labels.get(k) == Some(v))
    }

    fn slice(&self, r: &Running, state: PodState) -> EndpointSlice {
        let at = Placement {
            node: &r.node,
            zone: &r.zone,
        };
        slice_of(&self.namespace, &self.service, &r.backend, state, at)
    }
}

/// The Pods of `k` bound to a known node: name -> (node, zone).
fn bound(fake: &FakeApiServer, k: &Kubelets) -> BTreeMap<String, (String, String)> {
    let zones: BTreeMap<String, String> = fake
        .list::<Node>("")
        .into_iter()
        .filter_map(|n| {
            let zone = n.metadata.labels.as_ref()?.get(ZONE_LABEL).cloned();
            Some((n.metadata.name?, zone.unwrap_or_default()))
        })
        .collect();
    fake.list::<Pod>(&k.namespace)
        .into_iter()
        .filter(|p| k.selects(p))
        .filter_map(|p| {
            let node = p.spec.as_ref()?.node_name.clone()?;
            let zone = zones.get(&node)?.clone();
            Some((p.metadata.name?, (node, zone)))
        })
        .collect()
}

/// Writes `name`'s status: running at `r`'s address, ready or not.
fn write_status(fake: &FakeApiServer, namespace: &str, name: &str, r: &Running, ready: bool) {
    let ip = r.backend.local_addr().ip().to_string();
    fake.update::<Pod>(namespace, name, |pod| {
        pod.status = Some(PodStatus {
            phase: Some("Running".into()),
            pod_ip: Some(ip.clone()),
            pod_ips: Some(vec![PodIP { ip: ip.clone() }]),
            host_ip: Some(ip),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if ready { "True" } else { "False" }.into(),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        });
    });
}

/// Runs `k`'s Pods until `stop`, then stops every process.
pub async fn run(fake: Arc<FakeApiServer>, k: Kubelets, mut stop: watch::Receiver<bool>) {
    let mut running: BTreeMap<String, Running> = BTreeMap::new();
    let mut changes = fake.changes();
    loop {
        changes.borrow_and_update();
        let pods = bound(&fake, &k);
        for (name, (node, zone)) in &pods {
            if running.contains_key(name) {
                continue;
            }
            let Ok(backend) = start_pod(name).await else {
                continue;
            };
            let r = Running {
                backend,
                node: node.clone(),
                zone: zone.clone(),
                ready_at: Some(Instant::now() + k.ready_after),
            };
            fake.apply(&k.slice(&r, PodState::Starting));
            write_status(&fake, &k.namespace, name, &r, false);
            running.insert(name.clone(), r);
        }
        let now = Instant::now();
        for (name, r) in running.iter_mut() {
            if r.ready_at.is_some_and(|t| t <= now) {
                r.ready_at = None;
                fake.apply(&k.slice(r, PodState::Ready));
                write_status(&fake, &k.namespace, name, r, true);
            }
        }
        let gone: Vec<String> = running
            .keys()
            .filter(|n| !pods.contains_key(*n))
            .cloned()
            .collect();
        for name in gone {
            if let Some(r) = running.remove(&name) {
                tokio::spawn(retire(Arc::clone(&fake), k.clone(), r));
            }
        }
        let next_ready = running.values().filter_map(|r| r.ready_at).min();
        tokio::select! {
            c = changes.changed() => if c.is_err() { break },
            _ = sleep_until(next_ready) => {}
            _ = crate::stopped(&mut stop) => break,
        }
    }
    for (_, r) in running {
        r.backend.stop().await;
    }
}

/// A deleted Pod: terminating, then its slice gone, then its process.
async fn retire(fake: Arc<FakeApiServer>, k: Kubelets, r: Running) {
    fake.apply(&k.slice(&r, PodState::Terminating));
    tokio::time::sleep(k.drain).await;
    fake.delete::<EndpointSlice>(&k.namespace, &format!("{}-{}", k.service, r.backend.name()));
    tokio::time::sleep(k.drain).await;
    r.backend.stop().await;
}
