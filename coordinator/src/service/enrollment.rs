//! Device enrollment: which key speaks for which device, and whether the coordinator listens.
//!
//! Every state, report and block request arrives as a [`DeviceMessage`] signed by the device's
//! own key ([`flotilla_protocol::device`]). The [`Registry`] decides, for each one, whether it
//! may reach the engine or the artifact server:
//!
//! - The signature is checked over the exact bytes received, first against the key the message
//!   names (so a broken or moved signature is refused before anything else), and the message
//!   must speak for the device whose topic it came on.
//! - A device the coordinator has never seen becomes **pending** with the key of its first
//!   signed state, like a device's authentication set in Mender's device authorization. It is
//!   accepted without an operator only when that key is pre-authorized (the `authorized_keys`
//!   file) or the state carries the proof of an unused enrollment token, which is then used up.
//! - Only messages signed by the **accepted** key pass. A different key for a known device
//!   waits as the device's `new_key` until an operator accepts or rejects it; the device stays
//!   accepted with its old key meanwhile, so a stranger with a made-up key can neither take the
//!   device over nor knock it off the fleet. A key change is never accepted silently.
//! - Rejected keys and revoked devices are ignored from then on.
//!
//! - A token's proof is checked only within the enrollment attempt limits (`[enrollment]
//!   attempts_per_second`, `device_attempts_per_minute`), so tokens cannot be guessed online at
//!   any speed. An attempt beyond them is not lost: its device waits as pending with the state
//!   that carried it, and [`Registry::retry_deferred`] checks it when there is room again.
//!
//! Everything ignored is counted by reason ([`Ignored`]), and [`IgnoredLog`] turns the counts
//! into at most one log line per interval, with the rate of each reason, so a flood of forged
//! messages or guessed tokens cannot flood the log and is still named.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::service::tokens::new_token;
use crate::service::tokens::{
    AttemptCounts, Attempts, ATTEMPTS_PER_SECOND, DEVICE_ATTEMPTS_PER_MINUTE,
};

use flotilla_protocol::control::EnrollmentInfo;
use flotilla_protocol::{device, hex, DeviceMessage, DeviceState, SignedBlob, VerifyingKey};
use serde::{Deserialize, Serialize};

/// Where a device stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Pending,
    Accepted,
    Rejected,
    Revoked,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Accepted => "accepted",
            Status::Rejected => "rejected",
            Status::Revoked => "revoked",
        }
    }
}

/// One device's enrollment, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Enrollment {
    pub device: String,
    /// The key (hex) `status` is about.
    pub key: String,
    pub status: Status,
    /// How an accepted key was accepted: `operator`, `token` or `authorized_key`.
    #[serde(default)]
    pub via: Option<String>,
    /// Unix seconds of the last status change.
    pub since: u64,
    /// Another key (hex) that signed a state for this device, waiting for an operator.
    #[serde(default)]
    pub new_key: Option<String>,
    /// Keys (hex) an operator rejected for this device; ignored from then on.
    #[serde(default)]
    pub rejected_keys: Vec<String>,
    /// The last state signed by the waiting key (`key` while pending, else `new_key`), as
    /// received, so accepting it can register the device at once.
    #[serde(default)]
    pub waiting_state: Option<SignedBlob>,
}

/// Why a device message was ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Ignored {
    /// An old unsigned state, report or block request.
    Unsigned,
    /// The signature does not verify against the key the message names, or the signed bytes
    /// are not a device message.
    BadSignature,
    /// Signed for another device than the topic's, or the wrong kind for the topic.
    WrongTopic,
    /// A report or block request from a device that never sent a signed state.
    Unknown,
    Pending,
    Rejected,
    Revoked,
    /// Signed by a key that is not the device's accepted key.
    OtherKey,
    /// A new device while `max_pending` devices already wait.
    TooManyPending,
    /// A block request for an artifact of no action the device holds.
    NoAction,
    /// A state whose enrollment token proof matches no unused token (the device is pending).
    WrongToken,
    /// A state whose enrollment token proof waits: the attempt limits were reached.
    AttemptLimited,
}

impl Ignored {
    pub fn name(self) -> &'static str {
        match self {
            Ignored::Unsigned => "unsigned",
            Ignored::BadSignature => "bad signature",
            Ignored::WrongTopic => "wrong topic",
            Ignored::Unknown => "unknown device",
            Ignored::Pending => "device pending",
            Ignored::Rejected => "key rejected",
            Ignored::Revoked => "device revoked",
            Ignored::OtherKey => "signed by another key",
            Ignored::TooManyPending => "too many pending devices",
            Ignored::NoAction => "no action for this artifact",
            Ignored::WrongToken => "wrong enrollment token",
            Ignored::AttemptLimited => "enrollment attempt over the limit",
        }
    }
}

/// What the registry made of one signed device message.
#[derive(Debug, Default)]
pub struct Verdict {
    /// Signed by the device's accepted key: hand it on.
    pub accepted: Option<DeviceMessage>,
    pub ignored: Option<Ignored>,
    /// The device's record changed and must be stored.
    pub changed: bool,
    /// An enrollment token (its sha256, hex) was used up and must be stored.
    pub used_token: Option<String>,
    /// A transition worth an INFO line (a new pending device, an automatic acceptance).
    pub note: Option<String>,
}

impl Verdict {
    fn ignored(why: Ignored) -> Self {
        Verdict {
            ignored: Some(why),
            ..Verdict::default()
        }
    }
}

/// A pre-authorized key, optionally bound to one device id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthorizedKey {
    pub key: [u8; 32],
    pub device: Option<String>,
}

