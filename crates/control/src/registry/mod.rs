//! The registry: the desired state of every service (spec, endpoints,
//! slices) with a version that grows on every write, persisted write by
//! write, and the deltas that writes produce for distribution.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use meshless_model::{AtPath, Endpoint, EndpointId, FieldError, MAX_WEIGHT, ServiceSettings};

pub use crate::api::{
    EndpointInput, EndpointView, MAX_TTL_SECONDS, ServicePort, ServiceSpec, ServiceView, SliceView,
};
use crate::reconciler::SliceSet;
pub use crate::store::{ServiceRecord, StoredEndpoint};

mod group;
mod restore;
mod slices;
use crate::store::{Storage, Store, StoreError, WriteBatch};
pub use group::GroupFailed;

fn into_stored(input: EndpointInput) -> StoredEndpoint {
    StoredEndpoint {
        endpoint: Endpoint {
            id: EndpointId::new(input.id),
            addresses: input.addresses,
            port: input.port,
            weight: input.weight,
            zone: input.zone,
            node: input.node,
            conditions: input.conditions,
            starting: input.starting && !input.conditions.ready && !input.conditions.terminating,
        },
        ttl_seconds: input.ttl_seconds,
    }
}

/// A rejected write; nothing was stored.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error(transparent)]
    Invalid(#[from] FieldError),
    #[error("unknown service {0:?}")]
    UnknownService(String),
    /// A bulk call's delete of an endpoint the service does not hold: `at`
    /// names it in the request (`delete[i]`).
    #[error("{at}: service {service:?} has no endpoint {id:?}")]
    UnknownEndpointAt {
        at: String,
        service: String,
        id: String,
    },
    #[error("service {service:?} has no endpoint {id:?}")]
    UnknownEndpoint { service: String, id: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> RegistryError {
    RegistryError::Invalid(FieldError::new(field, reason))
}

/// What changed in one service, for distribution: endpoints (with the
/// slice now holding them) and removed ids. `reset` means the receiver
/// replaces its whole view of the service with `upserted`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceDelta {
    pub service: String,
    pub version: u64,
    pub upserted: Vec<(Endpoint, String)>,
    pub removed: Vec<EndpointId>,
    pub reset: bool,
    /// The scaler could not start an instance: held requests fail at once.
    pub activation_error: Option<String>,
    /// The service's settings: set in every reset and when they changed
    /// (`None` in a reset = no settings).
    pub settings: Option<ServiceSettings>,
}

/// One service's live state.
#[derive(Debug)]
struct Service {
    spec: ServiceSpec,
    version: u64,
    endpoints: BTreeMap<EndpointId, StoredEndpoint>,
    expires: HashMap<EndpointId, Instant>,
    slices: SliceSet,
    /// Endpoints changed since the last reconcile.
    dirty: BTreeSet<EndpointId>,
    /// Settings changed since the last reconcile.
    settings_dirty: bool,
    last_change: Instant,
    compacted_since_change: bool,
}

/// Every service, versioned and persisted.
#[derive(Debug)]
pub struct Registry {
    version: u64,
    services: BTreeMap<String, Service>,
    store: Option<Box<dyn Storage>>,
    max_per_slice: usize,
    /// Inside a group ([`Registry::begin_group`]): the batches staged for
    /// one commit; memory already holds them.
    staged: Option<Vec<WriteBatch>>,
    /// Set when memory could not be reloaded after a failed group commit,
    /// or the store was closed: every later write fails with it.
    broken: Option<StoreError>,
    /// Services another source owns (key -> where they come from): the
    /// registration API refuses to change them. Not persisted: a source
    /// claims its services again when it starts.
    owners: BTreeMap<String, String>,
}

/// Why `input` cannot be registered beyond its id and ranges: an address
/// no proxy can dial as an instance (unspecified = the proxy itself,
/// multicast, broadcast), an address listed twice, or a zone or node name
/// longer than Kubernetes allows (63, 253). The field path under `at`.
fn check_placement(at: &str, input: &EndpointInput) -> Result<(), RegistryError> {
    let mut seen = BTreeSet::new();
    for (j, a) in input.addresses.iter().enumerate() {
        let broadcast = matches!(a, std::net::IpAddr::V4(v4) if v4.is_broadcast());
        if a.is_unspecified() || a.is_multicast() || broadcast {
            return Err(invalid(
                format!("{at}.addresses[{j}]"),
                format!("{a} is not an instance address (unspecified, multicast or broadcast)"),
            ));
        }
        if !seen.insert(*a) {
            return Err(invalid(
                format!("{at}.addresses[{j}]"),
                format!("duplicate address {a}"),
            ));
        }
    }
    for (field, value, max) in [("zone", &input.zone, 63), ("node", &input.node, 253)] {
        if let Some(v) = value
            && (v.len() > max || v.chars().any(|c| c.is_control() || c.is_whitespace()))
        {
            return Err(invalid(
                format!("{at}.{field}"),
                format!("must be at most {max} characters, without spaces or control characters"),
            ));
        }
    }
    Ok(())
}

/// An endpoint's validation error at the field it concerns (under `at`),
/// without the model's "endpoint ID:" prefix.
fn endpoint_invalid(at: &str, err: &meshless_model::EndpointError) -> RegistryError {
    use meshless_model::EndpointError as E;
    let field = match err {
        E::EmptyId => "id",
        E::NoAddress { .. } => "addresses",
        E::ZeroPort { .. } => "port",
        E::BadWeight { .. } => "weight",
        E::InconsistentConditions { .. } => "conditions",
    };
    let text = err.to_string();
    // "endpoint ID: FIELD: reason" / "endpoint id: reason": the reason.
    let reason = text
        .split_once(&format!("{field}: "))
        .map_or(text.as_str(), |(_, r)| r);
    invalid(format!("{at}.{field}"), reason.to_owned())
}

fn validate_name(field: &str, value: &str, max: usize) -> Result<(), RegistryError> {
    let ok = !value.is_empty()
        && value.len() <= max
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !value.starts_with('-')
        && !value.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!(
                "{value:?} must be 1..={max} lowercase letters, digits, '-' or '.', not starting or ending with '-'"
            ),
        ))
    }
}

