//! A TCP stream that counts the bytes the kernel took from it, under a
//! downstream TLS stream: the HTTP/1 server bounds a client that takes no
//! byte for `timeouts.send`, and over TLS the plaintext it writes is taken
//! by rustls (which holds up to 64 KiB of records) before any of it
//! reaches the client. The count is what did.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// A [`TcpStream`] and the bytes written to it so far.
#[derive(Debug)]
pub struct Counted {
    stream: TcpStream,
    /// Bytes the socket accepted (wrapping: only compared for change).
    sent: u64,
}

impl Counted {
    pub fn new(stream: TcpStream) -> Self {
        Self { stream, sent: 0 }
    }

    /// Bytes the socket accepted so far (wraps).
    pub fn sent(&self) -> u64 {
        self.sent
    }

    fn count(&mut self, written: &Poll<io::Result<usize>>) {
        if let Poll::Ready(Ok(n)) = written {
            self.sent = self.sent.wrapping_add(*n as u64);
        }
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.count(&written);
        written
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.count(&written);
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn what_the_socket_took_is_counted_and_reads_pass_through() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let client = TcpStream::connect(addr).await.expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        let mut counted = Counted::new(server);
        let mut client = client;
        counted.write_all(b"hello").await.expect("write");
        let bufs = [io::IoSlice::new(b"ab"), io::IoSlice::new(b"c")];
        let n = counted.write_vectored(&bufs).await.expect("write");
        assert_eq!(counted.sent(), 5 + n as u64);
        let mut got = vec![0u8; 5 + n];
        client.read_exact(&mut got).await.expect("read");
        client.write_all(b"x").await.expect("write");
        let mut one = [0u8; 1];
        counted.read_exact(&mut one).await.expect("read");
        assert_eq!(&one, b"x");
    }
}
