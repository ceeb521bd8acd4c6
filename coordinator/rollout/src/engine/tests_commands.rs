//! Operator commands and error actions do what they say in every state (issue 11): stop and
//! rollback reach devices past activation, `next` never slips past an approval, approval names
//! never collide, a deleted device's action is canceled, a retry keeps its gates, and a
//! rollout's summary stays true.

use super::tests_features::{group, ids, pct, Bench, T0};
use super::*;
use crate::plan::{ErrorAction, ErrorCondition, Retry};

fn progress(name: &str) -> Phase {
    match name {
        "activated" => Phase::Activated,
        "confirming" => Phase::Confirming,
        "staged" => Phase::Staged,
        _ => Phase::Downloading { done: 1, total: 2 },
    }
}

/// Every group's counters add up to its devices, and the status says the same.
fn assert_counts_add_up(b: &Bench, name: &str) {
    let r = b.rollout(name);
    for (g, gs) in r.groups.iter().zip(r.status().groups) {
        let c = g.counts;
        let sum = c.scheduled
            + c.in_progress
            + c.soaking
            + c.ready
            + c.failures()
            + c.canceled
            + c.skipped;
        assert_eq!(sum, c.total, "group {} counts {c:?}", g.name);
        assert_eq!(
            gs.ready + gs.failed + gs.in_progress + gs.scheduled + gs.canceled,
            gs.total,
            "group {} status {gs:?}",
            g.name
        );
    }
}

fn rollback_on_first_failure() -> Option<ErrorCondition> {
    Some(ErrorCondition {
        percent: Some(pct(20)),
        action: ErrorAction::Rollback,
        ..ErrorCondition::default()
    })
}

#[test]
fn rollback_reaches_devices_past_activation_and_late_finishers() {
    let mut b = Bench::new(4);
    let mut g = group("g", ids(0..4));
    g.error = rollback_on_first_failure();
    b.create("rb", vec![g], |_| {});
    b.start("rb");
    b.ready(&ids(0..1));
    b.report("d001", progress("activated"));
    b.report("d002", progress("staged"));
    b.fail("d003");
    let r = b.rollout("rb");
    assert_eq!(r.state, RolloutState::Failed);
    assert_eq!(
        b.canceled,
        vec!["d002"],
        "only the device before activation"
    );
    assert_eq!(b.rollbacks.len(), 1, "the ready device goes back at once");
    assert!(b.has_trace(
        "rb",
        "the 1 device past activation is sent back when it finishes"
    ));
    assert_eq!(
        b.phase("rb", "d001"),
        "activated",
        "still running, not canceled"
    );
    // The device past activation finishes on the bad release: it gets a rollback.
    b.report("d001", Phase::Ready);
    assert_eq!(b.phase("rb", "d001"), "rolling_back");
    assert!(b.rollbacks.iter().any(|(d, _)| d == "d001"));
    // The device whose cancel came too late finishes too: never left on the bad release.
    b.report("d002", Phase::Ready);
    assert_eq!(b.phase("rb", "d002"), "rolling_back");
    assert!(b.has_trace("rb", "d002 in group g finished on release fw-2 (its cancel came after activation); sending it back"));
    for d in ["d000", "d001", "d002"] {
        b.report(d, Phase::Ready);
        assert_eq!(b.phase("rb", d), "rolled_back");
    }
    assert_counts_add_up(&b, "rb");
    let r = b.rollout("rb");
    assert_eq!(r.groups[0].counts.in_progress, 0);
    assert_eq!(r.groups[0].state, GroupState::Error);
}

