//! The two sides of the differential test: the codec (`meshless_h1::check`)
//! and hyper 1 (its server and client HTTP/1 connections over an in-memory
//! duplex), each reducing a byte stream to the messages it framed. Used by
//! `tests/differential.rs` and by the `h1_differential` fuzz target.
#![allow(dead_code, clippy::unwrap_used)]

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use meshless_h1::Limits;
use meshless_h1::check::{self, BodyEnd, End, Stream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Header or trailer fields: lowercase name, value.
pub type Fields = Vec<(String, Vec<u8>)>;

/// One message as seen on either side, in a form both can produce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub line: String,
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body when it completed, `None` when it did not.
    pub body: Option<(Vec<u8>, Fields)>,
}

/// How a stream ended, as both sides can tell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Every byte framed (or ignored after a message that closes).
    Clean,
    /// A head or body refused, or the input ended inside one.
    Refused,
    /// `CONNECT` (the screen's `501`).
    Connect,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub messages: Vec<Seen>,
    pub end: Ending,
}

pub fn sorted(mut fields: Vec<(String, Vec<u8>)>) -> Vec<(String, Vec<u8>)> {
    // hyper's HeaderMap groups values by name; a stable sort by name gives
    // both sides the same order (values of one name stay in wire order).
    fields.sort_by(|a, b| a.0.cmp(&b.0));
    fields
}

pub fn map_fields(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    let fields = headers
        .iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect();
    sorted(fields)
}

pub fn version(v: http::Version) -> &'static str {
    if v == http::Version::HTTP_10 {
        "HTTP/1.0"
    } else {
        "HTTP/1.1"
    }
}

/// The codec's view of a request stream.
pub fn ours(input: &[u8]) -> Outcome {
    ours_with(input, &Limits::default())
}

pub fn ours_with(input: &[u8], limits: &Limits) -> Outcome {
    let Stream { messages, end } = check::request_stream_with(input, limits);
    let messages = messages
        .into_iter()
        .map(|m| Seen {
            line: m.line,
            headers: sorted(m.headers),
            body: (m.end == BodyEnd::Complete).then(|| (m.body, sorted(m.trailers))),
        })
        .collect();
    let end = match end {
        End::Clean => Ending::Clean,
        End::Upgrade => Ending::Connect,
        End::Truncated | End::Rejected(_) => Ending::Refused,
    };
    Outcome { messages, end }
}

/// What the hyper side's service recorded.
#[derive(Debug)]
pub enum Record {
    Message(Seen),
    Screened(StatusCode),
}

