//! The registry's slice work: reconciling a service's changed endpoints
//! into slices, and compacting sparse slices of quiet services. Both write
//! the store before memory, so a failed write leaves memory unchanged.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use meshless_model::{Endpoint, EndpointId};

use super::{Registry, RegistryError, ServiceDelta, ServiceRecord, ServiceSpec};
use crate::reconciler::{SliceChanges, SliceSet};
use crate::store::WriteBatch;

impl Registry {
    /// Packs a service's changed endpoints into slices, persists the slices
    /// that changed, and returns the delta (None when nothing changed).
    /// The store is written first: when it fails, memory is unchanged and
    /// the endpoints stay dirty, so the next flush tries again.
    pub fn reconcile(
        &mut self,
        key: &str,
    ) -> Result<Option<(ServiceDelta, SliceChanges)>, RegistryError> {
        let Some(svc) = self.services.get(key) else {
            return Ok(None);
        };
        if svc.dirty.is_empty() && !svc.settings_dirty {
            return Ok(None);
        }
        // Only the changed endpoints and the slices holding them are read.
        let changed: Vec<(&EndpointId, Option<&Endpoint>)> = svc
            .dirty
            .iter()
            .map(|id| (id, svc.endpoints.get(id).map(|e| &e.endpoint)))
            .collect();
        let plan = svc.slices.plan(&changed);
        // Each delta gets its own version, so deltas are ordered as published.
        let version = self.version + 1;
        let writes = plan
            .writes()
            .map(|(name, m)| (name, m.map(|m| m.keys().cloned().collect())));
        let batch = Self::slice_batch(version, key, &svc.spec, plan.next_suffix(), writes);
        self.commit(batch)?;
        self.version = version;
        let changes = plan.changes.clone();
        let svc = self.services.get_mut(key).expect("checked above");
        svc.slices.apply(plan);
        svc.version = version;
        let dirty = std::mem::take(&mut svc.dirty);
        let settings = std::mem::take(&mut svc.settings_dirty).then(|| svc.spec.settings.clone());
        let mut delta = ServiceDelta {
            service: key.to_owned(),
            version,
            upserted: Vec::new(),
            removed: Vec::new(),
            reset: false,
            activation_error: None,
            settings,
        };
        for id in dirty {
            match svc.endpoints.get(&id) {
                Some(e) => {
                    let slice = svc.slices.slice_of(&id).unwrap_or_default().to_owned();
                    delta.upserted.push((e.endpoint.clone(), slice));
                }
                None => delta.removed.push(id),
            }
        }
        Ok(Some((delta, changes)))
    }

    /// Brings a restored service's slices to its endpoints (slices lag them
    /// after a crash between an endpoint write and its reconcile) and
    /// stores the change, store first; no change, no write.
    pub(super) fn settle(&mut self, key: &str) -> Result<(), RegistryError> {
        let Some(svc) = self.services.get(key) else {
            return Ok(());
        };
        let desired: BTreeMap<EndpointId, Endpoint> = svc
            .endpoints
            .iter()
            .map(|(id, e)| (id.clone(), e.endpoint.clone()))
            .collect();
        let mut slices = svc.slices.clone();
        let changes = slices.reconcile(&desired);
        if changes.is_empty() {
            return Ok(());
        }
        let version = self.version + 1;
        self.commit(Self::whole_slice_batch(
            version, key, &svc.spec, &slices, &changes,
        ))?;
        self.version = version;
        let svc = self.services.get_mut(key).expect("checked above");
        svc.slices = slices;
        svc.version = version;
        Ok(())
    }

    /// The store write for `slices` after `changes`, at `version`.
    fn whole_slice_batch(
        version: u64,
        key: &str,
        spec: &ServiceSpec,
        slices: &SliceSet,
        changes: &SliceChanges,
    ) -> WriteBatch {
        let written = changes.created.iter().chain(&changes.updated).map(|name| {
            let ids = slices
                .slice(name)
                .map(|s| s.endpoints.keys().cloned().collect());
            (name.as_str(), ids)
        });
        let deleted = changes.deleted.iter().map(|name| (name.as_str(), None));
        Self::slice_batch(
            version,
            key,
            spec,
            slices.next_suffix(),
            written.chain(deleted),
        )
    }

    /// The store write of slice rows (`None`: deleted) at `version`.
    fn slice_batch<'a>(
        version: u64,
        key: &str,
        spec: &ServiceSpec,
        next_slice: u64,
        rows: impl Iterator<Item = (&'a str, Option<Vec<EndpointId>>)>,
    ) -> WriteBatch {
        let record = ServiceRecord {
            spec: spec.clone(),
            version,
            next_slice,
        };
        WriteBatch {
            version,
            services: vec![(key.to_owned(), Some(record))],
            slices: rows
                .map(|(name, ids)| (key.to_owned(), name.to_owned(), ids))
                .collect(),
            ..WriteBatch::default()
        }
    }

    /// Merges sparse slices of services quiet for `quiet`; returns the
    /// deltas (moved endpoints with their new slice) and the first store
    /// error. Each service's compaction is written to the store before
    /// memory changes; on a store error it stops there, the deltas of the
    /// services compacted before it are still returned (stored, so they
    /// must be published), memory and store agree, and the failed service
    /// is tried again next time.
    pub fn compact_quiet(
        &mut self,
        quiet: Duration,
    ) -> (Vec<ServiceDelta>, Result<(), RegistryError>) {
        let now = Instant::now();
        let due: Vec<String> = self
            .services
            .iter()
            .filter(|(_, s)| {
                !s.compacted_since_change
                    && now.duration_since(s.last_change) >= quiet
                    && s.dirty.is_empty()
            })
            .map(|(k, _)| k.clone())
            .collect();
        let mut out = Vec::new();
        for key in due {
            match self.compact_one(&key) {
                Ok(Some(delta)) => out.push(delta),
                Ok(None) => {}
                Err(e) => return (out, Err(e)),
            }
        }
        (out, Ok(()))
    }

    /// Compacts one service's slices: store first, then memory.
    fn compact_one(&mut self, key: &str) -> Result<Option<ServiceDelta>, RegistryError> {
        let Some(svc) = self.services.get(key) else {
            return Ok(None);
        };
        let mut slices = svc.slices.clone();
        let changes = slices.compact();
        if changes.is_empty() {
            if let Some(svc) = self.services.get_mut(key) {
                svc.compacted_since_change = true;
            }
            return Ok(None);
        }
        let version = self.version + 1;
        let batch = Self::whole_slice_batch(version, key, &svc.spec, &slices, &changes);
        let upserted = svc
            .endpoints
            .iter()
            .filter_map(|(id, e)| {
                let now_in = slices.slice_of(id).unwrap_or_default();
                (svc.slices.slice_of(id).unwrap_or_default() != now_in)
                    .then(|| (e.endpoint.clone(), now_in.to_owned()))
            })
            .collect();
        self.commit(batch)?;
        self.version = version;
        let svc = self.services.get_mut(key).expect("checked above");
        svc.slices = slices;
        svc.version = version;
        svc.compacted_since_change = true;
        Ok(Some(ServiceDelta {
            service: key.to_owned(),
            version,
            upserted,
            removed: Vec::new(),
            reset: false,
            activation_error: None,
            settings: None,
        }))
    }
}
