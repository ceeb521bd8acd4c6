//! issue 12: a fleet at scale on one coordinator. `flotilla-fleetsim` plays the devices (each
//! with its own key, pre-authorized through the keys file it writes) over one MQTT connection
//! to Mosquitto; a real `flotilla serve` runs a 5-group rollout over all of them.
//!
//! What a user would notice: the rollout finishes with every device Ready, the coordinator
//! never loses its link to the broker, and no device is sent the same desired action twice.
//! The rollout's end is read from the decision trace on `events/log` (a small message per
//! decision); the number of devices is [`DEVICES`], or `FLOTILLA_SCALE_DEVICES`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use flotilla_protocol::control::{TraceEntry, TraceKind};
use flotilla_protocol::Topics;
use flotilla_tests::{bin, BrokerKind, Site};

const DEVICES: u64 = 10_000;
const GROUPS: usize = 5;

fn devices() -> u64 {
    std::env::var("FLOTILLA_SCALE_DEVICES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(DEVICES)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_over_ten_thousand_simulated_devices_finishes_cleanly() {
    let n = devices();
    // The coordinator flushes every store write; on tmpfs a flush costs nothing, so the test
    // measures the coordinator's work rather than this machine's disk.
    if std::path::Path::new("/dev/shm").is_dir() {
        std::env::set_var("TMPDIR", "/dev/shm");
    }
    let mut site = Site::new(BrokerKind::Mosquitto);
    let sim = bin("flotilla-fleetsim");
    let status = Command::new(&sim)
        .args(["--count", &n.to_string(), "--write-authorized-keys"])
        .arg(site.authorized_keys_file())
        .stdout(Stdio::null())
        .status()
        .expect("run flotilla-fleetsim");
    assert!(status.success(), "writing the authorized keys failed");
    site.flotilla(&[
        "release",
        "create",
        "--data-dir",
        &site.path("coordinator").to_string_lossy(),
        "--key",
        &site.path("keys/release.key").to_string_lossy(),
        "--name",
        "fw-scale",
        "--version",
        "2.0.0",
        "--counter",
        "2",
        "--hardware",
        "sim-board",
        "--artifact",
        &format!("app={}", site.path("keys/release.pub").display()),
    ]);
    site.start_coordinator();
    let trace = site.watcher(&[Topics::default().event_log()]).await;

    let summary = site.path("fleetsim.json");
    let log = std::fs::File::create(site.path("fleetsim.log")).expect("fleetsim log");
    let mut simulator = Command::new(&sim)
        .args(["--broker", &format!("127.0.0.1:{}", site.port)])
        .args(["--count", &n.to_string()])
        .arg("--coordinator-key")
        .arg(site.path("keys/coordinator.pub"))
        .args([
            "--groups",
            &GROUPS.to_string(),
            "--until-done",
            "--timeout",
            "10m",
        ])
        .arg("--summary")
        .arg(&summary)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start flotilla-fleetsim");

    // Every device enrolled (the coordinator logs each once, just before it takes the
    // device's state), then one answered request: it queued behind those states, so the
    // rollout plans over the whole fleet.
    let log_path = site.path("coordinator.log");
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        let enrolled = log.matches("enrolled by authorized key").count() as u64;
        if enrolled >= n {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {enrolled} of {n} simulated devices enrolled"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    site.flotilla(&["approvals"]);
    let spec = site.path("scale.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"scale\"\nrelease = \"fw-scale\"\n[groups]\ncount = {GROUPS}\n\
             success = {{ threshold = \"100%\", action = \"next\" }}\n"
        ),
    )
    .expect("write spec");
    // The replies carry per-device detail, which may not fit one message at this size (an
    // error reply then, though the command took effect): the trace says what happened.
    site.flotilla_output(&["rollout", "create", "--spec", &spec.to_string_lossy()]);
    site.flotilla_output(&["rollout", "start", "scale"]);

    let entry = |m: &flotilla_tests::WatchedMessage| -> Option<TraceEntry> {
        serde_json::from_slice::<TraceEntry>(&m.payload)
            .ok()
            .filter(|e| e.rollout == "scale")
    };
    let created = trace
        .wait_until("the rollout's creation", Duration::from_secs(60), |w| {
            w.messages()
                .iter()
                .filter_map(entry)
                .find(|e| e.kind == TraceKind::Created)
        })
        .await;
    assert!(
        created.message.contains(&format!("{n} devices")),
        "the rollout was not planned over the whole fleet: {}",
        created.message
    );
    let ended = trace
        .wait_until("the rollout to end", Duration::from_secs(600), |w| {
            w.messages().iter().filter_map(entry).find(|e| {
                matches!(
                    e.kind,
                    TraceKind::Finished
                        | TraceKind::Stopped
                        | TraceKind::ErrorPaused
                        | TraceKind::ErrorStopped
                )
            })
        })
        .await;
    assert_eq!(ended.kind, TraceKind::Finished, "{}", ended.message);

    let exit = simulator.wait().expect("wait for flotilla-fleetsim");
    assert!(
        exit.success(),
        "flotilla-fleetsim did not see every device finish"
    );
    let figures: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&summary).expect("fleetsim summary"))
            .expect("summary JSON");
    assert_eq!(figures["ready"], n, "every device Ready: {figures:#}");
    assert_eq!(figures["desired"], n, "one install per device: {figures:#}");
    assert_eq!(
        figures["desired_duplicates"], 0,
        "a desired action was sent twice: {figures:#}"
    );
    assert_eq!(
        figures["refused"], 0,
        "a desired action failed its checks: {figures:#}"
    );
    // At this size neither list fits one message: both answer in pages, and the CLI pages
    // through them.
    let devices: Vec<serde_json::Value> =
        serde_json::from_str(&site.flotilla(&["devices", "--json"])).expect("devices JSON");
    assert_eq!(
        devices.len() as u64,
        n,
        "flotilla devices lists every device"
    );
    let status: serde_json::Value =
        serde_json::from_str(&site.flotilla(&["rollout", "status", "scale", "--json"]))
            .expect("status JSON");
    let groups = status["groups"].as_array().expect("groups");
    let listed: u64 = groups
        .iter()
        .map(|g| g["devices"].as_object().map_or(0, |d| d.len() as u64))
        .sum();
    let ready: u64 = groups
        .iter()
        .map(|g| g["ready"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(listed, n, "flotilla rollout status lists every device");
    assert_eq!(ready, n, "and every one is ready");
    let log = std::fs::read_to_string(site.path("coordinator.log")).expect("coordinator log");
    assert!(
        !log.contains("MQTT connection lost"),
        "the coordinator's link dropped during the rollout"
    );
}

/// The simulator checks desired actions like the agent: a forged one (another key) is refused
/// and never reported; one signed by the coordinator's key is installed and reported Ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulator_refuses_a_forged_desired_action_and_installs_a_signed_one() {
    use flotilla_protocol::{
        envelope, ActionBody, ActionKind, DesiredAction, DeviceId, Message, ReleaseManifest,
        SignedBlob,
    };
    let site = Site::new(BrokerKind::Mosquitto);
    let topics = Topics::default();
    let reports = site
        .watcher(&[format!("{}/devices/+/report", topics.prefix())])
        .await;
    let coordinator = flotilla_protocol::signing::secret_key_from_text(
        &std::fs::read_to_string(site.path("keys/coordinator.key")).expect("coordinator key"),
    )
    .expect("coordinator key");
    let rogue = flotilla_protocol::signing::generate_key();
    let manifest = ReleaseManifest {
        name: "fw-3".into(),
        version: "3.0.0".into(),
        counter: 3,
        hardware: vec!["sim-board".into()],
        artifacts: Vec::new(),
        created_at: 0,
        expires_at: u64::MAX / 2,
    };
    let manifest = SignedBlob::sign(&rogue, envelope::to_bytes(&manifest));
    for (device, key) in [("sim-000000", &rogue), ("sim-000001", &coordinator)] {
        let action = DesiredAction {
            action_id: format!("act-{device}"),
            device_id: device.into(),
            rollout_id: "r".into(),
            issued_at: 1,
            expires_at: u64::MAX / 2,
            body: ActionBody::Install {
                manifest: manifest.clone(),
                kind: ActionKind::Forced,
                window: None,
            },
        };
        let blob = SignedBlob::sign(key, envelope::to_bytes(&action));
        // Retained: the simulator reads it when it subscribes.
        site.publish(
            &topics.desired(&DeviceId::new(device).expect("id")),
            envelope::encode(&Message::Desired(blob)),
            true,
        )
        .await;
    }
    let summary = site.path("fleetsim.json");
    let mut simulator = Command::new(bin("flotilla-fleetsim"))
        .args(["--broker", &format!("127.0.0.1:{}", site.port)])
        .args(["--count", "2", "--progress", "0s"])
        .arg("--coordinator-key")
        .arg(site.path("keys/coordinator.pub"))
        .arg("--summary")
        .arg(&summary)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start flotilla-fleetsim");
    let ready = reports
        .final_report("sim-000001", Duration::from_secs(60))
        .await;
    assert_eq!(ready.phase, flotilla_protocol::Phase::Ready);
    let _ = Command::new("kill")
        .args(["-TERM", &simulator.id().to_string()])
        .status();
    assert!(simulator.wait().expect("wait").success());
    assert!(
        reports.reports("sim-000000").is_empty(),
        "a forged desired action was acted on"
    );
    let figures: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&summary).expect("summary")).expect("JSON");
    assert_eq!(figures["refused"], 1, "{figures:#}");
    assert_eq!(figures["desired"], 1, "{figures:#}");
    assert_eq!(figures["ready"], 1, "{figures:#}");
}
