//! The engine against the reference documents (`hawkbit-rollout-data-model.txt`,
//! `kubefleet-safe-rollout.txt`, `kubefleet-staged-update.txt`), each test quoting the passage
//! it holds the engine to, and the stored state a restart depends on.

use super::*;
use crate::zoneinfo::SystemZones;
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
