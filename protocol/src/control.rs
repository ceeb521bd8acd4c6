//! The integration-facing JSON: control requests and replies, rollout summaries and the
//! decision trace. Field names here are a stable, documented interface (`docs/protocol.md`);
//! any MQTT client can use them.
//!
//! A request is published on `{root}/v1/control/request`; the reply goes to the topic the
//! request names in `reply_to`, carrying the request's `id`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A control request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlRequest {
    /// Chosen by the client; echoed in the reply.
    pub id: String,
    /// Topic to publish the reply on.
    pub reply_to: String,
    #[serde(flatten)]
    pub command: Command,
}

/// What a control request asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum Command {
    /// Create a rollout from a TOML spec (the text of the spec file).
    CreateRollout {
        spec: String,
    },
    StartRollout {
        rollout: String,
    },
    PauseRollout {
        rollout: String,
    },
    ResumeRollout {
        rollout: String,
    },
    StopRollout {
        rollout: String,
    },
    /// One rollout's status, or all of them when `rollout` is absent.
    RolloutStatus {
        #[serde(default)]
        rollout: Option<String>,
    },
    ListDevices,
    ListReleases,
}

/// The answer to a control request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlReply {
    pub id: String,
    pub ok: bool,
    /// Present when `ok` is false: what was wrong, naming the field and value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The command's result: a [`RolloutStatus`], a list of them, a list of [`DeviceSummary`]…
    #[serde(default)]
    pub result: serde_json::Value,
}

/// A rollout as operators see it; also published retained on `events/rollouts/{name}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutStatus {
    pub name: String,
    pub release: String,
    /// creating, ready, starting, running, paused, stopped, finished
    pub state: String,
    pub groups: Vec<GroupStatus>,
    /// Why each transition happened, oldest first.
    pub trace: Vec<TraceEntry>,
}

/// One deployment group of a rollout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupStatus {
    pub name: String,
    /// scheduled, running, finished, error
    pub state: String,
    pub total: usize,
    pub ready: usize,
    pub failed: usize,
    pub in_progress: usize,
    pub scheduled: usize,
    /// Device id to its phase in this rollout (`scheduled`, `accepted`, …, `ready`, `failed`).
    pub devices: BTreeMap<String, String>,
}

/// One decision, with the numbers behind it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceEntry {
    /// Seconds since the Unix epoch.
    pub at: u64,
    pub rollout: String,
    pub message: String,
}

/// A device as the coordinator knows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceSummary {
    pub id: String,
    pub hardware_id: String,
    pub labels: BTreeMap<String, String>,
    pub online: bool,
    /// Installed release name, if any.
    pub installed: Option<String>,
    /// The current or last action's rollout and phase.
    pub rollout: Option<String>,
    pub phase: Option<String>,
    /// Reason of a failed or refused action.
    pub reason: Option<String>,
}

/// A release the coordinator holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReleaseSummary {
    pub name: String,
    pub version: String,
    pub counter: u64,
    pub hardware: Vec<String>,
    pub artifacts: Vec<ArtifactSummary>,
}

/// One artifact of a release.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArtifactSummary {
    pub name: String,
    pub target: String,
    pub size: u64,
    pub sha256: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_json_is_flat_and_stable() {
        let req = ControlRequest {
            id: "1".into(),
            reply_to: "flotilla/v1/control/reply/cli".into(),
            command: Command::PauseRollout {
                rollout: "fw-2-4".into(),
            },
        };
        let json = serde_json::to_value(&req).expect("encodes");
        assert_eq!(
            json,
            serde_json::json!({"id": "1", "reply_to": "flotilla/v1/control/reply/cli",
                               "command": "pause_rollout", "rollout": "fw-2-4"})
        );
        let back: ControlRequest = serde_json::from_value(json).expect("decodes");
        assert_eq!(back, req);
        let status: ControlRequest =
            serde_json::from_str(r#"{"id":"2","reply_to":"r","command":"rollout_status"}"#)
                .expect("rollout is optional");
        assert_eq!(status.command, Command::RolloutStatus { rollout: None });
    }
}
