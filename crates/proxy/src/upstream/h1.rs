//! An upstream HTTP/1.1 connection of meshless's own (`clusters[].http1:
//! meshless`): the request's task writes the request and reads the
//! response itself — no task per connection, no channel or oneshot per
//! request. The codec is meshless-h1's (heads by `httparse`, framing as
//! hyper's client decides it, chunk sizes by `httparse::parse_chunk_size`).
//!
//! Invariants:
//! - Framing per RFC 9112 6.3 as `meshless_h1::framing::response` decides
//!   it: no body for `HEAD`, `1xx`, `204`, `304`; chunked; one agreed
//!   `Content-Length` (conflicting or invalid ones are an error, never a
//!   guess); else to the close. Interim `1xx` heads are skipped; a `101`
//!   (upgrades go through hyper, `pool.rs`) ends the connection.
//! - A connection goes back to its pool only when the response body was
//!   read to its end, the request was written whole, no byte follows the
//!   response, and neither side said `close`; a body dropped before its
//!   end closes the connection, unless the rest of it was already read.
//! - The request body is written while the response is read (an upstream
//!   may answer before it has read the whole request, and may stream its
//!   answer while it reads); after an I/O error on the write side the
//!   response already sent can still be read, but the connection is not
//!   reused.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, Version};
use http_body::{Body, Frame, SizeHint};
use meshless_h1::chunked::{self, Decoder, Step};
use meshless_h1::response::{self, ResponseLimits, Unwritable};
use meshless_h1::{Parsed, framing};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::UpstreamBody;
use super::connect::Socket;
use super::pool::EndpointPool;

/// Bytes read at a time (the read buffer grows to a head's size).
const READ_SIZE: usize = 8 * 1024;

/// Free read buffers kept per worker thread for the exchanges to come: a
/// connection holds one only while its exchange reads (an idle pooled
/// connection holds none), and gives it back when its response ends.
const FREE_MAX: usize = 32;

thread_local! {
    static FREE: std::cell::RefCell<Vec<BytesMut>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A free read buffer of this worker, or a new empty one.
fn borrow_buffer() -> BytesMut {
    crate::free_list::take(&FREE).unwrap_or_default()
}

/// The largest read buffer kept for reuse (one grown for a large head is
/// freed instead), so the free list holds at most `FREE_MAX` of these.
const KEEP_MAX: usize = 4 * READ_SIZE;

/// Gives `buf` back to this worker's free buffers if it is unshared (no
/// data frame sent on still points into it) and worth keeping: not grown
/// past [`KEEP_MAX`]. Dropped instead while the thread's locals are torn
/// down (a body dropped at thread exit).
fn give_back(buf: BytesMut) {
    if let Some(buf) = crate::free_list::reusable_buffer(buf, KEEP_MAX, READ_SIZE) {
        crate::free_list::give(&FREE, buf, FREE_MAX);
    }
}

/// A request's write buffer: a head's room. Free ones are kept per worker
/// thread (at most [`FREE_MAX`]) for the requests to come, as the read
/// buffers are: one is taken per request, and an allocation per request
/// is what it saves.
const OUT_SIZE: usize = 512;

/// The largest write buffer kept for reuse (one grown for a body copied
/// behind its head is freed instead).
const OUT_KEEP_MAX: usize = 4 * 1024;

thread_local! {
    static FREE_OUT: std::cell::RefCell<Vec<BytesMut>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A free write buffer of this worker, or a new one.
fn out_buffer() -> BytesMut {
    crate::free_list::take(&FREE_OUT).unwrap_or_else(|| BytesMut::with_capacity(OUT_SIZE))
}

/// Gives a request's write buffer back to this worker's free ones if it
/// is unshared and its allocation was not grown past [`OUT_KEEP_MAX`]
/// (judged as the read buffers are, [`give_back`]: a written buffer is
/// advanced, so the room left says nothing of its allocation); what it
/// held is dropped (an exchange that failed may leave bytes unwritten).
fn give_out_back(out: BytesMut) {
    if let Some(out) = crate::free_list::reusable_buffer(out, OUT_KEEP_MAX, OUT_SIZE) {
        crate::free_list::give(&FREE_OUT, out, FREE_MAX);
    }
}

/// Response data frames up to this size are copied out of the read
/// buffer rather than split off it, so the buffer stays unshared and is
/// given back whole ([`give_back`]).
const SPLIT_MIN: usize = 4 * 1024;

/// Request data frames up to this size are copied behind the head.
const COPY_MAX: usize = 16 * 1024;

/// Buffered request bytes are written out once there are this many.
const FLUSH_AT: usize = 64 * 1024;

/// Header slots parsed on the stack (hyper's client's limit).
const SLOTS: usize = 100;

/// The error of the response body's frames.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("upstream connection: {0}")]
    Io(#[from] io::Error),
    #[error("upstream closed the connection before the response ended")]
    Closed,
    #[error("upstream response refused: {0}")]
    Protocol(#[from] meshless_h1::Error),
    #[error("request body: {0}")]
    Body(BoxError),
    #[error("request body longer or shorter than its content-length")]
    Length,
    #[error(transparent)]
    Head(#[from] Unwritable),
    /// A `101` (or a `2xx` to `CONNECT`) to a request that did not ask to
    /// switch protocols: upgrades never come this way (hyper carries
    /// them), so the upstream switched unasked (RFC 9110 15.2.2).
    #[error("upstream switched protocols unasked")]
    UnaskedUpgrade,
}

/// An open connection with its read buffer (bytes read and not used).
#[derive(Debug)]
pub struct Conn {
    io: Socket,
    buf: BytesMut,
}

impl Conn {
    pub(super) fn new(io: Socket) -> Self {
        Self {
            io,
            buf: BytesMut::new(),
        }
    }

    /// Whether an idle connection can carry a request: its peer has not
    /// closed it and sent nothing unasked (a read that would wait). The
    /// probe registers no waker of ours.
    pub fn reusable(&mut self) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut probe = [0u8; 1];
        let mut rb = ReadBuf::new(&mut probe);
        Pin::new(&mut self.io)
            .poll_read(&mut cx, &mut rb)
            .is_pending()
    }
}

/// How the request body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    /// Exactly this many bytes still to write.
    Length(u64),
    Chunked,
}

/// The request side of an exchange: bytes to write and the body to come.
struct Sending {
    out: BytesMut,
    /// A large data frame, written from its own bytes after `out`.
    big: Option<Bytes>,
    body: Option<UpstreamBody>,
    encoding: Encoding,
    /// Everything was written and flushed.
    done: bool,
    /// Writing failed: nothing more is written, the connection is not reused.
    failed: Option<io::Error>,
    /// A chunked body's trailers to send: the fields the request's
    /// `Trailer` names (hyper's client sends only those), once the body
    /// gave them (boxed: rare).
    trailers: Option<Box<Trailers>>,
    /// The body once its `Content-Length` bytes are written: the message
    /// is whole on the wire (RFC 9112 6.2), so its end of stream (an
    /// HTTP/2 client's END_STREAM may come in a frame of its own, later)
    /// is not waited for; kept unread, dropped with the exchange.
    rest: Option<UpstreamBody>,
}

/// The trailer fields a chunked request may send, and those it sent.
#[derive(Default)]
struct Trailers {
    /// Named by the request's `Trailer` fields (lower case).
    allowed: Vec<HeaderName>,
    sent: Option<HeaderMap>,
}

/// Fields never sent as trailers (hyper's client's rule, RFC 9110 6.5.1:
/// framing, routing, authentication and content metadata).
static NOT_TRAILERS: [HeaderName; 12] = [
    header::AUTHORIZATION,
    header::CACHE_CONTROL,
    header::CONTENT_ENCODING,
    header::CONTENT_LENGTH,
    header::CONTENT_RANGE,
    header::CONTENT_TYPE,
    header::HOST,
    header::MAX_FORWARDS,
    header::SET_COOKIE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::TE,
];

/// Connection-specific fields (RFC 9113 8.2.2), never forwarded in a
/// response's trailers.
static CONNECTION_FIELDS: [HeaderName; 4] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::UPGRADE,
];

impl Trailers {
    /// The fields a request's `Trailer` names, if it names any.
    fn declared(h: &HeaderMap) -> Option<Box<Self>> {
        let allowed: Vec<HeaderName> = h
            .get_all(header::TRAILER)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|s| s.split(','))
            .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
            .filter(|n| !NOT_TRAILERS.contains(n))
            .collect();
        (!allowed.is_empty()).then(|| {
            Box::new(Self {
                allowed,
                sent: None,
            })
        })
    }

    /// The fields to write with the last chunk.
    fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.sent
            .iter()
            .flat_map(|m| m.iter())
            .filter(|(n, _)| self.allowed.contains(n))
            .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()))
    }
}

