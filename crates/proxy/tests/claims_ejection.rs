//! The ejection cap at the proxy, stated from its definition (README,
//! after Envoy minus pitfalls #26877 and #17504): with N endpoints and
//! `max_ejection_percent` p, at most max(1, floor(N * p / 100)) endpoints
//! are ejected at once (one is always allowed in a cluster of two or
//! more), and never every endpoint. All endpoints fail here, for good, so
//! the cap is the only thing that stops more ejections: the count reaches
//! it exactly.

mod common;

use common::*;

async fn ejected(p: &meshless_proxy::Proxy) -> usize {
    admin(p, "/clusters")
        .await
        .1
        .matches("\"ejected\": true")
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ejections_stop_at_the_cap_when_every_endpoint_fails() {
    for (n, percent) in [(5usize, 50u32), (5, 10), (2, 100), (10, 30)] {
        let bs = backends(n).await;
        for b in &bs {
            b.set_failing(true);
        }
        let extra = format!(
            "    retries: {{ count: 0 }}\n    outlier_detection: {{ consecutive_5xx: 2, interval: 100ms, base_ejection_time: 300s, max_ejection_percent: {percent} }}\n"
        );
        let (p, addr) = proxy(&config(&bs, &extra)).await;
        let cap = (n * percent as usize / 100).max(1).min(n - 1);
        let c = client();
        // Enough failures for every endpoint to cross its threshold many times.
        for _ in 0..(n * 8) {
            get(&c, addr, "/", &[]).await;
        }
        eventually(&format!("n={n} p={percent}: {cap} ejected"), || async {
            ejected(&p).await == cap
        })
        .await;
        for _ in 0..(n * 8) {
            get(&c, addr, "/", &[]).await;
        }
        assert_eq!(
            ejected(&p).await,
            cap,
            "n={n} p={percent}: never above the cap"
        );
        p.shutdown().await;
    }
}
