//! Health, outlier ejection, panic mode, locality and rebuilds.

mod common;

use std::time::Duration;

use common::*;
use meshless_balance::{
    Cluster, ClusterConfig, HealthConfig, LocalityConfig, LocalityMode, Outcome, OutlierConfig,
    PickContext, PolicyKind,
};
use meshless_model::{Conditions, Endpoint};
use proptest::prelude::*;

fn with_outlier(policy: PolicyKind) -> ClusterConfig {
    let mut c = ClusterConfig::new(policy);
    c.outlier = OutlierConfig {
        max_ejection_percent: 50,
        ..OutlierConfig::default()
    };
    c
}

/// Sends `count` requests to endpoint `i` that end with `outcome`.
fn fail(c: &Cluster, i: usize, count: usize, outcome: Outcome) {
    for _ in 0..count {
        c.start(i).expect("in range").finish(outcome);
    }
}

#[test]
fn consecutive_5xx_eject_for_base_time_times_ejections() {
    let (c, clock) = manual(&endpoints(4), with_outlier(PolicyKind::RoundRobin));
    fail(&c, 0, 4, Outcome::Status(500));
    assert!(!c.stats(0).expect("stats").ejected, "4 < 5 consecutive");
    fail(&c, 0, 1, Outcome::Status(503));
    let s = c.stats(0).expect("stats");
    assert!(s.ejected && s.times_ejected == 1);
    for k in 0..100 {
        assert_ne!(c.pick_index(&PickContext::new().with_entropy(k)), Some(0));
    }
    clock.advance(Duration::from_secs(29));
    c.tick();
    assert!(c.stats(0).expect("stats").ejected, "30 s not over");
    clock.advance(Duration::from_secs(1));
    c.tick();
    assert!(!c.stats(0).expect("stats").ejected);
    // Second ejection lasts 2 x base.
    fail(&c, 0, 5, Outcome::ConnectFailed);
    clock.advance(Duration::from_secs(59));
    c.tick();
    assert!(
        c.stats(0).expect("stats").ejected,
        "second ejection is 60 s"
    );
    clock.advance(Duration::from_secs(1));
    c.tick();
    assert!(!c.stats(0).expect("stats").ejected);
}

#[test]
fn a_success_resets_the_consecutive_count() {
    let (c, _) = manual(&endpoints(4), with_outlier(PolicyKind::RoundRobin));
    for _ in 0..3 {
        fail(&c, 1, 4, Outcome::Status(500));
        fail(&c, 1, 1, Outcome::Status(200));
    }
    assert!(!c.stats(1).expect("stats").ejected);
    // 4xx is the client's fault: it counts as a response that works.
    fail(&c, 1, 4, Outcome::Status(500));
    fail(&c, 1, 1, Outcome::Status(404));
    fail(&c, 1, 4, Outcome::Status(500));
    assert!(!c.stats(1).expect("stats").ejected);
    // Cancelled requests say nothing.
    fail(&c, 1, 1, Outcome::Cancelled);
    fail(&c, 1, 1, Outcome::Status(500));
    assert!(c.stats(1).expect("stats").ejected);
}

#[test]
fn gateway_errors_eject_on_their_own_threshold() {
    let mut cfg = with_outlier(PolicyKind::RoundRobin);
    cfg.outlier.consecutive_5xx = 0;
    cfg.outlier.consecutive_gateway_errors = 3;
    let (c, _) = manual(&endpoints(4), cfg);
    fail(&c, 2, 5, Outcome::Status(500));
    assert!(
        !c.stats(2).expect("stats").ejected,
        "500 is not a gateway error"
    );
    fail(&c, 2, 3, Outcome::Timeout);
    assert!(c.stats(2).expect("stats").ejected);
}

