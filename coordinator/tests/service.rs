//! The service over MQTT, in process: a coordinator on an embedded broker on a free port, driven
//! through the control client and raw device clients.

use std::time::Duration;

use flotilla_coordinator::cli::client::ControlClient;
use flotilla_coordinator::service::config::{
    BrokerConfig, Config, EnrollmentConfig, OperatorConfig,
};
use flotilla_coordinator::service::keys;
use flotilla_coordinator::service::releases::{NewRelease, ReleaseStore};
use flotilla_coordinator::service::store::Store;
use flotilla_coordinator::service::{mqtt, serve};
use flotilla_protocol::control::{
    Command, DeviceGroupInfo, DeviceSummary, RolloutStatus, StrategyInfo,
};
use flotilla_protocol::{
    envelope, ActionBody, ActionKind, DesiredAction, DeviceId, DeviceState, Message, SignedBlob,
    SigningKey, TimeWindow, Topics, VerifyingKey,
};
use rumqttc::{AsyncClient, Event, EventLoop, MqttOptions, Packet, QoS};
use std::collections::BTreeMap;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

/// The one-time enrollment token the fake device enrolls with.
/// 32 random bytes in hex, as `flotilla enrollment token` makes them: the config refuses
/// tokens under 128 bits.
const TOKEN: &str = "9d1c6f0a3e7b52c48f2a6d0e91b7c35a4e8f2d6b0c9a1e7f3d5b8c2a6e0f4d19";

/// The fake device's own key.
fn device_key() -> flotilla_protocol::SigningKey {
    flotilla_protocol::SigningKey::from_bytes(&[42; 32])
}

/// A device message signed by the fake device, in its envelope.
fn signed(message: &flotilla_protocol::DeviceMessage) -> Vec<u8> {
    envelope::encode(&Message::Device(flotilla_protocol::device::sign(
        &device_key(),
        message,
    )))
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

struct Harness {
    _dir: tempfile::TempDir,
    config: Config,
    coordinator_pub: VerifyingKey,
    release_blob: SignedBlob,
}

/// The admin operator every harness coordinator knows.
fn operator() -> SigningKey {
    SigningKey::from_bytes(&[42; 32])
}

fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
}

fn harness() -> Harness {
    let dir = tempfile::tempdir().expect("tempdir");
    let keys_dir = dir.path().join("keys");
    keys::keygen(&keys_dir, &[], false).expect("keygen");
    let data_dir = dir.path().join("data");
    let app = dir.path().join("app.bin");
    std::fs::write(&app, b"new firmware").expect("write");
    let release_key = keys::load_secret_key(&keys_dir.join("release.key")).expect("key");
    let releases = ReleaseStore::new(&data_dir);
    let new = NewRelease {
        name: "fw-1".into(),
        version: "1.0.0".into(),
        counter: 1,
        hardware: vec![],
        artifacts: vec![format!("app={}", app.display())],
        artifact_types: vec![],
        expires_in: 86_400,
        block_size: Some(flotilla_protocol::blocks::DEFAULT_BLOCK_SIZE),
    };
    releases.create(&new, &release_key, now()).expect("release");
    let (release_blob, _) = releases.load("fw-1").expect("load");
    let addr = free_addr();
    let config = Config {
        data_dir,
        coordinator_key: keys_dir.join("coordinator.key"),
        broker: BrokerConfig {
            embedded: Some(addr),
            ..BrokerConfig::plain("127.0.0.1", addr.port())
        },
        action_validity: 3600,
        operators: vec![OperatorConfig {
            name: "tester".into(),
            role: flotilla_protocol::operator::Role::Admin,
            key: operator().verifying_key(),
        }],
        clock_window: 60,
        control_limits: Default::default(),
        enrollment: EnrollmentConfig {
            authorized_keys: None,
            tokens: vec![TOKEN.into()],
            max_pending: 10,
            attempts_per_second: 20,
            device_attempts_per_minute: 6,
        },
        metrics: None,
        http: None,
        verify_threads: 2,
        marker_timeout: Duration::from_secs(30),
        watch_sys_dropped: false,
        store: Default::default(),
    };
    let coordinator_pub = keys::load_public_key(&keys_dir.join("coordinator.pub")).expect("pub");
    Harness {
        _dir: dir,
        config,
        coordinator_pub,
        release_blob,
    }
}

