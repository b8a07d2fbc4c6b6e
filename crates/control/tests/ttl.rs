//! Endpoint TTLs: removal when the TTL runs out, renewal pushing it back,
//! and the errors of renewing what cannot be renewed. Time is passed in,
//! so nothing here waits on the clock.

use std::time::{Duration, Instant};

use meshless_control::registry::{
    EndpointInput, Registry, RegistryError, ServicePort, ServiceSpec,
};
use meshless_model::EndpointId;

fn registry() -> Registry {
    let mut r = Registry::open(None, 100).expect("registry");
    r.put_service(ServiceSpec {
        namespace: "shop".into(),
        name: "cart".into(),
        ports: vec![ServicePort::tcp(80)],
        settings: Default::default(),
    })
    .expect("service");
    r
}

fn with_ttl(id: &str, ttl: Option<u64>) -> EndpointInput {
    EndpointInput {
        ttl_seconds: ttl,
        starting: false,
        ..EndpointInput::new(id, [10, 0, 0, 1].into(), 80)
    }
}

fn ids(r: &Registry) -> Vec<String> {
    r.view("shop/cart")
        .map(|v| v.endpoints.into_iter().map(|e| e.id).collect())
        .unwrap_or_default()
}

#[test]
fn an_endpoint_goes_when_its_ttl_runs_out_and_not_before() {
    let mut r = registry();
    let start = Instant::now();
    r.put_endpoints(
        "shop/cart",
        vec![
            with_ttl("short", Some(5)),
            with_ttl("long", Some(60)),
            with_ttl("none", None),
        ],
    )
    .expect("put");
    // Deadlines are set at or after `start`.
    assert_eq!(r.expire(start + Duration::from_secs(4)).expect("expire"), 0);
    assert_eq!(ids(&r).len(), 3);
    let later = Instant::now() + Duration::from_secs(5);
    assert_eq!(r.expire(later).expect("expire"), 1);
    assert_eq!(ids(&r), vec!["long", "none"]);
    let much_later = Instant::now() + Duration::from_secs(24 * 3600 + 1);
    assert_eq!(r.expire(much_later).expect("expire"), 1);
    assert_eq!(ids(&r), vec!["none"], "no TTL, no expiry");
    assert!(
        r.dirty_services().contains(&"shop/cart".to_owned()),
        "removals are distributed"
    );
}

#[test]
fn renewal_restarts_the_period_from_the_renewal() {
    let mut r = registry();
    r.put_endpoints("shop/cart", vec![with_ttl("a", Some(10))])
        .expect("put");
    let before_renew = Instant::now();
    r.renew("shop/cart", &EndpointId::new("a")).expect("renew");
    // The new deadline is at least 10 s after `before_renew`.
    assert_eq!(
        r.expire(before_renew + Duration::from_secs(9))
            .expect("expire"),
        0
    );
    assert_eq!(ids(&r), vec!["a"]);
    let after = Instant::now() + Duration::from_secs(10);
    assert_eq!(r.expire(after).expect("expire"), 1);
}

#[test]
fn renewing_what_has_no_ttl_or_does_not_exist_fails_by_name() {
    let mut r = registry();
    r.put_endpoints("shop/cart", vec![with_ttl("none", None)])
        .expect("put");
    match r.renew("shop/cart", &EndpointId::new("none")) {
        Err(RegistryError::Invalid(e)) => assert_eq!(e.path, "ttl_seconds"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        r.renew("shop/cart", &EndpointId::new("ghost")),
        Err(RegistryError::UnknownEndpoint { .. })
    ));
    assert!(matches!(
        r.renew("shop/nope", &EndpointId::new("none")),
        Err(RegistryError::UnknownService(_))
    ));
    let e = r
        .put_endpoints("shop/cart", vec![with_ttl("zero", Some(0))])
        .expect_err("ttl 0");
    assert!(e.to_string().contains("put[0].ttl_seconds"), "{e}");
}