impl Drop for Sending {
    /// The write buffer goes back for a request to come.
    fn drop(&mut self) {
        give_out_back(std::mem::take(&mut self.out));
    }
}

impl Sending {
    /// Encodes the head of `req` (hyper's client's framing rules for a
    /// request body) and keeps its body to write.
    fn new(req: Request<UpstreamBody>) -> Result<(Self, bool), ExchangeError> {
        let (mut parts, body) = req.into_parts();
        let h = &mut parts.headers;
        let said = Said::of(h);
        let (encoding, body) = frame_request(&parts.method, h, body, said.transfer_encoding);
        let keep_alive = !said.close;
        // Borrowed from the URI but for an absolute form (no allocation
        // per request).
        let target: std::borrow::Cow<'_, str> = match parts.uri.authority() {
            Some(_) => parts.uri.to_string().into(),
            None => parts
                .uri
                .path_and_query()
                .map_or("/", |p| p.as_str())
                .into(),
        };
        if said.cookies > 1 {
            join_cookies(h);
        }
        let mut out = out_buffer();
        let fields = h.iter().map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()));
        response::write_request_head(&mut out, &parts.method, &target, Version::HTTP_11, fields)?;
        let trailers = match encoding {
            Encoding::Chunked => Trailers::declared(h),
            Encoding::Length(_) => None,
        };
        // Written: the map goes back for a head to come.
        crate::header_maps::recycle(std::mem::take(&mut parts.headers));
        let mut sending = Self {
            out,
            big: None,
            done: false,
            body,
            encoding,
            failed: None,
            trailers,
            rest: None,
        };
        sending.whole_at_length();
        Ok((sending, keep_alive))
    }

    /// Whether the request was written whole.
    fn complete(&self) -> bool {
        self.done && self.failed.is_none()
    }

    /// Writes on: `Ready(Ok)` once the whole request is written and
    /// flushed (or writing failed: see `failed`), `Ready(Err)` when the
    /// request body broke.
    fn poll_send<I: AsyncWrite + Unpin>(
        &mut self,
        io: &mut I,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), ExchangeError>> {
        if self.done || self.failed.is_some() {
            return Poll::Ready(Ok(()));
        }
        match self.poll_write_all(io, cx) {
            Poll::Ready(Err(ExchangeError::Io(e))) => {
                self.body = None;
                self.failed = Some(e);
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }

    fn poll_write_all<I: AsyncWrite + Unpin>(
        &mut self,
        io: &mut I,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), ExchangeError>> {
        loop {
            let mut waiting = false;
            if let Some(body) = self.body.as_mut()
                && self.big.is_none()
                && self.out.len() < FLUSH_AT
            {
                match Pin::new(body).poll_frame(cx) {
                    Poll::Pending => waiting = true,
                    Poll::Ready(Some(Ok(frame))) => {
                        match frame.into_data() {
                            Ok(data) => {
                                self.data(data)?;
                                self.whole_at_length();
                            }
                            // Sent with the last chunk, when the request
                            // declared them (else dropped, as hyper does).
                            Err(frame) => {
                                if let (Ok(t), Some(trailers)) =
                                    (frame.into_trailers(), self.trailers.as_mut())
                                {
                                    trailers.sent = Some(t);
                                }
                            }
                        }
                        continue;
                    }
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(ExchangeError::Body(e))),
                    Poll::Ready(None) => {
                        self.body = None;
                        self.end()?;
                        continue;
                    }
                }
            }
            ready!(self.poll_drain(io, cx))?;
            if self.body.is_none() || waiting {
                ready!(Pin::new(&mut *io).poll_flush(cx))?;
                if self.body.is_some() {
                    return Poll::Pending;
                }
                self.done = true;
                return Poll::Ready(Ok(()));
            }
        }
    }

    /// With every `Content-Length` byte written, the request is complete:
    /// the body is set aside unread ([`Sending::rest`]).
    fn whole_at_length(&mut self) {
        if self.encoding == Encoding::Length(0) && self.body.is_some() {
            self.rest = self.body.take();
        }
    }

    fn data(&mut self, data: Bytes) -> Result<(), ExchangeError> {
        if data.is_empty() {
            return Ok(());
        }
        match &mut self.encoding {
            Encoding::Length(left) => {
                let n = data.len() as u64;
                if n > *left {
                    return Err(ExchangeError::Length);
                }
                *left -= n;
            }
            Encoding::Chunked => crate::h1out::chunk_size(&mut self.out, data.len()),
        }
        if data.len() <= COPY_MAX {
            self.out.put_slice(&data);
            if self.encoding == Encoding::Chunked {
                self.out.put_slice(b"\r\n");
            }
        } else {
            // The chunk's CRLF follows it once written (`poll_drain`).
            self.big = Some(data);
        }
        Ok(())
    }

    fn end(&mut self) -> Result<(), ExchangeError> {
        match self.encoding {
            Encoding::Chunked => match self.trailers.take() {
                Some(t) => response::write_last_chunk(&mut self.out, t.fields())?,
                None => self.out.put_slice(b"0\r\n\r\n"),
            },
            Encoding::Length(left) if left > 0 => return Err(ExchangeError::Length),
            Encoding::Length(_) => {}
        }
        Ok(())
    }

    /// Writes out `out` and the big frame after it.
    fn poll_drain<I: AsyncWrite + Unpin>(
        &mut self,
        io: &mut I,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), ExchangeError>> {
        let chunked = self.encoding == Encoding::Chunked;
        let drained = crate::h1out::poll_drain(&mut self.out, &mut self.big, chunked, io, cx);
        Poll::Ready(Ok(ready!(drained)?))
    }
}

