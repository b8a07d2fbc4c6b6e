//! `meshless proxy`, `control`, `up`, `backend`, `demo` and `fake-kube`:
//! the commands that run servers until told to stop.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use meshless_backend::{Backend, BackendConfig};
use meshless_control::config::ControlConfig;
use meshless_control::plane::ControlPlane;
use meshless_proxy::config::ControlLink;
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
    /// Unix socket on which this proxy hands its listening sockets to a
    /// new process started with `--takeover` (binary upgrade).
    #[arg(long)]
    pub upgrade_socket: Option<PathBuf>,
    /// Take the listening sockets of the proxy serving `--upgrade-socket`,
    /// start accepting on them, and let that proxy drain and exit.
    #[arg(long, requires = "upgrade_socket")]
    pub takeover: bool,
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
pub fn runtime(threads: Option<usize>) -> Result<tokio::runtime::Runtime> {
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
        // The certificate, key and CA files too, as a start reads them.
        meshless_proxy::proxy::check_files(&config)
            .with_context(|| args.config.display().to_string())?;
        println!("{}: ok", args.config.display());
        return Ok(());
    }
    let rt = runtime(args.threads)?;
    let result = rt.block_on(run_proxy(config, &args));
    // A hand-over abandoned on SIGTERM may still wait (bounded) in a
    // blocking thread: not worth waiting for.
    rt.shutdown_timeout(Duration::from_secs(1));
    result
}

async fn run_proxy(config: ProxyConfig, args: &ProxyArgs) -> Result<()> {
    let path = args.config.as_path();
    // Installed before anything else: a SIGHUP while starting or taking
    // over (which waits for the old process) is a reload once started,
    // not the default action (exit), and SIGTERM/SIGINT are caught.
    let mut hup = signal(SignalKind::hangup()).context("installing SIGHUP handler")?;
    // SIGUSR1 reopens a file access log (logrotate), as with Envoy and nginx.
    let mut usr1 = signal(SignalKind::user_defined1()).context("installing SIGUSR1 handler")?;
    let mut signals = Stop::install()?;
    let proxy = match (&args.upgrade_socket, args.takeover) {
        (Some(socket), true) => crate::upgrade::take_over(config, socket).await?,
        _ => Proxy::start(config).await?,
    };
    let upgrades = match &args.upgrade_socket {
        Some(socket) => Some(crate::upgrade::listen(socket, args.takeover)?),
        None => None,
    };
    let mut seen = watched_files(path);
    let mut poll = tokio::time::interval(Duration::from_millis(500));
    // A hand-over runs beside the signals: SIGTERM/SIGINT abort it, and a
    // reload asked meanwhile waits for its end (applied if it failed).
    let mut handing: Option<std::pin::Pin<Box<dyn Future<Output = bool> + Send + '_>>> = None;
    let mut reload_pending = false;
    loop {
        let reload = tokio::select! {
            () = signals.next() => {
                if handing.take().is_some() {
                    tracing::warn!("upgrade: hand-over abandoned on SIGTERM/SIGINT");
                }
                break;
            }
            _ = hup.recv() => true,
            _ = usr1.recv() => {
                if let Err(e) = proxy.reopen_access_log() {
                    tracing::error!(error = %e, "cannot reopen the access log; writing on to the open file");
                }
                false
            }
            _ = poll.tick(), if args.watch => {
                let now = watched_files(path);
                let changed = now.is_some() && now != seen;
                if changed { seen = now; }
                changed
            }
            stream = crate::upgrade::accept(upgrades.as_ref()), if handing.is_none() => {
                if stream.is_some() {
                    handing = Some(Box::pin(crate::upgrade::hand_over(&proxy, stream)));
                }
                false
            }
            handed = async {
                match handing.as_mut() {
                    Some(h) => h.await,
                    None => std::future::pending().await,
                }
            }, if handing.is_some() => {
                handing = None;
                if handed {
                    return drain_or_cut(proxy.shutdown_handed_over(), &mut signals).await;
                }
                std::mem::take(&mut reload_pending)
            }
        };
        if reload && handing.is_some() {
            // The hand-over holds the reload lock; applied after it fails
            // (when it succeeds, the new process has its own config).
            reload_pending = true;
        } else if reload {
            // Counted and logged by the proxy; the running config stays on failure.
            let _ = proxy.reload_from(path).await;
        }
    }
    drop(handing);
    tracing::info!("shutting down: draining in-flight requests");
    drain_or_cut(proxy.shutdown(), &mut signals).await
}

