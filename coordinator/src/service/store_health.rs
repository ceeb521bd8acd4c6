//! Whether the coordinator's store can be written, and what it does while it cannot.
//!
//! A write that fails (a full disk, a quota, a read-only mount) is an error with a reason, never
//! a reason to stop: the service keeps running and
//! - publishes no desired action, rollback, cancel or forget, because none of them may go out
//!   ahead of the stored rollout that justifies it (ADR 0003); they are counted as held back;
//! - refuses every control command that would change something, naming the store and the
//!   reason; commands a viewer may run still answer from memory;
//! - every [`RETRY_INTERVAL`] checks for room (a probe file) and, once there is, reopens the
//!   store (sled refuses all writes of an instance after one failed), writes every rollout and
//!   enrollment again and reissues what each device is owed.
//!
//! Status and trace events still go out: they describe, they do not instruct.
//!
//! A coordinator must also start on a disk that is already full, or an operator cannot even see
//! what it holds: sled cannot open its files without writing. So the data directory keeps a
//! reserve file ([`RESERVE_BYTES`] of zeros, `store.reserve`), made whenever there is room; a
//! start that finds no room for the store releases it and opens the store in the space it gave
//! back.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

/// How often a failing store is tried again.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(5);

/// The size of the reserve file kept for starting on a full disk.
pub const RESERVE_BYTES: usize = 4 * 1024 * 1024;
const RESERVE: &str = "store.reserve";

/// Free space a recovery attempt asks for first: more than sled needs to start a new segment.
const PROBE_BYTES: usize = 2 * 1024 * 1024;

/// The store's health as the service sees it.
#[derive(Debug, Default)]
pub struct StoreHealth {
    failing: Option<Failing>,
    last_attempt: Option<Instant>,
    /// Device actions not published because the store could not be written, in total.
    pub held_back: u64,
    /// Write failures, in total.
    pub failures: u64,
}

#[derive(Debug)]
struct Failing {
    since: u64,
    reason: String,
}

impl StoreHealth {
    pub fn is_failing(&self) -> bool {
        self.failing.is_some()
    }

    /// Records a failed write. Returns true when the store was healthy until now (the caller
    /// logs that once, not every failure).
    pub fn fail(&mut self, reason: String, now: u64) -> bool {
        self.failures += 1;
        match &mut self.failing {
            Some(failing) => {
                failing.reason = reason;
                false
            }
            None => {
                self.failing = Some(Failing { since: now, reason });
                self.last_attempt = Some(Instant::now());
                true
            }
        }
    }

    /// The answer to a command that would write while the store is failing.
    pub fn refusal(&self, store: &str) -> Option<String> {
        self.failing.as_ref().map(|f| {
            format!(
                "the coordinator cannot write its store at {} since {} ({}); it refuses changes \
                 until it can and retries every {} s; commands that only read still work",
                store,
                flotilla_rollout::window::utc_text(f.since),
                f.reason,
                RETRY_INTERVAL.as_secs()
            )
        })
    }

    /// Why the store is failing, if it is.
    pub fn reason(&self) -> Option<&str> {
        self.failing.as_ref().map(|f| f.reason.as_str())
    }

    /// Whether a recovery attempt is due now (failing, and the last one long enough ago).
    pub fn attempt_due(&mut self, at: Instant) -> bool {
        if self.failing.is_none() {
            return false;
        }
        if self
            .last_attempt
            .is_some_and(|last| at.duration_since(last) < RETRY_INTERVAL)
        {
            return false;
        }
        self.last_attempt = Some(at);
        true
    }

    /// The store works again; returns since when it had failed.
    pub fn recovered(&mut self) -> Option<u64> {
        self.failing.take().map(|f| f.since)
    }
}

/// Whether `dir` has room for the store to write again: writes and syncs a probe file of
/// 2 MiB, then removes it.
pub fn has_room(dir: &Path) -> std::io::Result<()> {
    let probe = dir.join(".store-space-probe");
    let result = (|| {
        let mut file = std::fs::File::create(&probe)?;
        file.write_all(&vec![0u8; PROBE_BYTES])?;
        file.sync_all()
    })();
    let _ = std::fs::remove_file(&probe);
    result
}

/// Whether an I/O error means the disk (or a quota) is full.
pub fn is_no_space(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
    ) || matches!(error.raw_os_error(), Some(28 | 122))
}

/// Makes the reserve file if it is missing; a disk without room for it is logged, not an
/// error (the reserve is made at the next chance).
pub fn ensure_reserve(dir: &Path) {
    let path = dir.join(RESERVE);
    if std::fs::metadata(&path).is_ok_and(|m| m.len() == RESERVE_BYTES as u64) {
        return;
    }
    let made = (|| {
        let mut file = std::fs::File::create(&path)?;
        file.write_all(&vec![0u8; RESERVE_BYTES])?;
        file.sync_all()
    })();
    if let Err(e) = made {
        let _ = std::fs::remove_file(&path);
        tracing::warn!(path = %path.display(), error = %e,
            "cannot make the reserve that lets the coordinator start on a full disk; trying again later");
    }
}

/// Releases the reserve; whether there was one.
pub fn release_reserve(dir: &Path) -> bool {
    std::fs::remove_file(dir.join(RESERVE)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_store_is_retried_at_intervals_and_named_in_refusals() {
        let mut health = StoreHealth::default();
        let start = Instant::now();
        assert!(!health.attempt_due(start), "nothing to retry");
        assert!(health.refusal("/data/db").is_none());
        assert!(health.fail("No space left on device".into(), 1_790_000_000));
        assert!(
            !health.fail("still full".into(), 1_790_000_001),
            "logged once"
        );
        let refusal = health.refusal("/data/db").expect("refused");
        assert!(
            refusal.contains("/data/db") && refusal.contains("still full"),
            "{refusal}"
        );
        assert!(!health.attempt_due(start), "not right after the failure");
        assert!(health.attempt_due(start + 2 * RETRY_INTERVAL));
        assert!(!health.attempt_due(start + 2 * RETRY_INTERVAL));
        assert_eq!(health.recovered(), Some(1_790_000_000));
        assert!(!health.is_failing());
        assert_eq!(health.failures, 2);
    }

    #[test]
    fn a_full_device_has_no_room() {
        // /dev is a directory without room for files in a test; /dev/full is not a directory.
        // A missing directory stands in for "no room" portably.
        let err = has_room(Path::new("/nonexistent-flotilla-dir")).expect_err("no room");
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
        let dir = tempfile::tempdir().expect("temp dir");
        has_room(dir.path()).expect("room");
        assert_eq!(
            std::fs::read_dir(dir.path()).expect("reads").count(),
            0,
            "probe removed"
        );
    }
}
