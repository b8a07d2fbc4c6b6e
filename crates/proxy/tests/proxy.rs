//! The proxy end to end: real backends, a real proxy and real HTTP on 127.0.0.1.

mod common;

use std::collections::HashMap;

use bytes::Bytes;
use common::*;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use meshless_proxy::ProxyConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_policy_balances_per_request() {
    let bs = backends(3).await;
    for policy in [
        "round_robin",
        "random",
        "least_request",
        "p2c",
        "ring_hash",
        "maglev",
        "bounded_load",
    ] {
        let extra =
            format!("    balancer: {{ policy: {policy}, hash_key: {{ header: x-user }} }}\n");
        let (p, addr) = proxy(&config(&bs, &extra)).await;
        let c = client();
        let mut seen: HashMap<String, u32> = HashMap::new();
        for _ in 0..60 {
            // One keep-alive connection: L4 balancing would pin it to one backend.
            let (s, b, _) = get(&c, addr, "/", &[]).await;
            assert_eq!(s, StatusCode::OK, "{policy}");
            *seen.entry(b).or_default() += 1;
        }
        assert_eq!(
            seen.len(),
            3,
            "{policy}: requests on one connection reach every backend: {seen:?}"
        );
        if policy == "round_robin" {
            assert!(seen.values().all(|&n| n == 20), "{seen:?}");
        }
        if ["ring_hash", "maglev", "bounded_load"].contains(&policy) {
            let (_, first, _) = get(&c, addr, "/", &[("x-user", "alice")]).await;
            for _ in 0..10 {
                let (_, again, _) = get(&c, addr, "/", &[("x-user", "alice")]).await;
                assert_eq!(again, first, "{policy}: a key sticks to its endpoint");
            }
        }
        p.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn affinity_spills_past_the_bound() {
    // Consistent hashing with bounded loads (Mirrokni, Thorup,
    // Zadimoghaddam): with m requests in flight, counting the one being
    // placed, no endpoint holds more than ceil(c * m / n). Requests are
    // held upstream and sent one at a time, so the bound is checked after
    // every placement, from the upstreams' own counts.
    let gs = [
        Gated::start("g0").await,
        Gated::start("g1").await,
        Gated::start("g2").await,
        Gated::start("g3").await,
    ];
    let eps: String = gs
        .iter()
        .map(|g| format!("      - {{ address: \"{}\" }}\n", g.local_addr()))
        .collect();
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: c }}]\nclusters:\n  - name: c\n    balancer: {{ policy: bounded_load, hash_key: {{ header: x-user }}, load_factor: 1.0 }}\n    endpoints:\n{eps}"
    );
    let (p, addr) = proxy(&yaml).await;
    let (_, pick) = admin(&p, "/pick?cluster=c&key=hot").await;
    let home = gs
        .iter()
        .position(|g| pick.contains(&g.local_addr().to_string()))
        .expect("home endpoint");
    let n = gs.len();
    let mut tasks = Vec::new();
    for m in 1..=8usize {
        tasks.push(tokio::spawn(async move {
            get(&client(), addr, "/", &[("x-user", "hot")]).await
        }));
        eventually(&format!("{m} held"), || async {
            gs.iter().map(Gated::held).sum::<usize>() == m
        })
        .await;
        let held: Vec<usize> = gs.iter().map(Gated::held).collect();
        let bound = m.div_ceil(n); // ceil(1.0 * m / n)
        assert!(
            held.iter().all(|&h| h <= bound),
            "after {m}: {held:?} exceeds ceil(m/n) = {bound}"
        );
        if m == 1 {
            assert_eq!(held[home], 1, "the first request goes home: {held:?}");
        }
    }
    let held: Vec<usize> = gs.iter().map(Gated::held).collect();
    assert_eq!(
        held,
        vec![2; 4],
        "8 requests at c = 1.0 fill every endpoint to 2"
    );
    for g in &gs {
        g.open();
    }
    for t in tasks {
        assert_eq!(t.await.expect("task").0, StatusCode::OK);
    }
    // Idle again: the key goes home.
    let (_, b, _) = get(&client(), addr, "/", &[("x-user", "hot")]).await;
    assert_eq!(b, gs[home].name);
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_backend_is_ejected_and_returns() {
    let bs = backends(3).await;
    // The ejection outlasts any pause of a busy machine between the third
    // failure and the look at /clusters; its end is waited for, not timed.
    let extra = "    retries: { count: 0 }\n    outlier_detection: { consecutive_5xx: 3, interval: 100ms, base_ejection_time: 3s, max_ejection_percent: 50 }\n";
    let (p, addr) = proxy(&config(&bs, extra)).await;
    let c = client();
    bs[0].set_failing(true);
    let mut failures = 0;
    let mut sent = 0;
    while failures < 3 {
        let (s, b, _) = get(&c, addr, "/", &[]).await;
        sent += 1;
        assert!(sent <= 30, "three failures within 30 requests");
        if s == StatusCode::INTERNAL_SERVER_ERROR {
            assert_eq!(b, "b0");
            failures += 1;
        }
    }
    // Ejected right at its threshold: the next requests never reach b0.
    let (_, clusters) = admin(&p, "/clusters").await;
    assert!(clusters.contains("\"ejected\": true"), "{clusters}");
    for _ in 0..6 {
        let (_, clusters) = admin(&p, "/clusters").await;
        let (s, b, _) = get(&c, addr, "/", &[]).await;
        if clusters.contains("\"ejected\": true") {
            assert_eq!(s, StatusCode::OK, "no request reaches an ejected endpoint");
            assert_ne!(b, "b0");
        }
    }
    bs[0].set_failing(false);
    eventually("b0 serves again after the ejection time", || async {
        let mut back = false;
        for _ in 0..3 {
            back |= get(&client(), addr, "/", &[]).await.1 == "b0";
        }
        back
    })
    .await;
    let (_, metrics) = admin(&p, "/metrics").await;
    assert!(
        metrics.contains("meshless_proxy_requests_total{listener=\"web\",cluster=\"c\""),
        "{metrics}"
    );
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_backend_costs_no_request_with_retries() {
    let mut bs = backends(3).await;
    let extra = "    retries: { count: 2, on: [connect_failure, reset, 5xx] }\n";
    let (p, addr) = proxy(&config(&bs, extra)).await;
    let c = client();
    for _ in 0..20 {
        assert_eq!(get(&c, addr, "/", &[]).await.0, StatusCode::OK);
    }
    bs.remove(1).stop().await;
    for i in 0..60 {
        let (s, b, _) = get(&c, addr, "/", &[]).await;
        assert_eq!(s, StatusCode::OK, "request {i} after the kill");
        assert_ne!(b, "b1");
    }
    p.shutdown().await;
}

/// With the default retries (`connect_failure` only), a request over
/// meshless's own HTTP/1.1 connections is sent without a copy of its
/// headers kept for a retry: its request takes them once a connection is
/// there. A retry after a refused connect still sends every header, the
/// client's and the proxy's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_refused_connect_sends_every_header() {
    let up = Gated::start("g").await;
    up.open();
    // A port nothing listens on once the listener is dropped.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let endpoints = format!(
        "      - {{ address: \"{dead}\" }}\n      - {{ address: \"{}\" }}\n",
        up.local_addr()
    );
    let extra = "    outlier_detection: { consecutive_5xx: 0, consecutive_gateway_errors: 0 }\n";
    let (p, addr) = proxy(&config_with_endpoints(&endpoints, extra)).await;
    let c = client();
    eventually("a request retried after a refused connect", || async {
        let (s, _, _) = get(&c, addr, "/r", &[("x-client", "kept")]).await;
        assert_eq!(s, StatusCode::OK);
        proxy_metric(&p, "meshless_proxy_retries_total{cluster=\"c\"}").await >= 1.0
    })
    .await;
    let seen = up.seen();
    assert!(!seen.is_empty());
    for req in seen {
        for name in [
            "host",
            "x-client",
            "x-request-id",
            "traceparent",
            "x-forwarded-for",
            "x-forwarded-proto",
        ] {
            assert!(req.headers.contains_key(name), "{name}: {:?}", req.headers);
        }
    }
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_remove_and_restore() {
    let bs = backends(2).await;
    let extra = "    retries: { count: 0 }\n    outlier_detection: { consecutive_5xx: 0, consecutive_gateway_errors: 0 }\n    health_check: { path: /healthz, interval: 100ms, timeout: 1s, healthy_threshold: 2, unhealthy_threshold: 2 }\n";
    let (p, addr) = proxy(&config(&bs, extra)).await;
    let c = client();
    bs[1].set_failing(true);
    eventually("b1 marked unhealthy", || async {
        admin(&p, "/clusters")
            .await
            .1
            .contains("\"healthy\": false")
    })
    .await;
    // b1 keeps failing its checks, so it stays out for the whole loop.
    for _ in 0..10 {
        let (s, b, _) = get(&c, addr, "/", &[]).await;
        assert_eq!(
            (s, b.as_str()),
            (StatusCode::OK, "b0"),
            "unhealthy b1 gets nothing"
        );
    }
    bs[1].set_failing(false);
    eventually("b1 restored", || async {
        let mut seen = false;
        for _ in 0..4 {
            seen |= get(&client(), addr, "/", &[]).await.1 == "b1";
        }
        seen
    })
    .await;
    assert!(
        !admin(&p, "/clusters")
            .await
            .1
            .contains("\"healthy\": false"),
        "both healthy again"
    );
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_downstream_and_upstream() {
    let bs = backends(2).await;
    let (p, addr) = proxy(&config(&bs, "    upstream_protocol: http2\n")).await;
    let c = h2_client();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..10 {
        let (s, b, body) = get(&c, addr, "/", &[]).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(body, format!("{b}\n"));
        seen.insert(b);
    }
    assert_eq!(seen.len(), 2, "streams of one h2 connection are balanced");
    let (_, clusters) = admin(&p, "/clusters").await;
    assert!(
        clusters.contains("\"upstream_connections\": 2"),
        "one multiplexed connection per endpoint: {clusters}"
    );
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_stream_both_ways() {
    let bs = backends(1).await;
    let (p, addr) = proxy(&config(&bs, "")).await;
    // 16 MiB in 64 KiB chunks, streamed (no Content-Length).
    let body = Chunks {
        chunk: Bytes::from(vec![7u8; 64 * 1024]),
        left: 256,
    };
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let req = Request::post(format!("http://{addr}/echo"))
        .body(body)
        .expect("request");
    let resp = client.request(req).await.expect("response");
    assert_eq!(resp.status(), StatusCode::OK);
    let mut total = 0usize;
    let mut body = resp.into_body();
    while let Some(frame) = body.frame().await {
        if let Ok(d) = frame.expect("frame").into_data() {
            assert!(d.iter().all(|&b| b == 7));
            total += d.len();
        }
    }
    assert_eq!(total, 16 * 1024 * 1024);
    p.shutdown().await;
}

/// A request body of `left` chunks, sent one by one (no Content-Length).
struct Chunks {
    chunk: Bytes,
    left: usize,
}

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if self.left == 0 {
            return std::task::Poll::Ready(None);
        }
        self.left -= 1;
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(self.chunk.clone()))))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_map_to_the_right_status() {
    let bs = backends(1).await;
    // A port with nothing listening: bind, learn the port, close.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr");
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - {{ match: {{ path_prefix: /dead }}, cluster: dead }}\n      - {{ match: {{ path_prefix: /empty }}, cluster: empty }}\n      - {{ match: {{ path_prefix: /fallback }}, cluster: fallback }}\n      - {{ cluster: slow }}\nclusters:\n  - name: dead\n    endpoints: [{{ address: \"{dead}\" }}]\n    retries: {{ count: 0 }}\n  - name: empty\n    endpoints: []\n  - name: fallback\n    endpoints: []\n    fallback: {{ status: 200, body: \"sorry, later\\n\" }}\n  - name: slow\n    endpoints: [{{ address: \"{}\" }}]\n    timeouts: {{ request: 200ms }}\n",
        bs[0].local_addr()
    );
    let (p, addr) = proxy(&yaml).await;
    let c = client();
    assert_eq!(get(&c, addr, "/dead", &[]).await.0, StatusCode::BAD_GATEWAY);
    assert_eq!(
        get(&c, addr, "/empty", &[]).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let (s, _, body) = get(&c, addr, "/fallback", &[]).await;
    assert_eq!((s, body.as_str()), (StatusCode::OK, "sorry, later\n"));
    assert_eq!(
        get(&c, addr, "/?delay_ms=1000", &[]).await.0,
        StatusCode::GATEWAY_TIMEOUT
    );
    assert_eq!(get(&c, addr, "/?delay_ms=10", &[]).await.0, StatusCode::OK);
    let (_, metrics) = admin(&p, "/metrics").await;
    for reason in ["connect_failed", "no_endpoint", "fallback", "timeout"] {
        assert!(
            metrics.contains(&format!("reason=\"{reason}\"")),
            "{reason}: {metrics}"
        );
    }
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_headers_and_request_ids() {
    let (up, p, addr) = open_upstream_behind_a_proxy().await;
    let c = client();
    let req = Request::get(format!("http://{addr}/"))
        .header("x-request-id", "abc-123")
        .header("x-forwarded-for", "203.0.113.7")
        .header("connection", "x-secret")
        .header("x-secret", "hop")
        .header("proxy-authorization", "Basic Zm9vOmJhcg==")
        .header("x-custom", "kept")
        .header("x-meshless-forwarded-by", "node-z")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = c.request(req).await.expect("response");
    assert_eq!(resp.status(), StatusCode::OK);
    for _ in 0..2 {
        get(&c, addr, "/", &[]).await;
    }
    let seen = up.seen();
    assert_eq!(seen.len(), 3);
    let h = &seen[0].headers;
    let text = |name: &str| h.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    assert_eq!(text("x-request-id").as_deref(), Some("abc-123"), "{h:?}");
    assert_eq!(
        text("x-forwarded-for").as_deref(),
        Some("203.0.113.7, 127.0.0.1"),
        "the client address is appended: {h:?}"
    );
    assert_eq!(text("x-forwarded-proto").as_deref(), Some("http"), "{h:?}");
    assert_eq!(text("x-custom").as_deref(), Some("kept"), "{h:?}");
    // Placement's one-hop marker is between proxies only.
    assert!(h.get("x-meshless-forwarded-by").is_none(), "{h:?}");
    for hop in ["x-secret", "proxy-authorization", "connection"] {
        assert!(
            h.get(hop).is_none(),
            "hop-by-hop {hop} not forwarded: {h:?}"
        );
    }
    // Requests without an id get a fresh one each.
    let ids: Vec<String> = seen[1..]
        .iter()
        .map(|s| {
            s.headers
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned()
        })
        .collect();
    assert!(ids.iter().all(|i| !i.is_empty()), "{ids:?}");
    assert_ne!(ids[0], ids[1], "ids are unique");
    let (_, pick) = admin(&p, "/pick?cluster=c&key=alice").await;
    assert!(pick.contains(&up.local_addr().to_string()), "{pick}");
    let (s, _) = admin(&p, "/pick?cluster=nope").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = admin(&p, "/ready").await;
    assert_eq!(s, StatusCode::OK);
    let (_, cfg) = admin(&p, "/config").await;
    assert!(cfg.contains("\"policy\": \"round_robin\""), "{cfg}");
    p.shutdown().await;
}

/// R10: `X-Forwarded-For` in several field lines (HAProxy's `option
/// forwardfor` adds a line; an HTTP/2 hop repeats the field): every line
/// is kept, in order, and the peer appended after the last one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_forwarded_for_in_several_lines_keeps_every_entry() {
    let up = Gated::start("g").await;
    up.open();
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    forwarding: {{ trusted_hops: 1 }}\n    routes: [{{ cluster: c }}]\nclusters:\n  - name: c\n    endpoints: [{{ address: \"{}\" }}]\n",
        up.local_addr()
    );
    let (p, addr) = proxy(&yaml).await;
    for c in [client(), h2_client()] {
        let req = Request::get(format!("http://{addr}/"))
            .header("x-forwarded-for", "6.6.6.6")
            .header("x-forwarded-for", "1.2.3.4")
            .body(Full::new(Bytes::new()))
            .expect("request");
        let resp = c.request(req).await.expect("response");
        assert_eq!(resp.status(), StatusCode::OK);
    }
    let seen = up.seen();
    assert_eq!(seen.len(), 2);
    for s in &seen {
        let lines: Vec<&str> = s
            .headers
            .get_all("x-forwarded-for")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        assert_eq!(
            lines,
            ["6.6.6.6, 1.2.3.4, 127.0.0.1"],
            "every received line kept in order, the peer last: {:?}",
            s.headers
        );
    }
    p.shutdown().await;
}

/// R11: toward an `http2` upstream, `:authority` carries the client's host
/// (Envoy's way), not the endpoint's address beside a `host` field that
/// disagrees: a meshless listener behind it (which refuses a `Host` that
/// differs from `:authority`) answers, and its endpoint sees the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_upstream_authority_is_the_clients_host() {
    let up = Gated::start("g").await;
    up.open();
    let (b, b_addr) = proxy(&config_with_endpoints(
        &format!("      - {{ address: \"{}\" }}\n", up.local_addr()),
        "",
    ))
    .await;
    let (a, a_addr) = proxy(&config_with_endpoints(
        &format!("      - {{ address: \"{b_addr}\" }}\n"),
        "    upstream_protocol: http2\n",
    ))
    .await;
    let c = client();
    let (status, _, body) = get(&c, a_addr, "/vh", &[("host", "app.example.com")]).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].headers.get("host").and_then(|v| v.to_str().ok()),
        Some("app.example.com"),
        "{:?}",
        seen[0].headers
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_reloads_under_load_fail_no_request() {
    let bs = backends(3).await;
    let yaml = config(&bs, "");
    let (p, addr) = proxy(&yaml).await;
    let p = std::sync::Arc::new(p);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for _ in 0..4 {
        let stop = stop.clone();
        load.push(tokio::spawn(async move {
            let c = client();
            let (mut ok, mut failed) = (0u32, 0u32);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match get(&c, addr, "/", &[]).await.0 {
                    StatusCode::OK => ok += 1,
                    _ => failed += 1,
                }
            }
            (ok, failed)
        }));
    }
    let listen = addr.to_string();
    for i in 0..100 {
        // Alternate policies and weights; keep the listener's address.
        let policy = ["round_robin", "least_request", "p2c", "maglev"][i % 4];
        let next = yaml
            .replacen(
                "address: \"127.0.0.1:0\"\n    routes",
                &format!("address: \"{listen}\"\n    routes"),
                1,
            )
            .replace(
                "    endpoints:\n",
                &format!("    balancer: {{ policy: {policy} }}\n    endpoints:\n"),
            );
        let cfg = common::on_test_http1(ProxyConfig::parse(&next, "reload.yaml").expect("valid"));
        p.reload(cfg).await.expect("reload");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut ok, mut failed) = (0, 0);
    for t in load {
        let (o, f) = t.await.expect("task");
        ok += o;
        failed += f;
    }
    assert_eq!(failed, 0, "{ok} ok");
    assert!(ok > 100, "load ran during the reloads: {ok}");
    let (_, metrics) = admin(&p, "/metrics").await;
    assert!(
        metrics.contains("meshless_proxy_reloads_total{result=\"success\"} 100"),
        "{metrics}"
    );
    // A reload that cannot bind keeps the running config.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let bad = yaml.replacen(
        "127.0.0.1:0\"\n    routes",
        &format!("{}\"\n    routes", taken.local_addr().expect("addr")),
        1,
    );
    assert!(
        p.reload(common::on_test_http1(
            ProxyConfig::parse(&bad, "bad.yaml").expect("valid")
        ))
        .await
        .is_err()
    );
    assert_eq!(get(&client(), addr, "/", &[]).await.0, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_keeps_endpoint_state_and_moves_listeners() {
    let bs = backends(2).await;
    let extra = "    retries: { count: 0 }\n    outlier_detection: { consecutive_5xx: 2, base_ejection_time: 60s, max_ejection_percent: 50 }\n";
    let yaml = config(&bs, extra);
    let (p, addr) = proxy(&yaml).await;
    let c = client();
    bs[0].set_failing(true);
    for _ in 0..6 {
        get(&c, addr, "/", &[]).await;
    }
    // A renamed listener: the old one closes, the new one opens; the ejection survives.
    let cfg = common::on_test_http1(
        ProxyConfig::parse(&yaml.replace("name: web", "name: web2"), "reload.yaml").expect("valid"),
    );
    p.reload(cfg).await.expect("reload");
    assert!(p.listener_addr("web").await.is_none());
    let addr2 = p.listener_addr("web2").await.expect("listener");
    assert_ne!(addr, addr2);
    eventually("old listener closed", || async {
        tokio::net::TcpStream::connect(addr).await.is_err()
    })
    .await;
    for _ in 0..6 {
        let (s, b, _) = get(&client(), addr2, "/", &[]).await;
        assert_eq!(
            (s, b.as_str()),
            (StatusCode::OK, "b1"),
            "b0 stays ejected across the reload"
        );
    }
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn circuit_breaker_sheds_excess_requests() {
    let up = Gated::start("g").await;
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: c }}]\nclusters:\n  - name: c\n    endpoints: [{{ address: \"{}\" }}]\n    circuit_breakers: {{ max_requests: 2 }}\n",
        up.local_addr()
    );
    let (p, addr) = proxy(&yaml).await;
    // Two requests fill the breaker and stay in flight until the gate opens.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(tokio::spawn(async move {
            get(&client(), addr, "/", &[]).await.0
        }));
    }
    eventually("two requests held upstream", || async { up.held() == 2 }).await;
    // While they are held, every further request is shed at once.
    for _ in 0..4 {
        assert_eq!(
            get(&client(), addr, "/", &[]).await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
    up.open();
    for t in held {
        assert_eq!(t.await.expect("task"), StatusCode::OK);
    }
    assert_eq!(
        up.seen().len(),
        2,
        "shed requests never reached the upstream"
    );
    // The slots were given back.
    assert_eq!(get(&client(), addr, "/", &[]).await.0, StatusCode::OK);
    let (_, metrics) = admin(&p, "/metrics").await;
    assert_eq!(
        metric_sum(
            &metrics,
            "meshless_proxy_overflows_total{cluster=\"c\",limit=\"max_requests\"}"
        ),
        4.0,
        "{metrics}"
    );
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_is_passed_through() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let bs = backends(1).await;
    let (p, addr) = proxy(&config(&bs, "")).await;
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(
        b"GET /upgrade HTTP/1.1\r\nHost: test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    )
    .await
    .expect("write");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).await.expect("read head");
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("upgrade: websocket"), "{head}");
    s.write_all(b"hello through the proxy")
        .await
        .expect("write");
    let mut echoed = [0u8; 23];
    s.read_exact(&mut echoed).await.expect("echo");
    assert_eq!(&echoed, b"hello through the proxy");
    // One upstream connection, the tunnel's: none opened beside it and
    // left idle (a pool with no idle connection opened one of its own
    // before handing the upgrade to hyper's).
    let (_, metrics) = admin(&p, "/metrics").await;
    let open = |name: &str| metric_sum(&metrics, &format!("{name}{{cluster=\"c\"}}"));
    assert_eq!(
        (
            open("meshless_proxy_upstream_connections"),
            open("meshless_proxy_upstream_idle_connections")
        ),
        (1.0, 0.0),
        "{metrics}"
    );
    drop(s);
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_on_5xx_hide_a_failing_backend_and_are_counted() {
    let bs = backends(3).await;
    let extra = "    retries: { count: 2, on: [5xx] }\n    outlier_detection: { consecutive_5xx: 0, consecutive_gateway_errors: 0 }\n";
    let (p, addr) = proxy(&config(&bs, extra)).await;
    bs[2].set_failing(true);
    let c = client();
    for _ in 0..30 {
        let (s, b, _) = get(&c, addr, "/", &[]).await;
        assert_eq!(s, StatusCode::OK);
        assert_ne!(b, "b2");
    }
    let (_, metrics) = admin(&p, "/metrics").await;
    let retries: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("meshless_proxy_retries_total{cluster=\"c\"} "))
        .and_then(|v| v.parse().ok())
        .expect("retries counted");
    // Every request first sent to b2 was retried (round robin sends about a third there).
    assert!(retries >= 10, "{retries} retries");
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locality_keeps_traffic_in_the_proxy_zone() {
    let bs = backends(3).await;
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nnode: {{ name: n1, zone: z1 }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: c }}]\nclusters:\n  - name: c\n    locality: {{ min_healthy_share: 0.5 }}\n    endpoints:\n      - {{ address: \"{}\", zone: z1 }}\n      - {{ address: \"{}\", zone: z2 }}\n      - {{ address: \"{}\", zone: z2 }}\n",
        bs[0].local_addr(),
        bs[1].local_addr(),
        bs[2].local_addr()
    );
    let (p, addr) = proxy(&yaml).await;
    let c = client();
    for _ in 0..10 {
        assert_eq!(get(&c, addr, "/", &[]).await.1, "b0", "same zone first");
    }
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_writes_one_json_line_per_request() {
    let bs = backends(1).await;
    let tmp = tempfile::Builder::new()
        .prefix("meshless-access-")
        .tempdir()
        .expect("temp dir");
    let path = tmp.path().join("access.log");
    let yaml = config(&bs, "").replacen(
        "drain_timeout: 5s\n",
        &format!("drain_timeout: 5s\naccess_log: \"{}\"\n", path.display()),
        1,
    );
    let (p, addr) = proxy(&yaml).await;
    let c = client();
    get(&c, addr, "/hello?x=1", &[("x-request-id", "req-42")]).await;
    get(&c, addr, "/status/503", &[]).await;
    let read = || -> Vec<String> {
        std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    };
    eventually("two access-log lines", || async { read().len() >= 2 }).await;
    let lines = read();
    assert_eq!(lines.len(), 2, "{lines:?}");
    let first: serde_json::Value = serde_json::from_str(&lines[0]).expect("json line");
    for key in [
        "time",
        "listener",
        "route",
        "cluster",
        "endpoint",
        "method",
        "path",
        "status",
        "bytes",
        "duration_ms",
        "request_id",
        "attempts",
    ] {
        assert!(first.get(key).is_some(), "missing {key}: {first}");
    }
    assert_eq!(first["request_id"], "req-42");
    assert_eq!(first["path"], "/hello");
    assert_eq!(first["status"], 200);
    assert_eq!(first["bytes"], 3);
    assert_eq!(first["endpoint"], bs[0].local_addr().to_string());
    let second: serde_json::Value = serde_json::from_str(&lines[1]).expect("json line");
    assert_eq!(second["status"], 503);
    p.shutdown().await;
}

/// A health-check target that reads each request head, writes `head` (if
/// any) and then holds the connection open, sending nothing more. Counts
/// connections accepted, and the most open at once.
struct Wedged {
    addr: std::net::SocketAddr,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    most_open: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Wedged {
    async fn start(head: &'static [u8]) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let accepted = std::sync::Arc::new(AtomicUsize::new(0));
        let most_open = std::sync::Arc::new(AtomicUsize::new(0));
        let open = std::sync::Arc::new(AtomicUsize::new(0));
        let (a, m) = (accepted.clone(), most_open.clone());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                let now = open.fetch_add(1, Ordering::SeqCst) + 1;
                m.fetch_max(now, Ordering::SeqCst);
                let open = open.clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let mut answered = false;
                    loop {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(_) if !answered && !head.is_empty() => {
                                answered = true;
                                let _ = s.write_all(head).await;
                            }
                            Ok(_) => {}
                        }
                    }
                    open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Self {
            addr,
            accepted,
            most_open,
        }
    }
}

/// The `healthy` flag `/clusters` shows for the endpoint at `addr`.
async fn endpoint_healthy(p: &meshless_proxy::Proxy, addr: std::net::SocketAddr) -> Option<bool> {
    let (_, body) = admin(p, "/clusters").await;
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    v[0]["endpoints"]
        .as_array()?
        .iter()
        .find(|e| e["address"] == addr.to_string())
        .and_then(|e| e["healthy"].as_bool())
}

/// E5: a check still waiting for its answer is not joined by another
/// every interval: one check per endpoint at a time, so an endpoint that
/// hangs holds one check connection, not `timeout / interval` of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_health_check_is_not_overlapped_by_the_next() {
    use std::sync::atomic::Ordering;
    let hang = Wedged::start(b"").await;
    let eps = format!("      - {{ address: \"{}\" }}\n", hang.addr);
    let extra = "    health_check: { path: /healthz, interval: 100ms, timeout: 1s, unhealthy_threshold: 1 }\n";
    let (p, _) = proxy(&config_with_endpoints(&eps, extra)).await;
    // Three checks started: the first two ended (timed out) before.
    eventually("three checks", || async {
        hang.accepted.load(Ordering::SeqCst) >= 3
    })
    .await;
    // One open at a time (two when a new one races the close of the last).
    let most = hang.most_open.load(Ordering::SeqCst);
    assert!(most <= 2, "{most} check connections open at once");
    p.shutdown().await;
}

/// E6: an HTTP check passes only once the whole response arrived within
/// the timeout: an endpoint that sends `200` and its head, then wedges
/// before the body, goes unhealthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_check_whose_body_never_comes_fails() {
    let wedged = Wedged::start(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n").await;
    let eps = format!("      - {{ address: \"{}\" }}\n", wedged.addr);
    let extra = "    health_check: { path: /healthz, interval: 100ms, timeout: 300ms, unhealthy_threshold: 1 }\n";
    let (p, _) = proxy(&config_with_endpoints(&eps, extra)).await;
    eventually("the wedged endpoint unhealthy", || async {
        endpoint_healthy(&p, wedged.addr).await == Some(false)
    })
    .await;
    p.shutdown().await;
}

/// `/clusters`' `panic` field and the `meshless_proxy_cluster_panic` gauge
/// of cluster `c`.
async fn panic_shown(p: &meshless_proxy::Proxy) -> (Option<bool>, f64) {
    let (_, body) = admin(p, "/clusters").await;
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    let gauge = proxy_metric(p, "meshless_proxy_cluster_panic{cluster=\"c\"}").await;
    (v[0]["panic"].as_bool(), gauge)
}

/// E7: panic mode shows: `/clusters` says `"panic": true` and
/// `meshless_proxy_cluster_panic{cluster}` is 1 while too few endpoints
/// are available (requests still go to all of them), 0 again after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panic_mode_shows_in_clusters_and_metrics() {
    let bs = backends(2).await;
    let extra = "    outlier_detection: { consecutive_5xx: 0, consecutive_gateway_errors: 0 }\n    health_check: { path: /healthz, interval: 100ms, timeout: 1s, healthy_threshold: 1, unhealthy_threshold: 1 }\n";
    let (p, _) = proxy(&config(&bs, extra)).await;
    assert_eq!(panic_shown(&p).await, (Some(false), 0.0));
    bs[0].set_failing(true);
    bs[1].set_failing(true);
    eventually("panic mode shown", || async {
        panic_shown(&p).await == (Some(true), 1.0)
    })
    .await;
    bs[0].set_failing(false);
    bs[1].set_failing(false);
    eventually("panic mode over", || async {
        panic_shown(&p).await == (Some(false), 0.0)
    })
    .await;
    p.shutdown().await;
}