/// Envoy's default: gateway failures are tracked, not enforced
/// (`enforcing_consecutive_gateway_failure` 0%). With `consecutive_5xx`
/// off, any number of gateway errors in a row ejects nothing; with the
/// default `consecutive_5xx` (5), five of them eject as 5xx.
#[test]
fn gateway_errors_alone_do_not_eject_by_default() {
    assert_eq!(OutlierConfig::default().consecutive_gateway_errors, 0);
    let mut cfg = with_outlier(PolicyKind::RoundRobin);
    cfg.outlier.consecutive_5xx = 0;
    let (c, _) = manual(&endpoints(4), cfg);
    for outcome in [
        Outcome::Status(502),
        Outcome::Status(503),
        Outcome::Status(504),
        Outcome::ConnectFailed,
        Outcome::Reset,
        Outcome::Timeout,
    ] {
        fail(&c, 0, 20, outcome);
    }
    assert!(!c.stats(0).expect("stats").ejected, "not enforced");
    let (c, _) = manual(&endpoints(4), with_outlier(PolicyKind::RoundRobin));
    fail(&c, 0, 4, Outcome::ConnectFailed);
    assert!(!c.stats(0).expect("stats").ejected, "4 < consecutive_5xx");
    fail(&c, 0, 1, Outcome::Status(503));
    assert!(c.stats(0).expect("stats").ejected, "5 in a row, as 5xx");
}

/// A long TCP flow's success is its connection: reported at once, it
/// breaks a run of gateway errors that happen while it is open.
#[test]
fn a_success_reported_now_breaks_the_run_of_failures_around_it() {
    let mut cfg = with_outlier(PolicyKind::RoundRobin);
    cfg.outlier.consecutive_gateway_errors = 2;
    let (c, _) = manual(&endpoints(4), cfg);
    let mut first = c.start(1).expect("in range");
    first.report_now(Outcome::Status(200));
    fail(&c, 1, 1, Outcome::ConnectFailed);
    let mut second = c.start(1).expect("in range");
    second.report_now(Outcome::Status(200));
    fail(&c, 1, 1, Outcome::ConnectFailed);
    assert!(
        !c.stats(1).expect("stats").ejected,
        "no two failures in a row"
    );
    assert_eq!(
        c.stats(1).expect("stats").in_flight,
        2,
        "the flows still count"
    );
    drop((first, second));
    assert_eq!(c.stats(1).expect("stats").in_flight, 0);
    assert!(
        !c.stats(1).expect("stats").ejected,
        "the drops record nothing more"
    );
}

#[test]
fn a_single_endpoint_cluster_is_never_ejected() {
    // envoyproxy/envoy #17504
    let (c, _) = manual(&endpoints(1), with_outlier(PolicyKind::RoundRobin));
    fail(&c, 0, 50, Outcome::Status(500));
    assert!(!c.stats(0).expect("stats").ejected);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// However endpoints fail, ejections stay within max(1, pct) and at
    /// least one endpoint stays available (envoy #26877, #3263).
    #[test]
    fn ejection_limit_never_strands_the_cluster(
        n in 1usize..25,
        pct in 0u8..=100,
        failures in prop::collection::vec(0usize..25, 0..200),
    ) {
        let mut cfg = ClusterConfig::new(PolicyKind::RoundRobin);
        cfg.outlier.max_ejection_percent = pct;
        cfg.outlier.consecutive_5xx = 1;
        let (c, _) = manual(&endpoints(n), cfg);
        for f in failures {
            fail(&c, f % n, 1, Outcome::Status(500));
        }
        let ejected = (0..n).filter(|&i| c.stats(i).expect("stats").ejected).count();
        let allowed = (n * usize::from(pct) / 100).max(1).min(n - 1);
        prop_assert!(ejected <= allowed, "{} ejected of {}, allowed {}", ejected, n, allowed);
        prop_assert!(ejected < n);
    }
}

#[test]
fn ejection_spares_the_last_healthy_endpoint() {
    let mut cfg = with_outlier(PolicyKind::RoundRobin);
    cfg.outlier.max_ejection_percent = 100;
    cfg.health.fall = 1;
    let (c, _) = manual(&endpoints(3), cfg);
    c.record_health_check(0, false);
    c.record_health_check(1, false);
    fail(&c, 2, 10, Outcome::Status(500));
    assert!(
        !c.stats(2).expect("stats").ejected,
        "the only available endpoint stays"
    );
}

