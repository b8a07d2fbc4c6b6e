//! Claim: reload without dropping a request, with listeners added, moved
//! and removed and endpoints changed, under concurrent keep-alive and
//! new-connection clients; listeners and clusters removed with requests in
//! flight; a reload that changes which services the proxy watches.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::*;
use http::{Method, StatusCode};
use meshless_control::plane::ControlPlane;
use meshless_proxy::ProxyConfig;

/// Listener `web` at `web` to cluster `c` with `endpoints`, plus one
/// listener per `(name, address)` in `side` to cluster `side`.
fn reload_yaml(
    web: SocketAddr,
    endpoints: &[SocketAddr],
    side: &[(String, SocketAddr)],
    side_cluster: SocketAddr,
) -> String {
    let mut y = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 20s\nlisteners:\n  - name: web\n    address: \"{web}\"\n    routes: [{{ cluster: c }}]\n"
    );
    for (name, addr) in side {
        y += &format!(
            "  - name: {name}\n    address: \"{addr}\"\n    routes: [{{ cluster: side }}]\n"
        );
    }
    y += "clusters:\n  - name: c\n    endpoints:\n";
    for e in endpoints {
        y += &format!("      - {{ address: \"{e}\" }}\n");
    }
    y += &format!("  - name: side\n    endpoints: [{{ address: \"{side_cluster}\" }}]\n");
    y
}