/// R5: access-log lines the writer fails to write (a full disk:
/// `/dev/full`) are counted as dropped, not lost silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_write_errors_are_counted_as_dropped() {
    let bs = backends(1).await;
    let yaml = format!("access_log: /dev/full\n{}", config(&bs, ""));
    let (p, addr) = proxy(&yaml).await;
    let c = client();
    eventually("lines lost to write errors counted", || async {
        assert_eq!(get(&c, addr, "/", &[]).await.0, StatusCode::OK);
        proxy_metric(&p, "meshless_proxy_access_log_dropped_total").await > 0.0
    })
    .await;
    p.shutdown().await;
}

/// Every request is timed once, in its listener's and cluster's series
/// (the listener keeps that series at hand: one lookup per cluster).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_is_timed_once_in_its_listener_and_cluster_series() {
    let bs = backends(2).await;
    let (p, addr) = proxy(&config(&bs, "")).await;
    let c = client();
    for _ in 0..5 {
        assert_eq!(get(&c, addr, "/", &[]).await.0, StatusCode::OK);
    }
    let series = "meshless_proxy_request_duration_seconds_count{listener=\"web\",cluster=\"c\"}";
    eventually("five requests timed", || async {
        proxy_metric(&p, series).await == 5.0
    })
    .await;
    let (_, metrics) = admin(&p, "/metrics").await;
    let counts = metrics
        .lines()
        .filter(|l| l.starts_with("meshless_proxy_request_duration_seconds_count"))
        .count();
    assert_eq!(counts, 1, "one series: {metrics}");
    p.shutdown().await;
}

