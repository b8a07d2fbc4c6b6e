//! The balance simulator: a discrete-event model of one policy on a keyed
//! workload, with optional unequal weights and failed endpoints, reporting
//! peak load, affinity, key movement and each endpoint's share.
//!
//! Concurrency is modelled as a fixed number of requests in flight: each
//! new request first completes one in-flight request chosen at random.
//! Endpoints marked down fail their active health checks before the first
//! request (through [`Cluster::record_health_check`]), so the policy sees
//! them exactly as the proxy would.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use meshless_balance::{
    Cluster, ClusterConfig, ConfigError, HashKind, ManualClock, OutlierConfig, PickContext,
    PolicyKind, hash_key,
};
use meshless_model::{Endpoint, MAX_WEIGHT};
use serde::Serialize;

use crate::SimError;
use crate::keys::{KeyDistribution, KeySampler};
use crate::progress::Progress;

/// Largest supported number of distinct keys (the zipf table is in memory).
pub const MAX_DISTINCT_KEYS: u64 = 10_000_000;

/// Which endpoints fail their health checks for the whole run.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Down {
    /// Every endpoint is up.
    #[default]
    None,
    /// The last `n` endpoints (highest indices), so with `--weights 4,1,1,1,1`
    /// a count never takes the first, heaviest one down.
    Count(usize),
    /// These endpoint indices (0-based).
    Indices(Vec<usize>),
}

impl FromStr for Down {
    type Err = SimError;

    /// `N` (a count) or `I,J,...` (indices; a single index as `I,`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |part: &str| SimError::new("down", format!("{part:?} is not a whole number"));
        if !s.contains(',') {
            return s.trim().parse().map(Self::Count).map_err(|_| bad(s));
        }
        s.split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| p.parse().map_err(|_| bad(p)))
            .collect::<Result<Vec<usize>, _>>()
            .map(Self::Indices)
    }
}

impl Down {
    /// The indices down among `endpoints`, ascending.
    pub fn indices(&self, endpoints: usize) -> Vec<usize> {
        let mut v = match self {
            Self::None => Vec::new(),
            Self::Count(n) => (endpoints.saturating_sub(*n)..endpoints).collect(),
            Self::Indices(v) => v.clone(),
        };
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// A workload for [`simulate_balance`].
#[derive(Debug, Clone, PartialEq)]
pub struct BalanceWorkload {
    pub policy: PolicyKind,
    /// Number of endpoints.
    pub endpoints: usize,
    /// One weight per endpoint; `None` = all 1.
    pub weights: Option<Vec<u32>>,
    /// Endpoints that are down for the whole run.
    pub down: Down,
    pub keys: KeyDistribution,
    pub distinct_keys: u64,
    pub requests: u64,
    /// Requests in flight at all times.
    pub concurrency: usize,
    /// Bounded-load factor c (>= 1.0).
    pub load_factor: f64,
    /// The consistent hash under bounded load.
    pub over: HashKind,
    /// Draws per pick for p2c.
    pub choices: usize,
    /// Seed of every random choice; the same seed gives the same report.
    pub seed: u64,
    /// Also report the share of keys whose home moves when this many endpoints leave.
    pub remove: Option<usize>,
}

/// One endpoint's part of a run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct EndpointShare {
    pub index: usize,
    pub weight: u32,
    /// False for endpoints down for the run.
    pub up: bool,
    /// Requests it served, over all requests.
    pub share: f64,
    /// Its weight over the total weight of endpoints up (0 when down): the
    /// share a weight-honouring policy aims at.
    pub weight_share: f64,
}

/// What a simulation measured.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BalanceReport {
    pub policy: String,
    pub endpoints: usize,
    pub keys: String,
    pub distinct_keys: u64,
    pub requests: u64,
    pub concurrency: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load_factor: Option<f64>,
    pub seed: u64,
    /// Highest in-flight count any endpoint reached, over concurrency / endpoints up.
    pub max_over_mean: f64,
    /// Most requests served by one endpoint, over requests / endpoints up.
    pub served_max_over_mean: f64,
    /// Share of requests served by their key's plain consistent-hash home.
    pub home_share: f64,
    /// With --remove: share of distinct keys whose home changes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moved: Option<Option<f64>>,
    /// Indices of the endpoints down for the run.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub down: Vec<usize>,
    /// Per endpoint, by index.
    pub shares: Vec<EndpointShare>,
}

