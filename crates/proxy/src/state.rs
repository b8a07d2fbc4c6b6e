//! State shared by every listener, the admin server and background tasks.

use std::sync::atomic::AtomicBool;

use arc_swap::ArcSwap;

use crate::access_log::AccessLogger;
use crate::metrics::Metrics;
use crate::snapshot::Snapshot;

/// The proxy's live state.
#[derive(Debug)]
pub struct ProxyState {
    /// The running configuration; swapped atomically on reload.
    pub snapshot: ArcSwap<Snapshot>,
    pub metrics: Metrics,
    pub access_log: ArcSwap<AccessLogger>,
    /// True once listeners are up and the config is loaded.
    pub ready: AtomicBool,
}
