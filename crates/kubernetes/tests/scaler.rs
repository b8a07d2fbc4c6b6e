//! `scaler: kubernetes` and leader election against the fake API server:
//! a Deployment scaled from zero by the first request through a real
//! proxy, and two control planes of which only the Lease holder scales.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use meshless_control::config::{ControlConfig, ControlConfigError};
use meshless_control::kubernetes::{ScaleOutcome, ScaleRequest, ScaleTarget};
use meshless_control::plane::ControlPlane;
use meshless_kubernetes::fake_api::FakeApiServer;
use meshless_kubernetes::fake_api::workloads::{self, Workload, deployment};
use meshless_kubernetes::objects::service;
use meshless_proxy::{Proxy, ProxyConfig};
use tokio::sync::watch;

/// A control plane file: `shop/lazy` autoscaled through Deployment `lazy`.
fn control_yaml(kubeconfig: &std::path::Path, identity: &str) -> String {
    format!(
        "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\n\
         kubernetes:\n  kubeconfig: \"{}\"\n  namespaces: [shop]\n  leader_election:\n    namespace: shop\n    identity: {identity}\n    lease_duration: 4s\n    retry_period: 200ms\n\
         services:\n  - namespace: shop\n    name: lazy\n    autoscaling:\n      min_instances: 0\n      max_instances: 2\n      tick: 100ms\n      scaler:\n        kubernetes: {{ name: lazy }}\n",
        kubeconfig.display()
    )
}

async fn plane(
    yaml: &str,
) -> (
    ControlPlane,
    watch::Sender<bool>,
    Vec<tokio::task::JoinHandle<()>>,
) {
    let config = ControlConfig::parse(yaml, "control.yaml").unwrap();
    let plane = ControlPlane::start(config.clone()).await.unwrap();
    let (stop, stopped) = watch::channel(false);
    let tasks =
        meshless_kubernetes::start(plane.state.clone(), config.kubernetes.unwrap(), stopped)
            .await
            .unwrap();
    (plane, stop, tasks)
}

