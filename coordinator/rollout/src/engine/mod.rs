//! The rollout engine: a sans-I/O state machine (docs/decisions/0003-coordinator-engine.md).
//!
//! Every input is a method call that takes `now` (Unix seconds) and returns [`Effect`]s for the
//! service to apply in order: `Save` (persist the rollout), then `Desired`/`Cancel`/`Rollback`/
//! `Approval`/`Forget` (sign and publish), then `Status` and `Trace` (integration events). Nothing
//! here reads a clock, touches a socket or the disk, so the same engine runs the service, the
//! simulator (`flotilla simulate`) and the tests.
//!
//! ```text
//! rollout:  creating -> ready -> [scheduled ->] running <-> paused
//!                                   |     \         |
//!                                   |      `-> finished | failed (error action stop/rollback)
//!                                   `-> stopped <-'      (stop from any non-terminal state)
//! group:    scheduled -> [approval ->] running -> [waiting ->] finished | error
//! device:   scheduled -> in progress (issued, accepted, …) [-> retrying] [-> soaking]
//!                     -> ready | failed | refused | timed out | canceled | skipped | rolled back
//! ```
//!
//! Every vocabulary arrives as the same compiled plan (`crate::plan`); how a rollout moves is in
//! `advance`, the stored shape in [`model`].
//!
//! Scale: a report is routed through a per-rollout index (device -> group) and updates that
//! group's counters incrementally. Per-device changes do not emit `Save`/`Status` (serializing a
//! 100,000-device rollout per report would be O(fleet)); instead the rollout is marked dirty and
//! [`Engine::tick`] emits one `Save` and one `Status` per dirty rollout. Transitions emit them at
//! once.

mod advance;
mod excluded;
pub mod model;
mod names;
mod owed;
mod queues;
mod sites;
mod status;
mod trace;

use std::collections::{btree_map, BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::ops::Bound;
use std::sync::Arc;

use flotilla_protocol::control::{
    ApprovalStatus, DeviceDetail, DeviceSummary, ExcludedDevice, GroupStatus, RolloutDevice,
    RolloutStatus, SourceBytes, TraceKind, SUMMARY_EXCLUDED, SUMMARY_SITES,
};
use flotilla_protocol::{DeviceState, Phase, Report, TimeWindow};

use crate::conditions::GroupCounts;
use crate::plan::{ActionType, Gate, Pace};
use crate::planner::{self, DeviceGroup, PlanDevice, PlanError};
use crate::ramp::Ramp;
use crate::selector::Labels;
use crate::spec::{RolloutSpec, SpecError, Strategy};

use crate::window::Window;
use crate::zoneinfo::ZoneSource;

use advance::{after_approval, before_approval, Ctx, Out};
pub use model::{
    DevicePhase, Group, GroupState, Outcome, ReleaseRef, Rollout, RolloutState, Slot, ISSUED,
};
use names::Names;
use trace::Decision;

/// How many trace entries a rollout keeps; older ones are dropped (they also went to `events/log`).
pub const TRACE_LIMIT: usize = 1000;

/// How many of the newest decisions a rollout's summary (the retained event, command replies,
/// paged status) carries; each decision is also published on `events/log` as it is made.
pub const SUMMARY_TRACE: usize = 100;

/// Who a command is attributed to when the caller names nobody (simulations, tests): the trace
/// says "paused by operator".
pub const OPERATOR: &str = "operator";

/// What the service must do, in this order: persist, publish snapshots, commands, events.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Persist the rollout with this name (read it with [`Engine::rollout`]).
    Save(String),
    /// Sign and publish (retained) a desired install action.
    Desired {
        device: String,
        action_id: String,
        rollout: String,
        release: String,
        action: ActionType,
        /// Devices of the same site that hold the release's artifacts, in the order to try
        /// them; empty when the device fetches from the coordinator alone. A non-empty list
        /// makes the install an `InstallWithPeers` with a grant naming them.
        peers: Vec<String>,
    },
    /// Publish (retained) a cancel of this action.
    Cancel {
        device: String,
        action_id: String,
        rollout: String,
    },
    /// Sign and publish (retained) a rollback of `undo`, the action that installed the release:
    /// the device returns to the release it kept.
    Rollback {
        device: String,
        action_id: String,
        rollout: String,
        undo: String,
    },
    /// Publish (retained) an approval request's state on `events/approvals/{name}`.
    Approval(ApprovalStatus),
    /// Clear a deleted device's retained topics (desired and state).
    Forget { device: String },
    /// Publish the rollout's summary (read it with [`Engine::status`]).
    Status(String),
    /// Publish this summary, taken on the way through a state that ends within the same call
    /// (`creating`, `starting`), on the same topic as [`Effect::Status`]. It comes before the
    /// desired actions, so `starting` shows while they are being signed and published.
    Snapshot(Box<RolloutStatus>),
    /// Publish one decision to `events/log`.
    Trace(flotilla_protocol::control::TraceEntry),
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("no rollout named {0:?}")]
    UnknownRollout(String),
    #[error("a rollout named {0:?} already exists")]
    AlreadyExists(String),
    #[error("rollout {rollout} is {state}; cannot {command} it")]
    InvalidTransition {
        rollout: String,
        state: RolloutState,
        command: &'static str,
    },
    #[error("rollout {rollout} would reach no device: {reason}")]
    NoDevices { rollout: String, reason: String },
    #[error(
        "rollout {rollout}: spec names release {spec_release:?} but release {release:?} was given"
    )]
    ReleaseMismatch {
        rollout: String,
        spec_release: String,
        release: String,
    },
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("no approval request named {0:?}")]
    UnknownApproval(String),
    #[error("no device named {0:?}")]
    UnknownDevice(String),
    #[error("{0}")]
    Conflict(String),
}

/// The action id of a device's first attempt in a rollout: `{rollout}@{created_at}:{device}`.
/// Retries append `:{attempt}` and a rollback appends `:rollback`. Including `created_at` keeps a
/// re-created rollout of the same name from colliding with an old one, since an agent never
/// applies an action id twice.
pub fn action_id(rollout: &str, created_at: u64, device: &str) -> String {
    format!("{rollout}@{created_at}:{device}")
}

/// The action id of a device's `attempt` (1 for the first) in a rollout.
pub fn attempt_action_id(rollout: &str, created_at: u64, device: &str, attempt: u32) -> String {
    let base = action_id(rollout, created_at, device);
    if attempt <= 1 {
        base
    } else {
        format!("{base}:{attempt}")
    }
}

/// The action id of the rollback a rollout's rollback error action sends a device.
pub fn rollback_action_id(rollout: &str, created_at: u64, device: &str) -> String {
    format!("{}:rollback", action_id(rollout, created_at, device))
}

/// The id a cancel of `action_id` is published under: its own, since an agent never acts on an
/// id it already knows (a cancel under the id of the running action would be taken for a repeat
/// of it). No report ever names it, and [`parse_action_id`] does not take it for an attempt.
pub fn cancel_action_id(action_id: &str) -> String {
    format!("{action_id}:cancel")
}

/// What an action id names, beyond the rollout and device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActionPart {
    /// An install attempt, counting from 1.
    Attempt(u32),
    Rollback,
}

/// Splits an action id made by [`action_id`] into (rollout, created_at, device, part). Rollout
/// names and device ids cannot contain `@` or `:`, so the split is unambiguous.
pub fn parse_action_id(id: &str) -> Option<(&str, u64, &str, ActionPart)> {
    let (rollout, rest) = id.split_once('@')?;
    let (created_at, rest) = rest.split_once(':')?;
    let (device, part) = match rest.split_once(':') {
        None => (rest, ActionPart::Attempt(1)),
        Some((device, "rollback")) => (device, ActionPart::Rollback),
        Some((device, n)) => (device, ActionPart::Attempt(n.parse().ok()?)),
    };
    Some((rollout, created_at.parse().ok()?, device, part))
}

/// What the engine knows about a device from its retained state and its reports.
#[derive(Debug, Clone)]
struct DeviceRecord {
    hardware_id: Arc<str>,
    labels: LabelList,
    online: bool,
    installed: Option<Arc<str>>,
    rollout: Option<Arc<str>>,
    phase: Option<&'static str>,
    reason: Option<String>,
}

/// A device's labels sorted by key, each key once, keys and values shared with the other
/// devices that carry them ([`names::Names`]).
#[derive(Debug, Clone)]
struct LabelList(Box<[(Arc<str>, Arc<str>)]>);

impl LabelList {
    /// As a map would keep them: the last of a repeated key counts.
    fn new(mut labels: Vec<(String, String)>, names: &mut Names) -> Self {
        labels.reverse();
        labels.sort_by(|a, b| a.0.cmp(&b.0));
        labels.dedup_by(|later, first| later.0 == first.0);
        Self(
            labels
                .iter()
                .map(|(k, v)| (names.get(k), names.get(v)))
                .collect(),
        )
    }
}