/// Checks a service as [`Registry::put_service`] does, without writing
/// it: names, ports and settings. The error names the field.
pub fn check_service_spec(spec: &ServiceSpec) -> Result<(), RegistryError> {
    validate_name("namespace", &spec.namespace, 63)?;
    validate_name("name", &spec.name, 63)?;
    let mut seen = BTreeSet::new();
    let mut names = BTreeSet::new();
    for (i, p) in spec.ports.iter().enumerate() {
        if let Some(name) = &p.name {
            validate_name(&format!("ports[{i}].name"), name, 63)?;
            if !names.insert(name.as_str()) {
                return Err(invalid(
                    format!("ports[{i}].name"),
                    format!("duplicate port name {name:?}"),
                ));
            }
        }
        if p.port == 0 {
            return Err(invalid(format!("ports[{i}].port"), "must be 1..=65535"));
        }
        if !matches!(p.protocol.as_str(), "TCP" | "UDP" | "SCTP") {
            return Err(invalid(
                format!("ports[{i}].protocol"),
                "must be TCP, UDP or SCTP",
            ));
        }
        if !seen.insert((p.port, p.protocol.clone())) {
            return Err(invalid(format!("ports[{i}]"), "duplicate port"));
        }
    }
    spec.settings.validate().at("settings")?;
    Ok(())
}

/// Checks endpoints as [`Registry::put_endpoints`] does, without writing
/// them: ranges, placement, addresses, and each id once. `list` names the
/// list in errors: `put` in the API's bulk body (`put[1].weight`),
/// `endpoints` in a file.
pub fn check_endpoints(list: &str, inputs: &[EndpointInput]) -> Result<(), RegistryError> {
    checked_endpoints(list, inputs.to_vec()).map(drop)
}

/// The endpoints to store, once each is checked (see [`check_endpoints`]).
fn checked_endpoints(
    list: &str,
    inputs: Vec<EndpointInput>,
) -> Result<Vec<StoredEndpoint>, RegistryError> {
    let mut ids = BTreeSet::new();
    let mut stored = Vec::with_capacity(inputs.len());
    for (i, input) in inputs.into_iter().enumerate() {
        let at = format!("{list}[{i}]");
        if let Some(t) = input.ttl_seconds
            && !(1..=MAX_TTL_SECONDS).contains(&t)
        {
            return Err(invalid(
                format!("{at}.ttl_seconds"),
                format!("must be 1..={MAX_TTL_SECONDS}"),
            ));
        }
        if input.weight == 0 || input.weight > MAX_WEIGHT {
            return Err(invalid(
                format!("{at}.weight"),
                format!("must be 1..={MAX_WEIGHT}"),
            ));
        }
        check_placement(&at, &input)?;
        let e = into_stored(input);
        e.endpoint
            .validate()
            .map_err(|err| endpoint_invalid(&at, &err))?;
        if !ids.insert(e.endpoint.id.clone()) {
            return Err(invalid(
                format!("{at}.id"),
                format!("duplicate id {:?} in this request", e.endpoint.id.as_str()),
            ));
        }
        stored.push(e);
    }
    Ok(stored)
}

