//! Cold starts through real sockets: a control plane running instances
//! with the process scaler, a proxy holding the first request. Readiness
//! pushed by the instance (`READY=1` on `NOTIFY_SOCKET`), and the probe
//! as the fallback for an instance that never notifies.

mod common;

use std::net::SocketAddr;

use common::*;
use http::StatusCode;
use meshless_control::config::ControlConfig;
use meshless_control::plane::ControlPlane;

/// A control plane with `demo/lazy` at zero, run by the process scaler
/// with `command` (a YAML flow list).
fn lazy_plane(command: &str) -> ControlConfig {
    let yaml = format!(
        "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\nservices:\n  - namespace: demo\n    name: lazy\n    autoscaling:\n      min_instances: 0\n      max_instances: 1\n      target_concurrency: 10\n      tick: 100ms\n      scaler:\n        process:\n          command: {command}\n          start_timeout: 20s\n          stop_grace: 2s\n"
    );
    ControlConfig::parse(&yaml, "control.yaml").expect("valid control config")
}

fn lazy_proxy(grpc: SocketAddr) -> String {
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ncontrol: {{ address: \"{grpc}\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: lazy }}]\nclusters:\n  - name: lazy\n    service: demo/lazy\n    activation: {{ queue_timeout: 20s }}\n"
    )
}

/// A Python HTTP server on `$PORT`; `after_listen` runs once it listens.
fn python_server(after_listen: &str) -> String {
    format!(
        "[python3, -c, \"import http.server as h, os, socket\\ns = h.HTTPServer(('127.0.0.1', int(os.environ['PORT'])), h.SimpleHTTPRequestHandler)\\n{after_listen}\\ns.serve_forever()\"]"
    )
}

async fn plane_metrics(api: SocketAddr) -> String {
    get(&client(), api, "/metrics", &[]).await.2
}

async fn subscribed(api: SocketAddr) {
    eventually("the proxy subscribed", || async move {
        metric(&plane_metrics(api).await, "meshless_control_subscribers") == Some(1.0)
    })
    .await;
}

/// Runs one cold start with `command`; returns the control plane's
/// metrics once `settled` holds for them.
async fn cold_start(command: &str, settled: fn(&str) -> bool) -> String {
    let plane = ControlPlane::start(lazy_plane(command))
        .await
        .expect("plane");
    let api = plane.api_addr();
    let (p, addr) = proxy(&lazy_proxy(plane.grpc_addr())).await;
    subscribed(api).await;
    let sent = std::time::Instant::now();
    let (status, _, body) = get(&client(), addr, "/", &[]).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    eventually("the control plane's metrics settle", || async move {
        settled(&plane_metrics(api).await)
    })
    .await;
    let metrics = plane_metrics(api).await;
    // The start is recorded phase by phase, in order (what the benchmark
    // pairs with the request): asked after the request was sent (unless
    // a scaling tick on the load report started it first), spawned after
    // that, ready after the spawn.
    eventually("the instance start recorded", || async {
        !plane.state.starts.list().is_empty()
    })
    .await;
    let starts = plane.state.starts.list();
    let [start] = &starts[..] else {
        panic!("one instance start recorded: {starts:?}");
    };
    assert_eq!(start.service, "demo/lazy");
    let asked = start.asked.unwrap_or(sent);
    assert!(sent <= asked && asked <= start.spawning && start.spawning < start.ready);
    p.shutdown().await;
    plane.shutdown().await;
    metrics
}

fn ready_total(m: &str) -> f64 {
    metric_sum(m, "meshless_control_instances_ready_total")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_notifies_is_announced_ready_and_answers() {
    // Listens, then says so; a garbage datagram first is ignored.
    let notify = "n = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\\nn.sendto(b'not an assignment', os.environ['NOTIFY_SOCKET'])\\nn.sendto(b'READY=1', os.environ['NOTIFY_SOCKET'])";
    // The datagrams are read as they arrive, even when the probe saw the
    // port first: wait until both are counted.
    let m = cold_start(&python_server(notify), |m| {
        ready_total(m) >= 1.0 && metric(m, "meshless_control_notify_ready_total") == Some(1.0)
    })
    .await;
    assert_eq!(ready_total(&m), 1.0, "{m}");
    assert_eq!(
        metric(&m, "meshless_control_notify_ignored_total"),
        Some(1.0),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_never_notifies_is_found_by_the_probe() {
    let m = cold_start(&python_server(""), |m| ready_total(m) >= 1.0).await;
    assert_eq!(
        metric(&m, "meshless_control_instances_ready_total{via=\"probe\"}"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "meshless_control_notify_ready_total"),
        Some(0.0),
        "{m}"
    );
}

/// Serves `answer(request)` over HTTP/1.1 on 127.0.0.1:0.
async fn http_server<F>(answer: F) -> SocketAddr
where
    F: Fn(http::Request<hyper::body::Incoming>) -> futures_like::BoxedAnswer
        + Send
        + Sync
        + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let answer = std::sync::Arc::new(answer);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let answer = std::sync::Arc::clone(&answer);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| answer(req));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

mod futures_like {
    use bytes::Bytes;
    use http_body_util::Full;
    pub type BoxedAnswer = std::pin::Pin<
        Box<
            dyn std::future::Future<
                    Output = Result<http::Response<Full<Bytes>>, std::convert::Infallible>,
                > + Send,
        >,
    >;
}

/// An OTLP/HTTP receiver: every JSON export request body it got.
async fn otlp_receiver() -> (
    SocketAddr,
    std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
) {
    use http_body_util::BodyExt;
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = std::sync::Arc::clone(&got);
    let addr = http_server(move |req| {
        let sink = std::sync::Arc::clone(&sink);
        Box::pin(async move {
            let body = req
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) {
                sink.lock().expect("lock").push(v);
            }
            Ok(http::Response::new(http_body_util::Full::new(
                bytes::Bytes::from_static(b"{}"),
            )))
        })
    })
    .await;
    (addr, got)
}

/// Every span received, flattened.
fn spans(got: &std::sync::Mutex<Vec<serde_json::Value>>) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for req in got.lock().expect("lock").iter() {
        for rs in req["resourceSpans"].as_array().into_iter().flatten() {
            for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                out.extend(ss["spans"].as_array().into_iter().flatten().cloned());
            }
        }
    }
    out
}

