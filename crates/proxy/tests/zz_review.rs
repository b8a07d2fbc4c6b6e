//! Review tests (temporary): h2 streams in the connection task, pooled
//! futures and the byte arena, through real sockets.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Full};

fn yaml_for(addr: SocketAddr) -> String {
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 5s\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\nclusters:\n  - name: c\n    endpoints:\n      - {{ address: \"{addr}\" }}\n"
    )
}

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

async fn body_of(resp: h2::client::ResponseFuture) -> Result<(http::StatusCode, Vec<u8>), h2::Error> {
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

fn dump(page: &str, what: &str) {
    for l in page.lines() {
        if !l.starts_with('#') && (l.contains("requests_total") || l.contains("connections")) {
            eprintln!("[{what}] {l}");
        }
    }
}

/// Many concurrent streams on one connection, every third reset by the
/// client right after it is sent: the others all complete, the connection
/// stays usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_h2_streams_some_reset() {
    let b = backend("b0").await;
    let bs = vec![b];
    let (p, addr) = proxy(&config(&bs, "")).await;
    let (mut client, conn) = h2(addr).await;
    // Settings exchanged first.
    let (resp, _) = client.clone().ready().await.expect("ready")
        .send_request(http::Request::get(format!("http://{addr}/first")).body(()).unwrap(), true)
        .expect("send");
    body_of(resp).await.expect("first");
    let total: usize = std::env::var("TOTAL").ok().and_then(|v| v.parse().ok()).unwrap_or(150);
    let started = Instant::now();
    let mut waits = Vec::new();
    let mut resets = 0;
    let reset_every: usize = std::env::var("RESET_EVERY").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let immediate = std::env::var("IMMEDIATE").is_ok();
    for i in 0..total {
        client = match client.clone().ready().await {
            Ok(c) => c,
            Err(e) => {
                eprintln!("ready failed at stream {i}: {e:?} reason={:?}", e.reason());
                break;
            }
        };
        let req = http::Request::get(format!("http://{addr}/s{i}?delay_ms={}", 20 + i % 50))
            .body(())
            .expect("request");
        let (resp, mut stream) = client.send_request(req, true).expect("send");
        if i % reset_every == 0 {
            if immediate && i % 2 == 0 {
                // Reset at once.
                stream.send_reset(h2::Reason::CANCEL);
            } else {
                // Reset a little later, while its upstream attempt runs.
                tokio::spawn(async move {
                    let ms: u64 = std::env::var("RESET_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    stream.send_reset(h2::Reason::CANCEL);
                });
            }
            resets += 1;
            drop(resp);
        } else {
            waits.push(tokio::spawn(body_of(resp)));
        }
    }
    let n = waits.len();
    let mut ok = 0;
    for w in waits {
        let r = tokio::time::timeout(DEADLINE, w)
            .await
            .expect("a stream completes in time")
            .expect("join");
        let (s, body) = match r {
            Ok(x) => x,
            Err(e) => {
                eprintln!("not ok: stream error {e:?}");
                continue;
            }
        };
        if s == 200 && body == b"b0\n" {
            ok += 1;
        } else {
            eprintln!("not ok: {s} {:?}", String::from_utf8_lossy(&body));
        }
    }
    eprintln!("{ok}/{n} streams ok, {resets} reset, {:?}", started.elapsed());
    if conn.is_finished() {
        eprintln!("client conn ended: {:?}", conn.await);
        dump(&admin(&p, "/metrics").await.1, "dead");
        panic!("connection died");
    }
    dump(&admin(&p, "/metrics").await.1, "reset");
    assert_eq!(ok, n);
    // The connection is still usable.
    let client = client.ready().await.expect("ready after");
    let mut client = client;
    let (resp, _) = client
        .send_request(http::Request::get(format!("http://{addr}/last")).body(()).unwrap(), true)
        .expect("send");
    let (s, _) = tokio::time::timeout(DEADLINE, body_of(resp)).await.expect("in time").expect("ok");
    assert_eq!(s, 200);
    assert!(!conn.is_finished());
    dump(&admin(&p, "/metrics").await.1, "reset");
}

/// The client closes its TCP connection with streams in flight: the proxy
/// notices (upstream requests cancelled or completed, counted), and a new
/// connection is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_client_disconnects_with_streams_in_flight() {
    let gated = Gated::start("g").await;
    let (p, addr) = proxy(&yaml_for(gated.local_addr())).await;
    let (mut client, conn) = h2(addr).await;
    let mut resps = Vec::new();
    for i in 0..20 {
        client = client.ready().await.expect("ready");
        let req = http::Request::get(format!("http://{addr}/d{i}")).body(()).unwrap();
        let (resp, _stream) = client.send_request(req, true).expect("send");
        resps.push(resp);
    }
    eventually("20 requests held upstream", || async { gated.held() == 20 }).await;
    dump(&admin(&p, "/metrics").await.1, "before close");
    conn.abort();
    drop(client);
    drop(resps);
    let t = Instant::now();
    eventually("the upstream requests are let go", || async { gated.held() == 0 }).await;
    eprintln!("held 0 after {:?}", t.elapsed());
    tokio::time::sleep(Duration::from_millis(200)).await;
    dump(&admin(&p, "/metrics").await.1, "after close");
    gated.open();
    let c = h2_client();
    let (s, body, _) = get(&c, addr, "/after", &[]).await;
    assert_eq!(s, 200);
    assert_eq!(body.trim(), "g");
}

/// Graceful drain with streams in flight: the client gets GOAWAY (no new
/// stream), the in-flight ones complete once the upstream answers, and the
/// shutdown ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_graceful_drain_with_streams_in_flight() {
    let gated = Gated::start("g").await;
    let (p, addr) = proxy(&yaml_for(gated.local_addr())).await;
    let (mut client, conn) = h2(addr).await;
    let mut waits = Vec::new();
    for i in 0..10 {
        client = client.ready().await.expect("ready");
        let req = http::Request::get(format!("http://{addr}/g{i}")).body(()).unwrap();
        let (resp, _) = client.send_request(req, true).expect("send");
        waits.push(tokio::spawn(body_of(resp)));
    }
    eventually("10 requests held upstream", || async { gated.held() == 10 }).await;
    let t = Instant::now();
    let shutdown = tokio::spawn(p.shutdown());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!shutdown.is_finished(), "shutdown waits for the streams");
    gated.open();
    for w in waits {
        let (s, body) = tokio::time::timeout(DEADLINE, w)
            .await
            .expect("in time")
            .expect("join")
            .expect("stream ok");
        assert_eq!((s.as_u16(), &body[..]), (200, &b"g\n"[..]));
    }
    tokio::time::timeout(DEADLINE, shutdown).await.expect("shutdown ends").expect("join");
    eprintln!("drain took {:?}", t.elapsed());
    let r = tokio::time::timeout(DEADLINE, conn).await.expect("conn ends").expect("join");
    eprintln!("client conn ended: {r:?}");
}

