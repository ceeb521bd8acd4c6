//! The decision trace's JSON schema in `docs/protocol.md` matches the types: every kind is
//! listed, every field is described, and an entry the coordinator writes fits the schema.

use flotilla_protocol::control::{Compared, TraceEntry, TraceKind};
use serde_json::Value;

/// Every kind; the match makes a new variant a compile error here until it is listed.
fn all_kinds() -> Vec<TraceKind> {
    use TraceKind::*;
    let all = vec![
        Created,
        Started,
        StartTimeReached,
        Paused,
        Resumed,
        Stopped,
        GroupStarted,
        DevicesStarted,
        DeviceStarted,
        DeviceSkipped,
        DeviceRetrying,
        DeviceTimedOut,
        DeviceJoined,
        DeviceDeleted,
        DeviceTakenOver,
        DeviceExcluded,
        ActionsCanceled,
        GroupSucceeded,
        GroupFinished,
        GroupFailed,
        SuccessPaused,
        ErrorPaused,
        ErrorStopped,
        ErrorRolledBack,
        ApprovalRequested,
        Approved,
        Denied,
        WaitElapsed,
        Waiting,
        NextTriggered,
        RetryCreated,
        Finished,
        Note,
    ];
    for k in &all {
        match k {
            Created | Started | StartTimeReached | Paused | Resumed | Stopped | GroupStarted
            | DevicesStarted | DeviceStarted | DeviceSkipped | DeviceRetrying | DeviceTimedOut
            | DeviceJoined | DeviceDeleted | DeviceTakenOver | DeviceExcluded | ActionsCanceled
            | GroupSucceeded | GroupFinished | GroupFailed | SuccessPaused | ErrorPaused
            | ErrorStopped | ErrorRolledBack | ApprovalRequested | Approved | Denied
            | WaitElapsed | Waiting | NextTriggered | RetryCreated | Finished | Note => {}
        }
    }
    all
}

fn schema() -> Value {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/protocol.md"))
        .expect("docs/protocol.md");
    let (_, after) = doc
        .split_once("<!-- trace-schema -->")
        .expect("docs/protocol.md marks the trace schema");
    let block = after
        .split_once("```json")
        .and_then(|(_, rest)| rest.split_once("```"))
        .map(|(block, _)| block)
        .expect("a json block after the marker");
    serde_json::from_str(block).expect("the schema is valid JSON")
}

#[test]
fn documented_schema_lists_every_kind_and_field() {
    let schema = schema();
    let listed: Vec<&str> = schema["properties"]["kind"]["enum"]
        .as_array()
        .expect("kind enum")
        .iter()
        .map(|v| v.as_str().expect("kind names are strings"))
        .collect();
    let kinds: Vec<String> = all_kinds().into_iter().map(TraceKind::name).collect();
    assert_eq!(
        listed, kinds,
        "docs/protocol.md lists the kinds in declaration order"
    );

    let entry = TraceEntry::new(
        1,
        "fw",
        "group canary paused rollout fw: 3 of 20 failed > 10%",
    )
    .kind(TraceKind::ErrorPaused)
    .group("canary")
    .device("dev-1")
    .by("alice")
    .coordinator("coord-b at lease epoch 2")
    .compared(Compared {
        counted: "failed".into(),
        count: 3,
        of: 20,
        op: ">".into(),
        threshold: "10%".into(),
        met: true,
    });
    let json = serde_json::to_value(&entry).expect("encodes");
    let props = schema["properties"].as_object().expect("properties");
    for (field, value) in json.as_object().expect("an object") {
        assert!(
            props.contains_key(field),
            "field {field} is not in the schema"
        );
        if let Some(inner) = value.as_object() {
            let inner_props = props[field]["properties"]
                .as_object()
                .expect("nested properties");
            for key in inner.keys() {
                assert!(
                    inner_props.contains_key(key),
                    "{field}.{key} is not in the schema"
                );
            }
            let required: Vec<&str> = props[field]["required"]
                .as_array()
                .expect("required")
                .iter()
                .filter_map(Value::as_str)
                .collect();
            assert_eq!(
                required.len(),
                inner.len(),
                "every field of {field} is required"
            );
        }
    }
    for required in schema["required"].as_array().expect("required") {
        let name = required.as_str().expect("a name");
        assert!(json.get(name).is_some(), "{name} is always written");
    }
    assert_eq!(
        props.len(),
        json.as_object().map_or(0, |o| o.len()),
        "no field undocumented or unwritten"
    );
}
