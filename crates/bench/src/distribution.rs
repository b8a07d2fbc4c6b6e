//! The distribution benchmark: a real control plane (a child process)
//! and N real gRPC subscriber streams over 127.0.0.1. Registers E
//! endpoints, applies K single-endpoint changes (one at a time, a gap
//! apart), then a rolling update that replaces every endpoint back to back,
//! and reports bytes written, bytes per change per subscriber, propagation
//! latency at every subscriber (for the single changes and for the rolling
//! update apart: one change reaching N proxies, and changes queued behind
//! each other), and the control plane's CPU and memory.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use meshless_api::v1::{self, ClientMessage, client_message, server_message};
use meshless_api::{DistributionClient, decode_delta};
use meshless_control::api::{BulkInput, EndpointInput, ServiceInput, ServicePort};
use meshless_control::client::ApiClient;
use meshless_sim::human;
use meshless_sim::progress::Progress;
use serde::Serialize;
use tokio_stream::wrappers::ReceiverStream;

use crate::follower::Follower;
use crate::process::{ChildGuard, free_ports, proc_cpu_seconds, proc_kb};
use crate::writes::WriteBenchReport;
use crate::{BenchError, percentile};

type Result<T> = std::result::Result<T, BenchError>;

/// Settings of the distribution benchmark.
#[derive(Debug, Clone)]
pub struct DistributionBenchSettings {
    /// The `meshless` binary: its `control` command is the control plane measured.
    pub exe: PathBuf,
    /// Subscriber streams (simulated proxies), each its own connection.
    pub subscribers: usize,
    /// Endpoints of the service.
    pub endpoints: usize,
    /// Endpoints per slice, 1..=1000.
    pub slice_size: usize,
    /// Single-endpoint changes before the rolling update.
    pub changes: usize,
    /// Time between the single changes, in milliseconds, so that each is
    /// measured alone (one change reaching every subscriber); 0 sends them
    /// back to back, as the rolling update is.
    pub change_gap_ms: u64,
    /// Concurrent registration clients of the write benchmark
    /// ([`crate::writes`], its own durable control plane) run first; 0 skips it.
    pub writers: usize,
    /// One real proxy process per policy follows the service; their CPU
    /// per change is reported.
    pub proxy_policies: Vec<String>,
    /// The proxies' `update_merge_window` in milliseconds (None: default).
    pub proxy_merge_window_ms: Option<u64>,
    /// The control plane's `stream_batch` (None: its default; 1: one
    /// write per message, as before batching).
    pub stream_batch: Option<usize>,
    /// The control plane's `stream_interval` in milliseconds (None: its
    /// default; 0: no pacing, a write as soon as a delta arrives).
    pub stream_interval_ms: Option<u64>,
    /// Each subscriber asks for a deterministic subset of this many
    /// endpoints (identity `bench-INDEX`); None: every endpoint.
    pub subset_size: Option<u32>,
    /// The subsets are zone-aware (`subset: { zone_aware: true }`): each
    /// subscriber sits in one of the endpoints' three zones, in turn.
    pub zone_aware: bool,
    /// Subscribers acknowledge every delta; otherwise once per heartbeat,
    /// as a meshless proxy does.
    pub ack_every_delta: bool,
}

/// What the benchmark measured.
#[derive(Debug, Serialize)]
pub struct DistributionBenchReport {
    pub subscribers: usize,
    /// Subset size each subscriber asked for (None: every endpoint).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subset_size: Option<u32>,
    /// The subsets were zone-aware (subscribers spread over the zones).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub zone_aware: bool,
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
    /// From a single change's write to its receipt at each subscriber.
    pub single_change: Latency,
    /// From a single change's write to its acknowledgment (the commit,
    /// fsync included): the part of `single_change` before the fan-out.
    pub single_change_write: Latency,
    /// From a tracked replacement's write (every 100th of the rolling
    /// update) to its receipt at each subscriber.
    pub rolling_update: Latency,
    /// Endpoints upserted to the subscribers, all of them together
    /// (snapshots included).
    pub upserts_received: u64,
    /// With zone-aware subsets: the share of those upserts that came from
    /// outside the receiving subscriber's zone (0 while each zone holds at
    /// least the subset size).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub out_of_zone_share: Option<f64>,
    pub control_cpu_seconds: f64,
    /// Messages written to subscribers (deltas and heartbeats).
    pub messages: u64,
    /// Control-plane CPU per message written, in microseconds.
    pub cpu_us_per_message: f64,
    /// Messages per stream write (batch), on average.
    pub messages_per_write: f64,
    pub control_peak_rss_mib: f64,
    pub memory_per_subscriber_bytes: f64,
    /// CPU per change of a real proxy following the service, per policy.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub proxies: Vec<crate::follower::FollowerReport>,
    /// The write benchmark, with `--writers N`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub writes: Option<WriteBenchReport>,
}

