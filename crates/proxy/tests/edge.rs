//! The edge filters through real sockets: deny rules (drop and reset as a
//! client sees them, reloaded), PROXY protocol v2 from an L4 listener into
//! an HTTP listener (the client's address in `X-Forwarded-For`, the access
//! log and a `client_address` hash), the trust rules of the PROXY
//! protocol, and a listener's `default_cluster`.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use common::{DEADLINE, Gated, backends, client, eventually, get, proxy_metric};
use http::StatusCode;
use meshless_balance::{PickContext, hash_key};
use meshless_proxy::{Proxy, ProxyConfig, proxy_protocol};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

async fn connect_from(from: u8, to: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, from)),
        0,
    ))
    .unwrap();
    s.connect(to).await.unwrap()
}

/// What a client from `127.0.0.<from>` that sends nothing reads:
/// `Ok(bytes)` up to the end of stream, or the error kind (an RST may
/// already fail the connect).
async fn outcome(from: u8, to: SocketAddr) -> Result<Vec<u8>, std::io::ErrorKind> {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, from)),
        0,
    ))
    .unwrap();
    read_all(s.connect(to).await.map_err(|e| e.kind())?).await
}

/// What a client reads from a connection it sends nothing on: `Ok(bytes)`
/// up to the end of stream, or the error kind.
async fn read_all(mut s: TcpStream) -> Result<Vec<u8>, std::io::ErrorKind> {
    let mut buf = Vec::new();
    tokio::time::timeout(DEADLINE, s.read_to_end(&mut buf))
        .await
        .expect("the connection ends")
        .map(|_| buf)
        .map_err(|e| e.kind())
}

/// An HTTP/1.1 GET written by hand on `s`; the response as text.
async fn raw_get(mut s: TcpStream) -> Result<String, std::io::ErrorKind> {
    s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .map_err(|e| e.kind())?;
    read_all(s)
        .await
        .map(|b| String::from_utf8_lossy(&b).into_owned())
}

fn http_yaml(backend: SocketAddr, listener_extra: &str) -> String {
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: c }}]\n{listener_extra}clusters:\n  - name: c\n    endpoints: [{{ address: \"{backend}\" }}]\n"
    )
}

/// `drop` closes (the client reads end of stream), `reset` sends RST
/// (`ECONNRESET`), others are served; counted per rule; a reload
/// changes the rules for new connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_rules_drop_and_reset_and_reload() {
    let bs = backends(1).await;
    let rules = "    deny:\n      - { name: dropped, sources: [127.0.0.2/32, \"::ffff:127.0.0.5/128\"], action: drop }\n      - { name: reset, sources: [127.0.0.3/32] , action: reset }\n";
    let yaml = http_yaml(bs[0].local_addr(), rules);
    let p = Proxy::start(common::on_test_http1(
        ProxyConfig::parse(&yaml, "edge.yaml").unwrap(),
    ))
    .await
    .unwrap();
    let addr = p.listener_addr("web").await.unwrap();
    assert_eq!(outcome(2, addr).await, Ok(vec![]));
    assert_eq!(outcome(5, addr).await, Ok(vec![]));
    assert_eq!(
        outcome(3, addr).await,
        Err(std::io::ErrorKind::ConnectionReset)
    );
    let ok = raw_get(connect_from(4, addr).await).await.unwrap();
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    let count = |rule: &str, action: &str| {
        format!(
            "meshless_proxy_denied_connections_total{{listener=\"web\",rule=\"{rule}\",action=\"{action}\"}}"
        )
    };
    assert_eq!(proxy_metric(&p, &count("dropped", "drop")).await, 2.0);
    assert_eq!(proxy_metric(&p, &count("reset", "reset")).await, 1.0);
    // Reloaded: 127.0.0.4 is reset now, 127.0.0.2 served.
    let reloaded = http_yaml(
        bs[0].local_addr(),
        "    deny:\n      - { name: four, sources: [127.0.0.4/32], action: reset }\n",
    );
    p.reload(common::on_test_http1(
        ProxyConfig::parse(&reloaded, "edge.yaml").unwrap(),
    ))
    .await
    .unwrap();
    assert_eq!(
        outcome(4, addr).await,
        Err(std::io::ErrorKind::ConnectionReset)
    );
    let ok = raw_get(connect_from(2, addr).await).await.unwrap();
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    assert_eq!(proxy_metric(&p, &count("four", "reset")).await, 1.0);
    p.shutdown().await;
}

