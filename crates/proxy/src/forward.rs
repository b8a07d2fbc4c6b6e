//! The request path: route, balance, forward with retries, and map
//! failures to the right status.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body::Body as _;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use meshless_balance::{Outcome, PickContext, hash_key};

use crate::body::{ActiveGuard, Completion, ProxyBody};
use crate::config::{HashKey, RetryOn};
use crate::metrics::{ClusterLabels, OverflowLabels};
use crate::snapshot::UpstreamCluster;
use crate::state::ProxyState;
use crate::upstream::{UpstreamBody, is_connection_limit};

/// Headers that describe one hop and are never forwarded (RFC 9110 7.6.1).
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The label of a field not known (yet) for a request.
fn unknown() -> Arc<str> {
    static UNKNOWN: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from("-"));
    Arc::clone(&UNKNOWN)
}

/// Handles one downstream request on `listener`.
pub async fn handle(
    state: Arc<ProxyState>,
    listener: Arc<str>,
    client: SocketAddr,
    mut req: Request<Incoming>,
) -> Result<Response<ProxyBody>, std::convert::Infallible> {
    let started = Instant::now();
    let snapshot = state.snapshot.load_full();
    let request_id = req
        .headers()
        .get(&X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .map(str::to_owned)
        .unwrap_or_else(new_request_id);
    let mut done = Completion {
        state: Arc::clone(&state),
        listener: Arc::clone(&listener),
        route: unknown(),
        cluster: unknown(),
        endpoint: unknown(),
        method: req.method().clone(),
        path: req.uri().path().to_owned(),
        status: 0,
        request_id,
        attempts: 0,
        started,
        guard: None,
        active: None,
    };
    let Some(routes) = snapshot.routes.get(&*listener) else {
        return Ok(local(
            done,
            StatusCode::SERVICE_UNAVAILABLE,
            "listener is being removed\n",
            "draining",
        ));
    };
    let (parts, body) = {
        let on_upgrade = is_upgrade(req.headers()).then(|| hyper::upgrade::on(&mut req));
        let (parts, body) = req.into_parts();
        ((parts, on_upgrade), body)
    };
    let (parts, downstream_upgrade) = parts;
    let Some(route) = routes.find(&parts) else {
        return Ok(local(done, StatusCode::NOT_FOUND, "no route\n", "no_route"));
    };
    done.route = Arc::clone(&route.name);
    let cluster_name = route.cluster(fastrand::u64(..));
    let Some(base) = snapshot.clusters.get(&**cluster_name).cloned() else {
        return Ok(local(
            done,
            StatusCode::SERVICE_UNAVAILABLE,
            "no such cluster\n",
            "no_cluster",
        ));
    };
    done.cluster = Arc::clone(&base.name);
    // `base` carries the settings; `cluster` the endpoints, which activation
    // may replace with a newer snapshot's.
    let mut cluster = Arc::clone(&base);
    let counters = Arc::clone(&base.counters);
    let breakers = &base.config.circuit_breakers;
    if counters.active_requests.load(Ordering::Relaxed) >= u64::from(breakers.max_requests) {
        overflow(&state, &base, "max_requests");
        return Ok(local(
            done,
            StatusCode::SERVICE_UNAVAILABLE,
            "overflow: max_requests\n",
            "overflow",
        ));
    }
    counters.active_requests.fetch_add(1, Ordering::Relaxed);
    done.active = Some(ActiveGuard(Arc::clone(&counters)));

    let node = &snapshot.config.node;
    let key = extract_key(base.config.balancer.hash_key.as_ref(), &parts, client);
    let mut ctx = PickContext::new().with_locality(node.name.as_deref(), node.zone.as_deref());
    if let Some(k) = key {
        ctx = ctx.with_key(k);
    }
    let upgrading = downstream_upgrade.is_some();
    let mut first_headers = Some(forwarded_headers(
        &parts.headers,
        client,
        &done.request_id,
        upgrading,
    ));
    let retries = &base.config.retries;
    let activation = base
        .config
        .activation
        .as_ref()
        .zip(base.config.service.as_deref());
    let replayable = body.is_end_stream()
        && downstream_upgrade.is_none()
        && (retries.all_methods || is_idempotent(&parts.method));
    let max_attempts = if replayable { 1 + retries.count } else { 1 };
    let mut body = Some(body.boxed());
    let mut tried: [usize; 4] = [usize::MAX; 4];
    // Set when this request was held for activation: its cold-start timeline.
    let mut held_at: Option<Instant> = None;
    loop {
        done.attempts += 1;
        let attempt = done.attempts;
        let retrying = attempt > 1;
        let picked = pick_untried(&cluster, &ctx, &tried, retrying);
        // Scale from zero (or past container_concurrency): hold, then pick again.
        let over_limit = |g: &meshless_balance::InFlight| {
            activation.is_some_and(|(a, _)| {
                a.container_concurrency > 0
                    && cluster.lb.set().load(g.index()) > a.container_concurrency
            })
        };
        if let Some((act, service)) = activation
            && !retrying
            && picked.as_ref().is_none_or(over_limit)
        {
            if let Some(g) = picked {
                g.finish(Outcome::Cancelled);
                // The key's endpoint is full: after the wait, pick by load, not by key.
                ctx.key = None;
            }
            match crate::activation::hold(&state, &base.name, service, act, &counters).await {
                Ok(c) => {
                    cluster = c;
                    done.attempts -= 1;
                    held_at.get_or_insert(started);
                    continue;
                }
                Err(refusal) => return Ok(refused(done, refusal)),
            }
        }
        let Some(mut guard) = picked else {
            return Ok(no_endpoint(done, &cluster));
        };
        let index = guard.index();
        tried[(attempt as usize - 1) % tried.len()] = index;
        done.endpoint = Arc::clone(&cluster.endpoint_labels[index]);
        if counters.pending.load(Ordering::Relaxed) >= u64::from(breakers.max_pending) {
            guard.set_outcome(Outcome::Cancelled);
            overflow(&state, &cluster, "max_pending");
            return Ok(local(
                done,
                StatusCode::SERVICE_UNAVAILABLE,
                "overflow: max_pending\n",
                "overflow",
            ));
        }
        let upstream_body: UpstreamBody = match body.take() {
            Some(b) => b,
            None => Empty::new().map_err(|never| match never {}).boxed(),
        };
        // The first attempt takes the prepared headers; a retry prepares them again.
        let headers = first_headers.take().unwrap_or_else(|| {
            forwarded_headers(&parts.headers, client, &done.request_id, upgrading)
        });
        let upstream_req = match build_request(&parts, headers, &cluster, index, upstream_body) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "cannot build upstream request");
                return Ok(local(
                    done,
                    StatusCode::BAD_REQUEST,
                    "bad request\n",
                    "bad_request",
                ));
            }
        };
        counters.pending.fetch_add(1, Ordering::Relaxed);
        if retrying {
            counters.active_retries.fetch_add(1, Ordering::Relaxed);
        }
        let sent = tokio::time::timeout(
            cluster.config.timeouts.request,
            cluster.client.request(upstream_req),
        )
        .await;
        counters.pending.fetch_sub(1, Ordering::Relaxed);
        if retrying {
            counters.active_retries.fetch_sub(1, Ordering::Relaxed);
        }
        let (outcome, failure) = match sent {
            Ok(Ok(mut resp)) => {
                let status = resp.status();
                if let Some(held) = held_at.take() {
                    let total = held.elapsed();
                    state
                        .metrics
                        .activation_phase
                        .get_or_create(&crate::metrics::PhaseLabels { phase: "response" })
                        .observe(total.as_secs_f64());
                    tracing::info!(
                        cluster = %base.name,
                        endpoint = %cluster.endpoint_labels[index],
                        request_id = %done.request_id,
                        status = status.as_u16(),
                        held_to_response_ms = total.as_millis() as u64,
                        "activation: held request answered"
                    );
                }
                let may_retry = status.is_server_error()
                    && retries.on.contains(&RetryOn::FiveXx)
                    && attempt < max_attempts
                    && retry_allowed(&state, &cluster);
                if may_retry {
                    guard.finish(Outcome::Status(status.as_u16()));
                    continue;
                }
                guard.set_outcome(Outcome::Status(status.as_u16()));
                done.status = status.as_u16();
                if status == StatusCode::SWITCHING_PROTOCOLS
                    && let Some(down) = downstream_upgrade
                {
                    let up = hyper::upgrade::on(&mut resp);
                    tokio::spawn(splice_upgrade(down, up));
                }
                strip_hop_by_hop(
                    resp.headers_mut(),
                    status == StatusCode::SWITCHING_PROTOCOLS,
                );
                done.guard = Some(guard);
                let (parts, body) = resp.into_parts();
                return Ok(Response::from_parts(
                    parts,
                    ProxyBody::new(body.boxed(), Some(done)),
                ));
            }
            Ok(Err(e)) if is_connection_limit(&e) => {
                guard.set_outcome(Outcome::Cancelled);
                overflow(&state, &cluster, "max_connections");
                return Ok(local(
                    done,
                    StatusCode::SERVICE_UNAVAILABLE,
                    "overflow: max_connections\n",
                    "overflow",
                ));
            }
            Ok(Err(e)) if e.is_connect() => (
                Outcome::ConnectFailed,
                (
                    StatusCode::BAD_GATEWAY,
                    "upstream connect failed\n",
                    "connect_failed",
                ),
            ),
            Ok(Err(_)) => (
                Outcome::Reset,
                (StatusCode::BAD_GATEWAY, "upstream reset\n", "reset"),
            ),
            Err(_) => (
                Outcome::Timeout,
                (StatusCode::GATEWAY_TIMEOUT, "upstream timeout\n", "timeout"),
            ),
        };
        guard.finish(outcome);
        let retry_on = match outcome {
            Outcome::ConnectFailed => RetryOn::ConnectFailure,
            Outcome::Reset => RetryOn::Reset,
            _ => RetryOn::FiveXx,
        };
        let may_retry = outcome != Outcome::Timeout
            && retries.on.contains(&retry_on)
            && attempt < max_attempts
            && retry_allowed(&state, &cluster);
        if !may_retry {
            let (status, text, reason) = failure;
            return Ok(local(done, status, text, reason));
        }
    }
}

