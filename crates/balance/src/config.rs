//! Balancer and cluster settings, with validation that names the field.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::health::{HealthConfig, OutlierConfig};
use crate::locality::{LocalityConfig, LocalityMode};
use crate::policy::{DEFAULT_CHOICES, DEFAULT_TABLE_SIZE, MAX_TABLE_SIZE, is_prime};

/// Default bounded-load factor `c` (the talk's 1.25; Envoy and HAProxy have
/// no default: the feature is off until a factor is set).
pub const DEFAULT_LOAD_FACTOR: f64 = 1.25;
/// Default panic threshold, in percent of endpoints available (Envoy's
/// `healthy_panic_threshold`).
pub const DEFAULT_PANIC_THRESHOLD: u8 = 50;

/// The load-balancing algorithm. Deserializes from its config name
/// (`round_robin`, `random`, `least_request`, `p2c`, `ring_hash`, `maglev`,
/// `bounded_load`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Smooth weighted round robin (nginx).
    RoundRobin,
    /// Weighted random.
    Random,
    /// Least requests in flight, full scan.
    LeastRequest,
    /// Power of k choices (`choices`, default 2).
    #[serde(rename = "p2c", alias = "power_of_choices")]
    PowerOfChoices,
    /// Ketama ring hash.
    RingHash,
    /// Maglev table.
    Maglev,
    /// Consistent hashing with bounded loads, over `over`.
    BoundedLoad,
}

impl PolicyKind {
    /// Every policy, in documentation order.
    pub const ALL: [PolicyKind; 7] = [
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LeastRequest,
        PolicyKind::PowerOfChoices,
        PolicyKind::RingHash,
        PolicyKind::Maglev,
        PolicyKind::BoundedLoad,
    ];

    /// The name used in config files and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastRequest => "least_request",
            PolicyKind::PowerOfChoices => "p2c",
            PolicyKind::RingHash => "ring_hash",
            PolicyKind::Maglev => "maglev",
            PolicyKind::BoundedLoad => "bounded_load",
        }
    }

    /// Whether the policy maps keys to endpoints.
    pub fn is_hash(self) -> bool {
        matches!(
            self,
            PolicyKind::RingHash | PolicyKind::Maglev | PolicyKind::BoundedLoad
        )
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| ConfigError::UnknownPolicy(s.to_owned()))
    }
}

/// The consistent hash under bounded load (`maglev` or `ring_hash`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HashKind {
    /// Ketama ring.
    RingHash,
    /// Maglev table (default).
    #[default]
    Maglev,
}

impl HashKind {
    /// The name used in config files.
    pub fn name(self) -> &'static str {
        match self {
            HashKind::RingHash => "ring_hash",
            HashKind::Maglev => "maglev",
        }
    }
}

impl FromStr for HashKind {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "maglev" => Ok(HashKind::Maglev),
            "ring_hash" => Ok(HashKind::RingHash),
            other => Err(ConfigError::Field {
                field: "balancer.over",
                reason: format!("expected maglev or ring_hash, got {other:?}"),
            }),
        }
    }
}

/// How endpoints are chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BalancerConfig {
    /// The algorithm.
    pub policy: PolicyKind,
    /// Draws per pick for `p2c` (2..=16).
    pub choices: usize,
    /// Ring points for `ring_hash`; `None` = 160 per endpoint, clamped to 1,024..=1,048,576.
    pub ring_size: Option<usize>,
    /// The smallest Maglev table; prime, at most 5,000,011 (Envoy's limit).
    /// The table grows with the endpoints ([`crate::policy::table_size_for`]).
    pub table_size: usize,
    /// The largest the Maglev table grows to; prime, at least
    /// `table_size`, at most 5,000,011 (the default).
    pub max_table_size: usize,
    /// Bounded load factor `c` (>= 1.0; Envoy's 150 = 1.5). Used as an
    /// integer percent, rounded: 1.255 acts as 1.26.
    pub load_factor: f64,
    /// The hash under `bounded_load`.
    pub over: HashKind,
}

impl Default for BalancerConfig {
    fn default() -> Self {
        Self {
            policy: PolicyKind::RoundRobin,
            choices: DEFAULT_CHOICES,
            ring_size: None,
            table_size: DEFAULT_TABLE_SIZE,
            max_table_size: MAX_TABLE_SIZE,
            load_factor: DEFAULT_LOAD_FACTOR,
            over: HashKind::Maglev,
        }
    }
}

