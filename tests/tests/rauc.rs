//! End-to-end: a rollout installs a signed RAUC bundle through the agent's `rauc` target, with
//! Debian's real RAUC service on file-backed slots: RAUC writes slot B and makes it primary, the
//! device reboots into it (the agent and RAUC's service restarted, booted from B) and the agent
//! marks it good after the health checks. A corrupt bundle then ends the device `failed` with
//! RAUC's own error in the rollout's status, and B stays the slot that boots.

use std::fs;

use flotilla_tests::rauc::{corrupt, require_rauc, RaucDevice};
use flotilla_tests::{bin, AgentOptions, BrokerKind, Site};

const APP_2: &[u8] = b"app 2.0\n";
const APP_3: &[u8] = b"app 3.0\n";

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

/// A root filesystem image standing in for a real one: `version` over and over.
fn image(version: &str, len: usize) -> Vec<u8> {
    format!("rootfs {version}\n")
        .into_bytes()
        .into_iter()
        .cycle()
        .take(len)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_installs_a_rauc_bundle_into_the_other_slot_and_a_corrupt_one_fails_with_raucs_error(
) {
    if !require_rauc("rauc end-to-end") {
        return;
    }
    let mut site = Site::new(BrokerKind::Embedded);
    // Declared after the site: dropped first, so the agent and RAUC's service stop before it.
    let device = RaucDevice::new(&site.path("rauc-device"));

    let rootfs_2 = image("2.0", 256 * 1024);
    let good = site.path("rootfs-2.raucb");
    device.bundle(&good, "2.0", &rootfs_2);
    let artifact = format!("rootfs={}", good.display());
    let typed = [
        "--artifact",
        &artifact,
        "--artifact-type",
        "rootfs=rauc-bundle",
    ];
    site.release_with("os-2", 2, APP_2, &typed);

    let bad = site.path("rootfs-3.raucb");
    device.bundle(&bad, "3.0", &image("3.0", 256 * 1024));
    corrupt(&bad, 200, 16);
    let artifact = format!("rootfs={}", bad.display());
    let typed = [
        "--artifact",
        &artifact,
        "--artifact-type",
        "rootfs=rauc-bundle",
    ];
    site.release_with("os-3", 3, APP_3, &typed);

    site.start_coordinator();
    let options = AgentOptions {
        launcher: Some(device.launcher(&bin("flotilla-agent"))),
        extra_config: Some(format!(
            "[[target]]\nname = \"rootfs\"\nkind = \"rauc\"\nreboot_command = [{:?}]\n",
            device.reboot_command().display().to_string()
        )),
        ..AgentOptions::default()
    };
    site.add_agent("dev-01", &[("env", "test")], options);
    site.wait_devices(1).await;

    // A good bundle: RAUC writes slot B, makes it primary, the device reboots into B and the
    // agent marks it good.
    site.create_and_start(&one_group("rauc-good", "os-2")).await;
    let status = site.wait_ended("rauc-good").await;
    assert_eq!(status.state, "finished", "{status:#?}");
    assert_eq!(status.groups[0].ready, 1, "{status:#?}");
    let slot_b = fs::read(device.slot("b")).expect("slot b");
    assert_eq!(&slot_b[..rootfs_2.len()], rootfs_2, "RAUC wrote slot B");
    assert!(
        fs::read(device.slot("a"))
            .expect("slot a")
            .iter()
            .all(|b| *b == 0),
        "the booted slot A was not touched"
    );
    assert_eq!(device.backend("primary"), "B", "RAUC made B primary");
    assert_eq!(device.backend("booted"), "B", "the device runs B");
    let calls = device.backend_calls();
    let primary = calls
        .iter()
        .position(|c| c == "set-primary B")
        .expect("RAUC made B primary through the backend");
    assert_eq!(
        calls[primary + 1..],
        ["set-state B good"],
        "after the reboot and the health checks the agent marked B good: {calls:?}"
    );
    assert_eq!(device.reboots(), 1, "one reboot into the new slot");
    assert_eq!(
        fs::read(site.target_file("dev-01")).expect("app file"),
        APP_2
    );
    let log = fs::read_to_string(site.path("agents/dev-01/agent.log")).expect("agent log");
    assert!(
        log.contains("rauc: ") && log.contains("Copying image to rootfs.1"),
        "RAUC's progress is in the agent's log:\n{log}"
    );

    // A corrupt bundle: RAUC refuses its signature, the device fails with RAUC's words, nothing
    // is written and B still boots.
    site.create_and_start(&one_group("rauc-corrupt", "os-3"))
        .await;
    let status = site.wait_ended("rauc-corrupt").await;
    assert_eq!(status.groups[0].failed, 1, "{status:#?}");
    let detail = &status.groups[0].device_details["dev-01"];
    let reason = detail.reason.as_deref().unwrap_or_default();
    assert!(
        reason.contains("rootfs") && reason.contains("signature verification failed"),
        "the device's error carries RAUC's own: {detail:#?}"
    );
    eprintln!("the device's reason: {reason}");
    assert!(
        fs::read(device.slot("a"))
            .expect("slot a")
            .iter()
            .all(|b| *b == 0),
        "RAUC wrote nothing from the corrupt bundle"
    );
    assert_eq!(device.backend("primary"), "B", "B still boots");
    assert_eq!(device.reboots(), 1, "no reboot for a refused bundle");
    assert_eq!(
        device.backend_calls().len(),
        calls.len(),
        "the refused bundle changed nothing in the bootloader: {:?}",
        device.backend_calls()
    );
    assert_eq!(
        fs::read(site.target_file("dev-01")).expect("app file"),
        APP_2,
        "the release's other artifact was rolled back to what ran"
    );
}
