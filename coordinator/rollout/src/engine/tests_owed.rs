//! What a device is owed across rollouts (`owed.rs`): the newest action any rollout sent it,
//! while that action is in progress, and only that. An older rollout's cancel, retry or soak
//! never comes back over what a newer one sent.

use super::tests_features::{group, ids, pct, Bench, T0};
use super::*;
use crate::plan::{ErrorAction, ErrorCondition, Retry};
use crate::zoneinfo::SystemZones;
use flotilla_protocol::InstalledRelease;

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

/// What an effect publishes on the device's `desired` topic, in words.
fn label(e: &Effect) -> String {
    match e {
        Effect::Desired { action_id, .. } => format!("install {action_id}"),
        Effect::Rollback { action_id, .. } => format!("rollback {action_id}"),
        Effect::Cancel { action_id, .. } => format!("cancel {action_id}"),
        other => format!("{other:?}"),
    }
}

/// What a repair of the device's retained `desired` topic would publish.
fn owed(b: &Bench, device: &str) -> Vec<String> {
    b.engine.reissue_device(device).iter().map(label).collect()
}

/// What a restart would publish for the device.
fn reissued(engine: &mut Engine, device: &str, now: u64) -> Vec<String> {
    engine
        .reissue(now)
        .iter()
        .filter(|e| !matches!(e, Effect::Approval(_)))
        .filter(|e| label(e).ends_with(&format!(":{device}")))
        .map(label)
        .collect()
}

/// The engine after a restart: every rollout through its stored form, `edit`ed on the way.
fn restarted(b: &Bench, edit: impl Fn(&mut Rollout)) -> Engine {
    let stored = b
        .engine
        .rollouts()
        .map(|r| {
            let json = serde_json::to_string(r).expect("serializes");
            let mut r: Rollout = serde_json::from_str(&json).expect("round-trips");
            edit(&mut r);
            r
        })
        .collect();
    Engine::restore(stored, SystemZones)
}

/// A device offline while rollout `a` sends it an install and is stopped (its cancel), then
/// rollout `b` sends it an install: what each step leaves the device owed.
fn missed_cancel() -> Bench {
    let mut b = Bench::new(1);
    let effects = b.engine.observe_state(state("d000", false), T0);
    b.take(effects);
    b.create("a", vec![group("g", ids(0..1))], |_| {});
    b.start("a");
    let a = b.rollout("a").attempt_id("d000", 1);
    assert_eq!(owed(&b, "d000"), vec![format!("install {a}")]);
    b.now += 60;
    let effects = b.engine.stop("a", b.now).expect("stops");
    b.take(effects);
    assert_eq!(owed(&b, "d000"), vec![format!("cancel {a}")]);
    b.now += 60;
    b.create("b", vec![group("g", ids(0..1))], |_| {});
    b.start("b");
    b
}

#[test]
fn a_stopped_rollouts_cancel_is_owed_only_until_a_newer_rollout_sends_the_device_an_action() {
    let mut b = missed_cancel();
    let install = format!("install {}", b.rollout("b").attempt_id("d000", 1));
    assert_eq!(
        owed(&b, "d000"),
        vec![install.clone()],
        "b's install supersedes a's cancel"
    );
    assert_eq!(reissued(&mut b.engine, "d000", b.now), vec![install]);

    // The device comes back, reads b's install and finishes it: nothing is owed any more, and
    // its topic keeps b's install (a's cancel is never published over it), restarts included.
    b.now += 60;
    let effects = b.engine.observe_state(state("d000", true), b.now);
    b.take(effects);
    b.report("d000", Phase::Ready);
    assert_eq!(b.phase("b", "d000"), "ready");
    assert!(owed(&b, "d000").is_empty(), "{:?}", owed(&b, "d000"));
    let mut engine = restarted(&b, |_| {});
    assert_eq!(engine.reissue_device("d000"), None);
    assert!(reissued(&mut engine, "d000", b.now).is_empty());
}

