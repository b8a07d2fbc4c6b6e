//! Circuit breakers, draining readiness, and a backend killed with
//! requests in flight (GETs retried, POSTs never replayed), through real
//! sockets with upstreams that hold answers until told.

mod common;

use std::net::SocketAddr;

use bytes::Bytes;
use common::*;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};

fn yaml(endpoints: &[SocketAddr], cluster_extra: &str) -> String {
    let eps: String = endpoints
        .iter()
        .map(|a| format!("      - {{ address: \"{a}\" }}\n"))
        .collect();
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 20s\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: c }}]\nclusters:\n  - name: c\n    endpoints:\n{eps}{cluster_extra}"
    )
}

async fn overflows(p: &meshless_proxy::Proxy, limit: &str) -> f64 {
    proxy_metric(
        p,
        &format!("meshless_proxy_overflows_total{{cluster=\"c\",limit=\"{limit}\"}}"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_pending_sheds_while_responses_are_awaited() {
    let up = Gated::start("g").await;
    let (p, addr) = proxy(&yaml(
        &[up.local_addr()],
        "    circuit_breakers: { max_pending: 1 }\n",
    ))
    .await;
    let held = tokio::spawn(async move { get(&client(), addr, "/", &[]).await });
    eventually("one request awaiting headers", || async { up.held() == 1 }).await;
    let (s, _, body) = get(&client(), addr, "/", &[]).await;
    assert_eq!(
        (s, body.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "overflow: max_pending\n")
    );
    assert_eq!(overflows(&p, "max_pending").await, 1.0);
    up.open();
    assert_eq!(held.await.expect("task").0, StatusCode::OK);
    assert_eq!(
        get(&client(), addr, "/", &[]).await.0,
        StatusCode::OK,
        "slot given back"
    );
    assert_eq!(up.seen().len(), 2);
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_connections_sheds_when_no_connection_can_be_opened() {
    let up = Gated::start("g").await;
    let (p, addr) = proxy(&yaml(
        &[up.local_addr()],
        "    retries: { count: 0 }\n    circuit_breakers: { max_connections: 1 }\n",
    ))
    .await;
    // HTTP/1.1 upstream: the held request owns the only connection.
    let held = tokio::spawn(async move { get(&client(), addr, "/", &[]).await });
    eventually("one request holding the connection", || async {
        up.held() == 1
    })
    .await;
    let (s, _, body) = get(&client(), addr, "/", &[]).await;
    assert_eq!(
        (s, body.as_str()),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "overflow: max_connections\n"
        )
    );
    assert_eq!(overflows(&p, "max_connections").await, 1.0);
    up.open();
    assert_eq!(held.await.expect("task").0, StatusCode::OK);
    // The connection is back in the pool: reused, no overflow.
    for _ in 0..3 {
        assert_eq!(get(&client(), addr, "/", &[]).await.0, StatusCode::OK);
    }
    assert_eq!(overflows(&p, "max_connections").await, 1.0);
    let (_, clusters) = admin(&p, "/clusters").await;
    assert!(
        clusters.contains("\"upstream_connections\": 1"),
        "{clusters}"
    );
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_answers_503_while_draining_and_in_flight_requests_finish() {
    let up = Gated::start("g").await;
    let (p, addr) = proxy(&yaml(&[up.local_addr()], "")).await;
    let admin_addr = p.admin_addr();
    assert_eq!(
        get(&client(), admin_addr, "/ready", &[]).await.0,
        StatusCode::OK
    );
    let held = tokio::spawn(async move { get(&client(), addr, "/", &[]).await });
    eventually("a request in flight", || async { up.held() == 1 }).await;
    let shutdown = tokio::spawn(p.shutdown());
    eventually("/ready says 503 while draining", || async {
        get(&client(), admin_addr, "/ready", &[]).await.0 == StatusCode::SERVICE_UNAVAILABLE
    })
    .await;
    eventually("the listener stops accepting", || async {
        tokio::net::TcpStream::connect(addr).await.is_err()
    })
    .await;
    assert!(
        !shutdown.is_finished(),
        "drain waits for the request in flight"
    );
    up.open();
    let (s, b, _) = held.await.expect("task");
    assert_eq!((s, b.as_str()), (StatusCode::OK, "g"));
    shutdown.await.expect("shutdown");
}

/// Status and body of one request with an `x-id` header.
async fn send(c: &TestClient, addr: SocketAddr, method: Method, id: usize) -> (StatusCode, String) {
    let body = if method == Method::POST {
        Bytes::from(format!("order {id}"))
    } else {
        Bytes::new()
    };
    let req = Request::builder()
        .method(method)
        .uri(format!("http://{addr}/"))
        .header("x-id", id.to_string())
        .body(Full::new(body))
        .expect("request");
    let resp = c.request(req).await.expect("response");
    let s = resp.status();
    let b = resp.into_body().collect().await.expect("body").to_bytes();
    (s, String::from_utf8_lossy(&b).into_owned())
}

fn ids(seen: &[Seen], method: &Method) -> Vec<String> {
    seen.iter()
        .filter(|s| s.method == *method)
        .filter_map(|s| s.headers.get("x-id")?.to_str().ok().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_backend_in_flight_gets_are_retried_and_posts_are_not_replayed() {
    let (g0, g1, g2) = (
        Gated::start("g0").await,
        Gated::start("g1").await,
        Gated::start("g2").await,
    );
    g0.open();
    g2.open();
    let (p, addr) = proxy(&yaml(
        &[g0.local_addr(), g1.local_addr(), g2.local_addr()],
        // A budget that admits every retry here (the budget has its own test).
        "    retries: { count: 2, on: [connect_failure, reset, 5xx], budget_percent: 100 }\n    outlier_detection: { consecutive_5xx: 0, consecutive_gateway_errors: 0 }\n",
    ))
    .await;
    // 24 concurrent requests, GETs and POSTs in turn, each sent once the
    // one before reached an upstream: round robin gives g1 every third,
    // so it holds both kinds (sent all at once, their order of arrival
    // was the scheduler's, and on a loaded machine g1 once held only GETs).
    let mut tasks = Vec::new();
    for id in 0..24 {
        let method = if id % 2 == 0 {
            Method::GET
        } else {
            Method::POST
        };
        tasks.push(tokio::spawn(async move {
            (id, method.clone(), send(&client(), addr, method, id).await)
        }));
        eventually("the request at an upstream", || async {
            g0.seen().len() + g1.seen().len() + g2.seen().len() == id + 1
        })
        .await;
    }
    eventually("every request answered or held by g1", || async {
        g0.seen().len() + g2.seen().len() + g1.held() == 24
    })
    .await;
    let at_g1 = g1.seen();
    let (gets_at_g1, posts_at_g1) = (ids(&at_g1, &Method::GET), ids(&at_g1, &Method::POST));
    assert!(
        !gets_at_g1.is_empty() && !posts_at_g1.is_empty(),
        "{gets_at_g1:?} {posts_at_g1:?}"
    );
    // g1 crashes with its requests in flight.
    g1.kill().await;
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.expect("task"));
    }
    let others: Vec<Seen> = g0.seen().into_iter().chain(g2.seen()).collect();
    for (id, method, (status, body)) in &results {
        let id_s = id.to_string();
        if *method == Method::GET {
            assert_eq!(
                *status,
                StatusCode::OK,
                "GET {id} retried elsewhere: {body}"
            );
        } else if posts_at_g1.contains(&id_s) {
            assert_ne!(
                *status,
                StatusCode::OK,
                "POST {id} lost with g1, not replayed"
            );
            assert!(
                !ids(&others, &Method::POST).contains(&id_s),
                "POST {id} was replayed to another backend"
            );
        } else {
            assert_eq!(*status, StatusCode::OK, "POST {id}: {body}");
        }
    }
    for id in &gets_at_g1 {
        assert!(ids(&others, &Method::GET).contains(id), "GET {id} retried");
    }
    // And under new load, the dead endpoint costs no request.
    let c = client();
    for i in 0..30 {
        assert_eq!(send(&c, addr, Method::GET, 100 + i).await.0, StatusCode::OK);
    }
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_budget_caps_retries_in_flight() {
    // g1 holds first attempts and is then killed; g2 holds whatever reaches
    // it, so every admitted retry stays in flight until the end.
    let (g1, g2) = (Gated::start("g1").await, Gated::start("g2").await);
    let (p, addr) = proxy(&yaml(
        &[g1.local_addr(), g2.local_addr()],
        "    retries: { count: 1, on: [reset], budget_percent: 1, min_concurrent: 1 }\n    outlier_detection: { consecutive_5xx: 0, consecutive_gateway_errors: 0 }\n",
    ))
    .await;
    let mut tasks = Vec::new();
    for id in 0..8 {
        tasks.push(tokio::spawn(async move {
            send(&client(), addr, Method::GET, id).await
        }));
    }
    eventually("all eight held", || async { g1.held() + g2.held() == 8 }).await;
    let (at_g1, at_g2) = (g1.held(), g2.held());
    assert!(at_g1 >= 2, "round robin sends half to g1: {at_g1}");
    g1.kill().await;
    // 1% of at most 8 active is 0, so only `min_concurrent` = 1 retry may be
    // in flight: one of g1's requests is retried, the others are refused.
    eventually("the budget refuses the other retries", || async {
        overflows(&p, "retry_budget").await >= (at_g1 - 1) as f64
    })
    .await;
    eventually("the admitted retry reaches g2", || async {
        g2.held() == at_g2 + 1
    })
    .await;
    g2.open();
    let mut ok = 0;
    for t in tasks {
        if t.await.expect("task").0 == StatusCode::OK {
            ok += 1;
        }
    }
    assert_eq!(
        ok,
        at_g2 + 1,
        "g2's own requests and exactly one retry succeed"
    );
    assert_eq!(overflows(&p, "retry_budget").await, (at_g1 - 1) as f64);
    p.shutdown().await;
}
