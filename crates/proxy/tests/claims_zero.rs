//! Claim: a burst at zero is held, not failed, up to the queue bound; past
//! it, 503 with Retry-After. The burst here is far above
//! `container_concurrency` x `max_instances`, and the instance cannot
//! start until the test lets it, so every count follows from the bound.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use http::StatusCode;
use meshless_control::config::ControlConfig;
use meshless_control::plane::ControlPlane;

const BURST: usize = 100;
const MAX_QUEUED: usize = 40;
const CONTAINER_CONCURRENCY: usize = 2;
const MAX_INSTANCES: usize = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_at_zero_is_held_up_to_the_queue_bound_and_the_rest_shed() {
    let tmp = tempfile::Builder::new()
        .prefix("meshless-claims-zero-")
        .tempdir()
        .expect("dir");
    let dir = tmp.path().to_path_buf();
    let gate = dir.join("go");
    // An instance that binds only once the gate file exists.
    let server = format!(
        "import os, time, http.server as h\nwhile not os.path.exists('{}'): time.sleep(0.01)\nh.ThreadingHTTPServer.request_queue_size = 256\nh.ThreadingHTTPServer(('127.0.0.1', int(os.environ['PORT'])), h.SimpleHTTPRequestHandler).serve_forever()",
        gate.display()
    );
    let yaml = format!(
        "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\nservices:\n  - namespace: demo\n    name: lazy\n    autoscaling:\n      min_instances: 0\n      max_instances: {MAX_INSTANCES}\n      target_concurrency: 10\n      tick: 100ms\n      scaler:\n        process:\n          command: [python3, -c, {server:?}]\n          start_timeout: 60s\n          stop_grace: 2s\n"
    );
    let plane = ControlPlane::start(ControlConfig::parse(&yaml, "control.yaml").expect("config"))
        .await
        .expect("plane");
    let (api, grpc) = (plane.api_addr(), plane.grpc_addr());
    let proxy_yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ncontrol: {{ address: \"{grpc}\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: lazy }}]\nclusters:\n  - name: lazy\n    service: demo/lazy\n    activation: {{ queue_timeout: 60s, max_queued: {MAX_QUEUED}, container_concurrency: {CONTAINER_CONCURRENCY} }}\n"
    );
    let (p, addr) = proxy(&proxy_yaml).await;
    subscribed(api, 1).await;
    const { assert!(BURST > CONTAINER_CONCURRENCY * MAX_INSTANCES + MAX_QUEUED) };
    let shed = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..BURST {
        let shed = shed.clone();
        tasks.push(tokio::spawn(async move {
            let req = http::Request::get(format!("http://{addr}/"))
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .expect("request");
            let resp = client().request(req).await.expect("response");
            let retry_after = resp.headers().get("retry-after").is_some();
            let status = resp.status();
            if status == StatusCode::SERVICE_UNAVAILABLE {
                shed.fetch_add(1, Ordering::SeqCst);
            }
            let body = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
                .unwrap_or_default();
            (status, retry_after, body)
        }));
    }
    // Nothing can be served yet: exactly the bound is held, the rest shed.
    eventually("the excess shed", || async {
        shed.load(Ordering::SeqCst) == BURST - MAX_QUEUED
    })
    .await;
    assert_eq!(
        proxy_metric(
            &p,
            "meshless_proxy_activations_total{result=\"queue_full\"}"
        )
        .await,
        (BURST - MAX_QUEUED) as f64
    );
    std::fs::write(&gate, b"go").expect("open the gate");
    let (mut ok, mut shed_with_retry_after, mut other) = (0, 0, Vec::new());
    for t in tasks {
        match t.await.expect("task") {
            (StatusCode::OK, _, _) => ok += 1,
            (StatusCode::SERVICE_UNAVAILABLE, true, _) => shed_with_retry_after += 1,
            x => other.push(x),
        }
    }
    assert!(other.is_empty(), "{other:?}");
    assert_eq!(
        (ok, shed_with_retry_after),
        (MAX_QUEUED, BURST - MAX_QUEUED)
    );
    let (_, view) = api_call(
        api,
        http::Method::GET,
        "/v1/services/demo/lazy",
        serde_json::Value::Null,
    )
    .await;
    let instances = view["endpoints"].as_array().map_or(0, Vec::len);
    assert!((1..=MAX_INSTANCES).contains(&instances), "{view}");
    p.shutdown().await;
    plane.shutdown().await;
}

/// Claim: with `container_concurrency`, requests at capacity go to an
/// instance with a free slot whatever the policy. A policy whose pick
/// follows the request (`random`: one seed per request; a hash key) once
/// picked the same full instance after every hold, and a hold ends at
/// once while any instance has room: the request spun without waiting,
/// and the proxy stopped answering anything. Each policy: two instances
/// of one slot each, slow answers, eight requests at once: every one is
/// answered 200 (it hung before, for `random`, `p2c`, `ring_hash` and
/// `maglev`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_at_capacity_go_to_an_instance_with_a_free_slot_under_every_policy() {
    let bs = backends(2).await;
    let plane = ControlPlane::start(plane_config(None))
        .await
        .expect("plane");
    let (api, grpc) = (plane.api_addr(), plane.grpc_addr());
    register_cart(api, &[("a", bs[0].local_addr()), ("b", bs[1].local_addr())]).await;
    for policy in [
        "random",
        "p2c",
        "ring_hash",
        "maglev",
        "round_robin",
        "least_request",
    ] {
        let extra = format!(
            "    balancer: {{ policy: {policy}, hash_key: {{ header: x-user }} }}\n    activation: {{ queue_timeout: 60s, container_concurrency: 1 }}\n"
        );
        let (p, addr) = proxy(&cart_proxy_yaml(grpc, &extra)).await;
        eventually("both endpoints known", || async {
            cluster_addresses(&p, "cart").await.len() == 2
        })
        .await;
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                tokio::spawn(async move {
                    let user = format!("u{}", i % 2);
                    let resp = get(&client(), addr, "/?delay_ms=200", &[("x-user", &user)]).await;
                    resp.0
                })
            })
            .collect();
        for t in tasks {
            let status = tokio::time::timeout(std::time::Duration::from_secs(60), t)
                .await
                .unwrap_or_else(|_| panic!("{policy}: a request hangs"))
                .expect("task");
            assert_eq!(status, StatusCode::OK, "{policy}");
        }
        p.shutdown().await;
    }
    plane.shutdown().await;
}
