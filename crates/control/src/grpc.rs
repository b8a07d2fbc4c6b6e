//! The distribution stream's gRPC side: the server with its bearer-token
//! interceptor; each subscriber's stream (`subscriber.rs`: its snapshot,
//! deltas, heartbeats and the placements of services at zero) runs inside
//! its response stream (`outbox.rs`), not as a task of its own.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use meshless_api::v1::{ClientMessage, ServerMessage, client_message};
use meshless_api::{Distribution, DistributionServer};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::distributor::Distributor;
use crate::outbox::{Follower, Outbox};
use crate::state::PlaneState;

pub use crate::subscriber::HEARTBEAT;
/// Batches of `stream_batch` messages (16 by default) queued per
/// subscriber before its future waits for the stream: 64 messages.
const QUEUE: usize = 4;

/// Serves the distribution stream on `listener` until `stop` changes.
pub async fn serve(listener: TcpListener, state: Arc<PlaneState>, mut stop: watch::Receiver<bool>) {
    let service = DistributionService {
        distributor: Arc::clone(&state.distributor),
        batch: state.config.stream_batch,
        interval: state.config.stream_interval,
    };
    let auth = state.auth.clone();
    let server = DistributionServer::new(service)
        .max_decoding_message_size(meshless_api::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(meshless_api::MAX_MESSAGE_BYTES);
    let server =
        tonic::service::interceptor::InterceptedService::new(server, move |req: Request<()>| {
            let got = req
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok());
            if auth.allows(got) {
                Ok(req)
            } else {
                Err(Status::unauthenticated(crate::state::UNAUTHENTICATED))
            }
        });
    // Deltas are small writes that must leave at once: no Nagle delay
    // behind an unacknowledged segment (tonic sets TCP_NODELAY only on
    // sockets it accepts itself).
    let incoming = tokio_stream::StreamExt::map(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        |s| {
            s.inspect(|s| {
                let _ = s.set_nodelay(true);
            })
        },
    );
    let result = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .add_service(server)
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = stop.changed().await;
        })
        .await;
    if let Err(e) = result {
        tracing::error!(error = %e, "distribution server failed");
    }
}

/// The tonic service over a shared distributor.
#[derive(Debug, Clone)]
pub struct DistributionService {
    pub distributor: Arc<Distributor>,
    /// Messages per stream write at most (`stream_batch`).
    pub batch: usize,
    /// Pacing of each subscriber's writes (`stream_interval`).
    pub interval: Duration,
}

type OutStream = Pin<Box<dyn Stream<Item = Result<ServerMessage, Status>> + Send>>;

#[tonic::async_trait]
impl Distribution for DistributionService {
    type StreamStream = OutStream;

    async fn stream(
        &self,
        request: Request<Streaming<ClientMessage>>,
    ) -> Result<Response<OutStream>, Status> {
        let mut inbound = request.into_inner();
        let hello = match tokio::time::timeout(Duration::from_secs(10), inbound.message()).await {
            Ok(Ok(Some(ClientMessage {
                msg: Some(client_message::Msg::Hello(h)),
            }))) => h,
            Ok(Ok(_)) => return Err(Status::invalid_argument("the first message must be Hello")),
            Ok(Err(s)) => return Err(s),
            Err(_) => return Err(Status::deadline_exceeded("no Hello within 10 s")),
        };
        let out = Outbox::new(QUEUE * self.batch);
        let d = Arc::clone(&self.distributor);
        let (batch, interval) = (self.batch, self.interval);
        let id = d
            .next_subscriber
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let writer = out.clone();
        // Runs inside the response stream: dropped (with its guards) when
        // the subscriber goes away.
        let follow = async move {
            let _joined = Joined::new(&d, id);
            let node = hello.node.clone();
            if let Err(e) =
                crate::subscriber::serve(&d, id, hello, inbound, writer, batch, interval).await
            {
                tracing::debug!(node = %node, error = %e, "subscriber stream ended");
            }
        };
        Ok(Response::new(Box::pin(Follower::new(out, follow))))
    }
}

/// A connected subscriber: counted in `subscribers` and forgotten (loads,
/// placements) when dropped, however its stream ends.
struct Joined<'a> {
    d: &'a Distributor,
    id: u64,
}

impl<'a> Joined<'a> {
    fn new(d: &'a Distributor, id: u64) -> Self {
        d.metrics.subscribers.inc();
        Self { d, id }
    }
}

impl Drop for Joined<'_> {
    fn drop(&mut self) {
        self.d.forget_subscriber(self.id);
        self.d.metrics.subscribers.dec();
    }
}
