//! One listening socket: accepts connections and serves HTTP/1.1 and h2c on
//! it (or, with `tls`, HTTP/1.1 and h2 over TLS chosen by ALPN), at most `max_connections` at once (more wait in the kernel's accept
//! backlog); stops accepting on request and drains its connections and
//! tunnels gracefully, closing what is left when the drain timeout ends.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinHandle;

use crate::connection::Drain;
use crate::lazy_tcp::LazyTcpStream;
use crate::limits::ListenerSettings;
use crate::pooled_future::PooledFuture;
use crate::protocol::ListenerProtocol;
use crate::request::Downstream;
use crate::request::tunnel::ConnectionGuards;
use crate::sockopt::SocketOptions;
use crate::state::ProxyState;
use crate::tls::ListenerTls;

/// A running listener.
#[derive(Debug)]
pub struct ListenerHandle {
    /// Configured address.
    pub address: SocketAddr,
    /// Bound address (differs from `address` when the port is 0).
    pub local_addr: SocketAddr,
    downstream: Arc<Downstream>,
    /// The socket, shared with the accept loop (and handed to a new
    /// process on a binary upgrade).
    socket: Arc<Listening>,
    /// TLS termination, when the listener has `tls`; swapped on reload.
    tls: Arc<ArcSwapOption<ListenerTls>>,
    /// Sends the drain deadline: stop accepting, drain, then close.
    stop: watch::Sender<Option<(Duration, Drain)>>,
    /// What the connections are asked (each holds a receiver; the accept
    /// loop's drain waits until none is left).
    graceful: Arc<watch::Sender<Drain>>,
    task: JoinHandle<()>,
    /// The `max_connections` slots, and the cap they were last sized to
    /// (a reload resizes them).
    slots: Arc<Slots>,
    cap: std::sync::Mutex<usize>,
}

impl ListenerHandle {
    /// Binds `address` with the listener's socket options.
    pub fn bind(
        address: SocketAddr,
        socket: &SocketOptions,
    ) -> std::io::Result<(Listening, SocketAddr)> {
        let listener = listening(socket.bind(address)?)?;
        let local = listener.get_ref().local_addr()?;
        Ok((listener, local))
    }

    /// Starts serving on an already bound socket.
    pub fn serve(
        name: Arc<str>,
        address: SocketAddr,
        listener: Listening,
        state: Arc<ProxyState>,
        settings: ListenerSettings,
        tls: Option<ListenerTls>,
    ) -> Self {
        let local_addr = listener.get_ref().local_addr().unwrap_or(address);
        let socket = Arc::new(listener);
        let (stop, stopped) = watch::channel(None);
        let cap = settings.max_connections as usize;
        let slots = Arc::new(Slots::new(cap));
        // Connections hold a receiver: a drain mode asks them to finish;
        // the sender's `closed()` resolves once every one has ended.
        let graceful = Arc::new(watch::channel(Drain::Serving).0);
        let downstream = Arc::new(Downstream::new(name, state, settings));
        let tls = Arc::new(ArcSwapOption::from(tls.map(|t| Arc::new(t.install()))));
        let task = tokio::spawn(accept_loop(
            Arc::clone(&downstream),
            Arc::clone(&socket),
            (Arc::clone(&tls), Arc::clone(&slots)),
            Arc::clone(&graceful),
            stopped,
        ));
        Self {
            address,
            local_addr,
            downstream,
            socket,
            tls,
            stop,
            graceful,
            task,
            slots,
            cap: std::sync::Mutex::new(cap),
        }
    }

    /// The TLS side now, if any (a reload builds the next one from it).
    pub fn tls(&self) -> Option<Arc<ListenerTls>> {
        self.tls.load_full()
    }

    /// Connections accepted from now on use `tls` (or plain TCP for
    /// `None`); the certificates of a reloaded one are installed now.
    pub fn update_tls(&self, tls: Option<ListenerTls>) {
        self.tls.store(tls.map(|t| Arc::new(t.install())));
    }

