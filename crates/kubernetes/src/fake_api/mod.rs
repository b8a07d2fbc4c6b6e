//! An in-process fake Kubernetes API server for tests and the demo: real
//! HTTP on a loopback port, objects as the JSON of k8s-openapi types, one
//! global `resourceVersion`, list, watch (JSON lines, `allowWatchBookmarks`,
//! `410 Gone` as an `ERROR` event when the version is older than the log,
//! as the real server does), get, create, replace (with `resourceVersion`
//! conflicts), delete, and the `scale` subresource.
//!
//! Scenario scripts drive it: [`FakeApiServer::apply`], `delete`,
//! `bookmark`, `compact` (the next resume gets 410), `end_watches`,
//! `set_down`, `refuse_creates` (an admission webhook's or RBAC's
//! refusal). Deleting an object deletes its dependents (objects whose
//! `ownerReferences` name its uid), as the garbage collector's background
//! cascade does. [`kubelet`] runs created Pods as real processes. It is
//! no apiserver: no admission, no defaulting, no pagination, no field
//! selectors, no auth, no graceful deletion (a DELETE removes the object
//! at once); label selectors are equality-based only.

pub mod kubelet;
mod routes;
pub mod store;
pub mod workloads;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::watch;

use store::Store;

/// The error that drops a connection while the server is "down".
#[derive(Debug, thiserror::Error)]
#[error("fake API server is down")]
struct Down;

/// Every response body.
type Body = BoxBody<Bytes, Infallible>;

/// What the connections share.
#[derive(Debug)]
struct Shared {
    store: Mutex<Store>,
    /// Bumped on every change, bookmark, or when watches must end.
    changed: watch::Sender<u64>,
    /// Watches opened before this epoch end.
    epoch: AtomicU64,
    /// Answer 503 to everything and end watches.
    down: AtomicBool,
    /// `METHOD path?query` of every request, in order.
    requests: Mutex<Vec<String>>,
    /// Resource (plural) -> the status code every create of it answers.
    refusals: Mutex<std::collections::BTreeMap<String, u16>>,
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn notify(&self) {
        self.changed.send_modify(|v| *v += 1);
    }
}

/// A running fake API server; stops when dropped.
#[derive(Debug)]
pub struct FakeApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.end_watches();
    }
}

/// The resource (plural) of a k8s-openapi type, e.g. `endpointslices`.
fn plural<K: k8s_openapi::Resource>() -> &'static str {
    K::URL_PATH_SEGMENT
}

impl FakeApiServer {
    /// Binds `addr` (use `127.0.0.1:0` in tests) and serves.
    pub async fn start(addr: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let (changed, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::default()),
            changed,
            epoch: AtomicU64::new(0),
            down: AtomicBool::new(false),
            requests: Mutex::new(Vec::new()),
            refusals: Mutex::new(std::collections::BTreeMap::new()),
        });
        let (stop, stopped) = watch::channel(false);
        tokio::spawn(accept_loop(listener, Arc::clone(&shared), stopped));
        Ok(Self { addr, shared, stop })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig whose current context points at this server.
    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n\
             current-context: fake\nusers:\n- name: fake\n  user:\n    token: fake-token\n",
            self.url()
        );
        std::fs::write(path, text)
    }

    /// Adds or replaces an object, as `kubectl apply` would; returns its new resourceVersion.
    pub fn apply<K: k8s_openapi::Resource + Serialize>(&self, object: &K) -> u64 {
        let value = serde_json::to_value(object).unwrap_or_default();
        let v = {
            let mut s = self.shared.store();
            s.apply(plural::<K>(), value);
            s.version
        };
        self.shared.notify();
        v
    }

    /// Deletes an object; false when it was absent.
    pub fn delete<K: k8s_openapi::Resource>(&self, namespace: &str, name: &str) -> bool {
        let found = self
            .shared
            .store()
            .delete(plural::<K>(), namespace, name)
            .is_some();
        self.shared.notify();
        found
    }

    /// An object as stored, decoded as `K`.
    pub fn get<K: k8s_openapi::Resource + serde::de::DeserializeOwned>(
        &self,
        namespace: &str,
        name: &str,
    ) -> Option<K> {
        let key = (
            plural::<K>().to_owned(),
            namespace.to_owned(),
            name.to_owned(),
        );
        let value = self.shared.store().objects.get(&key).cloned()?;
        serde_json::from_value(value).ok()
    }

    /// The objects of type `K` in `namespace`, sorted by name.
    pub fn list<K: k8s_openapi::Resource + serde::de::DeserializeOwned>(
        &self,
        namespace: &str,
    ) -> Vec<K> {
        let items =
            self.shared
                .store()
                .list(plural::<K>(), Some(namespace), &store::Selector::default());
        items
            .into_iter()
            .filter_map(|v| serde_json::from_value(v).ok())
            .collect()
    }

    /// Changes as they happen: the value grows on every change (and
    /// bookmark), so a scenario's controller can wait on it.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.shared.changed.subscribe()
    }

    /// Every create (POST) of `resource` answers `code` (e.g. 403 as
    /// RBAC, 422 as an admission policy) until called with `None`.
    pub fn refuse_creates(&self, resource: &str, code: Option<u16>) {
        let mut r = self
            .shared
            .refusals
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match code {
            Some(c) => r.insert(resource.to_owned(), c),
            None => r.remove(resource),
        };
    }

    /// Changes a stored object in place (one step: a concurrent delete
    /// either wins or loses, the object is never brought back); false
    /// when it is absent.
    pub fn update<K>(&self, namespace: &str, name: &str, change: impl FnOnce(&mut K)) -> bool
    where
        K: k8s_openapi::Resource + Serialize + serde::de::DeserializeOwned,
    {
        let key = (
            plural::<K>().to_owned(),
            namespace.to_owned(),
            name.to_owned(),
        );
        {
            let mut s = self.shared.store();
            let Some(mut object) = s
                .objects
                .get(&key)
                .and_then(|v| serde_json::from_value::<K>(v.clone()).ok())
            else {
                return false;
            };
            change(&mut object);
            let value = serde_json::to_value(&object).unwrap_or_default();
            s.apply(plural::<K>(), value);
        }
        self.shared.notify();
        true
    }

    /// Sends a bookmark to every watch that allows them.
    pub fn bookmark(&self) {
        self.shared.store().bookmark();
        self.shared.notify();
    }

    /// Forgets the event log and ends every watch: each watcher resumes
    /// from a version that is now too old, gets `410 Gone`, and relists.
    pub fn compact(&self) {
        self.shared.store().compact();
        self.end_watches();
    }

    /// Ends every open watch stream (as the server does at its timeout).
    pub fn end_watches(&self) {
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        self.shared.notify();
    }

    /// While down, connections are dropped without an answer and open
    /// watches end.
    pub fn set_down(&self, down: bool) {
        self.shared.down.store(down, Ordering::SeqCst);
        self.end_watches();
    }

    /// `METHOD path?query` of every request so far.
    pub fn requests(&self) -> Vec<String> {
        self.shared
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    loop {
        let stream = tokio::select! {
            _ = crate::stopped(&mut stop) => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => {
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let shared = Arc::clone(&shared);
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let shared = Arc::clone(&shared);
                async move {
                    // Down: the connection is dropped without an answer, as
                    // when the API server's process is gone.
                    if shared.down.load(Ordering::SeqCst) {
                        return Err(Down);
                    }
                    Ok::<_, Down>(routes::handle(shared, req).await)
                }
            });
            let conn = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = conn => {}
                _ = crate::stopped(&mut stop) => {}
            }
        });
    }
}
