//! Operators' commands on a rollout: start, pause, resume, stop, approve, trigger the next
//! group, retry failed devices, delete a device.

use super::create::new_group;
use super::*;
use crate::text::{agree, count};

impl Engine {
    pub(super) fn entry(&mut self, name: &str) -> Result<&mut Entry, EngineError> {
        self.rollouts
            .get_mut(name)
            .ok_or_else(|| EngineError::UnknownRollout(name.to_owned()))
    }

    pub(super) fn invalid(r: &Rollout, command: &'static str) -> EngineError {
        EngineError::InvalidTransition {
            rollout: r.name.clone(),
            state: r.state,
            command,
        }
    }

    /// ready -> running (or scheduled until `start_at`): the first group starts. Scheduled
    /// actions of older rollouts on the same devices are canceled (hawkBit).
    pub fn start(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        self.start_by(name, OPERATOR, now)
    }

    /// [`Engine::start`] on behalf of `by`, whom the trace names.
    pub fn start_by(&mut self, name: &str, by: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        let r = &mut self.entry(name)?.rollout;
        if r.state != RolloutState::Ready {
            return Err(Self::invalid(r, "start"));
        }
        let mut out = Out::default();
        r.set_condition("Progressing", true, "UpdateRunStarted", now);
        match r.spec.policies.start_at {
            Some(at) if at > now => {
                r.state = RolloutState::Scheduled;
                let message = format!(
                    "started by {by}; waits for its start time {}",
                    crate::window::utc_text(at)
                );
                r.record(
                    now,
                    Decision::new(TraceKind::Started, message).by(by),
                    &mut out,
                );
            }
            _ => {
                let message = format!("rollout started by {by}");
                r.record(
                    now,
                    Decision::new(TraceKind::Started, message).by(by),
                    &mut out,
                );
                r.starting(now, &mut out);
            }
        }
        self.cancel_older_scheduled(name, now, &mut out);
        self.advance(name, now, &mut out);
        Ok(self.emit(out))
    }

    /// hawkBit: a newer rollout cancels the older rollouts' scheduled (never sent) actions on
    /// the same devices, directly on the server.
    pub(super) fn cancel_older_scheduled(&mut self, name: &str, now: u64, out: &mut Out) {
        let Some(entry) = self.rollouts.get(name) else {
            return;
        };
        let created = entry.rollout.created_at;
        let devices: Vec<String> = entry.index.keys().cloned().collect();
        let mut touched = Vec::new();
        for (other, e) in &mut self.rollouts {
            if other == name
                || !e.rollout.state.is_active() && e.rollout.state != RolloutState::Ready
            {
                continue;
            }
            if e.rollout.created_at > created {
                continue;
            }
            let mut canceled = 0;
            for device in &devices {
                let Some(&gi) = e.index.get(device) else {
                    continue;
                };
                let group = &mut e.rollout.groups[gi];
                if group.slots.get(device).map(|s| &s.phase) == Some(&DevicePhase::Scheduled) {
                    group.set_phase(device, DevicePhase::Canceled);
                    canceled += 1;
                }
            }
            if canceled > 0 {
                let message = format!(
                    "{} canceled: newer rollout {name} covers {}",
                    count(canceled, "scheduled device action"),
                    agree(canceled, "that device", "those devices")
                );
                let decision = Decision::new(TraceKind::ActionsCanceled, message);
                e.rollout.record(now, decision, out);
                touched.push(other.clone());
            }
        }
        for other in touched {
            self.advance(&other, now, out);
        }
    }

    /// running -> paused: actions already sent continue and keep reporting; nothing new starts.
    pub fn pause(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        self.pause_by(name, OPERATOR, now)
    }

    /// [`Engine::pause`] on behalf of `by`, whom the trace names.
    pub fn pause_by(&mut self, name: &str, by: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        let r = &mut self.entry(name)?.rollout;
        if !matches!(r.state, RolloutState::Running | RolloutState::Scheduled) {
            return Err(Self::invalid(r, "pause"));
        }
        let mut out = Out::default();
        r.state = RolloutState::Paused;
        r.waiting = None;
        r.set_condition("Progressing", false, "UpdateRunPaused", now);
        let message = format!("paused by {by}");
        r.record(
            now,
            Decision::new(TraceKind::Paused, message).by(by),
            &mut out,
        );
        Ok(self.emit(out))
    }

