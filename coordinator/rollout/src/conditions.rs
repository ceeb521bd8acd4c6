//! A group's counts and its success and error conditions, evaluated as pure functions so the
//! engine, the simulator and the tests agree on the numbers and on the words of the decision
//! trace ("3 of 20 failed > 10%").

use flotilla_protocol::control::Compared;
use serde::{Deserialize, Serialize};

use crate::plan::{ErrorCondition, SuccessCondition, Threshold};

/// Where a group's devices stand, kept up to date incrementally by the engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupCounts {
    pub total: usize,
    /// Not yet sent a desired action.
    pub scheduled: usize,
    /// Sent, and not in a terminal phase yet (including devices waiting for a retry).
    pub in_progress: usize,
    /// Ready, but not yet for the rollout's whole soak time.
    #[serde(default)]
    pub soaking: usize,
    /// Ready (and soaked).
    pub ready: usize,
    /// Reported Failed, with no retry left.
    pub failed: usize,
    #[serde(default)]
    pub refused: usize,
    /// In progress past the rollout's timeout, or offline past its grace.
    #[serde(default)]
    pub timed_out: usize,
    pub canceled: usize,
    /// Left out because they were offline when their turn came (offline policy `skip`).
    #[serde(default)]
    pub skipped: usize,
}

impl GroupCounts {
    /// Devices whose action is not over.
    pub fn pending(&self) -> usize {
        self.scheduled + self.in_progress + self.soaking
    }

    /// Failures of every class.
    pub fn failures(&self) -> usize {
        self.failed + self.refused + self.timed_out
    }

    /// Devices that were started and are not ready: Fleet's NotReady, KubeFleet's unavailable.
    pub fn not_ready(&self) -> usize {
        self.in_progress + self.soaking + self.failures()
    }

    /// The devices that count toward the group's shares: skipped devices are left out.
    pub fn effective_total(&self) -> usize {
        self.total.saturating_sub(self.skipped)
    }
}

/// Whether a condition holds, and the numbers behind it in words and as fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evaluation {
    pub met: bool,
    /// e.g. "4 of 4 ready >= 100%" or "3 of 20 failed > 10%".
    pub reason: String,
    /// The same numbers for the trace's `compared` field.
    pub compared: Compared,
}

/// One comparison: `count` of `of` were `counted`, `count op threshold`.
fn compare(
    counted: &str,
    count: usize,
    of: usize,
    op: &str,
    threshold: String,
    met: bool,
) -> Compared {
    Compared {
        counted: counted.to_owned(),
        count: count as u64,
        of: of as u64,
        op: op.to_owned(),
        threshold,
        met,
    }
}

/// The success condition. A share holds when the ready share is at least the threshold (an
/// empty group succeeds at once); `AllBut` holds when every device was started and at most the
/// budget is not ready.
pub fn success_met(cond: &SuccessCondition, counts: &GroupCounts) -> Evaluation {
    let total = counts.effective_total();
    match cond.threshold {
        Threshold::Share(share) => {
            let met = share.reached_by(counts.ready, total);
            let op = if met { ">=" } else { "<" };
            Evaluation {
                met,
                reason: format!("{} of {total} ready {op} {share}", counts.ready),
                compared: compare("ready", counts.ready, total, op, share.to_string(), met),
            }
        }
        Threshold::AllBut(budget) => {
            let allowed = budget.of(total);
            let not_ready = counts.not_ready();
            if counts.scheduled > 0 {
                return Evaluation {
                    met: false,
                    reason: format!("{} of {total} not started yet", counts.scheduled),
                    compared: compare(
                        "not_started",
                        counts.scheduled,
                        total,
                        ">",
                        "0".into(),
                        false,
                    ),
                };
            }
            let met = not_ready <= allowed;
            let op = if met { "<=" } else { ">" };
            Evaluation {
                met,
                reason: format!(
                    "{not_ready} of {total} not ready {op} {allowed} allowed ({budget})"
                ),
                compared: compare("not_ready", not_ready, total, op, allowed.to_string(), met),
            }
        }
    }
}

/// Whether the success condition holds: [`success_met`]'s `met` without the words, for the
/// check made after every report.
pub fn success_holds(cond: &SuccessCondition, counts: &GroupCounts) -> bool {
    let total = counts.effective_total();
    match cond.threshold {
        Threshold::Share(share) => share.reached_by(counts.ready, total),
        Threshold::AllBut(budget) => {
            counts.scheduled == 0 && counts.not_ready() <= budget.of(total)
        }
    }
}

