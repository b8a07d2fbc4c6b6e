//! Path normalisation before routing, as Envoy's `normalize_path` and
//! `merge_slashes` do: dot-segments removed (RFC 3986 5.2.4, `%2e` counted
//! as `.`), or the request rejected; runs of `/` merged on request. The
//! route and the endpoint then see the same path, so `/public/../admin`
//! cannot reach a route that `/admin` would not.

use http::StatusCode;
use http::uri::{PathAndQuery, Uri};

use crate::limits::{DotSegments, PathSettings};
use crate::request::respond::LocalReply;

/// Whether `seg` is `.` (possibly percent-encoded).
fn is_dot(seg: &str) -> bool {
    seg == "." || seg.eq_ignore_ascii_case("%2e")
}

/// Whether `seg` is `..` (possibly percent-encoded).
fn is_dot_dot(seg: &str) -> bool {
    let lower = seg.to_ascii_lowercase();
    matches!(lower.as_str(), ".." | ".%2e" | "%2e." | "%2e%2e")
}

/// `path` with dot-segments removed (if `dots`) and empty segments merged
/// (if `merge`). `path` starts with `/`.
pub fn normalize(path: &str, dots: bool, merge: bool) -> String {
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    let last = segments.len().saturating_sub(1);
    let mut out: Vec<&str> = Vec::with_capacity(segments.len());
    for (i, seg) in segments.iter().enumerate() {
        let is_last = i == last;
        if dots && is_dot(seg) {
            if is_last {
                out.push("");
            }
        } else if dots && is_dot_dot(seg) {
            out.pop();
            if is_last {
                out.push("");
            }
        } else if merge && seg.is_empty() && !is_last {
            continue;
        } else {
            out.push(seg);
        }
    }
    if merge {
        // A trailing empty segment after a merged run stays single.
        out.dedup_by(|a, b| a.is_empty() && b.is_empty());
    }
    format!("/{}", out.join("/"))
}

/// Normalises the request's path in place per `settings`; the reply that
/// refuses it when `dot_segments: reject` and it has any.
pub fn apply(settings: &PathSettings, parts: &mut http::request::Parts) -> Option<LocalReply> {
    let path = parts.uri.path();
    if !path.starts_with('/')
        || settings.dot_segments == DotSegments::Keep && !settings.merge_slashes
    {
        return None;
    }
    let dots = settings.dot_segments != DotSegments::Keep;
    // Fast path: nothing to normalise (no `.` segment, no `%2e`, no `//`).
    let maybe_dots = dots && (path.contains("/.") || path.contains("/%2"));
    let maybe_slashes = settings.merge_slashes && path.contains("//");
    if !maybe_dots && !maybe_slashes {
        return None;
    }
    let normal = normalize(path, dots, settings.merge_slashes);
    if normal == path {
        return None;
    }
    if settings.dot_segments == DotSegments::Reject && normalize(path, true, false) != path {
        return Some(LocalReply::text(
            StatusCode::BAD_REQUEST,
            "path has dot-segments\n",
            "path_refused",
        ));
    }
    let with_query = match parts.uri.query() {
        Some(q) => format!("{normal}?{q}"),
        None => normal,
    };
    let mut uri = parts.uri.clone().into_parts();
    uri.path_and_query = PathAndQuery::from_maybe_shared(with_query).ok();
    if let Ok(u) = Uri::from_parts(uri) {
        parts.uri = u;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_segments_are_removed_as_rfc_3986_says() {
        // RFC 3986 5.2.4 and 5.4 examples, applied to absolute paths.
        let cases = [
            ("/a/b/c/./../../g", "/a/g"),
            ("/mid/content=5/../6", "/mid/6"),
            ("/a/b/..", "/a/"),
            ("/a/b/.", "/a/b/"),
            ("/../../x", "/x"),
            ("/a/%2e%2E/b", "/b"),
            ("/a/.%2e/b", "/b"),
            ("/public/../admin", "/admin"),
            ("/a//b", "/a//b"),
            ("/", "/"),
            ("/a/b/", "/a/b/"),
        ];
        for (input, want) in cases {
            assert_eq!(normalize(input, true, false), want, "{input}");
        }
    }

    #[test]
    fn slashes_merge_on_request() {
        assert_eq!(normalize("//a///b//", false, true), "/a/b/");
        assert_eq!(normalize("/a//../b", true, true), "/b");
        assert_eq!(normalize("/a/./b", false, true), "/a/./b");
    }

    fn parts(uri: &str) -> http::request::Parts {
        http::Request::get(uri)
            .body(())
            .expect("request")
            .into_parts()
            .0
    }

    #[test]
    fn remove_rewrites_reject_refuses_keep_leaves() {
        let mut s = PathSettings::default();
        let mut p = parts("/public/../admin?x=1");
        assert!(apply(&s, &mut p).is_none());
        assert_eq!(p.uri, "/admin?x=1");
        s.dot_segments = DotSegments::Reject;
        let mut p = parts("/public/../admin");
        assert_eq!(
            apply(&s, &mut p).map(|r| r.status),
            Some(StatusCode::BAD_REQUEST)
        );
        s.dot_segments = DotSegments::Keep;
        let mut p = parts("/public/../admin");
        assert!(apply(&s, &mut p).is_none());
        assert_eq!(p.uri, "/public/../admin");
    }
}
