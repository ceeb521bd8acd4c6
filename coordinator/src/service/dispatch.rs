//! Control commands: what each does to the engine, the registry and the store.

use flotilla_rollout::zoneinfo::SystemZones;
use std::collections::BTreeMap;

use flotilla_protocol::control::{Command, DeviceGroupInfo, StrategyInfo};
use flotilla_protocol::operator::Role;
use flotilla_protocol::{validate_id, DeviceId};

use crate::service::error::ServiceError;
use crate::service::leadership;
use crate::service::lists::{approvals_in, json, named_list, refuse_filters, selector};
use crate::service::state::{now, Service};

use crate::service::backup;
use crate::service::page::Pager;
use crate::service::store::{StoreError, StoredStrategy};
use flotilla_rollout::engine::{Effect, ReleaseRef};
use flotilla_rollout::planner::DeviceGroup;
use flotilla_rollout::selector::Selector;
use flotilla_rollout::spec::RolloutSpec;

/// Bounds on what control requests can make the coordinator store (an admin's mistake or a
/// stolen admin key must not fill its disk).
pub(super) const MAX_STRATEGIES: usize = 1_000;
pub(super) const MAX_STRATEGY_BYTES: usize = 64 * 1024;
pub(super) const MAX_GROUPS: usize = 1_000;
pub(super) const MAX_GROUP_LABELS: usize = 64;
pub(super) const MAX_SELECTOR_BYTES: usize = 4 * 1024;

impl Service {
    /// Runs one control command. The outer error stops the service; the inner one is the
    /// operator's mistake and goes back in the reply.
    pub(super) async fn command(
        &mut self,
        command: Command,
        by: &str,
    ) -> Result<Result<serde_json::Value, String>, ServiceError> {
        let writes = command.required_role() != Role::Viewer && !matches!(command, Command::Backup);
        if writes {
            if let Some(refusal) = self.health.refusal(&self.store.describe()) {
                return Ok(Err(refusal));
            }
        }
        let name = command.name();
        let (effects, answer) = match self.dispatch(command, by, now()) {
            Ok(done) => done,
            Err(e) => return Ok(Err(e)),
        };
        self.apply(effects).await?;
        if let Some(reason) = self.health.reason().filter(|_| writes) {
            // The write failed under this very command: say so, and what happens to it.
            return Ok(Err(format!(
                "{name} took effect in memory but could not be stored ({reason}); nothing it \
                 implies goes to devices until the store can be written again, and it is stored \
                 then"
            )));
        }
        Ok(match answer {
            Answer::Value(value) => Ok(value),
            // The summary: a reply to a command must not grow with the rollout.
            Answer::Status(name) => match self.engine.summary(&name) {
                Some(status) => Ok(json(&status)),
                None => Err(format!("no rollout named {name:?}")),
            },
            Answer::Approval(name) => Ok(self
                .engine
                .approvals()
                .into_iter()
                .find(|a| a.name == name)
                .map(|a| json(&a))
                .unwrap_or(serde_json::Value::Null)),
        })
    }

