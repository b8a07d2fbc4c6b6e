//! Ahead-of-time placement, the proxy's side: per service at zero, the node
//! the control plane chose for its next instance and that node's proxy (as
//! received on the stream), with one connection pool to those proxies.
//! A request this proxy would hold for such a service is forwarded there
//! instead when the chosen node is not this proxy's (see
//! `request/peer.rs`), so the instance starts on the chosen node.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use http::{HeaderName, HeaderValue};

use crate::config::UpstreamProtocol;
use crate::upstream::{ClusterCounters, EndpointPool, Pool, Settings};

/// Set on a request forwarded to a peer proxy ([`Marker`]): a request
/// carrying it is never forwarded again (one hop only).
pub const FORWARDED_BY: HeaderName = HeaderName::from_static("x-meshless-forwarded-by");

/// The value of [`FORWARDED_BY`]: `<node>;client=<ip>;token=<hex>`. The
/// sending proxy's node, the client address it computed (its own
/// `trusted_hops` applied, so the receiving proxy routes, hashes and logs
/// the same client), and the control plane's hop credential.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marker {
    pub node: String,
    pub client: Option<IpAddr>,
    pub token: String,
}

impl Marker {
    /// The header value (`None` when a part cannot be in one: the node or
    /// the token holds `;`, `=` or anything but visible ASCII, which would
    /// read back as another marker or none).
    pub fn to_header(&self) -> Option<HeaderValue> {
        let plain = |s: &str| {
            s.bytes()
                .all(|b| b.is_ascii_graphic() && b != b';' && b != b'=')
        };
        if !plain(&self.node) || !plain(&self.token) {
            return None;
        }
        let client = self.client.map(|ip| ip.to_string()).unwrap_or_default();
        let text = format!("{};client={client};token={}", self.node, self.token);
        HeaderValue::from_str(&text).ok()
    }

    /// Parses a header value; `None` when it is not one (then the request
    /// is an ordinary one).
    pub fn parse(value: &HeaderValue) -> Option<Self> {
        let mut parts = value.to_str().ok()?.split(';');
        let node = parts.next()?.trim().to_owned();
        let (mut client, mut token) = (None, None);
        for part in parts {
            match part.trim().split_once('=')? {
                ("client", ip) => client = Some(ip.parse().ok()),
                ("token", t) => token = Some(t.to_owned()),
                _ => return None,
            }
        }
        Some(Self {
            node,
            client: client?,
            token: token?,
        })
    }
}

/// Whether `a` and `b` are equal, in a time that depends on their lengths
/// only (a marker's token is compared so: how long a wrong guess took
/// says nothing about how much of it was right).
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Connections to peer proxies open at once, at most.
const MAX_PEER_CONNECTIONS: u32 = 1024;
/// TCP connect to a peer proxy: past this, the request is held locally.
const PEER_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// A chosen proxy found unreachable is passed over this long (requests
/// are held here at once, not after a connect timeout each) unless the
/// control plane places the service elsewhere first. About what the
/// control plane takes to notice a vanished proxy and place again.
pub const UNREACHABLE_FOR: Duration = Duration::from_secs(30);

/// The chosen node's proxy for one service.
#[derive(Debug, Clone)]
pub struct Target {
    pub node: String,
    pub address: SocketAddr,
    /// Connections to it (kept while a placement or a request holds it).
    pub pool: Arc<EndpointPool>,
}

/// The placements received, by service, and the peer proxies' addresses.
#[derive(Debug)]
pub struct Placements {
    pool: Pool,
    by_service: Mutex<HashMap<String, Target>>,
    /// The IP addresses of the peer proxies (as the control plane sent
    /// them): the only sources whose [`FORWARDED_BY`] marker is trusted.
    peers: Mutex<HashSet<IpAddr>>,
    /// The control plane's hop credential (none yet, or empty: no hop is
    /// trusted).
    hop_token: Mutex<Option<Arc<str>>>,
    /// Chosen proxies found unreachable, and until when they are passed
    /// over.
    unreachable: Mutex<HashMap<SocketAddr, Instant>>,
}

impl Default for Placements {
    fn default() -> Self {
        let counters = Arc::new(ClusterCounters::default());
        counters
            .max_connections
            .store(MAX_PEER_CONNECTIONS, Ordering::Relaxed);
        let settings = Settings {
            protocol: UpstreamProtocol::Http1,
            http1: crate::config::Http1Client::Hyper,
            connect: PEER_CONNECT_TIMEOUT,
            idle: Duration::from_secs(60),
            max_idle: 16,
            preconnect_milli: 1000,
            tls: None,
            // HTTP/1.1 to peers: no HTTP/2 PINGs.
            keepalive: (None, Duration::from_secs(10)),
        };
        Self {
            pool: Pool::new(settings, counters),
            by_service: Mutex::default(),
            peers: Mutex::default(),
            hop_token: Mutex::default(),
            unreachable: Mutex::default(),
        }
    }
}

