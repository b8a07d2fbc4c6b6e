//! Locality tiers built for one caller: only its node and zone tiers, and
//! picks for that caller the same as from a cluster with every tier.

mod common;

use common::*;
use meshless_balance::{Cluster, LocalityConfig, LocalityMode, PickContext, PolicyKind, Tiers};
use meshless_model::Endpoint;
use proptest::prelude::*;

/// `n` endpoints, endpoint `i` alone on node `n{i}`, in zone `z{i % 50}`.
fn one_per_node(n: usize) -> Vec<Endpoint> {
    endpoints(n)
        .into_iter()
        .enumerate()
        .map(|(i, e)| {
            e.with_node(format!("n{i}"))
                .with_zone(format!("z{}", i % 50))
        })
        .collect()
}

fn with_mode(policy: PolicyKind, mode: LocalityMode) -> meshless_balance::ClusterConfig {
    let mut cfg = config(policy);
    cfg.locality = Some(LocalityConfig {
        mode,
        ..LocalityConfig::default()
    });
    cfg
}

/// 5,000 endpoints on 5,000 nodes: a caller on one node builds one node
/// tier and one zone tier (a cluster with every tier would hold 5,000 node
/// rings of 1,024 points each), keeps them across a rebuild, and moves
/// them with `rebuild_for`.
#[test]
fn a_caller_on_one_of_5000_nodes_builds_one_node_tier_and_one_zone_tier() {
    let eps = one_per_node(5_000);
    let cfg = with_mode(PolicyKind::RingHash, LocalityMode::Prefer);
    let c = Cluster::new_for(&eps, cfg, Tiers::caller(Some("n17"), Some("z17"))).expect("valid");
    assert_eq!(c.tier_counts(), (1, 1));
    let at = |c: &Cluster, node: &str, zone: &str, entropy: u64| {
        let ctx = PickContext::new()
            .with_locality(Some(node), Some(zone))
            .with_entropy(entropy);
        c.pick_index(&ctx).expect("a pick")
    };
    for entropy in 0..50 {
        assert_eq!(at(&c, "n17", "z17", entropy), 17, "the caller's node first");
    }
    let again = c.rebuild(&eps[..4_999], cfg).expect("valid");
    assert_eq!(
        again.tier_counts(),
        (1, 1),
        "a rebuild keeps the caller's tiers"
    );
    let moved = again
        .rebuild_for(&eps, cfg, Tiers::caller(Some("n3"), Some("z3")))
        .expect("valid");
    assert_eq!(moved.tier_counts(), (1, 1));
    assert_eq!(at(&moved, "n3", "z3", 1), 3);
}

/// Only the tiers a mode reads, only where the caller is: `zone` builds no
/// node tier, `local_only` no zone tier, a caller on a node without
/// endpoints no node tier, a caller without locality none.
#[test]
fn a_caller_builds_only_the_tiers_its_mode_reads() {
    let eps = one_per_node(200);
    let own = || Tiers::caller(Some("n5"), Some("z5"));
    let counts = |mode, tiers| {
        Cluster::new_for(&eps, with_mode(PolicyKind::Maglev, mode), tiers)
            .expect("valid")
            .tier_counts()
    };
    assert_eq!(counts(LocalityMode::Prefer, own()), (1, 1));
    assert_eq!(counts(LocalityMode::Proportional, own()), (1, 1));
    assert_eq!(counts(LocalityMode::Zone, own()), (0, 1));
    assert_eq!(counts(LocalityMode::LocalOnly, own()), (1, 0));
    assert_eq!(
        counts(
            LocalityMode::Prefer,
            Tiers::caller(Some("elsewhere"), Some("z5"))
        ),
        (0, 1)
    );
    assert_eq!(
        counts(LocalityMode::Prefer, Tiers::caller(None, None)),
        (0, 0)
    );
    assert_eq!(counts(LocalityMode::Prefer, Tiers::Every), (200, 50));
    assert_eq!(counts(LocalityMode::LocalOnly, Tiers::Every), (200, 0));
}

/// Which context a step picks with: the caller's own, or one naming
/// another node (and zone), which a caller-only cluster has no tier for.
#[derive(Debug, Clone, Copy)]
enum Asker {
    Caller,
    OtherNode,
    OtherNodeAndZone,
}

