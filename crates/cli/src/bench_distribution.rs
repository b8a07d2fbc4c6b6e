//! `meshless bench distribution`: a real control plane (a child process)
//! and N real gRPC subscriber streams over 127.0.0.1. Registers E
//! endpoints, applies K single-endpoint changes, then a rolling update that
//! replaces every endpoint, and reports bytes written, bytes per change per
//! subscriber, propagation latency at every subscriber, and the control
//! plane's CPU and memory.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::Args;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use meshless_api::v1::{self, ClientMessage, client_message, server_message};
use meshless_api::{DistributionClient, decode_delta};
use serde::Serialize;
use serde_json::json;
use tokio_stream::wrappers::ReceiverStream;

use crate::progress::Progress;
use crate::report::percentile;

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
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// What the benchmark measured.
#[derive(Debug, Serialize)]
pub struct DistributionReport {
    pub subscribers: usize,
    pub endpoints: usize,
    pub slice_size: usize,
    pub changes: usize,
    /// Delta bytes the control plane wrote to subscribers (its own counter).
    pub bytes_written: u64,
    /// Of those, during the single changes.
    pub bytes_single_changes: u64,
    /// Of those, during the rolling update.
    pub bytes_rolling_update: u64,
    pub bytes_per_change_per_subscriber: f64,
    pub propagation_ms_p50: f64,
    pub propagation_ms_p99: f64,
    pub propagation_ms_max: f64,
    /// Latency samples (change x subscriber).
    pub samples: usize,
    pub control_cpu_seconds: f64,
    pub control_peak_rss_mib: f64,
    pub memory_per_subscriber_bytes: f64,
}

struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Two distinct free ports (both held until both are chosen).
fn free_ports() -> Result<(SocketAddr, SocketAddr)> {
    let a = std::net::TcpListener::bind("127.0.0.1:0")?;
    let b = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok((a.local_addr()?, b.local_addr()?))
}

fn proc_cpu_seconds(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let f: Vec<&str> = s.rsplit_once(')')?.1.split_whitespace().collect();
            let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
            Some(ticks / 100.0)
        })
        .unwrap_or(0.0)
}

fn proc_kb(pid: u32, key: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0.0)
}

type Http = Client<HttpConnector, Full<Bytes>>;

async fn call(
    http: &Http,
    api: SocketAddr,
    method: Method,
    path: &str,
    body: serde_json::Value,
) -> Result<serde_json::Value> {
    let req = Request::builder()
        .method(method)
        .uri(format!("http://{api}{path}"))
        .body(Full::new(Bytes::from(body.to_string())))?;
    let resp = http.request(req).await?;
    let status = resp.status();
    let bytes = resp.into_body().collect().await?.to_bytes();
    if !status.is_success() {
        bail!("{path}: {status}: {}", String::from_utf8_lossy(&bytes));
    }
    Ok(serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null))
}

