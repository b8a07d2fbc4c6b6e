//! Deterministic subsetting through real sockets: a control plane, real
//! backends and a proxy whose cluster asks for `subset: { size: 3 }` of a
//! 10-endpoint service, through a rolling update.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use common::*;
use http::{Method, StatusCode};
use meshless_backend::Backend;
use meshless_control::plane::ControlPlane;
use meshless_model::subset::subset;

const SIZE: usize = 3;
const N: usize = 10;

/// Keeps sending requests through the proxy until `stop`; counts the
/// requests and the ones that did not answer 200.
fn client_loop(
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<Vec<String>> {
    tokio::spawn(async move {
        let c = client();
        let mut errors = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let req = http::Request::get(format!("http://{addr}/"))
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .expect("request");
            sent.fetch_add(1, Ordering::Relaxed);
            match c.request(req).await {
                Ok(r) if r.status() == StatusCode::OK => {}
                Ok(r) => {
                    failed.fetch_add(1, Ordering::Relaxed);
                    errors.push(format!("status {}", r.status()));
                }
                Err(e) => {
                    failed.fetch_add(1, Ordering::Relaxed);
                    errors.push(e.to_string());
                }
            }
        }
        errors
    })
}

/// Polls `/clusters` until `stop`; returns the most endpoints `cart`
/// listed at once.
fn monitor(p: Arc<meshless_proxy::Proxy>, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<usize> {
    let most = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        while !stop.load(Ordering::Relaxed) {
            let n = cluster_addresses(&p, "cart").await.len();
            most.fetch_max(n, Ordering::Relaxed);
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        most.load(Ordering::Relaxed)
    })
}

