//! Deterministic subsetting: which `size` endpoints of a service one
//! subscriber (a node proxy) follows. Pure: no I/O, no state, no clock.
//!
//! # Algorithm
//!
//! Google's deterministic subsetting (*Site Reliability Engineering*,
//! ch. 20), with one change for churn: a round's order of the endpoints is
//! not a seeded shuffle of the list but the endpoints sorted by a hash of
//! `(round, endpoint id)`, so an endpoint's place in a round does not
//! depend on which other endpoints exist.
//!
//! - `m = max(1, ⌊N / size⌋)` subsets per round, `N` the distinct endpoints.
//! - Subscriber `i` is in round `r = ⌊i / m⌋` at slot `j = i mod m`.
//! - Round `r` orders the endpoints by [`order_key`]`(r, id)`; slot `j` takes
//!   ranks `j·size .. j·size + size` of that order (ranks `0 .. N` when
//!   `size ≥ N`).
//!
//! # Properties (proved by the property tests below)
//!
//! - **(c) Size**: a subset is exactly `min(size, N)` distinct endpoints.
//! - **(d) Deterministic**: the subset depends only on the set of endpoint
//!   ids, the subscriber index and `size`: not on input order or duplicates.
//! - **(a) Balance**: for subscribers `0 .. S` (consecutive indices from 0),
//!   every full round holds each endpoint at most once. If `size` divides
//!   `N`, each round holds every endpoint exactly once, so every endpoint is
//!   in `⌊S/m⌋` or `⌈S/m⌉` subsets, i.e. within 1 of `S·size/N` (exactly
//!   `S·size/N` when `S` is a multiple of `m`). If `size` does not divide
//!   `N`, each round leaves out the `N mod size` endpoints ranked last (a
//!   different set per round); every endpoint is still in at most `⌈S/m⌉`
//!   subsets, but one may be in fewer than `⌊S/m⌋ - 1`.
//! - **(b) Churn**: adding one endpoint, removing one, or replacing one by
//!   another (a rolling-update step) changes every subscriber's subset by at
//!   most one member out and one member in — provided `m = ⌊N/size⌋` is the
//!   same before and after. When `m` changes (`N` crosses a multiple of
//!   `size`), subscribers regroup into rounds and a subset may change
//!   entirely; that happens once per `size` endpoints added or removed.
//!   A replacement changes the subsets of the slots between the old
//!   endpoint's rank and the new one's (about a third of the subscribers on
//!   average), each by one out and one in.
//!
//! # Locality ([`zone_subset`])
//!
//! When the subscriber's zone holds at least `size` endpoints, its subset is
//! [`subset`] over that zone's endpoints alone, with the subscriber's index
//! among its zone's subscribers: so (a)-(d) hold per zone, for subscribers
//! numbered `0 .. S_z` within each zone. When the zone holds fewer, the
//! subset is all of the zone's endpoints plus [`subset`] of
//! `size - N_z` among the other zones' endpoints: still exactly
//! `min(size, N)` distinct endpoints, zone first. Churn (b) holds for a
//! subscriber while its zone keeps `⌊N_z/size⌋ ≥ 1` unchanged (a change in
//! another zone then does not touch it at all). Locality does not balance
//! load across zones of unequal size (an endpoint in a zone with few
//! endpoints and many subscribers serves more of them); that is the
//! operator's trade, as with Kubernetes' topology-aware routing.

use std::collections::BTreeSet;

/// Subsets per round for `n` distinct endpoints: `max(1, ⌊n / size⌋)`.
/// `size` 0 is treated as 1 (an empty subset has no rounds to speak of).
pub fn slots_per_round(n: usize, size: usize) -> u64 {
    (n / size.max(1)).max(1) as u64
}

/// `(round, slot)` of subscriber `index` when rounds have `slots` slots.
pub fn round_and_slot(index: u64, slots: u64) -> (u64, u64) {
    let slots = slots.max(1);
    (index / slots, index % slots)
}