/// HTTP/1 heads of many sizes (either side of 512 bytes), concurrently on
/// several connections: every header arrives upstream intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h1_heads_of_every_size_arrive_intact() {
    let gated = Gated::start("g").await;
    gated.open();
    let (_p, addr) = proxy(&yaml_for(gated.local_addr())).await;
    let sizes: Vec<usize> = (0..400).map(|i| (i * 37) % 1100).collect();
    let mut tasks = Vec::new();
    for w in 0..8 {
        let sizes = sizes.clone();
        tasks.push(tokio::spawn(async move {
            let c = client();
            for (i, &n) in sizes.iter().enumerate() {
                if i % 8 != w {
                    continue;
                }
                let pad: String = (0..n).map(|k| (b'a' + ((k + i) % 26) as u8) as char).collect();
                let req = http::Request::get(format!("http://{addr}/h{i}"))
                    .header("x-id", i.to_string())
                    .header("x-pad", pad)
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                let resp = c.request(req).await.expect("response");
                assert_eq!(resp.status(), 200);
                let _ = resp.into_body().collect().await;
            }
        }));
    }
    for t in tasks {
        t.await.expect("client");
    }
    let seen = gated.seen();
    assert_eq!(seen.len(), sizes.len());
    for s in seen {
        let i: usize = s.headers["x-id"].to_str().unwrap().parse().unwrap();
        let n = sizes[i];
        let pad: String = (0..n).map(|k| (b'a' + ((k + i) % 26) as u8) as char).collect();
        assert_eq!(s.path, format!("/h{i}"));
        assert_eq!(s.headers.get("x-pad").map(|v| v.as_bytes()), Some(pad.as_bytes()), "request {i}");
        assert_eq!(s.headers.get_all("x-request-id").iter().count(), 1);
        assert_eq!(s.headers["x-request-id"].len(), 32);
    }
}

