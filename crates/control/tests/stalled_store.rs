//! A commit stalled in the store (a slow or hung disk) holds the registry
//! lock for as long. API calls that need the registry then wait for it on
//! tokio's blocking pool, not on an executor thread, so the control plane
//! keeps serving everything that does not need the registry (`/metrics`,
//! `/ready`, streams, heartbeats), and the waiting calls finish once the
//! commit does.

#![allow(clippy::unwrap_used)]
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use meshless_control::config::ControlConfig;
use meshless_control::plane::ControlPlane;
use meshless_control::store::{Loaded, Storage, Store, StoreError, WriteBatch};

/// A real store whose commits wait while the gate is closed.
#[derive(Debug)]
struct Gated {
    inner: Store,
    gate: Arc<Gate>,
}

#[derive(Debug, Default)]
struct Gate {
    closed: Mutex<bool>,
    opened: Condvar,
    /// Set once a commit waits at the closed gate.
    stalled: AtomicBool,
}

/// Opens the gate when dropped: a failing assertion must not leave the
/// commit (and the runtime's shutdown) waiting forever.
struct OpenOnDrop(Arc<Gate>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.set(false);
    }
}

impl Gate {
    fn set(&self, closed: bool) {
        *self.closed.lock().unwrap() = closed;
        self.opened.notify_all();
    }
}

impl Gated {
    /// A store in `dir` with its gate open, and the gate.
    fn open(dir: &std::path::Path) -> (Self, Arc<Gate>) {
        let gate = Arc::new(Gate::default());
        let store = Self {
            inner: Store::open(dir).unwrap(),
            gate: Arc::clone(&gate),
        };
        (store, gate)
    }
}

impl Storage for Gated {
    fn load(&self) -> Result<Loaded, StoreError> {
        self.inner.load()
    }

    fn apply_group(&self, batches: &[WriteBatch]) -> Result<(), StoreError> {
        let mut closed = self.gate.closed.lock().unwrap();
        while *closed {
            self.gate.stalled.store(true, Ordering::SeqCst);
            closed = self.gate.opened.wait(closed).unwrap();
        }
        drop(closed);
        self.inner.apply_group(batches)
    }
}

