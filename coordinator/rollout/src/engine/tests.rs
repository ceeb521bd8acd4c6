use super::*;
use crate::zoneinfo::SystemZones;
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
    RolloutSpec::from_toml(
        &format!("name = \"fw-2-4\"\nrelease = \"fw-2.4.0\"\n{groups}"),
        &SystemZones,
    )
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
        let mut engine = Engine::new(SystemZones);
        for i in 0..devices {
            let effects = engine.observe_state(state(&format!("dev-{i:03}"), &label(i), None), NOW);
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
        Some(("fw-2-4", 1_700_000_000, "pi-17", ActionPart::Attempt(1)))
    );
    assert_eq!(
        parse_action_id("fw-2-4@1700000000:pi-17:3"),
        Some(("fw-2-4", 1_700_000_000, "pi-17", ActionPart::Attempt(3)))
    );
    assert_eq!(
        parse_action_id("fw-2-4@1700000000:pi-17:rollback"),
        Some(("fw-2-4", 1_700_000_000, "pi-17", ActionPart::Rollback))
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
    // hawkBit's `starting` is published before the first group's actions go out.
    assert!(matches!(&effects[1], Effect::Snapshot(s) if s.state == "starting"));
    assert_eq!(
        effects[2],
        Effect::Desired {
            device: "dev-000".into(),
            action_id: format!("fw-2-4@{NOW}:dev-000"),
            rollout: "fw-2-4".into(),
            release: "fw-2.4.0".into(),
            action: ActionType::Forced,
            peers: Vec::new(),
        }
    );
    assert_eq!(effects[4], Effect::Status("fw-2-4".into()));
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
        .contains("canceled 2 device actions, 3 devices not started stay as they are"));
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
    let mut engine = Engine::restore(vec![saved], SystemZones);
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
    let s = RolloutSpec::from_toml(
        "name = \"fw-2-4\"\nrelease = \"fw-2.4.0\"\nselect = \"site=mars\"\n[groups]\ncount = 1\n",
        &SystemZones,
    )
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
    let mut engine = Engine::new(SystemZones);
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

#[test]
fn commands_by_an_operator_name_them_in_the_trace() {
    let mut sim = Sim::new(4, no_labels);
    sim.engine
        .create_rollout_by(spec("[groups]\ncount = 2\n"), release(), "alice", NOW)
        .expect("created");
    assert!(
        sim.last_trace().starts_with("created by alice for release"),
        "{}",
        sim.last_trace()
    );
    let effects = sim
        .engine
        .start_by("fw-2-4", "alice", NOW)
        .expect("started");
    let traced: Vec<String> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Trace(t) => Some(t.message.clone()),
            _ => None,
        })
        .collect();
    assert!(
        traced.iter().any(|m| m == "rollout started by alice"),
        "the events/log entry names alice: {traced:?}"
    );
    sim.engine.pause_by("fw-2-4", "bob", NOW).expect("paused");
    assert_eq!(sim.last_trace(), "paused by bob");
    sim.engine.resume_by("fw-2-4", "bob", NOW).expect("resumed");
    assert_eq!(sim.last_trace(), "resumed by bob");
    sim.engine
        .trigger_next_by("fw-2-4", "carol", NOW)
        .expect("next");
    assert!(
        sim.rollout()
            .trace
            .iter()
            .any(|t| t.message == "carol triggered the next group after group group-1"),
        "{:?}",
        sim.rollout().trace
    );
    sim.engine.stop_by("fw-2-4", "dave", NOW).expect("stopped");
    assert!(
        sim.last_trace().starts_with("stopped by dave; canceled"),
        "{}",
        sim.last_trace()
    );
    // The commands without a name keep the words they always had.
    let mut plain = Sim::new(2, no_labels);
    plain.create_and_start("[groups]\ncount = 1\n");
    plain.engine.pause("fw-2-4", NOW).expect("paused");
    assert_eq!(plain.last_trace(), "paused by operator");
}

#[test]
fn device_releases_name_only_devices_with_a_live_action() {
    let mut sim = Sim::new(4, no_labels);
    assert!(sim.engine.device_releases("dev-000").is_empty());
    sim.create_and_start("[groups]\ncount = 2\n");
    // The first group's devices were sent the release; the second group's were not yet.
    assert_eq!(sim.engine.device_releases("dev-000"), vec!["fw-2.4.0"]);
    assert!(sim.engine.device_releases("dev-002").is_empty());
    assert!(sim.engine.device_releases("nobody").is_empty());
    // Once the device is done with it, the action is no longer live.
    sim.report("dev-000", failed());
    assert!(sim.engine.device_releases("dev-000").is_empty());
}

