//! Ketama-style consistent hashing on a ring, hashed with xxh3.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{Balancer, HashTable, Probe, View, pick_hashed};
use crate::context::PickContext;

/// Smallest automatic ring (Envoy's `minimum_ring_size` default).
pub const MIN_AUTO_RING: usize = 1024;
/// Largest configurable ring (Envoy's `maximum_ring_size` default).
pub const MAX_RING_SIZE: usize = 1 << 23;
/// Largest automatic ring.
pub const MAX_AUTO_RING: usize = 1 << 20;
/// Points per endpoint of weight 1 in an automatic ring (as Ketama).
pub const POINTS_PER_ENDPOINT: usize = 160;

/// A hash ring: each endpoint owns points in proportion to its weight (at
/// least one); a key belongs to the first point clockwise of its hash.
///
/// Invariants: the ring depends only on the set of (id, weight) pairs, not
/// their order; removing an endpoint moves only the keys it owned.
#[derive(Debug)]
pub struct RingHash {
    hashes: Vec<u64>,
    owners: Vec<u32>,
    members: Vec<u32>,
    /// `index[b]` = first ring position whose hash has top bits >= `b`
    /// (`bits` bits), so a lookup binary-searches one small bucket.
    index: Vec<u32>,
    /// Bits of the hash that select a bucket: about log2 of the ring size,
    /// at most `MAX_INDEX_BITS`, so the index costs at most ~4 bytes per
    /// ring point (a tier ring of 1,024 points has a 1,025-entry index, not
    /// 65,537).
    bits: u32,
}

/// Most bits of the hash that select a bucket of the lookup index.
const MAX_INDEX_BITS: u32 = 16;

/// The ring size used when none is configured: `160 x endpoints`, clamped
/// to `MIN_AUTO_RING..=MAX_AUTO_RING`.
pub fn auto_ring_size(endpoints: usize) -> usize {
    (POINTS_PER_ENDPOINT * endpoints).clamp(MIN_AUTO_RING, MAX_AUTO_RING)
}

impl RingHash {
    /// Builds a ring of about `size` points over `members`, given each
    /// member's identity and weight.
    pub fn new<'a>(
        members: &[u32],
        id_of: impl Fn(u32) -> &'a str,
        weight_of: impl Fn(u32) -> u32,
        size: usize,
    ) -> Self {
        let total: u64 = members
            .iter()
            .map(|&m| u64::from(weight_of(m).max(1)))
            .sum();
        let mut points: Vec<(u64, &str, u32)> = Vec::with_capacity(size + members.len());
        for &m in members {
            let id = id_of(m);
            let w = u64::from(weight_of(m).max(1));
            let count = ((size as u64 * w + total / 2) / total.max(1)).max(1);
            for j in 0..count {
                points.push((xxh3_64_with_seed(id.as_bytes(), j), id, m));
            }
        }
        points.sort_unstable_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        let hashes: Vec<u64> = points.iter().map(|p| p.0).collect();
        let bits = hashes
            .len()
            .next_power_of_two()
            .trailing_zeros()
            .clamp(1, MAX_INDEX_BITS);
        let mut index = Vec::with_capacity((1 << bits) + 1);
        let mut pos = 0usize;
        for bucket in 0..=(1u64 << bits) {
            while pos < hashes.len() && (hashes[pos] >> (64 - bits)) < bucket {
                pos += 1;
            }
            index.push(pos as u32);
        }
        Self {
            hashes,
            owners: points.iter().map(|p| p.2).collect(),
            members: members.to_vec(),
            index,
            bits,
        }
    }
}

impl RingHash {
    /// Heap bytes held by the ring (points, owners, index, members).
    pub fn heap_bytes(&self) -> usize {
        self.hashes.capacity() * 8
            + self.owners.capacity() * 4
            + self.index.capacity() * 4
            + self.members.capacity() * 4
    }
}

impl HashTable for RingHash {
    fn positions(&self) -> usize {
        self.hashes.len()
    }

    fn home_position(&self, key: u64) -> usize {
        let bucket = (key >> (64 - self.bits)) as usize;
        let (lo, hi) = (self.index[bucket] as usize, self.index[bucket + 1] as usize);
        let p = lo + self.hashes[lo..hi].partition_point(|&h| h < key);
        if p == self.hashes.len() { 0 } else { p }
    }

    fn endpoint_at(&self, position: usize) -> u32 {
        self.owners[position]
    }
}

impl Balancer for RingHash {
    fn pick(&self, view: &View<'_>, ctx: &PickContext<'_>) -> Option<u32> {
        pick_hashed(
            self,
            &self.members,
            view,
            ctx.key.unwrap_or(ctx.entropy),
            Probe::Next,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The bucket index finds the same position as a search of the whole ring.
        #[test]
        fn indexed_lookup_equals_full_search(n in 1usize..50, keys in prop::collection::vec(any::<u64>(), 100)) {
            let ids: Vec<String> = (0..n).map(|i| format!("ep-{i}")).collect();
            let members: Vec<u32> = (0..n as u32).collect();
            let ring = RingHash::new(&members, |m| ids[m as usize].as_str(), |_| 1, auto_ring_size(n));
            for k in keys.into_iter().chain([0, u64::MAX, ring.hashes[0], *ring.hashes.last().unwrap_or(&0)]) {
                let full = ring.hashes.partition_point(|&h| h < k);
                let full = if full == ring.hashes.len() { 0 } else { full };
                prop_assert_eq!(ring.home_position(k), full);
            }
        }
    }
}
