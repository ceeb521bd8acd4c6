//! How groups and rollouts end: the error and success conditions with the numbers they
//! compare, a group that is done, a rollout that finished, failed, stopped or rolled back, and
//! devices that finish after their rollout ended.

use flotilla_protocol::control::TraceKind;

use super::ended::Ended;
use super::model::{DevicePhase, GroupState, Rollout, RolloutState, ROLLING_BACK};
use super::trace::Decision;
use super::{attempt_action_id, rollback_action_id, Effect};
use crate::conditions::{error_holds, error_met, success_holds, success_met};
use crate::plan::{ErrorAction, SuccessAction};
use crate::text::{agree, count};
use crate::window::utc_text;

use super::advance::*;

impl Rollout {
    /// Applies the group's error condition; true when it fired (the caller stops advancing).
    pub(super) fn check_error(&mut self, gi: usize, now: u64, out: &mut Out) -> bool {
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

    pub(super) fn fail(&mut self, now: u64) {
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
    pub(super) fn roll_back(&mut self, _now: u64, out: &mut Out) -> usize {
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
    pub(super) fn check_success(&mut self, gi: usize, now: u64, out: &mut Out) -> Step {
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
        let last = gi + 1 == self.groups.len();
        let group = &mut self.groups[gi];
        group.released = true;
        let name = self.name.clone();
        match group.success.action {
            SuccessAction::Next => {
                out.touch(&name);
                Step::Go
            }
            // The last group: a pause would hold back nothing, and leave a rollout whose
            // every group is done waiting for a resume (issue "the first hour", item 8).
            SuccessAction::Pause if last => {
                let message = format!(
                    "group {gname} succeeded; its success action would pause before the next \
                     group, and it is the last"
                );
                self.record(
                    now,
                    Decision::new(TraceKind::Note, message).group(&gname),
                    out,
                );
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
    pub(super) fn check_done(&mut self, gi: usize, now: u64, out: &mut Out) -> bool {
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
}
