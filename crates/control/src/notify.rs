//! The receiving side of the systemd notification protocol
//! (`sd_notify(3)`): the process scaler binds one Unix datagram socket per
//! instance and hands its path to the instance in `NOTIFY_SOCKET`; the
//! instance sends `READY=1` once it can take requests. Readiness is then
//! pushed, not polled: the scaler marks the endpoint ready the moment the
//! datagram arrives.
//!
//! A datagram is a newline-separated list of `KEY=VALUE` assignments
//! (UTF-8; keys non-empty, `A-Z`, `0-9` and `_`). One that is not is
//! ignored and counted; assignments other than `READY=1` (`STATUS=`,
//! `MAINPID=`, ...) are valid and have no effect. The socket lives as long
//! as the instance (an instance may notify after the probe saw it), and
//! its file is removed when the [`NotifySocket`] is dropped.
//!
//! Each socket lives alone in a directory of its own with a random name
//! and mode 0700 (made by `tempfile`, as `mkdtemp(3)` does), in `TMPDIR`:
//! another user can neither guess the path, take it first, nor send on
//! it; the path reaches only the instance, in its environment.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use prometheus_client::metrics::counter::Counter;
use tokio::net::UnixDatagram;

/// The largest datagram read; systemd reads at most 4096 bytes per message
/// too. A longer one is truncated and then fails to parse or is seen by
/// its first part only.
const MAX_DATAGRAM: usize = 4096;

/// What one datagram says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    /// Valid, and one of its assignments is `READY=1`.
    Ready,
    /// Valid assignments, none of them `READY=1`.
    Other,
    /// Not a list of assignments: ignored and counted.
    Invalid,
}

fn valid_key(key: &str) -> bool {
    !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
}

/// Parses one datagram of the notification protocol.
pub fn parse(datagram: &[u8]) -> Message {
    let Ok(text) = std::str::from_utf8(datagram) else {
        return Message::Invalid;
    };
    let mut ready = false;
    let mut any = false;
    for line in text.split('\n').filter(|l| !l.is_empty()) {
        let Some((key, value)) = line.split_once('=') else {
            return Message::Invalid;
        };
        if !valid_key(key) {
            return Message::Invalid;
        }
        any = true;
        ready |= key == "READY" && value == "1";
    }
    match (any, ready) {
        (false, _) => Message::Invalid,
        (true, true) => Message::Ready,
        (true, false) => Message::Other,
    }
}

/// Counters of the notification sockets (clones of registered metrics).
#[derive(Debug, Clone, Default)]
pub struct NotifyCounters {
    /// `READY=1` datagrams received.
    pub ready: Counter,
    /// Datagrams ignored because they do not parse.
    pub ignored: Counter,
}

/// One instance's notification socket. Until `READY=1` it is read by
/// [`NotifySocket::ready`] itself, on the task waiting for readiness (no
/// task hand-off between the datagram and that task); from then on, or
/// once [`NotifySocket::keep_reading`] is called, by a background task, so
/// later datagrams are still read and counted.
#[derive(Debug)]
pub struct NotifySocket {
    path: PathBuf,
    /// The private directory holding the socket; removed on drop.
    _dir: tempfile::TempDir,
    /// `None` once handed to the background task.
    socket: Option<UnixDatagram>,
    counters: NotifyCounters,
    /// `READY=1` was read.
    is_ready: bool,
    /// Reused by every read of [`NotifySocket::ready`].
    buf: Vec<u8>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl NotifySocket {
    /// Binds a fresh socket in a private directory of its own in the
    /// temporary directory. Call within a Tokio runtime.
    pub fn bind(counters: NotifyCounters) -> std::io::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("meshless-notify-")
            .tempdir()?;
        // 0700 whatever the umask: only this user reaches the socket.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))?;
        let path = dir.path().join("notify.sock");
        let socket = UnixDatagram::bind(&path)?;
        Ok(Self {
            path,
            _dir: dir,
            socket: Some(socket),
            counters,
            is_ready: false,
            buf: Vec::new(),
            task: None,
        })
    }

    /// The path handed to the instance in `NOTIFY_SOCKET`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Resolves once the instance sent `READY=1` (never if it does not, or
    /// if reading was handed to the background task first). Cancel-safe:
    /// a datagram is consumed only by a read that completes.
    pub async fn ready(&mut self) {
        while !self.is_ready {
            let Some(socket) = &self.socket else {
                return std::future::pending().await;
            };
            self.buf.resize(MAX_DATAGRAM, 0);
            let Ok(n) = socket.recv(&mut self.buf).await else {
                return std::future::pending().await;
            };
            self.is_ready = count(&self.buf[..n], &self.counters);
        }
        self.keep_reading();
    }

