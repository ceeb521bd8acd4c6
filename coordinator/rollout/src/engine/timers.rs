//! What time moves: timeouts, retries and waits coming due, the next time anything will, and
//! devices that join a running rollout.

use flotilla_protocol::control::TraceKind;

use super::model::{DevicePhase, Rollout, RolloutState, Slot, ROLLING_BACK};
use super::trace::Decision;
use crate::plan::OfflinePolicy;

use super::advance::*;

impl Rollout {
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
