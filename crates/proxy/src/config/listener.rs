//! `listeners:` the ports the proxy accepts requests on and their limits.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::route::RouteConfig;

/// One listening port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    /// Unique name, used in metrics and logs.
    pub name: String,
    /// Address to bind.
    pub address: SocketAddr,
    /// Only `http` (HTTP/1.1 and h2c on the same port).
    #[serde(default)]
    pub protocol: ListenerProtocol,
    /// Routes, matched in order; the first match wins.
    pub routes: Vec<RouteConfig>,
    /// Downstream connections served at once; more wait in the kernel's
    /// accept backlog until one closes.
    #[serde(default = "crate::limits::default_max_connections")]
    pub max_connections: u32,
    /// Request-head size limits.
    #[serde(default)]
    pub limits: crate::limits::HeadLimits,
    /// Downstream timeouts.
    #[serde(default)]
    pub timeouts: crate::limits::ListenerTimeouts,
    /// `TRACE`: `refuse` (405) or `forward`. `CONNECT` is always refused (501).
    #[serde(default)]
    pub trace: crate::limits::TracePolicy,
    /// Path normalisation before routing.
    #[serde(default)]
    pub paths: crate::limits::PathSettings,
    /// `X-Forwarded-For` handling.
    #[serde(default)]
    pub forwarding: crate::limits::Forwarding,
    /// TLS termination: certificates by SNI name, ALPN, resumption.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<crate::tls::TlsSettings>,
}

impl ListenerConfig {
    /// The settings a running listener takes from this block.
    pub fn settings(&self) -> crate::limits::ListenerSettings {
        crate::limits::ListenerSettings {
            max_connections: self.max_connections,
            limits: self.limits.clone(),
            timeouts: self.timeouts.clone(),
            trace: self.trace,
            paths: self.paths.clone(),
            forwarding: self.forwarding.clone(),
        }
    }
}

/// Listener protocols.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ListenerProtocol {
    /// HTTP/1.1 and HTTP/2 with prior knowledge, cleartext.
    #[default]
    Http,
}
