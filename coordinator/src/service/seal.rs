//! The store's seal: a side file that remembers how far the store got, so a store that lost
//! writes it had acknowledged is noticed at start instead of silently accepted.
//!
//! The store counts its commits (a generation in its `meta` tree, written in the same flush as
//! the records). After every flush the generation is also written to `{db}.seal`, atomically
//! (temp file, fsync, rename, fsync of the directory). sled recovers a damaged log by cutting it
//! at the first bad entry, which takes the generation back with the records; the seal keeps the
//! higher number. At start, a store generation below the sealed one means acknowledged writes
//! are missing (docs/operations.md, "Backup and restore").
//!
//! The order is flush, then seal: a crash between the two leaves the store ahead of its seal,
//! which is fine. The seal is one line of text: `flotilla-store-seal 1 generation N`.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC: &str = "flotilla-store-seal 1 generation";

/// What the seal says about the store it belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SealCheck {
    /// No seal yet (a new store, or one from a version without seals).
    Unsealed,
    /// The store holds at least what the seal remembers.
    Intact,
    /// The store holds fewer commits than were acknowledged.
    Lost { stored: u64, sealed: u64 },
}

/// The seal file next to a store.
#[derive(Debug, Clone)]
pub struct Seal {
    path: PathBuf,
}

impl Seal {
    /// The seal of the sled database at `db` (the file `{db}.seal`).
    pub fn for_store(db: &Path) -> Seal {
        let mut name = db.file_name().unwrap_or_default().to_os_string();
        name.push(".seal");
        Seal {
            path: db.with_file_name(name),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The sealed generation; `None` when there is no seal. A seal that does not parse is an
    /// error naming the file: it is never taken for "no seal".
    pub fn read(&self) -> Result<Option<u64>, String> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read {}: {e}", self.path.display())),
        };
        text.trim()
            .strip_prefix(MAGIC)
            .and_then(|n| n.trim().parse().ok())
            .map(Some)
            .ok_or_else(|| {
                format!(
                    "{} is not a store seal (expected \"{MAGIC} N\")",
                    self.path.display()
                )
            })
    }

    /// Compares the store's generation with the seal.
    pub fn check(&self, stored: u64) -> Result<SealCheck, String> {
        Ok(match self.read()? {
            None => SealCheck::Unsealed,
            Some(sealed) if stored < sealed => SealCheck::Lost { stored, sealed },
            Some(_) => SealCheck::Intact,
        })
    }

    /// Records `generation` durably.
    pub fn write(&self, generation: u64) -> std::io::Result<()> {
        write_atomic(&self.path, format!("{MAGIC} {generation}\n").as_bytes())
    }
}

/// Writes `bytes` to `path` through a temp file in the same directory: fsync, rename, fsync of
/// the directory, so a crash leaves either the old file or the new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_behind_its_seal_is_lost_data() {
        let dir = tempfile::tempdir().expect("temp dir");
        let seal = Seal::for_store(&dir.path().join("db"));
        assert_eq!(seal.path(), dir.path().join("db.seal"));
        assert_eq!(seal.check(0), Ok(SealCheck::Unsealed));
        seal.write(41).expect("sealed");
        assert_eq!(seal.check(41), Ok(SealCheck::Intact));
        assert_eq!(seal.check(50), Ok(SealCheck::Intact), "ahead is fine");
        assert_eq!(
            seal.check(40),
            Ok(SealCheck::Lost {
                stored: 40,
                sealed: 41
            })
        );
    }

    #[test]
    fn a_damaged_seal_is_an_error_naming_it() {
        let dir = tempfile::tempdir().expect("temp dir");
        let seal = Seal::for_store(&dir.path().join("db"));
        std::fs::write(seal.path(), "garbage").expect("write");
        let err = seal.check(3).expect_err("not a seal");
        assert!(err.contains("db.seal"), "{err}");
    }
}
