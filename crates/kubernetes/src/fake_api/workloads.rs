//! What the fake cluster's controllers and kubelets would do for one
//! Deployment: keep `spec.replicas` pods running (each a real
//! `meshless-backend` on 127.0.0.1, port 0), reacting to each change at
//! once (no controller or scheduler delay is modelled), and publish each pod's
//! EndpointSlice as the EndpointSlice controller would: not ready when it
//! starts, ready after its readiness delay (the kubelet's probe period),
//! terminating, then gone when scaled down (oldest first).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{Container, PodSpec, PodTemplateSpec};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use meshless_backend::{Backend, BackendConfig};
use tokio::sync::watch;
use tokio::time::Instant;

use super::FakeApiServer;
use crate::objects::{PodState, pod_endpoint, slice};

/// A Deployment with `replicas`, the `app: NAME` selector and a Pod
/// template of those labels with one container (which the fake's
/// kubelets run as a `meshless-backend`, whatever its image).
pub fn deployment(namespace: &str, name: &str, replicas: i32) -> Deployment {
    let labels = std::collections::BTreeMap::from([("app".to_owned(), name.to_owned())]);
    let template = PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels.clone()),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "app".into(),
                image: Some("meshless-backend".into()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
    };
    Deployment {
        metadata: ObjectMeta {
            namespace: Some(namespace.to_owned()),
            name: Some(name.to_owned()),
            labels: Some(labels.clone()),
            ..ObjectMeta::default()
        },
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(labels),
                ..LabelSelector::default()
            },
            template,
            ..DeploymentSpec::default()
        }),
        status: None,
    }
}

/// Where one Deployment's pods are published.
#[derive(Debug, Clone)]
pub struct Workload {
    pub namespace: String,
    pub deployment: String,
    /// The Service whose slices list the pods.
    pub service: String,
    /// From a rise of `spec.replicas` to its pods starting (the
    /// ReplicaSet controller and the scheduler; zero: at once).
    pub start_after: Duration,
    /// From start to ready (the kubelet's readiness period).
    pub ready_after: Duration,
    /// From terminating to gone.
    pub drain: Duration,
}

/// The slice of one pod of `w` (the Deployment's pods run on `node-a`).
pub fn pod_slice(w: &Workload, pod: &Backend, state: PodState) -> EndpointSlice {
    let at = Placement {
        node: "node-a",
        zone: "zone-a",
    };
    slice_of(&w.namespace, &w.service, pod, state, at)
}

/// The node (and its zone) a pod runs on.
#[derive(Debug, Clone, Copy)]
pub struct Placement<'a> {
    pub node: &'a str,
    pub zone: &'a str,
}

/// The slice of `service` holding pod `pod` alone, named `SERVICE-POD`.
pub fn slice_of(
    namespace: &str,
    service: &str,
    pod: &Backend,
    state: PodState,
    at: Placement<'_>,
) -> EndpointSlice {
    let addr = pod.local_addr();
    slice(
        namespace,
        &format!("{service}-{}", pod.name()),
        service,
        "IPv4",
        ("http", i32::from(addr.port())),
        vec![pod_endpoint(
            pod.name(),
            &addr.ip().to_string(),
            state,
            at.node,
            at.zone,
        )],
    )
}

/// Starts one pod (a backend named `name`).
pub async fn start_pod(name: &str) -> std::io::Result<Backend> {
    Backend::start(BackendConfig {
        name: name.to_owned(),
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        latency: Duration::ZERO,
        fail_rate: 0.0,
        startup_delay: Duration::ZERO,
    })
    .await
    .map_err(std::io::Error::other)
}

/// Follows `w`'s Deployment until `stop`: starts pods up to its replicas,
/// retires the oldest beyond them.
pub async fn follow(fake: Arc<FakeApiServer>, w: Workload, mut stop: watch::Receiver<bool>) {
    let mut pods: Vec<Backend> = Vec::new();
    let mut serial = 0u32;
    let mut changes = fake.changes();
    let mut due: Option<Instant> = None;
    loop {
        changes.borrow_and_update();
        let replicas = fake
            .get::<Deployment>(&w.namespace, &w.deployment)
            .and_then(|d| d.spec?.replicas)
            .unwrap_or(0)
            .max(0) as usize;
        // The controllers and the scheduler take `start_after` to react.
        let start_now = pods.len() < replicas && {
            let at = *due.get_or_insert_with(|| Instant::now() + w.start_after);
            at <= Instant::now()
        };
        if pods.len() >= replicas || start_now {
            due = None;
        }
        while start_now && pods.len() < replicas {
            serial += 1;
            let Ok(pod) = start_pod(&format!("{}-{serial}", w.deployment)).await else {
                break;
            };
            fake.apply(&pod_slice(&w, &pod, PodState::Starting));
            let (fake, w2, slice) = (
                Arc::clone(&fake),
                w.clone(),
                pod_slice(&w, &pod, PodState::Ready),
            );
            tokio::spawn(async move {
                tokio::time::sleep(w2.ready_after).await;
                fake.apply(&slice);
            });
            pods.push(pod);
        }
        // The oldest goes first, so one pod more then one fewer replaces
        // a pod, as a rollout does.
        while pods.len() > replicas {
            let pod = pods.remove(0);
            fake.apply(&pod_slice(&w, &pod, PodState::Terminating));
            let (fake, w2) = (Arc::clone(&fake), w.clone());
            tokio::spawn(async move {
                tokio::time::sleep(w2.drain).await;
                fake.delete::<EndpointSlice>(
                    &w2.namespace,
                    &format!("{}-{}", w2.service, pod.name()),
                );
                tokio::time::sleep(w2.drain).await;
                pod.stop().await;
            });
        }
        // At once on any change of the fake (as the controllers' watches
        // do), so the Deployment path is measured without a poll period.
        tokio::select! {
            c = changes.changed() => if c.is_err() { break },
            _ = sleep_until(due) => {}
            _ = crate::stopped(&mut stop) => break,
        }
    }
    for pod in pods {
        pod.stop().await;
    }
}

/// Sleeps until `at`, or forever when `None`.
pub(crate) async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
