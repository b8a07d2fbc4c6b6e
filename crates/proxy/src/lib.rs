//! The meshless data plane: HTTP and TCP listeners, routing, clusters balanced per
//! request, upstream connection pools, health checks, admin and metrics.

pub mod accept;
pub mod access_log;
pub mod activation_queue;
pub mod admin;
pub mod byte_arena;
pub mod cidr;
pub mod config;
pub mod connection;
pub mod deny;
pub mod drain;
pub mod edge_metrics;
pub mod endpoint_labels;
pub mod endpoint_series;
pub mod flows;
pub mod free_list;
pub mod h1out;
pub mod h1serve;
pub mod h2_streams;
pub mod handoff;
pub mod header_maps;
pub mod health;
pub mod hop_fields;
pub mod hyper_h1;
pub mod l4;
pub mod limits;
pub mod listener;
pub mod merge_window;
pub mod metrics;
pub mod placement;
pub mod pooled_future;
pub mod protocol;
pub mod proxy;
pub mod proxy_protocol;
pub mod rapid_reset;
pub mod request;
pub mod router;
pub mod snapshot;
pub mod sockopt;
pub mod state;
pub mod tls;
pub mod upstream;

pub use config::{ConfigFileError, ProxyConfig};
pub use proxy::{Proxy, ProxyError};
pub mod control_link;
mod control_outbound;
