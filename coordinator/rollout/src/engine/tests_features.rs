//! Engine behaviour beyond hawkBit's plain groups: pace, gates, timers, error actions, overlap.
//! Plans are built directly, so these tests do not depend on any vocabulary's parser.

use super::*;
use crate::plan::{
    Budget, ErrorAction, ErrorCondition, OfflinePolicy, Percent, PlannedGroup, Policies, RateLimit,
    Retry, SuccessCondition, Threshold,
};
use crate::zoneinfo::SystemZones;
use flotilla_protocol::InstalledRelease;

pub(super) const T0: u64 = 1_800_000_000;

fn state(id: &str, online: bool) -> DeviceState {
    DeviceState {
        device_id: id.into(),
        hardware_id: "pi4".into(),
        labels: Vec::new(),
        installed: Some(InstalledRelease {
            name: "fw-1".into(),
            version: "1".into(),
            counter: 1,
        }),
        current: None,
        online,
        agent_version: "0.1.0".into(),
        at: T0,
    }
}

pub(super) fn ids(range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("d{i:03}")).collect()
}

pub(super) fn group(name: &str, devices: Vec<String>) -> PlannedGroup {
    PlannedGroup {
        name: name.into(),
        devices,
        pace: Pace::default(),
        success: SuccessCondition::default(),
        error: None,
        before: Gate::default(),
        after: Gate::default(),
    }
}

/// An engine, the fleet, and the agents' side: the current action id of every device.
pub(super) struct Bench {
    pub(super) engine: Engine,
    pub(super) now: u64,
    seq: HashMap<String, u64>,
    action: HashMap<String, String>,
    pub(super) sent: Vec<String>,
    pub(super) canceled: Vec<String>,
    pub(super) rollbacks: Vec<(String, String)>,
    pub(super) approvals: Vec<ApprovalStatus>,
}

impl Bench {
    pub(super) fn new(devices: usize) -> Self {
        let mut engine = Engine::new(SystemZones);
        for id in ids(0..devices) {
            engine.observe_state(state(&id, true), T0);
        }
        Bench {
            engine,
            now: T0,
            seq: HashMap::new(),
            action: HashMap::new(),
            sent: Vec::new(),
            canceled: Vec::new(),
            rollbacks: Vec::new(),
            approvals: Vec::new(),
        }
    }

    pub(super) fn take(&mut self, effects: Vec<Effect>) {
        for e in effects {
            match e {
                Effect::Desired {
                    device, action_id, ..
                } => {
                    self.sent.push(device.clone());
                    self.action.insert(device, action_id);
                }
                Effect::Cancel { device, .. } => self.canceled.push(device),
                Effect::Rollback {
                    device, action_id, ..
                } => {
                    self.action.insert(device.clone(), action_id.clone());
                    self.rollbacks.push((device, action_id));
                }
                Effect::Approval(a) => self.approvals.push(a),
                _ => {}
            }
        }
    }

    pub(super) fn create(
        &mut self,
        name: &str,
        groups: Vec<PlannedGroup>,
        policies: impl FnOnce(&mut Policies),
    ) {
        let mut spec = RolloutSpec::from_toml(
            &format!("name = \"{name}\"\nrelease = \"fw-2\"\n[groups]\ncount = 1\n"),
            &SystemZones,
        )
        .expect("valid spec");
        policies(&mut spec.policies);
        let plan = planner::Plan {
            groups,
            excluded: Vec::new(),
            unassigned: Vec::new(),
            sites: None,
        };
        let release = ReleaseRef {
            name: "fw-2".into(),
            counter: 2,
            hardware: Vec::new(),
        };
        let effects = self
            .engine
            .create_planned(spec, release, plan, None, self.now)
            .expect("created");
        self.take(effects);
    }

    pub(super) fn start(&mut self, name: &str) {
        let effects = self.engine.start(name, self.now).expect("started");
        self.take(effects);
    }

    pub(super) fn report(&mut self, device: &str, phase: Phase) {
        let action_id = self
            .action
            .get(device)
            .cloned()
            .expect("device has an action");
        self.report_on(device, action_id, phase);
    }