/// The zones the bench's endpoints (and zone-aware subscribers) sit in.
const ZONES: [&str; 3] = ["us-east-1a", "us-east-1b", "us-east-1c"];

/// What a subscriber asks for: every endpoint, or a subset.
#[derive(Debug, Clone, Copy)]
struct Ask {
    subset: Option<u32>,
    zone_aware: bool,
}

fn endpoint(id: &str, i: usize) -> EndpointInput {
    let zone = ZONES[i % 3];
    let ip = Ipv4Addr::new(10, 244 + ((i >> 16) % 8) as u8, (i >> 8) as u8, i as u8);
    EndpointInput {
        zone: Some(zone.into()),
        node: Some(format!(
            "ip-10-0-{}-{}.ec2.internal",
            (i * 7) % 256,
            (i * 13) % 256
        )),
        ..EndpointInput::new(id, IpAddr::V4(ip), 8080)
    }
}

/// Receipt times of tracked endpoints (ids starting with `t-`), per subscriber.
/// When a subscriber acknowledges the version it applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Acks {
    /// After every delta.
    EveryDelta,
    /// In answer to each heartbeat, as a meshless proxy does.
    PerHeartbeat,
}

async fn subscriber(
    grpc: SocketAddr,
    ready: Arc<AtomicU64>,
    index: usize,
    ask: Ask,
    acks: Acks,
) -> Result<Receipts> {
    let failed = |e: &dyn fmt::Display| BenchError::Failed(format!("subscriber: {e}"));
    let mut client = DistributionClient::connect(format!("http://{grpc}"))
        .await
        .map_err(|e| failed(&e))?;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(ClientMessage {
        msg: Some(client_message::Msg::Hello(v1::Hello {
            node: "bench".into(),
            zone: if ask.zone_aware {
                ZONES[index % 3].into()
            } else {
                "bench".into()
            },
            services: vec![SERVICE.into()],
            resume_version: 0,
            resume_incarnation: 0,
            peer_address: String::new(),
            subsets: ask
                .subset
                .map(|size| v1::SubsetRequest {
                    service: SERVICE.into(),
                    size,
                    zone_aware: ask.zone_aware,
                    index: None,
                })
                .into_iter()
                .collect(),
            subscriber: format!("bench-{index}"),
            compact: true,
        })),
    })
    .await
    .map_err(|e| failed(&e))?;
    let mut inbound = client
        .stream(ReceiverStream::new(rx))
        .await
        .map_err(|e| failed(&e))?
        .into_inner();
    let mut got = Receipts::default();
    let own_zone = ask.zone_aware.then(|| ZONES[index % 3]);
    let mut applied = 0;
    let ack = |version| ClientMessage {
        msg: Some(client_message::Msg::Ack(v1::Ack { version })),
    };
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
                let d = decode_delta(&b).map_err(|e| failed(&e))?;
                applied = d.version.max(applied);
                for e in d.upserted {
                    got.upserts += 1;
                    if own_zone.is_some_and(|z| e.zone != z) {
                        got.out_of_zone += 1;
                    }
                    if e.id.starts_with("t-") {
                        got.seen.push((e.id, now, d.version));
                    }
                }
                if acks == Acks::EveryDelta {
                    let _ = tx.try_send(ack(applied));
                }
            }
            Some(server_message::Msg::Heartbeat(_)) => {
                let _ = tx.try_send(ack(applied));
            }
            _ => {}
        }
    }
    drop(tx);
    Ok(got)
}

/// Latency percentiles, in milliseconds.
#[derive(Debug, Serialize)]
pub struct Latency {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub samples: usize,
}