/// The proxy's screen stage, as far as framing is concerned.
pub fn screen(parts: &http::request::Parts, limits: &Limits) -> Option<StatusCode> {
    let target = parts.uri.path_and_query().map_or(0, |p| p.as_str().len());
    let field_bytes: usize = parts
        .headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum();
    if target > limits.max_uri_bytes {
        Some(StatusCode::URI_TOO_LONG)
    } else if parts.headers.len() > limits.max_headers || field_bytes > limits.max_header_bytes {
        Some(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
    } else if parts.method == Method::CONNECT {
        Some(StatusCode::NOT_IMPLEMENTED)
    } else {
        None
    }
}

pub async fn record(
    req: Request<Incoming>,
    limits: Limits,
    log: Arc<Mutex<Vec<Record>>>,
) -> Response<Empty<Bytes>> {
    let (parts, body) = req.into_parts();
    if let Some(status) = screen(&parts, &limits) {
        log.lock().unwrap().push(Record::Screened(status));
        let mut resp = Response::new(Empty::new());
        *resp.status_mut() = status;
        resp.headers_mut()
            .insert("connection", http::HeaderValue::from_static("close"));
        return resp;
    }
    let line = format!("{} {} {}", parts.method, parts.uri, version(parts.version));
    let headers = map_fields(&parts.headers);
    let body = body.collect().await.ok().map(|c| {
        let trailers = c.trailers().map(map_fields).unwrap_or_default();
        (c.to_bytes().to_vec(), trailers)
    });
    let seen = Seen {
        line,
        headers,
        body,
    };
    log.lock().unwrap().push(Record::Message(seen));
    Response::new(Empty::new())
}

/// hyper's (plus the screen's) view of a request stream.
pub async fn hypers(input: Vec<u8>) -> Outcome {
    hypers_with(input, Limits::default()).await
}

/// As [`hypers`], with hyper built and the screen run for `limits` (as
/// crates/proxy/src/hyper_h1.rs builds it).
pub async fn hypers_with(input: Vec<u8>, limits: Limits) -> Outcome {
    let (client, server) = tokio::io::duplex(1 << 16);
    let log = Arc::new(Mutex::new(Vec::new()));
    let svc_log = Arc::clone(&log);
    let service = service_fn(move |req| {
        let log = Arc::clone(&svc_log);
        async move { Ok::<_, Infallible>(record(req, limits, log).await) }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    if limits.slots() > 100 {
        builder.max_headers(limits.slots());
    }
    // Half-close: the client shuts its write side after the last byte;
    // hyper must still answer what it read (the proxy does not set it, and
    // it does not change framing).
    builder
        .max_buf_size(limits.max_head_bytes())
        .half_close(true);
    let conn = builder.serve_connection(TokioIo::new(server), service);
    let (mut rd, mut wr) = tokio::io::split(client);
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(&input).await;
        let _ = wr.shutdown().await;
        // Keep the write half until the server is done with the stream.
        wr
    });
    let reader = tokio::spawn(async move {
        let mut sink = Vec::new();
        let _ = rd.read_to_end(&mut sink).await;
    });
    let result = tokio::time::timeout(Duration::from_secs(20), conn)
        .await
        .expect("hyper finished the stream");
    drop(writer.await);
    let _ = reader.await;
    let mut messages = Vec::new();
    let mut end = if result.is_ok() {
        Ending::Clean
    } else {
        Ending::Refused
    };
    for r in log.lock().unwrap().drain(..) {
        match r {
            Record::Message(m) => {
                if m.body.is_none() {
                    end = Ending::Refused;
                }
                messages.push(m);
            }
            Record::Screened(StatusCode::NOT_IMPLEMENTED) => end = Ending::Connect,
            Record::Screened(_) => end = Ending::Refused,
        }
    }
    Outcome { messages, end }
}

/// The codec's first final response (after any `1xx`) of `input` to a
/// request with `method`; `None` when there is none.
pub fn our_response(input: &[u8], method: &Method) -> Option<Seen> {
    let Stream { messages, .. } = check::response_stream(input, method);
    messages
        .into_iter()
        .find(|m| !m.line.ends_with(" 100") && !is_informational(&m.line))
        .map(|m| Seen {
            line: m.line,
            headers: sorted(m.headers),
            body: (m.end == BodyEnd::Complete).then(|| (m.body, sorted(m.trailers))),
        })
}

pub fn is_informational(line: &str) -> bool {
    line.rsplit(' ')
        .next()
        .and_then(|c| c.parse::<u16>().ok())
        .is_some_and(|c| (100..200).contains(&c) && c != 101)
}

/// hyper's client's view: one request with `method`, answered by `input`.
pub async fn hyper_response(input: Vec<u8>, method: Method) -> Option<Seen> {
    let (client, server) = tokio::io::duplex(1 << 16);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(client))
        .await
        .unwrap();
    let conn = tokio::spawn(conn.with_upgrades());
    let upstream = tokio::spawn(async move {
        let (mut rd, mut wr) = tokio::io::split(server);
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if rd.read(&mut byte).await.unwrap_or(0) == 0 {
                return;
            }
            head.push(byte[0]);
        }
        let _ = wr.write_all(&input).await;
        let _ = wr.shutdown().await;
        let mut sink = Vec::new();
        let _ = rd.read_to_end(&mut sink).await;
    });
    let uri = if method == Method::CONNECT {
        "a.example:443"
    } else {
        "/"
    };
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .header("host", "a.example")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let seen = match tokio::time::timeout(Duration::from_secs(20), async {
        let resp = sender.send_request(req).await.ok()?;
        let (parts, body) = resp.into_parts();
        let line = format!("{} {}", version(parts.version), parts.status.as_u16());
        let body = body.collect().await.ok().map(|c| {
            let trailers = c.trailers().map(map_fields).unwrap_or_default();
            (c.to_bytes().to_vec(), trailers)
        });
        Some(Seen {
            line,
            headers: map_fields(&parts.headers),
            body,
        })
    })
    .await
    {
        Ok(seen) => seen,
        Err(_) => panic!("hyper's client did not finish"),
    };
    conn.abort();
    upstream.abort();
    seen
}
