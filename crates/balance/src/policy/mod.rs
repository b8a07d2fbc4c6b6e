//! The load-balancing algorithms. Each is built once from an endpoint set
//! (or a subset of it, for locality tiers) and then picks many times without
//! locking or allocating.

mod bounded;
mod least_request;
mod maglev;
pub(crate) mod p2c;
mod random;
mod ring_hash;
mod round_robin;

use std::fmt;

pub use bounded::{BoundedLoad, Scope, load_factor_percent};
pub use least_request::LeastRequest;
pub use maglev::{
    BuildStats, DEFAULT_TABLE_SIZE, ENTRIES_PER_ENDPOINT, MAX_TABLE_SIZE, Maglev, is_prime,
    next_prime, table_size_for,
};
pub use p2c::{DEFAULT_CHOICES, PowerOfChoices};
pub use random::Random;
pub use ring_hash::{MAX_RING_SIZE, RingHash, auto_ring_size};
pub use round_robin::RoundRobin;

use crate::context::PickContext;
use crate::rng::SplitMix64;
use crate::set::EndpointSet;

/// Which endpoints a pick may return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// Only endpoints that are healthy and not ejected.
    Available,
    /// Every endpoint: panic mode, when none is available.
    Any,
}

/// An endpoint set seen through a filter: what a [`Balancer`] picks from.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    /// The snapshot being picked from.
    pub set: &'a EndpointSet,
    /// Which endpoints qualify.
    pub filter: Filter,
}

impl View<'_> {
    /// Whether endpoint `i` may be returned.
    #[inline]
    pub fn eligible(&self, i: u32) -> bool {
        match self.filter {
            Filter::Available => self.set.is_available(i as usize),
            Filter::Any => true,
        }
    }

    /// Requests in flight at endpoint `i`.
    #[inline]
    pub fn load(&self, i: u32) -> u32 {
        self.set.load(i as usize)
    }

    /// Weight of endpoint `i`.
    #[inline]
    pub fn weight(&self, i: u32) -> u32 {
        self.set.weight(i as usize)
    }
}

/// Chooses one endpoint of a set for one request.
///
/// Invariant for every implementation: the result is a member the algorithm
/// was built over and is eligible under `view.filter`; `None` only when no
/// member is eligible (or, for bounded load in a `prefer`, `zone` or
/// `proportional` tier, when every eligible member is at its bound).
pub trait Balancer: Send + Sync + fmt::Debug {
    /// The endpoint index (into `view.set`) for this request.
    fn pick(&self, view: &View<'_>, ctx: &PickContext<'_>) -> Option<u32>;

    /// Like [`Balancer::pick`], for a request about to start. Returns the
    /// endpoint and whether the pick already counted the request on it (an
    /// atomic reservation, as bounded load makes so that no racing pick can
    /// take the same last slot); if not, the caller starts it.
    fn pick_reserved(&self, view: &View<'_>, ctx: &PickContext<'_>) -> Option<(u32, bool)> {
        self.pick(view, ctx).map(|e| (e, false))
    }
}

/// Weighted random choice among the eligible `members`, by scanning: the
/// fallback of every algorithm whose fast path met ineligible endpoints.
pub(crate) fn pick_eligible_weighted(
    view: &View<'_>,
    members: &[u32],
    rng: &mut SplitMix64,
) -> Option<u32> {
    let total: u64 = members
        .iter()
        .filter(|&&m| view.eligible(m))
        .map(|&m| u64::from(view.weight(m)))
        .sum();
    if total == 0 {
        return None;
    }
    let mut x = rng.next_u64() % total;
    for &m in members {
        if view.eligible(m) {
            let w = u64::from(view.weight(m));
            if x < w {
                return Some(m);
            }
            x -= w;
        }
    }
    None
}

/// Compares `load / weight` of `a` and `b` exactly, in integers: `Less`
/// when `a` carries fewer requests per unit of weight.
///
/// This, not Envoy's `(load + 1) / weight`, is what weighted least request
/// and weighted P2C minimise: at equal loads it ties (and ties are broken in
/// proportion to weight), so at low concurrency traffic follows weight
/// instead of all going to the heaviest endpoint, and at high concurrency
/// loads settle in proportion to weight. (With `(load + 1) / weight`, an
/// endpoint of weight 4 beside ones of weight 1 takes every request until it
/// has 3 in flight.)
#[inline]
pub(crate) fn compare_load_per_weight(view: &View<'_>, a: u32, b: u32) -> std::cmp::Ordering {
    let la = u64::from(view.load(a));
    let lb = u64::from(view.load(b));
    (la * u64::from(view.weight(b).max(1))).cmp(&(lb * u64::from(view.weight(a).max(1))))
}

