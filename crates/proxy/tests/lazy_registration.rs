//! Connections registered with the reactor only when they first wait
//! (`LazyTcpStream`), through real sockets: a request already in the
//! socket when the proxy accepts it is read, answered and closed without
//! registering, and every way such a connection can later have to wait
//! (its client leaving while the upstream hangs, a `100 Continue`, a
//! partial head and its timeout, a response the client never reads, an
//! upgrade, HTTP/2, `http1: hyper`, the PROXY protocol, deny rules, TCP
//! and TLS listeners, a drain, a reset, a reload, a binary upgrade, a full
//! descriptor table) still wakes it, and every gauge comes back to zero.
//!
//! How a request is put in the socket before the proxy accepts it: the
//! listener has `max_connections: 1`, a holder connection takes the slot,
//! the client connects (the kernel completes the handshake) and writes,
//! the test waits until `/proc/net/tcp` shows the bytes in the queue of
//! the not yet accepted socket, then the holder leaves. Whether the
//! proxy's side of a connection is registered is read from the `fdinfo`
//! of this process's epoll instances (the proxy runs in the test's
//! process).
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::raw_h1::Reader;
use common::*;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use meshless_proxy::h1serve::Http1Server;
use meshless_proxy::{Proxy, ProxyConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BUFFERS: &str = "meshless_proxy_http1_buffers_lent{listener=\"web\"}";
const CONNECTIONS: &str = "meshless_proxy_downstream_connections{listener=\"web\"}";

/// One slot, and no head timeout to race the holder (listener fields,
/// indented 4).
const ONE_SLOT: &str = "    max_connections: 1\n    timeouts: { request_headers: 1h }\n";

/// One HTTP listener `web` routing everything to cluster `c` at `up`.
fn yaml(up: SocketAddr, listener_extra: &str) -> String {
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 5s\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n{listener_extra}    routes:\n      - cluster: c\nclusters:\n  - name: c\n    endpoints:\n      - {{ address: \"{up}\" }}\n"
    )
}

// ---------------------------------------------------------------------
// The kernel's view: /proc/net/tcp and the epoll instances' fdinfo.
// ---------------------------------------------------------------------

fn proc_addr(a: SocketAddr) -> String {
    match a {
        SocketAddr::V4(a) => format!(
            "{:08X}:{:04X}",
            u32::from_le_bytes(a.ip().octets()),
            a.port()
        ),
        SocketAddr::V6(_) => unreachable!("the tests listen on IPv4"),
    }
}

/// The socket at `local` connected to `remote` in `/proc/net/tcp`: its
/// inode (0 while it waits in the accept queue) and the bytes in its
/// receive queue; `None` when there is none (closed, or never was).
fn tcp_entry(local: SocketAddr, remote: SocketAddr) -> Option<(u64, u64)> {
    let (l, r) = (proc_addr(local), proc_addr(remote));
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap();
    text.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 10 || f[1] != l || f[2] != r {
            return None;
        }
        let rx = u64::from_str_radix(f[4].split(':').nth(1)?, 16).ok()?;
        Some((f[9].parse().ok()?, rx))
    })
}

/// The proxy's side of the connection `client` opened to it.
fn proxy_side(client: &TcpStream) -> Option<(u64, u64)> {
    tcp_entry(client.peer_addr().unwrap(), client.local_addr().unwrap())
}

/// Connections waiting in the accept queue of the listener at `addr`.
fn accept_queue(addr: SocketAddr) -> u64 {
    let any = "0.0.0.0:0".parse().unwrap();
    tcp_entry(addr, any).map_or(0, |(_, rx)| rx)
}

/// Whether a socket of inode `inode` is in the interest list of an epoll
/// instance of this process (tokio's reactor).
fn in_an_epoll(inode: u64) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return false;
    };
    for e in dir.flatten() {
        let Ok(link) = std::fs::read_link(e.path()) else {
            continue;
        };
        if link.to_str() != Some("anon_inode:[eventpoll]") {
            continue;
        }
        let info = std::fs::read_to_string(format!(
            "/proc/self/fdinfo/{}",
            e.file_name().to_string_lossy()
        ))
        .unwrap_or_default();
        let watched = info.lines().filter(|l| l.starts_with("tfd:")).any(|l| {
            l.split_whitespace().any(|t| {
                t.strip_prefix("ino:")
                    .and_then(|h| u64::from_str_radix(h, 16).ok())
                    == Some(inode)
            })
        });
        if watched {
            return true;
        }
    }
    false
}

/// Whether the proxy's side of `client` is registered with the reactor;
/// `None` once it is closed (or not yet accepted).
fn registered(client: &TcpStream) -> Option<bool> {
    match proxy_side(client)? {
        (0, _) => None,
        (inode, _) => Some(in_an_epoll(inode)),
    }
}

// ---------------------------------------------------------------------
// Putting bytes in a socket before the proxy accepts it.
// ---------------------------------------------------------------------

