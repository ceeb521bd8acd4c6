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
mod commands;
mod create;
mod ended;
mod excluded;
mod fill;
pub mod model;
mod names;
mod outcome;
mod owed;
mod queries;
mod queues;
mod sites;
mod status;
mod timers;
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
    /// A rollout was deleted: remove its record and clear its retained summary and approval
    /// requests.
    Deleted {
        rollout: String,
        approvals: Vec<String>,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("no rollout named {0:?}")]
    UnknownRollout(String),
    #[error("a rollout named {0:?} already exists")]
    AlreadyExists(String),
    #[error(
        "rollout {rollout} {}; cannot {command} it",
        crate::text::is_state(state)
    )]
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
    /// Who decides, stamped on every trace entry ([`Engine::set_decider`]).
    decider: Option<String>,
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
            decider: None,
        }
    }

    /// Names the coordinator that decides from now on: every trace entry records it, so a
    /// rollout's trace says which of several coordinators sharing a store decided what.
    /// `None` (the default) for a coordinator that is alone.
    pub fn set_decider(&mut self, decider: Option<String>) {
        self.decider = decider;
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
        // An offline state that names no release is an agent's last will, written when it
        // connected: the device still runs what it ran, which this engine knew, or which the
        // stored rollouts say it last became ready on.
        let installed = match &state.installed {
            Some(i) => Some(self.names.get(&i.name)),
            None if !state.online => {
                let known = self
                    .devices
                    .get(&state.device_id)
                    .and_then(|d| d.installed.clone());
                let ready = || self.last_ready_release(&state.device_id).map(str::to_owned);
                match known.map(|k| k.to_string()).or_else(ready) {
                    Some(name) => Some(self.names.get(&name)),
                    None => None,
                }
            }
            None => None,
        };
        let record = DeviceRecord {
            hardware_id: self.names.get(&state.hardware_id),
            labels: LabelList::new(state.labels, &mut self.names),
            online: state.online,
            installed,
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
