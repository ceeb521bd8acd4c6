//! How simulated devices answer and what operators do when: the script file, validated.

use serde::Deserialize;

use crate::cli::simulate::base::*;
use flotilla_rollout::duration::parse_duration;
use flotilla_rollout::planner::{FleetDevice, PlanDevice};
use flotilla_rollout::selector::Selector;

// ---------------------------------------------------------------------------------------------
// Outcomes

/// How a device answers a desired action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Ready this many seconds after the action arrived.
    Ready { after: u64 },
    /// Failed (rolled back) this many seconds after the action arrived.
    Fail { after: u64, reason: String },
    /// Accepts nothing and reports nothing.
    Silent,
}

/// A device's script: its answer, and when (seconds after the start) it goes offline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Script {
    pub answer: Answer,
    pub offline_at: Option<u64>,
}

/// Which devices a rule applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Id(String),
    Select(Selector),
}

/// One `[[device]]` rule; its unset parts come from the default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub target: Target,
    pub answer: Option<Answer>,
    pub offline_at: Option<u64>,
}

/// What an operator does during the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OperatorAction {
    Approve(String),
    Pause,
    Resume,
    Stop,
    /// `rollout next`; with `true`, `rollout next --skip-approval`.
    Next {
        skip_approval: bool,
    },
}

/// An operator action at a time (seconds after the start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorEvent {
    pub at: u64,
    pub action: OperatorAction,
}

/// The parsed outcomes file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcomes {
    pub default: Script,
    /// The first rule that matches a device wins.
    pub rules: Vec<Rule>,
    pub operator: Vec<OperatorEvent>,
}

