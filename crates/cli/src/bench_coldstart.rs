//! `meshless bench coldstart`: the first response's latency for a service
//! at zero instances, against the time the same backend command takes to
//! accept connections when started directly; and a burst of concurrent
//! requests at zero.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use meshless_control::config::ControlConfig;
use meshless_control::plane::ControlPlane;
use meshless_proxy::{Proxy, ProxyConfig};
use serde::Serialize;

use crate::progress::Progress;
use crate::report::percentile;

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
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// What the benchmark measured (milliseconds).
#[derive(Debug, Serialize)]
pub struct ColdstartReport {
    pub startup_delay_ms: u64,
    pub runs: usize,
    pub first_response_ms_p50: f64,
    pub baseline_ms_p50: f64,
    pub overhead_ms_p50: f64,
    pub overhead_ms_p99: f64,
    pub overhead_ms_max: f64,
    pub burst_requests: usize,
    pub burst_failures: usize,
    pub burst_instances_started: usize,
    pub burst_latency_ms_p99: f64,
}

fn command(delay: u64) -> Result<Vec<String>> {
    let exe = std::env::current_exe().context("locating the meshless binary")?;
    Ok(vec![
        exe.display().to_string(),
        "backend".into(),
        "--listen".into(),
        "127.0.0.1:{port}".into(),
        "--name".into(),
        "cold".into(),
        "--startup-delay".into(),
        format!("{delay}ms"),
    ])
}

/// Time from spawning the command to its port accepting, probed every 1 ms.
async fn baseline(cmd: &[String]) -> Result<Duration> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let args: Vec<String> = cmd[1..]
        .iter()
        .map(|a| a.replace("{port}", &port.to_string()))
        .collect();
    let start = Instant::now();
    let mut child = tokio::process::Command::new(&cmd[0])
        .args(&args)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    loop {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            let took = start.elapsed();
            let _ = child.kill().await;
            return Ok(took);
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!("the backend did not listen within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A control plane with service bench/cold at zero and a proxy in front.
async fn stack(delay: u64, target: u32, max: u32) -> Result<(ControlPlane, Proxy, SocketAddr)> {
    let cmd = serde_json::to_string(&command(delay)?)?;
    let control = ControlConfig::parse(
        &format!(
            "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\nservices:\n  - namespace: bench\n    name: cold\n    autoscaling:\n      min_instances: 0\n      max_instances: {max}\n      target_concurrency: {target}\n      target_utilization: 1.0\n      tick: 100ms\n      scaler:\n        process: {{ command: {cmd}, env: {{ RUST_LOG: warn }}, start_timeout: 30s }}\n"
        ),
        "bench",
    )?;
    let plane = ControlPlane::start(control).await?;
    let proxy = ProxyConfig::parse(
        &format!(
            "admin: {{ address: \"127.0.0.1:0\" }}\ncontrol: {{ address: \"{}\" }}\nlisteners:\n  - {{ name: web, address: \"127.0.0.1:0\", routes: [{{ cluster: cold }}] }}\nclusters:\n  - name: cold\n    service: bench/cold\n    balancer: {{ policy: least_request }}\n    activation: {{ queue_timeout: 60s }}\n    circuit_breakers: {{ max_requests: 100000, max_pending: 100000, max_connections: 100000 }}\n",
            plane.grpc_addr()
        ),
        "bench",
    )?;
    let proxy = Proxy::start(proxy).await?;
    let addr = proxy.listener_addr("web").await.context("listener")?;
    // Let the proxy subscribe before the first request.
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok((plane, proxy, addr))
}

async fn get(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    addr: SocketAddr,
) -> Result<u16> {
    let req = http::Request::get(format!("http://{addr}/")).body(Full::new(Bytes::new()))?;
    let resp = client.request(req).await?;
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await;
    Ok(status)
}

pub fn run(args: ColdstartArgs) -> Result<()> {
    if args.runs == 0 {
        bail!("--runs: must be at least 1");
    }
    crate::report::run_report(args.json, bench(&args), |report| {
        println!(
            "startup delay             {} ms, {} runs",
            report.startup_delay_ms, report.runs
        );
        println!(
            "first response p50        {:.1} ms (baseline: spawn to listening {:.1} ms)",
            report.first_response_ms_p50, report.baseline_ms_p50
        );
        println!(
            "overhead p50/p99/max      {:.1} / {:.1} / {:.1} ms",
            report.overhead_ms_p50, report.overhead_ms_p99, report.overhead_ms_max
        );
        if report.burst_requests > 0 {
            println!(
                "burst at zero             {} requests: {} failed, {} instances started, p99 {:.1} ms",
                report.burst_requests,
                report.burst_failures,
                report.burst_instances_started,
                report.burst_latency_ms_p99
            );
        }
    })
}

async fn bench(args: &ColdstartArgs) -> Result<ColdstartReport> {
    let cmd = command(args.startup_delay)?;
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(2000)
        .build_http();
    let mut first = Vec::new();
    let mut base = Vec::new();
    let mut overhead = Vec::new();
    let mut progress = Progress::new("cold starts", args.runs as u64);
    for run in 0..args.runs {
        let b = baseline(&cmd).await?.as_secs_f64() * 1000.0;
        let (plane, proxy, addr) = stack(args.startup_delay, 10, 5).await?;
        let start = Instant::now();
        let status = get(&client, addr).await?;
        let f = start.elapsed().as_secs_f64() * 1000.0;
        if status != 200 {
            bail!("cold start {run}: status {status}");
        }
        proxy.shutdown().await;
        plane.shutdown().await;
        first.push(f);
        base.push(b);
        overhead.push(f - b);
        progress.update(run as u64 + 1);
    }
    progress.finish();
    let (mut burst_latency, mut failures, mut started) = (Vec::new(), 0, 0);
    if args.burst > 0 {
        let (plane, proxy, addr) = stack(args.startup_delay, 10, 20).await?;
        let mut tasks = Vec::with_capacity(args.burst);
        for _ in 0..args.burst {
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                let t = Instant::now();
                let ok = matches!(get(&client, addr).await, Ok(200));
                (ok, t.elapsed().as_secs_f64() * 1000.0)
            }));
        }
        for t in tasks {
            let (ok, ms) = t.await?;
            if !ok {
                failures += 1;
            }
            burst_latency.push(ms);
        }
        let view = plane
            .state
            .registry
            .lock()
            .map_err(|_| anyhow::anyhow!("registry lock"))?
            .view("bench/cold");
        started = view.map_or(0, |v| v.endpoints.len());
        proxy.shutdown().await;
        plane.shutdown().await;
    }
    for v in [&mut first, &mut base, &mut overhead, &mut burst_latency] {
        v.sort_by(f64::total_cmp);
    }
    Ok(ColdstartReport {
        startup_delay_ms: args.startup_delay,
        runs: args.runs,
        first_response_ms_p50: percentile(&first, 0.5),
        baseline_ms_p50: percentile(&base, 0.5),
        overhead_ms_p50: percentile(&overhead, 0.5),
        overhead_ms_p99: percentile(&overhead, 0.99),
        overhead_ms_max: percentile(&overhead, 1.0),
        burst_requests: args.burst,
        burst_failures: failures,
        burst_instances_started: started,
        burst_latency_ms_p99: percentile(&burst_latency, 0.99),
    })
}
