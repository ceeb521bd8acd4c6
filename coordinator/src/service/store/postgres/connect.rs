//! Connecting to PostgreSQL: settings, TLS, and the thread each connection lives on.
//!
//! tokio-postgres needs a runtime to drive its connection, and the [`Backend`] methods are
//! synchronous and called from the service's tasks. So each connection (the store's and the
//! lease's) lives on a thread of its own with a current-thread runtime, and callers hand it jobs
//! and wait for the answer ([`wait`]), on a multi-thread runtime inside `block_in_place` so the
//! runtime's other tasks move to other workers meanwhile.
//!
//! [`Backend`]: crate::service::store::backend::Backend

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::config::{Host, SslMode};
use tokio_postgres::Client;

use crate::service::store::backend::BackendError;

/// Where the shared database is and how to reach it.
#[derive(Clone, PartialEq, Eq)]
pub struct PgSettings {
    /// `postgres://user@host:port/db`, without a password (that goes in `password`).
    pub url: String,
    pub password: Option<String>,
    /// CA certificates (PEM) the server's certificate must chain to; the system's roots when
    /// unset.
    pub ca_file: Option<PathBuf>,
    /// Whether to insist on TLS. Without it the connection is plain TCP.
    pub tls: bool,
    /// How long one attempt to connect may take.
    pub connect_timeout: Duration,
    /// How long one statement may take, at the server and as this client waits for it.
    pub statement_timeout: Duration,
}

impl Default for PgSettings {
    fn default() -> Self {
        PgSettings {
            url: "postgres://flotilla@127.0.0.1:5432/flotilla".to_owned(),
            password: None,
            ca_file: None,
            tls: false,
            connect_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(5),
        }
    }
}

impl std::fmt::Debug for PgSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgSettings")
            .field("url", &self.url)
            .field("password", &self.password.as_ref().map(|_| "(set)"))
            .field("ca_file", &self.ca_file)
            .field("tls", &self.tls)
            .field("connect_timeout", &self.connect_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .finish()
    }
}

/// The parsed settings, ready to connect with.
#[derive(Clone)]
pub(crate) struct Target {
    config: tokio_postgres::Config,
    tls: Option<tokio_postgres_rustls::MakeRustlsConnect>,
    /// `postgresql://user@host:port/db`, for messages.
    pub(crate) describe: String,
    pub(crate) statement_timeout: Duration,
}

impl Target {
    /// Checks `settings`; `timeouts_below` caps both timeouts (the lease keeps them under its
    /// renewal period so a dead connection cannot hold it past its deadline).
    pub(crate) fn new(
        settings: &PgSettings,
        timeouts_below: Option<Duration>,
    ) -> Result<Target, BackendError> {
        let mut config = tokio_postgres::Config::from_str(&settings.url).map_err(|e| {
            BackendError::failed(
                "postgresql settings",
                format!("url is not a PostgreSQL address: {e}"),
            )
        })?;
        let describe = describe(&config);
        if config.get_password().is_some() {
            return Err(BackendError::failed(
                &describe,
                "the url holds a password: put it in the password setting instead",
            ));
        }
        if let Some(password) = &settings.password {
            config.password(password.as_bytes());
        }
        let cap = |d: Duration| match timeouts_below {
            Some(limit) if d >= limit => limit.mul_f64(0.8),
            _ => d,
        };
        let connect_timeout = cap(settings.connect_timeout.max(Duration::from_millis(100)));
        let statement_timeout = cap(settings.statement_timeout.max(Duration::from_millis(100)));
        config.connect_timeout(connect_timeout);
        config.keepalives(true);
        config.keepalives_idle(Duration::from_secs(10));
        config.tcp_user_timeout(statement_timeout.max(Duration::from_secs(1)));
        config.application_name("flotilla");
        // A transaction whose client went silent (killed, or partitioned away while the server
        // still sees its socket) holds the lease row's share lock until the server gives up on
        // it: without the last setting, that is TCP keepalive's hours, and no standby could
        // take over meanwhile.
        config.options(format!(
            "-c client_min_messages=warning -c statement_timeout={0} -c lock_timeout={0} \
             -c idle_in_transaction_session_timeout={0}",
            statement_timeout.as_millis(),
        ));
        let tls = if settings.tls {
            config.ssl_mode(SslMode::Require);
            Some(tls_connector(&describe, settings)?)
        } else {
            config.ssl_mode(SslMode::Disable);
            None
        };
        Ok(Target {
            config,
            tls,
            describe,
            statement_timeout,
        })
    }

    /// One connection, its driver spawned on the current (the connection thread's) runtime.
    pub(crate) async fn connect(&self) -> Result<Client, BackendError> {
        let failed = |e: tokio_postgres::Error| {
            BackendError::failed(
                &self.describe,
                format!("cannot connect: {}", error_text(&e)),
            )
        };
        // The config's connect timeout bounds each address; this bounds the whole handshake.
        let limit = self
            .config
            .get_connect_timeout()
            .copied()
            .unwrap_or(self.statement_timeout)
            + self.statement_timeout;
        let attempt = async {
            match &self.tls {
                Some(tls) => {
                    let (client, connection) =
                        self.config.connect(tls.clone()).await.map_err(failed)?;
                    tokio::spawn(drive(connection));
                    Ok(client)
                }
                None => {
                    let (client, connection) = self
                        .config
                        .connect(tokio_postgres::NoTls)
                        .await
                        .map_err(failed)?;
                    tokio::spawn(drive(connection));
                    Ok(client)
                }
            }
        };
        match tokio::time::timeout(limit, attempt).await {
            Ok(result) => result,
            Err(_) => Err(BackendError::failed(
                &self.describe,
                format!("cannot connect: no answer within {limit:?}"),
            )),
        }
    }

