//! The registration API's inputs and outputs: what `PUT`, `POST` and `GET`
//! under `/v1/services` accept and return, shared by the server
//! ([`crate::http`]), the typed client ([`crate::client`]), the config file
//! (services declared at start) and tests. Inputs reject unknown fields;
//! outputs accept them, so an older client reads a newer server.

use std::net::IpAddr;

use meshless_model::{Conditions, Endpoint, ServiceSettings};
use serde::{Deserialize, Serialize};

/// Longest accepted endpoint TTL.
pub const MAX_TTL_SECONDS: u64 = 24 * 3600;

/// One port of a service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServicePort {
    #[serde(default)]
    pub name: Option<String>,
    pub port: u16,
    /// `TCP` (default), `UDP` or `SCTP`.
    #[serde(default = "default_protocol")]
    pub protocol: String,
}

fn default_protocol() -> String {
    "TCP".into()
}

impl ServicePort {
    /// An unnamed TCP port.
    pub fn tcp(port: u16) -> Self {
        Self {
            name: None,
            port,
            protocol: default_protocol(),
        }
    }
}

/// What a service is, apart from its endpoints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceSpec {
    pub namespace: String,
    pub name: String,
    #[serde(default)]
    pub ports: Vec<ServicePort>,
    /// Balancing settings proxies receive with the endpoints.
    #[serde(default, skip_serializing_if = "ServiceSettings::is_empty")]
    pub settings: ServiceSettings,
}

impl ServiceSpec {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// Body of `PUT /v1/services/NS/NAME`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceInput {
    #[serde(default)]
    pub ports: Vec<ServicePort>,
    /// Balancing settings proxies receive with the endpoints.
    #[serde(default, skip_serializing_if = "ServiceSettings::is_empty")]
    pub settings: ServiceSettings,
}

/// An endpoint as the registration API accepts it (body of
/// `PUT /v1/services/NS/NAME/endpoints/ID`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointInput {
    pub id: String,
    pub addresses: Vec<IpAddr>,
    pub port: u16,
    #[serde(default = "default_weight")]
    pub weight: u32,
    #[serde(default)]
    pub zone: Option<String>,
    #[serde(default)]
    pub node: Option<String>,
    #[serde(default)]
    pub conditions: Conditions,
    /// Seconds until the endpoint is removed unless renewed (as Consul's TTL checks).
    #[serde(default)]
    pub ttl_seconds: Option<u64>,
    /// Not ready only because it is still starting: proxies holding
    /// requests may probe it ([`meshless_model::Endpoint::starting`]);
    /// ignored for a ready or terminating endpoint.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub starting: bool,
}

fn default_weight() -> u32 {
    1
}

/// The longest endpoint id the registration API accepts (a Kubernetes
/// DNS subdomain name's limit).
pub const MAX_ENDPOINT_ID_LEN: usize = 253;

/// Whether `id` can name an endpoint in the registration API: it must be
/// addressable as one path segment (`.../endpoints/ID`, never
/// percent-decoded), so 1..=253 of `[A-Za-z0-9._:-]` (Kubernetes names,
/// pod names, and IP addresses as the Kubernetes source uses them), and
/// not `.` or `..`. The reason when it is not.
pub fn check_endpoint_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("must not be empty".into());
    }
    if id.len() > MAX_ENDPOINT_ID_LEN {
        return Err(format!(
            "must be at most {MAX_ENDPOINT_ID_LEN} characters, got {}",
            id.len()
        ));
    }
    if id == "." || id == ".." {
        return Err(format!("{id:?} cannot be addressed by path"));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')))
    {
        return Err(format!(
            "{c:?} not allowed: an id is letters, digits, '.', '_', ':' and '-' (it must be addressable as a path segment)"
        ));
    }
    Ok(())
}

impl EndpointInput {
    /// A ready endpoint of weight 1 at `address:port`, no placement, no TTL.
    pub fn new(id: impl Into<String>, address: IpAddr, port: u16) -> Self {
        Self {
            id: id.into(),
            addresses: vec![address],
            port,
            weight: default_weight(),
            zone: None,
            node: None,
            conditions: Conditions::READY,
            ttl_seconds: None,
            starting: false,
        }
    }
}

