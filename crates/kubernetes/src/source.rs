//! The Kubernetes source: one `kube::runtime::watcher` per resource
//! (Services, EndpointSlices) and namespace, merged in a [`SliceCache`],
//! written to the registry as read-only services and so fanned out to
//! every proxy by the distributor: one watch for the cluster, N proxies.
//!
//! - A full list (at start, after `410 Gone`, after a broken watch) is
//!   buffered from `Init` to `InitDone` and then replaces that resource's
//!   objects in the watcher's namespace at once: what the list lacks is
//!   removed, nothing is removed before the list is complete.
//! - Errors are followed by kube's default backoff (0.8 s doubling to
//!   30 s, jittered); meanwhile the registry keeps the last state, so
//!   proxies keep routing (static stability).
//! - Only what changed is written: per service, the endpoints that differ
//!   from what was last written, and the ids that left.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use futures_util::stream::{BoxStream, SelectAll};
use futures_util::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt, watcher as watch_stream};
use meshless_control::api::{EndpointInput, ServiceSpec};
use meshless_control::kubernetes::{
    AnnotationLabels, EventLabels, KubernetesMetrics, KubernetesSource,
};
use meshless_control::plane::PlaneState;
use meshless_model::EndpointId;
use tokio::sync::watch;

use crate::slices_cache::{Desired, ServiceKey, SliceCache};

/// One watch event, tagged with what was watched.
enum Update {
    Service(Option<String>, Box<Result<Event<Service>, watcher::Error>>),
    Slice(
        Option<String>,
        Box<Result<Event<EndpointSlice>, watcher::Error>>,
    ),
}

/// The watch streams of every resource and namespace, as one stream.
fn streams(client: &kube::Client, cfg: &KubernetesSource) -> SelectAll<BoxStream<'static, Update>> {
    let scopes: Vec<Option<String>> = if cfg.namespaces.is_empty() {
        vec![None]
    } else {
        cfg.namespaces.iter().cloned().map(Some).collect()
    };
    let mut config = watcher::Config::default();
    if let Some(sel) = &cfg.label_selector {
        config = config.labels(sel);
    }
    let mut all = SelectAll::new();
    for scope in scopes {
        let (services, slices): (Api<Service>, Api<EndpointSlice>) = match &scope {
            Some(ns) => (
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client.clone(), ns),
            ),
            None => (Api::all(client.clone()), Api::all(client.clone())),
        };
        let s = scope.clone();
        all.push(
            watch_stream(services, config.clone())
                .default_backoff()
                .into_stream()
                .map(move |e| Update::Service(s.clone(), Box::new(e)))
                .boxed(),
        );
        all.push(
            watch_stream(slices, config.clone())
                .default_backoff()
                .into_stream()
                .map(move |e| Update::Slice(scope.clone(), Box::new(e)))
                .boxed(),
        );
    }
    all
}

/// What one service was last written as.
#[derive(Debug, Default)]
struct Written {
    spec: Option<ServiceSpec>,
    endpoints: BTreeMap<String, EndpointInput>,
}

/// The source's state between events.
pub struct Source {
    state: Arc<PlaneState>,
    cache: SliceCache,
    written: BTreeMap<ServiceKey, Written>,
    /// Per service with bad annotations, per annotation: the error last
    /// reported (each new one is logged and counted once).
    bad_annotations: BTreeMap<ServiceKey, BTreeMap<String, String>>,
    /// Objects listed since `Init`, per (resource, namespace scope).
    service_lists: BTreeMap<Option<String>, Vec<Service>>,
    slice_lists: BTreeMap<Option<String>, Vec<EndpointSlice>>,
    /// The (resource, scope) watches whose first list is written; once
    /// every watch's is, the plane is synced (Ready, snapshots go out).
    listed: std::collections::BTreeSet<(&'static str, Option<String>)>,
    /// How many watches there are (two per namespace scope).
    watches: usize,
    /// Services whose whole endpoint set this process has written once:
    /// the first write of a service replaces what the registry held
    /// (restored from `data_dir`, or registered before the Service).
    replaced: std::collections::BTreeSet<ServiceKey>,
    /// Services whose last write or removal failed (the store refused
    /// it): synced again every [`RETRY`] until it succeeds.
    retry: std::collections::BTreeSet<ServiceKey>,
}

/// How often services whose write failed are tried again.
const RETRY: std::time::Duration = std::time::Duration::from_secs(1);

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Source")
            .field("services", &self.written.len())
            .finish_non_exhaustive()
    }
}

