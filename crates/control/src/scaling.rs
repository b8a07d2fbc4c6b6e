//! Autoscaled services: one loop per service joins the proxies' load
//! reports, the KPA autoscaler and a scaler. With the process scaler, each
//! instance is registered as a not-ready endpoint the moment it is spawned
//! (so proxies can probe it themselves), marked ready when its port
//! accepts, marked terminating and drained before it is stopped, and
//! replaced with backoff when it exits on its own. A start failure is
//! announced to proxies so requests held for the service fail at once.
//!
//! A process instance cannot outlive its control plane: on shutdown every
//! instance's endpoint is removed (stored) before its process is stopped,
//! and on start the loop removes the stored endpoints of instances it does
//! not run (left by a crash: ids `NS-NAME-N`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use meshless_model::{Conditions, EndpointId};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::api::{EndpointInput, RemoteLoad};
use crate::autoscaler::Autoscaler;
use crate::config::{ScalerConfig, ServiceScaling};
use crate::kubernetes::{ScaleOutcome, ScaleRequest, ScaleTarget};
use crate::metrics::ReadyLabels;
use crate::process_scaler::{self, ProcessSpec};
use crate::registry::Registry;
use crate::starts::InstanceStart;
use crate::state::PlaneState;
use crate::webhook::Webhook;

/// How long a drained instance keeps running after its endpoint is
/// removed, so the removal reaches proxies before the process stops
/// (capped by the service's drain period).
const DEREGISTER_GRACE: Duration = Duration::from_secs(1);

/// What the scaling loop tells an instance's task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    Run,
    /// Scaled down: terminating, drained, then stopped.
    ScaleDown,
    /// The control plane stops: endpoint removed at once, then stopped.
    Shutdown,
}

/// How often the Kubernetes scaler sets its target's replicas again when
/// its decision did not change (every tick while requests are held and no
/// instance runs).
const REASSERT_EVERY: Duration = Duration::from_secs(30);

/// One instance run by the process scaler.
#[derive(Debug)]
struct Managed {
    id: String,
    ready: Arc<AtomicBool>,
    /// Set when the instance is gone (exited, failed, or stopped).
    gone: Arc<AtomicBool>,
    order: watch::Sender<Order>,
    task: JoinHandle<()>,
}

/// Counts the instances of one service whose task has not ended: one
/// instance's failed start fails the held requests only when no other
/// instance is starting or running (the last one out reports).
#[derive(Debug)]
struct LiveInstance(Option<Arc<AtomicUsize>>);

impl LiveInstance {
    fn enter(live: &Arc<AtomicUsize>) -> Self {
        live.fetch_add(1, Ordering::AcqRel);
        Self(Some(Arc::clone(live)))
    }

    /// Leaves the count; the number of other instances still in it.
    fn leave(mut self) -> usize {
        self.0
            .take()
            .map_or(0, |live| live.fetch_sub(1, Ordering::AcqRel) - 1)
    }
}

