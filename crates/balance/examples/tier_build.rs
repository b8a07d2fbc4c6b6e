//! Build cost of locality tiers: a cluster of N endpoints, each alone on
//! its own node, 50 zones, `prefer` locality, built with a tier for every
//! node and zone (`Tiers::Every`, what every proxy built before) and with
//! only the caller's (`Tiers::Caller`). One build each, wall time.
//!
//! `cargo run -p meshless-balance --example tier_build -- [N]` (default 5000).

use std::time::Instant;

use meshless_balance::{Cluster, ClusterConfig, LocalityConfig, PolicyKind, Tiers};
use meshless_model::Endpoint;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = match std::env::args().nth(1) {
        Some(a) => a.parse()?,
        None => 5_000,
    };
    let eps: Vec<Endpoint> = (0..n)
        .map(|i| {
            let addr = format!("10.{}.{}.{}:8080", i >> 16 & 255, i >> 8 & 255, i & 255);
            Ok(Endpoint::new(format!("ep-{i}"), addr.parse()?)
                .with_node(format!("n{i}"))
                .with_zone(format!("z{}", i % 50)))
        })
        .collect::<Result<_, std::net::AddrParseError>>()?;
    println!("{n} endpoints on {n} nodes in 50 zones, prefer locality");
    for policy in [PolicyKind::RingHash, PolicyKind::Maglev] {
        let mut cfg = ClusterConfig::new(policy);
        cfg.locality = Some(LocalityConfig::default());
        for tiers in [Tiers::Every, Tiers::caller(Some("n17"), Some("z17"))] {
            let label = if tiers == Tiers::Every {
                "every"
            } else {
                "caller"
            };
            let start = Instant::now();
            let c = Cluster::new_for(&eps, cfg, tiers)?;
            let took = start.elapsed();
            let (nodes, zones) = c.tier_counts();
            println!(
                "{:<10} {label:<6} node tiers {nodes:>5} zone tiers {zones:>3} build {:>8.1} ms",
                policy.name(),
                took.as_secs_f64() * 1e3
            );
        }
    }
    Ok(())
}
