//! Progress for long-running models and benchmarks: a percentage on a
//! terminal, nothing when stderr is piped (so scripts read clean output).

use std::io::{IsTerminal, Write};

/// Reports `done / total` on stderr when it is a terminal.
#[derive(Debug)]
pub struct Progress {
    label: &'static str,
    total: u64,
    shown: u64,
    enabled: bool,
}

impl Progress {
    /// A progress line for `total` units of work.
    pub fn new(label: &'static str, total: u64) -> Self {
        Self::with_enabled(label, total, std::io::stderr().is_terminal())
    }

    /// A progress line that draws only when `enabled` (and stderr is a terminal).
    pub fn with_enabled(label: &'static str, total: u64, enabled: bool) -> Self {
        Self {
            label,
            total: total.max(1),
            shown: u64::MAX,
            enabled: enabled && std::io::stderr().is_terminal(),
        }
    }

    /// Records that `done` units are finished; redraws on each new percent.
    pub fn update(&mut self, done: u64) {
        if !self.enabled {
            return;
        }
        let pct = done.saturating_mul(100) / self.total;
        if pct != self.shown {
            self.shown = pct;
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r{}: {pct:>3}%", self.label);
            let _ = err.flush();
        }
    }

    /// Clears the line.
    pub fn finish(&mut self) {
        if self.enabled {
            let _ = write!(std::io::stderr().lock(), "\r\x1b[2K");
        }
    }
}
