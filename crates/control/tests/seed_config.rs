//! The `services:` a control-plane file seeds the registry with are
//! checked when the file is read, as the API checks a write: what
//! `meshless control --check` accepts, the plane starts with, and what it
//! refuses is refused naming the file and `services[i].endpoints[j]`.
//! An endpoint id the API could not address (`a/b`, `..`) is refused too:
//! it could never be renewed or deleted alone.
//!
//! Real sockets on 127.0.0.1, port 0.

use meshless_control::client::ApiClient;
use meshless_control::config::ControlConfig;
use meshless_control::plane::ControlPlane;

fn seeded(endpoints: &str) -> String {
    format!(
        "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\nservices:\n  - namespace: demo\n    name: web\n    ports: [{{ name: http, port: 80 }}]\n    endpoints:\n{endpoints}"
    )
}

/// Each bad seed is refused by the file's check, naming the file and the
/// endpoint's field; none reaches a start.
#[test]
fn bad_seed_endpoints_are_refused_naming_the_field() {
    let cases = [
        (
            "duplicate id",
            "      - { id: dup, addresses: [127.0.0.1], port: 1 }\n      - { id: dup, addresses: [127.0.0.2], port: 1 }\n",
            "services[0].endpoints[1].id",
        ),
        (
            "no address",
            "      - { id: a, addresses: [], port: 1 }\n",
            "services[0].endpoints[0].addresses",
        ),
        (
            "unspecified address",
            "      - { id: a, addresses: [127.0.0.1], port: 1 }\n      - { id: b, addresses: [0.0.0.0], port: 1 }\n",
            "services[0].endpoints[1].addresses",
        ),
        (
            "weight 0",
            "      - { id: a, addresses: [127.0.0.1], port: 1, weight: 0 }\n",
            "services[0].endpoints[0].weight",
        ),
        (
            "an id with a slash",
            "      - { id: \"a/b\", addresses: [127.0.0.1], port: 1 }\n",
            "services[0].endpoints[0].id",
        ),
        (
            "the id ..",
            "      - { id: \"..\", addresses: [127.0.0.1], port: 1 }\n",
            "services[0].endpoints[0].id",
        ),
        (
            "an empty id",
            "      - { id: \"\", addresses: [127.0.0.1], port: 1 }\n",
            "services[0].endpoints[0].id",
        ),
    ];
    for (what, endpoints, field) in cases {
        let err = ControlConfig::parse(&seeded(endpoints), "control.yaml")
            .expect_err(what)
            .to_string();
        assert!(
            err.starts_with("control.yaml: ") && err.contains(field),
            "{what}: the error should name the file and {field}: {err}"
        );
    }
}

#[test]
fn a_bad_seed_service_and_a_service_declared_twice_are_refused() {
    let bad_port = "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\nservices:\n  - namespace: demo\n    name: web\n    ports: [{ name: http, port: 80 }, { name: http, port: 81 }]\n";
    let err = ControlConfig::parse(bad_port, "control.yaml")
        .expect_err("duplicate port name")
        .to_string();
    assert!(err.contains("services[0].ports[1].name"), "{err}");

    let bad_name = "services:\n  - namespace: Demo\n    name: web\n";
    let err = ControlConfig::parse(bad_name, "control.yaml")
        .expect_err("uppercase namespace")
        .to_string();
    assert!(err.contains("services[0].namespace"), "{err}");

    let twice = "services:\n  - namespace: demo\n    name: web\n  - namespace: demo\n    name: api\n  - namespace: demo\n    name: web\n";
    let err = ControlConfig::parse(twice, "control.yaml")
        .expect_err("a service declared twice")
        .to_string();
    assert!(
        err.contains("services[2]") && err.contains("services[0]"),
        "{err}"
    );
}

/// What the check accepts, the plane starts with and serves; an id with
/// every character the API allows can be deleted alone through the API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_seeds_start_and_stay_addressable() {
    let text = seeded(
        "      - { id: \"pod-a_1.zone:0\", addresses: [127.0.0.1], port: 1, weight: 3 }\n      - { id: b, addresses: [127.0.0.2, \"::1\"], port: 2 }\n",
    );
    let config = ControlConfig::parse(&text, "control.yaml").expect("valid seeds");
    let plane = ControlPlane::start(config).await.expect("the plane starts");
    let c = ApiClient::new(plane.api_addr());
    let before = c.service("demo/web").await.expect("service");
    let mut ids: Vec<_> = before.endpoints.iter().map(|e| e.id.clone()).collect();
    ids.sort();
    assert_eq!(ids, ["b", "pod-a_1.zone:0"]);
    c.delete_endpoint("demo/web", "pod-a_1.zone:0")
        .await
        .expect("a seeded endpoint is deleted alone");
    let after = c.service("demo/web").await.expect("service");
    let left: Vec<_> = after.endpoints.iter().map(|e| e.id.clone()).collect();
    plane.shutdown().await;
    assert_eq!(left, ["b"]);
}
