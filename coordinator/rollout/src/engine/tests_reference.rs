//! The engine against the reference documents (`hawkbit-rollout-data-model.txt`,
//! `kubefleet-safe-rollout.txt`, `kubefleet-staged-update.txt`), each test quoting the passage
//! it holds the engine to, and the stored state a restart depends on.

use super::*;
use crate::zoneinfo::SystemZones;
use flotilla_protocol::control::{Compared, Condition, GroupStatus, TraceEntry, TraceKind};
use flotilla_protocol::InstalledRelease;

const T0: u64 = 1_800_000_000;

fn state(id: &str, labels: &[(&str, &str)]) -> DeviceState {
    DeviceState {
        device_id: id.into(),
        hardware_id: "pi4".into(),
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        installed: Some(InstalledRelease {
            name: "fw-1".into(),
            version: "1".into(),
            counter: 1,
        }),
        current: None,
        online: true,
        agent_version: "0.1.0".into(),
        at: T0,
    }
}

fn release() -> ReleaseRef {
    ReleaseRef {
        name: "fw-2".into(),
        counter: 2,
        hardware: Vec::new(),
    }
}

fn spec(name: &str, body: &str) -> RolloutSpec {
    RolloutSpec::from_toml(
        &format!("name = \"{name}\"\nrelease = \"fw-2\"\n{body}"),
        &SystemZones,
    )
    .expect("valid spec")
}

fn sent(effects: &[Effect]) -> Vec<String> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Desired { device, .. } => Some(device.clone()),
            _ => None,
        })
        .collect()
}

/// Through the store's encoding, as a restarted coordinator reads it.
fn stored(engine: &Engine) -> Vec<Rollout> {
    engine
        .rollouts()
        .map(|r| {
            let json = serde_json::to_string(r).expect("encodes");
            serde_json::from_str(&json).expect("decodes")
        })
        .collect()
}

fn group_of(engine: &Engine, rollout: &str, device: &str) -> Option<String> {
    engine
        .rollout(rollout)?
        .groups
        .iter()
        .find(|g| g.slots.contains_key(device))
        .map(|g| g.name.clone())
}

const DYNAMIC: &str =
    "[groups]\ndynamic = true\n[[groups.group]]\nname = \"canary\"\nselect = \"ring=canary\"\n";

#[test]
fn a_restart_never_changes_who_is_new_to_a_dynamic_rollout() {
    let mut engine = Engine::new(SystemZones);
    engine.observe_state(state("canary", &[("ring", "canary")]), T0);
    engine.observe_state(state("left-out", &[("ring", "main")]), T0);
    engine
        .create_rollout(spec("dyn", DYNAMIC), release(), T0)
        .expect("created");
    // Registered after the creation, before the start: not new once the rollout runs.
    engine.observe_state(state("early", &[("ring", "main")]), T0 + 1);
    let effects = engine.start("dyn", T0 + 2).expect("started");
    assert_eq!(sent(&effects), ["canary"]);

    let mut engine = Engine::restore(stored(&engine), SystemZones);
    for id in ["canary", "left-out", "early"] {
        let ring = if id == "canary" { "canary" } else { "main" };
        let effects = engine.observe_state(state(id, &[("ring", ring)]), T0 + 10);
        assert!(
            sent(&effects).is_empty(),
            "{id} is not new after the restart"
        );
    }
    assert_eq!(group_of(&engine, "dyn", "left-out"), None);
    assert_eq!(group_of(&engine, "dyn", "early"), None);

    let effects = engine.observe_state(state("late", &[("ring", "main")]), T0 + 11);
    assert_eq!(group_of(&engine, "dyn", "late").as_deref(), Some("dynamic"));
    assert!(
        effects
            .iter()
            .any(|e| matches!(e, Effect::Save(r) if r == "dyn")),
        "who the rollout has seen is saved with it"
    );
    // And that survives a second restart.
    let mut engine = Engine::restore(stored(&engine), SystemZones);
    engine.observe_state(state("late", &[("ring", "main")]), T0 + 12);
    assert_eq!(group_of(&engine, "dyn", "late").as_deref(), Some("dynamic"));
    assert_eq!(
        engine
            .rollout("dyn")
            .map(|r| r.groups.last().map(|g| g.devices.len())),
        Some(Some(1))
    );
}

/// Sends a device's report for its first attempt in rollout `name`.
fn report(
    engine: &mut Engine,
    name: &str,
    device: &str,
    seq: u64,
    phase: Phase,
    now: u64,
) -> Vec<Effect> {
    let created_at = engine.rollout(name).expect("rollout exists").created_at;
    engine.observe_report(
        Report {
            device_id: device.into(),
            seq,
            action_id: action_id(name, created_at, device),
            rollout_id: name.into(),
            phase,
            at: now,
        },
        now,
    )
}

