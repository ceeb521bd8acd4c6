//! `flotilla simulate`: the files it reads and the report it prints.

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Args;

use crate::cli::fleetfile;
use crate::cli::out::{out, outln};
use crate::cli::simulate::base::*;
use crate::cli::simulate::run::*;
use crate::cli::simulate::script::*;
use crate::cli::view;
use flotilla_rollout::duration::parse_duration;

// ---------------------------------------------------------------------------------------------
// The command

/// `flotilla simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// The rollout spec (TOML).
    #[arg(long)]
    pub spec: PathBuf,
    /// The fleet: a JSON array of {"id", "labels", "hardware_id"}.
    #[arg(long)]
    pub fleet: PathBuf,
    /// What the devices and the operator do (TOML); without it every device is ready 30s after
    /// its action arrives.
    #[arg(long)]
    pub outcomes: Option<PathBuf>,
    /// Named device groups that partitions refer to (JSON array).
    #[arg(long)]
    pub groups: Option<PathBuf>,
    /// End the run after this much virtual time (s, m, h, d, or a compound like 2h30m).
    #[arg(long, default_value = "30d")]
    pub until: String,
    /// When the virtual clock starts (RFC 3339, e.g. 2027-01-04T09:00:00Z); matters for
    /// maintenance windows.
    #[arg(long)]
    pub start: Option<String>,
    /// The release's size in bytes, to count bytes by source: a device ready after fetching
    /// from peers counts them from its first peer, the others from the coordinator.
    #[arg(long, value_name = "BYTES")]
    pub artifact_size: Option<u64>,
    /// Print the timeline, final status and device phases as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Reads the files named by the arguments and runs the simulation, for the `simulate` command
/// (which ends the process right after: [`SimOptions::then_exit`]).
pub fn simulate_files(args: &SimulateArgs) -> Result<SimReport, SimError> {
    let until = parse_duration(&args.until).map_err(|reason| SimError::Flag {
        flag: "until",
        value: args.until.clone(),
        reason,
    })?;
    let start = match &args.start {
        Some(text) => parse_rfc3339(text).map_err(|reason| SimError::Flag {
            flag: "start",
            value: text.clone(),
            reason,
        })?,
        None => DEFAULT_START,
    };
    let spec = fleetfile::load_spec(&args.spec)?;
    let fleet = fleetfile::load_fleet_file(&args.fleet)?;
    let groups = match &args.groups {
        Some(path) => fleetfile::load_device_groups(path)?,
        None => Vec::new(),
    };
    let outcomes = match &args.outcomes {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| SimError::ReadOutcomes {
                path: path.clone(),
                source,
            })?;
            Outcomes::from_toml(&text)?
        }
        None => Outcomes::default(),
    };
    let devices = fleet.devices();
    simulate(
        spec,
        &devices,
        groups,
        &outcomes,
        SimOptions {
            start,
            until,
            artifact_size: args.artifact_size,
            then_exit: true,
        },
    )
}

/// Runs `flotilla simulate`: prints the report and returns the exit code (0 finished, 2 not
/// finished, 1 on error with the error on stderr).
pub fn run_simulate(args: &SimulateArgs) -> i32 {
    match simulate_files(args) {
        Ok(report) => {
            if args.json {
                match serde_json::to_string_pretty(&report) {
                    Ok(json) => outln!("{json}"),
                    Err(e) => {
                        eprintln!("error: cannot encode the report: {e}");
                        return 1;
                    }
                }
            } else {
                out!("{}", render(&report));
            }
            let code = report.exit_code();
            // A report of a million devices is millions of small allocations; the command ends
            // here, so they are not freed one by one.
            std::mem::forget(report);
            code
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// Most device rows the text report lists; `--json` has them all.
pub(super) const DEVICE_ROWS: usize = 40;

/// The report as text: the timeline, how the run ended, the groups and the devices.
pub fn render(report: &SimReport) -> String {
    let mut out = String::new();
    for entry in &report.timeline {
        let _ = writeln!(out, "{}  {}", offset(entry.at), entry.message);
    }
    let why = match report.end.reason {
        EndReason::Done => "the rollout reached its end",
        EndReason::Idle => "nothing else would happen",
        EndReason::Until => "the --until horizon was reached",
    };
    let _ = writeln!(
        out,
        "\nrun ended at {}: {why}; rollout {} is {}",
        offset(report.end.at),
        report.rollout.name,
        report.rollout.state
    );
    let width = view::group_name_width(&report.rollout.groups);
    for g in &report.rollout.groups {
        out.push_str(&view::group_line(g, width));
        out.push('\n');
    }
    out.push_str(&view::sites_and_bytes(&report.rollout));
    let id_width = report
        .devices
        .keys()
        .map(String::len)
        .max()
        .unwrap_or(0)
        .max(6);
    let _ = writeln!(out, "\n{:id_width$}  PHASE", "DEVICE");
    for (id, phase) in report.devices.iter().take(DEVICE_ROWS) {
        let _ = writeln!(out, "{id:id_width$}  {phase}");
    }
    if report.devices.len() > DEVICE_ROWS {
        let _ = writeln!(
            out,
            "… {} more devices (--json lists them all)",
            report.devices.len() - DEVICE_ROWS
        );
    }
    out
}
