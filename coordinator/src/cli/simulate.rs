//! `flotilla simulate`: the real [`Engine`] driven in virtual time by scripted devices and
//! operator events, so an operator can see what a spec will do before touching a device.
//!
//! Nothing here decides anything about the rollout: the simulator only plays the devices and the
//! operator. It registers each fleet device with [`Engine::observe_state`], creates and starts the
//! rollout, and then runs an event loop over a virtual clock:
//!
//! - an [`Effect::Desired`] makes the device answer with its scripted reports (Accepted at once,
//!   then Ready or Failed after its delay, or nothing if it is silent), with increasing `seq`
//!   and the action id from the effect; a newer desired action or an [`Effect::Cancel`] drops the
//!   device's pending reports;
//! - a device scripted to go offline gets an `observe_state` with `online = false` at that time
//!   and sends nothing after it;
//! - operator events (approve, pause, resume, stop, next) call the engine at their time;
//! - [`Engine::tick`] runs at every simulated second that has something scheduled, and the clock
//!   jumps to the next event or [`Engine::next_timer`], whichever is first. Idle hours cost
//!   nothing.
//!
//! The run ends when the rollout is finished, stopped or failed, when nothing can happen any
//! more, or at the `until` horizon. The timeline is the engine's decision trace, in order.
//!
//! The outcomes file (TOML):
//!
//! ```toml
//! default = { ready_after = "30s" }
//! [[device]]
//! id = "dev-003"                 # or select = "env=canary"
//! fail_after = "20s"             # or ready_after = "2m", or silent = true
//! reason = "health check nginx failed"
//! offline_at = "5m"              # optional, from the start of the run
//! [[operator]]
//! at = "1h"
//! approve = "fw-2-4-canary"      # or command = "pause" | "resume" | "stop" | "next" (with
//!                                 # skip_approval = true: `rollout next --skip-approval`)
//! ```

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Args;
use flotilla_protocol::control::{RolloutStatus, TraceEntry};
use flotilla_protocol::{ByteCounts, CurrentAction, DeviceState, Phase, Report};
use serde::{Deserialize, Serialize};

use crate::cli::fleetfile::{self, FleetError};
use crate::cli::out::{out, outln};
use crate::cli::view;
use flotilla_rollout::duration::parse_duration;
use flotilla_rollout::engine::{Effect, Engine, EngineError, ReleaseRef, OPERATOR};
use flotilla_rollout::planner::{DeviceGroup, FleetDevice, PlanDevice};
use flotilla_rollout::selector::Selector;
use flotilla_rollout::spec::RolloutSpec;
use flotilla_rollout::zoneinfo::SystemZones;

/// Where the virtual clock starts unless `--start` says otherwise (2027-01-15T08:00:00Z).
pub const DEFAULT_START: u64 = 1_800_000_000;

/// How long a run may last in virtual time unless `--until` says otherwise.
pub const DEFAULT_UNTIL: u64 = 30 * 86_400;

/// What every device does when there is no outcomes file.
pub const DEFAULT_READY_AFTER: u64 = 30;

/// Most rounds of events and ticks at one virtual second before the run is declared stuck.
const MAX_ROUNDS_PER_SECOND: usize = 10_000;

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Files(#[from] FleetError),
    #[error("cannot read outcomes file {path}: {source}")]
    ReadOutcomes {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("outcomes file: {0}")]
    Outcomes(String),
    #[error("--{flag} {value:?}: {reason}")]
    Flag {
        flag: &'static str,
        value: String,
        reason: String,
    },
    #[error("the simulated coordinator refused the rollout: {0}")]
    Engine(#[from] EngineError),
    #[error("the engine kept acting at +{} without time passing; giving up", offset(*at))]
    Stuck { at: u64 },
}

// ---------------------------------------------------------------------------------------------
// Outcomes

/// How a device answers a desired action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Ready this many seconds after the action arrived.
    Ready { after: u64 },
    /// Failed (rolled back) this many seconds after the action arrived.
    Fail { after: u64, reason: String },
    /// Accepts nothing and reports nothing.
    Silent,
}

/// A device's script: its answer, and when (seconds after the start) it goes offline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Script {
    pub answer: Answer,
    pub offline_at: Option<u64>,
}

/// Which devices a rule applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Id(String),
    Select(Selector),
}

/// One `[[device]]` rule; its unset parts come from the default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub target: Target,
    pub answer: Option<Answer>,
    pub offline_at: Option<u64>,
}

/// What an operator does during the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OperatorAction {
    Approve(String),
    Pause,
    Resume,
    Stop,
    /// `rollout next`; with `true`, `rollout next --skip-approval`.
    Next {
        skip_approval: bool,
    },
}

