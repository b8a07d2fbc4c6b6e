//! The cold-start benchmark: the first response's latency for a service
//! at zero instances, against the time the same backend command takes to
//! accept connections when started directly; and a burst of concurrent
//! requests at zero.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use meshless_control::client::ApiClient;
use meshless_control::config::ControlConfig;
use meshless_control::notify::{NotifyCounters, NotifySocket};
use meshless_control::plane::ControlPlane;
use meshless_proxy::{Proxy, ProxyConfig};
use meshless_sim::progress::Progress;
use serde::Serialize;

use crate::spans::{Phase, Receiver};
use crate::{BenchError, percentile};

type Result<T> = std::result::Result<T, BenchError>;

/// Settings of the cold-start benchmark.
#[derive(Debug, Clone)]
pub struct ColdstartSettings {
    /// The `meshless` binary: its `backend` command is the instance started.
    pub exe: PathBuf,
    /// The backend waits this many milliseconds before it listens.
    pub startup_delay: u64,
    /// Cold starts to measure (at least 1).
    pub runs: usize,
    /// Concurrent requests of the burst at zero (0 skips it).
    pub burst: usize,
    /// The proxy's `activation.release_concurrency` (`None`: its default).
    pub release_concurrency: Option<u32>,
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
    /// The instance's spawn to its `READY=1` (the same spawns).
    pub baseline_notify_ms_p50: f64,
    /// First response minus spawn-to-`READY=1`, per run: the overhead
    /// without the baseline's polling (1-2 ms periods).
    pub overhead_notify_ms_p50: f64,
    pub overhead_notify_ms_p99: f64,
    pub overhead_notify_ms_max: f64,
    /// The same spawn's start (from the spawn call to the scaler seeing
    /// `READY=1`), as the control plane recorded it, p50.
    pub paired_instance_ms_p50: f64,
    /// Per run: the first response minus its own instance's start (spawn
    /// to `READY=1`): what the path added around that instance, without
    /// the jitter of a second, independent spawn.
    pub paired_overhead_ms_p50: f64,
    pub paired_overhead_ms_p99: f64,
    pub paired_overhead_ms_max: f64,
    /// The paired overhead phase by phase (each run's own instants).
    pub paired_phases: Vec<Phase>,
    pub burst_requests: usize,
    pub burst_failures: usize,
    /// Failed burst requests by status and body (or client error).
    pub burst_failure_reasons: BTreeMap<String, usize>,
    /// Retries the proxy made during the burst (`proxy_retries`).
    pub burst_retries: f64,
    /// Released requests that connected again to their fresh instance
    /// (`activations_total{result="reconnected"}`).
    pub burst_reconnects: f64,
    pub burst_instances_started: usize,
    pub burst_latency_ms_p99: f64,
    /// Burst requests that took over 1 s (a dropped SYN is retransmitted
    /// after 1 s: the sign of an overflowing accept queue).
    pub burst_over_1s: usize,
    /// The proxy's spans of the measured cold starts, phase by phase.
    pub phases: Vec<Phase>,
}

/// The cold-start spans of the proxy, in the order of a cold start
/// (each measured from its own start: see docs/control.md).
const PHASES: [&str; 6] = [
    "activation.sent",
    "instance.announced",
    "instance.ready",
    "activation.held",
    "upstream.response",
    "proxy request",
];

fn command(exe: &std::path::Path, delay: u64) -> Vec<String> {
    vec![
        exe.display().to_string(),
        "backend".into(),
        "--listen".into(),
        "127.0.0.1:{port}".into(),
        "--name".into(),
        "cold".into(),
        "--startup-delay".into(),
        format!("{delay}ms"),
    ]
}

/// The instance's own start, from its spawn: to its port accepting
/// (probed every 1 ms, as before: Tokio's timer makes that 1-2 ms, so
/// this is up to ~1 ms late), and to its `READY=1` on `NOTIFY_SOCKET`
/// (an event: what the process scaler uses, sent once it listens).
#[derive(Debug, Clone, Copy)]
struct Baseline {
    listening: Duration,
    notified: Duration,
}

