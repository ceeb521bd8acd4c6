//! End to end: operator commands and error actions do exactly what they say, with a real
//! coordinator, Mosquitto and real agents (issue 11). An agent is held past activation by a
//! slow health check (its soak time): from there it ignores a cancel and finishes on the new
//! release, and the coordinator must say so, or send it back.

use std::fs;
use std::time::Duration;

use flotilla_protocol::control::{GroupStatus, RolloutStatus};
use flotilla_tests::{AgentOptions, BrokerKind, Site, WAIT};

const FIRMWARE: &[u8] = b"firmware 2.0\n";
const OLD: &[u8] = b"factory firmware\n";

/// An agent of a site: id, labels, options.
type Agent<'a> = (&'a str, &'a [(&'a str, &'a str)], AgentOptions);

/// A site on Mosquitto with release fw-2 and the given agents.
async fn site(agents: &[Agent<'_>]) -> Site {
    let mut site = Site::new(BrokerKind::Mosquitto);
    site.release("fw-2", 2, FIRMWARE);
    site.start_coordinator();
    for (id, labels, options) in agents {
        site.add_agent(id, labels, options.clone());
    }
    site.wait_devices(agents.len()).await;
    site
}

/// Held in `confirming` (past activation) for this long.
fn slow(soak: &'static str) -> AgentOptions {
    AgentOptions {
        soak,
        ..AgentOptions::default()
    }
}

fn unhealthy() -> AgentOptions {
    AgentOptions {
        healthy: false,
        ..AgentOptions::default()
    }
}

fn phase<'a>(status: &'a RolloutStatus, device: &str) -> &'a str {
    status
        .groups
        .iter()
        .find_map(|g| g.devices.get(device))
        .map_or("", String::as_str)
}

fn traced(status: &RolloutStatus, text: &str) -> bool {
    status.trace.iter().any(|t| t.message.contains(text))
}