#[test]
fn stop_says_what_becomes_of_every_device_and_nothing_runs_forever() {
    let mut b = Bench::new(6);
    b.create(
        "st",
        vec![group("g1", ids(0..4)), group("g2", ids(4..6))],
        |p| {
            p.soak = 600;
            p.timeout = Some(3600);
            p.retry = Some(Retry {
                attempts: 2,
                backoff: 60,
            });
        },
    );
    b.start("st");
    b.report("d000", Phase::Ready);
    b.report("d001", progress("confirming"));
    b.report("d002", progress("downloading"));
    b.fail("d003");
    assert_eq!(b.phase("st", "d003"), "retrying");
    let effects = b.engine.stop_by("st", "alice", T0 + 5).expect("stopped");
    b.take(effects);
    assert_eq!(b.canceled, vec!["d002"], "cancels only what can still stop");
    let last = b.trace("st").last().cloned().unwrap_or_default();
    assert_eq!(
        last,
        "stopped by alice; canceled 1 device action, 2 devices not started stay as they are, \
         1 device past activation cannot be canceled and finishes on release fw-2, \
         1 device soaking counts as ready on release fw-2, \
         1 device waiting for a retry counts as failed"
    );
    assert_eq!(b.phase("st", "d000"), "ready");
    assert_eq!(b.phase("st", "d003"), "failed");
    assert_eq!(b.rollout("st").groups[0].state, GroupState::Running);
    assert_counts_add_up(&b, "st");
    // It finishes on the new release and is reported as such; nothing is sent.
    let sent = b.sent.len();
    b.report("d001", Phase::Ready);
    assert_eq!(b.phase("st", "d001"), "ready");
    assert!(b.has_trace(
        "st",
        "device d001 in group g1 finished on release fw-2 (it was past activation when the rollout ended); it counts as ready"
    ));
    assert_eq!(b.sent.len(), sent);
    assert!(b.rollbacks.is_empty());
    let r = b.rollout("st");
    assert_eq!(r.groups[0].state, GroupState::Error, "2 of 4 ready");
    assert_eq!(r.status().groups[0].in_progress, 0);
    assert_counts_add_up(&b, "st");
}

#[test]
fn without_a_timeout_a_stopped_rollout_still_times_out_a_silent_device() {
    let mut b = Bench::new(2);
    b.create("st", vec![group("g", ids(0..2))], |p| p.timeout = None);
    b.start("st");
    b.report("d000", progress("activated"));
    b.ready(&ids(1..2));
    b.engine.stop("st", T0 + 1).expect("stopped");
    assert_eq!(b.phase("st", "d000"), "activated", "it may still finish");
    assert_eq!(
        b.engine.next_timer(),
        Some(T0 + Rollout::ENDED_GRACE),
        "the ended rollout keeps a timer for it"
    );
    b.at(Rollout::ENDED_GRACE);
    assert_eq!(b.phase("st", "d000"), "timed_out");
    assert!(b.has_trace("st", "and the rollout has ended"));
    assert_eq!(b.rollout("st").status().groups[0].in_progress, 0);
    assert_counts_add_up(&b, "st");
    assert_eq!(b.engine.next_timer(), None);
}

#[test]
fn a_device_of_a_stopped_rollout_that_never_reports_times_out() {
    let mut b = Bench::new(2);
    b.create("st", vec![group("g", ids(0..2))], |p| p.timeout = Some(600));
    b.start("st");
    b.report("d000", progress("activated"));
    b.ready(&ids(1..2));
    b.engine.stop("st", T0 + 1).expect("stopped");
    assert_eq!(b.engine.next_timer(), Some(T0 + 600));
    b.at(600);
    assert_eq!(b.phase("st", "d000"), "timed_out");
    let r = b.rollout("st");
    assert_eq!(r.groups[0].state, GroupState::Error);
    assert_eq!(b.engine.next_timer(), None);
    assert_counts_add_up(&b, "st");
}

fn approval_after(name: &str, devices: Vec<String>) -> crate::plan::PlannedGroup {
    let mut g = group(name, devices);
    g.after.approval = true;
    g
}

fn approval_before(name: &str, devices: Vec<String>) -> crate::plan::PlannedGroup {
    let mut g = group(name, devices);
    g.before.approval = true;
    g
}

#[test]
fn next_refuses_past_an_after_approval_unless_told_and_then_records_it() {
    let mut b = Bench::new(3);
    b.create(
        "nx",
        vec![
            approval_after("canary", ids(0..1)),
            group("rest", ids(1..3)),
        ],
        |_| {},
    );
    b.start("nx");
    // Before the approval is even requested, and once it is pending.
    let err = b
        .engine
        .trigger_next_by("nx", "alice", T0)
        .expect_err("gate");
    assert!(
        err.to_string()
            .contains("approval nx-canary, which is requested when the group succeeds"),
        "{err}"
    );
    b.ready(&ids(0..1));
    let err = b
        .engine
        .trigger_next_by("nx", "alice", T0)
        .expect_err("gate");
    assert_eq!(
        err.to_string(),
        "rollout nx: group rest starts only after approval nx-canary, which is pending; approve it (flotilla approve nx-canary) or pass --skip-approval"
    );
    assert_eq!(b.sent, ids(0..1), "nothing started");
    let effects = b
        .engine
        .trigger_next_with("nx", "alice", true, T0 + 1)
        .expect("skipped");
    b.take(effects);
    assert_eq!(b.sent, ids(0..3));
    assert!(b.has_trace(
        "nx",
        "approval nx-canary given by alice via next (--skip-approval)"
    ));
    assert!(
        b.engine.approvals().iter().all(|a| a.approved),
        "none left pending"
    );
    assert!(b.approvals.last().is_some_and(|a| a.approved));
}

