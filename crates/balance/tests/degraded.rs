//! Shares with endpoints down and weights unequal: each policy against the
//! definition of a weighted share (`w_i / sum of live weights`), and bounded
//! load's bound with unequal weights, ejected endpoints and strict tiers.

mod common;

use common::*;
use meshless_balance::policy::load_factor_percent;
use meshless_balance::{
    Cluster, ClusterConfig, HashKind, LocalityConfig, LocalityMode, Outcome, PickContext,
    PolicyKind, hash_key,
};
use proptest::prelude::*;

fn ctx(entropy: u64) -> PickContext<'static> {
    PickContext::new().with_entropy(entropy)
}

/// A cluster with fall = 1 and the endpoints of `down` failed by health
/// check; rings of 65,536 points (so the ring's own unevenness is small).
fn degraded(weights: &[u32], down: &[bool], policy: PolicyKind) -> Cluster {
    let mut cfg = config(policy);
    cfg.balancer.ring_size = Some(1 << 16);
    cfg.health.fall = 1;
    cfg.panic_threshold = 0;
    let c = Cluster::new(&weighted(weights), cfg).expect("valid");
    for (i, &d) in down.iter().enumerate() {
        if d {
            c.record_health_check(i, false);
        }
    }
    c
}

/// Sequential picks (each request ends before the next): per-endpoint counts.
fn shares(c: &Cluster, picks: u64, seed: u64, keyed: bool) -> Vec<u64> {
    let mut counts = vec![0u64; c.endpoints().len()];
    let mut rng = fastrand::Rng::with_seed(seed);
    for _ in 0..picks {
        let e = rng.u64(..);
        let mut cx = ctx(e);
        if keyed {
            cx = cx.with_key(hash_key(&e.to_le_bytes()));
        }
        let g = c.pick(&cx).expect("a live endpoint exists");
        counts[g.index()] += 1;
    }
    counts
}

