//! The slice reconciler: packs a service's endpoints into slices of at most
//! `max_endpoints_per_slice`, the way the Kubernetes EndpointSlice
//! controller does (`staging/src/k8s.io/endpointslice/reconciler.go`), so
//! that a change rewrites as few slices as possible — every rewritten slice
//! is sent to every watcher.
//!
//! Invariants (property-tested): no slice holds more than the maximum;
//! every desired endpoint is in exactly one slice; the union of the slices
//! equals the desired set; a change touches only the slices that hold
//! changed endpoints, plus at most the slices needed to place new ones.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use meshless_model::{Endpoint, EndpointId};
use serde::{Deserialize, Serialize};

mod plan;
pub use plan::SlicePlan;

/// Default and bounds of `max_endpoints_per_slice` (Kubernetes: 100, 1..=1000).
pub const DEFAULT_MAX_PER_SLICE: usize = 100;
/// Largest accepted `max_endpoints_per_slice`.
pub const MAX_MAX_PER_SLICE: usize = 1000;

/// One slice: a named group of endpoints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    pub name: String,
    pub endpoints: BTreeMap<EndpointId, Endpoint>,
}

/// What one reconciliation or compaction did, by slice name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SliceChanges {
    pub created: Vec<String>,
    pub updated: Vec<String>,
    pub deleted: Vec<String>,
}

impl SliceChanges {
    /// Slice writes: every created, updated or deleted slice is one object
    /// sent to every watcher.
    pub fn writes(&self) -> usize {
        self.created.len() + self.updated.len() + self.deleted.len()
    }

    /// True when nothing changed.
    pub fn is_empty(&self) -> bool {
        self.writes() == 0
    }
}

/// The slices of one service.
///
/// Invariant: `index` maps every endpoint held by a slice to that slice's
/// name, and nothing else, so finding an endpoint's slice is O(1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceSet {
    /// Name prefix of the slices (the service name).
    prefix: String,
    max_per_slice: usize,
    slices: BTreeMap<String, Slice>,
    /// Suffix of the next new slice name; only grows, so names never repeat.
    next_suffix: u64,
    /// The slice holding each endpoint.
    index: HashMap<EndpointId, String>,
}

impl SliceSet {
    /// An empty set for service `prefix` with at most `max_per_slice`
    /// endpoints per slice (clamped to 1..=1000).
    pub fn new(prefix: impl Into<String>, max_per_slice: usize) -> Self {
        Self {
            prefix: prefix.into(),
            max_per_slice: max_per_slice.clamp(1, MAX_MAX_PER_SLICE),
            slices: BTreeMap::new(),
            next_suffix: 0,
            index: HashMap::new(),
        }
    }

    /// Rebuilds a set from stored slices (name and endpoints). Names seen
    /// are never handed out again: new names continue after `next_suffix`.
    pub fn restore(
        prefix: impl Into<String>,
        max_per_slice: usize,
        next_suffix: u64,
        stored: impl IntoIterator<Item = (String, Vec<Endpoint>)>,
    ) -> Self {
        let mut set = Self::new(prefix, max_per_slice);
        set.next_suffix = next_suffix;
        for (name, endpoints) in stored {
            let endpoints: BTreeMap<EndpointId, Endpoint> =
                endpoints.into_iter().map(|e| (e.id.clone(), e)).collect();
            if !endpoints.is_empty() {
                set.slices.insert(name.clone(), Slice { name, endpoints });
            }
        }
        set.reindex();
        set
    }

    /// Rebuilds `index` from the slices (after a whole-set change).
    fn reindex(&mut self) {
        self.index = self
            .slices
            .values()
            .flat_map(|s| s.endpoints.keys().map(|id| (id.clone(), s.name.clone())))
            .collect();
    }

    /// The suffix the next new slice name will get.
    pub fn next_suffix(&self) -> u64 {
        self.next_suffix
    }

