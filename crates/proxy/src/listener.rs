//! One listening socket: accepts connections and serves HTTP/1.1 and h2c on
//! it; stops accepting on request and drains its connections gracefully.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::state::ProxyState;

/// A running listener.
#[derive(Debug)]
pub struct ListenerHandle {
    /// Configured address.
    pub address: SocketAddr,
    /// Bound address (differs from `address` when the port is 0).
    pub local_addr: SocketAddr,
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
    ) -> Self {
        let local_addr = listener.local_addr().unwrap_or(address);
        let (stop, stopped) = watch::channel(None);
        let task = tokio::spawn(accept_loop(name, listener, state, stopped));
        Self {
            address,
            local_addr,
            stop,
            task,
        }
    }

    /// Whether a listener configured at `address` is this one: the same
    /// configured address, or the address this one actually bound.
    pub fn serves(&self, address: SocketAddr) -> bool {
        address == self.address || address == self.local_addr
    }

    /// Stops accepting; open connections finish their requests (up to
    /// `drain`), then close. Resolves when done.
    pub async fn shutdown(self, drain: Duration) {
        let _ = self.stop.send(Some(drain));
        let _ = self.task.await;
    }
}

async fn accept_loop(
    name: Arc<str>,
    listener: TcpListener,
    state: Arc<ProxyState>,
    mut stopped: watch::Receiver<Option<Duration>>,
) {
    let graceful = GracefulShutdown::new();
    let drain = loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, client) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(listener = %name, error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let state = Arc::clone(&state);
                let name = Arc::clone(&name);
                let service = service_fn(move |req| {
                    crate::request::handle(Arc::clone(&state), Arc::clone(&name), client, req)
                });
                let mut builder = auto::Builder::new(TokioExecutor::new());
                builder.http1().timer(TokioTimer::new()).header_read_timeout(Duration::from_secs(30));
                let conn = builder
                    .serve_connection_with_upgrades(TokioIo::new(stream), service)
                    .into_owned();
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
            changed = stopped.changed() => {
                let drain = if changed.is_ok() { *stopped.borrow() } else { None };
                break drain.unwrap_or(Duration::ZERO);
            }
        }
    };
    drop(listener);
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(listener = %name, "drain timeout: closing remaining connections");
    }
}
