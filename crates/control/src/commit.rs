//! Group commit of registry writes. Writers hand their write to one
//! commit thread and wait (asynchronously) for its answer; the thread
//! takes every write queued, runs them in order under the registry lock
//! inside one group ([`Registry::begin_group`]), reconciles and commits
//! them in one store transaction (one fsync), then answers each writer and
//! publishes their deltas (in that order: see [`Shared::run`]). A writer
//! is acknowledged only after the commit that holds its write; the fsync
//! never runs on an async worker thread.

use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::distributor::Distributor;
use crate::metrics::ControlMetrics;
use crate::registry::{Registry, RegistryError, ServiceDelta};
use crate::store::StoreError;

/// The most writes in one group (one transaction).
pub const MAX_GROUP: usize = 1024;

/// Told the group's outcome: the registry version after it, or why the
/// store refused it.
type Completion = Box<dyn FnOnce(Result<u64, StoreError>) + Send>;
/// One write: runs on the registry and returns who to tell the outcome.
type Job = Box<dyn FnOnce(&mut Registry) -> Completion + Send>;

/// The handle writers send their writes to; the thread stops when the
/// last handle is dropped.
#[derive(Debug)]
pub struct Committer {
    jobs: Mutex<mpsc::Sender<Job>>,
    metrics: Arc<ControlMetrics>,
}

/// What the commit thread needs.
struct Shared {
    registry: Arc<Mutex<Registry>>,
    distributor: Arc<Distributor>,
    metrics: Arc<ControlMetrics>,
    /// Zero: reconcile and publish in every group; else the batch task does.
    batch_period: Duration,
}

impl Committer {
    /// Starts the commit thread.
    pub fn start(
        registry: Arc<Mutex<Registry>>,
        distributor: Arc<Distributor>,
        metrics: Arc<ControlMetrics>,
        batch_period: Duration,
    ) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let shared = Shared {
            registry,
            distributor,
            metrics: Arc::clone(&metrics),
            batch_period,
        };
        let spawned = std::thread::Builder::new()
            .name("meshless-commit".into())
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    let mut jobs = vec![first];
                    while jobs.len() < MAX_GROUP {
                        match rx.try_recv() {
                            Ok(job) => jobs.push(job),
                            Err(_) => break,
                        }
                    }
                    shared.run(jobs);
                }
            });
        if let Err(e) = spawned {
            // Without the thread every grouped write fails (its answer never comes).
            tracing::error!(error = %e, "cannot start the commit thread");
        }
        Self {
            jobs: Mutex::new(tx),
            metrics,
        }
    }

    /// Runs `f` on the registry in the next group and answers once that
    /// group is durable: `f`'s value and the registry version after the
    /// group. Its deltas are published right after the answers, before
    /// the registry lock is let go: a read of the registry after the
    /// answer sees them. A writer that goes away while waiting does not
    /// cancel the write.
    pub async fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Registry) -> Result<T, RegistryError> + Send + 'static,
    ) -> Result<(T, u64), RegistryError> {
        let (job, answer) = job(f, Arc::clone(&self.metrics));
        let sent = self
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(job);
        let stopped = || RegistryError::Store(StoreError::Io("the commit thread stopped".into()));
        sent.map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

type Answer<T> = tokio::sync::oneshot::Receiver<Result<(T, u64), RegistryError>>;

/// `f` as a job, and where its answer will come.
fn job<T: Send + 'static>(
    f: impl FnOnce(&mut Registry) -> Result<T, RegistryError> + Send + 'static,
    metrics: Arc<ControlMetrics>,
) -> (Job, Answer<T>) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job: Job = Box::new(move |reg: &mut Registry| {
        let out = f(reg);
        Box::new(move |group: Result<u64, StoreError>| {
            let answer = match (out, group) {
                (Ok(v), Ok(version)) => Ok((v, version)),
                (Err(e), _) => Err(e),
                (Ok(_), Err(e)) => Err(e.into()),
            };
            match &answer {
                Ok(_) => metrics.writes.inc(),
                Err(_) => metrics.rejected_writes.inc(),
            };
            let _ = tx.send(answer);
        })
    });
    (job, rx)
}