#[test]
fn summaries_hold_no_device_and_the_device_pages_add_up_to_the_status() {
    let mut sim = Sim::new(300, |i| {
        if i % 2 == 0 {
            vec![("site", "a")]
        } else {
            vec![("site", "b")]
        }
    });
    let effects = sim.create_and_start("[groups]\ncount = 3\n");
    for device in desired(&effects).iter().take(40) {
        sim.report(device, failed());
    }
    let full = sim.engine.status("fw-2-4").expect("status");
    let summary = sim.engine.summary("fw-2-4").expect("summary");
    // The summary is the status without per-device detail: same counts and Fleet summaries.
    assert!(summary
        .groups
        .iter()
        .all(|g| g.devices.is_empty() && g.device_details.is_empty()));
    for (s, f) in summary.groups.iter().zip(&full.groups) {
        assert_eq!(
            (s.total, s.ready, s.failed, &s.summary),
            (f.total, f.ready, f.failed, &f.summary)
        );
    }
    assert!(summary.trace.len() <= SUMMARY_TRACE);
    assert_eq!(summary.trace.last(), full.trace.last());
    let effects = sim.engine.pause("fw-2-4", NOW + 100).expect("paused");
    for effect in &effects {
        if let Effect::Snapshot(s) = effect {
            assert!(s.groups.iter().all(|g| g.devices.is_empty()));
        }
    }
    // Devices in id order across the groups, each with its group, from any cursor on.
    let all: Vec<RolloutDevice> = sim
        .engine
        .rollout_devices("fw-2-4", None)
        .expect("rollout")
        .collect();
    assert_eq!(all.len(), 300);
    assert!(all.windows(2).all(|w| w[0].id < w[1].id));
    let mut rebuilt = summary.clone();
    rebuilt.add_devices(all.clone());
    for (r, f) in rebuilt.groups.iter().zip(&full.groups) {
        assert_eq!(r.devices, f.devices);
        assert_eq!(r.device_details, f.device_details);
    }
    let rest: Vec<String> = sim
        .engine
        .rollout_devices("fw-2-4", Some(&all[149].id))
        .expect("rollout")
        .map(|d| d.id)
        .collect();
    assert_eq!(
        rest,
        all[150..].iter().map(|d| d.id.clone()).collect::<Vec<_>>()
    );
    assert!(sim.engine.rollout_devices("nope", None).is_none());
    assert_eq!(
        sim.engine
            .device_labels("dev-002")
            .and_then(|l| l.label("site")),
        Some("a")
    );
}

/// `flotilla devices` reads a device's installed release from the engine: a device that went
/// away (its last will, online false, names no release) still shows what it runs, while the
/// coordinator runs and after a restart from the stored rollouts.
#[test]
fn an_offline_device_keeps_its_installed_release_across_its_will_and_a_restart() {
    let mut sim = Sim::new(1, no_labels);
    sim.create_and_start("[groups]\ncount = 1\n");
    sim.report("dev-000", Phase::Ready);
    let mut online = state("dev-000", &[], None);
    online.installed = Some(InstalledRelease {
        name: "fw-2.4.0".into(),
        version: "2.4.0".into(),
        counter: 4,
    });
    sim.engine.observe_state(online, sim.now);
    let mut will = state("dev-000", &[], None);
    will.installed = None;
    will.online = false;
    will.at = 0;
    let installed = |engine: &Engine| {
        let d = engine.devices().into_iter().next().expect("one device");
        (d.online, d.installed)
    };

    sim.engine.observe_state(will.clone(), sim.now);
    assert_eq!(installed(&sim.engine), (false, Some("fw-2.4.0".to_owned())));

    let saved: Vec<Rollout> = sim.engine.rollouts().cloned().collect();
    let mut restarted = Engine::restore(saved, SystemZones);
    restarted.observe_state(will.clone(), sim.now);
    assert_eq!(
        installed(&restarted),
        (false, Some("fw-2.4.0".to_owned())),
        "after a restart, from the rollout it became ready in"
    );

    let mut fresh = Engine::new(SystemZones);
    fresh.observe_state(will, sim.now);
    assert_eq!(
        installed(&fresh),
        (false, None),
        "nothing known: nothing shown"
    );
}

/// What a device's page shows: its action with phase and reason, since when it is offline; and
/// per release, how many devices run it and which rollouts roll it out.
#[test]
fn a_device_shows_its_actions_and_last_sight_and_releases_their_use() {
    let mut sim = Sim::new(2, no_labels);
    sim.create_and_start("[groups]\ncount = 1\n");
    let first = sim.group_devices(0)[0].clone();
    sim.report(&first, failed());
    let actions = sim.engine.device_actions(&first);
    assert_eq!(actions.len(), 1, "{actions:?}");
    let action = &actions[0];
    assert_eq!(
        (
            action.rollout.as_str(),
            action.release.as_str(),
            action.detail.phase.as_str()
        ),
        ("fw-2-4", "fw-2.4.0", "failed")
    );
    assert_eq!(
        action.detail.reason.as_deref(),
        Some("health check nginx failed (rolled back)")
    );
    assert!(sim.engine.device_actions("dev-999").is_empty());

    assert_eq!(sim.engine.device(&first).and_then(|d| d.last_seen), None);
    let mut gone = state(&first, &[], None);
    gone.online = false;
    sim.engine.observe_state(gone, NOW + 50);
    let seen = sim.engine.device(&first).expect("known");
    assert_eq!((seen.online, seen.last_seen), (false, Some(NOW + 50)));

    let usage = sim.engine.release_usage();
    assert_eq!(usage["fw-2.3.0"], (2, Vec::new()));
    assert_eq!(usage["fw-2.4.0"], (0, vec!["fw-2-4".to_owned()]));
}
