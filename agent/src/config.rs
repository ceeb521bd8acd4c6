//! The agent's configuration: a TOML file parsed into raw serde structs, then validated into
//! [`Config`] through `TryFrom`, so that everything past this module can rely on valid values.
//!
//! Validation errors name the field and the value (`health.check[0].command: must not be
//! empty`), because the person reading them is editing a file on a device over a slow shell.
//! The commented default configuration is embedded ([`DEFAULT_CONFIG`]) and printable with
//! `flotilla-agent print-default-config`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use flotilla_mqtt::https::OriginTls;
use flotilla_mqtt::{BrokerOrder, Connection, ConnectionSpec, Credentials, RawTls, Tls};
use flotilla_protocol::{signing, DeviceId, VerifyingKey};
use flotilla_targets::{AbConfig, MenderModuleConfig, RaucConfig, ScriptConfig, SwupdateConfig};
use serde::Deserialize;

mod targets;
use targets::{target_kind, RawTarget};

/// The commented default configuration.
pub const DEFAULT_CONFIG: &str = include_str!("../default-config.toml");

/// Largest block the artifact server hands out (protocol `MAX_BLOCK`, 64 KiB).
pub const MAX_BLOCK_SIZE: u32 = 64 * 1024;

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config is not valid TOML: {0}")]
    Toml(#[from] toml::de::Error),
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub device_id: DeviceId,
    pub hardware_id: String,
    pub data_dir: PathBuf,
    /// A one-time enrollment token the coordinator lists: the first state signed with this
    /// device's key carries a proof of it and is accepted without an operator.
    pub enrollment_token: Option<String>,
    pub broker: BrokerConfig,
    /// Sorted by key, as published in the device state.
    pub labels: Vec<(String, String)>,
    pub trust: TrustConfig,
    pub targets: Vec<TargetConfig>,
    pub health: HealthConfig,
    pub download: DownloadConfig,
    pub store: StoreConfig,
    pub peers: PeersConfig,
    pub origins: OriginsConfig,
}

#[derive(Debug, Clone)]
pub struct BrokerConfig {
    /// The first broker (`host` and `port`, or the first of `hosts`).
    pub host: String,
    pub port: u16,
    /// The rest of `hosts`: brokers of the same cluster, tried in turn from one picked by the
    /// device id when the one in use cannot be reached (decision 0057).
    pub alternates: Vec<(String, u16)>,
    pub topic_root: String,
    pub keep_alive: Duration,
    /// How often the agent sends its state again unprompted (`state_refresh`, 15 minutes by
    /// default; `None` is "0s", never): a state a broker lost or garbled is back within it
    /// (decision 0072). Each device stretches it by a factor of its own (`refresh.rs`).
    pub state_refresh: Option<Duration>,
    /// Username (the device id, for the shipped ACL) and the password read at load time.
    pub credentials: Option<Credentials>,
    /// TLS; `None` is plain TCP.
    pub tls: Option<Tls>,
}

impl BrokerConfig {
    /// How the link reaches the broker. The MQTT client id is the device id.
    pub fn connection(&self) -> Connection {
        Connection {
            host: self.host.clone(),
            port: self.port,
            alternates: self.alternates.clone(),
            order: BrokerOrder::SpreadById,
            credentials: self.credentials.clone(),
            tls: self.tls.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct TrustConfig {
    pub release_keys: Vec<VerifyingKey>,
    pub coordinator_keys: Vec<VerifyingKey>,
    /// Keys that sign keys documents (key rotation); empty disables rotation.
    pub root_keys: Vec<VerifyingKey>,
    /// Root signatures a keys document needs.
    pub root_threshold: u32,
    /// How far ahead of this device's clock an action may be issued, in seconds; `None`: no
    /// bound (for devices without a trustworthy clock). Trusted time never runs further ahead.
    pub max_clock_skew: Option<u64>,
}

/// The kinds of update target the agent can build from configuration, with their settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetKind {
    /// `kind = "file"`: replace one file or directory atomically.
    File { path: PathBuf },
    /// `kind = "ab"`: an A/B slot pair switched through a boot-control backend.
    Ab(AbConfig),
    /// `kind = "script"`: a user's executable with the fixed subcommands.
    Script(ScriptConfig),
    /// `kind = "mender-module"`: an unchanged Mender update module.
    MenderModule(MenderModuleConfig),
    /// `kind = "swupdate"`: a `.swu` image installed with `swupdate -i` or through a running
    /// SWUpdate daemon's socket.
    Swupdate(SwupdateConfig),
    /// `kind = "rauc"`: a RAUC bundle installed through RAUC's service.
    Rauc(RaucConfig),
}

#[derive(Debug, Clone)]
pub struct TargetConfig {
    pub name: String,
    pub kind: TargetKind,
}

#[derive(Debug, Clone)]
pub struct HealthConfig {
    pub soak: Duration,
    pub interval: Duration,
    pub checks: Vec<HealthCheck>,
}

#[derive(Debug, Clone)]
pub struct HealthCheck {
    pub name: String,
    /// Program and arguments; never empty.
    pub command: Vec<String>,
    pub timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct DownloadConfig {
    pub block_size: u32,
    pub in_flight: usize,
    /// 0 means unlimited.
    pub max_bytes_per_sec: u64,
    /// A peer that leaves a block unanswered this long is bypassed for the action.
    pub peer_timeout: Duration,
    /// A peer whose blocks take longer than this on average (its `Unavailable` answers
    /// included), over its last 8, is bypassed for the action as slow. More than 0.
    pub peer_slow_block: Duration,
    /// Peers that deliver no block for this long are left: the rest comes from the coordinator.
    pub peer_fallback_after: Duration,
}

/// Serving verified blocks to the peers of the device's site (`[peers]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeersConfig {
    /// Answer peer block requests at all.
    pub serve: bool,
    /// Peer requests handled at once; 16 per slot more wait, and any beyond are dropped.
    pub max_concurrent: usize,
    /// Bytes a second sent to peers, all together; 0 means unlimited.
    pub max_bytes_per_sec: u64,
    /// Verified downloads kept after an action ends (to serve and to copy blocks from), newest
    /// first; older ones are removed.
    pub keep_bytes: u64,
}

impl Default for PeersConfig {
    fn default() -> Self {
        Self {
            serve: true,
            max_concurrent: default_peer_concurrency(),
            max_bytes_per_sec: 0,
            keep_bytes: default_keep_bytes(),
        }
    }
}

/// HTTP(S) origins a release names for its artifacts (`[origins]`, decision 0064).
#[derive(Debug, Clone, Default)]
pub struct OriginsConfig {
    /// A PEM file of the private CA an HTTPS origin's certificate may chain to, trusted beside
    /// the system's roots.
    pub ca_file: Option<PathBuf>,
    /// The certificates an HTTPS origin's must chain to, built from `ca_file` at load time.
    pub tls: OriginTls,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub cache_bytes: u64,
    /// Restarts that find one action in the same unfinished state before the agent gives it up.
    pub max_restarts: u32,
}

impl Config {
    /// Parses and validates TOML text.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig = toml::from_str(text)?;
        raw.try_into()
    }

    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text)
    }

    /// The target configured under `name`.
    pub fn target(&self, name: &str) -> Option<&TargetConfig> {
        self.targets.iter().find(|t| t.name == name)
    }
}

