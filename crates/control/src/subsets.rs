//! Deterministic subsetting in the stream: a subscriber that asks for a
//! subset of `size` endpoints of a service follows only
//! [`meshless_model::subset`]`(endpoints, index, size)` of it, where
//! `index` is the one its identity holds in the service's subset group.
//!
//! # Invariants
//!
//! - The view of a service here is exactly what was published: it changes
//!   only by [`Subsets::apply`] of each published delta, in version order.
//! - For every index held in a group, `members` equals `subset()` of the
//!   ids of the view's endpoints subsets are drawn from: the ready (or
//!   starting) ones that are not terminating, or the serving ones when
//!   there is none of those (`tests/subsets.rs` checks this after any
//!   sequence of changes).
//! - What a subscriber received (its reset, then its filtered deltas)
//!   equals, at every version, the view's endpoints restricted to its
//!   members: a delta carries the members that changed, the ones that came
//!   in (whole), and the ones that went out (removed), nothing else.
//! - Indices: an identity takes the index it asks for (the one it held on
//!   an earlier stream, `SubsetRequest.index`) when no other identity
//!   holds it, else the lowest index free in its group, and keeps it while
//!   any stream of that identity holds it; the last one to leave frees it.
//!   A plane restart forgets every index, and proxies that reconnect in
//!   any order get their old ones back (no reshuffle). Indices `0 .. S`
//!   with no gap balance load best: asked-for indices keep the density
//!   they had when handed out, and new identities fill gaps first.
//!
//! Cost: a round's order (endpoints by `(order_key(round, id), id)`) is
//! kept per round in use and updated per added or removed endpoint
//! (binary search, O(N) move), so a delta costs O(rounds x N) for orders
//! plus O(size) per subscriber index, not a sort per subscriber.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Range;
use std::sync::Arc;

use meshless_api::{EncodedPair, v1};
use meshless_model::subset::{
    fallback_index, next_slots, order_key, ranked, round_and_slot, slot_ranks, slots_per_round,
};

/// What one subsetted subscriber of a service follows: `size` endpoints,
/// at `index` in the service's group for that size (and zone, for a
/// zone-aware subset: `index` then numbers the zone's subscribers).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SubsetKey {
    pub size: u32,
    /// The subscriber's zone, for a subset that prefers it.
    pub zone: Option<Arc<str>>,
    pub index: u64,
}

impl SubsetKey {
    fn group(&self) -> GroupKey {
        (self.size, self.zone.clone())
    }
}

/// A group of subscribers sharing indices: subset size and zone.
type GroupKey = (u32, Option<Arc<str>>);

/// Per subset key, the encoded delta its subscribers receive for one
/// published delta; a key absent receives nothing (no member changed).
pub type SubsetDeltas = HashMap<SubsetKey, EncodedPair>;

/// The published view of every service and the subset groups on it.
#[derive(Debug, Default)]
pub struct Subsets {
    services: HashMap<String, View>,
}

/// Which endpoints of the view an order ranks.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Scope {
    /// Every endpoint.
    All,
    /// The endpoints of one zone.
    In(Arc<str>),
    /// The endpoints of every other zone.
    Out(Arc<str>),
}

impl Scope {
    fn holds(&self, zone: &str) -> bool {
        match self {
            Scope::All => true,
            Scope::In(z) => **z == *zone,
            Scope::Out(z) => **z != *zone,
        }
    }
}

/// One round's order of a scope's endpoint ids: by `(order_key(round, id),
/// id)`.
type Order = Vec<(u64, Arc<str>)>;

/// Where some of a key's members come from in the current view.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    /// Every endpoint of the scope.
    Every(Scope),
    /// Ranks of one round's order of the scope.
    Ranks {
        scope: Scope,
        round: u64,
        ranks: Range<usize>,
    },
}