/// An operator action at a time (seconds after the start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorEvent {
    pub at: u64,
    pub action: OperatorAction,
}

/// The parsed outcomes file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcomes {
    pub default: Script,
    /// The first rule that matches a device wins.
    pub rules: Vec<Rule>,
    pub operator: Vec<OperatorEvent>,
}

impl Default for Outcomes {
    fn default() -> Self {
        Outcomes {
            default: Script {
                answer: Answer::Ready {
                    after: DEFAULT_READY_AFTER,
                },
                offline_at: None,
            },
            rules: Vec::new(),
            operator: Vec::new(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOutcomes {
    #[serde(default)]
    default: Option<RawScript>,
    #[serde(default)]
    device: Vec<RawScript>,
    #[serde(default)]
    operator: Vec<RawOperator>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScript {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    select: Option<String>,
    #[serde(default)]
    ready_after: Option<String>,
    #[serde(default)]
    fail_after: Option<String>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    silent: Option<bool>,
    #[serde(default)]
    offline_at: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOperator {
    at: String,
    #[serde(default)]
    approve: Option<String>,
    #[serde(default)]
    command: Option<String>,
    /// Only with `command = "next"`: as `rollout next --skip-approval`.
    #[serde(default)]
    skip_approval: bool,
}

fn duration(field: &str, value: &str) -> Result<u64, String> {
    parse_duration(value).map_err(|reason| format!("{field}: {value:?}: {reason}"))
}

impl RawScript {
    fn answer(&self, field: &str) -> Result<Option<Answer>, String> {
        let set = [
            self.ready_after.is_some(),
            self.fail_after.is_some(),
            self.silent.is_some(),
        ];
        if set.iter().filter(|s| **s).count() > 1 {
            return Err(format!(
                "{field}: set only one of ready_after, fail_after and silent"
            ));
        }
        if self.reason.is_some() && self.fail_after.is_none() {
            return Err(format!(
                "{field}.reason: only a fail_after rule has a reason"
            ));
        }
        Ok(if let Some(v) = &self.ready_after {
            Some(Answer::Ready {
                after: duration(&format!("{field}.ready_after"), v)?,
            })
        } else if let Some(v) = &self.fail_after {
            Some(Answer::Fail {
                after: duration(&format!("{field}.fail_after"), v)?,
                reason: self
                    .reason
                    .clone()
                    .unwrap_or_else(|| "scripted failure".to_owned()),
            })
        } else {
            match self.silent {
                Some(true) => Some(Answer::Silent),
                Some(false) => {
                    return Err(format!(
                        "{field}.silent: false says nothing; leave it out or set ready_after"
                    ))
                }
                None => None,
            }
        })
    }

    fn offline_at(&self, field: &str) -> Result<Option<u64>, String> {
        self.offline_at
            .as_deref()
            .map(|v| duration(&format!("{field}.offline_at"), v))
            .transpose()
    }
}

impl Outcomes {
    /// Parses and validates an outcomes file; errors name the entry and field.
    pub fn from_toml(text: &str) -> Result<Outcomes, SimError> {
        let raw: RawOutcomes =
            toml::from_str(text).map_err(|e| SimError::Outcomes(e.to_string()))?;
        Self::validate(raw).map_err(SimError::Outcomes)
    }

    fn validate(raw: RawOutcomes) -> Result<Outcomes, String> {
        let mut out = Outcomes::default();
        if let Some(d) = raw.default {
            if d.id.is_some() || d.select.is_some() {
                return Err(
                    "default: applies to every device; move id/select into a [[device]] rule"
                        .into(),
                );
            }
            if let Some(answer) = d.answer("default")? {
                out.default.answer = answer;
            }
            out.default.offline_at = d.offline_at("default")?;
        }
        for (i, d) in raw.device.iter().enumerate() {
            let field = format!("device[{i}]");
            let target = match (&d.id, &d.select) {
                (Some(id), None) => Target::Id(id.clone()),
                (None, Some(sel)) => Target::Select(
                    Selector::parse(sel).map_err(|e| format!("{field}.select: {e}"))?,
                ),
                _ => return Err(format!("{field}: set exactly one of id and select")),
            };
            let answer = d.answer(&field)?;
            let offline_at = d.offline_at(&field)?;
            if answer.is_none() && offline_at.is_none() {
                return Err(format!(
                    "{field}: says nothing; set ready_after, fail_after, silent or offline_at"
                ));
            }
            out.rules.push(Rule {
                target,
                answer,
                offline_at,
            });
        }
        for (i, o) in raw.operator.iter().enumerate() {
            let field = format!("operator[{i}]");
            let at = duration(&format!("{field}.at"), &o.at)?;
            if o.skip_approval && o.command.as_deref() != Some("next") {
                return Err(format!(
                    "{field}.skip_approval: only with command = \"next\""
                ));
            }
            let action = match (&o.approve, o.command.as_deref()) {
                (Some(name), None) => OperatorAction::Approve(name.clone()),
                (None, Some("pause")) => OperatorAction::Pause,
                (None, Some("resume")) => OperatorAction::Resume,
                (None, Some("stop")) => OperatorAction::Stop,
                (None, Some("next")) => OperatorAction::Next {
                    skip_approval: o.skip_approval,
                },
                (None, Some(other)) => {
                    return Err(format!(
                        "{field}.command: {other:?} is not one of pause, resume, stop, next"
                    ))
                }
                _ => return Err(format!("{field}: set exactly one of approve and command")),
            };
            out.operator.push(OperatorEvent { at, action });
        }
        Ok(out)
    }

    /// The script of one device: the first matching rule over the default.
    pub fn script_for(&self, device: &FleetDevice) -> Script {
        self.scripts().swap_remove(self.rule_for(device))
    }

    /// Which script of [`Outcomes::scripts`] a device follows: 0 for the default, `i + 1` for
    /// rule `i`.
    fn rule_for<D: PlanDevice + ?Sized>(&self, device: &D) -> usize {
        self.rules
            .iter()
            .position(|r| match &r.target {
                Target::Id(id) => id == device.id(),
                Target::Select(sel) => sel.matches(device.labels()),
            })
            .map_or(0, |i| i + 1)
    }

    /// The default script, then each rule's over the default.
    fn scripts(&self) -> Vec<Script> {
        let mut scripts = vec![self.default.clone()];
        for rule in &self.rules {
            let mut script = self.default.clone();
            if let Some(answer) = &rule.answer {
                script.answer = answer.clone();
            }
            if rule.offline_at.is_some() {
                script.offline_at = rule.offline_at;
            }
            scripts.push(script);
        }
        scripts
    }
}

// ---------------------------------------------------------------------------------------------
// The run

/// One decision of the engine, at seconds from the start of the run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimelineEntry {
    pub at: u64,
    pub message: String,
}

/// Why the run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndReason {
    /// The rollout reached a terminal state (finished, stopped, failed).
    Done,
    /// No event, timer or operator action was left.
    Idle,
    /// The `until` horizon was reached with things still scheduled.
    Until,
}

/// When and why the run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct End {
    /// Seconds from the start.
    pub at: u64,
    pub reason: EndReason,
}

/// The result of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimReport {
    pub timeline: Vec<TimelineEntry>,
    pub rollout: RolloutStatus,
    /// Device id -> phase in the rollout.
    pub devices: BTreeMap<String, String>,
    pub end: End,
}

impl SimReport {
    /// 0 when the rollout finished, 2 when it is paused, stopped, failed or still waiting.
    pub fn exit_code(&self) -> i32 {
        if self.rollout.state == "finished" {
            0
        } else {
            2
        }
    }
}

/// Where the run starts and how long it may last.
#[derive(Debug, Clone, Copy)]
pub struct SimOptions {
    /// Unix seconds of the start of the run.
    pub start: u64,
    /// Seconds after the start at which the run ends at the latest.
    pub until: u64,
    /// The release's size in bytes: each device that ends ready reports that many bytes, from
    /// its first peer when its action named peers, else from the coordinator.
    pub artifact_size: Option<u64>,
    /// The process ends right after the run (the `simulate` command): the engine, millions of
    /// small allocations at a million devices, is left to the exit instead of freed one by one.
    pub then_exit: bool,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            start: DEFAULT_START,
            until: DEFAULT_UNTIL,
            artifact_size: None,
            then_exit: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Report {
        device: usize,
        epoch: u64,
        action_id: String,
        phase: Phase,
    },
    Offline {
        device: usize,
    },
    Operator(OperatorAction),
}

/// A device the simulator can play: what its retained state says.
pub trait SimDevice: PlanDevice {
    /// Its labels as its retained state carries them.
    fn label_list(&self) -> Vec<(String, String)>;
}

impl SimDevice for FleetDevice {
    fn label_list(&self) -> Vec<(String, String)> {
        self.labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}

impl SimDevice for fleetfile::Device<'_> {
    fn label_list(&self) -> Vec<(String, String)> {
        self.labels()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }
}

/// A simulated device; its id and labels stay in the fleet it was read from.
struct Device {
    /// Its script in `Sim::scripts`.
    script: usize,
    online: bool,
    seq: u64,
    /// Bumped by every new action or cancel, so older pending reports are dropped.
    epoch: u64,
    /// The action of its last report, and that report's phase.
    current: Option<(String, Phase)>,
    /// The peers its last desired action named.
    peers: Vec<String>,
}

struct Sim<'f, D> {
    engine: Engine,
    rollout: String,
    start: u64,
    fleet: &'f [D],
    scripts: Vec<Script>,
    devices: Vec<Device>,
    index: HashMap<&'f str, usize>,
    /// Events by time, each second's in the order they were scheduled.
    queue: BTreeMap<u64, Vec<Event>>,
    timeline: Vec<TimelineEntry>,
    artifact_size: Option<u64>,
}

impl<D: SimDevice> Sim<'_, D> {
    fn schedule(&mut self, at: u64, event: Event) {
        self.queue.entry(at).or_default().push(event);
    }

