//! "Plan against my real fleet": `flotilla plan` reads what the running coordinator's CLI
//! prints (`flotilla devices --json`, `flotilla strategy show NAME`) as they are, and makes the
//! groups the coordinator then makes of the same spec.

use std::collections::BTreeMap;
use std::fs;
use std::process::Command;
use std::time::{Duration, Instant};

use flotilla_tests::{bin, AgentOptions, BrokerKind, Site, WAIT};
use serde_json::Value;

const STRATEGY: &str = r#"
[[stage]]
name = "staging"
select = "env=staging"
[[stage]]
name = "production"
select = "env=prod"
max_concurrency = 1
"#;

const SPEC: &str = r#"
name = "fw-2-staged"
release = "fw-2"
[staged]
strategy = "two-stage"
"#;

/// Group name -> its devices, sorted.
fn groups_of(groups: &Value) -> BTreeMap<String, Vec<String>> {
    groups
        .as_array()
        .expect("groups")
        .iter()
        .map(|g| {
            let mut devices: Vec<String> = match &g["devices"] {
                Value::Array(list) => list
                    .iter()
                    .map(|d| d.as_str().expect("device id").to_owned())
                    .collect(),
                Value::Object(map) => map.keys().cloned().collect(),
                other => panic!("devices of a group: {other}"),
            };
            devices.sort();
            (g["name"].as_str().expect("name").to_owned(), devices)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_takes_devices_json_and_a_stored_strategy_and_matches_the_coordinator() {
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-2", 2, b"firmware 2");
    site.start_coordinator();
    site.add_agent("stage-1", &[("env", "staging")], AgentOptions::default());
    site.add_agent("prod-1", &[("env", "prod")], AgentOptions::default());
    site.add_agent("prod-2", &[("env", "prod")], AgentOptions::default());
    // A device no operator has accepted yet: `devices` lists it, no rollout reaches it.
    let pending = AgentOptions {
        enroll: false,
        ..AgentOptions::default()
    };
    site.add_agent("prod-new", &[("env", "prod")], pending);
    site.wait_devices(3).await;

    fs::write(site.path("two-stage.toml"), STRATEGY).expect("write strategy");
    site.flotilla(&[
        "strategy",
        "create",
        "two-stage",
        "--file",
        &site.path("two-stage.toml").to_string_lossy(),
    ]);

    // What an operator saves from the running coordinator, byte for byte.
    let deadline = Instant::now() + WAIT;
    let devices_json = loop {
        let text = site.flotilla(&["devices", "--json"]);
        if text.contains("\"prod-new\"") {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "the pending device never showed in `flotilla devices --json`: {text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    fs::write(site.path("fleet.json"), &devices_json).expect("write fleet");
    let shown = site.flotilla(&["strategy", "show", "two-stage"]);
    fs::write(site.path("shown.toml"), shown).expect("write shown strategy");
    fs::write(site.path("spec.toml"), SPEC).expect("write spec");

    let plan = Command::new(bin("flotilla"))
        .args(["plan", "--json", "--spec"])
        .arg(site.path("spec.toml"))
        .arg("--fleet")
        .arg(site.path("fleet.json"))
        .arg("--strategy-file")
        .arg(site.path("shown.toml"))
        .output()
        .expect("run flotilla plan");
    let stderr = String::from_utf8_lossy(&plan.stderr);
    assert!(plan.status.success(), "flotilla plan: {stderr}");
    assert!(
        stderr.contains("left out prod-new: enrollment pending"),
        "{stderr}"
    );
    let planned: Value = serde_json::from_slice(&plan.stdout).expect("plan JSON");
    let planned = groups_of(&planned["groups"]);
    assert_eq!(
        planned,
        BTreeMap::from([
            ("staging".to_owned(), vec!["stage-1".to_owned()]),
            (
                "production".to_owned(),
                vec!["prod-1".to_owned(), "prod-2".to_owned()]
            ),
        ])
    );

    // The coordinator makes the same groups of the same spec.
    site.flotilla(&[
        "rollout",
        "create",
        "--spec",
        &site.path("spec.toml").to_string_lossy(),
    ]);
    let status: Value =
        serde_json::from_str(&site.flotilla(&["rollout", "status", "fw-2-staged", "--json"]))
            .expect("status JSON");
    assert_eq!(groups_of(&status["groups"]), planned);

    // Without the strategy's stages, plan says where to get them.
    let missing = Command::new(bin("flotilla"))
        .args(["plan", "--spec"])
        .arg(site.path("spec.toml"))
        .arg("--fleet")
        .arg(site.path("fleet.json"))
        .output()
        .expect("run flotilla plan");
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(!missing.status.success());
    assert!(
        stderr.contains("--strategy-file") && stderr.contains("flotilla strategy show two-stage"),
        "{stderr}"
    );
}
