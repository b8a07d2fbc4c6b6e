//! Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam,
//! SODA 2018), with random jumps on overflow (arXiv 1908.08762).

use super::{Balancer, Filter, HashTable, View, least_loaded};
use crate::context::PickContext;
use crate::rng::SplitMix64;

/// Random jumps tried after the home endpoint is full, before a scan.
const JUMPS: usize = 16;
/// Mixed into the key to seed the jump sequence.
const JUMP_SEED: u64 = 0x6a75_6d70_6a75_6d70;

/// Affinity by key, with no endpoint above `c` times its fair share.
///
/// With `T` requests in flight across the cluster and total eligible weight
/// `W`, endpoint `i` may take a request only while
/// `in_flight_i + 1 <= ceil(c * (T + 1) * w_i / W)` (for equal weights:
/// `ceil(c x mean)`, the mean counting the new request). A key goes to its
/// home endpoint on the underlying ring or Maglev table when that fits;
/// otherwise it jumps to pseudo-random table positions derived from the key
/// (so hot keys scatter instead of cascading onto the home's neighbours, and
/// one key still follows one path); after `JUMPS` misses, the eligible
/// endpoint with the lowest relative load is taken, which always fits.
///
/// Invariants: no pick exceeds the bound (unless `strict` is false and
/// concurrent picks raced past it); when the home endpoint fits, the key
/// stays home. With `strict` (inside a locality tier, whose members may all
/// be full) the pick returns `None` instead of exceeding the bound.
#[derive(Debug)]
pub struct BoundedLoad {
    table: Box<dyn HashTable>,
    members: Vec<u32>,
    load_factor: f64,
    strict: bool,
}

impl BoundedLoad {
    pub(crate) fn new(
        table: Box<dyn HashTable>,
        members: &[u32],
        load_factor: f64,
        strict: bool,
    ) -> Self {
        Self {
            table,
            members: members.to_vec(),
            load_factor,
            strict,
        }
    }
}

impl Balancer for BoundedLoad {
    fn pick(&self, view: &View<'_>, ctx: &PickContext<'_>) -> Option<u32> {
        let positions = self.table.positions();
        if positions == 0 {
            return None;
        }
        let total_weight = match view.filter {
            Filter::Available => view.set.available_all().weight,
            Filter::Any => view.set.total_weight,
        };
        if total_weight == 0 {
            return None;
        }
        // Per unit of weight, the allowed load, times total_weight.
        let scaled = self.load_factor * (view.set.total_in_flight() + 1) as f64;
        let fits = |e: u32| {
            let bound = (scaled * f64::from(view.weight(e)) / total_weight as f64).ceil();
            view.eligible(e) && f64::from(view.load(e)) + 1.0 <= bound
        };
        let key = ctx.key.unwrap_or(ctx.entropy);
        let home = self.table.endpoint_at(self.table.home_position(key));
        if fits(home) {
            return Some(home);
        }
        let mut rng = SplitMix64::new(key ^ JUMP_SEED);
        for _ in 0..JUMPS {
            let e = self.table.endpoint_at(rng.below(positions));
            if fits(e) {
                return Some(e);
            }
        }
        let best = least_loaded(view, self.members.iter().copied(), &mut rng)?;
        if self.strict && !fits(best) {
            None
        } else {
            Some(best)
        }
    }
}