#[test]
fn next_never_starts_a_group_behind_a_pending_before_approval() {
    let mut b = Bench::new(5);
    b.create(
        "nx",
        vec![
            group("a", ids(0..1)),
            approval_before("b", ids(1..3)),
            group("c", ids(3..5)),
        ],
        |_| {},
    );
    b.start("nx");
    b.ready(&ids(0..1));
    assert_eq!(b.rollout("nx").groups[1].state, GroupState::Approval);
    let err = b.engine.trigger_next("nx", T0).expect_err("gate");
    assert!(
        err.to_string()
            .contains("group b is the next group and waits for approval nx-before-b"),
        "{err}"
    );
    // Approved later: b starts, and c waits for b's success as it should.
    let effects = b.engine.approve("nx-before-b", T0 + 1).expect("approved");
    b.take(effects);
    assert_eq!(b.sent, ids(0..3));
    assert_eq!(b.rollout("nx").groups[2].state, GroupState::Scheduled);
    b.ready(&ids(1..3));
    assert_eq!(b.sent, ids(0..5));
    // The same with the flag: b starts, c still waits for b.
    let mut b = Bench::new(5);
    b.create(
        "nx",
        vec![
            group("a", ids(0..1)),
            approval_before("b", ids(1..3)),
            group("c", ids(3..5)),
        ],
        |_| {},
    );
    b.start("nx");
    b.ready(&ids(0..1));
    let effects = b
        .engine
        .trigger_next_with("nx", "bob", true, T0 + 1)
        .expect("skipped");
    b.take(effects);
    assert_eq!(b.sent, ids(0..3));
    assert_eq!(b.rollout("nx").groups[2].state, GroupState::Scheduled);
    assert!(b.has_trace("nx", "approval nx-before-b given by bob via next"));
    // On the last group: a plain reason.
    b.ready(&ids(1..3));
    let err = b.engine.trigger_next("nx", T0 + 2).expect_err("last");
    assert_eq!(
        err.to_string(),
        "rollout nx: every group has started (the last, c, is running); there is no next group to start"
    );
}

#[test]
fn approval_names_that_would_collide_are_refused_naming_both_gates() {
    let mut b = Bench::new(2);
    let spec = RolloutSpec::from_toml(
        "name = \"r\"\nrelease = \"fw-2\"\n[groups]\ncount = 1\n",
        &crate::zoneinfo::SystemZones,
    )
    .expect("spec");
    let plan = planner::Plan {
        groups: vec![
            approval_after("before-prod", ids(0..1)),
            approval_before("prod", ids(1..2)),
        ],
        excluded: Vec::new(),
        unassigned: Vec::new(),
        sites: None,
    };
    let release = ReleaseRef {
        name: "fw-2".into(),
        counter: 2,
        hardware: Vec::new(),
    };
    let err = b
        .engine
        .create_planned(spec.clone(), release.clone(), plan, None, T0)
        .expect_err("collision");
    assert_eq!(
        err.to_string(),
        "rollout r: the approval after group before-prod of rollout r and the approval before group prod of rollout r would both be named r-before-prod; rename one of the groups (stages)"
    );
    assert!(b.engine.rollout("r").is_none());
    // Across rollouts: r-x's gate after y would answer to the same name as r's after x-y.
    b.create("r", vec![approval_after("x-y", ids(0..1))], |_| {});
    let mut spec = spec;
    spec.name = "r-x".into();
    let plan = planner::Plan {
        groups: vec![approval_after("y", ids(1..2))],
        excluded: Vec::new(),
        unassigned: Vec::new(),
        sites: None,
    };
    let err = b
        .engine
        .create_planned(spec, release, plan, None, T0)
        .expect_err("collision");
    assert!(
        err.to_string().contains("would both be named r-x-y"),
        "{err}"
    );
}

