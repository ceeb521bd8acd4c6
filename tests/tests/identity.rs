//! Device identity, end to end: a real coordinator and real agents on a broker without any ACL,
//! and an attacker who is just another MQTT client. Forged reports, states and block requests
//! (unsigned, or signed by a key that is not the device's) change nothing; a device that is not
//! enrolled is not targeted and gets no blocks until an operator accepts it; reject and revoke
//! stop a device; a pre-authorized key or a one-time token enrolls it without an operator.

use std::fs;
use std::time::{Duration, Instant};

use flotilla_protocol::control::{Command, DeviceSummary, RolloutStatus};
use flotilla_protocol::signing::{generate_key, secret_key_from_text};
use flotilla_protocol::{
    device, envelope, BlockRequest, DesiredAction, DeviceId, DeviceMessage, DeviceState, Message,
    Phase, Report, SigningKey, Topics,
};
use flotilla_tests::{broker_kinds, AgentOptions, BrokerKind, Site, Watcher, WAIT};

const FIRMWARE: &[u8] = b"firmware 2: signed all the way\n";

fn id(device: &str) -> DeviceId {
    DeviceId::new(device).expect("device id")
}

fn one_group(name: &str, release: &str) -> String {
    format!("name = \"{name}\"\nrelease = \"{release}\"\n[groups]\ncount = 1\n")
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs()
}

/// The secret key a running agent made for itself.
fn agent_key(site: &Site, device: &str) -> SigningKey {
    let text = fs::read_to_string(site.path(&format!("agents/{device}/data/device.key")))
        .expect("the agent made its key");
    secret_key_from_text(&text).expect("device key")
}

fn signed(key: &SigningKey, message: &DeviceMessage) -> Vec<u8> {
    envelope::encode(&Message::Device(device::sign(key, message)))
}

fn report(device: &str, seq: u64, action_id: &str, rollout: &str, phase: Phase) -> Report {
    Report {
        device_id: device.into(),
        seq,
        action_id: action_id.into(),
        rollout_id: rollout.into(),
        phase,
        at: unix_now(),
    }
}

fn state(device: &str, labels: &[(&str, &str)]) -> DeviceState {
    DeviceState {
        device_id: device.into(),
        hardware_id: "test-board".into(),
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        installed: None,
        current: None,
        online: true,
        agent_version: "forged".into(),
        at: unix_now(),
    }
}

