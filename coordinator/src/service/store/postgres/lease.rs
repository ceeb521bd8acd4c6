//! The lease: one row that says which coordinator leads, with an epoch that only grows.
//!
//! A [`Lease`] runs on a thread of its own with its own connection, so a busy store cannot
//! delay a renewal. Each `renew_every`:
//!
//! ```text
//!   standby --(UPDATE .. WHERE expires_at <= now() RETURNING epoch)--> leader at epoch+1
//!   leader  --(UPDATE .. WHERE holder = me AND epoch = e AND expires_at > now())--> leader
//!   leader  --(0 rows, or no answer until the local deadline)--> standby (never e again)
//! ```
//!
//! Every time is the database's `now()`. Locally the leader keeps a deadline by its monotonic
//! clock: `t0 + ttl - margin`, where `t0` is taken before the renewal is sent, so the lease
//! cannot have run out at the database before the deadline passes here. [`Leadership::leads`]
//! compares with that deadline itself, so it turns false on time even while this thread waits
//! on a dead connection.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::{watch, Notify};
use tokio_postgres::Client;

use super::connect::{self, PgSettings, Target};
use super::migrate;
use crate::service::leadership::{
    Leadership, LeadershipStatus, LeaseSettings, LeaseView, Member, Role,
};
use crate::service::store::backend::BackendError;

/// Members seen within this many TTLs are listed in [`LeadershipStatus::members`].
const MEMBER_TTLS: u32 = 3;

/// Leadership by the lease row of a shared PostgreSQL store.
pub struct Lease {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("me", &self.shared.me)
            .field("database", &self.shared.target.describe)
            .field("leads", &self.leads())
            .finish()
    }
}

struct Shared {
    me: String,
    client_id: String,
    timing: LeaseSettings,
    target: Target,
    state: Mutex<State>,
    role: watch::Sender<Role>,
    stop: AtomicBool,
    step_down: AtomicBool,
    wake: Notify,
}

#[derive(Default)]
struct State {
    /// The lease this coordinator holds, and until when (locally) it may act on it.
    held: Option<Held>,
    /// The epoch it holds or last held.
    last_epoch: u64,
    view: Option<LeaseView>,
    members: Vec<Member>,
    takeovers: u64,
}

#[derive(Clone, Copy)]
struct Held {
    epoch: u64,
    deadline: Instant,
}

impl Lease {
    /// Connects (migrating the schema if needed), makes a first attempt to take the lease, and
    /// keeps renewing or trying on a thread of its own until [`Lease::step_down`] or drop.
    /// Fails when the settings are unusable or the database cannot be reached at all.
    pub fn start(
        settings: &PgSettings,
        me: String,
        client_id: String,
        timing: LeaseSettings,
    ) -> Result<Arc<Lease>, BackendError> {
        if timing.margin >= timing.ttl || timing.renew_every >= timing.ttl {
            return Err(BackendError::failed(
                "lease settings",
                format!(
                    "renew_every ({:?}) and margin ({:?}) must both be shorter than ttl ({:?})",
                    timing.renew_every, timing.margin, timing.ttl
                ),
            ));
        }
        let target = Target::new(settings, Some(timing.renew_every))?;
        let runtime = connect::runtime(&target.describe)?;
        let shared = Arc::new(Shared {
            me,
            client_id,
            timing,
            target,
            state: Mutex::new(State::default()),
            role: watch::Sender::new(Role::Standby { lease: None }),
            stop: AtomicBool::new(false),
            step_down: AtomicBool::new(false),
            wake: Notify::new(),
        });
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("flotilla-lease".to_owned())
            .spawn(move || runtime.block_on(run(thread_shared, ready_tx)))
            .map_err(|e| {
                BackendError::failed(
                    &shared.target.describe,
                    format!("cannot start the lease thread: {e}"),
                )
            })?;
        match connect::wait(ready_rx) {
            Some(Ok(())) => Ok(Arc::new(Lease {
                shared,
                thread: Mutex::new(Some(thread)),
            })),
            Some(Err(e)) => Err(e),
            None => Err(BackendError::failed(
                &shared.target.describe,
                "the lease thread stopped before it connected",
            )),
        }
    }

