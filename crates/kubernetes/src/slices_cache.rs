//! Services and their EndpointSlices, merged per service the way
//! kube-proxy's `EndpointSliceCache` does (`pkg/proxy/endpointslicecache.go`):
//! slices are kept by name under the service named by their
//! `kubernetes.io/service-name` label, and a service's endpoints are the
//! union of its slices' endpoints, each counted once. Because slices are
//! kept by name, an endpoint the EndpointSlice controller moves from one
//! slice to another (added to the new slice, then removed from the old) is
//! never absent in between.
//!
//! Pure data: no I/O, no clock. The source ([`crate::source`]) feeds it
//! watch events and writes what [`SliceCache::desired`] returns.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::{Endpoint as SliceEndpoint, EndpointSlice};
use meshless_control::api::{EndpointInput, ServicePort, ServiceSpec};
use meshless_model::{Conditions, FieldError, ServiceSettings};

/// The label naming a slice's service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Annotation choosing which Service port the endpoints serve (name or
/// number); absent = the Service's first port.
pub const PORT_ANNOTATION: &str = "meshless.io/port";

/// `namespace/name`.
pub type ServiceKey = String;

/// What the registry should hold for one service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Desired {
    pub spec: ServiceSpec,
    /// Sorted by id, each id once.
    pub endpoints: Vec<EndpointInput>,
    /// Slice endpoints left out (FQDN, no usable address, no matching port).
    pub skipped: u64,
    /// The Service's `meshless.io/*` settings annotations are bad: `spec`
    /// carries no settings, and the writer keeps what it had.
    pub settings_error: Option<FieldError>,
    /// [`PORT_ANNOTATION`] names no port of the Service: `endpoints` is
    /// empty, and the writer keeps the endpoints it had.
    pub port_error: Option<FieldError>,
}

/// Every watched Service and EndpointSlice, by service.
#[derive(Debug, Default, Clone)]
pub struct SliceCache {
    services: BTreeMap<ServiceKey, Service>,
    /// Service key -> slice name -> slice.
    slices: BTreeMap<ServiceKey, BTreeMap<String, EndpointSlice>>,
    /// `namespace/slice-name` -> the service key it was filed under, so a
    /// slice whose label changes leaves its old service.
    slice_service: BTreeMap<String, ServiceKey>,
}

fn key(namespace: Option<&str>, name: &str) -> ServiceKey {
    format!("{}/{name}", namespace.unwrap_or("default"))
}

/// Whether `namespace/name` lies in `scope` (`None`: everywhere).
fn in_scope(key: &str, scope: Option<&str>) -> bool {
    scope.is_none_or(|ns| key.split_once('/').is_some_and(|(k, _)| k == ns))
}

fn slice_id(slice: &EndpointSlice) -> String {
    key(
        slice.metadata.namespace.as_deref(),
        slice.metadata.name.as_deref().unwrap_or_default(),
    )
}

/// The service key of a slice: its namespace and `kubernetes.io/service-name`.
pub fn slice_service_key(slice: &EndpointSlice) -> Option<ServiceKey> {
    let name = slice.metadata.labels.as_ref()?.get(SERVICE_NAME_LABEL)?;
    Some(key(slice.metadata.namespace.as_deref(), name))
}

/// The key of a Service object.
pub fn service_key(service: &Service) -> Option<ServiceKey> {
    let name = service.metadata.name.as_deref()?;
    Some(key(service.metadata.namespace.as_deref(), name))
}

impl SliceCache {
    /// Adds or replaces a Service; returns its key.
    pub fn apply_service(&mut self, service: Service) -> Option<ServiceKey> {
        let k = service_key(&service)?;
        self.services.insert(k.clone(), service);
        Some(k)
    }

    /// Removes a Service (its slices stay until they are deleted too).
    pub fn delete_service(&mut self, service: &Service) -> Option<ServiceKey> {
        let k = service_key(service)?;
        self.services.remove(&k);
        Some(k)
    }

    /// Adds or replaces a slice; returns the services it changed (its old
    /// one too when its service label changed).
    pub fn apply_slice(&mut self, slice: EndpointSlice) -> Vec<ServiceKey> {
        let id = slice_id(&slice);
        let mut changed = self.remove_slice_id(&id);
        let (Some(k), Some(name)) = (slice_service_key(&slice), slice.metadata.name.clone()) else {
            return changed;
        };
        self.slice_service.insert(id, k.clone());
        self.slices
            .entry(k.clone())
            .or_default()
            .insert(name, slice);
        if !changed.contains(&k) {
            changed.push(k);
        }
        changed
    }

