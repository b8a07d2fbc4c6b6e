//! `batch_period`: with a period, writes are stored at once but reconciled
//! and published together by the next flush, as one delta per service with
//! every endpoint changed since the last one; without, each write
//! publishes its own delta.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use meshless_control::config::ControlConfig;
use meshless_control::metrics::ControlMetrics;
use meshless_control::registry::{EndpointInput, Registry, ServiceSpec};
use meshless_control::state::{Auth, PlaneState};

fn state(batch_period: Duration) -> PlaneState {
    let registry = Arc::new(Mutex::new(Registry::open(None, 100).expect("registry")));
    let metrics = Arc::new(ControlMetrics::new());
    let config = ControlConfig {
        batch_period,
        history: 100,
        ..ControlConfig::default()
    };
    PlaneState::new(registry, metrics, config, Auth::new(None))
}

fn write_five(s: &PlaneState) {
    s.write(|r| {
        r.put_service(ServiceSpec {
            namespace: "shop".into(),
            name: "cart".into(),
            ports: Vec::new(),
            settings: Default::default(),
        })
    })
    .expect("service");
    for i in 0..5u8 {
        let e = EndpointInput::new(format!("cart-{i}"), [10, 0, 0, i].into(), 80);
        s.write(|r| r.put_endpoints("shop/cart", vec![e]))
            .expect("put");
    }
}

#[test]
fn a_batch_publishes_every_write_of_its_period_as_one_delta() {
    let s = state(Duration::from_secs(3600));
    write_five(&s);
    assert_eq!(s.metrics.writes.get(), 6, "every write is stored at once");
    assert_eq!(
        s.metrics.deltas.get(),
        0,
        "nothing published before the flush"
    );
    assert_eq!(s.lock().dirty_services(), vec!["shop/cart".to_owned()]);
    let mut reg = s.lock();
    s.flush(&mut reg, Instant::now()).expect("flush");
    drop(reg);
    assert_eq!(
        s.metrics.deltas.get(),
        1,
        "one delta for the five endpoints"
    );
    assert!(s.lock().dirty_services().is_empty());
    let mut reg = s.lock();
    s.flush(&mut reg, Instant::now()).expect("flush");
    drop(reg);
    assert_eq!(
        s.metrics.deltas.get(),
        1,
        "an empty period publishes nothing"
    );
}

#[test]
fn without_a_batch_period_each_write_publishes_its_delta() {
    let s = state(Duration::ZERO);
    write_five(&s);
    assert_eq!(s.metrics.deltas.get(), 5);
    assert!(s.lock().dirty_services().is_empty());
}