/// One service as published, with its subset groups.
#[derive(Debug, Default)]
struct View {
    /// The version of the last delta applied.
    version: u64,
    /// The endpoints subsets are drawn from ([`in_subsets`]): the ready
    /// ones and those still starting, or while there is none of those,
    /// the serving ones (terminating but still serving).
    endpoints: BTreeMap<String, v1::Endpoint>,
    /// The others: in no subset until the rule takes them.
    waiting: BTreeMap<String, v1::Endpoint>,
    /// No endpoint is ready or starting: subsets are drawn from the
    /// serving ones (a proxy uses a terminating endpoint that still
    /// serves when it has no ready one).
    serving_fallback: bool,
    /// Endpoint ids per zone (every endpoint is in exactly one, `""` for
    /// none).
    zones: HashMap<Arc<str>, BTreeSet<Arc<str>>>,
    settings: Option<v1::ServiceSettings>,
    /// Per round and scope in use: the scope's endpoint ids by
    /// `(order_key(round, id), id)`.
    orders: BTreeMap<(u64, Scope), Order>,
    /// Per subset size and zone.
    groups: BTreeMap<GroupKey, Group>,
    /// Per kept order: where the last delta inserted or removed, for
    /// skipping the subsets it cannot have moved.
    touched: BTreeMap<(u64, Scope), Touched>,
    /// Whether the last delta added or removed an endpoint (or moved one
    /// to another zone).
    ids_changed: bool,
    /// The zones whose endpoint set the last delta changed.
    zones_changed: BTreeSet<Arc<str>>,
}

/// The insertions and removals of one delta in one round's order, each
/// at its rank in the order as it was then.
///
/// Ranks below `low` kept their endpoint. After exactly one insertion and
/// one removal (a replacement), both below rank `s`, every rank from `s` on
/// also kept its endpoint: an insertion at `p` moves ranks `>= p` up by
/// one, a removal at `p` moves ranks `> p` down by one; in either order,
/// an endpoint at `r >= s` is moved by both and one below `s` stays below
/// it. (With more operations an endpoint can be moved by some and not by
/// others, so the shortcut is for the one-in-one-out case only.)
#[derive(Debug, Clone, Copy)]
struct Touched {
    low: usize,
    high: usize,
    net: i64,
    ops: u32,
}

impl Touched {
    fn record(slot: Option<&mut Self>, at: usize, step: i64) -> Option<Self> {
        match slot {
            Some(t) => {
                t.low = t.low.min(at);
                t.high = t.high.max(at);
                t.net += step;
                t.ops += 1;
                None
            }
            None => Some(Self {
                low: at,
                high: at,
                net: step,
                ops: 1,
            }),
        }
    }

    /// Whether the ranks `start .. end` may hold other endpoints now.
    fn moves(&self, start: usize, end: usize) -> bool {
        let replaced_before = self.ops == 2 && self.net == 0 && self.high < start;
        let unchanged = self.low >= end || replaced_before;
        !unchanged
    }
}

/// The subscribers of one service asking for one subset size.
#[derive(Debug, Default)]
struct Group {
    /// Identity -> (index, streams holding it).
    holders: HashMap<String, (u64, usize)>,
    /// Index -> its current members, sorted by id.
    members: BTreeMap<u64, Vec<Arc<str>>>,
    /// Subsets per round of the group's own scope (every endpoint, or the
    /// zone's for a zone-aware group), kept by
    /// [`meshless_model::subset::next_slots`] so that `N` going back and
    /// forth across a multiple of the size does not regroup subscribers.
    slots: u64,
    /// Whether the last delta changed `slots`.
    slots_moved: bool,
}

/// The highest index a subscriber may ask for back: an index costs one
/// round's order of the endpoints, so a stream cannot make the plane keep
/// arbitrarily many.
pub const MAX_ASKED_INDEX: u64 = 1 << 16;

impl Group {
    /// `wanted` when no identity holds it (and it is at most
    /// [`MAX_ASKED_INDEX`]), else the lowest index no identity holds.
    fn free_index(&self, wanted: Option<u64>) -> u64 {
        let used: BTreeSet<u64> = self.holders.values().map(|&(i, _)| i).collect();
        if let Some(w) = wanted.filter(|w| *w <= MAX_ASKED_INDEX && !used.contains(w)) {
            return w;
        }
        (0..).find(|i| !used.contains(i)).unwrap_or(0)
    }
}

impl View {
    fn n(&self) -> usize {
        self.endpoints.len()
    }

    /// Endpoints in `zone`.
    fn n_in(&self, zone: &str) -> usize {
        self.zones.get(zone).map_or(0, BTreeSet::len)
    }

    /// Endpoints in the scope a group ranks: the zone's for a zone-aware
    /// group, else every one.
    fn n_of_group(&self, zone: Option<&Arc<str>>) -> usize {
        zone.map_or(self.n(), |z| self.n_in(z))
    }