    /// This coordinator's id.
    pub fn me(&self) -> &str {
        &self.shared.me
    }

    /// The epoch this coordinator may write at now, if it leads.
    pub fn leading_epoch(&self) -> Option<u64> {
        let state = self.shared.state();
        state
            .held
            .filter(|h| Instant::now() < h.deadline)
            .map(|h| h.epoch)
    }

    /// The epoch this coordinator may write at now, and until when (by its monotonic clock).
    pub(crate) fn leading(&self) -> Option<(u64, Instant)> {
        let state = self.shared.state();
        state
            .held
            .filter(|h| Instant::now() < h.deadline)
            .map(|h| (h.epoch, h.deadline))
    }

    /// The epoch it holds or last held (0 before it ever led).
    pub fn last_epoch(&self) -> u64 {
        self.shared.state().last_epoch
    }

    /// On a clean shutdown: stops acting at once, expires the lease at the database if it is
    /// still ours (so a standby takes over at its next try instead of after the TTL), and stops
    /// the lease's thread.
    pub fn step_down(&self) {
        self.shared.step_down.store(true, Ordering::SeqCst);
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.lose(None);
        self.shared.wake.notify_one();
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(thread) = thread {
            let on_multi_thread = tokio::runtime::Handle::try_current()
                .map(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
                .unwrap_or(false);
            let join = move || {
                let _ = thread.join();
            };
            if on_multi_thread {
                tokio::task::block_in_place(join);
            } else {
                join();
            }
        }
    }
}

impl Drop for Lease {
    /// Stops the thread without touching the lease: it runs out on its own, as after a crash.
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.lose(None);
        self.shared.wake.notify_one();
    }
}

impl Leadership for Lease {
    fn leads(&self) -> bool {
        self.leading_epoch().is_some()
    }

    fn epoch(&self) -> u64 {
        self.last_epoch()
    }

    fn watch(&self) -> watch::Receiver<Role> {
        self.shared.role.subscribe()
    }

    fn status(&self) -> LeadershipStatus {
        let state = self.shared.state();
        LeadershipStatus {
            me: self.shared.me.clone(),
            lease: state.view.clone(),
            members: state.members.clone(),
            takeovers: state.takeovers,
        }
    }
}

impl Shared {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Leader at `epoch` until `deadline`.
    fn gain(&self, epoch: u64, deadline: Instant) {
        {
            let mut state = self.state();
            state.held = Some(Held { epoch, deadline });
            state.last_epoch = epoch;
            state.takeovers += 1;
        }
        tracing::info!(
            "{}: {} leads at lease epoch {epoch}",
            self.target.describe,
            self.me
        );
        self.role.send_if_modified(|role| {
            let changed = *role != Role::Leader { epoch };
            *role = Role::Leader { epoch };
            changed
        });
    }

    /// No longer leader (deposed, lapsed, stopping); `why` is logged when it led until now.
    fn lose(&self, why: Option<&str>) {
        let (was, view) = {
            let mut state = self.state();
            (state.held.take(), state.view.clone())
        };
        if let (Some(held), Some(why)) = (was, why) {
            tracing::warn!(
                "{}: {} stops leading at lease epoch {}: {why}",
                self.target.describe,
                self.me,
                held.epoch
            );
        }
        self.role.send_if_modified(|role| match role {
            Role::Leader { .. } => {
                *role = Role::Standby { lease: view };
                true
            }
            Role::Standby { .. } => false,
        });
    }

    /// Drops the lead once the local deadline has passed; it never comes back at that epoch.
    fn lapse_if_due(&self) {
        let due = self
            .state()
            .held
            .is_some_and(|h| Instant::now() >= h.deadline);
        if due {
            self.lose(Some("its lease could not be renewed before its deadline"));
        }
    }

    /// When a standby tries next: just after the live lease it last read runs out (by the
    /// database's clock, read in whole seconds, so a quarter second after the second it
    /// names), rather than up to `renew_every` later. A leader, or a standby that saw no
    /// live lease, keeps the usual period.
    fn expiry_try(&self) -> Instant {
        let state = self.state();
        let far = Instant::now() + self.timing.renew_every;
        match (&state.held, &state.view) {
            (None, Some(view)) if view.is_live() => {
                let left = Duration::from_secs(view.expires_at - view.read_at);
                far.min(Instant::now() + left + Duration::from_millis(250))
            }
            _ => far,
        }
    }

