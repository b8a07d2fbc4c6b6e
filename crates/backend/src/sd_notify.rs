//! The sending side of systemd's notification protocol (`sd_notify(3)`):
//! once the backend listens it sends `READY=1` to the Unix datagram
//! socket named by `NOTIFY_SOCKET`, so whoever started it (systemd, or the
//! meshless process scaler) knows at once, without probing its port. A
//! name starting with `@` is an abstract socket, as in systemd.

use std::os::unix::net::UnixDatagram;
use std::path::Path;

/// Sends `READY=1` to the notification socket at `path`.
pub fn notify_ready(path: &Path) -> std::io::Result<()> {
    send(path, b"READY=1\nSTATUS=listening")
}

fn send(path: &Path, message: &[u8]) -> std::io::Result<()> {
    let socket = UnixDatagram::unbound()?;
    let text = path.to_string_lossy();
    if let Some(name) = text.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        socket.send_to_addr(message, &addr)?;
    } else {
        socket.send_to(message, path)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_reaches_a_path_socket() {
        let path = std::env::temp_dir().join(format!("meshless-sdn-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let rx = UnixDatagram::bind(&path).expect("bind");
        notify_ready(&path).expect("send");
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).expect("recv");
        assert!(buf[..n].split(|b| *b == b'\n').any(|l| l == b"READY=1"));
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_missing_socket_is_an_error_not_a_panic() {
        assert!(notify_ready(Path::new("/nonexistent/meshless.sock")).is_err());
    }
}
