//! Helpers shared by the balance integration tests.
#![allow(dead_code)]

use std::sync::Arc;

use meshless_balance::{Cluster, ClusterConfig, InFlight, ManualClock, OutlierConfig, PolicyKind};
use meshless_model::Endpoint;

pub fn endpoint(i: usize) -> Endpoint {
    Endpoint::new(
        format!("ep-{i}"),
        format!("127.0.0.1:{}", 10_000 + i)
            .parse()
            .expect("address"),
    )
}

pub fn endpoints(n: usize) -> Vec<Endpoint> {
    (0..n).map(endpoint).collect()
}

pub fn weighted(weights: &[u32]) -> Vec<Endpoint> {
    weights
        .iter()
        .enumerate()
        .map(|(i, &w)| endpoint(i).with_weight(w))
        .collect()
}

pub fn config(policy: PolicyKind) -> ClusterConfig {
    let mut c = ClusterConfig::new(policy);
    c.outlier = OutlierConfig::disabled();
    c
}

pub fn cluster(eps: &[Endpoint], policy: PolicyKind) -> Cluster {
    Cluster::new(eps, config(policy)).expect("valid cluster")
}

pub fn manual(eps: &[Endpoint], config: ClusterConfig) -> (Cluster, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new());
    let c = Cluster::with_clock(eps, config, clock.clone()).expect("valid cluster");
    (c, clock)
}

/// Holds `loads[i]` requests on endpoint `i`.
pub fn hold(cluster: &Cluster, loads: &[u32]) -> Vec<InFlight> {
    let mut guards = Vec::new();
    for (i, &l) in loads.iter().enumerate() {
        for _ in 0..l {
            guards.push(cluster.start(i).expect("index in range"));
        }
    }
    guards
}

/// Relative load `(load + 1) / weight` as a comparable fraction.
pub fn rel(cluster: &Cluster, i: usize) -> (u64, u64) {
    let s = cluster.set();
    (u64::from(s.load(i)) + 1, u64::from(s.weight(i)))
}

pub fn less(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 * b.1 < b.0 * a.1
}

/// Load per weight `load / weight` as a comparable fraction.
pub fn per_weight(cluster: &Cluster, i: usize) -> (u64, u64) {
    let s = cluster.set();
    (u64::from(s.load(i)), u64::from(s.weight(i)))
}
