//! One subscriber's stream task: a snapshot (or a replay from its resume
//! version), then deltas from the shared log (`delta_log.rs`) and heartbeats,
//! while it reads the subscriber's load reports, activations and changes
//! of what it watches.
//!
//! A watched service is followed whole (the shared encoding of every
//! delta) or, when the subscriber asked for a subset of it, through a
//! [`SubsetLease`]: a reset of its members, then only the deltas of its
//! subset key. Each service has a floor: deltas at or below it are already
//! in what the subscriber was sent (its snapshot, replay or reset).
//!
//! Placements: the task also sends the ahead-of-time placement of every
//! watched service at zero (`placement.rs`), and what changes of them.
//!
//! Batched writes: messages are gathered in `pending`; when the task wakes
//! for a delta it also takes every delta already queued in the log (up
//! to `stream_batch` messages) and hands them to the stream as one batch,
//! which tonic encodes into one buffer: one HTTP/2 DATA frame and one
//! write for many messages, and one wake of the connection's task.
//!
//! No task of its own: `serve` is driven by the subscriber's response
//! stream (`outbox.rs`), so a delta wakes only the task writing the stream.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use meshless_api::v1::{self, ClientMessage, ServerMessage, client_message, server_message};
use meshless_api::{EncodedPair, Encoding};
use tokio_stream::StreamExt;
use tonic::{Status, Streaming};

use crate::delta_log::{LogReader, TryRecvError};
use crate::distributor::{Distributor, EncodedDelta, SubsetLease};
use crate::gate;
use crate::placement::Peer;

/// How often an idle stream carries a heartbeat.
pub const HEARTBEAT: Duration = Duration::from_secs(5);

/// Why a subscriber's stream ended early.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StreamEnd {
    #[error("subscriber went away")]
    Gone,
    #[error("inbound stream: {0}")]
    Inbound(Status),
}

/// A subscriber's cursor in the published deltas.
type Deltas = LogReader<std::sync::Arc<EncodedDelta>>;

/// Where a subscriber's batches go: its response stream (`outbox.rs`).
pub(crate) type Out = crate::outbox::Outbox;

fn delta_msg(bytes: bytes::Bytes) -> ServerMessage {
    ServerMessage {
        msg: Some(server_message::Msg::Delta(bytes)),
    }
}

/// How one service is followed as a subset: its size, the zone it
/// prefers (a zone-aware request from a subscriber that named its zone),
/// and the index the subscriber held before (given back when free).
type SubsetAsk = (u32, Option<String>, Option<u64>);

/// The services a `Hello` or `Subscribe` asks for: every watched service,
/// and how those asked as subsets are followed (size 0: whole). `zone` is
/// the `Hello`'s.
fn requested(
    services: Vec<String>,
    subsets: Vec<v1::SubsetRequest>,
    zone: &str,
) -> (BTreeSet<String>, BTreeMap<String, SubsetAsk>) {
    let mut watched: BTreeSet<String> = services.into_iter().collect();
    let mut sizes = BTreeMap::new();
    for s in subsets {
        watched.insert(s.service.clone());
        if s.size > 0 {
            let zone = (s.zone_aware && !zone.is_empty()).then(|| zone.to_owned());
            sizes.insert(s.service, (s.size, zone, s.index));
        }
    }
    (watched, sizes)
}

/// What one stream follows and has been sent.
struct Follow<'a> {
    d: &'a Distributor,
    out: Out,
    /// Who holds subset indices: the `Hello`'s subscriber, else its node,
    /// else this stream.
    identity: String,
    /// The `Hello`'s zone (zone-aware subsets prefer it).
    zone: String,
    watched: BTreeSet<String>,
    /// Per service followed whole: its floor.
    floors: BTreeMap<String, u64>,
    /// Per service followed as a subset.
    leases: BTreeMap<String, SubsetLease<'a>>,
    /// The highest version sent (heartbeats carry it).
    sent_up_to: u64,
    /// Messages gathered for the next write.
    pending: Vec<ServerMessage>,
    /// Delta bytes of `pending` (counted in the metrics when written).
    pending_bytes: u64,
    /// Messages per write at most (`stream_batch`).
    batch: usize,
    /// The encoding this subscriber reads (`Hello.compact`).
    encoding: Encoding,
}

