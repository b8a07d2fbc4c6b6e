//! Upstream faults in the middle of an exchange: a response body cut by a
//! reset, and an HTTP/2 upstream that sends GOAWAY with streams open.

mod common;

use bytes::Bytes;
use common::*;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};

fn one_cluster(endpoint: std::net::SocketAddr, extra: &str) -> String {
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: c }}]\nclusters:\n  - name: c\n    endpoints: [{{ address: \"{endpoint}\" }}]\n{extra}"
    )
}

/// Failures the proxy recorded for the only endpoint of cluster `c`.
async fn endpoint_failures(p: &meshless_proxy::Proxy) -> u64 {
    let (_, body) = admin(p, "/clusters").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let clusters = v.as_array().cloned().unwrap_or_default();
    clusters
        .iter()
        .filter(|c| c["name"] == "c")
        .flat_map(|c| c["endpoints"].as_array().cloned().unwrap_or_default())
        .filter_map(|e| e["failures"].as_u64())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_cut_mid_way_is_an_error_downstream_and_the_endpoints_fault() {
    // Promises 1,000 bytes, sends 10, closes.
    let up = raw_upstream(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n0123456789").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("access.log");
    let yaml = format!(
        "access_log: \"{}\"\n{}",
        log.display(),
        one_cluster(up, "    retries: { count: 0 }\n")
    );
    let (p, addr) = proxy(&yaml).await;
    for c in [client(), h2_client()] {
        let req = Request::get(format!("http://{addr}/"))
            .body(Full::new(Bytes::new()))
            .expect("request");
        // The head may already be out (then the body fails), or the
        // connection closes before it; never a complete-looking response.
        let Ok(resp) = c.request(req).await else {
            continue;
        };
        assert_eq!(resp.status(), StatusCode::OK, "headers were already sent");
        let body = resp.into_body().collect().await;
        assert!(
            body.is_err(),
            "a truncated body must not look complete: {:?}",
            body.map(|b| b.to_bytes().len())
        );
    }
    eventually("the cut counted against the endpoint", || async {
        endpoint_failures(&p).await >= 2
    })
    .await;
    // Logged as cut by the upstream, with the status that was sent: not
    // as a complete 200, nor as the client's abort.
    let lines = || std::fs::read_to_string(&log).unwrap_or_default();
    eventually("both requests logged", || async {
        lines().lines().count() == 2
    })
    .await;
    for line in lines().lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        assert_eq!(v["cut"], "reset", "{line}");
        assert_eq!(v["status"], 200, "{line}");
        assert!(v.get("fault").is_none(), "{line}");
    }
    let (_, metrics) = admin(&p, "/metrics").await;
    assert!(metrics.contains("class=\"reset\""), "{metrics}");
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_goaway_from_an_upstream_finishes_open_streams_and_moves_new_ones() {
    let up = Gated::start("g").await;
    let (p, addr) = proxy(&one_cluster(
        up.local_addr(),
        // A stream that races the GOAWAY is refused unprocessed (RFC 9113
        // 6.8) and safe to retry: with no retry on `reset` it would be a 502.
        "    upstream_protocol: http2\n    retries: { count: 1, on: [connect_failure, reset] }\n",
    ))
    .await;
    let first = tokio::spawn(async move { get(&client(), addr, "/first", &[]).await });
    eventually("the first stream held", || async { up.held() == 1 }).await;
    // The upstream says GOAWAY: its open stream finishes, no new stream
    // may start on that connection.
    up.goaway();
    let second = tokio::spawn(async move { get(&client(), addr, "/second", &[]).await });
    eventually("the second stream held on a new connection", || async {
        up.held() == 2
    })
    .await;
    up.open();
    for (name, t) in [("first", first), ("second", second)] {
        let (s, b, body) = t.await.expect("task");
        assert_eq!((s, b.as_str()), (StatusCode::OK, "g"), "{name}: {body}");
    }
    // Later requests: the closed connection is not reused.
    for i in 0..5 {
        let (s, _, body) = get(&client(), addr, "/", &[]).await;
        assert_eq!(s, StatusCode::OK, "request {i} after GOAWAY: {body}");
    }
    p.shutdown().await;
}
