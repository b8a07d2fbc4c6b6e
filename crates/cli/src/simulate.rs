//! `meshless simulate`: flags onto the workloads of `meshless-sim`, and
//! its reports printed as one JSON object (`--json`) or as text.

use std::str::FromStr;

use anyhow::Result;
use clap::{Args, Subcommand};
use meshless_balance::{BalancerConfig, HashKind, PolicyKind};
use meshless_sim::{BalanceWorkload, DistributionWorkload, Down, KeyDistribution};

/// Simulations.
#[derive(Debug, Subcommand)]
pub enum SimulateCommand {
    /// Run a balancing policy on a synthetic keyed workload.
    Balance(BalanceArgs),
    /// Bytes and events of endpoint changes: Endpoints, EndpointSlices, meshless deltas.
    Distribution(DistributionArgs),
}

/// Arguments of `simulate balance`.
#[derive(Debug, Clone, Args)]
pub struct BalanceArgs {
    /// round_robin, random, least_request, p2c, ring_hash, maglev, bounded_load.
    #[arg(long, value_parser = <PolicyKind as FromStr>::from_str)]
    pub policy: PolicyKind,
    /// Number of endpoints; default: as many as --weights, else 10.
    #[arg(long)]
    pub endpoints: Option<usize>,
    /// Weight of each endpoint, comma separated: `4,1,1,1,1` (default all 1).
    #[arg(long, value_delimiter = ',')]
    pub weights: Option<Vec<u32>>,
    /// Endpoints down for the whole run: a count N (the last N), or indices `0,3` (one index: `3,`).
    #[arg(long, value_parser = <Down as FromStr>::from_str)]
    pub down: Option<Down>,
    /// Key popularity: `uniform`, or `zipf:S` with exponent S > 0.
    #[arg(long, default_value = "uniform", value_parser = <KeyDistribution as FromStr>::from_str)]
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
    #[arg(long, default_value_t = BalancerConfig::default().load_factor)]
    pub load_factor: f64,
    /// The consistent hash under bounded_load: maglev or ring-hash.
    #[arg(long, default_value = "maglev", value_parser = parse_hash)]
    pub over: HashKind,
    /// Draws per pick for p2c.
    #[arg(long, default_value_t = BalancerConfig::default().choices)]
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

/// Arguments of `simulate distribution`.
#[derive(Debug, Clone, Args)]
pub struct DistributionArgs {
    /// Nodes, each running a proxy (watcher).
    #[arg(long, default_value_t = 5000)]
    pub nodes: u64,
    /// Endpoints of the service.
    #[arg(long, default_value_t = 20_000)]
    pub endpoints: u64,
    /// Endpoints per EndpointSlice.
    #[arg(long, default_value_t = 100)]
    pub slice_size: u64,
    /// Seed of the generated names and addresses.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Endpoints per node's subset: adds rows for meshless deltas with
    /// deterministic subsetting (0 = off).
    #[arg(long, default_value_t = 0)]
    pub subset_size: u64,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
}

fn parse_hash(s: &str) -> Result<HashKind, String> {
    match s {
        "maglev" => Ok(HashKind::Maglev),
        "ring-hash" | "ring_hash" => Ok(HashKind::RingHash),
        _ => Err(format!("expected maglev or ring-hash, got {s:?}")),
    }
}

impl BalanceArgs {
    fn workload(self) -> BalanceWorkload {
        let endpoints = self
            .endpoints
            .or(self.weights.as_ref().map(Vec::len))
            .unwrap_or(10);
        BalanceWorkload {
            policy: self.policy,
            endpoints,
            weights: self.weights,
            down: self.down.unwrap_or_default(),
            keys: self.keys,
            distinct_keys: self.distinct_keys,
            requests: self.requests,
            concurrency: self.concurrency,
            load_factor: self.load_factor,
            over: self.over,
            choices: self.choices,
            seed: self.seed,
            remove: self.remove,
        }
    }
}

/// Prints `report` as one JSON line, or through its `Display`.
pub fn print<T: serde::Serialize + std::fmt::Display>(json: bool, report: &T) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        println!("{report}");
    }
    Ok(())
}

pub fn run(cmd: SimulateCommand) -> Result<()> {
    match cmd {
        SimulateCommand::Balance(args) => {
            let json = args.json;
            let report = meshless_sim::simulate_balance(&args.workload(), true)?;
            print(json, &report)
        }
        SimulateCommand::Distribution(a) => {
            let report = meshless_sim::distribution::report(&DistributionWorkload {
                nodes: a.nodes,
                endpoints: a.endpoints,
                slice_size: a.slice_size,
                seed: a.seed,
                subset_size: a.subset_size,
            })?;
            print(a.json, &report)
        }
    }
}