/// Parses an authorized keys file: one hex public key per line, optionally followed by the
/// device id it may enroll; blank lines and `#` comments are skipped. Errors name the line.
pub fn parse_authorized_keys(text: &str) -> Result<Vec<AuthorizedKey>, String> {
    let mut keys = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let key_text = words.next().unwrap_or("");
        let key = flotilla_protocol::signing::public_key_from_text(key_text)
            .map_err(|e| format!("line {}: {key_text:?}: {e}", n + 1))?;
        let device = match words.next() {
            Some(id) => {
                flotilla_protocol::validate_id("device id", id)
                    .map_err(|e| format!("line {}: {e}", n + 1))?;
                Some(id.to_owned())
            }
            None => None,
        };
        if let Some(extra) = words.next() {
            return Err(format!(
                "line {}: unexpected {extra:?} after the key and device id",
                n + 1
            ));
        }
        keys.push(AuthorizedKey {
            key: key.to_bytes(),
            device,
        });
    }
    Ok(keys)
}

/// How a state that arrived would be accepted without an operator.
#[derive(Debug, PartialEq, Eq)]
enum Auto {
    /// Not at all: no authorized key, no token proof.
    No,
    AuthorizedKey,
    /// An unused token (its sha256, hex) matched the proof.
    Token(String),
    /// The proof matched no unused token.
    WrongToken,
    /// The proof was not checked: the attempt limits were reached.
    Limited,
}

impl Auto {
    /// How it accepts (the via name and the token used up), if it does.
    fn accepts(&self) -> Option<(&'static str, Option<String>)> {
        match self {
            Auto::AuthorizedKey => Some(("authorized_key", None)),
            Auto::Token(digest) => Some(("token", Some(digest.clone()))),
            _ => None,
        }
    }

    /// Why the message is ignored when it does not accept: `otherwise`, or what the token
    /// attempt came to.
    fn ignored(&self, otherwise: Ignored) -> Ignored {
        match self {
            Auto::WrongToken => Ignored::WrongToken,
            Auto::Limited => Ignored::AttemptLimited,
            _ => otherwise,
        }
    }
}

/// The enrollments and what is accepted without an operator.
#[derive(Debug)]
pub struct Registry {
    records: BTreeMap<String, Enrollment>,
    /// Pre-authorized keys, each with the device ids it may enroll (`None`: any). A map, because
    /// every state of a device not yet accepted is checked against it.
    authorized: HashMap<[u8; 32], Vec<Option<String>>>,
    tokens: Vec<String>,
    /// sha256 (hex) of used-up tokens.
    used: BTreeSet<String>,
    max_pending: usize,
    attempts: Attempts,
    /// Devices whose waiting state carries a token proof the attempt limits held back.
    deferred: BTreeSet<String>,
}

impl Default for Registry {
    fn default() -> Self {
        Registry::new(Vec::new(), Vec::new(), Vec::new(), Vec::new(), 1000)
    }
}

fn token_digest(token: &str) -> String {
    hex::encode(&flotilla_protocol::sha256(token.as_bytes()))
}

/// The fewest hex digits of a key an operator may give to pin it: 64 bits, so nobody can make a
/// key that shares them with the device's.
pub const MIN_KEY_PREFIX: usize = 16;

/// Checks an operator's key (full hex or at least its first [`MIN_KEY_PREFIX`] hex digits) and
/// returns it in lower case.
fn given_key(given: &str) -> Result<String, String> {
    let given = given.trim().to_ascii_lowercase();
    if given.len() < MIN_KEY_PREFIX || given.len() > 64 {
        return Err(format!(
            "key {given:?} is {} hex digits: give the full key (64) or at least its first \
             {MIN_KEY_PREFIX}",
            given.len()
        ));
    }
    if let Some(bad) = given.chars().find(|c| !c.is_ascii_hexdigit()) {
        return Err(format!("key {given:?} is not hex ({bad:?})"));
    }
    Ok(given)
}

impl Registry {
    pub fn new(
        records: Vec<Enrollment>,
        authorized: Vec<AuthorizedKey>,
        tokens: Vec<String>,
        used: Vec<String>,
        max_pending: usize,
    ) -> Self {
        Self {
            records: records.into_iter().map(|r| (r.device.clone(), r)).collect(),
            authorized: authorized.into_iter().fold(HashMap::new(), |mut map, a| {
                map.entry(a.key).or_insert_with(Vec::new).push(a.device);
                map
            }),
            tokens,
            used: used.into_iter().collect(),
            max_pending: max_pending.max(1),
            attempts: Attempts::new(ATTEMPTS_PER_SECOND, DEVICE_ATTEMPTS_PER_MINUTE),
            deferred: BTreeSet::new(),
        }
    }

    /// The same registry with these enrollment attempt limits (`[enrollment]
    /// attempts_per_second`, `device_attempts_per_minute`).
    pub fn with_limits(mut self, per_second: u32, device_per_minute: u32) -> Registry {
        let counts = self.attempts.counts.clone();
        self.attempts = Attempts::new(per_second, device_per_minute);
        self.attempts.counts = counts;
        self
    }

    /// Enrollment attempts by result, for the metrics endpoint.
    pub fn attempt_counts(&self) -> Arc<AttemptCounts> {
        self.attempts.counts.clone()
    }

    /// How many devices wait for their token proof to be checked.
    pub fn deferred_count(&self) -> usize {
        self.deferred.len()
    }

    /// Checks the token proofs the attempt limits held back, in device id order, while the
    /// limits allow and leave half a second's worth for fresh attempts: the verdicts of those
    /// devices' waiting states, as if they arrived now.
    pub fn retry_deferred(&mut self, now: u64) -> Vec<(String, Verdict)> {
        let mut out = Vec::new();
        let waiting: Vec<String> = self.deferred.iter().cloned().collect();
        for device in waiting {
            if !self.attempts.has_spare(now) {
                break;
            }
            if !self.attempts.device_ready(&device, now) {
                continue;
            }
            self.deferred.remove(&device);
            let Some(blob) = self
                .records
                .get(&device)
                .and_then(|r| r.waiting_state.clone())
            else {
                continue;
            };
            let verdict = self.observe(&device, "device state", &blob, now);
            out.push((device, verdict));
        }
        out
    }

