//! Deterministic subsetting in the stream (`meshless_control::subsets`):
//! what every subsetted subscriber holds equals `meshless_model::subset`
//! (or `zone_subset`, for a zone-aware one) of the published endpoints
//! after any sequence of changes, with each group's `m` kept by
//! `next_slots` from the group's first subscriber on.

#![allow(clippy::unwrap_used)]
use std::collections::BTreeMap;

use meshless_api::v1;
use meshless_control::subsets::{SubsetKey, Subsets};
use meshless_model::subset::{next_slots, subset_in_slots, zone_subset_in_slots};
use proptest::prelude::*;

/// Endpoint `id` on `port`, in one of three zones by both (so a new port
/// may move it to another zone).
fn ep(id: &str, port: u32) -> v1::Endpoint {
    let spread = id.bytes().map(u32::from).sum::<u32>() + port;
    v1::Endpoint {
        id: id.to_owned(),
        addresses: vec!["10.0.0.1".into()],
        port,
        zone: format!("z{}", spread % 3),
        ready: true,
        ..v1::Endpoint::default()
    }
}

/// The endpoints subsets are drawn from (the plane's rule): the ready or
/// starting ones that are not terminating; when there is none, the
/// serving ones.
fn eligible(truth: &BTreeMap<String, v1::Endpoint>) -> Vec<&v1::Endpoint> {
    let strict: Vec<&v1::Endpoint> = truth
        .values()
        .filter(|e| (e.ready || e.starting) && !e.terminating)
        .collect();
    if strict.is_empty() {
        truth.values().filter(|e| e.serving).collect()
    } else {
        strict
    }
}

/// The zones subscribers sit in: the endpoints' three and one with none.
const ZONES: [Option<&str>; 5] = [None, Some("z0"), Some("z1"), Some("z2"), Some("empty")];

/// What a subscriber holds after applying `bytes` (the proxy's rule:
/// reset clears; upserts, then removals).
fn follow(view: &mut BTreeMap<String, v1::Endpoint>, bytes: &[u8]) {
    let d = meshless_api::decode_delta(bytes).unwrap();
    if d.reset {
        view.clear();
    }
    for e in d.upserted {
        view.insert(e.id.clone(), e);
    }
    for id in d.removed {
        view.remove(&id);
    }
}

/// A change to the service: put endpoint `id` (new, or a new port), or
/// remove it, or a reset to a set.
#[derive(Debug, Clone)]
enum Op {
    Put(u8, u32),
    /// Put it not ready: terminating, or failing its readiness probe.
    Unready(u8, bool),
    Remove(u8),
    Replace(u8, u8),
    /// Several puts and removals in one delta.
    Many(Vec<u8>, Vec<u8>),
    Reset(Vec<u8>),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..40, 1u32..4).prop_map(|(i, p)| Op::Put(i, p)),
        3 => (0u8..40, any::<bool>()).prop_map(|(i, t)| Op::Unready(i, t)),
        4 => (0u8..40).prop_map(Op::Remove),
        4 => (0u8..40, 0u8..40).prop_map(|(a, b)| Op::Replace(a, b)),
        2 => (
            proptest::collection::vec(0u8..40, 0..4),
            proptest::collection::vec(0u8..40, 0..4)
        )
            .prop_map(|(put, remove)| Op::Many(put, remove)),
        1 => proptest::collection::vec(0u8..40, 0..30).prop_map(Op::Reset),
    ]
}

fn delta_of(op: &Op, version: u64) -> v1::Delta {
    let id = |i: &u8| format!("pod-{i}");
    let mut d = v1::Delta {
        version,
        service: "ns/a".into(),
        ..v1::Delta::default()
    };
    match op {
        Op::Put(i, p) => d.upserted.push(ep(&id(i), *p)),
        Op::Unready(i, terminating) => d.upserted.push(v1::Endpoint {
            ready: false,
            serving: *terminating,
            terminating: *terminating,
            ..ep(&id(i), 1)
        }),
        Op::Remove(i) => d.removed.push(id(i)),
        Op::Replace(a, b) => {
            d.upserted.push(ep(&id(a), 9));
            if a != b {
                d.removed.push(id(b));
            }
        }
        Op::Many(put, remove) => {
            d.upserted = put.iter().map(|i| ep(&id(i), 5)).collect();
            d.upserted.dedup_by(|a, b| a.id == b.id);
            d.removed = remove
                .iter()
                .filter(|r| !put.contains(r))
                .map(&id)
                .collect();
        }
        Op::Reset(ids) => {
            d.reset = true;
            d.upserted = ids.iter().map(|i| ep(&id(i), 1)).collect();
        }
    }
    d
}

