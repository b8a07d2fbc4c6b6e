//! A request body that can be sent again: the first attempt reads the
//! downstream body and keeps a copy of what it read, up to
//! [`REPLAY_LIMIT`] bytes; a retry replays the copy, then goes on reading
//! the downstream body where the first attempt stopped. What lets a gRPC
//! call (a POST with a body) be retried, as Envoy's retry buffer does.
//!
//! Invariant: a replayed body is byte for byte the downstream body, or it
//! never ends. Every frame the newest attempt has not sent is kept, so
//! the newest never waits on another attempt: an older attempt whose
//! connection reads on (hyper sends a body after an early answer) reads
//! for it too, at most [`REPLAY_LIMIT`] bytes ahead of it (then it waits
//! its turn), and every attempt waiting for a frame is woken when another
//! reads one. Once the copy outgrew the limit no new attempt can be made
//! ([`Replay::attempt`] is `None`); an older attempt still reading behind
//! frames that were dropped then waits forever rather than send a body
//! with a hole (its stream is dropped with its exchange).
//!
//! The copy lives only while another attempt may need it: a body kept
//! only for a reconnect ([`Keep::Reconnect`]: a request released from an
//! activation hold whose connect failed, so nothing was read) keeps no
//! byte the newest attempt sent, and once no retry can follow
//! ([`RequestBody::seal`]: the last attempt is under way, or a response
//! was chosen) or past the limit, what the newest attempt sent is dropped.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};

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

    /// Whether another attempt can be made ([`Self::attempt`] is `Some`).
    pub fn replayable(&self) -> bool {
        match self {
            Self::Once(_) => true,
            Self::Replay(r) => r.replayable(),
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

impl Kept {
    fn len(&self) -> usize {
        match self {
            Self::Data(d) => d.len(),
            Self::Trailers(_) => 0,
        }
    }
}

/// The attempts waiting for the shared body. The downstream body wakes
/// one waker (the last it was polled with), and more than one attempt
/// may wait on it: it is polled with this one, which wakes them all.
#[derive(Debug, Default)]
struct Waiters(Mutex<Vec<Waker>>);

impl Waiters {
    fn add(&self, waker: &Waker) {
        let mut list = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if !list.iter().any(|w| w.will_wake(waker)) {
            list.push(waker.clone());
        }
    }

    /// Wakes every waiting attempt but `own` (the one that just read).
    fn wake_others(&self, own: Option<&Waker>) {
        let list = std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner));
        for w in list {
            if !own.is_some_and(|o| o.will_wake(&w)) {
                w.wake();
            }
        }
    }
}

impl Wake for Waiters {
    fn wake(self: Arc<Self>) {
        self.wake_others(None);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wake_others(None);
    }
}

#[derive(Debug)]
struct Shared {
    source: UpstreamBody,
    /// Frames read from `source`, in order, from frame `dropped` on.
    kept: VecDeque<Kept>,
    /// Frames dropped from the front of `kept` (sent by the newest
    /// attempt after a seal or past the limit): no new attempt can be
    /// made once it is not 0.
    dropped: usize,
    kept_bytes: usize,
    /// Most bytes kept for a new attempt.
    limit: usize,
    /// Frames read from `source` so far.
    pulled: usize,
    /// The copy outgrew `limit`: no new attempt can be made, and what the
    /// newest attempt sent is dropped.
    over_limit: bool,
    /// No retry follows: what the newest attempt sent is dropped.
    sealed: bool,
    /// The newest attempt and how many frames it has sent. Every frame it
    /// has not sent is kept, whatever `sealed` and `over_limit` say.
    newest: (u64, usize),
    /// `source` has ended.
    ended: bool,
    /// Attempts waiting for a frame another attempt reads.
    waiters: Arc<Waiters>,
    /// Wakes all of `waiters`: what `source` is polled with.
    fanout: Waker,
}