    /// Hands a command to the engine or the store on behalf of operator `by`, whom the
    /// engine's trace names. Returns the effects to apply and what to answer once they are
    /// applied, or the error for the reply; nothing here publishes.
    pub(super) fn dispatch(
        &mut self,
        command: Command,
        by: &str,
        now: u64,
    ) -> Result<(Vec<Effect>, Answer), String> {
        let engine_error = |e: flotilla_rollout::engine::EngineError| e.to_string();
        let store_error = |e: StoreError| e.to_string();
        let status =
            |name: String, r: Result<Vec<Effect>, flotilla_rollout::engine::EngineError>| {
                r.map(|effects| (effects, Answer::Status(name)))
                    .map_err(engine_error)
            };
        let value = |v: serde_json::Value| Ok((Vec::new(), Answer::Value(v)));
        match command {
            Command::CreateRollout { spec } => {
                let spec = RolloutSpec::from_toml(&spec, &SystemZones)
                    .map_err(|e| format!("invalid rollout spec: {e}"))?;
                let spec = self.resolve_strategy(spec)?;
                let (blob, manifest) = self
                    .releases
                    .load(&spec.release)
                    .map_err(|e| e.to_string())?;
                self.manifests.insert(manifest.name.clone(), blob);
                let release = ReleaseRef {
                    name: manifest.name.clone(),
                    counter: manifest.counter,
                    hardware: manifest.hardware,
                };
                let name = spec.name.clone();
                let unknown = self.devices_without_state();
                let r = self
                    .engine
                    .create_rollout_knowing(spec, release, by, &unknown, now);
                status(name, r)
            }
            Command::StartRollout { rollout } => {
                let r = self.engine.start_by(&rollout, by, now);
                status(rollout, r)
            }
            Command::PauseRollout { rollout } => {
                let r = self.engine.pause_by(&rollout, by, now);
                status(rollout, r)
            }
            Command::ResumeRollout { rollout } => {
                let r = self.engine.resume_by(&rollout, by, now);
                status(rollout, r)
            }
            Command::StopRollout { rollout } => {
                let r = self.engine.stop_by(&rollout, by, now);
                status(rollout, r)
            }
            Command::TriggerNext {
                rollout,
                skip_approval,
            } => {
                let r = self
                    .engine
                    .trigger_next_with(&rollout, by, skip_approval, now);
                status(rollout, r)
            }
            Command::RetryRollout { rollout, name } => {
                let new_name = name.unwrap_or_else(|| format!("{rollout}-retry"));
                validate_id("rollout name", &new_name).map_err(|e| format!("name: {e}"))?;
                let r = self
                    .engine
                    .retry_failed_by(&rollout, Some(new_name.clone()), by, now);
                status(new_name, r)
            }
            // Without paging fields, the reply an older client expects (refused by `reply`
            // when it does not fit in one message); with them, a page.
            Command::RolloutStatus {
                rollout: Some(name),
                page,
            } if page.is_paged() => value(json(&self.rollout_page(&name, &page)?)),
            Command::RolloutStatus {
                rollout: Some(name),
                ..
            } => match self.engine.status(&name) {
                Some(status) => value(json(&status)),
                None => Err(format!("no rollout named {name:?}")),
            },
            Command::RolloutStatus {
                rollout: None,
                page,
            } if page.is_paged() => {
                refuse_filters(
                    &page,
                    &["select", "group", "online", "enrollment"],
                    "rollouts",
                )?;
                let states = page.phase.clone();
                let all = self
                    .engine
                    .summaries_after(page.after.as_deref())
                    .filter(|s| states.as_ref().is_none_or(|p| *p == s.state));
                value(json(
                    &Pager::new(&page, 0)?.collect(all, |s| s.name.clone()),
                ))
            }
            Command::RolloutStatus { rollout: None, .. } => {
                let all: Vec<_> = self.engine.summaries_after(None).collect();
                value(json(&all))
            }
            Command::ListDevices { page } if page.is_paged() => {
                value(json(&self.device_page(&page, now)?))
            }
            Command::ListDevices { .. } => value(json(&self.device_list(now))),
            Command::ShowDevice { device } => value(json(&self.device_view(&device, now)?)),
            Command::PendingDevices { page } if page.is_paged() => {
                refuse_filters(
                    &page,
                    &["phase", "group", "online", "enrollment"],
                    "pending devices",
                )?;
                let select = selector(&page)?;
                let pending = self
                    .registry
                    .pending_after(page.after.as_deref())
                    .filter(|info| select.matches(&info.labels));
                let pager = Pager::new(&page, 0)?;
                value(json(&pager.collect(pending, |info| info.device.clone())))
            }
            Command::PendingDevices { .. } => value(json(&self.registry.pending())),
            Command::AcceptDevice { device, key } => {
                let state = self.registry.accept(&device, key.as_deref(), now)?;
                self.save_enrollment(&device)?;
                tracing::info!(%device, "device accepted by an operator");
                let effects = match state {
                    Some(state) => self.engine.observe_state(state, now),
                    None => Vec::new(),
                };
                let info = self.registry.info(&device);
                Ok((effects, Answer::Value(json(&info))))
            }
            Command::RejectDevice { device, key } => {
                self.registry.reject(&device, key.as_deref(), now)?;
                self.save_enrollment(&device)?;
                tracing::info!(%device, "device key rejected by an operator");
                value(json(&self.registry.info(&device)))
            }
            Command::RevokeDevice { device } => {
                self.registry.revoke(&device, now)?;
                self.save_enrollment(&device)?;
                tracing::info!(%device, "device revoked by an operator");
                // It leaves the rollouts not yet finished and its retained topics are cleared.
                let effects = match self.engine.delete_device(&device, now) {
                    Ok(effects) => effects,
                    Err(_) => vec![Effect::Forget {
                        device: device.clone(),
                    }],
                };
                let info = self.registry.info(&device);
                Ok((effects, Answer::Value(json(&info))))
            }
            Command::ListReleases { page } => {
                let mut all = self.releases.summaries().map_err(|e| e.to_string())?;
                let mut usage = self.engine.release_usage();
                for release in &mut all {
                    let (devices, rollouts) = usage.remove(&release.name).unwrap_or_default();
                    release.devices = Some(devices);
                    release.rollouts = rollouts;
                }
                value(named_list(all, &page, "releases", |r| r.name.clone())?)
            }
            Command::DeleteDevice { device } => {
                DeviceId::new(&device).map_err(|e| format!("device: {e}"))?;
                let effects = self
                    .engine
                    .delete_device_by(&device, by, now)
                    .map_err(engine_error)?;
                Ok((
                    effects,
                    Answer::Value(serde_json::json!({ "deleted": device })),
                ))
            }
            Command::Approve { name } => {
                let effects = self
                    .engine
                    .approve_by(&name, by, now)
                    .map_err(engine_error)?;
                Ok((effects, Answer::Approval(name)))
            }
            Command::Login => value(serde_json::json!({ "operator": by })),
            Command::DeleteRollout { rollout } => {
                let effects = self.engine.delete(&rollout).map_err(engine_error)?;
                tracing::info!(%rollout, %by, "rollout deleted");
                Ok((
                    effects,
                    Answer::Value(serde_json::json!({ "deleted": rollout })),
                ))
            }
            Command::Deny { name, reason } => {
                let effects = self
                    .engine
                    .deny_by(&name, by, reason.as_deref(), now)
                    .map_err(engine_error)?;
                Ok((effects, Answer::Approval(name)))
            }
            Command::ListApprovals { page } => {
                let (all, page) = approvals_in(self.engine.approvals(), page)?;
                value(named_list(all, &page, "approvals", |a| a.name.clone())?)
            }
            Command::Coordinators => {
                let info = leadership::info(self.leadership.status(), self.store.describe());
                value(json(&info))
            }
            Command::Backup => {
                let path = self
                    .data_dir
                    .join("backups")
                    .join(format!("flotilla-backup-{now}.jsonl"));
                let info = backup::write_backup(&self.store, &path, now, &self.key)
                    .map_err(|e| e.to_string())?;
                tracing::info!(%by, path = %info.path, records = info.records, "store backed up");
                value(json(&info))
            }
            Command::CreateStrategy { name, spec } => {
                check_strategy(&name, &spec)?;
                let all = self.store.list_strategies().map_err(store_error)?;
                if all.len() >= MAX_STRATEGIES && !all.iter().any(|s| s.name == name) {
                    return Err(format!(
                        "there are already {MAX_STRATEGIES} stored strategies, the most the \
                         coordinator keeps; delete one first"
                    ));
                }
                let stored = StoredStrategy { name, text: spec };
                self.store
                    .save_strategy(&stored)
                    .map_err(|e| self.write_failed(e))?;
                value(json(&strategy_info(stored)))
            }
            Command::ListStrategies { page } => {
                let all = self.store.list_strategies().map_err(store_error)?;
                let all: Vec<_> = all.into_iter().map(strategy_info).collect();
                value(named_list(all, &page, "strategies", |s| s.name.clone())?)
            }
            Command::ShowStrategy { name } => match self.store.load_strategy(&name) {
                Ok(Some(stored)) => value(json(&strategy_info(stored))),
                Ok(None) => Err(no_strategy(&name)),
                Err(e) => Err(e.to_string()),
            },
            Command::CreateGroup {
                name,
                select,
                labels,
            } => {
                let group = device_group(name, &select, labels)?;
                let all = self.store.list_groups().map_err(store_error)?;
                if all.len() >= MAX_GROUPS && !all.iter().any(|g| g.name == group.name) {
                    return Err(format!(
                        "there are already {MAX_GROUPS} device groups, the most the coordinator \
                         keeps; delete one first"
                    ));
                }
                self.store
                    .save_group(&group)
                    .map_err(|e| self.write_failed(e))?;
                self.refresh_device_groups().map_err(store_error)?;
                value(json(&group_info(&group)))
            }
            Command::ListGroups { page } => {
                let all = self.store.list_groups().map_err(store_error)?;
                let all: Vec<_> = all.iter().map(group_info).collect();
                value(named_list(all, &page, "device groups", |g| g.name.clone())?)
            }
            Command::DeleteGroup { name } => {
                let Some(group) = self.store.load_group(&name).map_err(store_error)? else {
                    return Err(format!("no device group named {name:?}"));
                };
                self.store
                    .delete_group(&name)
                    .map_err(|e| self.write_failed(e))?;
                self.refresh_device_groups().map_err(store_error)?;
                value(json(&group_info(&group)))
            }
        }
    }

