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
    /// When the client made the request, Unix seconds. Inside the signed bytes, so the
    /// coordinator can refuse a request outside its clock window (see [`crate::operator`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub at: u64,
    /// A value the client never reuses (within the clock window), so the coordinator can refuse
    /// the same signed request published twice.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub nonce: String,
    #[serde(flatten)]
    pub command: Command,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl ControlRequest {
    pub fn new(
        id: impl Into<String>,
        reply_to: impl Into<String>,
        at: u64,
        nonce: impl Into<String>,
        command: Command,
    ) -> ControlRequest {
        ControlRequest {
            id: id.into(),
            reply_to: reply_to.into(),
            at,
            nonce: nonce.into(),
            command,
        }
    }
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
    /// Delete a rollout that has ended (stopped, finished, failed) or never started (ready):
    /// its record, its retained summary and approval requests go. Result:
    /// `{"deleted": name}`.
    DeleteRollout {
        rollout: String,
    },
    /// One rollout's status, or all of them when `rollout` is absent. Without paging fields
    /// the reply is what it always was (a [`RolloutStatus`] with every device, or a list of
    /// them) and fails when it does not fit in one message. With any of them (see [`PageQuery`]):
    /// for one rollout, a [`RolloutPage`] (the status without per-device detail, and a page
    /// of its devices in id order; `group`, `phase` and `select` filter them); for all
    /// rollouts, a [`Page`] of statuses without per-device detail in name order (`phase`
    /// filters by state).
    RolloutStatus {
        #[serde(default)]
        rollout: Option<String>,
        #[serde(flatten)]
        page: PageQuery,
    },
    /// Every device the coordinator knows. Without paging fields: a list of
    /// [`DeviceSummary`] (failing when it does not fit in one message); with any of them, a
    /// [`Page`] of them in id order (`select` and `phase` filter them, `group` names a stored
    /// device group whose selector they must match).
    ListDevices {
        #[serde(flatten)]
        page: PageQuery,
    },
    /// Result: a list of [`ReleaseSummary`] in name order; with `limit` or `after`, a [`Page`].
    ListReleases {
        #[serde(flatten)]
        page: PageQuery,
    },
    /// Approve an approval request by name (`<rollout>-<group>` or `<rollout>-before-<group>`).
    /// Result: the [`ApprovalStatus`], now approved.
    Approve {
        name: String,
    },
    /// Who signed this request: `{"operator": name}`. Over HTTP, `POST /api/v1/session` with a
    /// signed `login` opens a browser session for that operator (reads only; every change is
    /// still a signed request).
    Login,
    /// Deny a pending approval request by name: the rollout stops there, as `stop_rollout`
    /// stops it, and the trace says who denied it and why. Result: the [`ApprovalStatus`], now
    /// denied.
    Deny {
        name: String,
        /// Why, in the operator's words; shown in the trace.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// Start the next group of a running rollout now, without waiting for the current group's
    /// success condition (hawkBit's manual trigger). Result: the rollout's status.
    TriggerNext {
        rollout: String,
        /// Give the approvals in the way (after the last started group, before the next one)
        /// in the operator's name, recorded in the trace; without it such a gate refuses.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        skip_approval: bool,
    },
    /// Create a new rollout over the failed, refused and timed-out devices of a finished,
    /// stopped or paused rollout. Named `<rollout>-retry` unless `name` is given.
    /// Result: the new rollout's status.
    RetryRollout {
        rollout: String,
        #[serde(default)]
        name: Option<String>,
    },
    /// Forget a device: it leaves the registry and the groups of rollouts not yet finished, and
    /// its retained `desired` and `state` topics are cleared. Result: `{"deleted": device}`.
    DeleteDevice {
        device: String,
    },
    /// Store (or replace) a staged update strategy from TOML (`[[stage]]` entries).
    /// Result: the [`StrategyInfo`].
    CreateStrategy {
        name: String,
        spec: String,
    },
    /// Result: a list of [`StrategyInfo`], in name order; with `limit` or `after`, a [`Page`].
    ListStrategies {
        #[serde(flatten)]
        page: PageQuery,
    },
    /// Result: one [`StrategyInfo`].
    ShowStrategy {
        name: String,
    },
    /// Store (or replace) a device group: a named selector with labels of its own.
    /// Result: the [`DeviceGroupInfo`].
    CreateGroup {
        name: String,
        select: String,
        #[serde(default)]
        labels: BTreeMap<String, String>,
    },
    /// Result: a list of [`DeviceGroupInfo`], in name order; with `limit` or `after`, a
    /// [`Page`].
    ListGroups {
        #[serde(flatten)]
        page: PageQuery,
    },
    /// Result: the deleted [`DeviceGroupInfo`].
    DeleteGroup {
        name: String,
    },
    /// Every approval request, pending and approved. Result: a list of [`ApprovalStatus`] in
    /// name order; with `limit` or `after`, a [`Page`].
    ListApprovals {
        #[serde(flatten)]
        page: PageQuery,
    },
    /// Devices waiting for an operator: new devices, and new keys of known devices.
    /// Result: a list of [`EnrollmentInfo`], in device order; with paging fields, a [`Page`] of
    /// them (`select` filters by the labels their state claims).
    PendingDevices {
        #[serde(flatten)]
        page: PageQuery,
    },
    /// Accept a pending device (or the new key of a known one). `key`, the full hex key or its
    /// first 16 hex digits, pins which key is accepted: the request fails if another key is
    /// waiting. Result: the [`EnrollmentInfo`], now accepted.
    AcceptDevice {
        device: String,
        #[serde(default)]
        key: Option<String>,
    },
    /// Reject a pending device, or the new key of an accepted one (which stays accepted with
    /// its old key). Result: the [`EnrollmentInfo`].
    RejectDevice {
        device: String,
        #[serde(default)]
        key: Option<String>,
    },
    /// Revoke an accepted device: everything it signs is ignored from now on, it leaves the
    /// rollouts not yet finished and its retained topics are cleared. Result: the
    /// [`EnrollmentInfo`], now revoked.
    RevokeDevice {
        device: String,
    },
    /// One device in detail: its summary, its enrollment and key fingerprint, and every action
    /// the rollouts hold for it (newest first) with its phase, reason and bytes by source.
    /// Result: a [`crate::device_view::DeviceView`].
    ShowDevice {
        device: String,
    },
    /// Write a backup of the coordinator's store into `{data_dir}/backups/` on the
    /// coordinator's machine (the coordinator picks the file name). Result: the [`BackupInfo`].
    Backup,
    /// Which coordinators share the store, which leads, and its lease. Result:
    /// [`CoordinatorsInfo`]. Answered by the leader; on a shared store that nobody leads, by
    /// every standby (which answer every other command with who led last).
    Coordinators,
}

/// Paging and filters of a list command; every field is optional, and a request with none of
/// them gets the unpaged reply older coordinators gave. A cursor is a position in a stable
/// order (device id, rollout name), not an offset: items that come and go between two pages
/// neither repeat nor hide the ones that stayed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageQuery {
    /// The most items a page holds; the coordinator caps it at [`MAX_PAGE_LIMIT`] and stops a
    /// page early when more items would not fit in one message. Default [`DEFAULT_PAGE_LIMIT`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
    /// The `next` of the previous page: this page starts after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
    /// A label selector the devices must match (`site=berlin,tier in (1,2)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub select: Option<String>,
    /// Only devices in this phase (`ready`, `failed`, `scheduled`, …), or rollouts in this state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Only devices of this group: a group of the rollout (`rollout_status`), or a stored
    /// device group (`list_devices`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Only devices that are connected (`true`) or not (`false`) (`list_devices`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub online: Option<bool>,
    /// Only devices whose enrollment is this: `accepted`, `pending`, `rejected` or `revoked`
    /// (`list_devices`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enrollment: Option<String>,
}

