//! gRPC through the proxy, with a tonic client and the backend's tonic
//! services (health and echo) on 127.0.0.1: unary and streaming calls,
//! per-RPC balancing on one channel, trailers, gRPC outcomes (outlier
//! ejection, retries), deadlines, local replies in gRPC form and gRPC
//! health checks.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use meshless_backend::grpc::echo::echo_client::EchoClient;
use meshless_backend::grpc::echo::{EchoReply, EchoRequest};
use tonic::Code;
use tonic::transport::Channel;

/// A cluster block speaking HTTP/2 to the endpoints, plus `extra`.
fn h2(extra: &str) -> String {
    format!("    upstream_protocol: http2\n{extra}")
}

/// One tonic channel (one HTTP/2 connection) to `addr`.
async fn channel(addr: SocketAddr) -> EchoClient<Channel> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connects");
    EchoClient::new(ch)
}

fn req(message: &str) -> EchoRequest {
    EchoRequest {
        message: message.into(),
        ..EchoRequest::default()
    }
}

/// The backend named in a response's metadata.
fn named<T>(resp: &tonic::Response<T>) -> String {
    resp.metadata()
        .get("x-backend")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned()
}

#[tokio::test]
async fn unary_and_streaming_calls_pass_through() {
    let b = backends(1).await;
    let (_p, addr) = proxy(&config(&b, &h2(""))).await;
    let mut c = channel(addr).await;

    let r = c.unary(req("hi")).await.expect("unary");
    assert_eq!(named(&r), "b0");
    assert_eq!(r.get_ref().message, "hi");

    let mut s = EchoRequest {
        count: 5,
        ..req("s")
    };
    s.delay_ms = 1;
    let mut stream = c
        .server_stream(s)
        .await
        .expect("server stream")
        .into_inner();
    let mut got = Vec::new();
    while let Some(m) = stream.message().await.expect("message") {
        got.push(m.message);
    }
    assert_eq!(got, ["s 0", "s 1", "s 2", "s 3", "s 4"]);

    let msgs = (0..4).map(|i| req(&format!("c{i}")));
    let r = c
        .client_stream(tokio_stream::iter(msgs))
        .await
        .expect("client stream");
    assert_eq!(
        (r.get_ref().received, r.get_ref().message.as_str()),
        (4, "c3")
    );

    // Bidi, interactively: each reply arrives before the next request is sent.
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let mut replies = c
        .bidi(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("bidi")
        .into_inner();
    for i in 0..3 {
        tx.send(req(&format!("m{i}"))).await.expect("send");
        let m: EchoReply = replies.message().await.expect("reply").expect("some");
        assert_eq!(m.message, format!("m{i}"));
    }
    drop(tx);
    assert!(replies.message().await.expect("end").is_none());
}

#[tokio::test]
async fn error_status_message_and_binary_details_reach_the_client() {
    let b = backends(1).await;
    let (_p, addr) = proxy(&config(&b, &h2(""))).await;
    let mut c = channel(addr).await;
    let err = c
        .unary(EchoRequest {
            fail_code: Code::NotFound as u32,
            ..req("x")
        })
        .await
        .expect_err("fails");
    assert_eq!(err.code(), Code::NotFound);
    assert_eq!(err.message(), "b0 fails as asked");
    assert_eq!(&err.details()[..], b"b0");
}

#[tokio::test]
async fn one_channels_calls_spread_over_every_endpoint() {
    let b = backends(3).await;
    let (_p, addr) = proxy(&config(&b, &h2(""))).await;
    let mut c = channel(addr).await;
    let mut counts = std::collections::HashMap::<String, u32>::new();
    for i in 0..300 {
        let r = c.unary(req(&i.to_string())).await.expect("unary");
        *counts.entry(r.get_ref().backend.clone()).or_default() += 1;
    }
    // Round robin: every prefix of the sequence is within 2 of the equal
    // share, so 300 calls give each of 3 endpoints 100 +- 2.
    assert_eq!(counts.len(), 3, "{counts:?}");
    for (name, n) in &counts {
        assert!((98..=102).contains(n), "{name}: {n} of 300: {counts:?}");
    }
}

/// The cluster's `active_requests` as `/clusters` shows it.
async fn active(p: &meshless_proxy::Proxy) -> u64 {
    let (_, body) = admin(p, "/clusters").await;
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    v[0]["active_requests"].as_u64().expect("active_requests")
}

#[tokio::test]
async fn a_stream_counts_until_its_trailers_and_outlives_the_request_timeout() {
    let b = backends(1).await;
    let extra = h2("    timeouts: { request: 1s }\n");
    let (p, addr) = proxy(&config(&b, &extra)).await;
    let mut c = channel(addr).await;
    // Three replies 600 ms apart: the stream lasts longer than the 1 s
    // request timeout meant for unary HTTP exchanges.
    let call = EchoRequest {
        count: 3,
        delay_ms: 600,
        ..req("long")
    };
    let mut stream = c.server_stream(call).await.expect("stream").into_inner();
    let first = stream.message().await.expect("first").expect("some");
    assert_eq!(first.message, "long 0");
    assert_eq!(active(&p).await, 1, "held while the stream is open");
    let mut n = 1;
    while stream.message().await.expect("message").is_some() {
        n += 1;
    }
    assert_eq!(n, 3);
    eventually("the stream's slot is given back", || async {
        active(&p).await == 0
    })
    .await;
}
