//! The admin HTTP server: `/metrics`, `/ready`, `/config`, `/clusters`,
//! and `/pick` (lookaside balancing: which endpoint would serve this key).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use meshless_balance::{PickContext, hash_key};
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::metrics::{ClusterLabels, EndpointLabels};
use crate::state::ProxyState;

/// Serves admin requests on `listener` until `stop` changes; then stops
/// accepting and closes each connection after its request in flight.
pub async fn serve(listener: TcpListener, state: Arc<ProxyState>, mut stop: watch::Receiver<bool>) {
    let mut backoff = crate::listener::AcceptBackoff::default();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        let pause = backoff.failed();
                        tracing::warn!(error = %e, ?pause, "admin: accept failed");
                        tokio::time::sleep(pause).await;
                        continue;
                    }
                };
                backoff.reset();
                let state = Arc::clone(&state);
                let mut stopped = stop.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| answer(Arc::clone(&state), req));
                    let builder = auto::Builder::new(TokioExecutor::new());
                    let mut conn = std::pin::pin!(builder.serve_connection(TokioIo::new(stream), service));
                    // Once the server stops (a hand-over: the new process
                    // answers the shared socket), keep-alive clients such
                    // as a metrics scraper are closed after their current
                    // request and reconnect to it.
                    tokio::select! {
                        _ = conn.as_mut() => return,
                        _ = stopped.wait_for(|s| *s) => {}
                    }
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                });
            }
            _ = stop.changed() => break,
        }
    }
}

fn reply(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    r
}

fn json(status: StatusCode, value: &impl Serialize) -> Response<Full<Bytes>> {
    match serde_json::to_vec_pretty(value) {
        Ok(mut v) => {
            v.push(b'\n');
            reply(status, "application/json", v)
        }
        Err(e) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            e.to_string(),
        ),
    }
}

fn query_param<'a>(query: Option<&'a str>, name: &str) -> Option<&'a str> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

async fn answer(
    state: Arc<ProxyState>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let resp = match req.uri().path() {
        "/metrics" => {
            refresh_gauges(&state);
            reply(
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                state.metrics.encode(),
            )
        }
        "/ready" => {
            if !state.ready.load(Ordering::Acquire) {
                reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "not ready\n")
            } else if !state.control_synced.load(Ordering::Acquire) {
                reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    "not ready: waiting for the control plane's first snapshot\n",
                )
            } else {
                reply(StatusCode::OK, "text/plain", "ready\n")
            }
        }
        "/config" => json(StatusCode::OK, &*state.snapshot.load().config),
        "/clusters" => json(StatusCode::OK, &clusters(&state)),
        "/pick" => pick(&state, req.uri().query()),
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "admin: /metrics /ready /config /clusters /pick?cluster=NAME&key=KEY\n",
        ),
    };
    Ok(resp)
}

#[derive(Serialize)]
struct ClusterView {
    name: String,
    policy: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    hash_key: Option<crate::config::HashKey>,
    /// The locality mode, absent when off.
    #[serde(skip_serializing_if = "Option::is_none")]
    locality: Option<meshless_balance::LocalityMode>,
    /// Why the service's settings did not apply (the file's config is used).
    #[serde(skip_serializing_if = "Option::is_none")]
    settings_error: Option<String>,
    active_requests: u64,
    /// Requests sent and waiting for response headers.
    pending_requests: u64,
    /// Retry attempts under way.
    active_retries: u64,
    /// Requests held for activation.
    queued_requests: u64,
    /// Requests released from an activation hold still waiting for their
    /// response headers (each holds a ticket: `release_concurrency`).
    releasing_requests: u64,
    upstream_connections: u64,
    /// Idle HTTP/1.1 connections kept for reuse.
    upstream_idle_connections: u64,
    /// Whether panic mode is on: too few endpoints available, picks go
    /// to all of them (unhealthy and ejected ones included).
    panic: bool,
    endpoints: Vec<EndpointView>,
}

#[derive(Serialize)]
struct EndpointView {
    id: String,
    address: String,
    weight: u32,
    zone: Option<String>,
    node: Option<String>,
    healthy: bool,
    ejected: bool,
    times_ejected: u32,
    in_flight: u32,
    requests: u64,
    failures: u64,
}