/// Sends a request, retrying while the coordinator is still subscribing (a request sent
/// before its subscription is lost, by MQTT's design).
async fn ask(
    client: &ControlClient,
    command: Command,
) -> Result<serde_json::Value, flotilla_coordinator::cli::client::ClientError> {
    for _ in 0..20 {
        match client
            .request(command.clone(), Duration::from_secs(1))
            .await
        {
            Err(flotilla_coordinator::cli::client::ClientError::NoReply { .. }) => continue,
            other => return other,
        }
    }
    client.request(command, Duration::from_secs(1)).await
}

fn device_client(port: u16) -> (AsyncClient, EventLoop) {
    let mut o = MqttOptions::new(mqtt::unique_client_id("fake-device"), "127.0.0.1", port);
    o.set_max_packet_size(1 << 20, 1 << 20);
    AsyncClient::new(o, 100)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_and_starts_a_rollout_over_mqtt_and_survives_garbage() {
    let h = harness();
    let topics = Topics::default();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(serve(h.config.clone(), shutdown.clone()));
    let port = h.config.broker.port;
    let client = ControlClient::connect("127.0.0.1", port, "flotilla", operator())
        .await
        .expect("client connects");
    let releases = ask(
        &client,
        Command::ListReleases {
            page: Default::default(),
        },
    )
    .await
    .expect("coordinator answers");
    assert_eq!(releases[0]["name"], "fw-1");

    // A device announces itself (retained state), then garbage arrives on its topics and on
    // the control topic.
    let (device, mut device_el) = device_client(port);
    let id = DeviceId::new("dev-1").expect("id");
    let state = DeviceState {
        device_id: "dev-1".into(),
        hardware_id: "pi4".into(),
        labels: vec![("env".into(), "canary".into())],
        installed: None,
        current: None,
        online: true,
        agent_version: "test".into(),
        at: now(),
    };
    device
        .publish(
            topics.state(&id),
            QoS::AtLeastOnce,
            true,
            signed(&flotilla_protocol::DeviceMessage::State {
                state,
                enrollment: Some(flotilla_protocol::device::enrollment_proof(
                    TOKEN,
                    "dev-1",
                    &device_key().verifying_key(),
                )),
            }),
        )
        .await
        .expect("queue");
    device
        .publish(
            topics.report(&id),
            QoS::AtLeastOnce,
            false,
            b"\xff\xfegarbage".to_vec(),
        )
        .await
        .expect("queue");
    device
        .publish(
            topics.control_request(),
            QoS::AtLeastOnce,
            false,
            b"{not json".to_vec(),
        )
        .await
        .expect("queue");
    device
        .subscribe(topics.desired(&id), QoS::AtLeastOnce)
        .await
        .expect("queue");
    // Drive the fake device's connection until the broker has its messages.
    let mut acks = 0;
    tokio::time::timeout(WAIT, async {
        while acks < 3 {
            if let Event::Incoming(Packet::PubAck(_)) =
                device_el.poll().await.expect("device connection")
            {
                acks += 1;
            }
        }
    })
    .await
    .expect("device publishes acknowledged");

    // The coordinator keeps answering, and learned the device despite the garbage.
    let devices: Vec<DeviceSummary> = tokio::time::timeout(WAIT, async {
        loop {
            let value = ask(
                &client,
                Command::ListDevices {
                    page: Default::default(),
                },
            )
            .await
            .expect("answers after garbage");
            let devices: Vec<DeviceSummary> = serde_json::from_value(value).expect("devices");
            if !devices.is_empty() {
                return devices;
            }
        }
    })
    .await
    .expect("device registered");
    assert_eq!(devices[0].id, "dev-1");
    assert!(devices[0].online);

    // Bad input gets a clear refusal naming the problem.
    let err = ask(
        &client,
        Command::CreateRollout {
            spec: "name = \"r\"\nrelease = \"nope\"\n[groups]\ncount = 1\n".into(),
        },
    )
    .await
    .expect_err("unknown release");
    assert!(err.to_string().contains("no release named nope"), "{err}");

    // A one-hour daily maintenance window that opened ten minutes ago (UTC).
    let opened = (now() - 600) / 60 * 60;
    let (hour, minute) = (opened / 3600 % 24, opened / 60 % 60);
    let spec = format!(
        "name = \"r1\"\nrelease = \"fw-1\"\n[groups]\ncount = 1\n[[window]]\ncron = \"{minute} {hour} * * *\"\nduration = \"1h\"\n"
    );
    let created: RolloutStatus = serde_json::from_value(
        ask(&client, Command::CreateRollout { spec })
            .await
            .expect("created"),
    )
    .expect("status");
    assert_eq!(
        (
            created.name.as_str(),
            created.release.as_str(),
            created.state.as_str()
        ),
        ("r1", "fw-1", "ready")
    );
    assert_eq!(created.groups.iter().map(|g| g.total).sum::<usize>(), 1);

    let started: RolloutStatus = serde_json::from_value(
        ask(
            &client,
            Command::StartRollout {
                rollout: "r1".into(),
            },
        )
        .await
        .expect("started"),
    )
    .expect("status");
    assert_eq!(started.state, "running");

    // The device receives a retained, coordinator-signed install of the stored release.
    let desired = tokio::time::timeout(WAIT, async {
        loop {
            if let Event::Incoming(Packet::Publish(p)) =
                device_el.poll().await.expect("device connection")
            {
                if p.topic == topics.desired(&id) {
                    return p;
                }
            }
        }
    })
    .await
    .expect("desired action published");
    let Ok(Message::Desired(blob)) = envelope::decode(&desired.payload) else {
        panic!("not a desired action")
    };
    let bytes = blob
        .verify("desired action", &[h.coordinator_pub])
        .expect("signed by the coordinator key");
    let action: DesiredAction = envelope::from_bytes("desired action", bytes).expect("decodes");
    assert_eq!(action.device_id, "dev-1");
    let action_id = action.action_id.clone();
    assert_eq!(action.rollout_id, "r1");
    assert_eq!(action.expires_at - action.issued_at, 3600);
    match &action.body {
        ActionBody::Install {
            manifest,
            kind,
            window,
        } => {
            assert_eq!(manifest, &h.release_blob);
            assert_eq!(kind, &ActionKind::Forced);
            // The agent gets the maintenance window in UTC, to hold to without a zone database.
            assert_eq!(
                window,
                &Some(TimeWindow {
                    not_before: opened,
                    not_after: opened + 3600 - 1
                })
            );
        }
        other => panic!("expected an install, got {other:?}"),
    }

    // The artifact is served in blocks on the device's own block topic.
    let sha256 = flotilla_protocol::sha256(b"new firmware");
    device
        .subscribe(topics.block(&id), QoS::AtLeastOnce)
        .await
        .expect("queue");
    let fetch = flotilla_protocol::DeviceMessage::Fetch {
        device_id: "dev-1".into(),
        request: flotilla_protocol::BlockRequest {
            sha256,
            offset: 4,
            length: 1000,
        },
    };
    device
        .publish(topics.fetch(&id), QoS::AtLeastOnce, false, signed(&fetch))
        .await
        .expect("queue");
    let block = tokio::time::timeout(WAIT, async {
        loop {
            if let Event::Incoming(Packet::Publish(p)) =
                device_el.poll().await.expect("device connection")
            {
                if p.topic == topics.block(&id) {
                    return p;
                }
            }
        }
    })
    .await
    .expect("block served");
    assert_eq!(
        envelope::decode(&block.payload).expect("decodes"),
        Message::Block(flotilla_protocol::BlockReply::Data {
            sha256,
            offset: 4,
            data: b"firmware".to_vec()
        })
    );

    let err = ask(
        &client,
        Command::StartRollout {
            rollout: "r1".into(),
        },
    )
    .await
    .expect_err("already running");
    assert!(err.to_string().contains("r1"), "{err}");

    shutdown.cancel();
    tokio::time::timeout(WAIT, server)
        .await
        .expect("stops")
        .expect("no panic")
        .expect("clean shutdown");

    // The rollout survived in the store.
    {
        let store = Store::open(h.config.data_dir.join("db")).expect("store reopens");
        let stored = store.load_rollouts().expect("loads");
        assert_eq!(stored.len(), 1);
        assert_eq!(stored[0].name, "r1");
    }

    // A restarted coordinator, on a fresh broker that lost every retained message, still
    // knows the rollout and re-publishes the running group's desired action.
    let mut config = h.config.clone();
    let addr = free_addr();
    config.broker.port = addr.port();
    config.broker.embedded = Some(addr);
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(serve(config, shutdown.clone()));
    let client = ControlClient::connect("127.0.0.1", addr.port(), "flotilla", operator())
        .await
        .expect("client connects");
    let status: RolloutStatus = serde_json::from_value(
        ask(
            &client,
            Command::RolloutStatus {
                rollout: Some("r1".into()),
                page: Default::default(),
            },
        )
        .await
        .expect("status after restart"),
    )
    .expect("status");
    assert_eq!(status.state, "running");
    let (device, mut device_el) = device_client(addr.port());
    device
        .subscribe(topics.desired(&id), QoS::AtLeastOnce)
        .await
        .expect("queue");
    let reissued = tokio::time::timeout(WAIT, async {
        loop {
            if let Event::Incoming(Packet::Publish(p)) =
                device_el.poll().await.expect("device connection")
            {
                if p.topic == topics.desired(&id) {
                    return p;
                }
            }
        }
    })
    .await
    .expect("desired action reissued after restart");
    let Ok(Message::Desired(blob)) = envelope::decode(&reissued.payload) else {
        panic!("not a desired action")
    };
    let bytes = blob
        .verify("desired action", &[h.coordinator_pub])
        .expect("signed");
    let again: DesiredAction = envelope::from_bytes("desired action", bytes).expect("decodes");
    assert_eq!(
        again.action_id, action_id,
        "same action id, so the agent does not apply it twice"
    );
    assert_eq!(again.body, action.body, "the same window too");
    shutdown.cancel();
    tokio::time::timeout(WAIT, server)
        .await
        .expect("stops")
        .expect("no panic")
        .expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_groups_strategies_and_approvals_over_mqtt() {
    let h = harness();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(serve(h.config.clone(), shutdown.clone()));
    let client = ControlClient::connect("127.0.0.1", h.config.broker.port, "flotilla", operator())
        .await
        .expect("client connects");

    // A device group: stored, listed with its canonical selector and labels.
    let created = ask(
        &client,
        Command::CreateGroup {
            name: "kitchens".into(),
            select: "site in (a, b), !quarantined".into(),
            labels: BTreeMap::from([("tier".into(), "1".into())]),
        },
    )
    .await
    .expect("group created");
    assert_eq!(created["select"], "site in (a,b),!quarantined");
    ask(
        &client,
        Command::CreateGroup {
            name: "beta".into(),
            select: "ring=beta".into(),
            labels: BTreeMap::new(),
        },
    )
    .await
    .expect("group created");
    let groups: Vec<DeviceGroupInfo> = serde_json::from_value(
        ask(
            &client,
            Command::ListGroups {
                page: Default::default(),
            },
        )
        .await
        .expect("lists"),
    )
    .expect("group list");
    assert_eq!(
        groups
            .iter()
            .map(|g| (g.name.as_str(), g.labels.len()))
            .collect::<Vec<_>>(),
        vec![("beta", 0), ("kitchens", 1)]
    );

    // Bad input names the field and stores nothing.
    let err = ask(
        &client,
        Command::CreateGroup {
            name: "broken".into(),
            select: "env in (".into(),
            labels: BTreeMap::new(),
        },
    )
    .await
    .expect_err("bad selector");
    assert!(
        err.to_string().contains("select: selector \"env in (\""),
        "{err}"
    );
    let err = ask(
        &client,
        Command::CreateGroup {
            name: "no/slash".into(),
            select: "env=prod".into(),
            labels: BTreeMap::new(),
        },
    )
    .await
    .expect_err("bad name");
    assert!(
        err.to_string()
            .contains("name: device group name \"no/slash\""),
        "{err}"
    );
    let err = ask(
        &client,
        Command::CreateGroup {
            name: "spaced".into(),
            select: "env=prod".into(),
            labels: BTreeMap::from([("tier".into(), "one two".into())]),
        },
    )
    .await
    .expect_err("bad label value");
    assert!(
        err.to_string().contains("labels.tier: value \"one two\""),
        "{err}"
    );

    let deleted = ask(
        &client,
        Command::DeleteGroup {
            name: "beta".into(),
        },
    )
    .await
    .expect("deleted");
    assert_eq!(deleted["name"], "beta");
    let err = ask(
        &client,
        Command::DeleteGroup {
            name: "beta".into(),
        },
    )
    .await
    .expect_err("already gone");
    assert!(
        err.to_string().contains("no device group named \"beta\""),
        "{err}"
    );
    let groups: Vec<DeviceGroupInfo> = serde_json::from_value(
        ask(
            &client,
            Command::ListGroups {
                page: Default::default(),
            },
        )
        .await
        .expect("lists"),
    )
    .expect("group list");
    assert_eq!(
        groups.len(),
        1,
        "only kitchens and none of the refused ones: {groups:?}"
    );

    // A staged strategy: stored verbatim and shown back.
    let text = "# two stages\n[[stage]]\nname = \"canary\"\nselect = \"env=canary\"\n\
                [[stage]]\nname = \"prod\"\n";
    ask(
        &client,
        Command::CreateStrategy {
            name: "two-stage".into(),
            spec: text.into(),
        },
    )
    .await
    .expect("strategy stored");
    let shown: StrategyInfo = serde_json::from_value(
        ask(
            &client,
            Command::ShowStrategy {
                name: "two-stage".into(),
            },
        )
        .await
        .expect("shown"),
    )
    .expect("strategy");
    assert_eq!(shown.spec, text);
    let listed = ask(
        &client,
        Command::ListStrategies {
            page: Default::default(),
        },
    )
    .await
    .expect("lists");
    assert_eq!(listed[0]["name"], "two-stage");
    let err = ask(
        &client,
        Command::CreateStrategy {
            name: "empty".into(),
            spec: "# nothing\n".into(),
        },
    )
    .await
    .expect_err("no stages");
    assert!(
        err.to_string().contains(
            "spec: strategy empty: stage: [] is not a list of at least one [[stage]] entry"
        ),
        "{err}"
    );
    let err = ask(
        &client,
        Command::ShowStrategy {
            name: "nope".into(),
        },
    )
    .await
    .expect_err("unknown");
    assert!(
        err.to_string()
            .contains("no stored strategy named nope; create it with `flotilla strategy create`"),
        "{err}"
    );

    // Approvals: the engine's own words come back to the operator.
    let err = ask(
        &client,
        Command::Approve {
            name: "nope-canary".into(),
        },
    )
    .await
    .expect_err("unknown approval");
    assert!(
        err.to_string().contains(
            &flotilla_rollout::engine::EngineError::UnknownApproval("nope-canary".into())
                .to_string()
        ),
        "{err}"
    );
    let approvals = ask(
        &client,
        Command::ListApprovals {
            page: Default::default(),
        },
    )
    .await
    .expect("lists");
    assert_eq!(approvals, serde_json::json!([]));
    let err = ask(
        &client,
        Command::TriggerNext {
            rollout: "ghost".into(),
            skip_approval: false,
        },
    )
    .await
    .expect_err("unknown rollout");
    assert!(
        err.to_string().contains("no rollout named \"ghost\""),
        "{err}"
    );
    let err = ask(
        &client,
        Command::RetryRollout {
            rollout: "ghost".into(),
            name: Some("bad name".into()),
        },
    )
    .await
    .expect_err("bad retry name");
    assert!(
        err.to_string().contains("name: rollout name \"bad name\""),
        "{err}"
    );

    shutdown.cancel();
    tokio::time::timeout(WAIT, server)
        .await
        .expect("stops")
        .expect("no panic")
        .expect("clean shutdown");

    // Groups and strategies are in the store for the next start.
    let store = Store::open(h.config.data_dir.join("db")).expect("store reopens");
    assert_eq!(
        store
            .list_groups()
            .expect("loads")
            .iter()
            .map(|g| g.name.as_str())
            .collect::<Vec<_>>(),
        vec!["kitchens"]
    );
    assert!(store.load_strategy("two-stage").expect("loads").is_some());
}
