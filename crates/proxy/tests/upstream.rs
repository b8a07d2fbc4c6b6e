//! The proxy's upstream connections through real sockets: reuse, idle
//! limits and timeout, connections closed with their endpoint, HTTP/2
//! streams within the peer's limit, pre-connect within `max_connections`,
//! and TLS to upstreams (CA, SNI, ALPN, a wrong CA refused with a reason).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use common::{admin, client, eventually, get, proxy};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use meshless_proxy::{Proxy, ProxyConfig};
use tokio::sync::watch;

/// What the test upstream saw.
#[derive(Default)]
struct Seen {
    accepted: AtomicUsize,
    open: AtomicUsize,
    /// Requests being answered now.
    held: AtomicUsize,
    /// Most streams ever open at once on one connection.
    max_streams: AtomicUsize,
    sni: Mutex<Vec<String>>,
    /// The ALPN id agreed on each TLS connection (empty: none).
    alpn: Mutex<Vec<Vec<u8>>>,
}

/// Lowers a count on drop.
struct Down<'a>(&'a AtomicUsize);

impl Drop for Down<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A test upstream: HTTP/1.1 and h2c (or TLS, given a server config),
/// HTTP/2 limited to `max_streams` streams per connection, answers held
/// until the gate opens.
struct Upstream {
    addr: SocketAddr,
    seen: Arc<Seen>,
    gate: watch::Sender<bool>,
}

impl Upstream {
    async fn start(max_streams: u32, tls: Option<Arc<rustls::ServerConfig>>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Seen::default());
        let (gate, rx) = watch::channel(true);
        let s = Arc::clone(&seen);
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (seen, rx, tls) = (Arc::clone(&s), rx.clone(), tls.clone());
                tokio::spawn(async move {
                    seen.accepted.fetch_add(1, Ordering::SeqCst);
                    seen.open.fetch_add(1, Ordering::SeqCst);
                    let _open = Down(&seen.open);
                    match tls {
                        Some(cfg) => {
                            let Ok(stream) = tokio_rustls::TlsAcceptor::from(cfg).accept(tcp).await
                            else {
                                return;
                            };
                            let sni = stream.get_ref().1.server_name().unwrap_or("").to_owned();
                            seen.sni.lock().unwrap().push(sni);
                            let alpn = stream.get_ref().1.alpn_protocol().unwrap_or(b"").to_vec();
                            seen.alpn.lock().unwrap().push(alpn);
                            serve(stream, &seen, rx, max_streams).await;
                        }
                        None => serve(tcp, &seen, rx, max_streams).await,
                    }
                });
            }
        });
        Self { addr, seen, gate }
    }

    fn hold(&self) {
        let _ = self.gate.send(false);
    }

    fn release(&self) {
        let _ = self.gate.send(true);
    }

    fn accepted(&self) -> usize {
        self.seen.accepted.load(Ordering::SeqCst)
    }

    fn open(&self) -> usize {
        self.seen.open.load(Ordering::SeqCst)
    }

    fn held(&self) -> usize {
        self.seen.held.load(Ordering::SeqCst)
    }
}

async fn serve<S>(io: S, seen: &Arc<Seen>, gate: watch::Receiver<bool>, max_streams: u32)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let streams = Arc::new(AtomicUsize::new(0));
    let seen2 = Arc::clone(seen);
    let service = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
        let (seen, streams, mut gate) = (Arc::clone(&seen2), Arc::clone(&streams), gate.clone());
        async move {
            let now = streams.fetch_add(1, Ordering::SeqCst) + 1;
            let _s = Down(&streams);
            seen.max_streams.fetch_max(now, Ordering::SeqCst);
            seen.held.fetch_add(1, Ordering::SeqCst);
            let _h = Down(&seen.held);
            let _ = req.into_body().collect().await;
            let _ = gate.wait_for(|open| *open).await;
            Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from("ok\n"))))
        }
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder.http2().max_concurrent_streams(max_streams);
    let _ = builder.serve_connection(TokioIo::new(io), service).await;
}

/// A proxy in front of `addrs` with `extra` cluster YAML (indented 4).
async fn proxy_to(addrs: &[SocketAddr], extra: &str) -> (Proxy, SocketAddr) {
    proxy(&yaml(addrs, extra)).await
}

