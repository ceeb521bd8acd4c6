//! The validated rollout spec, as it is stored with its rollout, and the errors that name what
//! was wrong with a spec.

use serde::{Deserialize, Serialize};

use crate::plan::Gate;
use crate::selector::{Selector, SelectorError};

pub use crate::plan::{
    Budget, ErrorAction, ErrorCondition, Percent, Policies, SuccessAction, SuccessCondition,
    Threshold,
};

/// Most groups a spec may define: a typo like `count = 30000` should fail, not plan 30,000 groups.
pub const MAX_GROUPS: u32 = 1000;

/// Fleet's `maxNew`: most devices a partition starts in one batch.
pub const DEFAULT_MAX_NEW: usize = 50;
/// Fleet's `autoPartitionThreshold`: fewer selected devices than this make one partition.
pub const DEFAULT_AUTO_PARTITION_THRESHOLD: usize = 200;
/// KubeFleet's `unavailablePeriodSeconds` default, used by `[rolling]`.
pub const DEFAULT_ROLLING_UNAVAILABLE_PERIOD: u64 = 60;
/// The highest rollout weight.
pub const MAX_WEIGHT: u32 = 1000;
/// The retry backoff when `retry` does not set one.
pub const DEFAULT_RETRY_BACKOFF: u64 = 30;

/// A validated rollout spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutSpec {
    pub name: String,
    pub release: String,
    /// Which devices the rollout covers; every device when empty.
    pub select: Selector,
    pub strategy: Strategy,
    /// Rollout-wide settings (action type, timeouts, retries, windows…).
    pub policies: Policies,
}

/// How the selected devices are split into ordered groups: one of the four vocabularies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// hawkBit deployment groups.
    Groups(GroupsSpec),
    /// Rancher Fleet partitions.
    Partitions(PartitionsSpec),
    /// KubeFleet's RollingUpdate.
    Rolling(RollingSpec),
    /// A KubeFleet staged update run.
    Staged(StagedSpec),
}

/// hawkBit deployment groups: either `count` even groups or an explicit list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupsSpec {
    /// `count = N`: N groups splitting the devices as evenly as possible.
    Count {
        count: u32,
        success: SuccessCondition,
        error: Option<ErrorCondition>,
    },
    /// `[[groups.group]]` entries, filled in order.
    List(Vec<GroupSpec>),
}

/// One explicit deployment group, with the rollout-wide defaults already applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupSpec {
    pub name: String,
    pub select: Selector,
    /// Share of the matching devices not already in an earlier group.
    pub percent: Percent,
    pub success: SuccessCondition,
    pub error: Option<ErrorCondition>,
}

/// Rancher Fleet partitions. `maxUnavailablePartitions` lives in
/// [`Policies::max_unavailable_groups`], because the engine applies it across groups.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartitionsSpec {
    /// The NotReady devices a partition may have and still be Ready (default 100%).
    pub max_unavailable: Budget,
    /// Size of each automatic partition (default 25%).
    pub auto_partition_size: Budget,
    /// Fewer selected devices than this make one partition; 0 always makes one (default 200).
    pub auto_partition_threshold: usize,
    /// Most devices started in one batch (default 50).
    pub max_new: usize,
    /// Manual partitions, in rollout order. When present, auto-partitioning is ignored.
    pub partitions: Vec<PartitionSpec>,
    pub error: Option<ErrorCondition>,
}

/// One manual partition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartitionSpec {
    pub name: String,
    /// This partition's own budget, or the `[partitions]` one.
    pub max_unavailable: Budget,
    pub members: PartitionMembers,
}

/// Which devices a manual partition takes (of those not in an earlier partition).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PartitionMembers {
    /// These device ids, in this order (Fleet's `clusterName`).
    Devices(Vec<String>),
    /// Devices matching a label selector (`clusterSelector`).
    Select(Selector),
    /// The devices of the named device group (`clusterGroup`).
    Group(String),
    /// The devices of every device group whose own labels match (`clusterGroupSelector`).
    GroupSelect(Selector),
}

/// KubeFleet's RollingUpdate over the devices picked by [`Pick`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RollingSpec {
    /// Most picked devices unavailable at once; a percentage rounds down, and at least 1.
    pub max_unavailable: Budget,
    pub pick: Pick,
    pub error: Option<ErrorCondition>,
}

/// KubeFleet's placement types: which of the selected devices a rolling update covers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pick {
    /// Every selected device (`PickAll`).
    All,
    /// The first n selected devices by id (`PickN`).
    N(usize),
    /// These devices, in this order (`PickFixed`).
    Fixed(Vec<String>),
}

/// A KubeFleet staged update run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StagedSpec {
    /// The stored strategy the spec names (`strategy = "name"`), if any.
    pub strategy: Option<String>,
    /// The stages: written inline, or the snapshot of the named strategy once resolved. `None`
    /// while a named strategy is unresolved.
    pub stages: Option<Vec<StageSpec>>,
    /// The error condition of every stage: `[staged] error`, or a failed device stops the run.
    pub error: ErrorCondition,
}

