//! Binary upgrade under load: 20 hand-overs in a row between proxies (each
//! takes the previous one's listening sockets over a Unix socket, then the
//! previous one drains), while HTTP/1 keep-alive clients, TLS keep-alive
//! clients and streaming tunnels run: no request fails, no tunnel breaks.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::tls::{self, Sender, TempDir};
use common::{backends, client, endpoints_yaml, eventually, get};
use http::StatusCode;
use meshless_proxy::{Proxy, ProxyConfig, handoff};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixListener;

fn config(dir: &Path, endpoints: &str) -> ProxyConfig {
    let pem = dir.join("a.pem").display().to_string();
    let key = dir.join("a.key").display().to_string();
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 30s\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\n  - name: web-tls\n    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\n    tls:\n      default_certificate: {{ certificate: \"{pem}\", key: \"{key}\" }}\nclusters:\n  - name: c\n    endpoints:\n{endpoints}"
    );
    ProxyConfig::parse(&yaml, "upgrade.yaml").unwrap()
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

/// One tunnel: 30 echoed messages 10 ms apart, then a clean close.
async fn tunnel(addr: std::net::SocketAddr) -> Result<(), String> {
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
    for i in 0..30u32 {
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

fn spawn_load(
    stop: &Arc<AtomicBool>,
    tally: &Arc<Tally>,
    web: std::net::SocketAddr,
    web_tls: std::net::SocketAddr,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    let http = client();
    for _ in 0..3 {
        let (stop, tally, http) = (stop.clone(), tally.clone(), http.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let (status, _, _) = get(&http, web, "/", &[]).await;
                tally.count(status == StatusCode::OK, &format!("http {status}"));
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
    let (stop, tally) = (stop.clone(), tally.clone());
    tasks.push(tokio::spawn(async move {
        while !stop.load(Ordering::Relaxed) {
            let r = tunnel(web).await;
            if let Err(e) = &r {
                eprintln!("tunnel failed: {e}");
                tally.tunnels_failed.fetch_add(1, Ordering::Relaxed);
            }
            tally.tunnels.fetch_add(1, Ordering::Relaxed);
        }
    }));
    tasks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_upgrades_under_load_fail_no_request_and_break_no_tunnel() {
    let dir = TempDir::new("upgrade");
    tls::write_cert(&dir.0, "a", &["a.test"]);
    let bs = backends(2).await;
    let endpoints = endpoints_yaml(&bs);
    let socket: PathBuf = dir.path("upgrade.sock");
    let first = Proxy::start(config(&dir.0, &endpoints)).await.unwrap();
    let web = first.listener_addr("web").await.unwrap();
    let web_tls = first.listener_addr("web-tls").await.unwrap();
    let admin = first.admin_addr();
    let mut generations = vec![tokio::spawn(serve_upgrades(
        first,
        UnixListener::bind(&socket).unwrap(),
    ))];
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let load = spawn_load(&stop, &tally, web, web_tls);
    for round in 0..20 {
        let before = tally.ok.load(Ordering::Relaxed);
        eventually("requests between upgrades", || async {
            tally.ok.load(Ordering::Relaxed) >= before + 30
        })
        .await;
        let (proxy, listener) = take_over(config(&dir.0, &endpoints), &socket).await;
        assert_eq!(proxy.listener_addr("web").await, Some(web), "round {round}");
        assert_eq!(proxy.listener_addr("web-tls").await, Some(web_tls));
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
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.await.unwrap();
    }
    assert_eq!(tally.failed.load(Ordering::Relaxed), 0, "failed requests");
    assert_eq!(
        tally.tunnels_failed.load(Ordering::Relaxed),
        0,
        "broken tunnels"
    );
    assert!(tally.tunnels.load(Ordering::Relaxed) >= 2);
    // The admin server moved too: the newest generation answers.
    let (status, _, _) = get(&client(), admin, "/ready", &[]).await;
    assert_eq!(status, StatusCode::OK);
    for g in generations {
        g.abort();
    }
}
