//! What a standby keeps warm so that taking over needs no re-read of the fleet's retained
//! messages: every device's last state and last desired action, checked as they arrive.
//!
//! A standby coordinator (`standby.rs`) stays subscribed to the same topics as the leader. It
//! keeps, per device:
//! - the last **state**, decoded, when its signature verifies under the key the device is
//!   accepted with in the standby's snapshot of the enrollments ([`Warm::observe_state`]);
//!   a state the snapshot cannot vouch for (a device enrolled since, a new key) is kept as
//!   received, and checked again when the snapshot is refreshed ([`Warm::refresh`]) or, at the
//!   latest, by the new leader through the same path as any state it receives;
//! - the last **desired action**, when this coordinator's key signed it for that device
//!   ([`Warm::observe_desired`]): its action id, issue and expiry times, and the digests it lets
//!   the device fetch. Anything else on a desired topic drops the entry, so the new leader
//!   publishes what it owes there.
//!
//! - the **reports and block requests** of the last few seconds, as received: one sent after
//!   the leader died and before another took over would otherwise wait for its device to send
//!   it again (a block request, the device's reply timeout).
//!
//! When it takes over, the new leader checks every kept state once more against the
//! enrollments it has just read (a device revoked since is not let in), feeds them to its
//! engine, and reads the kept desired actions exactly as it would have read them back from the
//! broker (`inbound.rs`). Pure: the standby owns the link and the store.
//!
//! Bounded: at most [`MAX_UNCHECKED`] states wait for a snapshot; past that, or when the link
//! dropped a message, the kept view is no longer known to be complete ([`Warm::is_complete`]),
//! and the new leader reads everything from the broker again as a coordinator does on start.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use flotilla_protocol::{
    envelope, DesiredAction, DeviceMessage, DeviceState, Digest, Message, VerifyingKey,
};

use crate::service::enrollment::{Enrollment, Registry, Status};
use crate::service::releases;
use crate::service::verify::{self, Checked};
use flotilla_protocol::manifest::Manifest;

/// States kept as received, waiting for a snapshot of the enrollments that accepts them.
pub const MAX_UNCHECKED: usize = 20_000;

/// Recent reports and block requests kept at most; the oldest go first.
pub const MAX_RECENT: usize = 50_000;

/// A device's retained desired action, as much of it as a coordinator needs after reading it
/// back: which action it is, when it was issued and until when it holds, and what it lets the
/// device fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetainedDesired {
    pub action_id: String,
    pub issued_at: u64,
    pub expires_at: u64,
    pub fetchable: Vec<Digest>,
}

impl RetainedDesired {
    /// What a coordinator keeps of `action`.
    pub fn of(action: &DesiredAction) -> RetainedDesired {
        RetainedDesired {
            action_id: action.action_id.clone(),
            issued_at: action.issued_at,
            expires_at: action.expires_at,
            fetchable: fetchable(action),
        }
    }
}

/// The artifacts and block lists an install lets its device fetch; none for anything else.
pub fn fetchable(action: &DesiredAction) -> Vec<Digest> {
    action
        .body
        .install()
        .and_then(|install| Manifest::decode(&install.manifest.payload).ok())
        .map(|m| releases::fetchable_digests(&m))
        .unwrap_or_default()
}

/// A device state whose signature verified under `key`.
#[derive(Debug, Clone)]
pub struct KeptState {
    pub key: [u8; 32],
    pub state: DeviceState,
}

/// What a standby knows of the fleet from its subscriptions.
#[derive(Debug, Default)]
pub struct Warm {
    /// Device id -> its accepted key, from the last snapshot of the enrollments.
    accepted: HashMap<String, [u8; 32]>,
    states: HashMap<String, KeptState>,
    unchecked: HashMap<String, Vec<u8>>,
    desired: HashMap<String, RetainedDesired>,
    /// Reports and block requests as received, with when, for the last [`Warm::window`]: those
    /// sent while no coordinator led reach the new leader.
    recent: VecDeque<(Instant, String, Vec<u8>)>,
    window: Duration,
    /// Something was not kept (too many unchecked states, a message the link dropped).
    incomplete: Option<String>,
}

