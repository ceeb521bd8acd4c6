//! issue 10, case 11: the coordinator's store can be backed up and restored, and a store that
//! lost writes it had acknowledged is reported at start instead of silently accepted.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use flotilla_tests::{bin, AgentOptions, BrokerKind, Site};

const SPEC: &str = "release = \"fw-5\"\nselect = \"ring=backup\"\n[groups]\ncount = 1\n";

fn spec(name: &str) -> String {
    format!("name = \"{name}\"\n{SPEC}")
}

/// Runs `flotilla serve` with the site's config and returns its exit status and output if it
/// stops within `within`; `None` (after killing it) if it keeps running.
fn serve_exits(site: &Site, within: Duration) -> Option<(std::process::ExitStatus, String)> {
    let mut child = Command::new(bin("flotilla"))
        .args(["serve", "--config"])
        .arg(site.path("coordinator.toml"))
        .env_remove("FLOTILLA_BROKER")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn flotilla serve");
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if child.try_wait().expect("wait").is_some() {
            let out = child.wait_with_output().expect("output");
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            return Some((out.status, text));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create copy");
    for entry in std::fs::read_dir(from).expect("read dir") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy file");
        }
    }
}

async fn start_fleet(site: &mut Site) {
    site.release("fw-5", 5, b"firmware five\n");
    site.start_coordinator();
    site.add_agent("bk-1", &[("ring", "backup")], AgentOptions::default());
    site.wait_online("bk-1", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_and_restore_bring_back_every_rollout() {
    let mut site = Site::new(BrokerKind::Embedded);
    start_fleet(&mut site).await;
    site.create_and_start(&spec("before-backup")).await;
    assert_eq!(site.wait_ended("before-backup").await.state, "finished");
    site.flotilla(&["group", "create", "kept", "--select", "ring=backup"]);

    let out = site.flotilla(&["backup"]);
    let path = out
        .strip_prefix("backup written to ")
        .and_then(|rest| rest.split(':').next())
        .unwrap_or_else(|| panic!("unexpected backup output: {out}"))
        .to_owned();
    assert!(
        Path::new(&path).starts_with(site.path("coordinator/backups")),
        "the coordinator picks the place: {path}"
    );

    // A stopped coordinator's store, backed up directly, holds the same records.
    assert!(site
        .terminate_coordinator(Duration::from_secs(10))
        .is_some());
    let offline = site.path("offline.jsonl");
    let data_dir = site.path("coordinator");
    let out = site.flotilla(&[
        "backup",
        "--data-dir",
        &data_dir.to_string_lossy(),
        "--out",
        &offline.to_string_lossy(),
    ]);
    assert!(out.contains("records"), "{out}");

    // The store is lost; restore brings it back.
    std::fs::rename(data_dir.join("db"), site.path("lost-db")).expect("lose the store");
    let out = site.flotilla(&[
        "restore",
        "--data-dir",
        &data_dir.to_string_lossy(),
        "--from",
        &path,
    ]);
    assert!(out.contains("restored"), "{out}");
    // Restoring over a store that has records needs --force.
    let refused = site.flotilla_output(&[
        "restore",
        "--data-dir",
        &data_dir.to_string_lossy(),
        "--from",
        &path,
    ]);
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--force"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );

    site.start_coordinator();
    let status = site
        .wait_status(
            "before-backup",
            "the restored rollout",
            flotilla_tests::WAIT,
            |_| true,
        )
        .await;
    assert_eq!(status.state, "finished", "{status:#?}");
    let groups = site.flotilla(&["group", "list"]);
    assert!(groups.contains("kept"), "{groups}");
    // The restored coordinator goes on: a new rollout over the same device works.
    site.release("fw-6", 6, b"firmware six\n");
    site.create_and_start(
        "name = \"after-restore\"\nrelease = \"fw-6\"\nselect = \"ring=backup\"\n[groups]\ncount = 1\n",
    )
    .await;
    assert_eq!(site.wait_ended("after-restore").await.state, "finished");
    assert_eq!(
        std::fs::read(site.target_file("bk-1")).expect("installed"),
        b"firmware six\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_lost_acknowledged_writes_does_not_start() {
    let mut site = Site::new(BrokerKind::Embedded);
    start_fleet(&mut site).await;
    site.create_and_start(&spec("first")).await;
    assert_eq!(site.wait_ended("first").await.state, "finished");
    assert!(site
        .terminate_coordinator(Duration::from_secs(10))
        .is_some());
    let db = site.path("coordinator/db");
    let older = site.path("older-db");
    copy_dir(&db, &older);

    site.start_coordinator();
    site.wait_status(
        "first",
        "the coordinator to start again",
        flotilla_tests::WAIT,
        |_| true,
    )
    .await;
    let client = site.client().await;
    client
        .request(
            flotilla_protocol::control::Command::CreateRollout {
                spec: spec("second"),
            },
            Duration::from_secs(10),
        )
        .await
        .expect("second rollout stored");
    assert!(site
        .terminate_coordinator(Duration::from_secs(10))
        .is_some());

    // The store comes back older than what was acknowledged (as after a damaged log was cut
    // short): the seal beside it remembers more.
    std::fs::remove_dir_all(&db).expect("remove store");
    copy_dir(&older, &db);
    let (status, output) = serve_exits(&site, Duration::from_secs(20))
        .expect("a coordinator whose store lost writes must not start");
    assert!(!status.success());
    assert!(
        output.contains("acknowledged writes are missing") && output.contains("flotilla restore"),
        "{output}"
    );

    let data_dir = site.path("coordinator");
    let check =
        site.flotilla_output(&["store", "check", "--data-dir", &data_dir.to_string_lossy()]);
    assert_eq!(check.status.code(), Some(1), "store check reports the loss");
    assert!(String::from_utf8_lossy(&check.stdout).contains("lost writes"));
    let out = site.flotilla(&["store", "reseal", "--data-dir", &data_dir.to_string_lossy()]);
    assert!(out.contains("given up"), "{out}");

    // Accepted as it is: it starts, with what the older store holds.
    site.start_coordinator();
    let first = site
        .wait_status(
            "first",
            "the coordinator to start",
            flotilla_tests::WAIT,
            |_| true,
        )
        .await;
    assert_eq!(first.state, "finished");
    assert!(
        site.status("second").await.is_none(),
        "the lost rollout is gone, as reported"
    );
}
