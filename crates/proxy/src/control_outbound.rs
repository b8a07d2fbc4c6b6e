//! The outgoing half of the proxy's control-plane stream: the session's
//! own messages (`Hello`, acks, load reports, subscriptions) and the
//! activation requests of held requests, merged in the one stream the
//! HTTP/2 connection polls for the request body. A held request's
//! activation goes from its own task straight to the task writing the
//! stream (no hand-off through the session's task on the way); a burst
//! held at once leaves as one load report and one `Activate` per service.
//!
//! Invariant: the activation receiver outlives a stream (requests held
//! while the control plane is away are asked for on the next stream), so
//! it is shared; a stream reads it only while its session is alive (the
//! session's sender not dropped: the session's own channel is polled
//! first and ends the stream once the session is gone), so a stale stream
//! never takes the receiver's wake-up from the current one.

use std::collections::{BTreeMap, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use meshless_api::v1::{self, ClientMessage, client_message};
use tokio::sync::mpsc;
use tokio_stream::Stream;

use crate::activation_queue::ActivationQueue;
use crate::state::ProxyState;

/// Requests in flight and held, per watched service, over its clusters.
/// Each request counts once: a held request is active (admitted) *and*
/// queued, so it is reported as queued only (the control plane's
/// autoscaler adds the two); a forwarded one is the chosen node's load.
pub(crate) fn loads(state: &ProxyState) -> Vec<v1::ServiceLoad> {
    use std::sync::atomic::Ordering;
    let snap = state.snapshot.load();
    let mut per: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for c in snap.clusters.values() {
        if let Some(s) = &c.config.service {
            let e = per.entry(s.as_str()).or_default();
            // Forwarded requests are the chosen node's proxy's load.
            let forwarded = c.counters.forwarded.load(Ordering::Relaxed);
            let queued = c.counters.queued.load(Ordering::Relaxed);
            e.0 += c
                .counters
                .active_requests
                .load(Ordering::Relaxed)
                .saturating_sub(forwarded)
                .saturating_sub(queued);
            e.1 += queued;
        }
    }
    per.into_iter()
        .map(|(service, (f, q))| v1::ServiceLoad {
            service: service.to_owned(),
            in_flight: u32::try_from(f).unwrap_or(u32::MAX),
            queued: u32::try_from(q).unwrap_or(u32::MAX),
        })
        .collect()
}

/// The activation requests of held requests (service names, each pending
/// once), shared by the streams of successive sessions.
pub(crate) type Activations = Arc<ActivationQueue>;

/// One session's outgoing stream.
pub(crate) struct Outbound {
    /// The session's own messages; closed when the session ends.
    own: mpsc::Receiver<ClientMessage>,
    activations: Activations,
    state: Arc<ProxyState>,
    /// This proxy's node, named in every `Activate`.
    node: String,
    /// Messages made from one read of the activations, in order.
    queued: VecDeque<ClientMessage>,
}

impl Outbound {
    pub(crate) fn new(
        own: mpsc::Receiver<ClientMessage>,
        activations: Activations,
        state: Arc<ProxyState>,
        node: String,
    ) -> Self {
        Self {
            own,
            activations,
            state,
            node,
            queued: VecDeque::new(),
        }
    }

    /// The services asked for since the last read, each once (registers
    /// for a wake-up when there are none).
    fn asked(&self, cx: &mut Context<'_>) -> Vec<String> {
        match self.activations.poll_take(cx) {
            Poll::Ready(services) => services,
            Poll::Pending => Vec::new(),
        }
    }
}

impl Stream for Outbound {
    type Item = ClientMessage;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<ClientMessage>> {
        let this = self.get_mut();
        if let Some(msg) = this.queued.pop_front() {
            return Poll::Ready(Some(msg));
        }
        // The session's own messages first: its `Hello` leads the stream,
        // and a session gone ends the stream before it reads activations.
        if let Poll::Ready(msg) = this.own.poll_recv(cx) {
            return Poll::Ready(msg);
        }
        let services = this.asked(cx);
        if services.is_empty() {
            return Poll::Pending;
        }
        // With the load that explains it (the control plane's scaling
        // loop reads the held count from the load reports).
        let load = v1::Load {
            services: loads(&this.state),
        };
        this.queued.push_back(ClientMessage {
            msg: Some(client_message::Msg::Load(load)),
        });
        for service in services {
            let node = this.node.clone();
            let act = v1::Activate { service, node };
            this.queued.push_back(ClientMessage {
                msg: Some(client_message::Msg::Activate(act)),
            });
        }
        Poll::Ready(this.queued.pop_front())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use tokio_stream::StreamExt;

    use super::*;

    /// A proxy's state with one activating cluster of `ns/a`, and the
    /// receiver of its activation requests.
    fn state() -> (Arc<ProxyState>, Activations) {
        let yaml = "control: { address: \"127.0.0.1:1\" }\nclusters:\n  - name: c\n    service: ns/a\n    activation: { queue_timeout: 60s }\n";
        let activations = Activations::default();
        let state = ProxyState::for_tests(yaml, Arc::clone(&activations));
        (Arc::new(state), activations)
    }

    fn hello() -> ClientMessage {
        ClientMessage {
            msg: Some(client_message::Msg::Hello(v1::Hello::default())),
        }
    }

    /// What a message is, for comparing sequences.
    fn kind(m: &ClientMessage) -> String {
        match &m.msg {
            Some(client_message::Msg::Hello(_)) => "hello".into(),
            Some(client_message::Msg::Load(_)) => "load".into(),
            Some(client_message::Msg::Activate(a)) => format!("activate {} {}", a.service, a.node),
            other => format!("{other:?}"),
        }
    }

    /// The next message, failing the test if none comes within 20 s.
    async fn next(out: &mut Outbound) -> Option<String> {
        tokio::time::timeout(Duration::from_secs(20), out.next())
            .await
            .expect("a message or the end")
            .map(|m| kind(&m))
    }

    /// Whether the stream has nothing to hand out now.
    fn idle(out: &mut Outbound) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        Pin::new(out).poll_next(&mut cx).is_pending()
    }

    /// A burst held at once: after the session's own messages, one load
    /// report and one `Activate` per service, whatever the count.
    #[tokio::test]
    async fn a_burst_asks_once_per_service_after_the_sessions_own_messages() {
        let (state, activations) = state();
        let (tx, rx) = mpsc::channel(16);
        tx.send(hello()).await.unwrap();
        for _ in 0..1000 {
            state.activate.send("ns/a".into());
        }
        state.activate.send("ns/b".into());
        let mut out = Outbound::new(rx, activations, Arc::clone(&state), "n1".into());
        assert_eq!(next(&mut out).await.as_deref(), Some("hello"));
        assert_eq!(next(&mut out).await.as_deref(), Some("load"));
        assert_eq!(next(&mut out).await.as_deref(), Some("activate ns/a n1"));
        assert_eq!(next(&mut out).await.as_deref(), Some("activate ns/b n1"));
        assert!(idle(&mut out), "nothing more was asked for");
        // A request held later wakes the stream.
        let asker = Arc::clone(&state);
        tokio::spawn(async move { asker.activate.send("ns/a".into()) });
        assert_eq!(next(&mut out).await.as_deref(), Some("load"));
        assert_eq!(next(&mut out).await.as_deref(), Some("activate ns/a n1"));
    }

    /// A held request is admitted (active) and queued: it counts once, as
    /// queued, so a burst held at zero is not seen as twice its size.
    #[test]
    fn a_held_request_counts_once_in_the_load() {
        use std::sync::atomic::Ordering;
        let (state, _) = state();
        let snap = state.snapshot.load();
        let c = &snap.clusters.values().next().unwrap().counters;
        // Three admitted: two held, one sent.
        c.active_requests.store(3, Ordering::Relaxed);
        c.queued.store(2, Ordering::Relaxed);
        let l = loads(&state);
        assert_eq!((l.len(), l[0].in_flight, l[0].queued), (1, 1, 2));
        // Counters read one by one may be momentarily inconsistent.
        c.active_requests.store(1, Ordering::Relaxed);
        assert_eq!(loads(&state)[0].in_flight, 0);
    }

    /// Requests held while no session is up are asked for on the next
    /// stream; the stream of a session that ended takes none of them.
    #[tokio::test]
    async fn activations_asked_between_sessions_go_out_on_the_next_stream() {
        let (state, activations) = state();
        let (tx1, rx1) = mpsc::channel(16);
        let mut old = Outbound::new(
            rx1,
            Arc::clone(&activations),
            Arc::clone(&state),
            "n1".into(),
        );
        assert!(idle(&mut old));
        drop(tx1);
        state.activate.send("ns/a".into());
        assert_eq!(next(&mut old).await, None, "its session ended");
        let (tx2, rx2) = mpsc::channel(16);
        tx2.send(hello()).await.unwrap();
        let mut new = Outbound::new(rx2, activations, Arc::clone(&state), "n1".into());
        assert_eq!(next(&mut new).await.as_deref(), Some("hello"));
        assert_eq!(next(&mut new).await.as_deref(), Some("load"));
        assert_eq!(next(&mut new).await.as_deref(), Some("activate ns/a n1"));
        // The old stream polled again still takes nothing (and is over).
        state.activate.send("ns/a".into());
        assert_eq!(next(&mut old).await, None);
        assert_eq!(next(&mut new).await.as_deref(), Some("load"));
        drop(tx2);
    }
}
