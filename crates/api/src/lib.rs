//! The control-plane wire protocol (`proto/meshless/v1/distribution.proto`,
//! protobuf over gRPC with tonic) and conversions between its messages and
//! the model.

use std::net::IpAddr;

use bytes::Bytes;
use meshless_model::{Conditions, Endpoint as ModelEndpoint, EndpointId, ServiceSettings};
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

mod encoding;
pub use encoding::{EncodedPair, Encoding, decode_delta, encode_compact};

/// The largest gRPC message either side of the distribution stream sends
/// or accepts (tonic's default is 4 MiB): a service's snapshot is one
/// message per service, and 45,000 endpoints already take 4.4 MB. Both
/// ends use this same limit.
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024 * 1024;

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
    #[error("service settings: {0}")]
    Settings(String),
}

/// Service settings to wire.
pub fn settings_to_wire(s: &ServiceSettings) -> v1::ServiceSettings {
    v1::ServiceSettings {
        policy: s.policy.clone(),
        hash_key: s.hash_key.as_ref().map(ToString::to_string),
        load_factor: s.load_factor,
        locality: s.locality.map(|l| l.to_string()),
        scale_to_zero: s.scale_to_zero,
    }
}

/// Wire service settings to model, validated.
pub fn settings_from_wire(w: &v1::ServiceSettings) -> Result<ServiceSettings, WireError> {
    let bad = |e: &dyn std::fmt::Display| WireError::Settings(e.to_string());
    let s = ServiceSettings {
        policy: w.policy.clone(),
        hash_key: w
            .hash_key
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(|e| bad(&e))?,
        load_factor: w.load_factor,
        locality: w
            .locality
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(|e| bad(&e))?,
        scale_to_zero: w.scale_to_zero,
    };
    s.validate().map_err(|e| bad(&e))?;
    Ok(s)
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
        starting: e.starting,
        slice: slice.to_owned(),
        packed_addresses: Vec::new(),
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
        starting: w.starting,
    })
}

/// Encodes a delta once; the bytes are shared by every subscriber.
pub fn encode_delta(delta: &v1::Delta) -> Bytes {
    Bytes::from(delta.encode_to_vec())
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

    #[test]
    fn settings_round_trip_and_bad_ones_are_refused() {
        let s = ServiceSettings {
            policy: Some("maglev".into()),
            hash_key: Some(meshless_model::HashKeySource::Query("id".into())),
            load_factor: Some(1.5),
            locality: Some(meshless_model::LocalityChoice::Any),
            scale_to_zero: Some(false),
        };
        assert_eq!(settings_from_wire(&settings_to_wire(&s)).expect("valid"), s);
        let empty = settings_to_wire(&ServiceSettings::default());
        assert_eq!(empty, v1::ServiceSettings::default());
        for bad in [
            v1::ServiceSettings {
                policy: Some("fastest".into()),
                ..Default::default()
            },
            v1::ServiceSettings {
                hash_key: Some("body".into()),
                ..Default::default()
            },
            v1::ServiceSettings {
                load_factor: Some(0.0),
                ..Default::default()
            },
            v1::ServiceSettings {
                locality: Some("moon".into()),
                ..Default::default()
            },
        ] {
            assert!(settings_from_wire(&bad).is_err(), "{bad:?}");
        }
    }
}
