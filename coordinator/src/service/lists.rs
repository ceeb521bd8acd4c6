//! The paged lists of the control API: devices, a rollout's devices, named lists.

use flotilla_protocol::control::{
    ApprovalStatus, DeviceSummary, PageQuery, RolloutPage, SourceBytes, OVERDUE_AFTER,
};
use flotilla_protocol::device_view::DeviceView;

use crate::service::enrollment::Status;
use crate::service::state::Service;

use crate::service::page::Pager;
use flotilla_rollout::selector::Selector;

/// What `flotilla devices` adds to the enrollment of an accepted device the engine holds no
/// state of: its retained state was not read since the coordinator started (a broker that
/// dropped it, a cleared topic, a device that never sent one since). A plan says the same of
/// it (`flotilla plan` reads it back from a fleet file).
pub(crate) const NO_STATE: &str = flotilla_rollout::planner::NO_STATE;

impl Service {
    /// Accepted devices, and how many of them the engine holds a state of (`coverage.rs`).
    pub(super) fn coverage_counts(&self) -> (usize, usize) {
        self.registry
            .all()
            .filter(|r| r.status == Status::Accepted)
            .fold((0, 0), |(accepted, with_state), r| {
                let known = self.engine.device_labels(&r.device).is_some();
                (accepted + 1, with_state + usize::from(known))
            })
    }

    /// Accepted devices the engine holds no state of, in id order: a rollout created now cannot
    /// plan them, and says so (`planner::exclude_unknown`).
    pub(super) fn devices_without_state(&self) -> Vec<String> {
        self.registry
            .all()
            .filter(|r| r.status == Status::Accepted)
            .filter(|r| self.engine.device_labels(&r.device).is_none())
            .map(|r| r.device.clone())
            .collect()
    }

    /// Every device: those the engine knows (accepted) and those waiting for, or refused by, an
    /// operator, each with its enrollment status. Devices that are not accepted show what their
    /// last state claims, never online: anyone can sign such a state, and a forged retained one
    /// would stay "online" for good (the table shows `-`, not known, for them).
    pub(super) fn device_list(&self, now: u64) -> Vec<DeviceSummary> {
        self.devices_after(None, now).collect()
    }

