//! A cluster: one immutable snapshot of endpoints with its algorithm, plus
//! the live state shared with every other snapshot of the same cluster.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use meshless_model::{Endpoint, EndpointId, routable_endpoints};

use crate::clock::{Clock, MonotonicClock};
use crate::config::{BalancerConfig, ClusterConfig, ConfigError, HashKind, PolicyKind};
use crate::context::PickContext;
use crate::locality::{Group, Locality, LocalityConfig, LocalityMode, Tier, Tiers};
use crate::policy::{
    Balancer, BoundedLoad, Filter, HashTable, LeastRequest, Maglev, PowerOfChoices, Random,
    RingHash, RoundRobin, Scope, View, auto_ring_size, next_prime, table_size_for,
};
use crate::set::{AvailabilityCache, EndpointSet};
use crate::state::{ClusterShared, EndpointState, EndpointStats, InFlight, Location};

/// One cluster snapshot: endpoints, the algorithm built over them and, with
/// locality, one prebuilt algorithm per node and per zone of [`Tiers`]
/// (every one, or only the caller's).
///
/// Snapshots are immutable; a change of endpoints or settings builds a new
/// one with [`Cluster::rebuild`], which keeps the load, health and outlier
/// state of every endpoint whose id stays at the same addresses and port
/// (and of an endpoint that left while ejected and comes back there). An id
/// at another address is a new host with fresh state; requests still
/// running on the old address end on the old state. Picking takes no lock
/// and allocates nothing.
///
/// Building has no effect on the live state: a rebuilt snapshot becomes the
/// cluster's current one (its member list is what outlier ejection counts,
/// its settings what it applies) when it is published, explicitly with
/// [`Cluster::publish`] or on its first pick, start, health check or tick.
/// A snapshot older than the published one never publishes, so a build
/// discarded by a failed reload changes nothing.
///
/// Only routable endpoints enter the set (kube-proxy's rule: ready ones, or
/// serving-and-terminating ones when none is ready).
#[derive(Debug)]
pub struct Cluster {
    set: EndpointSet,
    all: Box<dyn Balancer>,
    locality: Option<Locality>,
    config: ClusterConfig,
    /// Which locality tiers this snapshot (and each rebuild) builds.
    tiers: Tiers,
    generation: u64,
}

impl Cluster {
    /// A new cluster with fresh state and the monotonic clock, with a
    /// locality tier for every node and zone ([`Tiers::Every`]).
    pub fn new(endpoints: &[Endpoint], config: ClusterConfig) -> Result<Self, ConfigError> {
        Self::with_clock(endpoints, config, Arc::new(MonotonicClock::new()))
    }

    /// A new cluster with fresh state and the monotonic clock, building
    /// only the locality tiers of `tiers` (a proxy: its own node and zone).
    pub fn new_for(
        endpoints: &[Endpoint],
        config: ClusterConfig,
        tiers: Tiers,
    ) -> Result<Self, ConfigError> {
        Self::with_tiers(endpoints, config, Arc::new(MonotonicClock::new()), tiers)
    }

