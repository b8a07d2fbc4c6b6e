//! The control plane's YAML configuration: addresses, slice and history
//! settings, and services declared at start with their autoscaling.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use meshless_model::serde_duration as duration;
use meshless_model::{AtPath, FieldError, ServiceSettings};
use serde::{Deserialize, Serialize};

use crate::api::{EndpointInput, ServicePort, ServiceSpec, check_endpoint_id};
use crate::autoscaler::AutoscaleConfig;
use crate::kubernetes::{KubernetesSource, ScaleTarget};
use crate::process_scaler::ProcessSpec;
use crate::reconciler::{DEFAULT_MAX_PER_SLICE, MAX_MAX_PER_SLICE};
use crate::registry::{RegistryError, check_endpoints, check_service_spec};

/// `meshless control --config FILE`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlConfig {
    /// Registration API (HTTP JSON) and `/metrics`.
    #[serde(default = "default_api_address")]
    pub api_address: SocketAddr,
    /// Distribution stream (gRPC).
    #[serde(default = "default_grpc_address")]
    pub grpc_address: SocketAddr,
    /// File holding the bearer token; required when either address is not loopback.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// Embedded store directory; absent = in memory only (`--data-dir` overrides).
    #[serde(default)]
    pub data_dir: Option<PathBuf>,
    /// Endpoints per slice, 1..=1000.
    #[serde(default = "default_max_endpoints_per_slice")]
    pub max_endpoints_per_slice: usize,
    /// Changes within this window are reconciled and sent together; 0 = at once.
    #[serde(default, with = "duration")]
    pub batch_period: Duration,
    /// Sparse slices of a service are merged once it has been quiet this long.
    #[serde(default = "default_compact_after", with = "duration")]
    pub compact_after: Duration,
    /// Deltas kept for resuming proxies.
    #[serde(default = "default_history")]
    pub history: usize,
    /// Largest accepted API request body, in bytes.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
    /// Messages a subscriber's stream writes in one go: every delta queued
    /// for it since its last write, up to this many (1: one write each).
    #[serde(default = "default_stream_batch")]
    pub stream_batch: usize,
    /// Pacing of each subscriber's stream: after a write, deltas published
    /// within this long wait and leave together in its next write (one
    /// DATA frame, one `write`); the first delta after a quiet spell leaves
    /// at once. 0 = write as soon as a delta arrives.
    #[serde(default = "default_stream_interval", with = "duration")]
    pub stream_interval: Duration,
    /// Services (and endpoints) registered at start.
    #[serde(default)]
    pub services: Vec<StaticService>,
    /// Watch a Kubernetes cluster's Services and EndpointSlices (run by
    /// the `meshless-kubernetes` crate; see docs/kubernetes.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<KubernetesSource>,
}

/// A service declared in the file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticService {
    pub namespace: String,
    pub name: String,
    #[serde(default)]
    pub ports: Vec<ServicePort>,
    #[serde(default)]
    pub endpoints: Vec<EndpointInput>,
    /// Balancing settings proxies receive with the endpoints.
    #[serde(default, skip_serializing_if = "ServiceSettings::is_empty")]
    pub settings: ServiceSettings,
    /// Scale the service by load (and to zero): see docs/control.md.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<ServiceScaling>,
}

impl StaticService {
    /// Checks what the plane writes into an empty registry at start, as
    /// the API would check it: the service (names, ports, settings) and
    /// its endpoints (ranges, addresses, each id once and addressable by
    /// the API's paths). So `--check` refuses what the start would.
    pub fn validate_seed(&self) -> Result<(), FieldError> {
        let field = |e: RegistryError| match e {
            RegistryError::Invalid(f) => f,
            other => FieldError::new(meshless_model::field_error::TOP_LEVEL, other.to_string()),
        };
        check_service_spec(&self.spec()).map_err(field)?;
        check_endpoints("endpoints", &self.endpoints).map_err(field)?;
        for (j, e) in self.endpoints.iter().enumerate() {
            check_endpoint_id(&e.id)
                .map_err(|reason| FieldError::new(format!("endpoints[{j}].id"), reason))?;
        }
        Ok(())
    }

    /// The service part.
    pub fn spec(&self) -> ServiceSpec {
        ServiceSpec {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            ports: self.ports.clone(),
            settings: self.settings.clone(),
        }
    }
}

/// `autoscaling:` of a service: the autoscaler's settings (written at the
/// same level in YAML), how often it decides, and how instances are run.
/// Unknown keys are still rejected: serde checks what neither this struct
/// nor the flattened [`AutoscaleConfig`] consumed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceScaling {
    #[serde(flatten)]
    pub autoscale: AutoscaleConfig,
    /// How often the autoscaler decides (activations decide at once).
    #[serde(default = "default_tick", with = "duration")]
    pub tick: Duration,
    /// Between marking an instance terminating and stopping it.
    #[serde(default = "default_drain_period", with = "duration")]
    pub drain_period: Duration,
    /// How instances are run.
    pub scaler: ScalerConfig,
}

