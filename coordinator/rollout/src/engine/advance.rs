//! How a rollout moves: groups start in order behind their gates, devices start within a group as
//! its pace, the rate limit, the maintenance windows and overlapping rollouts allow, and the
//! success and error conditions release the next group, pause, stop or roll back.
//!
//! [`Rollout::advance`] is the one place where these decisions are made. It is called after every
//! input (a report, a command, a timer) and is idempotent: calling it again with nothing changed
//! changes nothing.

use std::collections::HashMap;

use flotilla_protocol::control::{ApprovalStatus, RolloutStatus, TraceKind};

use super::ended::Ended;
use super::model::{
    set_condition, DevicePhase, Group, GroupState, Rollout, RolloutState, Slot, Stall, ISSUED,
    ROLLING_BACK,
};
use super::queues::SiteQueues;
use super::trace::Decision;
use super::{attempt_action_id, rollback_action_id, Effect, TRACE_LIMIT};
use crate::conditions::{error_holds, error_met, success_holds, success_met};
use crate::plan::Threshold;
use crate::plan::{ErrorAction, OfflinePolicy, SuccessAction};
use crate::text::{agree, count};
use crate::window::{utc_text, Window, LOOKAHEAD};

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
struct Wait {
    kind: &'static str,
    text: String,
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

