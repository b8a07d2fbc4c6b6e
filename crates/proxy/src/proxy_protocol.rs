//! The PROXY protocol, version 2 (HAProxy's `proxy-protocol.txt`, section
//! 2.2): the binary header an L4 proxy sends before the stream so the next
//! hop learns the client's address. Sent by clusters with
//! `proxy_protocol: v2`; accepted on listeners with a `proxy_protocol`
//! block from `trusted` sources only.
//!
//! Header: the 12-byte signature, `0x2X` (version 2, command LOCAL=0 or
//! PROXY=1), the family and transport byte (`0x11` TCP/IPv4, `0x21`
//! TCP/IPv6; `0x00` UNSPEC), a big-endian length of what follows, then
//! the addresses (IPv4: 4+4+2+2 bytes, IPv6: 16+16+2+2, Unix: 108+108) and
//! TLVs (type, 2-byte length, value), which are checked for framing and
//! ignored. The parser is strict: any other version, command, family or
//! transport, a length too short for the addresses, or TLVs that overrun
//! the length is an error.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::cidr::Cidr;

/// The 12 bytes every v2 header starts with.
pub const SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// Signature, version/command, family/transport and length.
const FIXED: usize = 16;

/// `listeners[].proxy_protocol:` PROXY protocol v2 accepted from these
/// sources (Envoy's `proxy_protocol` listener filter; HAProxy's
/// `accept-proxy` with a `tcp-request connection expect-proxy` ACL).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyProtocolAccept {
    /// Peers allowed to send a header; a header from anyone else closes
    /// the connection.
    pub trusted: Vec<Cidr>,
    /// A trusted peer must send a header (else the connection is closed);
    /// false lets trusted peers connect without one too.
    #[serde(default = "default_required")]
    pub required: bool,
}

fn default_required() -> bool {
    true
}

impl ProxyProtocolAccept {
    /// Whether `peer` may send a header.
    pub fn trusts(&self, peer: std::net::IpAddr) -> bool {
        self.trusted.iter().any(|c| c.contains(peer))
    }
}

/// `clusters[].proxy_protocol:` the header sent to endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProxyProtocolVersion {
    /// The binary version 2 header.
    V2,
}

/// A parsed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// `PROXY` over TCP: the original client and the address it connected to.
    Proxy {
        source: SocketAddr,
        destination: SocketAddr,
    },
    /// `LOCAL` (the sender's own connection, e.g. a health check), or
    /// `PROXY` with an address family other than IP: use the real peer.
    Local,
}

/// Why a header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("not a PROXY protocol v2 signature")]
    Signature,
    #[error("version {0} (only 2)")]
    Version(u8),
    #[error("command {0} (only LOCAL and PROXY)")]
    Command(u8),
    #[error("family/transport byte {0:#04x} is none the protocol defines")]
    Family(u8),
    #[error("length {length} is too short for the addresses ({need} bytes)")]
    Short { length: usize, need: usize },
    #[error("a TLV overruns the header")]
    Tlv,
}

/// What the first bytes of a connection say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The signature: a header follows.
    Header,
    /// Anything else.
    Other,
    /// A part of the signature, so far.
    Undecided,
}

/// Tells a header from other traffic by the first bytes `head`.
pub fn start(head: &[u8]) -> Start {
    let n = head.len().min(SIGNATURE.len());
    if head[..n] != SIGNATURE[..n] {
        Start::Other
    } else if n == SIGNATURE.len() {
        Start::Header
    } else {
        Start::Undecided
    }
}

/// The `LOCAL` header: a connection the proxy opened on its own behalf (a
/// health check), whose receiver keeps the connection's own addresses.
pub fn encode_local() -> Vec<u8> {
    let mut out = Vec::with_capacity(FIXED);
    out.extend_from_slice(&SIGNATURE);
    out.extend_from_slice(&[0x20, 0x00, 0, 0]);
    out
}

/// The header announcing a TCP stream from `source` to `destination`.
/// Mixed families are sent as IPv6 (IPv4 as IPv4-mapped), as HAProxy does.
pub fn encode(source: SocketAddr, destination: SocketAddr) -> Vec<u8> {
    let mut out = Vec::with_capacity(FIXED + 36);
    out.extend_from_slice(&SIGNATURE);
    out.push(0x21);
    match (source.ip(), destination.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            out.extend_from_slice(&[0x11, 0, 12]);
            out.extend_from_slice(&s.octets());
            out.extend_from_slice(&d.octets());
        }
        (s, d) => {
            out.extend_from_slice(&[0x21, 0, 36]);
            out.extend_from_slice(&v6(s).octets());
            out.extend_from_slice(&v6(d).octets());
        }
    }
    out.extend_from_slice(&source.port().to_be_bytes());
    out.extend_from_slice(&destination.port().to_be_bytes());
    out
}

fn v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped(),
        IpAddr::V6(a) => a,
    }
}