impl Latency {
    fn of(mut latencies_ms: Vec<f64>) -> Self {
        latencies_ms.sort_by(f64::total_cmp);
        let p = |q| percentile(&latencies_ms, q);
        Latency {
            p50_ms: p(0.5),
            p99_ms: p(0.99),
            max_ms: p(1.0),
            samples: latencies_ms.len(),
        }
    }
}

impl fmt::Display for Latency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.2} / {:.2} / {:.2} ms ({} samples)",
            self.p50_ms, self.p99_ms, self.max_ms, self.samples
        )
    }
}

impl fmt::Display for DistributionBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.subset_size {
            Some(k) => writeln!(
                f,
                "subscribers               {} ({}subsets of {k})",
                self.subscribers,
                if self.zone_aware { "zone-aware " } else { "" }
            )?,
            None => writeln!(f, "subscribers               {}", self.subscribers)?,
        }
        writeln!(
            f,
            "endpoints                 {} (slices of {})",
            self.endpoints, self.slice_size
        )?;
        writeln!(
            f,
            "changes                   {} single + rolling update of {}",
            self.changes, self.endpoints
        )?;
        writeln!(
            f,
            "bytes written             {} (single changes {}, rolling update {})",
            human(self.bytes_written),
            human(self.bytes_single_changes),
            human(self.bytes_rolling_update)
        )?;
        writeln!(
            f,
            "bytes/change/subscriber   {:.0}",
            self.bytes_per_change_per_subscriber
        )?;
        writeln!(f, "propagation p50/p99/max")?;
        writeln!(f, "  one change              {}", self.single_change)?;
        writeln!(f, "    of which the write    {}", self.single_change_write)?;
        writeln!(f, "  rolling update          {}", self.rolling_update)?;
        if let Some(share) = self.out_of_zone_share {
            writeln!(
                f,
                "upserts from other zones  {:.2}% of {}",
                share * 100.0,
                self.upserts_received
            )?;
        }
        writeln!(
            f,
            "control plane CPU         {:.2} s",
            self.control_cpu_seconds
        )?;
        writeln!(
            f,
            "messages                  {} ({:.1} us CPU each, {:.2} per write)",
            self.messages, self.cpu_us_per_message, self.messages_per_write
        )?;
        writeln!(
            f,
            "control plane peak RSS    {:.1} MiB",
            self.control_peak_rss_mib
        )?;
        write!(
            f,
            "memory per subscriber     {:.0} bytes",
            self.memory_per_subscriber_bytes
        )?;
        for p in &self.proxies {
            write!(
                f,
                "\nproxy CPU per change      {:.3} ms ({})",
                p.cpu_ms_per_change, p.policy
            )?;
        }
        if let Some(w) = &self.writes {
            write!(f, "\n{w}")?;
        }
        Ok(())
    }
}

fn check(args: &DistributionBenchSettings) -> Result<()> {
    let setting = |flag, reason: &str| {
        Err(BenchError::Setting {
            flag,
            reason: reason.into(),
        })
    };
    if args.subscribers == 0 {
        return setting("subscribers", "must be at least 1");
    }
    if args.endpoints == 0 {
        return setting("endpoints", "must be at least 1");
    }
    if !(1..=1000).contains(&args.slice_size) {
        return setting("slice-size", "must be 1..=1000");
    }
    if args.subset_size == Some(0) {
        return setting("subset-size", "must be at least 1");
    }
    if args.zone_aware && args.subset_size.is_none() {
        return setting("zone-aware", "needs --subset-size");
    }
    Ok(())
}

/// The control plane child process, its client and its stream address.
struct Plane {
    child: ChildGuard,
    api: ApiClient,
    grpc: SocketAddr,
    dir: PathBuf,
}

const SERVICE: &str = "bench/svc";

