//! `flotilla backup`, `flotilla restore` and `flotilla store check|reseal`: the coordinator's
//! store, kept safe (docs/operations.md, "Backup and restore").
//!
//! A running coordinator holds its store locked, so an online backup is a control command (the
//! coordinator writes the file into its own `backups/` directory). Everything else works on the
//! data directory of a stopped coordinator.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use flotilla_protocol::control::BackupInfo;

use crate::service::backup::{self, BackupError, Trust};
use crate::service::keys::{self, KeysError};
use crate::service::seal::SealCheck;
use crate::service::store::{Store, StoreError};

#[derive(Debug, Args)]
pub struct BackupArgs {
    /// Read the store of a stopped coordinator in this data directory instead of asking a
    /// running one.
    #[arg(long, requires = "out", requires = "coordinator_key")]
    pub data_dir: Option<PathBuf>,
    /// Where to write the backup (with --data-dir).
    #[arg(long, requires = "data_dir")]
    pub out: Option<PathBuf>,
    /// The coordinator's secret key file (its config's `coordinator_key`), which signs the
    /// backup (with --data-dir; a running coordinator signs with its own).
    #[arg(long, requires = "data_dir")]
    pub coordinator_key: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// The data directory of the stopped coordinator to restore into.
    #[arg(long)]
    pub data_dir: PathBuf,
    /// The backup file (`flotilla backup`).
    #[arg(long)]
    pub from: PathBuf,
    /// Move a store that holds records aside (to `db.before-restore-TIME`) instead of refusing.
    #[arg(long)]
    pub force: bool,
    /// The coordinator's secret key file (its config's `coordinator_key`): the backup must be
    /// signed by its key, or by one given with --trust-key.
    #[arg(long, required_unless_present = "trust_key")]
    pub coordinator_key: Option<PathBuf>,
    /// The public key file (`.pub`) of another coordinator key the backup may be signed by,
    /// such as the coordinator's key before a rotation. Repeat for several.
    #[arg(long, value_name = "FILE")]
    pub trust_key: Vec<PathBuf>,
    /// Restore a version 1 backup, which carries no signature (made before backups were
    /// signed): only one kept where nobody else could write it.
    #[arg(long)]
    pub allow_unsigned: bool,
}

