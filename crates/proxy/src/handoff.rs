//! Binary upgrade: a running proxy hands its listening sockets to a new
//! process over a Unix socket (`SCM_RIGHTS`), as Envoy's hot restart and
//! HAProxy's `expose-fd listeners` with `-x` do.
//!
//! ```text
//! new process                         running process (serves `path`)
//!   connect(path)  ----------------->  accept
//!                  <-----------------  header (JSON: name, configured and bound
//!                                      address of each socket) + the fds
//!   Proxy::start_with(sockets)         (keeps accepting meanwhile)
//!   "ready\n"      ----------------->  stops accepting, drains, exits
//!   unlink(path), bind(path): serves the next upgrade
//! ```
//!
//! Both processes accept on the same sockets until the old one stops, so
//! no connection finds a closed port: the kernel's accept queue is one. If
//! the new process fails before `ready`, the old one never stopped.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::{Deserialize, Serialize};

/// The most sockets one upgrade hands over (Linux's `SCM_MAX_FD` is 253).
pub const MAX_SOCKETS: usize = 250;

/// What the new process answers once it accepts on the sockets.
const READY: &[u8] = b"ready\n";

/// How long either side waits for the other: the running process for the
/// new one's `ready` (the new one starts meanwhile), the new one for the
/// sockets. Past it the hand-over fails and the running process serves on.
pub const HANDOFF_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Why a hand-over failed.
#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    #[error("upgrade socket {path}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("upgrade socket: {0}")]
    Protocol(String),
}

/// One listening socket as described on the wire (its fd travels beside).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SocketInfo {
    /// The listener's name, or `admin`.
    pub name: String,
    /// The address in the config that bound it (port 0 stays 0).
    pub configured: SocketAddr,
    /// The address it is bound to.
    pub local: SocketAddr,
}

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    sockets: Vec<SocketInfo>,
}

/// Listening sockets received from the running process; each is taken at
/// most once by the listener (or admin server) that matches it.
#[derive(Debug, Default)]
pub struct Inherited {
    sockets: Vec<(SocketInfo, OwnedFd)>,
}

impl Inherited {
    /// The socket for `name` configured at `address`: same name and the
    /// same configured or bound address, or else any socket bound to
    /// `address` (not port 0).
    pub fn take(&mut self, name: &str, address: SocketAddr) -> Option<std::net::TcpListener> {
        let same_name =
            |i: &SocketInfo| i.name == name && (i.configured == address || i.local == address);
        let same_addr = |i: &SocketInfo| address.port() != 0 && i.local == address;
        let at = self
            .sockets
            .iter()
            .position(|(i, _)| same_name(i))
            .or_else(|| self.sockets.iter().position(|(i, _)| same_addr(i)))?;
        let (_, fd) = self.sockets.swap_remove(at);
        Some(std::net::TcpListener::from(fd))
    }

    /// How many sockets nobody took (closed when this is dropped).
    pub fn left(&self) -> usize {
        self.sockets.len()
    }
}

/// Takes the running process's sockets from `path` (the new side).
/// Returns them and the connection to answer [`ready`] on.
pub fn receive(path: &Path) -> Result<(Inherited, UnixStream), HandoffError> {
    let io = |source| HandoffError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut stream = UnixStream::connect(path).map_err(io)?;
    stream.set_read_timeout(Some(HANDOFF_TIMEOUT)).map_err(io)?;
    let mut head = vec![0u8; 64 * 1024];
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_SOCKETS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        &stream,
        &mut [IoSliceMut::new(&mut head)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )
    .map_err(|e| io(e.into()))?;
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    let header = read_header(&mut stream, &mut head, got.bytes).map_err(io)?;
    if header.sockets.len() != fds.len() {
        return Err(HandoffError::Protocol(format!(
            "{} sockets described, {} received",
            header.sockets.len(),
            fds.len()
        )));
    }
    let sockets = header.sockets.into_iter().zip(fds).collect();
    Ok((Inherited { sockets }, stream))
}

/// The header: a 4-byte big-endian length, then that much JSON; `head`
/// holds the first `got` bytes, the rest is read from `stream`.
fn read_header(stream: &mut UnixStream, head: &mut Vec<u8>, got: usize) -> std::io::Result<Header> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned());
    head.truncate(got);
    while head.len() < 4 {
        let mut b = [0u8; 1];
        stream.read_exact(&mut b)?;
        head.push(b[0]);
    }
    let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
    if len > 1 << 20 {
        return Err(bad("header too long"));
    }
    let have = head.len() - 4;
    if have < len {
        let mut rest = vec![0u8; len - have];
        stream.read_exact(&mut rest)?;
        head.extend_from_slice(&rest);
    }
    serde_json::from_slice(&head[4..4 + len]).map_err(|e| bad(&e.to_string()))
}

