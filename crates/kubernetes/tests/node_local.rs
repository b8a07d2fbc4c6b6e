//! Node-local activation with `scaler: kubernetes` and `node_local: true`
//! against the fake API server, through real proxies on two nodes: the
//! bridge Pod starts on the asking proxy's node and answers, the other
//! proxy's requests follow it, the Deployment's Pod takes over, a
//! restarted control plane adopts the Pod, scale to zero deletes it, and
//! every refusal falls back to the Deployment alone.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use meshless_control::config::ControlConfig;
use meshless_control::kubernetes::{ScaleOutcome, ScaleRequest, ScaleTarget};
use meshless_control::plane::ControlPlane;
use meshless_kubernetes::fake_api::FakeApiServer;
use meshless_kubernetes::fake_api::kubelet::{self, Kubelets};
use meshless_kubernetes::fake_api::workloads::{self, Workload, deployment};
use meshless_kubernetes::node_local::ACTIVATED_FOR;
use meshless_kubernetes::objects::{node, service};
use meshless_proxy::{Proxy, ProxyConfig};
use tokio::sync::watch;

/// Longer than any test: a Deployment Pod that "never" starts or turns ready.
const NEVER: Duration = Duration::from_secs(600);

/// How the fake cluster behaves.
#[derive(Clone, Copy)]
struct Timing {
    /// The Deployment's Pods: from the scale to the start.
    deployment_start: Duration,
    /// The Deployment's Pods: from the start to ready.
    deployment_ready: Duration,
}

/// The fake with `shop/lazy` (Service, Deployment at zero), nodes
/// `node-a` and `node-b`, kubelets for the Pods created through the API
/// and the Deployment's own follower; stops them when dropped.
struct Fake {
    api: Arc<FakeApiServer>,
    stop: watch::Sender<bool>,
    dir: tempfile::TempDir,
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

impl Fake {
    async fn start(name: &str, t: Timing) -> Self {
        let api = Arc::new(
            FakeApiServer::start("127.0.0.1:0".parse().unwrap())
                .await
                .unwrap(),
        );
        api.apply(&service("shop", "lazy", &[("http", 80)]));
        api.apply(&deployment("shop", "lazy", 0));
        api.apply(&node("node-a", "zone-a"));
        api.apply(&node("node-b", "zone-b"));
        let (stop, stopped) = watch::channel(false);
        let kubelets = Kubelets {
            namespace: "shop".into(),
            service: "lazy".into(),
            selector: [("app".to_owned(), "lazy".to_owned())].into(),
            // Never ready: the proxy answers by probing the starting Pod,
            // and readiness is the Deployment's Pod's alone (handover).
            ready_after: NEVER,
            drain: Duration::from_millis(200),
        };
        tokio::spawn(kubelet::run(Arc::clone(&api), kubelets, stopped.clone()));
        let workload = Workload {
            namespace: "shop".into(),
            deployment: "lazy".into(),
            service: "lazy".into(),
            start_after: t.deployment_start,
            ready_after: t.deployment_ready,
            drain: Duration::from_millis(200),
        };
        tokio::spawn(workloads::follow(Arc::clone(&api), workload, stopped));
        let dir = temp_dir(name);
        api.write_kubeconfig(&dir.path().join("kubeconfig"))
            .unwrap();
        Self { api, stop, dir }
    }

    /// The bridge Pods of `lazy`, by name.
    fn bridges(&self) -> Vec<Pod> {
        self.api
            .list::<Pod>("shop")
            .into_iter()
            .filter(|p| {
                p.metadata
                    .labels
                    .as_ref()
                    .is_some_and(|l| l.get(ACTIVATED_FOR).map(String::as_str) == Some("lazy"))
            })
            .collect()
    }

    fn replicas(&self) -> Option<i32> {
        self.api
            .get::<Deployment>("shop", "lazy")
            .and_then(|d| d.spec?.replicas)
    }

