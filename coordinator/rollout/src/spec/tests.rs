use super::*;
use crate::plan::{
    ActionType, FailureClasses, Gate, OfflinePolicy, RateLimit, Retry, UnknownDevices,
    DEFAULT_WEIGHT,
};
use crate::zoneinfo::SystemZones;

fn parse(text: &str) -> RolloutSpec {
    RolloutSpec::from_toml(text, &SystemZones)
        .unwrap_or_else(|e| panic!("spec should parse: {e}\n{text}"))
}

fn error(text: &str) -> String {
    match RolloutSpec::from_toml(text, &SystemZones) {
        Ok(spec) => panic!("spec should be refused, got {spec:?}"),
        Err(e) => e.to_string(),
    }
}

const FULL: &str = r#"
name = "fw-2-4"
release = "fw-2.4.0"
select = "hw=pi4"
[groups]
success = { threshold = "90%", action = "next" }
error = { threshold = "20%", action = "pause" }
[[groups.group]]
name = "canary"
select = "env=canary"
percent = 50
success = { threshold = 100, action = "pause" }
[[groups.group]]
error = { threshold = "12.5%" }
"#;

#[test]
fn full_spec_applies_defaults_and_overrides() {
    let spec = parse(FULL);
    assert_eq!(spec.name, "fw-2-4");
    assert_eq!(spec.release, "fw-2.4.0");
    assert_eq!(spec.select.to_string(), "hw=pi4");
    let Some(GroupsSpec::List(groups)) = spec.groups() else {
        panic!("expected a group list")
    };
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[0].name, "canary");
    assert_eq!(groups[0].select.to_string(), "env=canary");
    assert_eq!(groups[0].percent.to_string(), "50%");
    assert_eq!(
        groups[0].success,
        SuccessCondition {
            threshold: Threshold::Share(Percent::HUNDRED),
            action: SuccessAction::Pause
        }
    );
    assert_eq!(
        groups[0]
            .error
            .as_ref()
            .map(|e| e.percent.map(|p| p.to_string()).unwrap_or_default()),
        Some("20%".into())
    );
    // The second group takes the defaults from [groups] and its own error override.
    assert_eq!(groups[1].name, "group-2");
    assert!(groups[1].select.is_everything());
    assert_eq!(groups[1].percent, Percent::HUNDRED);
    assert_eq!(
        groups[1].success.threshold,
        Threshold::Share(Percent::from_basis_points(9000).expect("90%"))
    );
    assert_eq!(groups[1].success.action, SuccessAction::Next);
    assert_eq!(
        groups[1]
            .error
            .as_ref()
            .map(|e| e.percent.map(|p| p.to_string()).unwrap_or_default()),
        Some("12.5%".into())
    );
}

#[test]
fn count_spec_and_defaults() {
    let spec = parse("name = \"r1\"\nrelease = \"rel\"\n[groups]\ncount = 3\n");
    assert!(spec.select.is_everything());
    assert_eq!(
        spec.groups(),
        Some(&GroupsSpec::Count {
            count: 3,
            success: SuccessCondition::default(),
            error: None
        })
    );
    assert_eq!(spec.vocabulary(), "groups");
    assert_eq!(spec.policies, Policies::default());
}

#[test]
fn validated_spec_round_trips_through_json() {
    let spec = parse(FULL);
    let json = serde_json::to_string(&spec).expect("encodes");
    let back: RolloutSpec = serde_json::from_str(&json).expect("decodes");
    assert_eq!(back, spec);
}

#[test]
fn thresholds_accept_percent_strings_and_numbers() {
    for (text, want) in [
        ("\"25%\"", "25%"),
        ("25", "25%"),
        ("\"12.5%\"", "12.5%"),
        ("12.25", "12.25%"),
        ("0", "0%"),
        ("\"100 %\"", "100%"),
    ] {
        let spec = parse(&format!(
            "name = \"r\"\nrelease = \"x\"\n[groups]\ncount = 1\nsuccess = {{ threshold = {text} }}\n"
        ));
        let Some(GroupsSpec::Count { success, .. }) = spec.groups() else {
            panic!("count spec")
        };
        let Threshold::Share(share) = success.threshold else {
            panic!("share threshold")
        };
        assert_eq!(share.to_string(), want, "{text}");
    }
}

