//! Per-endpoint metric series follow the endpoints: churned endpoints
//! leave `/metrics`, live ones stay, and a request still in flight on an
//! endpoint that left does not bring its series back for good.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;

use common::*;
use meshless_control::plane::ControlPlane;

/// Rounds of the churn test, and fresh endpoint ids per round.
const ROUNDS: usize = 50;
const PER_ROUND: usize = 20;

/// A proxy following `shop/cart` with every delta applied at once.
fn yaml(grpc: SocketAddr) -> String {
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 5s\ncontrol: {{ address: \"{grpc}\", update_merge_window: 0s }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: cart }}]\nclusters:\n  - name: cart\n    service: shop/cart\n    balancer: {{ policy: round_robin }}\n    retries: {{ count: 0 }}\n"
    )
}

/// Every endpoint id a line of `page` names (`endpoint="..."`).
fn labelled(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = &l[l.find("endpoint=\"")? + "endpoint=\"".len()..];
            Some(rest[..rest.find('"')?].to_owned())
        })
        .collect()
}

/// The endpoint ids of cluster `cart` in `/clusters`.
async fn cluster_ids(p: &meshless_proxy::Proxy) -> BTreeSet<String> {
    cluster_endpoints(p, "cart")
        .await
        .iter()
        .filter_map(|e| e["id"].as_str().map(str::to_owned))
        .collect()
}

/// Replaces the endpoints `old` of `shop/cart` by `new`, all at `addr`,
/// and waits until the proxy's cluster holds exactly `new`.
async fn replace(
    p: &meshless_proxy::Proxy,
    api: SocketAddr,
    addr: SocketAddr,
    old: &BTreeSet<String>,
    new: &BTreeSet<String>,
) {
    let put: Vec<_> = new.iter().map(|id| endpoint_json(id, addr)).collect();
    let (s, body) = api_call(
        api,
        http::Method::POST,
        "/v1/services/shop/cart/endpoints",
        serde_json::json!({ "put": put, "delete": old }),
    )
    .await;
    assert_eq!(s, http::StatusCode::OK, "{body}");
    eventually("the proxy holds the new endpoints", || async {
        cluster_ids(p).await == *new
    })
    .await;
}

/// 1,000 endpoint ids pass through a cluster, each serving requests while
/// it is there; afterwards `/metrics` names only the live ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churned_endpoints_leave_the_metrics() {
    let plane = ControlPlane::start(plane_config(None))
        .await
        .expect("plane");
    let (api, grpc) = (plane.api_addr(), plane.grpc_addr());
    let b = backend("b").await;
    register_cart(api, &[]).await;
    let (p, addr) = proxy(&yaml(grpc)).await;
    let c = client();
    let mut live = BTreeSet::new();
    let mut ever = BTreeSet::new();
    for round in 0..ROUNDS {
        let next: BTreeSet<String> = (0..PER_ROUND).map(|i| format!("pod-{round}-{i}")).collect();
        replace(&p, api, b.local_addr(), &live, &next).await;
        live = next;
        // Round robin over equal weights: PER_ROUND picks take each once.
        for _ in 0..PER_ROUND {
            let (s, _, _) = get(&c, addr, "/", &[]).await;
            assert_eq!(s, http::StatusCode::OK);
        }
        ever.extend(labelled(&admin(&p, "/metrics").await.1));
    }
    // The test churned what it says: every id had its series at some point.
    assert_eq!(ever.len(), ROUNDS * PER_ROUND, "series seen");
    eventually("only live endpoints are labelled", || async {
        labelled(&admin(&p, "/metrics").await.1) == live
    })
    .await;
    assert_eq!(p.state().metrics.endpoint_series.live(), PER_ROUND);
    p.shutdown().await;
}

/// A request in flight on an endpoint that leaves ends normally; the
/// series it records into are removed once it ends, and stay removed;
/// the live endpoint's series stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_across_departure_leaves_no_series() {
    let plane = ControlPlane::start(plane_config(None))
        .await
        .expect("plane");
    let (api, grpc) = (plane.api_addr(), plane.grpc_addr());
    let gated = Gated::start("old").await;
    let b = backend("new").await;
    register_cart(api, &[("old", gated.local_addr())]).await;
    let (p, addr) = proxy(&yaml(grpc)).await;
    eventually("the proxy holds `old`", || async {
        cluster_ids(&p).await == BTreeSet::from(["old".to_owned()])
    })
    .await;
    let held = tokio::spawn(async move { get(&client(), addr, "/", &[]).await.0 });
    eventually("the request is held upstream", || async {
        gated.held() == 1
    })
    .await;
    let (s, body) = api_call(
        api,
        http::Method::POST,
        "/v1/services/shop/cart/endpoints",
        serde_json::json!({ "put": [endpoint_json("new", b.local_addr())], "delete": ["old"] }),
    )
    .await;
    assert_eq!(s, http::StatusCode::OK, "{body}");
    eventually("the proxy holds `new` only", || async {
        cluster_ids(&p).await == BTreeSet::from(["new".to_owned()])
    })
    .await;
    gated.open();
    assert_eq!(held.await.expect("task"), http::StatusCode::OK);
    let c = client();
    let (s, _, _) = get(&c, addr, "/", &[]).await;
    assert_eq!(s, http::StatusCode::OK);
    let only_new = BTreeSet::from(["new".to_owned()]);
    eventually("`old`'s series are gone", || async {
        labelled(&admin(&p, "/metrics").await.1) == only_new
    })
    .await;
    // Later requests and scrapes do not bring them back.
    for _ in 0..5 {
        let (s, _, _) = get(&c, addr, "/", &[]).await;
        assert_eq!(s, http::StatusCode::OK);
    }
    let page = admin(&p, "/metrics").await.1;
    assert_eq!(labelled(&page), only_new, "{page}");
    let ok = "meshless_proxy_requests_total{listener=\"web\",cluster=\"cart\",endpoint=\"new\",class=\"2xx\"}";
    assert_eq!(metric(&page, ok), Some(6.0), "{page}");
    p.shutdown().await;
}