/// What the encoder reads of a request's fields, found in one pass over
/// them (a lookup by name hashes it, and this runs for every request).
#[derive(Debug, Default)]
struct Said {
    /// A `Connection` value lists `close`.
    close: bool,
    /// A `Transfer-Encoding` line is there.
    transfer_encoding: bool,
    /// How many `Cookie` lines there are.
    cookies: usize,
}

impl Said {
    fn of(h: &HeaderMap) -> Self {
        let mut said = Self::default();
        for (name, value) in h {
            if *name == header::CONNECTION {
                said.close |= meshless_h1::framing::has_token(value.as_bytes(), "close");
            } else if *name == header::TRANSFER_ENCODING {
                said.transfer_encoding = true;
            } else if *name == header::COOKIE {
                said.cookies += 1;
            }
        }
        said
    }
}

/// Several `Cookie` fields (an HTTP/2 client sends each cookie in a field
/// of its own) become one, joined by `"; "`, as an HTTP/1.1 connection
/// must carry them (RFC 9113 8.2.3).
fn join_cookies(h: &mut HeaderMap) {
    let mut values = h.get_all(header::COOKIE).iter();
    let (Some(first), Some(_)) = (values.next(), values.next()) else {
        return;
    };
    let mut joined = first.as_bytes().to_vec();
    for v in h.get_all(header::COOKIE).iter().skip(1) {
        joined.extend_from_slice(b"; ");
        joined.extend_from_slice(v.as_bytes());
    }
    // Made of valid values and "; ": valid too.
    if let Ok(v) = HeaderValue::from_bytes(&joined) {
        h.insert(header::COOKIE, v);
    }
}

/// hyper's client's `set_length` for an HTTP/1.1 request: no body when
/// the body is already at its end (no `Transfer-Encoding` sent); a
/// `Transfer-Encoding` given is kept, made to end in `chunked`; else a
/// valid `Content-Length` given; else, for a body of unknown length,
/// none for `HEAD`/`CONNECT` and chunked for the others (hyper's client
/// sends none for `GET` either: content lost; see [`chunk_unsized_get`]);
/// else the body's exact length as `Content-Length`. The body is `None` when none
/// is written.
fn frame_request(
    method: &Method,
    h: &mut HeaderMap,
    body: UpstreamBody,
    transfer_encoding: bool,
) -> (Encoding, Option<UpstreamBody>) {
    if body.is_end_stream() {
        if transfer_encoding {
            h.remove(header::TRANSFER_ENCODING);
        }
        return (Encoding::Length(0), None);
    }
    if transfer_encoding {
        let chunked = h
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .next_back()
            .is_some_and(|v| meshless_h1::framing::last_coding_is_chunked(v.as_bytes()));
        if !chunked {
            h.append(
                header::TRANSFER_ENCODING,
                HeaderValue::from_static("chunked"),
            );
        }
        h.remove(header::CONTENT_LENGTH);
        return (Encoding::Chunked, Some(body));
    }
    if let Some(n) = content_length(h) {
        return (Encoding::Length(n), Some(body));
    }
    match body.size_hint().exact() {
        Some(n) => {
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
            (Encoding::Length(n), Some(body))
        }
        // `HEAD` and `CONNECT` carry no content. A `GET` with content of
        // unknown length (HTTP/2 DATA without `content-length`) is sent
        // chunked: dropping it would lose what the client sent (RFC 9110
        // §7.6), as hyper's client does ([`chunk_unsized_get`] makes it
        // send such a `GET` chunked too).
        None if matches!(*method, Method::HEAD | Method::CONNECT) => (Encoding::Length(0), None),
        None => {
            h.insert(
                header::TRANSFER_ENCODING,
                HeaderValue::from_static("chunked"),
            );
            h.remove(header::CONTENT_LENGTH);
            (Encoding::Chunked, Some(body))
        }
    }
}

