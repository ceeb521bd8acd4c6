//! The planner: a pure function from a rollout spec and a fleet snapshot to a [`Plan`].
//!
//! No clock, no I/O, no randomness: the same inputs always give the same plan, so plans can be
//! tested exhaustively, simulated, and shown to an operator before anything is sent to a device.
//!
//! Every vocabulary starts the same way: the devices the rollout selects and the release can be
//! installed on, sorted by id. Then:
//!
//! - `[groups]` (hawkBit): the groups take devices in order, each from the devices not already in
//!   an earlier group; 30 devices with a 50% group and a 100% group give 15 and 15.
//! - `[partitions]` (Rancher Fleet): manual partitions in order, or automatic partitions of
//!   `auto_partition_size` once the rollout has `auto_partition_threshold` devices; each starts
//!   `max_new` devices per batch and is Ready while at most `max_unavailable` are not ready.
//! - `[rolling]` (KubeFleet RollingUpdate): one group of the picked devices, at most
//!   `max_unavailable` of them updating at once.
//! - `[staged]` (KubeFleet staged run): one group per stage, a device in the first stage that
//!   selects it, ordered by the stage's sorting label, with the stage's gates.
//!
//! `docs/rollout-spec.md` describes the mapping in full.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::plan::{Budget, Gate, Pace, SuccessAction, SuccessCondition, Threshold};
pub use crate::plan::{Excluded, Plan, PlannedGroup, SitePlan};
use crate::selector::{Labels, Selector};
use crate::spec::{
    GroupsSpec, PartitionMembers, PartitionsSpec, Pick, RollingSpec, RolloutSpec, StagedSpec,
    Strategy,
};

/// One device as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetDevice {
    pub id: String,
    pub labels: BTreeMap<String, String>,
    pub hardware_id: String,
}

/// A fleet device as the planner reads it: [`FleetDevice`], or a more compact record of the
/// offline tools, which plan over a million devices.
pub trait PlanDevice {
    /// What the device's labels are read through.
    type Labels: Labels + ?Sized;
    fn id(&self) -> &str;
    fn hardware_id(&self) -> &str;
    fn labels(&self) -> &Self::Labels;
}

impl PlanDevice for FleetDevice {
    type Labels = BTreeMap<String, String>;
    fn id(&self) -> &str {
        &self.id
    }
    fn hardware_id(&self) -> &str {
        &self.hardware_id
    }
    fn labels(&self) -> &Self::Labels {
        &self.labels
    }
}

/// A device group (`flotilla group`): a named selector with labels of its own, which Fleet-style
/// partitions refer to by name (`group`) or by its labels (`group_select`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceGroup {
    pub name: String,
    pub select: Selector,
    pub labels: BTreeMap<String, String>,
}

/// Why a spec could not be planned against the fleet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("{field}: no device group named {name:?}")]
    UnknownGroup { field: String, name: String },
    #[error("{field}: no device group has labels matching {selector:?}")]
    NoMatchingGroups { field: String, selector: String },
    #[error("staged: strategy {name:?} was not resolved before planning")]
    UnresolvedStrategy { name: String },
    #[error("staged.stage {stage:?}: device {device:?} has no label {label:?} to sort by")]
    SortLabelMissing {
        stage: String,
        device: String,
        label: String,
    },
    #[error(
        "staged.stage {stage:?}: device {device:?} has label {label} = {value:?}, which is not an integer to sort by"
    )]
    SortLabelNotInteger {
        stage: String,
        device: String,
        label: String,
        value: String,
    },
    #[error(
        "unknown_devices = \"refuse\": {count} accepted devices have sent no state since the coordinator started, so whether the rollout selects them is unknown ({}); create the rollout again once they have (`flotilla devices` lists them as \"{NO_STATE}\"), or leave them out with unknown_devices = \"exclude\"",
        named(devices, *count)
    )]
    UnknownDevices { count: usize, devices: Vec<String> },
}

/// What `flotilla devices` says of an accepted device the coordinator has read no state of since
/// it started, and what a plan says of it.
pub const NO_STATE: &str = "no state since restart";

/// How many devices without a state an error, a status or a trace names; the rest are counted.
pub const UNKNOWN_NAMED: usize = 20;

/// The reason an accepted device without a state is not planned.
pub fn unknown_reason(dynamic: bool) -> String {
    let then = if dynamic {
        "it joins the dynamic group when its state arrives, if it matches"
    } else {
        "it is not in this rollout"
    };
    format!(
        "accepted, {NO_STATE}: its labels and hardware are unknown (its retained state topic is \
         empty: cleared, dropped by the broker, or never sent); {then}"
    )
}

/// Whether a plan left this device out for want of a state ([`exclude_unknown`]).
pub fn is_unknown(e: &Excluded) -> bool {
    e.reason
        .strip_prefix("accepted, ")
        .is_some_and(|r| r.starts_with(NO_STATE))
}

/// The first few of `devices`, and how many more there are.
fn named(devices: &[String], count: usize) -> String {
    let mut text = devices.join(", ");
    if count > devices.len() {
        text.push_str(&format!(" and {} more", count - devices.len()));
    }
    text
}