    /// A new cluster with fresh state and the given clock (published), with
    /// a locality tier for every node and zone.
    pub fn with_clock(
        endpoints: &[Endpoint],
        config: ClusterConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, ConfigError> {
        Self::with_tiers(endpoints, config, clock, Tiers::Every)
    }

    /// A new cluster with fresh state, the given clock and the locality
    /// tiers of `tiers` (published).
    pub fn with_tiers(
        endpoints: &[Endpoint],
        config: ClusterConfig,
        clock: Arc<dyn Clock>,
        tiers: Tiers,
    ) -> Result<Self, ConfigError> {
        let shared = Arc::new(ClusterShared::new(clock, config.outlier, config.health));
        let c = Self::build(endpoints, config, tiers, shared, &HashMap::new())?;
        c.publish();
        Ok(c)
    }

    /// The next snapshot: new endpoints and settings, same live state for
    /// endpoints that stay. On error nothing changes; on success nothing
    /// changes either until the new snapshot is published.
    /// The locality tiers are this snapshot's.
    pub fn rebuild(
        &self,
        endpoints: &[Endpoint],
        config: ClusterConfig,
    ) -> Result<Self, ConfigError> {
        self.rebuild_for(endpoints, config, self.tiers.clone())
    }

    /// [`Cluster::rebuild`] building the locality tiers of `tiers` (the
    /// caller moved node or zone, as a reload may say).
    pub fn rebuild_for(
        &self,
        endpoints: &[Endpoint],
        config: ClusterConfig,
        tiers: Tiers,
    ) -> Result<Self, ConfigError> {
        let previous: HashMap<&EndpointId, &Arc<EndpointState>> =
            self.set.states.iter().map(|s| (&s.id, s)).collect();
        let shared = Arc::clone(&self.set.shared);
        Self::build(endpoints, config, tiers, shared, &previous)
    }

    fn build(
        endpoints: &[Endpoint],
        config: ClusterConfig,
        tiers: Tiers,
        shared: Arc<ClusterShared>,
        previous: &HashMap<&EndpointId, &Arc<EndpointState>>,
    ) -> Result<Self, ConfigError> {
        let mut seen = HashSet::new();
        for e in endpoints {
            e.validate()?;
            if !seen.insert(&e.id) {
                return Err(ConfigError::DuplicateEndpoint(e.id.to_string()));
            }
        }
        let routable: Vec<Endpoint> = routable_endpoints(endpoints).into_iter().cloned().collect();
        config.validate_for(routable.len())?;
        // The state of the same id at the same location (in the previous
        // snapshot, else the published one or departed), else a new host
        // (an id back at another address inherits no ejection or health).
        let remembered = shared.remembered(
            routable
                .iter()
                .map(|e| &e.id)
                .filter(|id| !previous.contains_key(id)),
        );
        let states: Vec<Arc<EndpointState>> = routable
            .iter()
            .map(|e| {
                let at = Location::of(e);
                previous
                    .get(&e.id)
                    .copied()
                    .or_else(|| remembered.get(&e.id))
                    .map(Arc::clone)
                    .filter(|s| s.location == at)
                    .unwrap_or_else(|| {
                        Arc::new(EndpointState::new(
                            e.id.clone(),
                            at,
                            config.health.initially_healthy,
                        ))
                    })
            })
            .collect();
        let weights: Vec<u32> = routable.iter().map(|e| e.weight).collect();
        let generation = shared.next_generation();
        let set = EndpointSet {
            total_weight: weights.iter().map(|&w| u64::from(w)).sum(),
            endpoints: routable,
            states,
            weights,
            shared,
            availability: AvailabilityCache::new(),
        };
        let everyone: Vec<u32> = (0..set.len() as u32).collect();
        let all = build_balancer(&config.balancer, &set, &everyone, Scope::Cluster);
        let locality = config
            .locality
            .map(|lc| build_locality(&config.balancer, &set, lc, &tiers));
        Ok(Self {
            set,
            all,
            locality,
            config,
            tiers,
            generation,
        })
    }

    /// How many locality tiers this snapshot holds: `(nodes, zones)`.
    pub fn tier_counts(&self) -> (usize, usize) {
        self.locality
            .as_ref()
            .map_or((0, 0), |l| (l.nodes.len(), l.zones.len()))
    }

    /// Makes this snapshot the cluster's current one (its members are what
    /// outlier ejection and the eligible total count), unless a newer
    /// snapshot already is. Idempotent.
    pub fn publish(&self) {
        self.set.shared.publish(
            self.generation,
            &self.set.states,
            self.config.outlier,
            self.config.health,
        );
    }

    #[inline]
    fn ensure_published(&self) {
        if !self.set.shared.is_published(self.generation) {
            self.publish();
        }
    }

    /// Chooses an endpoint and starts a request on it. `None` when the
    /// cluster has no endpoint, or none is available and panic mode is off
    /// (or, with locality `local_only`, the caller's node has none; under
    /// bounded load the node's own load sets the bound, so a node with an
    /// eligible endpoint always answers).
    #[inline]
    pub fn pick(&self, ctx: &PickContext<'_>) -> Option<InFlight> {
        let (i, reserved) = self.choose(ctx, true)?;
        let (state, shared) = (&self.set.states[i], &self.set.shared);
        Some(if reserved {
            InFlight::adopt(state, shared, i)
        } else {
            InFlight::start(state, shared, i)
        })
    }

    /// Starts a request on the endpoint at `index` (after a lookaside pick,
    /// or to retry on a chosen endpoint). `None` if out of range.
    pub fn start(&self, index: usize) -> Option<InFlight> {
        self.ensure_published();
        let state = self.set.states.get(index)?;
        Some(InFlight::start(state, &self.set.shared, index))
    }

    /// Chooses an endpoint without starting a request (lookaside: the caller
    /// connects itself). Bounded load checks its bound without reserving.
    pub fn pick_index(&self, ctx: &PickContext<'_>) -> Option<usize> {
        self.choose(ctx, false).map(|(i, _)| i)
    }

    /// Whether fewer than `panic_threshold` percent of the endpoints are available.
    pub fn in_panic(&self) -> bool {
        let n = self.set.len() as u64;
        n > 0 && self.set.available_all().count * 100 < u64::from(self.config.panic_threshold) * n
    }

    /// The pick: panic mode over every endpoint, else locality, else the
    /// whole set. With `reserve`, the flag says the request is already counted.
    fn choose(&self, ctx: &PickContext<'_>, reserve: bool) -> Option<(usize, bool)> {
        self.ensure_published();
        let pick = |b: &dyn Balancer, v: &View<'_>, c: &PickContext<'_>| {
            if reserve {
                b.pick_reserved(v, c)
            } else {
                b.pick(v, c).map(|e| (e, false))
            }
        };
        let view = View {
            set: &self.set,
            filter: Filter::Available,
        };
        if let Some(loc) = &self.locality
            && loc.config.mode == LocalityMode::LocalOnly
        {
            return loc
                .pick_local(&view, ctx, self.config.panic_threshold, &pick)
                .map(|(e, r)| (e as usize, r));
        }
        if self.in_panic() {
            let any = View {
                set: &self.set,
                filter: Filter::Any,
            };
            return self.all.pick(&any, ctx).map(|e| (e as usize, false));
        }
        if let Some(loc) = &self.locality
            && let Some((e, r)) = loc.pick(&view, ctx, self.all.as_ref(), &pick)
        {
            return Some((e as usize, r));
        }
        pick(self.all.as_ref(), &view, ctx).map(|(e, r)| (e as usize, r))
    }
    /// The endpoints of this snapshot.
    pub fn endpoints(&self) -> &[Endpoint] {
        &self.set.endpoints
    }

    /// The endpoint set the algorithms read.
    pub fn set(&self) -> &EndpointSet {
        &self.set
    }

    /// The settings this snapshot was built with.
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// Live state of the endpoint at `index`.
    pub fn stats(&self, index: usize) -> Option<EndpointStats> {
        self.set.states.get(index).map(|s| s.snapshot())
    }

    /// Applies an active health-check result to the endpoint at `index`.
    pub fn record_health_check(&self, index: usize, passed: bool) {
        self.ensure_published();
        if let Some(s) = self.set.states.get(index) {
            self.set.shared.record_check(s, passed);
        }
    }

    /// Periodic housekeeping, every `outlier.interval`: returns endpoints
    /// whose ejection time is up and decays ejection multipliers.
    pub fn tick(&self) {
        self.ensure_published();
        self.set.shared.tick();
    }
}

/// The locality tiers of `tiers` over `set`, one algorithm each.
fn build_locality(
    cfg: &BalancerConfig,
    set: &EndpointSet,
    lc: LocalityConfig,
    tiers: &Tiers,
) -> Locality {
    let (nodes, zones) = Locality::groups(set, lc.mode, tiers);
    // A `local_only` node tier is all the caller may use: bounded load
    // divides the tier's own load, never refusing (see Scope).
    let node_scope = match lc.mode {
        LocalityMode::LocalOnly => Scope::OwnTier,
        _ => Scope::SpillingTier,
    };
    let build = |groups: Vec<Group>, scope: Scope| {
        groups
            .into_iter()
            .map(|(name, members)| {
                let b = build_balancer(cfg, set, &members, scope);
                let w = members
                    .iter()
                    .map(|&m| u64::from(set.weight(m as usize)))
                    .sum();
                (name, Tier::new(members, w, b))
            })
            .collect()
    };
    Locality {
        nodes: build(nodes, node_scope),
        zones: build(zones, Scope::SpillingTier),
        config: lc,
    }
}

/// Builds the configured algorithm over `members` of `set`. Tiers (any
/// scope but the cluster's) get hash tables sized for their own member count.
fn build_balancer(
    cfg: &BalancerConfig,
    set: &EndpointSet,
    members: &[u32],
    scope: Scope,
) -> Box<dyn Balancer> {
    let strict = scope != Scope::Cluster;
    let weight_of = |m: u32| set.weight(m as usize);
    let id_of = |m: u32| set.endpoints[m as usize].id.as_str();
    let ring = || {
        let auto = auto_ring_size(members.len());
        let size = match cfg.ring_size {
            Some(s) if strict => s.min(auto),
            Some(s) => s,
            None => auto,
        };
        RingHash::new(members, id_of, weight_of, size)
    };
    let maglev = || {
        let grown = table_size_for(cfg.table_size, cfg.max_table_size, members.len());
        let size = if strict {
            grown.min(next_prime((members.len() * 101).max(1009)))
        } else {
            grown
        };
        Maglev::new(members, id_of, weight_of, size)
    };
    match cfg.policy {
        PolicyKind::RoundRobin => Box::new(RoundRobin::new(members, weight_of)),
        PolicyKind::Random => Box::new(Random::new(members, weight_of)),
        PolicyKind::LeastRequest => Box::new(LeastRequest::new(members)),
        PolicyKind::PowerOfChoices => {
            Box::new(PowerOfChoices::new(members, cfg.choices, weight_of))
        }
        PolicyKind::RingHash => Box::new(ring()),
        PolicyKind::Maglev => Box::new(maglev()),
        PolicyKind::BoundedLoad => {
            let table: Box<dyn HashTable> = match cfg.over {
                HashKind::RingHash => Box::new(ring()),
                HashKind::Maglev => Box::new(maglev()),
            };
            Box::new(BoundedLoad::new(table, members, cfg.load_factor, scope))
        }
    }
}