impl Source {
    /// A source writing to `state`'s registry.
    pub fn new(state: Arc<PlaneState>) -> Self {
        Self {
            state,
            cache: SliceCache::default(),
            written: BTreeMap::new(),
            bad_annotations: BTreeMap::new(),
            service_lists: BTreeMap::new(),
            slice_lists: BTreeMap::new(),
            listed: std::collections::BTreeSet::new(),
            watches: usize::MAX,
            replaced: std::collections::BTreeSet::new(),
            retry: std::collections::BTreeSet::new(),
        }
    }

    fn metrics(&self) -> &KubernetesMetrics {
        &self.state.metrics.kubernetes
    }

    /// Watches until `stop` turns true.
    pub async fn run(
        mut self,
        client: kube::Client,
        cfg: KubernetesSource,
        mut stop: watch::Receiver<bool>,
    ) {
        let mut updates = streams(&client, &cfg);
        self.watches = updates.len();
        let mut retry = tokio::time::interval(RETRY);
        loop {
            tokio::select! {
                _ = crate::stopped(&mut stop) => return,
                next = updates.next() => match next {
                    Some(u) => self.handle(u).await,
                    None => return,
                },
                _ = retry.tick(), if !self.retry.is_empty() => {
                    for key in std::mem::take(&mut self.retry) {
                        self.sync(&key).await;
                    }
                }
            }
        }
    }

    fn count(&self, resource: &str, event: &str) {
        self.metrics()
            .events
            .get_or_create(&EventLabels {
                resource: resource.into(),
                event: event.into(),
            })
            .inc();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.metrics().last_sync_timestamp.set(now);
    }

    async fn handle(&mut self, update: Update) {
        let touched = match update {
            Update::Service(scope, e) => match *e {
                Ok(e) => self.service_event(scope, e),
                Err(e) => self.error(&e),
            },
            Update::Slice(scope, e) => match *e {
                Ok(e) => self.slice_event(scope, e),
                Err(e) => self.error(&e),
            },
        };
        for key in touched {
            self.sync(&key).await;
        }
        self.metrics().services.set(self.written.len() as i64);
        if self.listed.len() == self.watches && !self.state.distributor.is_synced() {
            tracing::info!(
                services = self.written.len(),
                "kubernetes source listed; serving snapshots"
            );
            self.state.distributor.mark_synced();
        }
    }

    fn error(&self, e: &watcher::Error) -> Vec<ServiceKey> {
        self.metrics().errors.inc();
        tracing::warn!(error = %e, "kubernetes watch error; serving the last state, retrying with backoff");
        Vec::new()
    }

    fn service_event(&mut self, scope: Option<String>, e: Event<Service>) -> Vec<ServiceKey> {
        match e {
            Event::Init => {
                self.metrics().relists.inc();
                self.service_lists.insert(scope, Vec::new());
                Vec::new()
            }
            Event::InitApply(s) => {
                self.service_lists.entry(scope).or_default().push(s);
                Vec::new()
            }
            Event::InitDone => {
                self.count("service", "relist");
                self.listed.insert(("service", scope.clone()));
                let listed = self.service_lists.remove(&scope).unwrap_or_default();
                self.cache.replace_services(scope.as_deref(), listed)
            }
            Event::Apply(s) => {
                self.count("service", "apply");
                self.cache.apply_service(s).into_iter().collect()
            }
            Event::Delete(s) => {
                self.count("service", "delete");
                self.cache.delete_service(&s).into_iter().collect()
            }
        }
    }

