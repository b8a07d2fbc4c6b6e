//! Durations in config files as human-readable strings: `250ms`, `5s`, `1m`.
//! Use as `#[serde(with = "meshless_model::serde_duration")]`.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

/// The longest duration any config field accepts: 365 days. Longer ones
/// mean "never" in practice, and a deadline that far is where `Instant +
/// Duration` overflows (and panics) at run time; a field with a tighter
/// bound checks it on its own.
pub const MAX: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// Deserializes `"5s"`-style strings, at most [`MAX`] (the error is the
/// field's: the YAML reader names its path).
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    let d = humantime::parse_duration(&s).map_err(|e| {
        serde::de::Error::custom(format!(
            "invalid duration {s:?} ({e}); use e.g. 250ms, 5s, 1m"
        ))
    })?;
    if d > MAX {
        return Err(serde::de::Error::custom(format!(
            "must be at most 365d, got {s:?}"
        )));
    }
    Ok(d)
}

/// Serializes as a `"5s"`-style string.
pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_duration(*d).to_string())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[derive(Debug, serde::Deserialize)]
    struct T {
        #[serde(with = "super")]
        d: Duration,
    }

    #[test]
    fn durations_past_a_year_are_refused_with_the_field() {
        let ok: T = crate::yaml::from_str("d: 365d").expect("a year");
        assert_eq!(ok.d, super::MAX);
        for huge in ["366d", "18446744073709551615s", "1000000d"] {
            let e = crate::yaml::from_str::<T>(&format!("d: {huge}")).expect_err(huge);
            assert_eq!(e.path, "d", "{huge}: {e:?}");
            assert!(e.reason.contains("must be at most 365d"), "{huge}: {e:?}");
        }
    }
}
