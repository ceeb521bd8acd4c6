//! Persistence in sled, so a restarted coordinator continues where it stopped.
//!
//! Trees keyed by name, most with the JSON of one record as the value:
//!
//! ```text
//! rollouts       rollout name  -> Rollout          (engine state)
//! strategies     strategy name -> StoredStrategy   (`flotilla strategy create`)
//! device_groups  group name    -> DeviceGroup      (`flotilla group create`)
//! enrollments    device id     -> Enrollment       (device keys and whether they are accepted)
//! used_tokens    sha256 hex    -> unix time        (enrollment tokens already used up)
//! issued         device id     -> u64 big-endian   (`issued_at` of the last desired action)
//! meta           "generation"  -> u64 big-endian   (commits so far, see below)
//! published      device id     -> 32 bytes         (digest of the last desired action published)
//! ```
//!
//! `published` is a cache, not a record: it lets a restarted coordinator recognise its own
//! retained desired actions by their bytes instead of checking each signature again
//! ([`published_digest`]). It is not in backups; without it the signatures are checked.
//!
//! Every flushed write is a commit: it bumps the generation in the same flush and then writes
//! it to the seal file beside the database (`seal.rs`), so a store that comes back from a
//! damaged log with fewer commits than were acknowledged is reported at start
//! ([`Store::check_seal`]). [`Store::export`] and [`Store::import`] copy every tree for
//! `flotilla backup` and `flotilla restore` (`backup.rs`).
//!
//! JSON rather than postcard because it is self-describing: a record written by an older version
//! still decodes when fields with defaults were added since. Every write is flushed before it
//! returns, because the engine's contract is that a rollout is persisted before the desired
//! actions it justifies are published (docs/decisions/0003-coordinator-engine.md), and an operator
//! who was told "stored" must find the strategy or group after a restart.
//!
//! A record that does not decode is logged, naming it, and skipped, so one bad record cannot keep
//! the coordinator from starting; it stays in the database for an operator to inspect.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use flotilla_rollout::engine::Rollout;
use flotilla_rollout::planner::DeviceGroup;

use crate::service::enrollment::Enrollment;
use crate::service::seal::{Seal, SealCheck};

pub mod backend;
pub mod postgres;

/// sled's page cache; rollouts are read once at startup and then written, so a small cache is enough.
const CACHE_CAPACITY: u64 = 8 * 1024 * 1024;

