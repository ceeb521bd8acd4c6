//! The broker as the second wall: Mosquitto with the shipped `deploy/mosquitto` configuration
//! and ACL, TLS only, a password file and client certificates (tests/src/secure.rs).
//!
//! Mosquitto drops a publish its ACL denies and still acknowledges it (MQTT 3.1.1), and grants
//! subscriptions whose messages it then filters. So "cannot" is checked the way a user would
//! notice: a subscriber that may see everything (the coordinator's login) or the reader in
//! question receives a marker published after the forbidden message was processed, and nothing
//! of the forbidden message before it.

use std::fs;

use flotilla_protocol::Phase;
use flotilla_tests::secure::{COORDINATOR, MONITOR, OBSERVER, OPERATOR};
use flotilla_tests::{AgentOptions, BrokerKind, Connected, Probe, SecureBroker, Site, WAIT};
use rumqttc::ConnectReturnCode;

const ROOT: &str = "flotilla/v1";

async fn accepted(connection: &flotilla_mqtt::Connection, client_id: &str) -> Probe {
    match Probe::connect(connection, client_id).await {
        (Connected::Accepted, Some(probe)) => probe,
        (other, _) => panic!("{client_id} was not let in: {other:?}"),
    }
}

/// The read-only monitor's login, subscribed to every flotilla topic: it sees what the
/// coordinator would (whose own login the tests use for writing; the broker keeps one
/// connection per login).
async fn everything(broker: &SecureBroker) -> Probe {
    let mut all = accepted(&broker.login(MONITOR), MONITOR).await;
    assert!(all.subscribe(&format!("{ROOT}/#")).await);
    all
}

