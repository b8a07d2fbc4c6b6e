//! Property tests of every algorithm's stated invariant.

mod common;

use std::collections::HashMap;

use common::*;
use meshless_balance::policy::is_prime;
use meshless_balance::{
    BalancerConfig, Cluster, ClusterConfig, HashKind, PickContext, PolicyKind, hash_key,
};
use proptest::prelude::*;

fn ctx(entropy: u64) -> PickContext<'static> {
    PickContext::new().with_entropy(entropy)
}

fn keyed(key: u64) -> PickContext<'static> {
    PickContext::new().with_key(key).with_entropy(0)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Every policy returns a member: an available one while at least half
    /// of the endpoints are available (the default panic threshold), any
    /// one below it (panic mode spreads over all, as Envoy does).
    #[test]
    fn picks_are_available_members(
        n in 1usize..40,
        weights in prop::collection::vec(1u32..10, 40),
        down in prop::collection::vec(any::<bool>(), 40),
        entropy in any::<u64>(),
    ) {
        let eps = weighted(&weights[..n]);
        for policy in PolicyKind::ALL {
            let mut cfg = config(policy);
            cfg.health.fall = 1;
            let c = Cluster::new(&eps, cfg).expect("valid");
            for (i, &d) in down[..n].iter().enumerate() {
                c.record_health_check(i, !d);
            }
            let up = down[..n].iter().filter(|&&d| !d).count();
            let panic = up * 100 < 50 * n;
            prop_assert_eq!(c.in_panic(), panic);
            for k in 0..8u64 {
                let pick = c.pick_index(&ctx(entropy.wrapping_add(k)).with_key(entropy ^ k));
                let i = pick.expect("panic mode always picks");
                prop_assert!(i < n);
                if !panic {
                    prop_assert!(!down[i], "{policy} picked unavailable {i}");
                }
            }
        }
    }

    /// Least request: no available endpoint carries strictly fewer requests
    /// per unit of weight. (The old promise, minimal `(load + 1) / weight`,
    /// sent everything to the heaviest endpoint at low concurrency.)
    #[test]
    fn least_request_is_minimal(
        loads in prop::collection::vec(0u32..6, 1..30),
        weights in prop::collection::vec(1u32..5, 30),
        entropy in any::<u64>(),
    ) {
        let n = loads.len();
        let c = cluster(&weighted(&weights[..n]), PolicyKind::LeastRequest);
        let _g = hold(&c, &loads);
        let i = c.pick_index(&ctx(entropy)).expect("pick");
        for j in 0..n {
            prop_assert!(!less(per_weight(&c, j), per_weight(&c, i)));
        }
    }

    /// Ring hash and Maglev depend only on the set of endpoints, not their order.
    #[test]
    fn hash_tables_ignore_endpoint_order(
        n in 1usize..30,
        seed in any::<u64>(),
        keys in prop::collection::vec(any::<u64>(), 50),
    ) {
        let eps = endpoints(n);
        let mut shuffled = eps.clone();
        fastrand::Rng::with_seed(seed).shuffle(&mut shuffled);
        for policy in [PolicyKind::RingHash, PolicyKind::Maglev] {
            let a = cluster(&eps, policy);
            let b = cluster(&shuffled, policy);
            for &k in &keys {
                let ia = a.pick_index(&keyed(k)).expect("pick");
                let ib = b.pick_index(&keyed(k)).expect("pick");
                prop_assert_eq!(&a.endpoints()[ia].id, &b.endpoints()[ib].id);
            }
        }
    }

    /// Bounded load: no pick takes an endpoint above ceil(c * mean), through
    /// any sequence of arrivals and completions (c as an integer percent).
    #[test]
    fn bounded_load_never_exceeds_bound(
        n in 1usize..20,
        load_factor in 1.0f64..2.0,
        over_ring in any::<bool>(),
        steps in prop::collection::vec((any::<u64>(), any::<bool>(), 0usize..1000), 1..400),
        hot in 1u64..4,
    ) {
        let mut cfg = config(PolicyKind::BoundedLoad);
        cfg.balancer.load_factor = load_factor;
        cfg.balancer.over = if over_ring { HashKind::RingHash } else { HashKind::Maglev };
        let c = Cluster::new(&endpoints(n), cfg).expect("valid");
        let mut live = Vec::new();
        for (key, finish, which) in steps {
            if finish && !live.is_empty() {
                live.swap_remove(which % live.len());
                continue;
            }
            let total = c.set().total_in_flight();
            let pct = meshless_balance::policy::load_factor_percent(load_factor);
            let bound = (pct * (total + 1)).div_ceil(100 * n as u64) as u32;
            // Few distinct keys: hot keys that must overflow.
            let g = c.pick(&keyed(key % hot)).expect("pick");
            let load = c.set().load(g.index());
            prop_assert!(load <= bound, "load {} > bound {}", load, bound);
            live.push(g);
        }
    }

    /// Bounded load keeps every key on its home endpoint while nothing is over the bound.
    #[test]
    fn bounded_load_stays_home_when_under_bound(
        n in 2usize..30,
        keys in prop::collection::vec(any::<u64>(), 1..100),
        loads in prop::collection::vec(0u32..3, 30),
    ) {
        let eps = endpoints(n);
        let plain = cluster(&eps, PolicyKind::Maglev);
        let mut cfg = config(PolicyKind::BoundedLoad);
        cfg.balancer.load_factor = 2.0;
        let c = Cluster::new(&eps, cfg).expect("valid");
        let _g = hold(&c, &loads[..n]);
        let total: u32 = loads[..n].iter().sum();
        let bound = (2 * (total + 1)).div_ceil(n as u32);
        for k in keys {
            let home = plain.pick_index(&keyed(k)).expect("pick");
            if loads[home] < bound {
                prop_assert_eq!(c.pick_index(&keyed(k)), Some(home));
            }
        }
    }

    /// Random honours weights: a heavy endpoint's share tracks its weight.
    #[test]
    fn random_honours_weights(weights in prop::collection::vec(1u32..8, 2..6), seed in any::<u64>()) {
        let c = cluster(&weighted(&weights), PolicyKind::Random);
        let draws = 20_000u64;
        let mut counts = vec![0u64; weights.len()];
        for k in 0..draws {
            counts[c.pick_index(&ctx(seed.wrapping_add(k).wrapping_mul(0x9E37_79B9_7F4A_7C15))).expect("pick")] += 1;
        }
        let total: u32 = weights.iter().sum();
        for (i, &w) in weights.iter().enumerate() {
            let expected = draws as f64 * f64::from(w) / f64::from(total);
            let sd = (expected * (1.0 - f64::from(w) / f64::from(total))).sqrt();
            prop_assert!((counts[i] as f64 - expected).abs() < 6.0 * sd + 1.0,
                "endpoint {} drawn {} times, expected {:.0}", i, counts[i], expected);
        }
    }
}

