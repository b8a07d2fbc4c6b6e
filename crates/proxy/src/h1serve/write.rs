//! The response writer: the head by `meshless_h1::response::
//! write_response_head`, the body by `Content-Length` when known,
//! chunked when not (close-delimited to an HTTP/1.0 client), none to
//! `HEAD` and for `1xx`/`204`/`304` — hyper's server rules. Small data
//! frames are copied behind the head into one buffer; a large one is
//! written from its own bytes (vectored) so it is not copied.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::{Method, StatusCode, Version};
use http_body::Body;
use tokio::io::AsyncWrite;

use meshless_h1::framing::has_token;

use crate::request::body::ProxyBody;

/// Data frames up to this size are copied into the write buffer.
const COPY_MAX: usize = 16 * 1024;

/// The write buffer is written out once it holds this much.
const FLUSH_AT: usize = 64 * 1024;

/// Fields never written as trailers (RFC 9110 6.5.1: framing, routing
/// and content metadata), whatever the upstream sent.
static NOT_TRAILERS: [header::HeaderName; 8] = [
    header::CONTENT_LENGTH,
    header::TRANSFER_ENCODING,
    header::TRAILER,
    header::HOST,
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_RANGE,
    header::CONNECTION,
];

/// How the response body is delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    None,
    Length(u64),
    Chunked,
    /// To the close (an HTTP/1.0 client, length unknown).
    Close,
}

/// What the writer knows of the request it answers.
#[derive(Debug, Clone)]
pub struct Answering {
    pub method: Method,
    pub version: Version,
    /// The connection may carry another request after this one.
    pub keep_alive: bool,
}

/// A response being written.
pub struct Writer {
    out: BytesMut,
    big: Option<Bytes>,
    body: Option<ProxyBody>,
    encoding: Encoding,
    /// Body bytes still allowed by `Content-Length`.
    left: u64,
    /// Whether the connection closes after this response.
    pub close: bool,
    done: bool,
    /// The body's trailers, written with the last chunk (boxed: rare).
    trailers: Option<Box<http::HeaderMap>>,
    /// The last [`Writer::poll_write`] ended waiting for the client to
    /// take bytes (not for the body).
    pub stalled: bool,
    /// Bumped by every write that moved bytes out: a stall's progress.
    pub moved: u64,
}

