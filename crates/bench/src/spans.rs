//! An in-process OTLP/HTTP (JSON) receiver for the benchmarks: the proxy
//! under test exports its spans here, and the benchmark reports how long
//! each phase of a cold start took.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde_json::Value;

use crate::{BenchError, percentile};

/// Durations (ms) of spans by name, as received.
#[derive(Debug, Clone, Default)]
pub struct Receiver {
    spans: Arc<Mutex<Spans>>,
}

/// What the receiver kept.
#[derive(Debug, Default)]
struct Spans {
    /// Every span but [`REQUEST`], by name.
    by_name: BTreeMap<String, Vec<f64>>,
    /// [`REQUEST`] spans: trace id and duration.
    requests: Vec<(String, f64)>,
    /// Traces with an `activation.*` span: the held (cold) requests.
    held: std::collections::HashSet<String>,
}

/// The span of a whole proxied request.
const REQUEST: &str = "proxy request";

impl Spans {
    /// The durations of the spans named `name` (`None`: none received);
    /// of [`REQUEST`], those of held requests only (a benchmark's warm
    /// requests are left out).
    fn durations(&self, name: &str) -> Option<Vec<f64>> {
        if name != REQUEST {
            return self.by_name.get(name).cloned();
        }
        let held: Vec<f64> = self
            .requests
            .iter()
            .filter(|(trace, _)| self.held.contains(trace))
            .map(|(_, ms)| *ms)
            .collect();
        (!held.is_empty()).then_some(held)
    }
}

/// One phase's durations (milliseconds).
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    pub name: String,
    pub count: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

fn record(spans: &Mutex<Spans>, body: &[u8]) {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    let nanos = |s: &Value, f: &str| s[f].as_str().and_then(|t| t.parse::<u128>().ok());
    let mut spans = spans.lock().unwrap_or_else(PoisonError::into_inner);
    for rs in v["resourceSpans"].as_array().into_iter().flatten() {
        for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
            for s in ss["spans"].as_array().into_iter().flatten() {
                let (Some(a), Some(b), Some(name)) = (
                    nanos(s, "startTimeUnixNano"),
                    nanos(s, "endTimeUnixNano"),
                    s["name"].as_str(),
                ) else {
                    continue;
                };
                let ms = b.saturating_sub(a) as f64 / 1e6;
                let trace = s["traceId"].as_str().unwrap_or_default().to_owned();
                if name == REQUEST {
                    spans.requests.push((trace, ms));
                    continue;
                }
                if name.starts_with("activation.") {
                    spans.held.insert(trace);
                }
                spans.by_name.entry(name.to_owned()).or_default().push(ms);
            }
        }
    }
}

impl Receiver {
    /// Listens on 127.0.0.1:0; returns the receiver and its traces URL.
    pub async fn start() -> Result<(Self, String), BenchError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(BenchError::io("binding the OTLP receiver"))?;
        let addr: SocketAddr = listener
            .local_addr()
            .map_err(BenchError::io("binding the OTLP receiver"))?;
        let me = Self::default();
        let spans = Arc::clone(&me.spans);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let spans = Arc::clone(&spans);
                tokio::spawn(async move {
                    let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let spans = Arc::clone(&spans);
                        async move {
                            if let Ok(body) = req.into_body().collect().await {
                                record(&spans, &body.to_bytes());
                            }
                            Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                                bytes::Bytes::from_static(b"{}"),
                            )))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok((me, format!("http://{addr}/v1/traces")))
    }

    /// Spans received named `name` (for `proxy request`: of held
    /// requests only).
    pub fn count(&self, name: &str) -> usize {
        let spans = self.spans.lock().unwrap_or_else(PoisonError::into_inner);
        spans.durations(name).map_or(0, |v| v.len())
    }

    /// Each phase's p50 and p99, in `order` (names not received are left out).
    pub fn phases(&self, order: &[&str]) -> Vec<Phase> {
        let spans = self.spans.lock().unwrap_or_else(PoisonError::into_inner);
        order
            .iter()
            .filter_map(|name| {
                let mut v = spans.durations(name)?;
                v.sort_by(f64::total_cmp);
                Some(Phase {
                    name: (*name).to_owned(),
                    count: v.len(),
                    p50_ms: percentile(&v, 0.5),
                    p99_ms: percentile(&v, 0.99),
                })
            })
            .collect()
    }
}
