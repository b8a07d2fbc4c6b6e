//! Stage 4, attempt: pick an endpoint, send, classify the outcome. A
//! [`RetryPolicy`] owns the attempt count and the endpoints tried; only
//! upstream faults are the endpoint's or retried — a broken downstream
//! body is the client's ([`Failure::ClientBody`]).

use std::time::Duration;

use crate::upstream::ResponseBody;
use http::{Response, StatusCode};
use meshless_balance::{InFlight, Outcome, PickContext};

use crate::config::{Retries, RetryOn};
use crate::request::downstream::ClientFault;
use crate::request::respond::LocalReply;
use crate::snapshot::UpstreamCluster;
use crate::upstream::{ConnectError, Lease, SendError, TlsFault, UpstreamBody};

/// How many endpoints a request remembers having tried.
const TRIED: usize = 4;

/// The first retry's back-off ceiling (Envoy's `base_interval` default).
const BACKOFF_BASE: Duration = Duration::from_millis(25);
/// The largest back-off ceiling (Envoy's default, 10 x the base).
const BACKOFF_MAX: Duration = Duration::from_millis(250);

/// Attempts of one request: how many are allowed, which failures are
/// retried, which endpoints were tried.
#[derive(Debug)]
pub struct RetryPolicy {
    max_attempts: u32,
    attempts: u32,
    /// The retried failures, one bit each ([`bit`]): made per request
    /// without the allocation a copy of the config's list was.
    on: u32,
    tried: [usize; TRIED],
}

/// The bit of `on` in [`RetryPolicy`]'s set.
fn bit(on: RetryOn) -> u32 {
    1 << (on as u32)
}

// Every kind has a bit of a `u32` (the last one declared is the largest).
const _: () = assert!((RetryOn::Unavailable as u32) < 32);

impl RetryPolicy {
    /// `1 + retries.count` attempts for a `replayable` request (no body,
    /// idempotent or `all_methods`, no upgrade), else one. The config
    /// bounds `count` ([`crate::config::MAX_RETRIES`]); the sum saturates
    /// all the same.
    pub fn new(retries: &Retries, replayable: bool) -> Self {
        Self {
            max_attempts: if replayable {
                retries.count.saturating_add(1)
            } else {
                1
            },
            attempts: 0,
            on: retries.on.iter().fold(0, |set, &on| set | bit(on)),
            tried: [usize::MAX; TRIED],
        }
    }

    /// Attempts made so far.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether the attempts are used up: the one just recorded was the last.
    pub fn last(&self) -> bool {
        self.attempts >= self.max_attempts
    }

    /// Whether the next attempt is a retry.
    pub fn retrying(&self) -> bool {
        self.attempts > 0
    }

    /// Records an attempt to endpoint `index`.
    pub fn record(&mut self, index: usize) {
        self.tried[self.attempts as usize % TRIED] = index;
        self.attempts += 1;
    }

    /// Takes back the last attempt recorded: it never reached its
    /// endpoint and is made again (a released request's reconnect).
    pub fn forget_last(&mut self) {
        self.attempts = self.attempts.saturating_sub(1);
        self.tried[self.attempts as usize % TRIED] = usize::MAX;
    }

    /// The wait before the next attempt, a retry: fully jittered between
    /// zero and [`backoff_ceiling`] (Envoy's default retry back-off), so
    /// retries of a failing endpoint do not follow each other at once.
    pub fn backoff(&self) -> Duration {
        backoff_ceiling(self.attempts).mul_f64(fastrand::f64())
    }

    /// Whether a failure of kind `on` may be retried (the budget aside).
    /// A refused stream (never processed) is, listed in `on` or not.
    pub fn may_retry(&self, on: RetryOn) -> bool {
        self.attempts < self.max_attempts
            && (on == RetryOn::RefusedStream || self.on & bit(on) != 0)
    }

    /// Whether a failure that can only come once the request was made
    /// (a reset, a response) may still be retried: attempts are left and
    /// `on` lists more than `connect_failure` (a refused stream, always
    /// retried, comes from HTTP/2 endpoints only). Without it, an attempt
    /// over meshless's own HTTP/1.1 connections is followed by another
    /// only when it could not connect, before its request was made: the
    /// request's headers need no copy for it.
    pub fn retries_once_sent(&self) -> bool {
        self.attempts < self.max_attempts && self.on & !bit(RetryOn::ConnectFailure) != 0
    }