#[test]
fn stores_from_before_the_send_count_order_sends_by_time() {
    let b = missed_cancel();
    let install = format!("install {}", b.rollout("b").attempt_id("d000", 1));
    let forget = |r: &mut Rollout| {
        for g in &mut r.groups {
            for slot in g.slots.values_mut() {
                slot.sent = 0;
            }
        }
    };
    let engine = restarted(&b, forget);
    let owed: Vec<String> = engine.reissue_device("d000").iter().map(label).collect();
    assert_eq!(owed, vec![install]);
}

#[test]
fn a_canceled_action_that_fails_late_is_not_retried_over_the_newer_rollouts() {
    let mut b = Bench::new(1);
    b.create("a", vec![group("g", ids(0..1))], |p| {
        p.retry = Some(Retry {
            attempts: 2,
            backoff: 30,
        })
    });
    b.start("a");
    let a = b.rollout("a").attempt_id("d000", 1);
    b.report("d000", Phase::Activated);
    // An equal weight takes the device over; past activation, the agent finishes a's action.
    b.now += 10;
    b.create("b", vec![group("g", ids(0..1))], |_| {});
    b.start("b");
    assert_eq!(b.phase("a", "d000"), "canceled");
    let sent = b.sent.len();
    b.report_on(
        "d000",
        a,
        Phase::Failed {
            reason: "health check app failed".into(),
            rolled_back: true,
        },
    );
    b.at(3600);
    assert_eq!(b.sent.len(), sent, "no retry of a: {:?}", b.sent);
    assert!(
        b.phase("a", "d000").starts_with("failed"),
        "{}",
        b.phase("a", "d000")
    );
    let install = format!("install {}", b.rollout("b").attempt_id("d000", 1));
    assert_eq!(owed(&b, "d000"), vec![install]);
}

#[test]
fn a_rollback_takes_the_device_over_from_the_rollout_that_had_it() {
    let mut b = Bench::new(2);
    let mut g = group("g", ids(0..2));
    g.error = Some(ErrorCondition {
        percent: Some(pct(25)),
        action: ErrorAction::Rollback,
        ..ErrorCondition::default()
    });
    b.create("a", vec![g], |_| {});
    b.start("a");
    b.report("d000", Phase::Ready);
    b.now += 10;
    b.create("b", vec![group("g", ids(0..1))], |_| {});
    b.start("b");
    assert_eq!(b.phase("b", "d000"), "issued");
    // a's other device fails: a sends d000 back to the release it kept, over b's install.
    b.fail("d001");
    assert_eq!(b.rollbacks.len(), 1);
    assert_eq!(b.phase("b", "d000"), "canceled");
    assert!(b.has_trace(
        "b",
        "device d000: action canceled, rollout a took the device over"
    ));
    let rollback = format!("rollback {}", b.rollbacks[0].1);
    assert_eq!(owed(&b, "d000"), vec![rollback]);
    b.report("d000", Phase::Ready);
    assert_eq!(b.phase("a", "d000"), "rolled_back");
    assert!(owed(&b, "d000").is_empty());
}

#[test]
fn a_soaking_device_taken_over_counts_as_ready_for_the_rollout_it_soaked_in() {
    let mut b = Bench::new(1);
    b.create(
        "a",
        vec![group("g", ids(0..1)), group("h", Vec::new())],
        |p| p.soak = 600,
    );
    b.start("a");
    b.report("d000", Phase::Ready);
    assert_eq!(b.phase("a", "d000"), "soaking");
    b.now += 10;
    b.create("b", vec![group("g", ids(0..1))], |_| {});
    b.start("b");
    assert_eq!(b.phase("a", "d000"), "ready");
    assert!(b.has_trace(
        "a",
        "device d000: soak ended, rollout b took the device over; it counts as ready"
    ));
    b.at(3600);
    assert_eq!(b.rollout("a").state, RolloutState::Finished);
    assert!(
        b.has_trace("a", "group g finished: 1 of 1 ready"),
        "{:?}",
        b.trace("a")
    );
}
