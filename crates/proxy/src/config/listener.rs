//! `listeners:` the ports the proxy accepts requests on and their limits.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::route::RouteConfig;
use crate::protocol::ListenerProtocol;

/// One listening port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    /// Unique name, used in metrics and logs.
    pub name: String,
    /// Address to bind.
    pub address: SocketAddr,
    /// `http` (HTTP/1.1 and h2c on the same port) or `tcp` (flows to `tcp.cluster`).
    #[serde(default)]
    pub protocol: ListenerProtocol,
    /// Routes, matched in order; the first match wins (`http` only).
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// The cluster of requests no route matches (`http` only; Envoy's
    /// catch-all virtual host, HAProxy's `default_backend`). Absent: `404`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_cluster: Option<String>,
    /// Where flows go (`tcp` listeners only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<crate::protocol::TcpProxy>,
    /// Deny rules checked on every accepted connection, first match wins.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<crate::deny::DenyRule>,
    /// PROXY protocol v2 accepted from trusted peers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_protocol: Option<crate::proxy_protocol::ProxyProtocolAccept>,
    /// Options of the listening and accepted sockets.
    #[serde(default)]
    pub socket: crate::sockopt::SocketOptions,
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
    /// What serves HTTP/1.1 downstream: `hyper` (default) or `meshless`
    /// (the connection state machine on meshless-h1).
    #[serde(default)]
    pub http1: crate::limits::Http1Server,
    /// HTTP/2 stream-reset limits (rapid reset).
    #[serde(default)]
    pub http2: crate::limits::Http2Limits,
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
            protocol: self.protocol,
            tcp: self.tcp.clone(),
            deny: self.deny.clone(),
            proxy_protocol: self.proxy_protocol.clone(),
            socket: self.socket.clone(),
            http1: self.http1,
            http2: self.http2.clone(),
        }
    }
}

/// Checks what depends on the listener's protocol, its deny rules, PROXY
/// protocol and socket options; `clusters` are the names defined and
/// `congestion` what the kernel offers. Paths are relative to the listener.
pub(super) fn validate_listener(
    l: &ListenerConfig,
    clusters: &std::collections::HashSet<&str>,
    congestion: Option<&str>,
) -> Result<(), meshless_model::FieldError> {
    use meshless_model::{AtPath, FieldError};
    let known = |path: &str, name: &str| {
        if clusters.contains(name) {
            Ok(())
        } else {
            Err(FieldError::new(path, format!("unknown cluster {name:?}")))
        }
    };
    match l.protocol {
        ListenerProtocol::Http => {
            if l.tcp.is_some() {
                return Err(FieldError::new("tcp", "only for `protocol: tcp` listeners"));
            }
            if l.routes.is_empty() && l.default_cluster.is_none() {
                return Err(FieldError::new(
                    "routes",
                    "at least one route (or a default_cluster) is required",
                ));
            }
            if let Some(c) = &l.default_cluster {
                known("default_cluster", c)?;
            }
        }
        ListenerProtocol::Tcp => {
            let Some(tcp) = &l.tcp else {
                return Err(FieldError::new(
                    "tcp",
                    "a `protocol: tcp` listener needs `tcp: { cluster: NAME }`",
                ));
            };
            if !l.routes.is_empty() || l.default_cluster.is_some() {
                return Err(FieldError::new(
                    "routes",
                    "a `protocol: tcp` listener has no routes or default_cluster (use tcp.cluster)",
                ));
            }
            known("tcp.cluster", &tcp.cluster)?;
            if l.tls.is_some() {
                return Err(FieldError::new(
                    "tls",
                    "TLS is terminated on HTTP listeners only; a `protocol: tcp` listener passes TLS through as bytes",
                ));
            }
            if tcp.connect_attempts == 0 {
                return Err(FieldError::new(
                    "tcp.connect_attempts",
                    "must be at least 1",
                ));
            }
        }
    }
    crate::deny::validate(&l.deny)?;
    if let Some(p) = &l.proxy_protocol
        && p.trusted.is_empty()
    {
        return Err(FieldError::new(
            "proxy_protocol.trusted",
            "at least one trusted source block is required",
        ));
    }
    l.socket.validate(true, congestion).at("socket")
}
