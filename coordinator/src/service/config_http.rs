//! The `[http]` section: the coordinator's HTTP server, for the HTTP API (`/api/...`) and
//! `/metrics` (decision 0055). Off unless `listen` is set; `flotilla demo` turns it on.
//!
//! ```toml
//! [http]
//! listen = "127.0.0.1:8080"
//! [http.tls]                 # HTTPS; without it only a loopback address is accepted
//! cert_file = "tls/coordinator.crt"
//! key_file = "tls/coordinator.key"
//! ```
//!
//! Plain HTTP beyond loopback is refused: the API carries operators' signed requests, and a
//! browser session would carry a cookie. `insecure_plain_http = true` allows it anyway (behind a
//! proxy that terminates TLS on the same host), and the coordinator warns when it starts.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Where and how the HTTP server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpConfig {
    pub listen: SocketAddr,
    /// HTTPS with this certificate chain and key (PEM); `None` serves plain HTTP.
    pub tls: Option<HttpTls>,
}

/// The server's certificate chain and private key, PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpTls {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawHttp {
    listen: Option<String>,
    tls: Option<RawHttpTls>,
    insecure_plain_http: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHttpTls {
    cert_file: String,
    key_file: String,
}

/// A setting of `[http]` that is wrong: the field, its value, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpFieldError {
    pub field: &'static str,
    pub value: String,
    pub reason: String,
}

impl RawHttp {
    /// Checks the section; paths are relative to the config file's directory (`base`).
    pub(crate) fn validate(self, base: &Path) -> Result<Option<HttpConfig>, HttpFieldError> {
        let Some(listen) = self.listen else {
            if self.tls.is_some() {
                return Err(HttpFieldError {
                    field: "http.tls",
                    value: "(set)".into(),
                    reason: "needs http.listen, the address to serve HTTPS on".into(),
                });
            }
            return Ok(None);
        };
        let addr = listen.parse::<SocketAddr>().map_err(|e| HttpFieldError {
            field: "http.listen",
            value: listen.clone(),
            reason: format!("expected IP:PORT like 127.0.0.1:8080 ({e})"),
        })?;
        let tls = self.tls.map(|t| HttpTls {
            cert_file: base.join(t.cert_file),
            key_file: base.join(t.key_file),
        });
        if tls.is_none() && !addr.ip().is_loopback() && !self.insecure_plain_http {
            return Err(HttpFieldError {
                field: "http.listen",
                value: listen,
                reason: "plain HTTP beyond loopback would carry operators' requests and sessions \
                         in the clear: set [http.tls] cert_file and key_file, listen on \
                         127.0.0.1, or set http.insecure_plain_http = true behind a TLS proxy on \
                         this host"
                    .into(),
            });
        }
        if tls.is_none() && !addr.ip().is_loopback() {
            tracing::warn!(%addr, "serving plain HTTP beyond loopback (http.insecure_plain_http)");
        }
        Ok(Some(HttpConfig { listen: addr, tls }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Option<HttpConfig>, HttpFieldError> {
        toml::from_str::<RawHttp>(text)
            .expect("toml")
            .validate(Path::new("/etc/flotilla"))
    }

    #[test]
    fn off_by_default_and_loopback_or_tls_when_on() {
        assert_eq!(parse(""), Ok(None));
        assert_eq!(
            parse("listen = \"127.0.0.1:8080\""),
            Ok(Some(HttpConfig {
                listen: "127.0.0.1:8080".parse().expect("addr"),
                tls: None
            }))
        );
        let https = parse(
            "listen = \"0.0.0.0:8443\"\n[tls]\ncert_file = \"tls/c.crt\"\nkey_file = \"tls/c.key\"",
        )
        .expect("https")
        .expect("on");
        assert_eq!(
            https.tls.expect("tls").cert_file,
            PathBuf::from("/etc/flotilla/tls/c.crt")
        );
        let err = parse("listen = \"0.0.0.0:8080\"").expect_err("plain beyond loopback");
        assert_eq!(err.field, "http.listen");
        assert!(err.reason.contains("[http.tls]"), "{err:?}");
        assert!(parse("listen = \"0.0.0.0:8080\"\ninsecure_plain_http = true").is_ok());
        let err = parse("listen = \"localhost\"").expect_err("not an address");
        assert!(err.reason.contains("IP:PORT"), "{err:?}");
        let err = parse("[tls]\ncert_file = \"c\"\nkey_file = \"k\"").expect_err("no listen");
        assert_eq!(err.field, "http.tls");
    }
}
