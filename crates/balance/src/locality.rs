//! Locality: same node first, then same zone, then anywhere.

use std::collections::HashMap;

use foldhash::fast::RandomState;

use crate::context::PickContext;
use crate::policy::{Balancer, View};
use crate::set::{AvailabilityCache, EndpointSet};

/// Locality settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LocalityConfig {
    /// A tier is used only while at least this share (0.0..=1.0) of its
    /// endpoints is available; below it, requests spill to the next tier.
    pub min_healthy_share: f64,
}

impl Default for LocalityConfig {
    fn default() -> Self {
        Self {
            min_healthy_share: 0.5,
        }
    }
}

/// A node or zone name with the indices of its endpoints.
pub(crate) type Group = (String, Vec<u32>);

/// One tier: the endpoints of one node or one zone, with its own algorithm.
#[derive(Debug)]
pub(crate) struct Tier {
    members: Vec<u32>,
    balancer: Box<dyn Balancer>,
    availability: AvailabilityCache,
}

impl Tier {
    pub(crate) fn new(members: Vec<u32>, balancer: Box<dyn Balancer>) -> Self {
        Self {
            members,
            balancer,
            availability: AvailabilityCache::new(),
        }
    }
}

/// Tiers per node and per zone, prebuilt so a pick only looks one up.
///
/// Invariant: a tier is tried only when the caller is in it and its
/// available share is at least `min_healthy_share`; a tier whose algorithm
/// returns nothing (all ineligible, or all at their bound under bounded
/// load) spills to the next.
#[derive(Debug)]
pub(crate) struct Locality {
    pub(crate) nodes: HashMap<String, Tier, RandomState>,
    pub(crate) zones: HashMap<String, Tier, RandomState>,
    pub(crate) config: LocalityConfig,
}

impl Locality {
    /// Groups `set`'s endpoints by node and by zone.
    pub(crate) fn groups(set: &EndpointSet) -> (Vec<Group>, Vec<Group>) {
        let mut nodes: HashMap<&str, Vec<u32>, RandomState> = HashMap::default();
        let mut zones: HashMap<&str, Vec<u32>, RandomState> = HashMap::default();
        for (i, e) in set.endpoints.iter().enumerate() {
            if let Some(n) = &e.node {
                nodes.entry(n).or_default().push(i as u32);
            }
            if let Some(z) = &e.zone {
                zones.entry(z).or_default().push(i as u32);
            }
        }
        let own = |m: HashMap<&str, Vec<u32>, RandomState>| {
            m.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
        };
        (own(nodes), own(zones))
    }

    /// The pick from the caller's node tier, else its zone tier, else `None`.
    pub(crate) fn pick(&self, view: &View<'_>, ctx: &PickContext<'_>) -> Option<u32> {
        let tiers = [
            ctx.node.and_then(|n| self.nodes.get(n)),
            ctx.zone.and_then(|z| self.zones.get(z)),
        ];
        for tier in tiers.into_iter().flatten() {
            let a = tier
                .availability
                .get(view.set, tier.members.iter().copied());
            let share = a.count as f64 / tier.members.len() as f64;
            if a.count == 0 || share < self.config.min_healthy_share {
                continue;
            }
            if let Some(e) = tier.balancer.pick(view, ctx) {
                return Some(e);
            }
        }
        None
    }
}
