//! How a rollout moves: groups start in order behind their gates, devices start within a group as
//! its pace, the rate limit, the maintenance windows and overlapping rollouts allow, and the
//! success and error conditions release the next group, pause, stop or roll back.
//!
//! [`Rollout::advance`] is the one place where these decisions are made. It is called after every
//! input (a report, a command, a timer) and is idempotent: calling it again with nothing changed
//! changes nothing.

use std::collections::HashMap;

use flotilla_protocol::control::{ApprovalStatus, RolloutStatus, TraceKind};

use super::model::{set_condition, DevicePhase, Group, GroupState, Rollout, RolloutState};
use super::queues::SiteQueues;
use super::trace::Decision;
use super::{attempt_action_id, Effect, TRACE_LIMIT};
use crate::conditions::success_met;
use crate::plan::Threshold;
use crate::text::count;
use crate::window::Window;

/// What the engine knows about devices, as the rollout logic needs it.
pub(crate) struct Ctx<'a> {
    /// Device id -> offline since; online and unknown devices are not in it.
    pub offline: &'a HashMap<String, u64>,
    /// Device id -> (rollout, weight) whose action is the device's current one.
    pub owners: &'a HashMap<String, (String, u32)>,
    /// Parsed maintenance windows of this rollout.
    pub windows: &'a [Window],
}

/// Effects collected during one call, emitted in the documented order, plus the bookkeeping the
/// engine applies across rollouts afterwards.
#[derive(Default)]
pub(crate) struct Out {
    pub save: Vec<String>,
    pub commands: Vec<Effect>,
    pub status: Vec<String>,
    pub trace: Vec<Effect>,
    /// (device, rollout, weight): the rollout sent the device its current action.
    pub claims: Vec<(String, String, u32)>,
    /// (device, rollout): the action of that rollout on the device ended.
    pub releases: Vec<(String, String)>,
    /// (other rollout, device, by rollout): a newer or heavier rollout took the device over.
    pub preempt: Vec<(String, String, String)>,
    /// (device, rollout): a deleted device left the rollout's groups.
    pub left: Vec<(String, String)>,
    /// Summaries of states passed through within this call (`creating`, `starting`).
    pub snapshots: Vec<RolloutStatus>,
}

impl Out {
    pub fn touch(&mut self, rollout: &str) {
        if !self.save.iter().any(|r| r == rollout) {
            self.save.push(rollout.to_owned());
        }
        if !self.status.iter().any(|r| r == rollout) {
            self.status.push(rollout.to_owned());
        }
    }

    pub fn into_effects(self) -> Vec<Effect> {
        let mut effects: Vec<Effect> = self.save.into_iter().map(Effect::Save).collect();
        effects.extend(
            self.snapshots
                .into_iter()
                .map(|s| Effect::Snapshot(Box::new(s))),
        );
        effects.extend(self.commands);
        effects.extend(self.status.into_iter().map(Effect::Status));
        effects.extend(self.trace);
        effects
    }
}

/// The approval request that holds group `group` of `rollout` before its first device starts.
pub(crate) fn before_approval(rollout: &str, group: &str) -> String {
    format!("{rollout}-before-{group}")
}

/// The approval request that holds the group after `group` of `rollout` once `group` succeeded.
pub(crate) fn after_approval(rollout: &str, group: &str) -> String {
    format!("{rollout}-{group}")
}

/// Why a group is not starting more devices: a kind (a change of kind is worth a trace entry)
/// and the words with the numbers.
pub(super) struct Wait {
    pub(super) kind: &'static str,
    pub(super) text: String,
}

impl Rollout {
    /// ready or scheduled -> starting -> running. hawkBit shows `starting` while the actions
    /// are being created; here that is while the first group's desired actions go out, so the
    /// `starting` summary is published before them and `running` after.
    pub(crate) fn starting(&mut self, now: u64, out: &mut Out) {
        self.state = RolloutState::Starting;
        self.started_at = Some(now);
        out.snapshots.push(self.summary());
        self.state = RolloutState::Running;
    }