#[test]
fn errors_name_the_field_and_value() {
    let base = "name = \"r\"\nrelease = \"x\"\n";
    let cases: &[(&str, &str)] = &[
        (
            "[groups]\ncount = 1\nsuccess = { threshold = \"120%\" }\n",
            "groups.success.threshold: \"120%\" is not a percentage from 0% to 100%",
        ),
        (
            "[groups]\n[[groups.group]]\npercent = 50\n[[groups.group]]\npercent = 0\n",
            "groups.group[1].percent: 0 is not a percentage above 0% and at most 100%",
        ),
        (
            "[groups]\ncount = 1\nerror = { threshold = -5 }\n",
            "groups.error.threshold: -5 is not",
        ),
        (
            "[groups]\ncount = 1\nerror = { threshold = \"abc\" }\n",
            "groups.error.threshold: \"abc\" is not",
        ),
        (
            "[groups]\ncount = 1\nerror = { action = \"explode\" }\n",
            "groups.error.action: \"explode\" is not one of \"pause\", \"stop\", \"rollback\"",
        ),
        (
            "[groups]\ncount = 1\nsuccess = { action = \"go\" }\n",
            "groups.success.action: \"go\" is not one of",
        ),
        (
            "[groups]\ncount = 0\n",
            "groups.count: 0 is not from 1 to 1000",
        ),
        ("[groups]\ncount = 5000\n", "groups.count: 5000"),
        ("[groups]\n", "set `count` or at least one"),
        (
            "[groups]\ncount = 2\n[[groups.group]]\nname = \"a\"\n",
            "either `count` or",
        ),
        (
            "select = \"env in ()\"\n[groups]\ncount = 1\n",
            "select: selector \"env in ()\"",
        ),
        (
            "[groups]\n[[groups.group]]\nselect = \"env=\"\n",
            "groups.group[0].select: selector \"env=\": expected a label value at position 4",
        ),
        (
            "[groups]\n[[groups.group]]\nname = \"a b\"\n",
            "groups.group[0].name: group name \"a b\"",
        ),
        (
            "[groups]\n[[groups.group]]\nname = \"a\"\n[[groups.group]]\nname = \"a\"\n",
            "groups.group[1].name: group name \"a\" is already used by groups.group[0]",
        ),
        ("[groups]\ncount = 1\ncont = 2\n", "unknown field `cont`"),
        (
            "[groups]\n[[groups.group]]\npercnt = 2\n",
            "unknown field `percnt`",
        ),
    ];
    for (tail, want) in cases {
        let e = error(&format!("{base}{tail}"));
        assert!(
            e.contains(want),
            "error for {tail:?} was {e:?}, expected it to contain {want:?}"
        );
    }
    let e = error("name = \"fw/2\"\nrelease = \"x\"\n[groups]\ncount = 1\n");
    assert!(e.starts_with("name: rollout name \"fw/2\""), "{e}");
    let e = error("name = \"r\"\nrelease = \"\"\n[groups]\ncount = 1\n");
    assert!(
        e.starts_with("release: release name must not be empty"),
        "{e}"
    );
    let e = error("name = \"r\"\n[groups]\ncount = 1\n");
    assert!(e.contains("missing field `release`"), "{e}");
}

#[test]
fn percent_arithmetic_is_exact() {
    let p = Percent::from_basis_points(5_000).expect("50%");
    assert_eq!(p.of_rounded_up(30), 15);
    assert_eq!(p.of_rounded_up(31), 16);
    assert_eq!(p.of_rounded_up(1), 1);
    assert!(p.reached_by(15, 30));
    assert!(!p.exceeded_by(15, 30));
    assert!(p.exceeded_by(16, 30));
    assert_eq!(Percent::from_basis_points(10_001), None);
}

const BASE: &str = "name = \"r\"\nrelease = \"x\"\n";

fn with(tail: &str) -> RolloutSpec {
    parse(&format!("{BASE}{tail}"))
}

