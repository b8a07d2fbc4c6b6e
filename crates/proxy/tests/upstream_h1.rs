//! Differential test of the upstream HTTP/1.1 clients: the same response
//! byte streams, valid and malformed, served by a raw TCP server to a
//! request through the proxy with `clusters[].http1: hyper` and with
//! `http1: meshless`, must give the client the same outcome: the status,
//! the body bytes (or a broken body), and whether the connection to the
//! upstream goes back to the pool or is closed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use meshless_proxy::{Proxy, ProxyConfig};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the raw server answers every request with.
#[derive(Debug, Clone)]
struct Script {
    bytes: Vec<u8>,
    /// The server closes the connection after writing them.
    close: bool,
}

/// A raw upstream: answers each request head with the script's bytes;
/// records, per connection, whether the proxy closed it.
struct Raw {
    addr: SocketAddr,
    closed: Arc<Mutex<Vec<Arc<AtomicBool>>>>,
}

impl Raw {
    async fn start(script: Script) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let closed: Arc<Mutex<Vec<Arc<AtomicBool>>>> = Arc::default();
        let seen = Arc::clone(&closed);
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let flag = Arc::new(AtomicBool::new(false));
                seen.lock().unwrap().push(Arc::clone(&flag));
                tokio::spawn(serve(s, script.clone(), flag));
            }
        });
        Self { addr, closed }
    }

    /// Whether the proxy closed the first connection.
    fn first_closed(&self) -> bool {
        let c = self.closed.lock().unwrap();
        c.first().is_some_and(|f| f.load(Ordering::SeqCst))
    }
}

async fn serve(mut s: TcpStream, script: Script, closed: Arc<AtomicBool>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        // One request head (the test's requests have no body).
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => {
                    closed.store(true, Ordering::SeqCst);
                    return;
                }
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        buf.drain(..end);
        if s.write_all(&script.bytes).await.is_err() {
            return;
        }
        if script.close {
            let _ = s.shutdown().await;
            return;
        }
    }
}

/// What the client saw, and what became of the upstream connection.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcome {
    status: u16,
    /// The body, or `None` when it broke (then `status` is 0).
    body: Option<Vec<u8>>,
    /// `Some(true)`: pooled; `Some(false)`: closed by the proxy; `None`:
    /// not compared (the server closes it itself).
    reused: Option<bool>,
}