    /// A report on `action_id`, which need not be the last action the device was sent.
    pub(super) fn report_on(&mut self, device: &str, action_id: String, phase: Phase) {
        let rollout = action_id.split('@').next().unwrap_or_default().to_owned();
        let seq = self.seq.entry(device.to_owned()).or_insert(0);
        *seq += 1;
        let report = Report {
            device_id: device.into(),
            seq: *seq,
            action_id,
            rollout_id: rollout,
            phase,
            at: self.now,
        };
        let effects = self.engine.observe_report(report, self.now);
        self.take(effects);
    }

    pub(super) fn ready(&mut self, devices: &[String]) {
        for d in devices {
            self.report(d, Phase::Ready);
        }
    }

    pub(super) fn fail(&mut self, device: &str) {
        self.report(
            device,
            Phase::Failed {
                reason: "health check app failed".into(),
                rolled_back: true,
            },
        );
    }

    /// Moves the clock and runs the timers.
    pub(super) fn at(&mut self, secs_from_start: u64) {
        self.now = T0 + secs_from_start;
        let effects = self.engine.tick(self.now);
        self.take(effects);
    }

    pub(super) fn rollout(&self, name: &str) -> &Rollout {
        self.engine.rollout(name).expect("rollout exists")
    }

    pub(super) fn phase(&self, name: &str, device: &str) -> String {
        self.rollout(name).device_phases()[device].clone()
    }

    pub(super) fn trace(&self, name: &str) -> Vec<String> {
        self.rollout(name)
            .trace
            .iter()
            .map(|t| t.message.clone())
            .collect()
    }

    pub(super) fn has_trace(&self, name: &str, text: &str) -> bool {
        self.trace(name).iter().any(|m| m.contains(text))
    }
}

pub(super) fn pct(p: u32) -> Percent {
    Percent::from_basis_points(p * 100).expect("valid percent")
}

#[test]
fn fleet_batches_wait_for_the_unavailability_budget() {
    // Fleet's 100-device scenario: batches of 50, max_unavailable 10%.
    let mut b = Bench::new(100);
    let mut g = group("all", ids(0..100));
    g.pace = Pace {
        batch: Some(50),
        gate: Some(Budget::Percent(pct(10))),
        concurrency: None,
    };
    g.success.threshold = Threshold::AllBut(Budget::Percent(pct(10)));
    b.create("fw", vec![g], |_| {});
    b.start("fw");
    assert_eq!(b.sent.len(), 50, "the first batch is 50 devices");
    let summary = b.engine.status("fw").expect("status").groups[0]
        .summary
        .clone();
    assert_eq!(summary["NotReady"], 50);
    assert_eq!(
        summary["OutOfSync"], 50,
        "the devices not started have an older release"
    );
    // 39 ready: 11 not ready > 10 allowed, so the second batch waits.
    b.ready(&ids(0..39));
    assert_eq!(b.sent.len(), 50);
    let waiting = b.rollout("fw").waiting.clone().unwrap_or_default();
    assert!(
        waiting.contains("11 of 100 not ready > 10 allowed"),
        "{waiting}"
    );
    // One more ready: 10 not ready is within the budget; the next 50 start.
    b.ready(&ids(39..40));
    assert_eq!(b.sent.len(), 100);
    assert!(b.has_trace(
        "fw",
        "started 50 devices (100 of 100 started, 60 not ready)"
    ));
    let summary = b.engine.status("fw").expect("status").groups[0]
        .summary
        .clone();
    assert_eq!(summary["Ready"], 40);
    assert_eq!(summary["NotReady"], 60);
    assert!(!summary.contains_key("OutOfSync"));
    b.ready(&ids(40..91));
    // 9 not ready of 100, all started: the partition is Ready.
    assert_eq!(b.rollout("fw").groups[0].succeeded_at, Some(T0));
}

#[test]
fn max_unavailable_groups_lets_the_next_partition_start_while_one_is_not_ready() {
    let mut b = Bench::new(40);
    let mut parts = Vec::new();
    for (i, range) in [0..20, 20..40].into_iter().enumerate() {
        let mut g = group(&format!("partition-{}", i + 1), ids(range));
        g.pace.batch = Some(50);
        g.pace.gate = Some(Budget::Count(0));
        g.success.threshold = Threshold::AllBut(Budget::Count(0));
        parts.push(g);
    }
    b.create("strict", parts.clone(), |_| {});
    b.start("strict");
    assert_eq!(b.sent.len(), 20, "strict: the second partition waits");
    let mut b2 = Bench::new(40);
    b2.create("lenient", parts, |p| {
        p.max_unavailable_groups = Budget::Count(1)
    });
    b2.start("lenient");
    assert_eq!(
        b2.sent.len(),
        40,
        "one NotReady partition is allowed, so the second starts"
    );
}