/// Polls until `series` reads `want` on the proxy's `/metrics`.
async fn metric_is(p: &Proxy, series: &str, want: f64) {
    eventually(&format!("{series} == {want}"), || async {
        proxy_metric(p, series).await == want
    })
    .await;
}

/// Polls until no endpoint counts a request in flight.
async fn nothing_in_flight(p: &Proxy) {
    eventually("no request in flight", || async {
        metric_sum(
            &admin(p, "/metrics").await.1,
            "meshless_proxy_endpoint_in_flight{",
        ) == 0.0
    })
    .await;
}

/// Waits until the listener counts no connection and no buffer, then
/// shuts the proxy down.
async fn nothing_held_then_shutdown(p: Proxy) {
    metric_is(&p, CONNECTIONS, 0.0).await;
    metric_is(&p, BUFFERS, 0.0).await;
    nothing_in_flight(&p).await;
    p.shutdown().await;
}

/// Whether the server closes `s` (reads until EOF or an error).
async fn closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(DEADLINE, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => return false,
        }
    }
}

/// Takes the listener's only slot with a connection that writes `first`
/// (which must not end it): returns once the proxy counts it.
async fn take_slot(p: &Proxy, addr: SocketAddr, first: &[u8]) -> TcpStream {
    let mut holder = TcpStream::connect(addr).await.unwrap();
    holder.write_all(first).await.unwrap();
    metric_is(p, CONNECTIONS, 1.0).await;
    holder
}

/// Waits until at least `n` bytes `client` wrote are in the queue of the
/// proxy's side of it, not yet accepted.
async fn queued_in_kernel(client: &TcpStream, n: u64) {
    eventually("the bytes wait in the accept queue", || async {
        matches!(proxy_side(client), Some((0, rx)) if rx >= n)
    })
    .await;
}

/// `client` (connected while `holder` holds the only slot) writes `raw`,
/// and half-closes if asked, before the proxy accepts it; then the holder
/// leaves and the proxy accepts `client` with its bytes already there.
async fn with_bytes_at_accept(
    holder: TcpStream,
    client: &mut TcpStream,
    raw: &[u8],
    half_close: bool,
) {
    client.write_all(raw).await.unwrap();
    if half_close {
        client.shutdown().await.unwrap();
    }
    queued_in_kernel(client, raw.len() as u64).await;
    drop(holder);
}

/// A new connection whose `raw` bytes are there when the proxy accepts it.
async fn queued(p: &Proxy, addr: SocketAddr, raw: &[u8]) -> TcpStream {
    let holder = take_slot(p, addr, b"").await;
    let mut c = TcpStream::connect(addr).await.unwrap();
    with_bytes_at_accept(holder, &mut c, raw, false).await;
    c
}

/// Reads a response head (up to its blank line) and nothing more.
async fn head_only(s: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut b = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(DEADLINE, s.read(&mut b))
            .await
            .expect("a head within the deadline")
            .unwrap();
        assert!(n > 0, "closed mid-head: {}", String::from_utf8_lossy(&got));
        got.push(b[0]);
    }
    String::from_utf8(got).unwrap()
}

// ---------------------------------------------------------------------
// The tests.
// ---------------------------------------------------------------------

/// The fast path is real (the proxy's side of a connection whose request
/// was there at accept stays out of epoll while nothing waits: here its
/// pipelined requests fill the read-ahead, so the watch for the client
/// leaving never reads), every answer comes, and the connection is
/// registered once it waits for a head, then woken by the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_there_at_accept_is_served_unregistered_then_registers_when_it_waits() {
    let g = Gated::start("g").await;
    // Read-ahead while the upstream answers: max(3072, 8192) bytes.
    let extra =
        format!("{ONE_SLOT}    limits: {{ max_header_bytes: 1024, max_uri_bytes: 1024 }}\n");
    let (p, addr) = proxy_on(&yaml(g.local_addr(), &extra), Http1Server::Meshless).await;
    let one = b"GET / HTTP/1.1\r\nHost: t\r\n\r\n";
    let n = 12 * 1024 / one.len();
    let mut c = queued(&p, addr, &one.repeat(n)).await;
    eventually("the first request held upstream", || async {
        g.held() == 1
    })
    .await;
    assert_eq!(
        registered(&c),
        Some(false),
        "a connection that never waited on its socket is registered"
    );
    g.open();
    let mut r = Reader::new();
    for i in 0..n {
        let resp = r.response(&mut c, false).await.expect("a response");
        assert_eq!(resp.status, 200, "response {i}");
        assert_eq!(resp.body, b"g\n");
    }
    eventually("registered once it waits for a head", || async {
        registered(&c) == Some(true)
    })
    .await;
    c.write_all(one).await.unwrap();
    assert_eq!(r.response(&mut c, false).await.unwrap().status, 200);
    drop(c);
    nothing_held_then_shutdown(p).await;
    g.kill().await;
}