fn topics(messages: &[(String, Vec<u8>)]) -> Vec<&str> {
    messages.iter().map(|(t, _)| t.as_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_known_clients_over_tls_get_in() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = SecureBroker::start(dir.path(), &["dev-a"]);

    let (anonymous, _) = Probe::connect(&broker.anonymous(), "anon").await;
    assert_eq!(
        anonymous,
        Connected::Refused(ConnectReturnCode::NotAuthorized),
        "an anonymous client is refused"
    );

    let mut wrong = broker.login("dev-a");
    if let Some(c) = wrong.credentials.as_mut() {
        c.password = flotilla_mqtt::Password::new("not-the-password");
    }
    let (answer, _) = Probe::connect(&wrong, "dev-a").await;
    assert!(
        matches!(answer, Connected::Refused(_)),
        "a wrong password is refused: {answer:?}"
    );

    let mut cleartext = broker.login("dev-a");
    cleartext.tls = None;
    let (answer, _) = Probe::connect(&cleartext, "dev-a").await;
    assert!(
        matches!(answer, Connected::Failed(_)),
        "no MQTT without TLS: {answer:?}"
    );

    // The mutual-TLS listener wants a certificate: a password alone does not get in.
    let mut no_cert = broker.login("dev-a");
    no_cert.port = broker.mtls_port;
    let (answer, _) = Probe::connect(&no_cert, "dev-a").await;
    assert!(
        matches!(answer, Connected::Failed(_)),
        "mutual TLS without a certificate: {answer:?}"
    );

    // A client that trusts another CA does not talk to this broker: it could be anyone.
    let other_ca = dir.path().join("other-ca");
    let out = std::process::Command::new("sh")
        .arg(flotilla_tests::secure::deploy_dir().join("make-certs.sh"))
        .arg(&other_ca)
        .arg("ca")
        .output()
        .expect("run make-certs.sh");
    assert!(out.status.success(), "{out:?}");
    let untrusted = flotilla_mqtt::ConnectionSpec {
        tls: Some(flotilla_mqtt::RawTls {
            ca_file: Some(other_ca.join("ca.crt")),
            ..Default::default()
        }),
        ..flotilla_mqtt::ConnectionSpec::plain("127.0.0.1", broker.tls_port)
    }
    .validate(dir.path(), &|_| None)
    .expect("valid settings");
    let (answer, _) = Probe::connect(&untrusted, "dev-a").await;
    assert!(
        matches!(&answer, Connected::Failed(e) if e.contains("certificate") || e.contains("Certificate")),
        "a broker certificate from an unknown CA is refused: {answer:?}"
    );

    let (answer, _) = Probe::connect(&broker.login("dev-a"), "dev-a").await;
    assert_eq!(answer, Connected::Accepted, "the device's password");
    let (answer, _) = Probe::connect(&broker.cert_login("dev-b"), "dev-b").await;
    assert_eq!(answer, Connected::Accepted, "a certificate from the CA");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_writes_and_reads_only_its_own_topics() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = SecureBroker::start(dir.path(), &["dev-a", "dev-b"]);
    let mut all = everything(&broker).await;

    // dev-a logs in with its password, dev-c with its certificate: both are devices.
    for (login, me) in [
        (broker.login("dev-a"), "dev-a"),
        (broker.cert_login("dev-c"), "dev-c"),
    ] {
        let mut device = accepted(&login, me).await;
        let forbidden = [
            format!("{ROOT}/devices/dev-b/report"),
            format!("{ROOT}/devices/dev-b/state"),
            format!("{ROOT}/devices/dev-b/fetch"),
            format!("{ROOT}/devices/{me}/desired"),
            format!("{ROOT}/devices/{me}/block"),
            format!("{ROOT}/devices/dev-b/desired"),
            format!("{ROOT}/control/request"),
            format!("{ROOT}/events/log"),
        ];
        for topic in &forbidden {
            device.publish(topic, b"forged", false).await;
        }
        device
            .publish(&format!("{ROOT}/devices/{me}/state"), b"own state", false)
            .await;
        device
            .publish(&format!("{ROOT}/devices/{me}/fetch"), b"own fetch", false)
            .await;
        let marker = format!("{ROOT}/devices/{me}/report");
        device.publish(&marker, b"own report", false).await;
        let seen = all.until(&marker).await;
        assert_eq!(
            topics(&seen),
            vec![
                format!("{ROOT}/devices/{me}/state"),
                format!("{ROOT}/devices/{me}/fetch")
            ],
            "{me}: only its own state, fetch and report reach the coordinator"
        );

        // Reading: subscribed to every device topic, it gets only its own desired and block.
        assert!(device.subscribe(&format!("{ROOT}/#")).await);
        let mut coordinator = accepted(&broker.login(COORDINATOR), "coordinator-writer").await;
        for topic in [
            format!("{ROOT}/devices/dev-b/desired"),
            format!("{ROOT}/devices/dev-b/block"),
            format!("{ROOT}/devices/dev-b/state"),
            format!("{ROOT}/control/request"),
            format!("{ROOT}/events/log"),
            format!("{ROOT}/devices/{me}/block"),
        ] {
            coordinator.publish(&topic, b"for someone", false).await;
        }
        let marker = format!("{ROOT}/devices/{me}/desired");
        coordinator.publish(&marker, b"yours", false).await;
        let seen = device.until(&marker).await;
        assert_eq!(
            topics(&seen),
            vec![format!("{ROOT}/devices/{me}/block")],
            "{me} reads only its own desired and block"
        );
        let _ = all.until(&marker).await;
    }

    // A client id proves nothing: the operator connecting as "dev-a" is still not dev-a.
    let mut impostor = accepted(&broker.login(OPERATOR), "dev-a").await;
    impostor
        .publish(&format!("{ROOT}/devices/dev-a/report"), b"forged", false)
        .await;
    let mut coordinator = accepted(&broker.login(COORDINATOR), "coordinator-marker").await;
    let marker = format!("{ROOT}/events/log");
    coordinator.publish(&marker, b"marker", false).await;
    assert_eq!(
        topics(&all.until(&marker).await),
        Vec::<&str>::new(),
        "an operator using a device's client id cannot write as the device"
    );
}

/// issue 19, item 2: any login could connect under another client's id (another device's, the
/// coordinator's) and Mosquitto dropped the real client; held during a rollout, that knocked the
/// coordinator off 71 times in 25 s. The shipped listeners replace the client id with the
/// login's user name: an impostor only ever replaces its own connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_login_takes_over_another_clients_id() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = SecureBroker::start(dir.path(), &["dev-a", "dev-b"]);
    // The real clients: the coordinator, dev-b with its password, dev-c with its certificate.
    let mut coordinator = accepted(&broker.login(COORDINATOR), COORDINATOR).await;
    assert!(
        coordinator
            .subscribe(&format!("{ROOT}/devices/+/report"))
            .await
    );
    let mut dev_b = accepted(&broker.login("dev-b"), "dev-b").await;
    assert!(
        dev_b
            .subscribe(&format!("{ROOT}/devices/dev-b/desired"))
            .await
    );
    let mut dev_c = accepted(&broker.cert_login("dev-c"), "dev-c").await;
    assert!(
        dev_c
            .subscribe(&format!("{ROOT}/devices/dev-c/desired"))
            .await
    );

    // dev-a, with its password and with its certificate, claims each of their ids, over and
    // over. Each attempt is let in (as dev-a) or refused, and does what an impostor would.
    for _ in 0..5 {
        for login in [broker.login("dev-a"), broker.cert_login("dev-a")] {
            for victim in [COORDINATOR, "dev-b", "dev-c"] {
                if let (Connected::Accepted, Some(mut impostor)) =
                    Probe::connect(&login, victim).await
                {
                    impostor
                        .publish(&format!("{ROOT}/devices/dev-a/report"), b"dev-a", false)
                        .await;
                }
            }
        }
    }

    // Every real client still has its first connection, and it works both ways.
    for (device, probe) in [("dev-b", &mut dev_b), ("dev-c", &mut dev_c)] {
        let topic = format!("{ROOT}/devices/{device}/desired");
        coordinator.publish(&topic, b"yours", false).await;
        assert_eq!(
            probe.next_publish(WAIT).await,
            Some((topic, b"yours".to_vec())),
            "{device} still receives its desired action"
        );
        let report = format!("{ROOT}/devices/{device}/report");
        probe.publish(&report, b"mine", false).await;
        let seen = coordinator.until(&report).await;
        assert!(
            seen.iter().all(|(t, _)| t.ends_with("/dev-a/report")),
            "only the impostor's own reports came before: {seen:?}"
        );
        assert_eq!(
            probe.losses(),
            0,
            "{device} was never knocked off the broker"
        );
    }
    assert_eq!(
        coordinator.losses(),
        0,
        "the coordinator was never knocked off the broker"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_reads_events_only_and_an_operator_controls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = SecureBroker::start(dir.path(), &[]);
    let mut all = everything(&broker).await;
    let mut coordinator = accepted(&broker.login(COORDINATOR), "coordinator-writer").await;
    let mut observer = accepted(&broker.login(OBSERVER), "dashboard").await;
    let operator_id = "flotilla-cli-test-1";
    let mut operator = accepted(&broker.login(OPERATOR), operator_id).await;

    // Control: the observer's request never reaches the coordinator, the operator's does.
    observer
        .publish(&format!("{ROOT}/control/request"), b"observer", false)
        .await;
    observer
        .publish(&format!("{ROOT}/devices/obs/state"), b"observer", false)
        .await;
    operator
        .publish(&format!("{ROOT}/control/request"), b"operator", false)
        .await;
    operator
        .publish(&format!("{ROOT}/devices/dev-a/desired"), b"operator", false)
        .await;
    // Nobody but the coordinator publishes its end-of-retained marker.
    for client in [&mut observer, &mut operator] {
        client
            .publish(&format!("{ROOT}/coordinator/marker"), b"forged", false)
            .await;
    }
    let marker = format!("{ROOT}/events/marker-1");
    coordinator.publish(&marker, b"", false).await;
    let seen = all.until(&marker).await;
    assert_eq!(
        seen,
        vec![(format!("{ROOT}/control/request"), b"operator".to_vec())],
        "only the operator's control request arrives; neither writes device topics nor the \
         coordinator's marker"
    );

    // Reading: both get events; device topics and other logins' replies reach neither; the
    // operator gets the replies to its own login (its client id is its user name).
    assert!(observer.subscribe(&format!("{ROOT}/#")).await);
    assert!(operator.subscribe(&format!("{ROOT}/#")).await);
    for (topic, payload) in [
        (format!("{ROOT}/devices/dev-a/state"), "state"),
        (format!("{ROOT}/devices/dev-a/report"), "report"),
        (format!("{ROOT}/control/reply/someone-else"), "theirs"),
        (format!("{ROOT}/control/request"), "request"),
        (format!("{ROOT}/events/rollouts/fw-2"), "rollout event"),
        (
            format!("{ROOT}/control/reply/{operator_id}"),
            "by client id",
        ),
        (format!("{ROOT}/control/reply/{OPERATOR}"), "yours"),
        (
            format!("{ROOT}/coordinator/marker"),
            "the coordinator's marker",
        ),
    ] {
        coordinator.publish(&topic, payload.as_bytes(), false).await;
    }
    let marker = format!("{ROOT}/events/marker-2");
    coordinator.publish(&marker, b"", false).await;
    assert_eq!(
        topics(&observer.until(&marker).await),
        vec![format!("{ROOT}/events/rollouts/fw-2")],
        "the observer sees the events and nothing else"
    );
    assert_eq!(
        topics(&operator.until(&marker).await),
        vec![
            format!("{ROOT}/events/rollouts/fw-2"),
            format!("{ROOT}/control/reply/{OPERATOR}")
        ],
        "the operator sees the events and its own login's replies, not a reply topic named \
         after the client id it asked for"
    );
}

/// issue 19, item 2, as it was found: a device holds the coordinator's id (and another
/// device's) while a rollout runs. The coordinator and the agent never lose their connection,
/// and the rollout finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_finishes_while_a_device_claims_the_coordinators_id() {
    const ID: &str = "tls-victim";
    let mut site = Site::new(BrokerKind::Secure);
    site.release("fw-3", 3, b"firmware three\n");
    site.start_coordinator();
    site.add_agent(ID, &[("env", "claimed")], AgentOptions::default());
    site.wait_devices(1).await;
    // A device of the fleet (a certificate from the CA) that claims other clients' ids.
    let impostor = site.secure().cert_login("impostor-dev");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let claiming = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut attempts = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                for victim in [COORDINATOR, ID] {
                    let (_, probe) = Probe::connect(&impostor, victim).await;
                    drop(probe);
                    attempts += 1;
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            attempts
        }
    });
    site.create_and_start(
        "name = \"claimed\"\nrelease = \"fw-3\"\nselect = \"env=claimed\"\n[groups]\ncount = 1\n",
    )
    .await;
    let status = site.wait_ended("claimed").await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let attempts = claiming.await.expect("impostor task");
    assert!(
        attempts >= 4,
        "the impostor kept trying: {attempts} attempts"
    );
    assert_eq!(status.state, "finished", "{status:#?}");
    assert_eq!(
        fs::read(site.target_file(ID)).expect("target file"),
        b"firmware three\n"
    );
    let coordinator_log = fs::read_to_string(site.path("coordinator.log")).expect("log");
    assert!(
        !coordinator_log.contains("MQTT connection lost"),
        "the coordinator's connection never dropped:\n{coordinator_log}"
    );
    let agent_log = fs::read_to_string(site.path(&format!("agents/{ID}/agent.log"))).expect("log");
    assert!(
        !agent_log.contains("broker connection:"),
        "the agent's connection never dropped:\n{agent_log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollout_over_tls_with_credentials_reaches_the_devices() {
    const FIRMWARE: &[u8] = b"firmware 2.0 over TLS\n";
    let mut site = Site::new(BrokerKind::Secure);
    site.release("fw-2", 2, FIRMWARE);
    site.start_coordinator();
    let watcher = site.watcher(&[format!("{ROOT}/devices/+/report")]).await;
    for id in ["tls-dev-1", "tls-dev-2"] {
        site.add_agent(id, &[("env", "tls")], AgentOptions::default());
    }
    site.wait_devices(2).await;

    // The CLI, as the operator over TLS, lists both devices.
    let listed = site.flotilla(&["devices"]);
    assert!(
        listed.contains("tls-dev-1") && listed.contains("tls-dev-2"),
        "{listed}"
    );
    // Without credentials the CLI is refused, and says so.
    let out = std::process::Command::new(flotilla_tests::bin("flotilla"))
        .args(["--broker", &format!("127.0.0.1:{}", site.port), "--ca-file"])
        .arg(site.secure().ca_file())
        .args(["devices"])
        .env_remove("FLOTILLA_BROKER_USERNAME")
        // A valid operator key: the refusal must come from the broker.
        .env(
            "FLOTILLA_OPERATOR_KEY",
            site.operator_key_file(flotilla_tests::ADMIN),
        )
        .output()
        .expect("run flotilla");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "anonymous CLI must fail");
    assert!(stderr.contains("NotAuthorized"), "{stderr}");

    site.create_and_start(
        r#"
name = "fw-tls"
release = "fw-2"
[groups]
count = 1
success = { threshold = "100%", action = "next" }
"#,
    )
    .await;
    site.wait_status("fw-tls", "the rollout to finish", WAIT, |s| {
        s.state == "finished"
    })
    .await;
    for id in ["tls-dev-1", "tls-dev-2"] {
        assert_eq!(
            fs::read(site.target_file(id)).expect("target file"),
            FIRMWARE,
            "{id} installed the release"
        );
        let report = watcher.final_report(id, WAIT).await;
        assert_eq!(report.phase, Phase::Ready, "{id}: {report:?}");
    }
}

/// issue 19, item 2: the shipped broker keeps one connection per login (it replaces every client
/// id with the user name), so `flotilla` commands run at once under one login knocked each other
/// off the broker, and the one knocked off lost its reply. Commands under one login on one
/// machine now take turns, and every one gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_run_at_once_under_one_login_all_get_their_answers() {
    const AT_ONCE: usize = 8;
    let mut site = Site::new(BrokerKind::Secure);
    site.start_coordinator();
    site.add_agent("tls-dev-1", &[("env", "tls")], AgentOptions::default());
    site.wait_devices(1).await;
    let started: Vec<_> = (0..AT_ONCE)
        .map(|_| {
            site.flotilla_command(&["devices"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("start flotilla")
        })
        .collect();
    for child in started {
        let out = child.wait_with_output().expect("flotilla ran");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("tls-dev-1"),
            "every command lists the device: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
