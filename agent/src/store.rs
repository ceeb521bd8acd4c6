//! The agent's durable memory, in sled: action records with their persisted state, the
//! installed release, the report sequence number, the outbox of reports the broker has not
//! acknowledged yet, each action's bytes by source, and a mirror of the trust file.
//!
//! Every state change is flushed before the caller acts on it, because the state machine's
//! promise ("persisted before every side effect") is only as good as the flush. Values are
//! postcard; they never leave the device, but postcard keeps them small on small flash.
//!
//! Every value is written framed with its sha256, and a value whose checksum does
//! not match is reported as damaged ([`StoreError::Decode`]) rather than decoded. Values
//! written before the frame existed (no frame tag) are still read, as long as they decode
//! exactly. sled's own checksums make a damaged log go back in time instead (its recovery stops
//! at the first bad entry, so later writes are lost while older ones read fine):
//! [`open_data_dir`] notices that from the trust file, and the agent verifies every stored
//! action again before resuming it (`resume.rs`, decision 0036).
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
use crate::record::{ActionRecord, LegacyActionRecord, RollbackPoint};
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
/// a damaged database was moved aside (see [`Store::open`]) or is behind the trust file
/// ([`behind_trust_file`]). Used by the daemon, `status` and `keys install`, so all three see
/// the same state.
pub fn open_data_dir(config: &Config) -> Result<(Store, TrustState, Option<String>), StoreError> {
    std::fs::create_dir_all(&config.data_dir).map_err(|source| StoreError::CreateDataDir {
        path: config.data_dir.clone(),
        source,
    })?;
    let file = trust_state::read_trust_file(&config.data_dir);
    // A database removed by hand is not one that lost writes: sled starts a new one.
    let existed = db_path(&config.data_dir).exists();
    let (store, note) = Store::open(
        &config.data_dir,
        config.store.cache_bytes,
        file.now(trust_state::system_now(), config.trust.max_clock_skew),
    )?;
    // A mirror this build cannot read (written before the trust file gained fields) is
    // ignored: the trust file is the authority and the two are merged for safety only.
    let (mirror, readable) = match store.trust() {
        Ok(mirror) => (mirror, true),
        Err(e) => {
            tracing::warn!("{e}; using the trust file alone");
            (None, false)
        }
    };
    // A database that was moved aside is empty, and says so already.
    let note = note.or_else(|| {
        let behind = (existed && readable).then(|| behind_trust_file(&file, mirror.as_ref()));
        behind.flatten().map(|why| {
            format!(
                "database {} {why}: it lost writes, so what it holds about recent actions may be old",
                db_path(&config.data_dir).display()
            )
        })
    });
    let trust = file.merge(mirror.unwrap_or_default());
    if note.is_some() {
        // The report sequence went back with the rest, and the coordinator drops a number it
        // has seen. Continue above any number this device can have used.
        let floor = trust
            .now(trust_state::system_now(), config.trust.max_clock_skew)
            .saturating_mul(SEQ_PER_SECOND);
        store.continue_seq_above(floor)?;
    }
    Ok((store, trust, note))
}

/// Where the report sequence continues after its database lost writes: the trusted time times
/// this. A device reports far less often than this many times a second, so the numbers it
/// used before (counted from 1, or from an earlier such floor) are all below it.
const SEQ_PER_SECOND: u64 = 1_000;