    /// paused -> running. A group in error, or whose success action paused the rollout, counts
    /// as done: the operator chose to continue, so the group after it starts.
    pub fn resume(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        self.resume_by(name, OPERATOR, now)
    }

    /// [`Engine::resume`] on behalf of `by`, whom the trace names.
    pub fn resume_by(
        &mut self,
        name: &str,
        by: &str,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        let r = &mut self.entry(name)?.rollout;
        if r.state != RolloutState::Paused {
            return Err(Self::invalid(r, "resume"));
        }
        let mut out = Out::default();
        r.state = RolloutState::Running;
        r.set_condition("Progressing", true, "UpdateRunResumed", now);
        let mut passed = Vec::new();
        for g in &mut r.groups {
            if g.state == GroupState::Error && !g.released {
                g.released = true;
                passed.push(g.name.clone());
            }
        }
        let message = if passed.is_empty() {
            format!("resumed by {by}")
        } else {
            format!(
                "resumed by {by}; group {} in error counts as done",
                passed.join(", ")
            )
        };
        r.record(
            now,
            Decision::new(TraceKind::Resumed, message).by(by),
            &mut out,
        );
        // Resuming past a group in error is the operator's decision about that group, so its
        // after approval is given with it, in the operator's name, and the trace says so.
        for gi in 0..r.groups.len() {
            let g = &r.groups[gi];
            if g.after.approval && passed.contains(&g.name) {
                let approval = after_approval(&r.name, &g.name);
                r.grant(
                    &approval,
                    gi,
                    "after",
                    &format!("by {by} via resume"),
                    now,
                    &mut out,
                );
            }
        }
        self.advance(name, now, &mut out);
        Ok(self.emit(out))
    }

    /// Stops a rollout for good: no group starts again and every unfinished device ends by its
    /// phase (docs/operations.md): not started, canceled, or, past activation, left to finish
    /// on the new release and counted by its own report.
    pub fn stop(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        self.stop_by(name, OPERATOR, now)
    }

    /// [`Engine::stop`] on behalf of `by`, whom the trace names.
    pub fn stop_by(&mut self, name: &str, by: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        let r = &mut self.entry(name)?.rollout;
        if r.state.is_terminal() {
            return Err(Self::invalid(r, "stop"));
        }
        let mut out = Out::default();
        // Stopped first: a device ending now ends for good (no retry is scheduled).
        r.state = RolloutState::Stopped;
        let ended = r.cancel_unfinished(now, &mut out);
        r.waiting = None;
        r.set_condition("Progressing", false, "UpdateRunStopped", now);
        let release = r.release.name.clone();
        let message = format!("stopped by {by}; {}", ended.describe(&release));
        r.record(
            now,
            Decision::new(TraceKind::Stopped, message).by(by),
            &mut out,
        );
        self.apply_bookkeeping(now, &mut out);
        Ok(self.emit(out))
    }

    /// Approves an approval request by name; approving twice is harmless.
    pub fn approve(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        self.approve_by(name, OPERATOR, now)
    }

    /// [`Engine::approve`] on behalf of `by`, whom the trace names.
    pub fn approve_by(
        &mut self,
        name: &str,
        by: &str,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        // Names are unique among rollouts that have not ended (checked at create); an ended
        // rollout's approval of the same name is only history.
        let holders = || {
            self.rollouts
                .values()
                .filter(|e| e.rollout.approvals.iter().any(|a| a.name == name))
        };
        let rollout = holders()
            .find(|e| !e.rollout.state.is_terminal())
            .or_else(|| holders().next())
            .map(|e| e.rollout.name.clone())
            .ok_or_else(|| EngineError::UnknownApproval(name.to_owned()))?;
        let mut out = Out::default();
        let r = &mut self.entry(&rollout)?.rollout;
        let Some(a) = r.approvals.iter_mut().find(|a| a.name == name) else {
            return Err(EngineError::UnknownApproval(name.to_owned()));
        };
        if a.approved {
            return Ok(Vec::new());
        }
        if let Some(denied) = &a.denied {
            return Err(EngineError::Conflict(format!(
                "approval {name} was denied by {denied}, which stopped rollout {rollout}; \
                 retry the rollout to go on"
            )));
        }
        if r.state.is_terminal() {
            return Err(EngineError::Conflict(format!(
                "approval {name} was withdrawn: rollout {rollout} is {}, so approving it would do \
                 nothing",
                r.state
            )));
        }
        let Some(a) = r.approvals.iter_mut().find(|a| a.name == name) else {
            return Err(EngineError::UnknownApproval(name.to_owned()));
        };
        a.approved = true;
        a.approved_at = Some(now);
        let approval = a.clone();
        let gname = approval.group.clone();
        if let Some(g) = r.groups.iter_mut().find(|g| g.name == approval.group) {
            g.condition(
                "ApprovalRequestApproved",
                true,
                "AfterStageTaskApprovalRequestApproved",
                now,
            );
        }
        out.commands.push(Effect::Approval(approval));
        let message = format!("approval {name} approved by {by}");
        let decision = Decision::new(TraceKind::Approved, message).by(by);
        r.record(now, decision.group(&gname), &mut out);
        self.advance(&rollout, now, &mut out);
        Ok(self.emit(out))
    }

