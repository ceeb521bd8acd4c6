//! The store on PostgreSQL, for coordinators that share one database and take turns leading
//! (docs/decisions/0044-postgres-store-and-lease.md).
//!
//! - `connect.rs`: [`PgSettings`], TLS (rustls with ring), and the connection thread each
//!   connection lives on.
//! - `migrate.rs`: the schema's versions (`migrations/NNNN_name.sql`), applied on connect under
//!   an advisory lock; a database newer than this binary is refused.
//! - `lease.rs`: [`Lease`], the one lease row that says who leads, renewed on its own thread and
//!   connection.
//! - here: [`PgBackend`], the [`Backend`] on the `records` table. Every write is one transaction
//!   that first checks, under a share lock on the lease row, that the writer still holds the lease
//!   at its epoch ([`Fence::Lease`]), or, for offline tools, that nobody does
//!   ([`Fence::NoLiveLease`]).
//!
//! ```no_run
//! # fn demo() -> Result<(), flotilla_coordinator::service::store::backend::BackendError> {
//! use flotilla_coordinator::service::leadership::LeaseSettings;
//! use flotilla_coordinator::service::store::backend::{Backend, Op};
//! use flotilla_coordinator::service::store::postgres::{Fence, Lease, PgBackend, PgSettings};
//! let settings = PgSettings { url: "postgres://flotilla@db:5432/flotilla".into(), ..PgSettings::default() };
//! let lease = Lease::start(&settings, "coord-a".into(), "flotilla-coordinator-a".into(), LeaseSettings::default())?;
//! let store = PgBackend::connect(&settings, Fence::Lease(lease))?;
//! store.write(vec![Op::put("rollouts", b"r1".to_vec(), b"{}".to_vec())])?;
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;
use tokio_postgres::Client;

use super::backend::{Backend, BackendError, Op};

mod connect;
mod lease;
mod migrate;

pub use connect::PgSettings;
pub use lease::Lease;
pub use migrate::{newest_known as newest_schema_version, MIGRATIONS};

use connect::{wait_until, NoAnswer, Target};

/// The tree answered from memory (see [`PgBackend`]).
const PUBLISHED: &str = "published";

/// What a write must find in the lease row before it may land.
#[derive(Debug, Clone)]
pub enum Fence {
    /// A coordinator's store: its lease must be live at the database, held by it at the epoch it
    /// holds now. Otherwise [`BackendError::Fenced`].
    Lease(Arc<Lease>),
    /// An offline tool's store (`flotilla restore`): nobody may hold a live lease.
    NoLiveLease,
}

/// The lease check that runs inside a write's transaction.
#[derive(Debug, Clone)]
enum Check {
    Holder { me: String, epoch: u64 },
    NoLiveLease,
}

enum Job {
    Connect,
    Get { tree: String, key: Vec<u8> },
    Scan { tree: String },
    IsEmpty,
    Write { ops: Vec<Op>, check: Check },
}

enum Answer {
    Connected(BTreeMap<Vec<u8>, Vec<u8>>),
    Value(Option<Vec<u8>>),
    Entries(Entries),
    Empty(bool),
    Written,
}

/// Puts waiting for the next write, by tree and key.
type Lazy = BTreeMap<(String, Vec<u8>), Vec<u8>>;

/// Keys and values of one tree, in key order.
type Entries = Vec<(Vec<u8>, Vec<u8>)>;

type Reply = std::sync::mpsc::Sender<Result<Answer, BackendError>>;

/// The [`Backend`] on PostgreSQL.
///
/// Tree `published` is answered from memory: the service asks it once per device when it starts
/// (100,000 times on a large fleet), so it is loaded on connect and on [`Backend::reopen`] and kept
/// up to date by this backend's own writes. Every other read queries the database.
pub struct PgBackend {
    describe: String,
    jobs: mpsc::UnboundedSender<(Job, Reply)>,
    published: Mutex<BTreeMap<Vec<u8>, Vec<u8>>>,
    /// Puts not yet committed ([`PgBackend::put_lazily`]): the next write takes them along.
    lazy: Mutex<Lazy>,
    fence: Fence,
}

