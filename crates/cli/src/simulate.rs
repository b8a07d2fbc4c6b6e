//! `meshless simulate balance`: a discrete-event model of one policy on a
//! keyed workload, reporting peak load, affinity and key movement.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use meshless_balance::{
    Cluster, ClusterConfig, HashKind, ManualClock, OutlierConfig, PickContext, PolicyKind, hash_key,
};
use meshless_model::Endpoint;
use serde::Serialize;

use crate::progress::Progress;

/// Simulations.
#[derive(Debug, Subcommand)]
pub enum SimulateCommand {
    /// Run a balancing policy on a synthetic keyed workload.
    Balance(BalanceArgs),
    /// Bytes and events of endpoint changes: Endpoints, EndpointSlices, meshless deltas.
    Distribution(crate::distribution_model::DistributionArgs),
}

/// Arguments of `simulate balance`.
#[derive(Debug, Clone, Args)]
pub struct BalanceArgs {
    /// round_robin, random, least_request, p2c, ring_hash, maglev, bounded_load.
    #[arg(long, value_parser = parse_policy)]
    pub policy: PolicyKind,
    /// Number of endpoints (equal weight).
    #[arg(long, default_value_t = 10)]
    pub endpoints: usize,
    /// Key popularity: `uniform`, or `zipf:S` with exponent S > 0.
    #[arg(long, default_value = "uniform")]
    pub keys: KeyDistribution,
    /// Number of distinct keys.
    #[arg(long, default_value_t = 10_000)]
    pub distinct_keys: u64,
    /// Requests to simulate.
    #[arg(long, default_value_t = 100_000)]
    pub requests: u64,
    /// Requests in flight at all times.
    #[arg(long, default_value_t = 100)]
    pub concurrency: usize,
    /// Bounded-load factor c (>= 1.0).
    #[arg(long, default_value_t = 1.25)]
    pub load_factor: f64,
    /// The consistent hash under bounded_load.
    #[arg(long, value_enum, default_value_t = Over::Maglev)]
    pub over: Over,
    /// Draws per pick for p2c.
    #[arg(long, default_value_t = 2)]
    pub choices: usize,
    /// Seed of every random choice; the same seed gives the same report.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also report the share of keys whose home moves when this many endpoints leave.
    #[arg(long)]
    pub remove: Option<usize>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The hash under bounded load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Over {
    /// Maglev table.
    Maglev,
    /// Ketama ring.
    RingHash,
}

fn parse_policy(s: &str) -> Result<PolicyKind, String> {
    s.parse()
        .map_err(|e: meshless_balance::ConfigError| e.to_string())
}

/// How often each distinct key is requested.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KeyDistribution {
    /// Every key equally often.
    Uniform,
    /// Key of rank r with probability proportional to 1 / r^s.
    Zipf(f64),
}

impl FromStr for KeyDistribution {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "uniform" {
            return Ok(Self::Uniform);
        }
        if let Some(exp) = s.strip_prefix("zipf:") {
            let v: f64 = exp
                .parse()
                .map_err(|_| format!("--keys: zipf exponent {exp:?} is not a number"))?;
            if !(v > 0.0 && v.is_finite()) {
                return Err(format!("--keys: zipf exponent must be > 0, got {v}"));
            }
            return Ok(Self::Zipf(v));
        }
        Err(format!("--keys: expected `uniform` or `zipf:S`, got {s:?}"))
    }
}

impl fmt::Display for KeyDistribution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Uniform => f.write_str("uniform"),
            Self::Zipf(s) => write!(f, "zipf:{s}"),
        }
    }
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
    /// Highest in-flight count any endpoint reached, over concurrency / endpoints.
    pub max_over_mean: f64,
    /// Most requests served by one endpoint, over requests / endpoints.
    pub served_max_over_mean: f64,
    /// Share of requests served by their key's plain consistent-hash home.
    pub home_share: f64,
    /// With --remove: share of distinct keys whose home changes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moved: Option<Option<f64>>,
}

/// Largest supported number of distinct keys (the zipf table is in memory).
const MAX_DISTINCT_KEYS: u64 = 10_000_000;

pub fn run(cmd: SimulateCommand) -> Result<()> {
    match cmd {
        SimulateCommand::Distribution(args) => crate::distribution_model::run(&args),
        SimulateCommand::Balance(args) => {
            let report = simulate_balance(&args, true)?;
            if args.json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print_report(&report);
            }
            Ok(())
        }
    }
}

fn validate(a: &BalanceArgs) -> Result<()> {
    if a.endpoints == 0 {
        bail!("--endpoints: must be at least 1");
    }
    if a.concurrency == 0 {
        bail!("--concurrency: must be at least 1");
    }
    if a.requests == 0 {
        bail!("--requests: must be at least 1");
    }
    if a.distinct_keys == 0 || a.distinct_keys > MAX_DISTINCT_KEYS {
        bail!(
            "--distinct-keys: must be 1..={MAX_DISTINCT_KEYS}, got {}",
            a.distinct_keys
        );
    }
    if let Some(r) = a.remove
        && r >= a.endpoints
    {
        bail!(
            "--remove: must leave at least one endpoint ({r} of {})",
            a.endpoints
        );
    }
    Ok(())
}

fn cluster_config(a: &BalanceArgs, policy: PolicyKind) -> ClusterConfig {
    let mut cfg = ClusterConfig::new(policy);
    cfg.outlier = OutlierConfig::disabled();
    cfg.balancer.load_factor = a.load_factor;
    cfg.balancer.choices = a.choices;
    cfg.balancer.over = match a.over {
        Over::Maglev => HashKind::Maglev,
        Over::RingHash => HashKind::RingHash,
    };
    cfg.balancer.table_size = meshless_balance::policy::next_prime(
        meshless_balance::policy::DEFAULT_TABLE_SIZE.max(a.endpoints * 101),
    );
    cfg
}

