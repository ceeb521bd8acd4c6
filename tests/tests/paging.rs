//! issue 12, items 1 and 2: no message the coordinator publishes grows with the fleet, the list
//! commands answer in pages, and every MQTT connection sends small packets at once.
//!
//! A few thousand devices register cheaply: one test client publishes their signed, retained
//! states (keys pre-authorized), on Mosquitto configured as the shipped config configures it.
//! Then `flotilla devices` and `flotilla rollout status` (real processes) page through them, and
//! the retained rollout event is read as any integration reads it.

use std::collections::BTreeSet;
use std::fs;
use std::time::{Duration, Instant};

use flotilla_protocol::control::{Command, DeviceSummary, PageQuery, RolloutStatus};
use flotilla_protocol::signing::generate_key;
use flotilla_protocol::{device, envelope, DeviceId, DeviceMessage, DeviceState, Message, Topics};
use flotilla_tests::{bin, BrokerKind, Site, Watcher, ADMIN};
use rumqttc::QoS;

/// Enough that one unpaged reply or one retained event with per-device detail is several times
/// larger than a message may be (about 200 bytes a device in `list_devices`).
const DEVICES: usize = 3_000;

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs()
}

fn device_id(i: usize) -> String {
    format!("dev-{i:05}")
}

/// Pre-authorizes `DEVICES` keys, starts the coordinator and publishes every device's signed,
/// retained state from one client; returns once the coordinator lists them all.
async fn fleet_site() -> Site {
    let mut site = Site::new(BrokerKind::Mosquitto);
    site.release("fw-2", 2, b"firmware two\n");
    let keys: Vec<_> = (0..DEVICES).map(|_| generate_key()).collect();
    let mut authorized = String::from("# pre-authorized device keys\n");
    for (i, key) in keys.iter().enumerate() {
        let public = flotilla_protocol::hex::encode(key.verifying_key().as_bytes());
        authorized.push_str(&format!("{public} {}\n", device_id(i)));
    }
    fs::write(site.authorized_keys_file(), authorized).expect("write authorized keys");
    site.start_coordinator();

    let mut options = site.connection().options("fleet-publisher");
    options.set_max_packet_size(1 << 20, 1 << 20);
    let (client, eventloop) = flotilla_mqtt::client(options, DEVICES + 10);
    let poller = flotilla_tests::mqtt::keep_polling("fleet-publisher", eventloop);
    let topics = Topics::default();
    for (i, key) in keys.iter().enumerate() {
        let id = device_id(i);
        let site_label = if i % 2 == 0 { "a" } else { "b" };
        let state = DeviceState {
            device_id: id.clone(),
            hardware_id: "test-board".into(),
            labels: [("site".to_owned(), site_label.to_owned())]
                .into_iter()
                .collect(),
            installed: None,
            current: None,
            online: true,
            agent_version: "paging-test".into(),
            at: unix_now(),
        };
        let signed = device::sign(
            key,
            &DeviceMessage::State {
                state,
                enrollment: None,
            },
        );
        client
            .publish(
                topics.state(&DeviceId::new(&id).expect("id")),
                QoS::AtLeastOnce,
                true,
                envelope::encode(&Message::Device(signed)),
            )
            .await
            .expect("queue state");
    }
    site.wait_devices(DEVICES).await;
    poller.abort();
    site
}

