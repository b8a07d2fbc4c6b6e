//! Background tasks: active health checks per cluster, and the outlier
//! detection tick.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::HeaderValue;
use http::uri::Authority;
use http::{Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use prost::Message as _;
use tokio::io::AsyncWriteExt as _;
use tokio::sync::watch;

use crate::state::ProxyState;
use crate::upstream::TlsClient;

/// Runs until `stop` changes: every 100 ms, checks each cluster's endpoints
/// whose `health_check.interval` has passed, and ticks outlier detection of
/// each cluster every `outlier_detection.interval`. Follows the current
/// snapshot, so reloads take effect at the next round.
pub async fn run(state: Arc<ProxyState>, mut stop: watch::Receiver<bool>) {
    let clients = Clients::new();
    let checking = InFlight::default();
    // When each cluster was last checked, and the jitter drawn for its next wait.
    let mut last_check: HashMap<String, (Instant, Duration)> = HashMap::new();
    let mut last_tick: HashMap<String, Instant> = HashMap::new();
    let mut panicking: HashMap<String, bool> = HashMap::new();
    let mut round = tokio::time::interval(Duration::from_millis(100));
    round.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = round.tick() => {}
            _ = stop.changed() => return,
        }
        let snap = state.snapshot.load_full();
        let now = Instant::now();
        last_check.retain(|name, _| snap.clusters.contains_key(name));
        last_tick.retain(|name, _| snap.clusters.contains_key(name));
        panicking.retain(|name, _| snap.clusters.contains_key(name));
        for (name, cluster) in &snap.clusters {
            let panic = cluster.lb.in_panic();
            if panicking.insert(name.clone(), panic).unwrap_or(false) != panic {
                if panic {
                    tracing::warn!(cluster = %name, threshold = cluster.config.panic_threshold, "panic mode: too few endpoints available; requests go to all of them, unhealthy and ejected ones included");
                } else {
                    tracing::info!(cluster = %name, "panic mode over");
                }
            }
            let interval = cluster.config.outlier_detection.interval;
            let tick = last_tick.entry(name.clone()).or_insert(now);
            if now.duration_since(*tick) >= interval {
                *tick = now;
                cluster.lb.tick();
            }
            let Some(hc) = &cluster.config.health_check else {
                continue;
            };
            if !check_due(last_check.get(name).copied(), now, hc) {
                continue;
            }
            last_check.insert(name.clone(), (now, draw_jitter(hc.interval_jitter)));
            // A cluster that sends a PROXY header on its flows sends one on
            // its checks too (`LOCAL`: the check is the proxy's own
            // connection), or an endpoint that requires it refuses them.
            let local = cluster.config.proxy_protocol.is_some();
            let http2 = cluster.config.upstream_protocol == crate::config::UpstreamProtocol::Http2;
            for (i, authority) in cluster.authorities.iter().enumerate() {
                // One check per endpoint at a time (Envoy and HAProxy wait
                // for the answer or the timeout): a hanging endpoint does
                // not pile up connections, and results land in order.
                let Some(running) = checking.start(name, &cluster.endpoint_labels[i]) else {
                    continue;
                };
                let clients = clients.clone();
                let cluster = Arc::clone(cluster);
                let state = Arc::clone(&state);
                let hc = hc.clone();
                let authority = authority.clone();
                tokio::spawn(async move {
                    // A TLS cluster's endpoints are checked over TLS, with
                    // the client (CA, SNI, ALPN) its requests use.
                    let tls = cluster.endpoint_pools.get(i).and_then(|p| p.tls());
                    let check = async {
                        match &hc.grpc {
                            _ if hc.tcp => tcp_check(&authority, local).await,
                            Some(g) => {
                                let via = match tls {
                                    Some(tls) => Via::Tls(tls, local, true),
                                    None => Via::Client(clients.grpc(local)),
                                };
                                grpc_check(via, &authority, &g.service).await
                            }
                            None => {
                                let via = match tls {
                                    Some(tls) => Via::Tls(tls, local, http2),
                                    None => Via::Client(clients.http(local)),
                                };
                                http_check(via, &authority, hc.path()).await
                            }
                        }
                    };
                    let passed = tokio::time::timeout(hc.timeout, check)
                        .await
                        .unwrap_or(false);
                    cluster.lb.record_health_check(i, passed);
                    cluster
                        .series(i, &state.metrics.endpoint_series)
                        .health_check(passed);
                    drop(running);
                });
            }
        }
    }
}

