//! The webhook scaler against a webhook that hangs: a call that is never
//! answered times out and is retried, and a newer desired count does not
//! wait for it; the service's scaling loop is never held up.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use meshless_control::config::ControlConfig;
use meshless_control::plane::ControlPlane;
use meshless_control::webhook::Webhook;
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The `desired` of each POST: the hung one first, then each answered one.
type Seen = Arc<Mutex<Vec<u64>>>;

fn desired(body: &[u8]) -> u64 {
    let v: serde_json::Value = serde_json::from_slice(body).expect("json body");
    v["desired"].as_u64().expect("desired")
}

/// Reads one request's body (Content-Length framing); `None` if the
/// connection ends first.
async fn read_body(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = s.read(&mut chunk).await.ok().filter(|n| *n > 0)?;
                buf.extend_from_slice(&chunk[..n]);
            }
            return Some(buf[end + 4..end + 4 + len].to_vec());
        }
        let n = s.read(&mut chunk).await.ok().filter(|n| *n > 0)?;
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// A webhook on 127.0.0.1:0 that reads its first connection's request and
/// never answers it (nor closes it); it answers every later one 200.
async fn hanging_webhook() -> (SocketAddr, Seen, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen: Seen = Arc::default();
    let hung_at: Seen = Arc::default();
    let log = Arc::clone(&seen);
    let hung_log = Arc::clone(&hung_at);
    tokio::spawn(async move {
        let mut hung = Vec::new();
        while let Ok((mut s, _)) = listener.accept().await {
            if hung.is_empty() {
                if let Some(body) = read_body(&mut s).await {
                    hung_log.lock().expect("log").push(desired(&body));
                }
                hung.push(s);
                continue;
            }
            let log = Arc::clone(&log);
            tokio::spawn(async move {
                while let Some(body) = read_body(&mut s).await {
                    log.lock().expect("log").push(desired(&body));
                    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                    if s.write_all(ok).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, seen, hung_at)
}

async fn eventually(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_never_answered_times_out_and_is_retried() {
    let (hook, seen, _) = hanging_webhook().await;
    let yaml = format!(
        "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\nservices:\n  - namespace: demo\n    name: hooked\n    autoscaling:\n      min_instances: 1\n      max_instances: 2\n      tick: 100ms\n      scaler:\n        webhook:\n          url: \"http://{hook}/scale\"\n          timeout: 300ms\n"
    );
    let config = ControlConfig::parse(&yaml, "control.yaml").expect("config");
    let plane = ControlPlane::start(config).await.expect("plane");
    // The first call (desired 1) hangs; its retry is answered.
    eventually("the webhook is told desired 1", || {
        seen.lock().expect("seen").contains(&1)
    })
    .await;
    assert!(plane.state.metrics.webhook_failures.get() >= 1);
    plane.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_count_does_not_wait_for_a_hung_call() {
    let (hook, seen, hung) = hanging_webhook().await;
    let failures = Counter::default();
    // A timeout far beyond the test's deadline: only abandoning the hung
    // call lets the new count through.
    let webhook = Webhook::start(
        "demo/hooked".into(),
        format!("http://{hook}/scale"),
        Duration::from_secs(3600),
        Duration::from_millis(100),
        failures.clone(),
    );
    webhook.set(0);
    eventually("the call for desired 0 hangs", || {
        !hung.lock().expect("hung").is_empty()
    })
    .await;
    // Asked again while it hangs: still the same count, no new call.
    webhook.set(0);
    webhook.set(1);
    eventually("the webhook is told desired 1", || {
        seen.lock().expect("seen").contains(&1)
    })
    .await;
    assert_eq!(*hung.lock().expect("hung"), vec![0]);
    assert_eq!(*seen.lock().expect("seen"), vec![1], "no second call for 0");
    assert_eq!(failures.get(), 0, "abandoned, not failed");
}