    /// Records a decision; every decision is a state change worth saving and publishing.
    pub(crate) fn record(&mut self, now: u64, decision: impl Into<Decision>, out: &mut Out) {
        let entry = decision.into().entry(now, &self.name);
        if self.trace.len() >= TRACE_LIMIT {
            let excess = self.trace.len() + 1 - TRACE_LIMIT;
            self.trace.drain(..excess);
        }
        self.trace.push(entry.clone());
        out.touch(&self.name);
        out.trace.push(Effect::Trace(entry));
    }

    pub(crate) fn device_total(&self) -> usize {
        self.groups.iter().map(|g| g.devices.len()).sum()
    }

    pub(crate) fn set_condition(&mut self, kind: &str, status: bool, reason: &str, now: u64) {
        set_condition(&mut self.conditions, kind, status, reason, "", now);
    }

    /// The action id of a device's current attempt.
    pub(crate) fn attempt_id(&self, device: &str, attempt: u32) -> String {
        attempt_action_id(&self.name, self.created_at, device, attempt)
    }

    pub(super) fn desired(&self, gi: usize, device: &str, attempt: u32) -> Effect {
        Effect::Desired {
            device: device.to_owned(),
            action_id: self.attempt_id(device, attempt),
            rollout: self.name.clone(),
            release: self.release.name.clone(),
            action: self.spec.policies.action,
            peers: self.groups[gi]
                .slots
                .get(device)
                .map(|s| s.peers.clone())
                .unwrap_or_default(),
        }
    }

    /// Successes so far, for the rate limit's ramp.
    pub(super) fn successes(&self) -> usize {
        self.groups.iter().map(|g| g.counts.ready).sum()
    }

    /// Moves the rollout as far as it can go now. See the module documentation.
    pub(crate) fn advance(&mut self, now: u64, ctx: &Ctx, out: &mut Out) {
        self.advance_groups(now, ctx, out);
        // Only a running rollout waits for something; a paused or ended one says so by its state.
        if self.state != RolloutState::Running && self.waiting.take().is_some() {
            out.touch(&self.name);
        }
    }

    pub(super) fn advance_groups(&mut self, now: u64, ctx: &Ctx, out: &mut Out) {
        self.checked_at = self.checked_at.max(now);
        if self.state == RolloutState::Scheduled {
            match self.spec.policies.start_at {
                Some(at) if at > now => return,
                _ => {
                    self.record(
                        now,
                        Decision::new(TraceKind::StartTimeReached, "start time reached"),
                        out,
                    );
                    self.starting(now, out);
                }
            }
        }
        if self.state != RolloutState::Running {
            self.settle_passive(now, out);
            return;
        }
        let group_count = self.groups.len();
        let unready_budget = self.spec.policies.max_unavailable_groups.of(group_count);
        let mut wait: Option<Wait> = None;
        for gi in 0..group_count {
            match self.groups[gi].state {
                GroupState::Scheduled | GroupState::Approval => {
                    if self.groups[gi].before.approval {
                        let name = before_approval(&self.name, &self.groups[gi].name);
                        if !self.approval_granted(&name, gi, "before", now, out) {
                            self.groups[gi].state = GroupState::Approval;
                            wait = Some(Wait {
                                kind: "approval",
                                text: format!(
                                    "group {} waits for approval: flotilla approve {name}",
                                    self.groups[gi].name
                                ),
                            });
                            break;
                        }
                    }
                    self.start_group(gi, now, out);
                }
                _ => {}
            }
            if self.groups[gi].state == GroupState::Running {
                if let Some(w) = self.fill(gi, now, ctx, out) {
                    wait.get_or_insert(w);
                }
            }
            if matches!(
                self.groups[gi].state,
                GroupState::Running | GroupState::Waiting
            ) && self.check_error(gi, now, out)
            {
                return;
            }
            if !self.groups[gi].released {
                match self.check_success(gi, now, out) {
                    Step::Stop => return,
                    Step::Wait(w) => {
                        wait.get_or_insert(w);
                    }
                    Step::Go => {}
                }
            }
            if self.check_done(gi, now, out) {
                return;
            }
            if self.groups[gi].released {
                continue;
            }
            // Fleet's maxUnavailablePartitions: the next group may start while this one is fully
            // started but not yet successful, as long as few enough groups are in that state.
            let unready = self.groups[..=gi]
                .iter()
                .filter(|g| g.state != GroupState::Scheduled && !g.released)
                .count();
            let group = &self.groups[gi];
            if group.all_started() && !group.dynamic && gi + 1 < group_count {
                if unready_budget > 0 && unready <= unready_budget {
                    continue;
                }
                // Fleet: say why the next partition waits on readiness.
                if matches!(group.success.threshold, Threshold::AllBut(_)) {
                    wait.get_or_insert(Wait {
                        kind: "groups",
                        text: format!(
                            "{} waits: {} not ready > {unready_budget} allowed (group {} is not ready yet)",
                            self.groups[gi + 1].name,
                            count(unready, "group"),
                            group.name
                        ),
                    });
                }
            }
            break;
        }
        self.set_waiting(wait, now, out);
        self.check_finished(now, out);
    }

