//! Traces for meshless: the W3C `traceparent` header ([`context`]), span
//! records ([`span`]) and their export over OTLP/HTTP with the JSON
//! encoding ([`export`]) from a background task with a bounded queue, so
//! recording a span never blocks a request (a full queue drops and counts).

pub mod context;
pub mod export;
pub mod span;

pub use context::TraceParent;
pub use export::{TraceCounters, Tracer, TracingConfig};
pub use span::{Span, SpanKind};