async fn put(api: SocketAddr, id: &str, b: &Backend) {
    let (s, body) = api_call(
        api,
        Method::PUT,
        &format!("/v1/services/shop/cart/endpoints/{id}"),
        endpoint_json(id, b.local_addr()),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{body}");
}

async fn delete(api: SocketAddr, id: &str) {
    let (s, body) = api_call(
        api,
        Method::DELETE,
        &format!("/v1/services/shop/cart/endpoints/{id}"),
        serde_json::Value::Null,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{body}");
}

/// Waits until the proxy's cluster holds exactly `subset()` of `live`
/// (id -> backend) for index 0: the only subscriber holds index 0.
async fn follows_the_model(p: &meshless_proxy::Proxy, live: &BTreeMap<String, Backend>) {
    follows_a_subset_of(p, live, SIZE).await;
}

async fn follows_a_subset_of(
    p: &meshless_proxy::Proxy,
    live: &BTreeMap<String, Backend>,
    size: usize,
) {
    let ids: Vec<&str> = live.keys().map(String::as_str).collect();
    let want: BTreeSet<String> = subset(&ids, 0, size)
        .into_iter()
        .map(|id| live[id].local_addr().to_string())
        .collect();
    eventually("the proxy holds subset() of the live endpoints", || async {
        let got: BTreeSet<String> = cluster_addresses(p, "cart").await.into_iter().collect();
        got == want
    })
    .await;
}

/// A control plane with `N` endpoints `{prefix}-{i}` of shop/cart (each a
/// backend) and a proxy following a subset of `SIZE` of it, once the
/// proxy holds `subset()` of them.
async fn subset_of_cart(
    prefix: &str,
) -> (
    ControlPlane,
    BTreeMap<String, Backend>,
    meshless_proxy::Proxy,
    SocketAddr,
) {
    let plane = ControlPlane::start(plane_config(None))
        .await
        .expect("plane");
    let mut live: BTreeMap<String, Backend> = BTreeMap::new();
    for i in 0..N {
        let id = format!("{prefix}-{i}");
        live.insert(id.clone(), backend(&id).await);
    }
    let initial: Vec<(&str, SocketAddr)> = live
        .iter()
        .map(|(id, b)| (id.as_str(), b.local_addr()))
        .collect();
    register_cart(plane.api_addr(), &initial).await;
    let yaml = cart_proxy_yaml(
        plane.grpc_addr(),
        &format!("    subset: {{ size: {SIZE} }}\n"),
    );
    let (p, addr) = proxy(&yaml).await;
    follows_the_model(&p, &live).await;
    (plane, live, p, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subset_follows_a_rolling_update_without_failing_a_request() {
    let (plane, mut live, p, addr) = subset_of_cart("old").await;
    let api = plane.api_addr();
    let p = Arc::new(p);

    let stop = Arc::new(AtomicBool::new(false));
    let (sent, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let clients: Vec<_> = (0..2)
        .map(|_| client_loop(addr, stop.clone(), sent.clone(), failed.clone()))
        .collect();
    let most = monitor(Arc::clone(&p), stop.clone());

    // Every endpoint replaced, one at a time: the new one registered ready
    // (its process already listens), then the old one removed. Removed
    // processes stay up until the end, as a terminating pod finishes its
    // in-flight requests within its grace period.
    let mut retired = Vec::new();
    for i in 0..N {
        let new_id = format!("new-{i}");
        live.insert(new_id.clone(), backend(&new_id).await);
        put(api, &new_id, &live[&new_id]).await;
        follows_the_model(&p, &live).await;
        let old_id = format!("old-{i}");
        delete(api, &old_id).await;
        retired.extend(live.remove(&old_id));
        follows_the_model(&p, &live).await;
    }
    let before = sent.load(Ordering::Relaxed);
    eventually("requests keep flowing after the update", || async {
        sent.load(Ordering::Relaxed) > before + 20
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let errors = c.await.expect("client");
        assert!(errors.is_empty(), "failed requests: {errors:?}");
    }
    let most = most.await.expect("monitor");
    assert_eq!(failed.load(Ordering::Relaxed), 0);
    assert!(sent.load(Ordering::Relaxed) > 0);
    assert!(
        most <= SIZE,
        "/clusters listed {most} endpoints, more than {SIZE}"
    );
    assert_eq!(most, SIZE);

    // Requests now reach only the subset's backends, all of them new.
    let ids: Vec<&str> = live.keys().map(String::as_str).collect();
    let members: BTreeSet<&str> = subset(&ids, 0, SIZE).into_iter().collect();
    let counts = |live: &BTreeMap<String, Backend>| -> BTreeMap<String, u64> {
        live.iter()
            .map(|(id, b)| (id.clone(), b.requests()))
            .collect()
    };
    let start = counts(&live);
    let c = client();
    for _ in 0..30 {
        let (status, _, _) = get(&c, addr, "/", &[]).await;
        assert_eq!(status, StatusCode::OK);
    }
    let end = counts(&live);
    let served: Vec<&String> = end.keys().filter(|id| end[*id] > start[*id]).collect();
    assert!(!served.is_empty());
    assert!(
        served.iter().all(|id| members.contains(id.as_str())),
        "served by {served:?}, subset {members:?}"
    );
    drop(retired);

    // A reload with another size, then without a subset, then with one
    // again: each is a `Subscribe` the control plane answers with a reset.
    let p = Arc::into_inner(p).expect("the monitor is done");
    for size in [5, 0, SIZE] {
        let extra = if size == 0 {
            String::new()
        } else {
            format!("    subset: {{ size: {size} }}\n")
        };
        let yaml = cart_proxy_yaml(plane.grpc_addr(), &extra);
        let cfg = common::on_test_http1(
            meshless_proxy::ProxyConfig::parse(&yaml, "p.yaml").expect("valid"),
        );
        p.reload(cfg).await.expect("reload");
        follows_a_subset_of(&p, &live, if size == 0 { N } else { size }).await;
        let held = if size == 0 { 0.0 } else { 1.0 };
        eventually("one subset subscription while subsetted", || async {
            let page = get(&client(), api, "/metrics", &[]).await.2;
            metric(&page, "meshless_control_subset_subscriptions") == Some(held)
        })
        .await;
    }
    // The stream's end releases its subset index (the lease's guard).
    p.shutdown().await;
    eventually("no subset subscription left", || async {
        let page = get(&client(), api, "/metrics", &[]).await.2;
        metric(&page, "meshless_control_subset_subscriptions") == Some(0.0)
    })
    .await;
    plane.shutdown().await;
}

/// Puts endpoint `id` of `b` on its way out: not ready, still serving,
/// terminating (a pod in its grace period, before its endpoint is
/// deleted).
async fn put_terminating(api: SocketAddr, id: &str, b: &Backend) {
    let mut body = endpoint_json(id, b.local_addr());
    body["conditions"] =
        serde_json::json!({ "ready": false, "serving": true, "terminating": true });
    let (s, text) = api_call(
        api,
        Method::PUT,
        &format!("/v1/services/shop/cart/endpoints/{id}"),
        body,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{text}");
}

/// A subset member on its way out (terminating, as every pod of a rolling
/// update is before its endpoint is deleted) leaves the proxy's subset
/// and a ready endpoint takes its place: the subset is drawn from the
/// ready endpoints. When every endpoint is terminating, the subset is
/// drawn from the serving ones, which the proxy still uses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_members_are_replaced_by_ready_endpoints() {
    let (plane, mut live, p, addr) = subset_of_cart("pod").await;
    let api = plane.api_addr();

    // Its members terminate: ready ones take their places.
    let ids: Vec<String> = live.keys().cloned().collect();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    let members: Vec<String> = subset(&ids, 0, SIZE)
        .into_iter()
        .map(str::to_owned)
        .collect();
    let mut ending: BTreeMap<String, Backend> = BTreeMap::new();
    for id in &members {
        put_terminating(api, id, &live[id]).await;
        ending.extend(live.remove_entry(id));
    }
    follows_the_model(&p, &live).await;
    let c = client();
    let before: BTreeMap<&String, u64> = ending.iter().map(|(id, b)| (id, b.requests())).collect();
    for _ in 0..20 {
        let (status, _, _) = get(&c, addr, "/", &[]).await;
        assert_eq!(status, StatusCode::OK);
    }
    for (id, b) in &ending {
        assert_eq!(b.requests(), before[id], "{id} is terminating");
    }

    // Every endpoint terminating: the serving ones are drawn from, and
    // requests still succeed.
    for (id, b) in &live {
        put_terminating(api, id, b).await;
    }
    live.append(&mut ending);
    follows_the_model(&p, &live).await;
    for _ in 0..10 {
        let (status, _, _) = get(&c, addr, "/", &[]).await;
        assert_eq!(status, StatusCode::OK);
    }
    p.shutdown().await;
}

/// Waits until proxy `p` (in `zone`, the first zone-aware subscriber of
/// its zone: index 0) holds exactly `zone_subset()` of `live` (id ->
/// (zone, backend)).
async fn follows_its_zone(
    p: &meshless_proxy::Proxy,
    live: &BTreeMap<String, (&str, Backend)>,
    zone: &str,
    size: usize,
) -> BTreeSet<String> {
    let pairs: Vec<(&str, &str)> = live.iter().map(|(id, (z, _))| (id.as_str(), *z)).collect();
    let ids: BTreeSet<String> = meshless_model::subset::zone_subset(&pairs, zone, 0, size)
        .into_iter()
        .map(str::to_owned)
        .collect();
    let want: BTreeSet<String> = ids
        .iter()
        .map(|id| live[id].1.local_addr().to_string())
        .collect();
    eventually(
        "the proxy holds zone_subset() of the live endpoints",
        || async {
            let got: BTreeSet<String> = cluster_addresses(p, "cart").await.into_iter().collect();
            got == want
        },
    )
    .await;
    ids
}

/// Two proxies in different zones ask for a zone-aware subset of 2 of a
/// service spread over both zones: each holds endpoints of its own zone
/// only; when its zone has fewer than 2 left, it holds those and one from
/// the other zone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zone_aware_subset_takes_its_own_zone_first() {
    let plane = ControlPlane::start(plane_config(None))
        .await
        .expect("plane");
    let api = plane.api_addr();
    let mut live: BTreeMap<String, (&str, Backend)> = BTreeMap::new();
    for (zone, prefix) in [("z1", "a"), ("z2", "b")] {
        for i in 0..3 {
            let id = format!("{prefix}{i}");
            live.insert(id.clone(), (zone, backend(&id).await));
        }
    }
    register_cart(api, &[]).await;
    let put: Vec<_> = live
        .iter()
        .map(|(id, (zone, b))| {
            let mut e = endpoint_json(id, b.local_addr());
            e["zone"] = (*zone).into();
            e
        })
        .collect();
    put_cart_endpoints(api, put).await;

    let extra = "    subset: { size: 2, zone_aware: true }\n";
    let in_zone = |zone: &str| {
        format!(
            "node: {{ name: node-{zone}, zone: {zone} }}\n{}",
            cart_proxy_yaml(plane.grpc_addr(), extra)
        )
    };
    let (p1, _) = proxy(&in_zone("z1")).await;
    let (p2, _) = proxy(&in_zone("z2")).await;
    let held = follows_its_zone(&p1, &live, "z1", 2).await;
    assert!(held.iter().all(|id| id.starts_with('a')), "{held:?}");
    let held = follows_its_zone(&p2, &live, "z2", 2).await;
    assert!(held.iter().all(|id| id.starts_with('b')), "{held:?}");

    // z1 down to one endpoint: p1 holds it and one of z2; p2 is untouched.
    for id in ["a0", "a1"] {
        delete(api, id).await;
        live.remove(id);
    }
    let held = follows_its_zone(&p1, &live, "z1", 2).await;
    assert!(held.contains("a2"), "{held:?}");
    assert_eq!(held.iter().filter(|id| id.starts_with('b')).count(), 1);
    follows_its_zone(&p2, &live, "z2", 2).await;
    p1.shutdown().await;
    p2.shutdown().await;
    plane.shutdown().await;
}

/// `/clusters`' `cart` endpoints: (address, weight).
async fn cart_weights(p: &meshless_proxy::Proxy) -> BTreeMap<String, u64> {
    cluster_endpoints(p, "cart")
        .await
        .iter()
        .filter_map(|e| Some((e["address"].as_str()?.to_owned(), e["weight"].as_u64()?)))
        .collect()
}

/// A control-plane restart (same store) with the proxies coming back in
/// the other order: each proxy asks for the subset index it held and gets
/// its own subset back, instead of the one of whoever reconnected first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plane_restart_leaves_every_proxy_its_subset() {
    const K: usize = 2;
    let dir = tempfile::tempdir().expect("dir");
    let plane = ControlPlane::start(plane_config(Some(dir.path().to_path_buf())))
        .await
        .expect("plane");
    let mut live: BTreeMap<String, Backend> = BTreeMap::new();
    for i in 0..6 {
        live.insert(format!("e-{i}"), backend(&format!("e-{i}")).await);
    }
    let initial: Vec<(&str, SocketAddr)> = live
        .iter()
        .map(|(id, b)| (id.as_str(), b.local_addr()))
        .collect();
    register_cart(plane.api_addr(), &initial).await;
    let ids: Vec<&str> = live.keys().map(String::as_str).collect();
    let subset_of = |index: u64| -> BTreeSet<String> {
        subset(&ids, index, K)
            .into_iter()
            .map(|id| live[id].local_addr().to_string())
            .collect()
    };
    // One relay per proxy, so the test decides who reconnects first.
    let relays = [
        Relay::start(plane.grpc_addr()).await,
        Relay::start(plane.grpc_addr()).await,
    ];
    let relay_addrs = [relays[0].local_addr(), relays[1].local_addr()];
    let extra = format!("    subset: {{ size: {K} }}\n");
    let mut proxies = Vec::new();
    for (i, relay) in relay_addrs.iter().enumerate() {
        let (p, _) = proxy(&cart_proxy_yaml(*relay, &extra)).await;
        // Connected one after the other: indices 0 then 1.
        let want = subset_of(i as u64);
        eventually("the proxy holds its subset", || async {
            cluster_addresses(&p, "cart")
                .await
                .into_iter()
                .collect::<BTreeSet<_>>()
                == want
        })
        .await;
        proxies.push(p);
    }
    assert_ne!(subset_of(0), subset_of(1));

    for r in relays {
        r.stop().await;
    }
    plane.shutdown().await;
    let plane = ControlPlane::start(plane_config(Some(dir.path().to_path_buf())))
        .await
        .expect("plane restarts");
    let api = plane.api_addr();
    // The second proxy first.
    let second = Relay::start_on(relay_addrs[1], plane.grpc_addr()).await;
    subscribed(api, 1).await;
    let first = Relay::start_on(relay_addrs[0], plane.grpc_addr()).await;
    subscribed(api, 2).await;
    // A change every member sees (weight 2, same ids): a proxy showing it
    // follows the restarted plane.
    let reweighted: Vec<serde_json::Value> = initial
        .iter()
        .map(|(id, a)| {
            let mut e = endpoint_json(id, *a);
            e["weight"] = 2.into();
            e
        })
        .collect();
    put_cart_endpoints(api, reweighted).await;
    for (i, p) in proxies.iter().enumerate() {
        eventually("the proxy follows the restarted plane", || async {
            let w = cart_weights(p).await;
            w.len() == K && w.values().all(|w| *w == 2)
        })
        .await;
        let got: BTreeSet<String> = cart_weights(p).await.into_keys().collect();
        assert_eq!(got, subset_of(i as u64), "proxy {i} keeps its subset");
    }
    drop(proxies);
    first.stop().await;
    second.stop().await;
    plane.shutdown().await;
}
