//! Ahead-of-time placement through real sockets: one control plane with a
//! service at zero (process scaler), two proxies on different nodes that
//! take forwarded requests. The control plane places the service on one
//! node before any request; a request to the other proxy is forwarded to
//! the chosen node's proxy, which activates locally; with the chosen
//! proxy unreachable, the other proxy activates itself.

mod common;

use std::net::SocketAddr;

use common::*;
use http::StatusCode;
use meshless_control::config::ControlConfig;
use meshless_control::plane::ControlPlane;
use meshless_proxy::Proxy;

/// A control plane with `demo/lazy` at zero, one instance at most, each a
/// Python HTTP server on `$PORT`.
fn lazy_plane() -> ControlConfig {
    plane_running(
        "[python3, -c, \"import http.server as h, os\\nh.HTTPServer(('127.0.0.1', int(os.environ['PORT'])), h.SimpleHTTPRequestHandler).serve_forever()\"]",
    )
}

/// Like [`lazy_plane`], with instances that answer with the request's
/// `X-Forwarded-For|X-Forwarded-Proto`.
fn echo_plane() -> ControlConfig {
    let script = "import http.server as h, os\n\
        class H(h.BaseHTTPRequestHandler):\n    \
          def do_GET(self):\n        \
            b = ('%s|%s' % (self.headers.get('x-forwarded-for'), self.headers.get('x-forwarded-proto'))).encode()\n        \
            self.send_response(200)\n        \
            self.send_header('content-length', str(len(b)))\n        \
            self.end_headers()\n        \
            self.wfile.write(b)\n\
        h.HTTPServer(('127.0.0.1', int(os.environ['PORT'])), H).serve_forever()\n";
    plane_running(&format!("[python3, -c, {script:?}]"))
}

fn plane_running(command: &str) -> ControlConfig {
    let yaml = format!(
        "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\nservices:\n  - namespace: demo\n    name: lazy\n    autoscaling:\n      min_instances: 0\n      max_instances: 1\n      target_concurrency: 10\n      tick: 100ms\n      scaler:\n        process:\n          command: {command}\n          start_timeout: 20s\n          stop_grace: 2s\n"
    );
    ControlConfig::parse(&yaml, "control.yaml").expect("valid control config")
}

/// A proxy on `node` following `demo/lazy`; `peer` is the YAML of its
/// peer settings inside `control:` (empty: it takes no forwarded requests).
fn lazy_proxy(grpc: SocketAddr, node: &str, peer: &str) -> String {
    format!(
        "node: {{ name: {node} }}\nadmin: {{ address: \"127.0.0.1:0\" }}\ncontrol: {{ address: \"{grpc}\"{peer} }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: lazy }}]\nclusters:\n  - name: lazy\n    service: demo/lazy\n    activation: {{ queue_timeout: 20s }}\n"
    )
}

/// Waits until `p` has a placement for `demo/lazy`; returns its node.
async fn placed_node(p: &Proxy) -> String {
    eventually("a placement for demo/lazy", || async {
        !p.state().placements.list().is_empty()
    })
    .await;
    p.state().placements.list()[0].1.clone()
}

/// The nodes of `demo/lazy`'s endpoints, from the registration API.
async fn instance_nodes(api: SocketAddr) -> Vec<String> {
    let (_, view) = api_call(
        api,
        http::Method::GET,
        "/v1/services/demo/lazy",
        serde_json::Value::Null,
    )
    .await;
    view["endpoints"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|e| e["node"].as_str().map(str::to_owned))
        .collect()
}

fn activations(result: &str) -> String {
    format!("meshless_proxy_activations_total{{result=\"{result}\"}}")
}

/// Two proxies that both take forwarded requests, on `node-a` and
/// `node-b`; returns them as (chosen, other) with the other's listener.
async fn two_proxies(grpc: SocketAddr) -> (Proxy, Proxy, SocketAddr) {
    two_proxies_of(|node| lazy_proxy(grpc, node, ", peer_listener: web")).await
}

