use super::*;
use flotilla_rollout::planner::FleetDevice;
use flotilla_rollout::spec::RolloutSpec;
use flotilla_rollout::zoneinfo::SystemZones;
use std::collections::BTreeMap;

fn fleet(n: usize, canary: usize) -> Vec<FleetDevice> {
    (0..n)
        .map(|i| FleetDevice {
            id: format!("dev-{i:03}"),
            labels: BTreeMap::from([(
                "env".to_owned(),
                if i < canary { "canary" } else { "prod" }.to_owned(),
            )]),
            hardware_id: "pi4".into(),
        })
        .collect()
}

fn spec(groups: &str) -> RolloutSpec {
    RolloutSpec::from_toml(
        &format!("name = \"fw-2-4\"\nrelease = \"fw-2.4.0\"\n{groups}"),
        &SystemZones,
    )
    .expect("valid spec")
}

const CANARY_REST: &str = "[groups]\nerror = { threshold = \"20%\" }\n\
    [[groups.group]]\nname = \"canary\"\nselect = \"env=canary\"\n\
    [[groups.group]]\nname = \"rest\"\n";

fn run(groups: &str, outcomes: &str) -> SimReport {
    let outcomes = Outcomes::from_toml(outcomes).expect("valid outcomes");
    simulate(
        spec(groups),
        &fleet(10, 2),
        Vec::new(),
        &outcomes,
        SimOptions::default(),
    )
    .expect("runs")
}

fn at(report: &SimReport, needle: &str) -> Option<u64> {
    report
        .timeline
        .iter()
        .find(|t| t.message.contains(needle))
        .map(|t| t.at)
}

#[test]
fn groups_start_when_the_previous_one_is_ready() {
    let r = run(
        "[groups]\ncount = 3\n",
        "default = { ready_after = \"2m\" }\n",
    );
    assert_eq!(r.exit_code(), 0);
    assert_eq!(r.rollout.state, "finished");
    assert_eq!(at(&r, "group group-1 started"), Some(0));
    assert_eq!(at(&r, "group group-2 started"), Some(120));
    assert_eq!(at(&r, "group group-3 started"), Some(240));
    assert_eq!(at(&r, "finished: 10 of 10"), Some(360));
    assert_eq!(
        r.end,
        End {
            at: 360,
            reason: EndReason::Done
        }
    );
    assert!(r.devices.values().all(|p| p == "ready"));
}

#[test]
fn a_failing_canary_pauses_and_the_operator_resumes() {
    let r = run(
        CANARY_REST,
        "[[device]]\nid = \"dev-001\"\nfail_after = \"20s\"\nreason = \"health check nginx failed\"\n\
         [[operator]]\nat = \"1h\"\ncommand = \"resume\"\n",
    );
    assert_eq!(
        at(
            &r,
            "group canary paused rollout fw-2-4: 1 of 2 failed > 20%"
        ),
        Some(20)
    );
    assert_eq!(at(&r, "resumed by operator"), Some(3600));
    assert_eq!(at(&r, "group rest started"), Some(3600));
    assert_eq!(r.rollout.state, "finished");
    assert_eq!(r.devices["dev-001"], "failed");
}

#[test]
fn cancel_drops_pending_reports_and_stop_ends_the_run() {
    let r = run(
        CANARY_REST,
        "default = { ready_after = \"10m\" }\n[[operator]]\nat = \"1m\"\ncommand = \"stop\"\n",
    );
    assert_eq!(r.exit_code(), 2);
    assert_eq!(r.rollout.state, "stopped");
    assert_eq!(r.end.at, 60);
    assert_eq!(r.devices["dev-000"], "canceled");
    // A stop cancels the actions that were never sent too (on the server, no message).
    assert_eq!(r.devices["dev-005"], "canceled");
}

#[test]
fn silent_and_offline_devices_leave_the_rollout_waiting() {
    let r = run(
        CANARY_REST,
        "[[device]]\nid = \"dev-000\"\nsilent = true\n[[device]]\nid = \"dev-001\"\noffline_at = \"10s\"\n",
    );
    assert_eq!(r.exit_code(), 2);
    assert_eq!(r.rollout.state, "running");
    assert_eq!(r.devices["dev-000"], "issued", "never answered");
    assert_eq!(
        r.devices["dev-001"], "accepted",
        "went offline before ready"
    );
    assert!(r.end.at <= DEFAULT_UNTIL);
}

#[test]
fn refused_operator_commands_are_in_the_timeline() {
    let r = run(
        "[groups]\ncount = 1\n",
        "[[operator]]\nat = \"5m\"\ncommand = \"resume\"\n",
    );
    // The rollout finished at 30s; nothing is left to resume at 5m, and the run ended first.
    assert_eq!(r.end.at, 30);
    let r = run(
        "[groups]\ncount = 1\n",
        "default = { ready_after = \"1h\" }\n[[operator]]\nat = \"5m\"\ncommand = \"resume\"\n",
    );
    assert_eq!(
        at(
            &r,
            "operator resume refused: rollout fw-2-4 is running; cannot resume it"
        ),
        Some(300)
    );
}

#[test]
fn outcomes_errors_name_the_entry_and_field() {
    let err = |text: &str| Outcomes::from_toml(text).expect_err("invalid").to_string();
    assert_eq!(
        err("[[device]]\nid = \"a\"\nready_after = \"2x\"\n"),
        "outcomes file: device[0].ready_after: \"2x\": unknown unit \"x\"; use s, m, h or d"
    );
    assert!(err("[[device]]\nready_after = \"2m\"\n")
        .contains("device[0]: set exactly one of id and select"));
    assert!(
        err("[[device]]\nid = \"a\"\nready_after = \"1s\"\nsilent = true\n")
            .contains("only one of")
    );
    assert!(err("[[operator]]\nat = \"1h\"\ncommand = \"reboot\"\n")
        .contains("operator[0].command: \"reboot\" is not one of"));
    assert!(err("[[device]]\nselect = \"env in (\"\nsilent = true\n")
        .starts_with("outcomes file: device[0].select:"));
    assert!(err("bogus = 1\n").contains("bogus"));
}

#[test]
fn rules_match_by_id_then_selector_over_the_default() {
    let o = Outcomes::from_toml(
        "default = { ready_after = \"1m\" }\n\
         [[device]]\nid = \"dev-000\"\nsilent = true\n\
         [[device]]\nselect = \"env=canary\"\nfail_after = \"5s\"\n\
         [[device]]\nselect = \"env=prod\"\noffline_at = \"1h\"\n",
    )
    .expect("valid");
    let f = fleet(3, 2);
    assert_eq!(o.script_for(&f[0]).answer, Answer::Silent);
    assert!(matches!(
        o.script_for(&f[1]).answer,
        Answer::Fail { after: 5, .. }
    ));
    let prod = o.script_for(&f[2]);
    assert_eq!(prod.answer, Answer::Ready { after: 60 });
    assert_eq!(prod.offline_at, Some(3600));
}

#[test]
fn rfc3339_times() {
    assert_eq!(parse_rfc3339("2027-01-04T09:00:00Z"), Ok(1_799_053_200));
    assert_eq!(
        parse_rfc3339("2027-01-04T10:00:00+01:00"),
        Ok(1_799_053_200)
    );
    assert_eq!(parse_rfc3339("2027-01-04T09:00:00.250Z"), Ok(1_799_053_200));
    assert!(parse_rfc3339("2027-02-30T09:00:00Z").is_err());
    assert!(parse_rfc3339("yesterday").is_err());
    assert_eq!(offset(3 * 86_400 + 3723), "+73:02:03");
}
