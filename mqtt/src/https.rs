//! TLS towards an HTTPS artifact origin (docs/decisions/0062-http-origins.md, 0064): the same
//! rustls with `ring` as the broker connection, so the agent links no second TLS stack.
//!
//! An origin's certificate must chain to the system's root certificates, or to the private CA
//! a device names ([`OriginTls::with_ca_file`], the agent's `[origins] ca_file`), which is
//! trusted beside the system's roots: locations change with every release
//! (`release locate`), so a device set up for a fleet's private object store must still reach a
//! public CDN a later release names.
//!
//! ```
//! use flotilla_mqtt::https::OriginTls;
//! let err = OriginTls::with_ca_file(std::path::Path::new("/nonexistent/ca.pem")).unwrap_err();
//! assert!(err.to_string().contains("/nonexistent/ca.pem"));
//! ```

use std::io;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use rumqttc::tokio_rustls::client::TlsStream;
use rumqttc::tokio_rustls::TlsConnector;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, RootCertStore};
use tokio::net::TcpStream;

/// Which certificates an HTTPS origin's must chain to. Cheap to clone.
#[derive(Clone, Default)]
pub struct OriginTls {
    /// `None`: the system's roots alone, loaded on the first HTTPS connection.
    with_ca: Option<Arc<ClientConfig>>,
}

impl std::fmt::Debug for OriginTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.with_ca {
            Some(_) => "OriginTls(system roots and a private CA)",
            None => "OriginTls(system roots)",
        })
    }
}

/// Why a CA file cannot be used; names the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {reason}")]
pub struct CaFileError {
    pub path: String,
    pub reason: String,
}

impl OriginTls {
    /// The system's roots and the CA certificate(s) of the PEM file at `path`. Fails, naming
    /// the file, when it cannot be read or holds no usable CA certificate.
    pub fn with_ca_file(path: &Path) -> Result<OriginTls, CaFileError> {
        let error = |reason: String| CaFileError {
            path: path.display().to_string(),
            reason,
        };
        let certs = crate::read_certs("ca_file", path).map_err(|e| error(e.reason))?;
        let mut roots = RootCertStore::empty();
        let (added, _) = roots.add_parsable_certificates(certs);
        if added == 0 {
            return Err(error("holds no usable CA certificate".to_owned()));
        }
        roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        let config = client_config(roots).map_err(error)?;
        Ok(OriginTls {
            with_ca: Some(config),
        })
    }

    /// Runs a TLS handshake with `host` over `tcp`, checking its certificate.
    pub async fn connect(&self, host: &str, tcp: TcpStream) -> io::Result<TlsStream<TcpStream>> {
        let config = match &self.with_ca {
            Some(config) => config.clone(),
            None => system_config().map_err(io::Error::other)?,
        };
        let name = ServerName::try_from(host.to_owned())
            .map_err(|e| io::Error::other(format!("{host:?} is not a host name: {e}")))?;
        TlsConnector::from(config).connect(name, tcp).await
    }
}

fn client_config(roots: RootCertStore) -> Result<Arc<ClientConfig>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("no usable TLS version: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

fn system_config() -> Result<Arc<ClientConfig>, String> {
    static CONFIG: OnceLock<Result<Arc<ClientConfig>, String>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let mut roots = RootCertStore::empty();
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            if roots.is_empty() {
                return Err(
                    "the system has no root certificates (name a CA in [origins] ca_file)"
                        .to_owned(),
                );
            }
            client_config(roots)
        })
        .clone()
}