impl BalancerConfig {
    /// Defaults with `policy`.
    pub fn new(policy: PolicyKind) -> Self {
        Self {
            policy,
            ..Self::default()
        }
    }
}

/// Everything a [`crate::Cluster`] is built from besides its endpoints.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClusterConfig {
    /// The algorithm and its parameters.
    pub balancer: BalancerConfig,
    /// Prefer the caller's node, then zone; `None` = off.
    pub locality: Option<LocalityConfig>,
    /// Passive outlier ejection.
    pub outlier: OutlierConfig,
    /// Active health-check thresholds.
    pub health: HealthConfig,
    /// Panic mode (Envoy's `healthy_panic_threshold`): while fewer than this
    /// percent of the endpoints are available (healthy and not ejected),
    /// picks spread over *all* endpoints, so the last few live ones are not
    /// crushed by the whole load; locality is not applied meanwhile.
    /// 0..=100; default 50; 0 disables it (with none available a pick then
    /// returns nothing).
    pub panic_threshold: u8,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            balancer: BalancerConfig::default(),
            locality: None,
            outlier: OutlierConfig::default(),
            health: HealthConfig::default(),
            panic_threshold: DEFAULT_PANIC_THRESHOLD,
        }
    }
}

impl ClusterConfig {
    /// Defaults with `policy`.
    pub fn new(policy: PolicyKind) -> Self {
        Self {
            balancer: BalancerConfig::new(policy),
            ..Self::default()
        }
    }

    /// Checks every setting on its own, without endpoints and without
    /// building a balancer: what a config file can be checked against.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let b = &self.balancer;
        if !(2..=crate::policy::p2c::MAX_CHOICES).contains(&b.choices) {
            return Err(field(
                "balancer.choices",
                format!("must be 2..=16, got {}", b.choices),
            ));
        }
        if !(b.load_factor >= 1.0 && b.load_factor <= 100.0) {
            return Err(field(
                "balancer.load_factor",
                format!("must be a number in 1.0..=100.0, got {}", b.load_factor),
            ));
        }
        if self.uses_maglev() {
            if !is_prime(b.table_size) {
                return Err(field(
                    "balancer.table_size",
                    format!("must be prime, got {}", b.table_size),
                ));
            }
            if b.table_size > MAX_TABLE_SIZE {
                return Err(field(
                    "balancer.table_size",
                    format!("must be at most {MAX_TABLE_SIZE}, got {}", b.table_size),
                ));
            }
            if !is_prime(b.max_table_size)
                || b.max_table_size < b.table_size
                || b.max_table_size > MAX_TABLE_SIZE
            {
                return Err(field(
                    "balancer.max_table_size",
                    format!(
                        "must be a prime in table_size..={MAX_TABLE_SIZE}, got {}",
                        b.max_table_size
                    ),
                ));
            }
        }
        if let Some(size) = b.ring_size
            && !(1..=crate::policy::MAX_RING_SIZE).contains(&size)
        {
            return Err(field(
                "balancer.ring_size",
                format!("must be 1..=8388608, got {size}"),
            ));
        }
        if let Some(l) = self.locality {
            if !(0.0..=1.0).contains(&l.min_healthy_share) {
                return Err(field(
                    "locality.min_healthy_share",
                    format!("must be 0.0..=1.0, got {}", l.min_healthy_share),
                ));
            }
            if l.mode == LocalityMode::Proportional && l.min_cluster_size == 0 {
                return Err(field(
                    "locality.min_cluster_size",
                    "must be at least 1".to_owned(),
                ));
            }
        }
        if self.panic_threshold > 100 {
            return Err(field(
                "panic_threshold",
                format!("must be 0..=100 (percent), got {}", self.panic_threshold),
            ));
        }
        if self.outlier.max_ejection_percent > 100 {
            return Err(field(
                "outlier_detection.max_ejection_percent",
                format!("must be 0..=100, got {}", self.outlier.max_ejection_percent),
            ));
        }
        if self.health.rise == 0 || self.health.fall == 0 {
            return Err(field(
                "health_check.rise/fall",
                "thresholds must be at least 1".to_owned(),
            ));
        }
        Ok(())
    }

    /// [`ClusterConfig::validate`], plus the checks that depend on how many
    /// endpoints the cluster has.
    pub fn validate_for(&self, endpoints: usize) -> Result<(), ConfigError> {
        self.validate()?;
        if self.uses_maglev() && self.maglev_table_size(endpoints) < endpoints {
            return Err(field(
                "balancer.table_size",
                format!(
                    "the Maglev table (at most {MAX_TABLE_SIZE}) must be at least the number of endpoints ({endpoints})"
                ),
            ));
        }
        Ok(())
    }

    /// Whether the table is under Envoy's guidance of 100 entries per
    /// endpoint for `endpoints` (then ownership spreads beyond ~1%).
    /// (The table grows with the endpoints, so only above the cap.)
    pub fn maglev_table_small_for(&self, endpoints: usize) -> bool {
        self.uses_maglev()
            && self.maglev_table_size(endpoints)
                < endpoints.saturating_mul(MAGLEV_ENTRIES_PER_ENDPOINT)
    }

    /// The Maglev table size for `endpoints` endpoints: `table_size` grown
    /// up to `max_table_size` by [`crate::policy::table_size_for`].
    pub fn maglev_table_size(&self, endpoints: usize) -> usize {
        let b = &self.balancer;
        crate::policy::table_size_for(b.table_size, b.max_table_size, endpoints)
    }

    /// Whether the cluster builds a Maglev table (`maglev`, or
    /// `bounded_load` over Maglev).
    pub fn uses_maglev(&self) -> bool {
        let b = &self.balancer;
        b.policy == PolicyKind::Maglev
            || (b.policy == PolicyKind::BoundedLoad && b.over == HashKind::Maglev)
    }
}

