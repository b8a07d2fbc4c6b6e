//! The response body sent downstream. It holds the request's in-flight
//! guard and bookkeeping until the body ends, so load counts until the last
//! byte and the access log sees the bytes sent.

use std::future::Future;
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
use crate::request::admit::Slot;
use crate::request::downstream::ClientFault;
use crate::state::ProxyState;
use crate::upstream::{Lease, UpstreamBody};

/// How the exchange ended, as far as the downstream response goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Not (yet) finished: if the record is dropped like this, the client
    /// went away first (`client_abort`).
    Aborted,
    /// The last response byte was handed to the connection.
    Complete,
    /// The response body broke mid-way.
    Broken,
    /// The cluster's request timeout ended the exchange mid-body.
    TimedOut,
}

/// The error that cuts a response body at the request deadline.
#[derive(Debug, thiserror::Error)]
#[error("request timeout: the exchange did not finish in time")]
pub struct RequestTimeout;

/// Errors of a downstream response body.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// What is recorded when a request ends. Recorded on drop, so a request
/// dropped at any `.await` is still counted and logged (`client_abort`),
/// and the guards it holds are given back.
#[derive(Debug)]
pub struct Completion {
    pub state: Arc<ProxyState>,
    pub listener: Arc<str>,
    pub route: Arc<str>,
    pub cluster: Arc<str>,
    pub endpoint: Arc<str>,
    /// The metric series of the endpoint last tried, held to the end so
    /// they outlive the request even when the endpoint left meanwhile.
    pub series: Option<Arc<crate::endpoint_series::EndpointSeries>>,
    pub method: http::Method,
    /// The target as received (its path is logged); shares the bytes.
    pub uri: http::Uri,
    /// The status sent downstream; 0 before one is.
    pub status: u16,
    pub request_id: crate::request::headers::RequestId,
    pub attempts: u32,
    pub started: Instant,
    /// The endpoint's in-flight guard, until the response body ends.
    pub guard: Option<InFlight>,
    /// The cluster's `max_requests` slot, until the response body ends.
    pub active: Option<Slot>,
    /// The upstream connection, until the response body ends (then it
    /// goes back to its pool).
    pub upstream: Option<Lease>,
    /// Counted as forwarded to a peer proxy (ahead-of-time placement),
    /// until the response body ends.
    pub forwarded: Option<Slot>,
    /// Set when the client's request body failed.
    pub fault: ClientFault,
    /// The client's IP address, for the access log.
    pub client: Option<std::net::IpAddr>,
    pub end: End,
    /// Response body bytes sent.
    pub bytes: u64,
    /// When the whole exchange must be over (the cluster's
    /// `timeouts.request`, or a gRPC call's `grpc-timeout`); `None` = never.
    pub deadline: Option<Instant>,
    /// The request is gRPC: local replies and a deadline cut answer with a
    /// `grpc-status`, and the one in the response's trailers is the outcome.
    pub grpc: bool,
    /// A gRPC response whose `grpc-status` has not come yet (none in its
    /// headers): if its stream ends without one in trailers either, the
    /// call failed (gRPC clients see INTERNAL), and is recorded so.
    pub grpc_status_due: bool,
    /// The gRPC call's `grpc-status`, once known (the access log's field).
    pub grpc_code: Option<u32>,
    /// The request's trace context (always; spans only with `tracing:`).
    pub trace: crate::request::trace::RequestTrace,
    /// Wakes a held request when this one ends (dropped after `guard`).
    pub capacity: Option<crate::request::activate::CapacityNotice>,
    /// The `proxy_request_duration_seconds` series of `listener` and
    /// `cluster`, once the cluster is known (else it is looked up).
    pub duration: Option<prometheus_client::metrics::histogram::Histogram>,
}

