//! Small, allocation-free randomness for the pick path.

/// SplitMix64: a 64-bit generator that passes BigCrush, seeded per pick from
/// [`crate::PickContext::entropy`] so that a pick is reproducible from its
/// context and needs no shared (locked) generator.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    /// Seeds are mixed first, so seeds in arithmetic progression (k x the
    /// generator's own increment) do not yield shifted copies of one stream.
    pub(crate) fn new(seed: u64) -> Self {
        Self(mix(seed))
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in `0..n` (Lemire's multiply-shift; bias < n / 2^64). `n > 0`.
    pub(crate) fn below(&mut self, n: usize) -> usize {
        below(self.next_u64(), n)
    }
}

/// Maps a uniform 64-bit value to `0..n` without division. `n > 0`.
pub(crate) fn below(x: u64, n: usize) -> usize {
    ((u128::from(x) * n as u128) >> 64) as usize
}

/// The SplitMix64 finalizer: a bijective 64-bit mix.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
