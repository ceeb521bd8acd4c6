//! issue 23: a fleet on a three-node NATS cluster started from the shipped `deploy/nats/`
//! files (tests/src/nats.rs): TLS, a password per login, the shipped permissions, retained
//! messages replicated on JetStream. Every client lists all three nodes (decision 0057).
//!
//! - Agents spread over the three nodes, the coordinator on node 1: a rollout finishes.
//! - The node the coordinator and two agents use is killed (SIGKILL) mid-rollout: the rollout
//!   still finishes, every device installed once, no action sent twice. (One node at a time:
//!   a second node's death soon after the first came back can leave subscriptions made while it
//!   was down without a quorum; docs/decisions/0061-nats-cluster-permissions-and-client-ids.md.)
//! - The permissions refuse what the Mosquitto ACL refuses (tests/tests/secure.rs), checked the
//!   same way: a reader that may see everything receives a marker published after the forbidden
//!   message was acknowledged, and nothing of the forbidden message before it. Where Mosquitto
//!   grants a subscription and filters its messages, NATS refuses the subscription in its SubAck.

use std::fs;

use flotilla_protocol::Topics;
use flotilla_tests::nats::{first_of, Cluster};
use flotilla_tests::secure::{COORDINATOR, MONITOR, OBSERVER, OPERATOR};
use flotilla_tests::{AgentOptions, Connected, Probe, Site, Watcher, WAIT};
use rumqttc::ConnectReturnCode;

const ROOT: &str = "flotilla/v1";
const FIRMWARE: &[u8] = b"firmware 2.0, carried by a NATS cluster\n";

/// Six devices, stage by stage, and the node (0-based) each starts on: every stage has devices
/// on two nodes, and each node holds two devices.
const DEVICES: [(&str, &str, usize); 6] = [
    ("dev-1", "a", 0),
    ("dev-2", "a", 1),
    ("dev-3", "b", 2),
    ("dev-4", "b", 0),
    ("dev-5", "c", 1),
    ("dev-6", "c", 2),
];

fn ids() -> Vec<&'static str> {
    DEVICES.iter().map(|(id, _, _)| *id).collect()
}

/// Three stages of two devices; `approval` puts an approval after the first.
fn spec(name: &str, approval: bool) -> String {
    let after = if approval {
        "after = { approval = true }\n"
    } else {
        ""
    };
    format!(
        "name = \"{name}\"\nrelease = \"fw-2\"\n[[staged.stage]]\nname = \"a\"\nselect = \"stage=a\"\n\
         {after}[[staged.stage]]\nname = \"b\"\nselect = \"stage=b\"\n\
         [[staged.stage]]\nname = \"c\"\nselect = \"stage=c\"\n"
    )
}

/// The node list of device `id` that makes it start on node `node`: flotilla-mqtt dials the
/// list from the entry its client id picks (decision 0057), then the next.
fn list_starting_on(cluster: &Cluster, id: &str, node: usize) -> Vec<u16> {
    let ports = cluster.mqtt_ports();
    let picked = first_of(id, ports.len());
    (0..ports.len())
        .map(|i| ports[(node + ports.len() + i - picked) % ports.len()])
        .collect()
}

/// A site on a fresh cluster with the release, the coordinator (nodes from node 1) and the
/// six agents online, each on its node.
async fn fleet(options: AgentOptions) -> Site {
    let mut site = Site::nats_cluster(&ids());
    site.release("fw-2", 2, FIRMWARE);
    site.start_coordinator();
    for (id, stage, node) in DEVICES {
        // A state can be lost at the start: the coordinator subscribes on node 1 while the
        // agents publish, and a state published there before the subscription, before node
        // 1's copy of the retained messages has it, reaches the coordinator neither way (seen
        // in CI: the two devices of node 1 never listed). Agents send it again every few
        // seconds here (every 15 minutes by default; decision 0072).
        let options = AgentOptions {
            broker_ports: Some(list_starting_on(site.cluster(), id, node)),
            state_refresh: Some("3s"),
            ..options.clone()
        };
        site.add_agent(id, &[("stage", stage)], options);
    }
    site.wait_devices(DEVICES.len()).await;
    site
}

