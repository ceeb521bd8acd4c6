//! [`AgentError`]: why the agent as a whole could not start or keep running.
//!
//! Failures of a single update action are not errors of the agent: they end that action as
//! `Failed` or `Refused` and are reported to the coordinator. What lands here is what stops the
//! daemon (the database cannot be opened, the data directory cannot be created).

use std::path::PathBuf;

use crate::config::ConfigError;
use crate::store::StoreError;

/// Why the agent stopped or could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot create data directory {path}: {source}")]
    CreateDataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot read status file {path} (the agent writes it when it reports): {source}")]
    ReadStatusFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no action is waiting for local consent; give the action id explicitly")]
    NothingWaitsForConsent,
    #[error("cannot write consent file {path}: {source}")]
    WriteConsent {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write trust file {path}: {source}")]
    WriteTrustFile {
        path: PathBuf,
        source: std::io::Error,
    },
}