    /// A pick that avoids endpoints already tried (when the cluster has
    /// others), the way Envoy's `previous_hosts` predicate does.
    pub fn pick(&self, cluster: &UpstreamCluster, ctx: &PickContext<'_>) -> Option<InFlight> {
        if !self.retrying() {
            return cluster.lb.pick(ctx);
        }
        for _ in 0..TRIED {
            // Hash keys always map to the same endpoint: retries pick freely.
            let mut c = *ctx;
            c.key = None;
            c.entropy = fastrand::u64(..);
            let g = cluster.lb.pick(&c)?;
            if !self.tried.contains(&g.index()) || cluster.lb.endpoints().len() <= 1 {
                return Some(g);
            }
            g.finish(Outcome::Cancelled);
        }
        cluster.lb.pick(ctx)
    }
}

/// The back-off ceiling after `attempts` attempts: 25 ms after the first,
/// doubled after each further one, at most 250 ms.
fn backoff_ceiling(attempts: u32) -> Duration {
    let doublings = attempts.saturating_sub(1).min(8);
    BACKOFF_BASE.saturating_mul(1 << doublings).min(BACKOFF_MAX)
}

/// Why an attempt got no response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The cluster's `max_connections` is reached (shed, not the endpoint's).
    ConnectionLimit,
    /// No connection could be opened.
    ConnectFailed,
    /// The connection broke before response headers.
    Reset,
    /// The HTTP/2 endpoint refused the stream (REFUSED_STREAM): the
    /// request was not processed.
    Refused,
    /// No response headers within `timeouts.request`.
    Timeout,
    /// The downstream request body was malformed or cut: the client's fault.
    ClientBody,
    /// The cluster's `max_pending` is reached (shed before sending).
    Pending,
    /// The request cannot be expressed upstream.
    BadRequest,
    /// The TLS handshake with the endpoint failed (a connect failure of
    /// the endpoint's, answered with the reason).
    Tls(TlsFault),
}

impl Failure {
    /// The outcome recorded for the endpoint (outlier detection, stats).
    pub fn outcome(self) -> Outcome {
        match self {
            Failure::ConnectionLimit
            | Failure::ClientBody
            | Failure::Pending
            | Failure::BadRequest => Outcome::Cancelled,
            Failure::ConnectFailed | Failure::Tls(_) => Outcome::ConnectFailed,
            Failure::Reset | Failure::Refused => Outcome::Reset,
            Failure::Timeout => Outcome::Timeout,
        }
    }

    /// The retry condition this failure matches, if any may retry it.
    pub fn retry_on(self) -> Option<RetryOn> {
        match self {
            Failure::ConnectFailed | Failure::Tls(_) => Some(RetryOn::ConnectFailure),
            Failure::Reset => Some(RetryOn::Reset),
            Failure::Refused => Some(RetryOn::RefusedStream),
            _ => None,
        }
    }

    /// The local reply when this failure ends the request.
    pub fn reply(self) -> LocalReply {
        match self {
            Failure::ConnectionLimit => LocalReply::overflow("max_connections"),
            Failure::ConnectFailed => LocalReply::text(
                StatusCode::BAD_GATEWAY,
                "upstream connect failed\n",
                "connect_failed",
            ),
            Failure::Reset | Failure::Refused => {
                LocalReply::text(StatusCode::BAD_GATEWAY, "upstream reset\n", "reset")
            }
            Failure::Timeout => {
                LocalReply::text(StatusCode::GATEWAY_TIMEOUT, "upstream timeout\n", "timeout")
            }
            Failure::Tls(fault) => LocalReply::text(
                StatusCode::SERVICE_UNAVAILABLE,
                fault.message(),
                "tls_failed",
            ),
            Failure::Pending => LocalReply::overflow("max_pending"),
            Failure::BadRequest => {
                LocalReply::text(StatusCode::BAD_REQUEST, "bad request\n", "bad_request")
            }
            Failure::ClientBody => LocalReply::text(
                StatusCode::BAD_REQUEST,
                "malformed or incomplete request body\n",
                "client_error",
            ),
        }
    }
}