    /// `what` failed with `e`: an error naming the database.
    pub(crate) fn error(&self, what: &str, e: &tokio_postgres::Error) -> BackendError {
        BackendError::failed(&self.describe, format!("{what}: {}", error_text(e)))
    }

    /// Runs `work` with this client-side bound on top of the server's statement timeout, so a
    /// connection cut off without a reset cannot keep the caller waiting.
    pub(crate) async fn bounded<T, E: From<BackendError>>(
        &self,
        what: &str,
        work: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let limit = self.statement_timeout + self.statement_timeout / 4;
        match tokio::time::timeout(limit, work).await {
            Ok(result) => result,
            Err(_) => Err(BackendError::failed(
                &self.describe,
                format!("{what}: no answer within {limit:?} (the connection is dropped)"),
            )
            .into()),
        }
    }
}

async fn drive<S, T>(connection: tokio_postgres::Connection<S, T>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    if let Err(e) = connection.await {
        tracing::debug!("postgresql connection ended: {e}");
    }
}

/// The database error's own message (with its detail) where there is one, else the client's.
pub(crate) fn error_text(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => match db.detail() {
            Some(detail) => format!("{} ({detail})", db.message()),
            None => db.message().to_owned(),
        },
        None => {
            let mut text = e.to_string();
            let mut source = std::error::Error::source(e);
            while let Some(s) = source {
                text.push_str(": ");
                text.push_str(&s.to_string());
                source = s.source();
            }
            text
        }
    }
}

/// `postgresql://user@host:port/db`, never the password.
fn describe(config: &tokio_postgres::Config) -> String {
    let user = config.get_user().unwrap_or("");
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(name)) => name.clone(),
        Some(Host::Unix(path)) => path.display().to_string(),
        None => "localhost".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let db = config.get_dbname().unwrap_or(user);
    let at = if user.is_empty() { "" } else { "@" };
    format!("postgresql://{user}{at}{host}:{port}/{db}")
}

fn tls_connector(
    describe: &str,
    settings: &PgSettings,
) -> Result<tokio_postgres_rustls::MakeRustlsConnect, BackendError> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    match &settings.ca_file {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
                .map_err(|e| {
                    BackendError::failed(
                        describe,
                        format!("cannot read the CA file {}: {e}", path.display()),
                    )
                })?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(BackendError::failed(
                    describe,
                    format!("the CA file {} holds no usable certificate", path.display()),
                ));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            if roots.is_empty() {
                return Err(BackendError::failed(
                    describe,
                    "TLS without a CA file, and the system has no root certificates",
                ));
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| BackendError::failed(describe, format!("no usable TLS version: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

/// Waits for `rx`'s answer from a connection thread without stalling a multi-thread runtime.
pub(crate) fn wait<T>(rx: std::sync::mpsc::Receiver<T>) -> Option<T> {
    wait_until(rx, None).ok()
}

/// Why [`wait_until`] returned without an answer.
pub(crate) enum NoAnswer {
    /// The connection thread is gone.
    Gone,
    /// `until` passed first.
    TimedOut,
}

/// Like [`wait`], giving up at `until`.
pub(crate) fn wait_until<T>(
    rx: std::sync::mpsc::Receiver<T>,
    until: Option<std::time::Instant>,
) -> Result<T, NoAnswer> {
    use std::sync::mpsc::RecvTimeoutError;
    let receive = move || match until {
        None => rx.recv().map_err(|_| NoAnswer::Gone),
        Some(until) => {
            let left = until.saturating_duration_since(std::time::Instant::now());
            rx.recv_timeout(left).map_err(|e| match e {
                RecvTimeoutError::Timeout => NoAnswer::TimedOut,
                RecvTimeoutError::Disconnected => NoAnswer::Gone,
            })
        }
    };
    let on_multi_thread = tokio::runtime::Handle::try_current()
        .map(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
        .unwrap_or(false);
    if on_multi_thread {
        tokio::task::block_in_place(receive)
    } else {
        receive()
    }
}

/// A current-thread runtime for a connection thread.
pub(crate) fn runtime(describe: &str) -> Result<tokio::runtime::Runtime, BackendError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| BackendError::failed(describe, format!("cannot start a runtime: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describe_names_user_host_port_and_database_never_the_password() {
        let settings = PgSettings {
            url: "postgres://flotilla@db.example:6432/fleet".to_owned(),
            password: Some("hunter2".to_owned()),
            ..PgSettings::default()
        };
        let target = Target::new(&settings, None).expect("settings");
        assert_eq!(
            target.describe,
            "postgresql://flotilla@db.example:6432/fleet"
        );
        assert!(!format!("{settings:?}").contains("hunter2"));
    }

    #[test]
    fn a_password_in_the_url_is_refused_without_repeating_it() {
        let settings = PgSettings {
            url: "postgres://flotilla:hunter2@db.example/fleet".to_owned(),
            ..PgSettings::default()
        };
        let err = Target::new(&settings, None)
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("password setting"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn the_lease_keeps_its_timeouts_below_its_renewal_period() {
        let settings = PgSettings::default();
        let target = Target::new(&settings, Some(Duration::from_secs(1))).expect("settings");
        assert!(target.statement_timeout < Duration::from_secs(1));
        assert!(target.config.get_connect_timeout().expect("set") < &Duration::from_secs(1));
    }
}
