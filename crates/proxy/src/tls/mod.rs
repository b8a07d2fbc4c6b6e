//! TLS termination on a listener (rustls, aws-lc-rs provider only): the
//! certificate chosen by SNI name with a default ([`resolver`]), ALPN `h2`
//! and `http/1.1`, TLS 1.2 and 1.3 only, session resumption by tickets and
//! a server-side cache. Certificates are read and checked when a config is
//! loaded or reloaded ([`certs`]); a reload swaps the certificate table and
//! keeps the session cache and ticket keys, so resumption survives it.

pub mod certs;
pub mod counted;
pub mod resolver;
pub mod settings;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::server::{ProducesTickets, ServerSessionMemoryCache, StoresServerSessions};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;

pub use counted::Counted;

pub use certs::CertError;
pub use resolver::{CertTable, SniResolver};
pub use settings::{Alpn, CertificateFiles, SniCertificate, TlsSettings, TlsVersion};

/// The one crypto provider of the build.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// Why TLS settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(transparent)]
    Certificate(#[from] CertError),
    #[error("TLS setup: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Reads and checks every certificate `settings` names, at time `now`.
pub fn load_table(settings: &TlsSettings, now: SystemTime) -> Result<CertTable, CertError> {
    let provider = provider();
    let default = certs::load(&settings.default_certificate, &provider, now)?;
    let mut table = CertTable::new(default);
    for c in &settings.certificates {
        let key = certs::load(&c.files(), &provider, now)?;
        for name in &c.server_names {
            table.insert(name, Arc::clone(&key));
        }
    }
    Ok(table)
}

/// What a listener's TLS keeps across reloads: the resolver (whose table
/// a reload swaps), the session cache and the ticket keys.
#[derive(Debug, Clone)]
struct Keep {
    resolver: Arc<SniResolver>,
    cache: Arc<dyn StoresServerSessions>,
    ticketer: Arc<dyn ProducesTickets>,
}

/// The TLS side of a running listener: one server config, replaced (with
/// its kept parts) on reload.
#[derive(Debug)]
pub struct ListenerTls {
    config: Arc<ServerConfig>,
    /// How long a handshake may take after the accept.
    pub handshake_timeout: Duration,
    keep: Keep,
    /// The certificates of a reload, for the kept resolver: stored by
    /// [`ListenerTls::install`] once the whole reload is accepted.
    staged: Option<CertTable>,
}

impl ListenerTls {
    /// A fresh TLS side serving `table` with `settings`.
    pub fn new(settings: &TlsSettings, table: CertTable) -> Result<Self, TlsError> {
        let keep = Keep {
            resolver: Arc::new(SniResolver::new(table)),
            cache: ServerSessionMemoryCache::new(settings.session_resumption.cache_size.max(1)),
            ticketer: rustls::crypto::aws_lc_rs::Ticketer::new()?,
        };
        Self::with(settings, keep)
    }

    /// The TLS side after a reload to `settings` and `table`; sessions and
    /// ticket keys stay. Nothing changes for the running listener (whose
    /// resolver it shares) until [`ListenerTls::install`]: a reload
    /// rejected later leaves the running certificates in place.
    pub fn reloaded(&self, settings: &TlsSettings, table: CertTable) -> Result<Self, TlsError> {
        let keep = self.keep.clone();
        let mut next = Self::with(settings, keep)?;
        next.staged = Some(table);
        Ok(next)
    }

    /// Makes the certificates of [`ListenerTls::reloaded`] the ones new
    /// handshakes see (on the resolver shared with the running side).
    pub fn install(mut self) -> Self {
        if let Some(table) = self.staged.take() {
            self.keep.resolver.store(table);
        }
        self
    }

    fn with(settings: &TlsSettings, keep: Keep) -> Result<Self, TlsError> {
        let versions: &[&rustls::SupportedProtocolVersion] = match settings.min_version {
            TlsVersion::Tls12 => &[&rustls::version::TLS13, &rustls::version::TLS12],
            TlsVersion::Tls13 => &[&rustls::version::TLS13],
        };
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(versions)?
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(&keep.resolver) as _);
        config.alpn_protocols = settings.alpn.iter().map(|a| a.id().to_vec()).collect();
        let resumption = &settings.session_resumption;
        if resumption.cache_size > 0 {
            config.session_storage = Arc::clone(&keep.cache);
        } else {
            config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        }
        if resumption.tickets {
            config.ticketer = Arc::clone(&keep.ticketer);
        } else {
            config.send_tls13_tickets = 0;
        }
        Ok(Self {
            config: Arc::new(config),
            handshake_timeout: settings.handshake_timeout,
            keep,
            staged: None,
        })
    }

    /// Runs the server side of a handshake on `stream`, up to
    /// `handshake_timeout`.
    pub async fn handshake(&self, stream: TcpStream) -> Handshake {
        let accept =
            tokio_rustls::TlsAcceptor::from(Arc::clone(&self.config)).accept(Counted::new(stream));
        match tokio::time::timeout(self.handshake_timeout, accept).await {
            Ok(Ok(tls)) => Handshake::Done(Box::new(tls)),
            Ok(Err(e)) => Handshake::Failed(e),
            Err(_) => Handshake::TimedOut,
        }
    }
}

/// How a handshake ended.
#[derive(Debug)]
pub enum Handshake {
    Done(Box<TlsStream<Counted>>),
    Failed(std::io::Error),
    TimedOut,
}

impl Handshake {
    /// Its label in `meshless_proxy_tls_handshakes_total`: `full`,
    /// `resumed`, `failed` or `timeout`.
    pub fn result(&self) -> &'static str {
        match self {
            Self::Done(tls) => match tls.get_ref().1.handshake_kind() {
                Some(rustls::HandshakeKind::Resumed) => "resumed",
                _ => "full",
            },
            Self::Failed(_) => "failed",
            Self::TimedOut => "timeout",
        }
    }
}

/// Whether the client chose HTTP/2 by ALPN (else HTTP/1.1: without ALPN,
/// HTTP/2 over TLS is not negotiated, RFC 9113 3.2).
pub fn negotiated_h2(tls: &TlsStream<Counted>) -> bool {
    tls.get_ref().1.alpn_protocol() == Some(b"h2")
}
