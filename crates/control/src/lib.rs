//! The meshless control plane: the registry of services and endpoints, the
//! slice reconciler, the embedded store, the registration API and endpoint
//! distribution to proxies. Module map: ARCHITECTURE.md.

pub mod api;
pub mod autoscaler;
pub mod client;
pub mod commit;
pub mod config;
mod delta_log;
pub mod distributor;
mod gate;
pub mod grpc;
pub mod http;
pub mod kubernetes;
pub mod metrics;
pub mod notify;
mod outbox;
pub mod placement;
pub mod plane;
mod process_group;
pub mod process_scaler;
pub mod reconciler;
pub mod registry;
pub mod scaling;
pub mod starts;
pub mod state;
pub mod store;
mod subscriber;
pub mod subsets;
pub mod tasks;
pub mod webhook;
