//! Balancing settings a service carries to every proxy with its endpoints
//! (from Kubernetes Service annotations or the registration API). Each is
//! optional: a proxy's own cluster config wins where it says something.
//!
//! Invariant: a [`ServiceSettings`] that passed [`ServiceSettings::validate`]
//! names a known policy, a finite `load_factor >= 1.0`, and a hash key whose
//! header name is a valid token; every parsed value prints back to the text
//! it was parsed from ([`HashKeySource`], [`LocalityChoice`]).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::FieldError;

/// The balancer policy names a setting may carry; the same list as
/// `meshless_balance::PolicyKind::ALL` (a test there keeps them equal).
pub const POLICY_NAMES: [&str; 7] = [
    "round_robin",
    "random",
    "least_request",
    "p2c",
    "ring_hash",
    "maglev",
    "bounded_load",
];

/// The annotation prefix of every setting, e.g. `meshless.io/policy`.
pub const ANNOTATION_PREFIX: &str = "meshless.io/";

/// Settings of one service; `None` = not set (the proxy's default or file).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceSettings {
    /// A balancer policy, one of [`POLICY_NAMES`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// Where the affinity key comes from (hash policies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash_key: Option<HashKeySource>,
    /// Bounded-load factor c, finite and >= 1.0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_factor: Option<f64>,
    /// Which endpoints a proxy prefers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locality: Option<LocalityChoice>,
    /// Hold requests while the service has no ready instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_to_zero: Option<bool>,
}

// `load_factor` is never NaN once validated, so equality is an equivalence.
impl Eq for ServiceSettings {}

impl ServiceSettings {
    /// Whether no setting is set.
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }

    /// Checks each set value; the error names the field.
    pub fn validate(&self) -> Result<(), FieldError> {
        if let Some(p) = &self.policy
            && !POLICY_NAMES.contains(&p.as_str())
        {
            return Err(FieldError::new(
                "policy",
                format!(
                    "unknown policy {p:?} (expected one of {})",
                    POLICY_NAMES.join(", ")
                ),
            ));
        }
        if let Some(c) = self.load_factor
            && !(c.is_finite() && c >= 1.0)
        {
            return Err(FieldError::new(
                "load_factor",
                format!("must be a number of at least 1.0, got {c}"),
            ));
        }
        Ok(())
    }

    /// The settings named by `meshless.io/*` annotations (other annotations
    /// are ignored). The first bad value fails the whole set, with the
    /// annotation's name as the path, so a caller can keep what it had.
    pub fn from_annotations(annotations: &BTreeMap<String, String>) -> Result<Self, FieldError> {
        let get = |name: &str| annotations.get(&format!("{ANNOTATION_PREFIX}{name}"));
        let at = |name: &str| format!("{ANNOTATION_PREFIX}{name}");
        let mut s = Self::default();
        if let Some(v) = get("policy") {
            // Kubernetes style (`ring-hash`) and config style (`ring_hash`).
            s.policy = Some(v.trim().replace('-', "_"));
        }
        if let Some(v) = get("hash-key") {
            s.hash_key = Some(
                v.parse()
                    .map_err(|e: ParseError| FieldError::new(at("hash-key"), e.0))?,
            );
        }
        if let Some(v) = get("load-factor") {
            let c: f64 = v
                .trim()
                .parse()
                .map_err(|_| FieldError::new(at("load-factor"), format!("not a number: {v:?}")))?;
            s.load_factor = Some(c);
        }
        if let Some(v) = get("locality") {
            s.locality = Some(
                v.parse()
                    .map_err(|e: ParseError| FieldError::new(at("locality"), e.0))?,
            );
        }
        if let Some(v) = get("scale-to-zero") {
            s.scale_to_zero = Some(match v.trim() {
                "true" => true,
                "false" => false,
                other => {
                    return Err(FieldError::new(
                        at("scale-to-zero"),
                        format!("expected true or false, got {other:?}"),
                    ));
                }
            });
        }
        s.validate().map_err(|e| {
            let name = match e.path.as_str() {
                "load_factor" => "load-factor",
                other => other,
            };
            FieldError::new(at(name), e.reason)
        })?;
        Ok(s)
    }
}

/// Why a setting's text could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError(pub String);

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The source of a request's affinity key: `header:NAME`, `cookie:NAME`,
/// `query:NAME`, `path` or `source-ip`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum HashKeySource {
    /// A request header (name lowercased).
    Header(String),
    Cookie(String),
    Query(String),
    Path,
    /// The client's address.
    SourceIp,
}

/// RFC 9110 token characters (header names).
fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

impl FromStr for HashKeySource {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, ParseError> {
        let s = s.trim();
        match s {
            "path" => return Ok(Self::Path),
            "source-ip" => return Ok(Self::SourceIp),
            _ => {}
        }
        let expected = || {
            ParseError(format!(
                "expected header:NAME, cookie:NAME, query:NAME, path or source-ip, got {s:?}"
            ))
        };
        let (kind, name) = s.split_once(':').ok_or_else(expected)?;
        if name.is_empty() {
            return Err(ParseError(format!("{kind}: needs a name")));
        }
        match kind {
            "header" if is_token(name) => Ok(Self::Header(name.to_ascii_lowercase())),
            "header" => Err(ParseError(format!("not a valid header name: {name:?}"))),
            "cookie" | "query" if name.bytes().any(|b| b.is_ascii_control() || b == b' ') => {
                Err(ParseError(format!(
                    "{kind} name has spaces or control characters: {name:?}"
                )))
            }
            "cookie" => Ok(Self::Cookie(name.to_owned())),
            "query" => Ok(Self::Query(name.to_owned())),
            _ => Err(expected()),
        }
    }
}

