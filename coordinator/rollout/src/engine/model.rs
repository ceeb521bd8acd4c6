//! The stored shape of a rollout: its groups, every device's slot, approvals, conditions and
//! trace. Everything here is serialized into the store, so a restarted coordinator continues
//! exactly where it stopped.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use flotilla_protocol::control::{ApprovalStatus, Condition, SourceBytes, TraceEntry};
use flotilla_protocol::Phase;
use serde::{Deserialize, Serialize};

use super::queues::SiteQueues;
use crate::conditions::GroupCounts;
use crate::plan::{ErrorCondition, Excluded, Gate, Pace, SuccessCondition};
use crate::ramp::Ramp;
use crate::spec::RolloutSpec;

/// The release a rollout installs, as far as the engine needs to know it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseRef {
    pub name: String,
    pub counter: u64,
    /// Compatible hardware ids; empty means any.
    pub hardware: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutState {
    Creating,
    Ready,
    /// Started by the operator, waiting for its `start_at` time.
    Scheduled,
    Starting,
    Running,
    Paused,
    Stopped,
    Finished,
    /// Ended by an error condition whose action is stop or rollback.
    Failed,
}

impl RolloutState {
    /// No group will start again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RolloutState::Stopped | RolloutState::Finished | RolloutState::Failed
        )
    }

    /// Started and not over: its devices' actions count as the devices' current ones.
    pub fn is_active(self) -> bool {
        matches!(
            self,
            RolloutState::Scheduled
                | RolloutState::Starting
                | RolloutState::Running
                | RolloutState::Paused
        )
    }
}

impl fmt::Display for RolloutState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RolloutState::Creating => "creating",
            RolloutState::Ready => "ready",
            RolloutState::Scheduled => "scheduled",
            RolloutState::Starting => "starting",
            RolloutState::Running => "running",
            RolloutState::Paused => "paused",
            RolloutState::Stopped => "stopped",
            RolloutState::Finished => "finished",
            RolloutState::Failed => "failed",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupState {
    Scheduled,
    /// Waiting for the approval before its first device starts.
    Approval,
    Running,
    /// Every device is done and the group succeeded; its after gate (approval, timed wait) holds
    /// the next group.
    Waiting,
    Finished,
    Error,
}

impl fmt::Display for GroupState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GroupState::Scheduled => "scheduled",
            GroupState::Approval => "approval",
            GroupState::Running => "running",
            GroupState::Waiting => "waiting",
            GroupState::Finished => "finished",
            GroupState::Error => "error",
        })
    }
}

/// Where one device stands in one rollout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DevicePhase {
    /// No desired action sent yet.
    Scheduled,
    /// Desired action sent; the protocol phase name, or `issued` before the first report.
    InProgress(String),
    /// Failed or timed out; a retry is due at the slot's `retry_at`.
    Retrying(String),
    /// Ready (or applied without health tracking), not yet for the whole soak time.
    Soaking,
    Ready,
    Failed(String),
    Refused(String),
    TimedOut(String),
    Canceled,
    /// Left out: offline when its turn came under the `skip` offline policy, or deleted.
    Skipped(String),
    /// Sent back to the release it kept by the rollout's rollback error action.
    RolledBack,
}

/// Phase name of a device whose desired action was sent but that has not reported yet.
pub const ISSUED: &str = "issued";
/// Phase name of a device whose rollback was sent.
pub const ROLLING_BACK: &str = "rolling_back";
/// Reported phases after the switch to the new release (the agent's point of no return).
pub const PAST_ACTIVATION: [&str; 2] = ["activated", "confirming"];