    /// Hands the socket to a background task that reads (and counts) what
    /// the instance sends from now on. Call within a Tokio runtime.
    pub fn keep_reading(&mut self) {
        if let Some(socket) = self.socket.take() {
            self.buf = Vec::new();
            let counters = self.counters.clone();
            self.task = Some(tokio::spawn(read(socket, counters)));
        }
    }
}

impl Drop for NotifySocket {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
        // The directory goes with `_dir`, after this.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Counts one datagram; true if it says `READY=1`.
fn count(datagram: &[u8], counters: &NotifyCounters) -> bool {
    match parse(datagram) {
        Message::Ready => {
            counters.ready.inc();
            true
        }
        Message::Other => false,
        Message::Invalid => {
            counters.ignored.inc();
            tracing::debug!(bytes = datagram.len(), "notify socket: datagram ignored");
            false
        }
    }
}

async fn read(socket: UnixDatagram, counters: NotifyCounters) {
    let mut buf = vec![0u8; MAX_DATAGRAM];
    while let Ok(n) = socket.recv(&mut buf).await {
        count(&buf[..n], &counters);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[tokio::test]
    async fn each_socket_is_alone_in_a_private_directory_removed_with_it() {
        let a = NotifySocket::bind(NotifyCounters::default()).expect("bind");
        let b = NotifySocket::bind(NotifyCounters::default()).expect("bind");
        let dir = a.path().parent().expect("dir").to_path_buf();
        assert_ne!(Some(dir.as_path()), b.path().parent());
        let mode = std::fs::metadata(&dir).expect("dir").permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "{mode:o}");
        assert_eq!(std::fs::read_dir(&dir).expect("list").count(), 1);
        drop(a);
        assert!(!dir.exists(), "{} left behind", dir.display());
    }

    #[test]
    fn messages_of_the_protocol() {
        assert_eq!(parse(b"READY=1"), Message::Ready);
        assert_eq!(parse(b"STATUS=listening\nREADY=1\n"), Message::Ready);
        assert_eq!(parse(b"READY=0"), Message::Other);
        assert_eq!(parse(b"STATUS=starting"), Message::Other);
        assert_eq!(parse(b""), Message::Invalid);
        assert_eq!(parse(b"\xff\xfeREADY=1"), Message::Invalid);
        assert_eq!(parse(b"hello"), Message::Invalid);
        assert_eq!(parse(b"ready=1"), Message::Invalid);
        assert_eq!(parse(b"=1"), Message::Invalid);
    }

    fn assignment() -> impl Strategy<Value = String> {
        ("[A-Z_][A-Z0-9_]{0,8}", "[ -~]{0,12}").prop_map(|(k, v)| format!("{k}={v}"))
    }

    proptest! {
        /// sd_notify(3): a newline-separated list of assignments; it
        /// announces readiness exactly when one of them is `READY=1`.
        #[test]
        fn a_list_of_assignments_is_ready_iff_it_holds_ready_1(
            lines in prop::collection::vec(assignment(), 1..6),
        ) {
            let text = lines.join("\n");
            let expected = if lines.iter().any(|l| l == "READY=1") { Message::Ready } else { Message::Other };
            prop_assert_eq!(parse(text.as_bytes()), expected);
        }

        #[test]
        fn any_bytes_parse_without_panicking(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = parse(&bytes);
        }
    }

    #[tokio::test]
    async fn ready_arrives_and_garbage_is_counted() {
        let counters = NotifyCounters::default();
        let mut socket = NotifySocket::bind(counters.clone()).expect("bind");
        let path = socket.path().to_owned();
        let sender = UnixDatagram::unbound().expect("unbound");
        sender.send_to(b"\xff\x00junk", &path).await.expect("send");
        sender
            .send_to(b"STATUS=warming up", &path)
            .await
            .expect("send");
        sender.send_to(b"READY=1", &path).await.expect("send");
        socket.ready().await;
        // Datagrams are read in order: the garbage was counted first.
        assert_eq!((counters.ready.get(), counters.ignored.get()), (1, 1));
        // Ready stays ready; what comes later is still read and counted.
        socket.ready().await;
        sender.send_to(b"junk", &path).await.expect("send");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while counters.ignored.get() < 2 {
            assert!(std::time::Instant::now() < deadline, "read after ready");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        drop(socket);
        assert!(!path.exists(), "the socket file is removed");
    }
}