/// How [`least_loaded`] breaks ties.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ties {
    /// Uniformly over the tied candidates (candidates already drawn by weight).
    Uniform,
    /// In proportion to the tied candidates' weights.
    Weighted,
    /// To the first tied candidate (candidates in draw order, the first
    /// drawn in proportion to weight).
    First,
}

/// A consistent-hash table: positions that map to endpoints.
pub(crate) trait HashTable: fmt::Debug + Send + Sync {
    /// Number of positions.
    fn positions(&self) -> usize;
    /// The position a key hash lands on.
    fn home_position(&self, key: u64) -> usize;
    /// The endpoint owning a position.
    fn endpoint_at(&self, position: usize) -> u32;
}

/// Walk budget along a hash table before falling back to a scan.
const HASH_WALK_LIMIT: usize = 64;

/// How a consistent-hash pick looks past an ineligible home endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// The next position along the table (a ring: the next point clockwise,
    /// which is what a ring rebuilt without the endpoint would answer).
    Next,
    /// Pseudo-random positions derived from the key (Maglev: its entries of
    /// one endpoint form an arithmetic progression, so the entry after a
    /// down endpoint's run is not a weight-proportional draw; a random
    /// position is).
    Random,
}

/// Seeds the random probe sequence of a key.
const PROBE_SEED: u64 = 0x7072_6f62_6570_726f;

/// Plain consistent-hash pick: the home endpoint of `key`, or, when it is
/// not eligible, the first eligible one along the key's probe sequence, so a
/// down endpoint's keys spread over live ones in proportion to weight and no
/// other key moves; deterministic for a given key and state.
pub(crate) fn pick_hashed(
    table: &dyn HashTable,
    members: &[u32],
    view: &View<'_>,
    key: u64,
    probe: Probe,
) -> Option<u32> {
    let n = table.positions();
    if n == 0 {
        return None;
    }
    let mut pos = table.home_position(key);
    // Seeded on the first miss only: the healthy path stays one lookup.
    let mut rng: Option<SplitMix64> = None;
    for _ in 0..HASH_WALK_LIMIT.min(n) {
        let e = table.endpoint_at(pos);
        if view.eligible(e) {
            return Some(e);
        }
        pos = match probe {
            Probe::Next if pos + 1 == n => 0,
            Probe::Next => pos + 1,
            Probe::Random => rng
                .get_or_insert_with(|| SplitMix64::new(key ^ PROBE_SEED))
                .below(n),
        };
    }
    pick_eligible_weighted(view, members, &mut SplitMix64::new(key))
}

/// Greatest common divisor.
pub(crate) fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The eligible candidate with the lowest `load / weight`; ties broken at
/// random by reservoir sampling (uniform or weight-proportional), so no
/// position is favoured.
pub(crate) fn least_loaded(
    view: &View<'_>,
    candidates: impl IntoIterator<Item = u32>,
    ties: Ties,
    rng: &mut SplitMix64,
) -> Option<u32> {
    let mut best: Option<u32> = None;
    let mut tied = 0u64;
    for m in candidates {
        if !view.eligible(m) {
            continue;
        }
        let w = match ties {
            Ties::Uniform => 1,
            Ties::Weighted => u64::from(view.weight(m).max(1)),
            Ties::First => 0,
        };
        match best.map(|b| compare_load_per_weight(view, m, b)) {
            None | Some(std::cmp::Ordering::Less) => {
                best = Some(m);
                tied = w;
            }
            Some(std::cmp::Ordering::Equal) if ties == Ties::First => {}
            Some(std::cmp::Ordering::Equal) => {
                tied += w;
                if (rng.below(tied as usize) as u64) < w {
                    best = Some(m);
                }
            }
            Some(std::cmp::Ordering::Greater) => {}
        }
    }
    best
}
