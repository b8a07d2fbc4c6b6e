//! Balancing through the proxy with real backends: a down endpoint's share
//! is spread over the live ones, and weights hold under concurrency.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use http::StatusCode;

/// Polls `/clusters` until the endpoint at `address` reports `healthy ==
/// want` (20 s deadline).
async fn wait_health(p: &meshless_proxy::Proxy, address: &str, want: bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, body) = admin(p, "/clusters").await;
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        let healthy = v
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|c| c["endpoints"].as_array().into_iter().flatten())
            .find(|e| e["address"] == address)
            .and_then(|e| e["healthy"].as_bool());
        if healthy == Some(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{address} never became healthy={want}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Five equal endpoints under round robin, one failing its health check:
/// each of the other four serves 25% ± 3%, and the failing one nothing.
/// (Their own turns are exact; the failing one's 20% is split by weighted
/// draws: with 2,000 requests each gets 100 ± 9 of those 400, so 3 points
/// are about 7 standard deviations.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_spreads_a_failed_endpoints_share_evenly() {
    let bs = backends(5).await;
    bs[4].set_failing(true);
    let extra = "    balancer: { policy: round_robin }\n    health_check: { path: /healthz, interval: 100ms, timeout: 1s, unhealthy_threshold: 1, healthy_threshold: 1 }\n";
    let (p, addr) = proxy(&config(&bs, extra)).await;
    wait_health(&p, &bs[4].local_addr().to_string(), false).await;
    let c = client();
    let total = 2_000u32;
    let mut seen: HashMap<String, u32> = HashMap::new();
    for _ in 0..total {
        let (s, b, _) = get(&c, addr, "/", &[]).await;
        assert_eq!(s, StatusCode::OK);
        *seen.entry(b).or_default() += 1;
    }
    eprintln!("round robin, b4 failing: {seen:?}");
    assert_eq!(
        seen.get("b4"),
        None,
        "the failing endpoint gets nothing: {seen:?}"
    );
    for i in 0..4 {
        let share = f64::from(seen.get(&format!("b{i}")).copied().unwrap_or(0)) / f64::from(total);
        assert!(
            (share - 0.25).abs() <= 0.03,
            "b{i} share {share:.3}: {seen:?}"
        );
    }
    p.shutdown().await;
}

/// Weights [4,1,1,1,1] under P2C with 32 concurrent clients: the heavy
/// endpoint serves 50% ± 5%. Each request takes 10 ms at the backend so
/// about 32 are in flight at the balancer, where P2C's loads settle in
/// proportion to weight (uniform draws capped it at 40%).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2c_honours_weights_under_concurrency() {
    let bs = backends(5).await;
    let eps = weighted_endpoints_yaml(&bs, &[4, 1, 1, 1, 1]);
    let extra = "    balancer: { policy: p2c }\n";
    let (p, addr) = proxy(&config_with_endpoints(&eps, extra)).await;
    let c = client();
    let per_client = 50;
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move {
                let mut seen: HashMap<String, u32> = HashMap::new();
                for _ in 0..per_client {
                    let (s, b, _) = get(&c, addr, "/?delay_ms=10", &[]).await;
                    assert_eq!(s, StatusCode::OK);
                    *seen.entry(b).or_default() += 1;
                }
                seen
            })
        })
        .collect();
    let mut seen: HashMap<String, u32> = HashMap::new();
    for t in tasks {
        for (b, n) in t.await.expect("client task") {
            *seen.entry(b).or_default() += n;
        }
    }
    let total: u32 = seen.values().sum();
    assert_eq!(total, 32 * per_client);
    eprintln!("p2c [4,1,1,1,1], 32 clients: {seen:?}");
    let heavy = f64::from(seen.get("b0").copied().unwrap_or(0)) / f64::from(total);
    assert!(
        (heavy - 0.5).abs() <= 0.05,
        "heavy share {heavy:.3}: {seen:?}"
    );
    p.shutdown().await;
}

/// The new balancing fields are checked with the file, field and reason.
#[tokio::test]
async fn panic_threshold_and_locality_mode_are_validated() {
    let bs = backends(2).await;
    let parse = |extra: &str| {
        meshless_proxy::ProxyConfig::parse(&config(&bs, extra), "p.yaml").map_err(|e| e.to_string())
    };
    let e = parse("    panic_threshold: 120\n").expect_err("over 100");
    assert!(e.contains("clusters[0].panic_threshold"), "{e}");
    let e = parse("    locality: { mode: local_only }\n").expect_err("no node name");
    assert!(e.contains("clusters[0].locality.mode"), "{e}");
    let e = parse("    locality: { mode: nearest }\n").expect_err("unknown mode");
    assert!(e.contains("locality"), "{e}");
    parse("    panic_threshold: 0\n    locality: { mode: proportional, min_cluster_size: 3 }\n")
        .expect("valid");
}