    /// [`Service::device_list`] after the device id `after`, in id order, read lazily from the
    /// engine's and the registry's sorted maps. The two are walked side by side, so a page costs
    /// its own devices (and the registry records between them), not the fleet. Devices offline
    /// for longer than [`OVERDUE_AFTER`] at `now` are marked overdue.
    pub(super) fn devices_after<'a>(
        &'a self,
        after: Option<&'a str>,
        now: u64,
    ) -> impl Iterator<Item = DeviceSummary> + 'a {
        self.devices_merged(after)
            .map(move |d| mark_overdue(d, now))
    }

    fn devices_merged<'a>(
        &'a self,
        after: Option<&'a str>,
    ) -> impl Iterator<Item = DeviceSummary> + 'a {
        let mut known = self.engine.devices_after(after).peekable();
        let mut records = self.registry.all_after(after).peekable();
        std::iter::from_fn(move || loop {
            let next_known = known.peek().map(|d| d.id.as_str());
            let Some(record) = records.peek() else {
                let mut d = known.next()?;
                d.enrollment = self.registry.status_text(&d.id);
                return Some(d);
            };
            match next_known {
                Some(id) if id <= record.device.as_str() => {
                    if id == record.device {
                        records.next();
                    }
                    let mut d = known.next()?;
                    d.enrollment = self.registry.status_text(&d.id);
                    return Some(d);
                }
                _ => {
                    // A record the engine has no state for: waiting for, or refused by, an
                    // operator, or accepted and not heard from since the coordinator started.
                    let record = records.next()?;
                    if self.engine.device_labels(&record.device).is_some() {
                        continue;
                    }
                    match self.unknown_device(&record.device) {
                        Some(d) => return Some(d),
                        None => continue,
                    }
                }
            }
        })
    }

    /// A device with an enrollment record and no state in the engine: waiting for, or refused
    /// by, an operator, or accepted and not heard from since the coordinator started.
    fn unknown_device(&self, device: &str) -> Option<DeviceSummary> {
        let info = self.registry.info(device)?;
        let accepted = info.status == Status::Accepted.name();
        Some(DeviceSummary {
            id: device.to_owned(),
            hardware_id: info.hardware_id.unwrap_or_default(),
            labels: info.labels,
            online: false,
            installed: None,
            rollout: None,
            phase: None,
            reason: None,
            enrollment: self.registry.status_text(device).map(|status| {
                if accepted {
                    format!("{status}, {NO_STATE}")
                } else {
                    status
                }
            }),
            last_seen: None,
            overdue: false,
        })
    }

    /// A page of `list_devices`: `select`, `phase`, `online` and `enrollment` filter, `group`
    /// names a stored device group whose selector the devices must match.
    pub(super) fn device_page(
        &self,
        page: &PageQuery,
        now: u64,
    ) -> Result<flotilla_protocol::control::Page<DeviceSummary>, String> {
        let select = selector(page)?;
        let filter = DeviceFilter::of(page)?;
        let group = match &page.group {
            None => None,
            Some(name) => Some(
                self.store
                    .load_group(name)
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| format!("group: no device group named {name:?}"))?
                    .select,
            ),
        };
        let phase = page.phase.as_deref();
        let devices = self
            .devices_after(page.after.as_deref(), now)
            .filter(|d| filter.matches(d))
            .filter(|d| select.matches(&d.labels))
            .filter(|d| group.as_ref().is_none_or(|g| g.matches(&d.labels)))
            .filter(|d| phase.is_none_or(|p| d.phase.as_deref() == Some(p)));
        Ok(Pager::new(page, 0)?.collect(devices, |d| d.id.clone()))
    }

    /// A page of one rollout: its summary and a page of its devices; `group`, `phase` and
    /// `select` filter the devices.
    pub(super) fn rollout_page(&self, name: &str, page: &PageQuery) -> Result<RolloutPage, String> {
        let status = self
            .engine
            .summary(name)
            .ok_or_else(|| format!("no rollout named {name:?}"))?;
        if let Some(group) = &page.group {
            if !status.groups.iter().any(|g| &g.name == group) {
                return Err(format!(
                    "group: rollout {name} has no group named {group:?}"
                ));
            }
        }
        refuse_filters(page, &["online", "enrollment"], "a rollout's devices")?;
        let select = selector(page)?;
        let devices = self
            .engine
            .rollout_devices(name, page.after.as_deref())
            .ok_or_else(|| format!("no rollout named {name:?}"))?
            .filter(|d| page.group.as_ref().is_none_or(|g| *g == d.group))
            .filter(|d| page.phase.as_ref().is_none_or(|p| *p == d.detail.phase))
            .filter(|d| {
                select.is_everything()
                    || self
                        .engine
                        .device_labels(&d.id)
                        .is_some_and(|labels| select.matches(labels))
            });
        let reserved = serde_json::to_vec(&status).map_or(0, |v| v.len());
        let devices = Pager::new(page, reserved)?.collect(devices, |d| d.id.clone());
        Ok(RolloutPage {
            status,
            items: devices.items,
            next: devices.next,
        })
    }
}

impl Service {
    /// One device in detail (`show_device`): its summary, key fingerprints and every action the
    /// rollouts hold for it, newest first.
    pub(super) fn device_view(&self, device: &str, now: u64) -> Result<DeviceView, String> {
        let summary = match self.engine.device(device) {
            Some(mut d) => {
                d.enrollment = self.registry.status_text(device);
                Some(d)
            }
            None => self.unknown_device(device),
        };
        let summary = summary
            .map(|d| mark_overdue(d, now))
            .ok_or_else(|| format!("no device named {device:?}"))?;
        let info = self.registry.info(device);
        let print = |key: &str| key.get(..16).unwrap_or(key).to_owned();
        let actions = self.engine.device_actions(device);
        let mut bytes = SourceBytes::default();
        for a in &actions {
            if let Some(b) = &a.bytes {
                bytes.add(b);
            }
        }
        Ok(DeviceView {
            summary,
            fingerprint: info.as_ref().map(|i| print(&i.key)),
            new_key: info.as_ref().and_then(|i| i.new_key.as_deref().map(print)),
            actions,
            bytes,
        })
    }
}

