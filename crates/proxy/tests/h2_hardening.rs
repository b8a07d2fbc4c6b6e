//! HTTP/2, gRPC and TLS hardening: rapid reset, gRPC status, upstream
//! stream errors and keep-alive, health checks over TLS, reloads.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use tokio::io::AsyncReadExt;
use tokio::sync::watch;

/// A TCP upstream that counts the connections it accepted (total) and
/// those still open, and never answers (every request is held until the
/// proxy closes the connection).
struct Silent {
    addr: SocketAddr,
    accepted: watch::Receiver<usize>,
    open: Arc<AtomicUsize>,
}

async fn silent_upstream() -> Silent {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, accepted) = watch::channel(0usize);
    let open = Arc::new(AtomicUsize::new(0));
    let open2 = Arc::clone(&open);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tx.send_modify(|n| *n += 1);
            open2.fetch_add(1, Ordering::SeqCst);
            let open = Arc::clone(&open2);
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                }
                open.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    Silent {
        addr,
        accepted,
        open,
    }
}

/// H1 (CVE-2023-44487, rapid reset): a client that opens streams and
/// resets each once the proxy has started its upstream attempt gets a
/// GOAWAY after a bounded number of them, and each reset cancels its
/// upstream attempt (the upstream sees its connection closed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_reset_gets_goaway_and_bounded_upstream_connections() {
    let up = silent_upstream().await;
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 5s\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\nclusters:\n  - name: c\n    endpoints:\n      - {{ address: \"{}\" }}\n",
        up.addr
    );
    let (_p, addr) = proxy(&yaml).await;
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut client, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    let (done_tx, mut done) = watch::channel(None::<Result<(), h2::Error>>);
    tokio::spawn(async move {
        let r = conn.await;
        let _ = done_tx.send(Some(r));
    });
    const STREAMS: usize = 1000;
    let mut sent = 0;
    let mut accepted = up.accepted.clone();
    for i in 0..STREAMS {
        let ready = tokio::select! {
            r = client.ready() => r,
            _ = done.wait_for(Option::is_some) => break,
        };
        let Ok(c) = ready else { break };
        client = c;
        let req = http::Request::get(format!("http://{addr}/r{i}"))
            .body(())
            .expect("request");
        let Ok((_resp, mut stream)) = client.send_request(req, true) else {
            break;
        };
        sent += 1;
        // Reset once the proxy has opened its upstream connection for it
        // (an accepted stream: h2's pending-accept limit does not count it).
        tokio::select! {
            r = tokio::time::timeout(DEADLINE, accepted.wait_for(|n| *n > i)) => {
                r.expect("the upstream sees the attempt").expect("counter");
            }
            _ = done.wait_for(Option::is_some) => break,
        }
        stream.send_reset(h2::Reason::CANCEL);
    }
    // The connection ends (GOAWAY) well before every stream was sent.
    tokio::time::timeout(DEADLINE, done.wait_for(Option::is_some))
        .await
        .expect("the proxy ends the connection")
        .expect("watch");
    let total = *up.accepted.borrow();
    eprintln!("{sent} streams sent, {total} upstream connections");
    assert!(sent < STREAMS, "all {sent} streams were accepted");
    assert!(
        total <= 200,
        "{total} upstream connections for {sent} reset streams"
    );
    // Every reset stream's upstream attempt was cancelled.
    eventually(
        "the upstream connections of reset streams close",
        || async { up.open.load(Ordering::SeqCst) == 0 },
    )
    .await;
}

/// What the raw HTTP/2 upstream does with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// `200`, a body, end of stream.
    Ok,
    /// A gRPC response (`application/grpc`, one message) whose stream ends
    /// without `grpc-status` (no trailers).
    GrpcNoStatus,
    /// A gRPC response head that ends the stream, without `grpc-status`.
    GrpcHeadOnlyNoStatus,
    /// RST_STREAM with this reason.
    Reset(h2::Reason),
    /// `200` with a field whose name HTTP/2 lets through and HTTP/1.1
    /// forbids (`x"y`: `"` is no token character), as a gRPC response
    /// whose `grpc-status` would come in trailers.
    BadName,
}