#[test]
fn deleting_a_device_cancels_its_action_after_forgetting_it() {
    let mut b = Bench::new(2);
    b.create("del", vec![group("g", ids(0..2))], |_| {});
    b.start("del");
    b.report(
        "d000",
        Phase::Waiting {
            reason: "consent".into(),
        },
    );
    let effects = b
        .engine
        .delete_device_by("d000", "alice", T0 + 1)
        .expect("deleted");
    let forget = effects
        .iter()
        .position(|e| matches!(e, Effect::Forget { device } if device == "d000"));
    let cancel = effects.iter().position(|e| {
        matches!(e, Effect::Cancel { device, action_id, .. }
            if device == "d000" && action_id == &action_id_of(&b, "del", "d000"))
    });
    assert!(forget.is_some() && cancel > forget, "{effects:?}");
    b.take(effects);
    assert!(b.has_trace(
        "del",
        "device d000 deleted by alice; its action was canceled"
    ));
    assert_eq!(b.rollout("del").groups[0].counts.total, 1);
}

fn action_id_of(b: &Bench, rollout: &str, device: &str) -> String {
    action_id(rollout, b.rollout(rollout).created_at, device)
}

#[test]
fn retry_keeps_the_groups_gates_and_counts_attempts_on() {
    let mut b = Bench::new(4);
    let mut canary = approval_before("canary", ids(0..2));
    canary.after.approval = true;
    b.create("orig", vec![canary, group("prod", ids(2..4))], |_| {});
    b.start("orig");
    let effects = b
        .engine
        .approve("orig-before-canary", T0)
        .expect("approved");
    b.take(effects);
    b.ready(&ids(0..1));
    b.fail("d001");
    assert_eq!(b.rollout("orig").state, RolloutState::Paused);
    b.engine.stop("orig", T0 + 1).expect("stopped");
    let effects = b.engine.retry_failed("orig", None, T0 + 2).expect("retry");
    b.take(effects);
    let retry = b.rollout("orig-retry");
    assert_eq!(retry.groups.len(), 1);
    assert_eq!(retry.groups[0].name, "canary");
    assert_eq!(retry.groups[0].devices, vec!["d001"]);
    assert!(retry.groups[0].before.approval && retry.groups[0].after.approval);
    let sent = b.sent.len();
    b.start("orig-retry");
    assert_eq!(b.sent.len(), sent, "the retry waits for its approval too");
    let effects = b
        .engine
        .approve("orig-retry-before-canary", T0 + 3)
        .expect("approved");
    b.take(effects);
    assert_eq!(b.sent.last().map(String::as_str), Some("d001"));
    let detail = &b.rollout("orig-retry").status().groups[0].device_details["d001"];
    assert_eq!(detail.attempt, 2, "the second attempt overall");
}

#[test]
fn a_run_resumed_past_a_failed_group_does_not_claim_success() {
    let mut b = Bench::new(4);
    b.create(
        "rs",
        vec![group("g1", ids(0..2)), group("g2", ids(2..4))],
        |_| {},
    );
    b.start("rs");
    b.ready(&ids(0..1));
    b.fail("d001");
    assert_eq!(b.rollout("rs").state, RolloutState::Paused);
    let effects = b.engine.resume("rs", T0 + 1).expect("resumed");
    b.take(effects);
    b.ready(&ids(2..4));
    let r = b.rollout("rs");
    assert_eq!(r.state, RolloutState::Finished);
    assert!(r
        .conditions
        .iter()
        .any(|c| c.kind == "Succeeded" && !c.status));
    assert!(b.has_trace("rs", "not succeeded: group g1 ended in error"));
}

#[test]
fn the_waiting_line_is_cleared_while_paused() {
    let mut b = Bench::new(2);
    b.create(
        "wt",
        vec![approval_after("g1", ids(0..1)), group("g2", ids(1..2))],
        |_| {},
    );
    b.start("wt");
    b.ready(&ids(0..1));
    assert!(b.rollout("wt").waiting.is_some());
    let effects = b.engine.pause("wt", T0 + 1).expect("paused");
    b.take(effects);
    assert_eq!(b.rollout("wt").waiting, None);
    assert_eq!(b.rollout("wt").status().waiting, None);
}

