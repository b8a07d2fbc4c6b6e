//! An HTTP/2 connection's streams, run by the connection's own task.
//!
//! hyper hands each stream's future to its executor. Spawned as a tokio
//! task per stream, each costs a task cell aligned to 128 bytes (glibc
//! serves it from `posix_memalign`'s slow path: about 600 instructions,
//! and the splits it leaves make later allocations slower), a trip
//! through the scheduler to start, and another per wake-up. Here the
//! [`StreamExecutor`] queues the future instead, and [`run`] polls the
//! connection and its streams together: two small allocations per stream
//! (the future's box, the set's node), no scheduler.
//!
//! One consequence, by design: a connection's streams share one task, so
//! one worker thread (Envoy and HAProxy bind a connection to one worker
//! the same way). Before, with a multi-threaded runtime, the streams of
//! one busy connection could spread over several threads.
//!
//! Invariants:
//! - A stream's future is polled only by its connection's task: hyper
//!   queues it from inside the connection's `poll`, and [`run`] takes it
//!   into its set after that `poll` returns.
//! - At most [`MAX_STARTED_PER_POLL`] streams start per poll of the task;
//!   the rest wait until the runtime has polled its I/O driver and its
//!   other tasks once (as a task per stream would have let it): a burst of
//!   hundreds of streams on one connection does not open hundreds of
//!   upstream connections before anything else runs.
//! - A panic in one stream's future ends that stream, as in a task of
//!   its own: the connection and its other streams go on.
//! - [`run`] returns once the connection has ended and every stream it
//!   started has finished: requests under way when a client goes complete
//!   (their records, logs and metrics) as they did in tasks of their own.

use std::future::{Future, poll_fn};
use std::panic::AssertUnwindSafe;
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;

use futures_util::FutureExt;
use futures_util::stream::{FuturesUnordered, StreamExt};

type StreamFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Most streams [`run`] starts in one poll.
pub const MAX_STARTED_PER_POLL: usize = 32;

/// hyper's executor for one connection: queues each stream's future for
/// [`run`].
#[derive(Clone, Default)]
pub struct StreamExecutor {
    queued: Arc<Mutex<Vec<StreamFuture>>>,
}

impl<F> hyper::rt::Executor<F> for StreamExecutor
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, fut: F) {
        // A panic ends this stream alone (tokio's task would have caught
        // it); the panic hook has reported it already.
        let fut = AssertUnwindSafe(fut).catch_unwind().map(|_| ());
        self.queued
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Box::pin(fut));
    }
}

impl std::fmt::Debug for StreamExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let queued = self.queued.lock().map_or(0, |q| q.len());
        f.debug_struct("StreamExecutor")
            .field("queued", &queued)
            .finish()
    }
}

impl StreamExecutor {
    /// Moves up to `max` queued streams, oldest first, into `into`;
    /// whether any are left.
    fn start_queued(&self, into: &mut FuturesUnordered<StreamFuture>, max: usize) -> bool {
        let mut queued = self.queued.lock().unwrap_or_else(PoisonError::into_inner);
        let n = queued.len().min(max);
        into.extend(queued.drain(..n));
        !queued.is_empty()
    }
}