    /// The kept subsets per round of `key`'s group (none for an unknown
    /// group: then `⌊n/size⌋`).
    fn slots_of(&self, key: &SubsetKey) -> Option<u64> {
        self.groups.get(&key.group()).map(|g| g.slots)
    }

    /// Moves every group's kept `m` after a delta (see
    /// [`meshless_model::subset::next_slots`]).
    fn update_slots(&mut self) {
        let counts: Vec<usize> = self
            .groups
            .keys()
            .map(|(_, zone)| self.n_of_group(zone.as_ref()))
            .collect();
        for (((size, _), g), n) in self.groups.iter_mut().zip(counts) {
            let slots = next_slots(Some(g.slots), n, *size as usize);
            g.slots_moved = slots != g.slots;
            g.slots = slots;
        }
    }

    /// `size` of the `n` endpoints of `scope` for subscriber `index`, with
    /// `slots` subsets per round (`None`: `⌊n/size⌋`).
    fn part(scope: Scope, n: usize, size: usize, index: u64, slots: Option<u64>) -> Part {
        if size >= n {
            return Part::Every(scope);
        }
        let slots = slots.unwrap_or_else(|| slots_per_round(n, size));
        let (round, slot) = round_and_slot(index, slots);
        Part::Ranks {
            scope,
            round,
            ranks: slot_ranks(slot, n, size),
        }
    }

    /// Where `key`'s members come from now: [`meshless_model::subset`] over
    /// every endpoint, or, for a zone-aware key,
    /// [`meshless_model::subset::zone_subset`]: the zone's endpoints alone
    /// when they are at least `size`, else all of them and a subset of the
    /// rest.
    fn parts(&self, key: &SubsetKey) -> Vec<Part> {
        let (n, size) = (self.n(), key.size as usize);
        if n == 0 || size == 0 {
            return Vec::new();
        }
        let zone = match &key.zone {
            Some(z) if size < n && self.n_in(z) > 0 => z,
            Some(z) => {
                let index = fallback_index(z, key.index);
                return vec![Self::part(Scope::All, n, size, index, None)];
            }
            None => {
                let slots = self.slots_of(key);
                return vec![Self::part(Scope::All, n, size, key.index, slots)];
            }
        };
        let local = self.n_in(zone);
        if local >= size {
            let slots = self.slots_of(key);
            return vec![Self::part(
                Scope::In(zone.clone()),
                local,
                size,
                key.index,
                slots,
            )];
        }
        vec![
            Part::Every(Scope::In(zone.clone())),
            Self::part(
                Scope::Out(zone.clone()),
                n - local,
                size - local,
                fallback_index(zone, key.index),
                None,
            ),
        ]
    }

    /// Every subset key of the view's groups.
    fn keys(&self) -> Vec<SubsetKey> {
        self.groups
            .iter()
            .flat_map(|((size, zone), g)| {
                g.members.keys().map(move |&index| SubsetKey {
                    size: *size,
                    zone: zone.clone(),
                    index,
                })
            })
            .collect()
    }

    /// Builds the orders the held indices need now (rounds follow the
    /// endpoint counts) and drops the others.
    fn ensure_rounds(&mut self) {
        let needed: BTreeSet<(u64, Scope)> = self
            .keys()
            .iter()
            .flat_map(|key| self.parts(key))
            .filter_map(|part| match part {
                Part::Ranks { scope, round, .. } => Some((round, scope)),
                Part::Every(_) => None,
            })
            .collect();
        self.orders.retain(|k, _| needed.contains(k));
        for (round, scope) in needed {
            if self.orders.contains_key(&(round, scope.clone())) {
                continue;
            }
            let mut order: Order = self
                .endpoints
                .iter()
                .filter(|(_, e)| scope.holds(&e.zone))
                .map(|(id, _)| (order_key(round, id), Arc::from(id.as_str())))
                .collect();
            order.sort_unstable();
            self.orders.insert((round, scope), order);
        }
    }

    /// The members of `key` in the current view (sorted by id); call after
    /// [`View::ensure_rounds`].
    fn compute(&self, key: &SubsetKey) -> Vec<Arc<str>> {
        let mut out: Vec<Arc<str>> = Vec::new();
        for part in self.parts(key) {
            match part {
                Part::Every(Scope::In(z)) => {
                    out.extend(self.zones.get(&z).into_iter().flatten().cloned());
                }
                Part::Every(scope) => out.extend(
                    self.endpoints
                        .iter()
                        .filter(|(_, e)| scope.holds(&e.zone))
                        .map(|(id, _)| Arc::from(id.as_str())),
                ),
                Part::Ranks {
                    scope,
                    round,
                    ranks,
                } => {
                    if let Some(order) = self.orders.get(&(round, scope)) {
                        out.extend(ranked(order, ranks).map(|(_, id)| Arc::clone(id)));
                    }
                }
            }
        }
        out.sort_unstable();
        out
    }