impl DevicePhase {
    /// Lower-case name as shown in status tables.
    pub fn name(&self) -> &str {
        match self {
            DevicePhase::Scheduled => "scheduled",
            DevicePhase::InProgress(name) => name,
            DevicePhase::Retrying(_) => "retrying",
            DevicePhase::Soaking => "soaking",
            DevicePhase::Ready => "ready",
            DevicePhase::Failed(_) => "failed",
            DevicePhase::Refused(_) => "refused",
            DevicePhase::TimedOut(_) => "timed_out",
            DevicePhase::Canceled => "canceled",
            DevicePhase::Skipped(_) => "skipped",
            DevicePhase::RolledBack => "rolled_back",
        }
    }

    pub fn reason(&self) -> Option<&str> {
        match self {
            DevicePhase::Retrying(r)
            | DevicePhase::Failed(r)
            | DevicePhase::Refused(r)
            | DevicePhase::TimedOut(r)
            | DevicePhase::Skipped(r) => Some(r),
            _ => None,
        }
    }

    /// The action is over for this rollout (a retry pending is not over).
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            DevicePhase::Ready
                | DevicePhase::Failed(_)
                | DevicePhase::Refused(_)
                | DevicePhase::TimedOut(_)
                | DevicePhase::Canceled
                | DevicePhase::Skipped(_)
                | DevicePhase::RolledBack
        )
    }

    /// A desired action was sent and may still be acted on by the device.
    pub fn is_live(&self) -> bool {
        matches!(
            self,
            DevicePhase::InProgress(_) | DevicePhase::Soaking | DevicePhase::Retrying(_)
        )
    }

    /// The device reported a phase after its switch to the new release (`activated`,
    /// `confirming`): the agent ignores a cancel from here on (it cannot undo silently), so the
    /// action ends ready or failed, never canceled.
    pub fn past_activation(&self) -> bool {
        matches!(self, DevicePhase::InProgress(p) if PAST_ACTIVATION.contains(&p.as_str()))
    }

    pub fn is_failure(&self) -> bool {
        matches!(
            self,
            DevicePhase::Failed(_) | DevicePhase::Refused(_) | DevicePhase::TimedOut(_)
        )
    }

    pub(crate) fn count_in(&self, counts: &mut GroupCounts, add: bool) {
        let slot = match self {
            DevicePhase::Scheduled => &mut counts.scheduled,
            DevicePhase::InProgress(_) | DevicePhase::Retrying(_) => &mut counts.in_progress,
            DevicePhase::Soaking => &mut counts.soaking,
            DevicePhase::Ready => &mut counts.ready,
            DevicePhase::Failed(_) => &mut counts.failed,
            DevicePhase::Refused(_) => &mut counts.refused,
            DevicePhase::TimedOut(_) => &mut counts.timed_out,
            DevicePhase::Canceled | DevicePhase::RolledBack => &mut counts.canceled,
            DevicePhase::Skipped(_) => &mut counts.skipped,
        };
        if add {
            *slot += 1;
        } else {
            *slot = slot.saturating_sub(1);
        }
    }
}

/// What a reported protocol phase means for the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Progress(String),
    /// Ready and healthy (download-only actions: downloaded).
    Ready,
    /// Installed, but the device cannot track readiness (no health checks).
    Untracked,
    Failed(String),
    Refused(String),
    Canceled,
}

impl Outcome {
    pub fn from_phase(phase: &Phase) -> Outcome {
        match phase {
            Phase::Ready | Phase::Downloaded => Outcome::Ready,
            Phase::Failed {
                reason,
                rolled_back: true,
            } => Outcome::Failed(format!("{reason} (rolled back)")),
            Phase::Failed {
                reason,
                rolled_back: false,
            } => Outcome::Failed(reason.clone()),
            Phase::Refused { reason } => Outcome::Refused(reason.clone()),
            Phase::Canceled => Outcome::Canceled,
            Phase::Applied => Outcome::Untracked,
            other => Outcome::Progress(other.name().to_owned()),
        }
    }
}

