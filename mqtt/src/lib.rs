//! # flotilla-mqtt
//!
//! How a flotilla process connects to its MQTT broker, in one place for the coordinator, the
//! agent and the CLI: the broker's address, a username and password, TLS with a CA file (or the
//! system's roots) and a client certificate for mutual TLS, turned into `rumqttc::MqttOptions`.
//!
//! Settings are validated once, when a config file or the command line is read
//! ([`ConnectionSpec::validate`]): the password is read from its file or environment variable,
//! the certificates and the key are parsed, and the TLS client configuration is built. Every
//! problem comes back as a [`FieldError`] naming the setting and the value, so a process never
//! starts with a connection it cannot make. After that, [`Connection::options`] cannot fail.
//!
//! TLS is rustls with the `ring` provider only, passed explicitly (no process-wide default
//! provider, no aws-lc): `ring` cross-compiles with Debian's gcc cross toolchains and keeps the
//! agent small (docs/decisions/0014-broker-tls.md).
//!
//! Every connection is opened with TCP_NODELAY ([`client`]): MQTT exchanges are small packets
//! that wait for an answer, and with Nagle's algorithm on, each waits for the peer's delayed
//! ACK, a floor of about 40 ms on every round trip (docs/decisions/0019-paged-api-nodelay.md).
//!
//! ```
//! use flotilla_mqtt::ConnectionSpec;
//! let spec = ConnectionSpec::plain("127.0.0.1", 1883);
//! let connection = spec.validate(std::path::Path::new("."), &|_| None).expect("valid");
//! let options = connection.options("dev-1");
//! assert_eq!(options.client_id(), "dev-1");
//! let (_client, _eventloop) = flotilla_mqtt::client(options, 10);
//! ```

mod guard;
pub mod https;
mod oversize;

pub use guard::{
    remove_own_dirs as remove_own_guard_dirs, spread, Guard, GuardError, Link, LinkSetup,
    DIAL_TIMEOUT,
};
pub use oversize::{dropped, Dropped, DROPPED_TOPIC};

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rumqttc::{AsyncClient, EventLoop, MqttOptions, NetworkOptions, TlsConfiguration, Transport};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};
use serde::Deserialize;

pub use rumqttc;

/// The conventional environment variable for a broker password.
pub const PASSWORD_ENV: &str = "FLOTILLA_BROKER_PASSWORD";

/// A secret that never appears in `Debug` output, so a logged config does not leak it.
#[derive(Clone, PartialEq, Eq)]
pub struct Password(String);

impl Password {
    pub fn new(secret: impl Into<String>) -> Self {
        Self(secret.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Password {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Password(<redacted>)")
    }
}

/// MQTT username and password.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: Password,
}

/// The `[broker.tls]` table as written in a config file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    /// PEM file with the CA certificate(s) the broker's certificate must chain to. Without it,
    /// the system's root certificates are used.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate (chain) for mutual TLS; needs `client_key`.
    pub client_cert: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of `client_cert`.
    pub client_key: Option<PathBuf>,
}

/// The broker settings as written (config file or command line), before validation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnectionSpec {
    pub host: String,
    pub port: u16,
    /// Further brokers of the same cluster, tried in turn when one cannot be reached
    /// ([`Connection::alternates`]).
    pub alternates: Vec<(String, u16)>,
    /// In which order the brokers are tried.
    pub order: BrokerOrder,
    pub username: Option<String>,
    /// A file whose content (without a trailing newline) is the password.
    pub password_file: Option<PathBuf>,
    /// The name of an environment variable holding the password.
    pub password_env: Option<String>,
    /// `Some` turns TLS on.
    pub tls: Option<RawTls>,
}

/// A refused setting: which one, its value, and why. `field` is the key inside `[broker]`
/// (`password_file`, `tls.ca_file`); callers prefix it (`broker.`) or map it to a flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} = {value:?}: {reason}")]
pub struct FieldError {
    pub field: &'static str,
    pub value: String,
    pub reason: String,
}