impl<'a> Follow<'a> {
    /// Queues `msg` for the next write; writes when the batch is full.
    async fn send(&mut self, msg: ServerMessage, delta_bytes: usize) -> Result<(), StreamEnd> {
        self.pending.push(msg);
        self.pending_bytes += delta_bytes as u64;
        if self.pending.len() >= self.batch {
            self.flush().await?;
        }
        Ok(())
    }

    /// Writes what is gathered, as one batch; counts it in the metrics
    /// (once per batch: the counters are shared by every subscriber).
    async fn flush(&mut self) -> Result<(), StreamEnd> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let (messages, bytes) = (
            self.pending.len() as u64,
            std::mem::take(&mut self.pending_bytes),
        );
        self.out
            .send(&mut self.pending)
            .await
            .map_err(|_| StreamEnd::Gone)?;
        let m = &self.d.metrics;
        m.messages_sent.inc_by(messages);
        m.bytes_sent.inc_by(bytes);
        m.stream_writes.inc();
        Ok(())
    }

    /// After a delta: takes the deltas already queued in the log too
    /// (up to a batch), then writes them all at once.
    async fn drain(&mut self, rx: &mut Deltas) -> Result<(), StreamEnd> {
        // Bounded, so a log full of other services' deltas cannot keep
        // this task from its other duties.
        for _ in 0..self.batch * 4 {
            if self.pending.len() >= self.batch {
                break;
            }
            match rx.try_recv() {
                Ok(delta) if self.watched.contains(&delta.service) => self.on_delta(&delta).await?,
                Ok(_) => {}
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Lagged(_)) => {
                    self.catch_up().await?;
                    break;
                }
            }
        }
        self.flush().await
    }

    /// Queues the delta in this stream's encoding.
    async fn send_delta(&mut self, pair: &EncodedPair) -> Result<(), StreamEnd> {
        let bytes = pair.get(self.encoding).clone();
        let n = bytes.len();
        self.send(delta_msg(bytes), n).await
    }

    /// Whole resets of `services`; their floors move to the version read.
    async fn send_resets(&mut self, services: &[String]) -> Result<u64, StreamEnd> {
        let (version, resets) = self.d.resets(services);
        for s in services {
            self.floors.insert(s.clone(), version);
        }
        for bytes in &resets {
            self.send_delta(bytes).await?;
        }
        Ok(version)
    }

    /// Starts following `service` as the subset `ask`: its reset.
    async fn lease(&mut self, service: &str, ask: SubsetAsk) -> Result<(), StreamEnd> {
        self.floors.remove(service);
        let (size, zone, wanted) = ask;
        let (lease, bytes) =
            self.d
                .lease_subset(service, size, zone.as_deref(), &self.identity, wanted);
        self.leases.insert(service.to_owned(), lease);
        self.send_delta(&bytes).await
    }

    /// Services followed whole.
    fn whole(&self) -> Vec<String> {
        self.watched
            .iter()
            .filter(|s| !self.leases.contains_key(*s))
            .cloned()
            .collect()
    }

    /// Hands a published delta to the subscriber if it concerns it.
    async fn on_delta(&mut self, delta: &EncodedDelta) -> Result<(), StreamEnd> {
        let bytes = if let Some(lease) = self.leases.get_mut(&delta.service) {
            if delta.version <= lease.floor {
                return Ok(());
            }
            match &delta.subsets {
                None => Some(delta.bytes.clone()),
                Some(slot) => {
                    let kept = slot
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .as_ref()
                        .map(|per_key| per_key.get(&lease.key).cloned());
                    // Payloads gone (the delta is SUBSET_WINDOW old): the
                    // subset's current members instead; the floor moves.
                    kept.unwrap_or_else(|| {
                        self.d.metrics.coalesced.inc();
                        Some(lease.reset())
                    })
                }
            }
        } else {
            match self.floors.get(&delta.service) {
                Some(&floor) if delta.version > floor => Some(delta.bytes.clone()),
                _ => return Ok(()),
            }
        };
        if let Some(bytes) = bytes {
            self.send_delta(&bytes).await?;
            let age = delta.committed.elapsed().as_secs_f64();
            self.d.metrics.propagation.observe(age);
        }
        self.sent_up_to = self.sent_up_to.max(delta.version);
        Ok(())
    }

    /// Too slow for the log: one reset per service replaces what it missed
    /// (the reader's cursor is already past it).
    async fn catch_up(&mut self) -> Result<(), StreamEnd> {
        self.d.metrics.coalesced.inc();
        let whole = self.whole();
        let v = self.send_resets(&whole).await?;
        self.sent_up_to = self.sent_up_to.max(v);
        let resets: Vec<EncodedPair> = self.leases.values_mut().map(|l| l.reset()).collect();
        for bytes in &resets {
            self.send_delta(bytes).await?;
        }
        Ok(())
    }

    /// A `Subscribe`: follows what it asks from now on; services newly
    /// followed (or followed another way) get a reset.
    async fn resubscribe(&mut self, s: v1::Subscribe) -> Result<(), StreamEnd> {
        let (watched, sizes) = requested(s.services, s.subsets, &self.zone);
        let mut fresh: Vec<String> = Vec::new();
        let changed: Vec<String> = self
            .leases
            .iter()
            .filter(|(service, l)| {
                sizes
                    .get(*service)
                    .map(|(size, zone, _)| (*size, zone.as_deref()))
                    != Some((l.key.size, l.key.zone.as_deref()))
            })
            .map(|(service, _)| service.clone())
            .collect();
        for service in changed {
            self.leases.remove(&service);
            if watched.contains(&service) && !sizes.contains_key(&service) {
                fresh.push(service);
            }
        }
        for service in &watched {
            let new = !self.watched.contains(service);
            if new && !sizes.contains_key(service) {
                fresh.push(service.clone());
            }
        }
        self.floors.retain(|s, _| watched.contains(s));
        self.watched = watched;
        for (service, ask) in sizes {
            if !self.leases.contains_key(&service) {
                self.lease(&service, ask).await?;
            }
        }
        self.send_resets(&fresh).await?;
        Ok(())
    }

    /// The snapshot (or a replay of whole services from the resume
    /// version) and every subset's reset; returns the version it covers.
    async fn start(
        &mut self,
        hello: &v1::Hello,
        sizes: BTreeMap<String, SubsetAsk>,
    ) -> Result<(), StreamEnd> {
        for (service, ask) in sizes {
            self.lease(&service, ask).await?;
        }
        let whole = self.whole();
        let same_incarnation = hello.resume_incarnation == self.d.incarnation;
        let replay = (hello.resume_version > 0 && same_incarnation)
            .then(|| {
                self.d
                    .replay(hello.resume_version, &whole.iter().cloned().collect())
            })
            .flatten();
        let v = match replay {
            Some(deltas) => {
                let mut v = hello.resume_version;
                for delta in deltas {
                    v = v.max(delta.version);
                    self.send_delta(&delta.bytes).await?;
                }
                v
            }
            None => {
                self.d.metrics.snapshots.inc();
                let v = self.send_resets(&whole).await?;
                let done = v1::SnapshotDone {
                    version: v,
                    incarnation: self.d.incarnation,
                };
                let msg = server_message::Msg::SnapshotDone(done);
                self.send(ServerMessage { msg: Some(msg) }, 0).await?;
                v
            }
        };
        for s in whole {
            self.floors.insert(s, v);
        }
        self.sent_up_to = v;
        self.flush().await
    }
}