impl Completion {
    /// The record of a request just received on `listener`, whose map
    /// carries what `carried` says (the fields it lacks not looked up).
    /// Boxed: the record travels with the request and then its response
    /// (about 500 bytes), through every layer that moves them; a box
    /// moves as a pointer. Written into a box taken first (`Box::write`),
    /// which lets the compiler build it there rather than copy it in.
    pub fn new(
        state: Arc<ProxyState>,
        listener: Arc<str>,
        parts: &http::request::Parts,
        carried: crate::request::headers::Carried,
    ) -> Box<Self> {
        use crate::request::headers::{RequestId, request_id};
        use crate::request::trace::RequestTrace;
        use meshless_trace::TraceParent;
        let boxed = Box::new_uninit();
        Box::write(
            boxed,
            Self {
                state,
                listener,
                route: unknown(),
                cluster: unknown(),
                endpoint: unknown(),
                series: None,
                method: parts.method.clone(),
                uri: parts.uri.clone(),
                status: 0,
                request_id: if carried.request_id {
                    request_id(&parts.headers)
                } else {
                    RequestId::random()
                },
                attempts: 0,
                started: Instant::now(),
                guard: None,
                active: None,
                upstream: None,
                forwarded: None,
                fault: ClientFault::default(),
                client: None,
                end: End::Aborted,
                bytes: 0,
                deadline: None,
                grpc: crate::request::grpc::is_grpc(&parts.headers),
                grpc_status_due: false,
                grpc_code: None,
                trace: RequestTrace::continuing(
                    carried
                        .traceparent
                        .then(|| TraceParent::from_headers(&parts.headers))
                        .flatten(),
                ),
                capacity: None,
                duration: None,
            },
        )
    }

    /// Takes a gRPC response's `grpc-status` (from its trailers, or headers
    /// of a trailers-only answer) as the outcome: the endpoint's (so
    /// outlier detection sees UNAVAILABLE as a 503) and the status recorded.
    pub fn grpc_outcome(&mut self, headers: &http::HeaderMap) {
        use crate::request::grpc;
        // Not a lookup on every response: only a gRPC call's counts.
        let Some(code) = Some(headers).filter(|_| self.grpc).and_then(grpc::status) else {
            return;
        };
        self.grpc_status_due = false;
        self.set_grpc_code(code);
    }

    /// The outcome of a gRPC call answered with `code`.
    fn set_grpc_code(&mut self, code: u32) {
        self.grpc_code = Some(code);
        self.status = crate::request::grpc::http_status(code);
        if let Some(g) = self.guard.as_mut() {
            g.set_outcome(Outcome::Status(self.status));
        }
    }

    /// Notes a gRPC response head: without `grpc-status` (not a
    /// trailers-only answer), the status is due in its trailers.
    pub fn grpc_response(&mut self, status: http::StatusCode, headers: &http::HeaderMap) {
        use crate::request::grpc;
        self.grpc_status_due = self.grpc
            && status == http::StatusCode::OK
            && grpc::is_grpc(headers)
            && grpc::status(headers).is_none();
    }

