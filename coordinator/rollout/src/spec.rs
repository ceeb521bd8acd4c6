//! The rollout spec: the TOML an operator writes, validated into a [`RolloutSpec`].
//!
//! Parsing happens in two steps: serde reads the raw TOML into private structs that refuse
//! unknown fields (so a typo is an error, not a silently ignored setting), then validation turns
//! them into the public types, naming the field (a TOML path) and the value in every error. The
//! validated spec is serializable because it is stored with the rollout.
//!
//! A spec has the common keys (`name`, `release`, `select`), the rollout-wide policies (action
//! type, timeouts, retries, offline handling, rate, maintenance windows, soak), and exactly one
//! of four vocabularies, each from the system whose documents define it:
//!
//! - `[groups]`: Eclipse hawkBit deployment groups ([`GroupsSpec`]);
//! - `[partitions]`: Rancher Fleet partitions ([`PartitionsSpec`]);
//! - `[rolling]`: KubeFleet's RollingUpdate ([`RollingSpec`]);
//! - `[staged]`: KubeFleet staged update runs ([`StagedSpec`]), inline or naming a stored
//!   [`StagedStrategy`] that the service snapshots into the spec with
//!   [`RolloutSpec::resolve_strategy`].
//!
//! The planner compiles every vocabulary into the same [`crate::plan::Plan`];
//! `docs/rollout-spec.md` describes the grammar and the mapping.
//!
//! ```toml
//! name = "fw-2-4"
//! release = "fw-2.4.0"
//! select = "hw=pi4"
//! timeout = "30m"
//! [groups]
//! success = { threshold = "100%", action = "next" }
//! error = { threshold = "20%", action = "pause" }
//! [[groups.group]]
//! name = "canary"
//! select = "env=canary"
//! percent = 50
//! [[groups.group]]
//! name = "rest"
//! ```

use serde::{Deserialize, Serialize};

use crate::duration::parse_duration;
use crate::plan::{
    ActionType, FailureClasses, Gate, OfflinePolicy, RateLimit, Retry, SitePolicy, UnknownDevices,
    WindowSpec, DEFAULT_SEED_WAIT, DEFAULT_WEIGHT,
};
use crate::selector::{Selector, SelectorError};
use crate::window::Window;
use crate::zoneinfo::ZoneSource;

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
    /// Parses and validates a TOML rollout spec; maintenance windows look their time zones up
    /// in `zones`.
    pub fn from_toml(text: &str, zones: &dyn ZoneSource) -> Result<RolloutSpec, SpecError> {
        let raw: RawSpec = toml::from_str(text).map_err(|e| SpecError::Toml {
            message: e.to_string(),
        })?;
        raw.validate(zones)
    }

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

