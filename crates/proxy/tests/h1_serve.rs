//! The meshless HTTP/1 server (`listeners[].http1: meshless`) through
//! real sockets: keep-alive, pipelining, `Connection: close`, HTTP/1.0,
//! request bodies by length, chunked and after `100 Continue`, clients
//! that vanish at each step (every gauge back to 0, the request counted as
//! `client_abort`), and idle connections that hold no buffer.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::raw_h1::Reader;
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BUFFERS: &str = "meshless_proxy_http1_buffers_lent{listener=\"web\"}";
const CONNECTIONS: &str = "meshless_proxy_downstream_connections{listener=\"web\"}";

/// `yaml` (one listener, as [`config`] writes it) with `field` (one line
/// of YAML, unindented) added to the listener.
fn with_listener_field(yaml: &str, field: &str) -> String {
    let at = "    address: \"127.0.0.1:0\"\n    routes:";
    assert!(yaml.contains(at), "no listener to add {field} to: {yaml}");
    yaml.replace(
        at,
        &format!("    address: \"127.0.0.1:0\"\n    {field}\n    routes:"),
    )
}

/// A proxy whose listener `web` is served by meshless's HTTP/1 server.
async fn h1_proxy(bs: &[meshless_backend::Backend]) -> (meshless_proxy::Proxy, SocketAddr) {
    proxy(&with_listener_field(&config(bs, ""), "http1: meshless")).await
}

/// Whether the server closes `s` (reads until EOF; bytes are ignored).
async fn closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(DEADLINE, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => return false,
        }
    }
}

/// Polls until `series` reads `want` on the proxy's `/metrics`.
async fn metric_is(p: &meshless_proxy::Proxy, series: &str, want: f64) {
    eventually(&format!("{series} == {want}"), || async {
        proxy_metric(p, series).await == want
    })
    .await;
}

/// Waits until the listener counts no connection and no buffer, then
/// shuts the proxy down.
async fn nothing_held_then_shutdown(p: meshless_proxy::Proxy) {
    metric_is(&p, CONNECTIONS, 0.0).await;
    metric_is(&p, BUFFERS, 0.0).await;
    p.shutdown().await;
}