const ROLLOUTS: &str = "rollouts";
const STRATEGIES: &str = "strategies";
const DEVICE_GROUPS: &str = "device_groups";
/// Device id -> `issued_at` of the last desired action signed for it (big-endian u64).
const ISSUED: &str = "issued";
const ENROLLMENTS: &str = "enrollments";
const USED_TOKENS: &str = "used_tokens";
const META: &str = "meta";
/// Device id -> [`published_digest`] of the last desired action published for it.
const PUBLISHED: &str = "published";
const GENERATION: &[u8] = b"generation";
/// What [`Store::save_published`] keeps of a retained desired action: sha256 over the signing
/// key's public half and the payload as published. Retained bytes with the digest stored for
/// their device are exactly what this coordinator, with this key, published last; any other
/// bytes (another key, an older action, a forgery) have their signature checked.
pub fn published_digest(key: &flotilla_protocol::VerifyingKey, payload: &[u8]) -> [u8; 32] {
    use sha2::Digest as _;
    let mut hash = sha2::Sha256::new();
    hash.update(b"flotilla published desired v1\0");
    hash.update(key.as_bytes());
    hash.update(payload);
    hash.finalize().into()
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

/// One exported record: its tree, key and value.
pub type Record = (&'static str, Vec<u8>, Vec<u8>);

/// The trees a backup holds, in the order they are written.
pub const TREES: [&str; 7] = [
    ROLLOUTS,
    STRATEGIES,
    DEVICE_GROUPS,
    ISSUED,
    ENROLLMENTS,
    USED_TOKENS,
    META,
];

/// A staged update strategy as the operator wrote it: the TOML text (`[[stage]]` entries) under
/// a name that staged rollout specs refer to. The text is kept verbatim so `strategy show`
/// prints exactly what was stored; it is parsed when a rollout uses it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredStrategy {
    pub name: String,
    pub text: String,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open the rollout store at {}: {source}", path.display())]
    Open { path: PathBuf, source: sled::Error },
    #[error("cannot encode rollout {rollout}: {source}")]
    Encode {
        rollout: String,
        source: serde_json::Error,
    },
    #[error("cannot write rollout {rollout}: {source}")]
    Write {
        rollout: String,
        source: sled::Error,
    },
    #[error("cannot delete rollout {rollout}: {source}")]
    Delete {
        rollout: String,
        source: sled::Error,
    },
    #[error("cannot read the rollout store: {source}")]
    Read { source: sled::Error },
    #[error("cannot record the last action issued to device {device}: {source}")]
    WriteIssued { device: String, source: sled::Error },
    #[error("cannot encode {kind} {name}: {source}")]
    EncodeRecord {
        kind: &'static str,
        name: String,
        source: serde_json::Error,
    },
    #[error("cannot write {kind} {name}: {source}")]
    WriteRecord {
        kind: &'static str,
        name: String,
        source: sled::Error,
    },
    #[error("cannot delete {kind} {name}: {source}")]
    DeleteRecord {
        kind: &'static str,
        name: String,
        source: sled::Error,
    },
    #[error("cannot read {kind} {name}: {source}")]
    ReadRecord {
        kind: &'static str,
        name: String,
        source: sled::Error,
    },
    #[error("stored {kind} {name} does not decode: {source}")]
    DecodeRecord {
        kind: &'static str,
        name: String,
        source: serde_json::Error,
    },
    #[error("{}: {reason}", path.display())]
    Seal { path: PathBuf, reason: String },
    #[error("cannot import into the store: {source}")]
    Import { source: sled::Error },
}

/// The coordinator's sled database.
///
/// After a failed write sled refuses every later write of that instance, even once space
/// returns; [`Store::reopen`] closes it and opens the files again.
pub struct Store {
    path: PathBuf,
    seal: Seal,
    /// Commits so far; mirrors `meta/generation`.
    generation: AtomicU64,
    /// `None` only when a reopen failed: every call then fails naming why.
    trees: Option<Trees>,
}

/// The open database and its trees.
struct Trees {
    db: sled::Db,
    meta: sled::Tree,
    rollouts: sled::Tree,
    strategies: sled::Tree,
    device_groups: sled::Tree,
    issued: sled::Tree,
    published: sled::Tree,
    enrollments: sled::Tree,
    used_tokens: sled::Tree,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.path)
            .field("generation", &self.generation())
            .field("open", &self.trees.is_some())
            .finish()
    }
}

/// One tree of named JSON records, and what to call a record in messages.
struct Records<'a> {
    store: &'a Store,
    tree: fn(&Trees) -> &sled::Tree,
    kind: &'static str,
}