impl Placements {
    /// `service` is placed on `node`, whose proxy is at `address`; an empty
    /// node (or an address that does not parse) withdraws it.
    pub fn set(&self, service: &str, node: &str, address: &str) {
        let mut map = self
            .by_service
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let parsed = address.parse::<SocketAddr>();
        match parsed {
            Ok(address) if !node.is_empty() => {
                let kept = map
                    .get(service)
                    .filter(|t| t.address == address)
                    .map(|t| Arc::clone(&t.pool));
                let Some(pool) = kept.or_else(|| self.pool.endpoints(&[address]).pop()) else {
                    return;
                };
                let target = Target {
                    node: node.to_owned(),
                    address,
                    pool,
                };
                map.insert(service.to_owned(), target);
            }
            Err(e) if !node.is_empty() => {
                tracing::warn!(service, node, address, error = %e, "placement skipped: bad peer address");
                map.remove(service);
            }
            _ => {
                map.remove(service);
            }
        }
    }

    /// Forgets every placement and peer (a new stream sends the current
    /// ones).
    pub fn clear(&self) {
        self.by_service
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        self.peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        *self
            .hop_token
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
        self.unreachable
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// The chosen proxy at `address` could not be reached: it is passed
    /// over for [`UNREACHABLE_FOR`] (a placement elsewhere is used at
    /// once).
    pub fn mark_unreachable(&self, address: SocketAddr) {
        let mut u = self
            .unreachable
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        u.retain(|_, until| *until > now);
        u.insert(address, now + UNREACHABLE_FOR);
    }

    fn reachable(&self, address: SocketAddr) -> bool {
        self.unreachable
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&address)
            .is_none_or(|until| *until <= Instant::now())
    }

    /// Keeps the control plane's hop credential (sent with the peers).
    pub fn set_hop_token(&self, token: &str) {
        let token = (!token.is_empty()).then(|| Arc::from(token));
        *self
            .hop_token
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = token;
    }

    /// The hop credential to put in the marker of a forwarded request.
    pub fn hop_token(&self) -> Option<Arc<str>> {
        self.hop_token
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Whether a request marked `marker` from `source` was forwarded by a
    /// peer proxy: from a peer's address, with the hop credential.
    pub fn trusts(&self, source: IpAddr, marker: &Marker) -> bool {
        let Some(token) = self.hop_token() else {
            return false;
        };
        // Compared before the address check, whatever it says: the time
        // taken tells nothing about either.
        let credential = same_secret(token.as_bytes(), marker.token.as_bytes());
        self.is_peer(source) & credential
    }

    /// Applies a change of the peer proxies' addresses (text IPs; one
    /// that does not parse is skipped with a warning).
    pub fn change_peers(&self, added: &[String], removed: &[String]) {
        let parse = |a: &String| match a.parse::<IpAddr>() {
            Ok(ip) => Some(ip.to_canonical()),
            Err(e) => {
                tracing::warn!(address = %a, error = %e, "peer address skipped");
                None
            }
        };
        let mut peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        for ip in removed.iter().filter_map(parse) {
            peers.remove(&ip);
        }
        peers.extend(added.iter().filter_map(parse));
    }

    /// Whether `ip` is a peer proxy's address: a request from it marked
    /// [`FORWARDED_BY`] was forwarded by that proxy.
    pub fn is_peer(&self, ip: IpAddr) -> bool {
        self.peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&ip.to_canonical())
    }

    /// Where to forward `service`'s held requests from a proxy on
    /// `own_node` (at `own_address`, if it takes forwarded requests):
    /// `None` when it is not placed, or placed on this proxy.
    pub fn target(
        &self,
        service: &str,
        own_node: Option<&str>,
        own_address: Option<SocketAddr>,
    ) -> Option<Target> {
        let map = self
            .by_service
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let target = map
            .get(service)
            .filter(|t| own_node != Some(t.node.as_str()) && own_address != Some(t.address))
            .cloned();
        drop(map);
        target.filter(|t| self.reachable(t.address))
    }

