//! Active health-check state: rise/fall thresholds, as HAProxy does them.

use std::time::Duration;

/// Thresholds for active health checks (HAProxy defaults `rise 2`, `fall 3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    /// Consecutive passed checks that make an unhealthy endpoint healthy. >= 1.
    pub rise: u32,
    /// Consecutive failed checks that make a healthy endpoint unhealthy. >= 1.
    pub fall: u32,
    /// Whether an endpoint new to the cluster starts healthy (true) or must
    /// first pass `rise` checks (false).
    pub initially_healthy: bool,
    /// Whether active health checks run at all. Without them nothing can
    /// clear an unhealthy mark, so publishing a snapshot with `false`
    /// clears every mark and streak, and check results are ignored (a
    /// check of the removed configuration still under way). On by
    /// default; a proxy cluster without `health_check` sets it off.
    pub active: bool,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            rise: 2,
            fall: 3,
            initially_healthy: true,
            active: true,
        }
    }
}

/// Passive outlier detection, with Envoy's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutlierConfig {
    /// Consecutive 5xx (including gateway errors) that eject; 0 disables.
    /// Envoy `consecutive_5xx` (enforced: `enforcing_consecutive_5xx` 100%).
    pub consecutive_5xx: u32,
    /// Consecutive 502/503/504, connect errors, resets or timeouts that
    /// eject; 0 disables, the default: Envoy tracks
    /// `consecutive_gateway_failure` (5) but does not enforce it
    /// (`enforcing_consecutive_gateway_failure` 0%). Gateway errors still
    /// count towards `consecutive_5xx`.
    pub consecutive_gateway_errors: u32,
    /// How often [`crate::Cluster::tick`] is expected to run (Envoy `interval`).
    pub interval: Duration,
    /// Ejection lasts `base_ejection_time x times ejected`, capped by `max_ejection_time`.
    pub base_ejection_time: Duration,
    /// Upper bound of one ejection; a value below `base_ejection_time`
    /// acts as `base_ejection_time` (Envoy).
    pub max_ejection_time: Duration,
    /// At most this share of the cluster (0..=100) is ejected at once; at
    /// least one endpoint may be ejected in a cluster of two or more, and the
    /// last available endpoint never is.
    pub max_ejection_percent: u8,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        Self {
            consecutive_5xx: 5,
            consecutive_gateway_errors: 0,
            interval: Duration::from_secs(10),
            base_ejection_time: Duration::from_secs(30),
            max_ejection_time: Duration::from_secs(300),
            max_ejection_percent: 10,
        }
    }
}

impl OutlierConfig {
    /// Outlier detection switched off.
    pub fn disabled() -> Self {
        Self {
            consecutive_5xx: 0,
            consecutive_gateway_errors: 0,
            ..Self::default()
        }
    }

    /// The ejection length after the `times`-th ejection, in nanoseconds:
    /// `base x times`, capped at the larger of `max_ejection_time` and
    /// `base_ejection_time` (Envoy's rule: a cap below the base does not
    /// shorten the base).
    pub(crate) fn ejection_nanos(&self, times: u32) -> u64 {
        let base = u64::try_from(self.base_ejection_time.as_nanos()).unwrap_or(u64::MAX);
        let max = u64::try_from(self.max_ejection_time.as_nanos()).unwrap_or(u64::MAX);
        base.saturating_mul(u64::from(times.max(1)))
            .min(max.max(base))
    }
}