fn yaml(addrs: &[SocketAddr], extra: &str) -> String {
    let eps: String = addrs
        .iter()
        .map(|a| format!("      - {{ address: \"{a}\" }}\n"))
        .collect();
    common::config_with_endpoints(&eps, extra)
}

/// `upstream_connections` and `upstream_idle_connections` of cluster `c`.
async fn gauges(p: &Proxy) -> (u64, u64) {
    let (_, page) = admin(p, "/clusters").await;
    let v: serde_json::Value = serde_json::from_str(&page).unwrap();
    let c = &v.as_array().unwrap()[0];
    (
        c["upstream_connections"].as_u64().unwrap(),
        c["upstream_idle_connections"].as_u64().unwrap(),
    )
}

#[tokio::test]
async fn keep_alive_connections_are_reused_and_counted() {
    let up = Upstream::start(100, None).await;
    let (p, addr) = proxy_to(&[up.addr], "").await;
    let c = client();
    for _ in 0..20 {
        assert_eq!(get(&c, addr, "/", &[]).await.0, 200);
    }
    assert_eq!(
        up.accepted(),
        1,
        "one connection serves sequential requests"
    );
    eventually("one open connection, idle", || async {
        gauges(&p).await == (1, 1)
    })
    .await;
    p.shutdown().await;
}

#[tokio::test]
async fn idle_connections_close_after_the_idle_timeout() {
    let up = Upstream::start(100, None).await;
    let (p, addr) = proxy_to(&[up.addr], "    timeouts: { idle: 200ms }\n").await;
    assert_eq!(get(&client(), addr, "/", &[]).await.0, 200);
    eventually("the upstream sees its connection closed", || async {
        up.open() == 0
    })
    .await;
    eventually("the gauges at 0", || async { gauges(&p).await == (0, 0) }).await;
    p.shutdown().await;
}

/// An idle pooled connection the upstream closes (its keep-alive timeout,
/// as Node.js closes after 5 s) is closed on the proxy's side within
/// about a second, not left in CLOSE-WAIT (and counted as open and idle)
/// until the idle timeout's sweep: here 120 s.
#[tokio::test]
async fn an_idle_connection_the_upstream_closed_is_closed_soon() {
    use tokio::io::AsyncWriteExt;
    let up = common::tcp_server(|mut s| async move {
        if common::read_head(&mut s).await.is_none() {
            return;
        }
        let _ = s
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nok\n")
            .await;
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        // Closed while idle.
    })
    .await;
    let (p, addr) = proxy_to(&[up], "    timeouts: { idle: 120s }\n").await;
    assert_eq!(get(&client(), addr, "/", &[]).await.0, 200);
    eventually(
        "the closed connection leaves the pool and its gauges",
        || async { gauges(&p).await == (0, 0) },
    )
    .await;
    p.shutdown().await;
}

#[tokio::test]
async fn idle_connections_are_kept_up_to_max_idle_per_endpoint() {
    let up = Upstream::start(100, None).await;
    let extra = "    connection_pool: { max_idle_per_endpoint: 2 }\n";
    let (p, addr) = proxy_to(&[up.addr], extra).await;
    up.hold();
    let c = client();
    let reqs: Vec<_> = (0..6)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move { get(&c, addr, "/", &[]).await.0 })
        })
        .collect();
    eventually("6 requests held upstream", || async { up.held() == 6 }).await;
    assert_eq!(up.accepted(), 6, "one connection per request in flight");
    up.release();
    for r in reqs {
        assert_eq!(r.await.unwrap(), 200);
    }
    eventually("2 idle connections left", || async {
        up.open() == 2 && gauges(&p).await == (2, 2)
    })
    .await;
    p.shutdown().await;
}

#[tokio::test]
async fn a_removed_endpoints_connections_are_closed() {
    let (a, b) = (
        Upstream::start(100, None).await,
        Upstream::start(100, None).await,
    );
    let extra = "    balancer: { policy: round_robin }\n";
    let (p, addr) = proxy_to(&[a.addr, b.addr], extra).await;
    let c = client();
    for _ in 0..4 {
        assert_eq!(get(&c, addr, "/", &[]).await.0, 200);
    }
    assert_eq!((a.open(), b.open()), (1, 1));
    let cfg = ProxyConfig::parse(&yaml(&[b.addr], extra), "test.yaml").unwrap();
    p.reload(common::on_test_http1(cfg)).await.unwrap();
    eventually("a's connection closed", || async { a.open() == 0 }).await;
    assert_eq!(get(&c, addr, "/", &[]).await.0, 200);
    assert_eq!((b.accepted(), b.open()), (1, 1), "b's connection kept");
    p.shutdown().await;
}

