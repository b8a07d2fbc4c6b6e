//! Background tasks: active health checks per cluster, and the outlier
//! detection tick.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Uri};
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
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
                let uri = Uri::builder()
                    .scheme("http")
                    .authority(authority.clone())
                    .path_and_query(hc.path.as_str())
                    .build();
                let Ok(uri) = uri else { continue };
                let client = client.clone();
                let cluster = Arc::clone(cluster);
                let state = Arc::clone(&state);
                let timeout = hc.timeout;
                tokio::spawn(async move {
                    let req = Request::get(uri)
                        .header("user-agent", "meshless-health-check")
                        .body(Empty::new());
                    let passed = match req {
                        Ok(req) => matches!(
                            tokio::time::timeout(timeout, client.request(req)).await,
                            Ok(Ok(resp)) if resp.status().is_success() || resp.status().is_redirection()
                        ),
                        Err(_) => false,
                    };
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