fn pct(p: u32) -> Percent {
    Percent::from_basis_points(p * 100).expect("valid percent")
}

#[test]
fn top_level_keys_become_policies() {
    let spec = with(
        r#"
action = "time_forced"
force_at = "2026-11-22T02:00:00Z"
start_at = 1795309200
weight = 900
timeout = "30m"
retry = { attempts = 2, backoff = "45s" }
offline = { fail_after = "10m" }
rate = { base = 5, factor = 1.5, every = 20, max = 100 }
soak = "10m"
unavailable_period = 30
[[window]]
cron = "0 2 * * *"
duration = "3h"
tz = "Europe/Berlin"
[[window]]
cron = "0 14 * * 6"
duration = "1h"
[groups]
count = 1
dynamic = true
"#,
    );
    let p = &spec.policies;
    assert_eq!(p.action, ActionType::TimeForced { at: 1_795_312_800 });
    assert_eq!(p.start_at, Some(1_795_309_200));
    assert_eq!(p.weight, 900);
    assert_eq!(p.timeout, Some(1800));
    assert_eq!(
        p.retry,
        Some(Retry {
            attempts: 2,
            backoff: 45
        })
    );
    assert_eq!(p.offline, OfflinePolicy::Fail { grace: 600 });
    assert_eq!(
        p.rate,
        Some(RateLimit {
            base: 5.0,
            factor: 1.5,
            every: 20,
            max: Some(100.0)
        })
    );
    assert_eq!(p.soak, 600);
    assert_eq!(p.unavailable_period, 30);
    assert_eq!(p.windows.len(), 2);
    assert_eq!(p.windows[0].tz, "Europe/Berlin");
    assert_eq!(p.windows[0].duration, 3 * 3600);
    assert_eq!(p.windows[1].tz, "UTC", "UTC unless the window names a zone");
    assert!(p.dynamic);
    assert_eq!(p.max_unavailable_groups, Budget::Count(0));
}

#[test]
fn policy_defaults_and_simple_forms() {
    let spec = with("action = \"soft\"\noffline = \"skip\"\nretry = { attempts = 1 }\nrate = { base = 2 }\n[groups]\ncount = 1\n");
    let p = &spec.policies;
    assert_eq!(p.action, ActionType::Soft);
    assert_eq!(p.offline, OfflinePolicy::Skip);
    assert_eq!(p.weight, DEFAULT_WEIGHT);
    assert_eq!(
        p.retry,
        Some(Retry {
            attempts: 1,
            backoff: DEFAULT_RETRY_BACKOFF
        })
    );
    let rate = p.rate.expect("rate");
    assert_eq!((rate.factor, rate.every, rate.max), (2.0, 10, None));
    assert_eq!(p.unavailable_period, 0, "0 outside [rolling]");
    assert!(!p.dynamic);
    assert_eq!(p.unknown_devices, UnknownDevices::Exclude);
    let spec = with("unknown_devices = \"refuse\"\n[groups]\ncount = 1\n");
    assert_eq!(spec.policies.unknown_devices, UnknownDevices::Refuse);
    let spec = with("action = \"download_only\"\noffline = \"wait\"\n[groups]\ncount = 1\n");
    assert_eq!(spec.policies.action, ActionType::DownloadOnly);
    assert_eq!(spec.policies.offline, OfflinePolicy::Wait);
}

#[test]
fn times_are_rfc3339_with_offsets_or_unix_seconds() {
    assert_eq!(rfc3339("2026-11-22T02:00:00Z"), Some(1_795_312_800));
    assert_eq!(rfc3339("2026-11-22T02:00:00+01:00"), Some(1_795_309_200));
    assert_eq!(rfc3339("2026-11-22t02:00:00.750z"), Some(1_795_312_800));
    assert_eq!(rfc3339("2024-02-29T23:59:59Z"), Some(1_709_251_199));
    assert_eq!(rfc3339("1970-01-01T00:00:00Z"), Some(0));
    for bad in [
        "2023-02-29T00:00:00Z",
        "2026-13-01T00:00:00Z",
        "2026-11-22T24:00:00Z",
        "2026-11-22T02:00:00",
        "2026-11-22 02:00Z",
        "1969-12-31T23:59:59Z",
        "2026-11-22T02:00:00+1:00",
    ] {
        assert_eq!(rfc3339(bad), None, "{bad}");
    }
    // An unquoted TOML datetime works too.
    let spec = with("start_at = 2026-11-22T02:00:00Z\n[groups]\ncount = 1\n");
    assert_eq!(spec.policies.start_at, Some(1_795_312_800));
}

