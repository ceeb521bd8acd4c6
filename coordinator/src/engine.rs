//! The rollout engine: a sans-I/O state machine (docs/decisions/0003-coordinator-engine.md).
//!
//! Every input is a method call that takes `now` (Unix seconds) and returns [`Effect`]s for the
//! service to apply in order: `Save` (persist the rollout), then `Desired`/`Cancel` (sign and
//! publish), then `Status` and `Trace` (integration events). Nothing here reads a clock, touches a
//! socket or the disk, so the same engine runs the service, the simulator and the tests.
//!
//! ```text
//! rollout:  creating -> ready -> starting -> running <-> paused
//!                                            |   \        |
//!                                            |    `-> finished
//!                                            `-> stopped <-'     (stop from any non-terminal state)
//! group:    scheduled -> running -> finished | error
//! device:   scheduled -> in progress (issued, accepted, …) -> ready | failed | refused | canceled
//! ```
//!
//! A group starts when the previous group's success condition holds and its action is `next`.
//! Its error condition (failed share strictly above the threshold) pauses the rollout; a group
//! whose devices all ended without reaching the success threshold pauses it too, because the
//! rollout could otherwise never move on. Resuming treats a group in error as done.
//!
//! Scale: a report is routed through a per-rollout index (device -> group) and updates that
//! group's counters incrementally; only that group is evaluated. Per-device changes do not emit
//! `Save`/`Status` (serializing a 100,000-device rollout per report would be O(fleet));
//! instead the rollout is marked dirty and [`Engine::tick`] emits one `Save` and one `Status`
//! per dirty rollout. Transitions (a group starting, a pause, the end) emit them at once.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

use flotilla_protocol::control::{DeviceSummary, GroupStatus, RolloutStatus, TraceEntry};
use flotilla_protocol::{DeviceState, Phase, Report};
use serde::{Deserialize, Serialize};

use crate::conditions::{error_met, success_met, GroupCounts};
use crate::plan::{ActionType, ErrorCondition, Excluded, SuccessAction, SuccessCondition};
use crate::planner::{self, DeviceGroup, FleetDevice, PlanError};
use crate::spec::{RolloutSpec, SpecError};

/// How many trace entries a rollout keeps; older ones are dropped (they also went to `events/log`).
pub const TRACE_LIMIT: usize = 1000;

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
    Starting,
    Running,
    Paused,
    Stopped,
    Finished,
}

impl fmt::Display for RolloutState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RolloutState::Creating => "creating",
            RolloutState::Ready => "ready",
            RolloutState::Starting => "starting",
            RolloutState::Running => "running",
            RolloutState::Paused => "paused",
            RolloutState::Stopped => "stopped",
            RolloutState::Finished => "finished",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupState {
    Scheduled,
    Running,
    Finished,
    Error,
}

impl fmt::Display for GroupState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GroupState::Scheduled => "scheduled",
            GroupState::Running => "running",
            GroupState::Finished => "finished",
            GroupState::Error => "error",
        })
    }
}

/// Where one device stands in one rollout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DevicePhase {
    /// In a group that has not started: no desired action sent yet.
    Scheduled,
    /// Desired action sent; the protocol phase name, or `issued` before the first report.
    InProgress(String),
    Ready,
    Failed(String),
    Refused(String),
    Canceled,
}

/// Phase name of a device whose desired action was sent but that has not reported yet.
pub const ISSUED: &str = "issued";

impl DevicePhase {
    /// The engine's view of a reported protocol phase. A download-only action that ends in
    /// `downloaded` did what it was asked, so it counts as ready.
    pub fn from_phase(phase: &Phase) -> Self {
        match phase {
            Phase::Ready | Phase::Downloaded => DevicePhase::Ready,
            Phase::Failed {
                reason,
                rolled_back: true,
            } => DevicePhase::Failed(format!("{reason} (rolled back)")),
            Phase::Failed {
                reason,
                rolled_back: false,
            } => DevicePhase::Failed(reason.clone()),
            Phase::Refused { reason } => DevicePhase::Refused(reason.clone()),
            Phase::Canceled => DevicePhase::Canceled,
            other => DevicePhase::InProgress(other.name().to_owned()),
        }
    }

    /// Lower-case name as shown in status tables.
    pub fn name(&self) -> &str {
        match self {
            DevicePhase::Scheduled => "scheduled",
            DevicePhase::InProgress(name) => name,
            DevicePhase::Ready => "ready",
            DevicePhase::Failed(_) => "failed",
            DevicePhase::Refused(_) => "refused",
            DevicePhase::Canceled => "canceled",
        }
    }

    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            DevicePhase::Ready
                | DevicePhase::Failed(_)
                | DevicePhase::Refused(_)
                | DevicePhase::Canceled
        )
    }

    fn count_in(&self, counts: &mut GroupCounts, add: bool) {
        let slot = match self {
            DevicePhase::Scheduled => &mut counts.scheduled,
            DevicePhase::InProgress(_) => &mut counts.in_progress,
            DevicePhase::Ready => &mut counts.ready,
            DevicePhase::Failed(_) | DevicePhase::Refused(_) => &mut counts.failed,
            DevicePhase::Canceled => &mut counts.canceled,
        };
        if add {
            *slot += 1;
        } else {
            *slot = slot.saturating_sub(1);
        }
    }
}

/// A rollout as stored: its spec, its groups with every device's phase, and its trace.
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
    /// The last [`TRACE_LIMIT`] decisions, oldest first.
    pub trace: Vec<TraceEntry>,
}

/// One deployment group of a rollout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Group {
    pub name: String,
    pub state: GroupState,
    /// Sorted by id.
    pub devices: Vec<String>,
    pub success: SuccessCondition,
    pub error: Option<ErrorCondition>,
    /// Kept equal to a count over `phases`, updated per change rather than recomputed.
    pub counts: GroupCounts,
    pub phases: BTreeMap<String, DevicePhase>,
    /// The group's success action ran, or an operator resumed past its error: it will not
    /// start another group again.
    pub success_action_done: bool,
}

impl Group {
    /// Sets a device's phase and keeps the counters right; false when nothing changed.
    fn set_phase(&mut self, device: &str, new: DevicePhase) -> bool {
        let Some(slot) = self.phases.get_mut(device) else {
            return false;
        };
        if *slot == new {
            return false;
        }
        slot.count_in(&mut self.counts, false);
        new.count_in(&mut self.counts, true);
        *slot = new;
        true
    }
}

/// What the service must do, in this order: persist, publish desired actions, publish events.
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
    Approval(flotilla_protocol::control::ApprovalStatus),
    /// Clear a deleted device's retained topics (desired and state).
    Forget { device: String },
    /// Publish (retained) a cancel of this action.
    Cancel {
        device: String,
        action_id: String,
        rollout: String,
    },
    /// Publish the rollout's summary (read it with [`Engine::status`]).
    Status(String),
    /// Publish one decision to `events/log`.
    Trace(TraceEntry),
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

