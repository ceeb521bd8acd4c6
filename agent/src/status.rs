//! The local status view: what `flotilla-agent status` prints, and the status file that makes it
//! work while the agent runs.
//!
//! A running agent holds the sled lock, so no second process can open the database. The agent
//! therefore also writes the same text to `<data_dir>/status` (atomically) whenever it reports a
//! new phase. `status` reads the database when it can and the status file when the database is
//! locked; `consent` uses the same view to find the action that waits for consent.
//!
//! ```text
//! installed: app-2 2.0 (counter 2)
//! action: r1@5:dev-1 (rollout r1)
//! phase: waiting
//! reason: waiting for local consent (flotilla-agent consent r1@5:dev-1)
//! unacknowledged reports: 0
//! trusted time: 1700000000
//! ```

use std::path::{Path, PathBuf};

use crate::config::Config;
use crate::store::{Store, StoreError};
use crate::trust_state::TrustState;

/// Why `flotilla-agent status` could not show the status.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot read status file {path} (the agent writes it when it reports): {source}")]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Path of the status file.
pub fn status_file(data_dir: &Path) -> PathBuf {
    data_dir.join("status")
}

/// The status text for a store and trust state.
pub fn status_text(store: &Store, trust: &TrustState) -> Result<String, StoreError> {
    let mut out = String::new();
    match store.installed()? {
        Some(i) => out.push_str(&format!(
            "installed: {} {} (counter {})\n",
            i.name, i.version, i.counter
        )),
        None => out.push_str("installed: nothing recorded\n"),
    }
    match store.current()? {
        Some(r) => {
            let phase = r.phase();
            out.push_str(&format!(
                "action: {} (rollout {})\nphase: {}\n",
                r.action_id,
                r.rollout_id,
                phase.name()
            ));
            if let Some(reason) = phase.reason() {
                out.push_str(&format!("reason: {reason}\n"));
            }
        }
        None => out.push_str("action: none\n"),
    }
    if let Some(e) = store.last_error()? {
        out.push_str(&format!("last error: {e}\n"));
    }
    out.push_str(&format!(
        "unacknowledged reports: {}\n",
        store.outbox().len()
    ));
    out.push_str(&format!("trusted time: {}\n", trust.last_trusted_time));
    Ok(out)
}

/// Writes the status file. Best effort: it is a convenience for people on the device, and a
/// failure to write it must never stop an update.
pub fn write_status_file(data_dir: &Path, store: &Store, trust: &TrustState) {
    let text = match status_text(store, trust) {
        Ok(text) => text,
        Err(e) => {
            tracing::warn!("cannot build the status file: {e}");
            return;
        }
    };
    let path = status_file(data_dir);
    if let Err(e) = flotilla_targets::fs::atomic_write(&path, text) {
        tracing::warn!("cannot write status file {}: {e}", path.display());
    }
}

/// What `flotilla-agent status` prints: from the database if the agent is not running, else from
/// the status file the running agent keeps.
pub fn status(config: &Config) -> Result<String, StatusError> {
    if !crate::store::db_path(&config.data_dir).exists() {
        return Ok(format!(
            "no database in {}: the agent has not run yet\n",
            config.data_dir.display()
        ));
    }
    match crate::store::open_data_dir(config) {
        Ok((store, trust, _)) => Ok(status_text(&store, &trust)?),
        Err(StoreError::Locked { .. }) => {
            let path = status_file(&config.data_dir);
            let text = std::fs::read_to_string(&path).map_err(|source| StatusError::ReadFile {
                path: path.clone(),
                source,
            })?;
            Ok(format!(
                "(the agent is running; as of its last report, from {})\n{text}",
                path.display()
            ))
        }
        Err(e) => Err(e.into()),
    }
}

/// The action a status text says is waiting for local consent.
pub fn waiting_for_consent(status: &str) -> Option<String> {
    let mut action = None;
    let mut waiting = false;
    let mut consent = false;
    for line in status.lines() {
        if let Some(rest) = line.strip_prefix("action: ") {
            action = rest.split(" (rollout ").next().map(str::to_owned);
        } else if line == "phase: waiting" {
            waiting = true;
        } else if line.starts_with("reason: waiting for local consent") {
            consent = true;
        }
    }
    action.filter(|_| waiting && consent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_action_waiting_for_consent() {
        let text = "installed: nothing recorded\naction: r1@5:dev-1 (rollout r1)\nphase: waiting\n\
                    reason: waiting for local consent (flotilla-agent consent r1@5:dev-1)\n";
        assert_eq!(waiting_for_consent(text), Some("r1@5:dev-1".into()));
        let window = "action: a1 (rollout r1)\nphase: waiting\nreason: outside the time window: opens at 100\n";
        assert_eq!(
            waiting_for_consent(window),
            None,
            "a time window is not consent"
        );
        assert_eq!(
            waiting_for_consent("action: a1 (rollout r1)\nphase: downloading\n"),
            None
        );
        assert_eq!(waiting_for_consent("action: none\n"), None);
    }
}