proptest! {
    /// After any sequence of changes, every subscriber holds exactly
    /// `subset()` of the current ready endpoints (`zone_subset()` for a
    /// zone-aware one), with their latest fields, whether it joined at the
    /// start or half-way: an endpoint that is not ready or terminating is
    /// in no subset, unless no endpoint is ready (then the serving ones
    /// are drawn from).
    #[test]
    fn streamed_subsets_equal_the_model(
        initial in proptest::collection::vec(0u8..40, 0..30),
        ops in proptest::collection::vec(op(), 0..40),
        sizes in proptest::collection::vec(1u32..8, 1..6),
        join_at in 0usize..40,
    ) {
        let mut s = Subsets::default();
        let mut truth: BTreeMap<String, v1::Endpoint> = BTreeMap::new();
        let seed: Vec<v1::Endpoint> = initial.iter().map(|i| ep(&format!("pod-{i}"), 1)).collect();
        s.seed("ns/a", 1, seed.clone(), None);
        for e in seed {
            truth.insert(e.id.clone(), e);
        }
        let mut subs: Vec<(SubsetKey, BTreeMap<String, v1::Endpoint>)> = Vec::new();
        // Per group (size, zone): its kept m, set at its first join and
        // moved by next_slots after every delta.
        let mut slots: BTreeMap<(u32, Option<String>), u64> = BTreeMap::new();
        let scope_n = |truth: &BTreeMap<String, v1::Endpoint>, zone: &Option<String>| {
            eligible(truth).into_iter().filter(|e| zone.as_ref().is_none_or(|z| e.zone == *z)).count()
        };
        let join = |s: &mut Subsets, subs: &mut Vec<_>, slots: &mut BTreeMap<_, u64>, truth: &BTreeMap<_, _>, n: usize| {
            for (k, size) in sizes.iter().enumerate() {
                for zone in ZONES {
                    let group = (*size, zone.map(str::to_owned));
                    let count = scope_n(truth, &group.1);
                    slots.entry(group).or_insert_with(|| next_slots(None, count, *size as usize));
                    let (key, _, bytes) = s.register("ns/a", *size, zone, &format!("node-{n}-{k}"));
                    let mut view = BTreeMap::new();
                    follow(&mut view, &bytes.compact);
                    subs.push((key, view));
                }
            }
        };
        join(&mut s, &mut subs, &mut slots, &truth, 0);
        for (step, op) in ops.iter().enumerate() {
            if step == join_at {
                join(&mut s, &mut subs, &mut slots, &truth, 1);
            }
            let delta = delta_of(op, step as u64 + 2);
            if delta.reset {
                truth.clear();
            }
            for e in &delta.upserted {
                truth.insert(e.id.clone(), e.clone());
            }
            for id in &delta.removed {
                truth.remove(id);
            }
            let out = s.apply(&delta).unwrap();
            for ((size, zone), m) in slots.iter_mut() {
                *m = next_slots(Some(*m), scope_n(&truth, zone), *size as usize);
            }
            for (key, view) in &mut subs {
                if let Some(bytes) = out.get(key) {
                    follow(view, &bytes.compact);
                }
            }
            let ids: Vec<&str> = eligible(&truth).into_iter().map(|e| e.id.as_str()).collect();
            let zoned: Vec<(&str, &str)> = eligible(&truth)
                .into_iter()
                .map(|e| (e.id.as_str(), e.zone.as_str()))
                .collect();
            for (key, view) in &subs {
                let size = key.size as usize;
                let m = slots[&(key.size, key.zone.as_deref().map(str::to_owned))];
                let want = match &key.zone {
                    None => subset_in_slots(&ids, key.index, size, Some(m)),
                    Some(z) => zone_subset_in_slots(&zoned, z, key.index, size, Some(m)),
                };
                let got: Vec<&str> = view.keys().map(String::as_str).collect();
                prop_assert_eq!(&got, &want, "key {:?} after {:?}", key, op);
                prop_assert_eq!(s.members("ns/a", key), want.iter().map(|x| x.to_string()).collect::<Vec<_>>());
                for (id, e) in view {
                    prop_assert_eq!(Some(e), truth.get(id), "stale fields of {}", id);
                }
            }
        }
    }
}

