//! Least request, by full scan.

use super::{Balancer, View, least_loaded};
use crate::context::PickContext;
use crate::rng::SplitMix64;

/// Picks the eligible member with the lowest `(in_flight + 1) / weight`,
/// scanning every member: O(N) per pick, exact.
///
/// Invariant: no eligible member has a strictly lower relative load than the
/// one returned; ties are broken uniformly at random (reservoir sampling),
/// so no position is favoured.
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
        least_loaded(view, self.members.iter().copied(), &mut rng)
    }
}
