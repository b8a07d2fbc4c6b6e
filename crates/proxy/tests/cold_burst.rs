//! A burst of held requests released to a fresh instance whose listen
//! backlog is small (8 here, as a single-threaded server's often is;
//! Python's default is 5): none may be lost.
//!
//! The instance (a Python `HTTPServer`, one connection at a time) binds
//! once the test opens the first gate and accepts once it opens the
//! second. In between, it listens without accepting: its accept queue
//! holds at most `BACKLOG + 1` connections and the kernel drops every
//! further SYN (the client's connect then times out), exactly what a
//! burst does to a fresh instance that is slow to accept.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use common::*;
use http::StatusCode;
use meshless_control::config::ControlConfig;
use meshless_control::plane::ControlPlane;

const BURST: usize = 300;
const BACKLOG: usize = 8;

/// The instance: binds with a listen backlog of `BACKLOG` once `bind`
/// exists, accepts once `serve` exists, answers `ok` (HTTP/1.0: one
/// request per connection).
fn instance(bind: &Path, serve: &Path) -> String {
    let script = format!(
        "import os, time, http.server as h\n\
         class H(h.BaseHTTPRequestHandler):\n    \
           def do_GET(self):\n        \
             self.send_response(200)\n        \
             self.send_header('content-length', '3')\n        \
             self.end_headers()\n        \
             self.wfile.write(b'ok\\n')\n    \
           def do_POST(self):\n        \
             n = int(self.headers.get('content-length', '0'))\n        \
             out = (self.headers.get('x-mark', 'none') + ':').encode() + self.rfile.read(n) + b'\\n'\n        \
             self.send_response(200)\n        \
             self.send_header('content-length', str(len(out)))\n        \
             self.end_headers()\n        \
             self.wfile.write(out)\n    \
           def log_message(self, *a):\n        \
             pass\n\
         class S(h.HTTPServer):\n    \
           request_queue_size = {BACKLOG}\n\
         while not os.path.exists('{bind}'): time.sleep(0.01)\n\
         s = S(('127.0.0.1', int(os.environ['PORT'])), H)\n\
         while not os.path.exists('{serve}'): time.sleep(0.01)\n\
         s.serve_forever()\n",
        bind = bind.display(),
        serve = serve.display(),
    );
    format!("[python3, -c, {script:?}]")
}

fn plane(command: &str) -> ControlConfig {
    let yaml = format!(
        "api_address: \"127.0.0.1:0\"\ngrpc_address: \"127.0.0.1:0\"\nservices:\n  - namespace: demo\n    name: lazy\n    autoscaling:\n      min_instances: 0\n      max_instances: 1\n      target_concurrency: 1000\n      tick: 100ms\n      scaler:\n        process:\n          command: {command}\n          start_timeout: 60s\n          stop_grace: 2s\n"
    );
    ControlConfig::parse(&yaml, "control.yaml").expect("valid control config")
}

fn proxy_yaml(grpc: SocketAddr, activation: &str, timeouts: &str) -> String {
    format!(
        "admin: {{ address: \"127.0.0.1:0\" }}\ncontrol: {{ address: \"{grpc}\" }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: lazy }}]\nclusters:\n  - name: lazy\n    service: demo/lazy\n    activation: {{ queue_timeout: 60s, {activation} }}\n    timeouts: {{ request: 60s, {timeouts} }}\n    circuit_breakers: {{ max_requests: 10000, max_pending: 10000, max_connections: 10000 }}\n"
    )
}

/// The cluster's entry in the proxy's `/clusters`.
async fn cluster(p: &meshless_proxy::Proxy) -> serde_json::Value {
    let (_, body) = admin(p, "/clusters").await;
    let all: serde_json::Value = serde_json::from_str(&body).expect("json");
    all.as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "lazy").cloned())
        .unwrap_or_default()
}

fn count(c: &serde_json::Value, field: &str) -> u64 {
    c[field].as_u64().unwrap_or(0)
}

struct Gates {
    _dir: tempfile::TempDir,
    bind: PathBuf,
    serve: PathBuf,
}

fn gates() -> Gates {
    let dir = tempfile::Builder::new()
        .prefix("meshless-cold-burst-")
        .tempdir()
        .expect("dir");
    Gates {
        bind: dir.path().join("bind"),
        serve: dir.path().join("serve"),
        _dir: dir,
    }
}