/// `|count - picks * p| <= 6 sd + slack`: a binomial bound for random
/// shares, loose enough never to fail by chance (6 sigma).
fn within(count: u64, picks: u64, p: f64, slack: f64) -> bool {
    let mean = picks as f64 * p;
    let sd = (picks as f64 * p * (1.0 - p)).sqrt();
    (count as f64 - mean).abs() <= 6.0 * sd + slack
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Round robin, random, P2C and least request, one request at a time:
    /// each live endpoint serves `w_i / W_live` of requests (within 6 sigma
    /// of a binomial; round robin's own turns are exact, only the down
    /// turns are random), a down one none.
    #[test]
    fn share_follows_weight_with_any_subset_down(
        weights in prop::collection::vec(1u32..6, 2..9),
        down_bits in any::<u16>(),
        seed in any::<u64>(),
    ) {
        let n = weights.len();
        let mut down: Vec<bool> = (0..n).map(|i| down_bits >> i & 1 == 1).collect();
        if down.iter().all(|&d| d) {
            down[0] = false;
        }
        let live: u64 = (0..n).filter(|&i| !down[i]).map(|i| u64::from(weights[i])).sum();
        let picks = 12_000u64;
        for policy in [PolicyKind::RoundRobin, PolicyKind::Random, PolicyKind::PowerOfChoices, PolicyKind::LeastRequest] {
            let c = degraded(&weights, &down, policy);
            let counts = shares(&c, picks, seed, false);
            for i in 0..n {
                if down[i] {
                    prop_assert_eq!(counts[i], 0, "{} sent to down {}", policy, i);
                } else {
                    let p = f64::from(weights[i]) / live as f64;
                    prop_assert!(within(counts[i], picks, p, 2.0),
                        "{}: endpoint {} (w {}) served {} of {}, want {:.0}; weights {:?} down {:?}",
                        policy, i, weights[i], counts[i], picks, p * picks as f64, weights, down);
                }
            }
        }
    }

    /// Ring hash, Maglev and bounded load (idle): keys of down endpoints move
    /// to live ones, and each live endpoint's share of keys stays within
    /// 0.06 of `w_i / W_live` (the table's own unevenness at 65,536 ring
    /// points or 65,537 Maglev entries, plus where the moved keys land; a
    /// 1,024-point ring with 2 of 5 endpoints live is off by ~0.05 alone).
    #[test]
    fn hash_share_follows_weight_with_any_subset_down(
        weights in prop::collection::vec(1u32..6, 2..7),
        down_bits in any::<u8>(),
        seed in any::<u64>(),
    ) {
        let n = weights.len();
        let mut down: Vec<bool> = (0..n).map(|i| down_bits >> i & 1 == 1).collect();
        if down.iter().all(|&d| d) {
            down[n - 1] = false;
        }
        let live: u64 = (0..n).filter(|&i| !down[i]).map(|i| u64::from(weights[i])).sum();
        let picks = 20_000u64;
        for policy in [PolicyKind::RingHash, PolicyKind::Maglev, PolicyKind::BoundedLoad] {
            let c = degraded(&weights, &down, policy);
            let counts = shares(&c, picks, seed, true);
            for i in 0..n {
                let share = counts[i] as f64 / picks as f64;
                let want = if down[i] { 0.0 } else { f64::from(weights[i]) / live as f64 };
                prop_assert!((share - want).abs() <= 0.06,
                    "{}: endpoint {} share {:.3}, want {:.3}; weights {:?} down {:?}",
                    policy, i, share, want, weights, down);
            }
        }
    }

    /// Bounded load, unequal weights, some endpoints ejected while requests
    /// still run on them, callers inside strict node tiers or not: every
    /// pick lands on an available endpoint whose load after the pick is at
    /// most `ceil(c * (T + 1) * w / W)`, with T the requests in flight on
    /// available endpoints and W their total weight, computed here from
    /// each endpoint's own stats.
    #[test]
    fn bounded_load_bound_holds_with_weights_ejections_and_tiers(
        weights in prop::collection::vec(1u32..5, 3..10),
        held in prop::collection::vec(0u32..4, 10),
        eject in prop::collection::vec(any::<bool>(), 10),
        load_factor in 1.0f64..2.0,
        over_ring in any::<bool>(),
        local in any::<bool>(),
        steps in prop::collection::vec((0u64..3, any::<bool>(), 0usize..1000), 1..200),
    ) {
        let n = weights.len();
        let eps: Vec<_> = weighted(&weights)
            .into_iter()
            .enumerate()
            .map(|(i, e)| e.with_node(if i % 3 == 0 { "n0" } else { "n1" }))
            .collect();
        let mut cfg = config(PolicyKind::BoundedLoad);
        cfg.balancer.load_factor = load_factor;
        cfg.balancer.over = if over_ring { HashKind::RingHash } else { HashKind::Maglev };
        cfg.locality = Some(LocalityConfig { min_healthy_share: 0.0, ..LocalityConfig::default() });
        cfg.outlier.consecutive_5xx = 1;
        cfg.outlier.max_ejection_percent = 100;
        cfg.panic_threshold = 0;
        let c = Cluster::new(&eps, cfg).expect("valid");
        let mut live = hold(&c, &held[..n]);
        for (i, &e) in eject[..n].iter().enumerate() {
            if e {
                c.start(i).expect("in range").finish(Outcome::Status(503));
            }
        }
        let pct = load_factor_percent(load_factor);
        for (key, finish, which) in steps {
            if finish && !live.is_empty() {
                live.swap_remove(which % live.len());
                continue;
            }
            let avail: Vec<usize> = (0..n).filter(|&i| {
                let s = c.stats(i).expect("stats");
                s.healthy && !s.ejected
            }).collect();
            let t: u64 = avail.iter().map(|&i| u64::from(c.set().load(i))).sum();
            let w: u64 = avail.iter().map(|&i| u64::from(weights[i])).sum();
            let node = if local { Some("n0") } else { None };
            let g = c.pick(&keyed(key).with_locality(node, None)).expect("pick");
            let e = g.index();
            prop_assert!(avail.contains(&e), "picked unavailable {}", e);
            let load = u64::from(c.set().load(e));
            let bound = (u128::from(pct) * u128::from(t + 1) * u128::from(weights[e]))
                .div_ceil(100 * u128::from(w)) as u64;
            prop_assert!(load <= bound, "endpoint {} (w {}) load {} > bound {}", e, weights[e], load, bound);
            live.push(g);
        }
    }

    /// Bounded load under `local_only` (every request of the caller goes to
    /// its node): any weights, loads, nodes and health, panic threshold 0 or
    /// 50. A pick is `Some` iff the caller's node has an endpoint that may be
    /// picked (an available one, or any one while the node is in panic), it
    /// is on the node, and it fits the node's own bound:
    /// `load + 1 <= ceil(c * (T + 1) * w / W)` with `T` and `W` the load and
    /// weight of the node's eligible endpoints (all of them in panic).
    #[test]
    fn local_only_bounded_load_picks_iff_the_node_has_an_eligible_endpoint(
        weights in prop::collection::vec(1u32..6, 1..10),
        nodes in prop::collection::vec(0u8..3, 10),
        held in prop::collection::vec(0u32..5, 10),
        down in prop::collection::vec(any::<bool>(), 10),
        load_factor in 1.0f64..2.0,
        over_ring in any::<bool>(),
        panic in any::<bool>(),
        steps in prop::collection::vec((any::<u64>(), 0u8..3, any::<bool>()), 1..60),
    ) {
        let n = weights.len();
        let eps: Vec<_> = weighted(&weights)
            .into_iter()
            .enumerate()
            .map(|(i, e)| e.with_node(format!("n{}", nodes[i])))
            .collect();
        let mut cfg = config(PolicyKind::BoundedLoad);
        cfg.balancer.load_factor = load_factor;
        cfg.balancer.over = if over_ring { HashKind::RingHash } else { HashKind::Maglev };
        cfg.locality = Some(LocalityConfig { mode: LocalityMode::LocalOnly, ..LocalityConfig::default() });
        cfg.health.fall = 1;
        cfg.panic_threshold = if panic { 50 } else { 0 };
        let c = Cluster::new(&eps, cfg).expect("valid");
        let mut live = hold(&c, &held[..n]);
        for (i, &d) in down[..n].iter().enumerate() {
            if d {
                c.record_health_check(i, false);
            }
        }
        let pct = u128::from(load_factor_percent(load_factor));
        for (key, node, reserve) in steps {
            let name = format!("n{node}");
            let on_node: Vec<usize> = (0..n).filter(|&i| nodes[i] == node).collect();
            let up: Vec<usize> = on_node.iter().copied().filter(|&i| !down[i]).collect();
            let in_panic = (up.len() as u64) * 100 < u64::from(cfg.panic_threshold) * on_node.len() as u64;
            let eligible = if in_panic { on_node.clone() } else { up };
            let t: u128 = eligible.iter().map(|&i| u128::from(c.set().load(i))).sum();
            let w: u128 = eligible.iter().map(|&i| u128::from(weights[i])).sum();
            let cx = keyed(key).with_locality(Some(&name), None);
            let got = if reserve {
                c.pick(&cx).map(|g| { let i = g.index(); live.push(g); i })
            } else {
                c.pick_index(&cx)
            };
            prop_assert_eq!(got.is_some(), !eligible.is_empty(), "node {} eligible {:?}", node, eligible);
            if let Some(e) = got {
                prop_assert!(eligible.contains(&e), "picked {} outside {:?}", e, eligible);
                let before = u128::from(c.set().load(e)) - u128::from(reserve);
                prop_assert!(before * 100 * w < pct * (t + 1) * u128::from(weights[e]),
                    "endpoint {} (w {}) load {} over the node bound (T {}, W {})", e, weights[e], before, t, w);
            }
        }
    }
}

