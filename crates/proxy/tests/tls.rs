//! TLS termination through real sockets with a rustls client: certificates
//! by SNI name and the default, ALPN h2 and http/1.1, resumption, TLS
//! versions, the handshake timeout, certificate reload under traffic, and
//! refused files keeping the running config.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::tls::{self, Sender, TempDir};
use common::{backend, endpoints_yaml, eventually, proxy_metric};
use http::StatusCode;
use meshless_proxy::{Proxy, ProxyConfig};
use tokio::io::AsyncReadExt;

/// A config with listener `web` terminating TLS: `a.test` and `b.test`
/// (with `*.wild.test`) by SNI, `default` otherwise; `tls_extra` is added
/// to its `tls:` block (indented 6).
fn tls_config(dir: &Path, endpoints: &str, tls_extra: &str) -> String {
    let f = |stem: &str, ext: &str| dir.join(format!("{stem}.{ext}")).display().to_string();
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 5s\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\n    tls:\n      default_certificate: {{ certificate: \"{}\", key: \"{}\" }}\n      certificates:\n        - {{ server_names: [a.test], certificate: \"{}\", key: \"{}\" }}\n        - {{ server_names: [b.test, \"*.wild.test\"], certificate: \"{}\", key: \"{}\" }}\n{tls_extra}clusters:\n  - name: c\n    endpoints:\n{endpoints}",
        f("default", "pem"),
        f("default", "key"),
        f("a", "pem"),
        f("a", "key"),
        f("b", "pem"),
        f("b", "key"),
    )
}

struct Certs {
    default: Vec<u8>,
    a: Vec<u8>,
    b: Vec<u8>,
}

fn write_all(dir: &Path) -> Certs {
    Certs {
        default: tls::write_cert(dir, "default", &["default.test"]),
        a: tls::write_cert(dir, "a", &["a.test"]),
        b: tls::write_cert(dir, "b", &["b.test", "*.wild.test"]),
    }
}

async fn start(yaml: &str) -> (Proxy, std::net::SocketAddr) {
    let cfg = common::on_test_http1(ProxyConfig::parse(yaml, "tls.yaml").unwrap());
    let p = Proxy::start(cfg).await.unwrap();
    let addr = p.listener_addr("web").await.unwrap();
    (p, addr)
}

#[tokio::test]
async fn each_sni_name_gets_its_certificate_and_others_the_default() {
    let dir = TempDir::new("tls-sni");
    let certs = write_all(&dir.0);
    let b0 = backend("b0").await;
    let (p, addr) = start(&tls_config(
        &dir.0,
        &endpoints_yaml(std::slice::from_ref(&b0)),
        "",
    ))
    .await;
    let client = tls::default_client();
    let cases = [
        ("a.test", &certs.a),
        ("A.TEST", &certs.a),
        ("b.test", &certs.b),
        ("x.wild.test", &certs.b),
        ("wild.test", &certs.default),
        ("y.x.wild.test", &certs.default),
        ("unknown.test", &certs.default),
        // An IP address: the client sends no SNI.
        ("127.0.0.1", &certs.default),
    ];
    for (sni, want) in cases {
        let conn = tls::connect(&client, addr, sni).await.unwrap();
        assert!(tls::leaf(&conn) == **want, "{sni}: wrong certificate");
        let mut s = Sender::new(conn).await.unwrap();
        let (status, _) = s.get(sni, "/").await.unwrap();
        assert_eq!(status, StatusCode::OK, "{sni}");
    }
    p.shutdown().await;
}

#[tokio::test]
async fn alpn_h2_and_http11_both_reach_the_backend() {
    let dir = TempDir::new("tls-alpn");
    write_all(&dir.0);
    let b0 = backend("b0").await;
    let (p, addr) = start(&tls_config(
        &dir.0,
        &endpoints_yaml(std::slice::from_ref(&b0)),
        "",
    ))
    .await;
    for (offered, agreed) in [
        (&["h2", "http/1.1"][..], Some("h2")),
        (&["h2"][..], Some("h2")),
        (&["http/1.1"][..], Some("http/1.1")),
        (&[][..], None),
    ] {
        let client = tls::client_config(offered, rustls::ALL_VERSIONS);
        let conn = tls::connect(&client, addr, "a.test").await.unwrap();
        assert_eq!(tls::alpn(&conn).as_deref(), agreed, "{offered:?}");
        let mut s = Sender::new(conn).await.unwrap();
        for _ in 0..3 {
            let (status, from) = s.get("a.test", "/").await.unwrap();
            assert_eq!(
                (status, from.as_str()),
                (StatusCode::OK, "b0"),
                "{offered:?}"
            );
        }
    }
    p.shutdown().await;
}

#[tokio::test]
async fn tls13_only_refuses_a_tls12_client_and_resumption_works() {
    let dir = TempDir::new("tls-versions");
    write_all(&dir.0);
    let b0 = backend("b0").await;
    let yaml = tls_config(
        &dir.0,
        &endpoints_yaml(std::slice::from_ref(&b0)),
        "      min_version: \"1.3\"\n",
    );
    let (p, addr) = start(&yaml).await;
    let old = tls::client_config(&["http/1.1"], &[&rustls::version::TLS12]);
    assert!(tls::connect(&old, addr, "a.test").await.is_err());
    eventually("the refused handshake counted", || async {
        proxy_metric(
            &p,
            "meshless_proxy_tls_handshakes_total{listener=\"web\",result=\"failed\"}",
        )
        .await
            == 1.0
    })
    .await;
    // The same client config keeps the session: its second handshake resumes.
    let client = tls::default_client();
    let mut resumed = false;
    for _ in 0..3 {
        let conn = tls::connect(&client, addr, "a.test").await.unwrap();
        resumed |= conn.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
        let mut s = Sender::new(conn).await.unwrap();
        assert_eq!(s.get("a.test", "/").await.unwrap().0, StatusCode::OK);
    }
    assert!(resumed, "no handshake resumed a session");
    let resumed_metric = "meshless_proxy_tls_handshakes_total{listener=\"web\",result=\"resumed\"}";
    assert!(proxy_metric(&p, resumed_metric).await >= 1.0);
    p.shutdown().await;
}

#[tokio::test]
async fn a_silent_client_is_closed_at_the_handshake_timeout_and_counted() {
    let dir = TempDir::new("tls-timeout");
    write_all(&dir.0);
    let b0 = backend("b0").await;
    let yaml = tls_config(
        &dir.0,
        &endpoints_yaml(std::slice::from_ref(&b0)),
        "      handshake_timeout: 200ms\n",
    );
    let (p, addr) = start(&yaml).await;
    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The proxy closes it: the read ends (0 bytes or a reset), it never hangs.
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(common::DEADLINE, silent.read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");
    eventually("the timeout counted", || async {
        proxy_metric(
            &p,
            "meshless_proxy_tls_handshakes_total{listener=\"web\",result=\"timeout\"}",
        )
        .await
            == 1.0
    })
    .await;
    p.shutdown().await;
}

/// Clients keep connecting and sending while the certificate of `a.test`
/// is replaced and the config reloaded: every request succeeds, a
/// connection opened before the reload keeps working, and new handshakes
/// get the new certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_reload_under_traffic() {
    let dir = TempDir::new("tls-reload");
    let certs = write_all(&dir.0);
    let b0 = backend("b0").await;
    let yaml = tls_config(&dir.0, &endpoints_yaml(std::slice::from_ref(&b0)), "");
    let file = dir.path("proxy.yaml");
    std::fs::write(&file, &yaml).unwrap();
    let p = Proxy::start(common::on_test_http1(ProxyConfig::load(&file).unwrap()))
        .await
        .unwrap();
    let addr = p.listener_addr("web").await.unwrap();
    let client = tls::default_client();
    let mut before = Sender::new(tls::connect(&client, addr, "a.test").await.unwrap())
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let mut load = Vec::new();
    for _ in 0..4 {
        let (stop, ok, failed, client) = (stop.clone(), ok.clone(), failed.clone(), client.clone());
        load.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let result = match tls::connect(&client, addr, "a.test").await {
                    Ok(conn) => match Sender::new(conn).await {
                        Ok(mut s) => s.get("a.test", "/").await.map(|r| r.0),
                        Err(e) => Err(e.to_string()),
                    },
                    Err(e) => Err(e.to_string()),
                };
                match result {
                    Ok(StatusCode::OK) => ok.fetch_add(1, Ordering::Relaxed),
                    other => {
                        eprintln!("failed: {other:?}");
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        }));
    }
    eventually("traffic before the reload", || async {
        ok.load(Ordering::Relaxed) >= 20
    })
    .await;
    let new_a = tls::write_cert(&dir.0, "a", &["a.test"]);
    assert!(new_a != certs.a);
    p.reload_from(&file).await.unwrap();
    let seen_before = ok.load(Ordering::Relaxed);
    eventually("traffic after the reload", || async {
        ok.load(Ordering::Relaxed) >= seen_before + 20
    })
    .await;
    // A client without a session to resume (a resumed session keeps the
    // certificate of the handshake that made it, as TLS defines).
    let fresh = tls::connect(&tls::default_client(), addr, "a.test")
        .await
        .unwrap();
    assert!(
        tls::leaf(&fresh) == new_a,
        "a new handshake got the old certificate"
    );
    assert!(tls::leaf(&tls::connect(&client, addr, "b.test").await.unwrap()) == certs.b);
    assert_eq!(before.get("a.test", "/").await.unwrap().0, StatusCode::OK);
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.await.unwrap();
    }
    assert_eq!(failed.load(Ordering::Relaxed), 0);
    p.shutdown().await;
}

