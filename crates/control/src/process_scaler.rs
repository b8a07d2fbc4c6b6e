//! The process scaler: runs one OS process per instance of a service, with
//! its port in an environment variable; knows an instance is ready when its
//! port accepts a connection (probed every few milliseconds); stops
//! instances with SIGTERM, then SIGKILL after a grace period.
//!
//! Driven by [`crate::scaling`], which registers the instances as endpoints
//! and replaces those that exit on their own, with backoff.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::process::{Child, Command};

/// How to run one instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessSpec {
    /// Program and arguments; `{port}` in an argument is replaced by the
    /// port, and `{meshless}` by the path of the running meshless binary.
    pub command: Vec<String>,
    /// Extra environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory.
    #[serde(default)]
    pub working_dir: Option<PathBuf>,
    /// Environment variable that carries the instance's port.
    #[serde(default = "default_port_env")]
    pub port_env: String,
    /// After SIGTERM, SIGKILL follows this much later.
    #[serde(
        default = "default_stop_grace",
        with = "meshless_model::serde_duration"
    )]
    pub stop_grace: Duration,
    /// How often a starting instance's port is probed.
    #[serde(
        default = "default_probe_interval",
        with = "meshless_model::serde_duration"
    )]
    pub probe_interval: Duration,
    /// An instance not accepting connections by then has failed to start.
    #[serde(
        default = "default_start_timeout",
        with = "meshless_model::serde_duration"
    )]
    pub start_timeout: Duration,
}

fn default_port_env() -> String {
    "PORT".into()
}
fn default_stop_grace() -> Duration {
    Duration::from_secs(10)
}
fn default_probe_interval() -> Duration {
    Duration::from_millis(5)
}
fn default_start_timeout() -> Duration {
    Duration::from_secs(30)
}

/// Why an instance could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("command: must not be empty")]
    EmptyCommand,
    #[error("no free port: {0}")]
    Port(std::io::Error),
    #[error("command {program:?}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("instance {id} exited before accepting connections ({status})")]
    Exited { id: String, status: String },
    #[error("instance {id} did not accept connections within {timeout:?}")]
    StartTimeout { id: String, timeout: Duration },
}

/// One running instance.
#[derive(Debug)]
pub struct Instance {
    pub id: String,
    pub address: SocketAddr,
    pub started: Instant,
    child: Child,
}

impl Instance {
    /// Waits for the process to exit.
    pub async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        self.child.wait().await
    }

    /// The OS process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }
}

fn free_port(host: IpAddr) -> Result<u16, ProcessError> {
    std::net::TcpListener::bind((host, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(ProcessError::Port)
}

/// Spawns one instance named `id`, on a free port of 127.0.0.1.
pub fn spawn(spec: &ProcessSpec, id: &str) -> Result<Instance, ProcessError> {
    let (program, args) = spec
        .command
        .split_first()
        .ok_or(ProcessError::EmptyCommand)?;
    let program = if program == "{meshless}" {
        std::env::current_exe()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| "meshless".to_owned())
    } else {
        program.clone()
    };
    let host = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let port = free_port(host)?;
    let mut cmd = Command::new(&program);
    cmd.args(args.iter().map(|a| a.replace("{port}", &port.to_string())))
        .envs(&spec.env)
        .env(&spec.port_env, port.to_string())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    if let Some(dir) = &spec.working_dir {
        cmd.current_dir(dir);
    }
    let child = cmd.spawn().map_err(|source| ProcessError::Spawn {
        program: program.clone(),
        source,
    })?;
    Ok(Instance {
        id: id.to_owned(),
        address: SocketAddr::new(host, port),
        started: Instant::now(),
        child,
    })
}

/// Probes the instance's port every `probe_interval` until it accepts a
/// connection; fails at once if the process exits, or at `start_timeout`.
/// Returns the time from spawn to the first accepted connection.
pub async fn wait_ready(
    spec: &ProcessSpec,
    instance: &mut Instance,
) -> Result<Duration, ProcessError> {
    let deadline = instance.started + spec.start_timeout;
    loop {
        if tokio::net::TcpStream::connect(instance.address)
            .await
            .is_ok()
        {
            return Ok(instance.started.elapsed());
        }
        if let Ok(Some(status)) = instance.child.try_wait() {
            return Err(ProcessError::Exited {
                id: instance.id.clone(),
                status: status.to_string(),
            });
        }
        if Instant::now() >= deadline {
            return Err(ProcessError::StartTimeout {
                id: instance.id.clone(),
                timeout: spec.start_timeout,
            });
        }
        tokio::time::sleep(spec.probe_interval).await;
    }
}

/// SIGTERM, then SIGKILL after `grace` if the process is still running.
/// Returns true when it stopped within the grace period.
pub async fn stop(mut instance: Instance, grace: Duration) -> bool {
    let Some(pid) = instance.pid() else {
        return true;
    };
    // `kill -TERM` avoids unsafe code for the signal.
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await;
    match tokio::time::timeout(grace, instance.child.wait()).await {
        Ok(_) => true,
        Err(_) => {
            let _ = instance.child.kill().await;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny server in Python (on every Debian machine CI runs on).
    fn server_spec(extra: &str) -> ProcessSpec {
        ProcessSpec {
            command: vec![
                "python3".into(),
                "-c".into(),
                format!(
                    "import os, socket, time\n{extra}\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('127.0.0.1', int(os.environ['PORT'])))\ns.listen()\nwhile True:\n    c, _ = s.accept()\n    c.close()\n"
                ),
            ],
            env: BTreeMap::new(),
            working_dir: None,
            port_env: "PORT".into(),
            stop_grace: Duration::from_secs(2),
            probe_interval: Duration::from_millis(5),
            start_timeout: Duration::from_secs(10),
        }
    }

    #[tokio::test]
    async fn starts_probes_and_stops_an_instance() {
        let spec = server_spec("time.sleep(0.2)");
        let mut inst = spawn(&spec, "svc-0").expect("spawn");
        let took = wait_ready(&spec, &mut inst).await.expect("ready");
        assert!(took >= Duration::from_millis(200), "{took:?}");
        let addr = inst.address;
        assert!(
            stop(inst, Duration::from_secs(2)).await,
            "stopped by SIGTERM"
        );
        assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    }

    #[tokio::test]
    async fn an_instance_that_exits_fails_at_once() {
        let spec = server_spec("raise SystemExit(3)");
        let mut inst = spawn(&spec, "svc-1").expect("spawn");
        let err = wait_ready(&spec, &mut inst).await.expect_err("exits");
        assert!(matches!(err, ProcessError::Exited { .. }), "{err}");
    }

    #[tokio::test]
    async fn sigkill_follows_an_ignored_sigterm() {
        let spec = server_spec("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)");
        let mut inst = spawn(&spec, "svc-2").expect("spawn");
        wait_ready(&spec, &mut inst).await.expect("ready");
        assert!(
            !stop(inst, Duration::from_millis(300)).await,
            "needed SIGKILL"
        );
    }
}