#[test]
fn a_timed_out_device_that_reports_ready_clears_its_groups_error() {
    let mut b = Bench::new(4);
    b.create("to", vec![group("g", ids(0..4))], |p| p.timeout = Some(60));
    b.start("to");
    b.ready(&ids(0..3));
    b.at(61);
    assert_eq!(b.phase("to", "d003"), "timed_out");
    assert_eq!(b.rollout("to").groups[0].state, GroupState::Error);
    b.report("d003", Phase::Ready);
    let r = b.rollout("to");
    assert_eq!(r.groups[0].counts.ready, 4);
    assert_ne!(r.groups[0].state, GroupState::Error, "4 of 4 ready");
    assert!(b.has_trace("to", "group g is no longer in error"));
    let effects = b.engine.resume("to", T0 + 62).expect("resumed");
    b.take(effects);
    let r = b.rollout("to");
    assert_eq!(r.state, RolloutState::Finished);
    assert!(r
        .conditions
        .iter()
        .any(|c| c.kind == "Succeeded" && c.status));
}

#[test]
fn a_cancel_has_an_id_of_its_own_that_is_never_taken_for_an_attempt() {
    let install = action_id("r", T0, "d000");
    let cancel = cancel_action_id(&install);
    assert_ne!(cancel, install);
    assert_eq!(parse_action_id(&cancel), None);
    assert_eq!(
        parse_action_id(&cancel_action_id(&attempt_action_id("r", T0, "d000", 2))),
        None
    );
}

/// A rollout named "m" in `state`, with a failed device (d001) wherever one fits: groups g1
/// (d000, d001), g2 (d002), g3 (d003).
fn in_state(state: RolloutState) -> Bench {
    let mut b = Bench::new(4);
    let mut g1 = group("g1", ids(0..2));
    if state == RolloutState::Failed {
        g1.error = Some(ErrorCondition {
            action: ErrorAction::Stop,
            ..ErrorCondition::default()
        });
    }
    let groups = vec![g1, group("g2", ids(2..3)), group("g3", ids(3..4))];
    let start_at = (state == RolloutState::Scheduled).then_some(T0 + 3600);
    b.create("m", groups, |p| p.start_at = start_at);
    if state == RolloutState::Ready {
        return b;
    }
    b.start("m");
    match state {
        RolloutState::Scheduled | RolloutState::Running => {}
        RolloutState::Paused => {
            b.ready(&ids(0..1));
            b.fail("d001");
        }
        RolloutState::Failed => b.fail("d001"),
        RolloutState::Stopped => {
            b.fail("d001");
            b.engine.stop("m", T0).expect("stopped");
        }
        RolloutState::Finished => {
            b.ready(&ids(0..1));
            b.fail("d001");
            let effects = b.engine.resume("m", T0).expect("resumed");
            b.take(effects);
            b.ready(&ids(2..3));
            b.ready(&ids(3..4));
        }
        _ => unreachable!("not a state an operator meets"),
    }
    assert_eq!(b.rollout("m").state, state);
    b
}

/// The command x state table of docs/operations.md: which commands each rollout state takes
/// (ok) and which it refuses, naming the state.
#[test]
fn every_command_in_every_rollout_state_does_what_the_table_says() {
    use RolloutState::*;
    let states = [Ready, Scheduled, Running, Paused, Stopped, Finished, Failed];
    // (command, the states it is accepted in)
    let table: [(&str, &[RolloutState]); 7] = [
        ("start", &[Ready]),
        ("pause", &[Scheduled, Running]),
        ("resume", &[Paused]),
        ("stop", &[Ready, Scheduled, Running, Paused]),
        ("next", &[Running]),
        ("retry", &[Paused, Stopped, Finished, Failed]),
        ("delete", &[Ready, Stopped, Finished, Failed]),
    ];
    for (command, accepted) in table {
        for state in states {
            let mut b = in_state(state);
            let result = match command {
                "start" => b.engine.start("m", T0),
                "pause" => b.engine.pause("m", T0),
                "resume" => b.engine.resume("m", T0),
                "stop" => b.engine.stop("m", T0),
                "next" => b.engine.trigger_next("m", T0),
                "delete" => b.engine.delete("m"),
                _ => b.engine.retry_failed("m", None, T0),
            };
            match (accepted.contains(&state), result) {
                (true, Ok(_)) => {}
                (false, Err(e)) => assert!(
                    e.to_string().contains(&crate::text::is_state(state)),
                    "{command} in {state}: {e}"
                ),
                (true, Err(e)) => panic!("{command} in {state} was refused: {e}"),
                (false, Ok(_)) => panic!("{command} in {state} was accepted"),
            }
        }
    }
}

