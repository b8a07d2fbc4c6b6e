//! Merging of endpoint updates, as Envoy's `update_merge_window`: a
//! service's clusters are rebuilt at once on the first change after a
//! quiet window, and changes arriving within `window` of that rebuild wait
//! for one rebuild at the end of the window. So a burst (a rolling update)
//! costs at most one rebuild per window per service, whatever its rate.
//!
//! Invariants (tested): rebuilds of a service are at least `window` apart
//! unless urgent; no change waits longer than `window` for its rebuild.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// Which services to rebuild now and which later.
#[derive(Debug)]
pub struct MergeWindow {
    window: Duration,
    /// When each service's clusters were last rebuilt.
    last: HashMap<String, Instant>,
    /// Services with merged changes, and when their rebuild is due.
    pending: BTreeMap<String, Instant>,
}

impl MergeWindow {
    /// Merging within `window` (zero: every change rebuilds at once).
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            last: HashMap::new(),
            pending: BTreeMap::new(),
        }
    }

    /// A change to `service` arrived at `now`: true when it must be
    /// rebuilt now (then call [`MergeWindow::rebuilt`]), false when it is
    /// merged into the rebuild due at the end of the window. `urgent`
    /// (a reset, or a service with no ready endpoint that requests may be
    /// waiting on) always rebuilds now.
    pub fn admit(&mut self, service: &str, now: Instant, urgent: bool) -> bool {
        let quiet = self
            .last
            .get(service)
            .is_none_or(|t| now.saturating_duration_since(*t) >= self.window);
        if urgent || quiet {
            return true;
        }
        let due = self.last[service] + self.window;
        self.pending.entry(service.to_owned()).or_insert(due);
        false
    }

    /// `service` was rebuilt at `now`: its merged changes are in.
    pub fn rebuilt(&mut self, service: &str, now: Instant) {
        self.pending.remove(service);
        if !self.window.is_zero() {
            self.last.insert(service.to_owned(), now);
        }
    }

    /// When the next merged rebuild is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.pending.values().min().copied()
    }

    /// Services whose merged rebuild is due at `now` (removed from pending).
    pub fn take_due(&mut self, now: Instant) -> Vec<String> {
        let due: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, t)| **t <= now)
            .map(|(s, _)| s.clone())
            .collect();
        for s in &due {
            self.pending.remove(s);
        }
        due
    }

    /// Every service with merged changes (when the stream ends).
    pub fn take_all(&mut self) -> Vec<String> {
        std::mem::take(&mut self.pending).into_keys().collect()
    }

    /// Forgets services no longer watched.
    pub fn retain(&mut self, watched: impl Fn(&str) -> bool) {
        self.pending.retain(|s, _| watched(s));
        self.last.retain(|s, _| watched(s));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any arrival pattern: non-urgent rebuilds of a service are at least
        /// a window apart, and every change is rebuilt within a window.
        #[test]
        fn rebuilds_are_a_window_apart_and_no_change_waits_longer(
            window_ms in 1u64..500,
            gaps_ms in prop::collection::vec(0u64..700, 1..60),
            urgent in prop::collection::vec(any::<bool>(), 60),
        ) {
            let window = Duration::from_millis(window_ms);
            let t0 = Instant::now();
            let mut m = MergeWindow::new(window);
            let mut now = t0;
            let mut rebuilds: Vec<(Instant, bool)> = Vec::new();
            let mut waiting: Option<Instant> = None; // oldest change not yet rebuilt
            for (k, gap) in gaps_ms.iter().enumerate() {
                let next = now + Duration::from_millis(*gap);
                // The timer fires for merged rebuilds due before the next change.
                while let Some(due) = m.next_due().filter(|d| *d <= next) {
                    prop_assert_eq!(m.take_due(due), vec!["s".to_owned()]);
                    m.rebuilt("s", due);
                    rebuilds.push((due, false));
                    if let Some(w) = waiting.take() {
                        prop_assert!(due - w <= window, "waited {:?}", due - w);
                    }
                }
                now = next;
                if m.admit("s", now, urgent[k]) {
                    m.rebuilt("s", now);
                    rebuilds.push((now, urgent[k]));
                    waiting = None;
                } else {
                    waiting.get_or_insert(now);
                }
            }
            for pair in rebuilds.windows(2) {
                let ((a, _), (b, b_urgent)) = (pair[0], pair[1]);
                prop_assert!(b_urgent || b - a >= window, "{:?} apart", b - a);
            }
        }
    }

    #[test]
    fn a_zero_window_rebuilds_every_change() {
        let mut m = MergeWindow::new(Duration::ZERO);
        let t = Instant::now();
        for _ in 0..3 {
            assert!(m.admit("s", t, false));
            m.rebuilt("s", t);
        }
        assert_eq!(m.next_due(), None);
    }
}
