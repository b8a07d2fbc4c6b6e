//! Ahead-of-time placement on the request path: a request this proxy would
//! hold for a service at zero that the control plane placed on another
//! node goes to that node's proxy instead, which holds it and activates
//! the service locally. One hop only: the forwarded request carries
//! [`FORWARDED_BY`] (a [`Marker`]: this proxy's node, the client address
//! it computed, the control plane's hop credential), and a request
//! carrying it is never forwarded again. No credential from the control
//! plane: nothing is forwarded.
//!
//! Fallback: when no connection to the chosen proxy can be had (it is
//! gone, or unreachable within the connect timeout), nothing was sent, the
//! body is untouched, and the request is held here as without placement:
//! this proxy asks for the instance itself, and passes that proxy over for
//! `placement::UNREACHABLE_FOR` (the next requests do not wait for a
//! connect timeout each) unless the service is placed elsewhere. A body already handed to a
//! pooled connection that turned out closed, with no new connection after
//! it, cannot be held again: that request is answered 502.
//!
//! The marker is removed from requests sent to endpoints
//! (`headers::build_request`): it is between proxies only.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::upstream::ResponseBody;
use http::header::HOST;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, Uri};
use http_body_util::BodyExt;

use crate::placement::{FORWARDED_BY, Marker, Target};
use crate::request::admit::{Gauge, Slot};
use crate::request::body::Completion;
use crate::request::respond::LocalReply;
use crate::snapshot::UpstreamCluster;
use crate::state::ProxyState;
use crate::upstream::{ConnectError, Lease, SendError, UpstreamBody};

/// How a forwarded request ended.
#[derive(Debug)]
pub enum Forwarded {
    /// The chosen proxy answered (whatever the status).
    Answered(Response<ResponseBody>, Lease),
    /// No connection: nothing was sent; hold the request here.
    Unreachable,
    /// Sent, then failed: the reply to give.
    Failed(LocalReply),
}

/// The client of a request forwarded by a peer proxy: it carries a
/// [`FORWARDED_BY`] marker with the control plane's hop credential and
/// comes from a peer proxy's address (as the control plane sent them).
/// Its client is the one the sending proxy computed (the source address
/// when the marker names none). `None` for any other request: its client
/// and forwarding headers are its own. A marker from a client that is no
/// peer is removed (a client cannot opt out of placement); one from a
/// peer's address that fails the check (a credential the control plane
/// has since replaced, or none) stays, so the request is never forwarded
/// again (one hop only, whatever the credentials say).
pub fn hop(
    state: &ProxyState,
    headers: &mut HeaderMap,
    source: std::net::SocketAddr,
) -> Option<IpAddr> {
    let value = headers.get(FORWARDED_BY)?;
    if let Some(marker) = Marker::parse(value)
        && state.placements.trusts(source.ip(), &marker)
    {
        return Some(marker.client.unwrap_or_else(|| source.ip()));
    }
    if !state.placements.is_peer(source.ip()) {
        headers.remove(FORWARDED_BY);
    }
    None
}

/// The proxy to forward to instead of holding for `cluster`'s service: a
/// placement on another node, and a request no proxy forwarded yet.
pub fn target(
    state: &ProxyState,
    cluster: &UpstreamCluster,
    headers: &HeaderMap,
    node: Option<&str>,
) -> Option<Target> {
    cluster.config.activation.as_ref()?;
    let service = cluster.config.service.as_deref()?;
    if headers.contains_key(FORWARDED_BY) {
        return None;
    }
    // Without the credential the peer would take the hop for an ordinary
    // request (and might forward it again).
    state.placements.hop_token()?;
    state
        .placements
        .target(service, node, state.peer_address.get().copied())
}

/// The request for the peer proxy: the downstream request's method, path
/// and (already forwarded) headers, its host kept, with `marker`.
fn build(
    parts: &http::request::Parts,
    mut headers: HeaderMap,
    marker: &HeaderValue,
    body: UpstreamBody,
) -> Request<UpstreamBody> {
    if !headers.contains_key(HOST)
        && let Some(host) = parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    {
        headers.insert(HOST, host);
    }
    headers.insert(FORWARDED_BY, marker.clone());
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| Uri::from_static("/"), |p| Uri::from(p.clone()));
    let mut req = Request::new(body);
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = path;
    *req.headers_mut() = headers;
    req
}

/// The marker of a request this proxy (on `node`) forwards for `client`
/// with the hop credential `token`: `None` when it may not forward (no
/// credential, e.g. cleared by a new stream since [`target`]; or a part
/// that cannot be in the marker).
fn marker_header(
    node: Option<&str>,
    token: Option<&str>,
    client: Option<IpAddr>,
) -> Option<HeaderValue> {
    let token = token.filter(|t| !t.is_empty())?;
    Marker {
        node: node.unwrap_or_default().to_owned(),
        client,
        token: token.to_owned(),
    }
    .to_header()
}

