//! Smooth weighted round robin, as nginx does it.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Balancer, View, gcd, pick_eligible_weighted};
use crate::context::PickContext;
use crate::rng::{SplitMix64, below};

/// Longest precomputed schedule, in picks. Larger (gcd-reduced) total
/// weights use a low-discrepancy sequence over the weights instead.
pub const MAX_SCHEDULE: u64 = 1 << 16;
/// Random slots tried for a down endpoint's turn before a weighted scan.
const REDRAWS: usize = 8;
/// 2^64 / golden ratio: the Weyl step of the low-discrepancy sequence.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Smooth weighted round robin (nginx `ngx_http_upstream_get_peer`).
///
/// nginx's sequence is periodic with period W = sum of (gcd-reduced)
/// weights, so it is computed once at build time and replayed with one
/// atomic counter: no lock on the pick path. Each build starts the
/// sequence at a random slot (as Envoy does), so proxies rebuilt by the
/// same update do not all send their next request to the same endpoint.
///
/// Invariants, all endpoints up: over the schedule, endpoint `i` appears
/// exactly `w_i` times, and in every prefix of length `t` its count differs
/// from `t * w_i / W` by less than 2 (nginx's sequence stays within about 1).
///
/// Endpoints down: the turn of a down endpoint goes to a random slot of the
/// schedule whose endpoint is up, which is a draw in proportion to weight
/// among the live endpoints. So live endpoint `i` serves `w_i / W_live` of
/// requests (its own turns plus its weight's part of the down ones) instead
/// of the down endpoint's successor taking its whole share, as a walk to
/// the next slot would (5 equal endpoints, one down: 25% each, not 40% for
/// one of them). The redistributed part is random, not smooth.
///
/// When W exceeds `max(MAX_SCHEDULE, members)`, request `t` goes to the
/// endpoint owning point `frac(t * 0.618..) * W` of the cumulative weights
/// (a Weyl sequence, O(log N)): shares stay exact in proportion to weight,
/// however small a weight is next to the others (no scaling that rounds
/// weights 1 and 2 to the same slot count).
#[derive(Debug)]
pub struct RoundRobin {
    schedule: Vec<u32>,
    /// Cumulative weights, when the schedule would be too long (else empty).
    cumulative: Vec<u64>,
    members: Vec<u32>,
    next: AtomicU64,
}

impl RoundRobin {
    /// Builds the schedule over `members` (indices with their weights).
    pub fn new(members: &[u32], weight_of: impl Fn(u32) -> u32) -> Self {
        let weights: Vec<u64> = members
            .iter()
            .map(|&m| u64::from(weight_of(m).max(1)))
            .collect();
        let g = weights.iter().fold(0, |g, &w| gcd(g, w)).max(1);
        let total: u64 = weights.iter().map(|w| w / g).sum();
        let (schedule, cumulative) = if total > MAX_SCHEDULE.max(members.len() as u64) {
            let cumulative = weights
                .iter()
                .scan(0u64, |acc, &w| {
                    *acc += w;
                    Some(*acc)
                })
                .collect();
            (Vec::new(), cumulative)
        } else {
            let schedule = smooth_schedule(&weights)
                .into_iter()
                .map(|pos| members[pos as usize])
                .collect();
            (schedule, Vec::new())
        };
        Self {
            schedule,
            cumulative,
            members: members.to_vec(),
            next: AtomicU64::new(fastrand::u64(..)),
        }
    }

    /// The precomputed sequence of endpoint indices (empty when the total
    /// weight is too large for one and the Weyl sequence is used).
    pub fn schedule(&self) -> &[u32] {
        &self.schedule
    }

    /// The endpoint of turn `t`.
    #[inline]
    fn turn(&self, t: u64) -> u32 {
        if self.schedule.is_empty() {
            let total = self.cumulative.last().copied().unwrap_or(0);
            let point = below(t.wrapping_mul(GOLDEN), total as usize) as u64;
            let pos = self.cumulative.partition_point(|&c| c <= point);
            self.members[pos.min(self.members.len() - 1)]
        } else {
            self.schedule[(t % self.schedule.len() as u64) as usize]
        }
    }
}

impl Balancer for RoundRobin {
    fn pick(&self, view: &View<'_>, ctx: &PickContext<'_>) -> Option<u32> {
        if self.members.is_empty() {
            return None;
        }
        let e = self.turn(self.next.fetch_add(1, Ordering::Relaxed));
        if view.eligible(e) {
            return Some(e);
        }
        // A down endpoint's turn: a random turn, i.e. a weighted draw.
        let mut rng = SplitMix64::new(ctx.entropy);
        for _ in 0..REDRAWS {
            let e = self.turn(rng.next_u64());
            if view.eligible(e) {
                return Some(e);
            }
        }
        pick_eligible_weighted(view, &self.members, &mut rng)
    }
}

