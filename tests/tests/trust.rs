//! The agent's trust checks, end to end: a real agent process on a shared broker receives
//! desired actions that anyone on the broker could have published. Each bad one is refused with a
//! reason that names what was wrong, and the device's file stays exactly as it was.

use std::fs;
use std::time::{SystemTime, UNIX_EPOCH};

use flotilla_protocol::signing::{generate_key, secret_key_from_text};
use flotilla_protocol::{
    envelope, ActionBody, ActionKind, DesiredAction, DeviceId, Message, Phase, SignedBlob,
    SigningKey, Topics,
};
use flotilla_tests::{AgentOptions, BrokerKind, Site, Watcher, WAIT};

const DEVICE: &str = "dev-trust";
const FACTORY: &[u8] = b"factory firmware\n";

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs()
}

fn secret(site: &Site, name: &str) -> SigningKey {
    let text = fs::read_to_string(site.path(&format!("keys/{name}.key"))).expect("read key");
    secret_key_from_text(&text).expect("parse key")
}

/// The signed manifest blob of a release created by `flotilla release create`.
fn release_blob(site: &Site, name: &str) -> SignedBlob {
    let bytes =
        fs::read(site.path(&format!("coordinator/releases/{name}.release"))).expect("read release");
    envelope::from_bytes("release", &bytes).expect("decode release file")
}

struct Case<'a> {
    action_id: &'a str,
    device_id: &'a str,
    manifest: SignedBlob,
    expires_at: u64,
    signer: &'a SigningKey,
}

fn desired(case: Case<'_>) -> Vec<u8> {
    let action = DesiredAction {
        action_id: case.action_id.into(),
        device_id: case.device_id.into(),
        rollout_id: "trust-test".into(),
        issued_at: now(),
        expires_at: case.expires_at,
        body: ActionBody::Install {
            manifest: case.manifest,
            kind: ActionKind::Forced,
            window: None,
        },
    };
    envelope::encode(&Message::Desired(SignedBlob::sign(
        case.signer,
        envelope::to_bytes(&action),
    )))
}

async fn send_and_wait(site: &Site, watcher: &Watcher, payload: Vec<u8>) -> Phase {
    watcher.clear();
    let topic = Topics::default().desired(&DeviceId::new(DEVICE).expect("id"));
    site.publish(&topic, payload, true).await;
    watcher.final_report(DEVICE, WAIT).await.phase
}