fn field_error(
    field: &'static str,
    value: impl fmt::Display,
    reason: impl Into<String>,
) -> FieldError {
    FieldError {
        field,
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// TLS settings, validated: the files it came from and the client configuration built from them.
#[derive(Clone)]
pub struct Tls {
    pub ca_file: Option<PathBuf>,
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// The first certificate of `client_cert` (DER), whose common name a broker that logs
    /// clients in by certificate takes as the user name.
    client_leaf: Option<CertificateDer<'static>>,
    config: Arc<ClientConfig>,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .finish_non_exhaustive()
    }
}

/// Two TLS settings are equal when they name the same files.
impl PartialEq for Tls {
    fn eq(&self, other: &Self) -> bool {
        self.ca_file == other.ca_file && self.client_cert == other.client_cert
    }
}

/// A validated broker connection.
#[derive(Debug, Clone, PartialEq)]
pub struct Connection {
    /// The first broker.
    pub host: String,
    pub port: u16,
    /// Further brokers of the same cluster (a NATS cluster, Mosquittos behind one name...): when
    /// the broker in use cannot be reached or drops the connection, the next connection goes to
    /// the next one that answers (decision 0057). Empty for one broker.
    pub alternates: Vec<(String, u16)>,
    pub order: BrokerOrder,
    pub credentials: Option<Credentials>,
    pub tls: Option<Tls>,
}

/// Which broker of a list a link tries first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BrokerOrder {
    /// The first, then the next: a coordinator or an operator's tool, which should use the
    /// broker listed first (the closest) whenever it answers.
    #[default]
    InOrder,
    /// One picked by the client id, then the next: devices spread over the brokers of a cluster
    /// instead of all crowding the first, and each device comes back to the same one (decision
    /// 0057).
    SpreadById,
}

/// Parses `HOST:PORT` (`[v6]:PORT` for an IPv6 address), for broker lists in configs and flags.
pub fn parse_host_port(text: &str) -> Result<(String, u16), String> {
    let (host, port) = text
        .trim()
        .rsplit_once(':')
        .ok_or_else(|| format!("{text:?}: expected HOST:PORT like mqtt.example.com:8883"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("{text:?}: {port:?} is not a port"))?;
    if host.is_empty() {
        return Err(format!(
            "{text:?}: expected HOST:PORT like mqtt.example.com:8883"
        ));
    }
    Ok((host.to_owned(), port))
}

impl ConnectionSpec {
    /// Plain TCP, no credentials.
    pub fn plain(host: &str, port: u16) -> Self {
        Self {
            host: host.to_owned(),
            port,
            ..Self::default()
        }
    }

    /// Validates the settings: reads the password, parses certificates and key, builds the TLS
    /// configuration. Relative file paths resolve against `base`; `env` looks up environment
    /// variables (pass `&|name| std::env::var(name).ok()`).
    pub fn validate(
        self,
        base: &Path,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Connection, FieldError> {
        if self.host.trim().is_empty() {
            return Err(field_error("host", &self.host, "must not be empty"));
        }
        if self.port == 0 {
            return Err(field_error("port", 0, "must be between 1 and 65535"));
        }
        for (host, port) in &self.alternates {
            if host.trim().is_empty() || *port == 0 {
                return Err(field_error(
                    "hosts",
                    format!("{host}:{port}"),
                    "every broker needs a host and a port",
                ));
            }
        }
        let credentials = credentials(
            self.username,
            self.password_file.map(|p| base.join(p)),
            self.password_env,
            env,
        )?;
        let tls = match self.tls {
            None => None,
            Some(raw) => Some(tls(raw, base)?),
        };
        Ok(Connection {
            host: self.host,
            port: self.port,
            alternates: self.alternates,
            order: self.order,
            credentials,
            tls,
        })
    }
}

fn credentials(
    username: Option<String>,
    password_file: Option<PathBuf>,
    password_env: Option<String>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Credentials>, FieldError> {
    let password = match (&password_file, &password_env) {
        (Some(_), Some(var)) => {
            return Err(field_error(
                "password_env",
                var,
                "set either password_file or password_env, not both",
            ))
        }
        (Some(path), None) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                field_error(
                    "password_file",
                    path.display(),
                    format!("cannot read it: {e}"),
                )
            })?;
            let secret = text.trim_end_matches(['\n', '\r']);
            if secret.is_empty() {
                return Err(field_error(
                    "password_file",
                    path.display(),
                    "the file is empty",
                ));
            }
            Some(Password::new(secret))
        }
        (None, Some(var)) => match env(var) {
            Some(secret) if !secret.is_empty() => Some(Password::new(secret)),
            _ => {
                return Err(field_error(
                    "password_env",
                    var,
                    "the environment variable is not set or empty",
                ))
            }
        },
        (None, None) => None,
    };
    match (username, password) {
        (None, None) => Ok(None),
        (Some(username), _) if username.trim().is_empty() => {
            Err(field_error("username", username, "must not be empty"))
        }
        (Some(username), Some(password)) => Ok(Some(Credentials { username, password })),
        (Some(username), None) => Err(field_error(
            "username",
            username,
            "needs a password: set password_file or password_env",
        )),
        (None, Some(_)) => Err(field_error(
            if password_file.is_some() {
                "password_file"
            } else {
                "password_env"
            },
            password_file
                .map(|p| p.display().to_string())
                .or(password_env)
                .unwrap_or_default(),
            "a password needs a username",
        )),
    }
}

