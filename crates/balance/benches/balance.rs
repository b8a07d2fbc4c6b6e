//! Pick cost per algorithm and endpoint count; Maglev (also skewed weights) and ring build cost,
//! and the grown Maglev table at 2,000 and 20,000 endpoints.
//!
//! Run: `cargo bench -p meshless-balance --bench balance`

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use meshless_balance::policy::{
    DEFAULT_TABLE_SIZE, MAX_TABLE_SIZE, Maglev, RingHash, auto_ring_size, table_size_for,
};
use meshless_balance::{Cluster, ClusterConfig, OutlierConfig, PickContext, PolicyKind};
use meshless_model::{Endpoint, MAX_WEIGHT};

fn endpoints(n: usize) -> Vec<Endpoint> {
    (0..n)
        .map(|i| {
            let ip = std::net::Ipv4Addr::from(0x0A00_0000 + i as u32);
            Endpoint::new(format!("ep-{i}"), std::net::SocketAddr::from((ip, 8080)))
        })
        .collect()
}

fn picks(c: &mut Criterion) {
    let mut group = c.benchmark_group("pick");
    for policy in PolicyKind::ALL {
        for n in [10usize, 100, 1_000, 10_000] {
            let mut cfg = ClusterConfig::new(policy);
            cfg.outlier = OutlierConfig::disabled();
            let cluster = Cluster::new(&endpoints(n), cfg).expect("valid cluster");
            // Some load so load-aware policies have work to compare.
            let _held: Vec<_> = (0..n / 2)
                .filter_map(|i| cluster.start((i * 7) % n))
                .collect();
            let mut k = 0u64;
            group.bench_with_input(BenchmarkId::new(policy.name(), n), &n, |b, _| {
                b.iter(|| {
                    k = k.wrapping_add(0x9E37_79B9_7F4A_7C15);
                    let ctx = PickContext {
                        key: Some(k),
                        node: None,
                        zone: None,
                        entropy: k,
                    };
                    black_box(cluster.pick_index(black_box(&ctx)))
                })
            });
        }
    }
    group.finish();

    // Degraded: 10% of the endpoints down (a down endpoint's turn or draw is
    // redrawn), 1,000 endpoints, unequal weights for P2C.
    let mut group = c.benchmark_group("pick_degraded");
    for policy in [
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::PowerOfChoices,
        PolicyKind::Maglev,
        PolicyKind::BoundedLoad,
    ] {
        let mut cfg = ClusterConfig::new(policy);
        cfg.outlier = OutlierConfig::disabled();
        cfg.health.fall = 1;
        let eps: Vec<Endpoint> = endpoints(1_000)
            .into_iter()
            .enumerate()
            .map(|(i, e)| e.with_weight(1 + (i % 4) as u32))
            .collect();
        let cluster = Cluster::new(&eps, cfg).expect("valid cluster");
        (0..1_000)
            .step_by(10)
            .for_each(|i| cluster.record_health_check(i, false));
        let mut k = 0u64;
        group.bench_function(BenchmarkId::new(policy.name(), 1_000), |b| {
            b.iter(|| {
                k = k.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let ctx = PickContext::new().with_key(k).with_entropy(k);
                black_box(cluster.pick_index(black_box(&ctx)))
            })
        });
    }
    group.finish();

    // The full request bookkeeping: pick, take the in-flight guard, drop it.
    let mut group = c.benchmark_group("pick_and_guard");
    for policy in [PolicyKind::PowerOfChoices, PolicyKind::BoundedLoad] {
        let mut cfg = ClusterConfig::new(policy);
        cfg.outlier = OutlierConfig::disabled();
        let cluster = Cluster::new(&endpoints(1_000), cfg).expect("valid cluster");
        let mut k = 0u64;
        group.bench_function(BenchmarkId::new(policy.name(), 1_000), |b| {
            b.iter(|| {
                k = k.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let ctx = PickContext::new().with_key(k).with_entropy(k);
                black_box(cluster.pick(&ctx))
            })
        });
    }
    group.finish();
}

fn builds(c: &mut Criterion) {
    let eps = endpoints(1_000);
    let members: Vec<u32> = (0..eps.len() as u32).collect();
    let id_of = |m: u32| eps[m as usize].id.as_str();
    let mut group = c.benchmark_group("build");
    group.sample_size(20);
    for m in [65_537usize, 655_373] {
        group.bench_with_input(BenchmarkId::new("maglev_n1000", m), &m, |b, &m| {
            b.iter(|| black_box(Maglev::new(&members, id_of, |_| 1, m)))
        });
    }
    // One endpoint of MAX_WEIGHT beside 5,000 of weight 1, in the table
    // grown for them: the skew that made the round-by-round fill take seconds.
    let skewed = endpoints(5_001);
    let skewed_members: Vec<u32> = (0..skewed.len() as u32).collect();
    let m = table_size_for(DEFAULT_TABLE_SIZE, MAX_TABLE_SIZE, skewed.len());
    group.bench_with_input(BenchmarkId::new("maglev_skewed_n5001", m), &m, |b, &m| {
        b.iter(|| {
            black_box(Maglev::new(
                &skewed_members,
                |i| skewed[i as usize].id.as_str(),
                |i| if i == 5_000 { MAX_WEIGHT } else { 1 },
                m,
            ))
        })
    });
    let size = auto_ring_size(members.len());
    group.bench_with_input(BenchmarkId::new("ring_n1000", size), &size, |b, &size| {
        b.iter(|| black_box(RingHash::new(&members, id_of, |_| 1, size)))
    });
    group.finish();
    ring_memory(&eps);
}

/// A Maglev table at 2,000 and 20,000 endpoints: the fixed default size
/// (65,537) next to the grown one (100 entries per endpoint or more).
fn grown_builds(c: &mut Criterion) {
    let mut group = c.benchmark_group("maglev_grown");
    group.sample_size(10);
    for n in [2_000usize, 20_000] {
        let eps = endpoints(n);
        let members: Vec<u32> = (0..n as u32).collect();
        let id_of = |m: u32| eps[m as usize].id.as_str();
        for m in [
            DEFAULT_TABLE_SIZE,
            table_size_for(DEFAULT_TABLE_SIZE, MAX_TABLE_SIZE, n),
        ] {
            let name = format!("n{n}");
            group.bench_with_input(BenchmarkId::new(name, m), &m, |b, &m| {
                b.iter(|| black_box(Maglev::new(&members, id_of, |_| 1, m)))
            });
        }
    }
    group.finish();
}

/// Heap held by the rings of 1,000 locality tiers (one node tier of 2
/// endpoints each, automatic ring size), printed once: the figure behind
/// BENCHMARKS.md's ring-memory line.
fn ring_memory(eps: &[Endpoint]) {
    let bytes: usize = (0..1_000)
        .map(|t| {
            let members = [2 * t as u32 % 1000, (2 * t as u32 + 1) % 1000];
            let ring = RingHash::new(
                &members,
                |m| eps[m as usize].id.as_str(),
                |_| 1,
                auto_ring_size(2),
            );
            ring.heap_bytes()
        })
        .sum();
    eprintln!(
        "ring memory: 1,000 node tiers of 2 endpoints: {} bytes ({:.1} MB)",
        bytes,
        bytes as f64 / 1e6
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = picks, builds, grown_builds
}
criterion_main!(benches);