/// Why a response could not be written whole.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("writing the response: {0}")]
    Io(#[from] io::Error),
    #[error("response body: {0}")]
    Body(crate::request::body::BodyError),
    #[error("response body longer or shorter than its content-length")]
    Length,
    #[error(transparent)]
    Head(#[from] meshless_h1::response::Unwritable),
}

/// A response whose head HTTP/1.1 cannot carry (a field name or value a
/// client would refuse or read otherwise: an HTTP/2 upstream's field may
/// hold bytes HTTP/1.1 forbids), with what it held.
#[derive(Debug)]
pub struct Unsendable {
    pub error: meshless_h1::response::Unwritable,
    body: ProxyBody,
    out: BytesMut,
}

impl Unsendable {
    /// A `502` in its place (reason `bad_response`), written on the same
    /// buffer: the request's record moves to it, the endpoint is charged
    /// with a bad response (as a reset), and the upstream's body is
    /// dropped unread (its connection is not reused).
    pub fn bad_gateway(mut self) -> (http::Response<ProxyBody>, BytesMut) {
        use crate::request::respond::LocalReply;
        let reply = LocalReply::text(
            StatusCode::BAD_GATEWAY,
            "upstream response cannot be sent over HTTP/1.1\n",
            "bad_response",
        );
        let record = self.body.take_completion();
        drop(self.body);
        self.out.clear();
        let resp = match record {
            Some(mut record) => {
                if let Some(g) = record.guard.as_mut() {
                    g.set_outcome(meshless_balance::Outcome::Reset);
                }
                reply.respond(record)
            }
            None => reply.unrecorded(),
        };
        (resp, self.out)
    }
}

impl Writer {
    /// Encodes the head of `resp` into `out` (empty); the connection closes
    /// after it when `close` (or when the request or response says so).
    /// A head HTTP/1.1 cannot carry is given back, nothing of it written.
    pub fn new(
        resp: http::Response<ProxyBody>,
        req: &Answering,
        close: bool,
        mut out: BytesMut,
    ) -> Result<Self, Box<Unsendable>> {
        let (mut parts, body) = resp.into_parts();
        let status = parts.status;
        let h = &mut parts.headers;
        let bodiless = req.method == Method::HEAD
            || status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED;
        let said = Said::of(h);
        // hyper's rules: an HTTP/1.0 peer is answered in HTTP/1.0, and so
        // is a response an upstream sent as HTTP/1.0 (no chunked coding
        // then); to an HTTP/1.0 peer, such a response keeps the
        // connection only if it says `keep-alive`.
        let line = if req.version == Version::HTTP_10 || parts.version == Version::HTTP_10 {
            Version::HTTP_10
        } else {
            Version::HTTP_11
        };
        let old_upstream = req.version == Version::HTTP_10
            && parts.version == Version::HTTP_10
            && !said.keep_alive;
        let mut close = close || said.close || !req.keep_alive || old_upstream;
        let length = said.length;
        let chunked_header = said.transfer_encoding;
        // hyper's rules: a response that can have no content has no
        // length (RFC 9110 8.6 forbids one on 1xx and 204; a 304's would
        // describe another response).
        if bodiless && req.method != Method::HEAD && said.lengths > 0 {
            h.remove(header::CONTENT_LENGTH);
        }
        let encoding = if bodiless {
            Encoding::None
        } else if chunked_header && line == Version::HTTP_11 {
            if said.lengths > 0 {
                h.remove(header::CONTENT_LENGTH);
            }
            Encoding::Chunked
        } else if let Some(n) = length {
            if said.lengths > 1 {
                // Equal repeats (an upstream's parser refused unequal
                // ones): one line, as hyper writes; strict clients refuse
                // a repeated length.
                h.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
            }
            Encoding::Length(n)
        } else if let Some(n) = body.size_hint().exact() {
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
            Encoding::Length(n)
        } else if line == Version::HTTP_11 {
            h.insert(
                header::TRANSFER_ENCODING,
                HeaderValue::from_static("chunked"),
            );
            Encoding::Chunked
        } else {
            close = true;
            Encoding::Close
        };
        if encoding == Encoding::Close {
            h.remove(header::TRANSFER_ENCODING);
        }
        if close {
            h.insert(header::CONNECTION, HeaderValue::from_static("close"));
        } else if req.version == Version::HTTP_10 {
            h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        }
        if !said.date {
            h.insert(header::DATE, date());
        }
        // The upstream's own reason phrase, as hyper's server keeps it.
        let reason = parts
            .extensions
            .get::<hyper::ext::ReasonPhrase>()
            .and_then(|r| std::str::from_utf8(r.as_bytes()).ok())
            .unwrap_or("");
        let fields = h.iter().map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()));
        if let Err(error) =
            meshless_h1::response::write_response_head(&mut out, line, status, reason, fields)
        {
            return Err(Box::new(Unsendable { error, body, out }));
        }
        // Written: the map goes back for a head to come.
        crate::header_maps::recycle(std::mem::take(&mut parts.headers));
        let left = match encoding {
            Encoding::Length(n) => n,
            _ => 0,
        };
        Ok(Self {
            out,
            big: None,
            body: (encoding != Encoding::None).then_some(body),
            encoding,
            left,
            close,
            done: encoding == Encoding::None,
            trailers: None,
            stalled: false,
            moved: 0,
        })
    }

    /// Writes the response on: `Ready(Ok)` once all of it is written and
    /// flushed. The body's record completes when its last frame is read.
    pub fn poll_write<I: AsyncWrite + Unpin>(
        &mut self,
        io: &mut I,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), WriteError>> {
        self.stalled = false;
        loop {
            if self.poll_drain(io, cx, false)?.is_pending() {
                return self.blocked(cx);
            }
            if self.done {
                if Pin::new(&mut *io).poll_flush(cx)?.is_pending() {
                    return self.blocked(cx);
                }
                return Poll::Ready(Ok(()));
            }
            let Some(body) = self.body.as_mut() else {
                self.done = true;
                continue;
            };
            match Pin::new(body).poll_frame(cx) {
                Poll::Pending => {
                    if self.poll_drain(io, cx, true)?.is_pending()
                        || Pin::new(&mut *io).poll_flush(cx)?.is_pending()
                    {
                        return self.blocked(cx);
                    }
                    return Poll::Pending;
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => self.data(data)?,
                    Err(frame) => {
                        if let Ok(t) = frame.into_trailers() {
                            self.trailers = Some(Box::new(t));
                        }
                    }
                },
                Poll::Ready(Some(Err(e))) => {
                    self.close = true;
                    // What is already buffered (the head, data received)
                    // goes out as far as the socket takes it now, never
                    // waiting: the client sees a message cut short (RFC
                    // 9112 8), not a connection closed with no byte,
                    // which it would take for a stale keep-alive one and
                    // retry.
                    self.body = None;
                    if self.poll_drain(io, cx, true).is_ready() {
                        let _ = Pin::new(&mut *io).poll_flush(cx);
                    }
                    return Poll::Ready(Err(WriteError::Body(e)));
                }
                Poll::Ready(None) => {
                    self.body = None;
                    self.end()?;
                }
            }
        }
    }

    /// The client takes no more bytes: `Pending` ([`Writer::stalled`]: the
    /// connection bounds the wait), unless the body's deadline passed
    /// meanwhile (its timer is polled here, since the body is not polled
    /// while nothing can be written): then the body is dropped (its
    /// upstream exchange ends) and the connection closes.
    fn blocked(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), WriteError>> {
        self.stalled = true;
        let Some(body) = self.body.as_mut() else {
            return Poll::Pending;
        };
        let Poll::Ready(cut) = Pin::new(body).poll_deadline(cx) else {
            return Poll::Pending;
        };
        self.body = None;
        self.close = true;
        Poll::Ready(Err(WriteError::Body(cut)))
    }

    fn data(&mut self, data: Bytes) -> Result<(), WriteError> {
        if data.is_empty() {
            return Ok(());
        }
        match self.encoding {
            Encoding::None => return Ok(()),
            Encoding::Length(_) => {
                let n = data.len() as u64;
                if n > self.left {
                    self.close = true;
                    return Err(WriteError::Length);
                }
                self.left -= n;
            }
            Encoding::Chunked => crate::h1out::chunk_size(&mut self.out, data.len()),
            Encoding::Close => {}
        }
        if data.len() <= COPY_MAX {
            self.out.put_slice(&data);
        } else {
            self.big = Some(data);
        }
        if self.encoding == Encoding::Chunked {
            if self.big.is_some() {
                // The chunk's CRLF goes after the big frame: see poll_drain.
            } else {
                self.out.put_slice(b"\r\n");
            }
        }
        Ok(())
    }

    fn end(&mut self) -> Result<(), WriteError> {
        self.done = true;
        match self.encoding {
            Encoding::Chunked => {
                let trailers = self.trailers.take().map(|t| *t).unwrap_or_default();
                let fields = trailers
                    .iter()
                    .filter(|(n, _)| !NOT_TRAILERS.contains(n))
                    .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()));
                if let Err(e) = meshless_h1::response::write_last_chunk(&mut self.out, fields) {
                    self.close = true;
                    return Err(e.into());
                }
            }
            Encoding::Length(_) if self.left > 0 => {
                self.close = true;
                return Err(WriteError::Length);
            }
            _ => {}
        }
        Ok(())
    }

    /// Writes out what is buffered (and the big frame after it): when
    /// `force`d, or a big frame waits, or the buffer is full, or the body
    /// has ended.
    fn poll_drain<I: AsyncWrite + Unpin>(
        &mut self,
        io: &mut I,
        cx: &mut Context<'_>,
        force: bool,
    ) -> Poll<io::Result<()>> {
        let must = force || self.big.is_some() || self.out.len() >= FLUSH_AT || self.done;
        if !must && self.body.is_some() {
            return Poll::Ready(Ok(()));
        }
        let chunked = self.encoding == Encoding::Chunked;
        let before = (self.out.len(), self.big.as_ref().map(Bytes::len));
        let drained = crate::h1out::poll_drain(&mut self.out, &mut self.big, chunked, io, cx);
        if before != (self.out.len(), self.big.as_ref().map(Bytes::len)) {
            self.moved = self.moved.wrapping_add(1);
        }
        drained
    }

    /// The write buffer, for the next response (empty).
    pub fn into_buffer(mut self) -> BytesMut {
        self.out.clear();
        std::mem::take(&mut self.out)
    }
}

