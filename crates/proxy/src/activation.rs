//! Activation: a request for a `service:` cluster with no ready endpoint
//! (or none under its `container_concurrency`) is held in a bounded
//! per-cluster queue while the control plane starts an instance. The proxy
//! asks for one at once, probes each announced-but-not-ready instance's
//! address itself every few milliseconds, and sends the request the moment
//! one accepts — no extra hop, no wait for a readiness cycle.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use http::StatusCode;
use meshless_model::{Conditions, Endpoint};

use crate::config::Activation;
use crate::metrics::{ActivationLabels, PhaseLabels};
use crate::snapshot::UpstreamCluster;
use crate::state::ProxyState;

/// Why a held request was not sent.
#[derive(Debug)]
pub struct Refusal {
    pub status: StatusCode,
    pub body: String,
    /// Seconds for a `Retry-After` header.
    pub retry_after: Option<u32>,
    pub reason: &'static str,
}

/// Lowers the queued count when the request leaves the queue.
struct Queued<'a>(&'a std::sync::atomic::AtomicU64);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Whether `c` can take a request now: an available endpoint, under the
/// per-instance limit when there is one.
fn has_capacity(c: &UpstreamCluster, limit: u32) -> bool {
    let set = c.lb.set();
    (0..set.len()).any(|i| set.is_available(i) && (limit == 0 || set.load(i) < limit))
}

/// Endpoints of `service` that are announced but not ready yet.
fn starting(state: &ProxyState, service: &str) -> Vec<Endpoint> {
    let services = state
        .services
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    services
        .get(service)
        .map(|eps| {
            eps.iter()
                .filter(|e| !e.conditions.ready && !e.conditions.terminating)
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// Marks an endpoint ready on the proxy's own probe, before the control
/// plane says so, and rebuilds the service's clusters.
fn promote(state: &ProxyState, service: &str, id: &meshless_model::EndpointId) {
    let mut services = state
        .services
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let Some(eps) = services.get_mut(service) else {
        return;
    };
    let Some(e) = eps.iter_mut().find(|e| &e.id == id) else {
        return;
    };
    e.conditions = Conditions::READY;
    let current = state.snapshot.load_full();
    if let Ok(next) = current.with_service(service, &services) {
        state.snapshot.store(Arc::new(next));
    }
    drop(services);
    state.endpoints_changed.notify_waiters();
}

/// Probes the starting endpoints of `service` once; true if one accepted.
async fn probe_once(state: &ProxyState, service: &str, timeout: Duration) -> bool {
    for e in starting(state, service) {
        let Some(addr) = e.socket_addr() else {
            continue;
        };
        if probe(addr, timeout).await {
            promote(state, service, &e.id);
            return true;
        }
    }
    false
}

async fn probe(addr: SocketAddr, timeout: Duration) -> bool {
    matches!(
        tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await,
        Ok(Ok(_))
    )
}

/// Holds a request until `cluster_name` can take it; returns that cluster
/// (from the snapshot current then) or why it cannot be sent.
pub async fn hold(
    state: &Arc<ProxyState>,
    cluster_name: &str,
    service: &str,
    act: &Activation,
    counters: &crate::upstream::ClusterCounters,
) -> Result<Arc<UpstreamCluster>, Refusal> {
    let held = Instant::now();
    let m = &state.metrics;
    let queued = counters.queued.fetch_add(1, Ordering::Relaxed);
    let _queued = Queued(&counters.queued);
    if queued >= u64::from(act.max_queued) {
        m.activations
            .get_or_create(&ActivationLabels {
                result: "queue_full",
            })
            .inc();
        return Err(Refusal {
            status: StatusCode::SERVICE_UNAVAILABLE,
            body: format!("activation queue full ({} held)\n", act.max_queued),
            retry_after: Some(1),
            reason: "queue_full",
        });
    }
    let _ = state.activate.send(service.to_owned());
    let deadline = held + act.queue_timeout;
    let mut announced = false;
    let mut probed = false;
    loop {
        let snap = state.snapshot.load_full();
        if let Some(c) = snap.clusters.get(cluster_name)
            && has_capacity(c, act.container_concurrency)
        {
            m.activation_phase
                .get_or_create(&PhaseLabels { phase: "ready" })
                .observe(held.elapsed().as_secs_f64());
            m.activations
                .get_or_create(&ActivationLabels { result: "sent" })
                .inc();
            return Ok(Arc::clone(c));
        }
        let failure = state
            .activation_errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(service)
            .filter(|(_, at)| *at >= held)
            .map(|(reason, _)| reason.clone());
        if let Some(reason) = failure {
            m.activations
                .get_or_create(&ActivationLabels {
                    result: "start_failed",
                })
                .inc();
            tracing::warn!(service, error = %reason, "held requests fail: instance failed to start");
            return Err(Refusal {
                status: StatusCode::SERVICE_UNAVAILABLE,
                body: format!("{service}: instance failed to start: {reason}\n"),
                retry_after: None,
                reason: "start_failed",
            });
        }
        if Instant::now() >= deadline {
            m.activations
                .get_or_create(&ActivationLabels { result: "timeout" })
                .inc();
            return Err(Refusal {
                status: StatusCode::GATEWAY_TIMEOUT,
                body: format!(
                    "{service}: no instance ready within {:?}\n",
                    act.queue_timeout
                ),
                retry_after: None,
                reason: "activation_timeout",
            });
        }
        if !announced && !starting(state, service).is_empty() {
            announced = true;
            m.activation_phase
                .get_or_create(&PhaseLabels { phase: "announced" })
                .observe(held.elapsed().as_secs_f64());
        }
        // One held request per service probes; the others wait for it.
        let prober = state
            .probing
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(service.to_owned());
        if prober {
            let ok = probe_once(
                state,
                service,
                act.probe_interval.max(Duration::from_millis(50)),
            )
            .await;
            state
                .probing
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(service);
            if ok && !probed {
                probed = true;
                m.activation_phase
                    .get_or_create(&PhaseLabels {
                        phase: "probe_success",
                    })
                    .observe(held.elapsed().as_secs_f64());
                tracing::info!(
                    service,
                    held_to_probe_success_ms = held.elapsed().as_millis() as u64,
                    "activation: instance answered the proxy's probe"
                );
                continue;
            }
        }
        tokio::select! {
            _ = state.endpoints_changed.notified() => {}
            _ = tokio::time::sleep(act.probe_interval) => {}
        }
    }
}