    /// Gives the engine the stored device groups, all of them.
    pub(super) fn refresh_device_groups(&mut self) -> Result<(), StoreError> {
        let groups = self.store.list_groups()?;
        self.engine.set_device_groups(groups);
        Ok(())
    }

    /// A staged spec names a stored strategy; the rollout gets its own resolved copy, so a later
    /// change to the stored strategy does not change a rollout already created (KubeFleet's
    /// strategy snapshot).
    pub(super) fn resolve_strategy(&self, spec: RolloutSpec) -> Result<RolloutSpec, String> {
        let Some(name) = staged_strategy_name(&spec) else {
            return Ok(spec);
        };
        let stored = self
            .store
            .load_strategy(name)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| no_strategy(name))?;
        resolve_with(spec, &stored)
    }
}

/// What a command answers once its effects are applied.
pub(super) enum Answer {
    /// The status of this rollout, read after the effects.
    Status(String),
    /// This approval request, read after the effects.
    Approval(String),
    Value(serde_json::Value),
}

pub(super) fn no_strategy(name: &str) -> String {
    format!("no stored strategy named {name}; create it with `flotilla strategy create`")
}

pub(super) fn strategy_info(stored: StoredStrategy) -> StrategyInfo {
    StrategyInfo {
        name: stored.name,
        spec: stored.text,
    }
}

