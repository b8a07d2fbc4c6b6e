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
//!   view's endpoint ids (`tests/subsets.rs` checks this after any
//!   sequence of changes).
//! - What a subscriber received (its reset, then its filtered deltas)
//!   equals, at every version, the view's endpoints restricted to its
//!   members: a delta carries the members that changed, the ones that came
//!   in (whole), and the ones that went out (removed), nothing else.
//! - Indices: an identity takes the lowest index free in its group and
//!   keeps it while any stream of that identity holds it; the last one to
//!   leave frees it (a returning identity takes the lowest free again,
//!   usually its old one). Indices `0 .. S` with no gap balance load best.
//!
//! Cost: a round's order (endpoints by `(order_key(round, id), id)`) is
//! kept per round in use and updated per added or removed endpoint
//! (binary search, O(N) move), so a delta costs O(rounds x N) for orders
//! plus O(size) per subscriber index, not a sort per subscriber.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use meshless_api::{EncodedPair, v1};
use meshless_model::subset::{order_key, round_and_slot, slot_ranks, slots_per_round};

/// What one subsetted subscriber of a service follows: `size` endpoints,
/// at `index` in the service's group for that size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SubsetKey {
    pub size: u32,
    pub index: u64,
}

/// Per subset key, the encoded delta its subscribers receive for one
/// published delta; a key absent receives nothing (no member changed).
pub type SubsetDeltas = HashMap<SubsetKey, EncodedPair>;

/// The published view of every service and the subset groups on it.
#[derive(Debug, Default)]
pub struct Subsets {
    services: HashMap<String, View>,
}

/// One service as published, with its subset groups.
#[derive(Debug, Default)]
struct View {
    /// The version of the last delta applied.
    version: u64,
    endpoints: BTreeMap<String, v1::Endpoint>,
    settings: Option<v1::ServiceSettings>,
    /// Per round in use: the endpoint ids by `(order_key(round, id), id)`.
    orders: BTreeMap<u64, Vec<(u64, Arc<str>)>>,
    /// Per subset size.
    groups: BTreeMap<u32, Group>,
    /// Per kept round: where the last delta inserted or removed, for
    /// skipping the subsets it cannot have moved.
    touched: BTreeMap<u64, Touched>,
    /// Whether the last delta added or removed an endpoint.
    ids_changed: bool,
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
}

impl Group {
    /// The lowest index no identity holds.
    fn free_index(&self) -> u64 {
        let used: BTreeSet<u64> = self.holders.values().map(|&(i, _)| i).collect();
        (0..).find(|i| !used.contains(i)).unwrap_or(0)
    }
}

impl View {
    fn n(&self) -> usize {
        self.endpoints.len()
    }

    /// Builds the orders of the rounds the held indices need now (`m`
    /// follows the endpoint count) and drops the others.
    fn ensure_rounds(&mut self) {
        let n = self.n();
        let needed: BTreeSet<u64> = self
            .groups
            .iter()
            .flat_map(|(&size, g)| {
                let m = slots_per_round(n, size as usize);
                // A size of N or more takes every endpoint: no order.
                let ordered = (size as usize) < n;
                g.members
                    .keys()
                    .filter(move |_| ordered)
                    .map(move |&i| round_and_slot(i, m).0)
            })
            .collect();
        self.orders.retain(|r, _| needed.contains(r));
        for r in needed {
            if !self.orders.contains_key(&r) {
                let mut order: Vec<(u64, Arc<str>)> = self
                    .endpoints
                    .keys()
                    .map(|id| (order_key(r, id), Arc::from(id.as_str())))
                    .collect();
                order.sort_unstable();
                self.orders.insert(r, order);
            }
        }
    }

    /// The members of `key` in the current view (sorted by id); call after
    /// [`View::ensure_rounds`].
    fn compute(&self, key: SubsetKey) -> Vec<Arc<str>> {
        let (n, size) = (self.n(), key.size as usize);
        if n == 0 || size == 0 {
            return Vec::new();
        }
        if size >= n {
            return self
                .endpoints
                .keys()
                .map(|id| Arc::from(id.as_str()))
                .collect();
        }
        let (round, slot) = round_and_slot(key.index, slots_per_round(n, size));
        let Some(order) = self.orders.get(&round) else {
            return Vec::new();
        };
        let mut out: Vec<Arc<str>> = order
            .get(slot_ranks(slot, n, size))
            .unwrap_or_default()
            .iter()
            .map(|(_, id)| Arc::clone(id))
            .collect();
        out.sort_unstable();
        out
    }

    /// The current members of `key`, sorted by id (none for an unknown
    /// key).
    fn members_of(&self, key: SubsetKey) -> &[Arc<str>] {
        self.groups
            .get(&key.size)
            .and_then(|g| g.members.get(&key.index))
            .map(Vec::as_slice)
            .unwrap_or_default()
    }

    /// Whether the last delta may have changed the members of `key` (else
    /// they are the same): a reset, a change of `m` or of the "size >= N"
    /// case, or an insertion or removal at a rank before the slot's end.
    fn may_move(&self, key: SubsetKey, n_before: usize, reset: bool) -> bool {
        let (n, size) = (self.n(), key.size as usize);
        if reset || slots_per_round(n_before, size) != slots_per_round(n, size) {
            return true;
        }
        if size >= n || size >= n_before {
            return self.ids_changed;
        }
        let (round, slot) = round_and_slot(key.index, slots_per_round(n, size));
        let ranks = slot_ranks(slot, n, size);
        self.touched
            .get(&round)
            .is_some_and(|t| t.moves(ranks.start, ranks.end))
    }

