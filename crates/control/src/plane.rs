//! The running control plane: registration API (HTTP JSON), distribution
//! stream (gRPC), and the background work (TTL expiry, batched
//! reconciliation, compaction of sparse slices).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use meshless_api::DistributionServer;
use meshless_model::EndpointId;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::ControlConfig;
use crate::distributor::{DistributionService, Distributor};
use crate::metrics::ControlMetrics;
use crate::registry::{EndpointInput, Registry, RegistryError, ServicePort, ServiceSpec};
use crate::store::Store;

/// Why the control plane could not start.
#[derive(Debug, thiserror::Error)]
pub enum PlaneError {
    #[error("{what} {address}: cannot bind: {source}")]
    Bind {
        what: &'static str,
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error("token_file {path}: {source}")]
    Token {
        path: String,
        source: std::io::Error,
    },
    #[error("services[{index}]: {source}")]
    StaticService { index: usize, source: RegistryError },
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// State shared by the API, the stream and the background tasks.
#[derive(Debug)]
pub struct PlaneState {
    pub registry: Arc<Mutex<Registry>>,
    pub distributor: Arc<Distributor>,
    pub metrics: Arc<ControlMetrics>,
    pub config: ControlConfig,
    token: Option<String>,
}

impl PlaneState {
    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs one write; without a batch period, reconciles and publishes at once.
    pub fn write<T>(
        &self,
        f: impl FnOnce(&mut Registry) -> Result<T, RegistryError>,
    ) -> Result<T, RegistryError> {
        let committed = Instant::now();
        let mut reg = self.lock();
        let out = f(&mut reg);
        match &out {
            Ok(_) => self.metrics.writes.inc(),
            Err(_) => self.metrics.rejected_writes.inc(),
        };
        if out.is_ok() && self.config.batch_period.is_zero() {
            self.flush(&mut reg, committed)?;
        }
        out
    }

    /// [`PlaneState::write`], also returning the registry version once the
    /// write's deltas are published: the version proxies will see.
    pub fn write_versioned<T>(
        &self,
        f: impl FnOnce(&mut Registry) -> Result<T, RegistryError>,
    ) -> Result<(T, u64), RegistryError> {
        let out = self.write(f)?;
        Ok((out, self.lock().version()))
    }

    /// Reconciles every changed service and publishes its delta.
    fn flush(&self, reg: &mut Registry, committed: Instant) -> Result<(), RegistryError> {
        for key in reg.dirty_services() {
            if let Some((delta, changes)) = reg.reconcile(&key)? {
                self.metrics.slice_writes.inc_by(changes.writes() as u64);
                self.distributor.publish(&delta, committed);
            }
        }
        Ok(())
    }
}

/// A running control plane.
#[derive(Debug)]
pub struct ControlPlane {
    pub state: Arc<PlaneState>,
    api_addr: SocketAddr,
    grpc_addr: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl ControlPlane {
    /// Opens the store, registers the file's services, binds both addresses
    /// and starts serving.
    pub async fn start(config: ControlConfig) -> Result<Self, PlaneError> {
        let token = match &config.token_file {
            Some(p) => Some(
                std::fs::read_to_string(p)
                    .map_err(|source| PlaneError::Token {
                        path: p.display().to_string(),
                        source,
                    })?
                    .trim()
                    .to_owned(),
            ),
            None => None,
        };
        let store = config
            .data_dir
            .as_deref()
            .map(Store::open)
            .transpose()
            .map_err(RegistryError::from)?;
        let registry = Arc::new(Mutex::new(Registry::open(
            store,
            config.max_endpoints_per_slice,
        )?));
        let metrics = Arc::new(ControlMetrics::new());
        let distributor = Arc::new(Distributor::new(
            Arc::clone(&registry),
            Arc::clone(&metrics),
            config.history,
        ));
        let state = Arc::new(PlaneState {
            registry,
            distributor: Arc::clone(&distributor),
            metrics,
            config: config.clone(),
            token,
        });
        for (index, s) in config.services.iter().enumerate() {
            let key = s.spec().key();
            state
                .write(|r| {
                    r.put_service(s.spec())?;
                    if !s.endpoints.is_empty() {
                        r.put_endpoints(&key, s.endpoints.clone())?;
                    }
                    Ok(())
                })
                .map_err(|source| PlaneError::StaticService { index, source })?;
        }
        let bind = |what: &'static str, address: SocketAddr| async move {
            TcpListener::bind(address)
                .await
                .map_err(|source| PlaneError::Bind {
                    what,
                    address,
                    source,
                })
        };
        let api = bind("api_address", config.api_address).await?;
        let grpc = bind("grpc_address", config.grpc_address).await?;
        let api_addr = api.local_addr().unwrap_or(config.api_address);
        let grpc_addr = grpc.local_addr().unwrap_or(config.grpc_address);
        let (stop, stopped) = watch::channel(false);
        let mut tasks = vec![
            tokio::spawn(serve_api(api, Arc::clone(&state), stopped.clone())),
            tokio::spawn(serve_grpc(grpc, Arc::clone(&state), stopped.clone())),
            tokio::spawn(housekeeping(Arc::clone(&state), stopped.clone())),
        ];
        for s in &config.services {
            if let Some(scaling) = &s.autoscaling {
                tasks.push(tokio::spawn(crate::scaling::run(
                    Arc::clone(&state),
                    s.spec().key(),
                    scaling.clone(),
                    stopped.clone(),
                )));
            }
        }
        if !config.batch_period.is_zero() {
            tasks.push(tokio::spawn(batches(Arc::clone(&state), stopped)));
        }
        tracing::info!(api = %api_addr, grpc = %grpc_addr, "control plane listening");
        Ok(Self {
            state,
            api_addr,
            grpc_addr,
            stop,
            tasks,
        })
    }

