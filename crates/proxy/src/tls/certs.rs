//! Reading a certificate chain and its key from PEM files, refused at load
//! (with the file named) when unreadable, empty, expired, not yet valid, or
//! when the key does not match the certificate.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

use super::settings::CertificateFiles;

/// Why a certificate or key file was refused.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("{path}: cannot read: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("{path}: no PEM certificate in the file")]
    NoCertificate { path: PathBuf },
    #[error("{path}: no PEM private key in the file")]
    NoKey { path: PathBuf },
    #[error("{path}: unusable private key: {reason}")]
    Key { path: PathBuf, reason: String },
    #[error("{path}: not an X.509 certificate: {reason}")]
    Parse { path: PathBuf, reason: String },
    #[error("{path}: certificate expired (not after {not_after} s since the epoch)")]
    Expired { path: PathBuf, not_after: i64 },
    #[error("{path}: certificate not valid yet (not before {not_before} s since the epoch)")]
    NotYetValid { path: PathBuf, not_before: i64 },
    #[error("{key}: the key does not match the certificate {certificate}")]
    Mismatch { certificate: PathBuf, key: PathBuf },
}

fn read(path: &Path) -> Result<Vec<u8>, CertError> {
    std::fs::read(path).map_err(|e| CertError::Read {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

/// The chain in `files.certificate` with the key in `files.key`, checked
/// against `now`: the leaf must be valid at `now`, and the key must be the
/// leaf's.
pub fn load(
    files: &CertificateFiles,
    provider: &CryptoProvider,
    now: SystemTime,
) -> Result<Arc<CertifiedKey>, CertError> {
    let chain = read_chain(&files.certificate)?;
    check_validity(&files.certificate, &chain[0], now)?;
    let key = read_key(&files.key)?;
    let signing = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| CertError::Key {
            path: files.key.clone(),
            reason: e.to_string(),
        })?;
    let certified = CertifiedKey::new(chain, signing);
    certified.keys_match().map_err(|_| CertError::Mismatch {
        certificate: files.certificate.clone(),
        key: files.key.clone(),
    })?;
    Ok(Arc::new(certified))
}

fn read_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, CertError> {
    let pem = read(path)?;
    let chain = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CertError::Parse {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
    if chain.is_empty() {
        return Err(CertError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(chain)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, CertError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => CertError::NoKey {
            path: path.to_owned(),
        },
        e => CertError::Key {
            path: path.to_owned(),
            reason: e.to_string(),
        },
    })
}

/// Refuses a leaf that is expired or not yet valid at `now`.
fn check_validity(
    path: &Path,
    leaf: &CertificateDer<'_>,
    now: SystemTime,
) -> Result<(), CertError> {
    let (_, cert) =
        x509_parser::parse_x509_certificate(leaf.as_ref()).map_err(|e| CertError::Parse {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
    let now = match now.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(_) => 0,
    };
    let validity = cert.validity();
    let not_after = validity.not_after.timestamp();
    let not_before = validity.not_before.timestamp();
    if now > not_after {
        return Err(CertError::Expired {
            path: path.to_owned(),
            not_after,
        });
    }
    if now < not_before {
        return Err(CertError::NotYetValid {
            path: path.to_owned(),
            not_before,
        });
    }
    Ok(())
}