/// Tells the running process that the new one accepts now: it stops.
pub fn ready(mut stream: UnixStream) -> std::io::Result<()> {
    stream.write_all(READY)?;
    stream.flush()
}

/// Sends `sockets` on `stream` (the running side), then waits up to
/// [`HANDOFF_TIMEOUT`] for the new process's `ready`. `Ok(true)`: it is
/// ready, stop accepting; `Ok(false)`: it went away before (keep serving);
/// an error (`WouldBlock`/`TimedOut` when it said nothing in time): keep
/// serving.
pub fn send(
    stream: &mut UnixStream,
    sockets: &[(SocketInfo, BorrowedFd<'_>)],
) -> std::io::Result<bool> {
    send_within(stream, sockets, HANDOFF_TIMEOUT)
}

/// As [`send`], waiting up to `wait` for `ready`.
pub fn send_within(
    stream: &mut UnixStream,
    sockets: &[(SocketInfo, BorrowedFd<'_>)],
    wait: std::time::Duration,
) -> std::io::Result<bool> {
    stream.set_read_timeout(Some(wait))?;
    if sockets.len() > MAX_SOCKETS {
        return Err(std::io::Error::other(format!(
            "more than {MAX_SOCKETS} listening sockets"
        )));
    }
    let header = Header {
        sockets: sockets.iter().map(|(i, _)| i.clone()).collect(),
    };
    let json = serde_json::to_vec(&header).map_err(std::io::Error::other)?;
    let mut bytes = u32::try_from(json.len())
        .map_err(std::io::Error::other)?
        .to_be_bytes()
        .to_vec();
    bytes.extend_from_slice(&json);
    let fds: Vec<BorrowedFd<'_>> = sockets.iter().map(|(_, fd)| *fd).collect();
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other("ancillary buffer too small"));
    }
    let sent = rustix::net::sendmsg(
        stream.as_fd(),
        &[IoSlice::new(&bytes)],
        &mut control,
        SendFlags::empty(),
    )?;
    stream.write_all(&bytes[sent..])?;
    let mut answer = Vec::new();
    stream.take(READY.len() as u64).read_to_end(&mut answer)?;
    Ok(answer == READY)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn sockets_pass_between_two_ends_and_are_matched_by_name_or_address() {
        let dir = std::env::temp_dir().join(format!("meshless-handoff-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        let server = std::os::unix::net::UnixListener::bind(&dir).unwrap();
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let (la, lb) = (a.local_addr().unwrap(), b.local_addr().unwrap());
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let old = std::thread::spawn(move || {
            let (mut s, _) = server.accept().unwrap();
            let infos = [
                (
                    SocketInfo {
                        name: "a".into(),
                        configured: any,
                        local: la,
                    },
                    a.as_fd(),
                ),
                (
                    SocketInfo {
                        name: "b".into(),
                        configured: lb,
                        local: lb,
                    },
                    b.as_fd(),
                ),
            ];
            send(&mut s, &infos).unwrap()
        });
        let (mut inherited, stream) = receive(&dir).unwrap();
        // `b` by its bound address under another name; `a` by name and port 0.
        let got_b = inherited.take("renamed", lb).unwrap();
        assert_eq!(got_b.local_addr().unwrap(), lb);
        assert!(inherited.take("other", any).is_none());
        let got_a = inherited.take("a", any).unwrap();
        assert_eq!(got_a.local_addr().unwrap(), la);
        assert_eq!(inherited.left(), 0);
        // The received socket accepts connections made to the address.
        let client = std::net::TcpStream::connect(la).unwrap();
        let (accepted, _) = got_a.accept().unwrap();
        assert_eq!(accepted.peer_addr().unwrap(), client.local_addr().unwrap());
        ready(stream).unwrap();
        assert!(old.join().unwrap());
        let _ = std::fs::remove_file(&dir);
    }

    /// A new process that takes the sockets and never says `ready` (stuck
    /// in its start) fails the hand-over after the wait, instead of
    /// holding the running process forever (review 9, E1).
    #[test]
    fn a_peer_that_never_says_ready_fails_the_hand_over_after_the_wait() {
        let (mut old, new) = UnixStream::pair().unwrap();
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let local = a.local_addr().unwrap();
        let info = SocketInfo {
            name: "a".into(),
            configured: local,
            local,
        };
        let wait = std::time::Duration::from_millis(100);
        let e = send_within(&mut old, &[(info, a.as_fd())], wait).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "{e}"
        );
        drop(new);
    }
}