/// Whether a cluster's checks are due at `now`: never checked, or its
/// last round (`last`: when, and the jitter drawn then) is at least
/// `interval` plus that jitter ago. The drawn jitter counts only up to the
/// current `interval_jitter`, so a reload that lowers it applies at once.
fn check_due(
    last: Option<(Instant, Duration)>,
    now: Instant,
    hc: &crate::config::HealthCheck,
) -> bool {
    last.is_none_or(|(at, jitter)| {
        let wait = hc.interval.saturating_add(jitter.min(hc.interval_jitter));
        now.saturating_duration_since(at) >= wait
    })
}

/// A uniformly drawn extra wait in `0..=max`.
fn draw_jitter(max: Duration) -> Duration {
    if max.is_zero() {
        return Duration::ZERO;
    }
    let nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
    Duration::from_nanos(fastrand::u64(0..=nanos))
}

/// A cluster's name and one of its endpoint ids.
type EndpointKey = (String, Arc<str>);

/// The endpoints whose check is under way.
#[derive(Clone, Default)]
struct InFlight(Arc<std::sync::Mutex<std::collections::HashSet<EndpointKey>>>);

impl InFlight {
    /// Marks a check of `endpoint` of `cluster` as started, or `None`
    /// when one is already under way. The mark goes with the guard.
    fn start(&self, cluster: &str, endpoint: &Arc<str>) -> Option<Running> {
        let key = (cluster.to_owned(), Arc::clone(endpoint));
        let mut set = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        set.insert(key.clone()).then(|| Running {
            set: self.clone(),
            key,
        })
    }
}

/// A check under way; dropping it (the check ended, or its task did)
/// lets the endpoint be checked again.
struct Running {
    set: InFlight,
    key: EndpointKey,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.set
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.key);
    }
}

type GrpcClient = Client<Connector, Full<Bytes>>;
type HttpClient = Client<Connector, Full<Bytes>>;