fn assert_refused(phase: &Phase, needle: &str, what: &str) {
    let reason = phase.reason().unwrap_or_default();
    assert!(
        matches!(phase, Phase::Refused { .. } | Phase::Failed { .. }) && reason.contains(needle),
        "{what}: expected a refusal naming {needle:?}, got {phase:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_or_invalid_updates_are_refused_with_a_reason() {
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-5", 5, b"firmware five\n");
    site.release("fw-3", 3, b"firmware three\n");
    site.release("fw-9", 9, b"firmware nine\n");
    site.start_coordinator();
    site.add_agent(DEVICE, &[("env", "test")], AgentOptions::default());
    site.wait_devices(1).await;
    let watcher = Watcher::start(
        site.port,
        &[Topics::default().report(&DeviceId::new(DEVICE).expect("id"))],
    )
    .await;
    let coordinator = secret(&site, "coordinator");
    let rogue = generate_key();
    let target = site.target_file(DEVICE);
    let later = now() + 3600;

    // A release signed by a key the device does not trust.
    let good = release_blob(&site, "fw-5");
    let forged = SignedBlob::sign(&rogue, good.payload.clone());
    let phase = send_and_wait(
        &site,
        &watcher,
        desired(Case {
            action_id: "a1",
            device_id: DEVICE,
            manifest: forged,
            expires_at: later,
            signer: &coordinator,
        }),
    )
    .await;
    assert_refused(&phase, "unknown key", "release signed by an unknown key");
    assert_eq!(fs::read(&target).expect("target"), FACTORY);

    // An action signed by a key that is not the coordinator's: ignored, and never reported
    // under the action id it claims (a forgery naming a real action id would fail it on the
    // coordinator: issue 10, case 3). The expired action after it is the next one reported.
    let topic = Topics::default().desired(&DeviceId::new(DEVICE).expect("id"));
    watcher.clear();
    site.publish(
        &topic,
        desired(Case {
            action_id: "a2",
            device_id: DEVICE,
            manifest: good.clone(),
            expires_at: later,
            signer: &rogue,
        }),
        true,
    )
    .await;
    site.publish(
        &topic,
        desired(Case {
            action_id: "a3",
            device_id: DEVICE,
            manifest: good.clone(),
            expires_at: now() - 60,
            signer: &coordinator,
        }),
        true,
    )
    .await;
    let report = watcher.final_report(DEVICE, WAIT).await;
    assert_eq!(report.action_id, "a3");
    assert_refused(&report.phase, "expired", "expired action");
    assert!(
        watcher.reports(DEVICE).iter().all(|r| r.action_id != "a2"),
        "the action signed by an unknown key is not reported: {:?}",
        watcher.reports(DEVICE)
    );
    assert_eq!(fs::read(&target).expect("target"), FACTORY);

    // An action for another device, replayed onto this device's topic.
    let phase = send_and_wait(
        &site,
        &watcher,
        desired(Case {
            action_id: "a4",
            device_id: "dev-other",
            manifest: good.clone(),
            expires_at: later,
            signer: &coordinator,
        }),
    )
    .await;
    assert_refused(&phase, "dev-other", "action for another device");
    assert_eq!(fs::read(&target).expect("target"), FACTORY);

    // A tampered artifact: the server's copy no longer matches the signed digest.
    let nine = release_blob(&site, "fw-9");
    let manifest = flotilla_protocol::manifest::Manifest::decode(&nine.payload)
        .expect("manifest")
        .release;
    let stored = site.path(&format!(
        "coordinator/artifacts/{}",
        flotilla_protocol::hex::encode(&manifest.artifacts[0].sha256)
    ));
    fs::write(&stored, b"firmware NINE\n").expect("tamper with the stored artifact");
    let phase = send_and_wait(
        &site,
        &watcher,
        desired(Case {
            action_id: "a5",
            device_id: DEVICE,
            manifest: nine,
            expires_at: later,
            signer: &coordinator,
        }),
    )
    .await;
    // The release signs block lists, so the first block already fails its signed hash; nothing
    // reaches the target.
    assert!(
        matches!(&phase, Phase::Failed { reason, rolled_back: false }
            if reason.contains("fails its signed hash")),
        "tampered artifact: expected a failure naming the block's hash, got {phase:?}"
    );
    assert_eq!(fs::read(&target).expect("target"), FACTORY);

    // A good release installs...
    let phase = send_and_wait(
        &site,
        &watcher,
        desired(Case {
            action_id: "a6",
            device_id: DEVICE,
            manifest: good,
            expires_at: later,
            signer: &coordinator,
        }),
    )
    .await;
    assert_eq!(phase, Phase::Ready);
    assert_eq!(fs::read(&target).expect("target"), b"firmware five\n");

    // ...and a release with a lower counter is refused afterwards.
    let three = release_blob(&site, "fw-3");
    let phase = send_and_wait(
        &site,
        &watcher,
        desired(Case {
            action_id: "a7",
            device_id: DEVICE,
            manifest: three,
            expires_at: later,
            signer: &coordinator,
        }),
    )
    .await;
    assert_refused(&phase, "counter", "lower release counter");
    assert_eq!(fs::read(&target).expect("target"), b"firmware five\n");
}

/// The desired action on `watcher`'s messages with this body kind, as published (signed bytes).
fn captured(watcher: &Watcher, cancel: bool) -> Option<(Vec<u8>, DesiredAction)> {
    watcher.messages().into_iter().find_map(|m| {
        let Some(Message::Desired(blob)) = m.decode() else {
            return None;
        };
        let action: DesiredAction = envelope::from_bytes("desired action", &blob.payload).ok()?;
        (matches!(action.body, ActionBody::Cancel { .. }) == cancel).then_some((m.payload, action))
    })
}

/// issue 9, "Replay and revocation": a captured signed install, re-published after `rollout
/// stop`, must not install the stopped release. The device was offline while the install was
/// published, so it never saw it under that action id; when it comes back it finds the stop's
/// cancel, which is newer than the install and becomes the last action it accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_install_replayed_after_stop_is_refused() {
    const ID: &str = "dev-replay";
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-7", 7, b"firmware seven\n");
    site.start_coordinator();
    site.add_agent(ID, &[("ring", "replay")], AgentOptions::default());
    site.wait_online(ID, true).await;
    site.kill_agent(ID);
    site.wait_online(ID, false).await;

    let desired_topic = Topics::default().desired(&DeviceId::new(ID).expect("id"));
    let desired = Watcher::start(site.port, std::slice::from_ref(&desired_topic)).await;
    site.create_and_start(
        "name = \"replay\"\nrelease = \"fw-7\"\nselect = \"ring=replay\"\n[groups]\ncount = 1\n",
    )
    .await;
    let (install, install_action) = desired
        .wait_until(
            "the install, published while the device is offline",
            WAIT,
            |w| captured(w, false),
        )
        .await;
    site.flotilla(&["rollout", "stop", "replay"]);
    let (_, cancel) = desired
        .wait_until("the stop's cancel", WAIT, |w| captured(w, true))
        .await;
    assert!(
        cancel.issued_at > install_action.issued_at,
        "the cancel is issued after the install: {} vs {}",
        cancel.issued_at,
        install_action.issued_at
    );

    // The device comes back and reads the retained cancel; the trust file then holds it as the
    // last accepted action.
    let reports = Watcher::start(
        site.port,
        &[Topics::default().report(&DeviceId::new(ID).expect("id"))],
    )
    .await;
    site.start_agent(ID);
    site.wait_online(ID, true).await;
    let trust_file = site.path(&format!("agents/{ID}/data/trust"));
    let needle = format!("last_action_issued_at = {}", cancel.issued_at);
    reports
        .wait_until("the device to accept the cancel", WAIT, |_| {
            fs::read_to_string(&trust_file)
                .ok()
                .filter(|text| text.contains(&needle))
        })
        .await;

    // An attacker re-publishes the captured install.
    site.publish(&desired_topic, install, true).await;
    let phase = reports.final_report(ID, WAIT).await.phase;
    assert_refused(
        &phase,
        "older than the last accepted action",
        "replayed install",
    );
    assert_eq!(
        fs::read(site.target_file(ID)).expect("target"),
        FACTORY,
        "the stopped release is not installed"
    );
}

