//! Crash-safe persistence of the registry in an embedded redb database:
//! services, endpoints, slice membership and the version counter. Every
//! registry write is one transaction, so a restart finds exactly the state
//! of the last acknowledged write.

use std::path::Path;

use meshless_model::{Endpoint, EndpointId};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::api::ServiceSpec;

/// A service as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceRecord {
    pub spec: ServiceSpec,
    pub version: u64,
    pub next_slice: u64,
}

/// An endpoint as stored: the endpoint and its optional TTL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredEndpoint {
    pub endpoint: Endpoint,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
}

const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const SERVICES: TableDefinition<&str, &[u8]> = TableDefinition::new("services");
const ENDPOINTS: TableDefinition<&str, &[u8]> = TableDefinition::new("endpoints");
const SLICES: TableDefinition<&str, &[u8]> = TableDefinition::new("slices");
const VERSION_KEY: &str = "version";

/// Why the store failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("data store {path}: {message}")]
    Open { path: String, message: String },
    #[error("data store: {0}")]
    Io(String),
    #[error("data store: corrupt record {key:?}: {message}")]
    Corrupt { key: String, message: String },
}

fn io(e: impl std::fmt::Display) -> StoreError {
    StoreError::Io(e.to_string())
}

/// One write to the store, applied atomically.
#[derive(Debug, Default)]
pub struct WriteBatch {
    pub version: u64,
    pub services: Vec<(String, Option<ServiceRecord>)>,
    pub endpoints: Vec<(String, EndpointId, Option<StoredEndpoint>)>,
    pub slices: Vec<(String, String, Option<Vec<EndpointId>>)>,
    /// Services whose every endpoint and slice row goes.
    pub purge: Vec<String>,
}

/// What a restart finds.
#[derive(Debug, Default)]
pub struct Loaded {
    pub version: u64,
    pub services: Vec<ServiceRecord>,
    pub endpoints: Vec<(String, StoredEndpoint)>,
    pub slices: Vec<(String, String, Vec<EndpointId>)>,
}

/// Where the registry persists its writes: [`Store`] (redb) in production;
/// tests put doubles behind it (a store whose writes fail).
pub trait Storage: Send + std::fmt::Debug {
    /// Everything stored.
    fn load(&self) -> Result<Loaded, StoreError>;
    /// Applies `batches` in order, atomically and durably: all of them
    /// or, on error, none of them (one transaction, one fsync).
    fn apply_group(&self, batches: &[WriteBatch]) -> Result<(), StoreError>;
    /// Applies one batch: [`Storage::apply_group`] of one.
    fn apply(&self, batch: &WriteBatch) -> Result<(), StoreError> {
        self.apply_group(std::slice::from_ref(batch))
    }
}

impl Storage for Store {
    fn load(&self) -> Result<Loaded, StoreError> {
        Store::load(self)
    }

    fn apply_group(&self, batches: &[WriteBatch]) -> Result<(), StoreError> {
        Store::apply_group(self, batches)
    }
}

/// The embedded database. After a failed write it is closed and opened
/// again on the next use: redb refuses every later transaction of a
/// handle that saw an I/O error (`PreviousIo`), so without a reopen one
/// full disk would fail every write until a restart.
#[derive(Debug)]
pub struct Store {
    /// `None` after a failed write, until reopened.
    db: std::sync::Mutex<Option<Database>>,
    file: std::path::PathBuf,
}

fn row_key(service: &str, item: &str) -> String {
    format!("{service}\t{item}")
}

fn split_key(key: &str) -> Option<(&str, &str)> {
    key.split_once('\t')
}