    /// The current members of `key`, sorted by id (none for an unknown
    /// key).
    fn members_of(&self, key: &SubsetKey) -> &[Arc<str>] {
        self.groups
            .get(&key.group())
            .and_then(|g| g.members.get(&key.index))
            .map(Vec::as_slice)
            .unwrap_or_default()
    }

    /// Whether the last delta may have changed the members of `key` (else
    /// they are the same): a reset, a change of the group's kept `m` or of
    /// the "size >= N" case, an insertion or removal at a rank before the
    /// slot's end, or any change to a slot that wraps around its round.
    /// A zone-aware key whose zone holds at least `size` endpoints moves
    /// only when that zone's set changed; one whose zone holds fewer, when
    /// any set changed.
    fn may_move(&self, key: &SubsetKey, n_before: usize, reset: bool) -> bool {
        let (n, size) = (self.n(), key.size as usize);
        if reset {
            return true;
        }
        if let Some(zone) = &key.zone {
            let local_kept = !self.zones_changed.contains(zone) && self.n_in(zone) >= size;
            return self.ids_changed && !local_kept;
        }
        let Some(group) = self.groups.get(&key.group()) else {
            return true;
        };
        if group.slots_moved {
            return true;
        }
        if size >= n || size >= n_before {
            return self.ids_changed;
        }
        let (round, slot) = round_and_slot(key.index, group.slots);
        let ranks = slot_ranks(slot, n, size);
        if ranks.end > n.min(n_before) {
            // Wraps (now or before): its first ranks move with any change.
            return self.ids_changed;
        }
        self.touched
            .get(&(round, Scope::All))
            .is_some_and(|t| t.moves(ranks.start, ranks.end))
    }

    /// Adds `id` of `zone` to every kept order of a scope holding it (it
    /// was not in the view).
    fn order_insert(&mut self, id: &str, zone: &str) {
        self.ids_changed = true;
        let zone: Arc<str> = Arc::from(zone);
        let id: Arc<str> = Arc::from(id);
        self.zones
            .entry(zone.clone())
            .or_default()
            .insert(id.clone());
        self.zones_changed.insert(zone.clone());
        for ((r, scope), order) in &mut self.orders {
            if !scope.holds(&zone) {
                continue;
            }
            let k = (order_key(*r, &id), id.clone());
            let at = order.binary_search(&k).unwrap_or_else(|at| at);
            order.insert(at, k);
            let tk = (*r, scope.clone());
            if let Some(t) = Touched::record(self.touched.get_mut(&tk), at, 1) {
                self.touched.insert(tk, t);
            }
        }
    }

    /// Removes `id` of `zone` from every kept order.
    fn order_remove(&mut self, id: &str, zone: &str) {
        self.ids_changed = true;
        if let Some(ids) = self.zones.get_mut(zone) {
            ids.remove(id);
            if ids.is_empty() {
                self.zones.remove(zone);
            }
        }
        self.zones_changed.insert(Arc::from(zone));
        for ((r, scope), order) in &mut self.orders {
            if !scope.holds(zone) {
                continue;
            }
            let k = (order_key(*r, id), Arc::from(id));
            if let Ok(at) = order.binary_search(&k) {
                order.remove(at);
                let tk = (*r, scope.clone());
                if let Some(t) = Touched::record(self.touched.get_mut(&tk), at, -1) {
                    self.touched.insert(tk, t);
                }
            }
        }
    }