/// Adds the accepted devices the coordinator holds no state of (`unknown`, in id order) to a
/// plan as excluded, naming why, or refuses the plan under `unknown_devices = "refuse"`.
pub fn exclude_unknown(
    spec: &RolloutSpec,
    plan: &mut Plan,
    unknown: &[String],
) -> Result<(), PlanError> {
    if unknown.is_empty() {
        return Ok(());
    }
    if spec.policies.unknown_devices == crate::plan::UnknownDevices::Refuse {
        return Err(PlanError::UnknownDevices {
            count: unknown.len(),
            devices: unknown.iter().take(UNKNOWN_NAMED).cloned().collect(),
        });
    }
    let reason = unknown_reason(spec.policies.dynamic);
    plan.excluded.extend(unknown.iter().map(|device| Excluded {
        device: device.clone(),
        reason: reason.clone(),
    }));
    Ok(())
}

/// Splits the fleet into the spec's groups. `release_hardware` is the release's list of
/// compatible hardware ids; empty means any hardware. `device_groups` are the stored device
/// groups that `[partitions]` may refer to.
pub fn plan<D: PlanDevice>(
    spec: &RolloutSpec,
    fleet: &[D],
    release_hardware: &[String],
    device_groups: &[DeviceGroup],
) -> Result<Plan, PlanError> {
    let mut sel = Selection::new(spec, fleet, release_hardware);
    let (groups, unassigned) = match &spec.strategy {
        Strategy::Groups(g) => hawkbit_groups(g, &sel.selected),
        Strategy::Partitions(p) => partitions(p, &mut sel, device_groups)?,
        Strategy::Rolling(r) => rolling(r, &mut sel),
        Strategy::Staged(s) => staged(s, &sel.selected)?,
    };
    let sites = spec.policies.sites.as_ref().map(|policy| {
        let site_of: HashMap<&str, &str> = sel
            .selected
            .iter()
            .filter_map(|d| Some((d.id(), d.labels().label(&policy.label)?)))
            .collect();
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        let mut without_site = 0;
        for device in groups.iter().flat_map(|g| &g.devices) {
            match site_of.get(device.as_str()) {
                Some(site) => *counts.entry((*site).to_owned()).or_default() += 1,
                None => without_site += 1,
            }
        }
        SitePlan {
            policy: policy.clone(),
            sites: counts.into_iter().collect(),
            without_site,
        }
    });
    Ok(Plan {
        groups,
        excluded: sel
            .excluded
            .into_iter()
            .map(|(device, reason)| Excluded { device, reason })
            .collect(),
        unassigned,
        sites,
    })
}

/// The devices a rollout covers, and what became of the others.
struct Selection<'a, D> {
    /// Selected by the rollout and compatible with the release, sorted by id, each once.
    selected: Vec<&'a D>,
    /// Every fleet device's standing, by id; `Selected` holds the index in fleet order, which
    /// `sorted` maps to the index in `selected`.
    status: HashMap<&'a str, Standing>,
    sorted: Vec<usize>,
    /// Device id -> why it is left out.
    excluded: BTreeMap<String, String>,
    rollout_select: String,
}

#[derive(Clone, Copy)]
enum Standing {
    Selected(usize),
    NotSelected,
    Incompatible,
}

impl<'a, D: PlanDevice> Selection<'a, D> {
    fn new(spec: &RolloutSpec, fleet: &'a [D], release_hardware: &[String]) -> Self {
        let mut excluded = BTreeMap::new();
        let mut selected: Vec<&D> = Vec::new();
        let mut status = HashMap::with_capacity(fleet.len());
        for device in fleet {
            let std::collections::hash_map::Entry::Vacant(entry) = status.entry(device.id()) else {
                continue;
            };
            let standing = if !spec.select.matches(device.labels()) {
                Standing::NotSelected
            } else if release_hardware.is_empty()
                || release_hardware.iter().any(|h| h == device.hardware_id())
            {
                selected.push(device);
                Standing::Selected(selected.len() - 1)
            } else {
                excluded.insert(
                    device.id().to_owned(),
                    format!(
                        "hardware {:?} is not in release {}'s hardware list [{}]",
                        device.hardware_id(),
                        spec.release,
                        release_hardware.join(", ")
                    ),
                );
                Standing::Incompatible
            };
            entry.insert(standing);
        }
        // Sorted by id; `sorted[i]` is where the i-th device selected in fleet order went.
        let mut order: Vec<usize> = (0..selected.len()).collect();
        order.sort_unstable_by(|&a, &b| selected[a].id().cmp(selected[b].id()));
        let mut sorted = vec![0; order.len()];
        for (to, &from) in order.iter().enumerate() {
            sorted[from] = to;
        }
        let selected = order.iter().map(|&i| selected[i]).collect();
        Selection {
            selected,
            sorted,
            status,
            excluded,
            rollout_select: spec.select.to_string(),
        }
    }

    /// Indices into `selected` of devices listed by id, in the listed order. Listed devices the
    /// rollout does not cover are excluded with the reason.
    fn listed(&mut self, ids: &[String]) -> Vec<usize> {
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            match self.status.get(id.as_str()) {
                Some(&Standing::Selected(i)) => {
                    let i = self.sorted[i];
                    if !out.contains(&i) {
                        out.push(i);
                    }
                }
                Some(Standing::Incompatible) => {}
                Some(Standing::NotSelected) => {
                    self.excluded.insert(
                        id.clone(),
                        format!(
                            "not selected by the rollout's selector {:?}",
                            self.rollout_select
                        ),
                    );
                }
                None => {
                    self.excluded
                        .insert(id.clone(), "not in the fleet".to_owned());
                }
            }
        }
        out
    }

    fn ids(&self, indices: &[usize]) -> Vec<String> {
        indices
            .iter()
            .map(|&i| self.selected[i].id().to_owned())
            .collect()
    }

    /// Selected devices whose index is not in `taken`.
    fn rest(&self, taken: &[bool]) -> Vec<String> {
        self.selected
            .iter()
            .zip(taken)
            .filter(|(_, t)| !**t)
            .map(|(d, _)| d.id().to_owned())
            .collect()
    }
}

