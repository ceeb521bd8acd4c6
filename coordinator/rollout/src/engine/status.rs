//! The parts of a rollout's status that only staged runs show, in KubeFleet's terms
//! (`kubefleet-staged-update.txt`): the strategy snapshot, per-device conditions and the
//! deletion stage.

use flotilla_protocol::control::{
    Condition, GroupStatus, StageSnapshot, StageTask, StrategySnapshot,
};

use super::advance::seconds;
use super::model::{DevicePhase, Rollout, RolloutState, Slot};
use crate::plan::Gate;
use crate::spec::Strategy;

/// The name KubeFleet gives its deletion stage.
pub const DELETION_STAGE: &str = "kubernetes-fleet.io/deleteStage";

fn condition(kind: &str, status: bool, reason: &str, message: &str, at: u64) -> Condition {
    Condition {
        kind: kind.to_owned(),
        status,
        reason: reason.to_owned(),
        message: message.to_owned(),
        at,
    }
}

fn tasks(gate: &Gate) -> Vec<StageTask> {
    let mut tasks = Vec::new();
    if gate.approval {
        tasks.push(StageTask {
            kind: "Approval".into(),
            wait: None,
        });
    }
    if gate.wait > 0 {
        tasks.push(StageTask {
            kind: "TimedWait".into(),
            wait: Some(seconds(gate.wait)),
        });
    }
    tasks
}

impl Rollout {
    fn is_staged(&self) -> bool {
        matches!(self.spec.strategy, Strategy::Staged(_))
    }

    /// The stages the run captured when it was created.
    pub(crate) fn strategy_snapshot(&self) -> Option<StrategySnapshot> {
        let Strategy::Staged(staged) = &self.spec.strategy else {
            return None;
        };
        let stages = staged.stages.as_ref()?;
        Some(StrategySnapshot {
            strategy: staged.strategy.clone(),
            stages: stages
                .iter()
                .map(|s| StageSnapshot {
                    name: s.name.clone(),
                    select: s.select.to_string(),
                    sort_by: s.sort_by.clone(),
                    max_concurrency: s.max_concurrency,
                    before: tasks(&s.before),
                    after: tasks(&s.after),
                })
                .collect(),
        })
    }

    /// KubeFleet's per-cluster conditions for one device of a staged run: `Started` once its
    /// action was sent, `Succeeded` once it ended (false when it did not end ready).
    pub(crate) fn device_conditions(&self, slot: &Slot) -> Vec<Condition> {
        if !self.is_staged() {
            return Vec::new();
        }
        let mut out = Vec::new();
        if let Some(at) = slot.started_at {
            out.push(condition("Started", true, "ClusterUpdatingStarted", "", at));
        }
        let at = slot.ended_at.or(slot.started_at).unwrap_or(self.checked_at);
        let ended = match &slot.phase {
            DevicePhase::Ready => Some((true, "ClusterUpdatingSucceeded", String::new())),
            DevicePhase::Failed(r) | DevicePhase::Refused(r) | DevicePhase::TimedOut(r) => {
                Some((false, "ClusterUpdatingFailed", r.clone()))
            }
            DevicePhase::Canceled => Some((false, "ClusterUpdatingFailed", "canceled".into())),
            DevicePhase::RolledBack => Some((false, "ClusterUpdatingFailed", "rolled back".into())),
            DevicePhase::Skipped(r) => Some((false, "ClusterUpdatingSkipped", r.clone())),
            _ => None,
        };
        if let Some((status, reason, message)) = ended {
            out.push(condition("Succeeded", status, reason, &message, at));
        }
        out
    }

    /// KubeFleet's deletion stage: no devices (flotilla never removes software from a device
    /// the run leaves out); it starts and succeeds when the run does.
    pub(crate) fn deletion_stage(&self) -> Option<GroupStatus> {
        if !self.is_staged() {
            return None;
        }
        let mut stage = GroupStatus {
            name: DELETION_STAGE.into(),
            state: "scheduled".into(),
            ..GroupStatus::default()
        };
        if self.state == RolloutState::Finished {
            let at = self
                .conditions
                .iter()
                .find(|c| c.kind == "Succeeded")
                .map_or(self.checked_at, |c| c.at);
            stage.state = "finished".into();
            stage.started_at = Some(at);
            stage.ended_at = Some(at);
            stage.conditions = vec![
                condition("Progressing", true, "StageUpdatingStarted", "", at),
                condition("Succeeded", true, "StageUpdatingSucceeded", "", at),
            ];
        }
        Some(stage)
    }
}
