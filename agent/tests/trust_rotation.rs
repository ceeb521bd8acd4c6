//! Trust hardening end to end: key rotation through `flotilla-agent keys install`, replayed
//! actions, and the release counter surviving the loss of the database.
//!
//! The broker tests run a real mosquitto and play the coordinator; they are skipped with a
//! notice when `mosquitto` is not installed. The refused rotations need no broker.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{
    block, key, next_publish, now, release, run_agent, send_block, set_desired, start_broker,
    TIMEOUT,
};
use flotilla_agent::trust::{self, InstallKeysError};
use flotilla_agent::Config;
use flotilla_protocol::{
    envelope, hex, keys, ActionBody, ActionKind, BlockReply, DesiredAction, DeviceId, KeysDocument,
    Message, MultiSignedBlob, Phase, ReleaseManifest, Report, SignedBlob, SigningKey, Topics,
};
use rumqttc::AsyncClient;
use tokio::sync::mpsc;

const RELEASE: u8 = 1;
const OLD_COORDINATOR: u8 = 2;
const NEW_COORDINATOR: u8 = 20;
const ROOTS: [u8; 3] = [11, 12, 13];
const STRANGER: u8 = 99;

fn pubkey(seed: u8) -> String {
    format!("\"{}\"", hex::encode(key(seed).verifying_key().as_bytes()))
}

fn config_text(port: u16, dir: &Path, device: &str, dest: &Path) -> String {
    format!(
        r#"
device_id = "{device}"
hardware_id = "pi4"
data_dir = "{data}"
[broker]
host = "127.0.0.1"
port = {port}
keep_alive = "5s"
[trust]
release_keys = [{rk}]
coordinator_keys = [{ck}]
root_keys = [{r0}, {r1}, {r2}]
root_threshold = 2
[[target]]
name = "app"
kind = "file"
path = "{dest}"
"#,
        data = dir.join("agent-data").display(),
        rk = pubkey(RELEASE),
        ck = pubkey(OLD_COORDINATOR),
        r0 = pubkey(ROOTS[0]),
        r1 = pubkey(ROOTS[1]),
        r2 = pubkey(ROOTS[2]),
        dest = dest.display(),
    )
}