    /// The placements now, as (service, node, address), sorted.
    pub fn list(&self) -> Vec<(String, String, SocketAddr)> {
        let map = self
            .by_service
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut v: Vec<_> = map
            .iter()
            .map(|(s, t)| (s.clone(), t.node.clone(), t.address))
            .collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_placement_on_this_node_or_address_is_not_a_target() {
        let p = Placements::default();
        p.set("ns/a", "n2", "127.0.0.1:9000");
        p.set("ns/b", "n1", "127.0.0.1:9001");
        let own: SocketAddr = "127.0.0.1:9001".parse().expect("addr");
        assert_eq!(
            p.target("ns/a", Some("n1"), Some(own)).map(|t| t.node),
            Some("n2".into())
        );
        assert!(p.target("ns/b", Some("n1"), None).is_none(), "own node");
        assert!(p.target("ns/b", None, Some(own)).is_none(), "own address");
        assert!(p.target("ns/c", Some("n1"), None).is_none(), "not placed");
        p.set("ns/a", "", "");
        assert!(p.target("ns/a", Some("n1"), None).is_none(), "withdrawn");
        p.set("ns/a", "n2", "not an address");
        assert!(p.target("ns/a", Some("n1"), None).is_none(), "unusable");
        assert_eq!(p.list().len(), 1);
        p.clear();
        assert!(p.list().is_empty());
    }

    #[tokio::test]
    async fn a_proxy_found_unreachable_is_passed_over_until_placed_elsewhere() {
        let p = Placements::default();
        p.set("ns/a", "n2", "127.0.0.1:9000");
        p.set("ns/b", "n2", "127.0.0.1:9000");
        p.mark_unreachable("127.0.0.1:9000".parse().expect("addr"));
        assert!(p.target("ns/a", Some("n1"), None).is_none());
        assert!(p.target("ns/b", Some("n1"), None).is_none(), "same proxy");
        // Placed the same again (the plane has not noticed): still passed over.
        p.set("ns/a", "n2", "127.0.0.1:9000");
        assert!(p.target("ns/a", Some("n1"), None).is_none());
        // Placed elsewhere: used at once.
        p.set("ns/a", "n3", "127.0.0.1:9001");
        assert_eq!(
            p.target("ns/a", Some("n1"), None).map(|t| t.node),
            Some("n3".into())
        );
        // A new stream starts afresh.
        p.clear();
        p.set("ns/b", "n2", "127.0.0.1:9000");
        assert!(p.target("ns/b", Some("n1"), None).is_some());
    }

    fn marker(client: &str, token: &str) -> Marker {
        Marker {
            node: "n1".into(),
            client: client.parse().ok(),
            token: token.into(),
        }
    }

    #[tokio::test]
    async fn a_hop_is_trusted_from_a_peer_with_the_credential_only() {
        let p = Placements::default();
        let peer: IpAddr = "10.0.0.1".parse().expect("ip");
        p.change_peers(&["10.0.0.1".into()], &[]);
        let good = marker("1.2.3.4", "s3cret");
        assert!(!p.trusts(peer, &good), "no credential received yet");
        p.set_hop_token("s3cret");
        assert!(p.trusts(peer, &good));
        assert!(!p.trusts("10.0.0.9".parse().expect("ip"), &good), "no peer");
        for wrong in ["", "s3cre", "s3cret!", "S3cret", "x3cret"] {
            assert!(!p.trusts(peer, &marker("1.2.3.4", wrong)), "{wrong:?}");
        }
        p.set_hop_token("");
        assert!(!p.trusts(peer, &good), "an empty credential trusts nothing");
        p.set_hop_token("s3cret");
        p.clear();
        assert!(!p.trusts(peer, &good), "a new stream sends it again");
    }

    #[test]
    fn a_marker_reads_back_and_anything_else_is_none() {
        let m = marker("2001:db8::1", "abc");
        let v = m.to_header().expect("header");
        assert_eq!(v, "n1;client=2001:db8::1;token=abc");
        assert_eq!(Marker::parse(&v), Some(m));
        let none = marker("", "abc");
        assert_eq!(
            Marker::parse(&none.to_header().expect("header")),
            Some(none)
        );
        for node in ["a;b", "a=b", "a b", "a,\u{e9}", "a\x7f"] {
            let m = Marker {
                node: node.into(),
                ..marker("1.2.3.4", "abc")
            };
            assert_eq!(m.to_header(), None, "{node:?}");
        }
        for bad in [
            "n1",
            "n1;token=abc",
            "n1;client=1.2.3.4",
            "n1;client=1.2.3.4;token=a;x=y",
            "n1;client",
        ] {
            let v = HeaderValue::from_static(bad);
            assert_eq!(Marker::parse(&v), None, "{bad}");
        }
    }

    proptest::proptest! {
        #[test]
        fn same_secret_is_equality(a in proptest::collection::vec(0u8..4, 0..6), b in proptest::collection::vec(0u8..4, 0..6)) {
            proptest::prop_assert_eq!(same_secret(&a, &b), a == b);
        }
    }

    #[tokio::test]
    async fn only_the_peers_sent_are_trusted() {
        let p = Placements::default();
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        p.change_peers(
            &["10.0.0.1".into(), "::ffff:10.0.0.2".into(), "x".into()],
            &[],
        );
        assert!(p.is_peer(ip("10.0.0.1")));
        assert!(p.is_peer(ip("10.0.0.2")), "v4-mapped is the same address");
        assert!(!p.is_peer(ip("10.0.0.3")));
        p.change_peers(&[], &["10.0.0.1".into()]);
        assert!(!p.is_peer(ip("10.0.0.1")));
        p.clear();
        assert!(!p.is_peer(ip("10.0.0.2")), "a new stream sends them again");
    }
}
