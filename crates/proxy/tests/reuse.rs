//! What is reused per worker, under the bad cases: the boxes of handler
//! and connection futures (`pooled_future`), the chunk of small strings
//! that holds heads and request ids (`byte_arena`), and HTTP/2 streams run
//! in their connection's task (`h2_streams`). Real sockets on 127.0.0.1.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Full};

fn yaml_for(upstream: SocketAddr) -> String {
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 5s\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\nclusters:\n  - name: c\n    endpoints:\n      - {{ address: \"{upstream}\" }}\n"
    )
}

/// Waits until the proxy counts no downstream connection.
async fn no_connection_counted(p: &meshless_proxy::Proxy) {
    eventually("no connection left counted", || async {
        metric_sum(
            &admin(p, "/metrics").await.1,
            "meshless_proxy_downstream_connections",
        ) == 0.0
    })
    .await;
}

/// A raw h2 client on `addr`, its connection driven by a task.
async fn h2(
    addr: SocketAddr,
) -> (
    h2::client::SendRequest<Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (client, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    (client, tokio::spawn(conn))
}

async fn body_of(
    resp: h2::client::ResponseFuture,
) -> Result<(http::StatusCode, Vec<u8>), h2::Error> {
    let resp = resp.await?;
    let status = resp.status();
    let mut body = resp.into_body();
    let mut out = Vec::new();
    while let Some(d) = body.data().await {
        let d = d?;
        let _ = body.flow_control().release_capacity(d.len());
        out.extend_from_slice(&d);
    }
    Ok((status, out))
}

/// A client that closes its HTTP/2 connection with 20 streams held by the
/// upstream: every upstream request is let go, each counted as the
/// client's abort, the connection no longer counted, and the proxy serves
/// the next client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_in_flight_are_let_go_when_their_client_closes() {
    let gated = Gated::start("g").await;
    let (p, addr) = proxy(&yaml_for(gated.local_addr())).await;
    let (mut client, conn) = h2(addr).await;
    let mut answers = Vec::new();
    for i in 0..20 {
        client = client.ready().await.expect("ready");
        let req = http::Request::get(format!("http://{addr}/d{i}"))
            .body(())
            .expect("request");
        let (resp, _stream) = client.send_request(req, true).expect("send");
        answers.push(resp);
    }
    eventually("20 requests held upstream", || async { gated.held() == 20 }).await;
    conn.abort();
    drop((client, answers));
    eventually("the upstream requests let go", || async {
        gated.held() == 0
    })
    .await;
    no_connection_counted(&p).await;
    let page = admin(&p, "/metrics").await.1;
    assert!(page.contains("class=\"client_abort\""), "{page}");
    gated.open();
    let (status, body, _) = get(&h2_client(), addr, "/after", &[]).await;
    assert_eq!(status, 200);
    assert_eq!(body.trim(), "g");
}

/// A graceful shutdown with 10 HTTP/2 streams in flight waits for them:
/// each is answered once the upstream answers, then the shutdown ends
/// and so does the client's connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_drain_lets_streams_in_flight_finish() {
    let gated = Gated::start("g").await;
    let (p, addr) = proxy(&yaml_for(gated.local_addr())).await;
    let (mut client, conn) = h2(addr).await;
    let mut waits = Vec::new();
    for i in 0..10 {
        client = client.ready().await.expect("ready");
        let req = http::Request::get(format!("http://{addr}/g{i}"))
            .body(())
            .expect("request");
        let (resp, _) = client.send_request(req, true).expect("send");
        waits.push(tokio::spawn(body_of(resp)));
    }
    eventually("10 requests held upstream", || async { gated.held() == 10 }).await;
    let shutdown = tokio::spawn(p.shutdown());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !shutdown.is_finished(),
        "the shutdown waits for the streams"
    );
    gated.open();
    for w in waits {
        let (status, body) = tokio::time::timeout(DEADLINE, w)
            .await
            .expect("in time")
            .expect("join")
            .expect("the stream completes");
        assert_eq!((status.as_u16(), &body[..]), (200, &b"g\n"[..]));
    }
    tokio::time::timeout(DEADLINE, shutdown)
        .await
        .expect("the shutdown ends")
        .expect("join");
    let _ = tokio::time::timeout(DEADLINE, conn)
        .await
        .expect("the client's connection ends");
}

/// Bursts of 190 streams on one connection, each held 300 ms upstream:
/// every one is answered 200. Started all in one turn, the upstream
/// connections they open overflowed the backend's accept queue (502s);
/// the connection starts them 32 a turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_of_streams_on_one_connection_are_all_answered() {
    // Kept: the backend stops when dropped.
    let backends = [backend("b0").await];
    let (_p, addr) = proxy(&config(&backends, "")).await;
    let (client, _conn) = h2(addr).await;
    for round in 0..3 {
        let mut answers = Vec::new();
        let mut c = client.clone().ready().await.expect("ready");
        for i in 0..190 {
            c = c.ready().await.expect("ready");
            let req = http::Request::get(format!("http://{addr}/r{round}-{i}?delay_ms=300"))
                .body(())
                .expect("request");
            let (resp, _) = c.send_request(req, true).expect("send");
            answers.push(tokio::spawn(body_of(resp)));
        }
        for (i, a) in answers.into_iter().enumerate() {
            let (status, body) = tokio::time::timeout(DEADLINE, a)
                .await
                .expect("in time")
                .expect("join")
                .expect("the stream completes");
            assert_eq!(
                status,
                200,
                "round {round} stream {i}: {}",
                String::from_utf8_lossy(&body)
            );
        }
    }
}