    /// The slices, by name.
    pub fn slices(&self) -> impl Iterator<Item = &Slice> {
        self.slices.values()
    }

    /// The slice named `name`.
    pub fn slice(&self, name: &str) -> Option<&Slice> {
        self.slices.get(name)
    }

    /// Number of slices.
    pub fn len(&self) -> usize {
        self.slices.len()
    }

    /// True when there is no slice.
    pub fn is_empty(&self) -> bool {
        self.slices.is_empty()
    }

    /// The largest number of endpoints per slice.
    pub fn max_per_slice(&self) -> usize {
        self.max_per_slice
    }

    /// The slice holding endpoint `id`.
    pub fn slice_of(&self, id: &EndpointId) -> Option<&str> {
        self.index.get(id).map(String::as_str)
    }

    fn new_name(&mut self) -> String {
        let name = format!("{}-{:05}", self.prefix, self.next_suffix);
        self.next_suffix += 1;
        name
    }

    /// Brings the slices to `desired`, rewriting as few slices as possible.
    /// Reads every slice: O(endpoints). [`SliceSet::plan`] does the same
    /// for a known set of changed endpoints at a cost that follows them.
    pub fn reconcile(&mut self, desired: &BTreeMap<EndpointId, Endpoint>) -> SliceChanges {
        let changes = self.reconcile_all(desired);
        self.reindex();
        changes
    }

    fn reconcile_all(&mut self, desired: &BTreeMap<EndpointId, Endpoint>) -> SliceChanges {
        let max = self.max_per_slice;
        let mut updated: BTreeSet<String> = BTreeSet::new();
        let mut emptied: Vec<String> = Vec::new();
        let mut placed: BTreeSet<EndpointId> = BTreeSet::new();

        // 1. Remove endpoints no longer desired; update changed ones in place.
        for slice in self.slices.values_mut() {
            let before = slice.endpoints.len();
            slice.endpoints.retain(|id, _| desired.contains_key(id));
            // Over the limit (stored under a larger `max_endpoints_per_slice`):
            // the excess is placed again below, like new endpoints.
            while slice.endpoints.len() > max {
                slice.endpoints.pop_last();
            }
            let mut changed = slice.endpoints.len() != before;
            for (id, ep) in slice.endpoints.iter_mut() {
                placed.insert(id.clone());
                if let Some(want) = desired.get(id)
                    && want != ep
                {
                    *ep = want.clone();
                    changed = true;
                }
            }
            if slice.endpoints.is_empty() {
                emptied.push(slice.name.clone());
            } else if changed {
                updated.insert(slice.name.clone());
            }
        }
        let mut remaining: Vec<(&EndpointId, &Endpoint)> = desired
            .iter()
            .filter(|(id, _)| !placed.contains(*id))
            .collect();

        // 2. Fill the slices already being updated, fullest first.
        let mut order: Vec<String> = updated.iter().cloned().collect();
        order.sort_by_key(|n| std::cmp::Reverse(self.slices[n].endpoints.len()));
        for name in &order {
            let slice = self.slices.get_mut(name).expect("listed slice exists");
            while slice.endpoints.len() < max {
                let Some((id, ep)) = remaining.pop() else {
                    break;
                };
                slice.endpoints.insert(id.clone(), ep.clone());
            }
        }

        // 3. Whole new slices for what fills them; the last partial chunk
        //    goes to the unchanged slice that ends closest to full, if one
        //    has room, else to a new slice.
        let mut fresh: Vec<Vec<(&EndpointId, &Endpoint)>> = Vec::new();
        while remaining.len() >= max {
            fresh.push(remaining.split_off(remaining.len() - max));
        }
        if !remaining.is_empty() {
            let need = remaining.len();
            let target = self
                .slices
                .values()
                .filter(|s| !updated.contains(&s.name) && !s.endpoints.is_empty())
                .filter(|s| s.endpoints.len() + need <= max)
                .max_by_key(|s| (s.endpoints.len(), std::cmp::Reverse(s.name.clone())))
                .map(|s| s.name.clone());
            match target {
                Some(name) => {
                    let slice = self.slices.get_mut(&name).expect("slice exists");
                    for (id, ep) in remaining.drain(..) {
                        slice.endpoints.insert(id.clone(), ep.clone());
                    }
                    updated.insert(name);
                }
                None => fresh.push(std::mem::take(&mut remaining)),
            }
        }

        // 4. A slice being deleted and one being created make one update:
        //    the new endpoints reuse the emptied slice's name.
        let mut changes = SliceChanges::default();
        let mut reusable = emptied.into_iter();
        for chunk in fresh {
            let endpoints = chunk
                .into_iter()
                .map(|(id, ep)| (id.clone(), ep.clone()))
                .collect();
            match reusable.next() {
                Some(name) => {
                    let slice = self.slices.get_mut(&name).expect("emptied slice exists");
                    slice.endpoints = endpoints;
                    updated.insert(name);
                }
                None => {
                    let name = self.new_name();
                    self.slices.insert(
                        name.clone(),
                        Slice {
                            name: name.clone(),
                            endpoints,
                        },
                    );
                    changes.created.push(name);
                }
            }
        }
        for name in reusable {
            self.slices.remove(&name);
            changes.deleted.push(name);
        }
        changes.updated = updated.into_iter().collect();
        changes
    }

