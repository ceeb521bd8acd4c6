//! A damaged agent database never takes a device back to an older release (issue 19, item 1).
//!
//! Real agent processes over a real mosquitto broker, with the test playing the coordinator.
//! sled notices flipped bits in its log by their checksums and recovers to the entry before the
//! first damaged one, so a damaged database opens as an older one: an action from an earlier
//! release can come back half-way through. The agent must verify such an action again, fail it
//! with the reason, install nothing, and report.
//!
//! Skipped with a notice when `mosquitto` is not installed.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::{
    client, config_text, next_publish, release, send_block, set_desired, sign_action, start_broker,
    TIMEOUT,
};
use flotilla_protocol::{
    envelope, ActionKind, BlockReply, DeviceId, DeviceState, Message, Phase, Report, SignedBlob,
    Topics,
};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

const DEVICE: &str = "dev-store";

/// The agent's config: one `file` target at `work/app.bin`, a health check, a short soak.
fn agent_config_text(port: u16, work: &Path) -> String {
    let rest = format!(
        r#"
[[target]]
name = "app"
kind = "file"
path = "{dest}"
[health]
soak = "100ms"
interval = "50ms"
[[health.check]]
name = "app-runs"
command = ["/bin/sh", "-c", "test -s {dest}"]
timeout = "5s"
[download]
block_size = 4096
"#,
        dest = work.join("app.bin").display(),
    );
    config_text(port, work, DEVICE, &rest)
}

/// The content of release `counter`.
fn content(counter: u64) -> Vec<u8> {
    (0..6_000u32)
        .map(|i| (i as u64 * 7 + counter) as u8)
        .collect()
}

/// Which release the device runs, by the content of its file.
fn running(work: &Path) -> String {
    let bytes = std::fs::read(work.join("app.bin")).expect("read");
    (1..=12).find(|&c| bytes == content(c)).map_or_else(
        || format!("{} unknown bytes", bytes.len()),
        |c| format!("release {c}"),
    )
}

/// The signed install of release `app-{counter}` as action `act-{counter}`.
fn install(counter: u64) -> SignedBlob {
    let body = common::install(
        &release("app", counter, "app.bin", "app", &content(counter)),
        ActionKind::Forced,
    );
    sign_action(DEVICE, &format!("act-{counter}"), body)
}

/// What the stand-in coordinator hears from the device.
#[derive(Debug)]
enum Heard {
    Report(Report),
    State(DeviceState),
}

/// Plays the coordinator: publishes `desired` retained, serves the content of every release in
/// `counters` by its digest, and passes on reports and states. Stops when dropped.
struct StandIn {
    client: rumqttc::AsyncClient,
    heard: mpsc::Receiver<Heard>,
    task: JoinHandle<()>,
    /// The highest report sequence number seen.
    max_seq: u64,
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn stand_in(port: u16, name: &str, desired: SignedBlob, counters: &[u64]) -> StandIn {
    let topics = Topics::default();
    let id = DeviceId::new(DEVICE).expect("device id");
    let (client, mut eventloop) = client(
        port,
        name,
        [topics.report(&id), topics.fetch(&id), topics.state(&id)],
    )
    .await;
    set_desired(&client, &id, desired).await;
    let served: Vec<([u8; 32], Vec<u8>)> = counters
        .iter()
        .map(|&c| (flotilla_protocol::sha256(&content(c)), content(c)))
        .collect();
    let (tx, heard) = mpsc::channel(10_000);
    let replier = client.clone();
    let block_topic = topics.block(&id);
    let task = tokio::spawn(async move {
        loop {
            let p = next_publish(&mut eventloop).await;
            let heard = match envelope::decode(&p.payload).map(flotilla_protocol::device::plain) {
                Ok(Message::Report(r)) => Heard::Report(r),
                Ok(Message::State(s)) => Heard::State(s),
                Ok(Message::Fetch(req)) => {
                    let Some((_, data)) = served.iter().find(|(sha, _)| *sha == req.sha256) else {
                        continue;
                    };
                    let reply = BlockReply::Data {
                        sha256: req.sha256,
                        offset: req.offset,
                        data: common::block(data, &req),
                    };
                    send_block(&replier, block_topic.clone(), reply);
                    continue;
                }
                _ => continue,
            };
            let _ = tx.send(heard).await;
        }
    });
    StandIn {
        client,
        heard,
        task,
        max_seq: 0,
    }
}

impl StandIn {
    /// Replaces the retained desired action.
    async fn desire(&self, desired: SignedBlob) {
        let id = DeviceId::new(DEVICE).expect("device id");
        set_desired(&self.client, &id, desired).await;
    }