/// Serves one subscriber until it leaves or the plane closes. Subset
/// leases are released when this returns or is dropped.
pub(crate) async fn serve(
    d: &Distributor,
    id: u64,
    hello: v1::Hello,
    inbound: Streaming<ClientMessage>,
    out: Out,
    batch: usize,
    interval: Duration,
) -> Result<(), StreamEnd> {
    let closing = d.closing.subscribe();
    if *closing.borrow() {
        return Ok(());
    }
    if !until_synced(d, &out, closing.clone()).await? {
        return Ok(());
    }
    // Every source behind a gate: the task wakes once per delta, and an
    // idle source then costs an atomic read, not a poll; the task's waker
    // is registered once per wake-up for all of them.
    let wakes = gate::Wakes::new();
    let mut closing = gate::watch_changes(closing, &wakes);
    let mut inbound = gate::Gate::new(inbound, &wakes);
    let identity = [&hello.subscriber, &hello.node]
        .into_iter()
        .find(|s| !s.is_empty())
        .cloned()
        .unwrap_or_else(|| format!("stream-{id}"));
    let (watched, sizes) = requested(hello.services.clone(), hello.subsets.clone(), &hello.zone);
    d.placements
        .join(id, &hello.node, &hello.peer_address, &watched);
    // Subscribe before reading state, so no delta falls between the two.
    let mut deltas = gate::Gate::new(d.log.subscribe(), &wakes);
    let mut f = Follow {
        d,
        out,
        identity,
        zone: hello.zone.clone(),
        watched,
        floors: BTreeMap::new(),
        leases: BTreeMap::new(),
        sent_up_to: 0,
        pending: Vec::with_capacity(batch.max(1)),
        pending_bytes: 0,
        batch: batch.max(1),
        encoding: Encoding::of(&hello),
    };
    f.start(&hello, sizes).await?;
    let mut placements = gate::watch_changes(d.placements.changed(), &wakes);
    let mut placed = PlacementsSent::default();
    placed.send_changes(&mut f).await?;
    f.flush().await?;
    let mut heartbeat = tokio::time::interval(HEARTBEAT);
    heartbeat.tick().await;
    let mut heartbeat = gate::ticks(heartbeat, &wakes);
    // Pacing (`stream_interval`): after a write that emptied the log,
    // the log is not read again until the pause ends.
    let mut pause = std::pin::pin!(tokio::time::sleep(Duration::ZERO));
    let mut paused = false;
    loop {
        // In order: the registration before the gates look at their bits;
        // then the gated sources, each an atomic read while idle; the log
        // last, so a steady stream of deltas cannot keep the subscriber's
        // own messages (activations, loads) waiting.
        tokio::select! {
            biased;
            () = wakes.registered() => {}
            _ = closing.next() => return Ok(()),
            msg = inbound.next() => match msg {
                Some(Ok(ClientMessage { msg: Some(m) })) => {
                    let resubscribed = matches!(m, client_message::Msg::Subscribe(_));
                    on_message(&mut f, id, &hello.node, m).await?;
                    if resubscribed {
                        d.placements.watching(id, &f.watched);
                        placed.send_changes(&mut f).await?;
                    }
                    f.flush().await?;
                }
                Some(Ok(_)) => {}
                None => return Ok(()),
                Some(Err(s)) => return Err(StreamEnd::Inbound(s)),
            },
            Some(()) = placements.next() => {
                placed.send_changes(&mut f).await?;
                f.flush().await?;
            }
            Some(()) = heartbeat.next() => {
                let hb = v1::Heartbeat { version: f.sent_up_to };
                let msg = ServerMessage { msg: Some(server_message::Msg::Heartbeat(hb)) };
                f.send(msg, 0).await?;
                f.flush().await?;
            }
            () = &mut pause, if paused => paused = false,
            Some(got) = deltas.next(), if !paused => match got {
                Ok(delta) => {
                    if f.watched.contains(&delta.service) {
                        f.on_delta(&delta).await?;
                    }
                    f.drain(deltas.inner_mut()).await?;
                    if !interval.is_zero() && deltas.inner_mut().is_empty() {
                        pause.as_mut().reset(tokio::time::Instant::now() + interval);
                        paused = true;
                    }
                }
                Err(TryRecvError::Lagged(_)) => {
                    f.catch_up().await?;
                    f.flush().await?;
                }
                // Never yielded by the stream (it waits instead).
                Err(TryRecvError::Empty) => {}
            },
        }
    }
}

