//! Metric series labelled by endpoint, and their removal when the endpoint
//! is gone.
//!
//! Pods churn: every rolling update brings endpoint ids never seen before,
//! so a series per endpoint kept forever grows `/metrics` and memory
//! without bound. Each `(cluster, endpoint)` pair has one
//! [`EndpointSeries`] handle while anything can still record on it: the
//! snapshots whose cluster holds the endpoint (each cluster keeps its
//! handles, carried over by rebuilds while the endpoint stays), and through
//! them every request in flight, health check and TCP connect begun there.
//! The endpoint's series exist while the handle does: when its last holder
//! drops it, the series are removed from their families. A request still
//! in flight on an endpoint that left holds the handle, so it records into
//! series that are removed only after it ends; nothing can recreate them
//! later, since every series of an endpoint is created through its live
//! handle ([`SeriesTable::get`] hands out the live one, one per pair).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::edge_metrics::ConnectLabels;
use crate::endpoint_labels::{EndpointLabels, RequestLabels};

/// The families whose series name an endpoint.
#[derive(Debug, Clone, Default)]
pub struct EndpointFamilies {
    pub requests: Family<RequestLabels, Counter>,
    pub health_checks: Family<EndpointLabels, Counter>,
    pub health_check_failures: Family<EndpointLabels, Counter>,
    pub connect_failures: Family<ConnectLabels, Counter>,
}

/// The live handle of each `(cluster, endpoint)` pair: at most one at a time.
#[derive(Debug, Clone)]
pub struct SeriesTable(Arc<Table>);

#[derive(Debug)]
struct Table {
    families: EndpointFamilies,
    live: Mutex<HashMap<EndpointLabels, Weak<EndpointSeries>>>,
}

impl SeriesTable {
    /// A table over `families`.
    pub fn new(families: EndpointFamilies) -> Self {
        Self(Arc::new(Table {
            families,
            live: Mutex::new(HashMap::new()),
        }))
    }

    /// The handle of `endpoint` in `cluster`: the live one, or a new one.
    pub fn get(&self, cluster: &Arc<str>, endpoint: &Arc<str>) -> Arc<EndpointSeries> {
        let key = EndpointLabels {
            cluster: cluster.to_string(),
            endpoint: endpoint.to_string(),
        };
        let mut live = self.0.live.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(handle) = live.get(&key).and_then(Weak::upgrade) {
            return handle;
        }
        let handle = Arc::new(EndpointSeries {
            key: key.clone(),
            cluster: Arc::clone(cluster),
            endpoint: Arc::clone(endpoint),
            table: Arc::clone(&self.0),
            requests: RwLock::new(Vec::new()),
        });
        live.insert(key, Arc::downgrade(&handle));
        handle
    }

    /// Pairs with a live handle (what `/metrics` may hold series for).
    pub fn live(&self) -> usize {
        let live = self.0.live.lock().unwrap_or_else(PoisonError::into_inner);
        live.values().filter(|w| w.strong_count() > 0).count()
    }
}

/// A request counter: listener, status class, the series' counter.
type RequestSeries = (Arc<str>, &'static str, Counter);

/// One endpoint of one cluster in the metrics; its series are removed when
/// the last holder drops it.
#[derive(Debug)]
pub struct EndpointSeries {
    key: EndpointLabels,
    cluster: Arc<str>,
    endpoint: Arc<str>,
    table: Arc<Table>,
    /// The request series created through this handle (removed on drop).
    requests: RwLock<Vec<RequestSeries>>,
}

impl EndpointSeries {
    /// The endpoint's id, as labelled.
    pub fn endpoint(&self) -> &Arc<str> {
        &self.endpoint
    }

    /// The cluster's name, as labelled.
    pub fn cluster(&self) -> &Arc<str> {
        &self.cluster
    }

    /// Counts a request that ended with `class` on `listener`.
    pub fn request(&self, listener: &Arc<str>, class: &'static str) {
        let same = |(l, c, _): &&RequestSeries| **l == **listener && *c == class;
        let read = self.requests.read().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, _, counter)) = read.iter().find(same) {
            counter.inc();
            return;
        }
        drop(read);
        let mut write = self
            .requests
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some((_, _, counter)) = write.iter().find(same) {
            counter.inc();
            return;
        }
        let counter = self
            .table
            .families
            .requests
            .get_or_create_owned(&self.request_labels(listener, class));
        counter.inc();
        write.push((Arc::clone(listener), class, counter));
    }

    /// Counts an active health check, and its failure unless it `passed`.
    pub fn health_check(&self, passed: bool) {
        let families = &self.table.families;
        families.health_checks.get_or_create(&self.key).inc();
        if !passed {
            families
                .health_check_failures
                .get_or_create(&self.key)
                .inc();
        }
    }

    /// Counts a TCP connect to the endpoint that failed or timed out.
    pub fn connect_failure(&self) {
        self.table
            .families
            .connect_failures
            .get_or_create(&self.connect_labels())
            .inc();
    }

    fn request_labels(&self, listener: &Arc<str>, class: &'static str) -> RequestLabels {
        RequestLabels {
            listener: Arc::clone(listener),
            cluster: Arc::clone(&self.cluster),
            endpoint: Arc::clone(&self.endpoint),
            class,
        }
    }

    fn connect_labels(&self) -> ConnectLabels {
        ConnectLabels {
            cluster: self.key.cluster.clone(),
            endpoint: self.key.endpoint.clone(),
        }
    }

    /// Takes over the request series `old` created (a handle made for the
    /// pair after `old`'s last holder let go, before `old` was dropped).
    fn adopt(&self, old: Vec<RequestSeries>) {
        let mut mine = self
            .requests
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        for s in old {
            if !mine.iter().any(|(l, c, _)| *l == s.0 && *c == s.1) {
                mine.push(s);
            }
        }
    }

    /// Removes every series of the pair from its family.
    fn remove_series(&mut self) {
        let families = &self.table.families;
        let requests = std::mem::take(
            self.requests
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for (listener, class, _) in &requests {
            families
                .requests
                .remove(&self.request_labels(listener, class));
        }
        families.health_checks.remove(&self.key);
        families.health_check_failures.remove(&self.key);
        families.connect_failures.remove(&self.connect_labels());
    }
}

