//! The planner: pure functions from a rollout spec and a fleet snapshot to ordered groups, and
//! from a group's counts to whether its success or error condition holds.
//!
//! No clock, no I/O, no randomness: the same inputs always give the same plan, so plans can be
//! tested exhaustively, simulated, and shown to an operator before anything is sent to a device.
//!
//! Filling follows hawkBit: the devices selected by the rollout (and compatible with the
//! release's hardware list) are sorted by id, then the groups take devices in order, each from
//! the devices not already in an earlier group. 30 devices with a 50% group and a 100% group
//! give 15 and 15.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use crate::plan::{Excluded, Plan, PlannedGroup};
use crate::plan::{Gate, Pace};
use crate::selector::Selector;
use crate::spec::{GroupsSpec, RolloutSpec, Strategy};

/// One device as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetDevice {
    pub id: String,
    pub labels: BTreeMap<String, String>,
    pub hardware_id: String,
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
    #[error("staged: strategy {name:?} was not resolved before planning")]
    UnresolvedStrategy { name: String },
}

/// Splits the fleet into the spec's groups. `release_hardware` is the release's list of
/// compatible hardware ids; empty means any hardware.
pub fn plan(
    spec: &RolloutSpec,
    fleet: &[FleetDevice],
    release_hardware: &[String],
    _device_groups: &[DeviceGroup],
) -> Result<Plan, PlanError> {
    let mut excluded = Vec::new();
    let mut selected: Vec<&FleetDevice> = Vec::new();
    for device in fleet.iter().filter(|d| spec.select.matches(&d.labels)) {
        if release_hardware.is_empty() || release_hardware.contains(&device.hardware_id) {
            selected.push(device);
        } else {
            excluded.push(Excluded {
                device: device.id.clone(),
                reason: format!(
                    "hardware {:?} is not in release {}'s hardware list [{}]",
                    device.hardware_id,
                    spec.release,
                    release_hardware.join(", ")
                ),
            });
        }
    }
    selected.sort_by(|a, b| a.id.cmp(&b.id));
    selected.dedup_by(|a, b| a.id == b.id);
    excluded.sort_by(|a, b| a.device.cmp(&b.device));

    let mut groups = Vec::new();
    let mut unassigned = Vec::new();
    match &spec.strategy {
        Strategy::Groups(GroupsSpec::Count {
            count,
            success,
            error,
        }) => {
            let count = *count as usize;
            let (base, extra) = (selected.len() / count, selected.len() % count);
            let mut rest = selected.iter();
            for i in 0..count {
                // Earlier groups take the remainder one device each.
                let size = base + usize::from(i < extra);
                groups.push(PlannedGroup {
                    name: format!("group-{}", i + 1),
                    devices: rest.by_ref().take(size).map(|d| d.id.clone()).collect(),
                    pace: Pace::default(),
                    success: success.clone(),
                    error: error.clone(),
                    before: Gate::default(),
                    after: Gate::default(),
                });
            }
        }
        Strategy::Groups(GroupsSpec::List(list)) => {
            let mut taken = vec![false; selected.len()];
            for g in list {
                let candidates: Vec<usize> = (0..selected.len())
                    .filter(|&i| !taken[i] && g.select.matches(&selected[i].labels))
                    .collect();
                // Round up so that a small percentage of a small fleet still gets one device.
                let size = g.percent.of_rounded_up(candidates.len());
                let mut devices = Vec::with_capacity(size);
                for &i in candidates.iter().take(size) {
                    taken[i] = true;
                    devices.push(selected[i].id.clone());
                }
                groups.push(PlannedGroup {
                    name: g.name.clone(),
                    devices,
                    pace: Pace::default(),
                    success: g.success.clone(),
                    error: g.error.clone(),
                    before: Gate::default(),
                    after: Gate::default(),
                });
            }
            unassigned = selected
                .iter()
                .zip(&taken)
                .filter(|(_, t)| !**t)
                .map(|(d, _)| d.id.clone())
                .collect();
        }
    }
    Ok(Plan {
        groups,
        excluded,
        unassigned,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        RolloutSpec::from_toml(&format!("name = \"r\"\nrelease = \"rel\"\n{groups}"))
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
}
