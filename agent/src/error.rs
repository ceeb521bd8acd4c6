//! [`AgentError`]: why the agent as a whole could not start or keep running.
//!
//! Failures of a single update action are not errors of the agent: they end that action as
//! `Failed` or `Refused` and are reported to the coordinator. What lands here is what stops the
//! daemon (the database cannot be opened, the data directory cannot be created).
//!
//! Errors are defined where they arise and wrapped here only if they stop the daemon:
//! [`ConfigError`] (config), [`StoreError`] (store). The commands beside the daemon have their
//! own: `StatusError` (status), `ConsentError` (consent), `InstallKeysError` (trust). Only the
//! agent module uses this one, so no lower module depends on it.

use std::path::PathBuf;

use crate::config::ConfigError;
use crate::identity::IdentityError;
use crate::store::StoreError;

/// Why the agent stopped or could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `<data_dir>/targets`, the parent of the targets' state directories (the data directory
    /// itself is created by [`crate::store::open_data_dir`]).
    #[error("cannot create data directory {path}: {source}")]
    CreateDataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The device key (`<data_dir>/device.key`) cannot be read or made.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error("cannot write trust file {path}: {source}")]
    WriteTrustFile {
        path: PathBuf,
        source: std::io::Error,
    },
}