fn asker() -> impl Strategy<Value = Asker> {
    prop_oneof![
        3 => Just(Asker::Caller),
        1 => Just(Asker::OtherNode),
        1 => Just(Asker::OtherNodeAndZone),
    ]
}

fn mode() -> impl Strategy<Value = LocalityMode> {
    prop_oneof![
        Just(LocalityMode::Prefer),
        Just(LocalityMode::Proportional),
        Just(LocalityMode::Zone),
        Just(LocalityMode::LocalOnly),
    ]
}

type At<'a> = (Option<&'a str>, Option<&'a str>);

fn picking(at: At<'_>, key: u64, entropy: u64) -> PickContext<'_> {
    PickContext::new()
        .with_locality(at.0, at.1)
        .with_key(key)
        .with_entropy(entropy)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// For any policy, mode, weights, placement and health, a cluster
    /// built for one caller answers that caller's picks exactly as a
    /// cluster with every tier does (same endpoints, same requests held,
    /// same sequence); a pick naming another node or zone is answered as
    /// the every-tier cluster answers a node or zone without endpoints.
    /// Round robin starts each balancer at a random slot (as Envoy does),
    /// so for it only whether a pick is answered must agree.
    #[test]
    fn caller_tiers_pick_as_every_tier_does(
        placement in prop::collection::vec((1u32..5, 0u8..4, 0u8..3), 1..12),
        policy in prop::sample::select(PolicyKind::ALL.to_vec()),
        mode in mode(),
        share in 0.0f64..=1.0,
        caller in (0u8..4, 0u8..3),
        down in prop::collection::vec(any::<bool>(), 12),
        panic in any::<bool>(),
        steps in prop::collection::vec((asker(), any::<u64>(), any::<u64>(), any::<bool>()), 1..60),
    ) {
        // Node or zone number 3 / 2 means "none named".
        let name = |p: &str, v: u8, none: u8| (v != none).then(|| format!("{p}{v}"));
        let eps: Vec<Endpoint> = placement
            .iter()
            .enumerate()
            .map(|(i, &(w, n, z))| {
                let mut e = endpoint(i).with_weight(w);
                e.node = name("n", n, 3);
                e.zone = name("z", z, 2);
                e
            })
            .collect();
        let mut cfg = config(policy);
        cfg.locality = Some(LocalityConfig {
            mode,
            min_healthy_share: share,
            min_cluster_size: 3,
        });
        cfg.health.fall = 1;
        cfg.panic_threshold = if panic { 50 } else { 0 };
        let (node, zone) = (name("n", caller.0, 3), name("z", caller.1, 2));
        let every = Cluster::new(&eps, cfg).expect("valid");
        let own = Cluster::new_for(&eps, cfg, Tiers::caller(node.as_deref(), zone.as_deref()))
            .expect("valid");
        for (i, &d) in down[..eps.len()].iter().enumerate() {
            if d {
                every.record_health_check(i, false);
                own.record_health_check(i, false);
            }
        }
        let mut held = Vec::new();
        for (who, key, entropy, reserve) in steps {
            let (asked, as_every) = match who {
                Asker::Caller => ((node.as_deref(), zone.as_deref()), (node.as_deref(), zone.as_deref())),
                Asker::OtherNode => ((Some("n-other"), zone.as_deref()), (Some("nowhere"), zone.as_deref())),
                Asker::OtherNodeAndZone => ((Some("n-other"), Some("z-other")), (Some("nowhere"), Some("nowhere"))),
            };
            let ctx = |at| picking(at, key, entropy);
            let (a, b) = if reserve {
                let a = every.pick(&ctx(as_every));
                let b = own.pick(&ctx(asked));
                let got = (a.as_ref().map(|g| g.index()), b.as_ref().map(|g| g.index()));
                held.push((a, b));
                got
            } else {
                (every.pick_index(&ctx(as_every)), own.pick_index(&ctx(asked)))
            };
            if policy == PolicyKind::RoundRobin {
                prop_assert_eq!(a.is_some(), b.is_some(), "{:?}", who);
            } else {
                prop_assert_eq!(a, b, "{:?}", who);
            }
        }
    }
}