/// How the database's copy of the trust state is behind the trust file, if it is. The agent
/// writes the copy first and the file second (`Env::save_trust`), so a copy behind the file
/// means the database lost writes it had flushed: sled's recovery stops at the first damaged
/// entry of its log, and what came after is gone.
pub fn behind_trust_file(file: &TrustState, mirror: Option<&TrustState>) -> Option<String> {
    let Some(mirror) = mirror else {
        return (file.installed_counter > 0 || file.last_action_issued_at > 0).then(|| {
            format!(
                "holds no trust state, while the trust file holds installed counter {} and \
                 last action issued at {}",
                file.installed_counter, file.last_action_issued_at
            )
        });
    };
    (mirror.installed_counter < file.installed_counter
        || mirror.last_action_issued_at < file.last_action_issued_at)
        .then(|| {
            format!(
                "is behind the trust file (installed counter {} against {}, last action issued \
                 at {} against {})",
                mirror.installed_counter,
                file.installed_counter,
                mirror.last_action_issued_at,
                file.last_action_issued_at
            )
        })
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
        let bytes = seal(&flotilla_protocol::envelope::to_bytes(value));
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
        decode(&bytes, what).map(Some)
    }

    /// The record of one action, if it was ever seen. A record written before records kept
    /// the signed action ([`LegacyActionRecord`]) comes back without it.
    pub fn action(&self, action_id: &str) -> Result<Option<ActionRecord>, StoreError> {
        let what = format!("action {action_id}");
        let Some(bytes) =
            self.actions
                .get(action_id.as_bytes())
                .map_err(|source| StoreError::Read {
                    what: what.clone(),
                    source,
                })?
        else {
            return Ok(None);
        };
        let record = match unseal(&bytes) {
            Unsealed::Body(body) => exact::<ActionRecord>(body, &what)?,
            Unsealed::Legacy(raw) => exact::<LegacyActionRecord>(raw, &what)?.into(),
            Unsealed::Damaged(reason) => return Err(StoreError::Decode { what, reason }),
        };
        if record.action_id != action_id {
            return Err(StoreError::Decode {
                what,
                reason: format!("it holds action {}", record.action_id),
            });
        }
        Ok(Some(record))
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
            .insert(CURRENT, seal(record.action_id.as_bytes()))
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
        let Some(id) = id else {
            return Ok(None);
        };
        let id = match unseal(&id) {
            Unsealed::Body(id) | Unsealed::Legacy(id) => {
                std::str::from_utf8(id).map_err(|_| StoreError::Decode {
                    what: "current action".into(),
                    reason: "its id is not UTF-8".into(),
                })?
            }
            Unsealed::Damaged(reason) => {
                return Err(StoreError::Decode {
                    what: "current action".into(),
                    reason,
                })
            }
        };
        self.action(id)
    }

    /// The installed release as recorded here. A damaged entry is logged and read as nothing
    /// recorded: it only describes the release (the trust file holds its counter), and an
    /// error here would stop every later install from recording itself.
    pub fn installed(&self) -> Result<Option<InstalledRelease>, StoreError> {
        match self.get(&self.meta, INSTALLED, "installed release") {
            Err(e @ StoreError::Decode { .. }) => {
                tracing::warn!("{e}; taken as nothing recorded");
                Ok(None)
            }
            other => other,
        }
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
        // A damaged count starts again: it only decides when to give up.
        let last: Option<(String, Vec<u8>, u32)> =
            match self.get(&self.meta, RESTARTS, "restart count") {
                Err(e @ StoreError::Decode { .. }) => {
                    tracing::warn!("{e}; counting from 1");
                    None
                }
                other => other?,
            };
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
        let last = match self.get::<u64>(&self.meta, SEQ, "report sequence") {
            // Reports must go on: continue after the newest one not yet acknowledged.
            Err(e @ StoreError::Decode { .. }) => {
                tracing::warn!("{e}; continuing after the outbox");
                self.outbox().last().map(|r| r.seq)
            }
            other => other?,
        };
        let seq = last.unwrap_or(0) + 1;
        self.put(&self.meta, SEQ, "report sequence", &seq)?;
        Ok(seq)
    }

    /// Makes the next report sequence number higher than `floor`, durably.
    pub fn continue_seq_above(&self, floor: u64) -> Result<(), StoreError> {
        let last = match self.get::<u64>(&self.meta, SEQ, "report sequence") {
            Ok(last) => last.unwrap_or(0),
            Err(StoreError::Decode { .. }) => 0,
            Err(e) => return Err(e),
        };
        if last < floor {
            self.put(&self.meta, SEQ, "report sequence", &floor)?;
            self.flush()?;
        }
        Ok(())
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
                Ok((_, bytes)) => match decode::<Report>(&bytes, "outbox entry") {
                    Ok(r) => out.push(r),
                    Err(e) => tracing::warn!("skipping it: {e}"),
                },
                Err(e) => tracing::warn!("cannot read outbox: {e}"),
            }
        }
        out
    }
}

