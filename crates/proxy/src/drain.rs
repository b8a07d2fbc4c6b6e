//! What a listener asks of its connections while it drains, and how a
//! hyper connection is driven through a drain.

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;

/// What a listener asks of its connections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Drain {
    /// Serve on.
    #[default]
    Serving,
    /// Finish what is in flight, then close: an idle HTTP/1 connection
    /// closes at once, a busy one after its response (`connection:
    /// close`); HTTP/2 gets a GOAWAY.
    Now,
    /// As `Now` for HTTP/2; HTTP/1 keeps its connection and answers its
    /// next request with `connection: close`, then closes (Envoy's drain,
    /// HAProxy's `idle-close-on-response`): a keep-alive client never sees
    /// a close racing the request it is sending. A connection accepted
    /// but not yet speaking is served the same way. Idle ones close when
    /// the drain ends.
    OnNextResponse,
}

/// Polls `conn` to its end. Once `draining` asks (or its listener is
/// gone), asks it to `shutdown` gracefully and polls on; or, for
/// [`Drain::OnNextResponse`] on HTTP/1 (`closing` given), raises `closing`
/// so that its next response says `connection: close`, and polls on
/// until the drain turns to `Now` (then as above).
pub async fn drive<C: Future>(
    conn: C,
    mut draining: watch::Receiver<Drain>,
    closing: Option<&AtomicBool>,
    shutdown: impl FnOnce(Pin<&mut C>),
) {
    let mut conn = pin!(conn);
    let mode = tokio::select! {
        _ = conn.as_mut() => return,
        d = draining.wait_for(|d| *d != Drain::Serving) => d.map_or(Drain::Now, |d| *d),
    };
    if let (Drain::OnNextResponse, Some(closing)) = (mode, closing) {
        closing.store(true, Ordering::Release);
        // The drain may turn to `Now` (a shutdown's `drain_delay` ends):
        // an idle connection closes then, a busy one after its response.
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = draining.wait_for(|d| *d == Drain::Now) => {}
        }
    }
    shutdown(conn.as_mut());
    conn.await;
}
