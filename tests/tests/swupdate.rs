//! End-to-end: a rollout installs a SWUpdate image through the agent's `swupdate` target, with
//! Debian's real `swupdate -i` and through a running SWUpdate daemon's socket, and a corrupt
//! image ends the device `failed` with SWUpdate's own error in the rollout's status.
//!
//! The tests take turns ([`swupdate_lock`]): SWUpdate binds one machine-wide name.

use std::fs;

use flotilla_tests::swu::{corrupt, require_swupdate, swupdate_lock, Signer, SwupdateDaemon};
use flotilla_tests::{AgentOptions, BrokerKind, Site};

const APP_2: &[u8] = b"app 2.0\n";
const APP_3: &[u8] = b"app 3.0\n";
const FIRMWARE_2: &[u8] = b"firmware settings 2.0: written by SWUpdate\n";
const FIRMWARE_3: &[u8] = b"firmware settings 3.0: never written\n";

fn one_group(name: &str, release: &str) -> String {
    format!(
        r#"
name = "{name}"
release = "{release}"
[groups]
count = 1
success = {{ threshold = "100%", action = "next" }}
error = {{ threshold = "50%", action = "pause" }}
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_installs_a_swu_and_a_corrupt_one_fails_with_swupdates_error() {
    if !require_swupdate("swupdate end-to-end") {
        return;
    }
    let _one_swupdate = swupdate_lock();
    let mut site = Site::new(BrokerKind::Embedded);
    let signer = Signer::new(&site.path("signer"));
    // What the image writes: a file in the test's directory, standing in for a partition.
    let device_dir = site.path("device-firmware");
    fs::create_dir_all(&device_dir).expect("device directory");
    let dest = device_dir.join("firmware.conf");
    fs::write(&dest, b"factory settings\n").expect("factory settings");

    let good = site.path("firmware-2.swu");
    signer.file_image(&good, "2.0.0", &dest, FIRMWARE_2);
    let artifact = format!("firmware={}", good.display());
    site.release_with(
        "fw-2",
        2,
        APP_2,
        &["--artifact", &artifact, "--artifact-type", "firmware=swu"],
    );

    let bad = site.path("firmware-3.swu");
    signer.file_image(&bad, "3.0.0", &dest, FIRMWARE_3);
    corrupt(&bad, b"never written");
    let artifact = format!("firmware={}", bad.display());
    site.release_with(
        "fw-3",
        3,
        APP_3,
        &["--artifact", &artifact, "--artifact-type", "firmware=swu"],
    );

    site.start_coordinator();
    let options = AgentOptions {
        extra_config: Some(format!(
            "[[target]]\nname = \"firmware\"\nkind = \"swupdate\"\n\
             args = [\"-k\", {:?}, \"-H\", \"board:1.0\"]\n",
            signer.cert().display().to_string()
        )),
        ..AgentOptions::default()
    };
    site.add_agent("dev-01", &[("env", "test")], options);
    site.wait_devices(1).await;

    // A good image: SWUpdate writes the file and the device ends ready.
    site.create_and_start(&one_group("swu-good", "fw-2")).await;
    let status = site.wait_ended("swu-good").await;
    assert_eq!(status.state, "finished", "{status:#?}");
    assert_eq!(status.groups[0].ready, 1, "{status:#?}");
    assert_eq!(fs::read(&dest).expect("firmware file"), FIRMWARE_2);
    assert_eq!(
        fs::read(site.target_file("dev-01")).expect("app file"),
        APP_2
    );
    let log = fs::read_to_string(site.path("agents/dev-01/agent.log")).expect("agent log");
    assert!(
        log.contains("swupdate: ") && log.contains("SWUPDATE successful"),
        "SWUpdate's progress is in the agent's log:\n{log}"
    );

    // A corrupt image: SWUpdate refuses it, the device fails with SWUpdate's words, and the file
    // keeps what the good image wrote.
    site.create_and_start(&one_group("swu-corrupt", "fw-3"))
        .await;
    let status = site.wait_ended("swu-corrupt").await;
    assert_eq!(status.groups[0].failed, 1, "{status:#?}");
    let detail = &status.groups[0].device_details["dev-01"];
    let reason = detail.reason.as_deref().unwrap_or_default();
    assert!(
        reason.contains("firmware") && reason.contains("HASH mismatch"),
        "the device's error carries SWUpdate's own: {detail:#?}"
    );
    eprintln!("the device's reason: {reason}");
    assert_eq!(fs::read(&dest).expect("firmware file"), FIRMWARE_2);
    assert_eq!(
        fs::read(site.target_file("dev-01")).expect("app file"),
        APP_2,
        "the release's other artifact was rolled back to what ran"
    );
}

/// A device whose SWUpdate runs as a daemon (for its web server or suricatta): the agent installs
/// through the daemon's socket, its log shows SWUpdate's progress, and a corrupt image ends the
/// device `failed` with SWUpdate's "HASH mismatch" read from the daemon.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_installs_through_a_running_swupdate_daemon() {
    if !require_swupdate("swupdate daemon end-to-end") {
        return;
    }
    let _one_swupdate = swupdate_lock();
    let mut site = Site::new(BrokerKind::Embedded);
    let signer = Signer::new(&site.path("signer"));
    let device_dir = site.path("device-firmware");
    fs::create_dir_all(&device_dir).expect("device directory");
    let dest = device_dir.join("firmware.conf");
    fs::write(&dest, b"factory settings\n").expect("factory settings");
    let cert = signer.cert().display().to_string();
    let daemon = SwupdateDaemon::start(
        &site.path("swupdate-daemon"),
        &["-k", &cert, "-H", "board:1.0"],
    );

    let good = site.path("firmware-2.swu");
    signer.file_image(&good, "2.0.0", &dest, FIRMWARE_2);
    let artifact = format!("firmware={}", good.display());
    site.release_with(
        "fw-2",
        2,
        APP_2,
        &["--artifact", &artifact, "--artifact-type", "firmware=swu"],
    );
    let bad = site.path("firmware-3.swu");
    signer.file_image(&bad, "3.0.0", &dest, FIRMWARE_3);
    corrupt(&bad, b"never written");
    let artifact = format!("firmware={}", bad.display());
    site.release_with(
        "fw-3",
        3,
        APP_3,
        &["--artifact", &artifact, "--artifact-type", "firmware=swu"],
    );

    site.start_coordinator();
    // `path` names a program that fails: an install that fell back to `swupdate -i` could not
    // pass for one through the daemon.
    let options = AgentOptions {
        extra_config: Some(format!(
            "[[target]]\nname = \"firmware\"\nkind = \"swupdate\"\npath = \"/bin/false\"\n\
             socket = {:?}\n",
            daemon.socket().display().to_string()
        )),
        ..AgentOptions::default()
    };
    site.add_agent("dev-01", &[("env", "test")], options);
    site.wait_devices(1).await;

    site.create_and_start(&one_group("swu-daemon-good", "fw-2"))
        .await;
    let status = site.wait_ended("swu-daemon-good").await;
    assert_eq!(status.state, "finished", "{status:#?}");
    assert_eq!(status.groups[0].ready, 1, "{status:#?}");
    assert_eq!(fs::read(&dest).expect("firmware file"), FIRMWARE_2);
    let log = fs::read_to_string(site.path("agents/dev-01/agent.log")).expect("agent log");
    assert!(
        log.contains("installing through SWUpdate's daemon")
            && log.contains("swupdate progress: step 1/")
            && log.contains("swupdate: SWUPDATE successful"),
        "the agent used the daemon and logged its progress:\n{log}"
    );
    assert!(
        daemon.log().contains("SWUPDATE successful"),
        "the daemon installed it:\n{}",
        daemon.log()
    );

    site.create_and_start(&one_group("swu-daemon-corrupt", "fw-3"))
        .await;
    let status = site.wait_ended("swu-daemon-corrupt").await;
    assert_eq!(status.groups[0].failed, 1, "{status:#?}");
    let detail = &status.groups[0].device_details["dev-01"];
    let reason = detail.reason.as_deref().unwrap_or_default();
    assert!(
        reason.contains("firmware") && reason.contains("HASH mismatch"),
        "the device's error carries SWUpdate's own: {detail:#?}"
    );
    eprintln!("the device's reason: {reason}");
    assert_eq!(fs::read(&dest).expect("firmware file"), FIRMWARE_2);
    assert_eq!(
        fs::read(site.target_file("dev-01")).expect("app file"),
        APP_2,
        "the release's other artifact was rolled back to what ran"
    );
}
