//! The coordinator's configuration file (`flotilla serve --config FILE`).
//!
//! A raw serde struct mirrors the TOML; [`Config`] is what the service uses, built through
//! `TryFrom` so every problem is reported with the field and the value before anything starts.
//! Relative paths resolve against the config file's directory, not the working directory, so a
//! config behaves the same under systemd as in a shell. The commented default is embedded and
//! printed by `flotilla serve --print-default-config`.

use flotilla_mqtt::{BrokerOrder, Connection, ConnectionSpec, Credentials, RawTls, Tls};
use flotilla_rollout::duration::parse_duration;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use flotilla_protocol::operator::Role;
use flotilla_protocol::VerifyingKey;
use serde::Deserialize;

use crate::service::config_http::{HttpConfig, RawHttp};
use crate::service::config_store::{RawStore, StoreConfig};
use crate::service::tokens::{token_strength, TOKEN_MIN_BITS};

/// The commented default configuration.
pub const DEFAULT_CONFIG: &str = include_str!("../../default-config.toml");

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid TOML: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("config field {field} = {value:?} is invalid: {reason}")]
    Field {
        field: &'static str,
        value: String,
        reason: String,
    },
    /// A setting given on the command line or in the environment ([`Given`]).
    #[error("{setting} {value:?} is invalid: {reason}")]
    Given {
        /// The flag or environment variable, as the operator wrote it.
        setting: &'static str,
        value: String,
        reason: String,
    },
}

/// A setting given outside the config file, with where it came from (`--broker`,
/// `FLOTILLA_BROKER`), so that a refusal names what the operator wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Given<T> {
    pub value: T,
    pub from: &'static str,
}

/// Broker settings from `flotilla serve`'s command line or environment. Each one replaces the
/// config file's setting of the same name: flag > environment variable > config file > default
/// (the CLI decides between flag and variable). Paths are relative to the working directory.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BrokerOverrides {
    /// broker.host and broker.port, or broker.hosts when there are several (`--broker a:1883,b:1883`).
    pub addr: Option<Given<Vec<(String, u16)>>>,
    pub topic_root: Option<Given<String>>,
    pub embedded: Option<Given<SocketAddr>>,
    /// Lets the embedded broker listen on an address other than loopback
    /// (`--insecure-embedded-broker`, or broker.insecure_embedded in the config file).
    pub insecure_embedded: Option<Given<()>>,
    pub username: Option<Given<String>>,
    /// Replaces both password_file and password_env.
    pub password_file: Option<Given<PathBuf>>,
    /// Turns TLS on (the config's [broker.tls] files, if any, still apply).
    pub tls: Option<Given<()>>,
    pub ca_file: Option<Given<PathBuf>>,
    pub client_cert: Option<Given<PathBuf>>,
    pub client_key: Option<Given<PathBuf>>,
}

impl BrokerOverrides {
    /// The login and TLS settings given, as (where from, value) for messages.
    fn login_and_tls(&self) -> Vec<(&'static str, String)> {
        let path = |g: &Option<Given<PathBuf>>| {
            g.as_ref().map(|g| (g.from, g.value.display().to_string()))
        };
        [
            self.username.as_ref().map(|g| (g.from, g.value.clone())),
            path(&self.password_file),
            self.tls.as_ref().map(|g| (g.from, "true".to_owned())),
            path(&self.ca_file),
            path(&self.client_cert),
            path(&self.client_key),
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// Whether `host:port` reaches the embedded broker listening on `embedded`.
fn names_embedded(host: &str, port: u16, embedded: SocketAddr) -> bool {
    if port != embedded.port() {
        return false;
    }
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    let same_ip = host
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip == embedded.ip());
    same_ip || (loopback && (embedded.ip().is_loopback() || embedded.ip().is_unspecified()))
}

/// Whether `addr` is reachable from this host only.
fn is_loopback(addr: SocketAddr) -> bool {
    addr.ip().to_canonical().is_loopback()
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Holds `db/` (sled), `artifacts/` and `releases/`.
    pub data_dir: PathBuf,
    /// The coordinator's secret signing key (signs desired actions).
    pub coordinator_key: PathBuf,
    pub broker: BrokerConfig,
    /// How long a desired action stays valid after it is issued, in seconds.
    pub action_validity: u64,
    /// Who may send control requests, and what each may do.
    pub operators: Vec<OperatorConfig>,
    /// How far a signed control request's `at` may be from the coordinator's clock, in seconds.
    pub clock_window: u64,
    /// How many control requests a second each operator key, and each role, may send.
    pub control_limits: ControlLimits,
    /// Which devices are accepted without an operator.
    pub enrollment: EnrollmentConfig,
    /// Where `GET /metrics` is served (`[metrics] listen`); `None`, the default, serves none.
    pub metrics: Option<SocketAddr>,
    /// The HTTP server for the API and `/metrics` (`[http]`); `None`, the default, serves none.
    pub http: Option<HttpConfig>,
    /// Worker threads that check device signatures ahead of the service loop
    /// (`[service] verify_threads`; default: the cores available, at most 8).
    pub verify_threads: usize,
    /// How long the end-of-retained marker may take to come back after a (re)connect before the
    /// registry is taken as complete (`[service] marker_timeout`, seconds; default 30).
    pub marker_timeout: std::time::Duration,
    /// Subscribe to the count of messages the broker dropped, where Mosquitto publishes it
    /// (`[service] watch_sys_dropped`; default off; `coverage.rs`).
    pub watch_sys_dropped: bool,
    /// Where the state is kept (`[store]`): sled in `data_dir` (the default) or PostgreSQL.
    pub store: StoreConfig,
}

/// The most `[service] marker_timeout` may ask for, in seconds.
pub const MAX_MARKER_TIMEOUT: u64 = 3600;

/// The most `[service] verify_threads` may ask for.
pub const MAX_VERIFY_THREADS: usize = 64;

/// One operator allowed to send signed control requests.
#[derive(Debug, Clone, PartialEq)]
pub struct OperatorConfig {
    /// Named in the decision trace and the logs ("rollout fw-2-4 started by alice").
    pub name: String,
    pub role: Role,
    pub key: VerifyingKey,
}

/// Control requests a second, by the role of the operator sending them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoleRates {
    pub viewer: u32,
    pub operator: u32,
    pub admin: u32,
}

impl RoleRates {
    pub fn of(&self, role: Role) -> u32 {
        match role {
            Role::Viewer => self.viewer,
            Role::Operator => self.operator,
            Role::Admin => self.admin,
        }
    }
}

/// The rate limits of the operator gate (`[control] key_rate` and `role_rate`): each key may
/// send `key` requests a second, all keys of one role together `role`; each with a burst of
/// [`CONTROL_BURST_SECONDS`] seconds' worth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlLimits {
    pub key: RoleRates,
    pub role: RoleRates,
}