/// What a response says of its endpoint (the outcome recorded) and the
/// retry condition it matches: a 5xx, or for a gRPC request a
/// `grpc-status` in the headers (a trailers-only answer), taken as the HTTP
/// status Envoy maps it to (UNAVAILABLE is a 503).
///
/// A gRPC response (`content-type: application/grpc`) that ends with its
/// headers and has no `grpc-status` in them is INTERNAL (gRPC clients
/// report a missing status so): a failure, retried on `internal`.
pub fn judge(resp: &Response<ResponseBody>, grpc: bool) -> (Outcome, Option<RetryOn>) {
    use http_body::Body as _;
    let code = if grpc {
        crate::request::grpc::status(resp.headers()).or_else(|| {
            (resp.status() == http::StatusCode::OK
                && crate::request::grpc::is_grpc(resp.headers())
                && resp.body().is_end_stream())
            .then_some(crate::request::grpc::code::INTERNAL)
        })
    } else {
        None
    };
    let http = code.map_or(resp.status().as_u16(), crate::request::grpc::http_status);
    let on = if resp.status().is_server_error() {
        Some(RetryOn::FiveXx)
    } else {
        code.and_then(crate::request::grpc::retry_on)
    };
    (Outcome::Status(http), on)
}

/// Sends one attempt to endpoint `index` and waits (until `deadline`, if
/// any) for its response headers. The lease holds the connection until the
/// response ends.
///
/// The request is made by `make` only once a connection is there (a
/// failure to connect leaves what `make` would take with the caller),
/// unless it asks to `upgrade`: that one goes straight to a new connection
/// ([`crate::upstream::EndpointPool::send`]).
pub async fn send(
    cluster: &UpstreamCluster,
    index: usize,
    (make, upgrade): (impl FnOnce() -> http::Request<UpstreamBody>, bool),
    deadline: Option<tokio::time::Instant>,
    fault: &ClientFault,
) -> Result<(Response<ResponseBody>, Lease), Failure> {
    let pool = &cluster.endpoint_pools[index];
    // Pinned in place: moved into `timeout` by value, the exchange would
    // take room in this future twice.
    let exchange = std::pin::pin!(async move {
        if upgrade {
            pool.send(make()).await
        } else {
            pool.send_once_connected(make).await
        }
    });
    // At the deadline itself: no clock read to turn it into a duration.
    let sent = match deadline {
        Some(at) => tokio::time::timeout_at(at, exchange).await,
        None => Ok(exchange.await),
    };
    match sent {
        Ok(Ok(answer)) => Ok(answer),
        // Whatever the error, a body the client broke is the client's.
        Ok(Err(_)) if fault.is_set() => Err(Failure::ClientBody),
        Ok(Err(SendError::Connect(ConnectError::Limit))) => Err(Failure::ConnectionLimit),
        Ok(Err(SendError::Connect(ConnectError::Connect))) => Err(Failure::ConnectFailed),
        Ok(Err(SendError::Connect(ConnectError::Tls(f)))) => Err(Failure::Tls(f)),
        Ok(Err(SendError::Http(_) | SendError::Exchange(_))) => Err(Failure::Reset),
        Ok(Err(SendError::Refused)) => Err(Failure::Refused),
        Err(_) if fault.is_set() => Err(Failure::ClientBody),
        Err(_) => Err(Failure::Timeout),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn retries(count: u32, on: Vec<RetryOn>) -> Retries {
        Retries {
            count,
            on,
            ..Retries::default()
        }
    }

    /// Each kind listed is retried, and only those (and a refused
    /// stream, always): the bits are distinct.
    #[test]
    fn the_retried_kinds_are_the_listed_ones() {
        let all = [
            RetryOn::ConnectFailure,
            RetryOn::Reset,
            RetryOn::RefusedStream,
            RetryOn::FiveXx,
            RetryOn::Cancelled,
            RetryOn::DeadlineExceeded,
            RetryOn::Internal,
            RetryOn::ResourceExhausted,
            RetryOn::Unavailable,
        ];
        for listed in all {
            let p = RetryPolicy::new(&retries(1, vec![listed]), true);
            for asked in all {
                let retried = asked == listed || asked == RetryOn::RefusedStream;
                assert_eq!(p.may_retry(asked), retried, "{listed:?} listed, {asked:?}");
            }
        }
        let p = RetryPolicy::new(&retries(1, all[3..].to_vec()), true);
        assert!(all[3..].iter().all(|&k| p.may_retry(k)));
        assert!(!p.may_retry(RetryOn::Reset) && !p.may_retry(RetryOn::ConnectFailure));
    }

    /// Asked once the attempt is recorded: only `connect_failure` listed
    /// (the default), no retry can follow a request once made; anything
    /// more listed, one can, until the attempts are used up.
    #[test]
    fn retries_once_sent_need_more_than_connect_failure() {
        let mut p = RetryPolicy::new(&Retries::default(), true);
        p.record(0);
        assert!(!p.retries_once_sent(), "the default: connect_failure only");
        for on in [
            RetryOn::Reset,
            RetryOn::FiveXx,
            RetryOn::RefusedStream,
            RetryOn::Unavailable,
        ] {
            let mut p = RetryPolicy::new(&retries(1, vec![RetryOn::ConnectFailure, on]), true);
            p.record(0);
            assert!(p.retries_once_sent(), "{on:?}: a retry is left");
            p.record(1);
            assert!(!p.retries_once_sent(), "{on:?}: attempts used up");
        }
        let mut p = RetryPolicy::new(&retries(1, vec![RetryOn::Reset]), false);
        p.record(0);
        assert!(!p.retries_once_sent(), "not replayable: one attempt");
    }

    #[test]
    fn a_request_with_a_body_is_tried_once() {
        let mut p = RetryPolicy::new(&retries(3, vec![RetryOn::Reset]), false);
        p.record(0);
        assert!(!p.may_retry(RetryOn::Reset));
    }

    #[test]
    fn retries_stop_at_the_count_and_only_on_listed_failures() {
        let mut p = RetryPolicy::new(&retries(2, vec![RetryOn::Reset]), true);
        assert!(!p.retrying());
        p.record(0);
        assert!(p.retrying() && p.may_retry(RetryOn::Reset));
        assert!(!p.may_retry(RetryOn::FiveXx));
        p.record(1);
        assert!(p.may_retry(RetryOn::Reset));
        assert!(!p.last());
        p.record(2);
        assert!(!p.may_retry(RetryOn::Reset));
        assert!(p.last());
        assert_eq!(p.attempts(), 3);
    }

    #[test]
    fn the_largest_count_saturates_instead_of_overflowing() {
        let mut p = RetryPolicy::new(&retries(u32::MAX, vec![RetryOn::Reset]), true);
        p.record(0);
        assert!(p.may_retry(RetryOn::Reset) && !p.last());
    }

    #[test]
    fn retries_back_off_exponentially_up_to_a_ceiling() {
        let ceilings: Vec<u64> = (1..=7)
            .map(|n| backoff_ceiling(n).as_millis() as u64)
            .collect();
        assert_eq!(ceilings, [25, 50, 100, 200, 250, 250, 250]);
        assert_eq!(backoff_ceiling(u32::MAX), BACKOFF_MAX);
        let mut p = RetryPolicy::new(&retries(10, vec![RetryOn::Reset]), true);
        for i in 0..10 {
            p.record(i);
            let wait = p.backoff();
            assert!(wait <= backoff_ceiling(p.attempts()), "{wait:?}");
        }
    }

    #[test]
    fn client_faults_are_never_the_endpoints_nor_retried() {
        let f = Failure::ClientBody;
        assert_eq!(f.outcome(), Outcome::Cancelled);
        assert!(!f.outcome().is_5xx() && !f.outcome().is_gateway_error());
        assert_eq!(f.retry_on(), None);
        assert_eq!(f.reply().status, StatusCode::BAD_REQUEST);
        assert_eq!(Failure::Timeout.retry_on(), None);
        assert!(Failure::Reset.outcome().is_gateway_error());
    }
}