/// Round robin serves exactly the weights over each period.
#[test]
fn round_robin_honours_weights_over_a_period() {
    let weights = [5, 1, 1, 3];
    let c = cluster(&weighted(&weights), PolicyKind::RoundRobin);
    let mut counts = [0u32; 4];
    for _ in 0..10 * 3 {
        counts[c.pick_index(&PickContext::new()).expect("pick")] += 1;
    }
    assert_eq!(counts, [15, 3, 3, 9]);
}

/// Share of `keys` whose endpoint id changes when the last endpoint leaves.
fn moved_share(policy: PolicyKind, n: usize, keys: u64, removed: usize) -> f64 {
    let eps = endpoints(n);
    let before = cluster(&eps, policy);
    let mut fewer = eps.clone();
    fewer.remove(removed);
    let after = cluster(&fewer, policy);
    let moved = (0..keys)
        .filter(|k| {
            let key = hash_key(&k.to_le_bytes());
            let a = &before.endpoints()[before.pick_index(&keyed(key)).expect("pick")].id;
            let b = &after.endpoints()[after.pick_index(&keyed(key)).expect("pick")].id;
            a != b
        })
        .count();
    moved as f64 / keys as f64
}

#[test]
fn removing_one_endpoint_moves_about_one_nth_of_keys() {
    for n in [10usize, 100] {
        for removed in [0, n / 2, n - 1] {
            let ideal = 1.0 / n as f64;
            let maglev = moved_share(PolicyKind::Maglev, n, 50_000, removed);
            let ring = moved_share(PolicyKind::RingHash, n, 50_000, removed);
            assert!(
                maglev <= 2.0 * ideal,
                "maglev n={n}: moved {maglev:.4}, ideal {ideal:.4}"
            );
            assert!(
                ring <= 1.5 * ideal,
                "ring n={n}: moved {ring:.4}, ideal {ideal:.4}"
            );
            assert!(
                maglev >= 0.5 * ideal && ring >= 0.5 * ideal,
                "the removed endpoint's keys move"
            );
        }
    }
}