/// How many seconds' worth of requests a key or a role may send at once.
pub const CONTROL_BURST_SECONDS: u64 = 10;

impl Default for ControlLimits {
    fn default() -> Self {
        ControlLimits {
            key: RoleRates {
                viewer: 10,
                operator: 20,
                admin: 50,
            },
            role: RoleRates {
                viewer: 20,
                operator: 50,
                admin: 100,
            },
        }
    }
}

/// Device enrollment: what is accepted without an operator (`[enrollment]`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EnrollmentConfig {
    /// A file of pre-authorized device keys: one hex public key per line, optionally followed
    /// by the only device id it may enroll; `#` starts a comment.
    pub authorized_keys: Option<PathBuf>,
    /// One-time enrollment tokens; each accepts the first device that shows it, then never again.
    pub tokens: Vec<String>,
    /// How many devices may wait for an operator at once; states of further unknown devices are
    /// ignored (and counted) so a flood of made-up devices cannot fill the store.
    pub max_pending: usize,
    /// Enrollment attempts (states carrying a token's proof) checked a second, all devices
    /// together (`attempts_per_second`); a burst of ten seconds' worth.
    pub attempts_per_second: u32,
    /// Enrollment attempts checked a minute for one device id (`device_attempts_per_minute`);
    /// a burst of three.
    pub device_attempts_per_minute: u32,
}

/// Where the MQTT broker is, how to log in, and whether to run one in-process.
#[derive(Debug, Clone, PartialEq)]
pub struct BrokerConfig {
    /// The first broker.
    pub host: String,
    pub port: u16,
    /// Further brokers of the same cluster, tried in order when the one in use cannot be
    /// reached (`[broker] hosts`, `--broker a:1883,b:1883`; decision 0057).
    pub alternates: Vec<(String, u16)>,
    pub topic_root: String,
    /// Run rumqttd inside the coordinator, listening here.
    pub embedded: Option<SocketAddr>,
    /// The coordinator's MQTT client id: stable, so a broker ACL can name it.
    pub client_id: String,
    /// Username and password (read from its file or variable when the config was loaded).
    pub credentials: Option<Credentials>,
    /// TLS to the external broker; `None` is plain TCP.
    pub tls: Option<Tls>,
}

/// The coordinator's client id when the config names none.
pub const DEFAULT_CLIENT_ID: &str = "flotilla-coordinator";

