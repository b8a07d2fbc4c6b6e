//! The downstream request body as sent upstream, with a flag that says
//! whether the client broke it (malformed chunking, cut short, reset). The
//! flag is how a failed upstream exchange is told apart: the client's fault
//! or the endpoint's.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use pin_project_lite::pin_project;

/// Set once the downstream body failed; shared by the body and the request.
/// The flag is made when a body first takes a handle ([`Self::share`]): a
/// request whose body had ended on arrival (most `GET`s) never makes one.
#[derive(Debug, Clone, Default)]
pub struct ClientFault(Option<Arc<AtomicU8>>);

/// The body ended early (its connection closed or reset mid-body).
const CUT: u8 = 1;
/// The body broke the protocol (malformed chunking, DATA past its
/// `content-length`): the client's error whatever happens after.
const MALFORMED: u8 = 2;

impl ClientFault {
    /// Whether the client's body failed.
    pub fn is_set(&self) -> bool {
        self.state() != 0
    }

    /// Whether it failed by breaking the protocol, not only by ending.
    pub fn is_malformed(&self) -> bool {
        self.state() == MALFORMED
    }

    /// A handle to this flag for a body to set, the flag made on first use.
    pub fn share(&mut self) -> Self {
        Self(Some(Arc::clone(
            self.0.get_or_insert_with(Default::default),
        )))
    }

    fn state(&self) -> u8 {
        self.0.as_ref().map_or(0, |f| f.load(Ordering::Acquire))
    }

    /// Sets the flag; a handle no body took ([`Self::share`]) has none.
    fn set(&self, malformed: bool) {
        let kind = if malformed { MALFORMED } else { CUT };
        if let Some(f) = &self.0 {
            f.fetch_max(kind, Ordering::AcqRel);
        }
    }
}

/// Whether a request body's error is the client breaking the protocol:
/// meshless-h1's chunked decoder refusing it, or h2 resetting the stream
/// for a `PROTOCOL_ERROR` of the client's (DATA past its
/// `content-length`), through hyper's error or not. A connection that
/// closed or a stream the client reset is not.
fn is_malformed(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut at = Some(e);
    while let Some(e) = at {
        if let Some(f) = e.downcast_ref::<crate::request::h1_body::BodyFault>() {
            return matches!(f, crate::request::h1_body::BodyFault::Malformed(_));
        }
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return h2.is_library() && h2.reason() == Some(h2::Reason::PROTOCOL_ERROR);
        }
        at = e.source();
    }
    false
}

/// A downstream request body as it arrives: from hyper (HTTP/2, and
/// HTTP/1 with `http1: hyper`) or from the meshless HTTP/1 connection.
/// One type, so the request path is compiled once for both.
#[derive(Debug)]
pub enum Source {
    Hyper(Incoming),
    H1(crate::request::h1_body::RequestBody),
}

impl From<Incoming> for Source {
    fn from(b: Incoming) -> Self {
        Self::Hyper(b)
    }
}

impl Body for Source {
    type Data = Bytes;
    type Error = crate::request::body::BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            Self::Hyper(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            Self::H1(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Hyper(b) => b.is_end_stream(),
            Self::H1(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Hyper(b) => b.size_hint(),
            Self::H1(b) => b.size_hint(),
        }
    }
}

pin_project! {
    /// A downstream body that records its own failure in a [`ClientFault`].
    ///
    /// With [`DownstreamBody::hold_last`] (an HTTP/2 request with a
    /// `content-length`), the data frame that completes the declared length
    /// is held back until the stream is known to end there: an HTTP/1.1
    /// upstream takes a message as whole once its `Content-Length` bytes
    /// are written, so DATA beyond the length (a malformed request, RFC
    /// 9113 8.1.1, refused by the HTTP/2 layer) must surface before the
    /// upstream has every byte, never after it acted on the prefix.
    pub struct DownstreamBody<B = Incoming> {
        #[pin]
        inner: B,
        fault: ClientFault,
        // Declared bytes not yet received (`None`: nothing held back).
        left: Option<u64>,
        held: Option<Frame<Bytes>>,
        // Trailers that came while a frame was held, given after it.
        next: Option<Frame<Bytes>>,
        ended: bool,
    }
}

impl<B> DownstreamBody<B> {
    /// Wraps `inner`; its errors set `fault`.
    pub fn new(inner: B, fault: ClientFault) -> Self {
        Self {
            inner,
            fault,
            left: None,
            held: None,
            next: None,
            ended: false,
        }
    }

