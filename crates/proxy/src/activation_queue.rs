//! The services held requests ask the control plane to start, until the
//! stream to the control plane reads them ([`crate::control_outbound`]).
//!
//! Invariant: a service is pending at most once, so the queue holds at
//! most one entry per service whatever the number of held requests, and
//! however long the control plane is unreachable (one `Activate` per
//! service is all the control plane needs: its scaling loop reads the held
//! count from the load report sent with it).

use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

/// Pending activation requests, one per service, in the order first asked.
#[derive(Debug, Default)]
pub struct ActivationQueue(Mutex<Pending>);

#[derive(Debug, Default)]
struct Pending {
    services: Vec<String>,
    /// The stream waiting for the next request.
    waker: Option<Waker>,
}

impl ActivationQueue {
    /// Asks for `service` (a no-op while it is pending) and wakes the
    /// stream; returns whether it was not pending yet. Never fails: a
    /// request asked while the control plane is away goes out on the next
    /// stream.
    pub fn send(&self, service: String) -> bool {
        let mut p = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let new = !p.services.contains(&service);
        if new {
            p.services.push(service);
        }
        if let Some(w) = p.waker.take() {
            w.wake();
        }
        new
    }

    /// How many services are pending (at most the number of services).
    pub fn len(&self) -> usize {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .services
            .len()
    }

    /// Whether no service is pending.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes every pending service, or registers `cx` to be woken by the
    /// next [`ActivationQueue::send`] (one waiter: the current stream).
    pub(crate) fn poll_take(&self, cx: &mut Context<'_>) -> Poll<Vec<String>> {
        let mut p = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if p.services.is_empty() {
            p.waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        Poll::Ready(std::mem::take(&mut p.services))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_requests_stay_bounded_by_the_services() {
        let q = ActivationQueue::default();
        for i in 0..100_000 {
            q.send(format!("ns/s{}", i % 3));
        }
        assert_eq!(q.len(), 3);
        let mut cx = Context::from_waker(Waker::noop());
        let Poll::Ready(got) = q.poll_take(&mut cx) else {
            panic!("pending services");
        };
        assert_eq!(got, ["ns/s0", "ns/s1", "ns/s2"]);
        assert!(q.is_empty());
        assert!(q.poll_take(&mut cx).is_pending());
    }
}