/// A client whose request was there at accept, and which leaves (FIN or
/// RST) while the upstream hangs, is noticed on either HTTP/1 server: its
/// request is dropped (no request in flight, `client_abort`), and the
/// connection and its buffers are given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_while_the_upstream_hangs_is_noticed_without_a_prior_wait() {
    for engine in ENGINES {
        for reset in [false, true] {
            let g = Gated::start("g").await;
            let (p, addr) = proxy_on(&yaml(g.local_addr(), ONE_SLOT), engine).await;
            let c = queued(&p, addr, b"GET /hang HTTP/1.1\r\nHost: t\r\n\r\n").await;
            eventually("the request held upstream", || async { g.held() == 1 }).await;
            if reset {
                socket2::SockRef::from(&c)
                    .set_linger(Some(Duration::ZERO))
                    .unwrap();
            }
            drop(c);
            nothing_in_flight(&p).await;
            metric_is(&p, CONNECTIONS, 0.0).await;
            metric_is(&p, BUFFERS, 0.0).await;
            let page = admin(&p, "/metrics").await.1;
            assert!(
                page.contains("class=\"client_abort\""),
                "{engine:?} reset={reset}: {page}"
            );
            p.shutdown().await;
            g.kill().await;
        }
    }
}

/// Two pipelined requests and a half-close, all there at accept: both
/// are answered in order (the first slow enough for the watch to read the
/// FIN while the second waits in the buffer), then the connection closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_and_a_half_close_there_at_accept_are_all_answered() {
    let bs = backends(1).await;
    let (p, addr) = proxy_on(&yaml(bs[0].local_addr(), ONE_SLOT), Http1Server::Meshless).await;
    let holder = take_slot(&p, addr, b"").await;
    let mut c = TcpStream::connect(addr).await.unwrap();
    with_bytes_at_accept(
        holder,
        &mut c,
        b"GET /status/201?delay_ms=200 HTTP/1.1\r\nHost: t\r\n\r\nGET /status/202 HTTP/1.1\r\nHost: t\r\n\r\n",
        true,
    )
    .await;
    let mut r = Reader::new();
    assert_eq!(r.response(&mut c, false).await.unwrap().status, 201);
    assert_eq!(r.response(&mut c, false).await.unwrap().status, 202);
    assert!(closed(&mut c).await, "closed after the half-close");
    drop(c);
    nothing_held_then_shutdown(p).await;
}

/// `Expect: 100-continue` there at accept: the interim line is written
/// without waiting, the body (sent after it) wakes the connection, and a
/// next request on it is served; on either HTTP/1 server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_100_continue_there_at_accept_wakes_for_the_body() {
    let bs = backends(1).await;
    for engine in ENGINES {
        let (p, addr) = proxy_on(&yaml(bs[0].local_addr(), ONE_SLOT), engine).await;
        let mut c = queued(
            &p,
            addr,
            b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n",
        )
        .await;
        let mut r = Reader::new();
        let interim = r.response(&mut c, false).await.unwrap();
        assert_eq!(interim.status, 100, "{engine:?}");
        c.write_all(b"hello").await.unwrap();
        let resp = r.response(&mut c, false).await.unwrap();
        assert_eq!(
            (resp.status, &resp.body[..]),
            (200, &b"hello"[..]),
            "{engine:?}"
        );
        c.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(r.response(&mut c, false).await.unwrap().status, 200);
        drop(c);
        nothing_held_then_shutdown(p).await;
    }
}

/// A refused head there at accept, with more bytes behind it: the `400`
/// is written whole without waiting, the write side shut, and the
/// lingering close (reading what the client still sends) ends with
/// nothing held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_head_there_at_accept_is_answered_whole_then_lingers() {
    let bs = backends(1).await;
    let (p, addr) = proxy_on(&yaml(bs[0].local_addr(), ONE_SLOT), Http1Server::Meshless).await;
    let mut c = queued(
        &p,
        addr,
        b"GET / HTTP/1.1\r\nX-A: a\0b\r\n\r\nGET / HTTP/1.1\r\nHost: t\r\n\r\n",
    )
    .await;
    let resp = Reader::new().response(&mut c, false).await.unwrap();
    assert_eq!(resp.status, 400);
    assert_eq!(resp.header("connection"), Some("close"));
    // The proxy shut its side and reads on (lingering).
    let mut buf = [0u8; 16];
    let eof = tokio::time::timeout(DEADLINE, c.read(&mut buf))
        .await
        .unwrap();
    assert!(matches!(eof, Ok(0)), "{eof:?}");
    // Whether the lingering close still reads or has ended meanwhile.
    for _ in 0..3 {
        let _ = c.write_all(&[b'z'; 1000]).await;
    }
    drop(c);
    nothing_held_then_shutdown(p).await;
}