/// PING round trips on a connection whose streams are busy (uploads echoed
/// back): how long the connection's own frames wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_ping_latency_under_busy_streams() {
    let b = backend("b0").await;
    let bs = vec![b];
    let (_p, addr) = proxy(&config(&bs, "")).await;
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (client, mut conn) = h2::client::Builder::new()
        .initial_window_size(1 << 20)
        .initial_connection_window_size(1 << 24)
        .handshake::<_, Bytes>(tcp)
        .await
        .expect("h2 handshake");
    let mut pp = conn.ping_pong().expect("ping_pong");
    tokio::spawn(conn);
    let streams: usize = std::env::var("STREAMS").ok().and_then(|v| v.parse().ok()).unwrap_or(100);
    let size: usize = 128 * 1024;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..streams {
        let client = client.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut done = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut c = client.clone().ready().await.expect("ready");
                let req = http::Request::post(format!("http://{addr}/echo")).body(()).unwrap();
                let (resp, mut send) = c.send_request(req, false).expect("send");
                let body = Bytes::from(vec![b'x'; size]);
                send.reserve_capacity(size);
                send.send_data(body, true).expect("data");
                let (s, b) = body_of(resp).await.expect("resp");
                assert_eq!((s.as_u16(), b.len()), (200, size));
                done += 1;
            }
            done
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut rtts = Vec::new();
    for _ in 0..30 {
        let t = Instant::now();
        pp.ping(h2::Ping::opaque()).await.expect("pong");
        rtts.push(t.elapsed());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("task");
    }
    rtts.sort();
    eprintln!(
        "{streams} streams, {total} exchanges; ping rtt p50 {:?} p90 {:?} max {:?}",
        rtts[rtts.len() / 2],
        rtts[rtts.len() * 9 / 10],
        rtts[rtts.len() - 1]
    );
}

/// A burst of new streams, then a PING at once: how long the connection's
/// frames wait behind the burst's first polls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_ping_after_a_burst_of_streams() {
    let b = backend("b0").await;
    let bs = vec![b];
    let (_p, addr) = proxy(&config(&bs, "")).await;
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (client, mut conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    let mut pp = conn.ping_pong().expect("ping_pong");
    tokio::spawn(conn);
    let burst: usize = std::env::var("BURST").ok().and_then(|v| v.parse().ok()).unwrap_or(190);
    let mut rtts = Vec::new();
    for round in 0..5 {
        let mut resps = Vec::new();
        let mut c = client.clone().ready().await.expect("ready");
        for i in 0..burst {
            c = c.ready().await.expect("ready");
            let req = http::Request::get(format!("http://{addr}/r{round}-{i}?delay_ms=300")).body(()).unwrap();
            let (resp, _) = c.send_request(req, true).expect("send");
            let sent = Instant::now();
            resps.push(tokio::spawn(async move { let r = body_of(resp).await; (r, sent.elapsed()) }));
        }
        let t = Instant::now();
        pp.ping(h2::Ping::opaque()).await.expect("pong");
        rtts.push(t.elapsed());
        for r in resps {
            let (r, took) = r.await.expect("join");
            let (s, b) = r.expect("stream");
            if s != 200 {
                eprintln!("not ok: {s} {:?} after {took:?}", String::from_utf8_lossy(&b));
            }
        }
    }
    eprintln!("burst {burst}: ping rtts {rtts:?}");
}

fn rss_kib() -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines().find(|l| l.starts_with("VmRSS:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Small copies kept (as queued small body frames would be) while other
/// short-lived copies (heads) are made between them on the same thread.
#[test]
fn byte_arena_small_kept_copies_pin_whole_chunks() {
    std::thread::spawn(|| {
        let n = 100_000;
        for arena in [false, true] {
            let before = rss_kib();
            let mut kept = Vec::with_capacity(n);
            for i in 0..n {
                let one = [b'0' + (i % 10) as u8; 16];
                kept.push(if arena { meshless_proxy::byte_arena::copy(&one) } else { Bytes::copy_from_slice(&one) });
                for _ in 0..3 {
                    let head = [b'h'; 400];
                    drop(if arena { meshless_proxy::byte_arena::copy(&head) } else { Bytes::copy_from_slice(&head) });
                }
            }
            let after = rss_kib();
            eprintln!("arena={arena}: {n} kept 16-byte copies: RSS +{} KiB", after.saturating_sub(before));
            drop(kept);
        }
    })
    .join()
    .unwrap();
}
