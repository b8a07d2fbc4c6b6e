//! An I/O object whose first reads return bytes already read from it: how
//! a connection handed over to hyper has what was read replayed before the
//! rest of the stream (the first bytes, which told the protocol, for
//! hyper's HTTP/2 and HTTP/1 servers; the request head on an upgrade or
//! `CONNECT`). The bytes are freed once replayed, not held for the
//! connection's life.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// `io`, read from `prefix` first.
#[derive(Debug)]
pub struct Prefixed<I> {
    prefix: Bytes,
    io: I,
}

impl<I> Prefixed<I> {
    pub fn new(prefix: Bytes, io: I) -> Self {
        Self { prefix, io }
    }
}

impl<I: crate::wait_read::WaitRead> crate::wait_read::WaitRead for Prefixed<I> {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.prefix.is_empty() {
            self.io.poll_read_ready(cx)
        } else {
            Poll::Ready(Ok(()))
        }
    }

    fn sent(&self) -> u64 {
        self.io.sent()
    }

    fn registered(&self) -> bool {
        self.io.registered()
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Prefixed<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            if self.prefix.is_empty() {
                // `advance` keeps the allocation: let it go.
                self.prefix = Bytes::new();
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Prefixed<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn the_prefix_comes_first_then_the_stream() {
        let (mut a, b) = tokio::io::duplex(64);
        tokio::io::AsyncWriteExt::write_all(&mut a, b" world")
            .await
            .expect("write");
        drop(a);
        let mut p = Prefixed::new(Bytes::from_static(b"hello"), b);
        let mut got = String::new();
        p.read_to_string(&mut got).await.expect("read");
        assert_eq!(got, "hello world");
    }

    /// Once replayed, the prefix is let go: a connection that lives on
    /// (idle, or a tunnel) does not keep what it read first.
    #[tokio::test]
    async fn the_prefix_is_freed_once_replayed() {
        let (_a, b) = tokio::io::duplex(64);
        let first = Bytes::from(b"0123456789".to_vec());
        let mut p = Prefixed::new(first.clone(), b);
        let mut got = [0u8; 4];
        p.read_exact(&mut got).await.expect("read");
        assert!(!first.is_unique(), "still being replayed");
        let mut rest = [0u8; 6];
        p.read_exact(&mut rest).await.expect("read");
        assert_eq!((&got, &rest), (b"0123", b"456789"));
        assert!(first.is_unique(), "the replayed prefix is still held");
    }
}
