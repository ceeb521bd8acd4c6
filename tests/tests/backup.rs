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
        "--coordinator-key",
        &site.path("keys/coordinator.key").to_string_lossy(),
    ]);
    assert!(out.contains("records"), "{out}");

    // The store is lost; restore brings it back.
    std::fs::rename(data_dir.join("db"), site.path("lost-db")).expect("lose the store");
    let key = site.path("keys/coordinator.key");
    let out = site.flotilla(&[
        "restore",
        "--data-dir",
        &data_dir.to_string_lossy(),
        "--from",
        &path,
        "--coordinator-key",
        &key.to_string_lossy(),
    ]);
    assert!(out.contains("restored"), "{out}");
    // Restoring over a store that has records needs --force.
    let refused = site.flotilla_output(&[
        "restore",
        "--data-dir",
        &data_dir.to_string_lossy(),
        "--from",
        &path,
        "--coordinator-key",
        &key.to_string_lossy(),
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

/// The hex of `bytes`.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Edits a backup as someone with the file (and no key) would: `edit` changes the records'
/// lines, then the closing line's count and sha256 are made to match again.
fn edit_backup(
    text: &str,
    edit: impl Fn(Vec<serde_json::Value>) -> Vec<serde_json::Value>,
) -> String {
    let mut lines: Vec<&str> = text.lines().collect();
    let trailer = lines.pop().expect("closing line");
    let header = lines.remove(0);
    let records: Vec<serde_json::Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).expect("record line"))
        .collect();
    let records = edit(records);
    let mut body = format!("{header}\n");
    for record in &records {
        body.push_str(&format!("{record}\n"));
    }
    let mut trailer: serde_json::Value = serde_json::from_str(trailer).expect("closing line");
    trailer["records"] = records.len().into();
    let digest = std::process::Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write as _;
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(body.as_bytes())?;
            child.wait_with_output()
        })
        .expect("sha256sum");
    let digest = String::from_utf8_lossy(&digest.stdout);
    trailer["sha256"] = digest.split_whitespace().next().expect("digest").into();
    format!("{body}{trailer}\n")
}

/// Issue 19, item 7: a backup is signed with the coordinator key, and `restore` verifies it
/// before writing anything. A backup edited to accept a revoked device again and to forget the
/// used enrollment tokens, its sha256 recomputed, is refused naming the signature, and nothing is
/// written; the backup as made restores, signed by the coordinator's key, and the device stays
/// revoked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_backup_is_refused_before_anything_is_written() {
    let mut site = Site::new(BrokerKind::Embedded);
    start_fleet(&mut site).await;
    site.flotilla(&["devices", "revoke", "bk-1"]);
    site.wait_for_enrollment("bk-1", "revoked").await;
    let out = site.flotilla(&["backup"]);
    let coordinator_pub = std::fs::read_to_string(site.path("keys/coordinator.pub"))
        .expect("public key")
        .trim()
        .to_owned();
    assert!(
        out.contains(&format!("signed by coordinator key {coordinator_pub}")),
        "{out}"
    );
    let path = out
        .strip_prefix("backup written to ")
        .and_then(|rest| rest.split(':').next())
        .unwrap_or_else(|| panic!("unexpected backup output: {out}"))
        .to_owned();
    assert!(site
        .terminate_coordinator(Duration::from_secs(10))
        .is_some());

    // Edited: the revoked device accepted again, the used tokens forgotten.
    let text = std::fs::read_to_string(&path).expect("backup");
    let revoked = hex(b"\"status\":\"revoked\"");
    let edited = edit_backup(&text, |records| {
        records
            .into_iter()
            .filter(|r| r["tree"] != "used_tokens")
            .map(|mut r| {
                if r["tree"] == "enrollments" {
                    let value = r["value"].as_str().expect("hex").to_owned();
                    assert!(value.contains(&revoked), "the enrollment says revoked: {r}");
                    r["value"] = value
                        .replace(&revoked, &hex(b"\"status\":\"accepted\""))
                        .into();
                }
                r
            })
            .collect()
    });
    assert!(
        text.contains("\"tree\":\"used_tokens\"") && !edited.contains("used_tokens"),
        "the edit drops the used tokens"
    );
    let edited_path = site.path("edited.jsonl");
    std::fs::write(&edited_path, &edited).expect("write edited backup");

    let data_dir = site.path("coordinator");
    let key = site.path("keys/coordinator.key");
    std::fs::rename(data_dir.join("db"), site.path("lost-db")).expect("lose the store");
    let refused = site.flotilla_output(&[
        "restore",
        "--data-dir",
        &data_dir.to_string_lossy(),
        "--from",
        &edited_path.to_string_lossy(),
        "--coordinator-key",
        &key.to_string_lossy(),
    ]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success(),
        "an edited backup restored: {stderr}"
    );
    assert!(
        stderr.contains("signature does not verify") && stderr.contains(&coordinator_pub),
        "{stderr}"
    );
    assert!(
        !data_dir.join("db").exists(),
        "nothing is written before the backup is verified"
    );

    // Without a key to check it against, restore does not start.
    let keyless = site.flotilla_output(&[
        "restore",
        "--data-dir",
        &data_dir.to_string_lossy(),
        "--from",
        &path,
    ]);
    assert!(!keyless.status.success());
    assert!(
        String::from_utf8_lossy(&keyless.stderr).contains("--coordinator-key"),
        "{}",
        String::from_utf8_lossy(&keyless.stderr)
    );

    // The backup as made restores, and the device is still revoked.
    let out = site.flotilla(&[
        "restore",
        "--data-dir",
        &data_dir.to_string_lossy(),
        "--from",
        &path,
        "--coordinator-key",
        &key.to_string_lossy(),
    ]);
    assert!(
        out.contains("restored") && out.contains(&coordinator_pub),
        "{out}"
    );
    site.start_coordinator();
    site.wait_for_enrollment("bk-1", "revoked").await;
}
