//! The agent's durable memory, in sled: action records with their persisted state, the
//! installed release, the report sequence number, the outbox of reports the broker has not
//! acknowledged yet, each action's bytes by source, and a mirror of the trust file.
//!
//! Every state change is flushed before the caller acts on it, because the state machine's
//! promise ("persisted before every side effect") is only as good as the flush. Values are
//! postcard; they never leave the device, but postcard keeps them small on small flash.
//!
//! If the database cannot be opened because it is damaged, it is moved aside to
//! `<data_dir>/db.corrupt-<unix time>` and the agent starts empty: the retained desired action
//! brings it back to what the coordinator wants, and the trust file still guards the release
//! counter.

use std::path::{Path, PathBuf};

use std::collections::BTreeMap;

use flotilla_protocol::{ByteCounts, InstalledRelease, Report, UnixTime};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::config::Config;
use crate::record::{ActionRecord, RollbackPoint};
use crate::trust_state::{self, TrustState};

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot create data directory {path}: {source}")]
    CreateDataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot open database {path}: {source}")]
    Open { path: PathBuf, source: sled::Error },
    #[error("database {path} is in use by another process (is the agent running?)")]
    Locked { path: PathBuf },
    #[error("cannot move damaged database {path} aside: {source}")]
    MoveAside {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {what} to the database: {source}")]
    Write { what: String, source: sled::Error },
    #[error("cannot read {what} from the database: {source}")]
    Read { what: String, source: sled::Error },
    #[error("database entry {what} is damaged: {reason}")]
    Decode { what: String, reason: String },
}

const CURRENT: &[u8] = b"current";
const INSTALLED: &[u8] = b"installed";
const SEQ: &[u8] = b"seq";
const TRUST: &[u8] = b"trust";
const LAST_ERROR: &[u8] = b"last_error";
const ROLLBACK: &[u8] = b"rollback";
const RESTARTS: &[u8] = b"restarts";

/// Handle to the agent's database; cheap to clone and shareable between tasks.
#[derive(Clone)]
pub struct Store {
    db: sled::Db,
    actions: sled::Tree,
    meta: sled::Tree,
    outbox: sled::Tree,
    /// action id -> where its downloaded bytes came from ([`ByteCounts`]).
    bytes: sled::Tree,
    /// Tests: make every action save fail, as a full disk would.
    #[cfg(test)]
    pub fail_saves: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

/// The database directory inside the data directory.
pub fn db_path(data_dir: &Path) -> PathBuf {
    data_dir.join("db")
}

/// Opens the agent's state in `config.data_dir` (creating the directory): the store, and the
/// trust state as the trust file and its mirror in the store, merged. The third value says that
/// a damaged database was moved aside (see [`Store::open`]). Used by the daemon, `status` and
/// `keys install`, so all three see the same state.
pub fn open_data_dir(config: &Config) -> Result<(Store, TrustState, Option<String>), StoreError> {
    std::fs::create_dir_all(&config.data_dir).map_err(|source| StoreError::CreateDataDir {
        path: config.data_dir.clone(),
        source,
    })?;
    let file = trust_state::read_trust_file(&config.data_dir);
    let (store, note) = Store::open(
        &config.data_dir,
        config.store.cache_bytes,
        file.now(trust_state::system_now(), config.trust.max_clock_skew),
    )?;
    // A mirror this build cannot read (written before the trust file gained fields) is
    // ignored: the trust file is the authority and the two are merged for safety only.
    let mirror = store.trust().unwrap_or_else(|e| {
        tracing::warn!("{e}; using the trust file alone");
        None
    });
    let trust = file.merge(mirror.unwrap_or_default());
    Ok((store, trust, note))
}

impl Store {
    /// Opens the database under `data_dir`. A damaged database is moved aside and replaced by
    /// an empty one; the second value then says what happened, for the log and the coordinator.
    pub fn open(
        data_dir: &Path,
        cache_bytes: u64,
        now: UnixTime,
    ) -> Result<(Self, Option<String>), StoreError> {
        let path = db_path(data_dir);
        match Self::open_at(&path, cache_bytes) {
            Ok(store) => Ok((store, None)),
            // Never "repair" a database another process holds: that would pull it away from
            // under a running agent.
            Err(source) if is_lock(&source) => Err(StoreError::Locked { path }),
            Err(source) if is_damage(&source) => {
                let aside = data_dir.join(format!("db.corrupt-{now}"));
                std::fs::rename(&path, &aside).map_err(|e| StoreError::MoveAside {
                    path: path.clone(),
                    source: e,
                })?;
                let note = format!(
                    "database {} could not be opened ({source}); moved it to {} and started empty",
                    path.display(),
                    aside.display()
                );
                let store = Self::open_at(&path, cache_bytes)
                    .map_err(|source| StoreError::Open { path, source })?;
                Ok((store, Some(note)))
            }
            Err(source) => Err(StoreError::Open { path, source }),
        }
    }

