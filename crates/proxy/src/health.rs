//! Background tasks: active health checks per cluster, and the outlier
//! detection tick.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Uri};
use http_body_util::{BodyExt, Empty, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use prost::Message as _;
use tokio::sync::watch;

use crate::metrics::EndpointLabels;
use crate::state::ProxyState;

/// Runs until `stop` changes: every 100 ms, checks each cluster's endpoints
/// whose `health_check.interval` has passed, and ticks outlier detection of
/// each cluster every `outlier_detection.interval`. Follows the current
/// snapshot, so reloads take effect at the next round.
pub async fn run(state: Arc<ProxyState>, mut stop: watch::Receiver<bool>) {
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_max_idle_per_host(1)
        .build_http();
    let grpc_client: GrpcClient = Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_max_idle_per_host(1)
        .http2_only(true)
        .build_http();
    let mut last_check: HashMap<String, Instant> = HashMap::new();
    let mut last_tick: HashMap<String, Instant> = HashMap::new();
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
        for (name, cluster) in &snap.clusters {
            let interval = cluster.config.outlier_detection.interval;
            let tick = last_tick.entry(name.clone()).or_insert(now);
            if now.duration_since(*tick) >= interval {
                *tick = now;
                cluster.lb.tick();
            }
            let Some(hc) = &cluster.config.health_check else {
                continue;
            };
            let due = last_check
                .get(name)
                .is_none_or(|t| now.duration_since(*t) >= hc.interval);
            if !due {
                continue;
            }
            last_check.insert(name.clone(), now);
            for (i, authority) in cluster.authorities.iter().enumerate() {
                let client = client.clone();
                let grpc_client = grpc_client.clone();
                let cluster = Arc::clone(cluster);
                let state = Arc::clone(&state);
                let hc = hc.clone();
                let authority = authority.clone();
                tokio::spawn(async move {
                    let check = async {
                        match &hc.grpc {
                            _ if hc.tcp => tcp_check(&authority).await,
                            Some(g) => grpc_check(&grpc_client, &authority, &g.service).await,
                            None => http_check(&client, &authority, &hc.path).await,
                        }
                    };
                    let passed = tokio::time::timeout(hc.timeout, check)
                        .await
                        .unwrap_or(false);
                    cluster.lb.record_health_check(i, passed);
                    let labels = EndpointLabels {
                        cluster: cluster.name.to_string(),
                        endpoint: cluster.lb.endpoints()[i].id.to_string(),
                    };
                    state.metrics.health_checks.get_or_create(&labels).inc();
                    if !passed {
                        state
                            .metrics
                            .health_check_failures
                            .get_or_create(&labels)
                            .inc();
                    }
                });
            }
        }
    }
}

type GrpcClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// Passes when a TCP connection opens (then closed at once).
async fn tcp_check(authority: &Authority) -> bool {
    tokio::net::TcpStream::connect(authority.as_str())
        .await
        .is_ok()
}

/// GET `path`: 2xx and 3xx pass.
async fn http_check(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>,
    authority: &Authority,
    path: &str,
) -> bool {
    let uri = Uri::builder()
        .scheme("http")
        .authority(authority.clone())
        .path_and_query(path)
        .build();
    let Ok(uri) = uri else { return false };
    let req = Request::get(uri)
        .header("user-agent", "meshless-health-check")
        .body(Empty::new());
    let Ok(req) = req else { return false };
    matches!(
        client.request(req).await,
        Ok(resp) if resp.status().is_success() || resp.status().is_redirection()
    )
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
async fn grpc_check(client: &GrpcClient, authority: &Authority, service: &str) -> bool {
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
    let uri = Uri::builder()
        .scheme("http")
        .authority(authority.clone())
        .path_and_query("/grpc.health.v1.Health/Check")
        .build();
    let Ok(uri) = uri else { return false };
    let req = Request::post(uri)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("user-agent", "meshless-health-check")
        .body(Full::new(Bytes::from(framed)));
    let Ok(req) = req else { return false };
    let Ok(resp) = client.request(req).await else {
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