/// A stored, reusable staged strategy (KubeFleet's ClusterStagedUpdateStrategy). A run takes a
/// snapshot of it, so later changes to the strategy do not affect running rollouts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StagedStrategy {
    pub name: String,
    pub stages: Vec<StageSpec>,
}

/// One stage of a staged run. Two strategies are identical when their stages compare equal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageSpec {
    pub name: String,
    pub select: Selector,
    /// A label whose integer value orders the stage's devices; by id without it.
    pub sort_by: Option<String>,
    /// Most devices of the stage updating at once (default 1, as in KubeFleet).
    pub max_concurrency: usize,
    pub before: Gate,
    pub after: Gate,
}

/// Why a spec was refused. Every variant names the field (a TOML path) and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("rollout spec is not valid TOML or has a wrong field: {message}")]
    Toml { message: String },
    #[error("{field}: {source}")]
    Id {
        field: String,
        source: flotilla_protocol::IdError,
    },
    #[error("{field}: {source}")]
    Selector {
        field: String,
        source: SelectorError,
    },
    #[error("{field}: {value} is not a percentage {range}")]
    Percent {
        field: String,
        value: String,
        range: &'static str,
    },
    #[error("{field}: {value:?} is not one of {allowed}")]
    Action {
        field: String,
        value: String,
        allowed: &'static str,
    },
    /// A value of the right type outside its range, e.g. `weight: 2000 is not from 0 to 1000`.
    #[error("{field}: {value} is not {expected}")]
    Value {
        field: String,
        value: String,
        expected: String,
    },
    #[error("{field}: {value} is not a duration: {reason}")]
    Duration {
        field: String,
        value: String,
        reason: String,
    },
    #[error(
        "{field}: {value} is not an RFC 3339 time like \"2026-11-22T02:00:00Z\" or Unix seconds"
    )]
    Time { field: String, value: String },
    #[error("{field}: window {cron:?} in {tz}: {reason}")]
    Window {
        field: String,
        cron: String,
        tz: String,
        reason: String,
    },
    #[error("set exactly one of [groups], [partitions], [rolling] or [staged]; found {found}")]
    Vocabulary { found: String },
    #[error("{field}: set exactly one of {keys}; found {found}")]
    OneOf {
        field: String,
        keys: &'static str,
        found: String,
    },
    #[error("{field} = {value} needs {needs}")]
    Requires {
        field: String,
        value: String,
        needs: &'static str,
    },
    #[error("{field} = {value}: {why}")]
    NotApplicable {
        field: String,
        value: String,
        why: &'static str,
    },
    #[error("groups: set either `count` or `[[groups.group]]` entries, not both")]
    CountAndList,
    #[error("groups: set `count` or at least one `[[groups.group]]` entry")]
    NoGroups,
    #[error("groups.count: {value} is not from 1 to {MAX_GROUPS}")]
    Count { value: i64 },
    #[error("{field}: more than {MAX_GROUPS} entries ({count})")]
    TooManyGroups { field: String, count: usize },
    #[error("{field}: {what} {name:?} is already used by {first}")]
    Duplicate {
        field: String,
        what: &'static str,
        name: String,
        first: String,
    },
}

impl RolloutSpec {
    /// The vocabulary the spec is written in: "groups", "partitions", "rolling" or "staged".
    pub fn vocabulary(&self) -> &'static str {
        match &self.strategy {
            Strategy::Groups(_) => "groups",
            Strategy::Partitions(_) => "partitions",
            Strategy::Rolling(_) => "rolling",
            Strategy::Staged(_) => "staged",
        }
    }

    /// The hawkBit groups of a `[groups]` spec.
    pub fn groups(&self) -> Option<&GroupsSpec> {
        match &self.strategy {
            Strategy::Groups(g) => Some(g),
            _ => None,
        }
    }

    /// The stored strategy a `[staged]` spec names, while it is not resolved yet.
    pub fn staged_strategy_name(&self) -> Option<&str> {
        match &self.strategy {
            Strategy::Staged(StagedSpec {
                strategy: Some(name),
                stages: None,
                ..
            }) => Some(name),
            _ => None,
        }
    }

    /// Snapshots a stored strategy's stages into a `[staged]` spec, so that later changes to the
    /// strategy do not affect this rollout. Does nothing for other vocabularies.
    pub fn resolve_strategy(&mut self, strategy: &StagedStrategy) {
        if let Strategy::Staged(staged) = &mut self.strategy {
            staged.strategy = Some(strategy.name.clone());
            staged.stages = Some(strategy.stages.clone());
        }
    }

    /// The stages of a `[staged]` spec, inline or resolved; `None` otherwise.
    pub fn staged_stages(&self) -> Option<&[StageSpec]> {
        match &self.strategy {
            Strategy::Staged(StagedSpec {
                stages: Some(stages),
                ..
            }) => Some(stages),
            _ => None,
        }
    }
}
