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
/// Draws `k` distinct candidates among the *eligible* members and returns
/// the one with the fewest requests in flight per unit of weight
/// (`in_flight / weight`, compared exactly), so it is never more loaded per
/// weight than another candidate.
///
/// - Equal weights: the draws are uniform (Floyd's sampling, then redraws
///   for ineligible ones), as HAProxy's `random(2)` after its fix; ties to
///   a random candidate.
/// - Unequal weights: successive sampling in proportion to weight (Vose
///   alias table; a draw already taken or ineligible is redrawn), ties to
///   the first draw. The first draw is distributed exactly by weight, so at
///   equal loads per weight (idle, say) shares follow weight, and under
///   concurrency loads settle in proportion to weight. A uniform draw would
///   cap any endpoint at `k / N` of traffic.
/// - Why distinct: independent weighted draws land every candidate on a
///   heavy endpoint of weight share `p` with probability `p^k`, and it is
///   then chosen however loaded: with weights 10, 1, 1 and k = 2, at least
///   69% of requests, even while it is slow and far above its share. Envoy's
///   weighted least request (`weight / (active + 1)^bias`, EDF) has no such
///   floor: its share falls as its load rises. With distinct draws, an
///   endpoint carrying more per weight than every other eligible one gets
///   nothing while another is eligible, which is at most Envoy's share
///   (property-tested below).
///
/// Down endpoints are never candidates, so their share goes to live ones in
/// proportion to weight and P2C keeps its load awareness while they are
/// down. O(k) per pick; a weighted scan (O(N)) for a candidate only if
/// `REDRAWS` draws in a row hit ineligible or taken members (an endpoint
/// holding most of the weight: with share `p`, probability `p^REDRAWS`).
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
                let fresh = |e: u32, taken: &[u32]| view.eligible(e) && !taken.contains(&e);
                let mut e = self.draws.draw(rng);
                let mut tries = 0;
                while !fresh(e, &out[..len]) && tries < REDRAWS {
                    e = self.draws.draw(rng);
                    tries += 1;
                }
                let drawn = if fresh(e, &out[..len]) {
                    Some(e)
                } else {
                    weighted_excluding(view, &self.members, &out[..len], rng)
                };
                let Some(e) = drawn else { break };
                out[len] = e;
                len += 1;
            }
        }
        len
    }

    /// How the candidates' ties are broken.
    fn ties(&self) -> Ties {
        if self.draws.is_uniform() {
            Ties::Uniform
        } else {
            Ties::First
        }
    }
}

/// A weighted random choice among the eligible `members` not in `taken`,
/// by scanning.
fn weighted_excluding(
    view: &View<'_>,
    members: &[u32],
    taken: &[u32],
    rng: &mut SplitMix64,
) -> Option<u32> {
    let open = |m: &&u32| view.eligible(**m) && !taken.contains(*m);
    let total: u64 = members
        .iter()
        .filter(open)
        .map(|&m| u64::from(view.weight(m)))
        .sum();
    if total == 0 {
        return None;
    }
    let mut x = rng.next_u64() % total;
    for m in members.iter().filter(open) {
        let w = u64::from(view.weight(*m));
        if x < w {
            return Some(*m);
        }
        x -= w;
    }
    None
}

impl Balancer for PowerOfChoices {
    fn pick(&self, view: &View<'_>, ctx: &PickContext<'_>) -> Option<u32> {
        if self.members.is_empty() {
            return None;
        }
        let mut rng = SplitMix64::new(ctx.entropy);
        let mut drawn = [0u32; MAX_CHOICES];
        let len = self.draw(view, &mut rng, &mut drawn);
        least_loaded(view, drawn[..len].iter().copied(), self.ties(), &mut rng)
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

        /// Envoy's weighted least request picks endpoint `i` with
        /// probability `(w_i / (a_i + 1)) / sum_j (w_j / (a_j + 1))`
        /// (`active_request_bias` 1): a loaded endpoint's share falls with
        /// its load. A heavy endpoint held at ten times the `(a + 1) / w`
        /// of every other gets at most that share of P2C's picks (within 6
        /// sigma). Independent weighted draws gave it `(w_H / W)^2` at least.
        #[test]
        fn a_heavy_endpoint_far_above_its_share_gets_at_most_envoys_share(
            light in prop::collection::vec((1u32..4, 0u32..4), 1..8),
            heavy in 4u32..30,
            k in 2usize..4,
            seed in any::<u64>(),
        ) {
            let max_light = light.iter().map(|&(_, a)| a + 1).max().unwrap_or(1);
            // (a_H + 1) / w_H = 10 x max (a_j + 1) >= 10 x (a_j + 1) / w_j.
            let heavy_load = 10 * heavy * max_light - 1;
            let mut spec = vec![(heavy, heavy_load)];
            spec.extend(light.iter().copied());
            let eps: Vec<Endpoint> = spec
                .iter()
                .enumerate()
                .map(|(i, &(w, _))| {
                    Endpoint::new(
                        format!("ep-{i}"),
                        format!("127.0.0.1:{}", 1000 + i).parse().expect("address"),
                    )
                    .with_weight(w)
                })
                .collect();
            let mut cfg = ClusterConfig::new(PolicyKind::PowerOfChoices);
            cfg.outlier = crate::OutlierConfig::disabled();
            cfg.balancer.choices = k;
            let c = Cluster::new(&eps, cfg).expect("valid");
            let mut guards = Vec::new();
            for (i, &(_, a)) in spec.iter().enumerate() {
                for _ in 0..a {
                    guards.push(c.start(i).expect("in range"));
                }
            }
            let effective = |&(w, a): &(u32, u32)| f64::from(w) / f64::from(a + 1);
            let envoy = effective(&spec[0]) / spec.iter().map(effective).sum::<f64>();
            let picks = 4_000u64;
            let mut rng = SplitMix64::new(seed);
            let heavy_picks = (0..picks)
                .filter(|_| {
                    let ctx = crate::PickContext::new().with_entropy(rng.next_u64());
                    c.pick_index(&ctx) == Some(0)
                })
                .count() as f64;
            let n = picks as f64;
            let bound = envoy * n + 6.0 * (n * envoy * (1.0 - envoy)).sqrt() + 1.0;
            prop_assert!(heavy_picks <= bound,
                "heavy (w {}, load {}) got {} of {} picks; Envoy's share {:.4} allows {:.0}; light {:?}",
                heavy, heavy_load, heavy_picks, picks, envoy, bound, light);
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
