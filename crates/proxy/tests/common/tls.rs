//! TLS for tests: certificates made with rcgen into a temporary directory,
//! and a rustls client that records which certificate the server sent.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// A fresh directory under the system's temporary one, removed on drop.
#[derive(Debug)]
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "meshless-{tag}-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&p).expect("temp dir");
        Self(p)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A self-signed certificate for `names`, written as `<stem>.pem` and
/// `<stem>.key` into `dir`; returns its DER (what a client must receive).
pub fn write_cert(dir: &Path, stem: &str, names: &[&str]) -> Vec<u8> {
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let ck = rcgen::generate_simple_self_signed(names).expect("certificate");
    write_files(dir, stem, &ck.cert.pem(), &ck.signing_key.serialize_pem());
    ck.cert.der().to_vec()
}

/// A certificate for `names` that expired in 2000.
pub fn write_expired_cert(dir: &Path, stem: &str, names: &[&str]) {
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let key = rcgen::KeyPair::generate().expect("key");
    let mut params = rcgen::CertificateParams::new(names).expect("params");
    params.not_before = rcgen::date_time_ymd(1999, 1, 1);
    params.not_after = rcgen::date_time_ymd(2000, 1, 1);
    let cert = params.self_signed(&key).expect("certificate");
    write_files(dir, stem, &cert.pem(), &key.serialize_pem());
}

/// Writes both files, each replaced in one rename (as a deploy tool does).
pub fn write_files(dir: &Path, stem: &str, cert_pem: &str, key_pem: &str) {
    for (ext, text) in [("pem", cert_pem), ("key", key_pem)] {
        let tmp = dir.join(format!(".{stem}.{ext}.tmp"));
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, dir.join(format!("{stem}.{ext}"))).expect("rename");
    }
}

/// Accepts any certificate: the tests compare the certificate received
/// with the one expected, byte for byte, which is stricter.
#[derive(Debug)]
struct AcceptAny(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AcceptAny {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A client config offering `alpn`, limited to `versions`.
pub fn client_config(
    alpn: &[&str],
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Arc<ClientConfig> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut c = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(versions)
        .expect("versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAny(provider)))
        .with_no_client_auth();
    c.alpn_protocols = alpn.iter().map(|a| a.as_bytes().to_vec()).collect();
    Arc::new(c)
}

/// The default client: h2 and http/1.1, TLS 1.2 and 1.3.
pub fn default_client() -> Arc<ClientConfig> {
    client_config(&["h2", "http/1.1"], rustls::ALL_VERSIONS)
}

/// Connects to `addr` sending SNI `sni` (an IP sends none).
pub async fn connect(
    config: &Arc<ClientConfig>,
    addr: SocketAddr,
    sni: &str,
) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from(sni.to_owned()).map_err(std::io::Error::other)?;
    tokio_rustls::TlsConnector::from(Arc::clone(config))
        .connect(name, tcp)
        .await
}

/// The leaf certificate the server sent.
pub fn leaf(tls: &TlsStream<TcpStream>) -> Vec<u8> {
    tls.get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.as_ref().to_vec())
        .unwrap_or_default()
}

/// The ALPN protocol agreed.
pub fn alpn(tls: &TlsStream<TcpStream>) -> Option<String> {
    tls.get_ref()
        .1
        .alpn_protocol()
        .map(|p| String::from_utf8_lossy(p).into_owned())
}

/// A request sender over one TLS connection, HTTP/2 when ALPN chose it.
pub enum Sender {
    H1(hyper::client::conn::http1::SendRequest<Empty<Bytes>>),
    H2(hyper::client::conn::http2::SendRequest<Empty<Bytes>>),
}

impl Sender {
    /// Starts HTTP on `tls`, with the protocol ALPN chose.
    pub async fn new(tls: TlsStream<TcpStream>) -> hyper::Result<Self> {
        let h2 = alpn(&tls).as_deref() == Some("h2");
        let io = TokioIo::new(tls);
        if h2 {
            let (s, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
            tokio::spawn(conn);
            Ok(Self::H2(s))
        } else {
            let (s, conn) = hyper::client::conn::http1::handshake(io).await?;
            tokio::spawn(conn);
            Ok(Self::H1(s))
        }
    }

    /// Whether the connection can take a request (false once the server
    /// closed it, e.g. after a `connection: close` response or a GOAWAY).
    pub async fn ready(&mut self) -> bool {
        match self {
            Self::H1(s) => s.ready().await.is_ok(),
            Self::H2(s) => s.ready().await.is_ok(),
        }
    }

    /// GET `path` for `host`: status and the `x-backend` header, body read.
    pub async fn get(&mut self, host: &str, path: &str) -> Result<(StatusCode, String), String> {
        let resp = match self {
            Self::H1(s) => {
                let req = Request::get(path)
                    .header(http::header::HOST, host)
                    .body(Empty::<Bytes>::new())
                    .map_err(|e| e.to_string())?;
                s.ready().await.map_err(|e| e.to_string())?;
                s.send_request(req).await
            }
            Self::H2(s) => {
                let req = Request::get(format!("https://{host}{path}"))
                    .body(Empty::<Bytes>::new())
                    .map_err(|e| e.to_string())?;
                s.ready().await.map_err(|e| e.to_string())?;
                s.send_request(req).await
            }
        }
        .map_err(|e| e.to_string())?;
        let status = resp.status();
        let backend = resp
            .headers()
            .get("x-backend")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        resp.into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?;
        Ok((status, backend))
    }
}
