//! The proxy's side of the distribution stream: says who it is and which
//! services its clusters reference, applies snapshots and deltas to those
//! clusters only (no reload, endpoint state kept), acknowledges versions,
//! and, when the control plane is unreachable, keeps serving the last
//! endpoints it had while it reconnects with backoff and resumes from its
//! last version.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use meshless_api::v1::{self, ClientMessage, client_message, server_message};
use meshless_api::{DistributionClient, decode_delta, endpoint_from_wire, settings_from_wire};
use meshless_model::{Endpoint, EndpointId, ServiceSettings};
use tokio::sync::{mpsc, watch};
use tonic::transport::Endpoint as GrpcEndpoint;

use crate::config::NodeConfig;
use crate::control_outbound::{Activations, Outbound, loads};
use crate::merge_window::MergeWindow;
use crate::snapshot::{ServiceFeed, Watched};
use crate::state::ProxyState;

/// No message (heartbeats included) for this long: the stream is dead.
const SILENCE: Duration = Duration::from_secs(15);
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How often the load of watched services is reported.
const LOAD_REPORT: Duration = Duration::from_secs(1);

/// Why a stream to the control plane ended.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// Not a usable address, or no connection.
    #[error(transparent)]
    Connect(#[from] tonic::transport::Error),
    /// The token cannot be sent as a header value.
    #[error("control.token_file: {0}")]
    Token(#[from] tonic::metadata::errors::InvalidMetadataValue),
    /// The control plane answered with an error status.
    #[error("{code}: {message}")]
    Status { code: tonic::Code, message: String },
    /// No message, heartbeats included, for [`SILENCE`].
    #[error("no message for {} s", SILENCE.as_secs())]
    Silent,
    /// The control plane closed the stream.
    #[error("stream closed by the control plane")]
    Closed,
    /// The outgoing half of the stream is gone.
    #[error("outgoing stream closed")]
    SendClosed,
    /// A delta that does not decode.
    #[error(transparent)]
    Decode(#[from] meshless_api::WireError),
}

impl From<tonic::Status> for LinkError {
    fn from(s: tonic::Status) -> Self {
        LinkError::Status {
            code: s.code(),
            message: s.message().to_owned(),
        }
    }
}

impl<T> From<mpsc::error::SendError<T>> for LinkError {
    fn from(_: mpsc::error::SendError<T>) -> Self {
        LinkError::SendClosed
    }
}

/// The services and subset requests of a `Hello` or `Subscribe`.
/// What a stream asks for: services followed, and subset sizes.
type Requests = (Vec<String>, Vec<v1::SubsetRequest>);

fn requests(w: &Watched) -> Requests {
    let subsets = w
        .subsets
        .iter()
        .map(|(service, ask)| v1::SubsetRequest {
            service: service.clone(),
            size: ask.size,
            zone_aware: ask.zone_aware,
            index: None,
        })
        .collect();
    (w.services.iter().cloned().collect(), subsets)
}

/// Per service: the subset index the control plane last gave this proxy
/// (`Delta.subset_index`) and the request it was for (size, zone-aware),
/// kept across streams.
type Indices = BTreeMap<String, (u32, bool, u64)>;

/// `subsets` asking each for the index held before for the same request
/// (so that a restarted control plane gives it back instead of
/// reshuffling subsets; an index of another size is another group's).
fn asking_held(mut subsets: Vec<v1::SubsetRequest>, held: &Indices) -> Vec<v1::SubsetRequest> {
    for s in &mut subsets {
        s.index = held
            .get(&s.service)
            .filter(|(size, zone_aware, _)| (*size, *zone_aware) == (s.size, s.zone_aware))
            .map(|(_, _, index)| *index);
    }
    subsets
}

/// Remembers `index` for `service` under the request `asked` holds for it.
fn hold_index(held: &mut Indices, asked: &[v1::SubsetRequest], service: &str, index: u64) {
    if let Some(s) = asked.iter().find(|s| s.service == service) {
        held.insert(service.to_owned(), (s.size, s.zone_aware, index));
    }
}

/// This proxy's identity for subset indices: its node name, else an id
/// drawn once per process (the std hasher's random keys over the clock).
fn subscriber_identity(node: &NodeConfig) -> String {
    use std::hash::BuildHasher;
    if let Some(name) = node.name.as_ref().filter(|n| !n.is_empty()) {
        return name.clone();
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let id = std::collections::hash_map::RandomState::new().hash_one((now, std::process::id()));
    format!("proxy-{id:016x}")
}

/// The proxy's own view of the streamed services: endpoints per service.
/// Per service: its endpoints by id and its settings, as received.
type Table = BTreeMap<String, TableEntry>;

#[derive(Debug, Default)]
struct TableEntry {
    endpoints: BTreeMap<EndpointId, Endpoint>,
    settings: ServiceSettings,
}

/// Runs until `stop` changes; rebuilds merged within `merge_window`.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    state: Arc<ProxyState>,
    address: String,
    token: Option<String>,
    merge_window: Duration,
    node: NodeConfig,
    mut watched: watch::Receiver<Watched>,
    activations: Activations,
    mut stop: watch::Receiver<bool>,
) {
    let uri = if address.contains("://") {
        address.clone()
    } else {
        format!("http://{address}")
    };
    let mut table = Table::new();
    let mut merge = MergeWindow::new(merge_window);
    let mut resume = Resume::default();
    let mut backoff = BACKOFF_MIN;
    let mut received = false;
    let mut indices = Indices::new();
    let subscriber = subscriber_identity(&node);
    loop {
        let link = Link {
            table: &mut table,
            merge: &mut merge,
            resume: &mut resume,
            subscriber: &subscriber,
            received: &mut received,
            indices: &mut indices,
        };
        let session = session(
            &state,
            &uri,
            token.as_deref(),
            &node,
            &mut watched,
            &activations,
            link,
        );
        tokio::select! {
            result = session => {
                if let Err(e) = result {
                    state.metrics.control_stream_failures.inc();
                    let have = state.services.lock().unwrap_or_else(PoisonError::into_inner).len();
                    if have == 0 {
                        tracing::warn!(control = %address, error = ?e, "control plane unreachable; no endpoints received yet");
                    } else {
                        tracing::warn!(control = %address, error = ?e, services = have, "control plane unreachable; serving the last endpoints");
                    }
                }
                // A stream that carried messages was a good connection:
                // the next attempt starts from the shortest backoff.
                if std::mem::take(&mut received) {
                    backoff = BACKOFF_MIN;
                }
            }
            _ = stop.changed() => return,
        }
        // Changes merged when the stream ended apply now.
        for service in merge.take_all() {
            rebuild(&state, &table, &service);
            merge.rebuilt(&service, Instant::now());
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// Where the next stream resumes: the last version applied completely, the
/// control-plane incarnation it belongs to (0, 0: nothing yet), and the
/// requests (services and subset sizes) whose state that version covers.
/// A stream asking for anything else starts from a snapshot: a replay
/// from the version carries only changes, never a service's whole state.
#[derive(Debug, Default, Clone)]
struct Resume {
    version: u64,
    incarnation: u64,
    covers: Option<Requests>,
}

impl Resume {
    /// The `(version, incarnation)` a stream asking for `requests` resumes
    /// from: `(0, 0)` (a snapshot) unless this covers exactly those.
    fn point_for(&self, requests: &Requests) -> (u64, u64) {
        match &self.covers {
            Some(c) if c == requests => (self.version, self.incarnation),
            _ => (0, 0),
        }
    }
}

/// What a stream's session updates and the next one continues from.
struct Link<'a> {
    table: &'a mut Table,
    merge: &'a mut MergeWindow,
    resume: &'a mut Resume,
    /// This proxy's identity for subset indices, the same on every stream.
    subscriber: &'a str,
    /// Raised when the stream delivers a message.
    received: &'a mut bool,
    /// The subset indices held, asked for again on the next stream.
    indices: &'a mut Indices,
}

/// One stream, from connect to disconnect.
async fn session(
    state: &Arc<ProxyState>,
    uri: &str,
    token: Option<&str>,
    node: &NodeConfig,
    watched: &mut watch::Receiver<Watched>,
    activations: &Activations,
    link: Link<'_>,
) -> Result<(), LinkError> {
    let Link {
        table,
        merge,
        resume,
        subscriber,
        received,
        indices,
    } = link;
    let mut report = tokio::time::interval(LOAD_REPORT);
    let channel = GrpcEndpoint::from_shared(uri.to_owned())?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .connect()
        .await?;
    let auth = token
        .map(|t| format!("Bearer {t}").parse::<tonic::metadata::MetadataValue<_>>())
        .transpose()?;
    let mut client =
        DistributionClient::with_interceptor(channel, move |mut req: tonic::Request<()>| {
            if let Some(v) = &auth {
                req.metadata_mut().insert("authorization", v.clone());
            }
            Ok(req)
        })
        .max_decoding_message_size(meshless_api::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(meshless_api::MAX_MESSAGE_BYTES);
    let (tx, rx) = mpsc::channel::<ClientMessage>(16);
    let asked = requests(&watched.borrow_and_update());
    let (resume_version, resume_incarnation) = resume.point_for(&asked);
    // What a snapshot on this stream covers; none once the requests change.
    let mut snapshot_covers = Some(asked.clone());
    let (services, subsets) = asked;
    // The subset requests this stream made last (for `hold_index`).
    let mut asked_subsets = subsets.clone();
    let hello = ClientMessage {
        msg: Some(client_message::Msg::Hello(v1::Hello {
            node: node.name.clone().unwrap_or_default(),
            zone: node.zone.clone().unwrap_or_default(),
            services,
            resume_version,
            resume_incarnation,
            peer_address: state
                .peer_address
                .get()
                .map(ToString::to_string)
                .unwrap_or_default(),
            subsets: asking_held(subsets, indices),
            subscriber: subscriber.to_owned(),
            compact: true,
        })),
    };
    tx.send(hello).await?;
    // Held requests' activations join this stream directly (`control_outbound`).
    let outbound = Outbound::new(
        rx,
        Arc::clone(activations),
        Arc::clone(state),
        node.name.clone().unwrap_or_default(),
    );
    let mut inbound = client.stream(outbound).await?.into_inner();
    tracing::info!(control = %uri, resume_version, "control plane stream open");
    let _connected = Connected::new(&state.metrics.control_connected);
    // This stream sends the placements that hold now.
    state.placements.clear();
    // Measured from the last message received, not from the last turn of
    // the loop: the load report wakes the loop every second.
    let silence = tokio::time::sleep(SILENCE);
    tokio::pin!(silence);
    loop {
        let due = merge.next_due();
        let merged = async move {
            match due {
                Some(t) => tokio::time::sleep_until(t.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = &mut silence => {
                return Err(LinkError::Silent);
            }
            () = merged => {
                let now = Instant::now();
                for service in merge.take_due(now) {
                    rebuild(state, table, &service);
                    merge.rebuilt(&service, now);
                }
            }
            msg = inbound.message() => {
                let msg = match msg {
                    Err(s) => return Err(s.into()),
                    Ok(None) => return Err(LinkError::Closed),
                    Ok(Some(m)) => m,
                };
                silence.as_mut().reset(tokio::time::Instant::now() + SILENCE);
                match msg.msg {
                    Some(server_message::Msg::Delta(bytes)) => {
                        let delta = decode_delta(&bytes)?;
                        let (v, reset) = (delta.version, delta.reset);
                        if let Some(index) = delta.subset_index {
                            hold_index(indices, &asked_subsets, &delta.service, index);
                        }
                        // Only a stream past its snapshot was a good one
                        // (the backoff restarts after it): one that fails
                        // inside its snapshot every time must back off.
                        *received |= !reset;
                        apply(state, table, merge, delta);
                        // A reset is one service of a snapshot (or of a
                        // catch-up after lag): the version moves only once
                        // all of it arrived, so a stream cut half-way
                        // resumes from before it.
                        if !reset {
                            resume.version = resume.version.max(v);
                        }
                    }
                    Some(server_message::Msg::SnapshotDone(done)) => {
                        // The snapshot is the whole state at `done.version`
                        // of `done.incarnation`: a restarted control plane
                        // may be younger, or older with other changes, and
                        // versions of another incarnation say nothing.
                        *resume = Resume { version: done.version, incarnation: done.incarnation, covers: snapshot_covers.clone() };
                        *received = true;
                        if !state.control_synced.swap(true, std::sync::atomic::Ordering::AcqRel) {
                            tracing::info!(version = done.version, "first snapshot from the control plane applied; ready");
                        }
                    }
                    Some(server_message::Msg::Peers(p)) => {
                        state.placements.change_peers(&p.added, &p.removed);
                        state.placements.set_hop_token(&p.hop_token);
                    }
                    Some(server_message::Msg::Placement(p)) => {
                        state.placements.set(&p.service, &p.node, &p.address);
                    }
                    // The version applied, once per heartbeat: an ack per
                    // delta would cost the control plane a message in for
                    // every message out, on every stream.
                    Some(server_message::Msg::Heartbeat(_)) => {
                        *received = true;
                        let ack = ClientMessage { msg: Some(client_message::Msg::Ack(v1::Ack { version: resume.version })) };
                        let _ = tx.try_send(ack);
                    }
                    None => {}
                }
            }
            _ = report.tick() => {
                let load = ClientMessage { msg: Some(client_message::Msg::Load(v1::Load { services: loads(state) })) };
                let _ = tx.try_send(load);
            }
            changed = watched.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
                let (services, subsets) = requests(&watched.borrow_and_update());
                // The resume version no longer covers what this stream
                // follows (a new service arrives as a reset after it):
                // the next stream starts from a snapshot.
                resume.covers = None;
                snapshot_covers = None;
                table.retain(|s, _| services.contains(s));
                merge.retain(|s| services.iter().any(|w| w == s));
                indices.retain(|s, _| services.contains(s));
                asked_subsets.clone_from(&subsets);
                let subsets = asking_held(subsets, indices);
                let sub = ClientMessage { msg: Some(client_message::Msg::Subscribe(v1::Subscribe { services, subsets })) };
                tx.send(sub).await?;
            }
        }
    }
}

/// Applies one delta to the table; rebuilds the clusters of its service
/// now or at the end of the merge window.
fn apply(state: &ProxyState, table: &mut Table, merge: &mut MergeWindow, delta: v1::Delta) {
    if !delta.activation_error.is_empty() {
        state
            .activation_errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                delta.service.clone(),
                (delta.activation_error.clone(), std::time::Instant::now()),
            );
        state.endpoints_changed.notify_waiters();
        return;
    }
    let entry = table.entry(delta.service.clone()).or_default();
    if delta.reset {
        entry.endpoints.clear();
        entry.settings = ServiceSettings::default();
    }
    if let Some(w) = &delta.settings {
        match settings_from_wire(w) {
            Ok(s) => entry.settings = s,
            // Keep what it had: a newer control plane may know more values.
            Err(e) => {
                tracing::warn!(service = %delta.service, error = %e, "service settings skipped")
            }
        }
    }
    for w in &delta.upserted {
        match endpoint_from_wire(w) {
            Ok(e) => {
                entry.endpoints.insert(e.id.clone(), e);
            }
            Err(e) => tracing::warn!(service = %delta.service, error = %e, "endpoint skipped"),
        }
    }
    for id in &delta.removed {
        entry.endpoints.remove(&EndpointId::new(id.clone()));
    }
    // Requests may be held for a service with no ready endpoint (a cold
    // start: this delta may be the instance's readiness): never wait.
    let none_ready = state
        .services
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&delta.service)
        .is_none_or(|f| !f.endpoints.iter().any(|e| e.conditions.ready));
    let now = Instant::now();
    if merge.admit(&delta.service, now, delta.reset || none_ready) {
        rebuild(state, table, &delta.service);
        merge.rebuilt(&delta.service, now);
    }
}

/// Rebuilds the clusters of `service` from the table.
fn rebuild(state: &ProxyState, table: &Table, service: &str) {
    let feed = table
        .get(service)
        .map(|e| ServiceFeed {
            endpoints: e.endpoints.values().cloned().collect(),
            settings: e.settings.clone(),
        })
        .unwrap_or_default();
    // The lock orders this against reloads, which rebuild from the same table.
    let mut services = state
        .services
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    services.insert(service.to_owned(), feed);
    let current = state.snapshot.load_full();
    match current.with_service(service, &services) {
        Ok(next) => {
            state.snapshot.store(Arc::new(next));
            state.endpoints_swapped();
        }
        Err(e) => {
            tracing::error!(service = %service, error = %e, "cannot apply endpoints; keeping the previous ones");
        }
    }
}

/// Holds `control_connected` at 1 while a stream is open.
struct Connected(prometheus_client::metrics::gauge::Gauge);

impl Connected {
    fn new(gauge: &prometheus_client::metrics::gauge::Gauge) -> Self {
        gauge.set(1);
        Self(gauge.clone())
    }
}

impl Drop for Connected {
    fn drop(&mut self) {
        self.0.set(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(service: &str, size: u32, zone_aware: bool) -> v1::SubsetRequest {
        v1::SubsetRequest {
            service: service.into(),
            size,
            zone_aware,
            index: None,
        }
    }

    /// An index is asked for again only by the same request: another size
    /// (or zone awareness) is another group, where it means nothing.
    #[test]
    fn a_held_index_is_asked_for_by_the_same_request_only() {
        let mut held = Indices::new();
        let asked = [ask("ns/a", 3, false), ask("ns/b", 2, true)];
        hold_index(&mut held, &asked, "ns/a", 4);
        hold_index(&mut held, &asked, "ns/b", 1);
        hold_index(&mut held, &asked, "ns/not-asked", 9);
        let again = asking_held(
            vec![
                ask("ns/a", 3, false),
                ask("ns/b", 5, true),
                ask("ns/c", 3, false),
            ],
            &held,
        );
        let indices: Vec<Option<u64>> = again.iter().map(|s| s.index).collect();
        assert_eq!(indices, [Some(4), None, None]);
        assert_eq!(held.len(), 2);
    }
}