    /// The record of `device`, if it ever sent a signed state.
    pub fn get(&self, device: &str) -> Option<&Enrollment> {
        self.records.get(device)
    }

    /// Whether `device` is accepted.
    pub fn is_accepted(&self, device: &str) -> bool {
        self.records
            .get(device)
            .is_some_and(|r| r.status == Status::Accepted)
    }

    /// Every record, in device order.
    pub fn all(&self) -> impl Iterator<Item = &Enrollment> {
        self.records.values()
    }

    /// The sha256 (hex) of every used-up enrollment token.
    pub fn used_tokens(&self) -> impl Iterator<Item = &String> {
        self.used.iter()
    }

    /// How pre-authorization would accept `key` for `device`: an authorized key, or a token
    /// proof checked within the attempt limits.
    fn preauthorized(
        &mut self,
        device: &str,
        key: &VerifyingKey,
        message: &DeviceMessage,
        now: u64,
    ) -> Auto {
        if self.authorized.get(&key.to_bytes()).is_some_and(|devices| {
            devices
                .iter()
                .any(|d| d.as_deref().is_none_or(|d| d == device))
        }) {
            return Auto::AuthorizedKey;
        }
        let DeviceMessage::State {
            enrollment: Some(proof),
            ..
        } = message
        else {
            return Auto::No;
        };
        if !self.attempts.admit(device, now) {
            self.deferred.insert(device.to_owned());
            return Auto::Limited;
        }
        self.deferred.remove(device);
        let matched = self
            .tokens
            .iter()
            .map(|t| (t, token_digest(t)))
            .filter(|(_, digest)| !self.used.contains(digest))
            .find(|(t, _)| device::enrollment_proof(t, device, key) == *proof)
            .map(|(_, digest)| digest);
        let counts = &self.attempts.counts;
        match matched {
            Some(digest) => {
                counts.accepted.fetch_add(1, Ordering::Relaxed);
                Auto::Token(digest)
            }
            None => {
                counts.failed.fetch_add(1, Ordering::Relaxed);
                Auto::WrongToken
            }
        }
    }

    fn pending_count(&self) -> usize {
        self.records
            .values()
            .filter(|r| r.status == Status::Pending)
            .count()
    }

    /// Decides about one signed message that arrived on `topic_device`'s topic for messages of
    /// kind `expected` ([`DeviceMessage::name`]).
    pub fn observe(
        &mut self,
        topic_device: &str,
        expected: &str,
        blob: &SignedBlob,
        now: u64,
    ) -> Verdict {
        let opened = device::open_self_signed(blob).ok();
        self.observe_checked(topic_device, expected, blob, opened, now)
    }