    fn desired(&self, gi: usize, device: &str, attempt: u32) -> Effect {
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
    fn successes(&self) -> usize {
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

    fn advance_groups(&mut self, now: u64, ctx: &Ctx, out: &mut Out) {
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
    fn settle_passive(&mut self, now: u64, out: &mut Out) {
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

    fn set_waiting(&mut self, wait: Option<Wait>, now: u64, out: &mut Out) {
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
    fn approval_granted(
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

    fn start_group(&mut self, gi: usize, now: u64, out: &mut Out) {
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

    /// Starts the group's next devices as far as every limit allows; returns why it stopped
    /// short, if it did.
    fn fill(&mut self, gi: usize, now: u64, ctx: &Ctx, out: &mut Out) -> Option<Wait> {
        if self.groups[gi].cursor >= self.groups[gi].devices.len() {
            return None;
        }
        if !ctx.windows.is_empty() && !ctx.windows.iter().any(|w| w.is_open(now)) {
            let next = ctx.windows.iter().filter_map(|w| w.next_open(now)).min();
            return Some(Wait {
                kind: "window",
                text: match next {
                    Some(at) => format!(
                        "outside the maintenance windows; the next opens at {}",
                        utc_text(at)
                    ),
                    None => "outside the maintenance windows".to_owned(),
                },
            });
        }
        let site_policy = self.spec.policies.sites.is_some();
        let generation = self.site_generation();
        if site_policy {
            if let Some(stall) = &self.groups[gi].cache.stalled {
                if stall.generation == generation && now < stall.until {
                    return Some(Wait {
                        kind: "site",
                        text: stall.text.clone(),
                    });
                }
            }
            self.groups[gi].cache.stalled = None;
        }
        let (offline_policy, my_weight) = (self.spec.policies.offline, self.spec.policies.weight);
        let successes = self.successes();
        let mut queues = self.site_queues(gi, now);
        // When the fill began: the group's sites with devices left to start, and whether devices
        // without a site are left too.
        let open_sites = self.groups[gi].cache.open_sites;
        let open_without_site =
            self.groups[gi].counts.scheduled > self.groups[gi].cache.scheduled_in_sites;
        let mut started = 0usize;
        let mut result = None;
        // Devices start in list order; one whose site is full is passed over (the cursor stays
        // on it) and the next is looked at, so other sites keep going. The queues give that
        // order; `pos` is where a scan of the list would be (devices before it were looked at).
        let mut pos = self.groups[gi].cursor;
        // The last look ended at a device it could not start or at the end of the list (not at
        // the end of a batch): the cursor moves up to the first device not started.
        let mut stopped = false;
        'batches: loop {
            let group = &self.groups[gi];
            if group.cursor >= group.devices.len() {
                break;
            }
            let total = group.counts.effective_total();
            if let Some(gate) = group.pace.gate {
                let allowed = gate.of(total);
                if group.counts.not_ready() > allowed {
                    result = Some(Wait {
                        kind: "budget",
                        text: format!(
                            "group {}: {} of {total} not ready > {allowed} allowed ({gate}); the next batch waits",
                            group.name,
                            group.counts.not_ready()
                        ),
                    });
                    break;
                }
            }
            let batch = group.pace.batch.unwrap_or(usize::MAX);
            let mut in_batch = 0usize;
            let mut last_started = pos;
            stopped = true;
            while in_batch < batch {
                let next = queues.next(|pos| scheduled_at(&self.groups[gi], pos));
                let group = &self.groups[gi];
                if let Some(limit) = group.pace.concurrency {
                    // The limit holds at the next device not started whose site was not yet
                    // found full in this fill, blocked sites' first devices included.
                    if group.counts.not_ready() >= limit
                        && (next.is_some() || queues.blocked_from(pos))
                    {
                        result = Some(Wait {
                            kind: "concurrency",
                            text: format!(
                                "group {}: {} of {limit} allowed at once are not ready",
                                group.name,
                                group.counts.not_ready()
                            ),
                        });
                        break 'batches;
                    }
                }
                let Some((at, site_id)) = next else {
                    break 'batches;
                };
                pos = at + 1;
                let device = group.devices[at].clone();
                let site = queues.name(site_id).map(str::to_owned);
                let peers = match site.as_ref() {
                    Some(site) => match self.site_gate(site, &device, now) {
                        Ok(peers) => peers,
                        Err(why) => {
                            queues.block(at, site_id, why);
                            continue;
                        }
                    },
                    None => Vec::new(),
                };
                if let Some(ramp) = self.ramp.as_mut() {
                    if ramp.available(now, successes) == 0 {
                        result = Some(Wait {
                            kind: "rate",
                            text: format!(
                                "rate limit of {:.1} devices per minute",
                                ramp.rate(successes)
                            ),
                        });
                        break 'batches;
                    }
                }
                let offline_since = ctx.offline.get(&device).copied();
                if offline_since.is_some() && offline_policy == OfflinePolicy::Skip {
                    let group = &mut self.groups[gi];
                    group.set_phase(
                        &device,
                        DevicePhase::Skipped("offline when its turn came".into()),
                    );
                    if let Some(slot) = group.slots.get_mut(&device) {
                        slot.ended_at = Some(now);
                    }
                    queues.pop(at, site_id);
                    let gname = group.name.clone();
                    let message = format!(
                        "device {device} skipped in group {gname}: offline when its turn came"
                    );
                    let decision = Decision::new(TraceKind::DeviceSkipped, message);
                    self.record(now, decision.group(&gname).device(&device), out);
                    continue;
                }
                if let Some((owner, weight)) = ctx.owners.get(&device) {
                    if owner != &self.name {
                        if *weight > my_weight {
                            result = Some(Wait {
                                kind: "overlap",
                                text: format!(
                                    "device {device} is busy with rollout {owner} (weight {weight} > {my_weight})"
                                ),
                            });
                            break 'batches;
                        }
                        out.preempt
                            .push((owner.clone(), device.clone(), self.name.clone()));
                    }
                }
                if let Some(site) = &site {
                    self.seed_if_first(site, &device, &peers, now);
                }
                self.start_device(gi, &device, peers, now, out);
                queues.pop(at, site_id);
                if let Some(ramp) = self.ramp.as_mut() {
                    ramp.take(1);
                }
                last_started = at + 1;
                in_batch += 1;
                started += 1;
            }
            // The batch is full: a scan would be just past its last device.
            stopped = false;
            self.advance_cursor(gi, last_started);
            if self.groups[gi].pace.gate.is_none() && self.groups[gi].pace.batch.is_some() {
                // A batch without a gate is only a chunk: go on with the next one.
                continue;
            }
            if self.groups[gi].pace.gate.is_none() {
                break;
            }
        }
        if stopped {
            self.advance_cursor(gi, usize::MAX);
        }
        self.groups[gi].cache.queues = Some(queues);
        if started > 0 {
            let group = &self.groups[gi];
            if group.pace.batch.is_some() || group.pace.gate.is_some() {
                let (name, begun, total, not_ready) = (
                    group.name.clone(),
                    group.cursor,
                    group.devices.len(),
                    group.counts.not_ready(),
                );
                let message = format!(
                    "group {name}: started {} ({begun} of {total} started, {not_ready} not ready)",
                    count(started, "device")
                );
                let decision = Decision::new(TraceKind::DevicesStarted, message);
                self.record(now, decision.group(&name), out);
            }
        }
        if result.is_some() {
            return result;
        }
        // The sites found full: when the fill got here, every site with devices left to start
        // was looked at.
        let queues = self.groups[gi].cache.queues.as_deref()?;
        let (site, why) = queues
            .blocked
            .first_key_value()
            .map(|(s, w)| (s.clone(), w.clone()))?;
        let all_blocked = !open_without_site && queues.blocked.len() >= open_sites;
        let until = queues.first_seed_wait().unwrap_or(u64::MAX);
        let wait = Wait {
            kind: "site",
            text: self.site_wait(&site, why),
        };
        if all_blocked {
            // Until a site changes, a fill would pass over the same devices again.
            self.groups[gi].cache.stalled = Some(Stall {
                generation: self.site_generation(),
                until,
                text: wait.text.clone(),
            });
        }
        Some(wait)
    }

    /// Moves a group's cursor past the devices that have started, up to `bound`.
    fn advance_cursor(&mut self, gi: usize, bound: usize) {
        let group = &mut self.groups[gi];
        let end = bound.min(group.devices.len());
        while group.cursor < end
            && group
                .slots
                .get(&group.devices[group.cursor])
                .map(|s| &s.phase)
                != Some(&DevicePhase::Scheduled)
        {
            group.cursor += 1;
        }
    }

    /// The group's waiting queues for a fill, up to date: the sites touched since the last
    /// fill are open again in every group's queues, and those whose seed wait ended.
    fn site_queues(&mut self, gi: usize, now: u64) -> Box<SiteQueues> {
        let touched: Vec<String> = self
            .groups
            .iter_mut()
            .flat_map(|g| {
                g.cache.touched_folded = 0;
                std::mem::take(&mut g.cache.touched)
            })
            .collect();
        for (i, g) in self.groups.iter_mut().enumerate() {
            if i != gi && g.state != GroupState::Running {
                // Built again if the group runs again.
                g.cache.queues = None;
            }
            if let Some(queues) = g.cache.queues.as_mut() {
                for site in &touched {
                    queues.reopen(site);
                }
            }
        }
        let mut queues = self.groups[gi]
            .cache
            .queues
            .take()
            .unwrap_or_else(|| Box::new(build_queues(&self.groups[gi])));
        queues.end_seed_waits(now);
        queues
    }

    /// Sends a device its desired action (first attempt), naming the peers it may fetch from.
    pub(crate) fn start_device(
        &mut self,
        gi: usize,
        device: &str,
        peers: Vec<String>,
        now: u64,
        out: &mut Out,
    ) {
        let group = &mut self.groups[gi];
        group.set_phase(device, DevicePhase::InProgress(ISSUED.to_owned()));
        if let Some(slot) = group.slots.get_mut(device) {
            slot.attempt = 1;
            slot.started_at = Some(now);
            slot.attempt_at = Some(now);
            slot.peers = peers;
        }
        if group.devices.get(group.cursor).map(String::as_str) == Some(device) {
            group.cursor += 1;
        }
        out.commands.push(self.desired(gi, device, 1));
        out.claims.push((
            device.to_owned(),
            self.name.clone(),
            self.spec.policies.weight,
        ));
    }

    /// Sends the next attempt of a device waiting for its retry.
    pub(crate) fn retry_device(&mut self, gi: usize, device: &str, now: u64, out: &mut Out) {
        let group = &mut self.groups[gi];
        let Some(slot) = group.slots.get_mut(device) else {
            return;
        };
        slot.attempt += 1;
        slot.attempt_at = Some(now);
        slot.retry_at = None;
        let attempt = slot.attempt;
        let site = slot.site.clone();
        group.set_phase(device, DevicePhase::InProgress(ISSUED.to_owned()));
        let gname = group.name.clone();
        // A retry fetches from the site's holders as they are now (none: from the coordinator).
        let peers = site
            .filter(|_| self.spec.policies.sites.as_ref().is_some_and(|p| p.peers))
            .map(|site| self.holders_for(&site, device))
            .unwrap_or_default();
        if let Some(slot) = self.groups[gi].slots.get_mut(device) {
            slot.peers = peers;
        }
        out.commands.push(self.desired(gi, device, attempt));
        out.claims.push((
            device.to_owned(),
            self.name.clone(),
            self.spec.policies.weight,
        ));
        let message = format!("device {device} in group {gname}: attempt {attempt} sent");
        let decision = Decision::new(TraceKind::DeviceStarted, message);
        self.record(now, decision.group(&gname).device(device), out);
    }

    /// Moves a retry that is due while the maintenance windows are closed to the next opening
    /// (or a lookahead later when none opens within it, to look again then).
    fn defer_retry(
        &mut self,
        gi: usize,
        device: &str,
        now: u64,
        windows: &[Window],
        out: &mut Out,
    ) {
        let opens = windows.iter().filter_map(|w| w.next_open(now)).min();
        let group = &mut self.groups[gi];
        let gname = group.name.clone();
        let Some(slot) = group.slots.get_mut(device) else {
            return;
        };
        slot.retry_at = Some(opens.unwrap_or(now + LOOKAHEAD));
        let when = match opens {
            Some(at) => format!("which opens at {}", utc_text(at)),
            None => "none of which opens within 366 days".to_owned(),
        };
        self.record(
            now,
            format!(
                "device {device} in group {gname}: retry waits for the maintenance window, {when}"
            ),
            out,
        );
    }

    /// Applies the group's error condition; true when it fired (the caller stops advancing).
    fn check_error(&mut self, gi: usize, now: u64, out: &mut Out) -> bool {
        let group = &self.groups[gi];
        // The words are only made when the condition holds.
        if !group
            .error
            .as_ref()
            .is_some_and(|cond| error_holds(cond, &group.counts))
        {
            return false;
        }
        let Some(cond) = group.error.clone() else {
            return false;
        };
        let e = error_met(&cond, &group.counts);
        if !e.met {
            return false;
        }
        let gname = group.name.clone();
        let name = self.name.clone();
        let group = &mut self.groups[gi];
        group.state = GroupState::Error;
        group.ended_at = Some(now);
        group.condition("Failed", true, "StageUpdatingFailed", now);
        match cond.action {
            ErrorAction::Pause => {
                self.state = RolloutState::Paused;
                self.set_condition("Progressing", false, "UpdateRunPaused", now);
                let message = format!("group {gname} paused rollout {name}: {}", e.reason);
                let decision = Decision::new(TraceKind::ErrorPaused, message);
                self.record(now, decision.group(&gname).compared(e.compared), out);
            }
            ErrorAction::Stop => {
                let ended = self.cancel_unfinished(now, out);
                self.fail(now);
                let message = format!(
                    "group {gname} stopped rollout {name}: {}; {}",
                    e.reason,
                    ended.describe(&self.release.name)
                );
                let decision = Decision::new(TraceKind::ErrorStopped, message);
                self.record(now, decision.group(&gname).compared(e.compared), out);
            }
            ErrorAction::Rollback => {
                let ended = self.cancel_unfinished(now, out);
                let rolled = self.roll_back(now, out);
                self.rolled_back = true;
                self.fail(now);
                let later = if ended.finishing > 0 {
                    format!(
                        "; the {} past activation {} sent back when {}",
                        count(ended.finishing, "device"),
                        agree(ended.finishing, "is", "are"),
                        agree(ended.finishing, "it finishes", "they finish")
                    )
                } else {
                    String::new()
                };
                let ended = Ended {
                    finishing: 0,
                    ..ended
                };
                let message = format!(
                        "group {gname} rolled back rollout {name}: {}; {}, sending {} back to the release {} kept{later}",
                        e.reason,
                        ended.describe(&self.release.name),
                        count(rolled, "device"),
                        agree(rolled, "it", "they")
                );
                let decision = Decision::new(TraceKind::ErrorRolledBack, message);
                self.record(now, decision.group(&gname).compared(e.compared), out);
            }
        }
        true
    }

    fn fail(&mut self, now: u64) {
        self.state = RolloutState::Failed;
        self.waiting = None;
        self.set_condition("Progressing", false, "UpdateRunFailed", now);
        self.set_condition("Failed", true, "UpdateRunFailed", now);
    }

    /// Ends every unfinished device action: scheduled devices are dropped, actions that have
    /// not passed activation are canceled, soaking devices count as ready, devices waiting for
    /// a retry as failed. Devices past activation are left to finish (the agent ignores a
    /// cancel from there) and end with their own report. Groups with nothing left end now.
    pub(crate) fn cancel_unfinished(&mut self, now: u64, out: &mut Out) -> Ended {
        let mut ended = Ended::default();
        let (rname, created_at) = (self.name.clone(), self.created_at);
        for gi in 0..self.groups.len() {
            let group = &mut self.groups[gi];
            let open: Vec<(String, DevicePhase, u32)> = group
                .slots
                .iter()
                .filter(|(_, s)| !s.phase.is_terminal())
                .map(|(d, s)| (d.clone(), s.phase.clone(), s.attempt))
                .collect();
            for (device, phase, attempt) in open {
                let new = match phase {
                    DevicePhase::Scheduled => {
                        ended.dropped += 1;
                        DevicePhase::Canceled
                    }
                    DevicePhase::Soaking => {
                        ended.soaked += 1;
                        DevicePhase::Ready
                    }
                    DevicePhase::Retrying(reason) => {
                        ended.retries += 1;
                        DevicePhase::Failed(reason)
                    }
                    DevicePhase::InProgress(p) if p == ROLLING_BACK => continue,
                    p if p.past_activation() => {
                        ended.finishing += 1;
                        out.releases.push((device, rname.clone()));
                        continue;
                    }
                    _ => {
                        ended.canceled += 1;
                        out.commands.push(Effect::Cancel {
                            action_id: attempt_action_id(&rname, created_at, &device, attempt),
                            device: device.clone(),
                            rollout: rname.clone(),
                        });
                        DevicePhase::Canceled
                    }
                };
                group.set_phase(&device, new);
                if let Some(slot) = group.slots.get_mut(&device) {
                    slot.ended_at = Some(now);
                    slot.soak_until = None;
                    slot.retry_at = None;
                }
                out.releases.push((device, rname.clone()));
            }
            // A group held by its before approval never started: it stays scheduled, like the
            // groups after it.
            if group.state == GroupState::Approval {
                group.state = GroupState::Scheduled;
            }
            if matches!(group.state, GroupState::Running | GroupState::Waiting)
                && group.counts.pending() == 0
            {
                group.state = if success_met(&group.success, &group.counts).met {
                    GroupState::Finished
                } else {
                    GroupState::Error
                };
                group.ended_at.get_or_insert(now);
            }
        }
        ended
    }

    /// A device of a stopped or failed rollout finished on the new release after the rollout
    /// ended: it was past activation then, or its cancel came too late. After the rollback
    /// error action it is sent back too; otherwise it counts as ready, as it is.
    pub(crate) fn finished_late(
        &mut self,
        gi: usize,
        device: &str,
        was: &DevicePhase,
        now: u64,
        out: &mut Out,
    ) {
        let (rname, created_at) = (self.name.clone(), self.created_at);
        let release = self.release.name.clone();
        let group = &mut self.groups[gi];
        let gname = group.name.clone();
        let Some(slot) = group.slots.get_mut(device) else {
            return;
        };
        slot.ended_at = Some(now);
        slot.soak_until = None;
        let attempt = slot.attempt;
        let why = match was {
            DevicePhase::Canceled => "its cancel came after activation",
            DevicePhase::TimedOut(_) => "after it had timed out",
            _ => "it was past activation when the rollout ended",
        };
        if self.rolled_back {
            group.set_phase(device, DevicePhase::InProgress(ROLLING_BACK.to_owned()));
            out.commands.push(Effect::Rollback {
                device: device.to_owned(),
                action_id: rollback_action_id(&rname, created_at, device),
                undo: attempt_action_id(&rname, created_at, device, attempt),
                rollout: rname.clone(),
            });
            out.claims.push((device.to_owned(), rname, u32::MAX));
            self.record(
                now,
                format!(
                    "device {device} in group {gname} finished on release {release} ({why}); sending it back to the release it kept"
                ),
                out,
            );
        } else {
            group.set_phase(device, DevicePhase::Ready);
            out.releases.push((device.to_owned(), rname));
            self.record(
                now,
                format!(
                    "device {device} in group {gname} finished on release {release} ({why}); it counts as ready"
                ),
                out,
            );
        }
    }

    /// A device that had failed or timed out reported ready: a group that ended in error only
    /// because of it is evaluated again (a paused rollout stays paused).
    pub(crate) fn reopen(&mut self, gi: usize, device: &str, now: u64, out: &mut Out) {
        let group = &self.groups[gi];
        if group.state != GroupState::Error || group.dynamic {
            return;
        }
        if let Some(cond) = &group.error {
            if error_met(cond, &group.counts).met {
                return;
            }
        }
        let gname = group.name.clone();
        let ready = group.counts.ready + group.counts.soaking;
        let total = group.counts.effective_total();
        let group = &mut self.groups[gi];
        group.state = GroupState::Running;
        group.ended_at = None;
        group.condition("Failed", false, "StageUpdatingReevaluated", now);
        self.record(
            now,
            format!(
                "group {gname} is no longer in error: device {device} reported ready late ({ready} of {total} ready)"
            ),
            out,
        );
    }

    /// Sends every device that installed the release back to the one it kept.
    fn roll_back(&mut self, _now: u64, out: &mut Out) -> usize {
        let mut rolled = 0;
        let (rname, created_at) = (self.name.clone(), self.created_at);
        for group in &mut self.groups {
            let installed: Vec<(String, u32)> = group
                .slots
                .iter()
                .filter(|(_, s)| matches!(s.phase, DevicePhase::Ready | DevicePhase::Soaking))
                .map(|(d, s)| (d.clone(), s.attempt))
                .collect();
            for (device, attempt) in installed {
                group.set_phase(&device, DevicePhase::InProgress(ROLLING_BACK.to_owned()));
                out.commands.push(Effect::Rollback {
                    device: device.clone(),
                    action_id: rollback_action_id(&rname, created_at, &device),
                    undo: attempt_action_id(&rname, created_at, &device, attempt),
                    rollout: rname.clone(),
                });
                out.claims.push((device, rname.clone(), u32::MAX));
                rolled += 1;
            }
        }
        rolled
    }

    /// Applies the group's success condition and its after gate.
    fn check_success(&mut self, gi: usize, now: u64, out: &mut Out) -> Step {
        let group = &self.groups[gi];
        if !matches!(
            group.state,
            GroupState::Running | GroupState::Waiting | GroupState::Finished
        ) || group.dynamic
        {
            return Step::Go;
        }
        if group.succeeded_at.is_none() {
            // The words are only made when the condition holds.
            if !success_holds(&group.success, &group.counts) {
                return Step::Go;
            }
            let s = success_met(&group.success, &group.counts);
            if !s.met {
                return Step::Go;
            }
            let gname = group.name.clone();
            self.groups[gi].succeeded_at = Some(now);
            let message = format!("group {gname} succeeded: {}", s.reason);
            let decision = Decision::new(TraceKind::GroupSucceeded, message);
            self.record(now, decision.group(&gname).compared(s.compared), out);
        }
        let group = &self.groups[gi];
        let gname = group.name.clone();
        let succeeded_at = group.succeeded_at.unwrap_or(now);
        let after = group.after;
        let mut pending = Vec::new();
        if after.approval {
            let name = after_approval(&self.name, &gname);
            if !self.approval_granted(&name, gi, "after", now, out) {
                pending.push(format!("approval: flotilla approve {name}"));
            }
        }
        if after.wait > 0 {
            let until = succeeded_at + after.wait;
            if now < until {
                pending.push(format!(
                    "timed wait until {} ({} left)",
                    utc_text(until),
                    seconds(until - now)
                ));
            } else if !self.groups[gi]
                .conditions
                .iter()
                .any(|c| c.kind == "WaitTimeElapsed")
            {
                self.groups[gi].condition(
                    "WaitTimeElapsed",
                    true,
                    "AfterStageTaskWaitTimeElapsed",
                    now,
                );
                let message = format!("group {gname}: timed wait elapsed");
                let decision = Decision::new(TraceKind::WaitElapsed, message);
                self.record(now, decision.group(&gname), out);
            }
        }
        if !pending.is_empty() {
            let group = &mut self.groups[gi];
            if group.counts.pending() == 0 && group.state == GroupState::Running {
                group.state = GroupState::Waiting;
                group.condition("Progressing", false, "StageUpdatingWaiting", now);
                out.touch(&self.name);
            }
            return Step::Wait(Wait {
                kind: if after.approval && pending[0].starts_with("approval") {
                    "approval"
                } else {
                    "wait"
                },
                text: format!("group {gname} waits for {}", pending.join(" and ")),
            });
        }
        let group = &mut self.groups[gi];
        group.released = true;
        let name = self.name.clone();
        match group.success.action {
            SuccessAction::Next => {
                out.touch(&name);
                Step::Go
            }
            SuccessAction::Pause => {
                self.check_done(gi, now, out);
                self.state = RolloutState::Paused;
                self.set_condition("Progressing", false, "UpdateRunPaused", now);
                let message =
                    format!("group {gname} succeeded; its success action paused rollout {name}");
                let decision = Decision::new(TraceKind::SuccessPaused, message);
                self.record(now, decision.group(&gname), out);
                Step::Stop
            }
        }
    }

    /// Ends a group whose devices are all done; true when that paused the rollout.
    fn check_done(&mut self, gi: usize, now: u64, out: &mut Out) -> bool {
        let group = &self.groups[gi];
        if group.dynamic {
            return false;
        }
        match group.state {
            GroupState::Waiting if group.released => {
                let group = &mut self.groups[gi];
                group.state = GroupState::Finished;
                group.ended_at.get_or_insert(now);
                group.condition("Succeeded", true, "StageUpdatingSucceeded", now);
                let gname = group.name.clone();
                let message = format!("group {gname} finished");
                let decision = Decision::new(TraceKind::GroupFinished, message);
                self.record(now, decision.group(&gname), out);
                false
            }
            GroupState::Running if group.counts.pending() == 0 => {
                let s = success_met(&group.success, &group.counts);
                let gname = group.name.clone();
                let name = self.name.clone();
                let group = &mut self.groups[gi];
                group.ended_at = Some(now);
                if group.succeeded_at.is_some() || s.met {
                    if group.released {
                        group.state = GroupState::Finished;
                        group.condition("Succeeded", true, "StageUpdatingSucceeded", now);
                        group.condition("Progressing", false, "StageUpdatingSucceeded", now);
                        let message = format!("group {gname} finished: {}", s.reason);
                        let decision = Decision::new(TraceKind::GroupFinished, message);
                        self.record(now, decision.group(&gname).compared(s.compared), out);
                    } else {
                        group.state = GroupState::Waiting;
                        group.condition("Progressing", false, "StageUpdatingWaiting", now);
                        out.touch(&name);
                    }
                    false
                } else {
                    group.state = GroupState::Error;
                    group.condition("Failed", true, "StageUpdatingFailed", now);
                    self.state = RolloutState::Paused;
                    self.set_condition("Progressing", false, "UpdateRunPaused", now);
                    let message = format!(
                        "group {gname} paused rollout {name}: every device is done and {}",
                        s.reason
                    );
                    let decision = Decision::new(TraceKind::GroupFailed, message);
                    self.record(now, decision.group(&gname).compared(s.compared), out);
                    true
                }
            }
            _ => false,
        }
    }

    pub(crate) fn check_finished(&mut self, now: u64, out: &mut Out) {
        if self.state != RolloutState::Running
            || !self.groups.iter().all(|g| {
                g.state == GroupState::Finished || (g.state == GroupState::Error && g.released)
            })
        {
            return;
        }
        self.state = RolloutState::Finished;
        self.waiting = None;
        // A group passed in error may have devices it never started (its pace or site budgets
        // held them): they were sent nothing and end canceled, as when a rollout is stopped.
        let mut dropped = 0;
        for group in self
            .groups
            .iter_mut()
            .filter(|g| g.state == GroupState::Error)
        {
            let never: Vec<String> = group
                .slots
                .iter()
                .filter(|(_, s)| s.phase == DevicePhase::Scheduled)
                .map(|(d, _)| d.clone())
                .collect();
            for device in never {
                group.set_phase(&device, DevicePhase::Canceled);
                if let Some(slot) = group.slots.get_mut(&device) {
                    slot.ended_at = Some(now);
                }
                dropped += 1;
            }
        }
        let (ready, failed) = self.groups.iter().fold((0, 0), |(r, f), g| {
            (r + g.counts.ready, f + g.counts.failures())
        });
        // A group passed in error (the operator resumed past it) leaves the run unsuccessful.
        let errors: Vec<&str> = self
            .groups
            .iter()
            .filter(|g| g.state == GroupState::Error)
            .map(|g| g.name.as_str())
            .collect();
        let mut message = format!(
            "rollout {} finished: {ready} of {} ready, {failed} failed",
            self.name,
            count(self.device_total(), "device")
        );
        if errors.is_empty() {
            // KubeFleet keeps Progressing true (UpdateRunStarted) beside Succeeded when a run
            // ends well.
            self.set_condition("Succeeded", true, "UpdateRunSucceeded", now);
        } else {
            message.push_str(&format!(
                "; not succeeded: group {} ended in error",
                errors.join(", ")
            ));
            if dropped > 0 {
                message.push_str(&format!(
                    "; {} it never started {}",
                    count(dropped, "device"),
                    agree(dropped, "stays as it is", "stay as they are")
                ));
            }
            self.set_condition("Progressing", false, "UpdateRunFailed", now);
            self.set_condition("Succeeded", false, "UpdateRunFailed", now);
        }
        self.record(now, Decision::new(TraceKind::Finished, message), out);
    }

    /// How long a device past activation may go on without a report once its rollout was stopped
    /// or failed, when the spec sets no in-progress timeout: then it counts as timed out.
    pub(crate) const ENDED_GRACE: u64 = 3600;

    /// Timers: start time, soak, retries, in-progress timeouts and offline grace. Returns
    /// whether anything changed.
    pub(crate) fn run_timers(&mut self, now: u64, ctx: &Ctx, out: &mut Out) -> bool {
        let (timeout, offline) = (self.spec.policies.timeout, self.spec.policies.offline);
        // A rollout that ended leaves no device "running" forever: one past activation that never
        // reports times out after `ENDED_GRACE` when the spec sets no timeout of its own.
        let ended = matches!(self.state, RolloutState::Stopped | RolloutState::Failed);
        let timeout = timeout.or(ended.then_some(Self::ENDED_GRACE));
        // Only soaking devices, retries, timeouts and offline grace have per-device timers; a
        // rollout without them skips the scan (it runs every second).
        let per_device = timeout.is_some()
            || self.spec.policies.retry.is_some()
            || matches!(offline, OfflinePolicy::Fail { .. });
        let mut changed = false;
        let running = self.state == RolloutState::Running;
        for gi in 0..self.groups.len() {
            let group = &self.groups[gi];
            if group.counts.soaking == 0 && (!per_device || group.counts.in_progress == 0) {
                continue;
            }
            let mut soaked = Vec::new();
            let mut retry = Vec::new();
            let mut timed_out = Vec::new();
            for (device, slot) in &group.slots {
                match &slot.phase {
                    DevicePhase::Soaking if slot.soak_until.is_some_and(|t| t <= now) => {
                        soaked.push(device.clone());
                    }
                    DevicePhase::Retrying(_)
                        if running && slot.retry_at.is_some_and(|t| t <= now) =>
                    {
                        retry.push(device.clone());
                    }
                    DevicePhase::InProgress(name) if name != ROLLING_BACK => {
                        if let (Some(limit), Some(at)) = (timeout, slot.attempt_at) {
                            if at + limit <= now {
                                let why = if ended && self.spec.policies.timeout.is_none() {
                                    format!(
                                        "no answer within {} and the rollout has ended",
                                        seconds(limit)
                                    )
                                } else {
                                    format!("no answer within {}", seconds(limit))
                                };
                                timed_out.push((device.clone(), why));
                                continue;
                            }
                        }
                        if let OfflinePolicy::Fail { grace } = offline {
                            if let Some(&since) = ctx.offline.get(device) {
                                if since + grace <= now {
                                    timed_out.push((
                                        device.clone(),
                                        format!("offline for more than {}", seconds(grace)),
                                    ));
                                }
                            }
                        }
                    }
                    _ => {}
                }
            }
            for device in soaked {
                let group = &mut self.groups[gi];
                group.set_phase(&device, DevicePhase::Ready);
                if let Some(slot) = group.slots.get_mut(&device) {
                    slot.soak_until = None;
                }
                out.releases.push((device, self.name.clone()));
                changed = true;
            }
            for device in retry {
                // Maintenance windows gate every start, a retry too: one due while they are
                // closed moves to the next opening.
                if !ctx.windows.is_empty() && !ctx.windows.iter().any(|w| w.is_open(now)) {
                    self.defer_retry(gi, &device, now, ctx.windows, out);
                } else {
                    self.retry_device(gi, &device, now, out);
                }
                changed = true;
            }
            for (device, reason) in timed_out {
                self.fail_device(gi, &device, DevicePhase::TimedOut(reason), now, out);
                changed = true;
            }
        }
        changed
    }

    /// A device failed (or timed out): a retry when one is left, otherwise the failure counts.
    pub(crate) fn fail_device(
        &mut self,
        gi: usize,
        device: &str,
        failure: DevicePhase,
        now: u64,
        out: &mut Out,
    ) {
        let retry = self.spec.policies.retry;
        let name = self.name.clone();
        let group = &mut self.groups[gi];
        let gname = group.name.clone();
        let Some(slot) = group.slots.get_mut(device) else {
            return;
        };
        let attempt = slot.attempt.max(1);
        let reason = failure.reason().unwrap_or_default().to_owned();
        // An ended rollout sends nothing more: its failures are final. Nor does a canceled
        // action that failed afterwards (it was past activation): the device was taken over by
        // another rollout, or this one stopped; a retry would send this rollout's install over
        // whatever the device was sent since.
        let retryable = !matches!(failure, DevicePhase::Refused(_))
            && !self.state.is_terminal()
            && slot.phase != DevicePhase::Canceled;
        if let Some(r) = retry.filter(|r| retryable && attempt <= r.attempts) {
            let delay = r.backoff.saturating_mul(1u64 << (attempt - 1).min(20));
            slot.retry_at = Some(now + delay);
            group.set_phase(device, DevicePhase::Retrying(reason.clone()));
            let message = format!(
                "device {device} in group {gname}: attempt {attempt} ended ({reason}); retry {attempt} of {} in {}",
                r.attempts,
                seconds(delay)
            );
            let decision = Decision::new(TraceKind::DeviceRetrying, message);
            self.record(now, decision.group(&gname).device(device), out);
            return;
        }
        slot.ended_at = Some(now);
        slot.retry_at = None;
        if matches!(failure, DevicePhase::TimedOut(_)) {
            let message = format!("device {device} in group {gname} timed out: {reason}");
            let decision = Decision::new(TraceKind::DeviceTimedOut, message);
            self.record(now, decision.group(&gname).device(device), out);
        }
        let group = &mut self.groups[gi];
        group.set_phase(device, failure);
        out.releases.push((device.to_owned(), name));
    }

    /// The earliest time a timer of this rollout is due.
    pub(crate) fn next_timer(&self, ctx: &Ctx) -> Option<u64> {
        let p = &self.spec.policies;
        let mut next: Option<u64> = None;
        let mut consider = |t: u64| next = Some(next.map_or(t, |n: u64| n.min(t)));
        match self.state {
            RolloutState::Scheduled => {
                if let Some(at) = p.start_at {
                    consider(at);
                }
                return next;
            }
            RolloutState::Running | RolloutState::Paused => {}
            // Devices past activation when the rollout ended still time out.
            RolloutState::Stopped | RolloutState::Failed if self.in_flight() => {}
            _ => return None,
        }
        let ended = self.state.is_terminal();
        for group in &self.groups {
            if let (Some(at), true) = (
                group.succeeded_at,
                group.after.wait > 0 && !group.released && !ended,
            ) {
                consider(at + group.after.wait);
            }
            if group.counts.in_progress + group.counts.soaking == 0 {
                continue;
            }
            for (device, slot) in &group.slots {
                match &slot.phase {
                    DevicePhase::Soaking => slot.soak_until.into_iter().for_each(&mut consider),
                    DevicePhase::Retrying(_) => slot.retry_at.into_iter().for_each(&mut consider),
                    DevicePhase::InProgress(name) if name != ROLLING_BACK => {
                        let ended_grace =
                            matches!(self.state, RolloutState::Stopped | RolloutState::Failed)
                                .then_some(Self::ENDED_GRACE);
                        if let (Some(limit), Some(at)) =
                            (p.timeout.or(ended_grace), slot.attempt_at)
                        {
                            consider(at + limit);
                        }
                        if let OfflinePolicy::Fail { grace } = p.offline {
                            if let Some(&since) = ctx.offline.get(device) {
                                consider(since + grace);
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        if self.state == RolloutState::Running {
            if let Some(at) = self.next_seed_deadline() {
                consider(at);
            }
            if let Some(w) = self.waiting.as_deref() {
                match wait_kind(w) {
                    "window" => {
                        let now = self.checked_at;
                        if let Some(at) = ctx.windows.iter().filter_map(|w| w.next_open(now)).min()
                        {
                            consider(at);
                        }
                    }
                    "rate" => {
                        if let Some(ramp) = &self.ramp {
                            consider(ramp.next_at(self.checked_at, self.successes()));
                        }
                    }
                    _ => {}
                }
            }
        }
        next
    }

    /// Some device's action is still under way (an ended rollout keeps those past activation).
    pub(crate) fn in_flight(&self) -> bool {
        self.groups
            .iter()
            .any(|g| g.counts.in_progress + g.counts.soaking > 0)
    }

    /// Adds a device that registered after the start to the dynamic group.
    pub(crate) fn join_dynamic(
        &mut self,
        device: &str,
        site: Option<String>,
        now: u64,
        out: &mut Out,
    ) -> Option<usize> {
        let gi = self.groups.iter().position(|g| g.dynamic)?;
        let group = &mut self.groups[gi];
        if group.slots.contains_key(device) {
            return None;
        }
        group.devices.push(device.to_owned());
        let slot = Slot {
            site,
            ..Slot::scheduled()
        };
        if let Some(queues) = group.cache.queues.as_mut() {
            queues.append(group.devices.len() - 1, slot.site.as_deref());
        }
        if let Some(site) = &slot.site {
            group.cache.update_site(site, |c| {
                c.total += 1;
                c.scheduled += 1;
            });
        }
        group.cache.changes = group.cache.changes.wrapping_add(1);
        group.slots.insert(device.to_owned(), slot);
        group.counts.total += 1;
        group.counts.scheduled += 1;
        let gname = group.name.clone();
        let message =
            format!("device {device} registered after the start and joined group {gname}");
        let decision = Decision::new(TraceKind::DeviceJoined, message);
        self.record(now, decision.group(&gname).device(device), out);
        Some(gi)
    }
}

enum Step {
    Go,
    Wait(Wait),
    Stop,
}

/// A waiting text without its counts: "site harbour: of busy, waiting".
fn without_numbers(text: &str) -> String {
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
fn wait_kind(text: &str) -> &str {
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
fn scheduled_at(group: &Group, pos: usize) -> bool {
    group
        .devices
        .get(pos)
        .and_then(|d| group.slots.get(d))
        .is_some_and(|s| s.phase == DevicePhase::Scheduled)
}

/// The group's per-site waiting queues: its devices from the cursor on that have not started.
fn build_queues(group: &Group) -> SiteQueues {
    SiteQueues::build((group.cursor..group.devices.len()).filter_map(|pos| {
        let slot = group.slots.get(&group.devices[pos])?;
        (slot.phase == DevicePhase::Scheduled).then_some((pos, slot.site.as_deref()))
    }))
}