/// The approvals of `list_approvals`, those in the page's `phase` only (`pending`, `approved`,
/// `denied`, `withdrawn`), and the page without it.
pub(super) fn approvals_in(
    all: Vec<ApprovalStatus>,
    mut page: PageQuery,
) -> Result<(Vec<ApprovalStatus>, PageQuery), String> {
    let Some(phase) = page.phase.take() else {
        return Ok((all, page));
    };
    let state = |a: &ApprovalStatus| {
        if a.approved {
            "approved"
        } else if a.denied.is_some() {
            "denied"
        } else if a.withdrawn {
            "withdrawn"
        } else {
            "pending"
        }
    };
    if !["pending", "approved", "denied", "withdrawn"].contains(&phase.as_str()) {
        return Err(format!(
            "phase {phase:?}: an approval is pending, approved, denied or withdrawn"
        ));
    }
    let picked = all.into_iter().filter(|a| state(a) == phase).collect();
    Ok((picked, page))
}

/// The enrollment states a device list can be filtered by.
const ENROLLMENT: [&str; 4] = ["accepted", "pending", "rejected", "revoked"];

/// The filters of `list_devices` beyond labels and phase: connected or not, enrollment state.
#[derive(Debug, Default)]
pub(super) struct DeviceFilter {
    online: Option<bool>,
    enrollment: Option<String>,
}

impl DeviceFilter {
    pub(super) fn of(page: &PageQuery) -> Result<Self, String> {
        if let Some(e) = &page.enrollment {
            if !ENROLLMENT.contains(&e.as_str()) {
                return Err(format!(
                    "enrollment {e:?}: not an enrollment state; one of {}",
                    ENROLLMENT.join(", ")
                ));
            }
        }
        Ok(Self {
            online: page.online,
            enrollment: page.enrollment.clone(),
        })
    }

    /// Whether `d` passes: its connection, and the state its enrollment text starts with
    /// (`accepted, new key pending` is accepted).
    pub(super) fn matches(&self, d: &DeviceSummary) -> bool {
        let state = d
            .enrollment
            .as_deref()
            .map(|e| e.split(',').next().unwrap_or(e));
        self.online.is_none_or(|o| d.online == o)
            && self
                .enrollment
                .as_deref()
                .is_none_or(|wanted| state == Some(wanted))
    }
}

/// Marks a device overdue when it has been offline for longer than [`OVERDUE_AFTER`] at `now`.
pub(super) fn mark_overdue(mut d: DeviceSummary, now: u64) -> DeviceSummary {
    d.overdue = !d.online
        && d.last_seen
            .is_some_and(|since| now.saturating_sub(since) > OVERDUE_AFTER);
    d
}

/// The selector a page query's `select` names (everything without one).
pub(super) fn selector(page: &PageQuery) -> Result<Selector, String> {
    match &page.select {
        None => Ok(Selector::everything()),
        Some(text) => Selector::parse(text).map_err(|e| format!("select {text:?}: {e}")),
    }
}

/// A list of named things (at most a few thousand, each bounded): the whole list in name order
/// when unpaged, as older coordinators answered; a page of it after the cursor when paged.
pub(super) fn named_list<T: serde::Serialize>(
    mut all: Vec<T>,
    page: &PageQuery,
    list: &str,
    name: impl Fn(&T) -> String,
) -> Result<serde_json::Value, String> {
    if !page.is_paged() {
        return Ok(json(&all));
    }
    all.sort_by_key(|item| name(item));
    refuse_filters(page, &ALL_FILTERS, list)?;
    let after = page.after.as_deref();
    let rest = all
        .into_iter()
        .filter(|item| after.is_none_or(|a| name(item).as_str() > a));
    Ok(json(&Pager::new(page, 0)?.collect(rest, &name)))
}

/// Every filter of a page query: lists of named things have none of them.
pub(super) const ALL_FILTERS: [&str; 5] = ["select", "phase", "group", "online", "enrollment"];

/// Refuses the filters a list has nothing to apply to, naming them.
pub(super) fn refuse_filters(page: &PageQuery, fields: &[&str], list: &str) -> Result<(), String> {
    for field in fields {
        let given = match *field {
            "select" => page.select.is_some(),
            "phase" => page.phase.is_some(),
            "group" => page.group.is_some(),
            "online" => page.online.is_some(),
            "enrollment" => page.enrollment.is_some(),
            _ => false,
        };
        if given {
            return Err(format!("{field}: not a filter of the list of {list}"));
        }
    }
    Ok(())
}