/// Before hyper's HTTP/1.1 client sends `req`: a `GET` whose content has
/// no known length and no framing field (an HTTP/2 request with DATA and
/// no `content-length`) is marked `transfer-encoding: chunked`, which
/// hyper's client honours; without it hyper sends the `GET` with no body
/// at all, and the client's content is lost silently. The same rule as
/// [`frame_request`] for meshless's own connections.
pub(super) fn chunk_unsized_get(req: &mut Request<UpstreamBody>) {
    let unsized_content = !req.body().is_end_stream() && req.body().size_hint().exact().is_none();
    let h = req.headers();
    if req.method() == Method::GET
        && unsized_content
        && !h.contains_key(header::CONTENT_LENGTH)
        && !h.contains_key(header::TRANSFER_ENCODING)
    {
        req.headers_mut().insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
    }
}

/// The `Content-Length` of a request's fields when every line (a comma
/// list of digits) agrees, as hyper's `content_length_parse_all`.
fn content_length(h: &HeaderMap) -> Option<u64> {
    let mut length = None;
    for v in h.get_all(header::CONTENT_LENGTH) {
        for item in v.to_str().ok()?.split(',') {
            let n: u64 = item.trim().parse().ok()?;
            if length.is_some_and(|prev| prev != n)
                || !item.trim().bytes().all(|b| b.is_ascii_digit())
            {
                return None;
            }
            length = Some(n);
        }
    }
    length
}

/// One exchange on a connection.
struct Exchange {
    conn: Conn,
    sending: Sending,
    /// The request allows another one after it.
    keep_alive: bool,
}

impl Exchange {
    /// Reads more bytes into the buffer: `Ready(Ok(0))` at the end of
    /// the stream.
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.conn.buf.capacity() == 0 {
            self.conn.buf = borrow_buffer();
        }
        self.conn.buf.reserve(READ_SIZE);
        tokio_util::io::poll_read_buf(Pin::new(&mut self.conn.io), cx, &mut self.conn.buf)
    }
}

/// Sends `req` on `conn` and reads the response head; the response body
/// reads the rest, and puts the connection back in `pool` when it may be
/// reused.
///
/// A function returning its async block: an `async fn` would copy the
/// request into its body's locals.
#[allow(clippy::manual_async_fn)] // see above
pub fn exchange(
    conn: Conn,
    req: Request<UpstreamBody>,
    pool: Arc<EndpointPool>,
) -> impl Future<Output = Result<Response<ResponseBody>, ExchangeError>> + Send {
    async move {
        let method = req.method().clone();
        let (sending, keep_alive) = Sending::new(req)?;
        // Boxed once: the response body carries it, and is moved a few
        // times on its way downstream.
        let mut ex = Box::new(Exchange {
            conn,
            sending,
            keep_alive,
        });
        let limits = ResponseLimits::default();
        let head = std::future::poll_fn(|cx| poll_head(&mut ex, cx, &method, &limits)).await?;
        let (parts, framing) = head;
        if framing.upgrade {
            return Err(ExchangeError::UnaskedUpgrade);
        }
        let kind = match framing.body {
            _ if framing.upgrade => Kind::Done,
            framing::Body::Empty => Kind::Done,
            framing::Body::Length(n) => Kind::Length(n),
            framing::Body::Chunked => Kind::Chunked(Decoder::new(limits.max_headers)),
            framing::Body::CloseDelimited => Kind::Close,
        };
        ex.keep_alive &= framing.keep_alive && !framing.upgrade;
        let mut body = ResponseBody {
            ex: Some(ex),
            kind,
            pool: Some(pool),
        };
        if matches!(body.kind, Kind::Done) {
            body.finish();
        }
        Ok(Response::from_parts(parts, body))
    }
}

/// Writes the request on while reading, until a final response head.
fn poll_head(
    ex: &mut Exchange,
    cx: &mut Context<'_>,
    method: &Method,
    limits: &ResponseLimits,
) -> Poll<Result<(http::response::Parts, meshless_h1::Framing), ExchangeError>> {
    loop {
        if let Poll::Ready(Err(e)) = ex.sending.poll_send(&mut ex.conn.io, cx) {
            return Poll::Ready(Err(e));
        }
        while !ex.conn.buf.is_empty() {
            match take_head(&mut ex.conn.buf, method, limits)? {
                None => break,
                Some((_, f)) if f.informational => continue,
                Some(head) => return Poll::Ready(Ok(head)),
            }
        }
        let n = match ready!(ex.poll_read(cx)) {
            Ok(n) => n,
            Err(e) => return Poll::Ready(Err(ex.sending.failed.take().unwrap_or(e).into())),
        };
        if n == 0 {
            return Poll::Ready(Err(match ex.sending.failed.take() {
                Some(e) => e.into(),
                None => ExchangeError::Closed,
            }));
        }
    }
}