/// An L4 instance sends PROXY v2 to an L7 instance that trusts it: the
/// backend sees each client's own address in `X-Forwarded-For`, the
/// access log records it, and the L7 `client_address` hash follows it (the
/// backend reached is the one the L7 cluster picks for that address).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_protocol_carries_the_client_through_l4_to_l7() {
    let gs = [
        Gated::start("g0").await,
        Gated::start("g1").await,
        Gated::start("g2").await,
    ];
    for g in &gs {
        g.open();
    }
    let tmp = tempfile::Builder::new()
        .prefix("meshless-edge-")
        .tempdir()
        .unwrap();
    let log = tmp.path().join("access.log");
    let l7_yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\naccess_log: \"{}\"\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    proxy_protocol: {{ trusted: [127.0.0.1/32] }}\n    routes: [{{ cluster: c }}]\nclusters:\n  - name: c\n    balancer: {{ policy: maglev, hash_key: client_address, table_size: 1021 }}\n    endpoints:\n{}",
        log.display(),
        gs.iter()
            .map(|g| format!("      - {{ address: \"{}\" }}\n", g.local_addr()))
            .collect::<String>()
    );
    let l7 = Proxy::start(common::on_test_http1(
        ProxyConfig::parse(&l7_yaml, "l7.yaml").unwrap(),
    ))
    .await
    .unwrap();
    let l7_addr = l7.listener_addr("web").await.unwrap();
    let l4_yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: l4\n    address: \"127.0.0.1:0\"\n    protocol: tcp\n    tcp: {{ cluster: l7 }}\nclusters:\n  - name: l7\n    proxy_protocol: v2\n    endpoints: [{{ address: \"{l7_addr}\" }}]\n"
    );
    let l4 = Proxy::start(common::on_test_http1(
        ProxyConfig::parse(&l4_yaml, "l4.yaml").unwrap(),
    ))
    .await
    .unwrap();
    let l4_addr = l4.listener_addr("l4").await.unwrap();
    let mut reached = std::collections::HashSet::new();
    for from in 2..32u8 {
        let ip = format!("127.0.0.{from}");
        let before: Vec<usize> = gs.iter().map(|g| g.seen().len()).collect();
        let resp = raw_get(connect_from(from, l4_addr).await).await.unwrap();
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        let (i, g) = gs
            .iter()
            .enumerate()
            .find(|(i, g)| g.seen().len() > before[*i])
            .expect("a backend got it");
        let seen = g.seen().pop().unwrap();
        assert_eq!(seen.headers["x-forwarded-for"], ip.as_str());
        let snap = l7.state().snapshot.load();
        let c = &snap.clusters["c"];
        let want =
            c.lb.pick_index(&PickContext::new().with_key(hash_key(ip.as_bytes())))
                .unwrap();
        assert_eq!(
            c.lb.endpoints()[want].id.to_string(),
            gs[i].local_addr().to_string(),
            "the hash of {ip} picks the backend reached"
        );
        reached.insert(i);
    }
    assert!(
        reached.len() >= 2,
        "30 clients hash to more than one backend"
    );
    eventually("the access log names a client", || async {
        std::fs::read_to_string(&log).is_ok_and(|t| {
            t.lines().any(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .is_ok_and(|v| v["client"] == "127.0.0.7")
            })
        })
    })
    .await;
    l4.shutdown().await;
    l7.shutdown().await;
}

/// Trust: an untrusted peer sending a header is closed, a trusted peer
/// without one is closed (`required`), an untrusted peer without one is
/// served as itself, a header's client meets the deny rules, and a
/// malformed header is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_protocol_is_taken_from_trusted_peers_only() {
    let bs = backends(1).await;
    let extra = "    proxy_protocol: { trusted: [127.0.0.1/32] }\n    deny: [{ name: bad-client, sources: [192.0.2.0/24], action: drop }]\n";
    let p = Proxy::start(common::on_test_http1(
        ProxyConfig::parse(&http_yaml(bs[0].local_addr(), extra), "edge.yaml").unwrap(),
    ))
    .await
    .unwrap();
    let addr = p.listener_addr("web").await.unwrap();
    let header = |client: &str| {
        proxy_protocol::encode(client.parse().unwrap(), "127.0.0.1:80".parse().unwrap())
    };
    let with_header = |from: u8, h: Vec<u8>| async move {
        let mut s = connect_from(from, addr).await;
        s.write_all(&h).await.unwrap();
        raw_get(s).await
    };
    let ok = with_header(1, header("198.51.100.7:5000")).await.unwrap();
    assert!(ok.starts_with("HTTP/1.1 200"), "trusted with header: {ok}");
    let refused = with_header(9, header("198.51.100.7:5000")).await;
    assert!(
        !refused.is_ok_and(|r| r.contains("200")),
        "untrusted with header"
    );
    let refused = raw_get(connect_from(1, addr).await).await;
    assert!(
        !refused.is_ok_and(|r| r.contains("200")),
        "trusted without header"
    );
    let ok = raw_get(connect_from(9, addr).await).await.unwrap();
    assert!(
        ok.starts_with("HTTP/1.1 200"),
        "untrusted without header: {ok}"
    );
    let denied = with_header(1, header("192.0.2.9:5000")).await;
    assert!(!denied.is_ok_and(|r| r.contains("200")), "denied client");
    let mut bad = header("198.51.100.7:5000");
    bad[12] = 0x31;
    let refused = with_header(1, bad).await;
    assert!(!refused.is_ok_and(|r| r.contains("200")), "version 3");
    let reason = |r: &str| {
        format!("meshless_proxy_proxy_protocol_refused_total{{listener=\"web\",reason=\"{r}\"}}")
    };
    assert_eq!(proxy_metric(&p, &reason("untrusted")).await, 1.0);
    assert_eq!(proxy_metric(&p, &reason("missing")).await, 1.0);
    assert_eq!(proxy_metric(&p, &reason("malformed")).await, 1.0);
    assert_eq!(
        proxy_metric(
            &p,
            "meshless_proxy_denied_connections_total{listener=\"web\",rule=\"bad-client\",action=\"drop\"}"
        )
        .await,
        1.0
    );
    p.shutdown().await;
}

