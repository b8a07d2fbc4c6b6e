//! `stream_interval` through a real stream (127.0.0.1, port 0): deltas
//! published while a subscriber's write is paced leave together, every
//! one of them in order, and the first after a quiet spell leaves at once.

use std::time::{Duration, Instant};

use meshless_api::v1::{self, ClientMessage, client_message, server_message};
use meshless_control::api::{EndpointInput, ServiceInput};
use meshless_control::client::ApiClient;
use meshless_control::config::ControlConfig;
use meshless_control::plane::ControlPlane;
use tokio_stream::wrappers::ReceiverStream;

const SVC: &str = "shop/cart";

fn ep(i: u32) -> EndpointInput {
    EndpointInput::new(format!("cart-{i}"), [10, 0, 0, i as u8].into(), 8080)
}

/// The next delta on `inbound` (skipping other messages), within 20 s.
async fn next_delta(inbound: &mut tonic::Streaming<v1::ServerMessage>) -> v1::Delta {
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(20), inbound.message())
            .await
            .expect("a message within 20 s")
            .expect("stream ok")
            .expect("stream open");
        if let Some(server_message::Msg::Delta(b)) = msg.msg {
            return meshless_api::decode_delta(&b).expect("decodes");
        }
    }
}

#[tokio::test]
async fn deltas_within_the_interval_leave_in_one_write() {
    let interval = Duration::from_secs(1);
    let text = "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\nstream_interval: 1s\n";
    let config = ControlConfig::parse(text, "test").expect("config");
    let plane = ControlPlane::start(config).await.expect("start");
    let c = ApiClient::new(plane.api_addr());
    c.put_service(SVC, &ServiceInput::default())
        .await
        .expect("service");
    let mut grpc =
        meshless_api::DistributionClient::connect(format!("http://{}", plane.grpc_addr()))
            .await
            .expect("connect");
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let hello = v1::Hello {
        node: "n".into(),
        services: vec![SVC.into()],
        ..v1::Hello::default()
    };
    tx.send(ClientMessage {
        msg: Some(client_message::Msg::Hello(hello)),
    })
    .await
    .expect("hello");
    let mut inbound = grpc
        .stream(ReceiverStream::new(rx))
        .await
        .expect("stream")
        .into_inner();
    assert!(next_delta(&mut inbound).await.reset, "the snapshot");
    let metrics = &plane.state.metrics;
    let writes_before = metrics.stream_writes.get();
    let n = 20;
    let start = Instant::now();
    for i in 0..n {
        c.put_endpoint(SVC, &ep(i)).await.expect("write");
    }
    let mut versions = Vec::new();
    for _ in 0..n {
        let d = next_delta(&mut inbound).await;
        assert_eq!(d.upserted.len(), 1, "each delta as published");
        versions.push(d.version);
    }
    let elapsed = start.elapsed();
    assert!(versions.windows(2).all(|w| w[0] < w[1]), "in order");
    // The first write leaves at once; then at most one write per interval
    // (plus the one in progress when the writes ended).
    let writes = metrics.stream_writes.get() - writes_before;
    let bound = 2 + (elapsed.as_secs_f64() / interval.as_secs_f64()).ceil() as u64;
    assert!(
        writes <= bound,
        "{writes} writes for {n} deltas in {elapsed:?}: at most {bound}"
    );
    plane.shutdown().await;
}
