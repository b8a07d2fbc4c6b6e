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

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use meshless_api::v1::{self, ClientMessage, client_message};
use tokio::sync::mpsc;
use tokio_stream::Stream;

use crate::state::ProxyState;

/// The activation requests of held requests (service names), shared by
/// the streams of successive sessions.
pub(crate) type Activations = Arc<Mutex<mpsc::UnboundedReceiver<String>>>;

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
        let mut rx = self
            .activations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut services: Vec<String> = Vec::new();
        // `Ready(None)`: the proxy is gone; the session's channel ends the
        // stream.
        while let Poll::Ready(Some(service)) = rx.poll_recv(cx) {
            if !services.contains(&service) {
                services.push(service);
            }
        }
        services
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
            services: crate::control_link::loads(&this.state),
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