fn validate(a: &BalanceWorkload) -> Result<(), SimError> {
    let at_least_one = |flag, v: u64| match v {
        0 => Err(SimError::new(flag, "must be at least 1")),
        _ => Ok(()),
    };
    at_least_one("endpoints", a.endpoints as u64)?;
    at_least_one("concurrency", a.concurrency as u64)?;
    at_least_one("requests", a.requests)?;
    if a.distinct_keys == 0 || a.distinct_keys > MAX_DISTINCT_KEYS {
        return Err(SimError::new(
            "distinct-keys",
            format!("must be 1..={MAX_DISTINCT_KEYS}, got {}", a.distinct_keys),
        ));
    }
    if let Some(r) = a.remove
        && r >= a.endpoints
    {
        return Err(SimError::new(
            "remove",
            format!("must leave at least one endpoint ({r} of {})", a.endpoints),
        ));
    }
    if let Some(w) = &a.weights {
        if w.len() != a.endpoints {
            return Err(SimError::new(
                "weights",
                format!("{} weights for {} endpoints", w.len(), a.endpoints),
            ));
        }
        if let Some(bad) = w.iter().find(|&&w| w == 0 || w > MAX_WEIGHT) {
            return Err(SimError::new(
                "weights",
                format!("{bad} is not in 1..={MAX_WEIGHT}"),
            ));
        }
    }
    match &a.down {
        Down::Count(n) if *n > a.endpoints => Err(SimError::new(
            "down",
            format!("{n} of {} endpoints", a.endpoints),
        )),
        Down::Indices(v) if v.iter().any(|&i| i >= a.endpoints) => Err(SimError::new(
            "down",
            format!("indices must be below {}", a.endpoints),
        )),
        _ => Ok(()),
    }
}

fn cluster_config(a: &BalanceWorkload, policy: PolicyKind) -> ClusterConfig {
    let mut cfg = ClusterConfig::new(policy);
    cfg.outlier = OutlierConfig::disabled();
    cfg.balancer.load_factor = a.load_factor;
    cfg.balancer.choices = a.choices;
    cfg.balancer.over = a.over;
    cfg.balancer.table_size = meshless_balance::policy::next_prime(
        meshless_balance::policy::DEFAULT_TABLE_SIZE.max(a.endpoints * 101),
    );
    cfg
}

/// The plain consistent hash a policy's affinity is measured against.
fn home_policy(a: &BalanceWorkload) -> PolicyKind {
    match (a.policy, a.over) {
        (PolicyKind::RingHash, _) | (PolicyKind::BoundedLoad, HashKind::RingHash) => {
            PolicyKind::RingHash
        }
        _ => PolicyKind::Maglev,
    }
}

fn weight_of(a: &BalanceWorkload, i: usize) -> u32 {
    a.weights
        .as_ref()
        .and_then(|w| w.get(i).copied())
        .unwrap_or(1)
}

fn endpoints(a: &BalanceWorkload) -> Vec<Endpoint> {
    (0..a.endpoints)
        .map(|i| {
            let ip = std::net::Ipv4Addr::from(0x0A00_0000 + i as u32);
            Endpoint::new(
                format!("endpoint-{i}"),
                std::net::SocketAddr::from((ip, 8080)),
            )
            .with_weight(weight_of(a, i))
        })
        .collect()
}

fn key_hash(key: u64) -> u64 {
    hash_key(&key.to_le_bytes())
}