/// Sends `BURST` requests; returns their tasks once all are held.
async fn held_burst(
    p: &meshless_proxy::Proxy,
    addr: SocketAddr,
) -> Vec<tokio::task::JoinHandle<(StatusCode, String)>> {
    let tasks = (0..BURST)
        .map(|_| {
            tokio::spawn(async move {
                let (status, _, body) = get(&client(), addr, "/", &[]).await;
                (status, body)
            })
        })
        .collect();
    eventually("the whole burst held", || async {
        count(&cluster(p).await, "queued_requests") == BURST as u64
    })
    .await;
    tasks
}

/// Waits until at least `n` released requests connected again.
async fn reconnected(p: &meshless_proxy::Proxy, n: usize) {
    let series = "meshless_proxy_activations_total{result=\"reconnected\"}";
    eventually("connects dropped and tried again", || async {
        proxy_metric(p, series).await >= n as f64
    })
    .await;
}

async fn all_ok(tasks: Vec<tokio::task::JoinHandle<(StatusCode, String)>>) {
    let mut failed = Vec::new();
    for t in tasks {
        let (status, body) = t.await.expect("task");
        if status != StatusCode::OK || body != "ok\n" {
            failed.push((status, body));
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {BURST} failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
}

async fn start(
    activation: &str,
    timeouts: &str,
    g: &Gates,
) -> (ControlPlane, meshless_proxy::Proxy, SocketAddr) {
    let plane = ControlPlane::start(plane(&instance(&g.bind, &g.serve)))
        .await
        .expect("plane");
    let (api, grpc) = (plane.api_addr(), plane.grpc_addr());
    let (p, addr) = proxy(&proxy_yaml(grpc, activation, timeouts)).await;
    subscribed(api, 1).await;
    (plane, p, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_requests_are_released_a_few_at_a_time_and_none_overflows_the_backlog() {
    const RELEASE: usize = 4;
    // At most RELEASE of our connections and the two probes (the
    // scaler's, the proxy's) wait in an accept queue of BACKLOG + 1.
    const { assert!(RELEASE + 2 <= BACKLOG) };
    let g = gates();
    let (plane, p, addr) = start(
        &format!("release_concurrency: {RELEASE}"),
        "connect: 100ms",
        &g,
    )
    .await;
    let tasks = held_burst(&p, addr).await;
    std::fs::write(&g.bind, b"go").expect("bind gate");
    // The instance listens but does not accept: exactly RELEASE requests
    // are sent to it, the rest stay held.
    eventually("RELEASE requests sent, the rest held", || async {
        let c = cluster(&p).await;
        count(&c, "pending_requests") == RELEASE as u64
            && count(&c, "queued_requests") == (BURST - RELEASE) as u64
    })
    .await;
    let c = cluster(&p).await;
    assert_eq!(count(&c, "upstream_connections"), RELEASE as u64, "{c}");
    std::fs::write(&g.serve, b"go").expect("serve gate");
    all_ok(tasks).await;
    // Requests re-held only for their turn did not ask for an instance
    // again: at most one Activate per request (fewer: a burst held while
    // the stream is busy leaves in one message per service).
    let asked = metric(
        &get(&client(), plane.api_addr(), "/metrics", &[]).await.2,
        "meshless_control_activation_requests_total",
    )
    .unwrap_or(0.0);
    assert!((1.0..=BURST as f64).contains(&asked), "{asked}");
    // No SYN was dropped, so no connect failed.
    assert_eq!(
        proxy_metric(
            &p,
            "meshless_proxy_activations_total{result=\"reconnected\"}"
        )
        .await,
        0.0
    );
    assert_eq!(count(&cluster(&p).await, "queued_requests"), 0);
    p.shutdown().await;
    plane.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_pacing_connects_dropped_by_a_full_backlog_are_tried_again() {
    let g = gates();
    // No release limit, one retry at most by the retry policy: only the
    // reconnects of released requests can save the burst.
    let (plane, p, addr) = start("release_concurrency: 0", "connect: 100ms", &g).await;
    let tasks = held_burst(&p, addr).await;
    std::fs::write(&g.bind, b"go").expect("bind gate");
    // Every request is released at once; all but BACKLOG + 1 connects
    // find the accept queue full and time out.
    reconnected(&p, BURST).await;
    std::fs::write(&g.serve, b"go").expect("serve gate");
    all_ok(tasks).await;
    p.shutdown().await;
    plane.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_that_connects_again_keeps_its_headers_and_body() {
    let g = gates();
    // A POST is tried once (no retry may repeat it): its first attempt
    // is its last, and a reconnect must still send its headers and body.
    let (plane, p, addr) = start("release_concurrency: 0", "connect: 100ms", &g).await;
    let tasks: Vec<_> = (0..BURST)
        .map(|i| {
            tokio::spawn(async move {
                let body = format!("body-{i}");
                let req = http::Request::post(format!("http://{addr}/"))
                    .header("x-mark", "kept")
                    .body(http_body_util::Full::new(bytes::Bytes::from(body.clone())))
                    .expect("request");
                let resp = client().request(req).await.expect("response");
                let status = resp.status();
                let got = http_body_util::BodyExt::collect(resp.into_body())
                    .await
                    .expect("body")
                    .to_bytes();
                (status, String::from_utf8_lossy(&got).into_owned(), body)
            })
        })
        .collect();
    eventually("the whole burst held", || async {
        count(&cluster(&p).await, "queued_requests") == BURST as u64
    })
    .await;
    std::fs::write(&g.bind, b"go").expect("bind gate");
    reconnected(&p, 1).await;
    std::fs::write(&g.serve, b"go").expect("serve gate");
    for t in tasks {
        let (status, got, sent) = t.await.expect("task");
        assert_eq!(status, StatusCode::OK, "{got}");
        assert_eq!(got, format!("kept:{sent}\n"));
    }
    p.shutdown().await;
    plane.shutdown().await;
}

/// An instance whose answers are long-lived: headers at once, the body
/// only once `end` exists (a stream, a long poll). Binds once `bind`
/// exists; one thread per connection.
fn streaming_instance(bind: &Path, end: &Path) -> String {
    let script = format!(
        "import os, time, http.server as h\n\
         class H(h.BaseHTTPRequestHandler):\n    \
           protocol_version = 'HTTP/1.1'\n    \
           def do_GET(self):\n        \
             self.send_response(200)\n        \
             self.send_header('transfer-encoding', 'chunked')\n        \
             self.end_headers()\n        \
             self.wfile.flush()\n        \
             while not os.path.exists('{end}'): time.sleep(0.01)\n        \
             self.wfile.write(b'3\\r\\nok\\n\\r\\n0\\r\\n\\r\\n')\n    \
           def log_message(self, *a):\n        \
             pass\n\
         while not os.path.exists('{bind}'): time.sleep(0.01)\n\
         h.ThreadingHTTPServer(('127.0.0.1', int(os.environ['PORT'])), H).serve_forever()\n",
        bind = bind.display(),
        end = end.display(),
    );
    format!("[python3, -c, {script:?}]")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_lived_answers_do_not_keep_the_rest_of_the_burst_waiting() {
    const STREAMS: usize = 40;
    const RELEASE: usize = 4;
    let g = gates();
    let plane = ControlPlane::start(plane(&streaming_instance(&g.bind, &g.serve)))
        .await
        .expect("plane");
    let (api, grpc) = (plane.api_addr(), plane.grpc_addr());
    let activation = format!("release_concurrency: {RELEASE}");
    let (p, addr) = proxy(&proxy_yaml(grpc, &activation, "connect: 1s")).await;
    subscribed(api, 1).await;
    let headers = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (0..STREAMS)
        .map(|_| {
            let headers = std::sync::Arc::clone(&headers);
            tokio::spawn(async move {
                let req = http::Request::get(format!("http://{addr}/"))
                    .body(http_body_util::Full::new(bytes::Bytes::new()))
                    .expect("request");
                let resp = client().request(req).await.expect("response head");
                headers.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let status = resp.status();
                let body = http_body_util::BodyExt::collect(resp.into_body())
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                (status, body)
            })
        })
        .collect();
    eventually("the whole burst held", || async {
        count(&cluster(&p).await, "queued_requests") == STREAMS as u64
    })
    .await;
    std::fs::write(&g.bind, b"go").expect("bind gate");
    // Every stream gets its headers while the first ones are still open:
    // a place in the release is given back at the headers, not at the end.
    eventually("every stream answered", || async {
        headers.load(std::sync::atomic::Ordering::SeqCst) == STREAMS
    })
    .await;
    std::fs::write(&g.serve, b"go").expect("end gate");
    for t in tasks {
        let (status, body) = t.await.expect("task");
        assert_eq!((status, &body[..]), (StatusCode::OK, &b"ok\n"[..]));
    }
    p.shutdown().await;
    plane.shutdown().await;
}

/// An instance that counts its requests waiting for their answer (one
/// per connection: HTTP/1.0), in the file `state` of `dir` as `in_flight
/// max answered`. The first instance started binds once `bind` exists,
/// blocks every request until `serve` exists, answers at most `half`
/// before `rest` exists, and exits at once when `die` exists. Every later
/// instance (`second`: `serve` answering `ok2`, or `exit` failing at
/// once) is told apart by the file `started`. A request leaves the count
/// before its headers are sent: the proxy gives its ticket back at the
/// headers, so the count is what the tickets bound.
fn counting_instance(dir: &Path, half: usize, second: &str) -> String {
    let script = format!(
        "import os, time, threading, http.server as h\n\
         D = '{dir}'\n\
         def gate(n):\n    \
           while not os.path.exists(D + '/' + n): time.sleep(0.005)\n\
         first = not os.path.exists(D + '/started')\n\
         open(D + '/started', 'a').close()\n\
         if not first and '{second}' == 'exit': os._exit(3)\n\
         lock = threading.Lock()\n\
         st = [0, 0, 0]\n\
         def save():\n    \
           open(D + '/state.tmp', 'w').write('%d %d %d' % tuple(st))\n    \
           os.replace(D + '/state.tmp', D + '/state')\n\
         class H(h.BaseHTTPRequestHandler):\n    \
           def do_GET(self):\n        \
             with lock:\n            \
               st[0] += 1; st[1] = max(st[1], st[0]); save()\n        \
             if first:\n            \
               gate('serve')\n            \
               with lock: n = st[2]\n            \
               if n >= {half}: gate('rest')\n        \
             with lock:\n            \
               st[0] -= 1; st[2] += 1; save()\n        \
             body = b'ok\\n' if first else b'ok2\\n'\n        \
             self.send_response(200)\n        \
             self.send_header('content-length', str(len(body)))\n        \
             self.end_headers()\n        \
             self.wfile.write(body)\n    \
           def log_message(self, *a):\n        \
             pass\n\
         def watch():\n    \
           gate('die'); os._exit(0)\n\
         if first:\n    \
           threading.Thread(target=watch, daemon=True).start()\n    \
           gate('bind')\n\
         h.ThreadingHTTPServer(('127.0.0.1', int(os.environ['PORT'])), H).serve_forever()\n",
        dir = dir.display(),
    );
    format!("[python3, -c, {script:?}]")
}

/// `(in_flight, max, answered)` of the instances started from `dir`.
fn instance_state(dir: &Path) -> (usize, usize, usize) {
    let text = std::fs::read_to_string(dir.join("state")).unwrap_or_default();
    let v: Vec<usize> = text
        .split_whitespace()
        .filter_map(|n| n.parse().ok())
        .collect();
    match v[..] {
        [a, b, c] => (a, b, c),
        _ => (0, 0, 0),
    }
}

/// Sends `n` GETs; each task gives back its status and body.
fn send(n: usize, addr: SocketAddr) -> Vec<tokio::task::JoinHandle<(StatusCode, String)>> {
    (0..n)
        .map(|_| {
            tokio::spawn(async move {
                let (status, _, body) = get(&client(), addr, "/", &[]).await;
                (status, body)
            })
        })
        .collect()
}

async fn gauges_back_to_zero(p: &meshless_proxy::Proxy) {
    eventually("every gauge back to 0", || async {
        let c = cluster(p).await;
        [
            "queued_requests",
            "releasing_requests",
            "pending_requests",
            "active_requests",
            "active_retries",
        ]
        .iter()
        .all(|f| count(&c, f) == 0)
    })
    .await;
}

/// The proxy and instance state of a release: `queued` held, `in_flight`
/// at the instance.
async fn settled(p: &meshless_proxy::Proxy, dir: &Path, queued: usize, in_flight: usize) {
    eventually("the release settled", || async {
        let c = cluster(p).await;
        count(&c, "queued_requests") == queued as u64 && instance_state(dir).0 >= in_flight
    })
    .await;
}

/// A control plane whose instance is [`counting_instance`]`(dir, half,
/// second)` and a proxy following it that releases `release` held
/// requests at a time, once the proxy is subscribed.
struct Paced {
    g: Gates,
    dir: PathBuf,
    plane: ControlPlane,
    api: SocketAddr,
    p: meshless_proxy::Proxy,
    addr: SocketAddr,
}

async fn paced(half: usize, second: &str, release: usize) -> Paced {
    let g = gates();
    let dir = g.bind.parent().expect("dir").to_path_buf();
    let plane = ControlPlane::start(plane(&counting_instance(&dir, half, second)))
        .await
        .expect("plane");
    let (api, grpc) = (plane.api_addr(), plane.grpc_addr());
    let activation = format!("release_concurrency: {release}");
    let (p, addr) = proxy(&proxy_yaml(grpc, &activation, "connect: 1s")).await;
    subscribed(api, 1).await;
    Paced {
        g,
        dir,
        plane,
        api,
        p,
        addr,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_requests_during_a_release_take_a_ticket_and_never_pass_the_limit() {
    const RELEASE: usize = 4;
    const NEW: usize = 60;
    const HALF: usize = BURST / 2;
    let Paced {
        g,
        dir,
        plane,
        api: _,
        p,
        addr,
    } = paced(HALF, "serve", RELEASE).await;
    let mut tasks = held_burst(&p, addr).await;
    std::fs::write(&g.bind, b"go").expect("bind gate");
    settled(&p, &dir, BURST - RELEASE, RELEASE).await;
    // New requests while the room is full wait behind the burst.
    tasks.extend(send(NEW, addr));
    settled(&p, &dir, BURST + NEW - RELEASE, RELEASE).await;
    // New requests while tickets come and go: each takes one (or waits).
    std::fs::write(&g.serve, b"go").expect("serve gate");
    tasks.extend(send(NEW, addr));
    let total = BURST + 2 * NEW;
    eventually(
        "every request held, at the instance or answered",
        || async {
            let (in_flight, _, answered) = instance_state(&dir);
            let queued = count(&cluster(&p).await, "queued_requests") as usize;
            answered >= HALF && queued + in_flight + answered == total
        },
    )
    .await;
    std::fs::write(dir.join("rest"), b"go").expect("rest gate");
    for t in tasks {
        let (status, body) = t.await.expect("task");
        assert_eq!((status, &body[..]), (StatusCode::OK, "ok\n"));
    }
    let (_, max, answered) = instance_state(&dir);
    assert_eq!(answered, total);
    assert!(max <= RELEASE, "{max} requests at once at the instance");
    gauges_back_to_zero(&p).await;
    p.shutdown().await;
    plane.shutdown().await;
}

/// Held requests released at a time in [`instance_leaves_mid_release`].
const LEAVE_RELEASE: usize = 4;

/// How many requests may fail when the instance leaves: the
/// [`LEAVE_RELEASE`] at the instance, and as many released in the moment
/// it exits. Linux releases an exiting process's files in reverse order
/// (the last opened first), so its connections close before its listening
/// socket: the proxy sees them fail, releases the next requests, and
/// those connect into the listener's accept queue just before it closes
/// and resets them (seen in CI). They too were at the instance that left.
const LEAVE_MAY_FAIL: usize = 2 * LEAVE_RELEASE;

/// A burst being released (`RELEASE` at the instance, the rest held, and
/// new requests paced behind it) whose instance exits; the next instance
/// is `second` ([`counting_instance`]). Returns every answer, each
/// within a generous deadline (none may hang), once every gauge is 0.
async fn instance_leaves_mid_release(second: &str) -> Vec<(StatusCode, String)> {
    const RELEASE: usize = LEAVE_RELEASE;
    const NEW: usize = 40;
    let Paced {
        g,
        dir,
        plane,
        api,
        p,
        addr,
    } = paced(BURST, second, RELEASE).await;
    let mut tasks = held_burst(&p, addr).await;
    std::fs::write(&g.bind, b"go").expect("bind gate");
    settled(&p, &dir, BURST - RELEASE, RELEASE).await;
    // Paced: they find an instance, and no room.
    tasks.extend(send(NEW, addr));
    settled(&p, &dir, BURST + NEW - RELEASE, RELEASE).await;
    assert_eq!(
        proxy_metric(&p, "meshless_proxy_activations_total{result=\"sent\"}").await,
        RELEASE as f64,
        "only the burst's first requests were released"
    );
    // (activation requests, instances seen ready) at the control plane.
    let plane_counts = || async {
        let page = get(&client(), api, "/metrics", &[]).await.2;
        (
            metric(&page, "meshless_control_activation_requests_total").unwrap_or(0.0),
            metric_sum(&page, "meshless_control_instances_ready_total"),
        )
    };
    let before = plane_counts().await;
    std::fs::write(dir.join("die"), b"go").expect("die gate");
    // Either the held requests ask for an instance (the burst's own asked
    // once, when it was held), or the process scaler replaces the one that
    // exited before they see it gone: which comes first is a race.
    eventually("a new instance asked for or started", || async {
        let now = plane_counts().await;
        now.0 > before.0 || now.1 > before.1
    })
    .await;
    let mut answers = Vec::new();
    for t in tasks {
        let got = tokio::time::timeout(std::time::Duration::from_secs(60), t).await;
        answers.push(got.expect("a held request hangs").expect("task"));
    }
    gauges_back_to_zero(&p).await;
    p.shutdown().await;
    plane.shutdown().await;
    answers
}

/// How many of `answers` are `(status, body)`; panics on any answer that
/// is neither that nor what the requests at the instance that left may
/// get (an upstream fault: 502, or 503 when no endpoint was left to
/// retry on).
fn tally(answers: &[(StatusCode, String)], status: StatusCode, body: &str) -> usize {
    let mut n = 0;
    for (s, b) in answers {
        if (*s, b.as_str()) == (status, body) || (*s == status && b.contains(body)) {
            n += 1;
        } else {
            assert!(
                matches!(s.as_u16(), 502 | 503),
                "unexpected answer {s} {b:?}"
            );
        }
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paced_burst_whose_instance_leaves_gets_a_new_one() {
    let answers = instance_leaves_mid_release("serve").await;
    // Every request still held (the burst's and the paced ones) is
    // answered by the next instance; only those at the instance that
    // left may fail.
    let ok = tally(&answers, StatusCode::OK, "ok2\n");
    assert!(
        ok >= answers.len() - LEAVE_MAY_FAIL,
        "{ok} of {} answered",
        answers.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paced_burst_whose_instance_leaves_is_refused_when_the_next_cannot_start() {
    let answers = instance_leaves_mid_release("exit").await;
    let refused = tally(
        &answers,
        StatusCode::SERVICE_UNAVAILABLE,
        "instance failed to start",
    );
    assert!(
        refused >= answers.len() - LEAVE_MAY_FAIL,
        "{refused} of {} refused",
        answers.len()
    );
}

/// A burst no larger than the room is released whole: none is held any
/// more, but its requests still await their headers. New requests then
/// still take a ticket (or wait for one): they never pass the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_requests_wait_while_the_released_burst_awaits_its_headers() {
    const RELEASE: usize = 4;
    const NEW: usize = 20;
    let Paced {
        g,
        dir,
        plane,
        api: _,
        p,
        addr,
    } = paced(BURST, "serve", RELEASE).await;
    let mut tasks = send(RELEASE, addr);
    eventually("the burst held", || async {
        count(&cluster(&p).await, "queued_requests") == RELEASE as u64
    })
    .await;
    std::fs::write(&g.bind, b"go").expect("bind gate");
    settled(&p, &dir, 0, RELEASE).await;
    tasks.extend(send(NEW, addr));
    eventually("the new requests held or at the instance", || async {
        let queued = count(&cluster(&p).await, "queued_requests") as usize;
        queued + instance_state(&dir).0 == RELEASE + NEW
    })
    .await;
    let (in_flight, _, _) = instance_state(&dir);
    assert_eq!(in_flight, RELEASE, "only the burst at the instance");
    std::fs::write(&g.serve, b"go").expect("serve gate");
    for t in tasks {
        let (status, body) = t.await.expect("task");
        assert_eq!((status, &body[..]), (StatusCode::OK, "ok\n"));
    }
    let (_, max, answered) = instance_state(&dir);
    assert_eq!(answered, RELEASE + NEW);
    assert!(max <= RELEASE, "{max} requests at once at the instance");
    gauges_back_to_zero(&p).await;
    p.shutdown().await;
    plane.shutdown().await;
}