fn yaml(upstream: SocketAddr, engine: &str) -> String {
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\nclusters:\n  - name: c\n    http1: {engine}\n    endpoints:\n      - {{ address: \"{upstream}\" }}\n    retries: {{ count: 0 }}\n    timeouts: {{ request: 10s }}\n"
    )
}

/// One request with `method` through a proxy whose cluster uses `engine`,
/// to a raw server answering with `script`.
async fn outcome(script: &Script, method: &str, engine: &str) -> Outcome {
    let raw = Raw::start(script.clone()).await;
    let cfg = ProxyConfig::parse(&yaml(raw.addr, engine), "t.yaml").expect("valid");
    let p = Proxy::start(cfg).await.expect("proxy");
    let addr = p.listener_addr("web").await.expect("listener");
    let req = Request::builder()
        .method(method)
        .uri(format!("http://{addr}/"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    // A broken body is one outcome, whether the downstream connection
    // was cut before or after the head went out (that depends on when
    // the break is seen, not on the framing): status 0.
    let (status, body) = match common::client().request(req).await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            match resp.into_body().collect().await {
                Ok(b) => (status, Some(b.to_bytes().to_vec())),
                Err(_) => (0, None),
            }
        }
        Err(_) => (0, None),
    };
    let reused = if script.close {
        None
    } else {
        Some(settle(&p, &raw).await)
    };
    p.shutdown().await;
    Outcome {
        status,
        body,
        reused,
    }
}

/// Waits until the upstream connection is either idle in the pool or
/// closed by the proxy (one of the two always follows the response).
async fn settle(p: &Proxy, raw: &Raw) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let idle = p
            .state()
            .snapshot
            .load()
            .clusters
            .get("c")
            .map_or(0, |c| c.counters.idle_connections.load(Ordering::SeqCst));
        if idle > 0 && !raw.first_closed() {
            return true;
        }
        if raw.first_closed() {
            return false;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the connection neither pooled nor closed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn same(script: Script, method: &str) -> Outcome {
    let hyper = outcome(&script, method, "hyper").await;
    let own = outcome(&script, method, "meshless").await;
    assert_eq!(
        own,
        hyper,
        "{:?} to {method}",
        String::from_utf8_lossy(&script.bytes)
    );
    own
}

fn keep(bytes: &str) -> Script {
    Script {
        bytes: bytes.as_bytes().to_vec(),
        close: false,
    }
}

fn closing(bytes: &str) -> Script {
    Script {
        bytes: bytes.as_bytes().to_vec(),
        close: true,
    }
}

#[tokio::test]
async fn valid_framings_give_the_same_answer_and_reuse() {
    let ok = |body: &str| Some(body.as_bytes().to_vec());
    let o = same(
        keep("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"),
        "GET",
    )
    .await;
    assert_eq!((o.status, o.body, o.reused), (200, ok("hello"), Some(true)));
    let chunked = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n006;x=y\r\n world\r\n0\r\n\r\n";
    let o = same(keep(chunked), "GET").await;
    assert_eq!(
        (o.status, o.body, o.reused),
        (200, ok("hello world"), Some(true))
    );
    let trailers =
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\nx-sum: 1\r\n\r\n";
    assert_eq!(same(keep(trailers), "GET").await.body, ok("hi"));
    let two = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\nhi";
    assert_eq!(same(keep(two), "GET").await.reused, Some(true));
    let interim = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok";
    let o = same(keep(interim), "GET").await;
    assert_eq!((o.status, o.reused), (201, Some(true)));
    let head = "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n";
    let o = same(keep(head), "HEAD").await;
    assert_eq!((o.status, o.body, o.reused), (200, ok(""), Some(true)));
    let not_modified = "HTTP/1.1 304 Not Modified\r\ncontent-length: 5\r\n\r\n";
    assert_eq!(same(keep(not_modified), "GET").await.reused, Some(true));
    let close = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nhi";
    let o = same(keep(close), "GET").await;
    assert_eq!((o.body, o.reused), (ok("hi"), Some(false)));
    let old = "HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nhi";
    assert_eq!(same(keep(old), "GET").await.reused, Some(false));
    let eof = "HTTP/1.1 200 OK\r\n\r\nto the end";
    assert_eq!(same(closing(eof), "GET").await.body, ok("to the end"));
}

#[tokio::test]
async fn malformed_responses_give_the_same_answer() {
    for bad in [
        "HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello",
        "HTTP/1.1 200 OK\r\ncontent-length: 5, 6\r\n\r\nhello",
        "HTTP/1.1 200 OK\r\ncontent-length: abc\r\n\r\nhello",
        "HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\nhello",
        "HTTP/1.1 200 OK\r\nx-a: a\r\n b\r\ncontent-length: 0\r\n\r\n",
        "HTTP/1.1 2000 OK\r\ncontent-length: 0\r\n\r\n",
        "HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
        "HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        "garbage\r\n\r\n",
    ] {
        let o = same(keep(bad), "GET").await;
        assert_eq!((o.status, o.reused), (502, Some(false)), "{bad}");
    }
    // Framing errors inside the body: the body breaks (here before the
    // head is written downstream: the client sees the connection cut).
    for bad in [
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
    ] {
        let o = same(keep(bad), "GET").await;
        assert_eq!((o.body, o.reused), (None, Some(false)), "{bad}");
    }
    // Cut short by the upstream's close.
    for cut in [
        "HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello",
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
        "HTTP/1.1 200 OK\r\ncontent-le",
        "",
    ] {
        same(closing(cut), "GET").await;
    }
    // Both framings: chunked wins upstream (and the whole body is read).
    let both = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n1\r\nh\r\n1\r\ni\r\n0\r\n\r\n";
    let o = same(keep(both), "GET").await;
    assert_eq!((o.body, o.reused), (Some(b"hi".to_vec()), Some(true)));
    // A body after a 204: never read as one.
    let extra = "HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\nhello";
    let o = same(keep(extra), "GET").await;
    assert_eq!((o.status, o.reused), (204, Some(false)));
}

/// A generated response: status, framing, body, and how it may break.
fn generated() -> impl Strategy<Value = (Script, &'static str)> {
    let status = prop::sample::select(vec![200u16, 201, 404, 500, 204, 304]);
    let body = prop::collection::vec(any::<u8>(), 0..300);
    let cuts = prop::collection::vec(1usize..64, 0..4);
    (status, 0u8..8, body, cuts, any::<bool>(), any::<bool>()).prop_map(
        |(status, framing, body, cuts, interim, head)| {
            let mut out = Vec::new();
            if interim {
                out.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
            }
            out.extend_from_slice(format!("HTTP/1.1 {status} X\r\n").as_bytes());
            let mut close = false;
            let mut chunked_body = Vec::new();
            let mut rest = &body[..];
            for c in &cuts {
                let n = (*c).min(rest.len());
                chunked_body.extend_from_slice(format!("{n:x}\r\n").as_bytes());
                chunked_body.extend_from_slice(&rest[..n]);
                chunked_body.extend_from_slice(b"\r\n");
                rest = &rest[n..];
                if rest.is_empty() {
                    break;
                }
            }
            if !rest.is_empty() {
                chunked_body.extend_from_slice(format!("{:x}\r\n", rest.len()).as_bytes());
                chunked_body.extend_from_slice(rest);
                chunked_body.extend_from_slice(b"\r\n");
            }
            match framing {
                0 => out.extend_from_slice(
                    format!("content-length: {}\r\n\r\n", body.len()).as_bytes(),
                ),
                1 | 2 => {
                    if framing == 2 {
                        // Ignored for the framing; the same as the data's
                        // length, else the proxy's downstream side cuts
                        // the body when the lengths differ, at a point
                        // that depends on timing (reuse then too).
                        let n = body.len();
                        out.extend_from_slice(format!("content-length: {n}\r\n").as_bytes());
                    }
                    out.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n");
                }
                3 => out.extend_from_slice(
                    format!("content-length: {}\r\n\r\n", body.len() + 3).as_bytes(),
                ),
                4 => out.extend_from_slice(b"content-length: 1\r\ncontent-length: 2\r\n\r\n"),
                5 => out.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n"),
                _ => out.extend_from_slice(b"\r\n"),
            }
            match framing {
                1 | 2 => {
                    out.extend_from_slice(&chunked_body);
                    out.extend_from_slice(b"0\r\n\r\n");
                }
                // Cut: the server closes before the end.
                3 => {
                    out.extend_from_slice(&body);
                    close = true;
                }
                // A chunk size that is not hex.
                5 => out.extend_from_slice(b"xyz\r\n"),
                6 => {
                    out.extend_from_slice(&chunked_body);
                    close = true;
                }
                7 => {
                    out.extend_from_slice(&body);
                    close = true;
                }
                _ => out.extend_from_slice(&body),
            }
            let method = if head { "HEAD" } else { "GET" };
            (Script { bytes: out, close }, method)
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Any generated response: the same status, body and reuse on both.
    #[test]
    fn generated_responses_give_the_same_answer((script, method) in generated()) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async { same(script, method).await });
    }
}

/// Reads from `s` into `seen` until it holds `want`.
async fn read_until(s: &mut TcpStream, seen: &mut Vec<u8>, want: &[u8]) {
    let mut chunk = [0u8; 4096];
    let wait = async {
        while !seen.windows(want.len()).any(|w| w == want) {
            let n = s.read(&mut chunk).await.expect("read");
            assert!(n > 0, "closed before {:?}", String::from_utf8_lossy(want));
            seen.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(20), wait)
        .await
        .expect("in time");
}

/// An upstream that answers at once and echoes the request body as it
/// comes: each request chunk comes back before the client sends the next,
/// so the request is written on while its response is read.
#[tokio::test]
async fn a_request_body_streams_while_its_response_streams_back() {
    for engine in ["hyper", "meshless"] {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            read_until(&mut s, &mut buf, b"\r\n\r\n").await;
            let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
            let head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
            s.write_all(head).await.unwrap();
            // The request body is chunked: echoed as it is, it is a valid
            // chunked response body that ends where the request does.
            let mut rest = buf.split_off(end);
            let mut chunk = [0u8; 4096];
            loop {
                s.write_all(&rest).await.unwrap();
                if rest.ends_with(b"0\r\n\r\n") {
                    break;
                }
                let n = s.read(&mut chunk).await.unwrap();
                if n == 0 {
                    break;
                }
                rest = chunk[..n].to_vec();
            }
        });
        let cfg = ProxyConfig::parse(&yaml(up, engine), "t.yaml").expect("valid");
        let p = Proxy::start(cfg).await.expect("proxy");
        let addr = p.listener_addr("web").await.expect("listener");
        let mut c = TcpStream::connect(addr).await.unwrap();
        let head = "POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n";
        c.write_all(head.as_bytes()).await.unwrap();
        let mut seen = Vec::new();
        for i in 0..3 {
            let ping = format!("ping{i}");
            c.write_all(format!("5\r\n{ping}\r\n").as_bytes())
                .await
                .unwrap();
            read_until(&mut c, &mut seen, ping.as_bytes()).await;
        }
        c.write_all(b"0\r\n\r\n").await.unwrap();
        read_until(&mut c, &mut seen, b"0\r\n\r\n").await;
        assert!(seen.starts_with(b"HTTP/1.1 200 OK\r\n"), "{engine}");
        p.shutdown().await;
    }
}

/// A `101` to a request that did not ask to upgrade is an invalid answer
/// (RFC 9110 15.2.2: a server must not switch to a protocol the request
/// did not name): the client gets 502 on meshless's connection, not a
/// `101` followed by no tunnel.
#[tokio::test]
async fn an_unasked_switch_of_protocols_is_a_bad_gateway() {
    let script = closing(
        "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
    );
    let o = outcome(&script, "GET", "meshless").await;
    assert_eq!(o.status, 502, "{o:?}");
}

/// An early answer (a 413 before the upload ends) reaches an HTTP/2
/// client that is still uploading, and the rest of its upload is read
/// (and discarded) instead of its stream being reset as soon as the
/// answer is sent (curl before 8.x then reports a stream error, not the
/// answer).
#[tokio::test]
async fn an_early_answer_lets_an_http2_upload_finish() {
    use http_body::Frame;
    use http_body_util::StreamBody;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    const CHUNK: usize = 16 * 1024;
    const CHUNKS: usize = 192; // 3 MiB: more than the stream's window
    let raw = Raw::start(keep(
        "HTTP/1.1 413 Payload Too Large\r\ncontent-length: 4\r\n\r\nbig!",
    ))
    .await;
    let cfg = ProxyConfig::parse(&yaml(raw.addr, "meshless"), "t.yaml").expect("valid");
    let p = Proxy::start(cfg).await.expect("proxy");
    let addr = p.listener_addr("web").await.expect("listener");
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::convert::Infallible>>(1);
    let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let req = Request::post(format!("http://{addr}/"))
        .header("content-length", (CHUNK * CHUNKS).to_string())
        .body(body)
        .unwrap();
    let chunk = Bytes::from(vec![b'x'; CHUNK]);
    tx.send(Ok(Frame::data(chunk.clone()))).await.unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(20), client.request(req))
        .await
        .expect("answered")
        .expect("response");
    assert_eq!(resp.status(), 413);
    let got = resp.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(&got[..], b"big!");
    for i in 1..CHUNKS {
        tokio::time::timeout(
            Duration::from_secs(20),
            tx.send(Ok(Frame::data(chunk.clone()))),
        )
        .await
        .expect("the proxy keeps reading")
        .unwrap_or_else(|_| panic!("the upload was cut off after {i} of {CHUNKS} chunks"));
    }
    drop(tx);
    p.shutdown().await;
}