/// The action id of a device in a rollout: `{rollout}@{created_at}:{device}`. Including
/// `created_at` keeps a re-created rollout of the same name from colliding with an old one, since
/// an agent never applies an action id twice.
pub fn action_id(rollout: &str, created_at: u64, device: &str) -> String {
    format!("{rollout}@{created_at}:{device}")
}

/// Splits an action id made by [`action_id`] into (rollout, created_at, device). Rollout names and
/// device ids cannot contain `@` or `:`, so the split is unambiguous.
pub fn parse_action_id(id: &str) -> Option<(&str, u64, &str)> {
    let (rollout, rest) = id.split_once('@')?;
    let (created_at, device) = rest.split_once(':')?;
    Some((rollout, created_at.parse().ok()?, device))
}

/// Effects collected during one call, emitted in the documented order.
#[derive(Default)]
struct Out {
    save: Vec<String>,
    commands: Vec<Effect>,
    status: Vec<String>,
    trace: Vec<Effect>,
}

impl Out {
    fn touch(&mut self, rollout: &str) {
        if !self.save.iter().any(|r| r == rollout) {
            self.save.push(rollout.to_owned());
        }
        if !self.status.iter().any(|r| r == rollout) {
            self.status.push(rollout.to_owned());
        }
    }

    fn into_effects(self) -> Vec<Effect> {
        let mut effects: Vec<Effect> = self.save.into_iter().map(Effect::Save).collect();
        effects.extend(self.commands);
        effects.extend(self.status.into_iter().map(Effect::Status));
        effects.extend(self.trace);
        effects
    }
}

impl Rollout {
    /// Records a decision; every decision is a state change worth saving and publishing.
    fn record(&mut self, now: u64, message: String, out: &mut Out) {
        let entry = TraceEntry {
            at: now,
            rollout: self.name.clone(),
            message,
        };
        if self.trace.len() >= TRACE_LIMIT {
            let excess = self.trace.len() + 1 - TRACE_LIMIT;
            self.trace.drain(..excess);
        }
        self.trace.push(entry.clone());
        out.touch(&self.name);
        out.trace.push(Effect::Trace(entry));
    }

    fn device_total(&self) -> usize {
        self.groups.iter().map(|g| g.devices.len()).sum()
    }

    /// Sends the group's desired actions and marks it running.
    fn start_group(&mut self, gi: usize, why: &str, now: u64, out: &mut Out) {
        let (name, created_at, release) = (
            self.name.clone(),
            self.created_at,
            self.release.name.clone(),
        );
        let group = &mut self.groups[gi];
        group.state = GroupState::Running;
        for device in &group.devices {
            if group.phases.get(device) == Some(&DevicePhase::Scheduled) {
                if let Some(slot) = group.phases.get_mut(device) {
                    *slot = DevicePhase::InProgress(ISSUED.to_owned());
                }
                group.counts.scheduled = group.counts.scheduled.saturating_sub(1);
                group.counts.in_progress += 1;
                out.commands.push(Effect::Desired {
                    device: device.clone(),
                    action_id: action_id(&name, created_at, device),
                    rollout: name.clone(),
                    release: release.clone(),
                    action: ActionType::Forced,
                });
            }
        }
        let message = format!(
            "group {} started with {} devices: {why}",
            group.name,
            group.devices.len()
        );
        self.record(now, message, out);
    }

    /// Applies the conditions of group `gi` after something changed in it, starting following
    /// groups as their predecessors succeed. Iterative so a run of empty groups cannot recurse deep.
    fn settle(&mut self, mut gi: usize, now: u64, out: &mut Out) {
        while let Some(next) = self.evaluate(gi, now, out) {
            gi = next;
        }
        self.check_finished(now, out);
    }

    /// Evaluates one group; returns the index of a group it started.
    fn evaluate(&mut self, gi: usize, now: u64, out: &mut Out) -> Option<usize> {
        let running = self.state == RolloutState::Running;
        let name = self.name.clone();
        let group = &mut self.groups[gi];
        let gname = group.name.clone();
        if group.state == GroupState::Running {
            if let (true, Some(cond)) = (running, &group.error) {
                let e = error_met(cond, &group.counts);
                if e.met {
                    group.state = GroupState::Error;
                    self.state = RolloutState::Paused;
                    self.record(
                        now,
                        format!("group {gname} paused rollout {name}: {}", e.reason),
                        out,
                    );
                    return None;
                }
            }
            if group.counts.pending() == 0 {
                let s = success_met(&group.success, &group.counts);
                if s.met {
                    group.state = GroupState::Finished;
                    self.record(now, format!("group {gname} finished: {}", s.reason), out);
                } else {
                    group.state = GroupState::Error;
                    if running {
                        self.state = RolloutState::Paused;
                        let msg = format!(
                            "group {gname} paused rollout {name}: every device is done and {}",
                            s.reason
                        );
                        self.record(now, msg, out);
                    } else {
                        self.record(
                            now,
                            format!("group {gname} ended in error: {}", s.reason),
                            out,
                        );
                    }
                    return None;
                }
            }
        }
        let group = &mut self.groups[gi];
        if !running
            || group.success_action_done
            || !matches!(group.state, GroupState::Running | GroupState::Finished)
        {
            return None;
        }
        let s = success_met(&group.success, &group.counts);
        if !s.met {
            return None;
        }
        group.success_action_done = true;
        match group.success.action {
            SuccessAction::Next => {
                let why = format!("group {gname} succeeded: {}", s.reason);
                self.start_next(&why, now, out)
            }
            SuccessAction::Pause => {
                self.state = RolloutState::Paused;
                let msg = format!(
                    "group {gname} succeeded ({}); its success action paused rollout {name}",
                    s.reason
                );
                self.record(now, msg, out);
                None
            }
        }
    }

    fn start_next(&mut self, why: &str, now: u64, out: &mut Out) -> Option<usize> {
        let next = self
            .groups
            .iter()
            .position(|g| g.state == GroupState::Scheduled)?;
        self.start_group(next, why, now, out);
        Some(next)
    }

    fn check_finished(&mut self, now: u64, out: &mut Out) {
        if self.state != RolloutState::Running
            || !self
                .groups
                .iter()
                .all(|g| matches!(g.state, GroupState::Finished | GroupState::Error))
        {
            return;
        }
        self.state = RolloutState::Finished;
        let (ready, failed) = self.groups.iter().fold((0, 0), |(r, f), g| {
            (r + g.counts.ready, f + g.counts.failed)
        });
        let message = format!(
            "rollout {} finished: {ready} of {} devices ready, {failed} failed",
            self.name,
            self.device_total()
        );
        self.record(now, message, out);
    }

