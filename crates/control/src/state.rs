//! What the API, the stream, the scaling loops and the background tasks
//! share: the registry, the distributor, metrics, settings, and the one
//! bearer-token check both servers apply.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Instant;

use crate::commit::{Committer, reconcile_dirty};
use crate::config::ControlConfig;
use crate::distributor::Distributor;
use crate::kubernetes::ReplicaScaler;
use crate::metrics::ControlMetrics;
use crate::registry::{Registry, RegistryError};

/// The refusal text of both servers when the token is missing or wrong.
pub const UNAUTHENTICATED: &str = "a valid bearer token is required";

/// The bearer-token check of the registration API and the stream: with no
/// token configured everything passes; otherwise the `authorization`
/// value must be `Bearer TOKEN`: the scheme in any case (RFC 7235: the
/// auth-scheme is case-insensitive), one or more spaces, then the token
/// (compared in constant time).
#[derive(Debug, Clone, Default)]
pub struct Auth {
    /// `Bearer TOKEN` (what this plane sends) and where TOKEN starts.
    expected: Option<Arc<str>>,
}

/// The scheme and its separator, as this plane sends it.
const BEARER: &str = "Bearer ";

impl Auth {
    /// Requires `token` when given.
    pub fn new(token: Option<&str>) -> Self {
        Self {
            expected: token.map(|t| Arc::from(format!("{BEARER}{t}"))),
        }
    }

    /// The `authorization` value this plane sends to its peers (the same
    /// token: replicas share one `token_file`); `None` without a token.
    pub fn header(&self) -> Option<&str> {
        self.expected.as_deref()
    }

    /// Whether a request with this `authorization` value may pass.
    pub fn allows(&self, authorization: Option<&str>) -> bool {
        let Some(expected) = &self.expected else {
            return true;
        };
        let want = expected[BEARER.len()..].as_bytes();
        let got = authorization.unwrap_or("");
        let Some((scheme, credential)) = got.split_once(' ') else {
            return false;
        };
        if !scheme.eq_ignore_ascii_case(BEARER.trim_end()) {
            return false;
        }
        let got = credential.trim_start_matches(' ').as_bytes();
        // Every byte is compared whatever the first difference.
        let diff = got.iter().zip(want).fold(0u8, |acc, (a, b)| acc | (a ^ b));
        diff == 0 && got.len() == want.len()
    }
}

/// State shared by the API, the stream and the background tasks.
#[derive(Debug)]
pub struct PlaneState {
    pub registry: Arc<Mutex<Registry>>,
    pub distributor: Arc<Distributor>,
    pub metrics: Arc<ControlMetrics>,
    pub config: ControlConfig,
    pub auth: Auth,
    /// Group commit of the registration API's writes.
    pub committer: Committer,
    /// Set once by the Kubernetes side when it starts (`scaler: kubernetes`).
    pub replica_scaler: OnceLock<Arc<dyn ReplicaScaler>>,
    /// The process scaler's last instance starts, phase by phase.
    pub starts: crate::starts::InstanceStarts,
    /// The registration API's bound address (set once bound): what a
    /// leader advertises to its followers.
    pub api_address: OnceLock<std::net::SocketAddr>,
    /// The registry writes to a store on disk (each write an fsync).
    persistent: bool,
}

impl PlaneState {
    /// The shared state over `registry`, starting the commit thread.
    pub fn new(
        registry: Arc<Mutex<Registry>>,
        metrics: Arc<ControlMetrics>,
        config: ControlConfig,
        auth: Auth,
    ) -> Self {
        let distributor = Arc::new(Distributor::new(
            Arc::clone(&registry),
            Arc::clone(&metrics),
            config.history,
        ));
        if config.kubernetes.is_some() {
            // Nothing is served from a snapshot before the first lists.
            distributor.hold_until_synced();
        }
        let persistent = registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_persistent();
        let committer = Committer::start(
            Arc::clone(&registry),
            Arc::clone(&distributor),
            Arc::clone(&metrics),
            config.batch_period,
        );
        Self {
            registry,
            distributor,
            metrics,
            config,
            auth,
            committer,
            replica_scaler: OnceLock::new(),
            starts: crate::starts::InstanceStarts::default(),
            api_address: OnceLock::new(),
            persistent,
        }
    }