impl Records<'_> {
    fn tree(&self) -> Result<&sled::Tree, sled::Error> {
        Ok((self.tree)(self.store.t()?))
    }

    fn save<T: Serialize>(&self, name: &str, record: &T) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(record).map_err(|source| StoreError::EncodeRecord {
            kind: self.kind,
            name: name.to_owned(),
            source,
        })?;
        let write_error = |source| StoreError::WriteRecord {
            kind: self.kind,
            name: name.to_owned(),
            source,
        };
        self.tree()
            .and_then(|tree| tree.insert(name.as_bytes(), bytes))
            .map_err(write_error)?;
        self.store.commit().map_err(write_error)
    }

    /// The record named `name`, `None` when there is none. A record that does not decode is an
    /// error here (the caller asked for this one), unlike in [`Records::list`].
    fn load<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, StoreError> {
        let bytes = self
            .tree()
            .and_then(|tree| tree.get(name.as_bytes()))
            .map_err(|source| StoreError::ReadRecord {
                kind: self.kind,
                name: name.to_owned(),
                source,
            })?;
        bytes
            .map(|b| {
                serde_json::from_slice(&b).map_err(|source| StoreError::DecodeRecord {
                    kind: self.kind,
                    name: name.to_owned(),
                    source,
                })
            })
            .transpose()
    }

    /// Every record that decodes, in name order; the others are logged and skipped.
    fn list<T: DeserializeOwned>(&self) -> Result<Vec<T>, StoreError> {
        let mut records = Vec::new();
        let tree = self.tree().map_err(|source| StoreError::Read { source })?;
        for item in tree.iter() {
            let (key, value) = item.map_err(|source| StoreError::Read { source })?;
            let name = String::from_utf8_lossy(&key);
            match serde_json::from_slice::<T>(&value) {
                Ok(record) => records.push(record),
                Err(error) => tracing::warn!(
                    kind = self.kind,
                    name = %name,
                    %error,
                    "skipping stored {} {name:?}: it does not decode ({error}); it stays in the store",
                    self.kind
                ),
            }
        }
        Ok(records)
    }

    /// Removes a record; returns whether it existed.
    fn delete(&self, name: &str) -> Result<bool, StoreError> {
        let delete_error = |source| StoreError::DeleteRecord {
            kind: self.kind,
            name: name.to_owned(),
            source,
        };
        let old = self
            .tree()
            .and_then(|tree| tree.remove(name.as_bytes()))
            .map_err(delete_error)?;
        self.store.commit().map_err(delete_error)?;
        Ok(old.is_some())
    }
}

