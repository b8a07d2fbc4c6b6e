//! Incremental reconciliation: the slices a known set of changed endpoints
//! rewrites, computed without reading the slices they do not touch, and
//! applied only after the caller has stored them.
//!
//! Invariant (property-tested against [`SliceSet::reconcile`]): for a set
//! whose slices equal the desired endpoints except at the changed ids,
//! `plan` then `apply` leaves exactly the slices and changes the full
//! reconcile would. Cost: O(changed x log + touched slices x slice size +
//! number of slices) — the last term is one pass over slice sizes to find
//! the fullest slice with room, never over endpoints.

use std::collections::{BTreeMap, BTreeSet};

use meshless_model::{Endpoint, EndpointId};

use super::{Slice, SliceChanges, SliceSet};

type Members = BTreeMap<EndpointId, Endpoint>;

/// What one incremental reconcile will write: the new members of every
/// created or updated slice, the deleted slices, and the changes by name.
/// Nothing in the set changes until [`SliceSet::apply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlicePlan {
    /// New members by slice name; `None` deletes the slice.
    writes: BTreeMap<String, Option<Members>>,
    next_suffix: u64,
    pub changes: SliceChanges,
}

impl SlicePlan {
    /// The slices written, with their new members (`None`: deleted).
    pub fn writes(&self) -> impl Iterator<Item = (&str, Option<&Members>)> {
        self.writes.iter().map(|(n, m)| (n.as_str(), m.as_ref()))
    }

    /// The suffix of the next new slice name once applied.
    pub fn next_suffix(&self) -> u64 {
        self.next_suffix
    }

    /// The slice that will hold `id` once applied, if the plan moves or
    /// places it; otherwise look in the set.
    pub fn slice_of(&self, id: &EndpointId) -> Option<&str> {
        self.writes
            .iter()
            .find(|(_, m)| m.as_ref().is_some_and(|m| m.contains_key(id)))
            .map(|(n, _)| n.as_str())
    }
}

impl SliceSet {
    /// Plans the slice writes for `changed` endpoints, each with what is
    /// desired now (`None`: removed), in ascending id order as a
    /// `BTreeSet` yields them. Reads only the slices holding changed ids.
    pub fn plan(&self, changed: &[(&EndpointId, Option<&Endpoint>)]) -> SlicePlan {
        let max = self.max_per_slice;
        let mut touched: BTreeMap<String, Members> = BTreeMap::new();
        let mut changed_slices: BTreeSet<String> = BTreeSet::new();
        let mut remaining: Vec<(&EndpointId, &Endpoint)> = Vec::new();

        // 1. Remove endpoints no longer desired; update changed ones in place.
        for &(id, want) in changed {
            let Some(name) = self.index.get(id) else {
                if let Some(want) = want {
                    remaining.push((id, want));
                }
                continue;
            };
            let members = touched
                .entry(name.clone())
                .or_insert_with(|| self.slices[name].endpoints.clone());
            match want {
                None => {
                    members.remove(id);
                    changed_slices.insert(name.clone());
                }
                Some(want) if members.get(id) != Some(want) => {
                    members.insert(id.clone(), want.clone());
                    changed_slices.insert(name.clone());
                }
                Some(_) => {}
            }
        }
        let emptied: Vec<String> = changed_slices
            .iter()
            .filter(|n| touched[*n].is_empty())
            .cloned()
            .collect();
        let mut updated: BTreeSet<String> = changed_slices
            .into_iter()
            .filter(|n| !touched[n].is_empty())
            .collect();

        // 2. Fill the slices already being updated, fullest first.
        let mut order: Vec<String> = updated.iter().cloned().collect();
        order.sort_by_key(|n| std::cmp::Reverse(touched[n].len()));
        for name in &order {
            let members = touched.get_mut(name).expect("updated slices are touched");
            while members.len() < max {
                let Some((id, ep)) = remaining.pop() else {
                    break;
                };
                members.insert(id.clone(), ep.clone());
            }
        }

        // 3. Whole new slices for what fills them; the last partial chunk
        //    goes to the unchanged slice that ends closest to full.
        let mut fresh: Vec<Vec<(&EndpointId, &Endpoint)>> = Vec::new();
        while remaining.len() >= max {
            fresh.push(remaining.split_off(remaining.len() - max));
        }
        if !remaining.is_empty() {
            match self.fullest_with_room(remaining.len(), &updated, &touched) {
                Some(name) => {
                    let members = touched
                        .entry(name.clone())
                        .or_insert_with(|| self.slices[&name].endpoints.clone());
                    for (id, ep) in remaining.drain(..) {
                        members.insert(id.clone(), ep.clone());
                    }
                    updated.insert(name);
                }
                None => fresh.push(std::mem::take(&mut remaining)),
            }
        }
        self.finish_plan(touched, updated, emptied, fresh)
    }

