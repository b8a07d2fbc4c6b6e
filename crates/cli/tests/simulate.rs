//! Runs the real `meshless` binary and reads its JSON, as a script would.

use std::process::Command;

/// Runs `meshless ARGS` and reads the one JSON object it prints.
fn meshless_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_meshless"))
        .args(args)
        .output()
        .expect("run meshless");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    // No progress line when piped. `bench` runs real processes whose
    // warnings (e.g. a slow start on a loaded machine) may be logged; the
    // simulators log nothing at all.
    assert!(
        !stderr.contains('\r'),
        "no progress when piped, got: {stderr}"
    );
    if args.first() != Some(&"bench") {
        assert!(
            stderr.is_empty(),
            "no logs from a simulation, got: {stderr}"
        );
    }
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

fn simulate(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["simulate", "balance"];
    all.extend_from_slice(args);
    meshless_json(&all)
}

const WORKLOAD: [&str; 14] = [
    "--endpoints",
    "10",
    "--keys",
    "zipf:1.1",
    "--distinct-keys",
    "10000",
    "--requests",
    "200000",
    "--concurrency",
    "100",
    "--remove",
    "1",
    "--json",
    "--load-factor",
];

#[test]
fn bounded_load_meets_its_bound_and_beats_p2c_on_affinity() {
    let mut args = vec!["--policy", "bounded_load"];
    args.extend_from_slice(&WORKLOAD);
    args.push("1.25");
    let bounded = simulate(&args);
    let mut args = vec!["--policy", "p2c"];
    args.extend_from_slice(&WORKLOAD);
    args.push("1.25");
    let p2c = simulate(&args);
    for key in [
        "policy",
        "endpoints",
        "requests",
        "max_over_mean",
        "home_share",
        "moved",
    ] {
        assert!(bounded.get(key).is_some(), "missing {key}: {bounded}");
    }
    let max = bounded["max_over_mean"].as_f64().expect("number");
    // 1.25 plus at most one request's worth (one request = 1 / (100 / 10)).
    assert!(max <= 1.25 + 0.1 + 1e-9, "{bounded}");
    let home = bounded["home_share"].as_f64().expect("number");
    let p2c_home = p2c["home_share"].as_f64().expect("number");
    assert!(home > 3.0 * p2c_home, "{bounded} vs {p2c}");
    let moved = bounded["moved"].as_f64().expect("number");
    assert!(
        moved > 0.05 && moved < 0.2,
        "about 1/10 of keys move: {bounded}"
    );
    assert!(p2c["moved"].is_null());
}

#[test]
fn bad_flags_fail_with_a_message_naming_them() {
    let out = Command::new(env!("CARGO_BIN_EXE_meshless"))
        .args([
            "simulate",
            "balance",
            "--policy",
            "maglev",
            "--endpoints",
            "0",
        ])
        .output()
        .expect("run meshless");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--endpoints"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn simulate_distribution_reports_every_scheme_as_json() {
    let v = meshless_json(&[
        "simulate",
        "distribution",
        "--nodes",
        "50",
        "--endpoints",
        "300",
        "--json",
    ]);
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 12);
    let ours = rows
        .iter()
        .find(|r| r["scheme"] == "meshless deltas")
        .expect("ours");
    let slices = rows
        .iter()
        .find(|r| r["scheme"] == "EndpointSlices of 100")
        .expect("slices");
    let bytes = |row: &serde_json::Value| {
        row["total_bytes"]
            .as_u64()
            .unwrap_or_else(|| panic!("total_bytes is a number: {row}"))
    };
    assert!(bytes(ours) > 0, "{ours}");
    assert!(bytes(ours) < bytes(slices), "{ours} vs {slices}");
}

#[test]
fn bench_distribution_runs_against_a_real_control_plane() {
    let v = meshless_json(&[
        "bench",
        "distribution",
        "--subscribers",
        "5",
        "--endpoints",
        "200",
        "--changes",
        "5",
        "--json",
    ]);
    // 5 single changes and 2 tracked rolling replacements, at each of 5 subscribers.
    assert_eq!(v["single_change"]["samples"], 5 * 5, "{v}");
    assert_eq!(v["rolling_update"]["samples"], 5 * 2, "{v}");
    // One acknowledgment per single change, taken before its receipts.
    assert_eq!(v["single_change_write"]["samples"], 5, "{v}");
    let ms = |k: &str| v[k]["max_ms"].as_f64().unwrap_or(f64::NAN);
    assert!(ms("single_change_write") >= 0.0, "{v}");
    assert!(v["bytes_written"].as_u64().unwrap_or(0) > 0);
}

#[test]
fn bench_distribution_with_zone_aware_subsets_keeps_each_subscriber_in_its_zone() {
    // 300 endpoints in three zones (100 each) and subsets of 20: every
    // zone holds a whole subset, so no subscriber hears of another zone.
    let v = meshless_json(&[
        "bench",
        "distribution",
        "--subscribers",
        "6",
        "--endpoints",
        "300",
        "--changes",
        "3",
        "--subset-size",
        "20",
        "--zone-aware",
        "--json",
    ]);
    assert_eq!(v["zone_aware"], true, "{v}");
    // Each subscriber's snapshot alone holds its 20 endpoints.
    assert!(v["upserts_received"].as_u64().unwrap_or(0) >= 6 * 20, "{v}");
    assert_eq!(v["out_of_zone_share"].as_f64(), Some(0.0), "{v}");
}

#[test]
fn bench_distribution_refuses_zone_aware_without_a_subset() {
    let out = Command::new(env!("CARGO_BIN_EXE_meshless"))
        .args(["bench", "distribution", "--zone-aware"])
        .output()
        .expect("run meshless");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("zone-aware") && err.contains("subset-size"),
        "{err}"
    );
}

#[test]
fn bench_coldstart_measures_a_real_cold_start() {
    let v = meshless_json(&[
        "bench",
        "coldstart",
        "--startup-delay",
        "50",
        "--runs",
        "1",
        "--burst",
        "20",
        "--json",
    ]);
    assert!(
        v["first_response_ms_p50"].as_f64().unwrap_or(0.0) >= 50.0,
        "{v}"
    );
    assert_eq!(v["burst_failures"], 0, "{v}");
    assert!(
        v["burst_instances_started"].as_u64().unwrap_or(0) >= 1,
        "{v}"
    );
    // The default client sends on a connection opened before the clock;
    // every run is listed with its six paired phases.
    assert_eq!(v["client"], "open", "{v}");
    assert_eq!(v["upstream_http1"], "meshless", "{v}");
    let runs = v["paired_runs"].as_array().cloned().unwrap_or_default();
    assert_eq!(runs.len(), 1, "{v}");
    assert_eq!(
        runs[0]["phases_ms"].as_array().map(Vec::len),
        Some(6),
        "{v}"
    );
    assert_eq!(runs[0]["overhead_ms"], v["paired_overhead_ms_p50"], "{v}");
    assert!(v["warm_ms_p50"].as_f64().unwrap_or(0.0) > 0.0, "{v}");
}

/// `meshless simulate distribution --json ARGS`.
fn distribution(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["simulate", "distribution", "--json"];
    all.extend_from_slice(args);
    meshless_json(&all)
}

/// `(total_events, total_bytes)` of the row `scheme` in `scenario`; panics
/// when the row is missing.
fn row(report: &serde_json::Value, scenario: &str, scheme: &str) -> (u64, u64) {
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