/// One device of a group: its phase and the times the engine's timers need.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slot {
    pub phase: DevicePhase,
    /// 0 before the first desired action; 1 for the first attempt, 2 for the first retry…
    #[serde(default)]
    pub attempt: u32,
    #[serde(default)]
    pub started_at: Option<u64>,
    /// When the current attempt was sent (the in-progress timeout runs from here).
    #[serde(default)]
    pub attempt_at: Option<u64>,
    #[serde(default)]
    pub ended_at: Option<u64>,
    /// Soaking until this time.
    #[serde(default)]
    pub soak_until: Option<u64>,
    /// Retrying at this time.
    #[serde(default)]
    pub retry_at: Option<u64>,
    /// Attempts the device made in the rollout this one retries (`rollout retry`), so the
    /// attempt shown goes on counting.
    #[serde(default)]
    pub earlier_attempts: u32,
    /// The device was deleted while its group had not started or had finished (hawkBit: it
    /// shows as "not started"). Its phase, and so the group's counts, stay as they were; a
    /// group that has not started drops it when it starts.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deleted: bool,
    /// The device's site (its value of the site policy's label) when the rollout planned it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub site: Option<String>,
    /// Where the bytes of the device's action came from, as its final report said, with the
    /// peers added up: a report naming a thousand peers stores no more than one naming one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<SourceBytes>,
    /// The peers the device's current attempt was told to fetch from (re-sent as they were).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<String>,
    /// When this slot last sent the device something (an install, a rollback or a cancel), in
    /// the engine's count of actions sent to any device: the slot with the highest is the one
    /// whose action the device's retained `desired` topic holds (`owed.rs`). 0 for nothing
    /// sent, and in rollouts stored before it was counted.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub sent: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Phase name of a deleted device still listed in its group (hawkBit's "not started").
pub const NOT_STARTED: &str = "not_started";

impl Slot {
    pub fn scheduled() -> Self {
        Slot {
            phase: DevicePhase::Scheduled,
            attempt: 0,
            started_at: None,
            attempt_at: None,
            ended_at: None,
            soak_until: None,
            retry_at: None,
            earlier_attempts: 0,
            deleted: false,
            site: None,
            bytes: None,
            peers: Vec::new(),
            sent: 0,
        }
    }

    /// The phase as status tables show it: `not_started` once deleted.
    pub fn phase_name(&self) -> &str {
        if self.deleted {
            NOT_STARTED
        } else {
            self.phase.name()
        }
    }
}

/// One group of a rollout (deployment group, partition, rolling group or stage).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Group {
    pub name: String,
    pub state: GroupState,
    /// In rollout order.
    pub devices: Vec<String>,
    pub pace: Pace,
    pub success: SuccessCondition,
    pub error: Option<ErrorCondition>,
    pub before: Gate,
    pub after: Gate,
    /// Kept equal to a count over `slots`, updated per change rather than recomputed.
    pub counts: GroupCounts,
    pub slots: BTreeMap<String, Slot>,
    /// Index into `devices` of the next device to consider starting.
    pub cursor: usize,
    /// The group let the next one start (its success action ran after its after gate, an
    /// operator resumed past it, or triggered the next group).
    pub released: bool,
    pub started_at: Option<u64>,
    pub ended_at: Option<u64>,
    /// When the success condition first held (the after gate's timed wait runs from here).
    pub succeeded_at: Option<u64>,
    pub conditions: Vec<Condition>,
    /// Devices that registered after the start join this group (hawkBit's dynamic group).
    #[serde(default)]
    pub dynamic: bool,
    /// Sums over the slots kept up to date per change; rebuilt on load, never stored.
    #[serde(skip)]
    pub cache: GroupCache,
}

