//! Plain data shared by every meshless crate: endpoints, their addresses,
//! conditions and placement. This crate does no I/O and has no runtime.
//!
//! Invariant: a value of [`Endpoint`] that passed [`Endpoint::validate`] has
//! a non-empty id, at least one address, a non-zero port and a weight in
//! `1..=MAX_WEIGHT`.

mod endpoint;
pub mod field_error;
pub mod probe_backoff;
pub mod serde_duration;
pub mod service_settings;
pub mod subset;
pub mod yaml;

pub use endpoint::{
    Conditions, Endpoint, EndpointError, EndpointId, MAX_WEIGHT, routable_endpoints,
};
pub use field_error::{AtPath, FieldError};
pub use service_settings::{HashKeySource, LocalityChoice, ServiceSettings};
