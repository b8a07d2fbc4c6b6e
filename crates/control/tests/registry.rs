//! Registry validation and persistence across a restart.

use meshless_control::registry::{
    EndpointInput, Registry, RegistryError, ServicePort, ServiceSpec,
};
use meshless_control::store::Store;
use meshless_model::EndpointId;

/// A fresh directory for a store, removed when dropped.
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("meshless-reg-{name}-"))
        .tempdir()
        .expect("temp dir")
}

fn spec() -> ServiceSpec {
    ServiceSpec {
        namespace: "shop".into(),
        name: "cart".into(),
        ports: vec![ServicePort {
            name: Some("http".into()),
            port: 80,
            protocol: "TCP".into(),
        }],
        settings: Default::default(),
    }
}

fn input(i: u32) -> EndpointInput {
    serde_json::from_value(serde_json::json!({
        "id": format!("cart-{i}"),
        "addresses": [format!("10.0.{}.{}", i / 250, i % 250 + 1), "fd00::1"],
        "port": 8080,
        "zone": "z1",
    }))
    .expect("valid input")
}

#[test]
fn writes_are_validated_and_nothing_is_stored_on_error() {
    let mut r = Registry::open(None, 100).expect("registry");
    let mut bad = spec();
    bad.name = "Cart!".into();
    assert!(matches!(r.put_service(bad), Err(RegistryError::Invalid(e)) if e.path == "name"));
    assert!(matches!(
        r.put_endpoints("shop/cart", vec![input(1)]),
        Err(RegistryError::UnknownService(_))
    ));
    r.put_service(spec()).expect("service");
    let v = r.version();
    let mut zero_port = input(2);
    zero_port.port = 0;
    let e = r
        .put_endpoints("shop/cart", vec![input(1), zero_port])
        .expect_err("port 0");
    assert!(
        e.to_string().starts_with("put[1].port: "),
        "the field, without the model's \"endpoint ID:\" prefix: {e}"
    );
    assert_eq!(r.version(), v, "nothing stored");
    assert_eq!(r.view("shop/cart").expect("view").endpoints.len(), 0);
    let e = r
        .put_endpoints("shop/cart", vec![input(1), input(1)])
        .expect_err("dup");
    assert!(e.to_string().contains("duplicate"), "{e}");
}

#[test]
fn restart_restores_services_endpoints_slices_and_versions() {
    let tmp = temp_dir("restart");
    let dir = tmp.path();
    let (version, before) = {
        let mut r = Registry::open(Some(Store::open(dir).expect("store")), 10).expect("registry");
        r.put_service(spec()).expect("service");
        r.put_endpoints("shop/cart", (0..35).map(input).collect())
            .expect("endpoints");
        r.reconcile("shop/cart").expect("reconcile");
        r.delete_endpoints("shop/cart", &[EndpointId::new("cart-3")], true)
            .expect("delete");
        r.reconcile("shop/cart").expect("reconcile");
        let view = serde_json::to_value(r.view("shop/cart").expect("view")).expect("json");
        (r.version(), view)
    };
    let mut r = Registry::open(Some(Store::open(dir).expect("store")), 10).expect("registry");
    assert_eq!(r.version(), version);
    let after = serde_json::to_value(r.view("shop/cart").expect("view")).expect("json");
    assert_eq!(before, after, "services, endpoints and slices come back");
    assert_eq!(after["slices"].as_array().map(Vec::len), Some(4));
    let v = r
        .put_endpoints("shop/cart", vec![input(99)])
        .expect("write after restart");
    assert!(v > version, "versions keep increasing");
}

/// A service's settings reach the delta when they change (and only then),
/// every reset carries them, a bad one is refused with its path, and they
/// survive a restart.
#[test]
fn settings_travel_with_deltas_and_survive_a_restart() {
    let tmp = temp_dir("settings");
    let dir = tmp.path();
    let with = |policy: &str| {
        let mut s = spec();
        s.settings = serde_json::from_value(serde_json::json!({
            "policy": policy, "hash_key": "header:x-user"
        }))
        .expect("settings");
        s
    };
    {
        let mut r = Registry::open(Some(Store::open(dir).expect("store")), 100).expect("registry");
        r.put_service(with("maglev")).expect("service");
        let (delta, _) = r.reconcile("shop/cart").expect("ok").expect("a delta");
        let s = delta.settings.expect("new settings travel");
        assert_eq!(s.policy.as_deref(), Some("maglev"));
        // The same settings again: nothing to send.
        r.put_service(with("maglev")).expect("same");
        assert!(r.reconcile("shop/cart").expect("ok").is_none());
        // Endpoints only: the delta leaves the settings out (unchanged).
        r.put_endpoints("shop/cart", vec![input(1)])
            .expect("endpoint");
        let (delta, _) = r.reconcile("shop/cart").expect("ok").expect("a delta");
        assert!(delta.settings.is_none() && delta.upserted.len() == 1);
        r.put_service(with("ring_hash")).expect("changed");
        let (delta, _) = r.reconcile("shop/cart").expect("ok").expect("a delta");
        assert_eq!(
            delta.settings.and_then(|s| s.policy).as_deref(),
            Some("ring_hash")
        );
        let v = r.version();
        let e = r.put_service(with("fastest")).expect_err("unknown policy");
        assert!(
            matches!(&e, RegistryError::Invalid(f) if f.path == "settings.policy"),
            "{e}"
        );
        assert_eq!(r.version(), v, "nothing stored");
    }
    let r = Registry::open(Some(Store::open(dir).expect("store")), 100).expect("reopen");
    let s = r.settings("shop/cart").expect("service");
    assert_eq!(s.policy.as_deref(), Some("ring_hash"));
    assert_eq!(
        r.view("shop/cart")
            .expect("view")
            .settings
            .hash_key
            .map(|k| k.to_string())
            .as_deref(),
        Some("header:x-user")
    );
}

/// Lowering `max_endpoints_per_slice` applies to what is stored: a restart
/// re-packs the slices over the new limit (every endpoint in exactly one
/// slice), and the store holds the re-packed slices (the next restart
/// finds them as they are).
#[test]
fn a_lower_max_per_slice_repacks_stored_slices_at_restart() {
    let tmp = temp_dir("repack");
    let dir = tmp.path();
    {
        let mut r = Registry::open(Some(Store::open(dir).expect("store")), 100).expect("registry");
        r.put_service(spec()).expect("service");
        r.put_endpoints("shop/cart", (0..35).map(input).collect())
            .expect("endpoints");
        r.reconcile("shop/cart").expect("reconcile");
        assert_eq!(r.view("shop/cart").expect("view").slices.len(), 1);
    }
    let slices_after_open = || {
        let r = Registry::open(Some(Store::open(dir).expect("store")), 10).expect("registry");
        let view = r.view("shop/cart").expect("view");
        let mut placed: Vec<String> = view
            .slices
            .iter()
            .flat_map(|s| s.endpoints.iter().cloned())
            .collect();
        placed.sort();
        let mut ids: Vec<String> = view.endpoints.iter().map(|e| e.id.clone()).collect();
        ids.sort();
        assert_eq!(placed, ids, "every endpoint in exactly one slice");
        assert!(
            view.slices.iter().all(|s| s.endpoints.len() <= 10),
            "{:?}",
            view.slices
        );
        view.slices
    };
    let first = slices_after_open();
    assert_eq!(first.len(), 4);
    assert_eq!(slices_after_open(), first, "stored as re-packed");
}
