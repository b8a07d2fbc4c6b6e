//! gRPC through the proxy, with a tonic client and the backend's tonic
//! services (health and echo) on 127.0.0.1: unary and streaming calls,
//! per-RPC balancing on one channel, trailers, gRPC outcomes (outlier
//! ejection, retries), deadlines, local replies in gRPC form and gRPC
//! health checks.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;

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
async fn a_large_client_stream_passes_under_flow_control() {
    let b = backends(1).await;
    let (_p, addr) = proxy(&config(&b, &h2(""))).await;
    let mut c = channel(addr).await;
    // 2 MiB, far past HTTP/2's initial 64 KiB windows on both hops.
    let chunk = "x".repeat(32 * 1024);
    let msgs = (0..64).map(move |_| req(&chunk));
    let r = c
        .client_stream(tokio_stream::iter(msgs))
        .await
        .expect("client stream");
    assert_eq!(r.get_ref().received, 64);
    assert_eq!(r.get_ref().message.len(), 32 * 1024);
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
    assert_eq!(err.details(), b"b0");
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

/// The cluster's `active_requests` and its first endpoint's `in_flight`
/// (the load balancers read), as `/clusters` shows them.
async fn active(p: &meshless_proxy::Proxy) -> (u64, u64) {
    let (_, body) = admin(p, "/clusters").await;
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    let slot = v[0]["active_requests"].as_u64().expect("active_requests");
    let load = v[0]["endpoints"][0]["in_flight"]
        .as_u64()
        .expect("in_flight");
    (slot, load)
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
    assert_eq!(active(&p).await, (1, 1), "held while the stream is open");
    let mut n = 1;
    while stream.message().await.expect("message").is_some() {
        n += 1;
    }
    assert_eq!(n, 3);
    eventually("the stream's slot is given back", || async {
        active(&p).await == (0, 0)
    })
    .await;
}

/// A free port nothing listens on.
async fn dead_address() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    l.local_addr().expect("addr")
}