    /// [`Registry::observe`] with the signature already checked against the key the blob
    /// names (`verify.rs`, on a worker thread): `opened` is that key and the message when it
    /// verified, `None` when it did not.
    pub fn observe_checked(
        &mut self,
        topic_device: &str,
        expected: &str,
        blob: &SignedBlob,
        opened: Option<(VerifyingKey, DeviceMessage)>,
        now: u64,
    ) -> Verdict {
        let Some((key, message)) = opened.filter(|(key, _)| key.as_bytes() == &blob.signer) else {
            return Verdict::ignored(Ignored::BadSignature);
        };
        if message.device_id() != topic_device || message.name() != expected {
            return Verdict::ignored(Ignored::WrongTopic);
        }
        let key_hex = hex::encode(key.as_bytes());
        let is_state = matches!(message, DeviceMessage::State { .. });
        // Pre-authorization is looked at only where it could accept something: a new device,
        // a pending one, or a new key of a known one (a token check is an attempt, limited).
        let could_accept = is_state
            && self.records.get(topic_device).is_none_or(|r| {
                !r.rejected_keys.contains(&key_hex)
                    && (r.key != key_hex || r.status == Status::Pending)
            });
        let auto = if could_accept {
            self.preauthorized(topic_device, &key, &message, now)
        } else {
            Auto::No
        };
        let accept = |record: &mut Enrollment, via: &str| {
            record.key = key_hex.clone();
            record.status = Status::Accepted;
            record.via = Some(via.to_owned());
            record.since = now;
            record.new_key = None;
            record.waiting_state = None;
        };

        let Some(record) = self.records.get_mut(topic_device) else {
            if !is_state {
                return Verdict::ignored(Ignored::Unknown);
            }
            let mut record = Enrollment {
                device: topic_device.to_owned(),
                key: key_hex.clone(),
                status: Status::Pending,
                via: None,
                since: now,
                new_key: None,
                rejected_keys: Vec::new(),
                waiting_state: Some(blob.clone()),
            };
            let mut verdict = Verdict {
                changed: true,
                ..Verdict::default()
            };
            if let Some((via, token)) = auto.accepts() {
                accept(&mut record, via);
                verdict.note = Some(format!(
                    "device {topic_device} enrolled by {} with key {}",
                    via.replace('_', " "),
                    device::fingerprint(&key.to_bytes())
                ));
                verdict.used_token = token;
                verdict.accepted = Some(message);
            } else {
                if self.pending_count() >= self.max_pending {
                    self.deferred.remove(topic_device);
                    return Verdict::ignored(Ignored::TooManyPending);
                }
                let fingerprint = device::fingerprint(&key.to_bytes());
                verdict.note = Some(format!(
                    "device {topic_device} is pending enrollment with key {fingerprint}; compare it with what `flotilla-agent identity` prints on the device and accept it with `flotilla devices accept {topic_device} --key {fingerprint}`"
                ));
                verdict.ignored = Some(auto.ignored(Ignored::Pending));
            }
            self.records.insert(topic_device.to_owned(), record);
            if let Some(t) = &verdict.used_token {
                self.used.insert(t.clone());
            }
            return verdict;
        };

        if record.rejected_keys.contains(&key_hex) {
            return Verdict::ignored(Ignored::Rejected);
        }
        if record.key == key_hex {
            return match record.status {
                Status::Accepted => Verdict {
                    accepted: Some(message),
                    ..Verdict::default()
                },
                Status::Pending if auto.accepts().is_some() => {
                    let (via, token) = auto.accepts().unwrap_or(("operator", None));
                    accept(record, via);
                    if let Some(t) = &token {
                        self.used.insert(t.clone());
                    }
                    Verdict {
                        accepted: Some(message),
                        changed: true,
                        used_token: token,
                        note: Some(format!(
                            "pending device {topic_device} enrolled by {}",
                            via.replace('_', " ")
                        )),
                        ignored: None,
                    }
                }
                Status::Pending => {
                    // Kept in memory only: the retained state comes back after a restart, and a
                    // flood of states must not become a flood of store flushes.
                    if is_state {
                        record.waiting_state = Some(blob.clone());
                    }
                    Verdict::ignored(auto.ignored(Ignored::Pending))
                }
                Status::Rejected => Verdict::ignored(Ignored::Rejected),
                Status::Revoked => Verdict::ignored(Ignored::Revoked),
            };
        }

        // A key that is not the one this record is about.
        if !is_state {
            return Verdict::ignored(Ignored::OtherKey);
        }
        if let Some((via, token)) = auto.accepts() {
            // An operator pre-authorized exactly this key (or handed out the token): not silent.
            let old = record.key.clone();
            accept(record, via);
            if let Some(t) = &token {
                self.used.insert(t.clone());
            }
            return Verdict {
                accepted: Some(message),
                changed: true,
                used_token: token,
                note: Some(format!(
                    "device {topic_device} changed key from {} to {}, enrolled by {}",
                    old.get(..16).unwrap_or(&old),
                    device::fingerprint(&key.to_bytes()),
                    via.replace('_', " ")
                )),
                ignored: None,
            };
        }
        // The latest claimant waits (the operator pins the key to accept with --key). Only the
        // first new key is stored and logged: keys that keep changing stay in memory, so
        // alternating made-up keys cannot turn into store flushes and log lines.
        let mut verdict = Verdict::ignored(auto.ignored(Ignored::OtherKey));
        record.waiting_state = Some(blob.clone());
        if record.status == Status::Pending {
            record.key = key_hex;
            record.since = now;
        } else {
            if record.new_key.is_none() {
                verdict.note = Some(format!(
                    "device {topic_device} ({}) shows a new key {}; it stays {} with its old key until an operator accepts or rejects the new one",
                    record.status.name(),
                    device::fingerprint(&key.to_bytes()),
                    record.status.name()
                ));
                verdict.changed = true;
            }
            record.new_key = Some(key_hex);
        }
        verdict
    }

    /// The operator accepts `device`'s waiting key (its new key, or its pending, rejected or
    /// revoked one). `key` is the key the operator compared with the device's own (full hex or
    /// its first 16 hex digits): required, and refused when the waiting key is another one, so
    /// a key that some broker client showed after the operator looked is never accepted.
    /// Returns the waiting state, verified, for the engine.
    pub fn accept(
        &mut self,
        device: &str,
        key: Option<&str>,
        now: u64,
    ) -> Result<Option<DeviceState>, String> {
        self.deferred.remove(device);
        let record = self
            .records
            .get_mut(device)
            .ok_or_else(|| format!("no device {device:?} has asked to enroll"))?;
        let candidate = match (&record.new_key, record.status) {
            (Some(new), _) => new.clone(),
            (None, Status::Accepted) => {
                return Err(format!(
                    "device {device} is already accepted and no new key waits"
                ))
            }
            (None, _) => record.key.clone(),
        };
        let Some(given) = key else {
            return Err(format!(
                "accepting device {device} needs the key you compared with the one the device \
                 prints (`flotilla-agent identity`): add \"key\" to the request, the full hex or \
                 its first {MIN_KEY_PREFIX} hex digits (`flotilla devices accept {device} --key \
                 KEY`); the key waiting now is {candidate}; nothing was accepted"
            ));
        };
        let given = given_key(given)?;
        if !candidate.starts_with(&given) {
            return Err(format!(
                "device {device}'s waiting key is now {candidate}, not the {given} you gave: it \
                 changed since you listed it, or you compared another key; nothing was \
                 accepted. Compare again with `flotilla-agent identity` on the device and \
                 `flotilla devices pending`; if {given} is the device's key, reject the other \
                 (`flotilla devices reject {device} --key {}`) and accept {given} once the \
                 device shows it again",
                candidate.get(..MIN_KEY_PREFIX).unwrap_or(&candidate)
            ));
        }
        let state = record.waiting_state.take().and_then(|blob| {
            let key = VerifyingKey::from_bytes(&blob.signer).ok()?;
            (hex::encode(key.as_bytes()) == candidate)
                .then(|| device::open(&blob, &key).ok())
                .flatten()
        });
        record.rejected_keys.retain(|k| k != &candidate);
        record.key = candidate;
        record.status = Status::Accepted;
        record.via = Some("operator".into());
        record.since = now;
        record.new_key = None;
        Ok(match state {
            Some(DeviceMessage::State { state, .. }) if state.device_id == device => Some(state),
            _ => None,
        })
    }