/// The command the control plane runs under, from
/// `MESHLESS_BENCH_PLANE_WRAPPER` split at whitespace (e.g. `valgrind
/// --tool=callgrind`, as `bench/callgrind_distribution.py` sets it); empty:
/// none.
fn plane_wrapper() -> Vec<String> {
    std::env::var("MESHLESS_BENCH_PLANE_WRAPPER")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// Stops the control plane with SIGTERM (its graceful shutdown, after
/// which a profiler it runs under writes its data), waiting up to 60 s;
/// the guard kills it if it is still there.
async fn stop_plane(child: ChildGuard) {
    let pid = child.0.id().to_string();
    let sent = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .is_ok_and(|s| s.success());
    let mut child = child;
    let deadline = Instant::now() + Duration::from_secs(60);
    while sent && Instant::now() < deadline {
        if matches!(child.0.try_wait(), Ok(Some(_)) | Err(_)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(child);
}

/// Starts `meshless control` with the benchmark's settings and waits until ready.
async fn start_plane(args: &DistributionBenchSettings) -> Result<Plane> {
    let (api, grpc) = free_ports()?;
    let dir: PathBuf =
        std::env::temp_dir().join(format!("meshless-bench-dist-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(BenchError::io("creating the work directory"))?;
    let config = dir.join("control.yaml");
    std::fs::write(
        &config,
        format!(
            "api_address: \"{api}\"\ngrpc_address: \"{grpc}\"\nmax_endpoints_per_slice: {}\nhistory: 100000\nmax_body_bytes: 67108864\n{}{}",
            args.slice_size,
            args.stream_batch
                .map(|b| format!("stream_batch: {b}\n"))
                .unwrap_or_default(),
            args.stream_interval_ms
                .map(|ms| format!("stream_interval: {ms}ms\n"))
                .unwrap_or_default()
        ),
    )
    .map_err(BenchError::io("writing the control plane's config"))?;
    let wrapper = plane_wrapper();
    let mut command = match wrapper.split_first() {
        Some((tool, tool_args)) => {
            let mut c = Command::new(tool);
            c.args(tool_args).arg(&args.exe);
            c
        }
        None => Command::new(&args.exe),
    };
    let child = command
        .args(["control", "--config"])
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(BenchError::io("starting the control plane"))?;
    let plane = Plane {
        child: ChildGuard(child),
        api: ApiClient::new(api),
        grpc,
        dir,
    };
    let start = Instant::now();
    // A plane under a profiler starts tens of times slower.
    let patience = Duration::from_secs(if wrapper.is_empty() { 10 } else { 120 });
    while plane.api.ready().await.is_err() {
        if start.elapsed() > patience {
            return Err(BenchError::Failed("the control plane did not start".into()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    plane
        .api
        .put_service(
            SERVICE,
            &ServiceInput {
                ports: vec![ServicePort::tcp(80)],
                ..ServiceInput::default()
            },
        )
        .await?;
    for chunk in (0..args.endpoints).collect::<Vec<_>>().chunks(5000) {
        let put = chunk
            .iter()
            .map(|&i| endpoint(&format!("e-{i}"), i))
            .collect();
        let bulk = BulkInput {
            put,
            delete: Vec::new(),
        };
        plane.api.bulk(SERVICE, &bulk).await?;
    }
    Ok(plane)
}

/// Connects every subscriber and waits until each has its snapshot.
async fn connect(grpc: SocketAddr, n: usize, ask: Ask, acks: Acks) -> Result<Subscribers> {
    let ready = Arc::new(AtomicU64::new(0));
    let mut subs = Vec::new();
    let mut progress = Progress::new("connecting subscribers", n as u64);
    for i in 0..n {
        subs.push(tokio::spawn(subscriber(
            grpc,
            Arc::clone(&ready),
            i,
            ask,
            acks,
        )));
        if i % 50 == 49 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        progress.update(i as u64);
    }
    let start = Instant::now();
    while (ready.load(Ordering::Relaxed) as usize) < n {
        if start.elapsed() > Duration::from_secs(120) {
            return Err(BenchError::Failed(
                "subscribers did not all receive their snapshot".into(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    progress.finish();
    Ok(subs)
}

/// What a subscriber saw: each tracked endpoint's id, when it arrived and
/// the version of its delta.
/// What one subscriber received.
#[derive(Debug, Default)]
struct Receipts {
    /// Receipt times of tracked endpoints (id, instant, delta version).
    seen: Vec<(String, Instant, u64)>,
    /// Endpoints upserted to it (snapshot included).
    upserts: u64,
    /// Of those, endpoints outside its zone (zone-aware subscribers only).
    out_of_zone: u64,
}
/// The subscriber tasks.
type Subscribers = Vec<tokio::task::JoinHandle<Result<Receipts>>>;

/// Ids of the tracked single changes and rolling-update replacements.
const SINGLE: &str = "t-single-";
const ROLLING: &str = "t-roll-";

/// Single changes, one tracked endpoint each, `gap` apart; returns when
/// each was sent.
/// A tracked write: its endpoint id, when it was sent and acknowledged,
/// and the version it was acknowledged at.
struct Write {
    id: String,
    sent: Instant,
    acked: Instant,
    version: u64,
}

impl Write {
    /// A write sent at `sent` and acknowledged now, at `version`.
    fn acknowledged(id: String, sent: Instant, version: u64) -> Self {
        Write {
            id,
            sent,
            acked: Instant::now(),
            version,
        }
    }
}

type Sent = Vec<Write>;

async fn single_changes(api: &ApiClient, changes: usize, gap: Duration) -> Result<Sent> {
    let mut sent_at = Vec::new();
    let mut progress = Progress::new("single changes", changes as u64);
    for k in 0..changes {
        if k > 0 {
            tokio::time::sleep(gap).await;
        }
        let id = format!("{SINGLE}{k}");
        let t0 = Instant::now();
        let v = api.put_endpoint(SERVICE, &endpoint(&id, k)).await?;
        sent_at.push(Write::acknowledged(id, t0, v));
        progress.update(k as u64);
    }
    progress.finish();
    Ok(sent_at)
}

/// Rolling update: each endpoint replaced by a new one (one write each);
/// every 100th replacement is tracked.
async fn rolling_update(api: &ApiClient, endpoints: usize) -> Result<Sent> {
    let mut sent_at = Vec::new();
    let mut progress = Progress::new("rolling update", endpoints as u64);
    for i in 0..endpoints {
        let id = if i % 100 == 0 {
            format!("{ROLLING}{i}")
        } else {
            format!("n-{i}")
        };
        let t0 = Instant::now();
        let bulk = BulkInput {
            put: vec![endpoint(&id, i)],
            delete: vec![format!("e-{i}")],
        };
        let v = api.bulk(SERVICE, &bulk).await?;
        if id.starts_with("t-") {
            sent_at.push(Write::acknowledged(id, t0, v));
        }
        progress.update(i as u64);
    }
    progress.finish();
    Ok(sent_at)
}

/// Delta bytes the control plane has written, from its own counter.
async fn bytes_sent(api: &ApiClient) -> Result<u64> {
    counter(api, "meshless_control_bytes_sent_total").await
}

/// One of the control plane's counters (0 when absent).
async fn counter(api: &ApiClient, name: &str) -> Result<u64> {
    let text = api.metrics().await?;
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64))
}

fn ms_between(from: Instant, to: Instant) -> f64 {
    to.saturating_duration_since(from).as_secs_f64() * 1000.0
}

/// Propagation latencies in milliseconds, of the single changes and of the
/// tracked rolling-update replacements, from each subscriber's receipts.
/// Propagation samples of the single changes and of the rolling update,
/// and the subscribers' receipts summed up.
struct Propagation {
    single: Vec<f64>,
    rolling: Vec<f64>,
    upserts: u64,
    out_of_zone: u64,
}

async fn propagation(subs: Subscribers, sent_at: Sent) -> Result<Propagation> {
    let sent: std::collections::HashMap<String, Write> =
        sent_at.into_iter().map(|w| (w.id.clone(), w)).collect();
    let (mut single, mut rolling) = (Vec::new(), Vec::new());
    let (mut upserts, mut out_of_zone) = (0, 0);
    for s in subs {
        let got = s
            .await
            .map_err(|e| BenchError::Failed(format!("subscriber task: {e}")))??;
        upserts += got.upserts;
        out_of_zone += got.out_of_zone;
        for (id, at, version) in got.seen {
            // Only the write's own delta: with subsets an endpoint may
            // also enter a subset later, when the membership moves.
            let Some(w) = sent.get(&id).filter(|w| version <= w.version) else {
                continue;
            };
            let ms = ms_between(w.sent, at);
            if id.starts_with(SINGLE) {
                single.push(ms);
            } else {
                rolling.push(ms);
            }
        }
    }
    Ok(Propagation {
        single,
        rolling,
        upserts,
        out_of_zone,
    })
}

/// Runs the benchmark.
pub async fn run(args: &DistributionBenchSettings) -> Result<DistributionBenchReport> {
    check(args)?;
    let writes = match args.writers {
        0 => None,
        n => Some(crate::writes::run(&args.exe, n).await?),
    };
    let plane = start_plane(args).await?;
    let pid = plane.child.0.id();
    let rss_before = proc_kb(pid, "VmRSS:");
    let mut proxies = Vec::new();
    for policy in &args.proxy_policies {
        let window = args.proxy_merge_window_ms;
        let f = Follower::start(&args.exe, &plane.dir, plane.grpc, SERVICE, policy, window).await?;
        f.wait_for(&format!("e-{}", args.endpoints - 1)).await?;
        proxies.push(f);
    }
    let acks = if args.ack_every_delta {
        Acks::EveryDelta
    } else {
        Acks::PerHeartbeat
    };
    let ask = Ask {
        subset: args.subset_size,
        zone_aware: args.zone_aware,
    };
    let subs = connect(plane.grpc, args.subscribers, ask, acks).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rss_connected = proc_kb(pid, "VmRSS:");
    proxies.iter_mut().for_each(Follower::mark);
    let cpu0 = proc_cpu_seconds(pid);
    let messages0 = counter(&plane.api, "meshless_control_messages_sent_total").await?;
    let writes0 = counter(&plane.api, "meshless_control_stream_writes_total").await?;
    let bytes0 = bytes_sent(&plane.api).await?;
    let mut sent_at = single_changes(
        &plane.api,
        args.changes,
        Duration::from_millis(args.change_gap_ms),
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let bytes1 = bytes_sent(&plane.api).await?;
    sent_at.extend(rolling_update(&plane.api, args.endpoints).await?);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let bytes2 = bytes_sent(&plane.api).await?;
    let cpu = proc_cpu_seconds(pid) - cpu0;
    let messages = counter(&plane.api, "meshless_control_messages_sent_total").await? - messages0;
    let stream_writes =
        counter(&plane.api, "meshless_control_stream_writes_total").await? - writes0;
    let peak = proc_kb(pid, "VmHWM:");
    let i = args.endpoints - 1;
    let last = if i.is_multiple_of(100) {
        format!("{ROLLING}{i}")
    } else {
        format!("n-{i}")
    };
    let mut followed = Vec::new();
    for p in &proxies {
        p.wait_for(&last).await?;
        followed.push(p.report(args.changes + args.endpoints));
    }
    drop(proxies);
    stop_plane(plane.child).await;
    let writes_ms: Vec<f64> = sent_at
        .iter()
        .filter(|w| w.id.starts_with(SINGLE))
        .map(|w| ms_between(w.sent, w.acked))
        .collect();
    let got = propagation(subs, sent_at).await?;
    let _ = std::fs::remove_dir_all(&plane.dir);
    let total_changes = (args.changes + args.endpoints) as f64;
    Ok(DistributionBenchReport {
        subscribers: args.subscribers,
        subset_size: args.subset_size,
        zone_aware: args.zone_aware,
        endpoints: args.endpoints,
        slice_size: args.slice_size,
        changes: args.changes,
        bytes_written: bytes2 - bytes0,
        bytes_single_changes: bytes1 - bytes0,
        bytes_rolling_update: bytes2 - bytes1,
        bytes_per_change_per_subscriber: (bytes2 - bytes0) as f64
            / total_changes
            / args.subscribers as f64,
        single_change: Latency::of(got.single),
        rolling_update: Latency::of(got.rolling),
        upserts_received: got.upserts,
        out_of_zone_share: args
            .zone_aware
            .then(|| got.out_of_zone as f64 / got.upserts.max(1) as f64),
        single_change_write: Latency::of(writes_ms),
        control_cpu_seconds: cpu,
        messages,
        cpu_us_per_message: cpu * 1e6 / messages.max(1) as f64,
        messages_per_write: messages as f64 / stream_writes.max(1) as f64,
        control_peak_rss_mib: peak / 1024.0,
        memory_per_subscriber_bytes: (rss_connected - rss_before) * 1024.0
            / args.subscribers as f64,
        proxies: followed,
        writes,
    })
}
