//! Routes of one listener, compiled from config: matched in order on host,
//! path and headers; each names one cluster or a weighted split.

use std::sync::Arc;

use http::{HeaderName, HeaderValue, request::Parts};

use crate::config::{ListenerConfig, RouteConfig};

/// One compiled route.
#[derive(Debug)]
pub struct Route {
    /// Name for logs: configured, or `route-N`.
    pub name: Arc<str>,
    host: Option<HostMatch>,
    path: PathMatch,
    headers: Vec<(HeaderName, Option<HeaderValue>)>,
    target: Target,
    /// `Upgrade` protocols let through, lower-cased.
    upgrades: Vec<String>,
}

#[derive(Debug)]
enum HostMatch {
    Exact(String),
    /// `*.example.com` stored as `.example.com`.
    Suffix(String),
}

#[derive(Debug)]
enum PathMatch {
    Any,
    Exact(String),
    Prefix(String),
}

#[derive(Debug)]
enum Target {
    One(Arc<str>),
    /// Clusters with cumulative weights; `total` is the sum.
    Weighted(Vec<(Arc<str>, u64)>, u64),
}

/// The routes of one listener, in match order.
#[derive(Debug)]
pub struct RouteTable {
    routes: Vec<Route>,
    /// The listener's `default_cluster`, taken when no route matches.
    default: Option<Route>,
}

impl RouteTable {
    /// Compiles a listener's routes (already validated).
    pub fn new(listener: &ListenerConfig) -> Self {
        let routes = listener
            .routes
            .iter()
            .enumerate()
            .map(|(i, r)| compile(i, r))
            .collect();
        let default = listener.default_cluster.as_ref().map(|c| {
            let r = RouteConfig {
                name: Some("default_cluster".into()),
                matcher: Default::default(),
                cluster: Some(c.clone()),
                weighted_clusters: None,
                upgrades: crate::limits::default_upgrades(),
            };
            compile(listener.routes.len(), &r)
        });
        Self { routes, default }
    }

    /// The first route matching the request, else the default cluster's
    /// route (named `default_cluster`).
    pub fn find(&self, parts: &Parts) -> Option<&Route> {
        let host = request_host(parts);
        self.routes
            .iter()
            .find(|r| r.matches(parts, host))
            .or(self.default.as_ref())
    }
}

impl Route {
    fn matches(&self, parts: &Parts, host: Option<&str>) -> bool {
        let host_ok = match (&self.host, host) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(HostMatch::Exact(want)), Some(h)) => h.eq_ignore_ascii_case(want),
            (Some(HostMatch::Suffix(suffix)), Some(h)) => {
                h.len() > suffix.len() && h[h.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
            }
        };
        let path = parts.uri.path();
        let path_ok = match &self.path {
            PathMatch::Any => true,
            PathMatch::Exact(p) => path == p,
            PathMatch::Prefix(p) => path.starts_with(p.as_str()),
        };
        host_ok
            && path_ok
            && self.headers.iter().all(|(name, value)| match value {
                None => parts.headers.contains_key(name),
                Some(v) => parts.headers.get_all(name).iter().any(|x| x == v),
            })
    }

    /// Whether every protocol of an `Upgrade` header value is on this
    /// route's allowlist (`websocket`, `WebSocket/13`: the name before `/`).
    pub fn allows_upgrade(&self, upgrade: &str) -> bool {
        upgrade
            .split(',')
            .map(|p| {
                p.trim()
                    .split('/')
                    .next()
                    .unwrap_or("")
                    .to_ascii_lowercase()
            })
            .all(|p| !p.is_empty() && self.upgrades.contains(&p))
    }

    /// The cluster for this request; `draw` is uniform random.
    pub fn cluster(&self, draw: u64) -> &Arc<str> {
        match &self.target {
            Target::One(c) => c,
            Target::Weighted(list, total) => {
                let x = draw % (*total).max(1);
                list.iter()
                    .find(|(_, cumulative)| x < *cumulative)
                    .or(list.last())
                    .map(|(c, _)| c)
                    .unwrap_or_else(|| unreachable_cluster())
            }
        }
    }
}

