//! Malformed requests of the kinds proxies are tested with (request
//! smuggling, oversized heads, broken framing), over raw TCP. meshless
//! must reject them with a 4xx that names the cause, never a 502, and
//! forward nothing from a rejected head.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The status code of the first response to `raw`, or 0 if the
/// connection closed with none.
async fn status_of(addr: SocketAddr, raw: &[u8]) -> u16 {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(raw).await;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    let text = String::from_utf8_lossy(&got);
    text.strip_prefix("HTTP/1.1 ")
        .and_then(|t| t.get(..3))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// `(name, request, whether its head may reach an endpoint)`. Bodies that
/// break after a valid head reach the endpoint cut short, never re-framed.
/// `Transfer-Encoding` with `Content-Length` is framed by the encoding,
/// the length removed and the connection closed after it (RFC 9112 6.3,
/// what hyper does): the request after it on the wire is never read.
fn cases() -> Vec<(&'static str, Vec<u8>, bool)> {
    let big_header = format!(
        "GET / HTTP/1.1\r\nHost: t\r\nX-Big: {}\r\n\r\n",
        "a".repeat(200 * 1024)
    );
    let mut many = String::from("GET / HTTP/1.1\r\nHost: t\r\n");
    for i in 0..2000 {
        many.push_str(&format!("X-H{i}: 1\r\n"));
    }
    many.push_str("\r\n");
    let long_uri = format!(
        "GET /{} HTTP/1.1\r\nHost: t\r\n\r\n",
        "a".repeat(200 * 1024)
    );
    let v = |s: &str| s.as_bytes().to_vec();
    vec![
        (
            "CL and TE together",
            v(
                "POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: t\r\n\r\n",
            ),
            true,
        ),
        (
            "two Content-Lengths",
            v("POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\nabcde"),
            false,
        ),
        (
            "obfuscated TE value",
            v("POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n"),
            false,
        ),
        (
            "TE chunked not last",
            v(
                "POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
            ),
            false,
        ),
        (
            "space before colon",
            v("POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n"),
            false,
        ),
        (
            "NUL in a header",
            v("GET / HTTP/1.1\r\nHost: t\r\nX-A: a\0b\r\n\r\n"),
            false,
        ),
        (
            "obs-fold",
            v("GET / HTTP/1.1\r\nHost: t\r\nX-A: a\r\n b\r\n\r\n"),
            false,
        ),
        ("200 KB header", v(&big_header), false),
        ("2,000 headers", v(&many), false),
        ("200 KB URI", v(&long_uri), false),
        (
            "negative Content-Length",
            v("POST / HTTP/1.1\r\nHost: t\r\nContent-Length: -1\r\n\r\n"),
            false,
        ),
        (
            "bad chunk size",
            v(
                "POST /?delay_ms=100 HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nZZZ\r\n",
            ),
            true,
        ),
        (
            "chunk size overflow",
            v(
                "POST /?delay_ms=100 HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFFFFF\r\nx\r\n",
            ),
            true,
        ),
        ("HTTP/0.9", v("GET /\r\n\r\n"), false),
        (
            "two Hosts",
            v("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"),
            false,
        ),
        (
            "Host vs absolute URI",
            v("GET http://a.example/ HTTP/1.1\r\nHost: b.example\r\n\r\n"),
            false,
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_rejected_with_a_4xx() {
    let mut rejected = 0;
    let mut report = Vec::new();
    // One endpoint per case, counted once every case is done: a head that
    // may pass reaches its endpoint a little after the client has its
    // answer (the body breaks while the upstream exchange winds down), and
    // counted at once it would be charged to the next case.
    let mut reached_by = Vec::new();
    for (name, raw, head_may_pass) in cases() {
        let bs = backends(1).await;
        let (p, addr) = proxy(&config(&bs, "")).await;
        let status = status_of(addr, &raw).await;
        report.push(format!("{name}: {status}"));
        assert!(!(500..600).contains(&status), "{name}: {status}");
        if (400..500).contains(&status) {
            rejected += 1;
        }
        if !head_may_pass {
            // The endpoint is healthy and serving afterwards.
            assert_eq!(get(&client(), addr, "/", &[]).await.0, http::StatusCode::OK);
        }
        p.shutdown().await;
        reached_by.push((name, head_may_pass, bs));
    }
    for (name, head_may_pass, bs) in &reached_by {
        // At most the one request its head framed; never a smuggled
        // second (the health check above is the one more allowed).
        let reached = bs[0].requests() - u64::from(!head_may_pass);
        assert!(reached <= 1, "{name} reached the endpoint {reached} times");
        assert!(
            *head_may_pass || reached == 0,
            "{name} reached the endpoint"
        );
    }
    assert_eq!(report.len(), 16);
    assert!(
        rejected >= 14,
        "{rejected} of 16 rejected:\n{}",
        report.join("\n")
    );
    eprintln!("{}", report.join("\n"));
}

/// RFC 9110 15.6.6: a well-formed request line of another major version
/// (`HTTP/2.0`) is answered `505` by meshless's server; a malformed
/// version, and `HTTP/1.2` (major version 1 is supported; RFC 9112 2.3
/// asks to read it as 1.1, which httparse does not parse), `400`. hyper's
/// server answers `400` to all of them (not ours to change).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_versions_are_505_and_malformed_ones_400() {
    let bs = backends(1).await;
    let (p, addr) = proxy(&config(&bs, "")).await;
    let meshless = test_http1() == meshless_proxy::h1serve::Http1Server::Meshless;
    let major = if meshless { 505 } else { 400 };
    for (version, want) in [
        ("HTTP/2.0", major),
        ("HTTP/3.0", major),
        ("HTTP/1.2", 400),
        ("HTTP/2", 400),
        ("HTTP/1.1x", 400),
        ("http/1.1", 400),
    ] {
        let raw = format!("GET / {version}\r\nHost: t\r\n\r\n");
        assert_eq!(status_of(addr, raw.as_bytes()).await, want, "{version}");
    }
    if meshless {
        let series =
            "meshless_proxy_local_replies_total{listener=\"web\",reason=\"version_not_supported\"}";
        assert_eq!(proxy_metric(&p, series).await, 2.0);
    }
    assert_eq!(bs[0].requests(), 0);
    p.shutdown().await;
}
