//! A retried request body through real sockets: an idempotent PUT whose
//! body streams slowly, to an endpoint that answers 503 at once and
//! reads on. The proxy's connection to that endpoint goes on sending the
//! body while the retry (the last attempt, its copy sealed) streams it to
//! the other endpoint: the retry must get every byte, whichever of the
//! two reads the client's next chunk. (Which task reads it is up to
//! the scheduler: the hang fixed in `request/replay.rs`, the retry
//! missing a chunk the first attempt read, is shown deterministically by
//! that module's unit tests; this one checks the whole path.)

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::{Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An endpoint that answers every request 503 as soon as its head came,
/// then reads (and counts in `early`) whatever else the connection sends.
async fn early_503(early: Arc<AtomicUsize>) -> SocketAddr {
    tcp_server(move |mut s| {
        let early = Arc::clone(&early);
        async move {
            if read_head(&mut s).await.is_none() {
                return;
            }
            let mut buf = [0u8; 4096];
            let answer = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n";
            if s.write_all(answer).await.is_err() {
                return;
            }
            early.fetch_add(1, Ordering::SeqCst);
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    return;
                }
            }
        }
    })
    .await
}

/// An endpoint that answers 200 with the request's body; counts the
/// request heads it got in `heads`.
async fn echo(heads: Arc<AtomicUsize>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let heads = Arc::clone(&heads);
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                        heads.fetch_add(1, Ordering::SeqCst);
                        async move {
                            let body = req.into_body().collect().await.map(|b| b.to_bytes());
                            Ok::<_, Infallible>(Response::new(Full::new(body.unwrap_or_default())))
                        }
                    });
                let io = hyper_util::rt::TokioIo::new(s);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, service)
                    .await;
            });
        }
    });
    addr
}

type Chunks = tokio::sync::mpsc::Sender<Result<Frame<Bytes>, Infallible>>;

/// Sends a PUT whose body is what is sent on the returned channel; the
/// task gives back the response's status and body.
async fn streaming_put(addr: SocketAddr) -> (Chunks, tokio::task::JoinHandle<(StatusCode, Bytes)>) {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("handshake");
    tokio::spawn(conn);
    let req = Request::put(format!("http://{addr}/upload"))
        .body(body)
        .expect("request");
    let task = tokio::spawn(async move {
        let resp = send.send_request(req).await.expect("response");
        let status = resp.status();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, body)
    });
    (tx, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_gets_the_whole_body_while_the_first_attempt_reads_on() {
    let (early, heads) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let endpoints = format!(
        "      - {{ address: \"{}\" }}\n      - {{ address: \"{}\" }}\n",
        early_503(Arc::clone(&early)).await,
        echo(Arc::clone(&heads)).await
    );
    // The early endpoint answers one request per connection (it reads
    // the rest of the connection as the body): no connection is reused.
    let (p, addr) = proxy(&config_with_endpoints(
        &endpoints,
        "    balancer: { policy: round_robin }\n    retries: { count: 1, on: [5xx] }\n    connection_pool: { max_idle_per_endpoint: 0 }\n",
    ))
    .await;
    // Round robin: the first attempts alternate, so some go to the early
    // endpoint first and are retried.
    for round in 0..4 {
        let seen = || early.load(Ordering::SeqCst) + heads.load(Ordering::SeqCst);
        let before = seen();
        let (tx, task) = streaming_put(addr).await;
        let chunk = |i: usize| Bytes::from(vec![b'a' + (i % 26) as u8; 1000]);
        tx.send(Ok(Frame::data(chunk(0)))).await.expect("send");
        let mut whole = chunk(0).to_vec();
        // Until the first attempt reached an endpoint.
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while seen() == before && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for i in 1..20 {
            // Paced, so the two attempts take turns at the client's body.
            tokio::time::sleep(Duration::from_millis(2)).await;
            if tx.send(Ok(Frame::data(chunk(i)))).await.is_err() {
                break;
            }
            whole.extend_from_slice(&chunk(i));
        }
        drop(tx);
        let (status, body) = tokio::time::timeout(DEADLINE, task)
            .await
            .expect("the retry hangs")
            .expect("task");
        assert_eq!(status, StatusCode::OK, "round {round}");
        assert_eq!(body.len(), whole.len(), "round {round}");
        assert!(body == whole, "round {round}: the body differs");
    }
    assert!(early.load(Ordering::SeqCst) > 0, "no request was retried");
    p.shutdown().await;
}
