//! The W3C Trace Context `traceparent` header
//! (<https://www.w3.org/TR/trace-context/#traceparent-header>):
//! `version-traceid-parentid-flags`, lowercase hex, 2-32-16-2 digits.
//!
//! Invariants (property-tested): what [`TraceParent::header_value`] writes
//! parses back to the same value; a trace id or parent id of all zeros,
//! version `ff`, uppercase hex, or a version-00 value of any length other
//! than 55 is rejected; a later version may append `-`-separated fields.

use http::{HeaderMap, HeaderValue};

/// The header's name.
pub const TRACEPARENT: &str = "traceparent";

/// One `traceparent`: the trace, the span that is the parent of the
/// receiver's spans, and the flags (bit 0: sampled).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: u128,
    pub span_id: u64,
    pub flags: u8,
}

fn hex_lc(s: &[u8]) -> bool {
    s.iter()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
}

fn field(s: &[u8]) -> Option<u128> {
    if !hex_lc(s) {
        return None;
    }
    u128::from_str_radix(std::str::from_utf8(s).ok()?, 16).ok()
}

fn nonzero_u64() -> u64 {
    loop {
        let v = fastrand::u64(..);
        if v != 0 {
            return v;
        }
    }
}

impl TraceParent {
    /// Parses a header value; `None` when it is not a valid `traceparent`.
    pub fn parse(value: &[u8]) -> Option<Self> {
        if value.len() < 55 || value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
            return None;
        }
        let version = field(&value[0..2])?;
        if version == 0xff || (version == 0 && value.len() != 55) {
            return None;
        }
        if value.len() > 55 && value[55] != b'-' {
            return None;
        }
        let trace_id = field(&value[3..35])?;
        let span_id = u64::try_from(field(&value[36..52])?).ok()?;
        let flags = u8::try_from(field(&value[53..55])?).ok()?;
        (trace_id != 0 && span_id != 0).then_some(Self {
            trace_id,
            span_id,
            flags,
        })
    }

    /// The valid `traceparent` of `headers`, if there is exactly one.
    pub fn from_headers(headers: &HeaderMap) -> Option<Self> {
        let mut values = headers.get_all(TRACEPARENT).iter();
        let first = values.next()?;
        if values.next().is_some() {
            return None;
        }
        Self::parse(first.as_bytes())
    }

    /// A new trace (random ids), sampled.
    pub fn random() -> Self {
        let trace_id = (u128::from(nonzero_u64()) << 64) | u128::from(fastrand::u64(..));
        Self {
            trace_id,
            span_id: nonzero_u64(),
            flags: 1,
        }
    }

    /// The same trace and flags, with a new span id: the span of whoever
    /// received this one.
    pub fn child(&self) -> Self {
        Self {
            span_id: nonzero_u64(),
            ..*self
        }
    }

    /// The trace id as OTLP's JSON writes it (32 lowercase hex digits).
    pub fn trace_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// The version-00 header value (`00-{trace:032x}-{span:016x}-{flags:02x}`,
    /// written without the formatting machinery: this runs for every
    /// request the proxy forwards).
    pub fn header_value(&self) -> HeaderValue {
        HeaderValue::from_bytes(&self.header_text())
            .unwrap_or_else(|_| HeaderValue::from_static(""))
    }

    /// The bytes of [`Self::header_value`], for a caller that stores them
    /// itself (the proxy copies them into a shared chunk: no allocation).
    pub fn header_text(&self) -> [u8; 55] {
        let mut text = [0u8; 55];
        text[..3].copy_from_slice(b"00-");
        hex(&mut text[3..35], self.trace_id);
        text[35] = b'-';
        hex(&mut text[36..52], u128::from(self.span_id));
        text[52] = b'-';
        hex(&mut text[53..55], u128::from(self.flags));
        text
    }
}

/// Writes the low `out.len()` hex digits of `n` into `out`, lower case,
/// most significant first (`format!("{n:0w$x}")` without the formatting
/// machinery, for code that runs on every request).
pub fn hex(out: &mut [u8], mut n: u128) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    // Every byte's two digits: a step writes two.
    static PAIRS: [[u8; 2]; 256] = {
        let mut t = [[0u8; 2]; 256];
        let mut i = 0;
        while i < 256 {
            t[i] = [DIGITS[i >> 4], DIGITS[i & 0xf]];
            i += 1;
        }
        t
    };
    let mut pairs = out.rchunks_exact_mut(2);
    for pair in &mut pairs {
        pair.copy_from_slice(&PAIRS[(n & 0xff) as usize]);
        n >>= 8;
    }
    // An odd width: the most significant digit alone.
    if let [first] = pairs.into_remainder() {
        *first = DIGITS[(n & 0xf) as usize];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn the_header_is_what_format_writes(trace_id: u128, span_id: u64, flags: u8) {
            let p = TraceParent { trace_id, span_id, flags };
            let expected = format!("00-{trace_id:032x}-{span_id:016x}-{flags:02x}");
            let value = p.header_value();
            prop_assert_eq!(value.as_bytes(), expected.as_bytes());
        }
    }

    proptest! {
        #[test]
        fn hex_is_what_format_writes(n: u128, width in 0usize..=32) {
            let mut out = vec![0u8; width];
            hex(&mut out, n);
            let full = format!("{n:032x}");
            prop_assert_eq!(&out[..], &full.as_bytes()[32 - width..]);
        }
    }

    #[test]
    fn the_example_of_the_specification() {
        let v = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let p = TraceParent::parse(v).expect("valid");
        assert_eq!(p.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(p.span_id, 0x00f067aa0ba902b7);
        assert_eq!(p.flags, 1);
        assert_eq!(p.header_value().as_bytes(), v);
    }

    #[test]
    fn invalid_values_are_rejected() {
        for v in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "",
        ] {
            assert_eq!(TraceParent::parse(v.as_bytes()), None, "{v}");
        }
        // A later version may carry more fields.
        let later = b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more";
        assert!(TraceParent::parse(later).is_some());
    }

    proptest! {
        #[test]
        fn written_values_parse_back(t in 1u128.., s in 1u64.., f in any::<u8>()) {
            let p = TraceParent { trace_id: t, span_id: s, flags: f };
            prop_assert_eq!(TraceParent::parse(p.header_value().as_bytes()), Some(p));
            let c = p.child();
            prop_assert_eq!((c.trace_id, c.flags), (t, f));
            prop_assert!(c.span_id != 0);
        }

        #[test]
        fn any_bytes_parse_without_panicking(b in prop::collection::vec(any::<u8>(), 0..80)) {
            if let Some(p) = TraceParent::parse(&b) {
                prop_assert!(p.trace_id != 0 && p.span_id != 0);
            }
        }
    }
}