impl Shared {
    /// One group: run, reconcile, commit once, answer, publish. A job
    /// that panics fails its whole group (rolled back as a refused commit:
    /// nothing of it stored, memory reloaded, every writer answered with
    /// the error) and the thread goes on with the next group.
    fn run(&self, jobs: Vec<Job>) {
        let committed = Instant::now();
        let mut reg = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
        reg.begin_group();
        let mut completions: Vec<Completion> = Vec::with_capacity(jobs.len());
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for job in jobs {
                completions.push(job(&mut reg));
            }
            if self.batch_period.is_zero() {
                reconcile_dirty(&mut reg, &self.metrics).unwrap_or_else(|e| {
                    tracing::error!(error = %e, "reconcile failed");
                    Vec::new()
                })
            } else {
                Vec::new()
            }
        }));
        self.metrics.commit_groups.inc();
        let ended = match ran {
            Ok(deltas) => reg.end_group().map(|()| deltas),
            Err(_) => {
                tracing::error!("a write panicked: its group is rolled back");
                let error = StoreError::Io("a write in this group failed; rolled back".into());
                Err(reg.abort_group(error))
            }
        };
        match ended {
            Ok(deltas) => {
                self.metrics.record_store(false, reg.is_broken());
                // The writers first, then the subscribers: each answer and
                // each subscriber's wake-up queue a task on the executor in
                // the order they are made, so publishing first would put
                // every writer behind the fan-out to every subscriber. The
                // registry lock is held until the deltas are published, so
                // whatever reads the registry after an answer sees them.
                let outcome: Result<u64, StoreError> = Ok(reg.version());
                for c in completions {
                    c(outcome.clone());
                }
                for d in &deltas {
                    self.distributor.publish(d, committed);
                }
            }
            Err(failed) => {
                tracing::error!(error = %failed.error, "group commit failed; memory reloaded from the store");
                for service in &failed.services {
                    let delta = reset_delta(&mut reg, service);
                    self.distributor.publish(&delta, committed);
                }
                self.metrics.record_store(true, reg.is_broken());
                drop(reg);
                let outcome = Err(failed.error);
                for c in completions {
                    c(outcome.clone());
                }
            }
        }
    }
}

/// A reset delta with every endpoint `service` has now (none if gone).
fn reset_delta(reg: &mut Registry, service: &str) -> ServiceDelta {
    let upserted = reg.snapshot(service).map(|(_, e)| e).unwrap_or_default();
    ServiceDelta {
        service: service.to_owned(),
        version: reg.next_version(),
        upserted,
        removed: Vec::new(),
        reset: true,
        activation_error: None,
        settings: reg.settings(service).cloned(),
    }
}

