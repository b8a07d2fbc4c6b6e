//! The autoscaler, with the semantics of Knative's KPA: a stable window and
//! a panic window over observed concurrency, a target per instance, rate
//! limits, and scale to zero after a grace period. Pure: time is passed in,
//! so its behaviour is tested on synthetic load traces.
//!
//! [`crate::scaling`] feeds it the proxies' load reports and applies its decisions.

use std::collections::VecDeque;
use std::time::Duration;

use meshless_model::FieldError;
use serde::{Deserialize, Serialize};

/// Autoscaling settings of one service (Knative KPA defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AutoscaleConfig {
    /// Fewest instances; 0 allows scale to zero.
    #[serde(default)]
    pub min_instances: u32,
    /// Most instances.
    #[serde(default = "default_max_instances")]
    pub max_instances: u32,
    /// Concurrent requests one instance should carry.
    #[serde(default = "default_target_concurrency")]
    pub target_concurrency: f64,
    /// Share of the target aimed at (Knative: 70%), leaving headroom.
    #[serde(default = "default_target_utilization")]
    pub target_utilization: f64,
    /// Averaging window of the stable mode.
    #[serde(
        default = "default_stable_window",
        with = "meshless_model::serde_duration"
    )]
    pub stable_window: Duration,
    /// Averaging window of the panic mode.
    #[serde(
        default = "default_panic_window",
        with = "meshless_model::serde_duration"
    )]
    pub panic_window: Duration,
    /// Panic when the panic window would need this many times the ready instances.
    #[serde(default = "default_panic_threshold")]
    pub panic_threshold: f64,
    /// At most this many times the ready instances per decision.
    #[serde(default = "default_max_scale_up_rate")]
    pub max_scale_up_rate: f64,
    /// At least the ready instances divided by this per decision.
    #[serde(default = "default_max_scale_down_rate")]
    pub max_scale_down_rate: f64,
    /// With no request for this long, scale to `min_instances` (maybe zero).
    #[serde(
        default = "default_scale_to_zero_after",
        with = "meshless_model::serde_duration"
    )]
    pub scale_to_zero_after: Duration,
}

fn default_max_instances() -> u32 {
    10
}
fn default_target_concurrency() -> f64 {
    100.0
}
fn default_target_utilization() -> f64 {
    0.7
}
fn default_stable_window() -> Duration {
    Duration::from_secs(60)
}
fn default_panic_window() -> Duration {
    Duration::from_secs(6)
}
fn default_panic_threshold() -> f64 {
    2.0
}
fn default_max_scale_up_rate() -> f64 {
    1000.0
}
fn default_max_scale_down_rate() -> f64 {
    2.0
}
fn default_scale_to_zero_after() -> Duration {
    Duration::from_secs(30)
}

impl Default for AutoscaleConfig {
    fn default() -> Self {
        Self {
            min_instances: 0,
            max_instances: default_max_instances(),
            target_concurrency: default_target_concurrency(),
            target_utilization: default_target_utilization(),
            stable_window: default_stable_window(),
            panic_window: default_panic_window(),
            panic_threshold: default_panic_threshold(),
            max_scale_up_rate: default_max_scale_up_rate(),
            max_scale_down_rate: default_max_scale_down_rate(),
            scale_to_zero_after: default_scale_to_zero_after(),
        }
    }
}

impl AutoscaleConfig {
    /// Checks ranges; the error names the field at fault.
    pub fn validate(&self) -> Result<(), FieldError> {
        let err = |f: &str, r: &str| Err(FieldError::new(f, r));
        if self.max_instances == 0 || self.max_instances < self.min_instances {
            return err(
                "max_instances",
                "must be at least 1 and at least min_instances",
            );
        }
        if !(self.target_concurrency > 0.0 && self.target_concurrency.is_finite()) {
            return err("target_concurrency", "must be a number above 0");
        }
        if !(self.target_utilization > 0.0 && self.target_utilization <= 1.0) {
            return err("target_utilization", "must be in (0, 1]");
        }
        if self.panic_window.is_zero() || self.panic_window > self.stable_window {
            return err(
                "panic_window",
                "must be above zero and at most stable_window",
            );
        }
        if !(self.panic_threshold >= 1.0 && self.panic_threshold.is_finite()) {
            return err("panic_threshold", "must be at least 1.0");
        }
        let rate_ok = |r: f64| r > 1.0 && r.is_finite();
        if !rate_ok(self.max_scale_up_rate) {
            return err("max_scale_up_rate", "must be above 1.0");
        }
        if !rate_ok(self.max_scale_down_rate) {
            return err("max_scale_down_rate", "must be above 1.0");
        }
        Ok(())
    }