/// Takes the response head at the start of `buf` out of it, its header
/// values slices of the head's bytes; `None` until it is whole.
fn take_head(
    buf: &mut BytesMut,
    method: &Method,
    limits: &ResponseLimits,
) -> Result<Option<(http::response::Parts, meshless_h1::Framing)>, ExchangeError> {
    let base = buf.as_ptr() as usize;
    let mut slots = [httparse::EMPTY_HEADER; SLOTS];
    let Parsed::Complete { head, consumed } = response::parse(buf, &mut slots, method, limits)?
    else {
        return Ok(None);
    };
    let (status, version, framing) = (head.status, head.version, head.framing);
    // The upstream's own reason phrase, kept as hyper's client keeps it
    // (only when it is not the canonical one): both servers write it.
    let reason = (Some(head.reason) != status.canonical_reason())
        .then(|| hyper::ext::ReasonPhrase::try_from(head.reason.as_bytes()).ok())
        .flatten();
    // Copied out (a short head into this thread's chunk of small strings,
    // `byte_arena`), not split off: the values point into the copy alone,
    // and the read buffer stays unshared ([`give_back`]). The fields are
    // made straight from the parsed ones (no list of where they lie).
    let raw = crate::byte_arena::copy(&buf[..consumed]);
    let mut headers = crate::header_maps::with_capacity(head.headers.len());
    for h in framing.forwarded(head.headers) {
        if crate::hop_fields::dropped_on_arrival(h.name, h.value) {
            continue;
        }
        let name = HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| meshless_h1::Error::Head("header name"))?;
        let at = h.value.as_ptr() as usize - base;
        let value = HeaderValue::from_maybe_shared(raw.slice(at..at + h.value.len()))
            .map_err(|_| meshless_h1::Error::Head("header value"))?;
        headers.append(name, value);
    }
    buf.advance(consumed);
    let (mut parts, ()) = Response::new(()).into_parts();
    parts.status = status;
    parts.version = version;
    parts.headers = headers;
    if let Some(reason) = reason {
        parts.extensions.insert(reason);
    }
    Ok(Some((parts, framing)))
}

/// Where the response body is.
#[derive(Debug)]
enum Kind {
    Length(u64),
    Chunked(Decoder),
    Close,
    /// Read to its end.
    Done,
}

/// The body of a response read by [`exchange`]: data frames are slices
/// of the read buffer (no copy); trailers of a chunked body come as a
/// trailers frame.
pub struct ResponseBody {
    /// `None` once the body ended (the connection pooled or closed).
    ex: Option<Box<Exchange>>,
    kind: Kind,
    pool: Option<Arc<EndpointPool>>,
}

impl std::fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

/// At most this much of a request body is read and discarded after an
/// early answer.
const DISCARD_MAX_BYTES: u64 = 4 * 1024 * 1024;

/// For at most this long.
const DISCARD_MAX_TIME: std::time::Duration = std::time::Duration::from_secs(5);

/// Reads the rest of a request body the upstream answered before reading
/// it, and drops it: up to [`DISCARD_MAX_BYTES`] and [`DISCARD_MAX_TIME`],
/// then the body is dropped (its client is cut off). Off the response's
/// path: a task of its own (rare: early answers only).
fn discard_rest(mut body: UpstreamBody) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    rt.spawn(async move {
        let read = async {
            let mut seen = 0u64;
            while let Some(Ok(frame)) = http_body_util::BodyExt::frame(&mut body).await {
                if let Ok(data) = frame.into_data() {
                    seen += data.len() as u64;
                    if seen > DISCARD_MAX_BYTES {
                        return;
                    }
                }
            }
        };
        let _ = tokio::time::timeout(DISCARD_MAX_TIME, read).await;
    });
}

impl ResponseBody {
    /// The body is over: the connection goes back to the pool if it may
    /// carry another request, else it closes.
    fn finish(&mut self) {
        self.kind = Kind::Done;
        let Some(mut ex) = self.ex.take() else {
            return;
        };
        if !ex.sending.done
            && let Some(body) = ex.sending.body.take()
        {
            // An early answer (a 413 before the upload ends): the rest of
            // the request is read and discarded, as hyper's client does
            // while its connection lives, so a client still sending is not
            // cut off (an HTTP/2 stream reset) before it reads the answer.
            discard_rest(body);
        }
        let reusable = ex.keep_alive && ex.sending.complete() && ex.conn.buf.is_empty();
        if reusable && let Some(pool) = self.pool.take() {
            // An idle connection holds no buffer: its memory goes back to
            // the worker's free buffers while it is not shared with data
            // sent on.
            give_back(std::mem::take(&mut ex.conn.buf));
            pool.checkin_own(ex.conn);
        }
    }

    /// The next frame from the bytes buffered, or `None` when more must
    /// be read.
    fn buffered(&mut self) -> Result<Option<Frame<Bytes>>, ExchangeError> {
        let Some(ex) = self.ex.as_mut() else {
            return Ok(None);
        };
        let buf = &mut ex.conn.buf;
        match &mut self.kind {
            Kind::Done => Ok(None),
            Kind::Length(left) => {
                if buf.is_empty() {
                    return Ok(None);
                }
                let take = usize::try_from(*left).map_or(buf.len(), |l| l.min(buf.len()));
                let data = if take < SPLIT_MIN {
                    let small = Bytes::copy_from_slice(&buf[..take]);
                    buf.advance(take);
                    small
                } else {
                    buf.split_to(take).freeze()
                };
                *left -= take as u64;
                if *left == 0 {
                    self.finish();
                }
                Ok(Some(Frame::data(data)))
            }
            Kind::Close => {
                if buf.is_empty() {
                    return Ok(None);
                }
                Ok(Some(Frame::data(buf.split().freeze())))
            }
            Kind::Chunked(decoder) => match decoder.decode(buf)? {
                Step::Data(r) => {
                    buf.advance(r.start);
                    Ok(Some(Frame::data(buf.split_to(r.len()).freeze())))
                }
                Step::Incomplete { consumed } => {
                    buf.advance(consumed);
                    Ok(None)
                }
                Step::Done { consumed, trailers } => {
                    let fields = trailer_map(&buf[trailers])?;
                    buf.advance(consumed);
                    self.finish();
                    Ok(fields.map(Frame::trailers))
                }
            },
        }
    }
}