/// Drives `conn` (whose streams `exec` queues) and the streams until the
/// connection has ended and every stream has finished.
pub async fn run<C: Future>(conn: C, exec: StreamExecutor) -> C::Output {
    let mut conn = pin!(conn);
    let mut ended = None;
    let mut streams = FuturesUnordered::new();
    poll_fn(|cx| {
        if ended.is_none()
            && let Poll::Ready(out) = conn.as_mut().poll(cx)
        {
            ended = Some(out);
        }
        let more = exec.start_queued(&mut streams, MAX_STARTED_PER_POLL);
        if more {
            // More wait: this task is polled again once the runtime has
            // run its driver and other tasks (`yield_now` defers the wake).
            let _ = pin!(tokio::task::yield_now()).poll(cx);
        }
        // Until each is finished or waits (its waker then wakes this task).
        while let Poll::Ready(Some(())) = streams.poll_next_unpin(cx) {}
        if !more
            && streams.is_empty()
            && let Some(out) = ended.take()
        {
            return Poll::Ready(out);
        }
        Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::rt::Executor;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::sync::oneshot;

    /// A connection stand-in that queues `n` streams on its first poll and
    /// ends when `end` fires.
    async fn conn_queuing(
        exec: StreamExecutor,
        streams: Vec<StreamFuture>,
        end: oneshot::Receiver<()>,
    ) -> &'static str {
        for s in streams {
            exec.execute(s);
        }
        let _ = end.await;
        "ended"
    }

    #[tokio::test]
    async fn streams_run_beside_the_connection_and_outlive_it() {
        let exec = StreamExecutor::default();
        let done = Arc::new(AtomicUsize::new(0));
        let (release_tx, release_rx) = oneshot::channel::<()>();
        let (end_tx, end_rx) = oneshot::channel();
        let d = Arc::clone(&done);
        let quick: StreamFuture = Box::pin(async move {
            d.fetch_add(1, Ordering::SeqCst);
        });
        let d = Arc::clone(&done);
        let slow: StreamFuture = Box::pin(async move {
            let _ = release_rx.await;
            d.fetch_add(1, Ordering::SeqCst);
        });
        let task = tokio::spawn(run(
            conn_queuing(exec.clone(), vec![quick, slow], end_rx),
            exec,
        ));
        tokio::task::yield_now().await;
        assert_eq!(done.load(Ordering::SeqCst), 1, "the quick stream ran");
        // The connection ends; the slow stream keeps it running.
        end_tx.send(()).expect("conn waits");
        tokio::task::yield_now().await;
        assert!(!task.is_finished(), "a stream is still under way");
        release_tx.send(()).expect("stream waits");
        assert_eq!(task.await.expect("run"), "ended");
        assert_eq!(done.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_panicking_stream_ends_alone() {
        let exec = StreamExecutor::default();
        let done = Arc::new(AtomicUsize::new(0));
        let (end_tx, end_rx) = oneshot::channel();
        let boom: StreamFuture = Box::pin(async {
            panic!("a stream's bug");
        });
        let d = Arc::clone(&done);
        let fine: StreamFuture = Box::pin(async move {
            tokio::task::yield_now().await;
            d.fetch_add(1, Ordering::SeqCst);
        });
        let task = tokio::spawn(run(
            conn_queuing(exec.clone(), vec![boom, fine], end_rx),
            exec,
        ));
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
        end_tx.send(()).expect("conn waits");
        assert_eq!(task.await.expect("the connection's task survives"), "ended");
        assert_eq!(done.load(Ordering::SeqCst), 1);
    }

    /// 100 streams queued by one poll of the connection start at most 32
    /// a poll of `run`, and all of them finish before `run` returns, the
    /// connection having ended first.
    #[tokio::test]
    async fn a_burst_of_streams_starts_in_batches_and_all_finish() {
        let exec = StreamExecutor::default();
        let started = Arc::new(AtomicUsize::new(0));
        let finished = Arc::new(AtomicUsize::new(0));
        let streams: Vec<StreamFuture> = (0..100)
            .map(|_| {
                let (s, f) = (Arc::clone(&started), Arc::clone(&finished));
                Box::pin(async move {
                    s.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    f.fetch_add(1, Ordering::SeqCst);
                }) as StreamFuture
            })
            .collect();
        let (end_tx, end_rx) = oneshot::channel();
        end_tx.send(()).expect("receiver alive");
        let mut running = pin!(run(conn_queuing(exec.clone(), streams, end_rx), exec));
        // Streams started by each poll of `run`.
        let mut per_poll = Vec::new();
        let out = poll_fn(|cx| {
            let before = started.load(Ordering::SeqCst);
            let polled = running.as_mut().poll(cx);
            per_poll.push(started.load(Ordering::SeqCst) - before);
            polled
        })
        .await;
        assert_eq!(out, "ended");
        assert_eq!(finished.load(Ordering::SeqCst), 100);
        assert!(
            per_poll.iter().all(|&n| n <= MAX_STARTED_PER_POLL),
            "{per_poll:?}"
        );
        assert_eq!(
            per_poll.iter().filter(|&&n| n > 0).count(),
            4,
            "{per_poll:?}"
        );
    }

    #[tokio::test]
    async fn a_connection_with_no_streams_ends_when_it_ends() {
        let exec = StreamExecutor::default();
        assert_eq!(run(async { 7 }, exec).await, 7);
    }
}
