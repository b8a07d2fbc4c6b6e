//! A control plane that restarts: what it serves before, while and after
//! its Kubernetes source lists again. The fake API server, real control
//! planes (the second one on the first one's gRPC address, as a restarted
//! pod behind a Service would be) and a real proxy; all on 127.0.0.1.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use common::*;
use http::{Method, StatusCode};
use meshless_control::config::ControlConfig;
use meshless_control::kubernetes::KubernetesSource;
use meshless_control::plane::{ControlPlane, PlaneError};
use meshless_control::store::{Loaded, Storage, Store, StoreError, WriteBatch};
use meshless_kubernetes::fake_api::FakeApiServer;
use meshless_kubernetes::objects::{PodState, service};
use tokio::sync::watch;

/// A control plane watching the fake through `kubeconfig`, with its gRPC
/// server on `grpc` (retried while the last plane's port is still held).
async fn start_plane(
    kubeconfig: &Path,
    grpc: SocketAddr,
    data_dir: Option<PathBuf>,
) -> (ControlPlane, watch::Sender<bool>) {
    let (source, mut config) = watching(kubeconfig);
    config.grpc_address = grpc;
    config.data_dir = data_dir;
    start_plane_on(config, source, || None).await
}

/// [`start_plane`] with the store `storage` makes (`None`: `data_dir`'s).
async fn start_plane_on(
    config: ControlConfig,
    source: KubernetesSource,
    storage: impl Fn() -> Option<Box<dyn Storage>>,
) -> (ControlPlane, watch::Sender<bool>) {
    let started = Instant::now();
    let plane = loop {
        let started_plane = match storage() {
            Some(store) => ControlPlane::start_with_storage(config.clone(), Some(store)).await,
            None => ControlPlane::start(config.clone()).await,
        };
        match started_plane {
            Ok(p) => break p,
            Err(PlaneError::Bind { .. }) if started.elapsed() < DEADLINE => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => panic!("control plane: {e}"),
        }
    };
    let (stop, stopped) = watch::channel(false);
    meshless_kubernetes::start(plane.state.clone(), source, stopped)
        .await
        .unwrap();
    (plane, stop)
}

async fn stop_plane(plane: ControlPlane, stop: watch::Sender<bool>) {
    let _ = stop.send(true);
    plane.shutdown().await;
}

/// `/ready`'s status.
async fn ready(plane: &ControlPlane) -> StatusCode {
    let url = format!("http://{}/ready", plane.api_addr());
    send(&client(), Method::GET, &url, "").await.0
}

async fn fake_with_kubeconfig(name: &str) -> (FakeApiServer, tempfile::TempDir, PathBuf) {
    let fake = FakeApiServer::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let dir = temp_dir(name);
    let kubeconfig = dir.path().join("kubeconfig");
    fake.write_kubeconfig(&kubeconfig).unwrap();
    (fake, dir, kubeconfig)
}

/// K3: a plane restarted while the API server is unreachable has listed
/// nothing; it is not Ready and sends no snapshot (which would be an empty
/// reset of `shop/cart`), so the proxy keeps routing to the pod it knew.
/// Once the API server is back it lists, becomes Ready, and the stream
/// carries what changed meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_plane_serves_no_snapshot_before_it_has_listed() {
    let (a, b) = (pod("a").await, pod("b").await);
    let (fake, _dir, kubeconfig) = fake_with_kubeconfig("restart").await;
    fake.apply(&service("shop", "cart", &[("http", 80)]));
    fake.apply(&pod_slice("cart", &a, PodState::Ready));
    let (plane, stop) = start_plane(&kubeconfig, "127.0.0.1:0".parse().unwrap(), None).await;
    let grpc = plane.grpc_addr();
    eventually("the first plane is ready", || async {
        ready(&plane).await == StatusCode::OK
    })
    .await;
    let (proxy, addr) = proxy(grpc).await;
    wait_holds(&proxy, &[&a], "the first plane's list").await;

    fake.set_down(true);
    stop_plane(plane, stop).await;
    let (plane, stop) = start_plane(&kubeconfig, grpc, None).await;
    eventually("the proxy's stream reaches the new plane", || async {
        plane.state.metrics.subscribers.get() >= 1
    })
    .await;
    eventually("the new plane fails to list", || async {
        metric(
            &plane.state.metrics.encode(),
            "meshless_control_kubernetes_errors_total",
        ) >= 1.0
    })
    .await;
    assert_eq!(ready(&plane).await, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        answering(&client(), addr, 20).await,
        Some(vec!["a".to_owned()]),
        "static stability: the proxy keeps its endpoints"
    );
    assert_eq!(plane.state.metrics.snapshots.get(), 0, "no snapshot yet");

    fake.apply(&pod_slice("cart", &b, PodState::Ready));
    fake.set_down(false);
    eventually("the new plane is ready once listed", || async {
        ready(&plane).await == StatusCode::OK
    })
    .await;
    wait_holds(&proxy, &[&a, &b], "the new plane's snapshot").await;
    stop_plane(plane, stop).await;
}