fn nanos(span: &serde_json::Value, field: &str) -> u128 {
    span[field]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("a time")
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_start_exports_its_phases_as_ordered_child_spans() {
    let (otlp, got) = otlp_receiver().await;
    let plane = ControlPlane::start(lazy_plane(&python_server("")))
        .await
        .expect("plane");
    let yaml = format!(
        "{}tracing: {{ otlp_endpoint: \"http://{otlp}/v1/traces\", service_name: test, flush_interval: 50ms }}\n",
        lazy_proxy(plane.grpc_addr())
    );
    let (p, addr) = proxy(&yaml).await;
    subscribed(plane.api_addr()).await;
    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let (status, _, _) = get(&client(), addr, "/", &[("traceparent", parent.as_str())]).await;
    assert_eq!(status, StatusCode::OK);
    let names = [
        "proxy request",
        "activation.sent",
        "instance.announced",
        "instance.ready",
        "activation.held",
        "upstream.response",
    ];
    eventually("the spans exported", || {
        let got = std::sync::Arc::clone(&got);
        async move {
            let s = spans(&got);
            names.iter().all(|n| s.iter().any(|x| x["name"] == *n))
        }
    })
    .await;
    let all = spans(&got);
    let by = |name: &str| {
        let found: Vec<&serde_json::Value> = all.iter().filter(|s| s["name"] == name).collect();
        assert_eq!(found.len(), 1, "one {name}: {all:?}");
        found[0].clone()
    };
    let request = by("proxy request");
    assert_eq!(request["traceId"], CLIENT_TRACE);
    assert_eq!(
        request["parentSpanId"], CLIENT_SPAN,
        "the client's span is the parent"
    );
    assert_eq!(request["kind"], 2, "a server span");
    for n in &names[1..] {
        let s = by(n);
        assert_eq!(s["traceId"], CLIENT_TRACE, "{n}");
        assert_eq!(
            s["parentSpanId"], request["spanId"],
            "{n} is a child of the request"
        );
        assert!(
            nanos(&s, "startTimeUnixNano") <= nanos(&s, "endTimeUnixNano"),
            "{n}"
        );
    }
    // The phases in the order of a cold start.
    let end = |n: &str| nanos(&by(n), "endTimeUnixNano");
    let start = |n: &str| nanos(&by(n), "startTimeUnixNano");
    assert!(start("proxy request") <= start("activation.held"));
    assert!(end("activation.sent") <= end("instance.announced"));
    assert!(end("instance.announced") <= start("instance.ready"));
    assert!(end("instance.ready") <= end("activation.held"));
    assert!(end("activation.held") <= start("upstream.response"));
    assert!(end("upstream.response") <= end("proxy request"));
    p.shutdown().await;
    plane.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traceparent_is_continued_or_started_for_every_request() {
    // Tracing off: the header is propagated all the same.
    let upstream = http_server(|req| {
        let seen = req
            .headers()
            .get("traceparent")
            .map(|v| v.as_bytes().to_vec())
            .unwrap_or_default();
        Box::pin(async move {
            Ok(http::Response::new(http_body_util::Full::new(
                bytes::Bytes::from(seen),
            )))
        })
    })
    .await;
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - {{ name: web, address: \"127.0.0.1:0\", routes: [{{ cluster: c }}] }}\nclusters:\n  - name: c\n    endpoints: [{{ address: \"{upstream}\" }}]\n"
    );
    let (p, addr) = proxy(&yaml).await;
    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let (_, _, continued) = get(&client(), addr, "/", &[("traceparent", parent.as_str())]).await;
    let fields: Vec<&str> = continued.split('-').collect();
    assert_eq!(fields.len(), 4, "{continued}");
    assert_eq!(
        (fields[0], fields[1], fields[3]),
        ("00", CLIENT_TRACE, "01")
    );
    assert_ne!(fields[2], CLIENT_SPAN, "the proxy's own span id");
    // None, or an invalid one: a new trace.
    for sent in [
        None,
        Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
    ] {
        let headers: Vec<(&str, &str)> = sent.map(|v| ("traceparent", v)).into_iter().collect();
        let (_, _, started) = get(&client(), addr, "/", &headers).await;
        let fields: Vec<&str> = started.split('-').collect();
        assert_eq!(fields.len(), 4, "{started}");
        assert_eq!(fields[1].len(), 32, "{started}");
        assert_ne!(fields[1], "0".repeat(32));
    }
    p.shutdown().await;
}

/// `lazy_proxy` on node `node`.
fn lazy_proxy_on(grpc: SocketAddr, node: &str) -> String {
    format!("node: {{ name: {node} }}\n{}", lazy_proxy(grpc))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_instance_starts_on_the_node_that_asked_and_the_other_proxy_follows() {
    let plane = ControlPlane::start(lazy_plane(&python_server("")))
        .await
        .expect("plane");
    let api = plane.api_addr();
    let (a, addr_a) = proxy(&lazy_proxy_on(plane.grpc_addr(), "node-a")).await;
    let (b, addr_b) = proxy(&lazy_proxy_on(plane.grpc_addr(), "node-b")).await;
    eventually("both proxies subscribed", || async move {
        metric(&plane_metrics(api).await, "meshless_control_subscribers") == Some(2.0)
    })
    .await;
    // Proxy B asks: the instance is labelled with B's node.
    let (status, _, _) = get(&client(), addr_b, "/", &[]).await;
    assert_eq!(status, StatusCode::OK);
    let (_, view) = api_call(
        api,
        http::Method::GET,
        "/v1/services/demo/lazy",
        serde_json::Value::Null,
    )
    .await;
    let endpoints = view["endpoints"].as_array().cloned().unwrap_or_default();
    assert_eq!(endpoints.len(), 1, "{view}");
    assert_eq!(endpoints[0]["node"], "node-b", "{view}");
    // Proxy A's requests follow it (no second instance: max_instances 1).
    let (status, _, _) = get(&client(), addr_a, "/", &[]).await;
    assert_eq!(status, StatusCode::OK);
    let addresses = cluster_addresses(&a, "lazy").await;
    assert_eq!(addresses.len(), 1, "{addresses:?}");
    a.shutdown().await;
    b.shutdown().await;
    plane.shutdown().await;
}

/// An endpoint registered not ready (as a pod failing its readiness probe
/// arrives) is never probed into use, even when its port accepts: only
/// instances announced as starting are. The held request times out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_not_ready_endpoint_that_is_not_starting_gets_no_traffic() {
    let plane = ControlPlane::start(plane_config(None))
        .await
        .expect("plane");
    let api = plane.api_addr();
    let unready = backend("unready").await;
    register_cart(api, &[]).await;
    let mut e = endpoint_json("unready-pod", unready.local_addr());
    e["conditions"] = serde_json::json!({ "ready": false, "serving": false, "terminating": false });
    put_cart_endpoints(api, vec![e]).await;
    let yaml = cart_proxy_yaml(
        plane.grpc_addr(),
        "    activation: { queue_timeout: 1s, probe_interval: 1ms }\n",
    );
    let (p, addr) = proxy(&yaml).await;
    subscribed(api).await;
    eventually("the proxy has the not-ready endpoint", || async {
        p.state()
            .service_feeds()
            .get("shop/cart")
            .is_some_and(|f| f.endpoints.iter().any(|e| e.id.as_str() == "unready-pod"))
    })
    .await;
    let (status, _, body) = get(&client(), addr, "/", &[]).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "{body}");
    assert_eq!(
        unready.requests(),
        0,
        "the not-ready endpoint got a request"
    );
    p.shutdown().await;
    plane.shutdown().await;
}

/// With the control plane unreachable, every request held for a service
/// at zero asks for an instance, but the pending requests stay one per
/// service: memory does not grow with the requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn activation_requests_stay_bounded_while_the_control_plane_is_away() {
    // Accepts connections (the backlog) and never answers: no stream.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ncontrol: {{ address: \"{}\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - {{ match: {{ path_prefix: /a }}, cluster: a }}\n      - {{ cluster: b }}\nclusters:\n  - name: a\n    service: demo/a\n    activation: {{ queue_timeout: 1ms }}\n  - name: b\n    service: demo/b\n    activation: {{ queue_timeout: 1ms }}\n",
        silent.local_addr().expect("addr")
    );
    let (p, addr) = proxy(&yaml).await;
    let c = client();
    for i in 0..200 {
        let path = if i % 2 == 0 { "/a" } else { "/b" };
        let (status, _, body) = get(&c, addr, path, &[]).await;
        assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "{body}");
        assert!(p.state().activate.len() <= 2, "pending: one per service");
    }
    let sent = proxy_metric(&p, "meshless_proxy_activations_total{result=\"timeout\"}").await;
    assert_eq!(sent, 200.0, "every request was held");
    p.shutdown().await;
}

