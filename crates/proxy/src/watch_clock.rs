//! A listener's clock for the late watch of a connection not yet
//! registered with the reactor ([`crate::lazy_tcp`]): a request on such a
//! connection that waits on its upstream starts watching for its client
//! leaving only once a period ([`crate::h1serve::WATCH_AFTER`]) has
//! passed, because watching would register the connection.
//!
//! One clock per listener rather than a timer per request: inserting a
//! timer earlier than the runtime's next wake-up costs a system call (tokio
//! wakes its driver through an eventfd), about every other new connection
//! with a 10 ms timer each. The clock ticks only while some request waits
//! on it, once per period.
//!
//! Invariants:
//! - A waker handed to [`WatchClock::wake_after_tick`] is woken after the
//!   tick count has moved past the value read before handing it.
//! - The clock's task ([`WatchClock::run`]) sleeps on a `Notify` while no
//!   waker is waiting: an idle listener costs no wake-up.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Waker;
use std::time::Duration;

use tokio::sync::Notify;

/// Periods of a listener's watch clock, and the wakers waiting for the
/// next one to end.
#[derive(Debug, Default)]
pub struct WatchClock {
    /// Periods ended since the listener started.
    ticks: AtomicU64,
    /// Woken at the end of the current period.
    waiting: Mutex<Vec<Waker>>,
    /// Starts the clock when the first waker comes.
    start: Notify,
}

impl WatchClock {
    /// Periods ended so far.
    pub fn ticks(&self) -> u64 {
        self.ticks.load(Ordering::Acquire)
    }

    /// Wakes `waker` once the current period has ended (the tick count has
    /// moved past what [`WatchClock::ticks`] read before this call).
    pub fn wake_after_tick(&self, waker: &Waker) {
        let mut waiting = self
            .waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let first = waiting.is_empty();
        waiting.push(waker.clone());
        drop(waiting);
        if first {
            // Stored as a permit if the clock is mid-period: harmless.
            self.start.notify_one();
        }
    }

    /// Ticks every `period` while wakers wait, waking them at each tick;
    /// idles otherwise. Runs until dropped (the listener's accept loop
    /// aborts it when the listener has closed).
    pub async fn run(&self, period: Duration) {
        let mut woken = Vec::new();
        loop {
            self.start.notified().await;
            loop {
                tokio::time::sleep(period).await;
                {
                    let mut waiting = self
                        .waiting
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    // Swapped, so both vectors keep their room.
                    std::mem::swap(&mut *waiting, &mut woken);
                    self.ticks.fetch_add(1, Ordering::AcqRel);
                }
                if woken.is_empty() {
                    break;
                }
                woken.drain(..).for_each(Waker::wake);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::poll_fn;
    use std::sync::Arc;
    use std::task::Poll;

    /// Waits until the clock has ticked past `from`, as a request does.
    async fn past(clock: &WatchClock, from: u64) {
        poll_fn(|cx| {
            if clock.ticks() > from {
                return Poll::Ready(());
            }
            clock.wake_after_tick(cx.waker());
            // Read again: a tick between the first read and the push has
            // left this waker for the next period, which also ends.
            if clock.ticks() > from {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_is_woken_after_a_tick_and_the_clock_idles_without_waiters() {
        let clock = Arc::new(WatchClock::default());
        let running = tokio::spawn({
            let clock = Arc::clone(&clock);
            async move { clock.run(Duration::from_millis(10)).await }
        });
        assert_eq!(clock.ticks(), 0);
        // Idle: no waker, no tick however long.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(clock.ticks(), 0, "an idle clock does not tick");
        let from = clock.ticks();
        past(&clock, from).await;
        assert!(clock.ticks() > from);
        // Twice past: at least one whole period waited.
        let from = clock.ticks();
        past(&clock, from + 1).await;
        assert!(clock.ticks() >= from + 2);
        // Many waiters at once are all woken.
        let from = clock.ticks();
        let waiters: Vec<_> = (0..50)
            .map(|_| {
                let clock = Arc::clone(&clock);
                tokio::spawn(async move { past(&clock, from).await })
            })
            .collect();
        for w in waiters {
            w.await.expect("waiter");
        }
        // The clock stops after a period with no waiter.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let idle = clock.ticks();
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(clock.ticks(), idle, "idle again");
        running.abort();
    }
}