fn clusters(state: &ProxyState) -> Vec<ClusterView> {
    let snap = state.snapshot.load();
    let mut out: Vec<ClusterView> = snap
        .clusters
        .values()
        .map(|c| ClusterView {
            name: c.name.to_string(),
            policy: c.config.balancer.policy.clone(),
            hash_key: c.config.balancer.hash_key.clone(),
            locality: c
                .config
                .locality
                .as_ref()
                .filter(|l| l.enabled)
                .map(|l| l.mode),
            settings_error: c.settings_error.as_ref().map(ToString::to_string),
            active_requests: c.counters.active_requests.load(Ordering::Relaxed),
            pending_requests: c.counters.pending.load(Ordering::Relaxed),
            active_retries: c.counters.active_retries.load(Ordering::Relaxed),
            queued_requests: c.counters.queued.load(Ordering::Relaxed),
            releasing_requests: c.counters.releasing.load(Ordering::Relaxed),
            upstream_connections: c.counters.connections.load(Ordering::Relaxed),
            upstream_idle_connections: c.counters.idle_connections.load(Ordering::Relaxed),
            panic: c.lb.in_panic(),
            endpoints: c
                .lb
                .endpoints()
                .iter()
                .enumerate()
                .filter_map(|(i, e)| {
                    let s = c.lb.stats(i)?;
                    Some(EndpointView {
                        id: e.id.to_string(),
                        address: c.authorities[i].to_string(),
                        weight: e.weight,
                        zone: e.zone.clone(),
                        node: e.node.clone(),
                        healthy: s.healthy,
                        ejected: s.ejected,
                        times_ejected: s.times_ejected,
                        in_flight: s.in_flight,
                        requests: s.requests,
                        failures: s.failures,
                    })
                })
                .collect(),
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Lookaside: the endpoint the cluster would choose for `key` now.
fn pick(state: &ProxyState, query: Option<&str>) -> Response<Full<Bytes>> {
    let Some(name) = query_param(query, "cluster") else {
        return reply(
            StatusCode::BAD_REQUEST,
            "text/plain",
            "pick: query parameter `cluster` is required\n",
        );
    };
    let snap = state.snapshot.load();
    let Some(cluster) = snap.clusters.get(name) else {
        return reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            format!("pick: unknown cluster {name:?}\n"),
        );
    };
    let node = &snap.config.node;
    let mut ctx = PickContext::new().with_locality(node.name.as_deref(), node.zone.as_deref());
    if let Some(key) = query_param(query, "key") {
        ctx = ctx.with_key(hash_key(key.as_bytes()));
    }
    match cluster.lb.pick_index(&ctx) {
        Some(i) => {
            let e = &cluster.lb.endpoints()[i];
            json(
                StatusCode::OK,
                &serde_json::json!({
                    "cluster": name,
                    "endpoint": e.id.to_string(),
                    "address": cluster.authorities[i].to_string(),
                    "zone": e.zone,
                    "node": e.node,
                }),
            )
        }
        None => reply(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "pick: no usable endpoint\n",
        ),
    }
}

/// Sets per-endpoint gauges from live state before a scrape; endpoints that
/// left are dropped from the families.
fn refresh_gauges(state: &ProxyState) {
    let m = &state.metrics;
    m.endpoint_in_flight.clear();
    m.endpoint_healthy.clear();
    m.endpoint_ejected.clear();
    m.upstream_connections.clear();
    m.upstream_idle_connections.clear();
    m.cluster_panic.clear();
    let snap = state.snapshot.load();
    for c in snap.clusters.values() {
        m.cluster_panic
            .get_or_create(&ClusterLabels {
                cluster: c.name.to_string(),
            })
            .set(i64::from(c.lb.in_panic()));
        m.upstream_connections
            .get_or_create(&ClusterLabels {
                cluster: c.name.to_string(),
            })
            .set(i64::try_from(c.counters.connections.load(Ordering::Relaxed)).unwrap_or(i64::MAX));
        let idle = c.counters.idle_connections.load(Ordering::Relaxed);
        m.upstream_idle_connections
            .get_or_create(&ClusterLabels {
                cluster: c.name.to_string(),
            })
            .set(i64::try_from(idle).unwrap_or(i64::MAX));
        for (i, e) in c.lb.endpoints().iter().enumerate() {
            let Some(s) = c.lb.stats(i) else { continue };
            let labels = EndpointLabels {
                cluster: c.name.to_string(),
                endpoint: e.id.to_string(),
            };
            m.endpoint_in_flight
                .get_or_create(&labels)
                .set(i64::from(s.in_flight));
            m.endpoint_healthy
                .get_or_create(&labels)
                .set(i64::from(s.healthy));
            m.endpoint_ejected
                .get_or_create(&labels)
                .set(i64::from(s.ejected));
        }
    }
}