#[test]
fn health_checks_follow_rise_and_fall() {
    let mut cfg = ClusterConfig::new(PolicyKind::RoundRobin);
    cfg.health = HealthConfig {
        rise: 2,
        fall: 3,
        initially_healthy: true,
        active: true,
    };
    let c = Cluster::new(&endpoints(2), cfg).expect("valid");
    c.record_health_check(0, false);
    c.record_health_check(0, false);
    assert!(c.stats(0).expect("stats").healthy);
    c.record_health_check(0, false);
    assert!(!c.stats(0).expect("stats").healthy);
    c.record_health_check(0, true);
    assert!(!c.stats(0).expect("stats").healthy);
    c.record_health_check(0, true);
    assert!(c.stats(0).expect("stats").healthy);
    // New endpoints can be made to earn their place first.
    cfg.health.initially_healthy = false;
    let c = Cluster::new(&endpoints(2), cfg).expect("valid");
    assert!(!c.stats(1).expect("stats").healthy);
}

#[test]
fn panic_mode_picks_among_all_when_none_is_available() {
    let mut cfg = ClusterConfig::new(PolicyKind::LeastRequest);
    cfg.health.fall = 1;
    let c = Cluster::new(&endpoints(3), cfg).expect("valid");
    (0..3).for_each(|i| c.record_health_check(i, false));
    assert!(c.pick(&PickContext::new()).is_some());
    cfg.panic_threshold = 0;
    let c = Cluster::new(&endpoints(3), cfg).expect("valid");
    (0..3).for_each(|i| c.record_health_check(i, false));
    assert!(c.pick(&PickContext::new()).is_none());
}

#[test]
fn rebuild_keeps_state_of_endpoints_that_stay() {
    let (c, _) = manual(&endpoints(5), with_outlier(PolicyKind::LeastRequest));
    let _held = hold(&c, &[3, 0, 1, 0, 0]);
    fail(&c, 4, 5, Outcome::Status(500));
    assert!(c.stats(4).expect("stats").ejected);
    // Drop ep-1, reweight ep-0, add ep-9, reorder.
    let next = vec![
        endpoint(4),
        endpoint(9),
        endpoint(2),
        endpoint(0).with_weight(3),
        endpoint(3),
    ];
    let c2 = c.rebuild(&next, *c.config()).expect("valid");
    let by_id = |id: &str| {
        let i = c2
            .endpoints()
            .iter()
            .position(|e| e.id.as_str() == id)
            .expect("present");
        c2.stats(i).expect("stats")
    };
    assert_eq!(by_id("ep-0").in_flight, 3);
    assert_eq!(by_id("ep-2").in_flight, 1);
    assert!(by_id("ep-4").ejected);
    assert_eq!(by_id("ep-9").in_flight, 0);
    assert_eq!(c2.set().total_in_flight(), 4);
    // A rejected rebuild changes nothing.
    let mut bad = next.clone();
    bad[1].port = 0;
    assert!(c2.rebuild(&bad, *c2.config()).is_err());
}

#[test]
fn only_routable_endpoints_are_picked() {
    let terminating = Conditions {
        ready: false,
        serving: true,
        terminating: true,
    };
    let eps = vec![endpoint(0).with_conditions(terminating), endpoint(1)];
    let c = cluster(&eps, PolicyKind::RoundRobin);
    assert_eq!(c.endpoints().len(), 1);
    assert_eq!(c.endpoints()[0].id.as_str(), "ep-1");
    // With none ready, serving+terminating endpoints still answer.
    let c = cluster(&eps[..1], PolicyKind::RoundRobin);
    assert_eq!(c.endpoints().len(), 1);
}

fn placed(i: usize, node: &str, zone: &str) -> Endpoint {
    endpoint(i).with_node(node).with_zone(zone)
}

