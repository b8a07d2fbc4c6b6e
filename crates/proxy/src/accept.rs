//! What every accepted connection passes before its protocol is served,
//! in this order:
//!
//! 1. [`screen`]: the listener's deny rules on the peer address, at once
//!    after `accept`, before a byte is read (and before TLS: a TLS
//!    handshake belongs after this hook);
//! 2. [`client_address`]: the PROXY protocol v2 header, read from trusted
//!    peers, which names the client; the deny rules are checked again on
//!    that address.
//!
//! The client address that comes out feeds `X-Forwarded-For`, the access
//! log, `client_address`/`source_ip` hash keys and the deny rules.

use std::net::SocketAddr;

use crate::lazy_tcp::LazyTcpStream;

use crate::deny;
use crate::edge_metrics::{DenyLabels, ProxyProtocolLabels};
use crate::limits::ListenerSettings;
use crate::proxy_protocol::{self, Refused};
use crate::request::Downstream;

/// The deny-rule check on an accepted connection from `peer`: the stream
/// back if it may be served, else `None` (closed as its rule says, and
/// counted).
pub fn screen(
    downstream: &Downstream,
    settings: &ListenerSettings,
    stream: LazyTcpStream,
    peer: SocketAddr,
) -> Option<LazyTcpStream> {
    let Some(rule) = deny::matching(&settings.deny, peer.ip()) else {
        return Some(stream);
    };
    downstream
        .state
        .metrics
        .edge
        .denied
        .get_or_create(&DenyLabels {
            listener: downstream.name.to_string(),
            rule: rule.name.clone(),
            action: rule.action.name().to_owned(),
        })
        .inc();
    tracing::debug!(listener = %downstream.name, rule = %rule.name, %peer, "connection denied");
    deny::refuse(stream, rule.action);
    None
}

/// The client behind a connection accepted from `peer`: the source a
/// trusted PROXY header names, or `peer`. `None` when the connection was
/// refused (untrusted or missing header, malformed header, a deny rule on
/// the client address, or no header within `timeouts.request_headers`).
pub async fn client_address(
    downstream: &Downstream,
    settings: &ListenerSettings,
    stream: LazyTcpStream,
    peer: SocketAddr,
) -> Option<(LazyTcpStream, SocketAddr)> {
    let Some(accept) = &settings.proxy_protocol else {
        return Some((stream, peer));
    };
    if settings.tcp.is_some() && !accept.trusts(peer.ip()) {
        // A `tcp` listener may carry a protocol whose server speaks first
        // (SMTP, MySQL, IMAP): its clients send nothing until greeted, so
        // waiting for their first bytes would hold them until the timeout.
        // An untrusted peer is served as itself at once, as HAProxy's
        // `expect-proxy layer4 if <trusted>` does; what it sends, a header
        // included, reaches the endpoint as data.
        return Some((stream, peer));
    }
    // The header is waited for: the connection is registered at once.
    let mut stream = stream
        .into_tokio()
        .inspect_err(|e| tracing::debug!(listener = %downstream.name, %peer, error = %e, "connection not registered"))
        .ok()?;
    let read = proxy_protocol::accept(&mut stream, peer, accept);
    let reason = match tokio::time::timeout(settings.timeouts.request_headers, read).await {
        Ok(Ok(client)) => {
            let stream = screen(downstream, settings, stream.into(), client)?;
            return Some((stream, client));
        }
        Ok(Err(Refused::Untrusted)) => "untrusted",
        Ok(Err(Refused::Missing)) => "missing",
        Ok(Err(Refused::Header(_))) => "malformed",
        Ok(Err(Refused::Closed | Refused::Io(_))) => return None,
        Err(_) => "timeout",
    };
    downstream
        .state
        .metrics
        .edge
        .proxy_protocol_refused
        .get_or_create(&ProxyProtocolLabels {
            listener: downstream.name.to_string(),
            reason: reason.to_owned(),
        })
        .inc();
    tracing::debug!(listener = %downstream.name, %peer, reason, "PROXY protocol check refused the connection");
    None
}