    /// The retained state device `di` publishes.
    fn state(&self, di: usize, now: u64) -> DeviceState {
        let (f, d) = (&self.fleet[di], &self.devices[di]);
        DeviceState {
            device_id: f.id().to_owned(),
            hardware_id: f.hardware_id().to_owned(),
            labels: f.label_list(),
            installed: None,
            current: d.current.as_ref().map(|(action_id, phase)| CurrentAction {
                action_id: action_id.clone(),
                rollout_id: self.rollout.clone(),
                phase: phase.clone(),
            }),
            online: d.online,
            agent_version: "simulated".to_owned(),
            at: now,
        }
    }

    fn note(&mut self, now: u64, message: String) {
        self.timeline.push(TimelineEntry {
            at: now - self.start,
            message,
        });
    }

    /// Plays the devices' side of the engine's effects.
    fn handle(&mut self, effects: Vec<Effect>, now: u64) {
        for effect in effects {
            match effect {
                Effect::Desired {
                    device,
                    action_id,
                    peers,
                    ..
                } => {
                    if let Some(&di) = self.index.get(device.as_str()) {
                        self.devices[di].peers = peers;
                        self.answer(di, action_id, now, false);
                    }
                }
                Effect::Rollback {
                    device, action_id, ..
                } => {
                    if let Some(&di) = self.index.get(device.as_str()) {
                        self.answer(di, action_id, now, true);
                    }
                }
                Effect::Cancel {
                    device, action_id, ..
                } => {
                    let Some(&di) = self.index.get(device.as_str()) else {
                        continue;
                    };
                    let d = &mut self.devices[di];
                    let running = d
                        .current
                        .as_ref()
                        .is_some_and(|(a, phase)| *a == action_id && !phase.is_terminal());
                    d.epoch += 1;
                    let epoch = d.epoch;
                    if running && d.online {
                        let event = Event::Report {
                            device: di,
                            epoch,
                            action_id,
                            phase: Phase::Canceled,
                        };
                        self.schedule(now, event);
                    }
                }
                Effect::Trace(entry) => self.trace(entry),
                _ => {}
            }
        }
    }