impl Default for Outcomes {
    fn default() -> Self {
        Outcomes {
            default: Script {
                answer: Answer::Ready {
                    after: DEFAULT_READY_AFTER,
                },
                offline_at: None,
            },
            rules: Vec::new(),
            operator: Vec::new(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOutcomes {
    #[serde(default)]
    pub(super) default: Option<RawScript>,
    #[serde(default)]
    pub(super) device: Vec<RawScript>,
    #[serde(default)]
    pub(super) operator: Vec<RawOperator>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawScript {
    #[serde(default)]
    pub(super) id: Option<String>,
    #[serde(default)]
    pub(super) select: Option<String>,
    #[serde(default)]
    pub(super) ready_after: Option<String>,
    #[serde(default)]
    pub(super) fail_after: Option<String>,
    #[serde(default)]
    pub(super) reason: Option<String>,
    #[serde(default)]
    pub(super) silent: Option<bool>,
    #[serde(default)]
    pub(super) offline_at: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOperator {
    pub(super) at: String,
    #[serde(default)]
    pub(super) approve: Option<String>,
    #[serde(default)]
    pub(super) command: Option<String>,
    /// Only with `command = "next"`: as `rollout next --skip-approval`.
    #[serde(default)]
    pub(super) skip_approval: bool,
}

pub(super) fn duration(field: &str, value: &str) -> Result<u64, String> {
    parse_duration(value).map_err(|reason| format!("{field}: {value:?}: {reason}"))
}

impl RawScript {
    pub(super) fn answer(&self, field: &str) -> Result<Option<Answer>, String> {
        let set = [
            self.ready_after.is_some(),
            self.fail_after.is_some(),
            self.silent.is_some(),
        ];
        if set.iter().filter(|s| **s).count() > 1 {
            return Err(format!(
                "{field}: set only one of ready_after, fail_after and silent"
            ));
        }
        if self.reason.is_some() && self.fail_after.is_none() {
            return Err(format!(
                "{field}.reason: only a fail_after rule has a reason"
            ));
        }
        Ok(if let Some(v) = &self.ready_after {
            Some(Answer::Ready {
                after: duration(&format!("{field}.ready_after"), v)?,
            })
        } else if let Some(v) = &self.fail_after {
            Some(Answer::Fail {
                after: duration(&format!("{field}.fail_after"), v)?,
                reason: self
                    .reason
                    .clone()
                    .unwrap_or_else(|| "scripted failure".to_owned()),
            })
        } else {
            match self.silent {
                Some(true) => Some(Answer::Silent),
                Some(false) => {
                    return Err(format!(
                        "{field}.silent: false says nothing; leave it out or set ready_after"
                    ))
                }
                None => None,
            }
        })
    }

    pub(super) fn offline_at(&self, field: &str) -> Result<Option<u64>, String> {
        self.offline_at
            .as_deref()
            .map(|v| duration(&format!("{field}.offline_at"), v))
            .transpose()
    }
}

impl Outcomes {
    /// Parses and validates an outcomes file; errors name the entry and field.
    pub fn from_toml(text: &str) -> Result<Outcomes, SimError> {
        let raw: RawOutcomes =
            toml::from_str(text).map_err(|e| SimError::Outcomes(e.to_string()))?;
        Self::validate(raw).map_err(SimError::Outcomes)
    }

    pub(super) fn validate(raw: RawOutcomes) -> Result<Outcomes, String> {
        let mut out = Outcomes::default();
        if let Some(d) = raw.default {
            if d.id.is_some() || d.select.is_some() {
                return Err(
                    "default: applies to every device; move id/select into a [[device]] rule"
                        .into(),
                );
            }
            if let Some(answer) = d.answer("default")? {
                out.default.answer = answer;
            }
            out.default.offline_at = d.offline_at("default")?;
        }
        for (i, d) in raw.device.iter().enumerate() {
            let field = format!("device[{i}]");
            let target = match (&d.id, &d.select) {
                (Some(id), None) => Target::Id(id.clone()),
                (None, Some(sel)) => Target::Select(
                    Selector::parse(sel).map_err(|e| format!("{field}.select: {e}"))?,
                ),
                _ => return Err(format!("{field}: set exactly one of id and select")),
            };
            let answer = d.answer(&field)?;
            let offline_at = d.offline_at(&field)?;
            if answer.is_none() && offline_at.is_none() {
                return Err(format!(
                    "{field}: says nothing; set ready_after, fail_after, silent or offline_at"
                ));
            }
            out.rules.push(Rule {
                target,
                answer,
                offline_at,
            });
        }
        for (i, o) in raw.operator.iter().enumerate() {
            let field = format!("operator[{i}]");
            let at = duration(&format!("{field}.at"), &o.at)?;
            if o.skip_approval && o.command.as_deref() != Some("next") {
                return Err(format!(
                    "{field}.skip_approval: only with command = \"next\""
                ));
            }
            let action = match (&o.approve, o.command.as_deref()) {
                (Some(name), None) => OperatorAction::Approve(name.clone()),
                (None, Some("pause")) => OperatorAction::Pause,
                (None, Some("resume")) => OperatorAction::Resume,
                (None, Some("stop")) => OperatorAction::Stop,
                (None, Some("next")) => OperatorAction::Next {
                    skip_approval: o.skip_approval,
                },
                (None, Some(other)) => {
                    return Err(format!(
                        "{field}.command: {other:?} is not one of pause, resume, stop, next"
                    ))
                }
                _ => return Err(format!("{field}: set exactly one of approve and command")),
            };
            out.operator.push(OperatorEvent { at, action });
        }
        Ok(out)
    }

    /// The script of one device: the first matching rule over the default.
    pub fn script_for(&self, device: &FleetDevice) -> Script {
        self.scripts().swap_remove(self.rule_for(device))
    }

    /// Which script of [`Outcomes::scripts`] a device follows: 0 for the default, `i + 1` for
    /// rule `i`.
    pub(super) fn rule_for<D: PlanDevice + ?Sized>(&self, device: &D) -> usize {
        self.rules
            .iter()
            .position(|r| match &r.target {
                Target::Id(id) => id == device.id(),
                Target::Select(sel) => sel.matches(device.labels()),
            })
            .map_or(0, |i| i + 1)
    }

    /// The default script, then each rule's over the default.
    pub(super) fn scripts(&self) -> Vec<Script> {
        let mut scripts = vec![self.default.clone()];
        for rule in &self.rules {
            let mut script = self.default.clone();
            if let Some(answer) = &rule.answer {
                script.answer = answer.clone();
            }
            if rule.offline_at.is_some() {
                script.offline_at = rule.offline_at;
            }
            scripts.push(script);
        }
        scripts
    }
}