/// Each bad file is refused with its path in the error, at start and on
/// reload, and on reload the running certificates stay.
#[tokio::test]
async fn expired_mismatched_and_unreadable_files_are_refused() {
    let dir = TempDir::new("tls-bad");
    let certs = write_all(&dir.0);
    let b0 = backend("b0").await;
    let yaml = tls_config(&dir.0, &endpoints_yaml(std::slice::from_ref(&b0)), "");
    let file = dir.path("proxy.yaml");
    std::fs::write(&file, &yaml).unwrap();
    let p = Proxy::start(common::on_test_http1(ProxyConfig::load(&file).unwrap()))
        .await
        .unwrap();
    let addr = p.listener_addr("web").await.unwrap();
    let good_a = (
        std::fs::read_to_string(dir.path("a.pem")).unwrap(),
        std::fs::read_to_string(dir.path("a.key")).unwrap(),
    );
    let other_key = std::fs::read_to_string(dir.path("b.key")).unwrap();
    let a_pem = dir.path("a.pem").display().to_string();
    let a_key = dir.path("a.key").display().to_string();
    // What is spoiled, how, the file the error must name, and its reason.
    type Spoil<'a> = (&'a str, Box<dyn Fn() + 'a>, &'a str, &'a str);
    let bad: Vec<Spoil<'_>> = vec![
        (
            "expired",
            Box::new(|| tls::write_expired_cert(&dir.0, "a", &["a.test"])),
            &a_pem,
            "expired",
        ),
        (
            "mismatched key",
            Box::new(|| tls::write_files(&dir.0, "a", &good_a.0, &other_key)),
            &a_key,
            "does not match",
        ),
        (
            "missing certificate",
            Box::new(|| std::fs::remove_file(dir.path("a.pem")).unwrap()),
            &a_pem,
            "cannot read",
        ),
        (
            "not PEM",
            Box::new(|| tls::write_files(&dir.0, "a", "hello\n", &good_a.1)),
            &a_pem,
            "no PEM certificate",
        ),
        (
            "no key",
            Box::new(|| tls::write_files(&dir.0, "a", &good_a.0, "")),
            &a_key,
            "no PEM private key",
        ),
    ];
    let client = tls::default_client();
    for (what, spoil, path, reason) in bad {
        spoil();
        let err = p.reload_from(&file).await.unwrap_err().to_string();
        assert!(err.contains(path) && err.contains(reason), "{what}: {err}");
        let start = Proxy::start(common::on_test_http1(ProxyConfig::load(&file).unwrap())).await;
        let err = start.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            err.contains(path) && err.contains(reason),
            "{what} at start: {err}"
        );
        // The running certificates stay.
        let conn = tls::connect(&client, addr, "a.test").await.unwrap();
        assert!(
            tls::leaf(&conn) == certs.a,
            "{what}: the running certificate changed"
        );
        assert_eq!(
            Sender::new(conn)
                .await
                .unwrap()
                .get("a.test", "/")
                .await
                .unwrap()
                .0,
            StatusCode::OK
        );
        tls::write_files(&dir.0, "a", &good_a.0, &good_a.1);
    }
    assert!(proxy_metric(&p, "meshless_proxy_reloads_total{result=\"failure\"}").await >= 5.0);
    p.shutdown().await;
}

