//! The two encodings of a delta on the stream. Every delta is encoded once
//! per encoding, and each encoding's bytes are shared by every subscriber
//! that reads it.
//!
//! - **Full**: the `Delta` as built (every field), for proxies that did not
//!   say `Hello.compact`.
//! - **Compact**: the same delta without what no proxy reads or what has a
//!   default: each endpoint's addresses packed as 4 or 16 bytes
//!   (`packed_addresses`) instead of text, a weight of 1 omitted (0 reads
//!   as 1), the slice name omitted.
//!
//! Invariant: [`decode_delta`] of the compact bytes equals the full delta
//! with its slice names cleared and its weights of 1 read as 0 (checked by
//! the property test below), so a proxy applies both the same way.

use std::net::IpAddr;

use bytes::Bytes;
use prost::Message;

use crate::{WireError, v1};

/// Which encoding a stream reads (`Hello.compact`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Full,
    Compact,
}

impl Encoding {
    /// The encoding a subscriber asked for in its `Hello`.
    pub fn of(hello: &v1::Hello) -> Self {
        if hello.compact {
            Self::Compact
        } else {
            Self::Full
        }
    }
}

/// A delta encoded both ways; cloning shares the bytes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EncodedPair {
    pub full: Bytes,
    pub compact: Bytes,
}

impl EncodedPair {
    /// `delta` encoded once per encoding.
    pub fn encode(delta: &v1::Delta) -> Self {
        Self {
            full: Bytes::from(delta.encode_to_vec()),
            compact: encode_compact(delta),
        }
    }

    /// The bytes of `encoding`.
    pub fn get(&self, encoding: Encoding) -> &Bytes {
        match encoding {
            Encoding::Full => &self.full,
            Encoding::Compact => &self.compact,
        }
    }
}

/// `delta` in the compact encoding.
pub fn encode_compact(delta: &v1::Delta) -> Bytes {
    let mut d = delta.clone();
    for e in &mut d.upserted {
        compact_endpoint(e);
    }
    Bytes::from(d.encode_to_vec())
}

/// Packs the addresses (when all are IP addresses, as the control plane
/// sends, and packed they are shorter than as text: `::1` is not), omits a
/// weight of 1 and the slice. Never longer than the full encoding.
fn compact_endpoint(e: &mut v1::Endpoint) {
    e.slice.clear();
    if e.weight == 1 {
        e.weight = 0;
    }
    let packed: Option<Vec<Vec<u8>>> = e
        .addresses
        .iter()
        .map(|a| {
            a.parse::<IpAddr>().ok().map(|ip| match ip {
                IpAddr::V4(v4) => v4.octets().to_vec(),
                IpAddr::V6(v6) => v6.octets().to_vec(),
            })
        })
        .collect();
    // Judged by the encoded endpoint, not by the addresses' own bytes:
    // each element also costs its field's tag and length, and the packed
    // field's tag may be longer than the text field's.
    if let Some(packed) = packed {
        let as_text = e.encoded_len();
        let text = std::mem::take(&mut e.addresses);
        e.packed_addresses = packed;
        if e.encoded_len() >= as_text {
            e.packed_addresses.clear();
            e.addresses = text;
        }
    }
}