/// Names of the paired phases, in the order of a cold start.
const PAIRED: [&str; 4] = [
    "request -> activation read",
    "activation read -> spawn",
    "spawn -> READY=1 (instance)",
    "READY=1 -> response",
];

/// One cold start's instants: the request sent and answered (the
/// benchmark's), and its instance's start (the control plane's record,
/// same process, same clock).
#[derive(Debug, Clone, Copy)]
struct Paired {
    sent: Instant,
    answered: Instant,
    asked: Option<Instant>,
    spawning: Instant,
    ready: Instant,
}

impl Paired {
    /// The instance's own start, ms.
    fn instance_ms(&self) -> f64 {
        between(self.ready, self.spawning)
    }

    /// What the path added around the instance's start, ms: the response
    /// time minus the instance's own start. Below the time before the
    /// spawn when the proxy's probe found the instance listening before
    /// it said `READY=1` (the last phase is then negative).
    fn overhead_ms(&self) -> f64 {
        between(self.answered, self.sent) - self.instance_ms()
    }

    /// The phases of [`PAIRED`], ms (`NaN` where the start was not asked
    /// for by an activation); they add up to the response time.
    fn phases_ms(&self) -> [f64; 4] {
        [
            self.asked.map_or(f64::NAN, |a| between(a, self.sent)),
            self.asked.map_or(f64::NAN, |a| between(self.spawning, a)),
            between(self.ready, self.spawning),
            between(self.answered, self.ready),
        ]
    }
}

/// `later - earlier` in ms, negative when `later` is earlier.
fn between(later: Instant, earlier: Instant) -> f64 {
    match later.checked_duration_since(earlier) {
        Some(d) => ms(d),
        None => -ms(earlier - later),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The start of the one instance of `bench/cold` the plane recorded
/// (waited for: the proxy's own probe may have released the request
/// before the scaler read `READY=1`).
async fn instance_start(plane: &ControlPlane) -> Result<meshless_control::starts::InstanceStart> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = plane
            .state
            .starts
            .list()
            .into_iter()
            .find(|s| s.service == "bench/cold");
        match found {
            Some(start) => return Ok(start),
            None if Instant::now() > deadline => {
                return Err(BenchError::Failed(
                    "the control plane recorded no instance start within 10 s".into(),
                ));
            }
            None => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
}

/// p50 and p99 of each paired phase over `runs`.
fn paired_phases(runs: &[Paired]) -> Vec<Phase> {
    PAIRED
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut v: Vec<f64> = runs
                .iter()
                .map(|r| r.phases_ms()[i])
                .filter(|x| !x.is_nan())
                .collect();
            v.sort_by(f64::total_cmp);
            Phase {
                name: (*name).to_owned(),
                count: v.len(),
                p50_ms: percentile(&v, 0.5),
                p99_ms: percentile(&v, 0.99),
            }
        })
        .collect()
}

/// Spawns the command once and times its start both ways.
async fn baseline(cmd: &[String]) -> Result<Baseline> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(BenchError::io("choosing a free port"))?
        .port();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let args: Vec<String> = cmd[1..]
        .iter()
        .map(|a| a.replace("{port}", &port.to_string()))
        .collect();
    let mut notify = NotifySocket::bind(NotifyCounters::default())
        .map_err(BenchError::io("binding a notification socket"))?;
    let start = Instant::now();
    let mut child = tokio::process::Command::new(&cmd[0])
        .args(&args)
        .env("RUST_LOG", "warn")
        .env("NOTIFY_SOCKET", notify.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(BenchError::io("starting the backend"))?;
    let (mut listening, mut notified) = (None, None);
    while listening.is_none() || notified.is_none() {
        if start.elapsed() > Duration::from_secs(30) {
            return Err(BenchError::Failed(
                "the backend did not listen and notify within 30 s".into(),
            ));
        }
        if listening.is_none() && tokio::net::TcpStream::connect(addr).await.is_ok() {
            listening = Some(start.elapsed());
            continue;
        }
        tokio::select! {
            () = notify.ready(), if notified.is_none() => notified = Some(start.elapsed()),
            () = tokio::time::sleep(Duration::from_millis(1)), if listening.is_none() => {}
        }
    }
    let _ = child.kill().await;
    Ok(Baseline {
        listening: listening.unwrap_or_default(),
        notified: notified.unwrap_or_default(),
    })
}

