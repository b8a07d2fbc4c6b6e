//! Group commit: several writes staged in memory and written to the store
//! in one transaction with one fsync. Memory runs ahead of the store only
//! between [`Registry::begin_group`] and [`Registry::end_group`], both
//! called under the registry lock, so no reader sees a staged write and
//! no delta is published before its commit. When the commit fails, memory
//! is reloaded from the store: memory and store never diverge.

use std::time::Instant;

use super::{Registry, restore};
use crate::store::{StoreError, WriteBatch};

/// A group commit that failed: the store refused it and memory was
/// reloaded from the store.
#[derive(Debug)]
pub struct GroupFailed {
    pub error: StoreError,
    /// The services that need a reset delta: those the group wrote (memory
    /// went back to the store, and subscribers must hold what it holds)
    /// and those with writes committed earlier but not yet published (a
    /// batch period), whose dirty marks the reload lost. Services the
    /// failure did not touch get nothing: a full disk must not turn every
    /// failed write into a reset of every service for every proxy.
    pub services: Vec<String>,
}

impl Registry {
    /// Starts staging writes: each write changes memory at once and its
    /// store batch waits for [`Registry::end_group`].
    pub fn begin_group(&mut self) {
        self.staged.get_or_insert_with(Vec::new);
    }

    /// Commits the staged writes in one transaction. On failure memory is
    /// reloaded from the store, which holds exactly the state before the
    /// group; when that reload fails too, memory cannot be trusted and
    /// every later write fails with the reload's error.
    pub fn end_group(&mut self) -> Result<(), GroupFailed> {
        let Some(staged) = self.staged.take() else {
            return Ok(());
        };
        let Some(store) = &self.store else {
            return Ok(());
        };
        if staged.is_empty() {
            return Ok(());
        }
        let Err(error) = store.apply_group(&staged) else {
            return Ok(());
        };
        Err(self.roll_back(&staged, error))
    }

    /// Gives up the group in progress (a write panicked in it): nothing of
    /// it is stored, and memory is reloaded from the store as after a
    /// failed commit. Without a store, memory keeps what the group did.
    pub fn abort_group(&mut self, error: StoreError) -> GroupFailed {
        let staged = self.staged.take().unwrap_or_default();
        self.roll_back(&staged, error)
    }

    /// Memory back to the store after `staged` was not stored (without a
    /// store nothing is staged and memory stays as it is).
    fn roll_back(&mut self, staged: &[WriteBatch], error: StoreError) -> GroupFailed {
        let mut services: Vec<String> = staged
            .iter()
            .flat_map(|b| {
                let services = b.services.iter().map(|(k, _)| k);
                let endpoints = b.endpoints.iter().map(|(k, _, _)| k);
                let slices = b.slices.iter().map(|(k, _, _)| k);
                services.chain(endpoints).chain(slices).chain(&b.purge)
            })
            .cloned()
            .collect();
        services.extend(
            self.services
                .iter()
                .filter(|(_, s)| !s.dirty.is_empty() || s.settings_dirty)
                .map(|(k, _)| k.clone()),
        );
        services.sort();
        services.dedup();
        if self.store.is_some()
            && let Err(e) = self.reload()
        {
            tracing::error!(error = %e, "reloading the store after a failed commit");
            self.broken = Some(e);
        }
        GroupFailed { error, services }
    }

    /// Memory back to what the store holds (after a failed commit, or to
    /// leave the broken state once the store reads again); lease deadlines
    /// are kept, since they live in memory only.
    pub(super) fn reload(&mut self) -> Result<(), StoreError> {
        let Some(store) = &self.store else {
            return Ok(());
        };
        let loaded = store.load()?;
        // Versions handed out since the last commit without a store write
        // (activation errors, resets) were published: never hand them out
        // again.
        self.version = self.version.max(loaded.version);
        let before = std::mem::take(&mut self.services);
        self.services = restore::services(loaded, self.max_per_slice, Instant::now());
        // A failed group must not grant every TTL endpoint a fresh period
        // (with a failing store, dead instances would never expire).
        for (key, service) in &mut self.services {
            let Some(old) = before.get(key) else { continue };
            for (id, deadline) in &mut service.expires {
                if let Some(kept) = old.expires.get(id) {
                    *deadline = *kept;
                }
            }
        }
        for key in self.service_keys() {
            if self.settle(&key).is_err() {
                break;
            }
        }
        Ok(())
    }
}
