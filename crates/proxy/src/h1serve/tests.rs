//! The exchange's state machine on an in-memory connection whose writes
//! are throttled (a slow client), for orderings a real socket cannot be
//! made to produce on demand.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Waker;

use http_body::Body;
use tokio::io::ReadBuf;

use super::*;

/// Reads come from `input` (then `Pending`); writes take at most
/// `write_max` bytes and every other call is `Pending`: backpressure.
#[derive(Default)]
struct Slow {
    input: Vec<u8>,
    read_total: usize,
    written: Vec<u8>,
    write_max: usize,
    turn: bool,
}

impl AsyncRead for Slow {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let n = buf.remaining().min(self.input.len());
        if n == 0 {
            return Poll::Pending;
        }
        buf.put_slice(&self.input[..n]);
        self.input.drain(..n);
        self.read_total += n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Slow {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.turn = !self.turn;
        if self.turn {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let n = buf.len().min(self.write_max);
        self.written.extend_from_slice(&buf[..n]);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl WaitRead for Slow {
    fn poll_read_ready(&self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// A connection on `io`; the sender keeps its listener "serving".
fn conn<I>(io: I) -> (Conn<I>, watch::Sender<Drain>) {
    let (tx, rx) = watch::channel(Drain::Serving);
    let c = Conn {
        io,
        buf: None,
        gauge: Gauge::default(),
        draining: rx,
        drain: Drain::Serving,
        close_after: false,
        eof: false,
        linger: false,
        head_timer: None,
        first_exchange: true,
    };
    (c, tx)
}

fn framing(length: u64, expect_continue: bool) -> meshless_h1::Framing {
    meshless_h1::Framing {
        body: meshless_h1::Body::Length(length),
        keep_alive: true,
        expect_continue,
        upgrade: false,
        informational: false,
        keep_length: meshless_h1::framing::KeepLength::First,
    }
}

/// A request handler's future, boxed.
type Handling = Pin<Box<dyn Future<Output = Handled> + Send>>;

/// An exchange of a `POST` whose handler is `fut`.
fn exchange(c: &Conn<Slow>, feeder: Feeder, fut: Handling) -> Pin<Box<Serving<Handling>>> {
    exchange_sending(c, Some(feeder), fut, std::time::Duration::from_secs(60))
}

/// An exchange of a `POST` whose handler is `fut`, its writes bounded by
/// `send_for` (`timeouts.send`).
fn exchange_sending<I>(
    c: &Conn<I>,
    feeder: Option<Feeder>,
    fut: Handling,
    send_for: std::time::Duration,
) -> Pin<Box<Serving<Handling>>> {
    let answering = Answering {
        method: http::Method::POST,
        version: http::Version::HTTP_11,
        keep_alive: true,
    };
    let out = Lent::borrow(&c.gauge);
    let ex = Exchange::new(
        feeder,
        answering,
        out,
        8192,
        (std::time::Duration::from_secs(60), send_for),
    );
    Box::pin(Serving { ex, fut: Some(fut) })
}

fn ok() -> Result<http::Response<ProxyBody>, std::convert::Infallible> {
    Ok(http::Response::new(ProxyBody::full("ok", None)))
}

/// A handler that drops the request body unread, then answers 200 once
/// `release` is set.
fn drop_body_then_answer_on<B: Send + 'static>(body: B, release: &Arc<AtomicBool>) -> Handling {
    let rel = Arc::clone(release);
    Box::pin(async move {
        drop(body);
        std::future::poll_fn(|_| match rel.load(Ordering::Acquire) {
            true => Poll::Ready(()),
            false => Poll::Pending,
        })
        .await;
        ok()
    })
}

/// Polls the exchange (no waker) until it ends; `None` if it does not
/// within `polls`.
fn run(c: &mut Conn<Slow>, ex: &mut Pin<Box<Serving<Handling>>>, polls: usize) -> Option<bool> {
    let mut cx = Context::from_waker(Waker::noop());
    (0..polls).find_map(|_| match c.poll_serving(ex.as_mut(), &mut cx) {
        Poll::Ready(keep) => Some(keep),
        Poll::Pending => None,
    })
}

/// The handler wants the body (`100 Continue` is due), then answers
/// before reading it while the interim line is still being written: the
/// response starts only after the whole interim line.
// In a runtime: a write the slow client does not take arms the send
// timer (`timeouts.send`).
#[tokio::test]
async fn the_interim_line_is_finished_before_the_response_starts() {
    let io = Slow {
        input: b"hello".to_vec(),
        write_max: 7,
        ..Slow::default()
    };
    let (mut c, _tx) = conn(io);
    let (feeder, mut body) = Feeder::new(&framing(5, true), 100);
    let mut polls = 0;
    let fut: Handling = Box::pin(async move {
        std::future::poll_fn(|cx| {
            polls += 1;
            if polls == 1 {
                let _ = Pin::new(&mut body).poll_frame(cx);
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Poll::Ready(())
        })
        .await;
        drop(body);
        ok()
    });
    let mut ex = exchange(&c, feeder, fut);
    let keep = run(&mut c, &mut ex, 1000).expect("the exchange ends");
    let out = String::from_utf8_lossy(&c.io.written).into_owned();
    assert!(
        out.starts_with("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"),
        "{out:?}"
    );
    assert!(out.ends_with("\r\n\r\nok"), "{out:?}");
    assert!(keep, "the body was read whole");
}

/// A handler that drops the body unread and answers later: no `100
/// Continue` is sent for it, and the connection closes after the answer
/// (the client may still send the body).
// In a runtime: a write the slow client does not take arms the send
// timer (`timeouts.send`).
#[tokio::test]
async fn no_interim_line_for_a_body_dropped_unread() {
    let io = Slow {
        write_max: 1 << 20,
        ..Slow::default()
    };
    let (mut c, _tx) = conn(io);
    let (feeder, body) = Feeder::new(&framing(5, true), 100);
    let release = Arc::new(AtomicBool::new(false));
    let fut = drop_body_then_answer_on(body, &release);
    let mut ex = exchange(&c, feeder, fut);
    assert_eq!(run(&mut c, &mut ex, 10), None, "the answer is pending");
    assert!(c.io.written.is_empty(), "{:?}", c.io.written);
    release.store(true, Ordering::Release);
    assert_eq!(run(&mut c, &mut ex, 1000), Some(false));
    assert!(c.io.written.starts_with(b"HTTP/1.1 200 OK\r\n"));
}

/// A body dropped unread while its answer is pending, the client sending
/// it fast: the connection reads and discards at most `DRAIN_MAX` bytes
/// (and one read past them), then reads nothing more, and closes after
/// the answer.
// In a runtime: a write the slow client does not take arms the send
// timer (`timeouts.send`).
#[tokio::test]
async fn a_body_dropped_while_the_answer_is_pending_is_read_up_to_a_bound() {
    let sent = 10 << 20;
    let io = Slow {
        input: vec![b'z'; sent],
        write_max: 1 << 20,
        ..Slow::default()
    };
    let (mut c, _tx) = conn(io);
    let (feeder, body) = Feeder::new(&framing(100 << 20, false), 100);
    let release = Arc::new(AtomicBool::new(false));
    let fut = drop_body_then_answer_on(body, &release);
    let mut ex = exchange(&c, feeder, fut);
    assert_eq!(run(&mut c, &mut ex, 10), None, "the answer is pending");
    // One read takes at most the buffer's room: a fresh buffer, grown
    // once by `poll_fill` (under 3 x BUF_SIZE).
    let bound = DRAIN_MAX as usize + 3 * pool::BUF_SIZE;
    assert!(c.io.read_total <= bound, "read {} bytes", c.io.read_total);
    release.store(true, Ordering::Release);
    assert_eq!(run(&mut c, &mut ex, 1000), Some(false));
    assert!(c.io.read_total <= bound, "read {} bytes", c.io.read_total);
    assert!(c.io.written.starts_with(b"HTTP/1.1 200 OK\r\n"));
}

/// Bytes of the future `f` returns (5 arguments).
fn future_size5<A, B, C, D, E, R>(_: &impl FnOnce(A, B, C, D, E) -> R) -> usize {
    std::mem::size_of::<R>()
}

/// An idle connection's task holds [`serve`]'s future: no exchange (nor
/// its response writer) inline in it, they are boxed per request. With
/// one inline, the future would hold at least an `Exchange`, the `Conn`
/// and the `Peer` side by side (all three live while a request is
/// served; the head wait's state, not live then, may share their room).
#[test]
fn the_connection_future_holds_no_exchange_inline() {
    use std::mem::size_of;
    let serve = future_size5(&serve::<tokio::net::TcpStream>);
    let conn = size_of::<Conn<tokio::net::TcpStream>>();
    let ex = size_of::<Exchange>();
    let peer = size_of::<Peer>();
    eprintln!("serve {serve} B, Conn {conn} B, Exchange {ex} B, Peer {peer} B");
    assert!(serve < conn + ex + peer, "serve {serve} B");
}

impl WaitRead for tokio::io::DuplexStream {
    fn poll_read_ready(&self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// The head timer is kept across waits: armed by an earlier wait, it
/// fires before a later wait's deadline, and that wait goes on to its
/// own. Each wait closes `request_headers` after it began, no sooner (the
/// earlier timer) and no later. Virtual time: the runtime's clock jumps
/// to each timer.
#[tokio::test(start_paused = true)]
async fn each_head_wait_ends_its_own_timeout_after_it_began() {
    const WAIT: std::time::Duration = std::time::Duration::from_secs(10);
    let yaml = crate::config::ONE_LISTENER_YAML;
    let config = crate::ProxyConfig::parse(yaml, "t.yaml").expect("config");
    let mut settings = config.listeners[0].settings();
    settings.timeouts.request_headers = WAIT;
    let (mut client, server) = tokio::io::duplex(4096);
    let (mut c, tx) = conn(server);
    let second = std::time::Duration::from_secs(1);
    let started = Instant::now();
    let sender = tokio::spawn(async move {
        tokio::time::sleep(5 * second).await;
        client
            .write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
            .await
            .expect("written");
        // Held open: the second wait sees no close, only its deadline.
        tokio::time::sleep(100 * WAIT).await;
        drop(client);
    });
    let head = |_: &mut Conn<_>, h: Head| h;
    assert!(matches!(
        c.next_head(&settings, head).await,
        Next::Started(_)
    ));
    assert_eq!(started.elapsed(), 5 * second, "the head came 5 s in");
    assert!(c.head_timer.is_some(), "the first wait armed the timer");
    tokio::time::sleep(second).await;
    // The timer still holds the first wait's deadline, 4 s ahead.
    let began = Instant::now();
    assert!(matches!(c.next_head(&settings, head).await, Next::Closed));
    let waited = began.elapsed();
    assert!(waited >= WAIT, "closed {waited:?} into a {WAIT:?} wait");
    assert!(
        waited < WAIT + second,
        "closed {waited:?} into a {WAIT:?} wait"
    );
    // A shorter timeout from a reload applies to the next wait at once.
    settings.timeouts.request_headers = second;
    let began = Instant::now();
    assert!(matches!(c.next_head(&settings, head).await, Next::Closed));
    let waited = began.elapsed();
    assert!(waited >= second && waited < 2 * second, "{waited:?}");
    sender.abort();
    drop(tx);
}

/// A client that takes no byte of what is written to it is closed
/// `timeouts.send` after the write stopped, and counted: the `100
/// Continue` line, and a response whose body has ended (nothing else
/// bounds that wait: no body deadline is left to poll). A client that
/// reads slowly but steadily is not cut: the bound is between two writes
/// that move bytes, not on the whole response. Virtual time.
#[tokio::test(start_paused = true)]
async fn a_write_the_client_takes_nothing_of_ends_at_the_send_timeout() {
    const SEND: std::time::Duration = std::time::Duration::from_secs(5);
    let second = std::time::Duration::from_secs(1);
    // A duplex of 16 bytes: the first 16 go, then writes wait.
    for continue_due in [true, false] {
        let (client, server) = tokio::io::duplex(16);
        let (mut c, _tx) = conn(server);
        let (feeder, fut): (Option<Feeder>, Handling) = if continue_due {
            // Wants the body (the interim line is due), which never comes.
            let (f, mut body) = Feeder::new(&framing(5, true), 100);
            let fut = Box::pin(async move {
                std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx).map(|_| ())).await;
                std::future::pending::<()>().await;
                ok()
            });
            (Some(f), fut)
        } else {
            (None, Box::pin(async { ok() }))
        };
        let mut ex = exchange_sending(&c, feeder, fut, SEND);
        let began = Instant::now();
        let serving = std::future::poll_fn(|cx| c.poll_serving(ex.as_mut(), cx));
        let keep = tokio::time::timeout(3 * SEND, serving)
            .await
            .expect("closed at the send timeout, not left waiting");
        let waited = began.elapsed();
        assert!(!keep, "closed (100 Continue due: {continue_due})");
        assert!(ex.ex.send_timed_out, "counted as a send timeout");
        assert!(waited >= SEND && waited < SEND + second, "{waited:?}");
        drop(client);
    }
    // 8 bytes every SEND / 2: each write waits less than SEND, the whole
    // response (its head alone is over 60 bytes) takes several SENDs.
    let (mut client, server) = tokio::io::duplex(8);
    let (mut c, _tx) = conn(server);
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        let mut buf = [0u8; 8];
        loop {
            tokio::time::sleep(SEND / 2).await;
            match tokio::io::AsyncReadExt::read(&mut client, &mut buf).await {
                Ok(0) | Err(_) => return got,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
            if got.ends_with(b"\r\n\r\nok") {
                return got;
            }
        }
    });
    let mut ex = exchange_sending(&c, None, Box::pin(async { ok() }), SEND);
    let began = Instant::now();
    let keep = std::future::poll_fn(|cx| c.poll_serving(ex.as_mut(), cx)).await;
    assert!(keep, "a client that reads is not cut");
    assert!(!ex.ex.send_timed_out);
    assert!(began.elapsed() > 2 * SEND, "{:?}", began.elapsed());
    let got = reader.await.expect("reader");
    assert!(got.starts_with(b"HTTP/1.1 200 OK\r\n"), "{got:?}");
}