/// Requests no route matches go to `default_cluster`; matched ones to
/// their route's cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmatched_requests_go_to_the_default_cluster() {
    let bs = backends(2).await;
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    default_cluster: fallback\n    routes: [{{ match: {{ path_prefix: /api }}, cluster: api }}]\nclusters:\n  - name: api\n    endpoints: [{{ address: \"{}\" }}]\n  - name: fallback\n    endpoints: [{{ address: \"{}\" }}]\n",
        bs[0].local_addr(),
        bs[1].local_addr()
    );
    let p = Proxy::start(common::on_test_http1(
        ProxyConfig::parse(&yaml, "edge.yaml").unwrap(),
    ))
    .await
    .unwrap();
    let addr = p.listener_addr("web").await.unwrap();
    let c = client();
    let (s, b, _) = get(&c, addr, "/api/x", &[]).await;
    assert_eq!((s, b.as_str()), (StatusCode::OK, "b0"));
    let (s, b, _) = get(&c, addr, "/elsewhere", &[]).await;
    assert_eq!((s, b.as_str()), (StatusCode::OK, "b1"));
    // Without it, no route is a 404.
    let no_default = yaml.replace("    default_cluster: fallback\n", "");
    p.reload(common::on_test_http1(
        ProxyConfig::parse(&no_default, "edge.yaml").unwrap(),
    ))
    .await
    .unwrap();
    let (s, _, _) = get(&c, addr, "/elsewhere", &[]).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    p.shutdown().await;
}

/// Bad edge settings are refused at load with the field at fault.
#[test]
fn edge_settings_are_validated() {
    let base = "listeners:\n  - name: l\n    address: \"127.0.0.1:7000\"\n";
    let cluster = "clusters:\n  - name: c\n    endpoints: [{ address: \"127.0.0.1:1\" }]\n";
    let err = |listener: &str, clusters: &str| {
        ProxyConfig::parse(&format!("{base}{listener}{clusters}"), "e.yaml")
            .unwrap_err()
            .to_string()
    };
    let e = err("    protocol: tcp\n", cluster);
    assert!(
        e.contains("listeners[0].tcp: a `protocol: tcp` listener needs"),
        "{e}"
    );
    let e = err("    protocol: tcp\n    tcp: { cluster: nope }\n", cluster);
    assert!(
        e.contains("listeners[0].tcp.cluster: unknown cluster"),
        "{e}"
    );
    let e = err(
        "    protocol: tcp\n    tcp: { cluster: c }\n    tls: { default_certificate: { certificate: a.pem, key: a.key } }\n",
        cluster,
    );
    assert!(
        e.contains("listeners[0].tls: TLS is terminated on HTTP"),
        "{e}"
    );
    let e = err("    routes: []\n    default_cluster: nope\n", cluster);
    assert!(
        e.contains("listeners[0].default_cluster: unknown cluster"),
        "{e}"
    );
    let e = err(
        "    routes: [{ cluster: c }]\n    deny: [{ name: x, sources: [10.0.0.1/8] }]\n",
        cluster,
    );
    assert!(
        e.contains("listeners[0].deny[0].sources") && e.contains("host bits"),
        "{e}"
    );
    let e = err(
        "    routes: [{ cluster: c }]\n",
        &cluster.replace("    endpoints", "    proxy_protocol: v2\n    endpoints"),
    );
    assert!(
        e.contains("clusters[0].proxy_protocol: only for clusters of `protocol: tcp`"),
        "{e}"
    );
    let e = err(
        "    routes: [{ cluster: c }]\n    socket: { congestion_control: no-such-algorithm }\n",
        cluster,
    );
    assert!(e.contains("listeners[0].socket.congestion_control"), "{e}");
    // Two listeners on one address: only with reuse_port on both.
    let two = |opt: &str| {
        format!(
            "{base}    routes: [{{ cluster: c }}]\n{opt}  - name: m\n    address: \"127.0.0.1:7000\"\n    routes: [{{ cluster: c }}]\n{opt}{cluster}"
        )
    };
    let e = ProxyConfig::parse(&two(""), "e.yaml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("listeners[1].address"), "{e}");
    ProxyConfig::parse(&two("    socket: { reuse_port: true }\n"), "e.yaml").unwrap();
}

/// Two listeners share one port with `reuse_port`: the kernel spreads
/// connections over both, and both serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reuse_port_listeners_share_a_port() {
    let bs = backends(1).await;
    let one = http_yaml(bs[0].local_addr(), "    socket: { reuse_port: true }\n");
    let p = Proxy::start(common::on_test_http1(
        ProxyConfig::parse(&one, "edge.yaml").unwrap(),
    ))
    .await
    .unwrap();
    let addr = p.listener_addr("web").await.unwrap();
    let second = format!(
        "  - name: twin\n    address: \"{addr}\"\n    socket: {{ reuse_port: true }}\n    routes: [{{ cluster: c }}]\n"
    );
    let two = one.replace("clusters:\n", &format!("{second}clusters:\n"));
    p.reload(common::on_test_http1(
        ProxyConfig::parse(&two, "edge.yaml").unwrap(),
    ))
    .await
    .unwrap();
    // 64 open connections from distinct ports: all on one listener has
    // probability 2^-63 under the kernel's hash.
    let mut open = Vec::new();
    for _ in 0..64 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 12];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"HTTP/1.1 200");
        open.push(s);
    }
    for l in ["web", "twin"] {
        let series = format!("meshless_proxy_downstream_connections{{listener=\"{l}\"}}");
        let n = proxy_metric(&p, &series).await;
        assert!(n >= 1.0, "{l} served none of 64 connections");
    }
    drop(open);
    p.shutdown().await;
}