/// Waits until the plane's sources have listed what they serve (at once
/// when they have), sending heartbeats meanwhile so the subscriber keeps
/// the stream and, with it, its last endpoints. `false`: the plane closes.
async fn until_synced(
    d: &Distributor,
    out: &Out,
    mut closing: tokio::sync::watch::Receiver<bool>,
) -> Result<bool, StreamEnd> {
    let mut synced = d.synced();
    if *synced.borrow() {
        return Ok(true);
    }
    tracing::debug!("subscriber waits for the plane's sources to list");
    let mut heartbeat = tokio::time::interval(HEARTBEAT);
    heartbeat.tick().await;
    loop {
        tokio::select! {
            ok = async { synced.wait_for(|s| *s).await.is_ok() } => return Ok(ok),
            () = async { let _ = closing.wait_for(|c| *c).await; } => return Ok(false),
            _ = heartbeat.tick() => {
                let hb = v1::Heartbeat { version: 0 };
                let msg = ServerMessage { msg: Some(server_message::Msg::Heartbeat(hb)) };
                out.send(&mut vec![msg]).await.map_err(|_| StreamEnd::Gone)?;
            }
        }
    }
}

/// What one subscriber was last told of the placements of the services it
/// watches; it is sent what differs (an empty node: withdrawn).
#[derive(Default)]
struct PlacementsSent {
    sent: BTreeMap<String, Peer>,
    /// The peer proxies' IP addresses sent.
    peers: BTreeSet<std::net::IpAddr>,
}