/// Polls until no endpoint counts a request in flight.
async fn nothing_in_flight(p: &meshless_proxy::Proxy) {
    eventually("no request in flight", || async {
        metric_sum(
            &admin(p, "/metrics").await.1,
            "meshless_proxy_endpoint_in_flight{",
        ) == 0.0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_requests_share_a_connection_that_idles_with_no_buffer() {
    let bs = backends(1).await;
    let (p, addr) = h1_proxy(&bs).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut r = Reader::new();
    for i in 0..3 {
        s.write_all(format!("GET /{i} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let resp = r.response(&mut s, false).await.expect("a response");
        assert_eq!(resp.status, 200);
        assert_eq!(resp.header("x-backend"), Some("b0"));
        assert_eq!(resp.body, b"b0\n");
        assert!(resp.header("date").is_some());
    }
    assert_eq!(bs[0].requests(), 3);
    // Open and idle: no buffer lent (the gauge falls as the connection
    // gives its buffers back, which it does before waiting again).
    metric_is(&p, CONNECTIONS, 1.0).await;
    metric_is(&p, BUFFERS, 0.0).await;
    // Many idle connections, each after one request: still none.
    let mut idle = Vec::new();
    for _ in 0..20 {
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(
            Reader::new().response(&mut c, false).await.unwrap().status,
            200
        );
        idle.push(c);
    }
    metric_is(&p, CONNECTIONS, 21.0).await;
    metric_is(&p, BUFFERS, 0.0).await;
    // A request under way holds its buffer (the series is real): one
    // for the response it awaits, given back when it ends.
    let mut busy = TcpStream::connect(addr).await.unwrap();
    busy.write_all(b"GET /?delay_ms=60000 HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    metric_is(&p, BUFFERS, 1.0).await;
    drop(busy);
    metric_is(&p, BUFFERS, 0.0).await;
    drop(idle);
    drop(s);
    metric_is(&p, CONNECTIONS, 0.0).await;
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order() {
    let bs = backends(1).await;
    let (p, addr) = h1_proxy(&bs).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    // The first is slow: the second and third wait in the buffer.
    s.write_all(
        b"GET /status/201?delay_ms=50 HTTP/1.1\r\nHost: t\r\n\r\nPOST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhelloHEAD /status/202 HTTP/1.1\r\nHost: t\r\n\r\n",
    )
    .await
    .unwrap();
    let mut r = Reader::new();
    assert_eq!(r.response(&mut s, false).await.unwrap().status, 201);
    let echo = r.response(&mut s, false).await.unwrap();
    assert_eq!((echo.status, &echo.body[..]), (200, &b"hello"[..]));
    assert_eq!(r.response(&mut s, true).await.unwrap().status, 202);
    // Still open for more.
    s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(r.response(&mut s, false).await.unwrap().status, 200);
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_close_and_http10_close_after_the_response() {
    let bs = backends(1).await;
    let (p, addr) = h1_proxy(&bs).await;
    for req in [
        &b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"[..],
        b"GET / HTTP/1.0\r\n\r\n",
    ] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(req).await.unwrap();
        let resp = Reader::new().response(&mut s, false).await.unwrap();
        assert_eq!(resp.status, 200);
        assert_eq!(resp.body, b"b0\n");
        assert_eq!(resp.header("connection"), Some("close"));
        assert!(closed(&mut s).await, "closed after {req:?}");
    }
    // HTTP/1.0 asking for keep-alive keeps its connection.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut r = Reader::new();
    for _ in 0..2 {
        s.write_all(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            .await
            .unwrap();
        let resp = r.response(&mut s, false).await.unwrap();
        assert_eq!(resp.status, 200);
        assert_eq!(resp.header("connection"), Some("keep-alive"));
    }
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_by_length_chunked_and_after_100_continue() {
    let bs = backends(1).await;
    let (p, addr) = h1_proxy(&bs).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut r = Reader::new();
    // Content-Length, in two writes.
    s.write_all(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 11\r\n\r\nhello")
        .await
        .unwrap();
    s.write_all(b" world").await.unwrap();
    let resp = r.response(&mut s, false).await.unwrap();
    assert_eq!(resp.body, b"hello world");
    // Chunked, with an extension and a trailer.
    s.write_all(
        b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n6\r\n world\r\n0\r\nx-t: 1\r\n\r\n",
    )
    .await
    .unwrap();
    let resp = r.response(&mut s, false).await.unwrap();
    assert_eq!(resp.body, b"hello world");
    // 100-continue: the interim answer comes before the body is sent.
    s.write_all(
        b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n",
    )
    .await
    .unwrap();
    let interim = r.response(&mut s, false).await.unwrap();
    assert_eq!(interim.status, 100);
    s.write_all(b"ping").await.unwrap();
    let resp = r.response(&mut s, false).await.unwrap();
    assert_eq!((resp.status, &resp.body[..]), (200, &b"ping"[..]));
    // A large body, streamed both ways.
    let big = vec![b'x'; 1 << 20];
    let mut head = format!(
        "POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n",
        big.len()
    )
    .into_bytes();
    head.extend_from_slice(&big);
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        wr.write_all(&head).await.unwrap();
        wr
    });
    let mut got = Vec::new();
    let mut buf = vec![0u8; 65536];
    let mut all = std::mem::take(&mut r.rest);
    while !all.windows(4).any(|w| w == b"\r\n\r\n") || got.len() < big.len() {
        let n = tokio::time::timeout(DEADLINE, rd.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed mid-response");
        all.extend_from_slice(&buf[..n]);
        if let Some(i) = all.windows(4).position(|w| w == b"\r\n\r\n") {
            got = all[i + 4..].to_vec();
        }
    }
    writer.await.unwrap();
    assert!(got.len() >= big.len());
    p.shutdown().await;
}

/// Writes `raw` on a new connection, then closes it at once.
async fn vanish_after(addr: SocketAddr, raw: &[u8]) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(raw).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_vanishes_at_any_step_leaves_every_gauge_at_zero() {
    let bs = backends(1).await;
    let (p, addr) = h1_proxy(&bs).await;
    // Mid-head.
    vanish_after(addr, b"GET / HTTP/1.1\r\nHost:").await;
    // Mid-body.
    vanish_after(
        addr,
        b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\nonly ten..",
    )
    .await;
    // Mid-chunked-body.
    vanish_after(
        addr,
        b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
    )
    .await;
    // While the upstream answers: the request is dropped, not finished.
    vanish_after(addr, b"GET /?delay_ms=60000 HTTP/1.1\r\nHost: t\r\n\r\n").await;
    // Mid-response: a 4 MiB answer never read.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let n = 4 << 20;
    let mut req =
        format!("POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: {n}\r\n\r\n").into_bytes();
    req.extend(std::iter::repeat_n(b'y', n));
    let _ = tokio::time::timeout(Duration::from_millis(500), s.write_all(&req)).await;
    drop(s);
    metric_is(&p, CONNECTIONS, 0.0).await;
    metric_is(&p, BUFFERS, 0.0).await;
    nothing_in_flight(&p).await;
    let page = admin(&p, "/metrics").await.1;
    assert!(page.contains("class=\"client_abort\""), "{page}");
    // The endpoint is not blamed and serves on.
    assert_eq!(get(&client(), addr, "/", &[]).await.0, http::StatusCode::OK);
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_head_is_answered_and_closed() {
    let bs = backends(1).await;
    let (p, addr) = h1_proxy(&bs).await;
    for (raw, status) in [
        (&b"GET / HTTP/1.1\r\nX-A: a\0b\r\n\r\n"[..], 400),
        (
            b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            400,
        ),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
    ] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(raw).await.unwrap();
        let resp = Reader::new().response(&mut s, false).await.unwrap();
        assert_eq!(resp.status, status, "{raw:?}");
        assert_eq!(resp.header("connection"), Some("close"));
        assert!(closed(&mut s).await);
    }
    assert_eq!(bs[0].requests(), 0);
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_left_unread_is_discarded_up_to_a_bound_then_the_connection_closes() {
    let bs = backends(1).await;
    // Only `/api` is routed: anything else is answered 404 by the proxy,
    // which never reads the request's body.
    let yaml = config(&bs, "").replace(
        "    routes:\n      - cluster: c\n",
        "    http1: meshless\n    routes:\n      - match: { path_prefix: /api }\n        cluster: c\n",
    );
    assert!(yaml.contains("http1: meshless"));
    let (p, addr) = proxy(&yaml).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut r = Reader::new();
    let body = vec![b'z'; 1000];
    let mut req = b"POST /other HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n".to_vec();
    req.extend_from_slice(&body);
    req.extend_from_slice(b"GET /api HTTP/1.1\r\nHost: t\r\n\r\n");
    s.write_all(&req).await.unwrap();
    let first = r.response(&mut s, false).await.unwrap();
    assert_eq!(first.status, 404);
    assert_eq!(first.header("connection"), None);
    // The unread body was skipped, not taken for the next request.
    let second = r.response(&mut s, false).await.unwrap();
    assert_eq!((second.status, &second.body[..]), (200, &b"b0\n"[..]));
    // Chunked too.
    s.write_all(b"POST /other HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\nGET /api HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(r.response(&mut s, false).await.unwrap().status, 404);
    assert_eq!(r.response(&mut s, false).await.unwrap().status, 200);
    // Over the bound: the connection closes after the answer.
    let n = 1 << 20;
    let mut big =
        format!("POST /other HTTP/1.1\r\nHost: t\r\nContent-Length: {n}\r\n\r\n").into_bytes();
    big.extend(std::iter::repeat_n(b'z', n));
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(&big).await;
        wr
    });
    let mut all = std::mem::take(&mut r.rest);
    let mut buf = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(DEADLINE, rd.read(&mut buf))
            .await
            .expect("the proxy closes the connection")
            .unwrap_or(0);
        if n == 0 {
            break;
        }
        all.extend_from_slice(&buf[..n]);
    }
    assert!(
        all.starts_with(b"HTTP/1.1 404"),
        "{:?}",
        String::from_utf8_lossy(&all)
    );
    writer.abort();
    metric_is(&p, BUFFERS, 0.0).await;
    p.shutdown().await;
}

/// A request answered without reading its body, whose client then sends
/// nothing more: the proxy waits for the rest only up to
/// `timeouts.request_headers`, then closes (a silent client cannot hold
/// the connection, its buffer and a connection slot forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_with_an_unread_body_is_closed() {
    let bs = backends(1).await;
    let yaml = config(&bs, "").replace(
        "    routes:\n      - cluster: c\n",
        "    http1: meshless\n    timeouts: { request_headers: 1s }\n    routes:\n      - match: { path_prefix: /api }\n        cluster: c\n",
    );
    assert!(yaml.contains("request_headers: 1s"));
    let (p, addr) = proxy(&yaml).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"POST /other HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\nonly this")
        .await
        .unwrap();
    let resp = Reader::new().response(&mut s, false).await.unwrap();
    assert_eq!(resp.status, 404);
    assert!(closed(&mut s).await, "the silent client was not closed");
    nothing_held_then_shutdown(p).await;
}

// ---------------------------------------------------------------------
// The two HTTP/1 servers side by side: what a client can observe must be
// the same on `http1: meshless` as on hyper's (the default).
// ---------------------------------------------------------------------

use meshless_proxy::h1serve::Http1Server;

/// A listener `web` routing `/x` to an endpoint at `x` and the rest to
/// the backends `bs`; `listener_extra` is YAML indented 4.
fn two_clusters(bs: &[meshless_backend::Backend], x: SocketAddr, listener_extra: &str) -> String {
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 5s\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n{listener_extra}    routes:\n      - match: {{ path_prefix: /x }}\n        cluster: x\n      - cluster: c\nclusters:\n  - name: c\n    endpoints:\n{}  - name: x\n    endpoints:\n      - {{ address: \"{x}\" }}\n",
        endpoints_yaml(bs)
    )
}

/// An HTTP/1.0 client is answered with an `HTTP/1.0` status line (hyper
/// speaks the version of its peer), kept alive only when it asked; a
/// response an upstream sent as HTTP/1.0 keeps its version on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http10_is_answered_as_hyper_answers_it() {
    let bs = backends(1).await;
    let old = raw_upstream(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nold").await;
    let yaml = two_clusters(&bs, old, "");
    let mut from_old = Vec::new();
    for engine in ENGINES {
        let (p, addr) = proxy_on(&yaml, engine).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
        let resp = Reader::new().response(&mut s, false).await.unwrap();
        assert_eq!(
            (resp.version, resp.status),
            (0, 200),
            "{engine:?}: {resp:?}"
        );
        assert_eq!(resp.body, b"b0\n");
        assert!(closed(&mut s).await, "{engine:?}: HTTP/1.0 closes");
        let mut s = TcpStream::connect(addr).await.unwrap();
        let mut r = Reader::new();
        for _ in 0..2 {
            s.write_all(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
                .await
                .unwrap();
            let resp = r.response(&mut s, false).await.unwrap();
            assert_eq!(
                (resp.version, resp.status),
                (0, 200),
                "{engine:?}: {resp:?}"
            );
            assert_eq!(resp.header("connection"), Some("keep-alive"), "{engine:?}");
        }
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let resp = Reader::new().response(&mut s, false).await.unwrap();
        assert_eq!((resp.status, &resp.body[..]), (200, &b"old"[..]));
        from_old.push((resp.version, resp.header("connection").map(str::to_owned)));
        p.shutdown().await;
    }
    assert_eq!(from_old[0], from_old[1], "hyper, then meshless");
}

/// A connection to `addr` whose `GET /x/hold` ([`holding_upstream`]) has
/// its head and half its body read: the rest waits for `release`.
async fn held_half_way(addr: SocketAddr) -> (TcpStream, Reader) {
    let s = TcpStream::connect(addr).await.unwrap();
    hold_half_way(s, Reader::new()).await
}

/// On `s`, as [`held_half_way`].
async fn hold_half_way(mut s: TcpStream, mut r: Reader) -> (TcpStream, Reader) {
    s.write_all(b"GET /x/hold HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    while !r.rest.windows(9).any(|w| w == b"\r\n\r\nhello") {
        r.fill(&mut s).await.expect("the head and half the body");
    }
    (s, r)
}

/// An upstream that answers `/x/hold` with its head and half its body,
/// the other half once `release` is notified, and anything else at once.
async fn holding_upstream() -> (SocketAddr, std::sync::Arc<tokio::sync::Notify>) {
    let release = std::sync::Arc::new(tokio::sync::Notify::new());
    let rel = std::sync::Arc::clone(&release);
    let addr = tcp_server(move |mut s| {
        let rel = std::sync::Arc::clone(&rel);
        async move {
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let end = head.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
                let hold = head.starts_with(b"GET /x/hold ");
                head.drain(..end);
                if hold {
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")
                        .await;
                    rel.notified().await;
                    let _ = s.write_all(b"world").await;
                } else {
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                        .await;
                }
            }
        }
    })
    .await;
    (addr, release)
}

/// A drain that starts while a response is being written: that response
/// is finished as its head promised (kept alive); then `OnNextResponse`
/// (a binary upgrade's hand-over) answers the next request with
/// `connection: close` and closes, and `Now` (shutdown) closes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_during_a_response_finishes_it_then_closes_as_asked() {
    let bs = backends(1).await;
    let (up, release) = holding_upstream().await;
    let yaml = two_clusters(&bs, up, "");
    for on_next in [true, false] {
        for engine in ENGINES {
            let (p, addr) = proxy_on(&yaml, engine).await;
            let (mut s, mut r) = held_half_way(addr).await;
            let stop = tokio::spawn(async move {
                if on_next {
                    p.shutdown_handed_over().await;
                } else {
                    p.shutdown().await;
                }
            });
            eventually("the listener stops accepting", || async {
                TcpStream::connect(addr).await.is_err()
            })
            .await;
            release.notify_one();
            let resp = r.response(&mut s, false).await.expect("the whole response");
            let case = format!("{engine:?}, on_next {on_next}");
            assert_eq!(
                (resp.status, &resp.body[..]),
                (200, &b"helloworld"[..]),
                "{case}"
            );
            assert_eq!(resp.header("connection"), None, "{case}");
            if on_next {
                s.write_all(b"GET /x/next HTTP/1.1\r\nHost: t\r\n\r\n")
                    .await
                    .unwrap();
                let next = r.response(&mut s, false).await.expect("the next response");
                assert_eq!((next.status, &next.body[..]), (200, &b"ok"[..]), "{case}");
                assert_eq!(next.header("connection"), Some("close"), "{case}");
            }
            assert!(closed(&mut s).await, "{case}: closed");
            tokio::time::timeout(DEADLINE, stop)
                .await
                .expect("the drain ends")
                .unwrap();
        }
    }
}

/// A request with `Expect: 100-continue` answered without its body being
/// read (no route): no `100 Continue` precedes the answer, on either path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_100_continue_for_a_body_nobody_reads() {
    let bs = backends(1).await;
    let yaml = config(&bs, "").replace(
        "    routes:\n      - cluster: c\n",
        "    routes:\n      - match: { path_prefix: /api }\n        cluster: c\n",
    );
    for engine in ENGINES {
        let (p, addr) = proxy_on(&yaml, engine).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(
            b"POST /other HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n",
        )
        .await
        .unwrap();
        let resp = Reader::new().response(&mut s, false).await.unwrap();
        assert_eq!(resp.status, 404, "{engine:?}");
        p.shutdown().await;
    }
}

/// Two pipelined requests, then the client shuts its sending side (it
/// has nothing more to say): on meshless's path both are answered, in
/// order, then the connection closes. hyper (1.12, `half_close` off)
/// may close on the end of stream once a response is out (seen here
/// answering only the first of two GETs), so its side is held only to
/// answering them in order from the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_then_a_half_close_are_all_answered() {
    let bs = backends(1).await;
    let yaml = config(&bs, "");
    for engine in ENGINES {
        let (p, addr) = proxy_on(&yaml, engine).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(
            b"GET /status/201?delay_ms=50 HTTP/1.1\r\nHost: t\r\n\r\nPOST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabcGET /status/202 HTTP/1.1\r\nHost: t\r\n\r\nGET /status/203 HTTP/1.1\r\n",
        )
        .await
        .unwrap();
        s.shutdown().await.unwrap();
        let mut r = Reader::new();
        let mut answered = Vec::new();
        while let Some(resp) = r.response(&mut s, false).await {
            answered.push((
                resp.status,
                String::from_utf8_lossy(&resp.body).into_owned(),
            ));
        }
        let want = [
            (201, "b0 201\n".to_owned()),
            (200, "abc".to_owned()),
            (202, "b0 202\n".to_owned()),
        ];
        match engine {
            // The last, partial head is never answered.
            Http1Server::Meshless => assert_eq!(answered, want),
            Http1Server::Hyper => {
                assert!(
                    !answered.is_empty() && want.starts_with(&answered),
                    "{answered:?}"
                )
            }
        }
        p.shutdown().await;
    }
}

/// With `max_headers` above 100, a chunked body may end with as many
/// trailer fields as a head may have fields (hyper's rule: its
/// `max_headers` counts both).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trailers_follow_the_listeners_max_headers() {
    let bs = backends(1).await;
    let yaml = config(&bs, "").replace(
        "    routes:\n",
        "    limits: { max_headers: 200 }\n    routes:\n",
    );
    let mut req =
        b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n"
            .to_vec();
    for i in 0..150 {
        req.extend_from_slice(format!("x-t-{i}: v\r\n").as_bytes());
    }
    req.extend_from_slice(b"\r\n");
    for engine in ENGINES {
        let (p, addr) = proxy_on(&yaml, engine).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&req).await.unwrap();
        let resp = Reader::new().response(&mut s, false).await.unwrap();
        assert_eq!(
            (resp.status, &resp.body[..]),
            (200, &b"hello"[..]),
            "{engine:?}"
        );
        p.shutdown().await;
    }
}

/// What an upstream's response head becomes downstream, on both engines:
/// a chunked response's stale `Content-Length` is dropped (RFC 9112 6.3),
/// equal repeated lengths are written once, a 204 carries no length, the
/// upstream's reason phrase is kept, and response trailers reach a client
/// that accepts them; the connection stays usable after each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_response_heads_reach_the_client_as_hyper_sends_them() {
    let bs = backends(1).await;
    let cases: [(&'static [u8], &str); 5] = [
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            "te_and_length",
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
            "repeated_length",
        ),
        (b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n", "no_content"),
        (
            b"HTTP/1.1 299 Weird Thing\r\nContent-Length: 5\r\n\r\nhello",
            "reason",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: x-t\r\n\r\n5\r\nhello\r\n0\r\nx-t: 1\r\n\r\n",
            "trailers",
        ),
    ];
    for (raw, case) in cases {
        let up = raw_upstream(raw).await;
        let yaml = two_clusters(&bs, up, "");
        for engine in ENGINES {
            let (p, addr) = proxy_on(&yaml, engine).await;
            let mut s = TcpStream::connect(addr).await.unwrap();
            let what = format!("{case} on {engine:?}");
            if case == "trailers" {
                s.write_all(b"GET /x HTTP/1.1\r\nHost: t\r\nTE: trailers\r\n\r\n")
                    .await
                    .unwrap();
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                while !got.ends_with(b"0\r\nx-t: 1\r\n\r\n") {
                    let n = tokio::time::timeout(DEADLINE, s.read(&mut buf))
                        .await
                        .expect("answer")
                        .unwrap();
                    assert!(
                        n > 0,
                        "{what}: closed after {:?}",
                        String::from_utf8_lossy(&got)
                    );
                    got.extend_from_slice(&buf[..n]);
                }
            } else {
                s.write_all(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n")
                    .await
                    .unwrap();
                let resp = Reader::new().response(&mut s, false).await.unwrap();
                let lengths: Vec<&str> = resp
                    .headers
                    .iter()
                    .filter(|(n, _)| n == "content-length")
                    .map(|(_, v)| v.as_str())
                    .collect();
                match case {
                    "no_content" => {
                        assert_eq!(resp.status, 204, "{what}");
                        assert!(lengths.is_empty(), "{what}: {resp:?}");
                    }
                    "reason" => {
                        assert_eq!(
                            (resp.status, &resp.reason[..]),
                            (299, "Weird Thing"),
                            "{what}"
                        );
                    }
                    _ => {
                        assert_eq!(
                            (resp.status, &resp.body[..]),
                            (200, &b"hello"[..]),
                            "{what}"
                        );
                        assert!(lengths.len() <= 1 && lengths != ["7"], "{what}: {resp:?}");
                    }
                }
            }
            // The connection still serves the next request.
            s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
                .await
                .unwrap();
            let next = Reader::new().response(&mut s, false).await;
            assert_eq!(next.map(|r| r.status), Some(200), "{what}: next request");
            p.shutdown().await;
        }
    }
}

/// An upstream that answers every request `200` once it has read the
/// request whole (a chunked body to its last chunk and trailers), and
/// sends each request's bytes on `seen`.
async fn recording_upstream() -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let addr = tcp_server(move |mut s| {
        let tx = tx.clone();
        async move {
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            // The test's requests are chunked: they end with the blank
            // line after the last chunk's trailers.
            while !(got.windows(3).any(|w| w == b"\r\n0") && got.ends_with(b"\r\n\r\n")) {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
            let _ = tx.send(got);
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                .await;
        }
    })
    .await;
    (addr, rx)
}

/// A chunked request's trailers reach an HTTP/1.1 upstream (`Trailer`
/// is end to end, RFC 9110 6.6.2), on both engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_trailers_reach_the_upstream() {
    let bs = backends(1).await;
    let (up, mut seen) = recording_upstream().await;
    let yaml = two_clusters(&bs, up, "");
    for engine in ENGINES {
        let (p, addr) = proxy_on(&yaml, engine).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(
            b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nTrailer: x-t\r\n\r\n5\r\nhello\r\n0\r\nx-t: 1\r\n\r\n",
        )
        .await
        .unwrap();
        let resp = Reader::new().response(&mut s, false).await.unwrap();
        assert_eq!(
            (resp.status, &resp.body[..]),
            (200, &b"ok"[..]),
            "{engine:?}"
        );
        let got = seen.recv().await.unwrap();
        let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
        assert!(
            text.contains("\r\n0\r\nx-t: 1\r\n\r\n"),
            "{engine:?}: {text:?}"
        );
        p.shutdown().await;
    }
}

/// A client cannot unname the request's `Host` through `Connection`: the
/// upstream sees the host the request was routed by.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_cannot_remove_the_host() {
    let bs = backends(1).await;
    let (up, mut seen) = recording_upstream().await;
    let yaml = two_clusters(&bs, up, "");
    let (p, addr) = proxy_on(&yaml, Http1Server::Meshless).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(
        b"POST /x HTTP/1.1\r\nHost: site.example\r\nConnection: host\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    )
    .await
    .unwrap();
    let resp = Reader::new().response(&mut s, false).await.unwrap();
    assert_eq!(resp.status, 200);
    let text = String::from_utf8_lossy(&seen.recv().await.unwrap()).to_ascii_lowercase();
    assert!(text.contains("\r\nhost: site.example\r\n"), "{text:?}");
    p.shutdown().await;
}

/// A client that stops reading its response holds the exchange (its
/// upstream connection, its endpoint's load) only until the request's
/// deadline (`timeouts.request`): the deadline is kept while the writer
/// waits on the client, not only while it waits on the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_at_the_request_deadline() {
    let bs = backends(1).await;
    let up = endless_upstream().await;
    let yaml = two_clusters(&bs, up, "").replace(
        "  - name: x\n    endpoints:",
        "  - name: x\n    timeouts: { request: 1s }\n    endpoints:",
    );
    assert!(yaml.contains("request: 1s"));
    let (p, addr) = proxy_on(&yaml, Http1Server::Meshless).await;
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut s = sock.connect(addr).await.unwrap();
    s.write_all(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    // Nothing is read: the proxy's writes fill the socket and stop.
    eventually("the exchange ends at its deadline", || async {
        let page = admin(&p, "/metrics").await.1;
        metric_sum(&page, "meshless_proxy_endpoint_in_flight{") == 0.0
            && metric(&page, CONNECTIONS) == Some(0.0)
    })
    .await;
    assert!(closed(&mut s).await, "the connection is closed");
    p.shutdown().await;
}

/// A client that takes no byte of what the proxy writes is closed at the
/// listener's `timeouts.send` and counted, whether its responses had
/// ended (pipelined small answers: no body is left whose deadline could
/// end the wait) or one is still streaming from an upstream whose
/// deadline is far off. The listener's send buffer is small so that the
/// sockets fill after a few answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_takes_no_byte_is_closed_at_the_send_timeout() {
    closed_at_the_send_timeout(Http1Server::Meshless).await;
}

/// The same on hyper's HTTP/1 server (`http1: hyper`): its writes are
/// bounded by `timeouts.send` too (`send_timed`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_takes_no_byte_is_closed_at_the_send_timeout_on_hyper() {
    closed_at_the_send_timeout(Http1Server::Hyper).await;
}