impl BrokerConfig {
    /// Plain TCP to `host:port`, no credentials, the default root and client id.
    pub fn plain(host: &str, port: u16) -> Self {
        Self {
            host: host.to_owned(),
            port,
            alternates: Vec::new(),
            topic_root: flotilla_protocol::topics::DEFAULT_ROOT.into(),
            embedded: None,
            client_id: DEFAULT_CLIENT_ID.into(),
            credentials: None,
            tls: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    data_dir: String,
    coordinator_key: String,
    #[serde(default)]
    broker: RawBroker,
    #[serde(default)]
    actions: RawActions,
    #[serde(default)]
    control: RawControl,
    #[serde(default)]
    operators: Vec<RawOperator>,
    #[serde(default)]
    enrollment: RawEnrollment,
    #[serde(default)]
    metrics: RawMetrics,
    #[serde(default)]
    http: RawHttp,
    #[serde(default)]
    service: RawService,
    #[serde(default)]
    store: RawStore,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawService {
    verify_threads: Option<usize>,
    marker_timeout: Option<u64>,
    watch_sys_dropped: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawMetrics {
    listen: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawControl {
    clock_window: String,
    key_rate: RawRoleRates,
    role_rate: RawRoleRates,
}

impl Default for RawControl {
    fn default() -> Self {
        Self {
            clock_window: "60s".into(),
            key_rate: RawRoleRates::default(),
            role_rate: RawRoleRates::default(),
        }
    }
}

/// A table of requests a second by role; a role left out keeps its default.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawRoleRates {
    viewer: Option<u32>,
    operator: Option<u32>,
    admin: Option<u32>,
}

impl RawRoleRates {
    /// The rates with `defaults` for the roles left out; `field` names the table in errors.
    fn validate(&self, defaults: RoleRates, field: &'static str) -> Result<RoleRates, ConfigError> {
        let one = |given: Option<u32>, default: u32, role: &str| match given {
            None => Ok(default),
            Some(n @ 1..=MAX_CONTROL_RATE) => Ok(n),
            Some(n) => Err(ConfigError::Field {
                field,
                value: format!("{role} = {n}"),
                reason: format!("requests a second must be between 1 and {MAX_CONTROL_RATE}"),
            }),
        };
        Ok(RoleRates {
            viewer: one(self.viewer, defaults.viewer, "viewer")?,
            operator: one(self.operator, defaults.operator, "operator")?,
            admin: one(self.admin, defaults.admin, "admin")?,
        })
    }
}

/// The most control requests a second a key or role may be allowed.
pub const MAX_CONTROL_RATE: u32 = 100_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOperator {
    name: String,
    role: String,
    /// The public key in hex, inline.
    #[serde(default)]
    key: Option<String>,
    /// Or a public key file (`flotilla operator keygen` writes NAME.pub).
    #[serde(default)]
    key_file: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawEnrollment {
    authorized_keys: Option<String>,
    tokens: Vec<String>,
    max_pending: usize,
    attempts_per_second: u32,
    device_attempts_per_minute: u32,
}

impl Default for RawEnrollment {
    fn default() -> Self {
        Self {
            authorized_keys: None,
            tokens: Vec::new(),
            max_pending: 1000,
            attempts_per_second: 20,
            device_attempts_per_minute: 6,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawBroker {
    host: String,
    port: u16,
    /// Several brokers of one cluster, `HOST:PORT` each, instead of `host` and `port`.
    hosts: Vec<String>,
    topic_root: String,
    embedded: Option<String>,
    insecure_embedded: bool,
    client_id: String,
    username: Option<String>,
    password_file: Option<PathBuf>,
    password_env: Option<String>,
    tls: Option<RawTls>,
}

impl Default for RawBroker {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 1883,
            hosts: Vec::new(),
            topic_root: flotilla_protocol::topics::DEFAULT_ROOT.into(),
            embedded: None,
            insecure_embedded: false,
            client_id: DEFAULT_CLIENT_ID.into(),
            username: None,
            password_file: None,
            password_env: None,
            tls: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawActions {
    validity: String,
}

impl Default for RawActions {
    fn default() -> Self {
        Self {
            validity: "7d".into(),
        }
    }
}

/// A raw config plus the directory relative paths are resolved against, and the settings given
/// outside it.
struct Located<'a> {
    raw: RawConfig,
    base: PathBuf,
    overrides: &'a BrokerOverrides,
}

impl TryFrom<Located<'_>> for Config {
    type Error = ConfigError;

    fn try_from(located: Located<'_>) -> Result<Self, Self::Error> {
        let Located {
            mut raw,
            base,
            overrides,
        } = located;
        let given = |g: &Given<String>, reason: &str| ConfigError::Given {
            setting: g.from,
            value: g.value.clone(),
            reason: reason.to_owned(),
        };
        // The brokers: `--broker` (one or a list), else broker.hosts, else broker.host:port.
        let mut brokers: Vec<(String, u16)> = match &overrides.addr {
            Some(addr) => addr.value.clone(),
            None => {
                let mut parsed = Vec::new();
                for text in &raw.broker.hosts {
                    parsed.push(flotilla_mqtt::parse_host_port(text).map_err(|reason| {
                        ConfigError::Field {
                            field: "broker.hosts",
                            value: text.clone(),
                            reason,
                        }
                    })?);
                }
                parsed
            }
        };
        if !brokers.is_empty() {
            (raw.broker.host, raw.broker.port) = brokers.remove(0);
        }
        let alternates = brokers;
        let field = |field, value: &str, reason: &str| ConfigError::Field {
            field,
            value: value.to_owned(),
            reason: reason.to_owned(),
        };
        if raw.data_dir.trim().is_empty() {
            return Err(field("data_dir", &raw.data_dir, "must not be empty"));
        }
        if raw.coordinator_key.trim().is_empty() {
            return Err(field(
                "coordinator_key",
                &raw.coordinator_key,
                "must not be empty",
            ));
        }
        if raw.broker.host.trim().is_empty() {
            return Err(field("broker.host", &raw.broker.host, "must not be empty"));
        }
        if raw.broker.port == 0 {
            return Err(field("broker.port", "0", "must be between 1 and 65535"));
        }
        let client_id = &raw.broker.client_id;
        if client_id.is_empty()
            || client_id.len() > 64
            || !client_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(field(
                "broker.client_id",
                client_id,
                "use 1 to 64 of letters, digits, '.', '_' and '-'",
            ));
        }
        if let Some(root) = &overrides.topic_root {
            raw.broker.topic_root.clone_from(&root.value);
        }
        let root = &raw.broker.topic_root;
        if root.is_empty() || root.contains(['+', '#']) || root.starts_with('/') {
            let reason = "must be non-empty, not start with '/', and contain no MQTT wildcards";
            return Err(match &overrides.topic_root {
                Some(g) => given(g, reason),
                None => field("broker.topic_root", root, reason),
            });
        }
        let embedded = match (&overrides.embedded, &raw.broker.embedded) {
            (Some(g), _) => Some(g.value),
            (None, None) => None,
            (None, Some(addr)) => Some(addr.parse::<SocketAddr>().map_err(|e| {
                field(
                    "broker.embedded",
                    addr,
                    &format!("expected HOST:PORT like 127.0.0.1:1883 ({e})"),
                )
            })?),
        };
        if let Some(addr) = embedded {
            let named = match &overrides.embedded {
                Some(g) => format!("{} {addr}", g.from),
                None => format!("broker.embedded = \"{addr}\" in the config file"),
            };
            let insecure = overrides.insecure_embedded.is_some() || raw.broker.insecure_embedded;
            if !is_loopback(addr) && !insecure {
                let reason = format!(
                    "the embedded broker has no login, no TLS and no ACL: on {} anyone who reaches \
                     it can read every device's state, clear retained messages and take over the \
                     coordinator's client id. Listen on loopback (127.0.0.1:{port}) and use an \
                     external broker for devices on other hosts (deploy/mosquitto), or, on a \
                     network you trust, pass --insecure-embedded-broker (broker.insecure_embedded \
                     = true) to run it there anyway",
                    addr.ip(),
                    port = addr.port()
                );
                return Err(match &overrides.embedded {
                    Some(g) => ConfigError::Given {
                        setting: g.from,
                        value: addr.to_string(),
                        reason,
                    },
                    None => field("broker.embedded", &addr.to_string(), &reason),
                });
            }
            if let Some(g) = &overrides.addr {
                let (host, port) = (&raw.broker.host, &raw.broker.port);
                if !alternates.is_empty() || !names_embedded(host, *port, addr) {
                    return Err(ConfigError::Given {
                        setting: g.from,
                        value: format!("{host}:{port}"),
                        reason: format!(
                            "the coordinator runs an embedded broker ({named}) and connects to it, not to another broker; name the embedded broker's address or run without it"
                        ),
                    });
                }
            }
            if let Some((from, value)) = overrides.login_and_tls().into_iter().next() {
                return Err(ConfigError::Given {
                    setting: from,
                    value,
                    reason: format!(
                        "the coordinator runs an embedded broker ({named}) and connects to it over plain loopback TCP, without login or TLS; leave this out or run without the embedded broker"
                    ),
                });
            }
        }
        let action_validity = parse_duration(&raw.actions.validity)
            .map_err(|reason| field("actions.validity", &raw.actions.validity, &reason))?;
        if action_validity == 0 {
            return Err(field(
                "actions.validity",
                &raw.actions.validity,
                "must be longer than 0s",
            ));
        }
        let broker = raw.broker;
        let (spec, password_env_given) = connection_spec(
            ConnectionSpec {
                host: broker.host,
                port: broker.port,
                alternates,
                order: BrokerOrder::InOrder,
                username: broker.username,
                password_file: broker.password_file,
                password_env: broker.password_env,
                tls: broker.tls,
            },
            &base,
            overrides,
        );
        // Paths are absolute or relative to the working directory by now.
        let connection = spec
            .validate(Path::new(""), &|name| std::env::var(name).ok())
            .map_err(
                |e| match given_field(e.field, overrides, password_env_given) {
                    Some(setting) => ConfigError::Given {
                        setting,
                        value: e.value,
                        reason: e.reason,
                    },
                    None => ConfigError::Field {
                        field: broker_field(e.field),
                        value: e.value,
                        reason: e.reason,
                    },
                },
            )?;
        let clock_window = parse_duration(&raw.control.clock_window)
            .map_err(|reason| field("control.clock_window", &raw.control.clock_window, &reason))?;
        if clock_window == 0 {
            return Err(field(
                "control.clock_window",
                &raw.control.clock_window,
                "must be longer than 0s",
            ));
        }
        let operators = operators(&raw.operators, &base)?;
        if let Some(path) = &raw.enrollment.authorized_keys {
            if path.trim().is_empty() {
                return Err(field(
                    "enrollment.authorized_keys",
                    path,
                    "must not be empty (leave it out for none)",
                ));
            }
        }
        for (n, token) in raw.enrollment.tokens.iter().enumerate() {
            if let Err(weak) = token_strength(token) {
                // Do not echo a secret back, even a weak one: name its place in the list.
                return Err(field(
                    "enrollment.tokens",
                    &format!("(token {} of {})", n + 1, raw.enrollment.tokens.len()),
                    &format!(
                        "{weak}; a token must carry at least {TOKEN_MIN_BITS} bits of entropy: \
                         make one with `flotilla enrollment token` (32 random bytes in hex)"
                    ),
                ));
            }
        }
        if raw.enrollment.max_pending == 0 {
            return Err(field("enrollment.max_pending", "0", "must be at least 1"));
        }
        if raw.enrollment.attempts_per_second == 0 {
            return Err(field(
                "enrollment.attempts_per_second",
                "0",
                "must be at least 1",
            ));
        }
        if raw.enrollment.device_attempts_per_minute == 0 {
            return Err(field(
                "enrollment.device_attempts_per_minute",
                "0",
                "must be at least 1",
            ));
        }
        let defaults = ControlLimits::default();
        let control_limits = ControlLimits {
            key: raw
                .control
                .key_rate
                .validate(defaults.key, "control.key_rate")?,
            role: raw
                .control
                .role_rate
                .validate(defaults.role, "control.role_rate")?,
        };
        let metrics = match &raw.metrics.listen {
            None => None,
            Some(addr) => Some(addr.parse::<SocketAddr>().map_err(|e| {
                field(
                    "metrics.listen",
                    addr,
                    &format!("expected IP:PORT like 127.0.0.1:9464 ({e})"),
                )
            })?),
        };
        let verify_threads = match raw.service.verify_threads {
            None => crate::service::verify::default_threads(),
            Some(n @ 1..=MAX_VERIFY_THREADS) => n,
            Some(n) => {
                return Err(field(
                    "service.verify_threads",
                    &n.to_string(),
                    &format!("must be between 1 and {MAX_VERIFY_THREADS}"),
                ))
            }
        };
        let marker_timeout = match raw.service.marker_timeout {
            None => crate::service::loading::MARKER_TIMEOUT,
            Some(n @ 1..=MAX_MARKER_TIMEOUT) => std::time::Duration::from_secs(n),
            Some(n) => {
                return Err(field(
                    "service.marker_timeout",
                    &n.to_string(),
                    &format!("must be between 1 and {MAX_MARKER_TIMEOUT} seconds"),
                ))
            }
        };
        let enrollment = EnrollmentConfig {
            authorized_keys: raw.enrollment.authorized_keys.map(|p| base.join(p)),
            tokens: raw.enrollment.tokens,
            max_pending: raw.enrollment.max_pending,
            attempts_per_second: raw.enrollment.attempts_per_second,
            device_attempts_per_minute: raw.enrollment.device_attempts_per_minute,
        };
        let store = raw
            .store
            .validate(&base, &|name| std::env::var(name).ok())
            .map_err(|e| ConfigError::Field {
                field: e.field,
                value: e.value,
                reason: e.reason,
            })?;
        let http = raw.http.validate(&base).map_err(|e| ConfigError::Field {
            field: e.field,
            value: e.value,
            reason: e.reason,
        })?;
        Ok(Config {
            store,
            metrics,
            http,
            verify_threads,
            marker_timeout,
            watch_sys_dropped: raw.service.watch_sys_dropped,
            operators,
            clock_window,
            control_limits,
            enrollment,
            data_dir: base.join(&raw.data_dir),
            coordinator_key: base.join(&raw.coordinator_key),
            broker: BrokerConfig {
                host: connection.host,
                port: connection.port,
                alternates: connection.alternates,
                topic_root: broker.topic_root,
                embedded,
                client_id: broker.client_id,
                credentials: connection.credentials,
                tls: connection.tls,
            },
            action_validity,
        })
    }
}

/// Validates the `[[operators]]` entries: names follow the id rules and are unique, the role is
/// known, exactly one of `key` and `key_file` is given and holds a valid key, no key twice.
fn operators(raw: &[RawOperator], base: &Path) -> Result<Vec<OperatorConfig>, ConfigError> {
    let field = |field, value: &str, reason: String| ConfigError::Field {
        field,
        value: value.to_owned(),
        reason,
    };
    let mut out: Vec<OperatorConfig> = Vec::new();
    for op in raw {
        flotilla_protocol::validate_id("operator name", &op.name)
            .map_err(|e| field("operators.name", &op.name, e.to_string()))?;
        if out.iter().any(|o| o.name == op.name) {
            return Err(field(
                "operators.name",
                &op.name,
                "appears twice".to_owned(),
            ));
        }
        let role = Role::parse(&op.role).ok_or_else(|| {
            field(
                "operators.role",
                &op.role,
                format!("operator {}: expected viewer, operator or admin", op.name),
            )
        })?;
        let (what, value, text) = match (&op.key, &op.key_file) {
            (Some(key), None) => ("operators.key", key.clone(), key.clone()),
            (None, Some(file)) => {
                let path = base.join(file);
                let text = std::fs::read_to_string(&path).map_err(|e| {
                    field(
                        "operators.key_file",
                        file,
                        format!("operator {}: cannot read {}: {e}", op.name, path.display()),
                    )
                })?;
                ("operators.key_file", file.clone(), text)
            }
            _ => {
                return Err(field(
                    "operators",
                    &op.name,
                    "give exactly one of key (hex) and key_file".to_owned(),
                ))
            }
        };
        let key = flotilla_protocol::signing::public_key_from_text(&text)
            .map_err(|e| field(what, &value, format!("operator {}: {e}", op.name)))?;
        if let Some(other) = out.iter().find(|o| o.key == key) {
            return Err(field(
                what,
                &value,
                format!(
                    "operator {}: the same key as operator {}",
                    op.name, other.name
                ),
            ));
        }
        out.push(OperatorConfig {
            name: op.name.clone(),
            role,
            key,
        });
    }
    Ok(out)
}

/// The config file's connection settings (paths resolved against its directory `base`) with the
/// overrides applied, field by field; and whether the password variable was implied by a
/// `--username` given without a password file (as the other commands read it).
fn connection_spec(
    mut spec: ConnectionSpec,
    base: &Path,
    o: &BrokerOverrides,
) -> (ConnectionSpec, bool) {
    spec.password_file = spec.password_file.map(|p| base.join(p));
    if let Some(tls) = &mut spec.tls {
        for path in [&mut tls.ca_file, &mut tls.client_cert, &mut tls.client_key] {
            *path = path.as_ref().map(|p| base.join(p));
        }
    }
    if let Some(g) = &o.username {
        spec.username = Some(g.value.clone());
    }
    if let Some(g) = &o.password_file {
        spec.password_file = Some(g.value.clone());
        spec.password_env = None;
    }
    let implied =
        o.username.is_some() && spec.password_file.is_none() && spec.password_env.is_none();
    if implied {
        spec.password_env = Some(flotilla_mqtt::PASSWORD_ENV.to_owned());
    }
    let files = [&o.ca_file, &o.client_cert, &o.client_key];
    if o.tls.is_some() || files.iter().any(|g| g.is_some()) {
        let tls = spec.tls.get_or_insert_with(RawTls::default);
        let slots = [&mut tls.ca_file, &mut tls.client_cert, &mut tls.client_key];
        for (slot, g) in slots.into_iter().zip(files) {
            if let Some(g) = g {
                *slot = Some(g.value.clone());
            }
        }
    }
    (spec, implied)
}

/// The flag or variable a connection field came from, when it was given outside the config.
fn given_field(
    field: &'static str,
    o: &BrokerOverrides,
    password_env_given: bool,
) -> Option<&'static str> {
    let from = |g: &Option<Given<_>>| g.as_ref().map(|g: &Given<_>| g.from);
    match field {
        "host" | "port" => o.addr.as_ref().map(|g| g.from),
        "username" => o.username.as_ref().map(|g| g.from),
        "password_file" => from(&o.password_file),
        "password_env" if password_env_given => Some(flotilla_mqtt::PASSWORD_ENV),
        "password_env" => None,
        "tls.ca_file" => from(&o.ca_file),
        "tls.client_cert" => from(&o.client_cert),
        // A certificate without its key: the key is what is missing.
        "tls.client_key" => from(&o.client_key).or(from(&o.client_cert)),
        _ => o.tls.as_ref().map(|g| g.from),
    }
}

/// `broker.`-prefixed names for the fields flotilla-mqtt validates.
fn broker_field(field: &'static str) -> &'static str {
    match field {
        "host" => "broker.host",
        "port" => "broker.port",
        "username" => "broker.username",
        "password_file" => "broker.password_file",
        "password_env" => "broker.password_env",
        "tls.ca_file" => "broker.tls.ca_file",
        "tls.client_cert" => "broker.tls.client_cert",
        "tls.client_key" => "broker.tls.client_key",
        _ => "broker.tls",
    }
}

impl Config {
    /// Parses config text; relative paths resolve against `base`.
    pub fn from_toml(text: &str, base: &Path, origin: &Path) -> Result<Config, ConfigError> {
        Self::from_toml_with(text, base, origin, &BrokerOverrides::default())
    }

    /// [`Config::from_toml`] with settings given on the command line or in the environment.
    pub fn from_toml_with(
        text: &str,
        base: &Path,
        origin: &Path,
        overrides: &BrokerOverrides,
    ) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: origin.to_owned(),
            source,
        })?;
        Config::try_from(Located {
            raw,
            base: base.to_owned(),
            overrides,
        })
    }

    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Self::load_with(path, &BrokerOverrides::default())
    }

    /// Reads and validates a config file; each setting in `overrides` replaces the file's.
    pub fn load_with(path: &Path, overrides: &BrokerOverrides) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new(".")).to_owned();
        Config::from_toml_with(&text, &base, path, overrides)
    }

