//! A store whose writes fail: every registry write, reconcile and
//! compaction leaves memory unchanged when the store refuses it, so memory
//! and disk never diverge; once the store works again the same work goes
//! through, and a restart finds exactly what memory held.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use meshless_control::registry::{EndpointInput, Registry, ServicePort, ServiceSpec};
use meshless_control::store::{Loaded, Storage, Store, StoreError, WriteBatch};
use meshless_model::EndpointId;

/// A real store that refuses every write while `fail` is set (and every
/// read while `fail_reads` is).
#[derive(Debug)]
struct Flaky {
    inner: Store,
    fail: Arc<AtomicBool>,
    fail_reads: Arc<AtomicBool>,
}

impl Storage for Flaky {
    fn load(&self) -> Result<Loaded, StoreError> {
        if self.fail_reads.load(Ordering::SeqCst) {
            return Err(StoreError::Io("injected: input/output error".into()));
        }
        self.inner.load()
    }

    fn apply_group(&self, batches: &[WriteBatch]) -> Result<(), StoreError> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(StoreError::Io("injected: no space left on device".into()));
        }
        self.inner.apply_group(batches)
    }
}

/// A fresh directory for a store, removed when dropped.
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("meshless-flaky-{name}-"))
        .tempdir()
        .expect("temp dir")
}

fn spec() -> ServiceSpec {
    ServiceSpec {
        namespace: "shop".into(),
        name: "cart".into(),
        ports: vec![ServicePort::tcp(80)],
        settings: Default::default(),
    }
}

fn input(i: u32) -> EndpointInput {
    EndpointInput::new(format!("cart-{i}"), [10, 0, 0, i as u8].into(), 8080)
}

fn open(dir: &std::path::Path, fail: &Arc<AtomicBool>, max_per_slice: usize) -> Registry {
    let store = Flaky {
        inner: Store::open(dir).expect("store"),
        fail: Arc::clone(fail),
        fail_reads: Arc::new(AtomicBool::new(false)),
    };
    Registry::open_with(Some(Box::new(store)), max_per_slice).expect("registry")
}

fn view(r: &Registry) -> serde_json::Value {
    serde_json::to_value(r.view("shop/cart")).expect("json")
}

#[test]
fn failed_writes_change_nothing_in_memory_and_succeed_later() {
    let tmp = temp_dir("writes");
    let dir = tmp.path();
    let fail = Arc::new(AtomicBool::new(false));
    let mut r = open(dir, &fail, 4);
    r.put_service(spec()).expect("service");
    r.put_endpoints("shop/cart", (0..10).map(input).collect())
        .expect("endpoints");
    // The endpoints are stored; their slices are not yet (reconcile pending).
    fail.store(true, Ordering::SeqCst);
    let (version, before) = (r.version(), view(&r));
    assert!(r.reconcile("shop/cart").is_err(), "store refuses");
    assert!(r.put_endpoints("shop/cart", vec![input(20)]).is_err());
    assert!(
        r.delete_endpoints("shop/cart", &[EndpointId::new("cart-1")], true)
            .is_err()
    );
    assert!(r.put_service(spec()).is_err());
    assert_eq!(r.version(), version, "no version consumed");
    assert_eq!(view(&r), before, "memory unchanged");
    assert_eq!(
        r.dirty_services(),
        vec!["shop/cart".to_owned()],
        "still to reconcile"
    );
    fail.store(false, Ordering::SeqCst);
    let (delta, changes) = r
        .reconcile("shop/cart")
        .expect("store works again")
        .expect("a delta");
    assert_eq!(delta.upserted.len(), 10);
    assert_eq!(changes.created.len(), 3, "10 endpoints in slices of 4");
    let live = view(&r);
    drop(r);
    let r = Registry::open(Some(Store::open(dir).expect("reopen")), 4).expect("registry");
    assert_eq!(view(&r), live, "disk holds what memory held");
}