    fn deadline_from(&self, t0: Instant) -> Instant {
        t0 + self.timing.ttl - self.timing.margin
    }
}

/// The lease thread: connect, then renew or try to take over every `renew_every`.
async fn run(shared: Arc<Shared>, ready: std::sync::mpsc::Sender<Result<(), BackendError>>) {
    let mut client: Option<Client> = match connect(&shared).await {
        Ok(c) => Some(c),
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    tick(&shared, &mut client).await;
    let _ = ready.send(Ok(()));
    let mut next = Instant::now() + shared.timing.renew_every;
    while !shared.stopping() {
        // Wake at the deadline too, so the role watch changes when `leads()` does.
        let wake_at = match shared.state().held {
            Some(h) if h.deadline < next => h.deadline,
            _ => next,
        };
        tokio::select! {
            _ = tokio::time::sleep_until(wake_at.into()) => {}
            _ = shared.wake.notified() => {}
        }
        if shared.stopping() {
            break;
        }
        shared.lapse_if_due();
        if Instant::now() < next {
            continue;
        }
        next = Instant::now() + shared.timing.renew_every;
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            match connect(&shared).await {
                Ok(c) => client = Some(c),
                Err(e) => {
                    tracing::warn!("{}: lease: {e}", shared.me);
                    client = None;
                    shared.lapse_if_due();
                    continue;
                }
            }
        }
        tick(&shared, &mut client).await;
        next = next.min(shared.expiry_try());
    }
    if shared.step_down.load(Ordering::SeqCst) {
        let epoch = shared.state().last_epoch;
        if epoch > 0 {
            if let Some(c) = client.as_ref().filter(|c| !c.is_closed()) {
                let result = shared
                    .target
                    .bounded("step down", async {
                        c.execute(
                            "UPDATE lease SET expires_at = now()
                             WHERE holder = $1 AND epoch = $2 AND expires_at > now()",
                            &[&shared.me, &(epoch as i64)],
                        )
                        .await
                        .map_err(|e| shared.target.error("expire the lease", &e))
                    })
                    .await;
                match result {
                    Ok(1) => tracing::info!(
                        "{}: {} stepped down from lease epoch {epoch}",
                        shared.target.describe,
                        shared.me
                    ),
                    Ok(_) => {}
                    Err(e) => tracing::warn!("{}: {e}", shared.me),
                }
            }
        }
    }
}

async fn connect(shared: &Shared) -> Result<Client, BackendError> {
    let target = &shared.target;
    target
        .bounded("connect", async {
            let mut client = target.connect().await?;
            migrate::migrate(target, &mut client).await?;
            Ok(client)
        })
        .await
}