    /// Bound registration API address.
    pub fn api_addr(&self) -> SocketAddr {
        self.api_addr
    }

    /// Bound gRPC address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// Stops serving and closes the store.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
        }
        self.state.distributor.close();
        self.state.lock().close_store();
    }
}

async fn serve_grpc(
    listener: TcpListener,
    state: Arc<PlaneState>,
    mut stop: watch::Receiver<bool>,
) {
    let service = DistributionService {
        distributor: Arc::clone(&state.distributor),
    };
    let token = state.token.clone().map(|t| format!("Bearer {t}"));
    let server =
        DistributionServer::with_interceptor(
            service,
            move |req: tonic::Request<()>| match &token {
                None => Ok(req),
                Some(want) => match req
                    .metadata()
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                {
                    Some(got) if got == want => Ok(req),
                    _ => Err(tonic::Status::unauthenticated(
                        "a valid bearer token is required",
                    )),
                },
            },
        );
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let result = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .add_service(server)
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = stop.changed().await;
        })
        .await;
    if let Err(e) = result {
        tracing::error!(error = %e, "distribution server failed");
    }
}

/// TTL expiry every second; compaction of quiet services.
async fn housekeeping(state: Arc<PlaneState>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let now = Instant::now();
        let result = state.write(|r| r.expire(now));
        if let Ok(n) = result
            && n > 0
        {
            state.metrics.expired.inc_by(n as u64);
            tracing::info!(expired = n, "endpoints removed: TTL ran out");
        }
        let mut reg = state.lock();
        match reg.compact_quiet(state.config.compact_after) {
            Ok(deltas) => {
                for d in deltas {
                    state.distributor.publish(&d, now);
                }
            }
            Err(e) => tracing::error!(error = %e, "compaction failed"),
        }
    }
}

/// With a batch period: reconcile and publish what changed, once per period.
async fn batches(state: Arc<PlaneState>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(state.config.batch_period);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let mut reg = state.lock();
        if let Err(e) = state.flush(&mut reg, Instant::now()) {
            tracing::error!(error = %e, "reconcile failed");
        }
    }
}

async fn serve_api(listener: TcpListener, state: Arc<PlaneState>, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let state = Arc::clone(&state);
                tokio::spawn(async move {
                    let service = service_fn(move |req| api(Arc::clone(&state), req));
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
            _ = stop.changed() => return,
        }
    }
}