    /// While paused or stopped: groups whose devices are all done end, nothing starts.
    pub(super) fn settle_passive(&mut self, now: u64, out: &mut Out) {
        for gi in 0..self.groups.len() {
            let g = &self.groups[gi];
            if g.state == GroupState::Running && g.counts.pending() == 0 && !g.dynamic {
                let s = success_met(&g.success, &g.counts);
                let name = g.name.clone();
                let group = &mut self.groups[gi];
                group.ended_at = Some(now);
                if s.met {
                    group.state = GroupState::Finished;
                    group.condition("Succeeded", true, "StageUpdatingSucceeded", now);
                    group.condition("Progressing", false, "StageUpdatingSucceeded", now);
                    let message = format!("group {name} finished: {}", s.reason);
                    let decision = Decision::new(TraceKind::GroupFinished, message);
                    self.record(now, decision.group(&name).compared(s.compared), out);
                } else {
                    group.state = GroupState::Error;
                    group.condition("Failed", true, "StageUpdatingFailed", now);
                    let message = format!("group {name} ended in error: {}", s.reason);
                    let decision = Decision::new(TraceKind::GroupFailed, message);
                    self.record(now, decision.group(&name).compared(s.compared), out);
                }
            }
        }
    }

    pub(super) fn set_waiting(&mut self, wait: Option<Wait>, now: u64, out: &mut Out) {
        let old_kind = self.waiting.as_deref().map(wait_kind);
        match wait {
            Some(w) => {
                let text = format!("{}: {}", w.kind, w.text);
                if self.waiting.as_deref() != Some(text.as_str()) {
                    // A site wait is traced again when another site or another reason holds
                    // the rollout, not when only its numbers moved.
                    let changed = old_kind != Some(w.kind)
                        || (w.kind == "site"
                            && self.waiting.as_deref().map(without_numbers)
                                != Some(without_numbers(&text)));
                    if changed {
                        let message = format!("waiting: {}", w.text);
                        self.record(now, Decision::new(TraceKind::Waiting, message), out);
                    }
                    self.waiting = Some(text);
                    out.touch(&self.name);
                }
            }
            None => {
                if self.waiting.take().is_some() {
                    out.touch(&self.name);
                }
            }
        }
    }

    /// Whether the approval request `name` was granted; creates it (and publishes it) when it
    /// does not exist yet.
    pub(super) fn approval_granted(
        &mut self,
        name: &str,
        gi: usize,
        when: &str,
        now: u64,
        out: &mut Out,
    ) -> bool {
        if let Some(a) = self.approvals.iter().find(|a| a.name == name) {
            return a.approved;
        }
        let request = ApprovalStatus {
            denied_at: None,
            denied: None,
            name: name.to_owned(),
            rollout: self.name.clone(),
            group: self.groups[gi].name.clone(),
            when: when.to_owned(),
            approved: false,
            created_at: now,
            approved_at: None,
            withdrawn: false,
        };
        self.approvals.push(request.clone());
        self.groups[gi].condition(
            "ApprovalRequestCreated",
            true,
            "AfterStageTaskApprovalRequestCreated",
            now,
        );
        out.commands.push(Effect::Approval(request));
        let gname = self.groups[gi].name.clone();
        let message =
            format!("approval {name} requested {when} group {gname}: flotilla approve {name}");
        let decision = Decision::new(TraceKind::ApprovalRequested, message);
        self.record(now, decision.group(&gname), out);
        false
    }

