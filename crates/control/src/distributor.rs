//! The distribution stream: every delta is encoded once and the same bytes
//! go to every subscriber of its service. Subscribers read a shared log
//! (`delta_log.rs`); one that falls more than the log behind gets its
//! pending deltas coalesced into one reset per watched service, so server
//! memory per subscriber stays bounded and nobody else waits for it.

use std::collections::{BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use meshless_api::v1;
use meshless_api::{EncodedPair, endpoint_to_wire, settings_to_wire};

use crate::api::{REMOTE_LOAD_TTL, RemoteLoad};
use crate::delta_log::DeltaLog;
use crate::metrics::ControlMetrics;
use crate::registry::{Registry, ServiceDelta};
use crate::subsets::{SubsetDeltas, SubsetKey, Subsets};

/// The fewest deltas kept (`history`): a shorter shared log would
/// coalesce into resets the deltas of any subscriber a few writes behind.
pub const MIN_HISTORY: usize = 16;

/// One published delta.
#[derive(Debug)]
pub struct EncodedDelta {
    pub version: u64,
    pub service: String,
    /// Encoded once per encoding; every subscriber of an encoding shares it.
    pub bytes: EncodedPair,
    pub committed: Instant,
    /// An event, not state (an activation error): sent to the subscribers
    /// connected when it happens, never replayed on a resume, where it
    /// would fail requests held since before it.
    pub event: bool,
    /// What subsetted subscribers of the service receive instead of
    /// `bytes`, per subset key (absent key: nothing); `None`: `bytes`.
    pub subsets: Option<SubsetSlot>,
}

/// One delta's per-key subset payloads, emptied (`None`) once the delta
/// is [`SUBSET_WINDOW`] publications old: a subscriber that reaches it
/// later gets a reset of its subset instead.
pub type SubsetSlot = Arc<Mutex<Option<SubsetDeltas>>>;

/// Deltas whose subset payloads are kept: server memory for subsets is
/// bounded by this many deltas' payloads, not by the ring (`history`).
pub const SUBSET_WINDOW: usize = 1024;

/// Bytes of subset payloads kept (both encodings), whatever the number of
/// deltas: a delta that regroups every subscriber (or a reset) carries a
/// whole subset per index, so 1,024 of them could hold gigabytes. The
/// newest delta's payloads are always kept (its subscribers are reading
/// it); older ones go first.
pub const SUBSET_WINDOW_BYTES: usize = 64 << 20;

/// Bytes of one delta's subset payloads.
fn subset_bytes(per_key: &SubsetDeltas) -> usize {
    per_key
        .values()
        .map(|p| p.full.len() + p.compact.len())
        .sum()
}

/// The kept subset payloads, oldest first, and their bytes.
#[derive(Debug, Default)]
struct RecentSubsets {
    slots: VecDeque<(SubsetSlot, usize)>,
    bytes: usize,
}

impl RecentSubsets {
    /// Keeps `slot` (of `bytes`), emptying the oldest ones past
    /// [`SUBSET_WINDOW`] deltas or [`SUBSET_WINDOW_BYTES`].
    fn push(&mut self, slot: SubsetSlot, bytes: usize) {
        self.slots.push_back((slot, bytes));
        self.bytes += bytes;
        while self.slots.len() > 1
            && (self.slots.len() > SUBSET_WINDOW || self.bytes > SUBSET_WINDOW_BYTES)
            && let Some((old, old_bytes)) = self.slots.pop_front()
        {
            self.bytes -= old_bytes;
            *old.lock().unwrap_or_else(PoisonError::into_inner) = None;
        }
    }
}

/// Per service, per follower replica: (in flight, queued, when reported).
type RemoteLoads =
    std::collections::HashMap<String, std::collections::HashMap<String, (u64, u64, Instant)>>;

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
    pub(crate) metrics: Arc<ControlMetrics>,
    history: Mutex<History>,
    history_len: usize,
    /// Every published delta, read by each subscriber at its own cursor.
    pub(crate) log: Arc<DeltaLog<Arc<EncodedDelta>>>,
    /// Set on shutdown: every subscriber stream ends.
    pub(crate) closing: tokio::sync::watch::Sender<bool>,
    /// False until every source of the registry (the Kubernetes source's
    /// first lists) has written what it holds: until then no snapshot is
    /// sent, so a restarted plane never streams an empty reset for a
    /// service it simply has not listed yet (static stability).
    synced: tokio::sync::watch::Sender<bool>,
    /// The last reset (snapshot) encoding per service and the version it
    /// reflects: subscribers connecting together share one encoding.
    resets: Mutex<std::collections::HashMap<String, (u64, EncodedPair)>>,
    /// Latest load report per service and subscriber: (in flight, queued).
    loads: Mutex<LoadTable>,
    /// Per service, per follower replica: its forwarded load and when.
    remote_loads: Mutex<RemoteLoads>,
    /// Woken when a proxy asks to activate a service.
    activations: Mutex<std::collections::HashMap<String, Arc<tokio::sync::Notify>>>,
    /// Per service: the node of the proxy that last asked for an instance.
    activation_nodes: Mutex<std::collections::HashMap<String, String>>,
    /// Per service: when the first activation request not yet taken by
    /// its scaling loop was read from a stream (a cold start's record).
    activation_reads: Mutex<std::collections::HashMap<String, Instant>>,
    pub(crate) next_subscriber: std::sync::atomic::AtomicU64,
    /// Ahead-of-time placement of the services at zero.
    pub placements: crate::placement::Placements,
    /// The published view of every service and its subset groups.
    subsets: Mutex<Subsets>,
    /// The last [`SUBSET_WINDOW`] deltas' subset payloads, oldest first.
    recent_subsets: Mutex<RecentSubsets>,
    /// Random and non-zero, new on every start: versions are comparable
    /// only within one incarnation (a restarted plane may reuse them).
    pub(crate) incarnation: u64,
}