#[test]
fn a_failed_compaction_keeps_memory_and_is_retried() {
    let tmp = temp_dir("compact");
    let dir = tmp.path();
    let fail = Arc::new(AtomicBool::new(false));
    let mut r = open(dir, &fail, 10);
    r.put_service(spec()).expect("service");
    r.put_endpoints("shop/cart", (0..30).map(input).collect())
        .expect("endpoints");
    r.reconcile("shop/cart").expect("reconcile");
    // Leave one endpoint in each of the three slices of 10: all sparse
    // (under a quarter full), and one slice would hold them all.
    let gone: Vec<EndpointId> = r
        .view("shop/cart")
        .expect("view")
        .slices
        .iter()
        .flat_map(|s| s.endpoints[1..].to_vec())
        .map(EndpointId::new)
        .collect();
    r.delete_endpoints("shop/cart", &gone, true)
        .expect("delete");
    r.reconcile("shop/cart").expect("reconcile");
    let slices = |r: &Registry| r.view("shop/cart").map_or(0, |v| v.slices.len());
    assert_eq!(slices(&r), 3);
    fail.store(true, Ordering::SeqCst);
    let (version, before) = (r.version(), view(&r));
    let (deltas, stored) = r.compact_quiet(Duration::ZERO);
    assert!(stored.is_err() && deltas.is_empty());
    assert_eq!(
        (r.version(), view(&r)),
        (version, before),
        "memory unchanged"
    );
    fail.store(false, Ordering::SeqCst);
    let (deltas, stored) = r.compact_quiet(Duration::ZERO);
    stored.expect("compacts");
    assert_eq!(deltas.len(), 1);
    assert_eq!(slices(&r), 1, "three endpoints fit one slice");
    assert_eq!(deltas[0].upserted.len(), 2, "two endpoints moved");
    assert!(
        r.compact_quiet(Duration::ZERO).0.is_empty(),
        "once per change"
    );
    let live = view(&r);
    drop(r);
    let r = Registry::open(Some(Store::open(dir).expect("reopen")), 10).expect("registry");
    assert_eq!(view(&r), live, "disk holds what memory held");
}

#[test]
fn a_restart_settles_slices_left_behind_and_stores_them() {
    let tmp = temp_dir("settle");
    let dir = tmp.path();
    let fail = Arc::new(AtomicBool::new(false));
    let mut r = open(dir, &fail, 4);
    r.put_service(spec()).expect("service");
    r.put_endpoints("shop/cart", (0..6).map(input).collect())
        .expect("endpoints");
    // As a crash between the endpoint write and its reconcile: never reconciled.
    fail.store(true, Ordering::SeqCst);
    assert!(r.reconcile("shop/cart").is_err());
    drop(r);
    let r = Registry::open(Some(Store::open(dir).expect("reopen")), 4).expect("registry");
    let settled = view(&r);
    let v = r.view("shop/cart").expect("view");
    assert!(v.endpoints.iter().all(|e| e.slice.is_some()), "{settled}");
    assert_eq!(v.slices.iter().map(|s| s.endpoints.len()).sum::<usize>(), 6);
    let version = r.version();
    drop(r);
    let store = Store::open(dir).expect("reopen");
    let stored: usize = store
        .load()
        .expect("load")
        .slices
        .iter()
        .map(|s| s.2.len())
        .sum();
    assert_eq!(stored, 6, "the settled slices were stored");
    drop(store);
    let r = Registry::open(Some(Store::open(dir).expect("reopen")), 4).expect("registry");
    assert_eq!(view(&r), settled);
    assert_eq!(r.version(), version, "nothing left to settle: no write");
}

/// Versions handed out without a store write (activation errors, the
/// resets after a failed group) were published: a failed group's reload
/// must not hand them out again, or a subscriber would skip the later
/// writes that reuse them.
#[test]
fn a_failed_group_never_moves_the_version_back() {
    let tmp = temp_dir("version");
    let fail = Arc::new(AtomicBool::new(false));
    let mut r = open(tmp.path(), &fail, 10);
    r.put_service(spec()).expect("service");
    for _ in 0..3 {
        r.next_version();
    }
    let published = r.version();
    fail.store(true, Ordering::SeqCst);
    r.begin_group();
    r.put_endpoints("shop/cart", vec![input(1)])
        .expect("staged");
    assert!(r.end_group().is_err());
    assert!(r.version() >= published, "{} < {published}", r.version());
    fail.store(false, Ordering::SeqCst);
    r.put_endpoints("shop/cart", vec![input(2)]).expect("write");
    assert!(
        r.version() > published,
        "a fresh version for the next write"
    );
}

/// After the store is closed (shutdown), a write is refused: it could no
/// longer be made durable, and an acknowledgment would promise it was.
#[test]
fn a_write_after_the_store_closed_is_refused() {
    let tmp = temp_dir("closed");
    let fail = Arc::new(AtomicBool::new(false));
    let mut r = open(tmp.path(), &fail, 10);
    r.put_service(spec()).expect("service");
    r.close_store();
    let Err(err) = r.put_endpoints("shop/cart", vec![input(1)]) else {
        panic!("a write after close was accepted");
    };
    assert!(err.to_string().contains("shutting down"), "{err}");
    assert!(r.view("shop/cart").expect("view").endpoints.is_empty());
}

/// A real store that refuses every write once `left` reaches 0.
#[derive(Debug)]
struct Countdown {
    inner: Store,
    left: Arc<std::sync::atomic::AtomicI64>,
}

impl Storage for Countdown {
    fn load(&self) -> Result<Loaded, StoreError> {
        self.inner.load()
    }

    fn apply_group(&self, batches: &[WriteBatch]) -> Result<(), StoreError> {
        if self.left.fetch_sub(1, Ordering::SeqCst) <= 0 {
            return Err(StoreError::Io("injected: no space left on device".into()));
        }
        self.inner.apply_group(batches)
    }
}

