//! The device-facing messages. They travel as postcard inside an [`Envelope`](crate::Envelope).
//!
//! postcard is not self-describing, so the rules are: enums only ever gain variants at the end,
//! struct fields are never reordered or removed, and no serde attributes that postcard cannot
//! round-trip (no `skip_serializing_if`, no `flatten`, no untagged enums). The golden-bytes tests in
//! `tests/golden.rs` catch any accidental change.

use serde::{Deserialize, Serialize};

use crate::signing::SignedBlob;

/// Seconds since the Unix epoch.
pub type UnixTime = u64;

/// A sha256 digest.
pub type Digest = [u8; 32];

/// A release, signed offline with a release key. Carried inside desired actions as the exact
/// signed bytes, so the agent verifies what the release key signed, not a re-encoding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseManifest {
    /// Release name, unique per coordinator, e.g. `fw-2.4.0`.
    pub name: String,
    /// Human-readable version, e.g. `2.4.0`.
    pub version: String,
    /// Monotonic release counter: an agent only installs a counter higher than the installed one.
    pub counter: u64,
    /// Hardware ids this release may be installed on; empty means any.
    pub hardware: Vec<String>,
    pub artifacts: Vec<Artifact>,
    pub created_at: UnixTime,
    /// After this time no agent accepts the release.
    pub expires_at: UnixTime,
}

/// One file of a release.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    pub name: String,
    /// The name of the update target on the device that installs it, e.g. `app`.
    pub target: String,
    pub size: u64,
    pub sha256: Digest,
}

/// What the coordinator wants one device to do. Signed online with the coordinator key and
/// published retained on the device's `desired` topic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DesiredAction {
    /// Unique per device and rollout; the agent never applies the same action id twice.
    pub action_id: String,
    pub device_id: String,
    pub rollout_id: String,
    pub issued_at: UnixTime,
    pub expires_at: UnixTime,
    pub body: ActionBody,
}

/// The substance of a desired action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ActionBody {
    /// Nothing to do: the device should stay as it is.
    Nothing,
    /// Install a release. `manifest` holds the release key's signature over the manifest bytes.
    Install {
        manifest: SignedBlob,
        kind: ActionKind,
        window: Option<TimeWindow>,
    },
    /// Stop the named action if it has not been activated yet.
    Cancel { action_id: String },
    /// Return to the release the device kept before the named action.
    Rollback { action_id: String },
    /// Install a release, fetching blocks from the peers a coordinator-signed [`PeerGrant`]
    /// names before the coordinator. `grant` is signed on its own so the device can show it to
    /// those peers ([`PeerFetch`]). Sent only when peer sharing is on for the rollout; an older
    /// agent refuses this variant as malformed instead of misreading it.
    InstallWithPeers {
        manifest: SignedBlob,
        kind: ActionKind,
        window: Option<TimeWindow>,
        grant: SignedBlob,
    },
    /// Install a release, fetching blocks from HTTP(S) origins too (decision 0062): `origins`
    /// names, per artifact digest, a URL the device may fetch that artifact's blocks from with
    /// range requests, each block checked against the signed block list as a peer's is.
    /// `grant` is the peer grant, when the rollout shares between peers. Locations are not in
    /// the release's signed manifest (they change); this action is signed by the coordinator.
    /// An older agent refuses this variant as malformed instead of misreading it.
    InstallFromOrigins {
        manifest: SignedBlob,
        kind: ActionKind,
        window: Option<TimeWindow>,
        grant: Option<SignedBlob>,
        origins: Vec<crate::origin::Origin>,
    },
}

/// The parts of an install, whichever variant carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstallRef<'a> {
    pub manifest: &'a SignedBlob,
    pub kind: ActionKind,
    pub window: Option<TimeWindow>,
    /// The peer grant, for [`ActionBody::InstallWithPeers`].
    pub grant: Option<&'a SignedBlob>,
    /// HTTP(S) locations of its artifacts, for [`ActionBody::InstallFromOrigins`].
    pub origins: &'a [crate::origin::Origin],
}

