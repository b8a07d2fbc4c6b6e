//! `meshless proxy`, `meshless backend` and `meshless demo`: the commands
//! that run servers until told to stop.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use meshless_backend::{Backend, BackendConfig};
use meshless_control::config::ControlConfig;
use meshless_control::plane::ControlPlane;
use meshless_proxy::{Proxy, ProxyConfig};
use serde::Deserialize;
use tokio::signal::unix::{SignalKind, signal};

/// Arguments of `meshless proxy`.
#[derive(Debug, Args)]
pub struct ProxyArgs {
    /// YAML configuration file (see docs/config.md).
    #[arg(long)]
    pub config: PathBuf,
    /// Validate the file and exit: 0 when valid.
    #[arg(long)]
    pub check: bool,
    /// Reload when the file changes (checked every 500 ms), as well as on SIGHUP.
    #[arg(long)]
    pub watch: bool,
    /// Worker threads of the runtime; default: the number of cores.
    #[arg(long)]
    pub threads: Option<usize>,
}

/// Arguments of `meshless backend`.
#[derive(Debug, Args)]
pub struct BackendArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:9101")]
    pub listen: SocketAddr,
    /// Name reported in `x-backend` and in response bodies.
    #[arg(long, default_value = "backend")]
    pub name: String,
    /// Milliseconds added to every answer.
    #[arg(long, default_value_t = 0)]
    pub latency: u64,
    /// Share of requests (0.0..=1.0) answered 500 at random.
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,
    /// Wait this long before binding, like a slow-starting instance: `200ms`, `2s`.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
    pub startup_delay: Duration,
}

/// The async runtime: one thread runs everything with `--threads 1` (no
/// cross-thread scheduling, as a single HAProxy or nginx worker does);
/// otherwise a work-stealing pool of `threads` workers (default: cores).
fn runtime(threads: Option<usize>) -> Result<tokio::runtime::Runtime> {
    let mut b = match threads {
        Some(0) => bail!("--threads: must be at least 1"),
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    b.enable_all().build().context("starting the runtime")
}

/// Resolves on SIGTERM or SIGINT.
async fn terminated() -> Result<()> {
    let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}

pub fn proxy(args: ProxyArgs) -> Result<()> {
    let config = ProxyConfig::load(&args.config)?;
    if args.check {
        println!("{}: ok", args.config.display());
        return Ok(());
    }
    runtime(args.threads)?.block_on(run_proxy(config, &args.config, args.watch))
}

async fn run_proxy(config: ProxyConfig, path: &Path, watch: bool) -> Result<()> {
    let proxy = Proxy::start(config).await?;
    let mut hup = signal(SignalKind::hangup()).context("installing SIGHUP handler")?;
    let mut seen = std::fs::read(path).ok();
    let mut poll = tokio::time::interval(Duration::from_millis(500));
    let stop = terminated();
    tokio::pin!(stop);
    loop {
        let reload = tokio::select! {
            r = &mut stop => { r?; break; }
            _ = hup.recv() => true,
            _ = poll.tick(), if watch => {
                let now = std::fs::read(path).ok();
                let changed = now.is_some() && now != seen;
                if changed { seen = now; }
                changed
            }
        };
        if reload {
            match ProxyConfig::load(path) {
                Ok(c) => {
                    let _ = proxy.reload(c).await;
                }
                Err(e) => {
                    tracing::error!(error = %e, "reload rejected; the running configuration stays");
                    proxy
                        .state()
                        .metrics
                        .reloads
                        .get_or_create(&meshless_proxy::metrics::ReloadLabels {
                            result: "failure".into(),
                        })
                        .inc();
                }
            }
        }
    }
    tracing::info!("shutting down: draining in-flight requests");
    proxy.shutdown().await;
    Ok(())
}

pub fn backend(args: BackendArgs) -> Result<()> {
    runtime(Some(1))?.block_on(async {
        let b = Backend::start(BackendConfig {
            name: args.name,
            listen: args.listen,
            latency: Duration::from_millis(args.latency),
            fail_rate: args.fail_rate,
            startup_delay: args.startup_delay,
        })
        .await?;
        tracing::info!(name = b.name(), address = %b.local_addr(), "backend listening");
        terminated().await?;
        b.stop().await;
        Ok(())
    })
}

/// The demo configuration, shipped in the binary.
const DEMO_CONFIG: &str = include_str!("../../../examples/demo.yaml");

/// Arguments of `meshless demo`: the README's fixed ports by default.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Proxy listener.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Admin server.
    #[arg(long, default_value = "127.0.0.1:9901")]
    pub admin: SocketAddr,
    /// The three backends (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "127.0.0.1:9101,127.0.0.1:9102,127.0.0.1:9103"
    )]
    pub backends: Vec<SocketAddr>,
}

