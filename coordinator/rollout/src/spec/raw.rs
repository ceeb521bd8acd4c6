//! The spec's TOML as written: private structs that refuse unknown fields, and the checks of
//! single fields (numbers, durations, times, selectors, ids) that name the field and value.

use serde::Deserialize;

use crate::duration::parse_duration;
use crate::plan::{
    Budget, ErrorAction, ErrorCondition, FailureClasses, Percent, SitePolicy, SuccessAction,
    SuccessCondition, Threshold, DEFAULT_SEED_WAIT,
};
use crate::selector::Selector;
use crate::spec::types::*;

// ---------------------------------------------------------------------------------------------
// Raw TOML

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSpec {
    pub(super) name: String,
    pub(super) release: String,
    pub(super) select: Option<String>,
    pub(super) action: Option<String>,
    pub(super) force_at: Option<toml::Value>,
    pub(super) start_at: Option<toml::Value>,
    pub(super) weight: Option<i64>,
    pub(super) timeout: Option<toml::Value>,
    pub(super) retry: Option<RawRetry>,
    pub(super) offline: Option<toml::Value>,
    pub(super) rate: Option<RawRate>,
    pub(super) soak: Option<toml::Value>,
    pub(super) unavailable_period: Option<toml::Value>,
    pub(super) unknown_devices: Option<String>,
    #[serde(default)]
    pub(super) window: Vec<RawWindow>,
    pub(super) groups: Option<RawGroups>,
    pub(super) partitions: Option<RawPartitions>,
    pub(super) rolling: Option<RawRolling>,
    pub(super) staged: Option<RawStaged>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRetry {
    pub(super) attempts: i64,
    pub(super) backoff: Option<toml::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRate {
    pub(super) base: toml::Value,
    pub(super) factor: Option<toml::Value>,
    pub(super) every: Option<i64>,
    pub(super) max: Option<toml::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWindow {
    pub(super) cron: String,
    pub(super) duration: toml::Value,
    pub(super) tz: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawGroups {
    pub(super) count: Option<i64>,
    pub(super) success: Option<RawSuccess>,
    pub(super) error: Option<RawError>,
    pub(super) dynamic: Option<bool>,
    pub(super) sites: Option<RawSites>,
    #[serde(default)]
    pub(super) group: Vec<RawGroup>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawGroup {
    pub(super) name: Option<String>,
    pub(super) select: Option<String>,
    pub(super) percent: Option<RawNumber>,
    pub(super) success: Option<RawSuccess>,
    pub(super) error: Option<RawError>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPartitions {
    pub(super) max_unavailable: Option<RawNumber>,
    pub(super) max_unavailable_partitions: Option<RawNumber>,
    pub(super) auto_partition_size: Option<RawNumber>,
    pub(super) auto_partition_threshold: Option<i64>,
    pub(super) max_new: Option<i64>,
    pub(super) error: Option<RawError>,
    pub(super) sites: Option<RawSites>,
    #[serde(default)]
    pub(super) partition: Vec<RawPartition>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPartition {
    pub(super) name: Option<String>,
    pub(super) max_unavailable: Option<RawNumber>,
    pub(super) devices: Option<Vec<String>>,
    pub(super) select: Option<String>,
    pub(super) group: Option<String>,
    pub(super) group_select: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRolling {
    pub(super) max_unavailable: Option<RawNumber>,
    pub(super) unavailable_period: Option<toml::Value>,
    pub(super) pick: Option<toml::Value>,
    pub(super) error: Option<RawError>,
    pub(super) sites: Option<RawSites>,
    /// Read only to refuse it with a reason rather than as an unknown field.
    pub(super) max_surge: Option<toml::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStaged {
    pub(super) strategy: Option<String>,
    #[serde(default)]
    pub(super) stage: Vec<RawStage>,
    pub(super) error: Option<RawError>,
    pub(super) sites: Option<RawSites>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStrategyFile {
    #[serde(default)]
    pub(super) stage: Vec<RawStage>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStage {
    pub(super) name: String,
    pub(super) select: Option<String>,
    pub(super) sort_by: Option<String>,
    pub(super) max_concurrency: Option<i64>,
    pub(super) before: Option<RawGate>,
    pub(super) after: Option<RawGate>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawGate {
    pub(super) approval: Option<bool>,
    pub(super) wait: Option<toml::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSuccess {
    pub(super) threshold: Option<RawNumber>,
    pub(super) action: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawError {
    pub(super) threshold: Option<RawNumber>,
    pub(super) count: Option<i64>,
    pub(super) min_sample: Option<i64>,
    pub(super) classes: Option<Vec<String>>,
    pub(super) action: Option<String>,
}

/// A vocabulary's `sites` table. Each vocabulary names the busy limit with its own word for
/// devices at work (see [`SITE_BUSY_KEYS`]); the others are refused with a pointer to it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSites {
    pub(super) label: Option<String>,
    pub(super) max_running: Option<i64>,
    pub(super) max_busy: Option<i64>,
    pub(super) max_concurrency: Option<i64>,
    pub(super) max_unavailable: Option<i64>,
    pub(super) peers: Option<bool>,
    pub(super) seed_wait: Option<toml::Value>,
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
pub(super) enum RawNumber {
    Int(i64),
    Float(f64),
    Text(String),
}

// ---------------------------------------------------------------------------------------------
// Field parsers

impl RawNumber {
    /// How the value looked in the TOML, for error messages.
    pub(super) fn shown(&self) -> String {
        match self {
            RawNumber::Int(i) => i.to_string(),
            RawNumber::Float(f) => f.to_string(),
            RawNumber::Text(s) => format!("{s:?}"),
        }
    }

    /// A percentage: a bare number means percent (`25` is 25%).
    pub(super) fn percent(&self, field: String, min: Percent) -> Result<Percent, SpecError> {
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
    pub(super) fn budget(&self, field: String, min: usize) -> Result<Budget, SpecError> {
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

pub(super) fn selector(field: &str, text: Option<&str>) -> Result<Selector, SpecError> {
    match text {
        None => Ok(Selector::everything()),
        Some(t) => Selector::parse(t).map_err(|source| SpecError::Selector {
            field: field.to_owned(),
            source,
        }),
    }
}

pub(super) fn id(what: &'static str, field: String, value: &str) -> Result<(), SpecError> {
    flotilla_protocol::validate_id(what, value).map_err(|source| SpecError::Id { field, source })
}

/// An integer in `range`, e.g. `max_new` at least 1.
pub(super) fn integer(
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
pub(super) fn count(field: &str, value: i64, min: usize) -> Result<usize, SpecError> {
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
pub(super) fn duration(field: &str, value: &toml::Value) -> Result<u64, SpecError> {
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
pub(super) fn time(field: &str, value: &toml::Value) -> Result<u64, SpecError> {
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

pub(super) fn enumerated<T: Copy>(
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
    pub(super) fn success(
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
    pub(super) fn error(&self, field: &str) -> Result<ErrorCondition, SpecError> {
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
    pub(super) fn validate(&self, table: &str) -> Result<SitePolicy, SpecError> {
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

pub(super) fn error_condition(
    field: &str,
    raw: Option<&RawError>,
) -> Result<Option<ErrorCondition>, SpecError> {
    raw.map(|e| e.error(field)).transpose()
}
