//! Text rendering for operators: rollout status with per-group progress bars, the devices table,
//! approval requests, device groups and stored strategies. Pure functions from the control JSON
//! types to `String`, so the CLI, the demo and tests all show the same thing and the text can be
//! asserted on.

use flotilla_protocol::control::{
    ApprovalStatus, Condition, CoordinatorsInfo, DeviceGroupInfo, DeviceSummary, EnrollmentInfo,
    GroupStatus, RolloutStatus, StageTask, StrategyInfo, StrategySnapshot, TraceEntry, TraceKind,
};

/// Width of the progress bar between the brackets.
pub const BAR_WIDTH: usize = 30;

/// How many trace entries [`rollout_status`] shows.
pub const TRACE_LINES: usize = 5;

/// How text is drawn: plain characters only, or with ANSI colours too (on a terminal, unless
/// NO_COLOR is set). The characters are the same either way, so a bar reads the same in a log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Paint {
    #[default]
    Plain,
    Colour,
}

impl Paint {
    /// Colour when `stdout` is a terminal and NO_COLOR (no-color.org) is unset or empty.
    pub fn for_stdout() -> Paint {
        use std::io::IsTerminal as _;
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        if std::io::stdout().is_terminal() && !no_color {
            Paint::Colour
        } else {
            Paint::Plain
        }
    }

    /// `text` in the ANSI colour `code` (32 green, 31 red, 33 yellow), or as it is.
    fn paint(self, code: u8, text: &str) -> String {
        match self {
            Paint::Colour if !text.is_empty() => format!("\x1b[{code}m{text}\x1b[0m"),
            _ => text.to_owned(),
        }
    }
}

/// What a bar's cells stand for: `#` ready (green on a terminal), `x` failed (red), `~`
/// canceled (yellow), `-` not done yet.
pub const BAR_LEGEND: &str = "# ready, x failed, ~ canceled, - not done";

/// `[####xx~~------]`: the devices of a group by outcome, ready first, then failed, then
/// canceled, then the rest. A failed or canceled device always takes at least one cell, so a
/// bar with a failure in it never shows as all `#`, however large the group.
pub fn progress_bar(
    ready: usize,
    failed: usize,
    canceled: usize,
    total: usize,
    width: usize,
    paint: Paint,
) -> String {
    let cells = |n: usize| (n.min(total) * width).checked_div(total).unwrap_or(0);
    let mut counts = [cells(ready), cells(failed), cells(canceled)];
    for (i, n) in [(1, failed), (2, canceled)] {
        if n > 0 && counts[i] == 0 {
            counts[i] = 1;
        }
    }
    // Taking cells for the failures may overfill the bar: ready gives them back.
    while counts.iter().sum::<usize>() > width && counts[0] > 0 {
        counts[0] -= 1;
    }
    let rest = width.saturating_sub(counts.iter().sum());
    format!(
        "[{}{}{}{}]",
        paint.paint(32, &"#".repeat(counts[0])),
        paint.paint(31, &"x".repeat(counts[1])),
        paint.paint(33, &"~".repeat(counts[2])),
        "-".repeat(rest)
    )
}

/// One group's line: name, state, bar of ready, failed and canceled devices (see
/// [`progress_bar`]), and the counts, which add up to the total (canceled shown when there are
/// any).
pub fn group_line(group: &GroupStatus, name_width: usize) -> String {
    group_line_in(group, name_width, Paint::Plain)
}

/// [`group_line`], drawn with `paint`.
pub fn group_line_in(group: &GroupStatus, name_width: usize, paint: Paint) -> String {
    let canceled = if group.canceled > 0 {
        format!(", {} canceled", group.canceled)
    } else {
        String::new()
    };
    format!(
        "  {:name_width$}  {:9}  {}  {}/{} ready, {} failed, {} running, {} scheduled{canceled}",
        group.name,
        group.state,
        progress_bar(
            group.ready,
            group.failed,
            group.canceled,
            group.total,
            BAR_WIDTH,
            paint
        ),
        group.ready,
        group.total,
        group.failed,
        group.in_progress,
        group.scheduled,
    )
}

/// A rollout as a header (with its vocabulary, run conditions and what it waits for), one line
/// per group with its start and end, pending approvals with the command that approves them, and
/// the last few decisions.
pub fn rollout_status(status: &RolloutStatus) -> String {
    rollout_status_in(status, Paint::Plain)
}