/// What the writer reads of a response's fields, found in one pass over
/// them (a lookup by name hashes it, and this runs for every response).
#[derive(Debug, Default)]
struct Said {
    /// A `Connection` value lists `close`.
    close: bool,
    /// A `Connection` value lists `keep-alive`.
    keep_alive: bool,
    /// The first `Content-Length` line, when it is a number.
    length: Option<u64>,
    /// How many `Content-Length` lines there are.
    lengths: usize,
    /// A `Transfer-Encoding` line is there.
    transfer_encoding: bool,
    /// A `Date` line is there.
    date: bool,
}

impl Said {
    fn of(h: &http::HeaderMap) -> Self {
        let mut said = Self::default();
        for (name, value) in h {
            if *name == header::CONNECTION {
                said.close |= has_token(value.as_bytes(), "close");
                said.keep_alive |= has_token(value.as_bytes(), "keep-alive");
            } else if *name == header::CONTENT_LENGTH {
                if said.lengths == 0 {
                    said.length = value.to_str().ok().and_then(|v| v.trim().parse().ok());
                }
                said.lengths += 1;
            } else if *name == header::TRANSFER_ENCODING {
                said.transfer_encoding = true;
            } else if *name == header::DATE {
                said.date = true;
            }
        }
        said
    }
}