fn tls(raw: RawTls, base: &Path) -> Result<Tls, FieldError> {
    let cert = raw.client_cert.map(|p| base.join(p));
    let key = raw.client_key.map(|p| base.join(p));
    let pair = match (cert, key) {
        (None, None) => None,
        (Some(cert), None) => {
            return Err(field_error(
                "tls.client_key",
                "",
                format!("client_cert {} needs its key", cert.display()),
            ))
        }
        (None, Some(key)) => {
            return Err(field_error(
                "tls.client_cert",
                "",
                format!("client_key {} needs its certificate", key.display()),
            ))
        }
        (Some(cert), Some(key)) => Some((cert, key)),
    };
    let mut roots = RootCertStore::empty();
    let ca_file = raw.ca_file.map(|p| base.join(p));
    match &ca_file {
        Some(path) => {
            let certs = read_certs("tls.ca_file", path)?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(field_error(
                    "tls.ca_file",
                    path.display(),
                    "holds no usable CA certificate",
                ));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            if roots.is_empty() {
                return Err(field_error(
                    "tls.ca_file",
                    "",
                    "not set, and the system has no root certificates: name the broker's CA file",
                ));
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| field_error("tls", "", format!("no usable TLS version: {e}")))?
        .with_root_certificates(roots);
    let (config, client_cert, client_leaf) = match pair {
        None => (builder.with_no_client_auth(), None, None),
        Some((cert, key)) => {
            let chain = read_certs("tls.client_cert", &cert)?;
            let leaf = chain.first().cloned();
            let secret = PrivateKeyDer::from_pem_file(&key).map_err(|e| {
                field_error(
                    "tls.client_key",
                    key.display(),
                    format!("no PEM private key: {e}"),
                )
            })?;
            let config = builder.with_client_auth_cert(chain, secret).map_err(|e| {
                field_error(
                    "tls.client_key",
                    key.display(),
                    format!("does not fit client_cert {}: {e}", cert.display()),
                )
            })?;
            (config, Some((cert, key)), leaf)
        }
    };
    Ok(Tls {
        ca_file,
        client_cert,
        client_leaf,
        config: Arc::new(config),
    })
}

fn read_certs(
    field: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, FieldError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            field_error(
                field,
                path.display(),
                format!("cannot read PEM certificates: {e}"),
            )
        })?;
    if certs.is_empty() {
        return Err(field_error(
            field,
            path.display(),
            "holds no PEM certificate",
        ));
    }
    Ok(certs)
}

impl Connection {
    /// Plain TCP to `host:port` without credentials (the embedded broker, tests).
    pub fn plain(host: &str, port: u16) -> Connection {
        Connection {
            host: host.to_owned(),
            port,
            alternates: Vec::new(),
            order: BrokerOrder::InOrder,
            credentials: None,
            tls: None,
        }
    }

    /// `host:port` of the first broker, for messages.
    pub fn addr(&self) -> String {
        host_port(&self.host, self.port)
    }

    /// Every broker, the first one first.
    pub fn brokers(&self) -> Vec<(String, u16)> {
        std::iter::once((self.host.clone(), self.port))
            .chain(self.alternates.iter().cloned())
            .collect()
    }

    /// How the connection is made, for logs: `mqtts://host:port as user`, or
    /// `mqtts://a:8883,b:8883 as user` for a list.
    pub fn describe(&self) -> String {
        let scheme = if self.tls.is_some() { "mqtts" } else { "mqtt" };
        let addrs: Vec<String> = self
            .brokers()
            .iter()
            .map(|(h, p)| host_port(h, *p))
            .collect();
        let mut text = format!("{scheme}://{}", addrs.join(","));
        if let Some(c) = &self.credentials {
            text.push_str(&format!(" as {}", c.username));
        }
        if matches!(&self.tls, Some(t) if t.client_cert.is_some()) {
            text.push_str(" with a client certificate");
        }
        text
    }

    /// The name the broker knows this login by: the user name, or without one the common name
    /// of the client certificate (what Mosquitto's `use_identity_as_username` takes). `None`
    /// for an anonymous connection, or a certificate without a readable common name.
    pub fn login_name(&self) -> Option<String> {
        if let Some(c) = &self.credentials {
            return Some(c.username.clone());
        }
        let leaf = self.tls.as_ref()?.client_leaf.as_ref()?;
        common_name(leaf)
    }