/// A cluster, or the balancer's reason naming its setting.
fn build(
    eps: &[Endpoint],
    cfg: ClusterConfig,
    clock: Option<Arc<ManualClock>>,
) -> Result<Cluster, SimError> {
    let built = match clock {
        Some(c) => Cluster::with_clock(eps, cfg, c),
        None => Cluster::new(eps, cfg),
    };
    built.map_err(|e: ConfigError| {
        let reason = e.to_string();
        let flag = [("load_factor", "load-factor"), ("choices", "choices")]
            .into_iter()
            .find(|(field, _)| reason.contains(field))
            .map_or("policy", |(_, flag)| flag);
        SimError::new(flag, reason)
    })
}

/// Fails the health checks of `down` until the cluster stops offering them.
fn mark_down(cluster: &Cluster, down: &[usize]) -> Result<(), SimError> {
    let fall = cluster.config().health.fall.max(1);
    for &i in down {
        for _ in 0..=fall {
            if !cluster.set().is_available(i) {
                break;
            }
            cluster.record_health_check(i, false);
        }
        if cluster.set().is_available(i) {
            return Err(SimError::new(
                "down",
                format!("endpoint {i} stayed available after {fall} failed checks"),
            ));
        }
    }
    Ok(())
}

/// Runs the model. `show_progress` draws progress on a terminal.
pub fn simulate_balance(
    a: &BalanceWorkload,
    show_progress: bool,
) -> Result<BalanceReport, SimError> {
    validate(a)?;
    let eps = endpoints(a);
    let down = a.down.indices(a.endpoints);
    let cluster = build(
        &eps,
        cluster_config(a, a.policy),
        Some(Arc::new(ManualClock::new())),
    )?;
    mark_down(&cluster, &down)?;
    let home = build(&eps, cluster_config(a, home_policy(a)), None)?;
    let sampler = KeySampler::new(a.keys, a.distinct_keys);
    let mut rng = fastrand::Rng::with_seed(a.seed);
    let mut progress = Progress::with_enabled("simulating", a.requests, show_progress);
    let mut in_flight = Vec::with_capacity(a.concurrency);
    let mut served = vec![0u64; a.endpoints];
    let mut max_load = 0u32;
    let mut at_home = 0u64;
    for r in 0..a.requests {
        if in_flight.len() == a.concurrency {
            in_flight.swap_remove(rng.usize(..in_flight.len()));
        }
        let key = key_hash(sampler.sample(&mut rng));
        let ctx = PickContext::new().with_key(key).with_entropy(rng.u64(..));
        let guard = cluster
            .pick(&ctx)
            .ok_or_else(|| SimError::new("policy", "the cluster picked no endpoint"))?;
        let i = guard.index();
        served[i] += 1;
        max_load = max_load.max(cluster.set().load(i));
        if home.pick_index(&PickContext::new().with_key(key).with_entropy(0)) == Some(i) {
            at_home += 1;
        }
        in_flight.push(guard);
        if r % 4096 == 0 {
            progress.update(r);
        }
    }
    progress.finish();
    let up = (a.endpoints - down.len()).max(1) as f64;
    let mean_load = a.concurrency.min(a.requests as usize) as f64 / up;
    let mean_served = a.requests as f64 / up;
    let moved = a
        .remove
        .map(|r| moved_share(a, &eps, r, &mut rng))
        .transpose()?;
    Ok(BalanceReport {
        policy: a.policy.name().to_owned(),
        endpoints: a.endpoints,
        keys: a.keys.to_string(),
        distinct_keys: a.distinct_keys,
        requests: a.requests,
        concurrency: a.concurrency,
        load_factor: (a.policy == PolicyKind::BoundedLoad).then_some(a.load_factor),
        seed: a.seed,
        max_over_mean: round4(f64::from(max_load) / mean_load),
        served_max_over_mean: round4(
            served.iter().copied().max().unwrap_or(0) as f64 / mean_served,
        ),
        home_share: round4(at_home as f64 / a.requests as f64),
        moved,
        shares: shares(a, &served, &down),
        down,
    })
}

