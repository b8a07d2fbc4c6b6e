//! Power of k choices (P2C when k = 2).

use super::{Balancer, Random, Ties, View, least_loaded, pick_eligible_weighted};
use crate::context::PickContext;
use crate::rng::SplitMix64;

/// Largest supported `k`.
pub const MAX_CHOICES: usize = 16;
/// Default `k` (Envoy's `choice_count`, HAProxy's `random(2)`).
pub const DEFAULT_CHOICES: usize = 2;
/// Redraws of one candidate that came out ineligible (or a duplicate).
const REDRAWS: usize = 8;

/// Weighted power of k choices (P2C when k = 2).
///
/// Draws `k` candidates among the *eligible* members (an ineligible draw is
/// redrawn, up to `REDRAWS` times) and returns the one with the fewest
/// requests in flight per unit of weight (`in_flight / weight`, compared
/// exactly; ties to a random candidate).
///
/// - Equal weights: the draws are uniform and distinct (Floyd's sampling,
///   then redraws for ineligible ones), as HAProxy's `random(2)` after its
///   fix; the result is never more loaded than another candidate.
/// - Unequal weights: each draw is independent and in proportion to weight
///   (Vose alias table), so at equal loads per weight the chosen endpoint is
///   distributed exactly by weight (a heavy endpoint drawn twice is simply
///   chosen), and under concurrency loads settle in proportion to weight.
///   A uniform draw would cap any endpoint at `k / N` of traffic.
///
/// Down endpoints are never candidates, so their share goes to live ones in
/// proportion to weight and P2C keeps its load awareness while they are
/// down. O(k) per pick; a weighted scan only if `REDRAWS` draws in a row hit
/// ineligible members.
#[derive(Debug)]
pub struct PowerOfChoices {
    members: Vec<u32>,
    choices: usize,
    /// Weighted draws (uniform when all weights are equal).
    draws: Random,
}

impl PowerOfChoices {
    /// Over `members` with `choices` draws (clamped to `2..=MAX_CHOICES`).
    pub fn new(members: &[u32], choices: usize, weight_of: impl Fn(u32) -> u32) -> Self {
        Self {
            members: members.to_vec(),
            choices: choices.clamp(2, MAX_CHOICES),
            draws: Random::new(members, weight_of),
        }
    }

    /// Draws up to `k` eligible candidates (endpoint indices) into `out`;
    /// returns how many. Distinct when weights are equal.
    pub(crate) fn draw(
        &self,
        view: &View<'_>,
        rng: &mut SplitMix64,
        out: &mut [u32; MAX_CHOICES],
    ) -> usize {
        let n = self.members.len();
        let k = self.choices.min(n);
        let mut len = 0;
        if self.draws.is_uniform() {
            // Floyd: for j in n-k..n, take t in 0..=j; if taken, take j.
            let mut pos = [0usize; MAX_CHOICES];
            for (slot, j) in ((n - k)..n).enumerate() {
                let t = rng.below(j + 1);
                pos[slot] = if pos[..slot].contains(&t) { j } else { t };
            }
            for &p in &pos[..k] {
                let mut e = self.members[p];
                let mut tries = 0;
                while (!view.eligible(e) || out[..len].contains(&e)) && tries < REDRAWS {
                    e = self.members[rng.below(n)];
                    tries += 1;
                }
                if view.eligible(e) && !out[..len].contains(&e) {
                    out[len] = e;
                    len += 1;
                }
            }
        } else {
            for _ in 0..k {
                let mut e = self.draws.draw(rng);
                let mut tries = 0;
                while !view.eligible(e) && tries < REDRAWS {
                    e = self.draws.draw(rng);
                    tries += 1;
                }
                if view.eligible(e) {
                    out[len] = e;
                    len += 1;
                }
            }
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
        let mut drawn = [0u32; MAX_CHOICES];
        let len = self.draw(view, &mut rng, &mut drawn);
        least_loaded(view, drawn[..len].iter().copied(), Ties::Uniform, &mut rng)
            .or_else(|| pick_eligible_weighted(view, &self.members, &mut rng))
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
        let mut cfg = ClusterConfig::new(PolicyKind::PowerOfChoices);
        cfg.outlier = crate::OutlierConfig::disabled();
        Cluster::new(&eps, cfg).expect("valid")
    }

    proptest! {
        /// With at least k members, the k draws are distinct.
        #[test]
        fn draws_are_distinct(n in 1usize..50, k in 2usize..=MAX_CHOICES, seed in any::<u64>()) {
            let members: Vec<u32> = (0..n as u32).collect();
            let p = PowerOfChoices::new(&members, k, |_| 1);
            let c = cluster(n);
            let view = View { set: c.set(), filter: crate::Filter::Available };
            let mut rng = SplitMix64::new(seed);
            let mut out = [0u32; MAX_CHOICES];
            let len = p.draw(&view, &mut rng, &mut out);
            prop_assert_eq!(len, k.min(n));
            let mut seen = out[..len].to_vec();
            seen.sort_unstable();
            seen.dedup();
            prop_assert_eq!(seen.len(), len);
            prop_assert!(out[..len].iter().all(|&d| (d as usize) < n));
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
            let p = PowerOfChoices::new(&members, 2, |_| 1);
            // Reproduce the pick's draws from the same seed.
            let view = View { set: c.set(), filter: crate::Filter::Available };
            let mut rng = SplitMix64::new(seed);
            let mut out = [0u32; MAX_CHOICES];
            p.draw(&view, &mut rng, &mut out);
            let (out0, out1) = (out[0] as usize, out[1] as usize);
            let picked = c
                .pick_index(&crate::PickContext::new().with_entropy(seed))
                .expect("pick");
            prop_assert!(picked == out0 || picked == out1);
            let other = if picked == out0 { out1 } else { out0 };
            prop_assert!(loads[picked] <= loads[other]);
        }
    }
}