impl Labels for LabelList {
    fn label(&self, key: &str) -> Option<&str> {
        let i = self.0.binary_search_by(|(k, _)| (**k).cmp(key)).ok()?;
        Some(&self.0[i].1)
    }
}

/// A registry device as the planner reads it.
struct Registered<'a> {
    id: &'a str,
    record: &'a DeviceRecord,
}

impl PlanDevice for Registered<'_> {
    type Labels = LabelList;
    fn id(&self) -> &str {
        self.id
    }
    fn hardware_id(&self) -> &str {
        &self.record.hardware_id
    }
    fn labels(&self) -> &Self::Labels {
        &self.record.labels
    }
}

/// A rollout with what is rebuilt on restore and never stored.
struct Entry {
    rollout: Rollout,
    /// Device id -> group index.
    index: HashMap<String, usize>,
    windows: Vec<Window>,
}

impl Entry {
    fn new(mut rollout: Rollout, zones: &dyn ZoneSource) -> Self {
        for g in &mut rollout.groups {
            g.count_sites();
        }
        let index = rollout
            .groups
            .iter()
            .enumerate()
            .flat_map(|(gi, g)| g.devices.iter().map(move |d| (d.clone(), gi)))
            .collect();
        // Specs were validated when created; a window that no longer parses (its zone file
        // gone) is left out.
        let windows = rollout
            .spec
            .policies
            .windows
            .iter()
            .filter_map(|w| Window::parse(w, zones).ok())
            .collect();
        Self {
            rollout,
            index,
            windows,
        }
    }
}

/// The rollout engine. See the module documentation.
pub struct Engine {
    /// Time zone rules for maintenance windows.
    zones: Box<dyn ZoneSource + Send + Sync>,
    rollouts: BTreeMap<String, Entry>,
    devices: BTreeMap<String, DeviceRecord>,
    /// Device id -> offline since, for the devices offline (most of a fleet is not: it takes
    /// no room here).
    offline: HashMap<String, u64>,
    /// Device id -> (rollout, weight) whose action is the device's current one.
    owners: HashMap<String, (String, u32)>,
    /// Highest report seq seen per device, to drop duplicates and re-sent reports.
    last_seq: HashMap<String, u64>,
    /// Rollouts whose device phases changed since the last tick.
    dirty: BTreeSet<String>,
    /// Named device groups that partitions refer to.
    device_groups: Vec<DeviceGroup>,
    /// The registry's shared strings.
    names: Names,
    /// Actions sent to devices so far (installs, rollbacks, cancels), stamped on the slot of
    /// each as it is sent (`owed.rs`).
    sends: u64,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("rollouts", &self.rollouts.len())
            .field("devices", &self.devices.len())
            .finish()
    }
}

impl Engine {
    /// An engine with no rollouts; maintenance windows look their time zones up in `zones`.
    pub fn new(zones: impl ZoneSource + Send + Sync + 'static) -> Self {
        Self {
            zones: Box::new(zones),
            rollouts: BTreeMap::new(),
            devices: BTreeMap::new(),
            offline: HashMap::new(),
            owners: HashMap::new(),
            last_seq: HashMap::new(),
            dirty: BTreeSet::new(),
            device_groups: Vec::new(),
            names: Names::default(),
            sends: 0,
        }
    }

    /// Rebuilds the engine from stored rollouts after a restart. The device registry starts
    /// empty and refills from the retained state topics.
    pub fn restore(rollouts: Vec<Rollout>, zones: impl ZoneSource + Send + Sync + 'static) -> Self {
        let mut engine = Self::new(zones);
        engine.sends = owed::last_sent(rollouts.iter());
        for mut r in rollouts {
            if r.state.is_active() {
                for g in &r.groups {
                    for (device, slot) in &g.slots {
                        if slot.phase.is_live() {
                            engine
                                .owners
                                .insert(device.clone(), (r.name.clone(), r.spec.policies.weight));
                        }
                    }
                }
            }
            if r.spec.policies.dynamic && r.seen.is_empty() {
                // Stored before `seen` existed: at least the devices it planned are not new.
                r.seen = r
                    .groups
                    .iter()
                    .flat_map(|g| g.devices.iter().cloned())
                    .collect();
                r.seen.extend(r.unassigned.iter().cloned());
                r.seen.extend(r.excluded.iter().map(|e| e.device.clone()));
            }
            let entry = Entry::new(r, &*engine.zones);
            engine.rollouts.insert(entry.rollout.name.clone(), entry);
        }
        engine
    }

    /// Advances one rollout with the engine's device knowledge, then applies what it decided
    /// across rollouts (owners, preemption).
    fn advance(&mut self, name: &str, now: u64, out: &mut Out) {
        let mut pending = vec![name.to_owned()];
        let mut rounds = 0;
        while let Some(name) = pending.pop() {
            rounds += 1;
            if rounds > 64 {
                break;
            }
            let Some(entry) = self.rollouts.get_mut(&name) else {
                continue;
            };
            let ctx = Ctx {
                offline: &self.offline,
                owners: &self.owners,
                windows: &entry.windows,
            };
            entry.rollout.advance(now, &ctx, out);
            for other in self.apply_bookkeeping(now, out) {
                if !pending.contains(&other) {
                    pending.push(other);
                }
            }
        }
    }

    /// A device's retained state: updates the registry, and if its current action belongs to a
    /// rollout, applies the phase like a report (this is how a restarted coordinator catches up).
    pub fn observe_state(&mut self, state: DeviceState, now: u64) -> Vec<Effect> {
        let current = state.current.as_ref();
        let record = DeviceRecord {
            hardware_id: self.names.get(&state.hardware_id),
            labels: LabelList::new(state.labels, &mut self.names),
            online: state.online,
            installed: state.installed.as_ref().map(|i| self.names.get(&i.name)),
            rollout: current.map(|c| self.names.get(&c.rollout_id)),
            phase: current.map(|c| c.phase.name()),
            reason: current.and_then(|c| c.phase.reason().map(str::to_owned)),
        };
        if state.online {
            self.offline.remove(&state.device_id);
        } else if !self.offline.contains_key(&state.device_id) {
            self.offline.insert(state.device_id.clone(), now);
        }
        let known = match self.devices.entry(state.device_id.clone()) {
            btree_map::Entry::Occupied(mut e) => {
                e.insert(record);
                true
            }
            btree_map::Entry::Vacant(e) => {
                e.insert(record);
                false
            }
        };
        let mut out = Out::default();
        if let Some(c) = current {
            self.apply(
                &state.device_id,
                &c.action_id,
                &c.phase,
                true,
                now,
                &mut out,
            );
        }
        if !known {
            self.join_dynamic_groups(&state.device_id, now, &mut out);
        }
        self.emit(out)
    }

    /// A device the registry did not hold: rollouts with a dynamic group that never saw it
    /// record it, and those already started take it if it matches. A device a rollout saw
    /// before (before a coordinator restart too) is never new to it.
    fn join_dynamic_groups(&mut self, device: &str, now: u64, out: &mut Out) {
        if !self
            .rollouts
            .values()
            .any(|e| e.rollout.spec.policies.dynamic)
        {
            return;
        }
        let Some(record) = self.devices.get(device) else {
            return;
        };
        let mut joined = Vec::new();
        for (name, entry) in &mut self.rollouts {
            if !entry.rollout.first_sight(device) {
                continue;
            }
            if !out.save.contains(name) {
                out.save.push(name.clone());
            }
            let r = &entry.rollout;
            if !r.state.is_active()
                || entry.index.contains_key(device)
                || !r.spec.select.matches(&record.labels)
                || !(r.release.hardware.is_empty()
                    || r.release
                        .hardware
                        .iter()
                        .any(|h| **h == *record.hardware_id))
            {
                continue;
            }
            let site = site_of(r, &record.labels);
            if let Some(gi) = entry.rollout.join_dynamic(device, site, now, out) {
                entry.index.insert(device.to_owned(), gi);
                joined.push(name.clone());
            }
        }
        for name in joined {
            self.advance(&name, now, out);
        }
    }