impl PageQuery {
    /// A first page of `limit` items.
    pub fn first(limit: usize) -> PageQuery {
        PageQuery {
            limit: Some(limit),
            ..PageQuery::default()
        }
    }

    /// Whether the request asked for a page (any field set).
    pub fn is_paged(&self) -> bool {
        *self != PageQuery::default()
    }
}

/// The page size when a paged request names none.
pub const DEFAULT_PAGE_LIMIT: usize = 500;
/// The largest page size the coordinator grants.
pub const MAX_PAGE_LIMIT: usize = 2_000;

/// One page of a list: the items in the list's order and, when more follow, the cursor to ask
/// for the next page with (`after`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Page<T> {
    pub items: Vec<T>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// A page of one rollout: its status without per-device detail (the groups' counts and
/// summaries), and a page of its devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutPage {
    pub status: RolloutStatus,
    /// This page's devices, in id order.
    pub items: Vec<RolloutDevice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// One device of a rollout: its group and its detail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutDevice {
    pub id: String,
    pub group: String,
    #[serde(flatten)]
    pub detail: DeviceDetail,
}

impl RolloutStatus {
    /// Adds a page of devices to the groups' `devices` and `device_details`, so the pages of a
    /// [`RolloutPage`] add up to the status an unpaged request returns.
    pub fn add_devices(&mut self, items: Vec<RolloutDevice>) {
        for item in items {
            if let Some(group) = self.groups.iter_mut().find(|g| g.name == item.group) {
                group
                    .devices
                    .insert(item.id.clone(), item.detail.phase.clone());
                group.device_details.insert(item.id, item.detail);
            }
        }
    }
}