    /// Removes a slice; returns the service it belonged to.
    pub fn delete_slice(&mut self, slice: &EndpointSlice) -> Vec<ServiceKey> {
        self.remove_slice_id(&slice_id(slice))
    }

    fn remove_slice_id(&mut self, id: &str) -> Vec<ServiceKey> {
        let Some(k) = self.slice_service.remove(id) else {
            return Vec::new();
        };
        let name = id.split_once('/').map_or(id, |(_, n)| n);
        if let Some(by_name) = self.slices.get_mut(&k) {
            by_name.remove(name);
            if by_name.is_empty() {
                self.slices.remove(&k);
            }
        }
        vec![k]
    }

    /// Replaces every Service in `scope` (a namespace, or `None` for all)
    /// after a full list; returns every key that was or is now present.
    pub fn replace_services(
        &mut self,
        scope: Option<&str>,
        services: Vec<Service>,
    ) -> Vec<ServiceKey> {
        let mut touched: Vec<ServiceKey> = self
            .services
            .keys()
            .filter(|k| in_scope(k, scope))
            .cloned()
            .collect();
        self.services.retain(|k, _| !in_scope(k, scope));
        for s in services {
            if let Some(k) = self.apply_service(s) {
                touched.push(k);
            }
        }
        touched.sort();
        touched.dedup();
        touched
    }

    /// Replaces every slice in `scope` after a full list; returns every
    /// service key that had or now has slices.
    pub fn replace_slices(
        &mut self,
        scope: Option<&str>,
        slices: Vec<EndpointSlice>,
    ) -> Vec<ServiceKey> {
        let gone: Vec<String> = self
            .slice_service
            .keys()
            .filter(|id| in_scope(id, scope))
            .cloned()
            .collect();
        let mut touched = Vec::new();
        for id in gone {
            touched.extend(self.remove_slice_id(&id));
        }
        for s in slices {
            touched.extend(self.apply_slice(s));
        }
        touched.sort();
        touched.dedup();
        touched
    }

    /// Keys of the Services present.
    pub fn service_keys(&self) -> impl Iterator<Item = &ServiceKey> {
        self.services.keys()
    }

    /// The Service object under `key`.
    pub fn service(&self, key: &str) -> Option<&Service> {
        self.services.get(key)
    }

    /// What the registry should hold for `key`: `None` while there is no
    /// Service (slices without a Service are kept, not served, as kube-proxy does).
    pub fn desired(&self, key: &str) -> Option<Desired> {
        let service = self.services.get(key)?;
        let mut spec = service_spec(service)?;
        let annotations = service.metadata.annotations.clone().unwrap_or_default();
        let settings_error = match ServiceSettings::from_annotations(&annotations) {
            Ok(s) => {
                spec.settings = s;
                None
            }
            Err(e) => Some(e),
        };
        let (chosen, port_error) = match chosen_port(service) {
            Ok(p) => (p, None),
            Err(e) => (None, Some(e)),
        };
        let mut merged = Merged::default();
        if let (Some(port), Some(slices)) = (chosen, self.slices.get(key)) {
            // BTreeMap order: by slice name, so the first slice wins a duplicate.
            for slice in slices.values() {
                merged.add_slice(slice, &port);
            }
        }
        Some(Desired {
            spec,
            endpoints: merged.endpoints.into_values().collect(),
            skipped: merged.skipped,
            settings_error,
            port_error,
        })
    }
}