/// A partial head there at accept, then silence: closed at
/// `timeouts.request_headers` on either server (the slot is held by a
/// request in flight, which no head timeout ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_head_there_at_accept_is_closed_at_request_headers() {
    let bs = backends(1).await;
    for engine in ENGINES {
        let extra = "    max_connections: 1\n    timeouts: { request_headers: 1s }\n";
        let (p, addr) = proxy_on(&yaml(bs[0].local_addr(), extra), engine).await;
        let holder = take_slot(
            &p,
            addr,
            b"GET /?delay_ms=600000 HTTP/1.1\r\nHost: t\r\n\r\n",
        )
        .await;
        eventually("the holder's request in flight", || async {
            metric_sum(
                &admin(&p, "/metrics").await.1,
                "meshless_proxy_endpoint_in_flight{",
            ) == 1.0
        })
        .await;
        let mut c = TcpStream::connect(addr).await.unwrap();
        with_bytes_at_accept(holder, &mut c, b"GET / HTTP/1.1\r\nHost: t\r\nX-A:", false).await;
        assert!(
            closed(&mut c).await,
            "{engine:?}: the silent client is closed"
        );
        drop(c);
        nothing_held_then_shutdown(p).await;
    }
}

/// A request there at accept whose response the client never reads: the
/// write that would block registers the connection, and the send timeout
/// still closes it and counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_never_read_is_closed_at_the_send_timeout() {
    const SEND_TIMEOUTS: &str = "meshless_proxy_downstream_send_timeouts_total{listener=\"web\"}";
    let up = endless_upstream().await;
    let extra = format!("{ONE_SLOT}    socket: {{ send_buffer_bytes: 4096 }}\n")
        .replace("request_headers: 1h }", "request_headers: 1h, send: 1s }");
    assert!(extra.contains("send: 1s"));
    let yaml = yaml(up, &extra).replace(
        "  - name: c\n    endpoints:",
        "  - name: c\n    timeouts: { request: 300s }\n    endpoints:",
    );
    let (p, addr) = proxy_on(&yaml, Http1Server::Meshless).await;
    let holder = take_slot(&p, addr, b"").await;
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut c = sock.connect(addr).await.unwrap();
    with_bytes_at_accept(holder, &mut c, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n", false).await;
    eventually("the stuck connection is closed and counted", || async {
        let page = admin(&p, "/metrics").await.1;
        metric(&page, SEND_TIMEOUTS) == Some(1.0)
            && metric(&page, CONNECTIONS) == Some(0.0)
            && metric_sum(&page, "meshless_proxy_endpoint_in_flight{") == 0.0
    })
    .await;
    assert!(closed(&mut c).await, "the connection is closed");
    drop(c);
    nothing_held_then_shutdown(p).await;
}

/// Responses larger than the socket buffers, to pipelined requests all
/// there at accept (more than the read-ahead bound, so the watch for the
/// client leaving never reads and the first thing to wait is a write):
/// the write that would block registers the connection and must be woken
/// as the client reads. No timer would rescue a lost wake-up: the send
/// timeout and the upstream's request timeout are far off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_larger_than_the_socket_buffers_are_written_whole() {
    const BODY: usize = 1 << 20;
    let mut answer = format!("HTTP/1.1 200 OK\r\nContent-Length: {BODY}\r\n\r\n").into_bytes();
    answer.extend(std::iter::repeat_n(b'x', BODY));
    let up = raw_upstream(Box::leak(answer.into_boxed_slice())).await;
    let extra = "    max_connections: 1\n    timeouts: { request_headers: 1h, send: 1h }\n    limits: { max_header_bytes: 1024, max_uri_bytes: 1024 }\n    socket: { send_buffer_bytes: 4096 }\n";
    let yaml = yaml(up, extra).replace(
        "  - name: c\n    endpoints:",
        "  - name: c\n    timeouts: { request: 1h }\n    endpoints:",
    );
    assert!(yaml.contains("request: 1h"));
    let (p, addr) = proxy_on(&yaml, Http1Server::Meshless).await;
    let holder = take_slot(&p, addr, b"").await;
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut c = sock.connect(addr).await.unwrap();
    // 12 requests of about 1 KiB each: more than the 8 KiB read-ahead.
    let pad = "p".repeat(900);
    let one = format!("GET / HTTP/1.1\r\nHost: t\r\nX-Pad: {pad}\r\n\r\n");
    let n = 12;
    with_bytes_at_accept(holder, &mut c, one.repeat(n).as_bytes(), false).await;
    let mut r = Reader::new();
    for i in 0..n {
        let resp = r.response(&mut c, false).await.expect("a response");
        assert_eq!((resp.status, resp.body.len()), (200, BODY), "response {i}");
    }
    drop(c);
    nothing_held_then_shutdown(p).await;
}