impl std::fmt::Debug for PgBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgBackend")
            .field("database", &self.describe)
            .field("fence", &self.fence)
            .finish()
    }
}

impl PgBackend {
    /// Connects, brings the schema up to date and loads tree `published`. Fails when the
    /// database cannot be reached, or its schema is newer than this binary knows.
    pub fn connect(settings: &PgSettings, fence: Fence) -> Result<PgBackend, BackendError> {
        let target = Target::new(settings, None)?;
        let describe = target.describe.clone();
        let runtime = connect::runtime(&describe)?;
        let (jobs, mut queue) = mpsc::unbounded_channel::<(Job, Reply)>();
        std::thread::Builder::new()
            .name("flotilla-postgres".to_owned())
            .spawn(move || {
                let mut worker = Worker {
                    target,
                    client: None,
                };
                runtime.block_on(async move {
                    while let Some((job, reply)) = queue.recv().await {
                        let answer = worker.handle(job).await;
                        let _ = reply.send(answer);
                    }
                });
            })
            .map_err(|e| {
                BackendError::failed(&describe, format!("cannot start its thread: {e}"))
            })?;
        let backend = PgBackend {
            describe,
            jobs,
            published: Mutex::new(BTreeMap::new()),
            lazy: Mutex::new(BTreeMap::new()),
            fence,
        };
        backend.load()?;
        Ok(backend)
    }

    /// Reconnects and reloads tree `published`.
    fn load(&self) -> Result<(), BackendError> {
        match self.call(Job::Connect)? {
            Answer::Connected(published) => {
                *self.cache() = published;
                Ok(())
            }
            _ => Err(self.unexpected()),
        }
    }

    fn call(&self, job: Job) -> Result<Answer, BackendError> {
        self.call_until(job, None)
            .map_err(|e| e.unwrap_or_else(|| self.unexpected()))
    }

