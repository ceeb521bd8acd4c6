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

use flotilla_protocol::{signing, DeviceId, VerifyingKey};
use serde::Deserialize;

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
    pub broker: BrokerConfig,
    /// Sorted by key, as published in the device state.
    pub labels: Vec<(String, String)>,
    pub trust: TrustConfig,
    pub targets: Vec<TargetConfig>,
    pub health: HealthConfig,
    pub download: DownloadConfig,
    pub store: StoreConfig,
}

#[derive(Debug, Clone)]
pub struct BrokerConfig {
    pub host: String,
    pub port: u16,
    pub topic_root: String,
    pub keep_alive: Duration,
}

#[derive(Debug, Clone)]
pub struct TrustConfig {
    pub release_keys: Vec<VerifyingKey>,
    pub coordinator_keys: Vec<VerifyingKey>,
}

/// The kinds of update target the agent can build from configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetKind {
    File,
}

#[derive(Debug, Clone)]
pub struct TargetConfig {
    pub name: String,
    pub kind: TargetKind,
    pub path: PathBuf,
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
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBroker {
    host: String,
    #[serde(default = "default_port")]
    port: u16,
    #[serde(default = "default_root")]
    topic_root: String,
    #[serde(default = "default_keep_alive")]
    keep_alive: String,
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrust {
    release_keys: Vec<String>,
    coordinator_keys: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTarget {
    name: String,
    kind: String,
    path: PathBuf,
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
}

impl Default for RawDownload {
    fn default() -> Self {
        Self {
            block_size: default_block_size(),
            in_flight: default_in_flight(),
            max_bytes_per_sec: 0,
        }
    }
}

fn default_block_size() -> u32 {
    MAX_BLOCK_SIZE
}
fn default_in_flight() -> usize {
    4
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

        if raw.broker.host.trim().is_empty() {
            return Err(invalid("broker.host", "must not be empty"));
        }
        if raw.broker.port == 0 {
            return Err(invalid("broker.port", "0 is not a port"));
        }
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
            host: raw.broker.host,
            port: raw.broker.port,
            topic_root: raw.broker.topic_root.clone(),
            keep_alive: parse_duration("broker.keep_alive", &raw.broker.keep_alive)?,
        };
        if broker.keep_alive < Duration::from_secs(1) {
            return Err(invalid(
                "broker.keep_alive",
                format!("{:?}: must be at least 1s", raw.broker.keep_alive),
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

        let trust = TrustConfig {
            release_keys: parse_keys("trust.release_keys", &raw.trust.release_keys)?,
            coordinator_keys: parse_keys("trust.coordinator_keys", &raw.trust.coordinator_keys)?,
        };

        let mut targets: Vec<TargetConfig> = Vec::new();
        for (i, t) in raw.target.into_iter().enumerate() {
            let field = |f: &str| format!("target[{i}].{f}");
            if t.name.trim().is_empty() {
                return Err(invalid(field("name"), "must not be empty"));
            }
            if targets.iter().any(|o| o.name == t.name) {
                return Err(invalid(
                    field("name"),
                    format!("{:?} is configured twice", t.name),
                ));
            }
            let kind = match t.kind.as_str() {
                "file" => TargetKind::File,
                other => {
                    return Err(invalid(
                        field("kind"),
                        format!("{other:?}: supported kinds are \"file\""),
                    ))
                }
            };
            if !t.path.is_absolute() || t.path.file_name().is_none() {
                return Err(invalid(
                    field("path"),
                    format!("{:?}: must be an absolute path to a file", t.path),
                ));
            }
            targets.push(TargetConfig {
                name: t.name,
                kind,
                path: t.path,
            });
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
        if raw.store.cache_bytes < 64 * 1024 {
            return Err(invalid(
                "store.cache_bytes",
                format!("{}: must be at least 65536", raw.store.cache_bytes),
            ));
        }

        if raw.store.max_restarts == 0 {
            return Err(invalid("store.max_restarts", "0: must be at least 1"));
        }

        Ok(Config {
            device_id,
            hardware_id: raw.hardware_id,
            data_dir: raw.data_dir,
            broker,
            labels: raw.labels.into_iter().collect(),
            trust,
            targets,
            health,
            download: DownloadConfig {
                block_size: d.block_size,
                in_flight: d.in_flight,
                max_bytes_per_sec: d.max_bytes_per_sec,
            },
            store: StoreConfig {
                cache_bytes: raw.store.cache_bytes,
                max_restarts: raw.store.max_restarts,
            },
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

/// Parses `500ms`, `10s`, `5m`, `1h` (a whole number and a unit). `field` names it in errors.
pub fn parse_duration(field: &str, text: &str) -> Result<Duration, ConfigError> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let bad = || {
        invalid(
            field,
            format!("{text:?}: expected a duration like \"500ms\", \"10s\", \"5m\" or \"1h\""),
        )
    };
    let n: u64 = number.parse().map_err(|_| bad())?;
    let millis = match unit {
        "ms" => Some(n),
        "s" => n.checked_mul(1_000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        _ => return Err(bad()),
    };
    millis.map(Duration::from_millis).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn default_config_is_valid() {
        let c = Config::from_toml(DEFAULT_CONFIG).expect("default config parses");
        assert_eq!(c.device_id.as_str(), "dev-1");
        assert_eq!(c.broker.keep_alive, Duration::from_secs(30));
        assert_eq!(c.health.checks[0].name, "app-runs");
        assert_eq!(
            c.target("app").map(|t| t.path.clone()),
            Some(PathBuf::from("/opt/app/app.bin"))
        );
        assert_eq!(c.labels, vec![("env".to_owned(), "prod".to_owned())]);
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
        let e = err(r#"kind = "file""#, r#"kind = "ab""#);
        assert!(e.starts_with("target[0].kind: \"ab\""), "{e}");
        let e = err("max_restarts = 5", "max_restarts = 0");
        assert!(e.starts_with("store.max_restarts: 0"), "{e}");
        let e = err("block_size = 65536", "block_size = 100000");
        assert!(e.starts_with("download.block_size: 100000"), "{e}");
        let e = err(r#"release_keys = ["#, r#"release_keys = ["abc", "#);
        assert!(e.starts_with("trust.release_keys[0]: \"abc\""), "{e}");
        let e = err(
            r#"path = "/opt/app/app.bin""#,
            r#"path = "relative/app.bin""#,
        );
        assert!(e.starts_with("target[0].path"), "{e}");
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
