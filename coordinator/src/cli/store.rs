//! `flotilla backup`, `flotilla restore` and `flotilla store check|reseal`: the coordinator's
//! store, kept safe (docs/operations.md, "Backup and restore").
//!
//! A running coordinator holds its store locked, so an online backup is a control command (the
//! coordinator writes the file into its own `backups/` directory). Everything else works on the
//! data directory of a stopped coordinator.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use flotilla_protocol::control::BackupInfo;

use crate::service::backup::{self, BackupError};
use crate::service::seal::SealCheck;
use crate::service::store::{Store, StoreError};

#[derive(Debug, Args)]
pub struct BackupArgs {
    /// Read the store of a stopped coordinator in this data directory instead of asking a
    /// running one.
    #[arg(long, requires = "out")]
    pub data_dir: Option<PathBuf>,
    /// Where to write the backup (with --data-dir).
    #[arg(long, requires = "data_dir")]
    pub out: Option<PathBuf>,
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
}

#[derive(Debug, thiserror::Error)]
pub enum StoreCmdError {
    #[error(transparent)]
    Backup(#[from] BackupError),
    #[error("{source} (is the coordinator running? it keeps its store locked: use `flotilla backup` without --data-dir to ask it, or stop it to restore)")]
    Open { source: StoreError },
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn open(data_dir: &std::path::Path) -> Result<Store, StoreCmdError> {
    Store::open(data_dir.join("db")).map_err(|source| StoreCmdError::Open { source })
}

/// What a backup says to the operator.
pub fn describe_backup(info: &BackupInfo) -> String {
    format!(
        "backup written to {}: {} records, {} bytes, store generation {}, sha256 {}\n",
        info.path, info.records, info.bytes, info.generation, info.sha256
    )
}

/// `flotilla backup --data-dir D --out F`: backs up a stopped coordinator's store.
pub fn backup_offline(
    data_dir: &std::path::Path,
    out: &std::path::Path,
    now: u64,
) -> Result<BackupInfo, StoreCmdError> {
    let store = open(data_dir)?;
    Ok(backup::write_backup(&store, out, now)?)
}

/// `flotilla restore`.
pub fn restore(args: &RestoreArgs, now: u64) -> Result<i32, StoreCmdError> {
    let restored = backup::restore(&args.data_dir.join("db"), &args.from, args.force, now)
        .map_err(|e| match e {
            BackupError::Store(source) => StoreCmdError::Open { source },
            other => StoreCmdError::Backup(other),
        })?;
    if let Some(aside) = &restored.moved_aside {
        println!("the previous store was moved to {}", aside.display());
    }
    println!(
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
                    println!(
                        "intact: the store holds all {} acknowledged commits",
                        store.generation()
                    );
                    Ok(0)
                }
                SealCheck::Unsealed => {
                    println!(
                        "unsealed: the store holds {} commits and has no seal yet (the next write seals it)",
                        store.generation()
                    );
                    Ok(0)
                }
                SealCheck::Lost { stored, sealed } => {
                    println!(
                        "lost writes: the store holds {stored} commits but {sealed} were acknowledged; \
                         restore the latest backup (`flotilla restore`) or accept it as it is \
                         (`flotilla store reseal`)"
                    );
                    Ok(1)
                }
            }
        }
        StoreCmd::Reseal { data_dir } => {
            let store = open(data_dir)?;
            let before = store.check_seal()?;
            store.reseal()?;
            match before {
                SealCheck::Lost { stored, sealed } => println!(
                    "resealed at {stored} commits: the {} acknowledged commits that were lost are \
                     given up",
                    sealed - stored
                ),
                _ => println!(
                    "resealed at {} commits (nothing was lost)",
                    store.generation()
                ),
            }
            Ok(0)
        }
    }
}
