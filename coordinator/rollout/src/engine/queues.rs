//! Per-site waiting queues: which device of a group to look at next when site budgets hold
//! some sites back, in O(log n) per device instead of a scan over the group's device list.
//!
//! A group's devices start in list order, passing over those whose site is full
//! ([`super::sites`]). The queues give the same order without the scan: every site of the group
//! has a queue of its not-started devices (their positions in the list, in order; devices
//! without a site have one of their own), and the heads of the queues of sites not known to be
//! full are kept sorted by position, so the next device to consider is the first of them.
//!
//! A site found full stays *blocked* until something that decides its gate changes: its counts
//! in any group (a device starting, ending, joining or leaving), its holders or its seed, or the
//! end of a seed wait. Those changes are noted by the groups ([`super::model::GroupCache`]'s
//! `touched`) and read at the start of the next fill, which puts the site back among the open
//! ones; nothing else can change a gate's answer, so a blocked site's answer is the one a fresh
//! look would give.
//!
//! The queues are derived from the slots: built at a group's first fill (after a restart too),
//! kept up to date as devices start or join, dropped when devices leave the list (positions
//! move) and rebuilt then. They are never stored.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

/// The queue of devices without a site.
const NO_SITE: u32 = 0;

/// Why a site holds a device back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SiteWhy {
    Busy { busy: usize, limit: usize },
    Unavailable { unavailable: usize, limit: usize },
    Seed { seed: String, until: u64 },
}

/// A group's per-site waiting queues. See the module documentation.
#[derive(Debug, Clone, Default)]
pub struct SiteQueues {
    ids: HashMap<String, u32>,
    /// By id; id [`NO_SITE`] holds the devices without a site.
    sites: Vec<QueueSite>,
    /// The heads of the queues of sites not known to be full: (position, site id).
    open: BTreeSet<(usize, u32)>,
    /// The sites found full and unchanged since, by name, with why.
    pub(crate) blocked: BTreeMap<String, SiteWhy>,
    /// Their heads: (position, site id).
    blocked_heads: BTreeSet<(usize, u32)>,
    /// The blocked sites that wait for a seed: (end of the wait, site id).
    seed_waits: BTreeSet<(u64, u32)>,
}

#[derive(Debug, Clone, Default)]
struct QueueSite {
    name: Option<String>,
    /// Positions in the group's device list of devices not started yet (some may have left
    /// `scheduled` since; they are dropped when they reach the head).
    queue: VecDeque<usize>,
    state: State,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum State {
    /// Nothing queued.
    #[default]
    Idle,
    /// Its head is in `open`.
    Open,
    /// Found full; its head is in `blocked_heads`, and in `seed_waits` when it waits for a seed
    /// until then.
    Blocked { until: Option<u64> },
}

impl SiteQueues {
    /// The queues of the devices that have not started, given in list order as (position in
    /// the group's list, site) from the group's cursor on.
    pub fn build<'a>(scheduled: impl IntoIterator<Item = (usize, Option<&'a str>)>) -> Self {
        let mut q = SiteQueues {
            sites: vec![QueueSite::default()],
            ..SiteQueues::default()
        };
        for (pos, site) in scheduled {
            let id = q.id(site);
            q.sites[id as usize].queue.push_back(pos);
        }
        for (id, s) in q.sites.iter_mut().enumerate() {
            if let Some(&head) = s.queue.front() {
                s.state = State::Open;
                q.open.insert((head, id as u32));
            }
        }
        q
    }

    fn id(&mut self, site: Option<&str>) -> u32 {
        let Some(site) = site else {
            return NO_SITE;
        };
        if let Some(&id) = self.ids.get(site) {
            return id;
        }
        let id = self.sites.len() as u32;
        self.ids.insert(site.to_owned(), id);
        self.sites.push(QueueSite {
            name: Some(site.to_owned()),
            ..QueueSite::default()
        });
        id
    }

    /// The site's name (None for the devices without a site).
    pub fn name(&self, id: u32) -> Option<&str> {
        self.sites[id as usize].name.as_deref()
    }

    /// A device joined the end of the group's list at `pos`.
    pub fn append(&mut self, pos: usize, site: Option<&str>) {
        let id = self.id(site);
        let s = &mut self.sites[id as usize];
        s.queue.push_back(pos);
        if s.state == State::Idle {
            s.state = State::Open;
            self.open.insert((pos, id));
        }
    }

    /// Something that decides the site's gate changed: a blocked site is open again.
    pub fn reopen(&mut self, site: &str) {
        if let Some(&id) = self.ids.get(site) {
            self.reopen_id(id);
        }
    }

    fn reopen_id(&mut self, id: u32) {
        let s = &mut self.sites[id as usize];
        let State::Blocked { until } = s.state else {
            return;
        };
        let head = s.queue.front().copied().unwrap_or(usize::MAX);
        if let Some(name) = &s.name {
            self.blocked.remove(name);
        }
        self.blocked_heads.remove(&(head, id));
        if let Some(until) = until {
            self.seed_waits.remove(&(until, id));
        }
        s.state = State::Open;
        self.open.insert((head, id));
    }

    /// Opens the sites whose seed wait has ended by `now`.
    pub fn end_seed_waits(&mut self, now: u64) {
        while let Some(&(until, id)) = self.seed_waits.first() {
            if until > now {
                break;
            }
            self.reopen_id(id);
        }
    }

    /// The first device of an open site that has not started: (position, site id). Devices
    /// that started since they were queued are dropped on the way.
    /// `scheduled_at` says whether the device at a position of the group's list has not started.
    pub fn next(&mut self, scheduled_at: impl Fn(usize) -> bool) -> Option<(usize, u32)> {
        loop {
            let &(pos, id) = self.open.first()?;
            if scheduled_at(pos) {
                return Some((pos, id));
            }
            self.pop(pos, id);
        }
    }

    /// The device at the head of an open site's queue started or was passed for good.
    pub fn pop(&mut self, pos: usize, id: u32) {
        self.open.remove(&(pos, id));
        let s = &mut self.sites[id as usize];
        if s.queue.front() == Some(&pos) {
            s.queue.pop_front();
        }
        match s.queue.front() {
            Some(&next) => {
                self.open.insert((next, id));
            }
            None => s.state = State::Idle,
        }
    }

    /// The open site whose head is at `pos` is full, for `why`.
    pub(crate) fn block(&mut self, pos: usize, id: u32, why: SiteWhy) {
        self.open.remove(&(pos, id));
        let until = match &why {
            SiteWhy::Seed { until, .. } => Some(*until),
            _ => None,
        };
        let s = &mut self.sites[id as usize];
        s.state = State::Blocked { until };
        if let Some(name) = &s.name {
            self.blocked.insert(name.clone(), why);
        }
        self.blocked_heads.insert((pos, id));
        if let Some(until) = until {
            self.seed_waits.insert((until, id));
        }
    }

    /// Whether a blocked site's head is at `pos` or later.
    pub fn blocked_from(&self, pos: usize) -> bool {
        self.blocked_heads.range((pos, 0)..).next().is_some()
    }

    /// The earliest end of a seed wait among the blocked sites.
    pub fn first_seed_wait(&self) -> Option<u64> {
        self.seed_waits.first().map(|&(until, _)| until)
    }
}
