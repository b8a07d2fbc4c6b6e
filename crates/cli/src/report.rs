//! What the `bench` commands share: running a measurement on its own
//! runtime, printing its report as JSON or as text, and percentiles.

use std::future::Future;

use anyhow::Result;
use serde::Serialize;

/// Runs `measure` on a multi-thread runtime, then prints the report: one
/// JSON object with `json`, else through `print`.
pub fn run_report<T: Serialize>(
    json: bool,
    measure: impl Future<Output = Result<T>>,
    print: impl FnOnce(&T),
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(measure)?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print(&report);
    }
    Ok(())
}

/// The `p` quantile (0.0..=1.0) of ascending `sorted` values; NaN when empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}