    /// Denies a pending approval request on behalf of `by`: the rollout stops there, as
    /// [`Engine::stop_by`] stops it (no group starts again, unfinished devices end by their
    /// phase), and the trace says who denied which approval and why. Denying twice is harmless;
    /// an approval already given, or of a rollout that ended, is refused.
    pub fn deny_by(
        &mut self,
        name: &str,
        by: &str,
        reason: Option<&str>,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        let rollout = self
            .rollouts
            .values()
            .filter(|e| e.rollout.approvals.iter().any(|a| a.name == name))
            .map(|e| (e.rollout.state.is_terminal(), e.rollout.name.clone()))
            .min()
            .map(|(_, rollout)| rollout)
            .ok_or_else(|| EngineError::UnknownApproval(name.to_owned()))?;
        let r = &mut self.entry(&rollout)?.rollout;
        let Some(a) = r.approvals.iter_mut().find(|a| a.name == name) else {
            return Err(EngineError::UnknownApproval(name.to_owned()));
        };
        if a.denied.is_some() {
            return Ok(Vec::new());
        }
        if a.approved {
            return Err(EngineError::Conflict(format!(
                "approval {name} was already approved; stop rollout {rollout} instead"
            )));
        }
        if r.state.is_terminal() {
            return Err(EngineError::Conflict(format!(
                "approval {name} was withdrawn: rollout {rollout} is {}, so denying it would do \
                 nothing",
                r.state
            )));
        }
        let why = reason.map(str::trim).filter(|w| !w.is_empty());
        let words = match why {
            Some(why) => format!("{by}: {why}"),
            None => by.to_owned(),
        };
        a.denied = Some(words.clone());
        a.denied_at = Some(now);
        let approval = a.clone();
        let mut out = Out::default();
        out.commands.push(Effect::Approval(approval.clone()));
        if let Some(g) = r.groups.iter_mut().find(|g| g.name == approval.group) {
            g.condition(
                "ApprovalRequestDenied",
                true,
                "AfterStageTaskApprovalRequestDenied",
                now,
            );
        }
        let message = match why {
            Some(why) => format!("approval {name} denied by {by}: {why}"),
            None => format!("approval {name} denied by {by}"),
        };
        let decision = Decision::new(TraceKind::Denied, message).by(by);
        r.record(now, decision.group(&approval.group), &mut out);
        // Stopped as `stop` stops it, in the words of the denial.
        r.state = RolloutState::Stopped;
        let ended = r.cancel_unfinished(now, &mut out);
        r.waiting = None;
        r.set_condition("Progressing", false, "UpdateRunStopped", now);
        let release = r.release.name.clone();
        let message = format!(
            "stopped: approval {name} was denied; {}",
            ended.describe(&release)
        );
        r.record(
            now,
            Decision::new(TraceKind::Stopped, message).by(by),
            &mut out,
        );
        self.apply_bookkeeping(now, &mut out);
        Ok(self.emit(out))
    }