    /// The rollout as operators see it.
    pub fn status(&self) -> RolloutStatus {
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
                    total: g.counts.total,
                    ready: g.counts.ready,
                    failed: g.counts.failed,
                    in_progress: g.counts.in_progress,
                    scheduled: g.counts.scheduled,
                    devices: g
                        .phases
                        .iter()
                        .map(|(d, p)| (d.clone(), p.name().to_owned()))
                        .collect(),
                    ..GroupStatus::default()
                })
                .collect(),
            trace: self.trace.clone(),
            ..RolloutStatus::default()
        }
    }
}

/// What the engine knows about a device from its retained state and its reports.
#[derive(Debug, Clone)]
struct DeviceRecord {
    hardware_id: String,
    labels: BTreeMap<String, String>,
    online: bool,
    installed: Option<String>,
    rollout: Option<String>,
    phase: Option<String>,
    reason: Option<String>,
}

/// A rollout with its device index (rebuilt on restore, never stored).
struct Entry {
    rollout: Rollout,
    /// Device id -> group index.
    index: HashMap<String, usize>,
}

impl Entry {
    fn new(rollout: Rollout) -> Self {
        let index = rollout
            .groups
            .iter()
            .enumerate()
            .flat_map(|(gi, g)| g.devices.iter().map(move |d| (d.clone(), gi)))
            .collect();
        Self { rollout, index }
    }
}

/// The rollout engine. See the module documentation.
#[derive(Default)]
pub struct Engine {
    rollouts: BTreeMap<String, Entry>,
    devices: BTreeMap<String, DeviceRecord>,
    /// Highest report seq seen per device, to drop duplicates and re-sent reports.
    last_seq: HashMap<String, u64>,
    /// Rollouts whose device phases changed since the last tick.
    dirty: BTreeSet<String>,
    /// Named device groups that partitions refer to.
    device_groups: Vec<DeviceGroup>,
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
    pub fn new() -> Self {
        Self::default()
    }

    /// Rebuilds the engine from stored rollouts after a restart. The device registry starts
    /// empty and refills from the retained state topics.
    pub fn restore(rollouts: Vec<Rollout>) -> Self {
        let mut engine = Self::new();
        for r in rollouts {
            engine.rollouts.insert(r.name.clone(), Entry::new(r));
        }
        engine
    }

    /// Re-publishes what a crash may have kept from being published: desired actions of every
    /// unfinished device in started groups of running or paused rollouts, and cancels of stopped
    /// ones. Idempotent (same action ids, retained); never starts a group.
    pub fn reissue(&mut self, _now: u64) -> Vec<Effect> {
        let mut effects = Vec::new();
        for entry in self.rollouts.values() {
            let r = &entry.rollout;
            let active = matches!(
                r.state,
                RolloutState::Running | RolloutState::Paused | RolloutState::Starting
            );
            if !active && r.state != RolloutState::Stopped {
                continue;
            }
            for g in r.groups.iter().filter(|g| g.state != GroupState::Scheduled) {
                for (device, phase) in &g.phases {
                    let action_id = action_id(&r.name, r.created_at, device);
                    if active && !phase.is_terminal() {
                        effects.push(Effect::Desired {
                            device: device.clone(),
                            action_id,
                            rollout: r.name.clone(),
                            release: r.release.name.clone(),
                            action: r.spec.policies.action,
                        });
                    } else if !active && *phase == DevicePhase::Canceled {
                        effects.push(Effect::Cancel {
                            device: device.clone(),
                            action_id,
                            rollout: r.name.clone(),
                        });
                    }
                }
            }
        }
        effects
    }

    /// A device's retained state: updates the registry, and if its current action belongs to a
    /// rollout, applies the phase like a report (this is how a restarted coordinator catches up).
    pub fn observe_state(&mut self, state: DeviceState, now: u64) -> Vec<Effect> {
        let current = state.current.as_ref();
        let record = DeviceRecord {
            hardware_id: state.hardware_id.clone(),
            labels: state.labels.iter().cloned().collect(),
            online: state.online,
            installed: state.installed.as_ref().map(|i| i.name.clone()),
            rollout: current.map(|c| c.rollout_id.clone()),
            phase: current.map(|c| c.phase.name().to_owned()),
            reason: current.and_then(|c| c.phase.reason().map(str::to_owned)),
        };
        self.devices.insert(state.device_id.clone(), record);
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
        out.into_effects()
    }