impl Shared {
    /// After a seal or past the limit: drops the frames the newest attempt
    /// has sent. True when it dropped any (an older attempt waiting for
    /// room may read on).
    fn drop_sent(&mut self) -> bool {
        let mut freed = false;
        while (self.sealed || self.over_limit) && self.dropped < self.newest.1 {
            let Some(k) = self.kept.pop_front() else {
                break;
            };
            self.kept_bytes -= k.len();
            self.dropped += 1;
            freed = true;
        }
        if self.kept.is_empty() {
            self.kept = VecDeque::new();
        }
        freed
    }

    /// Whether a new attempt can still send the whole body from the copy.
    fn replayable(&self) -> bool {
        !self.over_limit && self.dropped == 0
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
        let waiters = Arc::new(Waiters::default());
        Self(Arc::new(Mutex::new(Shared {
            source,
            kept: VecDeque::new(),
            dropped: 0,
            kept_bytes: 0,
            limit,
            pulled: 0,
            over_limit: false,
            sealed: false,
            newest: (0, 0),
            ended: false,
            fanout: Waker::from(Arc::clone(&waiters)),
            waiters,
        })))
    }

    /// The body of a new attempt, from the start; `None` once a frame
    /// read is not kept (the copy outgrew its limit, or was dropped).
    pub fn attempt(&self) -> Option<UpstreamBody> {
        let mut shared = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if !shared.replayable() {
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

    /// No retry follows: nothing more is kept but what the newest attempt
    /// has not sent yet, and the copy is dropped as it sends it (at once
    /// for what it sent already).
    pub fn seal(&self) {
        let mut shared = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        shared.sealed = true;
        if shared.drop_sent() {
            shared.waiters.wake_others(None);
        }
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
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replayable()
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
    type Error = crate::request::body::BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, crate::request::body::BodyError>>> {
        let shared = Arc::clone(&self.shared);
        let mut s = shared.lock().unwrap_or_else(PoisonError::into_inner);
        let newest = s.newest.0 == self.generation;
        if self.cursor < s.pulled {
            // Behind the front: replay the copy. Its frame is gone only
            // for an older attempt (the newest's are kept), which then
            // never ends rather than skip bytes.
            let at = self.cursor.checked_sub(s.dropped);
            let Some(k) = at.and_then(|i| s.kept.get(i)).cloned() else {
                debug_assert!(!newest, "a frame the newest attempt needs was dropped");
                return Poll::Pending;
            };
            self.cursor += 1;
            if newest {
                s.newest.1 = self.cursor;
                if s.drop_sent() {
                    s.waiters.wake_others(Some(cx.waker()));
                }
            }
            return Poll::Ready(Some(Ok(match k {
                Kept::Data(d) => Frame::data(d),
                Kept::Trailers(t) => Frame::trailers(t),
            })));
        }
        if s.ended {
            return Poll::Ready(None);
        }
        // An older attempt reads ahead of the newest only while what it
        // reads (kept for the newest) fits the limit.
        s.waiters.add(cx.waker());
        if !newest && s.kept_bytes >= s.limit {
            return Poll::Pending;
        }
        let fanout = s.fanout.clone();
        let polled = Pin::new(&mut s.source).poll_frame(&mut Context::from_waker(&fanout));
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
        if polled.is_ready() {
            // The others may be waiting for this frame, or for the end.
            s.waiters.wake_others(Some(cx.waker()));
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

/// Keeps a copy of `frame` (just read): past the limit, or once sealed,
/// only until the newest attempt has sent it.
fn keep(s: &mut Shared, frame: &Frame<Bytes>) {
    let kept = if let Some(d) = frame.data_ref() {
        Kept::Data(d.clone())
    } else if let Some(t) = frame.trailers_ref() {
        Kept::Trailers(t.clone())
    } else {
        // No other kind of frame exists; kept empty so indices stay true.
        Kept::Data(Bytes::new())
    };
    s.kept_bytes += kept.len();
    s.kept.push_back(kept);
    if s.kept_bytes > s.limit {
        s.over_limit = true;
    }
    s.drop_sent();
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody};

    fn source(chunks: &[&'static [u8]]) -> UpstreamBody {
        let frames: Vec<Result<Frame<Bytes>, crate::request::body::BodyError>> = chunks
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
        let mut newest = r.attempt().expect("second");
        // `first` (older) reads past the limit: no new attempt.
        assert!(first.frame().await.is_some());
        assert!(first.frame().await.is_some());
        assert!(!r.replayable() && r.attempt().is_none());
        // The newest has sent nothing: it still gets every byte, the copy
        // dropped as it sends it.
        let mut cx = Context::from_waker(Waker::noop());
        assert!(
            Pin::new(&mut first).poll_frame(&mut cx).is_pending(),
            "the older waits: a whole copy is kept for the newest"
        );
        assert_eq!(read(newest_of(&mut newest)).await.len(), REPLAY_LIMIT + 2);
        assert_eq!(r.kept_bytes(), 0);
        // The older is behind frames that are gone: it neither ends nor
        // skips them.
        assert!(Pin::new(&mut first).poll_frame(&mut cx).is_pending());
    }

    fn newest_of(b: &mut UpstreamBody) -> UpstreamBody {
        std::mem::replace(
            b,
            http_body_util::Empty::new().map_err(|n| match n {}).boxed(),
        )
    }

    fn poll(b: &mut UpstreamBody, cx: &mut Context<'_>) -> Poll<Option<Vec<u8>>> {
        Pin::new(b)
            .poll_frame(cx)
            .map(|f| f.map(|f| f.expect("ok").into_data().expect("data").to_vec()))
    }

    /// The last attempt (sealed) caught up with the copy; then the first
    /// attempt's connection reads on (hyper keeps sending it after an
    /// early 503): the frame it reads is the newest's too.
    #[tokio::test]
    async fn the_newest_gets_a_frame_an_older_attempt_reads_after_it_caught_up() {
        let mut b = RequestBody::new(source(&[b"ab", b"cd", b"ef"]), Keep::Retries);
        let mut old = b.attempt().expect("first");
        old.frame().await.expect("frame").expect("ok");
        let mut last = b.attempt().expect("retry");
        b.seal();
        let mut cx = Context::from_waker(Waker::noop());
        assert_eq!(poll(&mut last, &mut cx), Poll::Ready(Some(b"ab".to_vec())));
        assert_eq!(b.kept_bytes(), 0);
        assert_eq!(poll(&mut old, &mut cx), Poll::Ready(Some(b"cd".to_vec())));
        assert_eq!(b.kept_bytes(), 2, "kept until the newest sent it");
        assert_eq!(poll(&mut last, &mut cx), Poll::Ready(Some(b"cd".to_vec())));
        assert_eq!(b.kept_bytes(), 0);
        assert_eq!(read(last).await, b"ef");
    }

    /// Counts its wakes.
    #[derive(Default)]
    struct Count(std::sync::atomic::AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// The downstream body wakes only the last waker it was polled with:
    /// an attempt waiting for it is woken when another reads the frame.
    #[tokio::test]
    async fn an_attempt_waiting_at_the_front_is_woken_when_another_reads() {
        let (tx, rx) =
            tokio::sync::mpsc::channel::<Result<Frame<Bytes>, crate::request::body::BodyError>>(4);
        let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed();
        let mut b = RequestBody::new(body, Keep::Retries);
        let mut old = b.attempt().expect("first");
        let mut last = b.attempt().expect("retry");
        b.seal();
        let (w_last, w_old) = (Arc::new(Count::default()), Arc::new(Count::default()));
        let waker_last = Waker::from(Arc::clone(&w_last));
        let waker_old = Waker::from(Arc::clone(&w_old));
        let mut cx_last = Context::from_waker(&waker_last);
        let mut cx_old = Context::from_waker(&waker_old);
        assert!(poll(&mut last, &mut cx_last).is_pending());
        assert!(poll(&mut old, &mut cx_old).is_pending());
        tx.send(Ok(Frame::data(Bytes::from_static(b"ab"))))
            .await
            .expect("send");
        assert_eq!(
            poll(&mut old, &mut cx_old),
            Poll::Ready(Some(b"ab".to_vec()))
        );
        assert!(
            w_last.0.load(std::sync::atomic::Ordering::SeqCst) > 0,
            "woken"
        );
        assert_eq!(
            poll(&mut last, &mut cx_last),
            Poll::Ready(Some(b"ab".to_vec()))
        );
        drop(tx);
        assert_eq!(poll(&mut last, &mut cx_last), Poll::Ready(None));
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

    fn owned_source(chunks: &[Vec<u8>]) -> UpstreamBody {
        let frames: Vec<Result<Frame<Bytes>, crate::request::body::BodyError>> = chunks
            .iter()
            .map(|c| Ok(Frame::data(Bytes::from(c.clone()))))
            .collect();
        StreamBody::new(tokio_stream::iter(frames)).boxed()
    }

    proptest::proptest! {
        /// An older attempt reading on (its connection sends on after an
        /// early answer) interleaved with the newest, sealed at any step,
        /// any limit: the newest sends exactly the downstream body, never
        /// waits on the older, the older sends a prefix of it (no hole),
        /// and the copy stays within the limit plus one frame.
        #[test]
        fn the_newest_sends_the_whole_body_whoever_reads_first(
            sizes in proptest::collection::vec(0usize..40, 0..8),
            limit in 0usize..120,
            older_first in 0usize..4,
            steps in proptest::collection::vec(proptest::bool::ANY, 0..24),
            seal_at in proptest::option::of(0usize..24),
        ) {
            let chunks: Vec<Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| (0..n).map(|j| ((i * 31 + j) % 251) as u8).collect())
                .collect();
            let whole: Vec<u8> = chunks.concat();
            let r = Replay::with_limit(owned_source(&chunks), limit);
            let mut cx = Context::from_waker(Waker::noop());
            let mut older = r.attempt().expect("first");
            let mut old_got = Vec::new();
            for _ in 0..older_first {
                if let Poll::Ready(Some(d)) = poll(&mut older, &mut cx) {
                    old_got.extend(d);
                }
            }
            let Some(mut newest) = r.attempt() else {
                // Not offered only once more than the limit was read.
                proptest::prop_assert!(old_got.len() > limit);
                return Ok(());
            };
            let mut got = Vec::new();
            let mut done = false;
            let max_frame = sizes.iter().copied().max().unwrap_or(0);
            for (i, older_reads) in steps.into_iter().enumerate() {
                if seal_at == Some(i) {
                    r.seal();
                }
                if older_reads {
                    if let Poll::Ready(Some(d)) = poll(&mut older, &mut cx) {
                        old_got.extend(d);
                    }
                } else if !done {
                    match poll(&mut newest, &mut cx) {
                        Poll::Ready(Some(d)) => got.extend(d),
                        Poll::Ready(None) => done = true,
                        Poll::Pending => proptest::prop_assert!(false, "the newest waits"),
                    }
                }
                proptest::prop_assert!(r.kept_bytes() <= limit + max_frame);
            }
            r.seal();
            while !done {
                match poll(&mut newest, &mut cx) {
                    Poll::Ready(Some(d)) => got.extend(d),
                    Poll::Ready(None) => done = true,
                    Poll::Pending => proptest::prop_assert!(false, "the newest waits"),
                }
            }
            proptest::prop_assert_eq!(&got, &whole);
            proptest::prop_assert_eq!(&old_got[..], &whole[..old_got.len()]);
            proptest::prop_assert_eq!(r.kept_bytes(), 0, "sealed, all sent");
        }

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