    /// A write from a background task (a scaler's instance) that never
    /// blocks its executor thread on the disk: through group commit
    /// ([`PlaneState::write_grouped`]) when the registry writes to a store
    /// on disk, so the fsync, and any wait for a lock held through
    /// another fsync, run on the commit thread; at once when it is memory
    /// only (no I/O, and one thread hop fewer on the cold-start path).
    pub async fn write_offloaded<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Registry) -> Result<T, RegistryError> + Send + 'static,
    ) -> Result<T, RegistryError> {
        if self.persistent {
            self.write_grouped(f).await.map(|(v, _)| v)
        } else {
            self.write(f)
        }
    }

    /// A write through group commit ([`Committer::write`]): answered once
    /// durable, with the registry version its deltas are published at.
    pub async fn write_grouped<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Registry) -> Result<T, RegistryError> + Send + 'static,
    ) -> Result<(T, u64), RegistryError> {
        self.committer.write(f).await
    }

    /// The registry, even if a panicking writer poisoned the lock (every
    /// write leaves it consistent: the store first, then memory).
    pub fn lock(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` with the registry locked, without blocking an executor
    /// thread: at once when the lock is free, else on tokio's blocking
    /// pool. The commit thread holds the lock through a group's fsync, so a
    /// task that waited for it on a worker would stall every other task of
    /// that worker (streams, heartbeats, `/metrics`) for as long. For reads
    /// and in-memory changes only; `f` must not write the store (see
    /// [`PlaneState::with_registry_offloaded`]). `None` only when the
    /// runtime is shutting down.
    pub async fn with_registry<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&PlaneState, &mut Registry) -> T + Send + 'static,
    ) -> Option<T> {
        match self.registry.try_lock() {
            Ok(mut reg) => return Some(f(self, &mut reg)),
            Err(std::sync::TryLockError::Poisoned(p)) => return Some(f(self, &mut p.into_inner())),
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
        self.metrics.registry_waits_offloaded.inc();
        self.with_registry_offloaded(f).await
    }

    /// Runs `f` with the registry locked on tokio's blocking pool: for work
    /// that writes the store (a transaction and an fsync), which must never
    /// run on an executor thread. `None` only when the runtime is shutting
    /// down.
    pub async fn with_registry_offloaded<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&PlaneState, &mut Registry) -> T + Send + 'static,
    ) -> Option<T> {
        let state = Arc::clone(self);
        match tokio::task::spawn_blocking(move || f(&state, &mut state.lock())).await {
            Ok(out) => Some(out),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => None,
        }
    }

    /// Runs one write at once under the registry lock (its own store
    /// transaction); without a batch period, reconciles and publishes at
    /// once. For rare writes (startup, scaling, compaction); the API's
    /// writes use [`PlaneState::write_grouped`].
    pub fn write<T>(
        &self,
        f: impl FnOnce(&mut Registry) -> Result<T, RegistryError>,
    ) -> Result<T, RegistryError> {
        let committed = Instant::now();
        let mut reg = self.lock();
        let out = f(&mut reg);
        let refused = matches!(out, Err(RegistryError::Store(_)));
        self.metrics.record_store(refused, reg.is_broken());
        match &out {
            Ok(_) => self.metrics.writes.inc(),
            Err(_) => self.metrics.rejected_writes.inc(),
        };
        if out.is_ok() && self.config.batch_period.is_zero() {
            self.flush(&mut reg, committed)?;
        }
        out
    }

    /// Reconciles every changed service and publishes its delta. Call with
    /// the registry lock held (`reg`), so deltas publish in version order.
    pub fn flush(&self, reg: &mut Registry, committed: Instant) -> Result<(), RegistryError> {
        for delta in reconcile_dirty(reg, &self.metrics)? {
            self.distributor.publish(&delta, committed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auth_passes_only_the_bearer_token() {
        let open = Auth::new(None);
        assert!(open.allows(None) && open.allows(Some("anything")));
        let auth = Auth::new(Some("s3cret"));
        assert!(auth.allows(Some("Bearer s3cret")));
        assert!(
            auth.allows(Some("bearer s3cret")),
            "the scheme is case-insensitive"
        );
        assert!(auth.allows(Some("BEARER  s3cret")));
        for bad in [
            None,
            Some(""),
            Some("Bearer"),
            Some("Bearer "),
            Some("Bearer s3cre"),
            Some("Bearer s3cret2"),
            Some("Bearer S3CRET"),
            Some("Bearers3cret"),
            Some("Basic s3cret"),
            Some("s3cret"),
        ] {
            assert!(!auth.allows(bad), "{bad:?}");
        }
    }
}