fn local_cluster(policy: PolicyKind, min_healthy_share: f64) -> Cluster {
    let eps = vec![
        placed(0, "n1", "z1"),
        placed(1, "n1", "z1"),
        placed(2, "n2", "z1"),
        placed(3, "n3", "z2"),
        placed(4, "n4", "z2"),
    ];
    let mut cfg = ClusterConfig::new(policy);
    cfg.locality = Some(LocalityConfig {
        min_healthy_share,
        ..LocalityConfig::default()
    });
    cfg.health.fall = 1;
    // Locality alone: panic mode (3 of 5 down is below 50%) is tested apart.
    cfg.panic_threshold = 0;
    Cluster::new(&eps, cfg).expect("valid")
}

#[test]
fn locality_prefers_node_then_zone_then_anywhere() {
    for policy in PolicyKind::ALL {
        let c = local_cluster(policy, 0.3);
        let at = |node, zone, k: u64| {
            c.pick_index(
                &PickContext::new()
                    .with_locality(node, zone)
                    .with_entropy(k)
                    .with_key(k),
            )
            .expect("pick")
        };
        for k in 0..50 {
            assert!(at(Some("n1"), Some("z1"), k) <= 1, "{policy}: node first");
            assert!(at(Some("n9"), Some("z1"), k) <= 2, "{policy}: then zone");
            assert!(
                at(Some("n9"), Some("z9"), k) <= 4,
                "{policy}: then anywhere"
            );
        }
        // One of two on n1 down: share 0.5 is not under 0.5, stay on the node.
        c.record_health_check(0, false);
        for k in 0..50 {
            assert_eq!(at(Some("n1"), Some("z1"), k), 1, "{policy}");
        }
        // Both down: spill to the zone (1 of 3 up: share 0.33 >= 0.3).
        c.record_health_check(1, false);
        for k in 0..50 {
            assert_eq!(at(Some("n1"), Some("z1"), k), 2, "{policy}");
        }
        // With a 0.5 threshold the same zone is too degraded: anywhere healthy.
        let strict = local_cluster(policy, 0.5);
        strict.record_health_check(0, false);
        strict.record_health_check(1, false);
        for k in 0..50 {
            let ctx = PickContext::new()
                .with_locality(Some("n1"), Some("z1"))
                .with_entropy(k)
                .with_key(k);
            assert!(strict.pick_index(&ctx).expect("pick") >= 2, "{policy}");
        }
        // Zone z1 entirely down: anywhere.
        c.record_health_check(2, false);
        for k in 0..50 {
            assert!(at(Some("n1"), Some("z1"), k) >= 3, "{policy}");
        }
    }
}

#[test]
fn locality_spills_when_the_tier_is_at_its_bound() {
    let c = local_cluster(PolicyKind::BoundedLoad, 0.5);
    let local = |k: u64| {
        PickContext::new()
            .with_locality(Some("n1"), Some("z1"))
            .with_key(k)
            .with_entropy(k)
    };
    // Load the node's two endpoints: with 5 endpoints and c = 1.25, their
    // bound soon falls below their load and requests leave the node.
    let mut held = Vec::new();
    let mut off_node = 0;
    for k in 0..40 {
        let g = c.pick(&local(k)).expect("pick");
        if g.index() > 1 {
            off_node += 1;
        }
        held.push(g);
    }
    assert!(off_node > 0, "requests spill off the node once it is full");
    let max = (0..5).map(|i| c.set().load(i)).max().unwrap_or(0);
    assert!(max <= (1.25f64 * 40.0 / 5.0).ceil() as u32);
}

/// A rebuild that is never published (a reload that failed later) changes
/// nothing: the running snapshot still ejects, ticks and counts its own
/// members.
#[test]
fn an_unpublished_rebuild_has_no_effect() {
    let (c, clock) = manual(&endpoints(4), with_outlier(PolicyKind::RoundRobin));
    let other = c
        .rebuild(&[endpoint(9)], *c.config())
        .expect("valid rebuild");
    drop(other);
    fail(&c, 0, 5, Outcome::Status(500));
    assert!(c.stats(0).expect("stats").ejected, "ep-0 is still a member");
    clock.advance(Duration::from_secs(30));
    c.tick();
    assert!(!c.stats(0).expect("stats").ejected, "tick still sees ep-0");
}