    /// Concurrency one instance is sized for.
    fn per_instance(&self) -> f64 {
        self.target_concurrency * self.target_utilization
    }
}

/// One decision and why.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// Instances wanted.
    pub desired: u32,
    /// Average concurrency over the stable window.
    pub stable_concurrency: f64,
    /// Average concurrency over the panic window.
    pub panic_concurrency: f64,
    /// In panic mode (no scale-down).
    pub panicking: bool,
    /// Fewer samples than a stable window (and the scale-to-zero grace):
    /// never below the ready instances.
    pub warming: bool,
}

/// The state of one service's autoscaler.
///
/// Invariants (tested): the result is within `min..=max`; never below the
/// current instances while panicking; never above `ready x
/// max_scale_up_rate` nor below `ready / max_scale_down_rate` (rounded down);
/// zero only after `scale_to_zero_after` without any request; never below
/// `ready` before a full `stable_window` and `scale_to_zero_after` of
/// samples since the first one (at start, or after
/// [`Autoscaler::restart_observation`]): no samples is unknown, not idle.
#[derive(Debug, Clone)]
pub struct Autoscaler {
    config: AutoscaleConfig,
    /// (time, concurrency) samples, oldest first, within the stable window.
    samples: VecDeque<(Duration, f64)>,
    /// Panic mode lasts until this time.
    panic_until: Option<Duration>,
    /// Last time any concurrency was observed.
    last_active: Option<Duration>,
    /// Time of the first sample since start or the last
    /// [`Autoscaler::restart_observation`].
    observed_since: Option<Duration>,
    /// Instances decided last time (the floor while panicking).
    last_desired: u32,
}

impl Autoscaler {
    /// A new autoscaler; `config` must be valid.
    pub fn new(config: AutoscaleConfig) -> Self {
        Self {
            last_desired: config.min_instances,
            config,
            samples: VecDeque::new(),
            panic_until: None,
            last_active: None,
            observed_since: None,
        }
    }

    /// Forgets every sample: what follows is observed afresh (a replica
    /// that just became the one deciding has seen only part of the load).
    pub fn restart_observation(&mut self) {
        self.samples.clear();
        self.panic_until = None;
        self.last_active = None;
        self.observed_since = None;
    }

    /// Whether fewer than a full stable window and scale-to-zero grace of
    /// samples were observed by `now`: no scale-down is decided yet.
    pub fn warming(&self, now: Duration) -> bool {
        let need = self
            .config
            .stable_window
            .max(self.config.scale_to_zero_after);
        self.observed_since
            .is_none_or(|since| now.saturating_sub(since) < need)
    }

    /// Records the concurrency (requests in flight plus queued, summed over
    /// proxies) observed at `now`. Samples must come in time order.
    pub fn record(&mut self, now: Duration, concurrency: f64) {
        let concurrency = concurrency.max(0.0);
        self.observed_since.get_or_insert(now);
        self.samples.push_back((now, concurrency));
        if concurrency > 0.0 {
            self.last_active = Some(now);
        }
        let horizon = now.saturating_sub(self.config.stable_window);
        while self.samples.front().is_some_and(|(t, _)| *t < horizon) {
            self.samples.pop_front();
        }
    }

    fn average(&self, now: Duration, window: Duration) -> f64 {
        let from = now.saturating_sub(window);
        let (sum, n) = self
            .samples
            .iter()
            .filter(|(t, _)| *t >= from)
            .fold((0.0, 0u32), |(s, n), (_, c)| (s + c, n + 1));
        if n == 0 { 0.0 } else { sum / f64::from(n) }
    }

