//! Least request, by full scan.

use super::{Balancer, Ties, View, least_loaded};
use crate::context::PickContext;
use crate::rng::SplitMix64;

/// Weighted least request: picks the eligible member with the lowest
/// `in_flight / weight`, scanning every member: O(N) per pick, exact.
///
/// Invariants: no eligible member carries strictly fewer requests per unit
/// of weight than the one returned; ties are broken at random in proportion
/// to weight (reservoir sampling). So with no request in flight (or equal
/// loads per weight) the choice is weighted random, and under sustained
/// concurrency loads settle in proportion to weight. Down (ineligible)
/// members are skipped; their share goes to the live ones by the same rule.
/// Envoy uses EDF over `weight / (in_flight + 1)`; that sends ever more to the
/// heaviest endpoint at low concurrency and, at high concurrency, less than
/// its weight (loads settle near `sqrt(weight)`): see
/// [`super::compare_load_per_weight`].
#[derive(Debug)]
pub struct LeastRequest {
    members: Vec<u32>,
}

impl LeastRequest {
    /// Over `members`.
    pub fn new(members: &[u32]) -> Self {
        Self {
            members: members.to_vec(),
        }
    }
}

impl Balancer for LeastRequest {
    fn pick(&self, view: &View<'_>, ctx: &PickContext<'_>) -> Option<u32> {
        let mut rng = SplitMix64::new(ctx.entropy);
        least_loaded(view, self.members.iter().copied(), Ties::Weighted, &mut rng)
    }
}