/// Where an action's bypassed peers are kept, beside its bytes in the same tree.
fn bypassed_key(action_id: &str) -> String {
    format!("bypassed/{action_id}")
}

/// The start of every value written since values carry a checksum. No value written before
/// can start with it: every one of them starts with a postcard varint (a length, a number, an
/// enum tag) or is an action id, and four bytes of `0xff` would be a varint of over 2^28.
const FRAME_TAG: [u8; 4] = [0xff, 0xff, 0xff, 0xf1];
const DIGEST_LEN: usize = 32;

/// A value as the store writes it: [`FRAME_TAG`], the sha256 of `body`, `body`.
fn seal(body: &[u8]) -> Vec<u8> {
    use sha2::Digest as _;
    let mut out = Vec::with_capacity(FRAME_TAG.len() + DIGEST_LEN + body.len());
    out.extend_from_slice(&FRAME_TAG);
    out.extend_from_slice(&sha2::Sha256::digest(body));
    out.extend_from_slice(body);
    out
}

/// What a stored value turned out to be.
#[derive(Debug, PartialEq, Eq)]
enum Unsealed<'a> {
    /// Framed, and its checksum matches: the body.
    Body(&'a [u8]),
    /// Not framed: written by a build before the frame existed (or damaged where the tag was).
    Legacy(&'a [u8]),
    /// Framed, and the checksum does not match (or the frame is cut short): why.
    Damaged(String),
}

fn unseal(bytes: &[u8]) -> Unsealed<'_> {
    use sha2::Digest as _;
    let Some(rest) = bytes.strip_prefix(&FRAME_TAG) else {
        return Unsealed::Legacy(bytes);
    };
    if rest.len() < DIGEST_LEN {
        return Unsealed::Damaged(format!("cut short at {} bytes", bytes.len()));
    }
    let (digest, body) = rest.split_at(DIGEST_LEN);
    if sha2::Sha256::digest(body).as_slice() == digest {
        Unsealed::Body(body)
    } else {
        Unsealed::Damaged("its checksum does not match its contents".into())
    }
}

/// Decodes a stored value of one type, framed or written before frames existed.
fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, StoreError> {
    match unseal(bytes) {
        Unsealed::Body(body) | Unsealed::Legacy(body) => exact(body, what),
        Unsealed::Damaged(reason) => Err(StoreError::Decode {
            what: what.to_owned(),
            reason,
        }),
    }
}

/// postcard, refusing trailing bytes: a damaged frame tag must not pass for an older value
/// that happens to decode from its first bytes.
fn exact<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, StoreError> {
    match postcard::take_from_bytes(bytes) {
        Ok((value, [])) => Ok(value),
        Ok((_, rest)) => Err(StoreError::Decode {
            what: what.to_owned(),
            reason: format!("{} bytes after its end", rest.len()),
        }),
        Err(e) => Err(StoreError::Decode {
            what: what.to_owned(),
            reason: e.to_string(),
        }),
    }
}

