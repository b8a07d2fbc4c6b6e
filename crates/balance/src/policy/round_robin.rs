//! Smooth weighted round robin, as nginx does it.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Balancer, View, gcd, pick_eligible_weighted};
use crate::context::PickContext;
use crate::rng::SplitMix64;

/// Longest precomputed schedule, in picks. Larger total weights are scaled
/// down to it (each endpoint keeps at least one slot).
pub const MAX_SCHEDULE: u64 = 1 << 16;

/// Smooth weighted round robin (nginx `ngx_http_upstream_get_peer`).
///
/// nginx's sequence is periodic with period W = sum of (gcd-reduced)
/// weights, so it is computed once at build time and replayed with one
/// atomic counter: no lock on the pick path. Invariant: over the schedule,
/// endpoint `i` appears exactly `w_i` times, and in every prefix of length
/// `t` its count differs from `t * w_i / W` by less than 2 (nginx's
/// sequence stays within about 1; the worst seen is 1.07). When W exceeds
/// `max(MAX_SCHEDULE, members)`, weights are first scaled to fit, so shares
/// are then exact to within one slot.
#[derive(Debug)]
pub struct RoundRobin {
    schedule: Vec<u32>,
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
        let schedule = smooth_schedule(&weights)
            .into_iter()
            .map(|pos| members[pos as usize])
            .collect();
        Self {
            schedule,
            members: members.to_vec(),
            next: AtomicU64::new(0),
        }
    }

    /// The precomputed sequence of endpoint indices.
    pub fn schedule(&self) -> &[u32] {
        &self.schedule
    }
}

impl Balancer for RoundRobin {
    fn pick(&self, view: &View<'_>, ctx: &PickContext<'_>) -> Option<u32> {
        let len = self.schedule.len();
        if len == 0 {
            return None;
        }
        let start = (self.next.fetch_add(1, Ordering::Relaxed) % len as u64) as usize;
        // Skip ineligible slots; after a bounded walk, fall back to a scan.
        let walk = len.min(2 * self.members.len());
        for off in 0..walk {
            let mut slot = start + off;
            if slot >= len {
                slot -= len;
            }
            let e = self.schedule[slot];
            if view.eligible(e) {
                return Some(e);
            }
        }
        pick_eligible_weighted(view, &self.members, &mut SplitMix64::new(ctx.entropy))
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
    let mut w: Vec<u64> = weights.iter().map(|&x| x / g).collect();
    let mut total: u64 = w.iter().sum();
    let cap = MAX_SCHEDULE.max(n as u64);
    if total > cap {
        for x in &mut w {
            *x = (*x * cap / total).max(1);
        }
        let g = w.iter().fold(0, |g, &x| gcd(g, x)).max(1);
        w.iter_mut().for_each(|x| *x /= g);
        total = w.iter().sum();
    }
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
    fn large_total_weight_is_scaled() {
        let weights: Vec<u64> = (0..1000).map(|i| 1 + (i % 97) * 100).collect();
        let s = smooth_schedule(&weights);
        assert!(s.len() as u64 <= MAX_SCHEDULE + 1000);
        let mut seen = vec![false; weights.len()];
        s.iter().for_each(|&p| seen[p as usize] = true);
        assert!(seen.iter().all(|&x| x), "every endpoint keeps a slot");
    }
}
