//! Peer sharing through a site broker bridged to the central broker (docs/peers.md): the shipped
//! bridge and ACLs on real Mosquitto processes, a site of real agents behind the bridge with the
//! coordinator on the central broker, and the coordinator's handling of bytes by source.
//!
//! Full peer sharing: the coordinator serves about one copy for the whole site, a malicious peer
//! is refused per block and named in the trace, a peer killed mid-transfer leaves the others to
//! finish.

use std::collections::BTreeMap;
use std::fs;
use std::time::Duration;

use flotilla_protocol::control::SourceBytes;
use flotilla_protocol::{
    device, envelope, BypassedPeer, ByteCounts, DeviceId, DeviceMessage, Message, Phase, Report,
    Topics,
};
use flotilla_tests::bridge::{
    self, CentralBroker, SiteBroker, BRIDGE_STATE_TOPIC, BRIDGE_USER, MONITOR,
};
use flotilla_tests::{
    require_mosquitto, AgentOptions, BrokerKind, Probe, Site, WatchedMessage, Watcher, WAIT,
};

const COORDINATOR: &str = "flotilla-coordinator";
/// The central broker's read-only monitor.
const CENTRAL_MONITOR: &str = flotilla_tests::secure::MONITOR;

/// An artifact whose every 64 KiB block differs from the others.
fn artifact(size: usize) -> Vec<u8> {
    (0..size)
        .map(|i| ((i / 7) as u32 ^ (i as u32 >> 16)).wrapping_mul(2_654_435_761) as u8)
        .collect()
}

