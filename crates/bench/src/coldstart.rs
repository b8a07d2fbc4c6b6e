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
    /// How the measured requests are sent.
    pub client: ClientKind,
    /// Worker threads of a runtime of their own for the control plane and
    /// one for the proxy (as separate processes would have); 0: both share
    /// the benchmark's runtime.
    pub own_runtimes: usize,
    /// The proxy's HTTP/1.1 connections to the instance
    /// (`clusters[].http1`).
    pub upstream_http1: UpstreamHttp1,
}

/// The proxy's upstream HTTP/1.1 client in the benchmark
/// (`clusters[].http1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamHttp1 {
    /// hyper's client: a connection task per upstream connection.
    Hyper,
    /// meshless's own connection, driven by the request's task (the
    /// proxy's default).
    #[default]
    Meshless,
}

impl UpstreamHttp1 {
    fn name(self) -> &'static str {
        match self {
            Self::Hyper => "hyper",
            Self::Meshless => "meshless",
        }
    }
}

/// The client of the measured cold starts (not part of the system: the
/// figures of the two are not comparable with each other).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientKind {
    /// hyper's pooling client (`hyper_util` legacy `Client`): a connection
    /// task of its own between the benchmark and the socket.
    Hyper,
    /// One HTTP/1.1 request written on a fresh `TcpStream` by the
    /// benchmark's own task, the response read there.
    Raw,
    /// One HTTP/1.1 request written on a connection opened (and accepted
    /// by the proxy) before the clock starts, by a task of the runtime,
    /// which reads the response: as a client with a kept-alive connection
    /// to its node's proxy sends it. The figure leaves out the client's
    /// own TCP connect and the hand-offs between the benchmark's main
    /// thread and the runtime's workers, which a warm request pays too.
    Open,
}

/// What the benchmark measured (milliseconds).
#[derive(Debug, Serialize)]
pub struct ColdstartReport {
    pub startup_delay_ms: u64,
    pub runs: usize,
    pub client: ClientKind,
    pub own_runtimes: usize,
    pub upstream_http1: UpstreamHttp1,
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
    /// The same client's next request of each run, once the instance is
    /// up (not held): what a request pays through this client and the
    /// proxy without a cold start, for comparison.
    pub warm_ms_p50: f64,
    pub warm_ms_p99: f64,
    /// The paired overhead phase by phase (each run's own instants).
    pub paired_phases: Vec<Phase>,
    /// Every run in the order it ran: its paired overhead and its phases
    /// (ms, in the order of `paired_phases`; `null` for a missing
    /// instant), so the slowest runs can be told apart.
    pub paired_runs: Vec<PairedRun>,
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

/// One run's paired overhead and phases (ms), for `--json`.
#[derive(Debug, Serialize)]
pub struct PairedRun {
    pub overhead_ms: f64,
    pub phases_ms: Vec<Option<f64>>,
}

/// Names of the paired phases, in the order of a cold start.
const PAIRED: [&str; 6] = [
    "request -> Activate read",
    "Activate read -> loop woke",
    "loop woke -> spawn",
    "spawn -> READY=1 (instance)",
    "READY=1 -> ready published",
    "published -> response",
];

/// One cold start's instants: the request sent and answered (the
/// benchmark's), and its instance's start (the control plane's record,
/// same process, same clock).
#[derive(Debug, Clone, Copy)]
struct Paired {
    sent: Instant,
    answered: Instant,
    /// The plane's stream read the proxy's `Activate`.
    read: Option<Instant>,
    /// The `Activate` woke the service's scaling loop.
    asked: Option<Instant>,
    spawning: Instant,
    ready: Instant,
    /// The ready endpoint's delta published to the subscribers.
    published: Instant,
}

impl Paired {
    /// The instance's own start, ms.
    fn instance_ms(&self) -> f64 {
        between(self.ready, self.spawning)
    }

    /// What the path added around the instance's start, ms: the response
    /// time minus the instance's own start. Below the time before the
    /// spawn when the proxy's probe found the instance listening before
    /// it said `READY=1` (the last phases are then negative).
    fn overhead_ms(&self) -> f64 {
        between(self.answered, self.sent) - self.instance_ms()
    }

