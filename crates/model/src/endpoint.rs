//! One backend instance a proxy can send requests to.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

/// Largest accepted endpoint weight (Envoy caps `load_balancing_weight` at a
/// similar magnitude; larger values only inflate hash tables).
pub const MAX_WEIGHT: u32 = 10_000;

/// Stable identity of an endpoint within its service, e.g. a pod name or
/// `10.0.0.7:8080`. State that must survive config changes (load, health,
/// outlier ejection) is keyed by this identity.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct EndpointId(String);

impl EndpointId {
    /// Wraps `id`; emptiness is checked by [`Endpoint::validate`].
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The identity as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for EndpointId {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

/// Conditions with the meaning Kubernetes EndpointSlices give them:
/// `serving` = the instance answers; `terminating` = it is being shut down;
/// `ready` = serving and not terminating.
///
/// A partial object is completed with Kubernetes' rules (EndpointConditions):
/// absent `terminating` is false; absent `serving` is the same as `ready`;
/// absent `ready` is `serving and not terminating` (true when neither is
/// given). So `{terminating: true}` is serving-and-terminating, not an
/// inconsistent "ready and terminating", and `{ready: false}` is not serving.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "PartialConditions")]
pub struct Conditions {
    /// Serving and not terminating: receives new requests.
    pub ready: bool,
    /// Answers requests (may also be terminating).
    pub serving: bool,
    /// Being shut down: gets no new requests while any ready endpoint exists.
    pub terminating: bool,
}

impl Default for Conditions {
    fn default() -> Self {
        Self::READY
    }
}

/// `conditions` as written: each field may be absent.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PartialConditions {
    #[serde(default)]
    ready: Option<bool>,
    #[serde(default)]
    serving: Option<bool>,
    #[serde(default)]
    terminating: Option<bool>,
}

impl From<PartialConditions> for Conditions {
    fn from(p: PartialConditions) -> Self {
        let terminating = p.terminating.unwrap_or(false);
        let serving = p.serving.or(p.ready).unwrap_or(true);
        let ready = p.ready.unwrap_or(serving && !terminating);
        Self {
            ready,
            serving,
            terminating,
        }
    }
}

impl Conditions {
    /// A normal, live endpoint.
    pub const READY: Self = Self {
        ready: true,
        serving: true,
        terminating: false,
    };
}

/// One backend instance: identity, addresses, port and placement.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    /// Stable identity within the service.
    pub id: EndpointId,
    /// One or more addresses (dual stack: IPv4 and IPv6); the first is preferred.
    pub addresses: Vec<IpAddr>,
    /// TCP port the endpoint listens on.
    pub port: u16,
    /// Relative share of traffic, `1..=MAX_WEIGHT`.
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Failure domain, e.g. `us-east-1a`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// Machine the endpoint runs on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Readiness as reported by the source of the endpoint.
    #[serde(default)]
    pub conditions: Conditions,
    /// Announced not ready by the scaler that runs it, only because it is
    /// still starting (the control plane's process scaler, or an instance
    /// registered so through the API): a proxy holding requests for it may
    /// probe it and send to it once it accepts, before the ready update
    /// arrives. Never set for endpoints whose readiness their source checks
    /// (Kubernetes pods, the API by default): those are used only once
    /// ready.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub starting: bool,
}

fn default_weight() -> u32 {
    1
}

/// Why an endpoint was rejected. Each variant names the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("endpoint id: must not be empty")]
    EmptyId,
    #[error("endpoint {id}: addresses: at least one address is required")]
    NoAddress { id: EndpointId },
    #[error("endpoint {id}: port: must be 1..=65535, got 0")]
    ZeroPort { id: EndpointId },
    #[error("endpoint {id}: weight: must be 1..={max}, got {weight}", max = MAX_WEIGHT)]
    BadWeight { id: EndpointId, weight: u32 },
    #[error(
        "endpoint {id}: conditions: ready requires serving and not terminating \
         (ready={ready}, serving={serving}, terminating={terminating})"
    )]
    InconsistentConditions {
        id: EndpointId,
        ready: bool,
        serving: bool,
        terminating: bool,
    },
}

impl Endpoint {
    /// A ready endpoint of weight 1 with one address.
    pub fn new(id: impl Into<String>, address: SocketAddr) -> Self {
        Self {
            id: EndpointId::new(id),
            addresses: vec![address.ip()],
            port: address.port(),
            weight: 1,
            zone: None,
            node: None,
            conditions: Conditions::READY,
            starting: false,
        }
    }

    /// Sets the weight.
    pub fn with_weight(mut self, weight: u32) -> Self {
        self.weight = weight;
        self
    }

    /// Sets the zone.
    pub fn with_zone(mut self, zone: impl Into<String>) -> Self {
        self.zone = Some(zone.into());
        self
    }

    /// Sets the node.
    pub fn with_node(mut self, node: impl Into<String>) -> Self {
        self.node = Some(node.into());
        self
    }

    /// Sets the conditions.
    pub fn with_conditions(mut self, conditions: Conditions) -> Self {
        self.conditions = conditions;
        self
    }