/// The fields the proxy sets (`x-forwarded-for`, `x-forwarded-proto`,
/// `x-request-id`, `traceparent`) reach the endpoint once each whatever
/// the client sent: none of them, each of them (replaced where it was),
/// repeated lines, or ones its `Connection` names (removed as hop-by-hop,
/// then set again): never missing, never twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_fields_arrive_once_each_whatever_the_client_sent() {
    let (up, p, addr) = open_upstream_behind_a_proxy().await;
    let c = client();
    let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let cases: [&[(&str, &str)]; 5] = [
        &[],
        &[
            ("x-forwarded-for", "203.0.113.7"),
            ("x-forwarded-proto", "https"),
            ("x-request-id", "abc-123"),
            ("traceparent", parent),
        ],
        &[
            ("x-forwarded-for", "203.0.113.7"),
            ("x-forwarded-for", "198.51.100.1"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-proto", "ftp"),
        ],
        &[
            ("connection", "x-request-id, traceparent, x-forwarded-proto"),
            ("x-request-id", "abc-124"),
            ("traceparent", parent),
            ("x-forwarded-proto", "https"),
        ],
        &[
            ("connection", "x-forwarded-for"),
            ("x-forwarded-for", "203.0.113.9"),
        ],
    ];
    for (i, fields) in cases.iter().enumerate() {
        let mut req = Request::get(format!("http://{addr}/case/{i}"));
        for (name, value) in fields.iter() {
            req = req.header(*name, *value);
        }
        let resp = c
            .request(req.body(Full::new(Bytes::new())).expect("request"))
            .await
            .expect("response");
        assert_eq!(resp.status(), StatusCode::OK, "case {i}");
    }
    let seen = up.seen();
    assert_eq!(seen.len(), cases.len());
    for req in &seen {
        let h = &req.headers;
        for name in [
            "x-forwarded-for",
            "x-forwarded-proto",
            "x-request-id",
            "traceparent",
        ] {
            assert_eq!(
                h.get_all(name).iter().count(),
                1,
                "{} {name}: {h:?}",
                req.path
            );
        }
        // Set by the proxy, not passed on from the client.
        assert_eq!(h["x-forwarded-proto"], "http", "{}: {h:?}", req.path);
        assert!(h.get("connection").is_none(), "{}: {h:?}", req.path);
    }
    let by_path = |path: &str| &seen.iter().find(|r| r.path == path).expect(path).headers;
    assert_eq!(by_path("/case/1")["x-request-id"], "abc-123");
    assert_eq!(
        by_path("/case/1")["x-forwarded-for"],
        "203.0.113.7, 127.0.0.1"
    );
    assert_eq!(
        by_path("/case/2")["x-forwarded-for"],
        "203.0.113.7, 198.51.100.1, 127.0.0.1"
    );
    // An `X-Forwarded-For` the client's `Connection` named is hop-by-hop:
    // not passed on, the client's address alone.
    assert_eq!(by_path("/case/4")["x-forwarded-for"], "127.0.0.1");
    // A trace continued from the client's: its trace id kept.
    let continued = by_path("/case/1")["traceparent"].to_str().expect("ascii");
    assert!(
        continued.starts_with("00-0af7651916cd43dd8448eb211c80319c-"),
        "{continued}"
    );
    p.shutdown().await;
}

/// A [`Gated`] upstream, open, as the one endpoint of cluster `c` behind
/// a proxy whose listener `web` routes to it.
async fn open_upstream_behind_a_proxy() -> (Gated, meshless_proxy::Proxy, std::net::SocketAddr) {
    let up = Gated::start("g").await;
    up.open();
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: c }}]\nclusters:\n  - name: c\n    endpoints: [{{ address: \"{}\" }}]\n",
        up.local_addr()
    );
    let (p, addr) = proxy(&yaml).await;
    (up, p, addr)
}