    /// Deletes a rollout that has ended (stopped, finished, failed) or never started (ready);
    /// its trace goes with it (the service logs who deleted it). A rollout that can still act
    /// on devices is refused: stop it first.
    pub fn delete(&mut self, name: &str) -> Result<Vec<Effect>, EngineError> {
        let r = &self.entry(name)?.rollout;
        if !(r.state.is_terminal() || r.state == RolloutState::Ready) {
            return Err(Self::invalid(r, "delete"));
        }
        let approvals = r.approvals.iter().map(|a| a.name.clone()).collect();
        self.rollouts.remove(name);
        self.owners.retain(|_, (owner, _)| owner != name);
        self.dirty.remove(name);
        Ok(vec![Effect::Deleted {
            rollout: name.to_owned(),
            approvals,
        }])
    }

    /// Every approval request, pending and approved.
    pub fn approvals(&self) -> Vec<ApprovalStatus> {
        self.rollouts
            .values()
            .flat_map(|e| e.rollout.approval_views())
            .collect()
    }

    /// Starts the next group of a running rollout now (hawkBit's manual trigger): the last
    /// started group is released without waiting for its success condition or its timed wait.
    /// An approval in the way (after the last started group, or before the group that would
    /// start) refuses, naming it; see [`Engine::trigger_next_with`].
    pub fn trigger_next(&mut self, name: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        self.trigger_next_by(name, OPERATOR, now)
    }

    /// [`Engine::trigger_next`] on behalf of `by`, whom the trace names.
    pub fn trigger_next_by(
        &mut self,
        name: &str,
        by: &str,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        self.trigger_next_with(name, by, false, now)
    }

    /// [`Engine::trigger_next_by`]; with `skip_approval` (`rollout next --skip-approval`) the
    /// approvals in the way are given in `by`'s name, and the trace says so ("approval r-canary
    /// given by alice via next").
    pub fn trigger_next_with(
        &mut self,
        name: &str,
        by: &str,
        skip_approval: bool,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        let r = &mut self.entry(name)?.rollout;
        if r.state != RolloutState::Running {
            return Err(Self::invalid(r, "trigger the next group of"));
        }
        let Some(last) = r
            .groups
            .iter()
            .rposition(|g| g.state != GroupState::Scheduled)
        else {
            return Err(Self::invalid(r, "trigger the next group of"));
        };
        let how = format!("by {by} via next (--skip-approval)");
        let mut out = Out::default();
        let gname = r.groups[last].name.clone();
        if r.groups[last].state == GroupState::Approval {
            // The group to start next is this one: only its own approval holds it.
            let approval = before_approval(&r.name, &gname);
            if !skip_approval {
                return Err(EngineError::Conflict(format!(
                    "rollout {name}: group {gname} is the next group and waits for approval {approval}; approve it (flotilla approve {approval}) or pass --skip-approval"
                )));
            }
            r.grant(&approval, last, "before", &how, now, &mut out);
            self.advance(name, now, &mut out);
            return Ok(self.emit(out));
        }
        if last + 1 >= r.groups.len() || r.groups[last + 1].dynamic {
            return Err(EngineError::Conflict(format!(
                "rollout {name}: every group has started (the last, {gname}, is {}); there is no next group to start",
                r.groups[last].state
            )));
        }
        if r.groups[last].after.approval && !r.groups[last].released {
            let approval = after_approval(&r.name, &gname);
            if !r.approved(&approval) {
                if !skip_approval {
                    let requested = if r.approvals.iter().any(|a| a.name == approval) {
                        "is pending"
                    } else {
                        "is requested when the group succeeds"
                    };
                    return Err(EngineError::Conflict(format!(
                        "rollout {name}: group {} starts only after approval {approval}, which {requested}; approve it (flotilla approve {approval}) or pass --skip-approval",
                        r.groups[last + 1].name
                    )));
                }
                r.grant(&approval, last, "after", &how, now, &mut out);
            }
        }
        let next = last + 1;
        if skip_approval && r.groups[next].before.approval {
            let approval = before_approval(&r.name, &r.groups[next].name);
            r.grant(&approval, next, "before", &how, now, &mut out);
        }
        r.groups[last].released = true;
        let message = format!("{by} triggered the next group after group {gname}");
        let decision = Decision::new(TraceKind::NextTriggered, message).by(by);
        r.record(now, decision.group(&gname), &mut out);
        self.advance(name, now, &mut out);
        Ok(self.emit(out))
    }