impl Store {
    /// Opens (or creates) the database directory at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Store, StoreError> {
        let path = path.as_ref();
        let trees = Trees::open(path)?;
        let generation = read_generation(&trees.meta).map_err(|source| StoreError::Open {
            path: path.to_owned(),
            source,
        })?;
        Ok(Store {
            path: path.to_owned(),
            seal: Seal::for_store(path),
            generation: AtomicU64::new(generation),
            trees: Some(trees),
        })
    }

    /// Closes the database and opens it again: the way back to a writable store after a write
    /// failed (a full disk). Closing first, because sled locks its files.
    pub fn reopen(&mut self) -> Result<(), StoreError> {
        self.trees = None;
        let trees = Trees::open(&self.path)?;
        let generation = read_generation(&trees.meta).map_err(|source| StoreError::Open {
            path: self.path.clone(),
            source,
        })?;
        self.generation.store(generation, Ordering::Relaxed);
        self.trees = Some(trees);
        Ok(())
    }

    /// Gives up the database without closing it. sled's close can wait forever on a disk that
    /// is still full; a process leaving after a failed write calls this instead of dropping.
    pub fn abandon(mut self) {
        if let Some(trees) = self.trees.take() {
            std::mem::forget(trees);
        }
    }

    /// The database directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn t(&self) -> Result<&Trees, sled::Error> {
        self.trees.as_ref().ok_or_else(|| {
            sled::Error::Io(std::io::Error::other(format!(
                "the store at {} is closed: reopening it after a failed write did not succeed",
                self.path.display()
            )))
        })
    }

    fn strategies(&self) -> Records<'_> {
        Records {
            store: self,
            tree: |t| &t.strategies,
            kind: "strategy",
        }
    }

    fn groups(&self) -> Records<'_> {
        Records {
            store: self,
            tree: |t| &t.device_groups,
            kind: "device group",
        }
    }

    fn enrollment_records(&self) -> Records<'_> {
        Records {
            store: self,
            tree: |t| &t.enrollments,
            kind: "device enrollment",
        }
    }

    fn token_records(&self) -> Records<'_> {
        Records {
            store: self,
            tree: |t| &t.used_tokens,
            kind: "used enrollment token",
        }
    }

    /// Stores (or replaces) a device's enrollment, flushed before returning.
    pub fn save_enrollment(&self, enrollment: &Enrollment) -> Result<(), StoreError> {
        self.enrollment_records()
            .save(&enrollment.device, enrollment)
    }

    /// Every stored enrollment that decodes, in device order.
    pub fn list_enrollments(&self) -> Result<Vec<Enrollment>, StoreError> {
        self.enrollment_records().list()
    }

    /// Records that the enrollment token with this sha256 (hex) is used up, at `at`.
    pub fn use_token(&self, digest: &str, at: u64) -> Result<(), StoreError> {
        self.token_records().save(digest, &at)
    }

    /// The sha256 (hex) of every used-up enrollment token.
    pub fn used_tokens(&self) -> Result<Vec<String>, StoreError> {
        let mut out = Vec::new();
        let tree = &self
            .t()
            .map_err(|source| StoreError::Read { source })?
            .used_tokens;
        for item in tree.iter() {
            let (key, _) = item.map_err(|source| StoreError::Read { source })?;
            out.push(String::from_utf8_lossy(&key).into_owned());
        }
        Ok(out)
    }

    /// Stores (or replaces) a staged strategy, flushed before returning.
    pub fn save_strategy(&self, strategy: &StoredStrategy) -> Result<(), StoreError> {
        self.strategies().save(&strategy.name, strategy)
    }

    /// The stored strategy named `name`, if any.
    pub fn load_strategy(&self, name: &str) -> Result<Option<StoredStrategy>, StoreError> {
        self.strategies().load(name)
    }

    /// Every stored strategy that decodes, in name order.
    pub fn list_strategies(&self) -> Result<Vec<StoredStrategy>, StoreError> {
        self.strategies().list()
    }

    /// Removes a strategy; returns whether it was stored. Rollouts already created from it keep
    /// their resolved copy (KubeFleet's strategy snapshot).
    pub fn delete_strategy(&self, name: &str) -> Result<bool, StoreError> {
        self.strategies().delete(name)
    }

    /// Stores (or replaces) a device group, flushed before returning.
    pub fn save_group(&self, group: &DeviceGroup) -> Result<(), StoreError> {
        self.groups().save(&group.name, group)
    }

    /// The device group named `name`, if any.
    pub fn load_group(&self, name: &str) -> Result<Option<DeviceGroup>, StoreError> {
        self.groups().load(name)
    }

    /// Every stored device group that decodes, in name order.
    pub fn list_groups(&self) -> Result<Vec<DeviceGroup>, StoreError> {
        self.groups().list()
    }

    /// Removes a device group; returns whether it was stored.
    pub fn delete_group(&self, name: &str) -> Result<bool, StoreError> {
        self.groups().delete(name)
    }

    /// Writes a rollout and flushes it to disk before returning.
    pub fn save_rollout(&self, rollout: &Rollout) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(rollout).map_err(|source| StoreError::Encode {
            rollout: rollout.name.clone(),
            source,
        })?;
        let write_error = |source| StoreError::Write {
            rollout: rollout.name.clone(),
            source,
        };
        self.t()
            .and_then(|t| t.rollouts.insert(rollout.name.as_bytes(), bytes))
            .map_err(write_error)?;
        self.commit().map_err(write_error)
    }

    /// Every stored rollout that decodes, in name order. Records that do not decode are logged
    /// and skipped.
    pub fn load_rollouts(&self) -> Result<Vec<Rollout>, StoreError> {
        let mut rollouts = Vec::new();
        let tree = &self
            .t()
            .map_err(|source| StoreError::Read { source })?
            .rollouts;
        for item in tree.iter() {
            let (key, value) = item.map_err(|source| StoreError::Read { source })?;
            let name = String::from_utf8_lossy(&key);
            match serde_json::from_slice::<Rollout>(&value) {
                Ok(rollout) => rollouts.push(rollout),
                Err(error) => tracing::warn!(
                    rollout = %name,
                    %error,
                    "skipping stored rollout {name:?}: it does not decode ({error}); it stays in the store"
                ),
            }
        }
        Ok(rollouts)
    }

    /// The `issued_at` of the last desired action signed for each device. Entries that do not
    /// decode are skipped: the sequence then restarts from the clock for that device.
    pub fn load_issued(&self) -> Result<HashMap<String, u64>, StoreError> {
        let mut issued = HashMap::new();
        let tree = &self
            .t()
            .map_err(|source| StoreError::Read { source })?
            .issued;
        for item in tree.iter() {
            let (key, value) = item.map_err(|source| StoreError::Read { source })?;
            if let (Ok(device), Ok(at)) = (
                String::from_utf8(key.to_vec()),
                <[u8; 8]>::try_from(value.as_ref()),
            ) {
                issued.insert(device, u64::from_be_bytes(at));
            }
        }
        Ok(issued)
    }

    /// The [`published_digest`] of the last desired action published for `device`, if known.
    pub fn published(&self, device: &str) -> Option<[u8; 32]> {
        let value = self.t().ok()?.published.get(device.as_bytes()).ok()??;
        <[u8; 32]>::try_from(value.as_ref()).ok()
    }

    /// Records the [`published_digest`] of the desired action just published for `device`. Not
    /// flushed here (the rollout save before every publish flushes); a digest that is lost or
    /// stale only means a signature check.
    pub fn save_published(&self, device: &str, digest: &[u8; 32]) -> Result<(), sled::Error> {
        self.t()?
            .published
            .insert(device.as_bytes(), digest.as_slice())?;
        Ok(())
    }

    /// Records the `issued_at` of the desired action just signed for `device`. Not flushed
    /// here: the rollout save that precedes every publish flushes the database.
    pub fn save_issued(&self, device: &str, at: u64) -> Result<(), StoreError> {
        self.t()
            .and_then(|t| t.issued.insert(device.as_bytes(), &at.to_be_bytes()))
            .map_err(|source| StoreError::WriteIssued {
                device: device.to_owned(),
                source,
            })?;
        Ok(())
    }

    /// Removes a rollout; removing one that is not stored is not an error.
    pub fn delete_rollout(&self, name: &str) -> Result<(), StoreError> {
        let delete_error = |source| StoreError::Delete {
            rollout: name.to_owned(),
            source,
        };
        self.t()
            .and_then(|t| t.rollouts.remove(name.as_bytes()))
            .map_err(delete_error)?;
        self.commit().map_err(delete_error)
    }

    /// Makes everything written so far durable as one commit: bumps the generation in the same
    /// flush, then seals it. A seal that cannot be written fails the commit like a flush would
    /// (it is the same disk).
    fn commit(&self) -> Result<(), sled::Error> {
        let next = self.generation.load(Ordering::Relaxed) + 1;
        let t = self.t()?;
        t.meta.insert(GENERATION, &next.to_be_bytes())?;
        t.db.flush()?;
        release_deferred_frees();
        self.generation.store(next, Ordering::Relaxed);
        self.seal.write(next).map_err(|e| {
            sled::Error::Io(std::io::Error::new(
                e.kind(),
                format!(
                    "cannot write the store seal {}: {e}",
                    self.seal.path().display()
                ),
            ))
        })
    }

    /// Commits so far.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Whether the store holds every commit its seal remembers (see `seal.rs`).
    pub fn check_seal(&self) -> Result<SealCheck, StoreError> {
        self.seal
            .check(self.generation())
            .map_err(|reason| StoreError::Seal {
                path: self.seal.path().to_owned(),
                reason,
            })
    }

    /// Seals the store at its current generation: after an operator accepted a loss, or after
    /// a restore.
    pub fn reseal(&self) -> Result<(), StoreError> {
        self.seal
            .write(self.generation())
            .map_err(|e| StoreError::Seal {
                path: self.seal.path().to_owned(),
                reason: e.to_string(),
            })
    }

    /// Every record of every tree, tree by tree in [`TREES`] order, keys in order.
    pub fn export(&self) -> Result<Vec<Record>, StoreError> {
        let mut out = Vec::new();
        for name in TREES {
            let tree = self
                .t()
                .and_then(|t| t.db.open_tree(name))
                .map_err(|source| StoreError::Read { source })?;
            for item in tree.iter() {
                let (key, value) = item.map_err(|source| StoreError::Read { source })?;
                out.push((name, key.to_vec(), value.to_vec()));
            }
        }
        Ok(out)
    }

    /// Whether the store holds no records at all.
    pub fn is_empty(&self) -> bool {
        TREES
            .iter()
            .filter_map(|name| self.t().ok()?.db.open_tree(name).ok())
            .all(|tree| tree.is_empty())
    }

    /// Writes exported records (see [`Store::export`]) and commits them; trees not in
    /// [`TREES`] are refused by the caller. The generation becomes the imported one plus this
    /// commit.
    pub fn import(&self, records: &[(String, Vec<u8>, Vec<u8>)]) -> Result<(), StoreError> {
        for (tree, key, value) in records {
            let tree = self
                .t()
                .and_then(|t| t.db.open_tree(tree))
                .map_err(|source| StoreError::Import { source })?;
            tree.insert(key.as_slice(), value.as_slice())
                .map_err(|source| StoreError::Import { source })?;
        }
        let imported = self
            .t()
            .and_then(|t| read_generation(&t.meta))
            .map_err(|source| StoreError::Import { source })?;
        self.generation.store(imported, Ordering::Relaxed);
        self.commit()
            .map_err(|source| StoreError::Import { source })
    }
}