/// A cluster that sends PROXY headers on its flows sends one (`LOCAL`) on
/// its health checks too: the L7 tier behind it requires a header from
/// the L4 tier, and checks without one would be refused and mark every
/// endpoint down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_of_a_proxy_protocol_cluster_send_a_local_header() {
    let g = Gated::start("g0").await;
    g.open();
    let l7_yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    proxy_protocol: {{ trusted: [127.0.0.1/32] }}\n    routes: [{{ cluster: c }}]\nclusters:\n  - name: c\n    endpoints: [{{ address: \"{}\" }}]\n",
        g.local_addr()
    );
    let l7 = Proxy::start(common::on_test_http1(
        ProxyConfig::parse(&l7_yaml, "l7.yaml").unwrap(),
    ))
    .await
    .unwrap();
    let l7_addr = l7.listener_addr("web").await.unwrap();
    let l4_yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\nlisteners:\n  - name: l4\n    address: \"127.0.0.1:0\"\n    protocol: tcp\n    tcp: {{ cluster: l7 }}\nclusters:\n  - name: l7\n    proxy_protocol: v2\n    health_check: {{ path: /, interval: 100ms, unhealthy_threshold: 1, healthy_threshold: 1 }}\n    endpoints: [{{ address: \"{l7_addr}\" }}]\n"
    );
    let l4 = Proxy::start(ProxyConfig::parse(&l4_yaml, "l4.yaml").unwrap())
        .await
        .unwrap();
    let checks =
        format!("meshless_proxy_health_checks_total{{cluster=\"l7\",endpoint=\"{l7_addr}\"}}");
    eventually("three health checks ran", || async {
        proxy_metric(&l4, &checks).await >= 3.0
    })
    .await;
    let failures = format!(
        "meshless_proxy_health_check_failures_total{{cluster=\"l7\",endpoint=\"{l7_addr}\"}}"
    );
    assert_eq!(proxy_metric(&l4, &failures).await, 0.0);
    let snap = l4.state().snapshot.load();
    assert!(
        snap.clusters["l7"].lb.stats(0).is_some_and(|s| s.healthy),
        "the L7 tier stays healthy"
    );
    let missing =
        "meshless_proxy_proxy_protocol_refused_total{listener=\"web\",reason=\"missing\"}";
    assert_eq!(proxy_metric(&l7, missing).await, 0.0);
    let checked = g.seen().iter().any(|s| {
        s.headers
            .get("user-agent")
            .is_some_and(|u| u == "meshless-health-check")
    });
    assert!(
        checked,
        "the checks reached the backend through the L7 tier"
    );
}