#[tokio::test]
async fn local_replies_carry_the_grpc_status() {
    let b = backends(1).await;
    let dead = dead_address().await;
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - {{ match: {{ path_prefix: /meshless.echo.v1.Echo/Unary }}, cluster: empty }}\n      - {{ match: {{ path_prefix: /meshless.echo.v1.Echo/ClientStream }}, cluster: dead }}\n      - {{ match: {{ path_prefix: /meshless.echo.v1.Echo/ServerStream }}, cluster: one }}\nclusters:\n  - name: empty\n    endpoints: []\n  - name: dead\n    upstream_protocol: http2\n    endpoints: [{{ address: \"{dead}\" }}]\n    retries: {{ count: 0 }}\n  - name: one\n    upstream_protocol: http2\n    endpoints: [{{ address: \"{}\" }}]\n    circuit_breakers: {{ max_requests: 1 }}\n",
        b[0].local_addr()
    );
    let (_p, addr) = proxy(&yaml).await;
    let mut c = channel(addr).await;

    let err = c.unary(req("x")).await.expect_err("no endpoint");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(err.message(), "no healthy upstream");

    let err = c
        .client_stream(tokio_stream::iter([req("x")]))
        .await
        .expect_err("connect fails");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");

    let err = c
        .bidi(tokio_stream::iter([req("x")]))
        .await
        .expect_err("no route");
    assert_eq!(err.code(), Code::Unimplemented, "{err:?}");

    // One stream holds the cluster's only request slot: the next call is shed.
    let long = EchoRequest {
        count: 10_000,
        delay_ms: 50,
        ..req("hold")
    };
    let mut held = c.server_stream(long).await.expect("stream").into_inner();
    held.message().await.expect("first").expect("some");
    let err = c.server_stream(req("x")).await.expect_err("overflow");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
}

/// One raw gRPC call over HTTP/2 (tonic's client would enforce
/// `grpc-timeout` itself): the `grpc-status` from the response's trailers,
/// or its headers for a trailers-only answer.
async fn raw_call(
    addr: SocketAddr,
    method: &str,
    msg: &EchoRequest,
    timeout: Option<&str>,
) -> String {
    use http_body_util::BodyExt;
    use prost::Message;
    let encoded = msg.encode_to_vec();
    let mut framed = vec![0u8];
    framed.extend_from_slice(&u32::try_from(encoded.len()).expect("len").to_be_bytes());
    framed.extend_from_slice(&encoded);
    let mut b = http::Request::post(format!("http://{addr}/meshless.echo.v1.Echo/{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(t) = timeout {
        b = b.header("grpc-timeout", t);
    }
    let req = b
        .body(http_body_util::Full::new(bytes::Bytes::from(framed)))
        .expect("request");
    let resp = h2_client().request(req).await.expect("response");
    assert_eq!(resp.status(), http::StatusCode::OK);
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.expect("body");
    let status = body
        .trailers()
        .and_then(|t| t.get("grpc-status"))
        .or(headers.get("grpc-status"));
    status
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none")
        .to_owned()
}

#[tokio::test]
async fn grpc_timeout_is_the_deadline_and_grpc_max_caps_it() {
    let b = backends(1).await;
    let (_p, addr) = proxy(&config(&b, &h2(""))).await;
    let slow = EchoRequest {
        delay_ms: 60_000,
        ..req("slow")
    };
    // No response headers before the deadline: a local DEADLINE_EXCEEDED.
    assert_eq!(raw_call(addr, "Unary", &slow, Some("300m")).await, "4");
    // Cut mid-stream: DEADLINE_EXCEEDED in trailers, not a reset.
    let long = EchoRequest {
        count: 10_000,
        delay_ms: 20,
        ..req("s")
    };
    assert_eq!(
        raw_call(addr, "ServerStream", &long, Some("500m")).await,
        "4"
    );
    // A malformed `grpc-timeout` is ignored; a quick call is not cut.
    assert_eq!(raw_call(addr, "Unary", &req("q"), Some("soon")).await, "0");

    // `timeouts.grpc_max` caps `grpc-timeout`, and is the deadline without one.
    let (_p2, addr2) = proxy(&config(&b, &h2("    timeouts: { grpc_max: 300ms }\n"))).await;
    assert_eq!(raw_call(addr2, "Unary", &slow, Some("1H")).await, "4");
    assert_eq!(raw_call(addr2, "Unary", &slow, None).await, "4");
}

/// Whether `/clusters` shows the endpoint at `addr` with `field` = `value`.
async fn endpoint_flag(p: &meshless_proxy::Proxy, addr: SocketAddr, field: &str) -> bool {
    let (_, body) = admin(p, "/clusters").await;
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    v[0]["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .find(|e| e["address"] == addr.to_string())
        .and_then(|e| e[field].as_bool())
        .expect("endpoint")
}

#[tokio::test]
async fn an_endpoint_answering_unavailable_is_ejected() {
    let b = backends(3).await;
    b[0].set_failing(true);
    let extra = h2(
        "    outlier_detection: { consecutive_gateway_errors: 3, consecutive_5xx: 0, max_ejection_percent: 50 }\n",
    );
    let (p, addr) = proxy(&config(&b, &extra)).await;
    let mut c = channel(addr).await;
    let failing = b[0].local_addr();
    eventually("the endpoint answering UNAVAILABLE is ejected", || {
        let mut c = c.clone();
        let p = &p;
        async move {
            let _ = c.unary(req("x")).await;
            endpoint_flag(p, failing, "ejected").await
        }
    })
    .await;
    for i in 0..30 {
        let r = c.unary(req(&i.to_string())).await.expect("others answer");
        assert_ne!(r.get_ref().backend, "b0");
    }
}

/// A cluster of `b` with outlier detection off and `retries`.
fn with_retries(b: &[meshless_backend::Backend], retries: &str) -> String {
    let extra = format!(
        "    retries: {retries}\n    outlier_detection: {{ consecutive_5xx: 0, consecutive_gateway_errors: 0 }}\n"
    );
    config(b, &h2(&extra))
}

#[tokio::test]
async fn retries_on_unavailable_hide_a_failing_endpoint_when_allowed() {
    let b = backends(3).await;
    b[1].set_failing(true);
    let retried = "{ count: 2, on: [unavailable], all_methods: true }";
    let (_p, addr) = proxy(&with_retries(&b, retried)).await;
    let mut c = channel(addr).await;
    for i in 0..30 {
        let r = c.unary(req(&i.to_string())).await.expect("retried");
        assert_eq!(r.get_ref().message, i.to_string(), "the body is replayed");
    }
    assert!(b[1].requests() > 0, "the failing endpoint was tried");

    // gRPC calls are POSTs: without `all_methods` they are not retried.
    let (_p2, addr2) = proxy(&with_retries(&b, "{ count: 2, on: [unavailable] }")).await;
    let mut c2 = channel(addr2).await;
    let mut failed = 0;
    for i in 0..30 {
        if let Err(e) = c2.unary(req(&i.to_string())).await {
            assert_eq!(e.code(), Code::Unavailable);
            failed += 1;
        }
    }
    assert!(
        failed > 0,
        "round robin sends some calls to the failing endpoint"
    );
}

#[tokio::test]
async fn retries_hide_a_killed_endpoint() {
    let mut b = backends(3).await;
    let retried = "{ count: 2, on: [connect_failure, reset, unavailable], all_methods: true }";
    let (_p, addr) = proxy(&with_retries(&b, retried)).await;
    let mut c = channel(addr).await;
    // Every endpoint has a pooled connection, then one dies.
    for i in 0..6 {
        c.unary(req(&i.to_string())).await.expect("warm");
    }
    b.remove(2).stop().await;
    for i in 0..30 {
        let r = c.unary(req(&i.to_string())).await.expect("retried");
        assert_ne!(r.get_ref().backend, "b2");
    }
}

#[tokio::test]
async fn grpc_health_checks_mark_endpoints_down_and_up() {
    let b = backends(2).await;
    let extra = h2(
        "    health_check: { grpc: { service: meshless.echo.v1.Echo }, interval: 100ms, healthy_threshold: 1, unhealthy_threshold: 1 }\n",
    );
    let (p, _addr) = proxy(&config(&b, &extra)).await;
    let a = b[0].local_addr();
    b[0].set_failing(true);
    eventually("NOT_SERVING marks it down", || async {
        !endpoint_flag(&p, a, "healthy").await
    })
    .await;
    assert!(endpoint_flag(&p, b[1].local_addr(), "healthy").await);
    b[0].set_failing(false);
    eventually("SERVING marks it up", || endpoint_flag(&p, a, "healthy")).await;

    // A service the server does not know (NOT_FOUND) fails the check.
    let extra = h2(
        "    health_check: { grpc: { service: no.such.Service }, interval: 100ms, healthy_threshold: 1, unhealthy_threshold: 1 }\n",
    );
    let (p2, _) = proxy(&config(&b, &extra)).await;
    eventually("an unknown service is down", || async {
        !endpoint_flag(&p2, b[1].local_addr(), "healthy").await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_grpc_call_is_released_to_the_new_instance() {
    use meshless_control::config::ControlConfig;
    use meshless_control::plane::ControlPlane;
    // The "instance" the scaler starts is a TCP relay (on its $PORT) to a
    // gRPC backend of the test: it listens only once started.
    let b = backends(1).await;
    let target = b[0].local_addr();
    let relay = format!(
        "import os, socket, threading\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('127.0.0.1', int(os.environ['PORT'])))\ns.listen(128)\ndef pipe(a, b):\n    try:\n        while True:\n            d = a.recv(65536)\n            if not d: break\n            b.sendall(d)\n    except OSError: pass\n    for x in (a, b):\n        try: x.shutdown(socket.SHUT_RDWR)\n        except OSError: pass\nwhile True:\n    c, _ = s.accept()\n    u = socket.create_connection(('{}', {}))\n    for a, b in ((c, u), (u, c)): threading.Thread(target=pipe, args=(a, b), daemon=True).start()\n",
        target.ip(),
        target.port()
    );
    let yaml = format!(
        "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\nservices:\n  - namespace: demo\n    name: lazy\n    autoscaling:\n      min_instances: 0\n      max_instances: 1\n      target_concurrency: 10\n      tick: 100ms\n      scaler:\n        process:\n          command: [python3, -c, {relay:?}]\n          start_timeout: 20s\n          stop_grace: 1s\n"
    );
    let plane = ControlPlane::start(ControlConfig::parse(&yaml, "control.yaml").expect("config"))
        .await
        .expect("plane");
    let (api, grpc) = (plane.api_addr(), plane.grpc_addr());
    let proxy_yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ncontrol: {{ address: \"{grpc}\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: lazy }}]\nclusters:\n  - name: lazy\n    service: demo/lazy\n    upstream_protocol: http2\n    activation: {{ queue_timeout: 20s }}\n"
    );
    let (p, addr) = proxy(&proxy_yaml).await;
    subscribed(api, 1).await;
    // At zero: the call is held while the instance starts, then answered.
    let mut c = channel(addr).await;
    let r = c
        .unary(req("cold"))
        .await
        .expect("answered after the start");
    assert_eq!(
        (r.get_ref().message.as_str(), named(&r).as_str()),
        ("cold", "b0")
    );
    assert!(proxy_metric(&p, "meshless_proxy_activations_total{result=\"sent\"}").await >= 1.0);
    p.shutdown().await;
    plane.shutdown().await;
}

/// The access log's `grpc_status` field: the upstream's status from its
/// trailers (OK, and NOT_FOUND), and the proxy's own in a local reply
/// (UNAVAILABLE: no endpoint); a plain HTTP request has none.
#[tokio::test]
async fn the_access_log_records_each_calls_grpc_status() {
    let b = backends(1).await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let yaml = format!(
        "access_log: \"{}\"\nadmin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - {{ match: {{ path_prefix: /meshless.echo.v1.Echo/ClientStream }}, cluster: empty }}\n      - {{ cluster: one }}\nclusters:\n  - name: empty\n    endpoints: []\n  - name: one\n    upstream_protocol: http2\n    endpoints: [{{ address: \"{}\" }}]\n",
        log.display(),
        b[0].local_addr()
    );
    let (_p, addr) = proxy(&yaml).await;
    let mut c = channel(addr).await;
    c.unary(req("x")).await.expect("ok");
    let err = c
        .unary(EchoRequest {
            fail_code: Code::NotFound as u32,
            ..req("x")
        })
        .await
        .expect_err("fails");
    assert_eq!(err.code(), Code::NotFound);
    let err = c
        .client_stream(tokio_stream::iter([req("x")]))
        .await
        .expect_err("no endpoint");
    assert_eq!(err.code(), Code::Unavailable);
    let (status, _, _) = get(&client(), addr, "/plain", &[]).await;
    assert_eq!(status, 200);
    // A stream cut mid-way by its deadline: DEADLINE_EXCEEDED.
    let long = EchoRequest {
        count: 10_000,
        delay_ms: 20,
        ..req("s")
    };
    assert_eq!(
        raw_call(addr, "ServerStream", &long, Some("300m")).await,
        "4"
    );
    let lines = || common::access_log_lines(&log);
    eventually("five access-log lines", || async { lines().len() == 5 }).await;
    let got: Vec<(String, serde_json::Value)> = lines()
        .iter()
        .map(|l| {
            (
                l["path"].as_str().unwrap_or("").to_owned(),
                l["grpc_status"].clone(),
            )
        })
        .collect();
    let want = [
        ("/meshless.echo.v1.Echo/Unary", serde_json::json!(0)),
        ("/meshless.echo.v1.Echo/Unary", serde_json::json!(5)),
        ("/meshless.echo.v1.Echo/ClientStream", serde_json::json!(14)),
        ("/plain", serde_json::Value::Null),
        ("/meshless.echo.v1.Echo/ServerStream", serde_json::json!(4)),
    ];
    for (i, (path, code)) in want.iter().enumerate() {
        assert_eq!((got[i].0.as_str(), &got[i].1), (*path, code), "{got:?}");
    }
}

/// A gRPC-Web answer (HTTP/1.1): one message and the trailer frame (flag
/// 0x80) holding `grpc-status:0`, the protocol's only place for the status.
static GRPC_WEB_OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc-web+proto\r\ncontent-length: 27\r\nconnection: close\r\n\r\n\x00\x00\x00\x00\x02hi\x80\x00\x00\x00\x0fgrpc-status:0\r\n";

/// R8: gRPC-Web (`application/grpc-web*`) is not native gRPC: its status is
/// in the body, never in HTTP trailers. An OK call is logged and counted
/// by its HTTP status (200, no `grpc_status`), ejects nobody, and
/// `timeouts.request` applies to it as to any HTTP request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_web_is_plain_http_for_outcomes_and_timeouts() {
    let ups = [
        raw_upstream(GRPC_WEB_OK).await,
        raw_upstream(GRPC_WEB_OK).await,
    ];
    let hang = Gated::start("hang").await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let yaml = format!(
        "access_log: \"{}\"\nadmin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - {{ match: {{ path_prefix: /hang }}, cluster: hang }}\n      - {{ cluster: web }}\nclusters:\n  - name: web\n    endpoints: [{{ address: \"{}\" }}, {{ address: \"{}\" }}]\n    outlier_detection: {{ consecutive_5xx: 2, max_ejection_percent: 100 }}\n  - name: hang\n    endpoints: [{{ address: \"{}\" }}]\n    timeouts: {{ request: 1s }}\n",
        log.display(),
        ups[0],
        ups[1],
        hang.local_addr()
    );
    let (p, addr) = proxy(&yaml).await;
    let c = client();
    let call = |path: &str, ct: &'static str| {
        http::Request::post(format!("http://{addr}{path}"))
            .header("content-type", ct)
            .body(http_body_util::Full::new(bytes::Bytes::from_static(
                b"\x00\x00\x00\x00\x02hi",
            )))
            .unwrap()
    };
    let types = [
        "application/grpc-web",
        "application/grpc-web+proto",
        "application/grpc-web-text",
    ];
    for i in 0..6 {
        let resp = c
            .request(call("/pkg.Svc/Call", types[i % 3]))
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
    }
    for e in cluster_endpoints(&p, "web").await {
        assert_eq!(
            e["times_ejected"], 0,
            "a healthy endpoint is not ejected: {e}"
        );
    }
    // No grpc-timeout: the cluster's request timeout answers, not never.
    let resp = tokio::time::timeout(DEADLINE, c.request(call("/hang", types[1])))
        .await
        .expect("timeouts.request applies to gRPC-Web")
        .unwrap();
    assert_eq!(resp.status(), 504);
    let lines = || common::access_log_lines(&log);
    eventually("seven access-log lines", || async { lines().len() == 7 }).await;
    for l in &lines()[..6] {
        assert_eq!(l["status"], 200, "{l}");
        assert!(l["grpc_status"].is_null(), "{l}");
    }
    let page = admin(&p, "/metrics").await.1;
    let not_2xx: Vec<&str> = page
        .lines()
        .filter(|l| {
            l.starts_with("meshless_proxy_requests_total{") && l.contains("cluster=\"web\"")
        })
        .filter(|l| !l.contains("class=\"2xx\"") && !l.ends_with(" 0"))
        .collect();
    assert!(not_2xx.is_empty(), "{not_2xx:?}");
}
