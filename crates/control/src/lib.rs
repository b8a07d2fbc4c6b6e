//! The meshless control plane.

pub mod reconciler;