async fn fake_with_lazy() -> Arc<FakeApiServer> {
    let fake = Arc::new(
        FakeApiServer::start("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap(),
    );
    fake.apply(&service("shop", "lazy", &[("http", 80)]));
    fake.apply(&deployment("shop", "lazy", 0));
    fake
}

fn is_leader(p: &ControlPlane) -> bool {
    metric(
        &p.state.metrics.encode(),
        "meshless_control_kubernetes_leader",
    ) == 1.0
}

#[test]
fn the_kubernetes_scaler_needs_the_kubernetes_section() {
    let yaml = control_yaml(std::path::Path::new("/k"), "a");
    let without: String = yaml
        .split("services:")
        .nth(1)
        .map(|s| format!("services:{s}"))
        .unwrap();
    match ControlConfig::parse(&without, "c.yaml") {
        Err(ControlConfigError::Invalid { error, .. }) => {
            assert_eq!(error.path, "services[0].autoscaling.scaler.kubernetes");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_request_scales_a_deployment_from_zero() {
    let fake = fake_with_lazy().await;
    let dir = temp_dir("scale");
    let kubeconfig = dir.path().join("kubeconfig");
    fake.write_kubeconfig(&kubeconfig).unwrap();
    let (stop_pods, pods_stopped) = watch::channel(false);
    let workload = Workload {
        namespace: "shop".into(),
        deployment: "lazy".into(),
        service: "lazy".into(),
        // Longer than any cold start here: the proxy answers by probing the
        // not-ready pod directly, before the "kubelet" marks it ready.
        start_after: Duration::ZERO,
        ready_after: Duration::from_secs(30),
        drain: Duration::from_millis(200),
    };
    let follower = tokio::spawn(workloads::follow(Arc::clone(&fake), workload, pods_stopped));
    let (plane, stop, _tasks) = plane(&control_yaml(&kubeconfig, "cp-1")).await;
    eventually("this replica leads", || async { is_leader(&plane) }).await;

    let (proxy, addr) = lazy_proxy(plane.grpc_addr()).await;
    // The service is known (with no endpoint) before the request is sent.
    eventually("the service reaches the registry", || async {
        plane.state.lock().view("shop/lazy").is_some()
    })
    .await;
    assert_eq!(routed(&client(), addr).await.as_deref(), Some("lazy-1"));
    let replicas = fake
        .get::<Deployment>("shop", "lazy")
        .and_then(|d| d.spec?.replicas);
    assert_eq!(replicas, Some(1));
    assert!(
        fake.requests()
            .iter()
            .any(|r| r.starts_with("PATCH /apis/apps/v1/namespaces/shop/deployments/lazy/scale")),
        "{:?}",
        fake.requests()
    );
    let view = plane.state.lock().view("shop/lazy").unwrap();
    assert!(
        !view.endpoints[0].conditions.ready,
        "answered before the pod was marked ready"
    );
    let _ = stop.send(true);
    let _ = stop_pods.send(true);
    follower.await.unwrap();
    proxy.shutdown().await;
    plane.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_lease_holder_scales_and_the_other_takes_over_when_it_dies() {
    let fake = fake_with_lazy().await;
    let dir = temp_dir("leader");
    let kubeconfig = dir.path().join("kubeconfig");
    fake.write_kubeconfig(&kubeconfig).unwrap();
    let (a, _stop_a, tasks_a) = plane(&control_yaml(&kubeconfig, "cp-a")).await;
    eventually("cp-a leads", || async { is_leader(&a) }).await;
    let (b, stop_b, _tasks_b) = plane(&control_yaml(&kubeconfig, "cp-b")).await;
    // b has tried at least once: the Lease has been read since b started.
    let reads = fake.requests().len();
    eventually("cp-b tries the Lease", || async {
        fake.requests()[reads..]
            .iter()
            .any(|r| r.contains("/leases/meshless-control"))
    })
    .await;
    assert!(is_leader(&a) && !is_leader(&b), "one leader");

    let target = ScaleTarget {
        resource: "deployments".into(),
        name: "lazy".into(),
        namespace: None,
        node_local: false,
    };
    let scale = |p: &ControlPlane| Arc::clone(p.state.replica_scaler.get().unwrap());
    let to = |replicas| ScaleRequest {
        service: "shop/lazy",
        namespace: "shop",
        target: &target,
        replicas,
        node: None,
    };
    assert_eq!(scale(&b).scale(to(2)).await, Ok(ScaleOutcome::NotLeader));
    assert_eq!(scale(&a).scale(to(2)).await, Ok(ScaleOutcome::Scaled));
    assert_eq!(
        fake.get::<Deployment>("shop", "lazy")
            .and_then(|d| d.spec?.replicas),
        Some(2)
    );

    // a dies without releasing the Lease: b takes over once the record has
    // not changed for the lease duration.
    for t in tasks_a {
        t.abort();
    }
    eventually("cp-b takes over", || async { is_leader(&b) }).await;
    let lease = fake
        .get::<Lease>("shop", "meshless-control")
        .unwrap()
        .spec
        .unwrap();
    assert_eq!(lease.holder_identity.as_deref(), Some("cp-b"));
    assert_eq!(lease.lease_transitions, Some(1));
    assert_eq!(scale(&b).scale(to(0)).await, Ok(ScaleOutcome::Scaled));

    // A clean stop releases the Lease at once.
    let _ = stop_b.send(true);
    eventually("cp-b releases", || async {
        fake.get::<Lease>("shop", "meshless-control")
            .and_then(|l| l.spec?.holder_identity)
            .is_none()
    })
    .await;
    drop(a);
}

/// K8: a control plane that starts (or restarts) while a Deployment runs
/// 3 replicas has no sample of its load: unknown, not idle. It writes no
/// scale-down before a full stable window and scale-to-zero grace of
/// samples (4 s here), then, still without load, scales it to zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starting_plane_scales_nothing_down_before_a_full_window() {
    let fake = Arc::new(
        FakeApiServer::start("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap(),
    );
    fake.apply(&service("shop", "web", &[("http", 80)]));
    fake.apply(&deployment("shop", "web", 3));
    let dir = temp_dir("warm");
    let kubeconfig = dir.path().join("kubeconfig");
    fake.write_kubeconfig(&kubeconfig).unwrap();
    let (stop_pods, pods_stopped) = watch::channel(false);
    let workload = Workload {
        namespace: "shop".into(),
        deployment: "web".into(),
        service: "web".into(),
        start_after: Duration::ZERO,
        ready_after: Duration::ZERO,
        drain: Duration::from_millis(100),
    };
    let follower = tokio::spawn(workloads::follow(Arc::clone(&fake), workload, pods_stopped));
    eventually("three pods run", || async {
        fake.list::<k8s_openapi::api::discovery::v1::EndpointSlice>("shop")
            .len()
            == 3
    })
    .await;
    let window = Duration::from_secs(4);
    let yaml = format!(
        "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\n\
         kubernetes:\n  kubeconfig: \"{}\"\n  namespaces: [shop]\n  leader_election:\n    namespace: shop\n    identity: cp-w\n    lease_duration: 4s\n    retry_period: 200ms\n\
         services:\n  - namespace: shop\n    name: web\n    autoscaling:\n      min_instances: 0\n      max_instances: 5\n      target_concurrency: 10.0\n      stable_window: 4s\n      panic_window: 1s\n      scale_to_zero_after: 2s\n      tick: 100ms\n      scaler:\n        kubernetes: {{ name: web }}\n",
        kubeconfig.display()
    );
    let replicas = || {
        fake.get::<Deployment>("shop", "web")
            .and_then(|d| d.spec?.replicas)
    };
    let started = std::time::Instant::now();
    let (plane, stop, _tasks) = plane(&yaml).await;
    let first_write = loop {
        if replicas() != Some(3) {
            break started.elapsed();
        }
        assert!(started.elapsed() < window + DEADLINE, "never scaled down");
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    // The plane started after `started`, and the change was seen after it
    // was written: this is at least the time the plane had observed.
    assert!(
        first_write >= window,
        "scaled to {:?} after {first_write:?}, before a full window of samples",
        replicas()
    );
    assert!(is_leader(&plane));
    eventually("scaled to zero without load", || async {
        replicas() == Some(0)
    })
    .await;
    let _ = stop.send(true);
    let _ = stop_pods.send(true);
    follower.await.unwrap();
    plane.shutdown().await;
}

/// A proxy on `grpc`'s control plane routing to `shop/lazy`, holding
/// requests while it has no instance.
async fn lazy_proxy(grpc: std::net::SocketAddr) -> (Proxy, std::net::SocketAddr) {
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ncontrol: {{ address: \"{grpc}\" }}\n\
         listeners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: lazy }}]\n\
         clusters:\n  - name: lazy\n    service: shop/lazy\n    activation: {{ queue_timeout: 15s, probe_interval: 5ms }}\n"
    );
    let proxy = Proxy::start(ProxyConfig::parse(&yaml, "proxy.yaml").unwrap())
        .await
        .unwrap();
    let addr = proxy.listener_addr("web").await.unwrap();
    (proxy, addr)
}

/// K7: two replicas, the proxy connected to the follower. Its activation
/// request and load reach the leader (the follower forwards them to the
/// address the leader wrote in the Lease), which scales the Deployment
/// from zero: the held request is answered by the new pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_on_the_follower_scales_from_zero_through_the_leader() {
    let fake = fake_with_lazy().await;
    let dir = temp_dir("follower");
    let kubeconfig = dir.path().join("kubeconfig");
    fake.write_kubeconfig(&kubeconfig).unwrap();
    let (stop_pods, pods_stopped) = watch::channel(false);
    let workload = Workload {
        namespace: "shop".into(),
        deployment: "lazy".into(),
        service: "lazy".into(),
        start_after: Duration::ZERO,
        ready_after: Duration::from_secs(30),
        drain: Duration::from_millis(200),
    };
    let follower = tokio::spawn(workloads::follow(Arc::clone(&fake), workload, pods_stopped));
    let (a, stop_a, _tasks_a) = plane(&control_yaml(&kubeconfig, "cp-a")).await;
    eventually("cp-a leads", || async { is_leader(&a) }).await;
    let (b, stop_b, _tasks_b) = plane(&control_yaml(&kubeconfig, "cp-b")).await;
    let b_scaler = Arc::clone(b.state.replica_scaler.get().unwrap());
    eventually("cp-b reads the leader's address", || async {
        b_scaler.leader_api().is_some()
    })
    .await;
    assert_eq!(
        b_scaler.leader_api(),
        Some((a.api_addr().to_string(), "cp-b".to_owned()))
    );
    assert!(!is_leader(&b));

    let (proxy, addr) = lazy_proxy(b.grpc_addr()).await;
    eventually("the service reaches cp-b's registry", || async {
        b.state.lock().view("shop/lazy").is_some()
    })
    .await;
    assert_eq!(routed(&client(), addr).await.as_deref(), Some("lazy-1"));
    assert_eq!(
        fake.get::<Deployment>("shop", "lazy")
            .and_then(|d| d.spec?.replicas),
        Some(1)
    );
    let writes = |p: &ControlPlane| {
        metric(
            &p.state.metrics.encode(),
            "meshless_control_kubernetes_scale_writes_total",
        )
    };
    assert!(writes(&a) >= 1.0, "the leader scaled");
    assert_eq!(writes(&b), 0.0, "the follower did not");
    let _ = stop_a.send(true);
    let _ = stop_b.send(true);
    let _ = stop_pods.send(true);
    follower.await.unwrap();
    proxy.shutdown().await;
    a.shutdown().await;
    b.shutdown().await;
}

/// A TCP relay to `to` that stops forwarding, both ways, once `frozen` is
/// set, keeping every socket open: an API server whose answers stop (a
/// partition, a blackholed load balancer) without any error.
async fn freezable_relay(
    to: std::net::SocketAddr,
    frozen: Arc<std::sync::atomic::AtomicBool>,
) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((down, _)) = listener.accept().await {
            let frozen = Arc::clone(&frozen);
            tokio::spawn(async move {
                let Ok(up) = tokio::net::TcpStream::connect(to).await else {
                    return;
                };
                let (dr, dw) = down.into_split();
                let (ur, uw) = up.into_split();
                tokio::join!(pipe(dr, uw, Arc::clone(&frozen)), pipe(ur, dw, frozen));
            });
        }
    });
    addr
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.load(std::sync::atomic::Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// K4: the leader's path to the API server stalls (requests sent, never
/// answered). Its round is bounded by the renew deadline, so it stops
/// leading, while the other replica takes the Lease over: never two
/// leaders for long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_api_calls_hang_stops_leading() {
    let fake = fake_with_lazy().await;
    let dir = temp_dir("hang");
    let direct = dir.path().join("kubeconfig");
    fake.write_kubeconfig(&direct).unwrap();
    let frozen = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let to = fake.url().trim_start_matches("http://").parse().unwrap();
    let via = freezable_relay(to, Arc::clone(&frozen)).await;
    let relayed = dir.path().join("kubeconfig-relayed");
    let text = std::fs::read_to_string(&direct).unwrap();
    std::fs::write(
        &relayed,
        text.replace(&fake.url(), &format!("http://{via}")),
    )
    .unwrap();
    let (a, _stop_a, _tasks_a) = plane(&control_yaml(&relayed, "cp-a")).await;
    eventually("cp-a leads", || async { is_leader(&a) }).await;
    let (b, stop_b, _tasks_b) = plane(&control_yaml(&direct, "cp-b")).await;

    frozen.store(true, std::sync::atomic::Ordering::SeqCst);
    eventually("cp-b takes over", || async { is_leader(&b) }).await;
    eventually("cp-a stops leading", || async { !is_leader(&a) }).await;
    let holder = fake
        .get::<Lease>("shop", "meshless-control")
        .and_then(|l| l.spec?.holder_identity);
    assert_eq!(holder.as_deref(), Some("cp-b"));
    let _ = stop_b.send(true);
    drop(a);
}

/// A Deployment scaled to zero behind the scaler's back (`kubectl scale`,
/// a GitOps sync) while its decision stays 1: the next held request makes
/// it set the replicas again, although its decision did not change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_changed_behind_the_scalers_back_are_set_again() {
    let fake = fake_with_lazy().await;
    let dir = temp_dir("reassert");
    let kubeconfig = dir.path().join("kubeconfig");
    fake.write_kubeconfig(&kubeconfig).unwrap();
    let (stop_pods, pods_stopped) = watch::channel(false);
    let workload = Workload {
        namespace: "shop".into(),
        deployment: "lazy".into(),
        service: "lazy".into(),
        start_after: Duration::ZERO,
        ready_after: Duration::from_millis(200),
        drain: Duration::from_millis(200),
    };
    let follower = tokio::spawn(workloads::follow(Arc::clone(&fake), workload, pods_stopped));
    let (plane, stop, _tasks) = plane(&control_yaml(&kubeconfig, "cp-1")).await;
    eventually("this replica leads", || async { is_leader(&plane) }).await;
    let (proxy, addr) = lazy_proxy(plane.grpc_addr()).await;
    eventually("the service reaches the registry", || async {
        plane.state.lock().view("shop/lazy").is_some()
    })
    .await;
    assert!(routed(&client(), addr).await.is_some(), "scaled from zero");
    let replicas = || {
        fake.get::<Deployment>("shop", "lazy")
            .and_then(|d| d.spec?.replicas)
    };
    assert_eq!(replicas(), Some(1));
    // The proxy's load report that came with the activation (held: 1)
    // is replaced by one without it (reports go every second): else the
    // scaler, still seeing a held request with nothing running, sets the
    // replicas again before the pod is even gone.
    eventually("no request held, for the plane", || async {
        plane.state.distributor.load("shop/lazy") == (0, 0)
    })
    .await;
    // Scaled to zero behind its back; its pod goes.
    assert!(fake.update::<Deployment>("shop", "lazy", |d| {
        if let Some(s) = d.spec.as_mut() {
            s.replicas = Some(0);
        }
    }));
    eventually("the pod is gone, for the proxy too", || async {
        let gone = plane
            .state
            .lock()
            .view("shop/lazy")
            .is_some_and(|v| v.endpoints.is_empty());
        gone && proxy
            .state()
            .service_feeds()
            .get("shop/lazy")
            .is_none_or(|f| f.endpoints.is_empty())
    })
    .await;
    assert!(routed(&client(), addr).await.is_some(), "set to 1 again");
    assert_eq!(replicas(), Some(1));
    let _ = stop.send(true);
    let _ = stop_pods.send(true);
    follower.await.unwrap();
    proxy.shutdown().await;
    plane.shutdown().await;
}