    /// The listening socket (to hand to a new process). It must stay
    /// non-blocking: the accept loop accepts on it directly.
    pub fn socket(&self) -> &std::net::TcpListener {
        self.socket.get_ref()
    }

    /// Applies reloaded settings: limits and timeouts of new requests and
    /// connections, and `max_connections` (a lower cap takes effect as
    /// connections over it close: none is cut).
    pub fn update(&self, settings: ListenerSettings) {
        let new = settings.max_connections as usize;
        self.downstream.update(settings);
        let mut cap = self
            .cap
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.slots.resize(*cap, new);
        *cap = new;
    }

    /// Whether a listener configured at `address` is this one: the same
    /// configured address, or the address this one actually bound.
    pub fn serves(&self, address: SocketAddr) -> bool {
        address == self.address || address == self.local_addr
    }

    /// Keeps accepting, but asks every connection, open or accepted from
    /// now on, to leave ([`Drain::OnNextResponse`]): HTTP/1 answers its
    /// next request with `connection: close`, HTTP/2 gets a GOAWAY. The
    /// `drain_delay` of a shutdown: clients move to another proxy before
    /// the listener closes.
    pub fn drain_connections(&self) {
        self.graceful.send_if_modified(|d| {
            let serving = *d == Drain::Serving;
            if serving {
                *d = Drain::OnNextResponse;
            }
            serving
        });
    }

    /// Stops accepting; open connections and tunnels finish (up to
    /// `drain`), then whatever is left is closed. Resolves when done.
    pub async fn shutdown(self, drain: Duration) {
        self.shutdown_with(drain, Drain::Now).await;
    }

    /// As [`ListenerHandle::shutdown`], connections asked to finish by `mode`.
    pub async fn shutdown_with(self, drain: Duration, mode: Drain) {
        // The accept loop holds the last reference: the socket closes
        // when it stops accepting, not at the end of the drain.
        drop(self.socket);
        let _ = self.stop.send(Some((drain, mode)));
        let _ = self.task.await;
    }
}

/// A listener's `max_connections` slots: permits of a semaphore, some of
/// them owed (a lowered cap while more connections were open: the accept
/// loop forgets that many permits as connections give theirs back).
#[derive(Debug)]
struct Slots {
    permits: Arc<Semaphore>,
    owed: std::sync::atomic::AtomicUsize,
}

impl Slots {
    fn new(cap: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(cap)),
            owed: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// Moves the slots from `old` in all to `new`: adds the difference
    /// (paying what is owed first), or takes it away: free permits at
    /// once, the rest owed.
    fn resize(&self, old: usize, new: usize) {
        use std::sync::atomic::Ordering;
        if new > old {
            let mut more = new - old;
            let _ = self
                .owed
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |owed| {
                    let paid = owed.min(new - old);
                    more = new - old - paid;
                    Some(owed - paid)
                });
            self.permits.add_permits(more);
        } else if new < old {
            let owed = (old - new) - self.permits.forget_permits(old - new);
            self.owed.fetch_add(owed, Ordering::AcqRel);
        }
    }

    /// Whether `permit` pays a debt (it is forgotten) instead of serving.
    fn pays_debt(&self, permit: OwnedSemaphorePermit) -> Option<OwnedSemaphorePermit> {
        use std::sync::atomic::Ordering;
        let paid = self
            .owed
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |o| o.checked_sub(1))
            .is_ok();
        if paid {
            permit.forget();
            None
        } else {
            Some(permit)
        }
    }
}

/// Exponential pause after a failed `accept` (EMFILE, ENFILE, ENOBUFS):
/// 5 ms doubling to 1 s, reset by a success, so a full descriptor table
/// does not spin a core.
#[derive(Debug, Default)]
pub struct AcceptBackoff(u32);

impl AcceptBackoff {
    /// The pause after one more failure.
    pub fn failed(&mut self) -> Duration {
        self.0 = (self.0 + 1).min(9);
        Duration::from_millis(5 << (self.0 - 1)).min(Duration::from_secs(1))
    }

