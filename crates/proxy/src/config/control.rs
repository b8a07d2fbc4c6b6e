//! `control:` the control plane whose distribution stream serves
//! `service:` clusters.

use std::time::Duration;

use meshless_model::serde_duration as duration;
use serde::{Deserialize, Serialize};

/// Envoy's `update_merge_window` default: 1 s.
pub fn default_update_merge_window() -> Duration {
    Duration::from_secs(1)
}

/// Where the control plane's distribution stream is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlLink {
    /// gRPC address of the control plane, `host:port`.
    pub address: String,
    /// File holding the bearer token the control plane requires.
    #[serde(default)]
    pub token_file: Option<std::path::PathBuf>,
    /// Deltas of a service arriving within this long of its last cluster
    /// rebuild are merged into one rebuild at the end of the window (like
    /// Envoy's `update_merge_window`); the first delta after a quiet
    /// window, a reset, and a delta to a service with no endpoints apply at
    /// once. `0s` rebuilds on every delta.
    #[serde(default = "default_update_merge_window", with = "duration")]
    pub update_merge_window: Duration,
}

impl ControlLink {
    /// A link to `address` with the defaults.
    pub fn new(address: impl Into<String>) -> Self {
        Self {
            address: address.into(),
            token_file: None,
            update_merge_window: default_update_merge_window(),
        }
    }
}