/// K1: with `data_dir`, a restarted plane starts from its store; the pods
/// that left while it was down (their slices replaced) must leave the
/// registry once it has listed, not stay forever beside the new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_gone_while_the_plane_was_down_leave_the_registry() {
    let (a, b) = (pod("a").await, pod("b").await);
    let (fake, dir, kubeconfig) = fake_with_kubeconfig("data").await;
    let data = dir.path().join("data");
    fake.apply(&service("shop", "cart", &[("http", 80)]));
    fake.apply(&pod_slice("cart", &a, PodState::Ready));
    let ids = |plane: &ControlPlane| -> Vec<String> {
        plane
            .state
            .lock()
            .view("shop/cart")
            .map(|v| v.endpoints.into_iter().map(|e| e.id).collect())
            .unwrap_or_default()
    };
    let any = "127.0.0.1:0".parse().unwrap();
    let (plane, stop) = start_plane(&kubeconfig, any, Some(data.clone())).await;
    eventually("pod a is listed", || async { ids(&plane) == ["a"] }).await;
    stop_plane(plane, stop).await;

    fake.delete::<k8s_openapi::api::discovery::v1::EndpointSlice>("shop", "cart-a");
    fake.apply(&pod_slice("cart", &b, PodState::Ready));
    let (plane, stop) = start_plane(&kubeconfig, any, Some(data)).await;
    eventually("the plane lists again", || async {
        ready(&plane).await == StatusCode::OK
    })
    .await;
    assert_eq!(
        ids(&plane),
        ["b"],
        "a left Kubernetes while the plane was down"
    );
    stop_plane(plane, stop).await;
}

/// A real store that refuses every write while `fail` is set.
#[derive(Debug)]
struct Flaky {
    inner: Store,
    fail: Arc<AtomicBool>,
}

impl Storage for Flaky {
    fn load(&self) -> Result<Loaded, StoreError> {
        self.inner.load()
    }

    fn apply_group(&self, batches: &[WriteBatch]) -> Result<(), StoreError> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(StoreError::Io("injected: no space left on device".into()));
        }
        self.inner.apply_group(batches)
    }
}

/// K6: writes the store refused are retried without waiting for another
/// event of the service: a slice change, then the Service's deletion, each
/// made while the store fails, reach the registry once it works again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_the_store_refused_are_retried_without_a_new_event() {
    let (a, b) = (pod("a").await, pod("b").await);
    let (fake, dir, kubeconfig) = fake_with_kubeconfig("retry").await;
    fake.apply(&service("shop", "cart", &[("http", 80)]));
    fake.apply(&pod_slice("cart", &a, PodState::Ready));
    let (source, config) = watching(&kubeconfig);
    let fail = Arc::new(AtomicBool::new(false));
    let data = dir.path().join("data");
    let (plane, stop) = start_plane_on(config, source, || {
        Some(Box::new(Flaky {
            inner: Store::open(&data).unwrap(),
            fail: Arc::clone(&fail),
        }))
    })
    .await;
    let ids = || -> Option<Vec<String>> {
        plane
            .state
            .lock()
            .view("shop/cart")
            .map(|v| v.endpoints.into_iter().map(|e| e.id).collect())
    };
    eventually("pod a is listed", || async {
        ids() == Some(vec!["a".into()])
    })
    .await;

    fail.store(true, Ordering::SeqCst);
    let refused = plane.state.metrics.rejected_writes.get();
    fake.apply(&pod_slice("cart", &b, PodState::Ready));
    eventually("the store refuses the write", || async {
        plane.state.metrics.rejected_writes.get() > refused
    })
    .await;
    assert_eq!(ids(), Some(vec!["a".into()]), "nothing written");
    fail.store(false, Ordering::SeqCst);
    eventually("the write is retried", || async {
        ids() == Some(vec!["a".into(), "b".into()])
    })
    .await;

    fail.store(true, Ordering::SeqCst);
    fake.delete::<k8s_openapi::api::core::v1::Service>("shop", "cart");
    let owner = || plane.state.lock().owner("shop/cart").map(str::to_owned);
    // The delete fails: the service stays, still read-only (claimed).
    let deletes = fake.requests().len();
    eventually("the deletion is seen", || async {
        metric(
            &plane.state.metrics.encode(),
            "meshless_control_kubernetes_events_total{resource=\"service\",event=\"delete\"}",
        ) >= 1.0
    })
    .await;
    assert!(
        ids().is_some() && owner().is_some(),
        "{:?}",
        fake.requests().get(deletes..)
    );
    fail.store(false, Ordering::SeqCst);
    eventually("the removal is retried", || async { ids().is_none() }).await;
    stop_plane(plane, stop).await;
}
