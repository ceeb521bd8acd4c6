//! What the engine shows: rollouts, their status and summaries, devices and their labels.

use super::*;
use flotilla_protocol::device_view::DeviceAction;

impl Engine {
    pub fn rollout(&self, name: &str) -> Option<&Rollout> {
        self.rollouts.get(name).map(|e| &e.rollout)
    }

    pub fn rollouts(&self) -> impl Iterator<Item = &Rollout> {
        self.rollouts.values().map(|e| &e.rollout)
    }

    /// A rollout's full status: every device's phase and detail, the whole trace. It grows
    /// with the rollout; what is published or sent in one message is [`Engine::summary`].
    pub fn status(&self, name: &str) -> Option<RolloutStatus> {
        self.rollout(name).map(|r| self.with_summary(r, r.status()))
    }

    pub fn statuses(&self) -> Vec<RolloutStatus> {
        self.rollouts()
            .map(|r| self.with_summary(r, r.status()))
            .collect()
    }

    /// A rollout's status without per-device detail: counts, per-group summaries, conditions,
    /// approvals and the newest [`SUMMARY_TRACE`] decisions. Its size does not depend on how
    /// many devices the rollout has (the retained rollout event and command replies).
    pub fn summary(&self, name: &str) -> Option<RolloutStatus> {
        self.rollout(name)
            .map(|r| self.with_summary(r, r.summary()))
    }

