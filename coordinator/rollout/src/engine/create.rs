//! Creating a rollout: planning it over the devices known now, checks against the other
//! runs (staged overlap, approval names), and the groups it starts with.

use super::*;
use crate::text::count;

impl Engine {
    /// Plans a rollout over the devices known now (creating -> ready). Fails when no device
    /// would be reached, naming why, or when a staged run overlaps another run with a different
    /// strategy.
    pub fn create_rollout(
        &mut self,
        spec: RolloutSpec,
        release: ReleaseRef,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        self.create(spec, release, None, &[], now)
    }

    /// [`Engine::create_rollout`] on behalf of an operator, whom the trace names.
    pub fn create_rollout_by(
        &mut self,
        spec: RolloutSpec,
        release: ReleaseRef,
        by: &str,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        self.create(spec, release, Some(by), &[], now)
    }

    /// [`Engine::create_rollout_by`] knowing `unknown`: the accepted devices (in id order) the
    /// engine holds no state of. They are listed as excluded, in the reply and the trace, or
    /// the rollout is refused under `unknown_devices = "refuse"` (`planner::exclude_unknown`).
    pub fn create_rollout_knowing(
        &mut self,
        spec: RolloutSpec,
        release: ReleaseRef,
        by: &str,
        unknown: &[String],
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        self.create(spec, release, Some(by), unknown, now)
    }

    pub(super) fn create(
        &mut self,
        spec: RolloutSpec,
        release: ReleaseRef,
        by: Option<&str>,
        unknown: &[String],
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        let name = spec.name.clone();
        if self.rollouts.contains_key(&name) {
            return Err(EngineError::AlreadyExists(name));
        }
        if spec.release != release.name {
            return Err(EngineError::ReleaseMismatch {
                rollout: name,
                spec_release: spec.release.clone(),
                release: release.name,
            });
        }
        let mut plan = planner::plan(&spec, &self.fleet(), &release.hardware, &self.device_groups)?;
        planner::exclude_unknown(&spec, &mut plan, unknown)?;
        self.create_planned(spec, release, plan, by, now)
    }

    /// Creates a rollout from an already computed plan.
    pub(crate) fn create_planned(
        &mut self,
        spec: RolloutSpec,
        release: ReleaseRef,
        plan: planner::Plan,
        by: Option<&str>,
        now: u64,
    ) -> Result<Vec<Effect>, EngineError> {
        let name = spec.name.clone();
        let planned = plan.device_count();
        if planned == 0 && !spec.policies.dynamic {
            let selected = self
                .devices
                .values()
                .filter(|d| spec.select.matches(&d.labels))
                .count();
            let mut reason = format!(
                "{} known, {selected} match select {:?}",
                count(self.devices.len(), "device"),
                spec.select.to_string()
            );
            let unknown = plan
                .excluded
                .iter()
                .filter(|e| planner::is_unknown(e))
                .count();
            let by_hardware = plan.excluded.len() - unknown;
            if by_hardware > 0 {
                reason.push_str(&format!(
                    ", {by_hardware} excluded because release {} supports only hardware [{}]",
                    release.name,
                    release.hardware.join(", ")
                ));
            }
            if unknown > 0 {
                reason.push_str(&format!(
                    ", {unknown} accepted devices not planned: {}",
                    planner::NO_STATE
                ));
            }
            if !plan.unassigned.is_empty() {
                reason.push_str(&format!(", {} taken by no group", plan.unassigned.len()));
            }
            return Err(EngineError::NoDevices {
                rollout: name,
                reason,
            });
        }
        self.check_staged_overlap(&spec, &plan)?;
        let empty_groups = plan.empty_group_warnings();
        let mut groups: Vec<Group> = plan.groups.into_iter().map(new_group).collect();
        self.check_approval_names(&name, &groups)?;
        if spec.policies.dynamic {
            let last = groups.last();
            let mut dynamic = new_group(crate::plan::PlannedGroup {
                name: "dynamic".into(),
                devices: Vec::new(),
                pace: Pace::default(),
                success: last.map(|g| g.success.clone()).unwrap_or_default(),
                error: last.and_then(|g| g.error.clone()),
                before: Gate::default(),
                after: Gate::default(),
            });
            dynamic.dynamic = true;
            groups.push(dynamic);
        }
        let sizes = groups
            .iter()
            .map(|g| format!("{} {}", g.name, g.devices.len()))
            .collect::<Vec<_>>()
            .join(", ");
        let ramp = spec.policies.rate.map(|limit| Ramp::new(limit, now));
        let mut rollout = Rollout {
            name: name.clone(),
            release,
            spec,
            created_at: now,
            state: RolloutState::Creating,
            groups,
            excluded: plan.excluded,
            unassigned: plan.unassigned,
            trace: Vec::new(),
            conditions: Vec::new(),
            approvals: Vec::new(),
            waiting: None,
            ramp,
            started_at: None,
            checked_at: now,
            rolled_back: false,
            seen: BTreeSet::new(),
            sites: BTreeMap::new(),
        };
        self.assign_sites(&mut rollout);
        if rollout.spec.policies.dynamic {
            rollout.seen = self.devices.keys().cloned().collect();
        }
        let mut out = Out::default();
        let operator = by;
        let by = by.map(|by| format!(" by {by}")).unwrap_or_default();
        let mut message = format!(
            "created{by} for release {}: {} in {} ({sizes})",
            rollout.release.name,
            count(planned, "device"),
            count(rollout.groups.len(), "group")
        );
        let unknown = rollout
            .excluded
            .iter()
            .filter(|e| planner::is_unknown(e))
            .count();
        let by_hardware = rollout.excluded.len() - unknown;
        if by_hardware > 0 {
            message.push_str(&format!("; {by_hardware} excluded by hardware"));
        }
        if unknown > 0 {
            message.push_str(&format!(
                "; {unknown} accepted devices not planned: {}",
                planner::NO_STATE
            ));
        }
        if !rollout.unassigned.is_empty() {
            message.push_str(&format!(
                "; {} selected but in no group, not rolled out",
                rollout.unassigned.len()
            ));
        }
        let mut decision = Decision::new(TraceKind::Created, message);
        if let Some(by) = operator {
            decision = decision.by(by);
        }
        rollout.record(now, decision, &mut out);
        rollout.trace_unknown(now, &mut out);
        for warning in empty_groups {
            rollout.record(now, Decision::new(TraceKind::Note, warning), &mut out);
        }
        // hawkBit shows `creating` while the groups are filled: published before `ready`.
        out.snapshots.push(rollout.summary());
        rollout.set_condition("Initialized", true, "UpdateRunInitializedSuccessfully", now);
        rollout.state = RolloutState::Ready;
        self.rollouts
            .insert(name, Entry::new(rollout, &*self.zones));
        Ok(self.emit(out))
    }