    fn trace(&mut self, entry: TraceEntry) {
        if entry.rollout == self.rollout {
            let at = entry.at.saturating_sub(self.start);
            self.timeline.push(TimelineEntry {
                at,
                message: entry.message,
            });
        }
    }

    /// Schedules a device's scripted reports for a new action.
    fn answer(&mut self, di: usize, action_id: String, now: u64, rollback: bool) {
        let d = &mut self.devices[di];
        d.epoch += 1;
        let epoch = d.epoch;
        if !d.online {
            // It picks the retained action up when it reconnects, which the script never does.
            return;
        }
        let terminal = match (&self.scripts[d.script].answer, rollback) {
            (Answer::Silent, _) => return,
            (Answer::Ready { after }, _) => (*after, Phase::Ready),
            (Answer::Fail { after, .. }, true) => (*after, Phase::Ready),
            (Answer::Fail { after, reason }, false) => (
                *after,
                Phase::Failed {
                    reason: reason.clone(),
                    rolled_back: true,
                },
            ),
        };
        let accepted = Event::Report {
            device: di,
            epoch,
            action_id: action_id.clone(),
            phase: Phase::Accepted,
        };
        let done = Event::Report {
            device: di,
            epoch,
            action_id,
            phase: terminal.1,
        };
        self.schedule(now, accepted);
        self.schedule(now.saturating_add(terminal.0), done);
    }