/// Reconciles every changed service; returns the deltas to publish (in
/// version order) once their slices are stored.
pub fn reconcile_dirty(
    reg: &mut Registry,
    metrics: &ControlMetrics,
) -> Result<Vec<ServiceDelta>, RegistryError> {
    let mut out = Vec::new();
    for key in reg.dirty_services() {
        if let Some((delta, changes)) = reg.reconcile(&key)? {
            metrics.slice_writes.inc_by(changes.writes() as u64);
            out.push(delta);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{EndpointInput, ServiceSpec};
    use crate::store::{Loaded, Storage, Store, WriteBatch};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// A real store counting its transactions, refusing them while `fail`.
    #[derive(Debug)]
    struct Counted {
        inner: Store,
        fail: Arc<AtomicBool>,
        transactions: Arc<AtomicUsize>,
    }

    impl Storage for Counted {
        fn load(&self) -> Result<Loaded, StoreError> {
            self.inner.load()
        }

        fn apply_group(&self, batches: &[WriteBatch]) -> Result<(), StoreError> {
            if self.fail.load(Ordering::SeqCst) {
                return Err(StoreError::Io("injected: disk full".into()));
            }
            self.transactions.fetch_add(1, Ordering::SeqCst);
            self.inner.apply_group(batches)
        }
    }

    struct Fixture {
        shared: Shared,
        dir: std::path::PathBuf,
        fail: Arc<AtomicBool>,
        transactions: Arc<AtomicUsize>,
    }

    fn fixture(name: &str) -> Fixture {
        let dir =
            std::env::temp_dir().join(format!("meshless-commit-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let fail = Arc::new(AtomicBool::new(false));
        let transactions = Arc::new(AtomicUsize::new(0));
        let store = Counted {
            inner: Store::open(&dir).expect("store"),
            fail: Arc::clone(&fail),
            transactions: Arc::clone(&transactions),
        };
        let mut reg = Registry::open_with(Some(Box::new(store)), 100).expect("registry");
        reg.put_service(ServiceSpec {
            namespace: "shop".into(),
            name: "cart".into(),
            ports: Vec::new(),
            settings: Default::default(),
        })
        .expect("service");
        let registry = Arc::new(Mutex::new(reg));
        let metrics = Arc::new(ControlMetrics::new());
        let distributor = Arc::new(Distributor::new(
            Arc::clone(&registry),
            Arc::clone(&metrics),
            64,
        ));
        transactions.store(0, Ordering::SeqCst);
        Fixture {
            shared: Shared {
                registry,
                distributor,
                metrics,
                batch_period: Duration::ZERO,
            },
            dir,
            fail,
            transactions,
        }
    }

    fn put(i: u32) -> impl FnOnce(&mut Registry) -> Result<u64, RegistryError> + Send + 'static {
        move |r: &mut Registry| {
            let e = EndpointInput::new(format!("cart-{i}"), [10, 0, 0, i as u8].into(), 8080);
            r.put_endpoints("shop/cart", vec![e])
        }
    }

    fn stored_ids(dir: &std::path::Path) -> Vec<String> {
        let mut ids: Vec<String> = Store::open(dir)
            .expect("reopen")
            .load()
            .expect("load")
            .endpoints
            .into_iter()
            .map(|(_, e)| e.endpoint.id.to_string())
            .collect();
        ids.sort();
        ids
    }

    #[tokio::test]
    async fn a_group_is_one_transaction_and_answers_after_it() {
        let f = fixture("group");
        let mut deltas = f.shared.distributor.log.subscribe();
        let (jobs, answers): (Vec<Job>, Vec<_>) = (0..50)
            .map(|i| job(put(i), Arc::clone(&f.shared.metrics)))
            .unzip();
        // A write with an invalid weight fails alone; the others go through.
        let (bad, bad_answer) = job(
            |r: &mut Registry| {
                let mut e = EndpointInput::new("bad", [10, 0, 0, 1].into(), 80);
                e.weight = 0;
                r.put_endpoints("shop/cart", vec![e])
            },
            Arc::clone(&f.shared.metrics),
        );
        f.shared.run(jobs.into_iter().chain([bad]).collect());
        assert_eq!(
            f.transactions.load(Ordering::SeqCst),
            1,
            "one commit for the group"
        );
        let version = f.shared.registry.lock().expect("lock").version();
        for a in answers {
            let (_, v) = a.await.expect("answered").expect("written");
            assert_eq!(v, version, "answered with the version after the group");
        }
        assert!(bad_answer.await.expect("answered").is_err());
        // One delta (the reconcile of the group) holding all 50 endpoints.
        let d = deltas.try_recv().expect("published");
        let wire = meshless_api::decode_delta(&d.bytes.full).expect("decodes");
        assert_eq!(wire.upserted.len(), 50);
        drop(f.shared);
        assert_eq!(stored_ids(&f.dir).len(), 50, "durable");
        let _ = std::fs::remove_dir_all(&f.dir);
    }

    /// A write that panics fails its group, which is rolled back; the
    /// commit thread's next group is stored as any other (a group left
    /// half-open would acknowledge later writes without storing them).
    #[tokio::test]
    async fn a_panicking_write_rolls_its_group_back_and_the_next_is_durable() {
        let f = fixture("panic");
        let (before, before_answer) = job(put(1), Arc::clone(&f.shared.metrics));
        let (panics, panic_answer) = job(
            |r: &mut Registry| -> Result<u64, RegistryError> {
                let _ = r.put_endpoints(
                    "shop/cart",
                    vec![EndpointInput::new("half", [10, 0, 0, 9].into(), 80)],
                );
                panic!("a bug in a write")
            },
            Arc::clone(&f.shared.metrics),
        );
        f.shared.run(vec![before, panics]);
        assert!(
            before_answer.await.expect("answered").is_err(),
            "its group failed"
        );
        assert!(
            panic_answer.await.is_err(),
            "no answer from the panicked write"
        );
        {
            let reg = f
                .shared
                .registry
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let (_, eps) = reg.snapshot("shop/cart").expect("service");
            assert!(eps.is_empty(), "memory rolled back to the store");
        }
        let (next, next_answer) = job(put(7), Arc::clone(&f.shared.metrics));
        f.shared.run(vec![next]);
        next_answer.await.expect("answered").expect("written");
        drop(f.shared);
        assert_eq!(stored_ids(&f.dir), vec!["cart-7"], "durable");
        let _ = std::fs::remove_dir_all(&f.dir);
    }

    /// A full disk fails every group; only the services a failed group
    /// wrote get a reset, not every service of the registry.
    #[tokio::test]
    async fn a_failed_group_resets_only_the_services_it_wrote() {
        let f = fixture("fail-scope");
        let (big, big_answer) = job(
            |r: &mut Registry| {
                r.put_service(ServiceSpec {
                    namespace: "shop".into(),
                    name: "big".into(),
                    ports: Vec::new(),
                    settings: Default::default(),
                })?;
                let eps = (0..20)
                    .map(|i| EndpointInput::new(format!("big-{i}"), [10, 1, 0, i].into(), 80))
                    .collect();
                r.put_endpoints("shop/big", eps)
            },
            Arc::clone(&f.shared.metrics),
        );
        f.shared.run(vec![big]);
        big_answer.await.expect("answered").expect("written");
        let mut deltas = f.shared.distributor.log.subscribe();
        f.fail.store(true, Ordering::SeqCst);
        for i in 0..5 {
            let (failing, answer) = job(put(i), Arc::clone(&f.shared.metrics));
            f.shared.run(vec![failing]);
            assert!(answer.await.expect("answered").is_err());
        }
        let mut reset = Vec::new();
        while let Ok(d) = deltas.try_recv() {
            reset.push(d.service.clone());
        }
        assert_eq!(
            reset,
            vec!["shop/cart"; 5],
            "one reset per failed group, of cart only"
        );
        drop(f.shared);
        let _ = std::fs::remove_dir_all(&f.dir);
    }

    #[tokio::test]
    async fn a_failed_group_answers_every_writer_with_the_error_and_memory_matches_the_store() {
        let f = fixture("fail");
        let (jobs, answers): (Vec<Job>, Vec<_>) = (0..3)
            .map(|i| job(put(i), Arc::clone(&f.shared.metrics)))
            .unzip();
        f.shared.run(jobs);
        let (ok, ok_answer) = job(put(9), Arc::clone(&f.shared.metrics));
        let mut deltas = f.shared.distributor.log.subscribe();
        f.fail.store(true, Ordering::SeqCst);
        let (failing, failing_answers): (Vec<Job>, Vec<_>) = (3..6)
            .map(|i| job(put(i), Arc::clone(&f.shared.metrics)))
            .unzip();
        f.shared.run(failing);
        for a in failing_answers {
            assert!(a.await.expect("answered").is_err(), "not acknowledged");
        }
        {
            let reg = f.shared.registry.lock().expect("lock");
            let (_, eps) = reg.snapshot("shop/cart").expect("service");
            assert_eq!(eps.len(), 3, "memory reloaded: only the committed writes");
        }
        // Subscribers get a reset to the reloaded state.
        let d = deltas.try_recv().expect("reset published");
        let wire = meshless_api::decode_delta(&d.bytes.full).expect("decodes");
        assert!(wire.reset);
        assert_eq!(wire.upserted.len(), 3);
        // The store works again: the next group goes through.
        f.fail.store(false, Ordering::SeqCst);
        f.shared.run(vec![ok]);
        ok_answer.await.expect("answered").expect("written");
        for a in answers {
            a.await.expect("answered").expect("written");
        }
        drop(f.shared);
        assert_eq!(
            stored_ids(&f.dir),
            vec!["cart-0", "cart-1", "cart-2", "cart-9"]
        );
        let _ = std::fs::remove_dir_all(&f.dir);
    }
}
