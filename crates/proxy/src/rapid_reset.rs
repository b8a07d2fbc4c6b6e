//! Streams a downstream HTTP/2 client resets before their response head,
//! counted per connection (CVE-2023-44487, "rapid reset"): h2's own limit
//! counts only streams reset before the server accepted them, so a client
//! that waits for each stream to be accepted (its upstream attempt
//! started) and then resets it is not bounded by it. Past
//! `listeners[].http2.max_premature_resets`, when more than half of the
//! connection's streams were reset that way, the connection gets a GOAWAY
//! (Envoy's premature-reset rule).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use tokio::sync::Notify;

/// One connection's streams and premature resets.
#[derive(Debug)]
pub struct ResetWatch {
    streams: AtomicU64,
    premature: AtomicU64,
    max: u64,
    tripped: Notify,
}

impl ResetWatch {
    /// Trips at `max` premature resets that are more than half the streams.
    pub fn new(max: u32) -> Arc<Self> {
        Arc::new(Self {
            streams: AtomicU64::new(0),
            premature: AtomicU64::new(0),
            max: u64::from(max.max(1)),
            tripped: Notify::new(),
        })
    }

    /// `fut` (one stream's answer) counted: dropped before it resolves,
    /// it is a premature reset.
    pub fn track<F: Future>(self: &Arc<Self>, fut: F) -> Tracked<F> {
        self.streams.fetch_add(1, Ordering::Relaxed);
        Tracked {
            fut,
            guard: StreamGuard {
                watch: Arc::clone(self),
                answered: false,
            },
        }
    }

    /// Resolves once the connection is past the limit.
    pub async fn tripped(&self) {
        self.tripped.notified().await;
    }

    /// Premature resets counted so far.
    pub fn premature(&self) -> u64 {
        self.premature.load(Ordering::Relaxed)
    }

    fn reset_early(&self) {
        let premature = self.premature.fetch_add(1, Ordering::Relaxed) + 1;
        let streams = self.streams.load(Ordering::Relaxed);
        if premature >= self.max && premature * 2 > streams {
            // A stored permit: the connection's task sees it even when
            // it is not waiting right now.
            self.tripped.notify_one();
        }
    }
}

/// Counts its stream as reset early unless its answer came.
#[derive(Debug)]
struct StreamGuard {
    watch: Arc<ResetWatch>,
    answered: bool,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if !self.answered {
            self.watch.reset_early();
        }
    }
}

pin_project_lite::pin_project! {
    /// A stream's answer, counted by its connection's [`ResetWatch`].
    #[derive(Debug)]
    pub struct Tracked<F> {
        #[pin]
        fut: F,
        guard: StreamGuard,
    }
}

impl<F: Future> Future for Tracked<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let out = std::task::ready!(this.fut.poll(cx));
        this.guard.answered = true;
        Poll::Ready(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn trips_at_the_limit_when_most_streams_were_reset() {
        let w = ResetWatch::new(3);
        // Answered streams are not premature.
        for _ in 0..2 {
            w.track(async {}).await;
        }
        for _ in 0..3 {
            drop(w.track(std::future::pending::<()>()));
        }
        assert_eq!(w.premature(), 3);
        // 3 of 5 streams: more than half, at the limit.
        tokio::time::timeout(std::time::Duration::from_secs(5), w.tripped())
            .await
            .expect("tripped");
    }

    #[tokio::test]
    async fn a_minority_of_resets_does_not_trip() {
        let w = ResetWatch::new(2);
        for _ in 0..10 {
            w.track(async {}).await;
        }
        for _ in 0..5 {
            drop(w.track(std::future::pending::<()>()));
        }
        let tripped = tokio::time::timeout(std::time::Duration::from_millis(1), w.tripped());
        assert!(tripped.await.is_err());
    }
}