impl PlacementsSent {
    /// Queues on `f` the change of the peer proxies' addresses since the
    /// last one sent, if any.
    async fn send_peers(&mut self, f: &mut Follow<'_>) -> Result<(), StreamEnd> {
        let now = f.d.placements.peer_ips();
        let added: Vec<String> = now
            .difference(&self.peers)
            .map(ToString::to_string)
            .collect();
        let removed: Vec<String> = self
            .peers
            .difference(&now)
            .map(ToString::to_string)
            .collect();
        if added.is_empty() && removed.is_empty() {
            return Ok(());
        }
        self.peers = now;
        let hop_token = f.d.placements.hop_token().to_owned();
        let msg = v1::PeerAddresses {
            added,
            removed,
            hop_token,
        };
        let msg = ServerMessage {
            msg: Some(server_message::Msg::Peers(msg)),
        };
        f.send(msg, 0).await
    }

    /// Queues on `f` the placements of its watched services that differ
    /// from what it was told.
    async fn send_changes(&mut self, f: &mut Follow<'_>) -> Result<(), StreamEnd> {
        self.send_peers(f).await?;
        let mut now = f.d.placements.current();
        now.retain(|s, _| f.watched.contains(s));
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
            f.send(placement_msg(gone), 0).await?;
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
            f.send(placement_msg(msg), 0).await?;
        }
        Ok(())
    }
}

fn placement_msg(p: v1::Placement) -> ServerMessage {
    ServerMessage {
        msg: Some(server_message::Msg::Placement(p)),
    }
}

