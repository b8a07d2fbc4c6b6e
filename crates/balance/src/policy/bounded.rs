//! Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam,
//! SODA 2018), with random jumps on overflow (arXiv 1908.08762).

use super::{Balancer, Filter, HashTable, Ties, View, least_loaded};
use crate::context::PickContext;
use crate::rng::SplitMix64;

/// Random jumps tried after the home endpoint is full, before a scan.
const JUMPS: usize = 16;
/// Mixed into the key to seed the jump sequence.
const JUMP_SEED: u64 = 0x6a75_6d70_6a75_6d70;
/// Scans of the members after the jumps: a reservation that lost a race
/// rescans once more.
const SCANS: usize = 3;

/// Affinity by key, with no endpoint above `c` times its fair share.
///
/// With `T` requests in flight on the available endpoints (requests still
/// running on ejected, unhealthy or removed endpoints are not counted), total
/// available weight `W` and the factor as an integer percent `p` (`c = p /
/// 100`, as Envoy's `hash_balance_factor` and HAProxy's
/// `hash-balance-factor`), endpoint `i` may take a request only while
/// `in_flight_i + 1 <= ceil(p * (T + 1) * w_i / (100 * W))`, computed in
/// integers (for equal weights: `ceil(c x mean)`, the mean counting the new
/// request). A key goes to its home endpoint on the underlying ring or
/// Maglev table when that fits; otherwise it jumps to pseudo-random table
/// positions derived from the key (so hot keys scatter instead of cascading
/// onto the home's neighbours, and one key still follows one path); after
/// `JUMPS` misses, the fitting endpoint with the fewest requests per unit of
/// weight is taken.
///
/// The bound is a hard promise under concurrency: [`Balancer::pick_reserved`]
/// checks the bound and raises the endpoint's count in one atomic
/// `fetch_update`, so racing picks of one hot key cannot all see "home fits"
/// (HAProxy checks and increments under its lock). The check uses `T` read
/// at the start of the pick; racing picks only raise the real total, so each
/// reservation also satisfies the bound of the total at the moment it is
/// made, except by the requests that *finished* during the pick (a
/// completion lowers `T` after it was read: the same as a completion right
/// after a single-threaded pick, which the bound never promised against).
///
/// What `T` and `W` cover, and whether the pick may fail, is the [`Scope`]:
/// the whole cluster (when no eligible endpoint fits, only possible when
/// completions race the pick, the least loaded eligible endpoint is taken
/// unreserved), a spilling locality tier (the cluster's `T` and `W`; `None`
/// when every member is at its bound, so the pick spills to the next tier),
/// or a `local_only` node tier (the tier's own `T` and `W`, never `None`
/// while a member is eligible). In panic mode (every endpoint eligible), `T`
/// and `W` cover every endpoint of the scope.
///
/// With `T` and `W` over the endpoints the pick may choose from and `c >= 1`,
/// some eligible endpoint always fits: if none did, summing
/// `load_i * 100 * W >= p * (T + 1) * w_i` over them gives `100 T >= p (T + 1)`.
#[derive(Debug)]
pub struct BoundedLoad {
    table: Box<dyn HashTable>,
    members: Vec<u32>,
    /// `c` as an integer percent (>= 100).
    percent: u64,
    scope: Scope,
}

/// Whose in-flight requests and weight a bounded-load pick divides, and
/// what it does when no member fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The whole cluster: its eligible `T` and `W`; never `None` while an
    /// endpoint is eligible.
    Cluster,
    /// A `prefer`, `zone` or `proportional` tier: the cluster's `T` and `W`
    /// (the tier holds the caller's share of a spread-out cluster); `None`
    /// when every eligible member is at its bound, and the pick spills.
    SpillingTier,
    /// A `local_only` node tier: the `T` and `W` of the tier's own eligible
    /// members (every request of the caller lands there, so the cluster's
    /// would refuse once the node holds `c` times its share); never `None`
    /// while a member is eligible. Costs one pass over the tier per pick.
    OwnTier,
}

/// The bound of one pick: `load + 1 <= ceil(percent * t1 * w / (100 * w_total))`.
#[derive(Debug, Clone, Copy)]
struct Bound {
    percent: u128,
    t1: u128,
    w_total: u128,
}

impl Bound {
    /// Whether an endpoint of weight `w` with `load` requests may take one more:
    /// `x <= ceil(a / b)` is `(x - 1) * b < a`, here with `x = load + 1`.
    #[inline]
    fn fits(self, load: u32, w: u32) -> bool {
        u128::from(load) * 100 * self.w_total < self.percent * self.t1 * u128::from(w)
    }
}