fn trace_text(status: &RolloutStatus) -> String {
    status
        .trace
        .iter()
        .map(|t| t.message.as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

fn assert_adds_up(status: &RolloutStatus) {
    for g in &status.groups {
        let GroupStatus {
            ready,
            failed,
            in_progress,
            scheduled,
            canceled,
            total,
            ..
        } = g;
        assert_eq!(
            ready + failed + in_progress + scheduled + canceled,
            *total,
            "group {} does not add up: {g:#?}",
            g.name
        );
    }
}

fn write_spec(site: &Site, name: &str, text: &str) -> String {
    let path = site.path(&format!("{name}.toml"));
    fs::write(&path, text).expect("write spec");
    path.to_string_lossy().into_owned()
}

/// Runs the CLI expecting it to fail; its stderr.
fn refused(site: &Site, args: &[&str]) -> String {
    let out = site.flotilla_output(args);
    assert!(
        !out.status.success(),
        "flotilla {args:?} should have failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

async fn wait_phase(site: &Site, rollout: &str, device: &str, want: &str) -> RolloutStatus {
    site.wait_status(rollout, &format!("{device} to be {want}"), WAIT, |s| {
        phase(s, device) == want
    })
    .await
}

/// Item 1: the rollback error action reaches a device that was past activation when it fired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_sends_back_a_device_that_was_past_activation() {
    let site = site(&[
        ("slow", &[("role", "slow")], slow("20s")),
        ("bad", &[("role", "bad")], unhealthy()),
    ])
    .await;
    site.create_and_start(
        r#"
name = "rb"
release = "fw-2"
[groups]
error = { count = 1, action = "rollback" }
[[groups.group]]
name = "first"
select = "role=slow"
[[groups.group]]
name = "second"
select = "role=bad"
"#,
    )
    .await;
    wait_phase(&site, "rb", "slow", "confirming").await;
    site.flotilla(&["rollout", "next", "rb"]);
    let status = site
        .wait_status("rb", "the rollback", WAIT, |s| s.state == "failed")
        .await;
    assert!(
        traced(
            &status,
            "the 1 device past activation is sent back when it finishes"
        ),
        "{}",
        trace_text(&status)
    );
    assert_ne!(phase(&status, "slow"), "canceled", "it cannot be canceled");
    // It finishes on the bad release, then goes back to the one it kept.
    let status = wait_phase(&site, "rb", "slow", "rolled_back").await;
    assert!(
        traced(
            &status,
            "device slow in group first finished on release fw-2"
        ),
        "{}",
        trace_text(&status)
    );
    assert_eq!(fs::read(site.target_file("slow")).expect("read"), OLD);
    assert_adds_up(&status);
}

/// Item 2: stop says what becomes of every device; nothing stays "running" for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_reports_a_device_past_activation_as_finishing_on_the_new_release() {
    let site = site(&[
        ("slow", &[("role", "slow")], slow("15s")),
        ("later", &[("role", "later")], AgentOptions::default()),
    ])
    .await;
    site.create_and_start(
        r#"
name = "st"
release = "fw-2"
[[groups.group]]
name = "first"
select = "role=slow"
[[groups.group]]
name = "second"
select = "role=later"
"#,
    )
    .await;
    wait_phase(&site, "st", "slow", "confirming").await;
    let out = site.flotilla(&["rollout", "stop", "st"]);
    assert!(
        out.contains(
            "stopped by admin; 1 device not started stays as it is, 1 device past activation cannot be canceled and finishes on release fw-2"
        ),
        "{out}"
    );
    let status = site.status("st").await.expect("status");
    assert_eq!(status.groups[1].canceled, 1);
    assert_adds_up(&status);
    let status = wait_phase(&site, "st", "slow", "ready").await;
    assert!(
        traced(
            &status,
            "device slow in group first finished on release fw-2 (it was past activation when the rollout ended); it counts as ready"
        ),
        "{}",
        trace_text(&status)
    );
    assert_eq!(status.state, "stopped");
    assert!(
        status.groups.iter().all(|g| g.in_progress == 0),
        "{status:#?}"
    );
    assert_eq!(status.groups[0].state, "finished");
    assert_adds_up(&status);
    assert_eq!(fs::read(site.target_file("slow")).expect("read"), FIRMWARE);
    assert_eq!(fs::read(site.target_file("later")).expect("read"), OLD);
}

/// Item 3 (and 9, the waiting line): `next` never slips past an approval without the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn next_refuses_at_approvals_and_skips_them_only_when_told() {
    let site = site(&[
        ("a1", &[("stage", "a")], AgentOptions::default()),
        ("b1", &[("stage", "b")], AgentOptions::default()),
        ("c1", &[("stage", "c")], slow("20s")),
    ])
    .await;
    site.create_and_start(
        r#"
name = "nx"
release = "fw-2"
[[staged.stage]]
name = "a"
select = "stage=a"
after = { approval = true }
[[staged.stage]]
name = "b"
select = "stage=b"
before = { approval = true }
[[staged.stage]]
name = "c"
select = "stage=c"
"#,
    )
    .await;
    site.wait_status("nx", "stage a to wait for its approval", WAIT, |s| {
        s.groups[0].state == "waiting"
    })
    .await;
    let err = refused(&site, &["rollout", "next", "nx"]);
    assert!(
        err.contains("group b starts only after approval nx-a, which is pending")
            && err.contains("--skip-approval"),
        "{err}"
    );
    // Paused, it no longer claims to wait for the approval.
    site.flotilla(&["rollout", "pause", "nx"]);
    let status = site.status("nx").await.expect("status");
    assert_eq!(status.waiting, None, "{status:#?}");
    site.flotilla(&["rollout", "resume", "nx"]);
    site.flotilla(&["approve", "nx-a"]);
    site.wait_status("nx", "stage b to wait for its approval", WAIT, |s| {
        s.groups[1].state == "approval"
    })
    .await;
    let err = refused(&site, &["rollout", "next", "nx"]);
    assert!(
        err.contains("group b is the next group and waits for approval nx-before-b"),
        "{err}"
    );
    let status = site.status("nx").await.expect("status");
    assert_eq!(status.groups[1].state, "approval", "nothing started");
    assert_eq!(status.groups[2].state, "scheduled");
    site.flotilla(&["rollout", "next", "nx", "--skip-approval"]);
    let status = wait_phase(&site, "nx", "c1", "confirming").await;
    assert!(
        traced(
            &status,
            "approval nx-before-b given by admin via next (--skip-approval)"
        ),
        "{}",
        trace_text(&status)
    );
    // c started behind b's health gate, not with b.
    let at = |text: &str| {
        status
            .trace
            .iter()
            .position(|t| t.message.starts_with(text))
            .unwrap_or_else(|| panic!("no {text:?} in\n{}", trace_text(&status)))
    };
    assert!(at("group b started") < at("group b succeeded"));
    assert!(at("group b succeeded") < at("group c started"));
    assert!(status.approvals.iter().all(|a| a.approved), "{status:#?}");
    let err = refused(&site, &["rollout", "next", "nx"]);
    assert!(
        err.contains(
            "every group has started (the last, c, is running); there is no next group to start"
        ),
        "{err}"
    );
}

/// Denying an approval stops the rollout there; the trace and `flotilla approvals` say who
/// and why, and the approval can no longer be given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_approval_stops_the_rollout_and_says_who_and_why() {
    let site = site(&[
        ("a1", &[("stage", "a")], AgentOptions::default()),
        ("b1", &[("stage", "b")], AgentOptions::default()),
    ])
    .await;
    site.create_and_start(
        r#"
name = "dn"
release = "fw-2"
[[staged.stage]]
name = "a"
select = "stage=a"
after = { approval = true }
[[staged.stage]]
name = "b"
select = "stage=b"
"#,
    )
    .await;
    site.wait_status("dn", "stage a to wait for its approval", WAIT, |s| {
        s.groups[0].state == "waiting"
    })
    .await;
    let said = site.flotilla(&["deny", "dn-a", "--reason", "the canary reboots in a loop"]);
    assert!(said.contains("denied dn-a"), "{said}");
    let status = site.status("dn").await.expect("status");
    assert_eq!(status.state, "stopped", "{status:#?}");
    assert!(
        traced(
            &status,
            "approval dn-a denied by admin: the canary reboots in a loop"
        ),
        "{}",
        trace_text(&status)
    );
    assert_ne!(phase(&status, "b1"), "ready", "{status:#?}");
    assert_ne!(status.groups[1].state, "running", "{status:#?}");
    let listed = site.flotilla(&["approvals"]);
    assert!(
        listed.contains("denied") && listed.contains("admin: the canary reboots in a loop"),
        "{listed}"
    );
    let err = refused(&site, &["approve", "dn-a"]);
    assert!(err.contains("was denied by admin"), "{err}");
    // An ended rollout can be deleted, with its approvals; its name is free again.
    let said = site.flotilla(&["rollout", "delete", "dn"]);
    assert!(said.contains("deleted rollout dn"), "{said}");
    assert!(site.status("dn").await.is_none(), "gone");
    let listed = site.flotilla(&["approvals"]);
    assert!(!listed.contains("dn-a"), "{listed}");
}

