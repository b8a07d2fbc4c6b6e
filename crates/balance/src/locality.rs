//! Locality: same node first, then same zone, then anywhere.

use std::collections::HashMap;

use foldhash::fast::RandomState;
use serde::{Deserialize, Serialize};

use crate::context::PickContext;
use crate::policy::{Balancer, Filter, View};
use crate::rng::{SplitMix64, mix};
use crate::set::{AvailabilityCache, EndpointSet};
use crate::state::release;

/// Default share of a tier that must be available for `prefer` to use it.
pub const DEFAULT_MIN_HEALTHY_SHARE: f64 = 0.5;
/// Default smallest cluster `proportional` applies to (Envoy's
/// `zone_aware_lb_config.min_cluster_size`).
pub const DEFAULT_MIN_CLUSTER_SIZE: usize = 6;
/// Picks of the next tier tried before accepting one inside the tier spilled from.
const SPILL_TRIES: u64 = 4;

/// How the caller's node and zone steer a pick.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LocalityMode {
    /// All or nothing per tier: the caller's node while at least
    /// `min_healthy_share` of its endpoints are available, else its zone
    /// under the same rule, else anywhere.
    #[default]
    Prefer,
    /// Envoy's zone-aware routing, applied to node then zone: a tier keeps
    /// the share of its traffic its available capacity can take, relative
    /// to the cluster's (`min(1, tier_available/tier_total ÷
    /// all_available/all_total)`, by weight), and the rest spills to
    /// endpoints outside the tier. Off below `min_cluster_size` endpoints
    /// and in panic mode. Callers are assumed to be spread like the
    /// endpoints (Envoy reads the callers' own spread from its local
    /// cluster; a node proxy has no such cluster).
    Proportional,
    /// `prefer` without the node tier: the caller's zone while at least
    /// `min_healthy_share` of its endpoints are available, else anywhere.
    Zone,
    /// Kubernetes `internalTrafficPolicy: Local`: only endpoints on the
    /// caller's node, never spill; nothing when the node has none (or the
    /// caller's node is unknown). Panic mode applies within the node.
    LocalOnly,
}

/// Locality settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LocalityConfig {
    /// How tiers are used.
    pub mode: LocalityMode,
    /// `prefer`: a tier is used only while at least this share (0.0..=1.0)
    /// of its endpoints is available; below it, requests spill to the next tier.
    pub min_healthy_share: f64,
    /// `proportional`: no locality for clusters with fewer endpoints.
    pub min_cluster_size: usize,
}

impl Default for LocalityConfig {
    fn default() -> Self {
        Self {
            mode: LocalityMode::Prefer,
            min_healthy_share: DEFAULT_MIN_HEALTHY_SHARE,
            min_cluster_size: DEFAULT_MIN_CLUSTER_SIZE,
        }
    }
}

/// Which locality tiers a cluster builds.
///
/// A proxy picks only for its own node and zone, so it builds only those
/// tiers ([`Tiers::Caller`]); a tier per node and per zone of the endpoints
/// ([`Tiers::Every`]) is for callers that play many nodes (simulations,
/// tests). A tier is at most one algorithm over its members (a ring of at
/// least 1,024 points, a Maglev table of at least 1,009 entries), so
/// `Every` over endpoints on N nodes builds N such tables per rebuild.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Tiers {
    /// A tier for every node and every zone the endpoints name: a pick
    /// may name any node and zone.
    #[default]
    Every,
    /// Only the caller's node tier and zone tier (each if named and if
    /// some endpoint is there). A pick naming another node or zone finds
    /// no tier there, as one naming a node without endpoints: `prefer`,
    /// `zone` and `proportional` go on to the next tier or anywhere,
    /// `local_only` answers nothing. For the caller's own node and zone a
    /// pick is the same as with [`Tiers::Every`].
    Caller {
        /// The caller's node.
        node: Option<String>,
        /// The caller's zone.
        zone: Option<String>,
    },
}

impl Tiers {
    /// Only the tiers of a caller on `node` in `zone`.
    pub fn caller(node: Option<&str>, zone: Option<&str>) -> Self {
        Tiers::Caller {
            node: node.map(str::to_owned),
            zone: zone.map(str::to_owned),
        }
    }

