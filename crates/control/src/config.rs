//! The control plane's YAML configuration.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use meshless_model::serde_duration as duration;
use serde::{Deserialize, Serialize};

use crate::reconciler::{DEFAULT_MAX_PER_SLICE, MAX_MAX_PER_SLICE};
use crate::registry::{EndpointInput, ServiceSpec};

/// `meshless control --config FILE`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlConfig {
    /// Registration API (HTTP JSON) and `/metrics`.
    #[serde(default = "default_api")]
    pub api_address: SocketAddr,
    /// Distribution stream (gRPC).
    #[serde(default = "default_grpc")]
    pub grpc_address: SocketAddr,
    /// File holding the bearer token; required when either address is not loopback.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// Embedded store directory; absent = in memory only (`--data-dir` overrides).
    #[serde(default)]
    pub data_dir: Option<PathBuf>,
    /// Endpoints per slice, 1..=1000.
    #[serde(default = "default_max_per_slice")]
    pub max_endpoints_per_slice: usize,
    /// Changes within this window are reconciled and sent together; 0 = at once.
    #[serde(default, with = "duration")]
    pub batch_period: Duration,
    /// Sparse slices of a service are merged once it has been quiet this long.
    #[serde(default = "default_quiet", with = "duration")]
    pub compact_after: Duration,
    /// Deltas kept for resuming proxies.
    #[serde(default = "default_history")]
    pub history: usize,
    /// Largest accepted API request body, in bytes.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// Services (and endpoints) registered at start.
    #[serde(default)]
    pub services: Vec<StaticService>,
}

/// A service declared in the file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticService {
    pub namespace: String,
    pub name: String,
    #[serde(default)]
    pub ports: Vec<crate::registry::ServicePort>,
    #[serde(default)]
    pub endpoints: Vec<EndpointInput>,
    /// Scale the service by load (and to zero): see docs/control.md.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<crate::scaling::ServiceScaling>,
}

impl StaticService {
    /// The service part.
    pub fn spec(&self) -> ServiceSpec {
        ServiceSpec {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            ports: self.ports.clone(),
        }
    }
}

fn default_api() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9400))
}
fn default_grpc() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9401))
}
fn default_max_per_slice() -> usize {
    DEFAULT_MAX_PER_SLICE
}
fn default_quiet() -> Duration {
    Duration::from_secs(30)
}
fn default_history() -> usize {
    10_000
}
fn default_max_body() -> usize {
    4 << 20
}

impl Default for ControlConfig {
    fn default() -> Self {
        Self {
            api_address: default_api(),
            grpc_address: default_grpc(),
            token_file: None,
            data_dir: None,
            max_endpoints_per_slice: default_max_per_slice(),
            batch_period: Duration::ZERO,
            compact_after: default_quiet(),
            history: default_history(),
            max_body_bytes: default_max_body(),
            services: Vec::new(),
        }
    }
}

/// A rejected control-plane configuration.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {path}: {reason}")]
pub struct ControlConfigError {
    pub file: String,
    pub path: String,
    pub reason: String,
}

impl ControlConfig {
    /// Reads and validates `file`.
    pub fn load(file: &Path) -> Result<Self, ControlConfigError> {
        let name = file.display().to_string();
        let text = std::fs::read_to_string(file).map_err(|e| ControlConfigError {
            file: name.clone(),
            path: "(file)".into(),
            reason: e.to_string(),
        })?;
        Self::parse(&text, &name)
    }

    /// Parses and validates YAML `text`.
    pub fn parse(text: &str, file: &str) -> Result<Self, ControlConfigError> {
        let err = |path: String, reason: String| ControlConfigError {
            file: file.to_owned(),
            path,
            reason,
        };
        let config: ControlConfig =
            meshless_model::yaml::from_str(text).map_err(|(path, reason)| err(path, reason))?;
        if !(1..=MAX_MAX_PER_SLICE).contains(&config.max_endpoints_per_slice) {
            return Err(err(
                "max_endpoints_per_slice".into(),
                "must be 1..=1000".into(),
            ));
        }
        if config.history == 0 {
            return Err(err("history".into(), "must be at least 1".into()));
        }
        let exposed =
            !config.api_address.ip().is_loopback() || !config.grpc_address.ip().is_loopback();
        if exposed && config.token_file.is_none() {
            return Err(err(
                "token_file".into(),
                "required when api_address or grpc_address is not a loopback address".into(),
            ));
        }
        Ok(config)
    }
}