#[tokio::test]
async fn http2_streams_stay_within_the_peers_limit() {
    let up = Upstream::start(2, None).await;
    let (p, addr) = proxy_to(&[up.addr], "    upstream_protocol: http2\n").await;
    // A first exchange, so the peer's SETTINGS are known.
    assert_eq!(get(&client(), addr, "/", &[]).await.0, 200);
    up.hold();
    let c = client();
    let reqs: Vec<_> = (0..6)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move { get(&c, addr, "/", &[]).await.0 })
        })
        .collect();
    eventually("6 streams held upstream", || async { up.held() == 6 }).await;
    assert!(up.accepted() >= 3, "6 streams at 2 per connection");
    assert_eq!(up.seen.max_streams.load(Ordering::SeqCst), 2);
    up.release();
    for r in reqs {
        assert_eq!(r.await.unwrap(), 200);
    }
    p.shutdown().await;
}

#[tokio::test]
async fn preconnect_opens_connections_ahead_within_max_connections() {
    let up = Upstream::start(100, None).await;
    let extra = "    connection_pool: { preconnect_ratio: 3.0 }\n";
    let (p, addr) = proxy_to(&[up.addr], extra).await;
    up.hold();
    let c = client();
    let one = tokio::spawn(async move { get(&c, addr, "/", &[]).await.0 });
    eventually("3 connections for 1 request", || async {
        up.accepted() == 3
    })
    .await;
    assert_eq!(up.held(), 1);
    up.release();
    assert_eq!(one.await.unwrap(), 200);
    eventually("3 open, 3 idle", || async { gauges(&p).await == (3, 3) }).await;
    p.shutdown().await;

    let up = Upstream::start(100, None).await;
    let extra = "    connection_pool: { preconnect_ratio: 3.0 }\n    circuit_breakers: { max_connections: 2 }\n";
    let (p, addr) = proxy_to(&[up.addr], extra).await;
    up.hold();
    let c = client();
    let one = tokio::spawn(async move { get(&c, addr, "/", &[]).await.0 });
    eventually("2 connections (the limit)", || async { up.accepted() == 2 }).await;
    up.release();
    assert_eq!(one.await.unwrap(), 200);
    // Every connect is counted (and bounded) before it starts.
    assert!(gauges(&p).await.0 <= 2);
    p.shutdown().await;
    assert_eq!(up.accepted(), 2);
}

#[tokio::test]
async fn without_preconnect_one_request_opens_one_connection() {
    let up = Upstream::start(100, None).await;
    let (p, addr) = proxy_to(&[up.addr], "").await;
    assert_eq!(get(&client(), addr, "/", &[]).await.0, 200);
    eventually("the connection idle", || async {
        gauges(&p).await == (1, 1)
    })
    .await;
    assert_eq!(up.accepted(), 1);
    p.shutdown().await;
}

// ---------------------------------------------------------------------
// TLS to upstreams.
// ---------------------------------------------------------------------

/// A CA (its PEM) and a server config whose certificate it signed for `name`.
fn pki(name: &str, alpn: &[&[u8]]) -> (String, Arc<rustls::ServerConfig>) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let der_key = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap();
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], der_key)
        .unwrap();
    cfg.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
    (ca.pem(), Arc::new(cfg))
}

/// `pem` written as `ca.pem` in a fresh directory (removed when the
/// returned guard drops), and its path.
fn ca_file(dir: &str, pem: &str) -> (common::tls::TempDir, std::path::PathBuf) {
    let dir = common::tls::TempDir::new(&format!("up-{dir}"));
    let path = dir.path("ca.pem");
    std::fs::write(&path, pem).unwrap();
    (dir, path)
}

fn tls_yaml(ca: &std::path::Path, name: &str, alpn: bool) -> String {
    format!(
        "    tls: {{ ca_file: \"{}\", server_name: \"{name}\", alpn: {alpn} }}\n    retries: {{ count: 0 }}\n",
        ca.display()
    )
}

