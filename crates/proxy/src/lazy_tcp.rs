//! An accepted connection that is registered with tokio's reactor (epoll)
//! only when it first has to wait, as HAProxy does: a read or write is
//! tried on the socket at once, and only one that would block registers
//! it. A connection whose request is already there when it is accepted,
//! answered and closed without waiting on its client (the common case of
//! a new connection per request), is never registered: two `epoll_ctl`
//! calls and tokio's registration (a 128-byte-aligned allocation) saved.
//!
//! Invariants:
//! - Once registered, a stream stays registered, and every poll goes to
//!   tokio's stream (which tracks readiness; nothing is read directly).
//! - A read or write that would block registers the stream and is polled
//!   again on it at once, so the task's waker is always kept: the socket's
//!   readiness since the failed attempt is reported by epoll (a socket
//!   registered while ready is reported as ready).
//! - An unregistered stream cannot tell readiness without reading:
//!   [`LazyTcpStream::poll_read_ready`] answers ready, and the read tells.
//!   [`LazyTcpStream::is_registered`] lets a caller that only wants to
//!   watch the socket (for the client leaving) wait before paying for the
//!   registration.

use std::io::{self, IoSlice, Read, Write};
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// An accepted TCP connection, registered with the reactor on first wait.
#[derive(Debug)]
pub struct LazyTcpStream {
    state: State,
}

#[derive(Debug)]
enum State {
    /// Not registered: reads and writes go to the (non-blocking) socket.
    Direct(std::net::TcpStream),
    Registered(TcpStream),
    /// Registering failed; the socket is closed and every call fails.
    Failed,
}

impl LazyTcpStream {
    /// Wraps an accepted socket, which must be in non-blocking mode.
    pub fn new(stream: std::net::TcpStream) -> Self {
        Self {
            state: State::Direct(stream),
        }
    }

    /// Whether the stream is registered with the reactor.
    pub fn is_registered(&self) -> bool {
        matches!(self.state, State::Registered(_))
    }

    /// The local address the connection was accepted on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        match &self.state {
            State::Direct(s) => s.local_addr(),
            State::Registered(s) => s.local_addr(),
            State::Failed => Err(failed()),
        }
    }

    /// The stream as tokio's, registered now (for the paths that wait
    /// from the start: TLS, L4, the PROXY header).
    pub fn into_tokio(mut self) -> io::Result<TcpStream> {
        self.register()?;
        match self.state {
            State::Registered(s) => Ok(s),
            _ => Err(failed()),
        }
    }

    /// Registers the stream if it is not yet; must be called from within
    /// the runtime.
    fn register(&mut self) -> io::Result<&mut TcpStream> {
        if matches!(self.state, State::Direct(_))
            && let State::Direct(std) = std::mem::replace(&mut self.state, State::Failed)
        {
            self.state = State::Registered(TcpStream::from_std(std)?);
        }
        match &mut self.state {
            State::Registered(s) => Ok(s),
            _ => Err(failed()),
        }
    }

    /// Tries `io` on the unregistered socket; registers it when the call
    /// would block (or the stream is registered already) and gives `None`
    /// then, so the caller polls tokio's stream.
    ///
    /// A direct call spends the task's budget as tokio's own stream does
    /// (`Pending` once it is spent, the task woken to go on), so a loop
    /// that reads while bytes keep coming still yields to the others.
    fn direct<R>(
        &mut self,
        cx: &mut Context<'_>,
        io: impl FnOnce(&std::net::TcpStream) -> io::Result<R>,
    ) -> Poll<Option<io::Result<R>>> {
        let State::Direct(s) = &self.state else {
            return Poll::Ready(None);
        };
        let budget = ready!(tokio::task::coop::poll_proceed(cx));
        Poll::Ready(match io(s) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => match self.register() {
                Ok(_) => None,
                Err(e) => Some(Err(e)),
            },
            done => {
                budget.made_progress();
                Some(done)
            }
        })
    }

    /// Whether bytes may be read: a registered stream asks the reactor; an
    /// unregistered one cannot tell without reading, so says ready (the
    /// read tells, and registers it if it would block).
    pub fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &self.state {
            State::Direct(_) => Poll::Ready(Ok(())),
            State::Registered(s) => s.poll_read_ready(cx),
            State::Failed => Poll::Ready(Err(failed())),
        }
    }

    /// The socket, for its options; `None` once registering failed (the
    /// socket is closed then).
    pub fn socket(&self) -> Option<socket2::SockRef<'_>> {
        match &self.state {
            State::Direct(s) => Some(socket2::SockRef::from(s)),
            State::Registered(s) => Some(socket2::SockRef::from(s)),
            State::Failed => None,
        }
    }

    fn registered(&mut self) -> io::Result<Pin<&mut TcpStream>> {
        self.register().map(Pin::new)
    }
}