/// A backup the coordinator wrote (`flotilla backup`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupInfo {
    /// Where the file is, on the coordinator's machine.
    pub path: String,
    pub records: usize,
    pub bytes: u64,
    /// sha256 (hex) of the records, as the file's closing line records it.
    pub sha256: String,
    /// The store's generation (commits) the backup holds.
    pub generation: u64,
    pub created_at: u64,
    /// The coordinator key (hex) that signed the backup. Added later: absent from older
    /// coordinators, whose backups are unsigned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signed_by: Option<String>,
}

/// The coordinators of a store and who leads (`flotilla status`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CoordinatorsInfo {
    /// The coordinator that answered (its `coordinator_id`, or its client id on sled).
    pub answered_by: String,
    /// Where the store is: a sled directory or a database address (never a password).
    pub store: String,
    /// The lease of a shared store; absent on sled, where the one coordinator always leads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseInfo>,
    /// Every coordinator the shared store saw lately.
    #[serde(default)]
    pub members: Vec<CoordinatorMember>,
    /// Times the answering coordinator took the lease over.
    #[serde(default)]
    pub failovers: u64,
}

/// A shared store's lease, with the database's times (unix seconds).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseInfo {
    pub holder: String,
    pub epoch: u64,
    pub acquired_at: u64,
    pub renewed_at: u64,
    pub expires_at: u64,
    /// The database's clock when the lease was read.
    pub read_at: u64,
}

impl LeaseInfo {
    /// Whether someone held the lease when it was read.
    pub fn is_live(&self) -> bool {
        self.expires_at > self.read_at
    }
}

/// A coordinator a shared store knows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoordinatorMember {
    pub id: String,
    pub client_id: String,
    /// Unix seconds, the database's clock.
    pub last_seen: u64,
}

/// A device's enrollment: which key the coordinator knows for it and whether it is accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnrollmentInfo {
    pub device: String,
    /// pending, accepted, rejected or revoked.
    pub status: String,
    /// The device's key (hex) this status is about.
    pub key: String,
    /// How an accepted device was accepted: operator, token or authorized_key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
    /// Unix seconds of the last status change.
    pub since: u64,
    /// Another key (hex) that signed a state for this device and waits for an operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_key: Option<String>,
    /// What the waiting key's last state claims (not trusted until accepted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware_id: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
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
    /// True while the coordinator is still reading the retained device states after a
    /// (re)connect: a read-only answer may then miss devices. Absent when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub loading: bool,
}