async fn bytes_sent(http: &Http, api: SocketAddr) -> Result<u64> {
    let req = Request::get(format!("http://{api}/metrics")).body(Full::new(Bytes::new()))?;
    let body = http
        .request(req)
        .await?
        .into_body()
        .collect()
        .await?
        .to_bytes();
    let text = String::from_utf8_lossy(&body);
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix("meshless_control_bytes_sent_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0))
}

fn endpoint(id: &str, i: usize) -> serde_json::Value {
    let zone = ["us-east-1a", "us-east-1b", "us-east-1c"][i % 3];
    json!({
        "id": id,
        "addresses": [format!("10.{}.{}.{}", 244 + (i >> 16) % 8, (i >> 8) & 255, i & 255)],
        "port": 8080,
        "zone": zone,
        "node": format!("ip-10-0-{}-{}.ec2.internal", (i * 7) % 256, (i * 13) % 256),
    })
}

/// Receipt times of tracked endpoints (ids starting with `t-`), per subscriber.
async fn subscriber(grpc: SocketAddr, ready: Arc<AtomicU64>) -> Result<Vec<(String, Instant)>> {
    let mut client = DistributionClient::connect(format!("http://{grpc}")).await?;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(ClientMessage {
        msg: Some(client_message::Msg::Hello(v1::Hello {
            node: "bench".into(),
            zone: "bench".into(),
            services: vec!["bench/svc".into()],
            resume_version: 0,
        })),
    })
    .await?;
    let mut inbound = client.stream(ReceiverStream::new(rx)).await?.into_inner();
    let mut seen = Vec::new();
    loop {
        let msg = match tokio::time::timeout(Duration::from_secs(120), inbound.message()).await {
            Ok(Ok(Some(m))) => m,
            _ => break,
        };
        let now = Instant::now();
        match msg.msg {
            Some(server_message::Msg::SnapshotDone(_)) => {
                ready.fetch_add(1, Ordering::Relaxed);
            }
            Some(server_message::Msg::Delta(b)) => {
                let d = decode_delta(&b)?;
                for e in d.upserted {
                    if e.id.starts_with("t-") {
                        seen.push((e.id, now));
                    }
                }
            }
            _ => {}
        }
    }
    drop(tx);
    Ok(seen)
}

pub fn run(args: DistributionBenchArgs) -> Result<()> {
    if args.subscribers == 0 || args.endpoints == 0 {
        bail!("--subscribers and --endpoints must be at least 1");
    }
    if !(1..=1000).contains(&args.slice_size) {
        bail!("--slice-size: must be 1..=1000");
    }
    crate::report::run_report(args.json, bench(&args), |report| {
        println!("subscribers               {}", report.subscribers);
        println!(
            "endpoints                 {} (slices of {})",
            report.endpoints, report.slice_size
        );
        println!(
            "changes                   {} single + rolling update of {}",
            report.changes, report.endpoints
        );
        println!(
            "bytes written             {} (single changes {}, rolling update {})",
            crate::distribution_model::human(report.bytes_written),
            crate::distribution_model::human(report.bytes_single_changes),
            crate::distribution_model::human(report.bytes_rolling_update)
        );
        println!(
            "bytes/change/subscriber   {:.0}",
            report.bytes_per_change_per_subscriber
        );
        println!(
            "propagation p50/p99/max   {:.2} / {:.2} / {:.2} ms ({} samples)",
            report.propagation_ms_p50,
            report.propagation_ms_p99,
            report.propagation_ms_max,
            report.samples
        );
        println!(
            "control plane CPU         {:.2} s",
            report.control_cpu_seconds
        );
        println!(
            "control plane peak RSS    {:.1} MiB",
            report.control_peak_rss_mib
        );
        println!(
            "memory per subscriber     {:.0} bytes",
            report.memory_per_subscriber_bytes
        );
    })
}

async fn bench(args: &DistributionBenchArgs) -> Result<DistributionReport> {
    let (api, grpc) = free_ports()?;
    let dir: PathBuf =
        std::env::temp_dir().join(format!("meshless-bench-dist-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("control.yaml");
    std::fs::write(
        &config,
        format!(
            "api_address: \"{api}\"\ngrpc_address: \"{grpc}\"\nmax_endpoints_per_slice: {}\nhistory: 100000\nmax_body_bytes: 67108864\n",
            args.slice_size
        ),
    )?;
    let exe = std::env::current_exe().context("locating the meshless binary")?;
    let child = Command::new(exe)
        .args(["control", "--config"])
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting the control plane")?;
    let child = ChildGuard(child);
    let pid = child.0.id();
    let http: Http = Client::builder(TokioExecutor::new()).build_http();
    let start = Instant::now();
    while call(&http, api, Method::GET, "/ready", serde_json::Value::Null)
        .await
        .is_err()
    {
        if start.elapsed() > Duration::from_secs(10) {
            bail!("the control plane did not start");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    call(
        &http,
        api,
        Method::PUT,
        "/v1/services/bench/svc",
        json!({ "ports": [{ "port": 80 }] }),
    )
    .await?;
    for chunk in (0..args.endpoints).collect::<Vec<_>>().chunks(5000) {
        let put: Vec<_> = chunk
            .iter()
            .map(|&i| endpoint(&format!("e-{i}"), i))
            .collect();
        call(
            &http,
            api,
            Method::POST,
            "/v1/services/bench/svc/endpoints",
            json!({ "put": put }),
        )
        .await?;
    }
    let rss_before = proc_kb(pid, "VmRSS:");
    let ready = Arc::new(AtomicU64::new(0));
    let mut subs = Vec::new();
    let mut progress = Progress::new("connecting subscribers", args.subscribers as u64);
    for i in 0..args.subscribers {
        subs.push(tokio::spawn(subscriber(grpc, Arc::clone(&ready))));
        if i % 50 == 49 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        progress.update(i as u64);
    }
    while (ready.load(Ordering::Relaxed) as usize) < args.subscribers {
        if start.elapsed() > Duration::from_secs(120) {
            bail!("subscribers did not all receive their snapshot");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    progress.finish();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rss_connected = proc_kb(pid, "VmRSS:");
    let cpu0 = proc_cpu_seconds(pid);
    let bytes0 = bytes_sent(&http, api).await?;
    // Single changes: one tracked endpoint each.
    let mut sent_at: Vec<(String, Instant)> = Vec::new();
    let mut progress = Progress::new("single changes", args.changes as u64);
    for k in 0..args.changes {
        let id = format!("t-single-{k}");
        let t0 = Instant::now();
        call(
            &http,
            api,
            Method::PUT,
            &format!("/v1/services/bench/svc/endpoints/{id}"),
            endpoint(&id, k),
        )
        .await?;
        sent_at.push((id, t0));
        progress.update(k as u64);
    }
    progress.finish();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let bytes1 = bytes_sent(&http, api).await?;
    // Rolling update: each endpoint replaced by a new one (one write each);
    // every 100th replacement is tracked.
    let mut progress = Progress::new("rolling update", args.endpoints as u64);
    for i in 0..args.endpoints {
        let id = if i % 100 == 0 {
            format!("t-roll-{i}")
        } else {
            format!("n-{i}")
        };
        let t0 = Instant::now();
        let body = json!({ "put": [endpoint(&id, i)], "delete": [format!("e-{i}")] });
        call(
            &http,
            api,
            Method::POST,
            "/v1/services/bench/svc/endpoints",
            body,
        )
        .await?;
        if id.starts_with("t-") {
            sent_at.push((id, t0));
        }
        progress.update(i as u64);
    }
    progress.finish();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let bytes2 = bytes_sent(&http, api).await?;
    let cpu = proc_cpu_seconds(pid) - cpu0;
    let peak = proc_kb(pid, "VmHWM:");
    drop(child);
    let sent: std::collections::HashMap<String, Instant> = sent_at.into_iter().collect();
    let mut latencies = Vec::new();
    for s in subs {
        for (id, at) in s.await.context("subscriber task")?? {
            if let Some(t0) = sent.get(&id) {
                latencies.push(at.saturating_duration_since(*t0).as_secs_f64() * 1000.0);
            }
        }
    }
    latencies.sort_by(f64::total_cmp);
    let _ = std::fs::remove_dir_all(&dir);
    let total_changes = (args.changes + args.endpoints) as f64;
    Ok(DistributionReport {
        subscribers: args.subscribers,
        endpoints: args.endpoints,
        slice_size: args.slice_size,
        changes: args.changes,
        bytes_written: bytes2 - bytes0,
        bytes_single_changes: bytes1 - bytes0,
        bytes_rolling_update: bytes2 - bytes1,
        bytes_per_change_per_subscriber: (bytes2 - bytes0) as f64
            / total_changes
            / args.subscribers as f64,
        propagation_ms_p50: percentile(&latencies, 0.5),
        propagation_ms_p99: percentile(&latencies, 0.99),
        propagation_ms_max: percentile(&latencies, 1.0),
        samples: latencies.len(),
        control_cpu_seconds: cpu,
        control_peak_rss_mib: peak / 1024.0,
        memory_per_subscriber_bytes: (rss_connected - rss_before) * 1024.0
            / args.subscribers as f64,
    })
}