async fn closed_at_the_send_timeout(server: Http1Server) {
    const SEND_TIMEOUTS: &str = "meshless_proxy_downstream_send_timeouts_total{listener=\"web\"}";
    let bs = backends(1).await;
    let up = endless_upstream().await;
    let listener = "    timeouts: { send: 1s }\n    socket: { send_buffer_bytes: 4096 }\n";
    let yaml = two_clusters(&bs, up, listener).replace(
        "  - name: x\n    endpoints:",
        "  - name: x\n    timeouts: { request: 300s }\n    endpoints:",
    );
    assert!(yaml.contains("request: 300s"));
    let (p, addr) = proxy_on(&yaml, server).await;
    // 2,000 pipelined requests for the backend's short answer; then one
    // for the endless body.
    let pipelined = b"GET / HTTP/1.1\r\nHost: t\r\n\r\n".repeat(2000);
    for (n, requests) in [
        (1.0, pipelined),
        (2.0, b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n".to_vec()),
    ] {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.set_recv_buffer_size(4096).unwrap();
        let s = sock.connect(addr).await.unwrap();
        let (mut rd, mut wr) = s.into_split();
        // Written from a task: the proxy stops reading once it is stuck.
        let writer = tokio::spawn(async move {
            let _ = wr.write_all(&requests).await;
            wr
        });
        eventually("the stuck connection is closed and counted", || async {
            let page = admin(&p, "/metrics").await.1;
            metric(&page, SEND_TIMEOUTS) == Some(n)
                && metric(&page, CONNECTIONS) == Some(0.0)
                && metric_sum(&page, "meshless_proxy_endpoint_in_flight{") == 0.0
        })
        .await;
        // What was buffered is there to read, then the end.
        let mut buf = vec![0u8; 64 * 1024];
        let ended = tokio::time::timeout(DEADLINE, async {
            loop {
                match rd.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(ended.is_ok(), "the connection is closed");
        writer.abort();
    }
    p.shutdown().await;
}

/// Empty lines after a request body (old clients send a CRLF after it)
/// do not keep the read buffer of the idle connection that follows, and
/// the next request on it is still answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crlf_after_a_body_keeps_no_buffer_while_idle() {
    let bs = backends(1).await;
    let (p, addr) = h1_proxy(&bs).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi\r\n")
        .await
        .unwrap();
    let mut r = Reader::new();
    let resp = r.response(&mut s, false).await.unwrap();
    assert_eq!((resp.status, &resp.body[..]), (200, &b"hi"[..]));
    metric_is(&p, BUFFERS, 0.0).await;
    s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let resp = r.response(&mut s, false).await.unwrap();
    assert_eq!(resp.status, 200);
    p.shutdown().await;
}

/// Lingering close: a request refused while its client is still sending
/// (a refused head; a body never read, on a reply that closes) is
/// answered, the write side shut, and what the client goes on sending is
/// read and discarded until it closes. Closing with those bytes unread
/// would reset the connection: the client's next write fails, and a
/// response still queued on the proxy's side is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_lingers_for_what_the_client_still_sends() {
    let bs = backends(1).await;
    let (p, addr) = h1_proxy(&bs).await;
    let junk = vec![b'z'; 256 * 1024];
    let heads: [(&[u8], u16); 2] = [
        // Refused by the codec: NUL in a field.
        (
            b"POST / HTTP/1.1\r\nHost: t\r\nX-A: a\0b\r\nContent-Length: 9999999\r\n\r\n",
            400,
        ),
        // Refused by the screen (`connection: close`), its body unread.
        (
            b"TRACE / HTTP/1.1\r\nHost: t\r\nContent-Length: 9999999\r\n\r\n",
            405,
        ),
    ];
    for (head, status) in heads {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(head).await.unwrap();
        s.write_all(&junk).await.unwrap();
        let resp = Reader::new().response(&mut s, false).await.unwrap();
        assert_eq!(resp.status, status);
        assert_eq!(resp.header("connection"), Some("close"));
        assert!(!resp.body.is_empty(), "the reply names its cause");
        // The proxy shut its side after the response...
        let mut buf = [0u8; 64];
        let eof = tokio::time::timeout(DEADLINE, s.read(&mut buf))
            .await
            .unwrap();
        assert_eq!(eof.unwrap(), 0);
        // ...and still reads what comes: no reset.
        s.write_all(&junk)
            .await
            .expect("the proxy reads on, no reset");
        s.shutdown().await.expect("no reset");
        let end = tokio::time::timeout(DEADLINE, s.read(&mut buf))
            .await
            .unwrap();
        assert_eq!(end.expect("no reset"), 0);
    }
    assert_eq!(bs[0].requests(), 0);
    nothing_held_then_shutdown(p).await;
}

/// R7: an answer given with more of the declared body left than the
/// proxy ever discards to keep the connection (or a body the client was
/// never told to send, `100 Continue` owed) says `connection: close`, as
/// the connection closes after it (RFC 9112 9.6): the client does not send
/// its next request into a closing connection. Within the bound it stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_answer_that_will_close_says_so() {
    let bs = backends(1).await;
    let yaml = config(&bs, "").replace(
        "    routes:\n      - cluster: c\n",
        "    http1: meshless\n    routes:\n      - match: { path_prefix: /api }\n        cluster: c\n",
    );
    assert!(yaml.contains("http1: meshless"));
    let (p, addr) = proxy(&yaml).await;
    for (head, sent, close) in [
        ("Content-Length: 204800\r\n", 8 * 1024, true),
        ("Content-Length: 5\r\nExpect: 100-continue\r\n", 0, true),
        ("Content-Length: 61440\r\n", 8 * 1024, false),
    ] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let mut req = format!("POST /other HTTP/1.1\r\nHost: t\r\n{head}\r\n").into_bytes();
        req.extend(std::iter::repeat_n(b'z', sent));
        s.write_all(&req).await.unwrap();
        let resp = Reader::new().response(&mut s, false).await.unwrap();
        assert_eq!(resp.status, 404, "{head}");
        assert_eq!(
            resp.header("connection") == Some("close"),
            close,
            "{head}: {:?}",
            resp.headers
        );
        if close {
            assert!(closed(&mut s).await, "{head}");
        }
    }
    p.shutdown().await;
}

