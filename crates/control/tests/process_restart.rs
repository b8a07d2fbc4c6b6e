//! Process-scaler instances and the store: an instance cannot outlive its
//! control plane, so none may come back from the store after a restart.
//! A shutdown stores the removal of every instance (and stops its process);
//! a start removes stored instances it does not run (left by a crash).

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use meshless_control::api::EndpointInput;
use meshless_control::config::ControlConfig;
use meshless_control::plane::ControlPlane;
use meshless_control::registry::Registry;
use meshless_control::store::Store;

const SVC: &str = "demo/lazy";

/// `demo/lazy` run by the process scaler (a Python server on `$PORT`),
/// stored in `dir`, with `min` instances always running.
fn plane_config(dir: &Path, min: u32) -> ControlConfig {
    let yaml = format!(
        "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\ndata_dir: \"{}\"\nservices:\n  - namespace: demo\n    name: lazy\n    autoscaling:\n      min_instances: {min}\n      max_instances: 2\n      target_concurrency: 10\n      tick: 100ms\n      scaler:\n        process:\n          command: [python3, -c, \"import http.server as h, os\\nh.HTTPServer(('127.0.0.1', int(os.environ['PORT'])), h.SimpleHTTPRequestHandler).serve_forever()\"]\n          start_timeout: 20s\n          stop_grace: 5s\n",
        dir.join("data").display()
    );
    ControlConfig::parse(&yaml, "control.yaml").expect("valid control config")
}

/// Ids of the stored endpoints of `SVC`, read from the store itself.
fn stored_ids(dir: &Path) -> Vec<String> {
    let store = Store::open(&dir.join("data")).expect("reopen the store");
    let registry = Registry::open(Some(store), 100).expect("registry");
    registry.view(SVC).map_or_else(Vec::new, |v| {
        v.endpoints.into_iter().map(|e| e.id).collect::<Vec<_>>()
    })
}

/// Polls `ok` every 20 ms for up to 20 s.
async fn eventually(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The address of the ready instance of `SVC`, once there is one.
async fn ready_instance(plane: &ControlPlane) -> SocketAddr {
    let mut found = None;
    eventually("an instance is ready", || {
        found = plane.state.lock().view(SVC).and_then(|v| {
            v.endpoints
                .iter()
                .find(|e| e.conditions.ready)
                .map(|e| SocketAddr::new(e.addresses[0], e.port))
        });
        found.is_some()
    })
    .await;
    found.expect("found")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_stores_the_removal_of_its_instances_and_stops_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plane = ControlPlane::start(plane_config(dir.path(), 1))
        .await
        .expect("plane");
    let address = ready_instance(&plane).await;
    plane.shutdown().await;
    assert_eq!(
        stored_ids(dir.path()),
        Vec::<String>::new(),
        "no instance stored"
    );
    // The process was stopped (SIGTERM to its group): its port closes.
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(address).await.is_ok() {
        assert!(Instant::now() < deadline, "the instance still accepts");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn endpoint(id: &str, port: u16) -> EndpointInput {
    serde_json::from_value(serde_json::json!({
        "id": id,
        "addresses": ["127.0.0.1"],
        "port": port,
        "conditions": { "ready": true, "serving": true, "terminating": false },
    }))
    .expect("endpoint")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_removes_stored_instances_it_does_not_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = plane_config(dir.path(), 0);
    // What a crash leaves: an instance stored as ready (its process died
    // with the plane), beside an endpoint that is no instance of ours.
    {
        let store = Store::open(&dir.path().join("data")).expect("store");
        let mut registry = Registry::open(Some(store), 100).expect("registry");
        registry
            .put_service(config.services[0].spec())
            .expect("service");
        registry
            .put_endpoints(
                SVC,
                vec![endpoint("demo-lazy-3", 9), endpoint("demo-lazy-extra", 10)],
            )
            .expect("endpoints");
        registry.close_store();
    }
    assert_eq!(stored_ids(dir.path()).len(), 2);
    let plane = ControlPlane::start(config).await.expect("plane");
    let ids = |plane: &ControlPlane| -> Vec<String> {
        plane.state.lock().view(SVC).map_or_else(Vec::new, |v| {
            v.endpoints.into_iter().map(|e| e.id).collect::<Vec<_>>()
        })
    };
    eventually("the stale instance is removed", || {
        !ids(&plane).contains(&"demo-lazy-3".to_owned())
    })
    .await;
    assert_eq!(ids(&plane), vec!["demo-lazy-extra".to_owned()]);
    plane.shutdown().await;
    assert_eq!(stored_ids(dir.path()), vec!["demo-lazy-extra".to_owned()]);
}