/// The scaler of a service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ScalerConfig {
    /// One local process per instance.
    Process(ProcessSpec),
    /// POST `{"service": ..., "desired": N}` to `url` on every change
    /// (each call bounded by `timeout`, retried every tick until it
    /// succeeds); instances register themselves through the API.
    Webhook {
        url: String,
        #[serde(default = "default_webhook_timeout", with = "duration")]
        timeout: Duration,
    },
    /// Set a Deployment's (or StatefulSet's) replicas through its `scale`
    /// subresource; its pods arrive through the Kubernetes source.
    Kubernetes(ScaleTarget),
}

impl ServiceScaling {
    /// Checks ranges and the scaler; the error names the field at fault.
    pub fn validate(&self) -> Result<(), FieldError> {
        self.autoscale.validate()?;
        if self.tick.is_zero() {
            return Err(FieldError::new("tick", "must be above zero"));
        }
        match &self.scaler {
            ScalerConfig::Process(p) => p.validate().at("scaler.process"),
            ScalerConfig::Webhook { url, .. } if !url.starts_with("http://") => Err(
                FieldError::new("scaler.webhook.url", "must be an http:// URL"),
            ),
            ScalerConfig::Webhook { timeout, .. } if timeout.is_zero() => Err(FieldError::new(
                "scaler.webhook.timeout",
                "must be above 0s",
            )),
            ScalerConfig::Kubernetes(t) => t.validate().at("scaler.kubernetes"),
            _ => Ok(()),
        }
    }
}

/// The longest `batch_period` accepted.
pub const MAX_BATCH_PERIOD: Duration = Duration::from_secs(10);

/// The smallest `max_body_bytes` accepted: room for a small write.
pub const MIN_MAX_BODY_BYTES: usize = 256;

fn default_api_address() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9400))
}
fn default_grpc_address() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9401))
}
fn default_max_endpoints_per_slice() -> usize {
    DEFAULT_MAX_PER_SLICE
}
fn default_compact_after() -> Duration {
    Duration::from_secs(30)
}
fn default_history() -> usize {
    10_000
}
/// Messages per stream write: 16, so a full queue of 4 batches holds
/// 64 messages, the bound per subscriber before batching.
pub fn default_stream_batch() -> usize {
    16
}
/// 0: no pacing (see `stream_interval`).
pub fn default_stream_interval() -> Duration {
    Duration::ZERO
}
fn default_max_body_bytes() -> usize {
    4 << 20
}
fn default_tick() -> Duration {
    Duration::from_secs(2)
}
fn default_webhook_timeout() -> Duration {
    crate::webhook::DEFAULT_TIMEOUT
}

fn default_drain_period() -> Duration {
    Duration::from_secs(10)
}

impl Default for ControlConfig {
    fn default() -> Self {
        Self {
            api_address: default_api_address(),
            grpc_address: default_grpc_address(),
            token_file: None,
            data_dir: None,
            max_endpoints_per_slice: default_max_endpoints_per_slice(),
            batch_period: Duration::ZERO,
            compact_after: default_compact_after(),
            history: default_history(),
            max_body_bytes: default_max_body_bytes(),
            stream_batch: default_stream_batch(),
            stream_interval: default_stream_interval(),
            services: Vec::new(),
            kubernetes: None,
        }
    }
}

/// A rejected control-plane configuration: the file and the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ControlConfigError {
    /// The file could not be read.
    #[error("{file}: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    /// A field is missing, unknown or out of range.
    #[error("{file}: {error}")]
    Invalid { file: String, error: FieldError },
}

impl ControlConfig {
    /// Reads and validates `file`.
    pub fn load(file: &Path) -> Result<Self, ControlConfigError> {
        let name = file.display().to_string();
        let text = std::fs::read_to_string(file).map_err(|source| ControlConfigError::Read {
            file: name.clone(),
            source,
        })?;
        Self::parse(&text, &name)
    }

