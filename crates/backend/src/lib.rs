//! A small HTTP server that names itself: the backend of meshless demos,
//! tests and benchmarks. Serves HTTP/1.1 and HTTP/2 over cleartext (prior
//! knowledge) on one port.
//!
//! | path | answer |
//! |---|---|
//! | `/healthz` | 200, or 503 while failing |
//! | `/admin/fail` | switches to failing mode: every other path answers 500 |
//! | `/admin/recover` | leaves failing mode |
//! | `/status/NNN` | answers status NNN |
//! | `/echo` | streams the request body back |
//! | `/upgrade` | with `Upgrade: X`, switches protocols (101) and echoes bytes |
//! | anything else | 200 with body `NAME\n` |
//!
//! Every response carries `x-backend: NAME`. A `delay_ms=N` query parameter
//! delays the answer by N milliseconds, on top of `latency`.
//!
//! gRPC requests (`content-type: application/grpc*`) on the same port go to
//! the standard health service and an echo service ([`grpc`]).

pub mod grpc;
pub mod sd_notify;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Settings of one backend.
#[derive(Debug, Clone)]
pub struct BackendConfig {
    /// Name reported in `x-backend` and in bodies.
    pub name: String,
    /// Address to bind (port 0 for any free port).
    pub listen: SocketAddr,
    /// Added to every answer.
    pub latency: Duration,
    /// Share of requests (0.0..=1.0) answered 500 at random.
    pub fail_rate: f64,
    /// Wait before binding, as a slow-starting instance would.
    pub startup_delay: Duration,
}

/// Why a backend could not start.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("--fail-rate: must be 0.0..=1.0, got {0}")]
    FailRate(f64),
    #[error("--listen {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A running backend.
#[derive(Debug)]
pub struct Backend {
    local_addr: SocketAddr,
    state: Arc<State>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct State {
    name: String,
    header: HeaderValue,
    latency: Duration,
    fail_rate: f64,
    failing: AtomicBool,
    requests: AtomicU64,
}

/// What a connection's requests are served with.
#[derive(Debug, Clone)]
struct Services {
    state: Arc<State>,
    grpc: tonic::service::Routes,
}

impl Backend {
    /// Binds (after `startup_delay`) and serves until [`Backend::stop`] or drop.
    pub async fn start(config: BackendConfig) -> Result<Self, BackendError> {
        if !(0.0..=1.0).contains(&config.fail_rate) {
            return Err(BackendError::FailRate(config.fail_rate));
        }
        tokio::time::sleep(config.startup_delay).await;
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| BackendError::Bind {
                    addr: config.listen,
                    source,
                })?;
        let local_addr = listener.local_addr().map_err(|source| BackendError::Bind {
            addr: config.listen,
            source,
        })?;
        let header = HeaderValue::from_str(&config.name)
            .unwrap_or_else(|_| HeaderValue::from_static("invalid-name"));
        let state = Arc::new(State {
            name: config.name,
            header,
            latency: config.latency,
            fail_rate: config.fail_rate,
            failing: AtomicBool::new(false),
            requests: AtomicU64::new(0),
        });
        let (stop, stopped) = watch::channel(false);
        let services = Services {
            grpc: grpc::routes(&state),
            state: Arc::clone(&state),
        };
        let task = tokio::spawn(accept_loop(listener, services, stopped));
        Ok(Self {
            local_addr,
            state,
            stop,
            task,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The backend's name.
    pub fn name(&self) -> &str {
        &self.state.name
    }

    /// Requests answered so far.
    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::Relaxed)
    }

    /// Enters or leaves failing mode (as `/admin/fail` and `/admin/recover`).
    pub fn set_failing(&self, failing: bool) {
        self.state.failing.store(failing, Ordering::Relaxed);
    }

    /// Stops accepting and closes every connection at once (like a
    /// crash); resolves when all are closed.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

async fn accept_loop(
    listener: TcpListener,
    services: Services,
    mut stopped: watch::Receiver<bool>,
) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let services = services.clone();
                connections.spawn(async move {
                    let service = service_fn(move |req| handle(services.clone(), req));
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection_with_upgrades(TokioIo::new(stream), service)
                        .await;
                });
            }
            _ = stopped.changed() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    connections.shutdown().await;
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = UnsyncBoxBody<Bytes, BoxError>;

fn full(text: impl Into<Bytes>) -> Body {
    Full::new(text.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// Whether the request is a gRPC call.
fn is_grpc(req: &Request<Incoming>) -> bool {
    req.headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

async fn handle(
    services: Services,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let Services { state, mut grpc } = services;
    state.requests.fetch_add(1, Ordering::Relaxed);
    if req.uri().path() == "/upgrade"
        && let Some(protocol) = req.headers().get(http::header::UPGRADE).cloned()
    {
        let on_upgrade = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            if let Ok(upgraded) = on_upgrade.await {
                let (mut r, mut w) = tokio::io::split(TokioIo::new(upgraded));
                let _ = tokio::io::copy(&mut r, &mut w).await;
            }
        });
        let mut resp = Response::new(full(Bytes::new()));
        *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        resp.headers_mut().insert(http::header::UPGRADE, protocol);
        resp.headers_mut().insert(
            http::header::CONNECTION,
            HeaderValue::from_static("upgrade"),
        );
        resp.headers_mut().insert("x-backend", state.header.clone());
        return Ok(resp);
    }
    let delay = req
        .uri()
        .query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("delay_ms=")))
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_millis)
        .unwrap_or_default();
    let wait = state.latency + delay;
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
    if is_grpc(&req) {
        let Ok(resp) = tower_service::Service::call(&mut grpc, req).await;
        return Ok(resp.map(|b| b.map_err(BoxError::from).boxed_unsync()));
    }
    let path = req.uri().path().to_owned();
    let failing = state.failing.load(Ordering::Relaxed);
    let (status, body) = match path.as_str() {
        "/healthz" if failing => (StatusCode::SERVICE_UNAVAILABLE, full("failing\n")),
        "/healthz" => (StatusCode::OK, full("ok\n")),
        "/admin/fail" => {
            state.failing.store(true, Ordering::Relaxed);
            (StatusCode::OK, full("failing\n"))
        }
        "/admin/recover" => {
            state.failing.store(false, Ordering::Relaxed);
            (StatusCode::OK, full("recovered\n"))
        }
        _ if failing => (
            StatusCode::INTERNAL_SERVER_ERROR,
            full(format!("{} failing\n", state.name)),
        ),
        _ if state.fail_rate > 0.0 && fastrand::f64() < state.fail_rate => (
            StatusCode::INTERNAL_SERVER_ERROR,
            full(format!("{} failed at random\n", state.name)),
        ),
        "/echo" => (
            StatusCode::OK,
            req.into_body().map_err(BoxError::from).boxed_unsync(),
        ),
        p if p.starts_with("/status/") => {
            let code = p["/status/".len()..]
                .parse::<u16>()
                .ok()
                .and_then(|c| StatusCode::from_u16(c).ok())
                .unwrap_or(StatusCode::BAD_REQUEST);
            (code, full(format!("{} {}\n", state.name, code.as_u16())))
        }
        _ => (StatusCode::OK, full(format!("{}\n", state.name))),
    };
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut().insert("x-backend", state.header.clone());
    Ok(resp)
}
