//! The control-plane wire protocol (`proto/meshless/v1/distribution.proto`,
//! protobuf over gRPC with tonic) and conversions between its messages and
//! the model.

use std::net::IpAddr;

use bytes::Bytes;
use meshless_model::{Conditions, Endpoint as ModelEndpoint, EndpointId};
use prost::Message;

#[allow(
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used
)]
pub mod v1 {
    tonic::include_proto!("meshless.v1");
}

pub use v1::distribution_client::DistributionClient;
pub use v1::distribution_server::{Distribution, DistributionServer};

/// Why a message could not be turned into model values.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("endpoint {id}: address {address:?}: {reason}")]
    Address {
        id: String,
        address: String,
        reason: String,
    },
    #[error("endpoint {id}: port {port} out of range")]
    Port { id: String, port: u32 },
    #[error("delta: {0}")]
    Decode(#[from] prost::DecodeError),
}

/// Model endpoint (with its slice) to wire.
pub fn endpoint_to_wire(e: &ModelEndpoint, slice: &str) -> v1::Endpoint {
    v1::Endpoint {
        id: e.id.to_string(),
        addresses: e.addresses.iter().map(ToString::to_string).collect(),
        port: u32::from(e.port),
        weight: e.weight,
        zone: e.zone.clone().unwrap_or_default(),
        node: e.node.clone().unwrap_or_default(),
        ready: e.conditions.ready,
        serving: e.conditions.serving,
        terminating: e.conditions.terminating,
        slice: slice.to_owned(),
    }
}

/// Wire endpoint to model.
pub fn endpoint_from_wire(w: &v1::Endpoint) -> Result<ModelEndpoint, WireError> {
    let addresses = w
        .addresses
        .iter()
        .map(|a| {
            a.parse::<IpAddr>().map_err(|e| WireError::Address {
                id: w.id.clone(),
                address: a.clone(),
                reason: e.to_string(),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let port = u16::try_from(w.port).map_err(|_| WireError::Port {
        id: w.id.clone(),
        port: w.port,
    })?;
    let opt = |s: &str| (!s.is_empty()).then(|| s.to_owned());
    Ok(ModelEndpoint {
        id: EndpointId::new(w.id.clone()),
        addresses,
        port,
        weight: w.weight.max(1),
        zone: opt(&w.zone),
        node: opt(&w.node),
        conditions: Conditions {
            ready: w.ready,
            serving: w.serving,
            terminating: w.terminating,
        },
    })
}

/// Encodes a delta once; the bytes are shared by every subscriber.
pub fn encode_delta(delta: &v1::Delta) -> Bytes {
    Bytes::from(delta.encode_to_vec())
}

/// Decodes a delta received in a `ServerMessage`.
pub fn decode_delta(bytes: &[u8]) -> Result<v1::Delta, WireError> {
    Ok(v1::Delta::decode(bytes)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_round_trip() {
        let e = ModelEndpoint::new("a", "10.0.0.1:80".parse().expect("addr"))
            .with_zone("z")
            .with_weight(3);
        let back = endpoint_from_wire(&endpoint_to_wire(&e, "s-1")).expect("valid");
        assert_eq!(back, e);
        let mut w = endpoint_to_wire(&e, "s");
        w.addresses = vec!["nope".into()];
        assert!(endpoint_from_wire(&w).is_err());
    }
}