    /// Creates a rollout (ready, not started) over the failed, refused and timed-out devices of
    /// another, named `<rollout>-retry` unless a name is given.
    pub fn retry_failed(
        &mut self,
        name: &str,
        new_name: Option<String>,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        self.retry_failed_by(name, new_name, OPERATOR, now)
    }

    /// [`Engine::retry_failed`] on behalf of `by`, whom the trace names.
    pub fn retry_failed_by(
        &mut self,
        name: &str,
        new_name: Option<String>,
        by: &str,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        let r = &self
            .rollouts
            .get(name)
            .ok_or_else(|| EngineError::UnknownRollout(name.to_owned()))?
            .rollout;
        if !matches!(
            r.state,
            RolloutState::Paused
                | RolloutState::Finished
                | RolloutState::Stopped
                | RolloutState::Failed
        ) {
            return Err(Self::invalid(r, "retry the failed devices of"));
        }
        // Same settings: every group that had failures keeps its name, pace, conditions and
        // gates, over its failed devices; each device's attempts go on counting.
        let mut groups = Vec::new();
        let mut failed = 0;
        for g in &r.groups {
            let devices: Vec<String> = g
                .devices
                .iter()
                .filter(|d| g.slots.get(*d).is_some_and(|s| s.phase.is_failure()))
                .cloned()
                .collect();
            if devices.is_empty() {
                continue;
            }
            failed += devices.len();
            let mut group = new_group(crate::plan::PlannedGroup {
                name: g.name.clone(),
                devices,
                pace: g.pace,
                success: g.success.clone(),
                error: g.error.clone(),
                before: g.before,
                after: g.after,
            });
            for (device, slot) in &mut group.slots {
                if let Some(old) = g.slots.get(device) {
                    slot.earlier_attempts = old.earlier_attempts + old.attempt;
                }
            }
            groups.push(group);
        }
        let new_name = new_name.unwrap_or_else(|| format!("{name}-retry"));
        flotilla_protocol::validate_id("rollout name", &new_name)
            .map_err(|e| EngineError::Conflict(e.to_string()))?;
        if failed == 0 {
            return Err(EngineError::NoDevices {
                rollout: new_name,
                reason: format!("rollout {name} has no failed, refused or timed-out device"),
            });
        }
        if self.rollouts.contains_key(&new_name) {
            return Err(EngineError::AlreadyExists(new_name));
        }
        self.check_approval_names(&new_name, &groups)?;
        let r = &self.rollouts[name].rollout;
        let mut spec = r.spec.clone();
        spec.name = new_name.clone();
        spec.policies.start_at = None;
        spec.policies.dynamic = false;
        let release = r.release.clone();
        let mut rollout = Rollout {
            name: new_name.clone(),
            release,
            ramp: spec.policies.rate.map(|limit| Ramp::new(limit, now)),
            spec,
            created_at: now,
            state: RolloutState::Ready,
            groups,
            excluded: Vec::new(),
            unassigned: Vec::new(),
            trace: Vec::new(),
            conditions: Vec::new(),
            approvals: Vec::new(),
            waiting: None,
            started_at: None,
            checked_at: now,
            rolled_back: false,
            seen: BTreeSet::new(),
            sites: BTreeMap::new(),
        };
        self.assign_sites(&mut rollout);
        let mut out = Out::default();
        rollout.set_condition("Initialized", true, "UpdateRunInitializedSuccessfully", now);
        let message =
            format!("created by {by} to retry the {failed} failed devices of rollout {name}");
        let decision = Decision::new(TraceKind::RetryCreated, message).by(by);
        rollout.record(now, decision, &mut out);
        self.rollouts
            .insert(new_name, Entry::new(rollout, &*self.zones));
        Ok(self.emit(out))
    }

    /// Forgets a device: it leaves the registry. As in hawkBit, it leaves a running group at
    /// once (counts are recomputed; an emptied group succeeds); in a group that has not started
    /// it shows as `not_started` and leaves when the group starts; in a finished group (or a
    /// rollout that is over) it shows as `not_started` and the counts stay.
    pub fn delete_device(&mut self, device: &str, now: u64) -> Result<Vec<Effect>, EngineError> {
        self.delete_device_by(device, OPERATOR, now)
    }

