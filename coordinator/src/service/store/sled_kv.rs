//! The sled backend: the store in the data directory, for one coordinator on one box.
//!
//! Every [`Backend::write`] is a commit: its operations, then the generation (commits so far,
//! in tree `meta`) bumped, then one flush, then the generation written to the seal file beside
//! the database (`seal.rs`), so a store that comes back from a damaged log with fewer commits
//! than were acknowledged is reported at start ([`SledKv::check_seal`]).
//!
//! sled locks its directory, so a second coordinator cannot open the same store: a sled store
//! always has exactly one coordinator, which always leads (`leadership.rs`).
//!
//! After a failed write sled refuses every later write of that instance, even once space
//! returns; [`Backend::reopen`] closes it and opens the files again.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::service::seal::{Seal, SealCheck};
use crate::service::store::backend::{Backend, BackendError, Entries, Op};

/// sled's page cache; rollouts are read once at startup and then written, so a small cache is enough.
const CACHE_CAPACITY: u64 = 8 * 1024 * 1024;

/// The tree and key of the generation.
pub const META: &str = "meta";
const GENERATION: &[u8] = b"generation";

/// The coordinator's sled database.
pub struct SledKv {
    path: PathBuf,
    seal: Seal,
    /// Commits so far; mirrors `meta/generation`.
    generation: AtomicU64,
    /// `None` only when a reopen failed: every call then fails naming why.
    db: Option<Open>,
}

/// The open database and the trees opened so far.
struct Open {
    db: sled::Db,
    trees: std::sync::RwLock<HashMap<String, sled::Tree>>,
}

impl std::fmt::Debug for SledKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SledKv")
            .field("path", &self.path)
            .field("generation", &self.generation())
            .field("open", &self.db.is_some())
            .finish()
    }
}

impl SledKv {
    /// Opens (or creates) the database directory at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<SledKv, BackendError> {
        let path = path.as_ref();
        let db = Open::new(path)?;
        let generation = db.read_generation().map_err(|e| open_error(path, e))?;
        Ok(SledKv {
            path: path.to_owned(),
            seal: Seal::for_store(path),
            generation: AtomicU64::new(generation),
            db: Some(db),
        })
    }

    /// The database directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Commits so far.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Whether the store holds every commit its seal remembers (see `seal.rs`).
    pub fn check_seal(&self) -> Result<SealCheck, String> {
        self.seal.check(self.generation())
    }

    /// The seal file beside the database.
    pub fn seal_path(&self) -> &Path {
        self.seal.path()
    }

    /// Seals the store at its current generation: after an operator accepted a loss, or after
    /// a restore.
    pub fn reseal(&self) -> Result<(), String> {
        self.seal
            .write(self.generation())
            .map_err(|e| e.to_string())
    }

    /// Gives up the database without closing it. sled's close can wait forever on a disk that
    /// is still full; a process leaving after a failed write calls this instead of dropping.
    pub fn abandon(mut self) {
        if let Some(db) = self.db.take() {
            std::mem::forget(db);
        }
    }

    fn open_db(&self) -> Result<&Open, BackendError> {
        self.db.as_ref().ok_or_else(|| {
            BackendError::failed(
                self.describe(),
                "the store is closed: reopening it after a failed write did not succeed",
            )
        })
    }

    fn tree(&self, name: &str) -> Result<sled::Tree, BackendError> {
        self.open_db()?
            .tree(name)
            .map_err(|e| BackendError::failed(self.describe(), e))
    }

    /// Bumps the generation in the same flush as what was written, then seals it. A seal that
    /// cannot be written fails the commit like a flush would (it is the same disk).
    fn commit(&self, open: &Open, touched_meta: bool) -> Result<(), BackendError> {
        let failed = |e: sled::Error| BackendError::failed(self.describe(), e);
        if touched_meta {
            // An import brings the generation of the store it came from.
            let imported = open.read_generation().map_err(failed)?;
            self.generation.store(imported, Ordering::Relaxed);
        }
        let next = self.generation() + 1;
        open.tree(META)
            .and_then(|meta| meta.insert(GENERATION, &next.to_be_bytes()))
            .map_err(failed)?;
        open.db.flush().map_err(failed)?;
        release_deferred_frees();
        self.generation.store(next, Ordering::Relaxed);
        self.seal.write(next).map_err(|e| {
            BackendError::failed(
                self.describe(),
                format!(
                    "cannot write the store seal {}: {e}",
                    self.seal.path().display()
                ),
            )
        })
    }
}

impl Backend for SledKv {
    fn describe(&self) -> String {
        self.path.display().to_string()
    }

