//! `flotilla backup` and `flotilla restore`: the coordinator's store as one signed file.
//!
//! A backup is JSON lines, readable with standard tools:
//!
//! ```text
//! {"format":"flotilla-backup","version":2,"created_at":1790000000,"generation":57,"signer":"3b6a…"}
//! {"tree":"rollouts","key":"fw-2","value":"7b226e616d65...}     one line per record (value in hex)
//! {"end":true,"records":12,"sha256":"...","signature":"..."}   sha256 of every byte above, signed
//! ```
//!
//! The trailer makes a truncated file an error naming what is wrong, never a partial restore.
//! The sha256 alone is no defence against an edit (anyone can recompute it), so the coordinator
//! signs it with its own key (`signer`, the key that signs desired actions): the signature covers
//! [`SIGNATURE_CONTEXT`], the record count and the sha256, which covers the header with the
//! signer and every record. A restore verifies it against the coordinator keys the operator
//! names, before anything is written (decision 0042). Version 1 backups carry no signature and
//! are restored only when the operator says so.
//!
//! A running coordinator writes a backup into `{data_dir}/backups/` when asked (the `backup`
//! control command: the path is its own choice, never the requester's); a stopped one can be
//! backed up with `flotilla backup --data-dir --coordinator-key`. Restore is offline only: it
//! writes into an empty store (or moves the old one aside with `--force`) and seals the result.
//!
//! Releases, artifacts and keys are plain files in the data directory and are backed up as
//! files (docs/operations.md).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use flotilla_protocol::control::BackupInfo;
use flotilla_protocol::{hex, SignedBlob, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::service::seal::write_atomic;
use crate::service::store::{Store, StoreError, TREES};

const FORMAT: &str = "flotilla-backup";
/// Signed backups. Version 1 was the same file without `signer` and `signature`.
const VERSION: u32 = 2;
const UNSIGNED_VERSION: u32 = 1;

/// What a backup's signature covers, ahead of the record count and the sha256: no other message
/// the coordinator key signs starts with these bytes (desired actions and grants start with the
/// protocol version, 1), so a backup signature is never anything else's.
pub const SIGNATURE_CONTEXT: &[u8] = b"flotilla backup signature v2\0";

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
    #[error(
        "{} is a version 1 backup, which carries no signature: anyone who could write the file \
         could have changed it and recomputed its sha256, so it is not restored; pass \
         --allow-unsigned to restore it anyway if it was kept where nobody else could write it",
        path.display()
    )]
    Unsigned { path: PathBuf },
    #[error(
        "{} is signed by coordinator key {signer}, which is none of the keys given ({trusted}); \
         if {signer} was this coordinator's key before a rotation, add its public key file with \
         --trust-key; otherwise the backup is not this coordinator's",
        path.display()
    )]
    UnknownSigner {
        path: PathBuf,
        signer: String,
        trusted: String,
    },
    #[error(
        "{}: its signature does not verify against its signer, coordinator key {signer}: the \
         file was changed (or damaged) after the coordinator signed it",
        path.display()
    )]
    BadSignature { path: PathBuf, signer: String },
}

/// Which backups a restore believes.
#[derive(Debug, Clone, Copy)]
pub struct Trust<'a> {
    /// Coordinator keys a backup may be signed by: the coordinator's own, and any it had before
    /// a rotation that the operator names.
    pub keys: &'a [VerifyingKey],
    /// Restore version 1 (unsigned) backups too.
    pub allow_unsigned: bool,
}

#[derive(Serialize, Deserialize)]
struct Header {
    format: String,
    version: u32,
    created_at: u64,
    generation: u64,
    /// The coordinator key (hex) that signed the backup; absent from version 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    signer: Option<String>,
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
    /// The signer's ed25519 signature (hex) over [`signed_bytes`]; absent from version 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    signature: Option<String>,
}

/// The bytes a backup's signature covers.
fn signed_bytes(records: usize, sha256: &[u8]) -> Vec<u8> {
    let mut bytes = SIGNATURE_CONTEXT.to_vec();
    bytes.extend_from_slice(&(records as u64).to_be_bytes());
    bytes.extend_from_slice(sha256);
    bytes
}

/// A backup read back and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backup {
    pub created_at: u64,
    pub generation: u64,
    /// The coordinator key that signed it; `None` for a version 1 backup.
    pub signer: Option<VerifyingKey>,
    /// Tree name, key, value.
    pub records: Vec<(String, Vec<u8>, Vec<u8>)>,
}