pub(super) fn group_info(group: &DeviceGroup) -> DeviceGroupInfo {
    DeviceGroupInfo {
        name: group.name.clone(),
        select: group.select.to_string(),
        labels: group.labels.clone(),
    }
}

/// Validates a `create_group` request into a device group, naming the field that is wrong.
pub(super) fn device_group(
    name: String,
    select: &str,
    labels: BTreeMap<String, String>,
) -> Result<DeviceGroup, String> {
    validate_id("device group name", &name).map_err(|e| format!("name: {e}"))?;
    if select.len() > MAX_SELECTOR_BYTES {
        return Err(format!(
            "select: {} bytes, more than the {MAX_SELECTOR_BYTES} a selector may have",
            select.len()
        ));
    }
    if labels.len() > MAX_GROUP_LABELS {
        return Err(format!(
            "labels: {} labels, more than the {MAX_GROUP_LABELS} a group may have",
            labels.len()
        ));
    }
    let select = Selector::parse(select).map_err(|e| format!("select: {e}"))?;
    for (key, value) in &labels {
        check_label("labels: key", key)?;
        check_label(&format!("labels.{key}: value"), value)?;
    }
    Ok(DeviceGroup {
        name,
        select,
        labels,
    })
}

/// Label keys and values use the selector's character set, so a partition's `group_select`
/// can match them.
pub(super) fn check_label(what: &str, text: &str) -> Result<(), String> {
    if text.is_empty() {
        return Err(format!("{what} must not be empty"));
    }
    if let Some(bad) = text
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/' | ':')))
    {
        return Err(format!(
            "{what} {text:?} contains {bad:?}; allowed are letters, digits, '.', '_', '-', '/' and ':'"
        ));
    }
    Ok(())
}

/// Checks a strategy before it is stored: a valid name, TOML, and at least one `[[stage]]`.
/// The stages themselves are validated when a staged rollout resolves the strategy.
pub(super) fn check_strategy(name: &str, text: &str) -> Result<(), String> {
    validate_id("strategy name", name).map_err(|e| format!("name: {e}"))?;
    if text.len() > MAX_STRATEGY_BYTES {
        return Err(format!(
            "spec: {} bytes, more than the {MAX_STRATEGY_BYTES} a strategy may have",
            text.len()
        ));
    }
    flotilla_rollout::spec::StagedStrategy::from_toml(name, text)
        .map(|_| ())
        .map_err(|e| format!("spec: strategy {name}: {e}"))
}

/// The stored strategy a staged rollout spec names, if it names one.
pub(super) fn staged_strategy_name(spec: &RolloutSpec) -> Option<&str> {
    spec.staged_strategy_name()
}

/// Snapshots the stored strategy a staged spec names into the spec (KubeFleet: a run keeps the
/// strategy as it was when the run was created).
pub(super) fn resolve_with(
    mut spec: RolloutSpec,
    stored: &StoredStrategy,
) -> Result<RolloutSpec, String> {
    let strategy = flotilla_rollout::spec::StagedStrategy::from_toml(&stored.name, &stored.text)
        .map_err(|e| format!("stored strategy {}: {e}", stored.name))?;
    spec.resolve_strategy(&strategy);
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// issue 10, case 9: what a control request may make the coordinator store is bounded.
    #[test]
    fn strategies_and_groups_are_bounded_in_size() {
        let big = format!(
            "[[stage]]\nname = \"a\"\n# {}\n",
            "x".repeat(MAX_STRATEGY_BYTES)
        );
        let err = check_strategy("s1", &big).expect_err("too large");
        assert!(
            err.starts_with("spec: ") && err.contains("more than the"),
            "{err}"
        );
        let labels: BTreeMap<String, String> = (0..=MAX_GROUP_LABELS)
            .map(|i| (format!("k{i}"), "v".to_owned()))
            .collect();
        let err = device_group("g1".into(), "env=lab", labels).expect_err("too many labels");
        assert!(err.starts_with("labels: 65 labels"), "{err}");
        let err = device_group(
            "g1".into(),
            &"a".repeat(MAX_SELECTOR_BYTES + 1),
            BTreeMap::new(),
        )
        .expect_err("too long");
        assert!(err.starts_with("select: "), "{err}");
    }
}
