//! Control-plane CPU per single-endpoint write (one endpoint replaced,
//! then reconciled into slices and turned into a delta), on services of
//! 2,000 and 20,000 endpoints. In memory (no store), so only the
//! registry's and the reconciler's work is measured; the goal is
//! a cost within 2x between the two sizes.
//!
//! Run: `cargo bench -p meshless-control --bench write`

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use meshless_control::api::{EndpointInput, ServicePort, ServiceSpec};
use meshless_control::registry::Registry;
use meshless_model::EndpointId;

const SERVICE: &str = "bench/svc";

fn input(i: usize, weight: u32) -> EndpointInput {
    let ip = Ipv4Addr::from(0x0AF4_0000 + i as u32);
    EndpointInput {
        zone: Some(["a", "b", "c"][i % 3].into()),
        node: Some(format!("node-{}", i % 500)),
        weight,
        ..EndpointInput::new(format!("e-{i}"), IpAddr::V4(ip), 8080)
    }
}

fn registry(n: usize) -> Registry {
    let mut r = Registry::open(None, 100).expect("registry");
    r.put_service(ServiceSpec {
        namespace: "bench".into(),
        name: "svc".into(),
        ports: vec![ServicePort::tcp(80)],
        settings: Default::default(),
    })
    .expect("service");
    r.put_endpoints(SERVICE, (0..n).map(|i| input(i, 1)).collect())
        .expect("endpoints");
    r.reconcile(SERVICE).expect("reconcile");
    r
}

fn single_write(c: &mut Criterion) {
    let mut group = c.benchmark_group("single_endpoint_write");
    for n in [2_000usize, 20_000] {
        let mut r = registry(n);
        let mut k = 0usize;
        group.bench_with_input(BenchmarkId::new("update", n), &n, |b, &n| {
            b.iter(|| {
                k += 1;
                let i = (k * 7919) % n;
                r.put_endpoints(SERVICE, vec![input(i, 1 + (k % 2) as u32)])
                    .expect("write");
                black_box(r.reconcile(SERVICE).expect("reconcile"))
            })
        });
        let mut next = n;
        group.bench_with_input(BenchmarkId::new("replace", n), &n, |b, _| {
            b.iter(|| {
                // A rolling update's step: one endpoint leaves, a new one comes.
                let gone = EndpointId::new(format!("e-{}", next - n));
                r.delete_endpoints(SERVICE, &[gone], false).expect("delete");
                r.put_endpoints(SERVICE, vec![input(next, 1)]).expect("put");
                next += 1;
                black_box(r.reconcile(SERVICE).expect("reconcile"))
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20);
    targets = single_write
}
criterion_main!(benches);
