//! issue 10, case 2: a flood of forged desired actions on an agent's topic and of junk control
//! requests on the coordinator's, while a rollout runs. Both keep working: the rollout finishes,
//! and both processes still stop within seconds on SIGTERM.

use std::time::Duration;

use flotilla_protocol::signing::generate_key;
use flotilla_protocol::{
    envelope, ActionBody, DesiredAction, DeviceId, Message, SignedBlob, Topics,
};
use flotilla_tests::{AgentOptions, BrokerKind, Site};
use rumqttc::{AsyncClient, MqttOptions, QoS};

const ID: &str = "dev-flooded";
const FORGERIES: usize = 3_000;
const JUNK_REQUESTS: usize = 3_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floods_of_forged_messages_stop_neither_agent_nor_coordinator() {
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-9", 9, b"firmware nine\n");
    site.start_coordinator();
    site.add_agent(
        ID,
        &[("ring", "flood")],
        AgentOptions {
            soak: "2s",
            ..AgentOptions::default()
        },
    );
    site.wait_online(ID, true).await;
    site.create_and_start(
        "name = \"flood\"\nrelease = \"fw-9\"\nselect = \"ring=flood\"\n[groups]\ncount = 1\n",
    )
    .await;

    // An attacker's client: forged desired actions for the device (signed by its own key,
    // claiming fresh action ids) and junk on the control topic, as fast as the broker takes them.
    let mut options = MqttOptions::new("attacker", "127.0.0.1", site.port);
    options.set_max_packet_size(1 << 20, 1 << 20);
    let (attacker, eventloop) = AsyncClient::new(options, 10_000);
    // A broker may drop a client that floods it; the attacker reconnects and goes on.
    let poller = flotilla_tests::mqtt::keep_polling("attacker", eventloop);
    let topics = Topics::default();
    let desired = topics.desired(&DeviceId::new(ID).expect("id"));
    let rogue = generate_key();
    for n in 0..FORGERIES {
        let action = DesiredAction {
            action_id: format!("forged-{n}"),
            device_id: ID.into(),
            rollout_id: "flood".into(),
            issued_at: u64::MAX / 2,
            expires_at: u64::MAX,
            body: ActionBody::Nothing,
        };
        let blob = SignedBlob::sign(&rogue, envelope::to_bytes(&action));
        attacker
            .publish(
                desired.clone(),
                QoS::AtMostOnce,
                false,
                envelope::encode(&Message::Desired(blob)),
            )
            .await
            .expect("queue forged desired action");
    }
    let control = topics.control_request();
    for n in 0..JUNK_REQUESTS {
        attacker
            .publish(
                control.clone(),
                QoS::AtMostOnce,
                false,
                format!("{{\"junk\": {n}}}").into_bytes(),
            )
            .await
            .expect("queue junk control request");
    }

    let status = site.wait_ended("flood").await;
    assert_eq!(status.state, "finished", "{status:#?}");
    assert_eq!(
        std::fs::read(site.target_file(ID)).expect("target"),
        b"firmware nine\n"
    );

    let agent = site.terminate_agent(ID, Duration::from_secs(10));
    assert!(
        agent.is_some_and(|s| s.success()),
        "the agent stops cleanly within 10s of SIGTERM: {agent:?}"
    );
    let coordinator = site.terminate_coordinator(Duration::from_secs(10));
    assert!(
        coordinator.is_some_and(|s| s.success()),
        "the coordinator stops cleanly within 10s of SIGTERM: {coordinator:?}"
    );
    poller.abort();
}

/// Publishes `payload` retained as any client could, whatever the broker does with it (Mosquitto
/// disconnects a client whose packet is too large).
async fn publish_raw(port: u16, topic: String, payload: Vec<u8>) {
    let mut options = MqttOptions::new(format!("oversize-{}", payload.len()), "127.0.0.1", port);
    options.set_max_packet_size(4 << 20, 4 << 20);
    let (client, mut eventloop) = AsyncClient::new(options, 10);
    client
        .publish(topic, QoS::AtLeastOnce, true, payload)
        .await
        .expect("queue publish");
    let _ = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            match eventloop.poll().await {
                Ok(rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_))) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
}

/// issue 10, case 4: one oversized retained message on a topic a client subscribes to made it
/// drop its connection on every delivery, reconnecting every 250 ms and answering nothing (1 MiB
/// for the coordinator, 300 kB on an agent's `desired`). The broker now refuses what is larger
/// than any flotilla message, and clients read anything a broker can deliver: the rollout runs
/// and neither link ever drops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_retained_messages_lock_nobody_out() {
    const DEV: &str = "dev-oversized";
    let mut site = Site::new(BrokerKind::Mosquitto);
    site.release("fw-4", 4, b"firmware four\n");
    site.start_coordinator();
    site.add_agent(DEV, &[("ring", "big")], AgentOptions::default());
    site.wait_online(DEV, true).await;

    let topics = Topics::default();
    let id = DeviceId::new(DEV).expect("id");
    publish_raw(site.port, topics.state(&id), vec![7; 1 << 20]).await;
    publish_raw(site.port, topics.desired(&id), vec![7; 300_000]).await;
    // Just under the broker's limit, with a 20 kB topic: larger than the coordinator used to
    // read, within what it reads now.
    let long = format!("{}/devices/{}/state", topics.prefix(), "x".repeat(20_000));
    publish_raw(
        site.port,
        long,
        vec![7; flotilla_protocol::BROKER_PACKET_LIMIT - 21_000],
    )
    .await;

    let client = site.client().await;
    for _ in 0..10 {
        client
            .request(
                flotilla_protocol::control::Command::ListDevices {
                    page: Default::default(),
                },
                Duration::from_secs(5),
            )
            .await
            .expect("the coordinator answers");
    }
    site.create_and_start(
        "name = \"big\"\nrelease = \"fw-4\"\nselect = \"ring=big\"\n[groups]\ncount = 1\n",
    )
    .await;
    let status = site.wait_ended("big").await;
    assert_eq!(status.state, "finished", "{status:#?}");

    let coordinator_log = std::fs::read_to_string(site.path("coordinator.log")).expect("log");
    assert!(
        !coordinator_log.contains("MQTT connection lost"),
        "the coordinator's link never dropped:\n{coordinator_log}"
    );
    let agent_log =
        std::fs::read_to_string(site.path(&format!("agents/{DEV}/agent.log"))).expect("log");
    assert!(
        !agent_log.contains("broker connection:"),
        "the agent's link never dropped:\n{agent_log}"
    );
}