impl Registry {
    /// An empty registry, persisted to `store` when given (its contents are loaded).
    pub fn open(store: Option<Store>, max_per_slice: usize) -> Result<Self, RegistryError> {
        Self::open_with(
            store.map(|s| Box::new(s) as Box<dyn Storage>),
            max_per_slice,
        )
    }

    /// [`Registry::open`] over any [`Storage`].
    pub fn open_with(
        store: Option<Box<dyn Storage>>,
        max_per_slice: usize,
    ) -> Result<Self, RegistryError> {
        let mut reg = Self {
            version: 0,
            services: BTreeMap::new(),
            store: None,
            max_per_slice,
            staged: None,
            broken: None,
            owners: BTreeMap::new(),
        };
        if let Some(store) = &store {
            let loaded = store.load()?;
            reg.version = loaded.version;
            reg.services = restore::services(loaded, max_per_slice, Instant::now());
        }
        reg.store = store;
        for key in reg.service_keys() {
            reg.settle(&key)?;
        }
        Ok(reg)
    }

    /// A fresh version for a message that changes no stored state (an
    /// activation error), so subscribers order it after what they have.
    pub fn next_version(&mut self) -> u64 {
        self.version += 1;
        self.version
    }

    /// Whether writes go to a store on disk (else memory only).
    pub fn is_persistent(&self) -> bool {
        self.store.is_some()
    }

    /// Whether a failed reload left memory untrusted: writes are refused
    /// until the store reads again.
    pub fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    /// Closes the store (on shutdown): later writes are refused, since
    /// they could no longer be made durable (a registry without a store
    /// stays memory-only).
    pub fn close_store(&mut self) {
        if self.store.take().is_some() {
            self.broken = Some(StoreError::Io(
                "closed: the control plane is shutting down".into(),
            ));
        }
    }

    /// The current version: bumped by every write.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Marks `key` as owned by another source (`origin` says which, e.g.
    /// `Kubernetes Service default/web`): API writes to it are refused.
    pub fn claim(&mut self, key: &str, origin: impl Into<String>) {
        self.owners.insert(key.to_owned(), origin.into());
    }

    /// Gives `key` back to the registration API.
    pub fn release(&mut self, key: &str) {
        self.owners.remove(key);
    }

    /// Where `key` comes from when another source owns it.
    pub fn owner(&self, key: &str) -> Option<&str> {
        self.owners.get(key).map(String::as_str)
    }

    /// How many services the registry holds.
    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    /// Every service key, sorted.
    pub fn service_keys(&self) -> Vec<String> {
        self.services.keys().cloned().collect()
    }

    /// Writes `batch` to the store (or stages it, inside a group); memory
    /// changes only after this returns Ok.
    fn commit(&mut self, batch: WriteBatch) -> Result<(), RegistryError> {
        if let Some(e) = self.broken.take() {
            // A store that reads again (space freed, the disk back) ends
            // the broken state; this write was computed on memory that
            // could not be trusted, so it is refused: its caller retries.
            // (Taken first: the reload's own slice writes come here too.)
            if self.store.is_some() && self.reload().is_ok() {
                tracing::info!("the store reads again; memory reloaded from it");
                return Err(StoreError::Io(format!(
                    "the store failed earlier ({e}) and was reloaded; retry the write"
                ))
                .into());
            }
            self.broken = Some(e.clone());
            return Err(e.into());
        }
        if let Some(staged) = &mut self.staged {
            if self.store.is_some() {
                staged.push(batch);
            }
            return Ok(());
        }
        if let Some(store) = &self.store {
            store.apply(&batch)?;
        }
        Ok(())
    }

    fn record(s: &Service) -> ServiceRecord {
        ServiceRecord {
            spec: s.spec.clone(),
            version: s.version,
            next_slice: s.slices.next_suffix(),
        }
    }