#[test]
fn concurrency_keeps_a_failed_device_holding_its_slot() {
    // KubeFleet: maxUnavailable 1; a failing device blocks the others.
    let mut b = Bench::new(3);
    let mut g = group("rolling", ids(0..3));
    g.pace.concurrency = Some(1);
    b.create("roll", vec![g], |_| {});
    b.start("roll");
    assert_eq!(b.sent, ids(0..1));
    b.ready(&ids(0..1));
    assert_eq!(b.sent, ids(0..2));
    b.fail("d001");
    assert_eq!(b.sent, ids(0..2), "the failed device holds the only slot");
    let waiting = b.rollout("roll").waiting.clone().unwrap_or_default();
    assert!(
        waiting.contains("1 of 1 allowed at once are not ready"),
        "{waiting}"
    );
}

#[test]
fn untracked_devices_count_as_available_after_the_unavailable_period() {
    let mut b = Bench::new(2);
    let mut g = group("rolling", ids(0..2));
    g.pace.concurrency = Some(1);
    b.create("roll", vec![g], |p| p.unavailable_period = 60);
    b.start("roll");
    // An agent without health checks reports "applied": installed, readiness unknown.
    b.report("d000", Phase::Applied);
    assert_eq!(b.phase("roll", "d000"), "soaking");
    assert_eq!(
        b.sent.len(),
        1,
        "an untracked device holds its slot for the period"
    );
    b.at(59);
    assert_eq!(b.sent.len(), 1);
    b.at(60);
    assert_eq!(b.phase("roll", "d000"), "ready");
    assert_eq!(
        b.sent.len(),
        2,
        "after the unavailable period it counts as available"
    );
    // A tracked Ready frees the slot at once.
    b.ready(&ids(1..2));
    assert_eq!(b.rollout("roll").state, RolloutState::Finished);
}

#[test]
fn staged_gates_approval_before_and_after_with_a_timed_wait() {
    let mut b = Bench::new(3);
    let mut staging = group("staging", ids(0..1));
    staging.after = Gate {
        approval: true,
        wait: 3600,
    };
    let mut prod = group("production", ids(1..3));
    prod.before = Gate {
        approval: true,
        wait: 0,
    };
    prod.pace.concurrency = Some(1);
    b.create("run", vec![staging, prod], |_| {});
    b.start("run");
    assert_eq!(b.sent, ids(0..1));
    b.at(10);
    b.ready(&ids(0..1));
    let r = b.rollout("run");
    assert_eq!(r.groups[0].state, GroupState::Waiting);
    assert_eq!(b.approvals.len(), 1);
    assert_eq!(b.approvals[0].name, "run-staging");
    // Approved, but the hour has not passed: both must be satisfied.
    let effects = b.engine.approve("run-staging", T0 + 20).expect("approved");
    b.take(effects);
    assert_eq!(b.sent.len(), 1);
    assert!(b
        .rollout("run")
        .waiting
        .clone()
        .unwrap_or_default()
        .contains("timed wait"));
    assert_eq!(b.engine.next_timer(), Some(T0 + 10 + 3600));
    b.at(10 + 3600);
    assert!(b.has_trace("run", "group staging: timed wait elapsed"));
    // Production waits for its before-approval.
    assert_eq!(b.rollout("run").groups[1].state, GroupState::Approval);
    assert_eq!(
        b.approvals.last().map(|a| a.name.as_str()),
        Some("run-before-production")
    );
    assert_eq!(b.sent.len(), 1);
    let effects = b
        .engine
        .approve("run-before-production", T0 + 3700)
        .expect("approved");
    b.take(effects);
    assert_eq!(b.sent, ids(0..2), "max_concurrency 1: one device at a time");
    b.now = T0 + 3800;
    b.ready(&ids(1..2));
    b.ready(&ids(2..3));
    let r = b.rollout("run");
    assert_eq!(r.state, RolloutState::Finished);
    let status = r.status();
    let kinds: Vec<(&str, bool)> = status
        .conditions
        .iter()
        .map(|c| (c.kind.as_str(), c.status))
        .collect();
    assert!(kinds.contains(&("Initialized", true)));
    assert!(kinds.contains(&("Succeeded", true)));
    let staging = &status.groups[0];
    for kind in [
        "ApprovalRequestCreated",
        "ApprovalRequestApproved",
        "WaitTimeElapsed",
        "Succeeded",
    ] {
        assert!(
            staging
                .conditions
                .iter()
                .any(|c| c.kind == kind && c.status),
            "staging lacks {kind}: {:?}",
            staging.conditions
        );
    }
    assert_eq!(staging.started_at, Some(T0));
    assert!(staging.device_details["d000"].ended_at.is_some());
    assert!(matches!(
        b.engine.approve("no-such", T0),
        Err(EngineError::UnknownApproval(_))
    ));
}