/// A raw HTTP/2 (h2c) upstream answering request `n` (counted from 0 over
/// every connection) with `answer(n)`; counts connections and requests.
struct H2Upstream {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
}

async fn h2_upstream(answer: fn(usize) -> Answer) -> H2Upstream {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let connections = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(AtomicUsize::new(0));
    let (conns, reqs) = (Arc::clone(&connections), Arc::clone(&requests));
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            conns.fetch_add(1, Ordering::SeqCst);
            let reqs = Arc::clone(&reqs);
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(s).await else {
                    return;
                };
                while let Some(Ok((_req, mut respond))) = conn.accept().await {
                    let n = reqs.fetch_add(1, Ordering::SeqCst);
                    let grpc = || {
                        http::Response::builder()
                            .status(200)
                            .header("content-type", "application/grpc")
                            .body(())
                            .expect("response")
                    };
                    match answer(n) {
                        Answer::Ok => {
                            let resp = http::Response::builder()
                                .status(200)
                                .header("x-backend", "raw")
                                .body(())
                                .expect("response");
                            if let Ok(mut body) = respond.send_response(resp, false) {
                                let _ = body.send_data(bytes::Bytes::from_static(b"ok\n"), true);
                            }
                        }
                        Answer::GrpcNoStatus => {
                            if let Ok(mut body) = respond.send_response(grpc(), false) {
                                let msg = bytes::Bytes::from_static(&[0, 0, 0, 0, 0]);
                                let _ = body.send_data(msg, true);
                            }
                        }
                        Answer::GrpcHeadOnlyNoStatus => {
                            let _ = respond.send_response(grpc(), true);
                        }
                        Answer::Reset(reason) => respond.send_reset(reason),
                        Answer::BadName => {
                            let name = http::HeaderName::from_lowercase(b"x\"y")
                                .expect("HTTP/2's table takes it");
                            let resp = http::Response::builder()
                                .status(200)
                                .header("content-type", "application/grpc")
                                .header(name, "1")
                                .body(())
                                .expect("response");
                            if let Ok(mut body) = respond.send_response(resp, false) {
                                let _ = body.send_data(bytes::Bytes::from_static(b"ok\n"), true);
                            }
                        }
                    }
                }
            });
        }
    });
    H2Upstream {
        addr,
        connections,
        requests,
    }
}

/// A proxy in front of one HTTP/2 endpoint at `addr`; `extra` is more of
/// the cluster's YAML (indented 4).
async fn h2_proxy(addrs: &[SocketAddr], extra: &str) -> (meshless_proxy::Proxy, SocketAddr) {
    let endpoints: String = addrs
        .iter()
        .map(|a| format!("      - {{ address: \"{a}\" }}\n"))
        .collect();
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 5s\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\nclusters:\n  - name: c\n    upstream_protocol: http2\n    endpoints:\n{endpoints}{extra}"
    );
    proxy(&yaml).await
}