    /// Where the coordinator connects: the embedded broker when there is one (so
    /// `--embedded-broker` alone is enough), otherwise `broker.host:broker.port`.
    pub fn connect_to(&self) -> (String, u16) {
        match self.broker.embedded {
            Some(addr) if addr.ip().is_unspecified() => ("127.0.0.1".to_owned(), addr.port()),
            Some(addr) => (addr.ip().to_string(), addr.port()),
            None => (self.broker.host.clone(), self.broker.port),
        }
    }

    /// How the coordinator connects: plain TCP to its embedded broker (loopback, no TLS, the
    /// credentials are not needed there), otherwise the configured host, credentials and TLS.
    pub fn connection(&self) -> Connection {
        let (host, port) = self.connect_to();
        if self.broker.embedded.is_some() {
            return Connection::plain(&host, port);
        }
        Connection {
            host,
            port,
            alternates: self.broker.alternates.clone(),
            order: BrokerOrder::InOrder,
            credentials: self.broker.credentials.clone(),
            tls: self.broker.tls.clone(),
        }
    }

    /// The broker address the coordinator connects to, as `HOST:PORT` for messages.
    pub fn broker_addr(&self) -> String {
        let (host, port) = self.connect_to();
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml(
            text,
            Path::new("/etc/flotilla"),
            Path::new("/etc/flotilla/coordinator.toml"),
        )
    }

