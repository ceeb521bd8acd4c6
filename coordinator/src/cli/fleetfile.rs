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
use flotilla_rollout::spec::{RolloutSpec, SpecError};

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
    #[error(transparent)]
    Plan(#[from] PlanError),
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

/// Parses a fleet file's text.
pub fn parse_fleet(text: &str) -> Result<Vec<FleetDevice>, FleetError> {
    let value: Value = serde_json::from_str(text).map_err(FleetError::Json)?;
    let Value::Array(entries) = value else {
        return Err(FleetError::NotArray {
            found: kind(&value),
        });
    };
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut fleet = Vec::with_capacity(entries.len());
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
        if let Some(key) = map
            .keys()
            .find(|k| !matches!(k.as_str(), "id" | "labels" | "hardware_id"))
        {
            return Err(bad(
                "",
                format!("unknown field {key:?}; expected id, labels, hardware_id"),
            ));
        }
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
        if let Some(&first) = seen.get(&id) {
            return Err(FleetError::Duplicate { index, id, first });
        }
        seen.insert(id.clone(), index);
        fleet.push(FleetDevice {
            id,
            labels,
            hardware_id,
        });
    }
    Ok(fleet)
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
pub struct PlanArgs {
    /// The rollout spec (TOML).
    #[arg(long)]
    pub spec: PathBuf,
    /// The fleet: a JSON array of {"id", "labels", "hardware_id"}.
    #[arg(long)]
    pub fleet: PathBuf,
    /// Named device groups that partitions refer to (JSON array).
    #[arg(long)]
    pub groups: Option<PathBuf>,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Plans a spec over a fleet file. The release's hardware list is not known offline, so no
/// device is excluded by hardware.
pub fn plan_files(args: &PlanArgs) -> Result<Plan, FleetError> {
    let spec = load_spec(&args.spec)?;
    let fleet = load_fleet(&args.fleet)?;
    let groups = match &args.groups {
        Some(path) => load_device_groups(path)?,
        None => Vec::new(),
    };
    Ok(planner::plan(&spec, &fleet, &[], &groups)?)
}

/// Runs `flotilla plan`: prints the plan and returns the exit code (1 on error, with the error
/// on stderr).
pub fn run_plan(args: &PlanArgs) -> i32 {
    match plan_files(args) {
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
