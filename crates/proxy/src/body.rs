//! The response body sent downstream. It holds the request's in-flight
//! guard and bookkeeping until the body ends, so load counts until the last
//! byte and the access log sees the bytes sent.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use meshless_balance::{InFlight, Outcome};
use pin_project_lite::pin_project;

use crate::access_log::AccessRecord;
use crate::metrics::{RequestLabels, RouteLabels};
use crate::state::ProxyState;
use crate::upstream::UpstreamBody;

/// Lowers a cluster's active-request count when dropped.
#[derive(Debug)]
pub struct ActiveGuard(pub Arc<crate::upstream::ClusterCounters>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0
            .active_requests
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// What is recorded when a request ends.
#[derive(Debug)]
pub struct Completion {
    pub state: Arc<ProxyState>,
    pub listener: Arc<str>,
    pub route: Arc<str>,
    pub cluster: Arc<str>,
    pub endpoint: Arc<str>,
    pub method: http::Method,
    pub path: String,
    pub status: u16,
    pub request_id: String,
    pub attempts: u32,
    pub started: Instant,
    pub guard: Option<InFlight>,
    pub active: Option<ActiveGuard>,
}

impl Completion {
    fn finish(mut self, bytes: u64, broken: bool) {
        if let Some(mut g) = self.guard.take() {
            if broken {
                g.set_outcome(Outcome::Reset);
            }
            drop(g);
        }
        drop(self.active.take());
        let elapsed = self.started.elapsed();
        let metrics = &self.state.metrics;
        let class = if broken {
            "reset"
        } else {
            match self.status / 100 {
                1 => "1xx",
                2 => "2xx",
                3 => "3xx",
                4 => "4xx",
                _ => "5xx",
            }
        };
        metrics
            .requests
            .get_or_create(&RequestLabels {
                listener: Arc::clone(&self.listener),
                cluster: Arc::clone(&self.cluster),
                endpoint: Arc::clone(&self.endpoint),
                class,
            })
            .inc();
        metrics
            .request_duration
            .get_or_create(&RouteLabels {
                listener: Arc::clone(&self.listener),
                cluster: Arc::clone(&self.cluster),
            })
            .observe(elapsed.as_secs_f64());
        let logger = self.state.access_log.load();
        if logger.enabled() {
            logger.log(&AccessRecord {
                time: humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
                listener: &self.listener,
                route: &self.route,
                cluster: &self.cluster,
                endpoint: &self.endpoint,
                method: self.method.as_str(),
                path: &self.path,
                status: self.status,
                bytes,
                duration_ms: elapsed.as_secs_f64() * 1000.0,
                request_id: &self.request_id,
                attempts: self.attempts,
            });
        }
    }
}

pin_project! {
    /// A downstream response body with its completion bookkeeping.
    pub struct ProxyBody {
        #[pin]
        inner: UpstreamBody,
        completion: Option<Completion>,
        bytes: u64,
    }

    impl PinnedDrop for ProxyBody {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(c) = this.completion.take() {
                c.finish(*this.bytes, false);
            }
        }
    }
}

impl std::fmt::Debug for ProxyBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyBody")
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl ProxyBody {
    /// Wraps an upstream (or local) body.
    pub fn new(inner: UpstreamBody, completion: Option<Completion>) -> Self {
        Self {
            inner,
            completion,
            bytes: 0,
        }
    }

    /// A complete body from bytes.
    pub fn full(bytes: impl Into<Bytes>, completion: Option<Completion>) -> Self {
        Self::new(
            Full::new(bytes.into())
                .map_err(|never| match never {})
                .boxed(),
            completion,
        )
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(d) = frame.data_ref() {
                    *this.bytes += d.len() as u64;
                }
            }
            Poll::Ready(Some(Err(_))) => {
                if let Some(c) = this.completion.take() {
                    c.finish(*this.bytes, true);
                }
            }
            Poll::Ready(None) => {
                if let Some(c) = this.completion.take() {
                    c.finish(*this.bytes, false);
                }
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