    /// A device's progress report. A `seq` not above the last one seen from the device is a
    /// duplicate or a re-send and is ignored.
    pub fn observe_report(&mut self, report: Report, now: u64) -> Vec<Effect> {
        match self.last_seq.get(&report.device_id) {
            Some(&last) if report.seq <= last => return Vec::new(),
            _ => {}
        }
        self.last_seq.insert(report.device_id.clone(), report.seq);
        if let Some(record) = self.devices.get_mut(&report.device_id) {
            record.rollout = Some(report.rollout_id.clone());
            record.phase = Some(report.phase.name().to_owned());
            record.reason = report.phase.reason().map(str::to_owned);
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
        out.into_effects()
    }

    /// Routes a device's phase for an action to its rollout and group. Anything that is not the
    /// device's current action in a rollout (unknown rollout, older incarnation, group not yet
    /// started, another device's id) is ignored.
    fn apply(
        &mut self,
        device: &str,
        action: &str,
        phase: &Phase,
        from_state: bool,
        now: u64,
        out: &mut Out,
    ) {
        let Some((rollout, created_at, for_device)) = parse_action_id(action) else {
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
        let Some(current) = group.phases.get(device) else {
            return;
        };
        if *current == DevicePhase::Scheduled {
            return;
        }
        let new = DevicePhase::from_phase(phase);
        // A retained state can be older than a report already applied; it never undoes an end.
        if from_state && current.is_terminal() && !new.is_terminal() {
            return;
        }
        if !group.set_phase(device, new) {
            return;
        }
        self.dirty.insert(entry.rollout.name.clone());
        entry.rollout.settle(gi, now, out);
    }

    /// Plans a rollout over the devices known now (creating -> ready). Fails when no device
    /// would be reached, naming why.
    pub fn create_rollout(
        &mut self,
        spec: RolloutSpec,
        release: ReleaseRef,
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
        let fleet: Vec<FleetDevice> = self
            .devices
            .iter()
            .map(|(id, d)| FleetDevice {
                id: id.clone(),
                labels: d.labels.clone(),
                hardware_id: d.hardware_id.clone(),
            })
            .collect();
        let plan = planner::plan(&spec, &fleet, &release.hardware, &self.device_groups)?;
        let planned = plan.device_count();
        if planned == 0 {
            let selected = fleet
                .iter()
                .filter(|d| spec.select.matches(&d.labels))
                .count();
            let mut reason = format!(
                "{} devices known, {selected} match select {:?}",
                fleet.len(),
                spec.select.to_string()
            );
            if !plan.excluded.is_empty() {
                reason.push_str(&format!(
                    ", {} excluded because release {} supports only hardware [{}]",
                    plan.excluded.len(),
                    release.name,
                    release.hardware.join(", ")
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
        let groups = plan
            .groups
            .into_iter()
            .map(|g| Group {
                counts: GroupCounts {
                    total: g.devices.len(),
                    scheduled: g.devices.len(),
                    ..GroupCounts::default()
                },
                phases: g
                    .devices
                    .iter()
                    .map(|d| (d.clone(), DevicePhase::Scheduled))
                    .collect(),
                name: g.name,
                state: GroupState::Scheduled,
                devices: g.devices,
                success: g.success,
                error: g.error,
                success_action_done: false,
            })
            .collect::<Vec<_>>();
        let sizes = groups
            .iter()
            .map(|g| format!("{} {}", g.name, g.devices.len()))
            .collect::<Vec<_>>()
            .join(", ");
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
        };
        let mut out = Out::default();
        let mut message = format!(
            "created for release {}: {planned} devices in {} groups ({sizes})",
            rollout.release.name,
            rollout.groups.len()
        );
        if !rollout.excluded.is_empty() {
            message.push_str(&format!(
                "; {} excluded by hardware",
                rollout.excluded.len()
            ));
        }
        if !rollout.unassigned.is_empty() {
            message.push_str(&format!(
                "; {} selected but in no group, not rolled out",
                rollout.unassigned.len()
            ));
        }
        rollout.record(now, message, &mut out);
        rollout.state = RolloutState::Ready;
        self.rollouts.insert(name, Entry::new(rollout));
        Ok(out.into_effects())
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

    /// ready -> starting -> running: the first group's devices get their desired actions.
    pub fn start(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        let r = &mut self.entry(name)?.rollout;
        if r.state != RolloutState::Ready {
            return Err(Self::invalid(r, "start"));
        }
        let mut out = Out::default();
        r.state = RolloutState::Starting;
        r.state = RolloutState::Running;
        if let Some(first) = r.start_next("rollout started by operator", now, &mut out) {
            r.settle(first, now, &mut out);
        }
        Ok(out.into_effects())
    }

    /// running -> paused: actions already sent continue and keep reporting; no group starts.
    pub fn pause(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        let r = &mut self.entry(name)?.rollout;
        if r.state != RolloutState::Running {
            return Err(Self::invalid(r, "pause"));
        }
        let mut out = Out::default();
        r.state = RolloutState::Paused;
        r.record(now, "paused by operator".to_owned(), &mut out);
        Ok(out.into_effects())
    }

    /// paused -> running, then re-evaluates every started group. A group in error counts as done:
    /// the operator chose to continue, so the group after it starts.
    pub fn resume(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        let r = &mut self.entry(name)?.rollout;
        if r.state != RolloutState::Paused {
            return Err(Self::invalid(r, "resume"));
        }
        let mut out = Out::default();
        r.state = RolloutState::Running;
        r.record(now, "resumed by operator".to_owned(), &mut out);
        // Conditions that held while paused act now (a success action, an error condition).
        for gi in 0..r.groups.len() {
            if r.state != RolloutState::Running {
                break;
            }
            if matches!(
                r.groups[gi].state,
                GroupState::Running | GroupState::Finished
            ) {
                r.settle(gi, now, &mut out);
            }
        }
        // The last started group is done with (its success action paused the rollout, or it is in
        // error): continuing means starting the group after it.
        let last = r
            .groups
            .iter()
            .rposition(|g| g.state != GroupState::Scheduled);
        if let (RolloutState::Running, Some(li)) = (r.state, last) {
            let group = &mut r.groups[li];
            if group.success_action_done || group.state == GroupState::Error {
                group.success_action_done = true;
                let why = if group.state == GroupState::Error {
                    format!("group {} is in error and the operator resumed", group.name)
                } else {
                    format!("the operator resumed after group {} succeeded", group.name)
                };
                if let Some(next) = r.start_next(&why, now, &mut out) {
                    r.settle(next, now, &mut out);
                }
            }
        }
        r.check_finished(now, &mut out);
        Ok(out.into_effects())
    }

    /// Stops a rollout for good: unfinished device actions in started groups are canceled and no
    /// group starts again.
    pub fn stop(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        let r = &mut self.entry(name)?.rollout;
        if matches!(r.state, RolloutState::Stopped | RolloutState::Finished) {
            return Err(Self::invalid(r, "stop"));
        }
        let mut out = Out::default();
        let mut canceled = 0;
        let (rname, created_at) = (r.name.clone(), r.created_at);
        for group in r
            .groups
            .iter_mut()
            .filter(|g| g.state != GroupState::Scheduled)
        {
            let unfinished: Vec<String> = group
                .phases
                .iter()
                .filter(|(_, p)| !p.is_terminal())
                .map(|(d, _)| d.clone())
                .collect();
            for device in unfinished {
                group.set_phase(&device, DevicePhase::Canceled);
                out.commands.push(Effect::Cancel {
                    action_id: action_id(&rname, created_at, &device),
                    device,
                    rollout: rname.clone(),
                });
                canceled += 1;
            }
            if group.state == GroupState::Running {
                // Every device is now done, so the group ends like any other.
                group.state = if success_met(&group.success, &group.counts).met {
                    GroupState::Finished
                } else {
                    GroupState::Error
                };
            }
        }
        r.state = RolloutState::Stopped;
        r.record(
            now,
            format!("stopped by operator; canceled {canceled} unfinished device actions"),
            &mut out,
        );
        Ok(out.into_effects())
    }

    /// Timers. Today: one `Save` and `Status` per rollout whose devices changed since the last
    /// tick. Call it about once a second. Time-based gates will hook in here.
    pub fn tick(&mut self, _now: u64) -> Vec<Effect> {
        let mut out = Out::default();
        for name in std::mem::take(&mut self.dirty) {
            if self.rollouts.contains_key(&name) {
                out.touch(&name);
            }
        }
        out.into_effects()
    }

    /// Replaces the named device groups (`flotilla group`) that specs may refer to.
    pub fn set_device_groups(&mut self, groups: Vec<DeviceGroup>) {
        self.device_groups = groups;
    }

    /// Approves an approval request by name.
    pub fn approve(&mut self, name: &str, _now: u64) -> Result<Vec<Effect>, EngineError> {
        Err(EngineError::UnknownApproval(name.to_owned()))
    }

    /// Every approval request, pending and approved.
    pub fn approvals(&self) -> Vec<flotilla_protocol::control::ApprovalStatus> {
        Vec::new()
    }

    /// Starts the next group of a running rollout now (hawkBit's manual trigger).
    pub fn trigger_next(&mut self, name: &str, _now: u64) -> Result<Vec<Effect>, EngineError> {
        Err(Self::invalid(
            &self.entry(name)?.rollout,
            "trigger the next group of",
        ))
    }

    /// Creates a rollout over the failed devices of another (`<rollout>-retry` by default).
    pub fn retry_failed(
        &mut self,
        name: &str,
        _new_name: Option<String>,
        _now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        Err(Self::invalid(&self.entry(name)?.rollout, "retry"))
    }

    /// Forgets a device: it leaves the registry and the groups of unfinished rollouts.
    pub fn delete_device(&mut self, device: &str, _now: u64) -> Result<Vec<Effect>, EngineError> {
        Err(EngineError::UnknownDevice(device.to_owned()))
    }

    /// The earliest time at which [`Engine::tick`] has a timer to act on (a timed wait, a
    /// timeout, a retry, a window opening, the rate limit), so a simulator can jump to it.
    pub fn next_timer(&self) -> Option<u64> {
        None
    }

    pub fn rollout(&self, name: &str) -> Option<&Rollout> {
        self.rollouts.get(name).map(|e| &e.rollout)
    }

    pub fn rollouts(&self) -> impl Iterator<Item = &Rollout> {
        self.rollouts.values().map(|e| &e.rollout)
    }

    pub fn status(&self, name: &str) -> Option<RolloutStatus> {
        self.rollout(name).map(Rollout::status)
    }

    pub fn statuses(&self) -> Vec<RolloutStatus> {
        self.rollouts().map(Rollout::status).collect()
    }

    /// Every device known from its retained state, sorted by id.
    pub fn devices(&self) -> Vec<DeviceSummary> {
        self.devices
            .iter()
            .map(|(id, d)| DeviceSummary {
                id: id.clone(),
                hardware_id: d.hardware_id.clone(),
                labels: d.labels.clone(),
                online: d.online,
                installed: d.installed.clone(),
                rollout: d.rollout.clone(),
                phase: d.phase.clone(),
                reason: d.reason.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_protocol::{CurrentAction, InstalledRelease};

    const NOW: u64 = 1_700_000_000;

    fn state(id: &str, labels: &[(&str, &str)], current: Option<CurrentAction>) -> DeviceState {
        DeviceState {
            device_id: id.into(),
            hardware_id: "pi4".into(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            installed: Some(InstalledRelease {
                name: "fw-2.3.0".into(),
                version: "2.3.0".into(),
                counter: 3,
            }),
            current,
            online: true,
            agent_version: "0.1.0".into(),
            at: NOW,
        }
    }

    fn release() -> ReleaseRef {
        ReleaseRef {
            name: "fw-2.4.0".into(),
            counter: 4,
            hardware: vec!["pi4".into()],
        }
    }

    fn spec(groups: &str) -> RolloutSpec {
        RolloutSpec::from_toml(&format!(
            "name = \"fw-2-4\"\nrelease = \"fw-2.4.0\"\n{groups}"
        ))
        .expect("valid spec")
    }

    fn failed() -> Phase {
        Phase::Failed {
            reason: "health check nginx failed".into(),
            rolled_back: true,
        }
    }

    /// An engine plus per-device report sequence numbers, as agents would send them.
    struct Sim {
        engine: Engine,
        seq: HashMap<String, u64>,
        now: u64,
    }

    impl Sim {
        fn new(devices: usize, label: impl Fn(usize) -> Vec<(&'static str, &'static str)>) -> Self {
            let mut engine = Engine::new();
            for i in 0..devices {
                let effects =
                    engine.observe_state(state(&format!("dev-{i:03}"), &label(i), None), NOW);
                assert!(effects.is_empty());
            }
            Self {
                engine,
                seq: HashMap::new(),
                now: NOW,
            }
        }

        fn report(&mut self, device: &str, phase: Phase) -> Vec<Effect> {
            let created_at = self
                .engine
                .rollout("fw-2-4")
                .expect("rollout exists")
                .created_at;
            let seq = self.seq.entry(device.to_owned()).or_insert(0);
            *seq += 1;
            self.now += 1;
            let report = Report {
                device_id: device.into(),
                seq: *seq,
                action_id: action_id("fw-2-4", created_at, device),
                rollout_id: "fw-2-4".into(),
                phase,
                at: self.now,
            };
            self.engine.observe_report(report, self.now)
        }

        fn create_and_start(&mut self, groups: &str) -> Vec<Effect> {
            self.engine
                .create_rollout(spec(groups), release(), NOW)
                .expect("created");
            self.engine.start("fw-2-4", NOW).expect("started")
        }

        fn rollout(&self) -> &Rollout {
            self.engine.rollout("fw-2-4").expect("rollout exists")
        }

        fn group_states(&self) -> Vec<GroupState> {
            self.rollout().groups.iter().map(|g| g.state).collect()
        }

        fn group_devices(&self, gi: usize) -> Vec<String> {
            self.rollout().groups[gi].devices.clone()
        }

        fn last_trace(&self) -> String {
            self.rollout()
                .trace
                .last()
                .map(|t| t.message.clone())
                .unwrap_or_default()
        }
    }

    fn desired(effects: &[Effect]) -> Vec<String> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Desired { device, .. } => Some(device.clone()),
                _ => None,
            })
            .collect()
    }

    fn no_labels(_: usize) -> Vec<(&'static str, &'static str)> {
        Vec::new()
    }

    #[test]
    fn action_ids_round_trip() {
        let id = action_id("fw-2-4", 1_700_000_000, "pi-17");
        assert_eq!(id, "fw-2-4@1700000000:pi-17");
        assert_eq!(
            parse_action_id(&id),
            Some(("fw-2-4", 1_700_000_000, "pi-17"))
        );
        assert_eq!(parse_action_id("manual-action"), None);
        assert_eq!(parse_action_id("r@notanumber:dev"), None);
    }

    #[test]
    fn start_orders_effects_and_sends_only_the_first_group() {
        let mut sim = Sim::new(6, no_labels);
        let created = sim
            .engine
            .create_rollout(spec("[groups]\ncount = 3\n"), release(), NOW)
            .expect("created");
        assert_eq!(created.first(), Some(&Effect::Save("fw-2-4".into())));
        assert_eq!(sim.rollout().state, RolloutState::Ready);
        assert!(
            sim.last_trace()
                .contains("6 devices in 3 groups (group-1 2, group-2 2, group-3 2)"),
            "{}",
            sim.last_trace()
        );

        let effects = sim.engine.start("fw-2-4", NOW).expect("started");
        assert_eq!(effects[0], Effect::Save("fw-2-4".into()));
        assert_eq!(desired(&effects), vec!["dev-000", "dev-001"]);
        assert_eq!(
            effects[1],
            Effect::Desired {
                device: "dev-000".into(),
                action_id: format!("fw-2-4@{NOW}:dev-000"),
                rollout: "fw-2-4".into(),
                release: "fw-2.4.0".into(),
                action: ActionType::Forced,
            }
        );
        assert_eq!(effects[3], Effect::Status("fw-2-4".into()));
        assert!(
            matches!(effects.last(), Some(Effect::Trace(t)) if t.message.contains("group group-1 started with 2 devices"))
        );
        assert_eq!(sim.rollout().state, RolloutState::Running);
        assert_eq!(
            sim.group_states(),
            vec![
                GroupState::Running,
                GroupState::Scheduled,
                GroupState::Scheduled
            ]
        );
    }

    #[test]
    fn three_groups_reach_every_device() {
        let mut sim = Sim::new(10, no_labels);
        let mut sent = desired(&sim.create_and_start("[groups]\ncount = 3\n"));
        let mut i = 0;
        while i < sent.len() {
            let device = sent[i].clone();
            sim.report(&device, Phase::Accepted);
            sim.report(
                &device,
                Phase::Downloading {
                    done: 10,
                    total: 100,
                },
            );
            sent.extend(desired(&sim.report(&device, Phase::Ready)));
            i += 1;
        }
        let mut all = sent.clone();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 10, "every device got exactly one desired action");
        assert_eq!(sent.len(), 10);
        assert_eq!(sim.rollout().state, RolloutState::Finished);
        assert_eq!(sim.group_states(), vec![GroupState::Finished; 3]);
        assert!(
            sim.last_trace()
                .contains("finished: 10 of 10 devices ready, 0 failed"),
            "{}",
            sim.last_trace()
        );
        let status = sim.engine.status("fw-2-4").expect("status");
        assert_eq!(status.state, "finished");
        assert_eq!(status.groups[0].ready, 4);
        assert_eq!(status.groups[0].devices["dev-000"], "ready");
    }

    #[test]
    fn error_threshold_pauses_then_resume_finishes() {
        let mut sim = Sim::new(12, |i| {
            if i < 5 {
                vec![("env", "canary")]
            } else {
                vec![("env", "prod")]
            }
        });
        sim.create_and_start(
            "[groups]\nerror = { threshold = \"20%\", action = \"pause\" }\n\
             [[groups.group]]\nname = \"canary\"\nselect = \"env=canary\"\n[[groups.group]]\nname = \"rest\"\n",
        );
        let canary = sim.group_devices(0);
        assert_eq!(canary.len(), 5);
        sim.report(&canary[0], failed());
        assert_eq!(
            sim.rollout().state,
            RolloutState::Running,
            "1 of 5 failed is not more than 20%"
        );
        let effects = sim.report(&canary[1], failed());
        assert_eq!(sim.rollout().state, RolloutState::Paused);
        assert_eq!(
            sim.group_states(),
            vec![GroupState::Error, GroupState::Scheduled]
        );
        assert!(
            desired(&effects).is_empty(),
            "the next group must not start"
        );
        assert_eq!(
            sim.last_trace(),
            "group canary paused rollout fw-2-4: 2 of 5 failed > 20%"
        );

        // Devices already working keep reporting while paused; nothing new starts.
        for d in &canary[2..] {
            assert!(desired(&sim.report(d, Phase::Ready)).is_empty());
        }
        let status = sim.engine.status("fw-2-4").expect("status");
        assert_eq!(
            (
                status.groups[0].ready,
                status.groups[0].failed,
                status.groups[0].in_progress
            ),
            (3, 2, 0)
        );
        assert_eq!(status.groups[1].scheduled, 7);

        let effects = sim.engine.resume("fw-2-4", sim.now).expect("resumed");
        let rest = desired(&effects);
        assert_eq!(rest, sim.group_devices(1));
        for d in &rest {
            sim.report(d, Phase::Ready);
        }
        assert_eq!(sim.rollout().state, RolloutState::Finished);
        assert_eq!(
            sim.group_states(),
            vec![GroupState::Error, GroupState::Finished]
        );
        assert!(
            sim.last_trace()
                .contains("10 of 12 devices ready, 2 failed"),
            "{}",
            sim.last_trace()
        );
    }

    #[test]
    fn refused_counts_as_failed_and_a_group_below_threshold_pauses() {
        let mut sim = Sim::new(4, no_labels);
        sim.create_and_start("[groups]\ncount = 2\n");
        let first = sim.group_devices(0);
        sim.report(&first[0], Phase::Ready);
        sim.report(
            &first[1],
            Phase::Refused {
                reason: "action expired at 1700000000".into(),
            },
        );
        // No error condition, but the group can never reach 100%: stay put and tell the operator.
        assert_eq!(sim.rollout().state, RolloutState::Paused);
        assert_eq!(
            sim.group_states(),
            vec![GroupState::Error, GroupState::Scheduled]
        );
        assert!(
            sim.last_trace().contains("1 of 2 ready < 100%"),
            "{}",
            sim.last_trace()
        );
        assert_eq!(
            sim.engine.status("fw-2-4").expect("status").groups[0].failed,
            1
        );
    }

    #[test]
    fn success_action_pause_waits_for_the_operator() {
        let mut sim = Sim::new(4, no_labels);
        sim.create_and_start("[groups]\n[[groups.group]]\nname = \"canary\"\npercent = 25\nsuccess = { action = \"pause\" }\n[[groups.group]]\nname = \"rest\"\n");
        let canary = sim.group_devices(0);
        assert_eq!(canary.len(), 1);
        let effects = sim.report(&canary[0], Phase::Ready);
        assert!(desired(&effects).is_empty());
        assert_eq!(sim.rollout().state, RolloutState::Paused);
        assert_eq!(
            sim.group_states(),
            vec![GroupState::Finished, GroupState::Scheduled]
        );
        assert!(
            sim.last_trace()
                .contains("success action paused rollout fw-2-4"),
            "{}",
            sim.last_trace()
        );
        let rest = desired(&sim.engine.resume("fw-2-4", sim.now).expect("resumed"));
        assert_eq!(rest.len(), 3);
        for d in &rest {
            sim.report(d, Phase::Ready);
        }
        assert_eq!(sim.rollout().state, RolloutState::Finished);
    }

    #[test]
    fn partial_success_starts_the_next_group_while_stragglers_finish() {
        let mut sim = Sim::new(8, no_labels);
        sim.create_and_start("[groups]\ncount = 2\nsuccess = { threshold = \"50%\" }\n");
        let first = sim.group_devices(0);
        sim.report(&first[0], Phase::Ready);
        let next = desired(&sim.report(&first[1], Phase::Ready));
        assert_eq!(
            next,
            sim.group_devices(1),
            "2 of 4 ready >= 50% starts group-2"
        );
        assert_eq!(
            sim.group_states(),
            vec![GroupState::Running, GroupState::Running]
        );
        for d in first[2..].iter().chain(&next) {
            assert!(
                desired(&sim.report(d, Phase::Ready)).is_empty(),
                "no group starts twice"
            );
        }
        assert_eq!(sim.rollout().state, RolloutState::Finished);
    }

    #[test]
    fn empty_groups_succeed_at_once() {
        // count = 3 over 2 devices plans 1, 1 and an empty third group.
        let mut sim = Sim::new(2, no_labels);
        sim.create_and_start("[groups]\ncount = 3\n");
        sim.report("dev-000", Phase::Ready);
        assert_eq!(sim.rollout().state, RolloutState::Running);
        sim.report("dev-001", Phase::Ready);
        assert_eq!(sim.rollout().state, RolloutState::Finished);
        assert_eq!(sim.group_states(), vec![GroupState::Finished; 3]);
        assert!(
            sim.rollout()
                .trace
                .iter()
                .any(|t| t.message == "group group-3 finished: 0 of 0 ready >= 100%"),
            "{:?}",
            sim.rollout().trace
        );
    }

    #[test]
    fn pause_resume_and_invalid_transitions() {
        let mut sim = Sim::new(2, no_labels);
        sim.engine
            .create_rollout(spec("[groups]\ncount = 2\n"), release(), NOW)
            .expect("created");
        let err = sim
            .engine
            .resume("fw-2-4", NOW)
            .expect_err("ready cannot resume");
        assert_eq!(err.to_string(), "rollout fw-2-4 is ready; cannot resume it");
        sim.engine.start("fw-2-4", NOW).expect("started");
        assert!(matches!(
            sim.engine.start("fw-2-4", NOW),
            Err(EngineError::InvalidTransition {
                command: "start",
                ..
            })
        ));
        assert!(sim.engine.resume("fw-2-4", NOW).is_err());
        sim.engine.pause("fw-2-4", NOW).expect("paused");
        assert_eq!(sim.last_trace(), "paused by operator");
        // While paused the first group succeeds, but the second waits for resume.
        let first = sim.group_devices(0);
        assert!(desired(&sim.report(&first[0], Phase::Ready)).is_empty());
        assert_eq!(
            sim.group_states(),
            vec![GroupState::Finished, GroupState::Scheduled]
        );
        let second = desired(&sim.engine.resume("fw-2-4", sim.now).expect("resumed"));
        assert_eq!(second, sim.group_devices(1));
        sim.report(&second[0], Phase::Ready);
        assert_eq!(sim.rollout().state, RolloutState::Finished);
        for result in [
            sim.engine.pause("fw-2-4", NOW),
            sim.engine.resume("fw-2-4", NOW),
            sim.engine.stop("fw-2-4", NOW),
        ] {
            assert!(result
                .expect_err("finished is terminal")
                .to_string()
                .contains("is finished"));
        }
        assert!(
            matches!(sim.engine.start("nope", NOW), Err(EngineError::UnknownRollout(n)) if n == "nope")
        );
    }

    #[test]
    fn stop_cancels_unfinished_devices_and_nothing_starts_again() {
        let mut sim = Sim::new(6, no_labels);
        sim.create_and_start("[groups]\ncount = 2\n");
        let first = sim.group_devices(0);
        sim.report(&first[0], Phase::Ready);
        sim.report(&first[1], Phase::Staged);
        let effects = sim.engine.stop("fw-2-4", sim.now).expect("stopped");
        assert_eq!(effects[0], Effect::Save("fw-2-4".into()));
        let canceled: Vec<&str> = effects
            .iter()
            .filter_map(|e| match e {
                Effect::Cancel {
                    device, action_id, ..
                } => {
                    assert_eq!(action_id, &format!("fw-2-4@{NOW}:{device}"));
                    Some(device.as_str())
                }
                _ => None,
            })
            .collect();
        assert_eq!(
            canceled,
            vec![first[1].as_str(), first[2].as_str()],
            "the ready device is left alone"
        );
        assert_eq!(sim.rollout().state, RolloutState::Stopped);
        assert!(sim
            .last_trace()
            .contains("canceled 2 unfinished device actions"));
        // Late reports still update the status but never start the next group.
        assert!(desired(&sim.report(&first[2], Phase::Ready)).is_empty());
        assert_eq!(sim.group_states()[1], GroupState::Scheduled);
        assert!(sim.engine.resume("fw-2-4", sim.now).is_err());
        assert!(sim.engine.stop("fw-2-4", sim.now).is_err());
        // After a restart the cancel is published again in case the crash came before it was.
        let reissued = sim.engine.reissue(sim.now);
        assert_eq!(reissued.len(), 1);
        assert!(matches!(&reissued[0], Effect::Cancel { device, .. } if device == &first[1]));
    }

    #[test]
    fn restore_and_reissue_resume_without_starting_groups_twice() {
        let mut sim = Sim::new(9, no_labels);
        sim.create_and_start("[groups]\ncount = 3\n");
        let first = sim.group_devices(0);
        for d in &first {
            sim.report(d, Phase::Ready);
        }
        let second = sim.group_devices(1);
        sim.report(&second[0], Phase::Ready);
        sim.report(&second[1], Phase::Downloading { done: 1, total: 2 });

        // What the store holds, through its encoding.
        let json = serde_json::to_string(sim.rollout()).expect("encodes");
        let saved: Rollout = serde_json::from_str(&json).expect("decodes");
        assert_eq!(&saved, sim.rollout());
        let mut engine = Engine::restore(vec![saved]);
        let reissued = engine.reissue(sim.now);
        assert_eq!(
            desired(&reissued),
            vec![second[1].clone(), second[2].clone()],
            "only unfinished devices of started groups"
        );
        assert_eq!(
            engine.rollout("fw-2-4").map(|r| r.state),
            Some(RolloutState::Running)
        );

        sim.engine = engine;
        let mut started = Vec::new();
        started.extend(desired(&sim.report(&second[1], Phase::Ready)));
        started.extend(desired(&sim.report(&second[2], Phase::Ready)));
        assert_eq!(started, sim.group_devices(2), "group-3 starts once");
        for d in &started {
            assert!(desired(&sim.report(d, Phase::Ready)).is_empty());
        }
        assert_eq!(sim.rollout().state, RolloutState::Finished);
        let starts = sim
            .rollout()
            .trace
            .iter()
            .filter(|t| t.message.contains("started with"))
            .count();
        assert_eq!(starts, 3, "each group started exactly once");
    }

    #[test]
    fn old_and_duplicate_seqs_are_ignored() {
        let mut sim = Sim::new(2, no_labels);
        sim.create_and_start("[groups]\ncount = 1\n");
        let created_at = sim.rollout().created_at;
        let report = |seq, phase| Report {
            device_id: "dev-000".into(),
            seq,
            action_id: action_id("fw-2-4", created_at, "dev-000"),
            rollout_id: "fw-2-4".into(),
            phase,
            at: NOW,
        };
        sim.engine.observe_report(report(5, Phase::Staged), NOW);
        assert!(sim
            .engine
            .observe_report(
                report(
                    4,
                    Phase::Failed {
                        reason: "old".into(),
                        rolled_back: false
                    }
                ),
                NOW
            )
            .is_empty());
        assert!(sim
            .engine
            .observe_report(report(5, Phase::Ready), NOW)
            .is_empty());
        assert_eq!(
            sim.engine.status("fw-2-4").expect("status").groups[0].devices["dev-000"],
            "staged"
        );
        sim.engine.observe_report(report(6, Phase::Ready), NOW);
        assert_eq!(
            sim.engine.status("fw-2-4").expect("status").groups[0].devices["dev-000"],
            "ready"
        );
    }

    #[test]
    fn reports_for_other_actions_are_ignored() {
        let mut sim = Sim::new(4, no_labels);
        sim.create_and_start("[groups]\ncount = 2\n");
        let scheduled = sim.group_devices(1)[0].clone();
        let mut send = |device: &str, action: String, seq| {
            sim.engine.observe_report(
                Report {
                    device_id: device.into(),
                    seq,
                    action_id: action,
                    rollout_id: "fw-2-4".into(),
                    phase: Phase::Ready,
                    at: NOW,
                },
                NOW,
            )
        };
        // A device of a group that has not started, an older incarnation, another device's id.
        send(&scheduled, action_id("fw-2-4", NOW, &scheduled), 1);
        send("dev-000", action_id("fw-2-4", NOW - 10, "dev-000"), 1);
        send("dev-001", action_id("fw-2-4", NOW, "dev-000"), 1);
        send("dev-001", "manual".into(), 2);
        let status = sim.engine.status("fw-2-4").expect("status");
        assert_eq!(status.groups[0].ready, 0);
        assert_eq!(status.groups[1].devices[&scheduled], "scheduled");
    }

    #[test]
    fn observe_state_catches_up_a_missed_ready() {
        let mut sim = Sim::new(2, no_labels);
        sim.create_and_start("[groups]\ncount = 2\n");
        let first = sim.group_devices(0)[0].clone();
        let current = CurrentAction {
            action_id: action_id("fw-2-4", NOW, &first),
            rollout_id: "fw-2-4".into(),
            phase: Phase::Ready,
        };
        let effects = sim
            .engine
            .observe_state(state(&first, &[], Some(current.clone())), NOW + 5);
        assert_eq!(
            desired(&effects),
            sim.group_devices(1),
            "the missed ready started the next group"
        );
        let summary = sim
            .engine
            .devices()
            .into_iter()
            .find(|d| d.id == first)
            .expect("known device");
        assert_eq!(
            (summary.rollout.as_deref(), summary.phase.as_deref()),
            (Some("fw-2-4"), Some("ready"))
        );
        // An older retained state never moves a finished device back.
        let stale = CurrentAction {
            phase: Phase::Staged,
            ..current
        };
        sim.engine
            .observe_state(state(&first, &[], Some(stale)), NOW + 6);
        assert_eq!(
            sim.engine.status("fw-2-4").expect("status").groups[0].devices[&first],
            "ready"
        );
    }

    #[test]
    fn create_fails_clearly_without_devices() {
        let mut sim = Sim::new(3, |_| vec![("hw", "pi4")]);
        let s = RolloutSpec::from_toml("name = \"fw-2-4\"\nrelease = \"fw-2.4.0\"\nselect = \"site=mars\"\n[groups]\ncount = 1\n")
            .expect("valid");
        let err = sim
            .engine
            .create_rollout(s, release(), NOW)
            .expect_err("no device on mars");
        assert_eq!(
            err.to_string(),
            "rollout fw-2-4 would reach no device: 3 devices known, 0 match select \"site=mars\""
        );
        assert!(sim.engine.rollout("fw-2-4").is_none(), "nothing is created");

        let cm4 = ReleaseRef {
            hardware: vec!["cm4".into()],
            ..release()
        };
        let err = sim
            .engine
            .create_rollout(spec("[groups]\ncount = 1\n"), cm4, NOW)
            .expect_err("wrong hardware");
        assert!(
            err.to_string()
                .contains("3 excluded because release fw-2.4.0 supports only hardware [cm4]"),
            "{err}"
        );

        sim.engine
            .create_rollout(spec("[groups]\ncount = 1\n"), release(), NOW)
            .expect("created");
        let err = sim
            .engine
            .create_rollout(spec("[groups]\ncount = 1\n"), release(), NOW)
            .expect_err("twice");
        assert_eq!(err.to_string(), "a rollout named \"fw-2-4\" already exists");
    }

    #[test]
    fn tick_saves_and_publishes_rollouts_whose_devices_changed() {
        let mut sim = Sim::new(3, no_labels);
        sim.create_and_start("[groups]\ncount = 1\n");
        assert!(sim.engine.tick(NOW).is_empty());
        let effects = sim.report("dev-000", Phase::Accepted);
        assert!(
            effects.is_empty(),
            "a phase change alone is batched until the tick: {effects:?}"
        );
        assert_eq!(
            sim.engine.tick(NOW),
            vec![
                Effect::Save("fw-2-4".into()),
                Effect::Status("fw-2-4".into())
            ]
        );
        assert!(sim.engine.tick(NOW).is_empty());
    }

    #[test]
    fn trace_keeps_the_last_thousand_entries() {
        let mut sim = Sim::new(1, no_labels);
        sim.create_and_start("[groups]\ncount = 1\n");
        for _ in 0..600 {
            sim.engine.pause("fw-2-4", NOW).expect("paused");
            sim.engine.resume("fw-2-4", NOW).expect("resumed");
        }
        let trace = &sim.rollout().trace;
        assert_eq!(trace.len(), TRACE_LIMIT);
        assert_eq!(
            trace.last().map(|t| t.message.as_str()),
            Some("resumed by operator")
        );
    }

    #[test]
    fn a_hundred_thousand_devices_finish() {
        const N: usize = 100_000;
        let mut engine = Engine::new();
        for i in 0..N {
            engine.observe_state(state(&format!("d{i:06}"), &[], None), NOW);
        }
        engine
            .create_rollout(
                spec("[groups]\ncount = 4\nerror = { threshold = \"5%\" }\n"),
                release(),
                NOW,
            )
            .expect("created");
        let mut pending = desired(&engine.start("fw-2-4", NOW).expect("started"));
        assert_eq!(pending.len(), N / 4);
        let mut reported = 0;
        while let Some(device) = pending.pop() {
            let report = Report {
                device_id: device.clone(),
                seq: 1,
                action_id: action_id("fw-2-4", NOW, &device),
                rollout_id: "fw-2-4".into(),
                phase: Phase::Ready,
                at: NOW,
            };
            pending.extend(desired(&engine.observe_report(report, NOW)));
            reported += 1;
        }
        assert_eq!(reported, N);
        let r = engine.rollout("fw-2-4").expect("rollout");
        assert_eq!(r.state, RolloutState::Finished);
        assert!(r
            .groups
            .iter()
            .all(|g| g.state == GroupState::Finished && g.counts.ready == N / 4));
    }
}