#[test]
fn tls_settings_are_validated_as_data() {
    let dir = std::env::temp_dir();
    for (extra, path) in [
        ("      alpn: []\n", "listeners[0].tls.alpn"),
        ("      alpn: [h2, h2]\n", "listeners[0].tls.alpn"),
        (
            "      handshake_timeout: 0s\n",
            "listeners[0].tls.handshake_timeout",
        ),
        (
            "      min_version: \"1.1\"\n",
            "listeners[0].tls.min_version",
        ),
    ] {
        let err = ProxyConfig::parse(
            &tls_config(&dir, "      - { address: \"127.0.0.1:1\" }\n", extra),
            "t.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains(path), "{extra}: {err}");
    }
    let dup = tls_config(&dir, "      - { address: \"127.0.0.1:1\" }\n", "")
        .replace("[a.test]", "[b.test]");
    let err = ProxyConfig::parse(&dup, "t.yaml").unwrap_err().to_string();
    assert!(
        err.contains("listeners[0].tls.certificates[1].server_names[0]"),
        "{err}"
    );
    let upper = tls_config(&dir, "      - { address: \"127.0.0.1:1\" }\n", "")
        .replace("[a.test]", "[A.test]");
    let err = ProxyConfig::parse(&upper, "t.yaml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("server_names[0]"), "{err}");
}

/// T2: a reload rejected because of a later listener changes nothing: the
/// certificates of a listener checked before the failure are not
/// installed (listener `web` keeps serving its old `a.test` certificate).
#[tokio::test]
async fn a_rejected_reload_installs_no_certificate() {
    let dir = TempDir::new("tls-rejected");
    let certs = write_all(&dir.0);
    tls::write_cert(&dir.0, "c", &["c.test"]);
    let b0 = backend("b0").await;
    let web = tls_config(&dir.0, &endpoints_yaml(std::slice::from_ref(&b0)), "");
    // A second TLS listener, after `web`.
    let second = format!(
        "  - name: second\n    address: \"127.0.0.1:0\"\n    routes:\n      - cluster: c\n    tls:\n      default_certificate: {{ certificate: \"{}\", key: \"{}\" }}\nclusters:\n",
        dir.path("c.pem").display(),
        dir.path("c.key").display()
    );
    let yaml = web.replacen("clusters:\n", &second, 1);
    let file = dir.path("proxy.yaml");
    std::fs::write(&file, &yaml).unwrap();
    let p = Proxy::start(common::on_test_http1(ProxyConfig::load(&file).unwrap()))
        .await
        .unwrap();
    let addr = p.listener_addr("web").await.unwrap();
    let client = tls::default_client();
    let leaf = |conn| tls::leaf(&conn);
    assert!(leaf(tls::connect(&client, addr, "a.test").await.unwrap()) == certs.a);

    // `web`'s certificate for a.test changes, `second`'s file is gone.
    let new_a = tls::write_cert(&dir.0, "a", &["a.test"]);
    assert!(new_a != certs.a);
    std::fs::remove_file(dir.path("c.pem")).unwrap();
    let err = p.reload_from(&file).await.unwrap_err().to_string();
    assert!(err.contains("listeners[1].tls"), "{err}");
    assert!(
        leaf(tls::connect(&client, addr, "a.test").await.unwrap()) == certs.a,
        "a rejected reload installed web's new certificate"
    );

    // Once `second` is fixed, the reload installs the new one.
    tls::write_cert(&dir.0, "c", &["c.test"]);
    p.reload_from(&file).await.unwrap();
    assert!(leaf(tls::connect(&client, addr, "a.test").await.unwrap()) == new_a);
    p.shutdown().await;
}

/// Over TLS, `timeouts.send` counts the bytes that reach the socket, not
/// the plaintext rustls takes (it holds up to 64 KiB of records): a
/// client that reads a 128 KiB answer slowly but steadily (4 KiB every
/// 250 ms, about 8 s) through small socket buffers is not cut by a 2 s
/// bound, though the last of the answer sits in rustls for longer (64
/// KiB at 16 KiB/s: 4 s). The bound is eight reads long: a reader
/// starved for a second on a loaded machine is still steady.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_but_steady_tls_reader_is_not_cut_at_the_send_timeout() {
    use tokio::io::AsyncWriteExt;
    const LEN: usize = 128 * 1024;
    let dir = TempDir::new("tls-send");
    write_all(&dir.0);
    let mut answer = format!("HTTP/1.1 200 OK\r\nContent-Length: {LEN}\r\n\r\n").into_bytes();
    answer.resize(answer.len() + LEN, b'x');
    let up = common::raw_upstream(answer.leak()).await;
    let listener = "    http1: meshless\n    timeouts: { send: 2s }\n    socket: { send_buffer_bytes: 4096 }\n    routes:\n";
    let yaml = tls_config(&dir.0, &format!("      - {{ address: \"{up}\" }}\n"), "").replacen(
        "    routes:\n",
        listener,
        1,
    );
    assert!(yaml.contains("send: 2s"));
    let (p, addr) = start(&yaml).await;
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let tcp = sock.connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("a.test").unwrap();
    let client = tls::client_config(&["http/1.1"], rustls::ALL_VERSIONS);
    let mut s = tokio_rustls::TlsConnector::from(client)
        .connect(name, tcp)
        .await
        .unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4 * 1024];
    let whole = loop {
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        let n = tokio::time::timeout(common::DEADLINE, s.read(&mut buf))
            .await
            .expect("bytes or an end")
            .unwrap_or(0);
        got.extend_from_slice(&buf[..n]);
        let body = got
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map(|i| got.len() - i - 4);
        if n == 0 || body == Some(LEN) {
            break body == Some(LEN);
        }
    };
    assert!(whole, "cut after {} bytes", got.len());
    let timeouts = "meshless_proxy_downstream_send_timeouts_total{listener=\"web\"}";
    assert_eq!(proxy_metric(&p, timeouts).await, 0.0);
    p.shutdown().await;
}