/// The plain consistent hash a policy's affinity is measured against.
fn home_policy(a: &BalanceArgs) -> PolicyKind {
    match (a.policy, a.over) {
        (PolicyKind::RingHash, _) | (PolicyKind::BoundedLoad, Over::RingHash) => {
            PolicyKind::RingHash
        }
        _ => PolicyKind::Maglev,
    }
}

fn endpoints(n: usize) -> Vec<Endpoint> {
    (0..n)
        .map(|i| {
            let ip = std::net::Ipv4Addr::from(0x0A00_0000 + i as u32);
            Endpoint::new(
                format!("endpoint-{i}"),
                std::net::SocketAddr::from((ip, 8080)),
            )
        })
        .collect()
}

fn key_hash(key: u64) -> u64 {
    hash_key(&key.to_le_bytes())
}

/// Runs the model. `show_progress` draws progress on a terminal.
pub fn simulate_balance(a: &BalanceArgs, show_progress: bool) -> Result<BalanceReport> {
    validate(a)?;
    let eps = endpoints(a.endpoints);
    let clock = Arc::new(ManualClock::new());
    let cluster = Cluster::with_clock(&eps, cluster_config(a, a.policy), clock)
        .context("building the cluster")?;
    let home = Cluster::new(&eps, cluster_config(a, home_policy(a)))
        .context("building the reference hash")?;
    let sampler = KeySampler::new(a.keys, a.distinct_keys);
    let mut rng = fastrand::Rng::with_seed(a.seed);
    let mut progress = Progress::new("simulating", a.requests);
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
            .context("the cluster picked no endpoint")?;
        let i = guard.index();
        served[i] += 1;
        max_load = max_load.max(cluster.set().load(i));
        if home.pick_index(&PickContext::new().with_key(key).with_entropy(0)) == Some(i) {
            at_home += 1;
        }
        in_flight.push(guard);
        if show_progress && r % 4096 == 0 {
            progress.update(r);
        }
    }
    progress.finish();
    let mean_load = a.concurrency.min(a.requests as usize) as f64 / a.endpoints as f64;
    let mean_served = a.requests as f64 / a.endpoints as f64;
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
    })
}

/// Share of distinct keys whose home changes when `remove` endpoints chosen
/// at random leave; `None` for policies that do not map keys to endpoints.
fn moved_share(
    a: &BalanceArgs,
    eps: &[Endpoint],
    remove: usize,
    rng: &mut fastrand::Rng,
) -> Result<Option<f64>> {
    if !a.policy.is_hash() {
        return Ok(None);
    }
    let policy = home_policy(a);
    let before = Cluster::new(eps, cluster_config(a, policy))?;
    let mut fewer = eps.to_vec();
    for _ in 0..remove {
        fewer.swap_remove(rng.usize(..fewer.len()));
    }
    let after = Cluster::new(&fewer, cluster_config(a, policy))?;
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

/// Draws key ids `0..distinct` under a distribution, by inverse CDF.
#[derive(Debug)]
struct KeySampler {
    distinct: u64,
    /// Cumulative probabilities for zipf; empty for uniform.
    cdf: Vec<f64>,
}

impl KeySampler {
    fn new(dist: KeyDistribution, distinct: u64) -> Self {
        let cdf = match dist {
            KeyDistribution::Uniform => Vec::new(),
            KeyDistribution::Zipf(s) => {
                let mut acc = 0.0;
                let mut cdf: Vec<f64> = (1..=distinct)
                    .map(|r| {
                        acc += 1.0 / (r as f64).powf(s);
                        acc
                    })
                    .collect();
                cdf.iter_mut().for_each(|c| *c /= acc);
                cdf
            }
        };
        Self { distinct, cdf }
    }

    fn sample(&self, rng: &mut fastrand::Rng) -> u64 {
        if self.cdf.is_empty() {
            return rng.u64(..self.distinct);
        }
        let u = rng.f64();
        (self.cdf.partition_point(|&c| c < u) as u64).min(self.distinct - 1)
    }
}

fn print_report(r: &BalanceReport) {
    println!("policy           {}", r.policy);
    if let Some(c) = r.load_factor {
        println!("load factor      {c}");
    }
    println!("endpoints        {}", r.endpoints);
    println!(
        "keys             {} over {} distinct",
        r.keys, r.distinct_keys
    );
    println!(
        "requests         {} at concurrency {}",
        r.requests, r.concurrency
    );
    println!(
        "max_over_mean    {:.4}   (peak in-flight on one endpoint / mean)",
        r.max_over_mean
    );
    println!(
        "served_max/mean  {:.4}   (most requests served by one endpoint / mean)",
        r.served_max_over_mean
    );
    println!(
        "home_share       {:.4}   (requests served by their key's home endpoint)",
        r.home_share
    );
    match r.moved {
        Some(Some(m)) => println!("moved            {m:.4}   (keys whose home changes on removal)"),
        Some(None) => println!(
            "moved            n/a      ({} does not map keys to endpoints)",
            r.policy
        ),
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(policy: PolicyKind) -> BalanceArgs {
        BalanceArgs {
            policy,
            endpoints: 10,
            keys: KeyDistribution::Zipf(1.1),
            distinct_keys: 2_000,
            requests: 20_000,
            concurrency: 100,
            load_factor: 1.25,
            over: Over::Maglev,
            choices: 2,
            seed: 7,
            remove: Some(1),
            json: true,
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
    }
}