fn shares(a: &BalanceWorkload, served: &[u64], down: &[usize]) -> Vec<EndpointShare> {
    let is_up = |i: usize| down.binary_search(&i).is_err();
    let up_weight: u64 = (0..a.endpoints)
        .filter(|&i| is_up(i))
        .map(|i| u64::from(weight_of(a, i)))
        .sum();
    served
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let weight = weight_of(a, i);
            let up = is_up(i);
            EndpointShare {
                index: i,
                weight,
                up,
                share: round4(n as f64 / a.requests as f64),
                weight_share: match (up, up_weight) {
                    (true, w) if w > 0 => round4(f64::from(weight) / w as f64),
                    _ => 0.0,
                },
            }
        })
        .collect()
}

/// Share of distinct keys whose home changes when `remove` endpoints chosen
/// at random leave; `None` for policies that do not map keys to endpoints.
fn moved_share(
    a: &BalanceWorkload,
    eps: &[Endpoint],
    remove: usize,
    rng: &mut fastrand::Rng,
) -> Result<Option<f64>, SimError> {
    if !a.policy.is_hash() {
        return Ok(None);
    }
    let policy = home_policy(a);
    let before = build(eps, cluster_config(a, policy), None)?;
    let mut fewer = eps.to_vec();
    for _ in 0..remove {
        fewer.swap_remove(rng.usize(..fewer.len()));
    }
    let after = build(&fewer, cluster_config(a, policy), None)?;
    let id = |c: &Cluster, key: u64| {
        c.pick_index(&PickContext::new().with_key(key).with_entropy(0))
            .map(|i| c.endpoints()[i].id.clone())
    };
    let moved = (0..a.distinct_keys)
        .filter(|&k| id(&before, key_hash(k)) != id(&after, key_hash(k)))
        .count();
    Ok(Some(round4(moved as f64 / a.distinct_keys as f64)))
}

fn round4(x: f64) -> f64 {
    (x * 10_000.0).round() / 10_000.0
}

