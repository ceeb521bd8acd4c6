//! End-to-end: real rollouts installing through the `mender-module` target, with Debian's
//! unchanged Mender update modules (`single-file`, `directory` from `mender-client`) on real
//! agent processes, and a module that fails in `ArtifactInstall`.
//!
//! The modules tests need `/usr/share/mender/modules/v3` (`apt-get install mender-client`);
//! without it they skip loudly, and fail under `FLOTILLA_REQUIRE_TOOLS=1` or in CI.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use flotilla_tests::{AgentOptions, BrokerKind, Site};

const MODULES: &str = "/usr/share/mender/modules/v3";
const NEW_FIRMWARE: &[u8] = b"firmware 2.0, installed by a Mender update module\n";

/// Whether Debian's module `name` is there; CI installs mender-client, so there a missing one
/// fails the test.
fn require_module(name: &str, test: &str) -> bool {
    if Path::new(MODULES).join(name).is_file() {
        return true;
    }
    let notice =
        format!("SKIPPED {test}: {MODULES}/{name} is missing (apt-get install mender-client)");
    if std::env::var_os("FLOTILLA_REQUIRE_TOOLS").is_some() || std::env::var_os("CI").is_some() {
        panic!("{notice}; .ci/run must install it");
    }
    eprintln!("\n!!!! {notice}");
    false
}

fn spec(name: &str) -> String {
    format!(
        "name = \"{name}\"\nrelease = \"fw-2\"\nselect = \"ring=mender\"\n[groups]\ncount = 1\n"
    )
}

