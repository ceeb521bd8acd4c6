//! End-to-end: a KubeFleet-style staged update run through a real coordinator and real agents,
//! with a stored strategy, an after-stage approval with a timed wait, and a before-stage approval.

use std::fs;
use std::time::Duration;

use flotilla_protocol::control::{ApprovalStatus, Command as Control};
use flotilla_protocol::Topics;
use flotilla_tests::{AgentOptions, BrokerKind, Site, Watcher, WAIT};

const FIRMWARE: &[u8] = b"firmware 2.0 staged\n";
const OLD: &[u8] = b"factory firmware\n";

const STRATEGY: &str = r#"
[[stage]]
name = "canary"
select = "env=canary"
after = { approval = true, wait = "4s" }

[[stage]]
name = "production"
select = "env=production"
sort_by = "order"
max_concurrency = 1
before = { approval = true }
"#;

const RUN: &str = r#"
name = "run-1"
release = "fw-2"
[staged]
strategy = "two-stage"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_run_waits_for_approvals_and_its_timed_wait() {
    let mut site = Site::new(BrokerKind::Embedded);
    site.release("fw-2", 2, FIRMWARE);
    site.start_coordinator();
    site.add_agent("canary-1", &[("env", "canary")], AgentOptions::default());
    site.add_agent(
        "prod-a",
        &[("env", "production"), ("order", "2")],
        AgentOptions::default(),
    );
    site.add_agent(
        "prod-b",
        &[("env", "production"), ("order", "1")],
        AgentOptions::default(),
    );
    site.wait_devices(3).await;
    let approvals = Watcher::start(site.port, &[Topics::default().approval_events_filter()]).await;

    let strategy = site.path("two-stage.toml");
    fs::write(&strategy, STRATEGY).expect("write strategy");
    let out = site.flotilla(&[
        "strategy",
        "create",
        "two-stage",
        "--file",
        strategy.to_str().expect("utf-8 path"),
    ]);
    assert!(out.contains("two-stage"), "{out}");

    let created = site.create_and_start(RUN).await;
    assert_eq!(created.strategy, "staged");
    assert_eq!(
        created.groups[1].devices.keys().count(),
        2,
        "production has both production devices"
    );

    // The canary stage updates, then waits for its approval.
    let status = site
        .wait_status(
            "run-1",
            "the canary stage to wait for approval",
            WAIT,
            |s| s.groups[0].state == "waiting",
        )
        .await;
    assert_eq!(
        fs::read(site.target_file("canary-1")).expect("read"),
        FIRMWARE
    );
    assert_eq!(fs::read(site.target_file("prod-a")).expect("read"), OLD);
    let pending: Vec<&ApprovalStatus> = status.approvals.iter().filter(|a| !a.approved).collect();
    assert_eq!(pending.len(), 1, "{status:#?}");
    assert_eq!(pending[0].name, "run-1-canary");
    let waiting = status.waiting.clone().unwrap_or_default();
    assert!(
        waiting.contains("flotilla approve run-1-canary"),
        "{waiting}"
    );
    // The approval request is on the events topic for any MQTT client.
    let published = approvals
        .wait_until("the approval request event", Duration::from_secs(10), |w| {
            w.messages()
                .into_iter()
                .find(|m| m.topic.ends_with("/events/approvals/run-1-canary"))
        })
        .await;
    let request: ApprovalStatus =
        serde_json::from_slice(&published.payload).expect("approval JSON");
    assert!(!request.approved);
    assert_eq!(request.group, "canary");

    // Approve with the CLI; the timed wait still holds the next stage until it has passed.
    let out = site.flotilla(&["approve", "run-1-canary"]);
    assert!(out.contains("run-1-canary"), "{out}");
    let status = site
        .wait_status("run-1", "production to ask for its approval", WAIT, |s| {
            s.groups[1].state == "approval"
        })
        .await;
    let canary = &status.groups[0];
    let succeeded = canary
        .conditions
        .iter()
        .find(|c| c.kind == "Progressing" || c.kind == "Succeeded")
        .map(|c| c.at)
        .expect("canary conditions");
    let elapsed = canary
        .conditions
        .iter()
        .find(|c| c.kind == "WaitTimeElapsed")
        .expect("the wait elapsed");
    assert!(
        elapsed.at >= canary.started_at.expect("started") + 4,
        "the timed wait of 4s was kept: {:?} (succeeded around {succeeded})",
        canary.conditions
    );
    assert!(canary
        .conditions
        .iter()
        .any(|c| c.kind == "ApprovalRequestApproved" && c.status));
    assert_eq!(fs::read(site.target_file("prod-a")).expect("read"), OLD);

    // Approve the production stage through the control topic, as an integration would.
    let client = site.client().await;
    client
        .request(
            Control::Approve {
                name: "run-1-before-production".into(),
            },
            Duration::from_secs(10),
        )
        .await
        .expect("approved");
    let status = site
        .wait_status("run-1", "the run to succeed", WAIT, |s| {
            s.state == "finished"
        })
        .await;
    for id in ["canary-1", "prod-a", "prod-b"] {
        assert_eq!(
            fs::read(site.target_file(id)).expect("read"),
            FIRMWARE,
            "{id}"
        );
    }
    assert!(status
        .conditions
        .iter()
        .any(|c| c.kind == "Succeeded" && c.status));
    // sort_by order: prod-b (order 1) before prod-a (order 2), one at a time.
    let prod = &status.groups[1].device_details;
    let (a, b) = (&prod["prod-a"], &prod["prod-b"]);
    assert!(
        b.ended_at.expect("b ended") <= a.started_at.expect("a started"),
        "prod-b finished before prod-a started: {prod:?}"
    );
    let messages: Vec<String> = status.trace.iter().map(|t| t.message.clone()).collect();
    assert!(
        messages
            .iter()
            .any(|m| m.contains("approval run-1-canary approved")),
        "{messages:#?}"
    );
}