/// A Service's ports as the registry keeps them.
fn service_spec(service: &Service) -> Option<ServiceSpec> {
    let ports = service
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .map(|ports| {
            ports
                .iter()
                .filter_map(|p| {
                    Some(ServicePort {
                        name: p.name.clone().filter(|n| !n.is_empty()),
                        port: u16::try_from(p.port).ok().filter(|p| *p > 0)?,
                        protocol: p.protocol.clone().unwrap_or_else(|| "TCP".into()),
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    Some(ServiceSpec {
        namespace: service.metadata.namespace.clone()?,
        name: service.metadata.name.clone()?,
        ports,
        settings: Default::default(),
    })
}

/// The Service port whose endpoints are served: [`PORT_ANNOTATION`] (a port
/// name or number) when set, else the first port. Slices name their ports
/// as the Service does (an unnamed port is `""`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct ChosenPort {
    name: String,
    protocol: String,
}

/// `Ok(None)`: the Service has no port; `Err`: the annotation names none
/// of its ports (a typo must not read as "no endpoints").
fn chosen_port(service: &Service) -> Result<Option<ChosenPort>, FieldError> {
    let ports = service
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_deref())
        .unwrap_or_default();
    let wanted = service
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(PORT_ANNOTATION));
    let port = match wanted {
        Some(w) => ports
            .iter()
            .find(|p| p.name.as_deref() == Some(w.as_str()) || p.port.to_string() == *w)
            .ok_or_else(|| {
                FieldError::new(
                    PORT_ANNOTATION,
                    format!("{w:?} names no port of the Service (a port name or number)"),
                )
            })?,
        None => match ports.first() {
            Some(p) => p,
            None => return Ok(None),
        },
    };
    Ok(Some(ChosenPort {
        name: port.name.clone().unwrap_or_default(),
        protocol: port.protocol.clone().unwrap_or_else(|| "TCP".into()),
    }))
}

/// The endpoints of one service while its slices are merged.
#[derive(Default)]
struct Merged {
    endpoints: BTreeMap<String, EndpointInput>,
    skipped: u64,
}

impl Merged {
    fn add_slice(&mut self, slice: &EndpointSlice, port: &ChosenPort) {
        let family_ok = matches!(slice.address_type.as_str(), "IPv4" | "IPv6");
        let number = slice.ports.as_ref().and_then(|ports| {
            ports
                .iter()
                .find(|p| {
                    p.name.as_deref().unwrap_or_default() == port.name
                        && p.protocol.as_deref().unwrap_or("TCP") == port.protocol
                })
                .and_then(|p| p.port)
                .and_then(|n| u16::try_from(n).ok())
                .filter(|n| *n > 0)
        });
        let (true, Some(number)) = (family_ok, number) else {
            self.skipped += slice.endpoints.len() as u64;
            return;
        };
        for e in &slice.endpoints {
            match endpoint_input(e, number) {
                Some(input) => self.add(input),
                None => self.skipped += 1,
            }
        }
    }

    /// Counts an endpoint once: a second sighting of the same id adds only
    /// the addresses of a family the first lacked (dual stack: one IPv4
    /// and one IPv6 slice name the same pod); otherwise the first stays.
    fn add(&mut self, input: EndpointInput) {
        match self.endpoints.get_mut(&input.id) {
            None => {
                self.endpoints.insert(input.id.clone(), input);
            }
            Some(first) => {
                for a in input.addresses {
                    if !first.addresses.iter().any(|b| b.is_ipv4() == a.is_ipv4()) {
                        first.addresses.push(a);
                    }
                }
            }
        }
    }
}

/// A slice endpoint's conditions as the model states them. The API says a
/// missing `ready` or `serving` is true and a missing `terminating` false;
/// the model's `ready` is also "serving and not terminating", so an
/// inconsistent object never makes a terminating endpoint ready.
pub fn conditions(e: &SliceEndpoint) -> Conditions {
    let c = e.conditions.as_ref();
    let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
    let ready_raw = c.and_then(|c| c.ready).unwrap_or(true);
    let serving = c.and_then(|c| c.serving).unwrap_or(ready_raw);
    Conditions {
        ready: ready_raw && serving && !terminating,
        serving,
        terminating,
    }
}

/// One slice endpoint as a registry endpoint: its id is the Pod it targets
/// (so the IPv4 and IPv6 slices of a dual-stack pod name one endpoint),
/// else its first address. `None` when no address parses.
fn endpoint_input(e: &SliceEndpoint, port: u16) -> Option<EndpointInput> {
    let addresses: Vec<IpAddr> = e
        .addresses
        .iter()
        .filter_map(|a| a.parse().ok())
        .take(1)
        .collect();
    let first = *addresses.first()?;
    let id = e
        .target_ref
        .as_ref()
        .filter(|r| r.kind.as_deref() == Some("Pod"))
        .and_then(|r| r.name.clone())
        .unwrap_or_else(|| first.to_string());
    Some(EndpointInput {
        id,
        addresses,
        port,
        weight: 1,
        zone: e.zone.clone(),
        node: e.node_name.clone(),
        conditions: conditions(e),
        ttl_seconds: None,
        // A pod not ready, not serving, not terminating is how a starting
        // pod looks (and, alas, one failing its readiness probe): probed
        // by proxies holding requests, as the cold-start path expects.
        starting: {
            let c = conditions(e);
            !c.ready && !c.serving && !c.terminating
        },
    })
}

#[cfg(test)]
#[path = "slices_cache_tests.rs"]
mod tests;
