//! Claim: static stability. A proxy that loses its control plane keeps
//! serving its last endpoints, detects a silent stream after the 15 s
//! silence limit, reconnects with backoff and resumes by version (no new
//! snapshot); it survives a control-plane restart under traffic, and one
//! that comes back with a younger state than the proxy has seen.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use http::{Method, StatusCode};
use meshless_control::plane::ControlPlane;

/// Keep-alive clients sending GETs until `stop`; returns (ok, failed).
fn traffic(
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<u64>> {
    (0..2)
        .map(|_| {
            let (stop, ok) = (stop.clone(), ok.clone());
            tokio::spawn(async move {
                let c = client();
                let mut failed = 0;
                while !stop.load(Ordering::SeqCst) {
                    match get(&c, addr, "/", &[]).await.0 {
                        StatusCode::OK => {
                            ok.fetch_add(1, Ordering::SeqCst);
                        }
                        _ => failed += 1,
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                failed
            })
        })
        .collect()
}

async fn plane_metric(api: SocketAddr, series: &str) -> f64 {
    metric(&get(&client(), api, "/metrics", &[]).await.2, series).unwrap_or(0.0)
}

/// Waits, up to `limit`, for `ok` to hold.
async fn within<F, Fut>(what: &str, limit: Duration, mut ok: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = std::time::Instant::now();
    while !ok().await {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_stream_is_dropped_and_resumed_by_version_and_a_restart_costs_nothing() {
    let tmp = tempfile::Builder::new()
        .prefix("meshless-claims-static-")
        .tempdir()
        .expect("dir");
    let dir = tmp.path().to_path_buf();
    let plane = ControlPlane::start(plane_config(Some(dir.clone())))
        .await
        .expect("plane");
    let (api, grpc) = (plane.api_addr(), plane.grpc_addr());
    let bs = backends(3).await;
    register_cart(
        api,
        &[("b0", bs[0].local_addr()), ("b1", bs[1].local_addr())],
    )
    .await;
    let relay = Relay::start(grpc).await;
    let (p, addr) = proxy(&cart_proxy_yaml(relay.local_addr(), "")).await;
    eventually("two endpoints", || async {
        cluster_addresses(&p, "cart").await.len() == 2
    })
    .await;
    let (stop, ok) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let load = traffic(addr, stop.clone(), ok.clone());
    let snapshots = plane_metric(api, "meshless_control_snapshots_total").await;
    assert!(snapshots >= 1.0);
    // The stream goes silent (no heartbeats, no TCP close): the proxy keeps
    // serving, and after the 15 s silence limit reconnects through the
    // relay (new connections are forwarded) while the old one stays open.
    relay.freeze();
    // A change made while the proxy cannot hear it.
    let (s, _) = api_call(
        api,
        Method::PUT,
        "/v1/services/shop/cart/endpoints/b2",
        endpoint_json("b2", bs[2].local_addr()),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    within(
        "reconnect after the silence limit",
        Duration::from_secs(60),
        || async {
            plane_metric(api, "meshless_control_subscribers").await >= 2.0
                && cluster_addresses(&p, "cart").await.len() == 3
        },
    )
    .await;
    assert_eq!(
        plane_metric(api, "meshless_control_snapshots_total").await,
        snapshots,
        "resumed from its version: the missed change was replayed, no snapshot"
    );
    // The control plane restarts, on the same ports with its store, under traffic.
    let served_before = ok.load(Ordering::SeqCst);
    plane.shutdown().await;
    let mut cfg = plane_config(Some(dir.clone()));
    cfg.api_address = api;
    cfg.grpc_address = grpc;
    eventually("traffic while the control plane is down", || async {
        ok.load(Ordering::SeqCst) >= served_before + 20
    })
    .await;
    let plane = ControlPlane::start(cfg).await.expect("plane restarts");
    let (s, _) = api_call(
        api,
        Method::DELETE,
        "/v1/services/shop/cart/endpoints/b0",
        serde_json::Value::Null,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    eventually("the proxy follows the restarted control plane", || async {
        let a = cluster_addresses(&p, "cart").await;
        a.len() == 2 && !a.contains(&bs[0].local_addr().to_string())
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for t in load {
        assert_eq!(t.await.expect("task"), 0, "no request failed");
    }
    p.shutdown().await;
    plane.shutdown().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_with_a_younger_state_is_followed_not_skipped() {
    let bs = backends(2).await;
    // Plane A (in memory) reaches version > 30.
    let (a, relay, p) = followed_plane(bs[0].local_addr(), 40).await;
    let (api, grpc, relay_addr) = (a.api_addr(), a.grpc_addr(), relay.local_addr());
    // Plane B replaces it with an empty state (versions start again).
    a.shutdown().await;
    let b = in_memory_plane_on(api, grpc).await;
    register_cart(api, &[("b0-b", bs[0].local_addr())]).await;
    // A change after B's snapshot: once the proxy has it, it has processed
    // the snapshot's end too (same stream, in order).
    let (s, _) = api_call(
        api,
        Method::PUT,
        "/v1/services/shop/cart/endpoints/b0-c",
        endpoint_json("b0-c", bs[0].local_addr()),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    eventually("the proxy on plane b", || async {
        admin(&p, "/clusters").await.1.contains("\"id\": \"b0-c\"")
    })
    .await;
    // The proxy loses plane B; meanwhile B changes the service, then
    // passes the version the proxy saw from A with other writes.
    relay.stop().await;
    let (s, _) = api_call(
        api,
        Method::PUT,
        "/v1/services/shop/cart/endpoints/b1",
        endpoint_json("b1", bs[1].local_addr()),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    bump(api, 60).await;
    let relay = Relay::start_on(relay_addr, grpc).await;
    eventually("the change made while disconnected", || async {
        cluster_addresses(&p, "cart")
            .await
            .contains(&bs[1].local_addr().to_string())
    })
    .await;
    p.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_control_plane_past_the_proxys_version_sends_a_snapshot() {
    let bs = backends(2).await;
    // Plane A (in memory): the proxy follows it up to some version v.
    let (a, relay, p) = followed_plane(bs[0].local_addr(), 5).await;
    let (api, grpc, relay_addr) = (a.api_addr(), a.grpc_addr(), relay.local_addr());
    // While the proxy is cut off, plane B replaces A (versions start
    // again), holds only b1 and passes v with writes of its own. Resuming
    // "from v" would replay B's last few deltas on top of A's state.
    relay.stop().await;
    a.shutdown().await;
    let b = in_memory_plane_on(api, grpc).await;
    register_cart(api, &[("b1", bs[1].local_addr())]).await;
    bump(api, 40).await;
    let relay = Relay::start_on(relay_addr, grpc).await;
    eventually("exactly plane b's endpoints", || async {
        cluster_addresses(&p, "cart").await == vec![bs[1].local_addr().to_string()]
    })
    .await;
    let snapshots = plane_metric(api, "meshless_control_snapshots_total").await;
    assert!(snapshots >= 1.0, "the resume was answered by a snapshot");
    p.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

/// A proxy whose config gains a service while its stream is down (a
/// reload during an outage) gets that service whole when it reconnects: a
/// resume replays only changes after its version, which would leave the
/// new service empty, so the stream starts from a snapshot instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_added_while_disconnected_arrives_whole() {
    let bs = backends(2).await;
    let (a, relay, p) = followed_plane(bs[0].local_addr(), 3).await;
    let (api, grpc, relay_addr) = (a.api_addr(), a.grpc_addr(), relay.local_addr());
    let (s, _) = api_call(
        api,
        Method::PUT,
        "/v1/services/shop/pay",
        serde_json::json!({ "ports": [{ "port": 80 }] }),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = api_call(
        api,
        Method::PUT,
        "/v1/services/shop/pay/endpoints/p0",
        endpoint_json("p0", bs[1].local_addr()),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    // A change the proxy follows, after shop/pay's: its resume version
    // passes the writes that made shop/pay.
    let (s, _) = api_call(
        api,
        Method::PUT,
        "/v1/services/shop/cart/endpoints/b0-again",
        endpoint_json("b0-again", bs[0].local_addr()),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    eventually("the second cart endpoint", || async {
        cluster_addresses(&p, "cart").await.len() == 2
    })
    .await;
    relay.stop().await;
    // Writes meanwhile move the version on: a resume is possible.
    bump(api, 2).await;
    let yaml = format!(
        "{}  - name: pay\n    service: shop/pay\n",
        cart_proxy_yaml(relay_addr, "")
    );
    p.reload(common::on_test_http1(
        meshless_proxy::ProxyConfig::parse(&yaml, "reload.yaml").expect("valid"),
    ))
    .await
    .expect("reload");
    let relay = Relay::start_on(relay_addr, grpc).await;
    eventually("shop/pay's endpoint after the reconnect", || async {
        cluster_addresses(&p, "pay").await == vec![bs[1].local_addr().to_string()]
    })
    .await;
    assert_eq!(cluster_addresses(&p, "cart").await.len(), 2);
    p.shutdown().await;
    a.shutdown().await;
    relay.stop().await;
}

/// An in-memory control plane holding `shop/cart` = {b0 at `b0`} after
/// `bumps` further writes, and a proxy following it through a relay,
/// once the proxy routes to exactly b0.
async fn followed_plane(
    b0: SocketAddr,
    bumps: usize,
) -> (ControlPlane, Relay, meshless_proxy::Proxy) {
    let a = ControlPlane::start(plane_config(None))
        .await
        .expect("plane a");
    register_cart(a.api_addr(), &[("b0", b0)]).await;
    bump(a.api_addr(), bumps).await;
    let relay = Relay::start(a.grpc_addr()).await;
    let (p, _addr) = proxy(&cart_proxy_yaml(relay.local_addr(), "")).await;
    eventually("b0 from plane a", || async {
        cluster_addresses(&p, "cart").await == vec![b0.to_string()]
    })
    .await;
    (a, relay, p)
}

/// A new in-memory control plane (versions start again) on the API and
/// stream addresses of one that stopped.
async fn in_memory_plane_on(api: SocketAddr, grpc: SocketAddr) -> ControlPlane {
    let mut cfg = plane_config(None);
    cfg.api_address = api;
    cfg.grpc_address = grpc;
    ControlPlane::start(cfg).await.expect("plane b")
}

/// `n` writes to another service: the registry version grows by `n`.
async fn bump(api: SocketAddr, n: usize) {
    let (s, _) = api_call(
        api,
        Method::PUT,
        "/v1/services/shop/other",
        serde_json::json!({}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    for i in 0..n {
        let (s, _) = api_call(
            api,
            Method::PUT,
            &format!("/v1/services/shop/other/endpoints/x{}", i % 3),
            endpoint_json(
                &format!("x{}", i % 3),
                SocketAddr::from(([127, 0, 0, 1], 9 + i as u16)),
            ),
        )
        .await;
        assert_eq!(s, StatusCode::OK);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_an_idle_stream_past_the_silence_limit() {
    let plane = ControlPlane::start(plane_config(None))
        .await
        .expect("plane");
    let (api, grpc) = (plane.api_addr(), plane.grpc_addr());
    let bs = backends(1).await;
    register_cart(api, &[("b0", bs[0].local_addr())]).await;
    let (p, _addr) = proxy(&cart_proxy_yaml(grpc, "")).await;
    eventually("the endpoint", || async {
        cluster_addresses(&p, "cart").await.len() == 1
    })
    .await;
    let snapshots = plane_metric(api, "meshless_control_snapshots_total").await;
    // No change for longer than the 15 s silence limit: only heartbeats
    // (every 5 s) flow, and they must keep the stream open.
    let sent_before = plane_metric(api, "meshless_control_messages_sent_total").await;
    tokio::time::sleep(Duration::from_secs(17)).await;
    let sent = plane_metric(api, "meshless_control_messages_sent_total").await;
    assert!(
        sent >= sent_before + 2.0,
        "heartbeats were sent: {sent_before} -> {sent}"
    );
    assert_eq!(
        plane_metric(api, "meshless_control_snapshots_total").await,
        snapshots,
        "the stream was not dropped and reopened"
    );
    assert_eq!(plane_metric(api, "meshless_control_subscribers").await, 1.0);
    p.shutdown().await;
    plane.shutdown().await;
}