    /// A link to the broker under `client_id` through the size guard ([`guard`]): adjust
    /// `options` of the returned [`LinkSetup`] (keep alive, packet sizes, last will), then
    /// start it. flotilla's own links (coordinator, agent, CLI, fleet simulator) are made here.
    pub fn link(&self, client_id: impl Into<String>) -> LinkSetup {
        LinkSetup::new(self, client_id.into())
    }

    /// rumqttc options for this connection under `client_id`; the caller adds keep alive,
    /// session, packet sizes and last will.
    pub fn options(&self, client_id: impl Into<String>) -> MqttOptions {
        let mut options = MqttOptions::new(client_id, self.host.clone(), self.port);
        if let Some(c) = &self.credentials {
            options.set_credentials(c.username.clone(), c.password.expose());
        }
        if let Some(tls) = &self.tls {
            options.set_transport(Transport::tls_with_config(TlsConfiguration::Rustls(
                tls.config.clone(),
            )));
        }
        options
    }
}

/// `host:port`, with brackets around an IPv6 address.
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The first common name (OID 2.5.4.3) of a DER certificate's subject, if it is a UTF-8,
/// printable or IA5 string. Reads only the outer structure; the certificate was parsed and
/// checked against its key by rustls already.
fn common_name(cert: &[u8]) -> Option<String> {
    const SEQUENCE: u8 = 0x30;
    const SET: u8 = 0x31;
    const OID: u8 = 0x06;
    const COMMON_NAME: [u8; 3] = [0x55, 0x04, 0x03];
    let (tag, certificate, _) = der_next(cert)?;
    let (tag2, tbs, _) = der_next(certificate)?;
    if tag != SEQUENCE || tag2 != SEQUENCE {
        return None;
    }
    let mut rest = tbs;
    // version: [0] EXPLICIT, absent in v1 certificates.
    if rest.first() == Some(&0xA0) {
        rest = der_next(rest)?.2;
    }
    // serialNumber, signature, issuer, validity.
    for _ in 0..4 {
        rest = der_next(rest)?.2;
    }
    let (tag, mut names, _) = der_next(rest)?;
    if tag != SEQUENCE {
        return None;
    }
    while !names.is_empty() {
        let (tag, mut set, after) = der_next(names)?;
        names = after;
        if tag != SET {
            return None;
        }
        while !set.is_empty() {
            let (tag, pair, after) = der_next(set)?;
            set = after;
            let (oid_tag, oid, value) = der_next(pair)?;
            if tag != SEQUENCE || oid_tag != OID || oid != COMMON_NAME {
                continue;
            }
            let (kind, text, _) = der_next(value)?;
            // UTF8String, PrintableString, IA5String.
            return match kind {
                0x0C | 0x13 | 0x16 => String::from_utf8(text.to_vec()).ok(),
                _ => None,
            };
        }
    }
    None
}

/// One DER element at the start of `input`: its tag, its contents and what follows it.
fn der_next(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 || rest.len() < count {
            return None;
        }
        let (bytes, rest) = rest.split_at(count);
        let len = bytes.iter().fold(0usize, |n, b| (n << 8) | usize::from(*b));
        (len, rest)
    };
    if rest.len() < len {
        return None;
    }
    let (contents, after) = rest.split_at(len);
    Some((tag, contents, after))
}

/// The socket settings of every flotilla connection: TCP_NODELAY on, so a small packet (a
/// control request, a PubAck, a block request) goes out at once instead of waiting up to the
/// peer's delayed-ACK timeout for more bytes to join it. rumqttc applies them to the socket
/// before connecting, for plain TCP and TLS alike.
pub fn network_options() -> NetworkOptions {
    let mut network = NetworkOptions::new();
    network.set_tcp_nodelay(true);
    network
}

/// The rumqttc client and event loop for `options`, with [`network_options`], connected
/// straight to the broker (no size guard): for tests and tools that play a bare client. Every
/// client is made here rather than with `AsyncClient::new`, whose sockets keep Nagle's algorithm
/// on; flotilla's own links go through [`Connection::link`].
pub fn client(options: MqttOptions, capacity: usize) -> (AsyncClient, EventLoop) {
    let (client, mut eventloop) = AsyncClient::new(options, capacity);
    eventloop.set_network_options(network_options());
    (client, eventloop)
}

#[cfg(test)]
mod tests;