    /// `client_abort` (the client left first), `client_error` (its body
    /// was broken), or nothing.
    pub fn client_fault(&self) -> Option<&'static str> {
        // A body that broke the protocol is the client's error even when
        // the exchange then ended as an abort (HTTP/2 resets the stream).
        if self.fault.is_malformed() {
            Some("client_error")
        } else if self.end == End::Aborted {
            Some("client_abort")
        } else if self.fault.is_set() {
            Some("client_error")
        } else {
            None
        }
    }

    /// `reset` (the upstream broke the response off) or `timeout` (the
    /// deadline cut it), when the client is not at fault; else nothing.
    pub fn cut(&self) -> Option<&'static str> {
        match self.end {
            _ if self.client_fault().is_some() => None,
            End::Broken => Some("reset"),
            End::TimedOut => Some("timeout"),
            End::Aborted | End::Complete => None,
        }
    }

    /// The `class` label of `proxy_requests`.
    fn class(&self) -> &'static str {
        if let Some(f) = self.client_fault().or_else(|| self.cut()) {
            return f;
        }
        match self.status / 100 {
            1 => "1xx",
            2 => "2xx",
            3 => "3xx",
            4 => "4xx",
            _ => "5xx",
        }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if self.end == End::Complete && self.grpc_status_due {
            // The stream ended without a `grpc-status`: the call failed
            // (gRPC clients report INTERNAL), the endpoint's fault.
            self.set_grpc_code(crate::request::grpc::code::INTERNAL);
        }
        if let Some(mut g) = self.guard.take() {
            // A body broken by the upstream is the endpoint's; one broken
            // because the client's side broke is not, and neither is one
            // cut by the deadline (a slow client stalls the endpoint too).
            match self.end {
                End::Broken if !self.fault.is_set() => g.set_outcome(Outcome::Reset),
                End::Broken | End::TimedOut => g.set_outcome(Outcome::Cancelled),
                End::Aborted | End::Complete => {}
            }
            drop(g);
        }
        drop(self.active.take());
        let elapsed = self.started.elapsed();
        if self.state.tracer.is_some() {
            let attributes = vec![
                ("http.request.method", self.method.to_string()),
                ("url.path", self.uri.path().to_owned()),
                ("http.response.status_code", self.status.to_string()),
                ("meshless.cluster", self.cluster.to_string()),
                ("meshless.endpoint", self.endpoint.to_string()),
                ("meshless.request_id", self.request_id.as_str().to_owned()),
            ];
            self.trace.request(&self.state, self.started, attributes);
        }
        let metrics = &self.state.metrics;
        match &self.series {
            // Series of an endpoint only through its handle (removed with it).
            Some(s) if *s.endpoint() == self.endpoint && *s.cluster() == self.cluster => {
                s.request(&self.listener, self.class());
            }
            _ => {
                metrics
                    .requests
                    .get_or_create(&RequestLabels {
                        listener: Arc::clone(&self.listener),
                        cluster: Arc::clone(&self.cluster),
                        endpoint: Arc::clone(&self.endpoint),
                        class: self.class(),
                    })
                    .inc();
            }
        }
        match &self.duration {
            Some(series) => series.observe(elapsed.as_secs_f64()),
            None => metrics
                .request_duration
                .get_or_create(&RouteLabels {
                    listener: Arc::clone(&self.listener),
                    cluster: Arc::clone(&self.cluster),
                })
                .observe(elapsed.as_secs_f64()),
        }
        let logger = self.state.access_log.load();
        if logger.enabled() {
            let client = self
                .client
                .map_or_else(|| "-".to_owned(), |ip| ip.to_string());
            let record = AccessRecord {
                client: &client,
                time: crate::access_log::now(),
                listener: &self.listener,
                route: &self.route,
                cluster: &self.cluster,
                endpoint: &self.endpoint,
                method: self.method.as_str(),
                path: self.uri.path(),
                status: self.status,
                bytes: self.bytes,
                duration_ms: elapsed.as_secs_f64() * 1000.0,
                request_id: self.request_id.as_str(),
                attempts: self.attempts,
                fault: self.client_fault(),
                cut: self.cut(),
                grpc_status: self.grpc_code,
            };
            logger.log(&record, &metrics.access_log_dropped);
        }
    }
}

/// The label of a field not known (yet) for a request.
fn unknown() -> Arc<str> {
    static UNKNOWN: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from("-"));
    Arc::clone(&UNKNOWN)
}