/// A rollout as operators see it; also published retained on `events/rollouts/{name}`.
///
/// Fields after `trace` were added later; readers must accept their absence.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RolloutStatus {
    pub name: String,
    pub release: String,
    /// creating, ready, scheduled, running, paused, stopped, finished, failed
    pub state: String,
    pub groups: Vec<GroupStatus>,
    /// Why each transition happened, oldest first.
    pub trace: Vec<TraceEntry>,
    /// The vocabulary the spec was written in: groups, partitions, rolling or staged.
    #[serde(default)]
    pub strategy: String,
    /// KubeFleet-style run conditions: Initialized, Progressing, Succeeded or Failed.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// Why the rollout is not starting more devices right now, if it is running but held
    /// (an approval, a timed wait, a maintenance window, the unavailability budget…).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
    /// Approval requests of this rollout, pending and approved.
    #[serde(default)]
    pub approvals: Vec<ApprovalStatus>,
    /// Staged runs: the stages as the run captured them when it was created (KubeFleet's
    /// `stagedUpdateStrategySnapshot`); later changes to a stored strategy do not show here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy_snapshot: Option<StrategySnapshot>,
    /// Staged runs: KubeFleet's deletion stage, the last one, which starts and succeeds once
    /// every stage has. It never has devices: flotilla does not remove software from devices a
    /// run leaves out (`docs/decisions/0016-reference-semantics.md`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_stage: Option<GroupStatus>,
    /// Where the bytes of the rollout's finished actions came from, all devices together.
    #[serde(default, skip_serializing_if = "SourceBytes::is_zero")]
    pub bytes: SourceBytes,
    /// Per-site limits and counts when the rollout has a site policy. A summary (the retained
    /// event, the head of a status page) lists at most [`SUMMARY_SITES`] sites, the busiest
    /// first; the full status lists every site, by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sites: Vec<SiteStatus>,
    /// How many sites the rollout has, listed or not.
    #[serde(default, skip_serializing_if = "no_sites")]
    pub site_count: usize,
    /// Devices left out when the rollout was created, with why (hardware the release does not
    /// support; accepted devices the coordinator had read no state of): at most
    /// [`SUMMARY_EXCLUDED`] of them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub excluded: Vec<ExcludedDevice>,
    /// How many devices were left out, listed or not.
    #[serde(default, skip_serializing_if = "no_sites")]
    pub excluded_count: usize,
}

/// A device a rollout left out when it was created, and why.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExcludedDevice {
    pub device: String,
    pub reason: String,
}

/// Most excluded devices a rollout's summary lists.
pub const SUMMARY_EXCLUDED: usize = 20;

fn no_sites(n: &usize) -> bool {
    *n == 0
}

/// Most sites a rollout's retained summary lists: it stays bounded however many sites a fleet
/// has (docs/decisions/0019).
pub const SUMMARY_SITES: usize = 20;

/// Bytes by where they came from, summed over devices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceBytes {
    pub coordinator: u64,
    pub peers: u64,
    pub local: u64,
    /// From HTTP(S) origins (decision 0062).
    #[serde(default)]
    pub http: u64,
}

impl SourceBytes {
    pub fn is_zero(&self) -> bool {
        *self == SourceBytes::default()
    }

    /// One device's counts, its peers added up.
    pub fn of(counts: &crate::messages::ByteCounts) -> Self {
        SourceBytes {
            coordinator: counts.coordinator,
            peers: counts.from_peers(),
            local: counts.local,
            http: counts.from_http(),
        }
    }

    pub fn add(&mut self, other: &SourceBytes) {
        self.coordinator = self.coordinator.saturating_add(other.coordinator);
        self.peers = self.peers.saturating_add(other.peers);
        self.local = self.local.saturating_add(other.local);
        self.http = self.http.saturating_add(other.http);
    }

    pub fn sub(&mut self, other: &SourceBytes) {
        self.coordinator = self.coordinator.saturating_sub(other.coordinator);
        self.peers = self.peers.saturating_sub(other.peers);
        self.local = self.local.saturating_sub(other.local);
        self.http = self.http.saturating_sub(other.http);
    }
}

impl std::fmt::Display for SourceBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} from the coordinator, {} from peers, {} local",
            self.coordinator, self.peers, self.local
        )?;
        if self.http > 0 {
            write!(f, ", {} from http", self.http)?;
        }
        Ok(())
    }
}

/// One site of a rollout: its limits and where its devices stand.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SiteStatus {
    pub name: String,
    /// The rollout's devices of this site.
    pub total: usize,
    /// Started and not terminal.
    pub busy: usize,
    /// Not ready: busy, soaking or failed.
    pub unavailable: usize,
    /// Not started, in groups that are running.
    pub waiting: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_busy: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unavailable: Option<usize>,
    /// With peer sharing: the device fetching for the site from the coordinator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<String>,
    /// With peer sharing: devices of the site holding the release verified (at most 8 named).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub holders: Vec<String>,
    #[serde(default, skip_serializing_if = "SourceBytes::is_zero")]
    pub bytes: SourceBytes,
}

