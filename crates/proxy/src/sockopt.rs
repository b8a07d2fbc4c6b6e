//! `socket:` options of a listener's sockets (the listening one and every
//! accepted one) and of a cluster's upstream connections.
//!
//! Envoy: `socket_options`, `per_connection_buffer_limit_bytes`,
//! `tcp_keepalive`, `enable_reuse_port`; HAProxy: `tcp-ut`, `tfo`,
//! `option tcpka`, `tune.rcvbuf.*`/`tune.sndbuf.*`, `cc` on a `bind` line.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use meshless_model::FieldError;
use meshless_model::serde_duration as duration;
use serde::{Deserialize, Serialize};
use socket2::{Domain, SockRef, Socket, TcpKeepalive, Type};
use tokio::net::{TcpListener, TcpStream};

/// Where the kernel lists the congestion-control algorithms it offers.
pub const AVAILABLE_CONGESTION_CONTROL: &str =
    "/proc/sys/net/ipv4/tcp_available_congestion_control";

/// Socket options; absent fields leave the kernel's defaults.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SocketOptions {
    /// `TCP_NODELAY`: send small writes at once (no Nagle delay).
    #[serde(default = "default_tcp_nodelay")]
    pub tcp_nodelay: bool,
    /// `SO_KEEPALIVE` probes; absent = off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keepalive: Option<Keepalive>,
    /// `SO_SNDBUF` in bytes (the kernel doubles it for bookkeeping).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub send_buffer_bytes: Option<u32>,
    /// `SO_RCVBUF` in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recv_buffer_bytes: Option<u32>,
    /// `TCP_CONGESTION`, e.g. `bbr`: one the kernel offers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub congestion_control: Option<String>,
    /// `SO_REUSEPORT` (listeners only): several listeners, in this or
    /// other processes, bind the same address and the kernel spreads
    /// connections over them.
    #[serde(default)]
    pub reuse_port: bool,
}

impl Default for SocketOptions {
    fn default() -> Self {
        Self {
            tcp_nodelay: default_tcp_nodelay(),
            keepalive: None,
            send_buffer_bytes: None,
            recv_buffer_bytes: None,
            congestion_control: None,
            reuse_port: false,
        }
    }
}

fn default_tcp_nodelay() -> bool {
    true
}

/// `socket.keepalive:` TCP keep-alive probes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Keepalive {
    /// Idle time before the first probe (`TCP_KEEPIDLE`).
    #[serde(default = "default_keepalive_time", with = "duration")]
    pub time: Duration,
    /// Time between probes (`TCP_KEEPINTVL`).
    #[serde(default = "default_keepalive_interval", with = "duration")]
    pub interval: Duration,
    /// Unanswered probes before the connection is dropped (`TCP_KEEPCNT`).
    #[serde(default = "default_keepalive_probes")]
    pub probes: u32,
}

fn default_keepalive_time() -> Duration {
    Duration::from_secs(300)
}
fn default_keepalive_interval() -> Duration {
    Duration::from_secs(75)
}
fn default_keepalive_probes() -> u32 {
    9
}