    /// [`Engine::summary`] of every rollout after `after` in name order.
    pub fn summaries_after<'a>(
        &'a self,
        after: Option<&str>,
    ) -> impl Iterator<Item = RolloutStatus> + 'a {
        let start = match after {
            Some(a) => Bound::Excluded(a.to_owned()),
            None => Bound::Unbounded,
        };
        self.rollouts
            .range((start, Bound::Unbounded))
            .map(|(_, e)| self.with_summary(&e.rollout, e.rollout.summary()))
    }

    /// The devices of rollout `name` after `after`, in id order across its groups, each with
    /// its group and detail; `None` when there is no such rollout.
    pub fn rollout_devices<'a>(
        &'a self,
        name: &str,
        after: Option<&str>,
    ) -> Option<impl Iterator<Item = RolloutDevice> + 'a> {
        let rollout = self.rollout(name)?;
        let start = || match after {
            Some(a) => Bound::Excluded(a.to_owned()),
            None => Bound::Unbounded,
        };
        let mut groups: Vec<_> = rollout
            .groups
            .iter()
            .map(|g| (g, g.slots.range((start(), Bound::Unbounded)).peekable()))
            .collect();
        // A merge of the groups' sorted slots: a device is in one group of a rollout.
        Some(std::iter::from_fn(move || {
            let (gi, _) = groups
                .iter_mut()
                .enumerate()
                .filter_map(|(i, (_, slots))| slots.peek().map(|(d, _)| (i, (*d).clone())))
                .min_by(|a, b| a.1.cmp(&b.1))?;
            let (group, slots) = &mut groups[gi];
            let (device, slot) = slots.next()?;
            Some(RolloutDevice {
                id: device.clone(),
                group: group.name.clone(),
                detail: rollout.device_detail(slot),
            })
        }))
    }

    /// The labels of a device the engine knows.
    pub fn device_labels(&self, device: &str) -> Option<&dyn Labels> {
        self.devices.get(device).map(|d| &d.labels as &dyn Labels)
    }

    /// A rollout's status with what only the registry knows: Fleet's per-group summary of
    /// Pending, OutOfSync, NotReady and Ready devices.
    pub(super) fn with_summary(&self, r: &Rollout, mut status: RolloutStatus) -> RolloutStatus {
        for (g, gs) in r.groups.iter().zip(status.groups.iter_mut()) {
            // Counted without an allocation per device: at 100,000 devices this runs on every
            // status read and every tick of a changed rollout.
            let (mut ready, mut not_ready, mut pending, mut out_of_sync) = (0, 0, 0, 0);
            for (device, slot) in &g.slots {
                match &slot.phase {
                    DevicePhase::Scheduled => {
                        let installed = self
                            .devices
                            .get(device)
                            .is_some_and(|d| d.installed.is_some());
                        if installed {
                            out_of_sync += 1;
                        } else {
                            pending += 1;
                        }
                    }
                    DevicePhase::Ready => ready += 1,
                    DevicePhase::Canceled | DevicePhase::Skipped(_) | DevicePhase::RolledBack => {}
                    _ => not_ready += 1,
                }
            }
            gs.summary = [
                ("NotReady", not_ready),
                ("OutOfSync", out_of_sync),
                ("Pending", pending),
                ("Ready", ready),
            ]
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(state, n)| (state.to_owned(), n))
            .collect();
        }
        status
    }

    /// The releases `device` was sent a desired action for that it may still act on: its live
    /// slots in active rollouts (in progress, soaking or retrying). The artifact server serves
    /// a device only the artifacts of these releases.
    pub fn device_releases(&self, device: &str) -> Vec<&str> {
        self.rollouts
            .values()
            .filter(|e| e.rollout.state.is_active())
            .filter_map(|e| {
                let gi = *e.index.get(device)?;
                let slot = e.rollout.groups.get(gi)?.slots.get(device)?;
                slot.phase
                    .is_live()
                    .then_some(e.rollout.release.name.as_str())
            })
            .collect()
    }

    /// The release `device` last became ready on in a rollout (the latest such slot by its end
    /// time), from the rollouts, which are stored: what a device that went away without saying
    /// what it runs (its last will names no release) is known to run, also after a restart.
    pub fn last_ready_release(&self, device: &str) -> Option<&str> {
        self.rollouts
            .values()
            .filter_map(|e| {
                let gi = *e.index.get(device)?;
                let slot = e.rollout.groups.get(gi)?.slots.get(device)?;
                (slot.phase == DevicePhase::Ready)
                    .then_some((slot.ended_at.unwrap_or(0), e.rollout.release.name.as_str()))
            })
            .max_by_key(|(at, _)| *at)
            .map(|(_, release)| release)
    }

    /// How many devices are known from their retained state.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Every device known from its retained state, sorted by id.
    pub fn devices(&self) -> Vec<DeviceSummary> {
        self.devices_after(None).collect()
    }

    /// The devices known from their retained state after `after`, in id order.
    pub fn devices_after<'a>(
        &'a self,
        after: Option<&str>,
    ) -> impl Iterator<Item = DeviceSummary> + 'a {
        let start = match after {
            Some(a) => Bound::Excluded(a.to_owned()),
            None => Bound::Unbounded,
        };
        self.devices
            .range((start, Bound::Unbounded))
            .map(|(id, d)| self.device_summary(id, d))
    }

    /// One device known from its retained state.
    pub fn device(&self, id: &str) -> Option<DeviceSummary> {
        self.devices.get(id).map(|d| self.device_summary(id, d))
    }

    fn device_summary(&self, id: &str, d: &DeviceRecord) -> DeviceSummary {
        DeviceSummary {
            id: id.to_owned(),
            hardware_id: d.hardware_id.to_string(),
            labels: d
                .labels
                .0
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            online: d.online,
            installed: d.installed.as_deref().map(str::to_owned),
            rollout: d.rollout.as_deref().map(str::to_owned),
            phase: d.phase.map(str::to_owned),
            reason: d.reason.clone(),
            enrollment: None,
            last_seen: (!d.online).then(|| self.offline.get(id).copied()).flatten(),
            overdue: false,
        }
    }

    /// Every action the rollouts hold for `device`, newest first (by start, then by the
    /// rollout's creation): what its page shows.
    pub fn device_actions(&self, device: &str) -> Vec<DeviceAction> {
        let mut actions: Vec<(u64, u64, DeviceAction)> = self
            .rollouts
            .values()
            .filter_map(|e| {
                let gi = *e.index.get(device)?;
                let group = e.rollout.groups.get(gi)?;
                let slot = group.slots.get(device)?;
                let action = DeviceAction {
                    rollout: e.rollout.name.clone(),
                    release: e.rollout.release.name.clone(),
                    group: group.name.clone(),
                    detail: e.rollout.device_detail(slot),
                    bytes: slot.bytes,
                };
                Some((slot.started_at.unwrap_or(0), e.rollout.created_at, action))
            })
            .collect();
        actions.sort_by_key(|a| std::cmp::Reverse((a.0, a.1)));
        actions.into_iter().map(|(_, _, a)| a).collect()
    }

    /// Per release: how many known devices run it, and the rollouts that roll it out.
    pub fn release_usage(&self) -> BTreeMap<String, (u64, Vec<String>)> {
        // Counted under the borrowed names first: a pass over every device (`list_releases`
        // asks for it) that allocates nothing per device.
        let mut installed: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
        for release in self.devices.values().filter_map(|d| d.installed.as_deref()) {
            *installed.entry(release).or_default() += 1;
        }
        let mut usage: BTreeMap<String, (u64, Vec<String>)> = installed
            .into_iter()
            .map(|(release, n)| (release.to_owned(), (n, Vec::new())))
            .collect();
        for e in self.rollouts.values() {
            let entry = usage.entry(e.rollout.release.name.clone()).or_default();
            entry.1.push(e.rollout.name.clone());
        }
        usage
    }
}