impl Trees {
    fn open(path: &Path) -> Result<Trees, StoreError> {
        let open_error = |source| StoreError::Open {
            path: path.to_owned(),
            source,
        };
        remove_empty_snapshots(path);
        let db = sled::Config::new()
            .path(path)
            .cache_capacity(CACHE_CAPACITY)
            .open()
            .map_err(open_error)?;
        Ok(Trees {
            meta: db.open_tree(META).map_err(open_error)?,
            rollouts: db.open_tree(ROLLOUTS).map_err(open_error)?,
            strategies: db.open_tree(STRATEGIES).map_err(open_error)?,
            device_groups: db.open_tree(DEVICE_GROUPS).map_err(open_error)?,
            issued: db.open_tree(ISSUED).map_err(open_error)?,
            published: db.open_tree(PUBLISHED).map_err(open_error)?,
            enrollments: db.open_tree(ENROLLMENTS).map_err(open_error)?,
            used_tokens: db.open_tree(USED_TOKENS).map_err(open_error)?,
            db,
        })
    }
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

/// The generation stored in `meta` (0 for a store without one).
fn read_generation(meta: &sled::Tree) -> Result<u64, sled::Error> {
    Ok(meta
        .get(GENERATION)?
        .and_then(|v| <[u8; 8]>::try_from(v.as_ref()).ok())
        .map_or(0, u64::from_be_bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_protocol::DeviceState;
    use flotilla_rollout::engine::{Engine, ReleaseRef};
    use flotilla_rollout::spec::RolloutSpec;
    use flotilla_rollout::zoneinfo::SystemZones;

    #[test]
    fn published_digests_survive_a_reopen_and_name_key_and_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ours = flotilla_protocol::SigningKey::from_bytes(&[1; 32]).verifying_key();
        let other = flotilla_protocol::SigningKey::from_bytes(&[2; 32]).verifying_key();
        let digest = published_digest(&ours, b"retained bytes");
        {
            let store = Store::open(dir.path().join("db")).expect("open");
            assert_eq!(store.published("dev-1"), None, "nothing published yet");
            store.save_published("dev-1", &digest).expect("save");
            store
                .save_rollout(&rollout("r1"))
                .expect("a flushed commit");
        }
        let store = Store::open(dir.path().join("db")).expect("reopen");
        assert_eq!(store.published("dev-1"), Some(digest));
        assert_eq!(store.published("dev-2"), None);
        assert_ne!(
            digest,
            published_digest(&ours, b"retained bytez"),
            "other bytes"
        );
        assert_ne!(
            digest,
            published_digest(&other, b"retained bytes"),
            "another key"
        );
        assert!(
            store
                .export()
                .expect("export")
                .iter()
                .all(|(tree, _, _)| *tree != PUBLISHED),
            "a cache, not in backups"
        );
    }

    /// A started rollout over three devices, the way the engine builds it.
    fn rollout(name: &str) -> Rollout {
        let mut engine = Engine::new(SystemZones);
        for id in ["dev-1", "dev-2", "dev-3"] {
            engine.observe_state(
                DeviceState {
                    device_id: id.into(),
                    hardware_id: "pi4".into(),
                    labels: vec![("env".into(), "prod".into())],
                    installed: None,
                    current: None,
                    online: true,
                    agent_version: "0.1.0".into(),
                    at: 1,
                },
                1,
            );
        }
        let spec = RolloutSpec::from_toml(&format!(
            "name = \"{name}\"\nrelease = \"fw-1\"\nselect = \"env in (prod, beta)\"\n[groups]\n\
             error = {{ threshold = \"10%\" }}\n[[groups.group]]\nname = \"canary\"\npercent = 33\n[[groups.group]]\n"
        ), &SystemZones)
        .expect("valid spec");
        let release = ReleaseRef {
            name: "fw-1".into(),
            counter: 1,
            hardware: vec![],
        };
        engine.create_rollout(spec, release, 100).expect("created");
        engine.start(name, 101).expect("started");
        engine.rollout(name).expect("exists").clone()
    }

    #[test]
    fn saved_rollouts_survive_a_reopen() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("db");
        let (a, b) = (rollout("a"), rollout("b"));
        {
            let store = Store::open(&path).expect("opens");
            store.save_rollout(&b).expect("saved");
            store.save_rollout(&a).expect("saved");
        }
        let store = Store::open(&path).expect("reopens");
        let loaded = store.load_rollouts().expect("loads");
        assert_eq!(loaded, vec![a.clone(), b], "equal, in name order");
        assert_eq!(loaded[0].groups[0].devices, vec!["dev-1"]);

        store.delete_rollout("b").expect("deleted");
        store
            .delete_rollout("never-existed")
            .expect("deleting nothing is fine");
        drop(store);
        let store = Store::open(&path).expect("reopens");
        assert_eq!(store.load_rollouts().expect("loads"), vec![a]);
    }

    #[test]
    fn a_record_that_does_not_decode_is_skipped() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = Store::open(dir.path().join("db")).expect("opens");
        store.save_rollout(&rollout("good")).expect("saved");
        store
            .t()
            .expect("open")
            .rollouts
            .insert("broken", &b"{\"name\": 3"[..])
            .expect("raw insert");
        let loaded = store
            .load_rollouts()
            .expect("startup is not blocked by one bad record");
        assert_eq!(
            loaded.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
            vec!["good"]
        );
        assert!(
            store
                .t()
                .expect("open")
                .rollouts
                .contains_key("broken")
                .expect("reads"),
            "the bad record is kept for inspection"
        );
    }

