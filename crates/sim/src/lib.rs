//! Scale models: what a balancing policy does on a keyed workload with
//! unequal weights and failed endpoints ([`balance`]), and what endpoint
//! changes cost on the wire under Kubernetes' schemes and ours
//! ([`distribution`]). Inputs are plain workload structs; the `meshless`
//! binary maps its flags onto them, so fields carry the flags' names and
//! errors name the flag at fault.

pub mod balance;
pub mod distribution;
mod keys;
pub mod progress;
pub mod subset_cost;

pub use balance::{BalanceReport, BalanceWorkload, Down, EndpointShare, simulate_balance};
pub use distribution::{DistributionWorkload, Row, human};
pub use keys::KeyDistribution;

/// A workload the model cannot run: the flag (field) at fault and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("--{flag}: {reason}")]
pub struct SimError {
    /// The workload field, spelled as the command-line flag (`endpoints`, `remove`).
    pub flag: &'static str,
    pub reason: String,
}

impl SimError {
    pub(crate) fn new(flag: &'static str, reason: impl Into<String>) -> Self {
        Self {
            flag,
            reason: reason.into(),
        }
    }
}
