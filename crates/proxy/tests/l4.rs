//! L4 (`protocol: tcp`) listeners through real sockets: instances agree
//! on a flow's endpoint, a flow keeps its endpoint across table changes,
//! a removed endpoint gets no new flows while its old ones stream until
//! the drain ends, half-close, and failed connects moving on and ejecting.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{
    DEADLINE, admin, api_call, endpoint_json, eventually, plane_config, proxy_metric, register_cart,
};
use meshless_balance::PickContext;
use meshless_proxy::l4::FlowKey;
use meshless_proxy::{Proxy, ProxyConfig};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// A TCP server that sends its name and a newline, echoes what it reads,
/// and at the client's end of stream sends `bye\n` and closes.
struct Echo {
    name: String,
    addr: SocketAddr,
    open: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Echo {
    async fn start(name: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicUsize::new(0));
        let (n, o) = (name.to_owned(), Arc::clone(&open));
        let task = tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let (n, o) = (n.clone(), Arc::clone(&o));
                tokio::spawn(async move {
                    o.fetch_add(1, Ordering::SeqCst);
                    let _ = s.write_all(format!("{n}\n").as_bytes()).await;
                    let mut buf = [0u8; 4096];
                    while let Ok(k) = s.read(&mut buf).await {
                        if k == 0 {
                            let _ = s.write_all(b"bye\n").await;
                            break;
                        }
                        if s.write_all(&buf[..k]).await.is_err() {
                            break;
                        }
                    }
                    o.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Self {
            name: name.to_owned(),
            addr,
            open,
            task,
        }
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn echoes(n: usize) -> Vec<Echo> {
    let mut v = Vec::new();
    for i in 0..n {
        v.push(Echo::start(&format!("e{i}")).await);
    }
    v
}

fn endpoints(addrs: &[SocketAddr]) -> String {
    addrs
        .iter()
        .map(|a| format!("      - {{ address: \"{a}\" }}\n"))
        .collect()
}

/// A proxy with one `tcp` listener `l4` sending to Maglev cluster `c`.
fn l4_yaml(addrs: &[SocketAddr], drain: &str, listener_extra: &str, cluster_extra: &str) -> String {
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: {drain}\nlisteners:\n  - name: l4\n    address: \"127.0.0.1:0\"\n    protocol: tcp\n    tcp: {{ cluster: c, flow_key: source_ip }}\n{listener_extra}clusters:\n  - name: c\n    balancer: {{ policy: maglev, table_size: 1021 }}\n    timeouts: {{ connect: 2s }}\n{cluster_extra}    endpoints:\n{}",
        endpoints(addrs)
    )
}

async fn start(yaml: &str) -> (Proxy, SocketAddr) {
    let p = Proxy::start(ProxyConfig::parse(yaml, "l4.yaml").unwrap())
        .await
        .unwrap();
    let addr = p.listener_addr("l4").await.unwrap();
    (p, addr)
}

/// A connection to `to` from the loopback address `127.0.0.<from>`.
async fn connect_from(from: u8, to: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, from)),
        0,
    ))
    .unwrap();
    s.connect(to).await.unwrap()
}

/// A flow from `127.0.0.<from>`: the endpoint's name line and the reader.
async fn flow(from: u8, to: SocketAddr) -> (String, BufReader<TcpStream>) {
    let mut r = BufReader::new(connect_from(from, to).await);
    let mut name = String::new();
    tokio::time::timeout(DEADLINE, r.read_line(&mut name))
        .await
        .expect("the endpoint names itself")
        .unwrap();
    (name.trim().to_owned(), r)
}

/// One echo round trip on an open flow.
async fn round_trip(r: &mut BufReader<TcpStream>, text: &str) -> String {
    r.get_mut()
        .write_all(format!("{text}\n").as_bytes())
        .await
        .unwrap();
    let mut line = String::new();
    tokio::time::timeout(DEADLINE, r.read_line(&mut line))
        .await
        .expect("echo")
        .unwrap();
    line.trim().to_owned()
}

