//! A plan never loses a device silently, end to end: Mosquitto, a coordinator process and two
//! agent processes.
//!
//! Anyone on the broker can clear a device's retained state (an empty retained message, as an
//! anonymous client here). A coordinator that restarts then holds no state of that device, so
//! it cannot know its labels; the device is still accepted and running. A rollout created then
//! names it as excluded, and why, in the reply and the trace (it once left it out without a
//! word), and a spec with `unknown_devices = "refuse"` is refused naming it.
//!
//! A device sends its state again every `[broker] state_refresh` (decision 0072): cleared the
//! same way, a device with a short refresh is back by itself and planned, beside one on the
//! default (15 minutes) that is still missing.

use std::time::Duration;

use flotilla_protocol::control::{Command, RolloutStatus, TraceKind};
use flotilla_protocol::{DeviceId, Topics};
use flotilla_tests::{AgentOptions, BrokerKind, Site};

const SPEC: &str =
    "name = \"ring\"\nrelease = \"fw-2\"\nselect = \"ring=x\"\n[groups]\ncount = 1\n";

/// Creates the rollout of [`SPEC`]; the status the reply carries.
async fn create(client: &flotilla_coordinator::cli::client::ControlClient) -> RolloutStatus {
    let reply = client
        .request(
            Command::CreateRollout { spec: SPEC.into() },
            Duration::from_secs(10),
        )
        .await
        .expect("created");
    serde_json::from_value(reply).expect("rollout status")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_whose_state_was_cleared_is_named_as_excluded_when_a_rollout_is_created() {
    let mut site = Site::new(BrokerKind::Mosquitto);
    site.release("fw-2", 2, b"firmware two\n");
    site.start_coordinator();
    site.add_agent("dev-kept", &[("ring", "x")], AgentOptions::default());
    site.add_agent("dev-cleared", &[("ring", "x")], AgentOptions::default());
    site.wait_devices(2).await;

    // An anonymous client clears dev-cleared's retained state; its agent runs on, connected.
    let topic = Topics::default().state(&DeviceId::new("dev-cleared").expect("id"));
    site.publish(&topic, Vec::new(), true).await;
    site.kill_coordinator();
    site.start_coordinator();
    site.wait_online("dev-kept", true).await;

    let client = site.client().await;
    let status = create(&client).await;
    let devices: Vec<&String> = status
        .groups
        .iter()
        .flat_map(|g| g.devices.keys())
        .collect();
    assert!(
        devices.is_empty(),
        "a summary lists no devices: {devices:?}"
    );
    assert_eq!(status.groups[0].total, 1, "only dev-kept is planned");
    assert_eq!(status.excluded_count, 1, "{status:#?}");
    let excluded = &status.excluded[0];
    assert_eq!(excluded.device, "dev-cleared");
    assert!(
        excluded
            .reason
            .starts_with("accepted, no state since restart: its labels and hardware are unknown"),
        "{}",
        excluded.reason
    );
    let traced = status
        .trace
        .iter()
        .find(|t| t.kind == TraceKind::DeviceExcluded)
        .unwrap_or_else(|| panic!("no device_excluded entry in {:#?}", status.trace));
    assert_eq!(traced.device.as_deref(), Some("dev-cleared"));
    assert!(
        traced
            .message
            .starts_with("device dev-cleared not planned: accepted, no state since restart"),
        "{}",
        traced.message
    );

    // An operator who would rather wait for it says so in the spec.
    let refused = client
        .request(
            Command::CreateRollout {
                spec: SPEC.replace("\"ring\"\n", "\"ring-2\"\nunknown_devices = \"refuse\"\n"),
            },
            Duration::from_secs(10),
        )
        .await
        .expect_err("refused");
    let text = refused.to_string();
    assert!(
        text.contains("1 accepted devices have sent no state since the coordinator started")
            && text.contains("(dev-cleared)"),
        "{text}"
    );
    let missing = client
        .rollout_status("ring-2", Default::default(), Duration::from_secs(10))
        .await;
    assert!(missing.is_err(), "ring-2 was created: {missing:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_whose_state_was_cleared_is_back_within_its_state_refresh() {
    let mut site = Site::new(BrokerKind::Mosquitto);
    site.release("fw-2", 2, b"firmware two\n");
    site.start_coordinator();
    site.add_agent("dev-default", &[("ring", "x")], AgentOptions::default());
    let refreshing = AgentOptions {
        state_refresh: Some("2s"),
        ..AgentOptions::default()
    };
    site.add_agent("dev-refresh", &[("ring", "x")], refreshing);
    site.wait_devices(2).await;

    // Both retained states are cleared, as a broker restarted without persistence would lose
    // them, and the coordinator restarts: it has the enrollments, no state of either.
    for id in ["dev-default", "dev-refresh"] {
        let topic = Topics::default().state(&DeviceId::new(id).expect("id"));
        site.publish(&topic, Vec::new(), true).await;
    }
    site.kill_coordinator();
    site.start_coordinator();

    // The refreshing device sends its state again by itself, and a rollout plans it; the other
    // stays unknown until its next change, reconnect or refresh.
    let back = site.wait_online("dev-refresh", true).await;
    assert_eq!(
        back.labels.get("ring").map(String::as_str),
        Some("x"),
        "its labels are known again: {back:?}"
    );
    let client = site.client().await;
    let status = create(&client).await;
    assert_eq!(
        status.groups[0].total, 1,
        "dev-refresh is planned: {status:#?}"
    );
    let excluded: Vec<&str> = status.excluded.iter().map(|e| e.device.as_str()).collect();
    assert_eq!(excluded, ["dev-default"], "{status:#?}");
}
