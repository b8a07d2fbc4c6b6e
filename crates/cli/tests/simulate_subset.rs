//! `meshless simulate distribution --subset-size`: the real binary, its JSON
//! read by row name as a script would.

use std::process::Command;

use serde_json::Value;

fn distribution(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_meshless"))
        .args(["simulate", "distribution", "--json"])
        .args(args)
        .output()
        .expect("run meshless");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// `(total_events, total_bytes)` of the row `scheme` in `scenario`; panics
/// when the row is missing.
fn row(report: &Value, scenario: &str, scheme: &str) -> (u64, u64) {
    let rows = report["rows"].as_array().expect("rows");
    let r = rows
        .iter()
        .find(|r| r["scenario"] == scenario && r["scheme"] == scheme)
        .unwrap_or_else(|| panic!("no row {scheme:?} in {scenario:?}: {report}"));
    let num = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
    (num("total_events"), num("total_bytes"))
}

#[test]
fn subsets_cut_a_single_change_to_the_holders_and_a_rolling_update_by_a_third() {
    let report = distribution(&[
        "--nodes",
        "5000",
        "--endpoints",
        "20000",
        "--slice-size",
        "100",
        "--subset-size",
        "100",
    ]);
    for key in ["nodes", "endpoints", "slice_size", "subset_size", "rows"] {
        assert!(report.get(key).is_some(), "missing {key}: {report}");
    }
    assert_eq!(report["subset_size"], 100);
    let subsets = "meshless deltas, subsets of 100";
    // 100 divides 20,000 and 5,000 nodes fill 25 whole rounds of 200 slots:
    // every endpoint is in exactly 5000 × 100 / 20000 = 25 subsets.
    let (events, bytes) = row(&report, "one endpoint changes", subsets);
    assert_eq!(events, 25);
    assert!(bytes < 1_000_000, "single change: {bytes} B");
    let (_, full_bytes) = row(&report, "one endpoint changes", "meshless deltas");
    assert_eq!(
        bytes * 200,
        full_bytes,
        "same delta, 25 nodes instead of 5000"
    );
    // A replacement touches the slots between the old and the new
    // endpoint's rank in each round: about a third of the nodes per step.
    let (events, bytes) = row(&report, "rolling update", subsets);
    let (full_events, full_bytes) = row(&report, "rolling update", "meshless deltas");
    assert!(events * 5 < full_events * 2, "{events} of {full_events}");
    assert!(events * 4 > full_events, "{events} of {full_events}");
    assert!(bytes * 5 < full_bytes * 2, "{bytes} of {full_bytes}");
    let (created, _) = row(&report, "service created", subsets);
    assert_eq!(created, 5000, "one reset per node");
}

#[test]
fn subset_size_zero_adds_no_rows() {
    let report = distribution(&["--nodes", "10", "--endpoints", "50"]);
    assert_eq!(report["subset_size"], 0);
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 12);
    assert!(
        rows.iter()
            .all(|r| !r["scheme"].as_str().unwrap_or("").contains("subsets"))
    );
}
