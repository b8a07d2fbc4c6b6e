//! Stage 1, route: which route and cluster a request goes to, or the local
//! reply that says why none.

use std::net::IpAddr;
use std::sync::Arc;

use http::StatusCode;
use http::header;
use meshless_balance::hash_key;

use crate::config::HashKey;
use crate::request::respond::LocalReply;
use crate::snapshot::{Snapshot, UpstreamCluster};

/// A routed request.
#[derive(Debug)]
pub struct Routed {
    /// The route's name.
    pub route: Arc<str>,
    /// The cluster chosen (by weight, for a split).
    pub cluster: Arc<UpstreamCluster>,
    /// The affinity key's hash, from the cluster's `hash_key` source.
    pub key: Option<u64>,
    /// The request asks for an upgrade: `Some(true)` if the route lets all
    /// its protocols through, `Some(false)` if the upgrade is refused.
    pub upgrade: Option<bool>,
}

/// Routes `parts` received on `listener`.
pub fn route(
    snapshot: &Snapshot,
    listener: &str,
    client: IpAddr,
    parts: &http::request::Parts,
) -> Result<Routed, LocalReply> {
    let Some(routes) = snapshot.routes.get(listener) else {
        return Err(LocalReply::text(
            StatusCode::SERVICE_UNAVAILABLE,
            "listener is being removed\n",
            "draining",
        ));
    };
    let Some(route) = routes.find(parts) else {
        return Err(LocalReply::text(
            StatusCode::NOT_FOUND,
            "no route\n",
            "no_route",
        ));
    };
    let name = route.cluster(fastrand::u64(..));
    let Some(cluster) = snapshot.clusters.get(&**name) else {
        return Err(LocalReply::text(
            StatusCode::SERVICE_UNAVAILABLE,
            "no such cluster\n",
            "no_cluster",
        ));
    };
    let upgrade = crate::request::headers::is_upgrade(&parts.headers).then(|| {
        parts
            .headers
            .get_all(header::UPGRADE)
            .iter()
            .all(|v| v.to_str().is_ok_and(|v| route.allows_upgrade(v)))
    });
    Ok(Routed {
        upgrade,
        route: Arc::clone(&route.name),
        key: extract_key(cluster.config.balancer.hash_key.as_ref(), parts, client),
        cluster: Arc::clone(cluster),
    })
}

/// The affinity key's hash, from the configured source.
pub fn extract_key(
    source: Option<&HashKey>,
    parts: &http::request::Parts,
    client: IpAddr,
) -> Option<u64> {
    match source? {
        HashKey::Header(name) => parts
            .headers
            .get(name.as_str())
            .map(|v| hash_key(v.as_bytes())),
        HashKey::Path => Some(hash_key(parts.uri.path().as_bytes())),
        HashKey::ClientAddress => Some(hash_key(client.to_string().as_bytes())),
        HashKey::Query(name) => parts.uri.query().and_then(|q| {
            q.split('&')
                .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
                .find(|(k, _)| k == name)
                .map(|(_, v)| hash_key(v.as_bytes()))
        }),
        HashKey::Cookie(name) => parts
            .headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|c| c.trim().split_once('='))
            .find(|(k, _)| k == name)
            .map(|(_, v)| hash_key(v.as_bytes())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    #[test]
    fn keys_come_from_the_configured_source() {
        let req = Request::builder()
            .uri("/p?a=1&user=bob")
            .header("x-user", "alice")
            .header("cookie", "theme=dark; session=s1")
            .body(())
            .expect("request");
        let (parts, ()) = req.into_parts();
        let client: IpAddr = "10.1.2.3".parse().expect("addr");
        let k = |s| extract_key(Some(&s), &parts, client);
        assert_eq!(
            k(HashKey::Header("x-user".into())),
            Some(hash_key(b"alice"))
        );
        assert_eq!(k(HashKey::Cookie("session".into())), Some(hash_key(b"s1")));
        assert_eq!(k(HashKey::Query("user".into())), Some(hash_key(b"bob")));
        assert_eq!(k(HashKey::Path), Some(hash_key(b"/p")));
        assert_eq!(k(HashKey::ClientAddress), Some(hash_key(b"10.1.2.3")));
        assert_eq!(k(HashKey::Header("x-none".into())), None);
    }

    fn snapshot(yaml: &str) -> Snapshot {
        let cfg = crate::ProxyConfig::parse(yaml, "t.yaml").expect("config");
        Snapshot::build(cfg, None, &Default::default()).expect("snapshot")
    }

    #[test]
    fn routes_by_path_or_answers_404() {
        let snap = snapshot(
            "listeners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - match: { path_prefix: /api }\n        cluster: c\nclusters:\n  - name: c\n    endpoints: [{ address: \"127.0.0.1:1\" }]\n",
        );
        let client: IpAddr = "127.0.0.1".parse().expect("addr");
        let head = |uri: &str| Request::get(uri).body(()).expect("request").into_parts().0;
        let hit = route(&snap, "web", client, &head("/api/x")).expect("routed");
        assert_eq!(&*hit.cluster.name, "c");
        let miss = route(&snap, "web", client, &head("/other")).expect_err("no route");
        assert_eq!(
            (miss.status, miss.reason),
            (StatusCode::NOT_FOUND, "no_route")
        );
        let gone = route(&snap, "old", client, &head("/api")).expect_err("no listener");
        assert_eq!(gone.reason, "draining");
        let ws = |proto: &str| {
            let req = Request::get("/api")
                .header("connection", "upgrade")
                .header("upgrade", proto)
                .body(())
                .expect("request");
            route(&snap, "web", client, &req.into_parts().0)
                .expect("routed")
                .upgrade
        };
        assert_eq!(ws("websocket"), Some(true));
        assert_eq!(ws("WebSocket/13"), Some(true));
        assert_eq!(ws("h2c"), Some(false));
        assert_eq!(ws("websocket, h2c"), Some(false));
        assert_eq!(hit.upgrade, None);
    }
}