fn traces(effects: &[Effect]) -> Vec<TraceEntry> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Trace(t) => Some(t.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn trace_entries_name_the_decision_its_subjects_and_numbers() {
    let mut engine = Engine::new(SystemZones);
    for i in 0..21 {
        engine.observe_state(state(&format!("dev-{i:02}"), &[]), T0);
    }
    let created = engine
        .create_rollout_by(
            spec(
                "tr",
                "[groups]\ncount = 1\nerror = { threshold = \"10%\", action = \"pause\" }\n",
            ),
            release(),
            "alice",
            T0,
        )
        .expect("created");
    let created = traces(&created);
    assert_eq!(
        (created[0].kind, created[0].by.as_deref()),
        (TraceKind::Created, Some("alice"))
    );
    let started = traces(&engine.start_by("tr", "bob", T0).expect("started"));
    assert_eq!(
        (started[0].kind, started[0].by.as_deref()),
        (TraceKind::Started, Some("bob"))
    );
    assert!(started
        .iter()
        .any(|t| t.kind == TraceKind::GroupStarted && t.group.as_deref() == Some("group-1")));

    let deleted = traces(
        &engine
            .delete_device_by("dev-20", "dave", T0)
            .expect("deleted"),
    );
    assert!(deleted.iter().any(|t| t.kind == TraceKind::DeviceDeleted
        && t.device.as_deref() == Some("dev-20")
        && t.by.as_deref() == Some("dave")));

    let failed = Phase::Failed {
        reason: "health check failed".into(),
        rolled_back: true,
    };
    let mut last = Vec::new();
    for i in 0..3 {
        last = report(
            &mut engine,
            "tr",
            &format!("dev-{i:02}"),
            1,
            failed.clone(),
            T0 + 1,
        );
    }
    // The issue's example: "group canary paused: 3 of 20 failed > 10%", as fields.
    let paused = traces(&last)
        .into_iter()
        .find(|t| t.kind == TraceKind::ErrorPaused)
        .expect("the error condition paused the rollout");
    assert_eq!(paused.group.as_deref(), Some("group-1"));
    assert_eq!(paused.by, None, "the engine's own decision");
    assert_eq!(
        paused.compared,
        Some(Compared {
            counted: "failed".into(),
            count: 3,
            of: 20,
            op: ">".into(),
            threshold: "10%".into(),
            met: true,
        })
    );
    assert!(
        paused.message.contains("3 of 20 failed > 10%"),
        "the words stay: {}",
        paused.message
    );

    let resumed = traces(&engine.resume_by("tr", "carol", T0 + 2).expect("resumed"));
    assert_eq!(
        (resumed[0].kind, resumed[0].by.as_deref()),
        (TraceKind::Resumed, Some("carol"))
    );
}

fn group_status(engine: &Engine, rollout: &str, gi: usize) -> GroupStatus {
    engine.status(rollout).expect("status").groups[gi].clone()
}

#[test]
fn deleted_devices_follow_hawkbit_by_the_state_of_their_group() {
    let mut engine = Engine::new(SystemZones);
    for i in 0..6 {
        engine.observe_state(state(&format!("dev-{i:02}"), &[]), T0);
    }
    engine
        .create_rollout(spec("del", "[groups]\ncount = 3\n"), release(), T0)
        .expect("created");
    engine.start("del", T0).expect("started");
    for d in ["dev-00", "dev-01"] {
        report(&mut engine, "del", d, 1, Phase::Ready, T0 + 1);
    }
    let g = group_status(&engine, "del", 1);
    assert_eq!(g.state, "running");

    // "If you delete Targets of a Rollout Group that has finished, the Targets will move from
    // finished (green in the UI) to not started (grey color in UI). The count of the Rollout
    // Group and Rollout will not get updated."
    engine.delete_device("dev-00", T0 + 2).expect("deleted");
    let g = group_status(&engine, "del", 0);
    assert_eq!(g.state, "finished");
    assert_eq!(g.devices["dev-00"], "not_started");
    assert_eq!((g.total, g.ready), (2, 2), "counts stay");

    // "If you delete Targets of a Rollout Group which has not started yet, the Targets will
    // move from scheduled (blue color in UI) to not started (grey color in UI). As soon as the
    // Rollout Group starts the count of the Rollout Group and Rollout will get updated."
    engine.delete_device("dev-05", T0 + 3).expect("deleted");
    let g = group_status(&engine, "del", 2);
    assert_eq!(g.state, "scheduled");
    assert_eq!(g.devices["dev-05"], "not_started");
    assert_eq!((g.total, g.scheduled), (2, 2), "not yet updated");

    // "If you delete targets of a running Rollout Group, the count of the Rollout Group and
    // Rollout will get updated as soon as the Scheduler task has executed."
    engine.delete_device("dev-03", T0 + 4).expect("deleted");
    let g = group_status(&engine, "del", 1);
    assert!(!g.devices.contains_key("dev-03"));
    assert_eq!(g.total, 1);

    let effects = report(&mut engine, "del", "dev-02", 1, Phase::Ready, T0 + 5);
    assert_eq!(
        sent(&effects),
        ["dev-04"],
        "the deleted device gets nothing"
    );
    let g = group_status(&engine, "del", 2);
    assert_eq!(g.state, "running");
    assert_eq!(g.total, 1, "updated when the group started");
    assert!(!g.devices.contains_key("dev-05"));
    assert!(engine
        .rollout("del")
        .expect("rollout")
        .trace
        .iter()
        .any(|t| t.message.contains("1 deleted device left it: dev-05")));

    // Finished rollouts keep the deleted device as not started, across a restart too.
    report(&mut engine, "del", "dev-04", 1, Phase::Ready, T0 + 6);
    assert_eq!(
        engine.status("del").map(|s| s.state),
        Some("finished".into())
    );
    let mut engine = Engine::restore(stored(&engine), SystemZones);
    assert_eq!(
        group_status(&engine, "del", 0).devices["dev-00"],
        "not_started"
    );
    assert!(engine.reissue(T0 + 7).is_empty());
}

/// The strategy of kubefleet-staged-update.txt's example run.
const EXAMPLE_RUN: &str = r#"
[[staged.stage]]
name = "staging"
select = "environment=staging"
after = { approval = true, wait = "1m" }

[[staged.stage]]
name = "canary"
select = "environment=canary"
after = { approval = true }

[[staged.stage]]
name = "production"
select = "environment=production"
sort_by = "order"
after = { approval = true, wait = "1m" }
"#;

fn condition<'a>(conditions: &'a [Condition], kind: &str) -> Option<(bool, &'a str)> {
    conditions
        .iter()
        .find(|c| c.kind == kind)
        .map(|c| (c.status, c.reason.as_str()))
}