/// The sum of `meshless_proxy_requests_total` samples of `class`.
async fn requests_of_class(p: &meshless_proxy::Proxy, class: &str) -> f64 {
    let page = admin(p, "/metrics").await.1;
    let tag = format!("class=\"{class}\"");
    page.lines()
        .filter(|l| l.starts_with("meshless_proxy_requests_total{") && l.contains(&tag))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// One gRPC-looking POST through the proxy; its status and whether its
/// body ended cleanly.
async fn grpc_post(addr: SocketAddr) -> (http::StatusCode, bool) {
    use http_body_util::BodyExt;
    let req = http::Request::post(format!("http://{addr}/pkg.Svc/Call"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(&[
            0, 0, 0, 0, 0,
        ])))
        .expect("request");
    let resp = h2_client().request(req).await.expect("response");
    let status = resp.status();
    (status, resp.into_body().collect().await.is_ok())
}

/// G1: a gRPC response whose stream ends without `grpc-status` (neither
/// in its headers nor in trailers) is a failure (INTERNAL, a 5xx), not a
/// success: in metrics, for outlier detection and for retries.
#[tokio::test]
async fn a_grpc_response_without_grpc_status_counts_as_a_failure() {
    let up = h2_upstream(|_| Answer::GrpcNoStatus).await;
    let (p, addr) = h2_proxy(&[up.addr], "").await;
    let (status, ended) = grpc_post(addr).await;
    assert_eq!(status, http::StatusCode::OK);
    assert!(ended);
    eventually("the call is counted as a 5xx", || async {
        requests_of_class(&p, "5xx").await == 1.0
    })
    .await;
    assert_eq!(requests_of_class(&p, "2xx").await, 0.0);

    // Outlier detection sees the failures: the endpoint is ejected.
    let up2 = h2_upstream(|_| Answer::GrpcNoStatus).await;
    let fine = h2_upstream(|_| Answer::Ok).await;
    let (p2, addr2) = h2_proxy(
        &[up2.addr, fine.addr],
        "    outlier_detection: { consecutive_5xx: 2, max_ejection_percent: 50 }\n",
    )
    .await;
    let failing = up2.addr.to_string();
    eventually(
        "the endpoint answering without grpc-status is ejected",
        || async {
            let _ = grpc_post(addr2).await;
            let (_, body) = admin(&p2, "/clusters").await;
            let v: serde_json::Value = serde_json::from_str(&body).expect("json");
            v[0]["endpoints"]
                .as_array()
                .expect("endpoints")
                .iter()
                .any(|e| e["address"] == failing.as_str() && e["ejected"].as_bool() == Some(true))
        },
    )
    .await;

    // A head-only gRPC answer without `grpc-status` is INTERNAL at once:
    // retried on `internal` (the second answer is a proper one).
    let up3 = h2_upstream(|n| {
        if n == 0 {
            Answer::GrpcHeadOnlyNoStatus
        } else {
            Answer::Ok
        }
    })
    .await;
    let (_p3, addr3) = h2_proxy(
        &[up3.addr],
        "    retries: { count: 1, on: [internal], all_methods: true }\n",
    )
    .await;
    let (status, _) = grpc_post(addr3).await;
    assert_eq!(status, http::StatusCode::OK);
    assert_eq!(up3.requests.load(Ordering::SeqCst), 2, "retried once");
}

/// G2: an upstream RST_STREAM on one stream does not drop the shared
/// HTTP/2 connection; REFUSED_STREAM is retried (it was not processed),
/// even when `retries.on` does not list it.
#[tokio::test]
async fn a_stream_reset_keeps_the_connection_and_refused_streams_are_retried() {
    // Request 0 is refused, then every one is answered.
    let up = h2_upstream(|n| {
        if n == 0 {
            Answer::Reset(h2::Reason::REFUSED_STREAM)
        } else {
            Answer::Ok
        }
    })
    .await;
    let (_p, addr) = h2_proxy(&[up.addr], "").await;
    let (status, backend, _) = get(&client(), addr, "/a", &[]).await;
    assert_eq!((status, backend.as_str()), (http::StatusCode::OK, "raw"));
    assert_eq!(
        up.requests.load(Ordering::SeqCst),
        2,
        "refused, then retried"
    );
    assert_eq!(
        up.connections.load(Ordering::SeqCst),
        1,
        "on the same connection"
    );

    // Another reason: that request fails (not retried by default), the
    // connection stays for the next one.
    let up2 = h2_upstream(|n| {
        if n == 0 {
            Answer::Reset(h2::Reason::INTERNAL_ERROR)
        } else {
            Answer::Ok
        }
    })
    .await;
    let (_p2, addr2) = h2_proxy(&[up2.addr], "").await;
    let (status, _, _) = get(&client(), addr2, "/a", &[]).await;
    assert_eq!(status, http::StatusCode::BAD_GATEWAY);
    for _ in 0..3 {
        let (status, _, _) = get(&client(), addr2, "/b", &[]).await;
        assert_eq!(status, http::StatusCode::OK);
    }
    assert_eq!(
        up2.connections.load(Ordering::SeqCst),
        1,
        "the connection was kept"
    );
}

/// G3: an upstream HTTP/2 connection whose peer stops answering (a frozen
/// relay: no FIN, no bytes) is closed by its keep-alive PINGs
/// (`connection_pool.connection_keepalive`), and the next request opens a
/// new connection instead of waiting on the dead one.
#[tokio::test]
async fn a_silent_upstream_h2_connection_is_closed_by_keepalive_pings() {
    let up = h2_upstream(|_| Answer::Ok).await;
    let relay = Relay::start(up.addr).await;
    let (p, addr) = h2_proxy(
        &[relay.local_addr()],
        "    connection_pool: { connection_keepalive: { interval: 100ms, timeout: 300ms } }\n    timeouts: { request: 60s }\n",
    )
    .await;
    let c = client();
    let (status, backend, _) = get(&c, addr, "/1", &[]).await;
    assert_eq!((status, backend.as_str()), (http::StatusCode::OK, "raw"));
    assert_eq!(up.connections.load(Ordering::SeqCst), 1);
    let open = || async {
        let (_, body) = admin(&p, "/clusters").await;
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        v[0]["upstream_connections"].as_u64().expect("gauge")
    };
    assert_eq!(open().await, 1);
    relay.freeze();
    eventually("the silent connection is closed", || async {
        open().await == 0
    })
    .await;
    let (status, _, _) = get(&c, addr, "/2", &[]).await;
    assert_eq!(status, http::StatusCode::OK);
    assert_eq!(up.connections.load(Ordering::SeqCst), 2, "a new connection");
}

/// H1, the other form: streams reset in the same breath as they are
/// opened (before the proxy accepts them) also end in a GOAWAY, and few
/// reach the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_reset_before_accept_get_goaway() {
    let up = silent_upstream().await;
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 5s\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\nclusters:\n  - name: c\n    endpoints:\n      - {{ address: \"{}\" }}\n",
        up.addr
    );
    let (_p, addr) = proxy(&yaml).await;
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut client, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    let ended = tokio::spawn(conn);
    const STREAMS: usize = 3000;
    let mut sent = 0;
    for i in 0..STREAMS {
        let Ok(c) = client.ready().await else { break };
        client = c;
        let req = http::Request::get(format!("http://{addr}/r{i}"))
            .body(())
            .expect("request");
        let Ok((_resp, mut stream)) = client.send_request(req, true) else {
            break;
        };
        stream.send_reset(h2::Reason::CANCEL);
        sent += 1;
        if ended.is_finished() {
            break;
        }
    }
    // The connection's end (a GOAWAY error or a clean close) is all
    // that matters here.
    let _ = tokio::time::timeout(DEADLINE, ended)
        .await
        .expect("the proxy ends the connection")
        .expect("task");
    let total = *up.accepted.borrow();
    eprintln!("{sent} streams sent, {total} upstream connections");
    assert!(sent < STREAMS, "all {sent} streams were accepted");
    assert!(
        total <= 200,
        "{total} upstream connections for {sent} reset streams"
    );
}

/// An HTTP/1.1 upstream that reports what it received on its first
/// connection once it holds a whole request of `body` bytes (then answers
/// 200), or when the proxy closes the connection first.
async fn reporting_upstream(body: usize) -> (SocketAddr, tokio::sync::oneshot::Receiver<Vec<u8>>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let Ok((mut s, _)) = listener.accept().await else {
            return;
        };
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let whole = got
                .windows(4)
                .position(|w| w == b"\r\n\r\n")
                .is_some_and(|i| got.len() >= i + 4 + body);
            if whole {
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
                break;
            }
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        let _ = tx.send(got);
        // Held open (as a keep-alive endpoint would) until the test ends.
        let _ = s.read(&mut buf).await;
    });
    (addr, rx)
}

