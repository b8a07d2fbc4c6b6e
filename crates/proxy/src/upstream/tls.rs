//! TLS to upstream endpoints: a rustls client (aws-lc-rs provider) built
//! from a cluster's `tls:` block, and the handshake with a reason an
//! operator can act on when it fails.

use std::io;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{CertificateError, ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::config::{UpstreamProtocol, UpstreamTls};

/// Why a TLS client could not be built from a `tls:` block.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    /// The CA file could not be read or holds no certificate.
    #[error("tls.ca_file {path}: {reason}")]
    CaFile { path: String, reason: String },
    /// rustls refused the settings.
    #[error("tls: {0}")]
    Rustls(#[from] rustls::Error),
    /// The server name is no DNS name or IP address.
    #[error("tls.server_name: not a DNS name or IP address: {0:?}")]
    ServerName(String),
}

/// Why a TLS handshake with an endpoint failed, as the reply names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsFault {
    /// The certificate is not signed by a CA of `ca_file`.
    UntrustedCertificate,
    /// The certificate is not valid for `server_name`.
    NameMismatch,
    /// The certificate has expired or is not yet valid.
    Expired,
    /// The endpoint did not agree to the offered ALPN protocol.
    Alpn,
    /// Any other handshake failure (protocol versions, a reset mid-handshake).
    Handshake,
}

impl TlsFault {
    /// The text of the local reply, one line.
    pub fn message(self) -> &'static str {
        match self {
            TlsFault::UntrustedCertificate => {
                "upstream TLS failed: certificate not signed by a trusted CA (tls.ca_file)\n"
            }
            TlsFault::NameMismatch => {
                "upstream TLS failed: certificate not valid for tls.server_name\n"
            }
            TlsFault::Expired => "upstream TLS failed: certificate expired or not yet valid\n",
            TlsFault::Alpn => "upstream TLS failed: endpoint refused the ALPN protocol\n",
            TlsFault::Handshake => "upstream TLS failed: handshake error\n",
        }
    }

    /// The fault behind a handshake's I/O error.
    fn of(err: &io::Error) -> Self {
        let Some(rustls) = err
            .get_ref()
            .and_then(|e| e.downcast_ref::<rustls::Error>())
        else {
            return TlsFault::Handshake;
        };
        match rustls {
            rustls::Error::InvalidCertificate(c) => match c {
                CertificateError::UnknownIssuer | CertificateError::BadSignature => {
                    TlsFault::UntrustedCertificate
                }
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => TlsFault::NameMismatch,
                CertificateError::Expired
                | CertificateError::ExpiredContext { .. }
                | CertificateError::NotValidYet
                | CertificateError::NotValidYetContext { .. } => TlsFault::Expired,
                _ => TlsFault::UntrustedCertificate,
            },
            rustls::Error::NoApplicationProtocol
            | rustls::Error::AlertReceived(rustls::AlertDescription::NoApplicationProtocol) => {
                TlsFault::Alpn
            }
            _ => TlsFault::Handshake,
        }
    }
}

/// A cluster's TLS client: the rustls config and the name it sends.
#[derive(Debug, Clone)]
pub struct TlsClient {
    config: Arc<ClientConfig>,
    server_name: ServerName<'static>,
    /// The ALPN id the endpoint must pick, when one is required.
    alpn: Option<&'static [u8]>,
}

impl TlsClient {
    /// Builds from a `tls:` block and the contents of its `ca_file`
    /// (`ca`, as [`read_ca`] read them): TLS 1.2 and 1.3, the CA file's
    /// roots only.
    pub fn new(
        tls: &UpstreamTls,
        ca: &[u8],
        protocol: UpstreamProtocol,
    ) -> Result<Self, TlsConfigError> {
        let roots = load_roots(tls, ca)?;
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let id: &'static [u8] = match protocol {
            UpstreamProtocol::Http1 => b"http/1.1",
            UpstreamProtocol::Http2 => b"h2",
        };
        // Offered when asked, and by default for HTTP/2; required only
        // when asked.
        let offered = tls.alpn.unwrap_or(protocol == UpstreamProtocol::Http2);
        if offered {
            config.alpn_protocols = vec![id.to_vec()];
        }
        let alpn = (tls.alpn == Some(true)).then_some(id);
        let server_name = ServerName::try_from(tls.server_name.clone())
            .map_err(|_| TlsConfigError::ServerName(tls.server_name.clone()))?;
        Ok(Self {
            config: Arc::new(config),
            server_name,
            alpn,
        })
    }

    /// The handshake over a connected socket.
    pub async fn handshake(&self, tcp: TcpStream) -> Result<TlsStream<TcpStream>, TlsFault> {
        let tls = TlsConnector::from(Arc::clone(&self.config))
            .connect(self.server_name.clone(), tcp)
            .await
            .map_err(|e| TlsFault::of(&e))?;
        if let Some(want) = self.alpn
            && tls.get_ref().1.alpn_protocol() != Some(want)
        {
            return Err(TlsFault::Alpn);
        }
        Ok(tls)
    }
}

/// The contents of `tls.ca_file`, read now (a reload reads it again: a
/// CA replaced at the same path is a new one).
pub fn read_ca(tls: &UpstreamTls) -> Result<Arc<[u8]>, TlsConfigError> {
    std::fs::read(&tls.ca_file)
        .map(Arc::from)
        .map_err(|e| TlsConfigError::CaFile {
            path: tls.ca_file.display().to_string(),
            reason: e.to_string(),
        })
}

/// The certificates of `ca` (the contents of `tls.ca_file`) as a root store.
fn load_roots(tls: &UpstreamTls, ca: &[u8]) -> Result<RootCertStore, TlsConfigError> {
    let fail = |reason: String| TlsConfigError::CaFile {
        path: tls.ca_file.display().to_string(),
        reason,
    };
    let certs = CertificateDer::pem_slice_iter(ca)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| fail(e.to_string()))?;
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(fail("no usable certificate in the file".into()));
    }
    Ok(roots)
}