#[test]
fn soak_holds_success_until_devices_stayed_ready() {
    let mut b = Bench::new(2);
    b.create(
        "s",
        vec![group("g1", ids(0..1)), group("g2", ids(1..2))],
        |p| p.soak = 600,
    );
    b.start("s");
    b.ready(&ids(0..1));
    assert_eq!(b.phase("s", "d000"), "soaking");
    assert_eq!(b.sent.len(), 1, "the next group waits for the soak");
    b.at(599);
    assert_eq!(b.sent.len(), 1);
    b.at(600);
    assert_eq!(b.phase("s", "d000"), "ready");
    assert_eq!(b.sent.len(), 2);
}

#[test]
fn a_silent_device_times_out_and_counts_as_failure() {
    let mut b = Bench::new(2);
    let mut g = group("g", ids(0..2));
    g.error = Some(ErrorCondition {
        percent: None,
        count: Some(1),
        ..ErrorCondition::default()
    });
    b.create("t", vec![g], |p| p.timeout = Some(1800));
    b.start("t");
    b.ready(&ids(0..1));
    b.at(1799);
    assert_eq!(b.rollout("t").state, RolloutState::Running);
    b.at(1800);
    assert_eq!(b.phase("t", "d001"), "timed_out");
    assert_eq!(b.rollout("t").state, RolloutState::Paused);
    assert!(b.has_trace("t", "1 of 2 failed >= 1"), "{:?}", b.trace("t"));
}

#[test]
fn retries_back_off_and_count_only_when_used_up() {
    let mut b = Bench::new(1);
    let mut g = group("g", ids(0..1));
    g.error = Some(ErrorCondition::default());
    b.create("r", vec![g], |p| {
        p.retry = Some(Retry {
            attempts: 2,
            backoff: 30,
        })
    });
    b.start("r");
    b.fail("d000");
    assert_eq!(b.phase("r", "d000"), "retrying");
    assert_eq!(
        b.rollout("r").state,
        RolloutState::Running,
        "not counted yet"
    );
    b.at(29);
    assert_eq!(b.sent.len(), 1);
    b.at(30);
    assert_eq!(b.sent.len(), 2);
    assert!(
        b.action["d000"].ends_with(":d000:2"),
        "{}",
        b.action["d000"]
    );
    b.fail("d000");
    b.at(30 + 59);
    assert_eq!(b.sent.len(), 2, "the second retry waits twice as long");
    b.at(30 + 60);
    assert_eq!(b.sent.len(), 3);
    b.fail("d000");
    assert_eq!(b.phase("r", "d000"), "failed");
    assert_eq!(b.rollout("r").state, RolloutState::Paused);
    assert_eq!(
        b.rollout("r").status().groups[0].device_details["d000"].attempt,
        3
    );
}

