//! Fields that describe one hop, known as a head is read: used by the
//! upstream HTTP/1.1 client (`upstream/h1.rs`) and checked against the
//! request path's strip (`request::headers::strip_hop_by_hop`), with no
//! import of either.

/// Whether a received field (its name compared without regard to case)
/// may be left out of the message's map as its head is read, because
/// the strip ([`crate::request::headers::strip_hop_by_hop`]) would remove
/// it and do nothing else for it: `Keep-Alive`, and a `Connection` whose
/// every token is `keep-alive` (or empty). A `Connection` that names
/// anything else (`close`, `upgrade`, another field) is kept for the
/// strip to act on. Left out, such a field costs no map entry and no
/// removal: an upstream's `Connection: keep-alive` comes with nearly
/// every response.
pub fn dropped_on_arrival(name: &str, value: &[u8]) -> bool {
    if name.eq_ignore_ascii_case("keep-alive") {
        return true;
    }
    name.eq_ignore_ascii_case("connection")
        && value.split(|b| *b == b',').all(|token| {
            let token = token.trim_ascii();
            token.is_empty() || token.eq_ignore_ascii_case(b"keep-alive")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_field_is_dropped_on_arrival_only_when_it_says_keep_alive() {
        for (name, value, dropped) in [
            ("connection", "keep-alive", true),
            ("Connection", "Keep-Alive", true),
            ("connection", " keep-alive ,\tKEEP-ALIVE, ", true),
            ("connection", "", true),
            ("keep-alive", "timeout=5, max=100", true),
            ("connection", "close", false),
            ("connection", "keep-alive, close", false),
            ("connection", "keep-alive, upgrade", false),
            ("connection", "keep-alive, x-secret", false),
            ("connection", "keep-alive-ish", false),
            ("x-connection", "keep-alive", false),
            ("upgrade", "websocket", false),
        ] {
            assert_eq!(
                dropped_on_arrival(name, value.as_bytes()),
                dropped,
                "{name}: {value}"
            );
        }
    }
}
