//! `flotilla plan`: the files it loads (fleet, spec, device groups, strategies) and the table it
//! prints.

use flotilla_rollout::zoneinfo::SystemZones;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;

use crate::cli::fleetfile::fleet::*;
use crate::cli::fleetfile::parse::*;
use flotilla_rollout::plan::{
    ErrorAction, ErrorCondition, Gate, Pace, Plan, SuccessAction, SuccessCondition, Threshold,
};
use flotilla_rollout::planner::{self, DeviceGroup};
use flotilla_rollout::spec::{RolloutSpec, StagedStrategy};

pub(super) fn read(what: &'static str, path: &Path) -> Result<String, FleetError> {
    std::fs::read_to_string(path).map_err(|source| FleetError::Read {
        what,
        path: path.to_owned(),
        source,
    })
}

/// Reads and parses a fleet file, keeping the devices it leaves out.
pub fn load_fleet_file(path: &Path) -> Result<Fleet, FleetError> {
    let bytes = std::fs::read(path).map_err(|source| FleetError::Read {
        what: "fleet file",
        path: path.to_owned(),
        source,
    })?;
    parse_fleet_file(&bytes)
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
pub(super) fn resolve_strategy(
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
    let mut fleet = load_fleet_file(&args.fleet)?;
    let groups = match &args.groups {
        Some(path) => load_device_groups(path)?,
        None => Vec::new(),
    };
    fleet.sort_by_id();
    let mut plan = planner::plan(&spec, &fleet.devices(), &[], &groups)?;
    let (unknown, left_out): (Vec<LeftOut>, Vec<LeftOut>) = fleet
        .left_out
        .into_iter()
        .partition(|d| without_state(&d.enrollment));
    let mut unknown: Vec<String> = unknown.into_iter().map(|d| d.id).collect();
    unknown.sort();
    planner::exclude_unknown(&spec, &mut plan, &unknown)?;
    Ok((plan, left_out))
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
                crate::cli::out::outln!("{json}");
                0
            }
            Err(e) => {
                eprintln!("error: cannot encode the plan: {e}");
                1
            }
        },
        Ok(plan) => {
            crate::cli::out::out!("{}", plan_table(&plan));
            for warning in plan.empty_group_warnings() {
                eprintln!("warning: {warning}");
            }
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
        "{} in {}",
        flotilla_rollout::text::count(plan.device_count(), "device"),
        flotilla_rollout::text::count(plan.groups.len(), "group")
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
    if let Some(sites) = &plan.sites {
        for (site, devices) in sites.sites.iter().take(PLAN_SITES) {
            let _ = writeln!(out, "{}", sites.line(site, *devices));
        }
        if sites.sites.len() > PLAN_SITES {
            let _ = writeln!(
                out,
                "… {} more sites (--json lists them all)",
                sites.sites.len() - PLAN_SITES
            );
        }
        if sites.without_site > 0 {
            let _ = writeln!(
                out,
                "{} without label {}: in no site, no site limit applies",
                flotilla_rollout::text::count(sites.without_site, "device"),
                sites.policy.label
            );
        }
    }
    out
}

/// Most site lines the plan table prints.
pub(super) const PLAN_SITES: usize = 50;

pub(super) fn pace_text(pace: &Pace) -> String {
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

pub(super) fn success_text(s: &SuccessCondition) -> String {
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

pub(super) fn error_text(e: &ErrorCondition) -> String {
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

pub(super) fn gates_text(before: &Gate, after: &Gate) -> String {
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