/// A pick that avoids endpoints this request already failed on (when the
/// cluster has others), the way Envoy's `previous_hosts` predicate does.
fn pick_untried(
    cluster: &UpstreamCluster,
    ctx: &PickContext<'_>,
    tried: &[usize],
    retrying: bool,
) -> Option<meshless_balance::InFlight> {
    if !retrying {
        return cluster.lb.pick(ctx);
    }
    for _ in 0..4 {
        // Hash keys always map to the same endpoint: retries pick freely.
        let mut c = *ctx;
        c.key = None;
        c.entropy = fastrand::u64(..);
        let g = cluster.lb.pick(&c)?;
        if !tried.contains(&g.index()) || cluster.lb.endpoints().len() <= 1 {
            return Some(g);
        }
        g.finish(Outcome::Cancelled);
    }
    cluster.lb.pick(ctx)
}

/// Retry budget: retries in flight stay under `budget_percent` of active
/// requests, with `min_concurrent` always allowed.
fn retry_allowed(state: &ProxyState, cluster: &UpstreamCluster) -> bool {
    let r = &cluster.config.retries;
    let active = cluster.counters.active_requests.load(Ordering::Relaxed);
    let budget = (active * u64::from(r.budget_percent) / 100).max(u64::from(r.min_concurrent));
    if cluster.counters.active_retries.load(Ordering::Relaxed) >= budget {
        overflow(state, cluster, "retry_budget");
        return false;
    }
    state
        .metrics
        .retries
        .get_or_create(&ClusterLabels {
            cluster: cluster.name.to_string(),
        })
        .inc();
    true
}

