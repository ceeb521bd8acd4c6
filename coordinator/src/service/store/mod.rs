//! Persistence, so a restarted coordinator (or the one that takes over) continues where the
//! last one stopped.
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
//! meta           "generation"  -> u64 big-endian   (commits so far, sled's seal)
//! published      device id     -> 32 bytes         (digest of the last desired action published)
//! sessions       sha256 hex    -> Session          (HTTP console sessions: the token's digest)
//! ```
//!
//! The trees live in a [`Backend`] (`backend.rs`): sled in the data directory (`sled_kv.rs`,
//! the default) or PostgreSQL shared by several coordinators (`postgres/`). [`Store`] is the
//! only way the service reaches either: it encodes and decodes records and names what failed.
//!
//! `published` is a cache, not a record: it lets a restarted coordinator recognise its own
//! retained desired actions by their bytes instead of checking each signature again
//! ([`published_digest`]). It is not in backups; without it the signatures are checked.
//!
//! [`Store::export`] and [`Store::import`] copy every tree for `flotilla backup` and `flotilla
//! restore` (`backup.rs`), and from one backend into the other (`flotilla store migrate`).
//!
//! JSON rather than postcard because it is self-describing: a record written by an older version
//! still decodes when fields with defaults were added since. Every write is durable before it
//! returns, because the engine's contract is that a rollout is persisted before the desired
//! actions it justifies are published (docs/decisions/0003-coordinator-engine.md), and an operator
//! who was told "stored" must find the strategy or group after a restart.
//!
//! A record that does not decode is logged, naming it, and skipped, so one bad record cannot keep
//! the coordinator from starting; it stays in the database for an operator to inspect.

use std::collections::HashMap;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use flotilla_rollout::engine::Rollout;
use flotilla_rollout::planner::DeviceGroup;

use crate::service::enrollment::Enrollment;
use crate::service::seal::SealCheck;

pub mod backend;
pub mod postgres;
pub mod sled_kv;

use backend::{Backend, BackendError, Op};
use sled_kv::SledKv;

const ROLLOUTS: &str = "rollouts";
const STRATEGIES: &str = "strategies";
const DEVICE_GROUPS: &str = "device_groups";
/// Device id -> `issued_at` (u64, big-endian) of the last desired action signed for it.
const ISSUED: &str = "issued";
const ENROLLMENTS: &str = "enrollments";
const USED_TOKENS: &str = "used_tokens";
/// Device id -> [`published_digest`] of the last desired action published for it.
const PUBLISHED: &str = "published";
/// sha256 (hex) of an HTTP session's token -> the session (`http/session.rs`, decision 0060).
/// Not in backups: a restored coordinator asks its operators to log in again.
const SESSIONS: &str = "sessions";

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
    sled_kv::META,
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
    #[error("{source}")]
    Open { source: BackendError },
    #[error("cannot encode {kind} {name}: {source}")]
    Encode {
        kind: &'static str,
        name: String,
        source: serde_json::Error,
    },
    #[error("cannot write {kind} {name}: {source}")]
    Write {
        kind: &'static str,
        name: String,
        source: BackendError,
    },
    #[error("cannot delete {kind} {name}: {source}")]
    Delete {
        kind: &'static str,
        name: String,
        source: BackendError,
    },
    #[error("cannot read {kind} {name}: {source}")]
    ReadRecord {
        kind: &'static str,
        name: String,
        source: BackendError,
    },
    #[error("cannot read the store's {tree}: {source}")]
    Read {
        tree: &'static str,
        source: BackendError,
    },
    #[error("stored {kind} {name} does not decode: {source}")]
    Decode {
        kind: &'static str,
        name: String,
        source: serde_json::Error,
    },
    #[error("cannot record the last action issued to device {device}: {source}")]
    WriteIssued {
        device: String,
        source: BackendError,
    },
    #[error("{}: {reason}", path.display())]
    Seal {
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("cannot import into the store: {source}")]
    Import { source: BackendError },
    #[error("cannot reopen the store: {source}")]
    Reopen { source: BackendError },
}

