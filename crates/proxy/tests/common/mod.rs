//! Helpers: real backends and a real proxy on 127.0.0.1, port 0.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use meshless_backend::{Backend, BackendConfig};
use meshless_proxy::{Proxy, ProxyConfig};

pub async fn backend(name: &str) -> Backend {
    Backend::start(BackendConfig {
        name: name.into(),
        listen: "127.0.0.1:0".parse().expect("addr"),
        latency: Duration::ZERO,
        fail_rate: 0.0,
        startup_delay: Duration::ZERO,
    })
    .await
    .expect("backend starts")
}

pub async fn backends(n: usize) -> Vec<Backend> {
    let mut v = Vec::new();
    for i in 0..n {
        v.push(backend(&format!("b{i}")).await);
    }
    v
}

/// YAML list of endpoints for `backends`.
pub fn endpoints_yaml(backends: &[Backend]) -> String {
    backends
        .iter()
        .map(|b| format!("      - {{ address: \"{}\" }}\n", b.local_addr()))
        .collect()
}

/// A proxy config with one listener `web` routing everything to cluster
/// `c`, whose extra YAML (indented 4) is `cluster_extra`.
pub fn config(backends: &[Backend], cluster_extra: &str) -> String {
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 5s\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\nclusters:\n  - name: c\n    endpoints:\n{}{}",
        endpoints_yaml(backends),
        cluster_extra
    )
}

pub async fn proxy(yaml: &str) -> (Proxy, SocketAddr) {
    let cfg = ProxyConfig::parse(yaml, "test.yaml").expect("valid config");
    let p = Proxy::start(cfg).await.expect("proxy starts");
    let addr = p.listener_addr("web").await.expect("listener");
    (p, addr)
}

pub type TestClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build_http()
}

pub fn h2_client() -> TestClient {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http()
}

/// Status, `x-backend` header and body of one GET.
pub async fn get(
    client: &TestClient,
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, String, String) {
    let mut b = Request::get(format!("http://{addr}{path}"));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(Full::new(Bytes::new())).expect("request");
    let resp = client.request(req).await.expect("response");
    let status = resp.status();
    let backend = resp
        .headers()
        .get("x-backend")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, backend, String::from_utf8_lossy(&body).into_owned())
}

/// GET on the admin server.
pub async fn admin(p: &Proxy, path: &str) -> (StatusCode, String) {
    let (s, _, body) = get(&client(), p.admin_addr(), path, &[]).await;
    (s, body)
}

/// YAML list of endpoints for `backends` with the given weights.
pub fn weighted_endpoints_yaml(backends: &[Backend], weights: &[u32]) -> String {
    backends
        .iter()
        .zip(weights)
        .map(|(b, w)| {
            format!(
                "      - {{ address: \"{}\", weight: {w} }}\n",
                b.local_addr()
            )
        })
        .collect()
}

/// Like [`config`], with the endpoint list given as YAML.
pub fn config_with_endpoints(endpoints_yaml: &str, cluster_extra: &str) -> String {
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 5s\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\nclusters:\n  - name: c\n    endpoints:\n{endpoints_yaml}{cluster_extra}"
    )
}