    fn deliver(&mut self, event: Event, now: u64) {
        match event {
            Event::Report {
                device,
                epoch,
                action_id,
                phase,
            } => {
                let d = &mut self.devices[device];
                if d.epoch != epoch || !d.online {
                    return;
                }
                d.seq += 1;
                d.current = Some((action_id.clone(), phase.clone()));
                if let (Some(size), Phase::Ready) = (self.artifact_size, &phase) {
                    let bytes = match d.peers.first() {
                        Some(peer) => ByteCounts {
                            peers: vec![(peer.clone(), size)],
                            ..ByteCounts::default()
                        },
                        None => ByteCounts {
                            coordinator: size,
                            ..ByteCounts::default()
                        },
                    };
                    let id = self.fleet[device].id().to_owned();
                    self.engine.observe_bytes(&id, &action_id, bytes);
                }
                let report = Report {
                    device_id: self.fleet[device].id().to_owned(),
                    seq: d.seq,
                    action_id,
                    rollout_id: self.rollout.clone(),
                    phase,
                    at: now,
                };
                let effects = self.engine.observe_report(report, now);
                self.handle(effects, now);
            }
            Event::Offline { device } => {
                self.devices[device].online = false;
                let state = self.state(device, now);
                let effects = self.engine.observe_state(state, now);
                self.handle(effects, now);
            }
            Event::Operator(action) => {
                let name = self.rollout.clone();
                let (what, result) = match &action {
                    OperatorAction::Approve(a) => {
                        (format!("approve {a}"), self.engine.approve(a, now))
                    }
                    OperatorAction::Pause => ("pause".to_owned(), self.engine.pause(&name, now)),
                    OperatorAction::Resume => ("resume".to_owned(), self.engine.resume(&name, now)),
                    OperatorAction::Stop => ("stop".to_owned(), self.engine.stop(&name, now)),
                    OperatorAction::Next { skip_approval } => {
                        let what = if *skip_approval {
                            "next --skip-approval"
                        } else {
                            "next"
                        };
                        let result =
                            self.engine
                                .trigger_next_with(&name, OPERATOR, *skip_approval, now);
                        (what.to_owned(), result)
                    }
                };
                match result {
                    Ok(effects) => self.handle(effects, now),
                    Err(e) => self.note(now, format!("operator {what} refused: {e}")),
                }
            }
        }
    }

    fn terminal(&self) -> bool {
        self.engine.rollout(&self.rollout).is_none_or(|r| {
            matches!(
                r.state.to_string().as_str(),
                "finished" | "stopped" | "failed"
            )
        })
    }

    /// The event loop; returns how the run ended.
    fn run(&mut self, mut now: u64, deadline: u64) -> Result<End, SimError> {
        let start = self.start;
        let end = |now: u64, reason| End {
            at: now - start,
            reason,
        };
        loop {
            let mut rounds = 0;
            loop {
                // Events scheduled at `now` while these are delivered come after them.
                while let Some(entry) = self.queue.first_entry() {
                    if *entry.key() > now {
                        break;
                    }
                    for event in entry.remove() {
                        self.deliver(event, now);
                    }
                }
                let effects = self.engine.tick(now);
                self.handle(effects, now);
                if self.queue.first_key_value().is_none_or(|(at, _)| *at > now) {
                    break;
                }
                rounds += 1;
                if rounds > MAX_ROUNDS_PER_SECOND {
                    return Err(SimError::Stuck {
                        at: now - self.start,
                    });
                }
            }
            if self.terminal() {
                return Ok(end(now, EndReason::Done));
            }
            let event = self.queue.first_key_value().map(|(at, _)| *at);
            // A timer the engine says is due now was just ticked; look at least a second ahead.
            let timer = self.engine.next_timer().map(|t| t.max(now + 1));
            let next = match (event, timer) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => return Ok(end(now, EndReason::Idle)),
            };
            if next > deadline {
                return Ok(end(deadline, EndReason::Until));
            }
            now = next;
        }
    }
}

/// Runs `spec` over `fleet` with the engine, scripted by `outcomes`.
pub fn simulate<D: SimDevice>(
    spec: RolloutSpec,
    fleet: &[D],
    device_groups: Vec<DeviceGroup>,
    outcomes: &Outcomes,
    options: SimOptions,
) -> Result<SimReport, SimError> {
    let start = options.start;
    let rollout = spec.name.clone();
    let mut sim = Sim {
        engine: Engine::new(SystemZones),
        rollout: rollout.clone(),
        start,
        fleet,
        scripts: outcomes.scripts(),
        devices: Vec::with_capacity(fleet.len()),
        index: HashMap::with_capacity(fleet.len()),
        queue: BTreeMap::new(),
        timeline: Vec::new(),
        artifact_size: options.artifact_size,
    };
    sim.engine.set_device_groups(device_groups);
    for (i, f) in fleet.iter().enumerate() {
        let script = outcomes.rule_for(f);
        let offline_at = sim.scripts[script].offline_at;
        sim.devices.push(Device {
            script,
            online: offline_at != Some(0),
            seq: 0,
            epoch: 0,
            current: None,
            peers: Vec::new(),
        });
        sim.index.insert(f.id(), i);
        let effects = sim.engine.observe_state(sim.state(i, start), start);
        sim.handle(effects, start);
        if let Some(at) = offline_at.filter(|at| *at > 0) {
            sim.schedule(start.saturating_add(at), Event::Offline { device: i });
        }
    }
    for o in &outcomes.operator {
        sim.schedule(
            start.saturating_add(o.at),
            Event::Operator(o.action.clone()),
        );
    }
    let release = ReleaseRef {
        name: spec.release.clone(),
        counter: 1,
        hardware: Vec::new(),
    };
    let effects = sim.engine.create_rollout(spec, release, start)?;
    sim.handle(effects, start);
    let effects = sim.engine.start(&rollout, start)?;
    sim.handle(effects, start);
    let end = sim.run(start, start.saturating_add(options.until))?;
    // The devices' side is done with: its memory goes before the report's copies are made
    // (the peak of a large run).
    sim.devices = Vec::new();
    sim.index = HashMap::new();
    sim.queue = BTreeMap::new();
    let status = sim
        .engine
        .status(&rollout)
        .ok_or_else(|| EngineError::UnknownRollout(rollout.clone()))?;
    let devices = status
        .groups
        .iter()
        .flat_map(|g| g.devices.iter().map(|(d, p)| (d.clone(), p.clone())))
        .collect();
    if options.then_exit {
        std::mem::forget(sim.engine);
    }
    Ok(SimReport {
        timeline: sim.timeline,
        rollout: status,
        devices,
        end,
    })
}