/// Sends the request to `target` and waits up to `limit` for its response
/// headers. `body` is taken only once a connection is there; nothing is
/// sent (`Unreachable`) without a marker ([`marker_header`]).
pub async fn forward(
    cluster: &UpstreamCluster,
    target: &Target,
    parts: &http::request::Parts,
    headers: HeaderMap,
    body: &mut Option<UpstreamBody>,
    limit: Duration,
    record: &mut Completion,
) -> Forwarded {
    let state = std::sync::Arc::clone(&record.state);
    let snapshot = state.snapshot.load();
    let token = state.placements.hop_token();
    let node = snapshot.config.node.name.as_deref();
    let Some(marker) = marker_header(node, token.as_deref(), record.client) else {
        // Nothing sent: hold the request here.
        tracing::warn!(peer = %target.address, "no marker to forward with (no hop credential, or a node name that cannot be in one); activating here");
        return Forwarded::Unreachable;
    };
    let started = Instant::now();
    // Counted by the chosen proxy, not in this proxy's load report.
    let counted = Slot::acquire(&cluster.counters, Gauge::Forwarded, u64::MAX);
    let exchange = target.pool.send_once_connected(|| {
        let b = body.take().unwrap_or_else(|| {
            http_body_util::Empty::new()
                .map_err(|never| match never {})
                .boxed()
        });
        build(parts, headers, &marker, b)
    });
    let sent = tokio::time::timeout(limit, exchange).await;
    let (result, outcome) = match sent {
        Ok(Ok((resp, lease))) => {
            record.forwarded = counted;
            record.attempts = 1;
            record.endpoint = std::sync::Arc::from(format!("peer:{}", target.address));
            let status = resp.status().as_u16().to_string();
            crate::request::activate::count(&state, "forwarded");
            span(&state, record, target, started, &status);
            return Forwarded::Answered(resp, lease);
        }
        // No connection and the body untouched: hold the request here.
        Ok(Err(SendError::Connect(ConnectError::Connect | ConnectError::Limit)))
            if body.is_some() =>
        {
            (Forwarded::Unreachable, "unreachable")
        }
        Ok(Err(_)) if record.fault.is_set() => (
            Forwarded::Failed(crate::request::attempt::Failure::ClientBody.reply()),
            "client_error",
        ),
        Ok(Err(_)) => (
            Forwarded::Failed(LocalReply::text(
                StatusCode::BAD_GATEWAY,
                "the chosen node's proxy failed\n",
                "peer_failed",
            )),
            "failed",
        ),
        // Still connecting when the time ran out: nothing sent.
        Err(_) if body.is_some() => (Forwarded::Unreachable, "unreachable"),
        Err(_) => (
            Forwarded::Failed(LocalReply::text(
                StatusCode::GATEWAY_TIMEOUT,
                "the chosen node's proxy did not answer in time\n",
                "peer_timeout",
            )),
            "timeout",
        ),
    };
    if matches!(result, Forwarded::Unreachable) {
        tracing::warn!(peer = %target.address, node = %target.node, "chosen node's proxy unreachable; activating here, and passing it over for {:?}", crate::placement::UNREACHABLE_FOR);
        state.placements.mark_unreachable(target.address);
        crate::request::activate::count(&state, "peer_unreachable");
    }
    span(&state, record, target, started, outcome);
    result
}

fn span(state: &ProxyState, record: &Completion, target: &Target, started: Instant, result: &str) {
    let address = target.address.to_string();
    let attributes = [
        ("meshless.peer.node", target.node.as_str()),
        ("meshless.peer.address", address.as_str()),
        ("meshless.result", result),
    ];
    record.trace.child(
        state,
        "activation.forwarded",
        started,
        Instant::now(),
        &attributes,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_marker_without_a_credential_or_with_a_node_that_cannot_be_in_one() {
        let ip = "192.0.2.1".parse().ok();
        let ok = marker_header(Some("n1"), Some("abc"), ip).expect("a marker");
        assert_eq!(ok, "n1;client=192.0.2.1;token=abc");
        assert!(marker_header(Some("n1"), None, ip).is_none(), "cleared");
        assert!(marker_header(Some("n1"), Some(""), ip).is_none(), "empty");
        for node in ["a;token=x", "a=b", "a b", "n\u{f6}de", "a\tb", " a"] {
            assert!(
                marker_header(Some(node), Some("abc"), ip).is_none(),
                "{node:?}"
            );
        }
        assert!(marker_header(Some("n1"), Some("a;b"), ip).is_none());
    }
}
