//! Site budgets and peer ordering (docs/decisions/0025-site-budgets-and-peer-ordering.md).
//!
//! A site is the set of a rollout's devices that carry the same value of the site policy's
//! label; a device without the label is in no site and no site limit applies to it. On top of
//! its group's pace, a device starts only while its site has fewer than `max_busy` devices busy
//! (started and not terminal) and fewer than `max_unavailable` not ready, counted across every
//! group of the rollout from the per-group [`super::model::SiteCounts`].
//!
//! With peer sharing, the first device of a site to start is the *seed*: it fetches from the
//! coordinator (no peers). The site's other devices wait until a device of the site reports
//! holding the release verified (a *holder*), then start naming the holders as peers. A seed that
//! ends without holding is replaced by the next device; one that stays busy past `seed_wait`
//! lets every waiting device of the site start without peers, so nobody waits forever.

use std::collections::BTreeSet;

use flotilla_protocol::control::{SiteStatus, SourceBytes};
use flotilla_protocol::Phase;

use super::model::{DevicePhase, GroupState, Rollout, SiteCounts};
pub(crate) use super::queues::SiteWhy;
use crate::plan::MAX_PEERS;

/// How many holders a site remembers having taken out (`SiteState::dropped`).
pub const DROPPED_KEPT: usize = 64;
use crate::window::utc_text;

/// A reported phase that means the device holds the release's artifacts verified.
pub(crate) fn holds_release(phase: &Phase) -> bool {
    matches!(
        phase,
        Phase::Verified
            | Phase::Staged
            | Phase::Activated
            | Phase::Confirming
            | Phase::Ready
            | Phase::Downloaded
            | Phase::Applied
    )
}

impl Rollout {
    /// Changes to any group's sites so far (see [`super::model::GroupCache::changes`]).
    pub(crate) fn site_generation(&self) -> u64 {
        self.groups
            .iter()
            .fold(0u64, |n, g| n.wrapping_add(g.cache.changes))
    }

    /// A site's counts over every group of the rollout.
    pub(crate) fn site_total(&self, site: &str) -> SiteCounts {
        let mut total = SiteCounts::default();
        for g in &self.groups {
            if let Some(c) = g.cache.sites.get(site) {
                total.add(c);
            }
        }
        total
    }

    /// Devices of a site not yet started in groups that are running: the ones its limits hold.
    pub(crate) fn site_waiting(&self, site: &str) -> usize {
        self.groups
            .iter()
            .filter(|g| g.state == GroupState::Running)
            .filter_map(|g| g.cache.sites.get(site))
            .map(|c| c.scheduled)
            .sum()
    }

    /// Whether `device` of `site` may start now, and with which peers.
    pub(crate) fn site_gate(
        &self,
        site: &str,
        device: &str,
        now: u64,
    ) -> Result<Vec<String>, SiteWhy> {
        let Some(policy) = &self.spec.policies.sites else {
            return Ok(Vec::new());
        };
        let c = self.site_total(site);
        if let Some(limit) = policy.max_busy {
            if c.busy >= limit {
                return Err(SiteWhy::Busy {
                    busy: c.busy,
                    limit,
                });
            }
        }
        if let Some(limit) = policy.max_unavailable {
            if c.unavailable >= limit {
                return Err(SiteWhy::Unavailable {
                    unavailable: c.unavailable,
                    limit,
                });
            }
        }
        if !policy.peers {
            return Ok(Vec::new());
        }
        let holders = self.holders_for(site, device);
        if !holders.is_empty() {
            return Ok(holders);
        }
        if let Some(state) = self.sites.get(site) {
            if let (Some(seed), Some(at)) = (&state.seed, state.seed_at) {
                let until = at.saturating_add(policy.seed_wait);
                if seed != device && self.is_busy(seed) && now < until {
                    return Err(SiteWhy::Seed {
                        seed: seed.clone(),
                        until,
                    });
                }
            }
        }
        Ok(Vec::new())
    }

    /// A device of a sharing site starts without peers: it becomes the site's seed unless a
    /// seed is still at work (past its wait, the others start without peers as well).
    pub(crate) fn seed_if_first(&mut self, site: &str, device: &str, peers: &[String], now: u64) {
        if !peers.is_empty() || !self.spec.policies.sites.as_ref().is_some_and(|p| p.peers) {
            return;
        }
        let seed_busy = self
            .sites
            .get(site)
            .and_then(|s| s.seed.as_deref())
            .is_some_and(|seed| self.is_busy(seed));
        if !seed_busy {
            // Other groups' devices of the site wait for this seed now.
            if let Some(g) = self.groups.first_mut() {
                g.cache.touch(site);
            }
            let state = self.sites.entry(site.to_owned()).or_default();
            state.seed = Some(device.to_owned());
            state.seed_at = Some(now);
        }
    }

    /// The holders of a site other than `device`, most recent last.
    pub(crate) fn holders_for(&self, site: &str, device: &str) -> Vec<String> {
        self.sites
            .get(site)
            .map(|s| s.holders.iter().filter(|h| *h != device).cloned().collect())
            .unwrap_or_default()
    }

    /// Started and not terminal, in whichever group the device is.
    fn is_busy(&self, device: &str) -> bool {
        self.groups
            .iter()
            .find_map(|g| g.slots.get(device))
            .is_some_and(|s| {
                matches!(
                    s.phase,
                    DevicePhase::InProgress(_) | DevicePhase::Retrying(_)
                )
            })
    }

