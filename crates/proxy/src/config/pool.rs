//! How a cluster keeps its upstream connections (`connection_pool:`) and
//! whether it speaks TLS to its endpoints (`tls:`).

use std::path::PathBuf;
use std::time::Duration;

use meshless_model::serde_duration as duration;

use meshless_model::FieldError;
use serde::{Deserialize, Serialize};

/// `connection_pool:` block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectionPool {
    /// Idle HTTP/1.1 connections kept per endpoint; more are closed when
    /// they come back (hyper-util's `pool_max_idle_per_host`, HAProxy's
    /// `pool-max-conn`).
    #[serde(default = "default_max_idle_per_endpoint")]
    pub max_idle_per_endpoint: u32,
    /// Connections kept open per endpoint for each request in flight there,
    /// opened in the background ahead of demand: `1.0` = none ahead, up to
    /// `3.0` (Envoy's `preconnect_policy.per_upstream_preconnect_ratio`).
    #[serde(default = "default_preconnect_ratio")]
    pub preconnect_ratio: f64,
    /// HTTP/2: keep-alive PINGs on every upstream connection, idle ones
    /// too (Envoy's `http2_protocol_options.connection_keepalive`).
    #[serde(default)]
    pub connection_keepalive: ConnectionKeepalive,
}

impl Default for ConnectionPool {
    fn default() -> Self {
        Self {
            max_idle_per_endpoint: default_max_idle_per_endpoint(),
            preconnect_ratio: default_preconnect_ratio(),
            connection_keepalive: ConnectionKeepalive::default(),
        }
    }
}

/// `connection_pool.connection_keepalive:` a PING every `interval` on each
/// upstream HTTP/2 connection; one not answered within `timeout` closes
/// the connection (a peer gone without a FIN is found before a request
/// waits on it). `interval: 0s` turns the PINGs off.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectionKeepalive {
    #[serde(default = "default_keepalive_interval", with = "duration")]
    pub interval: Duration,
    #[serde(default = "default_keepalive_timeout", with = "duration")]
    pub timeout: Duration,
}

impl Default for ConnectionKeepalive {
    fn default() -> Self {
        Self {
            interval: default_keepalive_interval(),
            timeout: default_keepalive_timeout(),
        }
    }
}

fn default_keepalive_interval() -> Duration {
    Duration::from_secs(30)
}

fn default_keepalive_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_max_idle_per_endpoint() -> u32 {
    1024
}

fn default_preconnect_ratio() -> f64 {
    1.0
}

impl ConnectionPool {
    /// Checks the ratio's range (Envoy's: 1.0 to 3.0).
    pub(super) fn validate(&self) -> Result<(), FieldError> {
        if self.connection_keepalive.timeout.is_zero() {
            return Err(FieldError::new(
                "connection_keepalive.timeout",
                "must be above zero",
            ));
        }
        if !(1.0..=3.0).contains(&self.preconnect_ratio) {
            return Err(FieldError::new(
                "preconnect_ratio",
                format!("must be 1.0 to 3.0, got {}", self.preconnect_ratio),
            ));
        }
        Ok(())
    }
}

/// `tls:` block: TLS to the endpoints (Envoy's `UpstreamTlsContext`,
/// HAProxy's `server ... ssl ca-file F sni S alpn A`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamTls {
    /// PEM file of the certificate authorities trusted for the endpoints'
    /// certificates (Envoy's `validation_context.trusted_ca`).
    pub ca_file: PathBuf,
    /// Name sent as SNI and checked against the endpoint's certificate
    /// (Envoy's `sni`; endpoints are IP addresses, so it is required).
    pub server_name: String,
    /// `true`: offer the ALPN id of `upstream_protocol` (`h2` or
    /// `http/1.1`) and refuse an endpoint that does not pick it (Envoy's
    /// `alpn_protocols`); `false`: offer none. Absent: `h2` is offered
    /// for `upstream_protocol: http2` (an endpoint that picks none is
    /// still spoken HTTP/2 to), nothing for `http1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alpn: Option<bool>,
}

impl UpstreamTls {
    /// Checks the name is one rustls can send as SNI.
    pub(super) fn validate(&self) -> Result<(), FieldError> {
        if rustls::pki_types::ServerName::try_from(self.server_name.as_str()).is_err() {
            return Err(FieldError::new(
                "server_name",
                format!("not a DNS name or IP address: {:?}", self.server_name),
            ));
        }
        if self.ca_file.as_os_str().is_empty() {
            return Err(FieldError::new(
                "ca_file",
                "must name a PEM file".to_owned(),
            ));
        }
        Ok(())
    }
}
