//! Edge limits through real sockets: upgrades, refused methods, head
//! limits, `max_connections` under a slowloris flood, the request timeout.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends `request` on a fresh connection and reads until the response head ends.
async fn head_of(addr: SocketAddr, request: &[u8]) -> (TcpStream, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match tokio::time::timeout(Duration::from_secs(20), s.read(&mut byte)).await {
            Ok(Ok(1)) => head.push(byte[0]),
            _ => break,
        }
    }
    (s, String::from_utf8_lossy(&head).to_lowercase())
}

/// A metric's value on `/metrics` (the first line starting with `prefix`).
async fn metric(p: &meshless_proxy::Proxy, prefix: &str) -> f64 {
    let (_, text) = admin(p, "/metrics").await;
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

async fn active_requests(p: &meshless_proxy::Proxy) -> u64 {
    let (_, body) = admin(p, "/clusters").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v[0]["active_requests"].as_u64().unwrap()
}

/// Reads until EOF (or an error); panics if it does not come in 20 s.
async fn wait_closed(s: &mut TcpStream) {
    let mut buf = [0u8; 64];
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return,
            Ok(Ok(_)) => {}
            Err(_) => panic!("connection still open"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_upgrade_is_refused_and_forwarded_plain() {
    let bs = backends(1).await;
    let (p, addr) = proxy(&config(&bs, "")).await;
    let (_s, head) = head_of(
        addr,
        b"GET /upgrade HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n",
    )
    .await;
    // The backend switches for any Upgrade it sees: a 200 proves it saw none.
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(!head.contains("upgrade: h2c"), "{head}");
    assert_eq!(
        metric(&p, "meshless_proxy_upgrades_refused_total{").await,
        1.0
    );
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_counts_as_a_request_until_it_closes() {
    let bs = backends(1).await;
    let yaml = config(&bs, "").replace(
        "    address: \"127.0.0.1:0\"\n    routes:",
        "    address: \"127.0.0.1:0\"\n    timeouts: { stream_idle: 500ms }\n    routes:",
    );
    let (p, addr) = proxy(&yaml).await;
    let ws =
        b"GET /upgrade HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n";
    let (mut s, head) = head_of(addr, ws).await;
    assert!(head.starts_with("http/1.1 101"), "{head}");
    s.write_all(b"ping").await.unwrap();
    let mut echo = [0u8; 4];
    s.read_exact(&mut echo).await.unwrap();
    assert_eq!(&echo, b"ping");
    assert_eq!(
        active_requests(&p).await,
        1,
        "an open tunnel is an active request"
    );
    // Nothing more is sent: the idle tunnel is closed, and its slot freed.
    wait_closed(&mut s).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while active_requests(&p).await != 0 {
        assert!(Instant::now() < deadline, "tunnel slot not given back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_is_closed_when_the_drain_ends() {
    let bs = backends(1).await;
    let yaml = config(&bs, "").replace("drain_timeout: 5s", "drain_timeout: 300ms");
    let (p, addr) = proxy(&yaml).await;
    let ws =
        b"GET /upgrade HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n";
    let (mut s, head) = head_of(addr, ws).await;
    assert!(head.starts_with("http/1.1 101"), "{head}");
    let shutdown = tokio::spawn(p.shutdown());
    wait_closed(&mut s).await;
    tokio::time::timeout(Duration::from_secs(20), shutdown)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_and_trace_are_refused() {
    let bs = backends(1).await;
    let (p, addr) = proxy(&config(&bs, "")).await;
    let (_s, head) = head_of(
        addr,
        b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
    )
    .await;
    assert!(head.starts_with("http/1.1 501"), "{head}");
    let (_s, head) = head_of(addr, b"TRACE / HTTP/1.1\r\nHost: t\r\n\r\n").await;
    assert!(head.starts_with("http/1.1 405"), "{head}");
    assert!(head.contains("allow: "), "{head}");
    assert_eq!(bs[0].requests(), 0, "nothing reached the backend");
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_heads_are_refused_with_431_and_414() {
    let bs = backends(1).await;
    let (p, addr) = proxy(&config(&bs, "")).await;
    let big = format!(
        "GET / HTTP/1.1\r\nHost: t\r\nX-Big: {}\r\n\r\n",
        "a".repeat(200 * 1024)
    );
    let (_s, head) = head_of(addr, big.as_bytes()).await;
    assert!(head.starts_with("http/1.1 431"), "{head}");
    let mut many = String::from("GET / HTTP/1.1\r\nHost: t\r\n");
    for i in 0..2000 {
        many.push_str(&format!("X-H{i}: 1\r\n"));
    }
    many.push_str("\r\n");
    let (_s, head) = head_of(addr, many.as_bytes()).await;
    assert!(head.starts_with("http/1.1 431"), "{head}");
    let long = format!("GET /{} HTTP/1.1\r\nHost: t\r\n\r\n", "a".repeat(9 * 1024));
    let (_s, head) = head_of(addr, long.as_bytes()).await;
    assert!(head.starts_with("http/1.1 414"), "{head}");
    assert_eq!(bs[0].requests(), 0, "nothing reached the backend");
    p.shutdown().await;
}

/// A slowloris flood (connections that send a header byte now and then)
/// three times `max_connections`: the proxy never serves more than the cap
/// at once, counts the overflow, and a normal request still gets through
/// once `request_headers` cuts the slow ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_is_held_to_max_connections() {
    let bs = backends(1).await;
    let yaml = config(&bs, "").replace(
        "    address: \"127.0.0.1:0\"\n    routes:",
        "    address: \"127.0.0.1:0\"\n    max_connections: 20\n    timeouts: { request_headers: 1s }\n    routes:",
    );
    let (p, addr) = proxy(&yaml).await;
    let mut flood = tokio::task::JoinSet::new();
    for _ in 0..60 {
        flood.spawn(async move {
            let Ok(mut s) = TcpStream::connect(addr).await else {
                return;
            };
            let _ = s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n").await;
            for _ in 0..100 {
                if s.write_all(b"X-a: b\r\n").await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
    }
    let normal = tokio::spawn(async move { get(&client(), addr, "/", &[]).await.0 });
    let mut peak = 0.0f64;
    while !normal.is_finished() {
        peak = peak.max(
            metric(
                &p,
                "meshless_proxy_downstream_connections{listener=\"web\"}",
            )
            .await,
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(normal.await.unwrap(), http::StatusCode::OK);
    assert!((1.0..=20.0).contains(&peak), "peak {peak}");
    assert!(metric(&p, "meshless_proxy_downstream_connections_at_limit_total{").await >= 1.0);
    flood.abort_all();
    p.shutdown().await;
}

/// A connection that never sends a byte is closed once `request_headers`
/// passes (the protocol is told from the first bytes, so no request head
/// timer of hyper's runs yet), and its slot is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_is_closed_after_request_headers() {
    let bs = backends(1).await;
    let yaml = config(&bs, "").replace(
        "    address: \"127.0.0.1:0\"\n    routes:",
        "    address: \"127.0.0.1:0\"\n    timeouts: { request_headers: 1s }\n    routes:",
    );
    let (p, addr) = proxy(&yaml).await;
    let mut silent = TcpStream::connect(addr).await.unwrap();
    wait_closed(&mut silent).await;
    let gauge = "meshless_proxy_downstream_connections{listener=\"web\"}";
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&p, gauge).await != 0.0 {
        assert!(Instant::now() < deadline, "connection gauge not back to 0");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, head) = head_of(addr, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n").await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    p.shutdown().await;
}

/// An upload that trickles is cut by the cluster's request timeout, which
/// covers the exchange to the last response byte, and frees its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_body_is_cut_by_the_request_timeout() {
    let bs = backends(1).await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let yaml = format!(
        "access_log: \"{}\"\n{}",
        log.display(),
        config(&bs, "    timeouts: { request: 1s }\n")
    );
    let (p, addr) = proxy(&yaml).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\n\r\n")
        .await
        .unwrap();
    let trickle = async {
        loop {
            if s.write_all(b"x").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    // Writes stop working once the proxy closes the connection.
    tokio::time::timeout(Duration::from_secs(20), trickle)
        .await
        .expect("the slow upload is cut");
    let deadline = Instant::now() + Duration::from_secs(20);
    while active_requests(&p).await != 0 {
        assert!(Instant::now() < deadline, "slot not given back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, metrics) = admin(&p, "/metrics").await;
    assert!(metrics.contains("class=\"timeout\""), "{metrics}");
    // The access log says so too, not that the client left.
    let deadline = Instant::now() + Duration::from_secs(20);
    let line = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(line) = text.lines().next() {
            break line.to_owned();
        }
        assert!(Instant::now() < deadline, "no access-log line");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["cut"], "timeout", "{line}");
    assert!(v.get("fault").is_none(), "{line}");
    p.shutdown().await;
}

/// A connection whose request outlives the drain is closed when the drain
/// timeout ends, and shutdown does not wait for the endpoint's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_timeout_closes_what_is_left() {
    let bs = backends(1).await;
    let yaml = config(&bs, "").replace("drain_timeout: 5s", "drain_timeout: 300ms");
    let (p, addr) = proxy(&yaml).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /?delay_ms=600000 HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while active_requests(&p).await != 1 {
        assert!(Instant::now() < deadline, "request never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let shutdown = tokio::spawn(p.shutdown());
    wait_closed(&mut s).await;
    tokio::time::timeout(Duration::from_secs(20), shutdown)
        .await
        .unwrap()
        .unwrap();
}

/// With `drain_delay`, `/ready` fails at once while the listener still
/// serves; only then does it close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_fails_before_listeners_close() {
    let bs = backends(1).await;
    let yaml = config(&bs, "").replace("drain_timeout: 5s", "drain_timeout: 1s\ndrain_delay: 5s");
    let (p, addr) = proxy(&yaml).await;
    let admin_addr = p.admin_addr();
    let shutdown = tokio::spawn(p.shutdown());
    let c = client();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, _, _) = get(&c, admin_addr, "/ready", &[]).await;
        if status != http::StatusCode::OK {
            break;
        }
        assert!(Instant::now() < deadline, "/ready never failed");
    }
    // Not ready, but still serving: one request well inside the 5 s delay.
    assert_eq!(get(&client(), addr, "/", &[]).await.0, http::StatusCode::OK);
    tokio::time::timeout(Duration::from_secs(20), shutdown)
        .await
        .unwrap()
        .unwrap();
    assert!(TcpStream::connect(addr).await.is_err(), "listener closed");
}

/// One request on the keep-alive connection `s`: the response head
/// (lowercase), its body read to its `content-length`.
async fn exchange(s: &mut TcpStream) -> String {
    s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(DEADLINE, s.read(&mut byte))
            .await
            .expect("response head")
            .unwrap();
        assert_eq!(n, 1, "closed before the response head");
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|v| v.trim().parse().ok())
        .expect("content-length");
    let mut body = vec![0u8; len];
    tokio::time::timeout(DEADLINE, s.read_exact(&mut body))
        .await
        .expect("body")
        .unwrap();
    head
}

/// On shutdown, during `drain_delay`: the listener still accepts, but
/// every HTTP/1 response says `connection: close` (on connections open
/// before and accepted since), and HTTP/2 connections get a GOAWAY, so
/// keep-alive clients reconnect elsewhere before the listener closes
/// instead of losing the request they send as it closes (review 9, E12).
async fn drain_delay_tells_clients_to_leave(http1: &str) {
    let bs = backends(1).await;
    // The delay outlasts the test: everything below happens inside it.
    let yaml = config(&bs, "")
        .replace("drain_timeout: 5s", "drain_timeout: 5s\ndrain_delay: 1h")
        .replace(
            "    routes:\n",
            &format!("    http1: {http1}\n    routes:\n"),
        );
    let (p, addr) = proxy(&yaml).await;
    let admin_addr = p.admin_addr();
    let mut kept = TcpStream::connect(addr).await.unwrap();
    let head = exchange(&mut kept).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(!head.contains("connection: close"), "{head}");
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut h2, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let h2_conn = tokio::spawn(conn);
    let req = || {
        http::Request::get(format!("http://{addr}/"))
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap()
    };
    assert_eq!(h2.send_request(req()).await.unwrap().status(), 200);

    let shutdown = tokio::spawn(p.shutdown());
    let c = client();
    eventually("/ready fails", || async {
        get(&c, admin_addr, "/ready", &[]).await.0 != http::StatusCode::OK
    })
    .await;
    // The connection open before: its next response closes it.
    let head = exchange(&mut kept).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("connection: close"), "{http1}: {head}");
    wait_closed(&mut kept).await;
    // One accepted during the delay: served, and told too.
    let mut fresh = TcpStream::connect(addr).await.unwrap();
    let head = exchange(&mut fresh).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("connection: close"), "{http1}: {head}");
    wait_closed(&mut fresh).await;
    // HTTP/2: GOAWAY, then the idle connection ends (long before the
    // delay does).
    tokio::time::timeout(DEADLINE, h2_conn)
        .await
        .expect("HTTP/2 connection ended by GOAWAY during drain_delay")
        .unwrap()
        .ok();
    shutdown.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_delay_tells_clients_to_leave_meshless_http1() {
    drain_delay_tells_clients_to_leave("meshless").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_delay_tells_clients_to_leave_hyper_http1() {
    drain_delay_tells_clients_to_leave("hyper").await;
}

/// At the end of `drain_delay` the keep-alive connections still idle
/// (told to leave, but sending nothing) are closed at once, with both
/// HTTP/1 servers: the shutdown does not wait for `drain_timeout`.
async fn idle_connections_close_when_drain_delay_ends(http1: &str) {
    let bs = backends(1).await;
    let yaml = config(&bs, "")
        .replace("drain_timeout: 5s", "drain_timeout: 1h\ndrain_delay: 1s")
        .replace(
            "    routes:\n",
            &format!("    http1: {http1}\n    timeouts: {{ request_headers: 1h }}\n    routes:\n"),
        );
    let (p, addr) = proxy(&yaml).await;
    let mut idle = TcpStream::connect(addr).await.unwrap();
    let head = exchange(&mut idle).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    tokio::time::timeout(DEADLINE, p.shutdown())
        .await
        .expect("shutdown waited for the idle connection");
    wait_closed(&mut idle).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_close_when_drain_delay_ends_meshless_http1() {
    idle_connections_close_when_drain_delay_ends("meshless").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_close_when_drain_delay_ends_hyper_http1() {
    idle_connections_close_when_drain_delay_ends("hyper").await;
}

/// Dot-segments are removed before routing: `/public/../admin` is routed
/// as `/admin` (no route here, 404), never to the `/public` route; with
/// `dot_segments: reject` it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paths_are_normalised_before_routing() {
    let bs = backends(1).await;
    let yaml = config(&bs, "").replace(
        "    routes:\n      - cluster: c\n",
        "    routes:\n      - { match: { path_prefix: /public }, cluster: c }\n",
    );
    let (p, addr) = proxy(&yaml).await;
    let (_s, head) = head_of(addr, b"GET /public/x HTTP/1.1\r\nHost: t\r\n\r\n").await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    for raw in [
        &b"GET /public/../admin HTTP/1.1\r\nHost: t\r\n\r\n"[..],
        &b"GET /public/%2e%2e/admin HTTP/1.1\r\nHost: t\r\n\r\n"[..],
    ] {
        let (_s, head) = head_of(addr, raw).await;
        assert!(head.starts_with("http/1.1 404"), "{head}");
    }
    p.shutdown().await;
    let rejecting = yaml.replace(
        "    routes:\n",
        "    paths: { dot_segments: reject }\n    routes:\n",
    );
    let (p, addr) = proxy(&rejecting).await;
    let (_s, head) = head_of(addr, b"GET /public/../admin HTTP/1.1\r\nHost: t\r\n\r\n").await;
    assert!(head.starts_with("http/1.1 400"), "{head}");
    p.shutdown().await;
}

/// An upgraded connection keeps its `max_connections` slot, and counts in
/// `downstream_connections`, until its tunnel closes: the HTTP/1 server's
/// part of the connection ends at the `101`, the tunnel holds the
/// connection's guards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_keeps_its_connection_slot_until_it_closes() {
    let bs = backends(1).await;
    let yaml = config(&bs, "").replace(
        "    address: \"127.0.0.1:0\"\n    routes:",
        "    address: \"127.0.0.1:0\"\n    max_connections: 1\n    routes:",
    );
    let (p, addr) = proxy(&yaml).await;
    let gauge = "meshless_proxy_downstream_connections{listener=\"web\"}";
    let ws =
        b"GET /upgrade HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n";
    let (mut s, head) = head_of(addr, ws).await;
    assert!(head.starts_with("http/1.1 101"), "{head}");
    let mut echo = [0u8; 4];
    s.write_all(b"ping").await.unwrap();
    s.read_exact(&mut echo).await.unwrap();
    assert_eq!(&echo, b"ping");
    assert_eq!(
        metric(&p, gauge).await,
        1.0,
        "the tunnel is an open connection"
    );
    // The only slot is the tunnel's: a second connection waits in the
    // backlog, unanswered (with the slot given back it is served at once).
    let mut second = TcpStream::connect(addr).await.unwrap();
    second
        .write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let mut byte = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(500), second.read(&mut byte)).await;
    assert!(early.is_err(), "served while the tunnel held the only slot");
    s.write_all(b"pong").await.unwrap();
    s.read_exact(&mut echo).await.unwrap();
    assert_eq!(&echo, b"pong");
    assert_eq!(metric(&p, gauge).await, 1.0);
    // The tunnel closes: its slot goes to the waiting connection.
    drop(s);
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(DEADLINE, second.read(&mut byte))
            .await
            .expect("the waiting connection is served once the tunnel closes")
            .unwrap();
        assert_eq!(n, 1, "closed before a response");
        head.push(byte[0]);
    }
    assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
    drop(second);
    let deadline = Instant::now() + DEADLINE;
    while metric(&p, gauge).await != 0.0 {
        assert!(Instant::now() < deadline, "connection gauge not back to 0");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    p.shutdown().await;
}

/// Heads over `max_uri_bytes` and `max_header_bytes` (within what hyper
/// buffers) are answered `414`/`431` with the limit in the body, counted
/// in `local_replies_total` under their reason, on either HTTP/1 server
/// (meshless's codec refuses them itself, hyper's server leaves them to
/// the screen stage).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_heads_are_counted_with_a_reason_and_say_why() {
    let bs = backends(1).await;
    let (p, addr) = proxy(&config(&bs, "")).await;
    let long = format!("GET /{} HTTP/1.1\r\nHost: t\r\n\r\n", "a".repeat(9 * 1024));
    let big = format!(
        "GET / HTTP/1.1\r\nHost: t\r\nX-Big: {}\r\n\r\n",
        "a".repeat(17 * 1024)
    );
    for (raw, status, reason, says) in [
        (
            long,
            "414",
            "uri_too_long",
            "request target over 8192 bytes",
        ),
        (
            big,
            "431",
            "headers_too_large",
            "request headers over 100 fields or 16384 bytes",
        ),
    ] {
        let (mut s, head) = head_of(addr, raw.as_bytes()).await;
        assert!(head.starts_with(&format!("http/1.1 {status}")), "{head}");
        assert!(head.contains("connection: close"), "{head}");
        let mut body = String::new();
        tokio::time::timeout(DEADLINE, s.read_to_string(&mut body))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(body, format!("{says}\n"));
        let series =
            format!("meshless_proxy_local_replies_total{{listener=\"web\",reason=\"{reason}\"}}");
        assert_eq!(metric(&p, &series).await, 1.0, "{series}");
    }
    assert_eq!(bs[0].requests(), 0, "nothing reached the backend");
    p.shutdown().await;
}

/// E19: a reload resizes `max_connections`: raised, a connection waiting
/// in the backlog is served at once; lowered, new connections wait until
/// the open ones are under the new cap (none is cut).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_resizes_max_connections() {
    let bs = backends(1).await;
    let with_cap = |addr: &str, cap: u32| {
        config(&bs, "").replace(
            "    address: \"127.0.0.1:0\"\n    routes:",
            // Idle keep-alive connections stay for the whole test.
            &format!("    address: \"{addr}\"\n    max_connections: {cap}\n    timeouts: {{ request_headers: 1h, idle: 1h }}\n    routes:"),
        )
    };
    let (p, addr) = proxy(&with_cap("127.0.0.1:0", 1)).await;
    let reload = |cap: u32| {
        let text = with_cap(&addr.to_string(), cap);
        on_test_http1(meshless_proxy::ProxyConfig::parse(&text, "r.yaml").unwrap())
    };
    let get = b"GET / HTTP/1.1\r\nHost: t\r\n\r\n";
    let (first, head) = head_of(addr, get).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    p.reload(reload(2)).await.expect("reload to 2");
    // The second slot: served (before the fix it waited for the first).
    let (second, head) = head_of(addr, get).await;
    assert!(head.starts_with("http/1.1 200"), "raised cap: {head}");
    p.reload(reload(1)).await.expect("reload to 1");
    drop(second);
    // Two open connections was one over the cap: with the second closed,
    // the first holds the only slot, so a third waits in the backlog.
    let mut third = TcpStream::connect(addr).await.unwrap();
    third.write_all(get).await.unwrap();
    let mut byte = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(500), third.read(&mut byte)).await;
    assert!(early.is_err(), "served over the lowered cap");
    drop(first);
    let n = tokio::time::timeout(DEADLINE, third.read(&mut byte))
        .await
        .expect("served once the first connection closed")
        .unwrap();
    assert_eq!(n, 1);
    p.shutdown().await;
}

/// R1: `limits.max_headers` above what a header map holds is refused at
/// load, naming the field; at the bound, a head past it is a 431 (and one
/// within it served), never a panic of the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_headers_is_bounded_by_what_a_map_holds() {
    // Raw: a hyper backend would refuse more than 100 fields itself.
    let up =
        raw_upstream(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").await;
    let endpoints = format!("      - {{ address: \"{up}\" }}\n");
    let with = |n: u32| {
        config_with_endpoints(&endpoints, "").replace(
            "    address: \"127.0.0.1:0\"\n    routes:",
            &format!("    address: \"127.0.0.1:0\"\n    limits: {{ max_headers: {n}, max_header_bytes: 8388608 }}\n    routes:"),
        )
    };
    let err =
        meshless_proxy::ProxyConfig::parse(&with(100_000), "t.yaml").expect_err("above the bound");
    let msg = err.to_string();
    assert!(msg.contains("limits.max_headers"), "{msg}");
    assert!(msg.contains("10000"), "{msg}");
    let (p, addr) = proxy(&with(10_000)).await;
    for (fields, want) in [(9_990, "http/1.1 200"), (33_000, "http/1.1 431")] {
        let mut req = b"GET / HTTP/1.1\r\nHost: t\r\n".to_vec();
        for i in 0..fields {
            req.extend_from_slice(format!("x-{i}: v\r\n").as_bytes());
        }
        req.extend_from_slice(b"\r\n");
        let (_s, head) = head_of(addr, &req).await;
        assert!(head.starts_with(want), "{fields} fields: {head}");
    }
    p.shutdown().await;
}