    fn group(name: &str, select: &str, labels: &[(&str, &str)]) -> DeviceGroup {
        DeviceGroup {
            name: name.into(),
            select: flotilla_rollout::selector::Selector::parse(select).expect("valid selector"),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }

    #[test]
    fn strategies_round_trip_in_name_order_and_survive_a_reopen() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("db");
        let text = "[[stage]]\nname = \"canary\"\nselect = \"env=canary\"\n# kept verbatim\n";
        let canary = StoredStrategy {
            name: "two-stage".into(),
            text: text.into(),
        };
        let other = StoredStrategy {
            name: "a-first".into(),
            text: "[[stage]]\nname = \"all\"\n".into(),
        };
        {
            let store = Store::open(&path).expect("opens");
            store.save_strategy(&canary).expect("saved");
            store.save_strategy(&other).expect("saved");
        }
        let store = Store::open(&path).expect("reopens");
        assert_eq!(
            store.load_strategy("two-stage").expect("reads"),
            Some(canary.clone()),
            "the text comes back byte for byte, comments included"
        );
        assert_eq!(store.load_strategy("missing").expect("reads"), None);
        assert_eq!(
            store.list_strategies().expect("lists"),
            vec![other.clone(), canary.clone()],
            "in name order"
        );

        let replaced = StoredStrategy {
            name: "two-stage".into(),
            text: "[[stage]]\nname = \"everyone\"\n".into(),
        };
        store.save_strategy(&replaced).expect("replaced");
        assert_eq!(
            store.load_strategy("two-stage").expect("reads"),
            Some(replaced)
        );
        assert!(store.delete_strategy("a-first").expect("deleted"));
        assert!(!store
            .delete_strategy("a-first")
            .expect("deleting twice is fine"));
        assert_eq!(store.list_strategies().expect("lists").len(), 1);
    }

