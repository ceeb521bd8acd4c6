//! Accepted devices the engine holds no state of when a rollout is created: never left out
//! without a word (`planner::exclude_unknown`, `excluded.rs`).

use super::*;
use crate::zoneinfo::SystemZones;
use flotilla_protocol::control::TraceEntry;
use flotilla_protocol::InstalledRelease;

const T0: u64 = 1_800_000_000;

fn state(id: &str, ring: &str) -> DeviceState {
    DeviceState {
        device_id: id.into(),
        hardware_id: "pi4".into(),
        labels: vec![("ring".to_owned(), ring.to_owned())],
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

fn spec(extra: &str) -> RolloutSpec {
    RolloutSpec::from_toml(
        &format!(
            "name = \"r\"\nrelease = \"fw-2\"\nselect = \"ring=a\"\n{extra}[groups]\ncount = 1\n"
        ),
        &SystemZones,
    )
    .expect("valid spec")
}

fn engine() -> Engine {
    let mut engine = Engine::new(SystemZones);
    engine.observe_state(state("d1", "a"), T0);
    engine.observe_state(state("d2", "b"), T0);
    engine
}

#[test]
fn accepted_devices_without_a_state_are_excluded_by_name_in_the_reply_and_the_trace() {
    let mut engine = engine();
    let unknown = vec!["d3".to_owned()];
    let effects = engine
        .create_rollout_knowing(spec(""), release(), "alice", &unknown, T0)
        .expect("created");
    let status = engine.summary("r").expect("summary");
    assert_eq!(status.excluded_count, 1);
    assert_eq!(status.excluded[0].device, "d3");
    assert!(
        status.excluded[0]
            .reason
            .starts_with("accepted, no state since restart: its labels and hardware are unknown"),
        "{}",
        status.excluded[0].reason
    );
    let created = &status.trace[0].message;
    assert!(
        created.ends_with("; 1 accepted devices not planned: no state since restart"),
        "{created}"
    );
    let excluded: Vec<&TraceEntry> = status
        .trace
        .iter()
        .filter(|t| t.kind == TraceKind::DeviceExcluded)
        .collect();
    assert_eq!(excluded.len(), 1, "{:?}", status.trace);
    assert_eq!(excluded[0].device.as_deref(), Some("d3"));
    assert!(excluded[0]
        .message
        .starts_with("device d3 not planned: accepted, no state since restart"));
    // Published on events/log as it is decided.
    assert!(effects
        .iter()
        .any(|e| matches!(e, Effect::Trace(t) if t.kind == TraceKind::DeviceExcluded)));
    // The plan itself is what the selector makes of the devices with a state.
    assert_eq!(
        engine.rollout("r").expect("rollout").groups[0].devices,
        vec!["d1"]
    );
}

#[test]
fn refuse_names_the_devices_without_a_state_and_creates_nothing() {
    let mut engine = engine();
    let unknown: Vec<String> = (0..25).map(|i| format!("x{i:02}")).collect();
    let err = engine
        .create_rollout_knowing(
            spec("unknown_devices = \"refuse\"\n"),
            release(),
            "alice",
            &unknown,
            T0,
        )
        .expect_err("refused");
    let text = err.to_string();
    assert!(
        text.starts_with("unknown_devices = \"refuse\": 25 accepted devices have sent no state since the coordinator started"),
        "{text}"
    );
    assert!(text.contains("(x00, x01,"), "{text}");
    assert!(text.contains("x19 and 5 more)"), "{text}");
    assert!(engine.rollout("r").is_none());
    // With no device missing, the same spec creates the rollout.
    engine
        .create_rollout_knowing(
            spec("unknown_devices = \"refuse\"\n"),
            release(),
            "alice",
            &[],
            T0,
        )
        .expect("created");
}

#[test]
fn many_devices_without_a_state_are_named_up_to_a_bound_and_counted() {
    let mut engine = engine();
    let unknown: Vec<String> = (0..50).map(|i| format!("x{i:02}")).collect();
    engine
        .create_rollout_knowing(spec(""), release(), "alice", &unknown, T0)
        .expect("created");
    let status = engine.summary("r").expect("summary");
    assert_eq!(status.excluded_count, 50);
    assert_eq!(status.excluded.len(), SUMMARY_EXCLUDED);
    let r = engine.rollout("r").expect("rollout");
    let named = r
        .trace
        .iter()
        .filter(|t| t.kind == TraceKind::DeviceExcluded)
        .count();
    assert_eq!(named, planner::UNKNOWN_NAMED);
    let last = &r.trace.last().expect("trace").message;
    assert_eq!(
        last,
        "30 more accepted devices not planned: no state since restart; `flotilla devices` lists them all"
    );
}

#[test]
fn a_dynamic_rollout_takes_a_device_without_a_state_when_its_state_arrives() {
    let mut engine = engine();
    let unknown = vec!["d3".to_owned()];
    let spec = RolloutSpec::from_toml(
        "name = \"r\"\nrelease = \"fw-2\"\nselect = \"ring=a\"\n[groups]\ncount = 1\ndynamic = true\n",
        &SystemZones,
    )
    .expect("valid spec");
    engine
        .create_rollout_knowing(spec, release(), "alice", &unknown, T0)
        .expect("created");
    let reason = &engine.summary("r").expect("summary").excluded[0].reason;
    assert!(
        reason.ends_with("it joins the dynamic group when its state arrives, if it matches"),
        "{reason}"
    );
    engine.start("r", T0).expect("started");
    let effects = engine.observe_state(state("d3", "a"), T0 + 1);
    assert!(
        effects.iter().any(|e| matches!(
            e,
            Effect::Trace(t) if t.kind == TraceKind::DeviceJoined && t.device.as_deref() == Some("d3")
        )),
        "{effects:?}"
    );
}