    fn get(&self, tree: &str, key: &[u8]) -> Result<Option<Vec<u8>>, BackendError> {
        self.tree(tree)?
            .get(key)
            .map(|v| v.map(|v| v.to_vec()))
            .map_err(|e| BackendError::failed(self.describe(), e))
    }

    fn scan(&self, tree: &str) -> Result<Entries, BackendError> {
        self.tree(tree)?
            .iter()
            .map(|item| {
                item.map(|(k, v)| (k.to_vec(), v.to_vec()))
                    .map_err(|e| BackendError::failed(self.describe(), e))
            })
            .collect()
    }

    fn write(&self, ops: Vec<Op>) -> Result<(), BackendError> {
        let open = self.open_db()?;
        let failed = |e: sled::Error| BackendError::failed(self.describe(), e);
        let mut touched_meta = false;
        for op in ops {
            match op {
                Op::Put { tree, key, value } => {
                    touched_meta |= tree == META;
                    open.tree(&tree)
                        .and_then(|t| t.insert(key, value))
                        .map_err(failed)?;
                }
                Op::Remove { tree, key } => {
                    open.tree(&tree)
                        .and_then(|t| t.remove(key))
                        .map_err(failed)?;
                }
            }
        }
        self.commit(open, touched_meta)
    }

    fn put_lazily(&self, tree: &str, key: &[u8], value: &[u8]) -> Result<(), BackendError> {
        self.tree(tree)?
            .insert(key, value)
            .map(drop)
            .map_err(|e| BackendError::failed(self.describe(), e))
    }

    fn is_empty(&self) -> Result<bool, BackendError> {
        let open = self.open_db()?;
        for name in open.db.tree_names() {
            if name.as_ref() == b"__sled__default" {
                continue;
            }
            let tree = open
                .db
                .open_tree(&name)
                .map_err(|e| BackendError::failed(self.describe(), e))?;
            if !tree.is_empty() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn reopen(&mut self) -> Result<(), BackendError> {
        self.db = None;
        let db = Open::new(&self.path)?;
        let generation = db
            .read_generation()
            .map_err(|e| open_error(&self.path, e))?;
        self.generation.store(generation, Ordering::Relaxed);
        self.db = Some(db);
        Ok(())
    }
}

impl Open {
    fn new(path: &Path) -> Result<Open, BackendError> {
        remove_empty_snapshots(path);
        let db = sled::Config::new()
            .path(path)
            .cache_capacity(CACHE_CAPACITY)
            .open()
            .map_err(|e| open_error(path, e))?;
        Ok(Open {
            db,
            trees: std::sync::RwLock::new(HashMap::new()),
        })
    }

    fn tree(&self, name: &str) -> Result<sled::Tree, sled::Error> {
        if let Some(tree) = self
            .trees
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
        {
            return Ok(tree.clone());
        }
        let tree = self.db.open_tree(name)?;
        self.trees
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_owned(), tree.clone());
        Ok(tree)
    }

    /// The generation stored in `meta` (0 for a store without one).
    fn read_generation(&self) -> Result<u64, sled::Error> {
        Ok(self
            .tree(META)?
            .get(GENERATION)?
            .and_then(|v| <[u8; 8]>::try_from(v.as_ref()).ok())
            .map_or(0, u64::from_be_bytes))
    }
}

fn open_error(path: &Path, e: sled::Error) -> BackendError {
    BackendError::failed(
        format!("cannot open the rollout store at {}", path.display()),
        e,
    )
}

/// Hands this thread's deferred frees to sled's garbage collector.
///
/// sled frees a superseded page (the old value of a rewritten rollout among them) through
/// crossbeam-epoch, which keeps what a thread defers in that thread's own bag until 64 items have
/// gathered. The service task moves between tokio's worker threads and a running rollout is saved
/// about once a second, so a few dozen superseded copies of a rollout record (4 MB at 100,000
/// devices) could wait in a bag for good: that was most of the memory a 100k rollout left behind
/// (decision 0034). Flushing after each commit lets the collector free them once no thread can
/// still be reading them. It costs one pin and a queue push per commit.
fn release_deferred_frees() {
    crossbeam_epoch::pin().flush();
}

/// An open that ran out of space leaves an empty snapshot file behind, and sled then refuses
/// the database as corrupt even once there is room. An empty snapshot holds nothing: removing it
/// makes sled rebuild the snapshot from its log, which holds the data.
fn remove_empty_snapshots(db: &Path) {
    let Ok(entries) = std::fs::read_dir(db) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let empty = entry.metadata().is_ok_and(|m| m.is_file() && m.len() == 0);
        if empty && name.to_string_lossy().starts_with("snap.") {
            tracing::warn!(file = %entry.path().display(), "removing an empty store snapshot left by an earlier start that ran out of space");
            let _ = std::fs::remove_file(entry.path());
        }
    }
}