fn json(status: StatusCode, value: &impl serde::Serialize) -> Response<Full<Bytes>> {
    let body = serde_json::to_vec_pretty(value).unwrap_or_default();
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

fn error(status: StatusCode, message: impl std::fmt::Display) -> Response<Full<Bytes>> {
    json(status, &serde_json::json!({ "error": message.to_string() }))
}

fn registry_error(e: RegistryError) -> Response<Full<Bytes>> {
    let status = match e {
        RegistryError::Invalid { .. } => StatusCode::BAD_REQUEST,
        RegistryError::UnknownService(_) | RegistryError::UnknownEndpoint { .. } => {
            StatusCode::NOT_FOUND
        }
        RegistryError::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    error(status, e)
}

/// Reads a JSON body of at most `max` bytes.
async fn read_json<T: serde::de::DeserializeOwned>(
    req: Request<Incoming>,
    max: usize,
) -> Result<T, Response<Full<Bytes>>> {
    let body = Limited::new(req.into_body(), max)
        .collect()
        .await
        .map_err(|_| {
            error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body over {max} bytes"),
            )
        })?
        .to_bytes();
    let de = &mut serde_json::Deserializer::from_slice(&body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        error(
            StatusCode::BAD_REQUEST,
            format!("body: {path}: {}", e.into_inner()),
        )
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServiceBody {
    #[serde(default)]
    ports: Vec<ServicePort>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BulkBody {
    #[serde(default)]
    put: Vec<EndpointInput>,
    #[serde(default)]
    delete: Vec<String>,
}

async fn api(
    state: Arc<PlaneState>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(route(&state, req).await.unwrap_or_else(|r| r))
}

async fn route(
    state: &PlaneState,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Response<Full<Bytes>>> {
    let path: Vec<String> = req
        .uri()
        .path()
        .trim_matches('/')
        .split('/')
        .map(str::to_owned)
        .collect();
    let parts: Vec<&str> = path.iter().map(String::as_str).collect();
    let method = req.method().clone();
    match (&method, parts.as_slice()) {
        (&Method::GET, ["metrics"]) => {
            let mut r = Response::new(Full::new(Bytes::from(state.metrics.encode())));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            return Ok(r);
        }
        (&Method::GET, ["ready"]) => {
            return Ok(json(StatusCode::OK, &serde_json::json!({"ready": true})));
        }
        _ => {}
    }
    if let Some(token) = &state.token {
        let got = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if got != Some(format!("Bearer {token}").as_str()) {
            return Err(error(
                StatusCode::UNAUTHORIZED,
                "a valid bearer token is required",
            ));
        }
    }
    let max = state.config.max_body_bytes;
    match (&method, parts.as_slice()) {
        (&Method::GET, ["v1", "services"]) => {
            let reg = state.lock();
            let list: Vec<_> = reg
                .service_keys()
                .into_iter()
                .map(|k| serde_json::json!({ "service": k }))
                .collect();
            Ok(json(
                StatusCode::OK,
                &serde_json::json!({ "version": reg.version(), "services": list }),
            ))
        }
        (&Method::GET, ["v1", "services", ns, name]) => {
            let key = format!("{ns}/{name}");
            match state.lock().view(&key) {
                Some(v) => Ok(json(StatusCode::OK, &v)),
                None => Err(error(
                    StatusCode::NOT_FOUND,
                    format!("unknown service {key:?}"),
                )),
            }
        }
        (&Method::PUT, ["v1", "services", ns, name]) => {
            let (ns, name) = (ns.to_string(), name.to_string());
            let body: ServiceBody = read_json(req, max).await?;
            let spec = ServiceSpec {
                namespace: ns,
                name,
                ports: body.ports,
            };
            let v = state
                .write(|r| r.put_service(spec))
                .map_err(registry_error)?;
            Ok(json(StatusCode::OK, &serde_json::json!({ "version": v })))
        }
        (&Method::DELETE, ["v1", "services", ns, name]) => {
            let key = format!("{ns}/{name}");
            let committed = Instant::now();
            let mut reg = state.lock();
            let delta = reg.delete_service(&key).map_err(registry_error)?;
            state.distributor.publish(&delta, committed);
            Ok(json(
                StatusCode::OK,
                &serde_json::json!({ "version": delta.version }),
            ))
        }
        (&Method::PUT, ["v1", "services", ns, name, "endpoints", id]) => {
            let key = format!("{ns}/{name}");
            let id = id.to_string();
            let body: EndpointInput = read_json(req, max).await?;
            if body.id != id {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    format!("id: body says {:?}, path says {id:?}", body.id),
                ));
            }
            let (_, v) = state
                .write_versioned(|r| r.put_endpoints(&key, vec![body]))
                .map_err(registry_error)?;
            Ok(json(StatusCode::OK, &serde_json::json!({ "version": v })))
        }
        (&Method::DELETE, ["v1", "services", ns, name, "endpoints", id]) => {
            let key = format!("{ns}/{name}");
            let ids = [EndpointId::new(id.to_string())];
            let (_, v) = state
                .write_versioned(|r| r.delete_endpoints(&key, &ids, true))
                .map_err(registry_error)?;
            Ok(json(StatusCode::OK, &serde_json::json!({ "version": v })))
        }
        (&Method::POST, ["v1", "services", ns, name, "endpoints", id, "renew"]) => {
            let key = format!("{ns}/{name}");
            let id = EndpointId::new(id.to_string());
            state.lock().renew(&key, &id).map_err(registry_error)?;
            Ok(json(
                StatusCode::OK,
                &serde_json::json!({ "renewed": id.to_string() }),
            ))
        }
        (&Method::POST, ["v1", "services", ns, name, "endpoints"]) => {
            let key = format!("{ns}/{name}");
            let body: BulkBody = read_json(req, max).await?;
            let ids: Vec<EndpointId> = body.delete.into_iter().map(EndpointId::new).collect();
            let (_, v) = state
                .write_versioned(|r| {
                    let mut v = r.version();
                    if !body.put.is_empty() {
                        v = r.put_endpoints(&key, body.put)?;
                    }
                    if !ids.is_empty() {
                        v = r.delete_endpoints(&key, &ids, false)?;
                    }
                    Ok(v)
                })
                .map_err(registry_error)?;
            Ok(json(StatusCode::OK, &serde_json::json!({ "version": v })))
        }
        _ => Err(error(
            StatusCode::NOT_FOUND,
            "routes: GET /v1/services, GET|PUT|DELETE /v1/services/NS/NAME, \
             PUT|DELETE /v1/services/NS/NAME/endpoints/ID, POST /v1/services/NS/NAME/endpoints (bulk), \
             POST /v1/services/NS/NAME/endpoints/ID/renew, GET /metrics, GET /ready",
        )),
    }
}
