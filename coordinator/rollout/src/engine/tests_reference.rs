//! The engine against the reference documents (`hawkbit-rollout-data-model.txt`,
//! `kubefleet-safe-rollout.txt`, `kubefleet-staged-update.txt`), each test quoting the passage
//! it holds the engine to, and the stored state a restart depends on.

use super::*;
use crate::zoneinfo::SystemZones;
use flotilla_protocol::control::{Compared, TraceEntry, TraceKind};
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
    // The example: "group canary paused: 3 of 20 failed > 10%", as fields.
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