#[test]
fn offline_devices_are_skipped_or_failed_after_grace() {
    let mut b = Bench::new(3);
    let effects = b.engine.observe_state(state("d001", false), T0);
    b.take(effects);
    b.create("skip", vec![group("g", ids(0..3))], |p| {
        p.offline = OfflinePolicy::Skip
    });
    b.start("skip");
    assert_eq!(b.sent, vec!["d000".to_string(), "d002".to_string()]);
    assert_eq!(b.phase("skip", "d001"), "skipped");
    b.ready(&["d000".to_string(), "d002".to_string()]);
    assert_eq!(
        b.rollout("skip").state,
        RolloutState::Finished,
        "skipped devices leave the group's total"
    );

    let mut b = Bench::new(2);
    b.create("fail", vec![group("g", ids(0..2))], |p| {
        p.offline = OfflinePolicy::Fail { grace: 600 }
    });
    b.start("fail");
    b.now = T0 + 100;
    let effects = b.engine.observe_state(state("d001", false), T0 + 100);
    b.take(effects);
    b.at(699);
    assert_eq!(b.phase("fail", "d001"), ISSUED);
    b.at(700);
    assert_eq!(b.phase("fail", "d001"), "timed_out");
    assert!(b.has_trace("fail", "offline for more than 10m"));
}

#[test]
fn the_rate_limit_ramps_up_with_successes() {
    let mut b = Bench::new(30);
    b.create("rate", vec![group("g", ids(0..30))], |p| {
        p.rate = Some(RateLimit {
            base: 2.0,
            factor: 2.0,
            every: 2,
            max: None,
        })
    });
    b.start("rate");
    assert_eq!(b.sent.len(), 1, "one device at once, then 2 per minute");
    b.at(30);
    assert_eq!(b.sent.len(), 2);
    b.at(60);
    assert_eq!(b.sent.len(), 3);
    let first: Vec<String> = b.sent.clone();
    b.ready(&first[..2]);
    // Two successes double the rate to 4 per minute.
    b.at(75);
    assert_eq!(b.sent.len(), 4);
    assert!(b
        .rollout("rate")
        .waiting
        .clone()
        .unwrap_or_default()
        .contains("rate limit of 4.0 devices per minute"));
}

#[test]
fn error_action_rollback_sends_ready_devices_back() {
    let mut b = Bench::new(4);
    let mut g = group("g", ids(0..4));
    g.error = Some(ErrorCondition {
        percent: Some(pct(25)),
        action: ErrorAction::Rollback,
        ..ErrorCondition::default()
    });
    b.create("rb", vec![g], |_| {});
    b.start("rb");
    b.ready(&ids(0..2));
    b.fail("d002");
    assert_eq!(b.rollout("rb").state, RolloutState::Running);
    b.fail("d003");
    let r = b.rollout("rb");
    assert_eq!(r.state, RolloutState::Failed);
    assert_eq!(b.rollbacks.len(), 2);
    assert!(b.rollbacks[0].1.ends_with(":d000:rollback"));
    assert!(b.has_trace("rb", "sending 2 devices back to the release they kept"));
    b.report("d000", Phase::Ready);
    assert_eq!(b.phase("rb", "d000"), "rolled_back");
}

#[test]
fn error_action_stop_fails_the_run_and_cancels() {
    let mut b = Bench::new(3);
    let mut g = group("g", ids(0..3));
    g.error = Some(ErrorCondition {
        action: ErrorAction::Stop,
        ..ErrorCondition::default()
    });
    b.create("st", vec![g, group("later", Vec::new())], |_| {});
    b.start("st");
    b.fail("d000");
    let r = b.rollout("st");
    assert_eq!(r.state, RolloutState::Failed);
    assert_eq!(b.canceled.len(), 2);
    assert!(r
        .status()
        .conditions
        .iter()
        .any(|c| c.kind == "Failed" && c.status));
}

#[test]
fn devices_registering_after_the_start_join_the_dynamic_group() {
    let mut b = Bench::new(1);
    b.create("dyn", vec![group("g", ids(0..1))], |p| p.dynamic = true);
    b.start("dyn");
    b.ready(&ids(0..1));
    assert_eq!(
        b.rollout("dyn").state,
        RolloutState::Running,
        "the dynamic group stays open"
    );
    let effects = b.engine.observe_state(state("late-1", true), T0 + 5);
    b.take(effects);
    assert_eq!(b.sent.last().map(String::as_str), Some("late-1"));
    assert!(b.has_trace(
        "dyn",
        "late-1 registered after the start and joined group dynamic"
    ));
}