    /// Whether a tier for node (`is_node`) or zone `name` is built.
    fn wants(&self, name: &str, is_node: bool) -> bool {
        match self {
            Tiers::Every => true,
            Tiers::Caller { node, zone } => {
                let own = if is_node { node } else { zone };
                own.as_deref() == Some(name)
            }
        }
    }
}

/// A node or zone name with the indices of its endpoints.
pub(crate) type Group = (String, Vec<u32>);

/// One tier: the endpoints of one node or one zone, with its own algorithm.
#[derive(Debug)]
pub(crate) struct Tier {
    members: Vec<u32>,
    /// Sum of the members' weights.
    weight: u64,
    balancer: Box<dyn Balancer>,
    availability: AvailabilityCache,
}

impl Tier {
    pub(crate) fn new(members: Vec<u32>, weight: u64, balancer: Box<dyn Balancer>) -> Self {
        Self {
            members,
            weight,
            balancer,
            availability: AvailabilityCache::new(),
        }
    }
}

/// How a tier balancer is asked for an endpoint (reserving or not).
pub(crate) type PickFn<'f> =
    &'f dyn Fn(&dyn Balancer, &View<'_>, &PickContext<'_>) -> Option<(u32, bool)>;

/// Tiers per node and per zone, prebuilt so a pick only looks one up.
///
/// Invariant (`prefer`): a tier is tried only when the caller is in it and
/// its available share is at least `min_healthy_share`; a tier whose
/// algorithm returns nothing (all ineligible, or all at their bound under
/// bounded load) spills to the next.
#[derive(Debug)]
pub(crate) struct Locality {
    pub(crate) nodes: HashMap<String, Tier, RandomState>,
    pub(crate) zones: HashMap<String, Tier, RandomState>,
    pub(crate) config: LocalityConfig,
}

impl Locality {
    /// Groups `set`'s endpoints by node and by zone: only the groups of
    /// `tiers`, and only those `mode` reads (`zone` reads no node tier,
    /// `local_only` no zone tier).
    pub(crate) fn groups(
        set: &EndpointSet,
        mode: LocalityMode,
        tiers: &Tiers,
    ) -> (Vec<Group>, Vec<Group>) {
        let by_node = mode != LocalityMode::Zone;
        let by_zone = mode != LocalityMode::LocalOnly;
        let mut nodes: HashMap<&str, Vec<u32>, RandomState> = HashMap::default();
        let mut zones: HashMap<&str, Vec<u32>, RandomState> = HashMap::default();
        for (i, e) in set.endpoints.iter().enumerate() {
            if let Some(n) = e
                .node
                .as_deref()
                .filter(|n| by_node && tiers.wants(n, true))
            {
                nodes.entry(n).or_default().push(i as u32);
            }
            if let Some(z) = e
                .zone
                .as_deref()
                .filter(|z| by_zone && tiers.wants(z, false))
            {
                zones.entry(z).or_default().push(i as u32);
            }
        }
        let own = |m: HashMap<&str, Vec<u32>, RandomState>| {
            m.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
        };
        (own(nodes), own(zones))
    }

    fn tiers(&self, ctx: &PickContext<'_>) -> [Option<&Tier>; 2] {
        [
            ctx.node.and_then(|n| self.nodes.get(n)),
            ctx.zone.and_then(|z| self.zones.get(z)),
        ]
    }

    /// `prefer` and `proportional`: the pick from the caller's node tier,
    /// else its zone tier, else (proportional only) a pick of `all` outside
    /// the tiers spilled from; `None` leaves the pick to the caller.
    pub(crate) fn pick(
        &self,
        view: &View<'_>,
        ctx: &PickContext<'_>,
        all: &dyn Balancer,
        pick: PickFn<'_>,
    ) -> Option<(u32, bool)> {
        match self.config.mode {
            LocalityMode::Prefer | LocalityMode::Zone => self.prefer(view, ctx, pick),
            LocalityMode::Proportional => self.proportional(view, ctx, all, pick),
            LocalityMode::LocalOnly => None,
        }
    }

