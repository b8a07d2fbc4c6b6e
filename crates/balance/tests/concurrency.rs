//! Several OS threads picking and completing at once: bounded load's bound,
//! single ejection, the availability cache, and `local_only` bounded load.

mod common;

use std::sync::{Arc, Barrier};
use std::thread;

use common::*;
use meshless_balance::policy::load_factor_percent;
use meshless_balance::{Cluster, ClusterConfig, Outcome, PickContext, PolicyKind};

const THREADS: usize = 8;

/// Racing picks of one hot key never push an endpoint past the bound of
/// the total they create: after every round of 8 threads x 6 picks each
/// (held, no completions), each endpoint's load is at most
/// `ceil(c * T * w / W)`. Without the atomic reservation every thread saw
/// "home fits" and the home endpoint took most of the round.
#[test]
fn bounded_load_bound_holds_under_racing_picks() {
    let weights = [1u32, 2, 1, 3, 1];
    let w_total: u64 = weights.iter().map(|&w| u64::from(w)).sum();
    for load_factor in [1.0, 1.25] {
        let mut cfg = config(PolicyKind::BoundedLoad);
        cfg.balancer.load_factor = load_factor;
        let c = Arc::new(Cluster::new(&weighted(&weights), cfg).expect("valid"));
        let pct = u128::from(load_factor_percent(load_factor));
        for round in 0..40u64 {
            let barrier = Arc::new(Barrier::new(THREADS));
            let handles: Vec<_> = (0..THREADS)
                .map(|t| {
                    let (c, barrier) = (Arc::clone(&c), Arc::clone(&barrier));
                    thread::spawn(move || {
                        barrier.wait();
                        (0..6u64)
                            .map(|k| {
                                let ctx = PickContext::new()
                                    .with_key(round % 3)
                                    .with_entropy(round ^ (t as u64) << 8 ^ k);
                                c.pick(&ctx).expect("pick")
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            let guards: Vec<_> = handles
                .into_iter()
                .flat_map(|h| h.join().expect("thread"))
                .collect();
            let t = c.set().total_in_flight();
            assert_eq!(t, (THREADS * 6) as u64);
            for (i, &w) in weights.iter().enumerate() {
                let bound =
                    (pct * u128::from(t) * u128::from(w)).div_ceil(100 * u128::from(w_total));
                let load = u128::from(c.set().load(i));
                assert!(
                    load <= bound,
                    "c={load_factor} round {round}: endpoint {i} (w {w}) load {load} > {bound}"
                );
            }
            drop(guards);
            assert_eq!(c.set().total_in_flight(), 0);
            assert_eq!(c.set().eligible_in_flight(), 0);
        }
    }
}

/// Threads that pick, hold and complete at random leave no load behind, and
/// the eligible total always equals the sum over available endpoints once
/// they stop (its updates never drift), with health flapping meanwhile.
#[test]
fn eligible_total_never_drifts() {
    let mut cfg = config(PolicyKind::BoundedLoad);
    cfg.health.fall = 1;
    cfg.health.rise = 1;
    let c = Arc::new(Cluster::new(&endpoints(6), cfg).expect("valid"));
    let barrier = Arc::new(Barrier::new(THREADS + 1));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (c, barrier) = (Arc::clone(&c), Arc::clone(&barrier));
            thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t as u64);
                let mut held = Vec::new();
                barrier.wait();
                for _ in 0..5_000 {
                    if rng.bool() && !held.is_empty() {
                        held.swap_remove(rng.usize(..held.len()));
                    } else if let Some(g) = c.pick(&PickContext::new().with_key(rng.u64(..4))) {
                        held.push(g);
                    }
                }
                // Half of the threads stop holding; the rest keep theirs.
                if t % 2 == 0 {
                    held.clear();
                }
                held
            })
        })
        .collect();
    barrier.wait();
    let mut rng = fastrand::Rng::with_seed(99);
    for _ in 0..2_000 {
        c.record_health_check(rng.usize(..6), rng.bool());
    }
    let held: Vec<_> = handles
        .into_iter()
        .flat_map(|h| h.join().expect("thread"))
        .collect();
    let sum: u64 = (0..6)
        .filter(|&i| {
            let s = c.stats(i).expect("stats");
            s.healthy && !s.ejected
        })
        .map(|i| u64::from(c.set().load(i)))
        .sum();
    assert_eq!(c.set().eligible_in_flight(), sum);
    assert_eq!(c.set().total_in_flight(), held.len() as u64);
    drop(held);
    assert_eq!(c.set().eligible_in_flight(), 0);
    assert_eq!(c.set().total_in_flight(), 0);
}

/// Two failing completions at once eject an endpoint once: `times_ejected`
/// is 1 after 8 threads each end a failed request on it together.
#[test]
fn concurrent_failures_eject_once() {
    for _ in 0..100 {
        let mut cfg = ClusterConfig::new(PolicyKind::RoundRobin);
        cfg.outlier.consecutive_5xx = 1;
        cfg.outlier.max_ejection_percent = 100;
        let c = Arc::new(Cluster::new(&endpoints(4), cfg).expect("valid"));
        let barrier = Arc::new(Barrier::new(THREADS));
        let guards: Vec<_> = (0..THREADS)
            .map(|_| c.start(0).expect("in range"))
            .collect();
        let handles: Vec<_> = guards
            .into_iter()
            .map(|g| {
                let barrier = Arc::clone(&barrier);
                thread::spawn(move || {
                    barrier.wait();
                    g.finish(Outcome::Status(503));
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().expect("thread"));
        let s = c.stats(0).expect("stats");
        assert!(s.ejected);
        assert_eq!(
            s.times_ejected, 1,
            "ejected once, not once per racing failure"
        );
    }
}

/// The availability cache never pairs the count of one moment with the
/// weight of another: with weights 1, 2, 4, 8, 16 the available weight
/// names the available set, so the count must be its number of bits, on
/// every read while other threads flip health; and once they stop the cache
/// reports the truth.
#[test]
fn availability_cache_reads_are_consistent() {
    let weights = [1u32, 2, 4, 8, 16];
    let mut cfg = config(PolicyKind::RoundRobin);
    cfg.health.fall = 1;
    cfg.health.rise = 1;
    let c = Arc::new(Cluster::new(&weighted(&weights), cfg).expect("valid"));
    let flippers: Vec<_> = (0..2)
        .map(|t| {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t);
                for _ in 0..20_000 {
                    c.record_health_check(rng.usize(..5), rng.bool());
                }
            })
        })
        .collect();
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                for _ in 0..20_000 {
                    let (count, weight) = c.set().available();
                    assert_eq!(
                        count,
                        u64::from(weight.count_ones()),
                        "torn read: {count}, {weight}"
                    );
                }
            })
        })
        .collect();
    flippers
        .into_iter()
        .chain(readers)
        .for_each(|h| h.join().expect("thread"));
    let truth: u64 = (0..5)
        .filter(|&i| c.stats(i).expect("stats").healthy)
        .map(|i| u64::from(weights[i]))
        .sum();
    assert_eq!(c.set().available().1, truth);
}