/// A keep-alive HTTP/1.1 upstream that answers each request after
/// `delay` with a field `x-pad` of `len` bytes and an empty body (a
/// response whole once its head is read).
async fn slow_upstream(delay: Duration, len: usize) -> SocketAddr {
    tcp_server(move |mut s| async move {
        let mut buf = [0u8; 4096];
        let mut got = Vec::new();
        let pad = "a".repeat(len);
        let answer =
            format!("HTTP/1.1 200 OK\r\nX-Pad: {pad}\r\nContent-Length: 0\r\n\r\n").into_bytes();
        loop {
            while let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                got.drain(..i + 4);
                tokio::time::sleep(delay).await;
                if s.write_all(&answer).await.is_err() {
                    return;
                }
            }
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
}

/// The first thing to wait is a write, with nothing else to wake the
/// connection: pipelined requests there at accept, more than the
/// read-ahead bound (the watch for the client leaving tops the buffer up
/// while each answer is awaited, then reads no more), answer heads larger
/// than the socket buffers and no body (no upstream left to wake the
/// connection), a client that reads nothing until the proxy's write
/// has blocked (the connection is then registered), and the send timeout
/// an hour away: only the socket becoming writable can wake it (the
/// write registered it), and every answer must come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_blocks_first_is_woken_when_the_client_reads() {
    const LEN: usize = 4096;
    let up = slow_upstream(Duration::from_millis(50), LEN).await;
    let extra = "    max_connections: 1\n    timeouts: { request_headers: 1h, send: 1h }\n    limits: { max_header_bytes: 1024, max_uri_bytes: 1024 }\n    socket: { send_buffer_bytes: 4096 }\n";
    let (p, addr) = proxy_on(&yaml(up, extra), Http1Server::Meshless).await;
    let holder = take_slot(&p, addr, b"").await;
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut c = sock.connect(addr).await.unwrap();
    let pad = "p".repeat(900);
    let one = format!("GET / HTTP/1.1\r\nHost: t\r\nX-Pad: {pad}\r\n\r\n");
    let n = 24;
    with_bytes_at_accept(holder, &mut c, one.repeat(n).as_bytes(), false).await;
    eventually("the blocked write registered the connection", || async {
        registered(&c) == Some(true)
    })
    .await;
    let mut r = Reader::new();
    for i in 0..n {
        let resp = r.response(&mut c, false).await.expect("a response");
        let pad = resp.header("x-pad").map_or(0, str::len);
        assert_eq!((resp.status, pad), (200, LEN), "response {i}");
    }
    drop(c);
    nothing_held_then_shutdown(p).await;
}

/// An upgrade there at accept is handed to hyper and tunnels: each echo
/// waits on the client's socket, so the tunnel must be woken by it; on
/// either HTTP/1 server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_there_at_accept_tunnels_both_ways() {
    let bs = backends(1).await;
    for engine in ENGINES {
        let (p, addr) = proxy_on(&yaml(bs[0].local_addr(), ONE_SLOT), engine).await;
        let mut c = queued(
            &p,
            addr,
            b"GET /upgrade HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
        )
        .await;
        let head = head_only(&mut c).await;
        assert!(head.starts_with("HTTP/1.1 101"), "{engine:?}: {head}");
        for i in 0..3 {
            let msg = format!("ping {i}");
            c.write_all(msg.as_bytes()).await.unwrap();
            let mut got = vec![0u8; msg.len()];
            tokio::time::timeout(DEADLINE, c.read_exact(&mut got))
                .await
                .expect("an echo within the deadline")
                .unwrap();
            assert_eq!(got, msg.as_bytes(), "{engine:?}");
        }
        drop(c);
        nothing_held_then_shutdown(p).await;
    }
}

/// HTTP/2 with prior knowledge, preface and request there at accept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_prior_knowledge_there_at_accept_is_served() {
    let bs = backends(1).await;
    let (p, addr) = proxy_on(&yaml(bs[0].local_addr(), ONE_SLOT), Http1Server::Meshless).await;
    let holder = take_slot(&p, addr, b"").await;
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (peer, local) = (tcp.peer_addr().unwrap(), tcp.local_addr().unwrap());
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    let answer = tokio::spawn(async move {
        let mut out = Vec::new();
        for i in 0..3 {
            let req = http::Request::get(format!("http://t/status/20{i}"))
                .body(Empty::<Bytes>::new())
                .unwrap();
            let resp = send.send_request(req).await.unwrap();
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            out.push((status, body));
        }
        out
    });
    // The preface (24 bytes), SETTINGS and the first request's HEADERS.
    eventually(
        "the preface and a request wait in the accept queue",
        || async { matches!(tcp_entry(peer, local), Some((0, rx)) if rx > 24 + 9 + 9) },
    )
    .await;
    drop(holder);
    let out = tokio::time::timeout(DEADLINE, answer)
        .await
        .expect("answers within the deadline")
        .unwrap();
    for (i, (status, body)) in out.into_iter().enumerate() {
        assert_eq!(status, 200 + i as u16);
        assert_eq!(body, format!("b0 {}\n", 200 + i));
    }
    conn.abort();
    let _ = conn.await;
    nothing_held_then_shutdown(p).await;
}

