//! Helpers: real backends and a real proxy on 127.0.0.1, port 0.
#![allow(dead_code)]

pub mod raw_h1;
pub mod tls;

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

/// The HTTP/1 server the suites run on: the default (`meshless`) unless
/// the environment says `MESHLESS_TEST_HTTP1=hyper` (how CI runs the fault
/// suites on hyper's server connection too) or `=meshless`.
pub fn test_http1() -> meshless_proxy::h1serve::Http1Server {
    use meshless_proxy::h1serve::Http1Server;
    match std::env::var("MESHLESS_TEST_HTTP1").as_deref() {
        Ok("meshless") => Http1Server::Meshless,
        Ok("hyper") => Http1Server::Hyper,
        _ => Http1Server::default(),
    }
}

/// The HTTP/1.1 client the suites' clusters use: the default (`meshless`)
/// unless the environment says `MESHLESS_TEST_UPSTREAM_HTTP1=hyper` (how
/// CI runs the proxy suites on hyper's client too) or `=meshless`.
pub fn test_upstream_http1() -> meshless_proxy::config::Http1Client {
    use meshless_proxy::config::Http1Client;
    match std::env::var("MESHLESS_TEST_UPSTREAM_HTTP1").as_deref() {
        Ok("meshless") => Http1Client::Meshless,
        Ok("hyper") => Http1Client::Hyper,
        _ => Http1Client::default(),
    }
}

/// `cfg` with every listener on [`test_http1`] and every cluster on
/// [`test_upstream_http1`] (unless its YAML chose the other one).
pub fn on_test_http1(mut cfg: ProxyConfig) -> ProxyConfig {
    let engine = test_http1();
    for l in &mut cfg.listeners {
        if l.http1 == meshless_proxy::h1serve::Http1Server::default() {
            l.http1 = engine;
        }
    }
    let client = test_upstream_http1();
    for c in &mut cfg.clusters {
        if c.http1 == meshless_proxy::config::Http1Client::default() {
            c.http1 = client;
        }
    }
    cfg
}

pub async fn proxy(yaml: &str) -> (Proxy, SocketAddr) {
    let cfg = on_test_http1(ProxyConfig::parse(yaml, "test.yaml").expect("valid config"));
    let p = Proxy::start(cfg).await.expect("proxy starts");
    let addr = p.listener_addr("web").await.expect("listener");
    (p, addr)
}

/// Both HTTP/1 servers, for tests that run on each in turn.
pub const ENGINES: [meshless_proxy::h1serve::Http1Server; 2] = [
    meshless_proxy::h1serve::Http1Server::Hyper,
    meshless_proxy::h1serve::Http1Server::Meshless,
];

