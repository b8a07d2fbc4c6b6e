//! How a downstream connection waits for bytes without holding a buffer,
//! and tells how many bytes its socket took: what meshless's HTTP/1
//! server (`h1serve`) and the send bound on hyper's (`send_timed`) ask of
//! the streams they serve.

use std::task::{Context, Poll};

/// How a connection waits for bytes without holding a buffer: a plain
/// socket asks for its readiness; a TLS stream (which may already hold
/// decrypted bytes) is read at once, the buffer given back if it had none.
pub trait WaitRead {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>>;

    /// Bytes the socket took so far (wrapping), where writes to this
    /// stream are not what reaches the socket (a TLS stream's records);
    /// 0 where they are (then the writer's own count tells progress).
    fn sent(&self) -> u64 {
        0
    }

    /// Whether the stream is registered with the reactor, so that waiting
    /// on it costs nothing more; `false` for a [`LazyTcpStream`] not yet
    /// registered, which the watch for the client leaving while the
    /// upstream answers waits `h1serve::WATCH_AFTER` before registering.
    ///
    /// [`LazyTcpStream`]: crate::lazy_tcp::LazyTcpStream
    fn registered(&self) -> bool {
        true
    }
}

impl WaitRead for tokio::net::TcpStream {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        tokio::net::TcpStream::poll_read_ready(self, cx)
    }
}

impl WaitRead for crate::lazy_tcp::LazyTcpStream {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        crate::lazy_tcp::LazyTcpStream::poll_read_ready(self, cx)
    }

    fn registered(&self) -> bool {
        self.is_registered()
    }
}

impl WaitRead for tokio_rustls::server::TlsStream<crate::tls::Counted> {
    fn poll_read_ready(&self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn sent(&self) -> u64 {
        self.get_ref().0.sent()
    }
}
