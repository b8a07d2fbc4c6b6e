//! What subsetting ([`meshless_model::subset`]) saves on the wire: how many
//! subscribers of `0 .. nodes` receive a message when one endpoint changes
//! and during a rolling update, counted from the real assignment (ranks of
//! the endpoints in every round), not from an average.
//!
//! A subscriber receives a message exactly when its subset is touched: the
//! changed endpoint is a member, or a replacement moves its slot's members
//! (one member out, one in; see the churn property of the subset module).

use meshless_model::subset::{order_key, slot_ranks, slots_per_round};

/// `(rounds, slots per round)` for `nodes` subscribers over `n` endpoints.
fn layout(nodes: u64, n: usize, size: usize) -> (u64, u64) {
    let m = slots_per_round(n, size);
    (nodes.div_ceil(m), m)
}

/// Slots of round `round` that have a subscriber: `m`, or fewer in the last.
fn slots_in_round(round: u64, m: u64, nodes: u64) -> u64 {
    nodes.saturating_sub(round * m).min(m)
}

/// Subscribers of `0 .. nodes` whose subset (of `size` among `ids`, distinct)
/// holds `ids[which]`.
pub fn holders(ids: &[String], which: usize, nodes: u64, size: usize) -> u64 {
    let (n, target) = (ids.len(), &ids[which]);
    let (rounds, m) = layout(nodes, n, size);
    let mut count = 0;
    for r in 0..rounds {
        let key = (order_key(r, target), target.as_str());
        let rank = ids
            .iter()
            .filter(|id| (order_key(r, id), id.as_str()) < key)
            .count();
        let hit = (0..slots_in_round(r, m, nodes)).any(|j| slot_ranks(j, n, size).contains(&rank));
        count += u64::from(hit);
    }
    count
}

/// Subscriber-messages of a rolling update that replaces `old[t]` by `new[t]`
/// for `t` in order (one delta per step; `N` stays `old.len()`). Ids are
/// distinct across `old` and `new`.
pub fn rolling_update_messages(old: &[String], new: &[String], nodes: u64, size: usize) -> u64 {
    let n = old.len();
    let (rounds, m) = layout(nodes, n, size);
    let span = size.min(n).max(1);
    let mut messages = 0;
    for r in 0..rounds {
        // Every id, old and new, at its place in round r's order.
        let mut all: Vec<(u64, &str, usize)> = old
            .iter()
            .chain(new)
            .enumerate()
            .map(|(i, id)| (order_key(r, id), id.as_str(), i))
            .collect();
        all.sort_unstable();
        let mut place = vec![0; all.len()];
        for (pos, &(_, _, i)) in all.iter().enumerate() {
            place[i] = pos;
        }
        let mut present = Fenwick::new(all.len());
        for &pos in &place[..n] {
            present.add(pos, 1);
        }
        let slots = slots_in_round(r, m, nodes);
        for t in 0..n.min(new.len()) {
            let p = present.prefix(place[t]);
            present.add(place[t], -1);
            let q = present.prefix(place[n + t]);
            present.add(place[n + t], 1);
            // A slot is touched unless both ranks are before it or both after.
            let first = (p.min(q) / span) as u64;
            let last = ((p.max(q) / span) as u64).min(slots.saturating_sub(1));
            if first < slots {
                messages += last - first + 1;
            }
        }
    }
    messages
}

/// Counts present positions: `prefix(i)` = how many present before `i`.
struct Fenwick(Vec<i64>);

impl Fenwick {
    fn new(len: usize) -> Self {
        Self(vec![0; len + 1])
    }

    fn add(&mut self, pos: usize, delta: i64) {
        let mut i = pos + 1;
        while i < self.0.len() {
            self.0[i] += delta;
            i += i & i.wrapping_neg();
        }
    }

    fn prefix(&self, pos: usize) -> usize {
        let (mut i, mut sum) = (pos, 0);
        while i > 0 {
            sum += self.0[i];
            i -= i & i.wrapping_neg();
        }
        sum.max(0) as usize
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::BTreeSet;

    use meshless_model::subset::subset;
    use proptest::prelude::*;

    use super::*;

    fn names(prefix: &str, n: usize) -> Vec<String> {
        (0..n).map(|i| format!("{prefix}-{i}")).collect()
    }

    proptest! {
        /// The fast counts equal brute force: every subscriber's subset
        /// computed before and after each step, and compared.
        #[test]
        fn counts_match_brute_force(n in 1usize..30, size in 1usize..12, nodes in 1u64..40) {
            let (old, new) = (names("old", n), names("new", n));
            let mut current = old.clone();
            let mut brute = 0;
            for t in 0..n {
                let before: Vec<BTreeSet<String>> = (0..nodes)
                    .map(|i| subset(&current, i, size).into_iter().map(str::to_owned).collect())
                    .collect();
                current[t] = new[t].clone();
                for (i, b) in before.iter().enumerate() {
                    let after: BTreeSet<String> =
                        subset(&current, i as u64, size).into_iter().map(str::to_owned).collect();
                    brute += u64::from(&after != b);
                }
            }
            prop_assert_eq!(rolling_update_messages(&old, &new, nodes, size), brute);
            for which in 0..n {
                let want = (0..nodes)
                    .filter(|&i| subset(&old, i, size).contains(&old[which].as_str()))
                    .count() as u64;
                prop_assert_eq!(holders(&old, which, nodes, size), want);
            }
        }
    }
}