/// The reviewer's case: 10 endpoints of weight 1 on 10 nodes, c = 1.25,
/// `local_only`, caller on n0: the node's only endpoint takes every request
/// (before, the second one found it over the cluster-wide bound and got
/// `None`, a 503).
#[test]
fn local_only_bounded_load_keeps_serving_its_node() {
    let eps: Vec<_> = (0..10)
        .map(|i| endpoint(i).with_node(format!("n{i}")))
        .collect();
    let mut cfg = config(PolicyKind::BoundedLoad);
    cfg.locality = Some(LocalityConfig {
        mode: LocalityMode::LocalOnly,
        ..LocalityConfig::default()
    });
    let c = Cluster::new(&eps, cfg).expect("valid");
    let held: Vec<_> = (0..20)
        .map(|k| {
            c.pick(&keyed(k).with_locality(Some("n0"), None))
                .expect("the node's endpoint is up")
        })
        .collect();
    assert!(held.iter().all(|g| g.index() == 0));
    assert_eq!(c.set().load(0), 20);
}

fn keyed(key: u64) -> PickContext<'static> {
    PickContext::new().with_key(key).with_entropy(key)
}

/// The case: 5 equal endpoints, one down. Every live endpoint takes
/// 25% (here within 1.5 points over 20,000 picks), not 40% for the down
/// one's successor; with two adjacent down, 33% each, not 60%.
#[test]
fn round_robin_spreads_a_down_endpoints_share() {
    for down in [vec![2usize], vec![1, 2]] {
        let mut mask = vec![false; 5];
        down.iter().for_each(|&d| mask[d] = true);
        let c = degraded(&[1; 5], &mask, PolicyKind::RoundRobin);
        let picks = 20_000u64;
        let counts = shares(&c, picks, 7, false);
        let want = 1.0 / (5 - down.len()) as f64;
        for (i, &n) in counts.iter().enumerate() {
            let share = n as f64 / picks as f64;
            if mask[i] {
                assert_eq!(n, 0);
            } else {
                assert!(
                    (share - want).abs() < 0.015,
                    "down {down:?}: endpoint {i} share {share:.3}"
                );
            }
        }
    }
}