    fn slice_event(&mut self, scope: Option<String>, e: Event<EndpointSlice>) -> Vec<ServiceKey> {
        match e {
            Event::Init => {
                self.metrics().relists.inc();
                self.slice_lists.insert(scope, Vec::new());
                Vec::new()
            }
            Event::InitApply(s) => {
                self.slice_lists.entry(scope).or_default().push(s);
                Vec::new()
            }
            Event::InitDone => {
                self.count("endpointslice", "relist");
                self.listed.insert(("endpointslice", scope.clone()));
                let listed = self.slice_lists.remove(&scope).unwrap_or_default();
                self.cache.replace_slices(scope.as_deref(), listed)
            }
            Event::Apply(s) => {
                self.count("endpointslice", "apply");
                self.cache.apply_slice(s)
            }
            Event::Delete(s) => {
                self.count("endpointslice", "delete");
                self.cache.delete_slice(&s)
            }
        }
    }

    /// Brings the registry's copy of `key` to what the cache says. The
    /// store's transaction (and fsync, with `data_dir`) runs off the
    /// executor's threads: through group commit for a write, on the
    /// blocking pool for a delete, so the plane's streams and heartbeats
    /// never wait behind the disk.
    async fn sync(&mut self, key: &str) {
        match self.cache.desired(key) {
            None => self.remove(key).await,
            Some(d) => self.write(key, d).await,
        }
    }

    /// The Service is gone: its service leaves the registry. Until the
    /// delete is stored the service stays claimed (read-only) and is
    /// retried ([`RETRY`]).
    async fn remove(&mut self, key: &str) {
        self.bad_annotations.remove(key);
        self.replaced.remove(key);
        if !self.written.contains_key(key) {
            return;
        }
        let committed = Instant::now();
        let owned = key.to_owned();
        let deleted = self
            .state
            .with_registry_offloaded(move |state, reg| {
                let deleted = match reg.delete_service(&owned) {
                    Ok(delta) => {
                        state.distributor.publish(&delta, committed);
                        Ok(())
                    }
                    Err(meshless_control::registry::RegistryError::UnknownService(_)) => Ok(()),
                    Err(e) => Err(e),
                };
                if deleted.is_ok() {
                    reg.release(&owned);
                }
                deleted
            })
            .await;
        match deleted {
            Some(Ok(())) => {
                self.written.remove(key);
                self.retry.remove(key);
                tracing::info!(service = key, "kubernetes service removed");
            }
            Some(Err(e)) => {
                tracing::error!(service = key, error = %e, "cannot remove kubernetes service; retrying");
                self.retry.insert(key.to_owned());
            }
            // The runtime is shutting down.
            None => {
                self.retry.insert(key.to_owned());
            }
        }
    }

    /// A bad annotation: the service keeps the settings (or endpoints) it
    /// had; each new error is logged (an event-like line) and counted once.
    fn reject_annotations(&mut self, key: &str, e: &meshless_model::FieldError) {
        let text = e.to_string();
        let seen = self.bad_annotations.entry(key.to_owned()).or_default();
        if seen.get(&e.path) == Some(&text) {
            return;
        }
        seen.insert(e.path.clone(), text);
        self.metrics()
            .annotation_errors
            .get_or_create(&AnnotationLabels {
                annotation: e.path.clone(),
            })
            .inc();
        tracing::warn!(service = key, annotation = %e.path, reason = %e.reason, "bad annotation on Kubernetes Service; keeping its previous settings and endpoints");
    }

