//! The rollout spec: the TOML an operator writes, validated into a [`RolloutSpec`].
//!
//! Parsing happens in two steps: serde reads the raw TOML into private structs that refuse
//! unknown fields (so a typo is an error, not a silently ignored setting), then validation turns
//! them into the public types, naming the field and the value in every error. The validated spec
//! is serializable because it is stored with the rollout.
//!
//! Today the only strategy is hawkBit's deployment groups (`[groups]`). Rancher Fleet partitions,
//! KubeFleet rolling updates and staged runs will arrive as further [`Strategy`] variants that
//! compile into the same ordered groups with conditions, which is why the conditions live on each
//! [`GroupSpec`] rather than on the strategy.
//!
//! ```toml
//! name = "fw-2-4"
//! release = "fw-2.4.0"
//! select = "hw=pi4"
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

use crate::selector::{Selector, SelectorError};

pub use crate::plan::{
    Budget, ErrorAction, ErrorCondition, Percent, Policies, SuccessAction, SuccessCondition,
    Threshold,
};

/// Most groups a spec may define: a typo like `count = 30000` should fail, not plan 30,000 groups.
pub const MAX_GROUPS: u32 = 1000;

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

/// How the selected devices are split into ordered groups.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// hawkBit deployment groups.
    Groups(GroupsSpec),
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
    #[error("groups: set either `count` or `[[groups.group]]` entries, not both")]
    CountAndList,
    #[error("groups: set `count` or at least one `[[groups.group]]` entry")]
    NoGroups,
    #[error("groups.count: {value} is not from 1 to {MAX_GROUPS}")]
    Count { value: i64 },
    #[error("groups.group: more than {MAX_GROUPS} groups ({count})")]
    TooManyGroups { count: usize },
    #[error("{field}: group name {name:?} is already used by groups.group[{first}]")]
    DuplicateGroup {
        field: String,
        name: String,
        first: usize,
    },
}

impl RolloutSpec {
    /// Parses and validates a TOML rollout spec.
    pub fn from_toml(text: &str) -> Result<RolloutSpec, SpecError> {
        let raw: RawSpec = toml::from_str(text).map_err(|e| SpecError::Toml {
            message: e.to_string(),
        })?;
        raw.validate()
    }