/// Waits until the coordinator's log has its (rate-limited) line about ignored device messages,
/// which it writes for the first one at once; panics after [`WAIT`].
async fn wait_ignored_logged(site: &Site) {
    let deadline = Instant::now() + WAIT;
    loop {
        let log = fs::read_to_string(site.path("coordinator.log")).unwrap_or_default();
        if log.contains("ignored device messages") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the coordinator never logged ignored device messages"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn devices(site: &Site) -> Vec<DeviceSummary> {
    let value = site
        .client()
        .await
        .request(
            Command::ListDevices {
                page: Default::default(),
            },
            Duration::from_secs(10),
        )
        .await
        .expect("list devices");
    serde_json::from_value(value).expect("device list")
}

/// Polls until `device` shows the enrollment status `status`.
async fn wait_enrollment(site: &Site, device: &str, status: &str) -> DeviceSummary {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(d) = devices(site)
            .await
            .into_iter()
            .find(|d| d.id == device && d.enrollment.as_deref() == Some(status))
        {
            return d;
        }
        assert!(
            Instant::now() < deadline,
            "{device} never became {status}: {:#?}",
            devices(site).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Creates a rollout and returns its status with every device (the reply is its summary; the
/// devices come page by page).
async fn create(site: &Site, spec: &str) -> Result<RolloutStatus, String> {
    let client = site.client().await;
    let created: RolloutStatus = client
        .request(
            Command::CreateRollout {
                spec: spec.to_owned(),
            },
            Duration::from_secs(10),
        )
        .await
        .map(|v| serde_json::from_value(v).expect("rollout status"))
        .map_err(|e| e.to_string())?;
    assert!(
        created.groups.iter().all(|g| g.devices.is_empty()),
        "a reply carries the summary"
    );
    client
        .rollout_status(&created.name, Default::default(), Duration::from_secs(10))
        .await
        .map_err(|e| e.to_string())
}

async fn start(site: &Site, name: &str) {
    site.client()
        .await
        .request(
            Command::StartRollout {
                rollout: name.to_owned(),
            },
            Duration::from_secs(10),
        )
        .await
        .expect("start rollout");
}

/// The action id of the retained desired action on `device`'s topic, as any client of the
/// shared broker can read it.
async fn retained_action_id(site: &Site, device: &str) -> String {
    let watcher = Watcher::start(site.port, &[Topics::default().desired(&id(device))]).await;
    let message = watcher
        .wait_until("the retained desired action", WAIT, |w| {
            w.messages().into_iter().find(|m| !m.payload.is_empty())
        })
        .await;
    let Some(Message::Desired(blob)) = message.decode() else {
        panic!("not a desired action");
    };
    let action: DesiredAction =
        envelope::from_bytes("desired action", &blob.payload).expect("desired action");
    action.action_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_reports_neither_advance_nor_pause_a_rollout_and_real_reports_still_count() {
    // Mosquitto runs without any ACL here: the signatures alone must hold.
    for kind in broker_kinds() {
        forged_reports(kind).await;
    }
}

async fn forged_reports(kind: BrokerKind) {
    let mut site = Site::new(kind);
    site.release("fw-2", 2, FIRMWARE);
    site.start_coordinator();
    site.add_agent("dev-a", &[("env", "test")], AgentOptions::default());
    site.add_agent("dev-b", &[("env", "test")], AgentOptions::default());
    site.wait_devices(2).await;

    let spec = "name = \"guarded\"\nrelease = \"fw-2\"\n[groups]\ncount = 2\nsuccess = { threshold = \"100%\", action = \"next\" }\nerror = { threshold = \"50%\", action = \"pause\" }\n";
    let created = create(&site, spec).await.expect("created");
    let canary = created.groups[0]
        .devices
        .keys()
        .next()
        .expect("a canary")
        .clone();
    // The canary is stopped: it will never report by itself.
    site.kill_agent(&canary);
    start(&site, "guarded").await;
    site.wait_status("guarded", "the canary to be sent its action", WAIT, |s| {
        s.groups[0].devices.get(&canary).map(String::as_str) == Some("issued")
    })
    .await;

    // The attacker reads the action id off the shared broker and forges reports with huge
    // sequence numbers: Ready (would advance the group), Failed (would pause the rollout).
    let action_id = retained_action_id(&site, &canary).await;
    let topic = Topics::default().report(&id(&canary));
    let rogue = generate_key();
    let failed = Phase::Failed {
        reason: "forged".into(),
        rolled_back: true,
    };
    let forged = [
        envelope::encode(&Message::Report(report(
            &canary,
            1_000_000,
            &action_id,
            "guarded",
            Phase::Ready,
        ))),
        signed(
            &rogue,
            &DeviceMessage::Report(report(
                &canary,
                1_000_001,
                &action_id,
                "guarded",
                Phase::Ready,
            )),
        ),
        envelope::encode(&Message::Report(report(
            &canary,
            u64::MAX - 1,
            &action_id,
            "guarded",
            failed.clone(),
        ))),
        signed(
            &rogue,
            &DeviceMessage::Report(report(&canary, u64::MAX, &action_id, "guarded", failed)),
        ),
    ];
    for payload in forged {
        site.publish(&topic, payload, false).await;
    }
    wait_ignored_logged(&site).await;
    // For a while after the forgeries, nothing moved: still running, the canary still issued,
    // the second group not started.
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        let status = site.status("guarded").await.expect("status");
        assert_eq!(status.state, "running", "{status:#?}");
        assert_eq!(
            status.groups[0].devices.get(&canary).map(String::as_str),
            Some("issued"),
            "{status:#?}"
        );
        assert_eq!(status.groups[1].state, "scheduled", "{status:#?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The real canary comes back: its reports, with far lower sequence numbers, still count.
    site.start_agent(&canary);
    let status = site
        .wait_status("guarded", "the rollout to finish", WAIT, |s| {
            s.state == "finished"
        })
        .await;
    assert!(
        status.groups.iter().all(|g| g.ready == g.total),
        "{status:#?}"
    );
    assert_eq!(fs::read(site.target_file(&canary)).expect("file"), FIRMWARE);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_retained_states_change_no_labels_and_add_no_device() {
    for kind in broker_kinds() {
        forged_states(kind).await;
    }
}

async fn forged_states(kind: BrokerKind) {
    let mut site = Site::new(kind);
    site.release("fw-2", 2, FIRMWARE);
    site.start_coordinator();
    site.add_agent("dev-real", &[("env", "prod")], AgentOptions::default());
    site.wait_devices(1).await;

    let topics = Topics::default();
    let rogue = generate_key();
    let canary = [("env", "canary")];
    // Relabel the real device (unsigned, and signed by another key); invent devices.
    site.publish(
        &topics.state(&id("dev-real")),
        envelope::encode(&Message::State(state("dev-real", &canary))),
        true,
    )
    .await;
    site.publish(
        &topics.state(&id("dev-real")),
        signed(
            &rogue,
            &DeviceMessage::State {
                state: state("dev-real", &canary),
                enrollment: None,
            },
        ),
        true,
    )
    .await;
    site.publish(
        &topics.state(&id("ghost-1")),
        envelope::encode(&Message::State(state("ghost-1", &canary))),
        true,
    )
    .await;
    // A made-up device with a made-up key and a made-up token proof.
    site.publish(
        &topics.state(&id("ghost-2")),
        signed(
            &rogue,
            &DeviceMessage::State {
                state: state("ghost-2", &canary),
                enrollment: Some(device::enrollment_proof(
                    "guessed-token",
                    "ghost-2",
                    &rogue.verifying_key(),
                )),
            },
        ),
        true,
    )
    .await;
    wait_ignored_logged(&site).await;
    // The self-signed ghost is pending (an operator sees it), nothing more.
    wait_enrollment(&site, "ghost-2", "pending").await;

    let list = devices(&site).await;
    let real = list
        .iter()
        .find(|d| d.id == "dev-real")
        .expect("real device");
    assert_eq!(
        real.labels.get("env").map(String::as_str),
        Some("prod"),
        "{list:#?}"
    );
    assert_eq!(
        real.enrollment.as_deref(),
        Some("accepted, new key pending")
    );
    assert!(!list.iter().any(|d| d.id == "ghost-1"), "{list:#?}");
    let ghost = list.iter().find(|d| d.id == "ghost-2").expect("listed");
    assert!(!ghost.online, "{list:#?}");

    // No device is a canary, so a canary rollout reaches nobody; a rollout over everyone
    // reaches the real device only.
    let spec =
        "name = \"canaries\"\nrelease = \"fw-2\"\nselect = \"env=canary\"\n[groups]\ncount = 1\n";
    let err = create(&site, spec).await.expect_err("no canary exists");
    assert!(err.contains("no device"), "{err}");
    let all = create(&site, &one_group("everyone", "fw-2"))
        .await
        .expect("created");
    let targeted: Vec<&String> = all.groups.iter().flat_map(|g| g.devices.keys()).collect();
    assert_eq!(targeted, ["dev-real"], "{all:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_device_gets_no_blocks_and_no_rollout_until_an_operator_accepts_it() {
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-2", 2, FIRMWARE);
    site.release("fw-3", 3, b"firmware 3\n");
    site.start_coordinator();
    site.add_agent("dev-ok", &[("env", "test")], AgentOptions::default());
    let manual = AgentOptions {
        enroll: false,
        ..AgentOptions::default()
    };
    site.add_agent("dev-new", &[("env", "test")], manual);
    site.wait_devices(1).await;
    wait_enrollment(&site, "dev-new", "pending").await;
    let pending = site.flotilla(&["devices", "pending"]);
    let key = site.device_key("dev-new").expect("the agent made its key");
    assert!(
        pending.contains("dev-new") && pending.contains(&key),
        "{pending}"
    );
    let table = site.flotilla(&["devices"]);
    assert!(
        table.contains("ENROLLMENT") && table.contains("pending") && table.contains("accepted"),
        "{table}"
    );
    // Connected and waiting: the coordinator does not listen to it yet, so it does not claim
    // to know whether it is online ("no" would say it is not).
    let row: Vec<&str> = table
        .lines()
        .find(|l| l.starts_with("dev-new "))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    assert_eq!(
        row.get(..3),
        Some(&["dev-new", "-", "pending"][..]),
        "{table}"
    );

    // Its state does not put it in a rollout.
    let first = create(&site, &one_group("first", "fw-2"))
        .await
        .expect("created");
    let targeted: Vec<&String> = first.groups.iter().flat_map(|g| g.devices.keys()).collect();
    assert_eq!(targeted, ["dev-ok"], "{first:#?}");
    start(&site, "first").await;
    site.wait_status("first", "the first rollout to finish", WAIT, |s| {
        s.state == "finished"
    })
    .await;

    // It gets no blocks, even asking with its own key; an accepted device holding the
    // release does, and its answer (after the pending device's request) shows the coordinator
    // has handled both.
    let sha256 = flotilla_protocol::sha256(FIRMWARE);
    let request = BlockRequest {
        sha256,
        offset: 0,
        length: 16,
    };
    let watcher = Watcher::start(
        site.port,
        &[
            Topics::default().block(&id("dev-new")),
            Topics::default().block(&id("dev-ok")),
        ],
    )
    .await;
    for (device, key) in [
        ("dev-new", agent_key(&site, "dev-new")),
        ("dev-ok", agent_key(&site, "dev-ok")),
    ] {
        site.publish(
            &Topics::default().fetch(&id(device)),
            signed(
                &key,
                &DeviceMessage::Fetch {
                    device_id: device.into(),
                    request: request.clone(),
                },
            ),
            false,
        )
        .await;
    }
    watcher
        .wait_until("the accepted device's block", WAIT, |w| {
            w.messages()
                .into_iter()
                .find(|m| m.topic == Topics::default().block(&id("dev-ok")))
        })
        .await;
    let to_pending: Vec<_> = watcher
        .messages()
        .into_iter()
        .filter(|m| m.topic == Topics::default().block(&id("dev-new")))
        .collect();
    assert!(to_pending.is_empty(), "a pending device got {to_pending:?}");

    // The operator accepts it, pinning the key the device shows; now it is targeted.
    let out = site.flotilla(&["devices", "accept", "dev-new", "--key", &key[..16]]);
    assert!(out.contains("dev-new is accepted"), "{out}");
    wait_enrollment(&site, "dev-new", "accepted").await;
    let second = create(&site, &one_group("second", "fw-3"))
        .await
        .expect("created");
    let mut targeted: Vec<&String> = second
        .groups
        .iter()
        .flat_map(|g| g.devices.keys())
        .collect();
    targeted.sort();
    assert_eq!(targeted, ["dev-new", "dev-ok"], "{second:#?}");
    start(&site, "second").await;
    site.wait_status("second", "the second rollout to finish", WAIT, |s| {
        s.state == "finished" && s.groups.iter().all(|g| g.ready == g.total)
    })
    .await;
    assert_eq!(
        fs::read(site.target_file("dev-new")).expect("file"),
        b"firmware 3\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_and_revoke_stop_a_device() {
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-2", 2, FIRMWARE);
    site.start_coordinator();
    let manual = AgentOptions {
        enroll: false,
        ..AgentOptions::default()
    };
    site.add_agent("dev-rejected", &[("env", "test")], manual);
    site.add_agent("dev-revoked", &[("env", "test")], AgentOptions::default());
    site.wait_devices(1).await;
    wait_enrollment(&site, "dev-rejected", "pending").await;

    let out = site.flotilla(&["devices", "reject", "dev-rejected"]);
    assert!(out.contains("rejected"), "{out}");
    wait_enrollment(&site, "dev-rejected", "rejected").await;
    let pending = site.flotilla(&["devices", "pending"]);
    assert!(!pending.contains("dev-rejected"), "{pending}");

    let out = site.flotilla(&["devices", "revoke", "dev-revoked"]);
    assert!(out.contains("revoked"), "{out}");
    wait_enrollment(&site, "dev-revoked", "revoked").await;
    // Restarting the revoked agent does not bring it back: once its new signed state is on
    // the broker (and so, in order, at the coordinator), it is still not targeted.
    site.kill_agent("dev-revoked");
    let states = Watcher::start(site.port, &[Topics::default().state(&id("dev-revoked"))]).await;
    states.clear();
    site.start_agent("dev-revoked");
    states
        .wait_until("the restarted agent's state", WAIT, |w| {
            w.messages()
                .into_iter()
                .find(|m| matches!(m.decode(), Some(Message::State(s)) if s.online))
        })
        .await;
    wait_ignored_logged(&site).await;
    let err = create(&site, &one_group("nobody", "fw-2"))
        .await
        .expect_err("no accepted device left");
    assert!(err.contains("no device"), "{err}");
    let table = site.flotilla(&["devices"]);
    assert!(
        table.contains("rejected") && table.contains("revoked"),
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preauthorized_key_or_a_token_enrolls_without_an_operator() {
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-2", 2, FIRMWARE);
    let key = site.authorize_key("dev-key");
    site.start_coordinator();
    let by_key = AgentOptions {
        enroll: false,
        ..AgentOptions::default()
    };
    site.add_agent("dev-key", &[("env", "test")], by_key);
    site.add_agent("dev-token", &[("env", "test")], AgentOptions::default());
    site.wait_devices(2).await;
    assert_eq!(
        site.device_key("dev-key"),
        Some(key),
        "the agent kept its key"
    );
    for device in ["dev-key", "dev-token"] {
        wait_enrollment(&site, device, "accepted").await;
    }
    let pending = site.flotilla(&["devices", "pending"]);
    assert!(pending.contains("no devices are waiting"), "{pending}");
    let status = site.create_and_start(&one_group("auto", "fw-2")).await;
    assert_eq!(status.groups[0].total, 2, "{status:#?}");
    site.wait_status("auto", "the rollout to finish", WAIT, |s| {
        s.state == "finished" && s.groups[0].ready == 2
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_key_for_a_known_device_waits_for_an_operator() {
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-2", 2, FIRMWARE);
    site.start_coordinator();
    site.add_agent("dev-x", &[("env", "test")], AgentOptions::default());
    site.wait_devices(1).await;
    wait_enrollment(&site, "dev-x", "accepted").await;
    let old = site.device_key("dev-x").expect("key");

    // Re-imaged: the agent loses its key and makes a new one. Its token is used up, so the new
    // key is not accepted by itself; the device stays accepted with the old key meanwhile.
    site.kill_agent("dev-x");
    fs::remove_file(site.path("agents/dev-x/data/device.key")).expect("remove key");
    site.start_agent("dev-x");
    wait_enrollment(&site, "dev-x", "accepted, new key pending").await;
    let new = site.device_key("dev-x").expect("new key");
    assert_ne!(new, old);
    let pending = site.flotilla(&["devices", "pending"]);
    assert!(
        pending.contains("dev-x") && pending.contains(&new),
        "{pending}"
    );

    // Accepting some other key fails; accepting the key the device shows works, and the
    // device's reports (signed with it) now count.
    let wrong = site.flotilla_output(&["devices", "accept", "dev-x", "--key", &old]);
    assert!(
        !wrong.status.success(),
        "the old key is not the waiting one"
    );
    let out = site.flotilla(&["devices", "accept", "dev-x", "--key", &new]);
    assert!(out.contains("dev-x is accepted"), "{out}");
    site.create_and_start(&one_group("after-rekey", "fw-2"))
        .await;
    site.wait_status("after-rekey", "the rollout to finish", WAIT, |s| {
        s.state == "finished" && s.groups[0].ready == 1
    })
    .await;
}

/// `flotilla devices accept` in a pseudo-terminal (util-linux `script`), answering `answer` to
/// its question; returns everything the terminal showed.
fn accept_on_a_terminal(site: &Site, device: &str, answer: &str) -> (bool, String) {
    use std::io::Write as _;
    let command = format!(
        "{} --broker 127.0.0.1:{} devices accept {device}",
        flotilla_tests::bin("flotilla").display(),
        site.port
    );
    let mut child = std::process::Command::new("script")
        .args(["--quiet", "--return", "--command", &command, "/dev/null"])
        .env_remove("FLOTILLA_BROKER")
        .env(
            "FLOTILLA_OPERATOR_KEY",
            site.operator_key_file(flotilla_tests::ADMIN),
        )
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run script (util-linux)");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(answer.as_bytes())
        .expect("answer");
    let out = child.wait_with_output().expect("script ends");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Issue 19, item 6: `devices accept` accepts only the key the operator saw. A broker client
/// that signs a state for a pending device with its own key becomes the waiting key; accepting
/// without a key, or with the key the operator had listed, is refused by the coordinator naming
/// both keys, and the device stays pending. On a terminal the CLI shows the waiting key and pins
/// the one the operator confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_pins_the_key_the_operator_saw() {
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-2", 2, FIRMWARE);
    site.start_coordinator();
    let manual = AgentOptions {
        enroll: false,
        ..AgentOptions::default()
    };
    site.add_agent("dev-pin", &[("env", "test")], manual);
    // Polls until the coordinator answers: it may not listen yet.
    site.wait_for_enrollment("dev-pin", "pending").await;
    let real = site.device_key("dev-pin").expect("the agent's key");
    let listed = site.flotilla(&["devices", "pending"]);
    assert!(listed.contains(&real), "{listed}");

    // After the operator looked, another client signs a state for the device with its own key.
    let rogue = generate_key();
    let rogue_hex = flotilla_protocol::hex::encode(rogue.verifying_key().as_bytes());
    site.publish(
        &Topics::default().state(&id("dev-pin")),
        signed(
            &rogue,
            &DeviceMessage::State {
                state: state("dev-pin", &[("env", "test")]),
                enrollment: None,
            },
        ),
        true,
    )
    .await;
    let deadline = Instant::now() + WAIT;
    while !site.flotilla(&["devices", "pending"]).contains(&rogue_hex) {
        assert!(Instant::now() < deadline, "the rogue key never waited");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Without --key (and not on a terminal) the CLI refuses to guess.
    let bare = site.flotilla_output(&["devices", "accept", "dev-pin"]);
    let stderr = String::from_utf8_lossy(&bare.stderr).into_owned();
    assert!(!bare.status.success(), "accepted without a key: {stderr}");
    assert!(stderr.contains("--key"), "{stderr}");
    // With the key the operator listed, the coordinator refuses: the waiting key changed.
    let pinned = site.flotilla_output(&["devices", "accept", "dev-pin", "--key", &real[..16]]);
    let stderr = String::from_utf8_lossy(&pinned.stderr).into_owned();
    assert!(!pinned.status.success(), "accepted another key: {stderr}");
    assert!(
        stderr.contains(&rogue_hex) && stderr.contains(&real[..16]) && stderr.contains("changed"),
        "{stderr}"
    );
    // A request in the older shape, without a key, is refused by the coordinator itself.
    let err = site
        .client()
        .await
        .request(
            Command::AcceptDevice {
                device: "dev-pin".into(),
                key: None,
            },
            Duration::from_secs(10),
        )
        .await
        .expect_err("no key, no acceptance");
    assert!(err.to_string().contains("add \"key\""), "{err}");
    let summary = wait_enrollment(&site, "dev-pin", "pending").await;
    assert_eq!(summary.enrollment.as_deref(), Some("pending"));

    // The operator rejects the stranger's key; the device shows its own again, and accepting
    // on a terminal shows that key, asks, and pins it.
    site.flotilla(&["devices", "reject", "dev-pin", "--key", &rogue_hex]);
    site.kill_agent("dev-pin");
    site.start_agent("dev-pin");
    wait_enrollment(&site, "dev-pin", "rejected, new key pending").await;
    let (ok, shown) = accept_on_a_terminal(&site, "dev-pin", "n\n");
    assert!(
        !ok && shown.contains(&real) && shown.contains("[y/N]"),
        "{shown}"
    );
    assert!(shown.contains("nothing was accepted"), "{shown}");
    let (ok, shown) = accept_on_a_terminal(&site, "dev-pin", "y\n");
    assert!(
        ok && shown.contains(&format!("dev-pin is accepted (key {real})")),
        "{shown}"
    );
    wait_enrollment(&site, "dev-pin", "accepted").await;
    let status = site.create_and_start(&one_group("pinned", "fw-2")).await;
    assert_eq!(status.groups[0].total, 1, "{status:#?}");
    site.wait_status("pinned", "the accepted device's install", WAIT, |s| {
        s.state == "finished" && s.groups[0].ready == 1
    })
    .await;
}