/// A rolling update that removes before it adds, on a service whose size
/// is a multiple of the subset size (`N` going 200 -> 199 -> 200): every
/// subscriber's subset loses at most one member and gains at most one per
/// step (a recomputed `m` would regroup them all twice per step).
#[test]
fn a_rolling_update_across_a_multiple_of_the_size_moves_one_member_per_step() {
    let mut s = Subsets::default();
    let eps: Vec<v1::Endpoint> = (0..200).map(|i| ep(&format!("pod-{i}"), 1)).collect();
    s.seed("ns/a", 1, eps, None);
    let keys: Vec<SubsetKey> = (0..8)
        .map(|i| s.register("ns/a", 100, None, &format!("node-{i}")).0)
        .collect();
    let mut version = 1;
    for step in 0..20 {
        let steps = [
            (Vec::new(), vec![format!("pod-{step}")]),
            (vec![ep(&format!("new-{step}"), 1)], Vec::new()),
        ];
        for (upserted, removed) in steps {
            version += 1;
            let before: Vec<Vec<String>> = keys.iter().map(|k| s.members("ns/a", k)).collect();
            s.apply(&v1::Delta {
                version,
                service: "ns/a".into(),
                upserted,
                removed,
                ..v1::Delta::default()
            });
            for (key, old) in keys.iter().zip(before) {
                let new = s.members("ns/a", key);
                let out = old.iter().filter(|id| !new.contains(id)).count();
                let inn = new.iter().filter(|id| !old.contains(id)).count();
                assert!(
                    out <= 1 && inn <= 1,
                    "{key:?} at step {step}: {out} out, {inn} in"
                );
                assert_eq!(new.len(), 100);
            }
        }
    }
}

#[test]
fn identities_take_the_lowest_free_index_and_keep_it_while_held() {
    let mut s = Subsets::default();
    let eps: Vec<v1::Endpoint> = (0..10).map(|i| ep(&format!("p{i}"), 1)).collect();
    s.seed("ns/a", 1, eps, None);
    let (a, _, _) = s.register("ns/a", 3, None, "a");
    let (b, _, _) = s.register("ns/a", 3, None, "b");
    let (a2, _, _) = s.register("ns/a", 3, None, "a");
    assert_eq!((a.index, b.index, a2.index), (0, 1, 0));
    s.release("ns/a", &a, "a");
    let (c, _, _) = s.register("ns/a", 3, None, "c");
    assert_eq!(c.index, 2, "a still holds 0 through its second stream");
    s.release("ns/a", &a, "a");
    let (d, _, _) = s.register("ns/a", 3, None, "d");
    assert_eq!(d.index, 0, "freed by a's last stream");
    assert_eq!(s.members("ns/a", &d).len(), 3);
}

#[test]
fn a_change_outside_the_subset_sends_nothing_and_an_activation_error_goes_to_all() {
    let mut s = Subsets::default();
    let eps: Vec<v1::Endpoint> = (0..12).map(|i| ep(&format!("p{i}"), 1)).collect();
    s.seed("ns/a", 1, eps, None);
    let (key, _, _) = s.register("ns/a", 3, None, "a");
    let members = s.members("ns/a", &key);
    let outside = (0..12)
        .map(|i| format!("p{i}"))
        .find(|id| !members.contains(id))
        .unwrap();
    let change = v1::Delta {
        version: 2,
        service: "ns/a".into(),
        upserted: vec![ep(&outside, 7)],
        ..v1::Delta::default()
    };
    assert!(s.apply(&change).unwrap().is_empty());
    let inside = v1::Delta {
        version: 3,
        service: "ns/a".into(),
        upserted: vec![ep(&members[0], 7)],
        ..v1::Delta::default()
    };
    let out = s.apply(&inside).unwrap();
    let got = meshless_api::decode_delta(&out[&key].full).unwrap();
    assert_eq!(got.upserted, vec![ep(&members[0], 7)]);
    assert!(got.removed.is_empty());
    let error = v1::Delta {
        version: 4,
        service: "ns/a".into(),
        activation_error: "no".into(),
        ..v1::Delta::default()
    };
    assert!(s.apply(&error).is_none(), "the shared bytes go to everyone");
}

