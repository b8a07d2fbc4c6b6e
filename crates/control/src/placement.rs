//! Ahead-of-time placement: for an autoscaled service at zero instances,
//! the node where its next instance will start, chosen before the first
//! request and announced to every proxy, so the proxies on other nodes
//! forward that service's first requests to the chosen node's proxy and
//! the activation is local there.
//!
//! Rule ([`choose`], pure): among the connected proxies that announced a
//! peer address and watch the service (so they route it and can activate
//! it), the node of the proxy that last reported requests for it; else the
//! node with the highest rendezvous hash (`xxh3(service, node)`).
//! A choice is kept while the service stays at zero and its node has a
//! connected proxy: proxies joining do not move it; it is dropped when the
//! service gets an instance, and made again when the node's last proxy
//! leaves.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Mutex, PoisonError};

use tokio::sync::watch;

/// A proxy that takes forwarded requests: its node and its peer address
/// (`host:port` of the listener other proxies forward to).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub node: String,
    pub address: String,
}

/// The node for `service`'s next instance among `nodes` (node -> peer
/// address): `last_active` when it is among them, else the highest
/// `xxh3(service \0 node)`. `None` when `nodes` is empty.
pub fn choose(
    service: &str,
    last_active: Option<&str>,
    nodes: &BTreeMap<String, String>,
) -> Option<Peer> {
    let node = match last_active.filter(|n| nodes.contains_key(*n)) {
        Some(n) => n,
        None => nodes
            .keys()
            .max_by_key(|n| rendezvous(service, n))?
            .as_str(),
    };
    nodes.get(node).map(|address| Peer {
        node: node.to_owned(),
        address: address.clone(),
    })
}

/// Whether `address` (`ip:port`) is a loopback address.
fn is_loopback(address: &str) -> bool {
    address
        .parse::<std::net::SocketAddr>()
        .is_ok_and(|a| a.ip().to_canonical().is_loopback())
}

/// The rendezvous (highest random weight) score of `node` for `service`;
/// the node name breaks the (unlikely) tie so the choice is total.
fn rendezvous<'a>(service: &str, node: &'a str) -> (u64, &'a str) {
    let mut key = Vec::with_capacity(service.len() + node.len() + 1);
    key.extend_from_slice(service.as_bytes());
    key.push(0);
    key.extend_from_slice(node.as_bytes());
    (xxhash_rust::xxh3::xxh3_64(&key), node)
}

#[derive(Debug, Default)]
struct Inner {
    /// Connected proxies that announced a peer address, by subscriber id,
    /// with the services each watches.
    peers: HashMap<u64, (Peer, BTreeSet<String>)>,
    /// Services whose scaling loop runs (what `last_active` may hold).
    scaled: BTreeSet<String>,
    /// Autoscaled services at zero instances now.
    at_zero: BTreeSet<String>,
    /// Per service of `scaled`: the node of the proxy that last reported
    /// requests (bounded by the services scaled, not by what proxies
    /// report).
    last_active: HashMap<String, String>,
    /// The current choice per service at zero.
    chosen: BTreeMap<String, Peer>,
}

impl Inner {
    /// Node -> peer address of the connected proxies that watch
    /// `service` (the lowest subscriber id's address when a node has
    /// several).
    fn nodes(&self, service: &str) -> BTreeMap<String, String> {
        let mixed = self.mixed();
        let mut ids: Vec<(&u64, &Peer)> = self
            .peers
            .iter()
            .filter(|(_, (_, watched))| watched.contains(service))
            .filter(|(_, (p, _))| !(mixed && is_loopback(&p.address)))
            .map(|(id, (p, _))| (id, p))
            .collect();
        ids.sort_by_key(|(id, _)| **id);
        let mut nodes = BTreeMap::new();
        for (_, p) in ids {
            nodes
                .entry(p.node.clone())
                .or_insert_with(|| p.address.clone());
        }
        nodes
    }

    /// Whether some peer addresses are loopback and others are not: then
    /// the proxies are not all on one machine, and a loopback address
    /// cannot be reached from the other nodes (it is never chosen).
    fn mixed(&self) -> bool {
        let mut loopback = self.peers.values().map(|(p, _)| is_loopback(&p.address));
        loopback.clone().any(|l| l) && loopback.any(|l| !l)
    }

