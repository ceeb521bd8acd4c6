//! From the TOML as written to a [`RolloutSpec`]: the rollout-wide policies and each of the
//! four vocabularies, checked as a whole.

use crate::plan::{
    ActionType, Budget, ErrorAction, ErrorCondition, Gate, OfflinePolicy, Percent, Policies,
    RateLimit, Retry, SuccessCondition, UnknownDevices, WindowSpec, DEFAULT_WEIGHT,
};
use crate::spec::raw::*;
use crate::spec::types::*;
use crate::window::Window;
use crate::zoneinfo::ZoneSource;

impl RolloutSpec {
    /// Parses and validates a TOML rollout spec; maintenance windows look their time zones up
    /// in `zones`.
    pub fn from_toml(text: &str, zones: &dyn ZoneSource) -> Result<RolloutSpec, SpecError> {
        let raw: RawSpec = toml::from_str(text).map_err(|e| SpecError::Toml {
            message: e.to_string(),
        })?;
        raw.validate(zones)
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