#[test]
fn trigger_next_and_deleted_devices() {
    let mut b = Bench::new(4);
    b.create(
        "tn",
        vec![group("g1", ids(0..2)), group("g2", ids(2..4))],
        |_| {},
    );
    b.start("tn");
    let effects = b.engine.trigger_next("tn", T0).expect("triggered");
    b.take(effects);
    assert_eq!(b.sent.len(), 4);
    assert!(b.has_trace("tn", "operator triggered the next group after group g1"));
    // Deleting a device of a running group recomputes its counts; an emptied group succeeds.
    let mut b = Bench::new(3);
    b.create(
        "del",
        vec![group("g1", ids(0..1)), group("g2", ids(1..3))],
        |_| {},
    );
    b.start("del");
    let effects = b.engine.delete_device("d000", T0).expect("deleted");
    assert!(effects.contains(&Effect::Forget {
        device: "d000".into()
    }));
    b.take(effects);
    assert_eq!(b.sent, vec!["d000", "d001", "d002"]);
    assert!(b.has_trace("del", "group g1 succeeded: 0 of 0 ready"));
    assert!(matches!(
        b.engine.delete_device("d000", T0),
        Err(EngineError::UnknownDevice(_))
    ));
}

#[test]
fn retry_failed_creates_a_rollout_of_the_failed_devices() {
    let mut b = Bench::new(3);
    b.create("orig", vec![group("g", ids(0..3))], |_| {});
    b.start("orig");
    b.ready(&ids(0..1));
    b.fail("d001");
    b.fail("d002");
    assert_eq!(b.rollout("orig").state, RolloutState::Paused);
    let effects = b.engine.retry_failed("orig", None, T0 + 10).expect("retry");
    b.take(effects);
    let retry = b.rollout("orig-retry");
    assert_eq!(retry.state, RolloutState::Ready);
    assert_eq!(retry.groups[0].devices, vec!["d001", "d002"]);
    b.start("orig-retry");
    assert!(b.action["d001"].starts_with("orig-retry@"));
}

#[test]
fn a_newer_rollout_cancels_scheduled_actions_and_weight_decides_running_ones() {
    let mut b = Bench::new(2);
    b.create(
        "old",
        vec![group("g1", ids(0..1)), group("g2", ids(1..2))],
        |p| p.weight = 800,
    );
    b.start("old");
    b.now = T0 + 1;
    b.create("new", vec![group("g", ids(0..2))], |p| p.weight = 100);
    b.start("new");
    // d001 was only scheduled in "old": canceled there on the server.
    assert_eq!(b.phase("old", "d001"), "canceled");
    assert!(b.has_trace(
        "old",
        "1 scheduled device action canceled: newer rollout new"
    ));
    // d000 is running in "old" with a higher weight: "new" waits for it, in order.
    assert_eq!(b.sent, vec!["d000"]);
    assert!(b
        .rollout("new")
        .waiting
        .clone()
        .unwrap_or_default()
        .contains("d000 is busy with rollout old (weight 800 > 100)"));
    b.report("d000", Phase::Ready);
    let effects = b.engine.tick(T0 + 2);
    b.take(effects);
    assert_eq!(b.sent, vec!["d000", "d000", "d001"]);
    assert!(b.action["d000"].starts_with("new@"));

    // A heavier newer rollout takes a running device over.
    let mut b = Bench::new(1);
    b.create("light", vec![group("g", ids(0..1))], |p| p.weight = 100);
    b.start("light");
    b.create("heavy", vec![group("g", ids(0..1))], |p| p.weight = 900);
    b.start("heavy");
    assert_eq!(b.phase("light", "d000"), "canceled");
    assert!(b.action["d000"].starts_with("heavy@"));
}

#[test]
fn start_at_waits_for_its_time() {
    let mut b = Bench::new(1);
    b.create("later", vec![group("g", ids(0..1))], |p| {
        p.start_at = Some(T0 + 3600)
    });
    b.start("later");
    assert_eq!(b.rollout("later").state, RolloutState::Scheduled);
    assert!(b.sent.is_empty());
    assert_eq!(b.engine.next_timer(), Some(T0 + 3600));
    b.at(3600);
    assert_eq!(b.sent.len(), 1);
    assert!(b.has_trace("later", "start time reached"));
}