    /// Drops choices that no longer hold and makes the missing ones; true
    /// if anything changed.
    fn settle(&mut self) -> bool {
        let before = self.chosen.clone();
        let kept: Vec<String> = self
            .chosen
            .iter()
            .filter(|(s, p)| {
                self.at_zero.contains(*s) && self.nodes(s).get(&p.node) == Some(&p.address)
            })
            .map(|(s, _)| s.clone())
            .collect();
        self.chosen.retain(|s, _| kept.contains(s));
        let missing: Vec<String> = self
            .at_zero
            .iter()
            .filter(|s| !self.chosen.contains_key(*s))
            .cloned()
            .collect();
        for service in missing {
            let last = self.last_active.get(&service).map(String::as_str);
            if let Some(p) = choose(&service, last, &self.nodes(&service)) {
                self.chosen.insert(service, p);
            }
        }
        self.chosen != before
    }
}

/// The placements of the services at zero, and who takes forwarded
/// requests. Subscribers watch [`Placements::changed`] and send what
/// differs from what they sent.
#[derive(Debug)]
pub struct Placements {
    inner: Mutex<Inner>,
    /// Bumped on every change of the choices.
    generation: watch::Sender<u64>,
    /// The hop credential sent to subscribers with the peers
    /// ([`hop_token`]).
    hop_token: String,
}

impl Default for Placements {
    fn default() -> Self {
        Self {
            inner: Mutex::default(),
            generation: watch::channel(0).0,
            hop_token: hop_token(),
        }
    }
}

