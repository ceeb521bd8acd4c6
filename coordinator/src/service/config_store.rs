//! The `[store]` section: sled in the data directory (the default, nothing to set), or a
//! PostgreSQL database shared by several coordinators that take turns leading.
//!
//! ```toml
//! [store]
//! url = "postgres://flotilla@db.example.net:5432/flotilla"
//! password_file = "store.pass"      # or password_env = "FLOTILLA_STORE_PASSWORD"
//! ca_file = "db-ca.pem"             # TLS to the database, trusting this CA
//! coordinator_id = "coord-a"        # default: the host name
//! lease_ttl = 15                    # seconds; renew every lease_renew, step down lease_margin early
//! lease_renew = 5
//! lease_margin = 3
//! ```
//!
//! The password never goes in the URL: a URL is logged and shown in `flotilla status`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::service::leadership::LeaseSettings;

/// Where the coordinator keeps its state.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum StoreConfig {
    /// sled in `{data_dir}/db`: one coordinator.
    #[default]
    Sled,
    /// A PostgreSQL database several coordinators share.
    Postgres(PostgresConfig),
}

/// A shared PostgreSQL store and this coordinator's place among those using it.
#[derive(Clone, PartialEq)]
pub struct PostgresConfig {
    /// `postgres://user@host:port/database`, without a password.
    pub url: String,
    pub password: Option<String>,
    /// TLS to the database, trusting this CA certificate (PEM).
    pub ca_file: Option<PathBuf>,
    /// This coordinator's name in the lease and in `flotilla status`.
    pub coordinator_id: String,
    pub lease: LeaseSettings,
}

impl std::fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("url", &self.url)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("ca_file", &self.ca_file)
            .field("coordinator_id", &self.coordinator_id)
            .field("lease", &self.lease)
            .finish()
    }
}

/// `[store]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawStore {
    url: Option<String>,
    password_file: Option<PathBuf>,
    password_env: Option<String>,
    ca_file: Option<PathBuf>,
    coordinator_id: Option<String>,
    lease_ttl: Option<u64>,
    lease_renew: Option<u64>,
    lease_margin: Option<u64>,
}

/// A `[store]` field that is wrong: the field, the value and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreFieldError {
    pub field: &'static str,
    pub value: String,
    pub reason: String,
}

fn wrong(field: &'static str, value: impl std::fmt::Display, reason: &str) -> StoreFieldError {
    StoreFieldError {
        field,
        value: value.to_string(),
        reason: reason.to_owned(),
    }
}

impl RawStore {
    /// Validates the section; relative paths are taken from `base` (the config file's
    /// directory), variables read through `env`.
    pub(crate) fn validate(
        self,
        base: &Path,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<StoreConfig, StoreFieldError> {
        let Some(url) = self.url else {
            let lease_fields = [
                ("store.password_file", self.password_file.is_some()),
                ("store.password_env", self.password_env.is_some()),
                ("store.ca_file", self.ca_file.is_some()),
                ("store.coordinator_id", self.coordinator_id.is_some()),
                ("store.lease_ttl", self.lease_ttl.is_some()),
                ("store.lease_renew", self.lease_renew.is_some()),
                ("store.lease_margin", self.lease_margin.is_some()),
            ];
            if let Some((field, _)) = lease_fields.iter().find(|(_, set)| *set) {
                return Err(wrong(
                    field,
                    "(set)",
                    "only means something with store.url (a PostgreSQL store); without it the \
                     store is sled in the data directory",
                ));
            }
            return Ok(StoreConfig::Sled);
        };
        check_url(&url)?;
        let password = match (self.password_file, self.password_env) {
            (Some(_), Some(var)) => {
                return Err(wrong(
                    "store.password_env",
                    var,
                    "set either password_file or password_env, not both",
                ))
            }
            (Some(path), None) => {
                let path = base.join(path);
                let text = std::fs::read_to_string(&path).map_err(|e| {
                    wrong(
                        "store.password_file",
                        path.display(),
                        &format!("cannot read it: {e}"),
                    )
                })?;
                let secret = text.trim_end_matches(['\n', '\r']);
                if secret.is_empty() {
                    return Err(wrong(
                        "store.password_file",
                        path.display(),
                        "the file is empty",
                    ));
                }
                Some(secret.to_owned())
            }
            (None, Some(var)) => match env(&var) {
                Some(secret) if !secret.is_empty() => Some(secret),
                _ => {
                    return Err(wrong(
                        "store.password_env",
                        var,
                        "the environment variable is not set or empty",
                    ))
                }
            },
            (None, None) => None,
        };
        let coordinator_id = match self.coordinator_id {
            Some(id) => id,
            None => host_name(),
        };
        if coordinator_id.is_empty()
            || coordinator_id.len() > 64
            || !coordinator_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return Err(wrong(
                "store.coordinator_id",
                &coordinator_id,
                "must be 1 to 64 letters, digits, '-', '_' or '.'",
            ));
        }
        let defaults = LeaseSettings::default();
        let secs = |field: &'static str, value: Option<u64>, default: Duration| match value {
            None => Ok(default),
            Some(0) => Err(wrong(field, 0, "must be at least 1 second")),
            Some(s) if s > 3600 => Err(wrong(field, s, "must be at most 3600 seconds")),
            Some(s) => Ok(Duration::from_secs(s)),
        };
        let lease = LeaseSettings {
            ttl: secs("store.lease_ttl", self.lease_ttl, defaults.ttl)?,
            renew_every: secs("store.lease_renew", self.lease_renew, defaults.renew_every)?,
            margin: match self.lease_margin {
                Some(0) => Duration::ZERO,
                other => secs("store.lease_margin", other, defaults.margin)?,
            },
        };
        if lease.renew_every + lease.margin >= lease.ttl {
            return Err(wrong(
                "store.lease_renew",
                lease.renew_every.as_secs(),
                &format!(
                    "lease_renew + lease_margin must be less than lease_ttl ({} s): a leader \
                     must renew before it has to step down",
                    lease.ttl.as_secs()
                ),
            ));
        }
        Ok(StoreConfig::Postgres(PostgresConfig {
            url,
            password,
            ca_file: self.ca_file.map(|p| base.join(p)),
            coordinator_id,
            lease,
        }))
    }
}

