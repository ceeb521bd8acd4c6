//! Control requests on a connection of their own (decision 0066), with Mosquitto as
//! `deploy/mosquitto` ships it: the coordinator logs in twice (its user name, and the same with
//! `-control`), neither login takes the other's connection over, and a control request sent
//! while the coordinator still reads thousands of retained states is answered, the read at
//! once and a `rollout create` once every state is read, planning over the whole fleet.

use std::time::Duration;

use flotilla_protocol::control::{Command, PageQuery, RolloutStatus};
use flotilla_protocol::{device, envelope, DeviceId, DeviceMessage, DeviceState, Message, Topics};
use flotilla_tests::secure::{COORDINATOR, COORDINATOR_CONTROL};
use flotilla_tests::{BrokerKind, Site, WAIT};
use rumqttc::{Event, Packet, QoS};

const DEVICES: u32 = 2_000;

fn key_of(n: u32) -> flotilla_protocol::SigningKey {
    flotilla_tests::numbered_key(11, n)
}

fn id(n: u32) -> String {
    format!("burst-{n:05}")
}

/// Publishes every device's signed state, retained, as the coordinator would find them after a
/// restart (with its login: it is not running yet).
async fn retained_states(site: &Site) {
    let topics = Topics::default();
    let mut options = site.connection().options(COORDINATOR.to_owned());
    options.set_max_packet_size(1 << 20, 1 << 20);
    let (sender, mut eventloop) = flotilla_mqtt::client(options, DEVICES as usize + 10);
    let acks = tokio::spawn(async move {
        let mut acked = 0;
        while acked < DEVICES {
            if let Event::Incoming(Packet::PubAck(_)) = eventloop.poll().await.expect("connected") {
                acked += 1;
            }
        }
        eventloop
    });
    for n in 0..DEVICES {
        let state = DeviceMessage::State {
            state: DeviceState {
                device_id: id(n),
                hardware_id: "test-board".into(),
                labels: vec![],
                installed: None,
                current: None,
                online: true,
                agent_version: "test".into(),
                at: flotilla_tests::unix_now(),
            },
            enrollment: None,
        };
        let payload = envelope::encode(&Message::Device(device::sign(&key_of(n), &state)));
        sender
            .publish(
                topics.state(&DeviceId::new(id(n)).expect("id")),
                QoS::AtLeastOnce,
                true,
                payload,
            )
            .await
            .expect("queue");
    }
    let mut eventloop = tokio::time::timeout(WAIT, acks)
        .await
        .expect("the broker took every state")
        .expect("the sender's event loop");
    // Leaves, so the coordinator's login is free again before it starts.
    sender.disconnect().await.expect("disconnect");
    tokio::time::timeout(WAIT, async {
        while let Ok(event) = eventloop.poll().await {
            if matches!(event, Event::Outgoing(rumqttc::Outgoing::Disconnect)) {
                return;
            }
        }
    })
    .await
    .expect("disconnected");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_logins_stay_connected_and_a_request_during_the_retained_burst_is_answered() {
    if !flotilla_tests::require_mosquitto(module_path!()) {
        return;
    }
    let mut site = Site::new(BrokerKind::Secure);
    let authorized = flotilla_tests::authorized_keys(DEVICES, key_of, id);
    std::fs::write(site.authorized_keys_file(), authorized).expect("authorized keys");
    site.release("fw-1", 1, b"firmware one\n");
    retained_states(&site).await;

    // The coordinator's marker, seen by a watcher as soon as it is published: its main
    // connection has subscribed, and its control connection did before it.
    let watcher = site.watcher(&[Topics::default().marker()]).await;
    let client = site.client().await;
    let logged_before = site.secure().log().len();
    site.start_coordinator();
    watcher
        .wait_until("the coordinator's marker", WAIT, |w| {
            (!w.messages().is_empty()).then_some(())
        })
        .await;
    let read = Command::ListDevices {
        page: PageQuery {
            limit: Some(1),
            ..PageQuery::default()
        },
    };
    let create = Command::CreateRollout {
        spec: "name = \"everyone\"\nrelease = \"fw-1\"\n[groups]\ncount = 4\n".into(),
    };
    let (first, created) = tokio::join!(
        client.request_reply(read.clone(), WAIT),
        client.request_reply(create, WAIT)
    );
    let first = first.expect("the read is answered");
    assert!(first.ok, "{first:?}");
    let created = created.expect("the create is answered");
    assert!(created.ok, "{created:?}");
    let status: RolloutStatus = serde_json::from_value(created.result).expect("status");
    assert_eq!(
        status.groups.iter().map(|g| g.total).sum::<usize>(),
        DEVICES as usize,
        "the rollout plans over every device with a retained state"
    );
    if !first.loading {
        eprintln!("note: the retained states were all read before the first read arrived");
    }

    // Requests keep being answered once the fleet is read; the broker let both logins in and
    // closed neither for the other.
    for _ in 0..3 {
        let again = client
            .request_reply(read.clone(), WAIT)
            .await
            .expect("answered");
        assert!(again.ok && !again.loading, "{again:?}");
    }
    // Since the coordinator started: each login connected once (a login taken over would
    // come back, and take over in turn, again and again).
    let broker = site.secure().log().split_off(logged_before);
    for login in [COORDINATOR, COORDINATOR_CONTROL] {
        let connects = broker.matches(&format!(" as {login} ")).count();
        assert_eq!(connects, 1, "{login} connected once:\n{broker}");
    }
    assert!(
        !broker.contains("already connected"),
        "no login took another connection over:\n{broker}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_without_the_control_login_still_gets_every_request_answered() {
    if !flotilla_tests::require_mosquitto(module_path!()) {
        return;
    }
    let mut site = Site::new(BrokerKind::Secure);
    // A broker set up before the control connection existed: no such login.
    let password =
        std::fs::read_to_string(site.secure().password_file(COORDINATOR)).expect("password");
    assert!(site.secure().logs_in(COORDINATOR_CONTROL, password.trim()));
    site.secure().remove_login(COORDINATOR_CONTROL);
    let mut refused = false;
    for _ in 0..100 {
        if !site.secure().logs_in(COORDINATOR_CONTROL, password.trim()) {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        refused,
        "the broker refuses the control login once it is removed"
    );

    let client = site.client().await;
    site.start_coordinator();
    let read = Command::ListDevices {
        page: PageQuery::default(),
    };
    // Asked until answered (a request sent before the coordinator subscribed is lost).
    let mut answered = None;
    for _ in 0..60 {
        if let Ok(reply) = client
            .request_reply(read.clone(), Duration::from_secs(1))
            .await
        {
            answered = Some(reply);
            break;
        }
    }
    let reply = answered.expect("answered on the main connection");
    assert!(reply.ok, "{reply:?}");
    for _ in 0..3 {
        let again = client
            .request_reply(read.clone(), WAIT)
            .await
            .expect("answered");
        assert!(again.ok, "{again:?}");
    }
    let log = std::fs::read_to_string(site.path("coordinator.log")).expect("log");
    assert!(
        log.contains("the control connection is not up"),
        "the coordinator says what to check:\n{log}"
    );
}