impl SiteStatus {
    /// One line: "site harbour: 2 of 2 busy, 14 waiting".
    pub fn line(&self) -> String {
        let busy = match self.max_busy {
            Some(limit) => format!("{} of {limit} busy", self.busy),
            None => format!("{} busy", self.busy),
        };
        let mut line = format!("site {}: {busy}", self.name);
        if let Some(limit) = self.max_unavailable {
            line.push_str(&format!(", {} of {limit} unavailable", self.unavailable));
        }
        line.push_str(&format!(", {} waiting", self.waiting));
        if let Some(seed) = &self.seed {
            if self.holders.is_empty() {
                line.push_str(&format!(", seed {seed}"));
            }
        }
        if !self.holders.is_empty() {
            line.push_str(&format!(", peers {}", self.holders.join(" ")));
        }
        if !self.bytes.is_zero() {
            line.push_str(&format!("; bytes {}", self.bytes));
        }
        line
    }
}

/// The stages of a staged run, as captured when the run was created.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StrategySnapshot {
    /// The stored strategy the run named, absent for stages written in the spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<String>,
    pub stages: Vec<StageSnapshot>,
}

/// One stage of a [`StrategySnapshot`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageSnapshot {
    pub name: String,
    /// The label selector in canonical form.
    pub select: String,
    /// The label whose integer value orders the stage's devices (KubeFleet's sortingLabelKey).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sort_by: Option<String>,
    pub max_concurrency: usize,
    /// Tasks before the stage starts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub before: Vec<StageTask>,
    /// KubeFleet's afterStageTasks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub after: Vec<StageTask>,
}

/// A task before or after a stage: `{"type": "Approval"}` or `{"type": "TimedWait", "wait": "1m"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageTask {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait: Option<String>,
}

/// One group (deployment group, partition, stage) of a rollout.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GroupStatus {
    pub name: String,
    /// scheduled, approval, running, waiting, finished, error
    pub state: String,
    pub total: usize,
    pub ready: usize,
    /// Failed, refused or timed out.
    pub failed: usize,
    pub in_progress: usize,
    pub scheduled: usize,
    /// Canceled (by a stop, a newer rollout or an error action) or rolled back, so that
    /// `ready + failed + in_progress + scheduled + canceled` is `total`. Absent from older
    /// coordinators.
    #[serde(default)]
    pub canceled: usize,
    /// Device id to its phase in this rollout (`scheduled`, `accepted`, …, `ready`, `failed`).
    pub devices: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<u64>,
    /// Progressing, Succeeded, Failed, and the after-stage task conditions.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// Per-device detail: when it started and ended, the reason of a failure, the attempt.
    #[serde(default)]
    pub device_details: BTreeMap<String, DeviceDetail>,
    /// Rancher Fleet's per-device states summarised: `Pending` (not started, nothing installed
    /// yet), `OutOfSync` (not started, an older release installed), `NotReady` (started, not
    /// ready: in progress, failed, timed out) and `Ready`. Absent from older coordinators.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub summary: BTreeMap<String, usize>,
}

/// A condition in the KubeFleet style: a type that is true or false since a time, with a reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Condition {
    /// e.g. Initialized, Progressing, Succeeded, Failed, ApprovalRequestCreated,
    /// ApprovalRequestApproved, WaitTimeElapsed, Started.
    #[serde(rename = "type")]
    pub kind: String,
    pub status: bool,
    /// A CamelCase reason such as UpdateRunStarted or StageUpdatingWaiting.
    pub reason: String,
    #[serde(default)]
    pub message: String,
    /// Unix seconds of the last transition.
    pub at: u64,
}

/// One device of a group, in detail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceDetail {
    pub phase: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// 1 for the first attempt, 2 for the first retry, …
    #[serde(default)]
    pub attempt: u32,
    /// Staged runs: KubeFleet's per-cluster conditions, `Started` (ClusterUpdatingStarted) and
    /// `Succeeded` (ClusterUpdatingSucceeded, or false with ClusterUpdatingFailed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// An approval request: named `<rollout>-<group>` for the gate after a group and
