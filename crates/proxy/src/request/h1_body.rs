//! A request body read by the meshless HTTP/1 connection (`h1serve`)
//! and sent upstream. The body is
//! polled by the upstream connection's task and filled by the downstream
//! connection's task, one frame at a time through a slot both share: the
//! connection reads body bytes only once the body has been polled (so
//! `100 Continue` is written when the body is first wanted, as hyper
//! does) and only while the slot is empty (back-pressure). Data frames are
//! slices of the read buffer frozen to `Bytes`: no copy. A request without
//! a body shares nothing and allocates nothing ([`RequestBody::empty`]).

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use meshless_h1::chunked::{self, Decoder, Step};

use crate::request::body::BodyError;

/// Why a request body ended before its framing said it would.
#[derive(Debug, thiserror::Error)]
pub enum BodyFault {
    /// The client closed (or reset) its connection mid-body.
    #[error("request body cut short: {0}")]
    CutShort(&'static str),
    /// The chunked coding broke its grammar or a limit.
    #[error(transparent)]
    Malformed(#[from] meshless_h1::Error),
}

/// What the two sides share.
#[derive(Debug, Default)]
struct Shared {
    /// The next frame, handed over by the connection.
    frame: Option<Result<Frame<Bytes>, BodyFault>>,
    /// The connection handed over the last frame (or an error).
    done: bool,
    /// The body has been polled (its bytes are wanted).
    wanted: bool,
    /// The body was dropped: nobody reads what is left.
    dropped: bool,
    /// Data bytes still to come, when the length is known.
    remaining: Option<u64>,
    body: Option<Waker>,
    conn: Option<Waker>,
}

fn lock(s: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    s.lock().unwrap_or_else(PoisonError::into_inner)
}

fn wake(slot: &mut Option<Waker>) {
    if let Some(w) = slot.take() {
        w.wake();
    }
}

fn register(slot: &mut Option<Waker>, cx: &Context<'_>) {
    match slot {
        Some(w) if w.will_wake(cx.waker()) => {}
        _ => *slot = Some(cx.waker().clone()),
    }
}

/// The upstream side: an `http_body::Body` of the request.
#[derive(Debug)]
pub struct RequestBody {
    shared: Option<Arc<Mutex<Shared>>>,
}

impl RequestBody {
    /// A request without a body.
    pub fn empty() -> Self {
        Self { shared: None }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let Some(shared) = &self.shared else {
            return Poll::Ready(None);
        };
        let mut s = lock(shared);
        if let Some(frame) = s.frame.take() {
            wake(&mut s.conn);
            if let (Ok(f), Some(left)) = (&frame, s.remaining.as_mut())
                && let Some(d) = f.data_ref()
            {
                *left = left.saturating_sub(d.len() as u64);
            }
            return Poll::Ready(Some(frame.map_err(BodyError::from)));
        }
        if s.done {
            return Poll::Ready(None);
        }
        s.wanted = true;
        register(&mut s.body, cx);
        wake(&mut s.conn);
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.shared.as_ref().is_none_or(|s| {
            let s = lock(s);
            s.done && s.frame.is_none()
        })
    }

    fn size_hint(&self) -> SizeHint {
        let remaining = match &self.shared {
            None => Some(0),
            Some(s) => lock(s).remaining,
        };
        remaining.map_or_else(SizeHint::default, SizeHint::with_exact)
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        if let Some(shared) = &self.shared {
            let mut s = lock(shared);
            s.dropped = true;
            wake(&mut s.conn);
        }
    }
}

impl Drop for Feeder {
    /// The exchange ended (the client left, a write failed, the connection
    /// closes) with the body not all read: an upstream side still reading
    /// it is told the body was cut, never left waiting.
    fn drop(&mut self) {
        // Abandoned (or dropped upstream) bodies were told already.
        if !self.finished && !self.discarding {
            self.tell_cut("the connection ended first");
        }
    }
}

/// How the rest of the body is delimited.
#[derive(Debug)]
enum Framing {
    Length(u64),
    Chunked(Box<Decoder>),
}

/// What the connection needs next to feed the body.
#[derive(Debug, PartialEq, Eq)]
pub enum Need {
    /// Nothing now (the body is not wanted, or its slot is full): the
    /// connection's waker is registered.
    Nothing,
    /// More bytes in the read buffer.
    Bytes,
    /// The whole body has been read from the connection.
    Done,
}

/// The connection side of a request body.
#[derive(Debug)]
pub struct Feeder {
    shared: Arc<Mutex<Shared>>,
    framing: Framing,
    /// `100 Continue` is still to be written once the body is wanted.
    pub continue_due: bool,
    /// The body was dropped unread: what is left is read and discarded.
    pub discarding: bool,
    /// Bytes of the connection (framing included) discarded so far.
    pub discarded: u64,
    finished: bool,
    /// Most trailer fields (the listener's header slots, as hyper).
    max_trailers: usize,
}

impl Feeder {
    /// A body of `framing` (not `Empty`), with its upstream side.
    pub fn new(framing: &meshless_h1::Framing, max_trailers: usize) -> (Self, RequestBody) {
        let (f, remaining) = match framing.body {
            meshless_h1::Body::Length(n) => (Framing::Length(n), Some(n)),
            _ => (Framing::Chunked(Box::new(Decoder::new(max_trailers))), None),
        };
        let shared = Arc::new(Mutex::new(Shared {
            remaining,
            ..Shared::default()
        }));
        let feeder = Self {
            shared: Arc::clone(&shared),
            framing: f,
            continue_due: framing.expect_continue,
            discarding: false,
            discarded: 0,
            finished: false,
            max_trailers,
        };
        (
            feeder,
            RequestBody {
                shared: Some(shared),
            },
        )
    }

    /// Whether every byte of the body has been read off the connection.
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// Bytes of a `Content-Length` body not yet read off the connection
    /// (`None` for a chunked one, whose length is unknown).
    pub fn length_left(&self) -> Option<u64> {
        match &self.framing {
            Framing::Length(left) => Some(*left),
            Framing::Chunked(_) => None,
        }
    }

    /// Whether the body has been polled upstream (a body dropped unread
    /// was never wanted: no `100 Continue` is owed for it).
    pub fn wanted(&self) -> bool {
        lock(&self.shared).wanted
    }

    /// Hands over (or discards) what `buf` holds of the body, and says
    /// what is needed next. `Err` is a framing error: the connection
    /// cannot be read on (the body has been told).
    pub fn feed(&mut self, buf: &mut BytesMut, cx: &Context<'_>) -> Result<Need, BodyFault> {
        loop {
            if self.finished {
                return Ok(Need::Done);
            }
            let mut s = lock(&self.shared);
            if s.dropped && !self.discarding {
                self.discarding = true;
                s.frame = None;
            }
            if !self.discarding && (!s.wanted || s.frame.is_some()) {
                register(&mut s.conn, cx);
                return Ok(Need::Nothing);
            }
            drop(s);
            let before = buf.len();
            let decoded = self.decode(buf);
            if self.discarding {
                self.discarded += (before - buf.len()) as u64;
            }
            let frame = match decoded {
                Ok(Some(frame)) => frame,
                Ok(None) => return Ok(Need::Bytes),
                Err(e) => {
                    self.finished = true;
                    self.hand_over(Err(BodyFault::Malformed(e.clone())), true);
                    return Err(BodyFault::Malformed(e));
                }
            };
            let last = self.finished;
            if !self.discarding {
                self.hand_over(Ok(frame), last);
            }
        }
    }

    /// The response ended with the body not all read: what is left is
    /// read and discarded, and an upstream side still reading is told the
    /// body was cut (never that it ended).
    pub fn abandon(&mut self) {
        if self.discarding || self.finished {
            return;
        }
        self.discarding = true;
        self.tell_cut("the response ended first");
    }

    /// Tells an upstream side still reading that the body was cut
    /// (`why`), never that it ended.
    fn tell_cut(&self, why: &'static str) {
        let mut s = lock(&self.shared);
        if !s.dropped {
            s.frame = Some(Err(BodyFault::CutShort(why)));
        }
        s.done = true;
        wake(&mut s.body);
    }

    /// The connection closed (or failed) before the body ended.
    pub fn cut(&mut self, why: &'static str) {
        if !self.finished {
            self.finished = true;
            self.hand_over(Err(BodyFault::CutShort(why)), true);
        }
    }

    fn hand_over(&self, frame: Result<Frame<Bytes>, BodyFault>, last: bool) {
        let mut s = lock(&self.shared);
        let empty_data = matches!(&frame, Ok(f) if f.data_ref().is_some_and(Bytes::is_empty));
        if !s.dropped && !empty_data {
            s.frame = Some(frame);
        }
        s.done |= last;
        wake(&mut s.body);
    }

    /// The next frame from the start of `buf` (taken out of it), `None`
    /// when more bytes are needed. Sets `finished` with the last one.
    fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Frame<Bytes>>, meshless_h1::Error> {
        match &mut self.framing {
            Framing::Length(left) => {
                if buf.is_empty() {
                    return Ok(None);
                }
                let n = usize::try_from(*left).map_or(buf.len(), |l| l.min(buf.len()));
                *left -= n as u64;
                self.finished = *left == 0;
                Ok(Some(Frame::data(buf.split_to(n).freeze())))
            }
            Framing::Chunked(decoder) => match decoder.decode(&buf[..])? {
                Step::Data(range) => {
                    buf.advance(range.start);
                    Ok(Some(Frame::data(buf.split_to(range.len()).freeze())))
                }
                Step::Incomplete { consumed } => {
                    buf.advance(consumed);
                    Ok(None)
                }
                Step::Done { consumed, trailers } => {
                    let fields = trailer_map(&buf[trailers], self.max_trailers)?;
                    buf.advance(consumed);
                    self.finished = true;
                    Ok(Some(match fields {
                        Some(t) => Frame::trailers(t),
                        None => Frame::data(Bytes::new()),
                    }))
                }
            },
        }
    }
}

/// The trailer section (at most `max` fields) as a map; `None` when
/// there is none.
fn trailer_map(section: &[u8], max: usize) -> Result<Option<HeaderMap>, meshless_h1::Error> {
    if section.is_empty() {
        return Ok(None);
    }
    let mut slots = vec![httparse::EMPTY_HEADER; max];
    let fields = chunked::parse_trailers(section, &mut slots)?;
    let mut map = HeaderMap::with_capacity(fields.len());
    for f in fields {
        let bad = || meshless_h1::Error::Chunked("invalid trailer fields");
        let name = http::HeaderName::from_bytes(f.name.as_bytes()).map_err(|_| bad())?;
        let value = http::HeaderValue::from_bytes(f.value).map_err(|_| bad())?;
        map.append(name, value);
    }
    Ok(Some(map))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framing(body: meshless_h1::Body) -> meshless_h1::Framing {
        meshless_h1::Framing {
            body,
            keep_alive: true,
            expect_continue: false,
            upgrade: false,
            informational: false,
            keep_length: meshless_h1::framing::KeepLength::First,
        }
    }

    /// Feeds `wire` in pieces of `step` bytes while reading the body.
    fn round_trip(f: meshless_h1::Body, wire: &[u8], step: usize) -> Result<Vec<u8>, String> {
        let (mut feeder, mut body) = Feeder::new(&framing(f), 100);
        let mut buf = BytesMut::new();
        let mut rest = wire;
        let mut out = Vec::new();
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..10_000 {
            if let Ok(Need::Bytes) = feeder.feed(&mut buf, &cx) {
                let n = step.min(rest.len());
                if n == 0 {
                    feeder.cut("eof");
                }
                buf.extend_from_slice(&rest[..n]);
                rest = &rest[n..];
                continue;
            }
            match Pin::new(&mut body).poll_frame(&mut cx) {
                Poll::Pending => {}
                Poll::Ready(None) => return Ok(out),
                Poll::Ready(Some(Ok(f))) => {
                    if let Some(d) = f.data_ref() {
                        out.extend_from_slice(d);
                    }
                }
                Poll::Ready(Some(Err(e))) => return Err(e.to_string()),
            }
        }
        Err("no progress".into())
    }

    #[test]
    fn a_length_body_arrives_whole_in_any_pieces() {
        for step in [1, 3, 100] {
            let got = round_trip(meshless_h1::Body::Length(5), b"hello", step);
            assert_eq!(got.as_deref(), Ok(&b"hello"[..]));
        }
        let cut = round_trip(meshless_h1::Body::Length(9), b"hello", 2);
        assert!(cut.is_err());
    }

    #[test]
    fn a_chunked_body_is_decoded_and_a_broken_one_fails() {
        let wire = b"5\r\nhello\r\n3;x=y\r\nabc\r\n0\r\nx-t: 1\r\n\r\n";
        for step in [1, 4, 100] {
            let got = round_trip(meshless_h1::Body::Chunked, wire, step);
            assert_eq!(got.as_deref(), Ok(&b"helloabc"[..]));
        }
        let bad = round_trip(meshless_h1::Body::Chunked, b"5\r\nhello\r\nZZ\r\n", 3);
        assert!(bad.is_err());
    }

    /// The connection side dropped with the body half read (the client
    /// left, a write failed): the upstream side gets an error at once,
    /// never a clean end and never `Pending` forever; a pending data
    /// frame does not pass for the whole body.
    #[test]
    fn a_feeder_dropped_mid_body_cuts_it() {
        let mut cx = Context::from_waker(Waker::noop());
        let (mut feeder, mut body) = Feeder::new(&framing(meshless_h1::Body::Length(10)), 100);
        assert!(Pin::new(&mut body).poll_frame(&mut cx).is_pending());
        let mut buf = BytesMut::from(&b"hel"[..]);
        let _ = feeder.feed(&mut buf, &cx);
        drop(feeder);
        match Pin::new(&mut body).poll_frame(&mut cx) {
            Poll::Ready(Some(Err(_))) => {}
            other => panic!("expected the body to fail, got {other:?}"),
        }
        assert!(matches!(
            Pin::new(&mut body).poll_frame(&mut cx),
            Poll::Ready(None)
        ));
        // A body whose every byte was read ends cleanly however the
        // feeder goes.
        let (mut feeder, mut body) = Feeder::new(&framing(meshless_h1::Body::Length(3)), 100);
        assert!(Pin::new(&mut body).poll_frame(&mut cx).is_pending());
        let mut buf = BytesMut::from(&b"abc"[..]);
        let _ = feeder.feed(&mut buf, &cx);
        assert!(feeder.finished());
        drop(feeder);
        let frame = Pin::new(&mut body).poll_frame(&mut cx);
        assert!(matches!(frame, Poll::Ready(Some(Ok(_)))), "{frame:?}");
        assert!(matches!(
            Pin::new(&mut body).poll_frame(&mut cx),
            Poll::Ready(None)
        ));
    }

    #[test]
    fn an_empty_body_ends_at_once() {
        let b = RequestBody::empty();
        assert!(b.is_end_stream());
        assert_eq!(b.size_hint().exact(), Some(0));
    }
}