    #[test]
    fn default_config_is_valid() {
        let config = parse(DEFAULT_CONFIG).expect("the shipped default parses");
        assert_eq!(config.broker.port, 1883);
        assert_eq!(config.broker.topic_root, "flotilla");
        assert_eq!(config.action_validity, 7 * 86_400);
        assert_eq!(config.clock_window, 60);
        assert!(config.operators.is_empty());
        assert_eq!(config.broker.client_id, "flotilla-coordinator");
        assert_eq!(config.broker.credentials, None);
        assert_eq!(config.broker.tls, None);
        assert!(config.data_dir.starts_with("/etc/flotilla") || config.data_dir.is_absolute());
        assert_eq!(config.enrollment.max_pending, 1000);
        assert!(config.enrollment.tokens.is_empty());
        assert_eq!(config.metrics, None, "no metrics endpoint unless asked for");
        assert_eq!(
            config.verify_threads,
            crate::service::verify::default_threads(),
            "one signature worker per core unless set"
        );
    }

    #[test]
    fn marker_timeout_is_thirty_seconds_unless_set() {
        let base = "data_dir = \"d\"\ncoordinator_key = \"k\"\n";
        let config = parse(base).expect("valid");
        assert_eq!(config.marker_timeout, std::time::Duration::from_secs(30));
        let config = parse(&format!("{base}[service]\nmarker_timeout = 5\n")).expect("valid");
        assert_eq!(config.marker_timeout, std::time::Duration::from_secs(5));
        for bad in ["0", "3601", "\"5s\""] {
            let err = parse(&format!("{base}[service]\nmarker_timeout = {bad}\n"))
                .expect_err(bad)
                .to_string();
            assert!(err.contains("marker_timeout"), "{bad}: {err}");
        }
    }

    #[test]
    fn watch_sys_dropped_is_off_unless_set() {
        let base = "data_dir = \"d\"\ncoordinator_key = \"k\"\n";
        assert!(!parse(base).expect("valid").watch_sys_dropped);
        let config = parse(&format!("{base}[service]\nwatch_sys_dropped = true\n")).expect("valid");
        assert!(config.watch_sys_dropped);
        let err = parse(&format!("{base}[service]\nwatch_sys_dropped = \"yes\"\n"))
            .expect_err("not a bool")
            .to_string();
        assert!(err.contains("watch_sys_dropped"), "{err}");
    }

