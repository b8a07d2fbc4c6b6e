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
//!
//! The copy lives only while another attempt may need it: a body kept
//! only for a reconnect ([`Keep::Reconnect`]: a request released from an
//! activation hold whose connect failed, so nothing was read) keeps no
//! byte, and once no retry can follow ([`RequestBody::seal`]: the last
//! attempt is under way, or a response was chosen) nothing more is copied
//! and what was is dropped as the newest attempt replays it.

use std::collections::VecDeque;
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

/// What a request's body is kept for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Nothing: one attempt.
    No,
    /// A new attempt only while no byte was read (a connect that failed):
    /// no copy.
    Reconnect,
    /// Retries: a copy up to [`REPLAY_LIMIT`].
    Retries,
}

/// A request's body as its attempts send it.
#[derive(Debug)]
pub enum RequestBody {
    /// Sent once; later attempts (of a request without a body) send none.
    Once(Option<UpstreamBody>),
    /// Kept for retries.
    Replay(Replay),
}

impl RequestBody {
    /// `body`, kept as `keep` says when it has any bytes.
    pub fn new(body: UpstreamBody, keep: Keep) -> Self {
        let limit = match keep {
            _ if body.is_end_stream() => return Self::Once(Some(body)),
            Keep::No => return Self::Once(Some(body)),
            Keep::Reconnect => 0,
            Keep::Retries => REPLAY_LIMIT,
        };
        Self::Replay(Replay::with_limit(body, limit))
    }

    /// No retry follows the attempt under way: copy nothing more, and drop
    /// the copy as that attempt replays it.
    pub fn seal(&self) {
        if let Self::Replay(r) = self {
            r.seal();
        }
    }