/// A flow from `127.0.0.<from>` that sends `text` and closes its side:
/// everything it read until the flow ended.
async fn send_and_close(from: u8, to: SocketAddr, text: &str) -> String {
    let mut s = connect_from(from, to).await;
    s.write_all(text.as_bytes()).await.unwrap();
    s.shutdown().await.unwrap();
    let mut all = String::new();
    tokio::time::timeout(DEADLINE, s.read_to_string(&mut all))
        .await
        .expect("the flow ends")
        .unwrap();
    all
}

/// The endpoint id (address) the proxy's cluster `c` picks for `key`.
fn pick(p: &Proxy, key: u64) -> String {
    let snap = p.state().snapshot.load();
    let c = &snap.clusters["c"];
    let i = c.lb.pick_index(&PickContext::new().with_key(key)).unwrap();
    c.lb.endpoints()[i].id.to_string()
}

fn name_of(echoes: &[Echo], id: &str) -> String {
    echoes
        .iter()
        .find(|e| e.addr.to_string() == id)
        .map(|e| e.name.clone())
        .unwrap()
}

/// Two instances built independently from the same endpoints (listed in
/// opposite orders) pick the same endpoint for 10,000 flow keys of both
/// kinds, and 150 real flows from distinct source addresses reach that
/// endpoint through either instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_agree_on_every_flow() {
    let es = echoes(5).await;
    let addrs: Vec<SocketAddr> = es.iter().map(|e| e.addr).collect();
    let reversed: Vec<SocketAddr> = addrs.iter().rev().copied().collect();
    let (a, a_addr) = start(&l4_yaml(&addrs, "5s", "", "")).await;
    let (b, b_addr) = start(&l4_yaml(&reversed, "5s", "", "")).await;
    let mut rng = fastrand::Rng::with_seed(7);
    let mut per_endpoint = std::collections::HashMap::new();
    for i in 0..10_000u32 {
        let ip = if i % 2 == 0 {
            IpAddr::from(rng.u32(..).to_be_bytes())
        } else {
            IpAddr::from(rng.u128(..).to_be_bytes())
        };
        let client = SocketAddr::new(ip, rng.u16(..));
        let kind = if i % 3 == 0 {
            FlowKey::SourceIpPort
        } else {
            FlowKey::SourceIp
        };
        let key = kind.hash(client);
        let (pa, pb) = (pick(&a, key), pick(&b, key));
        assert_eq!(pa, pb, "instances disagree on {client} ({kind:?})");
        *per_endpoint.entry(pa).or_insert(0u32) += 1;
    }
    // Maglev spreads keys evenly: each of 5 gets about 2,000 (1021 slots
    // of 5 owners: 204 or 205 each).
    assert_eq!(per_endpoint.len(), 5, "{per_endpoint:?}");
    for (id, n) in &per_endpoint {
        assert!((1_700..=2_300).contains(n), "{id}: {n} of 10,000");
    }
    for from in 2..152u8 {
        let expected = name_of(
            &es,
            &pick(
                &a,
                FlowKey::SourceIp.hash(SocketAddr::new(
                    IpAddr::V4(Ipv4Addr::new(127, 0, 0, from)),
                    0,
                )),
            ),
        );
        let (via_a, _) = flow(from, a_addr).await;
        let (via_b, _) = flow(from, b_addr).await;
        assert_eq!(
            (&via_a, &via_b),
            (&expected, &expected),
            "flow from 127.0.0.{from}"
        );
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// A flow keeps streaming to its endpoint while endpoints are added
/// (the table changes) and after its endpoint is removed; the removed
/// endpoint gets no new flow; a reload that shortens `drain_timeout`
/// ends its drain, and the flow is closed and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flow_survives_table_changes_and_its_endpoint_drains() {
    let es = echoes(5).await;
    let addrs: Vec<SocketAddr> = es.iter().map(|e| e.addr).collect();
    let (p, addr) = start(&l4_yaml(&addrs[..3], "60s", "", "")).await;
    let (name, mut old) = flow(2, addr).await;
    assert_eq!(round_trip(&mut old, "one").await, "one");
    // More endpoints: the table changes, the flow stays.
    let grown = ProxyConfig::parse(&l4_yaml(&addrs, "60s", "", ""), "l4.yaml").unwrap();
    p.reload(grown).await.unwrap();
    assert_eq!(round_trip(&mut old, "two").await, "two");
    // Its endpoint leaves.
    let gone = es.iter().find(|e| e.name == name).unwrap();
    let rest: Vec<SocketAddr> = addrs.iter().copied().filter(|a| *a != gone.addr).collect();
    p.reload(ProxyConfig::parse(&l4_yaml(&rest, "60s", "", ""), "l4.yaml").unwrap())
        .await
        .unwrap();
    for from in 3..60u8 {
        let (n, _) = flow(from, addr).await;
        assert_ne!(
            n, name,
            "a new flow from 127.0.0.{from} reached the removed endpoint"
        );
    }
    assert_eq!(round_trip(&mut old, "three").await, "three");
    assert_eq!(gone.open.load(Ordering::SeqCst), 1, "only the old flow");
    // A shorter drain ends it.
    p.reload(ProxyConfig::parse(&l4_yaml(&rest, "0s", "", ""), "l4.yaml").unwrap())
        .await
        .unwrap();
    let mut rest_of_it = Vec::new();
    let read = tokio::time::timeout(DEADLINE, old.read_to_end(&mut rest_of_it)).await;
    assert!(read.expect("closed within the deadline").is_ok());
    eventually("the drained flow counted", || async {
        proxy_metric(
            &p,
            "meshless_proxy_tcp_flows_ended_total{listener=\"l4\",cluster=\"c\",end=\"endpoint_drained\"}",
        )
        .await
            == 1.0
    })
    .await;
    eventually("the endpoint sees its flow closed", || async {
        gone.open.load(Ordering::SeqCst) == 0
    })
    .await;
    p.shutdown().await;
}