fn devices_json(site: &Site, args: &[&str]) -> Vec<DeviceSummary> {
    let mut all = vec!["devices", "--json"];
    all.extend_from_slice(args);
    serde_json::from_str(&site.flotilla(&all)).expect("device list JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_and_rollout_status_answer_in_pages_at_thousands_of_devices() {
    let site = fleet_site().await;

    // `flotilla devices` lists every device once, in id order, whatever the page size.
    let started = Instant::now();
    let listed = devices_json(&site, &[]);
    println!(
        "flotilla devices: {} devices in {:?}",
        listed.len(),
        started.elapsed()
    );
    let ids: Vec<String> = listed.iter().map(|d| d.id.clone()).collect();
    let expected: Vec<String> = (0..DEVICES).map(device_id).collect();
    assert_eq!(ids, expected);
    let started = Instant::now();
    let small_pages = devices_json(&site, &["--page-size", "7", "--select", "site=a"]);
    println!(
        "flotilla devices --page-size 7: {} round trips in {:?}",
        DEVICES.div_ceil(14),
        started.elapsed()
    );
    assert_eq!(small_pages.len(), DEVICES / 2);
    assert!(small_pages.iter().all(|d| d.labels["site"] == "a"));
    let first = devices_json(&site, &["--limit", "10"]);
    assert_eq!(first.len(), 10);
    assert_eq!(first[9].id, device_id(9));
    let table = site.flotilla(&["devices"]);
    assert_eq!(
        table.lines().count(),
        DEVICES + 1,
        "a header and every device"
    );

    // A rollout over all of them: its command replies are summaries, its status comes in pages.
    let spec = "name = \"wide\"\nrelease = \"fw-2\"\n[groups]\ncount = 4\n";
    let spec_file = site.path("wide.toml");
    fs::write(&spec_file, spec).expect("write spec");
    let events = Watcher::connect(
        site.connection(),
        &[Topics::default().rollout_event("wide")],
    )
    .await;
    let created = site.flotilla(&["rollout", "create", "--spec", &spec_file.to_string_lossy()]);
    assert!(created.contains("rollout wide"), "{created}");
    let started = site.flotilla(&["rollout", "start", "wide"]);
    assert!(started.contains("state running"), "{started}");

    let status: RolloutStatus =
        serde_json::from_str(&site.flotilla(&["rollout", "status", "wide", "--json"]))
            .expect("status JSON");
    let mut seen = BTreeSet::new();
    for group in &status.groups {
        assert_eq!(group.devices.len(), group.total, "group {}", group.name);
        assert_eq!(group.device_details.len(), group.total);
        seen.extend(group.devices.keys().cloned());
    }
    assert_eq!(seen.len(), DEVICES, "every device once, in one group");
    let text = site.flotilla(&["rollout", "status", "wide", "--page-size", "250"]);
    assert!(
        text.contains("rollout wide  release fw-2  state running"),
        "{text}"
    );
    let canary: RolloutStatus = serde_json::from_str(&site.flotilla(&[
        "rollout",
        "status",
        "wide",
        "--json",
        "--group",
        &status.groups[0].name,
        "--phase",
        "issued",
    ]))
    .expect("filtered status JSON");
    let issued = status.groups[0]
        .devices
        .values()
        .filter(|p| p.as_str() == "issued")
        .count();
    assert!(
        issued > 0,
        "the first group's devices were sent their action"
    );
    assert_eq!(canary.groups[0].devices.len(), issued);
    assert!(canary.groups[1..].iter().all(|g| g.devices.is_empty()));
    // Without a name, one line per rollout.
    let all = site.flotilla(&["rollout", "status"]);
    assert!(
        all.starts_with("ROLLOUT ") && all.lines().any(|l| l.starts_with("wide ")),
        "{all}"
    );

    // The retained event carries counts and per-group summaries, never per-device detail.
    let event = events
        .wait_until("the retained rollout event", Duration::from_secs(30), |w| {
            w.messages().last().cloned()
        })
        .await;
    println!(
        "retained rollout event: {} bytes for {DEVICES} devices",
        event.payload.len()
    );
    let event: RolloutStatus = serde_json::from_slice(&event.payload).expect("event JSON");
    assert_eq!(event.groups.iter().map(|g| g.total).sum::<usize>(), DEVICES);
    assert!(event
        .groups
        .iter()
        .all(|g| g.devices.is_empty() && g.device_details.is_empty()));

    // A bad page size is refused by the CLI, a bad filter by the coordinator, each naming it.
    let zero = site.flotilla_output(&["devices", "--page-size", "0"]);
    assert!(!zero.status.success());
    assert!(String::from_utf8_lossy(&zero.stderr).contains("--page-size"));
    let bad = site.flotilla_output(&["devices", "--select", "site in (a"]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("select \"site in (a\""),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}

/// Devices that join between two pages do not shift the pages: the ones ahead of the cursor
/// are listed, the ones behind it are not, and every device that was there is listed once. The
/// cursor is a device id, not an offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_survives_devices_joining_between_pages() {
    let site = fleet_site().await;
    let client = site.client().await;
    let page = |after: Option<String>| {
        let client = &client;
        async move {
            let value = client
                .request(
                    Command::ListDevices {
                        page: PageQuery {
                            limit: Some(1_000),
                            after,
                            ..PageQuery::default()
                        },
                    },
                    Duration::from_secs(10),
                )
                .await
                .expect("a page");
            serde_json::from_value::<flotilla_protocol::control::Page<DeviceSummary>>(value)
                .expect("page JSON")
        }
    };
    let first = page(None).await;
    assert_eq!(first.items.len(), 1_000);
    assert_eq!(first.next.as_deref(), Some(device_id(999).as_str()));
    // Two new devices announce themselves (self-signed, so they wait for an operator and are
    // listed as pending): one sorts behind the cursor, one ahead of it.
    let (behind, ahead) = (
        format!("{}x", device_id(5)),
        format!("{}x", device_id(2_500)),
    );
    for id in [&behind, &ahead] {
        let state = DeviceState {
            device_id: id.clone(),
            hardware_id: "test-board".into(),
            labels: Default::default(),
            installed: None,
            current: None,
            online: true,
            agent_version: "paging-test".into(),
            at: unix_now(),
        };
        let signed = device::sign(
            &generate_key(),
            &DeviceMessage::State {
                state,
                enrollment: None,
            },
        );
        site.publish(
            &Topics::default().state(&DeviceId::new(id).expect("id")),
            envelope::encode(&Message::Device(signed)),
            true,
        )
        .await;
    }
    site.wait_for_enrollment(&ahead, "pending").await;
    site.wait_for_enrollment(&behind, "pending").await;
    let mut ids: Vec<String> = first.items.into_iter().map(|d| d.id).collect();
    let mut next = first.next;
    while let Some(after) = next {
        let more = page(Some(after)).await;
        ids.extend(more.items.into_iter().map(|d| d.id));
        next = more.next;
    }
    let mut expected: Vec<String> = (0..DEVICES).map(device_id).collect();
    expected.push(ahead);
    expected.sort();
    assert_eq!(ids.len(), expected.len());
    assert_eq!(
        ids, expected,
        "each once, in id order, the one behind the cursor not at all"
    );
}

/// Every connection the `flotilla` CLI opens (the same link code the coordinator runs) turns
/// Nagle's algorithm off; the test broker, like the shipped config, does on its side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_connections_send_small_packets_at_once() {
    let site = Site::new(BrokerKind::Mosquitto);
    let trace = site.path("cli.strace");
    let output = std::process::Command::new("strace")
        .args(["-f", "-e", "trace=setsockopt", "-o"])
        .arg(&trace)
        .arg(bin("flotilla"))
        .args(["--broker", &format!("127.0.0.1:{}", site.port)])
        .args(["--operator-key"])
        .arg(site.operator_key_file(ADMIN))
        .args(["devices"])
        .output()
        .expect("run flotilla under strace (apt-get install strace)");
    // No coordinator runs: the CLI connects, asks, and reports that nobody answered.
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("no reply"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let calls = fs::read_to_string(&trace).expect("strace output");
    assert!(
        calls.contains("TCP_NODELAY, [1]"),
        "no socket with TCP_NODELAY on:\n{calls}"
    );
    assert!(!calls.contains("TCP_NODELAY, [0]"), "{calls}");
}

/// The test broker runs with the shipped config's latency and queue settings.
#[test]
fn the_test_broker_is_tuned_like_the_shipped_one() {
    let shipped = fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/mosquitto/mosquitto.conf"),
    )
    .expect("read the shipped config");
    let settings: Vec<&str> = shipped
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .collect();
    for line in flotilla_tests::site::SHIPPED_BROKER_TUNING.lines() {
        assert!(
            settings.contains(&line),
            "{line:?} is not in the shipped config"
        );
    }
    for setting in [
        "set_tcp_nodelay",
        "max_queued_messages",
        "max_inflight_messages",
    ] {
        assert!(
            flotilla_tests::site::SHIPPED_BROKER_TUNING.contains(setting),
            "the test broker lacks {setting}"
        );
    }
}