    /// Waits for the final report of `action_id`.
    async fn final_report(&mut self, action_id: &str) -> Report {
        let wait = async {
            loop {
                match self.heard.recv().await {
                    Some(Heard::Report(r)) => {
                        self.max_seq = self.max_seq.max(r.seq);
                        if r.action_id == action_id && r.phase.is_terminal() {
                            return r;
                        }
                    }
                    Some(_) => {}
                    None => panic!("the stand-in stopped"),
                }
            }
        };
        tokio::time::timeout(TIMEOUT, wait)
            .await
            .unwrap_or_else(|_| panic!("no final report of {action_id} within 30s"))
    }

    /// After a restart at `started` (Unix seconds): waits for a final report of `action_id`
    /// made by this run, then for a state the device published after it saying no action runs
    /// any more (so whatever else it resumed has ended too). Returns every report this run
    /// made, in order; the last one of `action_id` is its reconcile.
    async fn settled(&mut self, action_id: &str, started: u64) -> Vec<Report> {
        let mut reports = Vec::new();
        let mut reconciled = false;
        let wait = async {
            loop {
                match self.heard.recv().await {
                    // Reports the outbox sends again were made before this run.
                    Some(Heard::Report(r)) if r.at >= started => {
                        self.max_seq = self.max_seq.max(r.seq);
                        reconciled |= r.action_id == action_id && r.phase.is_terminal();
                        reports.push(r);
                    }
                    Some(Heard::State(s)) if reconciled && s.online && s.at >= started => {
                        if s.current.as_ref().is_none_or(|c| c.phase.is_terminal()) {
                            return;
                        }
                    }
                    Some(_) => {}
                    None => panic!("the stand-in stopped"),
                }
            }
        };
        let done = tokio::time::timeout(TIMEOUT, wait).await;
        assert!(
            done.is_ok(),
            "no final report of {action_id} and no idle device within 30s; reports: {reports:#?}"
        );
        reports
    }
}

fn write_config(work: &Path, text: &str) -> PathBuf {
    let path = work.join("agent.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

/// Starts the agent binary, with `FLOTILLA_FAULT` set to `fault` if given.
fn spawn_agent(config: &Path, fault: Option<&str>) -> tokio::process::Child {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla-agent"));
    command
        .args(["run", "--config"])
        .arg(config)
        .env_remove(flotilla_agent::fault::FAULT_VAR)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    if let Some(point) = fault {
        command.env(flotilla_agent::fault::FAULT_VAR, point);
    }
    command.spawn().expect("start agent")
}

async fn kill(mut agent: tokio::process::Child) {
    agent.start_kill().expect("kill -9");
    let _ = agent.wait().await;
}

/// Copies a directory tree.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("list") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

/// Every file under `dir`, depth first.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("list") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            out.extend(files(&path));
        } else {
            out.push(path);
        }
    }
    out.sort();
    out
}

fn installed_counter(work: &Path) -> String {
    let trust = std::fs::read_to_string(work.join("agent-data/trust")).expect("trust file");
    trust
        .lines()
        .find(|l| l.starts_with("installed_counter = "))
        .unwrap_or_default()
        .to_owned()
}

fn now() -> u64 {
    common::now()
}