/// A control plane with service bench/cold at zero and a proxy in front.
async fn stack(
    cmd: &[String],
    target: u32,
    max: u32,
    otlp: Option<&str>,
    release: Option<u32>,
) -> Result<(ControlPlane, Proxy, SocketAddr)> {
    let release = release.map_or_else(String::new, |n| format!(", release_concurrency: {n}"));
    let tracing = otlp.map_or_else(String::new, |url| {
        format!("tracing: {{ otlp_endpoint: \"{url}\", flush_interval: 20ms }}\n")
    });
    let cmd = serde_json::to_string(cmd).map_err(|e| BenchError::Failed(e.to_string()))?;
    let control = ControlConfig::parse(
        &format!(
            "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\nservices:\n  - namespace: bench\n    name: cold\n    autoscaling:\n      min_instances: 0\n      max_instances: {max}\n      target_concurrency: {target}\n      target_utilization: 1.0\n      tick: 100ms\n      scaler:\n        process: {{ command: {cmd}, env: {{ RUST_LOG: warn }}, start_timeout: 30s }}\n"
        ),
        "bench",
    )?;
    let plane = ControlPlane::start(control).await?;
    let proxy = ProxyConfig::parse(
        &format!(
            "{tracing}admin: {{ address: \"127.0.0.1:0\" }}\ncontrol: {{ address: \"{}\" }}\nlisteners:\n  - {{ name: web, address: \"127.0.0.1:0\", routes: [{{ cluster: cold }}] }}\nclusters:\n  - name: cold\n    service: bench/cold\n    balancer: {{ policy: least_request }}\n    activation: {{ queue_timeout: 60s{release} }}\n    circuit_breakers: {{ max_requests: 100000, max_pending: 100000, max_connections: 100000 }}\n",
            plane.grpc_addr()
        ),
        "bench",
    )?;
    let proxy = Proxy::start(proxy).await?;
    let addr = proxy
        .listener_addr("web")
        .await
        .ok_or_else(|| BenchError::Failed("the proxy has no listener `web`".into()))?;
    // Let the proxy subscribe before the first request.
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok((plane, proxy, addr))
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

async fn get(client: &HttpClient, addr: SocketAddr) -> Result<u16> {
    Ok(get_text(client, addr, "/").await?.0)
}

/// Status and body of `GET http://addr{path}`.
async fn get_text(client: &HttpClient, addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let req = http::Request::get(format!("http://{addr}{path}"))
        .body(Full::new(Bytes::new()))
        .map_err(|e| BenchError::Failed(e.to_string()))?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| BenchError::Failed(format!("GET http://{addr}{path}: {e}")))?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// The sum of the samples of a Prometheus text page whose line starts
/// with `prefix`.
fn metric_sum(page: &str, prefix: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}

/// What the burst at zero measured.
#[derive(Debug, Default)]
struct Burst {
    latency_ms: Vec<f64>,
    failures: BTreeMap<String, usize>,
    retries: f64,
    reconnects: f64,
    started: usize,
}

/// `args.burst` concurrent requests to a fresh stack at zero (up to 20
/// instances).
async fn run_burst(cmd: &[String], client: &HttpClient, args: &ColdstartSettings) -> Result<Burst> {
    let n = args.burst;
    let (plane, proxy, addr) = stack(cmd, 10, 20, None, args.release_concurrency).await?;
    let mut tasks = Vec::with_capacity(n);
    for _ in 0..n {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let got = get_text(&client, addr, "/").await;
            (got, t.elapsed().as_secs_f64() * 1000.0)
        }));
    }
    let mut burst = Burst::default();
    for t in tasks {
        let (got, ms) = t
            .await
            .map_err(|e| BenchError::Failed(format!("burst request: {e}")))?;
        let failure = match got {
            Ok((200, _)) => None,
            Ok((status, body)) => Some(format!("{status} {}", body.trim())),
            Err(e) => Some(e.to_string()),
        };
        if let Some(reason) = failure {
            *burst.failures.entry(reason).or_default() += 1;
        }
        burst.latency_ms.push(ms);
    }
    let (_, metrics) = get_text(client, proxy.admin_addr(), "/metrics").await?;
    burst.retries = metric_sum(&metrics, "meshless_proxy_retries_total");
    burst.reconnects = metric_sum(
        &metrics,
        "meshless_proxy_activations_total{result=\"reconnected\"}",
    );
    let view = ApiClient::new(plane.api_addr())
        .service("bench/cold")
        .await?;
    burst.started = view.endpoints.len();
    proxy.shutdown().await;
    plane.shutdown().await;
    Ok(burst)
}