    fn open_at(path: &Path, cache_bytes: u64) -> Result<Self, sled::Error> {
        let db = sled::Config::new()
            .path(path)
            .cache_capacity(cache_bytes)
            .open()?;
        Ok(Self {
            actions: db.open_tree("actions")?,
            meta: db.open_tree("meta")?,
            outbox: db.open_tree("outbox")?,
            bytes: db.open_tree("bytes")?,
            db,
            #[cfg(test)]
            fail_saves: Default::default(),
        })
    }

    /// Makes everything written so far durable.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.db
            .flush()
            .map(|_| ())
            .map_err(|source| StoreError::Write {
                what: "flush".into(),
                source,
            })
    }

    fn put<T: Serialize>(
        &self,
        tree: &sled::Tree,
        key: &[u8],
        what: &str,
        value: &T,
    ) -> Result<(), StoreError> {
        let bytes = flotilla_protocol::envelope::to_bytes(value);
        tree.insert(key, bytes)
            .map(|_| ())
            .map_err(|source| StoreError::Write {
                what: what.to_owned(),
                source,
            })
    }

    fn get<T: DeserializeOwned>(
        &self,
        tree: &sled::Tree,
        key: &[u8],
        what: &str,
    ) -> Result<Option<T>, StoreError> {
        let Some(bytes) = tree.get(key).map_err(|source| StoreError::Read {
            what: what.to_owned(),
            source,
        })?
        else {
            return Ok(None);
        };
        postcard::from_bytes(&bytes)
            .map(Some)
            .map_err(|e| StoreError::Decode {
                what: what.to_owned(),
                reason: e.to_string(),
            })
    }

    /// The record of one action, if it was ever seen.
    pub fn action(&self, action_id: &str) -> Result<Option<ActionRecord>, StoreError> {
        self.get(
            &self.actions,
            action_id.as_bytes(),
            &format!("action {action_id}"),
        )
    }

    /// Saves an action record and makes it the current one, durably.
    pub fn save_action(&self, record: &ActionRecord) -> Result<(), StoreError> {
        self.save_action_unflushed(record)?;
        self.flush()
    }

    /// Saves an action record durably without making it the current one: a refusal that
    /// arrives while another action runs must not hide that action from a restart.
    pub fn save_action_aside(&self, record: &ActionRecord) -> Result<(), StoreError> {
        let what = format!("action {}", record.action_id);
        self.put(&self.actions, record.action_id.as_bytes(), &what, record)?;
        self.flush()
    }