/// Item 4: two gates that would share a name are refused, naming both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colliding_approval_names_are_refused_naming_both_stages() {
    let site = site(&[
        ("p1", &[("stage", "before-prod")], AgentOptions::default()),
        ("p2", &[("stage", "prod")], AgentOptions::default()),
    ])
    .await;
    let spec = write_spec(
        &site,
        "r",
        r#"
name = "r"
release = "fw-2"
[[staged.stage]]
name = "before-prod"
select = "stage=before-prod"
after = { approval = true }
[[staged.stage]]
name = "prod"
select = "stage=prod"
before = { approval = true }
"#,
    );
    let err = refused(&site, &["rollout", "create", "--spec", &spec]);
    assert!(
        err.contains("the approval after group before-prod of rollout r and the approval before group prod of rollout r would both be named r-before-prod"),
        "{err}"
    );
    assert!(site.status("r").await.is_none(), "nothing was created");
}

/// Item 7: deleting a device stops its action; it never installs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_device_cancels_its_action() {
    let mut site = Site::new(BrokerKind::Mosquitto);
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    site.release("fw-2", 2, &big);
    site.start_coordinator();
    site.add_agent(
        "dl",
        &[],
        AgentOptions {
            max_bytes_per_sec: 4000,
            block_size: 1024,
            ..AgentOptions::default()
        },
    );
    site.wait_devices(1).await;
    site.create_and_start("name = \"del\"\nrelease = \"fw-2\"\n[groups]\ncount = 1\n")
        .await;
    wait_phase(&site, "del", "dl", "downloading").await;
    site.flotilla(&["devices", "delete", "dl"]);
    // The agent stops and says so when it announces itself again.
    let client = site.client().await;
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let devices = client
            .request(
                flotilla_protocol::control::Command::ListDevices {
                    page: Default::default(),
                },
                Duration::from_secs(5),
            )
            .await
            .expect("devices");
        let devices: Vec<flotilla_protocol::control::DeviceSummary> =
            serde_json::from_value(devices).expect("device list");
        if devices
            .iter()
            .any(|d| d.id == "dl" && d.phase.as_deref() == Some("canceled"))
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the deleted device never reported its action canceled: {devices:#?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(fs::read(site.target_file("dl")).expect("read"), OLD);
    let status = site.status("del").await.expect("status");
    assert!(
        traced(
            &status,
            "device dl deleted by admin; its action was canceled"
        ),
        "{}",
        trace_text(&status)
    );
}