/// A random hop credential: 32 bytes from the kernel's generator
/// (`/dev/urandom`), in hex. Proxies trust a forwarded request only with
/// it, so it must not be guessable: when the generator cannot be read it
/// is empty, and no hop is trusted (forwarded requests are then held
/// where they arrive, as ordinary ones).
fn hop_token() -> String {
    use std::io::Read;
    let mut bytes = [0u8; 32];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if let Err(e) = read {
        tracing::error!(error = %e, "no hop credential (cannot read /dev/urandom): peer hops are not trusted");
        return String::new();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Placements {
    /// The hop credential subscribers get with the peers (empty when
    /// none could be made).
    pub fn hop_token(&self) -> &str {
        &self.hop_token
    }

    /// Applies `f`; when it `touched` anything, settles the choices and
    /// tells the subscribers (the peers may have changed even when the
    /// choices did not: they compare what they sent).
    fn update(&self, f: impl FnOnce(&mut Inner) -> bool) {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let touched = f(&mut inner);
        if touched {
            inner.settle();
            self.generation.send_modify(|g| *g += 1);
        }
    }

    /// A proxy connected on `node`, taking forwarded requests at `address`
    /// (either empty: it takes none) for the services it `watches`.
    pub fn join(&self, subscriber: u64, node: &str, address: &str, watches: &BTreeSet<String>) {
        if node.is_empty() || address.is_empty() {
            return;
        }
        let peer = Peer {
            node: node.to_owned(),
            address: address.to_owned(),
        };
        let entry = (peer, watches.clone());
        self.update(|i| {
            let fresh = i.peers.insert(subscriber, entry).is_none();
            let twin = i
                .peers
                .iter()
                .any(|(id, (p, _))| *id != subscriber && p.node == node && p.address != address);
            if twin {
                tracing::warn!(
                    node,
                    address,
                    "two connected proxies claim this node at different peer addresses: they count \
                     as one node (the first one's address is used) and share its subset index; \
                     node names must be unique per machine"
                );
            }
            if i.mixed() {
                tracing::warn!(
                    node,
                    address,
                    "peer proxies announce loopback and other addresses: the loopback ones are \
                     never chosen (set control.peer_address to an address other nodes reach)"
                );
            }
            fresh
        });
    }

    /// A connected proxy now watches `watches` (a `Subscribe`).
    pub fn watching(&self, subscriber: u64, watches: &BTreeSet<String>) {
        self.update(|i| match i.peers.get_mut(&subscriber) {
            Some((_, w)) if w != watches => {
                w.clone_from(watches);
                true
            }
            _ => false,
        });
    }

    /// A proxy's stream ended.
    pub fn leave(&self, subscriber: u64) {
        self.update(|i| i.peers.remove(&subscriber).is_some());
    }

    /// The proxy on `node` reported requests for `service` (kept only for
    /// a service whose scaling loop runs).
    pub fn record_activity(&self, service: &str, node: &str) {
        if node.is_empty() {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if inner.scaled.contains(service)
            && inner.last_active.get(service).map(String::as_str) != Some(node)
        {
            inner
                .last_active
                .insert(service.to_owned(), node.to_owned());
        }
    }

    /// Whether `service` has no instance now (its scaling loop says, at
    /// each decision).
    pub fn set_at_zero(&self, service: &str, at_zero: bool) {
        self.update(|i| {
            if !i.scaled.contains(service) {
                i.scaled.insert(service.to_owned());
            }
            if at_zero {
                i.at_zero.insert(service.to_owned())
            } else {
                i.at_zero.remove(service)
            }
        });
    }

    /// `service`'s scaling loop ended: nothing of it is kept.
    pub fn forget(&self, service: &str) {
        self.update(|i| {
            i.last_active.remove(service);
            i.at_zero.remove(service) | i.scaled.remove(service)
        });
    }

    /// The IP addresses of the connected proxies that take forwarded
    /// requests (addresses that do not parse as `ip:port` are left out).
    pub fn peer_ips(&self) -> BTreeSet<std::net::IpAddr> {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner
            .peers
            .values()
            .filter_map(|(p, _)| p.address.parse::<std::net::SocketAddr>().ok())
            .map(|a| a.ip().to_canonical())
            .collect()
    }

    /// The current choices.
    pub fn current(&self) -> BTreeMap<String, Peer> {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .chosen
            .clone()
    }

    /// Changes whenever the choices or the peers may have changed.
    pub fn changed(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_hop_credential_is_random_per_plane() {
        let (a, b) = (Placements::default(), Placements::default());
        for t in [a.hop_token(), b.hop_token()] {
            assert_eq!(t.len(), 64, "{t}");
            assert!(t.bytes().all(|c| c.is_ascii_hexdigit()), "{t}");
        }
        assert_ne!(a.hop_token(), b.hop_token());
    }

    fn nodes(names: &[String]) -> BTreeMap<String, String> {
        names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), format!("10.0.0.{i}:80")))
            .collect()
    }

    fn names() -> impl Strategy<Value = Vec<String>> {
        proptest::collection::btree_set("[a-z]{1,6}", 1..8).prop_map(|s| s.into_iter().collect())
    }

    proptest! {
        /// The choice is one of the nodes, and the same for any order of
        /// the same nodes (a set, not a list).
        #[test]
        fn the_choice_is_a_known_node(service in "[a-z]{1,8}/[a-z]{1,8}", ns in names()) {
            let set = nodes(&ns);
            let p = choose(&service, None, &set).expect("a node");
            prop_assert_eq!(set.get(&p.node), Some(&p.address));
        }

        /// Rendezvous stability: removing a node that was not chosen keeps
        /// the choice; adding a node either keeps it or picks the new node.
        #[test]
        fn only_the_changed_node_moves_the_choice(
            service in "[a-z]{1,8}/[a-z]{1,8}",
            ns in names(),
            extra in "[A-Z]{1,6}",
        ) {
            let set = nodes(&ns);
            let first = choose(&service, None, &set).expect("a node").node;
            let mut grown = set.clone();
            grown.insert(extra.clone(), "10.1.0.1:80".into());
            let after = choose(&service, None, &grown).expect("a node").node;
            prop_assert!(after == first || after == extra);
            for gone in ns.iter().filter(|n| **n != first) {
                let mut shrunk = set.clone();
                shrunk.remove(gone);
                prop_assert_eq!(&choose(&service, None, &shrunk).expect("a node").node, &first);
            }
        }

        /// The node that last had requests wins while it is connected.
        #[test]
        fn the_last_active_node_wins(service in "[a-z]{1,8}", ns in names(), pick in any::<prop::sample::Index>()) {
            let set = nodes(&ns);
            let active = &ns[pick.index(ns.len())];
            prop_assert_eq!(&choose(&service, Some(active), &set).expect("a node").node, active);
            prop_assert!(choose(&service, Some("not-connected"), &set).is_some());
        }
    }

    /// What is kept of activity is bounded by the services scaled: reports
    /// for any other name are not kept, and a service whose loop ended is
    /// forgotten.
    #[test]
    fn activity_is_kept_only_for_services_scaled() {
        let a: BTreeSet<String> = ["ns/a".to_owned()].into();
        let p = Placements::default();
        p.join(1, "n1", "10.0.0.1:80", &a);
        p.join(2, "n2", "10.0.0.2:80", &a);
        for i in 0..1000 {
            p.record_activity(&format!("ns/unknown-{i}"), "n1");
        }
        p.set_at_zero("ns/a", false);
        p.record_activity("ns/a", "n2");
        let kept = |p: &Placements| p.inner.lock().expect("lock").last_active.len();
        assert_eq!(kept(&p), 1);
        p.set_at_zero("ns/a", true);
        assert_eq!(p.current()["ns/a"].node, "n2", "the last active node");
        p.forget("ns/a");
        assert_eq!(kept(&p), 0);
        assert!(p.current().is_empty());
        assert!(p.inner.lock().expect("lock").scaled.is_empty());
    }

    /// A loopback peer address is chosen only when every peer's is (all
    /// proxies on one machine): with others, it cannot be reached.
    #[test]
    fn a_loopback_peer_is_not_chosen_beside_reachable_ones() {
        let a: BTreeSet<String> = ["ns/a".to_owned()].into();
        let p = Placements::default();
        p.set_at_zero("ns/a", true);
        p.join(1, "n1", "127.0.0.1:80", &a);
        p.join(2, "n2", "127.0.0.1:81", &a);
        assert!(
            p.current().contains_key("ns/a"),
            "one machine: loopback is fine"
        );
        p.join(3, "n3", "10.0.0.3:80", &a);
        p.leave(1);
        p.leave(2);
        p.join(4, "n4", "[::1]:80", &a);
        for _ in 0..3 {
            assert_eq!(p.current()["ns/a"].node, "n3");
            p.set_at_zero("ns/a", false);
            p.set_at_zero("ns/a", true);
        }
        p.leave(3);
        assert_eq!(p.current()["ns/a"].node, "n4", "alone again");
    }

    /// Proxies with one node name are one node (as for subset indices: a
    /// node's proxies, e.g. both processes of a binary upgrade, share
    /// one): the first connected one's address is used, the other's once
    /// it is alone.
    #[test]
    fn proxies_with_one_node_name_are_one_node() {
        let a: BTreeSet<String> = ["ns/a".to_owned()].into();
        let p = Placements::default();
        p.set_at_zero("ns/a", true);
        p.join(1, "n1", "10.0.0.1:80", &a);
        p.join(2, "n1", "10.0.0.9:80", &a);
        assert_eq!(p.current()["ns/a"].address, "10.0.0.1:80");
        assert_eq!(p.peer_ips().len(), 2, "both addresses are peers");
        p.leave(1);
        assert_eq!(p.current()["ns/a"].address, "10.0.0.9:80");
    }

    #[test]
    fn no_nodes_no_choice() {
        assert_eq!(choose("ns/a", Some("x"), &BTreeMap::new()), None);
    }

    #[test]
    fn a_choice_is_kept_until_the_service_scales_or_its_node_leaves() {
        let a: BTreeSet<String> = ["ns/a".to_owned()].into();
        let p = Placements::default();
        let mut changed = p.changed();
        p.set_at_zero("ns/a", true);
        assert!(p.current().is_empty(), "no proxy yet: no choice");
        p.join(1, "n1", "10.0.0.1:80", &a);
        assert_eq!(p.current()["ns/a"].node, "n1");
        assert!(changed.has_changed().expect("open"));
        changed.mark_unchanged();
        // Another proxy joins and reports requests: the choice stays (the
        // subscribers are told: the peers changed).
        p.join(2, "n2", "10.0.0.2:80", &a);
        p.record_activity("ns/a", "n2");
        assert_eq!(p.current()["ns/a"].node, "n1");
        assert!(changed.has_changed().expect("open"));
        let ips: Vec<String> = p.peer_ips().iter().map(ToString::to_string).collect();
        assert_eq!(ips, ["10.0.0.1", "10.0.0.2"]);
        // The chosen node leaves: the node with the last requests takes it.
        p.leave(1);
        assert_eq!(p.current()["ns/a"].node, "n2");
        // An instance starts: no placement; back at zero, chosen again.
        p.set_at_zero("ns/a", false);
        assert!(p.current().is_empty());
        p.join(3, "n1", "10.0.0.1:80", &a);
        p.record_activity("ns/a", "n1");
        p.set_at_zero("ns/a", true);
        assert_eq!(p.current()["ns/a"].node, "n1", "the last active node");
        // A proxy without a peer address takes no forwarded requests.
        p.leave(2);
        p.leave(3);
        p.join(4, "n4", "", &a);
        assert!(p.current().is_empty());
    }

    /// Only a proxy that watches the service (routes it, can activate it)
    /// is chosen; one that starts watching it can be, one that stops
    /// watching it loses the placement.
    #[test]
    fn only_a_proxy_that_watches_the_service_is_chosen() {
        let a: BTreeSet<String> = ["ns/a".to_owned()].into();
        let other: BTreeSet<String> = ["ns/b".to_owned()].into();
        let p = Placements::default();
        p.set_at_zero("ns/a", true);
        p.join(1, "n1", "10.0.0.1:80", &other);
        assert!(p.current().is_empty(), "n1 does not route ns/a");
        p.join(2, "n2", "10.0.0.2:80", &a);
        assert_eq!(p.current()["ns/a"].node, "n2");
        p.watching(1, &a);
        assert_eq!(p.current()["ns/a"].node, "n2", "kept while n2 watches it");
        p.watching(2, &other);
        assert_eq!(p.current()["ns/a"].node, "n1", "n2 stopped watching it");
        p.watching(1, &other);
        assert!(p.current().is_empty());
    }
}
