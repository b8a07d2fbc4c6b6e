//! One immutable, complete view of the running configuration: routes per
//! listener and clusters with their balancers and pools. Swapped whole on
//! reload; requests finish on the snapshot they started with.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use http::uri::Authority;
use meshless_balance::Cluster;
use meshless_model::FieldError;

use crate::config::{ClusterConfig, ProxyConfig};
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
    pub config: ClusterConfig,
    /// The balancer, with load, health and outlier state.
    pub lb: Cluster,
    /// `ip:port` of each endpoint, by balancer index.
    pub authorities: Vec<Authority>,
    /// Endpoint ids as shared strings (metric labels), by balancer index.
    pub endpoint_labels: Vec<Arc<str>>,
    /// The cluster's connections.
    pub pool: Pool,
    /// Each endpoint's connections, by balancer index.
    pub endpoint_pools: Vec<Arc<EndpointPool>>,
    pub pool_key: PoolKey,
    pub counters: Arc<ClusterCounters>,
}

impl UpstreamCluster {
    /// Builds from validated config, keeping `previous`'s live state and,
    /// when the pool settings are unchanged, its connections.
    pub fn build(
        config: &ClusterConfig,
        previous: Option<&UpstreamCluster>,
        services: &ServiceEndpoints,
    ) -> Result<Self, ClusterError> {
        let endpoints = match &config.service {
            Some(s) => services.get(s).cloned().unwrap_or_default(),
            None => config.endpoints_model(),
        };
        let balance = config.balance_config()?;
        // Warn once as a cluster crosses the rule, not on every rebuild.
        let was_small =
            previous.is_some_and(|p| balance.maglev_table_small_for(p.lb.endpoints().len()));
        if balance.maglev_table_small_for(endpoints.len()) && !was_small {
            tracing::warn!(
                cluster = %config.name,
                endpoints = endpoints.len(),
                table_size = balance.balancer.table_size,
                "Maglev table under 100 entries per endpoint: keys spread unevenly; set balancer.table_size to a prime of at least 100x the endpoints (at most 5,000,011)"
            );
        }
        let lb = match previous {
            Some(p) => p.lb.rebuild(&endpoints, balance),
            None => Cluster::new(&endpoints, balance),
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
        let endpoint_labels = lb
            .endpoints()
            .iter()
            .map(|e| Arc::from(e.id.as_str()))
            .collect();
        let counters = previous.map_or_else(Default::default, |p| Arc::clone(&p.counters));
        counters
            .max_connections
            .store(config.circuit_breakers.max_connections, Ordering::Relaxed);
        let pool_key = PoolKey::of(config);
        let pool = match previous {
            Some(p) if p.pool_key == pool_key => p.pool.clone(),
            _ => upstream::pool(&pool_key, Arc::clone(&counters))?,
        };
        let endpoint_pools = pool.endpoints(&addrs);
        Ok(Self {
            name: Arc::from(config.name.as_str()),
            config: config.clone(),
            lb,
            authorities,
            endpoint_labels,
            pool,
            endpoint_pools,
            pool_key,
            counters,
        })
    }
}

/// Endpoints of `service:` clusters, by `namespace/name`, as last received
/// from the control plane.
pub type ServiceEndpoints = HashMap<String, Vec<meshless_model::Endpoint>>;

/// Everything a request needs, at one config version.
#[derive(Debug)]
pub struct Snapshot {
    pub config: Arc<ProxyConfig>,
    pub routes: HashMap<String, Arc<RouteTable>>,
    pub clusters: HashMap<String, Arc<UpstreamCluster>>,
}

impl Snapshot {
    /// Builds from validated config, carrying state over from `previous`.
    pub fn build(
        config: ProxyConfig,
        previous: Option<&Snapshot>,
        services: &ServiceEndpoints,
    ) -> Result<Self, SnapshotError> {
        let mut clusters = HashMap::new();
        for (i, c) in config.clusters.iter().enumerate() {
            let prev = previous
                .and_then(|p| p.clusters.get(&c.name))
                .map(Arc::as_ref);
            let built = UpstreamCluster::build(c, prev, services)
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
        services: &ServiceEndpoints,
    ) -> Result<Self, ClusterError> {
        let mut clusters = self.clusters.clone();
        for (name, c) in &self.clusters {
            if c.config.service.as_deref() == Some(service) {
                let built = UpstreamCluster::build(&c.config, Some(c), services)?;
                clusters.insert(name.clone(), Arc::new(built));
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
}