/// Publishing a rebuild makes its members the ones ejection counts; an
/// older snapshot never publishes over a newer one.
#[test]
fn publish_installs_the_newest_snapshot_only() {
    let (c, _) = manual(&endpoints(2), with_outlier(PolicyKind::RoundRobin));
    let bigger = c.rebuild(&endpoints(10), *c.config()).expect("valid");
    bigger.publish();
    c.publish(); // older: ignored
    // With 10 members at 50%, five may be ejected; with 2, only one.
    for i in 0..3 {
        fail(&bigger, i, 5, Outcome::Status(500));
    }
    let ejected = (0..10)
        .filter(|&i| bigger.stats(i).expect("stats").ejected)
        .count();
    assert_eq!(ejected, 3);
}

/// An endpoint that goes not-ready and comes back keeps its ejection
/// (and its ejection count) instead of returning with a clean slate.
#[test]
fn ejection_survives_a_not_ready_flap() {
    let (c, clock) = manual(&endpoints(4), with_outlier(PolicyKind::RoundRobin));
    fail(&c, 0, 5, Outcome::Status(500));
    assert!(c.stats(0).expect("stats").ejected);
    let without = c.rebuild(&endpoints(4)[1..], *c.config()).expect("valid");
    without.publish();
    let back = without.rebuild(&endpoints(4), *c.config()).expect("valid");
    back.publish();
    let i = back
        .endpoints()
        .iter()
        .position(|e| e.id.as_str() == "ep-0")
        .expect("present");
    let s = back.stats(i).expect("stats");
    assert!(s.ejected && s.times_ejected == 1, "{s:?}");
    assert!((0..100).all(|k| back.pick_index(&PickContext::new().with_entropy(k)) != Some(i)));
    clock.advance(Duration::from_secs(30));
    back.tick();
    assert!(!back.stats(i).expect("stats").ejected);
}

/// An ejected endpoint absent from a rebuild that is never published and
/// present in the next rebuild (two deltas before the first pick) keeps
/// its ejection: the build finds it among the published members.
#[test]
fn ejection_survives_build_build_publish() {
    let (c, clock) = manual(&endpoints(4), with_outlier(PolicyKind::RoundRobin));
    fail(&c, 0, 5, Outcome::Status(500));
    assert!(c.stats(0).expect("stats").ejected);
    let without = c.rebuild(&endpoints(4)[1..], *c.config()).expect("valid");
    let back = without.rebuild(&endpoints(4), *c.config()).expect("valid");
    back.publish();
    let i = back
        .endpoints()
        .iter()
        .position(|e| e.id.as_str() == "ep-0")
        .expect("present");
    let s = back.stats(i).expect("stats");
    assert!(s.ejected && s.times_ejected == 1, "{s:?}");
    assert!((0..100).all(|k| back.pick_index(&PickContext::new().with_entropy(k)) != Some(i)));
    // The unpublished build stays unpublished; the ejection ends on time.
    without.publish();
    assert!(back.stats(i).expect("stats").ejected);
    clock.advance(Duration::from_secs(30));
    back.tick();
    assert!(!back.stats(i).expect("stats").ejected);
}

/// The same after a departure: left while ejected (published), absent
/// from an unpublished build, back in the next one.
#[test]
fn a_departed_ejection_survives_build_build_publish() {
    let (c, _) = manual(&endpoints(4), with_outlier(PolicyKind::RoundRobin));
    fail(&c, 0, 5, Outcome::Status(500));
    let gone = c.rebuild(&endpoints(4)[1..], *c.config()).expect("valid");
    gone.publish();
    let still_gone = gone
        .rebuild(&endpoints(4)[2..], *c.config())
        .expect("valid");
    let back = still_gone
        .rebuild(&endpoints(4), *c.config())
        .expect("valid");
    back.publish();
    let s = back.stats(0).expect("stats");
    assert_eq!(back.endpoints()[0].id.as_str(), "ep-0");
    assert!(s.ejected && s.times_ejected == 1, "{s:?}");
}