    /// The phases of [`PAIRED`], ms (`NaN` for a phase whose instant is
    /// missing: a start not asked for by an activation); with every
    /// instant present they add up to the response time.
    fn phases_ms(&self) -> [f64; 6] {
        let points = [
            Some(self.sent),
            self.read,
            self.asked,
            Some(self.spawning),
            Some(self.ready),
            Some(self.published),
            Some(self.answered),
        ];
        std::array::from_fn(|i| match (points[i], points[i + 1]) {
            (Some(a), Some(b)) => between(b, a),
            _ => f64::NAN,
        })
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

/// Runs `fut` on `rt` (a runtime of its own) or, without one, here.
async fn on<T: Send + 'static>(
    rt: Option<&tokio::runtime::Handle>,
    fut: impl std::future::Future<Output = T> + Send + 'static,
) -> Result<T> {
    match rt {
        Some(rt) => rt
            .spawn(fut)
            .await
            .map_err(|e| BenchError::Failed(format!("task on its own runtime: {e}"))),
        None => Ok(fut.await),
    }
}

/// Where the control plane and the proxy run: their own runtimes, or the
/// benchmark's (`None`).
#[derive(Clone, Copy)]
struct Runtimes<'a> {
    plane: Option<&'a tokio::runtime::Handle>,
    proxy: Option<&'a tokio::runtime::Handle>,
}

/// The stack of one run: a control plane and a proxy in front.
struct Stack {
    plane: ControlPlane,
    proxy: Proxy,
    addr: SocketAddr,
}

impl Stack {
    /// Stops both, each on its own runtime.
    async fn shutdown(self, rts: Runtimes<'_>) -> Result<()> {
        on(rts.proxy, self.proxy.shutdown()).await?;
        on(rts.plane, self.plane.shutdown()).await
    }
}

/// A control plane with service bench/cold at zero and a proxy in front.
async fn stack(
    cmd: &[String],
    (target, max): (u32, u32),
    otlp: Option<&str>,
    release: Option<u32>,
    upstream_http1: UpstreamHttp1,
    rts: Runtimes<'_>,
) -> Result<Stack> {
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
    let plane = on(rts.plane, ControlPlane::start(control)).await??;
    let proxy = ProxyConfig::parse(
        &format!(
            "{tracing}admin: {{ address: \"127.0.0.1:0\" }}\ncontrol: {{ address: \"{}\" }}\nlisteners:\n  - {{ name: web, address: \"127.0.0.1:0\", routes: [{{ cluster: cold }}] }}\nclusters:\n  - name: cold\n    service: bench/cold\n    http1: {}\n    balancer: {{ policy: least_request }}\n    activation: {{ queue_timeout: 60s{release} }}\n    circuit_breakers: {{ max_requests: 100000, max_pending: 100000, max_connections: 100000 }}\n",
            plane.grpc_addr(),
            upstream_http1.name()
        ),
        "bench",
    )?;
    let proxy = on(rts.proxy, Proxy::start(proxy)).await??;
    let addr = proxy
        .listener_addr("web")
        .await
        .ok_or_else(|| BenchError::Failed("the proxy has no listener `web`".into()))?;
    // Let the proxy subscribe before the first request.
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(Stack { plane, proxy, addr })
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

/// One measured request through `kind`: its status and the instants it
/// was sent and answered.
async fn measured(
    kind: ClientKind,
    client: &HttpClient,
    addr: SocketAddr,
) -> Result<(u16, Instant, Instant)> {
    match kind {
        ClientKind::Hyper => timed(get(client, addr)).await,
        ClientKind::Raw => timed(raw_get(addr)).await,
        ClientKind::Open => open_get(addr).await,
    }
}

/// The status of `request`, with the instants it was sent and answered.
async fn timed(
    request: impl std::future::Future<Output = Result<u16>>,
) -> Result<(u16, Instant, Instant)> {
    let start = Instant::now();
    let status = request.await?;
    Ok((status, start, Instant::now()))
}

/// A failed `GET http://addr/`.
fn get_failed(addr: SocketAddr, what: &str) -> BenchError {
    BenchError::Failed(format!("GET http://{addr}/: {what}"))
}

/// A new connection to `addr`, `TCP_NODELAY` set.
async fn connected(addr: SocketAddr) -> Result<tokio::net::TcpStream> {
    let conn = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| get_failed(addr, &e.to_string()))?;
    conn.set_nodelay(true)
        .map_err(|e| get_failed(addr, &e.to_string()))?;
    Ok(conn)
}

/// Status of `GET http://addr/` sent by this task on a fresh connection
/// (`connection: close`), once the whole response is read.
async fn raw_get(addr: SocketAddr) -> Result<u16> {
    raw_exchange(connected(addr).await?, addr).await
}

/// [`ClientKind::Open`]: status of `GET http://addr/` sent on a
/// connection opened before the clock starts, and the instants it was
/// sent and answered, both taken by the task of the runtime that writes
/// the request and reads the response.
async fn open_get(addr: SocketAddr) -> Result<(u16, Instant, Instant)> {
    let conn = connected(addr).await?;
    // Time for the proxy to accept the connection and wait on it, as on
    // a kept-alive connection.
    tokio::time::sleep(Duration::from_millis(50)).await;
    tokio::spawn(timed(raw_exchange(conn, addr)))
        .await
        .map_err(|e| get_failed(addr, &e.to_string()))?
}

/// Writes `GET /` (`connection: close`) on `conn` and reads the whole
/// response: its status.
async fn raw_exchange(mut conn: tokio::net::TcpStream, addr: SocketAddr) -> Result<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let failed = |what: &str| get_failed(addr, what);
    let req = format!("GET / HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    conn.write_all(req.as_bytes())
        .await
        .map_err(|e| failed(&e.to_string()))?;
    let mut buf = Vec::with_capacity(1024);
    loop {
        if let Some((status, len, head)) = parse_head(&buf)
            && buf.len() >= head + len
        {
            return Ok(status);
        }
        if buf.len() > 1 << 20 {
            return Err(failed("response over 1 MiB"));
        }
        let n = conn
            .read_buf(&mut buf)
            .await
            .map_err(|e| failed(&e.to_string()))?;
        if n == 0 {
            return match parse_head(&buf) {
                Some((status, _, _)) => Ok(status),
                None => Err(failed("closed before a response head")),
            };
        }
    }
}

/// An HTTP/1.1 response head in `buf`: its status, `content-length` (0
/// when absent) and length with the blank line; `None` until complete.
fn parse_head(buf: &[u8]) -> Option<(u16, usize, usize)> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&buf[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let len = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0);
    Some((status, len, end))
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
async fn run_burst(
    cmd: &[String],
    client: &HttpClient,
    args: &ColdstartSettings,
    rts: Runtimes<'_>,
) -> Result<Burst> {
    let n = args.burst;
    let stack = stack(
        cmd,
        (10, 20),
        None,
        args.release_concurrency,
        args.upstream_http1,
        rts,
    )
    .await?;
    let addr = stack.addr;
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
    let (_, metrics) = get_text(client, stack.proxy.admin_addr(), "/metrics").await?;
    burst.retries = metric_sum(&metrics, "meshless_proxy_retries_total");
    burst.reconnects = metric_sum(
        &metrics,
        "meshless_proxy_activations_total{result=\"reconnected\"}",
    );
    let view = ApiClient::new(stack.plane.api_addr())
        .service("bench/cold")
        .await?;
    burst.started = view.endpoints.len();
    stack.shutdown(rts).await?;
    Ok(burst)
}

impl fmt::Display for ColdstartReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "startup delay             {} ms, {} runs",
            self.startup_delay_ms, self.runs
        )?;
        let rts = match self.own_runtimes {
            0 => "one runtime shared by client, proxy and plane".to_owned(),
            n => format!("proxy and plane each on a runtime of {n} worker(s)"),
        };
        write!(f, "\nclient {:?}, {rts}", self.client)?;
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
        write!(
            f,
            "\nwarm request (same client) p50/p99 {:.2} / {:.2} ms",
            self.warm_ms_p50, self.warm_ms_p99
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

/// A runtime for the control plane and one for the proxy, of `threads`
/// workers each (none for 0); shut down in the background when dropped
/// (a runtime dropped in an async context would panic).
struct OwnRuntimes(Option<(tokio::runtime::Runtime, tokio::runtime::Runtime)>);

impl OwnRuntimes {
    fn new(threads: usize) -> Result<Self> {
        if threads == 0 {
            return Ok(Self(None));
        }
        let build = |name: &str| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .thread_name(name)
                .enable_all()
                .build()
                .map_err(BenchError::io("starting a runtime"))
        };
        Ok(Self(Some((build("bench-plane")?, build("bench-proxy")?))))
    }

    fn handles(&self) -> Runtimes<'_> {
        Runtimes {
            plane: self.0.as_ref().map(|(p, _)| p.handle()),
            proxy: self.0.as_ref().map(|(_, p)| p.handle()),
        }
    }
}

