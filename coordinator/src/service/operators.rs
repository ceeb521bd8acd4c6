//! Who sent a control request, and may they: the checks between the control topic and
//! `dispatch` (docs/security.md, "Operator commands").
//!
//! [`Gate::check`] takes the raw MQTT payload and the coordinator's clock and either returns the
//! operator and the parsed request, or a [`Refusal`] that says why, with the request's `id` and
//! a valid `reply_to` whenever the payload gave them, so the client gets an error reply instead
//! of silence. In order: the payload is a signed request (`{"request", "key", "signature"}`);
//! the request text parses and its `reply_to` is a plain reply topic under the root; the key
//! belongs to a configured operator; the signature verifies over the exact request bytes;
//! `at` lies within the clock window; the (key, nonce) pair was not seen in the window; the
//! operator's role covers the command. Pure apart from its nonce cache: `now` is an argument.

use std::collections::{BTreeSet, HashSet};

use flotilla_protocol::control::ControlRequest;
use flotilla_protocol::operator::{check_reply_to, Role, SignedRequest};
use flotilla_protocol::{Digest, Topics};

use crate::service::config::OperatorConfig;

/// At most this many nonces are remembered. When full, the oldest is forgotten and nothing at
/// or before its time is accepted any more, so the cache stays bounded without ever letting a
/// forgotten request through again.
pub const NONCE_CAPACITY: usize = 100_000;

/// A request that passed every check.
#[derive(Debug)]
pub struct Authorized {
    /// The operator's configured name.
    pub operator: String,
    pub role: Role,
    pub request: ControlRequest,
}

/// A request that was refused, and why.
#[derive(Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The request's `id`, when it could be read.
    pub id: Option<String>,
    /// Where to send the error reply: only a `reply_to` that passed [`check_reply_to`].
    pub reply_to: Option<String>,
    /// Starts with the kind of refusal: "unsigned request", "malformed request", "unknown key",
    /// "wrong signature", "clock skew", "replayed request", "not allowed", "invalid reply_to".
    pub reason: String,
}

/// The operator keys and the replay cache.
#[derive(Debug)]
pub struct Gate {
    operators: Vec<OperatorConfig>,
    window: u64,
    topics: Topics,
    /// (at, digest of key and nonce), ordered by time for eviction.
    by_time: BTreeSet<(u64, Digest)>,
    seen: HashSet<Digest>,
    /// Requests at or before this time are refused: their nonces may have been evicted.
    floor: Option<u64>,
    /// When this gate was made (the service started). The nonce cache lives in memory, so a
    /// request made before then may have been accepted by the previous run: refused.
    started: u64,
}

impl Gate {
    /// A gate for a service started at `started` (Unix seconds).
    pub fn new(operators: Vec<OperatorConfig>, window: u64, topics: Topics, started: u64) -> Gate {
        Gate {
            operators,
            window,
            topics,
            by_time: BTreeSet::new(),
            seen: HashSet::new(),
            floor: None,
            started,
        }
    }

    /// How many operators are configured.
    pub fn operator_count(&self) -> usize {
        self.operators.len()
    }