/// Whether the error condition holds: [`error_met`]'s `met` without the words, for the check
/// made after every report.
pub fn error_holds(cond: &ErrorCondition, counts: &GroupCounts) -> bool {
    let total = counts.effective_total();
    let classes = cond.classes;
    let failures = if classes.failed { counts.failed } else { 0 }
        + if classes.refused { counts.refused } else { 0 }
        + if classes.timed_out {
            counts.timed_out
        } else {
            0
        };
    let ended = counts.ready + counts.soaking + counts.failures();
    ended >= cond.min_sample
        && (cond.count.is_some_and(|count| failures >= count)
            || cond
                .percent
                .is_some_and(|percent| percent.exceeded_by(failures, total)))
}

/// The error condition: at least `min_sample` devices ended, and the failures of the counted
/// classes are strictly more than the percentage of the group or at least the count. A 0%
/// threshold fires on the first failure; an empty group never fails.
pub fn error_met(cond: &ErrorCondition, counts: &GroupCounts) -> Evaluation {
    let total = counts.effective_total();
    let classes = cond.classes;
    let failures = if classes.failed { counts.failed } else { 0 }
        + if classes.refused { counts.refused } else { 0 }
        + if classes.timed_out {
            counts.timed_out
        } else {
            0
        };
    let what = failure_words(cond);
    let ended = counts.ready + counts.soaking + counts.failures();
    if ended < cond.min_sample {
        return Evaluation {
            met: false,
            reason: format!(
                "{failures} of {total} {what}, but only {ended} ended < minimum sample {}",
                cond.min_sample
            ),
            compared: compare(
                "ended",
                ended,
                total,
                "<",
                cond.min_sample.to_string(),
                false,
            ),
        };
    }
    if let Some(count) = cond.count {
        if failures >= count {
            return Evaluation {
                met: true,
                reason: format!("{failures} of {total} {what} >= {count}"),
                compared: compare(&what, failures, total, ">=", count.to_string(), true),
            };
        }
    }
    if let Some(percent) = cond.percent {
        if percent.exceeded_by(failures, total) {
            return Evaluation {
                met: true,
                reason: format!("{failures} of {total} {what} > {percent}"),
                compared: compare(&what, failures, total, ">", percent.to_string(), true),
            };
        }
    }
    let mut limits = Vec::new();
    if let Some(p) = cond.percent {
        limits.push(p.to_string());
    }
    if let Some(c) = cond.count {
        limits.push(format!("below {c}"));
    }
    let limits = limits.join(" and ");
    Evaluation {
        met: false,
        reason: format!("{failures} of {total} {what} <= {limits}"),
        compared: compare(&what, failures, total, "<=", limits, false),
    }
}