/// The `Date` header value now, formatted once per second per thread.
fn date() -> HeaderValue {
    use std::cell::RefCell;
    use std::time::{SystemTime, UNIX_EPOCH};
    thread_local! {
        static CACHE: RefCell<(u64, Option<HeaderValue>)> = const { RefCell::new((0, None)) };
    }
    let now = SystemTime::now();
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        match &c.1 {
            Some(v) if c.0 == secs => v.clone(),
            _ => {
                let v = HeaderValue::from_str(&httpdate::fmt_http_date(now))
                    .unwrap_or_else(|_| HeaderValue::from_static("Thu, 01 Jan 1970 00:00:00 GMT"));
                *c = (secs, Some(v.clone()));
                v
            }
        }
    })
}

/// A complete response the connection makes itself (a refused head):
/// `reply`'s status, content type and body, `connection: close`.
pub fn refusal(reply: &crate::request::respond::LocalReply) -> Vec<u8> {
    let mut out = Vec::with_capacity(160 + reply.body.len());
    let date = date();
    let length = reply.body.len().to_string();
    let fields: [(&[u8], &[u8]); 4] = [
        (b"content-type", reply.content_type.as_bytes()),
        (b"content-length", length.as_bytes()),
        (b"connection", b"close"),
        (b"date", date.as_bytes()),
    ];
    // Valid fields and a canonical reason: never unwritable.
    let _ = meshless_h1::response::write_response_head(
        &mut out,
        Version::HTTP_11,
        reply.status,
        "",
        fields,
    );
    out.extend_from_slice(&reply.body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answering(method: Method, version: Version) -> Answering {
        Answering {
            method,
            version,
            keep_alive: version == Version::HTTP_11,
        }
    }

    async fn written(resp: http::Response<ProxyBody>, req: &Answering) -> (String, bool) {
        let mut w = Writer::new(resp, req, false, BytesMut::new()).expect("head");
        let mut sink = Vec::new();
        std::future::poll_fn(|cx| w.poll_write(&mut sink, cx))
            .await
            .expect("written");
        (String::from_utf8_lossy(&sink).into_owned(), w.close)
    }

    #[tokio::test]
    async fn a_known_length_is_sent_as_content_length() {
        let resp = http::Response::new(ProxyBody::full("hello", None));
        let (out, close) = written(resp, &answering(Method::GET, Version::HTTP_11)).await;
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        assert!(out.contains("content-length: 5\r\n"), "{out}");
        assert!(out.ends_with("\r\n\r\nhello"), "{out}");
        assert!(!close);
    }

    #[tokio::test]
    async fn an_unknown_length_is_chunked_or_closes_for_http10() {
        let stream = |chunks: Vec<&'static [u8]>| {
            use http_body_util::BodyExt;
            let frames = chunks.into_iter().map(|c| {
                Ok::<_, crate::request::body::BodyError>(http_body::Frame::data(
                    Bytes::from_static(c),
                ))
            });
            ProxyBody::new(
                http_body_util::StreamBody::new(tokio_stream::iter(frames)).boxed(),
                None,
            )
        };
        let resp = http::Response::new(stream(vec![b"ab", b"cde"]));
        let (out, _) = written(resp, &answering(Method::GET, Version::HTTP_11)).await;
        assert!(out.contains("transfer-encoding: chunked\r\n"), "{out}");
        assert!(
            out.ends_with("\r\n\r\n2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n"),
            "{out}"
        );
        let resp = http::Response::new(stream(vec![b"ab"]));
        let (out, close) = written(resp, &answering(Method::GET, Version::HTTP_10)).await;
        assert!(
            out.contains("connection: close\r\n") && out.ends_with("\r\n\r\nab"),
            "{out}"
        );
        assert!(close);
    }

    #[tokio::test]
    async fn head_and_204_have_no_body() {
        let resp = http::Response::new(ProxyBody::full("hello", None));
        let (out, _) = written(resp, &answering(Method::HEAD, Version::HTTP_11)).await;
        assert!(out.ends_with("\r\n\r\n"), "{out}");
        let mut resp = http::Response::new(ProxyBody::full("", None));
        *resp.status_mut() = StatusCode::NO_CONTENT;
        let (out, _) = written(resp, &answering(Method::GET, Version::HTTP_11)).await;
        assert!(
            out.starts_with("HTTP/1.1 204") && out.ends_with("\r\n\r\n"),
            "{out}"
        );
    }
}
