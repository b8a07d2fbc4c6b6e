//! The process scaler: runs one OS process per instance of a service, with
//! its port in an environment variable; knows an instance is ready when it
//! sends `READY=1` on the notification socket it is handed
//! (`NOTIFY_SOCKET`, [`crate::notify`]) or, for one that never notifies,
//! when its port accepts a connection (probed with a backoff from 200 µs to
//! `probe_interval`), whichever comes first (`readiness: first`, the
//! default; `readiness: notify` waits for `READY=1` alone); stops instances with SIGTERM,
//! then SIGKILL after a grace period. Each instance leads its own process
//! group, and signals go to the whole group ([`crate::process_group`]):
//! what a wrapper forks stops with it.
//!
//! Driven by [`crate::scaling`], which registers the instances as endpoints
//! and replaces those that exit on their own, with backoff.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use meshless_model::probe_backoff::ProbeBackoff;
use serde::{Deserialize, Serialize};
use tokio::process::{Child, Command};

use rustix::process::Signal;

use crate::notify::{NotifyCounters, NotifySocket};
use crate::process_group::{self, Group};

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
    /// Hand each instance a notification socket in `NOTIFY_SOCKET`
    /// (systemd's `READY=1` convention); the probe still runs beside it.
    #[serde(default = "default_notify")]
    pub notify: bool,
    /// What makes a starting instance ready: `first` (its `READY=1` or
    /// its port accepting, whichever comes first) or `notify` (its
    /// `READY=1` only, as systemd's `Type=notify`: for a program that
    /// listens before it can serve; its port is then probed by nobody,
    /// neither here nor by proxies).
    #[serde(default)]
    pub readiness: Readiness,
    /// The longest wait between probes of a starting instance's port
    /// (the waits start at 200 µs and double up to this).
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

impl ProcessSpec {
    /// Whether the instance's port may be probed for readiness (by the
    /// scaler, and by proxies holding requests).
    pub fn probed(&self) -> bool {
        self.readiness == Readiness::First
    }

    /// Checks what would start nothing, probe without a pause or give up
    /// at once; the error names the field.
    pub fn validate(&self) -> Result<(), meshless_model::FieldError> {
        use meshless_model::FieldError;
        if self.command.first().is_none_or(|p| p.is_empty()) {
            return Err(FieldError::new("command", "must name a program"));
        }
        if self.port_env.is_empty() || self.port_env.contains('=') {
            return Err(FieldError::new(
                "port_env",
                format!(
                    "must be an environment variable name, got {:?}",
                    self.port_env
                ),
            ));
        }
        meshless_model::probe_backoff::check_probe_interval(self.probe_interval)?;
        if self.start_timeout.is_zero() {
            return Err(FieldError::new("start_timeout", "must be above 0s"));
        }
        if self.readiness == Readiness::Notify && !self.notify {
            return Err(FieldError::new(
                "readiness",
                "`notify` needs `notify: true` (the instance's READY=1 is its only sign)",
            ));
        }
        Ok(())
    }
}

/// `readiness:` of a process instance.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Readiness {
    /// `READY=1` or the port accepting, whichever comes first.
    #[default]
    First,
    /// `READY=1` only.
    Notify,
}

fn default_port_env() -> String {
    "PORT".into()
}
fn default_notify() -> bool {
    true
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
    /// Its process group (its pid at spawn), SIGKILLed on drop unless
    /// [`stop`] saw it gone: nothing it started outlives it.
    group: Option<Group>,
    /// Its notification socket, kept for the instance's life.
    notify: Option<NotifySocket>,
}

impl Drop for Instance {
    fn drop(&mut self) {
        if let Some(g) = self.group.take() {
            g.signal(Signal::KILL);
        }
    }
}

/// How an instance was seen ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// It sent `READY=1` on its notification socket.
    Notify,
    /// Its port accepted a connection.
    Probe,
}