/// `local_only` under bounded load with 8 threads picking for one node
/// (2 of its 10 endpoints; endpoint 1 flapping, endpoint 0 always up):
/// every pick is answered, always on the node, however many requests the
/// node already holds, and nothing is left in flight afterwards.
#[test]
fn local_only_bounded_load_answers_every_racing_pick() {
    use meshless_balance::{LocalityConfig, LocalityMode};
    let eps: Vec<_> = (0..10)
        .map(|i| endpoint(i).with_node(if i < 2 { "n0" } else { "n1" }))
        .collect();
    let mut cfg = config(PolicyKind::BoundedLoad);
    cfg.locality = Some(LocalityConfig {
        mode: LocalityMode::LocalOnly,
        ..LocalityConfig::default()
    });
    cfg.health.fall = 1;
    cfg.health.rise = 1;
    let c = Arc::new(Cluster::new(&eps, cfg).expect("valid"));
    let barrier = Arc::new(Barrier::new(THREADS + 1));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (c, barrier) = (Arc::clone(&c), Arc::clone(&barrier));
            thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t as u64);
                let mut held = Vec::new();
                barrier.wait();
                for _ in 0..3_000 {
                    if rng.u8(..4) == 0 && !held.is_empty() {
                        held.swap_remove(rng.usize(..held.len()));
                    } else {
                        let ctx = PickContext::new()
                            .with_key(rng.u64(..8))
                            .with_locality(Some("n0"), None);
                        let g = c.pick(&ctx).expect("the node has an endpoint up");
                        assert!(g.index() < 2, "off the node: {}", g.index());
                        held.push(g);
                    }
                }
                held.len()
            })
        })
        .collect();
    barrier.wait();
    let mut rng = fastrand::Rng::with_seed(7);
    for _ in 0..2_000 {
        c.record_health_check(1, rng.bool());
    }
    let held: usize = handles.into_iter().map(|h| h.join().expect("thread")).sum();
    assert!(held > 0);
    assert_eq!(c.set().total_in_flight(), 0);
}