/// The total size of the header that starts `fixed` (its first 16 bytes),
/// after checking signature, version, command and family.
pub fn header_len(fixed: &[u8; FIXED]) -> Result<usize, HeaderError> {
    if fixed[..12] != SIGNATURE {
        return Err(HeaderError::Signature);
    }
    let (version, command) = (fixed[12] >> 4, fixed[12] & 0x0f);
    if version != 2 {
        return Err(HeaderError::Version(version));
    }
    if command > 1 {
        return Err(HeaderError::Command(command));
    }
    let length = usize::from(u16::from_be_bytes([fixed[14], fixed[15]]));
    let need = address_len(fixed[13])?;
    if command == 1 && length < need {
        return Err(HeaderError::Short { length, need });
    }
    Ok(FIXED + length)
}

/// Bytes of addresses for a family/transport byte.
fn address_len(family: u8) -> Result<usize, HeaderError> {
    match family {
        0x00 => Ok(0),
        0x11 | 0x12 => Ok(12),
        0x21 | 0x22 => Ok(36),
        0x31 | 0x32 => Ok(216),
        other => Err(HeaderError::Family(other)),
    }
}

/// Parses a whole header (`buf.len()` as [`header_len`] said).
pub fn decode(buf: &[u8]) -> Result<Header, HeaderError> {
    let fixed: &[u8; FIXED] = buf
        .get(..FIXED)
        .and_then(|b| b.try_into().ok())
        .ok_or(HeaderError::Signature)?;
    let total = header_len(fixed)?;
    let need = address_len(fixed[13])?;
    let body = buf.get(FIXED..total).ok_or(HeaderError::Short {
        length: buf.len().saturating_sub(FIXED),
        need,
    })?;
    // A LOCAL header may carry no addresses at all.
    let (addresses, mut tlvs) = body.split_at(need.min(body.len()));
    while !tlvs.is_empty() {
        let [_, hi, lo, rest @ ..] = tlvs else {
            return Err(HeaderError::Tlv);
        };
        let n = usize::from(u16::from_be_bytes([*hi, *lo]));
        tlvs = rest.get(n..).ok_or(HeaderError::Tlv)?;
    }
    let proxy = fixed[12] & 0x0f == 1;
    let port = |at: usize| u16::from_be_bytes([addresses[at], addresses[at + 1]]);
    let octets4 = |at: usize| -> [u8; 4] { std::array::from_fn(|i| addresses[at + i]) };
    let octets16 = |at: usize| -> [u8; 16] { std::array::from_fn(|i| addresses[at + i]) };
    Ok(match fixed[13] {
        0x11 if proxy => Header::Proxy {
            source: SocketAddr::new(octets4(0).into(), port(8)),
            destination: SocketAddr::new(octets4(4).into(), port(10)),
        },
        0x21 if proxy => Header::Proxy {
            source: SocketAddr::new(IpAddr::from(octets16(0)).to_canonical(), port(32)),
            destination: SocketAddr::new(IpAddr::from(octets16(16)).to_canonical(), port(34)),
        },
        _ => Header::Local,
    })
}

/// How long to wait before peeking again at a part of the signature: the
/// first wait, doubled after each peek that found nothing new, up to
/// [`PEEK_AGAIN_MAX`]. A peer that stalls (or half-closes: a peek cannot
/// see the end of stream behind bytes not yet read) inside the signature
/// costs a few wake-ups a second until `timeouts.request_headers`, not
/// two hundred.
const PEEK_AGAIN: Duration = Duration::from_millis(5);
const PEEK_AGAIN_MAX: Duration = Duration::from_millis(320);