/// Runs a shutdown's drain; a second SIGTERM/SIGINT meanwhile cuts it
/// short: what is left is closed at once (the runtime ends with it).
async fn drain_or_cut(drain: impl Future<Output = ()>, signals: &mut Stop) -> Result<()> {
    tokio::select! {
        () = drain => {}
        () = signals.next() => {
            tracing::warn!("second SIGTERM/SIGINT: closing what is left of the drain now");
        }
    }
    Ok(())
}

/// SIGTERM and SIGINT, caught from start-up on.
struct Stop {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Stop {
    fn install() -> Result<Self> {
        Ok(Self {
            term: signal(SignalKind::terminate()).context("installing SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing SIGINT handler")?,
        })
    }

    /// The next SIGTERM or SIGINT.
    async fn next(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

/// The bytes of the config file and of every certificate and key file it
/// names (in order), for `--watch`; `None` when the config is unreadable.
fn watched_files(path: &Path) -> Option<Vec<Option<Vec<u8>>>> {
    let config = std::fs::read(path).ok()?;
    let mut files = vec![Some(config)];
    if let Ok(parsed) = ProxyConfig::load(path) {
        files.extend(parsed.tls_files().iter().map(|f| std::fs::read(f).ok()));
    }
    Some(files)
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
        // Whoever started us (systemd, the process scaler) learns it at once.
        if let Some(path) = std::env::var_os("NOTIFY_SOCKET")
            && let Err(e) = meshless_backend::sd_notify::notify_ready(std::path::Path::new(&path))
        {
            tracing::warn!(error = %e, "cannot send READY=1 to NOTIFY_SOCKET");
        }
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
    if args.backends.len() != 3 {
        bail!(
            "--backends: three addresses are needed, got {}",
            args.backends.len()
        );
    }
    // The shipped file names the default addresses; other ones replace them.
    let mut yaml = DEMO_CONFIG
        .replace("127.0.0.1:8080", &args.listen.to_string())
        .replace("127.0.0.1:9901", &args.admin.to_string());
    for (i, addr) in args.backends.iter().enumerate() {
        yaml = yaml.replace(&format!("127.0.0.1:910{}", i + 1), &addr.to_string());
    }
    let config = ProxyConfig::parse(&yaml, "examples/demo.yaml")?;
    let wanted: Vec<StackBackend> = args
        .backends
        .iter()
        .enumerate()
        .map(|(i, addr)| StackBackend {
            name: format!("backend-{}", i + 1),
            listen: *addr,
        })
        .collect();
    runtime(None)?.block_on(async {
        let backends = start_backends(&wanted).await?;
        let proxy = Proxy::start(config).await?;
        print!("{DEMO_HELP}");
        terminated().await?;
        proxy.shutdown().await;
        for b in backends {
            b.stop().await;
        }
        Ok(())
    })
}

/// What `meshless demo` prints: the commands to try.
const DEMO_HELP: &str = include_str!("../../../examples/demo.txt");

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
        // The override is checked like the file's value (`--data-dir ""`).
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("--data-dir: {e}"))?;
    }
    if args.check {
        println!("{}: ok", args.config.display());
        return Ok(());
    }
    // Before the runtime's threads: snapshot copies go back to the system
    // when freed (`malloc_tuning.rs`).
    let tuning = crate::malloc_tuning::fix_mmap_threshold();
    tracing::debug!(?tuning, "malloc mmap threshold");
    runtime(None)?.block_on(async {
        let plane = ControlPlane::start(config).await?;
        let kube = crate::kubernetes::KubeSide::start(&plane).await?;
        terminated().await?;
        if let Some(k) = kube {
            k.stop().await;
        }
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
    proxy: ProxyConfig,
    #[serde(default)]
    backends: Vec<StackBackend>,
    /// The proxy had no `control:` of its own: it dials this file's control
    /// plane at the address that plane actually bound (port 0 allowed).
    #[serde(skip)]
    proxy_follows_plane: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StackBackend {
    name: String,
    listen: SocketAddr,
}

/// Starts demo backends (no latency, no failures) on their addresses.
async fn start_backends(wanted: &[StackBackend]) -> Result<Vec<Backend>> {
    let mut backends = Vec::new();
    for b in wanted {
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
    Ok(backends)
}

impl Stack {
    /// Reads the stack file; each part passes its own validation, with
    /// errors at `control.…` or `proxy.…`. A proxy without `control:`
    /// follows this file's control plane.
    fn load(path: &Path) -> Result<Self> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).with_context(|| format!("{file}: cannot read"))?;
        let mut stack: Stack =
            meshless_model::yaml::from_str(&text).map_err(|e| anyhow::anyhow!("{file}: {e}"))?;
        stack
            .control
            .validate()
            .map_err(|e| anyhow::anyhow!("{file}: {}", e.at("control")))?;
        if stack.proxy.control.is_none() {
            stack.proxy_follows_plane = true;
            stack.proxy.control = Some(ControlLink::new(stack.control.grpc_address.to_string()));
        }
        stack
            .proxy
            .validate()
            .map_err(|e| anyhow::anyhow!("{file}: {}", e.at("proxy")))?;
        Ok(stack)
    }
}

/// Where a client on this machine reaches a server bound to `bound`: its
/// port, and loopback when it bound every address (`0.0.0.0`, `::`).
fn dial_address(bound: SocketAddr) -> SocketAddr {
    match bound.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::from((Ipv4Addr::LOCALHOST, bound.port()))
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::from((Ipv6Addr::LOCALHOST, bound.port()))
        }
        _ => bound,
    }
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
    let stack = Stack::load(&args.config)?;
    if args.check {
        println!("{}: ok", args.config.display());
        return Ok(());
    }
    let Stack {
        control,
        mut proxy,
        backends: wanted,
        proxy_follows_plane,
    } = stack;
    runtime(None)?.block_on(async {
        let backends = start_backends(&wanted).await?;
        let plane = ControlPlane::start(control).await?;
        let kube = crate::kubernetes::KubeSide::start(&plane).await?;
        if proxy_follows_plane && let Some(link) = proxy.control.as_mut() {
            link.address = dial_address(plane.grpc_addr()).to_string();
        }
        let proxy = Proxy::start(proxy).await?;
        println!(
            "meshless up: control plane API http://{} (gRPC {}), proxy admin http://{}",
            plane.api_addr(),
            plane.grpc_addr(),
            proxy.admin_addr()
        );
        terminated().await?;
        proxy.shutdown().await;
        if let Some(k) = kube {
            k.stop().await;
        }
        plane.shutdown().await;
        for b in backends {
            b.stop().await;
        }
        Ok(())
    })
}

/// Arguments of `meshless fake-kube`.
#[derive(Debug, Args)]
pub struct FakeKubeArgs {
    /// Address of the fake API server.
    #[arg(long, default_value = "127.0.0.1:6443")]
    pub listen: SocketAddr,
    /// Where to write a kubeconfig pointing at it.
    #[arg(long, default_value = "/tmp/meshless-fake-kubeconfig")]
    pub kubeconfig: PathBuf,
    /// Roll Deployment demo/web this often (e.g. 30s); 0 = never.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub roll_every: Duration,
}

/// Runs the fake cluster until SIGINT or SIGTERM.
pub fn fake_kube(args: FakeKubeArgs) -> Result<()> {
    let settings = meshless_kubernetes::demo::DemoSettings {
        listen: args.listen,
        kubeconfig: args.kubeconfig,
        roll_every: (!args.roll_every.is_zero()).then_some(args.roll_every),
    };
    runtime(None)?.block_on(async {
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let demo = tokio::spawn(meshless_kubernetes::demo::run(settings, stopped));
        terminated().await?;
        let _ = stop.send(true);
        demo.await.context("fake-kube")?.context("fake-kube")?;
        Ok(())
    })
}
