//! The write benchmark: a real control plane (a child process) with a data
//! directory, so every acknowledged write is durable, and N concurrent
//! registration clients. Each writer registers its own endpoints (with a
//! TTL) one write at a time, then renews them; reports acknowledged writes
//! per second, renewals per second, the store transactions the writes
//! took (group commit) and the control plane's CPU per write.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use meshless_control::api::{EndpointInput, ServiceInput, ServicePort};
use meshless_control::client::ApiClient;
use serde::Serialize;

use crate::BenchError;
use crate::process::{ChildGuard, free_ports, proc_cpu_seconds};

/// Writes each writer makes (one endpoint each).
pub const WRITES_PER_WRITER: usize = 100;
/// Times each writer renews each of its endpoints.
pub const RENEWALS_PER_ENDPOINT: usize = 4;

const SERVICE: &str = "bench/writes";

/// What the write benchmark measured.
#[derive(Debug, Serialize)]
pub struct WriteBenchReport {
    pub writers: usize,
    pub writes: usize,
    pub writes_per_second: f64,
    pub renewals: usize,
    pub renewals_per_second: f64,
    /// Store transactions (one fsync each) the writes took.
    pub commit_groups: u64,
    pub control_cpu_us_per_write: f64,
}

impl fmt::Display for WriteBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "durable writes            {} by {} writers: {:.0} /s in {} commits ({:.0} µs CPU each)",
            self.writes,
            self.writers,
            self.writes_per_second,
            self.commit_groups,
            self.control_cpu_us_per_write
        )?;
        write!(
            f,
            "renewals                  {}: {:.0} /s",
            self.renewals, self.renewals_per_second
        )
    }
}

/// Reads a counter from the control plane's metrics.
async fn counter(api: &ApiClient, name: &str) -> Result<u64, BenchError> {
    let text = api.metrics().await?;
    let prefix = format!("{name} ");
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0))
}

fn input(writer: usize, k: usize) -> EndpointInput {
    let n = writer * WRITES_PER_WRITER + k;
    let ip = Ipv4Addr::new(10, 200 + (n >> 16) as u8, (n >> 8) as u8, n as u8);
    EndpointInput {
        ttl_seconds: Some(600),
        starting: false,
        ..EndpointInput::new(format!("w{writer}-{k}"), IpAddr::V4(ip), 8080)
    }
}

/// Runs `call(w)` for every writer `w` at once; returns the time all took.
async fn concurrently<F, Fut>(writers: usize, call: F) -> Result<Duration, BenchError>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<(), BenchError>> + Send + 'static,
{
    let start = Instant::now();
    let tasks: Vec<_> = (0..writers).map(|w| tokio::spawn(call(w))).collect();
    for t in tasks {
        t.await
            .map_err(|e| BenchError::Failed(format!("writer task: {e}")))??;
    }
    Ok(start.elapsed())
}

/// Starts a durable control plane, runs the writers, then the renewals.
pub async fn run(exe: &std::path::Path, writers: usize) -> Result<WriteBenchReport, BenchError> {
    let (api_addr, grpc) = free_ports()?;
    let dir: PathBuf =
        std::env::temp_dir().join(format!("meshless-bench-writes-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(BenchError::io("creating the work directory"))?;
    let config = dir.join("control.yaml");
    let data = dir.join("data");
    std::fs::write(
        &config,
        format!(
            "api_address: \"{api_addr}\"\ngrpc_address: \"{grpc}\"\ndata_dir: \"{}\"\n",
            data.display()
        ),
    )
    .map_err(BenchError::io("writing the control plane's config"))?;
    let child = Command::new(exe)
        .args(["control", "--config"])
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(BenchError::io("starting the control plane"))?;
    let child = ChildGuard(child);
    let api = ApiClient::new(api_addr);
    let start = Instant::now();
    while api.ready().await.is_err() {
        if start.elapsed() > Duration::from_secs(10) {
            return Err(BenchError::Failed("the control plane did not start".into()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ports = vec![ServicePort::tcp(80)];
    api.put_service(
        SERVICE,
        &ServiceInput {
            ports,
            ..ServiceInput::default()
        },
    )
    .await?;
    let pid = child.0.id();
    let groups0 = counter(&api, "meshless_control_commit_groups_total").await?;
    let cpu0 = proc_cpu_seconds(pid);
    let write_time = concurrently(writers, move |w| async move {
        let api = ApiClient::new(api_addr);
        for k in 0..WRITES_PER_WRITER {
            api.put_endpoint(SERVICE, &input(w, k)).await?;
        }
        Ok(())
    })
    .await?;
    let cpu = proc_cpu_seconds(pid) - cpu0;
    let groups = counter(&api, "meshless_control_commit_groups_total").await? - groups0;
    let renew_time = concurrently(writers, move |w| async move {
        let api = ApiClient::new(api_addr);
        for _ in 0..RENEWALS_PER_ENDPOINT {
            for k in 0..WRITES_PER_WRITER {
                api.renew(SERVICE, &format!("w{w}-{k}")).await?;
            }
        }
        Ok(())
    })
    .await?;
    drop(child);
    let _ = std::fs::remove_dir_all(&dir);
    let writes = writers * WRITES_PER_WRITER;
    let renewals = writes * RENEWALS_PER_ENDPOINT;
    Ok(WriteBenchReport {
        writers,
        writes,
        writes_per_second: writes as f64 / write_time.as_secs_f64(),
        renewals,
        renewals_per_second: renewals as f64 / renew_time.as_secs_f64(),
        commit_groups: groups,
        control_cpu_us_per_write: cpu * 1e6 / writes as f64,
    })
}