#[test]
fn staged_run_status_has_kubefleets_shape() {
    let mut engine = Engine::new(SystemZones);
    engine.observe_state(state("member1", &[("environment", "staging")]), T0);
    engine.observe_state(state("member2", &[("environment", "canary")]), T0);
    engine
        .create_rollout(spec("example-run", EXAMPLE_RUN), release(), T0)
        .expect("created");

    // "StagedUpdateStrategySnapshot: the snapshot of the updateRun strategy, which ensures any
    // strategy changes will not affect executing updateRuns."
    let status = engine.status("example-run").expect("status");
    let snapshot = status
        .strategy_snapshot
        .expect("a staged run shows its snapshot");
    let names: Vec<&str> = snapshot.stages.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["staging", "canary", "production"]);
    let staging: Vec<(&str, Option<&str>)> = snapshot.stages[0]
        .after
        .iter()
        .map(|t| (t.kind.as_str(), t.wait.as_deref()))
        .collect();
    assert_eq!(staging, [("Approval", None), ("TimedWait", Some("1m"))]);
    assert_eq!(snapshot.stages[2].sort_by.as_deref(), Some("order"));
    assert_eq!(snapshot.stages[0].select, "environment=staging");

    engine.start("example-run", T0).expect("started");
    report(
        &mut engine,
        "example-run",
        "member1",
        1,
        Phase::Ready,
        T0 + 15,
    );
    let status = engine.status("example-run").expect("status");
    // "member1 from stage staging has been updated successfully. The stage is waiting for
    // approval": the stage's Progressing is False (StageUpdatingWaiting), the run's stays
    // True (UpdateRunStarted).
    assert_eq!(
        condition(&status.groups[0].conditions, "Progressing"),
        Some((false, "StageUpdatingWaiting"))
    );
    assert_eq!(
        condition(&status.conditions, "Progressing"),
        Some((true, "UpdateRunStarted"))
    );
    // "ClusterUpdatingStarted condition indicates the cluster is being updated and
    // ClusterUpdatingSucceeded condition shows the cluster is updated successfully."
    let member1 = &status.groups[0].device_details["member1"];
    assert_eq!(
        condition(&member1.conditions, "Started"),
        Some((true, "ClusterUpdatingStarted"))
    );
    assert_eq!(
        condition(&member1.conditions, "Succeeded"),
        Some((true, "ClusterUpdatingSucceeded"))
    );
    let member2 = &status.groups[1].device_details["member2"];
    assert!(member2.conditions.is_empty(), "member2 is not updated yet");
    let deletion = status
        .deletion_stage
        .expect("a staged run shows its deletion stage");
    assert_eq!(deletion.state, "scheduled");

    engine
        .approve("example-run-staging", T0 + 76)
        .expect("approved");
    engine.tick(T0 + 76);
    report(
        &mut engine,
        "example-run",
        "member2",
        1,
        Phase::Ready,
        T0 + 91,
    );
    engine
        .approve("example-run-canary", T0 + 216)
        .expect("approved");
    engine.tick(T0 + 216);
    engine
        .approve("example-run-production", T0 + 226)
        .expect("approved");
    engine.tick(T0 + 276);
    let status = engine.status("example-run").expect("status");
    assert_eq!(status.state, "finished");
    // The completed run: Initialized, Progressing (UpdateRunStarted) and Succeeded all True.
    assert_eq!(
        condition(&status.conditions, "Initialized"),
        Some((true, "UpdateRunInitializedSuccessfully"))
    );
    assert_eq!(
        condition(&status.conditions, "Progressing"),
        Some((true, "UpdateRunStarted"))
    );
    assert_eq!(
        condition(&status.conditions, "Succeeded"),
        Some((true, "UpdateRunSucceeded"))
    );
    // "The deletion stage is the last stage of the updateRun. […] The status is pretty much the
    // same as a normal update stage, except that there are no after-stage tasks."
    let deletion = status.deletion_stage.expect("deletion stage");
    assert_eq!(deletion.name, "kubernetes-fleet.io/deleteStage");
    assert!(deletion.devices.is_empty(), "flotilla never uninstalls");
    assert_eq!(
        condition(&deletion.conditions, "Progressing"),
        Some((true, "StageUpdatingStarted"))
    );
    assert_eq!(
        condition(&deletion.conditions, "Succeeded"),
        Some((true, "StageUpdatingSucceeded"))
    );
    assert_eq!(deletion.started_at, deletion.ended_at);
    assert!(deletion.started_at.is_some());

    // Other vocabularies have none of this.
    engine
        .create_rollout(spec("plain", "[groups]\ncount = 1\n"), release(), T0)
        .expect("created");
    let plain = engine.status("plain").expect("status");
    assert!(plain.strategy_snapshot.is_none() && plain.deletion_stage.is_none());
}

