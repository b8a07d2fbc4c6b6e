//! Signals to an instance's whole process group. Each instance is spawned
//! as the leader of its own group (pgid = its pid), so a wrapper
//! (`sh -c`, npm, a launcher script) and everything it forks are stopped
//! together, as Kubernetes (the container's cgroup) and systemd
//! (`KillMode=control-group`) do. Signals go through `kill(2)` directly
//! (rustix, no `unsafe`, no `kill` binary needed on `PATH`).

use std::time::Duration;

use rustix::io::Errno;
use rustix::process::{Pid, Signal};

/// How often [`wait_gone`] looks at the group again.
const POLL: Duration = Duration::from_millis(10);

/// A process group: the pid of its leader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group(Pid);

impl Group {
    /// The group led by `pid` (none for pid 0, which would mean "our own
    /// group").
    pub fn led_by(pid: u32) -> Option<Self> {
        i32::try_from(pid).ok().and_then(Pid::from_raw).map(Group)
    }

    /// The group id.
    pub fn id(self) -> i32 {
        self.0.as_raw_nonzero().get()
    }

    /// Sends `signal` to every process of the group; a group already gone
    /// is not an error. Any other failure is logged loudly: the instance
    /// may keep running.
    pub fn signal(self, signal: Signal) {
        match rustix::process::kill_process_group(self.0, signal) {
            Ok(()) | Err(Errno::SRCH) => {}
            Err(e) => {
                tracing::error!(pgid = self.id(), ?signal, error = %e, "cannot signal the instance's process group")
            }
        }
    }

    /// Whether a process of the group still runs. Zombies do not count: an
    /// orphan whose new parent never reaps it (meshless as a container's
    /// pid 1) stays a zombie, but it holds no port and runs no code.
    pub fn alive(self) -> bool {
        match rustix::process::test_kill_process_group(self.0) {
            Err(Errno::SRCH) => false,
            Err(_) => true,
            Ok(()) => has_live_member(self.id()).unwrap_or(true),
        }
    }
}

/// Whether `/proc` lists a process of group `pgid` that is not a zombie;
/// `None` when `/proc` cannot be read (then it is assumed alive).
fn has_live_member(pgid: i32) -> Option<bool> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name();
        if !name
            .to_str()
            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        {
            continue;
        }
        // A process may exit between the listing and the read.
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // "pid (comm) state ppid pgrp ...": comm may hold spaces and ')'.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next();
        let pgrp = fields.nth(1).and_then(|f| f.parse::<i32>().ok());
        if pgrp == Some(pgid) && !matches!(state, Some("Z" | "X")) {
            return Some(true);
        }
    }
    Some(false)
}

/// Polls until no process of `group` runs, or `deadline`; returns whether
/// the group is gone.
pub async fn wait_gone(group: Group, deadline: tokio::time::Instant) -> bool {
    loop {
        if !group.alive() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(POLL).await;
    }
}