    /// The instance count for now, given `ready` instances.
    pub fn decide(&mut self, now: Duration, ready: u32) -> Decision {
        let cfg = &self.config;
        let per = cfg.per_instance();
        let stable = self.average(now, cfg.stable_window);
        let panic = self.average(now, cfg.panic_window);
        let want_stable = (stable / per).ceil() as u32;
        let want_panic = (panic / per).ceil() as u32;
        // Panic when the short window needs threshold x what is ready.
        let triggered = if ready == 0 {
            want_panic > 0
        } else {
            f64::from(want_panic) / f64::from(ready) >= cfg.panic_threshold
        };
        if triggered {
            self.panic_until = Some(now + cfg.stable_window);
        }
        let panicking = self.panic_until.is_some_and(|t| now < t);
        if !panicking {
            self.panic_until = None;
        }
        let mut desired = if panicking {
            want_panic.max(want_stable).max(self.last_desired)
        } else {
            want_stable
        };
        // Rate limits relative to what is ready (at least one to start from zero).
        let base = f64::from(ready.max(1));
        let up_limit = (base * cfg.max_scale_up_rate).ceil() as u32;
        let down_limit = (f64::from(ready) / cfg.max_scale_down_rate).floor() as u32;
        desired = desired.min(up_limit).max(down_limit);
        let warming = self.warming(now);
        if warming {
            // Too few samples to tell idle from unobserved: no scale-down.
            desired = desired.max(ready);
        }
        // Scale to zero only after the grace period without any request
        // (observed: counted from the first sample when none was active
        // and instances run; a service at zero that never saw a request
        // stays at zero).
        let quiet_since = self
            .last_active
            .or(self.observed_since.filter(|_| ready > 0));
        let idle_long_enough =
            quiet_since.is_none_or(|t| now.saturating_sub(t) >= cfg.scale_to_zero_after);
        if desired == 0 && !idle_long_enough {
            desired = 1;
        }
        desired = desired.clamp(cfg.min_instances, cfg.max_instances);
        self.last_desired = desired;
        Decision {
            desired,
            stable_concurrency: stable,
            panic_concurrency: panic,
            panicking,
            warming,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn config() -> AutoscaleConfig {
        AutoscaleConfig {
            min_instances: 0,
            max_instances: 50,
            target_concurrency: 10.0,
            target_utilization: 1.0,
            ..AutoscaleConfig::default()
        }
    }

    /// Feeds `load` once a second from `from` to `to` and returns the last decision.
    fn run(a: &mut Autoscaler, from: u64, to: u64, load: f64, ready: &mut u32) -> Decision {
        let mut d = a.decide(secs(from), *ready);
        for t in from..to {
            a.record(secs(t), load);
            d = a.decide(secs(t), *ready);
            *ready = d.desired;
        }
        d
    }

    #[test]
    fn steady_load_needs_load_over_target() {
        let mut a = Autoscaler::new(config());
        let mut ready = 1;
        let d = run(&mut a, 0, 120, 45.0, &mut ready);
        assert_eq!(d.desired, 5, "ceil(45 / 10)");
        assert!(!d.panicking);
    }

    #[test]
    fn utilization_leaves_headroom() {
        let mut cfg = config();
        cfg.target_utilization = 0.7;
        let mut a = Autoscaler::new(cfg);
        let mut ready = 1;
        let d = run(&mut a, 0, 120, 70.0, &mut ready);
        assert_eq!(d.desired, 10, "ceil(70 / 7)");
    }

    #[test]
    fn a_burst_panics_and_panic_never_scales_down_until_a_stable_window_passes() {
        let mut a = Autoscaler::new(config());
        let mut ready = 1;
        run(&mut a, 0, 60, 10.0, &mut ready);
        assert_eq!(ready, 1);
        // Burst to 200: panic at the first second, and within one panic
        // window the whole burst is provisioned.
        let d = run(&mut a, 60, 61, 200.0, &mut ready);
        assert!(d.panicking && d.desired > 1, "{d:?}");
        let d = run(&mut a, 61, 67, 200.0, &mut ready);
        assert!(d.desired >= 20, "{d:?}");
        let peak = d.desired;
        // Load drops: still panicking, no scale-down for a stable window.
        let d = run(&mut a, 67, 100, 5.0, &mut ready);
        assert!(d.panicking && d.desired >= peak, "{d:?}");
        // One stable window after the last trigger: panic ends, scale down (rate-limited).
        let d = run(&mut a, 100, 130, 5.0, &mut ready);
        assert!(!d.panicking, "{d:?}");
        assert!(d.desired < peak);
    }

    #[test]
    fn scale_down_is_rate_limited() {
        let mut a = Autoscaler::new(config());
        let mut ready = 40;
        a.record(secs(0), 0.0);
        let d = a.decide(secs(0), ready);
        assert_eq!(d.desired, 40, "no samples yet: no scale-down");
        a.record(secs(60), 0.0);
        let d = a.decide(secs(60), ready);
        assert_eq!(d.desired, 20, "at most halve per decision");
        ready = d.desired;
        let d = a.decide(secs(61), ready);
        assert_eq!(d.desired, 10);
    }

    #[test]
    fn scales_to_zero_only_after_the_grace_period() {
        let mut a = Autoscaler::new(config());
        let mut ready = 1;
        run(&mut a, 0, 10, 3.0, &mut ready);
        assert_eq!(ready, 1);
        let d = run(&mut a, 10, 39, 0.0, &mut ready);
        assert_eq!(d.desired, 1, "29 s idle < 30 s");
        let d = run(&mut a, 39, 75, 0.0, &mut ready);
        assert_eq!(d.desired, 0, "{d:?}");
        // A request at zero: one instance at once (panic from zero).
        a.record(secs(75), 1.0);
        let d = a.decide(secs(75), 0);
        assert_eq!(d.desired, 1);
    }

    proptest::proptest! {
        /// From the first sample (at start, or after a restart of the
        /// observation) until a full stable window and scale-to-zero grace
        /// have passed: never below the ready instances (within max), and,
        /// with instances ready, never zero before the grace, whatever the
        /// load.
        #[test]
        fn no_scale_down_before_a_full_window_of_samples(
            steps in proptest::collection::vec(
                (0u64..6, 0.0f64..40.0, 0u32..60, proptest::bool::weighted(0.05)),
                1..120,
            ),
        ) {
            let cfg = config();
            let need = cfg.stable_window.max(cfg.scale_to_zero_after);
            let mut a = Autoscaler::new(cfg.clone());
            let (mut t, mut first) = (secs(100), None);
            for (dt, load, ready, restart) in steps {
                if restart {
                    a.restart_observation();
                    first = None;
                }
                t += secs(dt);
                a.record(t, load);
                let since = *first.get_or_insert(t);
                let d = a.decide(t, ready);
                if t - since < need {
                    proptest::prop_assert!(d.warming);
                    proptest::prop_assert!(d.desired >= ready.min(cfg.max_instances), "{d:?} ready {ready}");
                }
                if t - since < cfg.scale_to_zero_after && ready > 0 {
                    proptest::prop_assert!(d.desired > 0, "{d:?}");
                }
            }
        }
    }

    #[test]
    fn stays_within_min_and_max() {
        let mut cfg = config();
        cfg.min_instances = 2;
        cfg.max_instances = 5;
        let mut a = Autoscaler::new(cfg);
        let mut ready = 2;
        assert_eq!(run(&mut a, 0, 100, 0.0, &mut ready).desired, 2);
        assert_eq!(run(&mut a, 100, 200, 1000.0, &mut ready).desired, 5);
    }

    #[test]
    fn validation_names_the_field() {
        let mut cfg = config();
        cfg.panic_window = secs(120);
        assert_eq!(cfg.validate().expect_err("window").path, "panic_window");
        let mut cfg = config();
        cfg.max_instances = 0;
        assert_eq!(cfg.validate().expect_err("max").path, "max_instances");
        assert!(config().validate().is_ok());
    }
}
