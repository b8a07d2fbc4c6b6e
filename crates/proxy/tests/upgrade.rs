//! Binary upgrade under load: 20 hand-overs in a row between proxies (each
//! takes the previous one's listening sockets over a Unix socket, then the
//! previous one drains), while HTTP/1 and HTTP/2 keep-alive clients, TLS
//! keep-alive clients, streaming tunnels and long-lived TCP flows through
//! an L4 (`protocol: tcp`) listener run: no request fails, no tunnel or
//! flow breaks.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::tls::{self, Sender, TempDir};
use common::{backends, client, endpoints_yaml, eventually, get, h2_client};
use http::StatusCode;
use meshless_proxy::{Proxy, ProxyConfig, handoff};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixListener;

fn config(dir: &Path, endpoints: &str) -> ProxyConfig {
    let pem = dir.join("a.pem").display().to_string();
    let key = dir.join("a.key").display().to_string();
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 30s\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\n  - name: web-tls\n    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\n    tls:\n      default_certificate: {{ certificate: \"{pem}\", key: \"{key}\" }}\n  - name: l4\n    address: \"127.0.0.1:0\"\n    protocol: tcp\n    tcp: {{ cluster: t, flow_key: source_ip_port }}\nclusters:\n  - name: c\n    endpoints:\n{endpoints}  - name: t\n    balancer: {{ policy: maglev }}\n    endpoints:\n{endpoints}"
    );
    common::on_test_http1(ProxyConfig::parse(&yaml, "upgrade.yaml").unwrap())
}

/// The running side: hands over on the first request, then drains.
async fn serve_upgrades(proxy: Proxy, listener: UnixListener) {
    loop {
        let (stream, _) = listener.accept().await.unwrap();
        if proxy.hand_over(stream.into_std().unwrap()).await.unwrap() {
            proxy.shutdown_handed_over().await;
            return;
        }
    }
}

/// The new side: takes the sockets from `path`, says ready, serves `path`.
async fn take_over(config: ProxyConfig, path: &Path) -> (Proxy, UnixListener) {
    let from = path.to_owned();
    let (mut inherited, stream) = tokio::task::spawn_blocking(move || handoff::receive(&from))
        .await
        .unwrap()
        .unwrap();
    let proxy = Proxy::start_with(config, &mut inherited).await.unwrap();
    assert_eq!(inherited.left(), 0, "every socket was taken");
    tokio::task::spawn_blocking(move || handoff::ready(stream))
        .await
        .unwrap()
        .unwrap();
    std::fs::remove_file(path).unwrap();
    (proxy, UnixListener::bind(path).unwrap())
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    failed: AtomicU64,
    tunnels: AtomicU64,
    tunnels_failed: AtomicU64,
    flows: AtomicU64,
    flows_failed: AtomicU64,
    /// HTTP/2 requests refused by a GOAWAY before processing, sent again.
    refused: AtomicU64,
}

impl Tally {
    fn count(&self, ok: bool, what: &str) {
        if ok {
            self.ok.fetch_add(1, Ordering::Relaxed);
        } else {
            eprintln!("failed: {what}");
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One tunnel: an upgrade to the backend's echo, then `messages` echoed
/// messages 10 ms apart, then a clean close. Through an HTTP listener it
/// is an upgraded request; through the `tcp` listener the same bytes are
/// one L4 flow the proxy only copies.
async fn tunnel(addr: std::net::SocketAddr, messages: u32) -> Result<(), String> {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    s.write_all(
        b"GET /upgrade HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    )
    .await
    .map_err(|e| e.to_string())?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte)
            .await
            .map_err(|e| format!("head: {e}"))?;
        head.push(byte[0]);
    }
    if !head.starts_with(b"HTTP/1.1 101") {
        return Err(String::from_utf8_lossy(&head).into_owned());
    }
    for i in 0..messages {
        let msg = format!("message {i:04}");
        s.write_all(msg.as_bytes())
            .await
            .map_err(|e| format!("write {i}: {e}"))?;
        let mut back = vec![0u8; msg.len()];
        s.read_exact(&mut back)
            .await
            .map_err(|e| format!("echo {i}: {e}"))?;
        if back != msg.as_bytes() {
            return Err(format!("echo {i} differs"));
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Whether `e` says the server refused the request with GOAWAY before
/// processing it: RFC 9113 section 6.8 makes such a request safe to send
/// again, and HTTP/2 clients do; hyper's client reports it instead.
fn refused_by_goaway(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(err) = next {
        if let Some(h2) = err.downcast_ref::<h2::Error>() {
            return h2.is_go_away() && h2.is_remote() && h2.reason() == Some(h2::Reason::NO_ERROR);
        }
        next = err.source();
    }
    false
}

/// One GET of `/` over `http`, sent again (up to 3 times) when refused
/// by a GOAWAY; the status, or what went wrong.
async fn get_retrying_refused(
    http: &common::TestClient,
    addr: std::net::SocketAddr,
    tally: &Tally,
) -> Result<StatusCode, String> {
    use http_body_util::BodyExt;
    for _ in 0..3 {
        let req = http::Request::get(format!("http://{addr}/"))
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        match http.request(req).await {
            Ok(resp) => {
                let status = resp.status();
                resp.into_body()
                    .collect()
                    .await
                    .map_err(|e| format!("body: {e}"))?;
                return Ok(status);
            }
            Err(e) if refused_by_goaway(&e) => {
                tally.refused.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => return Err(format!("{e:?}")),
        }
    }
    Err("refused three times".into())
}

/// The listeners under load.
#[derive(Clone, Copy)]
struct Addrs {
    web: std::net::SocketAddr,
    web_tls: std::net::SocketAddr,
    l4: std::net::SocketAddr,
}

fn spawn_load(
    stop: &Arc<AtomicBool>,
    tally: &Arc<Tally>,
    addrs: Addrs,
) -> Vec<tokio::task::JoinHandle<()>> {
    let Addrs { web, web_tls, l4 } = addrs;
    let mut tasks = Vec::new();
    // Three HTTP/1.1 keep-alive clients and two HTTP/2 (prior knowledge)
    // clients, each on a pooled connection.
    for http in [client(), client(), client(), h2_client(), h2_client()] {
        let (stop, tally) = (stop.clone(), tally.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let r = get_retrying_refused(&http, web, &tally).await;
                tally.count(r == Ok(StatusCode::OK), &format!("http {r:?}"));
            }
        }));
    }
    for _ in 0..2 {
        let (stop, tally) = (stop.clone(), tally.clone());
        let config = tls::client_config(&["http/1.1"], rustls::ALL_VERSIONS);
        tasks.push(tokio::spawn(async move {
            let mut conn: Option<Sender> = None;
            while !stop.load(Ordering::Relaxed) {
                let reusable = match conn.as_mut() {
                    Some(s) => s.ready().await,
                    None => false,
                };
                // Closed by the server after a response: a new connection.
                let mut s = match conn.take() {
                    Some(s) if reusable => s,
                    _ => {
                        let tcp = tls::connect(&config, web_tls, "a.test").await.unwrap();
                        Sender::new(tcp).await.unwrap()
                    }
                };
                let r = s.get("a.test", "/").await;
                tally.count(matches!(r, Ok((StatusCode::OK, _))), &format!("tls {r:?}"));
                conn = Some(s);
            }
        }));
    }
    let (stop_tunnels, tunnels) = (stop.clone(), tally.clone());
    tasks.push(tokio::spawn(async move {
        let (stop, tally) = (stop_tunnels, tunnels);
        while !stop.load(Ordering::Relaxed) {
            let r = tunnel(web, 30).await;
            if let Err(e) = &r {
                eprintln!("tunnel failed: {e}");
                tally.tunnels_failed.fetch_add(1, Ordering::Relaxed);
            }
            tally.tunnels.fetch_add(1, Ordering::Relaxed);
        }
    }));
    // Long-lived L4 flows: 150 messages 10 ms apart (1.5 s or more each),
    // so every flow spans several hand-overs and stays on the generation
    // that accepted it until it closes.
    for _ in 0..3 {
        let (stop, tally) = (stop.clone(), tally.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Err(e) = tunnel(l4, 150).await {
                    eprintln!("flow failed: {e}");
                    tally.flows_failed.fetch_add(1, Ordering::Relaxed);
                }
                tally.flows.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    tasks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_upgrades_under_load_fail_no_request_and_break_no_tunnel_or_flow() {
    let dir = TempDir::new("upgrade");
    tls::write_cert(&dir.0, "a", &["a.test"]);
    let bs = backends(2).await;
    let endpoints = endpoints_yaml(&bs);
    let socket: PathBuf = dir.path("upgrade.sock");
    let first = Proxy::start(config(&dir.0, &endpoints)).await.unwrap();
    let web = first.listener_addr("web").await.unwrap();
    let web_tls = first.listener_addr("web-tls").await.unwrap();
    let l4 = first.listener_addr("l4").await.unwrap();
    let admin = first.admin_addr();
    let mut generations = vec![tokio::spawn(serve_upgrades(
        first,
        UnixListener::bind(&socket).unwrap(),
    ))];
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let load = spawn_load(&stop, &tally, Addrs { web, web_tls, l4 });
    for round in 0..20 {
        let before = tally.ok.load(Ordering::Relaxed);
        eventually("requests between upgrades", || async {
            tally.ok.load(Ordering::Relaxed) >= before + 30
        })
        .await;
        let (proxy, listener) = take_over(config(&dir.0, &endpoints), &socket).await;
        assert_eq!(proxy.listener_addr("web").await, Some(web), "round {round}");
        assert_eq!(proxy.listener_addr("web-tls").await, Some(web_tls));
        assert_eq!(proxy.listener_addr("l4").await, Some(l4));
        assert_eq!(proxy.admin_addr(), admin);
        generations.push(tokio::spawn(serve_upgrades(proxy, listener)));
    }
    let before = tally.ok.load(Ordering::Relaxed);
    eventually("requests after the last upgrade", || async {
        tally.ok.load(Ordering::Relaxed) >= before + 30
    })
    .await;
    let tunnels = tally.tunnels.load(Ordering::Relaxed);
    eventually("a tunnel after the last upgrade", || async {
        tally.tunnels.load(Ordering::Relaxed) > tunnels
    })
    .await;
    let flows = tally.flows.load(Ordering::Relaxed);
    eventually("a flow after the last upgrade", || async {
        tally.flows.load(Ordering::Relaxed) > flows
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.await.unwrap();
    }
    eprintln!(
        "requests ok {} (refused by GOAWAY and sent again {}), tunnels {}, flows {}",
        tally.ok.load(Ordering::Relaxed),
        tally.refused.load(Ordering::Relaxed),
        tally.tunnels.load(Ordering::Relaxed),
        tally.flows.load(Ordering::Relaxed)
    );
    assert_eq!(tally.failed.load(Ordering::Relaxed), 0, "failed requests");
    assert_eq!(
        tally.tunnels_failed.load(Ordering::Relaxed),
        0,
        "broken tunnels"
    );
    assert!(tally.tunnels.load(Ordering::Relaxed) >= 2);
    assert_eq!(
        tally.flows_failed.load(Ordering::Relaxed),
        0,
        "broken flows"
    );
    assert!(tally.flows.load(Ordering::Relaxed) >= 3);
    // The admin server moved too: the newest generation answers.
    let (status, _, _) = get(&client(), admin, "/ready", &[]).await;
    assert_eq!(status, StatusCode::OK);
    for g in generations {
        g.abort();
    }
}

fn plain_config(extra_listener: &str, endpoints: &str) -> ProxyConfig {
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 30s\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\n{extra_listener}clusters:\n  - name: c\n    endpoints:\n{endpoints}"
    );
    common::on_test_http1(ProxyConfig::parse(&yaml, "upgrade.yaml").unwrap())
}

/// Review 9, E11: once the new process accepts, the old one stops
/// accepting on the shared admin socket too, though it drains on (a long
/// request here): every `/ready` after that is the new process's 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_hand_over_only_the_new_process_answers_the_admin_socket() {
    let dir = TempDir::new("upgrade-admin");
    let bs = backends(1).await;
    let endpoints = endpoints_yaml(&bs);
    let socket: PathBuf = dir.path("upgrade.sock");
    let old = Proxy::start(plain_config("", &endpoints)).await.unwrap();
    let web = old.listener_addr("web").await.unwrap();
    let admin = old.admin_addr();
    let old_state = Arc::clone(old.state());
    // A request that keeps the old process draining through the test.
    let slow = tokio::spawn(async move { get(&client(), web, "/?delay_ms=60000", &[]).await });
    eventually("the long request in flight", || async {
        common::metric_sum(
            &common::admin(&old, "/metrics").await.1,
            "meshless_proxy_endpoint_in_flight{",
        ) >= 1.0
    })
    .await;
    // A keep-alive admin client of the old process (a metrics scraper).
    let mut scraper = tokio::net::TcpStream::connect(admin).await.unwrap();
    scraper
        .write_all(b"GET /ready HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    while !got.ends_with(b"ready\n") {
        let mut buf = [0u8; 256];
        let n = scraper.read(&mut buf).await.unwrap();
        assert!(n > 0, "admin closed: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    let old_side = tokio::spawn(serve_upgrades(old, UnixListener::bind(&socket).unwrap()));
    let (new, _listener) = take_over(plain_config("", &endpoints), &socket).await;
    assert_eq!(new.admin_addr(), admin);
    eventually("the old process draining", || async {
        !old_state.ready.load(Ordering::Acquire)
    })
    .await;
    assert!(!old_side.is_finished(), "the old process still drains");
    for i in 0..40 {
        let (status, _, body) = get(&client(), admin, "/ready", &[]).await;
        assert_eq!(status, StatusCode::OK, "probe {i}: {body}");
    }
    // The old process's keep-alive admin connection is closed (the
    // scraper reconnects, to the new process).
    let mut buf = [0u8; 64];
    let closed = tokio::time::timeout(common::DEADLINE, scraper.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0) | Err(_))),
        "the old process's admin connection: {closed:?}"
    );
    slow.abort();
    old_side.abort();
}

/// Review 9, E3: a takeover that fails at start (here its second
/// listener's address is busy) never accepted on the sockets it received:
/// connections waiting in their accept queue are all still there for the
/// old process. Ten failed takeovers in a row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_that_fails_at_start_accepts_nothing() {
    let dir = TempDir::new("upgrade-fail");
    let bs = backends(1).await;
    let endpoints = endpoints_yaml(&bs);
    let socket: PathBuf = dir.path("upgrade.sock");
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let extra = format!(
        "  - name: web2\n    address: \"{}\"\n    routes:\n      - cluster: c\n",
        busy.local_addr().unwrap()
    );
    // The "old process": one listening socket nobody accepts on.
    let shared = Arc::new(std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    let web = shared.local_addr().unwrap();
    let server = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let old = {
        let shared = Arc::clone(&shared);
        std::thread::spawn(move || {
            for _ in 0..10 {
                let (mut s, _) = server.accept().unwrap();
                let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
                let info = handoff::SocketInfo {
                    name: "web".into(),
                    configured: any,
                    local: shared.local_addr().unwrap(),
                };
                use std::os::fd::AsFd;
                // The new process fails and goes away: never ready.
                assert!(!handoff::send(&mut s, &[(info, shared.as_fd())]).unwrap());
            }
        })
    };
    shared.set_nonblocking(true).unwrap();
    for round in 0..10 {
        let waiting: Vec<std::net::TcpStream> = (0..5)
            .map(|_| std::net::TcpStream::connect(web).unwrap())
            .collect();
        let from = socket.clone();
        let (mut inherited, stream) = tokio::task::spawn_blocking(move || handoff::receive(&from))
            .await
            .unwrap()
            .unwrap();
        let started = Proxy::start_with(plain_config(&extra, &endpoints), &mut inherited).await;
        let e = started.expect_err("listeners[1] is busy");
        assert!(e.to_string().contains("listeners[1].address"), "{e}");
        drop((inherited, stream));
        // Give a stray accept loop of the failed start every chance to run.
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let mut queued = 0;
        while shared.accept().is_ok() {
            queued += 1;
        }
        assert_eq!(
            queued,
            waiting.len(),
            "round {round}: connections taken by the failed start"
        );
    }
    old.join().unwrap();
}
