//! The distribution stream's gRPC side: the server with its bearer-token
//! interceptor, and one task per subscriber that sends a snapshot (or a
//! replay from its resume version), then deltas from the shared broadcast
//! ring, heartbeats and the placements of the services at zero, and reads
//! its load reports and activations.

use std::collections::{BTreeMap, BTreeSet};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use meshless_api::v1::{self, ClientMessage, ServerMessage, client_message, server_message};
use meshless_api::{Distribution, DistributionServer};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::distributor::Distributor;
use crate::placement::Peer;
use crate::state::PlaneState;

/// How often an idle stream carries a heartbeat.
pub const HEARTBEAT: Duration = Duration::from_secs(5);
/// Messages queued per subscriber before it counts as slow.
const QUEUE: usize = 64;

/// Why a subscriber's stream ended early.
#[derive(Debug, thiserror::Error)]
enum StreamEnd {
    #[error("subscriber went away")]
    Gone,
    #[error("inbound stream: {0}")]
    Inbound(Status),
}

/// Serves the distribution stream on `listener` until `stop` changes.
pub async fn serve(listener: TcpListener, state: Arc<PlaneState>, mut stop: watch::Receiver<bool>) {
    let service = DistributionService {
        distributor: Arc::clone(&state.distributor),
    };
    let auth = state.auth.clone();
    let server = DistributionServer::with_interceptor(service, move |req: Request<()>| {
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
}

type OutStream = Pin<Box<dyn Stream<Item = Result<ServerMessage, Status>> + Send>>;

fn delta_msg(bytes: Bytes) -> ServerMessage {
    ServerMessage {
        msg: Some(server_message::Msg::Delta(bytes)),
    }
}

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
        let (out, rx) = mpsc::channel(QUEUE);
        let d = Arc::clone(&self.distributor);
        tokio::spawn(async move {
            d.metrics.subscribers.inc();
            let node = hello.node.clone();
            let id = d
                .next_subscriber
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if let Err(e) = serve_subscriber(&d, id, hello, inbound, out).await {
                tracing::debug!(node = %node, error = %e, "subscriber stream ended");
            }
            d.forget_subscriber(id);
            d.metrics.subscribers.dec();
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

async fn send(
    d: &Distributor,
    out: &mpsc::Sender<Result<ServerMessage, Status>>,
    msg: ServerMessage,
    delta_bytes: usize,
) -> Result<(), StreamEnd> {
    out.send(Ok(msg)).await.map_err(|_| StreamEnd::Gone)?;
    d.metrics.messages_sent.inc();
    d.metrics.bytes_sent.inc_by(delta_bytes as u64);
    Ok(())
}

async fn send_resets(
    d: &Distributor,
    out: &mpsc::Sender<Result<ServerMessage, Status>>,
    services: impl IntoIterator<Item = &String>,
) -> Result<u64, StreamEnd> {
    let (version, resets) = d.resets(services);
    for bytes in resets {
        let n = bytes.len();
        send(d, out, delta_msg(bytes), n).await?;
    }
    Ok(version)
}

async fn serve_subscriber(
    d: &Distributor,
    id: u64,
    hello: v1::Hello,
    mut inbound: Streaming<ClientMessage>,
    out: mpsc::Sender<Result<ServerMessage, Status>>,
) -> Result<(), StreamEnd> {
    let mut closing = d.closing.subscribe();
    if *closing.borrow() {
        return Ok(());
    }
    d.placements.join(id, &hello.node, &hello.peer_address);
    let mut watched: BTreeSet<String> = hello.services.into_iter().collect();
    // Subscribe before reading state, so no delta falls between the two.
    let mut rx = d.tx.subscribe();
    let same_incarnation = hello.resume_incarnation == d.incarnation;
    let replay = (hello.resume_version > 0 && same_incarnation)
        .then(|| d.replay(hello.resume_version, &watched))
        .flatten();
    let mut sent_up_to = match replay {
        Some(deltas) => {
            let mut v = hello.resume_version;
            for delta in deltas {
                v = v.max(delta.version);
                send(d, &out, delta_msg(delta.bytes.clone()), delta.bytes.len()).await?;
            }
            v
        }
        None => {
            d.metrics.snapshots.inc();
            let v = send_resets(d, &out, &watched).await?;
            let done = ServerMessage {
                msg: Some(server_message::Msg::SnapshotDone(v1::SnapshotDone {
                    version: v,
                    incarnation: d.incarnation,
                })),
            };
            send(d, &out, done, 0).await?;
            v
        }
    };
    let mut placed = PlacementsSent::new(d);
    placed.send_changes(d, &out, &watched).await?;
    let mut heartbeat = tokio::time::interval(HEARTBEAT);
    heartbeat.tick().await;
    loop {
        tokio::select! {
            got = rx.recv() => match got {
                Ok(delta) => {
                    // Older deltas are already in what was sent (snapshot or replay).
                    if delta.version <= sent_up_to || !watched.contains(&delta.service) {
                        continue;
                    }
                    let n = delta.bytes.len();
                    send(d, &out, delta_msg(delta.bytes.clone()), n).await?;
                    d.metrics.propagation.observe(delta.committed.elapsed().as_secs_f64());
                    sent_up_to = sent_up_to.max(delta.version);
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    // Too slow for the ring: one reset per service replaces what was missed.
                    d.metrics.coalesced.inc();
                    rx = d.tx.subscribe();
                    sent_up_to = sent_up_to.max(send_resets(d, &out, &watched).await?);
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            },
            msg = inbound.message() => match msg {
                Ok(Some(ClientMessage { msg: Some(client_message::Msg::Subscribe(s)) })) => {
                    let next: BTreeSet<String> = s.services.into_iter().collect();
                    let added: Vec<String> = next.difference(&watched).cloned().collect();
                    watched = next;
                    send_resets(d, &out, &added).await?;
                    placed.send_changes(d, &out, &watched).await?;
                }
                Ok(Some(ClientMessage { msg: Some(client_message::Msg::Ack(_)) })) => {}
                Ok(Some(ClientMessage { msg: Some(client_message::Msg::Load(load)) })) => {
                    d.record_load(id, &hello.node, &load);
                }
                Ok(Some(ClientMessage { msg: Some(client_message::Msg::Activate(a)) })) => {
                    // Node-local activation: the node that holds the request.
                    let node = if a.node.is_empty() { hello.node.clone() } else { a.node };
                    d.request_activation(&a.service, node);
                }
                Ok(Some(_)) => {}
                Ok(None) => return Ok(()),
                Err(s) => return Err(StreamEnd::Inbound(s)),
            },
            Ok(()) = placed.changed.changed() => {
                placed.send_changes(d, &out, &watched).await?;
            }
            _ = closing.changed() => return Ok(()),
            _ = heartbeat.tick() => {
                let hb = ServerMessage {
                    msg: Some(server_message::Msg::Heartbeat(v1::Heartbeat { version: sent_up_to })),
                };
                send(d, &out, hb, 0).await?;
            }
        }
    }
}

/// What one subscriber was last told of the placements of the services it
/// watches; it is sent what differs (an empty node: withdrawn).
struct PlacementsSent {
    changed: watch::Receiver<u64>,
    sent: BTreeMap<String, Peer>,
}

impl PlacementsSent {
    fn new(d: &Distributor) -> Self {
        Self {
            changed: d.placements.changed(),
            sent: BTreeMap::new(),
        }
    }

    async fn send_changes(
        &mut self,
        d: &Distributor,
        out: &mpsc::Sender<Result<ServerMessage, Status>>,
        watched: &BTreeSet<String>,
    ) -> Result<(), StreamEnd> {
        self.changed.mark_unchanged();
        let mut now = d.placements.current();
        now.retain(|s, _| watched.contains(s));
        let withdrawn: Vec<String> = self
            .sent
            .keys()
            .filter(|s| !now.contains_key(*s))
            .cloned()
            .collect();
        for service in withdrawn {
            self.sent.remove(&service);
            let gone = v1::Placement {
                service,
                ..Default::default()
            };
            send(d, out, placement_msg(gone), 0).await?;
        }
        for (service, peer) in now {
            if self.sent.get(&service) == Some(&peer) {
                continue;
            }
            let msg = v1::Placement {
                service: service.clone(),
                node: peer.node.clone(),
                address: peer.address.clone(),
            };
            self.sent.insert(service, peer);
            send(d, out, placement_msg(msg), 0).await?;
        }
        Ok(())
    }
}

fn placement_msg(p: v1::Placement) -> ServerMessage {
    ServerMessage {
        msg: Some(server_message::Msg::Placement(p)),
    }
}