    /// A device's progress report. A `seq` not above the last one seen from the device is a
    /// duplicate or a re-send and is ignored.
    pub fn observe_report(&mut self, report: Report, now: u64) -> Vec<Effect> {
        match self.last_seq.get(&report.device_id) {
            Some(&last) if report.seq <= last => return Vec::new(),
            _ => {}
        }
        match self.last_seq.get_mut(&report.device_id) {
            Some(last) => *last = report.seq,
            None => {
                self.last_seq.insert(report.device_id.clone(), report.seq);
            }
        }
        if let Some(record) = self.devices.get_mut(&report.device_id) {
            if record.rollout.as_deref() != Some(report.rollout_id.as_str()) {
                record.rollout = Some(self.names.get(&report.rollout_id));
            }
            record.phase = Some(report.phase.name());
            let reason = report.phase.reason();
            if record.reason.as_deref() != reason {
                record.reason = reason.map(str::to_owned);
            }
        }
        let mut out = Out::default();
        self.apply(
            &report.device_id,
            &report.action_id,
            &report.phase,
            false,
            now,
            &mut out,
        );
        self.emit(out)
    }

    /// Routes a device's phase for an action to its rollout and group. Anything that is not the
    /// device's current action in a rollout (unknown rollout, older incarnation or attempt, group
    /// not yet started, another device's id) is ignored.
    fn apply(
        &mut self,
        device: &str,
        action: &str,
        phase: &Phase,
        from_state: bool,
        now: u64,
        out: &mut Out,
    ) {
        let Some((rollout, created_at, for_device, part)) = parse_action_id(action) else {
            return;
        };
        if for_device != device {
            return;
        }
        let Some(entry) = self.rollouts.get_mut(rollout) else {
            return;
        };
        if entry.rollout.created_at != created_at {
            return;
        }
        let Some(&gi) = entry.index.get(device) else {
            return;
        };
        let r = &mut entry.rollout;
        let Some(slot) = r.groups[gi].slots.get(device) else {
            return;
        };
        let current = slot.phase.clone();
        let outcome = Outcome::from_phase(phase);
        let name = r.name.clone();
        match part {
            ActionPart::Rollback => {
                if !is_rolling_back(&current) {
                    return;
                }
                let new = match outcome {
                    Outcome::Ready | Outcome::Untracked => DevicePhase::RolledBack,
                    Outcome::Failed(reason) | Outcome::Refused(reason) => {
                        DevicePhase::Failed(format!("rollback failed: {reason}"))
                    }
                    _ => return,
                };
                let group = &mut r.groups[gi];
                group.set_phase(device, new);
                if let Some(slot) = group.slots.get_mut(device) {
                    slot.ended_at = Some(now);
                }
                out.releases.push((device.to_owned(), name.clone()));
            }
            ActionPart::Attempt(attempt) => {
                if current == DevicePhase::Scheduled || attempt != slot.attempt {
                    return;
                }
                if matches!(current, DevicePhase::Retrying(_) | DevicePhase::RolledBack)
                    || is_rolling_back(&current)
                {
                    return;
                }
                // A retained state can be older than a report already applied; it never undoes
                // an end.
                if from_state && current.is_terminal() && matches!(outcome, Outcome::Progress(_)) {
                    return;
                }
                // Peers of its site may fetch from a device that holds the release verified.
                r.note_holder(gi, device, phase);
                let policies = &r.spec.policies;
                match outcome {
                    Outcome::Progress(p) => {
                        if current.is_terminal() || current == DevicePhase::Soaking {
                            return;
                        }
                        r.groups[gi].set_phase(device, DevicePhase::InProgress(p));
                    }
                    Outcome::Ready | Outcome::Untracked => {
                        if matches!(current, DevicePhase::Ready | DevicePhase::Soaking) {
                            return;
                        }
                        if r.state.is_terminal() {
                            r.finished_late(gi, device, &current, now, out);
                            self.dirty.insert(name.clone());
                            self.advance(&name, now, out);
                            return;
                        }
                        let hold = if outcome == Outcome::Untracked {
                            policies.soak.max(policies.unavailable_period)
                        } else {
                            policies.soak
                        };
                        let group = &mut r.groups[gi];
                        if let Some(slot) = group.slots.get_mut(device) {
                            slot.ended_at = Some(now);
                            slot.soak_until = (hold > 0).then_some(now + hold);
                        }
                        if hold > 0 {
                            group.set_phase(device, DevicePhase::Soaking);
                        } else {
                            group.set_phase(device, DevicePhase::Ready);
                            out.releases.push((device.to_owned(), name.clone()));
                        }
                        if current.is_failure() {
                            r.reopen(gi, device, now, out);
                        }
                    }
                    Outcome::Failed(reason) => {
                        if current.is_failure() {
                            return;
                        }
                        r.fail_device(gi, device, DevicePhase::Failed(reason), now, out);
                    }
                    Outcome::Refused(reason) => {
                        if current.is_failure() {
                            return;
                        }
                        r.fail_device(gi, device, DevicePhase::Refused(reason), now, out);
                    }
                    Outcome::Canceled => {
                        let group = &mut r.groups[gi];
                        group.set_phase(device, DevicePhase::Canceled);
                        if let Some(slot) = group.slots.get_mut(device) {
                            slot.ended_at = Some(now);
                        }
                        out.releases.push((device.to_owned(), name.clone()));
                    }
                }
            }
        }
        if !self.dirty.contains(&name) {
            self.dirty.insert(name.clone());
        }
        self.advance(&name, now, out);
    }

    /// The most peers one report may name in the trace; the rest are counted in one line, so a
    /// device cannot flood its rollout's trace.
    pub const BYPASSED_TRACED: usize = 4;

    /// Traces the peers a device stopped asking during its action (a block that failed its
    /// hash, no answer), as its final report names them: "dev-3 bypassed peer dev-5: block 12
    /// failed its hash". Call once per final report (the service counts a repeated report
    /// once); a report for an action the engine does not run is ignored.
    pub fn observe_bypassed(
        &mut self,
        device: &str,
        action_id: &str,
        bypassed: &[flotilla_protocol::BypassedPeer],
        now: u64,
    ) -> Vec<Effect> {
        let mut out = Out::default();
        if bypassed.is_empty() {
            return self.emit(out);
        }
        let Some((rollout, created_at, for_device, ActionPart::Attempt(_))) =
            parse_action_id(action_id)
        else {
            return self.emit(out);
        };
        if for_device != device {
            return self.emit(out);
        }
        let Some(entry) = self.rollouts.get_mut(rollout) else {
            return self.emit(out);
        };
        if entry.rollout.created_at != created_at {
            return self.emit(out);
        }
        let Some(&gi) = entry.index.get(device) else {
            return self.emit(out);
        };
        let r = &mut entry.rollout;
        let group = r.groups[gi].name.clone();
        let mut notes = Vec::new();
        // Later devices of the site are not sent to a peer that failed one of them.
        for b in bypassed {
            if let Some(site) = r.drop_holder(gi, device, &b.peer) {
                notes.push(format!(
                    "peer {} is no longer offered to site {site}: {device} bypassed it",
                    b.peer
                ));
            }
        }
        for b in bypassed.iter().take(Self::BYPASSED_TRACED) {
            notes.push(format!("{device} bypassed peer {}: {}", b.peer, b.reason));
        }
        if bypassed.len() > Self::BYPASSED_TRACED {
            notes.push(format!(
                "{device} bypassed {} more peers",
                bypassed.len() - Self::BYPASSED_TRACED
            ));
        }
        for message in notes {
            let decision = Decision::new(TraceKind::Note, message).group(&group);
            r.record(now, decision.device(device), &mut out);
        }
        self.dirty.insert(rollout.to_owned());
        self.emit(out)
    }
    /// Where the bytes of a device's action came from, from its final report: stored in the
    /// device's slot and summed per rollout and per site in the status. Anything that is not the
    /// device's current attempt in a rollout is ignored, as for reports.
    pub fn observe_bytes(
        &mut self,
        device: &str,
        action_id: &str,
        bytes: flotilla_protocol::ByteCounts,
    ) {
        let Some((rollout, created_at, for_device, ActionPart::Attempt(attempt))) =
            parse_action_id(action_id)
        else {
            return;
        };
        if for_device != device {
            return;
        }
        let Some(entry) = self.rollouts.get_mut(rollout) else {
            return;
        };
        if entry.rollout.created_at != created_at {
            return;
        }
        let Some(&gi) = entry.index.get(device) else {
            return;
        };
        let group = &mut entry.rollout.groups[gi];
        let Some(slot) = group.slots.get(device) else {
            return;
        };
        let bytes = SourceBytes::of(&bytes);
        if slot.attempt != attempt || slot.bytes == Some(bytes) {
            return;
        }
        group.set_bytes(device, bytes);
        self.dirty.insert(rollout.to_owned());
    }

