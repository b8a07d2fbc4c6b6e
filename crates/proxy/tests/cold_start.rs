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
    let (status, _, body) = get(&client(), addr, "/", &[]).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    eventually("the control plane's metrics settle", || async move {
        settled(&plane_metrics(api).await)
    })
    .await;
    let metrics = plane_metrics(api).await;
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