/// [`rollout_status`], its bars drawn with `paint`.
pub fn rollout_status_in(status: &RolloutStatus, paint: Paint) -> String {
    let mut out = format!(
        "rollout {}  release {}  state {}\n",
        status.name, status.release, status.state
    );
    if !status.strategy.is_empty() {
        out.push_str(&format!("  strategy {}\n", status.strategy));
    }
    if !status.conditions.is_empty() {
        // KubeFleet's words (type, status, reason) for its own vocabularies; plain words for
        // hawkBit's groups and Fleet's partitions, which have no such conditions.
        let text = match status.strategy.as_str() {
            "staged" | "rolling" => conditions(&status.conditions),
            _ => plain_conditions(&status.conditions),
        };
        out.push_str(&format!("  conditions {text}\n"));
    }
    if let Some(snapshot) = &status.strategy_snapshot {
        out.push_str(&format!("  {}\n", strategy_snapshot(snapshot)));
    }
    if let Some(waiting) = &status.waiting {
        out.push_str(&format!("  waiting: {waiting}\n"));
    }
    let name_width = group_name_width(&status.groups);
    if status.groups.is_empty() {
        out.push_str("  (no groups)\n");
    }
    for group in &status.groups {
        out.push_str(&group_line_in(group, name_width, paint));
        match (group.started_at, group.ended_at) {
            (Some(start), Some(end)) => {
                out.push_str(&format!("  started {}  ended {}", clock(start), clock(end)))
            }
            (Some(start), None) => out.push_str(&format!("  started {}", clock(start))),
            _ => {}
        }
        let deleted = group
            .devices
            .values()
            .filter(|p| p.as_str() == "not_started")
            .count();
        if deleted > 0 {
            out.push_str(&format!("  {deleted} deleted, not started"));
        }
        out.push('\n');
    }
    out.push_str(&sites_and_bytes(status));
    out.push_str(&excluded(status));
    if let Some(stage) = &status.deletion_stage {
        let when = match stage.ended_at {
            Some(at) => format!(" at {}", clock(at)),
            None => String::new(),
        };
        out.push_str(&format!(
            "  deletion stage {}{when} (no devices: a device the run leaves out keeps its release)\n",
            stage.state
        ));
    }
    let pending: Vec<&ApprovalStatus> = status.approvals.iter().filter(|a| !a.approved).collect();
    if !pending.is_empty() {
        out.push_str("pending approvals:\n");
    }
    for approval in pending {
        out.push_str(&format!(
            "  {}  {} group {} since {}: run `flotilla approve {}`\n",
            approval.name,
            approval.when,
            approval.group,
            clock(approval.created_at),
            approval.name
        ));
    }
    let skip = status.trace.len().saturating_sub(TRACE_LINES);
    if !status.trace.is_empty() {
        out.push_str("recent decisions:\n");
    }
    for (entry, message) in decision_lines(&status.trace[skip..]) {
        let by = entry
            .coordinator
            .as_ref()
            .map(|c| format!("  ({c})"))
            .unwrap_or_default();
        out.push_str(&format!("  {}  {message}{by}\n", clock(entry.at)));
    }
    out
}

/// The trace as people read it: a group that succeeded (its success condition held: the next
/// group may start) and finished (every device of it ended) on the same numbers at the same
/// moment is one line, "group canary succeeded and finished: 4 of 4 ready >= 75%". Other entries
/// are their own messages.
pub fn decision_lines(trace: &[TraceEntry]) -> Vec<(&TraceEntry, String)> {
    let mut lines = Vec::with_capacity(trace.len());
    let mut i = 0;
    while i < trace.len() {
        let entry = &trace[i];
        if let Some(next) = trace.get(i + 1) {
            let numbers = |t: &TraceEntry| t.message.split_once(": ").map(|(_, n)| n.to_owned());
            if entry.kind == TraceKind::GroupSucceeded
                && next.kind == TraceKind::GroupFinished
                && entry.group == next.group
                && entry.at == next.at
                && numbers(entry).is_some()
                && numbers(entry) == numbers(next)
            {
                let group = entry.group.as_deref().unwrap_or_default();
                let numbers = numbers(entry).unwrap_or_default();
                lines.push((
                    next,
                    format!("group {group} succeeded and finished: {numbers}"),
                ));
                i += 2;
                continue;
            }
        }
        lines.push((entry, entry.message.clone()));
        i += 1;
    }
    lines
}

/// The devices a rollout left out when it was created, one line each, and how many more.
pub fn excluded(status: &RolloutStatus) -> String {
    let mut out = String::new();
    for e in &status.excluded {
        out.push_str(&format!("  excluded {}: {}\n", e.device, e.reason));
    }
    let more = status.excluded_count.saturating_sub(status.excluded.len());
    if more > 0 {
        out.push_str(&format!(
            "  … {more} more excluded (the first {} are listed; `flotilla devices` shows those without a state)\n",
            status.excluded.len()
        ));
    }
    out
}