impl ActionBody {
    /// The install this body asks for, if it is one.
    pub fn install(&self) -> Option<InstallRef<'_>> {
        match self {
            ActionBody::Install {
                manifest,
                kind,
                window,
            } => Some(InstallRef {
                manifest,
                kind: *kind,
                window: *window,
                grant: None,
                origins: &[],
            }),
            ActionBody::InstallWithPeers {
                manifest,
                kind,
                window,
                grant,
            } => Some(InstallRef {
                manifest,
                kind: *kind,
                window: *window,
                grant: Some(grant),
                origins: &[],
            }),
            ActionBody::InstallFromOrigins {
                manifest,
                kind,
                window,
                grant,
                origins,
            } => Some(InstallRef {
                manifest,
                kind: *kind,
                window: *window,
                grant: grant.as_ref(),
                origins,
            }),
            _ => None,
        }
    }

    /// The action kind of an install, to change it in place (tests, time-forced promotion).
    pub fn install_kind_mut(&mut self) -> Option<&mut ActionKind> {
        match self {
            ActionBody::Install { kind, .. }
            | ActionBody::InstallWithPeers { kind, .. }
            | ActionBody::InstallFromOrigins { kind, .. } => Some(kind),
            _ => None,
        }
    }
}

/// Signed by the coordinator for one device and one action: the peers it may fetch blocks from,
/// in the order to try them, and the digests (artifacts and their block lists) it may ask them
/// for. A peer serves a [`PeerFetch`] only if this verifies against a coordinator key it trusts,
/// names the peer among `sources`, covers the digest asked for, and has not expired; it answers
/// on the topic of `device_id`, never one the request names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerGrant {
    pub device_id: String,
    pub action_id: String,
    pub rollout_id: String,
    pub sources: Vec<String>,
    pub digests: Vec<Digest>,
    pub expires_at: UnixTime,
}

/// A block request to a peer, on the peer's `peer-fetch` topic: the requester's grant and what
/// it asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerFetch {
    pub grant: SignedBlob,
    pub request: BlockRequest,
}

/// Where an action's bytes came from, sent with its final report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ByteCounts {
    /// Bytes fetched from the coordinator's artifact server.
    pub coordinator: u64,
    /// Bytes copied from what the device already held (an installed release, the other slot,
    /// an earlier download).
    pub local: u64,
    /// Bytes fetched from each peer, by device id, and from HTTP(S) origins under the name
    /// [`HTTP_SOURCE`](crate::origin::HTTP_SOURCE) (decision 0062).
    pub peers: Vec<(String, u64)>,
}

/// A peer a device stopped asking during one action, and why ("block 12 failed its hash",
/// "no answer within 3s").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BypassedPeer {
    pub peer: String,
    pub reason: String,
}

impl ByteCounts {
    /// Bytes fetched from peers, all together (HTTP origins left out).
    pub fn from_peers(&self) -> u64 {
        self.peers
            .iter()
            .filter(|(name, _)| name != crate::origin::HTTP_SOURCE)
            .map(|(_, n)| n)
            .sum()
    }

    /// Bytes fetched from HTTP(S) origins.
    pub fn from_http(&self) -> u64 {
        self.peers
            .iter()
            .filter(|(name, _)| name == crate::origin::HTTP_SOURCE)
            .map(|(_, n)| n)
            .sum()
    }

    /// Every byte counted, whatever its source.
    pub fn total(&self) -> u64 {
        self.coordinator + self.local + self.from_peers() + self.from_http()
    }
}

/// hawkBit's action types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ActionKind {
    /// Install at once.
    Forced,
    /// Install once the device consents locally.
    Soft,
    /// Download and verify only.
    DownloadOnly,
    /// Soft until the given time, forced after it.
    TimeForced { at: UnixTime },
}

/// A window of time in which installing is allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimeWindow {
    pub not_before: UnixTime,
    pub not_after: UnixTime,
}

/// An agent's progress report for one action. `seq` grows by one per report per device, so
/// the coordinator sees duplicates and gaps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub device_id: String,
    pub seq: u64,
    pub action_id: String,
    pub rollout_id: String,
    pub phase: Phase,
    pub at: UnixTime,
}

/// Where an action stands on the device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    Accepted,
    /// Waiting for the time window or local consent.
    Waiting {
        reason: String,
    },
    Downloading {
        done: u64,
        total: u64,
    },
    Verified,
    Staged,
    Activated,
    /// Health checks are running over the soak time.
    Confirming,
    /// Installed and healthy for the whole soak time.
    Ready,
    Failed {
        reason: String,
        rolled_back: bool,
    },
    Canceled,
    /// The action was refused before anything was applied (trust checks, compatibility).
    Refused {
        reason: String,
    },
    /// Download-only actions end here.
    Downloaded,
    /// Installed and activated; this device has no health checks, so its readiness cannot be
    /// tracked. Terminal like `Ready`: the installed release is updated.
    Applied,
}

