//! `flotilla backup` and `flotilla restore`: the coordinator's store as one checked file.
//!
//! A backup is JSON lines, readable with standard tools:
//!
//! ```text
//! {"format":"flotilla-backup","version":1,"created_at":1790000000,"generation":57}
//! {"tree":"rollouts","key":"fw-2","value":"7b226e616d65...}     one line per record (value in hex)
//! {"end":true,"records":12,"sha256":"..."}                     sha256 of every byte above
//! ```
//!
//! The trailer makes a truncated or edited file an error naming what is wrong, never a partial
//! restore. A running coordinator writes a backup into `{data_dir}/backups/` when asked (the
//! `backup` control command: the path is its own choice, never the requester's); a stopped one
//! can be backed up with `flotilla backup --data-dir`. Restore is offline only: it writes into an
//! empty store (or moves the old one aside with `--force`) and seals the result.
//!
//! Releases, artifacts and keys are plain files in the data directory and are backed up as
//! files (docs/operations.md).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use flotilla_protocol::control::BackupInfo;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::service::seal::write_atomic;
use crate::service::store::{Store, StoreError, TREES};

const FORMAT: &str = "flotilla-backup";
const VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot write the backup {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read the backup {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is not a usable backup: {reason}", path.display())]
    Invalid { path: PathBuf, reason: String },
    #[error(
        "the store at {} already holds records; restore into an empty data directory, or pass \
         --force to move the current store aside first",
        path.display()
    )]
    NotEmpty { path: PathBuf },
    #[error("cannot move the current store {} aside: {source}", path.display())]
    MoveAside {
        path: PathBuf,
        source: std::io::Error,
    },
}

#[derive(Serialize, Deserialize)]
struct Header {
    format: String,
    version: u32,
    created_at: u64,
    generation: u64,
}

#[derive(Serialize, Deserialize)]
struct Line {
    tree: String,
    key: String,
    value: String,
}

#[derive(Serialize, Deserialize)]
struct Trailer {
    end: bool,
    records: usize,
    sha256: String,
}

/// A backup read back and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backup {
    pub created_at: u64,
    pub generation: u64,
    /// Tree name, key, value.
    pub records: Vec<(String, Vec<u8>, Vec<u8>)>,
}

/// Writes every record of `store` to `path` (atomically: a crash leaves no half backup).
pub fn write_backup(store: &Store, path: &Path, now: u64) -> Result<BackupInfo, BackupError> {
    let records = store.export()?;
    let mut text = Vec::new();
    let header = Header {
        format: FORMAT.into(),
        version: VERSION,
        created_at: now,
        generation: store.generation(),
    };
    push_line(&mut text, &header);
    for (tree, key, value) in &records {
        let key = String::from_utf8(key.clone()).map_err(|_| BackupError::Invalid {
            path: path.to_owned(),
            reason: format!("a key in tree {tree} is not UTF-8"),
        })?;
        push_line(
            &mut text,
            &Line {
                tree: (*tree).to_owned(),
                key,
                value: flotilla_protocol::hex::encode(value),
            },
        );
    }
    let sha256 = flotilla_protocol::hex::encode(&Sha256::digest(&text));
    push_line(
        &mut text,
        &Trailer {
            end: true,
            records: records.len(),
            sha256: sha256.clone(),
        },
    );
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| BackupError::Write {
            path: path.to_owned(),
            source,
        })?;
    }
    write_atomic(path, &text).map_err(|source| BackupError::Write {
        path: path.to_owned(),
        source,
    })?;
    Ok(BackupInfo {
        path: path.display().to_string(),
        records: records.len(),
        bytes: text.len() as u64,
        sha256,
        generation: header.generation,
        created_at: now,
    })
}

fn push_line<T: Serialize>(out: &mut Vec<u8>, value: &T) {
    // Plain data; serializing it cannot fail.
    let _ = serde_json::to_writer(&mut *out, value);
    out.push(b'\n');
}

