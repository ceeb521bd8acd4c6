//! Key files: `flotilla keygen` and the loaders the rest of the coordinator uses.
//!
//! Two ed25519 key pairs matter: the offline **release** key that signs release manifests, and the
//! online **coordinator** key that signs desired actions. Both are stored as hex text (the
//! format of `flotilla_protocol::signing`), secret halves with mode 0600 so that a shared
//! machine does not leak them. Existing files are never overwritten by accident: replacing a key
//! strands every device that trusts the old one, so it takes `--force`.

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use flotilla_protocol::signing::{self, KeyError};
use flotilla_protocol::{SigningKey, VerifyingKey};

/// Why a key operation failed. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error("cannot create key directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} already exists; pass --force to replace it (devices trusting the old key will refuse new signatures)")]
    Exists { path: PathBuf },
    #[error("cannot write key file {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read key file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("key file {path} is not a valid key: {source}")]
    Parse { path: PathBuf, source: KeyError },
    #[error("key name {name:?} is invalid: {source}")]
    Name {
        name: String,
        source: flotilla_protocol::IdError,
    },
    #[error("keys document: {0}")]
    Document(String),
    #[error("keys document {path} cannot be read as one: {reason}")]
    DocumentFile { path: PathBuf, reason: String },
}

/// One key pair written by [`keygen`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenKey {
    pub secret: PathBuf,
    pub public: PathBuf,
    /// The public key in hex, to paste into agent configs.
    pub public_hex: String,
}

/// Writes `{name}.key` / `{name}.pub` into `dir` for each name (default: `release` and
/// `coordinator`). Checks every target file before writing any, so a refusal leaves nothing
/// half-done.
pub fn keygen(dir: &Path, names: &[String], force: bool) -> Result<Vec<WrittenKey>, KeysError> {
    let default_names = ["release".to_owned(), "coordinator".to_owned()];
    let names = if names.is_empty() {
        &default_names[..]
    } else {
        names
    };
    for name in names {
        flotilla_protocol::validate_id("key name", name).map_err(|source| KeysError::Name {
            name: name.clone(),
            source,
        })?;
    }
    fs::create_dir_all(dir).map_err(|source| KeysError::CreateDir {
        path: dir.to_owned(),
        source,
    })?;
    if !force {
        for name in names {
            for ext in ["key", "pub"] {
                let path = dir.join(format!("{name}.{ext}"));
                if path.exists() {
                    return Err(KeysError::Exists { path });
                }
            }
        }
    }
    let mut written = Vec::new();
    for name in names {
        let key = signing::generate_key();
        let secret = dir.join(format!("{name}.key"));
        let public = dir.join(format!("{name}.pub"));
        write_file(&secret, signing::secret_key_to_text(&key).as_bytes(), 0o600)?;
        let public_text = signing::public_key_to_text(&key.verifying_key());
        write_file(&public, public_text.as_bytes(), 0o644)?;
        written.push(WrittenKey {
            secret,
            public,
            public_hex: public_text.trim().to_owned(),
        });
    }
    Ok(written)
}

fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), KeysError> {
    let err = |source| KeysError::Write {
        path: path.to_owned(),
        source,
    };
    let mut options = fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        // Set at creation so the secret is never readable by others, not even briefly.
        options.mode(mode);
    }
    let mut file = options.open(path).map_err(err)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        // `mode` at open only applies to new files; a forced overwrite must tighten it too.
        file.set_permissions(fs::Permissions::from_mode(mode))
            .map_err(err)?;
    }
    file.write_all(bytes).map_err(err)?;
    file.sync_all().map_err(err)
}