    /// Holds back the frame that completes `length` declared bytes until
    /// the body is seen to end after it.
    pub fn hold_last(mut self, length: u64) -> Self {
        self.left = Some(length);
        self
    }
}

impl<B> Body for DownstreamBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: AsRef<dyn std::error::Error + Send + Sync>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        let Some(left) = this.left.as_mut() else {
            let polled = this.inner.poll_frame(cx);
            if let Poll::Ready(Some(Err(e))) = &polled {
                this.fault.set(is_malformed(e.as_ref()));
            }
            return polled;
        };
        loop {
            if let Some(next) = this.next.take() {
                return Poll::Ready(Some(Ok(next)));
            }
            if *this.ended {
                return Poll::Ready(this.held.take().map(Ok));
            }
            if this.held.is_some() && this.inner.is_end_stream() {
                *this.ended = true;
                continue;
            }
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => *this.ended = true,
                Poll::Ready(Some(Err(e))) => {
                    // Whatever was held is never sent: the request is cut.
                    *this.held = None;
                    *this.ended = true;
                    this.fault.set(is_malformed(e.as_ref()));
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        *left = left.saturating_sub(data.len() as u64);
                        if data.is_empty() {
                            continue;
                        }
                        if this.held.is_some() {
                            // More than declared and not refused below:
                            // never handed on after the whole prefix.
                            *this.held = None;
                            *this.ended = true;
                            this.fault.set(true);
                            return Poll::Ready(None);
                        }
                        if *left == 0 && !this.inner.is_end_stream() {
                            *this.held = Some(frame);
                            continue;
                        }
                        return Poll::Ready(Some(Ok(frame)));
                    }
                    // Trailers: the stream ends with them.
                    *this.ended = true;
                    match this.held.take() {
                        Some(held) => {
                            *this.next = Some(frame);
                            return Poll::Ready(Some(Ok(held)));
                        }
                        None => return Poll::Ready(Some(Ok(frame))),
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_none() && self.next.is_none() && (self.ended || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let held = self
            .held
            .as_ref()
            .and_then(Frame::data_ref)
            .map_or(0, |d| d.len() as u64);
        let inner = self.inner.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower().saturating_add(held));
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(held));
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody};

    #[test]
    fn an_error_sets_the_fault_and_data_does_not() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let frames: Vec<Result<Frame<Bytes>, crate::request::body::BodyError>> = vec![
                Ok(Frame::data(Bytes::from_static(b"ok"))),
                Err(std::io::Error::other("connection reset").into()),
            ];
            let mut fault = ClientFault::default();
            let mut body =
                DownstreamBody::new(StreamBody::new(futures_iter(frames)), fault.share());
            assert!(body.frame().await.is_some_and(|f| f.is_ok()));
            assert!(!fault.is_set());
            assert!(body.frame().await.is_some_and(|f| f.is_err()));
            assert!(fault.is_set());
            assert!(!fault.is_malformed(), "a cut is not malformed");
        });
    }

    /// A malformed chunk (meshless-h1's) is the client breaking the
    /// protocol, also through a box; a cut body, a bare reset reason and
    /// an I/O error are not.
    #[test]
    fn malformed_bodies_are_told_from_cut_ones() {
        use crate::request::h1_body::BodyFault;
        let chunk = BodyFault::Malformed(meshless_h1::Error::Head("chunk size"));
        assert!(is_malformed(&chunk));
        assert!(!is_malformed(&BodyFault::CutShort("closed")));
        // h2 makes its own resets only inside (the end-to-end test
        // `h2_data_longer_than_content_length_is_not_forwarded_as_whole`
        // has one); a bare reason is not h2's own reset.
        assert!(!is_malformed(&h2::Error::from(h2::Reason::CANCEL)));
        assert!(!is_malformed(&h2::Error::from(h2::Reason::PROTOCOL_ERROR)));
        assert!(!is_malformed(&std::io::Error::other("reset")));
        let boxed: crate::request::body::BodyError = Box::new(chunk);
        assert!(is_malformed(boxed.as_ref()));
    }

    fn futures_iter<T>(v: Vec<T>) -> tokio_stream::Iter<std::vec::IntoIter<T>> {
        tokio_stream::iter(v)
    }
}