/// sled reports a held lock as an `Other` I/O error; its message is the only way to tell.
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
            signed: None,
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
        let (store, _) = reopen_store(dir.path());
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
        let (store, _) = reopen_store(dir.path());
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

    /// An install record as the agent keeps it: the signed action (with its signed manifest)
    /// beside what was decoded from it.
    fn signed_record(id: &str, state: State) -> ActionRecord {
        use flotilla_protocol::{envelope, ActionKind, Artifact, ReleaseManifest, SignedBlob};
        let key = |seed: u8| flotilla_protocol::SigningKey::from_bytes(&[seed; 32]);
        let manifest = ReleaseManifest {
            name: "app-5".into(),
            version: "5.0".into(),
            counter: 5,
            hardware: vec!["pi4".into()],
            artifacts: vec![Artifact {
                name: "app.bin".into(),
                target: "app".into(),
                size: 3,
                sha256: flotilla_protocol::sha256(b"abc"),
            }],
            created_at: 10,
            expires_at: 1_000,
        };
        let action = DesiredAction {
            action_id: id.into(),
            device_id: "dev-1".into(),
            rollout_id: "r1".into(),
            issued_at: 10,
            expires_at: 500,
            body: ActionBody::Install {
                manifest: SignedBlob::sign(&key(1), envelope::to_bytes(&manifest)),
                kind: ActionKind::Forced,
                window: None,
            },
        };
        ActionRecord {
            action_id: id.into(),
            rollout_id: "r1".into(),
            signed: Some(SignedBlob::sign(&key(2), envelope::to_bytes(&action))),
            action,
            manifest: Some(manifest),
            state,
        }
    }

    /// Every single bit flipped anywhere in a stored record (and in the current action's id)
    /// is reported as damage naming the entry; none reads back as another record.
    #[test]
    fn a_flipped_bit_anywhere_in_a_record_is_reported_as_damage() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, _) = Store::open(dir.path(), 1 << 20, 100).expect("open");
        let record = signed_record("act-1", State::Staged);
        store.save_action(&record).expect("save");
        let good = store.actions.get("act-1").expect("read").expect("kept");
        for bit in 0..good.len() * 8 {
            let mut bad = good.to_vec();
            bad[bit / 8] ^= 1 << (bit % 8);
            store.actions.insert("act-1", bad).expect("write");
            match store.action("act-1") {
                Err(StoreError::Decode { what, .. }) => assert_eq!(what, "action act-1"),
                other => panic!("bit {bit}: {other:?}"),
            }
        }
        store.actions.insert("act-1", good).expect("write");
        assert_eq!(store.current().expect("read"), Some(record.clone()));
        let id = store.meta.get(CURRENT).expect("read").expect("kept");
        for bit in 0..id.len() * 8 {
            let mut bad = id.to_vec();
            bad[bit / 8] ^= 1 << (bit % 8);
            store.meta.insert(CURRENT, bad).expect("write");
            let read = store.current();
            assert!(
                matches!(&read, Err(StoreError::Decode { .. })),
                "bit {bit}: {read:?}"
            );
        }
    }

    /// Values written by builds before values carried a checksum are read as they were: an
    /// agent updated in the middle of an action finishes it.
    #[test]
    fn records_written_before_checksums_are_still_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, _) = Store::open(dir.path(), 1 << 20, 100).expect("open");
        let record = signed_record("act-1", State::Confirming);
        let legacy = crate::record::LegacyActionRecord {
            action_id: record.action_id.clone(),
            rollout_id: record.rollout_id.clone(),
            action: record.action.clone(),
            manifest: record.manifest.clone(),
            state: record.state.clone(),
        };
        use flotilla_protocol::envelope::to_bytes;
        store
            .actions
            .insert("act-1", to_bytes(&legacy))
            .expect("write");
        store.meta.insert(CURRENT, "act-1").expect("write");
        store.meta.insert(SEQ, to_bytes(&41u64)).expect("write");
        let current = store.current().expect("read").expect("kept");
        assert_eq!(
            current,
            ActionRecord {
                signed: None,
                ..record
            }
        );
        assert_eq!(store.next_seq().expect("seq"), 42);
        // A legacy value with bytes after its end is damage, not a shorter value.
        let mut long = to_bytes(&legacy);
        long.push(0);
        store.actions.insert("act-1", long).expect("write");
        assert!(matches!(
            store.action("act-1"),
            Err(StoreError::Decode { .. })
        ));
    }

    /// A damaged report sequence or restart count does not stop reports or starts.
    #[test]
    fn a_damaged_sequence_or_restart_count_starts_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, _) = Store::open(dir.path(), 1 << 20, 100).expect("open");
        let report = Report {
            device_id: "dev-1".into(),
            seq: store.next_seq().expect("seq"),
            action_id: "a1".into(),
            rollout_id: "r1".into(),
            phase: Phase::Accepted,
            at: 5,
        };
        store.outbox_put(&report).expect("outbox");
        let staged = record("a1", State::Staged);
        assert_eq!(store.count_restart(&staged).expect("count"), 1);
        for key in [SEQ, RESTARTS] {
            let mut bad = store.meta.get(key).expect("read").expect("kept").to_vec();
            let last = bad.len() - 1;
            bad[last] ^= 0x10;
            store.meta.insert(key, bad).expect("write");
        }
        assert_eq!(store.next_seq().expect("seq"), 2, "after the outbox");
        assert_eq!(store.count_restart(&staged).expect("count"), 1);
    }

    fn config_in(dir: &Path) -> Config {
        let mut config =
            Config::from_toml(crate::config::DEFAULT_CONFIG).expect("the default config");
        config.data_dir = dir.to_owned();
        config
    }

    /// [`Store::open`] once the store dropped just before has let go of its lock (see
    /// [`reopen_data_dir`]).
    fn reopen_store(dir: &Path) -> (Store, Option<String>) {
        for _ in 0..500 {
            match Store::open(dir, 1 << 20, 100) {
                Ok(opened) => return opened,
                Err(StoreError::Locked { .. }) => {
                    std::thread::sleep(std::time::Duration::from_millis(10))
                }
                Err(e) => panic!("reopen: {e}"),
            }
        }
        panic!("the store stayed locked after it was dropped");
    }

    /// [`open_data_dir`] once the store dropped just before has let go of its lock (sled's
    /// background threads release it a moment after the last handle is dropped).
    fn reopen_data_dir(config: &Config) -> (Store, TrustState, Option<String>) {
        for _ in 0..500 {
            match open_data_dir(config) {
                Ok(opened) => return opened,
                Err(StoreError::Locked { .. }) => {
                    std::thread::sleep(std::time::Duration::from_millis(10))
                }
                Err(e) => panic!("open: {e}"),
            }
        }
        panic!("the store stayed locked after it was dropped");
    }

    /// sled's recovery drops what followed a damaged entry of its log: the database's copy of
    /// the trust state then lags the trust file, and opening it says so.
    #[test]
    fn a_database_behind_its_trust_file_is_noted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = config_in(dir.path());
        let old = TrustState {
            installed_counter: 2,
            last_action_issued_at: 20,
            ..TrustState::default()
        };
        let new = TrustState {
            installed_counter: 12,
            last_action_issued_at: 120,
            ..TrustState::default()
        };
        {
            let (store, _, note) = open_data_dir(&config).expect("open");
            assert_eq!(note, None, "a new device");
            store.set_trust(&old).expect("mirror");
        }
        trust_state::write_trust_file(dir.path(), &new).expect("trust file");
        let (store, trust, note) = reopen_data_dir(&config);
        assert_eq!(trust.installed_counter, 12, "the higher counter wins");
        assert!(
            store.next_seq().expect("seq") > trust_state::system_now() * 1000,
            "reports continue above any number used before"
        );
        let note = note.expect("noted");
        assert!(
            note.ends_with(
                "db is behind the trust file (installed counter 2 against 12, last action \
                 issued at 20 against 120): it lost writes, so what it holds about recent \
                 actions may be old"
            ),
            "{note}"
        );
        store.set_trust(&new).expect("mirror");
        drop(store);
        let (_, _, note) = reopen_data_dir(&config);
        assert_eq!(note, None, "in step again");
        // A database that lost everything while the trust file stayed.
        {
            let (store, _, _) = reopen_data_dir(&config);
            store.meta.remove(TRUST).expect("remove");
        }
        let (_, _, note) = reopen_data_dir(&config);
        assert!(note.is_some_and(
            |n| n.contains("holds no trust state, while the trust file holds installed counter 12")
        ));
        // One removed by hand is simply new: the trust file keeps the counter (decision 0006).
        std::fs::remove_dir_all(db_path(dir.path())).expect("remove");
        let (_, trust, note) = reopen_data_dir(&config);
        assert_eq!((note, trust.installed_counter), (None, 12));
    }
}