    /// Saves an action record without flushing: for download progress, where losing the last
    /// few blocks to a power cut only means fetching them again.
    pub fn save_action_unflushed(&self, record: &ActionRecord) -> Result<(), StoreError> {
        let what = format!("action {}", record.action_id);
        #[cfg(test)]
        if self.fail_saves.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(StoreError::Write {
                what,
                source: sled::Error::Io(std::io::ErrorKind::StorageFull.into()),
            });
        }
        self.put(&self.actions, record.action_id.as_bytes(), &what, record)?;
        self.meta
            .insert(CURRENT, record.action_id.as_bytes())
            .map(|_| ())
            .map_err(|source| StoreError::Write {
                what: "current action".into(),
                source,
            })
    }

    /// Where the bytes of an action came from, if it downloaded any.
    pub fn action_bytes(&self, action_id: &str) -> Result<Option<ByteCounts>, StoreError> {
        self.get(
            &self.bytes,
            action_id.as_bytes(),
            &format!("bytes of action {action_id}"),
        )
    }

    /// Records where the bytes of an action came from, without flushing: saved with each block
    /// of download progress and flushed with it.
    pub fn set_action_bytes(&self, action_id: &str, bytes: &ByteCounts) -> Result<(), StoreError> {
        self.put(
            &self.bytes,
            action_id.as_bytes(),
            &format!("bytes of action {action_id}"),
            bytes,
        )
    }

    /// The peers an action stopped asking, by id, with the reason; empty if none.
    pub fn action_bypassed(&self, action_id: &str) -> Result<BTreeMap<String, String>, StoreError> {
        Ok(self
            .get(
                &self.bytes,
                bypassed_key(action_id).as_bytes(),
                &format!("bypassed peers of action {action_id}"),
            )?
            .unwrap_or_default())
    }

    /// Records the peers an action stopped asking, without flushing (saved with the bytes).
    pub fn set_action_bypassed(
        &self,
        action_id: &str,
        bypassed: &BTreeMap<String, String>,
    ) -> Result<(), StoreError> {
        self.put(
            &self.bytes,
            bypassed_key(action_id).as_bytes(),
            &format!("bypassed peers of action {action_id}"),
            bypassed,
        )
    }

    /// The action the agent is working on or finished last.
    pub fn current(&self) -> Result<Option<ActionRecord>, StoreError> {
        let id = self.meta.get(CURRENT).map_err(|source| StoreError::Read {
            what: "current action".into(),
            source,
        })?;
        match id {
            Some(id) => self.action(&String::from_utf8_lossy(&id)),
            None => Ok(None),
        }
    }

    pub fn installed(&self) -> Result<Option<InstalledRelease>, StoreError> {
        self.get(&self.meta, INSTALLED, "installed release")
    }

    pub fn set_installed(&self, release: &InstalledRelease) -> Result<(), StoreError> {
        self.put(&self.meta, INSTALLED, "installed release", release)?;
        self.flush()
    }

    /// Sets or (with `None`) forgets the installed release, durably.
    pub fn replace_installed(&self, release: Option<&InstalledRelease>) -> Result<(), StoreError> {
        match release {
            Some(r) => self.set_installed(r),
            None => {
                self.meta
                    .remove(INSTALLED)
                    .map_err(|source| StoreError::Write {
                        what: "installed release".into(),
                        source,
                    })?;
                self.flush()
            }
        }
    }

    /// What a signed rollback would return to, if anything.
    pub fn rollback_point(&self) -> Result<Option<RollbackPoint>, StoreError> {
        self.get(&self.meta, ROLLBACK, "rollback point")
    }

    /// Records (or with `None`, forgets) the rollback point, durably.
    pub fn set_rollback_point(&self, point: Option<&RollbackPoint>) -> Result<(), StoreError> {
        match point {
            Some(p) => self.put(&self.meta, ROLLBACK, "rollback point", p)?,
            None => {
                self.meta
                    .remove(ROLLBACK)
                    .map_err(|source| StoreError::Write {
                        what: "rollback point".into(),
                        source,
                    })?;
            }
        }
        self.flush()
    }

    /// Counts a start that found `record` unfinished, durably, and returns how many starts in a
    /// row found this action in exactly this state. Progress (a download that got further, a
    /// new state) starts the count again at 1.
    pub fn count_restart(&self, record: &ActionRecord) -> Result<u32, StoreError> {
        let state = flotilla_protocol::envelope::to_bytes(&record.state);
        let last: Option<(String, Vec<u8>, u32)> =
            self.get(&self.meta, RESTARTS, "restart count")?;
        let count = match last {
            Some((id, s, n)) if id == record.action_id && s == state => n.saturating_add(1),
            _ => 1,
        };
        self.put(
            &self.meta,
            RESTARTS,
            "restart count",
            &(record.action_id.clone(), state, count),
        )?;
        self.flush()?;
        Ok(count)
    }

    /// Forgets the restart count: the agent stopped cleanly, so the next start is not part of a
    /// crash loop.
    pub fn clear_restarts(&self) -> Result<(), StoreError> {
        self.meta
            .remove(RESTARTS)
            .map_err(|source| StoreError::Write {
                what: "restart count".into(),
                source,
            })?;
        self.flush()
    }

    pub fn trust(&self) -> Result<Option<TrustState>, StoreError> {
        self.get(&self.meta, TRUST, "trust state")
    }

    pub fn set_trust(&self, trust: &TrustState) -> Result<(), StoreError> {
        self.put(&self.meta, TRUST, "trust state", trust)?;
        self.flush()
    }

    /// Remembers an agent-level error for `flotilla-agent status`.
    pub fn set_last_error(&self, message: &str) -> Result<(), StoreError> {
        self.put(&self.meta, LAST_ERROR, "last error", &message.to_owned())?;
        self.flush()
    }

    pub fn last_error(&self) -> Result<Option<String>, StoreError> {
        self.get(&self.meta, LAST_ERROR, "last error")
    }

    /// Takes the next report sequence number (1, 2, ...), durably, so numbers keep growing
    /// across restarts.
    pub fn next_seq(&self) -> Result<u64, StoreError> {
        let seq = self
            .get::<u64>(&self.meta, SEQ, "report sequence")?
            .unwrap_or(0)
            + 1;
        self.put(&self.meta, SEQ, "report sequence", &seq)?;
        Ok(seq)
    }

    /// Keeps a report until the broker acknowledges it, durably.
    pub fn outbox_put(&self, report: &Report) -> Result<(), StoreError> {
        self.put(
            &self.outbox,
            &report.seq.to_be_bytes(),
            &format!("report {}", report.seq),
            report,
        )?;
        self.flush()
    }

    /// Forgets an acknowledged report.
    pub fn outbox_remove(&self, seq: u64) -> Result<(), StoreError> {
        self.outbox
            .remove(seq.to_be_bytes())
            .map(|_| ())
            .map_err(|source| StoreError::Write {
                what: format!("report {seq}"),
                source,
            })
    }

    /// Unacknowledged reports, oldest first. Damaged entries are skipped (and logged): a lost
    /// report is recovered by the retained device state, a stuck outbox is not.
    pub fn outbox(&self) -> Vec<Report> {
        let mut out = Vec::new();
        for entry in self.outbox.iter() {
            match entry {
                Ok((_, bytes)) => match postcard::from_bytes::<Report>(&bytes) {
                    Ok(r) => out.push(r),
                    Err(e) => tracing::warn!("skipping damaged outbox entry: {e}"),
                },
                Err(e) => tracing::warn!("cannot read outbox: {e}"),
            }
        }
        out
    }
}