    /// After a success.
    pub fn reset(&mut self) {
        self.0 = 0;
    }
}

async fn accept_loop(
    downstream: Arc<Downstream>,
    listener: Arc<Listening>,
    (tls, slots): (Arc<ArcSwapOption<ListenerTls>>, Arc<Slots>),
    graceful: Arc<watch::Sender<Drain>>,
    mut stopped: watch::Receiver<Option<(Duration, Drain)>>,
) {
    let metrics = &downstream.state.metrics;
    let mut backoff = AcceptBackoff::default();
    let clock = Arc::clone(&downstream.watch_clock);
    let ticking = tokio::spawn(async move { clock.run(crate::h1serve::WATCH_AFTER).await });
    let (drain, mode) = loop {
        if slots.permits.available_permits() == 0 {
            metrics.connections_at_limit(&downstream.name);
        }
        let permit = tokio::select! {
            p = Arc::clone(&slots.permits).acquire_owned() => p,
            changed = stopped.changed() => break drain_of(changed, &stopped),
        };
        let Ok(permit) = permit else {
            break (Duration::ZERO, Drain::Now);
        };
        let Some(permit) = slots.pays_debt(permit) else {
            continue;
        };
        tokio::select! {
            accepted = accept(&listener) => match accepted {
                Ok((stream, client)) => {
                    backoff.reset();
                    let tls = tls.load_full();
                    serve_connection(&downstream, tls, graceful.subscribe(), stream, client, permit);
                }
                Err(e) => {
                    let pause = backoff.failed();
                    tracing::warn!(listener = %downstream.name, error = %e, ?pause, "accept failed");
                    tokio::time::sleep(pause).await;
                }
            },
            changed = stopped.changed() => break drain_of(changed, &stopped),
        }
    };
    drop(listener);
    let tunnels = &downstream.tunnels;
    graceful.send_replace(mode);
    // Connections first: a request still being served may open a tunnel,
    // and none can once every connection has ended.
    let drained = async {
        graceful.closed().await;
        tunnels.idle().await;
    };
    if tokio::time::timeout(drain, drained).await.is_err() {
        tracing::warn!(listener = %downstream.name, "drain timeout: closing remaining connections");
    }
    tunnels.close_all();
    ticking.abort();
}

fn drain_of(
    changed: Result<(), watch::error::RecvError>,
    stopped: &watch::Receiver<Option<(Duration, Drain)>>,
) -> (Duration, Drain) {
    let drain = if changed.is_ok() {
        *stopped.borrow()
    } else {
        None
    };
    drain.unwrap_or((Duration::ZERO, Drain::Now))
}

/// `stream` registered with the reactor (TCP proxying and TLS wait on the
/// socket from the start), or `None` (logged) if it could not be.
fn registered(
    downstream: &Downstream,
    client: SocketAddr,
    stream: LazyTcpStream,
) -> Option<tokio::net::TcpStream> {
    stream
        .into_tokio()
        .inspect_err(|e| tracing::debug!(listener = %downstream.name, %client, error = %e, "connection not registered"))
        .ok()
}

/// A listening socket, watched by the reactor; the connections it accepts
/// are registered only when they first wait ([`LazyTcpStream`]).
pub type Listening = AsyncFd<std::net::TcpListener>;

/// `listener` as a listener serves it ([`ListenerHandle::serve`]).
// `AsyncFd::new` is deprecated because a `T` that does not own its
// descriptor (a bare number) could be closed under the registration; a
// `std::net::TcpListener` owns its socket, which closes only when the
// `AsyncFd` drops it (its safe replacement is `unsafe`, which this
// workspace forbids).
#[allow(deprecated)]
pub fn listening(listener: TcpListener) -> std::io::Result<Listening> {
    AsyncFd::new(listener.into_std()?)
}