impl From<TcpStream> for LazyTcpStream {
    fn from(stream: TcpStream) -> Self {
        Self {
            state: State::Registered(stream),
        }
    }
}

/// Bytes of the worker's scratch buffer a direct read goes through.
const SCRATCH: usize = 16 * 1024;

thread_local! {
    /// Zeroed once per worker thread: a direct read lands here and is
    /// copied into the caller's buffer, whose room is uninitialised (this
    /// workspace has no `unsafe` to read into it, and zeroing the room,
    /// 8-16 KiB, on every read cost more than copying what was read).
    static SCRATCH_BUF: std::cell::RefCell<Box<[u8]>> =
        std::cell::RefCell::new(vec![0; SCRATCH].into_boxed_slice());
}

/// One read of the unregistered socket `s` into `buf`.
fn read_direct(mut s: &std::net::TcpStream, buf: &mut ReadBuf<'_>) -> io::Result<()> {
    let want = buf.remaining().min(SCRATCH);
    SCRATCH_BUF.with_borrow_mut(|scratch| {
        let n = s.read(&mut scratch[..want])?;
        buf.put_slice(&scratch[..n]);
        Ok(())
    })
}

fn failed() -> io::Error {
    io::Error::new(
        io::ErrorKind::NotConnected,
        "the connection could not be registered with the reactor",
    )
}

impl AsyncRead for LazyTcpStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let State::Registered(s) = &mut this.state {
            return Pin::new(s).poll_read(cx, buf);
        }
        let read = ready!(this.direct(cx, |s| read_direct(s, buf)));
        match read {
            Some(done) => Poll::Ready(done),
            None => this.registered()?.poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for LazyTcpStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let State::Registered(s) = &mut this.state {
            return Pin::new(s).poll_write(cx, buf);
        }
        match ready!(this.direct(cx, |mut s| s.write(buf))) {
            Some(done) => Poll::Ready(done),
            None => this.registered()?.poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let State::Registered(s) = &mut this.state {
            return Pin::new(s).poll_write_vectored(cx, bufs);
        }
        match ready!(this.direct(cx, |mut s| s.write_vectored(bufs))) {
            Some(done) => Poll::Ready(done),
            None => this.registered()?.poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // A TCP socket has nothing to flush (tokio's does the same).
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().state {
            State::Direct(s) => Poll::Ready(s.shutdown(std::net::Shutdown::Write)),
            State::Registered(s) => Pin::new(s).poll_shutdown(cx),
            State::Failed => Poll::Ready(Err(failed())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A connected pair: the accepted side made lazy, and the client.
    async fn pair() -> (LazyTcpStream, TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let client = TcpStream::connect(listener.local_addr().expect("addr"));
        let client = client.await.expect("connect");
        let (accepted, _) = listener.accept().expect("accept");
        accepted.set_nonblocking(true).expect("non-blocking");
        (LazyTcpStream::new(accepted), client)
    }

    #[tokio::test]
    async fn bytes_already_there_are_read_and_answered_without_registering() {
        let (mut lazy, mut client) = pair().await;
        client.write_all(b"ping").await.expect("write");
        // Until the bytes are in the socket, a read would register.
        let mut ready = false;
        for _ in 0..200 {
            let mut head = [std::mem::MaybeUninit::new(0); 4];
            if let Some(Ok(n)) = lazy.socket().map(|s| s.peek(&mut head)) {
                ready = n == 4;
            }
            if ready {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert!(ready, "the client's bytes arrive");
        let mut got = [0u8; 4];
        lazy.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"ping");
        lazy.write_all(b"pong").await.expect("write");
        lazy.shutdown().await.expect("shutdown");
        assert!(!lazy.is_registered(), "nothing had to wait");
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.expect("read");
        assert_eq!(answer, b"pong");
    }

    #[tokio::test]
    async fn a_read_that_would_block_registers_and_wakes_when_bytes_come() {
        let (mut lazy, mut client) = pair().await;
        let reader = tokio::spawn(async move {
            let mut got = [0u8; 5];
            lazy.read_exact(&mut got).await.map(|_| (got, lazy))
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        client.write_all(b"hello").await.expect("write");
        let (got, lazy) = reader.await.expect("task").expect("read");
        assert_eq!(&got, b"hello");
        assert!(lazy.is_registered(), "the first read had to wait");
    }

    #[tokio::test]
    async fn the_end_of_the_stream_reads_as_zero_on_either_side_of_registering() {
        let (mut lazy, client) = pair().await;
        drop(client);
        let mut rest = Vec::new();
        lazy.read_to_end(&mut rest).await.expect("read");
        assert!(rest.is_empty());
    }

    #[tokio::test]
    async fn into_tokio_registers_and_keeps_the_bytes() {
        let (lazy, mut client) = pair().await;
        client.write_all(b"abc").await.expect("write");
        let mut stream = lazy.into_tokio().expect("registered");
        let mut got = [0u8; 3];
        stream.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"abc");
    }
}
