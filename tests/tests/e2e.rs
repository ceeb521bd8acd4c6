//! End-to-end: a real coordinator process and real agent processes over real brokers.
//!
//! Each test builds its own site (broker on a free port, keys, release, processes) in a
//! temporary directory, so tests run in parallel and never depend on what runs on the machine.

use std::collections::BTreeSet;
use std::fs;
use std::time::Duration;

use flotilla_protocol::control::RolloutStatus;
use flotilla_protocol::{Phase, Topics};
use flotilla_tests::{broker_kinds, AgentOptions, BrokerKind, Site, Watcher, WAIT};

const NEW_FIRMWARE: &[u8] = b"firmware 2.0: faster, safer\n";

fn three_group_spec(name: &str, error_threshold: &str) -> String {
    format!(
        r#"
name = "{name}"
release = "fw-2"
[groups]
count = 3
success = {{ threshold = "100%", action = "next" }}
error = {{ threshold = "{error_threshold}", action = "pause" }}
"#
    )
}

fn group_started(status: &RolloutStatus, index: usize) -> bool {
    status
        .groups
        .get(index)
        .is_some_and(|g| g.state != "scheduled")
}

async fn fleet(kind: BrokerKind, n: usize, unhealthy: &[usize]) -> Site {
    let mut site = Site::new(kind);
    site.release("fw-2", 2, NEW_FIRMWARE);
    site.start_coordinator();
    for i in 1..=n {
        let options = AgentOptions {
            healthy: !unhealthy.contains(&i),
            ..AgentOptions::default()
        };
        site.add_agent(&format!("dev-{i:02}"), &[("env", "test")], options);
    }
    site.wait_devices(n).await;
    site
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollout_over_three_groups_reaches_every_device() {
    for kind in broker_kinds() {
        let site = fleet(kind, 6, &[]).await;
        let created = site
            .create_and_start(&three_group_spec("fw-rollout", "50%"))
            .await;
        assert_eq!(created.groups.len(), 3, "{kind:?}: three groups planned");
        let status = site
            .wait_status("fw-rollout", "the rollout to finish", WAIT, |s| {
                s.state == "finished"
            })
            .await;
        assert!(
            status
                .groups
                .iter()
                .all(|g| g.state == "finished" && g.ready == g.total),
            "{kind:?}: {status:#?}"
        );
        let devices: BTreeSet<&String> = status
            .groups
            .iter()
            .flat_map(|g| g.devices.keys())
            .collect();
        assert_eq!(devices.len(), 6, "{kind:?}: every device is in a group");
        for i in 1..=6 {
            let id = format!("dev-{i:02}");
            assert_eq!(
                fs::read(site.target_file(&id)).expect("target file"),
                NEW_FIRMWARE,
                "{kind:?}: {id}"
            );
        }
        let listed = site.flotilla(&["devices"]);
        assert!(
            listed.contains("dev-06") && listed.contains("fw-2"),
            "devices table: {listed}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_threshold_pauses_and_resume_continues() {
    // Two of the first group's two devices fail their health check: 100% > 50%.
    let site = fleet(BrokerKind::Embedded, 6, &[1, 2]).await;
    site.create_and_start(&three_group_spec("fw-guarded", "50%"))
        .await;
    let paused = site
        .wait_status("fw-guarded", "the rollout to pause", WAIT, |s| {
            s.state == "paused"
        })
        .await;
    assert_eq!(paused.groups[0].state, "error", "{paused:#?}");
    assert_eq!(paused.groups[0].failed, 2, "{paused:#?}");
    assert!(
        paused.trace.iter().any(|t| t.message.contains("2 of 2")),
        "trace names the numbers: {paused:#?}"
    );
    // The failed devices rolled back: the file is what it was before.
    assert_eq!(
        fs::read(site.target_file("dev-01")).expect("target"),
        b"factory firmware\n"
    );

    // Nothing more starts while paused.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let still = site.status("fw-guarded").await.expect("status");
    assert_eq!(still.state, "paused");
    assert!(
        !group_started(&still, 1),
        "next group must not start while paused: {still:#?}"
    );
    assert_eq!(
        fs::read(site.target_file("dev-03")).expect("target"),
        b"factory firmware\n"
    );

    site.flotilla(&["rollout", "resume", "fw-guarded"]);
    let done = site
        .wait_status("fw-guarded", "the resumed rollout to finish", WAIT, |s| {
            s.state == "finished"
        })
        .await;
    assert_eq!(done.groups[1].ready, done.groups[1].total, "{done:#?}");
    assert_eq!(done.groups[2].ready, done.groups[2].total, "{done:#?}");
    assert_eq!(
        fs::read(site.target_file("dev-06")).expect("target"),
        NEW_FIRMWARE
    );
    let table = site.flotilla(&["rollout", "status", "fw-guarded"]);
    assert!(table.contains("finished"), "status table: {table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_mid_download_resumes_without_refetching() {
    let mut site = Site::new(BrokerKind::Embedded);
    // 1 MiB at 256 KiB/s: about four seconds of download to interrupt.
    let artifact: Vec<u8> = (0..1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    site.release("fw-2", 2, &artifact);
    site.start_coordinator();
    let options = AgentOptions {
        max_bytes_per_sec: 256 * 1024,
        ..AgentOptions::default()
    };
    site.add_agent("dev-slow", &[("env", "test")], options);
    site.wait_devices(1).await;
    let topics = Topics::default();
    let watcher = Watcher::start(site.port, &[format!("{}/devices/+/#", topics.prefix())]).await;
    site.create_and_start(&three_group_spec("fw-resume", "50%").replace("count = 3", "count = 1"))
        .await;

    let done_before_kill = watcher
        .wait_until("download progress from dev-slow", WAIT, |w| {
            w.reports("dev-slow").iter().find_map(|r| match r.phase {
                Phase::Downloading { done, total } if done > 0 && done < total => Some(done),
                _ => None,
            })
        })
        .await;
    site.kill_agent("dev-slow");
    // The broker publishes the agent's last will; the coordinator shows the device offline.
    site.wait_online("dev-slow", false).await;
    watcher.clear();
    site.start_agent("dev-slow");

    let last = watcher.final_report("dev-slow", WAIT).await;
    assert_eq!(last.phase, Phase::Ready, "{last:?}");
    assert_eq!(
        fs::read(site.target_file("dev-slow")).expect("target"),
        artifact
    );
    let refetched: Vec<u64> = watcher
        .fetches("dev-slow")
        .iter()
        .map(|f| f.offset)
        .filter(|offset| *offset < done_before_kill)
        .collect();
    assert!(
        refetched.is_empty(),
        "blocks below {done_before_kill} fetched again: {refetched:?}"
    );
    assert!(
        !watcher.fetches("dev-slow").is_empty(),
        "the rest was fetched after the restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinator_killed_mid_rollout_finishes_without_restarting_groups() {
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-2", 2, NEW_FIRMWARE);
    site.start_coordinator();
    for i in 1..=6 {
        let options = AgentOptions {
            soak: "2s",
            ..AgentOptions::default()
        };
        site.add_agent(&format!("dev-{i:02}"), &[("env", "test")], options);
    }
    site.wait_devices(6).await;
    site.create_and_start(&three_group_spec("fw-restart", "50%"))
        .await;
    site.wait_status("fw-restart", "the second group to start", WAIT, |s| {
        group_started(s, 1)
    })
    .await;

    site.kill_coordinator();
    site.start_coordinator();

    let done = site
        .wait_status(
            "fw-restart",
            "the rollout to finish after the restart",
            WAIT,
            |s| s.state == "finished",
        )
        .await;
    assert!(done.groups.iter().all(|g| g.ready == g.total), "{done:#?}");
    for group in &done.groups {
        let starts = done
            .trace
            .iter()
            .filter(|t| {
                t.message
                    .starts_with(&format!("group {} started", group.name))
            })
            .count();
        assert_eq!(
            starts, 1,
            "group {} started {starts} times: {:#?}",
            group.name, done.trace
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_pause_holds_the_next_group_and_stop_is_final() {
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-2", 2, NEW_FIRMWARE);
    site.start_coordinator();
    for i in 1..=4 {
        let options = AgentOptions {
            soak: "3s",
            ..AgentOptions::default()
        };
        site.add_agent(&format!("dev-{i:02}"), &[("env", "test")], options);
    }
    site.wait_devices(4).await;
    let spec = site.path("spec.toml");
    fs::write(
        &spec,
        three_group_spec("fw-held", "50%").replace("count = 3", "count = 2"),
    )
    .expect("write spec");
    let created = site.flotilla(&["rollout", "create", "--spec", &spec.to_string_lossy()]);
    assert!(
        created.contains("fw-held"),
        "create prints the rollout: {created}"
    );
    site.flotilla(&["rollout", "start", "fw-held"]);
    site.flotilla(&["rollout", "pause", "fw-held"]);

    // The first group's devices finish their update, but the paused rollout starts nothing new.
    let paused = site
        .wait_status(
            "fw-held",
            "the first group to finish while paused",
            WAIT,
            |s| s.groups[0].ready == s.groups[0].total,
        )
        .await;
    assert_eq!(paused.state, "paused", "{paused:#?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let still = site.status("fw-held").await.expect("status");
    assert!(
        !group_started(&still, 1),
        "a paused rollout must not start the next group: {still:#?}"
    );
    let table = site.flotilla(&["rollout", "status", "fw-held"]);
    assert!(
        table.contains("paused") && table.contains("[#"),
        "status table with progress bars: {table}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&site.flotilla(&["rollout", "status", "fw-held", "--json"]))
            .expect("status --json");
    assert_eq!(json["state"], "paused", "{json}");

    site.flotilla(&["rollout", "stop", "fw-held"]);
    let stopped = site.status("fw-held").await.expect("status");
    assert_eq!(stopped.state, "stopped");
    let refused = site.flotilla_output(&["rollout", "resume", "fw-held"]);
    assert!(
        !refused.status.success(),
        "a stopped rollout cannot be resumed"
    );
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("stopped"),
        "{refused:?}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let last = site.status("fw-held").await.expect("status");
    assert!(!group_started(&last, 1), "{last:#?}");
    for id in ["dev-03", "dev-04"] {
        assert_eq!(
            fs::read(site.target_file(id)).expect("target"),
            b"factory firmware\n",
            "{id} untouched"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_spec_is_refused_with_the_field_named() {
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-2", 2, NEW_FIRMWARE);
    site.start_coordinator();
    site.add_agent("dev-01", &[("env", "test")], AgentOptions::default());
    site.wait_devices(1).await;
    let spec = site.path("broken.toml");
    fs::write(&spec, three_group_spec("fw-broken", "120%")).expect("write spec");
    let out = site.flotilla_output(&["rollout", "create", "--spec", &spec.to_string_lossy()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("groups.error.threshold") && stderr.contains("120%"),
        "{stderr}"
    );
    let unknown = site.flotilla_output(&["rollout", "start", "fw-nope"]);
    assert!(
        String::from_utf8_lossy(&unknown.stderr).contains("fw-nope"),
        "{unknown:?}"
    );
}