    /// Requests to the API since `from` (an index into the log), without
    /// the watches.
    fn calls_since(&self, from: usize) -> Vec<String> {
        self.api.requests()[from..]
            .iter()
            .filter(|r| !r.contains("watch=true"))
            .cloned()
            .collect()
    }
}

/// A control plane scaling `shop/lazy` through Deployment `lazy`.
fn control_yaml(fake: &Fake, identity: &str, node_local: bool, min: u32) -> String {
    format!(
        "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\n\
         kubernetes:\n  kubeconfig: \"{}\"\n  namespaces: [shop]\n  leader_election:\n    namespace: shop\n    identity: {identity}\n    lease_duration: 4s\n    retry_period: 200ms\n\
         services:\n  - namespace: shop\n    name: lazy\n    autoscaling:\n      min_instances: {min}\n      max_instances: 2\n      tick: 100ms\n      stable_window: 4s\n      panic_window: 1s\n      scale_to_zero_after: 3s\n      scaler:\n        kubernetes: {{ name: lazy, node_local: {node_local} }}\n",
        fake.dir.path().join("kubeconfig").display()
    )
}

/// The plane, its Kubernetes side's stop switch; once it leads, watches
/// the slices and has made its first scale call.
async fn plane(fake: &Fake, yaml: &str) -> (ControlPlane, watch::Sender<bool>) {
    let from = fake.api.requests().len();
    let config = ControlConfig::parse(yaml, "control.yaml").unwrap();
    let plane = ControlPlane::start(config.clone()).await.unwrap();
    let (stop, stopped) = watch::channel(false);
    meshless_kubernetes::start(plane.state.clone(), config.kubernetes.unwrap(), stopped)
        .await
        .unwrap();
    eventually("this replica leads", || async {
        metric(
            &plane.state.metrics.encode(),
            "meshless_control_kubernetes_leader",
        ) == 1.0
    })
    .await;
    eventually("the service reaches the registry", || async {
        plane.state.lock().view("shop/lazy").is_some()
    })
    .await;
    eventually("the slices watched, the first decision made", || async {
        let calls = fake.api.requests();
        let calls = &calls[from..];
        calls
            .iter()
            .any(|c| c.contains("/endpointslices?") && c.contains("watch=true"))
            && calls
                .iter()
                .any(|c| c.starts_with("PATCH") && c.contains("/scale"))
    })
    .await;
    (plane, stop)
}

/// A proxy on `node` routing listener `web` to `shop/lazy`.
async fn proxy_on(plane: &ControlPlane, node: &str) -> (Proxy, std::net::SocketAddr) {
    proxy_with(plane, node, "").await
}

/// [`proxy_on`] with `peer` added to its `control:` settings.
async fn proxy_with(plane: &ControlPlane, node: &str, peer: &str) -> (Proxy, std::net::SocketAddr) {
    let yaml = format!(
        "node: {{ name: {node} }}\nadmin: {{ address: \"127.0.0.1:0\" }}\ncontrol: {{ address: \"{}\"{peer} }}\n\
         listeners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: lazy }}]\n\
         clusters:\n  - name: lazy\n    service: shop/lazy\n    activation: {{ queue_timeout: 15s, probe_interval: 5ms }}\n",
        plane.grpc_addr()
    );
    let p = Proxy::start(ProxyConfig::parse(&yaml, "proxy.yaml").unwrap())
        .await
        .unwrap();
    let addr = p.listener_addr("web").await.unwrap();
    (p, addr)
}

fn pods_metric(plane: &ControlPlane, event: &str) -> f64 {
    metric(
        &plane.state.metrics.encode(),
        &format!("meshless_control_kubernetes_node_local_pods_total{{event=\"{event}\"}}"),
    )
}

fn fallbacks(plane: &ControlPlane, reason: &str) -> f64 {
    metric(
        &plane.state.metrics.encode(),
        &format!("meshless_control_kubernetes_node_local_fallbacks_total{{reason=\"{reason}\"}}"),
    )
}

/// The node of the registry endpoint `id`.
fn endpoint_node(plane: &ControlPlane, id: &str) -> Option<String> {
    let view = plane.state.lock().view("shop/lazy")?;
    view.endpoints.into_iter().find(|e| e.id == id)?.node
}

const SLOW_DEPLOYMENT: Timing = Timing {
    deployment_start: NEVER,
    deployment_ready: NEVER,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pod_starts_on_the_asking_node_the_other_proxy_follows_and_zero_deletes_it() {
    let fake = Fake::start("asking", SLOW_DEPLOYMENT).await;
    let (plane, _stop) = plane(&fake, &control_yaml(&fake, "cp-1", true, 0)).await;
    let (a, addr_a) = proxy_on(&plane, "node-a").await;
    let (b, addr_b) = proxy_on(&plane, "node-b").await;
    eventually("both proxies subscribed", || async {
        metric(
            &plane.state.metrics.encode(),
            "meshless_control_subscribers",
        ) == 2.0
    })
    .await;

    // Proxy B asks: one Pod, from the template, bound to node-b, answers.
    let answered = routed(&client(), addr_b).await.expect("an answer");
    let pods = fake.bridges();
    assert_eq!(pods.len(), 1, "one bridge Pod");
    let pod = &pods[0];
    let name = pod.metadata.name.clone().unwrap();
    assert_eq!(answered, name, "the bridge Pod answered");
    assert!(name.starts_with("lazy-act-"), "{name}");
    let spec = pod.spec.clone().unwrap();
    assert_eq!(spec.node_name.as_deref(), Some("node-b"));
    assert_eq!(spec.containers[0].name, "app", "the template's spec");
    let owner = &pod.metadata.owner_references.clone().unwrap()[0];
    let uid = fake
        .api
        .get::<Deployment>("shop", "lazy")
        .unwrap()
        .metadata
        .uid;
    assert_eq!(
        (owner.kind.as_str(), Some(owner.uid.clone())),
        ("Deployment", uid)
    );
    assert_eq!(endpoint_node(&plane, &name).as_deref(), Some("node-b"));
    // The scale and the count end with the scale call, which the answer
    // need not wait for.
    eventually("the Deployment scaled too, the Pod counted", || async {
        fake.replicas() == Some(1) && pods_metric(&plane, "created") == 1.0
    })
    .await;

    // Proxy A's requests follow it: no second Pod.
    assert_eq!(
        routed(&client(), addr_a).await.as_deref(),
        Some(name.as_str())
    );
    assert_eq!(fake.bridges().len(), 1);

    // Idle: scale to zero deletes the Pod and zeroes the Deployment. The
    // count follows the delete call's answer, so it may trail the Pod's
    // removal from the API by a moment.
    eventually("scaled to zero, the Pod counted as deleted", || async {
        fake.bridges().is_empty()
            && fake.replicas() == Some(0)
            && pods_metric(&plane, "deleted") == 1.0
    })
    .await;
    eventually("the Pod's endpoint is gone", || async {
        endpoint_node(&plane, &name).is_none()
    })
    .await;
    a.shutdown().await;
    b.shutdown().await;
    plane.shutdown().await;
}

/// With `node_local`, a service at zero is placed ahead of time: a
/// request to the proxy on the other node is forwarded to the chosen
/// node's proxy, whose `Activate` puts the Pod on the chosen node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_puts_the_first_pod_on_the_chosen_node() {
    let fake = Fake::start("placed", SLOW_DEPLOYMENT).await;
    let (plane, _stop) = plane(&fake, &control_yaml(&fake, "cp-1", true, 0)).await;
    let (a, addr_a) = proxy_with(&plane, "node-a", ", peer_listener: web").await;
    let (b, addr_b) = proxy_with(&plane, "node-b", ", peer_listener: web").await;
    let placed = |p: &Proxy| p.state().placements.list().first().map(|x| x.1.clone());
    eventually("both proxies hear one placement", || async {
        placed(&a).is_some() && placed(&a) == placed(&b)
    })
    .await;
    let chosen = placed(&a).unwrap();
    let other = if chosen == "node-a" { addr_b } else { addr_a };
    let answered = routed(&client(), other).await.expect("an answer");
    let pods = fake.bridges();
    assert_eq!(pods.len(), 1);
    assert_eq!(pods[0].metadata.name.as_deref(), Some(answered.as_str()));
    let node = pods[0].spec.clone().unwrap().node_name;
    assert_eq!(node.as_deref(), Some(chosen.as_str()), "on the chosen node");
    eventually("the placement withdrawn", || async {
        placed(&a).is_none() && placed(&b).is_none()
    })
    .await;
    a.shutdown().await;
    b.shutdown().await;
    plane.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_is_handed_over_once_the_deployments_pod_is_ready() {
    let fake = Fake::start(
        "handover",
        Timing {
            deployment_start: Duration::from_millis(300),
            deployment_ready: Duration::from_millis(300),
        },
    )
    .await;
    let (plane, _stop) = plane(&fake, &control_yaml(&fake, "cp-1", true, 0)).await;
    let (b, addr_b) = proxy_on(&plane, "node-b").await;
    assert!(routed(&client(), addr_b).await.is_some());
    eventually("the bridge handed over", || async {
        pods_metric(&plane, "handed_over") == 1.0
    })
    .await;
    assert!(fake.bridges().is_empty(), "deleted");
    assert_eq!(fake.replicas(), Some(1), "the Deployment keeps its Pod");
    eventually("the Deployment's Pod serves", || async {
        routed(&client(), addr_b).await.as_deref() == Some("lazy-1")
    })
    .await;
    b.shutdown().await;
    plane.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_plane_adopts_the_pod_instead_of_creating_another() {
    let fake = Fake::start("adopt", SLOW_DEPLOYMENT).await;
    let (first, stop_first) = plane(&fake, &control_yaml(&fake, "cp-1", true, 0)).await;
    let (b, addr_b) = proxy_on(&first, "node-b").await;
    let answered = routed(&client(), addr_b).await.expect("an answer");
    b.shutdown().await;
    let _ = stop_first.send(true);
    first.shutdown().await;

    // The successor keeps one instance (min 1): its first decision scales
    // above zero, which lists and adopts the Pod.
    let (second, _stop) = plane(&fake, &control_yaml(&fake, "cp-2", true, 1)).await;
    eventually("the Pod adopted", || async {
        pods_metric(&second, "adopted") == 1.0
    })
    .await;
    let target = ScaleTarget {
        resource: "deployments".into(),
        name: "lazy".into(),
        namespace: None,
        node_local: true,
    };
    let request = |replicas, node| ScaleRequest {
        service: "shop/lazy",
        namespace: "shop",
        target: &target,
        replicas,
        node,
    };
    let scaler = Arc::clone(second.state.replica_scaler.get().unwrap());
    // Even asked from zero on another node: no second Pod.
    assert_eq!(
        scaler.scale(request(1, Some("node-a"))).await,
        Ok(ScaleOutcome::Scaled)
    );
    let names: Vec<Option<String>> = fake
        .bridges()
        .into_iter()
        .map(|p| p.metadata.name)
        .collect();
    assert_eq!(names, [Some(answered)]);
    assert_eq!(pods_metric(&second, "created"), 0.0);
    assert_eq!(pods_metric(&second, "adopted"), 1.0, "counted once");
    assert_eq!(
        scaler.scale(request(0, None)).await,
        Ok(ScaleOutcome::Scaled)
    );
    assert!(fake.bridges().is_empty());
    assert_eq!(pods_metric(&second, "deleted"), 1.0);
    second.shutdown().await;
}

/// A cold start through a proxy on `node` with the Deployment's Pod
/// starting at once and Pod creates answering `refuse`: which Pod
/// answered, once the fallback for `reason` is counted, and the API calls.
async fn cold_start_falling_back(
    name: &str,
    node: &str,
    refuse: Option<u16>,
    reason: &str,
) -> (String, Vec<String>) {
    let fake = Fake::start(
        name,
        Timing {
            deployment_start: Duration::ZERO,
            deployment_ready: NEVER,
        },
    )
    .await;
    fake.api.refuse_creates("pods", refuse);
    let (plane, _stop) = plane(&fake, &control_yaml(&fake, "cp-1", true, 0)).await;
    let (p, addr) = proxy_on(&plane, node).await;
    let answered = routed(&client(), addr).await.expect("an answer");
    eventually("the fallback counted", || async {
        fallbacks(&plane, reason) == 1.0
    })
    .await;
    assert!(fake.bridges().is_empty(), "no bridge Pod");
    assert_eq!(fake.replicas(), Some(1));
    let calls = fake.calls_since(0);
    p.shutdown().await;
    plane.shutdown().await;
    (answered, calls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_pod_falls_back_to_the_deployment() {
    for (code, reason) in [(403, "forbidden"), (422, "invalid"), (409, "conflict")] {
        let (answered, calls) =
            cold_start_falling_back(&format!("refused-{code}"), "node-b", Some(code), reason).await;
        assert_eq!(answered, "lazy-1", "the Deployment's Pod answered ({code})");
        assert!(
            calls
                .iter()
                .any(|c| c.starts_with("POST /api/v1/namespaces/shop/pods")),
            "{calls:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_node_falls_back_without_creating_a_pod() {
    let (answered, calls) =
        cold_start_falling_back("unknown", "node-x", None, "node_unknown").await;
    assert_eq!(answered, "lazy-1");
    assert!(
        calls
            .iter()
            .any(|c| c.starts_with("GET /api/v1/nodes/node-x")),
        "{calls:?}"
    );
    assert!(
        !calls
            .iter()
            .any(|c| c.starts_with("POST /api/v1/namespaces/shop/pods")),
        "nothing created: {calls:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_deployment_deletes_its_bridge_pod() {
    let fake = Fake::start("owner", SLOW_DEPLOYMENT).await;
    let (plane, _stop) = plane(&fake, &control_yaml(&fake, "cp-1", true, 0)).await;
    let (b, addr_b) = proxy_on(&plane, "node-b").await;
    assert!(routed(&client(), addr_b).await.is_some());
    assert_eq!(fake.bridges().len(), 1);
    fake.api.delete::<Deployment>("shop", "lazy");
    assert!(fake.bridges().is_empty(), "the owner's cascade");
    b.shutdown().await;
    plane.shutdown().await;
}

/// The API calls of the Pod path's scale call from zero, sorted (the
/// bridge list, the Node and the Deployment read together, then the
/// create; the scale alongside).
const POD_PATH_CALLS: [&str; 5] = [
    "GET /api/v1/namespaces/shop/pods",
    "GET /api/v1/nodes/node-b",
    "GET /apis/apps/v1/namespaces/shop/deployments/lazy",
    "PATCH /apis/apps/v1/namespaces/shop/deployments/lazy/scale",
    "POST /api/v1/namespaces/shop/pods",
];

/// One cold start from a proxy on node-b in a fresh cluster, through the
/// Pod path or the Deployment path: the time from the request to its
/// answer. Asserts which Pod answered and the API calls made.
async fn cold_start(node_local: bool, run: usize) -> Duration {
    let timing = match node_local {
        true => SLOW_DEPLOYMENT,
        false => Timing {
            deployment_start: Duration::ZERO,
            deployment_ready: NEVER,
        },
    };
    let fake = Fake::start(&format!("paths-{run}"), timing).await;
    let (plane, _stop) = plane(&fake, &control_yaml(&fake, "cp-1", node_local, 0)).await;
    let (p, addr) = proxy_on(&plane, "node-b").await;
    let client = client();
    let from = fake.api.requests().len();
    let sent = Instant::now();
    let answered = routed(&client, addr).await.expect("an answer");
    let took = sent.elapsed();
    // The scale call's requests (the answer need not wait for all).
    eventually("the scale call done", || async {
        fake.calls_since(from).iter().any(|c| c.contains("/scale"))
    })
    .await;
    let mut calls: Vec<String> = fake
        .calls_since(from)
        .into_iter()
        .filter(|c| !c.contains("/leases/"))
        .map(|c| c.split('?').next().unwrap_or_default().to_owned())
        .collect();
    calls.sort();
    if node_local {
        assert!(answered.starts_with("lazy-act-"), "{answered}");
        assert_eq!(calls, POD_PATH_CALLS);
    } else {
        assert_eq!(answered, "lazy-1");
        assert_eq!(calls, [POD_PATH_CALLS[3]]);
    }
    p.shutdown().await;
    plane.shutdown().await;
    took
}

fn summary(label: &str, mut times: Vec<Duration>) -> String {
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    format!(
        "{label}: runs {}, request -> answer min {:.1} ms, median {:.1} ms, max {:.1} ms",
        times.len(),
        ms(times[0]),
        ms(times[times.len() / 2]),
        ms(times[times.len() - 1]),
    )
}

/// Time from a request that starts a cold start to its answer, for the
/// node-local Pod path and the Deployment path, runs interleaved, on the
/// fake (debug build; no controller, scheduler or image-pull latency is
/// modelled, so the difference is the scaler's own API calls). Prints the
/// figures; asserts only which Pod answers and the API calls each path
/// makes. `MESHLESS_COLD_RUNS` sets the runs per path (default 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_paths_measured_side_by_side() {
    let runs: usize = std::env::var("MESHLESS_COLD_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
        .max(1);
    let (mut pod, mut deployment) = (Vec::new(), Vec::new());
    for run in 0..runs {
        pod.push(cold_start(true, run).await);
        deployment.push(cold_start(false, run).await);
    }
    eprintln!(
        "{}\n{}",
        summary("pod", pod),
        summary("deployment", deployment)
    );
}