#[tokio::test]
async fn tls_to_an_upstream_sends_sni_and_checks_the_ca() {
    let (ca, server) = pki("backend.test", &[]);
    let up = Upstream::start(100, Some(server)).await;
    let (_ca_dir, ca) = ca_file("ok", &ca);
    let (p, addr) = proxy_to(&[up.addr], &tls_yaml(&ca, "backend.test", false)).await;
    let c = client();
    for _ in 0..3 {
        let (status, _, body) = get(&c, addr, "/", &[]).await;
        assert_eq!((status.as_u16(), body.as_str()), (200, "ok\n"));
    }
    assert_eq!(
        *up.seen.sni.lock().unwrap(),
        vec!["backend.test".to_owned()]
    );
    p.shutdown().await;
}

#[tokio::test]
async fn tls_with_a_wrong_ca_or_name_is_refused_with_the_reason() {
    let (_, server) = pki("backend.test", &[]);
    let (other_ca, _) = pki("backend.test", &[]);
    let up = Upstream::start(100, Some(server)).await;
    let (_ca_dir, ca) = ca_file("wrong", &other_ca);
    let (p, addr) = proxy_to(&[up.addr], &tls_yaml(&ca, "backend.test", false)).await;
    let (status, _, body) = get(&client(), addr, "/", &[]).await;
    assert_eq!(status, 503);
    assert!(body.contains("not signed by a trusted CA"), "{body}");
    assert_eq!(up.held(), 0);
    p.shutdown().await;

    let (ca, server) = pki("backend.test", &[]);
    let up = Upstream::start(100, Some(server)).await;
    let (_ca_dir, ca) = ca_file("name", &ca);
    let (p, addr) = proxy_to(&[up.addr], &tls_yaml(&ca, "other.test", false)).await;
    let (status, _, body) = get(&client(), addr, "/", &[]).await;
    assert_eq!(status, 503);
    assert!(body.contains("not valid for tls.server_name"), "{body}");
    p.shutdown().await;
}

#[tokio::test]
async fn tls_with_alpn_h2_multiplexes_one_connection() {
    let (ca, server) = pki("backend.test", &[b"h2"]);
    let up = Upstream::start(100, Some(server)).await;
    let (_ca_dir, ca) = ca_file("h2", &ca);
    let extra = format!(
        "    upstream_protocol: http2\n{}",
        tls_yaml(&ca, "backend.test", true)
    );
    let (p, addr) = proxy_to(&[up.addr], &extra).await;
    assert_eq!(get(&client(), addr, "/", &[]).await.0, 200);
    let c = client();
    let reqs: Vec<_> = (0..8)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move { get(&c, addr, "/", &[]).await.0 })
        })
        .collect();
    for r in reqs {
        assert_eq!(r.await.unwrap(), 200);
    }
    assert_eq!(up.accepted(), 1, "streams share one TLS connection");
    p.shutdown().await;

    // An endpoint that does not agree to h2 is refused, with the reason.
    let (ca, server) = pki("backend.test", &[b"http/1.1"]);
    let up = Upstream::start(100, Some(server)).await;
    let (_ca_dir, ca) = ca_file("noh2", &ca);
    let extra = format!(
        "    upstream_protocol: http2\n{}",
        tls_yaml(&ca, "backend.test", true)
    );
    let (p, addr) = proxy_to(&[up.addr], &extra).await;
    let (status, _, body) = get(&client(), addr, "/", &[]).await;
    assert_eq!(status, 503);
    assert!(body.contains("ALPN"), "{body}");
    p.shutdown().await;
}

#[tokio::test]
async fn a_missing_ca_file_is_refused_at_load() {
    let missing = std::env::temp_dir().join("meshless-up-no-such-dir/ca.pem");
    let yaml = yaml(
        &["127.0.0.1:1".parse().unwrap()],
        &tls_yaml(&missing, "backend.test", false),
    );
    let cfg = ProxyConfig::parse(&yaml, "test.yaml").unwrap();
    let Err(err) = Proxy::start(cfg).await else {
        panic!("a missing CA file was accepted");
    };
    let text = err.to_string();
    assert!(text.contains("tls.ca_file"), "{text}");
}

/// Whether `/clusters` shows the endpoint at `addr` healthy.
async fn healthy(p: &Proxy, addr: SocketAddr) -> bool {
    let (_, body) = admin(p, "/clusters").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v[0]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["address"] == addr.to_string())
        .and_then(|e| e["healthy"].as_bool())
        .unwrap()
}