/// Accepts one connection (non-blocking, close-on-exec), not registered
/// with the reactor: where tokio's `accept` registers every connection,
/// one answered without waiting never is.
async fn accept(listener: &Listening) -> std::io::Result<(LazyTcpStream, SocketAddr)> {
    let flags = socket2::Type::from(0).nonblocking().cloexec();
    listener
        .async_io(Interest::READABLE, |l| {
            let (socket, peer) = socket2::SockRef::from(l).accept4(flags.into())?;
            let peer = peer.as_socket().ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::InvalidData, "a peer that is not IP")
            })?;
            Ok((LazyTcpStream::new(socket.into()), peer))
        })
        .await
}

/// Serves one accepted connection; `permit` is its `max_connections` slot.
/// The deny rules see it first ([`crate::accept::screen`]), then the
/// PROXY header is read, then its protocol is served.
fn serve_connection(
    downstream: &Arc<Downstream>,
    tls: Option<Arc<ListenerTls>>,
    draining: watch::Receiver<Drain>,
    stream: LazyTcpStream,
    peer: SocketAddr,
    permit: OwnedSemaphorePermit,
) {
    let settings = downstream.settings();
    let Some(stream) = crate::accept::screen(downstream, &settings, stream, peer) else {
        return;
    };
    if let Some(socket) = stream.socket() {
        let _ = settings.socket.apply(socket);
    }
    let open = crate::metrics::OpenConnection::new(&downstream.connections);
    // Shared: a tunnel opened on the connection holds them until it closes.
    let guards = Arc::new(ConnectionGuards::new(open, permit));
    // At the end of a drain, whatever is still open is dropped (closed).
    let closed = downstream.tunnels.closed();
    let downstream = Arc::clone(downstream);
    let hold = Arc::downgrade(&guards);
    // The connection's future lives in a box reused per worker thread, so
    // the task tokio allocates is small: tokio moves a task's future into
    // its cell and writes its stage again when it ends, a copy of the
    // whole future each time (about 1,600 instructions per connection at
    // this size), and a cell this large came from the allocator's slow
    // path (BENCHMARKS.md).
    let served = PooledFuture::new(|| {
        serve_accepted(downstream, settings, tls, draining, stream, peer, hold)
    });
    tokio::spawn(ConnectionTask {
        served,
        closed,
        _open: guards,
    });
}

pin_project_lite::pin_project! {
    /// One connection's task: serves it until it ends or the drain ends
    /// (`closed`), then is dropped with its guards (the connection gauge,
    /// the `max_connections` slot; a tunnel opened on the connection holds
    /// them on until it closes). A plain struct rather than an async
    /// block, so the futures are stored once (an async block would keep
    /// each both as captured and as awaited).
    struct ConnectionTask<S, C> {
        #[pin]
        served: S,
        #[pin]
        closed: C,
        _open: Arc<ConnectionGuards>,
    }
}

