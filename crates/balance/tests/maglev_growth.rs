//! The Maglev table grows with the endpoint count: at least 100 entries
//! per endpoint (Envoy's guidance) up to the cap, and a size that changes
//! only at class boundaries. Each endpoint's share of the table is within
//! the Maglev paper's bound for the table's size M: with equal weights the
//! population gives every endpoint `floor(M/N)` or `ceil(M/N)` entries, so
//! its share is within `1/M` of `1/N`.

#![allow(clippy::unwrap_used)]

use meshless_balance::policy::{
    DEFAULT_TABLE_SIZE, ENTRIES_PER_ENDPOINT, MAX_TABLE_SIZE, Maglev, is_prime, table_size_for,
};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Prime, at least the floor, 100 entries per endpoint below the cap
    /// (at the cap above it), under 2x what is needed (+ the prime gap),
    /// and the same for every count of one class.
    #[test]
    fn the_size_follows_the_rule(n in 0usize..80_000, floor_i in 0usize..3) {
        let floor = [1_021, 65_537, 1_000_003][floor_i];
        let m = table_size_for(floor, MAX_TABLE_SIZE, n);
        prop_assert!(is_prime(m), "{m} not prime");
        prop_assert!(m >= floor && m <= MAX_TABLE_SIZE.max(floor));
        let want = n * ENTRIES_PER_ENDPOINT;
        if want <= MAX_TABLE_SIZE {
            prop_assert!(m >= want, "{n} endpoints: {m} < {want}");
        } else {
            prop_assert_eq!(m, MAX_TABLE_SIZE);
        }
        if m > floor && m < MAX_TABLE_SIZE {
            // The smallest class floor x 2^k at or above `want`, then its prime.
            prop_assert!(m < 2 * want + 1_000, "{n}: {m} is more than a class above {want}");
        }
        // Monotone, and constant within a class: the count one below has
        // the same size unless it falls into the class below.
        if n > 0 {
            let below = table_size_for(floor, MAX_TABLE_SIZE, n - 1);
            prop_assert!(below <= m);
            if below != m {
                prop_assert!((n - 1) * ENTRIES_PER_ENDPOINT <= below && n * ENTRIES_PER_ENDPOINT > below);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// With equal weights, every endpoint owns floor(M/N) or ceil(M/N)
    /// entries of the grown table: its share is within 1/M of 1/N, so the
    /// largest share is within 1% (100 entries each) of the smallest.
    #[test]
    fn every_share_is_within_the_papers_bound(n in 600usize..2_500) {
        let m = table_size_for(DEFAULT_TABLE_SIZE, MAX_TABLE_SIZE, n);
        let ids: Vec<String> = (0..n).map(|i| format!("pod-{i}")).collect();
        let members: Vec<u32> = (0..n as u32).collect();
        let table = Maglev::new(&members, |i| ids[i as usize].as_str(), |_| 1, m);
        let mut owned = vec![0usize; n];
        for &e in table.table() {
            owned[e as usize] += 1;
        }
        let (lo, hi) = (m / n, m.div_ceil(n));
        prop_assert!(owned.iter().all(|&k| k == lo || k == hi), "not floor/ceil of {m}/{n}");
        let (min, max) = (*owned.iter().min().unwrap(), *owned.iter().max().unwrap());
        prop_assert!(min >= ENTRIES_PER_ENDPOINT);
        prop_assert!((max - min) as f64 / min as f64 <= 0.01 + f64::EPSILON);
    }
}

#[test]
fn sizes_at_known_counts_and_under_a_cap() {
    let size = |n| table_size_for(DEFAULT_TABLE_SIZE, MAX_TABLE_SIZE, n);
    assert_eq!(size(20_000), 2_097_211, "65,537 x 2^5, then the next prime");
    assert_eq!(size(655), DEFAULT_TABLE_SIZE);
    assert_eq!(size(656), 131_101);
    assert_eq!(size(60_000), MAX_TABLE_SIZE);
    // The class 524,296 (65,537 x 2^3) is under 5,243 x 100 = 524,300,
    // but its prime is not: that prime is the size, not the next class's.
    let m = size(5_243);
    assert!((524_300..600_000).contains(&m), "{m}");
    assert_eq!(size(5_242), m);
    // A cap stops the growth there.
    assert_eq!(table_size_for(DEFAULT_TABLE_SIZE, 262_151, 20_000), 262_151);
    assert_eq!(table_size_for(DEFAULT_TABLE_SIZE, 200_003, 20_000), 200_003);
}
