//! One listening socket: accepts connections and serves HTTP/1.1 and h2c on
//! it, at most `max_connections` at once (more wait in the kernel's accept
//! backlog); stops accepting on request and drains its connections and
//! tunnels gracefully, closing what is left when the drain timeout ends.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinHandle;

use crate::limits::ListenerSettings;
use crate::request::{Downstream, Peer};
use crate::state::ProxyState;

/// A running listener.
#[derive(Debug)]
pub struct ListenerHandle {
    /// Configured address.
    pub address: SocketAddr,
    /// Bound address (differs from `address` when the port is 0).
    pub local_addr: SocketAddr,
    downstream: Arc<Downstream>,
    /// Sends the drain deadline: stop accepting, drain, then close.
    stop: watch::Sender<Option<Duration>>,
    task: JoinHandle<()>,
}

impl ListenerHandle {
    /// Binds `address`.
    pub async fn bind(address: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
        let listener = TcpListener::bind(address).await?;
        let local = listener.local_addr()?;
        Ok((listener, local))
    }

    /// Starts serving on an already bound socket.
    pub fn serve(
        name: Arc<str>,
        address: SocketAddr,
        listener: TcpListener,
        state: Arc<ProxyState>,
        settings: ListenerSettings,
    ) -> Self {
        let local_addr = listener.local_addr().unwrap_or(address);
        let (stop, stopped) = watch::channel(None);
        let downstream = Arc::new(Downstream::new(name, state, settings));
        let task = tokio::spawn(accept_loop(Arc::clone(&downstream), listener, stopped));
        Self {
            address,
            local_addr,
            downstream,
            stop,
            task,
        }
    }

    /// Applies reloaded settings (limits and timeouts of new requests and
    /// connections; `max_connections` when the listener is re-created).
    pub fn update(&self, settings: ListenerSettings) {
        self.downstream.update(settings);
    }

    /// Whether a listener configured at `address` is this one: the same
    /// configured address, or the address this one actually bound.
    pub fn serves(&self, address: SocketAddr) -> bool {
        address == self.address || address == self.local_addr
    }

    /// Stops accepting; open connections and tunnels finish (up to
    /// `drain`), then whatever is left is closed. Resolves when done.
    pub async fn shutdown(self, drain: Duration) {
        let _ = self.stop.send(Some(drain));
        let _ = self.task.await;
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
    listener: TcpListener,
    mut stopped: watch::Receiver<Option<Duration>>,
) {
    let graceful = GracefulShutdown::new();
    let max = downstream.settings().max_connections as usize;
    let slots = Arc::new(Semaphore::new(max));
    let metrics = &downstream.state.metrics;
    let mut backoff = AcceptBackoff::default();
    let drain = loop {
        if slots.available_permits() == 0 {
            metrics.connections_at_limit(&downstream.name);
        }
        let permit = tokio::select! {
            p = Arc::clone(&slots).acquire_owned() => p,
            changed = stopped.changed() => break drain_of(changed, &stopped),
        };
        let Ok(permit) = permit else {
            break Duration::ZERO;
        };
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, client)) => {
                    backoff.reset();
                    serve_connection(&downstream, &graceful, stream, client, permit);
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
    let drained = async { tokio::join!(graceful.shutdown(), tunnels.idle()) };
    if tokio::time::timeout(drain, drained).await.is_err() {
        tracing::warn!(listener = %downstream.name, "drain timeout: closing remaining connections");
    }
    tunnels.close_all();
}

fn drain_of(
    changed: Result<(), watch::error::RecvError>,
    stopped: &watch::Receiver<Option<Duration>>,
) -> Duration {
    let drain = if changed.is_ok() {
        *stopped.borrow()
    } else {
        None
    };
    drain.unwrap_or(Duration::ZERO)
}

/// Serves one accepted connection; `permit` is its `max_connections` slot.
fn serve_connection(
    downstream: &Arc<Downstream>,
    graceful: &GracefulShutdown,
    stream: TcpStream,
    client: SocketAddr,
    permit: OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let settings = downstream.settings();
    let t = &settings.timeouts;
    let d = Arc::clone(downstream);
    let peer = Peer::new(client);
    let service = service_fn(move |req| crate::request::handle(Arc::clone(&d), peer.clone(), req));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(t.request_headers)
        .max_buf_size(head_buffer(&settings));
    if let Some(n) = hyper_max_headers(settings.limits.max_headers) {
        builder.http1().max_headers(n);
    }
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(t.idle)
        .keep_alive_timeout(t.request_headers)
        .max_header_list_size(settings.limits.max_header_bytes + settings.limits.max_uri_bytes);
    let conn = builder
        .serve_connection_with_upgrades(TokioIo::new(stream), service)
        .into_owned();
    let conn = graceful.watch(conn);
    let open = downstream.state.metrics.connection_opened(&downstream.name);
    // At the end of a drain, whatever is still open is dropped (closed).
    let closed = downstream.tunnels.closed();
    tokio::spawn(async move {
        tokio::select! {
            _ = conn => {}
            () = closed => {}
        }
        drop((open, permit));
    });
}

/// hyper's own header-count limit, when its default (100, parsed on the
/// stack) does not do: the screen stage answers `431` with its reason for
/// more than `max_headers`, so hyper must parse one more. Up to 100, hyper's
/// default lets the screen see every count it refuses, and more than 100
/// hyper refuses itself (also `431`). Set, hyper allocates two arrays of
/// that many entries on the heap for every request head it parses.
fn hyper_max_headers(max_headers: u32) -> Option<usize> {
    const HYPER_DEFAULT: usize = 100;
    let n = max_headers as usize + 1;
    (n > HYPER_DEFAULT + 1).then_some(n)
}

/// hyper's read buffer for a request head: the header and target limits
/// plus room for the request line; hyper answers `431` past it.
fn head_buffer(s: &ListenerSettings) -> usize {
    let want = s.limits.max_header_bytes as usize + s.limits.max_uri_bytes as usize + 1024;
    want.max(8192)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyper_parses_on_the_stack_up_to_its_default() {
        assert_eq!(hyper_max_headers(10), None);
        assert_eq!(hyper_max_headers(100), None);
        assert_eq!(hyper_max_headers(101), Some(102));
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
