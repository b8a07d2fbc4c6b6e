//! Downstream HTTP/1.1 served by hyper's server connection
//! (`listeners[].http1: hyper`, and every connection the meshless state
//! machine hands over: upgrades, `CONNECT`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;

use crate::drain::{Drain, drive};
use crate::limits::ListenerSettings;
use crate::request::downstream::Source;
use crate::request::{Downstream, Peer};
use crate::send_timed::SendTimed;

/// Serves HTTP/1.1 on `io` with hyper's server connection (upgrades
/// included) until it closes or drains.
pub async fn serve<I>(
    downstream: Arc<Downstream>,
    io: I,
    peer: Peer,
    draining: watch::Receiver<Drain>,
) where
    I: AsyncRead + AsyncWrite + crate::wait_read::WaitRead + Unpin + Send + 'static,
{
    let settings = downstream.settings();
    let io = SendTimed::new(io, settings.timeouts.send, Arc::clone(&downstream));
    let upgraded = io.upgraded();
    let io = TokioIo::new(io);
    {
        {
            let closing = Arc::new(AtomicBool::new(false));
            let close = Arc::clone(&closing);
            // Boxed, once per request: hyper keeps the service's future in a
            // slot of every connection, which at hundreds of connections is
            // cold memory on each request, and idle memory between requests;
            // a fresh allocation is the one the last request just freed.
            let service = service_fn(move |req| {
                let (downstream, peer) = (Arc::clone(&downstream), peer.clone());
                let close = Arc::clone(&close);
                let upgraded = Arc::clone(&upgraded);
                // The request's future is made inside the block: made
                // outside and moved in, it would take room twice.
                Box::pin(async move {
                    let (parts, body) = req.into_parts();
                    let mut resp =
                        crate::request::handle(downstream, peer, parts, Source::Hyper(body))
                            .await?;
                    let upgrading = resp.status() == http::StatusCode::SWITCHING_PROTOCOLS;
                    if upgrading {
                        // A tunnel's idle time is `stream_idle`'s, not
                        // `timeouts.send`'s.
                        upgraded.store(true, Ordering::Release);
                    }
                    if close.load(Ordering::Acquire) && !upgrading {
                        resp.headers_mut().insert(
                            http::header::CONNECTION,
                            http::HeaderValue::from_static("close"),
                        );
                    }
                    Ok::<_, std::convert::Infallible>(resp)
                })
            });
            let conn = http1_builder(&settings)
                .serve_connection(io, service)
                .with_upgrades();
            drive(conn, draining, Some(&closing), |c| c.graceful_shutdown()).await;
        }
    }
}

fn http1_builder(settings: &ListenerSettings) -> http1::Builder {
    let mut b = http1::Builder::new();
    b.timer(TokioTimer::new())
        .header_read_timeout(settings.timeouts.request_headers)
        .max_buf_size(head_buffer(settings));
    if let Some(n) = hyper_max_headers(settings.limits.max_headers) {
        b.max_headers(n);
    }
    b
}

/// hyper's own header-count limit, when its default (100, parsed on the
/// stack) does not do: the screen stage answers `431` with its reason for
/// more than `max_headers`, so hyper must parse one more. Up to 100, hyper's
/// default lets the screen see every count it refuses, and more than 100
/// hyper refuses itself (also `431`). Set, hyper allocates two arrays of
/// that many entries on the heap for every request head it parses.
fn hyper_max_headers(max_headers: u32) -> Option<usize> {
    const HYPER_DEFAULT: usize = 100;
    let n = max_headers as usize + 1;
    (n > HYPER_DEFAULT + 1).then_some(n)
}

/// hyper's read buffer for a request head: the header and target limits
/// plus room for the request line; hyper answers `431` past it.
fn head_buffer(s: &ListenerSettings) -> usize {
    let want = s.limits.max_header_bytes as usize + s.limits.max_uri_bytes as usize + 1024;
    want.max(8192)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyper_parses_on_the_stack_up_to_its_default() {
        assert_eq!(hyper_max_headers(10), None);
        assert_eq!(hyper_max_headers(100), None);
        assert_eq!(hyper_max_headers(101), Some(102));
    }
}
