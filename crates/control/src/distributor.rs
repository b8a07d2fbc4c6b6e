//! The distribution stream: every delta is encoded once and the same bytes
//! go to every subscriber of its service. Subscribers read a shared
//! broadcast ring; one that falls more than the ring behind gets its
//! pending deltas coalesced into one reset per watched service, so server
//! memory per subscriber stays bounded and nobody else waits for it.

use std::collections::{BTreeSet, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use meshless_api::v1::{self, ClientMessage, ServerMessage, client_message, server_message};
use meshless_api::{Distribution, encode_delta, endpoint_to_wire};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::metrics::ControlMetrics;
use crate::registry::{Registry, ServiceDelta};

/// How often an idle stream carries a heartbeat.
pub const HEARTBEAT: Duration = Duration::from_secs(5);
/// Messages queued per subscriber before it counts as slow.
const QUEUE: usize = 64;

/// One published delta.
#[derive(Debug)]
pub struct EncodedDelta {
    pub version: u64,
    pub service: String,
    pub bytes: Bytes,
    pub committed: Instant,
}

/// Per service, per subscriber: (requests in flight, requests queued).
type LoadTable = std::collections::HashMap<String, std::collections::HashMap<u64, (u32, u32)>>;

/// Recent deltas, for resumption.
#[derive(Debug)]
struct History {
    deltas: VecDeque<Arc<EncodedDelta>>,
    /// Every delta at or below this version may be missing.
    dropped_up_to: u64,
}

/// Publishes deltas and serves subscribers.
#[derive(Debug)]
pub struct Distributor {
    registry: Arc<Mutex<Registry>>,
    metrics: Arc<ControlMetrics>,
    history: Mutex<History>,
    history_len: usize,
    tx: broadcast::Sender<Arc<EncodedDelta>>,
    /// Set on shutdown: every subscriber stream ends.
    closing: tokio::sync::watch::Sender<bool>,
    /// The last reset (snapshot) encoding per service and the version it
    /// reflects: subscribers connecting together share one encoding.
    resets: Mutex<std::collections::HashMap<String, (u64, Bytes)>>,
    /// Latest load report per service and subscriber: (in flight, queued).
    loads: Mutex<LoadTable>,
    /// Woken when a proxy asks to activate a service.
    activations: Mutex<std::collections::HashMap<String, Arc<tokio::sync::Notify>>>,
    next_subscriber: std::sync::atomic::AtomicU64,
}

impl Distributor {
    /// Ends every subscriber stream (on shutdown), so proxies reconnect.
    pub fn close(&self) {
        let _ = self.closing.send(true);
    }

    /// A distributor keeping the last `history_len` deltas for resumption;
    /// the broadcast ring holds as many.
    pub fn new(
        registry: Arc<Mutex<Registry>>,
        metrics: Arc<ControlMetrics>,
        history_len: usize,
    ) -> Self {
        let (tx, _) = broadcast::channel(history_len.max(16));
        // Deltas from before this process started are not in the history.
        let dropped_up_to = registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .version();
        Self {
            registry,
            metrics,
            history: Mutex::new(History {
                deltas: VecDeque::with_capacity(history_len),
                dropped_up_to,
            }),
            history_len: history_len.max(16),
            tx,
            closing: tokio::sync::watch::channel(false).0,
            resets: Mutex::new(std::collections::HashMap::new()),
            loads: Mutex::new(std::collections::HashMap::new()),
            activations: Mutex::new(std::collections::HashMap::new()),
            next_subscriber: std::sync::atomic::AtomicU64::new(1),
        }
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Requests in flight and queued for `service`, summed over proxies.
    pub fn load(&self, service: &str) -> (u64, u64) {
        let loads = self.loads.lock().unwrap_or_else(PoisonError::into_inner);
        loads.get(service).map_or((0, 0), |per| {
            per.values().fold((0, 0), |(f, q), (a, b)| {
                (f + u64::from(*a), q + u64::from(*b))
            })
        })
    }

    /// The signal a proxy's activation request for `service` wakes.
    pub fn activation(&self, service: &str) -> Arc<tokio::sync::Notify> {
        let mut a = self
            .activations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Arc::clone(a.entry(service.to_owned()).or_default())
    }

    fn record_load(&self, subscriber: u64, load: &v1::Load) {
        let mut loads = self.loads.lock().unwrap_or_else(PoisonError::into_inner);
        for s in &load.services {
            loads
                .entry(s.service.clone())
                .or_default()
                .insert(subscriber, (s.in_flight, s.queued));
        }
    }

    fn forget_subscriber(&self, subscriber: u64) {
        let mut loads = self.loads.lock().unwrap_or_else(PoisonError::into_inner);
        for per in loads.values_mut() {
            per.remove(&subscriber);
        }
    }

    /// Tells the proxies watching `service` that its instances cannot start.
    pub fn publish_activation_error(&self, service: &str, reason: &str) {
        // Held across `publish`, so the version is published in order.
        let mut registry = self.registry();
        let version = registry.next_version();
        let delta = ServiceDelta {
            service: service.to_owned(),
            version,
            upserted: Vec::new(),
            removed: Vec::new(),
            reset: false,
            activation_error: Some(reason.to_owned()),
        };
        self.publish(&delta, Instant::now());
        drop(registry);
    }

    /// Encodes `delta` once and hands it to every subscriber. Call with the
    /// registry lock held, in version order.
    pub fn publish(&self, delta: &ServiceDelta, committed: Instant) {
        let wire = v1::Delta {
            version: delta.version,
            service: delta.service.clone(),
            upserted: delta
                .upserted
                .iter()
                .map(|(e, s)| endpoint_to_wire(e, s))
                .collect(),
            removed: delta.removed.iter().map(|id| id.to_string()).collect(),
            reset: delta.reset,
            activation_error: delta.activation_error.clone().unwrap_or_default(),
        };
        let encoded = Arc::new(EncodedDelta {
            version: delta.version,
            service: delta.service.clone(),
            bytes: encode_delta(&wire),
            committed,
        });
        {
            let mut h = self.history.lock().unwrap_or_else(PoisonError::into_inner);
            if h.deltas.len() == self.history_len
                && let Some(old) = h.deltas.pop_front()
            {
                h.dropped_up_to = h.dropped_up_to.max(old.version);
            }
            h.deltas.push_back(Arc::clone(&encoded));
        }
        self.metrics.deltas.inc();
        let _ = self.tx.send(encoded);
    }

    /// Reset deltas with every endpoint of each service (empty if unknown),
    /// all read under one lock, and the registry version they reflect.
    fn resets<'a>(&self, services: impl IntoIterator<Item = &'a String>) -> (u64, Vec<Bytes>) {
        let reg = self.registry();
        let mut cache = self.resets.lock().unwrap_or_else(PoisonError::into_inner);
        let out = services
            .into_iter()
            .map(|service| {
                let current = reg.service_version(service);
                if let Some((v, bytes)) = cache.get(service)
                    && Some(*v) == current
                {
                    return bytes.clone();
                }
                let (version, endpoints) =
                    reg.snapshot(service).unwrap_or((reg.version(), Vec::new()));
                let bytes = encode_delta(&v1::Delta {
                    version,
                    service: service.clone(),
                    upserted: endpoints
                        .iter()
                        .map(|(e, s)| endpoint_to_wire(e, s))
                        .collect(),
                    removed: Vec::new(),
                    reset: true,
                    activation_error: String::new(),
                });
                if let Some(v) = current {
                    cache.insert(service.clone(), (v, bytes.clone()));
                }
                bytes
            })
            .collect();
        (reg.version(), out)
    }

    /// Deltas after `version` for `services`, if the history still holds
    /// every one of them.
    fn replay(&self, version: u64, services: &BTreeSet<String>) -> Option<Vec<Arc<EncodedDelta>>> {
        // Lock order is registry, then history (as `publish` takes them):
        // read the registry before taking the history lock.
        let registry_version = self.registry().version();
        let h = self.history.lock().unwrap_or_else(PoisonError::into_inner);
        if h.dropped_up_to > version || version > registry_version {
            return None;
        }
        Some(
            h.deltas
                .iter()
                .filter(|d| d.version > version && services.contains(&d.service))
                .cloned()
                .collect(),
        )
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
) -> Result<(), String> {
    out.send(Ok(msg))
        .await
        .map_err(|_| "subscriber went away".to_owned())?;
    d.metrics.messages_sent.inc();
    d.metrics.bytes_sent.inc_by(delta_bytes as u64);
    Ok(())
}

async fn send_resets(
    d: &Distributor,
    out: &mpsc::Sender<Result<ServerMessage, Status>>,
    services: impl IntoIterator<Item = &String>,
) -> Result<u64, String> {
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
) -> Result<(), String> {
    let mut closing = d.closing.subscribe();
    if *closing.borrow() {
        return Ok(());
    }
    let mut watched: BTreeSet<String> = hello.services.into_iter().collect();
    // Subscribe before reading state, so no delta falls between the two.
    let mut rx = d.tx.subscribe();
    let replay = (hello.resume_version > 0)
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
                })),
            };
            send(d, &out, done, 0).await?;
            v
        }
    };
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
                }
                Ok(Some(ClientMessage { msg: Some(client_message::Msg::Ack(_)) })) => {}
                Ok(Some(ClientMessage { msg: Some(client_message::Msg::Load(load)) })) => {
                    d.record_load(id, &load);
                }
                Ok(Some(ClientMessage { msg: Some(client_message::Msg::Activate(a)) })) => {
                    d.activation(&a.service).notify_one();
                }
                Ok(Some(_)) => {}
                Ok(None) => return Ok(()),
                Err(s) => return Err(s.to_string()),
            },
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