/// The finding itself: the device runs release 12 (its trust file says `installed_counter =
/// 12`) and its database goes back to the moment an action of release 2 was verified, ready to
/// stage. Restarted,
/// the agent fails that action with the reason, installs nothing, and reports; the retained
/// action of release 12 is reported failed with the database's state named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_action_from_a_database_gone_back_fails_and_installs_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).expect("mkdir");
    let dest = work.join("app.bin");
    std::fs::write(&dest, b"factory").expect("write");
    let config = write_config(&work, &agent_config_text(broker.port, &work));
    let mut coordinator = stand_in(broker.port, "test-coordinator-12", install(2), &[2, 12]).await;

    // Release 2 is downloaded and verified, and the database of that moment is kept.
    let status = tokio::time::timeout(TIMEOUT, spawn_agent(&config, Some("after-verified")).wait())
        .await
        .expect("the agent stops at its fault point within 30s")
        .expect("wait");
    assert!(
        !status.success(),
        "the agent aborted once release 2 was verified"
    );
    let db = work.join("agent-data/db");
    copy_tree(&db, &dir.path().join("db-verified"));

    // Release 2 finishes, then release 12 is installed.
    let agent = spawn_agent(&config, None);
    assert_eq!(coordinator.final_report("act-2").await.phase, Phase::Ready);
    assert_eq!(running(&work), "release 2");
    coordinator.desire(install(12)).await;
    assert_eq!(coordinator.final_report("act-12").await.phase, Phase::Ready);
    assert_eq!(running(&work), "release 12");
    assert_eq!(installed_counter(&work), "installed_counter = 12");
    kill(agent).await;

    // The database goes back to release 2 verified: what sled's recovery makes of a damaged
    // log.
    std::fs::remove_dir_all(&db).expect("remove");
    copy_tree(&dir.path().join("db-verified"), &db);
    let started = now();
    let seen = coordinator.max_seq;
    let agent = spawn_agent(&config, None);
    let reports = coordinator.settled("act-12", started).await;
    // A coordinator drops a report whose number it has seen: the reports made now continue
    // above every number used before, though the database's counter went back.
    for r in reports.iter().filter(|r| r.phase.is_terminal()) {
        assert!(r.seq > seen, "{r:?} reuses a number up to {seen}");
    }

    assert_eq!(running(&work), "release 12", "release 12 stays installed");
    // The outbox of that moment sends act-2's reports up to verified again; beside them only
    // the failure, which names why.
    let failure = "stored action act-2 (state verified) was not resumed: its release counter 2 is \
                   below the installed 12: the record is older than what this device runs; no \
                   target was touched";
    let old: Vec<&Phase> = reports
        .iter()
        .filter(|r| r.action_id == "act-2")
        .map(|r| &r.phase)
        .collect();
    assert!(
        old.iter().any(|p| matches!(
            p,
            Phase::Failed { reason, rolled_back: false } if reason == failure
        )),
        "act-2 must be reported failed, naming why: {old:#?}"
    );
    assert!(
        old.iter().all(|p| matches!(
            p,
            Phase::Accepted | Phase::Downloading { .. } | Phase::Verified | Phase::Failed { .. }
        ) && !matches!(p, Phase::Failed { reason, .. } if reason != failure)),
        "act-2 went no further than verified: {old:#?}"
    );
    let Some(Report {
        phase: Phase::Failed { reason, .. },
        ..
    }) = reports.iter().rfind(|r| r.action_id == "act-12")
    else {
        panic!("act-12 must be reported failed: {reports:#?}");
    };
    assert!(
        reason.contains("is behind the trust file (installed counter 0 against 12"),
        "{reason}"
    );
    assert!(
        reason.ends_with(
            "this action cannot be resumed: release counter 12 is not higher than installed 12"
        ),
        "{reason}"
    );
    assert_eq!(installed_counter(&work), "installed_counter = 12");
    kill(agent).await;
    let status = flotilla_agent::status(&flotilla_agent::Config::load(&config).expect("config"))
        .expect("status");
    assert!(
        status.contains("last error: database ") && status.contains("is behind the trust file"),
        "{status}"
    );
}

/// The record of an action and the current action's pointer are written one after the other,
/// and a log cut between them leaves an unfinished action that is not the current one. When its
/// desired action arrives again it is verified and goes on, rather than being re-reported in a
/// phase it never leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_action_that_is_not_the_current_one_goes_on_when_it_arrives_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).expect("mkdir");
    std::fs::write(work.join("app.bin"), b"factory").expect("write");
    let config = write_config(&work, &agent_config_text(broker.port, &work));
    let mut coordinator =
        stand_in(broker.port, "test-coordinator-aside", install(1), &[1, 2]).await;
    let agent = spawn_agent(&config, None);
    assert_eq!(coordinator.final_report("act-1").await.phase, Phase::Ready);
    kill(agent).await;

    // Action 2 recorded as accepted, while the current action is still action 1.
    let second = install(2);
    {
        let (store, _) =
            flotilla_agent::store::Store::open(&work.join("agent-data"), 1 << 20, now())
                .expect("open the database");
        let action: flotilla_protocol::DesiredAction =
            envelope::from_bytes("desired action", &second.payload).expect("decode");
        let manifest = action.body.install().map(|i| {
            envelope::from_bytes("release manifest", &i.manifest.payload).expect("decode")
        });
        store
            .save_action_aside(&flotilla_agent::record::ActionRecord {
                action_id: action.action_id.clone(),
                rollout_id: action.rollout_id.clone(),
                manifest,
                state: flotilla_agent::record::State::Accepted,
                action,
                signed: Some(second.clone()),
            })
            .expect("save");
    }
    coordinator.desire(second).await;
    let agent = spawn_agent(&config, None);
    assert_eq!(coordinator.final_report("act-2").await.phase, Phase::Ready);
    assert_eq!(running(&work), "release 2");
    kill(agent).await;
}