/// Approving is accepted in every state that has the request; in an ended rollout it only
/// records the approval, nothing starts.
#[test]
fn approving_an_ended_rollout_starts_nothing() {
    let mut b = Bench::new(2);
    b.create(
        "ap",
        vec![approval_after("g1", ids(0..1)), group("g2", ids(1..2))],
        |_| {},
    );
    b.start("ap");
    b.ready(&ids(0..1));
    b.engine.stop("ap", T0 + 1).expect("stopped");
    let sent = b.sent.len();
    let err = b.engine.approve("ap-g1", T0 + 2).expect_err("withdrawn");
    assert!(err.to_string().contains("withdrawn"), "{err}");
    assert_eq!(b.sent.len(), sent);
    assert_eq!(b.rollout("ap").groups[1].state, GroupState::Scheduled);
}

#[test]
fn a_stopped_rollouts_pending_approval_is_withdrawn_and_cannot_be_given() {
    let mut b = Bench::new(2);
    let mut first = group("a", ids(0..1));
    first.after.approval = true;
    b.create("wd", vec![first, group("b", ids(1..2))], |_| {});
    b.start("wd");
    b.ready(&ids(0..1));
    let name = "wd-a";
    let pending = b.engine.approvals();
    assert!(
        pending
            .iter()
            .any(|a| a.name == name && !a.approved && !a.withdrawn),
        "{pending:?}"
    );
    b.engine.stop("wd", T0 + 5).expect("stopped");
    let listed = b.engine.approvals();
    assert!(
        listed.iter().any(|a| a.name == name && a.withdrawn),
        "{listed:?}"
    );
    assert!(b
        .rollout("wd")
        .status()
        .approvals
        .iter()
        .all(|a| a.withdrawn));
    let err = b.engine.approve(name, T0 + 6).expect_err("withdrawn");
    assert!(err.to_string().contains("withdrawn"), "{err}");
}

#[test]
fn a_denied_approval_stops_the_rollout_there_and_says_who_and_why() {
    let mut b = Bench::new(5);
    b.create(
        "dn",
        vec![
            approval_after("canary", ids(0..1)),
            approval_before("wave", ids(1..3)),
            group("rest", ids(3..5)),
        ],
        |_| {},
    );
    b.start("dn");
    b.ready(&ids(0..1));
    assert!(b
        .engine
        .approvals()
        .iter()
        .any(|a| a.name == "dn-canary" && !a.approved));
    let effects = b
        .engine
        .deny_by("dn-canary", "alice", Some(" crash loop on dev-00 "), T0 + 5)
        .expect("denied");
    b.take(effects);
    assert_eq!(b.sent, ids(0..1), "nothing more starts");
    let r = b.rollout("dn");
    assert_eq!(r.state, RolloutState::Stopped);
    assert!(b.has_trace(
        "dn",
        "approval dn-canary denied by alice: crash loop on dev-00"
    ));
    assert!(b.has_trace("dn", "stopped: approval dn-canary was denied"));
    let denied = b
        .engine
        .approvals()
        .into_iter()
        .find(|a| a.name == "dn-canary")
        .expect("listed");
    assert_eq!(
        denied.denied.as_deref(),
        Some("alice: crash loop on dev-00")
    );
    assert_eq!(denied.denied_at, Some(T0 + 5));
    assert!(!denied.withdrawn, "denied, not withdrawn");
    assert!(
        b.approvals.last().is_some_and(|a| a.denied.is_some()),
        "the denial is published like an approval"
    );
    // Denying again changes nothing; approving it now is refused, naming the denial.
    assert!(b
        .engine
        .deny_by("dn-canary", "bob", None, T0 + 6)
        .expect("again")
        .is_empty());
    let err = b
        .engine
        .approve_by("dn-canary", "bob", T0 + 7)
        .expect_err("denied");
    assert!(
        err.to_string()
            .contains("approval dn-canary was denied by alice: crash loop on dev-00"),
        "{err}"
    );
    // An approval already given cannot be denied; an unknown one is named.
    let mut b = Bench::new(3);
    b.create(
        "ok",
        vec![
            approval_after("canary", ids(0..1)),
            group("rest", ids(1..3)),
        ],
        |_| {},
    );
    b.start("ok");
    b.ready(&ids(0..1));
    let effects = b.engine.approve("ok-canary", T0 + 1).expect("approved");
    b.take(effects);
    let err = b
        .engine
        .deny_by("ok-canary", "alice", None, T0 + 2)
        .expect_err("approved already");
    assert!(err.to_string().contains("already approved"), "{err}");
    let err = b
        .engine
        .deny_by("nope", "alice", None, T0 + 2)
        .expect_err("unknown");
    assert!(err.to_string().contains("nope"), "{err}");
    // Paused at the gate: denied, stopped. Ended: the request is withdrawn, denying refused.
    for (paused, stopped_first) in [(true, false), (false, true)] {
        let mut b = Bench::new(3);
        b.create(
            "pd",
            vec![
                approval_after("canary", ids(0..1)),
                group("rest", ids(1..3)),
            ],
            |_| {},
        );
        b.start("pd");
        b.ready(&ids(0..1));
        if paused {
            b.engine.pause("pd", T0 + 1).expect("paused");
        }
        if stopped_first {
            b.engine.stop("pd", T0 + 1).expect("stopped");
            let err = b
                .engine
                .deny_by("pd-canary", "alice", None, T0 + 2)
                .expect_err("withdrawn");
            assert!(err.to_string().contains("withdrawn"), "{err}");
            continue;
        }
        b.engine
            .deny_by("pd-canary", "alice", None, T0 + 2)
            .expect("denied while paused");
        assert_eq!(b.rollout("pd").state, RolloutState::Stopped);
        assert!(b.has_trace("pd", "approval pd-canary denied by alice"));
    }
}