impl OwnRuntimes {
    /// Shuts both down and waits for their tasks to be dropped (instances
    /// are killed as their tasks drop them: a process exiting first would
    /// leave them running).
    async fn close(mut self) {
        if let Some((plane, proxy)) = self.0.take() {
            let _ = tokio::task::spawn_blocking(move || {
                plane.shutdown_timeout(Duration::from_secs(5));
                proxy.shutdown_timeout(Duration::from_secs(5));
            })
            .await;
        }
    }
}

impl Drop for OwnRuntimes {
    fn drop(&mut self) {
        if let Some((plane, proxy)) = self.0.take() {
            plane.shutdown_background();
            proxy.shutdown_background();
        }
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
    let mut warm = Vec::new();
    let (receiver, otlp) = Receiver::start().await?;
    let own_rts = OwnRuntimes::new(args.own_runtimes)?;
    let rts = own_rts.handles();
    let mut progress = Progress::new("cold starts", args.runs as u64);
    for run in 0..args.runs {
        let own = baseline(&cmd).await?;
        let b = own.listening.as_secs_f64() * 1000.0;
        let bn = own.notified.as_secs_f64() * 1000.0;
        let stack = stack(
            &cmd,
            (10, 5),
            Some(&otlp),
            args.release_concurrency,
            args.upstream_http1,
            rts,
        )
        .await?;
        let (status, start, answered) = measured(args.client, &client, stack.addr).await?;
        let f = ms(answered - start);
        if status != 200 {
            return Err(BenchError::Failed(format!(
                "cold start {run}: status {status}"
            )));
        }
        let own = instance_start(&stack.plane).await?;
        let (_, warm_start, warm_answered) = measured(args.client, &client, stack.addr).await?;
        warm.push(ms(warm_answered - warm_start));
        paired.push(Paired {
            sent: start,
            answered,
            read: own.read,
            asked: own.asked,
            spawning: own.spawning,
            ready: own.ready,
            published: own.published,
        });
        stack.shutdown(rts).await?;
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
        burst = run_burst(&cmd, &client, args, rts).await?;
    }
    own_rts.close().await;
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
        &mut warm,
    ] {
        v.sort_by(f64::total_cmp);
    }
    Ok(ColdstartReport {
        startup_delay_ms: args.startup_delay,
        runs: args.runs,
        client: args.client,
        own_runtimes: args.own_runtimes,
        upstream_http1: args.upstream_http1,
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
        warm_ms_p50: percentile(&warm, 0.5),
        warm_ms_p99: percentile(&warm, 0.99),
        paired_phases: paired_phases(&paired),
        paired_runs: paired
            .iter()
            .map(|r| PairedRun {
                overhead_ms: r.overhead_ms(),
                phases_ms: r
                    .phases_ms()
                    .iter()
                    .map(|&x| (!x.is_nan()).then_some(x))
                    .collect(),
            })
            .collect(),
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
            read: Some(at(1)),
            asked: Some(at(2)),
            spawning: at(3),
            ready: at(210),
            published: at(211),
            answered: at(213),
        };
        assert_eq!(p.instance_ms(), 207.0);
        assert_eq!(p.overhead_ms(), 6.0);
        assert_eq!(p.phases_ms(), [1.0, 1.0, 1.0, 207.0, 1.0, 2.0]);
        // The phases cover the request: overhead plus the instance's start.
        let sum: f64 = p.phases_ms().iter().sum();
        assert_eq!(sum, ms(p.answered - p.sent));
        let unasked = Paired {
            read: None,
            asked: None,
            ..p
        };
        let phases = unasked.phases_ms();
        assert!(phases[..3].iter().all(|x| x.is_nan()));
        assert_eq!(phases[3..], [207.0, 1.0, 2.0]);
        assert_eq!(unasked.overhead_ms(), 6.0);
        // Answered (through the proxy's probe) before READY=1 was read.
        let early = Paired {
            answered: at(209),
            ..p
        };
        assert_eq!(early.phases_ms()[5], -2.0);
        assert_eq!(early.overhead_ms(), 2.0);
    }
}