impl Drop for EndpointSeries {
    /// Removes the series, unless a newer handle of the pair is live (made
    /// between this one's last release and now): then it keeps them.
    fn drop(&mut self) {
        let table = Arc::clone(&self.table);
        let mut live = table.live.lock().unwrap_or_else(PoisonError::into_inner);
        let successor = live.get(&self.key).and_then(Weak::upgrade);
        match &successor {
            Some(next) => {
                let requests = self
                    .requests
                    .get_mut()
                    .unwrap_or_else(PoisonError::into_inner);
                next.adopt(std::mem::take(requests));
            }
            None => {
                live.remove(&self.key);
                self.remove_series();
            }
        }
        drop(live);
        // The successor may be released last here: after the lock.
        drop(successor);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(f: &EndpointFamilies) -> String {
        let mut r = prometheus_client::registry::Registry::default();
        r.register("requests", "", f.requests.clone());
        r.register("checks", "", f.health_checks.clone());
        r.register("connects", "", f.connect_failures.clone());
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).expect("encode");
        out
    }

    /// Series live exactly as long as some holder of the pair's handle.
    #[test]
    fn series_leave_with_the_last_holder() {
        let families = EndpointFamilies::default();
        let table = SeriesTable::new(families.clone());
        let (c, e, l): (Arc<str>, Arc<str>, Arc<str>) = ("c".into(), "e1".into(), "web".into());
        let a = table.get(&c, &e);
        let b = table.get(&c, &e);
        assert!(Arc::ptr_eq(&a, &b), "one handle per pair");
        a.request(&l, "2xx");
        a.request(&l, "5xx");
        b.health_check(false);
        b.connect_failure();
        drop(a);
        let page = encode(&families);
        assert!(page.contains("endpoint=\"e1\""), "{page}");
        assert_eq!(table.live(), 1);
        drop(b);
        let page = encode(&families);
        assert!(!page.contains("e1"), "{page}");
        assert_eq!(table.live(), 0);
        // A new handle of the same pair starts afresh.
        table.get(&c, &e).request(&l, "2xx");
        assert!(!encode(&families).contains("e1"));
    }

    /// A handle made while the old one's drop is pending takes over its
    /// series, so none outlives both.
    #[test]
    fn a_successor_adopts_the_series() {
        let families = EndpointFamilies::default();
        let table = SeriesTable::new(families.clone());
        let (c, e, l): (Arc<str>, Arc<str>, Arc<str>) = ("c".into(), "e".into(), "web".into());
        let old = table.get(&c, &e);
        old.request(&l, "4xx");
        // As if `old`'s strong count had reached 0 before its drop ran:
        // the table's entry is replaced by a successor.
        let next = {
            let mut live = table.0.live.lock().expect("lock");
            let next = Arc::new(EndpointSeries {
                key: old.key.clone(),
                cluster: Arc::clone(&c),
                endpoint: Arc::clone(&e),
                table: Arc::clone(&table.0),
                requests: RwLock::new(Vec::new()),
            });
            live.insert(old.key.clone(), Arc::downgrade(&next));
            next
        };
        drop(old);
        assert!(encode(&families).contains("class=\"4xx\""));
        next.request(&l, "2xx");
        drop(next);
        assert!(!encode(&families).contains("endpoint=\"e\""));
    }
}