/// A client on `addr` until `stop`: keep-alive (one pooled client) or a
/// new connection per request. Returns (ok, failures with reasons).
fn client_loop(
    addr: SocketAddr,
    keep_alive: bool,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(u32, Vec<String>)> {
    tokio::spawn(async move {
        let pooled = client();
        let (mut ok, mut failed) = (0, Vec::new());
        while !stop.load(Ordering::SeqCst) {
            let c = if keep_alive { pooled.clone() } else { client() };
            let req = http::Request::get(format!("http://{addr}/"))
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .expect("request");
            match c.request(req).await {
                Ok(r) if r.status() == StatusCode::OK => {
                    let _ = http_body_util::BodyExt::collect(r.into_body()).await;
                    ok += 1;
                }
                Ok(r) => failed.push(format!("status {}", r.status())),
                Err(e) => failed.push(format!("{e:?}")),
            }
        }
        (ok, failed)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_that_move_listeners_and_change_endpoints_drop_no_request() {
    let bs = backends(5).await;
    let addrs: Vec<SocketAddr> = bs.iter().map(|b| b.local_addr()).collect();
    let side = Gated::start("side").await;
    side.open();
    // Start on a free port, then keep that address for `web`.
    let (p, web) = proxy(&reload_yaml(
        "127.0.0.1:0".parse().expect("addr"),
        &addrs[..3],
        &[],
        side.local_addr(),
    ))
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for keep_alive in [true, true, false, false] {
        load.push(client_loop(web, keep_alive, stop.clone()));
    }
    let mut previous: Vec<(String, SocketAddr)> = Vec::new();
    let reloads = 30;
    for i in 0..reloads {
        // Endpoints rotate over five backends, three at a time.
        let eps: Vec<SocketAddr> = (0..3).map(|k| addrs[(i + k) % 5]).collect();
        // One side listener moves to a new port each time, one is added
        // every other time and removed the time after.
        let mut side_listeners = vec![("moving".to_owned(), "127.0.0.1:0".parse().expect("addr"))];
        if i % 2 == 0 {
            side_listeners.push((format!("added{i}"), "127.0.0.1:0".parse().expect("addr")));
        }
        let cfg = ProxyConfig::parse(
            &reload_yaml(web, &eps, &side_listeners, side.local_addr()),
            "reload.yaml",
        )
        .expect("valid");
        p.reload(cfg).await.expect("reload");
        let now: Vec<(String, SocketAddr)> = {
            let mut v = Vec::new();
            for (name, _) in &side_listeners {
                v.push((
                    name.clone(),
                    p.listener_addr(name).await.expect("listener bound"),
                ));
            }
            v
        };
        for (name, addr) in &now {
            assert_eq!(
                get(&client(), *addr, "/", &[]).await.0,
                StatusCode::OK,
                "{name} serves"
            );
        }
        for (name, old) in &previous {
            if !now.iter().any(|(_, a)| a == old) {
                eventually(&format!("old {name} at {old} closed"), || async {
                    tokio::net::TcpStream::connect(*old).await.is_err()
                })
                .await;
            }
        }
        previous = now;
    }
    stop.store(true, Ordering::SeqCst);
    let mut total = 0;
    for t in load {
        let (ok, failed) = t.await.expect("task");
        assert!(
            failed.is_empty(),
            "{} failed: {:?}",
            failed.len(),
            &failed[..failed.len().min(5)]
        );
        total += ok;
    }
    assert!(total >= 30, "load ran during the reloads: {total}");
    assert_eq!(
        proxy_metric(&p, "meshless_proxy_reloads_total{result=\"success\"}").await,
        f64::from(u32::try_from(reloads).expect("count"))
    );
    // Every backend served through `web` at some point.
    for b in &bs {
        assert!(b.requests() > 0, "{} served", b.name());
    }
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_listener_and_its_cluster_lets_requests_in_flight_finish() {
    let bs = backends(1).await;
    let held = Gated::start("held").await;
    let (p, web) = proxy(&reload_yaml(
        "127.0.0.1:0".parse().expect("addr"),
        &[bs[0].local_addr()],
        &[("side".to_owned(), "127.0.0.1:0".parse().expect("addr"))],
        held.local_addr(),
    ))
    .await;
    let side_addr = p.listener_addr("side").await.expect("side");
    let in_flight = tokio::spawn(async move { get(&client(), side_addr, "/", &[]).await });
    eventually("a request in flight on the side listener", || async {
        held.held() == 1
    })
    .await;
    // Reload without the side listener and without its cluster.
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 20s\nlisteners:\n  - name: web\n    address: \"{web}\"\n    routes: [{{ cluster: c }}]\nclusters:\n  - name: c\n    endpoints: [{{ address: \"{}\" }}]\n",
        bs[0].local_addr()
    );
    p.reload(common::on_test_http1(
        ProxyConfig::parse(&yaml, "reload.yaml").expect("valid"),
    ))
    .await
    .expect("reload");
    assert!(p.listener_addr("side").await.is_none());
    eventually("the removed listener stops accepting", || async {
        tokio::net::TcpStream::connect(side_addr).await.is_err()
    })
    .await;
    let (_, clusters) = admin(&p, "/clusters").await;
    assert!(!clusters.contains("\"name\": \"side\""), "{clusters}");
    assert!(
        !in_flight.is_finished(),
        "the request is still held upstream"
    );
    held.open();
    let (s, b, _) = in_flight.await.expect("task");
    assert_eq!(
        (s, b.as_str()),
        (StatusCode::OK, "held"),
        "finished on the config it began with"
    );
    assert_eq!(get(&client(), web, "/", &[]).await.0, StatusCode::OK);
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_changes_the_watched_services_subscribes_without_reconnecting() {
    let plane = ControlPlane::start(plane_config(None))
        .await
        .expect("plane");
    let (api, grpc) = (plane.api_addr(), plane.grpc_addr());
    let bs = backends(2).await;
    register_cart(api, &[("b0", bs[0].local_addr())]).await;
    let (s, _) = api_call(
        api,
        Method::PUT,
        "/v1/services/shop/other",
        serde_json::json!({}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = api_call(
        api,
        Method::PUT,
        "/v1/services/shop/other/endpoints/b1",
        endpoint_json("b1", bs[1].local_addr()),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let yaml = cart_proxy_yaml(grpc, "");
    let (p, web) = proxy(&yaml).await;
    eventually("cart from the control plane", || async {
        get(&client(), web, "/", &[]).await.1 == "b0"
    })
    .await;
    let snapshots = metric(
        &get(&client(), api, "/metrics", &[]).await.2,
        "meshless_control_snapshots_total",
    );
    // Reload: the listener now routes to a new cluster following shop/other.
    let next = yaml
        .replace(
            "routes: [{ cluster: cart }]",
            "routes: [{ cluster: other }]",
        )
        .replace(
            "    service: shop/cart\n",
            "    service: shop/cart\n  - name: other\n    service: shop/other\n",
        )
        .replacen(
            "address: \"127.0.0.1:0\"\n    routes",
            &format!("address: \"{web}\"\n    routes"),
            1,
        );
    p.reload(common::on_test_http1(
        ProxyConfig::parse(&next, "reload.yaml").expect("valid"),
    ))
    .await
    .expect("reload");
    eventually("shop/other's endpoints arrive", || async {
        get(&client(), web, "/", &[]).await.1 == "b1"
    })
    .await;
    // A later change to the newly watched service reaches the proxy too.
    let (s, _) = api_call(
        api,
        Method::PUT,
        "/v1/services/shop/other/endpoints/b0",
        endpoint_json("b0", bs[0].local_addr()),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    eventually("a change to shop/other", || async {
        cluster_addresses(&p, "other").await.len() == 2
    })
    .await;
    let page = get(&client(), api, "/metrics", &[]).await.2;
    assert_eq!(
        metric(&page, "meshless_control_snapshots_total"),
        snapshots,
        "no reconnect: a subscription change"
    );
    assert_eq!(metric(&page, "meshless_control_subscribers"), Some(1.0));
    p.shutdown().await;
    plane.shutdown().await;
}