/// A site with the release `fw-2` (artifact `content`) and one agent whose `app` target is
/// `app_target`.
async fn site_with(id: &str, content: &[u8], app_target: String) -> Site {
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-2", 2, content);
    site.start_coordinator();
    let options = AgentOptions {
        app_target: Some(app_target),
        ..AgentOptions::default()
    };
    site.add_agent(id, &[("ring", "mender")], options);
    site.wait_online(id, true).await;
    site
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_installs_a_payload_through_the_single_file_module() {
    if !require_module(
        "single-file",
        "a_rollout_installs_a_payload_through_the_single_file_module",
    ) {
        return;
    }
    let id = "mender-single";
    // The module installs the agent's app.bin itself, which its health check reads.
    let mut site = Site::new(BrokerKind::Embedded);
    let dest = site.target_file(id);
    let dest_dir = dest.parent().expect("agent dir").display().to_string();
    // Typed as Mender types an artifact: by the module that installs it.
    site.release_with(
        "fw-2",
        2,
        NEW_FIRMWARE,
        &["--artifact-type", "app=mender:single-file"],
    );
    // A payload for another module: the device refuses it before downloading.
    site.release_with(
        "fw-3",
        3,
        b"a tree",
        &["--artifact-type", "app=mender:directory"],
    );
    site.start_coordinator();
    let app_target = format!(
        "kind = \"mender-module\"\nmodule = \"single-file\"\npayload_file = \"app.bin\"\n\
         files = {{ dest_dir = {dest_dir:?}, filename = \"app.bin\", permissions = \"0640\" }}"
    );
    site.add_agent(
        id,
        &[("ring", "mender")],
        AgentOptions {
            app_target: Some(app_target),
            ..AgentOptions::default()
        },
    );
    site.wait_online(id, true).await;
    assert_eq!(
        fs::read(&dest).expect("factory file"),
        b"factory firmware\n"
    );

    site.create_and_start(&spec("single-file")).await;
    let status = site.wait_ended("single-file").await;
    assert_eq!(status.state, "finished", "{status:#?}");
    assert_eq!(status.groups[0].devices[id], "ready", "{status:#?}");
    assert_eq!(fs::read(&dest).expect("installed"), NEW_FIRMWARE);
    let mode = fs::metadata(&dest).expect("meta").permissions().mode() & 0o777;
    assert_eq!(mode, 0o640, "the module applied files/permissions");
    // Committed and cleaned up: the files tree is gone, as Mender leaves it.
    let tree = site.path(&format!("agents/{id}/data/targets/app/tree"));
    assert!(!tree.exists(), "{} is left after Cleanup", tree.display());

    site.create_and_start(
        "name = \"for-directory\"\nrelease = \"fw-3\"\nselect = \"ring=mender\"\n[groups]\ncount = 1\n",
    )
    .await;
    let status = site.wait_ended("for-directory").await;
    assert_eq!(status.groups[0].failed, 1, "{status:#?}");
    let detail = &status.groups[0].device_details[id];
    let reason = detail.reason.as_deref().unwrap_or_default();
    assert!(
        reason.contains("payload for the Mender update module \"directory\"")
            && reason.contains("v3/single-file"),
        "the device names the module the payload is for and the one it runs: {detail:#?}"
    );
    assert_eq!(
        fs::read(&dest).expect("kept"),
        NEW_FIRMWARE,
        "nothing installed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_installs_a_directory_through_the_directory_module() {
    if !require_module(
        "directory",
        "a_rollout_installs_a_directory_through_the_directory_module",
    ) {
        return;
    }
    let id = "mender-dir";
    let staging = tempfile::tempdir().expect("tempdir");
    fs::create_dir_all(staging.path().join("src/static")).expect("src");
    fs::write(staging.path().join("src/index.html"), "<h1>v2</h1>\n").expect("index");
    fs::write(staging.path().join("src/static/app.js"), "start(2);\n").expect("js");
    let tar = staging.path().join("update.tar");
    let made = Command::new("tar")
        .arg("-cf")
        .arg(&tar)
        .arg("-C")
        .arg(staging.path().join("src"))
        .arg(".")
        .status()
        .expect("tar runs");
    assert!(made.success());
    let content = fs::read(&tar).expect("tar");

    let www = tempfile::tempdir().expect("www parent");
    let dest_dir = www.path().join("www");
    fs::create_dir_all(&dest_dir).expect("www");
    fs::write(dest_dir.join("index.html"), "<h1>v1</h1>\n").expect("v1");
    let app_target = format!(
        "kind = \"mender-module\"\nmodule = \"directory\"\npayload_file = \"update.tar\"\n\
         files = {{ dest_dir = {:?} }}",
        dest_dir.display().to_string()
    );
    let site = site_with(id, &content, app_target).await;
    site.create_and_start(&spec("directory")).await;
    let status = site.wait_ended("directory").await;
    assert_eq!(status.state, "finished", "{status:#?}");
    assert_eq!(status.groups[0].devices[id], "ready", "{status:#?}");
    assert_eq!(
        fs::read_to_string(dest_dir.join("index.html")).expect("index"),
        "<h1>v2</h1>\n"
    );
    assert_eq!(
        fs::read_to_string(dest_dir.join("static/app.js")).expect("js"),
        "start(2);\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_failing_in_install_fails_the_device_with_its_error_and_keeps_the_old_content() {
    let id = "mender-failing";
    let modules = tempfile::tempdir().expect("module dir");
    let module = modules.path().join("flaky-firmware");
    let mut site = Site::new(BrokerKind::Embedded);
    let dest = site.target_file(id);
    // Backs up, half-writes the file, then fails like a flash write running out of space;
    // ArtifactRollback restores the backup.
    fs::write(
        &module,
        format!(
            r#"#!/bin/sh
case "$1" in
  SupportsRollback) echo Yes ;;
  NeedsArtifactReboot) echo No ;;
  ArtifactInstall)
    cp "{dest}" "$2/tmp/backup"
    head -c 5 "$2/files/app.bin" > "{dest}"
    echo "flash write at offset 5 failed: No space left on device" >&2
    exit 1 ;;
  ArtifactRollback) cp "$2/tmp/backup" "{dest}" ;;
esac
exit 0
"#,
            dest = dest.display()
        ),
    )
    .expect("module");
    fs::set_permissions(&module, fs::Permissions::from_mode(0o755)).expect("chmod");
    site.release("fw-2", 2, NEW_FIRMWARE);
    site.start_coordinator();
    let app_target = format!(
        "kind = \"mender-module\"\nmodule = {:?}\npayload_file = \"app.bin\"",
        module.display().to_string()
    );
    site.add_agent(
        id,
        &[("ring", "mender")],
        AgentOptions {
            app_target: Some(app_target),
            ..AgentOptions::default()
        },
    );
    site.wait_online(id, true).await;

    site.create_and_start(&spec("failing")).await;
    let status = site.wait_ended("failing").await;
    let detail = &status.groups[0].device_details[id];
    assert_eq!(detail.phase, "failed", "{status:#?}");
    let reason = detail.reason.clone().unwrap_or_default();
    assert!(
        reason.contains("ArtifactInstall failed")
            && reason.contains("flash write at offset 5 failed: No space left on device"),
        "the module's own error is the device's reason: {reason}"
    );
    assert_eq!(
        fs::read(&dest).expect("target"),
        b"factory firmware\n",
        "ArtifactRollback put the old content back"
    );
}