#[test]
fn error_conditions_take_counts_samples_classes_and_actions() {
    let spec = with(
        "[groups]\ncount = 1\nerror = { count = 3, min_sample = 5, classes = [\"timed_out\"], action = \"rollback\" }\n",
    );
    let Some(GroupsSpec::Count { error, .. }) = spec.groups() else {
        panic!("count spec")
    };
    assert_eq!(
        error,
        &Some(ErrorCondition {
            percent: None,
            count: Some(3),
            min_sample: 5,
            classes: FailureClasses {
                failed: false,
                timed_out: true,
                refused: false
            },
            action: ErrorAction::Rollback
        }),
        "with only a count, no percentage applies"
    );
    let spec = with("[groups]\ncount = 1\nerror = { action = \"stop\" }\n");
    let Some(GroupsSpec::Count { error, .. }) = spec.groups() else {
        panic!("count spec")
    };
    let error = error.as_ref().expect("error condition");
    assert_eq!(
        error.percent,
        Some(Percent::ZERO),
        "fires on the first failure"
    );
    assert_eq!(error.classes, FailureClasses::default());
    assert_eq!(error.action, ErrorAction::Stop);
}

#[test]
fn partitions_defaults_and_manual_partitions() {
    let spec = with("[partitions]\n");
    let Strategy::Partitions(p) = &spec.strategy else {
        panic!("partitions")
    };
    assert_eq!(spec.vocabulary(), "partitions");
    assert_eq!(p.max_unavailable, Budget::Percent(Percent::HUNDRED));
    assert_eq!(p.auto_partition_size, Budget::Percent(pct(25)));
    assert_eq!(p.auto_partition_threshold, 200);
    assert_eq!(p.max_new, 50);
    assert!(p.partitions.is_empty() && p.error.is_none());
    assert_eq!(spec.policies.max_unavailable_groups, Budget::Count(0));

    let spec = with(
        r#"
[partitions]
max_unavailable = "10%"
max_unavailable_partitions = 1
max_new = 20
error = { threshold = "5%", action = "stop" }
[[partitions.partition]]
name = "pilots"
devices = ["dev-2", "dev-1"]
max_unavailable = 0
[[partitions.partition]]
select = "env=staging"
[[partitions.partition]]
name = "lab"
group = "lab-boxes"
[[partitions.partition]]
name = "west"
group_select = "region=west"
"#,
    );
    let Strategy::Partitions(p) = &spec.strategy else {
        panic!("partitions")
    };
    assert_eq!(spec.policies.max_unavailable_groups, Budget::Count(1));
    assert_eq!(p.max_new, 20);
    assert_eq!(p.error.as_ref().map(|e| e.action), Some(ErrorAction::Stop));
    let names: Vec<&str> = p.partitions.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["pilots", "partition-2", "lab", "west"]);
    assert_eq!(p.partitions[0].max_unavailable, Budget::Count(0));
    assert_eq!(
        p.partitions[1].max_unavailable,
        Budget::Percent(pct(10)),
        "falls back to [partitions] max_unavailable"
    );
    assert_eq!(
        p.partitions[0].members,
        PartitionMembers::Devices(vec!["dev-2".into(), "dev-1".into()])
    );
    assert!(
        matches!(&p.partitions[1].members, PartitionMembers::Select(s) if s.to_string() == "env=staging")
    );
    assert_eq!(
        p.partitions[2].members,
        PartitionMembers::Group("lab-boxes".into())
    );
    assert!(
        matches!(&p.partitions[3].members, PartitionMembers::GroupSelect(s) if s.to_string() == "region=west")
    );
}