    #[test]
    fn device_groups_round_trip_in_name_order_and_survive_a_reopen() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("db");
        let kitchens = group("kitchens", "site in (a, b), !quarantined", &[("tier", "1")]);
        let beta = group("beta", "ring=beta", &[]);
        {
            let store = Store::open(&path).expect("opens");
            store.save_group(&kitchens).expect("saved");
            store.save_group(&beta).expect("saved");
        }
        let store = Store::open(&path).expect("reopens");
        let listed = store.list_groups().expect("lists");
        assert_eq!(
            listed,
            vec![beta.clone(), kitchens.clone()],
            "in name order"
        );
        assert_eq!(
            listed[1].select.to_string(),
            "site in (a,b),!quarantined",
            "the selector is stored in its canonical form"
        );
        assert_eq!(store.load_group("kitchens").expect("reads"), Some(kitchens));
        assert!(store.delete_group("kitchens").expect("deleted"));
        assert!(!store
            .delete_group("kitchens")
            .expect("deleting twice is fine"));
        assert_eq!(store.load_group("kitchens").expect("reads"), None);
        drop(store);
        let store = Store::open(&path).expect("reopens");
        assert_eq!(store.list_groups().expect("lists"), vec![beta]);
    }

    #[test]
    fn a_group_record_that_does_not_decode_is_skipped_in_lists_and_named_when_asked_for() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = Store::open(dir.path().join("db")).expect("opens");
        store
            .save_group(&group("good", "env=prod", &[]))
            .expect("saved");
        store
            .t()
            .expect("open")
            .device_groups
            .insert(
                "broken",
                &br#"{"name":"broken","select":"env in ()","labels":{}}"#[..],
            )
            .expect("raw insert");
        let names: Vec<String> = store
            .list_groups()
            .expect("one bad record does not block the list")
            .into_iter()
            .map(|g| g.name)
            .collect();
        assert_eq!(names, vec!["good"]);
        let err = store.load_group("broken").expect_err("does not decode");
        assert!(err.to_string().contains("device group broken"), "{err}");
    }

    #[test]
    fn opening_a_path_that_is_a_file_names_it() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, b"x").expect("write");
        let err = Store::open(&file).expect_err("a file is not a database");
        assert!(err.to_string().contains("not-a-dir"), "{err}");
    }
}