    /// The operator rejects `device`'s new key (the device stays accepted with its old key) or,
    /// when it has none, the pending device.
    pub fn reject(&mut self, device: &str, key: Option<&str>, now: u64) -> Result<(), String> {
        self.deferred.remove(device);
        let record = self
            .records
            .get_mut(device)
            .ok_or_else(|| format!("no device {device:?} has asked to enroll"))?;
        let candidate = match (&record.new_key, record.status) {
            (Some(new), _) => new.clone(),
            (None, Status::Pending) => record.key.clone(),
            (None, Status::Accepted) => {
                return Err(format!(
                    "device {device} is accepted and no new key waits; use `flotilla devices revoke {device}`"
                ))
            }
            (None, status) => return Err(format!("device {device} is already {}", status.name())),
        };
        if let Some(given) = key {
            let given = given_key(given)?;
            if !candidate.starts_with(&given) {
                return Err(format!(
                    "device {device}'s waiting key is {candidate}, not the {given} you gave; \
                     nothing was rejected"
                ));
            }
        }
        if record.new_key.take().is_none() {
            record.status = Status::Rejected;
            record.via = None;
            record.since = now;
        }
        record.waiting_state = None;
        if !record.rejected_keys.contains(&candidate) {
            record.rejected_keys.push(candidate);
        }
        Ok(())
    }

    /// The operator revokes an accepted device.
    pub fn revoke(&mut self, device: &str, now: u64) -> Result<(), String> {
        self.deferred.remove(device);
        let record = self
            .records
            .get_mut(device)
            .ok_or_else(|| format!("no device {device:?} has asked to enroll"))?;
        if record.status != Status::Accepted {
            return Err(format!(
                "device {device} is {}, not accepted; use `flotilla devices reject {device}`",
                record.status.name()
            ));
        }
        record.status = Status::Revoked;
        record.via = None;
        record.since = now;
        Ok(())
    }

    /// The operator's view of one record.
    pub fn info(&self, device: &str) -> Option<EnrollmentInfo> {
        let r = self.records.get(device)?;
        let claimed = r
            .waiting_state
            .as_ref()
            .and_then(|b| device::open_self_signed(b).ok())
            .and_then(|(_, m)| match m {
                DeviceMessage::State { state, .. } => Some(state),
                _ => None,
            });
        Some(EnrollmentInfo {
            device: r.device.clone(),
            status: r.status.name().to_owned(),
            key: r.key.clone(),
            via: r.via.clone(),
            since: r.since,
            new_key: r.new_key.clone(),
            hardware_id: claimed.as_ref().map(|s| s.hardware_id.clone()),
            labels: claimed
                .map(|s| s.labels.into_iter().collect())
                .unwrap_or_default(),
        })
    }

    /// Devices waiting for an operator: pending ones and known ones with a new key.
    pub fn pending(&self) -> Vec<EnrollmentInfo> {
        self.records
            .values()
            .filter(|r| r.status == Status::Pending || r.new_key.is_some())
            .filter_map(|r| self.info(&r.device))
            .collect()
    }

    /// Every record after the device id `after`, in device order, read lazily.
    pub fn all_after<'a>(&'a self, after: Option<&str>) -> impl Iterator<Item = &'a Enrollment> {
        let start = match after {
            Some(a) => std::ops::Bound::Excluded(a.to_owned()),
            None => std::ops::Bound::Unbounded,
        };
        self.records
            .range((start, std::ops::Bound::Unbounded))
            .map(|(_, r)| r)
    }

    /// [`Registry::pending`] after the device id `after`, read lazily (a page of them).
    pub fn pending_after<'a>(
        &'a self,
        after: Option<&str>,
    ) -> impl Iterator<Item = EnrollmentInfo> + 'a {
        let start = match after {
            Some(a) => std::ops::Bound::Excluded(a.to_owned()),
            None => std::ops::Bound::Unbounded,
        };
        self.records
            .range((start, std::ops::Bound::Unbounded))
            .map(|(_, r)| r)
            .filter(|r| r.status == Status::Pending || r.new_key.is_some())
            .filter_map(|r| self.info(&r.device))
    }

    /// The short status shown in `flotilla devices`.
    pub fn status_text(&self, device: &str) -> Option<String> {
        let r = self.records.get(device)?;
        Some(match (r.status, &r.new_key) {
            (status, Some(_)) => format!("{}, new key pending", status.name()),
            (status, None) => status.name().to_owned(),
        })
    }
}

/// Counts ignored device messages and logs them at most once per interval.
#[derive(Debug)]
pub struct IgnoredLog {
    interval: Duration,
    /// Since the coordinator started.
    pub total: BTreeMap<Ignored, u64>,
    /// Since the last log line.
    recent: BTreeMap<Ignored, u64>,
    last_log: Option<Instant>,
    example: Option<String>,
}

