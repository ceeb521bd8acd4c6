//! issue 19, item 9: the coordinator, the agent and the CLI on brokers they do not configure.
//!
//! On a broker without a packet-size limit (Debian's stock Mosquitto, NATS's MQTT listener, many
//! hosted brokers) anyone may leave a message of any size, retained, on a topic a flotilla
//! process subscribes to. rumqttc refused such a packet by dropping the connection, got the
//! retained message again on reconnecting, and so on every 250 ms: the process heard nothing
//! else. Every flotilla link now goes through flotilla-mqtt's size guard (decision 0039): the
//! message is skipped as it streams, counted and dropped, and the link stays up.

use std::time::Duration;

use flotilla_protocol::control::Command;
use flotilla_protocol::{DeviceId, Topics};
use flotilla_tests::{AgentOptions, BrokerKind, Site, WAIT};
use rumqttc::{AsyncClient, MqttOptions, QoS};

const DEV: &str = "dev-huge";

/// Publishes `size` bytes on `topic` as any client of the broker could, and waits for the
/// broker to take it.
async fn publish_huge(port: u16, topic: &str, size: usize, retain: bool) {
    let mut options = MqttOptions::new(
        format!("huge-{}", flotilla_tests::free_port()),
        "127.0.0.1",
        port,
    );
    options.set_max_packet_size(64 << 20, 64 << 20);
    let (client, mut eventloop) = AsyncClient::new(options, 10);
    client
        .publish(topic, QoS::AtLeastOnce, retain, vec![7u8; size])
        .await
        .expect("queue publish");
    tokio::time::timeout(WAIT, async {
        loop {
            match eventloop.poll().await {
                Ok(rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_))) => return,
                Ok(_) => {}
                Err(e) => panic!("publishing {size} bytes on {topic}: {e}"),
            }
        }
    })
    .await
    .expect("the broker took the message");
    let _ = client.disconnect().await;
    let _ = tokio::time::timeout(Duration::from_secs(1), eventloop.poll()).await;
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0)
}

/// Messages of `size` bytes, retained on topics the coordinator and the agent subscribe to and
/// sent to the control client's reply topic: every link stays up, the coordinator answers, the
/// agent installs, and the coordinator counts what it dropped.
async fn nobody_is_deafened(kind: BrokerKind, size: usize) {
    let mut site = Site::new(kind);
    site.release("fw-4", 4, b"firmware four\n");
    let metrics = site.enable_metrics();
    site.start_coordinator();
    site.add_agent(DEV, &[("ring", "big")], AgentOptions::default());
    site.wait_online(DEV, true).await;

    let topics = Topics::default();
    let id = DeviceId::new(DEV).expect("id");
    let other = DeviceId::new("dev-other").expect("id");
    // The coordinator's topics.
    let coordinator_topics = [
        topics.state(&other),
        topics.report(&other),
        topics.fetch(&other),
        topics.control_request(),
    ];
    for topic in &coordinator_topics {
        publish_huge(site.port, topic, size, true).await;
    }
    // The agent's topics.
    for topic in [
        topics.desired(&id),
        topics.block(&id),
        topics.peer_fetch(&id),
        topics.peer_block(&id, &other),
    ] {
        publish_huge(site.port, &topic, size, true).await;
    }
    // The control client's reply topic, while it is subscribed: the reply to its next request
    // comes after this message on the same subscription.
    let client = site.client().await;
    publish_huge(site.port, client.reply_topic(), size, false).await;
    client
        .request(
            Command::ListDevices {
                page: Default::default(),
            },
            Duration::from_secs(10),
        )
        .await
        .expect("the control client's link stayed up and the coordinator answered");
    drop(client);

    // The agent restarts: its link subscribes again and gets every retained giant again.
    site.terminate_agent(DEV, Duration::from_secs(10));
    site.wait_online(DEV, false).await;
    site.start_agent(DEV);
    site.wait_online(DEV, true).await;
    site.create_and_start(
        "name = \"big\"\nrelease = \"fw-4\"\nselect = \"ring=big\"\n[groups]\ncount = 1\n",
    )
    .await;
    let status = site.wait_ended("big").await;
    assert_eq!(status.state, "finished", "{status:#?}");
    assert_eq!(
        std::fs::read(site.target_file(DEV)).expect("target"),
        b"firmware four\n"
    );

    let text = flotilla_tests::scrape_metrics(metrics).await;
    let oversized = metric(&text, "flotilla_link_incoming_oversized_total");
    assert!(
        oversized >= coordinator_topics.len() as u64,
        "the coordinator counted the {} messages it dropped: {oversized}",
        coordinator_topics.len()
    );
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
    assert!(
        agent_log.contains("dropped unread"),
        "the agent says what it dropped:\n{agent_log}"
    );
}

/// Mosquitto without `max_packet_size`, as Debian installs it: 4 MiB messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_any_size_on_mosquitto_without_a_limit_deafen_nobody() {
    nobody_is_deafened(BrokerKind::Unlimited, 4 << 20).await;
}

/// NATS's MQTT listener, which speaks MQTT 3.1.1 only (no Maximum Packet Size to ask for):
/// messages just under its own limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_any_size_on_nats_deafen_nobody() {
    nobody_is_deafened(BrokerKind::Nats, flotilla_tests::nats::MAX_PAYLOAD - 4096).await;
}