    /// Records what a device's report says about holding the release for its site's peers;
    /// true when the site got its first holder (devices waiting for it may start now).
    pub(crate) fn note_holder(&mut self, gi: usize, device: &str, phase: &Phase) -> bool {
        if !self.spec.policies.sites.as_ref().is_some_and(|p| p.peers) {
            return false;
        }
        let Some(site) = self.site_of(gi, device) else {
            return false;
        };
        self.holders_changed(gi, &site);
        let state = self.sites.entry(site).or_default();
        let had = state.holders.is_empty();
        if holds_release(phase) {
            if state
                .holders
                .iter()
                .chain(&state.dropped)
                .any(|h| h == device)
            {
                return false;
            }
            state.holders.push(device.to_owned());
            if state.holders.len() > MAX_PEERS {
                let excess = state.holders.len() - MAX_PEERS;
                state.holders.drain(..excess);
            }
            return had;
        }
        if matches!(
            phase,
            Phase::Failed { .. } | Phase::Canceled | Phase::Refused { .. }
        ) {
            state.holders.retain(|h| h != device);
        }
        false
    }

    /// Takes `peer` out of the holders of `device`'s site (device `device` of group `gi`
    /// bypassed it: a block that failed its hash, no answer, too slow): the site's later devices
    /// are sent to its other holders, or to the coordinator. The site, when `peer` was one of its
    /// holders. Only the reporting device's own site is touched. The peer is not taken back when
    /// it reports holding the release again (`Ready` after `Verified`).
    pub(crate) fn drop_holder(&mut self, gi: usize, device: &str, peer: &str) -> Option<String> {
        let site = self.site_of(gi, device)?;
        let state = self.sites.get_mut(&site)?;
        let before = state.holders.len();
        state.holders.retain(|h| h != peer);
        if state.holders.len() == before {
            return None;
        }
        state.dropped.push(peer.to_owned());
        if state.dropped.len() > DROPPED_KEPT {
            state.dropped.remove(0);
        }
        self.holders_changed(gi, &site);
        Some(site)
    }

    /// The site of a device of group `gi`, as planned.
    fn site_of(&self, gi: usize, device: &str) -> Option<String> {
        self.groups[gi].slots.get(device)?.site.clone()
    }

    /// A site's holders changed: devices waiting for it may start now (or with other peers).
    fn holders_changed(&mut self, gi: usize, site: &str) {
        let cache = &mut self.groups[gi].cache;
        cache.changes = cache.changes.wrapping_add(1);
        cache.touch(site);
    }

    /// The words of a site's wait, with the numbers.
    pub(crate) fn site_wait(&self, site: &str, why: SiteWhy) -> String {
        let waiting = self.site_waiting(site);
        let text = match why {
            SiteWhy::Busy { busy, limit } => {
                format!("site {site}: {busy} of {limit} busy, {waiting} waiting")
            }
            SiteWhy::Unavailable { unavailable, limit } => {
                format!("site {site}: {unavailable} of {limit} unavailable, {waiting} waiting")
            }
            SiteWhy::Seed { seed, until } => format!(
                "site {site}: {waiting} waiting for seed {seed} to hold the release (at most until {})",
                utc_text(until)
            ),
        };
        text
    }

    /// When the oldest seed wait of a site with devices waiting ends (a timer to act on).
    pub(crate) fn next_seed_deadline(&self) -> Option<u64> {
        let policy = self.spec.policies.sites.as_ref().filter(|p| p.peers)?;
        self.sites
            .iter()
            .filter(|(site, s)| s.holders.is_empty() && self.site_waiting(site) > 0)
            .filter_map(|(_, s)| s.seed_at.map(|at| at.saturating_add(policy.seed_wait)))
            .filter(|&t| t > self.checked_at)
            .min()
    }

    /// Every site of the rollout, by name.
    pub(crate) fn site_names(&self) -> BTreeSet<&str> {
        self.groups
            .iter()
            .flat_map(|g| g.cache.sites.keys().map(String::as_str))
            .collect()
    }

    /// The bytes of every device of the rollout added up.
    pub(crate) fn bytes_total(&self) -> SourceBytes {
        let mut total = SourceBytes::default();
        for g in &self.groups {
            total.add(&g.cache.bytes);
        }
        total
    }

    /// The sites as the status shows them: with `limit`, that many, the busiest first (then
    /// the most waiting, then by name); without, every site by name.
    pub(crate) fn site_statuses(&self, limit: Option<usize>) -> Vec<SiteStatus> {
        let Some(policy) = &self.spec.policies.sites else {
            return Vec::new();
        };
        let mut sites: Vec<SiteStatus> = self
            .site_names()
            .into_iter()
            .map(|name| {
                let c = self.site_total(name);
                let state = self.sites.get(name);
                SiteStatus {
                    name: name.to_owned(),
                    total: c.total,
                    busy: c.busy,
                    unavailable: c.unavailable,
                    waiting: self.site_waiting(name),
                    max_busy: policy.max_busy,
                    max_unavailable: policy.max_unavailable,
                    seed: state.and_then(|s| s.seed.clone()),
                    holders: state.map(|s| s.holders.clone()).unwrap_or_default(),
                    bytes: c.bytes,
                }
            })
            .collect();
        if let Some(limit) = limit {
            sites.sort_by(|a, b| {
                (b.busy, b.waiting)
                    .cmp(&(a.busy, a.waiting))
                    .then_with(|| a.name.cmp(&b.name))
            });
            sites.truncate(limit);
        }
        sites
    }
}