/// R6: a head the meshless codec refuses (414, 431, 400) writes its
/// access-log line too ("each request writes one JSON line"), method and
/// path `-`, counted a client error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_head_writes_an_access_log_line() {
    let bs = backends(1).await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let yaml = with_listener_field(
        &format!("access_log: \"{}\"\n{}", log.display(), config(&bs, "")),
        "http1: meshless",
    );
    let (p, addr) = proxy(&yaml).await;
    let long = format!("GET /{} HTTP/1.1\r\nHost: t\r\n\r\n", "u".repeat(9000));
    for (req, want) in [
        (long.as_bytes(), 414),
        (&b"GET / HTTP/1.1\r\nHost: t\r\nbad header\r\n\r\n"[..], 400),
    ] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(req).await.unwrap();
        let resp = Reader::new().response(&mut s, false).await.unwrap();
        assert_eq!(resp.status, want);
    }
    let lines = || access_log_lines(&log);
    eventually("two access-log lines", || async { lines().len() == 2 }).await;
    let got: Vec<(u64, String, String)> = lines()
        .iter()
        .map(|l| {
            (
                l["status"].as_u64().unwrap_or(0),
                l["path"].as_str().unwrap_or("").to_owned(),
                l["fault"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (414, "-".to_owned(), "client_error".to_owned()),
            (400, "-".to_owned(), "client_error".to_owned())
        ]
    );
    p.shutdown().await;
}

/// R2: an upstream that dies right after its response head and some of
/// the body: what the proxy already holds (the head, the bytes received)
/// reaches the client, a message cut short, never a connection closed
/// with no byte (which a client takes for a stale keep-alive connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_dying_after_its_head_still_gets_the_head_out() {
    static DYING: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 10000\r\n\r\n0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789";
    let up = raw_upstream(DYING).await;
    let yaml = with_listener_field(
        &config_with_endpoints(&format!("      - {{ address: \"{up}\" }}\n"), ""),
        "http1: meshless",
    );
    let (p, addr) = proxy(&yaml).await;
    for i in 0..30 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match tokio::time::timeout(DEADLINE, s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(n)) => all.extend_from_slice(&buf[..n]),
                Err(_) => panic!("the proxy closes the connection"),
            }
        }
        assert!(
            all.starts_with(b"HTTP/1.1 200"),
            "try {i}: {:?}",
            String::from_utf8_lossy(&all)
        );
    }
    p.shutdown().await;
}