/// A small generator (splitmix64): the same flips for the same seed.
struct Flips(u64);

impl Flips {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Flips bits at random offsets in the files of `db`, 1 to 100 bytes in each: in every file
    /// but `conf` each time, and in `conf` one seed in four (sled refuses a damaged `conf`
    /// outright and the database is moved aside, which would leave no seed for its log).
    /// Returns how many bytes were flipped in which file.
    fn damage(&mut self, db: &Path) -> Vec<(String, usize)> {
        let mut done = Vec::new();
        for file in files(db) {
            let mut bytes = std::fs::read(&file).expect("read");
            if bytes.is_empty() || (file.ends_with("conf") && !self.next().is_multiple_of(4)) {
                continue;
            }
            let count = [1, 1, 2, 3, 5, 10, 30, 100][(self.next() % 8) as usize];
            for _ in 0..count {
                let at = (self.next() % bytes.len() as u64) as usize;
                bytes[at] ^= 1 << (self.next() % 8);
            }
            std::fs::write(&file, bytes).expect("write");
            let name = file.strip_prefix(db).unwrap_or(&file).display().to_string();
            done.push((name, count));
        }
        done
    }
}

/// Bit flips at random offsets in every file of the agent's database, over many seeds: the
/// restarted agent always reports the retained action (its phase again, or failed with a
/// reason), and the device never ends on a release older than the one it had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bit_flips_in_the_database_never_bring_back_an_older_release() {
    const SEEDS: u64 = 32;
    const LATEST: u64 = 4;
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).expect("mkdir");
    std::fs::write(work.join("app.bin"), b"factory").expect("write");
    let config = write_config(&work, &agent_config_text(broker.port, &work));
    let counters: Vec<u64> = (1..=LATEST).collect();

    // A history: releases 1 to 4 installed one after the other, every state of each in the log.
    let mut latest = install(1);
    let mut coordinator = stand_in(
        broker.port,
        "test-coordinator-history",
        latest.clone(),
        &counters,
    )
    .await;
    let agent = spawn_agent(&config, None);
    for counter in 1..=LATEST {
        if counter > 1 {
            latest = install(counter);
            coordinator.desire(latest.clone()).await;
        }
        let done = coordinator.final_report(&format!("act-{counter}")).await;
        assert_eq!(done.phase, Phase::Ready, "release {counter}");
    }
    kill(agent).await;
    drop(coordinator);
    let snapshot = dir.path().join("snapshot");
    copy_tree(&work, &snapshot);
    // Reports of this run are told from those the outbox sends again by their time.
    tokio::time::sleep(Duration::from_millis(1100)).await;

    let latest_action = format!("act-{LATEST}");
    for seed in 0..SEEDS {
        std::fs::remove_dir_all(&work).expect("remove");
        copy_tree(&snapshot, &work);
        let mut flips = Flips(seed);
        let damage = flips.damage(&work.join("agent-data/db"));
        let mut coordinator = stand_in(
            broker.port,
            &format!("test-coordinator-seed-{seed}"),
            latest.clone(),
            &counters,
        )
        .await;
        let started = now();
        let mut agent = spawn_agent(&config, None);
        let reports = tokio::select! {
            reports = coordinator.settled(&latest_action, started) => reports,
            status = agent.wait() => panic!("seed {seed} ({damage:?}): the agent exited ({status:?})"),
        };
        assert_eq!(
            running(&work),
            format!("release {LATEST}"),
            "seed {seed} ({damage:?}): the device must stay on release {LATEST}: {reports:#?}"
        );
        let reconcile = reports
            .iter()
            .rfind(|r| r.action_id == latest_action)
            .map(|r| r.phase.clone());
        match &reconcile {
            Some(Phase::Ready) => {}
            Some(Phase::Failed { reason, .. }) if !reason.is_empty() => {}
            other => panic!("seed {seed} ({damage:?}): reconciled as {other:?}: {reports:#?}"),
        }
        for r in &reports {
            if let Phase::Failed { reason, .. } = &r.phase {
                assert!(
                    !reason.is_empty(),
                    "seed {seed}: a failure names its reason"
                );
            }
        }
        assert_eq!(
            installed_counter(&work),
            format!("installed_counter = {LATEST}"),
            "seed {seed}"
        );
        kill(agent).await;
        let others: Vec<String> = reports
            .iter()
            .filter(|r| r.action_id != latest_action && r.phase.is_terminal())
            .map(|r| format!("{} {}", r.action_id, r.phase.name()))
            .collect();
        eprintln!("seed {seed}: {damage:?}: {reconcile:?}; also {others:?}");
    }
}