/// `<rollout>-before-<group>` for the gate before it. Published retained on
/// `events/approvals/{name}` and approved with the `approve` command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalStatus {
    pub name: String,
    pub rollout: String,
    pub group: String,
    /// "before" or "after".
    pub when: String,
    pub approved: bool,
    /// Unix seconds when the request was created.
    pub created_at: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved_at: Option<u64>,
    /// The rollout ended before it was approved: approving it is refused, it would do nothing.
    /// Absent from older coordinators.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub withdrawn: bool,
    /// When an operator denied it (which stopped its rollout); absent unless denied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub denied_at: Option<u64>,
    /// Who denied it and why: "alice: the canary's error rate is too high".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub denied: Option<String>,
}

pub use crate::trace::{Compared, TraceEntry, TraceKind};

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
    /// accepted, pending, rejected or revoked (`accepted, new key pending` when another key
    /// waits for an operator). Absent from older coordinators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enrollment: Option<String>,
    /// Unix seconds since which the device is offline (the coordinator's clock, at the latest
    /// since the coordinator started); absent while it is connected. Absent from older
    /// coordinators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<u64>,
    /// Offline for longer than [`OVERDUE_AFTER`]: not heard from when it was expected to be.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub overdue: bool,
}

/// Seconds a device may stay offline before it is marked overdue (hawkBit's polling time plus
/// its overdue time, 5 + 5 minutes by default): an agent's MQTT connection says it is alive,
/// and it reconnects within this after a broker or network hiccup.
pub const OVERDUE_AFTER: u64 = 600;

/// A release the coordinator holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReleaseSummary {
    pub name: String,
    pub version: String,
    pub counter: u64,
    pub hardware: Vec<String>,
    pub artifacts: Vec<ArtifactSummary>,
    /// How many known devices run it. Absent from older coordinators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<u64>,
    /// The rollouts that roll it out, in name order. Absent from older coordinators.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rollouts: Vec<String>,
}

/// A stored staged update strategy, as `create_strategy` stored it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StrategyInfo {
    pub name: String,
    /// The TOML text, verbatim.
    pub spec: String,
}

