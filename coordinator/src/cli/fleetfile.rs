//! Fleet files and `flotilla plan`: what a rollout spec would make of a fleet, without a
//! coordinator.
//!
//! A fleet file is a JSON array of devices as their retained state would describe them:
//!
//! ```json
//! [
//!   {"id": "dev-001", "labels": {"env": "canary", "site": "ber"}, "hardware_id": "pi4"},
//!   {"id": "dev-002", "labels": {"env": "prod"}}
//! ]
//! ```
//!
//! `hardware_id` defaults to `any`; `labels` defaults to none. Every error names the entry's
//! index and field, and a device id may appear only once. The same file feeds
//! `flotilla simulate` (the `simulate` module).
//!
//! The output of `flotilla devices --json` is a fleet file as it stands: its other fields
//! (`online`, `installed`, `rollout`, `phase`, `reason`) are read past, and a device whose
//! `enrollment` is not accepted is left out, as the coordinator plans accepted devices only.
//! A staged spec that names a stored strategy is planned with that strategy's stages from
//! `--strategy-file` (`flotilla strategy show NAME` prints them), so `plan` stays offline
//! (docs/decisions/0018-cli-settings-and-offline-plan.md).

use flotilla_rollout::zoneinfo::SystemZones;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;
use serde_json::Value;

use flotilla_rollout::plan::{
    ErrorAction, ErrorCondition, Gate, Pace, Plan, SuccessAction, SuccessCondition, Threshold,
};
use flotilla_rollout::planner::{self, DeviceGroup, FleetDevice, PlanError};
use flotilla_rollout::spec::{RolloutSpec, SpecError, StagedStrategy};

/// The hardware id of a fleet entry that does not name one.
pub const ANY_HARDWARE: &str = "any";

/// How many device ids the plan table shows per group.
const FIRST_DEVICES: usize = 5;

/// Why a fleet file, a spec or a device-group file could not be used offline.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("cannot read {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("fleet file is not JSON: {0}")]
    Json(serde_json::Error),
    #[error("fleet file: expected a JSON array of devices, found {found}")]
    NotArray { found: &'static str },
    #[error("fleet[{index}]{field}: {problem}")]
    Entry {
        index: usize,
        /// `.id`, `.labels.env`…, empty for the entry itself.
        field: String,
        problem: String,
    },
    #[error("fleet[{index}].id: {id:?} is already used by fleet[{first}]")]
    Duplicate {
        index: usize,
        id: String,
        first: usize,
    },
    #[error("device groups file {path}: {source}")]
    Groups {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("spec {path}: {source}")]
    Spec {
        path: PathBuf,
        source: Box<SpecError>,
    },
    #[error("strategy file {path}: {source}")]
    Strategy {
        path: PathBuf,
        source: Box<SpecError>,
    },
    #[error("spec {path} names the stored strategy {name:?}; give its stages with --strategy-file FILE (`flotilla strategy show {name} > {name}.toml` writes them)")]
    NeedStrategy { path: PathBuf, name: String },
    #[error("--strategy-file {strategy}: spec {spec} does not name a stored strategy (`[staged]` with `strategy = \"NAME\"`); leave --strategy-file out")]
    UnusedStrategy { strategy: PathBuf, spec: PathBuf },
    #[error(transparent)]
    Plan(#[from] PlanError),
}

/// A device of the fleet file that the coordinator would not plan: its enrollment is not
/// accepted (pending, rejected, revoked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeftOut {
    pub id: String,
    pub enrollment: String,
}

/// A fleet file: the devices a rollout can be planned over, and those left out.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Fleet {
    pub devices: Vec<FleetDevice>,
    pub left_out: Vec<LeftOut>,
}

/// The fields of `flotilla devices --json` (`DeviceSummary`) that planning does not use.
const STATUS_FIELDS: [&str; 5] = ["online", "installed", "rollout", "phase", "reason"];