/// nginx's smooth weighted round robin sequence for `weights`, as positions.
///
/// nginx, per pick: every peer's `current += weight`; the peer with the
/// largest `current` (first in list order on ties) is chosen and its
/// `current -= total`. Peers of equal weight are chosen in list order among
/// themselves, so each weight class is simulated by one cursor: a step
/// costs O(number of distinct weights), not O(peers).
pub(crate) fn smooth_schedule(weights: &[u64]) -> Vec<u32> {
    let n = weights.len();
    if n == 0 {
        return Vec::new();
    }
    let g = weights.iter().fold(0, |g, &w| gcd(g, w)).max(1);
    let w: Vec<u64> = weights.iter().map(|&x| x / g).collect();
    let total: u64 = w.iter().sum();
    if w.iter().all(|&x| x == w[0]) {
        return (0..n as u32).collect();
    }
    // Weight classes: members of one weight, in list order, with a cursor.
    struct Class {
        weight: u64,
        members: Vec<u32>,
        cursor: usize,
        rounds: u64,
    }
    let mut classes: Vec<Class> = Vec::new();
    let mut by_weight = std::collections::BTreeMap::new();
    for (i, &x) in w.iter().enumerate() {
        let c = *by_weight.entry(x).or_insert_with(|| {
            classes.push(Class {
                weight: x,
                members: Vec::new(),
                cursor: 0,
                rounds: 0,
            });
            classes.len() - 1
        });
        classes[c].members.push(i as u32);
    }
    let mut schedule = Vec::with_capacity(total as usize);
    for t in 1..=total {
        // current(peer) after this step's increment = t*w - total*picks;
        // a class's candidate is its cursor member, picked `rounds` times.
        let mut best: Option<(i128, u32, usize)> = None;
        for (ci, c) in classes.iter().enumerate() {
            let cur =
                i128::from(t) * i128::from(c.weight) - i128::from(total) * i128::from(c.rounds);
            let pos = c.members[c.cursor];
            let better = match best {
                None => true,
                Some((bc, bpos, _)) => cur > bc || (cur == bc && pos < bpos),
            };
            if better {
                best = Some((cur, pos, ci));
            }
        }
        if let Some((_, pos, ci)) = best {
            schedule.push(pos);
            let c = &mut classes[ci];
            c.cursor += 1;
            if c.cursor == c.members.len() {
                c.cursor = 0;
                c.rounds += 1;
            }
        }
    }
    schedule
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// nginx's loop, literally, for comparison.
    fn nginx(weights: &[u64], picks: usize) -> Vec<u32> {
        let total: i64 = weights.iter().map(|&w| w as i64).sum();
        let mut current = vec![0i64; weights.len()];
        let mut out = Vec::new();
        for _ in 0..picks {
            let mut best: Option<usize> = None;
            for i in 0..weights.len() {
                current[i] += weights[i] as i64;
                if best.is_none_or(|b| current[i] > current[b]) {
                    best = Some(i);
                }
            }
            let b = best.expect("non-empty");
            current[b] -= total;
            out.push(b as u32);
        }
        out
    }

    #[test]
    fn matches_nginx_example() {
        // nginx's documented example: weights 5,1,1 -> a a b a c a a.
        assert_eq!(smooth_schedule(&[5, 1, 1]), [0, 0, 1, 0, 2, 0, 0]);
    }

    proptest! {
        #[test]
        fn equals_nginx_sequence(weights in prop::collection::vec(1u64..20, 1..12)) {
            let g = weights.iter().fold(0, |g, &w| gcd(g, w));
            let reduced: Vec<u64> = weights.iter().map(|w| w / g).collect();
            let ours = smooth_schedule(&weights);
            let total: u64 = reduced.iter().sum();
            prop_assert_eq!(ours.len() as u64, total);
            prop_assert_eq!(ours, nginx(&reduced, total as usize));
        }

        #[test]
        fn every_prefix_is_smooth(weights in prop::collection::vec(1u64..50, 1..20)) {
            let s = smooth_schedule(&weights);
            let g = weights.iter().fold(0, |g, &w| gcd(g, w));
            let w: Vec<u64> = weights.iter().map(|x| x / g).collect();
            let total: u64 = w.iter().sum();
            let mut counts = vec![0u64; w.len()];
            for (t, &p) in s.iter().enumerate() {
                counts[p as usize] += 1;
                for i in 0..w.len() {
                    // |count*W - t*w| < 2W  <=>  |count - t*w/W| < 2
                    let lhs = (counts[i] * total) as i128;
                    let rhs = ((t as u64 + 1) * w[i]) as i128;
                    prop_assert!((lhs - rhs).abs() < 2 * total as i128);
                }
            }
        }
    }

    #[test]
    fn large_total_weight_keeps_small_weights_apart() {
        // Total weight far above MAX_SCHEDULE: weights 1 and 2 must still
        // get shares in the ratio 1:2 (the old scaling gave both one slot).
        let mut weights: Vec<u32> = vec![10_000; 20];
        weights.extend([1, 2]);
        let members: Vec<u32> = (0..weights.len() as u32).collect();
        let rr = RoundRobin::new(&members, |m| weights[m as usize]);
        assert!(rr.schedule().is_empty(), "uses the Weyl sequence");
        let total: u64 = weights.iter().map(|&w| u64::from(w)).sum();
        let picks = 20 * total;
        let mut counts = vec![0u64; weights.len()];
        for t in 0..picks {
            counts[rr.turn(t) as usize] += 1;
        }
        for (i, &w) in weights.iter().enumerate() {
            let want = picks * u64::from(w) / total;
            // A Weyl sequence's discrepancy is O(log picks): a few picks.
            assert!(
                counts[i].abs_diff(want) <= 64,
                "endpoint {i}: {} vs {want}",
                counts[i]
            );
        }
    }
}