/// The text report: one line per measure, then one per endpoint when the
/// run had unequal weights or endpoints down (or few endpoints).
impl fmt::Display for BalanceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "policy           {}", self.policy)?;
        if let Some(c) = self.load_factor {
            writeln!(f, "load factor      {c}")?;
        }
        writeln!(f, "endpoints        {}", self.endpoints)?;
        writeln!(
            f,
            "keys             {} over {} distinct",
            self.keys, self.distinct_keys
        )?;
        writeln!(
            f,
            "requests         {} at concurrency {}",
            self.requests, self.concurrency
        )?;
        writeln!(
            f,
            "max_over_mean    {:.4}   (peak in-flight on one endpoint / mean)",
            self.max_over_mean
        )?;
        writeln!(
            f,
            "served_max/mean  {:.4}   (most requests served by one endpoint / mean)",
            self.served_max_over_mean
        )?;
        write!(
            f,
            "home_share       {:.4}   (requests served by their key's home endpoint)",
            self.home_share
        )?;
        match self.moved {
            Some(Some(m)) => write!(
                f,
                "\nmoved            {m:.4}   (keys whose home changes on removal)"
            )?,
            Some(None) => write!(
                f,
                "\nmoved            n/a      ({} does not map keys to endpoints)",
                self.policy
            )?,
            None => {}
        }
        let unequal = self.shares.windows(2).any(|w| w[0].weight != w[1].weight);
        if unequal || !self.down.is_empty() || self.endpoints <= 16 {
            write!(f, "\n\nendpoint  weight  up    share   weight share")?;
            for s in &self.shares {
                let up = if s.up { "yes" } else { "no" };
                write!(
                    f,
                    "\n{:>8}  {:>6}  {up:<4}  {:.4}  {:.4}",
                    s.index, s.weight, s.share, s.weight_share
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(policy: PolicyKind) -> BalanceWorkload {
        BalanceWorkload {
            policy,
            endpoints: 10,
            weights: None,
            down: Down::None,
            keys: KeyDistribution::Zipf(1.1),
            distinct_keys: 2_000,
            requests: 20_000,
            concurrency: 100,
            load_factor: 1.25,
            over: HashKind::Maglev,
            choices: 2,
            seed: 7,
            remove: Some(1),
        }
    }

    #[test]
    fn bounded_load_stays_under_its_factor_and_keeps_affinity() {
        let bounded = simulate_balance(&args(PolicyKind::BoundedLoad), false).expect("runs");
        // ceil(1.25 * mean) plus at most one request's worth.
        assert!(
            bounded.max_over_mean <= 1.25 + 1.0 / 10.0 + 1e-9,
            "{bounded:?}"
        );
        let p2c = simulate_balance(&args(PolicyKind::PowerOfChoices), false).expect("runs");
        assert!(
            bounded.home_share > 2.0 * p2c.home_share,
            "{bounded:?} vs {p2c:?}"
        );
        let maglev = simulate_balance(&args(PolicyKind::Maglev), false).expect("runs");
        assert_eq!(maglev.home_share, 1.0);
        assert!(
            maglev.max_over_mean > bounded.max_over_mean,
            "zipf keys overload plain hashing"
        );
        assert!(bounded.moved.flatten().is_some_and(|m| m > 0.0 && m < 0.25));
        assert_eq!(p2c.moved, Some(None));
    }

    #[test]
    fn same_seed_same_report() {
        let a = simulate_balance(&args(PolicyKind::Random), false).expect("runs");
        let b = simulate_balance(&args(PolicyKind::Random), false).expect("runs");
        assert_eq!(a, b);
    }

    #[test]
    fn bad_input_names_the_flag() {
        let mut a = args(PolicyKind::Maglev);
        a.endpoints = 0;
        assert!(
            simulate_balance(&a, false)
                .expect_err("0")
                .to_string()
                .contains("--endpoints")
        );
        let mut a = args(PolicyKind::Maglev);
        a.remove = Some(10);
        assert!(
            simulate_balance(&a, false)
                .expect_err("all")
                .to_string()
                .contains("--remove")
        );
        let mut a = args(PolicyKind::BoundedLoad);
        a.load_factor = 0.5;
        assert!(
            format!("{:#}", simulate_balance(&a, false).expect_err("c")).contains("load_factor")
        );
        assert!("zipf:x".parse::<KeyDistribution>().is_err());
        assert!("zipf:-1".parse::<KeyDistribution>().is_err());
        assert!("gauss".parse::<KeyDistribution>().is_err());
        let mut a = args(PolicyKind::Random);
        a.weights = Some(vec![1, 2]);
        assert_eq!(
            simulate_balance(&a, false).expect_err("len").flag,
            "weights"
        );
        let mut a = args(PolicyKind::Random);
        a.down = Down::Indices(vec![10]);
        assert_eq!(simulate_balance(&a, false).expect_err("idx").flag, "down");
    }

    #[test]
    fn down_parses_as_a_count_or_a_list() {
        assert_eq!("2".parse::<Down>(), Ok(Down::Count(2)));
        assert_eq!("0,3".parse::<Down>(), Ok(Down::Indices(vec![0, 3])));
        assert_eq!("3,".parse::<Down>(), Ok(Down::Indices(vec![3])));
        assert!("x".parse::<Down>().is_err());
        assert_eq!(Down::Count(2).indices(5), vec![3, 4]);
    }

    #[test]
    fn a_down_endpoint_serves_nothing_and_shares_add_up() {
        // Holds for every policy whatever the algorithm: an endpoint failing
        // its checks is not available, so outside panic mode it gets nothing.
        for policy in [
            PolicyKind::RoundRobin,
            PolicyKind::Random,
            PolicyKind::PowerOfChoices,
        ] {
            let mut a = args(policy);
            a.endpoints = 5;
            a.weights = Some(vec![4, 1, 1, 1, 1]);
            a.down = "1,".parse().expect("down");
            a.remove = None;
            let r = simulate_balance(&a, false).expect("runs");
            assert_eq!(r.down, vec![1]);
            assert_eq!(r.shares[1].share, 0.0, "{r:?}");
            assert_eq!(r.shares[0].weight_share, 0.5714, "4 of the 7 weight up");
            let total: f64 = r.shares.iter().map(|s| s.share).sum();
            assert!((total - 1.0).abs() < 1e-3, "{r:?}");
        }
    }
}