/// Validation guarantees a weighted route has a cluster; this is never hit.
fn unreachable_cluster() -> &'static Arc<str> {
    static NONE: std::sync::OnceLock<Arc<str>> = std::sync::OnceLock::new();
    NONE.get_or_init(|| Arc::from(""))
}

fn compile(index: usize, r: &RouteConfig) -> Route {
    let host = r.matcher.host.as_ref().map(|h| match h.strip_prefix('*') {
        Some(suffix) => HostMatch::Suffix(suffix.to_owned()),
        None => HostMatch::Exact(h.clone()),
    });
    let path = match (&r.matcher.path, &r.matcher.path_prefix) {
        (Some(p), _) => PathMatch::Exact(p.clone()),
        (None, Some(p)) => PathMatch::Prefix(p.clone()),
        (None, None) => PathMatch::Any,
    };
    let headers = r
        .matcher
        .headers
        .iter()
        .filter_map(|h| {
            let name = HeaderName::from_bytes(h.name.as_bytes()).ok()?;
            let value = h.value.as_ref().and_then(|v| HeaderValue::from_str(v).ok());
            Some((name, value))
        })
        .collect();
    let target = match (&r.cluster, &r.weighted_clusters) {
        (Some(c), _) => Target::One(Arc::from(c.as_str())),
        (None, Some(list)) => {
            let mut acc = 0u64;
            let cumulative = list
                .iter()
                .filter(|w| w.weight > 0)
                .map(|w| {
                    acc += u64::from(w.weight);
                    (Arc::from(w.cluster.as_str()), acc)
                })
                .collect();
            Target::Weighted(cumulative, acc)
        }
        (None, None) => Target::One(Arc::from("")),
    };
    Route {
        name: Arc::from(r.name.clone().unwrap_or_else(|| format!("route-{index}"))),
        host,
        path,
        headers,
        target,
        upgrades: r.upgrades.iter().map(|u| u.to_ascii_lowercase()).collect(),
    }
}

/// The request's host without port: `Host` header (HTTP/1.1) or the URI
/// authority (HTTP/2 `:authority`).
pub fn request_host(parts: &Parts) -> Option<&str> {
    let raw = parts
        .headers
        .get(http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| parts.uri.authority().map(|a| a.as_str()))?;
    Some(strip_port(raw))
}

fn strip_port(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        // [v6]:port
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ProxyConfig;

    fn table() -> RouteTable {
        let cfg = ProxyConfig::parse(
            r#"
listeners:
  - name: l
    address: 127.0.0.1:1
    routes:
      - match: { host: "*.example.com", path_prefix: /api }
        cluster: a
      - match: { path: /exact, headers: [{ name: x-canary, value: "1" }] }
        cluster: b
      - weighted_clusters: [{ cluster: a, weight: 1 }, { cluster: b, weight: 3 }]
clusters:
  - { name: a, endpoints: [{ address: "127.0.0.1:2" }] }
  - { name: b, endpoints: [{ address: "127.0.0.1:3" }] }
"#,
            "t.yaml",
        )
        .expect("valid");
        RouteTable::new(&cfg.listeners[0])
    }

    fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = http::Request::builder().uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).expect("request").into_parts().0
    }

    #[test]
    fn matches_in_order() {
        let t = table();
        let p = parts("/api/x", &[("host", "www.example.com:8080")]);
        assert_eq!(t.find(&p).map(|r| &*r.name), Some("route-0"));
        let p = parts("/api/x", &[("host", "example.com")]);
        assert_eq!(t.find(&p).map(|r| &*r.name), Some("route-2"));
        let p = parts("/exact", &[("x-canary", "1")]);
        assert_eq!(t.find(&p).map(|r| &*r.name), Some("route-1"));
        let p = parts("/exact", &[("x-canary", "2")]);
        assert_eq!(t.find(&p).map(|r| &*r.name), Some("route-2"));
        let p = parts("http://a.example.com/api", &[]);
        assert_eq!(
            t.find(&p).map(|r| &*r.name),
            Some("route-0"),
            "h2 authority"
        );
    }

    #[test]
    fn weighted_split_follows_weights() {
        let t = table();
        let p = parts("/", &[]);
        let r = t.find(&p).expect("route");
        let b = (0..4000u64).filter(|&d| &**r.cluster(d) == "b").count();
        assert_eq!(b, 3000);
    }
}