/// The bytes by source of a rollout and one line per site: "site harbour: 2 of 2 busy, 14
/// waiting". A summary lists only the busiest sites and says how many it left out.
pub fn sites_and_bytes(status: &RolloutStatus) -> String {
    let mut out = String::new();
    if !status.bytes.is_zero() {
        out.push_str(&format!(
            "  bytes: {}
",
            status.bytes
        ));
    }
    for site in &status.sites {
        out.push_str(&format!(
            "  {}
",
            site.line()
        ));
    }
    let left_out = status.site_count.saturating_sub(status.sites.len());
    if left_out > 0 {
        out.push_str(&format!(
            "  … {left_out} more sites, less busy (the {} busiest are listed)\n",
            status.sites.len()
        ));
    }
    out
}

/// A staged run's strategy snapshot on one line:
/// `stages (snapshot of example): staging [after Approval, TimedWait 1m], canary, …`.
pub fn strategy_snapshot(snapshot: &StrategySnapshot) -> String {
    let tasks = |tasks: &[StageTask]| {
        tasks
            .iter()
            .map(|t| match &t.wait {
                Some(wait) => format!("{} {wait}", t.kind),
                None => t.kind.clone(),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let stages = snapshot
        .stages
        .iter()
        .map(|s| {
            let mut parts = Vec::new();
            if let Some(label) = &s.sort_by {
                parts.push(format!("sorted by {label}"));
            }
            if !s.before.is_empty() {
                parts.push(format!("before {}", tasks(&s.before)));
            }
            if !s.after.is_empty() {
                parts.push(format!("after {}", tasks(&s.after)));
            }
            if parts.is_empty() {
                s.name.clone()
            } else {
                format!("{} [{}]", s.name, parts.join("; "))
            }
        })
        .collect::<Vec<_>>()
        .join(", ");
    match &snapshot.strategy {
        Some(name) => format!("stages (snapshot of {name}): {stages}"),
        None => format!("stages: {stages}"),
    }
}

/// Run conditions on one line: `Initialized=true since 18:00:00Z (UpdateRunStarted), …`.
pub fn conditions(conditions: &[Condition]) -> String {
    conditions
        .iter()
        .map(|c| {
            let mut text = format!("{}={} since {}", c.kind, c.status, clock(c.at));
            if !c.reason.is_empty() {
                text.push_str(&format!(" ({})", c.reason));
            }
            text
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Run conditions in plain words: `initialized 18:00:00Z, progressing since 18:00:05Z`.
pub fn plain_conditions(conditions: &[Condition]) -> String {
    conditions
        .iter()
        .map(|c| {
            let kind = c.kind.to_ascii_lowercase();
            match (c.kind.as_str(), c.status) {
                ("Initialized", true) => format!("initialized {}", clock(c.at)),
                (_, true) => format!("{kind} since {}", clock(c.at)),
                (_, false) => format!("not {kind} since {}", clock(c.at)),
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Approval requests: name, rollout, group, before/after, and pending or when approved.
pub fn approvals_table(approvals: &[ApprovalStatus]) -> String {
    if approvals.is_empty() {
        return "no approval requests\n".to_owned();
    }
    let rows: Vec<Vec<String>> = approvals
        .iter()
        .map(|a| {
            vec![
                a.name.clone(),
                a.rollout.clone(),
                a.group.clone(),
                a.when.clone(),
                match (a.approved, a.approved_at) {
                    (true, Some(at)) => format!("approved {}", clock(at)),
                    (true, None) => "approved".to_owned(),
                    (false, _) if a.denied.is_some() => format!(
                        "denied {} by {}",
                        a.denied_at.map(clock).unwrap_or_default(),
                        a.denied.as_deref().unwrap_or_default()
                    ),
                    (false, _) if a.withdrawn => "withdrawn (the rollout ended)".to_owned(),
                    (false, _) => format!("pending since {}", clock(a.created_at)),
                },
            ]
        })
        .collect();
    table(&["APPROVAL", "ROLLOUT", "GROUP", "WHEN", "STATE"], &rows)
}

/// Device groups: name, selector, labels.
pub fn groups_table(groups: &[DeviceGroupInfo]) -> String {
    if groups.is_empty() {
        return "no device groups\n".to_owned();
    }
    let rows: Vec<Vec<String>> = groups
        .iter()
        .map(|g| {
            let labels = g
                .labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",");
            let select = if g.select.is_empty() {
                "(every device)".to_owned()
            } else {
                g.select.clone()
            };
            vec![g.name.clone(), select, labels]
        })
        .collect();
    table(&["GROUP", "SELECT", "LABELS"], &rows)
}

/// Stored strategies, one name a line.
pub fn strategies_list(strategies: &[StrategyInfo]) -> String {
    if strategies.is_empty() {
        return "no stored strategies\n".to_owned();
    }
    strategies.iter().map(|s| format!("{}\n", s.name)).collect()
}

/// Left-aligned columns two spaces apart, the last column unpadded.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (cell, w) in cells.iter().zip(&widths) {
            s.push_str(&format!("{cell:w$}  "));
        }
        format!("{}\n", s.trim_end())
    };
    let mut out = line(header.to_vec());
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

/// The width of the group name column for [`group_line`].
pub fn group_name_width(groups: &[GroupStatus]) -> usize {
    groups
        .iter()
        .map(|g| g.name.len())
        .max()
        .unwrap_or(0)
        .max(5)
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

/// Every rollout on one line (`rollout list`, `rollout status` without a name): state,
/// release, groups ended of all, devices ready of all, failed, and the group at work now.
pub fn rollouts_table(statuses: &[RolloutStatus]) -> String {
    if statuses.is_empty() {
        return "no rollouts\n".to_owned();
    }
    let rows: Vec<Vec<String>> = statuses
        .iter()
        .map(|s| {
            let ended = s
                .groups
                .iter()
                .filter(|g| matches!(g.state.as_str(), "finished" | "error"))
                .count();
            let total: usize = s.groups.iter().map(|g| g.total).sum();
            let ready: usize = s.groups.iter().map(|g| g.ready).sum();
            let failed: usize = s.groups.iter().map(|g| g.failed).sum();
            let now = s
                .groups
                .iter()
                .find(|g| {
                    matches!(
                        g.state.as_str(),
                        "running" | "waiting" | "approval" | "error"
                    )
                })
                .map(|g| format!("{} {}", g.name, g.state))
                .unwrap_or_else(|| "-".to_owned());
            vec![
                s.name.clone(),
                s.state.clone(),
                s.release.clone(),
                format!("{ended}/{}", s.groups.len()),
                format!("{ready}/{total}"),
                failed.to_string(),
                now,
            ]
        })
        .collect();
    table(
        &[
            "ROLLOUT", "STATE", "RELEASE", "GROUPS", "READY", "FAILED", "NOW",
        ],
        &rows,
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

/// The devices table: id, online, enrollment, installed, rollout, phase, reason. ONLINE is `-`
/// for a device that is not accepted (pending, rejected, revoked): the coordinator does not
/// listen to it, so whether it is connected is not known (`no` would say it is not).
pub fn devices_table(devices: &[DeviceSummary]) -> String {
    if devices.is_empty() {
        return "no devices have reported yet\n".to_owned();
    }
    const N: usize = 7;
    let rows: Vec<[String; N]> = devices
        .iter()
        .map(|d| {
            [
                d.id.clone(),
                match (d.enrollment.as_deref(), d.online) {
                    (Some(e), _) if !e.starts_with("accepted") => "-".into(),
                    (_, true) => "yes".into(),
                    (_, false) => "no".into(),
                },
                d.enrollment.clone().unwrap_or_else(|| "-".into()),
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
        "ENROLLMENT",
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
    let line = |cells: [&str; N]| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i == N - 1 {
                s.push_str(cell);
            } else {
                s.push_str(&format!("{cell:w$}  "));
            }
        }
        format!("{}\n", s.trim_end())
    };
    let mut out = line(header);
    for row in &rows {
        out.push_str(&line(std::array::from_fn(|i| row[i].as_str())));
    }
    out
}

/// The table of devices waiting for an operator: id, status, key, what they claim.
pub fn enrollments_table(pending: &[EnrollmentInfo]) -> String {
    if pending.is_empty() {
        return "no devices are waiting for an operator\n".to_owned();
    }
    let mut out = String::new();
    for e in pending {
        let (waiting, what) = match &e.new_key {
            Some(new) => (new.as_str(), format!("{}, new key", e.status)),
            None => (e.key.as_str(), e.status.clone()),
        };
        let labels: Vec<String> = e.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        out.push_str(&format!(
            "{}  {what}  key {waiting}  hardware {}  labels {}\n",
            e.device,
            e.hardware_id.as_deref().unwrap_or("-"),
            if labels.is_empty() {
                "-".to_owned()
            } else {
                labels.join(",")
            }
        ));
    }
    out
}

/// `flotilla status`: where the store is, who leads, and every coordinator of a shared store.
/// Ages are taken on the database's clock (the lease's `read_at`), not this machine's.
pub fn coordinators(info: &CoordinatorsInfo) -> String {
    let mut out = String::new();
    let Some(lease) = &info.lease else {
        out.push_str(&format!("store     {} (sled)\n", info.store));
        out.push_str(&format!(
            "leader    {}: the only coordinator of a sled store, it always leads\n",
            info.answered_by
        ));
        return out;
    };
    let secs = |s: u64| format!("{s} s");
    out.push_str(&format!("store     {} (shared)\n", info.store));
    if lease.is_live() {
        out.push_str(&format!(
            "leader    {}, lease epoch {}, leading for {}, renewed {} ago, runs out in {} unless renewed\n",
            lease.holder,
            lease.epoch,
            secs(lease.read_at.saturating_sub(lease.acquired_at)),
            secs(lease.read_at.saturating_sub(lease.renewed_at)),
            secs(lease.expires_at - lease.read_at),
        ));
    } else if lease.epoch == 0 {
        out.push_str("leader    none: no coordinator has led this store yet\n");
    } else {
        out.push_str(&format!(
            "leader    none for {}: the last was {} (lease epoch {}), whose lease ran out at {}\n",
            secs(lease.read_at.saturating_sub(lease.expires_at)),
            lease.holder,
            lease.epoch,
            flotilla_rollout::window::utc_text(lease.expires_at),
        ));
    }
    out.push_str(&format!(
        "answered  by {} ({} takeover{} by it)\n",
        info.answered_by,
        info.failovers,
        if info.failovers == 1 { "" } else { "s" }
    ));
    if info.members.is_empty() {
        return out;
    }
    let id_width = info
        .members
        .iter()
        .map(|m| m.id.len())
        .max()
        .unwrap_or(0)
        .max(11);
    let client_width = info
        .members
        .iter()
        .map(|m| m.client_id.len())
        .max()
        .unwrap_or(0)
        .max(9);
    out.push_str(&format!(
        "\n{:id_width$}  {:7}  {:client_width$}  LAST SEEN\n",
        "COORDINATOR", "ROLE", "CLIENT ID"
    ));
    for m in &info.members {
        let leads = m.id == lease.holder && lease.is_live();
        out.push_str(&format!(
            "{:id_width$}  {:7}  {:client_width$}  {} ago\n",
            m.id,
            if leads { "leader" } else { "standby" },
            m.client_id,
            secs(lease.read_at.saturating_sub(m.last_seen)),
        ));
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
        let bar = |ready, failed, canceled, total| {
            progress_bar(ready, failed, canceled, total, 8, Paint::Plain)
        };
        assert_eq!(bar(0, 0, 0, 4), "[--------]");
        assert_eq!(bar(2, 0, 0, 4), "[####----]");
        assert_eq!(bar(4, 0, 0, 4), "[########]");
        assert_eq!(bar(9, 0, 0, 4), "[########]");
        assert_eq!(bar(0, 0, 0, 0), "[--------]");
    }

    #[test]
    fn failures_and_cancels_are_drawn_apart_from_ready_and_never_look_done() {
        let bar = |ready, failed, canceled, total| {
            progress_bar(ready, failed, canceled, total, 8, Paint::Plain)
        };
        // The issue's case: every device done, none ready.
        assert_eq!(bar(0, 2, 0, 2), "[xxxxxxxx]");
        assert_eq!(bar(2, 1, 1, 4), "[####xx~~]");
        // One failure in a large group still takes a cell, from ready.
        assert_eq!(bar(999, 1, 0, 1000), "[#######x]");
        assert_eq!(bar(1, 0, 3, 4), "[##~~~~~~]");

        let coloured = progress_bar(1, 1, 0, 2, 4, Paint::Colour);
        assert_eq!(coloured, "[\x1b[32m##\x1b[0m\x1b[31mxx\x1b[0m]");
        let mut failed = group("canary", "failed", 2, 0, 2, 0);
        failed.scheduled = 0;
        let line = group_line(&failed, 6);
        assert!(line.contains("failed"), "{line}");
        assert!(
            !line.contains('#'),
            "a failed group shows no ready cells: {line}"
        );
        assert!(!line.contains('\x1b'), "plain text off a terminal: {line}");
    }

    #[test]
    fn status_shows_sites_and_bytes_by_source() {
        use flotilla_protocol::control::{SiteStatus, SourceBytes};
        let status = RolloutStatus {
            name: "fw".into(),
            state: "running".into(),
            bytes: SourceBytes {
                coordinator: 1_000,
                peers: 15_000,
                local: 24,
                http: 0,
            },
            sites: vec![SiteStatus {
                name: "harbour".into(),
                total: 16,
                busy: 2,
                unavailable: 2,
                waiting: 14,
                max_busy: Some(2),
                ..SiteStatus::default()
            }],
            site_count: 3,
            ..RolloutStatus::default()
        };
        let text = rollout_status(&status);
        assert!(
            text.contains("  bytes: 1000 from the coordinator, 15000 from peers, 24 local\n"),
            "{text}"
        );
        assert!(
            text.contains("  site harbour: 2 of 2 busy, 14 waiting\n"),
            "{text}"
        );
        assert!(text.contains("… 2 more sites"), "{text}");
    }

    #[test]
    fn status_shows_groups_counts_and_recent_trace() {
        let trace = (0..8)
            .map(|i| TraceEntry {
                at: 100 + i,
                rollout: "fw".into(),
                message: format!("decision {i}"),
                ..TraceEntry::default()
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
                progress_bar(3, 1, 0, 4, BAR_WIDTH, Paint::Plain)
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
    fn rollouts_list_is_one_line_each() {
        let status = |name: &str, state: &str, groups| RolloutStatus {
            name: name.into(),
            release: "fw-2".into(),
            state: state.into(),
            groups,
            ..RolloutStatus::default()
        };
        let text = rollouts_table(&[
            status(
                "fw-2-4",
                "running",
                vec![
                    group("canary", "finished", 2, 2, 0, 0),
                    group("rest", "running", 8, 1, 1, 2),
                ],
            ),
            status("first", "failed", vec![group("g1", "error", 2, 0, 2, 0)]),
        ]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            vec![
                "ROLLOUT  STATE    RELEASE  GROUPS  READY  FAILED  NOW",
                "fw-2-4   running  fw-2     1/2     3/10   1       rest running",
                "first    failed   fw-2     1/1     0/2    2       g1 error",
            ]
        );
        assert_eq!(rollouts_table(&[]), "no rollouts\n");
    }

    #[test]
    fn staged_status_shows_snapshot_deletion_stage_and_deleted_devices() {
        let task = |kind: &str, wait: Option<&str>| StageTask {
            kind: kind.into(),
            wait: wait.map(str::to_owned),
        };
        let stage = |name: &str, sort_by: Option<&str>, after: Vec<StageTask>| {
            flotilla_protocol::control::StageSnapshot {
                name: name.into(),
                select: format!("environment={name}"),
                sort_by: sort_by.map(str::to_owned),
                max_concurrency: 1,
                before: Vec::new(),
                after,
            }
        };
        let mut staging = group("staging", "finished", 2, 1, 0, 0);
        staging.devices = BTreeMap::from([
            ("member1".into(), "ready".into()),
            ("member3".into(), "not_started".into()),
        ]);
        let status = RolloutStatus {
            name: "example-run".into(),
            release: "fw-2".into(),
            state: "finished".into(),
            groups: vec![staging],
            strategy: "staged".into(),
            strategy_snapshot: Some(StrategySnapshot {
                strategy: Some("example-strategy".into()),
                stages: vec![
                    stage(
                        "staging",
                        None,
                        vec![task("Approval", None), task("TimedWait", Some("1m"))],
                    ),
                    stage("production", Some("order"), Vec::new()),
                ],
            }),
            deletion_stage: Some(GroupStatus {
                name: "kubernetes-fleet.io/deleteStage".into(),
                state: "finished".into(),
                started_at: Some(3600),
                ended_at: Some(3600),
                ..GroupStatus::default()
            }),
            ..RolloutStatus::default()
        };
        let text = rollout_status(&status);
        assert!(
            text.contains(
                "  stages (snapshot of example-strategy): staging [after Approval, TimedWait 1m], \
                 production [sorted by order]\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("  deletion stage finished at 01:00:00Z (no devices"),
            "{text}"
        );
        assert!(text.contains("  1 deleted, not started\n"), "{text}");
    }

    #[test]
    fn status_shows_strategy_conditions_waiting_approvals_and_group_times() {
        let condition = |kind: &str, status: bool, reason: &str, at: u64| Condition {
            kind: kind.into(),
            status,
            reason: reason.into(),
            message: String::new(),
            at,
        };
        let mut canary = group("canary", "finished", 2, 2, 0, 0);
        canary.started_at = Some(3600);
        canary.ended_at = Some(3600 + 125);
        let mut rest = group("rest", "scheduled", 8, 0, 0, 0);
        rest.started_at = None;
        let approval = |name: &str, approved: bool| ApprovalStatus {
            denied_at: None,
            denied: None,
            name: name.into(),
            rollout: "fw-2-4".into(),
            group: "canary".into(),
            when: "after".into(),
            approved,
            created_at: 3600 + 125,
            approved_at: approved.then_some(3600 + 200),
            withdrawn: false,
        };
        let status = RolloutStatus {
            name: "fw-2-4".into(),
            release: "fw-2.4.0".into(),
            state: "running".into(),
            groups: vec![canary, rest],
            strategy: "staged".into(),
            conditions: vec![
                condition(
                    "Initialized",
                    true,
                    "UpdateRunInitializedSuccessfully",
                    3590,
                ),
                condition("Progressing", false, "UpdateRunWaiting", 3725),
            ],
            waiting: Some("approval fw-2-4-canary is pending".into()),
            approvals: vec![
                approval("fw-2-4-canary", false),
                approval("fw-2-4-before-canary", true),
            ],
            ..RolloutStatus::default()
        };
        let text = rollout_status(&status);
        assert!(
            text.starts_with(
                "rollout fw-2-4  release fw-2.4.0  state running\n  strategy staged\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "  conditions Initialized=true since 00:59:50Z (UpdateRunInitializedSuccessfully), \
                 Progressing=false since 01:02:05Z (UpdateRunWaiting)\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("  waiting: approval fw-2-4-canary is pending\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "2/2 ready, 0 failed, 0 running, 0 scheduled  started 01:00:00Z  ended 01:02:05Z\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("0/8 ready, 0 failed, 0 running, 8 scheduled\n"),
            "a group that has not started shows no times: {text}"
        );
        assert!(
            text.contains("run `flotilla approve fw-2-4-canary`"),
            "{text}"
        );
        assert!(
            !text.contains("flotilla approve fw-2-4-before-canary"),
            "approved requests need no command: {text}"
        );
    }

    #[test]
    fn approvals_groups_and_strategies_render_as_tables() {
        let approvals = vec![
            ApprovalStatus {
                denied_at: None,
                denied: None,
                name: "fw-2-4-canary".into(),
                rollout: "fw-2-4".into(),
                group: "canary".into(),
                when: "after".into(),
                approved: false,
                created_at: 60,
                approved_at: None,
                withdrawn: false,
            },
            ApprovalStatus {
                denied_at: None,
                denied: None,
                name: "fw-2-4-before-rest".into(),
                rollout: "fw-2-4".into(),
                group: "rest".into(),
                when: "before".into(),
                approved: true,
                created_at: 60,
                approved_at: Some(120),
                withdrawn: false,
            },
        ];
        let text = approvals_table(&approvals);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            vec![
                "APPROVAL            ROLLOUT  GROUP   WHEN    STATE",
                "fw-2-4-canary       fw-2-4   canary  after   pending since 00:01:00Z",
                "fw-2-4-before-rest  fw-2-4   rest    before  approved 00:02:00Z",
            ]
        );
        assert_eq!(approvals_table(&[]), "no approval requests\n");

        let groups = vec![
            DeviceGroupInfo {
                name: "kitchens".into(),
                select: "site in (a,b)".into(),
                labels: BTreeMap::from([("tier".into(), "1".into()), ("zone".into(), "eu".into())]),
            },
            DeviceGroupInfo {
                name: "all".into(),
                select: String::new(),
                labels: BTreeMap::new(),
            },
        ];
        let text = groups_table(&groups);
        assert!(
            text.contains("kitchens  site in (a,b)   tier=1,zone=eu\n"),
            "{text}"
        );
        assert!(text.contains("all       (every device)\n"), "{text}");
        assert_eq!(groups_table(&[]), "no device groups\n");
        assert_eq!(
            strategies_list(&[StrategyInfo {
                name: "two-stage".into(),
                spec: String::new()
            }]),
            "two-stage\n"
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
                enrollment: Some("accepted".into()),
                last_seen: None,
                overdue: false,
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
                enrollment: None,
                last_seen: None,
                overdue: false,
            },
        ];
        let text = devices_table(&devices);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(
            lines[0].starts_with("DEVICE         ONLINE  ENROLLMENT  INSTALLED"),
            "{text}"
        );
        assert!(
            lines[1].starts_with("pi-1           yes     accepted    fw-2.4.0"),
            "{text}"
        );
        assert!(lines[2].ends_with("failed  health check failed"), "{text}");
        let pending = DeviceSummary {
            id: "pi-new".into(),
            enrollment: Some("pending".into()),
            ..devices[1].clone()
        };
        let text = devices_table(&[pending]);
        assert!(
            text.lines()
                .nth(1)
                .is_some_and(|l| l.starts_with("pi-new  -       pending")),
            "whether a pending device is connected is not known: {text}"
        );
        assert_eq!(devices_table(&[]), "no devices have reported yet\n");
    }

    #[test]
    fn status_names_the_leader_its_epoch_and_each_coordinator_by_the_database_clock() {
        use flotilla_protocol::control::{CoordinatorMember, LeaseInfo};
        let member = |id: &str, seen| CoordinatorMember {
            id: id.into(),
            client_id: format!("flotilla-coordinator-{id}"),
            last_seen: seen,
        };
        let mut info = CoordinatorsInfo {
            answered_by: "coord-a".into(),
            store: "postgresql://flotilla@db:5432/flotilla".into(),
            lease: Some(LeaseInfo {
                holder: "coord-a".into(),
                epoch: 4,
                acquired_at: 1_000,
                renewed_at: 1_098,
                expires_at: 1_113,
                read_at: 1_100,
            }),
            members: vec![member("coord-a", 1_098), member("coord-b", 1_099)],
            failovers: 1,
        };
        let text = coordinators(&info);
        assert!(text.contains("leader    coord-a, lease epoch 4, leading for 100 s, renewed 2 s ago, runs out in 13 s"), "{text}");
        assert!(text.contains("(1 takeover by it)"), "{text}");
        let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("coord-")).collect();
        assert!(
            rows[0].contains("leader") && rows[0].ends_with("2 s ago"),
            "{text}"
        );
        assert!(
            rows[1].contains("standby") && rows[1].ends_with("1 s ago"),
            "{text}"
        );

        info.lease.as_mut().expect("lease").read_at = 1_120;
        let text = coordinators(&info);
        assert!(
            text.contains("leader    none for 7 s: the last was coord-a (lease epoch 4)"),
            "{text}"
        );
        assert!(
            !text.contains(" leader "),
            "nobody is shown leading: {text}"
        );

        info.lease = None;
        assert!(coordinators(&info).contains("the only coordinator of a sled store"));
    }

    #[test]
    fn a_group_that_succeeds_and_finishes_at_once_is_one_line() {
        let entry = |at, kind, message: &str| TraceEntry {
            at,
            kind,
            group: Some("g1".into()),
            message: message.into(),
            ..TraceEntry::default()
        };
        let trace = [
            entry(
                5,
                TraceKind::GroupSucceeded,
                "group g1 succeeded: 4 of 4 ready >= 75%",
            ),
            entry(
                5,
                TraceKind::GroupFinished,
                "group g1 finished: 4 of 4 ready >= 75%",
            ),
            entry(
                6,
                TraceKind::GroupSucceeded,
                "group g1 succeeded: 3 of 4 ready >= 75%",
            ),
            entry(
                9,
                TraceKind::GroupFinished,
                "group g1 finished: 4 of 4 ready >= 75%",
            ),
        ];
        let lines: Vec<String> = decision_lines(&trace).into_iter().map(|(_, l)| l).collect();
        assert_eq!(
            lines,
            [
                "group g1 succeeded and finished: 4 of 4 ready >= 75%",
                "group g1 succeeded: 3 of 4 ready >= 75%",
                "group g1 finished: 4 of 4 ready >= 75%",
            ]
        );
    }

    #[test]
    fn conditions_are_kubefleets_words_only_for_its_own_vocabularies() {
        let condition = |kind: &str, status, reason: &str| Condition {
            kind: kind.into(),
            status,
            reason: reason.into(),
            message: String::new(),
            at: 3600,
        };
        let status = RolloutStatus {
            name: "r".into(),
            release: "fw".into(),
            state: "running".into(),
            strategy: "groups".into(),
            conditions: vec![
                condition("Initialized", true, "UpdateRunInitializedSuccessfully"),
                condition("Progressing", false, "UpdateRunPaused"),
            ],
            ..RolloutStatus::default()
        };
        let text = rollout_status(&status);
        assert!(
            text.contains("  conditions initialized 01:00:00Z, not progressing since 01:00:00Z\n"),
            "{text}"
        );
        assert!(!text.contains("UpdateRun"), "{text}");
        let staged = RolloutStatus {
            strategy: "staged".into(),
            ..status
        };
        assert!(rollout_status(&staged).contains("(UpdateRunInitializedSuccessfully)"));
    }
}