    /// The hawkBit groups of the spec (the only strategy so far).
    pub fn groups(&self) -> &GroupsSpec {
        match &self.strategy {
            Strategy::Groups(g) => g,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpec {
    name: String,
    release: String,
    #[serde(default)]
    select: Option<String>,
    groups: RawGroups,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGroups {
    #[serde(default)]
    count: Option<i64>,
    #[serde(default)]
    success: Option<RawCondition>,
    #[serde(default)]
    error: Option<RawCondition>,
    #[serde(default)]
    group: Vec<RawGroup>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGroup {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    select: Option<String>,
    #[serde(default)]
    percent: Option<RawNumber>,
    #[serde(default)]
    success: Option<RawCondition>,
    #[serde(default)]
    error: Option<RawCondition>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCondition {
    #[serde(default)]
    threshold: Option<RawNumber>,
    #[serde(default)]
    action: Option<String>,
}

/// A percentage as written: `25`, `12.5` or `"25%"`.
#[derive(Deserialize)]
#[serde(untagged)]
enum RawNumber {
    Int(i64),
    Float(f64),
    Text(String),
}

impl RawNumber {
    /// How the value looked in the TOML, for error messages.
    fn shown(&self) -> String {
        match self {
            RawNumber::Int(i) => i.to_string(),
            RawNumber::Float(f) => f.to_string(),
            RawNumber::Text(s) => format!("{s:?}"),
        }
    }

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

impl RawCondition {
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
            Some("next") => SuccessAction::Next,
            Some("pause") => SuccessAction::Pause,
            Some(other) => {
                return Err(SpecError::Action {
                    field: format!("{field}.action"),
                    value: other.to_owned(),
                    allowed: "\"next\", \"pause\"",
                })
            }
        };
        Ok(SuccessCondition { threshold, action })
    }

    fn error(&self, field: &str) -> Result<ErrorCondition, SpecError> {
        // An error condition without a threshold would fire on the first failure; say 0% to mean that.
        let threshold = match &self.threshold {
            Some(t) => t.percent(format!("{field}.threshold"), Percent::ZERO)?,
            None => Percent::ZERO,
        };
        let action = match self.action.as_deref() {
            None | Some("pause") => ErrorAction::Pause,
            Some(other) => {
                return Err(SpecError::Action {
                    field: format!("{field}.action"),
                    value: other.to_owned(),
                    allowed: "\"pause\"",
                })
            }
        };
        Ok(ErrorCondition {
            percent: Some(threshold),
            action,
            ..ErrorCondition::default()
        })
    }
}

impl RawSpec {
    fn validate(self) -> Result<RolloutSpec, SpecError> {
        flotilla_protocol::validate_id("rollout name", &self.name).map_err(|source| {
            SpecError::Id {
                field: "name".into(),
                source,
            }
        })?;
        flotilla_protocol::validate_id("release name", &self.release).map_err(|source| {
            SpecError::Id {
                field: "release".into(),
                source,
            }
        })?;
        let select = selector("select", self.select.as_deref())?;

        let g = self.groups;
        let success = match &g.success {
            Some(c) => c.success("groups.success", &SuccessCondition::default())?,
            None => SuccessCondition::default(),
        };
        let error = g
            .error
            .as_ref()
            .map(|c| c.error("groups.error"))
            .transpose()?;

        let groups = match (g.count, g.group.is_empty()) {
            (Some(_), false) => return Err(SpecError::CountAndList),
            (None, true) => return Err(SpecError::NoGroups),
            (Some(count), true) => {
                let count = u32::try_from(count)
                    .ok()
                    .filter(|c| (1..=MAX_GROUPS).contains(c))
                    .ok_or(SpecError::Count { value: count })?;
                GroupsSpec::Count {
                    count,
                    success,
                    error,
                }
            }
            (None, false) => {
                if g.group.len() > MAX_GROUPS as usize {
                    return Err(SpecError::TooManyGroups {
                        count: g.group.len(),
                    });
                }
                let mut list: Vec<GroupSpec> = Vec::with_capacity(g.group.len());
                for (i, raw) in g.group.into_iter().enumerate() {
                    let field = format!("groups.group[{i}]");
                    let name = raw.name.unwrap_or_else(|| format!("group-{}", i + 1));
                    flotilla_protocol::validate_id("group name", &name).map_err(|source| {
                        SpecError::Id {
                            field: format!("{field}.name"),
                            source,
                        }
                    })?;
                    if let Some(first) = list.iter().position(|g| g.name == name) {
                        return Err(SpecError::DuplicateGroup {
                            field: format!("{field}.name"),
                            name,
                            first,
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
                GroupsSpec::List(list)
            }
        };
        Ok(RolloutSpec {
            name: self.name,
            release: self.release,
            select,
            strategy: Strategy::Groups(groups),
            policies: Policies::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> RolloutSpec {
        RolloutSpec::from_toml(text).unwrap_or_else(|e| panic!("spec should parse: {e}\n{text}"))
    }

    fn error(text: &str) -> String {
        match RolloutSpec::from_toml(text) {
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
        let GroupsSpec::List(groups) = spec.groups() else {
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
            &GroupsSpec::Count {
                count: 3,
                success: SuccessCondition::default(),
                error: None
            }
        );
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
            let GroupsSpec::Count { success, .. } = spec.groups() else {
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
                "[groups]\ncount = 1\nerror = { action = \"stop\" }\n",
                "groups.error.action: \"stop\" is not one of \"pause\"",
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
}