    fn prefer(
        &self,
        view: &View<'_>,
        ctx: &PickContext<'_>,
        pick: PickFn<'_>,
    ) -> Option<(u32, bool)> {
        // `zone` skips the node tier.
        let skip = usize::from(self.config.mode == LocalityMode::Zone);
        for tier in self.tiers(ctx).into_iter().skip(skip).flatten() {
            let a = tier
                .availability
                .get(view.set, tier.members.iter().copied());
            let share = a.count as f64 / tier.members.len() as f64;
            if a.count == 0 || share < self.config.min_healthy_share {
                continue;
            }
            if let Some(e) = pick(tier.balancer.as_ref(), view, ctx) {
                return Some(e);
            }
        }
        None
    }

    /// Zone-aware routing: stay in a tier with probability of its relative
    /// available capacity; else pick outside it from the next tier.
    fn proportional(
        &self,
        view: &View<'_>,
        ctx: &PickContext<'_>,
        all: &dyn Balancer,
        pick: PickFn<'_>,
    ) -> Option<(u32, bool)> {
        let set = view.set;
        if set.len() < self.config.min_cluster_size || set.total_weight == 0 {
            return None;
        }
        let global = set.available_all();
        if global.weight == 0 {
            return None;
        }
        let mut rng = SplitMix64::new(mix(ctx.entropy ^ 0x6c6f_6361_6c69_7479));
        // The tier spilled from: the next pick must land outside it.
        let mut outside: Option<(&Tier, bool)> = None;
        let tiers = self.tiers(ctx);
        for (level, tier) in tiers.into_iter().enumerate() {
            let Some(tier) = tier else { continue };
            let a = tier.availability.get(set, tier.members.iter().copied());
            // p = min(1, (a.weight / tier.weight) / (global.weight / total)),
            // compared against a uniform draw in integers.
            let num = u128::from(a.weight) * u128::from(set.total_weight);
            let den = u128::from(tier.weight) * u128::from(global.weight);
            let draw = u128::from(rng.next_u64());
            let stay = a.weight > 0 && (num >= den || draw * den < num << 64);
            if stay {
                return spill_pick(tier.balancer.as_ref(), view, ctx, outside, pick);
            }
            outside = Some((tier, level == 0));
        }
        outside.and_then(|_| spill_pick(all, view, ctx, outside, pick))
    }

    /// `local_only`: the caller's node tier, or nothing. `panic_threshold`
    /// applies to the node's endpoints.
    pub(crate) fn pick_local(
        &self,
        view: &View<'_>,
        ctx: &PickContext<'_>,
        panic_threshold: u8,
        pick: PickFn<'_>,
    ) -> Option<(u32, bool)> {
        let tier = ctx.node.and_then(|n| self.nodes.get(n))?;
        let a = tier
            .availability
            .get(view.set, tier.members.iter().copied());
        let n = tier.members.len() as u64;
        if a.count * 100 < u64::from(panic_threshold) * n {
            let any = View {
                set: view.set,
                filter: Filter::Any,
            };
            return tier.balancer.pick(&any, ctx).map(|e| (e, false));
        }
        pick(tier.balancer.as_ref(), view, ctx)
    }
}

/// A pick of `b` that lands outside the tier in `outside` (if any; the flag
/// says a node tier, else a zone tier): a few tries with fresh entropy, then
/// the last pick is accepted as is (hash policies map a key to one endpoint
/// whatever the entropy). A rejected reservation is released.
fn spill_pick(
    b: &dyn Balancer,
    view: &View<'_>,
    ctx: &PickContext<'_>,
    outside: Option<(&Tier, bool)>,
    pick: PickFn<'_>,
) -> Option<(u32, bool)> {
    let Some((_, is_node)) = outside else {
        return pick(b, view, ctx);
    };
    let inside = |e: u32| {
        let ep = &view.set.endpoints[e as usize];
        if is_node {
            ep.node.as_deref() == ctx.node
        } else {
            ep.zone.as_deref() == ctx.zone
        }
    };
    for k in 0..SPILL_TRIES {
        let c = ctx.with_entropy(mix(ctx.entropy.wrapping_add(k + 1)));
        let got = pick(b, view, &c)?;
        if !inside(got.0) || k + 1 == SPILL_TRIES {
            return Some(got);
        }
        if got.1 {
            release(&view.set.states[got.0 as usize], &view.set.shared);
        }
    }
    None
}