type Groups = (Vec<PlannedGroup>, Vec<String>);

/// A group that starts whole and has open gates.
fn group(name: String, devices: Vec<String>) -> PlannedGroup {
    PlannedGroup {
        name,
        devices,
        pace: Pace::default(),
        success: SuccessCondition::default(),
        error: None,
        before: Gate::default(),
        after: Gate::default(),
    }
}

fn hawkbit_groups<D: PlanDevice>(spec: &GroupsSpec, selected: &[&D]) -> Groups {
    match spec {
        GroupsSpec::Count {
            count,
            success,
            error,
        } => {
            let count = *count as usize;
            let (base, extra) = (selected.len() / count, selected.len() % count);
            let mut rest = selected.iter();
            let groups = (0..count)
                .map(|i| {
                    // Earlier groups take the remainder one device each.
                    let size = base + usize::from(i < extra);
                    PlannedGroup {
                        success: success.clone(),
                        error: error.clone(),
                        ..group(
                            format!("group-{}", i + 1),
                            rest.by_ref()
                                .take(size)
                                .map(|d| d.id().to_owned())
                                .collect(),
                        )
                    }
                })
                .collect();
            (groups, Vec::new())
        }
        GroupsSpec::List(list) => {
            let mut taken = vec![false; selected.len()];
            let mut groups = Vec::with_capacity(list.len());
            for g in list {
                let candidates: Vec<usize> = (0..selected.len())
                    .filter(|&i| !taken[i] && g.select.matches(selected[i].labels()))
                    .collect();
                // Round up so that a small percentage of a small fleet still gets one device.
                let size = g.percent.of_rounded_up(candidates.len());
                let mut devices = Vec::with_capacity(size);
                for &i in candidates.iter().take(size) {
                    taken[i] = true;
                    devices.push(selected[i].id().to_owned());
                }
                groups.push(PlannedGroup {
                    success: g.success.clone(),
                    error: g.error.clone(),
                    ..group(g.name.clone(), devices)
                });
            }
            let unassigned = selected
                .iter()
                .zip(&taken)
                .filter(|(_, t)| !**t)
                .map(|(d, _)| d.id().to_owned())
                .collect();
            (groups, unassigned)
        }
    }
}

fn partitions<D: PlanDevice>(
    spec: &PartitionsSpec,
    sel: &mut Selection<'_, D>,
    device_groups: &[DeviceGroup],
) -> Result<Groups, PlanError> {
    let partition = |name: String, devices: Vec<String>, budget: Budget| PlannedGroup {
        pace: Pace {
            batch: Some(spec.max_new),
            gate: Some(budget),
            concurrency: None,
        },
        success: SuccessCondition {
            threshold: Threshold::AllBut(budget),
            action: SuccessAction::Next,
        },
        error: spec.error.clone(),
        ..group(name, devices)
    };
    let n = sel.selected.len();
    if spec.partitions.is_empty() {
        let all: Vec<String> = sel.selected.iter().map(|d| d.id().to_owned()).collect();
        if spec.auto_partition_threshold == 0 || n < spec.auto_partition_threshold {
            return Ok((
                vec![partition("all".into(), all, spec.max_unavailable)],
                Vec::new(),
            ));
        }
        // Fleet rounds partition sizes down; the remainder forms a last, smaller partition.
        let size = match spec.auto_partition_size {
            Budget::Count(c) => c,
            Budget::Percent(p) => p.of_rounded_down(n),
        }
        .max(1);
        let groups = all
            .chunks(size)
            .enumerate()
            .map(|(i, chunk)| {
                partition(
                    format!("partition-{}", i + 1),
                    chunk.to_vec(),
                    spec.max_unavailable,
                )
            })
            .collect();
        return Ok((groups, Vec::new()));
    }

    let mut taken = vec![false; n];
    let mut groups = Vec::with_capacity(spec.partitions.len());
    for (i, p) in spec.partitions.iter().enumerate() {
        let field = format!("partitions.partition[{i}]");
        let matching = |sel: &Selection<'_, D>, pred: &dyn Fn(&D) -> bool| -> Vec<usize> {
            (0..n).filter(|&j| pred(sel.selected[j])).collect()
        };
        let candidates = match &p.members {
            PartitionMembers::Devices(ids) => sel.listed(ids),
            PartitionMembers::Select(s) => matching(sel, &|d| s.matches(d.labels())),
            PartitionMembers::Group(name) => {
                let g = device_groups
                    .iter()
                    .find(|g| &g.name == name)
                    .ok_or_else(|| PlanError::UnknownGroup {
                        field: format!("{field}.group"),
                        name: name.clone(),
                    })?;
                matching(sel, &|d| g.select.matches(d.labels()))
            }
            PartitionMembers::GroupSelect(s) => {
                let chosen: Vec<&DeviceGroup> = device_groups
                    .iter()
                    .filter(|g| s.matches(&g.labels))
                    .collect();
                if chosen.is_empty() {
                    return Err(PlanError::NoMatchingGroups {
                        field: format!("{field}.group_select"),
                        selector: s.to_string(),
                    });
                }
                matching(sel, &|d| {
                    chosen.iter().any(|g| g.select.matches(d.labels()))
                })
            }
        };
        // A device in an earlier partition is not taken again.
        let mine: Vec<usize> = candidates.into_iter().filter(|&j| !taken[j]).collect();
        for &j in &mine {
            taken[j] = true;
        }
        groups.push(partition(p.name.clone(), sel.ids(&mine), p.max_unavailable));
    }
    Ok((groups, sel.rest(&taken)))
}

