//! TLS towards an HTTPS artifact origin (docs/decisions/0062-http-origins.md): the same rustls
//! with `ring` as the broker connection, checked against the system's root certificates, so
//! the agent links no second TLS stack.

use std::io;
use std::sync::{Arc, OnceLock};

use rumqttc::tokio_rustls::client::TlsStream;
use rumqttc::tokio_rustls::TlsConnector;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, RootCertStore};
use tokio::net::TcpStream;

fn config() -> Result<Arc<ClientConfig>, String> {
    static CONFIG: OnceLock<Result<Arc<ClientConfig>, String>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let mut roots = RootCertStore::empty();
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            if roots.is_empty() {
                return Err("the system has no root certificates".to_owned());
            }
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| format!("no usable TLS version: {e}"))?
                .with_root_certificates(roots)
                .with_no_client_auth();
            Ok(Arc::new(config))
        })
        .clone()
}

/// Runs a TLS handshake with `host` over `tcp`, checking its certificate against the system's
/// roots.
pub async fn connect(host: &str, tcp: TcpStream) -> io::Result<TlsStream<TcpStream>> {
    let config = config().map_err(io::Error::other)?;
    let name = ServerName::try_from(host.to_owned())
        .map_err(|e| io::Error::other(format!("{host:?} is not a host name: {e}")))?;
    TlsConnector::from(config).connect(name, tcp).await
}
