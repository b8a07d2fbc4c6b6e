//! The fields the proxy adds to a forwarded request (`x-forwarded-for`,
//! `x-forwarded-proto`, `x-request-id`, `traceparent`) when the client's
//! map lacks them: kept beside the map rather than inserted into it.
//! Inserting costs a hash of each name (none is a standard one, so each
//! is hashed byte by byte) and a probe, about 300 instructions a field.
//! meshless's own HTTP/1.1 client (`upstream/h1.rs`) writes them after
//! the map's fields, straight into the request head; every other path
//! (hyper's client, HTTP/2, a peer proxy, an upgrade) appends them to the
//! map first ([`Added::append_to`]). Either way the upstream gets the
//! same fields in the same order: the map's, then these (a name the map
//! lacks goes after its fields, as an insert would put it; a `Host` the
//! proxy adds to a request that had none now comes before them). Imports
//! neither `request` nor `upstream`, which both use it.

use http::{HeaderMap, HeaderName, HeaderValue};

/// `x-forwarded-for`.
pub static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// `x-forwarded-proto`.
pub static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
/// `x-request-id`.
pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// `traceparent` as a name made once: a `&str` key makes (and allocates)
/// a new name on every insert.
pub static TRACEPARENT: HeaderName = HeaderName::from_static(meshless_trace::context::TRACEPARENT);

/// Added fields, each `Some` only when the map it goes with lacks its
/// name (the caller knows: `request::headers::Carried`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Added {
    pub forwarded_for: Option<HeaderValue>,
    pub forwarded_proto: Option<HeaderValue>,
    pub request_id: Option<HeaderValue>,
    pub traceparent: Option<HeaderValue>,
}

impl Added {
    /// The fields, in the order they are written.
    pub fn iter(&self) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
        [
            (&X_FORWARDED_FOR, &self.forwarded_for),
            (&X_FORWARDED_PROTO, &self.forwarded_proto),
            (&X_REQUEST_ID, &self.request_id),
            (&TRACEPARENT, &self.traceparent),
        ]
        .into_iter()
        .filter_map(|(name, value)| Some(name).zip(value.as_ref()))
    }

    /// Puts the fields into `map` (which lacks their names): what the
    /// paths that send a map, not a head of meshless's own, do.
    pub fn append_to(self, map: &mut HeaderMap) {
        let fields = [
            (&X_FORWARDED_FOR, self.forwarded_for),
            (&X_FORWARDED_PROTO, self.forwarded_proto),
            (&X_REQUEST_ID, self.request_id),
            (&TRACEPARENT, self.traceparent),
        ];
        for (name, value) in fields {
            if let Some(value) = value {
                map.append(name.clone(), value);
            }
        }
    }
}

/// The headers of a request to forward: the map, and the added fields it
/// lacks.
#[derive(Debug, Clone, Default)]
pub struct Outgoing {
    pub map: HeaderMap,
    pub added: Added,
}

impl Outgoing {
    /// The whole map, the added fields appended.
    pub fn into_map(self) -> HeaderMap {
        let Self { mut map, added } = self;
        added.append_to(&mut map);
        map
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(s: &str) -> Option<HeaderValue> {
        Some(HeaderValue::from_str(s).expect("value"))
    }

    #[test]
    fn written_and_appended_fields_are_the_same_in_the_same_order() {
        let mut map = HeaderMap::new();
        map.insert("host", HeaderValue::from_static("a"));
        map.append("x-b", HeaderValue::from_static("1"));
        let added = Added {
            forwarded_for: value("10.0.0.1"),
            forwarded_proto: None,
            request_id: value("id"),
            traceparent: value("00-1-2-01"),
        };
        let written: Vec<(String, Vec<u8>)> = map
            .iter()
            .chain(added.iter())
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        let whole = Outgoing { map, added }.into_map();
        let appended: Vec<(String, Vec<u8>)> = whole
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        assert_eq!(written, appended);
        let names: Vec<&str> = written.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "host",
                "x-b",
                "x-forwarded-for",
                "x-request-id",
                "traceparent"
            ]
        );
    }
}
