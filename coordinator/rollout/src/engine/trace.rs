//! What a rollout tells the world: the decision trace, every decision as words for people and
//! as fields for programs ([`TraceEntry`], whose JSON schema is in `docs/protocol.md`), and the
//! summaries of the states it passes through within one call (`creating`, `starting`).
//!
//! A call site names the kind of decision and what it is about:
//! `self.record(now, Decision::new(TraceKind::GroupStarted, message).group(&name), out)`.
//! A plain `String` still records, as a [`TraceKind::Note`] with words only.

use flotilla_protocol::control::{Compared, TraceEntry, TraceKind};

use super::advance::Out;
use super::model::{Rollout, RolloutState};
use super::{Effect, TRACE_LIMIT};

/// A decision on its way into the trace; [`Rollout::record`] adds the time and the rollout.
#[derive(Debug, Clone)]
pub(crate) struct Decision(TraceEntry);

impl Decision {
    pub fn new(kind: TraceKind, message: impl Into<String>) -> Decision {
        Decision(TraceEntry::new(0, "", message).kind(kind))
    }

    pub fn group(self, group: &str) -> Decision {
        Decision(self.0.group(group))
    }

    pub fn device(self, device: &str) -> Decision {
        Decision(self.0.device(device))
    }

    /// The operator who asked; the engine's own name for itself (`by` absent) is left out.
    pub fn by(self, by: &str) -> Decision {
        Decision(self.0.by(by))
    }

    pub fn compared(self, compared: Compared) -> Decision {
        Decision(self.0.compared(compared))
    }
}

impl From<String> for Decision {
    fn from(message: String) -> Decision {
        Decision(TraceEntry::new(0, "", message))
    }
}

impl Rollout {
    /// ready or scheduled -> starting -> running. hawkBit shows `starting` while the actions
    /// are being created; here that is while the first group's desired actions go out, so the
    /// `starting` summary is published before them and `running` after.
    pub(crate) fn starting(&mut self, now: u64, out: &mut Out) {
        self.state = RolloutState::Starting;
        self.started_at = Some(now);
        out.snapshots.push(self.status());
        self.state = RolloutState::Running;
    }

    /// Records a decision; every decision is a state change worth saving and publishing.
    pub(crate) fn record(&mut self, now: u64, decision: impl Into<Decision>, out: &mut Out) {
        let mut entry = decision.into().0;
        entry.at = now;
        entry.rollout = self.name.clone();
        if self.trace.len() >= TRACE_LIMIT {
            let excess = self.trace.len() + 1 - TRACE_LIMIT;
            self.trace.drain(..excess);
        }
        self.trace.push(entry.clone());
        out.touch(&self.name);
        out.trace.push(Effect::Trace(entry));
    }
}