fn spread_cluster(mode: LocalityMode, n_per_node: usize, nodes: usize) -> Cluster {
    let eps: Vec<Endpoint> = (0..n_per_node * nodes)
        .map(|i| {
            let node = format!("n{}", i / n_per_node);
            endpoint(i).with_node(&node).with_zone("z1")
        })
        .collect();
    let mut cfg = ClusterConfig::new(PolicyKind::Random);
    cfg.locality = Some(LocalityConfig {
        mode,
        ..LocalityConfig::default()
    });
    cfg.health.fall = 1;
    cfg.outlier = OutlierConfig::disabled();
    Cluster::new(&eps, cfg).expect("valid")
}

/// Proportional (Envoy zone-aware) locality: a node with one of its two
/// endpoints down keeps the share its capacity can take, relative to the
/// cluster's — (1/2) / (11/12) = 54.5% — on its live endpoint, and spills
/// the rest outside the node, instead of the live one taking everything.
#[test]
fn proportional_locality_keeps_what_the_node_can_take() {
    let c = spread_cluster(LocalityMode::Proportional, 2, 6);
    let at_n0 = |k: u64| {
        c.pick_index(
            &PickContext::new()
                .with_locality(Some("n0"), Some("z1"))
                .with_entropy(k),
        )
        .expect("pick")
    };
    assert!((0..2_000).all(|k| at_n0(k) <= 1), "all healthy: node only");
    c.record_health_check(0, false);
    let picks = 20_000u64;
    let local = (0..picks).filter(|&k| at_n0(k) == 1).count() as f64 / picks as f64;
    assert!((local - 6.0 / 11.0).abs() < 0.02, "local share {local:.3}");
    assert!((0..picks).all(|k| at_n0(k) != 0));
    // Below min_cluster_size (6) there is no locality at all.
    let small = spread_cluster(LocalityMode::Proportional, 1, 5);
    let ctx = |k| {
        PickContext::new()
            .with_locality(Some("n0"), Some("z1"))
            .with_entropy(k)
    };
    let off = (0..2_000)
        .filter(|&k| small.pick_index(&ctx(k)) != Some(0))
        .count();
    assert!(
        off > 1_000,
        "5 endpoints: spread over all ({off} of 2000 off the node)"
    );
}

/// `local_only` (Kubernetes internalTrafficPolicy: Local): only the caller's
/// node, never spill; nothing when the node has no endpoint up (panic off)
/// or the caller's node is unknown.
#[test]
fn local_only_never_leaves_the_node() {
    let c = spread_cluster(LocalityMode::LocalOnly, 2, 3);
    let at = |node: Option<&'static str>, k: u64| {
        c.pick_index(
            &PickContext::new()
                .with_locality(node, Some("z1"))
                .with_entropy(k),
        )
    };
    assert!((0..500).all(|k| matches!(at(Some("n1"), k), Some(2 | 3))));
    assert_eq!(at(None, 0), None);
    assert_eq!(at(Some("elsewhere"), 0), None);
    c.record_health_check(2, false);
    assert!((0..500).all(|k| at(Some("n1"), k) == Some(3)));
    c.record_health_check(3, false);
    // 0 of 2 on the node: panic (default 50%) spreads over the node's own.
    assert!((0..500).all(|k| matches!(at(Some("n1"), k), Some(2 | 3))));
    let mut cfg = *c.config();
    cfg.panic_threshold = 0;
    let strict = c.rebuild(c.endpoints(), cfg).expect("valid");
    assert_eq!(
        strict.pick_index(&PickContext::new().with_locality(Some("n1"), None)),
        None
    );
}