    /// The preferred socket address (first address, endpoint port).
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        self.addresses
            .first()
            .map(|ip| SocketAddr::new(*ip, self.port))
    }

    /// Checks the invariants listed in the crate docs.
    pub fn validate(&self) -> Result<(), EndpointError> {
        if self.id.as_str().is_empty() {
            return Err(EndpointError::EmptyId);
        }
        if self.addresses.is_empty() {
            return Err(EndpointError::NoAddress {
                id: self.id.clone(),
            });
        }
        if self.port == 0 {
            return Err(EndpointError::ZeroPort {
                id: self.id.clone(),
            });
        }
        if self.weight == 0 || self.weight > MAX_WEIGHT {
            return Err(EndpointError::BadWeight {
                id: self.id.clone(),
                weight: self.weight,
            });
        }
        let c = self.conditions;
        if c.ready && (!c.serving || c.terminating) {
            return Err(EndpointError::InconsistentConditions {
                id: self.id.clone(),
                ready: c.ready,
                serving: c.serving,
                terminating: c.terminating,
            });
        }
        Ok(())
    }
}

/// The endpoints that may receive new requests, by kube-proxy's rule: the
/// ready ones; if none is ready, the ones that are serving and terminating
/// (so a service mid-rollout keeps answering). Order is preserved.
pub fn routable_endpoints(endpoints: &[Endpoint]) -> Vec<&Endpoint> {
    let ready: Vec<&Endpoint> = endpoints.iter().filter(|e| e.conditions.ready).collect();
    if !ready.is_empty() {
        return ready;
    }
    endpoints
        .iter()
        .filter(|e| e.conditions.serving && e.conditions.terminating)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(id: &str) -> Endpoint {
        Endpoint::new(id, "127.0.0.1:8080".parse().expect("literal address"))
    }

    #[test]
    fn validate_names_the_field() {
        assert!(ep("a").validate().is_ok());
        let e = ep("a").with_weight(0).validate().expect_err("weight 0");
        assert!(e.to_string().contains("weight"), "{e}");
        let mut no_addr = ep("b");
        no_addr.addresses.clear();
        assert!(
            no_addr
                .validate()
                .expect_err("no address")
                .to_string()
                .contains("addresses")
        );
        let mut zero_port = ep("c");
        zero_port.port = 0;
        assert!(
            zero_port
                .validate()
                .expect_err("port 0")
                .to_string()
                .contains("port")
        );
        assert_eq!(ep("").validate(), Err(EndpointError::EmptyId));
        let bad = ep("d").with_conditions(Conditions {
            ready: true,
            serving: true,
            terminating: true,
        });
        assert!(
            bad.validate()
                .expect_err("ready+terminating")
                .to_string()
                .contains("conditions")
        );
    }

    #[test]
    fn routable_prefers_ready_then_serving_terminating() {
        let terminating = Conditions {
            ready: false,
            serving: true,
            terminating: true,
        };
        let gone = Conditions {
            ready: false,
            serving: false,
            terminating: true,
        };
        let eps = vec![
            ep("a").with_conditions(terminating),
            ep("b"),
            ep("c").with_conditions(gone),
        ];
        let ids: Vec<_> = routable_endpoints(&eps)
            .iter()
            .map(|e| e.id.as_str())
            .collect();
        assert_eq!(ids, ["b"]);
        let eps = vec![
            ep("a").with_conditions(terminating),
            ep("c").with_conditions(gone),
        ];
        let ids: Vec<_> = routable_endpoints(&eps)
            .iter()
            .map(|e| e.id.as_str())
            .collect();
        assert_eq!(ids, ["a"]);
    }

    #[test]
    fn deserializes_with_defaults_and_rejects_unknown_fields() {
        let e: Endpoint =
            serde_json::from_str(r#"{"id":"x","addresses":["10.0.0.1","fd00::1"],"port":80}"#)
                .expect("valid json");
        assert_eq!(e.weight, 1);
        assert!(e.conditions.ready);
        assert_eq!(e.addresses.len(), 2);
        let err = serde_json::from_str::<Endpoint>(
            r#"{"id":"x","addresses":["10.0.0.1"],"port":80,"wieght":3}"#,
        )
        .expect_err("typo");
        assert!(err.to_string().contains("wieght"));
    }

    #[test]
    fn partial_conditions_follow_kubernetes_defaults() {
        let parse = |j: &str| serde_json::from_str::<Conditions>(j).expect("valid");
        assert_eq!(parse("{}"), Conditions::READY);
        let t = parse(r#"{"terminating": true}"#);
        assert!(t.serving && t.terminating && !t.ready, "{t:?}");
        let r = parse(r#"{"ready": false}"#);
        assert!(!r.ready && !r.serving && !r.terminating, "{r:?}");
        let s = parse(r#"{"serving": false}"#);
        assert!(!s.ready && !s.serving, "{s:?}");
        assert!(serde_json::from_str::<Conditions>(r#"{"readyy": true}"#).is_err());
    }
}