fn rolling<D: PlanDevice>(spec: &RollingSpec, sel: &mut Selection<'_, D>) -> Groups {
    let n = sel.selected.len();
    let picked: Vec<usize> = match &spec.pick {
        Pick::All => (0..n).collect(),
        Pick::N(k) => (0..n.min(*k)).collect(),
        Pick::Fixed(ids) => sel.listed(ids),
    };
    // A percentage is of KubeFleet's "target number of clusters": the devices picked for
    // PickAll, N itself for PickN and the length of the list for PickFixed, however many of
    // those the fleet really has. Rounded down and never below 1, so in-place updates progress.
    let target = match &spec.pick {
        Pick::All => picked.len(),
        Pick::N(k) => *k,
        Pick::Fixed(ids) => ids.len(),
    };
    let concurrency = match spec.max_unavailable {
        Budget::Count(c) => c,
        Budget::Percent(p) => p.of_rounded_down(target),
    }
    .max(1);
    let mut taken = vec![false; n];
    for &j in &picked {
        taken[j] = true;
    }
    let g = PlannedGroup {
        pace: Pace {
            concurrency: Some(concurrency),
            ..Pace::default()
        },
        error: spec.error.clone(),
        ..group("rolling".into(), sel.ids(&picked))
    };
    (vec![g], sel.rest(&taken))
}