/// Two services due for compaction and a store that takes only the first:
/// the first one's delta (stored) is still returned, to be published.
#[test]
fn a_compaction_cut_by_the_store_still_returns_what_it_stored() {
    let tmp = temp_dir("compact-partial");
    let left = Arc::new(std::sync::atomic::AtomicI64::new(i64::MAX));
    let store = Countdown {
        inner: Store::open(tmp.path()).expect("store"),
        left: Arc::clone(&left),
    };
    let mut r = Registry::open_with(Some(Box::new(store)), 10).expect("registry");
    for name in ["a", "b"] {
        let key = format!("shop/{name}");
        r.put_service(ServiceSpec {
            name: name.into(),
            ..spec()
        })
        .expect("service");
        r.put_endpoints(&key, (0..30).map(input).collect())
            .expect("endpoints");
        r.reconcile(&key).expect("reconcile");
        let gone: Vec<EndpointId> = r
            .view(&key)
            .expect("view")
            .slices
            .iter()
            .flat_map(|s| s.endpoints[1..].to_vec())
            .map(EndpointId::new)
            .collect();
        r.delete_endpoints(&key, &gone, true).expect("delete");
        r.reconcile(&key).expect("reconcile");
    }
    left.store(1, Ordering::SeqCst);
    let (deltas, stored) = r.compact_quiet(Duration::ZERO);
    assert!(stored.is_err(), "the second service's compaction failed");
    assert_eq!(deltas.len(), 1, "the first one's delta is kept");
    assert_eq!(deltas[0].service, "shop/a");
    left.store(i64::MAX, Ordering::SeqCst);
    let (deltas, stored) = r.compact_quiet(Duration::ZERO);
    stored.expect("compacts");
    assert_eq!(deltas.len(), 1);
    assert_eq!(deltas[0].service, "shop/b", "tried again next time");
}

/// C2: a failed group reloads memory from the store, but lease deadlines
/// live in memory only: the reload must not grant every TTL endpoint a
/// fresh period (with a failing store, a dead instance would never go).
#[test]
fn a_failed_write_keeps_every_lease_deadline() {
    let tmp = temp_dir("leases");
    let fail = Arc::new(AtomicBool::new(false));
    let mut r = open(tmp.path(), &fail, 4);
    r.put_service(spec()).expect("service");
    let leased = EndpointInput {
        ttl_seconds: Some(5),
        ..input(1)
    };
    let start = std::time::Instant::now();
    r.put_endpoints("shop/cart", vec![leased]).expect("put");
    // Ten seconds pass: one expiry that the store refuses (a full disk).
    fail.store(true, Ordering::SeqCst);
    let past_deadline = start + Duration::from_secs(10);
    assert!(r.expire(past_deadline).is_err(), "store refuses");
    // The deadline is still the first one, not ten seconds later + 5 s.
    fail.store(false, Ordering::SeqCst);
    assert_eq!(r.expire(past_deadline).expect("expire"), 1);
    assert!(
        r.view("shop/cart").expect("view").endpoints.is_empty(),
        "expired"
    );
}

/// C1: a store that could not even be read back after a failed write
/// leaves memory untrusted and writes refused, but only until it reads
/// again: the next write then reloads memory (and is refused, to be
/// retried), and the writes after it go through, with no restart.
#[test]
fn a_store_that_reads_again_ends_the_broken_state() {
    let tmp = temp_dir("broken");
    let (fail, fail_reads) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let store = Flaky {
        inner: Store::open(tmp.path()).expect("store"),
        fail: Arc::clone(&fail),
        fail_reads: Arc::clone(&fail_reads),
    };
    let mut r = Registry::open_with(Some(Box::new(store)), 4).expect("registry");
    r.put_service(spec()).expect("service");
    r.put_endpoints("shop/cart", vec![input(1)]).expect("put");
    fail.store(true, Ordering::SeqCst);
    fail_reads.store(true, Ordering::SeqCst);
    // A group (as the API's group commit writes) whose commit fails, and
    // whose reload fails too.
    r.begin_group();
    r.put_endpoints("shop/cart", vec![input(2)])
        .expect("staged");
    assert!(r.end_group().is_err());
    assert!(r.is_broken(), "memory could not be reloaded");
    assert!(r.put_endpoints("shop/cart", vec![input(3)]).is_err());
    // The disk is back.
    fail.store(false, Ordering::SeqCst);
    fail_reads.store(false, Ordering::SeqCst);
    let e = r
        .put_endpoints("shop/cart", vec![input(4)])
        .expect_err("computed on untrusted memory");
    assert!(e.to_string().contains("retry"), "{e}");
    assert!(!r.is_broken());
    r.put_endpoints("shop/cart", vec![input(4)])
        .expect("the retry goes through");
    let ids: Vec<String> = r
        .view("shop/cart")
        .expect("view")
        .endpoints
        .into_iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(ids, vec!["cart-1".to_owned(), "cart-4".to_owned()]);
}