impl Phase {
    /// Whether the action is over on the device.
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            Phase::Ready
                | Phase::Failed { .. }
                | Phase::Canceled
                | Phase::Refused { .. }
                | Phase::Downloaded
                | Phase::Applied
        )
    }

    /// A short lower-case name, as shown in tables and JSON.
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Accepted => "accepted",
            Phase::Waiting { .. } => "waiting",
            Phase::Downloading { .. } => "downloading",
            Phase::Verified => "verified",
            Phase::Staged => "staged",
            Phase::Activated => "activated",
            Phase::Confirming => "confirming",
            Phase::Ready => "ready",
            Phase::Failed { .. } => "failed",
            Phase::Canceled => "canceled",
            Phase::Refused { .. } => "refused",
            Phase::Downloaded => "downloaded",
            Phase::Applied => "applied",
        }
    }

    /// The reason carried by a failed, refused or waiting phase.
    pub fn reason(&self) -> Option<&str> {
        match self {
            Phase::Failed { reason, .. }
            | Phase::Refused { reason }
            | Phase::Waiting { reason } => Some(reason),
            _ => None,
        }
    }
}

/// A device's self-description, published retained on its `state` topic. The last will is the
/// same message with `online: false`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceState {
    pub device_id: String,
    pub hardware_id: String,
    pub labels: Vec<(String, String)>,
    pub installed: Option<InstalledRelease>,
    pub current: Option<CurrentAction>,
    pub online: bool,
    pub agent_version: String,
    pub at: UnixTime,
}

/// The release a device runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstalledRelease {
    pub name: String,
    pub version: String,
    pub counter: u64,
}

/// The action a device is working on, or finished last.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CurrentAction {
    pub action_id: String,
    pub rollout_id: String,
    pub phase: Phase,
}

/// A request for part of an artifact, by digest. Requests are pipelined: an agent keeps several
/// in flight and resumes at the first block it does not have.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRequest {
    pub sha256: Digest,
    pub offset: u64,
    pub length: u32,
}

/// The artifact server's answer to a [`BlockRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockReply {
    Data {
        sha256: Digest,
        offset: u64,
        /// One byte string on the wire (the same postcard bytes as a `u8` sequence, read and
        /// written in one piece).
        #[serde(with = "crate::raw_bytes")]
        data: Vec<u8>,
    },
    /// The server has no artifact with that digest, or the range lies outside it.
    Unavailable {
        sha256: Digest,
        offset: u64,
        reason: String,
    },
}

/// What a device signs with its own key: every state, report and block request it sends
/// travels as the postcard bytes of one of these inside a [`SignedBlob`], wrapped in
/// [`Message::Device`](crate::Message::Device). See [`crate::device`] for signing and checking.
///
/// Each variant names the device it speaks for, so a signed message cannot be moved to another
/// device's topic, and the variant names its kind, so a signed report cannot pass as a state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceMessage {
    /// The device's retained state. `enrollment` proves knowledge of a one-time enrollment
    /// token without revealing it ([`crate::device::enrollment_proof`]).
    State {
        state: DeviceState,
        enrollment: Option<Digest>,
    },
    Report(Report),
    Fetch {
        device_id: String,
        request: BlockRequest,
    },
    /// A report that ends an action, with where its bytes came from and the peers the device
    /// stopped asking (a bad block, no answer), so the coordinator's trace can say so.
    ReportWithBytes {
        report: Report,
        bytes: ByteCounts,
        bypassed: Vec<BypassedPeer>,
    },
}

impl DeviceMessage {
    /// The device the message speaks for.
    pub fn device_id(&self) -> &str {
        match self {
            DeviceMessage::State { state, .. } => &state.device_id,
            DeviceMessage::Report(r) | DeviceMessage::ReportWithBytes { report: r, .. } => {
                &r.device_id
            }
            DeviceMessage::Fetch { device_id, .. } => device_id,
        }
    }

    /// The message's name, for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            DeviceMessage::State { .. } => "device state",
            DeviceMessage::Report(_) => "report",
            DeviceMessage::Fetch { .. } => "block request",
            DeviceMessage::ReportWithBytes { .. } => "report",
        }
    }
}