/// The client ends its sending side; the endpoint still answers on the
/// other direction (`bye`) and the client reads to the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_passes_through() {
    let es = echoes(1).await;
    let (p, addr) = start(&l4_yaml(&[es[0].addr], "5s", "", "")).await;
    assert_eq!(send_and_close(1, addr, "hello ").await, "e0\nhello bye\n");
    eventually("flow gauge back to 0", || async {
        let page = admin(&p, "/metrics").await.1;
        common::metric(
            &page,
            "meshless_proxy_tcp_flows_active{listener=\"l4\",cluster=\"c\"}",
        ) == Some(0.0)
    })
    .await;
    let rx = proxy_metric(
        &p,
        "meshless_proxy_tcp_bytes_total{listener=\"l4\",direction=\"downstream_rx\"}",
    )
    .await;
    assert_eq!(rx, 6.0, "the client's 6 bytes");
    p.shutdown().await;
}

/// An idle flow is closed after `idle_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_flow_is_closed() {
    let es = echoes(1).await;
    let yaml = l4_yaml(&[es[0].addr], "5s", "", "").replace(
        "flow_key: source_ip }",
        "flow_key: source_ip, idle_timeout: 300ms }",
    );
    let (p, addr) = start(&yaml).await;
    let (_, mut r) = flow(1, addr).await;
    let mut rest = Vec::new();
    let read = tokio::time::timeout(DEADLINE, r.read_to_end(&mut rest)).await;
    assert!(read.expect("closed by the idle timeout").is_ok());
    eventually("counted as idle_timeout", || async {
        proxy_metric(
            &p,
            "meshless_proxy_tcp_flows_ended_total{listener=\"l4\",cluster=\"c\",end=\"idle_timeout\"}",
        )
        .await
            == 1.0
    })
    .await;
    p.shutdown().await;
}