/// What a group sums over its slots per site and in bytes, kept with `counts` by
/// [`Group::set_phase`] and [`Group::set_bytes`], rebuilt from the slots on load
/// ([`Group::count_sites`]). It is derived from the slots, so it takes no part in comparing
/// groups: a group read back from the store equals the one written.
#[derive(Debug, Clone, Default)]
pub struct GroupCache {
    pub sites: BTreeMap<String, SiteCounts>,
    /// The bytes of every slot added up.
    pub bytes: SourceBytes,
    /// Bumped by every change that can let a device of a site start: a site device's phase,
    /// a device joining or leaving, the group starting, a site's holders.
    pub changes: u64,
    /// Every device the group has left was held by a full site at the last fill; nothing
    /// changed since (the sum of every group's `changes` says so) means no scan is needed.
    pub stalled: Option<Stall>,
    /// How many sites have devices not started yet, and how many such devices they have.
    pub open_sites: usize,
    pub scheduled_in_sites: usize,
    /// Sites whose counts changed since the last fill of any group: every group's waiting
    /// queues look at them again ([`super::queues`]).
    pub touched: Vec<String>,
    /// The length of `touched` after repeated names were last folded.
    pub touched_folded: usize,
    /// The group's per-site waiting queues, built at its first fill.
    pub queues: Option<Box<SiteQueues>>,
}

impl GroupCache {
    /// Changes a site's counts with `f`, keeping the open-site counters right and noting the
    /// site as touched when its counts changed; true when they did.
    pub fn update_site(&mut self, site: &str, f: impl FnOnce(&mut SiteCounts)) -> bool {
        let c = match self.sites.get_mut(site) {
            Some(c) => c,
            None => self.sites.entry(site.to_owned()).or_default(),
        };
        let before = *c;
        f(c);
        let after = *c;
        match (before.scheduled > 0, after.scheduled > 0) {
            (false, true) => self.open_sites += 1,
            (true, false) => self.open_sites -= 1,
            _ => {}
        }
        self.scheduled_in_sites = self.scheduled_in_sites + after.scheduled - before.scheduled;
        let changed = after != before;
        if changed {
            self.touch(site);
        }
        changed
    }

    /// Notes a site for every group's waiting queues. Read at the next fill; until then (a paused
    /// rollout, one whose groups all ended) repeated names are folded each time the list
    /// doubles, so it stays within twice the sites touched.
    pub fn touch(&mut self, site: &str) {
        self.touched.push(site.to_owned());
        if self.touched.len() >= 2 * self.touched_folded.max(32) {
            self.touched.sort_unstable();
            self.touched.dedup();
            self.touched_folded = self.touched.len();
        }
    }
}

/// A group whose remaining devices all wait for their sites.
#[derive(Debug, Clone)]
pub struct Stall {
    /// The sum of every group's `changes` when it was found.
    pub generation: u64,
    /// A seed's wait ends then: look again.
    pub until: u64,
    /// The words of the wait.
    pub text: String,
}

impl PartialEq for GroupCache {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// How many of a group's devices of one site are where the site limits look.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SiteCounts {
    pub total: usize,
    /// Not started yet.
    pub scheduled: usize,
    /// Started and not terminal: in progress or waiting for a retry.
    pub busy: usize,
    /// Not ready, as a group's budget counts it: busy, soaking, or failed.
    pub unavailable: usize,
    pub bytes: SourceBytes,
}

impl SiteCounts {
    fn count(&mut self, phase: &DevicePhase, add: bool) {
        let (scheduled, busy, unavailable) = match phase {
            DevicePhase::Scheduled => (1, 0, 0),
            DevicePhase::InProgress(_) | DevicePhase::Retrying(_) => (0, 1, 1),
            DevicePhase::Soaking => (0, 0, 1),
            p if p.is_failure() => (0, 0, 1),
            _ => (0, 0, 0),
        };
        let apply = |n: &mut usize, d: usize| {
            *n = if add { *n + d } else { n.saturating_sub(d) };
        };
        apply(&mut self.scheduled, scheduled);
        apply(&mut self.busy, busy);
        apply(&mut self.unavailable, unavailable);
        apply(&mut self.total, 1);
    }