/// The rank key of endpoint `id` in round `round`: rounds order endpoints by
/// `(order_key, id)` ascending. Stable across processes and versions of Rust
/// (FNV-1a over the id, mixed with the round by SplitMix64).
pub fn order_key(round: u64, id: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325_u64 ^ splitmix64(round);
    for b in id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    splitmix64(h)
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The ranks slot `slot` takes when `n` endpoints are split into subsets of
/// `size`: `slot·size .. slot·size + size`, or `0 .. n` when `size ≥ n`.
pub fn slot_ranks(slot: u64, n: usize, size: usize) -> std::ops::Range<usize> {
    if size >= n {
        return 0..n;
    }
    let start = slot as usize * size;
    start..start + size
}

/// The subset of subscriber `index` among endpoints `ids`, sorted by id.
/// Duplicate ids count once; `size` 0 gives an empty subset.
pub fn subset<S: AsRef<str>>(ids: &[S], index: u64, size: usize) -> Vec<&str> {
    let distinct: BTreeSet<&str> = ids.iter().map(AsRef::as_ref).collect();
    if size == 0 || distinct.is_empty() {
        return Vec::new();
    }
    let n = distinct.len();
    let (round, slot) = round_and_slot(index, slots_per_round(n, size));
    let mut order: Vec<(u64, &str)> = distinct
        .into_iter()
        .map(|id| (order_key(round, id), id))
        .collect();
    order.sort_unstable();
    let mut out: Vec<&str> = order[slot_ranks(slot, n, size)]
        .iter()
        .map(|&(_, id)| id)
        .collect();
    out.sort_unstable();
    out
}

/// The subset of the subscriber with index `zone_index` among the
/// subscribers in `zone`, preferring endpoints in `zone`; `endpoints` are
/// `(id, zone)` pairs. Sorted by id; duplicate ids count once (with the
/// lexicographically smallest zone given for them).
pub fn zone_subset<'a>(
    endpoints: &'a [(&'a str, &'a str)],
    zone: &str,
    zone_index: u64,
    size: usize,
) -> Vec<&'a str> {
    let mut by_id: Vec<(&str, &str)> = endpoints.to_vec();
    by_id.sort_unstable();
    by_id.dedup_by(|a, b| a.0 == b.0);
    let (local, other): (Vec<_>, Vec<_>) = by_id.iter().partition(|(_, z)| *z == zone);
    let local: Vec<&'a str> = local.into_iter().map(|&(id, _)| id).collect();
    if local.len() >= size {
        return borrowed(&local, subset(&local, zone_index, size));
    }
    let other: Vec<&'a str> = other.into_iter().map(|&(id, _)| id).collect();
    let rest = borrowed(&other, subset(&other, zone_index, size - local.len()));
    let mut out = local;
    out.extend(rest);
    out.sort_unstable();
    out
}