impl Store {
    /// Opens (or creates) `dir/meshless.redb`.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let open_err = |message: String| StoreError::Open {
            path: dir.display().to_string(),
            message,
        };
        std::fs::create_dir_all(dir).map_err(|e| open_err(e.to_string()))?;
        let db =
            Database::create(dir.join("meshless.redb")).map_err(|e| open_err(e.to_string()))?;
        let txn = db.begin_write().map_err(io)?;
        for t in [SERVICES, ENDPOINTS, SLICES] {
            txn.open_table(t).map_err(io)?;
        }
        txn.open_table(META).map_err(io)?;
        txn.commit().map_err(io)?;
        Ok(Self {
            db: std::sync::Mutex::new(Some(db)),
            file: dir.join("meshless.redb"),
        })
    }

    /// Runs `f` on the database, opening it again first if a failed write
    /// closed it; a failure of `f` closes it (the next use reopens).
    fn with_db<T>(
        &self,
        f: impl FnOnce(&Database) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut slot = self
            .db
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let db = match slot.take() {
            Some(db) => db,
            None => {
                let db = Database::create(&self.file).map_err(io)?;
                tracing::info!(file = %self.file.display(), "data store opened again after a failed write");
                db
            }
        };
        let out = f(&db);
        if out.is_ok() {
            *slot = Some(db);
        }
        out
    }

    /// Everything stored.
    pub fn load(&self) -> Result<Loaded, StoreError> {
        self.with_db(Self::load_from)
    }

    fn load_from(db: &Database) -> Result<Loaded, StoreError> {
        let txn = db.begin_read().map_err(io)?;
        let mut out = Loaded::default();
        let meta = txn.open_table(META).map_err(io)?;
        out.version = meta.get(VERSION_KEY).map_err(io)?.map_or(0, |v| v.value());
        let corrupt = |key: &str, e: serde_json::Error| StoreError::Corrupt {
            key: key.to_owned(),
            message: e.to_string(),
        };
        for row in txn.open_table(SERVICES).map_err(io)?.iter().map_err(io)? {
            let (k, v) = row.map_err(io)?;
            let rec: ServiceRecord =
                serde_json::from_slice(v.value()).map_err(|e| corrupt(k.value(), e))?;
            out.services.push(rec);
        }
        for row in txn.open_table(ENDPOINTS).map_err(io)?.iter().map_err(io)? {
            let (k, v) = row.map_err(io)?;
            let Some((svc, _)) = split_key(k.value()) else {
                continue;
            };
            let ep: StoredEndpoint =
                serde_json::from_slice(v.value()).map_err(|e| corrupt(k.value(), e))?;
            out.endpoints.push((svc.to_owned(), ep));
        }
        for row in txn.open_table(SLICES).map_err(io)?.iter().map_err(io)? {
            let (k, v) = row.map_err(io)?;
            let Some((svc, slice)) = split_key(k.value()) else {
                continue;
            };
            let ids: Vec<EndpointId> =
                serde_json::from_slice(v.value()).map_err(|e| corrupt(k.value(), e))?;
            out.slices.push((svc.to_owned(), slice.to_owned(), ids));
        }
        Ok(out)
    }

    /// Applies `batch` in one transaction.
    pub fn apply(&self, batch: &WriteBatch) -> Result<(), StoreError> {
        self.apply_group(std::slice::from_ref(batch))
    }

    /// Applies `batches` in order in one transaction: one commit, one
    /// fsync for all of them (group commit).
    pub fn apply_group(&self, batches: &[WriteBatch]) -> Result<(), StoreError> {
        self.with_db(|db| {
            let txn = db.begin_write().map_err(io)?;
            for batch in batches {
                Self::write_batch(&txn, batch)?;
            }
            txn.commit().map_err(io)?;
            Ok(())
        })
    }

    fn write_batch(txn: &redb::WriteTransaction, batch: &WriteBatch) -> Result<(), StoreError> {
        {
            let mut meta = txn.open_table(META).map_err(io)?;
            meta.insert(VERSION_KEY, batch.version).map_err(io)?;
            let mut services = txn.open_table(SERVICES).map_err(io)?;
            let mut endpoints = txn.open_table(ENDPOINTS).map_err(io)?;
            let mut slices = txn.open_table(SLICES).map_err(io)?;
            for svc in &batch.purge {
                let prefix = row_key(svc, "");
                for table in [&mut endpoints, &mut slices] {
                    let keys: Vec<String> = table
                        .range(prefix.as_str()..)
                        .map_err(io)?
                        .map_while(|r| r.ok().map(|(k, _)| k.value().to_owned()))
                        .take_while(|k| k.starts_with(&prefix))
                        .collect();
                    for k in keys {
                        table.remove(k.as_str()).map_err(io)?;
                    }
                }
            }
            for (key, rec) in &batch.services {
                match rec {
                    Some(r) => {
                        let v = serde_json::to_vec(r).map_err(io)?;
                        services.insert(key.as_str(), v.as_slice()).map_err(io)?;
                    }
                    None => {
                        services.remove(key.as_str()).map_err(io)?;
                    }
                }
            }
            for (svc, id, ep) in &batch.endpoints {
                let k = row_key(svc, id.as_str());
                match ep {
                    Some(e) => {
                        let v = serde_json::to_vec(e).map_err(io)?;
                        endpoints.insert(k.as_str(), v.as_slice()).map_err(io)?;
                    }
                    None => {
                        endpoints.remove(k.as_str()).map_err(io)?;
                    }
                }
            }
            for (svc, name, ids) in &batch.slices {
                let k = row_key(svc, name);
                match ids {
                    Some(ids) => {
                        let v = serde_json::to_vec(ids).map_err(io)?;
                        slices.insert(k.as_str(), v.as_slice()).map_err(io)?;
                    }
                    None => {
                        slices.remove(k.as_str()).map_err(io)?;
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("meshless-store-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn record(name: &str, version: u64) -> ServiceRecord {
        ServiceRecord {
            spec: ServiceSpec {
                namespace: "ns".into(),
                name: name.into(),
                ports: Vec::new(),
                settings: Default::default(),
            },
            version,
            next_slice: 1,
        }
    }

    fn stored(id: &str) -> StoredEndpoint {
        StoredEndpoint {
            endpoint: Endpoint::new(id, "10.0.0.1:80".parse().expect("addr")),
            ttl_seconds: Some(30),
        }
    }

    #[test]
    fn batches_apply_whole_and_purge_only_their_service() {
        let d = dir("purge");
        let store = Store::open(&d).expect("open");
        let mut batch = WriteBatch {
            version: 3,
            ..WriteBatch::default()
        };
        for svc in ["ns/a", "ns/ab"] {
            let name = svc.trim_start_matches("ns/");
            batch.services.push((svc.into(), Some(record(name, 3))));
            batch
                .endpoints
                .push((svc.into(), EndpointId::new("e1"), Some(stored("e1"))));
            batch.slices.push((
                svc.into(),
                format!("{name}-0"),
                Some(vec![EndpointId::new("e1")]),
            ));
        }
        store.apply(&batch).expect("apply");
        let loaded = store.load().expect("load");
        assert_eq!(loaded.version, 3);
        assert_eq!(loaded.services.len(), 2);
        assert_eq!(loaded.endpoints[0].1, stored("e1"));
        // Purging ns/a leaves ns/ab (a prefix of its key) alone.
        store
            .apply(&WriteBatch {
                version: 4,
                services: vec![("ns/a".into(), None)],
                purge: vec!["ns/a".into()],
                ..WriteBatch::default()
            })
            .expect("purge");
        let loaded = store.load().expect("load");
        assert_eq!(loaded.version, 4);
        assert_eq!(loaded.services, vec![record("ab", 3)]);
        assert_eq!(loaded.endpoints.len(), 1);
        assert_eq!(loaded.endpoints[0].0, "ns/ab");
        assert_eq!(
            loaded.slices,
            vec![("ns/ab".into(), "ab-0".into(), vec![EndpointId::new("e1")])]
        );
        drop(store);
        let again = Store::open(&d).expect("reopen").load().expect("load");
        assert_eq!(again.version, 4, "durable across a reopen");
        let _ = std::fs::remove_dir_all(d);
    }
}