impl StagedStrategy {
    /// Parses a stored staged strategy: `[[stage]]` entries with the same keys as
    /// `[[staged.stage]]`.
    pub fn from_toml(name: &str, text: &str) -> Result<StagedStrategy, SpecError> {
        flotilla_protocol::validate_id("strategy name", name).map_err(|source| SpecError::Id {
            field: "strategy".into(),
            source,
        })?;
        let raw: RawStrategyFile = toml::from_str(text).map_err(|e| SpecError::Toml {
            message: e.to_string(),
        })?;
        if raw.stage.is_empty() {
            return Err(SpecError::Value {
                field: "stage".into(),
                value: "[]".into(),
                expected: "a list of at least one [[stage]] entry".into(),
            });
        }
        Ok(StagedStrategy {
            name: name.to_owned(),
            stages: stages("stage", raw.stage)?,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Raw TOML

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpec {
    name: String,
    release: String,
    select: Option<String>,
    action: Option<String>,
    force_at: Option<toml::Value>,
    start_at: Option<toml::Value>,
    weight: Option<i64>,
    timeout: Option<toml::Value>,
    retry: Option<RawRetry>,
    offline: Option<toml::Value>,
    rate: Option<RawRate>,
    soak: Option<toml::Value>,
    unavailable_period: Option<toml::Value>,
    unknown_devices: Option<String>,
    #[serde(default)]
    window: Vec<RawWindow>,
    groups: Option<RawGroups>,
    partitions: Option<RawPartitions>,
    rolling: Option<RawRolling>,
    staged: Option<RawStaged>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRetry {
    attempts: i64,
    backoff: Option<toml::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRate {
    base: toml::Value,
    factor: Option<toml::Value>,
    every: Option<i64>,
    max: Option<toml::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWindow {
    cron: String,
    duration: toml::Value,
    tz: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGroups {
    count: Option<i64>,
    success: Option<RawSuccess>,
    error: Option<RawError>,
    dynamic: Option<bool>,
    sites: Option<RawSites>,
    #[serde(default)]
    group: Vec<RawGroup>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGroup {
    name: Option<String>,
    select: Option<String>,
    percent: Option<RawNumber>,
    success: Option<RawSuccess>,
    error: Option<RawError>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPartitions {
    max_unavailable: Option<RawNumber>,
    max_unavailable_partitions: Option<RawNumber>,
    auto_partition_size: Option<RawNumber>,
    auto_partition_threshold: Option<i64>,
    max_new: Option<i64>,
    error: Option<RawError>,
    sites: Option<RawSites>,
    #[serde(default)]
    partition: Vec<RawPartition>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPartition {
    name: Option<String>,
    max_unavailable: Option<RawNumber>,
    devices: Option<Vec<String>>,
    select: Option<String>,
    group: Option<String>,
    group_select: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRolling {
    max_unavailable: Option<RawNumber>,
    unavailable_period: Option<toml::Value>,
    pick: Option<toml::Value>,
    error: Option<RawError>,
    sites: Option<RawSites>,
    /// Read only to refuse it with a reason rather than as an unknown field.
    max_surge: Option<toml::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStaged {
    strategy: Option<String>,
    #[serde(default)]
    stage: Vec<RawStage>,
    error: Option<RawError>,
    sites: Option<RawSites>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStrategyFile {
    #[serde(default)]
    stage: Vec<RawStage>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStage {
    name: String,
    select: Option<String>,
    sort_by: Option<String>,
    max_concurrency: Option<i64>,
    before: Option<RawGate>,
    after: Option<RawGate>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGate {
    approval: Option<bool>,
    wait: Option<toml::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSuccess {
    threshold: Option<RawNumber>,
    action: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawError {
    threshold: Option<RawNumber>,
    count: Option<i64>,
    min_sample: Option<i64>,
    classes: Option<Vec<String>>,
    action: Option<String>,
}

/// A vocabulary's `sites` table. Each vocabulary names the busy limit with its own word for
/// devices at work (see [`SITE_BUSY_KEYS`]); the others are refused with a pointer to it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSites {
    label: Option<String>,
    max_running: Option<i64>,
    max_busy: Option<i64>,
    max_concurrency: Option<i64>,
    max_unavailable: Option<i64>,
    peers: Option<bool>,
    seed_wait: Option<toml::Value>,
}

/// The key of the per-site busy limit in each vocabulary's `sites` table: hawkBit counts
/// running actions, Fleet and KubeFleet's rolling update speak of devices updating (busy), a
/// KubeFleet stage of its concurrency.
pub const SITE_BUSY_KEYS: [(&str, &str); 4] = [
    ("groups", "max_running"),
    ("partitions", "max_busy"),
    ("rolling", "max_busy"),
    ("staged", "max_concurrency"),
];

/// A percentage or a budget as written: `25`, `12.5`, `"25%"` or `"10"`.
#[derive(Deserialize)]
#[serde(untagged)]
enum RawNumber {
    Int(i64),
    Float(f64),
    Text(String),
}

// ---------------------------------------------------------------------------------------------
// Field parsers

impl RawNumber {
    /// How the value looked in the TOML, for error messages.
    fn shown(&self) -> String {
        match self {
            RawNumber::Int(i) => i.to_string(),
            RawNumber::Float(f) => f.to_string(),
            RawNumber::Text(s) => format!("{s:?}"),
        }
    }

    /// A percentage: a bare number means percent (`25` is 25%).
    fn percent(&self, field: String, min: Percent) -> Result<Percent, SpecError> {
        let parsed = match self {
            RawNumber::Int(i) => u32::try_from(*i)
                .ok()
                .and_then(|i| i.checked_mul(100))
                .and_then(Percent::from_basis_points),
            RawNumber::Float(f) => {
                let bp = (f * 100.0).round();
                // Only accept floats that are exactly representable in hundredths.
                (f.is_finite() && (0.0..=10_000.0).contains(&bp) && ((f * 100.0) - bp).abs() < 1e-6)
                    .then(|| Percent::from_basis_points(bp as u32))
                    .flatten()
            }
            RawNumber::Text(s) => Percent::parse_text(s),
        };
        match parsed {
            Some(p) if p >= min => Ok(p),
            _ => Err(SpecError::Percent {
                field,
                value: self.shown(),
                range: if min == Percent::ZERO {
                    "from 0% to 100%"
                } else {
                    "above 0% and at most 100%"
                },
            }),
        }
    }

    /// A number of devices (`10`, `"10"`) or a percentage (`"10%"`), as Fleet and KubeFleet
    /// write `maxUnavailable`. `min` is the smallest count or share accepted.
    fn budget(&self, field: String, min: usize) -> Result<Budget, SpecError> {
        let parsed = match self {
            RawNumber::Int(i) => usize::try_from(*i).ok().map(Budget::Count),
            RawNumber::Float(_) => None,
            RawNumber::Text(s) if s.trim_end().ends_with('%') => {
                Percent::parse_text(s).map(Budget::Percent)
            }
            RawNumber::Text(s) => s.trim().parse::<usize>().ok().map(Budget::Count),
        };
        let ok = match parsed {
            Some(Budget::Count(n)) => n >= min,
            Some(Budget::Percent(p)) => min == 0 || p > Percent::ZERO,
            None => false,
        };
        match parsed {
            Some(b) if ok => Ok(b),
            _ => Err(SpecError::Value {
                field,
                value: self.shown(),
                expected: if min == 0 {
                    "a number of devices or a percentage from 0% to 100%".into()
                } else {
                    format!("a number of devices (at least {min}) or a percentage above 0%")
                },
            }),
        }
    }
}

fn selector(field: &str, text: Option<&str>) -> Result<Selector, SpecError> {
    match text {
        None => Ok(Selector::everything()),
        Some(t) => Selector::parse(t).map_err(|source| SpecError::Selector {
            field: field.to_owned(),
            source,
        }),
    }
}

fn id(what: &'static str, field: String, value: &str) -> Result<(), SpecError> {
    flotilla_protocol::validate_id(what, value).map_err(|source| SpecError::Id { field, source })
}

/// An integer in `range`, e.g. `max_new` at least 1.
fn integer(
    field: &str,
    value: i64,
    range: std::ops::RangeInclusive<i64>,
    expected: &str,
) -> Result<i64, SpecError> {
    if range.contains(&value) {
        Ok(value)
    } else {
        Err(SpecError::Value {
            field: field.to_owned(),
            value: value.to_string(),
            expected: expected.to_owned(),
        })
    }
}

/// A count of devices, at least `min`.
fn count(field: &str, value: i64, min: usize) -> Result<usize, SpecError> {
    let n = integer(
        field,
        value,
        min as i64..=i64::MAX,
        &format!("at least {min}"),
    )?;
    usize::try_from(n).map_err(|_| SpecError::Value {
        field: field.to_owned(),
        value: value.to_string(),
        expected: "a device count this machine can hold".into(),
    })
}

/// Seconds: a duration like `"30m"` (see [`parse_duration`]) or an integer of seconds.
fn duration(field: &str, value: &toml::Value) -> Result<u64, SpecError> {
    let err = |reason: String| SpecError::Duration {
        field: field.to_owned(),
        value: value.to_string(),
        reason,
    };
    match value {
        toml::Value::Integer(i) => {
            u64::try_from(*i).map_err(|_| err("a duration cannot be negative".into()))
        }
        toml::Value::String(s) => parse_duration(s).map_err(err),
        _ => Err(err(
            "expected a string like \"30m\" or a number of seconds".into()
        )),
    }
}

/// Unix seconds: RFC 3339 text (or a TOML datetime with an offset), or an integer.
fn time(field: &str, value: &toml::Value) -> Result<u64, SpecError> {
    let parsed = match value {
        toml::Value::Integer(i) => u64::try_from(*i).ok(),
        toml::Value::String(s) => rfc3339(s),
        toml::Value::Datetime(d) => rfc3339(&d.to_string()),
        _ => None,
    };
    parsed.ok_or_else(|| SpecError::Time {
        field: field.to_owned(),
        value: value.to_string(),
    })
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.frac](Z|+hh:mm|-hh:mm)` to Unix seconds (fractions dropped).
///
/// jiff reads the text; it accepts a superset of RFC 3339 (ISO 8601 and Temporal forms such as
/// `20261122T020000Z`, a missing seconds field, or a `[zone]` suffix), so the RFC's shape is
/// checked first: seconds present and the offset written as `Z` or `±hh:mm` at the end.
pub fn rfc3339(text: &str) -> Option<u64> {
    let text = text.trim();
    let b = text.as_bytes();
    let at = |i: usize, allowed: &[u8]| b.get(i).is_some_and(|c| allowed.contains(c));
    let shaped = at(4, b"-") && at(7, b"-") && at(10, b"Tt ") && at(13, b":") && at(16, b":");
    let offset = matches!(b.last(), Some(b'Z' | b'z'))
        || (b.len() >= 6 && at(b.len() - 6, b"+-") && at(b.len() - 3, b":"));
    if !shaped || !offset || b.len() < 20 {
        return None;
    }
    let stamp: jiff::Timestamp = text.parse().ok()?;
    if stamp.subsec_nanosecond() < 0 {
        // Before 1970 by a fraction of a second.
        return None;
    }
    u64::try_from(stamp.as_second()).ok()
}

fn enumerated<T: Copy>(
    field: String,
    value: &str,
    options: &[(&str, T)],
    allowed: &'static str,
) -> Result<T, SpecError> {
    options
        .iter()
        .find(|(name, _)| *name == value)
        .map(|(_, v)| *v)
        .ok_or_else(|| SpecError::Action {
            field,
            value: value.to_owned(),
            allowed,
        })
}

impl RawSuccess {
    fn success(
        &self,
        field: &str,
        default: &SuccessCondition,
    ) -> Result<SuccessCondition, SpecError> {
        let threshold = match &self.threshold {
            Some(t) => Threshold::Share(t.percent(format!("{field}.threshold"), Percent::ZERO)?),
            None => default.threshold,
        };
        let action = match self.action.as_deref() {
            None => default.action,
            Some(a) => enumerated(
                format!("{field}.action"),
                a,
                &[
                    ("next", SuccessAction::Next),
                    ("pause", SuccessAction::Pause),
                ],
                "\"next\", \"pause\"",
            )?,
        };
        Ok(SuccessCondition { threshold, action })
    }
}

impl RawError {
    fn error(&self, field: &str) -> Result<ErrorCondition, SpecError> {
        let at_least = self
            .count
            .map(|c| count(&format!("{field}.count"), c, 1))
            .transpose()?;
        // Without a threshold or a count the condition fires on the first failure (0%); with
        // only a count, the count alone decides.
        let percent = match (&self.threshold, at_least) {
            (Some(t), _) => Some(t.percent(format!("{field}.threshold"), Percent::ZERO)?),
            (None, Some(_)) => None,
            (None, None) => Some(Percent::ZERO),
        };
        let min_sample = self
            .min_sample
            .map(|m| count(&format!("{field}.min_sample"), m, 0))
            .transpose()?
            .unwrap_or(0);
        let classes = match &self.classes {
            None => FailureClasses::default(),
            Some(list) => {
                if list.is_empty() {
                    return Err(SpecError::Value {
                        field: format!("{field}.classes"),
                        value: "[]".into(),
                        expected:
                            "a list naming at least one of \"failed\", \"timed_out\", \"refused\""
                                .into(),
                    });
                }
                let mut c = FailureClasses {
                    failed: false,
                    timed_out: false,
                    refused: false,
                };
                for (i, class) in list.iter().enumerate() {
                    match enumerated(
                        format!("{field}.classes[{i}]"),
                        class,
                        &[("failed", 0), ("timed_out", 1), ("refused", 2)],
                        "\"failed\", \"timed_out\", \"refused\"",
                    )? {
                        0 => c.failed = true,
                        1 => c.timed_out = true,
                        _ => c.refused = true,
                    }
                }
                c
            }
        };
        let action = match self.action.as_deref() {
            None => ErrorAction::Pause,
            Some(a) => enumerated(
                format!("{field}.action"),
                a,
                &[
                    ("pause", ErrorAction::Pause),
                    ("stop", ErrorAction::Stop),
                    ("rollback", ErrorAction::Rollback),
                ],
                "\"pause\", \"stop\", \"rollback\"",
            )?,
        };
        Ok(ErrorCondition {
            percent,
            count: at_least,
            min_sample,
            classes,
            action,
        })
    }
}

impl RawSites {
    /// The site policy of vocabulary `table` (`groups`, `partitions`, `rolling`, `staged`).
    fn validate(&self, table: &str) -> Result<SitePolicy, SpecError> {
        let busy_key = SITE_BUSY_KEYS
            .iter()
            .find(|(t, _)| *t == table)
            .map_or("max_busy", |(_, k)| *k);
        let field = |key: &str| format!("{table}.sites.{key}");
        let label = self.label.as_deref().ok_or_else(|| SpecError::Requires {
            field: format!("{table}.sites"),
            value: "{ ... }".into(),
            needs:
                "label, the device label whose value names a device's site (e.g. label = \"site\")",
        })?;
        if label.is_empty() || !label.chars().all(crate::selector::is_word_char) {
            return Err(SpecError::Value {
                field: field("label"),
                value: format!("{label:?}"),
                expected: "a label key (letters, digits, '.', '_', '-', '/', ':')".into(),
            });
        }
        let mut max_busy = None;
        for (key, value) in [
            ("max_running", self.max_running),
            ("max_busy", self.max_busy),
            ("max_concurrency", self.max_concurrency),
        ] {
            let Some(v) = value else { continue };
            if key != busy_key {
                return Err(SpecError::Value {
                    field: field(key),
                    value: v.to_string(),
                    expected: format!(
                        "a key of [{table}.sites]; this vocabulary calls it {busy_key}"
                    ),
                });
            }
            max_busy = Some(count(&field(key), v, 1)?);
        }
        let max_unavailable = self
            .max_unavailable
            .map(|v| count(&field("max_unavailable"), v, 1))
            .transpose()?;
        let peers = self.peers.unwrap_or(false);
        let seed_wait = match &self.seed_wait {
            Some(v) => {
                if !peers {
                    return Err(SpecError::NotApplicable {
                        field: field("seed_wait"),
                        value: v.to_string(),
                        why: "seed_wait is only used with peers = true",
                    });
                }
                let secs = duration(&field("seed_wait"), v)?;
                if secs == 0 {
                    return Err(SpecError::Duration {
                        field: field("seed_wait"),
                        value: v.to_string(),
                        reason: "must be longer than 0s: the seed needs time to fetch".into(),
                    });
                }
                secs
            }
            None => DEFAULT_SEED_WAIT,
        };
        if max_busy.is_none() && max_unavailable.is_none() && !peers {
            return Err(SpecError::Requires {
                field: format!("{table}.sites.label"),
                value: format!("{label:?}"),
                needs: "a limit or peer sharing: max_unavailable, the busy limit of this vocabulary, or peers = true",
            });
        }
        Ok(SitePolicy {
            label: label.to_owned(),
            max_busy,
            max_unavailable,
            peers,
            seed_wait,
        })
    }
}

fn error_condition(
    field: &str,
    raw: Option<&RawError>,
) -> Result<Option<ErrorCondition>, SpecError> {
    raw.map(|e| e.error(field)).transpose()
}

// ---------------------------------------------------------------------------------------------
// Validation

impl RawSpec {
    fn validate(self, zones: &dyn ZoneSource) -> Result<RolloutSpec, SpecError> {
        id("rollout name", "name".into(), &self.name)?;
        id("release name", "release".into(), &self.release)?;
        let select = selector("select", self.select.as_deref())?;
        let mut policies = self.policies(zones)?;

        let mut found = Vec::new();
        for (name, present) in [
            ("[groups]", self.groups.is_some()),
            ("[partitions]", self.partitions.is_some()),
            ("[rolling]", self.rolling.is_some()),
            ("[staged]", self.staged.is_some()),
        ] {
            if present {
                found.push(name);
            }
        }
        if found.len() != 1 {
            return Err(SpecError::Vocabulary {
                found: if found.is_empty() {
                    "none".into()
                } else {
                    found.join(" and ")
                },
            });
        }
        let sites = [
            (
                "groups",
                self.groups.as_ref().and_then(|g| g.sites.as_ref()),
            ),
            (
                "partitions",
                self.partitions.as_ref().and_then(|p| p.sites.as_ref()),
            ),
            (
                "rolling",
                self.rolling.as_ref().and_then(|r| r.sites.as_ref()),
            ),
            (
                "staged",
                self.staged.as_ref().and_then(|s| s.sites.as_ref()),
            ),
        ];
        if let Some((table, raw)) = sites.iter().find_map(|(t, r)| r.map(|r| (t, r))) {
            policies.sites = Some(raw.validate(table)?);
        }
        let strategy = if let Some(g) = self.groups {
            policies.dynamic = g.dynamic.unwrap_or(false);
            Strategy::Groups(g.validate()?)
        } else if let Some(p) = self.partitions {
            let (spec, max_unavailable_partitions) = p.validate()?;
            policies.max_unavailable_groups = max_unavailable_partitions;
            Strategy::Partitions(spec)
        } else if let Some(r) = self.rolling {
            match (&r.unavailable_period, &self.unavailable_period) {
                (Some(inner), Some(_)) => {
                    return Err(SpecError::NotApplicable {
                        field: "rolling.unavailable_period".into(),
                        value: inner.to_string(),
                        why: "unavailable_period is also set at the top level; set it in one place",
                    })
                }
                (Some(inner), None) => {
                    policies.unavailable_period = duration("rolling.unavailable_period", inner)?
                }
                (None, Some(_)) => {}
                (None, None) => policies.unavailable_period = DEFAULT_ROLLING_UNAVAILABLE_PERIOD,
            }
            Strategy::Rolling(r.validate()?)
        } else if let Some(s) = self.staged {
            Strategy::Staged(s.validate()?)
        } else {
            return Err(SpecError::Vocabulary {
                found: "none".into(),
            });
        };
        Ok(RolloutSpec {
            name: self.name,
            release: self.release,
            select,
            strategy,
            policies,
        })
    }

    /// The rollout-wide policies from the top-level keys.
    fn policies(&self, zones: &dyn ZoneSource) -> Result<Policies, SpecError> {
        let mut p = Policies::default();
        let force_at = self
            .force_at
            .as_ref()
            .map(|v| time("force_at", v))
            .transpose()?;
        p.action = match self.action.as_deref() {
            None | Some("forced") => ActionType::Forced,
            Some("soft") => ActionType::Soft,
            Some("download_only") => ActionType::DownloadOnly,
            Some("time_forced") => ActionType::TimeForced {
                at: force_at.ok_or(SpecError::Requires {
                    field: "action".into(),
                    value: "\"time_forced\"".into(),
                    needs: "force_at, the time after which the action is forced",
                })?,
            },
            Some(other) => {
                return Err(SpecError::Action {
                    field: "action".into(),
                    value: other.to_owned(),
                    allowed: "\"forced\", \"soft\", \"download_only\", \"time_forced\"",
                })
            }
        };
        if let (Some(v), false) = (
            &self.force_at,
            matches!(p.action, ActionType::TimeForced { .. }),
        ) {
            return Err(SpecError::NotApplicable {
                field: "force_at".into(),
                value: v.to_string(),
                why: "force_at is only used with action = \"time_forced\"",
            });
        }
        p.start_at = self
            .start_at
            .as_ref()
            .map(|v| time("start_at", v))
            .transpose()?;
        if let Some(w) = self.weight {
            p.weight = integer(
                "weight",
                w,
                0..=i64::from(MAX_WEIGHT),
                &format!("from 0 to {MAX_WEIGHT}"),
            )? as u32;
        } else {
            p.weight = DEFAULT_WEIGHT;
        }
        if let Some(t) = &self.timeout {
            let secs = duration("timeout", t)?;
            if secs == 0 {
                return Err(SpecError::Duration {
                    field: "timeout".into(),
                    value: t.to_string(),
                    reason: "a timeout must be longer than 0s; leave it out to wait forever".into(),
                });
            }
            p.timeout = Some(secs);
        }
        if let Some(r) = &self.retry {
            let attempts = integer("retry.attempts", r.attempts, 0..=100, "from 0 to 100")? as u32;
            let backoff = match &r.backoff {
                Some(b) => duration("retry.backoff", b)?,
                None => DEFAULT_RETRY_BACKOFF,
            };
            p.retry = Some(Retry { attempts, backoff });
        }
        if let Some(o) = &self.offline {
            p.offline = offline(o)?;
        }
        if let Some(r) = &self.rate {
            p.rate = Some(r.validate()?);
        }
        if let Some(s) = &self.soak {
            p.soak = duration("soak", s)?;
        }
        if let Some(u) = &self.unavailable_period {
            p.unavailable_period = duration("unavailable_period", u)?;
        }
        if let Some(u) = &self.unknown_devices {
            p.unknown_devices = enumerated(
                "unknown_devices".into(),
                u,
                &[
                    ("exclude", UnknownDevices::Exclude),
                    ("refuse", UnknownDevices::Refuse),
                ],
                "\"exclude\", \"refuse\"",
            )?;
        }
        for (i, w) in self.window.iter().enumerate() {
            p.windows.push(w.validate(&format!("window[{i}]"), zones)?);
        }
        Ok(p)
    }
}

fn offline(value: &toml::Value) -> Result<OfflinePolicy, SpecError> {
    match value {
        toml::Value::String(s) => enumerated(
            "offline".into(),
            s,
            &[("wait", OfflinePolicy::Wait), ("skip", OfflinePolicy::Skip)],
            "\"wait\", \"skip\", { fail_after = \"10m\" }",
        ),
        toml::Value::Table(t) if t.len() == 1 && t.contains_key("fail_after") => {
            let grace = t
                .get("fail_after")
                .map(|v| duration("offline.fail_after", v))
                .transpose()?
                .unwrap_or(0);
            Ok(OfflinePolicy::Fail { grace })
        }
        other => Err(SpecError::Value {
            field: "offline".into(),
            value: other.to_string(),
            expected: "\"wait\", \"skip\" or { fail_after = \"10m\" }".into(),
        }),
    }
}

/// A devices-per-minute figure: an integer or a float.
fn rate_number(
    field: &str,
    value: &toml::Value,
    min: f64,
    expected: &str,
) -> Result<f64, SpecError> {
    let n = match value {
        toml::Value::Integer(i) => Some(*i as f64),
        toml::Value::Float(f) if f.is_finite() => Some(*f),
        _ => None,
    };
    match n {
        Some(n) if n >= min && (min > 0.0 || n > 0.0) => Ok(n),
        _ => Err(SpecError::Value {
            field: field.to_owned(),
            value: value.to_string(),
            expected: expected.to_owned(),
        }),
    }
}

impl RawRate {
    fn validate(&self) -> Result<RateLimit, SpecError> {
        let base = rate_number(
            "rate.base",
            &self.base,
            0.0,
            "a number of devices per minute above 0",
        )?;
        let factor = match &self.factor {
            Some(f) => rate_number("rate.factor", f, 1.0, "a factor of at least 1")?,
            None => 2.0,
        };
        let every = match self.every {
            Some(e) => integer("rate.every", e, 1..=i64::from(u32::MAX), "at least 1")? as u32,
            None => 10,
        };
        let max = match &self.max {
            Some(m) => {
                let expected =
                    format!("a number of devices per minute of at least rate.base ({base})");
                Some(rate_number("rate.max", m, base, &expected)?)
            }
            None => None,
        };
        Ok(RateLimit {
            base,
            factor,
            every,
            max,
        })
    }
}

impl RawWindow {
    fn validate(&self, field: &str, zones: &dyn ZoneSource) -> Result<WindowSpec, SpecError> {
        let duration_secs = duration(&format!("{field}.duration"), &self.duration)?;
        if duration_secs == 0 {
            return Err(SpecError::Duration {
                field: format!("{field}.duration"),
                value: self.duration.to_string(),
                reason: "a window must stay open longer than 0s".into(),
            });
        }
        let spec = WindowSpec {
            cron: self.cron.clone(),
            duration: duration_secs,
            tz: self.tz.clone().unwrap_or_else(|| "UTC".into()),
        };
        Window::parse(&spec, zones).map_err(|e| SpecError::Window {
            field: field.to_owned(),
            cron: spec.cron.clone(),
            tz: spec.tz.clone(),
            reason: e.to_string(),
        })?;
        Ok(spec)
    }
}

impl RawGroups {
    fn validate(self) -> Result<GroupsSpec, SpecError> {
        let success = match &self.success {
            Some(c) => c.success("groups.success", &SuccessCondition::default())?,
            None => SuccessCondition::default(),
        };
        let error = error_condition("groups.error", self.error.as_ref())?;
        match (self.count, self.group.is_empty()) {
            (Some(_), false) => Err(SpecError::CountAndList),
            (None, true) => Err(SpecError::NoGroups),
            (Some(count), true) => {
                let count = u32::try_from(count)
                    .ok()
                    .filter(|c| (1..=MAX_GROUPS).contains(c))
                    .ok_or(SpecError::Count { value: count })?;
                Ok(GroupsSpec::Count {
                    count,
                    success,
                    error,
                })
            }
            (None, false) => {
                if self.group.len() > MAX_GROUPS as usize {
                    return Err(SpecError::TooManyGroups {
                        field: "groups.group".into(),
                        count: self.group.len(),
                    });
                }
                let mut list: Vec<GroupSpec> = Vec::with_capacity(self.group.len());
                for (i, raw) in self.group.into_iter().enumerate() {
                    let field = format!("groups.group[{i}]");
                    let name = raw.name.unwrap_or_else(|| format!("group-{}", i + 1));
                    id("group name", format!("{field}.name"), &name)?;
                    if let Some(first) = list.iter().position(|g| g.name == name) {
                        return Err(SpecError::Duplicate {
                            field: format!("{field}.name"),
                            what: "group name",
                            name,
                            first: format!("groups.group[{first}]"),
                        });
                    }
                    let select = selector(&format!("{field}.select"), raw.select.as_deref())?;
                    let percent = match &raw.percent {
                        Some(p) => p.percent(
                            format!("{field}.percent"),
                            Percent::from_basis_points(1).unwrap_or(Percent::HUNDRED),
                        )?,
                        None => Percent::HUNDRED,
                    };
                    let success = match &raw.success {
                        Some(c) => c.success(&format!("{field}.success"), &success)?,
                        None => success.clone(),
                    };
                    let error = match &raw.error {
                        Some(c) => Some(c.error(&format!("{field}.error"))?),
                        None => error.clone(),
                    };
                    list.push(GroupSpec {
                        name,
                        select,
                        percent,
                        success,
                        error,
                    });
                }
                Ok(GroupsSpec::List(list))
            }
        }
    }
}

impl RawPartitions {
    /// The spec, and `max_unavailable_partitions` for the policies.
    fn validate(self) -> Result<(PartitionsSpec, Budget), SpecError> {
        let max_unavailable = match &self.max_unavailable {
            Some(b) => b.budget("partitions.max_unavailable".into(), 0)?,
            None => Budget::Percent(Percent::HUNDRED),
        };
        let max_unavailable_partitions = match &self.max_unavailable_partitions {
            Some(b) => b.budget("partitions.max_unavailable_partitions".into(), 0)?,
            None => Budget::Count(0),
        };
        let auto_partition_size = match &self.auto_partition_size {
            Some(b) => b.budget("partitions.auto_partition_size".into(), 1)?,
            None => Budget::Percent(Percent::from_basis_points(2_500).unwrap_or(Percent::HUNDRED)),
        };
        let auto_partition_threshold = match self.auto_partition_threshold {
            Some(t) => count("partitions.auto_partition_threshold", t, 0)?,
            None => DEFAULT_AUTO_PARTITION_THRESHOLD,
        };
        let max_new = match self.max_new {
            Some(m) => count("partitions.max_new", m, 1)?,
            None => DEFAULT_MAX_NEW,
        };
        let error = error_condition("partitions.error", self.error.as_ref())?;
        if self.partition.len() > MAX_GROUPS as usize {
            return Err(SpecError::TooManyGroups {
                field: "partitions.partition".into(),
                count: self.partition.len(),
            });
        }
        let mut partitions: Vec<PartitionSpec> = Vec::with_capacity(self.partition.len());
        for (i, raw) in self.partition.into_iter().enumerate() {
            let field = format!("partitions.partition[{i}]");
            let name = raw.name.unwrap_or_else(|| format!("partition-{}", i + 1));
            id("partition name", format!("{field}.name"), &name)?;
            if let Some(first) = partitions.iter().position(|p| p.name == name) {
                return Err(SpecError::Duplicate {
                    field: format!("{field}.name"),
                    what: "partition name",
                    name,
                    first: format!("partitions.partition[{first}]"),
                });
            }
            let own_budget = match &raw.max_unavailable {
                Some(b) => b.budget(format!("{field}.max_unavailable"), 0)?,
                None => max_unavailable,
            };
            let mut set = Vec::new();
            for (key, present) in [
                ("devices", raw.devices.is_some()),
                ("select", raw.select.is_some()),
                ("group", raw.group.is_some()),
                ("group_select", raw.group_select.is_some()),
            ] {
                if present {
                    set.push(key);
                }
            }
            if set.len() != 1 {
                return Err(SpecError::OneOf {
                    field,
                    keys: "devices, select, group, group_select",
                    found: if set.is_empty() {
                        "none".into()
                    } else {
                        set.join(" and ")
                    },
                });
            }
            let members = if let Some(devices) = raw.devices {
                PartitionMembers::Devices(device_list(&format!("{field}.devices"), devices)?)
            } else if let Some(s) = raw.select {
                PartitionMembers::Select(selector(&format!("{field}.select"), Some(&s))?)
            } else if let Some(g) = raw.group {
                id("device group name", format!("{field}.group"), &g)?;
                PartitionMembers::Group(g)
            } else {
                let s = raw.group_select.unwrap_or_default();
                PartitionMembers::GroupSelect(selector(&format!("{field}.group_select"), Some(&s))?)
            };
            partitions.push(PartitionSpec {
                name,
                max_unavailable: own_budget,
                members,
            });
        }
        Ok((
            PartitionsSpec {
                max_unavailable,
                auto_partition_size,
                auto_partition_threshold,
                max_new,
                partitions,
                error,
            },
            max_unavailable_partitions,
        ))
    }
}

/// A non-empty list of valid device ids, each listed once.
fn device_list(field: &str, devices: Vec<String>) -> Result<Vec<String>, SpecError> {
    if devices.is_empty() {
        return Err(SpecError::Value {
            field: field.to_owned(),
            value: "[]".into(),
            expected: "a list of at least one device id".into(),
        });
    }
    for (i, d) in devices.iter().enumerate() {
        id("device id", format!("{field}[{i}]"), d)?;
        if let Some(first) = devices[..i].iter().position(|e| e == d) {
            return Err(SpecError::Duplicate {
                field: format!("{field}[{i}]"),
                what: "device",
                name: d.clone(),
                first: format!("{field}[{first}]"),
            });
        }
    }
    Ok(devices)
}

impl RawRolling {
    fn validate(self) -> Result<RollingSpec, SpecError> {
        if let Some(surge) = &self.max_surge {
            return Err(SpecError::NotApplicable {
                field: "rolling.max_surge".into(),
                value: surge.to_string(),
                why: "flotilla updates devices in place: a device cannot run two releases side by \
                      side and there is no spare device to surge onto; use max_unavailable to \
                      set how many devices update at once",
            });
        }
        let max_unavailable = match &self.max_unavailable {
            Some(b) => b.budget("rolling.max_unavailable".into(), 1)?,
            None => Budget::Percent(Percent::from_basis_points(2_500).unwrap_or(Percent::HUNDRED)),
        };
        let pick = match &self.pick {
            None => Pick::All,
            Some(v) => pick(v)?,
        };
        let error = error_condition("rolling.error", self.error.as_ref())?;
        Ok(RollingSpec {
            max_unavailable,
            pick,
            error,
        })
    }
}

fn pick(value: &toml::Value) -> Result<Pick, SpecError> {
    let wrong = || SpecError::Value {
        field: "rolling.pick".into(),
        value: value.to_string(),
        expected: "\"all\", { n = 3 } or { fixed = [\"dev-1\", \"dev-2\"] }".into(),
    };
    match value {
        toml::Value::String(s) if s == "all" => Ok(Pick::All),
        toml::Value::Table(t) if t.len() == 1 => match (t.get("n"), t.get("fixed")) {
            (Some(toml::Value::Integer(n)), None) => Ok(Pick::N(count("rolling.pick.n", *n, 1)?)),
            (Some(other), None) => Err(SpecError::Value {
                field: "rolling.pick.n".into(),
                value: other.to_string(),
                expected: "a number of devices (at least 1)".into(),
            }),
            (None, Some(toml::Value::Array(list))) => {
                let mut ids = Vec::with_capacity(list.len());
                for (i, v) in list.iter().enumerate() {
                    match v {
                        toml::Value::String(s) => ids.push(s.clone()),
                        other => {
                            return Err(SpecError::Value {
                                field: format!("rolling.pick.fixed[{i}]"),
                                value: other.to_string(),
                                expected: "a device id".into(),
                            })
                        }
                    }
                }
                Ok(Pick::Fixed(device_list("rolling.pick.fixed", ids)?))
            }
            _ => Err(wrong()),
        },
        _ => Err(wrong()),
    }
}

impl RawStaged {
    fn validate(self) -> Result<StagedSpec, SpecError> {
        let error = match &self.error {
            Some(e) => e.error("staged.error")?,
            // A failed device fails the run, as in KubeFleet.
            None => ErrorCondition {
                action: ErrorAction::Stop,
                ..ErrorCondition::default()
            },
        };
        let stages = match (self.strategy, self.stage.is_empty()) {
            (Some(name), true) => {
                id("strategy name", "staged.strategy".into(), &name)?;
                return Ok(StagedSpec {
                    strategy: Some(name),
                    stages: None,
                    error,
                });
            }
            (Some(_), false) => {
                return Err(SpecError::OneOf {
                    field: "staged".into(),
                    keys: "strategy, [[staged.stage]]",
                    found: "strategy and [[staged.stage]]".into(),
                })
            }
            (None, true) => {
                return Err(SpecError::OneOf {
                    field: "staged".into(),
                    keys: "strategy, [[staged.stage]]",
                    found: "none".into(),
                })
            }
            (None, false) => stages("staged.stage", self.stage)?,
        };
        Ok(StagedSpec {
            strategy: None,
            stages: Some(stages),
            error,
        })
    }
}

fn stages(field: &str, raw: Vec<RawStage>) -> Result<Vec<StageSpec>, SpecError> {
    if raw.len() > MAX_GROUPS as usize {
        return Err(SpecError::TooManyGroups {
            field: field.to_owned(),
            count: raw.len(),
        });
    }
    let mut out: Vec<StageSpec> = Vec::with_capacity(raw.len());
    for (i, s) in raw.into_iter().enumerate() {
        let f = format!("{field}[{i}]");
        id("stage name", format!("{f}.name"), &s.name)?;
        if let Some(first) = out.iter().position(|o| o.name == s.name) {
            return Err(SpecError::Duplicate {
                field: format!("{f}.name"),
                what: "stage name",
                name: s.name,
                first: format!("{field}[{first}]"),
            });
        }
        let select = selector(&format!("{f}.select"), s.select.as_deref())?;
        let sort_by = match s.sort_by {
            Some(label) if label.trim().is_empty() || label.contains(char::is_whitespace) => {
                return Err(SpecError::Value {
                    field: format!("{f}.sort_by"),
                    value: format!("{label:?}"),
                    expected: "a label key".into(),
                })
            }
            other => other,
        };
        let max_concurrency = match s.max_concurrency {
            Some(m) => count(&format!("{f}.max_concurrency"), m, 1)?,
            None => 1,
        };
        let before = match &s.before {
            None => Gate::default(),
            Some(g) => {
                if let Some(w) = &g.wait {
                    return Err(SpecError::NotApplicable {
                        field: format!("{f}.before.wait"),
                        value: w.to_string(),
                        why: "a stage cannot wait before it starts; put the wait in the previous \
                              stage's after",
                    });
                }
                Gate {
                    approval: g.approval.unwrap_or(false),
                    wait: 0,
                }
            }
        };
        let after = match &s.after {
            None => Gate::default(),
            Some(g) => Gate {
                approval: g.approval.unwrap_or(false),
                wait: g
                    .wait
                    .as_ref()
                    .map(|w| duration(&format!("{f}.after.wait"), w))
                    .transpose()?
                    .unwrap_or(0),
            },
        };
        out.push(StageSpec {
            name: s.name,
            select,
            sort_by,
            max_concurrency,
            before,
            after,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{ActionType, FailureClasses, OfflinePolicy, RateLimit, Retry};
    use crate::zoneinfo::SystemZones;

    fn parse(text: &str) -> RolloutSpec {
        RolloutSpec::from_toml(text, &SystemZones)
            .unwrap_or_else(|e| panic!("spec should parse: {e}\n{text}"))
    }

    fn error(text: &str) -> String {
        match RolloutSpec::from_toml(text, &SystemZones) {
            Ok(spec) => panic!("spec should be refused, got {spec:?}"),
            Err(e) => e.to_string(),
        }
    }

    const FULL: &str = r#"
name = "fw-2-4"
release = "fw-2.4.0"
select = "hw=pi4"
[groups]
success = { threshold = "90%", action = "next" }
error = { threshold = "20%", action = "pause" }
[[groups.group]]
name = "canary"
select = "env=canary"
percent = 50
success = { threshold = 100, action = "pause" }
[[groups.group]]
error = { threshold = "12.5%" }
"#;

    #[test]
    fn full_spec_applies_defaults_and_overrides() {
        let spec = parse(FULL);
        assert_eq!(spec.name, "fw-2-4");
        assert_eq!(spec.release, "fw-2.4.0");
        assert_eq!(spec.select.to_string(), "hw=pi4");
        let Some(GroupsSpec::List(groups)) = spec.groups() else {
            panic!("expected a group list")
        };
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].name, "canary");
        assert_eq!(groups[0].select.to_string(), "env=canary");
        assert_eq!(groups[0].percent.to_string(), "50%");
        assert_eq!(
            groups[0].success,
            SuccessCondition {
                threshold: Threshold::Share(Percent::HUNDRED),
                action: SuccessAction::Pause
            }
        );
        assert_eq!(
            groups[0]
                .error
                .as_ref()
                .map(|e| e.percent.map(|p| p.to_string()).unwrap_or_default()),
            Some("20%".into())
        );
        // The second group takes the defaults from [groups] and its own error override.
        assert_eq!(groups[1].name, "group-2");
        assert!(groups[1].select.is_everything());
        assert_eq!(groups[1].percent, Percent::HUNDRED);
        assert_eq!(
            groups[1].success.threshold,
            Threshold::Share(Percent::from_basis_points(9000).expect("90%"))
        );
        assert_eq!(groups[1].success.action, SuccessAction::Next);
        assert_eq!(
            groups[1]
                .error
                .as_ref()
                .map(|e| e.percent.map(|p| p.to_string()).unwrap_or_default()),
            Some("12.5%".into())
        );
    }

    #[test]
    fn count_spec_and_defaults() {
        let spec = parse("name = \"r1\"\nrelease = \"rel\"\n[groups]\ncount = 3\n");
        assert!(spec.select.is_everything());
        assert_eq!(
            spec.groups(),
            Some(&GroupsSpec::Count {
                count: 3,
                success: SuccessCondition::default(),
                error: None
            })
        );
        assert_eq!(spec.vocabulary(), "groups");
        assert_eq!(spec.policies, Policies::default());
    }

    #[test]
    fn validated_spec_round_trips_through_json() {
        let spec = parse(FULL);
        let json = serde_json::to_string(&spec).expect("encodes");
        let back: RolloutSpec = serde_json::from_str(&json).expect("decodes");
        assert_eq!(back, spec);
    }

    #[test]
    fn thresholds_accept_percent_strings_and_numbers() {
        for (text, want) in [
            ("\"25%\"", "25%"),
            ("25", "25%"),
            ("\"12.5%\"", "12.5%"),
            ("12.25", "12.25%"),
            ("0", "0%"),
            ("\"100 %\"", "100%"),
        ] {
            let spec = parse(&format!(
                "name = \"r\"\nrelease = \"x\"\n[groups]\ncount = 1\nsuccess = {{ threshold = {text} }}\n"
            ));
            let Some(GroupsSpec::Count { success, .. }) = spec.groups() else {
                panic!("count spec")
            };
            let Threshold::Share(share) = success.threshold else {
                panic!("share threshold")
            };
            assert_eq!(share.to_string(), want, "{text}");
        }
    }

    #[test]
    fn errors_name_the_field_and_value() {
        let base = "name = \"r\"\nrelease = \"x\"\n";
        let cases: &[(&str, &str)] = &[
            (
                "[groups]\ncount = 1\nsuccess = { threshold = \"120%\" }\n",
                "groups.success.threshold: \"120%\" is not a percentage from 0% to 100%",
            ),
            (
                "[groups]\n[[groups.group]]\npercent = 50\n[[groups.group]]\npercent = 0\n",
                "groups.group[1].percent: 0 is not a percentage above 0% and at most 100%",
            ),
            (
                "[groups]\ncount = 1\nerror = { threshold = -5 }\n",
                "groups.error.threshold: -5 is not",
            ),
            (
                "[groups]\ncount = 1\nerror = { threshold = \"abc\" }\n",
                "groups.error.threshold: \"abc\" is not",
            ),
            (
                "[groups]\ncount = 1\nerror = { action = \"explode\" }\n",
                "groups.error.action: \"explode\" is not one of \"pause\", \"stop\", \"rollback\"",
            ),
            (
                "[groups]\ncount = 1\nsuccess = { action = \"go\" }\n",
                "groups.success.action: \"go\" is not one of",
            ),
            (
                "[groups]\ncount = 0\n",
                "groups.count: 0 is not from 1 to 1000",
            ),
            ("[groups]\ncount = 5000\n", "groups.count: 5000"),
            ("[groups]\n", "set `count` or at least one"),
            (
                "[groups]\ncount = 2\n[[groups.group]]\nname = \"a\"\n",
                "either `count` or",
            ),
            (
                "select = \"env in ()\"\n[groups]\ncount = 1\n",
                "select: selector \"env in ()\"",
            ),
            (
                "[groups]\n[[groups.group]]\nselect = \"env=\"\n",
                "groups.group[0].select: selector \"env=\": expected a label value at position 4",
            ),
            (
                "[groups]\n[[groups.group]]\nname = \"a b\"\n",
                "groups.group[0].name: group name \"a b\"",
            ),
            (
                "[groups]\n[[groups.group]]\nname = \"a\"\n[[groups.group]]\nname = \"a\"\n",
                "groups.group[1].name: group name \"a\" is already used by groups.group[0]",
            ),
            ("[groups]\ncount = 1\ncont = 2\n", "unknown field `cont`"),
            (
                "[groups]\n[[groups.group]]\npercnt = 2\n",
                "unknown field `percnt`",
            ),
        ];
        for (tail, want) in cases {
            let e = error(&format!("{base}{tail}"));
            assert!(
                e.contains(want),
                "error for {tail:?} was {e:?}, expected it to contain {want:?}"
            );
        }
        let e = error("name = \"fw/2\"\nrelease = \"x\"\n[groups]\ncount = 1\n");
        assert!(e.starts_with("name: rollout name \"fw/2\""), "{e}");
        let e = error("name = \"r\"\nrelease = \"\"\n[groups]\ncount = 1\n");
        assert!(
            e.starts_with("release: release name must not be empty"),
            "{e}"
        );
        let e = error("name = \"r\"\n[groups]\ncount = 1\n");
        assert!(e.contains("missing field `release`"), "{e}");
    }

    #[test]
    fn percent_arithmetic_is_exact() {
        let p = Percent::from_basis_points(5_000).expect("50%");
        assert_eq!(p.of_rounded_up(30), 15);
        assert_eq!(p.of_rounded_up(31), 16);
        assert_eq!(p.of_rounded_up(1), 1);
        assert!(p.reached_by(15, 30));
        assert!(!p.exceeded_by(15, 30));
        assert!(p.exceeded_by(16, 30));
        assert_eq!(Percent::from_basis_points(10_001), None);
    }

    const BASE: &str = "name = \"r\"\nrelease = \"x\"\n";

    fn with(tail: &str) -> RolloutSpec {
        parse(&format!("{BASE}{tail}"))
    }

    fn pct(p: u32) -> Percent {
        Percent::from_basis_points(p * 100).expect("valid percent")
    }

    #[test]
    fn top_level_keys_become_policies() {
        let spec = with(
            r#"
action = "time_forced"
force_at = "2026-11-22T02:00:00Z"
start_at = 1795309200
weight = 900
timeout = "30m"
retry = { attempts = 2, backoff = "45s" }
offline = { fail_after = "10m" }
rate = { base = 5, factor = 1.5, every = 20, max = 100 }
soak = "10m"
unavailable_period = 30
[[window]]
cron = "0 2 * * *"
duration = "3h"
tz = "Europe/Berlin"
[[window]]
cron = "0 14 * * 6"
duration = "1h"
[groups]
count = 1
dynamic = true
"#,
        );
        let p = &spec.policies;
        assert_eq!(p.action, ActionType::TimeForced { at: 1_795_312_800 });
        assert_eq!(p.start_at, Some(1_795_309_200));
        assert_eq!(p.weight, 900);
        assert_eq!(p.timeout, Some(1800));
        assert_eq!(
            p.retry,
            Some(Retry {
                attempts: 2,
                backoff: 45
            })
        );
        assert_eq!(p.offline, OfflinePolicy::Fail { grace: 600 });
        assert_eq!(
            p.rate,
            Some(RateLimit {
                base: 5.0,
                factor: 1.5,
                every: 20,
                max: Some(100.0)
            })
        );
        assert_eq!(p.soak, 600);
        assert_eq!(p.unavailable_period, 30);
        assert_eq!(p.windows.len(), 2);
        assert_eq!(p.windows[0].tz, "Europe/Berlin");
        assert_eq!(p.windows[0].duration, 3 * 3600);
        assert_eq!(p.windows[1].tz, "UTC", "UTC unless the window names a zone");
        assert!(p.dynamic);
        assert_eq!(p.max_unavailable_groups, Budget::Count(0));
    }

    #[test]
    fn policy_defaults_and_simple_forms() {
        let spec = with("action = \"soft\"\noffline = \"skip\"\nretry = { attempts = 1 }\nrate = { base = 2 }\n[groups]\ncount = 1\n");
        let p = &spec.policies;
        assert_eq!(p.action, ActionType::Soft);
        assert_eq!(p.offline, OfflinePolicy::Skip);
        assert_eq!(p.weight, DEFAULT_WEIGHT);
        assert_eq!(
            p.retry,
            Some(Retry {
                attempts: 1,
                backoff: DEFAULT_RETRY_BACKOFF
            })
        );
        let rate = p.rate.expect("rate");
        assert_eq!((rate.factor, rate.every, rate.max), (2.0, 10, None));
        assert_eq!(p.unavailable_period, 0, "0 outside [rolling]");
        assert!(!p.dynamic);
        assert_eq!(p.unknown_devices, UnknownDevices::Exclude);
        let spec = with("unknown_devices = \"refuse\"\n[groups]\ncount = 1\n");
        assert_eq!(spec.policies.unknown_devices, UnknownDevices::Refuse);
        let spec = with("action = \"download_only\"\noffline = \"wait\"\n[groups]\ncount = 1\n");
        assert_eq!(spec.policies.action, ActionType::DownloadOnly);
        assert_eq!(spec.policies.offline, OfflinePolicy::Wait);
    }

    #[test]
    fn times_are_rfc3339_with_offsets_or_unix_seconds() {
        assert_eq!(rfc3339("2026-11-22T02:00:00Z"), Some(1_795_312_800));
        assert_eq!(rfc3339("2026-11-22T02:00:00+01:00"), Some(1_795_309_200));
        assert_eq!(rfc3339("2026-11-22t02:00:00.750z"), Some(1_795_312_800));
        assert_eq!(rfc3339("2024-02-29T23:59:59Z"), Some(1_709_251_199));
        assert_eq!(rfc3339("1970-01-01T00:00:00Z"), Some(0));
        for bad in [
            "2023-02-29T00:00:00Z",
            "2026-13-01T00:00:00Z",
            "2026-11-22T24:00:00Z",
            "2026-11-22T02:00:00",
            "2026-11-22 02:00Z",
            "1969-12-31T23:59:59Z",
            "2026-11-22T02:00:00+1:00",
        ] {
            assert_eq!(rfc3339(bad), None, "{bad}");
        }
        // An unquoted TOML datetime works too.
        let spec = with("start_at = 2026-11-22T02:00:00Z\n[groups]\ncount = 1\n");
        assert_eq!(spec.policies.start_at, Some(1_795_312_800));
    }

    #[test]
    fn error_conditions_take_counts_samples_classes_and_actions() {
        let spec = with(
            "[groups]\ncount = 1\nerror = { count = 3, min_sample = 5, classes = [\"timed_out\"], action = \"rollback\" }\n",
        );
        let Some(GroupsSpec::Count { error, .. }) = spec.groups() else {
            panic!("count spec")
        };
        assert_eq!(
            error,
            &Some(ErrorCondition {
                percent: None,
                count: Some(3),
                min_sample: 5,
                classes: FailureClasses {
                    failed: false,
                    timed_out: true,
                    refused: false
                },
                action: ErrorAction::Rollback
            }),
            "with only a count, no percentage applies"
        );
        let spec = with("[groups]\ncount = 1\nerror = { action = \"stop\" }\n");
        let Some(GroupsSpec::Count { error, .. }) = spec.groups() else {
            panic!("count spec")
        };
        let error = error.as_ref().expect("error condition");
        assert_eq!(
            error.percent,
            Some(Percent::ZERO),
            "fires on the first failure"
        );
        assert_eq!(error.classes, FailureClasses::default());
        assert_eq!(error.action, ErrorAction::Stop);
    }

    #[test]
    fn partitions_defaults_and_manual_partitions() {
        let spec = with("[partitions]\n");
        let Strategy::Partitions(p) = &spec.strategy else {
            panic!("partitions")
        };
        assert_eq!(spec.vocabulary(), "partitions");
        assert_eq!(p.max_unavailable, Budget::Percent(Percent::HUNDRED));
        assert_eq!(p.auto_partition_size, Budget::Percent(pct(25)));
        assert_eq!(p.auto_partition_threshold, 200);
        assert_eq!(p.max_new, 50);
        assert!(p.partitions.is_empty() && p.error.is_none());
        assert_eq!(spec.policies.max_unavailable_groups, Budget::Count(0));

        let spec = with(
            r#"
[partitions]
max_unavailable = "10%"
max_unavailable_partitions = 1
max_new = 20
error = { threshold = "5%", action = "stop" }
[[partitions.partition]]
name = "pilots"
devices = ["dev-2", "dev-1"]
max_unavailable = 0
[[partitions.partition]]
select = "env=staging"
[[partitions.partition]]
name = "lab"
group = "lab-boxes"
[[partitions.partition]]
name = "west"
group_select = "region=west"
"#,
        );
        let Strategy::Partitions(p) = &spec.strategy else {
            panic!("partitions")
        };
        assert_eq!(spec.policies.max_unavailable_groups, Budget::Count(1));
        assert_eq!(p.max_new, 20);
        assert_eq!(p.error.as_ref().map(|e| e.action), Some(ErrorAction::Stop));
        let names: Vec<&str> = p.partitions.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["pilots", "partition-2", "lab", "west"]);
        assert_eq!(p.partitions[0].max_unavailable, Budget::Count(0));
        assert_eq!(
            p.partitions[1].max_unavailable,
            Budget::Percent(pct(10)),
            "falls back to [partitions] max_unavailable"
        );
        assert_eq!(
            p.partitions[0].members,
            PartitionMembers::Devices(vec!["dev-2".into(), "dev-1".into()])
        );
        assert!(
            matches!(&p.partitions[1].members, PartitionMembers::Select(s) if s.to_string() == "env=staging")
        );
        assert_eq!(
            p.partitions[2].members,
            PartitionMembers::Group("lab-boxes".into())
        );
        assert!(
            matches!(&p.partitions[3].members, PartitionMembers::GroupSelect(s) if s.to_string() == "region=west")
        );
    }

    #[test]
    fn rolling_defaults_and_picks() {
        let spec = with("[rolling]\n");
        let Strategy::Rolling(r) = &spec.strategy else {
            panic!("rolling")
        };
        assert_eq!(spec.vocabulary(), "rolling");
        assert_eq!(r.max_unavailable, Budget::Percent(pct(25)));
        assert_eq!(r.pick, Pick::All);
        assert_eq!(spec.policies.unavailable_period, 60, "KubeFleet's default");

        let spec =
            with("[rolling]\nmax_unavailable = 2\nunavailable_period = \"5m\"\npick = { n = 3 }\n");
        let Strategy::Rolling(r) = &spec.strategy else {
            panic!("rolling")
        };
        assert_eq!(r.max_unavailable, Budget::Count(2));
        assert_eq!(r.pick, Pick::N(3));
        assert_eq!(spec.policies.unavailable_period, 300);

        let spec = with("unavailable_period = 0\n[rolling]\npick = { fixed = [\"b\", \"a\"] }\n");
        let Strategy::Rolling(r) = &spec.strategy else {
            panic!("rolling")
        };
        assert_eq!(r.pick, Pick::Fixed(vec!["b".into(), "a".into()]));
        assert_eq!(
            spec.policies.unavailable_period, 0,
            "an explicit top-level value wins over the default"
        );
    }

    const STRATEGY: &str = r#"
[[stage]]
name = "staging"
select = "environment=staging"
after = { wait = "1h" }
[[stage]]
name = "canary"
select = "environment=canary"
after = { approval = true }
[[stage]]
name = "production"
select = "environment=production"
sort_by = "order"
max_concurrency = 2
before = { approval = true }
after = { approval = true, wait = "1h" }
"#;

    #[test]
    fn staged_inline_stages_and_gates() {
        let text = STRATEGY.replace("[[stage]]", "[[staged.stage]]");
        let spec = with(&format!("[staged]\n{text}"));
        assert_eq!(spec.vocabulary(), "staged");
        assert_eq!(spec.staged_strategy_name(), None);
        let stages = spec.staged_stages().expect("inline stages");
        assert_eq!(stages.len(), 3);
        assert_eq!(
            stages[0].after,
            Gate {
                approval: false,
                wait: 3600
            }
        );
        assert_eq!(
            stages[0].max_concurrency, 1,
            "one device at a time by default"
        );
        assert_eq!(
            stages[1].after,
            Gate {
                approval: true,
                wait: 0
            }
        );
        assert_eq!(stages[2].sort_by.as_deref(), Some("order"));
        assert_eq!(stages[2].max_concurrency, 2);
        assert_eq!(
            stages[2].before,
            Gate {
                approval: true,
                wait: 0
            }
        );
        assert_eq!(
            stages[2].after,
            Gate {
                approval: true,
                wait: 3600
            }
        );
        let Strategy::Staged(s) = &spec.strategy else {
            panic!("staged")
        };
        assert_eq!(
            s.error.action,
            ErrorAction::Stop,
            "a failed device fails the run"
        );
        assert_eq!(s.error.percent, Some(Percent::ZERO));
    }

    #[test]
    fn staged_strategy_by_name_is_resolved_into_a_snapshot() {
        let mut spec =
            with("[staged]\nstrategy = \"example-strategy\"\nerror = { threshold = \"10%\" }\n");
        assert_eq!(spec.staged_strategy_name(), Some("example-strategy"));
        assert_eq!(spec.staged_stages(), None);
        let mut stored = StagedStrategy::from_toml("example-strategy", STRATEGY).expect("strategy");
        assert_eq!(stored.stages.len(), 3);
        spec.resolve_strategy(&stored);
        assert_eq!(spec.staged_strategy_name(), None, "resolved");
        assert_eq!(spec.staged_stages(), Some(stored.stages.as_slice()));
        // Changing the stored strategy afterwards does not change the rollout's snapshot.
        stored.stages.pop();
        assert_eq!(spec.staged_stages().map(<[StageSpec]>::len), Some(3));
        let Strategy::Staged(s) = &spec.strategy else {
            panic!("staged")
        };
        assert_eq!(s.strategy.as_deref(), Some("example-strategy"));
        assert_eq!(
            s.error.action,
            ErrorAction::Pause,
            "[staged] error replaces the default"
        );
        // Strategies with the same stages compare equal.
        let again = StagedStrategy::from_toml("example-strategy", STRATEGY).expect("strategy");
        assert_eq!(
            again.stages,
            StagedStrategy::from_toml("other", STRATEGY)
                .expect("strategy")
                .stages
        );
    }

    #[test]
    fn every_vocabulary_round_trips_through_json() {
        let staged = format!(
            "[staged]\n{}",
            STRATEGY.replace("[[stage]]", "[[staged.stage]]")
        );
        for tail in [
            "[partitions]\n[[partitions.partition]]\ndevices = [\"a\"]\n",
            "[rolling]\npick = { fixed = [\"a\"] }\n",
            "[staged]\nstrategy = \"s\"\n",
            staged.as_str(),
        ] {
            let spec = with(tail);
            let json = serde_json::to_string(&spec).expect("encodes");
            let back: RolloutSpec = serde_json::from_str(&json).expect("decodes");
            assert_eq!(back, spec, "{tail}");
        }
    }

    #[test]
    fn new_errors_name_the_field_and_value() {
        let cases: &[(&str, &str)] = &[
            ("", "set exactly one of [groups], [partitions], [rolling] or [staged]; found none"),
            ("[groups]\ncount = 1\n[rolling]\n", "found [groups] and [rolling]"),
            ("action = \"later\"\n[rolling]\n", "action: \"later\" is not one of \"forced\", \"soft\", \"download_only\", \"time_forced\""),
            ("action = \"time_forced\"\n[rolling]\n", "action = \"time_forced\" needs force_at"),
            ("force_at = 5\n[rolling]\n", "force_at = 5: force_at is only used with action = \"time_forced\""),
            ("action = \"time_forced\"\nforce_at = \"tomorrow\"\n[rolling]\n", "force_at: \"tomorrow\" is not an RFC 3339 time"),
            ("start_at = -1\n[rolling]\n", "start_at: -1 is not an RFC 3339 time"),
            ("weight = 2000\n[rolling]\n", "weight: 2000 is not from 0 to 1000"),
            ("timeout = \"30x\"\n[rolling]\n", "timeout: \"30x\" is not a duration: unknown unit \"x\""),
            ("timeout = \"0s\"\n[rolling]\n", "timeout: \"0s\" is not a duration: a timeout must be longer than 0s"),
            ("soak = true\n[rolling]\n", "soak: true is not a duration"),
            ("retry = { attempts = -1 }\n[rolling]\n", "retry.attempts: -1 is not from 0 to 100"),
            ("retry = { attempts = 1, backoff = \"x\" }\n[rolling]\n", "retry.backoff: \"x\" is not a duration"),
            ("offline = \"later\"\n[rolling]\n", "offline: \"later\" is not one of \"wait\", \"skip\""),
            ("unknown_devices = \"wait\"\n[rolling]\n", "unknown_devices: \"wait\" is not one of \"exclude\", \"refuse\""),
            ("offline = { grace = \"1m\" }\n[rolling]\n", "offline: { grace = \"1m\" } is not \"wait\", \"skip\" or { fail_after = \"10m\" }"),
            ("offline = { fail_after = \"soon\" }\n[rolling]\n", "offline.fail_after: \"soon\" is not a duration"),
            ("rate = { base = 0 }\n[rolling]\n", "rate.base: 0 is not a number of devices per minute above 0"),
            ("rate = { base = 5, factor = 0.5 }\n[rolling]\n", "rate.factor: 0.5 is not a factor of at least 1"),
            ("rate = { base = 5, every = 0 }\n[rolling]\n", "rate.every: 0 is not at least 1"),
            ("rate = { base = 5, max = 2 }\n[rolling]\n", "rate.max: 2 is not a number of devices per minute of at least rate.base (5)"),
            ("rate = { base = 5, burst = 2 }\n[rolling]\n", "unknown field `burst`"),
            ("[[window]]\ncron = \"0 2 * * *\"\nduration = \"0s\"\n[rolling]\n", "window[0].duration: \"0s\" is not a duration: a window must stay open longer than 0s"),
            ("[[window]]\ncron = \"0 2 * * *\"\n[rolling]\n", "missing field `duration`"),
            ("unavailable_period = \"1m\"\n[rolling]\nunavailable_period = \"2m\"\n", "rolling.unavailable_period = \"2m\": unavailable_period is also set at the top level"),
            ("[groups]\ncount = 1\nerror = { count = 0 }\n", "groups.error.count: 0 is not at least 1"),
            ("[groups]\ncount = 1\nerror = { min_sample = -2 }\n", "groups.error.min_sample: -2 is not at least 0"),
            ("[groups]\ncount = 1\nerror = { classes = [\"failed\", \"lost\"] }\n", "groups.error.classes[1]: \"lost\" is not one of \"failed\", \"timed_out\", \"refused\""),
            ("[groups]\ncount = 1\nerror = { classes = [] }\n", "groups.error.classes: [] is not a list naming at least one"),
            ("[groups]\ncount = 1\nsuccess = { count = 2 }\n", "unknown field `count`"),
            ("[groups]\ncount = 1\ndynamic = \"yes\"\n", "dynamic"),
            ("[partitions]\nmax_unavailable = \"ten\"\n", "partitions.max_unavailable: \"ten\" is not a number of devices or a percentage from 0% to 100%"),
            ("[partitions]\nmax_unavailable = 2.5\n", "partitions.max_unavailable: 2.5 is not a number of devices"),
            ("[partitions]\nmax_unavailable_partitions = \"150%\"\n", "partitions.max_unavailable_partitions: \"150%\" is not"),
            ("[partitions]\nauto_partition_size = 0\n", "partitions.auto_partition_size: 0 is not a number of devices (at least 1) or a percentage above 0%"),
            ("[partitions]\nauto_partition_size = \"0%\"\n", "partitions.auto_partition_size: \"0%\" is not"),
            ("[partitions]\nauto_partition_threshold = -1\n", "partitions.auto_partition_threshold: -1 is not at least 0"),
            ("[partitions]\nmax_new = 0\n", "partitions.max_new: 0 is not at least 1"),
            ("[partitions]\nerror = { action = \"halt\" }\n", "partitions.error.action: \"halt\" is not one of"),
            ("[partitions]\n[[partitions.partition]]\nname = \"a\"\n", "partitions.partition[0]: set exactly one of devices, select, group, group_select; found none"),
            ("[partitions]\n[[partitions.partition]]\nselect = \"a=b\"\ngroup = \"g\"\n", "partitions.partition[0]: set exactly one of devices, select, group, group_select; found select and group"),
            ("[partitions]\n[[partitions.partition]]\ndevices = []\n", "partitions.partition[0].devices: [] is not a list of at least one device id"),
            ("[partitions]\n[[partitions.partition]]\ndevices = [\"a\", \"b\", \"a\"]\n", "partitions.partition[0].devices[2]: device \"a\" is already used by partitions.partition[0].devices[0]"),
            ("[partitions]\n[[partitions.partition]]\ndevices = [\"a/b\"]\n", "partitions.partition[0].devices[0]: device id \"a/b\""),
            ("[partitions]\n[[partitions.partition]]\ngroup_select = \"x in ()\"\n", "partitions.partition[0].group_select: selector \"x in ()\""),
            ("[partitions]\n[[partitions.partition]]\nname = \"p\"\nselect = \"a=b\"\n[[partitions.partition]]\nname = \"p\"\nselect = \"a=c\"\n", "partitions.partition[1].name: partition name \"p\" is already used by partitions.partition[0]"),
            ("[partitions]\n[[partitions.partition]]\nselect = \"a=b\"\nmax_unavailable = -1\n", "partitions.partition[0].max_unavailable: -1 is not"),
            ("[partitions]\n[[partitions.partition]]\nclusterName = \"a\"\n", "unknown field `clusterName`"),
            ("[rolling]\nmax_surge = 1\n", "rolling.max_surge = 1: flotilla updates devices in place: a device cannot run two releases side by side and there is no spare device to surge onto"),
            ("[rolling]\nmax_unavailable = 0\n", "rolling.max_unavailable: 0 is not a number of devices (at least 1)"),
            ("[rolling]\npick = \"some\"\n", "rolling.pick: \"some\" is not \"all\", { n = 3 } or { fixed = [\"dev-1\", \"dev-2\"] }"),
            ("[rolling]\npick = { n = 0 }\n", "rolling.pick.n: 0 is not at least 1"),
            ("[rolling]\npick = { n = \"3\" }\n", "rolling.pick.n: \"3\" is not a number of devices"),
            ("[rolling]\npick = { fixed = [\"a\", 3] }\n", "rolling.pick.fixed[1]: 3 is not a device id"),
            ("[rolling]\npick = { fixed = [] }\n", "rolling.pick.fixed: [] is not a list of at least one device id"),
            ("[staged]\n", "staged: set exactly one of strategy, [[staged.stage]]; found none"),
            ("[staged]\nstrategy = \"s\"\n[[staged.stage]]\nname = \"a\"\n", "found strategy and [[staged.stage]]"),
            ("[staged]\nstrategy = \"a b\"\n", "staged.strategy: strategy name \"a b\""),
            ("[staged]\nerror = { threshold = \"x\" }\nstrategy = \"s\"\n", "staged.error.threshold: \"x\" is not a percentage"),
            ("[staged]\n[[staged.stage]]\nname = \"a\"\n[[staged.stage]]\nname = \"a\"\n", "staged.stage[1].name: stage name \"a\" is already used by staged.stage[0]"),
            ("[staged]\n[[staged.stage]]\nname = \"\"\n", "staged.stage[0].name: stage name must not be empty"),
            ("[staged]\n[[staged.stage]]\nname = \"a\"\nmax_concurrency = 0\n", "staged.stage[0].max_concurrency: 0 is not at least 1"),
            ("[staged]\n[[staged.stage]]\nname = \"a\"\nsort_by = \"\"\n", "staged.stage[0].sort_by: \"\" is not a label key"),
            ("[staged]\n[[staged.stage]]\nname = \"a\"\nselect = \"env=\"\n", "staged.stage[0].select: selector \"env=\""),
            ("[staged]\n[[staged.stage]]\nname = \"a\"\nbefore = { wait = \"1h\" }\n", "staged.stage[0].before.wait = \"1h\": a stage cannot wait before it starts"),
            ("[staged]\n[[staged.stage]]\nname = \"a\"\nafter = { wait = \"1 hour\" }\n", "staged.stage[0].after.wait: \"1 hour\" is not a duration"),
            ("[staged]\n[[staged.stage]]\nname = \"a\"\nafter = { approval = true, task = \"x\" }\n", "unknown field `task`"),
        ];
        let mut wrong = Vec::new();
        for (tail, want) in cases {
            match RolloutSpec::from_toml(&format!("{BASE}{tail}"), &SystemZones) {
                Ok(_) => wrong.push(format!("{tail:?} was accepted, expected {want:?}")),
                Err(e) if !e.to_string().contains(want) => {
                    wrong.push(format!("{tail:?} gave {e:?}, expected {want:?}"))
                }
                Err(_) => {}
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));

        let e = StagedStrategy::from_toml("s", "").expect_err("no stages");
        assert_eq!(
            e.to_string(),
            "stage: [] is not a list of at least one [[stage]] entry"
        );
        let e = StagedStrategy::from_toml("a/b", STRATEGY).expect_err("bad name");
        assert!(
            e.to_string().starts_with("strategy: strategy name \"a/b\""),
            "{e}"
        );
        let e =
            StagedStrategy::from_toml("s", "[[stage]]\nname = \"a\"\n[[stage]]\nname = \"a\"\n")
                .expect_err("duplicate");
        assert_eq!(
            e.to_string(),
            "stage[1].name: stage name \"a\" is already used by stage[0]"
        );
    }
}