#[test]
fn rolling_defaults_and_picks() {
    let spec = with("[rolling]\n");
    let Strategy::Rolling(r) = &spec.strategy else {
        panic!("rolling")
    };
    assert_eq!(spec.vocabulary(), "rolling");
    assert_eq!(r.max_unavailable, Budget::Percent(pct(25)));
    assert_eq!(r.pick, Pick::All);
    assert_eq!(spec.policies.unavailable_period, 60, "KubeFleet's default");

    let spec =
        with("[rolling]\nmax_unavailable = 2\nunavailable_period = \"5m\"\npick = { n = 3 }\n");
    let Strategy::Rolling(r) = &spec.strategy else {
        panic!("rolling")
    };
    assert_eq!(r.max_unavailable, Budget::Count(2));
    assert_eq!(r.pick, Pick::N(3));
    assert_eq!(spec.policies.unavailable_period, 300);

    let spec = with("unavailable_period = 0\n[rolling]\npick = { fixed = [\"b\", \"a\"] }\n");
    let Strategy::Rolling(r) = &spec.strategy else {
        panic!("rolling")
    };
    assert_eq!(r.pick, Pick::Fixed(vec!["b".into(), "a".into()]));
    assert_eq!(
        spec.policies.unavailable_period, 0,
        "an explicit top-level value wins over the default"
    );
}

const STRATEGY: &str = r#"
[[stage]]
name = "staging"
select = "environment=staging"
after = { wait = "1h" }
[[stage]]
name = "canary"
select = "environment=canary"
after = { approval = true }
[[stage]]
name = "production"
select = "environment=production"
sort_by = "order"
max_concurrency = 2
before = { approval = true }
after = { approval = true, wait = "1h" }
"#;

#[test]
fn staged_inline_stages_and_gates() {
    let text = STRATEGY.replace("[[stage]]", "[[staged.stage]]");
    let spec = with(&format!("[staged]\n{text}"));
    assert_eq!(spec.vocabulary(), "staged");
    assert_eq!(spec.staged_strategy_name(), None);
    let stages = spec.staged_stages().expect("inline stages");
    assert_eq!(stages.len(), 3);
    assert_eq!(
        stages[0].after,
        Gate {
            approval: false,
            wait: 3600
        }
    );
    assert_eq!(
        stages[0].max_concurrency, 1,
        "one device at a time by default"
    );
    assert_eq!(
        stages[1].after,
        Gate {
            approval: true,
            wait: 0
        }
    );
    assert_eq!(stages[2].sort_by.as_deref(), Some("order"));
    assert_eq!(stages[2].max_concurrency, 2);
    assert_eq!(
        stages[2].before,
        Gate {
            approval: true,
            wait: 0
        }
    );
    assert_eq!(
        stages[2].after,
        Gate {
            approval: true,
            wait: 3600
        }
    );
    let Strategy::Staged(s) = &spec.strategy else {
        panic!("staged")
    };
    assert_eq!(
        s.error.action,
        ErrorAction::Stop,
        "a failed device fails the run"
    );
    assert_eq!(s.error.percent, Some(Percent::ZERO));
}

#[test]
fn staged_strategy_by_name_is_resolved_into_a_snapshot() {
    let mut spec =
        with("[staged]\nstrategy = \"example-strategy\"\nerror = { threshold = \"10%\" }\n");
    assert_eq!(spec.staged_strategy_name(), Some("example-strategy"));
    assert_eq!(spec.staged_stages(), None);
    let mut stored = StagedStrategy::from_toml("example-strategy", STRATEGY).expect("strategy");
    assert_eq!(stored.stages.len(), 3);
    spec.resolve_strategy(&stored);
    assert_eq!(spec.staged_strategy_name(), None, "resolved");
    assert_eq!(spec.staged_stages(), Some(stored.stages.as_slice()));
    // Changing the stored strategy afterwards does not change the rollout's snapshot.
    stored.stages.pop();
    assert_eq!(spec.staged_stages().map(<[StageSpec]>::len), Some(3));
    let Strategy::Staged(s) = &spec.strategy else {
        panic!("staged")
    };
    assert_eq!(s.strategy.as_deref(), Some("example-strategy"));
    assert_eq!(
        s.error.action,
        ErrorAction::Pause,
        "[staged] error replaces the default"
    );
    // Strategies with the same stages compare equal.
    let again = StagedStrategy::from_toml("example-strategy", STRATEGY).expect("strategy");
    assert_eq!(
        again.stages,
        StagedStrategy::from_toml("other", STRATEGY)
            .expect("strategy")
            .stages
    );
}

