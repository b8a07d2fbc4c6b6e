//! Maglev consistent hashing (Eisenbud et al., NSDI 2016), weighted.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{Balancer, HashTable, Probe, View, pick_hashed};
use crate::context::PickContext;

/// Default lookup-table size: prime, as in the paper and Envoy.
pub const DEFAULT_TABLE_SIZE: usize = 65_537;
/// Largest lookup-table size (Envoy's limit; prime).
pub const MAX_TABLE_SIZE: usize = 5_000_011;
/// Entries per endpoint a table grows to (Envoy's guidance: at least 100,
/// for an ownership spread within about 1%).
pub const ENTRIES_PER_ENDPOINT: usize = 100;

/// The table size for `endpoints` endpoints with `floor` configured
/// (`balancer.table_size`, prime) and `cap` (`balancer.max_table_size`,
/// prime, at most [`MAX_TABLE_SIZE`]): `floor` while it holds
/// [`ENTRIES_PER_ENDPOINT`] per endpoint, else the smallest prime at or
/// above `floor x 2^k` for the smallest `k` that does, at most `cap` (with
/// the default cap, above 50,000 endpoints the table stays at the cap).
///
/// A pure function of `(floor, cap, endpoints)`, so every proxy with the
/// same endpoints builds the same table; the size changes (and every key
/// may move, as on any resize) only when the count crosses a class
/// boundary (the prime at or above `floor x 2^k`, over 100): 655, 1,311,
/// 2,621, ... endpoints for the default floor. Between boundaries a change moves keys as Maglev does.
pub fn table_size_for(floor: usize, cap: usize, endpoints: usize) -> usize {
    let want = endpoints.saturating_mul(ENTRIES_PER_ENDPOINT);
    let cap = cap.max(floor);
    if floor >= want || floor >= cap {
        return floor;
    }
    // The classes floor x 2^k in turn; the first whose prime reaches
    // `want` (the prime, not the class: a class just under `want` may
    // have its prime at or above it).
    let mut class = floor.max(1);
    loop {
        let m = next_prime(class.min(cap)).min(cap);
        if m >= want || class >= cap {
            return m;
        }
        class = class.saturating_mul(2);
    }
}

const OFFSET_SEED: u64 = 0x6d61_676c_6576_6f66; // "maglevof"
const SKIP_SEED: u64 = 0x6d61_676c_6576_736b; // "maglevsk"
const EMPTY: u32 = u32::MAX;

/// A Maglev lookup table of prime size M: `table[key % M]` is the endpoint.
///
/// Invariants: the table depends only on the set of (id, weight) pairs, not
/// their order (members are placed in id order); with equal weights each
/// endpoint owns `floor(M/N)` or `ceil(M/N)` entries; removing one endpoint
/// of N moves about 1/N of keys (a little more than a ring: the paper's
/// trade for an even spread and O(1) lookups).
#[derive(Debug)]
pub struct Maglev {
    table: Vec<u32>,
    members: Vec<u32>,
}

impl Maglev {
    /// Builds a table of `size` entries (must be prime and at least the
    /// number of members; checked by the caller's config validation).
    pub fn new<'a>(
        members: &[u32],
        id_of: impl Fn(u32) -> &'a str,
        weight_of: impl Fn(u32) -> u32,
        size: usize,
    ) -> Self {
        let m = size as u64;
        let mut order: Vec<(&str, u32)> = members.iter().map(|&i| (id_of(i), i)).collect();
        order.sort_unstable();
        // Per member: the next position of its permutation, its skip, its
        // weight and how many entries it owns. Positions advance by adding
        // `skip` modulo M, with no division in the loop.
        struct Cursor {
            position: u64,
            skip: u64,
            weight: u64,
            owned: u64,
        }
        let max_w = u64::from(
            members
                .iter()
                .map(|&i| weight_of(i).max(1))
                .max()
                .unwrap_or(1),
        );
        let mut cursors: Vec<Cursor> = order
            .iter()
            .map(|&(id, i)| Cursor {
                position: xxh3_64_with_seed(id.as_bytes(), OFFSET_SEED) % m,
                skip: xxh3_64_with_seed(id.as_bytes(), SKIP_SEED) % (m - 1) + 1,
                weight: u64::from(weight_of(i).max(1)),
                owned: 0,
            })
            .collect();
        let mut table = vec![EMPTY; size];
        let mut filled = 0usize;
        if !order.is_empty() {
            let mut round: u64 = 0;
            'fill: loop {
                round += 1;
                for (k, c) in cursors.iter_mut().enumerate() {
                    // Weighted turns: weight w fills on w of every max_w rounds.
                    if c.owned * max_w >= round * c.weight {
                        continue;
                    }
                    loop {
                        let slot = c.position as usize;
                        c.position += c.skip;
                        if c.position >= m {
                            c.position -= m;
                        }
                        if table[slot] == EMPTY {
                            table[slot] = order[k].1;
                            c.owned += 1;
                            filled += 1;
                            break;
                        }
                    }
                    if filled == size {
                        break 'fill;
                    }
                }
            }
        }
        Self {
            table,
            members: members.to_vec(),
        }
    }

    /// The lookup table (endpoint index per entry).
    pub fn table(&self) -> &[u32] {
        &self.table
    }

    /// Heap bytes held by the table and member list.
    pub fn heap_bytes(&self) -> usize {
        self.table.capacity() * 4 + self.members.capacity() * 4
    }
}

impl HashTable for Maglev {
    fn positions(&self) -> usize {
        if self.members.is_empty() {
            0
        } else {
            self.table.len()
        }
    }

    #[inline]
    fn home_position(&self, key: u64) -> usize {
        (key % self.table.len() as u64) as usize
    }

    #[inline]
    fn endpoint_at(&self, position: usize) -> u32 {
        self.table[position]
    }
}

impl Balancer for Maglev {
    fn pick(&self, view: &View<'_>, ctx: &PickContext<'_>) -> Option<u32> {
        pick_hashed(
            self,
            &self.members,
            view,
            ctx.key.unwrap_or(ctx.entropy),
            Probe::Random,
        )
    }
}

/// Trial-division primality test (table sizes are at most a few million).
pub fn is_prime(n: usize) -> bool {
    if n < 2 {
        return false;
    }
    if n.is_multiple_of(2) {
        return n == 2;
    }
    let mut d = 3;
    while d * d <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 2;
    }
    true
}

/// The smallest prime at or above `n`.
pub fn next_prime(mut n: usize) -> usize {
    while !is_prime(n) {
        n += 1;
    }
    n
}