/// review10 U8: an HTTP/2 `GET` whose content comes in DATA frames with
/// no `content-length` reaches the HTTP/1.1 upstream chunked, on either
/// client (hyper's client would send it without a body); a `GET` with no
/// content still goes with no framing field at all.
#[tokio::test]
async fn an_http2_get_with_content_and_no_length_keeps_its_content() {
    use http_body::Frame;
    use http_body_util::StreamBody;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    let backend = common::backend("echo").await;
    for engine in ["meshless", "hyper"] {
        let cfg = ProxyConfig::parse(&yaml(backend.local_addr(), engine), "t.yaml").expect("valid");
        let p = Proxy::start(cfg).await.expect("proxy");
        let addr = p.listener_addr("web").await.expect("listener");
        let client = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http();
        // A streamed body: its length is not known, so none is declared.
        let streamed = |parts: &[&'static str]| {
            let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = parts
                .iter()
                .map(|s| Ok(Frame::data(Bytes::from_static(s.as_bytes()))))
                .collect();
            StreamBody::new(tokio_stream::iter(frames))
        };
        for (parts, want) in [(&["hel", "lo"][..], &b"hello"[..]), (&[][..], &b""[..])] {
            let req = Request::get(format!("http://{addr}/echo"))
                .body(streamed(parts))
                .unwrap();
            let resp = client.request(req).await.expect("response");
            assert_eq!(resp.status(), 200, "{engine}");
            let got = resp.into_body().collect().await.expect("body").to_bytes();
            assert_eq!(&got[..], want, "{engine}: the GET's content");
        }
        p.shutdown().await;
    }
}