/// A tier's ring index is sized to the ring: 1,000 node tiers of 2
/// endpoints under ring hash hold ~1,024 points each, not a 65,537-entry
/// index each (which was ~270 MB per snapshot).
#[test]
fn tier_rings_are_small() {
    use meshless_balance::policy::{RingHash, auto_ring_size};
    let ids = ["a", "b"];
    let ring = RingHash::new(&[0, 1], |m| ids[m as usize], |_| 1, auto_ring_size(2));
    assert!(ring.heap_bytes() < 20_000, "{} bytes", ring.heap_bytes());
}

/// `zone`: the caller's zone while enough of it is up, never its node
/// alone; everything once the zone is down.
#[test]
fn zone_locality_prefers_the_zone_not_the_node() {
    // Two zones of three endpoints, one node each for the first two.
    let eps: Vec<Endpoint> = (0..6)
        .map(|i| {
            endpoint(i)
                .with_node(format!("n{i}"))
                .with_zone(if i < 3 { "z1" } else { "z2" })
        })
        .collect();
    let mut cfg = ClusterConfig::new(PolicyKind::Random);
    cfg.locality = Some(LocalityConfig {
        mode: LocalityMode::Zone,
        ..LocalityConfig::default()
    });
    cfg.health.fall = 1;
    cfg.outlier = OutlierConfig::disabled();
    let c = Cluster::new(&eps, cfg).expect("valid");
    let at = |k: u64| {
        c.pick_index(
            &PickContext::new()
                .with_locality(Some("n0"), Some("z1"))
                .with_entropy(k),
        )
        .expect("pick")
    };
    let picks: std::collections::BTreeSet<usize> = (0..600).map(at).collect();
    assert_eq!(picks, [0, 1, 2].into(), "the whole zone, not the node");
    for i in 0..3 {
        c.record_health_check(i, false);
    }
    let spilled: std::collections::BTreeSet<usize> = (0..600).map(at).collect();
    assert_eq!(spilled, [3, 4, 5].into(), "zone down: anywhere else");
}

/// `web-0` with a new address (a StatefulSet pod rescheduled) is a new
/// host, as Envoy keys hosts by address: no ejection, failure streak,
/// ejection count or health inherited, whether it moved while a member or
/// while away (departed ejected). The same id at the same address keeps
/// its ejection. Requests still running on the old address stay counted
/// on the old host and end there.
#[test]
fn a_moved_endpoint_starts_clean() {
    let moved = |eps: &[Endpoint]| {
        let mut eps = eps.to_vec();
        eps[0].port += 1_000;
        eps
    };
    let ejected_ep0 = || {
        let (c, _) = manual(&endpoints(4), with_outlier(PolicyKind::RoundRobin));
        fail(&c, 0, 5, Outcome::Status(500));
        assert!(c.stats(0).expect("stats").ejected);
        c
    };
    // Same id, same address: still ejected.
    let c = ejected_ep0();
    let same = c.rebuild(&endpoints(4), *c.config()).expect("valid");
    same.publish();
    assert!(same.stats(0).expect("stats").ejected);
    // Same id, new port, moved while a member; a request on the old host
    // still runs.
    let c = ejected_ep0();
    let running = c.start(0).expect("in range");
    let at_new = c
        .rebuild(&moved(&endpoints(4)), *c.config())
        .expect("valid");
    at_new.publish();
    let s = at_new.stats(0).expect("stats");
    assert!(!s.ejected && s.healthy && s.times_ejected == 0, "{s:?}");
    assert_eq!(s.in_flight, 0, "the running request is on the old address");
    assert!((0..100).any(|k| at_new.pick_index(&PickContext::new().with_entropy(k)) == Some(0)));
    assert_eq!(at_new.set().total_in_flight(), 1);
    drop(running);
    assert_eq!(at_new.set().total_in_flight(), 0);
    // Moved while away: left ejected, back at a new address.
    let c = ejected_ep0();
    let without = c.rebuild(&endpoints(4)[1..], *c.config()).expect("valid");
    without.publish();
    let back = without
        .rebuild(&moved(&endpoints(4)), *c.config())
        .expect("valid");
    back.publish();
    let i = back
        .endpoints()
        .iter()
        .position(|e| e.id.as_str() == "ep-0")
        .expect("present");
    let s = back.stats(i).expect("stats");
    assert!(!s.ejected && s.times_ejected == 0, "{s:?}");
    // An unhealthy endpoint that moves starts as a new one (healthy by default).
    let c = cluster(&endpoints(2), PolicyKind::RoundRobin);
    for _ in 0..3 {
        c.record_health_check(0, false);
    }
    assert!(!c.stats(0).expect("stats").healthy);
    let at_new = c
        .rebuild(&moved(&endpoints(2)), *c.config())
        .expect("valid");
    at_new.publish();
    assert!(at_new.stats(0).expect("stats").healthy);
}

