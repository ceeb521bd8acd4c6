//! Which coordinator leads: the one interface the service asks before it acts.
//!
//! A coordinator on sled is alone by construction (sled locks its directory), so it always
//! leads, at epoch 0 ([`Sole`]). Coordinators sharing a PostgreSQL store take turns by a lease
//! row (`store/postgres/lease.rs`, decision 0044): the holder leads until the database's clock
//! passes the lease's expiry; every write it makes is fenced by the lease's epoch, which only
//! grows.
//!
//! [`Leadership::leads`] is what the service checks right before it publishes anything that
//! instructs a device: it is true only while the lease was last renewed recently enough, by
//! this process's monotonic clock, that it cannot have expired at the database yet (renewed at
//! `t`, request sent at `t0 <= t`: the lease runs to at least `t0 + ttl` by the database's
//! clock, and a margin covers clock rate differences). A leader that was stopped, or cut off
//! from the database, finds `leads()` false when it wakes, before the new leader's first
//! desired action could be overwritten.

use std::time::Duration;

use flotilla_protocol::control::CoordinatorsInfo;

/// Lease timing. The defaults trade a failover of about `ttl + renew_every` against how long a
/// database or network hiccup may last before a healthy leader steps down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseSettings {
    /// How long a lease lasts after each renewal, by the database's clock.
    pub ttl: Duration,
    /// How often the leader renews (and a standby tries to take over).
    pub renew_every: Duration,
    /// A leader stops acting this long before its lease could have expired.
    pub margin: Duration,
}

impl Default for LeaseSettings {
    fn default() -> Self {
        LeaseSettings {
            ttl: Duration::from_secs(15),
            renew_every: Duration::from_secs(5),
            margin: Duration::from_secs(3),
        }
    }
}

/// This coordinator's role at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// It holds the lease at `epoch`.
    Leader { epoch: u64 },
    /// It does not; `lease` is what the database said last, if it could be read.
    Standby { lease: Option<LeaseView> },
}

/// The lease row as read from the database, and a coordinator the database knows: the
/// protocol's shapes, which `flotilla status` shows as they are.
pub use flotilla_protocol::control::{CoordinatorMember as Member, LeaseInfo as LeaseView};

/// What `flotilla status` shows about leadership.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeadershipStatus {
    /// This coordinator's id.
    pub me: String,
    /// `None` on a store with no lease (sled).
    pub lease: Option<LeaseView>,
    pub members: Vec<Member>,
    /// Times this coordinator took the lease over from another (or from nobody after expiry).
    pub takeovers: u64,
}

/// What the `coordinators` control command answers (`flotilla status`).
pub fn info(status: LeadershipStatus, store: String) -> CoordinatorsInfo {
    CoordinatorsInfo {
        answered_by: status.me,
        store,
        lease: status.lease,
        members: status.members,
        failovers: status.takeovers,
    }
}

/// The service's view of leadership.
pub trait Leadership: Send + Sync + std::fmt::Debug {
    /// Whether this coordinator may instruct devices and write the store right now.
    fn leads(&self) -> bool;
    /// The epoch of the lease this coordinator holds or last held (0 on sled).
    fn epoch(&self) -> u64;
    /// Changes of role, as they happen; the current role first.
    fn watch(&self) -> tokio::sync::watch::Receiver<Role>;
    /// The lease and the coordinators around it, as last read.
    fn status(&self) -> LeadershipStatus;
}

/// The only coordinator of a store nobody else can open: leads from start to stop.
#[derive(Debug)]
pub struct Sole {
    me: String,
    role: tokio::sync::watch::Sender<Role>,
}

impl Sole {
    pub fn new(me: impl Into<String>) -> Sole {
        Sole {
            me: me.into(),
            role: tokio::sync::watch::Sender::new(Role::Leader { epoch: 0 }),
        }
    }
}

impl Leadership for Sole {
    fn leads(&self) -> bool {
        true
    }

    fn epoch(&self) -> u64 {
        0
    }

    fn watch(&self) -> tokio::sync::watch::Receiver<Role> {
        self.role.subscribe()
    }

    fn status(&self) -> LeadershipStatus {
        LeadershipStatus {
            me: self.me.clone(),
            ..LeadershipStatus::default()
        }
    }
}
