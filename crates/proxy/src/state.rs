//! State shared by every listener, the admin server and background tasks.

use std::collections::HashSet;
use std::sync::atomic::AtomicBool;
use std::sync::{Mutex, PoisonError};

use arc_swap::ArcSwap;

use crate::access_log::AccessLogger;
use crate::metrics::Metrics;
use crate::snapshot::{ServiceFeeds, Snapshot};

/// The proxy's live state.
#[derive(Debug)]
pub struct ProxyState {
    /// The running configuration; swapped atomically on reload.
    pub snapshot: ArcSwap<Snapshot>,
    pub metrics: Metrics,
    pub access_log: ArcSwap<AccessLogger>,
    /// True once listeners are up and the config is loaded.
    pub ready: AtomicBool,
    /// True once the control plane's first snapshot arrived, or
    /// `control.initial_fetch_timeout` passed without it (always true
    /// without `control:`); `/ready` waits for it, as Envoy's initial
    /// fetch does.
    pub control_synced: AtomicBool,
    /// Endpoints of `service:` clusters as last received from the control
    /// plane; kept while it is unreachable (static stability).
    pub services: std::sync::Mutex<ServiceFeeds>,
    /// Services a held request asks the control plane to start (sent on
    /// the stream), each pending at most once.
    pub activate: std::sync::Arc<crate::activation_queue::ActivationQueue>,
    /// Notified whenever endpoints from the control plane change.
    pub endpoints_changed: tokio::sync::Notify,
    /// Open TCP flows by endpoint, woken when theirs leaves or comes back.
    pub flows: crate::flows::Flows,
    /// Per service: the last reason its instances failed to start, and when.
    pub activation_errors:
        std::sync::Mutex<std::collections::HashMap<String, (String, std::time::Instant)>>,
    /// Per service: one held request probes at a time.
    pub probing: Probing,
    /// The span exporter, when `tracing:` is set (fixed at start).
    pub tracer: Option<meshless_trace::Tracer>,
    /// Ahead-of-time placements of services at zero, from the control plane.
    pub placements: crate::placement::Placements,
    /// Where this proxy takes forwarded requests (`control.peer_listener`),
    /// set once its listener is bound.
    pub peer_address: std::sync::OnceLock<std::net::SocketAddr>,
}

impl ProxyState {
    /// After the running snapshot was swapped: wakes the TCP flows whose
    /// endpoint left or came back, and what waits for endpoints to change.
    pub fn endpoints_swapped(&self) {
        self.flows.update(&self.snapshot);
        self.endpoints_changed.notify_waiters();
    }

    /// A copy of the service endpoints (for building a snapshot).
    pub fn service_feeds(&self) -> ServiceFeeds {
        self.services
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// Services with a held request probing their starting instances: one
/// prober per service, the others wait for it.
#[derive(Debug, Default)]
pub struct Probing(Mutex<HashSet<String>>);

impl Probing {
    /// The turn to probe `service`, if nobody holds it.
    pub fn turn<'a>(&'a self, service: &str) -> Option<ProbeTurn<'a>> {
        let mut set = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        set.insert(service.to_owned()).then(|| ProbeTurn {
            probing: self,
            service: service.to_owned(),
        })
    }

    /// Whether some request is probing `service` now.
    pub fn is_probing(&self, service: &str) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(service)
    }
}

/// A held request's turn as its service's prober; given back on drop.
#[derive(Debug)]
pub struct ProbeTurn<'a> {
    probing: &'a Probing,
    service: String,
}

impl Drop for ProbeTurn<'_> {
    fn drop(&mut self) {
        self.probing
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.service);
    }
}

#[cfg(test)]
impl ProxyState {
    /// The state of a proxy running the config `yaml` (for unit tests),
    /// its activation requests queued on `activate`.
    pub(crate) fn for_tests(
        yaml: &str,
        activate: std::sync::Arc<crate::activation_queue::ActivationQueue>,
    ) -> Self {
        let cfg = crate::ProxyConfig::parse(yaml, "t.yaml").expect("config");
        let snapshot = Snapshot::build(cfg, None, &Default::default()).expect("snapshot");
        let off = &crate::config::AccessLog::Off;
        Self {
            snapshot: ArcSwap::from_pointee(snapshot),
            metrics: Metrics::new(),
            access_log: ArcSwap::from_pointee(AccessLogger::open(off).expect("off")),
            ready: AtomicBool::new(false),
            control_synced: AtomicBool::new(true),
            services: Default::default(),
            activate,
            endpoints_changed: tokio::sync::Notify::new(),
            flows: Default::default(),
            activation_errors: Default::default(),
            probing: Default::default(),
            tracer: None,
            placements: Default::default(),
            peer_address: Default::default(),
        }
    }
}