/// Item 8: a retry keeps the stage's approval gate and counts attempts on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_of_a_staged_rollout_keeps_its_approval_and_counts_attempts_on() {
    let site = site(&[
        ("good", &[("stage", "canary")], AgentOptions::default()),
        ("bad", &[("stage", "canary")], unhealthy()),
    ])
    .await;
    site.create_and_start(
        r#"
name = "rt"
release = "fw-2"
[[staged.stage]]
name = "canary"
select = "stage=canary"
before = { approval = true }
"#,
    )
    .await;
    site.flotilla(&["approve", "rt-before-canary"]);
    site.wait_ended("rt").await;
    site.flotilla(&["rollout", "retry", "rt"]);
    site.flotilla(&["rollout", "start", "rt-retry"]);
    let status = site
        .wait_status(
            "rt-retry",
            "the retry to wait for its approval",
            WAIT,
            |s| s.groups[0].state == "approval",
        )
        .await;
    assert_eq!(status.groups[0].name, "canary");
    assert_eq!(status.groups[0].devices.keys().collect::<Vec<_>>(), ["bad"]);
    assert!(status
        .approvals
        .iter()
        .any(|a| a.name == "rt-retry-before-canary" && !a.approved));
    site.flotilla(&["approve", "rt-retry-before-canary"]);
    let status = site.wait_ended("rt-retry").await;
    assert_eq!(status.groups[0].device_details["bad"].attempt, 2);
}