    #[test]
    fn verify_threads_is_a_small_positive_number() {
        let config =
            parse("data_dir = \"d\"\ncoordinator_key = \"k\"\n[service]\nverify_threads = 3\n")
                .expect("valid");
        assert_eq!(config.verify_threads, 3);
        for bad in ["0", "65", "-1", "\"two\""] {
            let err = parse(&format!(
                "data_dir = \"d\"\ncoordinator_key = \"k\"\n[service]\nverify_threads = {bad}\n"
            ))
            .expect_err(bad)
            .to_string();
            assert!(err.contains("verify_threads"), "{bad}: {err}");
        }
    }

    #[test]
    fn metrics_listen_is_an_ip_and_port() {
        let config = parse(
            "data_dir = \"d\"\ncoordinator_key = \"k\"\n[metrics]\nlisten = \"127.0.0.1:9464\"\n",
        )
        .expect("valid");
        assert_eq!(
            config.metrics,
            Some("127.0.0.1:9464".parse().expect("addr"))
        );
        for bad in ["localhost:9464", "127.0.0.1", ""] {
            let err = parse(&format!(
                "data_dir = \"d\"\ncoordinator_key = \"k\"\n[metrics]\nlisten = {bad:?}\n"
            ))
            .expect_err(bad)
            .to_string();
            assert!(
                err.contains("metrics.listen") && err.contains("IP:PORT"),
                "{err}"
            );
        }
        let err = parse("data_dir = \"d\"\ncoordinator_key = \"k\"\n[metrics]\nport = 1\n")
            .expect_err("unknown field")
            .to_string();
        assert!(err.contains("port"), "{err}");
    }

    #[test]
    fn enrollment_section_is_validated() {
        let token = "3f9c2a7e1b5d48c06a9e7f21d4c3b8a5";
        let config = parse(&format!(
            "data_dir = \"d\"\ncoordinator_key = \"k\"\n[enrollment]\nauthorized_keys = \"devices.keys\"\ntokens = [\"{token}\"]\n"
        ))
        .expect("valid");
        assert_eq!(
            config.enrollment.authorized_keys,
            Some(PathBuf::from("/etc/flotilla/devices.keys"))
        );
        assert_eq!(config.enrollment.tokens, vec![token]);
        assert_eq!(config.enrollment.attempts_per_second, 20);
        assert_eq!(config.enrollment.device_attempts_per_minute, 6);
        let err = parse(
            "data_dir = \"d\"\ncoordinator_key = \"k\"\n[enrollment]\nattempts_per_second = 0\n",
        )
        .expect_err("no attempts")
        .to_string();
        assert!(err.contains("enrollment.attempts_per_second"), "{err}");
    }

    #[test]
    fn control_rate_limits_default_and_are_validated() {
        let config = parse("data_dir = \"d\"\ncoordinator_key = \"k\"\n").expect("valid");
        assert_eq!(config.control_limits, ControlLimits::default());
        let config = parse(
            "data_dir = \"d\"\ncoordinator_key = \"k\"\n[control]\nkey_rate = { viewer = 2 }\nrole_rate = { viewer = 3, admin = 7 }\n",
        )
        .expect("valid");
        assert_eq!(config.control_limits.key.viewer, 2);
        assert_eq!(
            config.control_limits.key.admin,
            ControlLimits::default().key.admin
        );
        assert_eq!(
            (
                config.control_limits.role.viewer,
                config.control_limits.role.admin
            ),
            (3, 7)
        );
        let err = parse(
            "data_dir = \"d\"\ncoordinator_key = \"k\"\n[control]\nkey_rate = { operator = 0 }\n",
        )
        .expect_err("zero")
        .to_string();
        assert!(
            err.starts_with("config field control.key_rate = \"operator = 0\" is invalid"),
            "{err}"
        );
    }

    #[test]
    fn tokens_under_128_bits_are_refused_naming_the_field_and_how_to_make_one() {
        for weak in [
            "short",
            "abcdefgh",
            "0123456789abcdef",
            "service-test-token",
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "abababababababababababababababababababab",
            "0123456789abcdef0123456789abcdef",
            " 3f9c2a7e1b5d48c06a9e7f21d4c3b8a5",
        ] {
            let err = parse(&format!(
                "data_dir = \"d\"\ncoordinator_key = \"k\"\n[enrollment]\ntokens = [\"{}\", \"{weak}\"]\n",
                "3f9c2a7e1b5d48c06a9e7f21d4c3b8a5"
            ))
            .expect_err(weak)
            .to_string();
            assert!(
                err.starts_with("config field enrollment.tokens = \"(token 2 of 2)\" is invalid")
                    && err.contains("128 bits")
                    && err.contains("flotilla enrollment token")
                    && !err.contains(weak.trim()),
                "{weak}: {err}"
            );
        }
        // What the usual tools make passes: 16 random bytes in hex or base64, a UUID's 32 hex
        // digits, and what `flotilla enrollment token` makes.
        for strong in [
            "3f9c2a7e1b5d48c06a9e7f21d4c3b8a5",
            "q3Vb1y0kQ0mC2w8dXr5nRg==",
            "4e6b0d2c8f1a4b3e9d7c5a1f0e2b6d8c4a9f3e1d7b5c0a2e8f6d4b1c3a5e7f90",
        ] {
            token_strength(strong).unwrap_or_else(|e| panic!("{strong}: {e}"));
        }
    }

    #[test]
    fn relative_paths_resolve_against_the_config_file() {
        let config = parse(
            "data_dir = \"data\"\ncoordinator_key = \"keys/coordinator.key\"\n[broker]\nembedded = \"127.0.0.1:18830\"\n[actions]\nvalidity = \"12h\"\n",
        )
        .expect("valid");
        assert_eq!(config.data_dir, PathBuf::from("/etc/flotilla/data"));
        assert_eq!(
            config.coordinator_key,
            PathBuf::from("/etc/flotilla/keys/coordinator.key")
        );
        assert_eq!(
            config.broker.embedded,
            Some("127.0.0.1:18830".parse().expect("addr"))
        );
        assert_eq!(config.action_validity, 12 * 3600);
        assert_eq!(
            config.connect_to(),
            ("127.0.0.1".to_owned(), 18830),
            "connects to its embedded broker"
        );
        let abs =
            parse("data_dir = \"/var/lib/flotilla\"\ncoordinator_key = \"/k\"\n").expect("valid");
        assert_eq!(abs.data_dir, PathBuf::from("/var/lib/flotilla"));
    }

