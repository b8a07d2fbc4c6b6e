//! `meshless proxy --upgrade-socket PATH [--takeover]`: the binary upgrade
//! around `meshless_proxy::handoff`. The running proxy serves `PATH`; a new
//! one started with `--takeover` takes its listening sockets, accepts on
//! them, tells it so (it drains and exits), then serves `PATH` itself.

use std::path::Path;

use anyhow::{Context, Result, bail};
use meshless_proxy::{Proxy, ProxyConfig, handoff};
use tokio::net::UnixListener;

/// Starts a proxy on the sockets of the one serving `socket`, then tells
/// that one to stop accepting.
/// With no process to take over from (no socket file, or a stale one
/// nobody answers on: the old proxy crashed), starts as a fresh proxy
/// binding its own sockets, as HAProxy's `-x` and Envoy's hot restart do.
pub async fn take_over(config: ProxyConfig, socket: &Path) -> Result<Proxy> {
    let path = socket.to_owned();
    let received = tokio::task::spawn_blocking(move || handoff::receive(&path))
        .await
        .context("receiving the listening sockets")?;
    let (mut inherited, stream) = match received {
        Ok(r) => r,
        Err(handoff::HandoffError::Io { source, .. })
            if matches!(
                source.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            tracing::warn!(
                socket = %socket.display(),
                error = %source,
                "--takeover: no running proxy to take over from; binding the sockets"
            );
            return Ok(Proxy::start(config).await?);
        }
        Err(e) => return Err(e.into()),
    };
    let proxy = Proxy::start_with(config, &mut inherited).await?;
    if inherited.left() > 0 {
        tracing::info!(
            closed = inherited.left(),
            "listening sockets of the old process the new config does not use"
        );
    }
    drop(inherited);
    tokio::task::spawn_blocking(move || handoff::ready(stream))
        .await
        .context("telling the old process")?
        .context("telling the old process")?;
    tracing::info!(socket = %socket.display(), "took over the listening sockets");
    Ok(proxy)
}

/// Serves upgrade requests on `socket`. After a takeover the old process's
/// file is replaced; otherwise a file nobody answers on is stale and is
/// replaced, and one a live proxy answers on is an error.
pub fn listen(socket: &Path, took_over: bool) -> Result<UnixListener> {
    if socket.exists() {
        if !took_over && std::os::unix::net::UnixStream::connect(socket).is_ok() {
            bail!(
                "--upgrade-socket {}: a running proxy serves it; start with --takeover to replace it",
                socket.display()
            );
        }
        std::fs::remove_file(socket)
            .with_context(|| format!("--upgrade-socket {}: removing", socket.display()))?;
    }
    UnixListener::bind(socket).with_context(|| format!("--upgrade-socket {}", socket.display()))
}

/// The next upgrade request; never resolves without a socket.
pub async fn accept(listener: Option<&UnixListener>) -> Option<std::os::unix::net::UnixStream> {
    let Some(listener) = listener else {
        return std::future::pending().await;
    };
    match listener.accept().await {
        Ok((stream, _)) => stream.into_std().ok(),
        Err(e) => {
            tracing::warn!(error = %e, "upgrade socket: accept failed");
            // EMFILE and the like: do not spin.
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            None
        }
    }
}

/// Hands the sockets over; true when the new process accepts on them.
pub async fn hand_over(proxy: &Proxy, stream: Option<std::os::unix::net::UnixStream>) -> bool {
    let Some(stream) = stream else {
        return false;
    };
    match proxy.hand_over(stream).await {
        Ok(true) => {
            tracing::info!("upgrade: the new process accepts; draining and exiting");
            true
        }
        Ok(false) => {
            tracing::warn!("upgrade: the new process went away before taking over; serving on");
            false
        }
        Err(e) => {
            tracing::warn!(error = %e, "upgrade: hand-over failed; serving on");
            false
        }
    }
}
