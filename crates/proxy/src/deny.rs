//! Deny lists: CIDR rules checked on every accepted connection before
//! anything else is done with it (before a PROXY header is read, before
//! TLS, before a byte of HTTP), and again on the client address a trusted
//! PROXY header names. The first matching rule decides: `drop` closes the
//! connection at once (the client reads end of stream), `reset` closes it
//! with `SO_LINGER` 0 so the kernel sends RST (the client reads
//! `ECONNRESET`). Counted per rule: `meshless_proxy_denied_connections_total`.
//!
//! Envoy: the `envoy.filters.network.rbac` filter with `DENY` policies on
//! `source_ip`/`direct_remote_ip`; HAProxy: `tcp-request connection reject`
//! (close) and `tcp-request connection silent-drop` / `reject` with RST.

use std::net::IpAddr;
use std::time::Duration;

use meshless_model::FieldError;
use serde::{Deserialize, Serialize};

use crate::cidr::Cidr;

/// `listeners[].deny[]:` one rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DenyRule {
    /// Metric label and log field; unique within the listener.
    pub name: String,
    /// Source blocks the rule matches (IPv4 and IPv6).
    pub sources: Vec<Cidr>,
    /// What is done with a matching connection.
    #[serde(default)]
    pub action: DenyAction,
}

/// How a denied connection is closed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DenyAction {
    /// Close at once (FIN): the client reads end of stream.
    #[default]
    Drop,
    /// Close with `SO_LINGER` 0 (RST): the client reads `ECONNRESET`.
    Reset,
}

impl DenyAction {
    /// The metric label.
    pub fn name(self) -> &'static str {
        match self {
            DenyAction::Drop => "drop",
            DenyAction::Reset => "reset",
        }
    }
}

/// The first rule of `rules` that matches `ip`.
pub fn matching(rules: &[DenyRule], ip: IpAddr) -> Option<&DenyRule> {
    rules
        .iter()
        .find(|r| r.sources.iter().any(|c| c.contains(ip)))
}

/// Closes a denied connection as `action` says. A `drop` is a plain close:
/// FIN, or RST when the peer's bytes are still unread (the kernel's rule;
/// nothing is read from a denied peer to avoid it).
pub fn refuse(stream: crate::lazy_tcp::LazyTcpStream, action: DenyAction) {
    if action == DenyAction::Reset
        && let Some(socket) = stream.socket()
    {
        // Best effort: if the option cannot be set, a plain close remains.
        let _ = socket.set_linger(Some(Duration::ZERO));
    }
    drop(stream);
}

/// Checks a listener's rules: names present and unique, each with sources.
pub fn validate(rules: &[DenyRule]) -> Result<(), FieldError> {
    let mut names = std::collections::HashSet::new();
    for (i, r) in rules.iter().enumerate() {
        if r.name.is_empty() {
            return Err(FieldError::new(
                format!("deny[{i}].name"),
                "must not be empty",
            ));
        }
        if !names.insert(r.name.as_str()) {
            return Err(FieldError::new(
                format!("deny[{i}].name"),
                format!("duplicate rule name {:?}", r.name),
            ));
        }
        if r.sources.is_empty() {
            return Err(FieldError::new(
                format!("deny[{i}].sources"),
                "at least one CIDR block is required",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_first_matching_rule_decides() {
        let rule = |name: &str, cidr: &str, action| DenyRule {
            name: name.into(),
            sources: vec![cidr.parse().unwrap()],
            action,
        };
        let rules = vec![
            rule("one", "10.1.0.0/16", DenyAction::Reset),
            rule("ten", "10.0.0.0/8", DenyAction::Drop),
            rule("v6", "2001:db8::/32", DenyAction::Reset),
        ];
        let m = |ip: &str| matching(&rules, ip.parse().unwrap()).map(|r| r.name.as_str());
        assert_eq!(m("10.1.2.3"), Some("one"));
        assert_eq!(m("10.2.0.1"), Some("ten"));
        assert_eq!(m("::ffff:10.2.0.1"), Some("ten"));
        assert_eq!(m("2001:db8:1::1"), Some("v6"));
        assert_eq!(m("192.0.2.1"), None);
        assert!(validate(&rules).is_ok());
        let dup = vec![rules[0].clone(), rules[0].clone()];
        assert_eq!(validate(&dup).unwrap_err().path, "deny[1].name");
    }
}