    /// Gives the approval `name` (`when` group `gi`) as an operator's explicit command did
    /// (`given`: "by alice via next (--skip-approval)"): created approved if it was not
    /// requested yet.
    pub(crate) fn grant(
        &mut self,
        name: &str,
        gi: usize,
        when: &str,
        given: &str,
        now: u64,
        out: &mut Out,
    ) {
        let index = match self.approvals.iter().position(|a| a.name == name) {
            Some(i) => i,
            None => {
                self.approvals.push(ApprovalStatus {
                    denied_at: None,
                    denied: None,
                    name: name.to_owned(),
                    rollout: self.name.clone(),
                    group: self.groups[gi].name.clone(),
                    when: when.to_owned(),
                    approved: false,
                    created_at: now,
                    approved_at: None,
                    withdrawn: false,
                });
                self.approvals.len() - 1
            }
        };
        let approval = &mut self.approvals[index];
        if approval.approved {
            return;
        }
        approval.approved = true;
        approval.approved_at = Some(now);
        let approval = approval.clone();
        self.groups[gi].condition(
            "ApprovalRequestApproved",
            true,
            "AfterStageTaskApprovalRequestApproved",
            now,
        );
        out.commands.push(Effect::Approval(approval));
        self.record(now, format!("approval {name} given {given}"), out);
    }

    /// Whether the approval `name` exists and was given.
    pub(crate) fn approved(&self, name: &str) -> bool {
        self.approvals.iter().any(|a| a.name == name && a.approved)
    }

    pub(super) fn start_group(&mut self, gi: usize, now: u64, out: &mut Out) {
        let why = match gi {
            0 => "first group".to_owned(),
            _ => {
                let prev = &self.groups[gi - 1];
                if prev.released {
                    format!("group {} released it", prev.name)
                } else {
                    format!(
                        "group {} is fully started and the unready-group budget allows it",
                        prev.name
                    )
                }
            }
        };
        let group = &mut self.groups[gi];
        let dropped = group.drop_deleted();
        group.state = GroupState::Running;
        // Its devices now count as waiting for their sites.
        group.cache.changes = group.cache.changes.wrapping_add(1);
        group.started_at = Some(now);
        group.condition("Progressing", true, "StageUpdatingStarted", now);
        let mut message = format!(
            "group {} started with {} ({why})",
            group.name,
            count(group.devices.len(), "device")
        );
        if !dropped.is_empty() {
            message.push_str(&format!(
                "; {} left it: {}",
                count(dropped.len(), "deleted device"),
                dropped.join(", ")
            ));
        }
        out.left
            .extend(dropped.into_iter().map(|d| (d, self.name.clone())));
        let gname = group.name.clone();
        let decision = Decision::new(TraceKind::GroupStarted, message);
        self.record(now, decision.group(&gname), out);
    }
}

pub(super) enum Step {
    Go,
    Wait(Wait),
    Stop,
}

/// A waiting text without its counts: "site harbour: of busy, waiting".
pub(super) fn without_numbers(text: &str) -> String {
    text.split_whitespace()
        .filter(|w| {
            !w.trim_end_matches([',', ';', ')'])
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The kind of a stored waiting text ("approval: …").
pub(super) fn wait_kind(text: &str) -> &str {
    text.split_once(':').map_or(text, |(k, _)| k)
}

/// Seconds in words: 90 -> "1m30s".
pub(crate) fn seconds(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    for (n, unit) in [(d, "d"), (h, "h"), (m, "m"), (s, "s")] {
        if n > 0 {
            out.push_str(&format!("{n}{unit}"));
        }
    }
    if out.is_empty() {
        out.push_str("0s");
    }
    out
}

/// Whether the device at `pos` of the group's list has not started.
pub(super) fn scheduled_at(group: &Group, pos: usize) -> bool {
    group
        .devices
        .get(pos)
        .and_then(|d| group.slots.get(d))
        .is_some_and(|s| s.phase == DevicePhase::Scheduled)
}

/// The group's per-site waiting queues: its devices from the cursor on that have not started.
pub(super) fn build_queues(group: &Group) -> SiteQueues {
    SiteQueues::build((group.cursor..group.devices.len()).filter_map(|pos| {
        let slot = group.slots.get(&group.devices[pos])?;
        (slot.phase == DevicePhase::Scheduled).then_some((pos, slot.site.as_deref()))
    }))
}