    pub fn add(&mut self, other: &SiteCounts) {
        self.total += other.total;
        self.scheduled += other.scheduled;
        self.busy += other.busy;
        self.unavailable += other.unavailable;
        self.bytes.add(&other.bytes);
    }
}

impl Group {
    /// Sets a device's phase and keeps the counters right; false when nothing changed.
    pub fn set_phase(&mut self, device: &str, new: DevicePhase) -> bool {
        let Some(slot) = self.slots.get_mut(device) else {
            return false;
        };
        if slot.phase == new {
            return false;
        }
        slot.phase.count_in(&mut self.counts, false);
        new.count_in(&mut self.counts, true);
        if let Some(site) = &slot.site {
            let old = &slot.phase;
            // Progress within a phase (accepted, downloading…) lets no other device start.
            if self.cache.update_site(site, |c| {
                c.count(old, false);
                c.count(&new, true);
            }) {
                self.cache.changes = self.cache.changes.wrapping_add(1);
            }
        }
        slot.phase = new;
        true
    }

    /// Rebuilds the group's [`GroupCache`] from the slots.
    pub fn count_sites(&mut self) {
        self.cache.sites.clear();
        self.cache.bytes = SourceBytes::default();
        self.cache.open_sites = 0;
        self.cache.scheduled_in_sites = 0;
        self.cache.queues = None;
        for slot in self.slots.values() {
            let bytes = slot.bytes.unwrap_or_default();
            self.cache.bytes.add(&bytes);
            if let Some(site) = &slot.site {
                self.cache.update_site(site, |c| {
                    c.count(&slot.phase, true);
                    c.bytes.add(&bytes);
                });
            }
        }
        // Nothing waits on a fresh count.
        self.cache.touched.clear();
        self.cache.touched_folded = 0;
    }

    /// Sets a device's bytes and keeps the sums right.
    pub fn set_bytes(&mut self, device: &str, new: SourceBytes) {
        let Some(slot) = self.slots.get_mut(device) else {
            return;
        };
        let old = slot.bytes.unwrap_or_default();
        slot.bytes = Some(new);
        self.cache.bytes.sub(&old);
        self.cache.bytes.add(&new);
        if let Some(site) = &slot.site {
            let c = self.cache.sites.entry(site.clone()).or_default();
            c.bytes.sub(&old);
            c.bytes.add(&new);
        }
    }

    /// Takes a slot out of the site counts and byte sums before it is removed.
    pub fn uncount_site(&mut self, device: &str) {
        self.cache.changes = self.cache.changes.wrapping_add(1);
        if let Some(slot) = self.slots.get(device) {
            let bytes = slot.bytes.unwrap_or_default();
            self.cache.bytes.sub(&bytes);
            if let Some(site) = &slot.site {
                if self.cache.sites.contains_key(site) {
                    self.cache.update_site(site, |c| {
                        c.count(&slot.phase, false);
                        c.bytes.sub(&bytes);
                    });
                }
            }
        }
    }

    /// Sets (or adds) a condition of this type.
    pub fn condition(&mut self, kind: &str, status: bool, reason: &str, at: u64) {
        set_condition(&mut self.conditions, kind, status, reason, "", at);
    }

    /// Removes the devices deleted while the group had not started, keeping the counters
    /// right; returns them.
    pub fn drop_deleted(&mut self) -> Vec<String> {
        let gone: Vec<String> = self
            .slots
            .iter()
            .filter(|(_, s)| s.deleted)
            .map(|(d, _)| d.clone())
            .collect();
        for device in &gone {
            self.uncount_site(device);
            if let Some(slot) = self.slots.remove(device) {
                slot.phase.count_in(&mut self.counts, false);
                self.counts.total = self.counts.total.saturating_sub(1);
            }
            if let Some(pos) = self.devices.iter().position(|d| d == device) {
                self.devices.remove(pos);
                if pos < self.cursor {
                    self.cursor -= 1;
                }
            }
            // Positions moved: the queues are rebuilt at the next fill.
            self.cache.queues = None;
        }
        gone
    }

