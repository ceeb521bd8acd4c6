//! Why the coordinator service stops with an error.

use std::path::PathBuf;

use crate::service::broker::BrokerError;
use crate::service::keys::KeysError;
use crate::service::store::StoreError;

/// Why the service stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Broker(#[from] BrokerError),
    #[error("embedded broker start-up task failed: {reason}")]
    BrokerTask { reason: String },
    #[error("cannot start the signature worker threads ([service] verify_threads = {threads}): {reason}")]
    VerifyThreads { threads: usize, reason: String },
    #[error("cannot load the coordinator key: {0}")]
    Key(#[from] KeysError),
    /// The store's own error already names the path.
    #[error("{source}")]
    OpenStore { path: PathBuf, source: StoreError },
    #[error("cannot load rollouts from {store}: {source}")]
    LoadRollouts { store: String, source: StoreError },
    #[error("cannot load device groups from {store}: {source}")]
    LoadGroups { store: String, source: StoreError },
    #[error("cannot load the per-device action sequence from {store}: {source}")]
    LoadSequence { store: String, source: StoreError },
    #[error(
        "the store at {} holds {stored} commits but {sealed} were acknowledged (its seal {}): \
         {} acknowledged writes are missing, the newest rollouts or device records may be lost. \
         Restore the latest backup (`flotilla restore`), or accept the store as it is with \
         `flotilla store reseal` (docs/operations.md, \"Backup and restore\")",
        path.display(), seal.display(), sealed - stored
    )]
    StoreLost {
        path: PathBuf,
        seal: PathBuf,
        stored: u64,
        sealed: u64,
    },
    #[error(
        "no room to open the store in {} ({reason}) and no reserve left to release: free some \
         space and start again",
        data_dir.display()
    )]
    NoRoom { data_dir: PathBuf, reason: String },
    #[error("cannot check the store's seal: {0}")]
    Seal(StoreError),
    #[error("the MQTT link to {addr} stopped unexpectedly")]
    LinkClosed { addr: String },
    #[error("cannot read the authorized device keys {path}: {reason}")]
    AuthorizedKeys { path: PathBuf, reason: String },
    #[error("cannot load device enrollments from {store}: {source}")]
    LoadEnrollments { store: String, source: StoreError },
    #[error(transparent)]
    Http(#[from] crate::service::http::StartError),
    /// This coordinator no longer holds the lease of a shared store: it stops publishing and
    /// writing at once and goes back to being a standby (`shared.rs`).
    #[error("this coordinator stopped leading (its lease epoch was {epoch}): {reason}")]
    Deposed { epoch: u64, reason: String },
    /// The shared store could not be reached or used at start.
    #[error("{reason}")]
    SharedStore { reason: String },
}
