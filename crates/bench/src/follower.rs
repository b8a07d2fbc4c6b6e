//! A real proxy process following the benchmark's service through the
//! control plane (one `service:` cluster with a given balancing policy, on
//! one thread), to measure what each change costs a proxy: its CPU time
//! over the changes, divided by the changes.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::BenchError;
use crate::process::{ChildGuard, free_ports, proc_cpu_seconds};

/// What one following proxy cost.
#[derive(Debug, Serialize)]
pub struct FollowerReport {
    pub policy: String,
    /// The proxy's CPU time over the changes, per change.
    pub cpu_ms_per_change: f64,
}

/// A running proxy process.
pub(crate) struct Follower {
    child: ChildGuard,
    admin: SocketAddr,
    pub(crate) policy: String,
    cpu0: f64,
}

impl Follower {
    /// Starts `meshless proxy --threads 1` following `service` on `grpc`.
    pub(crate) async fn start(
        exe: &Path,
        dir: &Path,
        grpc: SocketAddr,
        service: &str,
        policy: &str,
        merge_window_ms: Option<u64>,
    ) -> Result<Self, BenchError> {
        let merge = merge_window_ms
            .map(|ms| format!(", update_merge_window: {ms}ms"))
            .unwrap_or_default();
        let (admin, _) = free_ports()?;
        let config = dir.join(format!("proxy-{policy}.yaml"));
        std::fs::write(
            &config,
            format!(
                "admin: {{ address: \"{admin}\" }}\ncontrol: {{ address: \"{grpc}\"{merge} }}\nlisteners:\n  - name: web\n    address: \"127.0.0.1:0\"\n    routes: [{{ cluster: svc }}]\nclusters:\n  - name: svc\n    service: {service}\n    balancer: {{ policy: {policy} }}\n"
            ),
        )
        .map_err(BenchError::io("writing a proxy's config"))?;
        let child = Command::new(exe)
            .args(["proxy", "--threads", "1", "--config"])
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(BenchError::io("starting a proxy"))?;
        Ok(Self {
            child: ChildGuard(child),
            admin,
            policy: policy.to_owned(),
            cpu0: 0.0,
        })
    }

    /// The admin `/clusters` text, if the proxy answers.
    async fn clusters(&self) -> Option<String> {
        let mut s = tokio::net::TcpStream::connect(self.admin).await.ok()?;
        let req = format!("GET /clusters HTTP/1.0\r\nHost: {}\r\n\r\n", self.admin);
        s.write_all(req.as_bytes()).await.ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.ok()?;
        String::from_utf8(out).ok()
    }

    /// Waits until the proxy's cluster holds endpoint `id` (quoted in its JSON).
    pub(crate) async fn wait_for(&self, id: &str) -> Result<(), BenchError> {
        let start = Instant::now();
        let needle = format!("\"{id}\"");
        while !self.clusters().await.is_some_and(|c| c.contains(&needle)) {
            if start.elapsed() > Duration::from_secs(60) {
                return Err(BenchError::Failed(format!(
                    "the {} proxy never received {id}",
                    self.policy
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// Starts counting CPU from now.
    pub(crate) fn mark(&mut self) {
        self.cpu0 = proc_cpu_seconds(self.child.0.id());
    }

    /// CPU since [`Follower::mark`], per change.
    pub(crate) fn report(&self, changes: usize) -> FollowerReport {
        let cpu = proc_cpu_seconds(self.child.0.id()) - self.cpu0;
        FollowerReport {
            policy: self.policy.clone(),
            cpu_ms_per_change: cpu * 1000.0 / changes.max(1) as f64,
        }
    }
}
