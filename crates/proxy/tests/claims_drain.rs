//! Claim (README, docs/control.md): an endpoint marked terminating drains
//! with zero failed requests. Proven strictly: no retries hide a misroute,
//! the drained backend is crashed once its drain is over, and who served
//! each request is checked against when it started.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use common::*;
use http::{Method, StatusCode};
use meshless_control::plane::ControlPlane;

/// One finished request: the phase it started in, its status, who served it.
type Record = (u64, StatusCode, String);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_endpoint_drains_with_zero_failed_requests() {
    let plane = ControlPlane::start(plane_config(None))
        .await
        .expect("plane");
    let (api, grpc) = (plane.api_addr(), plane.grpc_addr());
    let mut bs = backends(3).await;
    let ids: Vec<(&str, _)> = bs.iter().map(|b| (b.name(), b.local_addr())).collect();
    register_cart(api, &ids).await;
    let b1_addr = bs[1].local_addr();
    // No retries: a request sent to a stopped endpoint would fail visibly.
    let (p, addr) = proxy(&cart_proxy_yaml(
        grpc,
        "    balancer: { policy: round_robin }\n    retries: { count: 0 }\n",
    ))
    .await;
    eventually("three endpoints from the control plane", || async {
        cluster_addresses(&p, "cart").await.len() == 3
    })
    .await;
    // Phase 0: before the change; 1: after the proxy applied "terminating";
    // 2: after b1 was stopped; 3: after the DELETE.
    let phase = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicU64::new(0));
    // Per client: the phase its last finished request started in.
    let finished: Arc<Vec<AtomicU64>> = Arc::new((0..4).map(|_| AtomicU64::new(0)).collect());
    let mut load = Vec::new();
    for i in 0..4 {
        let (phase, stop, finished) = (phase.clone(), stop.clone(), finished.clone());
        load.push(tokio::spawn(async move {
            let c = client();
            let mut out: Vec<Record> = Vec::new();
            while stop.load(Ordering::SeqCst) == 0 {
                let started = phase.load(Ordering::SeqCst);
                let (s, b, _) = get(&c, addr, "/?delay_ms=5", &[]).await;
                out.push((started, s, b));
                finished[i].store(started, Ordering::SeqCst);
            }
            out
        }));
    }
    // Each client is sequential: once all have finished a request started
    // in phase `ph`, no request of an earlier phase is in flight.
    let settle = |ph: u64| {
        let finished = finished.clone();
        let p = &p;
        async move {
            eventually(&format!("every client past phase {ph}"), || async {
                finished.iter().all(|f| f.load(Ordering::SeqCst) >= ph)
            })
            .await;
            // And some traffic in this phase, so each phase is exercised.
            let before = total_requests(p).await;
            eventually(&format!("requests in phase {ph}"), || async {
                total_requests(p).await >= before + 20.0
            })
            .await;
        }
    };
    eventually("load reaches b1", || async { bs[1].requests() >= 5 }).await;
    // b1 is being shut down: terminating.
    let mut t = endpoint_json("b1", b1_addr);
    t["conditions"] = serde_json::json!({ "ready": false, "serving": true, "terminating": true });
    let (s, _) = api_call(api, Method::PUT, "/v1/services/shop/cart/endpoints/b1", t).await;
    assert_eq!(s, StatusCode::OK);
    eventually("the proxy stops routing to b1", || async {
        !cluster_addresses(&p, "cart")
            .await
            .contains(&b1_addr.to_string())
    })
    .await;
    phase.store(1, Ordering::SeqCst);
    settle(1).await;
    // The drain is over: crash b1; anything still routed there now fails.
    let b1 = bs.remove(1);
    b1.stop().await;
    phase.store(2, Ordering::SeqCst);
    settle(2).await;
    let (s, body) = api_call(
        api,
        Method::DELETE,
        "/v1/services/shop/cart/endpoints/b1",
        serde_json::Value::Null,
    )
    .await;
    assert_eq!(
        s,
        StatusCode::OK,
        "DELETE of a terminating endpoint: {body}"
    );
    phase.store(3, Ordering::SeqCst);
    settle(3).await;
    stop.store(1, Ordering::SeqCst);
    let mut records: Vec<Record> = Vec::new();
    for t in load {
        records.extend(t.await.expect("task"));
    }
    let failed: Vec<&Record> = records.iter().filter(|r| r.1 != StatusCode::OK).collect();
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    let misrouted: Vec<&Record> = records.iter().filter(|r| r.0 >= 1 && r.2 == "b1").collect();
    assert!(
        misrouted.is_empty(),
        "sent to b1 after it turned terminating: {misrouted:?}"
    );
    assert!(
        records.iter().any(|r| r.0 == 0 && r.2 == "b1"),
        "b1 served before the change"
    );
    for ph in 1..=3 {
        for b in ["b0", "b2"] {
            assert!(
                records.iter().any(|r| r.0 == ph && r.2 == b),
                "{b} serves in phase {ph}"
            );
        }
    }
    p.shutdown().await;
    plane.shutdown().await;
}

/// Requests the proxy finished for cluster `cart`, over all endpoints.
async fn total_requests(p: &meshless_proxy::Proxy) -> f64 {
    metric_sum(
        &admin(p, "/metrics").await.1,
        "meshless_proxy_requests_total{listener=\"web\",cluster=\"cart\"",
    )
}