fn agent_log(site: &Site, id: &str) -> String {
    fs::read_to_string(site.path(&format!("agents/{id}/agent.log"))).unwrap_or_default()
}

/// Finished, every stage's devices ready, every device running the release, installed once.
fn every_device_installed_once(site: &Site, status: &flotilla_protocol::control::RolloutStatus) {
    assert_eq!(status.state, "finished", "{status:#?}");
    for group in &status.groups {
        assert_eq!(group.ready, group.total, "no report lost: {status:#?}");
    }
    for (id, _, _) in DEVICES {
        assert_eq!(
            fs::read(site.target_file(id)).expect("target file"),
            FIRMWARE,
            "{id} runs the new firmware"
        );
        let log = agent_log(site, id);
        let finished = log
            .lines()
            .filter(|l| l.contains("action finished"))
            .count();
        assert_eq!(finished, 1, "{id} installed exactly once; its log:\n{log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_to_agents_spread_over_three_nodes_finishes() {
    let mut site = fleet(AgentOptions::default()).await;
    let ports = site.cluster().mqtt_ports();
    // Each device started on its node, and says which.
    for (id, _, node) in DEVICES {
        let log = agent_log(&site, id);
        let used = log
            .lines()
            .find(|l| l.contains("using broker"))
            .unwrap_or_else(|| panic!("{id} names the node it uses:\n{log}"));
        assert!(
            used.contains(&format!("127.0.0.1:{}", ports[node])),
            "{id} started on node {}: {used}",
            node + 1
        );
    }
    // The operator's CLI, over the cluster with its own login, lists the fleet.
    let listed = site.flotilla(&["devices"]);
    for id in ids() {
        assert!(listed.contains(id), "the CLI lists {id}:\n{listed}");
    }

    site.create_and_start(&spec("spread", false)).await;
    let status = site.wait_ended("spread").await;
    every_device_installed_once(&site, &status);
}

/// The node the coordinator uses dies (SIGKILL) while the first stage installs; it also holds
/// dev-1 (in that stage) and dev-4 (in the next). Everyone moves on to the other two nodes and
/// the rollout finishes there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_coordinators_node_mid_rollout_still_installs_every_device_once() {
    // Slow enough downloads that the stage is still under way when the node dies.
    let options = AgentOptions {
        soak: "2s",
        max_bytes_per_sec: 8192,
        block_size: 4096,
        ..AgentOptions::default()
    };
    let mut site = fleet(options).await;
    // What the coordinator sends, watched from node 2, which stays up.
    let desired = Watcher::connect(
        site.cluster().login(MONITOR, 1),
        &[Topics::default().desired_filter()],
    )
    .await;

    site.create_and_start(&spec("crash", false)).await;
    desired
        .wait_until("stage a's first desired action", WAIT, |w| {
            w.desired_actions()
                .iter()
                .any(|(d, _)| d == "dev-1")
                .then_some(())
        })
        .await;
    site.cluster().kill(0);

    // The two nodes left elect new JetStream leaders and drop their MQTT clients meanwhile (for
    // about 10 s here, longer on a busy machine); everyone reconnects with backoff. A minute is
    // tight for that on two busy cores: allow three.
    let status = site
        .wait_status(
            "crash",
            "the rollout to end after node 1's death",
            WAIT * 3,
            |s| {
                matches!(
                    s.state.as_str(),
                    "finished" | "paused" | "failed" | "stopped"
                )
            },
        )
        .await;
    every_device_installed_once(&site, &status);
    let mut seen = std::collections::BTreeMap::new();
    for (device, action) in desired.desired_actions() {
        *seen.entry((device, action)).or_insert(0) += 1;
    }
    // The same action may arrive twice: QoS 1 is at least once, a JetStream consumer moved to
    // another node redelivers, and a coordinator that cannot read the retained actions while
    // JetStream elects sends them again under the same id. An agent acts once per id (checked
    // above: every device installed once); what must not happen is a second, different action.
    let twice: Vec<_> = seen.iter().filter(|(_, &n)| n > 1).collect();
    if !twice.is_empty() {
        eprintln!("delivered more than once (same action id, installed once): {twice:?}");
    }
    assert_eq!(
        seen.len(),
        DEVICES.len(),
        "one action id per device: {seen:?}"
    );

    // The coordinator and the agents of the dead node went on to another node.
    let coordinator = fs::read_to_string(site.path("coordinator.log")).expect("coordinator log");
    assert!(
        coordinator.contains("MQTT connection lost")
            && coordinator
                .lines()
                .filter(|l| l.contains("using broker"))
                .count()
                >= 2,
        "the coordinator lost node 1 and went on to another:\n{coordinator}"
    );
    for id in ["dev-1", "dev-4"] {
        let log = agent_log(&site, id);
        assert!(
            log.lines().filter(|l| l.contains("using broker")).count() >= 2,
            "{id} moved to another node:\n{log}"
        );
    }
}

async fn accepted(connection: &flotilla_mqtt::Connection, client_id: &str) -> Probe {
    match Probe::connect(connection, client_id).await {
        (Connected::Accepted, Some(probe)) => probe,
        (other, _) => panic!("{client_id} was not let in: {other:?}"),
    }
}

/// Logs in as `user` with NATS's own protocol on `port` and returns the server's answer.
fn nats_protocol_login(port: u16, user: &str, password: &str) -> String {
    use std::io::{BufRead, Write};
    let stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("NATS client port");
    stream.set_read_timeout(Some(WAIT)).expect("read timeout");
    let mut reader = std::io::BufReader::new(stream.try_clone().expect("clone"));
    let mut info = String::new();
    reader.read_line(&mut info).expect("INFO");
    assert!(
        info.starts_with("INFO "),
        "the server introduces itself: {info}"
    );
    let connect = format!(
        "CONNECT {{\"verbose\":false,\"user\":{user:?},\"pass\":{password:?},\"protocol\":1}}\r\nPING\r\n"
    );
    (&stream).write_all(connect.as_bytes()).expect("CONNECT");
    let mut answer = String::new();
    reader.read_line(&mut answer).expect("answer");
    answer
}

fn topics(messages: &[(String, Vec<u8>)]) -> Vec<&str> {
    messages.iter().map(|(t, _)| t.as_str()).collect()
}

/// What `probe` received before `marker`, sorted by topic, and then whatever of `expected` had
/// not arrived yet. NATS keeps order within one JetStream consumer only while nothing is
/// redelivered, and a subscription per filter is a consumer each: on a busy machine an allowed
/// message can come after the marker. A forbidden one never comes: its publish was refused, or
/// no subscription of the reader's matches it (the SubAcks refused above).
async fn received(probe: &mut Probe, marker: &str, expected: &[&str]) -> Vec<(String, Vec<u8>)> {
    let mut seen = probe.until(marker).await;
    while let Some(missing) = expected
        .iter()
        .find(|topic| !seen.iter().any(|(t, _)| t == *topic))
    {
        match probe.next_publish(WAIT).await {
            Some(message) => seen.push(message),
            None => panic!("{missing} did not arrive within {WAIT:?}; before it: {seen:?}"),
        }
    }
    seen.sort();
    seen
}

/// The cases of tests/tests/secure.rs on the cluster, with the writers, the readers and the
/// monitor that sees everything on different nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_permissions_refuse_what_the_mosquitto_acl_refuses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cluster = Cluster::start(dir.path(), &["dev-a", "dev-b"]);
    let mut all = accepted(&cluster.login(MONITOR, 2), MONITOR).await;
    assert!(all.subscribe(&format!("{ROOT}/#")).await);

    // Who gets in: no one without a login, a wrong password, or TLS.
    let mut anonymous = cluster.login("dev-a", 0);
    anonymous.credentials = None;
    let (answer, _) = Probe::connect(&anonymous, "anon").await;
    assert!(
        matches!(answer, Connected::Refused(_)),
        "an anonymous client is refused: {answer:?}"
    );
    let mut wrong = cluster.login("dev-a", 0);
    if let Some(c) = wrong.credentials.as_mut() {
        c.password = flotilla_mqtt::Password::new("not-the-password");
    }
    let (answer, _) = Probe::connect(&wrong, "dev-a").await;
    assert_eq!(
        answer,
        Connected::Refused(ConnectReturnCode::NotAuthorized),
        "a wrong password is refused"
    );
    let mut cleartext = cluster.login("dev-a", 0);
    cleartext.tls = None;
    let (answer, _) = Probe::connect(&cleartext, "dev-a").await;
    assert!(
        matches!(answer, Connected::Failed(_)),
        "no MQTT without TLS: {answer:?}"
    );

    // Nor with NATS's own protocol, where a login could subscribe to the server's subjects:
    // every flotilla login is MQTT only.
    let password = fs::read_to_string(cluster.password_file("dev-a")).expect("password");
    assert!(
        nats_protocol_login(cluster.nodes[0].client_port, "dev-a", password.trim())
            .contains("Authorization Violation"),
        "a device's login is refused on NATS's own protocol"
    );

    // A device writes only its own report, state and fetch.
    let mut device = accepted(&cluster.login("dev-a", 1), "dev-a").await;
    for topic in [
        format!("{ROOT}/devices/dev-b/report"),
        format!("{ROOT}/devices/dev-b/state"),
        format!("{ROOT}/devices/dev-b/fetch"),
        format!("{ROOT}/devices/dev-a/desired"),
        format!("{ROOT}/devices/dev-a/block"),
        format!("{ROOT}/devices/dev-b/desired"),
        format!("{ROOT}/control/request"),
        format!("{ROOT}/events/log"),
        format!("{ROOT}/coordinator/marker"),
    ] {
        device.publish(&topic, b"forged", false).await;
    }
    device
        .publish(&format!("{ROOT}/devices/dev-a/state"), b"own state", true)
        .await;
    device
        .publish(&format!("{ROOT}/devices/dev-a/fetch"), b"own fetch", false)
        .await;
    let marker = format!("{ROOT}/devices/dev-a/report");
    device.publish(&marker, b"own report", false).await;
    let own = [
        format!("{ROOT}/devices/dev-a/fetch"),
        format!("{ROOT}/devices/dev-a/state"),
    ];
    assert_eq!(
        topics(&received(&mut all, &marker, &[&own[0], &own[1]]).await),
        own,
        "only the device's own state, fetch and report reach the coordinator"
    );

    // A device reads only its own desired and block: anything wider is refused, including the
    // server's own $MQTT subjects.
    for filter in [
        format!("{ROOT}/#"),
        format!("{ROOT}/devices/+/desired"),
        format!("{ROOT}/devices/dev-b/desired"),
        format!("{ROOT}/devices/dev-b/block"),
        format!("{ROOT}/devices/dev-b/state"),
        format!("{ROOT}/control/request"),
        format!("{ROOT}/events/#"),
        "$MQTT/sub/#".to_owned(),
        "#".to_owned(),
    ] {
        assert!(
            !device.subscribe(&filter).await,
            "dev-a may not subscribe to {filter}"
        );
    }
    assert!(
        device
            .subscribe(&format!("{ROOT}/devices/dev-a/desired"))
            .await
    );
    assert!(
        device
            .subscribe(&format!("{ROOT}/devices/dev-a/block"))
            .await
    );
    let mut coordinator = accepted(&cluster.login(COORDINATOR, 0), "coordinator-writer").await;
    for topic in [
        format!("{ROOT}/devices/dev-b/desired"),
        format!("{ROOT}/devices/dev-b/block"),
        format!("{ROOT}/devices/dev-b/state"),
        format!("{ROOT}/control/request"),
        format!("{ROOT}/events/log"),
        format!("{ROOT}/devices/dev-a/block"),
    ] {
        coordinator.publish(&topic, b"for someone", false).await;
    }
    let marker = format!("{ROOT}/devices/dev-a/desired");
    coordinator.publish(&marker, b"yours", true).await;
    // Its desired and block are two subscriptions (no order between them on NATS): the block
    // may come after the marker.
    let block = format!("{ROOT}/devices/dev-a/block");
    assert_eq!(
        topics(&received(&mut device, &marker, &[&block]).await),
        vec![block.as_str()],
        "dev-a reads only its own desired and block"
    );
    let _ = all.until(&marker).await;
    // Retained: the device's desired action waits for it on another node.
    let mut again = accepted(&cluster.login("dev-a", 2), "dev-a-again").await;
    assert!(again.subscribe(&marker).await);
    assert_eq!(
        again.next_publish(WAIT).await,
        Some((marker.clone(), b"yours".to_vec())),
        "the retained desired action is kept for the device on every node"
    );
    assert_eq!(device.losses(), 0, "refusals did not cost dev-a its link");

    // An observer reads the events only; an operator sends control requests and reads the
    // events and its own login's replies.
    let mut observer = accepted(&cluster.login(OBSERVER, 1), "dashboard").await;
    let operator_id = "flotilla-cli-test-1";
    let mut operator = accepted(&cluster.login(OPERATOR, 2), operator_id).await;
    let mut monitor = accepted(&cluster.login(MONITOR, 1), "monitor-writer").await;
    for client in [&mut observer, &mut monitor] {
        client
            .publish(&format!("{ROOT}/control/request"), b"read only", false)
            .await;
        client
            .publish(&format!("{ROOT}/devices/obs/state"), b"read only", false)
            .await;
    }
    operator
        .publish(&format!("{ROOT}/control/request"), b"operator", false)
        .await;
    operator
        .publish(&format!("{ROOT}/devices/dev-a/desired"), b"operator", false)
        .await;
    for client in [&mut observer, &mut operator] {
        client
            .publish(&format!("{ROOT}/coordinator/marker"), b"forged", false)
            .await;
    }
    let marker = format!("{ROOT}/events/marker-1");
    coordinator.publish(&marker, b"", false).await;
    let request = format!("{ROOT}/control/request");
    assert_eq!(
        received(&mut all, &marker, &[&request]).await,
        vec![(request.clone(), b"operator".to_vec())],
        "only the operator's control request arrives; nobody else writes control, device \
         topics or the coordinator's marker"
    );

    for filter in [
        format!("{ROOT}/#"),
        format!("{ROOT}/devices/+/state"),
        format!("{ROOT}/control/request"),
        format!("{ROOT}/control/reply/+"),
        format!("{ROOT}/coordinator/marker"),
    ] {
        assert!(!observer.subscribe(&filter).await, "observer: {filter}");
        assert!(!operator.subscribe(&filter).await, "operator: {filter}");
    }
    assert!(
        !operator
            .subscribe(&format!("{ROOT}/control/reply/{operator_id}"))
            .await,
        "the operator's replies are its login's, not its client id's"
    );
    assert!(
        !observer
            .subscribe(&format!("{ROOT}/control/reply/{OBSERVER}"))
            .await
    );
    assert!(observer.subscribe(&format!("{ROOT}/events/#")).await);
    assert!(operator.subscribe(&format!("{ROOT}/events/#")).await);
    assert!(
        operator
            .subscribe(&format!("{ROOT}/control/reply/{OPERATOR}"))
            .await
    );
    for topic in [
        format!("{ROOT}/devices/dev-a/state"),
        format!("{ROOT}/control/reply/someone-else"),
        format!("{ROOT}/events/rollouts/fw-2"),
        format!("{ROOT}/control/reply/{operator_id}"),
        format!("{ROOT}/control/reply/{OPERATOR}"),
        format!("{ROOT}/coordinator/marker"),
    ] {
        coordinator.publish(&topic, b"for someone", false).await;
    }
    let marker = format!("{ROOT}/events/marker-2");
    coordinator.publish(&marker, b"", false).await;
    let event = format!("{ROOT}/events/rollouts/fw-2");
    assert_eq!(
        topics(&received(&mut observer, &marker, &[&event]).await),
        vec![event.as_str()],
        "the observer sees the events and nothing else"
    );
    // Two subscriptions, two JetStream consumers: the reply may come after the marker. What
    // else the operator may not read, its SubAcks refused above.
    let reply = format!("{ROOT}/control/reply/{OPERATOR}");
    assert_eq!(
        topics(&received(&mut operator, &marker, &[&reply, &event]).await),
        vec![reply.as_str(), event.as_str()],
        "the operator sees the events and its own login's replies"
    );
}