/// A trusted PROXY header and a request there at accept: the client the
/// header names reaches the upstream, and a second request on the
/// connection (registered to read the header) is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_header_and_request_there_at_accept_are_served() {
    let g = Gated::start("g").await;
    g.open();
    let extra = format!("{ONE_SLOT}    proxy_protocol: {{ trusted: [127.0.0.1/32] }}\n");
    let (p, addr) = proxy_on(&yaml(g.local_addr(), &extra), Http1Server::Meshless).await;
    let mut raw = meshless_proxy::proxy_protocol::encode(
        "198.51.100.7:5000".parse().unwrap(),
        "127.0.0.1:80".parse().unwrap(),
    );
    raw.extend_from_slice(b"GET /one HTTP/1.1\r\nHost: t\r\n\r\n");
    let mut c = queued(&p, addr, &raw).await;
    let mut r = Reader::new();
    assert_eq!(r.response(&mut c, false).await.unwrap().status, 200);
    c.write_all(b"GET /two HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(r.response(&mut c, false).await.unwrap().status, 200);
    let seen = g.seen();
    assert_eq!(seen.len(), 2);
    for s in &seen {
        let xff = s
            .headers
            .get("x-forwarded-for")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        assert!(xff.contains("198.51.100.7"), "{}: {xff}", s.path);
    }
    drop(c);
    nothing_held_then_shutdown(p).await;
    g.kill().await;
}

/// A denied peer (`action: reset`) whose request is there at accept is
/// reset and counted; nothing is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_peer_with_bytes_there_at_accept_is_reset() {
    let bs = backends(1).await;
    let extra = format!(
        "{ONE_SLOT}    deny:\n      - {{ name: reset, sources: [127.0.0.3/32], action: reset }}\n"
    );
    let (p, addr) = proxy_on(&yaml(bs[0].local_addr(), &extra), Http1Server::Meshless).await;
    let holder = take_slot(&p, addr, b"").await;
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.3:0".parse().unwrap()).unwrap();
    let mut c = sock.connect(addr).await.unwrap();
    with_bytes_at_accept(holder, &mut c, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n", false).await;
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(DEADLINE, c.read(&mut buf))
        .await
        .expect("an answer within the deadline");
    assert_eq!(
        read.map_err(|e| e.kind()),
        Err(std::io::ErrorKind::ConnectionReset)
    );
    assert_eq!(
        proxy_metric(
            &p,
            "meshless_proxy_denied_connections_total{listener=\"web\",rule=\"reset\",action=\"reset\"}"
        )
        .await,
        1.0
    );
    drop(c);
    nothing_held_then_shutdown(p).await;
}

/// A `protocol: tcp` listener relays bytes that were there at accept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_listener_relays_bytes_there_at_accept() {
    let bs = backends(1).await;
    let yaml = format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ndrain_timeout: 5s\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    protocol: tcp\n    tcp: {{ cluster: c }}\n    max_connections: 1\nclusters:\n  - name: c\n    endpoints:\n      - {{ address: \"{}\" }}\n",
        bs[0].local_addr()
    );
    let (p, addr) = proxy_on(&yaml, Http1Server::Meshless).await;
    let mut c = queued(
        &p,
        addr,
        b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    )
    .await;
    let resp = Reader::new().response(&mut c, false).await.unwrap();
    assert_eq!((resp.status, &resp.body[..]), (200, &b"b0\n"[..]));
    assert!(closed(&mut c).await);
    drop(c);
    metric_is(&p, CONNECTIONS, 0.0).await;
    p.shutdown().await;
}

/// A TLS listener whose ClientHello is there at accept: the handshake and
/// requests on it complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_client_hello_there_at_accept_is_answered() {
    let dir = tls::TempDir::new("lazy-tls");
    tls::write_cert(&dir.0, "a", &["a.test"]);
    let extra = format!(
        "{ONE_SLOT}    tls:\n      default_certificate: {{ certificate: \"{}\", key: \"{}\" }}\n      handshake_timeout: 1h\n",
        dir.path("a.pem").display(),
        dir.path("a.key").display()
    );
    let bs = backends(1).await;
    let (p, addr) = proxy_on(&yaml(bs[0].local_addr(), &extra), Http1Server::Meshless).await;
    let holder = take_slot(&p, addr, b"").await;
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (peer, local) = (tcp.peer_addr().unwrap(), tcp.local_addr().unwrap());
    let name = rustls::pki_types::ServerName::try_from("a.test".to_owned()).unwrap();
    let connect = tokio::spawn(
        tokio_rustls::TlsConnector::from(tls::client_config(&["http/1.1"], rustls::ALL_VERSIONS))
            .connect(name, tcp),
    );
    eventually("the ClientHello waits in the accept queue", || async {
        matches!(tcp_entry(peer, local), Some((0, rx)) if rx > 0)
    })
    .await;
    drop(holder);
    let stream = tokio::time::timeout(DEADLINE, connect)
        .await
        .expect("a handshake within the deadline")
        .unwrap()
        .unwrap();
    let mut sender = tls::Sender::new(stream).await.unwrap();
    for _ in 0..2 {
        let (status, backend) = sender.get("a.test", "/").await.unwrap();
        assert_eq!((status.as_u16(), backend.as_str()), (200, "b0"));
    }
    drop(sender);
    nothing_held_then_shutdown(p).await;
}