/// A last group whose success action is `pause` has nothing to hold back: the rollout finishes
/// instead of waiting, paused with every group done, for a resume.
#[test]
fn a_pause_after_the_last_group_finishes_the_rollout() {
    let mut b = Bench::new(2);
    let mut last = group("b", ids(1..2));
    last.success.action = crate::plan::SuccessAction::Pause;
    let mut first = group("a", ids(0..1));
    first.success.action = crate::plan::SuccessAction::Pause;
    b.create("lp", vec![first, last], |_| {});
    b.start("lp");
    b.ready(&ids(0..1));
    assert_eq!(
        b.rollout("lp").state,
        RolloutState::Paused,
        "a pause before a group holds"
    );
    let effects = b.engine.resume("lp", T0 + 1).expect("resumed");
    b.take(effects);
    b.ready(&ids(1..2));
    assert_eq!(b.rollout("lp").state, RolloutState::Finished);
    assert!(b.has_trace("lp", "group b succeeded; its success action would pause before the next group, and it is the last"));
}

/// Deleting an ended rollout removes it and what it published; its devices can go to another
/// rollout, and its name can be used again.
#[test]
fn a_deleted_rollout_is_gone_with_its_approvals_and_frees_its_name() {
    let mut b = Bench::new(2);
    b.create(
        "dl",
        vec![approval_after("a", ids(0..1)), group("b", ids(1..2))],
        |_| {},
    );
    b.start("dl");
    b.ready(&ids(0..1));
    let err = b.engine.delete("dl").expect_err("running");
    assert_eq!(err.to_string(), "rollout dl is running; cannot delete it");
    b.engine.stop("dl", T0 + 1).expect("stopped");
    let effects = b.engine.delete("dl").expect("deleted");
    assert!(
        matches!(&effects[..], [Effect::Deleted { rollout, approvals }] if rollout == "dl" && approvals == &["dl-a".to_owned()]),
        "{effects:?}"
    );
    assert!(b.engine.rollout("dl").is_none());
    assert!(
        b.engine.approvals().is_empty(),
        "its approvals went with it"
    );
    let err = b.engine.delete("dl").expect_err("gone");
    assert!(err.to_string().contains("no rollout named"), "{err}");
    // The name and the devices are free again.
    b.create("dl", vec![group("all", ids(0..2))], |_| {});
    b.start("dl");
    b.ready(&ids(0..2));
    assert_eq!(b.rollout("dl").state, RolloutState::Finished);
}

/// A group whose selector matched no device is named at create: it would start and succeed at
/// once, which a typo in its label would never say otherwise.
#[test]
fn a_group_that_selects_no_device_is_named_when_the_rollout_is_created() {
    let mut b = Bench::new(2);
    b.create(
        "eg",
        vec![group("canary", vec![]), group("rest", ids(0..2))],
        |_| {},
    );
    assert!(b.has_trace(
        "eg",
        "group canary selects no device: it will start and succeed at once; check its select"
    ));
}
