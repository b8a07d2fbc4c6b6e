//! IPv4 and IPv6 address blocks (`10.0.0.0/8`, `2001:db8::/32`), as deny
//! rules and trusted PROXY-protocol sources name them.
//!
//! Invariant: an address is inside a block when its first `prefix` bits
//! equal the block's; IPv4-mapped IPv6 addresses (`::ffff:10.1.2.3`) are
//! compared as the IPv4 address they carry, so a dual-stack socket's peers
//! match IPv4 rules.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// One address block. The host bits of `addr` are zero (checked at parse).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

/// Why a string is no CIDR block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    #[error("{0:?} is no IP address")]
    Address(String),
    #[error("prefix length {prefix:?} of {addr} is not a number in 0..={max}")]
    Prefix {
        addr: IpAddr,
        prefix: String,
        max: u8,
    },
    #[error("a block of IPv4-mapped addresses needs a prefix of at least 96")]
    Mapped,
    #[error("{0} has host bits set past its prefix (did you mean {1}?)")]
    HostBits(String, String),
}

impl Cidr {
    /// The block of `addr`'s first `prefix` bits; `None` if `prefix` is too long.
    pub fn new(addr: IpAddr, prefix: u8) -> Option<Self> {
        let addr = addr.to_canonical();
        (prefix <= max_prefix(addr)).then(|| Self {
            addr: masked(addr, prefix),
            prefix,
        })
    }

    /// Whether `ip` lies in this block.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        ip.is_ipv4() == self.addr.is_ipv4() && masked(ip, self.prefix) == self.addr
    }
}

fn max_prefix(addr: IpAddr) -> u8 {
    if addr.is_ipv4() { 32 } else { 128 }
}

/// `addr` with every bit past the first `prefix` cleared.
fn masked(addr: IpAddr, prefix: u8) -> IpAddr {
    match addr {
        IpAddr::V4(a) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::from((u32::from(a) & mask).to_be_bytes())
        }
        IpAddr::V6(a) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::from((u128::from(a) & mask).to_be_bytes())
        }
    }
}

impl FromStr for Cidr {
    type Err = CidrError;

    /// `ADDR/PREFIX`, or a bare address (a block of one). An IPv4-mapped
    /// block (`::ffff:10.0.0.0/104`) is the IPv4 block it maps (`/8`).
    fn from_str(s: &str) -> Result<Self, CidrError> {
        let (a, p) = s.split_once('/').map_or((s, None), |(a, p)| (a, Some(p)));
        let written: IpAddr = a.parse().map_err(|_| CidrError::Address(a.to_owned()))?;
        let max = max_prefix(written);
        let prefix = match p {
            None => max,
            Some(p) => {
                p.parse::<u8>()
                    .ok()
                    .filter(|n| *n <= max)
                    .ok_or_else(|| CidrError::Prefix {
                        addr: written,
                        prefix: p.to_owned(),
                        max,
                    })?
            }
        };
        let addr = written.to_canonical();
        let prefix = match (written, addr) {
            // Mapped: the first 96 bits are the mapping prefix.
            (IpAddr::V6(_), IpAddr::V4(_)) => prefix.checked_sub(96).ok_or(CidrError::Mapped)?,
            _ => prefix,
        };
        let block = Self {
            addr: masked(addr, prefix),
            prefix,
        };
        if block.addr != addr {
            return Err(CidrError::HostBits(s.to_owned(), block.to_string()));
        }
        Ok(block)
    }
}

impl TryFrom<String> for Cidr {
    type Error = CidrError;
    fn try_from(s: String) -> Result<Self, CidrError> {
        s.parse()
    }
}

impl From<Cidr> for String {
    fn from(c: Cidr) -> Self {
        c.to_string()
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_blocks_and_refuses_host_bits() {
        let c: Cidr = "10.0.0.0/8".parse().unwrap();
        assert!(c.contains("10.255.1.2".parse().unwrap()));
        assert!(!c.contains("11.0.0.1".parse().unwrap()));
        assert!(c.contains("::ffff:10.1.2.3".parse().unwrap()));
        assert!(
            !c.contains("::a00:1".parse().unwrap()),
            "IPv4-compatible is IPv6"
        );
        assert_eq!(
            "10.0.0.1/8".parse::<Cidr>(),
            Err(CidrError::HostBits(
                "10.0.0.1/8".into(),
                "10.0.0.0/8".into()
            ))
        );
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        let e = "10.0.0.0/-1"
            .parse::<Cidr>()
            .expect_err("negative")
            .to_string();
        assert_eq!(
            e,
            "prefix length \"-1\" of 10.0.0.0 is not a number in 0..=32"
        );
        assert!("2001:db8::/129".parse::<Cidr>().is_err());
        assert!("nope/8".parse::<Cidr>().is_err());
        let mapped: Cidr = "::ffff:10.0.0.0/104".parse().unwrap();
        assert_eq!(mapped.to_string(), "10.0.0.0/8");
        assert_eq!("::ffff:0.0.0.0/80".parse::<Cidr>(), Err(CidrError::Mapped));
        let one: Cidr = "2001:db8::1".parse().unwrap();
        assert_eq!(one.to_string(), "2001:db8::1/128");
        let all: Cidr = "::/0".parse().unwrap();
        assert!(all.contains("2001:db8::5".parse().unwrap()));
        assert!(!all.contains("1.2.3.4".parse().unwrap()));
    }

    /// Membership stated bit by bit: the first `prefix` bits agree.
    fn same_prefix(a: &[u8], b: &[u8], prefix: u8) -> bool {
        (0..usize::from(prefix))
            .all(|i| (a[i / 8] >> (7 - i % 8)) & 1 == (b[i / 8] >> (7 - i % 8)) & 1)
    }

    proptest! {
        #[test]
        fn v4_membership_is_the_first_prefix_bits(net: [u8; 4], ip: [u8; 4], prefix in 0u8..=32) {
            let block = Cidr::new(IpAddr::from(net), prefix).unwrap();
            prop_assert_eq!(block.contains(IpAddr::from(ip)), same_prefix(&net, &ip, prefix));
            prop_assert_eq!(block.to_string().parse::<Cidr>().unwrap(), block);
        }

        #[test]
        fn v6_membership_is_the_first_prefix_bits(net: [u8; 16], ip: [u8; 16], prefix in 0u8..=128) {
            let n = IpAddr::from(net);
            prop_assume!(n.to_canonical().is_ipv6());
            let block = Cidr::new(n, prefix).unwrap();
            let i = IpAddr::from(ip);
            prop_assume!(i.to_canonical().is_ipv6());
            prop_assert_eq!(block.contains(i), same_prefix(&net, &ip, prefix));
        }
    }
}
