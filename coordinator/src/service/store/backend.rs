//! The interface every store implementation offers: named trees of byte keys and values.
//!
//! The typed store (`store/mod.rs`) keeps rollouts, strategies, device groups, enrollments and
//! the per-device action sequence as JSON or big-endian records in trees; a backend only moves
//! bytes. Two backends implement it: sled in the data directory (`sled_kv.rs`, the default for
//! one box and the demo) and PostgreSQL (`postgres/`, for coordinators that share one database
//! and take turns leading, decision 0044).
//!
//! A backend's contract:
//! - [`Backend::write`] applies its operations atomically and durably: when it returns `Ok`,
//!   every operation survives a crash of the process and of the machine; when it returns an
//!   error, none of them is visible.
//! - A backend shared by several coordinators fences every write by the writer's lease epoch:
//!   a coordinator that no longer leads gets [`BackendError::Fenced`] and nothing is written.
//! - Reads never block on a lease.
//! - Every method may be called from inside a tokio task; a backend that waits on the network
//!   must not stall the runtime's other tasks for longer than its own timeouts.

/// A tree's entries, key and value, in key order.
pub type Entries = Vec<(Vec<u8>, Vec<u8>)>;

/// One change to the store, applied with others in one [`Backend::write`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put {
        tree: String,
        key: Vec<u8>,
        value: Vec<u8>,
    },
    Remove {
        tree: String,
        key: Vec<u8>,
    },
}

impl Op {
    pub fn put(tree: &str, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Op {
        Op::Put {
            tree: tree.to_owned(),
            key: key.into(),
            value: value.into(),
        }
    }

    pub fn remove(tree: &str, key: impl Into<Vec<u8>>) -> Op {
        Op::Remove {
            tree: tree.to_owned(),
            key: key.into(),
        }
    }
}

/// Why a backend call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BackendError {
    /// This coordinator does not hold the lease (any more): another leads, or nobody does. The
    /// write did not happen, and the caller must stop acting as leader.
    #[error("this coordinator no longer leads (its lease epoch was {epoch}): {reason}")]
    Fenced { epoch: u64, reason: String },
    /// Anything else: the disk, the database, the connection. `what` names the store.
    #[error("{what}: {reason}")]
    Failed { what: String, reason: String },
}

impl BackendError {
    pub fn failed(what: impl Into<String>, reason: impl std::fmt::Display) -> BackendError {
        BackendError::Failed {
            what: what.into(),
            reason: reason.to_string(),
        }
    }

    pub fn is_fenced(&self) -> bool {
        matches!(self, BackendError::Fenced { .. })
    }
}

/// Named trees of byte keys and values, written atomically and durably.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Where the data lives, for messages and logs: a directory, or the database's address
    /// (never its password).
    fn describe(&self) -> String;

    /// The value under `key` in `tree`, if there is one.
    fn get(&self, tree: &str, key: &[u8]) -> Result<Option<Vec<u8>>, BackendError>;

    /// Every entry of `tree`, in key order.
    fn scan(&self, tree: &str) -> Result<Entries, BackendError>;

    /// Applies `ops` in order, atomically and durably (see the module's contract). An empty
    /// list still commits: it makes earlier writes durable and, where there is a lease, checks
    /// it.
    fn write(&self, ops: Vec<Op>) -> Result<(), BackendError>;

    /// Stores `value` under `key` without making it durable yet: the next [`Backend::write`]
    /// commits it with its own operations, and reads see it at once. Only for records whose
    /// loss in a crash is harmless or repaired: the per-device action sequence (read back from
    /// the broker's retained actions) and the digests of published actions (a cache).
    fn put_lazily(&self, tree: &str, key: &[u8], value: &[u8]) -> Result<(), BackendError> {
        self.write(vec![Op::put(tree, key, value)])
    }

    /// Whether no tree holds anything.
    fn is_empty(&self) -> Result<bool, BackendError>;

    /// Back to a usable state after a failure: sled opens its files again (it refuses every
    /// write of an instance after one failed); a database backend connects again. Also called
    /// when a standby coordinator takes over, so caches reflect what the last leader wrote.
    fn reopen(&mut self) -> Result<(), BackendError>;
}
