//! The downstream request body as sent upstream, with a flag that says
//! whether the client broke it (malformed chunking, cut short, reset). The
//! flag is how a failed upstream exchange is told apart: the client's fault
//! or the endpoint's.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use pin_project_lite::pin_project;

/// Set once the downstream body failed; shared by the body and the request.
#[derive(Debug, Clone, Default)]
pub struct ClientFault(Arc<AtomicBool>);

impl ClientFault {
    /// Whether the client's body failed.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    fn set(&self) {
        self.0.store(true, Ordering::Release);
    }
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
    pub struct DownstreamBody<B = Incoming> {
        #[pin]
        inner: B,
        fault: ClientFault,
    }
}

impl<B> DownstreamBody<B> {
    /// Wraps `inner`; its errors set `fault`.
    pub fn new(inner: B, fault: ClientFault) -> Self {
        Self { inner, fault }
    }
}

impl<B: Body<Data = Bytes>> Body for DownstreamBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        if let Poll::Ready(Some(Err(_))) = &polled {
            this.fault.set();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
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
            let frames: Vec<Result<Frame<Bytes>, std::io::Error>> = vec![
                Ok(Frame::data(Bytes::from_static(b"ok"))),
                Err(std::io::Error::other("bad chunk")),
            ];
            let fault = ClientFault::default();
            let mut body =
                DownstreamBody::new(StreamBody::new(futures_iter(frames)), fault.clone());
            assert!(body.frame().await.is_some_and(|f| f.is_ok()));
            assert!(!fault.is_set());
            assert!(body.frame().await.is_some_and(|f| f.is_err()));
            assert!(fault.is_set());
        });
    }

    fn futures_iter<T>(v: Vec<T>) -> tokio_stream::Iter<std::vec::IntoIter<T>> {
        tokio_stream::iter(v)
    }
}