impl fmt::Display for ColdstartReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "startup delay             {} ms, {} runs",
            self.startup_delay_ms, self.runs
        )?;
        write!(
            f,
            "\nfirst response p50        {:.1} ms (baseline: spawn to listening {:.1} ms)",
            self.first_response_ms_p50, self.baseline_ms_p50
        )?;
        write!(
            f,
            "\noverhead p50/p99/max      {:.1} / {:.1} / {:.1} ms",
            self.overhead_ms_p50, self.overhead_ms_p99, self.overhead_ms_max
        )?;
        write!(
            f,
            "\nagainst READY=1           {:.1} ms baseline; overhead p50/p99/max {:.1} / {:.1} / {:.1} ms",
            self.baseline_notify_ms_p50,
            self.overhead_notify_ms_p50,
            self.overhead_notify_ms_p99,
            self.overhead_notify_ms_max
        )?;
        write!(
            f,
            "\npaired (same spawn)       instance spawn to READY=1 p50 {:.1} ms; overhead p50/p99/max {:.2} / {:.2} / {:.2} ms",
            self.paired_instance_ms_p50,
            self.paired_overhead_ms_p50,
            self.paired_overhead_ms_p99,
            self.paired_overhead_ms_max
        )?;
        for p in &self.paired_phases {
            write!(
                f,
                "\n  {:<30} p50/p99 {:.2} / {:.2} ms",
                p.name, p.p50_ms, p.p99_ms
            )?;
        }
        for p in &self.phases {
            write!(
                f,
                "\nspan {:<20} p50/p99 {:.2} / {:.2} ms ({} spans)",
                p.name, p.p50_ms, p.p99_ms, p.count
            )?;
        }
        if self.burst_requests > 0 {
            write!(
                f,
                "\nburst at zero             {} requests: {} failed, {} instances started, p99 {:.1} ms",
                self.burst_requests,
                self.burst_failures,
                self.burst_instances_started,
                self.burst_latency_ms_p99
            )?;
            write!(
                f,
                ", {} over 1 s, {} retries, {} reconnects",
                self.burst_over_1s, self.burst_retries, self.burst_reconnects
            )?;
            for (reason, n) in &self.burst_failure_reasons {
                write!(f, "\n  failed {n:>5}  {reason}")?;
            }
        }
        Ok(())
    }
}