impl fmt::Display for HashKeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Header(n) => write!(f, "header:{n}"),
            Self::Cookie(n) => write!(f, "cookie:{n}"),
            Self::Query(n) => write!(f, "query:{n}"),
            Self::Path => f.write_str("path"),
            Self::SourceIp => f.write_str("source-ip"),
        }
    }
}

impl TryFrom<String> for HashKeySource {
    type Error = ParseError;
    fn try_from(s: String) -> Result<Self, ParseError> {
        s.parse()
    }
}

impl From<HashKeySource> for String {
    fn from(k: HashKeySource) -> String {
        k.to_string()
    }
}

/// Which endpoints a proxy prefers: `node` (its node, then its zone, then
/// anywhere), `zone` (its zone, then anywhere), `any` (no preference),
/// `local-only` (its node only, never elsewhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum LocalityChoice {
    Node,
    Zone,
    Any,
    LocalOnly,
}

impl FromStr for LocalityChoice {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, ParseError> {
        match s.trim() {
            "node" => Ok(Self::Node),
            "zone" => Ok(Self::Zone),
            "any" => Ok(Self::Any),
            "local-only" => Ok(Self::LocalOnly),
            other => Err(ParseError(format!(
                "expected node, zone, any or local-only, got {other:?}"
            ))),
        }
    }
}

impl fmt::Display for LocalityChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Node => "node",
            Self::Zone => "zone",
            Self::Any => "any",
            Self::LocalOnly => "local-only",
        })
    }
}

impl TryFrom<String> for LocalityChoice {
    type Error = ParseError;
    fn try_from(s: String) -> Result<Self, ParseError> {
        s.parse()
    }
}

impl From<LocalityChoice> for String {
    fn from(l: LocalityChoice) -> String {
        l.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (format!("{ANNOTATION_PREFIX}{k}"), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn every_annotation_is_read() {
        let s = ServiceSettings::from_annotations(&annotations(&[
            ("policy", "ring-hash"),
            ("hash-key", "header:X-User"),
            ("load-factor", "1.25"),
            ("locality", "local-only"),
            ("scale-to-zero", "true"),
        ]))
        .expect("valid");
        assert_eq!(s.policy.as_deref(), Some("ring_hash"));
        assert_eq!(s.hash_key, Some(HashKeySource::Header("x-user".into())));
        assert_eq!(s.load_factor, Some(1.25));
        assert_eq!(s.locality, Some(LocalityChoice::LocalOnly));
        assert_eq!(s.scale_to_zero, Some(true));
        let none = ServiceSettings::from_annotations(&BTreeMap::from([(
            "other.io/policy".to_owned(),
            "x".to_owned(),
        )]))
        .expect("ignored");
        assert!(none.is_empty());
    }

    #[test]
    fn a_bad_value_names_its_annotation() {
        for (name, value) in [
            ("policy", "fastest"),
            ("hash-key", "header:bad header"),
            ("hash-key", "cookie:"),
            ("hash-key", "body"),
            ("load-factor", "0.5"),
            ("load-factor", "NaN"),
            ("load-factor", "lots"),
            ("locality", "region"),
            ("scale-to-zero", "yes"),
        ] {
            let e = ServiceSettings::from_annotations(&annotations(&[
                ("policy", "maglev"),
                (name, value),
            ]))
            .expect_err(value);
            assert_eq!(e.path, format!("meshless.io/{name}"), "{value}: {e}");
        }
    }

    #[test]
    fn json_form_is_the_text_form() {
        let s = ServiceSettings {
            hash_key: Some(HashKeySource::Cookie("sid".into())),
            locality: Some(LocalityChoice::Zone),
            ..ServiceSettings::default()
        };
        let json = serde_json::to_string(&s).expect("json");
        assert_eq!(json, r#"{"hash_key":"cookie:sid","locality":"zone"}"#);
        assert_eq!(
            serde_json::from_str::<ServiceSettings>(&json).expect("back"),
            s
        );
        assert!(serde_json::from_str::<ServiceSettings>(r#"{"hash_key":"nope"}"#).is_err());
    }

    fn key_source() -> impl Strategy<Value = HashKeySource> {
        prop_oneof![
            "[a-z0-9-]{1,12}".prop_map(HashKeySource::Header),
            "[A-Za-z0-9_.]{1,12}".prop_map(HashKeySource::Cookie),
            "[A-Za-z0-9_.]{1,12}".prop_map(HashKeySource::Query),
            Just(HashKeySource::Path),
            Just(HashKeySource::SourceIp),
        ]
    }

    proptest! {
        /// Printing then parsing gives the same source back.
        #[test]
        fn hash_key_sources_round_trip(k in key_source()) {
            prop_assert_eq!(k.to_string().parse::<HashKeySource>(), Ok(k));
        }

        /// Whatever the text, parsing never panics, and what parses prints
        /// back to a text that parses to the same value.
        #[test]
        fn any_text_parses_or_is_refused(s in ".{0,24}") {
            if let Ok(k) = s.parse::<HashKeySource>() {
                prop_assert_eq!(k.to_string().parse::<HashKeySource>(), Ok(k));
            }
        }
    }
}