/// A proxy on `yaml` whose listeners are all served by `engine`.
pub async fn proxy_on(
    yaml: &str,
    engine: meshless_proxy::h1serve::Http1Server,
) -> (Proxy, SocketAddr) {
    let mut cfg = ProxyConfig::parse(yaml, "test.yaml").expect("valid config");
    for l in &mut cfg.listeners {
        l.http1 = engine;
    }
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
// ---------------------------------------------------------------------
// Waiting on conditions, reading metrics, and upstreams the test controls.
// ---------------------------------------------------------------------

/// Generous deadline for a condition on a busy 2-core machine.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// Polls `ok` every 25 ms until it holds; panics after [`DEADLINE`].
pub async fn eventually<F, Fut>(what: &str, mut ok: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = std::time::Instant::now();
    while !ok().await {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The value of the sample `series` (name with its labels, exactly as
/// printed, e.g. `foo_total{a="b"}`) in a Prometheus text page.
pub fn metric(page: &str, series: &str) -> Option<f64> {
    page.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// Sum of every sample whose line starts with `prefix`.
pub fn metric_sum(page: &str, prefix: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits until the control plane at `api` counts `n` subscribers.
pub async fn subscribed(api: SocketAddr, n: u32) {
    eventually("the proxies subscribed", || async {
        metric(
            &get(&client(), api, "/metrics", &[]).await.2,
            "meshless_control_subscribers",
        ) == Some(f64::from(n))
    })
    .await;
}

/// One proxy metric (see [`metric`]), 0 when absent.
pub async fn proxy_metric(p: &Proxy, series: &str) -> f64 {
    metric(&admin(p, "/metrics").await.1, series).unwrap_or(0.0)
}

/// One request the [`Gated`] upstream received.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: http::Method,
    pub path: String,
    pub headers: http::HeaderMap,
}

/// An HTTP/1.1 + h2c upstream that holds every answer until [`Gated::open`]
/// (or answers at once after it), records what it received, and can be
/// killed (every connection closed mid-request) or told to send GOAWAY.
pub struct Gated {
    pub name: String,
    addr: SocketAddr,
    seen: std::sync::Arc<std::sync::Mutex<Vec<Seen>>>,
    /// Requests being held now.
    held: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    gate: tokio::sync::watch::Sender<bool>,
    goaway: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Gated {
    /// Starts closed: requests are held until [`Gated::open`].
    pub async fn start(name: &str) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let held = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (gate, gate_rx) = tokio::sync::watch::channel(false);
        let (goaway, goaway_rx) = tokio::sync::watch::channel(false);
        let ctx = GateCtx {
            name: name.to_owned(),
            seen: seen.clone(),
            held: held.clone(),
            gate: gate_rx,
        };
        let task = tokio::spawn(gated_accept(listener, ctx, goaway_rx));
        Self {
            name: name.to_owned(),
            addr,
            seen,
            held,
            gate,
            goaway,
            task,
        }
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Releases held requests; later ones are answered at once.
    pub fn open(&self) {
        let _ = self.gate.send(true);
    }

    /// Requests being held now.
    pub fn held(&self) -> usize {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Every request received so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Graceful shutdown of every open connection (HTTP/2: GOAWAY; held
    /// streams still finish), while the listener keeps accepting.
    pub fn goaway(&self) {
        let _ = self.goaway.send(true);
    }

    /// A crash: the listener and every connection close at once, held
    /// requests unanswered.
    pub async fn kill(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

#[derive(Clone)]
struct GateCtx {
    name: String,
    seen: std::sync::Arc<std::sync::Mutex<Vec<Seen>>>,
    held: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    gate: tokio::sync::watch::Receiver<bool>,
}

/// Lowers the held count when the answer is sent or the request dropped.
struct HeldGuard(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Drop for HeldGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

async fn gated_accept(
    listener: tokio::net::TcpListener,
    ctx: GateCtx,
    goaway: tokio::sync::watch::Receiver<bool>,
) {
    // Dropping the set (on abort) closes every connection.
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let ctx = ctx.clone();
                let mut goaway = goaway.clone();
                goaway.mark_unchanged();
                conns.spawn(async move {
                    let service = hyper::service::service_fn(move |req| gated_answer(ctx.clone(), req));
                    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                    tokio::pin!(conn);
                    tokio::select! {
                        _ = conn.as_mut() => return,
                        // Only connections open when GOAWAY is asked for.
                        _ = goaway.changed() => conn.as_mut().graceful_shutdown(),
                    }
                    let _ = conn.await;
                });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

async fn gated_answer(
    ctx: GateCtx,
    req: Request<hyper::body::Incoming>,
) -> Result<http::Response<Full<Bytes>>, std::convert::Infallible> {
    let (parts, body) = req.into_parts();
    let _ = body.collect().await;
    ctx.seen
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(Seen {
            method: parts.method.clone(),
            path: parts.uri.path().to_owned(),
            headers: parts.headers.clone(),
        });
    ctx.held.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let _guard = HeldGuard(ctx.held.clone());
    let mut gate = ctx.gate.clone();
    let _ = gate.wait_for(|open| *open).await;
    let mut resp = http::Response::new(Full::new(Bytes::from(format!("{}\n", ctx.name))));
    resp.headers_mut().insert(
        "x-backend",
        http::HeaderValue::from_str(&ctx.name).expect("name"),
    );
    Ok(resp)
}

/// Reads from `s` until a request head's end (`\r\n\r\n`): what was
/// read (the head, and whatever followed it in the same reads), or `None`
/// if the connection ended or failed first.
pub async fn read_head(s: &mut tokio::net::TcpStream) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 4096];
    let mut head = Vec::new();
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    Some(head)
}

/// A TCP server on 127.0.0.1 (port 0) that runs `each` on every
/// connection it accepts, each in a task of its own, for as long as the
/// runtime lives. Returns its address.
pub async fn tcp_server<F, Fut>(each: F) -> SocketAddr
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            tokio::spawn(each(s));
        }
    });
    addr
}

/// An upstream that answers every request with a 64 MiB body, written
/// for as long as the proxy takes it.
pub async fn endless_upstream() -> SocketAddr {
    use tokio::io::AsyncWriteExt;
    tcp_server(|mut s| async move {
        if read_head(&mut s).await.is_none() {
            return;
        }
        let total = 64 << 20;
        let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {total}\r\n\r\n");
        if s.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        let chunk = vec![b'x'; 64 * 1024];
        for _ in 0..total / chunk.len() {
            if s.write_all(&chunk).await.is_err() {
                return;
            }
        }
    })
    .await
}

/// A raw TCP upstream that answers every connection with `response`
/// (bytes written as they are), then closes it: for truncated bodies and
/// other broken answers. Returns its address.
pub async fn raw_upstream(response: &'static [u8]) -> SocketAddr {
    use tokio::io::AsyncWriteExt;
    tcp_server(move |mut s| async move {
        if read_head(&mut s).await.is_none() {
            return;
        }
        let _ = s.write_all(response).await;
        let _ = s.flush().await;
        // Closing with unread data pending would send RST; the request is
        // read whole above, so this is a plain close.
    })
    .await
}

/// A TCP relay in front of an address: forwards bytes both ways until
/// [`Relay::freeze`] stops forwarding on every open connection (they stay
/// open, silent); connections opened later are forwarded normally.
pub struct Relay {
    addr: SocketAddr,
    frozen: tokio::sync::watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    pub async fn start(target: SocketAddr) -> Self {
        Self::start_on("127.0.0.1:0".parse().expect("addr"), target).await
    }

    /// A relay bound at `listen` (to reuse the address of one stopped).
    pub async fn start_on(listen: SocketAddr, target: SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind(listen).await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (frozen, frozen_rx) = tokio::sync::watch::channel(0u64);
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((down, _)) = accepted else { continue };
                        let mut freeze = frozen_rx.clone();
                        freeze.mark_unchanged();
                        conns.spawn(async move {
                            let Ok(mut up) = tokio::net::TcpStream::connect(target).await else { return };
                            let mut down = down;
                            tokio::select! {
                                _ = tokio::io::copy_bidirectional(&mut down, &mut up) => {}
                                _ = freeze.changed() => {
                                    // Silent but open until the relay stops.
                                    std::future::pending::<()>().await;
                                }
                            }
                        });
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Self { addr, frozen, task }
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops forwarding on every connection open now (they stay open).
    pub fn freeze(&self) {
        self.frozen.send_modify(|n| *n += 1);
    }

    /// Closes the listener and every connection.
    pub async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

// ---------------------------------------------------------------------
// The control plane, as the proxy's tests use it.
// ---------------------------------------------------------------------

/// A control plane config on 127.0.0.1 port 0, in memory or in `data_dir`.
pub fn plane_config(
    data_dir: Option<std::path::PathBuf>,
) -> meshless_control::config::ControlConfig {
    meshless_control::config::ControlConfig {
        api_address: "127.0.0.1:0".parse().expect("addr"),
        grpc_address: "127.0.0.1:0".parse().expect("addr"),
        data_dir,
        ..meshless_control::config::ControlConfig::default()
    }
}

/// One call to the registration API: status and JSON body (Null if none).
pub async fn api_call(
    api: SocketAddr,
    method: http::Method,
    path: &str,
    body: serde_json::Value,
) -> (StatusCode, serde_json::Value) {
    let req = Request::builder()
        .method(method)
        .uri(format!("http://{api}{path}"))
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let resp = client().request(req).await.expect("response");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

/// The registration body of one endpoint at `addr`.
pub fn endpoint_json(id: &str, addr: SocketAddr) -> serde_json::Value {
    serde_json::json!({ "id": id, "addresses": [addr.ip().to_string()], "port": addr.port() })
}

/// Creates service `shop/cart` with one endpoint per `(id, addr)`; returns
/// the registry version after the write.
pub async fn register_cart(api: SocketAddr, endpoints: &[(&str, SocketAddr)]) -> u64 {
    let (s, _) = api_call(
        api,
        http::Method::PUT,
        "/v1/services/shop/cart",
        serde_json::json!({ "ports": [{ "port": 80 }] }),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let put: Vec<_> = endpoints
        .iter()
        .map(|(id, a)| endpoint_json(id, *a))
        .collect();
    put_cart_endpoints(api, put).await
}

/// Puts the endpoints `put` (registration API JSON) into `shop/cart` in
/// one write; returns the registry version after it.
pub async fn put_cart_endpoints(api: SocketAddr, put: Vec<serde_json::Value>) -> u64 {
    let (s, body) = api_call(
        api,
        http::Method::POST,
        "/v1/services/shop/cart/endpoints",
        serde_json::json!({ "put": put }),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{body}");
    body["version"].as_u64().expect("version")
}

/// A proxy config whose cluster `cart` follows service `shop/cart` at `grpc`.
pub fn cart_proxy_yaml(grpc: SocketAddr, cluster_extra: &str) -> String {
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 5s\ncontrol: {{ address: \"{grpc}\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: cart }}]\nclusters:\n  - name: cart\n    service: shop/cart\n{cluster_extra}"
    )
}

/// The endpoints (as JSON objects) the proxy's cluster `name` holds now,
/// from `/clusters`.
pub async fn cluster_endpoints(p: &Proxy, name: &str) -> Vec<serde_json::Value> {
    let (_, body) = admin(p, "/clusters").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let clusters = v
        .as_array()
        .cloned()
        .or_else(|| v["clusters"].as_array().cloned())
        .unwrap_or_default();
    clusters
        .iter()
        .filter(|c| c["name"] == name)
        .flat_map(|c| c["endpoints"].as_array().cloned().unwrap_or_default())
        .collect()
}

/// Addresses of the endpoints the proxy's cluster `name` holds now, from `/clusters`.
pub async fn cluster_addresses(p: &Proxy, name: &str) -> Vec<String> {
    cluster_endpoints(p, name)
        .await
        .iter()
        .filter_map(|e| e["address"].as_str().map(str::to_owned))
        .collect()
}

/// The JSON lines of an access-log file so far (none while it is missing).
pub fn access_log_lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}