    #[test]
    fn credentials_come_from_a_file_beside_the_config_and_the_client_id_is_stable() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("broker.password"), "hunter2\n").expect("write");
        let text = "data_dir = \"d\"\ncoordinator_key = \"k\"\n[broker]\nhost = \"mqtt.example.com\"\nport = 8883\nclient_id = \"coord-eu\"\nusername = \"flotilla-coordinator\"\npassword_file = \"broker.password\"\n";
        let config =
            Config::from_toml(text, dir.path(), &dir.path().join("c.toml")).expect("valid");
        assert_eq!(config.broker.client_id, "coord-eu");
        let connection = config.connection();
        let options = connection.options(config.broker.client_id.clone());
        let login = options.credentials().expect("credentials");
        assert_eq!(login.username, "flotilla-coordinator");
        assert_eq!(login.password, "hunter2");
        assert_eq!(connection.addr(), "mqtt.example.com:8883");
        assert!(
            !format!("{config:?}").contains("hunter2"),
            "the password must not show in logs"
        );
        // The embedded broker is plain loopback: no credentials, no TLS.
        let embedded = Config::from_toml(
            &format!("{text}embedded = \"127.0.0.1:18831\"\n"),
            dir.path(),
            &dir.path().join("c.toml"),
        )
        .expect("valid");
        assert_eq!(embedded.connection().credentials, None);
        assert_eq!(embedded.connection().addr(), "127.0.0.1:18831");
    }

    #[test]
    fn overrides_replace_settings_one_by_one_and_errors_name_where_they_came_from() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("broker.password"), "hunter2\n").expect("write");
        let text = "data_dir = \"d\"\ncoordinator_key = \"k\"\n[broker]\nhost = \"file-host\"\nport = 1883\ntopic_root = \"file-root\"\nusername = \"coord\"\npassword_file = \"broker.password\"\n";
        let load = |o: &BrokerOverrides| {
            Config::from_toml_with(text, dir.path(), &dir.path().join("c.toml"), o)
        };
        let given = |value: &str, from| {
            Some(Given {
                value: value.to_owned(),
                from,
            })
        };
        let overrides = BrokerOverrides {
            addr: Some(Given {
                value: vec![("flag-host".to_owned(), 8883)],
                from: "--broker",
            }),
            topic_root: given("env-root", "FLOTILLA_TOPIC_ROOT"),
            ..BrokerOverrides::default()
        };
        let config = load(&overrides).expect("valid");
        assert_eq!(config.broker_addr(), "flag-host:8883");
        assert_eq!(config.broker.topic_root, "env-root");
        // The file's login is kept: only the address and the root were given.
        let login = config
            .broker
            .credentials
            .expect("credentials from the file");
        assert_eq!(
            (login.username.as_str(), login.password.expose()),
            ("coord", "hunter2")
        );

        let err = load(&BrokerOverrides {
            username: given("other", "FLOTILLA_BROKER_USERNAME"),
            password_file: Some(Given {
                value: PathBuf::from("/nonexistent/pw"),
                from: "--password-file",
            }),
            ..BrokerOverrides::default()
        })
        .expect_err("missing password file")
        .to_string();
        assert!(
            err.starts_with("--password-file \"/nonexistent/pw\" is invalid"),
            "{err}"
        );
        let err = load(&BrokerOverrides {
            topic_root: given("a/+", "--topic-root"),
            ..BrokerOverrides::default()
        })
        .expect_err("wildcard")
        .to_string();
        assert!(err.starts_with("--topic-root \"a/+\" is invalid"), "{err}");

        let embedded = |addr: &str| {
            Some(Given {
                value: addr.parse().expect("addr"),
                from: "--embedded-broker",
            })
        };
        let same = BrokerOverrides {
            embedded: embedded("0.0.0.0:18830"),
            insecure_embedded: Some(Given {
                value: (),
                from: "--insecure-embedded-broker",
            }),
            addr: Some(Given {
                value: vec![("localhost".to_owned(), 18830)],
                from: "FLOTILLA_BROKER",
            }),
            ..BrokerOverrides::default()
        };
        let config = load(&same).expect("the address names the embedded broker");
        assert_eq!(config.connection().credentials, None, "plain loopback");
        let other = BrokerOverrides {
            addr: Some(Given {
                value: vec![("localhost".to_owned(), 1883)],
                from: "FLOTILLA_BROKER",
            }),
            ..same
        };
        let err = load(&other).expect_err("another broker").to_string();
        assert!(
            err.starts_with("FLOTILLA_BROKER \"localhost:1883\"")
                && err.contains("--embedded-broker 0.0.0.0:18830"),
            "{err}"
        );
    }

    #[test]
    fn a_list_of_brokers_from_the_file_or_the_flag() {
        let base = "data_dir = \"d\"\ncoordinator_key = \"k\"\n[broker]\n";
        let c = parse(&format!(
            "{base}hosts = [\"a.example:8883\", \"b.example:8884\"]\n"
        ))
        .expect("a list");
        assert_eq!(
            c.connection().brokers(),
            [
                ("a.example".to_owned(), 8883),
                ("b.example".to_owned(), 8884)
            ]
        );
        assert_eq!(c.connection().order, BrokerOrder::InOrder);
        assert_eq!(c.broker_addr(), "a.example:8883");
        let err = parse(&format!("{base}hosts = [\"a.example\"]\n"))
            .expect_err("no port")
            .to_string();
        assert!(
            err.contains("broker.hosts") && err.contains("HOST:PORT"),
            "{err}"
        );
        // A flag's list replaces the file's.
        let dir = tempfile::tempdir().expect("tempdir");
        let flagged = Config::from_toml_with(
            &format!("{base}hosts = [\"a.example:8883\"]\n"),
            dir.path(),
            &dir.path().join("c.toml"),
            &BrokerOverrides {
                addr: Some(Given {
                    value: vec![
                        ("x.example".to_owned(), 1883),
                        ("y.example".to_owned(), 1883),
                    ],
                    from: "--broker",
                }),
                ..BrokerOverrides::default()
            },
        )
        .expect("flag");
        assert_eq!(
            flagged.connection().brokers(),
            [
                ("x.example".to_owned(), 1883),
                ("y.example".to_owned(), 1883)
            ]
        );
    }

    #[test]
    fn an_embedded_broker_beyond_loopback_needs_the_insecure_setting() {
        let dir = tempfile::tempdir().expect("tempdir");
        let head = "data_dir = \"d\"\ncoordinator_key = \"k\"\n[broker]\n";
        let load = |text: &str, o: &BrokerOverrides| {
            Config::from_toml_with(text, dir.path(), &dir.path().join("c.toml"), o)
        };
        for addr in ["127.0.0.1:18830", "[::1]:18830", "127.0.0.2:18830"] {
            load(
                &format!("{head}embedded = \"{addr}\"\n"),
                &BrokerOverrides::default(),
            )
            .unwrap_or_else(|e| panic!("{addr} is loopback: {e}"));
        }
        for addr in ["0.0.0.0:18830", "[::]:18830", "192.168.1.5:18830"] {
            let text = format!("{head}embedded = \"{addr}\"\n");
            let err = load(&text, &BrokerOverrides::default())
                .expect_err("beyond loopback")
                .to_string();
            assert!(
                err.starts_with(&format!(
                    "config field broker.embedded = \"{addr}\" is invalid"
                )) && err.contains("no login, no TLS and no ACL")
                    && err.contains("broker.insecure_embedded = true"),
                "{err}"
            );
            load(
                &format!("{text}insecure_embedded = true\n"),
                &BrokerOverrides::default(),
            )
            .expect("insisted on in the config file");
        }
        let flag = BrokerOverrides {
            embedded: Some(Given {
                value: "0.0.0.0:18830".parse().expect("addr"),
                from: "--embedded-broker",
            }),
            ..BrokerOverrides::default()
        };
        let err = load(head, &flag).expect_err("beyond loopback").to_string();
        assert!(
            err.starts_with("--embedded-broker \"0.0.0.0:18830\" is invalid")
                && err.contains("--insecure-embedded-broker"),
            "{err}"
        );
        let insisted = BrokerOverrides {
            insecure_embedded: Some(Given {
                value: (),
                from: "--insecure-embedded-broker",
            }),
            ..flag
        };
        let config = load(head, &insisted).expect("insisted on with the flag");
        assert_eq!(
            config.broker.embedded,
            Some("0.0.0.0:18830".parse().expect("addr"))
        );
    }

    #[test]
    fn errors_name_the_field_and_value() {
        let cases = [
            (
                "data_dir = \"d\"\ncoordinator_key = \"k\"\n[broker]\nembedded = \"nowhere\"\n",
                "broker.embedded",
                "nowhere",
            ),
            (
                "data_dir = \"d\"\ncoordinator_key = \"k\"\n[actions]\nvalidity = \"7w\"\n",
                "actions.validity",
                "7w",
            ),
            (
                "data_dir = \"d\"\ncoordinator_key = \"k\"\n[broker]\ntopic_root = \"a/#\"\n",
                "broker.topic_root",
                "a/#",
            ),
            ("data_dir = \"\"\ncoordinator_key = \"k\"\n", "data_dir", ""),
            (
                "data_dir = \"d\"\ncoordinator_key = \"k\"\n[broker]\nclient_id = \"a/b\"\n",
                "broker.client_id",
                "a/b",
            ),
            (
                "data_dir = \"d\"\ncoordinator_key = \"k\"\n[broker]\nusername = \"u\"\npassword_file = \"no-such-file\"\n",
                "broker.password_file",
                "/etc/flotilla/no-such-file",
            ),
            (
                "data_dir = \"d\"\ncoordinator_key = \"k\"\n[broker.tls]\nca_file = \"tls/missing.crt\"\n",
                "broker.tls.ca_file",
                "/etc/flotilla/tls/missing.crt",
            ),
        ];
        for (text, field, value) in cases {
            let err = parse(text).expect_err(field).to_string();
            assert!(
                err.contains(field) && err.contains(&format!("{value:?}")),
                "{err}"
            );
        }
        let err =
            parse("data_dir = \"d\"\ncoordinator_key = \"k\"\ncolour = 1\n").expect_err("unknown");
        assert!(err.to_string().contains("colour"), "{err}");
        let key = "8a88e3dd7409f195fd52db2d3cba5d72ca6709bf1d94121bf3748801b40f6f5c";
        let cases = [
            (
                format!("[[operators]]\nname = \"a/b\"\nrole = \"admin\"\nkey = \"{key}\"\n"),
                "operators.name",
                "a/b",
            ),
            (
                format!("[[operators]]\nname = \"alice\"\nrole = \"root\"\nkey = \"{key}\"\n"),
                "operators.role",
                "root",
            ),
            (
                "[[operators]]\nname = \"alice\"\nrole = \"admin\"\nkey = \"zz\"\n".to_owned(),
                "operators.key",
                "zz",
            ),
            (
                "[control]\nclock_window = \"0s\"\n".to_owned(),
                "control.clock_window",
                "0s",
            ),
            (
                format!("[[operators]]\nname = \"a\"\nrole = \"admin\"\nkey = \"{key}\"\n[[operators]]\nname = \"b\"\nrole = \"viewer\"\nkey = \"{key}\"\n"),
                "operators.key",
                key,
            ),
        ];
        for (tail, field, value) in cases {
            let text = format!("data_dir = \"d\"\ncoordinator_key = \"k\"\n{tail}");
            let err = parse(&text).expect_err(field).to_string();
            assert!(
                err.contains(field) && err.contains(&format!("{value:?}")),
                "{err}"
            );
        }
        let ok = parse(&format!(
            "data_dir = \"d\"\ncoordinator_key = \"k\"\n[control]\nclock_window = \"2m\"\n[[operators]]\nname = \"alice\"\nrole = \"operator\"\nkey = \"{key}\"\n"
        ))
        .expect("valid");
        assert_eq!(ok.clock_window, 120);
        assert_eq!(ok.operators[0].name, "alice");
        assert_eq!(ok.operators[0].role, Role::Operator);

        // key_file resolves against the config file's directory, like every path.
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("bob.pub"), format!("{key}\n")).expect("write");
        let text = "data_dir = \"d\"\ncoordinator_key = \"k\"\n[[operators]]\nname = \"bob\"\nrole = \"viewer\"\nkey_file = \"bob.pub\"\n";
        let from_file =
            Config::from_toml(text, dir.path(), &dir.path().join("c.toml")).expect("valid");
        assert_eq!(from_file.operators[0].key, ok.operators[0].key);
        let missing = text.replace("bob.pub", "nobody.pub");
        let file_err = Config::from_toml(&missing, dir.path(), &dir.path().join("c.toml"))
            .expect_err("missing file")
            .to_string();
        assert!(
            file_err.contains("operators.key_file") && file_err.contains("nobody.pub"),
            "{file_err}"
        );
        let both = format!("{text}key = \"{key}\"\n");
        let both_err = Config::from_toml(&both, dir.path(), &dir.path().join("c.toml"))
            .expect_err("both")
            .to_string();
        assert!(both_err.contains("exactly one of key"), "{both_err}");
        let err = parse("coordinator_key = \"k\"\n").expect_err("missing");
        assert!(err.to_string().contains("data_dir"), "{err}");
    }
}