/// A shutdown while a connection whose request was there at accept waits
/// on its upstream: the drain ends at its deadline, the client sees the
/// connection closed, and the shutdown completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_closes_a_connection_waiting_on_its_upstream() {
    for engine in ENGINES {
        let g = Gated::start("g").await;
        let yaml = yaml(g.local_addr(), ONE_SLOT).replace("drain_timeout: 5s", "drain_timeout: 1s");
        let (p, addr) = proxy_on(&yaml, engine).await;
        let mut c = queued(&p, addr, b"GET /hang HTTP/1.1\r\nHost: t\r\n\r\n").await;
        eventually("the request held upstream", || async { g.held() == 1 }).await;
        tokio::time::timeout(DEADLINE, p.shutdown())
            .await
            .expect("the shutdown ends");
        assert!(
            closed(&mut c).await,
            "{engine:?}: closed at the drain's end"
        );
        g.kill().await;
    }
}

/// A client that resets its connection before the proxy accepts it (part
/// of a head, or a whole request, waiting): the direct read or write
/// fails, and nothing is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_reset_before_accept_holds_nothing() {
    let bs = backends(1).await;
    for engine in ENGINES {
        let (p, addr) = proxy_on(&yaml(bs[0].local_addr(), ONE_SLOT), engine).await;
        for raw in [
            &b"GET / HTTP/1.1\r\nHost: t\r\n"[..],
            b"GET / HTTP/1.1\r\nHost: t\r\n\r\n",
        ] {
            let holder = take_slot(&p, addr, b"").await;
            let mut c = TcpStream::connect(addr).await.unwrap();
            c.write_all(raw).await.unwrap();
            queued_in_kernel(&c, raw.len() as u64).await;
            let (peer, local) = (c.peer_addr().unwrap(), c.local_addr().unwrap());
            socket2::SockRef::from(&c)
                .set_linger(Some(Duration::ZERO))
                .unwrap();
            drop(c);
            // Reset, it leaves the established table (still queued).
            eventually("the reset reached the queued socket", || async {
                tcp_entry(peer, local).is_none()
            })
            .await;
            drop(holder);
            eventually("the reset connection accepted", || async {
                accept_queue(addr) == 0
            })
            .await;
            metric_is(&p, CONNECTIONS, 0.0).await;
            metric_is(&p, BUFFERS, 0.0).await;
            nothing_in_flight(&p).await;
        }
        // The listener serves on.
        assert_eq!(get(&client(), addr, "/", &[]).await.0, http::StatusCode::OK);
        nothing_held_then_shutdown(p).await;
    }
}

/// A listener a reload binds accepts and serves, a connection whose
/// request was there at accept included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_bound_by_a_reload_serves() {
    let bs = backends(1).await;
    let base = yaml(bs[0].local_addr(), "");
    let (p, _) = proxy_on(&base, Http1Server::Meshless).await;
    let web2 = "  - name: web2\n    address: \"127.0.0.1:0\"\n    max_connections: 1\n    timeouts: { request_headers: 1h }\n    routes:\n      - cluster: c\nclusters:\n";
    let reloaded = base.replacen("clusters:\n", web2, 1);
    p.reload(on_test_http1(
        ProxyConfig::parse(&reloaded, "lazy.yaml").unwrap(),
    ))
    .await
    .unwrap();
    let addr = p.listener_addr("web2").await.expect("web2 bound");
    let series = "meshless_proxy_downstream_connections{listener=\"web2\"}";
    let holder = TcpStream::connect(addr).await.unwrap();
    metric_is(&p, series, 1.0).await;
    let mut c = TcpStream::connect(addr).await.unwrap();
    with_bytes_at_accept(holder, &mut c, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n", false).await;
    let mut r = Reader::new();
    assert_eq!(r.response(&mut c, false).await.unwrap().status, 200);
    c.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(r.response(&mut c, false).await.unwrap().status, 200);
    drop(c);
    metric_is(&p, series, 0.0).await;
    metric_is(
        &p,
        "meshless_proxy_http1_buffers_lent{listener=\"web2\"}",
        0.0,
    )
    .await;
    p.shutdown().await;
}