async fn probe(connection: flotilla_mqtt::Connection, client_id: &str) -> Probe {
    let (answer, probe) = Probe::connect(&connection, client_id).await;
    probe.unwrap_or_else(|| panic!("{client_id} could not log in: {answer:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_bridge_carries_device_topics_and_keeps_peer_topics_on_the_site() {
    if !require_mosquitto(module_path!()) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let central = CentralBroker::start(&dir.path().join("central"), &[COORDINATOR, BRIDGE_USER]);
    let devices = vec!["harbour-1".to_owned(), "harbour-2".to_owned()];
    let site = SiteBroker::start(
        &dir.path().join("site"),
        central.port,
        &central.password(BRIDGE_USER),
        &devices,
    );
    site.wait_bridged(central.login(COORDINATOR)).await;

    let topics = Topics::default();
    let one = DeviceId::new("harbour-1").expect("id");
    let two = DeviceId::new("harbour-2").expect("id");
    let mut coordinator = probe(central.login(COORDINATOR), "flotilla-coordinator").await;
    assert!(coordinator.subscribe("flotilla/v1/#").await);
    let mut dev1 = probe(site.login("harbour-1"), "harbour-1").await;
    let mut dev2 = probe(site.login("harbour-2"), "harbour-2").await;

    // Mosquitto grants every subscription and filters each message by the ACL on delivery:
    // harbour-2 subscribes to everything and must get only what is meant for it.
    for filter in [
        topics.desired(&one),
        topics.block(&one),
        topics.peer_fetch(&one),
        topics.peer_block_filter(&one),
    ] {
        assert!(dev1.subscribe(&filter).await, "harbour-1 may read {filter}");
    }
    dev2.subscribe("flotilla/v1/#").await;

    // Out over the bridge: a device's state reaches the coordinator on the central broker.
    dev1.publish(&topics.state(&one), b"state of harbour-1", false)
        .await;
    coordinator.until(&topics.state(&one)).await;

    // In over the bridge: the coordinator's desired action and block reply reach the device.
    coordinator
        .publish(&topics.desired(&one), b"desired for harbour-1", false)
        .await;
    coordinator
        .publish(&topics.block(&one), b"block for harbour-1", false)
        .await;
    let got = dev1.until(&topics.block(&one)).await;
    assert_eq!(
        got,
        vec![(topics.desired(&one), b"desired for harbour-1".to_vec())],
        "harbour-1 got its desired action over the bridge"
    );

    // Peer traffic stays on the site: a request to a peer and the peer's blocks reach the
    // devices and never the central broker. A block posing as another peer, and a state posing
    // as another device, are dropped.
    dev2.publish(
        &topics.peer_fetch(&one),
        b"peer-fetch from harbour-2",
        false,
    )
    .await;
    let at_dev1 = dev1.until(&topics.peer_fetch(&one)).await;
    assert!(at_dev1.is_empty(), "{at_dev1:?}");
    dev1.publish(
        &topics.peer_block(&two, &two),
        b"posing as harbour-2",
        false,
    )
    .await;
    dev1.publish(&topics.state(&two), b"posing as harbour-2", false)
        .await;
    dev1.publish(
        &topics.peer_block(&two, &one),
        b"block from harbour-1",
        false,
    )
    .await;
    let at_dev2 = dev2.until(&topics.peer_block(&two, &one)).await;
    assert!(
        at_dev2.is_empty(),
        "harbour-2 read what is not meant for it: {at_dev2:?}"
    );
    dev1.publish(&topics.state(&one), b"marker", false).await;
    let at_central = coordinator.until(&topics.state(&one)).await;
    assert!(
        at_central
            .iter()
            .all(|(t, _)| !t.contains("/peer-") && *t != topics.state(&two)),
        "the central broker saw peer traffic or a forged state: {at_central:?}"
    );

    // The site's monitoring login sees the bridge's state on the site broker; a device does not.
    let mut monitor = probe(site.login(MONITOR), "site-monitor").await;
    assert!(monitor.subscribe(BRIDGE_STATE_TOPIC).await);
    // The retained link state arrives on subscribing.
    monitor.until(BRIDGE_STATE_TOPIC).await;

    // The bridge user may carry device topics only: not control requests or events.
    let (answer, bridge_login) = Probe::connect(&central.login(BRIDGE_USER), "impostor").await;
    let mut bridge_login = bridge_login.unwrap_or_else(|| panic!("{answer:?}"));
    bridge_login
        .publish(
            "flotilla/v1/control/request",
            b"from the bridge user",
            false,
        )
        .await;
    bridge_login
        .publish(&topics.state(&one), b"marker 2", false)
        .await;
    let seen = coordinator.until(&topics.state(&one)).await;
    assert!(
        seen.iter().all(|(t, _)| !t.contains("/control/")),
        "the bridge user published a control request: {seen:?}"
    );
}

/// issue 19, item 2, on the site broker and the bridge: a device of the site connected under
/// another device's id and the site broker dropped that device; a device with a central login
/// could do the same to the coordinator or to a whole site's bridge. The shipped site listener
/// and the central broker's rule replace client ids with user names, so nobody is knocked off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_device_takes_over_another_clients_id_on_the_site_or_the_central_broker() {
    if !require_mosquitto(module_path!()) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let central = CentralBroker::start(
        &dir.path().join("central"),
        &[COORDINATOR, BRIDGE_USER, CENTRAL_MONITOR, "central-dev"],
    );
    let devices = vec!["harbour-1".to_owned(), "harbour-2".to_owned()];
    let site = SiteBroker::start(
        &dir.path().join("site"),
        central.port,
        &central.password(BRIDGE_USER),
        &devices,
    );
    site.wait_bridged(central.login(CENTRAL_MONITOR)).await;
    // The bridge's link state from now on (the retained "1" first).
    let links = Watcher::connect(
        central.login(CENTRAL_MONITOR),
        &[BRIDGE_STATE_TOPIC.to_owned()],
    )
    .await;

    let topics = Topics::default();
    let one = DeviceId::new("harbour-1").expect("id");
    let mut coordinator = probe(central.login(COORDINATOR), COORDINATOR).await;
    assert!(coordinator.subscribe(&topics.state(&one)).await);
    let mut dev1 = probe(site.login("harbour-1"), "harbour-1").await;
    assert!(dev1.subscribe(&topics.desired(&one)).await);

    // harbour-2 claims harbour-1's id on the site broker; a device with a central login claims
    // the coordinator's and the bridge's ids on the central broker; over and over.
    for _ in 0..5 {
        let (_, impostor) = Probe::connect(&site.login("harbour-2"), "harbour-1").await;
        drop(impostor);
        for victim in [COORDINATOR, BRIDGE_USER] {
            let (_, impostor) = Probe::connect(&central.login("central-dev"), victim).await;
            drop(impostor);
        }
    }

    // Through the bridge both ways: the coordinator's desired action reaches harbour-1 on the
    // site, harbour-1's state reaches the coordinator.
    coordinator
        .publish(&topics.desired(&one), b"desired for harbour-1", false)
        .await;
    assert_eq!(
        dev1.next_publish(WAIT).await,
        Some((topics.desired(&one), b"desired for harbour-1".to_vec())),
        "harbour-1 still gets its desired action over the bridge"
    );
    dev1.publish(&topics.state(&one), b"state of harbour-1", false)
        .await;
    coordinator.until(&topics.state(&one)).await;
    assert_eq!(
        dev1.losses(),
        0,
        "harbour-1 was never knocked off the site broker"
    );
    assert_eq!(
        coordinator.losses(),
        0,
        "the coordinator was never knocked off the central broker"
    );
    let dropped: Vec<WatchedMessage> = links
        .messages()
        .into_iter()
        .filter(|m| m.topic == BRIDGE_STATE_TOPIC && m.payload == b"0")
        .collect();
    assert!(
        dropped.is_empty(),
        "the site's bridge was never knocked off the central broker: {dropped:?}"
    );
}

/// The site of the bridged tests: a coordinator on a central Mosquitto, `n` agents on a site
/// broker bridged to it, a watcher on every device topic of the central broker.
struct Bridged {
    site: Site,
    _broker: SiteBroker,
    central: Watcher,
    devices: Vec<String>,
    /// The coordinator's metrics port.
    metrics: u16,
}

async fn bridged(
    n: usize,
    content: &[u8],
    release_flags: &[&str],
    options: AgentOptions,
) -> Bridged {
    let mut site = Site::new(BrokerKind::Mosquitto);
    let devices: Vec<String> = (1..=n).map(|i| format!("harbour-{i:02}")).collect();
    let broker = SiteBroker::start(&site.path("site-broker"), site.port, "unused", &devices);
    broker
        .wait_bridged(flotilla_tests::site::plain(site.port))
        .await;
    site.agent_broker = Some(broker.agent_broker());
    let central = Watcher::start(site.port, &["flotilla/v1/devices/#".to_owned()]).await;
    site.release_with("fw-2", 2, content, release_flags);
    let metrics = site.enable_metrics();
    site.start_coordinator();
    for id in &devices {
        site.add_agent(id, &[("site", bridge::SITE)], options.clone());
    }
    site.wait_devices(n).await;
    Bridged {
        site,
        _broker: broker,
        central,
        devices,
        metrics,
    }
}

/// Fails naming them if peer requests or peer blocks (`devices/{peer}/peer-fetch`,
/// `devices/{device}/peer-block/{peer}`) were seen on the central broker: the bridge keeps them
/// on the site.
fn assert_no_peer_traffic(central: &[WatchedMessage]) {
    let peer: Vec<&str> = central
        .iter()
        .map(|m| m.topic.as_str())
        .filter(|t| t.contains("/peer-"))
        .collect();
    assert!(
        peer.is_empty(),
        "peer traffic reached the central broker: {peer:?}"
    );
}

/// Each device's final report with its bytes by source (`ReportWithBytes`, signed by the
/// device) as seen on the central broker, the last one per device: what the coordinator adds
/// up. No operator command shows bytes per device, only per rollout and per site.
fn final_bytes(central: &[WatchedMessage]) -> BTreeMap<String, (ByteCounts, Vec<BypassedPeer>)> {
    let mut out = BTreeMap::new();
    for m in central {
        let Ok(Message::Device(blob)) = envelope::decode(&m.payload) else {
            continue;
        };
        if let Ok((
            _,
            DeviceMessage::ReportWithBytes {
                report,
                bytes,
                bypassed,
            },
        )) = device::open_self_signed(&blob)
        {
            out.insert(report.device_id, (bytes, bypassed));
        }
    }
    out
}

const SPEC: &str = r#"
name = "harbour-fw-2"
release = "fw-2"
[groups]
count = 1
success = { threshold = "100%", action = "next" }
error = { threshold = "50%", action = "pause" }
"#;

/// Runs the rollout to its end and checks every device is Ready with the release's bytes and
/// that nothing of peer traffic reached the central broker. Returns the bytes that crossed the
/// bridge by topic leaf.
async fn roll_out_and_check(b: &Bridged, content: &[u8]) -> BTreeMap<String, u64> {
    b.site.create_and_start(SPEC).await;
    let status = b
        .site
        .wait_status("harbour-fw-2", "the rollout to finish", WAIT, |s| {
            s.state == "finished"
        })
        .await;
    let ready: usize = status.groups.iter().map(|g| g.ready).sum();
    assert_eq!(ready, b.devices.len(), "{status:#?}");
    for id in &b.devices {
        assert!(
            fs::read(b.site.target_file(id)).expect("target file") == content,
            "{id} does not hold the release's bytes"
        );
    }
    let messages = b.central.messages();
    assert_no_peer_traffic(&messages);
    let traffic = bridge::traffic(&messages);
    println!("bytes over the bridge by topic: {traffic:?}");
    traffic
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_agents_behind_the_bridge_install_from_the_coordinator_on_the_central_broker() {
    if !require_mosquitto(module_path!()) {
        return;
    }
    let content = artifact(200_000);
    let b = bridged(8, &content, &["--no-blocks"], AgentOptions::default()).await;
    let traffic = roll_out_and_check(&b, &content).await;
    // Without peers every device fetched every byte over the bridge.
    let blocks = traffic.get("block").copied().unwrap_or(0);
    assert!(
        blocks >= 8 * content.len() as u64,
        "{blocks} bytes of block replies crossed the bridge for 8 devices of {} bytes",
        content.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_agents_behind_the_bridge_install_a_release_with_block_lists() {
    if !require_mosquitto(module_path!()) {
        return;
    }
    let content = artifact(300_000);
    let b = bridged(8, &content, &[], AgentOptions::default()).await;
    roll_out_and_check(&b, &content).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_site_sharing_blocks_takes_about_one_copy_from_the_coordinator() {
    if !require_mosquitto(module_path!()) {
        return;
    }
    let content = artifact(1 << 20);
    let b = bridged(8, &content, &[], AgentOptions::default()).await;
    let spec = format!("{SPEC}{SHARING}");
    b.site.create_and_start(&spec).await;
    let status = b
        .site
        .wait_status("harbour-fw-2", "the rollout to finish", WAIT, |s| {
            s.state == "finished"
        })
        .await;
    for id in &b.devices {
        assert!(
            fs::read(b.site.target_file(id)).expect("target") == content,
            "{id}"
        );
    }
    let central = b.central.messages();
    // The site's peers moved most of the bytes (below), none of it over the bridge.
    assert_no_peer_traffic(&central);
    let traffic = bridge::traffic(&central);
    let from_coordinator = traffic.get("block").copied().unwrap_or(0);
    assert!(
        from_coordinator as f64 <= 1.1 * content.len() as f64,
        "the coordinator served {from_coordinator} bytes for a site of 8 and an artifact of {}",
        content.len()
    );
    let metrics = flotilla_tests::scrape_metrics(b.metrics).await;
    let coordinator = metric(
        &metrics,
        "flotilla_device_bytes_total{source=\"coordinator\"}",
    );
    let peer = metric(&metrics, "flotilla_device_bytes_total{source=\"peer\"}");
    let local = metric(&metrics, "flotilla_device_bytes_total{source=\"local\"}");
    // Every device fetched its artifact's block list from the coordinator too.
    let list = flotilla_protocol::blocks::list_size(
        content.len() as u64,
        flotilla_protocol::blocks::DEFAULT_BLOCK_SIZE,
    );
    let per_device = content.len() as u64 + list;
    assert_eq!(
        coordinator + peer + local,
        8 * per_device,
        "bytes by source add up to every device's artifact and block list"
    );
    assert!(
        peer >= 6 * content.len() as u64,
        "most bytes came from peers: coordinator {coordinator}, peer {peer}, local {local}"
    );
    assert!(coordinator <= from_coordinator);

    // `flotilla rollout status` shows the same numbers, for the rollout and for its one site.
    let by_source = SourceBytes {
        coordinator,
        peers: peer,
        local,
        http: 0,
    };
    assert_eq!(status.bytes, by_source, "the rollout's bytes by source");
    assert_eq!(status.site_count, 1, "{:#?}", status.sites);
    let harbour = &status.sites[0];
    assert_eq!(harbour.name, bridge::SITE, "{harbour:#?}");
    assert_eq!(harbour.bytes, by_source, "the harbour's bytes by source");
    let text = b.site.flotilla(&["rollout", "status", "harbour-fw-2"]);
    assert!(
        text.contains(&format!("  bytes: {by_source}\n"))
            && text
                .lines()
                .any(|l| l.contains("site harbour: ")
                    && l.ends_with(&format!("; bytes {by_source}"))),
        "the rollout and the site line show the bytes by source: {text}"
    );
    // Per device, from what each device reported.
    let reported = final_bytes(&central);
    assert_eq!(
        reported.keys().collect::<Vec<_>>(),
        b.devices.iter().collect::<Vec<_>>(),
        "a final report with bytes from every device"
    );
    for (id, (bytes, _)) in &reported {
        assert_eq!(
            bytes.coordinator + bytes.from_peers() + bytes.local,
            per_device,
            "{id} counted its artifact and block list once: {bytes:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_serving_corrupt_blocks_is_refused_per_block_and_every_device_installs() {
    if !require_mosquitto(module_path!()) {
        return;
    }
    let content = artifact(1 << 20);
    // Slow downloads (about 4 s each), so the later devices of the site start while the liar
    // stands in for the first.
    let options = AgentOptions {
        max_bytes_per_sec: 256 << 10,
        ..AgentOptions::default()
    };
    let mut b = bridged(8, &content, &[], options).await;
    let spec = format!("{SPEC}{SHARING}");
    b.site.create_and_start(&spec).await;
    // The site's first device fetches from the coordinator; once it is Ready the coordinator
    // names it as a source for the others. It is then replaced by a client with its login that
    // answers every peer request with a corrupt block.
    let first = b
        .site
        .wait_status("harbour-fw-2", "the first device of the site", WAIT, |s| {
            s.groups.iter().map(|g| g.ready).sum::<usize>() >= 1
        })
        .await;
    // The ready device is the one whose target holds the release (the summary carries counts,
    // not devices).
    let bad = b
        .devices
        .iter()
        .find(|id| fs::read(b.site.target_file(id)).ok().as_deref() == Some(&content[..]))
        .cloned()
        .unwrap_or_else(|| panic!("a device holding the release: {first:#?}"));
    b.site.kill_agent(&bad);
    let topics = Topics::default();
    let bad_id = DeviceId::new(&bad).expect("id");
    let mut liar = probe(b._broker.login(&bad), &bad).await;
    assert!(liar.subscribe(&topics.peer_fetch(&bad_id)).await);
    let liar_task = tokio::spawn(async move {
        loop {
            let Some((_, payload)) = liar.next_publish(Duration::from_secs(3600)).await else {
                return;
            };
            let Ok(Message::PeerFetch(fetch)) = envelope::decode(&payload) else {
                continue;
            };
            let Ok(grant) = envelope::from_bytes::<flotilla_protocol::PeerGrant>(
                "peer grant",
                &fetch.grant.payload,
            ) else {
                continue;
            };
            let to = DeviceId::new(&grant.device_id).expect("id");
            let reply = flotilla_protocol::BlockReply::Data {
                sha256: fetch.request.sha256,
                offset: fetch.request.offset,
                data: vec![0xEE; fetch.request.length.min(65_536) as usize],
            };
            liar.publish_now(
                &topics.peer_block(&to, &bad_id),
                &envelope::encode(&Message::Block(reply)),
            )
            .await;
        }
    });
    let status = b
        .site
        .wait_status(
            "harbour-fw-2",
            "every other device to be ready",
            WAIT,
            // The liar's device counts: it was ready before it was replaced.
            |s| s.groups.iter().map(|g| g.ready).sum::<usize>() >= b.devices.len(),
        )
        .await;
    liar_task.abort();
    for id in b.devices.iter().filter(|id| **id != bad) {
        assert!(
            fs::read(b.site.target_file(id)).expect("target") == content,
            "{id}"
        );
    }
    assert!(
        status
            .trace
            .iter()
            .any(|t| t.message.contains(&format!("bypassed peer {bad}"))
                && t.message.contains("hash")),
        "the trace names the peer whose blocks were refused: {:#?}",
        status.trace
    );
    b.site.start_agent(&bad);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_killed_mid_transfer_does_not_stop_the_others() {
    if !require_mosquitto(module_path!()) {
        return;
    }
    let content = artifact(4 << 20);
    // About 2 s per download, so a device is still fetching when the peer is killed.
    let options = AgentOptions {
        max_bytes_per_sec: 2 << 20,
        ..AgentOptions::default()
    };
    let mut b = bridged(8, &content, &[], options).await;
    let spec = format!("{SPEC}{SHARING}");
    b.site.create_and_start(&spec).await;
    // The site's seed fetches from the coordinator; once it holds the release the others are
    // granted it as their first peer. It is the victim once it is ready (its install is done,
    // so the rollout can still finish) and another device has begun a download that names it.
    let first = b
        .site
        .wait_status("harbour-fw-2", "a device serving its peers", WAIT, |s| {
            s.groups.iter().map(|g| g.ready).sum::<usize>() >= 1
        })
        .await;
    let victim = first
        .groups
        .iter()
        .flat_map(|g| &g.devices)
        .find(|(_, phase)| *phase == "ready")
        .map(|(id, _)| id.clone())
        .unwrap_or_else(|| panic!("a ready device: {first:#?}"));
    let fetching = b
        .central
        .wait_until(
            &format!("a device downloading with {victim} among its peers"),
            WAIT,
            |w| downloading_from(&w.messages(), &victim),
        )
        .await;
    b.site.kill_agent(&victim);
    let status = b
        .site
        .wait_status("harbour-fw-2", "the rollout to end", WAIT, |s| {
            s.state == "finished" || s.state == "paused"
        })
        .await;
    assert_eq!(status.state, "finished", "{:#?}", status.trace);
    for id in &b.devices {
        assert!(
            fs::read(b.site.target_file(id)).expect("target") == content,
            "{id} does not hold the release's bytes"
        );
    }
    // The device that was fetching had bytes from the victim (so it was serving when it was
    // killed), bypassed it and finished from other sources; the trace names the victim.
    let reported = final_bytes(&b.central.messages());
    let (bytes, bypassed) = reported
        .get(&fetching)
        .unwrap_or_else(|| panic!("no final report with bytes from {fetching}"));
    let from_victim: u64 = bytes
        .peers
        .iter()
        .filter(|(peer, _)| *peer == victim)
        .map(|(_, n)| n)
        .sum();
    assert!(
        from_victim > 0,
        "{fetching} got nothing from {victim} before the kill: {bytes:?}"
    );
    assert!(
        bypassed.iter().any(|p| p.peer == victim),
        "{fetching} did not bypass {victim}: {bypassed:?}"
    );
    assert!(
        status.trace.iter().any(|t| t
            .message
            .starts_with(&format!("{fetching} bypassed peer {victim}: "))),
        "the trace names the peer that was killed: {:#?}",
        status.trace
    );
    let metrics = flotilla_tests::scrape_metrics(b.metrics).await;
    let peer = metric(&metrics, "flotilla_device_bytes_total{source=\"peer\"}");
    assert!(
        peer >= from_victim,
        "the coordinator counted {peer} bytes from peers"
    );
    println!("{fetching} had {from_victim} bytes from {victim} before it was killed: {bytes:?}");
}

/// A device other than `victim` whose latest install names `victim` among its peers and whose
/// latest report says it has started its download and is at most halfway (so blocks are still
/// to come: one near its end might finish on replies already sent), as seen on the central
/// broker.
fn downloading_from(central: &[WatchedMessage], victim: &str) -> Option<String> {
    let topics = Topics::default();
    // Device -> the action id of its latest install that names the victim as a peer.
    let mut granted: BTreeMap<String, String> = BTreeMap::new();
    // Device -> its latest report.
    let mut latest: BTreeMap<String, Report> = BTreeMap::new();
    for m in central {
        match (topics.parse(&m.topic), m.decode()) {
            (Some(flotilla_protocol::Topic::Desired(id)), Some(Message::Desired(blob))) => {
                let Ok(action) = envelope::from_bytes::<flotilla_protocol::DesiredAction>(
                    "desired action",
                    &blob.payload,
                ) else {
                    continue;
                };
                let grant = action.body.install().and_then(|i| i.grant).and_then(|g| {
                    envelope::from_bytes::<flotilla_protocol::PeerGrant>("peer grant", &g.payload)
                        .ok()
                });
                match grant {
                    Some(g) if g.sources.iter().any(|p| p == victim) => {
                        granted.insert(id.as_str().to_owned(), action.action_id);
                    }
                    _ => {
                        granted.remove(id.as_str());
                    }
                }
            }
            (Some(flotilla_protocol::Topic::Report(id)), Some(Message::Report(r))) => {
                latest.insert(id.as_str().to_owned(), r);
            }
            _ => {}
        }
    }
    granted.into_iter().find_map(|(id, action_id)| {
        let r = latest.get(&id)?;
        let partway =
            matches!(r.phase, Phase::Downloading { done, total } if done > 0 && done <= total / 2);
        (id != victim && r.action_id == action_id && partway).then_some(id)
    })
}

/// The value of the sample whose name and labels are exactly `sample`, 0 when absent.
fn metric(text: &str, sample: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(sample)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_counts_bytes_by_source_once_and_ignores_malformed_reports_with_bytes() {
    let mut site = Site::new(BrokerKind::Embedded);
    let port = site.enable_metrics();
    site.start_coordinator();
    site.add_agent("harbour-01", &[], AgentOptions::default());
    site.wait_devices(1).await;
    let key_text = fs::read_to_string(site.path("agents/harbour-01/data/device.key")).expect("key");
    let key = flotilla_protocol::signing::secret_key_from_text(&key_text).expect("device key");
    let topics = Topics::default();
    let id = DeviceId::new("harbour-01").expect("id");
    let report = Report {
        device_id: "harbour-01".into(),
        seq: 1,
        action_id: "nothing-known".into(),
        rollout_id: "none".into(),
        phase: Phase::Ready,
        at: 1,
    };
    let bytes = ByteCounts {
        coordinator: 1000,
        local: 300,
        peers: vec![("harbour-02".into(), 700), ("harbour-03".into(), 24)],
    };
    let signed =
        |message: &DeviceMessage| envelope::encode(&Message::Device(device::sign(&key, message)));
    let good = DeviceMessage::ReportWithBytes {
        report: report.clone(),
        bytes: bytes.clone(),
        bypassed: Vec::new(),
    };

    // Malformed: cut short, signed by a key nobody enrolled, speaking for another device, and
    // on the state topic.
    let mut cut = signed(&good);
    cut.truncate(cut.len() / 2);
    site.publish(&topics.report(&id), cut, false).await;
    let stranger = flotilla_protocol::signing::generate_key();
    site.publish(
        &topics.report(&id),
        envelope::encode(&Message::Device(device::sign(&stranger, &good))),
        false,
    )
    .await;
    let mut other = report.clone();
    other.device_id = "harbour-02".into();
    site.publish(
        &topics.report(&id),
        signed(&DeviceMessage::ReportWithBytes {
            report: other,
            bytes: bytes.clone(),
            bypassed: Vec::new(),
        }),
        false,
    )
    .await;
    site.publish(&topics.state(&id), signed(&good), false).await;
    // Then the real one, twice (an agent repeats a report until it is acknowledged).
    site.publish(&topics.report(&id), signed(&good), false)
        .await;
    site.publish(&topics.report(&id), signed(&good), false)
        .await;

    let ignored = |text: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with("flotilla_device_messages_ignored"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    let deadline = std::time::Instant::now() + WAIT;
    let text = loop {
        let text = flotilla_tests::scrape_metrics(port).await;
        if metric(&text, "flotilla_device_bytes_total{source=\"coordinator\"}") > 0
            && metric(
                &text,
                "flotilla_messages_malformed_total{reason=\"undecodable\"}",
            ) > 0
            && ignored(&text) >= 3
        {
            break text;
        }
        assert!(std::time::Instant::now() < deadline, "{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        metric(&text, "flotilla_device_bytes_total{source=\"coordinator\"}"),
        1000
    );
    assert_eq!(
        metric(&text, "flotilla_device_bytes_total{source=\"peer\"}"),
        724
    );
    assert_eq!(
        metric(&text, "flotilla_device_bytes_total{source=\"local\"}"),
        300
    );
    // The forged reports were ignored (the loop waited for their counts).
    assert!(ignored(&text) >= 3, "{text}");
    // Still serving: the CLI gets an answer.
    let listed = site.flotilla(&["devices"]);
    assert!(listed.contains("harbour-01"), "{listed}");
}

/// What the rollout spec adds to share blocks within the `site` label (docs/rollout-spec.md,
/// "Sites"): at most two devices of the site at work, one fetching first.
const SHARING: &str = "[groups.sites]\nlabel = \"site\"\nmax_running = 2\npeers = true\n";

/// The peer benchmark (`bench/peers.sh` runs it): one site of `PEER_BENCH_DEVICES` agents
/// behind the bridge, an artifact of `PEER_BENCH_BYTES`, peer sharing on when
/// `PEER_BENCH_SHARE=1`. Prints one `RESULT` line: bytes the coordinator served, bytes over the
/// bridge, seconds from the rollout's start to its last Ready. Asserts only that every device
/// ended with the release's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: bench/peers.sh runs it"]
async fn bench_site() {
    let env = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let n = env("PEER_BENCH_DEVICES", 4);
    let size = env("PEER_BENCH_BYTES", 4 << 20);
    let share = env("PEER_BENCH_SHARE", 0) == 1;
    let content = artifact(size);
    let mut site = Site::new(BrokerKind::Mosquitto);
    let port = site.enable_metrics();
    let devices: Vec<String> = (1..=n).map(|i| format!("harbour-{i:02}")).collect();
    let broker = SiteBroker::start(&site.path("site-broker"), site.port, "unused", &devices);
    broker
        .wait_bridged(flotilla_tests::site::plain(site.port))
        .await;
    site.agent_broker = Some(broker.agent_broker());
    // The same release either way (block lists, as `release create` makes them): the runs
    // differ only in the rollout's site policy.
    site.release_with("fw-2", 2, &content, &[]);
    site.start_coordinator();
    for id in &devices {
        let options = AgentOptions {
            block_size: 65_536,
            ..AgentOptions::default()
        };
        site.add_agent(id, &[("site", bridge::SITE)], options);
    }
    site.wait_devices(n).await;
    let central = Watcher::start(site.port, &["flotilla/v1/devices/#".to_owned()]).await;
    // Sharing alone, no busy limit: once the seed holds the release every other device starts,
    // as every device starts at once without sharing.
    let spec = if share {
        format!("{SPEC}[groups.sites]\nlabel = \"site\"\npeers = true\n")
    } else {
        SPEC.to_owned()
    };
    let started = std::time::Instant::now();
    site.create_and_start(&spec).await;
    site.wait_status(
        "harbour-fw-2",
        "the rollout to finish",
        Duration::from_secs(600),
        |s| s.state == "finished",
    )
    .await;
    let seconds = started.elapsed().as_secs_f64();
    for id in &devices {
        assert!(
            fs::read(site.target_file(id)).expect("target") == content,
            "{id}"
        );
    }
    let bridge_bytes: u64 = bridge::traffic(&central.messages()).values().sum();
    let served = metric(
        &flotilla_tests::scrape_metrics(port).await,
        "flotilla_artifact_block_bytes_served_total",
    );
    println!(
        "RESULT devices={n} sharing={} artifact_bytes={size} coordinator_bytes={served} \
         bridge_bytes={bridge_bytes} last_ready_s={seconds:.2}",
        if share { "on" } else { "off" }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_with_an_install_may_fetch_its_block_lists_and_nothing_else() {
    let mut site = Site::new(BrokerKind::Embedded);
    let content = artifact(150_000);
    site.release_with("fw-2", 2, &content, &["--block-size", "16384"]);
    site.start_coordinator();
    site.add_agent("harbour-01", &[], AgentOptions::default());
    site.wait_devices(1).await;
    let key_text = fs::read_to_string(site.path("agents/harbour-01/data/device.key")).expect("key");
    let key = flotilla_protocol::signing::secret_key_from_text(&key_text).expect("device key");
    let (_, manifest) =
        flotilla_coordinator::service::releases::ReleaseStore::new(site.path("coordinator"))
            .load_manifest("fw-2")
            .expect("release");
    let list = manifest.block_index(0).expect("a block list").sha256;
    let topics = Topics::default();
    let id = DeviceId::new("harbour-01").expect("id");
    let watcher = Watcher::start(site.port, &[topics.block(&id), topics.desired(&id)]).await;
    site.create_and_start(SPEC).await;
    watcher
        .wait_until("the install on the desired topic", WAIT, |w| {
            w.messages()
                .iter()
                .any(|m| m.topic == topics.desired(&id))
                .then_some(())
        })
        .await;
    for sha256 in [list, [7u8; 32]] {
        let fetch = DeviceMessage::Fetch {
            device_id: "harbour-01".into(),
            request: flotilla_protocol::BlockRequest {
                sha256,
                offset: 0,
                length: 65_536,
            },
        };
        let bytes = envelope::encode(&Message::Device(device::sign(&key, &fetch)));
        site.publish(&topics.fetch(&id), bytes, false).await;
    }
    let replies = watcher
        .wait_until("both block replies", WAIT, |w| {
            let replies: Vec<flotilla_protocol::BlockReply> = w
                .messages()
                .iter()
                .filter(|m| m.topic == topics.block(&id))
                .filter_map(|m| match m.decode() {
                    Some(Message::Block(reply)) => Some(reply),
                    _ => None,
                })
                .filter(|r| match r {
                    flotilla_protocol::BlockReply::Data { sha256, .. }
                    | flotilla_protocol::BlockReply::Unavailable { sha256, .. } => {
                        *sha256 == list || *sha256 == [7u8; 32]
                    }
                })
                .collect();
            // The agent fetches the same list for its own install: wait for an answer to each
            // of the two requests, not for any two replies.
            let answered = |digest: [u8; 32]| {
                replies.iter().any(|r| match r {
                    flotilla_protocol::BlockReply::Data { sha256, .. }
                    | flotilla_protocol::BlockReply::Unavailable { sha256, .. } => {
                        *sha256 == digest
                    }
                })
            };
            (answered(list) && answered([7u8; 32])).then_some(replies)
        })
        .await;
    let expected = fs::read(
        site.path("coordinator/artifacts")
            .join(flotilla_protocol::hex::encode(&list)),
    )
    .expect("the stored block list");
    assert!(
        replies.iter().any(|r| matches!(r,
            flotilla_protocol::BlockReply::Data { sha256, data, .. } if *sha256 == list && *data == expected)),
        "the block list was served: {replies:?}"
    );
    assert!(
        replies.iter().any(|r| matches!(r,
            flotilla_protocol::BlockReply::Unavailable { sha256, reason, .. }
                if *sha256 == [7u8; 32] && reason.contains("holds no action"))),
        "a digest outside the release was refused: {replies:?}"
    );
}

/// Adaptive downloads (issue 13, part 4) through real processes: a device that installed one
/// release fetches, for the next one with 1% of its blocks changed, only the changed blocks; the
/// rest it copies from what it already holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_with_one_percent_of_its_blocks_changed_downloads_only_those() {
    const BLOCK: usize = 16_384;
    const BLOCKS: usize = 200;
    let mut site = Site::new(BrokerKind::Embedded);
    let port = site.enable_metrics();
    let first: Vec<u8> = (0..BLOCK * BLOCKS)
        .map(|i| ((i / BLOCK) as u8) ^ (i as u8).wrapping_mul(31))
        .collect();
    let mut second = first.clone();
    // Two blocks of two hundred, one at the start and one in the middle, become content found
    // nowhere in the first image (a block equal to another block anywhere is copied, not
    // fetched: the index is by hash, not by position).
    for b in [0, BLOCKS / 2] {
        for (k, byte) in second[b * BLOCK..(b + 1) * BLOCK].iter_mut().enumerate() {
            *byte = ((k as u32).wrapping_mul(2_654_435_761) >> 13) as u8 ^ b as u8;
        }
    }
    let block_size = BLOCK.to_string();
    site.release_with("fw-1", 1, &first, &["--block-size", &block_size]);
    site.release_with("fw-2", 2, &second, &["--block-size", &block_size]);
    site.start_coordinator();
    site.add_agent("quay-01", &[], AgentOptions::default());
    site.wait_devices(1).await;
    let served = || async {
        metric(
            &flotilla_tests::scrape_metrics(port).await,
            "flotilla_artifact_block_bytes_served_total",
        )
    };
    let mut served_before = 0;
    for (release, content) in [("fw-1", &first), ("fw-2", &second)] {
        served_before = served().await;
        let spec = format!(
            "name = \"{release}-run\"\nrelease = \"{release}\"\n[groups]\ncount = 1\n\
             success = {{ threshold = \"100%\", action = \"next\" }}\n"
        );
        site.create_and_start(&spec).await;
        site.wait_status(
            &format!("{release}-run"),
            "the rollout to finish",
            WAIT,
            |s| s.state == "finished",
        )
        .await;
        assert!(
            fs::read(site.target_file("quay-01")).expect("target") == *content,
            "quay-01 does not hold {release}'s bytes"
        );
    }
    let text = flotilla_tests::scrape_metrics(port).await;
    let list = flotilla_protocol::blocks::list_size(first.len() as u64, BLOCK as u32);
    let coordinator = metric(&text, "flotilla_device_bytes_total{source=\"coordinator\"}");
    let local = metric(&text, "flotilla_device_bytes_total{source=\"local\"}");
    // The first release came whole from the coordinator (with its block list); of the second,
    // two blocks and the list.
    let second_fetched = coordinator - (first.len() as u64 + list);
    assert_eq!(second_fetched, 2 * BLOCK as u64 + list, "{text}");
    assert!(
        second_fetched as f64 <= 0.05 * second.len() as f64,
        "fetched {second_fetched} of {} bytes",
        second.len()
    );
    assert_eq!(local, (BLOCKS - 2) as u64 * BLOCK as u64, "{text}");
    // The coordinator's own count of what it sent agrees, whatever the device says.
    let served_second = served().await - served_before;
    assert!(
        served_second as f64 <= 0.05 * second.len() as f64,
        "the coordinator served {served_second} bytes for the second release of {}",
        second.len()
    );
    assert!(
        served_second >= 2 * BLOCK as u64,
        "the coordinator served {served_second} bytes, less than the two changed blocks"
    );
}