pub fn demo(args: &DemoArgs) -> Result<()> {
    // The shipped file names the default addresses; other ones replace them.
    let mut yaml = DEMO_CONFIG
        .replace("127.0.0.1:8080", &args.listen.to_string())
        .replace("127.0.0.1:9901", &args.admin.to_string());
    for (i, addr) in args.backends.iter().enumerate() {
        yaml = yaml.replace(&format!("127.0.0.1:910{}", i + 1), &addr.to_string());
    }
    if args.backends.len() != 3 {
        bail!(
            "--backends: three addresses are needed, got {}",
            args.backends.len()
        );
    }
    let config = ProxyConfig::parse(&yaml, "examples/demo.yaml")?;
    runtime(None)?.block_on(async {
        let mut backends = Vec::new();
        for (addr, name) in args
            .backends
            .iter()
            .zip(["backend-1", "backend-2", "backend-3"])
        {
            let b = Backend::start(BackendConfig {
                name: name.into(),
                listen: *addr,
                latency: Duration::ZERO,
                fail_rate: 0.0,
                startup_delay: Duration::ZERO,
            })
            .await
            .with_context(|| format!("starting {name}"))?;
            backends.push(b);
        }
        let proxy = Proxy::start(config).await?;
        println!("{}", DEMO_HELP);
        terminated().await?;
        proxy.shutdown().await;
        for b in backends {
            b.stop().await;
        }
        Ok(())
    })
}

const DEMO_HELP: &str = "\
meshless demo: proxy on http://127.0.0.1:8080, admin on http://127.0.0.1:9901
backends: backend-1 (127.0.0.1:9101, zone-a), backend-2 (:9102, zone-a), backend-3 (:9103, zone-b)

Balancing per request (round robin), even on one keep-alive connection:
  curl -s http://127.0.0.1:8080/ http://127.0.0.1:8080/ http://127.0.0.1:8080/

Affinity by header, with bounded load (the same user sticks to one backend):
  for i in 1 2 3; do curl -s -H 'x-user: alice' http://127.0.0.1:8080/sticky; done

Ejection of a failing backend (3 consecutive 5xx eject it for 15 s; retries hide the failures):
  curl -s http://127.0.0.1:9103/admin/fail
  for i in $(seq 6); do curl -s http://127.0.0.1:8080/; done
  curl -s http://127.0.0.1:9901/clusters
  curl -s http://127.0.0.1:9103/admin/recover

Lookaside (which backend would serve this key) and metrics:
  curl -s 'http://127.0.0.1:9901/pick?cluster=sticky&key=alice'
  curl -s http://127.0.0.1:9901/metrics | grep meshless_proxy_requests

Ctrl-C stops the demo.";

/// Arguments of `meshless control`.
#[derive(Debug, Args)]
pub struct ControlArgs {
    /// YAML configuration file (see docs/control.md).
    #[arg(long)]
    pub config: PathBuf,
    /// Directory of the embedded store; overrides `data_dir` in the file.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Validate the file and exit: 0 when valid.
    #[arg(long)]
    pub check: bool,
}

pub fn control(args: ControlArgs) -> Result<()> {
    let mut config = ControlConfig::load(&args.config)?;
    if args.data_dir.is_some() {
        config.data_dir = args.data_dir;
    }
    if args.check {
        println!("{}: ok", args.config.display());
        return Ok(());
    }
    runtime(None)?.block_on(async {
        let plane = ControlPlane::start(config).await?;
        terminated().await?;
        plane.shutdown().await;
        Ok(())
    })
}

/// `meshless up`'s file: a control plane, a proxy, and backends to start.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Stack {
    #[serde(default)]
    control: ControlConfig,
    proxy: serde_json::Value,
    #[serde(default)]
    backends: Vec<StackBackend>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StackBackend {
    name: String,
    listen: SocketAddr,
}

/// Arguments of `meshless up`.
#[derive(Debug, Args)]
pub struct UpArgs {
    /// Stack file: `control`, `proxy` and `backends` (see examples/stack.yaml).
    #[arg(long, default_value = "examples/stack.yaml")]
    pub config: PathBuf,
    /// Validate the file and exit: 0 when valid.
    #[arg(long)]
    pub check: bool,
}

pub fn up(args: UpArgs) -> Result<()> {
    let file = args.config.display().to_string();
    let text =
        std::fs::read_to_string(&args.config).with_context(|| format!("{file}: cannot read"))?;
    let stack: Stack = meshless_model::yaml::from_str(&text)
        .map_err(|(path, reason)| anyhow::anyhow!("{file}: {path}: {reason}"))?;
    // The control section goes through the control plane's own validation.
    let control_yaml = serde_json::to_string(&stack.control)?;
    let control = ControlConfig::parse(&control_yaml, &format!("{file} (control)"))?;
    let mut proxy_value = stack.proxy;
    if proxy_value.get("control").is_none()
        && let Some(obj) = proxy_value.as_object_mut()
    {
        obj.insert(
            "control".into(),
            serde_json::json!({ "address": control.grpc_address.to_string() }),
        );
    }
    let proxy = ProxyConfig::parse(
        &serde_json::to_string(&proxy_value)?,
        &format!("{file} (proxy)"),
    )?;
    if args.check {
        println!("{file}: ok");
        return Ok(());
    }
    runtime(None)?.block_on(async {
        let mut backends = Vec::new();
        for b in &stack.backends {
            let started = Backend::start(BackendConfig {
                name: b.name.clone(),
                listen: b.listen,
                latency: Duration::ZERO,
                fail_rate: 0.0,
                startup_delay: Duration::ZERO,
            })
            .await
            .with_context(|| format!("starting backend {}", b.name))?;
            backends.push(started);
        }
        let plane = ControlPlane::start(control).await?;
        let proxy = Proxy::start(proxy).await?;
        println!(
            "meshless up: control plane API http://{} (gRPC {}), proxy admin http://{}",
            plane.api_addr(),
            plane.grpc_addr(),
            proxy.admin_addr()
        );
        terminated().await?;
        proxy.shutdown().await;
        plane.shutdown().await;
        for b in backends {
            b.stop().await;
        }
        Ok(())
    })
}