/// Reads and checks a backup: format, version, every line, the record count and the digest.
pub fn read_backup(path: &Path) -> Result<Backup, BackupError> {
    let invalid = |reason: String| BackupError::Invalid {
        path: path.to_owned(),
        reason,
    };
    let file = std::fs::File::open(path).map_err(|source| BackupError::Read {
        path: path.to_owned(),
        source,
    })?;
    let mut reader = BufReader::new(file);
    let mut hasher = Sha256::new();
    let mut line = String::new();
    let mut number = 0usize;
    let mut next_line = |line: &mut String| -> Result<bool, BackupError> {
        line.clear();
        let n = reader.read_line(line).map_err(|source| BackupError::Read {
            path: path.to_owned(),
            source,
        })?;
        Ok(n > 0)
    };
    if !next_line(&mut line)? {
        return Err(invalid("the file is empty".into()));
    }
    number += 1;
    let header: Header = serde_json::from_str(&line)
        .map_err(|e| invalid(format!("line 1 is not a backup header: {e}")))?;
    if header.format != FORMAT {
        return Err(invalid(format!(
            "format {:?}, expected {FORMAT:?}",
            header.format
        )));
    }
    if header.version != VERSION {
        return Err(invalid(format!(
            "version {}, this flotilla reads version {VERSION}",
            header.version
        )));
    }
    hasher.update(line.as_bytes());
    let mut records = Vec::new();
    loop {
        if !next_line(&mut line)? {
            return Err(invalid(format!(
                "it ends after line {number} without its closing line: the file is truncated"
            )));
        }
        number += 1;
        if let Ok(trailer) = serde_json::from_str::<Trailer>(&line) {
            if !trailer.end {
                return Err(invalid(format!(
                    "line {number}: a closing line without end"
                )));
            }
            let digest = flotilla_protocol::hex::encode(&hasher.finalize());
            if trailer.sha256 != digest {
                return Err(invalid(format!(
                    "its content does not match its sha256 (recorded {}, computed {digest}): \
                     the file was changed or damaged",
                    trailer.sha256
                )));
            }
            if trailer.records != records.len() {
                return Err(invalid(format!(
                    "it claims {} records and holds {}",
                    trailer.records,
                    records.len()
                )));
            }
            if next_line(&mut line)? {
                return Err(invalid(format!("text after the closing line {number}")));
            }
            return Ok(Backup {
                created_at: header.created_at,
                generation: header.generation,
                records,
            });
        }
        hasher.update(line.as_bytes());
        let record: Line = serde_json::from_str(&line)
            .map_err(|e| invalid(format!("line {number} is not a record: {e}")))?;
        if !TREES.contains(&record.tree.as_str()) {
            return Err(invalid(format!(
                "line {number}: unknown tree {:?}",
                record.tree
            )));
        }
        let value = decode_hex(&record.value)
            .ok_or_else(|| invalid(format!("line {number}: the value is not hex")))?;
        records.push((record.tree, record.key.into_bytes(), value));
    }
}

/// What a restore did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restored {
    pub records: usize,
    pub generation: u64,
    /// Where the previous store went, with `--force`.
    pub moved_aside: Option<PathBuf>,
}

