use super::*;
use flotilla_rollout::planner;
use flotilla_rollout::spec::RolloutSpec;
use flotilla_rollout::zoneinfo::SystemZones;

#[test]
fn parses_devices_with_defaults() {
    let fleet = parse_fleet(
        r#"[{"id": "dev-1", "labels": {"env": "canary"}, "hardware_id": "pi4"},
            {"id": "dev-2"}]"#,
    )
    .expect("valid");
    assert_eq!(fleet.len(), 2);
    assert_eq!(fleet[0].labels["env"], "canary");
    assert_eq!(fleet[0].hardware_id, "pi4");
    assert_eq!(fleet[1].hardware_id, "any");
    assert!(fleet[1].labels.is_empty());
}

#[test]
fn reads_devices_json_and_leaves_out_devices_not_accepted() {
    let fleet = parse_fleet_file(
        br#"[{"id": "a", "hardware_id": "pi4", "labels": {"env": "prod"}, "online": true,
             "installed": "fw-1", "rollout": null, "phase": "ready", "reason": null,
             "enrollment": "accepted"},
            {"id": "b", "hardware_id": "pi4", "labels": {}, "online": false,
             "installed": null, "enrollment": "accepted, new key pending"},
            {"id": "c", "hardware_id": "", "labels": {}, "online": false,
             "enrollment": "pending"}]"#,
    )
    .expect("devices --json is a fleet file");
    let ids: Vec<&str> = fleet.devices().iter().map(|d| d.id()).collect();
    assert_eq!(ids, ["a", "b"]);
    assert_eq!(
        fleet.left_out,
        [LeftOut {
            id: "c".into(),
            enrollment: "pending".into()
        }]
    );
    let err = parse_fleet(r#"[{"id": "a", "online": "yes"}]"#).expect_err("bad type");
    assert_eq!(
        err.to_string(),
        "fleet[0].online: expected a boolean, found a string"
    );
}

#[test]
fn a_plan_names_accepted_devices_without_a_state_as_the_coordinator_does() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let fleet = dir.path().join("fleet.json");
    std::fs::write(
        &fleet,
        r#"[{"id": "a", "hardware_id": "pi4", "labels": {"env": "prod"},
             "enrollment": "accepted"},
            {"id": "b", "hardware_id": "", "labels": {}, "online": false,
             "enrollment": "accepted, no state since restart"},
            {"id": "c", "hardware_id": "", "labels": {}, "enrollment": "pending"}]"#,
    )
    .expect("write fleet");
    let plan_with = |extra: &str| {
        let spec = dir.path().join("spec.toml");
        let text = format!(
            "name = \"r\"\nrelease = \"fw-2\"\nselect = \"env=prod\"\n{extra}[groups]\ncount = 1\n"
        );
        std::fs::write(&spec, text).expect("write spec");
        plan_files(&PlanArgs {
            spec,
            fleet: fleet.clone(),
            groups: None,
            strategy_file: None,
            json: false,
        })
    };
    let (plan, left_out) = plan_with("").expect("plans");
    assert_eq!(plan.groups[0].devices, ["a"]);
    assert_eq!(plan.excluded.len(), 1);
    assert_eq!(plan.excluded[0].device, "b");
    assert_eq!(plan.excluded[0].reason, planner::unknown_reason(false));
    assert!(plan_table(&plan).contains("excluded b: accepted, no state since restart: "));
    assert_eq!(
        left_out.iter().map(|l| l.id.as_str()).collect::<Vec<_>>(),
        ["c"]
    );
    let err = plan_with("unknown_devices = \"refuse\"\n").expect_err("refused");
    assert!(
        err.to_string().starts_with(
            "unknown_devices = \"refuse\": 1 accepted devices have sent no state since the coordinator started, so whether the rollout selects them is unknown (b)"
        ),
        "{err}"
    );
}