/// Over TLS, a `100 Continue` whose flush waits (the socket is full of an
/// earlier response the client has not read) is bounded by
/// `timeouts.send` as the response is: the connection is closed and
/// counted, the request held upstream dropped as the client's abort, not
/// kept until the cluster's `timeouts.request` answers it 504.
///
/// Which write meets the full socket depends on the kernel's buffers, so
/// connections sweep the size of the first response (an echo of a
/// pipelined POST): on some, its last bytes fill the socket and the
/// interim line of the next request (`Expect: 100-continue`, to a held
/// upstream) is the write that stalls. Each client reads only once the
/// proxy closed every connection, and tells from what it got which write
/// stalled: the first response (cut), the interim line (first response
/// whole, no `100`), or none (`100` arrived: the body is awaited until the
/// cluster's deadline, then the 504 and the connection's end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_100_continue_whose_flush_waits_is_closed_at_the_send_timeout() {
    use tokio::io::AsyncWriteExt;
    // hyper's HTTP/1 server has no send bound (`timeouts.send` is ours:
    // docs/config.md); CI runs this suite on it too.
    if common::test_http1() == meshless_proxy::h1serve::Http1Server::Hyper {
        return;
    }
    const SEND_TIMEOUTS: &str = "meshless_proxy_downstream_send_timeouts_total{listener=\"web\"}";
    let dir = TempDir::new("tls-continue");
    write_all(&dir.0);
    let b0 = backend("b0").await;
    let held = common::Gated::start("x").await;
    let listener = "    http1: meshless\n    timeouts: { send: 1s, request_headers: 2s }\n    socket: { send_buffer_bytes: 4096 }\n    routes:\n      - match: { path_prefix: /x }\n        cluster: x\n";
    let yaml = format!(
        "{}  - name: x\n    timeouts: {{ request: 5s }}\n    endpoints:\n      - {{ address: \"{}\" }}\n",
        tls_config(&dir.0, &endpoints_yaml(std::slice::from_ref(&b0)), "").replacen(
            "    routes:\n",
            listener,
            1
        ),
        held.local_addr()
    );
    assert!(yaml.contains("cluster: x") && yaml.contains("request: 5s"));
    let (p, addr) = start(&yaml).await;
    let client = tls::client_config(&["http/1.1"], rustls::ALL_VERSIONS);
    let sizes: Vec<usize> = (0..160).map(|i| 1024 + i * 256).collect();
    let mut conns = Vec::new();
    for &size in &sizes {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.set_recv_buffer_size(4096).unwrap();
        let tcp = sock.connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("a.test").unwrap();
        let mut s = tokio_rustls::TlsConnector::from(client.clone())
            .connect(name, tcp)
            .await
            .unwrap();
        let mut req =
            format!("POST /echo HTTP/1.1\r\nHost: a.test\r\nContent-Length: {size}\r\n\r\n")
                .into_bytes();
        req.resize(req.len() + size, b'~');
        req.extend_from_slice(
            b"POST /x HTTP/1.1\r\nHost: a.test\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n",
        );
        s.write_all(&req).await.unwrap();
        s.flush().await.unwrap();
        conns.push(s);
    }
    eventually("every connection closed", || async {
        proxy_metric(
            &p,
            "meshless_proxy_downstream_connections{listener=\"web\"}",
        )
        .await
            == 0.0
    })
    .await;
    // What each client got: the first response whole, the interim line.
    let mut outcomes = Vec::new();
    for (s, &size) in conns.iter_mut().zip(&sizes) {
        let mut got = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match tokio::time::timeout(common::DEADLINE, s.read(&mut buf))
                .await
                .expect("the proxy closed it")
            {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        let whole = got.iter().filter(|b| **b == b'~').count() == size;
        let interim = got.windows(12).any(|w| w == b"100 Continue");
        outcomes.push((size, whole, interim));
    }
    let count = |f: fn(&(usize, bool, bool)) -> bool| outcomes.iter().filter(|o| f(o)).count();
    let stalled_interim = count(|o| o.1 && !o.2);
    let stalled_first = count(|o| !o.1);
    let continued = count(|o| o.2);
    assert!(
        stalled_interim > 0,
        "no size made the interim line the stalled write: {outcomes:?}"
    );
    let page = common::admin(&p, "/metrics").await.1;
    let x = |class: &str| {
        common::metric_sum(
            &page,
            &format!(
                "meshless_proxy_requests_total{{listener=\"web\",cluster=\"x\",endpoint=\"{}\",class=\"{class}\"}}",
                held.local_addr()
            ),
        )
    };
    // Closed at the send timeout: the held request dropped as the
    // client's abort, not answered 504 at the cluster's deadline.
    assert_eq!(
        (x("client_abort"), x("5xx")),
        (stalled_interim as f64, continued as f64),
        "{outcomes:?}"
    );
    let timeouts = common::metric(&page, SEND_TIMEOUTS).unwrap_or(0.0);
    assert!(
        timeouts >= (stalled_first + stalled_interim) as f64,
        "{timeouts} send timeouts: {outcomes:?}"
    );
    p.shutdown().await;
}