/// `max_ejection_time` below `base_ejection_time`: Envoy ejects for at
/// least the base (its cap is the larger of the two), so a base of 60 s
/// with the cap at 10 s still ejects for 60 s, then 60 s again.
#[test]
fn max_ejection_time_below_base_does_not_shorten_the_base() {
    let mut cfg = with_outlier(PolicyKind::RoundRobin);
    cfg.outlier.base_ejection_time = Duration::from_secs(60);
    cfg.outlier.max_ejection_time = Duration::from_secs(10);
    let (c, clock) = manual(&endpoints(4), cfg);
    for round in 0..2 {
        fail(&c, 0, 5, Outcome::Status(500));
        assert!(c.stats(0).expect("stats").ejected, "round {round}");
        clock.advance(Duration::from_secs(59));
        c.tick();
        assert!(
            c.stats(0).expect("stats").ejected,
            "round {round}: 60 s, not 10 s"
        );
        clock.advance(Duration::from_secs(1));
        c.tick();
        assert!(
            !c.stats(0).expect("stats").ejected,
            "round {round}: capped at 60 s"
        );
    }
}

/// A reload that removes the active health check: nothing could ever
/// clear an unhealthy mark again, so the new snapshot clears them all,
/// and a check of the old configuration still under way changes nothing.
#[test]
fn removing_the_health_check_makes_every_endpoint_healthy_again() {
    let mut cfg = ClusterConfig::new(PolicyKind::RoundRobin);
    cfg.health.fall = 1;
    let c = Cluster::new(&endpoints(2), cfg).expect("valid");
    c.record_health_check(1, false);
    assert!(!c.stats(1).expect("stats").healthy);
    cfg.health.active = false;
    let next = c.rebuild(&endpoints(2), cfg).expect("valid");
    next.publish();
    assert!(next.stats(1).expect("stats").healthy, "no check: healthy");
    next.record_health_check(1, false);
    assert!(next.stats(1).expect("stats").healthy, "late result ignored");
    let picked: std::collections::HashSet<_> = (0..20)
        .filter_map(|k| next.pick_index(&PickContext::new().with_entropy(k)))
        .collect();
    assert_eq!(picked.len(), 2, "both endpoints take traffic");
}

/// A reload that turns outlier detection off (both thresholds 0) returns
/// the ejected endpoints at once instead of at the end of their ejection.
#[test]
fn turning_outlier_detection_off_ends_current_ejections() {
    let cfg = with_outlier(PolicyKind::RoundRobin);
    let (c, _) = manual(&endpoints(4), cfg);
    fail(&c, 0, 5, Outcome::Status(500));
    assert!(c.stats(0).expect("stats").ejected);
    let mut off = cfg;
    off.outlier.consecutive_5xx = 0;
    off.outlier.consecutive_gateway_errors = 0;
    let next = c.rebuild(&endpoints(4), off).expect("valid");
    next.publish();
    let s = next.stats(0).expect("stats");
    assert!(!s.ejected && s.times_ejected == 0, "{s:?}");
}
