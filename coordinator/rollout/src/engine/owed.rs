//! What a device is owed: the one action its retained `desired` topic should hold.
//!
//! Every install, rollback and cancel the engine sends is stamped on the slot that sent it with
//! the engine's running count of actions sent ([`Slot::sent`]), which goes on across restarts
//! (it is stored with the slots). The device's retained `desired` topic holds the last of them,
//! so that is the only one a restart publishes again and the only one a repair of the topic
//! restores. A stopped rollout's cancel is owed while nothing newer was sent to the device; once
//! another rollout sends it an action, the cancel is superseded and never published again, so a
//! device that missed the cancel while offline is not sent it over its current action
//! (docs/decisions/0043-owed-actions-and-unknown-devices.md).
//!
//! Only what is still in progress is owed: an install of an active rollout, a rollback, a
//! cancel of a rollout that ended. A device whose newest action finished (ready, failed,
//! timed out) is owed nothing, and whatever its topic holds stays.

use std::collections::HashMap;

use super::advance::Out;
use flotilla_protocol::control::TraceKind;

use super::model::{self, DevicePhase, Rollout, Slot};
use super::trace::Decision;
use super::{rollback_action_id, Effect, Engine};

/// Orders two slots' sends of one device: the engine's count first; for rollouts stored before
/// it (0), the time of the send, an install or rollback before a cancel of the same second
/// (a newer rollout takes a device over in the second the older one's slot ends).
fn recency(r: &Rollout, slot: &Slot) -> (u64, u64, bool) {
    let cancel = slot.phase == DevicePhase::Canceled && !r.state.is_active();
    let rolling_back =
        matches!(&slot.phase, DevicePhase::InProgress(p) if p == model::ROLLING_BACK);
    let at = if cancel || rolling_back {
        slot.ended_at.or(slot.attempt_at)
    } else {
        slot.attempt_at
    };
    (slot.sent, at.unwrap_or(0), !cancel)
}

/// Whether a slot ever sent its device anything. A deleted device's slot counts too: what it
/// sent is newer than what other rollouts sent before, though it is owed nothing.
fn has_sent(slot: &Slot) -> bool {
    slot.attempt > 0 || slot.sent > 0
}

/// What re-publishes the action a device's slot in rollout `r` last sent it, while that action
/// is still owed.
fn reissue_slot(r: &Rollout, device: &str, slot: &Slot) -> Option<Effect> {
    if slot.deleted {
        return None;
    }
    let id = r.attempt_id(device, slot.attempt);
    match &slot.phase {
        DevicePhase::InProgress(p) if p == model::ROLLING_BACK => Some(Effect::Rollback {
            device: device.to_owned(),
            action_id: rollback_action_id(&r.name, r.created_at, device),
            rollout: r.name.clone(),
            undo: id,
        }),
        DevicePhase::InProgress(_) if r.state.is_active() => Some(Effect::Desired {
            device: device.to_owned(),
            action_id: id,
            rollout: r.name.clone(),
            release: r.release.name.clone(),
            action: r.spec.policies.action,
            peers: slot.peers.clone(),
        }),
        DevicePhase::Canceled if !r.state.is_active() && slot.attempt > 0 => Some(Effect::Cancel {
            device: device.to_owned(),
            action_id: id,
            rollout: r.name.clone(),
        }),
        _ => None,
    }
}

/// The highest send count stored in `rollouts`: where the engine's count goes on after a
/// restart.
pub(super) fn last_sent<'a>(rollouts: impl Iterator<Item = &'a Rollout>) -> u64 {
    rollouts
        .flat_map(|r| r.groups.iter())
        .flat_map(|g| g.slots.values())
        .map(|s| s.sent)
        .max()
        .unwrap_or(0)
}

impl Engine {
    /// Applies claims, releases and preemptions collected in `out`; returns the rollouts that
    /// lost a device and must be advanced again. A device has one owner: the rollout that sent
    /// it its current action. A claim by another rollout (a start that outweighs the owner, a
    /// rollback, which outweighs everything) takes the device over: the owner's action ends
    /// canceled, or, if the device was soaking on it, ready.
    pub(super) fn apply_bookkeeping(&mut self, now: u64, out: &mut Out) -> Vec<String> {
        for (device, rollout) in std::mem::take(&mut out.releases) {
            if self.owners.get(&device).is_some_and(|(r, _)| *r == rollout) {
                self.owners.remove(&device);
            }
        }
        for (device, rollout, weight) in std::mem::take(&mut out.claims) {
            if let Some((owner, _)) = self.owners.get(&device).filter(|(o, _)| *o != rollout) {
                let taken = (owner.clone(), device.clone(), rollout.clone());
                if !out.preempt.contains(&taken) {
                    out.preempt.push(taken);
                }
            }
            self.owners.insert(device, (rollout, weight));
        }
        for (device, rollout) in std::mem::take(&mut out.left) {
            if let Some(entry) = self.rollouts.get_mut(&rollout) {
                entry.index.remove(&device);
            }
        }
        let mut touched = Vec::new();
        for (other, device, by) in std::mem::take(&mut out.preempt) {
            let Some(entry) = self.rollouts.get_mut(&other) else {
                continue;
            };
            let Some(&gi) = entry.index.get(&device) else {
                continue;
            };
            let r = &mut entry.rollout;
            let group = &mut r.groups[gi];
            let Some(phase) = group.slots.get(&device).map(|s| s.phase.clone()) else {
                continue;
            };
            if phase.is_terminal() {
                continue;
            }
            // A soaking device installed the release and was healthy so far: it counts as
            // ready, as when a rollout stops (its group may have succeeded with it already).
            let (new, message) = if phase == DevicePhase::Soaking {
                let message = format!(
                    "device {device}: soak ended, rollout {by} took the device over; it counts as ready"
                );
                (DevicePhase::Ready, message)
            } else {
                let message =
                    format!("device {device}: action canceled, rollout {by} took the device over");
                (DevicePhase::Canceled, message)
            };
            group.set_phase(&device, new);
            if let Some(slot) = group.slots.get_mut(&device) {
                slot.ended_at = Some(now);
                slot.soak_until = None;
            }
            let gname = r.groups[gi].name.clone();
            let decision = Decision::new(TraceKind::DeviceTakenOver, message);
            r.record(now, decision.group(&gname).device(&device), out);
            touched.push(other.clone());
        }
        touched
    }