impl Via {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Via::Notify => "notify",
            Via::Probe => "probe",
        }
    }
}

/// A started instance's readiness.
#[derive(Debug, Clone, Copy)]
pub struct Ready {
    /// From spawn to ready.
    pub took: Duration,
    pub via: Via,
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

/// A notification socket for an instance, or none (disabled, or it
/// cannot be bound: the probe alone then tells readiness).
fn notify_socket(spec: &ProcessSpec, counters: &NotifyCounters) -> Option<NotifySocket> {
    if !spec.notify {
        return None;
    }
    NotifySocket::bind(counters.clone())
        .inspect_err(|e| tracing::warn!(error = %e, "no notification socket; probing only"))
        .ok()
}

/// Spawns one instance named `id`, on a free port of 127.0.0.1, with a
/// notification socket when `spec.notify`. Call within a Tokio runtime.
pub fn spawn(
    spec: &ProcessSpec,
    id: &str,
    counters: &NotifyCounters,
) -> Result<Instance, ProcessError> {
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
        .process_group(0)
        .kill_on_drop(true);
    if let Some(dir) = &spec.working_dir {
        cmd.current_dir(dir);
    }
    let notify = notify_socket(spec, counters);
    match &notify {
        Some(n) => cmd.env("NOTIFY_SOCKET", n.path()),
        None => cmd.env_remove("NOTIFY_SOCKET"),
    };
    let child = cmd.spawn().map_err(|source| ProcessError::Spawn {
        program: program.clone(),
        source,
    })?;
    let group = child.id().and_then(Group::led_by);
    Ok(Instance {
        id: id.to_owned(),
        address: SocketAddr::new(host, port),
        started: Instant::now(),
        child,
        group,
        notify,
    })
}

/// Resolves when `notify` announced readiness; never without a socket.
async fn notified(notify: Option<&mut NotifySocket>) {
    match notify {
        Some(n) => n.ready().await,
        None => std::future::pending().await,
    }
}

/// Waits for the instance to be ready: `READY=1` on its notification
/// socket, or (with `readiness: first`) its port accepting a connection
/// (probed with [`ProbeBackoff`] up to `probe_interval`), whichever comes
/// first; fails at once if the process exits, or at `start_timeout`.
pub async fn wait_ready(
    spec: &ProcessSpec,
    instance: &mut Instance,
) -> Result<Ready, ProcessError> {
    let deadline = instance.started + spec.start_timeout;
    let mut backoff = ProbeBackoff::new(spec.probe_interval);
    loop {
        if spec.probed()
            && tokio::net::TcpStream::connect(instance.address)
                .await
                .is_ok()
        {
            let took = instance.started.elapsed();
            // Its `READY=1`, if it comes, is still read and counted.
            if let Some(n) = instance.notify.as_mut() {
                n.keep_reading();
            }
            return Ok(Ready {
                took,
                via: Via::Probe,
            });
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
        tokio::select! {
            () = notified(instance.notify.as_mut()) => {
                let took = instance.started.elapsed();
                return Ok(Ready { took, via: Via::Notify });
            }
            () = tokio::time::sleep(backoff.next_wait()) => {}
        }
    }
}

/// SIGTERM to the instance's process group, then SIGKILL to the group
/// after `grace` if any process of it still runs (the leader, or anything
/// it started). Returns true when the whole group stopped within `grace`.
pub async fn stop(mut instance: Instance, grace: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + grace;
    let Some(group) = instance.group else {
        // No pid at spawn: it was already reaped.
        return true;
    };
    group.signal(Signal::TERM);
    let leader = tokio::time::timeout_at(deadline, instance.child.wait())
        .await
        .is_ok();
    let stopped = leader && process_group::wait_gone(group, deadline).await;
    if !stopped {
        tracing::warn!(instance = %instance.id, pgid = group.id(), ?grace, "instance still running after SIGTERM; SIGKILL");
        group.signal(Signal::KILL);
        let _ = instance.child.wait().await;
    }
    // Signalled with SIGKILL if needed: nothing left for the drop to do.
    instance.group = None;
    stopped
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
            notify: true,
            readiness: Readiness::First,
            probe_interval: Duration::from_millis(5),
            start_timeout: Duration::from_secs(10),
        }
    }