    /// Runs every check on a control request payload received at `now` (Unix seconds).
    pub fn check(&mut self, payload: &[u8], now: u64) -> Result<Authorized, Refusal> {
        let signed: SignedRequest = match serde_json::from_slice(payload) {
            Ok(s) => s,
            Err(e) => return Err(self.unsigned(payload, &e.to_string())),
        };
        let mut refusal = Refusal {
            id: None,
            reply_to: None,
            reason: String::new(),
        };
        let request: ControlRequest = match serde_json::from_str(&signed.request) {
            Ok(r) => r,
            Err(e) => {
                self.salvage(signed.request.as_bytes(), &mut refusal);
                refusal.reason =
                    format!("malformed request: request is not a control request: {e}");
                return Err(refusal);
            }
        };
        refusal.id = Some(request.id.clone());
        if let Err(e) = check_reply_to(&self.topics, &request.reply_to) {
            refusal.reason = format!("invalid reply_to: {e}");
            return Err(refusal);
        }
        refusal.reply_to = Some(request.reply_to.clone());
        let refuse = |mut refusal: Refusal, reason: String| {
            refusal.reason = reason;
            Err(refusal)
        };
        let key = match signed.public_key() {
            Ok(k) => k,
            Err(e) => return refuse(refusal, format!("malformed request: {e}")),
        };
        let Some(operator) = self.operators.iter().find(|o| o.key == key).cloned() else {
            return refuse(
                refusal,
                format!(
                    "unknown key {}: no operator of this coordinator has it",
                    signed.key.trim().to_ascii_lowercase()
                ),
            );
        };
        if let Err(e) = signed.verify_with(&key) {
            return refuse(refusal, e.to_string());
        }
        // Signed by a known operator from here on.
        if request.at == 0 || request.nonce.is_empty() {
            return refuse(
                refusal,
                "malformed request: a signed request needs \"at\" (Unix seconds) and a \"nonce\""
                    .into(),
            );
        }
        if request.nonce.len() > 128 {
            return refuse(
                refusal,
                format!(
                    "malformed request: nonce is {} bytes, at most 128",
                    request.nonce.len()
                ),
            );
        }
        if request.at.abs_diff(now) > self.window {
            return refuse(
                refusal,
                format!(
                    "clock skew: request made at {} but the coordinator's clock says {now} ({}s apart, the window is {}s)",
                    request.at,
                    request.at.abs_diff(now),
                    self.window
                ),
            );
        }
        let digest = nonce_digest(&key, &request.nonce);
        if self.seen.contains(&digest) {
            return refuse(
                refusal,
                format!(
                    "replayed request: nonce {:?} of operator {} was already used",
                    request.nonce, operator.name
                ),
            );
        }
        if request.at < self.started {
            return refuse(
                refusal,
                format!(
                    "replayed request: made at {}, before the coordinator started at {}; make a new request",
                    request.at, self.started
                ),
            );
        }
        if self.floor.is_some_and(|floor| request.at <= floor) {
            return refuse(
                refusal,
                format!(
                    "replayed request: too many requests in the clock window; make a new request (at {} is too old)",
                    request.at
                ),
            );
        }
        let needed = request.command.required_role();
        if operator.role < needed {
            return refuse(
                refusal,
                format!(
                    "not allowed: operator {} has role {}, {} needs {needed}",
                    operator.name,
                    operator.role,
                    request.command.name()
                ),
            );
        }
        self.remember(digest, request.at, now);
        Ok(Authorized {
            operator: operator.name.clone(),
            role: operator.role,
            request,
        })
    }

    /// Records a used nonce and forgets the ones whose requests the window refuses anyway.
    fn remember(&mut self, digest: Digest, at: u64, now: u64) {
        let oldest_valid = now.saturating_sub(self.window);
        while let Some(&(t, d)) = self.by_time.first() {
            if t >= oldest_valid && self.by_time.len() < NONCE_CAPACITY {
                break;
            }
            self.by_time.pop_first();
            self.seen.remove(&d);
            if t >= oldest_valid {
                self.floor = Some(self.floor.map_or(t, |f| f.max(t)));
            }
        }
        self.by_time.insert((at, digest));
        self.seen.insert(digest);
    }

    /// A payload that is not a signed request: say so, and answer if it names a valid reply_to.
    fn unsigned(&self, payload: &[u8], parse_error: &str) -> Refusal {
        let mut refusal = Refusal {
            id: None,
            reply_to: None,
            reason: String::new(),
        };
        let value = self.salvage(payload, &mut refusal);
        refusal.reason = match value {
            Some(v) if v.get("command").is_some() => {
                "unsigned request: control requests must be signed by an operator key \
                 ({\"request\", \"key\", \"signature\"}, docs/protocol.md)"
                    .to_owned()
            }
            Some(_) => format!(
                "malformed request: expected {{\"request\", \"key\", \"signature\"}}: {parse_error}"
            ),
            None => format!("malformed request: not JSON: {parse_error}"),
        };
        refusal
    }

    /// Reads `id` and a valid `reply_to` out of JSON that failed a stricter parse: a request,
    /// or a wrapper whose `request` string is one.
    fn salvage(&self, bytes: &[u8], refusal: &mut Refusal) -> Option<serde_json::Value> {
        let value: serde_json::Value = serde_json::from_slice(bytes).ok()?;
        if let Some(inner) = value.get("request").and_then(|r| r.as_str()) {
            self.salvage(inner.as_bytes(), refusal);
            return Some(value);
        }
        refusal.id = value.get("id").and_then(|v| v.as_str()).map(str::to_owned);
        refusal.reply_to = value
            .get("reply_to")
            .and_then(|v| v.as_str())
            .filter(|r| check_reply_to(&self.topics, r).is_ok())
            .map(str::to_owned);
        Some(value)
    }
}