    /// Merges slices under a quarter full into others with room, when that
    /// saves slices; run when the service has been quiet for a while.
    pub fn compact(&mut self) -> SliceChanges {
        let changes = self.compact_all();
        if !changes.is_empty() {
            self.reindex();
        }
        changes
    }

    fn compact_all(&mut self) -> SliceChanges {
        let max = self.max_per_slice;
        let sparse_limit = max.div_ceil(4);
        let mut sparse: Vec<String> = self
            .slices
            .values()
            .filter(|s| s.endpoints.len() < sparse_limit)
            .map(|s| s.name.clone())
            .collect();
        let total: usize = self.slices.values().map(|s| s.endpoints.len()).sum();
        // Nothing to gain when no slice is sparse or the count is already minimal.
        if sparse.is_empty() || self.slices.len() <= total.div_ceil(max) {
            return SliceChanges::default();
        }
        // Empty the smallest sparse slices first.
        sparse.sort_by_key(|n| (self.slices[n].endpoints.len(), n.clone()));
        let mut changes = SliceChanges::default();
        let mut updated = BTreeSet::new();
        for name in sparse {
            let size = self.slices[&name].endpoints.len();
            // Destination: another slice with room for all of it, fullest first.
            let dest = self
                .slices
                .values()
                .filter(|s| s.name != name && s.endpoints.len() + size <= max)
                .max_by_key(|s| (s.endpoints.len(), std::cmp::Reverse(s.name.clone())))
                .map(|s| s.name.clone());
            let Some(dest) = dest else { continue };
            let moved = std::mem::take(&mut self.slices.get_mut(&name).expect("exists").endpoints);
            self.slices
                .get_mut(&dest)
                .expect("exists")
                .endpoints
                .extend(moved);
            self.slices.remove(&name);
            updated.remove(&name);
            changes.deleted.push(name);
            updated.insert(dest);
        }
        changes.updated = updated.into_iter().collect();
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ep(i: u32, weight: u32) -> (EndpointId, Endpoint) {
        let e = Endpoint::new(
            format!("pod-{i}"),
            std::net::SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 8080)),
        )
        .with_weight(weight);
        (e.id.clone(), e)
    }

    fn desired(ids: impl IntoIterator<Item = u32>) -> BTreeMap<EndpointId, Endpoint> {
        ids.into_iter().map(|i| ep(i, 1)).collect()
    }

    fn check(set: &SliceSet, want: &BTreeMap<EndpointId, Endpoint>) -> Result<(), TestCaseError> {
        let mut seen = BTreeMap::new();
        for s in set.slices() {
            prop_assert!(
                s.endpoints.len() <= set.max_per_slice(),
                "slice {} too big",
                s.name
            );
            prop_assert!(!s.endpoints.is_empty(), "empty slice {}", s.name);
            for (id, e) in &s.endpoints {
                prop_assert!(seen.insert(id.clone(), e.clone()).is_none(), "{} twice", id);
            }
        }
        prop_assert_eq!(&seen, want);
        Ok(())
    }

    proptest! {
        /// Through any sequence of desired sets, the slices stay exact and bounded.
        #[test]
        fn slices_always_partition_the_desired_set(
            max in 1usize..12,
            steps in prop::collection::vec(prop::collection::btree_set(0u32..60, 0..50), 1..12),
            compact_at in prop::collection::vec(any::<bool>(), 12),
        ) {
            let mut set = SliceSet::new("svc", max);
            for (k, ids) in steps.into_iter().enumerate() {
                let want = desired(ids);
                set.reconcile(&want);
                check(&set, &want)?;
                if compact_at[k] {
                    set.compact();
                    check(&set, &want)?;
                }
            }
        }

        /// Changing one endpoint rewrites exactly the one slice holding it.
        #[test]
        fn one_change_touches_one_slice(n in 1u32..300, which in 0u32..300) {
            let mut set = SliceSet::new("svc", 100);
            let mut want = desired(0..n);
            set.reconcile(&want);
            let (id, e) = ep(which % n, 7);
            want.insert(id, e);
            let changes = set.reconcile(&want);
            prop_assert_eq!(changes.writes(), 1);
            prop_assert_eq!(changes.updated.len(), 1);
        }
    }

    #[test]
    fn new_endpoints_prefer_slices_being_updated_then_the_fullest_with_room() {
        let mut set = SliceSet::new("svc", 4);
        let mut want = desired(0..10); // slices of 4, 4, 2
        let c = set.reconcile(&want);
        assert_eq!((c.created.len(), set.len()), (3, 3));
        // Add two: the 2-slice (unchanged) is the only one with room; it ends full.
        want.extend(desired([20, 21]));
        let c = set.reconcile(&want);
        assert_eq!(c.created.len(), 0);
        assert_eq!(c.updated.len(), 1);
        // Remove one and add one in the same pass: the slice being updated takes it.
        want.remove(&ep(0, 1).0);
        want.extend(desired([30]));
        let c = set.reconcile(&want);
        assert_eq!(c.writes(), 1, "{c:?}");
    }

    #[test]
    fn a_delete_paired_with_a_create_becomes_an_update() {
        let mut set = SliceSet::new("svc", 2);
        set.reconcile(&desired([0, 1]));
        // Replace both endpoints: the emptied slice's name is reused.
        let c = set.reconcile(&desired([5, 6]));
        assert_eq!(c.created.len() + c.deleted.len(), 0, "{c:?}");
        assert_eq!(c.updated.len(), 1);
    }

    #[test]
    fn compaction_merges_sparse_slices() {
        let mut set = SliceSet::new("svc", 8);
        let want = desired(0..24); // 3 full slices
        set.reconcile(&want);
        // Remove most endpoints from two slices: they become sparse.
        let keep: BTreeMap<_, _> = want
            .into_iter()
            .filter(|(id, _)| {
                let i: u32 = id.as_str()[4..].parse().unwrap_or(0);
                i < 9 || i == 23
            })
            .collect();
        set.reconcile(&keep);
        let before = set.len();
        let c = set.compact();
        assert!(set.len() < before, "{c:?}");
        assert!(!c.deleted.is_empty());
        let total: usize = set.slices().map(|s| s.endpoints.len()).sum();
        assert_eq!(total, keep.len());
    }
}