/// issue 10, case 3: a desired action signed by someone else, claiming the action id of the
/// device's real action while it runs, used to be reported as a refusal of that action, and the
/// rollout paused on "1 of 1 failed" while the device was fine. It is ignored: the device ends
/// ready and the rollout finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgery_claiming_a_real_action_id_does_not_fail_it() {
    const ID: &str = "dev-claimed";
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-8", 8, b"firmware eight\n");
    site.start_coordinator();
    site.add_agent(
        ID,
        &[("ring", "claimed")],
        AgentOptions {
            soak: "3s",
            ..AgentOptions::default()
        },
    );
    site.wait_online(ID, true).await;
    let desired_topic = Topics::default().desired(&DeviceId::new(ID).expect("id"));
    let desired_watch = Watcher::start(site.port, std::slice::from_ref(&desired_topic)).await;
    site.create_and_start(
        "name = \"claimed\"\nrelease = \"fw-8\"\nselect = \"ring=claimed\"\n[groups]\ncount = 1\n",
    )
    .await;
    let (_, real) = desired_watch
        .wait_until("the real install", WAIT, |w| captured(w, false))
        .await;

    // While the device soaks, a forgery names the same action id, signed by another key.
    let rogue = generate_key();
    let mut forged = real.clone();
    forged.issued_at += 1;
    let forged = envelope::encode(&Message::Desired(SignedBlob::sign(
        &rogue,
        envelope::to_bytes(&forged),
    )));
    let reports = Watcher::start(
        site.port,
        &[Topics::default().report(&DeviceId::new(ID).expect("id"))],
    )
    .await;
    site.publish(&desired_topic, forged, false).await;

    let status = site.wait_ended("claimed").await;
    assert_eq!(status.state, "finished", "{status:#?}");
    assert!(
        reports
            .reports(ID)
            .iter()
            .all(|r| !matches!(r.phase, Phase::Refused { .. })),
        "nothing refused is reported for the real action: {:?}",
        reports.reports(ID)
    );
    assert_eq!(
        fs::read(site.target_file(ID)).expect("target"),
        b"firmware eight\n"
    );
}

/// issue 10, case 8: someone clears a device's retained `desired` topic (an empty retained
/// payload) while the device is offline. The coordinator notices the topic no longer holds the
/// action it owes the device and publishes it again, so the device, back online, installs and
/// the rollout finishes instead of running forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleared_retained_desired_action_is_published_again() {
    const ID: &str = "dev-cleared";
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-6", 6, b"firmware six\n");
    site.start_coordinator();
    site.add_agent(ID, &[("ring", "cleared")], AgentOptions::default());
    site.wait_online(ID, true).await;
    site.kill_agent(ID);
    site.wait_online(ID, false).await;

    let desired_topic = Topics::default().desired(&DeviceId::new(ID).expect("id"));
    let desired = Watcher::start(site.port, std::slice::from_ref(&desired_topic)).await;
    site.create_and_start(
        "name = \"cleared\"\nrelease = \"fw-6\"\nselect = \"ring=cleared\"\n[groups]\ncount = 1\n",
    )
    .await;
    let (_, install) = desired
        .wait_until("the install", WAIT, |w| captured(w, false))
        .await;

    desired.clear();
    site.publish(&desired_topic, Vec::new(), true).await;
    desired
        .wait_until("the install published again", WAIT, |w| {
            let (_, again) = captured(w, false)?;
            (again.action_id == install.action_id).then_some(())
        })
        .await;

    site.start_agent(ID);
    let status = site.wait_ended("cleared").await;
    assert_eq!(status.state, "finished", "{status:#?}");
    assert_eq!(
        fs::read(site.target_file(ID)).expect("target"),
        b"firmware six\n"
    );
}