/// A request pipelined while its predecessor's response is still being
/// written (its head and half its body out, the rest held upstream), then
/// the client's half-close: the first response is finished, the pipelined
/// one answered after it, then the connection closes. The end of stream
/// is not taken for a client gone (as when nothing follows it).
///
/// The held request is the connection's second: the first request of a
/// connection not yet registered with the reactor is watched for its
/// client only after `WATCH_AFTER` (h1serve), so on the first the
/// pipelined bytes and the end of stream could be read after the held
/// response ends, the end of stream then taken for the client leaving
/// while the pipelined request waits on its upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_close_during_a_response_still_answers_what_was_pipelined() {
    let bs = backends(1).await;
    let (up, release) = holding_upstream().await;
    let yaml = two_clusters(&bs, up, "");
    let (p, addr) = proxy_on(&yaml, Http1Server::Meshless).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /x/first HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let mut r = Reader::new();
    let first = r.response(&mut s, false).await.expect("the first request");
    assert_eq!((first.status, &first.body[..]), (200, &b"ok"[..]));
    let (mut s, mut r) = hold_half_way(s, r).await;
    s.write_all(b"GET /x/next HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    s.shutdown().await.unwrap();
    // The pipelined head is read (a read buffer lent beside the write
    // buffer) before the rest of the first response is released; the end
    // of stream, sent right behind it, is seen while that one is held.
    metric_is(&p, BUFFERS, 2.0).await;
    release.notify_one();
    let held = r.response(&mut s, false).await.expect("the held response");
    assert_eq!((held.status, &held.body[..]), (200, &b"helloworld"[..]));
    let next = r
        .response(&mut s, false)
        .await
        .expect("the pipelined request answered");
    assert_eq!((next.status, &next.body[..]), (200, &b"ok"[..]));
    assert!(closed(&mut s).await, "closed after the last answer");
    nothing_held_then_shutdown(p).await;
}