/// Writes every record of `store` to `path`, signed with the coordinator key `key`
/// (atomically: a crash leaves no half backup).
pub fn write_backup(
    store: &Store,
    path: &Path,
    now: u64,
    key: &SigningKey,
) -> Result<BackupInfo, BackupError> {
    let records = store.export()?;
    let mut text = Vec::new();
    let signer = hex::encode(key.verifying_key().as_bytes());
    let header = Header {
        format: FORMAT.into(),
        version: VERSION,
        created_at: now,
        generation: store.generation(),
        signer: Some(signer.clone()),
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
                value: hex::encode(value),
            },
        );
    }
    let digest = Sha256::digest(&text);
    let sha256 = hex::encode(&digest);
    let signature = SignedBlob::sign(key, signed_bytes(records.len(), &digest)).signature;
    push_line(
        &mut text,
        &Trailer {
            end: true,
            records: records.len(),
            sha256: sha256.clone(),
            signature: Some(hex::encode(&signature)),
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
        signed_by: Some(signer),
    })
}

fn push_line<T: Serialize>(out: &mut Vec<u8>, value: &T) {
    // Plain data; serializing it cannot fail.
    let _ = serde_json::to_writer(&mut *out, value);
    out.push(b'\n');
}

/// Reads and checks a backup: format, version, its signer among `trust`'s keys, every line, the
/// record count, the digest and the signature. Nothing is believed before all of it holds.
pub fn read_backup(path: &Path, trust: Trust<'_>) -> Result<Backup, BackupError> {
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
    let signer = match (header.version, &header.signer) {
        (VERSION, Some(signer)) => Some(trusted_signer(path, signer, trust.keys)?),
        (VERSION, None) => {
            return Err(invalid(
                "line 1: a version 2 header without its signer".into(),
            ))
        }
        (UNSIGNED_VERSION, _) if trust.allow_unsigned => None,
        (UNSIGNED_VERSION, _) => {
            return Err(BackupError::Unsigned {
                path: path.to_owned(),
            })
        }
        (other, _) => {
            return Err(invalid(format!(
                "version {other}, this flotilla reads versions {UNSIGNED_VERSION} and {VERSION}"
            )))
        }
    };
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
            let digest = hasher.finalize();
            let computed = hex::encode(&digest);
            if trailer.sha256 != computed {
                return Err(invalid(format!(
                    "its content does not match its sha256 (recorded {}, computed {computed}): \
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
            if let Some(signer) = &signer {
                check_signature(path, signer, &trailer, &digest)?;
            }
            if next_line(&mut line)? {
                return Err(invalid(format!("text after the closing line {number}")));
            }
            return Ok(Backup {
                created_at: header.created_at,
                generation: header.generation,
                signer,
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

/// The header's signer, if it is one of the trusted keys: checked before any record is read, so
/// a backup of another coordinator is refused at once, naming both.
fn trusted_signer(
    path: &Path,
    signer: &str,
    trusted: &[VerifyingKey],
) -> Result<VerifyingKey, BackupError> {
    trusted
        .iter()
        .find(|k| hex::encode(k.as_bytes()) == signer.to_ascii_lowercase())
        .copied()
        .ok_or_else(|| BackupError::UnknownSigner {
            path: path.to_owned(),
            signer: signer.to_owned(),
            trusted: if trusted.is_empty() {
                "none".to_owned()
            } else {
                trusted
                    .iter()
                    .map(|k| hex::encode(k.as_bytes()))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        })
}

/// Verifies the trailer's signature over the record count and the digest just computed.
fn check_signature(
    path: &Path,
    signer: &VerifyingKey,
    trailer: &Trailer,
    digest: &[u8],
) -> Result<(), BackupError> {
    let bad = || BackupError::BadSignature {
        path: path.to_owned(),
        signer: hex::encode(signer.as_bytes()),
    };
    let signature = trailer
        .signature
        .as_deref()
        .and_then(decode_hex)
        .ok_or_else(bad)?;
    let blob = SignedBlob {
        payload: signed_bytes(trailer.records, digest),
        signer: signer.to_bytes(),
        signature,
    };
    blob.verify("backup", std::slice::from_ref(signer))
        .map(|_| ())
        .map_err(|_| bad())
}

/// What a restore did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restored {
    pub records: usize,
    pub generation: u64,
    /// The coordinator key that signed the backup; `None` for a version 1 backup.
    pub signer: Option<VerifyingKey>,
    /// Where the previous store went, with `--force`.
    pub moved_aside: Option<PathBuf>,
}

/// Restores `backup` into the store at `db` (the coordinator must be stopped: the store is
/// locked while it runs), once it is read whole and its signature verified against `trust`. A
/// store with records is refused unless `force`, which moves it to `{db}.before-restore-{now}`
/// first. The restored store is sealed at its new generation.
pub fn restore(
    db: &Path,
    backup: &Path,
    force: bool,
    now: u64,
    trust: Trust<'_>,
) -> Result<Restored, BackupError> {
    let contents = read_backup(backup, trust)?;
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
        signer: contents.signer,
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

    fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    /// The coordinator's key in these tests, and the trust of a restore that knows only it.
    fn coordinator() -> SigningKey {
        key(7)
    }

    fn trusted() -> [VerifyingKey; 1] {
        [coordinator().verifying_key()]
    }

    fn trust(keys: &[VerifyingKey]) -> Trust<'_> {
        Trust {
            keys,
            allow_unsigned: false,
        }
    }

    /// Rewrites a backup's closing line with the sha256 of `text`'s other lines, as anyone can.
    fn recompute_sha256(text: &str) -> String {
        let mut lines: Vec<&str> = text.lines().collect();
        let trailer = lines.pop().expect("a closing line");
        let body: String = lines.iter().map(|l| format!("{l}\n")).collect();
        let mut trailer: serde_json::Value = serde_json::from_str(trailer).expect("json");
        trailer["sha256"] = hex::encode(&Sha256::digest(body.as_bytes())).into();
        format!("{body}{trailer}\n")
    }

    /// A backup of [`store_with_records`] signed with [`coordinator`], in a fresh directory.
    fn signed_backup() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("b.jsonl");
        write_backup(
            &store_with_records(&dir.path().join("db")),
            &file,
            1,
            &coordinator(),
        )
        .expect("backup");
        (dir, file)
    }

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
            write_backup(&store, &file, 1000, &coordinator()).expect("backup")
        };
        assert_eq!(
            info.records, 4,
            "two strategies, one issued, the generation"
        );
        let target = dir.path().join("restored");
        let restored = restore(&target, &file, false, 2000, trust(&trusted())).expect("restores");
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
        let (_dir, file) = signed_backup();
        let text = std::fs::read_to_string(&file).expect("read");

        std::fs::write(&file, text.replacen("\"a\"", "\"z\"", 1)).expect("write");
        let err = read_backup(&file, trust(&trusted()))
            .expect_err("edited")
            .to_string();
        assert!(err.contains("does not match its sha256"), "{err}");

        let cut: String = text.lines().take(3).map(|l| format!("{l}\n")).collect();
        std::fs::write(&file, cut).expect("write");
        let err = read_backup(&file, trust(&trusted()))
            .expect_err("truncated")
            .to_string();
        assert!(err.contains("truncated"), "{err}");

        std::fs::write(&file, "hello\n").expect("write");
        let err = read_backup(&file, trust(&trusted()))
            .expect_err("not a backup")
            .to_string();
        assert!(err.contains("line 1"), "{err}");
    }

    #[test]
    fn an_edited_backup_with_its_sha256_recomputed_is_refused_by_its_signature() {
        let (_dir, file) = signed_backup();
        let text = std::fs::read_to_string(&file).expect("read");
        assert_eq!(
            read_backup(&file, trust(&trusted()))
                .expect("as written")
                .signer,
            Some(coordinator().verifying_key())
        );

        // A record changed (a strategy's text here; a revoked device made accepted again, or a
        // used token dropped, are the same edit) and the sha256 made to match again.
        let edited = text.replacen(&hex::encode(b"name"), &hex::encode(b"NAME"), 1);
        assert_ne!(edited, text);
        std::fs::write(&file, recompute_sha256(&edited)).expect("write");
        let err = read_backup(&file, trust(&trusted()))
            .expect_err("edited")
            .to_string();
        assert!(
            err.contains("signature does not verify")
                && err.contains(&hex::encode(coordinator().verifying_key().as_bytes())),
            "{err}"
        );
        // A record dropped, and the count and sha256 made to match: the count is signed too.
        let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
        lines.remove(1);
        let last = lines.len() - 1;
        lines[last] = lines[last].replace("\"records\":4", "\"records\":3");
        let dropped: String = lines.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(&file, recompute_sha256(&dropped)).expect("write");
        let err = read_backup(&file, trust(&trusted()))
            .expect_err("a record dropped")
            .to_string();
        assert!(err.contains("signature does not verify"), "{err}");
        // The signature removed altogether.
        let mut trailer: serde_json::Value =
            serde_json::from_str(text.lines().last().expect("trailer")).expect("json");
        trailer.as_object_mut().expect("object").remove("signature");
        let body: String = text
            .lines()
            .rev()
            .skip(1)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&file, format!("{body}{trailer}\n")).expect("write");
        let err = read_backup(&file, trust(&trusted()))
            .expect_err("unsigned trailer")
            .to_string();
        assert!(err.contains("signature does not verify"), "{err}");
    }

    #[test]
    fn a_backup_signed_by_another_key_is_refused_unless_that_key_is_trusted() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("b.jsonl");
        let db = dir.path().join("db");
        // Made before a rotation, with the coordinator's previous key.
        let previous = key(6);
        write_backup(&store_with_records(&db), &file, 1, &previous).expect("backup");
        let err = restore(&dir.path().join("new"), &file, false, 5, trust(&trusted()))
            .expect_err("another key")
            .to_string();
        let previous_hex = hex::encode(previous.verifying_key().as_bytes());
        let current_hex = hex::encode(coordinator().verifying_key().as_bytes());
        assert!(
            err.contains(&previous_hex)
                && err.contains(&current_hex)
                && err.contains("--trust-key"),
            "{err}"
        );
        assert!(
            !dir.path().join("new").exists(),
            "nothing is written before the backup is believed"
        );
        let both = [coordinator().verifying_key(), previous.verifying_key()];
        let restored =
            restore(&dir.path().join("new"), &file, false, 5, trust(&both)).expect("trusted");
        assert_eq!(restored.signer, Some(previous.verifying_key()));

        // Someone re-signs an edited backup with a key of their own, naming it as the signer.
        let text = std::fs::read_to_string(&file).expect("read");
        let forger = key(9);
        let forged = text.replace(
            &previous_hex,
            &hex::encode(forger.verifying_key().as_bytes()),
        );
        let forged_file = dir.path().join("forged.jsonl");
        std::fs::write(&forged_file, forged).expect("write");
        let err = read_backup(&forged_file, trust(&both))
            .expect_err("the forger's key is not trusted")
            .to_string();
        assert!(err.contains("none of the keys given"), "{err}");
    }

    #[test]
    fn an_unsigned_version_1_backup_is_restored_only_when_allowed() {
        let (_dir, file) = signed_backup();
        // What an older flotilla wrote: no signer, no signature, version 1.
        let text = std::fs::read_to_string(&file).expect("read");
        let mut lines = text.lines();
        let mut header: serde_json::Value =
            serde_json::from_str(lines.next().expect("header")).expect("json");
        header["version"] = 1.into();
        header.as_object_mut().expect("object").remove("signer");
        let mut body = format!("{header}\n");
        let rest: Vec<&str> = lines.collect();
        for line in &rest[..rest.len() - 1] {
            body.push_str(line);
            body.push('\n');
        }
        let sha256 = hex::encode(&Sha256::digest(body.as_bytes()));
        let v1 = format!(
            "{body}{{\"end\":true,\"records\":{},\"sha256\":\"{sha256}\"}}\n",
            rest.len() - 1
        );
        std::fs::write(&file, v1).expect("write");
        let err = read_backup(&file, trust(&trusted()))
            .expect_err("unsigned")
            .to_string();
        assert!(
            err.contains("version 1") && err.contains("--allow-unsigned"),
            "{err}"
        );
        let keys = trusted();
        let allowed = Trust {
            keys: &keys,
            allow_unsigned: true,
        };
        let read = read_backup(&file, allowed).expect("allowed");
        assert_eq!(read.signer, None);
        assert_eq!(read.records.len(), 4);
    }

    #[test]
    fn mutated_backups_never_panic_and_never_restore_altered_records() {
        let (dir, file) = signed_backup();
        let original = std::fs::read(&file).expect("read");
        let good = read_backup(&file, trust(&trusted())).expect("valid");
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
            if let Ok(read) = read_backup(&mutated, trust(&trusted())) {
                assert_eq!(
                    read.records, good.records,
                    "an altered backup read as different records"
                );
            }
        }
    }

    #[test]
    fn restore_refuses_a_store_with_records_unless_forced() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("b.jsonl");
        let db = dir.path().join("db");
        write_backup(&store_with_records(&db), &file, 1, &coordinator()).expect("backup");
        let err = restore(&db, &file, false, 5, trust(&trusted())).expect_err("not empty");
        assert!(err.to_string().contains("--force"), "{err}");
        let restored = restore(&db, &file, true, 5, trust(&trusted())).expect("forced");
        let aside = restored.moved_aside.expect("moved aside");
        assert!(
            aside.ends_with("db.before-restore-5"),
            "{}",
            aside.display()
        );
        assert!(aside.exists());
    }
}