fn overflow(state: &ProxyState, cluster: &UpstreamCluster, limit: &str) {
    state
        .metrics
        .overflows
        .get_or_create(&OverflowLabels {
            cluster: cluster.name.to_string(),
            limit: limit.to_owned(),
        })
        .inc();
}

/// A response the proxy makes itself.
fn local(
    mut done: Completion,
    status: StatusCode,
    text: &'static str,
    reason: &str,
) -> Response<ProxyBody> {
    done.state.metrics.local_reply(&done.listener, reason);
    done.status = status.as_u16();
    let mut resp = Response::new(ProxyBody::full(text, Some(done)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

/// A held request that could not be sent (activation).
fn refused(mut done: Completion, r: crate::activation::Refusal) -> Response<ProxyBody> {
    done.state.metrics.local_reply(&done.listener, r.reason);
    done.status = r.status.as_u16();
    let mut resp = Response::new(ProxyBody::full(r.body, Some(done)));
    *resp.status_mut() = r.status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    if let Some(secs) = r.retry_after {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    resp
}

/// The cluster's fallback, or a plain 503, when no endpoint is usable.
fn no_endpoint(mut done: Completion, cluster: &UpstreamCluster) -> Response<ProxyBody> {
    let Some(f) = &cluster.config.fallback else {
        return local(
            done,
            StatusCode::SERVICE_UNAVAILABLE,
            "no healthy upstream\n",
            "no_endpoint",
        );
    };
    done.state.metrics.local_reply(&done.listener, "fallback");
    let status = StatusCode::from_u16(f.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    done.status = status.as_u16();
    let mut resp = Response::new(ProxyBody::full(f.body.clone(), Some(done)));
    *resp.status_mut() = status;
    if let Ok(v) = HeaderValue::from_str(&f.content_type) {
        resp.headers_mut().insert(header::CONTENT_TYPE, v);
    }
    resp
}

fn is_idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}

fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
}

/// Removes hop-by-hop headers, and those the `Connection` header names;
/// keeps `Connection: upgrade` and `Upgrade` for a protocol switch.
fn strip_hop_by_hop(headers: &mut HeaderMap, upgrading: bool) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .filter(|h| !(upgrading && h == header::UPGRADE))
        .collect();
    for h in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(h);
    }
    if upgrading {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    } else {
        headers.remove(header::UPGRADE);
    }
}

/// The headers sent upstream: hop-by-hop removed, forwarding headers set.
fn forwarded_headers(
    headers: &HeaderMap,
    client: SocketAddr,
    request_id: &str,
    upgrading: bool,
) -> HeaderMap {
    let mut out = headers.clone();
    strip_hop_by_hop(&mut out, upgrading);
    let ip = client.ip().to_string();
    let xff = match headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
        Some(prev) => format!("{prev}, {ip}"),
        None => ip,
    };
    if let Ok(v) = HeaderValue::from_str(&xff) {
        out.insert(X_FORWARDED_FOR.clone(), v);
    }
    out.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
    if let Ok(v) = HeaderValue::from_str(request_id) {
        out.insert(X_REQUEST_ID.clone(), v);
    }
    out
}