/// A binary upgrade: connections waiting in the accept queue of the
/// handed-over socket (the old process's only slot is held) are accepted
/// by the new process, their requests there at accept; the old process's
/// connection waiting on its upstream still gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_over_listener_accepts_what_waits_in_its_queue() {
    use meshless_proxy::handoff;
    let dir = tls::TempDir::new("lazy-upgrade");
    let g = Gated::start("g").await;
    let socket = dir.path("upgrade.sock");
    let old_yaml =
        yaml(g.local_addr(), ONE_SLOT).replace("drain_timeout: 5s", "drain_timeout: 30s");
    let cfg = |y: &str| on_test_http1(ProxyConfig::parse(y, "lazy.yaml").unwrap());
    let old = Proxy::start(cfg(&old_yaml)).await.unwrap();
    let addr = old.listener_addr("web").await.unwrap();
    // The old process's only connection: its request waits on the upstream.
    let mut held = TcpStream::connect(addr).await.unwrap();
    held.write_all(b"GET /old HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    eventually("the old process's request held", || async { g.held() == 1 }).await;
    // Two connections with their requests wait in the accept queue.
    let mut waiting = Vec::new();
    for i in 0..2 {
        let mut c = TcpStream::connect(addr).await.unwrap();
        let raw = format!("GET /new{i} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
        c.write_all(raw.as_bytes()).await.unwrap();
        queued_in_kernel(&c, raw.len() as u64).await;
        waiting.push(c);
    }
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let old_side = tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            if old.hand_over(stream.into_std().unwrap()).await.unwrap() {
                old.shutdown_handed_over().await;
                return;
            }
        }
    });
    let from = socket.clone();
    let (mut inherited, stream) = tokio::task::spawn_blocking(move || handoff::receive(&from))
        .await
        .unwrap()
        .unwrap();
    let new_yaml = yaml(g.local_addr(), "").replace("drain_timeout: 5s", "drain_timeout: 30s");
    let new = Proxy::start_with(cfg(&new_yaml), &mut inherited)
        .await
        .unwrap();
    assert_eq!(inherited.left(), 0);
    tokio::task::spawn_blocking(move || handoff::ready(stream))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(new.listener_addr("web").await, Some(addr));
    g.open();
    for (i, c) in waiting.iter_mut().enumerate() {
        let resp = Reader::new().response(c, false).await.expect("an answer");
        assert_eq!(resp.status, 200, "queued connection {i}");
    }
    let resp = Reader::new().response(&mut held, false).await.unwrap();
    assert_eq!(resp.status, 200, "the old process's request");
    drop(held);
    tokio::time::timeout(DEADLINE, old_side)
        .await
        .expect("the old process drains")
        .unwrap();
    // The new process serves new connections, and holds nothing after.
    assert_eq!(get(&client(), addr, "/", &[]).await.0, http::StatusCode::OK);
    drop(waiting);
    nothing_held_then_shutdown(new).await;
    g.kill().await;
}

/// EMFILE on accept: a connection that arrives while the descriptor table
/// is full waits in the queue, and is served once descriptors are free.
/// Run in a process of its own ([`emfile_child`]): filling the table would
/// break the other tests running beside it. Its table is cut to 1,024
/// descriptors first (`ulimit -n`), so filling it is quick wherever the
/// limit is large.
#[test]
fn a_full_descriptor_table_delays_accept_and_loses_nothing() {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg("ulimit -n 1024 && exec \"$0\" \"$@\"")
        .arg(exe)
        .args(["--exact", "emfile_child", "--ignored", "--nocapture"])
        .env("LAZY_REGISTRATION_EMFILE_CHILD", "1")
        .output()
        .unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "the child ran nothing: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by a_full_descriptor_table_delays_accept_and_loses_nothing in a process of its own"]
async fn emfile_child() {
    if std::env::var_os("LAZY_REGISTRATION_EMFILE_CHILD").is_none() {
        return;
    }
    let bs = backends(1).await;
    let (p, addr) = proxy_on(&yaml(bs[0].local_addr(), ""), Http1Server::Meshless).await;
    // The client's descriptor first: connecting needs none.
    let client = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    let mut proc_tcp = std::fs::File::open("/proc/net/tcp").unwrap();
    let mut hog = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => hog.push(f),
            Err(e) if e.raw_os_error() == Some(24) => break,
            Err(e) => panic!("{e}"),
        }
    }
    client.connect(&addr.into()).unwrap();
    let mut client: std::net::TcpStream = client.into();
    use std::io::{Read, Seek, Write};
    client
        .write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .unwrap();
    // Time for the accept loop to fail (and back off) a few times.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Still in the accept queue (read through a descriptor opened before
    // the table filled): there was none to accept it into.
    proc_tcp.rewind().unwrap();
    let mut table = String::new();
    proc_tcp.read_to_string(&mut table).unwrap();
    drop(hog);
    let (l, r) = (proc_addr(addr), proc_addr(client.local_addr().unwrap()));
    let entry = table
        .lines()
        .find(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            f.len() > 9 && f[1] == l && f[2] == r
        })
        .expect("the connection in the table");
    assert_eq!(
        entry.split_whitespace().nth(9),
        Some("0"),
        "accepted while no descriptor was free: {entry}"
    );
    let answer = tokio::task::spawn_blocking(move || {
        client.set_read_timeout(Some(DEADLINE)).unwrap();
        let mut all = Vec::new();
        client.read_to_end(&mut all).map(|_| all)
    })
    .await
    .unwrap()
    .expect("an answer once descriptors are free");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    nothing_held_then_shutdown(p).await;
}