    /// Parses and validates YAML `text`; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Self, ControlConfigError> {
        let invalid = |error| ControlConfigError::Invalid {
            file: file.to_owned(),
            error,
        };
        let config: ControlConfig = meshless_model::yaml::from_str(text).map_err(invalid)?;
        config.validate().map_err(invalid)?;
        Ok(config)
    }

    /// Checks what the types alone cannot: ranges, the token when exposed,
    /// each service's autoscaling.
    pub fn validate(&self) -> Result<(), FieldError> {
        if !(1..=MAX_MAX_PER_SLICE).contains(&self.max_endpoints_per_slice) {
            return Err(FieldError::new(
                "max_endpoints_per_slice",
                format!("must be 1..={MAX_MAX_PER_SLICE}"),
            ));
        }
        if self.history < crate::distributor::MIN_HISTORY {
            return Err(FieldError::new(
                "history",
                format!(
                    "must be at least {} (the shared delta log's smallest size)",
                    crate::distributor::MIN_HISTORY
                ),
            ));
        }
        if !(1..=1024).contains(&self.stream_batch) {
            return Err(FieldError::new("stream_batch", "must be 1..=1024"));
        }
        if self.stream_interval > Duration::from_secs(1) {
            return Err(FieldError::new("stream_interval", "must be at most 1s"));
        }
        if self.batch_period > MAX_BATCH_PERIOD {
            // Writes are acknowledged at once but reach proxies only at
            // the period's end: hours would be "never".
            return Err(FieldError::new(
                "batch_period",
                format!("must be at most {}s", MAX_BATCH_PERIOD.as_secs()),
            ));
        }
        if self.max_body_bytes < MIN_MAX_BODY_BYTES {
            return Err(FieldError::new(
                "max_body_bytes",
                format!(
                    "must be at least {MIN_MAX_BODY_BYTES} (smaller refuses every write with 413)"
                ),
            ));
        }
        if self
            .data_dir
            .as_ref()
            .is_some_and(|d| d.as_os_str().is_empty())
        {
            return Err(FieldError::new(
                "data_dir",
                "must not be empty (omit it to keep the registry in memory only)",
            ));
        }
        if self.api_address == self.grpc_address && self.api_address.port() != 0 {
            return Err(FieldError::new(
                "grpc_address",
                format!("must differ from api_address (both {})", self.api_address),
            ));
        }
        let exposed = !self.api_address.ip().is_loopback() || !self.grpc_address.ip().is_loopback();
        if exposed && self.token_file.is_none() {
            return Err(FieldError::new(
                "token_file",
                "required when api_address or grpc_address is not a loopback address",
            ));
        }
        let mut keys = std::collections::BTreeMap::new();
        for (i, s) in self.services.iter().enumerate() {
            let at = format!("services[{i}]");
            s.validate_seed().at(&at)?;
            if let Some(first) = keys.insert(s.spec().key(), i) {
                return Err(FieldError::new(
                    at,
                    format!(
                        "{}/{} is also services[{first}]: a service is declared once",
                        s.namespace, s.name
                    ),
                ));
            }
            if let Some(a) = &s.autoscaling {
                a.validate().at(format!("services[{i}].autoscaling"))?;
                if matches!(a.scaler, ScalerConfig::Kubernetes(_)) && self.kubernetes.is_none() {
                    return Err(FieldError::new(
                        format!("services[{i}].autoscaling.scaler.kubernetes"),
                        "needs the top-level `kubernetes:` section (the cluster to talk to)",
                    ));
                }
            }
        }
        if let Some(k) = &self.kubernetes {
            k.validate().at("kubernetes")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCALED: &str = "services:\n  - namespace: demo\n    name: lazy\n    autoscaling:\n      min_instances: 0\n      max_instances: 3\n      stable_window: 3s\n      panic_window: 1s\n      tick: 100ms\n      scaler: { webhook: { url: \"http://127.0.0.1:1/scale\" } }\n";

    #[test]
    fn autoscaling_keeps_its_flat_yaml_and_nests_the_autoscaler() {
        let c = ControlConfig::parse(SCALED, "t").expect("valid");
        let a = c.services[0].autoscaling.as_ref().expect("autoscaling");
        assert_eq!(a.autoscale.max_instances, 3);
        assert_eq!(a.autoscale.panic_window, Duration::from_secs(1));
        assert_eq!(
            a.autoscale.target_concurrency, 100.0,
            "defaults fill the rest"
        );
        assert_eq!(a.tick, Duration::from_millis(100));
        assert_eq!(a.drain_period, default_drain_period());
    }

    #[test]
    fn unknown_autoscaling_keys_are_still_rejected() {
        let text = SCALED.replace("min_instances: 0", "min_instance: 0");
        let e = ControlConfig::parse(&text, "t").expect_err("typo");
        assert!(e.to_string().contains("min_instance"), "{e}");
    }

    #[test]
    fn autoscaling_is_validated_with_its_path() {
        let text = SCALED.replace("panic_window: 1s", "panic_window: 9s");
        match ControlConfig::parse(&text, "t") {
            Err(ControlConfigError::Invalid { error, .. }) => {
                assert_eq!(error.path, "services[0].autoscaling.panic_window");
            }
            other => panic!("{other:?}"),
        }
        let text = SCALED.replace("http://127", "ftp://127");
        let e = ControlConfig::parse(&text, "t").expect_err("url");
        assert!(
            e.to_string()
                .contains("services[0].autoscaling.scaler.webhook.url"),
            "{e}"
        );
    }

    #[test]
    fn process_scaler_settings_are_checked_with_their_path() {
        let process = |extra: &str| {
            SCALED.replace(
                "scaler: { webhook: { url: \"http://127.0.0.1:1/scale\" } }",
                &format!("scaler: {{ process: {{ command: [sleep, \"9\"]{extra} }} }}"),
            )
        };
        ControlConfig::parse(&process(""), "t").expect("valid");
        for (field, extra) in [
            ("probe_interval", ", probe_interval: 0s"),
            ("start_timeout", ", start_timeout: 0s"),
            ("port_env", ", port_env: \"\""),
            ("command", ""),
        ] {
            let text = if field == "command" {
                process("").replace("command: [sleep, \"9\"]", "command: [\"\"]")
            } else {
                process(extra)
            };
            let e = ControlConfig::parse(&text, "t").expect_err(field);
            assert!(
                e.to_string().contains(&format!(
                    "services[0].autoscaling.scaler.process.{field}: must"
                )),
                "{field}: {e}"
            );
        }
    }

    #[test]
    fn the_kubernetes_section_is_parsed_and_checked_with_its_path() {
        let text = "kubernetes:\n  kubeconfig: /k\n  namespaces: [shop]\n  leader_election: { lease_duration: 10s }\n";
        let c = ControlConfig::parse(text, "t").expect("valid");
        let k = c.kubernetes.expect("section");
        assert_eq!(k.namespaces, ["shop"]);
        assert_eq!(k.leader_election.lease_duration, Duration::from_secs(10));
        assert_eq!(
            k.leader_election.retry_period,
            Duration::from_secs(2),
            "default"
        );
        let bad = text.replace("[shop]", "[Shop]");
        match ControlConfig::parse(&bad, "t") {
            Err(ControlConfigError::Invalid { error, .. }) => {
                assert_eq!(error.path, "kubernetes.namespaces[0]");
            }
            other => panic!("{other:?}"),
        }
        let bad = text.replace("10s", "1s");
        let e = ControlConfig::parse(&bad, "t").expect_err("retry above duration");
        assert!(
            e.to_string()
                .contains("kubernetes.leader_election.retry_period"),
            "{e}"
        );
        let typo = text.replace("namespaces", "namespace");
        assert!(ControlConfig::parse(&typo, "t").is_err(), "unknown field");
    }

    #[test]
    fn ranges_and_the_token_are_checked() {
        let e = ControlConfig::parse("max_endpoints_per_slice: 0\n", "f.yaml").expect_err("0");
        assert_eq!(
            e.to_string(),
            "f.yaml: max_endpoints_per_slice: must be 1..=1000"
        );
        let e = ControlConfig::parse("api_address: \"0.0.0.0:9400\"\n", "f").expect_err("token");
        assert!(e.to_string().contains("token_file"), "{e}");
        assert!(ControlConfig::parse("history: 0\n", "f").is_err());
        let small = ControlConfig::parse("history: 15\n", "f").expect_err("under the minimum");
        assert!(small.to_string().contains("history"), "{small}");
        assert!(ControlConfig::parse("history: 16\n", "f").is_ok());
    }

    #[test]
    fn values_that_make_the_plane_useless_are_refused_with_their_field() {
        for (text, field) in [
            ("max_body_bytes: 0\n", "max_body_bytes:"),
            ("max_body_bytes: 255\n", "max_body_bytes:"),
            ("data_dir: \"\"\n", "data_dir:"),
            (
                "api_address: 127.0.0.1:9400\ngrpc_address: 127.0.0.1:9400\n",
                "grpc_address:",
            ),
            ("batch_period: 100000h\n", "batch_period:"),
            ("batch_period: 11s\n", "batch_period:"),
        ] {
            let e = ControlConfig::parse(text, "f.yaml").expect_err(text);
            assert!(
                e.to_string().starts_with(&format!("f.yaml: {field}")),
                "{text}: {e}"
            );
        }
        for text in [
            "max_body_bytes: 256\n",
            "batch_period: 10s\n",
            "data_dir: /var/lib/meshless\n",
            "api_address: 127.0.0.1:0\ngrpc_address: 127.0.0.1:0\n",
        ] {
            assert!(ControlConfig::parse(text, "f").is_ok(), "{text}");
        }
        assert_eq!(
            ControlConfig::parse("{}", "f").expect("empty"),
            ControlConfig::default()
        );
    }
}
