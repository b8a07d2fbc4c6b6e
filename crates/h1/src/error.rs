//! What the codec refuses, and the status a server answers it with.

use http::StatusCode;

/// A message the codec refuses. Every variant ends the connection: after
/// it, the byte stream can no longer be framed safely.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The head is not HTTP/1.x grammar (httparse's verdict), or its method
    /// or target is not one `http` accepts.
    #[error("malformed message head: {0}")]
    Head(&'static str),
    /// A well-formed HTTP version of a major other than 1 (`HTTP/2.0` in
    /// a request line: `505`); a malformed version is a [`Error::Head`].
    #[error("unsupported HTTP version")]
    Version,
    /// The request target is over the limit (or hyper's 65,534 bytes).
    #[error("request target too long")]
    UriTooLong,
    /// The head is over the byte limit, or has too many header fields.
    #[error("message head too large")]
    HeadTooLarge,
    /// `Transfer-Encoding` whose last coding is not `chunked`, or on
    /// HTTP/1.0 (RFC 9112 6.1, 6.3).
    #[error("invalid Transfer-Encoding")]
    TransferEncoding,
    /// `Content-Length` that is not digits, or several that differ.
    #[error("invalid Content-Length")]
    ContentLength,
    /// A chunked body that breaks the grammar or a limit.
    #[error("invalid chunked body: {0}")]
    Chunked(&'static str),
    /// A response status line or code that is not valid.
    #[error("invalid response status")]
    Status,
}

impl Error {
    /// The status a server answers a refused request with (a client hop
    /// answers its own `502` instead).
    pub fn status(&self) -> StatusCode {
        match self {
            Error::UriTooLong => StatusCode::URI_TOO_LONG,
            Error::HeadTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Error::Version => StatusCode::HTTP_VERSION_NOT_SUPPORTED,
            // RFC 9112 6.3: a request whose last coding is not `chunked`
            // MUST be answered 400 (501 is for CONNECT, which the codec
            // reports and the proxy's screen refuses).
            Error::TransferEncoding
            | Error::Head(_)
            | Error::ContentLength
            | Error::Chunked(_)
            | Error::Status => StatusCode::BAD_REQUEST,
        }
    }
}

/// httparse's verdict as a codec error.
pub(crate) fn from_httparse(e: httparse::Error) -> Error {
    match e {
        httparse::Error::TooManyHeaders => Error::HeadTooLarge,
        httparse::Error::Version => Error::Version,
        httparse::Error::Status => Error::Status,
        httparse::Error::HeaderName => Error::Head("header name"),
        httparse::Error::HeaderValue => Error::Head("header value"),
        httparse::Error::NewLine => Error::Head("line ending"),
        httparse::Error::Token => Error::Head("method or target"),
    }
}