    /// The registry as the planner reads it, borrowed: a million devices are not copied.
    fn fleet(&self) -> Vec<Registered<'_>> {
        self.devices
            .iter()
            .map(|(id, record)| Registered { id, record })
            .collect()
    }

    /// Plans a rollout over the devices known now (creating -> ready). Fails when no device
    /// would be reached, naming why, or when a staged run overlaps another run with a different
    /// strategy.
    pub fn create_rollout(
        &mut self,
        spec: RolloutSpec,
        release: ReleaseRef,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        self.create(spec, release, None, &[], now)
    }

    /// [`Engine::create_rollout`] on behalf of an operator, whom the trace names.
    pub fn create_rollout_by(
        &mut self,
        spec: RolloutSpec,
        release: ReleaseRef,
        by: &str,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        self.create(spec, release, Some(by), &[], now)
    }

    /// [`Engine::create_rollout_by`] knowing `unknown`: the accepted devices (in id order) the
    /// engine holds no state of. They are listed as excluded, in the reply and the trace, or
    /// the rollout is refused under `unknown_devices = "refuse"` (`planner::exclude_unknown`).
    pub fn create_rollout_knowing(
        &mut self,
        spec: RolloutSpec,
        release: ReleaseRef,
        by: &str,
        unknown: &[String],
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        self.create(spec, release, Some(by), unknown, now)
    }

    fn create(
        &mut self,
        spec: RolloutSpec,
        release: ReleaseRef,
        by: Option<&str>,
        unknown: &[String],
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        let name = spec.name.clone();
        if self.rollouts.contains_key(&name) {
            return Err(EngineError::AlreadyExists(name));
        }
        if spec.release != release.name {
            return Err(EngineError::ReleaseMismatch {
                rollout: name,
                spec_release: spec.release.clone(),
                release: release.name,
            });
        }
        let mut plan = planner::plan(&spec, &self.fleet(), &release.hardware, &self.device_groups)?;
        planner::exclude_unknown(&spec, &mut plan, unknown)?;
        self.create_planned(spec, release, plan, by, now)
    }

    /// Creates a rollout from an already computed plan.
    pub(crate) fn create_planned(
        &mut self,
        spec: RolloutSpec,
        release: ReleaseRef,
        plan: planner::Plan,
        by: Option<&str>,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        let name = spec.name.clone();
        let planned = plan.device_count();
        if planned == 0 && !spec.policies.dynamic {
            let selected = self
                .devices
                .values()
                .filter(|d| spec.select.matches(&d.labels))
                .count();
            let mut reason = format!(
                "{} devices known, {selected} match select {:?}",
                self.devices.len(),
                spec.select.to_string()
            );
            let unknown = plan
                .excluded
                .iter()
                .filter(|e| planner::is_unknown(e))
                .count();
            let by_hardware = plan.excluded.len() - unknown;
            if by_hardware > 0 {
                reason.push_str(&format!(
                    ", {by_hardware} excluded because release {} supports only hardware [{}]",
                    release.name,
                    release.hardware.join(", ")
                ));
            }
            if unknown > 0 {
                reason.push_str(&format!(
                    ", {unknown} accepted devices not planned: {}",
                    planner::NO_STATE
                ));
            }
            if !plan.unassigned.is_empty() {
                reason.push_str(&format!(", {} taken by no group", plan.unassigned.len()));
            }
            return Err(EngineError::NoDevices {
                rollout: name,
                reason,
            });
        }
        self.check_staged_overlap(&spec, &plan)?;
        let mut groups: Vec<Group> = plan.groups.into_iter().map(new_group).collect();
        self.check_approval_names(&name, &groups)?;
        if spec.policies.dynamic {
            let last = groups.last();
            let mut dynamic = new_group(crate::plan::PlannedGroup {
                name: "dynamic".into(),
                devices: Vec::new(),
                pace: Pace::default(),
                success: last.map(|g| g.success.clone()).unwrap_or_default(),
                error: last.and_then(|g| g.error.clone()),
                before: Gate::default(),
                after: Gate::default(),
            });
            dynamic.dynamic = true;
            groups.push(dynamic);
        }
        let sizes = groups
            .iter()
            .map(|g| format!("{} {}", g.name, g.devices.len()))
            .collect::<Vec<_>>()
            .join(", ");
        let ramp = spec.policies.rate.map(|limit| Ramp::new(limit, now));
        let mut rollout = Rollout {
            name: name.clone(),
            release,
            spec,
            created_at: now,
            state: RolloutState::Creating,
            groups,
            excluded: plan.excluded,
            unassigned: plan.unassigned,
            trace: Vec::new(),
            conditions: Vec::new(),
            approvals: Vec::new(),
            waiting: None,
            ramp,
            started_at: None,
            checked_at: now,
            rolled_back: false,
            seen: BTreeSet::new(),
            sites: BTreeMap::new(),
        };
        self.assign_sites(&mut rollout);
        if rollout.spec.policies.dynamic {
            rollout.seen = self.devices.keys().cloned().collect();
        }
        let mut out = Out::default();
        let operator = by;
        let by = by.map(|by| format!(" by {by}")).unwrap_or_default();
        let mut message = format!(
            "created{by} for release {}: {planned} devices in {} groups ({sizes})",
            rollout.release.name,
            rollout.groups.len()
        );
        let unknown = rollout
            .excluded
            .iter()
            .filter(|e| planner::is_unknown(e))
            .count();
        let by_hardware = rollout.excluded.len() - unknown;
        if by_hardware > 0 {
            message.push_str(&format!("; {by_hardware} excluded by hardware"));
        }
        if unknown > 0 {
            message.push_str(&format!(
                "; {unknown} accepted devices not planned: {}",
                planner::NO_STATE
            ));
        }
        if !rollout.unassigned.is_empty() {
            message.push_str(&format!(
                "; {} selected but in no group, not rolled out",
                rollout.unassigned.len()
            ));
        }
        let mut decision = Decision::new(TraceKind::Created, message);
        if let Some(by) = operator {
            decision = decision.by(by);
        }
        rollout.record(now, decision, &mut out);
        rollout.trace_unknown(now, &mut out);
        // hawkBit shows `creating` while the groups are filled: published before `ready`.
        out.snapshots.push(rollout.summary());
        rollout.set_condition("Initialized", true, "UpdateRunInitializedSuccessfully", now);
        rollout.state = RolloutState::Ready;
        self.rollouts
            .insert(name, Entry::new(rollout, &*self.zones));
        Ok(self.emit(out))
    }

    /// KubeFleet: concurrent staged runs over the same devices must use identical strategies.
    fn check_staged_overlap(
        &self,
        spec: &RolloutSpec,
        plan: &planner::Plan,
    ) -> Result<(), EngineError> {
        let Strategy::Staged(_) = &spec.strategy else {
            return Ok(());
        };
        let mine = spec.staged_stages();
        let devices: BTreeSet<&String> = plan.groups.iter().flat_map(|g| &g.devices).collect();
        for entry in self.rollouts.values() {
            let other = &entry.rollout;
            if other.state.is_terminal() || !matches!(other.spec.strategy, Strategy::Staged(_)) {
                continue;
            }
            let shared = entry.index.keys().filter(|d| devices.contains(d)).count();
            if shared > 0 && other.spec.staged_stages() != mine {
                return Err(EngineError::Conflict(format!(
                    "staged run {} cannot initialize: run {} ({}) covers {shared} of the same devices with a different strategy; concurrent runs over the same devices must use identical strategies",
                    spec.name, other.name, other.state
                )));
            }
        }
        Ok(())
    }

    /// Approval requests are found by name alone (`flotilla approve NAME`), so a rollout whose
    /// gates would share a name, with each other or with a rollout that has not ended, is
    /// refused, naming both gates. Group names may contain `-`, so `<rollout>-before-prod`
    /// can be the gate after stage `before-prod` as well as the gate before stage `prod`.
    fn check_approval_names(&self, rollout: &str, groups: &[Group]) -> Result<(), EngineError> {
        fn gates<'a>(
            rollout: &'a str,
            groups: &'a [Group],
        ) -> impl Iterator<Item = (String, String)> + 'a {
            groups.iter().flat_map(move |g| {
                let before = g.before.approval.then(|| {
                    (
                        before_approval(rollout, &g.name),
                        format!("the approval before group {} of rollout {rollout}", g.name),
                    )
                });
                let after = g.after.approval.then(|| {
                    (
                        after_approval(rollout, &g.name),
                        format!("the approval after group {} of rollout {rollout}", g.name),
                    )
                });
                before.into_iter().chain(after)
            })
        }
        let mut seen: BTreeMap<String, String> = BTreeMap::new();
        for entry in self.rollouts.values() {
            let other = &entry.rollout;
            if other.state.is_terminal() || other.name == rollout {
                continue;
            }
            seen.extend(gates(&other.name, &other.groups));
        }
        let mut mine: BTreeMap<String, String> = BTreeMap::new();
        for (name, what) in gates(rollout, groups) {
            if let Some(first) = mine.get(&name).or_else(|| seen.get(&name)) {
                return Err(EngineError::Conflict(format!(
                    "rollout {rollout}: {first} and {what} would both be named {name}; rename one of the groups (stages)"
                )));
            }
            mine.insert(name, what);
        }
        Ok(())
    }

    fn entry(&mut self, name: &str) -> Result<&mut Entry, EngineError> {
        self.rollouts
            .get_mut(name)
            .ok_or_else(|| EngineError::UnknownRollout(name.to_owned()))
    }

    fn invalid(r: &Rollout, command: &'static str) -> EngineError {
        EngineError::InvalidTransition {
            rollout: r.name.clone(),
            state: r.state,
            command,
        }
    }

    /// ready -> running (or scheduled until `start_at`): the first group starts. Scheduled
    /// actions of older rollouts on the same devices are canceled (hawkBit).
    pub fn start(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        self.start_by(name, OPERATOR, now)
    }

    /// [`Engine::start`] on behalf of `by`, whom the trace names.
    pub fn start_by(&mut self, name: &str, by: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        let r = &mut self.entry(name)?.rollout;
        if r.state != RolloutState::Ready {
            return Err(Self::invalid(r, "start"));
        }
        let mut out = Out::default();
        r.set_condition("Progressing", true, "UpdateRunStarted", now);
        match r.spec.policies.start_at {
            Some(at) if at > now => {
                r.state = RolloutState::Scheduled;
                let message = format!("started by {by}; waits for its start time {at}");
                r.record(
                    now,
                    Decision::new(TraceKind::Started, message).by(by),
                    &mut out,
                );
            }
            _ => {
                let message = format!("rollout started by {by}");
                r.record(
                    now,
                    Decision::new(TraceKind::Started, message).by(by),
                    &mut out,
                );
                r.starting(now, &mut out);
            }
        }
        self.cancel_older_scheduled(name, now, &mut out);
        self.advance(name, now, &mut out);
        Ok(self.emit(out))
    }

    /// hawkBit: a newer rollout cancels the older rollouts' scheduled (never sent) actions on
    /// the same devices, directly on the server.
    fn cancel_older_scheduled(&mut self, name: &str, now: u64, out: &mut Out) {
        let Some(entry) = self.rollouts.get(name) else {
            return;
        };
        let created = entry.rollout.created_at;
        let devices: Vec<String> = entry.index.keys().cloned().collect();
        let mut touched = Vec::new();
        for (other, e) in &mut self.rollouts {
            if other == name
                || !e.rollout.state.is_active() && e.rollout.state != RolloutState::Ready
            {
                continue;
            }
            if e.rollout.created_at > created {
                continue;
            }
            let mut canceled = 0;
            for device in &devices {
                let Some(&gi) = e.index.get(device) else {
                    continue;
                };
                let group = &mut e.rollout.groups[gi];
                if group.slots.get(device).map(|s| &s.phase) == Some(&DevicePhase::Scheduled) {
                    group.set_phase(device, DevicePhase::Canceled);
                    canceled += 1;
                }
            }
            if canceled > 0 {
                let message = format!("{canceled} scheduled device actions canceled: newer rollout {name} covers those devices");
                let decision = Decision::new(TraceKind::ActionsCanceled, message);
                e.rollout.record(now, decision, out);
                touched.push(other.clone());
            }
        }
        for other in touched {
            self.advance(&other, now, out);
        }
    }

    /// running -> paused: actions already sent continue and keep reporting; nothing new starts.
    pub fn pause(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        self.pause_by(name, OPERATOR, now)
    }

    /// [`Engine::pause`] on behalf of `by`, whom the trace names.
    pub fn pause_by(&mut self, name: &str, by: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        let r = &mut self.entry(name)?.rollout;
        if !matches!(r.state, RolloutState::Running | RolloutState::Scheduled) {
            return Err(Self::invalid(r, "pause"));
        }
        let mut out = Out::default();
        r.state = RolloutState::Paused;
        r.waiting = None;
        r.set_condition("Progressing", false, "UpdateRunPaused", now);
        let message = format!("paused by {by}");
        r.record(
            now,
            Decision::new(TraceKind::Paused, message).by(by),
            &mut out,
        );
        Ok(self.emit(out))
    }

    /// paused -> running. A group in error, or whose success action paused the rollout, counts
    /// as done: the operator chose to continue, so the group after it starts.
    pub fn resume(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        self.resume_by(name, OPERATOR, now)
    }

    /// [`Engine::resume`] on behalf of `by`, whom the trace names.
    pub fn resume_by(
        &mut self,
        name: &str,
        by: &str,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        let r = &mut self.entry(name)?.rollout;
        if r.state != RolloutState::Paused {
            return Err(Self::invalid(r, "resume"));
        }
        let mut out = Out::default();
        r.state = RolloutState::Running;
        r.set_condition("Progressing", true, "UpdateRunResumed", now);
        let mut passed = Vec::new();
        for g in &mut r.groups {
            if g.state == GroupState::Error && !g.released {
                g.released = true;
                passed.push(g.name.clone());
            }
        }
        let message = if passed.is_empty() {
            format!("resumed by {by}")
        } else {
            format!(
                "resumed by {by}; group {} in error counts as done",
                passed.join(", ")
            )
        };
        r.record(
            now,
            Decision::new(TraceKind::Resumed, message).by(by),
            &mut out,
        );
        // Resuming past a group in error is the operator's decision about that group, so its
        // after approval is given with it, in the operator's name, and the trace says so.
        for gi in 0..r.groups.len() {
            let g = &r.groups[gi];
            if g.after.approval && passed.contains(&g.name) {
                let approval = after_approval(&r.name, &g.name);
                r.grant(
                    &approval,
                    gi,
                    "after",
                    &format!("by {by} via resume"),
                    now,
                    &mut out,
                );
            }
        }
        self.advance(name, now, &mut out);
        Ok(self.emit(out))
    }

    /// Stops a rollout for good: no group starts again and every unfinished device ends by its
    /// phase (docs/operations.md): not started, canceled, or, past activation, left to finish
    /// on the new release and counted by its own report.
    pub fn stop(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        self.stop_by(name, OPERATOR, now)
    }

    /// [`Engine::stop`] on behalf of `by`, whom the trace names.
    pub fn stop_by(&mut self, name: &str, by: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        let r = &mut self.entry(name)?.rollout;
        if r.state.is_terminal() {
            return Err(Self::invalid(r, "stop"));
        }
        let mut out = Out::default();
        // Stopped first: a device ending now ends for good (no retry is scheduled).
        r.state = RolloutState::Stopped;
        let ended = r.cancel_unfinished(now, &mut out);
        r.waiting = None;
        r.set_condition("Progressing", false, "UpdateRunStopped", now);
        let release = r.release.name.clone();
        let message = format!("stopped by {by}; {}", ended.describe(&release));
        r.record(
            now,
            Decision::new(TraceKind::Stopped, message).by(by),
            &mut out,
        );
        self.apply_bookkeeping(now, &mut out);
        Ok(self.emit(out))
    }

    /// Approves an approval request by name; approving twice is harmless.
    pub fn approve(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        self.approve_by(name, OPERATOR, now)
    }

    /// [`Engine::approve`] on behalf of `by`, whom the trace names.
    pub fn approve_by(
        &mut self,
        name: &str,
        by: &str,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        // Names are unique among rollouts that have not ended (checked at create); an ended
        // rollout's approval of the same name is only history.
        let holders = || {
            self.rollouts
                .values()
                .filter(|e| e.rollout.approvals.iter().any(|a| a.name == name))
        };
        let rollout = holders()
            .find(|e| !e.rollout.state.is_terminal())
            .or_else(|| holders().next())
            .map(|e| e.rollout.name.clone())
            .ok_or_else(|| EngineError::UnknownApproval(name.to_owned()))?;
        let mut out = Out::default();
        let r = &mut self.entry(&rollout)?.rollout;
        let Some(a) = r.approvals.iter_mut().find(|a| a.name == name) else {
            return Err(EngineError::UnknownApproval(name.to_owned()));
        };
        if a.approved {
            return Ok(Vec::new());
        }
        if r.state.is_terminal() {
            return Err(EngineError::Conflict(format!(
                "approval {name} was withdrawn: rollout {rollout} is {}, so approving it would do \
                 nothing",
                r.state
            )));
        }
        let Some(a) = r.approvals.iter_mut().find(|a| a.name == name) else {
            return Err(EngineError::UnknownApproval(name.to_owned()));
        };
        a.approved = true;
        a.approved_at = Some(now);
        let approval = a.clone();
        let gname = approval.group.clone();
        if let Some(g) = r.groups.iter_mut().find(|g| g.name == approval.group) {
            g.condition(
                "ApprovalRequestApproved",
                true,
                "AfterStageTaskApprovalRequestApproved",
                now,
            );
        }
        out.commands.push(Effect::Approval(approval));
        let message = format!("approval {name} approved by {by}");
        let decision = Decision::new(TraceKind::Approved, message).by(by);
        r.record(now, decision.group(&gname), &mut out);
        self.advance(&rollout, now, &mut out);
        Ok(self.emit(out))
    }

    /// Every approval request, pending and approved.
    pub fn approvals(&self) -> Vec<ApprovalStatus> {
        self.rollouts
            .values()
            .flat_map(|e| e.rollout.approval_views())
            .collect()
    }

    /// Starts the next group of a running rollout now (hawkBit's manual trigger): the last
    /// started group is released without waiting for its success condition or its timed wait.
    /// An approval in the way (after the last started group, or before the group that would
    /// start) refuses, naming it; see [`Engine::trigger_next_with`].
    pub fn trigger_next(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        self.trigger_next_by(name, OPERATOR, now)
    }

    /// [`Engine::trigger_next`] on behalf of `by`, whom the trace names.
    pub fn trigger_next_by(
        &mut self,
        name: &str,
        by: &str,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        self.trigger_next_with(name, by, false, now)
    }

    /// [`Engine::trigger_next_by`]; with `skip_approval` (`rollout next --skip-approval`) the
    /// approvals in the way are given in `by`'s name, and the trace says so ("approval r-canary
    /// given by alice via next").
    pub fn trigger_next_with(
        &mut self,
        name: &str,
        by: &str,
        skip_approval: bool,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        let r = &mut self.entry(name)?.rollout;
        if r.state != RolloutState::Running {
            return Err(Self::invalid(r, "trigger the next group of"));
        }
        let Some(last) = r
            .groups
            .iter()
            .rposition(|g| g.state != GroupState::Scheduled)
        else {
            return Err(Self::invalid(r, "trigger the next group of"));
        };
        let how = format!("by {by} via next (--skip-approval)");
        let mut out = Out::default();
        let gname = r.groups[last].name.clone();
        if r.groups[last].state == GroupState::Approval {
            // The group to start next is this one: only its own approval holds it.
            let approval = before_approval(&r.name, &gname);
            if !skip_approval {
                return Err(EngineError::Conflict(format!(
                    "rollout {name}: group {gname} is the next group and waits for approval {approval}; approve it (flotilla approve {approval}) or pass --skip-approval"
                )));
            }
            r.grant(&approval, last, "before", &how, now, &mut out);
            self.advance(name, now, &mut out);
            return Ok(self.emit(out));
        }
        if last + 1 >= r.groups.len() || r.groups[last + 1].dynamic {
            return Err(EngineError::Conflict(format!(
                "rollout {name}: every group has started (the last, {gname}, is {}); there is no next group to start",
                r.groups[last].state
            )));
        }
        if r.groups[last].after.approval && !r.groups[last].released {
            let approval = after_approval(&r.name, &gname);
            if !r.approved(&approval) {
                if !skip_approval {
                    let requested = if r.approvals.iter().any(|a| a.name == approval) {
                        "is pending"
                    } else {
                        "is requested when the group succeeds"
                    };
                    return Err(EngineError::Conflict(format!(
                        "rollout {name}: group {} starts only after approval {approval}, which {requested}; approve it (flotilla approve {approval}) or pass --skip-approval",
                        r.groups[last + 1].name
                    )));
                }
                r.grant(&approval, last, "after", &how, now, &mut out);
            }
        }
        let next = last + 1;
        if skip_approval && r.groups[next].before.approval {
            let approval = before_approval(&r.name, &r.groups[next].name);
            r.grant(&approval, next, "before", &how, now, &mut out);
        }
        r.groups[last].released = true;
        let message = format!("{by} triggered the next group after group {gname}");
        let decision = Decision::new(TraceKind::NextTriggered, message).by(by);
        r.record(now, decision.group(&gname), &mut out);
        self.advance(name, now, &mut out);
        Ok(self.emit(out))
    }

    /// Creates a rollout (ready, not started) over the failed, refused and timed-out devices of
    /// another, named `<rollout>-retry` unless a name is given.
    pub fn retry_failed(
        &mut self,
        name: &str,
        new_name: Option<String>,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        self.retry_failed_by(name, new_name, OPERATOR, now)
    }

    /// [`Engine::retry_failed`] on behalf of `by`, whom the trace names.
    pub fn retry_failed_by(
        &mut self,
        name: &str,
        new_name: Option<String>,
        by: &str,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        let r = &self
            .rollouts
            .get(name)
            .ok_or_else(|| EngineError::UnknownRollout(name.to_owned()))?
            .rollout;
        if !matches!(
            r.state,
            RolloutState::Paused
                | RolloutState::Finished
                | RolloutState::Stopped
                | RolloutState::Failed
        ) {
            return Err(Self::invalid(r, "retry the failed devices of"));
        }
        // Same settings: every group that had failures keeps its name, pace, conditions and
        // gates, over its failed devices; each device's attempts go on counting.
        let mut groups = Vec::new();
        let mut failed = 0;
        for g in &r.groups {
            let devices: Vec<String> = g
                .devices
                .iter()
                .filter(|d| g.slots.get(*d).is_some_and(|s| s.phase.is_failure()))
                .cloned()
                .collect();
            if devices.is_empty() {
                continue;
            }
            failed += devices.len();
            let mut group = new_group(crate::plan::PlannedGroup {
                name: g.name.clone(),
                devices,
                pace: g.pace,
                success: g.success.clone(),
                error: g.error.clone(),
                before: g.before,
                after: g.after,
            });
            for (device, slot) in &mut group.slots {
                if let Some(old) = g.slots.get(device) {
                    slot.earlier_attempts = old.earlier_attempts + old.attempt;
                }
            }
            groups.push(group);
        }
        let new_name = new_name.unwrap_or_else(|| format!("{name}-retry"));
        flotilla_protocol::validate_id("rollout name", &new_name)
            .map_err(|e| EngineError::Conflict(e.to_string()))?;
        if failed == 0 {
            return Err(EngineError::NoDevices {
                rollout: new_name,
                reason: format!("rollout {name} has no failed, refused or timed-out device"),
            });
        }
        if self.rollouts.contains_key(&new_name) {
            return Err(EngineError::AlreadyExists(new_name));
        }
        self.check_approval_names(&new_name, &groups)?;
        let r = &self.rollouts[name].rollout;
        let mut spec = r.spec.clone();
        spec.name = new_name.clone();
        spec.policies.start_at = None;
        spec.policies.dynamic = false;
        let release = r.release.clone();
        let mut rollout = Rollout {
            name: new_name.clone(),
            release,
            ramp: spec.policies.rate.map(|limit| Ramp::new(limit, now)),
            spec,
            created_at: now,
            state: RolloutState::Ready,
            groups,
            excluded: Vec::new(),
            unassigned: Vec::new(),
            trace: Vec::new(),
            conditions: Vec::new(),
            approvals: Vec::new(),
            waiting: None,
            started_at: None,
            checked_at: now,
            rolled_back: false,
            seen: BTreeSet::new(),
            sites: BTreeMap::new(),
        };
        self.assign_sites(&mut rollout);
        let mut out = Out::default();
        rollout.set_condition("Initialized", true, "UpdateRunInitializedSuccessfully", now);
        let message =
            format!("created by {by} to retry the {failed} failed devices of rollout {name}");
        let decision = Decision::new(TraceKind::RetryCreated, message).by(by);
        rollout.record(now, decision, &mut out);
        self.rollouts
            .insert(new_name, Entry::new(rollout, &*self.zones));
        Ok(self.emit(out))
    }

    /// Forgets a device: it leaves the registry. As in hawkBit, it leaves a running group at
    /// once (counts are recomputed; an emptied group succeeds); in a group that has not started
    /// it shows as `not_started` and leaves when the group starts; in a finished group (or a
    /// rollout that is over) it shows as `not_started` and the counts stay.
    pub fn delete_device(&mut self, device: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        self.delete_device_by(device, OPERATOR, now)
    }

    /// [`Engine::delete_device`] on behalf of `by`, whom the trace names.
    pub fn delete_device_by(
        &mut self,
        device: &str,
        by: &str,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        if self.devices.remove(device).is_none() {
            return Err(EngineError::UnknownDevice(device.to_owned()));
        }
        self.offline.remove(device);
        self.owners.remove(device);
        self.last_seq.remove(device);
        let mut out = Out::default();
        let mut touched = Vec::new();
        let mut cancels = Vec::new();
        for (name, entry) in &mut self.rollouts {
            // Deleted, it is forgotten: if it registers again it is a new device.
            if entry.rollout.seen.remove(device) && !out.save.contains(name) {
                out.save.push(name.clone());
            }
            let Some(&gi) = entry.index.get(device) else {
                continue;
            };
            let terminal = entry.rollout.state.is_terminal();
            let group = &mut entry.rollout.groups[gi];
            // hawkBit: in a group that has not started, or has finished, the device moves to
            // "not started"; the counts change only when a not-started group starts.
            let kept = match group.state {
                _ if terminal => Some("the rollout is over"),
                GroupState::Scheduled | GroupState::Approval => {
                    Some("it leaves the group when the group starts")
                }
                GroupState::Waiting | GroupState::Finished | GroupState::Error => {
                    Some("the group is done and keeps its counts")
                }
                GroupState::Running => None,
            };
            if let Some(why) = kept {
                let Some(slot) = group.slots.get_mut(device).filter(|s| !s.deleted) else {
                    continue;
                };
                slot.deleted = true;
                // A device still acting on this rollout's action (a group that is done may have
                // some) is told to stop, as in a running group.
                cancels.extend(deleted_cancel(name, entry.rollout.created_at, device, slot));
                let gname = group.name.clone();
                let message =
                    format!("device {device} deleted by {by}; not started in group {gname}: {why}");
                let decision = Decision::new(TraceKind::DeviceDeleted, message).by(by);
                entry
                    .rollout
                    .record(now, decision.group(&gname).device(device), &mut out);
                continue;
            }
            let mut canceled = false;
            group.uncount_site(device);
            if let Some(slot) = group.slots.remove(device) {
                slot.phase.count_in(&mut group.counts, false);
                group.counts.total = group.counts.total.saturating_sub(1);
                // A device that is still acting on this rollout's action is told to stop: a
                // deleted device must not go on to install (past activation it cannot stop).
                if let Some(cancel) = deleted_cancel(name, entry.rollout.created_at, device, &slot)
                {
                    cancels.push(cancel);
                    canceled = true;
                }
            }
            if let Some(pos) = group.devices.iter().position(|d| d == device) {
                group.devices.remove(pos);
                if pos < group.cursor {
                    group.cursor -= 1;
                }
                // Positions moved: the queues are rebuilt at the next fill.
                group.cache.queues = None;
            }
            entry.index.remove(device);
            let gname = group.name.clone();
            let action = if canceled {
                "; its action was canceled"
            } else {
                ""
            };
            let message = format!(
                "device {device} deleted by {by}{action}; group {gname} now has {} devices",
                { entry.rollout.groups[gi].devices.len() }
            );
            let decision = Decision::new(TraceKind::DeviceDeleted, message).by(by);
            entry
                .rollout
                .record(now, decision.group(&gname).device(device), &mut out);
            touched.push(name.clone());
        }
        // The cancel goes out after the forget's "nothing to do", so it is what the retained
        // desired topic keeps: an agent that comes back later still stops the action.
        out.commands.push(Effect::Forget {
            device: device.to_owned(),
        });
        out.commands.extend(cancels);
        for name in touched {
            self.advance(&name, now, &mut out);
        }
        Ok(self.emit(out))
    }

    /// Timers: start times, soak, retries, timeouts, offline grace, timed waits, windows and
    /// the rate limit; then one `Save` and `Status` per rollout whose devices changed since the
    /// last tick. Call it about once a second.
    pub fn tick(&mut self, now: u64) -> Vec<Effect> {
        let mut out = Out::default();
        // Ended rollouts too while a device past activation has not finished: it may time out.
        let names: Vec<String> = self
            .rollouts
            .iter()
            .filter(|(_, e)| e.rollout.state.is_active() || e.rollout.in_flight())
            .map(|(n, _)| n.clone())
            .collect();
        for name in names {
            let Some(entry) = self.rollouts.get_mut(&name) else {
                continue;
            };
            let ctx = Ctx {
                offline: &self.offline,
                owners: &self.owners,
                windows: &entry.windows,
            };
            if entry.rollout.run_timers(now, &ctx, &mut out) {
                self.dirty.insert(name.clone());
            }
            self.apply_bookkeeping(now, &mut out);
            self.advance(&name, now, &mut out);
        }
        for name in std::mem::take(&mut self.dirty) {
            if self.rollouts.contains_key(&name) {
                out.touch(&name);
            }
        }
        self.emit(out)
    }

    /// The earliest time at which [`Engine::tick`] has a timer to act on (a start time, a timed
    /// wait, a timeout, a retry, the end of a soak, a window opening, the rate limit), so a
    /// simulator can jump to it.
    pub fn next_timer(&self) -> Option<u64> {
        self.rollouts
            .values()
            .filter_map(|e| {
                let ctx = Ctx {
                    offline: &self.offline,
                    owners: &self.owners,
                    windows: &e.windows,
                };
                e.rollout.next_timer(&ctx)
            })
            .min()
    }

    /// Replaces the named device groups (`flotilla group`) that specs may refer to.
    pub fn set_device_groups(&mut self, groups: Vec<DeviceGroup>) {
        self.device_groups = groups;
    }

    /// The time window the current attempt of `device` in `rollout` carries to the agent: the
    /// maintenance window it was sent in, in UTC (`window::install_window`). None when the
    /// rollout has no windows or the device has no attempt.
    pub fn install_window(&self, rollout: &str, device: &str) -> Option<TimeWindow> {
        let entry = self.rollouts.get(rollout)?;
        let gi = *entry.index.get(device)?;
        let at = entry
            .rollout
            .groups
            .get(gi)?
            .slots
            .get(device)?
            .attempt_at?;
        crate::window::install_window(&entry.windows, at)
    }

    pub fn rollout(&self, name: &str) -> Option<&Rollout> {
        self.rollouts.get(name).map(|e| &e.rollout)
    }

    pub fn rollouts(&self) -> impl Iterator<Item = &Rollout> {
        self.rollouts.values().map(|e| &e.rollout)
    }

    /// A rollout's full status: every device's phase and detail, the whole trace. It grows
    /// with the rollout; what is published or sent in one message is [`Engine::summary`].
    pub fn status(&self, name: &str) -> Option<RolloutStatus> {
        self.rollout(name).map(|r| self.with_summary(r, r.status()))
    }

    pub fn statuses(&self) -> Vec<RolloutStatus> {
        self.rollouts()
            .map(|r| self.with_summary(r, r.status()))
            .collect()
    }

    /// A rollout's status without per-device detail: counts, per-group summaries, conditions,
    /// approvals and the newest [`SUMMARY_TRACE`] decisions. Its size does not depend on how
    /// many devices the rollout has (the retained rollout event and command replies).
    pub fn summary(&self, name: &str) -> Option<RolloutStatus> {
        self.rollout(name)
            .map(|r| self.with_summary(r, r.summary()))
    }

    /// [`Engine::summary`] of every rollout after `after` in name order.
    pub fn summaries_after<'a>(
        &'a self,
        after: Option<&str>,
    ) -> impl Iterator<Item = RolloutStatus> + 'a {
        let start = match after {
            Some(a) => Bound::Excluded(a.to_owned()),
            None => Bound::Unbounded,
        };
        self.rollouts
            .range((start, Bound::Unbounded))
            .map(|(_, e)| self.with_summary(&e.rollout, e.rollout.summary()))
    }

    /// The devices of rollout `name` after `after`, in id order across its groups, each with
    /// its group and detail; `None` when there is no such rollout.
    pub fn rollout_devices<'a>(
        &'a self,
        name: &str,
        after: Option<&str>,
    ) -> Option<impl Iterator<Item = RolloutDevice> + 'a> {
        let rollout = self.rollout(name)?;
        let start = || match after {
            Some(a) => Bound::Excluded(a.to_owned()),
            None => Bound::Unbounded,
        };
        let mut groups: Vec<_> = rollout
            .groups
            .iter()
            .map(|g| (g, g.slots.range((start(), Bound::Unbounded)).peekable()))
            .collect();
        // A merge of the groups' sorted slots: a device is in one group of a rollout.
        Some(std::iter::from_fn(move || {
            let (gi, _) = groups
                .iter_mut()
                .enumerate()
                .filter_map(|(i, (_, slots))| slots.peek().map(|(d, _)| (i, (*d).clone())))
                .min_by(|a, b| a.1.cmp(&b.1))?;
            let (group, slots) = &mut groups[gi];
            let (device, slot) = slots.next()?;
            Some(RolloutDevice {
                id: device.clone(),
                group: group.name.clone(),
                detail: rollout.device_detail(slot),
            })
        }))
    }

    /// The labels of a device the engine knows.
    pub fn device_labels(&self, device: &str) -> Option<&dyn Labels> {
        self.devices.get(device).map(|d| &d.labels as &dyn Labels)
    }

    /// A rollout's status with what only the registry knows: Fleet's per-group summary of
    /// Pending, OutOfSync, NotReady and Ready devices.
    fn with_summary(&self, r: &Rollout, mut status: RolloutStatus) -> RolloutStatus {
        for (g, gs) in r.groups.iter().zip(status.groups.iter_mut()) {
            let mut summary = BTreeMap::new();
            for (device, slot) in &g.slots {
                let state = match &slot.phase {
                    DevicePhase::Scheduled => {
                        let installed = self
                            .devices
                            .get(device)
                            .is_some_and(|d| d.installed.is_some());
                        if installed {
                            "OutOfSync"
                        } else {
                            "Pending"
                        }
                    }
                    DevicePhase::Ready => "Ready",
                    DevicePhase::Canceled | DevicePhase::Skipped(_) | DevicePhase::RolledBack => {
                        continue
                    }
                    _ => "NotReady",
                };
                *summary.entry(state.to_owned()).or_insert(0) += 1;
            }
            gs.summary = summary;
        }
        status
    }

    /// The releases `device` was sent a desired action for that it may still act on: its live
    /// slots in active rollouts (in progress, soaking or retrying). The artifact server serves
    /// a device only the artifacts of these releases.
    pub fn device_releases(&self, device: &str) -> Vec<&str> {
        self.rollouts
            .values()
            .filter(|e| e.rollout.state.is_active())
            .filter_map(|e| {
                let gi = *e.index.get(device)?;
                let slot = e.rollout.groups.get(gi)?.slots.get(device)?;
                slot.phase
                    .is_live()
                    .then_some(e.rollout.release.name.as_str())
            })
            .collect()
    }

    /// How many devices are known from their retained state.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Every device known from its retained state, sorted by id.
    pub fn devices(&self) -> Vec<DeviceSummary> {
        self.devices_after(None).collect()
    }

    /// The devices known from their retained state after `after`, in id order.
    pub fn devices_after<'a>(
        &'a self,
        after: Option<&str>,
    ) -> impl Iterator<Item = DeviceSummary> + 'a {
        let start = match after {
            Some(a) => Bound::Excluded(a.to_owned()),
            None => Bound::Unbounded,
        };
        self.devices
            .range((start, Bound::Unbounded))
            .map(|(id, d)| DeviceSummary {
                id: id.clone(),
                hardware_id: d.hardware_id.to_string(),
                labels: d
                    .labels
                    .0
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                online: d.online,
                installed: d.installed.as_deref().map(str::to_owned),
                rollout: d.rollout.as_deref().map(str::to_owned),
                phase: d.phase.map(str::to_owned),
                reason: d.reason.clone(),
                enrollment: None,
            })
    }
}

