//! A subscriber's response stream without a task of its own: the stream
//! drives the subscriber's future (`subscriber::serve`) each time the
//! HTTP/2 connection polls it for data, and hands out the messages the
//! future queued in the [`Outbox`]. A delta's wake-up goes straight to the
//! task that writes the stream: no channel hop and no second task wake per
//! message (the design before this ran each subscriber as a task sending
//! batches over an `mpsc` channel to the stream).
//!
//! Invariant: the future runs only inside [`Follower::poll_next`], and only
//! while fewer than `capacity` messages wait, so at most `capacity` plus
//! one batch of messages wait per subscriber (server memory per subscriber
//! stays bounded); messages leave in the order they were queued. A batch
//! is moved into the queue (its `Vec` keeps its room for the next one), so
//! a write allocates nothing here.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

use meshless_api::v1::ServerMessage;
use tonic::Status;

/// Messages queued for the response stream and the waker of a future
/// waiting for room.
#[derive(Debug, Default)]
struct Queue {
    messages: VecDeque<ServerMessage>,
    waiting: Option<Waker>,
}

/// The subscriber's side: where its future puts the messages to write.
#[derive(Debug, Clone)]
pub(crate) struct Outbox {
    queue: Arc<Mutex<Queue>>,
    capacity: usize,
}

/// The queue is gone: the response stream was dropped (the subscriber left).
#[derive(Debug)]
pub(crate) struct Closed;

impl Outbox {
    /// An outbox taking a batch while fewer than `capacity` messages (at
    /// least 1) wait.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            queue: Arc::new(Mutex::new(Queue::default())),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves the messages of `batch` into the queue (leaving it empty),
    /// waiting first while `capacity` messages wait.
    pub(crate) async fn send(&self, batch: &mut Vec<ServerMessage>) -> Result<(), Closed> {
        std::future::poll_fn(|cx| {
            if Arc::strong_count(&self.queue) == 1 {
                return Poll::Ready(Err(Closed));
            }
            let mut q = self.lock();
            if q.messages.len() < self.capacity {
                q.messages.extend(batch.drain(..));
                Poll::Ready(Ok(()))
            } else {
                q.waiting = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }

    /// The next message queued, if any; once the queue is empty, wakes a
    /// future waiting for room.
    fn pop(&self) -> Option<ServerMessage> {
        let mut q = self.lock();
        let msg = q.messages.pop_front();
        if msg.is_none()
            && let Some(w) = q.waiting.take()
        {
            w.wake();
        }
        msg
    }

    /// Messages waiting (for tests).
    #[cfg(test)]
    pub(crate) fn drain_messages(&self) -> Vec<ServerMessage> {
        self.lock().messages.drain(..).collect()
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
                Poll::Pending if self.outbox.lock().messages.is_empty() => return Poll::Pending,
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
                let mut batch = (0..3).map(|i| hb(b * 3 + i)).collect();
                if writer.send(&mut batch).await.is_err() {
                    return;
                }
                assert!(batch.is_empty(), "moved into the queue");
                assert!(writer.lock().messages.len() <= 2 + 3, "bounded by capacity");
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
        assert!(
            kept.send(&mut vec![hb(1)]).await.is_err(),
            "nobody reads it"
        );
    }
}