impl SocketOptions {
    /// Checks ranges and that the kernel offers `congestion_control`
    /// (read from `available`, the contents of
    /// [`AVAILABLE_CONGESTION_CONTROL`]; `None` when it cannot be read).
    pub fn validate(&self, listener: bool, available: Option<&str>) -> Result<(), FieldError> {
        if self.reuse_port && !listener {
            return Err(FieldError::new("reuse_port", "only for listeners"));
        }
        for (field, v) in [
            ("send_buffer_bytes", self.send_buffer_bytes),
            ("recv_buffer_bytes", self.recv_buffer_bytes),
        ] {
            if v.is_some_and(|v| v < 1024) {
                return Err(FieldError::new(field, "must be at least 1024"));
            }
        }
        if let Some(k) = &self.keepalive
            && (k.time.as_secs() == 0 || k.interval.as_secs() == 0 || k.probes == 0)
        {
            return Err(FieldError::new(
                "keepalive",
                "time and interval must be at least 1s, probes at least 1",
            ));
        }
        if let Some(cc) = &self.congestion_control {
            let Some(available) = available else {
                return Err(FieldError::new(
                    "congestion_control",
                    format!(
                        "cannot read {AVAILABLE_CONGESTION_CONTROL}: this kernel offers no choice"
                    ),
                ));
            };
            if !available.split_whitespace().any(|a| a == cc) {
                return Err(FieldError::new(
                    "congestion_control",
                    format!(
                        "{cc:?} is not offered by this kernel (it offers: {}); load its module (e.g. `modprobe tcp_{cc}`) or pick another",
                        available.trim()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Applies the per-connection options to a connected or accepted socket.
    pub fn apply(&self, socket: SockRef<'_>) -> io::Result<()> {
        socket.set_tcp_nodelay(self.tcp_nodelay)?;
        if let Some(k) = &self.keepalive {
            let params = TcpKeepalive::new()
                .with_time(k.time)
                .with_interval(k.interval)
                .with_retries(k.probes);
            socket.set_tcp_keepalive(&params)?;
        }
        self.apply_buffers(&socket)
    }

    /// Buffers and congestion control: also set on a listening socket,
    /// so that accepted sockets inherit them from the handshake on.
    fn apply_buffers(&self, socket: &Socket) -> io::Result<()> {
        if let Some(n) = self.send_buffer_bytes {
            socket.set_send_buffer_size(n as usize)?;
        }
        if let Some(n) = self.recv_buffer_bytes {
            socket.set_recv_buffer_size(n as usize)?;
        }
        if let Some(cc) = &self.congestion_control {
            socket.set_tcp_congestion(cc.as_bytes())?;
        }
        Ok(())
    }

    /// A listening socket on `address` with these options.
    pub fn bind(&self, address: SocketAddr) -> io::Result<TcpListener> {
        let socket = Socket::new(Domain::for_address(address), Type::STREAM, None)?;
        socket.set_reuse_address(true)?;
        if self.reuse_port {
            socket.set_reuse_port(true)?;
        }
        if address.is_ipv6() {
            socket.set_only_v6(true)?;
        }
        self.apply_buffers(&socket)?;
        socket.bind(&address.into())?;
        socket.listen(1024)?;
        socket.set_nonblocking(true)?;
        TcpListener::from_std(socket.into())
    }

    /// A connection to `address` with these options, within `timeout`.
    pub async fn connect(&self, address: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
        let socket = Socket::new(Domain::for_address(address), Type::STREAM, None)?;
        socket.set_nonblocking(true)?;
        self.apply_buffers(&socket)?;
        let socket = tokio::net::TcpSocket::from_std_stream(socket.into());
        let stream = tokio::time::timeout(timeout, socket.connect(address))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timeout"))??;
        self.apply(SockRef::from(&stream))?;
        Ok(stream)
    }
}

/// What this kernel offers, or `None` where it cannot be read.
pub fn available_congestion_control() -> Option<String> {
    std::fs::read_to_string(AVAILABLE_CONGESTION_CONTROL).ok()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn congestion_control_must_be_offered() {
        let o = SocketOptions {
            congestion_control: Some("bbr".into()),
            ..SocketOptions::default()
        };
        assert!(o.validate(true, Some("reno cubic bbr\n")).is_ok());
        let e = o.validate(true, Some("reno cubic\n")).unwrap_err();
        assert_eq!(e.path, "congestion_control");
        assert!(e.reason.contains("offers: reno cubic"), "{}", e.reason);
        assert!(o.validate(true, None).is_err());
        let r = SocketOptions {
            reuse_port: true,
            ..SocketOptions::default()
        };
        assert_eq!(r.validate(false, None).unwrap_err().path, "reuse_port");
    }

    #[tokio::test]
    async fn options_reach_the_sockets() {
        let o = SocketOptions {
            keepalive: Some(Keepalive {
                time: Duration::from_secs(30),
                interval: Duration::from_secs(5),
                probes: 3,
            }),
            recv_buffer_bytes: Some(64 * 1024),
            reuse_port: true,
            ..SocketOptions::default()
        };
        let l = o.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = l.local_addr().unwrap();
        let twin = o
            .bind(addr)
            .expect("a second SO_REUSEPORT listener on the same port");
        let c = o.connect(addr, Duration::from_secs(10)).await.unwrap();
        let s = SockRef::from(&c);
        assert!(s.tcp_nodelay().unwrap());
        assert!(s.keepalive().unwrap());
        assert_eq!(s.tcp_keepalive_time().unwrap(), Duration::from_secs(30));
        // Linux doubles the value asked for.
        assert!(s.recv_buffer_size().unwrap() >= 64 * 1024);
        // Congestion control, where the kernel offers a choice.
        if let Some(cc) = available_congestion_control()
            .and_then(|a| a.split_whitespace().next().map(str::to_owned))
        {
            let o = SocketOptions {
                congestion_control: Some(cc.clone()),
                ..SocketOptions::default()
            };
            o.validate(false, available_congestion_control().as_deref())
                .unwrap();
            let c = o.connect(addr, Duration::from_secs(10)).await.unwrap();
            let got = SockRef::from(&c).tcp_congestion().unwrap();
            let name: Vec<u8> = got.into_iter().take_while(|b| *b != 0).collect();
            assert_eq!(name, cc.as_bytes());
        }
        drop((l, twin));
    }
}
