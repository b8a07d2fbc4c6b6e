//! Power of k choices (P2C when k = 2).

use super::{Balancer, View, least_loaded, pick_eligible_weighted};
use crate::context::PickContext;
use crate::rng::SplitMix64;

/// Largest supported `k`.
pub const MAX_CHOICES: usize = 16;
/// Rounds of drawing before the pick falls back to a weighted scan.
const ROUNDS: usize = 4;

/// Draws `k` distinct members uniformly and returns the eligible one with
/// the highest `weight / (in_flight + 1)`.
///
/// Invariants: with at least `k` members the draws are distinct (Floyd's
/// sampling); the result is never more loaded, relative to weight, than
/// another eligible draw of the same round; ties go to a random draw.
#[derive(Debug)]
pub struct PowerOfChoices {
    members: Vec<u32>,
    choices: usize,
}

impl PowerOfChoices {
    /// Over `members` with `choices` draws (clamped to `2..=MAX_CHOICES`).
    pub fn new(members: &[u32], choices: usize) -> Self {
        Self {
            members: members.to_vec(),
            choices: choices.clamp(2, MAX_CHOICES),
        }
    }

    /// Draws `min(k, n)` distinct positions into `out`; returns how many.
    pub(crate) fn draw(&self, rng: &mut SplitMix64, out: &mut [usize; MAX_CHOICES]) -> usize {
        let n = self.members.len();
        let k = self.choices.min(n);
        // Floyd: for j in n-k..n, take t in 0..=j; if taken, take j.
        let mut len = 0;
        for j in (n - k)..n {
            let t = rng.below(j + 1);
            let pick = if out[..len].contains(&t) { j } else { t };
            out[len] = pick;
            len += 1;
        }
        len
    }
}

impl Balancer for PowerOfChoices {
    fn pick(&self, view: &View<'_>, ctx: &PickContext<'_>) -> Option<u32> {
        if self.members.is_empty() {
            return None;
        }
        let mut rng = SplitMix64::new(ctx.entropy);
        let mut drawn = [0usize; MAX_CHOICES];
        for _ in 0..ROUNDS {
            let len = self.draw(&mut rng, &mut drawn);
            let members = &self.members;
            let best = least_loaded(view, drawn[..len].iter().map(|&pos| members[pos]), &mut rng);
            if best.is_some() {
                return best;
            }
        }
        pick_eligible_weighted(view, &self.members, &mut rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Cluster, ClusterConfig, PolicyKind};
    use meshless_model::Endpoint;
    use proptest::prelude::*;

    fn cluster(n: usize) -> Cluster {
        let eps: Vec<Endpoint> = (0..n)
            .map(|i| {
                Endpoint::new(
                    format!("ep-{i}"),
                    format!("127.0.0.1:{}", 1000 + i).parse().expect("address"),
                )
            })
            .collect();
        Cluster::new(&eps, ClusterConfig::new(PolicyKind::PowerOfChoices)).expect("valid")
    }

    proptest! {
        /// With at least k members, the k draws are distinct.
        #[test]
        fn draws_are_distinct(n in 1usize..50, k in 2usize..=MAX_CHOICES, seed in any::<u64>()) {
            let members: Vec<u32> = (0..n as u32).collect();
            let p = PowerOfChoices::new(&members, k);
            let mut rng = SplitMix64::new(seed);
            let mut out = [0usize; MAX_CHOICES];
            let len = p.draw(&mut rng, &mut out);
            prop_assert_eq!(len, k.min(n));
            let mut seen = out[..len].to_vec();
            seen.sort_unstable();
            seen.dedup();
            prop_assert_eq!(seen.len(), len);
            prop_assert!(out[..len].iter().all(|&d| d < n));
        }

        /// P2C never returns the more loaded of its two draws.
        #[test]
        fn never_the_more_loaded_draw(
            loads in prop::collection::vec(0u32..8, 2..40),
            seed in any::<u64>(),
        ) {
            let n = loads.len();
            let c = cluster(n);
            let mut guards = Vec::new();
            for (i, &l) in loads.iter().enumerate() {
                for _ in 0..l {
                    guards.push(c.start(i).expect("in range"));
                }
            }
            let members: Vec<u32> = (0..n as u32).collect();
            let p = PowerOfChoices::new(&members, 2);
            // Reproduce the pick's first round of draws from the same seed.
            let mut rng = SplitMix64::new(seed);
            let mut out = [0usize; MAX_CHOICES];
            p.draw(&mut rng, &mut out);
            let picked = c
                .pick_index(&crate::PickContext::new().with_entropy(seed))
                .expect("pick");
            prop_assert!(picked == out[0] || picked == out[1]);
            let other = if picked == out[0] { out[1] } else { out[0] };
            prop_assert!(loads[picked] <= loads[other]);
        }
    }
}
