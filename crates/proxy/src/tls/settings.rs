//! `listeners[].tls`: TLS termination settings of one listener (Envoy's
//! `DownstreamTlsContext`, HAProxy's `bind ... ssl crt`). Validated here
//! as data; the files are read and checked by [`super::certs`].

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use meshless_model::FieldError;
use meshless_model::serde_duration as duration;
use serde::{Deserialize, Serialize};

/// TLS on one listener.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    /// Served when the client sends no SNI name, or one no entry of
    /// `certificates` covers.
    pub default_certificate: CertificateFiles,
    /// Certificates chosen by the client's SNI name.
    #[serde(default)]
    pub certificates: Vec<SniCertificate>,
    /// ALPN protocols offered, in order of preference.
    #[serde(default = "default_alpn")]
    pub alpn: Vec<Alpn>,
    /// The oldest TLS version accepted: `"1.2"` or `"1.3"`.
    #[serde(default)]
    pub min_version: TlsVersion,
    /// How long a client has to finish its handshake after the accept.
    #[serde(default = "default_handshake_timeout", with = "duration")]
    pub handshake_timeout: Duration,
    /// Session resumption.
    #[serde(default)]
    pub session_resumption: SessionResumption,
}

/// A PEM certificate chain (leaf first) and its PEM private key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertificateFiles {
    pub certificate: PathBuf,
    pub key: PathBuf,
}

/// A certificate served for some SNI names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SniCertificate {
    /// Exact names (`api.example.com`) or one-label wildcards
    /// (`*.example.com`, which covers `a.example.com`, not `example.com`
    /// nor `a.b.example.com`). An exact name wins over a wildcard.
    pub server_names: Vec<String>,
    pub certificate: PathBuf,
    pub key: PathBuf,
}

impl SniCertificate {
    /// Its files.
    pub fn files(&self) -> CertificateFiles {
        CertificateFiles {
            certificate: self.certificate.clone(),
            key: self.key.clone(),
        }
    }
}

/// An ALPN protocol the listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Alpn {
    #[serde(rename = "h2")]
    H2,
    #[serde(rename = "http/1.1")]
    Http11,
}

impl Alpn {
    /// Its identifier on the wire.
    pub fn id(self) -> &'static [u8] {
        match self {
            Self::H2 => b"h2",
            Self::Http11 => b"http/1.1",
        }
    }
}

fn default_alpn() -> Vec<Alpn> {
    vec![Alpn::H2, Alpn::Http11]
}

fn default_handshake_timeout() -> Duration {
    Duration::from_secs(10)
}

/// The oldest TLS version accepted (never below 1.2).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum TlsVersion {
    #[default]
    #[serde(rename = "1.2")]
    Tls12,
    #[serde(rename = "1.3")]
    Tls13,
}

/// Session resumption: stateless tickets and a server-side cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionResumption {
    /// Issue session tickets (keys rotated every 6 hours, kept across reloads).
    #[serde(default = "default_tickets")]
    pub tickets: bool,
    /// Sessions kept in the server-side cache; 0 turns it off.
    #[serde(default = "default_cache_size")]
    pub cache_size: usize,
}

impl Default for SessionResumption {
    fn default() -> Self {
        Self {
            tickets: default_tickets(),
            cache_size: default_cache_size(),
        }
    }
}

fn default_tickets() -> bool {
    true
}

fn default_cache_size() -> usize {
    4096
}

/// Whether `name` is a DNS name an SNI entry may hold: lowercase ASCII
/// labels of letters, digits and `-`, optionally starting with `*.`.
fn valid_server_name(name: &str) -> bool {
    let base = name.strip_prefix("*.").unwrap_or(name);
    !base.is_empty()
        && base.len() <= 253
        && base.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

impl TlsSettings {
    /// Checks the settings as data (the files are checked when loaded).
    pub fn validate(&self) -> Result<(), FieldError> {
        let err = |path: String, reason: &str| Err(FieldError::new(path, reason));
        if self.alpn.is_empty() {
            return err("alpn".into(), "at least one protocol is required");
        }
        if self.alpn.iter().collect::<HashSet<_>>().len() != self.alpn.len() {
            return err("alpn".into(), "lists a protocol twice");
        }
        if self.handshake_timeout.is_zero() {
            return err("handshake_timeout".into(), "must be more than 0");
        }
        let mut seen = HashSet::new();
        for (i, c) in self.certificates.iter().enumerate() {
            if c.server_names.is_empty() {
                return err(
                    format!("certificates[{i}].server_names"),
                    "at least one name is required",
                );
            }
            for (j, name) in c.server_names.iter().enumerate() {
                let at = format!("certificates[{i}].server_names[{j}]");
                if !valid_server_name(name) {
                    return err(at, "not a lowercase DNS name or *.wildcard");
                }
                if !seen.insert(name.as_str()) {
                    return err(at, &format!("{name:?} is listed twice"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_are_lowercase_dns_names_or_one_wildcard() {
        for ok in ["a.example.com", "*.example.com", "localhost", "x-1.io"] {
            assert!(valid_server_name(ok), "{ok}");
        }
        for bad in [
            "",
            "*.",
            "*",
            "A.example",
            "a..b",
            "a.*.b",
            "-a.b",
            "a b",
            "*.*.b",
            ".a",
        ] {
            assert!(!valid_server_name(bad), "{bad}");
        }
    }
}
