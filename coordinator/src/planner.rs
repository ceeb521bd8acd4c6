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

use crate::spec::{ErrorCondition, GroupsSpec, RolloutSpec, SuccessCondition};

/// One device as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetDevice {
    pub id: String,
    pub labels: BTreeMap<String, String>,
    pub hardware_id: String,
}

/// The planned groups of a rollout and the devices left out, with why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub groups: Vec<PlannedGroup>,
    /// Devices the rollout selector matched but the release cannot be installed on.
    pub excluded: Vec<Excluded>,
    /// Devices selected and compatible but taken by no group; they are not rolled out.
    pub unassigned: Vec<String>,
}

impl Plan {
    /// Devices in any group.
    pub fn device_count(&self) -> usize {
        self.groups.iter().map(|g| g.devices.len()).sum()
    }
}

/// One group with its devices, in rollout order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedGroup {
    pub name: String,
    /// Sorted by device id.
    pub devices: Vec<String>,
    pub success: SuccessCondition,
    pub error: Option<ErrorCondition>,
}

/// A device left out of a rollout, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Excluded {
    pub device: String,
    pub reason: String,
}

/// Splits the fleet into the spec's groups. `release_hardware` is the release's list of
/// compatible hardware ids; empty means any hardware.
pub fn plan_groups(spec: &RolloutSpec, fleet: &[FleetDevice], release_hardware: &[String]) -> Plan {
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
    match spec.groups() {
        GroupsSpec::Count {
            count,
            success,
            error,
        } => {
            let count = *count as usize;
            let (base, extra) = (selected.len() / count, selected.len() % count);
            let mut rest = selected.iter();
            for i in 0..count {
                // Earlier groups take the remainder one device each.
                let size = base + usize::from(i < extra);
                groups.push(PlannedGroup {
                    name: format!("group-{}", i + 1),
                    devices: rest.by_ref().take(size).map(|d| d.id.clone()).collect(),
                    success: success.clone(),
                    error: error.clone(),
                });
            }
        }
        GroupsSpec::List(list) => {
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
                    success: g.success.clone(),
                    error: g.error.clone(),
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
    Plan {
        groups,
        excluded,
        unassigned,
    }
}

/// Where a group's devices stand, kept up to date incrementally by the engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupCounts {
    pub total: usize,
    /// Not yet sent a desired action.
    pub scheduled: usize,
    /// Sent, and not in a terminal phase yet.
    pub in_progress: usize,
    pub ready: usize,
    /// Failed or refused.
    pub failed: usize,
    pub canceled: usize,
}

impl GroupCounts {
    /// Devices whose action is not over.
    pub fn pending(&self) -> usize {
        self.scheduled + self.in_progress
    }
}

/// Whether a condition holds, and the numbers behind it in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evaluation {
    pub met: bool,
    /// e.g. "4 of 4 ready >= 100%" or "3 of 20 failed > 10%".
    pub reason: String,
}

/// The success condition holds when the ready share is at least the threshold; an empty group
/// succeeds at once.
pub fn success_met(cond: &SuccessCondition, counts: &GroupCounts) -> Evaluation {
    let met = cond.threshold.reached_by(counts.ready, counts.total);
    let op = if met { ">=" } else { "<" };
    Evaluation {
        met,
        reason: format!(
            "{} of {} ready {op} {}",
            counts.ready, counts.total, cond.threshold
        ),
    }
}

/// The error condition holds when the failed share (failed and refused) is strictly above the
/// threshold, so a 0% threshold fires on the first failure and an empty group never fails.
pub fn error_met(cond: &ErrorCondition, counts: &GroupCounts) -> Evaluation {
    let met = cond.threshold.exceeded_by(counts.failed, counts.total);
    let op = if met { ">" } else { "<=" };
    Evaluation {
        met,
        reason: format!(
            "{} of {} failed {op} {}",
            counts.failed, counts.total, cond.threshold
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{ErrorAction, Percent, SuccessAction};

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
        let plan = plan_groups(&s, &fleet(30), &[]);
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
        assert_eq!(sizes(&plan_groups(&s, &fleet(12), &[])), vec![4, 4, 4]);
        let plan = plan_groups(&s, &fleet(10), &[]);
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
        assert_eq!(sizes(&plan_groups(&s, &fleet(2), &[])), vec![1, 1, 0]);
    }

    #[test]
    fn percentages_round_up_and_leftovers_are_reported() {
        let s = spec("[groups]\n[[groups.group]]\npercent = 10\n[[groups.group]]\npercent = 50\n");
        let plan = plan_groups(&s, &fleet(5), &[]);
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
        let plan = plan_groups(&s, &f, &[]);
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
        let plan = plan_groups(&s, &f, &["pi4".to_string(), "cm4".to_string()]);
        assert_eq!(plan.groups[0].devices, vec!["dev-000"]);
        assert_eq!(plan.excluded.len(), 1);
        assert_eq!(plan.excluded[0].device, "dev-001");
        assert!(
            plan.excluded[0].reason.contains("\"pi3\"")
                && plan.excluded[0].reason.contains("pi4, cm4")
        );
        // An empty hardware list means any hardware.
        let plan = plan_groups(&s, &f, &[]);
        assert_eq!(plan.groups[0].devices, vec!["dev-000", "dev-001"]);
        assert!(plan.excluded.is_empty());
    }

    fn counts(total: usize, ready: usize, failed: usize) -> GroupCounts {
        GroupCounts {
            total,
            ready,
            failed,
            in_progress: total - ready - failed,
            ..GroupCounts::default()
        }
    }

    fn pct(p: u32) -> Percent {
        Percent::from_basis_points(p * 100).expect("valid percent")
    }

    #[test]
    fn success_needs_the_threshold_share_ready() {
        let all = SuccessCondition {
            threshold: pct(100),
            action: SuccessAction::Next,
        };
        assert_eq!(
            success_met(&all, &counts(4, 4, 0)),
            Evaluation {
                met: true,
                reason: "4 of 4 ready >= 100%".into()
            }
        );
        assert_eq!(
            success_met(&all, &counts(4, 3, 1)),
            Evaluation {
                met: false,
                reason: "3 of 4 ready < 100%".into()
            }
        );
        let most = SuccessCondition {
            threshold: pct(75),
            action: SuccessAction::Next,
        };
        assert!(success_met(&most, &counts(4, 3, 0)).met);
        assert!(!success_met(&most, &counts(5, 3, 0)).met);
        let empty = success_met(&all, &counts(0, 0, 0));
        assert!(empty.met, "an empty group succeeds: {}", empty.reason);
    }

    #[test]
    fn error_needs_strictly_more_than_the_threshold_failed() {
        let ten = ErrorCondition {
            threshold: pct(10),
            action: ErrorAction::Pause,
        };
        assert_eq!(
            error_met(&ten, &counts(20, 0, 3)),
            Evaluation {
                met: true,
                reason: "3 of 20 failed > 10%".into()
            }
        );
        assert_eq!(
            error_met(&ten, &counts(20, 0, 2)),
            Evaluation {
                met: false,
                reason: "2 of 20 failed <= 10%".into()
            }
        );
        let zero = ErrorCondition {
            threshold: pct(0),
            action: ErrorAction::Pause,
        };
        assert!(!error_met(&zero, &counts(5, 0, 0)).met);
        assert!(error_met(&zero, &counts(5, 0, 1)).met);
        assert!(
            !error_met(&zero, &counts(0, 0, 0)).met,
            "an empty group never fails"
        );
    }
}
