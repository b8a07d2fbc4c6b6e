//! A finished span and its OTLP JSON encoding
//! (<https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding>:
//! ids as lowercase hex, enums as integers, 64-bit integers as strings).

use std::borrow::Cow;
use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

/// OTLP `SpanKind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    Internal = 1,
    Server = 2,
    Client = 3,
}

/// One finished span.
#[derive(Debug, Clone)]
pub struct Span {
    pub trace_id: u128,
    pub span_id: u64,
    /// The parent span's id (0: a root span).
    pub parent: u64,
    pub name: Cow<'static, str>,
    pub kind: SpanKind,
    pub start: SystemTime,
    pub end: SystemTime,
    pub attributes: Vec<(&'static str, String)>,
}

/// The wall-clock time of `at`, from one anchor taken once per process:
/// spans keep the order of their `Instant`s exactly (the wall clock may
/// drift from the anchor over a long run; spans are short).
pub fn wall(at: Instant) -> SystemTime {
    static ANCHOR: OnceLock<(Instant, SystemTime)> = OnceLock::new();
    let (mono, sys) = *ANCHOR.get_or_init(|| (Instant::now(), SystemTime::now()));
    match at.checked_duration_since(mono) {
        Some(after) => sys + after,
        None => sys.checked_sub(mono - at).unwrap_or(UNIX_EPOCH),
    }
}

fn nanos(t: SystemTime) -> String {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
        .to_string()
}

impl Span {
    /// A span of `trace_id` under `parent`, from `start` to `end`, with a
    /// new span id.
    pub fn new(
        trace_id: u128,
        parent: u64,
        name: &'static str,
        start: Instant,
        end: Instant,
    ) -> Self {
        Self {
            trace_id,
            span_id: fastrand::u64(1..),
            parent,
            name: Cow::Borrowed(name),
            kind: SpanKind::Internal,
            start: wall(start),
            end: wall(end),
            attributes: Vec::new(),
        }
    }

    /// Adds an attribute.
    pub fn with(mut self, key: &'static str, value: impl Into<String>) -> Self {
        self.attributes.push((key, value.into()));
        self
    }

    fn to_json(&self) -> Value {
        let attributes: Vec<Value> = self
            .attributes
            .iter()
            .map(|(k, v)| json!({ "key": k, "value": { "stringValue": v } }))
            .collect();
        let mut span = json!({
            "traceId": format!("{:032x}", self.trace_id),
            "spanId": format!("{:016x}", self.span_id),
            "name": self.name,
            "kind": self.kind as i32,
            "startTimeUnixNano": nanos(self.start),
            "endTimeUnixNano": nanos(self.end),
            "attributes": attributes,
        });
        if self.parent != 0 {
            span["parentSpanId"] = json!(format!("{:016x}", self.parent));
        }
        span
    }
}

/// An OTLP `ExportTraceServiceRequest` holding `spans` of `service`.
pub fn export_request(service: &str, spans: &[Span]) -> Value {
    let spans: Vec<Value> = spans.iter().map(Span::to_json).collect();
    json!({
        "resourceSpans": [{
            "resource": { "attributes": [
                { "key": "service.name", "value": { "stringValue": service } }
            ]},
            "scopeSpans": [{ "scope": { "name": "meshless" }, "spans": spans }]
        }]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_ids_as_hex_and_times_as_strings() {
        let now = Instant::now();
        let mut s = Span::new(0xab, 0xcd, "held", now, now).with("k", "v");
        s.span_id = 0xef;
        let v = export_request("svc", &[s]);
        let span = &v["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
        assert_eq!(span["traceId"], "000000000000000000000000000000ab");
        assert_eq!(span["spanId"], "00000000000000ef");
        assert_eq!(span["parentSpanId"], "00000000000000cd");
        assert_eq!(span["kind"], 1);
        assert!(span["startTimeUnixNano"].is_string());
        assert_eq!(span["attributes"][0]["value"]["stringValue"], "v");
    }
}