impl StoreError {
    /// Whether the write failed because this coordinator no longer leads.
    pub fn is_fenced(&self) -> bool {
        match self {
            StoreError::Write { source, .. }
            | StoreError::Delete { source, .. }
            | StoreError::WriteIssued { source, .. }
            | StoreError::Import { source } => source.is_fenced(),
            _ => false,
        }
    }
}

/// The coordinator's store: typed records over a [`Backend`].
#[derive(Debug)]
pub struct Store {
    kind: Kind,
}

/// The backend, by kind: sled has a seal and a directory that the others do not.
#[derive(Debug)]
enum Kind {
    Sled(SledKv),
    Other(Box<dyn Backend>),
}

/// One tree of named JSON records, and what to call a record in messages.
struct Records<'a> {
    store: &'a Store,
    tree: &'static str,
    kind: &'static str,
}

impl Records<'_> {
    fn save<T: Serialize>(&self, name: &str, record: &T) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(record).map_err(|source| StoreError::Encode {
            kind: self.kind,
            name: name.to_owned(),
            source,
        })?;
        self.store
            .backend()
            .write(vec![Op::put(self.tree, name, bytes)])
            .map_err(|source| StoreError::Write {
                kind: self.kind,
                name: name.to_owned(),
                source,
            })
    }

    /// The record named `name`, `None` when there is none. A record that does not decode is an
    /// error here (the caller asked for this one), unlike in [`Records::list`].
    fn load<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, StoreError> {
        let bytes = self
            .store
            .backend()
            .get(self.tree, name.as_bytes())
            .map_err(|source| StoreError::ReadRecord {
                kind: self.kind,
                name: name.to_owned(),
                source,
            })?;
        bytes
            .map(|b| {
                serde_json::from_slice(&b).map_err(|source| StoreError::Decode {
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
        let entries = self
            .store
            .backend()
            .scan(self.tree)
            .map_err(|source| StoreError::Read {
                tree: self.tree,
                source,
            })?;
        for (key, value) in entries {
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
        let existed = self
            .store
            .backend()
            .get(self.tree, name.as_bytes())
            .map_err(|source| StoreError::ReadRecord {
                kind: self.kind,
                name: name.to_owned(),
                source,
            })?
            .is_some();
        self.store
            .backend()
            .write(vec![Op::remove(self.tree, name)])
            .map_err(|source| StoreError::Delete {
                kind: self.kind,
                name: name.to_owned(),
                source,
            })?;
        Ok(existed)
    }
}

impl Store {
    /// Opens (or creates) the sled database directory at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Store, StoreError> {
        let kv = SledKv::open(path).map_err(|source| StoreError::Open { source })?;
        Ok(Store {
            kind: Kind::Sled(kv),
        })
    }

    /// A store on any other backend (PostgreSQL).
    pub fn on(backend: Box<dyn Backend>) -> Store {
        Store {
            kind: Kind::Other(backend),
        }
    }

    fn backend(&self) -> &dyn Backend {
        match &self.kind {
            Kind::Sled(kv) => kv,
            Kind::Other(b) => b.as_ref(),
        }
    }

    /// Back to a usable state after a failed write (sled opens its files again; a database
    /// backend connects again), or after another coordinator led (caches are read again).
    pub fn reopen(&mut self) -> Result<(), StoreError> {
        let result = match &mut self.kind {
            Kind::Sled(kv) => kv.reopen(),
            Kind::Other(b) => b.reopen(),
        };
        result.map_err(|source| StoreError::Reopen { source })
    }

    /// Gives up the store without closing it. sled's close can wait forever on a disk that is
    /// still full; a process leaving after a failed write calls this instead of dropping.
    pub fn abandon(self) {
        match self.kind {
            Kind::Sled(kv) => kv.abandon(),
            Kind::Other(b) => drop(b),
        }
    }

    /// Where the store is, for messages: a directory, or a database address.
    pub fn describe(&self) -> String {
        self.backend().describe()
    }

    /// The sled directory, when the store is sled.
    pub fn sled_path(&self) -> Option<&Path> {
        match &self.kind {
            Kind::Sled(kv) => Some(kv.path()),
            Kind::Other(_) => None,
        }
    }

    fn records(&self, tree: &'static str, kind: &'static str) -> Records<'_> {
        Records {
            store: self,
            tree,
            kind,
        }
    }

    /// Stores (or replaces) a device's enrollment, durable before returning.
    pub fn save_enrollment(&self, enrollment: &Enrollment) -> Result<(), StoreError> {
        self.records(ENROLLMENTS, "device enrollment")
            .save(&enrollment.device, enrollment)
    }

    /// Stores these enrollments and marks these tokens (sha256 hex, when) used, in one durable
    /// write: what devices enrolled by themselves within one tick of the service.
    pub fn save_enrollments(
        &self,
        enrollments: &[&Enrollment],
        tokens: &[(String, u64)],
    ) -> Result<(), StoreError> {
        let mut ops = Vec::with_capacity(enrollments.len() + tokens.len());
        for enrollment in enrollments {
            let bytes = serde_json::to_vec(enrollment).map_err(|source| StoreError::Encode {
                kind: "device enrollment",
                name: enrollment.device.clone(),
                source,
            })?;
            ops.push(Op::put(ENROLLMENTS, enrollment.device.as_str(), bytes));
        }
        for (digest, at) in tokens {
            let bytes = serde_json::to_vec(at).map_err(|source| StoreError::Encode {
                kind: "used enrollment token",
                name: digest.clone(),
                source,
            })?;
            ops.push(Op::put(USED_TOKENS, digest.as_str(), bytes));
        }
        let name = format!(
            "{} enrollments and {} used tokens",
            enrollments.len(),
            tokens.len()
        );
        self.backend()
            .write(ops)
            .map_err(|source| StoreError::Write {
                kind: "batch of",
                name,
                source,
            })
    }

    /// Every stored enrollment that decodes, in device order.
    pub fn list_enrollments(&self) -> Result<Vec<Enrollment>, StoreError> {
        self.records(ENROLLMENTS, "device enrollment").list()
    }

    /// Records that the enrollment token with this sha256 (hex) is used up, at `at`.
    pub fn use_token(&self, digest: &str, at: u64) -> Result<(), StoreError> {
        self.records(USED_TOKENS, "used enrollment token")
            .save(digest, &at)
    }

    /// The sha256 (hex) of every used-up enrollment token.
    pub fn used_tokens(&self) -> Result<Vec<String>, StoreError> {
        let entries = self
            .backend()
            .scan(USED_TOKENS)
            .map_err(|source| StoreError::Read {
                tree: USED_TOKENS,
                source,
            })?;
        Ok(entries
            .into_iter()
            .map(|(key, _)| String::from_utf8_lossy(&key).into_owned())
            .collect())
    }

    /// Stores an HTTP session under its token's digest (never the token), durable before
    /// returning.
    pub fn save_session<T: Serialize>(&self, digest: &str, session: &T) -> Result<(), StoreError> {
        self.records(SESSIONS, "HTTP session").save(digest, session)
    }

    /// Every stored HTTP session that decodes, with its token's digest.
    pub fn load_sessions<T: DeserializeOwned>(&self) -> Result<Vec<(String, T)>, StoreError> {
        let entries = self
            .backend()
            .scan(SESSIONS)
            .map_err(|source| StoreError::Read {
                tree: SESSIONS,
                source,
            })?;
        Ok(entries
            .into_iter()
            .filter_map(|(key, value)| {
                let digest = String::from_utf8_lossy(&key).into_owned();
                match serde_json::from_slice(&value) {
                    Ok(session) => Some((digest, session)),
                    Err(error) => {
                        tracing::warn!(%error, "skipping a stored HTTP session that does not decode");
                        None
                    }
                }
            })
            .collect())
    }

    /// Removes these HTTP sessions (by their tokens' digests) in one durable write.
    pub fn delete_sessions(&self, digests: &[String]) -> Result<(), StoreError> {
        let ops = digests
            .iter()
            .map(|d| Op::remove(SESSIONS, d.as_str()))
            .collect();
        self.backend()
            .write(ops)
            .map_err(|source| StoreError::Delete {
                kind: "HTTP sessions",
                name: format!("({})", digests.len()),
                source,
            })
    }

    /// Stores (or replaces) a staged strategy, durable before returning.
    pub fn save_strategy(&self, strategy: &StoredStrategy) -> Result<(), StoreError> {
        self.records(STRATEGIES, "strategy")
            .save(&strategy.name, strategy)
    }

    /// The stored strategy named `name`, if any.
    pub fn load_strategy(&self, name: &str) -> Result<Option<StoredStrategy>, StoreError> {
        self.records(STRATEGIES, "strategy").load(name)
    }

    /// Every stored strategy that decodes, in name order.
    pub fn list_strategies(&self) -> Result<Vec<StoredStrategy>, StoreError> {
        self.records(STRATEGIES, "strategy").list()
    }

    /// Removes a strategy; returns whether it was stored. Rollouts already created from it keep
    /// their resolved copy (KubeFleet's strategy snapshot).
    pub fn delete_strategy(&self, name: &str) -> Result<bool, StoreError> {
        self.records(STRATEGIES, "strategy").delete(name)
    }

    /// Stores (or replaces) a device group, durable before returning.
    pub fn save_group(&self, group: &DeviceGroup) -> Result<(), StoreError> {
        self.records(DEVICE_GROUPS, "device group")
            .save(&group.name, group)
    }

    /// The device group named `name`, if any.
    pub fn load_group(&self, name: &str) -> Result<Option<DeviceGroup>, StoreError> {
        self.records(DEVICE_GROUPS, "device group").load(name)
    }

    /// Every stored device group that decodes, in name order.
    pub fn list_groups(&self) -> Result<Vec<DeviceGroup>, StoreError> {
        self.records(DEVICE_GROUPS, "device group").list()
    }

    /// Removes a device group; returns whether it was stored.
    pub fn delete_group(&self, name: &str) -> Result<bool, StoreError> {
        self.records(DEVICE_GROUPS, "device group").delete(name)
    }

    /// Writes a rollout, durable before returning.
    pub fn save_rollout(&self, rollout: &Rollout) -> Result<(), StoreError> {
        self.records(ROLLOUTS, "rollout")
            .save(&rollout.name, rollout)
    }

    /// Every stored rollout that decodes, in name order. Records that do not decode are logged
    /// and skipped.
    pub fn load_rollouts(&self) -> Result<Vec<Rollout>, StoreError> {
        self.records(ROLLOUTS, "rollout").list()
    }

    /// Removes a rollout; removing one that is not stored is not an error.
    pub fn delete_rollout(&self, name: &str) -> Result<(), StoreError> {
        self.backend()
            .write(vec![Op::remove(ROLLOUTS, name)])
            .map_err(|source| StoreError::Delete {
                kind: "rollout",
                name: name.to_owned(),
                source,
            })
    }

    /// The `issued_at` of the last desired action signed for each device. Entries that do not
    /// decode are skipped: the sequence then restarts from the clock for that device.
    pub fn load_issued(&self) -> Result<HashMap<String, u64>, StoreError> {
        let entries = self
            .backend()
            .scan(ISSUED)
            .map_err(|source| StoreError::Read {
                tree: ISSUED,
                source,
            })?;
        Ok(entries
            .into_iter()
            .filter_map(|(key, value)| {
                Some((
                    String::from_utf8(key).ok()?,
                    u64::from_be_bytes(<[u8; 8]>::try_from(value.as_slice()).ok()?),
                ))
            })
            .collect())
    }

    /// The [`published_digest`] of the last desired action published for `device`, if known.
    pub fn published(&self, device: &str) -> Option<[u8; 32]> {
        let value = self.backend().get(PUBLISHED, device.as_bytes()).ok()??;
        <[u8; 32]>::try_from(value.as_slice()).ok()
    }

    /// Records the [`published_digest`] of the desired action just published for `device`. Not
    /// durable here (the rollout save before every publish commits); a digest that is lost or
    /// stale only means a signature check.
    pub fn save_published(&self, device: &str, digest: &[u8; 32]) -> Result<(), BackendError> {
        self.backend()
            .put_lazily(PUBLISHED, device.as_bytes(), digest.as_slice())
    }

    /// Records the `issued_at` of the desired action just signed for `device`. Not durable
    /// here: the next commit takes it along, and a coordinator that starts (or takes over) also
    /// reads the sequence back from the retained desired actions.
    pub fn save_issued(&self, device: &str, at: u64) -> Result<(), StoreError> {
        self.backend()
            .put_lazily(ISSUED, device.as_bytes(), &at.to_be_bytes())
            .map_err(|source| StoreError::WriteIssued {
                device: device.to_owned(),
                source,
            })
    }

    /// Commits so far (sled; 0 on other backends).
    pub fn generation(&self) -> u64 {
        match &self.kind {
            Kind::Sled(kv) => kv.generation(),
            Kind::Other(_) => 0,
        }
    }

    /// Whether the store holds every commit its seal remembers (see `seal.rs`). Only sled has
    /// a seal: a database keeps its own write-ahead log.
    pub fn check_seal(&self) -> Result<SealCheck, StoreError> {
        match &self.kind {
            Kind::Sled(kv) => kv.check_seal().map_err(|reason| StoreError::Seal {
                path: kv.seal_path().to_owned(),
                reason,
            }),
            Kind::Other(_) => Ok(SealCheck::Intact),
        }
    }

    /// Seals the store at its current generation: after an operator accepted a loss, or after
    /// a restore.
    pub fn reseal(&self) -> Result<(), StoreError> {
        match &self.kind {
            Kind::Sled(kv) => kv.reseal().map_err(|reason| StoreError::Seal {
                path: kv.seal_path().to_owned(),
                reason,
            }),
            Kind::Other(_) => Ok(()),
        }
    }

    /// Every record of every tree, tree by tree in [`TREES`] order, keys in order.
    pub fn export(&self) -> Result<Vec<Record>, StoreError> {
        let mut out = Vec::new();
        for tree in TREES {
            let entries = self
                .backend()
                .scan(tree)
                .map_err(|source| StoreError::Read { tree, source })?;
            out.extend(entries.into_iter().map(|(k, v)| (tree, k, v)));
        }
        Ok(out)
    }

    /// Whether the store holds no records at all.
    pub fn is_empty(&self) -> bool {
        self.backend().is_empty().unwrap_or(false)
    }

    /// Writes exported records (see [`Store::export`]) as one commit; trees not in [`TREES`]
    /// are refused by the caller. On sled the generation becomes the imported one plus this
    /// commit.
    pub fn import(&self, records: &[(String, Vec<u8>, Vec<u8>)]) -> Result<(), StoreError> {
        let ops = records
            .iter()
            .map(|(tree, key, value)| Op::put(tree, key.clone(), value.clone()))
            .collect();
        self.backend()
            .write(ops)
            .map_err(|source| StoreError::Import { source })
    }
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

    #[test]
    fn a_batch_of_enrollments_and_used_tokens_is_stored_in_one_write() {
        let dir = tempfile::tempdir().expect("tempdir");
        let enrolled = |device: &str| Enrollment {
            device: device.into(),
            key: "ab".repeat(32),
            status: crate::service::enrollment::Status::Accepted,
            via: Some("token".into()),
            since: 7,
            new_key: None,
            rejected_keys: vec![],
            waiting_state: None,
        };
        let (a, b) = (enrolled("dev-1"), enrolled("dev-2"));
        {
            let store = Store::open(dir.path().join("db")).expect("open");
            let before = store.generation();
            store
                .save_enrollments(&[&a, &b], &[("cd".repeat(32), 7)])
                .expect("saved");
            assert_eq!(store.generation(), before + 1, "one commit for the batch");
        }
        let store = Store::open(dir.path().join("db")).expect("reopen");
        let devices: Vec<_> = store
            .list_enrollments()
            .expect("list")
            .into_iter()
            .map(|e| e.device)
            .collect();
        assert_eq!(devices, ["dev-1", "dev-2"]);
        assert_eq!(store.used_tokens().expect("tokens"), ["cd".repeat(32)]);
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
            .backend()
            .write(vec![Op::put(ROLLOUTS, "broken", &b"{\"name\": 3"[..])])
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
                .backend()
                .get(ROLLOUTS, b"broken")
                .expect("reads")
                .is_some(),
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
            .backend()
            .write(vec![Op::put(
                DEVICE_GROUPS,
                "broken",
                &br#"{"name":"broken","select":"env in ()","labels":{}}"#[..],
            )])
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