pub(super) fn json<T: serde::Serialize>(value: &T) -> serde_json::Value {
    // The control types are plain data; converting them to a JSON value cannot fail.
    serde_json::to_value(value).unwrap_or(serde_json::Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Approvals, strategies, device groups and releases: unpaged as before, paged in name
    /// order from the cursor, with no filter to apply.
    #[test]
    fn named_lists_page_in_name_order_and_refuse_filters() {
        let names = || {
            vec![
                "c".to_owned(),
                "a".to_owned(),
                "d".to_owned(),
                "b".to_owned(),
            ]
        };
        let unpaged =
            named_list(names(), &PageQuery::default(), "groups", Clone::clone).expect("unpaged");
        assert_eq!(unpaged, serde_json::json!(["c", "a", "d", "b"]));
        let first =
            named_list(names(), &PageQuery::first(3), "groups", Clone::clone).expect("first page");
        assert_eq!(
            first,
            serde_json::json!({"items": ["a", "b", "c"], "next": "c"})
        );
        let rest = PageQuery {
            after: Some("c".into()),
            ..PageQuery::first(3)
        };
        let last = named_list(names(), &rest, "groups", Clone::clone).expect("last page");
        assert_eq!(last, serde_json::json!({"items": ["d"]}));
        let filtered = PageQuery {
            phase: Some("ready".into()),
            ..PageQuery::first(3)
        };
        let err = named_list(names(), &filtered, "device groups", Clone::clone)
            .expect_err("no phase to filter by");
        assert_eq!(err, "phase: not a filter of the list of device groups");
        let online = PageQuery {
            online: Some(true),
            ..PageQuery::first(3)
        };
        let err = named_list(names(), &online, "releases", Clone::clone)
            .expect_err("no connection to filter by");
        assert_eq!(err, "online: not a filter of the list of releases");
    }

    fn device(id: &str, online: bool, enrollment: &str, last_seen: Option<u64>) -> DeviceSummary {
        DeviceSummary {
            id: id.into(),
            hardware_id: "pi4".into(),
            labels: [("site".to_owned(), "berlin".to_owned())].into(),
            online,
            installed: None,
            rollout: None,
            phase: None,
            reason: None,
            enrollment: Some(enrollment.into()),
            last_seen,
            overdue: false,
        }
    }

    /// The devices page filters by connection and enrollment state; a device with a new key
    /// waiting is still accepted; an unknown state is refused, naming the ones there are.
    #[test]
    fn devices_filter_by_connection_and_enrollment() {
        let fleet = [
            device("a", true, "accepted", None),
            device("b", false, "accepted, new key pending", Some(10)),
            device("c", false, "pending", None),
            device("d", false, "revoked", Some(10)),
        ];
        let pick = |page: PageQuery| -> Vec<String> {
            let filter = DeviceFilter::of(&page).expect("a filter");
            fleet
                .iter()
                .filter(|d| filter.matches(d))
                .map(|d| d.id.clone())
                .collect()
        };
        let offline = PageQuery {
            online: Some(false),
            ..PageQuery::default()
        };
        assert_eq!(pick(offline), ["b", "c", "d"]);
        let accepted = PageQuery {
            enrollment: Some("accepted".into()),
            ..PageQuery::default()
        };
        assert_eq!(pick(accepted), ["a", "b"]);
        let both = PageQuery {
            online: Some(false),
            enrollment: Some("accepted".into()),
            ..PageQuery::default()
        };
        assert_eq!(pick(both), ["b"]);
        let bad = PageQuery {
            enrollment: Some("maybe".into()),
            ..PageQuery::default()
        };
        let err = DeviceFilter::of(&bad).expect_err("not a state");
        assert_eq!(
            err,
            "enrollment \"maybe\": not an enrollment state; one of accepted, pending, rejected, revoked"
        );
    }

    /// Offline for longer than the overdue time: marked; online, or offline for less: not.
    #[test]
    fn a_device_offline_too_long_is_overdue() {
        let now = 10_000;
        let long = mark_overdue(
            device("a", false, "accepted", Some(now - OVERDUE_AFTER - 1)),
            now,
        );
        assert!(long.overdue);
        let short = mark_overdue(device("b", false, "accepted", Some(now - 60)), now);
        assert!(!short.overdue);
        let online = mark_overdue(device("c", true, "accepted", None), now);
        assert!(!online.overdue);
        let never = mark_overdue(device("d", false, "pending", None), now);
        assert!(
            !never.overdue,
            "a device never heard from has no time to be late by"
        );
    }
}