/// Each build starts round robin at a random slot: 20 fresh clusters of 10
/// endpoints do not all send their first request to the same endpoint
/// (chance 10^-19 if they were random; certain if they all started at 0).
#[test]
fn round_robin_starts_at_a_random_slot() {
    let eps = endpoints(10);
    let first: std::collections::HashSet<usize> = (0..20)
        .map(|_| {
            cluster(&eps, PolicyKind::RoundRobin)
                .pick_index(&ctx(0))
                .expect("pick")
        })
        .collect();
    assert!(first.len() > 1, "every build started at {first:?}");
}

/// Closed loop with `concurrency` requests always in flight; each step ends
/// one of them chosen uniformly (equal latency) and picks a new one.
fn closed_loop(c: &Cluster, concurrency: usize, steps: u64, seed: u64) -> Vec<u64> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut live = Vec::new();
    let mut counts = vec![0u64; c.endpoints().len()];
    for step in 0..steps + concurrency as u64 {
        if live.len() == concurrency {
            live.swap_remove(rng.usize(..concurrency));
        }
        let g = c.pick(&ctx(rng.u64(..))).expect("pick");
        if step >= concurrency as u64 {
            counts[g.index()] += 1;
        }
        live.push(g);
    }
    counts
}

/// P2C and least request honour weights: weights [4,1,1,1,1] give the heavy
/// endpoint 50% (within 3 points) with 1, 8, 32 and 64 requests in flight.
/// Uniform P2C draws capped it at 2/5 = 40%; minimising (load+1)/w gave it
/// 100% at concurrency 1. (At exactly 2 in flight loads cannot split 4:1
/// and P2C gives it about 43%: the quantisation the docs state.)
#[test]
fn p2c_and_least_request_honour_weights_at_any_concurrency() {
    let c_weights = [4, 1, 1, 1, 1];
    for policy in [PolicyKind::PowerOfChoices, PolicyKind::LeastRequest] {
        let c = cluster(&weighted(&c_weights), policy);
        for concurrency in [1usize, 8, 32, 64] {
            let steps = 40_000;
            let counts = closed_loop(&c, concurrency, steps, 11);
            let share = counts[0] as f64 / steps as f64;
            assert!(
                (share - 0.5).abs() < 0.03,
                "{policy} at concurrency {concurrency}: heavy share {share:.3}"
            );
        }
    }
}

/// Weights [10,1,...,1] (10 endpoints) under P2C: the heavy one takes about
/// 10/19 = 53%, not at most 2/10.
#[test]
fn p2c_heavy_endpoint_gets_its_weight() {
    let mut w = vec![1u32; 10];
    w[0] = 10;
    let c = cluster(&weighted(&w), PolicyKind::PowerOfChoices);
    let steps = 40_000;
    let counts = closed_loop(&c, 16, steps, 3);
    let share = counts[0] as f64 / steps as f64;
    assert!((share - 10.0 / 19.0).abs() < 0.04, "heavy share {share:.3}");
}

/// Panic mode: below `panic_threshold` percent available, picks spread over
/// every endpoint; at or above it, only live ones; 0 disables it.
#[test]
fn panic_threshold_spreads_over_all_below_it() {
    let mut cfg = ClusterConfig::new(PolicyKind::Random);
    cfg.health.fall = 1;
    let c = Cluster::new(&endpoints(10), cfg).expect("valid");
    (0..5).for_each(|i| c.record_health_check(i, false));
    assert!(!c.in_panic(), "5 of 10 = 50% is not below 50%");
    assert!((0..2_000).all(|k| c.pick_index(&ctx(k)).expect("pick") >= 5));
    c.record_health_check(5, false);
    assert!(c.in_panic(), "4 of 10");
    let mut counts = [0u32; 10];
    for k in 0..10_000 {
        counts[c.pick_index(&ctx(k)).expect("pick")] += 1;
    }
    assert!(
        counts.iter().all(|&n| n > 700),
        "all ten serve in panic: {counts:?}"
    );
    cfg.panic_threshold = 0;
    let c = Cluster::new(&endpoints(3), cfg).expect("valid");
    c.record_health_check(0, false);
    c.record_health_check(1, false);
    assert!(
        (0..100).all(|k| c.pick_index(&ctx(k)) == Some(2)),
        "no panic at 0"
    );
    c.record_health_check(2, false);
    assert_eq!(c.pick_index(&ctx(0)), None);
}