    /// Applies a published delta to the endpoints and the orders.
    fn apply_endpoints(&mut self, delta: &v1::Delta) {
        self.version = delta.version;
        self.touched.clear();
        self.zones_changed.clear();
        self.ids_changed = delta.reset;
        if delta.reset {
            self.endpoints.clear();
            self.waiting.clear();
            self.zones.clear();
            self.orders.clear();
            self.settings = delta.settings.clone();
        } else if let Some(s) = &delta.settings {
            self.settings = Some(s.clone());
        }
        for e in &delta.upserted {
            if !in_subsets(e, self.serving_fallback) {
                // Out of every subset until it is ready again.
                self.waiting.insert(e.id.clone(), e.clone());
                if let Some(old) = self.endpoints.remove(&e.id) {
                    self.order_remove(&e.id, &old.zone);
                }
                continue;
            }
            self.waiting.remove(&e.id);
            match self.endpoints.insert(e.id.clone(), e.clone()) {
                None => self.order_insert(&e.id, &e.zone),
                // Moved to another zone: out of the old zone's orders,
                // into the new one's (the whole order keeps its place).
                Some(old) if old.zone != e.zone => {
                    self.order_remove(&e.id, &old.zone);
                    self.order_insert(&e.id, &e.zone);
                }
                Some(_) => {}
            }
        }
        for id in &delta.removed {
            self.waiting.remove(id);
            if let Some(old) = self.endpoints.remove(id) {
                self.order_remove(id, &old.zone);
            }
        }
        self.update_fallback();
    }

    /// Moves to the serving fallback when no endpoint is ready or
    /// starting any more, and back when one is: the endpoints the new rule
    /// takes come in, the ones it leaves go out (each as if added or
    /// removed). Every ready or starting endpoint is in `endpoints` under
    /// either rule (`waiting` never holds one), and outside the fallback
    /// `endpoints` holds nothing else: so outside it the check is whether
    /// `endpoints` is empty, and only under it (rare) a scan.
    fn update_fallback(&mut self) {
        let fallback = if self.serving_fallback {
            !self.endpoints.values().any(|e| in_subsets(e, false))
        } else {
            self.endpoints.is_empty()
        };
        if fallback == self.serving_fallback {
            return;
        }
        self.serving_fallback = fallback;
        let leaving: Vec<v1::Endpoint> = self
            .endpoints
            .values()
            .filter(|e| !in_subsets(e, fallback))
            .cloned()
            .collect();
        for e in leaving {
            self.endpoints.remove(&e.id);
            self.order_remove(&e.id, &e.zone);
            self.waiting.insert(e.id.clone(), e);
        }
        let coming: Vec<v1::Endpoint> = self
            .waiting
            .values()
            .filter(|e| in_subsets(e, fallback))
            .cloned()
            .collect();
        for e in coming {
            self.waiting.remove(&e.id);
            self.order_insert(&e.id, &e.zone);
            self.endpoints.insert(e.id.clone(), e);
        }
    }

    /// The wire endpoints of `ids` (all in the view).
    fn wire(&self, ids: impl IntoIterator<Item = impl AsRef<str>>) -> Vec<v1::Endpoint> {
        ids.into_iter()
            .filter_map(|id| self.endpoints.get(id.as_ref()).cloned())
            .collect()
    }

    /// A reset holding `members` only, for the subscriber at `index`.
    fn reset_bytes(&self, service: &str, members: &[Arc<str>], index: u64) -> EncodedPair {
        EncodedPair::encode(&v1::Delta {
            version: self.version,
            service: service.to_owned(),
            upserted: self.wire(members),
            removed: Vec::new(),
            reset: true,
            activation_error: String::new(),
            settings: self.settings.clone(),
            subset_index: Some(index),
        })
    }
}

/// Whether subsets are drawn from `e`: ready, or still starting (a proxy
/// holding requests for a service at zero may probe it), and not
/// terminating; under the `serving_fallback` (no such endpoint in the
/// service), serving. A not-ready or terminating endpoint (a pod failing
/// its readiness probe, one on its way out in a rolling update) leaves
/// every subset that held it, and another takes its place, as if it were
/// removed; it comes back as if added once ready.
fn in_subsets(e: &v1::Endpoint, serving_fallback: bool) -> bool {
    ((e.ready || e.starting) && !e.terminating) || (serving_fallback && e.serving)
}

/// Whether sorted `ids` holds `id`.
fn holds(ids: &[Arc<str>], id: &str) -> bool {
    ids.binary_search_by(|m| m.as_ref().cmp(id)).is_ok()
}

impl Subsets {
    /// Sets the view of `service` (at start, from the registry).
    pub fn seed(
        &mut self,
        service: &str,
        version: u64,
        endpoints: Vec<v1::Endpoint>,
        settings: Option<v1::ServiceSettings>,
    ) {
        let delta = v1::Delta {
            version,
            service: service.to_owned(),
            upserted: endpoints,
            reset: true,
            settings,
            ..v1::Delta::default()
        };
        self.apply(&delta);
    }