/// Restores `backup` into the store at `db` (the coordinator must be stopped: the store is
/// locked while it runs). A store with records is refused unless `force`, which moves it to
/// `{db}.before-restore-{now}` first. The restored store is sealed at its new generation.
pub fn restore(db: &Path, backup: &Path, force: bool, now: u64) -> Result<Restored, BackupError> {
    let contents = read_backup(backup)?;
    let mut moved_aside = None;
    {
        let store = Store::open(db)?;
        if !store.is_empty() {
            if !force {
                return Err(BackupError::NotEmpty {
                    path: db.to_owned(),
                });
            }
            drop(store);
            let aside = db.with_file_name(format!(
                "{}.before-restore-{now}",
                db.file_name().unwrap_or_default().to_string_lossy()
            ));
            std::fs::rename(db, &aside).map_err(|source| BackupError::MoveAside {
                path: db.to_owned(),
                source,
            })?;
            moved_aside = Some(aside);
        }
    }
    let store = Store::open(db)?;
    store.import(&contents.records)?;
    Ok(Restored {
        records: contents.records.len(),
        generation: store.generation(),
        moved_aside,
    })
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::store::StoredStrategy;

    fn store_with_records(db: &Path) -> Store {
        let store = Store::open(db).expect("opens");
        for name in ["a", "b"] {
            store
                .save_strategy(&StoredStrategy {
                    name: name.into(),
                    text: format!("[[stage]]\nname = \"{name}\"\n"),
                })
                .expect("saved");
        }
        store.save_issued("dev-1", 77).expect("issued");
        store
    }

    #[test]
    fn a_backup_restores_every_record_into_an_empty_store() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("b.jsonl");
        let info = {
            let store = store_with_records(&dir.path().join("db"));
            write_backup(&store, &file, 1000).expect("backup")
        };
        assert_eq!(
            info.records, 4,
            "two strategies, one issued, the generation"
        );
        let target = dir.path().join("restored");
        let restored = restore(&target, &file, false, 2000).expect("restores");
        assert_eq!(restored.records, 4);
        let store = Store::open(&target).expect("opens");
        assert_eq!(store.list_strategies().expect("lists").len(), 2);
        assert_eq!(store.load_issued().expect("loads")["dev-1"], 77);
        assert_eq!(
            store.check_seal().expect("seal"),
            crate::service::seal::SealCheck::Intact
        );
        assert!(store.generation() > info.generation);
    }

    #[test]
    fn a_changed_or_truncated_backup_is_refused_naming_why() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("b.jsonl");
        write_backup(&store_with_records(&dir.path().join("db")), &file, 1).expect("backup");
        let text = std::fs::read_to_string(&file).expect("read");

        std::fs::write(&file, text.replacen("\"a\"", "\"z\"", 1)).expect("write");
        let err = read_backup(&file).expect_err("edited").to_string();
        assert!(err.contains("does not match its sha256"), "{err}");

        let cut: String = text.lines().take(3).map(|l| format!("{l}\n")).collect();
        std::fs::write(&file, cut).expect("write");
        let err = read_backup(&file).expect_err("truncated").to_string();
        assert!(err.contains("truncated"), "{err}");

        std::fs::write(&file, "hello\n").expect("write");
        let err = read_backup(&file).expect_err("not a backup").to_string();
        assert!(err.contains("line 1"), "{err}");
    }

    #[test]
    fn mutated_backups_never_panic_and_never_restore_altered_records() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("b.jsonl");
        write_backup(&store_with_records(&dir.path().join("db")), &file, 1).expect("backup");
        let original = std::fs::read(&file).expect("read");
        let good = read_backup(&file).expect("valid");
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mutated = dir.path().join("m.jsonl");
        for _ in 0..2_000 {
            let mut bytes = original.clone();
            match next() % 3 {
                0 => {
                    let at = (next() as usize) % bytes.len();
                    bytes[at] ^= 1 << (next() % 8);
                }
                1 => bytes.truncate((next() as usize) % bytes.len()),
                _ => {
                    let at = (next() as usize) % bytes.len();
                    bytes.insert(at, (next() % 256) as u8);
                }
            }
            std::fs::write(&mutated, &bytes).expect("write");
            if let Ok(read) = read_backup(&mutated) {
                assert_eq!(read.records, good.records, "an altered backup read as different records");
            }
        }
    }

    #[test]
    fn restore_refuses_a_store_with_records_unless_forced() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("b.jsonl");
        let db = dir.path().join("db");
        write_backup(&store_with_records(&db), &file, 1).expect("backup");
        let err = restore(&db, &file, false, 5).expect_err("not empty");
        assert!(err.to_string().contains("--force"), "{err}");
        let restored = restore(&db, &file, true, 5).expect("forced");
        let aside = restored.moved_aside.expect("moved aside");
        assert!(
            aside.ends_with("db.before-restore-5"),
            "{}",
            aside.display()
        );
        assert!(aside.exists());
    }
}