/// Subscribers naming services that were never published leave nothing
/// behind once they go; a published service keeps its view (its
/// endpoints and settings), with or without subscribers.
#[test]
fn unknown_services_leave_no_view_behind() {
    let mut s = Subsets::default();
    for i in 0..50 {
        let name = format!("ns/typo-{i}");
        let (key, _, _) = s.register(&name, 3, None, "proxy-a");
        s.release(&name, &key, "proxy-a");
    }
    assert_eq!(s.services(), 0);
    s.apply(&v1::Delta {
        service: "ns/real".into(),
        version: 1,
        reset: true,
        upserted: vec![ep("a", 80)],
        ..v1::Delta::default()
    });
    let (key, _, _) = s.register("ns/real", 3, None, "proxy-a");
    s.release("ns/real", &key, "proxy-a");
    assert_eq!(s.services(), 1);
}

proptest! {
    /// A plane restart forgets the indices: subscribers that come back in
    /// any order, each asking for the index it held, get it back with the
    /// same members, and the indices stay `0 .. k` (balance holds).
    #[test]
    fn returning_subscribers_get_their_indices_back_in_any_order(
        n in 1u8..40,
        size in 1u32..8,
        k in 1usize..12,
        order in Just(()).prop_perturb(|_, mut rng| rng.next_u64()),
    ) {
        let eps: Vec<v1::Endpoint> = (0..n).map(|i| ep(&format!("pod-{i}"), 1)).collect();
        let mut before = Subsets::default();
        before.seed("ns/a", 1, eps.clone(), None);
        let held: Vec<(String, SubsetKey, Vec<String>)> = (0..k)
            .map(|i| {
                let who = format!("node-{i}");
                let (key, _, _) = before.register("ns/a", size, None, &who);
                let members = before.members("ns/a", &key);
                (who, key, members)
            })
            .collect();
        let mut after = Subsets::default();
        after.seed("ns/a", 1, eps, None);
        let mut returning = held.clone();
        // A permutation drawn from `order`.
        let mut seed = order;
        for i in (1..returning.len()).rev() {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            returning.swap(i, (seed >> 33) as usize % (i + 1));
        }
        let mut indices = Vec::new();
        for (who, key, members) in &returning {
            let (again, _, _) = after.register_asking("ns/a", size, None, who, Some(key.index));
            prop_assert_eq!(again.index, key.index);
            prop_assert_eq!(&after.members("ns/a", &again), members);
            indices.push(again.index);
        }
        indices.sort_unstable();
        prop_assert_eq!(indices, (0..k as u64).collect::<Vec<_>>());
    }
}

#[test]
fn an_asked_index_held_by_another_or_absurd_gives_the_lowest_free() {
    let mut s = Subsets::default();
    let eps: Vec<v1::Endpoint> = (0..10).map(|i| ep(&format!("p{i}"), 1)).collect();
    s.seed("ns/a", 1, eps, None);
    let (a, _, _) = s.register_asking("ns/a", 3, None, "a", Some(1));
    assert_eq!(a.index, 1);
    let (b, _, _) = s.register_asking("ns/a", 3, None, "b", Some(1));
    assert_eq!(b.index, 0, "1 is a's");
    let (c, _, _) = s.register_asking("ns/a", 3, None, "c", Some(u64::MAX));
    assert_eq!(c.index, 2);
    let (a2, _, _) = s.register_asking("ns/a", 3, None, "a", Some(7));
    assert_eq!(a2.index, 1, "an identity holding an index keeps it");
}