/// Whether an `enrollment` status text (`accepted`, `accepted, new key pending`, `pending`…)
/// means the coordinator plans the device.
fn is_accepted(enrollment: &str) -> bool {
    enrollment == "accepted" || enrollment.starts_with("accepted,")
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Parses a fleet file's text: the devices to plan over (those left out are dropped).
pub fn parse_fleet(text: &str) -> Result<Vec<FleetDevice>, FleetError> {
    Ok(parse_fleet_file(text)?.devices)
}

/// Parses a fleet file's text: a hand-written fleet, or `flotilla devices --json`.
pub fn parse_fleet_file(text: &str) -> Result<Fleet, FleetError> {
    let value: Value = serde_json::from_str(text).map_err(FleetError::Json)?;
    let Value::Array(entries) = value else {
        return Err(FleetError::NotArray {
            found: kind(&value),
        });
    };
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut fleet = Vec::with_capacity(entries.len());
    let mut left_out = Vec::new();
    for (index, entry) in entries.iter().enumerate() {
        let bad = |field: &str, problem: String| FleetError::Entry {
            index,
            field: field.to_owned(),
            problem,
        };
        let Value::Object(map) = entry else {
            return Err(bad(
                "",
                format!("expected an object, found {}", kind(entry)),
            ));
        };
        let known = |k: &str| {
            matches!(k, "id" | "labels" | "hardware_id" | "enrollment")
                || STATUS_FIELDS.contains(&k)
        };
        if let Some(key) = map.keys().find(|k| !known(k)) {
            return Err(bad(
                "",
                format!(
                    "unknown field {key:?}; expected id, labels, hardware_id (and the other fields of `flotilla devices --json`)"
                ),
            ));
        }
        for field in STATUS_FIELDS {
            let expected = if field == "online" {
                "a boolean"
            } else {
                "a string"
            };
            match map.get(field) {
                None | Some(Value::Null) => {}
                Some(Value::Bool(_)) if field == "online" => {}
                Some(Value::String(_)) if field != "online" => {}
                Some(other) => {
                    return Err(bad(
                        &format!(".{field}"),
                        format!("expected {expected}, found {}", kind(other)),
                    ))
                }
            }
        }
        let enrollment = match map.get("enrollment") {
            None | Some(Value::Null) => None,
            Some(Value::String(e)) => Some(e.clone()),
            Some(other) => {
                return Err(bad(
                    ".enrollment",
                    format!("expected a string, found {}", kind(other)),
                ))
            }
        };
        let id = match map.get("id") {
            Some(Value::String(id)) => id.clone(),
            Some(other) => {
                return Err(bad(
                    ".id",
                    format!("expected a string, found {}", kind(other)),
                ))
            }
            None => return Err(bad(".id", "missing".into())),
        };
        flotilla_protocol::ids::validate_id("device id", &id)
            .map_err(|e| bad(".id", e.to_string()))?;
        if let Some(&first) = seen.get(&id) {
            return Err(FleetError::Duplicate { index, id, first });
        }
        seen.insert(id.clone(), index);
        if let Some(enrollment) = enrollment.filter(|e| !is_accepted(e)) {
            left_out.push(LeftOut { id, enrollment });
            continue;
        }
        let mut labels = BTreeMap::new();
        match map.get("labels") {
            None | Some(Value::Null) => {}
            Some(Value::Object(l)) => {
                for (k, v) in l {
                    let Value::String(v) = v else {
                        return Err(bad(
                            &format!(".labels.{k}"),
                            format!("expected a string, found {}", kind(v)),
                        ));
                    };
                    labels.insert(k.clone(), v.clone());
                }
            }
            Some(other) => {
                return Err(bad(
                    ".labels",
                    format!("expected an object, found {}", kind(other)),
                ))
            }
        }
        let hardware_id = match map.get("hardware_id") {
            None | Some(Value::Null) => ANY_HARDWARE.to_owned(),
            Some(Value::String(h)) if !h.is_empty() => h.clone(),
            Some(Value::String(_)) => return Err(bad(".hardware_id", "must not be empty".into())),
            Some(other) => {
                return Err(bad(
                    ".hardware_id",
                    format!("expected a string, found {}", kind(other)),
                ))
            }
        };
        fleet.push(FleetDevice {
            id,
            labels,
            hardware_id,
        });
    }
    Ok(Fleet {
        devices: fleet,
        left_out,
    })
}

fn read(what: &'static str, path: &Path) -> Result<String, FleetError> {
    std::fs::read_to_string(path).map_err(|source| FleetError::Read {
        what,
        path: path.to_owned(),
        source,
    })
}

/// Reads and parses a fleet file.
pub fn load_fleet(path: &Path) -> Result<Vec<FleetDevice>, FleetError> {
    parse_fleet(&read("fleet file", path)?)
}

/// Reads and parses a fleet file, keeping the devices it leaves out.
pub fn load_fleet_file(path: &Path) -> Result<Fleet, FleetError> {
    parse_fleet_file(&read("fleet file", path)?)
}

/// Reads and validates a rollout spec file.
pub fn load_spec(path: &Path) -> Result<RolloutSpec, FleetError> {
    RolloutSpec::from_toml(&read("spec", path)?, &SystemZones).map_err(|e| FleetError::Spec {
        source: Box::new(e),
        path: path.to_owned(),
    })
}

/// Reads a device-groups file: a JSON array of `{"name", "select", "labels"}` as
/// `flotilla group` stores them.
pub fn load_device_groups(path: &Path) -> Result<Vec<DeviceGroup>, FleetError> {
    serde_json::from_str(&read("device groups file", path)?).map_err(|source| FleetError::Groups {
        path: path.to_owned(),
        source,
    })
}

/// `flotilla plan`.
#[derive(Debug, Args)]
#[command(after_long_help = "\
Plan against the real fleet, still offline:
  flotilla devices --json > fleet.json
  flotilla group list --json > groups.json          # when partitions name device groups
  flotilla strategy show NAME > NAME.toml           # when a [staged] spec names a strategy
  flotilla plan --spec SPEC --fleet fleet.json --groups groups.json --strategy-file NAME.toml")]
pub struct PlanArgs {
    /// The rollout spec (TOML).
    #[arg(long)]
    pub spec: PathBuf,
    /// The fleet: a JSON array of {"id", "labels", "hardware_id"}, or the output of
    /// `flotilla devices --json` (devices not accepted are left out).
    #[arg(long)]
    pub fleet: PathBuf,
    /// Named device groups that partitions refer to (JSON array, as `flotilla group list
    /// --json` prints them).
    #[arg(long)]
    pub groups: Option<PathBuf>,
    /// The stages of the stored strategy a `[staged]` spec names (`strategy = "NAME"`), as
    /// `flotilla strategy show NAME` prints them.
    #[arg(long, value_name = "FILE")]
    pub strategy_file: Option<PathBuf>,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Reads a stored strategy's stages (`flotilla strategy show NAME`) into a staged spec that
/// names the strategy, as the coordinator does when the rollout is created.
fn resolve_strategy(
    spec: &mut RolloutSpec,
    spec_path: &Path,
    strategy_file: Option<&Path>,
) -> Result<(), FleetError> {
    match (
        spec.staged_strategy_name().map(str::to_owned),
        strategy_file,
    ) {
        (None, None) => Ok(()),
        (None, Some(path)) => Err(FleetError::UnusedStrategy {
            strategy: path.to_owned(),
            spec: spec_path.to_owned(),
        }),
        (Some(name), None) => Err(FleetError::NeedStrategy {
            path: spec_path.to_owned(),
            name,
        }),
        (Some(name), Some(path)) => {
            let text = read("strategy file", path)?;
            let strategy =
                StagedStrategy::from_toml(&name, &text).map_err(|e| FleetError::Strategy {
                    path: path.to_owned(),
                    source: Box::new(e),
                })?;
            spec.resolve_strategy(&strategy);
            Ok(())
        }
    }
}

/// Plans a spec over a fleet file; also the devices the file leaves out. The release's
/// hardware list is not known offline, so no device is excluded by hardware.
pub fn plan_files(args: &PlanArgs) -> Result<(Plan, Vec<LeftOut>), FleetError> {
    let mut spec = load_spec(&args.spec)?;
    resolve_strategy(&mut spec, &args.spec, args.strategy_file.as_deref())?;
    let fleet = load_fleet_file(&args.fleet)?;
    let groups = match &args.groups {
        Some(path) => load_device_groups(path)?,
        None => Vec::new(),
    };
    let plan = planner::plan(&spec, &fleet.devices, &[], &groups)?;
    Ok((plan, fleet.left_out))
}

/// Runs `flotilla plan`: prints the plan and returns the exit code (1 on error, with the error
/// on stderr). Devices the fleet file leaves out are named on stderr.
pub fn run_plan(args: &PlanArgs) -> i32 {
    let planned = plan_files(args).map(|(plan, left_out)| {
        for d in &left_out {
            eprintln!(
                "left out {}: enrollment {} (the coordinator plans accepted devices only)",
                d.id, d.enrollment
            );
        }
        plan
    });
    match planned {
        Ok(plan) if args.json => match serde_json::to_string_pretty(&plan) {
            Ok(json) => {
                println!("{json}");
                0
            }
            Err(e) => {
                eprintln!("error: cannot encode the plan: {e}");
                1
            }
        },
        Ok(plan) => {
            print!("{}", plan_table(&plan));
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// The plan as a table: group, size, pace, conditions, gates and the first devices.
pub fn plan_table(plan: &Plan) -> String {
    let header = [
        "GROUP",
        "SIZE",
        "PACE",
        "SUCCESS",
        "ERROR",
        "GATES",
        "FIRST DEVICES",
    ];
    let rows: Vec<[String; 7]> = plan
        .groups
        .iter()
        .map(|g| {
            let mut first = g
                .devices
                .iter()
                .take(FIRST_DEVICES)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ");
            if g.devices.len() > FIRST_DEVICES {
                let _ = write!(first, ", … (+{})", g.devices.len() - FIRST_DEVICES);
            }
            [
                g.name.clone(),
                g.devices.len().to_string(),
                pace_text(&g.pace),
                success_text(&g.success),
                g.error.as_ref().map_or_else(|| "-".to_owned(), error_text),
                gates_text(&g.before, &g.after),
                if first.is_empty() { "-".into() } else { first },
            ]
        })
        .collect();
    let mut widths = header.map(str::chars).map(Iterator::count);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i == 1 {
                let _ = write!(text, "{cell:>w$}  ");
            } else if i + 1 == cells.len() {
                text.push_str(cell);
            } else {
                let _ = write!(text, "{cell:w$}  ");
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(header.to_vec());
    for row in &rows {
        line(row.iter().map(String::as_str).collect());
    }
    let _ = writeln!(
        out,
        "{} devices in {} groups",
        plan.device_count(),
        plan.groups.len()
    );
    if !plan.unassigned.is_empty() {
        let _ = writeln!(
            out,
            "{} selected but in no group, not rolled out: {}",
            plan.unassigned.len(),
            plan.unassigned.join(", ")
        );
    }
    for e in &plan.excluded {
        let _ = writeln!(out, "excluded {}: {}", e.device, e.reason);
    }
    out
}

fn pace_text(pace: &Pace) -> String {
    let mut parts = Vec::new();
    if let Some(b) = pace.batch {
        parts.push(format!("batches of {b}"));
    }
    if let Some(g) = pace.gate {
        parts.push(format!("next batch at <= {g} not ready"));
    }
    if let Some(c) = pace.concurrency {
        parts.push(format!("<= {c} at a time"));
    }
    if parts.is_empty() {
        "all at once".into()
    } else {
        parts.join(", ")
    }
}

fn success_text(s: &SuccessCondition) -> String {
    let threshold = match s.threshold {
        Threshold::Share(p) => format!(">= {p} ready"),
        Threshold::AllBut(b) => format!("all but {b} ready"),
    };
    let action = match s.action {
        SuccessAction::Next => "next",
        SuccessAction::Pause => "pause",
    };
    format!("{threshold} -> {action}")
}

fn error_text(e: &ErrorCondition) -> String {
    let mut parts = Vec::new();
    if let Some(p) = e.percent {
        parts.push(format!("> {p}"));
    }
    if let Some(c) = e.count {
        parts.push(format!(">= {c}"));
    }
    let mut text = format!("{} failed", parts.join(" or "));
    if e.min_sample > 0 {
        let _ = write!(text, " (after {})", e.min_sample);
    }
    let action = match e.action {
        ErrorAction::Pause => "pause",
        ErrorAction::Stop => "stop",
        ErrorAction::Rollback => "rollback",
    };
    format!("{text} -> {action}")
}

fn gates_text(before: &Gate, after: &Gate) -> String {
    let mut parts = Vec::new();
    for (when, gate) in [("before", before), ("after", after)] {
        if gate.approval {
            parts.push(format!("approval {when}"));
        }
        if gate.wait > 0 {
            parts.push(format!("wait {}s {when}", gate.wait));
        }
    }
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices_with_defaults() {
        let fleet = parse_fleet(
            r#"[{"id": "dev-1", "labels": {"env": "canary"}, "hardware_id": "pi4"},
                {"id": "dev-2"}]"#,
        )
        .expect("valid");
        assert_eq!(fleet.len(), 2);
        assert_eq!(fleet[0].labels["env"], "canary");
        assert_eq!(fleet[0].hardware_id, "pi4");
        assert_eq!(fleet[1].hardware_id, "any");
        assert!(fleet[1].labels.is_empty());
    }

    #[test]
    fn reads_devices_json_and_leaves_out_devices_not_accepted() {
        let fleet = parse_fleet_file(
            r#"[{"id": "a", "hardware_id": "pi4", "labels": {"env": "prod"}, "online": true,
                 "installed": "fw-1", "rollout": null, "phase": "ready", "reason": null,
                 "enrollment": "accepted"},
                {"id": "b", "hardware_id": "pi4", "labels": {}, "online": false,
                 "installed": null, "enrollment": "accepted, new key pending"},
                {"id": "c", "hardware_id": "", "labels": {}, "online": false,
                 "enrollment": "pending"}]"#,
        )
        .expect("devices --json is a fleet file");
        let ids: Vec<&str> = fleet.devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(
            fleet.left_out,
            [LeftOut {
                id: "c".into(),
                enrollment: "pending".into()
            }]
        );
        let err = parse_fleet(r#"[{"id": "a", "online": "yes"}]"#).expect_err("bad type");
        assert_eq!(
            err.to_string(),
            "fleet[0].online: expected a boolean, found a string"
        );
    }

    #[test]
    fn errors_name_the_index_and_field() {
        let err = |text: &str| parse_fleet(text).expect_err("invalid").to_string();
        assert_eq!(
            err(r#"[{"id": "a"}, {"id": "a"}]"#),
            "fleet[1].id: \"a\" is already used by fleet[0]"
        );
        assert_eq!(err(r#"[{"id": "a"}, {}]"#), "fleet[1].id: missing");
        assert_eq!(
            err(r#"[{"id": 7}]"#),
            "fleet[0].id: expected a string, found a number"
        );
        assert!(
            err(r#"[{"id": "a/b"}]"#).starts_with("fleet[0].id: device id \"a/b\" contains '/'")
        );
        assert_eq!(
            err(r#"[{"id": "a", "labels": {"env": 1}}]"#),
            "fleet[0].labels.env: expected a string, found a number"
        );
        assert!(err(r#"[{"id": "a", "hw": "pi4"}]"#).contains("fleet[0]: unknown field \"hw\""));
        assert_eq!(
            err(r#"{"id": "a"}"#),
            "fleet file: expected a JSON array of devices, found an object"
        );
        assert!(err("[").starts_with("fleet file is not JSON"));
    }

    #[test]
    fn the_table_shows_groups_sizes_and_conditions() {
        let fleet = parse_fleet(
            r#"[{"id": "c1", "labels": {"env": "canary"}}, {"id": "p1"}, {"id": "p2"}]"#,
        )
        .expect("valid");
        let spec = RolloutSpec::from_toml(
            "name = \"r\"\nrelease = \"fw\"\n[groups]\nerror = { threshold = \"20%\" }\n\
             [[groups.group]]\nname = \"canary\"\nselect = \"env=canary\"\n[[groups.group]]\nname = \"rest\"\n", &SystemZones
        )
        .expect("valid spec");
        let plan = planner::plan(&spec, &fleet, &[], &[]).expect("plans");
        let table = plan_table(&plan);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("GROUP"), "{table}");
        assert!(lines[1].starts_with("canary"), "{table}");
        assert!(lines[1].contains(">= 100% ready -> next"), "{table}");
        assert!(lines[1].contains("> 20% failed -> pause"), "{table}");
        assert!(lines[2].ends_with("p1, p2"), "{table}");
        assert!(table.contains("3 devices in 2 groups"), "{table}");
    }
}