impl Distributor {
    /// Ends every subscriber stream (on shutdown), so proxies reconnect.
    pub fn close(&self) {
        let _ = self.closing.send(true);
    }

    /// Holds every snapshot back until [`Distributor::mark_synced`]: for a
    /// source whose first list is still to come.
    pub fn hold_until_synced(&self) {
        self.synced.send_replace(false);
    }

    /// Every source has listed what it serves: snapshots may go out.
    pub fn mark_synced(&self) {
        self.synced.send_replace(true);
    }

    /// Whether snapshots may go out (the plane is Ready).
    pub fn is_synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// A receiver of the synced flag.
    pub(crate) fn synced(&self) -> tokio::sync::watch::Receiver<bool> {
        self.synced.subscribe()
    }

    /// A distributor keeping the last `history_len` deltas for resumption
    /// (at least [`MIN_HISTORY`]); the log subscribers read holds as many.
    pub fn new(
        registry: Arc<Mutex<Registry>>,
        metrics: Arc<ControlMetrics>,
        history_len: usize,
    ) -> Self {
        let history_len = history_len.max(MIN_HISTORY);
        // Deltas from before this process started are not in the history.
        let (dropped_up_to, subsets) = {
            let reg = registry.lock().unwrap_or_else(PoisonError::into_inner);
            (reg.version(), seed_subsets(&reg))
        };
        Self {
            registry,
            metrics,
            history: Mutex::new(History {
                deltas: VecDeque::with_capacity(history_len),
                dropped_up_to,
            }),
            history_len,
            log: DeltaLog::new(history_len),
            closing: tokio::sync::watch::channel(false).0,
            synced: tokio::sync::watch::channel(true).0,
            resets: Mutex::new(std::collections::HashMap::new()),
            loads: Mutex::new(std::collections::HashMap::new()),
            remote_loads: Mutex::new(std::collections::HashMap::new()),
            activations: Mutex::new(std::collections::HashMap::new()),
            activation_nodes: Mutex::new(std::collections::HashMap::new()),
            activation_reads: Mutex::new(std::collections::HashMap::new()),
            next_subscriber: std::sync::atomic::AtomicU64::new(1),
            placements: crate::placement::Placements::default(),
            subsets: Mutex::new(subsets),
            recent_subsets: Mutex::new(RecentSubsets::default()),
            incarnation: new_incarnation(),
        }
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Requests in flight and queued for `service`, summed over this
    /// replica's proxies and the reports forwarded by followers within
    /// [`REMOTE_LOAD_TTL`].
    pub fn load(&self, service: &str) -> (u64, u64) {
        let (f, q) = self.local_load(service);
        let remote = self
            .remote_loads
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        remote.get(service).map_or((f, q), |per| {
            per.values()
                .filter(|(_, _, at)| at.elapsed() < REMOTE_LOAD_TTL)
                .fold((f, q), |(f, q), (a, b, _)| (f + a, q + b))
        })
    }

    /// Requests in flight and queued for `service`, summed over this
    /// replica's proxies only (what a follower forwards).
    pub fn local_load(&self, service: &str) -> (u64, u64) {
        let loads = self.loads.lock().unwrap_or_else(PoisonError::into_inner);
        loads.get(service).map_or((0, 0), |per| {
            per.values().fold((0, 0), |(f, q), (a, b)| {
                (f + u64::from(*a), q + u64::from(*b))
            })
        })
    }

    /// A follower replica's forwarded load of `service` (replacing its
    /// last); with `activate` or requests queued, wakes the scaler as a
    /// proxy's activation request would. Unknown services are ignored.
    pub async fn record_remote_load(&self, service: &str, report: &RemoteLoad) {
        if !self.knows_service(service).await {
            return;
        }
        let mut remote = self
            .remote_loads
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Replicas gone for a while leave; the map stays bounded.
        remote.retain(|_, per| {
            per.retain(|_, (_, _, at)| at.elapsed() < REMOTE_LOAD_TTL);
            !per.is_empty()
        });
        remote.entry(service.to_owned()).or_default().insert(
            report.replica.clone(),
            (report.in_flight, report.queued, Instant::now()),
        );
        drop(remote);
        if report.activate || report.queued > 0 {
            self.activate_known(service, report.node.clone());
        }
    }

    /// Whether the registry holds `service`, without blocking an executor
    /// thread: the commit thread holds the registry lock through a
    /// group's fsync (seconds on a stalled disk), so when the lock is
    /// taken the check waits on tokio's blocking pool instead.
    async fn knows_service(&self, service: &str) -> bool {
        match self.registry.try_lock() {
            Ok(reg) => return reg.service_version(service).is_some(),
            Err(std::sync::TryLockError::Poisoned(p)) => {
                return p.into_inner().service_version(service).is_some();
            }
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
        self.metrics.registry_waits_offloaded.inc();
        let registry = Arc::clone(&self.registry);
        let service = service.to_owned();
        tokio::task::spawn_blocking(move || {
            registry
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .service_version(&service)
                .is_some()
        })
        .await
        .unwrap_or(false)
    }

    /// A proxy on `node` holds requests for `service`: remembers the node
    /// (the last asker wins; empty: none) and wakes the service's scaler.
    /// A service the registry does not hold is ignored (nothing could
    /// start it; remembering it would let a proxy grow these maps).
    pub async fn request_activation(&self, service: &str, node: String) {
        let read = Instant::now();
        if !self.knows_service(service).await {
            tracing::debug!(%service, "activation request for an unknown service ignored");
            return;
        }
        self.activate_at(service, node, read);
    }

    /// [`Distributor::request_activation`] of a service known to exist.
    fn activate_known(&self, service: &str, node: String) {
        self.activate_at(service, node, Instant::now());
    }

    fn activate_at(&self, service: &str, node: String, read: Instant) {
        self.metrics.activation_requests.inc();
        self.activation_reads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(service.to_owned())
            .or_insert(read);
        if !node.is_empty() {
            self.activation_nodes
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(service.to_owned(), node);
        }
        self.activation(service).notify_one();
    }

    /// The node of the last activation request for `service` not yet
    /// taken by an instance start.
    pub fn take_activation_node(&self, service: &str) -> Option<String> {
        self.activation_nodes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(service)
    }

    /// When the first activation request for `service` since the last
    /// call was read from a subscriber's stream (`None`: none since).
    pub fn take_activation_read(&self, service: &str) -> Option<Instant> {
        self.activation_reads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(service)
    }

    /// The signal a proxy's activation request for `service` wakes.
    pub fn activation(&self, service: &str) -> Arc<tokio::sync::Notify> {
        let mut a = self
            .activations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Arc::clone(a.entry(service.to_owned()).or_default())
    }

    /// Records the load report of `subscriber`, a proxy on `node`: its
    /// whole load, replacing the last (a service left out carries none).
    pub(crate) fn record_load(&self, subscriber: u64, node: &str, load: &v1::Load) {
        for s in &load.services {
            if s.in_flight > 0 || s.queued > 0 {
                self.placements.record_activity(&s.service, node);
            }
        }
        let mut loads = self.loads.lock().unwrap_or_else(PoisonError::into_inner);
        forget_load(&mut loads, subscriber);
        for s in &load.services {
            loads
                .entry(s.service.clone())
                .or_default()
                .insert(subscriber, (s.in_flight, s.queued));
        }
    }

    pub(crate) fn forget_subscriber(&self, subscriber: u64) {
        self.placements.leave(subscriber);
        let mut loads = self.loads.lock().unwrap_or_else(PoisonError::into_inner);
        forget_load(&mut loads, subscriber);
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
            settings: None,
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
            settings: delta.settings.as_ref().map(settings_to_wire),
            subset_index: None,
        };
        let subsets = self.lock_subsets().apply(&wire).map(|per_key| {
            let bytes = subset_bytes(&per_key);
            let slot: SubsetSlot = Arc::new(Mutex::new(Some(per_key)));
            self.recent_subsets
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(Arc::clone(&slot), bytes);
            slot
        });
        let encoded = Arc::new(EncodedDelta {
            version: delta.version,
            service: delta.service.clone(),
            bytes: EncodedPair::encode(&wire),
            committed,
            event: delta.activation_error.is_some(),
            subsets,
        });
        {
            let mut h = self.history.lock().unwrap_or_else(PoisonError::into_inner);
            if h.deltas.len() == self.history_len
                && let Some(old) = h.deltas.pop_front()
            {
                h.dropped_up_to = h.dropped_up_to.max(old.version);
            }
            // Resumption replays whole services only: the history keeps no
            // subset payloads (subsets are sent whole on reconnect).
            let kept = match encoded.subsets {
                None => Arc::clone(&encoded),
                Some(_) => Arc::new(EncodedDelta {
                    version: encoded.version,
                    service: encoded.service.clone(),
                    bytes: encoded.bytes.clone(),
                    committed: encoded.committed,
                    event: encoded.event,
                    subsets: None,
                }),
            };
            h.deltas.push_back(kept);
        }
        self.metrics.deltas.inc();
        self.log.publish(encoded);
    }

    /// Reset deltas with every endpoint of each service (empty if unknown),
    /// all read under one lock, and the registry version they reflect.
    pub(crate) fn resets<'a>(
        &self,
        services: impl IntoIterator<Item = &'a String>,
    ) -> (u64, Vec<EncodedPair>) {
        let reg = self.registry();
        let mut cache = self.resets.lock().unwrap_or_else(PoisonError::into_inner);
        if cache.len() > reg.service_count() {
            // Services deleted since their last snapshot: their encodings go.
            cache.retain(|service, _| reg.service_version(service).is_some());
        }
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
                let bytes = EncodedPair::encode(&v1::Delta {
                    version,
                    service: service.clone(),
                    upserted: endpoints
                        .iter()
                        .map(|(e, s)| endpoint_to_wire(e, s))
                        .collect(),
                    removed: Vec::new(),
                    reset: true,
                    activation_error: String::new(),
                    settings: reg.settings(service).map(settings_to_wire),
                    subset_index: None,
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
    pub(crate) fn replay(
        &self,
        version: u64,
        services: &BTreeSet<String>,
    ) -> Option<Vec<Arc<EncodedDelta>>> {
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
                .filter(|d| d.version > version && !d.event && services.contains(&d.service))
                .cloned()
                .collect(),
        )
    }
}

/// Removes `subscriber`'s load from every service, and services left with
/// no load at all.
fn forget_load(loads: &mut LoadTable, subscriber: u64) {
    loads.retain(|_, per| {
        per.remove(&subscriber);
        !per.is_empty()
    });
}

/// The published view of every service the registry holds now.
fn seed_subsets(reg: &Registry) -> Subsets {
    let mut subsets = Subsets::default();
    for key in reg.service_keys() {
        if let Some((version, endpoints)) = reg.snapshot(&key) {
            let wire = endpoints
                .iter()
                .map(|(e, s)| endpoint_to_wire(e, s))
                .collect();
            subsets.seed(
                &key,
                version,
                wire,
                reg.settings(&key).map(settings_to_wire),
            );
        }
    }
    subsets
}

/// One subsetted subscription of a stream: holds its index in the
/// service's group until dropped.
#[derive(Debug)]
pub(crate) struct SubsetLease<'a> {
    d: &'a Distributor,
    pub service: String,
    identity: String,
    pub key: SubsetKey,
    /// Deltas of the service at or below this version are in what the
    /// subscriber was sent (its subset reset).
    pub floor: u64,
}

impl Drop for SubsetLease<'_> {
    fn drop(&mut self) {
        self.d
            .lock_subsets()
            .release(&self.service, &self.key, &self.identity);
        self.d.metrics.subset_subscriptions.dec();
    }
}

