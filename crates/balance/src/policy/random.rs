//! Weighted random choice in O(1) per pick (Vose's alias method).

use super::{Balancer, View, pick_eligible_weighted};
use crate::context::PickContext;
use crate::rng::SplitMix64;

/// Draws before a pick gives up on its fast path and scans.
const DRAWS: usize = 8;

/// Weighted random: endpoint `i` is drawn with probability `w_i / W`.
///
/// Invariant: among eligible endpoints the draw stays proportional to
/// weight (ineligible draws are redrawn, then a weighted scan decides).
#[derive(Debug)]
pub struct Random {
    members: Vec<u32>,
    /// Column `c` keeps `members[c]` when a 64-bit draw is below `keep[c]`,
    /// else it yields `members[alias[c]]`. Empty when all weights are equal.
    keep: Vec<u64>,
    alias: Vec<u32>,
}

impl Random {
    /// Builds the alias table over `members`.
    pub fn new(members: &[u32], weight_of: impl Fn(u32) -> u32) -> Self {
        let weights: Vec<u32> = members.iter().map(|&m| weight_of(m).max(1)).collect();
        let (keep, alias) = if weights.iter().all(|&w| w == weights[0]) {
            (Vec::new(), Vec::new())
        } else {
            alias_table(&weights)
        };
        Self {
            members: members.to_vec(),
            keep,
            alias,
        }
    }

    /// One draw in proportion to weight, eligible or not.
    pub(crate) fn draw(&self, rng: &mut SplitMix64) -> u32 {
        let n = self.members.len();
        let c = rng.below(n);
        if self.keep.is_empty() || rng.next_u64() < self.keep[c] {
            self.members[c]
        } else {
            self.members[self.alias[c] as usize]
        }
    }
}

impl Random {
    /// Whether every member has the same weight.
    pub(crate) fn is_uniform(&self) -> bool {
        self.keep.is_empty()
    }
}

impl Balancer for Random {
    fn pick(&self, view: &View<'_>, ctx: &PickContext<'_>) -> Option<u32> {
        if self.members.is_empty() {
            return None;
        }
        let mut rng = SplitMix64::new(ctx.entropy);
        for _ in 0..DRAWS {
            let e = self.draw(&mut rng);
            if view.eligible(e) {
                return Some(e);
            }
        }
        pick_eligible_weighted(view, &self.members, &mut rng)
    }
}

/// Vose's alias method: `keep` thresholds scaled to 2^64 and aliases.
fn alias_table(weights: &[u32]) -> (Vec<u64>, Vec<u32>) {
    let n = weights.len();
    let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
    let mut scaled: Vec<f64> = weights
        .iter()
        .map(|&w| f64::from(w) * n as f64 / total)
        .collect();
    let mut alias = vec![0u32; n];
    let mut keep = vec![u64::MAX; n];
    let (mut small, mut large): (Vec<usize>, Vec<usize>) = (0..n).partition(|&i| scaled[i] < 1.0);
    while let (Some(s), Some(&l)) = (small.pop(), large.last()) {
        keep[s] = prob_to_threshold(scaled[s]);
        alias[s] = l as u32;
        scaled[l] -= 1.0 - scaled[s];
        if scaled[l] < 1.0 {
            large.pop();
            small.push(l);
        }
    }
    // Leftovers are 1.0 up to rounding: they always keep their column.
    (keep, alias)
}

fn prob_to_threshold(p: f64) -> u64 {
    if p >= 1.0 {
        u64::MAX
    } else {
        (p * 18_446_744_073_709_551_616.0) as u64
    }
}