/// `picked` (ids of `sorted`) as `sorted`'s own `&'a str`s.
fn borrowed<'a>(sorted: &[&'a str], picked: Vec<&str>) -> Vec<&'a str> {
    picked
        .into_iter()
        .filter_map(|id| sorted.binary_search(&id).ok().map(|i| sorted[i]))
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("pod-{i}")).collect()
    }

    /// How many of subscribers `0..s` hold each endpoint.
    fn counts(ids: &[String], s: u64, size: usize) -> BTreeMap<String, u64> {
        let mut c: BTreeMap<String, u64> = ids.iter().map(|i| (i.clone(), 0)).collect();
        for i in 0..s {
            for id in subset(ids, i, size) {
                *c.get_mut(id).unwrap() += 1;
            }
        }
        c
    }

    fn diff(a: &[&str], b: &[&str]) -> (usize, usize) {
        let (a, b): (BTreeSet<_>, BTreeSet<_>) = (a.iter().collect(), b.iter().collect());
        (a.difference(&b).count(), b.difference(&a).count())
    }

    proptest! {
        /// (c) exactly min(size, N) distinct endpoints, all from the input.
        #[test]
        fn size_is_min_of_size_and_n(n in 0usize..60, size in 0usize..80, index in 0u64..500) {
            let ids = ids(n);
            let s = subset(&ids, index, size);
            prop_assert_eq!(s.len(), size.min(n));
            prop_assert_eq!(s.iter().collect::<BTreeSet<_>>().len(), s.len());
            prop_assert!(s.iter().all(|id| ids.iter().any(|i| i == id)));
        }

        /// (d) the same set in any order, with duplicates, gives the same subset.
        #[test]
        fn independent_of_order_and_duplicates(
            n in 1usize..60, size in 1usize..30, index in 0u64..500, seed in any::<u64>(),
        ) {
            let ids = ids(n);
            let mut shuffled = ids.clone();
            shuffled.push(ids[seed as usize % n].clone());
            fastrand::Rng::with_seed(seed).shuffle(&mut shuffled);
            prop_assert_eq!(subset(&ids, index, size), subset(&shuffled, index, size));
        }

        /// (a) size divides N: every endpoint is in ⌊S/m⌋ or ⌈S/m⌉ subsets,
        /// within 1 of S·size/N, exactly S·size/N when m divides S.
        #[test]
        fn balanced_when_size_divides_n(m in 1usize..12, size in 1usize..12, s in 0u64..120) {
            let n = m * size;
            let c = counts(&ids(n), s, size);
            let (lo, hi) = (s / m as u64, s.div_ceil(m as u64));
            let mean = s as f64 * size as f64 / n as f64;
            for (id, k) in &c {
                prop_assert!(*k >= lo && *k <= hi, "{id}: {k} not in {lo}..={hi}");
                prop_assert!((*k as f64 - mean).abs() <= 1.0);
                if s % m as u64 == 0 {
                    prop_assert_eq!(*k, s / m as u64);
                }
            }
        }

        /// (a) otherwise: at most ⌈S/m⌉ each, S·min(size, N) in all.
        #[test]
        fn bounded_when_size_does_not_divide_n(n in 1usize..60, size in 1usize..20, s in 0u64..120) {
            let c = counts(&ids(n), s, size);
            let m = (n / size).max(1) as u64;
            prop_assert!(c.values().all(|&k| k <= s.div_ceil(m)));
            prop_assert_eq!(c.values().sum::<u64>(), s * size.min(n) as u64);
        }

        /// (b) one endpoint added, removed or replaced with ⌊N/size⌋ unchanged:
        /// every subset loses at most one member and gains at most one.
        #[test]
        fn one_change_moves_at_most_one_member(
            m in 1usize..8, size in 2usize..10, extra in 1usize..9, pick in any::<usize>(),
            op in 0u8..3, s in 1u64..60,
        ) {
            let extra = extra % (size - 1) + 1; // N mod size in 1..size-1: m holds for N±1
            let n = m * size + extra;
            let before = ids(n);
            let mut after = before.clone();
            match op {
                0 => after.push("new-pod".into()),
                1 => { after.remove(pick % n); }
                _ => { after[pick % n] = "new-pod".into(); }
            }
            prop_assume!(slots_per_round(after.len(), size) == slots_per_round(n, size));
            for i in 0..s {
                let (out, inn) = diff(&subset(&before, i, size), &subset(&after, i, size));
                prop_assert!(out <= 1 && inn <= 1, "subscriber {i}: {out} out, {inn} in");
            }
        }
    }

    fn zoned(n: usize, zones: usize) -> Vec<(String, String)> {
        (0..n)
            .map(|i| (format!("pod-{i}"), format!("zone-{}", i % zones.max(1))))
            .collect()
    }

    proptest! {
        /// Locality: exactly min(size, N) distinct endpoints; only the
        /// subscriber's zone when it has `size`, else all of it plus others.
        #[test]
        fn zone_subset_prefers_the_zone(
            n in 0usize..60, zones in 1usize..4, size in 0usize..30, index in 0u64..200,
        ) {
            let owned = zoned(n, zones);
            let eps: Vec<(&str, &str)> = owned.iter().map(|(i, z)| (i.as_str(), z.as_str())).collect();
            let s = zone_subset(&eps, "zone-0", index, size);
            prop_assert_eq!(s.len(), size.min(n));
            prop_assert_eq!(s.iter().collect::<BTreeSet<_>>().len(), s.len());
            let local: BTreeSet<&str> = eps.iter().filter(|e| e.1 == "zone-0").map(|e| e.0).collect();
            if local.len() >= size {
                prop_assert!(s.iter().all(|id| local.contains(id)));
            } else {
                prop_assert!(local.iter().all(|id| s.contains(id)));
            }
            let mut reversed = eps.clone();
            reversed.reverse();
            prop_assert_eq!(zone_subset(&reversed, "zone-0", index, size), s);
        }

        /// Locality keeps (a) per zone: with size dividing the zone's count,
        /// zone subscribers 0..S hold each zone endpoint ⌊S/m⌋ or ⌈S/m⌉ times.
        #[test]
        fn zone_subset_balances_within_the_zone(m in 1usize..8, size in 1usize..8, s in 0u64..80) {
            let owned = zoned(m * size * 3, 3);
            let eps: Vec<(&str, &str)> = owned.iter().map(|(i, z)| (i.as_str(), z.as_str())).collect();
            let mut c: BTreeMap<&str, u64> = BTreeMap::new();
            for i in 0..s {
                for id in zone_subset(&eps, "zone-1", i, size) {
                    *c.entry(id).or_default() += 1;
                }
            }
            let local = eps.iter().filter(|e| e.1 == "zone-1");
            let (lo, hi) = (s / m as u64, s.div_ceil(m as u64));
            for (id, _) in local {
                let k = c.get(id).copied().unwrap_or(0);
                prop_assert!(k >= lo && k <= hi, "{id}: {k} not in {lo}..={hi}");
            }
            prop_assert!(c.keys().all(|id| eps.iter().any(|e| e.0 == *id && e.1 == "zone-1")));
        }
    }

    #[test]
    fn key_is_stable_across_builds() {
        // Pinned: a changed hash would reshuffle every deployed subset.
        assert_eq!(order_key(0, "pod-1"), 8_450_093_768_840_088_528);
        assert_eq!(order_key(7, "pod-1"), 16_126_088_282_475_785_350);
        assert_eq!(subset(&["b", "a"], 0, 5), vec!["a", "b"]);
        assert!(subset(&[] as &[&str], 3, 5).is_empty());
    }
}