/// R4: an HTTP/2 request whose DATA run past its `content-length` is
/// malformed (RFC 9113 8.1.1) and must not be forwarded: the declared
/// prefix never reaches the HTTP/1.1 upstream as a whole request (which
/// it would act on), and the client's stream is refused. It is counted
/// `client_error`, though the HTTP/2 layer's reset ends the exchange as
/// an abort would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_data_longer_than_content_length_is_not_forwarded_as_whole() {
    let (up, received) = reporting_upstream(5).await;
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: c }}]\nclusters:\n  - name: c\n    endpoints: [{{ address: \"{up}\" }}]\n"
    );
    let (p, addr) = proxy(&yaml).await;
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (client, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(conn);
    let mut client = client.ready().await.expect("ready");
    let req = http::Request::post(format!("http://{addr}/x"))
        .header("content-length", "5")
        .body(())
        .expect("request");
    let (resp, mut stream) = client.send_request(req, false).expect("sent");
    stream
        .send_data(bytes::Bytes::from_static(b"12345"), false)
        .expect("data");
    stream
        .send_data(bytes::Bytes::from_static(b"67890"), true)
        .expect("data");
    let got = tokio::time::timeout(DEADLINE, received)
        .await
        .expect("the upstream saw a whole request or its connection closed")
        .expect("report");
    let got = String::from_utf8_lossy(&got);
    assert!(
        !got.contains("12345"),
        "a whole request went upstream: {got:?}"
    );
    let answered = tokio::time::timeout(DEADLINE, resp)
        .await
        .expect("an answer");
    assert!(
        answered.as_ref().map_or(true, |r| r.status() != 200),
        "{answered:?}"
    );
    // Counted as the client's error (it broke the protocol), not as a
    // client that left.
    eventually("the request counted", || async {
        requests_of_class(&p, "client_error").await == 1.0
    })
    .await;
    assert_eq!(requests_of_class(&p, "client_abort").await, 0.0);
    p.shutdown().await;
}

/// Reads `s` until what came satisfies `done`; panics if it closes first.
async fn read_until(s: &mut tokio::net::TcpStream, done: impl Fn(&str) -> bool) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !done(&String::from_utf8_lossy(&got)) {
        let n = tokio::time::timeout(DEADLINE, s.read(&mut buf))
            .await
            .expect("an answer")
            .expect("read");
        assert!(n > 0, "closed: {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// An HTTP/2 upstream's response head that HTTP/1.1 cannot carry (a field
/// name with `"`) is answered `502` on an `http1: meshless` listener, and
/// the connection stays: not closed with no byte (a client would take
/// that for a stale keep-alive connection and send the request again),
/// and the field never written. Counted as `bad_response`. A gRPC call
/// (over HTTP/1.1, as proxies forward them to each other) is answered
/// `UNAVAILABLE`, and logged as answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_head_http1_cannot_carry_is_a_bad_gateway() {
    use tokio::io::AsyncWriteExt;
    let up = h2_upstream(|_| Answer::BadName).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("access.log");
    let yaml = format!(
        "access_log: \"{}\"\nadmin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    http1: meshless\n    routes: [{{ cluster: c }}]\nclusters:\n  - name: c\n    upstream_protocol: http2\n    retries: {{ count: 0 }}\n    endpoints: [{{ address: \"{}\" }}]\n",
        log.display(),
        up.addr
    );
    let (p, addr) = proxy(&yaml).await;
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let want = "upstream response cannot be sent over HTTP/1.1\n";
    for _ in 0..2 {
        s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .expect("written");
        let text = read_until(&mut s, |t| t.ends_with(want)).await;
        assert!(text.starts_with("HTTP/1.1 502 "), "{text}");
        assert!(!text.contains("x\"y"), "{text}");
        assert!(
            !text.to_ascii_lowercase().contains("connection: close"),
            "{text}"
        );
    }
    s.write_all(b"POST /pkg.Svc/Call HTTP/1.1\r\nHost: t\r\ncontent-type: application/grpc\r\nte: trailers\r\ncontent-length: 5\r\n\r\n\0\0\0\0\0")
        .await
        .expect("written");
    let text = read_until(&mut s, |t| t.contains("\r\n\r\n"))
        .await
        .to_ascii_lowercase();
    assert!(text.starts_with("http/1.1 200 "), "{text}");
    assert!(text.contains("grpc-status: 14\r\n"), "{text}");
    let series = "meshless_proxy_local_replies_total{listener=\"web\",reason=\"bad_response\"}";
    assert_eq!(proxy_metric(&p, series).await, 3.0);
    eventually("three lines logged", || async {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .count()
            == 3
    })
    .await;
    let text = std::fs::read_to_string(&log).expect("log");
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    for v in &lines[..2] {
        assert_eq!(v["status"], 502, "{v}");
    }
    assert_eq!(lines[2]["grpc_status"], 14, "{}", lines[2]);
    assert_eq!(lines[2]["status"], 502, "{}", lines[2]);
    p.shutdown().await;
}
