//! Durations in config files as human-readable strings: `250ms`, `5s`, `1m`.
//! Use as `#[serde(with = "meshless_model::serde_duration")]`.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

/// Deserializes `"5s"`-style strings.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    humantime::parse_duration(&s).map_err(|e| {
        serde::de::Error::custom(format!(
            "invalid duration {s:?} ({e}); use e.g. 250ms, 5s, 1m"
        ))
    })
}

/// Serializes as a `"5s"`-style string.
pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_duration(*d).to_string())
}
