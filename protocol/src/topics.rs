//! Every MQTT topic flotilla uses is built and parsed here, and nowhere else.
//!
//! ```text
//! {root}/v1/devices/{id}/desired    retained  coordinator -> agent   signed desired action (postcard)
//! {root}/v1/devices/{id}/report               agent -> coordinator   progress reports (postcard)
//! {root}/v1/devices/{id}/state      retained  agent -> anyone        device description, last will (postcard)
//! {root}/v1/devices/{id}/fetch                agent -> coordinator   artifact block requests (postcard)
//! {root}/v1/devices/{id}/block                coordinator -> agent   artifact blocks (postcard)
//! {root}/v1/devices/{id}/peer-fetch           peer -> agent          block requests to a peer (postcard)
//! {root}/v1/devices/{id}/peer-block/{peer}    peer -> agent          blocks from peer {peer} (postcard)
//! {root}/v1/events/rollouts/{rollout}  retained                      rollout summary (JSON)
//! {root}/v1/events/log                                               decision trace entries (JSON)
//! {root}/v1/events/approvals/{name}    retained                      approval requests (JSON)
//! {root}/v1/control/request                                          control requests (JSON)
//! {root}/v1/control/reply/{client}                                   replies, topic named in the request
//! ```

use crate::ids::{validate_id, DeviceId};

/// The default topic root.
pub const DEFAULT_ROOT: &str = "flotilla";

/// The protocol version segment of every topic.
pub const VERSION_SEGMENT: &str = "v1";

/// Builds and parses the topics under one root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topics {
    prefix: String,
}

impl Default for Topics {
    fn default() -> Self {
        Self::new(DEFAULT_ROOT)
    }
}

/// A parsed topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topic {
    Desired(DeviceId),
    Report(DeviceId),
    State(DeviceId),
    Fetch(DeviceId),
    Block(DeviceId),
    /// A block request to this device, as a peer.
    PeerFetch(DeviceId),
    /// A block for `device` from the peer `source`.
    PeerBlock {
        device: DeviceId,
        source: DeviceId,
    },
    RolloutEvent(String),
    EventLog,
    ApprovalEvent(String),
    ControlRequest,
    ControlReply(String),
    /// The coordinator's own end-of-retained marker (see [`Topics::marker`]).
    Marker,
}

impl Topics {
    /// Topics under `root` (for example `flotilla` or `site-a/flotilla`), trailing `/` ignored.
    pub fn new(root: &str) -> Self {
        Self {
            prefix: format!("{}/{VERSION_SEGMENT}", root.trim_end_matches('/')),
        }
    }

