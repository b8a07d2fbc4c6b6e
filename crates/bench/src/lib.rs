//! Benchmark harnesses that back meshless's performance claims, each on
//! real sockets (127.0.0.1) and real processes: [`coldstart`] (first
//! response at zero instances) and [`distribution`] (a control plane and N
//! subscriber streams). Each takes plain settings and returns a report that
//! serializes to the JSON the `meshless bench` commands print and displays
//! as their text.

pub mod coldstart;
pub mod distribution;
pub mod follower;
mod process;
pub mod spans;
pub mod writes;

pub use coldstart::{ClientKind, ColdstartReport, ColdstartSettings, UpstreamHttp1};
pub use distribution::{DistributionBenchReport, DistributionBenchSettings};
pub use writes::WriteBenchReport;

/// Why a benchmark could not run to the end.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A setting out of range: the flag and why.
    #[error("--{flag}: {reason}")]
    Setting { flag: &'static str, reason: String },
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
    #[error(transparent)]
    ControlConfig(#[from] meshless_control::config::ControlConfigError),
    #[error(transparent)]
    Control(#[from] meshless_control::plane::PlaneError),
    #[error(transparent)]
    ProxyConfig(#[from] meshless_proxy::ConfigFileError),
    #[error(transparent)]
    Proxy(#[from] meshless_proxy::ProxyError),
    #[error(transparent)]
    Api(#[from] meshless_control::client::ClientError),
    /// The measurement went wrong: what was expected and what happened.
    #[error("{0}")]
    Failed(String),
}

impl BenchError {
    pub(crate) fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        move |source| Self::Io { what, source }
    }
}

/// The `p` quantile (0.0..=1.0) of ascending `sorted` values; NaN when empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_takes_the_nearest_rank() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 0.5), 3.0);
        assert_eq!(percentile(&v, 1.0), 5.0);
        assert!(percentile(&[], 0.5).is_nan());
    }
}
