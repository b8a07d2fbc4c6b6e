//! Every meshless load-balancing algorithm, with per-endpoint load, health
//! and outlier state. No I/O and no async runtime: the proxy feeds it
//! endpoints, request contexts and outcomes.
//!
//! Build a [`Cluster`] from endpoints and a [`ClusterConfig`], then call
//! [`Cluster::pick`] per request: it returns an [`InFlight`] guard that
//! counts as load until dropped, and records the request's [`Outcome`] for
//! outlier detection when it is.
//!
//! Every policy keeps its promise off the happy path, and each module says
//! how: with endpoints down, every policy picks only live ones, and the
//! shares follow `w / W_live` (round robin spreads a down endpoint's turns
//! by weight instead of handing them to its successor); with unequal
//! weights, P2C draws and least request compares by `in_flight / weight`;
//! bounded load reserves its slot atomically against a total over live
//! endpoints only; below [`ClusterConfig::panic_threshold`] percent
//! available, picks spread over every endpoint (Envoy's panic mode).

mod clock;
mod cluster;
mod config;
mod context;
mod health;
mod locality;
mod outcome;
pub mod policy;
mod rng;
mod set;
mod state;

pub use clock::{Clock, ManualClock, MonotonicClock};
pub use cluster::Cluster;
pub use config::{
    BalancerConfig, ClusterConfig, ConfigError, DEFAULT_LOAD_FACTOR, DEFAULT_PANIC_THRESHOLD,
    HashKind, PolicyKind,
};
pub use context::{PickContext, hash_key};
pub use health::{HealthConfig, OutlierConfig};
pub use locality::{
    DEFAULT_MIN_CLUSTER_SIZE, DEFAULT_MIN_HEALTHY_SHARE, LocalityConfig, LocalityMode, Tiers,
};
pub use outcome::Outcome;
pub use policy::{Balancer, Filter, View};
pub use set::EndpointSet;
pub use state::{EndpointStats, InFlight};