// ---- raw serde structs: exactly what the file says ----

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    device_id: String,
    hardware_id: String,
    data_dir: PathBuf,
    #[serde(default)]
    enrollment_token: Option<String>,
    broker: RawBroker,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    trust: RawTrust,
    #[serde(default)]
    target: Vec<RawTarget>,
    #[serde(default)]
    health: RawHealth,
    #[serde(default)]
    download: RawDownload,
    #[serde(default)]
    store: RawStore,
    #[serde(default)]
    peers: RawPeers,
    #[serde(default)]
    origins: RawOrigins,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBroker {
    #[serde(default)]
    host: String,
    #[serde(default = "default_port")]
    port: u16,
    /// Several brokers of one cluster, `HOST:PORT` each, instead of `host` and `port`.
    #[serde(default)]
    hosts: Vec<String>,
    #[serde(default = "default_root")]
    topic_root: String,
    #[serde(default = "default_keep_alive")]
    keep_alive: String,
    #[serde(default = "default_state_refresh")]
    state_refresh: String,
    username: Option<String>,
    password_file: Option<PathBuf>,
    password_env: Option<String>,
    tls: Option<RawTls>,
}

fn default_port() -> u16 {
    1883
}
fn default_root() -> String {
    flotilla_protocol::topics::DEFAULT_ROOT.to_owned()
}
fn default_keep_alive() -> String {
    "30s".to_owned()
}
fn default_state_refresh() -> String {
    "15m".to_owned()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrust {
    release_keys: Vec<String>,
    coordinator_keys: Vec<String>,
    #[serde(default)]
    root_keys: Vec<String>,
    #[serde(default = "default_root_threshold")]
    root_threshold: u32,
    #[serde(default = "default_max_clock_skew")]
    max_clock_skew: String,
}

fn default_root_threshold() -> u32 {
    2
}

fn default_max_clock_skew() -> String {
    "1h".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHealth {
    #[serde(default = "default_soak")]
    soak: String,
    #[serde(default = "default_interval")]
    interval: String,
    #[serde(default)]
    check: Vec<RawCheck>,
}

impl Default for RawHealth {
    fn default() -> Self {
        Self {
            soak: default_soak(),
            interval: default_interval(),
            check: Vec::new(),
        }
    }
}

fn default_soak() -> String {
    "10s".to_owned()
}
fn default_interval() -> String {
    "2s".to_owned()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCheck {
    name: String,
    command: Vec<String>,
    #[serde(default = "default_check_timeout")]
    timeout: String,
}

fn default_check_timeout() -> String {
    "5s".to_owned()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDownload {
    #[serde(default = "default_block_size")]
    block_size: u32,
    #[serde(default = "default_in_flight")]
    in_flight: usize,
    #[serde(default)]
    max_bytes_per_sec: u64,
    #[serde(default = "default_peer_timeout")]
    peer_timeout: String,
    #[serde(default = "default_peer_slow_block")]
    peer_slow_block: String,
    #[serde(default = "default_peer_fallback_after")]
    peer_fallback_after: String,
}

impl Default for RawDownload {
    fn default() -> Self {
        Self {
            block_size: default_block_size(),
            in_flight: default_in_flight(),
            max_bytes_per_sec: 0,
            peer_timeout: default_peer_timeout(),
            peer_slow_block: default_peer_slow_block(),
            peer_fallback_after: default_peer_fallback_after(),
        }
    }
}

fn default_peer_timeout() -> String {
    "3s".into()
}
fn default_peer_slow_block() -> String {
    "1s".into()
}
fn default_peer_fallback_after() -> String {
    "30s".into()
}

fn default_block_size() -> u32 {
    MAX_BLOCK_SIZE
}
fn default_in_flight() -> usize {
    4
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOrigins {
    ca_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStore {
    #[serde(default = "default_cache")]
    cache_bytes: u64,
    #[serde(default = "default_max_restarts")]
    max_restarts: u32,
}

impl Default for RawStore {
    fn default() -> Self {
        Self {
            cache_bytes: default_cache(),
            max_restarts: default_max_restarts(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPeers {
    #[serde(default = "default_serve")]
    serve: bool,
    #[serde(default = "default_peer_concurrency")]
    max_concurrent: usize,
    #[serde(default)]
    max_bytes_per_sec: u64,
    #[serde(default = "default_keep_bytes")]
    keep_bytes: u64,
}

impl Default for RawPeers {
    fn default() -> Self {
        let d = PeersConfig::default();
        Self {
            serve: d.serve,
            max_concurrent: d.max_concurrent,
            max_bytes_per_sec: d.max_bytes_per_sec,
            keep_bytes: d.keep_bytes,
        }
    }
}

fn default_serve() -> bool {
    true
}
fn default_peer_concurrency() -> usize {
    4
}
fn default_keep_bytes() -> u64 {
    1 << 30
}

/// The most peer requests a device handles at once.
pub const MAX_PEER_CONCURRENCY: usize = 64;

fn default_max_restarts() -> u32 {
    5
}

fn default_cache() -> u64 {
    1024 * 1024
}

impl TryFrom<RawConfig> for Config {
    type Error = ConfigError;

    fn try_from(raw: RawConfig) -> Result<Self, ConfigError> {
        let device_id = DeviceId::new(raw.device_id.clone())
            .map_err(|e| invalid("device_id", format!("{:?}: {e}", raw.device_id)))?;
        if raw.hardware_id.trim().is_empty() {
            return Err(invalid("hardware_id", "must not be empty"));
        }
        if raw.data_dir.as_os_str().is_empty() {
            return Err(invalid("data_dir", "must not be empty"));
        }
        if let Some(token) = &raw.enrollment_token {
            if token.trim().is_empty() {
                return Err(invalid(
                    "enrollment_token",
                    "must not be empty (leave it out to enroll through an operator)",
                ));
            }
        }

        let mut brokers = Vec::new();
        for text in &raw.broker.hosts {
            brokers.push(
                flotilla_mqtt::parse_host_port(text).map_err(|e| invalid("broker.hosts", e))?,
            );
        }
        match (raw.broker.host.trim().is_empty(), brokers.is_empty()) {
            (true, true) => {
                return Err(invalid(
                    "broker.host",
                    "must not be empty (or list the brokers of a cluster in broker.hosts)",
                ))
            }
            (false, false) => {
                return Err(invalid(
                    "broker.hosts",
                    "set either broker.host (and port) or broker.hosts, not both",
                ))
            }
            (false, true) => brokers.push((raw.broker.host.clone(), raw.broker.port)),
            (true, false) => {}
        }
        if raw.broker.port == 0 {
            return Err(invalid("broker.port", "0 is not a port"));
        }
        let (host, port) = brokers.remove(0);
        let alternates = brokers;
        // Relative paths resolve against the working directory, like data_dir.
        let connection = ConnectionSpec {
            host: host.clone(),
            port,
            alternates: alternates.clone(),
            order: BrokerOrder::SpreadById,
            username: raw.broker.username.clone(),
            password_file: raw.broker.password_file.clone(),
            password_env: raw.broker.password_env.clone(),
            tls: raw.broker.tls.clone(),
        }
        .validate(Path::new(""), &|name| std::env::var(name).ok())
        .map_err(|e| {
            invalid(
                format!("broker.{}", e.field),
                format!("{:?}: {}", e.value, e.reason),
            )
        })?;
        let root = raw.broker.topic_root.trim_end_matches('/');
        if root.is_empty() || root.contains(['+', '#']) {
            return Err(invalid(
                "broker.topic_root",
                format!(
                    "{:?}: must be non-empty and contain no '+' or '#'",
                    raw.broker.topic_root
                ),
            ));
        }
        let broker = BrokerConfig {
            host,
            port,
            alternates,
            topic_root: raw.broker.topic_root.clone(),
            keep_alive: parse_duration("broker.keep_alive", &raw.broker.keep_alive)?,
            state_refresh: Some(parse_duration(
                "broker.state_refresh",
                &raw.broker.state_refresh,
            )?)
            .filter(|every| !every.is_zero()),
            credentials: connection.credentials,
            tls: connection.tls,
        };
        if broker.keep_alive < Duration::from_secs(1) {
            return Err(invalid(
                "broker.keep_alive",
                format!("{:?}: must be at least 1s", raw.broker.keep_alive),
            ));
        }
        if broker
            .state_refresh
            .is_some_and(|every| every < Duration::from_secs(1))
        {
            return Err(invalid(
                "broker.state_refresh",
                format!(
                    "{:?}: must be at least 1s, or \"0s\" to never send the state unprompted",
                    raw.broker.state_refresh
                ),
            ));
        }

        for (key, value) in &raw.labels {
            if key.is_empty() {
                return Err(invalid(
                    "labels",
                    format!("label with value {value:?} has an empty key"),
                ));
            }
        }

        let root_keys = if raw.trust.root_keys.is_empty() {
            Vec::new()
        } else {
            parse_keys("trust.root_keys", &raw.trust.root_keys)?
        };
        let root_threshold = raw.trust.root_threshold;
        if !root_keys.is_empty()
            && (root_threshold == 0 || root_threshold as usize > root_keys.len())
        {
            return Err(invalid(
                "trust.root_threshold",
                format!(
                    "{root_threshold} is not between 1 and the {} root keys",
                    root_keys.len()
                ),
            ));
        }
        let max_clock_skew = match raw.trust.max_clock_skew.trim() {
            "off" => None,
            text => {
                let skew = parse_duration("trust.max_clock_skew", text)?;
                if skew < Duration::from_secs(60) {
                    return Err(invalid(
                        "trust.max_clock_skew",
                        format!("{text:?} is under a minute; use at least 1m, or \"off\""),
                    ));
                }
                Some(skew.as_secs())
            }
        };
        let trust = TrustConfig {
            release_keys: parse_keys("trust.release_keys", &raw.trust.release_keys)?,
            coordinator_keys: parse_keys("trust.coordinator_keys", &raw.trust.coordinator_keys)?,
            root_keys,
            root_threshold,
            max_clock_skew,
        };

        let mut targets: Vec<TargetConfig> = Vec::new();
        for (i, t) in raw.target.into_iter().enumerate() {
            let field = |f: &str| format!("target[{i}].{f}");
            if t.name.trim().is_empty() {
                return Err(invalid(field("name"), "must not be empty"));
            }
            // The name becomes a directory name (the default state directory of the target).
            if t.name.starts_with('.')
                || !t
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
            {
                return Err(invalid(
                    field("name"),
                    format!(
                        "{:?}: use letters, digits, '.', '_' and '-', not starting with '.'",
                        t.name
                    ),
                ));
            }
            if targets.iter().any(|o| o.name == t.name) {
                return Err(invalid(
                    field("name"),
                    format!("{:?} is configured twice", t.name),
                ));
            }
            let kind = target_kind(&t, &raw.data_dir, &field)?;
            targets.push(TargetConfig { name: t.name, kind });
        }

        let mut checks = Vec::new();
        for (i, c) in raw.health.check.into_iter().enumerate() {
            let field = |f: &str| format!("health.check[{i}].{f}");
            if c.name.trim().is_empty() {
                return Err(invalid(field("name"), "must not be empty"));
            }
            if c.command.is_empty() || c.command[0].is_empty() {
                return Err(invalid(field("command"), "must not be empty"));
            }
            let timeout = parse_duration(&field("timeout"), &c.timeout)?;
            if timeout.is_zero() {
                return Err(invalid(
                    field("timeout"),
                    format!("{:?}: must be more than 0", c.timeout),
                ));
            }
            checks.push(HealthCheck {
                name: c.name,
                command: c.command,
                timeout,
            });
        }
        let health = HealthConfig {
            soak: parse_duration("health.soak", &raw.health.soak)?,
            interval: parse_duration("health.interval", &raw.health.interval)?,
            checks,
        };
        if health.interval.is_zero() {
            return Err(invalid(
                "health.interval",
                format!("{:?}: must be more than 0", raw.health.interval),
            ));
        }

        let d = raw.download;
        if d.block_size == 0 || d.block_size > MAX_BLOCK_SIZE {
            return Err(invalid(
                "download.block_size",
                format!("{}: must be between 1 and {MAX_BLOCK_SIZE}", d.block_size),
            ));
        }
        if d.in_flight == 0 || d.in_flight > 64 {
            return Err(invalid(
                "download.in_flight",
                format!("{}: must be between 1 and 64", d.in_flight),
            ));
        }
        let peer_slow_block = parse_duration("download.peer_slow_block", &d.peer_slow_block)?;
        if peer_slow_block.is_zero() {
            return Err(invalid(
                "download.peer_slow_block",
                format!(
                    "{:?}: must be more than 0 (a larger value tolerates slower peers)",
                    d.peer_slow_block
                ),
            ));
        }
        if raw.store.cache_bytes < 64 * 1024 {
            return Err(invalid(
                "store.cache_bytes",
                format!("{}: must be at least 65536", raw.store.cache_bytes),
            ));
        }

        if raw.store.max_restarts == 0 {
            return Err(invalid("store.max_restarts", "0: must be at least 1"));
        }

        let p = raw.peers;
        if p.max_concurrent == 0 || p.max_concurrent > MAX_PEER_CONCURRENCY {
            return Err(invalid(
                "peers.max_concurrent",
                format!(
                    "{}: must be between 1 and {MAX_PEER_CONCURRENCY}",
                    p.max_concurrent
                ),
            ));
        }
        if p.max_bytes_per_sec != 0 && p.max_bytes_per_sec < u64::from(MAX_BLOCK_SIZE) {
            return Err(invalid(
                "peers.max_bytes_per_sec",
                format!(
                    "{}: must be 0 (unlimited) or at least {MAX_BLOCK_SIZE}, one block a second",
                    p.max_bytes_per_sec
                ),
            ));
        }

        // Relative paths resolve against the working directory, like data_dir.
        let origins = match raw.origins.ca_file {
            None => OriginsConfig::default(),
            Some(path) => OriginsConfig {
                tls: OriginTls::with_ca_file(&path)
                    .map_err(|e| invalid("origins.ca_file", e.to_string()))?,
                ca_file: Some(path),
            },
        };

        Ok(Config {
            device_id,
            hardware_id: raw.hardware_id,
            data_dir: raw.data_dir,
            enrollment_token: raw.enrollment_token,
            broker,
            labels: raw.labels.into_iter().collect(),
            trust,
            targets,
            health,
            download: DownloadConfig {
                block_size: d.block_size,
                in_flight: d.in_flight,
                max_bytes_per_sec: d.max_bytes_per_sec,
                peer_timeout: parse_duration("download.peer_timeout", &d.peer_timeout)?,
                peer_slow_block,
                peer_fallback_after: parse_duration(
                    "download.peer_fallback_after",
                    &d.peer_fallback_after,
                )?,
            },
            store: StoreConfig {
                cache_bytes: raw.store.cache_bytes,
                max_restarts: raw.store.max_restarts,
            },
            peers: PeersConfig {
                serve: p.serve,
                max_concurrent: p.max_concurrent,
                max_bytes_per_sec: p.max_bytes_per_sec,
                keep_bytes: p.keep_bytes,
            },
            origins,
        })
    }
}

fn parse_keys(field: &str, keys: &[String]) -> Result<Vec<VerifyingKey>, ConfigError> {
    if keys.is_empty() {
        return Err(invalid(field, "needs at least one key"));
    }
    keys.iter()
        .enumerate()
        .map(|(i, k)| {
            signing::public_key_from_text(k)
                .map_err(|e| invalid(format!("{field}[{i}]"), format!("{k:?}: {e}")))
        })
        .collect()
}

/// Parses `500ms`, `10s`, `5m`, `1h` (a whole number and a unit), or a compound of them such
/// as `1h30m` or `1s500ms` (the parts are added up). `field` names it in errors.
pub fn parse_duration(field: &str, text: &str) -> Result<Duration, ConfigError> {
    let bad = || {
        invalid(
            field,
            format!(
                "{text:?}: expected a duration like \"500ms\", \"10s\", \"5m\", \"1h\" or \"1h30m\""
            ),
        )
    };
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(bad());
    }
    let mut millis: u64 = 0;
    while !rest.is_empty() {
        let split = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(split);
        let unit_len = after
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(after.len());
        let (unit, next) = after.split_at(unit_len);
        let n: u64 = number.parse().map_err(|_| bad())?;
        let part = match unit {
            "ms" => Some(n),
            "s" => n.checked_mul(1_000),
            "m" => n.checked_mul(60_000),
            "h" => n.checked_mul(3_600_000),
            _ => return Err(bad()),
        };
        millis = part
            .and_then(|part| millis.checked_add(part))
            .ok_or_else(bad)?;
        rest = next;
    }
    Ok(Duration::from_millis(millis))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_targets::{BootControlKind, ScriptTimeouts};

    fn with(replace: &str, by: &str) -> Result<Config, ConfigError> {
        assert!(
            DEFAULT_CONFIG.contains(replace),
            "default config has {replace:?}"
        );
        Config::from_toml(&DEFAULT_CONFIG.replacen(replace, by, 1))
    }

    fn err(replace: &str, by: &str) -> String {
        with(replace, by).expect_err("must be refused").to_string()
    }

    #[test]
    fn peers_settings_are_read_and_checked_naming_the_field() {
        let c = Config::from_toml(DEFAULT_CONFIG).expect("default config parses");
        assert_eq!(c.peers, PeersConfig::default());
        assert!(c.peers.serve, "serving is on unless turned off");
        let c = Config::from_toml(include_str!("../example-config.toml")).expect("example");
        assert_eq!(c.peers.max_concurrent, 2);
        assert_eq!(c.peers.max_bytes_per_sec, 4 << 20);
        assert_eq!(c.peers.keep_bytes, 512 << 20);
        let c = with("serve = true", "serve = false").expect("valid");
        assert!(!c.peers.serve);

        let e = err("max_concurrent = 4", "max_concurrent = 0");
        assert!(
            e.starts_with("peers.max_concurrent: 0: must be between 1 and 64"),
            "{e}"
        );
        let e = err("max_concurrent = 4", "max_concurrent = 65");
        assert!(e.starts_with("peers.max_concurrent: 65"), "{e}");
        let e = err(
            "at least 65536.\nmax_bytes_per_sec = 0",
            "at least 65536.\nmax_bytes_per_sec = 1000",
        );
        assert!(e.starts_with("peers.max_bytes_per_sec: 1000"), "{e}");
        let e = err("keep_bytes = 1073741824", "keep_bytes = -1");
        assert!(e.contains("keep_bytes"), "{e}");
        let e = err("[peers]", "[peers]\nserv = true");
        assert!(e.contains("serv"), "{e}");
    }

    #[test]
    fn an_origin_ca_file_is_read_at_load_and_a_bad_one_is_refused_naming_it() {
        let c = Config::from_toml(DEFAULT_CONFIG).expect("default config parses");
        assert_eq!(
            c.origins.ca_file, None,
            "the system's roots alone by default"
        );

        let dir = tempfile::tempdir().expect("tempdir");
        let origins = |path: &Path| format!("[origins]\nca_file = {:?}", path);
        let missing = dir.path().join("missing.pem");
        let e = err("[origins]", &origins(&missing));
        assert!(
            e.starts_with(&format!(
                "origins.ca_file: {}: cannot read",
                missing.display()
            )),
            "{e}"
        );
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not a certificate\n").expect("write");
        let e = err("[origins]", &origins(&junk));
        assert!(
            e.starts_with(&format!(
                "origins.ca_file: {}: holds no PEM",
                junk.display()
            )),
            "{e}"
        );

        // A CA made as an operator would, with the shipped script (openssl must be installed).
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/mosquitto/make-certs.sh");
        let out = std::process::Command::new("sh")
            .arg(&script)
            .arg(dir.path().join("ca"))
            .arg("ca")
            .output()
            .expect("run make-certs.sh");
        assert!(out.status.success(), "make-certs.sh: {out:?}");
        let ca = dir.path().join("ca/ca.crt");
        let c = with("[origins]", &origins(&ca)).expect("a readable CA");
        assert_eq!(c.origins.ca_file, Some(ca));
    }

    #[test]
    fn default_config_is_valid() {
        let c = Config::from_toml(DEFAULT_CONFIG).expect("default config parses");
        assert_eq!(c.device_id.as_str(), "dev-1");
        assert_eq!(c.broker.keep_alive, Duration::from_secs(30));
        assert_eq!(c.health.checks[0].name, "app-runs");
        assert_eq!(
            c.target("app").map(|t| t.kind.clone()),
            Some(TargetKind::File {
                path: PathBuf::from("/opt/app/app.bin")
            })
        );
        assert_eq!(c.labels, vec![("env".to_owned(), "prod".to_owned())]);
    }

    #[test]
    fn the_state_is_sent_again_every_fifteen_minutes_unless_set_and_zero_turns_it_off() {
        let c = Config::from_toml(DEFAULT_CONFIG).expect("default config parses");
        assert_eq!(c.broker.state_refresh, Some(Duration::from_secs(15 * 60)));
        let keep = "state_refresh = \"15m\"\n";
        let c = with(keep, "state_refresh = \"2m\"\n").expect("2m");
        assert_eq!(c.broker.state_refresh, Some(Duration::from_secs(120)));
        let c = with(keep, "state_refresh = \"0s\"\n").expect("off");
        assert_eq!(c.broker.state_refresh, None);
        let e = err(keep, "state_refresh = \"500ms\"\n");
        assert!(
            e.starts_with("broker.state_refresh") && e.contains("at least 1s"),
            "{e}"
        );
        let e = err(keep, "state_refresh = \"often\"\n");
        assert!(e.starts_with("broker.state_refresh"), "{e}");
    }

    #[test]
    fn a_list_of_brokers_replaces_host_and_port_and_errors_name_the_field() {
        let hosts = "host = \"127.0.0.1\"\nport = 1883\n";
        let c = with(
            hosts,
            "hosts = [\"mqtt-1.example:8883\", \"[::1]:1883\", \"mqtt-3.example:8883\"]\n",
        )
        .expect("a list");
        assert_eq!(
            (c.broker.host.as_str(), c.broker.port),
            ("mqtt-1.example", 8883)
        );
        let connection = c.broker.connection();
        assert_eq!(
            connection.brokers(),
            [
                ("mqtt-1.example".to_owned(), 8883),
                ("::1".to_owned(), 1883),
                ("mqtt-3.example".to_owned(), 8883)
            ]
        );
        assert_eq!(connection.order, BrokerOrder::SpreadById);
        assert_eq!(
            connection.describe(),
            "mqtt://mqtt-1.example:8883,[::1]:1883,mqtt-3.example:8883"
        );
        let e = err(hosts, "hosts = [\"mqtt-1.example\"]\n");
        assert!(e.contains("broker.hosts") && e.contains("HOST:PORT"), "{e}");
        let e = err(hosts, "host = \"a\"\nhosts = [\"b:1883\"]\n");
        assert!(e.contains("either broker.host"), "{e}");
        let e = err(hosts, "hosts = []\n");
        assert!(
            e.contains("broker.host") && e.contains("broker.hosts"),
            "{e}"
        );
    }

    #[test]
    fn broker_credentials_and_tls_are_read_at_load_and_errors_name_the_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pw = dir.path().join("broker.password");
        std::fs::write(&pw, "device-secret\n").expect("write");
        let c = with(
            "keep_alive = \"30s\"\n",
            &format!("keep_alive = \"30s\"\nusername = \"dev-1\"\npassword_file = {pw:?}\n"),
        )
        .expect("valid");
        let login = c
            .broker
            .connection()
            .options("dev-1")
            .credentials()
            .expect("login");
        assert_eq!(
            (login.username.as_str(), login.password.as_str()),
            ("dev-1", "device-secret")
        );
        assert!(!format!("{c:?}").contains("device-secret"));
        assert_eq!(c.broker.tls, None);

        let missing = dir.path().join("nope.password");
        let text = err(
            "keep_alive = \"30s\"\n",
            &format!("keep_alive = \"30s\"\nusername = \"dev-1\"\npassword_file = {missing:?}\n"),
        );
        assert!(
            text.starts_with("broker.password_file: ") && text.contains("nope.password"),
            "{text}"
        );
        let text = err(
            "keep_alive = \"30s\"\n",
            "keep_alive = \"30s\"\n[broker.tls]\nca_file = \"/nonexistent/ca.crt\"\n",
        );
        assert!(
            text.starts_with("broker.tls.ca_file: ") && text.contains("/nonexistent/ca.crt"),
            "{text}"
        );
        let text = err(
            "keep_alive = \"30s\"\n",
            "keep_alive = \"30s\"\npassword = \"inline\"\n",
        );
        assert!(
            text.contains("password"),
            "an inline password is refused: {text}"
        );
    }

    #[test]
    fn example_config_is_valid() {
        let c = Config::from_toml(include_str!("../example-config.toml"))
            .expect("example config parses");
        assert_eq!(c.device_id.as_str(), "pi-kitchen-01");
    }

    #[test]
    fn errors_name_field_and_value() {
        assert_eq!(
            err(
                r#"command = ["/bin/sh", "-c", "test -s /opt/app/app.bin"]"#,
                "command = []"
            ),
            "health.check[0].command: must not be empty"
        );
        let e = err(r#"soak = "10s""#, r#"soak = "ten""#);
        assert!(e.starts_with("health.soak: \"ten\""), "{e}");
        let e = err(r#"device_id = "dev-1""#, r#"device_id = "dev/1""#);
        assert!(e.starts_with("device_id: \"dev/1\""), "{e}");
        let e = err(r#"kind = "file""#, r#"kind = "docker""#);
        assert!(e.starts_with("target[0].kind: \"docker\""), "{e}");
        let e = err("max_restarts = 5", "max_restarts = 0");
        assert!(e.starts_with("store.max_restarts: 0"), "{e}");
        let e = err("block_size = 65536", "block_size = 100000");
        assert!(e.starts_with("download.block_size: 100000"), "{e}");
        let e = err(r#"release_keys = ["#, r#"release_keys = ["abc", "#);
        assert!(e.starts_with("trust.release_keys[0]: \"abc\""), "{e}");
        let one_root = format!("root_keys = [\"{}\"]\ncoordinator_keys = [", "0".repeat(64));
        let e = err("coordinator_keys = [", &one_root);
        assert_eq!(
            e,
            "trust.root_threshold: 2 is not between 1 and the 1 root keys"
        );
        let c = with(
            "coordinator_keys = [",
            &format!("root_threshold = 1\n{one_root}"),
        )
        .expect("one root key, one signature");
        assert_eq!((c.trust.root_keys.len(), c.trust.root_threshold), (1, 1));
        let e = err(
            r#"path = "/opt/app/app.bin""#,
            r#"path = "relative/app.bin""#,
        );
        assert!(e.starts_with("target[0].path"), "{e}");
    }

    #[test]
    fn the_slow_peer_bound_is_read_and_must_be_more_than_zero() {
        let c = Config::from_toml(DEFAULT_CONFIG).expect("default");
        assert_eq!(c.download.peer_slow_block, Duration::from_secs(1));
        let c = with(r#"peer_slow_block = "1s""#, r#"peer_slow_block = "250ms""#).expect("250ms");
        assert_eq!(c.download.peer_slow_block, Duration::from_millis(250));
        let e = err(r#"peer_slow_block = "1s""#, r#"peer_slow_block = "0s""#);
        assert!(
            e.starts_with("download.peer_slow_block: \"0s\": must be more than 0"),
            "{e}"
        );
        let e = err(r#"peer_slow_block = "1s""#, r#"peer_slow_block = "soon""#);
        assert!(e.starts_with("download.peer_slow_block: \"soon\""), "{e}");
        // Left out, it is the default.
        let c = with("peer_slow_block = \"1s\"\n", "").expect("without the key");
        assert_eq!(c.download.peer_slow_block, Duration::from_secs(1));
    }

    const FILE_TARGET: &str = "kind = \"file\"\npath = \"/opt/app/app.bin\"";

    #[test]
    fn ab_target_is_built_with_defaults() {
        let c = with(
            FILE_TARGET,
            r#"kind = "ab"
slots = ["/dev/mmcblk0p2", "/dev/mmcblk0p3"]
bootctl = "uboot""#,
        )
        .expect("valid ab target");
        let Some(TargetKind::Ab(ab)) = c.target("app").map(|t| t.kind.clone()) else {
            panic!("expected an ab target: {:?}", c.targets);
        };
        assert_eq!(
            ab.slots,
            [
                PathBuf::from("/dev/mmcblk0p2"),
                PathBuf::from("/dev/mmcblk0p3")
            ]
        );
        assert_eq!(ab.bootctl, BootControlKind::UBoot { config: None });
        assert_eq!(ab.reboot_command, ["systemctl", "reboot"]);
        assert_eq!(
            ab.state_dir,
            PathBuf::from("/var/lib/flotilla-agent/targets/app")
        );
        let c = with(
            FILE_TARGET,
            r#"kind = "ab"
slots = ["/data/a.img", "/data/b.img"]
bootctl = "grub""#,
        )
        .expect("grub");
        let Some(TargetKind::Ab(ab)) = c.target("app").map(|t| t.kind.clone()) else {
            panic!("expected an ab target");
        };
        assert_eq!(
            ab.bootctl,
            BootControlKind::Grub {
                env_file: PathBuf::from("/boot/grub/grubenv")
            }
        );
    }

    #[test]
    fn ab_target_errors_name_the_field() {
        let ab = |rest: &str| {
            err(
                FILE_TARGET,
                &format!("kind = \"ab\"\nbootctl = \"file\"\nbootctl_path = \"/boot/env\"\n{rest}"),
            )
        };
        let e = ab(r#"slots = ["/dev/mmcblk0p2"]"#);
        assert!(
            e.starts_with("target[0].slots: [\"/dev/mmcblk0p2\"]: needs exactly two"),
            "{e}"
        );
        let e = ab(r#"slots = ["/dev/sda2", "/dev/sda2"]"#);
        assert!(e.starts_with("target[0].slots: "), "{e}");
        assert!(e.contains("must be different"), "{e}");
        let e = ab(r#"slots = ["/dev/sda2", "sda3"]"#);
        assert!(
            e.starts_with("target[0].slots: \"sda3\": must be an absolute"),
            "{e}"
        );
        let e = ab("");
        assert!(e.starts_with("target[0].slots: is required"), "{e}");
        let e = ab("slots = [\"/a\", \"/b\"]\nreboot_command = []");
        assert!(e.starts_with("target[0].reboot_command: []"), "{e}");
        let e = ab("slots = [\"/a\", \"/b\"]\npath = \"/x\"");
        assert!(
            e.starts_with("target[0].path: is not a setting of kind \"ab\""),
            "{e}"
        );
        let e = err(
            FILE_TARGET,
            "kind = \"ab\"\nslots = [\"/a\", \"/b\"]\nbootctl = \"lilo\"",
        );
        assert!(e.starts_with("target[0].bootctl: \"lilo\""), "{e}");
        let e = err(
            FILE_TARGET,
            "kind = \"ab\"\nslots = [\"/a\", \"/b\"]\nbootctl = \"file\"",
        );
        assert!(e.starts_with("target[0].bootctl_path: is required"), "{e}");
    }

    #[test]
    fn script_target_takes_timeouts_and_env() {
        let c = with(
            FILE_TARGET,
            r#"kind = "script"
path = "/usr/lib/flotilla/compose.sh"
timeouts = { stage = "45m", confirm = "30s" }
env = { COMPOSE_DIR = "/srv/app" }"#,
        )
        .expect("valid script target");
        let Some(TargetKind::Script(script)) = c.target("app").map(|t| t.kind.clone()) else {
            panic!("expected a script target");
        };
        assert_eq!(script.timeouts.stage, Duration::from_secs(45 * 60));
        assert_eq!(script.timeouts.confirm, Duration::from_secs(30));
        assert_eq!(script.timeouts.check, ScriptTimeouts::default().check);
        assert_eq!(
            script.env.get("COMPOSE_DIR").map(String::as_str),
            Some("/srv/app")
        );
        assert_eq!(script.reboot_command, None);

        let script = |rest: &str| {
            err(
                FILE_TARGET,
                &format!("kind = \"script\"\npath = \"/usr/lib/x.sh\"\n{rest}"),
            )
        };
        let e = script(r#"timeouts = { stage = "0s" }"#);
        assert!(e.starts_with("target[0].timeouts.stage: \"0s\""), "{e}");
        let e = script(r#"timeouts = { stage = "soon" }"#);
        assert!(e.starts_with("target[0].timeouts.stage: \"soon\""), "{e}");
        let e = script(r#"env = { FLOTILLA_ACTION_ID = "x" }"#);
        assert!(
            e.starts_with("target[0].env: \"FLOTILLA_ACTION_ID\""),
            "{e}"
        );
        let e = script(r#"slots = ["/a", "/b"]"#);
        assert!(e.starts_with("target[0].slots: is not a setting"), "{e}");
        let e = err(FILE_TARGET, "kind = \"script\"\npath = \"x.sh\"");
        assert!(e.starts_with("target[0].path: \"x.sh\""), "{e}");
    }

    #[test]
    fn mender_module_target_names_its_module_and_files() {
        let c = with(
            FILE_TARGET,
            r#"kind = "mender-module"
module = "single-file"
payload_file = "app.conf"
files = { dest_dir = "/opt/app", filename = "app.conf", permissions = "0644" }
timeouts = { activate = "2m" }"#,
        )
        .expect("valid mender-module target");
        let Some(TargetKind::MenderModule(m)) = c.target("app").map(|t| t.kind.clone()) else {
            panic!("expected a mender-module target");
        };
        assert_eq!(
            m.module,
            PathBuf::from("/usr/share/mender/modules/v3/single-file")
        );
        assert_eq!(m.payload_file.as_deref(), Some("app.conf"));
        assert_eq!(
            m.files.get("dest_dir").map(String::as_str),
            Some("/opt/app")
        );
        assert_eq!(m.timeouts.activate, Duration::from_secs(120));
        assert!(m.state_dir.ends_with("targets/app"), "{:?}", m.state_dir);

        let mender = |rest: &str| err(FILE_TARGET, &format!("kind = \"mender-module\"\n{rest}"));
        let e = mender("");
        assert!(e.starts_with("target[0].module: is required"), "{e}");
        let e = mender(r#"module = "modules/single-file""#);
        assert!(
            e.starts_with("target[0].module: \"modules/single-file\""),
            "{e}"
        );
        let e = mender("module = \"/opt/m\"\nfiles = { \"../x\" = \"y\" }");
        assert!(e.starts_with("target[0].files: \"../x\""), "{e}");
        let e = mender("module = \"/opt/m\"\npayload_file = \"a/b\"");
        assert!(e.starts_with("target[0].payload_file: \"a/b\""), "{e}");
        let e = mender("module = \"/opt/m\"\npath = \"/x\"");
        assert!(e.starts_with("target[0].path: is not a setting"), "{e}");
        let e = err(
            FILE_TARGET,
            "kind = \"file\"\npath = \"/x\"\nmodule = \"single-file\"",
        );
        assert!(e.starts_with("target[0].module: is not a setting"), "{e}");
    }

    #[test]
    fn swupdate_target_takes_its_arguments_and_commands() {
        let c = with(
            FILE_TARGET,
            r#"kind = "swupdate"
args = ["-k", "/etc/swupdate/cert.pem", "-H", "board:1.0"]
reboot = true
rollback_command = ["fw_setenv", "boot_copy", "a"]
timeouts = { activate = "45m" }"#,
        )
        .expect("valid swupdate target");
        let Some(TargetKind::Swupdate(swu)) = c.target("app").map(|t| t.kind.clone()) else {
            panic!("expected a swupdate target");
        };
        assert_eq!(swu.program, PathBuf::from("/usr/bin/swupdate"));
        assert_eq!(swu.args[3], "board:1.0");
        assert!(swu.reboot);
        assert_eq!(
            swu.reboot_command,
            Some(vec!["systemctl".to_owned(), "reboot".to_owned()]),
            "rebooting images get the default reboot command"
        );
        assert_eq!(swu.confirm_command, None);
        assert_eq!(swu.install_timeout, Duration::from_secs(45 * 60));
        assert_eq!(swu.state_dir, c.data_dir.join("targets").join("app"));
        assert_eq!(swu.socket, None, "swupdate -i unless a socket is set");

        let c = with(
            FILE_TARGET,
            "kind = \"swupdate\"\nsocket = \"/run/swupdate/sockinstctrl\"",
        )
        .expect("a swupdate target with a socket");
        let Some(TargetKind::Swupdate(swu)) = c.target("app").map(|t| t.kind.clone()) else {
            panic!("expected a swupdate target");
        };
        assert_eq!(
            swu.socket.as_deref(),
            Some(std::path::Path::new("/run/swupdate/sockinstctrl"))
        );
        assert_eq!(
            swu.progress_socket(),
            Some(PathBuf::from("/run/swupdate/swupdateprog"))
        );

        let swupdate = |rest: &str| err(FILE_TARGET, &format!("kind = \"swupdate\"\n{rest}"));
        let e = swupdate(r#"args = ["-i", "/tmp/other.swu"]"#);
        assert!(e.starts_with("target[0].args: \"-i\""), "{e}");
        let e = swupdate(r#"path = "swupdate""#);
        assert!(e.starts_with("target[0].path: \"swupdate\""), "{e}");
        let e = swupdate(r#"confirm_command = []"#);
        assert!(e.starts_with("target[0].confirm_command: []"), "{e}");
        let e = swupdate(r#"timeouts = { stage = "1m" }"#);
        assert!(
            e.starts_with("target[0].timeouts.stage: kind \"swupdate\""),
            "{e}"
        );
        let e = swupdate(r#"slots = ["/a", "/b"]"#);
        assert!(e.starts_with("target[0].slots: is not a setting"), "{e}");
        let e = swupdate(r#"socket = "sockinstctrl""#);
        assert!(e.starts_with("target[0].socket: \"sockinstctrl\""), "{e}");
        let e = err(
            FILE_TARGET,
            "kind = \"file\"\npath = \"/a\"\nsocket = \"/tmp/s\"",
        );
        assert!(e.starts_with("target[0].socket: is not a setting"), "{e}");
        let e = err(FILE_TARGET, "kind = \"file\"\npath = \"/a\"\nreboot = true");
        assert!(
            e.starts_with("target[0].reboot: is not a setting of kind \"file\""),
            "{e}"
        );
    }

    #[test]
    fn rauc_target_takes_its_program_reboot_command_and_install_timeout() {
        let c = with(
            FILE_TARGET,
            r#"kind = "rauc"
reboot_command = ["/sbin/reboot"]
timeouts = { activate = "20m" }"#,
        )
        .expect("valid rauc target");
        let Some(TargetKind::Rauc(rauc)) = c.target("app").map(|t| t.kind.clone()) else {
            panic!("expected a rauc target");
        };
        assert_eq!(rauc.program, PathBuf::from("/usr/bin/rauc"));
        assert_eq!(rauc.reboot_command, ["/sbin/reboot"]);
        assert_eq!(rauc.install_timeout, Duration::from_secs(20 * 60));
        assert_eq!(rauc.state_dir, c.data_dir.join("targets").join("app"));
        let c = with(FILE_TARGET, "kind = \"rauc\"").expect("defaults");
        let Some(TargetKind::Rauc(rauc)) = c.target("app").map(|t| t.kind.clone()) else {
            panic!("expected a rauc target");
        };
        assert_eq!(rauc.reboot_command, ["systemctl", "reboot"]);

        let rauc = |rest: &str| err(FILE_TARGET, &format!("kind = \"rauc\"\n{rest}"));
        let e = rauc(r#"path = "rauc""#);
        assert!(e.starts_with("target[0].path: \"rauc\""), "{e}");
        let e = rauc(r#"reboot_command = []"#);
        assert!(e.starts_with("target[0].reboot_command: []"), "{e}");
        let e = rauc(r#"timeouts = { confirm = "1m" }"#);
        assert!(
            e.starts_with("target[0].timeouts.confirm: kind \"rauc\""),
            "{e}"
        );
        let e = rauc(r#"args = ["--ignore-compatible"]"#);
        assert!(e.starts_with("target[0].args: is not a setting"), "{e}");
        let e = rauc(r#"bootctl = "uboot""#);
        assert!(e.starts_with("target[0].bootctl: is not a setting"), "{e}");
    }

    #[test]
    fn target_names_are_safe_directory_names() {
        let e = err(r#"name = "app""#, r#"name = "../app""#);
        assert!(e.starts_with("target[0].name: \"../app\""), "{e}");
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = err("[download]", "[download]\nblok_size = 4");
        assert!(e.contains("blok_size"), "{e}");
    }

    #[test]
    fn durations() {
        assert_eq!(
            parse_duration("x", "500ms").ok(),
            Some(Duration::from_millis(500))
        );
        assert_eq!(
            parse_duration("x", "10s").ok(),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            parse_duration("x", "5m").ok(),
            Some(Duration::from_secs(300))
        );
        assert_eq!(
            parse_duration("x", "1h").ok(),
            Some(Duration::from_secs(3600))
        );
        assert_eq!(
            parse_duration("x", "1h30m").ok(),
            Some(Duration::from_secs(5400))
        );
        assert_eq!(
            parse_duration("x", "1s500ms").ok(),
            Some(Duration::from_millis(1500))
        );
        for bad in [
            "",
            "10",
            "s",
            "1.5s",
            "-1s",
            "10 days",
            "99999999999999999999h",
        ] {
            let e = parse_duration("health.interval", bad)
                .expect_err(bad)
                .to_string();
            assert!(e.starts_with("health.interval: "), "{e}");
        }
    }
}