/// Whether the device is being sent back to the release it kept.
fn is_rolling_back(phase: &DevicePhase) -> bool {
    matches!(phase, DevicePhase::InProgress(p) if p == model::ROLLING_BACK)
}

/// A device's site in rollout `r`: its value of the site policy's label, if it has one.
fn site_of(r: &Rollout, labels: &LabelList) -> Option<String> {
    let policy = r.spec.policies.sites.as_ref()?;
    labels.label(&policy.label).map(str::to_owned)
}

impl Engine {
    /// Records every planned device's site from the labels the registry holds now.
    fn assign_sites(&self, rollout: &mut Rollout) {
        let Some(policy) = rollout.spec.policies.sites.as_ref() else {
            return;
        };
        for g in &mut rollout.groups {
            for (device, slot) in &mut g.slots {
                slot.site = self
                    .devices
                    .get(device)
                    .and_then(|d| d.labels.label(&policy.label))
                    .map(str::to_owned);
            }
        }
    }
}

fn new_group(g: crate::plan::PlannedGroup) -> Group {
    Group {
        counts: GroupCounts {
            total: g.devices.len(),
            scheduled: g.devices.len(),
            ..GroupCounts::default()
        },
        slots: g
            .devices
            .iter()
            .map(|d| (d.clone(), Slot::scheduled()))
            .collect(),
        name: g.name,
        state: GroupState::Scheduled,
        devices: g.devices,
        pace: g.pace,
        success: g.success,
        error: g.error,
        before: g.before,
        after: g.after,
        cursor: 0,
        released: false,
        started_at: None,
        ended_at: None,
        succeeded_at: None,
        conditions: Vec::new(),
        dynamic: false,
        cache: Default::default(),
    }
}