#[test]
fn every_vocabulary_round_trips_through_json() {
    let staged = format!(
        "[staged]\n{}",
        STRATEGY.replace("[[stage]]", "[[staged.stage]]")
    );
    for tail in [
        "[partitions]\n[[partitions.partition]]\ndevices = [\"a\"]\n",
        "[rolling]\npick = { fixed = [\"a\"] }\n",
        "[staged]\nstrategy = \"s\"\n",
        staged.as_str(),
    ] {
        let spec = with(tail);
        let json = serde_json::to_string(&spec).expect("encodes");
        let back: RolloutSpec = serde_json::from_str(&json).expect("decodes");
        assert_eq!(back, spec, "{tail}");
    }
}

#[test]
fn new_errors_name_the_field_and_value() {
    let cases: &[(&str, &str)] = &[
        ("", "set exactly one of [groups], [partitions], [rolling] or [staged]; found none"),
        ("[groups]\ncount = 1\n[rolling]\n", "found [groups] and [rolling]"),
        ("action = \"later\"\n[rolling]\n", "action: \"later\" is not one of \"forced\", \"soft\", \"download_only\", \"time_forced\""),
        ("action = \"time_forced\"\n[rolling]\n", "action = \"time_forced\" needs force_at"),
        ("force_at = 5\n[rolling]\n", "force_at = 5: force_at is only used with action = \"time_forced\""),
        ("action = \"time_forced\"\nforce_at = \"tomorrow\"\n[rolling]\n", "force_at: \"tomorrow\" is not an RFC 3339 time"),
        ("start_at = -1\n[rolling]\n", "start_at: -1 is not an RFC 3339 time"),
        ("weight = 2000\n[rolling]\n", "weight: 2000 is not from 0 to 1000"),
        ("timeout = \"30x\"\n[rolling]\n", "timeout: \"30x\" is not a duration: unknown unit \"x\""),
        ("timeout = \"0s\"\n[rolling]\n", "timeout: \"0s\" is not a duration: a timeout must be longer than 0s"),
        ("soak = true\n[rolling]\n", "soak: true is not a duration"),
        ("retry = { attempts = -1 }\n[rolling]\n", "retry.attempts: -1 is not from 0 to 100"),
        ("retry = { attempts = 1, backoff = \"x\" }\n[rolling]\n", "retry.backoff: \"x\" is not a duration"),
        ("offline = \"later\"\n[rolling]\n", "offline: \"later\" is not one of \"wait\", \"skip\""),
        ("unknown_devices = \"wait\"\n[rolling]\n", "unknown_devices: \"wait\" is not one of \"exclude\", \"refuse\""),
        ("offline = { grace = \"1m\" }\n[rolling]\n", "offline: { grace = \"1m\" } is not \"wait\", \"skip\" or { fail_after = \"10m\" }"),
        ("offline = { fail_after = \"soon\" }\n[rolling]\n", "offline.fail_after: \"soon\" is not a duration"),
        ("rate = { base = 0 }\n[rolling]\n", "rate.base: 0 is not a number of devices per minute above 0"),
        ("rate = { base = 5, factor = 0.5 }\n[rolling]\n", "rate.factor: 0.5 is not a factor of at least 1"),
        ("rate = { base = 5, every = 0 }\n[rolling]\n", "rate.every: 0 is not at least 1"),
        ("rate = { base = 5, max = 2 }\n[rolling]\n", "rate.max: 2 is not a number of devices per minute of at least rate.base (5)"),
        ("rate = { base = 5, burst = 2 }\n[rolling]\n", "unknown field `burst`"),
        ("[[window]]\ncron = \"0 2 * * *\"\nduration = \"0s\"\n[rolling]\n", "window[0].duration: \"0s\" is not a duration: a window must stay open longer than 0s"),
        ("[[window]]\ncron = \"0 2 * * *\"\n[rolling]\n", "missing field `duration`"),
        ("unavailable_period = \"1m\"\n[rolling]\nunavailable_period = \"2m\"\n", "rolling.unavailable_period = \"2m\": unavailable_period is also set at the top level"),
        ("[groups]\ncount = 1\nerror = { count = 0 }\n", "groups.error.count: 0 is not at least 1"),
        ("[groups]\ncount = 1\nerror = { min_sample = -2 }\n", "groups.error.min_sample: -2 is not at least 0"),
        ("[groups]\ncount = 1\nerror = { classes = [\"failed\", \"lost\"] }\n", "groups.error.classes[1]: \"lost\" is not one of \"failed\", \"timed_out\", \"refused\""),
        ("[groups]\ncount = 1\nerror = { classes = [] }\n", "groups.error.classes: [] is not a list naming at least one"),
        ("[groups]\ncount = 1\nsuccess = { count = 2 }\n", "unknown field `count`"),
        ("[groups]\ncount = 1\ndynamic = \"yes\"\n", "dynamic"),
        ("[partitions]\nmax_unavailable = \"ten\"\n", "partitions.max_unavailable: \"ten\" is not a number of devices or a percentage from 0% to 100%"),
        ("[partitions]\nmax_unavailable = 2.5\n", "partitions.max_unavailable: 2.5 is not a number of devices"),
        ("[partitions]\nmax_unavailable_partitions = \"150%\"\n", "partitions.max_unavailable_partitions: \"150%\" is not"),
        ("[partitions]\nauto_partition_size = 0\n", "partitions.auto_partition_size: 0 is not a number of devices (at least 1) or a percentage above 0%"),
        ("[partitions]\nauto_partition_size = \"0%\"\n", "partitions.auto_partition_size: \"0%\" is not"),
        ("[partitions]\nauto_partition_threshold = -1\n", "partitions.auto_partition_threshold: -1 is not at least 0"),
        ("[partitions]\nmax_new = 0\n", "partitions.max_new: 0 is not at least 1"),
        ("[partitions]\nerror = { action = \"halt\" }\n", "partitions.error.action: \"halt\" is not one of"),
        ("[partitions]\n[[partitions.partition]]\nname = \"a\"\n", "partitions.partition[0]: set exactly one of devices, select, group, group_select; found none"),
        ("[partitions]\n[[partitions.partition]]\nselect = \"a=b\"\ngroup = \"g\"\n", "partitions.partition[0]: set exactly one of devices, select, group, group_select; found select and group"),
        ("[partitions]\n[[partitions.partition]]\ndevices = []\n", "partitions.partition[0].devices: [] is not a list of at least one device id"),
        ("[partitions]\n[[partitions.partition]]\ndevices = [\"a\", \"b\", \"a\"]\n", "partitions.partition[0].devices[2]: device \"a\" is already used by partitions.partition[0].devices[0]"),
        ("[partitions]\n[[partitions.partition]]\ndevices = [\"a/b\"]\n", "partitions.partition[0].devices[0]: device id \"a/b\""),
        ("[partitions]\n[[partitions.partition]]\ngroup_select = \"x in ()\"\n", "partitions.partition[0].group_select: selector \"x in ()\""),
        ("[partitions]\n[[partitions.partition]]\nname = \"p\"\nselect = \"a=b\"\n[[partitions.partition]]\nname = \"p\"\nselect = \"a=c\"\n", "partitions.partition[1].name: partition name \"p\" is already used by partitions.partition[0]"),
        ("[partitions]\n[[partitions.partition]]\nselect = \"a=b\"\nmax_unavailable = -1\n", "partitions.partition[0].max_unavailable: -1 is not"),
        ("[partitions]\n[[partitions.partition]]\nclusterName = \"a\"\n", "unknown field `clusterName`"),
        ("[rolling]\nmax_surge = 1\n", "rolling.max_surge = 1: flotilla updates devices in place: a device cannot run two releases side by side and there is no spare device to surge onto"),
        ("[rolling]\nmax_unavailable = 0\n", "rolling.max_unavailable: 0 is not a number of devices (at least 1)"),
        ("[rolling]\npick = \"some\"\n", "rolling.pick: \"some\" is not \"all\", { n = 3 } or { fixed = [\"dev-1\", \"dev-2\"] }"),
        ("[rolling]\npick = { n = 0 }\n", "rolling.pick.n: 0 is not at least 1"),
        ("[rolling]\npick = { n = \"3\" }\n", "rolling.pick.n: \"3\" is not a number of devices"),
        ("[rolling]\npick = { fixed = [\"a\", 3] }\n", "rolling.pick.fixed[1]: 3 is not a device id"),
        ("[rolling]\npick = { fixed = [] }\n", "rolling.pick.fixed: [] is not a list of at least one device id"),
        ("[staged]\n", "staged: set exactly one of strategy, [[staged.stage]]; found none"),
        ("[staged]\nstrategy = \"s\"\n[[staged.stage]]\nname = \"a\"\n", "found strategy and [[staged.stage]]"),
        ("[staged]\nstrategy = \"a b\"\n", "staged.strategy: strategy name \"a b\""),
        ("[staged]\nerror = { threshold = \"x\" }\nstrategy = \"s\"\n", "staged.error.threshold: \"x\" is not a percentage"),
        ("[staged]\n[[staged.stage]]\nname = \"a\"\n[[staged.stage]]\nname = \"a\"\n", "staged.stage[1].name: stage name \"a\" is already used by staged.stage[0]"),
        ("[staged]\n[[staged.stage]]\nname = \"\"\n", "staged.stage[0].name: stage name must not be empty"),
        ("[staged]\n[[staged.stage]]\nname = \"a\"\nmax_concurrency = 0\n", "staged.stage[0].max_concurrency: 0 is not at least 1"),
        ("[staged]\n[[staged.stage]]\nname = \"a\"\nsort_by = \"\"\n", "staged.stage[0].sort_by: \"\" is not a label key"),
        ("[staged]\n[[staged.stage]]\nname = \"a\"\nselect = \"env=\"\n", "staged.stage[0].select: selector \"env=\""),
        ("[staged]\n[[staged.stage]]\nname = \"a\"\nbefore = { wait = \"1h\" }\n", "staged.stage[0].before.wait = \"1h\": a stage cannot wait before it starts"),
        ("[staged]\n[[staged.stage]]\nname = \"a\"\nafter = { wait = \"1 hour\" }\n", "staged.stage[0].after.wait: \"1 hour\" is not a duration"),
        ("[staged]\n[[staged.stage]]\nname = \"a\"\nafter = { approval = true, task = \"x\" }\n", "unknown field `task`"),
    ];
    let mut wrong = Vec::new();
    for (tail, want) in cases {
        match RolloutSpec::from_toml(&format!("{BASE}{tail}"), &SystemZones) {
            Ok(_) => wrong.push(format!("{tail:?} was accepted, expected {want:?}")),
            Err(e) if !e.to_string().contains(want) => {
                wrong.push(format!("{tail:?} gave {e:?}, expected {want:?}"))
            }
            Err(_) => {}
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));

    let e = StagedStrategy::from_toml("s", "").expect_err("no stages");
    assert_eq!(
        e.to_string(),
        "stage: [] is not a list of at least one [[stage]] entry"
    );
    let e = StagedStrategy::from_toml("a/b", STRATEGY).expect_err("bad name");
    assert!(
        e.to_string().starts_with("strategy: strategy name \"a/b\""),
        "{e}"
    );
    let e = StagedStrategy::from_toml("s", "[[stage]]\nname = \"a\"\n[[stage]]\nname = \"a\"\n")
        .expect_err("duplicate");
    assert_eq!(
        e.to_string(),
        "stage[1].name: stage name \"a\" is already used by stage[0]"
    );
}