    /// Applies a published delta; returns what each subset key receives,
    /// or `None` when the service has no subset subscriber or every
    /// subscriber gets the delta as it is (an activation error, which
    /// carries no endpoint).
    pub fn apply(&mut self, delta: &v1::Delta) -> Option<SubsetDeltas> {
        if !delta.activation_error.is_empty() {
            return None;
        }
        let view = self.services.entry(delta.service.clone()).or_default();
        let n_before = view.n();
        view.apply_endpoints(delta);
        if view.groups.is_empty() {
            // No subset subscriber: nothing per key (one registering
            // later starts from a reset above this version).
            return None;
        }
        view.update_slots();
        view.ensure_rounds();
        let mut out = SubsetDeltas::new();
        for key in view.keys() {
            if !view.may_move(&key, n_before, delta.reset) {
                // Same members: only changes to them (and settings).
                let members = view.members_of(&key);
                if let Some(bytes) = member_delta(view, delta, &key, members, members) {
                    out.insert(key, bytes);
                }
                continue;
            }
            let new = view.compute(&key);
            let old = view
                .groups
                .get_mut(&key.group())
                .and_then(|g| g.members.insert(key.index, new.clone()))
                .unwrap_or_default();
            if let Some(bytes) = member_delta(&*view, delta, &key, &old, &new) {
                out.insert(key, bytes);
            }
        }
        Some(out)
    }

    /// `identity` subscribes to a subset of `size` of `service` (preferring
    /// `zone` when given): returns its key, the version of the view and a
    /// reset holding its members. Pair with [`Subsets::release`].
    pub fn register(
        &mut self,
        service: &str,
        size: u32,
        zone: Option<&str>,
        identity: &str,
    ) -> (SubsetKey, u64, EncodedPair) {
        self.register_asking(service, size, zone, identity, None)
    }

    /// [`Subsets::register`], asking for index `wanted` (the one `identity`
    /// held on an earlier stream): given when no other identity holds it.
    /// An identity that holds an index already keeps it.
    pub fn register_asking(
        &mut self,
        service: &str,
        size: u32,
        zone: Option<&str>,
        identity: &str,
        wanted: Option<u64>,
    ) -> (SubsetKey, u64, EncodedPair) {
        let view = self.services.entry(service.to_owned()).or_default();
        let zone: Option<Arc<str>> = zone.filter(|z| !z.is_empty()).map(Arc::from);
        let n = view.n_of_group(zone.as_ref());
        let group = view
            .groups
            .entry((size, zone.clone()))
            .or_insert_with(|| Group {
                slots: next_slots(None, n, size as usize),
                ..Group::default()
            });
        let index = match group.holders.get_mut(identity) {
            Some((index, streams)) => {
                *streams += 1;
                *index
            }
            None => {
                let index = group.free_index(wanted);
                group.holders.insert(identity.to_owned(), (index, 1));
                group.members.insert(index, Vec::new());
                index
            }
        };
        let key = SubsetKey { size, zone, index };
        view.ensure_rounds();
        let members = view.compute(&key);
        let bytes = view.reset_bytes(service, &members, index);
        if let Some(g) = view.groups.get_mut(&key.group()) {
            g.members.insert(index, members);
        }
        (key, view.version, bytes)
    }

    /// A reset of `key`'s current members and the view's version (a
    /// subscriber that lagged behind the ring).
    pub fn reset(&self, service: &str, key: &SubsetKey) -> (u64, EncodedPair) {
        let Some(view) = self.services.get(service) else {
            return (
                0,
                EncodedPair::encode(&v1::Delta {
                    service: service.to_owned(),
                    reset: true,
                    ..v1::Delta::default()
                }),
            );
        };
        let members = view.members_of(key);
        (view.version, view.reset_bytes(service, members, key.index))
    }

    /// One stream of `identity` leaves the group of `key` of `service`;
    /// the last one frees the index.
    pub fn release(&mut self, service: &str, key: &SubsetKey, identity: &str) {
        let Some(view) = self.services.get_mut(service) else {
            return;
        };
        let Some(group) = view.groups.get_mut(&key.group()) else {
            return;
        };
        if let Some((index, streams)) = group.holders.get_mut(identity) {
            *streams -= 1;
            if *streams == 0 {
                let index = *index;
                group.holders.remove(identity);
                group.members.remove(&index);
            }
        }
        if group.holders.is_empty() {
            view.groups.remove(&key.group());
        }
        view.ensure_rounds();
        // A view made only because a subscriber named a service that was
        // never published (a typo, a service not created yet): gone with
        // its last group, so unknown names cannot grow the map.
        if view.groups.is_empty()
            && view.version == 0
            && view.endpoints.is_empty()
            && view.waiting.is_empty()
        {
            self.services.remove(service);
        }
    }

