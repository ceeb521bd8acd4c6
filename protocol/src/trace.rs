//! The decision trace: what the engine decided and why, with the numbers behind it
//! ([`TraceEntry`]), as rollout status, the event log and the console show it. Re-exported by
//! [`crate::control`], where the control API's replies carry it.

use serde::{Deserialize, Serialize};

/// One decision, with the numbers behind it: the words for people in `message`, and the same
/// decision in fields beside it for programs (`docs/protocol.md` has its JSON schema). Fields
/// after `message` were added later; readers must accept their absence.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TraceEntry {
    /// Seconds since the Unix epoch.
    pub at: u64,
    pub rollout: String,
    pub message: String,
    /// What was decided. [`TraceKind::Note`] for entries that carry only words.
    #[serde(default)]
    pub kind: TraceKind,
    /// The group the decision is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// The device the decision is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The operator who asked for it; absent for the engine's own decisions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// The coordinator that decided, where several share one store: its id and lease epoch
    /// (`coord-b at lease epoch 2`). Absent for a coordinator that is alone (sled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator: Option<String>,
    /// The numbers a success or error condition compared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compared: Option<Compared>,
}

impl TraceEntry {
    /// An entry with only words ([`TraceKind::Note`]); the builder methods add the fields.
    pub fn new(at: u64, rollout: impl Into<String>, message: impl Into<String>) -> TraceEntry {
        TraceEntry {
            at,
            rollout: rollout.into(),
            message: message.into(),
            ..TraceEntry::default()
        }
    }

    pub fn kind(mut self, kind: TraceKind) -> TraceEntry {
        self.kind = kind;
        self
    }

    pub fn group(mut self, group: impl Into<String>) -> TraceEntry {
        self.group = Some(group.into());
        self
    }

    pub fn device(mut self, device: impl Into<String>) -> TraceEntry {
        self.device = Some(device.into());
        self
    }

    pub fn coordinator(mut self, coordinator: impl Into<String>) -> TraceEntry {
        self.coordinator = Some(coordinator.into());
        self
    }

    pub fn by(mut self, by: impl Into<String>) -> TraceEntry {
        self.by = Some(by.into());
        self
    }

    pub fn compared(mut self, compared: Compared) -> TraceEntry {
        self.compared = Some(compared);
        self
    }
}

/// What a trace entry decided, as a snake_case name in JSON. A reader that meets a kind it does
/// not know reads it as [`TraceKind::Note`], so new kinds never break older integrations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceKind {
    /// The rollout was planned (creating -> ready).
    Created,
    /// An operator started it (ready -> running, or scheduled for its start time).
    Started,
    /// Its start time came (scheduled -> running).
    StartTimeReached,
    Paused,
    Resumed,
    Stopped,
    /// A group's first devices may start.
    GroupStarted,
    /// More devices of a group started (a batch, a gate, the concurrency).
    DevicesStarted,
    /// A device's desired action (a retry's too) was sent.
    DeviceStarted,
    /// A device was left out: offline when its turn came.
    DeviceSkipped,
    /// A device's attempt ended and a retry is due.
    DeviceRetrying,
    /// A device did not finish within the timeout or the offline grace.
    DeviceTimedOut,
    /// A device registered after the start and joined the dynamic group.
    DeviceJoined,
    /// An operator deleted a device.
    DeviceDeleted,
    /// Another rollout took the device over; its action here was canceled.
    DeviceTakenOver,
    /// A device was left out when the rollout was created (`device` names it, the message says
    /// why: an accepted device the coordinator had read no state of).
    DeviceExcluded,
    /// A newer rollout canceled this one's actions that were never sent.
    ActionsCanceled,
    /// The group's success condition held (`compared` has the numbers).
    GroupSucceeded,
    /// Every device of the group is done and it succeeded.
    GroupFinished,
    /// Every device of the group is done and it did not succeed.
    GroupFailed,
    /// The group's success action paused the rollout.
    SuccessPaused,
    /// The group's error condition held and paused the rollout (`compared`).
    ErrorPaused,
    /// The group's error condition held and stopped the rollout (`compared`).
    ErrorStopped,
    /// The group's error condition held and rolled the rollout back (`compared`).
    ErrorRolledBack,
    /// An approval request was created.
    ApprovalRequested,
    /// An approval request was approved.
    Approved,
    /// An approval request was denied, which stopped the rollout.
    Denied,
    /// A timed wait after a group elapsed.
    WaitElapsed,
    /// Nothing more starts for now; the message says why.
    Waiting,
    /// An operator started the next group without waiting for the success condition.
    NextTriggered,
    /// A rollout was created over another one's failed devices.
    RetryCreated,
    /// Every group is done.
    Finished,
    /// Words only, no fields to act on (and any kind this reader does not know). Kept last:
    /// serde reads unknown names as the last variant.
    #[default]
    #[serde(other)]
    Note,
}

impl TraceKind {
    /// The name used in JSON.
    pub fn name(self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default()
    }
}

/// The numbers a condition compared: `count` of `of` devices were `counted`, and `count op
/// threshold` held or did not ("3 of 20 failed > 10%").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Compared {
    /// What was counted: `ready`, `not_ready`, `failed` (or the counted failure classes, such
    /// as `failed or timed out`), `ended` (against a minimum sample), `not_started`.
    pub counted: String,
    pub count: u64,
    /// The group's devices the share is of (skipped devices left out).
    pub of: u64,
    /// `>=`, `<`, `>`, `<=`.
    pub op: String,
    /// The limit as the spec wrote it: `10%`, `3`, `100%`, `10% and below 3`.
    pub threshold: String,
    /// Whether the condition held.
    pub met: bool,
}
