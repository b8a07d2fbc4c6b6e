//! The last instance starts of the process scaler, each with the instants
//! of its phases on one clock (`Instant`): what a benchmark running the
//! control plane in its own process pairs with the requests it timed, so
//! a cold start's overhead is measured against the start of the same
//! instance, not of another spawn (`meshless bench coldstart`).

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

/// Starts kept, newest last (older ones are dropped).
const KEPT: usize = 64;

/// One instance that became ready.
#[derive(Debug, Clone)]
pub struct InstanceStart {
    pub service: String,
    pub id: String,
    /// When the stream read the activation request that started it
    /// (`None`: started by a decision, not an activation).
    pub read: Option<Instant>,
    /// When the activation request that started it woke the scaling loop
    /// (`None`: started by a decision, not an activation).
    pub asked: Option<Instant>,
    /// Just before the spawn call (`fork`/`exec`).
    pub spawning: Instant,
    /// When the scaler saw it ready: `READY=1` on its notification socket
    /// read, or its port accepting the scaler's probe.
    pub ready: Instant,
    /// How it was seen ready: `notify` or `probe`.
    pub via: &'static str,
    /// When its ready endpoint was published to the subscribers' ring
    /// (the delta that releases held requests).
    pub published: Instant,
}

/// The last [`KEPT`] starts.
#[derive(Debug, Default)]
pub struct InstanceStarts(Mutex<VecDeque<InstanceStart>>);

impl InstanceStarts {
    /// Records a start (dropping the oldest past [`KEPT`]).
    pub fn record(&self, start: InstanceStart) {
        let mut starts = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if starts.len() == KEPT {
            starts.pop_front();
        }
        starts.push_back(start);
    }

    /// The starts kept, oldest first.
    pub fn list(&self) -> Vec<InstanceStart> {
        let starts = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        starts.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_starts_are_kept_in_order() {
        let s = InstanceStarts::default();
        let now = Instant::now();
        for i in 0..KEPT + 3 {
            s.record(InstanceStart {
                service: "ns/a".into(),
                id: format!("i{i}"),
                read: None,
                asked: None,
                spawning: now,
                ready: now,
                via: "notify",
                published: now,
            });
        }
        let ids: Vec<String> = s.list().into_iter().map(|x| x.id).collect();
        assert_eq!(ids.len(), KEPT);
        assert_eq!(ids.first().map(String::as_str), Some("i3"));
        assert_eq!(ids.last().cloned(), Some(format!("i{}", KEPT + 2)));
    }
}
