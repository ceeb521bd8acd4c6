//! The device's own ed25519 key: `<data_dir>/device.key`, made on first start and reused on
//! every start after it. It signs every state, report and block request the agent sends
//! ([`flotilla_protocol::device`]); the coordinator accepts a device only once an operator (or
//! a pre-authorized key, or an enrollment token) enrolled that key.
//!
//! The file holds the 32-byte seed in hex, like the coordinator's key files. It is written
//! atomically and owner-only (`0o600`) from the moment it exists, so a power cut never leaves a
//! half-written key (which would silently turn the device into a new, unenrolled one). A key
//! file other users can read is narrowed to `0o600` with a warning: it is still the device's
//! identity, and refusing to start would take the device off the fleet.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use flotilla_protocol::signing::{generate_key, secret_key_from_text, secret_key_to_text};
use flotilla_protocol::SigningKey;

/// The key file's name inside the data directory.
pub const KEY_FILE: &str = "device.key";

/// Why the device key could not be loaded or created.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("cannot read device key {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("device key {path} is not a key ({reason}); move it aside to make a new one (the device must then be enrolled again)")]
    Parse { path: PathBuf, reason: String },
    #[error("cannot write device key {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("cannot narrow the permissions of device key {path}: {source}")]
    Permissions { path: PathBuf, source: io::Error },
}

/// `<data_dir>/device.key`.
pub fn key_file(data_dir: &Path) -> PathBuf {
    data_dir.join(KEY_FILE)
}

/// Loads the device key from `data_dir`, or makes one there if there is none yet. The data
/// directory must exist.
pub fn load_or_create(data_dir: &Path) -> Result<SigningKey, IdentityError> {
    let path = key_file(data_dir);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let key = secret_key_from_text(&text).map_err(|e| IdentityError::Parse {
                path: path.clone(),
                reason: e.to_string(),
            })?;
            narrow_permissions(&path)?;
            Ok(key)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let key = generate_key();
            let write = |source| IdentityError::Write {
                path: path.clone(),
                source,
            };
            // Written whole under a name of this process's own, then linked into place only if
            // no key is there yet: an agent starting and `flotilla-agent identity` run at the
            // same moment (`systemctl enable --now` and then `identity`, as the README does)
            // must not each make a key, the second replacing the first on disk while the first
            // signs for the running agent. The one that loses reads the winner's key.
            static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let own = data_dir.join(format!(".{KEY_FILE}.{}-{n}", std::process::id()));
            flotilla_targets::fs::atomic_write_private(&own, secret_key_to_text(&key))
                .map_err(write)?;
            let linked = std::fs::hard_link(&own, &path);
            let _ = std::fs::remove_file(&own);
            match linked {
                Ok(()) => flotilla_targets::fs::fsync_dir(data_dir).map_err(write)?,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    return load_or_create(data_dir)
                }
                Err(source) => return Err(write(source)),
            }
            tracing::info!(
                key = %flotilla_protocol::hex::encode(key.verifying_key().as_bytes()),
                path = %path.display(),
                "made a new device key; the coordinator must enroll it before it accepts this device"
            );
            Ok(key)
        }
        Err(source) => Err(IdentityError::Read { path, source }),
    }
}

/// The device's public key in hex, making the key (and the data directory) on first use.
pub fn public_key(data_dir: &Path) -> Result<String, IdentityError> {
    std::fs::create_dir_all(data_dir).map_err(|source| IdentityError::Write {
        path: data_dir.to_owned(),
        source,
    })?;
    let key = load_or_create(data_dir)?;
    Ok(flotilla_protocol::hex::encode(
        key.verifying_key().as_bytes(),
    ))
}

fn narrow_permissions(path: &Path) -> Result<(), IdentityError> {
    let error = |source| IdentityError::Permissions {
        path: path.to_owned(),
        source,
    };
    let mode = std::fs::metadata(path).map_err(error)?.permissions().mode();
    if mode & 0o077 != 0 {
        tracing::warn!(path = %path.display(), mode = format!("{:o}", mode & 0o777), "device key was readable by other users; narrowing it to 0600");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(error)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path)
            .expect("metadata")
            .permissions()
            .mode()
            & 0o777
    }

    #[test]
    fn processes_making_the_key_at_once_all_end_with_the_same_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let keys: Vec<String> = std::thread::scope(|s| {
            let makers: Vec<_> = (0..8)
                .map(|_| s.spawn(|| public_key(dir.path()).expect("key")))
                .collect();
            makers
                .into_iter()
                .map(|m| m.join().expect("thread"))
                .collect()
        });
        let on_disk = public_key(dir.path()).expect("key");
        assert!(keys.iter().all(|k| *k == on_disk), "{keys:?} vs {on_disk}");
        let files: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .filter_map(Result::ok)
            .map(|e| e.file_name())
            .collect();
        assert_eq!(files, [KEY_FILE], "no temporary file is left");
    }

    #[test]
    fn key_is_made_once_owner_only_and_reused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = load_or_create(dir.path()).expect("made");
        let path = key_file(dir.path());
        assert_eq!(mode(&path), 0o600);
        let again = load_or_create(dir.path()).expect("loaded");
        assert_eq!(
            again.to_bytes(),
            first.to_bytes(),
            "the same key on restart"
        );
        assert_eq!(mode(&path), 0o600);
        // Only the key file is left, no temporary file.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, [KEY_FILE]);
        // Another data directory is another device.
        let other = tempfile::tempdir().expect("tempdir");
        let second = load_or_create(other.path()).expect("made");
        assert_ne!(second.to_bytes(), first.to_bytes());
        assert_eq!(
            public_key(dir.path()).expect("public key"),
            flotilla_protocol::hex::encode(first.verifying_key().as_bytes())
        );
    }

    #[test]
    fn a_readable_key_is_narrowed_and_a_broken_one_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = load_or_create(dir.path()).expect("made");
        let path = key_file(dir.path());
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let again = load_or_create(dir.path()).expect("loaded");
        assert_eq!(again.to_bytes(), first.to_bytes());
        assert_eq!(mode(&path), 0o600);

        std::fs::write(&path, "not a key\n").expect("write");
        let err = load_or_create(dir.path()).expect_err("broken key");
        assert!(
            err.to_string().contains("device.key") && err.to_string().contains("not a key"),
            "{err}"
        );
        assert_eq!(
            std::fs::read_to_string(&path).expect("read"),
            "not a key\n",
            "a broken key is never replaced silently"
        );
    }
}
