//! A subscriber's response stream without a task of its own: the stream
//! drives the subscriber's future (`subscriber::serve`) each time the
//! HTTP/2 connection polls it for data, and hands out the messages the
//! future queued in the [`Outbox`]. A delta's wake-up goes straight to the
//! task that writes the stream: no channel hop and no second task wake per
//! message (the design before this ran each subscriber as a task sending
//! batches over an `mpsc` channel to the stream).
//!
//! Invariant: the future runs only inside [`Follower::poll_next`], and only
//! while the outbox is empty or below its capacity, so at most `capacity`
//! batches wait per subscriber (server memory per subscriber stays
//! bounded); messages leave in the order they were queued.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

use meshless_api::v1::ServerMessage;
use tonic::Status;

/// Batches queued for the response stream and the waker of a future
/// waiting for room.
#[derive(Debug, Default)]
struct Queue {
    batches: VecDeque<Vec<ServerMessage>>,
    /// Messages of the front batch already handed out.
    taken: usize,
    waiting: Option<Waker>,
}

/// The subscriber's side: where its future puts the batches to write.
#[derive(Debug, Clone)]
pub(crate) struct Outbox {
    queue: Arc<Mutex<Queue>>,
    capacity: usize,
}

/// The queue is gone: the response stream was dropped (the subscriber left).
#[derive(Debug)]
pub(crate) struct Closed;

impl Outbox {
    /// An outbox holding at most `capacity` batches (at least 1).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            queue: Arc::new(Mutex::new(Queue::default())),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `batch`, waiting first while `capacity` batches wait.
    pub(crate) async fn send(&self, batch: Vec<ServerMessage>) -> Result<(), Closed> {
        std::future::poll_fn(|cx| {
            if Arc::strong_count(&self.queue) == 1 {
                return Poll::Ready(Err(Closed));
            }
            let mut q = self.lock();
            if q.batches.len() < self.capacity {
                Poll::Ready(Ok(()))
            } else {
                q.waiting = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await?;
        self.lock().batches.push_back(batch);
        Ok(())
    }

    /// The next message queued, if any; wakes a future waiting for room.
    fn pop(&self) -> Option<ServerMessage> {
        let mut q = self.lock();
        loop {
            let taken = q.taken;
            let front = q.batches.front_mut()?;
            if taken < front.len() {
                let msg = std::mem::take(&mut front[taken]);
                q.taken += 1;
                return Some(msg);
            }
            q.batches.pop_front();
            q.taken = 0;
            if let Some(w) = q.waiting.take() {
                w.wake();
            }
        }
    }

    /// Batches waiting (for tests).
    #[cfg(test)]
    pub(crate) fn drain_batches(&self) -> Vec<Vec<ServerMessage>> {
        let mut q = self.lock();
        q.taken = 0;
        q.batches.drain(..).collect()
    }
}

/// The response stream of one subscriber: its future and its outbox.
pub(crate) struct Follower {
    outbox: Outbox,
    future: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl Follower {
    /// A stream that runs `future` (which writes into `outbox`) as it is
    /// polled, and ends when the future has ended and its messages are out.
    pub(crate) fn new(outbox: Outbox, future: impl Future<Output = ()> + Send + 'static) -> Self {
        Self {
            outbox,
            future: Some(Box::pin(future)),
        }
    }
}

impl tokio_stream::Stream for Follower {
    type Item = Result<ServerMessage, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(msg) = self.outbox.pop() {
                return Poll::Ready(Some(Ok(msg)));
            }
            let Some(future) = self.future.as_mut() else {
                return Poll::Ready(None);
            };
            match future.as_mut().poll(cx) {
                Poll::Ready(()) => self.future = None,
                // Nothing queued while it ran: wait for its wake-up.
                Poll::Pending if self.outbox.lock().batches.is_empty() => return Poll::Pending,
                Poll::Pending => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshless_api::v1::{Heartbeat, server_message};
    use tokio_stream::{Stream, StreamExt};

    fn hb(version: u64) -> ServerMessage {
        ServerMessage {
            msg: Some(server_message::Msg::Heartbeat(Heartbeat { version })),
        }
    }

    fn version(m: &ServerMessage) -> u64 {
        match &m.msg {
            Some(server_message::Msg::Heartbeat(h)) => h.version,
            _ => u64::MAX,
        }
    }

    /// Every message leaves once, in order, though the future queues more
    /// batches than the outbox holds: it waits for room, then goes on.
    #[tokio::test]
    async fn messages_leave_in_order_through_a_full_outbox() {
        let outbox = Outbox::new(2);
        let writer = outbox.clone();
        let follower = Follower::new(outbox, async move {
            for b in 0..10u64 {
                let batch = (0..3).map(|i| hb(b * 3 + i)).collect();
                if writer.send(batch).await.is_err() {
                    return;
                }
                assert!(writer.lock().batches.len() <= 2, "bounded by capacity");
                tokio::task::yield_now().await;
            }
        });
        let got: Vec<u64> = follower
            .map(|m| m.map(|m| version(&m)).unwrap_or(u64::MAX))
            .collect()
            .await;
        assert_eq!(got, (0..30).collect::<Vec<_>>());
    }

    /// Dropping the stream drops the subscriber's future (its guards run)
    /// and a sender left behind learns the subscriber is gone.
    #[tokio::test]
    async fn dropping_the_stream_drops_the_future() {
        struct Flag(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Flag(Arc::clone(&dropped));
        let outbox = Outbox::new(1);
        let kept = outbox.clone();
        let mut follower = Follower::new(outbox.clone(), async move {
            let _flag = flag;
            std::future::pending::<()>().await;
        });
        let mut cx = Context::from_waker(Waker::noop());
        let polled = Pin::new(&mut follower).poll_next(&mut cx);
        assert!(polled.is_pending(), "nothing to hand out yet");
        drop(follower);
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
        drop(outbox);
        assert!(kept.send(vec![hb(1)]).await.is_err(), "nobody reads it");
    }
}