/// Body of `POST /v1/services/NS/NAME/endpoints`: puts, then deletes, as
/// one write; ids to delete that are absent are skipped.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BulkInput {
    #[serde(default)]
    pub put: Vec<EndpointInput>,
    #[serde(default)]
    pub delete: Vec<String>,
}

/// `POST /v1/services/NS/NAME/load`: a follower control-plane replica
/// forwards its proxies' load of one service to the leader, which decides
/// the scale (every tick while it follows; kept for [`REMOTE_LOAD_TTL`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteLoad {
    /// The reporting replica (its Lease identity): its last report replaces the previous one.
    pub replica: String,
    /// Requests in flight, summed over its proxies.
    pub in_flight: u64,
    /// Requests held waiting for an instance, summed over its proxies.
    pub queued: u64,
    /// A proxy asked it for an instance since its last report.
    #[serde(default)]
    pub activate: bool,
    /// The node of the proxy that last asked (node-local activation); empty: none.
    #[serde(default)]
    pub node: String,
}

/// How long the leader counts a follower's load report (several ticks).
pub const REMOTE_LOAD_TTL: std::time::Duration = std::time::Duration::from_secs(10);

/// Reply to every write: the registry version once the write's deltas are
/// published (what proxies will see).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionReply {
    pub version: u64,
}

/// Reply to `POST .../endpoints/ID/renew`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenewReply {
    pub renewed: String,
}

/// Reply to `GET /v1/services`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceList {
    pub version: u64,
    pub services: Vec<ServiceListItem>,
}

/// One service in a [`ServiceList`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceListItem {
    /// `namespace/name`.
    pub service: String,
}

/// Every error reply: `{"error": "..."}`, naming the field at fault when
/// one is (`body: put[0].weight: ...`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    pub error: String,
}

/// A service with its endpoints and slices (`GET /v1/services/NS/NAME`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceView {
    pub namespace: String,
    pub name: String,
    pub ports: Vec<ServicePort>,
    #[serde(default, skip_serializing_if = "ServiceSettings::is_empty")]
    pub settings: ServiceSettings,
    pub version: u64,
    pub endpoints: Vec<EndpointView>,
    pub slices: Vec<SliceView>,
}

/// An endpoint in a [`ServiceView`]: the endpoint's fields, its TTL and slice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointView {
    pub id: String,
    pub addresses: Vec<IpAddr>,
    pub port: u16,
    pub weight: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    pub conditions: Conditions,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    pub slice: Option<String>,
}

impl EndpointView {
    /// `endpoint` with its TTL and slice.
    pub fn new(endpoint: &Endpoint, ttl_seconds: Option<u64>, slice: Option<String>) -> Self {
        Self {
            id: endpoint.id.to_string(),
            addresses: endpoint.addresses.clone(),
            port: endpoint.port,
            weight: endpoint.weight,
            zone: endpoint.zone.clone(),
            node: endpoint.node.clone(),
            conditions: endpoint.conditions,
            ttl_seconds,
            slice,
        }
    }
}

/// A slice in a [`ServiceView`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceView {
    pub name: String,
    pub endpoints: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_view_serializes_as_the_endpoint_plus_ttl_and_slice() {
        let e = Endpoint::new("a", "10.0.0.1:80".parse().expect("addr")).with_weight(3);
        let v = EndpointView::new(&e, Some(5), Some("s-1".into()));
        let mut want = serde_json::to_value(&e).expect("json");
        want["ttl_seconds"] = 5.into();
        want["slice"] = "s-1".into();
        assert_eq!(serde_json::to_value(&v).expect("json"), want);
        let back: EndpointView = serde_json::from_value(want).expect("reads back");
        assert_eq!(back, v);
    }

    #[test]
    fn inputs_reject_unknown_fields_and_default_the_rest() {
        let e: EndpointInput =
            serde_json::from_str(r#"{"id":"a","addresses":["10.0.0.1"],"port":80}"#)
                .expect("minimal");
        assert_eq!(
            e,
            EndpointInput::new("a", "10.0.0.1".parse().expect("ip"), 80)
        );
        assert!(serde_json::from_str::<BulkInput>(r#"{"puts":[]}"#).is_err());
        let p: ServicePort = serde_json::from_str(r#"{"port":80}"#).expect("port");
        assert_eq!(p, ServicePort::tcp(80));
    }
}
