//! `flotilla store migrate`: copies a stopped coordinator's sled store into the PostgreSQL
//! store its config names, the way from one coordinator to several (docs/operations.md,
//! "Several coordinators").
//!
//! It copies every record a backup holds (rollouts, strategies, device groups, enrollments,
//! used tokens, the per-device action sequence) in one transaction, and refuses a database
//! that already holds records or that a coordinator leads: nothing is merged and nothing is
//! overwritten behind a running coordinator's back.

use std::path::Path;

use crate::service::config::Config;
use crate::service::config_store::StoreConfig;
use crate::service::shared::pg_settings;
use crate::service::store::postgres::{Fence, PgBackend};
use crate::service::store::{Store, StoreError};

/// Why a migration did not happen.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("cannot read the config {path}: {reason}")]
    Config { path: String, reason: String },
    #[error("the config {path} has no [store] url: it names no PostgreSQL store to copy into")]
    NotShared { path: String },
    #[error("{source} (is the coordinator running? stop it first: it keeps its store locked)")]
    OpenSled { source: StoreError },
    #[error("cannot connect to the PostgreSQL store: {0}")]
    Connect(String),
    #[error(
        "the PostgreSQL store {store} already holds records: migrate only into an empty database"
    )]
    NotEmpty { store: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What was copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Migrated {
    pub records: usize,
    pub into: String,
}

/// Copies the sled store in `data_dir` into the PostgreSQL store of `config`.
pub fn migrate(data_dir: &Path, config: &Path) -> Result<Migrated, MigrateError> {
    let loaded = Config::load(config).map_err(|e| MigrateError::Config {
        path: config.display().to_string(),
        reason: e.to_string(),
    })?;
    let StoreConfig::Postgres(pg) = &loaded.store else {
        return Err(MigrateError::NotShared {
            path: config.display().to_string(),
        });
    };
    let from =
        Store::open(data_dir.join("db")).map_err(|source| MigrateError::OpenSled { source })?;
    let records = from.export()?;
    let backend = PgBackend::connect(&pg_settings(pg), Fence::NoLiveLease)
        .map_err(|e| MigrateError::Connect(e.to_string()))?;
    let into = Store::on(Box::new(backend));
    if !into.is_empty() {
        return Err(MigrateError::NotEmpty {
            store: into.describe(),
        });
    }
    let owned: Vec<(String, Vec<u8>, Vec<u8>)> = records
        .into_iter()
        .map(|(tree, key, value)| (tree.to_owned(), key, value))
        .collect();
    into.import(&owned)?;
    Ok(Migrated {
        records: owned.len(),
        into: into.describe(),
    })
}