/// One renewal or takeover attempt, then the status reads. Drops the client when it did not
/// answer.
async fn tick(shared: &Shared, client: &mut Option<Client>) {
    let Some(c) = client.as_ref() else {
        return;
    };
    let ttl_secs = shared.timing.ttl.as_secs_f64();
    let held = shared.state().held;
    let t0 = Instant::now();
    let attempt = match held {
        Some(h) => {
            let renewed = shared
                .target
                .bounded("renew the lease", async {
                    c.execute(
                        "UPDATE lease SET renewed_at = now(),
                                          expires_at = now() + make_interval(secs => $3)
                         WHERE holder = $1 AND epoch = $2 AND expires_at > now()",
                        &[&shared.me, &(h.epoch as i64), &ttl_secs],
                    )
                    .await
                    .map_err(|e| shared.target.error("renew the lease", &e))
                })
                .await;
            match renewed {
                Ok(1) => {
                    let mut state = shared.state();
                    match state.held.as_mut() {
                        // Still within the deadline it had: extend it.
                        Some(now) if now.epoch == h.epoch && Instant::now() < now.deadline => {
                            now.deadline = shared.deadline_from(t0);
                            drop(state);
                        }
                        _ => {
                            drop(state);
                            shared.lose(Some("its deadline passed while it renewed"));
                        }
                    }
                    Ok(())
                }
                Ok(_) => {
                    shared.lose(Some(
                        "the database says another coordinator holds the lease",
                    ));
                    Ok(())
                }
                Err(e) => Err(e),
            }
        }
        None => {
            let taken = shared
                .target
                .bounded("take the lease", async {
                    c.query_opt(
                        "UPDATE lease SET holder = $1, epoch = epoch + 1, acquired_at = now(),
                                          renewed_at = now(),
                                          expires_at = now() + make_interval(secs => $2)
                         WHERE expires_at <= now() RETURNING epoch",
                        &[&shared.me, &ttl_secs],
                    )
                    .await
                    .map_err(|e| shared.target.error("take the lease", &e))
                })
                .await;
            match taken {
                Ok(Some(row)) => match row.try_get::<_, i64>(0) {
                    Ok(epoch) => {
                        shared.gain(u64::try_from(epoch).unwrap_or(0), shared.deadline_from(t0));
                        Ok(())
                    }
                    Err(e) => Err(shared.target.error("read the lease's new epoch", &e)),
                },
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            }
        }
    };
    if let Err(e) = attempt {
        tracing::warn!("{}: lease: {e}", shared.me);
        // Connect again next time: a statement that failed may have left the connection
        // broken or stuck, and a fresh one costs little once per period.
        *client = None;
        shared.lapse_if_due();
        return;
    }
    let seen = shared
        .target
        .bounded("read the lease", read_status(shared, c))
        .await;
    match seen {
        Ok((view, members)) => {
            let mut state = shared.state();
            state.view = Some(view);
            state.members = members;
        }
        Err(e) => {
            tracing::warn!("{}: lease: {e}", shared.me);
            if c.is_closed() {
                *client = None;
            }
        }
    }
    shared.lapse_if_due();
}

/// Registers this coordinator and reads the lease row and the members.
async fn read_status(
    shared: &Shared,
    c: &Client,
) -> Result<(LeaseView, Vec<Member>), BackendError> {
    let target = &shared.target;
    c.execute(
        "INSERT INTO coordinators (id, client_id, last_seen) VALUES ($1, $2, now())
         ON CONFLICT (id) DO UPDATE SET client_id = EXCLUDED.client_id, last_seen = now()",
        &[&shared.me, &shared.client_id],
    )
    .await
    .map_err(|e| target.error("register this coordinator", &e))?;
    let row = c
        .query_one(
            "SELECT holder, epoch,
                    floor(extract(epoch FROM acquired_at))::bigint,
                    floor(extract(epoch FROM renewed_at))::bigint,
                    floor(extract(epoch FROM expires_at))::bigint,
                    floor(extract(epoch FROM now()))::bigint
             FROM lease",
            &[],
        )
        .await
        .map_err(|e| target.error("read the lease", &e))?;
    let read = |e: tokio_postgres::Error| target.error("read the lease", &e);
    let secs = |i: usize| -> Result<u64, BackendError> {
        Ok(u64::try_from(row.try_get::<_, i64>(i).map_err(read)?).unwrap_or(0))
    };
    let view = LeaseView {
        holder: row.try_get(0).map_err(read)?,
        epoch: secs(1)?,
        acquired_at: secs(2)?,
        renewed_at: secs(3)?,
        expires_at: secs(4)?,
        read_at: secs(5)?,
    };
    let window = (shared.timing.ttl * MEMBER_TTLS).as_secs_f64();
    let rows = c
        .query(
            "SELECT id, client_id, floor(extract(epoch FROM last_seen))::bigint
             FROM coordinators WHERE last_seen > now() - make_interval(secs => $1)
             ORDER BY id",
            &[&window],
        )
        .await
        .map_err(|e| target.error("read the coordinators", &e))?;
    let members = rows
        .into_iter()
        .map(|r| {
            Ok(Member {
                id: r.try_get(0)?,
                client_id: r.try_get(1)?,
                last_seen: u64::try_from(r.try_get::<_, i64>(2)?).unwrap_or(0),
            })
        })
        .collect::<Result<Vec<_>, tokio_postgres::Error>>()
        .map_err(|e| target.error("read the coordinators", &e))?;
    Ok((view, members))
}