fn labelled(id: &str, labels: &[(&str, &str)]) -> DeviceState {
    let mut s = state(id, true);
    s.labels = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    s
}

const STAGED: &str = r#"
release = "fw-2"
[staged]
[[staged.stage]]
name = "canary"
select = "env=canary"
after = { approval = true }
[[staged.stage]]
name = "production"
select = "env=production"
sort_by = "order"
max_concurrency = 2
"#;

#[test]
fn staged_runs_over_the_same_devices_need_identical_strategies() {
    let mut engine = Engine::new(SystemZones);
    engine.observe_state(labelled("c1", &[("env", "canary")]), T0);
    for (id, order) in [("p1", "3"), ("p2", "1"), ("p3", "2")] {
        engine.observe_state(labelled(id, &[("env", "production"), ("order", order)]), T0);
    }
    let release = ReleaseRef {
        name: "fw-2".into(),
        counter: 2,
        hardware: Vec::new(),
    };
    let first =
        RolloutSpec::from_toml(&format!("name = \"run-1\"\n{STAGED}"), &SystemZones).expect("spec");
    engine
        .create_rollout(first, release.clone(), T0)
        .expect("created");
    let effects = engine.start("run-1", T0).expect("started");
    assert_eq!(
        effects
            .iter()
            .filter(|e| matches!(e, Effect::Desired { .. }))
            .count(),
        1,
        "the canary stage first"
    );
    let r = engine.rollout("run-1").expect("run");
    assert_eq!(
        r.groups[1].devices,
        vec!["p2", "p3", "p1"],
        "sorted by the order label"
    );
    // The same strategy pipelines; a different one fails at initialization.
    let same =
        RolloutSpec::from_toml(&format!("name = \"run-2\"\n{STAGED}"), &SystemZones).expect("spec");
    engine
        .create_rollout(same, release.clone(), T0)
        .expect("identical strategies are fine");
    let other = RolloutSpec::from_toml(
        &format!(
            "name = \"run-3\"\n{}",
            STAGED.replace("max_concurrency = 2", "max_concurrency = 3")
        ),
        &SystemZones,
    )
    .expect("spec");
    let err = engine
        .create_rollout(other, release, T0)
        .expect_err("different strategy refused")
        .to_string();
    assert!(
        err.contains("staged run run-3 cannot initialize: run run-1 (running)")
            && err.contains("identical strategies"),
        "{err}"
    );
}

#[test]
fn retries_wait_for_the_maintenance_window_and_actions_carry_it() {
    // T0 is 2027-01-15 08:00 UTC; the window is 08:00-09:00 UTC every day.
    let mut b = Bench::new(1);
    b.create("r", vec![group("g", ids(0..1))], |p| {
        p.windows = vec![crate::plan::WindowSpec {
            cron: "0 8 * * *".into(),
            duration: 3600,
            tz: "UTC".into(),
        }];
        p.retry = Some(Retry {
            attempts: 1,
            backoff: 50 * 60,
        });
    });
    b.start("r");
    assert_eq!(b.sent, ["d000"]);
    let first = b.engine.install_window("r", "d000").expect("a window");
    assert_eq!((first.not_before, first.not_after), (T0, T0 + 3599));

    // Fails at 08:40; its retry is due at 09:30, when the window is closed.
    b.at(40 * 60);
    b.fail("d000");
    b.at(90 * 60);
    assert_eq!(b.sent.len(), 1, "no retry outside the window");
    assert!(
        b.has_trace(
            "r",
            "device d000 in group g: retry waits for the maintenance window, which opens at 2027-01-16T08:00:00Z"
        ),
        "{:?}",
        b.trace("r")
    );
    assert_eq!(b.engine.next_timer(), Some(T0 + 86_400));

    b.at(86_400 - 1);
    assert_eq!(b.sent.len(), 1);
    b.at(86_400);
    assert_eq!(b.sent.len(), 2, "the retry goes out when the window opens");
    let retry = b.engine.install_window("r", "d000").expect("a window");
    assert_eq!(
        (retry.not_before, retry.not_after),
        (T0 + 86_400, T0 + 86_400 + 3599)
    );
}
