//! The label sets of the per-endpoint metric families: shared by the
//! registry ([`crate::metrics`]) and the table that removes an endpoint's
//! series when it is gone ([`crate::endpoint_series`]).

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;

/// Labels of a finished request. Shared strings, so building the label set
/// on the request path allocates nothing.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub listener: Arc<str>,
    pub cluster: Arc<str>,
    pub endpoint: Arc<str>,
    pub class: &'static str,
}

/// Labels naming one endpoint of one cluster.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    pub cluster: String,
    pub endpoint: String,
}