/// Why an accepted connection was closed before it was served.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("PROXY header from an untrusted peer")]
    Untrusted,
    #[error("no PROXY header from a trusted peer")]
    Missing,
    #[error("closed before a PROXY header")]
    Closed,
    #[error(transparent)]
    Header(#[from] HeaderError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Reads the PROXY header, if any, from a connection accepted from
/// `peer`, and returns the client's address: the header's source, or
/// `peer` when there is none (or it is LOCAL). Bytes after the header stay
/// unread.
pub async fn accept(
    stream: &mut TcpStream,
    peer: SocketAddr,
    settings: &ProxyProtocolAccept,
) -> Result<SocketAddr, Refused> {
    let trusted = settings.trusts(peer.ip());
    let mut head = [0u8; SIGNATURE.len()];
    let (mut wait, mut had) = (PEEK_AGAIN, 0);
    let seen = loop {
        let n = stream.peek(&mut head).await?;
        if n == 0 {
            return Err(Refused::Closed);
        }
        match start(&head[..n]) {
            Start::Undecided => {
                if n > had {
                    (wait, had) = (PEEK_AGAIN, n);
                }
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(PEEK_AGAIN_MAX);
            }
            decided => break decided,
        }
    };
    match (seen, trusted) {
        (Start::Header, false) => Err(Refused::Untrusted),
        (Start::Header, true) => {
            let mut fixed = [0u8; FIXED];
            stream.read_exact(&mut fixed).await?;
            let total = header_len(&fixed)?;
            let mut buf = vec![0u8; total];
            buf[..FIXED].copy_from_slice(&fixed);
            stream.read_exact(&mut buf[FIXED..]).await?;
            Ok(match decode(&buf)? {
                Header::Proxy { source, .. } => source,
                Header::Local => peer,
            })
        }
        (_, true) if settings.required => Err(Refused::Missing),
        _ => Ok(peer),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    /// The spec's IPv4 example, written out byte by byte.
    #[test]
    fn encodes_the_layout_of_the_spec() {
        let src: SocketAddr = "192.0.2.1:56324".parse().unwrap();
        let dst: SocketAddr = "198.51.100.2:443".parse().unwrap();
        let mut want = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
        want.extend_from_slice(&[0x21, 0x11, 0x00, 0x0c, 192, 0, 2, 1, 198, 51, 100, 2]);
        want.extend_from_slice(&[0xdc, 0x04, 0x01, 0xbb]);
        assert_eq!(encode(src, dst), want);
        assert_eq!(
            decode(&want),
            Ok(Header::Proxy {
                source: src,
                destination: dst
            })
        );
    }

    #[test]
    fn the_local_header_decodes_as_local() {
        let h = encode_local();
        assert_eq!(h.len(), FIXED);
        assert_eq!(header_len(h[..FIXED].try_into().unwrap()), Ok(FIXED));
        assert_eq!(decode(&h), Ok(Header::Local));
    }

    #[test]
    fn refuses_what_the_spec_does_not_define() {
        let h = encode("10.0.0.1:1".parse().unwrap(), "10.0.0.2:2".parse().unwrap());
        let with = |at: usize, b: u8| {
            let mut h = h.clone();
            h[at] = b;
            decode(&h)
        };
        assert_eq!(with(0, b'X'), Err(HeaderError::Signature));
        assert_eq!(with(12, 0x11), Err(HeaderError::Version(1)));
        assert_eq!(with(12, 0x22), Err(HeaderError::Command(2)));
        assert_eq!(with(13, 0x41), Err(HeaderError::Family(0x41)));
        assert_eq!(
            with(15, 11),
            Err(HeaderError::Short {
                length: 11,
                need: 12
            })
        );
        // A TLV whose length overruns the header.
        let mut t = h.clone();
        t[15] = 15;
        t.extend_from_slice(&[0x04, 0x00, 0x05]);
        assert_eq!(decode(&t), Err(HeaderError::Tlv));
        // A LOCAL header with nothing after it.
        let mut local = SIGNATURE.to_vec();
        local.extend_from_slice(&[0x20, 0x00, 0, 0]);
        assert_eq!(decode(&local), Ok(Header::Local));
        assert_eq!(start(b"GET / HTTP/1.1\r\n"), Start::Other);
        assert_eq!(start(b"\r\n\r\n"), Start::Undecided);
        assert_eq!(start(&h), Start::Header);
    }

    fn addr() -> impl Strategy<Value = SocketAddr> {
        prop_oneof![
            (any::<[u8; 4]>(), any::<u16>()).prop_map(|(ip, p)| SocketAddr::new(ip.into(), p)),
            (any::<[u8; 16]>(), any::<u16>())
                .prop_map(|(ip, p)| { SocketAddr::new(IpAddr::from(ip).to_canonical(), p) }),
        ]
    }

    proptest! {
        /// Encoding then decoding gives the addresses back (IPv4 inside a
        /// mixed pair comes back as IPv4), with TLVs appended or not.
        #[test]
        fn round_trips(src in addr(), dst in addr(), tlv in proptest::collection::vec(any::<u8>(), 0..40)) {
            let mut h = encode(src, dst);
            let len = u16::from_be_bytes([h[14], h[15]]) as usize + 3 + tlv.len();
            h[14..16].copy_from_slice(&(len as u16).to_be_bytes());
            h.extend_from_slice(&[0xEE, 0, tlv.len() as u8]);
            h.extend_from_slice(&tlv);
            let fixed: [u8; FIXED] = h[..FIXED].try_into().unwrap();
            prop_assert_eq!(header_len(&fixed), Ok(h.len()));
            prop_assert_eq!(decode(&h), Ok(Header::Proxy { source: src, destination: dst }));
        }

        /// Arbitrary bytes never panic, and whatever is accepted is a
        /// header whose signature and version are right.
        #[test]
        fn garbage_is_refused_without_panicking(tail in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut h = SIGNATURE.to_vec();
            h.extend_from_slice(&tail);
            if decode(&h).is_ok() {
                prop_assert_eq!(h[12] >> 4, 2);
                prop_assert!(h[12] & 0x0f <= 1);
            }
            let _ = decode(&tail);
        }
    }
}