    /// [`Engine::delete_device`] on behalf of `by`, whom the trace names.
    pub fn delete_device_by(
        &mut self,
        device: &str,
        by: &str,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        if self.devices.remove(device).is_none() {
            return Err(EngineError::UnknownDevice(device.to_owned()));
        }
        self.offline.remove(device);
        self.owners.remove(device);
        self.last_seq.remove(device);
        let mut out = Out::default();
        let mut touched = Vec::new();
        let mut cancels = Vec::new();
        for (name, entry) in &mut self.rollouts {
            // Deleted, it is forgotten: if it registers again it is a new device.
            if entry.rollout.seen.remove(device) && !out.save.contains(name) {
                out.save.push(name.clone());
            }
            let Some(&gi) = entry.index.get(device) else {
                continue;
            };
            let terminal = entry.rollout.state.is_terminal();
            let group = &mut entry.rollout.groups[gi];
            // hawkBit: in a group that has not started, or has finished, the device moves to
            // "not started"; the counts change only when a not-started group starts.
            let kept = match group.state {
                _ if terminal => Some("the rollout is over"),
                GroupState::Scheduled | GroupState::Approval => {
                    Some("it leaves the group when the group starts")
                }
                GroupState::Waiting | GroupState::Finished | GroupState::Error => {
                    Some("the group is done and keeps its counts")
                }
                GroupState::Running => None,
            };
            if let Some(why) = kept {
                let Some(slot) = group.slots.get_mut(device).filter(|s| !s.deleted) else {
                    continue;
                };
                slot.deleted = true;
                // A device still acting on this rollout's action (a group that is done may have
                // some) is told to stop, as in a running group.
                cancels.extend(deleted_cancel(name, entry.rollout.created_at, device, slot));
                let gname = group.name.clone();
                let message =
                    format!("device {device} deleted by {by}; not started in group {gname}: {why}");
                let decision = Decision::new(TraceKind::DeviceDeleted, message).by(by);
                entry
                    .rollout
                    .record(now, decision.group(&gname).device(device), &mut out);
                continue;
            }
            let mut canceled = false;
            group.uncount_site(device);
            if let Some(slot) = group.slots.remove(device) {
                slot.phase.count_in(&mut group.counts, false);
                group.counts.total = group.counts.total.saturating_sub(1);
                // A device that is still acting on this rollout's action is told to stop: a
                // deleted device must not go on to install (past activation it cannot stop).
                if let Some(cancel) = deleted_cancel(name, entry.rollout.created_at, device, &slot)
                {
                    cancels.push(cancel);
                    canceled = true;
                }
            }
            if let Some(pos) = group.devices.iter().position(|d| d == device) {
                group.devices.remove(pos);
                if pos < group.cursor {
                    group.cursor -= 1;
                }
                // Positions moved: the queues are rebuilt at the next fill.
                group.cache.queues = None;
            }
            entry.index.remove(device);
            let gname = group.name.clone();
            let action = if canceled {
                "; its action was canceled"
            } else {
                ""
            };
            let message = format!(
                "device {device} deleted by {by}{action}; group {gname} now has {}",
                count(entry.rollout.groups[gi].devices.len(), "device")
            );
            let decision = Decision::new(TraceKind::DeviceDeleted, message).by(by);
            entry
                .rollout
                .record(now, decision.group(&gname).device(device), &mut out);
            touched.push(name.clone());
        }
        // The cancel goes out after the forget's "nothing to do", so it is what the retained
        // desired topic keeps: an agent that comes back later still stops the action.
        out.commands.push(Effect::Forget {
            device: device.to_owned(),
        });
        out.commands.extend(cancels);
        for name in touched {
            self.advance(&name, now, &mut out);
        }
        Ok(self.emit(out))
    }
}

/// The cancel a deleted device gets when it is still acting on this rollout's action (past
/// activation the agent ignores it and finishes, and its report says so).
pub(super) fn deleted_cancel(
    rollout: &str,
    created_at: u64,
    device: &str,
    slot: &Slot,
) -> Option<Effect> {
    matches!(&slot.phase, DevicePhase::InProgress(p) if p != model::ROLLING_BACK).then(|| {
        Effect::Cancel {
            device: device.to_owned(),
            action_id: attempt_action_id(rollout, created_at, device, slot.attempt),
            rollout: rollout.to_owned(),
        }
    })
}