/// Closes the gate and sends a write (from a plain thread) whose commit
/// stalls there, holding the registry lock; returns once it does, with
/// the guard that opens the gate again and the write's thread.
fn stall_a_write(
    gate: &Arc<Gate>,
    api: SocketAddr,
) -> (OpenOnDrop, std::thread::JoinHandle<Result<u16, String>>) {
    gate.set(true);
    let open = OpenOnDrop(Arc::clone(gate));
    let stalled_write = std::thread::spawn(move || {
        let body = r#"{"ports":[{"port":81}]}"#;
        request(api, "PUT", "/v1/services/shop/other", body)
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while !gate.stalled.load(Ordering::SeqCst) {
        assert!(
            Instant::now() < deadline,
            "the write never reached the store"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    (open, stalled_write)
}

/// Checks the stalled write still waits, opens the gate, and checks it
/// then succeeds.
fn end_stall(gate: &Gate, stalled_write: std::thread::JoinHandle<Result<u16, String>>) {
    assert!(!stalled_write.is_finished(), "the write is still waiting");
    gate.set(false);
    assert_eq!(stalled_write.join().unwrap(), Ok(200));
}

/// One HTTP/1.1 request on its own connection, from a plain thread (not
/// the runtime under test); the status, or the error (a read timeout).
fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> Result<u16, String> {
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: plane\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).map_err(|e| e.to_string())?;
    let head = String::from_utf8_lossy(&out);
    head.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no status in {head:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_commit_leaves_the_executor_serving() {
    let dir = tempfile::tempdir().unwrap();
    let (store, gate) = Gated::open(dir.path());
    let config = ControlConfig::parse(
        "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\n",
        "test",
    )
    .unwrap();
    let plane = ControlPlane::start_with_storage(config, Some(Box::new(store)))
        .await
        .unwrap();
    let api = plane.api_addr();
    let put_service = move |name: &str| {
        let path = format!("/v1/services/shop/{name}");
        request(api, "PUT", &path, r#"{"ports":[{"port":80}]}"#)
    };
    let endpoint = r#"{"id":"e1","addresses":["10.0.0.1"],"port":80,"ttl_seconds":60}"#;
    let setup = tokio::task::spawn_blocking(move || {
        let path = "/v1/services/shop/cart/endpoints/e1";
        [
            put_service("cart"),
            put_service("gone"),
            request(api, "PUT", path, endpoint),
        ]
    })
    .await
    .unwrap();
    assert_eq!(setup, [Ok(200), Ok(200), Ok(200)]);

    // A write whose commit stalls, holding the registry lock.
    let (_open, stalled_write) = stall_a_write(&gate, api);
    // More calls that need the registry than the runtime has workers: a
    // list, a view, a renewal, a delete (its own store write) and a
    // follower's load reports (which check that the service exists).
    let load = r#"{"replica":"follower-1","in_flight":3,"queued":0}"#;
    let waiting: Vec<_> = [
        ("GET", "/v1/services", ""),
        ("GET", "/v1/services/shop/cart", ""),
        ("POST", "/v1/services/shop/cart/endpoints/e1/renew", ""),
        ("GET", "/v1/services", ""),
        ("DELETE", "/v1/services/shop/gone", ""),
        ("POST", "/v1/services/shop/cart/load", load),
        ("POST", "/v1/services/shop/cart/load", load),
        ("POST", "/v1/services/shop/cart/load", load),
    ]
    .into_iter()
    .map(|(method, path, body)| std::thread::spawn(move || request(api, method, path, body)))
    .collect();
    // Each of them finds the registry locked (counted), and the executor
    // still answers what needs no registry.
    let offloaded = move || {
        let m = request_text(api, "/metrics");
        m.lines()
            .find(|l| l.starts_with("meshless_control_registry_waits_offloaded_total "))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let probe = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        // Every call but the delete (always on the blocking pool).
        while offloaded() < 7.0 {
            assert!(
                Instant::now() < deadline,
                "calls did not wait off the executor"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        request(api, "GET", "/ready", "")
    });
    assert_eq!(
        probe.join().unwrap(),
        Ok(200),
        "/ready answered during the stall"
    );
    // The commit goes through; everything that waited answers.
    end_stall(&gate, stalled_write);
    let statuses: Vec<Result<u16, String>> =
        waiting.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(
        statuses.iter().all(|s| *s == Ok(200)),
        "every call answered: {statuses:?}"
    );
    drop(plane);
}

/// The body of `GET path` (empty on any error).
fn request_text(addr: SocketAddr, path: &str) -> String {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let req = format!("GET {path} HTTP/1.1\r\nhost: plane\r\nconnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return String::new();
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// Instances of a process-scaler service that become ready while a commit
/// stalls register without blocking the executor: with a store on disk
/// their writes wait on the commit thread, so `/ready` and everything
/// else that needs no registry keep answering, and both are registered
/// once the commit goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_ready_during_a_stalled_commit_leave_the_executor_serving() {
    let dir = tempfile::tempdir().unwrap();
    let (store, gate) = Gated::open(dir.path());
    let marks = dir.path().join("marks");
    std::fs::create_dir(&marks).unwrap();
    // Each instance listens on $PORT a moment after it starts, and leaves
    // a mark once it does.
    let script = format!(
        "import os, socket, time\ntime.sleep(3.0)\ns = socket.socket()\ns.bind(('127.0.0.1', int(os.environ['PORT'])))\ns.listen()\nopen(os.path.join('{}', os.environ['PORT']), 'w').close()\ntime.sleep(120)\n",
        marks.display()
    );
    let command = serde_json::to_string(&["python3", "-c", &script]).unwrap();
    let config = ControlConfig::parse(
        &format!(
            "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\nservices:\n  - namespace: shop\n    name: lazy\n    autoscaling:\n      min_instances: 2\n      max_instances: 2\n      tick: 100ms\n      scaler:\n        process: {{ command: {command}, start_timeout: 30s, stop_grace: 1s }}\n"
        ),
        "test",
    )
    .unwrap();
    let plane = ControlPlane::start_with_storage(config, Some(Box::new(store)))
        .await
        .unwrap();
    let api = plane.api_addr();
    // Both instances spawned (registered as starting) before the stall.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let view = tokio::task::spawn_blocking(move || request_text(api, "/v1/services/shop/lazy"))
            .await
            .unwrap();
        if view.matches("\"id\": \"shop-lazy-").count() == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "instances not spawned: {view}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A write whose commit stalls, holding the registry lock, before the
    // instances listen.
    let (_open, stalled_write) = stall_a_write(&gate, api);
    // Both instances listen; the scaler sees it within its probe period
    // (milliseconds) and registers them ready.
    let marks_dir = marks.clone();
    let listening = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::fs::read_dir(&marks_dir).map_or(0, |d| d.count()) < 2 {
            assert!(Instant::now() < deadline, "the instances never listened");
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(500));
    });
    listening.await.unwrap();
    let ready = std::thread::spawn(move || request(api, "GET", "/ready", ""));
    assert_eq!(
        ready.join().unwrap(),
        Ok(200),
        "/ready answered while the instances' writes waited"
    );
    // The commit goes through: both instances end up registered ready.
    end_stall(&gate, stalled_write);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let view = tokio::task::spawn_blocking(move || request_text(api, "/v1/services/shop/lazy"))
            .await
            .unwrap();
        if view.matches("\"ready\": true").count() == 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "instances not registered: {view}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    plane.shutdown().await;
}