impl BoundedLoad {
    pub(crate) fn new(
        table: Box<dyn HashTable>,
        members: &[u32],
        load_factor: f64,
        scope: Scope,
    ) -> Self {
        Self {
            table,
            members: members.to_vec(),
            percent: load_factor_percent(load_factor),
            scope,
        }
    }

    /// `(T, W)` of this pick: requests in flight on, and total weight of,
    /// the endpoints the scope divides among.
    fn totals(&self, view: &View<'_>) -> (u64, u64) {
        match (self.scope, view.filter) {
            (Scope::OwnTier, _) => self
                .members
                .iter()
                .filter(|&&m| view.eligible(m))
                .fold((0, 0), |(t, w), &m| {
                    (t + u64::from(view.load(m)), w + u64::from(view.weight(m)))
                }),
            (_, Filter::Available) => (
                view.set.eligible_in_flight(),
                view.set.available_all().weight,
            ),
            (_, Filter::Any) => (view.set.total_in_flight(), view.set.total_weight),
        }
    }

    /// The pick; with `reserve`, the chosen endpoint's count is raised
    /// atomically with the bound check (returned flag `true`).
    fn choose(&self, view: &View<'_>, ctx: &PickContext<'_>, reserve: bool) -> Option<(u32, bool)> {
        let positions = self.table.positions();
        if positions == 0 {
            return None;
        }
        let (t, w_total) = self.totals(view);
        if w_total == 0 {
            return None;
        }
        let bound = Bound {
            percent: u128::from(self.percent),
            t1: u128::from(t) + 1,
            w_total: u128::from(w_total),
        };
        // Reservations need availability in the endpoint's word: only when
        // picking among available endpoints (not in panic mode).
        let reserve = reserve && view.filter == Filter::Available;
        let take = |e: u32| -> bool {
            if !view.eligible(e) {
                return false;
            }
            let w = view.weight(e);
            if reserve {
                view.set.states[e as usize].try_reserve(&view.set.shared, |l| bound.fits(l, w))
            } else {
                bound.fits(view.load(e), w)
            }
        };
        let key = ctx.key.unwrap_or(ctx.entropy);
        let home = self.table.endpoint_at(self.table.home_position(key));
        if take(home) {
            return Some((home, reserve));
        }
        let mut rng = SplitMix64::new(key ^ JUMP_SEED);
        for _ in 0..JUMPS {
            let e = self.table.endpoint_at(rng.below(positions));
            if take(e) {
                return Some((e, reserve));
            }
        }
        for _ in 0..SCANS {
            let fitting = self
                .members
                .iter()
                .copied()
                .filter(|&e| view.eligible(e) && bound.fits(view.load(e), view.weight(e)));
            let Some(best) = least_loaded(view, fitting, Ties::Weighted, &mut rng) else {
                break;
            };
            if take(best) {
                return Some((best, reserve));
            }
        }
        if self.scope == Scope::SpillingTier {
            return None;
        }
        least_loaded(view, self.members.iter().copied(), Ties::Weighted, &mut rng)
            .map(|e| (e, false))
    }
}

/// `c` as an integer percent, rounded: 1.25 -> 125 (at least 100).
pub fn load_factor_percent(load_factor: f64) -> u64 {
    let p = (load_factor * 100.0).round();
    if p.is_finite() && p >= 100.0 {
        p.min(u64::MAX as f64) as u64
    } else {
        100
    }
}

impl Balancer for BoundedLoad {
    fn pick(&self, view: &View<'_>, ctx: &PickContext<'_>) -> Option<u32> {
        self.choose(view, ctx, false).map(|(e, _)| e)
    }

    fn pick_reserved(&self, view: &View<'_>, ctx: &PickContext<'_>) -> Option<(u32, bool)> {
        self.choose(view, ctx, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_bound_is_exact() {
        // c = 1.1, T + 1 = 50, five equal endpoints: ceil(11.0) = 11, where
        // f64 arithmetic gave 12.
        let b = Bound {
            percent: 110,
            t1: 50,
            w_total: 5,
        };
        assert!(b.fits(10, 1), "load 10 -> 11 fits");
        assert!(!b.fits(11, 1), "load 11 -> 12 does not");
        assert_eq!(load_factor_percent(1.25), 125);
        assert_eq!(load_factor_percent(1.1), 110);
    }
}