fn read_text(path: &Path) -> Result<String, KeysError> {
    fs::read_to_string(path).map_err(|source| KeysError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Loads a secret key file.
pub fn load_secret_key(path: &Path) -> Result<SigningKey, KeysError> {
    signing::secret_key_from_text(&read_text(path)?).map_err(|source| KeysError::Parse {
        path: path.to_owned(),
        source,
    })
}

/// Loads a public key file.
pub fn load_public_key(path: &Path) -> Result<VerifyingKey, KeysError> {
    signing::public_key_from_text(&read_text(path)?).map_err(|source| KeysError::Parse {
        path: path.to_owned(),
        source,
    })
}

/// What a key rotation document replaces (see `flotilla keys rotate`).
#[derive(Debug, Clone)]
pub struct Rotation {
    pub version: u64,
    pub release_keys: Vec<PathBuf>,
    pub coordinator_keys: Vec<PathBuf>,
    /// New root keys; empty keeps the devices' current ones.
    pub root_keys: Vec<PathBuf>,
    pub root_threshold: u32,
    /// Secret root keys to sign with now; more can sign later with [`cosign`].
    pub signers: Vec<PathBuf>,
}

/// Builds and signs a keys document, written to `out` (mode 0644; it holds no secret).
/// Devices accept it with `flotilla-agent keys install` once enough current root keys signed it.
pub fn rotate(rotation: &Rotation, out: &Path) -> Result<usize, KeysError> {
    let publics = |paths: &[PathBuf]| -> Result<Vec<[u8; 32]>, KeysError> {
        paths
            .iter()
            .map(|p| load_public_key(p).map(|k| k.to_bytes()))
            .collect()
    };
    let doc = flotilla_protocol::keys::KeysDocument {
        version: rotation.version,
        release_keys: publics(&rotation.release_keys)?,
        coordinator_keys: publics(&rotation.coordinator_keys)?,
        root_keys: if rotation.root_keys.is_empty() {
            None
        } else {
            Some(publics(&rotation.root_keys)?)
        },
        root_threshold: rotation.root_threshold,
    };
    if doc.release_keys.is_empty() || doc.coordinator_keys.is_empty() {
        return Err(KeysError::Document(
            "name at least one --release-key and one --coordinator-key".into(),
        ));
    }
    if let Some(roots) = &doc.root_keys {
        if doc.root_threshold == 0 || doc.root_threshold as usize > roots.len() {
            return Err(KeysError::Document(format!(
                "--root-threshold {} must be from 1 to the {} new root keys",
                doc.root_threshold,
                roots.len()
            )));
        }
    }
    if rotation.signers.is_empty() {
        return Err(KeysError::Document(
            "sign with at least one root key (--sign ROOT.key)".into(),
        ));
    }
    let signers = rotation
        .signers
        .iter()
        .map(|p| load_secret_key(p))
        .collect::<Result<Vec<_>, _>>()?;
    let refs: Vec<&SigningKey> = signers.iter().collect();
    let signed = flotilla_protocol::signing::MultiSignedBlob::sign(
        &refs,
        flotilla_protocol::envelope::to_bytes(&doc),
    );
    write_file(out, &flotilla_protocol::keys::encode_file(&signed), 0o644)?;
    Ok(signers.len())
}

/// Adds a root key's signature to a keys document file, in place; returns how many signatures
/// it now has.
pub fn cosign(file: &Path, key: &Path) -> Result<usize, KeysError> {
    let bytes = fs::read(file).map_err(|source| KeysError::Read {
        path: file.to_owned(),
        source,
    })?;
    let mut signed =
        flotilla_protocol::keys::decode_file(&bytes).map_err(|e| KeysError::DocumentFile {
            path: file.to_owned(),
            reason: e.to_string(),
        })?;
    signed.add_signature(&load_secret_key(key)?);
    let count = signed.signatures.len();
    write_file(file, &flotilla_protocol::keys::encode_file(&signed), 0o644)?;
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_both_pairs_that_load_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let written = keygen(dir.path(), &[], false).expect("keygen");
        assert_eq!(written.len(), 2);
        for w in &written {
            let secret = load_secret_key(&w.secret).expect("secret loads");
            let public = load_public_key(&w.public).expect("public loads");
            assert_eq!(secret.verifying_key(), public);
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt as _;
                let mode = fs::metadata(&w.secret).expect("meta").permissions().mode() & 0o777;
                assert_eq!(mode, 0o600, "{}", w.secret.display());
            }
        }
        assert!(dir.path().join("release.key").exists());
        assert!(dir.path().join("coordinator.pub").exists());
    }

    #[test]
    fn refuses_to_overwrite_unless_forced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = keygen(dir.path(), &["ops".into()], false).expect("keygen");
        let err = keygen(dir.path(), &["ops".into()], false).expect_err("exists");
        assert!(err.to_string().contains("ops.key"), "{err}");
        assert!(err.to_string().contains("--force"), "{err}");
        // The refused run changed nothing.
        let on_disk = fs::read_to_string(&first[0].public).expect("read");
        assert_eq!(on_disk.trim(), first[0].public_hex);
        let second = keygen(dir.path(), &["ops".into()], true).expect("forced");
        assert_ne!(first[0].public_hex, second[0].public_hex);
    }

    #[test]
    fn load_errors_name_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("nope.key");
        let err = load_secret_key(&missing).expect_err("missing");
        assert!(err.to_string().contains("nope.key"), "{err}");
        let bad = dir.path().join("bad.pub");
        fs::write(&bad, "zz").expect("write");
        let err = load_public_key(&bad).expect_err("bad");
        assert!(err.to_string().contains("bad.pub"), "{err}");
        let err = keygen(dir.path(), &["a/b".into()], false).expect_err("bad name");
        assert!(err.to_string().contains("a/b"), "{err}");
    }

    #[test]
    fn rotation_documents_are_accepted_by_the_current_roots_only() {
        use flotilla_protocol::keys::{decode_file, KeyRing};
        let dir = tempfile::tempdir().expect("tempdir");
        let names: Vec<String> = ["root1", "root2", "root3", "release2", "coord2"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        keygen(dir.path(), &names, false).expect("keys");
        let p = |n: &str| dir.path().join(n);
        let rotation = Rotation {
            version: 1,
            release_keys: vec![p("release2.pub")],
            coordinator_keys: vec![p("coord2.pub")],
            root_keys: Vec::new(),
            root_threshold: 2,
            signers: vec![p("root1.key")],
        };
        let out = p("keys-v1.flkeys");
        assert_eq!(rotate(&rotation, &out).expect("written"), 1);
        let roots: Vec<VerifyingKey> = ["root1.pub", "root2.pub", "root3.pub"]
            .iter()
            .map(|n| load_public_key(&p(n)).expect("pub"))
            .collect();
        let ring = KeyRing {
            version: 0,
            release_keys: Vec::new(),
            coordinator_keys: Vec::new(),
            root_keys: roots,
            root_threshold: 2,
        };
        let read = || decode_file(&fs::read(&out).expect("read")).expect("decodes");
        let err = ring.accept(&read()).expect_err("one signature is short");
        assert!(err.to_string().contains("needs 2"), "{err}");
        assert_eq!(cosign(&out, &p("root3.key")).expect("cosigned"), 2);
        let next = ring.accept(&read()).expect("two of three roots signed");
        assert_eq!(
            next.coordinator_keys,
            vec![load_public_key(&p("coord2.pub")).expect("pub")]
        );
        let bad = Rotation {
            signers: Vec::new(),
            ..rotation
        };
        assert!(rotate(&bad, &p("x")).is_err());
    }
}
