//! One device in detail (`show_device`): what the console's device page and
//! `GET /api/v1/devices/{id}` show.

use serde::{Deserialize, Serialize};

use crate::control::{DeviceDetail, DeviceSummary, SourceBytes};

/// A device, its enrollment and every action the rollouts hold for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceView {
    /// What `list_devices` says of it.
    #[serde(flatten)]
    pub summary: DeviceSummary,
    /// The accepted key's fingerprint (its first 8 bytes in hex, as `flotilla-agent identity`
    /// prints it), or the waiting key's while it is pending.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// Another key's fingerprint that waits for an operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_key: Option<String>,
    /// Its actions, newest first: one per rollout that holds it.
    pub actions: Vec<DeviceAction>,
    /// The bytes of all its actions by where they came from.
    pub bytes: SourceBytes,
}

/// One action of a device: the rollout that holds it, its group and how far it got.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceAction {
    pub rollout: String,
    pub release: String,
    pub group: String,
    /// Phase, reason, times, attempt and conditions, as in a rollout's status.
    #[serde(flatten)]
    pub detail: DeviceDetail,
    /// Where the action's bytes came from, as its final report said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<SourceBytes>,
}
