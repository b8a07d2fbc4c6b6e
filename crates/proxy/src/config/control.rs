//! `control:` the control plane whose distribution stream serves
//! `service:` clusters.

use std::time::Duration;

use meshless_model::FieldError;
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
    /// Ahead-of-time placement: the (plain `http`) listener where this
    /// proxy takes requests forwarded by the proxies of other nodes for a
    /// service at zero placed on its node. Absent: it takes none (it still
    /// forwards to the proxies that do).
    #[serde(default)]
    pub peer_listener: Option<String>,
    /// The address other proxies reach `peer_listener` at, `IP:port`.
    /// Absent: the address the listener bound (required when that is
    /// `0.0.0.0` or `::`).
    #[serde(default)]
    pub peer_address: Option<std::net::SocketAddr>,
    /// `/ready` answers 503 until the first snapshot from the control
    /// plane arrived, or this long after start (Envoy's
    /// `initial_fetch_timeout`, 15 s); `0s`: ready at once.
    #[serde(default = "default_initial_fetch_timeout", with = "duration")]
    pub initial_fetch_timeout: Duration,
}

/// Envoy's `initial_fetch_timeout` default: 15 s.
pub fn default_initial_fetch_timeout() -> Duration {
    Duration::from_secs(15)
}

impl ControlLink {
    /// A link to `address` with the defaults.
    pub fn new(address: impl Into<String>) -> Self {
        Self {
            address: address.into(),
            token_file: None,
            update_merge_window: default_update_merge_window(),
            peer_listener: None,
            peer_address: None,
            initial_fetch_timeout: default_initial_fetch_timeout(),
        }
    }

    /// Checks `peer_listener` names a plain HTTP listener of `listeners`,
    /// and that other proxies can be told where it is.
    pub fn validate_peer(&self, listeners: &[super::ListenerConfig]) -> Result<(), FieldError> {
        let Some(name) = &self.peer_listener else {
            if self.peer_address.is_some() {
                return Err(FieldError::new(
                    "control.peer_address",
                    "needs control.peer_listener",
                ));
            }
            return Ok(());
        };
        let at = "control.peer_listener";
        let Some(l) = listeners.iter().find(|l| &l.name == name) else {
            return Err(FieldError::new(at, format!("no listener named {name:?}")));
        };
        if l.protocol != crate::protocol::ListenerProtocol::Http || l.tls.is_some() {
            return Err(FieldError::new(
                at,
                "must be a plain `http` listener (no tls): peers forward cleartext HTTP",
            ));
        }
        if self.peer_address.is_none() && l.address.ip().is_unspecified() {
            return Err(FieldError::new(
                "control.peer_address",
                format!(
                    "required: listener {name:?} binds {}, which other proxies cannot dial",
                    l.address
                ),
            ));
        }
        Ok(())
    }
}
