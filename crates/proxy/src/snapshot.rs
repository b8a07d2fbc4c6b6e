//! One immutable, complete view of the running configuration: routes per
//! listener and clusters with their balancers and pools. Swapped whole on
//! reload; requests finish on the snapshot they started with.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use http::uri::Authority;
use meshless_balance::{Cluster, Tiers};
use meshless_model::FieldError;

use crate::config::{ClusterConfig, NodeConfig, ProxyConfig, SubsetConfig};
use crate::endpoint_series::{EndpointSeries, SeriesTable};
use crate::router::RouteTable;
use crate::upstream::{self, ClusterCounters, EndpointPool, Pool, PoolKey};

/// Why a cluster could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A policy or hash name that is none.
    #[error(transparent)]
    Settings(#[from] FieldError),
    /// The balancer rejected the settings or the endpoints.
    #[error(transparent)]
    Balancer(#[from] meshless_balance::ConfigError),
    /// An endpoint without a socket address.
    #[error("endpoint {0} has no address")]
    NoAddress(String),
    /// An endpoint address that is no URI authority.
    #[error(transparent)]
    Authority(#[from] http::uri::InvalidUri),
    /// The `tls:` block cannot be used (its CA file, say).
    #[error(transparent)]
    Tls(#[from] upstream::TlsConfigError),
}

/// Why a snapshot could not be built: the cluster at fault and why.
#[derive(Debug, thiserror::Error)]
#[error("clusters[{index}]: {source}")]
pub struct SnapshotError {
    /// Position of the cluster in the config.
    pub index: usize,
    pub source: ClusterError,
}

/// A cluster as the request path uses it.
#[derive(Debug)]
pub struct UpstreamCluster {
    pub name: Arc<str>,
    /// The file's cluster with the service's settings applied where the
    /// file is silent (the file's own when they cannot apply).
    pub config: ClusterConfig,
    /// Why the service's settings could not apply, if they could not.
    pub settings_error: Option<FieldError>,
    /// The balancer, with load, health and outlier state.
    pub lb: Cluster,
    /// `ip:port` of each endpoint, by balancer index.
    pub authorities: Vec<Authority>,
    /// Endpoint ids as shared strings (metric labels), by balancer index.
    pub endpoint_labels: Vec<Arc<str>>,
    /// Each endpoint's metric series handle, by balancer index: made at
    /// first use, carried over by rebuilds while the endpoint stays, so its
    /// series are removed once no snapshot (nor anything begun on one)
    /// holds it ([`crate::endpoint_series`]).
    series: Vec<OnceLock<Arc<EndpointSeries>>>,
    /// The cluster's connections.
    pub pool: Pool,
    /// Each endpoint's connections, by balancer index.
    pub endpoint_pools: Vec<Arc<EndpointPool>>,
    pub pool_key: PoolKey,
    pub counters: Arc<ClusterCounters>,
}

impl UpstreamCluster {
    /// Builds from validated config, keeping `previous`'s live state and,
    /// when the pool settings are unchanged, its connections. `node`: this
    /// proxy's node and zone, the only locality tiers built (every pick
    /// names them), and whether it knows its node (for a service's
    /// `local-only` setting). `read_ca`: read the `tls.ca_file` again (a
    /// start or reload; else the previous contents are kept while its
    /// path is the same, as for an endpoint update).
    pub fn build(
        declared: &ClusterConfig,
        previous: Option<&UpstreamCluster>,
        services: &ServiceFeeds,
        (node, read_ca): (&NodeConfig, bool),
    ) -> Result<Self, ClusterError> {
        let has_node = node.name.is_some();
        let feed = declared.service.as_ref().and_then(|s| services.get(s));
        let endpoints = match (&declared.service, feed) {
            (Some(_), Some(f)) => f.endpoints.clone(),
            (Some(_), None) => Vec::new(),
            (None, _) => declared.endpoints_model(),
        };
        let (config, settings_error) = effective_config(declared, feed, endpoints.len(), has_node);
        let previous_error = previous.and_then(|p| p.settings_error.as_ref());
        if let Some(e) = &settings_error
            && previous_error != Some(e)
        {
            tracing::warn!(cluster = %declared.name, setting = %e.path, reason = %e.reason, "service settings cannot apply; using the file's cluster config");
        }
        let config = &config;
        let balance = config.balance_config()?;
        // Warn once as a cluster crosses the rule, not on every rebuild.
        let was_small =
            previous.is_some_and(|p| balance.maglev_table_small_for(p.lb.endpoints().len()));
        if balance.maglev_table_small_for(endpoints.len()) && !was_small {
            tracing::warn!(
                cluster = %config.name,
                endpoints = endpoints.len(),
                table_size = balance.maglev_table_size(endpoints.len()),
                "Maglev table at its cap (balancer.max_table_size) is under 100 entries per endpoint: keys spread unevenly"
            );
        }
        let tiers = Tiers::caller(node.name.as_deref(), node.zone.as_deref());
        let lb = match previous {
            Some(p) => p.lb.rebuild_for(&endpoints, balance, tiers),
            None => Cluster::new_for(&endpoints, balance, tiers),
        }?;
        let addrs = lb
            .endpoints()
            .iter()
            .map(|e| {
                e.socket_addr()
                    .ok_or_else(|| ClusterError::NoAddress(e.id.to_string()))
            })
            .collect::<Result<Vec<_>, ClusterError>>()?;
        let authorities = addrs
            .iter()
            .map(|a| Authority::try_from(a.to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        let endpoint_labels: Vec<Arc<str>> = lb
            .endpoints()
            .iter()
            .map(|e| Arc::from(e.id.as_str()))
            .collect();
        let series = carried_series(previous, &endpoint_labels);
        let counters = previous.map_or_else(Default::default, |p| Arc::clone(&p.counters));
        counters
            .max_connections
            .store(config.circuit_breakers.max_connections, Ordering::Relaxed);
        let ca = match (&config.tls, previous) {
            (None, _) => None,
            (Some(tls), Some(p))
                if !read_ca && p.config.tls.as_ref().map(|t| &t.ca_file) == Some(&tls.ca_file) =>
            {
                p.pool_key.ca().cloned()
            }
            (Some(tls), _) => Some(upstream::CaBundle(upstream::read_ca(tls)?)),
        };
        let pool_key = PoolKey::of(config, ca);
        let pool = match previous {
            Some(p) if p.pool_key == pool_key => p.pool.clone(),
            _ => upstream::pool(&pool_key, Arc::clone(&counters))?,
        };
        let endpoint_pools = pool.endpoints(&addrs);
        Ok(Self {
            name: Arc::from(config.name.as_str()),
            config: config.clone(),
            settings_error,
            lb,
            authorities,
            endpoint_labels,
            series,
            pool,
            endpoint_pools,
            pool_key,
            counters,
        })
    }
}

impl UpstreamCluster {
    /// The metric series handle of the endpoint at `index`.
    pub fn series(&self, index: usize, table: &SeriesTable) -> Arc<EndpointSeries> {
        let handle =
            self.series[index].get_or_init(|| table.get(&self.name, &self.endpoint_labels[index]));
        Arc::clone(handle)
    }
}

/// The series handles `previous` made for endpoints still in the cluster,
/// by their new index (the others are made at first use).
fn carried_series(
    previous: Option<&UpstreamCluster>,
    labels: &[Arc<str>],
) -> Vec<OnceLock<Arc<EndpointSeries>>> {
    let made: HashMap<&str, &Arc<EndpointSeries>> = previous
        .map(|p| {
            p.endpoint_labels
                .iter()
                .zip(&p.series)
                .filter_map(|(label, s)| Some((&**label, s.get()?)))
                .collect()
        })
        .unwrap_or_default();
    labels
        .iter()
        .map(|label| match made.get(&**label) {
            Some(s) => OnceLock::from(Arc::clone(s)),
            None => OnceLock::new(),
        })
        .collect()
}

/// The declared cluster with the service's settings applied, if they
/// apply to it and the result is a valid balancer for `endpoints`
/// endpoints; else the declared one and why.
fn effective_config(
    declared: &ClusterConfig,
    feed: Option<&ServiceFeed>,
    endpoints: usize,
    has_node: bool,
) -> (ClusterConfig, Option<FieldError>) {
    let Some(settings) = feed.map(|f| &f.settings).filter(|s| !s.is_empty()) else {
        return (declared.clone(), None);
    };
    let applied = declared
        .with_service_settings(settings, has_node)
        .and_then(|c| {
            c.balance_config()?
                .validate_for(endpoints)
                .map_err(|e| FieldError::new("balancer", e.to_string()))?;
            Ok(c)
        });
    match applied {
        Ok(c) => (c, None),
        Err(e) => (declared.clone(), Some(e)),
    }
}

/// What the control plane last sent for one service.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServiceFeed {
    pub endpoints: Vec<meshless_model::Endpoint>,
    /// Balancing settings ([`ClusterConfig::with_service_settings`]).
    pub settings: meshless_model::ServiceSettings,
}

/// What `service:` clusters are built from, by `namespace/name`, as last
/// received from the control plane.
pub type ServiceFeeds = HashMap<String, ServiceFeed>;

/// A map by configured name, looked up on every request: hashed by
/// foldhash, not std's SipHash (about 180 instructions per lookup of a
/// short name, two lookups per request). The names are the
/// configuration's, never a client's, so flooding is not a concern.
pub type ByName<V> = HashMap<String, V, foldhash::fast::RandomState>;

/// Everything a request needs, at one config version.
#[derive(Debug)]
pub struct Snapshot {
    pub config: Arc<ProxyConfig>,
    pub routes: ByName<Arc<RouteTable>>,
    pub clusters: ByName<Arc<UpstreamCluster>>,
}

impl Snapshot {
    /// Builds from validated config, carrying state over from `previous`.
    pub fn build(
        config: ProxyConfig,
        previous: Option<&Snapshot>,
        services: &ServiceFeeds,
    ) -> Result<Self, SnapshotError> {
        let mut clusters = ByName::default();
        for (i, c) in config.clusters.iter().enumerate() {
            let prev = previous
                .and_then(|p| p.clusters.get(&c.name))
                .map(Arc::as_ref);
            let built = UpstreamCluster::build(c, prev, services, (&config.node, true))
                .map_err(|source| SnapshotError { index: i, source })?;
            clusters.insert(c.name.clone(), Arc::new(built));
        }
        let routes = config
            .listeners
            .iter()
            .map(|l| (l.name.clone(), Arc::new(RouteTable::new(l))))
            .collect();
        Ok(Self {
            config: Arc::new(config),
            routes,
            clusters,
        })
    }
}

impl Snapshot {
    /// This snapshot with the clusters of `service` rebuilt from `services`
    /// (keeping their endpoint state); everything else is shared.
    pub fn with_service(
        &self,
        service: &str,
        services: &ServiceFeeds,
    ) -> Result<Self, ClusterError> {
        let mut clusters = self.clusters.clone();
        // Built from the file's clusters: the settings apply afresh.
        for declared in &self.config.clusters {
            if declared.service.as_deref() == Some(service) {
                let prev = self.clusters.get(&declared.name).map(Arc::as_ref);
                let built =
                    UpstreamCluster::build(declared, prev, services, (&self.config.node, false))?;
                clusters.insert(declared.name.clone(), Arc::new(built));
            }
        }
        Ok(Self {
            config: Arc::clone(&self.config),
            routes: self.routes.clone(),
            clusters,
        })
    }

    /// The services the clusters reference.
    pub fn watched_services(&self) -> std::collections::BTreeSet<String> {
        self.config
            .clusters
            .iter()
            .filter_map(|c| c.service.clone())
            .collect()
    }

    /// What the control link asks for: every referenced service, and a
    /// subset for a service when every cluster referencing it asks for one
    /// (the largest; one cluster without `subset` needs every endpoint, and
    /// the proxy holds one view per service), zone-aware when every one of
    /// them asks it.
    pub fn watched(&self) -> Watched {
        let mut subsets = std::collections::BTreeMap::new();
        let mut whole = std::collections::BTreeSet::new();
        for c in &self.config.clusters {
            let Some(service) = &c.service else { continue };
            match c.subset {
                Some(s) => {
                    let ask: &mut SubsetConfig = subsets.entry(service.clone()).or_insert(s);
                    ask.size = ask.size.max(s.size);
                    ask.zone_aware &= s.zone_aware;
                }
                None => {
                    whole.insert(service.clone());
                }
            }
        }
        subsets.retain(|s, _| !whole.contains(s));
        Watched {
            services: self.watched_services(),
            subsets,
        }
    }
}

/// The services a proxy follows, and the subset size of those it follows
/// as a subset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Watched {
    pub services: std::collections::BTreeSet<String>,
    pub subsets: std::collections::BTreeMap<String, SubsetConfig>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshless_model::{LocalityChoice, ServiceSettings};

    fn feed(settings: ServiceSettings) -> ServiceFeed {
        ServiceFeed {
            endpoints: Vec::new(),
            settings,
        }
    }

    /// Settings that cannot apply leave the file's cluster in force and
    /// say why; settings that can are applied.
    #[test]
    fn settings_that_cannot_apply_fall_back_to_the_file() {
        let declared: ClusterConfig =
            meshless_model::yaml::from_str("name: web\nservice: shop/web\n").expect("yaml");
        let local_only = feed(ServiceSettings {
            locality: Some(LocalityChoice::LocalOnly),
            ..ServiceSettings::default()
        });
        let (c, e) = effective_config(&declared, Some(&local_only), 3, false);
        assert_eq!(c, declared);
        assert_eq!(e.expect("refused").path, "locality");
        let (c, e) = effective_config(&declared, Some(&local_only), 3, true);
        assert!(e.is_none() && c.locality.is_some());
        // The file's locality block stays while the policy applies.
        let declared_ring: ClusterConfig = meshless_model::yaml::from_str(
            "name: web\nservice: shop/web\nlocality: { mode: prefer }\n",
        )
        .expect("yaml");
        let maglev = feed(ServiceSettings {
            policy: Some("maglev".into()),
            ..ServiceSettings::default()
        });
        let (c, e) = effective_config(&declared_ring, Some(&maglev), 3, false);
        assert!(e.is_none(), "{e:?}");
        assert_eq!(c.balancer.policy, "maglev");
        let (c, e) = effective_config(&declared, None, 3, false);
        assert!(e.is_none() && c == declared);
    }

    /// A service is asked as a subset only when every cluster on it asks
    /// for one (the largest size); one cluster without `subset` needs all.
    #[test]
    fn watched_asks_a_subset_only_when_every_cluster_does() {
        let yaml = "control: { address: \"127.0.0.1:1\" }\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{ cluster: a }]\nclusters:\n  - { name: a, service: ns/a, subset: { size: 5 } }\n  - { name: a2, service: ns/a, subset: { size: 8 } }\n  - { name: b, service: ns/b, subset: { size: 5 } }\n  - { name: b2, service: ns/b }\n  - { name: c, service: ns/c }\n";
        let config = crate::ProxyConfig::parse(yaml, "p.yaml").expect("valid");
        let snap = Snapshot::build(config, None, &Default::default()).expect("snapshot");
        let w = snap.watched();
        assert_eq!(
            w.services.iter().map(String::as_str).collect::<Vec<_>>(),
            ["ns/a", "ns/b", "ns/c"]
        );
        assert_eq!(
            w.subsets
                .into_iter()
                .map(|(s, ask)| (s, ask.size, ask.zone_aware))
                .collect::<Vec<_>>(),
            [("ns/a".to_owned(), 8, false)]
        );
        let bad = |extra: &str| {
            let y = yaml.replace("subset: { size: 5 } }\n  - { name: b2", extra);
            crate::ProxyConfig::parse(&y, "p.yaml")
                .expect_err("invalid")
                .to_string()
        };
        let e = bad("subset: { size: 0 } }\n  - { name: b2");
        assert!(
            e.contains("clusters[2].subset.size: must be 1..=100000, got 0"),
            "{e}"
        );
        let e = bad("subset: { size: 5, zone: true } }\n  - { name: b2");
        assert!(e.contains("unknown field `zone`"), "{e}");
    }

    /// A subset is zone-aware only when every cluster on the service asks
    /// it: one that does not wants its endpoints spread over every zone.
    #[test]
    fn watched_asks_zone_aware_only_when_every_cluster_does() {
        let yaml = "control: { address: \"127.0.0.1:1\" }\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{ cluster: a }]\nclusters:\n  - { name: a, service: ns/a, subset: { size: 5, zone_aware: true } }\n  - { name: a2, service: ns/a, subset: { size: 8, zone_aware: true } }\n  - { name: b, service: ns/b, subset: { size: 5, zone_aware: true } }\n  - { name: b2, service: ns/b, subset: { size: 5 } }\n";
        let config = crate::ProxyConfig::parse(yaml, "p.yaml").expect("valid");
        let snap = Snapshot::build(config, None, &Default::default()).expect("snapshot");
        let asked: Vec<(String, u32, bool)> = snap
            .watched()
            .subsets
            .into_iter()
            .map(|(s, ask)| (s, ask.size, ask.zone_aware))
            .collect();
        assert_eq!(
            asked,
            [("ns/a".to_owned(), 8, true), ("ns/b".to_owned(), 5, false)]
        );
    }
}
