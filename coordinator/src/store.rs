//! Persistence of rollouts in sled, so a restarted coordinator continues where it stopped.
//!
//! One tree, `rollouts`, keyed by rollout name, each value the JSON of a [`Rollout`]. JSON rather
//! than postcard because it is self-describing: a record written by an older version still decodes
//! when fields with defaults were added since. Every save is flushed before it returns, because
//! the engine's contract is that a rollout is persisted before the desired actions it justifies are
//! published (docs/decisions/0003-coordinator-engine.md).
//!
//! A record that does not decode is logged, naming it, and skipped, so one bad record cannot keep
//! the coordinator from starting; it stays in the database for an operator to inspect.

use std::path::{Path, PathBuf};

use crate::engine::Rollout;

/// sled's page cache; rollouts are read once at startup and then written, so a small cache is enough.
const CACHE_CAPACITY: u64 = 8 * 1024 * 1024;

const ROLLOUTS: &str = "rollouts";

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
}

/// The coordinator's sled database.
pub struct Store {
    db: sled::Db,
    rollouts: sled::Tree,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("rollouts", &self.rollouts.len())
            .finish()
    }
}

impl Store {
    /// Opens (or creates) the database directory at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Store, StoreError> {
        let path = path.as_ref();
        let open_error = |source| StoreError::Open {
            path: path.to_owned(),
            source,
        };
        let db = sled::Config::new()
            .path(path)
            .cache_capacity(CACHE_CAPACITY)
            .open()
            .map_err(open_error)?;
        let rollouts = db.open_tree(ROLLOUTS).map_err(open_error)?;
        Ok(Store { db, rollouts })
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
        self.rollouts
            .insert(rollout.name.as_bytes(), bytes)
            .map_err(write_error)?;
        self.rollouts.flush().map_err(write_error)?;
        Ok(())
    }

    /// Every stored rollout that decodes, in name order. Records that do not decode are logged
    /// and skipped.
    pub fn load_rollouts(&self) -> Result<Vec<Rollout>, StoreError> {
        let mut rollouts = Vec::new();
        for item in self.rollouts.iter() {
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

    /// Removes a rollout; removing one that is not stored is not an error.
    pub fn delete_rollout(&self, name: &str) -> Result<(), StoreError> {
        let delete_error = |source| StoreError::Delete {
            rollout: name.to_owned(),
            source,
        };
        self.rollouts
            .remove(name.as_bytes())
            .map_err(delete_error)?;
        self.db.flush().map_err(delete_error)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Engine, ReleaseRef};
    use crate::spec::RolloutSpec;
    use flotilla_protocol::DeviceState;

    /// A started rollout over three devices, the way the engine builds it.
    fn rollout(name: &str) -> Rollout {
        let mut engine = Engine::new();
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
        ))
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
            store.rollouts.contains_key("broken").expect("reads"),
            "the bad record is kept for inspection"
        );
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