/// The states of rollout `name` published on its summary topic, in order.
fn published_states(effects: &[Effect], engine: &Engine, name: &str) -> Vec<String> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Snapshot(s) if s.name == name => Some(s.state.clone()),
            Effect::Status(n) if n == name => engine.status(n).map(|s| s.state),
            _ => None,
        })
        .collect()
}

#[test]
fn creating_and_starting_are_published_on_the_way() {
    let mut engine = Engine::new(SystemZones);
    for i in 0..4 {
        engine.observe_state(state(&format!("dev-{i:02}"), &[]), T0);
    }
    // "creation as well as starting a rollout might take some time. […] The creation and
    // starting progress is reflected by the rollout's status attribute."
    let effects = engine
        .create_rollout(spec("hb", "[groups]\ncount = 2\n"), release(), T0)
        .expect("created");
    assert_eq!(
        published_states(&effects, &engine, "hb"),
        ["creating", "ready"]
    );
    let Some(Effect::Snapshot(creating)) =
        effects.iter().find(|e| matches!(e, Effect::Snapshot(_)))
    else {
        panic!("no creating summary: {effects:?}");
    };
    assert_eq!(
        creating.groups.len(),
        2,
        "the groups are filled while creating"
    );

    // "All necessary deployment actions will be created in scheduled state at starting point.
    // Once all deployment actions have been scheduled, those of the first deployment group
    // will be started and set to running."
    let effects = engine.start("hb", T0).expect("started");
    assert_eq!(
        published_states(&effects, &engine, "hb"),
        ["starting", "running"]
    );
    let starting = effects
        .iter()
        .position(|e| matches!(e, Effect::Snapshot(s) if s.state == "starting"))
        .expect("starting");
    let first_desired = effects
        .iter()
        .position(|e| matches!(e, Effect::Desired { .. }))
        .expect("desired actions");
    assert!(
        starting < first_desired,
        "starting shows while the actions go out"
    );

    // A rollout with a start time passes through starting when the time comes.
    let mut later = spec("hb-later", "[groups]\ncount = 1\n");
    later.policies.start_at = Some(T0 + 100);
    engine
        .create_rollout(later, release(), T0)
        .expect("created");
    let effects = engine.start("hb-later", T0).expect("started");
    assert_eq!(
        published_states(&effects, &engine, "hb-later"),
        ["scheduled"]
    );
    let effects = engine.tick(T0 + 100);
    assert!(effects.iter().any(
        |e| matches!(e, Effect::Snapshot(s) if s.name == "hb-later" && s.state == "starting")
    ));
    assert_eq!(
        engine.status("hb-later").map(|s| s.state),
        Some("running".into())
    );
}
