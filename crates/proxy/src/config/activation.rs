//! `clusters[].activation:` and `clusters[].fallback:` what a request
//! gets when no endpoint is ready.

use std::time::Duration;

use meshless_model::FieldError;
use meshless_model::serde_duration as duration;
use serde::{Deserialize, Serialize};

/// `activation:` block: requests for a `service:` cluster with no ready
/// endpoint are held while the control plane starts an instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Activation {
    /// Requests held at once per cluster; past it, 503 with `Retry-After`.
    #[serde(default = "default_max_queued")]
    pub max_queued: u32,
    /// A held request waits at most this long, then 504.
    #[serde(default = "default_queue_timeout", with = "duration")]
    pub queue_timeout: Duration,
    /// The longest wait between probes (TCP connect) of a starting
    /// instance's address; the waits start at 200 µs and double up to it.
    #[serde(default = "default_probe_interval", with = "duration")]
    pub probe_interval: Duration,
    /// Hard limit of requests in flight per instance; 0 = none.
    #[serde(default)]
    pub container_concurrency: u32,
    /// While requests are held for the cluster, at most this many requests
    /// in flight per instance (when `container_concurrency` is 0): held
    /// requests are released to a fresh instance this many at a time, so
    /// its accept queue (its listen backlog) never takes the whole burst
    /// at once; 0 = no limit.
    #[serde(default = "default_release_concurrency")]
    pub release_concurrency: u32,
}

impl Default for Activation {
    fn default() -> Self {
        Self {
            max_queued: default_max_queued(),
            queue_timeout: default_queue_timeout(),
            probe_interval: default_probe_interval(),
            container_concurrency: 0,
            release_concurrency: default_release_concurrency(),
        }
    }
}

impl Activation {
    /// Checks the values that would hold nothing, wait for nothing or
    /// probe without a pause; the error names the field.
    pub(super) fn validate(&self) -> Result<(), FieldError> {
        if self.max_queued == 0 {
            return Err(FieldError::new(
                "max_queued",
                "must be at least 1 (without `activation:` nothing is held)",
            ));
        }
        if self.queue_timeout.is_zero() {
            return Err(FieldError::new("queue_timeout", "must be above 0s"));
        }
        meshless_model::probe_backoff::check_probe_interval(self.probe_interval)?;
        Ok(())
    }
}

fn default_max_queued() -> u32 {
    10_000
}
fn default_queue_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_probe_interval() -> Duration {
    Duration::from_millis(5)
}
fn default_release_concurrency() -> u32 {
    100
}

/// `fallback:` block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fallback {
    /// Status code.
    #[serde(default = "default_fallback_status")]
    pub status: u16,
    /// Body.
    #[serde(default)]
    pub body: String,
    /// Content-Type of the body.
    #[serde(default = "default_content_type")]
    pub content_type: String,
}

fn default_fallback_status() -> u16 {
    503
}
fn default_content_type() -> String {
    "text/plain; charset=utf-8".into()
}