    #[tokio::test]
    async fn starts_probes_and_stops_an_instance() {
        let spec = server_spec("time.sleep(0.2)");
        let mut inst = spawn(&spec, "svc-0", &NotifyCounters::default()).expect("spawn");
        let ready = wait_ready(&spec, &mut inst).await.expect("ready");
        assert!(ready.took >= Duration::from_millis(200), "{ready:?}");
        assert_eq!(ready.via, Via::Probe, "it never notifies");
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
        let mut inst = spawn(&spec, "svc-1", &NotifyCounters::default()).expect("spawn");
        let err = wait_ready(&spec, &mut inst).await.expect_err("exits");
        assert!(matches!(err, ProcessError::Exited { .. }), "{err}");
    }

    #[tokio::test]
    async fn sigkill_follows_an_ignored_sigterm() {
        let spec = server_spec("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)");
        let mut inst = spawn(&spec, "svc-2", &NotifyCounters::default()).expect("spawn");
        wait_ready(&spec, &mut inst).await.expect("ready");
        assert!(
            !stop(inst, Duration::from_millis(300)).await,
            "needed SIGKILL"
        );
    }

    /// `sh` running the server of [`server_spec`] as its child (forked, not
    /// exec'd: `&` then `wait`), as wrappers do.
    fn wrapped_spec(extra: &str) -> ProcessSpec {
        let mut spec = server_spec(extra);
        let code = spec.command.pop().expect("the python code");
        spec.env.insert("SERVER".into(), code);
        spec.command = vec![
            "sh".into(),
            "-c".into(),
            "python3 -c \"$SERVER\" & wait".into(),
        ];
        spec
    }

