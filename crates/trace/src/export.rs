//! The span exporter: [`Tracer::record`] puts a finished span in a bounded
//! queue without waiting (a full queue drops the span and counts it); a
//! background task takes batches of at most `max_batch` spans, at least
//! every `flush_interval`, and POSTs each as one OTLP/HTTP JSON request
//! to `otlp_endpoint`. A failed export is counted and its batch dropped
//! (no retry: spans must never hold memory without bound). The task ends,
//! after a last export, when every [`Tracer`] clone is dropped.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use prometheus_client::metrics::counter::Counter;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::span::{Span, export_request};

/// `tracing:` settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingConfig {
    /// OTLP/HTTP traces URL, e.g. `http://127.0.0.1:4318/v1/traces`.
    pub otlp_endpoint: String,
    /// The `service.name` resource attribute.
    #[serde(default = "default_service_name")]
    pub service_name: String,
    /// Spans waiting for export at most; past it, new spans are dropped.
    #[serde(default = "default_max_queued")]
    pub max_queued: usize,
    /// Spans per export request at most.
    #[serde(default = "default_max_batch")]
    pub max_batch: usize,
    /// A span waits at most this long for its batch.
    #[serde(
        default = "default_flush_interval",
        with = "meshless_model::serde_duration"
    )]
    pub flush_interval: Duration,
}

fn default_service_name() -> String {
    "meshless".into()
}
fn default_max_queued() -> usize {
    4096
}
fn default_max_batch() -> usize {
    512
}
fn default_flush_interval() -> Duration {
    Duration::from_secs(1)
}

impl TracingConfig {
    /// Why the settings cannot work, as (field, reason).
    pub fn check(&self) -> Result<http::Uri, (&'static str, String)> {
        let uri: http::Uri = self
            .otlp_endpoint
            .parse()
            .map_err(|e| ("otlp_endpoint", format!("{e}")))?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err(("otlp_endpoint", "must be an http:// URL (OTLP/HTTP)".into()));
        }
        if self.max_queued == 0 || self.max_batch == 0 || self.flush_interval.is_zero() {
            return Err((
                "max_queued",
                "max_queued, max_batch and flush_interval must be above zero".into(),
            ));
        }
        Ok(uri)
    }
}

/// Counters of the exporter (clones of registered metrics).
#[derive(Debug, Clone, Default)]
pub struct TraceCounters {
    /// Spans sent in a batch the receiver accepted.
    pub exported: Counter,
    /// Spans dropped because the queue was full.
    pub dropped: Counter,
    /// Spans in batches that failed to export.
    pub failed: Counter,
}

/// Records spans for export; cheap to clone.
#[derive(Debug, Clone)]
pub struct Tracer {
    tx: mpsc::Sender<Span>,
    counters: TraceCounters,
}

impl Tracer {
    /// Starts the export task (call within a Tokio runtime).
    pub fn start(config: &TracingConfig, counters: TraceCounters) -> Result<Self, String> {
        let uri = config.check().map_err(|(f, r)| format!("{f}: {r}"))?;
        let (tx, rx) = mpsc::channel(config.max_queued);
        let task = Export {
            uri,
            service: config.service_name.clone(),
            max_batch: config.max_batch,
            interval: config.flush_interval,
            counters: counters.clone(),
        };
        tokio::spawn(task.run(rx));
        Ok(Self { tx, counters })
    }

    /// Queues `span` for export; never waits. A full queue drops it.
    pub fn record(&self, span: Span) {
        if self.tx.try_send(span).is_err() {
            self.counters.dropped.inc();
        }
    }
}

struct Export {
    uri: http::Uri,
    service: String,
    max_batch: usize,
    interval: Duration,
    counters: TraceCounters,
}

impl Export {
    async fn run(self, mut rx: mpsc::Receiver<Span>) {
        let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
        let mut batch = Vec::with_capacity(self.max_batch);
        loop {
            // The first span of a batch, then what follows within the interval.
            let Some(first) = rx.recv().await else {
                return;
            };
            batch.push(first);
            let deadline = tokio::time::sleep(self.interval);
            tokio::pin!(deadline);
            let mut closed = false;
            while batch.len() < self.max_batch {
                tokio::select! {
                    s = rx.recv() => match s {
                        Some(s) => batch.push(s),
                        None => { closed = true; break; }
                    },
                    () = &mut deadline => break,
                }
            }
            self.send(&client, &batch).await;
            batch.clear();
            if closed {
                return;
            }
        }
    }

    async fn send(
        &self,
        client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
        batch: &[Span],
    ) {
        let body = export_request(&self.service, batch).to_string();
        let req = http::Request::post(self.uri.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)));
        let n = batch.len() as u64;
        let ok = match req {
            Ok(req) => {
                match tokio::time::timeout(Duration::from_secs(10), client.request(req)).await {
                    Ok(Ok(resp)) if resp.status().is_success() => true,
                    Ok(Ok(resp)) => {
                        tracing::warn!(status = %resp.status(), spans = n, "OTLP export refused");
                        false
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, spans = n, "OTLP export failed");
                        false
                    }
                    Err(_) => {
                        tracing::warn!(spans = n, "OTLP export timed out");
                        false
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "OTLP export request");
                false
            }
        };
        if ok {
            self.counters.exported.inc_by(n);
        } else {
            self.counters.failed.inc_by(n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(endpoint: &str) -> TracingConfig {
        TracingConfig {
            otlp_endpoint: endpoint.into(),
            service_name: "t".into(),
            max_queued: 2,
            max_batch: 512,
            flush_interval: Duration::from_secs(3600),
        }
    }

    #[test]
    fn settings_are_checked() {
        assert!(config("http://127.0.0.1:4318/v1/traces").check().is_ok());
        assert!(config("https://collector/v1/traces").check().is_err());
        assert!(config("not a url").check().is_err());
        let mut c = config("http://127.0.0.1:4318/v1/traces");
        c.max_queued = 0;
        assert!(c.check().is_err());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_full_queue_drops_and_counts_without_waiting() {
        // On a current-thread runtime the export task does not run while
        // this test does not yield: the queue of 2 fills.
        let counters = TraceCounters::default();
        let t = Tracer::start(&config("http://127.0.0.1:9/v1/traces"), counters.clone())
            .expect("tracer");
        let now = std::time::Instant::now();
        for _ in 0..5 {
            t.record(Span::new(1, 0, "s", now, now));
        }
        assert_eq!(counters.dropped.get(), 3);
    }
}