impl IgnoredLog {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            total: BTreeMap::new(),
            recent: BTreeMap::new(),
            last_log: None,
            example: None,
        }
    }

    /// Counts one ignored message; returns the log line to write now, if one is due.
    pub fn count(&mut self, why: Ignored, topic: &str, at: Instant) -> Option<String> {
        *self.total.entry(why).or_default() += 1;
        *self.recent.entry(why).or_default() += 1;
        self.example = Some(format!("{} on {topic}", why.name()));
        let due = self
            .last_log
            .is_none_or(|last| at.duration_since(last) >= self.interval);
        if !due {
            return None;
        }
        // Rates over the time since the last line; the first line has no span to speak of.
        let span = self
            .last_log
            .map(|last| at.duration_since(last).as_secs_f64());
        self.last_log = Some(at);
        let recent = std::mem::take(&mut self.recent);
        let counts: Vec<String> = recent
            .iter()
            .map(|(why, n)| match span {
                Some(secs) => format!("{n} {} ({:.1}/s)", why.name(), *n as f64 / secs),
                None => format!("{n} {}", why.name()),
            })
            .collect();
        let since = match span {
            Some(secs) => format!("in the last {secs:.0} s"),
            None => "since the start".to_owned(),
        };
        let failed: u64 = [Ignored::WrongToken, Ignored::AttemptLimited]
            .iter()
            .filter_map(|why| recent.get(why))
            .sum();
        let guessing = match span {
            Some(secs) if failed > 0 => format!(
                "; failed enrollment attempts at {:.1}/s: someone may be guessing enrollment \
                 tokens (docs/security.md, \"Device identity and enrollment\")",
                failed as f64 / secs
            ),
            None if failed > 0 => format!(
                "; {failed} failed enrollment attempts: someone may be guessing enrollment tokens \
                 (docs/security.md, \"Device identity and enrollment\")"
            ),
            _ => String::new(),
        };
        Some(format!(
            "ignored device messages {since}: {} (latest: {}){guessing}",
            counts.join(", "),
            self.example.take().unwrap_or_default()
        ))
    }

    /// All ignored messages so far.
    pub fn total(&self) -> u64 {
        self.total.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_protocol::{Phase, Report, SigningKey};

    fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    fn state(id: &str, key: &SigningKey, token: Option<&str>) -> SignedBlob {
        let state = DeviceState {
            device_id: id.into(),
            hardware_id: "pi4".into(),
            labels: vec![("env".into(), "prod".into())],
            installed: None,
            current: None,
            online: true,
            agent_version: "t".into(),
            at: 1,
        };
        let enrollment = token.map(|t| device::enrollment_proof(t, id, &key.verifying_key()));
        device::sign(key, &DeviceMessage::State { state, enrollment })
    }

    fn report(id: &str, key: &SigningKey) -> SignedBlob {
        device::sign(
            key,
            &DeviceMessage::Report(Report {
                device_id: id.into(),
                seq: 1,
                action_id: "a".into(),
                rollout_id: "r".into(),
                phase: Phase::Ready,
                at: 1,
            }),
        )
    }

    fn hex_key(seed: u8) -> String {
        hex::encode(key(seed).verifying_key().as_bytes())
    }

    fn registry() -> Registry {
        Registry::new(Vec::new(), Vec::new(), Vec::new(), Vec::new(), 10)
    }

    #[test]
    fn a_new_device_is_pending_until_accepted() {
        let mut reg = registry();
        let v = reg.observe("dev-1", "device state", &state("dev-1", &key(1), None), 5);
        assert_eq!(v.ignored, Some(Ignored::Pending));
        assert!(v.changed && v.accepted.is_none());
        assert_eq!(
            reg.observe("dev-1", "report", &report("dev-1", &key(1)), 6)
                .ignored,
            Some(Ignored::Pending)
        );
        assert_eq!(reg.pending().len(), 1);
        let state = reg.accept("dev-1", Some(&hex_key(1)), 7).expect("accepted");
        assert_eq!(
            state.map(|s| s.labels),
            Some(vec![("env".into(), "prod".into())])
        );
        assert!(reg.pending().is_empty());
        let v = reg.observe("dev-1", "report", &report("dev-1", &key(1)), 8);
        assert!(v.accepted.is_some(), "{v:?}");
    }

    #[test]
    fn other_keys_and_topics_are_ignored() {
        let mut reg = registry();
        reg.observe("dev-1", "device state", &state("dev-1", &key(1), None), 5);
        reg.accept("dev-1", Some(&hex_key(1)), 6).expect("accepted");
        assert_eq!(
            reg.observe("dev-1", "report", &report("dev-1", &key(2)), 7)
                .ignored,
            Some(Ignored::OtherKey)
        );
        assert_eq!(
            reg.observe("dev-2", "report", &report("dev-1", &key(1)), 7)
                .ignored,
            Some(Ignored::WrongTopic)
        );
        assert_eq!(
            reg.observe("dev-3", "report", &report("dev-3", &key(1)), 7)
                .ignored,
            Some(Ignored::Unknown)
        );
        let mut moved = report("dev-1", &key(1));
        moved.signer = key(2).verifying_key().to_bytes();
        assert_eq!(
            reg.observe("dev-1", "report", &moved, 7).ignored,
            Some(Ignored::BadSignature)
        );
        // A state with a new key does not unseat the accepted key; it waits.
        let v = reg.observe("dev-1", "device state", &state("dev-1", &key(2), None), 8);
        assert_eq!(v.ignored, Some(Ignored::OtherKey));
        assert!(reg.is_accepted("dev-1"));
        assert_eq!(
            reg.status_text("dev-1").as_deref(),
            Some("accepted, new key pending")
        );
        assert!(reg
            .observe("dev-1", "report", &report("dev-1", &key(1)), 9)
            .accepted
            .is_some());
        // Pinning the wrong key fails; rejecting the new one keeps it out for good.
        let k2 = hex::encode(key(2).verifying_key().as_bytes());
        let k3 = hex::encode(key(3).verifying_key().as_bytes());
        assert!(reg.accept("dev-1", Some(&k3), 10).is_err());
        reg.reject("dev-1", Some(&k2[..16]), 10).expect("rejected");
        assert_eq!(
            reg.observe("dev-1", "device state", &state("dev-1", &key(2), None), 11)
                .ignored,
            Some(Ignored::Rejected)
        );
        assert_eq!(reg.status_text("dev-1").as_deref(), Some("accepted"));
    }

    #[test]
    fn accept_needs_the_key_the_operator_saw_and_refuses_one_that_changed() {
        let mut reg = registry();
        reg.observe("dev-1", "device state", &state("dev-1", &key(1), None), 5);
        // The operator lists the device and sees key 1; then another client signs a state for
        // the same device with key 2, which is now the one waiting.
        let seen = hex_key(1);
        reg.observe("dev-1", "device state", &state("dev-1", &key(2), None), 6);

        let err = reg.accept("dev-1", None, 7).expect_err("no key given");
        assert!(
            err.contains("add \"key\"") && err.contains("--key") && err.contains(&hex_key(2)),
            "{err}"
        );
        let err = reg
            .accept("dev-1", Some(&seen[..16]), 7)
            .expect_err("the key changed since it was listed");
        assert!(
            err.contains(&hex_key(2)) && err.contains(&seen[..16]) && err.contains("changed"),
            "{err}"
        );
        assert_eq!(reg.get("dev-1").map(|r| r.status), Some(Status::Pending));
        for bad in ["1a2b", "zz2b3c4d5e6f7a8b9c"] {
            let err = reg.accept("dev-1", Some(bad), 7).expect_err("not a key");
            assert!(err.contains(bad), "{err}");
        }
        assert!(!reg.is_accepted("dev-1"));

        // Rejecting the stranger's key and waiting for the device's own state again works.
        reg.reject("dev-1", Some(&hex_key(2)[..16]), 8)
            .expect("rejected");
        reg.observe("dev-1", "device state", &state("dev-1", &key(1), None), 9);
        reg.accept("dev-1", Some(&seen.to_uppercase()), 10)
            .expect("the key the operator saw");
        assert!(reg
            .observe("dev-1", "report", &report("dev-1", &key(1)), 11)
            .accepted
            .is_some());
        assert_eq!(
            reg.observe("dev-1", "report", &report("dev-1", &key(2)), 11)
                .ignored,
            Some(Ignored::Rejected)
        );
    }

    #[test]
    fn accepting_a_new_key_replaces_the_old_one() {
        let mut reg = registry();
        reg.observe("dev-1", "device state", &state("dev-1", &key(1), None), 5);
        reg.accept("dev-1", Some(&hex_key(1)), 6).expect("accepted");
        reg.observe("dev-1", "device state", &state("dev-1", &key(2), None), 7);
        let k2 = hex::encode(key(2).verifying_key().as_bytes());
        assert!(reg
            .accept("dev-1", Some(&k2), 8)
            .expect("accepted")
            .is_some());
        assert!(reg
            .observe("dev-1", "report", &report("dev-1", &key(2)), 9)
            .accepted
            .is_some());
        assert_eq!(
            reg.observe("dev-1", "report", &report("dev-1", &key(1)), 9)
                .ignored,
            Some(Ignored::OtherKey)
        );
    }

    #[test]
    fn tokens_and_authorized_keys_accept_without_an_operator() {
        let authorized = vec![AuthorizedKey {
            key: key(3).verifying_key().to_bytes(),
            device: Some("dev-3".into()),
        }];
        let mut reg = Registry::new(
            Vec::new(),
            authorized,
            vec!["token-123456".into()],
            Vec::new(),
            10,
        );
        let v = reg.observe(
            "dev-1",
            "device state",
            &state("dev-1", &key(1), Some("token-123456")),
            5,
        );
        assert!(v.accepted.is_some());
        assert_eq!(v.used_token, Some(token_digest("token-123456")));
        // The token is used up: another device (or key) showing it is pending.
        let v = reg.observe(
            "dev-2",
            "device state",
            &state("dev-2", &key(2), Some("token-123456")),
            6,
        );
        assert_eq!(v.ignored, Some(Ignored::WrongToken));
        assert_eq!(reg.get("dev-2").map(|r| r.status), Some(Status::Pending));
        // A wrong token is no token.
        let v = reg.observe(
            "dev-4",
            "device state",
            &state("dev-4", &key(4), Some("guessed-token")),
            6,
        );
        assert_eq!(v.ignored, Some(Ignored::WrongToken));
        // An authorized key, bound to its device.
        assert!(reg
            .observe("dev-3", "device state", &state("dev-3", &key(3), None), 7)
            .accepted
            .is_some());
        assert_eq!(
            reg.observe("dev-5", "device state", &state("dev-5", &key(3), None), 7)
                .ignored,
            Some(Ignored::Pending)
        );
        assert_eq!(
            reg.get("dev-1").and_then(|r| r.via.clone()).as_deref(),
            Some("token")
        );
    }

    #[test]
    fn reject_and_revoke_stop_a_device() {
        let mut reg = registry();
        reg.observe("dev-1", "device state", &state("dev-1", &key(1), None), 5);
        reg.reject("dev-1", None, 6).expect("rejected");
        assert_eq!(
            reg.observe("dev-1", "device state", &state("dev-1", &key(1), None), 7)
                .ignored,
            Some(Ignored::Rejected)
        );
        reg.observe("dev-2", "device state", &state("dev-2", &key(2), None), 5);
        assert!(
            reg.revoke("dev-2", 6).is_err(),
            "only accepted devices are revoked"
        );
        reg.accept("dev-2", Some(&hex_key(2)), 6).expect("accepted");
        reg.revoke("dev-2", 7).expect("revoked");
        assert_eq!(
            reg.observe("dev-2", "report", &report("dev-2", &key(2)), 8)
                .ignored,
            Some(Ignored::Revoked)
        );
    }

    #[test]
    fn pending_devices_are_capped() {
        let mut reg = Registry::new(Vec::new(), Vec::new(), Vec::new(), Vec::new(), 2);
        for i in 0..2 {
            let id = format!("dev-{i}");
            assert_eq!(
                reg.observe(&id, "device state", &state(&id, &key(1), None), 1)
                    .ignored,
                Some(Ignored::Pending)
            );
        }
        assert_eq!(
            reg.observe("dev-9", "device state", &state("dev-9", &key(1), None), 1)
                .ignored,
            Some(Ignored::TooManyPending)
        );
        assert!(reg.get("dev-9").is_none());
    }

    #[test]
    fn authorized_keys_file_parses_and_names_bad_lines() {
        let k = hex::encode(key(1).verifying_key().as_bytes());
        let text = format!("# fleet\n{k} dev-1\n\n{k}   # any device\n");
        let keys = parse_authorized_keys(&text).expect("parses");
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0].device.as_deref(), Some("dev-1"));
        assert_eq!(keys[1].device, None);
        let err = parse_authorized_keys("nothex\n").expect_err("bad");
        assert!(err.contains("line 1"), "{err}");
        let err = parse_authorized_keys(&format!("{k} dev-1 extra\n")).expect_err("bad");
        assert!(err.contains("extra"), "{err}");
    }

    /// The attack of issue 19: guesses of a token as fast as the broker delivers them. Only
    /// three a minute are checked for one device id and two hundred at once (then twenty a
    /// second) for all of them; the rest wait or are counted. A real device caught in the flood
    /// is not lost: it waits as pending and enrolls once there is room.
    #[test]
    fn token_guesses_are_limited_per_device_and_in_all() {
        let token = "3f9c2a7e1b5d48c06a9e7f21d4c3b8a5";
        let mut reg = Registry::new(Vec::new(), Vec::new(), vec![token.into()], Vec::new(), 5000);
        let now = 1_000;
        let guess = |i: u32| format!("{i:032x}");
        for i in 0..100 {
            let v = reg.observe(
                "dev-x",
                "device state",
                &state("dev-x", &key(9), Some(&guess(i))),
                now,
            );
            assert!(v.accepted.is_none());
        }
        let counts = reg.attempt_counts();
        assert_eq!(
            counts.get(),
            [("accepted", 0), ("failed", 3), ("limited", 97)]
        );
        for i in 0..300 {
            let id = format!("ghost-{i}");
            reg.observe(
                &id,
                "device state",
                &state(&id, &key(9), Some(&guess(i))),
                now,
            );
        }
        assert_eq!(
            counts.get(),
            [("accepted", 0), ("failed", 200), ("limited", 200)]
        );
        // The real device, in the same second: held back, pending, its state kept.
        let v = reg.observe(
            "dev-real",
            "device state",
            &state("dev-real", &key(1), Some(token)),
            now,
        );
        assert_eq!(v.ignored, Some(Ignored::AttemptLimited));
        assert_eq!(reg.get("dev-real").map(|r| r.status), Some(Status::Pending));
        // A second later there is room for twenty, half of it for held-back attempts, taken in
        // id order: dev-real enrolls (dev-x waits for its own limit, the ghosts for what is
        // left). Fresh attempts still find the other half.
        let mut enrolled = None;
        for t in 1..=20 {
            for (device, v) in reg.retry_deferred(now + t) {
                if v.accepted.is_some() {
                    enrolled = Some((device, v.used_token, t));
                }
            }
            if enrolled.is_some() {
                break;
            }
        }
        let (device, used, _) = enrolled.expect("the real device enrolls once there is room");
        assert_eq!(device, "dev-real");
        assert_eq!(used, Some(token_digest(token)));
        assert!(reg.is_accepted("dev-real"));
        assert_eq!(counts.get()[0], ("accepted", 1));
        let now = now + 30;
        reg.retry_deferred(now);
        let fresh = reg.observe(
            "dev-new",
            "device state",
            &state("dev-new", &key(7), Some(token)),
            now,
        );
        assert_eq!(
            fresh.ignored,
            Some(Ignored::WrongToken),
            "checked at once (the token is used up)"
        );
    }

    #[test]
    fn failed_enrollment_attempts_are_logged_with_their_rate() {
        let mut log = IgnoredLog::new(Duration::from_secs(10));
        let t0 = Instant::now();
        let first = log
            .count(Ignored::WrongToken, "t", t0)
            .expect("the first one");
        assert!(
            first.contains("someone may be guessing enrollment tokens"),
            "{first}"
        );
        for i in 0..400 {
            log.count(
                Ignored::AttemptLimited,
                "t",
                t0 + Duration::from_millis(i * 10),
            );
        }
        for i in 0..99 {
            log.count(Ignored::WrongToken, "t", t0 + Duration::from_millis(i * 10));
        }
        let line = log
            .count(Ignored::WrongToken, "t", t0 + Duration::from_secs(10))
            .expect("due");
        assert!(
            line.starts_with("ignored device messages in the last 10 s:")
                && line.contains("100 wrong enrollment token (10.0/s)")
                && line.contains("400 enrollment attempt over the limit (40.0/s)")
                && line.contains("failed enrollment attempts at 50.0/s"),
            "{line}"
        );
    }

    #[test]
    fn ignored_messages_are_logged_at_most_once_per_interval() {
        let mut log = IgnoredLog::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert!(
            log.count(Ignored::Unsigned, "t", t0).is_some(),
            "the first one is logged"
        );
        for i in 0..1000 {
            assert!(log
                .count(Ignored::OtherKey, "t", t0 + Duration::from_millis(i))
                .is_none());
        }
        let line = log
            .count(Ignored::Unsigned, "x", t0 + Duration::from_secs(11))
            .expect("due");
        assert!(
            line.contains("1000 signed by another key") && line.contains("1 unsigned"),
            "{line}"
        );
        assert_eq!(log.total(), 1002);
    }
}
