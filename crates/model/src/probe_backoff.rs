//! The schedule of readiness probes of a starting instance: the first
//! probe follows at once, then the waits between probes start at
//! [`FIRST_PROBE_WAIT`] and double up to a cap (the configured
//! `probe_interval`). An instance that listens within a millisecond is
//! seen within a fraction of one; a slow one costs one probe per cap.
//!
//! Invariant (property-tested): every wait is at most the cap; the first
//! is `min(FIRST_PROBE_WAIT, cap)`; each next one is `min(2 x previous,
//! cap)`. Tokio's timer has a 1 ms resolution, so a wait under 1 ms
//! sleeps until the next millisecond tick: the schedule is the intent,
//! the timer rounds it up.

use std::time::Duration;

/// The first wait between probes.
pub const FIRST_PROBE_WAIT: Duration = Duration::from_micros(200);

/// Checks a configured `probe_interval` (the cap): at least
/// [`FIRST_PROBE_WAIT`], so the probe loop always pauses.
pub fn check_probe_interval(cap: Duration) -> Result<(), crate::FieldError> {
    if cap < FIRST_PROBE_WAIT {
        return Err(crate::FieldError::new(
            "probe_interval",
            format!(
                "must be at least {FIRST_PROBE_WAIT:?} (a probe loop without a pause), got {cap:?}"
            ),
        ));
    }
    Ok(())
}

/// Waits between readiness probes, doubling from [`FIRST_PROBE_WAIT`] to a cap.
#[derive(Debug, Clone)]
pub struct ProbeBackoff {
    next: Duration,
    cap: Duration,
}

impl ProbeBackoff {
    /// A schedule capped at `cap` (the old fixed period).
    pub fn new(cap: Duration) -> Self {
        Self {
            next: FIRST_PROBE_WAIT.min(cap),
            cap,
        }
    }

    /// The wait before the next probe.
    pub fn next_wait(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(self.cap);
        wait
    }

    /// Starts over from the first wait (something new to probe).
    pub fn reset(&mut self) {
        self.next = FIRST_PROBE_WAIT.min(self.cap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn doubles_from_the_first_wait_up_to_the_cap(cap_us in 0u64..20_000, n in 1usize..40) {
            let cap = Duration::from_micros(cap_us);
            let mut b = ProbeBackoff::new(cap);
            let waits: Vec<Duration> = (0..n).map(|_| b.next_wait()).collect();
            prop_assert_eq!(waits[0], FIRST_PROBE_WAIT.min(cap));
            for w in waits.windows(2) {
                prop_assert_eq!(w[1], (w[0] * 2).min(cap));
            }
            prop_assert!(waits.iter().all(|w| *w <= cap));
            b.reset();
            prop_assert_eq!(b.next_wait(), waits[0]);
        }
    }

    #[test]
    fn the_default_schedule_reaches_five_ms_after_five_probes() {
        let mut b = ProbeBackoff::new(Duration::from_millis(5));
        let waits: Vec<u64> = (0..7).map(|_| b.next_wait().as_micros() as u64).collect();
        assert_eq!(waits, [200, 400, 800, 1600, 3200, 5000, 5000]);
    }
}