    /// How many services have a view (tests and diagnostics).
    pub fn services(&self) -> usize {
        self.services.len()
    }

    /// The current members of `key` (tests and diagnostics).
    pub fn members(&self, service: &str, key: &SubsetKey) -> Vec<String> {
        self.services
            .get(service)
            .map(|v| v.members_of(key).iter().map(|id| id.to_string()).collect())
            .unwrap_or_default()
    }
}

/// The delta a subscriber whose members went from `old` to `new` receives
/// for `delta` (applied to `view` already), or `None` when nothing of it
/// concerns that subscriber.
fn member_delta(
    view: &View,
    delta: &v1::Delta,
    key: &SubsetKey,
    old: &[Arc<str>],
    new: &[Arc<str>],
) -> Option<EncodedPair> {
    if delta.reset {
        return Some(view.reset_bytes(&delta.service, new, key.index));
    }
    let removed: Vec<String> = old
        .iter()
        .filter(|id| !holds(new, id))
        .map(|id| id.to_string())
        .collect();
    // Members that came in (whole), then members the delta changed.
    let mut ids: BTreeSet<&str> = new
        .iter()
        .filter(|id| !holds(old, id))
        .map(AsRef::as_ref)
        .collect();
    ids.extend(
        delta
            .upserted
            .iter()
            .map(|e| e.id.as_str())
            .filter(|id| holds(new, id)),
    );
    if ids.is_empty() && removed.is_empty() && delta.settings.is_none() {
        return None;
    }
    Some(EncodedPair::encode(&v1::Delta {
        version: delta.version,
        service: delta.service.clone(),
        upserted: view.wire(ids),
        removed,
        reset: false,
        activation_error: String::new(),
        settings: delta.settings.clone(),
        subset_index: None,
    }))
}

#[cfg(test)]
mod tests {
    use super::Touched;
    use proptest::prelude::*;

    /// Two removals, then two insertions, all below rank 5 and netting to
    /// zero, still move rank 5 (the endpoint there goes to rank 3): only
    /// one-in-one-out may skip the windows after it.
    #[test]
    fn more_than_one_replacement_moves_the_windows_after_it() {
        let mut t = Touched::record(None, 0, -1).expect("first");
        for (at, step) in [(0, -1), (4, 1), (4, 1)] {
            assert!(Touched::record(Some(&mut t), at, step).is_none());
        }
        assert!(t.moves(5, 7));
        let one_in_one_out = {
            let mut t = Touched::record(None, 1, -1).expect("first");
            let _ = Touched::record(Some(&mut t), 3, 1);
            t
        };
        assert!(!one_in_one_out.moves(5, 7));
        assert!(one_in_one_out.moves(2, 4));
    }

    proptest! {
        /// Brute force: after one insertion and one removal (in either
        /// order), or any other operations, every window `Touched` calls unmoved
        /// holds the same values as before.
        #[test]
        fn a_window_called_unmoved_holds_the_same_endpoints(
            n in 1usize..30,
            ops in proptest::collection::vec((any::<bool>(), any::<prop::sample::Index>()), 1..5),
            start in 0usize..30,
            len in 1usize..10,
        ) {
            let mut order: Vec<u32> = (0..n as u32).collect();
            let before = order.clone();
            let mut touched: Option<Touched> = None;
            for (i, (insert, at)) in ops.iter().enumerate() {
                let (pos, step) = if *insert || order.is_empty() {
                    let pos = at.index(order.len() + 1);
                    order.insert(pos, 1000 + i as u32);
                    (pos, 1)
                } else {
                    let pos = at.index(order.len());
                    order.remove(pos);
                    (pos, -1)
                };
                if let Some(t) = Touched::record(touched.as_mut(), pos, step) {
                    touched = Some(t);
                }
            }
            let t = touched.expect("an operation");
            let end = start + len;
            if !t.moves(start, end) {
                prop_assert_eq!(before.get(start..end.min(before.len())), order.get(start..end.min(order.len())));
            }
        }
    }
}