impl Rollout {
    /// The rollout as operators see it, every device and decision included.
    pub fn status(&self) -> RolloutStatus {
        let mut status = self.summary();
        status.trace = self.trace.clone();
        status.sites = self.site_statuses(None);
        for (g, gs) in self.groups.iter().zip(status.groups.iter_mut()) {
            gs.devices = g
                .slots
                .iter()
                .map(|(d, s)| (d.clone(), s.phase_name().to_owned()))
                .collect();
            gs.device_details = g
                .slots
                .iter()
                .map(|(d, s)| (d.clone(), self.device_detail(s)))
                .collect();
        }
        status
    }

    /// One device's detail in this rollout.
    fn device_detail(&self, s: &Slot) -> DeviceDetail {
        DeviceDetail {
            phase: s.phase_name().to_owned(),
            started_at: s.started_at,
            ended_at: s.ended_at,
            reason: s.phase.reason().map(str::to_owned),
            attempt: s.earlier_attempts + s.attempt,
            conditions: self.device_conditions(s),
        }
    }

    /// The rollout without per-device detail and with the newest [`SUMMARY_TRACE`] decisions:
    /// what the retained rollout event carries.
    /// The approval requests as operators see them: one not given before the rollout ended is
    /// withdrawn.
    pub fn approval_views(&self) -> Vec<ApprovalStatus> {
        let ended = self.state.is_terminal();
        self.approvals
            .iter()
            .map(|a| ApprovalStatus {
                withdrawn: ended && !a.approved,
                ..a.clone()
            })
            .collect()
    }

