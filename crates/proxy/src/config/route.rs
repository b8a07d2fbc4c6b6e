//! `listeners[].routes:` matches and the clusters matching requests go to.

use std::collections::HashSet;

use meshless_model::FieldError;
use serde::{Deserialize, Serialize};

/// One route: a match and where matching requests go.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Name for logs and metrics; defaults to the route's position.
    #[serde(default)]
    pub name: Option<String>,
    /// Conditions, all of which must hold; empty matches everything.
    #[serde(rename = "match", default)]
    pub matcher: MatchConfig,
    /// Send to this cluster...
    #[serde(default)]
    pub cluster: Option<String>,
    /// ...or split across these clusters by weight.
    #[serde(default)]
    pub weighted_clusters: Option<Vec<WeightedCluster>>,
    /// `Upgrade` protocols passed through (case-insensitive); others are
    /// stripped and the request forwarded as a plain one. `h2c` never.
    #[serde(default = "crate::limits::default_upgrades")]
    pub upgrades: Vec<String>,
}

/// Request conditions.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatchConfig {
    /// Host (without port), exact, or `*.example.com` for any subdomain.
    #[serde(default)]
    pub host: Option<String>,
    /// Exact path.
    #[serde(default)]
    pub path: Option<String>,
    /// Path prefix.
    #[serde(default)]
    pub path_prefix: Option<String>,
    /// Headers that must be present (and equal `value`, when given).
    #[serde(default)]
    pub headers: Vec<HeaderMatch>,
}

/// One header condition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderMatch {
    /// Header name (case-insensitive).
    pub name: String,
    /// Exact value; absent = the header only has to be present.
    #[serde(default)]
    pub value: Option<String>,
}

/// A cluster and its share of a route's traffic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightedCluster {
    /// Cluster name.
    pub cluster: String,
    /// Relative weight (e.g. percent).
    pub weight: u32,
}

/// Checks one route; the error's path is relative to the route.
pub(super) fn validate_route(r: &RouteConfig, clusters: &HashSet<&str>) -> Result<(), FieldError> {
    let fail = |path: String, reason: String| Err(FieldError::new(path, reason));
    match (&r.cluster, &r.weighted_clusters) {
        (Some(c), None) => {
            if !clusters.contains(c.as_str()) {
                return fail("cluster".to_owned(), format!("unknown cluster {c:?}"));
            }
        }
        (None, Some(list)) => {
            if list.is_empty() || list.iter().all(|w| w.weight == 0) {
                return fail(
                    "weighted_clusters".to_owned(),
                    "needs at least one cluster with weight > 0".into(),
                );
            }
            for (k, w) in list.iter().enumerate() {
                if !clusters.contains(w.cluster.as_str()) {
                    return fail(
                        format!("weighted_clusters[{k}].cluster"),
                        format!("unknown cluster {:?}", w.cluster),
                    );
                }
            }
        }
        _ => {
            return fail(
                String::new(),
                "exactly one of `cluster` or `weighted_clusters` is required".into(),
            );
        }
    }
    if r.matcher.path.is_some() && r.matcher.path_prefix.is_some() {
        return fail(
            "match".to_owned(),
            "use `path` or `path_prefix`, not both".into(),
        );
    }
    for (field, p) in [
        ("path", &r.matcher.path),
        ("path_prefix", &r.matcher.path_prefix),
    ] {
        if let Some(p) = p
            && !p.starts_with('/')
        {
            return fail(
                format!("match.{field}"),
                format!("must start with '/', got {p:?}"),
            );
        }
    }
    for (k, h) in r.matcher.headers.iter().enumerate() {
        if http::HeaderName::from_bytes(h.name.as_bytes()).is_err() {
            return fail(
                format!("match.headers[{k}].name"),
                format!("not a valid header name: {:?}", h.name),
            );
        }
    }
    Ok(())
}