impl Warm {
    /// Nothing kept yet; states are checked against the accepted keys in `enrollments`;
    /// reports are kept for `window` (how long a coordinator can be gone before another
    /// leads).
    pub fn new(enrollments: &[Enrollment], window: Duration) -> Warm {
        Warm {
            accepted: accepted_keys(enrollments),
            window,
            ..Warm::default()
        }
    }

    /// A report or a block request on `topic`, received at `now`: kept, unchecked, for
    /// [`Warm::window`]. The new leader reads what is left as it reads any (its engine counts
    /// each report `seq` once; a device ignores a block it no longer waits for).
    pub fn observe_recent(&mut self, topic: &str, payload: &[u8], now: Instant) {
        while let Some((at, _, _)) = self.recent.front() {
            if now.duration_since(*at) <= self.window && self.recent.len() < MAX_RECENT {
                break;
            }
            self.recent.pop_front();
        }
        self.recent
            .push_back((now, topic.to_owned(), payload.to_vec()));
    }

    /// A publish on device `device`'s state topic. An empty payload clears the state.
    pub fn observe_state(&mut self, device: &str, payload: &[u8], checked: Option<Checked>) {
        self.states.remove(device);
        self.unchecked.remove(device);
        if payload.is_empty() {
            return;
        }
        let checked = checked.unwrap_or_else(|| verify::check(payload, None));
        match self.vouched(device, checked) {
            Some(kept) => {
                self.states.insert(device.to_owned(), kept);
            }
            None if self.unchecked.len() < MAX_UNCHECKED => {
                self.unchecked.insert(device.to_owned(), payload.to_vec());
            }
            None => self.lose(format!(
                "more than {MAX_UNCHECKED} device states could not be checked against the \
                 enrollments"
            )),
        }
    }

    /// The state in `checked`, if the device is accepted with the key that signed it.
    fn vouched(&self, device: &str, checked: Checked) -> Option<KeptState> {
        let Checked::Signed { blob, verified } = checked else {
            return None;
        };
        let (key, message) = verify::decode_verified(&blob, verified)?;
        let DeviceMessage::State { state, .. } = message else {
            return None;
        };
        (state.device_id == device && self.accepted.get(device) == Some(key.as_bytes())).then(
            || KeptState {
                key: *key.as_bytes(),
                state,
            },
        )
    }

    /// A publish on device `device`'s desired topic: kept when `coordinator` signed it for
    /// this device.
    pub fn observe_desired(&mut self, device: &str, payload: &[u8], coordinator: &VerifyingKey) {
        match ours(device, payload, coordinator) {
            Some(action) => {
                self.desired
                    .insert(device.to_owned(), RetainedDesired::of(&action));
            }
            None => {
                self.desired.remove(device);
            }
        }
    }

    /// A fresh snapshot of the enrollments: the states waiting for one are checked again.
    pub fn refresh(&mut self, enrollments: &[Enrollment]) {
        self.accepted = accepted_keys(enrollments);
        for (device, payload) in std::mem::take(&mut self.unchecked) {
            self.observe_state(&device, &payload, None);
        }
    }

    /// Records that something the leader would have read was not kept.
    pub fn lose(&mut self, why: String) {
        if self.incomplete.is_none() {
            self.incomplete = Some(why);
        }
    }

    /// Whether every message the link delivered is kept; the reason when it is not.
    pub fn is_complete(&self) -> Result<(), &str> {
        match &self.incomplete {
            None => Ok(()),
            Some(why) => Err(why),
        }
    }

    /// States kept checked, states waiting for a snapshot, desired actions kept.
    pub fn counts(&self) -> (usize, usize, usize) {
        (self.states.len(), self.unchecked.len(), self.desired.len())
    }

    /// Whether any state waits for a fresh snapshot of the enrollments.
    pub fn has_unchecked(&self) -> bool {
        !self.unchecked.is_empty()
    }