    /// Bad annotations keep what `old` had (settings, or endpoints when the
    /// port annotation names no port); each new error is reported once.
    fn check_annotations(&mut self, key: &str, d: &mut Desired, old: &Written) {
        let mut errors = Vec::new();
        if let Some(e) = d.settings_error.take() {
            d.spec.settings = old
                .spec
                .as_ref()
                .map(|s| s.settings.clone())
                .unwrap_or_default();
            errors.push(e);
        }
        if let Some(e) = d.port_error.take() {
            // A port annotation naming no port: the endpoints stay as they
            // were, not all removed.
            d.endpoints = old.endpoints.values().cloned().collect();
            errors.push(e);
        }
        if errors.is_empty() {
            if self.bad_annotations.remove(key).is_some() {
                tracing::info!(service = key, "Kubernetes Service annotations valid again");
            }
        } else {
            if let Some(seen) = self.bad_annotations.get_mut(key) {
                seen.retain(|path, _| errors.iter().any(|e| e.path == *path));
            }
            for e in &errors {
                self.reject_annotations(key, e);
            }
        }
    }

    async fn write(&mut self, key: &str, mut d: Desired) {
        if d.skipped > 0 {
            self.metrics().skipped_endpoints.inc_by(d.skipped);
        }
        let old = self.written.remove(key).unwrap_or_default();
        // Replace the registry's set once, unless the endpoints are unknown.
        let replace = !self.replaced.contains(key) && d.port_error.is_none();
        self.check_annotations(key, &mut d, &old);
        let spec_changed = old.spec.as_ref() != Some(&d.spec);
        let puts: Vec<EndpointInput> = d
            .endpoints
            .iter()
            .filter(|e| old.endpoints.get(&e.id) != Some(*e))
            .cloned()
            .collect();
        let wanted: BTreeMap<String, EndpointInput> =
            d.endpoints.into_iter().map(|e| (e.id.clone(), e)).collect();
        let deletes: Vec<EndpointId> = old
            .endpoints
            .keys()
            .filter(|id| !wanted.contains_key(*id))
            .map(EndpointId::new)
            .collect();
        let origin = format!("Kubernetes Service {key}");
        let spec = d.spec.clone();
        let owned = key.to_owned();
        let wanted_ids: BTreeSet<String> = if replace {
            wanted.keys().cloned().collect()
        } else {
            BTreeSet::new()
        };
        let result = self
            .state
            .write_offloaded(move |r| {
                let key = owned.as_str();
                let mut deletes = deletes;
                if replace {
                    deletes.extend(stale_ids(r, key, &wanted_ids, &deletes));
                }
                if spec_changed || r.owner(key).is_none() {
                    r.put_service(spec)?;
                    r.claim(key, origin);
                }
                if !puts.is_empty() {
                    r.put_endpoints(key, puts)?;
                }
                if !deletes.is_empty() {
                    r.delete_endpoints(key, &deletes, false)?;
                }
                Ok(())
            })
            .await;
        match result {
            Ok(()) => {
                self.retry.remove(key);
                if replace {
                    self.replaced.insert(key.to_owned());
                }
                self.written.insert(
                    key.to_owned(),
                    Written {
                        spec: Some(d.spec),
                        endpoints: wanted,
                    },
                );
            }
            Err(e) => {
                // Nothing was stored: the whole service is tried again.
                tracing::error!(service = key, error = %e, "cannot write kubernetes service; retrying");
                self.retry.insert(key.to_owned());
                if !old.endpoints.is_empty() || old.spec.is_some() {
                    self.written.insert(key.to_owned(), old);
                }
            }
        }
    }
}

/// Endpoint ids the registry holds for `key` that are neither wanted nor
/// already in `deletes`: what this process did not write (restored from
/// the store, or registered before the Service was listed).
fn stale_ids(
    r: &meshless_control::registry::Registry,
    key: &str,
    wanted: &BTreeSet<String>,
    deletes: &[EndpointId],
) -> Vec<EndpointId> {
    r.view(key)
        .map(|v| v.endpoints)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| !wanted.contains(&e.id) && !deletes.iter().any(|d| d.as_str() == e.id))
        .map(|e| EndpointId::new(e.id))
        .collect()
}