    /// The effects of one call, in the documented order, with each install, rollback and
    /// cancel stamped on the slot that sent it (in the order the service publishes them).
    pub(super) fn emit(&mut self, mut out: Out) -> Vec<Effect> {
        self.stamp_decider(&mut out);
        for e in &out.commands {
            let (device, rollout) = match e {
                Effect::Desired {
                    device, rollout, ..
                }
                | Effect::Rollback {
                    device, rollout, ..
                }
                | Effect::Cancel {
                    device, rollout, ..
                } => (device, rollout),
                _ => continue,
            };
            let Some(entry) = self.rollouts.get_mut(rollout) else {
                continue;
            };
            let Some(&gi) = entry.index.get(device) else {
                continue;
            };
            // A device deleted from a running group has no slot left: nothing more is owed.
            if let Some(slot) = entry.rollout.groups[gi].slots.get_mut(device) {
                self.sends += 1;
                slot.sent = self.sends;
            }
        }
        out.into_effects()
    }

    /// Stamps [`Engine::set_decider`]'s coordinator on the trace entries of `out` and on the
    /// same entries, the newest of each rollout's stored trace.
    fn stamp_decider(&mut self, out: &mut Out) {
        let Some(decider) = &self.decider else {
            return;
        };
        let mut per_rollout: HashMap<String, usize> = HashMap::new();
        for effect in &mut out.trace {
            if let Effect::Trace(entry) = effect {
                entry.coordinator = Some(decider.clone());
                *per_rollout.entry(entry.rollout.clone()).or_default() += 1;
            }
        }
        for (name, count) in per_rollout {
            if let Some(entry) = self.rollouts.get_mut(&name) {
                let trace = &mut entry.rollout.trace;
                let from = trace.len().saturating_sub(count);
                for stored in &mut trace[from..] {
                    stored.coordinator = Some(decider.clone());
                }
            }
        }
    }

    /// Re-publishes what a crash or a broker that lost its retained messages may have kept from
    /// devices: each device's owed action (its newest, while in progress), and every approval
    /// request. Idempotent (same action ids, retained); never starts a group.
    pub fn reissue(&mut self, _now: u64) -> Vec<Effect> {
        let mut newest: HashMap<&str, (&Rollout, &Slot)> = HashMap::new();
        for entry in self.rollouts.values() {
            let r = &entry.rollout;
            for g in &r.groups {
                for (device, slot) in g.slots.iter().filter(|(_, s)| has_sent(s)) {
                    match newest.get(device.as_str()) {
                        Some((or, os)) if recency(or, os) >= recency(r, slot) => {}
                        _ => {
                            newest.insert(device, (r, slot));
                        }
                    }
                }
            }
        }
        let mut effects: Vec<Effect> = newest
            .into_iter()
            .filter_map(|(device, (r, slot))| reissue_slot(r, device, slot))
            .collect();
        // One order for the same engine, whatever the hash map's.
        effects.sort_by(|a, b| owed_device(a).cmp(owed_device(b)));
        for entry in self.rollouts.values() {
            effects.extend(
                entry
                    .rollout
                    .approvals
                    .iter()
                    .cloned()
                    .map(Effect::Approval),
            );
        }
        effects
    }

    /// The action a device's retained `desired` topic should hold, if one is owed: what
    /// [`Engine::reissue`] publishes for it. Used when that topic is found holding something
    /// else.
    pub fn reissue_device(&self, device: &str) -> Option<Effect> {
        let mut newest: Option<(&Rollout, &Slot)> = None;
        for entry in self.rollouts.values() {
            let Some(&gi) = entry.index.get(device) else {
                continue;
            };
            let r = &entry.rollout;
            let Some(slot) = r.groups.get(gi).and_then(|g| g.slots.get(device)) else {
                continue;
            };
            if !has_sent(slot) {
                continue;
            }
            if newest.is_none_or(|(or, os)| recency(r, slot) > recency(or, os)) {
                newest = Some((r, slot));
            }
        }
        newest.and_then(|(r, slot)| reissue_slot(r, device, slot))
    }
}

/// The device an owed action is for.
fn owed_device(e: &Effect) -> &str {
    match e {
        Effect::Desired { device, .. }
        | Effect::Rollback { device, .. }
        | Effect::Cancel { device, .. } => device,
        _ => "",
    }
}