    /// Everything kept, for the new leader, as of `now`.
    pub fn take(self, now: Instant) -> Kept {
        let window = self.window;
        Kept {
            recent: self
                .recent
                .into_iter()
                .filter(|(at, _, _)| now.duration_since(*at) <= window)
                .map(|(_, topic, payload)| (topic, payload))
                .collect(),
            states: self.states,
            unchecked: self.unchecked,
            desired: self.desired,
        }
    }
}

/// What a standby hands the coordinator that takes over.
#[derive(Debug, Default)]
pub struct Kept {
    /// Checked states by device id.
    pub states: HashMap<String, KeptState>,
    /// States as received, by device id, for the leader to check as it checks any state.
    pub unchecked: HashMap<String, Vec<u8>>,
    /// Desired actions this coordinator's key signed, by device id.
    pub desired: HashMap<String, RetainedDesired>,
    /// The reports and block requests of the last window, topic and payload, in arrival order.
    pub recent: Vec<(String, Vec<u8>)>,
}

impl Kept {
    /// Whether `registry` (the new leader's, just read) still accepts the key a kept state was
    /// checked with.
    pub fn still_accepted(registry: &Registry, device: &str, kept: &KeptState) -> bool {
        registry.get(device).is_some_and(|e| {
            e.status == Status::Accepted && e.key == flotilla_protocol::hex::encode(&kept.key)
        })
    }
}

/// The desired action in `payload` if `coordinator` signed it for `device`.
pub fn ours(device: &str, payload: &[u8], coordinator: &VerifyingKey) -> Option<DesiredAction> {
    let Ok(Message::Desired(blob)) = envelope::decode(payload) else {
        return None;
    };
    let bytes = blob.verify("desired action", &[*coordinator]).ok()?;
    let action = envelope::from_bytes::<DesiredAction>("desired action", bytes).ok()?;
    (action.device_id == device).then_some(action)
}