    /// Every device was started (or skipped).
    pub fn all_started(&self) -> bool {
        self.counts.scheduled == 0
    }
}

/// Sets a condition, keeping its time when nothing changed.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    kind: &str,
    status: bool,
    reason: &str,
    message: &str,
    at: u64,
) {
    if let Some(c) = conditions.iter_mut().find(|c| c.kind == kind) {
        if c.status != status || c.reason != reason {
            c.status = status;
            c.reason = reason.to_owned();
            c.message = message.to_owned();
            c.at = at;
        }
        return;
    }
    conditions.push(Condition {
        kind: kind.to_owned(),
        status,
        reason: reason.to_owned(),
        message: message.to_owned(),
        at,
    });
}

/// A rollout as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rollout {
    pub name: String,
    pub release: ReleaseRef,
    pub spec: RolloutSpec,
    pub created_at: u64,
    pub state: RolloutState,
    pub groups: Vec<Group>,
    /// Devices the selector matched that the release's hardware list rules out.
    #[serde(default)]
    pub excluded: Vec<Excluded>,
    /// Devices selected but taken by no group.
    #[serde(default)]
    pub unassigned: Vec<String>,
    /// The last [`super::TRACE_LIMIT`] decisions, oldest first.
    pub trace: Vec<TraceEntry>,
    #[serde(default)]
    pub conditions: Vec<Condition>,
    #[serde(default)]
    pub approvals: Vec<ApprovalStatus>,
    /// Why nothing more starts right now, while running.
    #[serde(default)]
    pub waiting: Option<String>,
    #[serde(default)]
    pub ramp: Option<Ramp>,
    #[serde(default)]
    pub started_at: Option<u64>,
    /// The last time the rollout was advanced (for timers that depend on "now").
    #[serde(default)]
    pub checked_at: u64,
    /// Ended by the rollback error action: a device that finishes on the new release after
    /// that (it was past activation) is sent back too.
    #[serde(default)]
    pub rolled_back: bool,
    /// Dynamic rollouts only: every device the coordinator knew while this rollout existed
    /// (the fleet at creation and each device that registered since). Stored, so a restarted
    /// coordinator, whose registry refills from retained states, still knows who is new; only
    /// a device not in here joins the dynamic group.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub seen: BTreeSet<String>,
    /// Peer ordering per site (rollouts whose site policy shares between peers).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sites: BTreeMap<String, SiteState>,
}

/// Where one site stands in peer ordering.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SiteState {
    /// The device fetching from the coordinator for the site, and since when; the site's other
    /// devices wait for it until `seed_at` + the policy's `seed_wait`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed_at: Option<u64>,
    /// Devices of the site that reported holding the release's artifacts verified, in the order
    /// they first did (the newest last), at most [`crate::plan::MAX_PEERS`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub holders: Vec<String>,
    /// Holders taken out because a device of the site bypassed them, never offered again in
    /// this rollout; the newest [`super::sites::DROPPED_KEPT`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dropped: Vec<String>,
}

impl Rollout {
    /// A device registered: records it as seen and says whether it is new to this rollout.
    /// Always false for a rollout without a dynamic group.
    pub fn first_sight(&mut self, device: &str) -> bool {
        self.spec.policies.dynamic
            && !self.state.is_terminal()
            && self.seen.insert(device.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::GroupCache;

    #[test]
    fn sites_touched_while_no_fill_reads_them_take_bounded_room() {
        let mut cache = GroupCache::default();
        for i in 0..10_000 {
            cache.touch(["harbour", "quarry", "mill"][i % 3]);
        }
        assert!(cache.touched.len() < 64, "{}", cache.touched.len());
        let mut sites = cache.touched.clone();
        sites.sort();
        sites.dedup();
        assert_eq!(sites, ["harbour", "mill", "quarry"]);
    }
}
