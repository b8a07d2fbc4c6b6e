//! What a pick knows about the request it is made for.

/// The request-side input of a pick.
///
/// `entropy` seeds every random choice the pick makes, so the same context
/// always yields the same pick on the same state; [`PickContext::new`] draws
/// it from a thread-local generator (no lock).
#[derive(Debug, Clone, Copy)]
pub struct PickContext<'a> {
    /// 64-bit hash of the affinity key (header, cookie, path, client address),
    /// used by ring hash, Maglev and bounded load. Hash policies pick at
    /// random when it is absent.
    pub key: Option<u64>,
    /// The caller's node, for locality.
    pub node: Option<&'a str>,
    /// The caller's zone, for locality.
    pub zone: Option<&'a str>,
    /// Seed of this pick's random choices.
    pub entropy: u64,
}

impl Default for PickContext<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'a> PickContext<'a> {
    /// No key, no locality, fresh entropy.
    pub fn new() -> Self {
        Self {
            key: None,
            node: None,
            zone: None,
            entropy: fastrand::u64(..),
        }
    }

    /// Sets the affinity key hash.
    pub fn with_key(mut self, key: u64) -> Self {
        self.key = Some(key);
        self
    }

    /// Sets the caller's node and zone.
    pub fn with_locality(mut self, node: Option<&'a str>, zone: Option<&'a str>) -> Self {
        self.node = node;
        self.zone = zone;
        self
    }

    /// Sets the entropy (for reproducible picks in tests and simulations).
    pub fn with_entropy(mut self, entropy: u64) -> Self {
        self.entropy = entropy;
        self
    }
}

/// Hashes arbitrary key bytes the way every meshless process does (xxh3,
/// seed 0), so the same key maps to the same endpoint in every proxy.
pub fn hash_key(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}