/// Decodes a delta of either encoding: packed addresses are turned back
/// into text (after any text ones), so readers see only `addresses`.
pub fn decode_delta(bytes: &[u8]) -> Result<v1::Delta, WireError> {
    let mut d = v1::Delta::decode(bytes)?;
    for e in &mut d.upserted {
        for packed in std::mem::take(&mut e.packed_addresses) {
            let ip = match packed.len() {
                4 => <[u8; 4]>::try_from(packed.as_slice()).map(IpAddr::from),
                16 => <[u8; 16]>::try_from(packed.as_slice()).map(IpAddr::from),
                _ => {
                    return Err(WireError::Address {
                        id: e.id.clone(),
                        address: format!("{packed:02x?}"),
                        reason: format!("{} packed bytes, not 4 or 16", packed.len()),
                    });
                }
            };
            if let Ok(ip) = ip {
                e.addresses.push(ip.to_string());
            }
        }
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    fn endpoint() -> impl Strategy<Value = v1::Endpoint> {
        let address = prop_oneof![
            any::<[u8; 4]>().prop_map(|o| IpAddr::from(o).to_string()),
            any::<[u8; 16]>().prop_map(|o| IpAddr::from(o).to_string()),
            // Short IPv6 text (`::1`, `::ab`) is shorter than its 16 bytes.
            any::<u16>().prop_map(|x| IpAddr::from([0, 0, 0, 0, 0, 0, 0, x]).to_string()),
        ];
        (
            "[a-z0-9-]{1,20}",
            proptest::collection::vec(address, 0..3),
            (0u32..70_000, 0u32..4),
            ("[a-z0-9-]{0,12}", "[a-z0-9.-]{0,30}", "[a-z0-9-]{0,12}"),
            any::<(bool, bool, bool)>(),
        )
            .prop_map(
                |(
                    id,
                    addresses,
                    (port, weight),
                    (zone, node, slice),
                    (ready, serving, terminating),
                )| {
                    v1::Endpoint {
                        id,
                        addresses,
                        port,
                        weight,
                        zone,
                        node,
                        ready,
                        serving,
                        terminating,
                        slice,
                        packed_addresses: Vec::new(),
                        starting: false,
                    }
                },
            )
    }

    proptest! {
        /// Compact bytes decode to the full delta, less the slice names
        /// and with a weight of 1 as 0; and are never larger.
        #[test]
        fn compact_decodes_to_the_full_delta(
            upserted in proptest::collection::vec(endpoint(), 0..8),
            removed in proptest::collection::vec("[a-z0-9-]{1,20}", 0..4),
            version in any::<u64>(),
            reset in any::<bool>(),
        ) {
            let delta = v1::Delta {
                version,
                service: "ns/svc".into(),
                upserted,
                removed,
                reset,
                ..v1::Delta::default()
            };
            let pair = EncodedPair::encode(&delta);
            let full = decode_delta(&pair.full).unwrap();
            prop_assert_eq!(&full, &delta);
            let mut expected = delta.clone();
            for e in &mut expected.upserted {
                e.slice.clear();
                if e.weight == 1 {
                    e.weight = 0;
                }
            }
            prop_assert_eq!(decode_delta(&pair.compact).unwrap(), expected);
            prop_assert!(pair.compact.len() <= pair.full.len());
        }
    }

    /// What a proxy holds after applying deltas (its rule: a reset
    /// clears; upserts, then removals), as model endpoints.
    fn apply(
        view: &mut std::collections::BTreeMap<String, meshless_model::Endpoint>,
        bytes: &[u8],
    ) {
        let d = decode_delta(bytes).unwrap();
        if d.reset {
            view.clear();
        }
        for w in &d.upserted {
            if let Ok(e) = crate::endpoint_from_wire(w) {
                view.insert(w.id.clone(), e);
            }
        }
        for id in &d.removed {
            view.remove(id);
        }
    }

    fn change() -> impl Strategy<Value = v1::Delta> {
        (
            proptest::collection::vec(endpoint(), 0..4),
            proptest::collection::vec("[a-e]", 0..3),
            proptest::bool::weighted(0.1),
        )
            .prop_map(|(mut upserted, removed, reset)| {
                // Few ids, so changes hit endpoints already held.
                for e in &mut upserted {
                    e.id.truncate(1);
                }
                v1::Delta {
                    service: "ns/svc".into(),
                    upserted,
                    removed,
                    reset,
                    ..v1::Delta::default()
                }
            })
    }

    proptest! {
        /// After any sequence of changes, a proxy reading the compact
        /// encoding holds the same endpoints as one reading the full one.
        #[test]
        fn a_view_fed_compact_deltas_equals_one_fed_full_deltas(
            changes in proptest::collection::vec(change(), 1..30),
        ) {
            let (mut full, mut compact) = (Default::default(), Default::default());
            for (i, mut d) in changes.into_iter().enumerate() {
                d.version = i as u64 + 1;
                let pair = EncodedPair::encode(&d);
                apply(&mut full, &pair.full);
                apply(&mut compact, &pair.compact);
                prop_assert_eq!(&compact, &full);
            }
        }
    }

    #[test]
    fn a_packed_address_of_another_length_is_refused() {
        let d = v1::Delta {
            upserted: vec![v1::Endpoint {
                id: "e".into(),
                packed_addresses: vec![vec![10, 0, 0]],
                ..v1::Endpoint::default()
            }],
            ..v1::Delta::default()
        };
        let err = decode_delta(&d.encode_to_vec()).unwrap_err();
        assert!(err.to_string().contains("3 packed bytes"), "{err}");
    }

    /// `::1` is 3 bytes as text and 16 packed: it stays text, and the
    /// compact encoding is never longer than the full one.
    #[test]
    fn an_address_shorter_as_text_stays_text() {
        let d = v1::Delta {
            upserted: vec![v1::Endpoint {
                id: "e".into(),
                addresses: vec!["::1".into()],
                weight: 2,
                ..v1::Endpoint::default()
            }],
            ..v1::Delta::default()
        };
        let pair = EncodedPair::encode(&d);
        assert!(pair.compact.len() <= pair.full.len());
        assert_eq!(decode_delta(&pair.compact).unwrap(), d);
    }

    /// Two addresses one byte shorter packed than as text, but longer
    /// encoded: the packed field's tag (field 30) takes two bytes per
    /// element, the text field's one. Found by the property test in CI.
    #[test]
    fn addresses_are_packed_only_when_the_encoding_is_shorter() {
        let d = v1::Delta {
            upserted: vec![v1::Endpoint {
                id: "-".into(),
                addresses: vec!["100.100.100.100".into(), "::1000".into()],
                ..v1::Endpoint::default()
            }],
            ..v1::Delta::default()
        };
        let pair = EncodedPair::encode(&d);
        assert!(pair.compact.len() <= pair.full.len());
        assert_eq!(decode_delta(&pair.compact).unwrap(), d);
    }

    #[test]
    fn text_that_is_not_an_address_stays_text() {
        let mut e = v1::Endpoint {
            id: "e".into(),
            addresses: vec!["10.0.0.1".into(), "not-an-ip".into()],
            weight: 1,
            ..v1::Endpoint::default()
        };
        compact_endpoint(&mut e);
        assert_eq!(e.addresses, ["10.0.0.1", "not-an-ip"]);
        assert!(e.packed_addresses.is_empty());
        assert_eq!(e.weight, 0);
    }
}