/// A PostgreSQL URL with no password in it.
fn check_url(url: &str) -> Result<(), StoreFieldError> {
    let Some(rest) = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
    else {
        return Err(wrong(
            "store.url",
            url,
            "must start with postgres:// (postgres://user@host:port/database)",
        ));
    };
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    if let Some((user, _)) = authority.rsplit_once('@') {
        if user.contains(':') {
            return Err(wrong(
                "store.url",
                "postgres://<user>:<redacted>@...",
                "must not carry a password (it would show in logs and status): put it in \
                 store.password_file or store.password_env",
            ));
        }
    }
    if authority.rsplit('@').next().is_none_or(str::is_empty) {
        return Err(wrong("store.url", url, "names no host"));
    }
    Ok(())
}

/// This machine's host name, the default coordinator id.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "coordinator".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(toml_text: &str) -> RawStore {
        toml::from_str(toml_text).expect("parses")
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn no_url_is_sled_and_lease_settings_without_a_url_are_refused() {
        let dir = Path::new("/etc/flotilla");
        assert_eq!(raw("").validate(dir, &no_env), Ok(StoreConfig::Sled));
        let err = raw("lease_ttl = 20")
            .validate(dir, &no_env)
            .expect_err("refused");
        assert_eq!(err.field, "store.lease_ttl");
        assert!(err.reason.contains("store.url"), "{err:?}");
    }

    #[test]
    fn a_postgres_store_takes_its_password_from_the_environment_and_defaults_its_lease() {
        let env = |v: &str| (v == "PGPASS").then(|| "s3cret".to_owned());
        let config = raw(
            "url = \"postgres://flotilla@db:5432/flotilla\"\npassword_env = \"PGPASS\"\n\
             coordinator_id = \"coord-a\"",
        )
        .validate(Path::new("/etc/flotilla"), &env)
        .expect("valid");
        let StoreConfig::Postgres(pg) = config else {
            panic!("a postgres store");
        };
        assert_eq!(pg.password.as_deref(), Some("s3cret"));
        assert_eq!(pg.coordinator_id, "coord-a");
        assert_eq!(pg.lease, LeaseSettings::default());
        assert!(
            !format!("{pg:?}").contains("s3cret"),
            "the password is never printed"
        );
    }

    #[test]
    fn a_password_in_the_url_is_refused_without_repeating_it() {
        let err = raw("url = \"postgres://flotilla:hunter2@db/flotilla\"")
            .validate(Path::new("."), &no_env)
            .expect_err("refused");
        assert_eq!(err.field, "store.url");
        assert!(!err.value.contains("hunter2"), "{err:?}");
        assert!(err.reason.contains("password_file"), "{err:?}");
    }

    #[test]
    fn lease_timings_that_cannot_work_are_refused_naming_the_rule() {
        let err =
            raw("url = \"postgres://f@db/f\"\nlease_ttl = 6\nlease_renew = 5\nlease_margin = 1")
                .validate(Path::new("."), &no_env)
                .expect_err("refused");
        assert_eq!(err.field, "store.lease_renew");
        assert!(err.reason.contains("less than lease_ttl"), "{err:?}");
        let err = raw("url = \"mysql://db/f\"")
            .validate(Path::new("."), &no_env)
            .expect_err("refused");
        assert!(err.reason.contains("postgres://"), "{err:?}");
        let err = raw("url = \"postgres://f@db/f\"\ncoordinator_id = \"a b\"")
            .validate(Path::new("."), &no_env)
            .expect_err("refused");
        assert_eq!(err.field, "store.coordinator_id");
    }
}