/// Runs the benchmark: `runs` cold starts, then the burst.
pub async fn run(args: &ColdstartSettings) -> Result<ColdstartReport> {
    if args.runs == 0 {
        return Err(BenchError::Setting {
            flag: "runs",
            reason: "must be at least 1".into(),
        });
    }
    let cmd = command(&args.exe, args.startup_delay);
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(2000)
        .build_http();
    let mut first = Vec::new();
    let mut base = Vec::new();
    let mut overhead = Vec::new();
    let mut base_notify = Vec::new();
    let mut overhead_notify = Vec::new();
    let mut paired: Vec<Paired> = Vec::new();
    let (receiver, otlp) = Receiver::start().await?;
    let mut progress = Progress::new("cold starts", args.runs as u64);
    for run in 0..args.runs {
        let own = baseline(&cmd).await?;
        let b = own.listening.as_secs_f64() * 1000.0;
        let bn = own.notified.as_secs_f64() * 1000.0;
        let (plane, proxy, addr) =
            stack(&cmd, 10, 5, Some(&otlp), args.release_concurrency).await?;
        let start = Instant::now();
        let status = get(&client, addr).await?;
        let answered = Instant::now();
        let f = ms(answered - start);
        if status != 200 {
            return Err(BenchError::Failed(format!(
                "cold start {run}: status {status}"
            )));
        }
        let own = instance_start(&plane).await?;
        paired.push(Paired {
            sent: start,
            answered,
            asked: own.asked,
            spawning: own.spawning,
            ready: own.ready,
        });
        proxy.shutdown().await;
        plane.shutdown().await;
        first.push(f);
        base.push(b);
        overhead.push(f - b);
        base_notify.push(bn);
        overhead_notify.push(f - bn);
        progress.update(run as u64 + 1);
    }
    progress.finish();
    // Spans are exported in the background: give them a moment to arrive.
    let deadline = Instant::now() + Duration::from_secs(5);
    while receiver.count("proxy request") < args.runs && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let phases = receiver.phases(&PHASES);
    let mut burst = Burst::default();
    if args.burst > 0 {
        burst = run_burst(&cmd, &client, args).await?;
    }
    let mut burst_latency = std::mem::take(&mut burst.latency_ms);
    let mut paired_overhead: Vec<f64> = paired.iter().map(Paired::overhead_ms).collect();
    let mut paired_instance: Vec<f64> = paired.iter().map(Paired::instance_ms).collect();
    for v in [
        &mut paired_overhead,
        &mut paired_instance,
        &mut first,
        &mut base,
        &mut overhead,
        &mut base_notify,
        &mut overhead_notify,
        &mut burst_latency,
    ] {
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
        baseline_notify_ms_p50: percentile(&base_notify, 0.5),
        overhead_notify_ms_p50: percentile(&overhead_notify, 0.5),
        overhead_notify_ms_p99: percentile(&overhead_notify, 0.99),
        overhead_notify_ms_max: percentile(&overhead_notify, 1.0),
        paired_instance_ms_p50: percentile(&paired_instance, 0.5),
        paired_overhead_ms_p50: percentile(&paired_overhead, 0.5),
        paired_overhead_ms_p99: percentile(&paired_overhead, 0.99),
        paired_overhead_ms_max: percentile(&paired_overhead, 1.0),
        paired_phases: paired_phases(&paired),
        burst_requests: args.burst,
        burst_failures: burst.failures.values().sum(),
        burst_failure_reasons: burst.failures,
        burst_retries: burst.retries,
        burst_reconnects: burst.reconnects,
        burst_instances_started: burst.started,
        burst_latency_ms_p99: percentile(&burst_latency, 0.99),
        burst_over_1s: burst_latency.iter().filter(|ms| **ms > 1000.0).count(),
        phases,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_paired_overhead_is_the_time_around_the_instances_own_start() {
        let sent = Instant::now();
        let at = |ms: u64| sent + Duration::from_millis(ms);
        let p = Paired {
            sent,
            asked: Some(at(2)),
            spawning: at(3),
            ready: at(210),
            answered: at(212),
        };
        assert_eq!(p.instance_ms(), 207.0);
        assert_eq!(p.overhead_ms(), 5.0);
        assert_eq!(p.phases_ms(), [2.0, 1.0, 207.0, 2.0]);
        // The phases cover the request: overhead plus the instance's start.
        let sum: f64 = p.phases_ms().iter().sum();
        assert_eq!(sum, ms(p.answered - p.sent));
        let unasked = Paired { asked: None, ..p };
        assert!(unasked.phases_ms()[0].is_nan() && unasked.phases_ms()[1].is_nan());
        assert_eq!(unasked.overhead_ms(), 5.0);
        // Answered (through the proxy's probe) before READY=1 was read.
        let early = Paired {
            answered: at(209),
            ..p
        };
        assert_eq!(early.phases_ms()[3], -1.0);
        assert_eq!(early.overhead_ms(), 2.0);
    }
}