fn build_request(
    parts: &http::request::Parts,
    headers: HeaderMap,
    cluster: &UpstreamCluster,
    index: usize,
    body: UpstreamBody,
) -> Result<Request<UpstreamBody>, http::Error> {
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let uri = Uri::builder()
        .scheme("http")
        .authority(cluster.authorities[index].clone())
        .path_and_query(path)
        .build()?;
    let mut req = Request::new(body);
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    if !req.headers().contains_key(header::HOST)
        && let Some(a) = parts.uri.authority()
        && let Ok(v) = HeaderValue::from_str(a.as_str())
    {
        req.headers_mut().insert(header::HOST, v);
    }
    Ok(req)
}

/// Copies bytes both ways between an upgraded downstream and upstream.
async fn splice_upgrade(down: hyper::upgrade::OnUpgrade, up: hyper::upgrade::OnUpgrade) {
    let (Ok(down), Ok(up)) = (down.await, up.await) else {
        return;
    };
    let mut down = TokioIo::new(down);
    let mut up = TokioIo::new(up);
    let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
}

/// The affinity key's hash, from the configured source.
fn extract_key(
    source: Option<&HashKey>,
    parts: &http::request::Parts,
    client: SocketAddr,
) -> Option<u64> {
    match source? {
        HashKey::Header(name) => parts
            .headers
            .get(name.as_str())
            .map(|v| hash_key(v.as_bytes())),
        HashKey::Path => Some(hash_key(parts.uri.path().as_bytes())),
        HashKey::ClientAddress => Some(hash_key(client.ip().to_string().as_bytes())),
        HashKey::Query(name) => parts.uri.query().and_then(|q| {
            q.split('&')
                .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
                .find(|(k, _)| k == name)
                .map(|(_, v)| hash_key(v.as_bytes()))
        }),
        HashKey::Cookie(name) => parts
            .headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|c| c.trim().split_once('='))
            .find(|(k, _)| k == name)
            .map(|(_, v)| hash_key(v.as_bytes())),
    }
}

/// 128 random bits as 32 hex digits.
fn new_request_id() -> String {
    format!("{:032x}", fastrand::u128(..))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert("x-kept", HeaderValue::from_static("1"));
        let out = forwarded_headers(&h, "10.0.0.9:5000".parse().expect("addr"), "id-1", false);
        assert!(out.get("x-secret").is_none() && out.get("keep-alive").is_none());
        assert!(
            out.get(header::CONNECTION).is_none() && out.get(header::TRANSFER_ENCODING).is_none()
        );
        assert_eq!(out.get("x-kept").map(|v| v.as_bytes()), Some(&b"1"[..]));
        assert_eq!(
            out.get("x-forwarded-for").map(|v| v.as_bytes()),
            Some(&b"10.0.0.9"[..])
        );
        assert_eq!(
            out.get("x-request-id").map(|v| v.as_bytes()),
            Some(&b"id-1"[..])
        );
    }

    #[test]
    fn keys_come_from_the_configured_source() {
        let req = Request::builder()
            .uri("/p?a=1&user=bob")
            .header("x-user", "alice")
            .header("cookie", "theme=dark; session=s1")
            .body(())
            .expect("request");
        let (parts, ()) = req.into_parts();
        let client: SocketAddr = "10.1.2.3:9".parse().expect("addr");
        let k = |s| extract_key(Some(&s), &parts, client);
        assert_eq!(
            k(HashKey::Header("x-user".into())),
            Some(hash_key(b"alice"))
        );
        assert_eq!(k(HashKey::Cookie("session".into())), Some(hash_key(b"s1")));
        assert_eq!(k(HashKey::Query("user".into())), Some(hash_key(b"bob")));
        assert_eq!(k(HashKey::Path), Some(hash_key(b"/p")));
        assert_eq!(k(HashKey::ClientAddress), Some(hash_key(b"10.1.2.3")));
        assert_eq!(k(HashKey::Header("x-none".into())), None);
    }
}