/// HTTP/1.1 heads on either side of the chunk's 512-byte copy limit, on
/// eight connections at once: every field arrives upstream intact, with
/// one 32-digit request id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_heads_of_every_size_arrive_intact() {
    let gated = Gated::start("g").await;
    gated.open();
    let (_p, addr) = proxy(&yaml_for(gated.local_addr())).await;
    let sizes: Vec<usize> = (0..400).map(|i| (i * 37) % 1100).collect();
    let pad = |i: usize, n: usize| -> String {
        (0..n)
            .map(|k| char::from(b'a' + ((k + i) % 26) as u8))
            .collect()
    };
    let mut clients = Vec::new();
    for w in 0..8 {
        let sizes = sizes.clone();
        clients.push(tokio::spawn(async move {
            let c = client();
            for (i, &n) in sizes.iter().enumerate().filter(|(i, _)| i % 8 == w) {
                let req = http::Request::get(format!("http://{addr}/h{i}"))
                    .header("x-id", i.to_string())
                    .header("x-pad", pad(i, n))
                    .body(Full::new(Bytes::new()))
                    .expect("request");
                let resp = c.request(req).await.expect("response");
                assert_eq!(resp.status(), 200);
                let _ = resp.into_body().collect().await;
            }
        }));
    }
    for c in clients {
        c.await.expect("client");
    }
    let seen = gated.seen();
    assert_eq!(seen.len(), sizes.len());
    for s in seen {
        let i: usize = s.headers["x-id"]
            .to_str()
            .expect("text")
            .parse()
            .expect("a number");
        assert_eq!(s.path, format!("/h{i}"));
        assert_eq!(
            s.headers.get("x-pad").map(|v| v.as_bytes()),
            Some(pad(i, sizes[i]).as_bytes()),
            "request {i}"
        );
        assert_eq!(s.headers.get_all("x-request-id").iter().count(), 1);
        assert_eq!(s.headers["x-request-id"].len(), 32);
    }
}

/// One HTTP/1.1 exchange on a new connection to `addr`: `POST
/// /echo?delay_ms=DELAY` with `body`, `Connection: close`; the response's
/// body (chunks joined).
async fn echo_once(addr: SocketAddr, body: &str, delay_ms: u64) -> String {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "POST /echo?delay_ms={delay_ms} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let resp = common::raw_h1::Reader::new()
        .response(&mut s, false)
        .await
        .expect("a response");
    assert_eq!(resp.status, 200, "{resp:?}");
    String::from_utf8(resp.body).expect("text")
}

/// Each connection's future lives in a box a worker reuses, and a worker
/// keeps at most 64: 150 connections at once, half of them closed by
/// their client mid-request, then 150 more. Every answer is its own
/// connection's, no connection is left counted, and the next round is
/// served as the first was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_by_the_hundred_each_keep_their_own_state() {
    let b = backend("b").await;
    // 150 upstream connections at once on a loaded 2-core machine: the
    // connects are given time and a retry, which is not what is tested.
    let yaml = format!(
        "{}    timeouts: {{ connect: 10s }}\n    retries: {{ count: 3, on: [connect_failure], budget_percent: 100 }}\n",
        yaml_for(b.local_addr())
    );
    let (p, addr) = proxy(&yaml).await;
    for round in 0..2 {
        let mut tasks = Vec::new();
        for i in 0..150 {
            if i % 25 == 24 {
                // In batches, still all in flight together (each is held
                // 200 ms upstream).
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let body = format!("round {round} connection {i} {}", "x".repeat(i * 7));
            tasks.push(tokio::spawn(async move {
                if i % 2 == 1 && round == 0 {
                    // Gone mid-request: its future is dropped before it ends.
                    let _ = tokio::time::timeout(
                        Duration::from_millis(100),
                        echo_once(addr, &body, 2_000),
                    )
                    .await;
                    return;
                }
                let got = echo_once(addr, &body, 200).await;
                assert_eq!(got, body, "connection {i}");
            }));
        }
        for t in tasks {
            t.await.expect("client");
        }
        no_connection_counted(&p).await;
        // The 75 gone mid-request were each counted as the client's abort,
        // when their futures were dropped, not later.
        let page = admin(&p, "/metrics").await.1;
        let aborts: f64 = page
            .lines()
            .filter(|l| l.starts_with("meshless_proxy_requests") && l.contains("client_abort"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert_eq!(aborts, 75.0, "{page}");
    }
}