    /// Creates or updates a service. Returns the new version.
    pub fn put_service(&mut self, spec: ServiceSpec) -> Result<u64, RegistryError> {
        check_service_spec(&spec)?;
        let key = spec.key();
        let version = self.version + 1;
        let now = Instant::now();
        let svc = match self.services.get(&key) {
            Some(old) => Service {
                settings_dirty: old.settings_dirty || old.spec.settings != spec.settings,
                spec,
                version,
                endpoints: old.endpoints.clone(),
                expires: old.expires.clone(),
                slices: old.slices.clone(),
                dirty: old.dirty.clone(),
                last_change: now,
                compacted_since_change: false,
            },
            None => Service {
                settings_dirty: !spec.settings.is_empty(),
                slices: SliceSet::new(spec.name.clone(), self.max_per_slice),
                spec,
                version,
                endpoints: BTreeMap::new(),
                expires: HashMap::new(),
                dirty: BTreeSet::new(),
                last_change: now,
                compacted_since_change: false,
            },
        };
        let batch = WriteBatch {
            version,
            services: vec![(key.clone(), Some(Self::record(&svc)))],
            ..WriteBatch::default()
        };
        self.commit(batch)?;
        self.version = version;
        self.services.insert(key, svc);
        Ok(version)
    }

    /// Deletes a service with its endpoints; returns its reset delta.
    pub fn delete_service(&mut self, key: &str) -> Result<ServiceDelta, RegistryError> {
        if !self.services.contains_key(key) {
            return Err(RegistryError::UnknownService(key.to_owned()));
        }
        let version = self.version + 1;
        let batch = WriteBatch {
            version,
            services: vec![(key.to_owned(), None)],
            purge: vec![key.to_owned()],
            ..WriteBatch::default()
        };
        self.commit(batch)?;
        self.version = version;
        self.services.remove(key);
        Ok(ServiceDelta {
            service: key.to_owned(),
            version,
            upserted: Vec::new(),
            removed: Vec::new(),
            reset: true,
            activation_error: None,
            settings: None,
        })
    }

    /// Adds or replaces endpoints, all or none. Returns the new version.
    pub fn put_endpoints(
        &mut self,
        key: &str,
        inputs: Vec<EndpointInput>,
    ) -> Result<u64, RegistryError> {
        let svc = self
            .services
            .get(key)
            .ok_or_else(|| RegistryError::UnknownService(key.to_owned()))?;
        // As the bulk call's body names them; a single PUT strips `put[0]`.
        let stored = checked_endpoints("put", inputs)?;
        let version = self.version + 1;
        let mut batch = WriteBatch {
            version,
            ..WriteBatch::default()
        };
        for e in &stored {
            batch
                .endpoints
                .push((key.to_owned(), e.endpoint.id.clone(), Some(e.clone())));
        }
        let mut record = Self::record(svc);
        record.version = version;
        batch.services.push((key.to_owned(), Some(record)));
        self.commit(batch)?;
        self.version = version;
        let now = Instant::now();
        let svc = self.services.get_mut(key).expect("checked above");
        svc.version = version;
        svc.last_change = now;
        svc.compacted_since_change = false;
        for e in stored {
            let id = e.endpoint.id.clone();
            match e.ttl_seconds {
                Some(t) => svc.expires.insert(id.clone(), now + Duration::from_secs(t)),
                None => svc.expires.remove(&id),
            };
            svc.dirty.insert(id.clone());
            svc.endpoints.insert(id, e);
        }
        Ok(version)
    }

    /// Removes endpoints; ids not present are skipped unless `strict`.
    pub fn delete_endpoints(
        &mut self,
        key: &str,
        ids: &[EndpointId],
        strict: bool,
    ) -> Result<u64, RegistryError> {
        let svc = self
            .services
            .get(key)
            .ok_or_else(|| RegistryError::UnknownService(key.to_owned()))?;
        if strict && let Some(missing) = ids.iter().find(|id| !svc.endpoints.contains_key(*id)) {
            return Err(RegistryError::UnknownEndpoint {
                service: key.to_owned(),
                id: missing.to_string(),
            });
        }
        if !ids.iter().any(|id| svc.endpoints.contains_key(id)) {
            // Nothing to delete: no store write, no version, no delta.
            return Ok(self.version);
        }
        let version = self.version + 1;
        let mut batch = WriteBatch {
            version,
            ..WriteBatch::default()
        };
        for id in ids {
            batch.endpoints.push((key.to_owned(), id.clone(), None));
        }
        let mut record = Self::record(svc);
        record.version = version;
        batch.services.push((key.to_owned(), Some(record)));
        self.commit(batch)?;
        self.version = version;
        let svc = self.services.get_mut(key).expect("checked above");
        svc.version = version;
        svc.last_change = Instant::now();
        svc.compacted_since_change = false;
        for id in ids {
            if svc.endpoints.remove(id).is_some() {
                svc.expires.remove(id);
                svc.dirty.insert(id.clone());
            }
        }
        Ok(version)
    }