// ---------------------------------------------------------------------------------------------
// The command

/// `flotilla simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// The rollout spec (TOML).
    #[arg(long)]
    pub spec: PathBuf,
    /// The fleet: a JSON array of {"id", "labels", "hardware_id"}.
    #[arg(long)]
    pub fleet: PathBuf,
    /// What the devices and the operator do (TOML); without it every device is ready 30s after
    /// its action arrives.
    #[arg(long)]
    pub outcomes: Option<PathBuf>,
    /// Named device groups that partitions refer to (JSON array).
    #[arg(long)]
    pub groups: Option<PathBuf>,
    /// End the run after this much virtual time (s, m, h, d, or a compound like 2h30m).
    #[arg(long, default_value = "30d")]
    pub until: String,
    /// When the virtual clock starts (RFC 3339, e.g. 2027-01-04T09:00:00Z); matters for
    /// maintenance windows.
    #[arg(long)]
    pub start: Option<String>,
    /// The release's size in bytes, to count bytes by source: a device ready after fetching
    /// from peers counts them from its first peer, the others from the coordinator.
    #[arg(long, value_name = "BYTES")]
    pub artifact_size: Option<u64>,
    /// Print the timeline, final status and device phases as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Reads the files named by the arguments and runs the simulation, for the `simulate` command
/// (which ends the process right after: [`SimOptions::then_exit`]).
pub fn simulate_files(args: &SimulateArgs) -> Result<SimReport, SimError> {
    let until = parse_duration(&args.until).map_err(|reason| SimError::Flag {
        flag: "until",
        value: args.until.clone(),
        reason,
    })?;
    let start = match &args.start {
        Some(text) => parse_rfc3339(text).map_err(|reason| SimError::Flag {
            flag: "start",
            value: text.clone(),
            reason,
        })?,
        None => DEFAULT_START,
    };
    let spec = fleetfile::load_spec(&args.spec)?;
    let fleet = fleetfile::load_fleet_file(&args.fleet)?;
    let groups = match &args.groups {
        Some(path) => fleetfile::load_device_groups(path)?,
        None => Vec::new(),
    };
    let outcomes = match &args.outcomes {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| SimError::ReadOutcomes {
                path: path.clone(),
                source,
            })?;
            Outcomes::from_toml(&text)?
        }
        None => Outcomes::default(),
    };
    let devices = fleet.devices();
    simulate(
        spec,
        &devices,
        groups,
        &outcomes,
        SimOptions {
            start,
            until,
            artifact_size: args.artifact_size,
            then_exit: true,
        },
    )
}