impl Drop for LiveInstance {
    fn drop(&mut self) {
        if let Some(live) = self.0.take() {
            live.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// A start failed: held requests fail with `error` unless another
/// instance of the service is starting or running.
fn start_failed(state: &PlaneState, service: &str, id: &str, live: LiveInstance, error: &str) {
    tracing::error!(service, instance = %id, error, "instance failed to start");
    state.metrics.instance_start_failures.inc();
    let others = live.leave();
    if others == 0 {
        state.distributor.publish_activation_error(service, error);
    } else {
        tracing::info!(
            service,
            others,
            "held requests wait for the other instances"
        );
    }
}

fn conditions(ready: bool, terminating: bool) -> Conditions {
    Conditions {
        ready,
        serving: ready || terminating,
        terminating,
    }
}

/// Where an instance is: its address and the node it is labelled with.
#[derive(Debug, Clone)]
struct Placed {
    address: std::net::SocketAddr,
    node: Option<String>,
}

/// Registers the instance with conditions `c`; while it starts, proxies
/// may probe it unless `probed` is false (`readiness: notify`). The write
/// never blocks the executor on the disk ([`PlaneState::write_offloaded`]).
async fn put(
    state: &PlaneState,
    service: &str,
    id: &str,
    at: &Placed,
    c: Conditions,
    probed: bool,
) {
    let input = EndpointInput {
        id: id.to_owned(),
        addresses: vec![at.address.ip()],
        port: at.address.port(),
        weight: 1,
        zone: None,
        node: at.node.clone(),
        conditions: c,
        ttl_seconds: None,
        // Not ready only while starting: proxies may probe it.
        starting: probed && !c.ready && !c.terminating,
    };
    let owned = service.to_owned();
    let write = move |r: &mut Registry| r.put_endpoints(&owned, vec![input]);
    if let Err(e) = state.write_offloaded(write).await {
        tracing::error!(service, instance = id, error = %e, "cannot register instance");
    }
}

async fn remove(state: &PlaneState, service: &str, id: &str) {
    let ids = [EndpointId::new(id)];
    let owned = service.to_owned();
    let write = move |r: &mut Registry| r.delete_endpoints(&owned, &ids, false);
    if let Err(e) = state.write_offloaded(write).await {
        tracing::error!(service, instance = id, error = %e, "cannot remove instance");
    }
}

/// Whether `id` names an instance of `service` run by the process scaler
/// (`NS-NAME-N`, as [`run`] names them).
fn is_instance_id(service: &str, id: &str) -> bool {
    id.strip_prefix(&service.replace('/', "-"))
        .and_then(|rest| rest.strip_prefix('-'))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Removes the endpoints of process instances of `service` that this
/// control plane does not run: restored from the store after a crash (or a
/// shutdown whose removal did not complete). Their processes died with the
/// plane or run unmanaged; either way proxies must not use them, and with
/// them gone a request at zero activates a fresh instance.
async fn forget_stale_instances(state: &Arc<PlaneState>, service: &str) {
    let owned = service.to_owned();
    let stale: Vec<EndpointId> = state
        .with_registry(move |_, r| {
            r.view(&owned).map_or_else(Vec::new, |v| {
                v.endpoints
                    .iter()
                    .filter(|e| is_instance_id(&owned, &e.id))
                    .map(|e| EndpointId::new(e.id.as_str()))
                    .collect()
            })
        })
        .await
        .unwrap_or_default();
    if stale.is_empty() {
        return;
    }
    tracing::warn!(
        service,
        count = stale.len(),
        "removing stored endpoints of instances this control plane does not run"
    );
    let owned = service.to_owned();
    let write = move |r: &mut Registry| r.delete_endpoints(&owned, &stale, false);
    if let Err(e) = state.write_offloaded(write).await {
        tracing::error!(service, error = %e, "cannot remove stale instances");
    }
}

/// Sleeps `d`, or less when the control plane shuts down; returns whether
/// it does.
async fn sleep_unless_shutdown(order: &mut watch::Receiver<Order>, d: Duration) -> bool {
    let sleep = tokio::time::sleep(d);
    tokio::pin!(sleep);
    loop {
        if *order.borrow_and_update() == Order::Shutdown {
            return true;
        }
        tokio::select! {
            () = &mut sleep => return false,
            r = order.changed() => if r.is_err() { return true },
        }
    }
}

/// What one instance's task needs.
struct InstanceJob {
    state: Arc<PlaneState>,
    service: String,
    spec: ProcessSpec,
    id: String,
    ready: Arc<AtomicBool>,
    gone: Arc<AtomicBool>,
    drain: Duration,
    /// The node of the proxy whose activation request started it: the
    /// process scaler runs it locally and labels its endpoint so.
    node: Option<String>,
    /// When the stream read that activation request.
    read: Option<Instant>,
    /// When that activation request woke the scaling loop.
    asked: Option<Instant>,
    /// Counts it among the service's live instances.
    live: LiveInstance,
}

/// Runs one process instance for its whole life.
async fn run_instance(job: InstanceJob, mut stop: watch::Receiver<Order>) {
    let InstanceJob {
        state,
        service,
        spec,
        id,
        ready,
        gone,
        drain,
        node,
        read,
        asked,
        live,
    } = job;
    let spawning = Instant::now();
    let mut inst = match process_scaler::spawn(&spec, &id, &state.metrics.notify) {
        Ok(i) => i,
        Err(e) => {
            start_failed(&state, &service, &id, live, &e.to_string());
            gone.store(true, Ordering::Relaxed);
            return;
        }
    };
    let address = inst.address;
    let at = Placed { address, node };
    let spawned = Instant::now();
    // Announced at once, not ready: proxies may probe it directly.
    put(
        &state,
        &service,
        &id,
        &at,
        conditions(false, false),
        spec.probed(),
    )
    .await;
    tokio::select! {
        r = process_scaler::wait_ready(&spec, &mut inst) => match r {
            Ok(r) => {
                // Published first: held requests wait for this delta.
                ready.store(true, Ordering::Relaxed);
                put(&state, &service, &id, &at, conditions(true, false), spec.probed()).await;
                let published = Instant::now();
                // Recorded before the metrics count it: whoever sees the count
                // finds the record.
                state.starts.record(InstanceStart { service: service.clone(), id: id.clone(), read, asked, spawning, ready: inst.started + r.took, via: r.via.label(), published });
                state.metrics.instance_start.observe(spawned.elapsed().as_secs_f64());
                state.metrics.instances_ready.get_or_create(&ReadyLabels { via: r.via.label() }).inc();
                tracing::info!(service, instance = %id, %address, spawn_to_ready_ms = r.took.as_millis() as u64, via = r.via.label(), "instance ready");
            }
            Err(e) => {
                remove(&state, &service, &id).await;
                start_failed(&state, &service, &id, live, &e.to_string());
                process_scaler::stop(inst, spec.stop_grace).await;
                gone.store(true, Ordering::Relaxed);
                return;
            }
        },
        _ = stop.changed() => {
            remove(&state, &service, &id).await;
            process_scaler::stop(inst, spec.stop_grace).await;
            gone.store(true, Ordering::Relaxed);
            return;
        }
    }
    tokio::select! {
        status = inst.wait() => {
            tracing::warn!(service, instance = %id, status = ?status, "instance exited; it will be replaced");
            remove(&state, &service, &id).await;
        }
        _ = stop.changed() => {
            // On shutdown, the removal is stored before the store closes.
            if *stop.borrow_and_update() != Order::Shutdown {
                // Terminating: no new requests; in-flight ones get the drain period.
                put(&state, &service, &id, &at, conditions(false, true), spec.probed()).await;
                let shutdown = sleep_unless_shutdown(&mut stop, drain).await;
                remove(&state, &service, &id).await;
                // The delete takes a moment to reach every proxy, and one with
                // no ready endpoint still uses a terminating one as its
                // fallback: the instance outlives its registration a little
                // (Kubernetes users get the same from a preStop sleep).
                if !shutdown {
                    sleep_unless_shutdown(&mut stop, DEREGISTER_GRACE.min(drain)).await;
                }
            } else {
                remove(&state, &service, &id).await;
            }
            process_scaler::stop(inst, spec.stop_grace).await;
        }
    }
    gone.store(true, Ordering::Relaxed);
}

/// Endpoints of `service` that are not terminating: the instances a
/// Kubernetes scaler has running (they arrive through the source).
async fn registered(state: &Arc<PlaneState>, service: &str) -> u32 {
    let owned = service.to_owned();
    state
        .with_registry(move |_, r| {
            r.view(&owned).map_or(0, |v| {
                v.endpoints
                    .iter()
                    .filter(|e| !e.conditions.terminating)
                    .count() as u32
            })
        })
        .await
        .unwrap_or(0)
}

/// Sets the replicas of `target` through the Kubernetes side (from zero,
/// with the asking proxy's `node` for node-local activation); returns the
/// count now set, or `None` to try again on the next decision (not the
/// leader, no Kubernetes side connected, or an error).
async fn scale_kubernetes(
    state: &PlaneState,
    service: &str,
    target: &ScaleTarget,
    desired: u32,
    node: Option<&str>,
) -> Option<u32> {
    let Some(scaler) = state.replica_scaler.get() else {
        // The file requires `kubernetes:` with this scaler: its side is still starting.
        tracing::debug!(
            service,
            "scaler kubernetes: the Kubernetes side has not started yet"
        );
        return None;
    };
    let namespace = target
        .namespace
        .clone()
        .unwrap_or_else(|| service.split('/').next().unwrap_or_default().to_owned());
    let request = ScaleRequest {
        service,
        namespace: &namespace,
        target,
        replicas: desired,
        node,
    };
    match scaler.scale(request).await {
        Ok(ScaleOutcome::Scaled) => {
            tracing::info!(service, target = %target.name, desired, node, "replicas set");
            Some(desired)
        }
        Ok(ScaleOutcome::NotLeader) => None,
        Err(e) => {
            tracing::warn!(service, target = %target.name, error = %e, "cannot set replicas");
            None
        }
    }
}

/// While another replica leads: forwards this replica's load of `service`
/// (and whether a proxy asked for an instance, from `node`) to the leader,
/// which decides. Whether the leader took it.
async fn follow_leader(
    http: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    state: &PlaneState,
    service: &str,
    activate: bool,
    node: &str,
) -> bool {
    let Some((leader, me)) = state.replica_scaler.get().and_then(|s| s.leader_api()) else {
        return false;
    };
    let (in_flight, queued) = state.distributor.local_load(service);
    let report = RemoteLoad {
        replica: me,
        in_flight,
        queued,
        activate,
        node: node.to_owned(),
    };
    forward_load(http, state, &leader, service, &report).await
}

/// Sends `report` (this follower's load of `service`) to the leader's API
/// at `leader`; whether it was taken. Bounded: a leader that does not
/// answer within [`FORWARD_TIMEOUT`] misses this report, not the loop.
async fn forward_load(
    http: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    state: &PlaneState,
    leader: &str,
    service: &str,
    report: &RemoteLoad,
) -> bool {
    let body = match serde_json::to_vec(report) {
        Ok(b) => b,
        Err(_) => return false,
    };
    let mut req = http::Request::post(format!("http://{leader}/v1/services/{service}/load"))
        .header("content-type", "application/json");
    if let Some(auth) = state.auth.header() {
        req = req.header("authorization", auth);
    }
    let Ok(req) = req.body(Full::new(Bytes::from(body))) else {
        tracing::warn!(service, leader, "leader address is not usable in a URL");
        return false;
    };
    match tokio::time::timeout(FORWARD_TIMEOUT, http.request(req)).await {
        Ok(Ok(r)) if r.status().is_success() => true,
        Ok(Ok(r)) => {
            tracing::warn!(service, leader, status = %r.status(), "leader refused the forwarded load");
            false
        }
        Ok(Err(e)) => {
            tracing::warn!(service, leader, error = %e, "cannot forward load to the leader");
            false
        }
        Err(_) => {
            tracing::warn!(
                service,
                leader,
                "leader did not take the forwarded load in time"
            );
            false
        }
    }
}

/// How long a follower waits for the leader to take one load report.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(2);

/// The scaling loop of one service, until `stop` changes.
pub async fn run(
    state: Arc<PlaneState>,
    service: String,
    cfg: ServiceScaling,
    mut stop: watch::Receiver<bool>,
) {
    let mut autoscaler = Autoscaler::new(cfg.autoscale.clone());
    let started = Instant::now();
    let activation = state.distributor.activation(&service);
    if matches!(cfg.scaler, ScalerConfig::Process(_)) {
        forget_stale_instances(&state, &service).await;
    }
    let mut instances: Vec<Managed> = Vec::new();
    // Scaled down, still draining: stopped at once on shutdown.
    let mut draining: Vec<Managed> = Vec::new();
    let mut serial = 0u64;
    let live = Arc::new(AtomicUsize::new(0));
    let mut backoff = Duration::from_millis(100);
    let mut last_failure: Option<Instant> = None;
    let mut external_desired: Option<u32> = None;
    // When the Kubernetes scaler last set the replicas.
    let mut asserted: Option<Instant> = None;
    // A follower's calls to the leader (its proxies' load, activations).
    let http: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    // Its calls run beside the loop: a hung webhook never holds it up.
    let webhook = match &cfg.scaler {
        ScalerConfig::Webhook { url, timeout } => Some(Webhook::start(
            service.clone(),
            url.clone(),
            *timeout,
            cfg.tick,
            state.metrics.webhook_failures.clone(),
        )),
        _ => None,
    };
    let mut tick = tokio::time::interval(cfg.tick);
    // When a proxy last asked for activation, until an instance is spawned for it.
    let mut woken: Option<Instant> = None;
    // When the stream read the first activation request since the last spawn.
    let mut read: Option<Instant> = None;
    // Kubernetes: the node of the last activation request, until a scale
    // call succeeds.
    let mut asking_node: Option<String> = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = activation.notified() => {
                woken = Some(Instant::now());
                read = read.or(state.distributor.take_activation_read(&service));
            }
            _ = stop.changed() => break,
        }
        // Instances that died count as failures for the backoff.
        let before = instances.len();
        instances.retain(|m| !m.gone.load(Ordering::Relaxed));
        if instances.len() < before {
            last_failure = Some(Instant::now());
        }
        draining.retain(|m| !m.gone.load(Ordering::Relaxed));
        let (in_flight, queued) = state.distributor.load(&service);
        let now = started.elapsed();
        autoscaler.record(now, (in_flight + queued) as f64);
        let running = match &cfg.scaler {
            ScalerConfig::Kubernetes(_) => registered(&state, &service).await,
            _ => instances.len() as u32,
        };
        let mut d = autoscaler.decide(now, running);
        if queued > 0 && d.desired == 0 {
            d.desired = 1;
        }
        match &cfg.scaler {
            ScalerConfig::Webhook { .. } => {
                if let Some(w) = &webhook {
                    w.set(d.desired);
                }
            }
            ScalerConfig::Kubernetes(target) => {
                if let Some(n) = state.distributor.take_activation_node(&service) {
                    asking_node = Some(n);
                }
                if !state.replica_scaler.get().is_some_and(|s| s.leads()) {
                    // Not deciding here: once this replica leads, it
                    // observes a full window before any scale-down.
                    autoscaler.restart_observation();
                    let node = asking_node.as_deref().unwrap_or_default();
                    if follow_leader(&http, &state, &service, woken.is_some(), node).await {
                        woken = None;
                    }
                }
                // Set again although unchanged once due: a change made
                // behind its back (`kubectl scale`, a GitOps sync, the
                // leader while this replica was not) is undone.
                let every = if queued > 0 && running == 0 {
                    cfg.tick
                } else {
                    REASSERT_EVERY
                };
                let due = asserted.is_none_or(|t| t.elapsed() >= every);
                // Warming up, only a demand above what runs is written:
                // the workload may run more than the registry shows yet.
                let demand = in_flight + queued > 0 && d.desired > running;
                if (external_desired != Some(d.desired) || due) && (!d.warming || demand) {
                    // The node matters only for the first instance.
                    let node = asking_node
                        .as_deref()
                        .filter(|_| running == 0 && d.desired > 0);
                    external_desired =
                        scale_kubernetes(&state, &service, target, d.desired, node).await;
                    if external_desired.is_some() {
                        asserted = Some(Instant::now());
                        asking_node = None;
                    }
                }
            }
            ScalerConfig::Process(spec) => {
                let backing_off = last_failure.is_some_and(|t| t.elapsed() < backoff);
                if (instances.len() as u32) < d.desired && !backing_off {
                    if last_failure.is_some() {
                        backoff = (backoff * 2).min(Duration::from_secs(10));
                    }
                    while (instances.len() as u32) < d.desired {
                        serial += 1;
                        let id = format!("{}-{serial}", service.replace('/', "-"));
                        let (tx, rx) = watch::channel(Order::Run);
                        let ready = Arc::new(AtomicBool::new(false));
                        let gone = Arc::new(AtomicBool::new(false));
                        let job = InstanceJob {
                            state: Arc::clone(&state),
                            service: service.clone(),
                            spec: spec.clone(),
                            id: id.clone(),
                            ready: Arc::clone(&ready),
                            gone: Arc::clone(&gone),
                            drain: cfg.drain_period,
                            node: state.distributor.take_activation_node(&service),
                            read: read.take(),
                            asked: woken,
                            live: LiveInstance::enter(&live),
                        };
                        let m = Managed {
                            id,
                            ready,
                            gone,
                            order: tx,
                            task: tokio::spawn(run_instance(job, rx)),
                        };
                        if let Some(t) = woken.take() {
                            state
                                .metrics
                                .activation_to_spawn
                                .observe(t.elapsed().as_secs_f64());
                        }
                        instances.push(m);
                    }
                } else if last_failure.is_some_and(|t| t.elapsed() > Duration::from_secs(30)) {
                    backoff = Duration::from_millis(100);
                    last_failure = None;
                }
                while (instances.len() as u32) > d.desired {
                    // Stop the newest (least warmed-up) first.
                    if let Some(m) = instances.pop() {
                        tracing::info!(service, instance = %m.id, ready = m.ready.load(Ordering::Relaxed), "scaling down");
                        let _ = m.order.send(Order::ScaleDown);
                        draining.push(m);
                    }
                }
            }
        }
        // Ahead-of-time placement: a node is chosen for the next instance
        // while there is none. Only the process scaler and the Kubernetes
        // scaler with `node_local` start an instance on the asking node;
        // placing for the others would add a hop.
        let local = match &cfg.scaler {
            ScalerConfig::Process(_) => true,
            ScalerConfig::Kubernetes(t) => t.node_local,
            ScalerConfig::Webhook { .. } => false,
        };
        let at_zero = local && instances.is_empty() && registered(&state, &service).await == 0;
        state.distributor.placements.set_at_zero(&service, at_zero);
    }
    state.distributor.placements.forget(&service);
    // Every instance's endpoint is removed before its process is stopped;
    // the plane waits for this task before it closes the store.
    let all: Vec<Managed> = instances.into_iter().chain(draining).collect();
    for m in &all {
        let _ = m.order.send(Order::Shutdown);
    }
    for m in all {
        let _ = m.task.await;
    }
}