/// A stored device group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceGroupInfo {
    pub name: String,
    /// The selector in canonical form (`env in (a,b),!quarantined`).
    pub select: String,
    /// The group's own labels, which partitions can select groups by.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// One artifact of a release.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArtifactSummary {
    pub name: String,
    pub target: String,
    pub size: u64,
    pub sha256: String,
    /// The block size of the artifact's signed block list, when the release has block lists
    /// (what adaptive and peer downloads use); absent for a release made with `--no-blocks`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// The sha256 (hex) of that block list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_list_sha256: Option<String>,
    /// The artifact's type (`rauc-bundle`, `swu`, `mender:<module>`), absent for plain bytes
    /// that any target may take.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_json_is_flat_and_stable() {
        let req = ControlRequest::new(
            "1",
            "flotilla/v1/control/reply/cli",
            0,
            "",
            Command::PauseRollout {
                rollout: "fw-2-4".into(),
            },
        );
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
        assert_eq!(
            status.command,
            Command::RolloutStatus {
                rollout: None,
                page: PageQuery::default()
            }
        );
    }

    #[test]
    fn paging_fields_are_optional_and_flat() {
        // An older client's request reads as unpaged and encodes as before.
        for (text, command) in [
            (
                r#"{"command":"list_devices"}"#,
                Command::ListDevices {
                    page: PageQuery::default(),
                },
            ),
            (
                r#"{"command":"pending_devices"}"#,
                Command::PendingDevices {
                    page: PageQuery::default(),
                },
            ),
        ] {
            let parsed: Command = serde_json::from_str(text).expect("decodes");
            assert_eq!(parsed, command);
            assert_eq!(serde_json::to_string(&parsed).expect("encodes"), text);
        }
        let paged = ControlRequest::new(
            "3",
            "r",
            0,
            "",
            Command::RolloutStatus {
                rollout: Some("fw".into()),
                page: PageQuery {
                    limit: Some(100),
                    after: Some("dev-0099".into()),
                    phase: Some("failed".into()),
                    group: Some("canary".into()),
                    select: Some("site=a".into()),
                    ..PageQuery::default()
                },
            },
        );
        let json = serde_json::to_value(&paged).expect("encodes");
        assert_eq!(
            json,
            serde_json::json!({"id": "3", "reply_to": "r", "command": "rollout_status",
                "rollout": "fw", "limit": 100, "after": "dev-0099", "select": "site=a",
                "phase": "failed", "group": "canary"})
        );
        assert_eq!(
            serde_json::from_value::<ControlRequest>(json).expect("decodes"),
            paged
        );
        let bad = serde_json::from_str::<Command>(r#"{"command":"list_devices","limit":"ten"}"#)
            .expect_err("a limit is a number");
        assert!(bad.to_string().contains("invalid type"), "{bad}");
    }

    #[test]
    fn trace_entries_carry_fields_beside_the_words() {
        let entry = TraceEntry::new(
            1_700_000_000,
            "fw-2-4",
            "group canary paused rollout fw-2-4: 3 of 20 failed > 10%",
        )
        .kind(TraceKind::ErrorPaused)
        .group("canary")
        .compared(Compared {
            counted: "failed".into(),
            count: 3,
            of: 20,
            op: ">".into(),
            threshold: "10%".into(),
            met: true,
        });
        let json = serde_json::to_value(&entry).expect("encodes");
        assert_eq!(
            json,
            serde_json::json!({"at": 1_700_000_000u64, "rollout": "fw-2-4",
                "message": "group canary paused rollout fw-2-4: 3 of 20 failed > 10%",
                "kind": "error_paused", "group": "canary",
                "compared": {"counted": "failed", "count": 3, "of": 20, "op": ">",
                             "threshold": "10%", "met": true}})
        );
        assert_eq!(
            serde_json::from_value::<TraceEntry>(json).expect("decodes"),
            entry
        );
        // Written by an older coordinator: only the words.
        let old: TraceEntry =
            serde_json::from_str(r#"{"at":1,"rollout":"r","message":"paused by operator"}"#)
                .expect("old entries decode");
        assert_eq!((old.kind, old.by), (TraceKind::Note, None));
        // Written by a newer one: a kind this reader does not know is a note.
        let newer: TraceEntry = serde_json::from_str(
            r#"{"at":1,"rollout":"r","message":"m","kind":"something_new","by":"alice"}"#,
        )
        .expect("unknown kinds decode");
        assert_eq!(
            (newer.kind, newer.by.as_deref()),
            (TraceKind::Note, Some("alice"))
        );
        assert_eq!(TraceKind::DeviceTakenOver.name(), "device_taken_over");
    }

    #[test]
    fn operations_commands_have_stable_json() {
        let cases = [
            (
                Command::Approve {
                    name: "fw-2-4-canary".into(),
                },
                serde_json::json!({"command": "approve", "name": "fw-2-4-canary"}),
            ),
            (
                Command::RetryRollout {
                    rollout: "fw-2-4".into(),
                    name: None,
                },
                serde_json::json!({"command": "retry_rollout", "rollout": "fw-2-4", "name": null}),
            ),
            (
                Command::CreateGroup {
                    name: "kitchens".into(),
                    select: "site=a".into(),
                    labels: BTreeMap::from([("tier".into(), "1".into())]),
                },
                serde_json::json!({"command": "create_group", "name": "kitchens",
                                   "select": "site=a", "labels": {"tier": "1"}}),
            ),
            (
                Command::ListApprovals {
                    page: PageQuery::default(),
                },
                serde_json::json!({"command": "list_approvals"}),
            ),
        ];
        for (command, json) in cases {
            assert_eq!(serde_json::to_value(&command).expect("encodes"), json);
        }
        let minimal: Command =
            serde_json::from_str(r#"{"command":"create_group","name":"g","select":"a=b"}"#)
                .expect("labels are optional");
        assert_eq!(
            minimal,
            Command::CreateGroup {
                name: "g".into(),
                select: "a=b".into(),
                labels: BTreeMap::new()
            }
        );
        let retry: Command = serde_json::from_str(r#"{"command":"retry_rollout","rollout":"r"}"#)
            .expect("name is optional");
        assert_eq!(
            retry,
            Command::RetryRollout {
                rollout: "r".into(),
                name: None
            }
        );
    }
}
