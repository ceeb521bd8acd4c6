//! Text rendering for operators: rollout status with per-group progress bars, and the devices
//! table. Pure functions from the control JSON types to `String`, so the CLI, the demo and tests
//! all show the same thing and the text can be asserted on.

use flotilla_protocol::control::{DeviceSummary, GroupStatus, RolloutStatus};

/// Width of the progress bar between the brackets.
pub const BAR_WIDTH: usize = 30;

/// How many trace entries [`rollout_status`] shows.
pub const TRACE_LINES: usize = 5;

/// `[#########---------------------]`: `done` of `total`, `#` for done, `-` for the rest.
pub fn progress_bar(done: usize, total: usize, width: usize) -> String {
    let filled = (done.min(total) * width).checked_div(total).unwrap_or(0);
    format!("[{}{}]", "#".repeat(filled), "-".repeat(width - filled))
}

/// One group's line: name, state, bar of (ready + failed) / total, and the counts.
pub fn group_line(group: &GroupStatus, name_width: usize) -> String {
    let done = group.ready + group.failed;
    format!(
        "  {:name_width$}  {:9}  {}  {}/{} ready, {} failed, {} running, {} scheduled",
        group.name,
        group.state,
        progress_bar(done, group.total, BAR_WIDTH),
        group.ready,
        group.total,
        group.failed,
        group.in_progress,
        group.scheduled,
    )
}

/// A rollout as a header, one line per group, and the last few decisions.
pub fn rollout_status(status: &RolloutStatus) -> String {
    let mut out = format!(
        "rollout {}  release {}  state {}\n",
        status.name, status.release, status.state
    );
    let name_width = status
        .groups
        .iter()
        .map(|g| g.name.len())
        .max()
        .unwrap_or(0)
        .max(5);
    if status.groups.is_empty() {
        out.push_str("  (no groups)\n");
    }
    for group in &status.groups {
        out.push_str(&group_line(group, name_width));
        out.push('\n');
    }
    let skip = status.trace.len().saturating_sub(TRACE_LINES);
    if !status.trace.is_empty() {
        out.push_str("recent decisions:\n");
    }
    for entry in &status.trace[skip..] {
        out.push_str(&format!("  {}  {}\n", clock(entry.at), entry.message));
    }
    out
}

/// The UTC time of day of a Unix timestamp, `18:03:51Z`: decisions of one rollout are minutes
/// or hours apart, so the date would only be noise in the table (`--json` has the full value).
pub fn clock(at: u64) -> String {
    format!(
        "{:02}:{:02}:{:02}Z",
        (at / 3600) % 24,
        (at / 60) % 60,
        at % 60
    )
}

/// Several rollouts, separated by blank lines.
pub fn rollout_statuses(statuses: &[RolloutStatus]) -> String {
    if statuses.is_empty() {
        return "no rollouts\n".to_owned();
    }
    statuses
        .iter()
        .map(rollout_status)
        .collect::<Vec<_>>()
        .join("\n")
}

/// The devices table: id, online, installed, rollout, phase, reason.
pub fn devices_table(devices: &[DeviceSummary]) -> String {
    if devices.is_empty() {
        return "no devices have reported yet\n".to_owned();
    }
    let rows: Vec<[String; 6]> = devices
        .iter()
        .map(|d| {
            [
                d.id.clone(),
                if d.online { "yes".into() } else { "no".into() },
                d.installed.clone().unwrap_or_else(|| "-".into()),
                d.rollout.clone().unwrap_or_else(|| "-".into()),
                d.phase.clone().unwrap_or_else(|| "-".into()),
                d.reason.clone().unwrap_or_default(),
            ]
        })
        .collect();
    let header = [
        "DEVICE",
        "ONLINE",
        "INSTALLED",
        "ROLLOUT",
        "PHASE",
        "REASON",
    ];
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: [&str; 6]| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i == 5 {
                s.push_str(cell);
            } else {
                s.push_str(&format!("{cell:w$}  "));
            }
        }
        format!("{}\n", s.trim_end())
    };
    let mut out = line(header);
    for row in &rows {
        out.push_str(&line([
            &row[0], &row[1], &row[2], &row[3], &row[4], &row[5],
        ]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_protocol::control::TraceEntry;
    use std::collections::BTreeMap;

    fn group(
        name: &str,
        state: &str,
        total: usize,
        ready: usize,
        failed: usize,
        running: usize,
    ) -> GroupStatus {
        GroupStatus {
            name: name.into(),
            state: state.into(),
            total,
            ready,
            failed,
            in_progress: running,
            scheduled: total - ready - failed - running,
            devices: BTreeMap::new(),
            ..GroupStatus::default()
        }
    }

    #[test]
    fn bars_fill_proportionally() {
        assert_eq!(progress_bar(0, 4, 8), "[--------]");
        assert_eq!(progress_bar(2, 4, 8), "[####----]");
        assert_eq!(progress_bar(4, 4, 8), "[########]");
        assert_eq!(progress_bar(9, 4, 8), "[########]");
        assert_eq!(progress_bar(0, 0, 8), "[--------]");
    }

    #[test]
    fn status_shows_groups_counts_and_recent_trace() {
        let trace = (0..8)
            .map(|i| TraceEntry {
                at: 100 + i,
                rollout: "fw".into(),
                message: format!("decision {i}"),
            })
            .collect();
        let status = RolloutStatus {
            name: "fw-2-4".into(),
            release: "fw-2.4.0".into(),
            state: "running".into(),
            groups: vec![
                group("canary", "finished", 4, 3, 1, 0),
                group("rest", "running", 10, 0, 0, 2),
            ],
            trace,
            ..RolloutStatus::default()
        };
        let text = rollout_status(&status);
        assert!(
            text.starts_with("rollout fw-2-4  release fw-2.4.0  state running\n"),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "canary  finished   {}  3/4 ready, 1 failed, 0 running, 0 scheduled",
                progress_bar(4, 4, BAR_WIDTH)
            )),
            "{text}"
        );
        assert!(
            text.contains("0/10 ready, 0 failed, 2 running, 8 scheduled"),
            "{text}"
        );
        assert!(
            text.contains("decision 7") && text.contains("decision 3"),
            "{text}"
        );
        assert!(
            !text.contains("decision 2"),
            "only the last {TRACE_LINES} decisions: {text}"
        );
    }

    #[test]
    fn devices_table_aligns_columns() {
        let devices = vec![
            DeviceSummary {
                id: "pi-1".into(),
                hardware_id: "pi4".into(),
                labels: BTreeMap::new(),
                online: true,
                installed: Some("fw-2.4.0".into()),
                rollout: Some("fw-2-4".into()),
                phase: Some("ready".into()),
                reason: None,
            },
            DeviceSummary {
                id: "pi-kitchen-22".into(),
                hardware_id: "pi4".into(),
                labels: BTreeMap::new(),
                online: false,
                installed: None,
                rollout: Some("fw-2-4".into()),
                phase: Some("failed".into()),
                reason: Some("health check failed".into()),
            },
        ];
        let text = devices_table(&devices);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(
            lines[0].starts_with("DEVICE         ONLINE  INSTALLED"),
            "{text}"
        );
        assert!(
            lines[1].starts_with("pi-1           yes     fw-2.4.0"),
            "{text}"
        );
        assert!(lines[2].ends_with("failed  health check failed"), "{text}");
        assert_eq!(devices_table(&[]), "no devices have reported yet\n");
    }
}
