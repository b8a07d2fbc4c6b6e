//! Helpers: the fake API server, a control plane watching it through a
//! kubeconfig file, real backends (one per "pod") and a real proxy
//! subscribed to the control plane; all on 127.0.0.1, port 0.
#![allow(dead_code, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use meshless_backend::{Backend, BackendConfig};
use meshless_control::config::ControlConfig;
use meshless_control::kubernetes::KubernetesSource;
use meshless_control::plane::ControlPlane;
use meshless_kubernetes::fake_api::FakeApiServer;
use meshless_kubernetes::objects::{PodState, pod_endpoint, slice};
use meshless_proxy::{Proxy, ProxyConfig};
use tokio::sync::watch;

/// A generous deadline for a condition on a busy 2-core machine.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// Polls `ok` every 25 ms until it holds; panics after [`DEADLINE`].
pub async fn eventually<F, Fut>(what: &str, mut ok: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !ok().await {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A directory of its own under the system temp dir, removed on drop.
pub fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("meshless-kube-{name}-"))
        .tempdir()
        .unwrap()
}

/// A Kubernetes source reading `kubeconfig`, and a control plane config
/// on free loopback ports that watches with it.
pub fn watching(kubeconfig: &std::path::Path) -> (KubernetesSource, ControlConfig) {
    let source = KubernetesSource {
        kubeconfig: Some(kubeconfig.to_owned()),
        ..KubernetesSource::default()
    };
    let config = ControlConfig {
        api_address: "127.0.0.1:0".parse().unwrap(),
        grpc_address: "127.0.0.1:0".parse().unwrap(),
        kubernetes: Some(source.clone()),
        ..ControlConfig::default()
    };
    (source, config)
}

/// The fake, a control plane watching it, and the source's stop switch.
pub struct Cluster {
    pub fake: FakeApiServer,
    pub plane: ControlPlane,
    pub stop: watch::Sender<bool>,
    /// Holds the kubeconfig; removed when the cluster is dropped.
    pub dir: tempfile::TempDir,
}

impl Cluster {
    /// Starts the fake API server and a control plane that watches it
    /// through a kubeconfig file; `setup` fills the fake first.
    pub async fn start(name: &str, setup: impl FnOnce(&FakeApiServer)) -> Self {
        let fake = FakeApiServer::start("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        setup(&fake);
        let dir = temp_dir(name);
        let kubeconfig = dir.path().join("kubeconfig");
        fake.write_kubeconfig(&kubeconfig).unwrap();
        let (source, config) = watching(&kubeconfig);
        let plane = ControlPlane::start(config).await.unwrap();
        let (stop, stopped) = watch::channel(false);
        meshless_kubernetes::start(plane.state.clone(), source, stopped)
            .await
            .unwrap();
        Self {
            fake,
            plane,
            stop,
            dir,
        }
    }

    /// The control plane's metric `series` (0 when absent).
    pub fn metric(&self, series: &str) -> f64 {
        metric(&self.plane.state.metrics.encode(), series)
    }
}

/// The value of `series` (name with labels, exactly) on a metrics page.
pub fn metric(page: &str, series: &str) -> f64 {
    page.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0.0)
}

/// A backend named like the pod it stands for.
pub async fn pod(name: &str) -> Backend {
    Backend::start(BackendConfig {
        name: name.into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        latency: Duration::ZERO,
        fail_rate: 0.0,
        startup_delay: Duration::ZERO,
    })
    .await
    .unwrap()
}

/// The slice holding one pod. Every backend listens on 127.0.0.1 with a
/// port of its own, so each pod gets its own slice (as pods whose named
/// target port resolves to different numbers do).
pub fn pod_slice(service: &str, pod: &Backend, state: PodState) -> EndpointSlice {
    let addr = pod.local_addr();
    slice(
        "shop",
        &format!("{service}-{}", pod.name()),
        service,
        "IPv4",
        ("http", i32::from(addr.port())),
        vec![pod_endpoint(
            pod.name(),
            &addr.ip().to_string(),
            state,
            "node-a",
            "zone-a",
        )],
    )
}

/// A proxy routing listener `web` to the control plane's `shop/cart`.
pub async fn proxy(grpc: SocketAddr) -> (Proxy, SocketAddr) {
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 5s\ncontrol: {{ address: \"{grpc}\" }}\n\
         listeners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: cart }}]\n\
         clusters:\n  - name: cart\n    service: shop/cart\n"
    );
    let p = Proxy::start(ProxyConfig::parse(&yaml, "proxy.yaml").unwrap())
        .await
        .unwrap();
    let addr = p.listener_addr("web").await.unwrap();
    (p, addr)
}

pub type TestClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Status and body of one request.
pub async fn send(
    client: &TestClient,
    method: http::Method,
    url: &str,
    body: &str,
) -> (StatusCode, String) {
    let req = Request::builder()
        .method(method)
        .uri(url)
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    match client.request(req).await {
        Ok(resp) => {
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            (status, String::from_utf8_lossy(&body).into_owned())
        }
        Err(e) => (StatusCode::BAD_GATEWAY, format!("client error: {e}")),
    }
}

/// Which backend answered one GET through the proxy (`None` on a failure).
pub async fn routed(client: &TestClient, addr: SocketAddr) -> Option<String> {
    let req = Request::get(format!("http://{addr}/"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = client.request(req).await.ok()?;
    if resp.status() != StatusCode::OK {
        return None;
    }
    let name = resp.headers().get("x-backend")?.to_str().ok()?.to_owned();
    let _ = resp.into_body().collect().await.ok()?;
    Some(name)
}

/// Backends that answered `n` GETs, sorted and deduplicated; `None` if any failed.
pub async fn answering(client: &TestClient, addr: SocketAddr, n: usize) -> Option<Vec<String>> {
    let mut seen = Vec::new();
    for _ in 0..n {
        seen.push(routed(client, addr).await?);
    }
    seen.sort();
    seen.dedup();
    Some(seen)
}

/// The proxy's cluster `cart` as `/clusters` shows it (null when absent).
pub async fn cart_cluster(p: &Proxy) -> serde_json::Value {
    let (_, body) = send(
        &client(),
        http::Method::GET,
        &format!("http://{}/clusters", p.admin_addr()),
        "",
    )
    .await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let clusters = v
        .as_array()
        .cloned()
        .or_else(|| v["clusters"].as_array().cloned())
        .unwrap_or_default();
    clusters
        .into_iter()
        .find(|c| c["name"] == "cart")
        .unwrap_or_default()
}

/// Endpoint addresses the proxy's cluster `cart` holds, from `/clusters`.
pub async fn cluster_addresses(p: &Proxy) -> Vec<String> {
    let cart = cart_cluster(p).await;
    let mut out: Vec<String> = cart["endpoints"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|e| e["address"].as_str().map(str::to_owned))
        .collect();
    out.sort();
    out
}

/// Waits until the proxy's `cart` holds exactly these backends.
pub async fn wait_holds(p: &Proxy, pods: &[&Backend], what: &str) {
    let mut want: Vec<String> = pods.iter().map(|b| b.local_addr().to_string()).collect();
    want.sort();
    eventually(what, || {
        let want = want.clone();
        async move { cluster_addresses(p).await == want }
    })
    .await;
}