/// Both gauges, kept by the listener rather than looked up per
/// connection, count every connection and come back to 0 when they close,
/// on either HTTP/1 server: a listener on hyper's borrows a buffer too,
/// for the first read that tells the protocol, and gives it back.
#[tokio::test]
async fn the_buffer_and_connection_gauges_return_to_zero_on_either_server() {
    let bs = backends(1).await;
    let yaml = config(&bs, "").replace(
        "    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\n",
        "    address: \"127.0.0.1:0\"\n    http1: meshless\n    routes:\n      - cluster: c\n  \
         - name: old\n    address: \"127.0.0.1:0\"\n    http1: hyper\n    routes:\n      - cluster: c\n",
    );
    assert!(yaml.contains("http1: hyper"), "{yaml}");
    let (p, web) = proxy(&yaml).await;
    let old = p.listener_addr("old").await.expect("listener old");
    for addr in [web, old, web, old] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(DEADLINE, s.read_to_end(&mut answer))
            .await
            .expect("answered within the deadline")
            .unwrap();
        assert!(answer.starts_with(b"HTTP/1.1 200"), "{addr}");
    }
    let old_connections = "meshless_proxy_downstream_connections{listener=\"old\"}";
    eventually("both listeners' connection gauges back to 0", || async {
        let (_, page) = admin(&p, "/metrics").await;
        metric(&page, CONNECTIONS) == Some(0.0) && metric(&page, old_connections) == Some(0.0)
    })
    .await;
    let (_, page) = admin(&p, "/metrics").await;
    assert_eq!(
        metric(&page, BUFFERS),
        Some(0.0),
        "meshless listener's buffers"
    );
    let old_buffers = "meshless_proxy_http1_buffers_lent{listener=\"old\"}";
    assert_eq!(
        metric(&page, old_buffers),
        Some(0.0),
        "hyper listener's buffers (its connections' first reads)"
    );
    p.shutdown().await;
}