/// Like [`two_proxies`], each proxy's YAML made by `yaml(node)`.
async fn two_proxies_of(yaml: impl Fn(&str) -> String) -> (Proxy, Proxy, SocketAddr) {
    let (a, _) = proxy(&yaml("node-a")).await;
    let (b, addr_b) = proxy(&yaml("node-b")).await;
    let chosen = placed_node(&a).await;
    // Both proxies hear the same placement.
    eventually("both proxies placed", || async {
        b.state()
            .placements
            .list()
            .first()
            .is_some_and(|p| p.1 == chosen)
    })
    .await;
    if chosen == "node-a" {
        (a, b, addr_b)
    } else {
        let addr_a = a.listener_addr("web").await.expect("listener");
        (b, a, addr_a)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_request_is_served_on_the_chosen_node_through_its_proxy() {
    let plane = ControlPlane::start(lazy_plane()).await.expect("plane");
    let api = plane.api_addr();
    let (chosen, other, other_addr) = two_proxies(plane.grpc_addr()).await;
    let chosen_node = chosen.state().snapshot.load().config.node.name.clone();
    assert!(instance_nodes(api).await.is_empty(), "at zero");
    let (status, _, body) = get(&client(), other_addr, "/", &[]).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // The instance was started for the chosen node, by its proxy's hold.
    assert_eq!(
        instance_nodes(api).await,
        vec![chosen_node.clone().expect("node")]
    );
    assert_eq!(proxy_metric(&chosen, &activations("sent")).await, 1.0);
    assert_eq!(proxy_metric(&other, &activations("forwarded")).await, 1.0);
    assert_eq!(
        proxy_metric(&other, &activations("sent")).await,
        0.0,
        "the other proxy held nothing"
    );
    // The service has an instance: the placement is withdrawn.
    eventually("the placement withdrawn", || async {
        other.state().placements.list().is_empty()
    })
    .await;
    chosen.shutdown().await;
    other.shutdown().await;
    plane.shutdown().await;
}

/// The marker a peer proxy on `node-z` puts on a request it forwards,
/// with the hop credential `p` received.
fn marker_of(p: &Proxy) -> String {
    let token = p.state().placements.hop_token().expect("a hop credential");
    format!("node-z;client=203.0.113.9;token={token}")
}

/// A marked request from a peer proxy's address (both proxies are on
/// 127.0.0.1 here) with the hop credential is held where it arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_already_forwarded_is_never_forwarded_again() {
    let plane = ControlPlane::start(lazy_plane()).await.expect("plane");
    let api = plane.api_addr();
    let (chosen, other, other_addr) = two_proxies(plane.grpc_addr()).await;
    let other_node = other.state().snapshot.load().config.node.name.clone();
    let marker = marker_of(&other);
    let marked = [("x-meshless-forwarded-by", marker.as_str())];
    let (status, _, body) = get(&client(), other_addr, "/", &marked).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // Held where it arrived: the instance is the other node's.
    assert_eq!(instance_nodes(api).await, vec![other_node.expect("node")]);
    assert_eq!(proxy_metric(&other, &activations("forwarded")).await, 0.0);
    assert_eq!(proxy_metric(&chosen, &activations("sent")).await, 0.0);
    chosen.shutdown().await;
    other.shutdown().await;
    plane.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_chosen_proxy_unreachable_the_other_proxy_activates_itself() {
    let plane = ControlPlane::start(lazy_plane()).await.expect("plane");
    let api = plane.api_addr();
    let grpc = plane.grpc_addr();
    // The only proxy taking forwarded requests announces an address where
    // nothing listens (bound, then closed): it is chosen, and unreachable.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port");
    let peer = format!(", peer_listener: web, peer_address: \"{dead}\"");
    let (gone, _) = proxy(&lazy_proxy(grpc, "node-gone", &peer)).await;
    let (here, addr) = proxy(&lazy_proxy(grpc, "node-here", "")).await;
    assert_eq!(placed_node(&here).await, "node-gone");
    let (status, _, body) = get(&client(), addr, "/", &[]).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(instance_nodes(api).await, vec!["node-here".to_owned()]);
    assert_eq!(proxy_metric(&here, &activations("sent")).await, 1.0);
    assert_eq!(proxy_metric(&here, &activations("forwarded")).await, 0.0);
    assert_eq!(
        proxy_metric(&here, &activations("peer_unreachable")).await,
        1.0
    );
    // Passed over from now on: not chosen again while it is unreachable.
    assert!(
        here.state()
            .placements
            .target("demo/lazy", Some("node-here"), None)
            .is_none()
    );
    gone.shutdown().await;
    here.shutdown().await;
    plane.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_chosen_node_leaves_the_service_is_placed_on_another() {
    let plane = ControlPlane::start(lazy_plane()).await.expect("plane");
    let api = plane.api_addr();
    let (chosen, other, other_addr) = two_proxies(plane.grpc_addr()).await;
    let other_node = node_name(&other);
    chosen.shutdown().await;
    eventually("placed on the remaining node", || async {
        other
            .state()
            .placements
            .list()
            .first()
            .is_some_and(|p| p.1 == other_node)
    })
    .await;
    // Placed on its own node: it holds and activates locally.
    let (status, _, body) = get(&client(), other_addr, "/", &[]).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(instance_nodes(api).await, vec![other_node]);
    assert_eq!(proxy_metric(&other, &activations("forwarded")).await, 0.0);
    other.shutdown().await;
    plane.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_hop_keeps_the_original_clients_forwarding_headers() {
    let plane = ControlPlane::start(echo_plane()).await.expect("plane");
    let (chosen, other, other_addr) = two_proxies(plane.grpc_addr()).await;
    let xff = [("x-forwarded-for", "203.0.113.7")];
    let (status, _, body) = get(&client(), other_addr, "/", &xff).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(proxy_metric(&other, &activations("forwarded")).await, 1.0);
    // The first proxy appended its client; the chosen one added nothing
    // (it used to append the first proxy's address, and say `http` for a
    // client that came over TLS).
    assert_eq!(body, "203.0.113.7, 127.0.0.1|http");
    chosen.shutdown().await;
    other.shutdown().await;
    plane.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarding_marker_from_a_client_that_is_no_peer_is_not_trusted() {
    let plane = ControlPlane::start(echo_plane()).await.expect("plane");
    // The only proxy takes no forwarded requests: no peer address is known.
    let (here, addr) = proxy(&lazy_proxy(plane.grpc_addr(), "node-here", "")).await;
    let forged = [
        ("x-meshless-forwarded-by", "node-z"),
        ("x-forwarded-for", "203.0.113.7"),
        ("x-forwarded-proto", "https"),
    ];
    let (status, _, body) = get(&client(), addr, "/", &forged).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // Treated as any client's request: its address appended, the
    // protocol it used set.
    assert_eq!(body, "203.0.113.7, 127.0.0.1|http");
    assert!(
        !here
            .state()
            .placements
            .is_peer("127.0.0.1".parse().expect("ip"))
    );
    here.shutdown().await;
    plane.shutdown().await;
}

/// A marker from a peer proxy's address without the hop credential (or
/// with a wrong one: a control plane restarted since it forwarded) is not
/// trusted (its forwarding headers are the client's), and the request is
/// never forwarded again: one hop only, whatever the credentials say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_marker_from_a_peer_without_the_hop_credential_is_held_here_untrusted() {
    let plane = ControlPlane::start(echo_plane()).await.expect("plane");
    let api = plane.api_addr();
    let (chosen, other, other_addr) = two_proxies(plane.grpc_addr()).await;
    let other_node = node_name(&other);
    let token = other.state().placements.hop_token().expect("credential");
    let wrong = format!(
        "node-z;client=198.51.100.1;token={}",
        token.replace(&token[..1], "_")
    );
    for (i, marker) in [
        "node-z",
        "node-z;client=198.51.100.1;token=",
        wrong.as_str(),
    ]
    .into_iter()
    .enumerate()
    {
        let forged = [
            ("x-meshless-forwarded-by", marker),
            ("x-forwarded-for", "203.0.113.7"),
            ("x-forwarded-proto", "https"),
        ];
        let (status, _, body) = get(&client(), other_addr, "/", &forged).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body, "203.0.113.7, 127.0.0.1|http", "{marker}");
        if i == 0 {
            // Held and activated here, not on the chosen node.
            assert_eq!(instance_nodes(api).await, vec![other_node.clone()]);
            eventually("the placement withdrawn, the instance ready", || async {
                let snap = other.state().snapshot.load();
                other.state().placements.list().is_empty()
                    && snap.clusters.get("lazy").is_some_and(|c| {
                        let set = c.lb.set();
                        (0..set.len()).any(|e| set.is_available(e))
                    })
            })
            .await;
        }
    }
    assert_eq!(proxy_metric(&other, &activations("forwarded")).await, 0.0);
    assert_eq!(proxy_metric(&other, &activations("sent")).await, 1.0);
    assert_eq!(proxy_metric(&chosen, &activations("sent")).await, 0.0);
    chosen.shutdown().await;
    other.shutdown().await;
    plane.shutdown().await;
}

/// The client of a hop is the one the forwarding proxy computed with its
/// own `trusted_hops`, not the last `X-Forwarded-For` entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chosen_proxy_takes_the_client_the_forwarding_proxy_computed() {
    let plane = ControlPlane::start(echo_plane()).await.expect("plane");
    let grpc = plane.grpc_addr();
    let dir = tempfile::tempdir().expect("dir");
    let log = |node: &str| dir.path().join(format!("{node}.log"));
    let (chosen, other, other_addr) = two_proxies_of(|node| {
        let yaml = lazy_proxy(grpc, node, ", peer_listener: web").replace(
            "    routes:",
            "    forwarding: { trusted_hops: 1 }\n    routes:",
        );
        format!("access_log: \"{}\"\n{yaml}", log(node).display())
    })
    .await;
    // One proxy in front of `other` appended the client 203.0.113.7.
    let xff = [("x-forwarded-for", "192.0.2.1, 203.0.113.7")];
    let (status, _, body) = get(&client(), other_addr, "/", &xff).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(proxy_metric(&other, &activations("forwarded")).await, 1.0);
    // What `other` would have sent the instance itself.
    assert_eq!(body, "192.0.2.1, 203.0.113.7, 127.0.0.1|http");
    let node = node_name(&chosen);
    let path = log(&node);
    eventually("the chosen proxy's access log line", || async {
        std::fs::read_to_string(&path).is_ok_and(|t| t.contains("\"status\":200"))
    })
    .await;
    let line: serde_json::Value = std::fs::read_to_string(&path)
        .expect("log")
        .lines()
        .find(|l| l.contains("\"status\":200"))
        .and_then(|l| serde_json::from_str(l).ok())
        .expect("a JSON line");
    assert_eq!(line["client"], "203.0.113.7", "{line}");
    chosen.shutdown().await;
    other.shutdown().await;
    plane.shutdown().await;
}

/// The node name `p` was configured with.
fn node_name(p: &meshless_proxy::Proxy) -> String {
    p.state()
        .snapshot
        .load()
        .config
        .node
        .name
        .clone()
        .expect("node")
}
