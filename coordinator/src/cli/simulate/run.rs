//! The simulation: the real engine against simulated devices and a simulated clock, until the
//! rollout ends or the time is up.

use std::collections::{BTreeMap, HashMap};

use flotilla_protocol::control::{RolloutStatus, TraceEntry};
use flotilla_protocol::{ByteCounts, CurrentAction, DeviceState, Phase, Report};
use serde::{Deserialize, Serialize};

use crate::cli::fleetfile;
use crate::cli::simulate::base::*;
use crate::cli::simulate::script::*;
use flotilla_rollout::engine::{Effect, Engine, EngineError, ReleaseRef, OPERATOR};
use flotilla_rollout::planner::{DeviceGroup, FleetDevice, PlanDevice};
use flotilla_rollout::spec::RolloutSpec;
use flotilla_rollout::zoneinfo::SystemZones;

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
pub(super) enum Event {
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
pub(super) struct Device {
    /// Its script in `Sim::scripts`.
    pub(super) script: usize,
    pub(super) online: bool,
    pub(super) seq: u64,
    /// Bumped by every new action or cancel, so older pending reports are dropped.
    pub(super) epoch: u64,
    /// The action of its last report, and that report's phase.
    pub(super) current: Option<(String, Phase)>,
    /// The peers its last desired action named.
    pub(super) peers: Vec<String>,
}

pub(super) struct Sim<'f, D> {
    pub(super) engine: Engine,
    pub(super) rollout: String,
    pub(super) start: u64,
    pub(super) fleet: &'f [D],
    pub(super) scripts: Vec<Script>,
    pub(super) devices: Vec<Device>,
    pub(super) index: HashMap<&'f str, usize>,
    /// Events by time, each second's in the order they were scheduled.
    pub(super) queue: BTreeMap<u64, Vec<Event>>,
    pub(super) timeline: Vec<TimelineEntry>,
    pub(super) artifact_size: Option<u64>,
}

impl<D: SimDevice> Sim<'_, D> {
    pub(super) fn schedule(&mut self, at: u64, event: Event) {
        self.queue.entry(at).or_default().push(event);
    }

    /// The retained state device `di` publishes.
    pub(super) fn state(&self, di: usize, now: u64) -> DeviceState {
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

    pub(super) fn note(&mut self, now: u64, message: String) {
        self.timeline.push(TimelineEntry {
            at: now - self.start,
            message,
        });
    }

    /// Plays the devices' side of the engine's effects.
    pub(super) fn handle(&mut self, effects: Vec<Effect>, now: u64) {
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

    pub(super) fn trace(&mut self, entry: TraceEntry) {
        if entry.rollout == self.rollout {
            let at = entry.at.saturating_sub(self.start);
            self.timeline.push(TimelineEntry {
                at,
                message: entry.message,
            });
        }
    }

    /// Schedules a device's scripted reports for a new action.
    pub(super) fn answer(&mut self, di: usize, action_id: String, now: u64, rollback: bool) {
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

    pub(super) fn deliver(&mut self, event: Event, now: u64) {
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

    pub(super) fn terminal(&self) -> bool {
        self.engine.rollout(&self.rollout).is_none_or(|r| {
            matches!(
                r.state.to_string().as_str(),
                "finished" | "stopped" | "failed"
            )
        })
    }

    /// The event loop; returns how the run ended.
    pub(super) fn run(&mut self, mut now: u64, deadline: u64) -> Result<End, SimError> {
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