#[test]
fn errors_name_the_index_and_field() {
    let err = |text: &str| parse_fleet(text).expect_err("invalid").to_string();
    assert_eq!(
        err(r#"[{"id": "a"}, {"id": "a"}]"#),
        "fleet[1].id: \"a\" is already used by fleet[0]"
    );
    assert_eq!(err(r#"[{"id": "a"}, {}]"#), "fleet[1].id: missing");
    assert_eq!(
        err(r#"[{"id": "b"}, {"id": "a", "enrollment": "pending"}, {"id": "a"}, {"id": 7}]"#),
        "fleet[2].id: \"a\" is already used by fleet[1]",
        "the first error in file order, a repeated id of a device left out too"
    );
    assert_eq!(
        err(r#"[{"id": "a", "labels": {"env": "x", "env": 1}}]"#),
        "fleet[0].labels.env: expected a string, found a number",
        "the last of a repeated key counts, as in a JSON object"
    );
    assert_eq!(
        err(r#"[{"id": 7}]"#),
        "fleet[0].id: expected a string, found a number"
    );
    assert!(err(r#"[{"id": "a/b"}]"#).starts_with("fleet[0].id: device id \"a/b\" contains '/'"));
    assert_eq!(
        err(r#"[{"id": "a", "labels": {"env": 1}}]"#),
        "fleet[0].labels.env: expected a string, found a number"
    );
    assert!(err(r#"[{"id": "a", "hw": "pi4"}]"#).contains("fleet[0]: unknown field \"hw\""));
    assert_eq!(
        err(r#"{"id": "a"}"#),
        "fleet file: expected a JSON array of devices, found an object"
    );
    assert!(err("[").starts_with("fleet file is not JSON"));
}

#[test]
fn the_compact_fleet_in_id_order_plans_as_the_fleet_devices_do() {
    let text = r#"[{"id": "d", "labels": {"env": "prod", "site": "ber"}},
        {"id": "b", "labels": {"env": "canary"}, "hardware_id": "pi4"},
        {"id": "c", "labels": {"site": "ber", "env": "prod"}},
        {"id": "a", "labels": {"env": "prod"}}, {"id": "e"}]"#;
    let spec = RolloutSpec::from_toml(
        "name = \"r\"\nrelease = \"fw\"\nselect = \"env\"\n[groups]\n\
         [[groups.group]]\nname = \"canary\"\nselect = \"env=canary\"\n\
         [[groups.group]]\nname = \"ber\"\nselect = \"site in (ber)\"\npercent = 50\n\
         [[groups.group]]\nname = \"rest\"\nselect = \"env!=canary\"\n",
        &SystemZones,
    )
    .expect("valid spec");
    let owned = parse_fleet(text).expect("valid");
    let mut fleet = parse_fleet_file(text.as_bytes()).expect("valid");
    fleet.sort_by_id();
    let ids: Vec<&str> = fleet.devices().iter().map(|d| d.id()).collect();
    assert_eq!(ids, ["a", "b", "c", "d", "e"]);
    assert_eq!(
        planner::plan(&spec, &fleet.devices(), &[], &[]).expect("plans"),
        planner::plan(&spec, &owned, &[], &[]).expect("plans")
    );
}

#[test]
fn the_table_shows_groups_sizes_and_conditions() {
    let fleet =
        parse_fleet(r#"[{"id": "c1", "labels": {"env": "canary"}}, {"id": "p1"}, {"id": "p2"}]"#)
            .expect("valid");
    let spec = RolloutSpec::from_toml(
        "name = \"r\"\nrelease = \"fw\"\n[groups]\nerror = { threshold = \"20%\" }\n\
         [[groups.group]]\nname = \"canary\"\nselect = \"env=canary\"\n[[groups.group]]\nname = \"rest\"\n", &SystemZones
    )
    .expect("valid spec");
    let plan = planner::plan(&spec, &fleet, &[], &[]).expect("plans");
    let table = plan_table(&plan);
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("GROUP"), "{table}");
    assert!(lines[1].starts_with("canary"), "{table}");
    assert!(lines[1].contains(">= 100% ready -> next"), "{table}");
    assert!(lines[1].contains("> 20% failed -> pause"), "{table}");
    assert!(lines[2].ends_with("p1, p2"), "{table}");
    assert!(table.contains("3 devices in 2 groups"), "{table}");
}
