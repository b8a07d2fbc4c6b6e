//! Which certificate a handshake gets: the table of certificates by SNI
//! name, and the rustls resolver over it that a reload swaps atomically
//! (handshakes under way keep the table they started with).

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

/// Certificates by SNI name. Invariant of [`CertTable::find`]: an exact
/// name wins; else a wildcard `*.base` covers a name of exactly one more
/// label than `base`; else the default. Names compare case-insensitively.
#[derive(Debug, Clone)]
pub struct CertTable {
    exact: HashMap<String, Arc<CertifiedKey>>,
    /// Keyed by `base` of `*.base`.
    wildcard: HashMap<String, Arc<CertifiedKey>>,
    default: Arc<CertifiedKey>,
}

impl CertTable {
    /// A table serving `default` to every name.
    pub fn new(default: Arc<CertifiedKey>) -> Self {
        Self {
            exact: HashMap::new(),
            wildcard: HashMap::new(),
            default,
        }
    }

    /// Serves `key` for `name` (`host` or `*.base`, lowercase).
    pub fn insert(&mut self, name: &str, key: Arc<CertifiedKey>) {
        match name.strip_prefix("*.") {
            Some(base) => self.wildcard.insert(base.to_owned(), key),
            None => self.exact.insert(name.to_owned(), key),
        };
    }

    /// The certificate for a client that sent `sni` (or none).
    pub fn find(&self, sni: Option<&str>) -> &Arc<CertifiedKey> {
        let Some(name) = sni else {
            return &self.default;
        };
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        if let Some(k) = self.exact.get(&name) {
            return k;
        }
        name.split_once('.')
            .and_then(|(_, base)| self.wildcard.get(base))
            .unwrap_or(&self.default)
    }
}

/// The resolver a listener's `ServerConfig` holds for its whole life; a
/// reload stores a new table into it.
#[derive(Debug)]
pub struct SniResolver(ArcSwap<CertTable>);

impl SniResolver {
    pub fn new(table: CertTable) -> Self {
        Self(ArcSwap::from_pointee(table))
    }

    /// New handshakes see `table` from now on.
    pub fn store(&self, table: CertTable) {
        self.0.store(Arc::new(table));
    }
}

impl ResolvesServerCert for SniResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(self.0.load().find(hello.server_name())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rustls::sign::SigningKey;

    #[derive(Debug)]
    struct NoKey;
    impl SigningKey for NoKey {
        fn choose_scheme(
            &self,
            _: &[rustls::SignatureScheme],
        ) -> Option<Box<dyn rustls::sign::Signer>> {
            None
        }
        fn algorithm(&self) -> rustls::SignatureAlgorithm {
            rustls::SignatureAlgorithm::ECDSA
        }
    }

    /// A distinct key per tag (the tag is the certificate's bytes).
    fn key(tag: u8) -> Arc<CertifiedKey> {
        Arc::new(CertifiedKey::new(vec![vec![tag].into()], Arc::new(NoKey)))
    }

    fn tag(k: &CertifiedKey) -> u8 {
        k.cert[0].as_ref()[0]
    }

    const LABELS: [&str; 3] = ["a", "b", "c"];

    fn name() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(&LABELS[..]), 1..4).prop_map(|l| l.join("."))
    }

    proptest! {
        /// The rule stated independently: exact entry; else the wildcard
        /// whose base is the name without its first label; else default.
        #[test]
        fn find_follows_exact_then_one_label_wildcard_then_default(
            exact in prop::collection::vec(name(), 0..5),
            wild in prop::collection::vec(name(), 0..5),
            asked in name(),
            upper in any::<bool>(),
        ) {
            let mut t = CertTable::new(key(0));
            let mut want_exact = None;
            let mut want_wild = None;
            for (i, n) in exact.iter().enumerate() {
                t.insert(n, key(1 + i as u8));
                if *n == asked { want_exact = Some(1 + i as u8); }
            }
            for (i, base) in wild.iter().enumerate() {
                t.insert(&format!("*.{base}"), key(100 + i as u8));
                let labels: Vec<&str> = asked.split('.').collect();
                if labels.len() == base.split('.').count() + 1 && labels[1..].join(".") == *base {
                    want_wild = Some(100 + i as u8);
                }
            }
            let want = want_exact.or(want_wild).unwrap_or(0);
            let sent = if upper { asked.to_ascii_uppercase() } else { asked.clone() };
            prop_assert_eq!(tag(t.find(Some(&sent))), want);
            prop_assert_eq!(tag(t.find(None)), 0);
        }
    }
}