fn write_config(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("agent.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

/// A keys document of `version` that makes `coordinator` the coordinator key, signed by
/// `signers`, as the file an operator installs.
fn keys_file(version: u64, coordinator: u8, signers: &[u8]) -> Vec<u8> {
    let doc = KeysDocument {
        version,
        release_keys: vec![key(RELEASE).verifying_key().to_bytes()],
        coordinator_keys: vec![key(coordinator).verifying_key().to_bytes()],
        root_keys: None,
        root_threshold: 2,
    };
    let signers: Vec<SigningKey> = signers.iter().map(|s| key(*s)).collect();
    let signers: Vec<&SigningKey> = signers.iter().collect();
    keys::encode_file(&MultiSignedBlob::sign(&signers, envelope::to_bytes(&doc)))
}

fn artifact(counter: u64) -> Vec<u8> {
    format!("release {counter}\n").repeat(200).into_bytes()
}

/// An install of release `app-{counter}`, issued at `issued_at`, signed by `coordinator`.
fn install(
    device: &str,
    action_id: &str,
    counter: u64,
    issued_at: u64,
    coordinator: u8,
) -> SignedBlob {
    let manifest = ReleaseManifest {
        created_at: issued_at,
        ..release("app", counter, "app.bin", "app", &artifact(counter))
    };
    let action = DesiredAction {
        action_id: action_id.into(),
        device_id: device.into(),
        rollout_id: "r1".into(),
        issued_at,
        expires_at: now() + 3600,
        body: ActionBody::Install {
            manifest: SignedBlob::sign(&key(RELEASE), envelope::to_bytes(&manifest)),
            kind: ActionKind::Forced,
            window: None,
        },
    };
    SignedBlob::sign(&key(coordinator), envelope::to_bytes(&action))
}

/// Plays the coordinator for one device: publishes desired actions retained, serves the
/// artifacts of releases 1 to 9 by digest, and collects reports.
struct Coordinator {
    client: AsyncClient,
    device: DeviceId,
    reports: mpsc::Receiver<Report>,
    /// Block requests served so far.
    fetches: Arc<AtomicUsize>,
}

impl Coordinator {
    async fn start(port: u16, device: &str) -> Coordinator {
        let topics = Topics::default();
        let id = DeviceId::new(device).expect("device id");
        let (client, mut eventloop) = common::client(
            port,
            &format!("test-coordinator-{device}"),
            [topics.report(&id), topics.fetch(&id)],
        )
        .await;
        let served: HashMap<[u8; 32], Vec<u8>> = (1..10)
            .map(|c| {
                let bytes = artifact(c);
                (flotilla_protocol::sha256(&bytes), bytes)
            })
            .collect();
        let fetches = Arc::new(AtomicUsize::new(0));
        let (tx, reports) = mpsc::channel(1000);
        let block_topic = topics.block(&id);
        let c = client.clone();
        let counted = fetches.clone();
        tokio::spawn(async move {
            loop {
                let p = next_publish(&mut eventloop).await;
                match envelope::decode(&p.payload).map(flotilla_protocol::device::plain) {
                    Ok(Message::Report(r)) => {
                        let _ = tx.send(r).await;
                    }
                    Ok(Message::Fetch(req)) => {
                        counted.fetch_add(1, Ordering::SeqCst);
                        let data = served.get(&req.sha256).map_or(&[][..], Vec::as_slice);
                        let reply = BlockReply::Data {
                            sha256: req.sha256,
                            offset: req.offset,
                            data: block(data, &req),
                        };
                        send_block(&c, block_topic.clone(), reply);
                    }
                    _ => {}
                }
            }
        });
        Coordinator {
            client,
            device: id,
            reports,
            fetches,
        }
    }

    /// Replaces the retained desired action.
    async fn publish(&self, desired: SignedBlob) {
        set_desired(&self.client, &self.device, desired).await;
    }

    /// Waits for a final report about `action_id`; earlier reports are skipped.
    async fn final_phase(&mut self, action_id: &str) -> Phase {
        self.final_phase_and_seen(action_id).await.0
    }

    /// The final phase of `action_id`, and every report seen before it.
    async fn final_phase_and_seen(&mut self, action_id: &str) -> (Phase, Vec<Report>) {
        let mut seen = Vec::new();
        let found = tokio::time::timeout(TIMEOUT, async {
            while let Some(r) = self.reports.recv().await {
                if r.action_id == action_id && r.phase.is_terminal() {
                    return Some(r.phase);
                }
                seen.push(r);
            }
            None
        })
        .await;
        match found {
            Ok(Some(phase)) => (phase, seen),
            _ => panic!("no final report for {action_id} within 30s; reports: {seen:#?}"),
        }
    }
}

fn refused_reason(phase: Phase) -> String {
    match phase {
        Phase::Refused { reason } => reason,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Runs the agent binary's `keys install`; returns (success, stdout + stderr).
async fn keys_install(config: &Path, file: &Path) -> (bool, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla-agent"))
        .args(["keys", "install", "--config"])
        .arg(config)
        .arg(file)
        .output()
        .await
        .expect("run flotilla-agent");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Two of the three root keys rotate the coordinator key: from then on an action signed by
/// the new key is applied and one signed by the old key is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_coordinator_key_replaces_the_old_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"factory").expect("write old");
    let device = "dev-rotate";
    let config_path = write_config(
        dir.path(),
        &config_text(broker.port, dir.path(), device, &dest),
    );
    let file = dir.path().join("keys-1.bin");
    std::fs::write(&file, keys_file(1, NEW_COORDINATOR, &[ROOTS[0], ROOTS[2]])).expect("write");
    let (ok, said) = keys_install(&config_path, &file).await;
    assert!(ok, "{said}");
    assert!(said.starts_with("keys version 1 installed"), "{said}");
    let trust_file = std::fs::read_to_string(dir.path().join("agent-data/trust")).expect("read");
    assert!(
        trust_file.contains(&format!(
            "coordinator_key = {}",
            hex::encode(key(NEW_COORDINATOR).verifying_key().as_bytes())
        )),
        "{trust_file}"
    );

    let mut coordinator = Coordinator::start(broker.port, device).await;
    let config = Config::load(&config_path).expect("config");
    let agent = run_agent(config);

    // Signed by the retired key: ignored (and not reported under its action id, which anyone
    // could claim), so nothing is installed until the action signed by the new key.
    coordinator
        .publish(install(device, "by-old-key", 2, now(), OLD_COORDINATOR))
        .await;
    coordinator
        .publish(install(device, "by-new-key", 2, now(), NEW_COORDINATOR))
        .await;
    let (phase, seen) = coordinator.final_phase_and_seen("by-new-key").await;
    assert_eq!(phase, Phase::Applied);
    assert!(
        seen.iter().all(|r| r.action_id != "by-old-key"),
        "the action signed by the old key is never reported: {seen:#?}"
    );
    assert_eq!(std::fs::read(&dest).expect("read"), artifact(2));

    let _ = agent.stop().await;
}

/// Every refused keys document names its reason and leaves the trusted keys as they were.
#[test]
fn refused_rotations_leave_the_keys_unchanged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dest = dir.path().join("app.bin");
    let config =
        Config::from_toml(&config_text(1883, dir.path(), "dev-refuse", &dest)).expect("config");
    let install = |name: &str, bytes: Vec<u8>| {
        let file = dir.path().join(name);
        std::fs::write(&file, bytes).expect("write");
        trust::install_keys(&config, &file)
    };
    let accepted = install("v2", keys_file(2, NEW_COORDINATOR, &[ROOTS[0], ROOTS[1]]))
        .expect("version 2 accepted");
    assert_eq!(accepted.version, 2);
    let trust_path = dir.path().join("agent-data/trust");
    let before = std::fs::read(&trust_path).expect("trust file");

    let mut tampered = keys::decode_file(&keys_file(3, STRANGER, &ROOTS)).expect("decodes");
    let last = tampered.payload.len() - 1;
    tampered.payload[last] ^= 1;
    let cases: Vec<(&str, Vec<u8>, String)> = vec![
        (
            "one signature short",
            keys_file(3, STRANGER, &[ROOTS[1]]),
            "keys document is signed by 1 root key(s), it needs 2".into(),
        ),
        (
            "signed by a key that is not a root",
            keys_file(3, STRANGER, &[ROOTS[1], STRANGER]),
            format!(
                "keys document is signed by 1 root key(s), it needs 2 (ignored signatures by \
                 keys that are not a root key: {})",
                hex::encode(key(STRANGER).verifying_key().as_bytes())
            ),
        ),
        (
            "a replayed older version",
            keys_file(1, STRANGER, &ROOTS),
            "keys document version 1 is not newer than the accepted version 2".into(),
        ),
        (
            "tampered",
            keys::encode_file(&tampered),
            format!(
                "keys document signature by root key {} does not verify",
                hex::encode(key(ROOTS[0]).verifying_key().as_bytes())
            ),
        ),
    ];
    for (case, bytes, reason) in cases {
        match install(case, bytes) {
            Err(InstallKeysError::Refused { source, .. }) => {
                assert_eq!(source.to_string(), reason, "{case}")
            }
            other => panic!("{case}: expected a refusal, got {other:?}"),
        }
        assert_eq!(
            std::fs::read(&trust_path).expect("trust file"),
            before,
            "{case}: the trust file changed"
        );
    }
    let (_, trust) = open_trust(&config);
    let ring = trust.ring(&config.trust);
    assert_eq!(ring.version, 2);
    assert_eq!(
        ring.coordinator_keys,
        vec![key(NEW_COORDINATOR).verifying_key()]
    );
}

/// The trust state as the agent would start with it (trust file merged with the database).
fn open_trust(config: &Config) -> (flotilla_agent::store::Store, trust::TrustState) {
    let (store, trust, _) = flotilla_agent::store::open_data_dir(config).expect("open");
    (store, trust)
}

/// A handled action id is not applied again: the agent re-reports its phase without fetching
/// or writing anything. An action issued before the last accepted one is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_actions_are_not_applied() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"factory").expect("write old");
    let device = "dev-replay";
    let config_path = write_config(
        dir.path(),
        &config_text(broker.port, dir.path(), device, &dest),
    );
    let mut coordinator = Coordinator::start(broker.port, device).await;
    let agent = run_agent(Config::load(&config_path).expect("config"));

    let issued = now();
    let first = install(device, "act-3", 3, issued, OLD_COORDINATOR);
    coordinator.publish(first.clone()).await;
    assert_eq!(coordinator.final_phase("act-3").await, Phase::Applied);
    let fetched = coordinator.fetches.load(Ordering::SeqCst);
    assert!(fetched > 0);

    // Someone changes the file by hand; a replay of the same action must not rewrite it.
    std::fs::write(&dest, b"changed locally").expect("write");
    coordinator.publish(first).await;
    assert_eq!(coordinator.final_phase("act-3").await, Phase::Applied);
    assert_eq!(std::fs::read(&dest).expect("read"), b"changed locally");
    assert_eq!(
        coordinator.fetches.load(Ordering::SeqCst),
        fetched,
        "nothing fetched again"
    );

    coordinator
        .publish(install(
            device,
            "act-4-old",
            4,
            issued - 100,
            OLD_COORDINATOR,
        ))
        .await;
    assert_eq!(
        refused_reason(coordinator.final_phase("act-4-old").await),
        format!(
            "action act-4-old issued at {}, older than the last accepted action issued at {issued}",
            issued - 100
        )
    );
    assert_eq!(std::fs::read(&dest).expect("read"), b"changed locally");

    let _ = agent.stop().await;
}

/// Stop the agent, delete its database, start it again: the trust file still refuses a lower
/// release counter and an action older than the last accepted one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_database_keeps_the_release_counter() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let dest = dir.path().join("app.bin");
    std::fs::write(&dest, b"factory").expect("write old");
    let device = "dev-nodb";
    let config_path = write_config(
        dir.path(),
        &config_text(broker.port, dir.path(), device, &dest),
    );
    let config = Config::load(&config_path).expect("config");
    let mut coordinator = Coordinator::start(broker.port, device).await;

    let agent = run_agent(config.clone());
    let issued = now();
    coordinator
        .publish(install(device, "act-5", 5, issued, OLD_COORDINATOR))
        .await;
    assert_eq!(coordinator.final_phase("act-5").await, Phase::Applied);
    agent
        .stop()
        .await
        .expect("agent stops")
        .expect("agent task")
        .expect("agent ran");

    let db = flotilla_agent::store::db_path(&config.data_dir);
    std::fs::remove_dir_all(&db).expect("rm -r the database");

    let agent = run_agent(config.clone());
    coordinator
        .publish(install(
            device,
            "act-3-lower",
            3,
            issued + 1,
            OLD_COORDINATOR,
        ))
        .await;
    assert_eq!(
        refused_reason(coordinator.final_phase("act-3-lower").await),
        "release counter 3 is not higher than installed 5"
    );
    coordinator
        .publish(install(device, "act-6-old", 6, issued - 1, OLD_COORDINATOR))
        .await;
    let reason = refused_reason(coordinator.final_phase("act-6-old").await);
    assert!(
        reason.contains("older than the last accepted action"),
        "{reason}"
    );
    assert_eq!(std::fs::read(&dest).expect("read"), artifact(5));

    let _ = agent.stop().await;
}