// ---------------------------------------------------------------------
// The first bytes of a plain-text connection tell its protocol: read into
// a pooled buffer (not peeked), kept for our HTTP/1 server, replayed to
// hyper's servers.
// ---------------------------------------------------------------------

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// One HTTP/2 frame: its type, flags and stream, and its payload.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut f = vec![len[1], len[2], len[3], kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// Reads frames until the response HEADERS of stream 1; its payload.
async fn h2_response_head(s: &mut TcpStream) -> Vec<u8> {
    loop {
        let mut head = [0u8; 9];
        tokio::time::timeout(DEADLINE, s.read_exact(&mut head))
            .await
            .expect("a frame within the deadline")
            .expect("a frame head");
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).await.expect("a frame payload");
        assert_ne!(head[3], 0x7, "GOAWAY: {payload:?}");
        if head[3] == 0x1 && stream == 1 {
            return payload;
        }
    }
}

/// An HTTP/2 client with prior knowledge whose preface arrives in three
/// pieces (each a beginning of the preface, the first reads undecided)
/// is served as HTTP/2 on either HTTP/1 server: the bytes read while
/// waiting are all replayed to hyper's HTTP/2 connection; so are the
/// frames that came in the same read as the preface.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_preface_in_pieces_is_served_as_http2() {
    let bs = backends(1).await;
    let yaml = config(&bs, "");
    for engine in ENGINES {
        let (p, addr) = proxy_on(&yaml, engine).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        for piece in [&PREFACE[..1], &PREFACE[1..16], &PREFACE[16..]] {
            s.write_all(piece).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // SETTINGS (empty), then GET / on stream 1 (END_STREAM,
        // END_HEADERS): `:method GET`, `:scheme http`, `:path /` from
        // the static table, `:authority: t` a literal.
        let mut out = h2_frame(0x4, 0, 0, &[]);
        out.extend(h2_frame(0x1, 0x5, 1, b"\x82\x86\x84\x41\x01t"));
        s.write_all(&out).await.unwrap();
        let head = h2_response_head(&mut s).await;
        assert_eq!(head.first(), Some(&0x88), "`:status: 200` ({engine:?})");
        // And all of it in one write: the first read holds the preface
        // and the frames after it.
        let mut all = TcpStream::connect(addr).await.unwrap();
        all.write_all(&[PREFACE, &out[..]].concat()).await.unwrap();
        let head = h2_response_head(&mut all).await;
        assert_eq!(head.first(), Some(&0x88), "`:status: 200` ({engine:?})");
        drop((s, all));
        nothing_held_then_shutdown(p).await;
    }
}