impl Drop for ResponseBody {
    /// A body dropped before its end still gives its connection back
    /// when the rest of it is already buffered (as hyper's connection
    /// task, which reads ahead, does); otherwise the connection closes.
    fn drop(&mut self) {
        if matches!(self.kind, Kind::Close) {
            return;
        }
        while self.ex.is_some() {
            match self.buffered() {
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
    }
}

/// A chunked body's trailer section as a header map (`None`: no fields).
fn trailer_map(section: &[u8]) -> Result<Option<HeaderMap>, ExchangeError> {
    if section.is_empty() {
        return Ok(None);
    }
    let mut slots = [httparse::EMPTY_HEADER; SLOTS];
    let fields = chunked::parse_trailers(section, &mut slots)?;
    let mut map = HeaderMap::with_capacity(fields.len());
    for f in fields {
        let name = HeaderName::from_bytes(f.name.as_bytes())
            .map_err(|_| meshless_h1::Error::Chunked("invalid trailer fields"))?;
        let value = HeaderValue::from_bytes(f.value)
            .map_err(|_| meshless_h1::Error::Chunked("invalid trailer fields"))?;
        // Framing, routing and connection fields are no trailers (RFC
        // 9110 6.5.1; an HTTP/2 client refuses them, RFC 9113 8.2.2).
        if !NOT_TRAILERS.contains(&name) && !CONNECTION_FIELDS.contains(&name) {
            map.append(name, value);
        }
    }
    Ok((!map.is_empty()).then_some(map))
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            let fail = |this: &mut Self, e: ExchangeError| {
                this.kind = Kind::Done;
                this.ex = None;
                Poll::Ready(Some(Err(Box::new(e) as BoxError)))
            };
            match this.buffered() {
                Ok(Some(frame)) => return Poll::Ready(Some(Ok(frame))),
                Ok(None) => {}
                Err(e) => return fail(this, e),
            }
            let Some(ex) = this.ex.as_mut() else {
                return Poll::Ready(None);
            };
            // The request is written on while its response is read.
            if let Poll::Ready(Err(e)) = ex.sending.poll_send(&mut ex.conn.io, cx) {
                return fail(this, e);
            }
            match ready!(ex.poll_read(cx)) {
                Ok(0) if matches!(this.kind, Kind::Close) => {
                    // The end of a close-delimited body: the connection
                    // is not reused.
                    this.kind = Kind::Done;
                    this.ex = None;
                    return Poll::Ready(None);
                }
                Ok(0) => return fail(this, ExchangeError::Closed),
                Ok(_) => {}
                Err(e) => return fail(this, e.into()),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.kind, Kind::Done)
    }

    fn size_hint(&self) -> SizeHint {
        match self.kind {
            Kind::Done => SizeHint::with_exact(0),
            Kind::Length(n) => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full, StreamBody};
    use proptest::prelude::*;

    /// The head's fields point into a copy of it: the read buffer stays
    /// unshared, so it goes back to the worker's free buffers whole.
    #[test]
    fn a_response_head_leaves_the_read_buffer_unshared() {
        let mut buf = BytesMut::with_capacity(READ_SIZE);
        buf.extend_from_slice(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: v\r\n\r\nhi");
        let limits = ResponseLimits::default();
        let (parts, _) = take_head(&mut buf, &Method::GET, &limits)
            .expect("valid")
            .expect("whole");
        assert_eq!(&buf[..], b"hi");
        FREE.with(|f| f.borrow_mut().clear());
        give_back(buf);
        assert_eq!(FREE.with(|f| f.borrow().len()), 1, "unshared: kept");
        assert_eq!(parts.headers["x-a"], "v");
        let mut shared = borrow_buffer();
        shared.extend_from_slice(b"abc");
        let sent = shared.split_to(2).freeze();
        give_back(shared);
        assert_eq!(FREE.with(|f| f.borrow().len()), 0, "shared: not kept");
        drop(sent);
        // One grown for a large head is freed, not kept.
        give_back(BytesMut::with_capacity(KEEP_MAX + 1));
        assert_eq!(FREE.with(|f| f.borrow().len()), 0, "grown: not kept");
    }

    /// A request's write buffer goes back to the worker's free ones when
    /// its sending side drops, emptied, and the next request takes it;
    /// one grown past `OUT_KEEP_MAX` is freed instead.
    #[test]
    fn a_request_write_buffer_is_reused_emptied() {
        FREE_OUT.with(|f| f.borrow_mut().clear());
        let req = http::Request::builder()
            .uri("/x")
            .body(full(b"hi"))
            .expect("request");
        let (sending, _) = Sending::new(req).expect("encoded");
        assert!(!sending.out.is_empty(), "the head is in it");
        drop(sending);
        assert_eq!(FREE_OUT.with(|f| f.borrow().len()), 1, "kept");
        let out = out_buffer();
        assert!(out.is_empty() && out.capacity() >= OUT_SIZE);
        assert_eq!(FREE_OUT.with(|f| f.borrow().len()), 0, "taken");
        give_out_back(BytesMut::with_capacity(OUT_KEEP_MAX + 1));
        assert_eq!(FREE_OUT.with(|f| f.borrow().len()), 0, "grown: not kept");
        // Grown for a body copied behind the head, then written out (the
        // cursor advanced): the allocation counts, not the room left.
        let mut written = BytesMut::with_capacity(64 * 1024);
        written.extend_from_slice(&vec![1u8; 62 * 1024]);
        bytes::Buf::advance(&mut written, 62 * 1024);
        assert!(written.capacity() <= OUT_KEEP_MAX);
        give_out_back(written);
        assert_eq!(FREE_OUT.with(|f| f.borrow().len()), 0, "grown: not kept");
    }

    fn full(data: &'static [u8]) -> UpstreamBody {
        Full::new(Bytes::from_static(data))
            .map_err(|never| match never {})
            .boxed()
    }

    /// A body of unknown length, in these frames.
    fn stream(frames: Vec<Vec<u8>>) -> UpstreamBody {
        let frames = frames
            .into_iter()
            .map(|f| Ok::<_, BoxError>(Frame::data(Bytes::from(f))));
        StreamBody::new(tokio_stream::iter(frames)).boxed()
    }

    fn request(
        method: Method,
        fields: &[(&'static str, &'static str)],
        body: UpstreamBody,
    ) -> Request<UpstreamBody> {
        let mut req = Request::new(body);
        *req.method_mut() = method;
        *req.uri_mut() = http::Uri::from_static("/p?q");
        for (n, v) in fields {
            req.headers_mut().append(*n, HeaderValue::from_static(v));
        }
        req
    }

    /// Everything `Sending` writes for `req`.
    async fn written(req: Request<UpstreamBody>) -> Result<Vec<u8>, ExchangeError> {
        let (mut sending, _) = Sending::new(req)?;
        let mut out = Vec::new();
        std::future::poll_fn(|cx| sending.poll_send(&mut out, cx)).await?;
        Ok(out)
    }

    /// The head's fields and the bytes after it.
    fn split(wire: &[u8]) -> (Vec<(String, String)>, Vec<u8>) {
        let mut slots = [httparse::EMPTY_HEADER; 16];
        let mut req = httparse::Request::new(&mut slots);
        let Ok(httparse::Status::Complete(n)) = req.parse(wire) else {
            panic!("not a request head");
        };
        let fields = req
            .headers
            .iter()
            .map(|h| {
                (
                    h.name.to_owned(),
                    String::from_utf8_lossy(h.value).into_owned(),
                )
            })
            .collect();
        (fields, wire[n..].to_vec())
    }

    fn field<'a>(fields: &'a [(String, String)], name: &str) -> Option<&'a str> {
        fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    #[tokio::test]
    async fn framing_of_request_bodies_follows_hypers_client() {
        // No body: no framing field at all.
        let wire = written(request(Method::GET, &[], full(b"")))
            .await
            .expect("written");
        assert_eq!(wire, b"GET /p?q HTTP/1.1\r\n\r\n");
        // A known length is sent as Content-Length.
        let wire = written(request(Method::POST, &[], full(b"abc")))
            .await
            .expect("written");
        let (fields, body) = split(&wire);
        assert_eq!(
            (field(&fields, "content-length"), &body[..]),
            (Some("3"), &b"abc"[..])
        );
        // An unknown one: chunked, but none at all for a GET.
        let wire = written(request(Method::POST, &[], stream(vec![b"ab".to_vec()]))).await;
        let (fields, body) = split(&wire.expect("written"));
        assert_eq!(field(&fields, "transfer-encoding"), Some("chunked"));
        assert_eq!(body, b"2\r\nab\r\n0\r\n\r\n");
        // A GET with content of unknown length is chunked too (hyper's
        // client drops it; `chunk_unsized_get` makes hyper chunk it), a
        // HEAD is sent without.
        let wire = written(request(Method::GET, &[], stream(vec![b"ab".to_vec()]))).await;
        let (fields, body) = split(&wire.expect("written"));
        assert_eq!(field(&fields, "transfer-encoding"), Some("chunked"));
        assert_eq!(body, b"2\r\nab\r\n0\r\n\r\n");
        let wire = written(request(Method::HEAD, &[], stream(vec![b"ab".to_vec()]))).await;
        assert_eq!(wire.expect("written"), b"HEAD /p?q HTTP/1.1\r\n\r\n");
        // A Transfer-Encoding given is made to end in chunked, and wins
        // over a Content-Length.
        let given = [("transfer-encoding", "gzip"), ("content-length", "2")];
        let wire = written(request(Method::POST, &given, stream(vec![b"ab".to_vec()]))).await;
        let (fields, _) = split(&wire.expect("written"));
        assert_eq!(field(&fields, "content-length"), None);
        let te: Vec<_> = fields
            .iter()
            .filter(|(n, _)| n == "transfer-encoding")
            .collect();
        assert_eq!(te.len(), 2);
        assert_eq!(te[1].1, "chunked");
        // One that ends in chunked (any case, any spacing) is kept alone;
        // one with a byte outside visible ASCII is not chunked (as hyper
        // reads it), so chunked is added after it.
        let given = [("transfer-encoding", "gzip ,  CHUNKED ")];
        let wire = written(request(Method::POST, &given, stream(vec![b"ab".to_vec()]))).await;
        let (fields, body) = split(&wire.expect("written"));
        let te: Vec<_> = fields
            .iter()
            .filter(|(n, _)| n == "transfer-encoding")
            .collect();
        assert_eq!(te.len(), 1, "{fields:?}");
        assert_eq!(body, b"2\r\nab\r\n0\r\n\r\n");
        let mut req = request(Method::POST, &[], stream(vec![b"ab".to_vec()]));
        req.headers_mut().append(
            "transfer-encoding",
            HeaderValue::from_bytes(b"\xc3\xa9, chunked").expect("obs-text is a valid value"),
        );
        let wire = written(req).await.expect("written");
        let te = wire
            .windows(b"transfer-encoding: chunked\r\n".len())
            .filter(|w| w.eq_ignore_ascii_case(b"transfer-encoding: chunked\r\n"))
            .count();
        assert_eq!(te, 1, "{}", String::from_utf8_lossy(&wire));
    }

    /// A body of unknown length with data, then trailers.
    fn with_trailers(trailers: &[(&'static str, &'static str)]) -> UpstreamBody {
        let mut map = HeaderMap::new();
        for (n, v) in trailers {
            map.append(*n, HeaderValue::from_static(v));
        }
        let frames = vec![
            Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"ab"))),
            Ok(Frame::trailers(map)),
        ];
        StreamBody::new(tokio_stream::iter(frames)).boxed()
    }

    #[tokio::test]
    async fn chunked_request_trailers_are_sent_as_hypers_client_sends_them() {
        let sent = [("x-a", "1"), ("x-b", "2"), ("host", "evil"), ("x-c", "3")];
        // Only the fields `Trailer` names, never a routing or framing one.
        let declared = [("trailer", "x-a, Host"), ("trailer", "x-c")];
        let wire = written(request(Method::POST, &declared, with_trailers(&sent))).await;
        let (_, body) = split(&wire.expect("written"));
        assert_eq!(body, b"2\r\nab\r\n0\r\nx-a: 1\r\nx-c: 3\r\n\r\n");
        // None named: none sent.
        let wire = written(request(Method::POST, &[], with_trailers(&sent))).await;
        let (_, body) = split(&wire.expect("written"));
        assert_eq!(body, b"2\r\nab\r\n0\r\n\r\n");
        // A body with a length has no room for trailers.
        let given = [("trailer", "x-a"), ("content-length", "2")];
        let wire = written(request(Method::POST, &given, with_trailers(&sent))).await;
        let (_, body) = split(&wire.expect("written"));
        assert_eq!(body, b"ab");
    }

    /// RFC 9112 6.2: once its `Content-Length` bytes are written the
    /// request is whole, though the body's end of stream has not come (an
    /// HTTP/2 client's END_STREAM in a later frame of its own): the
    /// exchange does not wait for it, and the connection stays reusable.
    #[tokio::test]
    async fn a_request_is_whole_once_its_length_is_written() {
        use tokio_stream::StreamExt as _;
        let frames = tokio_stream::iter(vec![Ok::<_, BoxError>(Frame::data(Bytes::from_static(
            b"hello",
        )))])
        .chain(tokio_stream::pending());
        let body = StreamBody::new(frames).boxed();
        let req = request(Method::POST, &[("content-length", "5")], body);
        let (mut sending, _) = Sending::new(req).expect("head");
        let mut out = Vec::new();
        let sent = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            std::future::poll_fn(|cx| sending.poll_send(&mut out, cx)),
        )
        .await;
        assert!(matches!(sent, Ok(Ok(()))), "the request was not finished");
        assert!(sending.complete());
        let (_, body) = split(&out);
        assert_eq!(body, b"hello");
        // A length of zero: whole at once, whatever the body does.
        let body =
            StreamBody::new(tokio_stream::pending::<Result<Frame<Bytes>, BoxError>>()).boxed();
        let req = request(Method::POST, &[("content-length", "0")], body);
        let (mut sending, _) = Sending::new(req).expect("head");
        let mut out = Vec::new();
        std::future::poll_fn(|cx| sending.poll_send(&mut out, cx))
            .await
            .expect("written");
        assert!(sending.complete());
    }

    #[tokio::test]
    async fn cookie_fields_go_upstream_as_one_line() {
        let cookies = [("cookie", "a=1"), ("cookie", "b=2"), ("x", "y")];
        let wire = written(request(Method::GET, &cookies, full(b""))).await;
        let (fields, _) = split(&wire.expect("written"));
        let all: Vec<&(String, String)> = fields.iter().filter(|(n, _)| n == "cookie").collect();
        assert_eq!(all.len(), 1, "{fields:?}");
        assert_eq!(all[0].1, "a=1; b=2");
    }

    #[test]
    fn response_trailers_leave_framing_and_connection_fields_out() {
        let map =
            trailer_map(b"x-t: 1\r\ncontent-length: 5\r\nconnection: close\r\nhost: h\r\n\r\n")
                .expect("parsed")
                .expect("fields");
        assert_eq!(map.len(), 1, "{map:?}");
        assert_eq!(map.get("x-t").map(HeaderValue::as_bytes), Some(&b"1"[..]));
        let none = trailer_map(b"content-length: 5\r\n\r\n").expect("parsed");
        assert!(none.is_none());
    }

    #[tokio::test]
    async fn a_body_that_differs_from_its_length_is_an_error() {
        let short = request(Method::POST, &[("content-length", "5")], full(b"abc"));
        assert!(matches!(written(short).await, Err(ExchangeError::Length)));
        let long = request(Method::POST, &[("content-length", "2")], full(b"abc"));
        assert!(matches!(written(long).await, Err(ExchangeError::Length)));
    }

    proptest! {
        /// RFC 9112 7.1: a body of unknown length written chunked decodes
        /// (by meshless-h1's decoder) to its frames' data, and ends
        /// exactly at the end of what was written; large frames (written
        /// from their own bytes) too.
        #[test]
        fn a_streamed_body_is_written_as_chunks_of_its_data(
            frames in prop::collection::vec(
                prop_oneof![
                    prop::collection::vec(any::<u8>(), 0..64),
                    prop::collection::vec(any::<u8>(), COPY_MAX..COPY_MAX + 100),
                ],
                0..6,
            )
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
            let expected: Vec<u8> = frames.concat();
            let wire = rt
                .block_on(written(request(Method::PUT, &[], stream(frames))))
                .expect("written");
            let (fields, body) = split(&wire);
            prop_assert_eq!(field(&fields, "transfer-encoding"), Some("chunked"));
            let mut decoder = Decoder::new(10);
            let (mut pos, mut data) = (0, Vec::new());
            loop {
                match decoder.decode(&body[pos..]).expect("valid chunks") {
                    Step::Data(r) => {
                        data.extend_from_slice(&body[pos..][r.clone()]);
                        pos += r.end;
                    }
                    Step::Incomplete { .. } => panic!("the body does not end"),
                    Step::Done { consumed, .. } => {
                        pos += consumed;
                        break;
                    }
                }
            }
            prop_assert_eq!(pos, body.len());
            prop_assert_eq!(data, expected);
        }
    }
}
