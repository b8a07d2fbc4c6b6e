//! What a listener speaks (`protocol:`) and, for `protocol: tcp`, where
//! its flows go (`tcp:`): plain data read by the config, the listener
//! settings and the L4 proxy ([`crate::l4`]), depending on none of them.

use std::time::Duration;

use meshless_model::serde_duration as duration;
use serde::{Deserialize, Serialize};

/// Listener protocols.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ListenerProtocol {
    /// HTTP/1.1 and HTTP/2 with prior knowledge, cleartext.
    #[default]
    Http,
    /// Raw TCP: each connection a flow to one endpoint of `tcp.cluster`.
    Tcp,
}

/// `listeners[].tcp:` where a `protocol: tcp` listener sends its flows
/// (Envoy's `tcp_proxy` filter; HAProxy's `mode tcp` frontend).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TcpProxy {
    /// The cluster flows go to.
    pub cluster: String,
    /// The hash key of a flow for hash policies (`maglev`, `ring_hash`).
    #[serde(default)]
    pub flow_key: FlowKey,
    /// A flow with no byte in either direction for this long is closed
    /// (Envoy's `tcp_proxy.idle_timeout`, 1h; HAProxy `timeout client`/
    /// `timeout server`); `0s` = never.
    #[serde(default = "default_idle_timeout", with = "duration")]
    pub idle_timeout: Duration,
    /// Endpoints tried before the client's connection is closed: a failed
    /// connect is counted against the endpoint (outlier detection) and the
    /// next one tried (HAProxy's `retries 3` with `option redispatch`;
    /// Envoy's `max_connect_attempts`).
    #[serde(default = "default_connect_attempts")]
    pub connect_attempts: u32,
}

fn default_idle_timeout() -> Duration {
    Duration::from_secs(3600)
}
fn default_connect_attempts() -> u32 {
    3
}

/// What identifies a flow for hashing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlowKey {
    /// The client's IP address: every connection of a client goes to one
    /// endpoint.
    #[default]
    SourceIp,
    /// The client's IP address and port: connections spread, each pinned.
    SourceIpPort,
}
