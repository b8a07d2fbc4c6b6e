//! Balancer and cluster settings, with validation that names the field.

use std::fmt;
use std::str::FromStr;

use crate::health::{HealthConfig, OutlierConfig};
use crate::locality::LocalityConfig;
use crate::policy::{DEFAULT_TABLE_SIZE, is_prime};

/// The load-balancing algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// Smooth weighted round robin (nginx).
    RoundRobin,
    /// Weighted random.
    Random,
    /// Least requests in flight, full scan.
    LeastRequest,
    /// Power of k choices (`choices`, default 2).
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

/// The consistent hash under bounded load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HashKind {
    /// Ketama ring.
    RingHash,
    /// Maglev table (default).
    Maglev,
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
    /// Maglev table size; prime, at least the number of endpoints.
    pub table_size: usize,
    /// Bounded load factor `c` (>= 1.0; Envoy's 150 = 1.5).
    pub load_factor: f64,
    /// The hash under `bounded_load`.
    pub over: HashKind,
}

impl Default for BalancerConfig {
    fn default() -> Self {
        Self {
            policy: PolicyKind::RoundRobin,
            choices: 2,
            ring_size: None,
            table_size: DEFAULT_TABLE_SIZE,
            load_factor: 1.25,
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
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ClusterConfig {
    /// The algorithm and its parameters.
    pub balancer: BalancerConfig,
    /// Prefer the caller's node, then zone; `None` = off.
    pub locality: Option<LocalityConfig>,
    /// Passive outlier ejection.
    pub outlier: OutlierConfig,
    /// Active health-check thresholds.
    pub health: HealthConfig,
    /// When no endpoint is available, pick among all of them (panic mode,
    /// Envoy's default) instead of returning nothing.
    pub panic_when_all_unavailable: bool,
}

impl ClusterConfig {
    /// Defaults with `policy`, panic mode on.
    pub fn new(policy: PolicyKind) -> Self {
        Self {
            balancer: BalancerConfig::new(policy),
            panic_when_all_unavailable: true,
            ..Self::default()
        }
    }

    /// Checks every field against `endpoints` endpoints.
    pub fn validate(&self, endpoints: usize) -> Result<(), ConfigError> {
        let b = &self.balancer;
        if !(2..=crate::policy::p2c::MAX_CHOICES).contains(&b.choices) {
            return Err(ConfigError::Field {
                field: "balancer.choices",
                reason: format!("must be 2..=16, got {}", b.choices),
            });
        }
        if !(b.load_factor >= 1.0 && b.load_factor.is_finite()) {
            return Err(ConfigError::Field {
                field: "balancer.load_factor",
                reason: format!("must be a number >= 1.0, got {}", b.load_factor),
            });
        }
        let uses_maglev = b.policy == PolicyKind::Maglev
            || (b.policy == PolicyKind::BoundedLoad && b.over == HashKind::Maglev);
        if uses_maglev {
            if !is_prime(b.table_size) {
                return Err(ConfigError::Field {
                    field: "balancer.table_size",
                    reason: format!("must be prime, got {}", b.table_size),
                });
            }
            if b.table_size < endpoints {
                return Err(ConfigError::Field {
                    field: "balancer.table_size",
                    reason: format!(
                        "must be at least the number of endpoints ({endpoints}), got {} \
                         (use more than 100x the endpoints for an even spread)",
                        b.table_size
                    ),
                });
            }
        }
        if let Some(size) = b.ring_size
            && !(1..=crate::policy::MAX_RING_SIZE).contains(&size)
        {
            return Err(ConfigError::Field {
                field: "balancer.ring_size",
                reason: format!("must be 1..=8388608, got {size}"),
            });
        }
        if let Some(l) = self.locality
            && !(0.0..=1.0).contains(&l.min_healthy_share)
        {
            return Err(ConfigError::Field {
                field: "locality.min_healthy_share",
                reason: format!("must be 0.0..=1.0, got {}", l.min_healthy_share),
            });
        }
        if self.outlier.max_ejection_percent > 100 {
            return Err(ConfigError::Field {
                field: "outlier_detection.max_ejection_percent",
                reason: format!("must be 0..=100, got {}", self.outlier.max_ejection_percent),
            });
        }
        if self.health.rise == 0 || self.health.fall == 0 {
            return Err(ConfigError::Field {
                field: "health_check.rise/fall",
                reason: "thresholds must be at least 1".to_owned(),
            });
        }
        Ok(())
    }
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