    /// Adds `id` to every kept order (it was not in the view).
    fn order_insert(&mut self, id: &str) {
        for (&r, order) in &mut self.orders {
            let k = (order_key(r, id), Arc::from(id));
            let at = order.binary_search(&k).unwrap_or_else(|at| at);
            order.insert(at, k);
            if let Some(t) = Touched::record(self.touched.get_mut(&r), at, 1) {
                self.touched.insert(r, t);
            }
        }
    }

    /// Removes `id` from every kept order.
    fn order_remove(&mut self, id: &str) {
        for (&r, order) in &mut self.orders {
            let k = (order_key(r, id), Arc::from(id));
            if let Ok(at) = order.binary_search(&k) {
                order.remove(at);
                if let Some(t) = Touched::record(self.touched.get_mut(&r), at, -1) {
                    self.touched.insert(r, t);
                }
            }
        }
    }

    /// Applies a published delta to the endpoints and the orders.
    fn apply_endpoints(&mut self, delta: &v1::Delta) {
        self.version = delta.version;
        self.touched.clear();
        self.ids_changed = delta.reset;
        if delta.reset {
            self.endpoints.clear();
            self.orders.clear();
            self.settings = delta.settings.clone();
        } else if let Some(s) = &delta.settings {
            self.settings = Some(s.clone());
        }
        for e in &delta.upserted {
            if self.endpoints.insert(e.id.clone(), e.clone()).is_none() {
                self.ids_changed = true;
                self.order_insert(&e.id);
            }
        }
        for id in &delta.removed {
            if self.endpoints.remove(id).is_some() {
                self.ids_changed = true;
                self.order_remove(id);
            }
        }
    }

    /// The wire endpoints of `ids` (all in the view).
    fn wire(&self, ids: impl IntoIterator<Item = impl AsRef<str>>) -> Vec<v1::Endpoint> {
        ids.into_iter()
            .filter_map(|id| self.endpoints.get(id.as_ref()).cloned())
            .collect()
    }

    /// A reset holding `members` only.
    fn reset_bytes(&self, service: &str, members: &[Arc<str>]) -> EncodedPair {
        EncodedPair::encode(&v1::Delta {
            version: self.version,
            service: service.to_owned(),
            upserted: self.wire(members),
            removed: Vec::new(),
            reset: true,
            activation_error: String::new(),
            settings: self.settings.clone(),
        })
    }
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
        view.ensure_rounds();
        let mut out = SubsetDeltas::new();
        let keys: Vec<SubsetKey> = view
            .groups
            .iter()
            .flat_map(|(&size, g)| {
                g.members
                    .keys()
                    .map(move |&index| SubsetKey { size, index })
            })
            .collect();
        for key in keys {
            if !view.may_move(key, n_before, delta.reset) {
                // Same members: only changes to them (and settings).
                let members = view.members_of(key);
                if let Some(bytes) = member_delta(view, delta, members, members) {
                    out.insert(key, bytes);
                }
                continue;
            }
            let new = view.compute(key);
            let old = view
                .groups
                .get_mut(&key.size)
                .and_then(|g| g.members.insert(key.index, new.clone()))
                .unwrap_or_default();
            if let Some(bytes) = member_delta(&*view, delta, &old, &new) {
                out.insert(key, bytes);
            }
        }
        Some(out)
    }

    /// `identity` subscribes to a subset of `size` of `service`: returns
    /// its key, the version of the view and a reset holding its members.
    /// Pair with [`Subsets::release`].
    pub fn register(
        &mut self,
        service: &str,
        size: u32,
        identity: &str,
    ) -> (SubsetKey, u64, EncodedPair) {
        let view = self.services.entry(service.to_owned()).or_default();
        let group = view.groups.entry(size).or_default();
        let index = match group.holders.get_mut(identity) {
            Some((index, streams)) => {
                *streams += 1;
                *index
            }
            None => {
                let index = group.free_index();
                group.holders.insert(identity.to_owned(), (index, 1));
                group.members.insert(index, Vec::new());
                index
            }
        };
        let key = SubsetKey { size, index };
        view.ensure_rounds();
        let members = view.compute(key);
        let bytes = view.reset_bytes(service, &members);
        if let Some(g) = view.groups.get_mut(&size) {
            g.members.insert(index, members);
        }
        (key, view.version, bytes)
    }

    /// A reset of `key`'s current members and the view's version (a
    /// subscriber that lagged behind the ring).
    pub fn reset(&self, service: &str, key: SubsetKey) -> (u64, EncodedPair) {
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
        (view.version, view.reset_bytes(service, members))
    }

    /// One stream of `identity` leaves the group of `size` of `service`;
    /// the last one frees the index.
    pub fn release(&mut self, service: &str, size: u32, identity: &str) {
        let Some(view) = self.services.get_mut(service) else {
            return;
        };
        let Some(group) = view.groups.get_mut(&size) else {
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
            view.groups.remove(&size);
        }
        view.ensure_rounds();
        // A view made only because a subscriber named a service that was
        // never published (a typo, a service not created yet): gone with
        // its last group, so unknown names cannot grow the map.
        if view.groups.is_empty() && view.version == 0 && view.endpoints.is_empty() {
            self.services.remove(service);
        }
    }

    /// How many services have a view (tests and diagnostics).
    pub fn services(&self) -> usize {
        self.services.len()
    }

    /// The current members of `key` (tests and diagnostics).
    pub fn members(&self, service: &str, key: SubsetKey) -> Vec<String> {
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
    old: &[Arc<str>],
    new: &[Arc<str>],
) -> Option<EncodedPair> {
    if delta.reset {
        return Some(view.reset_bytes(&delta.service, new));
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