/// An HTTP/1 head whose first bytes are also a beginning of the preface
/// (`P`, then the rest of `PUT`) is HTTP/1 once a byte differs, and is
/// answered with the first byte kept, on either server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_head_that_starts_like_the_preface_is_served_whole() {
    let bs = backends(1).await;
    let yaml = config(&bs, "");
    for engine in ENGINES {
        let (p, addr) = proxy_on(&yaml, engine).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        s.write_all(b"P").await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        s.write_all(b"UT /x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi")
            .await
            .unwrap();
        let resp = Reader::new()
            .response(&mut s, false)
            .await
            .expect("a response");
        assert_eq!(resp.status, 200, "{engine:?}");
        assert_eq!(resp.header("x-backend"), Some("b0"), "{engine:?}");
        drop(s);
        nothing_held_then_shutdown(p).await;
    }
}

/// A client that sends a part of the preface and then closes, one that
/// sends a part and stalls (closed at `timeouts.request_headers`), and one
/// that connects and closes with nothing sent: none is answered, and no
/// connection or buffer is left counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_preface_that_closes_or_stalls_leaves_nothing_held() {
    let bs = backends(1).await;
    let yaml = with_listener_field(&config(&bs, ""), "timeouts: { request_headers: 1s }");
    for engine in ENGINES {
        let (p, addr) = proxy_on(&yaml, engine).await;
        // Closes after a part.
        let mut gone = TcpStream::connect(addr).await.unwrap();
        gone.write_all(&PREFACE[..16]).await.unwrap();
        // Stalls after a part: held open by the client, closed by the
        // proxy with nothing written.
        let mut stalled = TcpStream::connect(addr).await.unwrap();
        stalled.write_all(&PREFACE[..10]).await.unwrap();
        // Sends nothing.
        let silent = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        gone.shutdown().await.unwrap();
        drop(silent);
        let mut rest = Vec::new();
        tokio::time::timeout(DEADLINE, stalled.read_to_end(&mut rest))
            .await
            .expect("the stalled connection is closed by the proxy")
            .unwrap();
        assert!(rest.is_empty(), "{engine:?}: {rest:?}");
        assert!(closed(&mut gone).await, "{engine:?}");
        assert_eq!(bs[0].requests(), 0);
        nothing_held_then_shutdown(p).await;
    }
}

/// A batch of pipelined requests larger than a pooled buffer's 8 KiB, in
/// one write: the first read holds a part of it, and every request is
/// answered in order on either server (hyper's gets the first read
/// replayed, then the socket).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipelined_batch_larger_than_a_buffer_is_answered_whole() {
    let bs = backends(1).await;
    let yaml = config(&bs, "");
    for engine in ENGINES {
        let (p, addr) = proxy_on(&yaml, engine).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        let pad = "p".repeat(200);
        let batch: String = (0..60)
            .map(|i| format!("GET /{i} HTTP/1.1\r\nHost: t\r\nX-Pad: {pad}\r\n\r\n"))
            .collect();
        assert!(batch.len() > 12 * 1024, "{}", batch.len());
        s.write_all(batch.as_bytes()).await.unwrap();
        let mut r = Reader::new();
        for i in 0..60 {
            let resp = r.response(&mut s, false).await.expect("a response");
            assert_eq!(resp.status, 200, "{engine:?} request {i}");
        }
        drop(s);
        nothing_held_then_shutdown(p).await;
    }
}