    /// Polls until nothing accepts on `addr` (up to 20 s).
    async fn closes(addr: SocketAddr) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(addr).await.is_ok() {
            assert!(Instant::now() < deadline, "{addr} still accepts");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn stop_stops_what_the_instance_started() {
        let spec = wrapped_spec("");
        let mut inst = spawn(&spec, "svc-6", &NotifyCounters::default()).expect("spawn");
        wait_ready(&spec, &mut inst).await.expect("ready");
        let addr = inst.address;
        assert!(
            stop(inst, Duration::from_secs(10)).await,
            "the whole group stopped on SIGTERM"
        );
        closes(addr).await;
    }

    #[tokio::test]
    async fn a_dropped_instance_takes_its_children_along() {
        let spec = wrapped_spec("");
        let mut inst = spawn(&spec, "svc-7", &NotifyCounters::default()).expect("spawn");
        wait_ready(&spec, &mut inst).await.expect("ready");
        let addr = inst.address;
        // What a runtime dropped at shutdown or a task aborted does.
        drop(inst);
        closes(addr).await;
    }

    #[tokio::test]
    async fn sigkill_reaches_a_child_that_ignores_sigterm() {
        let spec = wrapped_spec("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)");
        let mut inst = spawn(&spec, "svc-8", &NotifyCounters::default()).expect("spawn");
        wait_ready(&spec, &mut inst).await.expect("ready");
        let addr = inst.address;
        assert!(
            !stop(inst, Duration::from_millis(300)).await,
            "needed SIGKILL"
        );
        closes(addr).await;
    }

    /// Sends `datagrams` (Python bytes literals) to `NOTIFY_SOCKET`, then
    /// sleeps for good: it never listens.
    fn notifier_spec(datagrams: &str) -> ProcessSpec {
        let mut spec = server_spec("");
        spec.command = vec![
            "python3".into(),
            "-c".into(),
            format!(
                "import os, socket, time\ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\nfor d in [{datagrams}]:\n    s.sendto(d, os.environ['NOTIFY_SOCKET'])\ntime.sleep(60)\n"
            ),
        ];
        spec
    }

    #[tokio::test]
    async fn ready_1_on_the_notification_socket_makes_an_instance_ready() {
        // It never listens: only the notification can make it ready.
        let spec = notifier_spec("b'STATUS=up', b'READY=1'");
        let counters = NotifyCounters::default();
        let mut inst = spawn(&spec, "svc-3", &counters).expect("spawn");
        let ready = wait_ready(&spec, &mut inst).await.expect("ready");
        assert_eq!(ready.via, Via::Notify);
        assert_eq!(counters.ready.get(), 1);
        stop(inst, Duration::from_secs(2)).await;
    }

    #[tokio::test]
    async fn garbage_on_the_notification_socket_is_ignored_and_counted() {
        let mut spec = notifier_spec("b'\\xff\\xfe', b'hello', b'READY=1'");
        spec.start_timeout = Duration::from_secs(10);
        let counters = NotifyCounters::default();
        let mut inst = spawn(&spec, "svc-4", &counters).expect("spawn");
        let ready = wait_ready(&spec, &mut inst).await.expect("ready");
        assert_eq!(ready.via, Via::Notify);
        assert_eq!((counters.ignored.get(), counters.ready.get()), (2, 1));
        stop(inst, Duration::from_secs(2)).await;
    }

    /// R9: with `readiness: notify` an instance that listens before it can
    /// serve is ready at its `READY=1`, not when its port first accepts.
    #[tokio::test]
    async fn with_readiness_notify_a_listening_port_is_not_ready_until_ready_1() {
        let dir = tempfile::tempdir().expect("tempdir");
        let go = dir.path().join("go");
        let mut spec = server_spec(&format!(
            "import threading\ndef later():\n    while not os.path.exists({go:?}):\n        time.sleep(0.01)\n    n = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n    n.sendto(b'READY=1', os.environ['NOTIFY_SOCKET'])\nthreading.Thread(target=later).start()",
            go = go.display().to_string()
        ));
        spec.readiness = Readiness::Notify;
        let counters = NotifyCounters::default();
        let mut inst = spawn(&spec, "svc-6", &counters).expect("spawn");
        let address = inst.address;
        let mut waiting = Box::pin(wait_ready(&spec, &mut inst));
        // Listening (it accepts), and still not ready.
        let listening = async {
            while tokio::net::TcpStream::connect(address).await.is_err() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::select! {
            r = &mut waiting => panic!("ready before READY=1: {r:?}"),
            () = listening => {}
        }
        // Probed, it would be ready within a few probe periods (5 ms).
        if let Ok(r) = tokio::time::timeout(Duration::from_millis(200), &mut waiting).await {
            panic!("ready on the port before READY=1: {r:?}");
        }
        std::fs::write(&go, b"").expect("go");
        let ready = waiting.await.expect("ready");
        assert_eq!(ready.via, Via::Notify);
        stop(inst, Duration::from_secs(2)).await;
    }

    #[test]
    fn readiness_notify_needs_the_notification_socket() {
        let mut spec = server_spec("");
        spec.readiness = Readiness::Notify;
        spec.validate().expect("valid");
        spec.notify = false;
        let e = spec.validate().expect_err("no socket");
        assert_eq!(e.path, "readiness");
    }

    #[tokio::test]
    async fn without_notify_no_socket_is_handed_over() {
        let mut spec = server_spec("assert 'NOTIFY_SOCKET' not in os.environ");
        spec.notify = false;
        let mut inst = spawn(&spec, "svc-5", &NotifyCounters::default()).expect("spawn");
        let ready = wait_ready(&spec, &mut inst)
            .await
            .expect("ready: the probe");
        assert_eq!(ready.via, Via::Probe);
        stop(inst, Duration::from_secs(2)).await;
    }
}
