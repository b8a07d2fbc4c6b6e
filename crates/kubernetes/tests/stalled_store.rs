//! The Kubernetes source writes the registry off the executor: while a
//! commit of one of its changes is stalled in the store (a slow or hung
//! disk with `data_dir`), the control plane's only executor thread keeps
//! serving (`/ready` answers), and the change lands once the store does.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::{pod, pod_slice, temp_dir, watching};
use meshless_control::plane::ControlPlane;
use meshless_control::store::{Loaded, Storage, Store, StoreError, WriteBatch};
use meshless_kubernetes::fake_api::FakeApiServer;
use meshless_kubernetes::objects::{PodState, service};

/// A real store whose commits wait while `closed` is set.
#[derive(Debug)]
struct Gated {
    inner: Store,
    gate: Arc<(Mutex<bool>, Condvar, AtomicBool)>,
}

impl Storage for Gated {
    fn load(&self) -> Result<Loaded, StoreError> {
        self.inner.load()
    }

    fn apply_group(&self, batches: &[WriteBatch]) -> Result<(), StoreError> {
        let (closed, opened, stalled) = &*self.gate;
        let mut closed = closed.lock().unwrap();
        while *closed {
            stalled.store(true, Ordering::SeqCst);
            closed = opened.wait(closed).unwrap();
        }
        drop(closed);
        self.inner.apply_group(batches)
    }
}

/// Opens the gate when dropped, so a failed assertion leaves no commit
/// (and no runtime shutdown) waiting forever.
struct OpenOnDrop(Arc<(Mutex<bool>, Condvar, AtomicBool)>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        *self.0.0.lock().unwrap() = false;
        self.0.1.notify_all();
    }
}

/// The status of `GET path`, from a plain thread (not the runtime under
/// test), or the error (a read timeout: the plane did not answer).
fn get(addr: SocketAddr, path: &str) -> Result<u16, String> {
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    let req = format!("GET {path} HTTP/1.1\r\nhost: plane\r\nconnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).map_err(|e| e.to_string())?;
    let head = String::from_utf8_lossy(&out);
    head.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no status in {head:?}"))
}

/// Waits (on this plain thread) until `ok`, for at most 20 s.
fn wait_until(what: &str, ok: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_stalled_commit_of_a_kubernetes_change_leaves_the_executor_serving() {
    // The fake API server and the pods on a runtime of their own; the
    // control plane and its Kubernetes source on one executor thread; the
    // checks on this thread, so a blocked executor fails the test instead
    // of hanging it.
    let world = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let plane_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (a, b, fake) = world.block_on(async {
        let fake = FakeApiServer::start("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        (pod("a").await, pod("b").await, fake)
    });
    fake.apply(&service("shop", "cart", &[("http", 80)]));
    fake.apply(&pod_slice("cart", &a, PodState::Ready));
    let dir = temp_dir("stalled-store");
    let kubeconfig = dir.path().join("kubeconfig");
    fake.write_kubeconfig(&kubeconfig).unwrap();
    let (source, config) = watching(&kubeconfig);
    let gate = Arc::new((Mutex::new(false), Condvar::new(), AtomicBool::new(false)));
    let store = Gated {
        inner: Store::open(&dir.path().join("data")).unwrap(),
        gate: Arc::clone(&gate),
    };
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    let plane = plane_rt.block_on(async {
        let plane = ControlPlane::start_with_storage(config, Some(Box::new(store)))
            .await
            .unwrap();
        meshless_kubernetes::start(plane.state.clone(), source, stopped)
            .await
            .unwrap();
        plane
    });
    let pods = |n: usize| {
        plane
            .state
            .lock()
            .view("shop/cart")
            .is_some_and(|v| v.endpoints.len() == n)
    };
    wait_until("the first pod is registered", || pods(1));

    // Close the gate; the next change's commit stalls in the store.
    *gate.0.lock().unwrap() = true;
    let open = OpenOnDrop(Arc::clone(&gate));
    fake.apply(&pod_slice("cart", &b, PodState::Ready));
    wait_until("the change reaches the store", || {
        gate.2.load(Ordering::SeqCst)
    });
    // The plane's one executor thread still answers (it would not, were
    // the source's commit waiting on it). The registry itself stays
    // locked by the stalled commit meanwhile.
    assert_eq!(
        get(plane.api_addr(), "/ready"),
        Ok(200),
        "/ready during the stalled commit"
    );
    // The store goes on: the change lands.
    drop(open);
    wait_until("the second pod is registered", || pods(2));
    drop(plane_rt);
    drop(world);
}