/// A flow whose endpoint is down: the connect fails, the next endpoint
/// serves the flow, the failure is counted and ejects the dead endpoint,
/// and the next flow with the same key goes straight to a live one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_down_endpoint_fails_over_and_is_ejected() {
    let es = echoes(2).await;
    // Bound and never listening, for the whole test: connects are refused,
    // and no other test's listener can be given the port meanwhile (a
    // port bound and dropped could be, and then answer nothing).
    let unlistened = TcpSocket::new_v4().unwrap();
    unlistened.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let dead = unlistened.local_addr().unwrap();
    let addrs = [es[0].addr, es[1].addr, dead];
    let outliers = "    outlier_detection: { consecutive_gateway_errors: 1, max_ejection_percent: 50, base_ejection_time: 60s }\n";
    let (p, addr) = start(&l4_yaml(&addrs, "5s", "", outliers)).await;
    let from = (2..250u8)
        .find(|f| {
            let client = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, *f)), 0);
            pick(&p, FlowKey::SourceIp.hash(client)) == dead.to_string()
        })
        .expect("some source hashes to the dead endpoint");
    let (name, first) = flow(from, addr).await;
    assert!(
        name == "e0" || name == "e1",
        "served by a live endpoint: {name}"
    );
    let failures =
        format!("meshless_proxy_tcp_connect_failures_total{{cluster=\"c\",endpoint=\"{dead}\"}}");
    assert_eq!(proxy_metric(&p, &failures).await, 1.0);
    let (_, body) = admin(&p, "/clusters").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let ejected = v
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| c["endpoints"].as_array().into_iter().flatten())
        .find(|e| e["address"] == dead.to_string())
        .and_then(|e| e["ejected"].as_bool());
    assert_eq!(ejected, Some(true), "{body}");
    let (again, second) = flow(from, addr).await;
    assert!(again == "e0" || again == "e1");
    assert_eq!(
        proxy_metric(&p, &failures).await,
        1.0,
        "no second try of the dead one"
    );
    drop((first, second, unlistened));
    p.shutdown().await;
}

/// TCP health checks take a dead endpoint out of the table: once it is
/// marked unhealthy, no flow tries it (no connect failure is counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_health_checks_take_a_dead_endpoint_out() {
    let es = echoes(2).await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let checks =
        "    health_check: { tcp: true, interval: 100ms, timeout: 1s, unhealthy_threshold: 1 }\n";
    let (p, addr) = start(&l4_yaml(&[es[0].addr, es[1].addr, dead], "5s", "", checks)).await;
    eventually("the dead endpoint marked unhealthy", || async {
        let (_, body) = admin(&p, "/clusters").await;
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v.as_array()
            .into_iter()
            .flatten()
            .flat_map(|c| c["endpoints"].as_array().into_iter().flatten())
            .any(|e| e["address"] == dead.to_string() && e["healthy"] == false)
    })
    .await;
    for from in 2..40u8 {
        let (name, _) = flow(from, addr).await;
        assert!(name == "e0" || name == "e1", "{name}");
    }
    let failures =
        format!("meshless_proxy_tcp_connect_failures_total{{cluster=\"c\",endpoint=\"{dead}\"}}");
    assert_eq!(proxy_metric(&p, &failures).await, 0.0);
    p.shutdown().await;
}