#[derive(Debug, Subcommand)]
pub enum StoreCmd {
    /// Compare a stopped coordinator's store with its seal: does it hold every acknowledged write?
    Check {
        #[arg(long)]
        data_dir: PathBuf,
    },
    /// Accept a stopped coordinator's store as it is after it lost writes (when no backup is
    /// newer): seals it at what it holds, so the coordinator starts again.
    Reseal {
        #[arg(long)]
        data_dir: PathBuf,
    },
    /// Copy a stopped coordinator's sled store into the PostgreSQL store its config names
    /// (`[store] url`), so several coordinators can share it. Refuses a database that holds
    /// records or that a coordinator leads.
    Migrate {
        /// The data directory of the stopped coordinator whose store is copied.
        #[arg(long)]
        data_dir: PathBuf,
        /// The coordinator config whose `[store]` section names the database.
        #[arg(long)]
        config: PathBuf,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum StoreCmdError {
    #[error(transparent)]
    Backup(#[from] BackupError),
    #[error("{source} (is the coordinator running? it keeps its store locked: use `flotilla backup` without --data-dir to ask it, or stop it to restore)")]
    Open { source: StoreError },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Keys(#[from] KeysError),
    #[error(transparent)]
    Migrate(#[from] crate::cli::migrate::MigrateError),
}

fn open(data_dir: &std::path::Path) -> Result<Store, StoreCmdError> {
    Store::open(data_dir.join("db")).map_err(|source| StoreCmdError::Open { source })
}

/// What a backup says to the operator.
pub fn describe_backup(info: &BackupInfo) -> String {
    let signed = match &info.signed_by {
        Some(key) => format!(", signed by coordinator key {key}"),
        None => ", unsigned".to_owned(),
    };
    format!(
        "backup written to {}: {} records, {} bytes, store generation {}, sha256 {}{signed}\n",
        info.path, info.records, info.bytes, info.generation, info.sha256
    )
}

/// `flotilla backup --data-dir D --out F --coordinator-key K`: backs up a stopped
/// coordinator's store, signed with its key.
pub fn backup_offline(args: &BackupArgs, now: u64) -> Result<Option<BackupInfo>, StoreCmdError> {
    let (Some(data_dir), Some(out), Some(key)) = (&args.data_dir, &args.out, &args.coordinator_key)
    else {
        return Ok(None);
    };
    let key = keys::load_secret_key(key)?;
    let store = open(data_dir)?;
    Ok(Some(backup::write_backup(&store, out, now, &key)?))
}

/// The coordinator keys a restore believes: `--coordinator-key`'s and every `--trust-key`.
fn trusted_keys(args: &RestoreArgs) -> Result<Vec<flotilla_protocol::VerifyingKey>, KeysError> {
    let mut trusted = Vec::new();
    if let Some(path) = &args.coordinator_key {
        trusted.push(keys::load_secret_key(path)?.verifying_key());
    }
    for path in &args.trust_key {
        trusted.push(keys::load_public_key(path)?);
    }
    Ok(trusted)
}

/// `flotilla restore`.
pub fn restore(args: &RestoreArgs, now: u64) -> Result<i32, StoreCmdError> {
    let keys = trusted_keys(args)?;
    let trust = Trust {
        keys: &keys,
        allow_unsigned: args.allow_unsigned,
    };
    let restored = backup::restore(
        &args.data_dir.join("db"),
        &args.from,
        args.force,
        now,
        trust,
    )
    .map_err(|e| match e {
        BackupError::Store(source) => StoreCmdError::Open { source },
        other => StoreCmdError::Backup(other),
    })?;
    if let Some(aside) = &restored.moved_aside {
        outln!("the previous store was moved to {}", aside.display());
    }
    match &restored.signer {
        Some(key) => outln!(
            "the backup's signature verifies: coordinator key {}",
            flotilla_protocol::hex::encode(key.as_bytes())
        ),
        None => outln!("the backup is unsigned (version 1), restored as --allow-unsigned asked"),
    }
    outln!(
        "restored {} records into {}; the store is at generation {} and sealed",
        restored.records,
        args.data_dir.join("db").display(),
        restored.generation
    );
    Ok(0)
}

/// `flotilla store check|reseal`. `check` exits 1 when writes were lost.
pub fn store(cmd: &StoreCmd) -> Result<i32, StoreCmdError> {
    match cmd {
        StoreCmd::Check { data_dir } => {
            let store = open(data_dir)?;
            match store.check_seal()? {
                SealCheck::Intact => {
                    outln!(
                        "intact: the store holds all {} acknowledged commits",
                        store.generation()
                    );
                    Ok(0)
                }
                SealCheck::Unsealed => {
                    outln!(
                        "unsealed: the store holds {} commits and has no seal yet (the next write seals it)",
                        store.generation()
                    );
                    Ok(0)
                }
                SealCheck::Lost { stored, sealed } => {
                    outln!(
                        "lost writes: the store holds {stored} commits but {sealed} were acknowledged; \
                         restore the latest backup (`flotilla restore`) or accept it as it is \
                         (`flotilla store reseal`)"
                    );
                    Ok(1)
                }
            }
        }
        StoreCmd::Migrate { data_dir, config } => {
            let done = crate::cli::migrate::migrate(data_dir, config)?;
            outln!(
                "copied {} records from {} into {}; start the coordinators with this config",
                done.records,
                data_dir.join("db").display(),
                done.into
            );
            Ok(0)
        }
        StoreCmd::Reseal { data_dir } => {
            let store = open(data_dir)?;
            let before = store.check_seal()?;
            store.reseal()?;
            match before {
                SealCheck::Lost { stored, sealed } => outln!(
                    "resealed at {stored} commits: the {} acknowledged commits that were lost are \
                     given up",
                    sealed - stored
                ),
                _ => outln!(
                    "resealed at {} commits (nothing was lost)",
                    store.generation()
                ),
            }
            Ok(0)
        }
    }
}
use crate::cli::out::outln;
