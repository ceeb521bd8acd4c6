//! Local consent for soft and time-forced actions.
//!
//! The running agent holds the sled lock, so a person on the device cannot write consent into
//! the database. Consent is a file instead: `flotilla-agent consent [ACTION_ID]` writes
//! `<data_dir>/consent/<action id>` atomically, and the agent, while an action waits for consent,
//! looks for that file once a second (and again after a restart). The file holds the time it was
//! given, for whoever looks later. It is removed when the action is over.
//!
//! An action id that is not safe as a file name (letters, digits, `.`, `_`, `-`, `@`, `:`, not
//! starting with `.`) gets the file `x-<hex of the id>` instead, so no id can point outside the
//! consent directory.

use std::path::{Path, PathBuf};

use flotilla_protocol::{hex, UnixTime};

use crate::config::Config;
use crate::status::StatusError;

/// Why `flotilla-agent consent` could not give consent.
#[derive(Debug, thiserror::Error)]
pub enum ConsentError {
    #[error(transparent)]
    Status(#[from] StatusError),
    #[error("no action is waiting for local consent; give the action id explicitly")]
    NothingWaiting,
    #[error("cannot write consent file {path}: {source}")]
    WriteFile {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The directory consent files live in.
pub fn consent_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("consent")
}

/// The consent file for one action.
pub fn consent_file(data_dir: &Path, action_id: &str) -> PathBuf {
    let safe = !action_id.is_empty()
        && action_id.len() <= 160
        && !action_id.starts_with('.')
        && action_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'@' | b':'));
    let name = if safe {
        action_id.to_owned()
    } else {
        format!("x-{}", hex::encode(action_id.as_bytes()))
    };
    consent_dir(data_dir).join(name)
}

/// Gives consent to `action_id`: writes its consent file atomically and returns its path.
pub fn give(data_dir: &Path, action_id: &str, now: UnixTime) -> std::io::Result<PathBuf> {
    let dir = consent_dir(data_dir);
    std::fs::create_dir_all(&dir)?;
    let path = consent_file(data_dir, action_id);
    flotilla_targets::fs::atomic_write(&path, format!("given_at = {now}\n"))?;
    Ok(path)
}

/// Whether consent to `action_id` was given.
pub fn given(data_dir: &Path, action_id: &str) -> bool {
    consent_file(data_dir, action_id).is_file()
}

/// Forgets the consent to a finished action. Best effort: a leftover file is harmless, since
/// action ids are never reused.
pub fn clear(data_dir: &Path, action_id: &str) {
    let path = consent_file(data_dir, action_id);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!("cannot remove consent file {}: {e}", path.display()),
    }
}

/// What `flotilla-agent consent [ACTION_ID]` does: gives consent to `action_id`, or to the action
/// the status view says is waiting for consent. Returns the action id and the file written.
pub fn consent(
    config: &Config,
    action_id: Option<&str>,
) -> Result<(String, PathBuf), ConsentError> {
    let action_id = match action_id {
        Some(id) => id.to_owned(),
        None => {
            let view = crate::status::status(config)?;
            crate::status::waiting_for_consent(&view).ok_or(ConsentError::NothingWaiting)?
        }
    };
    let now = crate::trust_state::system_now();
    let path =
        give(&config.data_dir, &action_id, now).map_err(|source| ConsentError::WriteFile {
            path: consent_file(&config.data_dir, &action_id),
            source,
        })?;
    Ok((action_id, path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consent_is_given_and_cleared() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(!given(dir.path(), "r1@5:dev-1"));
        let path = give(dir.path(), "r1@5:dev-1", 42).expect("give");
        assert_eq!(path, dir.path().join("consent").join("r1@5:dev-1"));
        assert!(given(dir.path(), "r1@5:dev-1"));
        assert!(!given(dir.path(), "r1@6:dev-1"), "consent is per action");
        clear(dir.path(), "r1@5:dev-1");
        assert!(!given(dir.path(), "r1@5:dev-1"));
    }

    #[test]
    fn unsafe_action_ids_stay_inside_the_consent_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        for id in ["../../etc/passwd", ".hidden", "", "a/b"] {
            let path = consent_file(dir.path(), id);
            assert_eq!(
                path.parent(),
                Some(consent_dir(dir.path()).as_path()),
                "{id}"
            );
            assert!(path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("x-")));
        }
    }
}
