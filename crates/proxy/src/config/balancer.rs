//! `clusters[].balancer:` and `clusters[].locality:` how endpoints are
//! chosen. Defaults are meshless-balance's, defined there once.

use meshless_balance::{BalancerConfig, HashKind, LocalityMode, PolicyKind};
use meshless_model::FieldError;
use serde::{Deserialize, Serialize};

/// `balancer:` block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BalancerYaml {
    /// round_robin, random, least_request, p2c, ring_hash, maglev, bounded_load.
    /// A name, checked by validation (not by serde, whose error would not
    /// name the policies there are).
    #[serde(default = "default_policy")]
    pub policy: String,
    /// Where the affinity key comes from (hash policies).
    #[serde(default)]
    pub hash_key: Option<HashKey>,
    /// Bounded-load factor c >= 1.0.
    #[serde(default = "default_load_factor")]
    pub load_factor: f64,
    /// Draws per pick for p2c.
    #[serde(default = "default_choices")]
    pub choices: usize,
    /// The smallest Maglev table (prime); it grows with the endpoints.
    #[serde(default = "default_table_size")]
    pub table_size: usize,
    /// The largest the Maglev table grows to (prime).
    #[serde(default = "default_max_table_size")]
    pub max_table_size: usize,
    /// Ring size; absent = 160 points per endpoint.
    #[serde(default)]
    pub ring_size: Option<usize>,
    /// Hash under bounded_load: maglev or ring_hash.
    #[serde(default = "default_over")]
    pub over: String,
    /// Whether the file has this block (true for every block read from a
    /// file, false for the default): a `service:` cluster without one takes
    /// its policy from the service's settings.
    #[serde(skip_serializing, skip_deserializing, default = "declared")]
    pub declared: bool,
}

fn declared() -> bool {
    true
}

impl Default for BalancerYaml {
    fn default() -> Self {
        Self {
            policy: default_policy(),
            hash_key: None,
            load_factor: default_load_factor(),
            choices: default_choices(),
            table_size: default_table_size(),
            max_table_size: default_max_table_size(),
            ring_size: None,
            over: default_over(),
            declared: false,
        }
    }
}

// The balancer's defaults are the balance crate's, defined there once.
fn default_policy() -> String {
    BalancerConfig::default().policy.name().to_owned()
}
fn default_load_factor() -> f64 {
    BalancerConfig::default().load_factor
}
fn default_choices() -> usize {
    BalancerConfig::default().choices
}
fn default_table_size() -> usize {
    BalancerConfig::default().table_size
}
fn default_max_table_size() -> usize {
    BalancerConfig::default().max_table_size
}
fn default_over() -> String {
    BalancerConfig::default().over.name().to_owned()
}

impl BalancerYaml {
    /// The policy named by `policy`; the error names the policies there are.
    pub fn policy_kind(&self) -> Result<PolicyKind, FieldError> {
        self.policy.parse().map_err(|_| {
            let names: Vec<&str> = PolicyKind::ALL.iter().map(|p| p.name()).collect();
            FieldError::new(
                "policy",
                format!(
                    "unknown policy {:?} (expected one of {})",
                    self.policy,
                    names.join(", ")
                ),
            )
        })
    }

    /// The hash named by `over`.
    pub fn over_kind(&self) -> Result<HashKind, FieldError> {
        self.over.parse().map_err(|_| {
            FieldError::new(
                "over",
                format!("expected maglev or ring_hash, got {:?}", self.over),
            )
        })
    }
}

/// The source of a request's affinity key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum HashKey {
    /// A request header's value.
    Header(String),
    /// A cookie's value.
    Cookie(String),
    /// A query parameter's value.
    Query(String),
    /// The request path.
    Path,
    /// The client's IP address.
    ClientAddress,
}

/// `locality:` block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalityYaml {
    /// On or off.
    #[serde(default = "default_locality_enabled")]
    pub enabled: bool,
    /// prefer (default), proportional (Envoy zone-aware) or local_only
    /// (node only, no spill).
    #[serde(default)]
    pub mode: LocalityMode,
    /// prefer: spill to the next tier below this available share (0.0..=1.0).
    #[serde(default = "default_min_healthy_share")]
    pub min_healthy_share: f64,
    /// proportional: no locality below this many endpoints (Envoy: 6).
    #[serde(default = "default_min_cluster_size")]
    pub min_cluster_size: usize,
}

impl Default for LocalityYaml {
    fn default() -> Self {
        Self {
            enabled: default_locality_enabled(),
            mode: LocalityMode::default(),
            min_healthy_share: default_min_healthy_share(),
            min_cluster_size: default_min_cluster_size(),
        }
    }
}

fn default_locality_enabled() -> bool {
    true
}
fn default_min_healthy_share() -> f64 {
    meshless_balance::DEFAULT_MIN_HEALTHY_SHARE
}
fn default_min_cluster_size() -> usize {
    meshless_balance::DEFAULT_MIN_CLUSTER_SIZE
}