/// Runs `flotilla simulate`: prints the report and returns the exit code (0 finished, 2 not
/// finished, 1 on error with the error on stderr).
pub fn run_simulate(args: &SimulateArgs) -> i32 {
    match simulate_files(args) {
        Ok(report) => {
            if args.json {
                match serde_json::to_string_pretty(&report) {
                    Ok(json) => outln!("{json}"),
                    Err(e) => {
                        eprintln!("error: cannot encode the report: {e}");
                        return 1;
                    }
                }
            } else {
                out!("{}", render(&report));
            }
            let code = report.exit_code();
            // A report of a million devices is millions of small allocations; the command ends
            // here, so they are not freed one by one.
            std::mem::forget(report);
            code
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// `+HH:MM:SS` from the start (hours grow past 24).
pub fn offset(secs: u64) -> String {
    format!(
        "+{:02}:{:02}:{:02}",
        secs / 3600,
        (secs / 60) % 60,
        secs % 60
    )
}

/// Most device rows the text report lists; `--json` has them all.
const DEVICE_ROWS: usize = 40;

/// The report as text: the timeline, how the run ended, the groups and the devices.
pub fn render(report: &SimReport) -> String {
    let mut out = String::new();
    for entry in &report.timeline {
        let _ = writeln!(out, "{}  {}", offset(entry.at), entry.message);
    }
    let why = match report.end.reason {
        EndReason::Done => "the rollout reached its end",
        EndReason::Idle => "nothing else would happen",
        EndReason::Until => "the --until horizon was reached",
    };
    let _ = writeln!(
        out,
        "\nrun ended at {}: {why}; rollout {} is {}",
        offset(report.end.at),
        report.rollout.name,
        report.rollout.state
    );
    let width = view::group_name_width(&report.rollout.groups);
    for g in &report.rollout.groups {
        out.push_str(&view::group_line(g, width));
        out.push('\n');
    }
    out.push_str(&view::sites_and_bytes(&report.rollout));
    let id_width = report
        .devices
        .keys()
        .map(String::len)
        .max()
        .unwrap_or(0)
        .max(6);
    let _ = writeln!(out, "\n{:id_width$}  PHASE", "DEVICE");
    for (id, phase) in report.devices.iter().take(DEVICE_ROWS) {
        let _ = writeln!(out, "{id:id_width$}  {phase}");
    }
    if report.devices.len() > DEVICE_ROWS {
        let _ = writeln!(
            out,
            "… {} more devices (--json lists them all)",
            report.devices.len() - DEVICE_ROWS
        );
    }
    out
}

/// Parses `YYYY-MM-DDTHH:MM:SS` followed by `Z` or `±HH:MM` (fractions of a second ignored).
pub fn parse_rfc3339(text: &str) -> Result<u64, String> {
    flotilla_rollout::spec::rfc3339(text)
        .ok_or_else(|| "expected an RFC 3339 time after 1970, like 2027-01-04T09:00:00Z".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(n: usize, canary: usize) -> Vec<FleetDevice> {
        (0..n)
            .map(|i| FleetDevice {
                id: format!("dev-{i:03}"),
                labels: BTreeMap::from([(
                    "env".to_owned(),
                    if i < canary { "canary" } else { "prod" }.to_owned(),
                )]),
                hardware_id: "pi4".into(),
            })
            .collect()
    }

    fn spec(groups: &str) -> RolloutSpec {
        RolloutSpec::from_toml(
            &format!("name = \"fw-2-4\"\nrelease = \"fw-2.4.0\"\n{groups}"),
            &SystemZones,
        )
        .expect("valid spec")
    }

    const CANARY_REST: &str = "[groups]\nerror = { threshold = \"20%\" }\n\
        [[groups.group]]\nname = \"canary\"\nselect = \"env=canary\"\n\
        [[groups.group]]\nname = \"rest\"\n";

    fn run(groups: &str, outcomes: &str) -> SimReport {
        let outcomes = Outcomes::from_toml(outcomes).expect("valid outcomes");
        simulate(
            spec(groups),
            &fleet(10, 2),
            Vec::new(),
            &outcomes,
            SimOptions::default(),
        )
        .expect("runs")
    }

    fn at(report: &SimReport, needle: &str) -> Option<u64> {
        report
            .timeline
            .iter()
            .find(|t| t.message.contains(needle))
            .map(|t| t.at)
    }

    #[test]
    fn groups_start_when_the_previous_one_is_ready() {
        let r = run(
            "[groups]\ncount = 3\n",
            "default = { ready_after = \"2m\" }\n",
        );
        assert_eq!(r.exit_code(), 0);
        assert_eq!(r.rollout.state, "finished");
        assert_eq!(at(&r, "group group-1 started"), Some(0));
        assert_eq!(at(&r, "group group-2 started"), Some(120));
        assert_eq!(at(&r, "group group-3 started"), Some(240));
        assert_eq!(at(&r, "finished: 10 of 10"), Some(360));
        assert_eq!(
            r.end,
            End {
                at: 360,
                reason: EndReason::Done
            }
        );
        assert!(r.devices.values().all(|p| p == "ready"));
    }

    #[test]
    fn a_failing_canary_pauses_and_the_operator_resumes() {
        let r = run(
            CANARY_REST,
            "[[device]]\nid = \"dev-001\"\nfail_after = \"20s\"\nreason = \"health check nginx failed\"\n\
             [[operator]]\nat = \"1h\"\ncommand = \"resume\"\n",
        );
        assert_eq!(
            at(
                &r,
                "group canary paused rollout fw-2-4: 1 of 2 failed > 20%"
            ),
            Some(20)
        );
        assert_eq!(at(&r, "resumed by operator"), Some(3600));
        assert_eq!(at(&r, "group rest started"), Some(3600));
        assert_eq!(r.rollout.state, "finished");
        assert_eq!(r.devices["dev-001"], "failed");
    }

    #[test]
    fn cancel_drops_pending_reports_and_stop_ends_the_run() {
        let r = run(
            CANARY_REST,
            "default = { ready_after = \"10m\" }\n[[operator]]\nat = \"1m\"\ncommand = \"stop\"\n",
        );
        assert_eq!(r.exit_code(), 2);
        assert_eq!(r.rollout.state, "stopped");
        assert_eq!(r.end.at, 60);
        assert_eq!(r.devices["dev-000"], "canceled");
        // A stop cancels the actions that were never sent too (on the server, no message).
        assert_eq!(r.devices["dev-005"], "canceled");
    }

    #[test]
    fn silent_and_offline_devices_leave_the_rollout_waiting() {
        let r = run(
            CANARY_REST,
            "[[device]]\nid = \"dev-000\"\nsilent = true\n[[device]]\nid = \"dev-001\"\noffline_at = \"10s\"\n",
        );
        assert_eq!(r.exit_code(), 2);
        assert_eq!(r.rollout.state, "running");
        assert_eq!(r.devices["dev-000"], "issued", "never answered");
        assert_eq!(
            r.devices["dev-001"], "accepted",
            "went offline before ready"
        );
        assert!(r.end.at <= DEFAULT_UNTIL);
    }

    #[test]
    fn refused_operator_commands_are_in_the_timeline() {
        let r = run(
            "[groups]\ncount = 1\n",
            "[[operator]]\nat = \"5m\"\ncommand = \"resume\"\n",
        );
        // The rollout finished at 30s; nothing is left to resume at 5m, and the run ended first.
        assert_eq!(r.end.at, 30);
        let r = run(
            "[groups]\ncount = 1\n",
            "default = { ready_after = \"1h\" }\n[[operator]]\nat = \"5m\"\ncommand = \"resume\"\n",
        );
        assert_eq!(
            at(
                &r,
                "operator resume refused: rollout fw-2-4 is running; cannot resume it"
            ),
            Some(300)
        );
    }

    #[test]
    fn outcomes_errors_name_the_entry_and_field() {
        let err = |text: &str| Outcomes::from_toml(text).expect_err("invalid").to_string();
        assert_eq!(
            err("[[device]]\nid = \"a\"\nready_after = \"2x\"\n"),
            "outcomes file: device[0].ready_after: \"2x\": unknown unit \"x\"; use s, m, h or d"
        );
        assert!(err("[[device]]\nready_after = \"2m\"\n")
            .contains("device[0]: set exactly one of id and select"));
        assert!(
            err("[[device]]\nid = \"a\"\nready_after = \"1s\"\nsilent = true\n")
                .contains("only one of")
        );
        assert!(err("[[operator]]\nat = \"1h\"\ncommand = \"reboot\"\n")
            .contains("operator[0].command: \"reboot\" is not one of"));
        assert!(err("[[device]]\nselect = \"env in (\"\nsilent = true\n")
            .starts_with("outcomes file: device[0].select:"));
        assert!(err("bogus = 1\n").contains("bogus"));
    }

    #[test]
    fn rules_match_by_id_then_selector_over_the_default() {
        let o = Outcomes::from_toml(
            "default = { ready_after = \"1m\" }\n\
             [[device]]\nid = \"dev-000\"\nsilent = true\n\
             [[device]]\nselect = \"env=canary\"\nfail_after = \"5s\"\n\
             [[device]]\nselect = \"env=prod\"\noffline_at = \"1h\"\n",
        )
        .expect("valid");
        let f = fleet(3, 2);
        assert_eq!(o.script_for(&f[0]).answer, Answer::Silent);
        assert!(matches!(
            o.script_for(&f[1]).answer,
            Answer::Fail { after: 5, .. }
        ));
        let prod = o.script_for(&f[2]);
        assert_eq!(prod.answer, Answer::Ready { after: 60 });
        assert_eq!(prod.offline_at, Some(3600));
    }

    #[test]
    fn rfc3339_times() {
        assert_eq!(parse_rfc3339("2027-01-04T09:00:00Z"), Ok(1_799_053_200));
        assert_eq!(
            parse_rfc3339("2027-01-04T10:00:00+01:00"),
            Ok(1_799_053_200)
        );
        assert_eq!(parse_rfc3339("2027-01-04T09:00:00.250Z"), Ok(1_799_053_200));
        assert!(parse_rfc3339("2027-02-30T09:00:00Z").is_err());
        assert!(parse_rfc3339("yesterday").is_err());
        assert_eq!(offset(3 * 86_400 + 3723), "+73:02:03");
    }
}
