//! Devices a rollout left out when it was created because the coordinator had read no state of
//! them (`planner::exclude_unknown`): the trace names each, so a device never leaves a rollout
//! without a word.

use flotilla_protocol::control::TraceKind;

use super::advance::Out;
use super::model::Rollout;
use super::trace::Decision;
use crate::planner::{self, UNKNOWN_NAMED};

impl Rollout {
    /// One `device_excluded` entry for each of the first [`UNKNOWN_NAMED`] accepted devices
    /// left out for want of a state, and one note counting the rest: a fleet whose broker lost
    /// every state does not flood the trace.
    pub(crate) fn trace_unknown(&mut self, now: u64, out: &mut Out) {
        let unknown: Vec<(String, String)> = self
            .excluded
            .iter()
            .filter(|e| planner::is_unknown(e))
            .map(|e| (e.device.clone(), e.reason.clone()))
            .collect();
        for (device, reason) in unknown.iter().take(UNKNOWN_NAMED) {
            let message = format!("device {device} not planned: {reason}");
            let decision = Decision::new(TraceKind::DeviceExcluded, message).device(device);
            self.record(now, decision, out);
        }
        if unknown.len() > UNKNOWN_NAMED {
            let message = format!(
                "{} more accepted devices not planned: {}; `flotilla devices` lists them all",
                unknown.len() - UNKNOWN_NAMED,
                planner::NO_STATE
            );
            self.record(now, message, out);
        }
    }
}
