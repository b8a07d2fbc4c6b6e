//! A request body that can be sent again: the first attempt reads the
//! downstream body and keeps a copy of what it read, up to
//! [`REPLAY_LIMIT`] bytes; a retry replays the copy, then goes on reading
//! the downstream body where the first attempt stopped. What lets a gRPC
//! call (a POST with a body) be retried, as Envoy's retry buffer does.
//!
//! Invariant: a replayed body is byte for byte the downstream body, or it
//! never ends. Once the copy outgrew the limit it is dropped and no new
//! attempt can be made ([`Replay::attempt`] is `None`); an older attempt
//! still reading behind the newest one then waits forever rather than
//! send a body with a hole (its stream is dropped with its exchange).

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

use crate::upstream::UpstreamBody;

/// Most request body bytes kept for a retry (Envoy's default retry buffer
/// is the connection buffer limit, 1 MiB; gRPC unary requests are small).
pub const REPLAY_LIMIT: usize = 64 * 1024;

/// A request's body as its attempts send it.
#[derive(Debug)]
pub enum RequestBody {
    /// Sent once; later attempts (of a request without a body) send none.
    Once(Option<UpstreamBody>),
    /// Kept for retries.
    Replay(Replay),
}

impl RequestBody {
    /// `body`, kept for retries when `retryable` and it has any bytes.
    pub fn new(body: UpstreamBody, retryable: bool) -> Self {
        if retryable && !body.is_end_stream() {
            Self::Replay(Replay::new(body))
        } else {
            Self::Once(Some(body))
        }
    }

    /// The body of the next attempt; `None` when it cannot be sent again.
    pub fn attempt(&mut self) -> Option<UpstreamBody> {
        match self {
            Self::Once(b) => Some(b.take().unwrap_or_else(|| {
                http_body_util::Empty::new()
                    .map_err(|never| match never {})
                    .boxed()
            })),
            Self::Replay(r) => r.attempt(),
        }
    }
}

/// A frame kept for replay.
#[derive(Debug, Clone)]
enum Kept {
    Data(Bytes),
    Trailers(HeaderMap),
}

#[derive(Debug)]
struct Shared {
    source: UpstreamBody,
    /// Frames read from `source`, in order, while within the limit.
    kept: Vec<Kept>,
    kept_bytes: usize,
    /// Frames read from `source` so far.
    pulled: usize,
    /// Frames past the limit were read: `kept` is gone.
    overflowed: bool,
    /// `source` has ended.
    ended: bool,
}

/// The downstream body of one request, shared by its attempts.
#[derive(Debug, Clone)]
pub struct Replay(Arc<Mutex<Shared>>);

impl Replay {
    /// Wraps the downstream body.
    pub fn new(source: UpstreamBody) -> Self {
        Self(Arc::new(Mutex::new(Shared {
            source,
            kept: Vec::new(),
            kept_bytes: 0,
            pulled: 0,
            overflowed: false,
            ended: false,
        })))
    }

    /// The body of a new attempt, from the start; `None` once the copy
    /// outgrew [`REPLAY_LIMIT`].
    pub fn attempt(&self) -> Option<UpstreamBody> {
        let shared = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if shared.overflowed {
            return None;
        }
        Some(
            AttemptBody {
                shared: Arc::clone(&self.0),
                cursor: 0,
            }
            .boxed(),
        )
    }

    /// Whether another attempt can still be made.
    pub fn replayable(&self) -> bool {
        !self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .overflowed
    }
}

/// One attempt's reading of a [`Replay`].
#[derive(Debug)]
struct AttemptBody {
    shared: Arc<Mutex<Shared>>,
    /// Frames this attempt has sent.
    cursor: usize,
}

impl Body for AttemptBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let shared = Arc::clone(&self.shared);
        let mut s = shared.lock().unwrap_or_else(PoisonError::into_inner);
        if self.cursor < s.pulled {
            // Behind the newest attempt: replay the copy, or (the copy is
            // gone) never end rather than skip bytes.
            let Some(k) = s.kept.get(self.cursor).cloned() else {
                return Poll::Pending;
            };
            self.cursor += 1;
            return Poll::Ready(Some(Ok(match k {
                Kept::Data(d) => Frame::data(d),
                Kept::Trailers(t) => Frame::trailers(t),
            })));
        }
        if s.ended {
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut s.source).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                s.pulled += 1;
                self.cursor += 1;
                keep(&mut s, frame);
            }
            Poll::Ready(None) => s.ended = true,
            Poll::Ready(Some(Err(_))) | Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        let s = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        self.cursor >= s.pulled && (s.ended || s.source.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let s = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        if self.cursor == 0 && s.pulled == 0 {
            s.source.size_hint()
        } else {
            SizeHint::default()
        }
    }
}