/// During a rollout whose new pods are not ready yet, the old endpoints
/// are terminating but still all the service has: they keep taking flows
/// (kube-proxy's rule), and their open flows are not drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flows_to_the_only_endpoints_left_are_not_drained_while_they_terminate() {
    let plane = meshless_control::plane::ControlPlane::start(plane_config(None))
        .await
        .unwrap();
    let e = Echo::start("e0").await;
    register_cart(plane.api_addr(), &[("e0", e.addr)]).await;
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 500ms\ncontrol: {{ address: \"{}\" }}\nlisteners:\n  - name: l4\n    address: \"127.0.0.1:0\"\n    protocol: tcp\n    tcp: {{ cluster: cart, flow_key: source_ip }}\nclusters:\n  - name: cart\n    service: shop/cart\n    balancer: {{ policy: maglev, table_size: 1021 }}\n",
        plane.grpc_addr()
    );
    let (p, addr) = start(&yaml).await;
    let terminating = |p: &Proxy| {
        let snap = p.state().snapshot.load();
        snap.clusters
            .get("cart")
            .map(|c| {
                c.lb.endpoints()
                    .iter()
                    .map(|e| e.conditions.terminating)
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    eventually("the endpoint from the control plane", || async {
        terminating(&p) == [false]
    })
    .await;
    let (name, mut open) = flow(2, addr).await;
    assert_eq!(name, "e0");
    let mut t = endpoint_json("e0", e.addr);
    t["conditions"] = serde_json::json!({ "ready": false, "serving": true, "terminating": true });
    let (s, _) = api_call(
        plane.api_addr(),
        http::Method::PUT,
        "/v1/services/shop/cart/endpoints/e0",
        t,
    )
    .await;
    assert_eq!(s, http::StatusCode::OK);
    eventually("the proxy holds e0 as terminating", || async {
        terminating(&p) == [true]
    })
    .await;
    // Well past drain_timeout (the drain would end 500 ms after the change).
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert_eq!(round_trip(&mut open, "still").await, "still");
    let (name, mut fresh) = flow(3, addr).await;
    assert_eq!(name, "e0", "new flows still reach it");
    assert_eq!(round_trip(&mut fresh, "new").await, "new");
    let drained = proxy_metric(
        &p,
        "meshless_proxy_tcp_flows_ended_total{listener=\"l4\",cluster=\"cart\",end=\"endpoint_drained\"}",
    )
    .await;
    assert_eq!(drained, 0.0);
}

/// A `tcp` listener with a PROXY protocol block serves an untrusted peer
/// at once, without waiting for bytes it may never send first: a
/// server-first protocol's client (the `Echo` endpoint greets with its
/// name) gets its greeting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_peer_of_a_server_first_protocol_is_greeted() {
    let e = echoes(1).await;
    let (_p, addr) = start(&l4_yaml(
        &[e[0].addr],
        "5s",
        "    proxy_protocol: { trusted: [127.0.0.1/32] }\n",
        "",
    ))
    .await;
    // From 127.0.0.9: not trusted; it sends nothing before the greeting.
    let (name, mut r) = flow(9, addr).await;
    assert_eq!(name, "e0");
    assert_eq!(round_trip(&mut r, "hello").await, "hello");
}

/// A change of other endpoints wakes no flow: 20 flows to endpoint A stay
/// asleep while B is added, and when B leaves only B's flow wakes (its
/// drain starts); when A leaves, each of A's flows wakes once and drains.
/// Wake-ups are counted by the proxy (`Flows::wakeups`), so the cost of a
/// delta follows the flows of the endpoints it moves, not every flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delta_wakes_only_the_flows_of_endpoints_that_left() {
    let es = echoes(3).await;
    let (a, b, c) = (es[0].addr, es[1].addr, es[2].addr);
    let (p, addr) = start(&l4_yaml(&[a], "60s", "", "")).await;
    let reload = |addrs: Vec<SocketAddr>, drain: &'static str| {
        let cfg = ProxyConfig::parse(&l4_yaml(&addrs, drain, "", ""), "l4.yaml").unwrap();
        let p = &p;
        async move { p.reload(cfg).await.unwrap() }
    };
    // Every flow from one source address has the same key: all to A.
    let mut to_a = Vec::new();
    for i in 0..20 {
        let (name, mut r) = flow(2, addr).await;
        assert_eq!(name, es[0].name);
        assert_eq!(round_trip(&mut r, &format!("a{i}")).await, format!("a{i}"));
        to_a.push(r);
    }
    let flows = &p.state().flows;
    assert_eq!(flows.tracked(), 1, "one entry for A's flows");
    reload(vec![a, b], "60s").await;
    // A flow to B (some source address hashes there).
    let mut to_b = None;
    for from in 3..200u8 {
        let (name, r) = flow(from, addr).await;
        if name == es[1].name {
            to_b = Some(r);
            break;
        }
    }
    let mut to_b = to_b.expect("a source address whose flow goes to B");
    assert_eq!(round_trip(&mut to_b, "b").await, "b");
    assert_eq!(flows.wakeups(), 0, "adding B woke no flow");
    // B leaves: its flow wakes (to start its drain), A's do not.
    reload(vec![a], "60s").await;
    eventually("B's flow woken", || async { flows.wakeups() == 1 }).await;
    for (i, r) in to_a.iter_mut().enumerate() {
        assert_eq!(round_trip(r, &format!("x{i}")).await, format!("x{i}"));
    }
    assert_eq!(round_trip(&mut to_b, "draining").await, "draining");
    assert_eq!(flows.wakeups(), 1, "B's departure woke B's flow only");
    // A leaves and the drain is cut to 0: every flow wakes once and closes.
    reload(vec![c], "0s").await;
    for mut r in to_a.into_iter().chain([to_b]) {
        let mut rest = Vec::new();
        let read = tokio::time::timeout(DEADLINE, r.read_to_end(&mut rest)).await;
        assert!(read.expect("closed within the deadline").is_ok());
    }
    eventually("21 drained flows counted", || async {
        proxy_metric(
            &p,
            "meshless_proxy_tcp_flows_ended_total{listener=\"l4\",cluster=\"c\",end=\"endpoint_drained\"}",
        )
        .await
            == 21.0
    })
    .await;
    assert_eq!(flows.wakeups(), 22, "20 of A's, B's twice");
    eventually("no endpoint tracked", || async { flows.tracked() == 0 }).await;
    p.shutdown().await;
}

