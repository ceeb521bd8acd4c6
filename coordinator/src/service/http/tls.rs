//! The HTTPS server's certificate chain and key (`[http.tls]`), PEM files, with rustls and the
//! ring provider only, as for the broker connection.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

use crate::service::config_http::HttpTls;

/// Why the certificate or key could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("http.tls.cert_file {path}: {reason}")]
    Cert { path: PathBuf, reason: String },
    #[error("http.tls.key_file {path}: {reason}")]
    Key { path: PathBuf, reason: String },
    #[error("http.tls: the certificate and key do not make a TLS server: {0}")]
    Config(String),
}

/// Loads the files and makes the acceptor.
pub fn acceptor(tls: &HttpTls) -> Result<TlsAcceptor, TlsError> {
    let certs = certs(&tls.cert_file)?;
    let key = PrivateKeyDer::from_pem_file(&tls.key_file).map_err(|e| TlsError::Key {
        path: tls.key_file.clone(),
        reason: e.to_string(),
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let cert_err = |reason: String| TlsError::Cert {
        path: path.to_owned(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| cert_err(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| cert_err(e.to_string()))?;
    if certs.is_empty() {
        return Err(cert_err("holds no certificate".into()));
    }
    Ok(certs)
}
