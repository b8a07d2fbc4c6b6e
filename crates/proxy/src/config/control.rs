//! `control:` the control plane whose distribution stream serves
//! `service:` clusters.

use serde::{Deserialize, Serialize};

/// Where the control plane's distribution stream is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlLink {
    /// gRPC address of the control plane, `host:port`.
    pub address: String,
    /// File holding the bearer token the control plane requires.
    #[serde(default)]
    pub token_file: Option<std::path::PathBuf>,
}