    /// KubeFleet: concurrent staged runs over the same devices must use identical strategies.
    pub(super) fn check_staged_overlap(
        &self,
        spec: &RolloutSpec,
        plan: &planner::Plan,
    ) -> Result<(), EngineError> {
        let Strategy::Staged(_) = &spec.strategy else {
            return Ok(());
        };
        let mine = spec.staged_stages();
        let devices: BTreeSet<&String> = plan.groups.iter().flat_map(|g| &g.devices).collect();
        for entry in self.rollouts.values() {
            let other = &entry.rollout;
            if other.state.is_terminal() || !matches!(other.spec.strategy, Strategy::Staged(_)) {
                continue;
            }
            let shared = entry.index.keys().filter(|d| devices.contains(d)).count();
            if shared > 0 && other.spec.staged_stages() != mine {
                return Err(EngineError::Conflict(format!(
                    "staged run {} cannot initialize: run {} ({}) covers {shared} of the same devices with a different strategy; concurrent runs over the same devices must use identical strategies",
                    spec.name, other.name, other.state
                )));
            }
        }
        Ok(())
    }

    /// Approval requests are found by name alone (`flotilla approve NAME`), so a rollout whose
    /// gates would share a name, with each other or with a rollout that has not ended, is
    /// refused, naming both gates. Group names may contain `-`, so `<rollout>-before-prod`
    /// can be the gate after stage `before-prod` as well as the gate before stage `prod`.
    pub(super) fn check_approval_names(
        &self,
        rollout: &str,
        groups: &[Group],
    ) -> Result<(), EngineError> {
        fn gates<'a>(
            rollout: &'a str,
            groups: &'a [Group],
        ) -> impl Iterator<Item = (String, String)> + 'a {
            groups.iter().flat_map(move |g| {
                let before = g.before.approval.then(|| {
                    (
                        before_approval(rollout, &g.name),
                        format!("the approval before group {} of rollout {rollout}", g.name),
                    )
                });
                let after = g.after.approval.then(|| {
                    (
                        after_approval(rollout, &g.name),
                        format!("the approval after group {} of rollout {rollout}", g.name),
                    )
                });
                before.into_iter().chain(after)
            })
        }
        let mut seen: BTreeMap<String, String> = BTreeMap::new();
        for entry in self.rollouts.values() {
            let other = &entry.rollout;
            if other.state.is_terminal() || other.name == rollout {
                continue;
            }
            seen.extend(gates(&other.name, &other.groups));
        }
        let mut mine: BTreeMap<String, String> = BTreeMap::new();
        for (name, what) in gates(rollout, groups) {
            if let Some(first) = mine.get(&name).or_else(|| seen.get(&name)) {
                return Err(EngineError::Conflict(format!(
                    "rollout {rollout}: {first} and {what} would both be named {name}; rename one of the groups (stages)"
                )));
            }
            mine.insert(name, what);
        }
        Ok(())
    }
}

impl Engine {
    /// Records every planned device's site from the labels the registry holds now.
    pub(super) fn assign_sites(&self, rollout: &mut Rollout) {
        let Some(policy) = rollout.spec.policies.sites.as_ref() else {
            return;
        };
        for g in &mut rollout.groups {
            for (device, slot) in &mut g.slots {
                slot.site = self
                    .devices
                    .get(device)
                    .and_then(|d| d.labels.label(&policy.label))
                    .map(str::to_owned);
            }
        }
    }
}

pub(super) fn new_group(g: crate::plan::PlannedGroup) -> Group {
    Group {
        counts: GroupCounts {
            total: g.devices.len(),
            scheduled: g.devices.len(),
            ..GroupCounts::default()
        },
        slots: g
            .devices
            .iter()
            .map(|d| (d.clone(), Slot::scheduled()))
            .collect(),
        name: g.name,
        state: GroupState::Scheduled,
        devices: g.devices,
        pace: g.pace,
        success: g.success,
        error: g.error,
        before: g.before,
        after: g.after,
        cursor: 0,
        released: false,
        started_at: None,
        ended_at: None,
        succeeded_at: None,
        conditions: Vec::new(),
        dynamic: false,
        cache: Default::default(),
    }
}
