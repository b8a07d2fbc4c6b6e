//! Trace context of a request: the proxy continues the client's W3C
//! `traceparent` (same trace id, a new span id: the proxy's span) or
//! starts a trace when there is none or it is invalid, and sends its own
//! span as the upstream's `traceparent`, whether tracing is on or not.
//! With `tracing:` set, each request records a server span, and a held
//! request ([`crate::request::activate`]) the phases of its cold start as
//! child spans.

use std::time::Instant;

use meshless_trace::{Span, SpanKind, TraceParent};

use crate::state::ProxyState;

/// The proxy's span of one request and the client's span above it.
#[derive(Debug, Clone, Copy)]
pub struct RequestTrace {
    /// The proxy's span: sent upstream as `traceparent`.
    pub context: TraceParent,
    /// The client's span id (0: the proxy started the trace).
    pub parent: u64,
}

impl RequestTrace {
    /// Continues `parent`'s trace, or (none) starts one.
    pub fn continuing(parent: Option<TraceParent>) -> Self {
        match parent {
            Some(p) => Self {
                context: p.child(),
                parent: p.span_id,
            },
            None => Self {
                context: TraceParent::random(),
                parent: 0,
            },
        }
    }

    /// Records a child span of the request's span, from `start` to `end`,
    /// when tracing is on.
    pub fn child(
        &self,
        state: &ProxyState,
        name: &'static str,
        start: Instant,
        end: Instant,
        attributes: &[(&'static str, &str)],
    ) {
        let Some(tracer) = &state.tracer else {
            return;
        };
        let mut span = Span::new(
            self.context.trace_id,
            self.context.span_id,
            name,
            start,
            end,
        );
        for (k, v) in attributes {
            span = span.with(k, *v);
        }
        tracer.record(span);
    }

    /// Records the request's own (server) span, when tracing is on.
    pub fn request(
        &self,
        state: &ProxyState,
        started: Instant,
        attributes: Vec<(&'static str, String)>,
    ) {
        let Some(tracer) = &state.tracer else {
            return;
        };
        let mut span = Span::new(
            self.context.trace_id,
            self.parent,
            "proxy request",
            started,
            Instant::now(),
        );
        span.span_id = self.context.span_id;
        span.kind = SpanKind::Server;
        span.attributes = attributes;
        tracer.record(span);
    }
}