impl Rollout {
    /// The rollout as operators see it, every device and decision included.
    pub fn status(&self) -> RolloutStatus {
        let mut status = self.summary();
        status.trace = self.trace.clone();
        status.sites = self.site_statuses(None);
        for (g, gs) in self.groups.iter().zip(status.groups.iter_mut()) {
            gs.devices = g
                .slots
                .iter()
                .map(|(d, s)| (d.clone(), s.phase_name().to_owned()))
                .collect();
            gs.device_details = g
                .slots
                .iter()
                .map(|(d, s)| (d.clone(), self.device_detail(s)))
                .collect();
        }
        status
    }

    /// One device's detail in this rollout.
    pub(super) fn device_detail(&self, s: &Slot) -> DeviceDetail {
        DeviceDetail {
            phase: s.phase_name().to_owned(),
            started_at: s.started_at,
            ended_at: s.ended_at,
            reason: s.phase.reason().map(str::to_owned),
            attempt: s.earlier_attempts + s.attempt,
            conditions: self.device_conditions(s),
        }
    }

    /// The rollout without per-device detail and with the newest [`SUMMARY_TRACE`] decisions:
    /// what the retained rollout event carries.
    /// The approval requests as operators see them: one not given before the rollout ended is
    /// withdrawn.
    pub fn approval_views(&self) -> Vec<ApprovalStatus> {
        let ended = self.state.is_terminal();
        self.approvals
            .iter()
            .map(|a| ApprovalStatus {
                withdrawn: ended && !a.approved && a.denied.is_none(),
                ..a.clone()
            })
            .collect()
    }

    pub fn summary(&self) -> RolloutStatus {
        let skip = self.trace.len().saturating_sub(SUMMARY_TRACE);
        RolloutStatus {
            name: self.name.clone(),
            release: self.release.name.clone(),
            state: self.state.to_string(),
            groups: self
                .groups
                .iter()
                .map(|g| GroupStatus {
                    name: g.name.clone(),
                    state: g.state.to_string(),
                    total: g.counts.effective_total(),
                    ready: g.counts.ready,
                    failed: g.counts.failures(),
                    in_progress: g.counts.in_progress + g.counts.soaking,
                    scheduled: g.counts.scheduled,
                    canceled: g.counts.canceled,
                    devices: BTreeMap::new(),
                    started_at: g.started_at,
                    ended_at: g.ended_at,
                    conditions: g.conditions.clone(),
                    device_details: BTreeMap::new(),
                    summary: BTreeMap::new(),
                })
                .collect(),
            trace: self.trace[skip..].to_vec(),
            strategy: self.spec.vocabulary().to_owned(),
            conditions: self.conditions.clone(),
            waiting: self.waiting.clone(),
            approvals: self.approval_views(),
            strategy_snapshot: self.strategy_snapshot(),
            deletion_stage: self.deletion_stage(),
            bytes: self.bytes_total(),
            sites: self.site_statuses(Some(SUMMARY_SITES)),
            site_count: self.site_names().len(),
            excluded: self
                .excluded
                .iter()
                .take(SUMMARY_EXCLUDED)
                .map(|e| ExcludedDevice {
                    device: e.device.clone(),
                    reason: e.reason.clone(),
                })
                .collect(),
            excluded_count: self.excluded.len(),
        }
    }

    /// Every device of the rollout with its phase name.
    pub fn device_phases(&self) -> BTreeMap<String, String> {
        self.groups
            .iter()
            .flat_map(|g| {
                g.slots
                    .iter()
                    .map(|(d, s)| (d.clone(), s.phase_name().to_owned()))
            })
            .collect()
    }
}