/// Item 9: a run resumed past a failed group does not claim success; a timed-out device that
/// reports ready later clears its group's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn summaries_stay_true_after_resume_and_late_readiness() {
    let site = site(&[
        ("bad", &[("grp", "one")], unhealthy()),
        ("two", &[("grp", "two")], AgentOptions::default()),
        ("late", &[("grp", "late")], slow("10s")),
    ])
    .await;
    site.create_and_start(
        r#"
name = "rs"
release = "fw-2"
select = "grp in (one, two)"
[groups]
error = { count = 1, action = "pause" }
[[groups.group]]
name = "one"
select = "grp=one"
[[groups.group]]
name = "two"
select = "grp=two"
"#,
    )
    .await;
    let status = site.wait_ended("rs").await;
    assert_eq!(status.state, "paused");
    site.flotilla(&["rollout", "resume", "rs"]);
    let status = site
        .wait_status("rs", "the run to finish", WAIT, |s| s.state == "finished")
        .await;
    assert!(
        status
            .conditions
            .iter()
            .any(|c| c.kind == "Succeeded" && !c.status),
        "{:#?}",
        status.conditions
    );
    assert!(
        traced(&status, "not succeeded: group one ended in error"),
        "{}",
        trace_text(&status)
    );

    site.create_and_start(
        r#"
name = "to"
release = "fw-2"
select = "grp=late"
timeout = "2s"
[groups]
count = 1
error = { count = 1, action = "pause" }
"#,
    )
    .await;
    let status = site
        .wait_status("to", "the device to time out", WAIT, |s| {
            phase(s, "late") == "timed_out"
        })
        .await;
    assert_eq!(status.groups[0].state, "error");
    let status = wait_phase(&site, "to", "late", "ready").await;
    assert_ne!(status.groups[0].state, "error", "{status:#?}");
    assert_eq!(status.groups[0].ready, 1);
    assert!(
        traced(&status, "group group-1 is no longer in error"),
        "{}",
        trace_text(&status)
    );
}

/// `rollout start --wait` follows a rollout whose devices fail to its end and exits with it: 3
/// for failed. Its bar shows the failures as `x`, never as a full bar of `#`; the trace says
/// "1 group"; `rollout list` has it on one line; `--watch` on an ended rollout exits at once
/// with the same code; and starting it again is refused in plain words.
#[tokio::test]
async fn waiting_on_a_failing_rollout_exits_3_and_draws_its_failures() {
    let site = site(&[("wf1", &[], unhealthy()), ("wf2", &[], unhealthy())]).await;
    let spec = write_spec(
        &site,
        "wf",
        "name = \"wf\"\nrelease = \"fw-2\"\n[groups]\ncount = 1\n\
         error = { count = 1, action = \"stop\" }\n",
    );
    site.flotilla(&["rollout", "create", "--spec", &spec]);
    let out = site.flotilla_output(&["rollout", "start", "wf", "--wait"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = text.rsplit("rollout wf ").next().unwrap_or_default();
    assert!(last.contains("state failed"), "{text}");
    let bar = last
        .lines()
        .find(|l| l.trim_start().starts_with("group-1"))
        .unwrap_or_else(|| panic!("no group line in:\n{text}"));
    assert!(bar.contains('x') && !bar.contains(&"#".repeat(30)), "{bar}");
    let status = site.status("wf").await.expect("status");
    assert!(
        traced(&status, "2 devices in 1 group ("),
        "{}",
        trace_text(&status)
    );
    assert!(!text.contains('\x1b'), "no colour in a pipe: {text}");

    let out = site.flotilla_output(&["rollout", "status", "wf", "--watch"]);
    assert_eq!(out.status.code(), Some(3));
    // `--json` keeps Unix seconds and adds each time's RFC 3339 text.
    let json: serde_json::Value =
        serde_json::from_str(&site.flotilla(&["rollout", "status", "wf", "--json"]))
            .expect("status JSON");
    let first = &json["trace"][0];
    let text = first["at_rfc3339"].as_str().unwrap_or_default();
    assert!(
        first["at"].is_u64() && text.len() == 20 && text.ends_with('Z'),
        "{first}"
    );
    let list = site.flotilla(&["rollout", "list"]);
    let row = list
        .lines()
        .find(|l| l.starts_with("wf "))
        .unwrap_or_else(|| panic!("{list}"));
    assert!(row.contains(" failed ") && row.contains(" fw-2 "), "{list}");
    assert_eq!(
        site.flotilla(&["rollout", "status"]),
        list,
        "without a name, status is the list"
    );
    let err = refused(&site, &["rollout", "start", "wf"]);
    assert!(
        err.contains("rollout wf has failed; cannot start it"),
        "{err}"
    );
}