/// Over TLS, a client that says `Expect: 100-continue` but sends its body
/// at once (as curl does after its 1 s wait, and clients that never wait)
/// with a request pipelined behind it, by length and chunked: the body
/// reaches the upstream whole, a `100 Continue` (if any) comes before the
/// final answer, and the next request on the connection is answered too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_body_sent_without_waiting_for_100_continue_is_read_once() {
    use tokio::io::AsyncWriteExt;
    let dir = TempDir::new("tls-expect");
    write_all(&dir.0);
    let b0 = backend("b0").await;
    let yaml = tls_config(&dir.0, &endpoints_yaml(std::slice::from_ref(&b0)), "").replacen(
        "    routes:\n",
        "    http1: meshless\n    routes:\n",
        1,
    );
    let (p, addr) = start(&yaml).await;
    let client = tls::client_config(&["http/1.1"], rustls::ALL_VERSIONS);
    for framing in [
        "Content-Length: 11\r\n\r\nhello world",
        "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    ] {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("a.test").unwrap();
        let mut s = tokio_rustls::TlsConnector::from(client.clone())
            .connect(name, tcp)
            .await
            .unwrap();
        let req = format!(
            "POST /echo HTTP/1.1\r\nHost: a.test\r\nExpect: 100-continue\r\n{framing}GET /status/202 HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        s.flush().await.unwrap();
        let mut got = Vec::new();
        let read = tokio::time::timeout(common::DEADLINE, s.read_to_end(&mut got)).await;
        assert!(read.is_ok(), "{framing:?}: the proxy closes after the GET");
        let text = String::from_utf8_lossy(&got).into_owned();
        // The interim line, if sent, is first; then the echo, then the GET's.
        let answers = text
            .strip_prefix("HTTP/1.1 100 Continue\r\n\r\n")
            .unwrap_or(&text);
        assert!(
            answers.starts_with("HTTP/1.1 200 OK\r\n") && !answers.contains("100 Continue"),
            "{framing:?}: {text}"
        );
        let second = answers
            .find("HTTP/1.1 202")
            .unwrap_or_else(|| panic!("{framing:?}: no answer to the GET: {text}"));
        let echo = &answers[..second];
        // Whole (its framing, length or chunks, is the proxy's choice).
        let body = &echo[echo.find("\r\n\r\n").unwrap() + 4..];
        assert!(
            body == "hello world"
                || (body.contains("hello")
                    && body.contains(" world")
                    && body.ends_with("0\r\n\r\n")),
            "{framing:?}: {echo}"
        );
        assert!(
            answers[second..].ends_with("b0 202\n"),
            "{framing:?}: {text}"
        );
    }
    p.shutdown().await;
}
