//! The paged lists of the control API: devices, a rollout's devices, named lists.

use flotilla_protocol::control::{DeviceSummary, PageQuery, RolloutPage};

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
    pub(super) fn device_list(&self) -> Vec<DeviceSummary> {
        self.devices_after(None).collect()
    }

    /// [`Service::device_list`] after the device id `after`, in id order, read lazily from the
    /// engine's and the registry's sorted maps. The two are walked side by side, so a page costs
    /// its own devices (and the registry records between them), not the fleet.
    pub(super) fn devices_after<'a>(
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
                    let Some(info) = self.registry.info(&record.device) else {
                        continue;
                    };
                    return Some(DeviceSummary {
                        id: record.device.clone(),
                        hardware_id: info.hardware_id.unwrap_or_default(),
                        labels: info.labels,
                        online: false,
                        installed: None,
                        rollout: None,
                        phase: None,
                        reason: None,
                        enrollment: self.registry.status_text(&record.device).map(|status| {
                            if record.status == Status::Accepted {
                                format!("{status}, {NO_STATE}")
                            } else {
                                status
                            }
                        }),
                    });
                }
            }
        })
    }

    /// A page of `list_devices`: `select` and `phase` filter, `group` names a stored device
    /// group whose selector the devices must match.
    pub(super) fn device_page(
        &self,
        page: &PageQuery,
    ) -> Result<flotilla_protocol::control::Page<DeviceSummary>, String> {
        let select = selector(page)?;
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
            .devices_after(page.after.as_deref())
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
    refuse_filters(page, &["select", "phase", "group"], list)?;
    let after = page.after.as_deref();
    let rest = all
        .into_iter()
        .filter(|item| after.is_none_or(|a| name(item).as_str() > a));
    Ok(json(&Pager::new(page, 0)?.collect(rest, &name)))
}

/// Refuses the filters a list has nothing to apply to, naming them.
pub(super) fn refuse_filters(page: &PageQuery, fields: &[&str], list: &str) -> Result<(), String> {
    for field in fields {
        let given = match *field {
            "select" => page.select.is_some(),
            "phase" => page.phase.is_some(),
            "group" => page.group.is_some(),
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
    }
}