impl SubsetLease<'_> {
    /// A reset of this subscription's current members; moves the floor.
    pub fn reset(&mut self) -> EncodedPair {
        let (version, bytes) = self.d.lock_subsets().reset(&self.service, &self.key);
        self.floor = version;
        bytes
    }
}

impl Distributor {
    fn lock_subsets(&self) -> std::sync::MutexGuard<'_, Subsets> {
        self.subsets.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `identity` follows a subset of `size` of `service` (preferring
    /// `zone` when given): the lease (its index, held until dropped) and a
    /// reset holding its members. Call after subscribing to the log:
    /// deltas above `floor` follow.
    pub(crate) fn lease_subset(
        &self,
        service: &str,
        size: u32,
        zone: Option<&str>,
        identity: &str,
        wanted: Option<u64>,
    ) -> (SubsetLease<'_>, EncodedPair) {
        let (key, floor, bytes) = self
            .lock_subsets()
            .register_asking(service, size, zone, identity, wanted);
        self.metrics.subset_subscriptions.inc();
        let lease = SubsetLease {
            d: self,
            service: service.to_owned(),
            identity: identity.to_owned(),
            key,
            floor,
        };
        (lease, bytes)
    }
}

/// A random non-zero id for this process's distributor: the std hasher's
/// per-process random keys over the clock and the process id.
fn new_incarnation() -> u64 {
    use std::hash::BuildHasher;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    std::collections::hash_map::RandomState::new()
        .hash_one((now, std::process::id()))
        .max(1)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use meshless_model::{Endpoint, EndpointId};

    #[test]
    fn kept_subset_payloads_are_bounded_by_bytes_and_keep_the_newest() {
        let slot = || -> SubsetSlot { Arc::new(Mutex::new(Some(SubsetDeltas::new()))) };
        let held = |s: &SubsetSlot| s.lock().expect("lock").is_some();
        let mut recent = RecentSubsets::default();
        let quarter = SUBSET_WINDOW_BYTES / 4;
        let slots: Vec<SubsetSlot> = (0..6).map(|_| slot()).collect();
        for s in &slots {
            recent.push(Arc::clone(s), quarter);
        }
        // Four quarters fit; the two oldest were emptied for the last two.
        let kept: Vec<bool> = slots.iter().map(held).collect();
        assert_eq!(kept, [false, false, true, true, true, true]);
        assert_eq!(recent.bytes, SUBSET_WINDOW_BYTES);
        // One payload over the whole budget empties the rest but stays.
        let huge = slot();
        recent.push(Arc::clone(&huge), 2 * SUBSET_WINDOW_BYTES);
        assert!(held(&huge) && slots.iter().all(|s| !held(s)));
        assert_eq!(recent.slots.len(), 1);
        // The count bound still holds for small payloads.
        for _ in 0..SUBSET_WINDOW + 10 {
            recent.push(slot(), 1);
        }
        assert_eq!(recent.slots.len(), SUBSET_WINDOW);
    }

    /// A delta of `service` at `version`: one endpoint put, one removed.
    pub(crate) fn delta(service: &str, version: u64) -> ServiceDelta {
        ServiceDelta {
            service: service.into(),
            version,
            upserted: vec![(
                Endpoint::new("e", "10.0.0.1:80".parse().expect("addr")),
                "s".into(),
            )],
            removed: vec![EndpointId::new("gone")],
            reset: false,
            activation_error: None,
            settings: None,
        }
    }

    fn distributor(history: usize) -> (Arc<Mutex<Registry>>, Distributor) {
        let registry = Arc::new(Mutex::new(Registry::open(None, 100).expect("registry")));
        let d = Distributor::new(
            Arc::clone(&registry),
            Arc::new(ControlMetrics::new()),
            history,
        );
        (registry, d)
    }

    #[test]
    fn a_published_delta_is_encoded_once_for_every_subscriber() {
        let (registry, d) = distributor(16);
        let (mut a, mut b) = (d.log.subscribe(), d.log.subscribe());
        let v = registry.lock().expect("lock").next_version();
        d.publish(&delta("ns/a", v), Instant::now());
        let (x, y) = (a.try_recv().expect("a"), b.try_recv().expect("b"));
        assert!(Arc::ptr_eq(&x, &y), "the same encoded bytes");
        let wire = meshless_api::decode_delta(&x.bytes.full).expect("decodes");
        assert_eq!((wire.version, wire.service.as_str()), (v, "ns/a"));
        assert_eq!(wire.removed, vec!["gone".to_owned()]);
        assert_eq!(d.metrics.deltas.get(), 1);
    }

    #[test]
    fn replay_covers_what_the_history_holds_and_refuses_the_rest() {
        let (registry, d) = distributor(16);
        let watched: BTreeSet<String> = ["ns/a".to_owned()].into();
        for _ in 0..20 {
            let mut reg = registry.lock().expect("lock");
            let v = reg.next_version();
            d.publish(
                &delta(if v % 2 == 0 { "ns/a" } else { "ns/b" }, v),
                Instant::now(),
            );
        }
        // The ring keeps the last 16 (versions 5..=20): resuming from 4 or later works.
        let replayed = d.replay(10, &watched).expect("in history");
        let versions: Vec<u64> = replayed.iter().map(|e| e.version).collect();
        assert_eq!(
            versions,
            vec![12, 14, 16, 18, 20],
            "only watched services, after 10"
        );
        assert!(d.replay(3, &watched).is_none(), "version 4 was dropped");
        assert!(
            d.replay(21, &watched).is_none(),
            "from the future: a snapshot instead"
        );
        assert_eq!(d.replay(20, &watched).map(|r| r.len()), Some(0));
    }

    #[test]
    fn loads_sum_over_subscribers_and_leave_with_them() {
        let (_, d) = distributor(16);
        let load = |in_flight, queued| v1::Load {
            services: vec![v1::ServiceLoad {
                service: "ns/a".into(),
                in_flight,
                queued,
            }],
        };
        d.record_load(1, "n1", &load(3, 1));
        d.record_load(2, "n2", &load(4, 0));
        d.record_load(1, "n1", &load(5, 2));
        assert_eq!(d.load("ns/a"), (9, 2), "the latest report per subscriber");
        d.forget_subscriber(1);
        assert_eq!(d.load("ns/a"), (4, 0));
        assert_eq!(d.load("ns/none"), (0, 0));
    }

    /// A report is the subscriber's whole load: a service it no longer
    /// reports (its config dropped it) carries none of its load, and a
    /// service nobody reports leaves the table.
    #[test]
    fn a_service_left_out_of_a_report_loses_that_subscribers_load() {
        let (_, d) = distributor(16);
        let load = |services: &[(&str, u32)]| v1::Load {
            services: services
                .iter()
                .map(|(s, q)| v1::ServiceLoad {
                    service: (*s).into(),
                    in_flight: *q,
                    queued: *q,
                })
                .collect(),
        };
        d.record_load(1, "n1", &load(&[("ns/a", 3)]));
        d.record_load(2, "n2", &load(&[("ns/a", 1)]));
        d.record_load(1, "n1", &load(&[("ns/b", 0)]));
        assert_eq!(d.load("ns/a"), (1, 1), "only subscriber 2's");
        d.forget_subscriber(2);
        d.forget_subscriber(1);
        assert_eq!(d.load("ns/a"), (0, 0));
        let loads = d.loads.lock().expect("lock");
        assert!(loads.is_empty(), "no empty entries left: {loads:?}");
    }

    /// Activation requests name services from the network: one the
    /// registry does not hold starts nothing and is not remembered.
    #[tokio::test]
    async fn an_activation_request_for_an_unknown_service_is_ignored() {
        let (registry, d) = distributor(16);
        for i in 0..100 {
            d.request_activation(&format!("ns/nope-{i}"), "n1".into())
                .await;
        }
        assert!(d.activations.lock().expect("lock").is_empty());
        assert!(d.activation_nodes.lock().expect("lock").is_empty());
        assert!(d.activation_reads.lock().expect("lock").is_empty());
        assert_eq!(d.metrics.activation_requests.get(), 0);
        registry
            .lock()
            .expect("lock")
            .put_service(crate::registry::ServiceSpec {
                namespace: "ns".into(),
                name: "a".into(),
                ports: vec![crate::registry::ServicePort::tcp(80)],
                settings: Default::default(),
            })
            .expect("service");
        let before = Instant::now();
        d.request_activation("ns/a", "n1".into()).await;
        let after = Instant::now();
        d.request_activation("ns/a", "n2".into()).await;
        assert_eq!(d.take_activation_node("ns/a").as_deref(), Some("n2"));
        assert_eq!(d.metrics.activation_requests.get(), 2);
        // The first request's read is kept until the scaling loop takes it.
        let read = d.take_activation_read("ns/a").expect("read recorded");
        assert!(before <= read && read <= after);
        assert_eq!(d.take_activation_read("ns/a"), None);
    }

    #[test]
    fn snapshot_encodings_of_deleted_services_are_dropped() {
        let (registry, d) = distributor(16);
        let names: Vec<String> = (0..20).map(|i| format!("svc-{i}")).collect();
        for name in &names {
            registry
                .lock()
                .expect("lock")
                .put_service(crate::registry::ServiceSpec {
                    namespace: "ns".into(),
                    name: name.clone(),
                    ports: vec![crate::registry::ServicePort::tcp(80)],
                    settings: Default::default(),
                })
                .expect("service");
        }
        let keys: Vec<String> = names.iter().map(|n| format!("ns/{n}")).collect();
        d.resets(&keys);
        assert_eq!(d.resets.lock().expect("lock").len(), 20);
        for key in &keys[1..] {
            registry
                .lock()
                .expect("lock")
                .delete_service(key)
                .expect("deleted");
        }
        d.resets(&keys[..1]);
        assert_eq!(
            d.resets.lock().expect("lock").len(),
            1,
            "only the live one kept"
        );
    }

    /// An activation error is an event of the moment: a subscriber that
    /// resumes later must not get it (it would fail requests held since).
    #[test]
    fn a_resume_does_not_replay_activation_errors() {
        let (registry, d) = distributor(16);
        let watched: BTreeSet<String> = ["ns/a".to_owned()].into();
        let v = registry.lock().expect("lock").next_version();
        d.publish(&delta("ns/a", v), Instant::now());
        d.publish_activation_error("ns/a", "spawn failed");
        let v = registry.lock().expect("lock").next_version();
        d.publish(&delta("ns/a", v), Instant::now());
        let replayed = d.replay(1, &watched).expect("in history");
        assert_eq!(replayed.len(), 1, "only the state change after 1");
        assert!(replayed.iter().all(|e| !e.event));
    }
}