/// R10: of two instances started for held requests, the one that fails
/// must not fail the requests the other one can serve. The instance that
/// claims the `first` directory exits with an error once the other has
/// started (its `second` marker exists): at that moment the other is
/// starting, and both held requests must get its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failed_start_does_not_fail_requests_another_instance_can_serve() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("start.sh");
    std::fs::write(
        &script,
        "if mkdir \"$D/first\" 2>/dev/null; then\n  while [ ! -e \"$D/second\" ]; do sleep 0.01; done\n  exit 1\nfi\ntouch \"$D/second\"\nexec python3 -c \"import http.server as h, os; h.HTTPServer(('127.0.0.1', int(os.environ['PORT'])), h.SimpleHTTPRequestHandler).serve_forever()\"\n",
    )
    .expect("script");
    let d = dir.path().display().to_string();
    let yaml = format!(
        "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\nservices:\n  - namespace: demo\n    name: lazy\n    autoscaling:\n      min_instances: 0\n      max_instances: 2\n      target_concurrency: 1\n      tick: 100ms\n      scaler:\n        process:\n          command: [sh, {script:?}]\n          working_dir: {d:?}\n          env: {{ D: {d:?} }}\n          start_timeout: 20s\n          stop_grace: 2s\n",
        script = script.display().to_string(),
    );
    let plane = ControlPlane::start(ControlConfig::parse(&yaml, "control.yaml").expect("valid"))
        .await
        .expect("plane");
    let api = plane.api_addr();
    let (p, addr) = proxy(&lazy_proxy(plane.grpc_addr())).await;
    subscribed(api).await;
    let c = client();
    let held: Vec<_> = (0..2)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move { get(&c, addr, "/", &[]).await })
        })
        .collect();
    for r in held {
        let (status, _, body) = r.await.expect("request task");
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let m = plane_metrics(api).await;
    assert!(
        metric_sum(&m, "meshless_control_instance_start_failures_total") >= 1.0,
        "the first instance failed: {m}"
    );
    p.shutdown().await;
    plane.shutdown().await;
}
