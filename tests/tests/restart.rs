//! A coordinator restart in the middle of a rollout with a dynamic group: real coordinator and
//! agent processes. What the rollout has seen is stored with it, so a restart never changes
//! which devices count as newly registered. On the way, the rollout's published summaries pass
//! through hawkBit's `creating` and `starting`.

use std::fs;

use flotilla_protocol::control::RolloutStatus;
use flotilla_tests::{AgentOptions, BrokerKind, Site, WAIT};

const NEW_FIRMWARE: &[u8] = b"firmware 2.0: faster, safer\n";

/// hawkBit groups over the canaries only; every other device is left out (unassigned), and
/// devices registering after the start join the `dynamic` group.
const SPEC: &str = r#"
name = "fw-dyn"
release = "fw-2"
[groups]
dynamic = true
[[groups.group]]
name = "canary"
select = "ring=canary"
"#;

fn group_of<'a>(status: &'a RolloutStatus, device: &str) -> Option<&'a str> {
    status
        .groups
        .iter()
        .find(|g| g.devices.contains_key(device))
        .map(|g| g.name.as_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_does_not_turn_left_out_devices_into_new_ones() {
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-2", 2, NEW_FIRMWARE);
    site.start_coordinator();
    site.add_agent("dev-canary", &[("ring", "canary")], AgentOptions::default());
    site.add_agent("dev-left", &[("ring", "main")], AgentOptions::default());
    site.wait_devices(2).await;
    let summaries = site
        .watcher(&["flotilla/v1/events/rollouts/fw-dyn".to_owned()])
        .await;

    let created = site.create_and_start(SPEC).await;
    assert_eq!(group_of(&created, "dev-canary"), Some("canary"));
    assert_eq!(group_of(&created, "dev-left"), None, "{created:#?}");
    site.wait_status("fw-dyn", "the canary to be ready", WAIT, |s| {
        s.groups[0].ready == 1
    })
    .await;

    // hawkBit's creating and starting are published on the way to ready and running.
    let mut states: Vec<String> = Vec::new();
    for m in summaries.messages() {
        let status: RolloutStatus = serde_json::from_slice(&m.payload).expect("summary JSON");
        if states.last() != Some(&status.state) {
            states.push(status.state);
        }
    }
    assert_eq!(
        states[..4],
        ["creating", "ready", "starting", "running"],
        "{states:?}"
    );

    site.kill_coordinator();
    site.start_coordinator();
    // The restarted coordinator has read dev-left's retained state again…
    site.wait_online("dev-left", true).await;
    // …and only then does a really new device register.
    site.add_agent("dev-new", &[("ring", "main")], AgentOptions::default());
    let status = site
        .wait_status("fw-dyn", "the new device to be updated", WAIT, |s| {
            s.groups
                .iter()
                .any(|g| g.devices.get("dev-new").map(String::as_str) == Some("ready"))
        })
        .await;

    assert_eq!(group_of(&status, "dev-new"), Some("dynamic"));
    assert_eq!(
        group_of(&status, "dev-left"),
        None,
        "a device the rollout saw before the restart joined the dynamic group after it: {:#?}",
        status.groups
    );
    assert!(
        !status
            .trace
            .iter()
            .any(|t| t.message.contains("device dev-left registered")),
        "{:#?}",
        status.trace
    );
    assert_eq!(
        fs::read(site.target_file("dev-new")).expect("dev-new's target"),
        NEW_FIRMWARE
    );
    assert_ne!(
        fs::read(site.target_file("dev-left")).ok().as_deref(),
        Some(NEW_FIRMWARE),
        "dev-left was never part of the rollout and keeps what it had"
    );
}

/// A device updated by a rollout that then goes away without a word (killed: the broker
/// publishes its last will, which names no release) still shows the release it runs in
/// `flotilla devices`, before and after a coordinator restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offline_device_shows_its_release_after_a_restart() {
    let mut site = Site::new(BrokerKind::Mosquitto);
    site.release("fw-2", 2, NEW_FIRMWARE);
    site.start_coordinator();
    site.add_agent("dev-gone", &[], AgentOptions::default());
    site.wait_devices(1).await;
    site.create_and_start("name = \"fw-off\"\nrelease = \"fw-2\"\n[groups]\ncount = 1\n")
        .await;
    let ended = site.wait_ended("fw-off").await;
    assert_eq!(ended.state, "finished", "{ended:#?}");
    let installed = |site: &Site| {
        let table = site.flotilla(&["devices"]);
        let row: Vec<String> = table
            .lines()
            .find(|l| l.starts_with("dev-gone "))
            .map(|l| l.split_whitespace().map(str::to_owned).collect())
            .unwrap_or_default();
        (row, table)
    };

    site.kill_agent("dev-gone");
    site.wait_online("dev-gone", false).await;
    let (row, table) = installed(&site);
    assert_eq!(
        row.get(1..4),
        Some(&["no".to_owned(), "accepted".into(), "fw-2".into()][..]),
        "{table}"
    );

    site.kill_coordinator();
    site.start_coordinator();
    site.wait_online("dev-gone", false).await;
    let (row, table) = installed(&site);
    assert_eq!(
        row.get(1..4),
        Some(&["no".to_owned(), "accepted".into(), "fw-2".into()][..]),
        "after the restart: {table}"
    );
}
