//! Rebuilding the registry's services from what the store holds.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use meshless_model::EndpointId;

use super::{Service, StoredEndpoint};
use crate::reconciler::SliceSet;
use crate::store::Loaded;

/// Every stored service with its endpoints and slices as stored, at `now`.
/// A restart grants every TTL a fresh period. Slices may lag the endpoints
/// (a crash between an endpoint write and its reconcile):
/// [`super::Registry::open_with`] settles them.
pub(super) fn services(
    loaded: Loaded,
    max_per_slice: usize,
    now: Instant,
) -> BTreeMap<String, Service> {
    let mut endpoints: HashMap<String, Vec<StoredEndpoint>> = HashMap::new();
    for (svc, ep) in loaded.endpoints {
        endpoints.entry(svc).or_default().push(ep);
    }
    let mut slices: HashMap<String, Vec<(String, Vec<EndpointId>)>> = HashMap::new();
    for (svc, name, ids) in loaded.slices {
        slices.entry(svc).or_default().push((name, ids));
    }
    let mut out = BTreeMap::new();
    for rec in loaded.services {
        let key = rec.spec.key();
        let eps: BTreeMap<EndpointId, StoredEndpoint> = endpoints
            .remove(&key)
            .unwrap_or_default()
            .into_iter()
            .map(|e| (e.endpoint.id.clone(), e))
            .collect();
        let stored_slices =
            slices
                .remove(&key)
                .unwrap_or_default()
                .into_iter()
                .map(|(name, ids)| {
                    let members = ids
                        .iter()
                        .filter_map(|id| eps.get(id).map(|e| e.endpoint.clone()))
                        .collect();
                    (name, members)
                });
        let slices = SliceSet::restore(
            rec.spec.name.clone(),
            max_per_slice,
            rec.next_slice,
            stored_slices,
        );
        let expires = eps
            .iter()
            .filter_map(|(id, e)| {
                e.ttl_seconds
                    .map(|t| (id.clone(), now + Duration::from_secs(t)))
            })
            .collect();
        let service = Service {
            spec: rec.spec,
            version: rec.version,
            endpoints: eps,
            expires,
            slices,
            dirty: Default::default(),
            settings_dirty: false,
            last_change: now,
            compacted_since_change: false,
        };
        out.insert(key, service);
    }
    out
}