impl<S: Future<Output = ()>, C: Future<Output = ()>> Future for ConnectionTask<S, C> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        if this.served.poll(cx).is_ready() || this.closed.poll(cx).is_ready() {
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

/// Serves one accepted (and screened) connection: its PROXY header, then
/// its protocol. Every connection's task holds this future for its whole
/// life, so rare arms (TLS, L4) are boxed: the task is as large as its
/// largest inline state. (A function returning an async block: an `async
/// fn` would store its arguments twice.)
#[allow(clippy::manual_async_fn)] // see above: arguments stored once
fn serve_accepted(
    downstream: Arc<Downstream>,
    settings: Arc<ListenerSettings>,
    tls: Option<Arc<ListenerTls>>,
    draining: watch::Receiver<Drain>,
    stream: LazyTcpStream,
    peer: SocketAddr,
    hold: Weak<ConnectionGuards>,
) -> impl Future<Output = ()> + Send + 'static {
    async move {
        let accepted = crate::accept::client_address(&downstream, &settings, stream, peer);
        let Some((stream, client)) = accepted.await else {
            return;
        };
        match (settings.protocol, tls) {
            (ListenerProtocol::Tcp, _) => {
                let Some(stream) = registered(&downstream, client, stream) else {
                    return;
                };
                Box::pin(crate::l4::serve(downstream, stream, client, draining)).await
            }
            (ListenerProtocol::Http, Some(tls)) => {
                let Some(stream) = registered(&downstream, client, stream) else {
                    return;
                };
                Box::pin(crate::connection::serve_tls(
                    downstream, tls, stream, client, hold, draining,
                ))
                .await
            }
            (ListenerProtocol::Http, None) => {
                crate::connection::serve(downstream, stream, client, hold, draining).await
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes of the future `f` returns (7 arguments).
    fn future_size7<A, B, C, D, E, G, H, R>(_: &impl FnOnce(A, B, C, D, E, G, H) -> R) -> usize {
        std::mem::size_of::<R>()
    }

    /// Bytes of the future `f` returns (5 arguments).
    fn future_size5<A, B, C, D, E, R>(_: &impl FnOnce(A, B, C, D, E) -> R) -> usize {
        std::mem::size_of::<R>()
    }

    /// Bytes of the future `f` returns (4 arguments).
    fn future_size4<A, B, C, D, R>(_: &impl FnOnce(A, B, C, D) -> R) -> usize {
        std::mem::size_of::<R>()
    }

    /// Bytes of a connection's task (`ConnectionTask`), its connection's
    /// future in a pooled box.
    fn task_size<S: Future + 'static, C>(
        _: &impl FnOnce(
            Arc<Downstream>,
            Arc<ListenerSettings>,
            Option<Arc<ListenerTls>>,
            watch::Receiver<Drain>,
            LazyTcpStream,
            SocketAddr,
            Weak<ConnectionGuards>,
        ) -> S,
        _closed: &C,
    ) -> usize {
        std::mem::size_of::<ConnectionTask<PooledFuture<S>, C>>()
    }

    /// What every plain HTTP connection holds while it lives (this build's
    /// layout; `--nocapture` prints them). The connection's future is in a
    /// pooled box, so the task tokio allocates and copies is a few
    /// pointers; each layer of the boxed future is at least as large as
    /// the one it awaits, and hyper's HTTP/1 and HTTP/2 connections are
    /// boxed, so the whole is smaller than either.
    #[test]
    fn connection_task_sizes() {
        let closed = crate::request::tunnel::Tunnels::default().closed();
        let task = task_size(&serve_accepted, &closed);
        let accepted = future_size7(&serve_accepted);
        let conn = future_size5(&crate::connection::serve);
        let h1 = future_size5(&crate::h1serve::serve::<LazyTcpStream>);
        let hyper =
            future_size4(&crate::hyper_h1::serve::<crate::h1serve::Prefixed<LazyTcpStream>>);
        eprintln!(
            "task {task} B, serve_accepted {accepted} B, connection::serve {conn} B, \
             h1serve::serve {h1} B, hyper_h1::serve {hyper} B"
        );
        assert!(
            task <= 256,
            "task {task} B: the connection's future is boxed"
        );
        assert!(accepted >= conn && conn >= h1);
        assert!(accepted < hyper, "serve_accepted {accepted} B");
        // Each idle connection holds a box of this size: the HTTP/2 and
        // hyper arms are boxed, so it is the HTTP/1 server's state and the
        // wait for the first bytes (904 B in this build; 1,568 B with the
        // HTTP/2 arm inline).
        assert!(
            accepted <= 1024,
            "serve_accepted {accepted} B: a rare arm inline?"
        );
    }

    #[test]
    fn accept_backoff_doubles_to_a_second_and_resets() {
        let mut b = AcceptBackoff::default();
        let pauses: Vec<u64> = (0..10).map(|_| b.failed().as_millis() as u64).collect();
        assert_eq!(pauses, [5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        b.reset();
        assert_eq!(b.failed(), Duration::from_millis(5));
    }
}