/// One message from the subscriber.
async fn on_message(
    f: &mut Follow<'_>,
    id: u64,
    hello_node: &str,
    msg: client_message::Msg,
) -> Result<(), StreamEnd> {
    match msg {
        client_message::Msg::Subscribe(s) => f.resubscribe(s).await?,
        client_message::Msg::Load(mut load) => {
            // Only what this stream follows: the load table stays bounded
            // by the services subscribers watch.
            load.services.retain(|s| f.watched.contains(&s.service));
            f.d.record_load(id, hello_node, &load);
        }
        client_message::Msg::Activate(a) => {
            // Node-local activation: the node that holds the request.
            let node = if a.node.is_empty() {
                hello_node.to_owned()
            } else {
                a.node
            };
            f.d.request_activation(&a.service, node).await;
        }
        client_message::Msg::Hello(_) | client_message::Msg::Ack(_) => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    use super::*;
    use crate::metrics::ControlMetrics;
    use crate::registry::{Registry, ServiceDelta};

    fn delta(version: u64) -> ServiceDelta {
        crate::distributor::tests::delta("ns/a", version)
    }

    /// A subset request of size 0 asks for the whole service (as the
    /// protocol says), not for nothing.
    #[test]
    fn a_subset_of_size_zero_follows_the_service_whole() {
        let sub = |service: &str, size| v1::SubsetRequest {
            service: service.into(),
            size,
            zone_aware: false,
            index: None,
        };
        let (watched, sizes) = requested(
            vec!["ns/a".into()],
            vec![sub("ns/b", 0), sub("ns/c", 10)],
            "z1",
        );
        assert_eq!(watched, ["ns/a", "ns/b", "ns/c"].map(String::from).into());
        assert_eq!(sizes, [("ns/c".to_owned(), (10, None, None))].into());
    }

    /// A zone-aware request takes the `Hello`'s zone; without a zone it is
    /// an ordinary subset.
    #[test]
    fn a_zone_aware_subset_prefers_the_hellos_zone() {
        let sub = |service: &str| v1::SubsetRequest {
            service: service.into(),
            size: 5,
            zone_aware: true,
            index: None,
        };
        let (_, sizes) = requested(Vec::new(), vec![sub("ns/a")], "z1");
        assert_eq!(
            sizes,
            [("ns/a".to_owned(), (5, Some("z1".into()), None))].into()
        );
        let (_, sizes) = requested(Vec::new(), vec![sub("ns/a")], "");
        assert_eq!(sizes, [("ns/a".to_owned(), (5, None, None))].into());
    }

    /// Deltas already queued when the task wakes leave in one batch (up to
    /// `batch`), in order; the rest in the next.
    #[tokio::test]
    async fn queued_deltas_leave_in_one_write() {
        let registry = Arc::new(Mutex::new(Registry::open(None, 100).expect("registry")));
        let metrics = Arc::new(ControlMetrics::new());
        let d = Distributor::new(Arc::clone(&registry), metrics, 64);
        let mut rx = d.log.subscribe();
        for _ in 0..20 {
            let v = registry.lock().expect("lock").next_version();
            d.publish(&delta(v), Instant::now());
        }
        let out = Out::new(64);
        let batches = out.clone();
        let mut f = Follow {
            d: &d,
            out,
            identity: "n".into(),
            zone: String::new(),
            watched: ["ns/a".to_owned()].into(),
            floors: [("ns/a".to_owned(), 0)].into(),
            leases: BTreeMap::new(),
            sent_up_to: 0,
            pending: Vec::new(),
            pending_bytes: 0,
            batch: 16,
            encoding: Encoding::Full,
        };
        let first = rx.recv().await.expect("delta");
        f.on_delta(&first).await.expect("sent");
        f.drain(&mut rx).await.expect("drained");
        f.drain(&mut rx).await.expect("drained");
        assert_eq!(batches.drain_messages().len(), 20);
        assert_eq!(
            d.metrics.stream_writes.get(),
            2,
            "a full batch, then the rest"
        );
        assert_eq!(d.metrics.messages_sent.get(), 20);
        assert_eq!(f.sent_up_to, 20);
    }

    /// A subsetted subscriber reaching a delta whose subset payloads were
    /// dropped (older than SUBSET_WINDOW) gets one reset of its subset,
    /// then nothing it already has.
    #[tokio::test]
    async fn a_subscriber_past_the_subset_window_gets_a_reset() {
        let registry = Arc::new(Mutex::new(Registry::open(None, 100).expect("registry")));
        let metrics = Arc::new(ControlMetrics::new());
        let d = Distributor::new(Arc::clone(&registry), metrics, 4096);
        let mut rx = d.log.subscribe();
        let (lease, _) = d.lease_subset("ns/a", 1, None, "n", None);
        let n = crate::distributor::SUBSET_WINDOW + 10;
        for _ in 0..n {
            let v = registry.lock().expect("lock").next_version();
            d.publish(&delta(v), Instant::now());
        }
        let out = Out::new(64);
        let batches = out.clone();
        let mut f = Follow {
            d: &d,
            out,
            identity: "n".into(),
            zone: String::new(),
            watched: ["ns/a".to_owned()].into(),
            floors: BTreeMap::new(),
            leases: [("ns/a".to_owned(), lease)].into(),
            sent_up_to: 0,
            pending: Vec::new(),
            pending_bytes: 0,
            batch: 16,
            encoding: Encoding::Full,
        };
        let first = rx.recv().await.expect("delta");
        f.on_delta(&first).await.expect("sent");
        while !rx.is_empty() {
            f.drain(&mut rx).await.expect("drained");
        }
        f.flush().await.expect("flushed");
        let msgs: Vec<ServerMessage> = batches.drain_messages();
        assert_eq!(msgs.len(), 1, "one reset, then nothing it already has");
        let Some(server_message::Msg::Delta(bytes)) = &msgs[0].msg else {
            panic!("a delta");
        };
        let reset = meshless_api::decode_delta(bytes).expect("decodes");
        assert!(reset.reset);
        assert_eq!(reset.version, n as u64);
        assert_eq!(reset.upserted.len(), 1);
        assert_eq!(d.metrics.coalesced.get(), 1);
    }
}