    /// Bytes of the copy kept now.
    pub fn kept_bytes(&self) -> usize {
        match self {
            Self::Once(_) => 0,
            Self::Replay(r) => r.kept_bytes(),
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
    /// Frames read from `source`, in order, from frame `dropped` on.
    kept: VecDeque<Kept>,
    /// Frames dropped from the front of `kept` (after a seal).
    dropped: usize,
    kept_bytes: usize,
    /// Most bytes kept.
    limit: usize,
    /// Frames read from `source` so far.
    pulled: usize,
    /// A frame read is not in `kept` (past the limit, or dropped after a
    /// seal): no new attempt can be made.
    overflowed: bool,
    /// No retry follows: nothing more is kept.
    sealed: bool,
    /// The newest attempt and how many frames it has sent.
    newest: (u64, usize),
    /// `source` has ended.
    ended: bool,
}

impl Shared {
    /// After a seal: drops the frames the newest attempt has sent.
    fn drop_sent(&mut self) {
        while self.sealed && self.dropped < self.newest.1 {
            let Some(k) = self.kept.pop_front() else {
                break;
            };
            if let Kept::Data(d) = k {
                self.kept_bytes -= d.len();
            }
            self.dropped += 1;
            self.overflowed = true;
        }
        if self.kept.is_empty() {
            self.kept = VecDeque::new();
        }
    }
}

/// The downstream body of one request, shared by its attempts.
#[derive(Debug, Clone)]
pub struct Replay(Arc<Mutex<Shared>>);

impl Replay {
    /// Wraps the downstream body, keeping up to [`REPLAY_LIMIT`] bytes.
    pub fn new(source: UpstreamBody) -> Self {
        Self::with_limit(source, REPLAY_LIMIT)
    }

    /// Wraps the downstream body, keeping up to `limit` bytes.
    pub fn with_limit(source: UpstreamBody, limit: usize) -> Self {
        Self(Arc::new(Mutex::new(Shared {
            source,
            kept: VecDeque::new(),
            dropped: 0,
            kept_bytes: 0,
            limit,
            pulled: 0,
            overflowed: false,
            sealed: false,
            newest: (0, 0),
            ended: false,
        })))
    }

    /// The body of a new attempt, from the start; `None` once a frame
    /// read is not kept (the copy outgrew its limit, or was dropped).
    pub fn attempt(&self) -> Option<UpstreamBody> {
        let mut shared = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if shared.overflowed {
            return None;
        }
        let generation = shared.newest.0 + 1;
        shared.newest = (generation, 0);
        Some(
            AttemptBody {
                shared: Arc::clone(&self.0),
                cursor: 0,
                generation,
            }
            .boxed(),
        )
    }

    /// No retry follows: nothing more is kept, and the copy is dropped as
    /// the newest attempt sends it (at once for what it sent already).
    pub fn seal(&self) {
        let mut shared = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        shared.sealed = true;
        shared.drop_sent();
    }

    /// Bytes of the copy kept now.
    pub fn kept_bytes(&self) -> usize {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .kept_bytes
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
    /// Its place among the attempts (the newest has the highest).
    generation: u64,
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
        let newest = s.newest.0 == self.generation;
        if self.cursor < s.pulled {
            // Behind the front: replay the copy, or (the copy is gone)
            // never end rather than skip bytes.
            let at = self.cursor.checked_sub(s.dropped);
            let Some(k) = at.and_then(|i| s.kept.get(i)).cloned() else {
                return Poll::Pending;
            };
            self.cursor += 1;
            if newest {
                s.newest.1 = self.cursor;
                s.drop_sent();
            }
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
                if newest {
                    s.newest.1 = self.cursor;
                }
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

/// Keeps a copy of `frame`, or drops every copy when over the limit or
/// sealed.
fn keep(s: &mut Shared, frame: &Frame<Bytes>) {
    if s.overflowed && s.kept.is_empty() {
        return;
    }
    let kept = if let Some(d) = frame.data_ref() {
        Kept::Data(d.clone())
    } else if let Some(t) = frame.trailers_ref() {
        Kept::Trailers(t.clone())
    } else {
        return;
    };
    let len = frame.data_ref().map_or(0, Bytes::len);
    // Sealed, the newest attempt reading at the front needs no copy (one
    // behind it still does).
    let front = s.sealed && s.newest.1 >= s.pulled;
    if front || s.kept_bytes + len > s.limit {
        s.overflowed = true;
        s.kept = VecDeque::new();
        s.kept_bytes = 0;
    } else {
        s.kept_bytes += len;
        s.kept.push_back(kept);
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

    #[tokio::test]
    async fn a_body_kept_for_a_reconnect_keeps_no_byte() {
        let mut b = RequestBody::new(source(&[b"ab", b"cd"]), Keep::Reconnect);
        // A connect failed: nothing was read, a new attempt is made.
        drop(b.attempt().expect("first"));
        let mut sent = b.attempt().expect("reconnect");
        let f = sent.frame().await.expect("frame").expect("ok");
        assert_eq!(f.into_data().expect("data"), &b"ab"[..]);
        assert_eq!(b.kept_bytes(), 0, "no copy");
        assert!(b.attempt().is_none(), "read from: it cannot be sent again");
        assert_eq!(read(sent).await, b"cd");
    }

    #[tokio::test]
    async fn sealed_the_copy_goes_as_the_last_attempt_replays_it() {
        let mut b = RequestBody::new(source(&[b"ab", b"cd", b"ef"]), Keep::Retries);
        let mut first = b.attempt().expect("first");
        for _ in 0..2 {
            first.frame().await.expect("frame").expect("ok");
        }
        drop(first);
        assert_eq!(b.kept_bytes(), 4);
        let mut last = b.attempt().expect("retry");
        b.seal();
        assert_eq!(b.kept_bytes(), 4, "not replayed yet");
        let f = last.frame().await.expect("frame").expect("ok");
        assert_eq!(f.into_data().expect("data"), &b"ab"[..]);
        assert_eq!(b.kept_bytes(), 2, "replayed, dropped");
        assert!(b.attempt().is_none(), "no attempt after a drop");
        assert_eq!(read(last).await, b"cdef");
        assert_eq!(b.kept_bytes(), 0);
    }

    #[tokio::test]
    async fn sealed_at_the_front_the_copy_goes_at_once() {
        let mut b = RequestBody::new(source(&[b"ab", b"cd"]), Keep::Retries);
        let mut only = b.attempt().expect("first");
        only.frame().await.expect("frame").expect("ok");
        assert_eq!(b.kept_bytes(), 2);
        // A response was chosen: no attempt follows.
        b.seal();
        assert_eq!(b.kept_bytes(), 0);
        assert_eq!(read(only).await, b"cd");
        assert_eq!(b.kept_bytes(), 0, "nothing copied after the seal");
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
            sealed_after in proptest::option::of(0usize..10),
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
                    // The last attempt, sealed (when `sealed_after`) after
                    // it sent that many frames: still every byte, and no
                    // copy left at its end.
                    Some(mut last) => {
                        let mut got = Vec::new();
                        let mut n = 0;
                        loop {
                            if sealed_after == Some(n) {
                                r.seal();
                            }
                            let Some(f) = last.frame().await else { break };
                            got.extend_from_slice(&f.expect("ok").into_data().expect("data"));
                            n += 1;
                        }
                        proptest::prop_assert_eq!(got, whole);
                        if sealed_after.is_some_and(|k| k <= n) {
                            proptest::prop_assert_eq!(r.kept_bytes(), 0);
                        }
                    }
                    // Offered no more only once more than the limit was read.
                    None => proptest::prop_assert!(whole.len() > REPLAY_LIMIT),
                }
                Ok(())
            })?;
        }
    }
}
