//! Body bytes on their way out of an HTTP/1 connection, the same for the
//! server's responses (`h1serve::write`) and the client's requests
//! (`upstream::h1`): small data copied into one buffer behind the head,
//! a large frame written from its own bytes (vectored, not copied), and a
//! chunk's closing CRLF after a large frame once it is out.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::AsyncWrite;

/// Appends a chunk's size line for `len` bytes of data (`{:X}\r\n`).
pub fn chunk_size(out: &mut BytesMut, len: usize) {
    let _ = std::fmt::Write::write_fmt(&mut Text(out), format_args!("{len:X}\r\n"));
}

/// Writes out `out`, then `big` after it, in vectored writes;
/// `Ready(Ok)` once both are written. When `big` is written whole and the
/// body is `chunked`, the chunk's CRLF goes into `out` and is written too.
pub fn poll_drain<I: AsyncWrite + Unpin>(
    out: &mut BytesMut,
    big: &mut Option<Bytes>,
    chunked: bool,
    io: &mut I,
    cx: &mut Context<'_>,
) -> Poll<io::Result<()>> {
    while !out.is_empty() || big.is_some() {
        let n = {
            let b = big.as_deref().unwrap_or_default();
            let slices = [io::IoSlice::new(out), io::IoSlice::new(b)];
            ready!(Pin::new(&mut *io).poll_write_vectored(cx, &slices))?
        };
        if n == 0 {
            return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
        }
        let from_out = n.min(out.len());
        out.advance(from_out);
        if let Some(b) = big.as_mut() {
            b.advance(n - from_out);
            if b.is_empty() {
                *big = None;
                if chunked {
                    out.put_slice(b"\r\n");
                }
            }
        }
    }
    Poll::Ready(Ok(()))
}

/// Writes formatted text into a `BytesMut`.
struct Text<'a>(&'a mut BytesMut);

impl std::fmt::Write for Text<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.put_slice(s.as_bytes());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_big_frame_follows_the_buffer_and_its_chunk_ends_after_it() {
        let mut out = BytesMut::new();
        chunk_size(&mut out, 0x1a);
        assert_eq!(&out[..], b"1A\r\n");
        let mut big = Some(Bytes::from(vec![b'x'; 0x1a]));
        let mut sink = Vec::new();
        std::future::poll_fn(|cx| poll_drain(&mut out, &mut big, true, &mut sink, cx))
            .await
            .expect("written");
        let mut want = b"1A\r\n".to_vec();
        want.extend_from_slice(&[b'x'; 0x1a]);
        want.extend_from_slice(b"\r\n");
        assert_eq!(sink, want);
        assert!(out.is_empty() && big.is_none());
    }
}
