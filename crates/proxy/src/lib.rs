//! The meshless data plane: HTTP listeners, routing, clusters balanced per
//! request, upstream connection pools, health checks, admin and metrics.

pub mod config;
mod duration;