/// Envoy's guidance for a Maglev table: at least 100 entries per endpoint.
pub const MAGLEV_ENTRIES_PER_ENDPOINT: usize = crate::policy::ENTRIES_PER_ENDPOINT;

fn field(field: &'static str, reason: String) -> ConfigError {
    ConfigError::Field { field, reason }
}

/// A rejected setting or endpoint list.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// A field's value is out of range.
    #[error("{field}: {reason}")]
    Field {
        /// Dotted path of the field.
        field: &'static str,
        /// What is wrong and what is allowed.
        reason: String,
    },
    /// Not a policy name.
    #[error(
        "policy: unknown policy {0:?} (expected one of round_robin, random, least_request, \
         p2c, ring_hash, maglev, bounded_load)"
    )]
    UnknownPolicy(String),
    /// An endpoint failed validation.
    #[error(transparent)]
    Endpoint(#[from] meshless_model::EndpointError),
    /// Two endpoints share an identity.
    #[error("endpoints: duplicate endpoint id {0:?}")]
    DuplicateEndpoint(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_knows_the_same_policy_names() {
        let names: Vec<&str> = PolicyKind::ALL.iter().map(|p| p.name()).collect();
        assert_eq!(names, meshless_model::service_settings::POLICY_NAMES);
    }

    #[test]
    fn a_maglev_table_is_small_under_100_entries_per_endpoint() {
        let maglev = ClusterConfig::new(PolicyKind::Maglev);
        // The table grows to 100 entries per endpoint up to its cap,
        // 5,000,011, which covers 50,000 endpoints.
        assert_eq!(maglev.maglev_table_size(655), 65_537);
        assert!(maglev.maglev_table_size(656) >= 65_600);
        assert!(!maglev.maglev_table_small_for(20_000));
        assert!(!maglev.maglev_table_small_for(50_000));
        assert!(maglev.maglev_table_small_for(50_001));
        let mut bounded = ClusterConfig::new(PolicyKind::BoundedLoad);
        assert!(
            bounded.maglev_table_small_for(60_000),
            "bounded load over Maglev"
        );
        bounded.balancer.over = HashKind::RingHash;
        assert!(!bounded.maglev_table_small_for(60_000), "no Maglev table");
        assert!(!ClusterConfig::new(PolicyKind::RoundRobin).maglev_table_small_for(60_000));
        // A cap keeps the table small (and the warning on).
        let mut capped = ClusterConfig::new(PolicyKind::Maglev);
        capped.balancer.max_table_size = 65_537;
        assert_eq!(capped.maglev_table_size(20_000), 65_537);
        assert!(capped.maglev_table_small_for(656));
        capped.balancer.max_table_size = 65_536;
        assert!(capped.validate().is_err(), "not prime");
    }
}