fn staged<D: PlanDevice>(spec: &StagedSpec, selected: &[&D]) -> Result<Groups, PlanError> {
    let stages = spec
        .stages
        .as_ref()
        .ok_or_else(|| PlanError::UnresolvedStrategy {
            name: spec.strategy.clone().unwrap_or_default(),
        })?;
    let mut members: Vec<Vec<&D>> = vec![Vec::new(); stages.len()];
    let mut unassigned = Vec::new();
    for d in selected {
        match stages.iter().position(|s| s.select.matches(d.labels())) {
            Some(i) => members[i].push(d),
            None => unassigned.push(d.id().to_owned()),
        }
    }
    let mut groups = Vec::with_capacity(stages.len());
    for (stage, devices) in stages.iter().zip(members) {
        let ordered: Vec<String> = match &stage.sort_by {
            None => devices.iter().map(|d| d.id().to_owned()).collect(),
            Some(label) => {
                let mut keyed = Vec::with_capacity(devices.len());
                for d in devices {
                    let value =
                        d.labels()
                            .label(label)
                            .ok_or_else(|| PlanError::SortLabelMissing {
                                stage: stage.name.clone(),
                                device: d.id().to_owned(),
                                label: label.clone(),
                            })?;
                    let key: i64 = value.parse().map_err(|_| PlanError::SortLabelNotInteger {
                        stage: stage.name.clone(),
                        device: d.id().to_owned(),
                        label: label.clone(),
                        value: value.to_owned(),
                    })?;
                    keyed.push((key, d.id().to_owned()));
                }
                // Equal values keep id order, so the plan stays deterministic.
                keyed.sort();
                keyed.into_iter().map(|(_, id)| id).collect()
            }
        };
        groups.push(PlannedGroup {
            pace: Pace {
                concurrency: Some(stage.max_concurrency),
                ..Pace::default()
            },
            error: Some(spec.error.clone()),
            before: stage.before,
            after: stage.after,
            ..group(stage.name.clone(), ordered)
        });
    }
    Ok((groups, unassigned))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zoneinfo::SystemZones;

    fn device(i: usize, labels: &[(&str, &str)], hw: &str) -> FleetDevice {
        FleetDevice {
            id: format!("dev-{i:03}"),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            hardware_id: hw.into(),
        }
    }

    fn fleet(n: usize) -> Vec<FleetDevice> {
        // Reversed so that the planner's sort is visible.
        (0..n).rev().map(|i| device(i, &[], "pi4")).collect()
    }

    fn spec(groups: &str) -> RolloutSpec {
        RolloutSpec::from_toml(
            &format!("name = \"r\"\nrelease = \"rel\"\n{groups}"),
            &SystemZones,
        )
        .expect("valid spec")
    }

    fn sizes(plan: &Plan) -> Vec<usize> {
        plan.groups.iter().map(|g| g.devices.len()).collect()
    }

    #[test]
    fn hawkbit_thirty_devices_fifty_then_hundred_percent() {
        let s = spec("[groups]\n[[groups.group]]\npercent = 50\n[[groups.group]]\npercent = 100\n");
        let plan = super::plan(&s, &fleet(30), &[], &[]).expect("plans");
        assert_eq!(sizes(&plan), vec![15, 15]);
        assert_eq!(plan.groups[0].devices[0], "dev-000");
        assert_eq!(plan.groups[0].devices[14], "dev-014");
        assert_eq!(plan.groups[1].devices[0], "dev-015");
        assert!(plan.unassigned.is_empty());
        assert_eq!(plan.groups[0].name, "group-1");
    }

    #[test]
    fn count_splits_evenly_with_extras_first() {
        let s = spec("[groups]\ncount = 3\n");
        assert_eq!(
            sizes(&super::plan(&s, &fleet(12), &[], &[]).expect("plans")),
            vec![4, 4, 4]
        );
        let plan = super::plan(&s, &fleet(10), &[], &[]).expect("plans");
        assert_eq!(sizes(&plan), vec![4, 3, 3]);
        assert_eq!(
            plan.groups
                .iter()
                .map(|g| g.name.as_str())
                .collect::<Vec<_>>(),
            ["group-1", "group-2", "group-3"]
        );
        let all: Vec<&String> = plan.groups.iter().flat_map(|g| &g.devices).collect();
        assert_eq!(all.len(), 10, "every device in exactly one group");
        assert_eq!(
            sizes(&super::plan(&s, &fleet(2), &[], &[]).expect("plans")),
            vec![1, 1, 0]
        );
    }

    #[test]
    fn percentages_round_up_and_leftovers_are_reported() {
        let s = spec("[groups]\n[[groups.group]]\npercent = 10\n[[groups.group]]\npercent = 50\n");
        let plan = super::plan(&s, &fleet(5), &[], &[]).expect("plans");
        // 10% of 5 = 0.5 -> 1; 50% of the remaining 4 = 2; 2 devices are in no group.
        assert_eq!(sizes(&plan), vec![1, 2]);
        assert_eq!(
            plan.unassigned,
            vec!["dev-003".to_string(), "dev-004".to_string()]
        );
        assert_eq!(plan.device_count(), 3);
    }

    #[test]
    fn group_selectors_take_only_devices_not_in_earlier_groups() {
        let mut f = vec![
            device(0, &[("env", "canary")], "pi4"),
            device(1, &[("env", "canary")], "pi4"),
        ];
        f.extend((2..6).map(|i| device(i, &[("env", "prod")], "pi4")));
        let s = spec(
            "[groups]\n[[groups.group]]\nname = \"canary\"\nselect = \"env=canary\"\n\
             [[groups.group]]\nname = \"half\"\npercent = 50\n[[groups.group]]\nname = \"rest\"\n",
        );
        let plan = super::plan(&s, &f, &[], &[]).expect("plans");
        assert_eq!(plan.groups[0].devices, vec!["dev-000", "dev-001"]);
        // 50% of the 4 devices left, not of all 6.
        assert_eq!(plan.groups[1].devices, vec!["dev-002", "dev-003"]);
        assert_eq!(plan.groups[2].devices, vec!["dev-004", "dev-005"]);
    }

    #[test]
    fn rollout_selector_and_hardware_filter() {
        let f = vec![
            device(0, &[("site", "a")], "pi4"),
            device(1, &[("site", "a")], "pi3"),
            device(2, &[("site", "b")], "pi4"),
        ];
        let s = RolloutSpec::from_toml(
            "name = \"r\"\nrelease = \"rel\"\nselect = \"site=a\"\n[groups]\ncount = 1\n",
            &SystemZones,
        )
        .expect("valid");
        let plan =
            super::plan(&s, &f, &["pi4".to_string(), "cm4".to_string()], &[]).expect("plans");
        assert_eq!(plan.groups[0].devices, vec!["dev-000"]);
        assert_eq!(plan.excluded.len(), 1);
        assert_eq!(plan.excluded[0].device, "dev-001");
        assert!(
            plan.excluded[0].reason.contains("\"pi3\"")
                && plan.excluded[0].reason.contains("pi4, cm4")
        );
        // An empty hardware list means any hardware.
        let plan = super::plan(&s, &f, &[], &[]).expect("plans");
        assert_eq!(plan.groups[0].devices, vec!["dev-000", "dev-001"]);
        assert!(plan.excluded.is_empty());
    }

    use crate::plan::{ErrorAction, ErrorCondition, Percent};
    use crate::spec::SuccessAction;

    fn pct(p: u32) -> Budget {
        Budget::Percent(Percent::from_basis_points(p * 100).expect("valid percent"))
    }

    fn names(plan: &Plan) -> Vec<&str> {
        plan.groups.iter().map(|g| g.name.as_str()).collect()
    }

    fn labelled(id: &str, labels: &[(&str, &str)]) -> FleetDevice {
        FleetDevice {
            id: id.into(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            hardware_id: "pi4".into(),
        }
    }

    fn plan_of(toml: &str, fleet: &[FleetDevice]) -> Plan {
        super::plan(&spec(toml), fleet, &[], &[]).expect("plans")
    }

    #[test]
    fn fleet_fifty_devices_make_one_partition_started_in_one_batch() {
        let plan = plan_of("[partitions]\nmax_unavailable = \"10%\"\n", &fleet(50));
        assert_eq!(names(&plan), ["all"]);
        assert_eq!(sizes(&plan), [50]);
        let g = &plan.groups[0];
        assert_eq!(
            g.pace,
            Pace {
                batch: Some(50),
                gate: Some(pct(10)),
                concurrency: None
            }
        );
        assert_eq!(g.success.threshold, Threshold::AllBut(pct(10)));
        assert_eq!(g.success.action, SuccessAction::Next);
        assert_eq!(g.error, None);
        assert!(g.before.is_open() && g.after.is_open());
    }

    #[test]
    fn fleet_hundred_devices_start_fifty_then_wait_for_the_gate() {
        let plan = plan_of("[partitions]\nmax_unavailable = \"10%\"\n", &fleet(100));
        assert_eq!(
            sizes(&plan),
            [100],
            "below the threshold of 200: one partition"
        );
        let pace = plan.groups[0].pace;
        assert_eq!(pace.batch, Some(50));
        // More than 10 of 100 not ready holds the second batch back.
        assert_eq!(pace.gate.map(|g| g.of(100)), Some(10));
    }

    #[test]
    fn fleet_two_hundred_devices_at_ten_percent_make_ten_partitions_of_twenty() {
        let s =
            spec("[partitions]\nmax_unavailable_partitions = 1\nauto_partition_size = \"10%\"\n");
        assert_eq!(s.policies.max_unavailable_groups, Budget::Count(1));
        let plan = super::plan(&s, &fleet(200), &[], &[]).expect("plans");
        assert_eq!(sizes(&plan), [20; 10]);
        assert_eq!(plan.groups[0].name, "partition-1");
        assert_eq!(plan.groups[9].name, "partition-10");
        assert_eq!(plan.groups[0].devices[0], "dev-000");
        assert_eq!(plan.groups[9].devices[19], "dev-199");
        // The defaults: everything may be NotReady (100%).
        assert_eq!(
            plan.groups[0].success.threshold,
            Threshold::AllBut(Budget::Percent(Percent::HUNDRED))
        );
        // With default settings, 200 devices make four partitions of 50.
        assert_eq!(sizes(&plan_of("[partitions]\n", &fleet(200))), [50; 4]);
    }

    #[test]
    fn fleet_rounds_partition_sizes_down_and_keeps_the_remainder() {
        let plan = plan_of("[partitions]\n", &fleet(230));
        assert_eq!(sizes(&plan), [57, 57, 57, 57, 2]);
        assert_eq!(plan.device_count(), 230);
        // A count instead of a share.
        assert_eq!(
            sizes(&plan_of(
                "[partitions]\nauto_partition_size = 70\n",
                &fleet(230)
            )),
            [70, 70, 70, 20]
        );
    }

    #[test]
    fn fleet_auto_partition_threshold_lowered_and_disabled() {
        let plan = plan_of(
            "[partitions]\nauto_partition_threshold = 50\nauto_partition_size = \"50%\"\n",
            &fleet(50),
        );
        assert_eq!(sizes(&plan), [25, 25]);
        assert_eq!(
            sizes(&plan_of(
                "[partitions]\nauto_partition_size = \"50%\"\n",
                &fleet(50)
            )),
            [50],
            "without the lowered threshold, one partition"
        );
        let plan = plan_of("[partitions]\nauto_partition_threshold = 0\n", &fleet(300));
        assert_eq!(names(&plan), ["all"]);
        assert_eq!(sizes(&plan), [300]);
    }

    #[test]
    fn fleet_strict_manual_partitions_by_stage_label() {
        let mut f: Vec<FleetDevice> = (0..200)
            .map(|i| {
                let stage = if i % 10 == 0 { "demoRollout" } else { "stable" };
                labelled(&format!("c-{i:03}"), &[("stage", stage)])
            })
            .collect();
        f.push(labelled("c-900", &[("stage", "retired")]));
        let s = spec(
            "[partitions]\nmax_unavailable = 0\nmax_unavailable_partitions = 0\n\
             [[partitions.partition]]\nname = \"demoRollout\"\nselect = \"stage=demoRollout\"\n\
             [[partitions.partition]]\nname = \"stable\"\nselect = \"stage=stable\"\n",
        );
        let plan = super::plan(&s, &f, &[], &[]).expect("plans");
        assert_eq!(names(&plan), ["demoRollout", "stable"]);
        assert_eq!(sizes(&plan), [20, 180]);
        assert_eq!(plan.groups[0].devices[1], "c-010");
        for g in &plan.groups {
            assert_eq!(g.success.threshold, Threshold::AllBut(Budget::Count(0)));
            assert_eq!(g.pace.gate, Some(Budget::Count(0)));
        }
        assert_eq!(s.policies.max_unavailable_groups, Budget::Count(0));
        assert_eq!(
            plan.unassigned,
            ["c-900"],
            "a device in no manual partition is not rolled out"
        );
    }

    #[test]
    fn manual_partitions_by_devices_select_group_and_group_select() {
        let f = vec![
            labelled("a", &[("rack", "1"), ("env", "lab")]),
            labelled("b", &[("rack", "1")]),
            labelled("c", &[("rack", "2")]),
            labelled("d", &[("rack", "3")]),
            labelled("e", &[("rack", "4")]),
            labelled("f", &[("rack", "5")]),
            labelled("g", &[("rack", "5"), ("site", "other")]),
        ];
        let groups = vec![
            DeviceGroup {
                name: "rack-1".into(),
                select: Selector::parse("rack=1").expect("selector"),
                labels: BTreeMap::new(),
            },
            DeviceGroup {
                name: "rack-3".into(),
                select: Selector::parse("rack=3").expect("selector"),
                labels: BTreeMap::from([("region".to_string(), "west".to_string())]),
            },
            DeviceGroup {
                name: "rack-4".into(),
                select: Selector::parse("rack=4").expect("selector"),
                labels: BTreeMap::from([("region".to_string(), "west".to_string())]),
            },
        ];
        let s = RolloutSpec::from_toml(
            "name = \"r\"\nrelease = \"rel\"\nselect = \"!site\"\n[partitions]\nmax_unavailable = 1\n\
             error = { count = 2, action = \"rollback\" }\n\
             [[partitions.partition]]\nname = \"pilots\"\ndevices = [\"c\", \"a\", \"ghost\", \"g\"]\nmax_unavailable = 0\n\
             [[partitions.partition]]\nname = \"rack-1\"\ngroup = \"rack-1\"\n\
             [[partitions.partition]]\nname = \"west\"\ngroup_select = \"region=west\"\n\
             [[partitions.partition]]\nname = \"lab\"\nselect = \"env=lab\"\n", &SystemZones
        )
        .expect("valid");
        let plan = super::plan(&s, &f, &[], &groups).expect("plans");
        assert_eq!(names(&plan), ["pilots", "rack-1", "west", "lab"]);
        assert_eq!(plan.groups[0].devices, ["c", "a"], "the listed order");
        assert_eq!(plan.groups[1].devices, ["b"], "a is already in pilots");
        assert_eq!(plan.groups[2].devices, ["d", "e"]);
        assert!(plan.groups[3].devices.is_empty());
        assert_eq!(plan.unassigned, ["f"]);
        assert_eq!(
            plan.groups[0].success.threshold,
            Threshold::AllBut(Budget::Count(0))
        );
        assert_eq!(
            plan.groups[1].success.threshold,
            Threshold::AllBut(Budget::Count(1))
        );
        assert_eq!(
            plan.groups[1].error.as_ref().map(|e| (e.count, e.action)),
            Some((Some(2), ErrorAction::Rollback))
        );
        assert_eq!(
            plan.excluded,
            [
                Excluded {
                    device: "g".into(),
                    reason: "not selected by the rollout's selector \"!site\"".into()
                },
                Excluded {
                    device: "ghost".into(),
                    reason: "not in the fleet".into()
                }
            ]
        );
    }

    #[test]
    fn unknown_device_groups_name_the_field() {
        let s = spec("[partitions]\n[[partitions.partition]]\nselect = \"a=b\"\n[[partitions.partition]]\ngroup = \"racks\"\n");
        let e = super::plan(&s, &fleet(3), &[], &[]).expect_err("unknown group");
        assert_eq!(
            e.to_string(),
            "partitions.partition[1].group: no device group named \"racks\""
        );
        let s = spec("[partitions]\n[[partitions.partition]]\ngroup_select = \"region=east\"\n");
        let e = super::plan(&s, &fleet(3), &[], &[]).expect_err("no matching group");
        assert_eq!(
            e.to_string(),
            "partitions.partition[0].group_select: no device group has labels matching \"region=east\""
        );
    }

    #[test]
    fn rolling_pick_all_with_max_unavailable_rounded_down_at_least_one() {
        let plan = plan_of("[rolling]\n", &fleet(4));
        assert_eq!(names(&plan), ["rolling"]);
        assert_eq!(sizes(&plan), [4]);
        let g = &plan.groups[0];
        assert_eq!(g.pace.concurrency, Some(1), "25% of 4");
        assert_eq!((g.pace.batch, g.pace.gate), (None, None));
        assert_eq!(g.success, SuccessCondition::default());
        assert_eq!(
            plan_of("[rolling]\n", &fleet(3)).groups[0].pace.concurrency,
            Some(1),
            "25% of 3 is 0, at least 1"
        );
        assert_eq!(
            plan_of("[rolling]\n", &fleet(11)).groups[0]
                .pace
                .concurrency,
            Some(2),
            "25% of 11 rounds down"
        );
        assert_eq!(
            plan_of("[rolling]\nmax_unavailable = 3\n", &fleet(11)).groups[0]
                .pace
                .concurrency,
            Some(3)
        );
        let plan = plan_of(
            "[rolling]\nerror = { threshold = \"10%\", action = \"stop\" }\n",
            &fleet(2),
        );
        assert_eq!(
            plan.groups[0].error.as_ref().map(|e| e.action),
            Some(ErrorAction::Stop)
        );
    }

    #[test]
    fn rolling_pick_n_and_fixed() {
        let plan = plan_of(
            "[rolling]\nmax_unavailable = \"50%\"\npick = { n = 3 }\n",
            &fleet(8),
        );
        assert_eq!(plan.groups[0].devices, ["dev-000", "dev-001", "dev-002"]);
        assert_eq!(
            plan.groups[0].pace.concurrency,
            Some(1),
            "50% of the 3 picked"
        );
        assert_eq!(plan.unassigned.len(), 5);
        assert_eq!(
            sizes(&plan_of("[rolling]\npick = { n = 30 }\n", &fleet(8))),
            [8]
        );
        // kubefleet-safe-rollout.txt: "For PickN, it's the number of clusters specified in the
        // ClusterResourcePlacement policy", not the number the scheduler found.
        let plan = plan_of(
            "[rolling]\nmax_unavailable = \"50%\"\npick = { n = 30 }\n",
            &fleet(8),
        );
        assert_eq!(sizes(&plan), [8]);
        assert_eq!(
            plan.groups[0].pace.concurrency,
            Some(15),
            "50% of the 30 asked for, not of the 8 found"
        );

        let plan = plan_of(
            "[rolling]\nmax_unavailable = \"50%\"\npick = { fixed = [\"dev-005\", \"dev-001\", \"dev-042\", \"dev-003\", \"dev-007\"] }\n",
            &fleet(8),
        );
        assert_eq!(
            plan.groups[0].devices,
            ["dev-005", "dev-001", "dev-003", "dev-007"]
        );
        assert_eq!(
            plan.groups[0].pace.concurrency,
            Some(2),
            "50% of the 5 listed (\"For PickFixed, it's the length of the list\")"
        );
        assert_eq!(
            plan.excluded,
            [Excluded {
                device: "dev-042".into(),
                reason: "not in the fleet".into()
            }]
        );
        assert_eq!(
            plan.unassigned,
            ["dev-000", "dev-002", "dev-004", "dev-006"]
        );
        let plan = plan_of(
            "[rolling]\nmax_unavailable = \"50%\"\npick = { fixed = [\"dev-001\", \"dev-041\", \"dev-042\", \"dev-043\"] }\n",
            &fleet(8),
        );
        assert_eq!(plan.groups[0].devices, ["dev-001"]);
        assert_eq!(
            plan.groups[0].pace.concurrency,
            Some(2),
            "50% of the 4 listed, though 1 is in the fleet"
        );
    }

    const STAGED: &str = r#"
[staged]
[[staged.stage]]
name = "staging"
select = "environment=staging"
after = { wait = "1h" }
[[staged.stage]]
name = "canary"
select = "environment=canary"
after = { approval = true }
[[staged.stage]]
name = "production"
select = "environment in (production, canary)"
sort_by = "order"
after = { approval = true, wait = "1h" }
"#;

    fn staged_fleet() -> Vec<FleetDevice> {
        vec![
            labelled("member1", &[("environment", "staging")]),
            labelled("member2", &[("environment", "canary")]),
            labelled("prod-a", &[("environment", "production"), ("order", "3")]),
            labelled("prod-b", &[("environment", "production"), ("order", "1")]),
            labelled("prod-c", &[("environment", "production"), ("order", "-2")]),
            labelled("prod-d", &[("environment", "production"), ("order", "1")]),
            labelled("lab-1", &[("environment", "lab")]),
        ]
    }

    #[test]
    fn staged_three_stages_in_order_sorted_by_label_with_gates() {
        let plan = plan_of(STAGED, &staged_fleet());
        assert_eq!(names(&plan), ["staging", "canary", "production"]);
        assert_eq!(plan.groups[0].devices, ["member1"]);
        assert_eq!(
            plan.groups[1].devices,
            ["member2"],
            "a device takes the first stage that selects it"
        );
        assert_eq!(
            plan.groups[2].devices,
            ["prod-c", "prod-b", "prod-d", "prod-a"],
            "by the integer value of `order`, ties by id"
        );
        assert_eq!(plan.unassigned, ["lab-1"]);
        assert_eq!(
            plan.groups[0].after,
            Gate {
                approval: false,
                wait: 3600
            }
        );
        assert_eq!(
            plan.groups[1].after,
            Gate {
                approval: true,
                wait: 0
            }
        );
        assert_eq!(
            plan.groups[2].after,
            Gate {
                approval: true,
                wait: 3600
            }
        );
        for g in &plan.groups {
            assert!(g.before.is_open());
            assert_eq!(g.pace.concurrency, Some(1), "one device at a time");
            assert_eq!(g.success, SuccessCondition::default());
            assert_eq!(
                g.error,
                Some(ErrorCondition {
                    action: ErrorAction::Stop,
                    ..ErrorCondition::default()
                }),
                "a failed device fails the run"
            );
        }
    }

    #[test]
    fn staged_bad_sort_labels_name_stage_device_label_and_value() {
        let mut f = staged_fleet();
        f.push(labelled(
            "prod-x",
            &[("environment", "production"), ("order", "first")],
        ));
        let e = super::plan(&spec(STAGED), &f, &[], &[]).expect_err("bad label");
        assert_eq!(
            e.to_string(),
            "staged.stage \"production\": device \"prod-x\" has label order = \"first\", which is not an integer to sort by"
        );
        let mut f = staged_fleet();
        f.push(labelled("prod-y", &[("environment", "production")]));
        let e = super::plan(&spec(STAGED), &f, &[], &[]).expect_err("missing label");
        assert_eq!(
            e.to_string(),
            "staged.stage \"production\": device \"prod-y\" has no label \"order\" to sort by"
        );
    }

    #[test]
    fn staged_named_strategy_plans_only_once_resolved() {
        let mut s = spec("[staged]\nstrategy = \"example-strategy\"\n");
        let e = super::plan(&s, &staged_fleet(), &[], &[]).expect_err("unresolved");
        assert_eq!(
            e,
            PlanError::UnresolvedStrategy {
                name: "example-strategy".into()
            }
        );
        let stored = crate::spec::StagedStrategy::from_toml(
            "example-strategy",
            &STAGED
                .replace("[staged]\n", "")
                .replace("staged.stage", "stage"),
        )
        .expect("strategy");
        s.resolve_strategy(&stored);
        let plan = super::plan(&s, &staged_fleet(), &[], &[]).expect("plans");
        assert_eq!(names(&plan), ["staging", "canary", "production"]);
        assert_eq!(plan.groups[2].devices.len(), 4);
    }

    #[test]
    fn every_complete_example_in_the_docs_parses_and_plans() {
        let doc = include_str!("../../../docs/rollout-spec.md");
        let mut complete = 0;
        for block in doc.split("```toml\n").skip(1) {
            let text = block.split("```").next().unwrap_or_default();
            let vocabulary = ["[groups]", "[partitions]", "[rolling]", "[staged]"]
                .iter()
                .any(|v| text.contains(v));
            if !text.starts_with("name = ") || !vocabulary {
                continue;
            }
            complete += 1;
            let s = RolloutSpec::from_toml(text, &SystemZones)
                .unwrap_or_else(|e| panic!("doc example refused: {e}\n{text}"));
            let f: Vec<FleetDevice> = staged_fleet()
                .into_iter()
                .map(|mut d| {
                    d.labels.insert("order".into(), "1".into());
                    d
                })
                .collect();
            super::plan(&s, &f, &[], &[])
                .unwrap_or_else(|e| panic!("doc example does not plan: {e}\n{text}"));
        }
        assert_eq!(complete, 4, "one complete example per vocabulary");
    }
}