    pub fn summary(&self) -> RolloutStatus {
        let skip = self.trace.len().saturating_sub(SUMMARY_TRACE);
        RolloutStatus {
            name: self.name.clone(),
            release: self.release.name.clone(),
            state: self.state.to_string(),
            groups: self
                .groups
                .iter()
                .map(|g| GroupStatus {
                    name: g.name.clone(),
                    state: g.state.to_string(),
                    total: g.counts.effective_total(),
                    ready: g.counts.ready,
                    failed: g.counts.failures(),
                    in_progress: g.counts.in_progress + g.counts.soaking,
                    scheduled: g.counts.scheduled,
                    canceled: g.counts.canceled,
                    devices: BTreeMap::new(),
                    started_at: g.started_at,
                    ended_at: g.ended_at,
                    conditions: g.conditions.clone(),
                    device_details: BTreeMap::new(),
                    summary: BTreeMap::new(),
                })
                .collect(),
            trace: self.trace[skip..].to_vec(),
            strategy: self.spec.vocabulary().to_owned(),
            conditions: self.conditions.clone(),
            waiting: self.waiting.clone(),
            approvals: self.approval_views(),
            strategy_snapshot: self.strategy_snapshot(),
            deletion_stage: self.deletion_stage(),
            bytes: self.bytes_total(),
            sites: self.site_statuses(Some(SUMMARY_SITES)),
            site_count: self.site_names().len(),
            excluded: self
                .excluded
                .iter()
                .take(SUMMARY_EXCLUDED)
                .map(|e| ExcludedDevice {
                    device: e.device.clone(),
                    reason: e.reason.clone(),
                })
                .collect(),
            excluded_count: self.excluded.len(),
        }
    }

    /// Every device of the rollout with its phase name.
    pub fn device_phases(&self) -> BTreeMap<String, String> {
        self.groups
            .iter()
            .flat_map(|g| {
                g.slots
                    .iter()
                    .map(|(d, s)| (d.clone(), s.phase_name().to_owned()))
            })
            .collect()
    }
}

/// The cancel a deleted device gets when it is still acting on this rollout's action (past
/// activation the agent ignores it and finishes, and its report says so).
fn deleted_cancel(rollout: &str, created_at: u64, device: &str, slot: &Slot) -> Option<Effect> {
    matches!(&slot.phase, DevicePhase::InProgress(p) if p != model::ROLLING_BACK).then(|| {
        Effect::Cancel {
            device: device.to_owned(),
            action_id: attempt_action_id(rollout, created_at, device, slot.attempt),
            rollout: rollout.to_owned(),
        }
    })
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_commands;
#[cfg(test)]
mod tests_excluded;
#[cfg(test)]
mod tests_features;
#[cfg(test)]
mod tests_owed;
#[cfg(test)]
mod tests_property;
#[cfg(test)]
mod tests_reference;
#[cfg(test)]
mod tests_sites;