/// With `access_log` on, each flow writes one line when it ends: its
/// client, endpoint, bytes each way and how it ended; a flow that found
/// no endpoint writes one too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_flow_writes_an_access_log_line() {
    let es = echoes(1).await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let yaml = format!(
        "access_log: \"{}\"\n{}",
        log.display(),
        l4_yaml(&[es[0].addr], "5s", "", "")
    );
    let (p, addr) = start(&yaml).await;
    assert_eq!(send_and_close(7, addr, "hello ").await, "e0\nhello bye\n");
    let lines = || common::access_log_lines(&log);
    eventually("the flow's line", || async { lines().len() == 1 }).await;
    let l = &lines()[0];
    let endpoint = es[0].addr.to_string();
    assert_eq!(
        (
            l["protocol"].as_str(),
            l["listener"].as_str(),
            l["client"].as_str(),
            l["cluster"].as_str(),
            l["endpoint"].as_str(),
            l["bytes_received"].as_u64(),
            l["bytes_sent"].as_u64(),
            l["end"].as_str(),
        ),
        (
            Some("tcp"),
            Some("l4"),
            Some("127.0.0.7"),
            Some("c"),
            Some(endpoint.as_str()),
            Some(6),
            Some(13),
            Some("closed"),
        ),
        "{l}"
    );
    p.shutdown().await;

    // No endpoint: the flow is closed at once, and logged so.
    let yaml = format!(
        "access_log: \"{}\"\n{}",
        log.display(),
        l4_yaml(&[], "5s", "", "").replace("endpoints:\n", "endpoints: []\n")
    );
    let (p, addr) = start(&yaml).await;
    let mut s = connect_from(8, addr).await;
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(DEADLINE, s.read_to_end(&mut rest)).await;
    eventually("the refused flow's line", || async { lines().len() == 2 }).await;
    let l = &lines()[1];
    assert_eq!(
        (
            l["endpoint"].as_str(),
            l["end"].as_str(),
            l["bytes_sent"].as_u64()
        ),
        (Some("-"), Some("no_endpoint"), Some(0)),
        "{l}"
    );
    p.shutdown().await;
}