/// Device id -> accepted key, of every accepted device in `enrollments`.
fn accepted_keys(enrollments: &[Enrollment]) -> HashMap<String, [u8; 32]> {
    enrollments
        .iter()
        .filter(|e| e.status == Status::Accepted)
        .filter_map(|e| {
            let key = flotilla_protocol::hex::decode_array::<32>(&e.key).ok()?;
            Some((e.device.clone(), key))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_protocol::{device, ActionBody, SignedBlob, SigningKey};

    const WINDOW: Duration = Duration::from_secs(20);

    fn state(device_id: &str) -> DeviceState {
        DeviceState {
            device_id: device_id.into(),
            hardware_id: "pi4".into(),
            labels: vec![],
            installed: None,
            current: None,
            online: true,
            agent_version: "test".into(),
            at: 1,
        }
    }

    /// `device_id`'s state, signed with `key`, as published.
    fn signed_state(key: &SigningKey, device_id: &str) -> Vec<u8> {
        let message = DeviceMessage::State {
            state: state(device_id),
            enrollment: None,
        };
        envelope::encode(&Message::Device(device::sign(key, &message)))
    }

    fn accepted(device_id: &str, key: &SigningKey) -> Enrollment {
        Enrollment {
            device: device_id.into(),
            key: flotilla_protocol::hex::encode(key.verifying_key().as_bytes()),
            status: Status::Accepted,
            via: Some("operator".into()),
            since: 1,
            new_key: None,
            rejected_keys: vec![],
            waiting_state: None,
        }
    }

    fn desired(key: &SigningKey, device_id: &str, action_id: &str, issued_at: u64) -> Vec<u8> {
        let action = DesiredAction {
            action_id: action_id.into(),
            device_id: device_id.into(),
            rollout_id: "r".into(),
            issued_at,
            expires_at: issued_at + 60,
            body: ActionBody::Nothing,
        };
        let blob = SignedBlob::sign(key, envelope::to_bytes(&action));
        envelope::encode(&Message::Desired(blob))
    }

    #[test]
    fn a_state_is_kept_checked_only_under_the_key_the_device_is_accepted_with() {
        let (dev1, dev2) = (
            SigningKey::from_bytes(&[1; 32]),
            SigningKey::from_bytes(&[2; 32]),
        );
        let mut warm = Warm::new(&[accepted("dev-1", &dev1)], WINDOW);
        warm.observe_state("dev-1", &signed_state(&dev1, "dev-1"), None);
        // Signed by another key, for another device's topic, not signed at all.
        warm.observe_state("dev-2", &signed_state(&dev2, "dev-2"), None);
        warm.observe_state("dev-3", &signed_state(&dev1, "dev-1"), None);
        warm.observe_state("dev-4", b"not an envelope", None);
        assert_eq!(warm.counts(), (1, 3, 0), "one checked, three waiting");
        let kept = warm.take(Instant::now());
        assert_eq!(kept.states["dev-1"].state.device_id, "dev-1");
        assert_eq!(kept.states["dev-1"].key, *dev1.verifying_key().as_bytes());
        assert!(kept.unchecked.contains_key("dev-2"));
    }

    #[test]
    fn a_fresh_snapshot_checks_the_waiting_states_and_an_empty_payload_clears_one() {
        let dev2 = SigningKey::from_bytes(&[2; 32]);
        let mut warm = Warm::new(&[], WINDOW);
        warm.observe_state("dev-2", &signed_state(&dev2, "dev-2"), None);
        assert!(warm.has_unchecked());
        warm.refresh(&[accepted("dev-2", &dev2)]);
        assert_eq!(
            warm.counts(),
            (1, 0, 0),
            "checked once the device is enrolled"
        );
        warm.observe_state("dev-2", b"", None);
        assert_eq!(warm.counts(), (0, 0, 0), "a cleared state is forgotten");
    }

    #[test]
    fn too_many_states_waiting_make_the_view_incomplete() {
        let key = SigningKey::from_bytes(&[3; 32]);
        let mut warm = Warm::new(&[], WINDOW);
        let payload = signed_state(&key, "dev-x");
        for n in 0..=MAX_UNCHECKED {
            warm.observe_state(&format!("dev-{n}"), &payload, None);
        }
        assert_eq!(warm.counts().1, MAX_UNCHECKED);
        let why = warm.is_complete().expect_err("incomplete");
        assert!(why.contains("could not be checked"), "{why}");
    }

    #[test]
    fn only_this_coordinators_desired_action_for_the_device_is_kept() {
        let ours = SigningKey::from_bytes(&[7; 32]);
        let theirs = SigningKey::from_bytes(&[8; 32]);
        let coordinator = ours.verifying_key();
        let mut warm = Warm::new(&[], WINDOW);
        warm.observe_desired("dev-1", &desired(&ours, "dev-1", "a-1", 10), &coordinator);
        warm.observe_desired("dev-2", &desired(&ours, "dev-1", "a-2", 10), &coordinator);
        warm.observe_desired("dev-3", &desired(&theirs, "dev-3", "a-3", 10), &coordinator);
        assert_eq!(warm.counts().2, 1);
        // Overwritten by something that is not ours: forgotten, so the leader publishes again.
        warm.observe_desired("dev-1", b"junk", &coordinator);
        assert_eq!(warm.counts().2, 0);
        warm.observe_desired("dev-1", &desired(&ours, "dev-1", "a-4", 11), &coordinator);
        let kept = warm.take(Instant::now());
        let action = &kept.desired["dev-1"];
        assert_eq!((action.action_id.as_str(), action.issued_at), ("a-4", 11));
        assert_eq!(action.expires_at, 71);
    }

    #[test]
    fn reports_and_block_requests_are_kept_for_the_window_only() {
        let mut warm = Warm::new(&[], WINDOW);
        let start = Instant::now();
        warm.observe_recent("flotilla/v1/devices/dev-1/report", b"old", start);
        warm.observe_recent("flotilla/v1/devices/dev-1/fetch", b"new", start + WINDOW);
        let kept = warm.take(start + WINDOW + Duration::from_secs(1));
        assert_eq!(
            kept.recent,
            vec![(
                "flotilla/v1/devices/dev-1/fetch".to_owned(),
                b"new".to_vec()
            )],
            "what is older than the window is not handed over"
        );
    }
}