/// sled reports a held lock as an `Other` I/O error; its message is the only way to tell.
/// Where an action's bypassed peers are kept, beside its bytes in the same tree.
fn bypassed_key(action_id: &str) -> String {
    format!("bypassed/{action_id}")
}

fn is_lock(e: &sled::Error) -> bool {
    matches!(e, sled::Error::Io(io) if io.to_string().contains("could not acquire lock"))
}

/// Whether the database itself is damaged, as opposed to the system refusing it something for
/// now (a full disk, a quota, a read-only mount, permissions): only damage is a reason to move a
/// database aside. Moving a healthy one aside for a full disk lost it, restart after restart.
fn is_damage(e: &sled::Error) -> bool {
    use std::io::ErrorKind as K;
    match e {
        sled::Error::Io(io) => !matches!(
            io.kind(),
            K::WouldBlock
                | K::PermissionDenied
                | K::NotFound
                | K::StorageFull
                | K::QuotaExceeded
                | K::ReadOnlyFilesystem
                | K::OutOfMemory
                | K::Interrupted
                | K::ResourceBusy
                | K::FileTooLarge
        ),
        sled::Error::CollectionNotFound(_) => false,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{ActionRecord, State};
    use flotilla_protocol::{ActionBody, DesiredAction, Phase};

    /// issue 10, case 6: a full disk (or a quota, a read-only mount) is not damage: the healthy
    /// database stays where it is and the open fails with the reason.
    #[test]
    fn a_full_disk_is_not_taken_for_a_damaged_database() {
        use std::io::ErrorKind as K;
        for kind in [K::StorageFull, K::QuotaExceeded, K::ReadOnlyFilesystem] {
            assert!(!is_damage(&sled::Error::Io(kind.into())), "{kind:?}");
        }
        assert!(is_damage(&sled::Error::Io(K::InvalidData.into())));
        assert!(is_damage(&sled::Error::Corruption { at: None, bt: () }));
    }

    fn record(id: &str, state: State) -> ActionRecord {
        ActionRecord {
            action_id: id.into(),
            rollout_id: "r1".into(),
            action: DesiredAction {
                action_id: id.into(),
                device_id: "dev-1".into(),
                rollout_id: "r1".into(),
                issued_at: 1,
                expires_at: 2,
                body: ActionBody::Nothing,
            },
            manifest: None,
            state,
        }
    }

    #[test]
    fn state_survives_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let (store, note) = Store::open(dir.path(), 1 << 20, 100).expect("open");
            assert!(note.is_none());
            store
                .save_action(&record(
                    "a1",
                    State::Downloading {
                        artifact: 0,
                        done: 4096,
                    },
                ))
                .expect("save");
            store
                .set_installed(&InstalledRelease {
                    name: "fw".into(),
                    version: "1".into(),
                    counter: 3,
                })
                .expect("installed");
            assert_eq!(store.next_seq().expect("seq"), 1);
            assert_eq!(store.next_seq().expect("seq"), 2);
            let report = Report {
                device_id: "dev-1".into(),
                seq: 2,
                action_id: "a1".into(),
                rollout_id: "r1".into(),
                phase: Phase::Accepted,
                at: 5,
            };
            store.outbox_put(&report).expect("outbox");
        }
        let (store, _) = Store::open(dir.path(), 1 << 20, 100).expect("reopen");
        let current = store.current().expect("read").expect("current action kept");
        assert_eq!(current.action_id, "a1");
        assert_eq!(
            current.state,
            State::Downloading {
                artifact: 0,
                done: 4096
            }
        );
        assert_eq!(store.installed().expect("read").map(|i| i.counter), Some(3));
        assert_eq!(
            store.next_seq().expect("seq"),
            3,
            "sequence numbers keep growing across restarts"
        );
        assert_eq!(store.outbox().len(), 1);
        store.outbox_remove(2).expect("remove");
        assert!(store.outbox().is_empty());
    }

    #[test]
    fn a_database_in_use_is_reported_and_never_moved_aside() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (running, _) = Store::open(dir.path(), 1 << 20, 100).expect("open");
        running
            .save_action(&record("a1", State::Accepted))
            .expect("save");
        let err = Store::open(dir.path(), 1 << 20, 100).expect_err("locked");
        assert!(matches!(err, StoreError::Locked { .. }), "{err}");
        assert!(err.to_string().contains("is the agent running?"), "{err}");
        assert!(
            !dir.path().join("db.corrupt-100").exists(),
            "a locked database is not damaged"
        );
        assert_eq!(
            running.current().expect("read").map(|r| r.action_id),
            Some("a1".into()),
            "the running agent keeps its database"
        );
    }

    #[test]
    fn restarts_are_counted_per_action_and_state() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, _) = Store::open(dir.path(), 1 << 20, 100).expect("open");
        let staged = record("a1", State::Staged);
        assert_eq!(store.count_restart(&staged).expect("count"), 1);
        assert_eq!(store.count_restart(&staged).expect("count"), 2);
        let moved_on = record("a1", State::Confirming);
        assert_eq!(
            store.count_restart(&moved_on).expect("count"),
            1,
            "progress resets"
        );
        let other = record("a2", State::Confirming);
        assert_eq!(store.count_restart(&other).expect("count"), 1, "per action");
        drop(store);
        let (store, _) = Store::open(dir.path(), 1 << 20, 100).expect("reopen");
        assert_eq!(
            store.count_restart(&other).expect("count"),
            2,
            "survives a restart"
        );
    }

    #[test]
    fn damaged_database_is_moved_aside() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = db_path(dir.path());
        std::fs::create_dir_all(&db).expect("mkdir");
        // A "conf" file sled cannot parse: what a torn write of its header looks like.
        std::fs::write(db.join("conf"), b"\xff\xfe garbage").expect("write");
        std::fs::write(db.join("db"), b"garbage").expect("write");
        let (store, note) = Store::open(dir.path(), 1 << 20, 1234).expect("opens anyway");
        let note = note.expect("reports the damage");
        assert!(note.contains("db.corrupt-1234"), "{note}");
        assert!(dir.path().join("db.corrupt-1234").exists());
        assert!(store.current().expect("read").is_none(), "starts empty");
    }
}
