//! The coordinator checks device signatures on several worker threads and still acts on device
//! messages in the order they arrived: every device of a burst of states is listed, each with
//! its signed state, and forged states in the burst are ignored. A control request sent after
//! the burst arrives on the coordinator's control connection (decision 0066) and is answered
//! without waiting for the burst: what it lists is only devices of the burst, and asked again
//! the coordinator lists all of them. (Mosquitto keeps one client's messages in order across
//! topics; the embedded rumqttd does not.)

use std::time::Duration;

use flotilla_protocol::control::{Command, ControlReply, ControlRequest, DeviceSummary};
use flotilla_protocol::operator::{new_nonce, SignedRequest};
use flotilla_protocol::{
    device, envelope, DeviceId, DeviceMessage, DeviceState, Message, Report, SigningKey, Topics,
};
use flotilla_tests::{BrokerKind, Site, ADMIN};
use rumqttc::{Event, Packet, QoS};

const DEVICES: u32 = 400;

fn key_of(n: u32) -> SigningKey {
    flotilla_tests::numbered_key(9, n)
}

fn id(n: u32) -> String {
    format!("ordered-{n:04}")
}

fn state(n: u32) -> DeviceMessage {
    DeviceMessage::State {
        state: DeviceState {
            device_id: id(n),
            hardware_id: "sim".into(),
            labels: vec![("burst".into(), "yes".into())],
            installed: None,
            current: None,
            online: true,
            agent_version: "test".into(),
            at: flotilla_tests::unix_now(),
        },
        enrollment: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_states_is_read_in_order_and_a_request_after_it_does_not_wait_for_it() {
    if !flotilla_tests::require_mosquitto(module_path!()) {
        return;
    }
    let mut site = Site::new(BrokerKind::Mosquitto);
    let authorized = flotilla_tests::authorized_keys(DEVICES, key_of, id);
    std::fs::write(site.authorized_keys_file(), authorized).expect("authorized keys");
    site.start_coordinator();
    // Answers once subscribed; from here on nothing this test sends is lost.
    let client = site.client().await;
    // Asked until answered (a request sent before the coordinator subscribed is lost).
    let mut devices = None;
    for _ in 0..30 {
        if let Ok(d) = client
            .list_devices(Default::default(), None, Duration::from_secs(1))
            .await
        {
            devices = Some(d);
            break;
        }
    }
    assert_eq!(devices.map(|d| d.len()), Some(0), "answered, no device yet");

    // One connection sends the burst and then the request, so the broker keeps their order.
    let topics = Topics::default();
    let mut options = site.connection().options("burst-sender".to_owned());
    options.set_max_packet_size(1 << 20, 1 << 20);
    let (sender, mut eventloop) = flotilla_mqtt::client(options, 10_000);
    let reply_to = topics.control_reply("burst-sender");
    sender
        .subscribe(reply_to.clone(), QoS::AtLeastOnce)
        .await
        .expect("queue subscribe");
    let subscribed = async {
        loop {
            if let Event::Incoming(Packet::SubAck(_)) = eventloop.poll().await.expect("connected") {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), subscribed)
        .await
        .expect("subscribed");
    let forger = key_of(DEVICES + 1);
    for n in 0..DEVICES {
        let device_id = DeviceId::new(id(n)).expect("id");
        let signed = |blob| envelope::encode(&Message::Device(blob));
        // A forged state for the device first (another key, not authorized), then its own
        // signed state, then a report: the forged one is ignored, the others pass in order.
        let mut forged = device::sign(&forger, &state(n));
        forged.signature[0] ^= 1;
        for (topic, payload) in [
            (topics.state(&device_id), signed(forged)),
            (
                topics.state(&device_id),
                signed(device::sign(&key_of(n), &state(n))),
            ),
            (
                topics.report(&device_id),
                signed(device::sign(
                    &key_of(n),
                    &DeviceMessage::Report(Report {
                        device_id: id(n),
                        seq: 1,
                        action_id: "none".into(),
                        rollout_id: "none".into(),
                        phase: flotilla_protocol::Phase::Accepted,
                        at: flotilla_tests::unix_now(),
                    }),
                )),
            ),
        ] {
            sender
                .publish(topic, QoS::AtLeastOnce, false, payload)
                .await
                .expect("queue");
        }
    }
    let burst: std::collections::BTreeSet<String> = (0..DEVICES).map(id).collect();
    let mut asked = 0;
    loop {
        let listed = ask(
            &sender,
            &mut eventloop,
            &site.operator_key(ADMIN),
            &reply_to,
            asked,
        )
        .await;
        asked += 1;
        assert!(
            listed.iter().all(|d| burst.contains(&d.id)),
            "only devices of the burst are listed"
        );
        assert!(
            listed.iter().all(|d| d.online && d.hardware_id == "sim"),
            "each with its signed state, the forged ones ignored"
        );
        if listed.len() == DEVICES as usize {
            break;
        }
        assert!(
            asked < 600,
            "the burst is never read whole: {} listed",
            listed.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sends a signed `ListDevices` on `sender` and returns what the reply lists.
async fn ask(
    sender: &rumqttc::AsyncClient,
    eventloop: &mut rumqttc::EventLoop,
    key: &SigningKey,
    reply_to: &str,
    n: usize,
) -> Vec<DeviceSummary> {
    let request = ControlRequest::new(
        format!("after-the-burst-{n}"),
        reply_to.to_owned(),
        flotilla_tests::unix_now(),
        new_nonce(),
        Command::ListDevices {
            page: Default::default(),
        },
    );
    let signed = SignedRequest::sign(key, &request);
    sender
        .publish(
            Topics::default().control_request(),
            QoS::AtLeastOnce,
            false,
            serde_json::to_vec(&signed).expect("json"),
        )
        .await
        .expect("queue request");
    let reply = async {
        loop {
            if let Event::Incoming(Packet::Publish(p)) = eventloop.poll().await.expect("connected")
            {
                if p.topic == reply_to {
                    return serde_json::from_slice::<ControlReply>(&p.payload).expect("reply");
                }
            }
        }
    };
    let reply = tokio::time::timeout(Duration::from_secs(60), reply)
        .await
        .expect("the request is answered");
    assert!(reply.ok, "{reply:?}");
    serde_json::from_value(reply.result).expect("devices")
}