    /// The job's answer, or `Err(None)` when `until` passed first.
    fn call_until(
        &self,
        job: Job,
        until: Option<std::time::Instant>,
    ) -> Result<Answer, Option<BackendError>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let gone = || BackendError::failed(&self.describe, "its connection thread has stopped");
        self.jobs.send((job, tx)).map_err(|_| Some(gone()))?;
        match wait_until(rx, until) {
            Ok(answer) => answer.map_err(Some),
            Err(NoAnswer::Gone) => Err(Some(gone())),
            Err(NoAnswer::TimedOut) => Err(None),
        }
    }

    /// Stores `value` under `key` without a transaction of its own: reads through this backend
    /// see it at once, and the next [`Backend::write`] commits it, fenced like the rest of that
    /// write. For records whose loss in a crash is harmless (the per-device action sequence, the
    /// published digests), written once per device and so too many for a transaction each.
    pub fn put_lazily(&self, tree: &str, key: &[u8], value: &[u8]) -> Result<(), BackendError> {
        if tree == PUBLISHED {
            self.cache().insert(key.to_vec(), value.to_vec());
        }
        self.pending()
            .insert((tree.to_owned(), key.to_vec()), value.to_vec());
        Ok(())
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Lazy> {
        self.lazy.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, BTreeMap<Vec<u8>, Vec<u8>>> {
        self.published.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn unexpected(&self) -> BackendError {
        BackendError::failed(&self.describe, "its connection thread answered out of turn")
    }
}

impl Backend for PgBackend {
    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn put_lazily(&self, tree: &str, key: &[u8], value: &[u8]) -> Result<(), BackendError> {
        PgBackend::put_lazily(self, tree, key, value)
    }

    fn get(&self, tree: &str, key: &[u8]) -> Result<Option<Vec<u8>>, BackendError> {
        if tree == PUBLISHED {
            return Ok(self.cache().get(key).cloned());
        }
        if let Some(value) = self.pending().get(&(tree.to_owned(), key.to_vec())) {
            return Ok(Some(value.clone()));
        }
        match self.call(Job::Get {
            tree: tree.to_owned(),
            key: key.to_vec(),
        })? {
            Answer::Value(value) => Ok(value),
            _ => Err(self.unexpected()),
        }
    }

    fn scan(&self, tree: &str) -> Result<Entries, BackendError> {
        if tree == PUBLISHED {
            let cache = self.cache();
            return Ok(cache.iter().map(|(k, v)| (k.clone(), v.clone())).collect());
        }
        let entries = match self.call(Job::Scan {
            tree: tree.to_owned(),
        })? {
            Answer::Entries(entries) => entries,
            _ => return Err(self.unexpected()),
        };
        let pending = self.pending();
        if !pending.keys().any(|(t, _)| t == tree) {
            return Ok(entries);
        }
        let mut merged: BTreeMap<Vec<u8>, Vec<u8>> = entries.into_iter().collect();
        for ((_, key), value) in pending.iter().filter(|((t, _), _)| t == tree) {
            merged.insert(key.clone(), value.clone());
        }
        Ok(merged.into_iter().collect())
    }

    fn write(&self, ops: Vec<Op>) -> Result<(), BackendError> {
        let (check, until) = match &self.fence {
            Fence::NoLiveLease => (Check::NoLiveLease, None),
            Fence::Lease(lease) => match lease.leading() {
                Some((epoch, deadline)) => (
                    Check::Holder {
                        me: lease.me().to_owned(),
                        epoch,
                    },
                    Some(deadline),
                ),
                None => {
                    return Err(BackendError::Fenced {
                        epoch: lease.last_epoch(),
                        reason: format!(
                            "{}: the lease is not live here (it ran out before it could be \
                             renewed, or another coordinator took it)",
                            self.describe
                        ),
                    })
                }
            },
        };
        let published: Vec<(Vec<u8>, Option<Vec<u8>>)> = ops
            .iter()
            .filter_map(|op| match op {
                Op::Put { tree, key, value } if tree == PUBLISHED => {
                    Some((key.clone(), Some(value.clone())))
                }
                Op::Remove { tree, key } if tree == PUBLISHED => Some((key.clone(), None)),
                _ => None,
            })
            .collect();
        // Lazy puts go first: the write's own operations come after them, as they were made.
        let lazy = std::mem::take(&mut *self.pending());
        let mut all: Vec<Op> = lazy
            .iter()
            .map(|((tree, key), value)| Op::put(tree, key.clone(), value.clone()))
            .collect();
        all.extend(ops);
        let epoch = match &check {
            Check::Holder { epoch, .. } => *epoch,
            Check::NoLiveLease => 0,
        };
        // A leader waits for its write no longer than it may act: past its deadline the
        // answer no longer matters to it, and it must step down without delay.
        let written = match self.call_until(Job::Write { ops: all, check }, until) {
            Ok(Answer::Written) => Ok(()),
            Ok(_) => Err(self.unexpected()),
            Err(Some(e)) => Err(e),
            Err(None) => Err(BackendError::Fenced {
                epoch,
                reason: format!(
                    "{}: the lease ran out here while this write waited for the database; if \
                     the database applied it, it did so before any other coordinator took over",
                    self.describe
                ),
            }),
        };
        if let Err(e) = written {
            // Not committed: keep them for the next write, unless put again meanwhile.
            let mut pending = self.pending();
            for (id, value) in lazy {
                pending.entry(id).or_insert(value);
            }
            return Err(e);
        }
        let mut cache = self.cache();
        for (key, value) in published {
            match value {
                Some(value) => cache.insert(key, value),
                None => cache.remove(&key),
            };
        }
        Ok(())
    }

    fn is_empty(&self) -> Result<bool, BackendError> {
        if !self.pending().is_empty() {
            return Ok(false);
        }
        match self.call(Job::IsEmpty)? {
            Answer::Empty(empty) => Ok(empty),
            _ => Err(self.unexpected()),
        }
    }

    fn reopen(&mut self) -> Result<(), BackendError> {
        self.load()
    }
}

/// The connection thread's side: one client, connected again when it was lost.
struct Worker {
    target: Target,
    client: Option<Client>,
}

impl Worker {
    async fn handle(&mut self, job: Job) -> Result<Answer, BackendError> {
        if let Job::Connect = job {
            self.client = None;
        }
        let client = match self.client.take() {
            Some(client) if !client.is_closed() => client,
            _ => {
                let target = &self.target;
                target
                    .bounded("connect", async {
                        let mut client = target.connect().await?;
                        migrate::migrate(target, &mut client).await?;
                        Ok(client)
                    })
                    .await?
            }
        };
        let mut client = client;
        let target = &self.target;
        let result = target.bounded("query", run(target, &mut client, job)).await;
        // A timeout, or an error without a database answer, means the connection is gone or
        // stuck: the next call connects again.
        let keep = match &result {
            Ok(_) => true,
            Err(Failure::Database(_)) | Err(Failure::Refused(_)) => !client.is_closed(),
            Err(Failure::Connection(_)) => false,
        };
        if keep {
            self.client = Some(client);
        }
        result.map_err(Failure::into_error)
    }
}

/// Why a job failed, and so whether its connection is still good.
enum Failure {
    /// The database answered with an error.
    Database(BackendError),
    /// The write was refused by the fence (a database answer too).
    Refused(BackendError),
    /// No answer: the connection broke or timed out.
    Connection(BackendError),
}

impl Failure {
    fn into_error(self) -> BackendError {
        match self {
            Failure::Database(e) | Failure::Refused(e) | Failure::Connection(e) => e,
        }
    }
}

impl From<BackendError> for Failure {
    fn from(e: BackendError) -> Failure {
        Failure::Connection(e)
    }
}

fn failure(target: &Target, what: &str, e: tokio_postgres::Error) -> Failure {
    let error = target.error(what, &e);
    if e.as_db_error().is_some() {
        Failure::Database(error)
    } else {
        Failure::Connection(error)
    }
}

/// The job on `client`; its bound (`Target::bounded`) is applied by the caller.
async fn run(target: &Target, client: &mut Client, job: Job) -> Result<Answer, Failure> {
    match job {
        Job::Connect => {
            let rows = client
                .query(
                    "SELECT key, value FROM records WHERE tree = $1",
                    &[&PUBLISHED],
                )
                .await
                .map_err(|e| failure(target, "load the published digests", e))?;
            let entries =
                pairs(rows).map_err(|e| failure(target, "load the published digests", e))?;
            Ok(Answer::Connected(entries.into_iter().collect()))
        }
        Job::Get { tree, key } => {
            let row = client
                .query_opt(
                    "SELECT value FROM records WHERE tree = $1 AND key = $2",
                    &[&tree, &key],
                )
                .await
                .map_err(|e| failure(target, &format!("read from {tree}"), e))?;
            let value = row.map(|r| r.try_get(0)).transpose();
            Ok(Answer::Value(value.map_err(|e| {
                failure(target, &format!("read from {tree}"), e)
            })?))
        }
        Job::Scan { tree } => {
            let rows = client
                .query(
                    "SELECT key, value FROM records WHERE tree = $1 ORDER BY key",
                    &[&tree],
                )
                .await
                .map_err(|e| failure(target, &format!("read {tree}"), e))?;
            let entries = pairs(rows).map_err(|e| failure(target, &format!("read {tree}"), e))?;
            Ok(Answer::Entries(entries))
        }
        Job::IsEmpty => {
            let row = client
                .query_one("SELECT NOT EXISTS (SELECT 1 FROM records)", &[])
                .await
                .map_err(|e| failure(target, "count the records", e))?;
            let empty = row
                .try_get(0)
                .map_err(|e| failure(target, "count the records", e))?;
            Ok(Answer::Empty(empty))
        }
        Job::Write { ops, check } => {
            write(target, client, ops, check).await?;
            Ok(Answer::Written)
        }
    }
}

/// Rows of (key, value).
fn pairs(rows: Vec<tokio_postgres::Row>) -> Result<Entries, tokio_postgres::Error> {
    rows.into_iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .collect()
}

/// `ops` in one transaction, after the lease check, many rows per statement.
async fn write(
    target: &Target,
    client: &mut Client,
    ops: Vec<Op>,
    check: Check,
) -> Result<(), Failure> {
    let tx = client
        .transaction()
        .await
        .map_err(|e| failure(target, "begin a write", e))?;
    // FOR SHARE holds the lease row until this transaction ends: a takeover (an UPDATE of the
    // row) waits for this write to commit, so the write lands before the new epoch starts or is
    // refused here; it can never land after.
    let lease = tx
        .query_one(
            "SELECT holder, epoch, expires_at > now(),
                    greatest(0, ceil(extract(epoch FROM expires_at - now())))::bigint
             FROM lease FOR SHARE",
            &[],
        )
        .await
        .map_err(|e| failure(target, "check the lease", e))?;
    let read = |e| failure(target, "check the lease", e);
    let holder: String = lease.try_get(0).map_err(read)?;
    let epoch = u64::try_from(lease.try_get::<_, i64>(1).map_err(read)?).unwrap_or(0);
    let live: bool = lease.try_get(2).map_err(read)?;
    let left: i64 = lease.try_get(3).map_err(read)?;
    match check {
        Check::Holder { me, epoch: mine } => {
            if !(live && holder == me && epoch == mine) {
                let reason = if holder == me && epoch == mine {
                    format!("{}: the lease at epoch {mine} ran out", target.describe)
                } else if live {
                    format!(
                        "{}: coordinator `{holder}` holds the lease at epoch {epoch}",
                        target.describe
                    )
                } else {
                    format!(
                        "{}: nobody holds the lease (last `{holder}` at epoch {epoch})",
                        target.describe
                    )
                };
                let _ = tx.rollback().await;
                return Err(Failure::Refused(BackendError::Fenced {
                    epoch: mine,
                    reason,
                }));
            }
        }
        Check::NoLiveLease => {
            if live {
                let _ = tx.rollback().await;
                return Err(Failure::Refused(BackendError::failed(
                    &target.describe,
                    format!(
                        "refused: coordinator `{holder}` leads this database (lease epoch \
                         {epoch}, {left} s left); stop it before writing with an offline tool"
                    ),
                )));
            }
        }
    }
    // The last operation on a key decides (ops apply in order, and only the end state of a
    // transaction is ever seen); one statement may not touch a row twice.
    let mut last: HashMap<(String, Vec<u8>), Option<Vec<u8>>> = HashMap::new();
    let mut order: Vec<(String, Vec<u8>)> = Vec::new();
    for op in ops {
        let (tree, key, value) = match op {
            Op::Put { tree, key, value } => (tree, key, Some(value)),
            Op::Remove { tree, key } => (tree, key, None),
        };
        let id = (tree, key);
        if last.insert(id.clone(), value).is_none() {
            order.push(id);
        }
    }
    let (mut put_trees, mut put_keys, mut put_values) = (Vec::new(), Vec::new(), Vec::new());
    let (mut remove_trees, mut remove_keys) = (Vec::new(), Vec::new());
    for id in order {
        let value = last.remove(&id).flatten();
        let (tree, key) = id;
        match value {
            Some(value) => {
                put_trees.push(tree);
                put_keys.push(key);
                put_values.push(value);
            }
            None => {
                remove_trees.push(tree);
                remove_keys.push(key);
            }
        }
    }
    if !put_trees.is_empty() {
        tx.execute(
            "INSERT INTO records (tree, key, value)
             SELECT * FROM unnest($1::text[], $2::bytea[], $3::bytea[])
             ON CONFLICT (tree, key) DO UPDATE SET value = EXCLUDED.value",
            &[&put_trees, &put_keys, &put_values],
        )
        .await
        .map_err(|e| failure(target, &format!("write {} records", put_trees.len()), e))?;
    }
    if !remove_trees.is_empty() {
        tx.execute(
            "DELETE FROM records WHERE (tree, key) IN
             (SELECT * FROM unnest($1::text[], $2::bytea[]))",
            &[&remove_trees, &remove_keys],
        )
        .await
        .map_err(|e| failure(target, &format!("remove {} records", remove_trees.len()), e))?;
    }
    tx.commit().await.map_err(|e| {
        // A commit without an answer may or may not have landed; say so.
        let mut f = failure(target, "commit a write", e);
        if let Failure::Connection(BackendError::Failed { reason, .. }) = &mut f {
            reason.push_str(" (it may or may not have been applied)");
        }
        f
    })?;
    Ok(())
}