    /// Refuses unless service `key` holds every one of `ids`; the error
    /// names the first missing as `delete[i]` (a bulk call's index).
    pub fn require_endpoints(&self, key: &str, ids: &[EndpointId]) -> Result<(), RegistryError> {
        let svc = self
            .services
            .get(key)
            .ok_or_else(|| RegistryError::UnknownService(key.to_owned()))?;
        match ids
            .iter()
            .enumerate()
            .find(|(_, id)| !svc.endpoints.contains_key(*id))
        {
            Some((i, id)) => Err(RegistryError::UnknownEndpointAt {
                at: format!("delete[{i}]"),
                service: key.to_owned(),
                id: id.to_string(),
            }),
            None => Ok(()),
        }
    }

    /// Extends an endpoint's TTL by its period.
    pub fn renew(&mut self, key: &str, id: &EndpointId) -> Result<(), RegistryError> {
        let svc = self
            .services
            .get_mut(key)
            .ok_or_else(|| RegistryError::UnknownService(key.to_owned()))?;
        let unknown = || RegistryError::UnknownEndpoint {
            service: key.to_owned(),
            id: id.to_string(),
        };
        let e = svc.endpoints.get(id).ok_or_else(unknown)?;
        let Some(t) = e.ttl_seconds else {
            return Err(invalid("ttl_seconds", "the endpoint has no TTL to renew"));
        };
        svc.expires
            .insert(id.clone(), Instant::now() + Duration::from_secs(t));
        Ok(())
    }

    /// Removes endpoints whose TTL ran out; returns how many.
    pub fn expire(&mut self, now: Instant) -> Result<usize, RegistryError> {
        let due: Vec<(String, Vec<EndpointId>)> = self
            .services
            .iter()
            .map(|(k, s)| {
                let ids: Vec<EndpointId> = s
                    .expires
                    .iter()
                    .filter(|(_, t)| **t <= now)
                    .map(|(id, _)| id.clone())
                    .collect();
                (k.clone(), ids)
            })
            .filter(|(_, ids)| !ids.is_empty())
            .collect();
        let mut n = 0;
        for (k, ids) in due {
            n += ids.len();
            self.delete_endpoints(&k, &ids, false)?;
        }
        Ok(n)
    }

    /// Services with changes not yet reconciled.
    pub fn dirty_services(&self) -> Vec<String> {
        self.services
            .iter()
            .filter(|(_, s)| !s.dirty.is_empty() || s.settings_dirty)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// The version of a service's last change, if it exists.
    pub fn service_version(&self, key: &str) -> Option<u64> {
        self.services.get(key).map(|s| s.version)
    }

    /// A service's settings, if it exists.
    pub fn settings(&self, key: &str) -> Option<&ServiceSettings> {
        self.services.get(key).map(|s| &s.spec.settings)
    }

    /// Every endpoint of a service with its slice (a snapshot).
    pub fn snapshot(&self, key: &str) -> Option<(u64, Vec<(Endpoint, String)>)> {
        let svc = self.services.get(key)?;
        let eps = svc
            .endpoints
            .values()
            .map(|e| {
                let slice = svc
                    .slices
                    .slice_of(&e.endpoint.id)
                    .unwrap_or_default()
                    .to_owned();
                (e.endpoint.clone(), slice)
            })
            .collect();
        Some((svc.version, eps))
    }

    /// A service with endpoints and slices, for the API.
    pub fn view(&self, key: &str) -> Option<ServiceView> {
        let svc = self.services.get(key)?;
        Some(ServiceView {
            namespace: svc.spec.namespace.clone(),
            name: svc.spec.name.clone(),
            ports: svc.spec.ports.clone(),
            settings: svc.spec.settings.clone(),
            version: svc.version,
            endpoints: svc
                .endpoints
                .values()
                .map(|e| {
                    let slice = svc.slices.slice_of(&e.endpoint.id).map(str::to_owned);
                    EndpointView::new(&e.endpoint, e.ttl_seconds, slice)
                })
                .collect(),
            slices: svc
                .slices
                .slices()
                .map(|s| SliceView {
                    name: s.name.clone(),
                    endpoints: s.endpoints.keys().map(|id| id.to_string()).collect(),
                })
                .collect(),
        })
    }

    /// Number of endpoints across services.
    pub fn endpoint_count(&self) -> usize {
        self.services.values().map(|s| s.endpoints.len()).sum()
    }
}