/// T1: active health checks of a TLS cluster speak TLS with the
/// cluster's client (CA, SNI; ALPN `h2` for HTTP/2), so a TLS endpoint
/// passes them (plaintext checks would fail it).
#[tokio::test]
async fn health_checks_of_a_tls_cluster_use_its_tls_settings() {
    for (protocol, alpn) in [("http1", &[][..]), ("http2", &[&b"h2"[..]][..])] {
        let (ca, server) = pki("backend.test", alpn);
        let up = Upstream::start(100, Some(server)).await;
        let (_ca_dir, ca) = ca_file(&format!("hc-{protocol}"), &ca);
        let extra = format!(
            "    upstream_protocol: {protocol}\n{}    health_check: {{ path: /health, interval: 100ms, healthy_threshold: 1, unhealthy_threshold: 1 }}\n",
            tls_yaml(&ca, "backend.test", !alpn.is_empty())
        );
        let (p, _addr) = proxy_to(&[up.addr], &extra).await;
        eventually("three checks over TLS with the cluster's SNI", || async {
            up.seen.sni.lock().unwrap().len() >= 3
        })
        .await;
        assert!(
            up.seen
                .sni
                .lock()
                .unwrap()
                .iter()
                .all(|s| s == "backend.test"),
            "{protocol}"
        );
        assert!(healthy(&p, up.addr).await, "{protocol}: the checks pass");
        p.shutdown().await;
    }
}

/// T4: a cluster with `upstream_protocol: http2` and `tls` (no `alpn`
/// given) offers `h2` in ALPN; an endpoint that agrees to none is still
/// spoken HTTP/2 to.
#[tokio::test]
async fn tls_to_an_http2_cluster_offers_h2_by_default() {
    for (server_alpn, agreed) in [(&[&b"h2"[..]][..], &b"h2"[..]), (&[][..], &b""[..])] {
        let (ca, server) = pki("backend.test", server_alpn);
        let up = Upstream::start(100, Some(server)).await;
        let (_ca_dir, ca) = ca_file("h2-default", &ca);
        let extra = format!(
            "    upstream_protocol: http2\n    tls: {{ ca_file: \"{}\", server_name: backend.test }}\n",
            ca.display()
        );
        let (p, addr) = proxy_to(&[up.addr], &extra).await;
        let (status, _, body) = get(&client(), addr, "/", &[]).await;
        assert_eq!((status.as_u16(), body.as_str()), (200, "ok\n"));
        assert_eq!(*up.seen.alpn.lock().unwrap(), vec![agreed.to_vec()]);
        p.shutdown().await;
    }
}

/// A reload reads the cluster's `tls.ca_file` again even when its path is
/// the same: a CA rotated in place takes effect, and a file that is no CA
/// any more fails the reload (the running pool stays).
#[tokio::test]
async fn a_reload_rereads_a_rewritten_ca_file_and_refuses_garbage() {
    let (ca, server) = pki("backend.test", &[]);
    let (other_ca, _) = pki("backend.test", &[]);
    let up = Upstream::start(100, Some(server)).await;
    let (_ca_dir, ca_path) = ca_file("rotate", &other_ca);
    let (p, addr) = proxy_to(&[up.addr], &tls_yaml(&ca_path, "backend.test", false)).await;
    let (status, _, _) = get(&client(), addr, "/", &[]).await;
    assert_eq!(status, 503, "the wrong CA");
    let same = || {
        let text = yaml(&[up.addr], &tls_yaml(&ca_path, "backend.test", false)).replace(
            "127.0.0.1:0\"\n    routes",
            &format!("{addr}\"\n    routes"),
        );
        assert!(text.contains(&addr.to_string()), "{text}");
        common::on_test_http1(ProxyConfig::parse(&text, "r.yaml").expect("valid"))
    };
    std::fs::write(&ca_path, &ca).unwrap();
    p.reload(same()).await.expect("reload with the rotated CA");
    let (status, _, body) = get(&client(), addr, "/", &[]).await;
    assert_eq!((status.as_u16(), body.as_str()), (200, "ok\n"));
    std::fs::write(&ca_path, "garbage\n").unwrap();
    let e = p
        .reload(same())
        .await
        .expect_err("a CA file with no certificate");
    assert!(e.to_string().contains("tls.ca_file"), "{e}");
    let (status, _, _) = get(&client(), addr, "/", &[]).await;
    assert_eq!(status, 200, "the running pool stays");
    p.shutdown().await;
}