    /// The root followed by the version, e.g. `flotilla/v1`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn device(&self, id: &DeviceId, leaf: &str) -> String {
        format!("{}/devices/{id}/{leaf}", self.prefix)
    }

    pub fn desired(&self, id: &DeviceId) -> String {
        self.device(id, "desired")
    }
    pub fn report(&self, id: &DeviceId) -> String {
        self.device(id, "report")
    }
    pub fn state(&self, id: &DeviceId) -> String {
        self.device(id, "state")
    }
    pub fn fetch(&self, id: &DeviceId) -> String {
        self.device(id, "fetch")
    }
    pub fn block(&self, id: &DeviceId) -> String {
        self.device(id, "block")
    }
    /// Where peers send this device block requests for what it holds.
    pub fn peer_fetch(&self, id: &DeviceId) -> String {
        self.device(id, "peer-fetch")
    }
    /// Where the peer `source` answers `device`'s block requests. Site brokers keep these and
    /// `peer-fetch` local (they are not bridged), and an ACL lets only `source` publish here.
    pub fn peer_block(&self, device: &DeviceId, source: &DeviceId) -> String {
        format!("{}/devices/{device}/peer-block/{source}", self.prefix)
    }
    /// Filter matching every peer's blocks for one device.
    pub fn peer_block_filter(&self, device: &DeviceId) -> String {
        format!("{}/devices/{device}/peer-block/+", self.prefix)
    }
    pub fn rollout_event(&self, rollout: &str) -> String {
        format!("{}/events/rollouts/{rollout}", self.prefix)
    }
    pub fn event_log(&self) -> String {
        format!("{}/events/log", self.prefix)
    }
    /// An approval request's state, retained: `{rollout}-{group}` or `{rollout}-before-{group}`.
    pub fn approval_event(&self, name: &str) -> String {
        format!("{}/events/approvals/{name}", self.prefix)
    }
    /// Filter matching all approval requests.
    pub fn approval_events_filter(&self) -> String {
        format!("{}/events/approvals/+", self.prefix)
    }
    pub fn control_request(&self) -> String {
        format!("{}/control/request", self.prefix)
    }
    pub fn control_reply(&self, client: &str) -> String {
        format!("{}/control/reply/{client}", self.prefix)
    }
    /// Where the coordinator publishes, and reads back, the marker that tells it every retained
    /// message delivered on subscribe has been read. Only the coordinator may publish or
    /// subscribe here (the shipped ACL); a random per-connection nonce in the payload covers a
    /// broker without one.
    pub fn marker(&self) -> String {
        format!("{}/coordinator/marker", self.prefix)
    }

    /// Subscription filters for the coordinator: every device's reports, states and block
    /// requests, and control requests.
    pub fn coordinator_filters(&self) -> Vec<String> {
        vec![
            format!("{}/devices/+/report", self.prefix),
            format!("{}/devices/+/state", self.prefix),
            format!("{}/devices/+/fetch", self.prefix),
            self.control_request(),
        ]
    }

    /// Every device's `desired` topic: the coordinator reads back the retained desired actions
    /// (its own, signed with its key) to know which artifacts each device may fetch.
    pub fn desired_filter(&self) -> String {
        format!("{}/devices/+/desired", self.prefix)
    }

    /// Subscription filters for one agent: its desired action, its blocks from the coordinator
    /// and from peers, and block requests from peers.
    pub fn agent_filters(&self, id: &DeviceId) -> Vec<String> {
        vec![
            self.desired(id),
            self.block(id),
            self.peer_block_filter(id),
            self.peer_fetch(id),
        ]
    }

    /// Filter matching all rollout summaries.
    pub fn rollout_events_filter(&self) -> String {
        format!("{}/events/rollouts/+", self.prefix)
    }

    /// Parses a topic under this root; `None` for anything else (including invalid ids).
    pub fn parse(&self, topic: &str) -> Option<Topic> {
        let rest = topic.strip_prefix(&self.prefix)?.strip_prefix('/')?;
        let parts: Vec<&str> = rest.split('/').collect();
        match parts.as_slice() {
            ["devices", id, leaf] => {
                let id = DeviceId::new(*id).ok()?;
                Some(match *leaf {
                    "desired" => Topic::Desired(id),
                    "report" => Topic::Report(id),
                    "state" => Topic::State(id),
                    "fetch" => Topic::Fetch(id),
                    "block" => Topic::Block(id),
                    "peer-fetch" => Topic::PeerFetch(id),
                    _ => return None,
                })
            }
            ["devices", id, "peer-block", source] => Some(Topic::PeerBlock {
                device: DeviceId::new(*id).ok()?,
                source: DeviceId::new(*source).ok()?,
            }),
            ["events", "rollouts", name] => {
                validate_id("rollout name", name).ok()?;
                Some(Topic::RolloutEvent((*name).to_owned()))
            }
            ["events", "log"] => Some(Topic::EventLog),
            ["events", "approvals", name] => {
                validate_id("approval name", name).ok()?;
                Some(Topic::ApprovalEvent((*name).to_owned()))
            }
            ["control", "request"] => Some(Topic::ControlRequest),
            ["coordinator", "marker"] => Some(Topic::Marker),
            ["control", "reply", client] if !client.is_empty() => {
                Some(Topic::ControlReply((*client).to_owned()))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_topic_round_trips() {
        let t = Topics::new("site-a/flotilla/");
        let id = DeviceId::new("dev-1").expect("valid");
        let cases = [
            (t.desired(&id), Topic::Desired(id.clone())),
            (t.report(&id), Topic::Report(id.clone())),
            (t.state(&id), Topic::State(id.clone())),
            (t.fetch(&id), Topic::Fetch(id.clone())),
            (t.block(&id), Topic::Block(id.clone())),
            (t.peer_fetch(&id), Topic::PeerFetch(id.clone())),
            (
                t.peer_block(&id, &DeviceId::new("dev-2").expect("valid")),
                Topic::PeerBlock {
                    device: id.clone(),
                    source: DeviceId::new("dev-2").expect("valid"),
                },
            ),
            (
                t.rollout_event("fw-2-4"),
                Topic::RolloutEvent("fw-2-4".into()),
            ),
            (t.event_log(), Topic::EventLog),
            (
                t.approval_event("fw-2-4-before-canary"),
                Topic::ApprovalEvent("fw-2-4-before-canary".into()),
            ),
            (t.control_request(), Topic::ControlRequest),
            (
                t.control_reply("cli-7"),
                Topic::ControlReply("cli-7".into()),
            ),
            (t.marker(), Topic::Marker),
        ];
        for (topic, parsed) in cases {
            assert!(topic.starts_with("site-a/flotilla/v1/"), "{topic}");
            assert_eq!(t.parse(&topic), Some(parsed), "{topic}");
        }
        assert_eq!(t.desired(&id), "site-a/flotilla/v1/devices/dev-1/desired");
        assert_eq!(
            t.approval_event("fw-2-4-canary"),
            "site-a/flotilla/v1/events/approvals/fw-2-4-canary"
        );
        assert_eq!(
            t.approval_events_filter(),
            "site-a/flotilla/v1/events/approvals/+"
        );
    }

    #[test]
    fn foreign_topics_are_ignored() {
        let t = Topics::default();
        for topic in [
            "flotilla/v2/devices/a/desired",
            "other/v1/devices/a/desired",
            "flotilla/v1/devices/a/unknown",
            "flotilla/v1/devices/a+b/state",
            "flotilla/v1/devices/a/state/extra",
            "flotilla/v1/events/approvals/a+b",
            "flotilla/v1/devices/a/peer-block/b+c",
            "flotilla/v1/devices/a/peer-block",
            "flotilla/v1/events/approvals/",
            "flotilla/v1",
        ] {
            assert_eq!(t.parse(topic), None, "{topic}");
        }
    }
}
