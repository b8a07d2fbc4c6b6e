//! The benchmarks' child processes: a guard that kills one, free ports,
//! and its CPU time and memory from `/proc`.

use std::net::SocketAddr;
use std::process::Child;

use crate::BenchError;

/// Kills and reaps the child when dropped.
pub(crate) struct ChildGuard(pub(crate) Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Two distinct free ports (both held until both are chosen).
pub(crate) fn free_ports() -> Result<(SocketAddr, SocketAddr), BenchError> {
    let bind = || std::net::TcpListener::bind("127.0.0.1:0");
    let (a, b) = (bind(), bind());
    let addr = |l: std::io::Result<std::net::TcpListener>| l.and_then(|l| l.local_addr());
    Ok((
        addr(a).map_err(BenchError::io("choosing a free port"))?,
        addr(b).map_err(BenchError::io("choosing a free port"))?,
    ))
}

pub(crate) fn proc_cpu_seconds(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let f: Vec<&str> = s.rsplit_once(')')?.1.split_whitespace().collect();
            let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
            Some(ticks / 100.0)
        })
        .unwrap_or(0.0)
}

pub(crate) fn proc_kb(pid: u32, key: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0.0)
}