/// "failed", or the counted classes in words when not all are counted.
fn failure_words(cond: &ErrorCondition) -> String {
    let c = cond.classes;
    if c.failed && c.refused && c.timed_out {
        return "failed".into();
    }
    let mut words = Vec::new();
    if c.failed {
        words.push("failed");
    }
    if c.timed_out {
        words.push("timed out");
    }
    if c.refused {
        words.push("refused");
    }
    if words.is_empty() {
        return "failed (no class counted)".into();
    }
    words.join(" or ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Budget, ErrorAction, FailureClasses, Percent, SuccessAction};

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

    fn share(p: u32) -> SuccessCondition {
        SuccessCondition {
            threshold: Threshold::Share(pct(p)),
            action: SuccessAction::Next,
        }
    }

    fn error(percent: Option<u32>, count: Option<usize>, min_sample: usize) -> ErrorCondition {
        ErrorCondition {
            percent: percent.map(pct),
            count,
            min_sample,
            classes: FailureClasses::default(),
            action: ErrorAction::Pause,
        }
    }

    #[test]
    fn the_quick_checks_agree_with_the_evaluations() {
        let mut errors = Vec::new();
        for percent in [None, Some(0), Some(10), Some(50)] {
            for count in [None, Some(1), Some(3)] {
                for min_sample in [0, 2, 6] {
                    errors.push(error(percent, count, min_sample));
                }
            }
        }
        let successes = [
            share(100),
            share(60),
            SuccessCondition {
                threshold: Threshold::AllBut(Budget::Count(1)),
                action: SuccessAction::Next,
            },
        ];
        for total in 0..8 {
            for ready in 0..=total {
                for failed in 0..=total - ready {
                    for scheduled in 0..=(total - ready - failed).min(1) {
                        let mut c = counts(total, ready, failed);
                        c.in_progress -= scheduled;
                        c.scheduled = scheduled;
                        for e in &errors {
                            assert_eq!(error_holds(e, &c), error_met(e, &c).met, "{e:?} {c:?}");
                        }
                        for s in &successes {
                            assert_eq!(success_holds(s, &c), success_met(s, &c).met, "{c:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn success_needs_the_threshold_share_ready() {
        assert_eq!(
            success_met(&share(100), &counts(4, 4, 0)),
            Evaluation {
                met: true,
                reason: "4 of 4 ready >= 100%".into(),
                compared: compare("ready", 4, 4, ">=", "100%".into(), true),
            }
        );
        assert_eq!(
            success_met(&share(100), &counts(4, 3, 1)).reason,
            "3 of 4 ready < 100%"
        );
        assert!(success_met(&share(75), &counts(4, 3, 0)).met);
        assert!(!success_met(&share(75), &counts(5, 3, 0)).met);
        assert!(
            success_met(&share(100), &counts(0, 0, 0)).met,
            "an empty group succeeds"
        );
        let mut skipped = counts(4, 3, 0);
        skipped.in_progress = 0;
        skipped.skipped = 1;
        assert!(
            success_met(&share(100), &skipped).met,
            "skipped devices leave the group's total"
        );
    }

    #[test]
    fn all_but_needs_every_device_started_and_few_not_ready() {
        let fleet = SuccessCondition {
            threshold: Threshold::AllBut(Budget::Percent(pct(10))),
            action: SuccessAction::Next,
        };
        // 40 devices, 10%: more than 4 not ready is NotReady.
        let mut c = counts(40, 35, 0);
        assert_eq!(
            success_met(&fleet, &c).reason,
            "5 of 40 not ready > 4 allowed (10%)"
        );
        c.ready = 36;
        c.in_progress = 4;
        assert!(success_met(&fleet, &c).met);
        c.scheduled = 1;
        c.ready = 35;
        assert!(!success_met(&fleet, &c).met, "a device not started yet");
    }

    #[test]
    fn error_by_percent_count_and_minimum_sample() {
        assert_eq!(
            error_met(&error(Some(10), None, 0), &counts(20, 0, 3)),
            Evaluation {
                met: true,
                reason: "3 of 20 failed > 10%".into(),
                compared: compare("failed", 3, 20, ">", "10%".into(), true),
            }
        );
        assert_eq!(
            error_met(&error(Some(10), None, 0), &counts(20, 0, 2)).reason,
            "2 of 20 failed <= 10%"
        );
        assert!(!error_met(&error(Some(0), None, 0), &counts(5, 0, 0)).met);
        assert!(error_met(&error(Some(0), None, 0), &counts(5, 0, 1)).met);
        assert!(!error_met(&error(Some(0), None, 0), &counts(0, 0, 0)).met);
        // A count fires at the count even when the share is small.
        let e = error_met(&error(Some(50), Some(2), 0), &counts(100, 10, 2));
        assert_eq!(e.reason, "2 of 100 failed >= 2");
        assert_eq!(
            (
                e.compared.count,
                e.compared.of,
                e.compared.op.as_str(),
                e.compared.threshold.as_str()
            ),
            (2, 100, ">=", "2")
        );
        let e = error_met(&error(Some(50), Some(9), 0), &counts(100, 10, 2));
        assert_eq!(e.compared.threshold, "50% and below 9");
        // Below the minimum sample nothing fires, however bad it looks.
        let e = error_met(&error(Some(0), None, 5), &counts(100, 1, 2));
        assert!(!e.met, "{}", e.reason);
        assert!(e.reason.contains("only 3 ended < minimum sample 5"));
        assert!(error_met(&error(Some(0), None, 5), &counts(100, 3, 2)).met);
    }

    #[test]
    fn error_counts_only_the_chosen_classes() {
        let mut cond = error(None, Some(1), 0);
        cond.classes = FailureClasses {
            failed: false,
            timed_out: true,
            refused: false,
        };
        let mut c = counts(10, 0, 3);
        c.refused = 2;
        c.in_progress = 5;
        assert!(!error_met(&cond, &c).met);
        c.timed_out = 1;
        c.in_progress = 4;
        assert_eq!(error_met(&cond, &c).reason, "1 of 10 timed out >= 1");
    }
}
