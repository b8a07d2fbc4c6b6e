//! `meshless bench`: flags onto the settings of `meshless-bench`, run on
//! a multi-thread runtime, reports printed as JSON (`--json`) or text.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use meshless_bench::{ClientKind, ColdstartSettings, DistributionBenchSettings, UpstreamHttp1};

/// Measurements that back the performance claims.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// A real control plane and N real subscriber streams on 127.0.0.1.
    Distribution(DistributionBenchArgs),
    /// First-response latency at zero instances, against the backend's own start time.
    Coldstart(ColdstartArgs),
}

/// Arguments of `bench distribution`.
#[derive(Debug, Clone, Args)]
pub struct DistributionBenchArgs {
    /// Subscriber streams (simulated proxies), each its own connection.
    #[arg(long, default_value_t = 100)]
    pub subscribers: usize,
    /// Endpoints of the service.
    #[arg(long, default_value_t = 2000)]
    pub endpoints: usize,
    /// Endpoints per slice.
    #[arg(long, default_value_t = 100)]
    pub slice_size: usize,
    /// Single-endpoint changes before the rolling update.
    #[arg(long, default_value_t = 100)]
    pub changes: usize,
    /// Milliseconds between the single changes, so that each is measured
    /// alone (0: back to back, as the rolling update).
    #[arg(long, default_value_t = 50)]
    pub change_gap_ms: u64,
    /// Concurrent registration clients of a durable-write benchmark run
    /// first (writes/s, renewals/s); 0 skips it.
    #[arg(long, default_value_t = 0)]
    pub writers: usize,
    /// Balancing policies (comma-separated): one real proxy process per
    /// policy follows the service, and its CPU per change is reported.
    #[arg(long, value_delimiter = ',')]
    pub proxy_policies: Vec<String>,
    /// The following proxies' `control.update_merge_window`, in
    /// milliseconds (default: the proxy's default; 0 rebuilds on every delta).
    #[arg(long)]
    pub proxy_merge_window_ms: Option<u64>,
    /// The control plane's `stream_batch`: messages a subscriber's stream
    /// writes in one go (default: the control plane's; 1: one write each).
    #[arg(long)]
    pub stream_batch: Option<usize>,
    /// The control plane's `stream_interval` in milliseconds: pacing of
    /// each subscriber's writes (default: the control plane's; 0: none).
    #[arg(long)]
    pub stream_interval_ms: Option<u64>,
    /// Each subscriber asks for a deterministic subset of this many
    /// endpoints (as a proxy's `subset: { size }`); default: every endpoint.
    #[arg(long)]
    pub subset_size: Option<u32>,
    /// The subsets are zone-aware (as `subset: { zone_aware: true }`):
    /// subscribers are spread over the endpoints' three zones. Needs
    /// `--subset-size`.
    #[arg(long)]
    pub zone_aware: bool,
    /// Subscribers acknowledge every delta (as proxies did before they
    /// acknowledged once per heartbeat), to measure what that costs.
    #[arg(long)]
    pub ack_every_delta: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `bench coldstart`.
#[derive(Debug, Clone, Args)]
pub struct ColdstartArgs {
    /// The backend waits this many milliseconds before it listens.
    #[arg(long, default_value_t = 200)]
    pub startup_delay: u64,
    /// Cold starts to measure.
    #[arg(long, default_value_t = 10)]
    pub runs: usize,
    /// Concurrent requests of the burst at zero (0 skips it).
    #[arg(long, default_value_t = 1000)]
    pub burst: usize,
    /// The proxy's `activation.release_concurrency` (default: the proxy's
    /// default; 0: held requests are released all at once).
    #[arg(long)]
    pub release_concurrency: Option<u32>,
    /// The client of the measured requests: `open` (one HTTP/1.1 request
    /// on a connection opened before the clock starts, written and read by
    /// a task of the runtime), `hyper` (hyper's pooling client, with a
    /// connection task of its own; its connect is timed) or `raw` (one
    /// HTTP/1.1 request written on a fresh socket by the benchmark's task;
    /// its connect is timed).
    #[arg(long, default_value = "open", value_parser = parse_client)]
    pub client: ClientKind,
    /// Run the control plane and the proxy each on a runtime of its own
    /// with this many worker threads, as separate processes would (0: one
    /// runtime shared with the benchmark's client).
    #[arg(long, default_value_t = 0)]
    pub own_runtimes: usize,
    /// The proxy's upstream HTTP/1.1 client (`clusters[].http1`):
    /// `meshless` (the proxy's default) or `hyper`.
    #[arg(long, default_value = "meshless", value_parser = parse_upstream_http1)]
    pub upstream_http1: UpstreamHttp1,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

fn parse_client(s: &str) -> Result<ClientKind, String> {
    match s {
        "hyper" => Ok(ClientKind::Hyper),
        "raw" => Ok(ClientKind::Raw),
        "open" => Ok(ClientKind::Open),
        other => Err(format!("`{other}`: expected `open`, `hyper` or `raw`")),
    }
}

fn parse_upstream_http1(s: &str) -> Result<UpstreamHttp1, String> {
    match s {
        "hyper" => Ok(UpstreamHttp1::Hyper),
        "meshless" => Ok(UpstreamHttp1::Meshless),
        other => Err(format!("`{other}`: expected `hyper` or `meshless`")),
    }
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    let exe = std::env::current_exe().context("locating the meshless binary")?;
    let rt = crate::serve::runtime(None)?;
    match cmd {
        BenchCommand::Distribution(a) => {
            let settings = DistributionBenchSettings {
                exe,
                subscribers: a.subscribers,
                endpoints: a.endpoints,
                slice_size: a.slice_size,
                changes: a.changes,
                change_gap_ms: a.change_gap_ms,
                writers: a.writers,
                proxy_policies: a.proxy_policies,
                proxy_merge_window_ms: a.proxy_merge_window_ms,
                stream_batch: a.stream_batch,
                stream_interval_ms: a.stream_interval_ms,
                subset_size: a.subset_size,
                zone_aware: a.zone_aware,
                ack_every_delta: a.ack_every_delta,
            };
            let report = rt.block_on(meshless_bench::distribution::run(&settings))?;
            crate::simulate::print(a.json, &report)
        }
        BenchCommand::Coldstart(a) => {
            let settings = ColdstartSettings {
                exe,
                startup_delay: a.startup_delay,
                runs: a.runs,
                burst: a.burst,
                release_concurrency: a.release_concurrency,
                client: a.client,
                own_runtimes: a.own_runtimes,
                upstream_http1: a.upstream_http1,
            };
            let report = rt.block_on(meshless_bench::coldstart::run(&settings))?;
            crate::simulate::print(a.json, &report)
        }
    }
}