/// Keeps a copy of `frame`, or drops every copy when over the limit.
fn keep(s: &mut Shared, frame: &Frame<Bytes>) {
    if s.overflowed {
        return;
    }
    let kept = if let Some(d) = frame.data_ref() {
        s.kept_bytes += d.len();
        Kept::Data(d.clone())
    } else if let Some(t) = frame.trailers_ref() {
        Kept::Trailers(t.clone())
    } else {
        return;
    };
    if s.kept_bytes > REPLAY_LIMIT {
        s.overflowed = true;
        s.kept = Vec::new();
    } else {
        s.kept.push(kept);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody};

    fn source(chunks: &[&'static [u8]]) -> UpstreamBody {
        let frames: Vec<Result<Frame<Bytes>, hyper::Error>> = chunks
            .iter()
            .map(|c| Ok(Frame::data(Bytes::from_static(c))))
            .collect();
        StreamBody::new(tokio_stream::iter(frames)).boxed()
    }

    async fn read(body: UpstreamBody) -> Vec<u8> {
        body.collect().await.expect("body").to_bytes().to_vec()
    }

    #[tokio::test]
    async fn every_attempt_sends_the_whole_body() {
        let r = Replay::new(source(&[b"ab", b"cd", b"ef"]));
        let mut first = r.attempt().expect("first");
        // The first attempt fails after one frame.
        let f = first.frame().await.expect("frame").expect("ok");
        assert_eq!(f.into_data().expect("data"), &b"ab"[..]);
        drop(first);
        // The retry replays it, then reads on.
        assert_eq!(read(r.attempt().expect("retry")).await, b"abcdef");
        // And another, all from the copy.
        assert_eq!(read(r.attempt().expect("again")).await, b"abcdef");
    }

    #[tokio::test]
    async fn past_the_limit_there_is_no_retry_and_no_hole() {
        static BIG: [u8; REPLAY_LIMIT] = [7; REPLAY_LIMIT];
        let r = Replay::new(source(&[b"x", &BIG, b"y"]));
        let mut first = r.attempt().expect("first");
        let mut behind = r.attempt().expect("second");
        // `first` reads past the limit: the copy is dropped.
        assert!(first.frame().await.is_some());
        assert!(first.frame().await.is_some());
        assert!(!r.replayable() && r.attempt().is_none());
        // `behind` has sent nothing and the copy is gone: it must neither
        // end nor skip frames, so it stays pending.
        let waker = futures_noop();
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut behind).poll_frame(&mut cx).is_pending());
        // The reader in front finishes normally.
        assert!(first.frame().await.is_some());
        assert!(first.frame().await.is_none());
    }

    fn futures_noop() -> std::task::Waker {
        std::task::Waker::noop().clone()
    }

    fn owned_source(chunks: &[Vec<u8>]) -> UpstreamBody {
        let frames: Vec<Result<Frame<Bytes>, hyper::Error>> = chunks
            .iter()
            .map(|c| Ok(Frame::data(Bytes::from(c.clone()))))
            .collect();
        StreamBody::new(tokio_stream::iter(frames)).boxed()
    }

    proptest::proptest! {
        /// Attempts that each read a prefix and fail, then one that reads
        /// to the end: the last sends exactly the downstream bytes when
        /// they fit the limit; past it no further attempt is offered.
        #[test]
        fn a_retry_sends_exactly_the_downstream_body(
            sizes in proptest::collection::vec(0usize..40_000, 0..8),
            failed_after in proptest::collection::vec(0usize..10, 0..4),
        ) {
            // Bytes that differ by position, so a skipped or repeated frame shows.
            let chunks: Vec<Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| (0..n).map(|j| ((i * 31 + j) % 251) as u8).collect())
                .collect();
            let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
            rt.block_on(async {
                let whole: Vec<u8> = chunks.concat();
                let r = Replay::new(owned_source(&chunks));
                for k in failed_after {
                    let Some(mut a) = r.attempt() else { break };
                    for _ in 0..k {
                        if a.frame().await.is_none() {
                            break;
                        }
                    }
                }
                match r.attempt() {
                    Some(last) => proptest::prop_assert_eq!(read(last).await, whole),
                    // Offered no more only once more than the limit was read.
                    None => proptest::prop_assert!(whole.len() > REPLAY_LIMIT),
                }
                Ok(())
            })?;
        }
    }
}