/// How a check's request is sent: by a shared plain client, or on a TLS
/// connection of its own (the TLS client, whether it starts with a PROXY
/// `LOCAL` header, whether it speaks HTTP/2).
enum Via<'a> {
    Client(&'a Client<Connector, Full<Bytes>>),
    Tls(&'a TlsClient, bool, bool),
}

impl Via<'_> {
    /// The URI of `path` at `authority` as this way sends it.
    fn uri(&self, authority: &Authority, path: &str) -> Option<Uri> {
        let scheme = match self {
            Via::Client(_) => "http",
            Via::Tls(..) => "https",
        };
        Uri::builder()
            .scheme(scheme)
            .authority(authority.clone())
            .path_and_query(path)
            .build()
            .ok()
    }

    /// Sends `req`; `None` when no response head came.
    async fn send(
        &self,
        authority: &Authority,
        mut req: Request<Full<Bytes>>,
    ) -> Option<http::Response<hyper::body::Incoming>> {
        let (tls, local, http2) = match self {
            Via::Client(c) => return c.request(req).await.ok(),
            Via::Tls(tls, local, http2) => (*tls, *local, *http2),
        };
        let mut tcp = tokio::net::TcpStream::connect(authority.as_str())
            .await
            .ok()?;
        let _ = tcp.set_nodelay(true);
        if local {
            tcp.write_all(&crate::proxy_protocol::encode_local())
                .await
                .ok()?;
        }
        let io = TokioIo::new(tls.handshake(tcp).await.ok()?);
        if http2 {
            let (mut send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .handshake(io)
                .await
                .ok()?;
            tokio::spawn(conn);
            send.send_request(req).await.ok()
        } else {
            // HTTP/1.1: the path in the request line, the endpoint in `host`.
            let host = HeaderValue::from_str(authority.as_str()).ok()?;
            req.headers_mut().insert(http::header::HOST, host);
            let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
            *req.uri_mut() = Uri::try_from(path).ok()?;
            let (mut send, conn) = hyper::client::conn::http1::handshake(io).await.ok()?;
            tokio::spawn(conn);
            send.send_request(req).await.ok()
        }
    }
}

/// The check clients: plain, and with a PROXY `LOCAL` header first.
#[derive(Clone)]
struct Clients {
    http: [HttpClient; 2],
    grpc: [GrpcClient; 2],
}

impl Clients {
    fn new() -> Self {
        let http = |local| {
            Client::builder(TokioExecutor::new())
                .pool_timer(TokioTimer::new())
                .pool_max_idle_per_host(1)
                .build(Connector::new(local))
        };
        let grpc = |local| {
            Client::builder(TokioExecutor::new())
                .pool_timer(TokioTimer::new())
                .pool_max_idle_per_host(1)
                .http2_only(true)
                .build(Connector::new(local))
        };
        Self {
            http: [http(false), http(true)],
            grpc: [grpc(false), grpc(true)],
        }
    }

    fn http(&self, local: bool) -> &HttpClient {
        &self.http[usize::from(local)]
    }

    fn grpc(&self, local: bool) -> &GrpcClient {
        &self.grpc[usize::from(local)]
    }
}

/// An HTTP connector that, for `local`, writes a PROXY protocol v2
/// `LOCAL` header on each new connection before the client speaks.
#[derive(Clone)]
struct Connector {
    inner: HttpConnector,
    local: bool,
}

impl Connector {
    fn new(local: bool) -> Self {
        Self {
            inner: HttpConnector::new(),
            local,
        }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<tokio::net::TcpStream>;
    type Error = BoxError;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, BoxError>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        let local = self.local;
        Box::pin(async move {
            let mut io = connecting.await?;
            if local {
                io.inner_mut()
                    .write_all(&crate::proxy_protocol::encode_local())
                    .await?;
            }
            Ok(io)
        })
    }
}

/// Passes when a TCP connection opens (then closed at once, after a
/// PROXY `LOCAL` header when the cluster sends headers).
async fn tcp_check(authority: &Authority, local: bool) -> bool {
    let Ok(mut s) = tokio::net::TcpStream::connect(authority.as_str()).await else {
        return false;
    };
    if local {
        let _ = s.write_all(&crate::proxy_protocol::encode_local()).await;
    }
    true
}

/// The most of a check's response body read: a longer one fails.
const MAX_CHECK_BODY: usize = 64 * 1024;

/// GET `path`: 2xx and 3xx pass, once the whole response (its body, up to
/// [`MAX_CHECK_BODY`]) has arrived: a server that sends the head and then
/// wedges fails (Envoy's HTTP checker decides at the end of the stream).
async fn http_check(via: Via<'_>, authority: &Authority, path: &str) -> bool {
    let Some(uri) = via.uri(authority, path) else {
        return false;
    };
    let req = Request::get(uri)
        .header("user-agent", "meshless-health-check")
        .body(Full::new(Bytes::new()));
    let Ok(req) = req else { return false };
    let Some(resp) = via.send(authority, req).await else {
        return false;
    };
    if !(resp.status().is_success() || resp.status().is_redirection()) {
        return false;
    }
    http_body_util::Limited::new(resp.into_body(), MAX_CHECK_BODY)
        .collect()
        .await
        .is_ok()
}

/// `grpc.health.v1.HealthCheckRequest`.
#[derive(Clone, PartialEq, prost::Message)]
struct HealthCheckRequest {
    #[prost(string, tag = "1")]
    service: String,
}

/// `grpc.health.v1.HealthCheckResponse`; `status` 1 is `SERVING`.
#[derive(Clone, PartialEq, prost::Message)]
struct HealthCheckResponse {
    #[prost(int32, tag = "1")]
    status: i32,
}

const SERVING: i32 = 1;

/// `grpc.health.v1.Health/Check` for `service` over HTTP/2: passes on
/// HTTP 200, `grpc-status` 0 and one response message saying `SERVING`
/// (Envoy's gRPC health checker; the Kubernetes gRPC probe).
async fn grpc_check(via: Via<'_>, authority: &Authority, service: &str) -> bool {
    let msg = HealthCheckRequest {
        service: service.to_owned(),
    }
    .encode_to_vec();
    let Ok(len) = u32::try_from(msg.len()) else {
        return false;
    };
    let mut framed = Vec::with_capacity(5 + msg.len());
    framed.push(0);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(&msg);
    let Some(uri) = via.uri(authority, "/grpc.health.v1.Health/Check") else {
        return false;
    };
    let req = Request::post(uri)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("user-agent", "meshless-health-check")
        .body(Full::new(Bytes::from(framed)));
    let Ok(req) = req else { return false };
    let Some(resp) = via.send(authority, req).await else {
        return false;
    };
    if resp.status() != http::StatusCode::OK {
        return false;
    }
    let (parts, body) = resp.into_parts();
    let Ok(collected) = body.collect().await else {
        return false;
    };
    let code = collected
        .trailers()
        .and_then(crate::request::grpc::status)
        .or_else(|| crate::request::grpc::status(&parts.headers));
    if code != Some(crate::request::grpc::code::OK) {
        return false;
    }
    serving(&collected.to_bytes())
}

/// Whether a length-prefixed `HealthCheckResponse` says `SERVING`.
fn serving(body: &[u8]) -> bool {
    let Some((head, msg)) = body.split_at_checked(5) else {
        return false;
    };
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]);
    // Uncompressed, exactly one message.
    if head[0] != 0 || usize::try_from(len).ok() != Some(msg.len()) {
        return false;
    }
    HealthCheckResponse::decode(msg).is_ok_and(|r| r.status == SERVING)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hc(interval_ms: u64, jitter_ms: u64) -> crate::config::HealthCheck {
        crate::config::HealthCheck {
            path: None,
            grpc: None,
            tcp: false,
            interval: Duration::from_millis(interval_ms),
            interval_jitter: Duration::from_millis(jitter_ms),
            timeout: Duration::from_secs(1),
            healthy_threshold: 2,
            unhealthy_threshold: 3,
        }
    }

    proptest! {
        /// A drawn jitter is never above its maximum, and none is drawn
        /// without one.
        #[test]
        fn a_drawn_jitter_stays_within_its_maximum(max_ns in 0u64..=u64::MAX / 2) {
            let max = Duration::from_nanos(max_ns);
            let drawn = draw_jitter(max);
            prop_assert!(drawn <= max);
            prop_assert_eq!(draw_jitter(Duration::ZERO), Duration::ZERO);
        }

        /// A check is due exactly once `interval` plus the drawn jitter
        /// (capped by the current `interval_jitter`) has passed.
        #[test]
        fn a_check_is_due_after_its_interval_and_drawn_jitter(
            interval in 1u64..10_000, jitter in 0u64..10_000, drawn in 0u64..20_000, elapsed in 0u64..40_000,
        ) {
            let at = Instant::now();
            let now = at + Duration::from_millis(elapsed);
            let due = check_due(Some((at, Duration::from_millis(drawn))), now, &hc(interval, jitter));
            prop_assert_eq!(due, elapsed >= interval + drawn.min(jitter));
        }
    }

    #[test]
    fn a_cluster_never_checked_is_due_at_once() {
        assert!(check_due(None, Instant::now(), &hc(5_000, 1_000)));
    }

    #[test]
    fn jitter_spreads_the_waits() {
        let drawn: std::collections::HashSet<Duration> = (0..64)
            .map(|_| draw_jitter(Duration::from_secs(1)))
            .collect();
        // 64 draws out of 10^9 + 1 values: equal ones would mean no spread.
        assert!(drawn.len() > 1, "{drawn:?}");
    }

    #[test]
    fn only_one_serving_message_passes() {
        let framed = |flag: u8, msg: &[u8]| {
            let mut v = vec![flag];
            v.extend_from_slice(&u32::try_from(msg.len()).expect("len").to_be_bytes());
            v.extend_from_slice(msg);
            v
        };
        assert!(serving(&framed(0, &[0x08, 0x01])));
        assert!(!serving(&framed(0, &[0x08, 0x02])), "NOT_SERVING");
        assert!(!serving(&framed(0, &[])), "UNKNOWN (0) is the default");
        assert!(!serving(&framed(1, &[0x08, 0x01])), "compressed");
        let mut long = framed(0, &[0x08, 0x01]);
        long.push(0);
        assert!(!serving(&long), "bytes past the message");
        assert!(!serving(&[0, 0, 0]), "short prefix");
    }
}