fn nonce_digest(key: &flotilla_protocol::VerifyingKey, nonce: &str) -> Digest {
    let mut bytes = key.as_bytes().to_vec();
    bytes.extend_from_slice(nonce.as_bytes());
    flotilla_protocol::sha256(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_protocol::control::Command;
    use flotilla_protocol::SigningKey;

    const NOW: u64 = 1_700_000_000;
    const REPLY: &str = "flotilla/v1/control/reply/me";

    fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    fn gate() -> Gate {
        let ops = [("alice", Role::Admin, 1), ("vic", Role::Viewer, 2)]
            .into_iter()
            .map(|(name, role, seed)| OperatorConfig {
                name: name.into(),
                role,
                key: key(seed).verifying_key(),
            })
            .collect();
        Gate::new(ops, 60, Topics::default(), NOW - 3600)
    }

    fn signed(seed: u8, at: u64, nonce: &str, command: Command) -> Vec<u8> {
        let request = ControlRequest::new("r1", REPLY, at, nonce, command);
        serde_json::to_vec(&SignedRequest::sign(&key(seed), &request)).expect("json")
    }

    fn start() -> Command {
        Command::StartRollout {
            rollout: "fw".into(),
        }
    }

    fn refused(gate: &mut Gate, payload: &[u8]) -> Refusal {
        gate.check(payload, NOW).expect_err("refused")
    }

    #[test]
    fn a_signed_request_of_a_known_operator_passes_once() {
        let mut g = gate();
        let payload = signed(1, NOW - 5, "n1", start());
        let ok = g.check(&payload, NOW).expect("authorized");
        assert_eq!(ok.operator, "alice");
        assert_eq!(ok.request.command, start());
        let again = refused(&mut g, &payload);
        assert!(
            again.reason.starts_with("replayed request"),
            "{}",
            again.reason
        );
        assert_eq!(again.reply_to.as_deref(), Some(REPLY));
        assert_eq!(again.id.as_deref(), Some("r1"));
    }

    #[test]
    fn every_refusal_names_why_and_where_to_answer() {
        let mut g = gate();
        let unsigned =
            serde_json::to_vec(&ControlRequest::new("u", REPLY, NOW, "n", start())).expect("json");
        let r = refused(&mut g, &unsigned);
        assert!(r.reason.starts_with("unsigned request"), "{}", r.reason);
        assert_eq!(
            (r.id.as_deref(), r.reply_to.as_deref()),
            (Some("u"), Some(REPLY))
        );

        let r = refused(&mut g, &signed(9, NOW, "n", start()));
        assert!(r.reason.starts_with("unknown key"), "{}", r.reason);

        let mut forged: SignedRequest =
            serde_json::from_slice(&signed(1, NOW, "n2", start())).expect("json");
        forged.request = forged.request.replace("\"fw\"", "\"fw-other\"");
        let r = refused(&mut g, &serde_json::to_vec(&forged).expect("json"));
        assert!(r.reason.starts_with("wrong signature"), "{}", r.reason);
        assert_eq!(r.reply_to.as_deref(), Some(REPLY));

        let r = refused(&mut g, &signed(1, NOW - 61, "n3", start()));
        assert!(r.reason.starts_with("clock skew"), "{}", r.reason);
        assert!(r.reason.contains(&(NOW - 61).to_string()) && r.reason.contains(&NOW.to_string()));
        let r = refused(&mut g, &signed(1, NOW + 61, "n3", start()));
        assert!(r.reason.starts_with("clock skew"), "{}", r.reason);

        let r = refused(&mut g, &signed(2, NOW, "n4", start()));
        assert_eq!(
            r.reason,
            "not allowed: operator vic has role viewer, start_rollout needs operator"
        );
        g.check(
            &signed(
                2,
                NOW,
                "n5",
                Command::ListDevices {
                    page: Default::default(),
                },
            ),
            NOW,
        )
        .expect("a viewer may list");

        let r = refused(&mut g, &signed(1, NOW, "", start()));
        assert!(r.reason.contains("nonce"), "{}", r.reason);

        // A wrapper without its signature still gets an answer.
        let mut wrapper: serde_json::Value =
            serde_json::from_slice(&signed(1, NOW, "n6", start())).expect("json");
        wrapper.as_object_mut().map(|o| o.remove("signature"));
        let r = refused(&mut g, &serde_json::to_vec(&wrapper).expect("json"));
        assert!(r.reason.starts_with("malformed request"), "{}", r.reason);
        assert_eq!(r.reply_to.as_deref(), Some(REPLY));

        let r = refused(&mut g, b"not json");
        assert!(r.reason.starts_with("malformed request"), "{}", r.reason);
        assert_eq!(r.reply_to, None);
    }

    #[test]
    fn an_invalid_reply_to_gets_no_reply() {
        let mut g = gate();
        for bad in [
            "flotilla/v1/control/reply/#",
            "flotilla/v1/devices/d/desired",
            "flotilla/v1/control/reply/a\0",
        ] {
            let request = ControlRequest::new("x", bad, NOW, "n", start());
            let payload =
                serde_json::to_vec(&SignedRequest::sign(&key(1), &request)).expect("json");
            let r = refused(&mut g, &payload);
            assert_eq!(r.reply_to, None, "{bad:?}");
            assert!(r.reason.starts_with("invalid reply_to"), "{}", r.reason);
            let unsigned = serde_json::to_vec(&request).expect("json");
            assert_eq!(refused(&mut g, &unsigned).reply_to, None, "{bad:?}");
        }
    }

    #[test]
    fn the_nonce_cache_is_bounded_and_never_forgets_into_a_replay() {
        let mut g = gate();
        // Old entries leave when their time falls out of the window.
        g.check(
            &signed(
                1,
                NOW,
                "a",
                Command::ListDevices {
                    page: Default::default(),
                },
            ),
            NOW,
        )
        .expect("ok");
        g.check(
            &signed(
                1,
                NOW + 100,
                "b",
                Command::ListDevices {
                    page: Default::default(),
                },
            ),
            NOW + 100,
        )
        .expect("ok");
        assert_eq!(g.seen.len(), 1, "a fell out of the window");
        assert_eq!(g.floor, None);
        // A full cache forgets its oldest nonce and refuses anything that old from then on.
        let mut g = gate();
        for i in 0..NONCE_CAPACITY as u64 {
            g.remember(flotilla_protocol::sha256(&i.to_le_bytes()), NOW - 10, NOW);
        }
        g.check(
            &signed(
                1,
                NOW,
                "fresh",
                Command::ListDevices {
                    page: Default::default(),
                },
            ),
            NOW,
        )
        .expect("ok");
        assert_eq!(g.seen.len(), NONCE_CAPACITY);
        assert_eq!(g.floor, Some(NOW - 10));
        let r = refused(
            &mut g,
            &signed(
                1,
                NOW - 10,
                "other",
                Command::ListDevices {
                    page: Default::default(),
                },
            ),
        );
        assert!(r.reason.starts_with("replayed request"), "{}", r.reason);
    }

    #[test]
    fn mutated_payloads_never_panic_and_never_pass_altered() {
        let original = ControlRequest::new("r1", REPLY, NOW, "n-m", start());
        let text = serde_json::to_string(&original).expect("json");
        let payload = signed(1, NOW, "n-m", start());
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        for _ in 0..5000 {
            let mut bytes = payload.clone();
            for _ in 0..=(state % 3) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let i = (state % bytes.len() as u64) as usize;
                bytes[i] ^= 1 << (state % 8);
            }
            // A fresh gate each time, so a surviving copy is not refused as a replay.
            if let Ok(ok) = gate().check(&bytes, NOW) {
                assert_eq!(
                    serde_json::to_string(&ok.request).expect("json"),
                    text,
                    "only the exact signed request passes"
                );
            }
        }
    }

    #[test]
    fn requests_from_before_a_restart_are_refused() {
        // The cache of the previous run is gone: anything made before this run started could
        // be a copy of a request that run accepted.
        let mut g = gate();
        g.started = NOW;
        let r = refused(
            &mut g,
            &signed(
                1,
                NOW - 1,
                "x",
                Command::ListDevices {
                    page: Default::default(),
                },
            ),
        );
        assert!(
            r.reason.starts_with("replayed request")
                && r.reason.contains("before the coordinator started"),
            "{}",
            r.reason
        );
        g.check(
            &signed(
                1,
                NOW,
                "y",
                Command::ListDevices {
                    page: Default::default(),
                },
            ),
            NOW,
        )
        .expect("made after the start");
    }
}
