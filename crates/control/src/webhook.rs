//! The webhook scaler: POSTs `{"service": ..., "desired": N}` to a URL
//! whenever the desired count changes. The calls run in their own task, so
//! a slow or hung webhook never holds up the service's scaling loop: each
//! call is bounded by a timeout (connect and answer), a failed call is
//! retried, and a newer desired count abandons the call in progress (the
//! newest count wins).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;

/// The default bound on one webhook call, connect included.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The scaling loop's handle on the webhook task; the task ends when this
/// is dropped.
#[derive(Debug)]
pub struct Webhook {
    desired: watch::Sender<Option<u32>>,
}

impl Webhook {
    /// Starts the task for `service`. `retry`: the wait after a failed
    /// call; `failures` counts failed calls (refused, unreachable, timed
    /// out). Call within a Tokio runtime.
    pub fn start(
        service: String,
        url: String,
        timeout: Duration,
        retry: Duration,
        failures: Counter,
    ) -> Self {
        let (desired, rx) = watch::channel(None);
        let call = Call {
            http: Client::builder(TokioExecutor::new()).build_http(),
            service,
            url,
            timeout,
        };
        tokio::spawn(run(call, retry, failures, rx));
        Self { desired }
    }

    /// Asks for `n` instances; a no-op when that is already asked.
    pub fn set(&self, n: u32) {
        self.desired.send_if_modified(|d| {
            let changed = *d != Some(n);
            *d = Some(n);
            changed
        });
    }
}

/// One webhook endpoint.
struct Call {
    http: Client<HttpConnector, Full<Bytes>>,
    service: String,
    url: String,
    timeout: Duration,
}

impl Call {
    /// POSTs `desired`; true when the webhook answered 2xx in time.
    async fn post(&self, desired: u32) -> bool {
        let service = self.service.as_str();
        let body = serde_json::json!({ "service": service, "desired": desired }).to_string();
        let req = match http::Request::post(self.url.as_str())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
        {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(service, error = %e, "scaler webhook url");
                return false;
            }
        };
        match tokio::time::timeout(self.timeout, self.http.request(req)).await {
            Ok(Ok(r)) if r.status().is_success() => true,
            Ok(Ok(r)) => {
                tracing::warn!(service, status = %r.status(), desired, "scaler webhook refused");
                false
            }
            Ok(Err(e)) => {
                tracing::warn!(service, error = %e, desired, "scaler webhook unreachable");
                false
            }
            Err(_) => {
                tracing::warn!(service, timeout = ?self.timeout, desired, "scaler webhook did not answer in time");
                false
            }
        }
    }
}

/// Until the handle is dropped: tells the webhook each new desired count,
/// retrying failed calls every `retry`.
async fn run(call: Call, retry: Duration, failures: Counter, mut rx: watch::Receiver<Option<u32>>) {
    // The last count the webhook acknowledged.
    let mut told: Option<u32> = None;
    loop {
        let want = *rx.borrow_and_update();
        if let Some(n) = want.filter(|n| told != Some(*n)) {
            tokio::select! {
                ok = call.post(n) => {
                    if ok {
                        told = Some(n);
                        continue;
                    }
                    failures.inc();
                    tokio::select! {
                        () = tokio::time::sleep(retry) => continue,
                        r = rx.changed() => if r.is_err() { return },
                    }
                    continue;
                }
                // A newer count: the call in progress is abandoned.
                r = rx.changed() => if r.is_err() { return },
            }
            continue;
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}