#[test]
fn maglev_entries_are_floor_or_ceil_of_m_over_n() {
    for n in [1usize, 7, 100, 1000] {
        let eps = endpoints(n);
        let c = cluster(&eps, PolicyKind::Maglev);
        // The table grows past 655 endpoints (100 entries each).
        let m = meshless_balance::policy::table_size_for(65_537, 5_000_011, n) as u64;
        let mut owned: HashMap<usize, u64> = HashMap::new();
        for slot in 0..m {
            // A key equal to the slot number lands on that slot.
            *owned
                .entry(c.pick_index(&keyed(slot)).expect("pick"))
                .or_default() += 1;
        }
        assert_eq!(owned.len(), n);
        let (lo, hi) = (m / n as u64, m.div_ceil(n as u64));
        assert!(owned.values().all(|&x| x == lo || x == hi), "n={n}");
    }
}

#[test]
fn weighted_maglev_and_ring_share_by_weight() {
    let weights = [1u32, 2, 3, 4];
    for policy in [PolicyKind::Maglev, PolicyKind::RingHash] {
        let c = cluster(&weighted(&weights), policy);
        let mut counts = [0u64; 4];
        let keys = 200_000u64;
        for k in 0..keys {
            counts[c
                .pick_index(&keyed(hash_key(&k.to_le_bytes())))
                .expect("pick")] += 1;
        }
        for (i, &w) in weights.iter().enumerate() {
            let share = counts[i] as f64 / keys as f64;
            let want = f64::from(w) / 10.0;
            assert!(
                (share - want).abs() < 0.03,
                "{policy}: endpoint {i} share {share:.3}, want {want}"
            );
        }
    }
}

#[test]
fn bad_settings_are_rejected_with_the_field_name() {
    let eps = endpoints(3);
    let mut cfg = ClusterConfig::new(PolicyKind::Maglev);
    cfg.balancer.table_size = 65_536;
    let e = Cluster::new(&eps, cfg).expect_err("not prime");
    assert!(e.to_string().starts_with("balancer.table_size"), "{e}");
    let mut cfg = ClusterConfig::new(PolicyKind::BoundedLoad);
    cfg.balancer.load_factor = 0.9;
    let e = Cluster::new(&eps, cfg).expect_err("c < 1");
    assert!(e.to_string().starts_with("balancer.load_factor"), "{e}");
    let mut dup = eps.clone();
    dup.push(endpoint(0));
    let e = Cluster::new(&dup, ClusterConfig::default()).expect_err("duplicate");
    assert!(e.to_string().contains("duplicate"), "{e}");
    assert!("p3c".parse::<PolicyKind>().is_err());
    assert!(is_prime(655_373) && is_prime(65_537));
    let _ = BalancerConfig::default();
}

#[test]
fn empty_cluster_picks_nothing() {
    for policy in PolicyKind::ALL {
        let c = cluster(&[], policy);
        assert!(c.pick(&PickContext::new()).is_none(), "{policy}");
    }
}