    /// The slice not being updated, not empty, with room for `need` more,
    /// fullest first (ties: the first name), as the full reconcile picks.
    fn fullest_with_room(
        &self,
        need: usize,
        updated: &BTreeSet<String>,
        touched: &BTreeMap<String, Members>,
    ) -> Option<String> {
        self.slices
            .values()
            .map(|s| {
                let len = touched.get(&s.name).map_or(s.endpoints.len(), |m| m.len());
                (s, len)
            })
            .filter(|(s, len)| {
                !updated.contains(&s.name) && *len > 0 && len + need <= self.max_per_slice
            })
            .max_by_key(|(s, len)| (*len, std::cmp::Reverse(s.name.clone())))
            .map(|(s, _)| s.name.clone())
    }

    /// Step 4: a slice being deleted and one being created make one update
    /// (the new endpoints reuse the emptied slice's name).
    fn finish_plan(
        &self,
        mut touched: BTreeMap<String, Members>,
        mut updated: BTreeSet<String>,
        emptied: Vec<String>,
        fresh: Vec<Vec<(&EndpointId, &Endpoint)>>,
    ) -> SlicePlan {
        let mut changes = SliceChanges::default();
        let mut next_suffix = self.next_suffix;
        let mut reusable = emptied.into_iter();
        let mut writes: BTreeMap<String, Option<Members>> = BTreeMap::new();
        for chunk in fresh {
            let members: Members = chunk
                .into_iter()
                .map(|(id, ep)| (id.clone(), ep.clone()))
                .collect();
            match reusable.next() {
                Some(name) => {
                    touched.insert(name.clone(), members);
                    updated.insert(name);
                }
                None => {
                    let name = format!("{}-{:05}", self.prefix, next_suffix);
                    next_suffix += 1;
                    writes.insert(name.clone(), Some(members));
                    changes.created.push(name);
                }
            }
        }
        for name in reusable {
            writes.insert(name.clone(), None);
            changes.deleted.push(name);
        }
        for name in &updated {
            writes.insert(name.clone(), touched.remove(name));
        }
        changes.updated = updated.into_iter().collect();
        SlicePlan {
            writes,
            next_suffix,
            changes,
        }
    }

    /// Applies a plan made by [`SliceSet::plan`] on this set, unchanged
    /// since. The index changes only for endpoints that join or leave a
    /// slice, not for every member of a rewritten one.
    pub fn apply(&mut self, plan: SlicePlan) {
        for (name, members) in plan.writes {
            let old = self.slices.remove(&name).map(|s| s.endpoints);
            if let Some(old) = &old {
                let gone = old
                    .keys()
                    .filter(|id| members.as_ref().is_none_or(|m| !m.contains_key(*id)));
                for id in gone {
                    if self.index.get(id) == Some(&name) {
                        self.index.remove(id);
                    }
                }
            }
            if let Some(endpoints) = members {
                let joined = endpoints
                    .keys()
                    .filter(|id| old.as_ref().is_none_or(|o| !o.contains_key(*id)));
                for id in joined {
                    self.index.insert(id.clone(), name.clone());
                }
                self.slices.insert(name.clone(), Slice { name, endpoints });
            }
        }
        self.next_suffix = plan.next_suffix;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ep(i: u32, weight: u32) -> Endpoint {
        Endpoint::new(
            format!("pod-{i}"),
            std::net::SocketAddr::from(([10, 0, (i >> 8) as u8, i as u8], 8080)),
        )
        .with_weight(weight)
    }

    proptest! {
        /// Any sequence of changes: plan + apply equals the full reconcile,
        /// slice for slice, change for change, and the index stays exact.
        #[test]
        fn plan_equals_the_full_reconcile(
            max in 1usize..10,
            start in prop::collection::btree_map(0u32..80, 1u32..3, 0..60),
            steps in prop::collection::vec(
                prop::collection::btree_map(0u32..80, prop::option::of(1u32..3), 0..20), 1..8),
        ) {
            let mut want: BTreeMap<EndpointId, Endpoint> =
                start.iter().map(|(i, w)| (ep(*i, *w).id, ep(*i, *w))).collect();
            let mut full = SliceSet::new("svc", max);
            full.reconcile(&want);
            let mut inc = full.clone();
            for step in steps {
                for (i, w) in &step {
                    let id = ep(*i, 1).id;
                    match w {
                        Some(w) => { want.insert(id, ep(*i, *w)); }
                        None => { want.remove(&id); }
                    }
                }
                let ids: BTreeSet<EndpointId> = step.keys().map(|i| ep(*i, 1).id).collect();
                let changed: Vec<(&EndpointId, Option<&Endpoint>)> =
                    ids.iter().map(|id| (id, want.get(id))).collect();
                let plan = inc.plan(&changed);
                let planned = plan.changes.clone();
                inc.apply(plan);
                let expected = full.reconcile(&want);
                prop_assert_eq!(&planned, &expected);
                prop_assert_eq!(&inc.slices, &full.slices);
                prop_assert_eq!(inc.next_suffix, full.next_suffix);
                let mut rebuilt = inc.clone();
                rebuilt.reindex();
                prop_assert_eq!(&inc.index, &rebuilt.index);
            }
        }
    }
}