pin_project! {
    /// A downstream response body with its completion bookkeeping.
    pub struct ProxyBody {
        #[pin]
        inner: UpstreamBody,
        completion: Option<Box<Completion>>,
        bytes: u64,
        // The timer is made (and registered) only when the body first has
        // to wait: a body that is ready at once costs no timer.
        deadline: Option<Instant>,
        timer: Option<Pin<Box<tokio::time::Sleep>>>,
        // Ended by the proxy (a gRPC deadline's trailers were sent).
        cut: bool,
    }

    impl PinnedDrop for ProxyBody {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(mut c) = this.completion.take() {
                // Dropped unread but complete (a HEAD, an empty body) is
                // not an abort.
                if this.inner.is_end_stream() || c.method == http::Method::HEAD {
                    c.end = End::Complete;
                }
                c.bytes = *this.bytes;
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
    /// The body is cut at the record's deadline, if it has one.
    pub fn new(inner: UpstreamBody, completion: Option<Box<Completion>>) -> Self {
        let deadline = completion.as_ref().and_then(|c| c.deadline);
        Self {
            inner,
            completion,
            bytes: 0,
            deadline,
            timer: None,
            cut: false,
        }
    }

    /// The request's record, taken out: the body no longer completes it
    /// (a response replaced by another before any byte of it was sent).
    pub fn take_completion(&mut self) -> Option<Box<Completion>> {
        self.completion.take()
    }

    /// A complete body from bytes.
    pub fn full(bytes: impl Into<Bytes>, completion: Option<Box<Completion>>) -> Self {
        Self::new(
            Full::new(bytes.into())
                .map_err(|never| match never {})
                .boxed(),
            completion,
        )
    }
}

/// Polls the body's deadline timer (made on first use): the error that
/// cuts the body once `deadline` has passed (then cleared), else `None`
/// (the timer is registered with `cx`).
fn deadline_passed(
    deadline: &mut Option<Instant>,
    timer: &mut Option<Pin<Box<tokio::time::Sleep>>>,
    cx: &mut Context<'_>,
) -> Option<BodyError> {
    let at = (*deadline)?;
    let timer = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at.into())));
    if timer.as_mut().poll(cx).is_pending() {
        return None;
    }
    *deadline = None;
    Some(Box::new(RequestTimeout))
}

impl ProxyBody {
    /// For a writer that cannot write (the client reads nothing): `Ready`
    /// with the error that ends the response once the request's deadline
    /// (`timeouts.request`) has passed — recorded as timed out, like a cut
    /// in [`Body::poll_frame`] — else `Pending` with the timer registered.
    /// A client that stops reading thus cannot hold the exchange, its
    /// upstream connection and its endpoint's load past the deadline.
    pub fn poll_deadline(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<BodyError> {
        let this = self.project();
        if *this.cut || this.completion.is_none() {
            return Poll::Pending;
        }
        let Some(cut) = deadline_passed(this.deadline, this.timer, cx) else {
            return Poll::Pending;
        };
        if let Some(mut c) = this.completion.take() {
            c.end = End::TimedOut;
            c.bytes = *this.bytes;
        }
        *this.cut = true;
        Poll::Ready(cut)
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.project();
        if *this.cut {
            return Poll::Ready(None);
        }
        let polled = this.inner.poll_frame(cx).map_err(BodyError::from);
        if polled.is_pending()
            && let Some(cut) = deadline_passed(this.deadline, this.timer, cx)
            && let Some(mut c) = this.completion.take()
        {
            c.end = End::TimedOut;
            c.bytes = *this.bytes;
            if c.grpc {
                // A gRPC client is told DEADLINE_EXCEEDED in trailers.
                *this.cut = true;
                let code = crate::request::grpc::code::DEADLINE_EXCEEDED;
                c.grpc_code = Some(code);
                c.status = crate::request::grpc::http_status(code);
                let t = crate::request::grpc::status_headers(code, "request timeout");
                return Poll::Ready(Some(Ok(Frame::trailers(t))));
            }
            return Poll::Ready(Some(Err(cut)));
        }
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(d) = frame.data_ref() {
                    *this.bytes += d.len() as u64;
                } else if let (Some(t), Some(c)) = (frame.trailers_ref(), this.completion.as_mut())
                {
                    c.grpc_outcome(t);
                }
            }
            Poll::Ready(Some(Err(_))) => {
                if let Some(mut c) = this.completion.take() {
                    c.end = End::Broken;
                    c.bytes = *this.bytes;
                }
            }
            Poll::Ready(None) => {
                if let Some(mut c) = this.completion.take() {
                    c.end = End::Complete;
                    c.bytes = *this.bytes;
                }
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.cut || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
