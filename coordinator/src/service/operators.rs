//! Who sent a control request, and may they: the checks between the control topic and
//! `dispatch` (docs/security.md, "Operator commands").
//!
//! [`Gate::check`] takes the raw MQTT payload and the coordinator's clock and either returns the
//! operator and the parsed request, or a [`Refusal`] that says why, with the request's `id` and
//! a valid `reply_to` whenever the payload gave them, so the client gets an error reply instead
//! of silence. In order: the payload is a signed request (`{"request", "key", "signature"}`);
//! the request text parses and its `reply_to` is a plain reply topic under the root; the key
//! belongs to a configured operator; the key, and its role, are within their rate limits; the
//! (key, nonce) pair was not seen; the signature verifies over the exact request bytes; `at`
//! lies within the clock window and after the coordinator started; the operator's role covers
//! the command. Pure apart from its memory: `now` is an argument.
//!
//! What one operator key does costs only that key (decision 0040):
//!
//! - **Replay memory per key.** Each key has its own nonce cache of at most
//!   [`NONCES_PER_KEY`]. When a key fills its own, its oldest nonce is forgotten and that key's
//!   requests at or before that time are refused from then on; no other key notices.
//! - **Rate limits per key and per role** (`[control] key_rate`, `role_rate`): token buckets of
//!   requests a second, with ten seconds' worth at once. They are checked before the signature,
//!   the one costly check, so a flood of valid requests costs a JSON parse each once its key is
//!   over its limit. Only fresh requests take a token: a request must pass the signature, the
//!   clock window and the replay check first, so nobody can spend someone else's budget with
//!   forgeries or copies of their requests. Roles have separate buckets: a viewer's flood never
//!   holds back an operator's or an admin's request.
//! - **Refusals are not a flood of their own.** At most [`REFUSALS_SPOKEN_PER_SECOND`]
//!   refusals a second are answered and logged one by one; a rate-limited key is told so once a
//!   second per reply topic, and only after its request's signature verified. The rest are
//!   `quiet`: counted, never answered, and summed up in one log line every [`SUMMARY_SECONDS`].

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use flotilla_protocol::control::ControlRequest;
use flotilla_protocol::operator::{check_reply_to, Role, SignedRequest};
use flotilla_protocol::{hex, Digest, Topics};

use crate::service::config::{ControlLimits, OperatorConfig, CONTROL_BURST_SECONDS};
use crate::service::rate::{Bucket, Rate};

/// At most this many nonces are remembered per operator key. When a key's cache is full, its
/// oldest nonce is forgotten and nothing of that key at or before its time is accepted any
/// more, so the cache stays bounded without ever letting a forgotten request through again.
/// Within its rate limit a key never gets there: 50 requests a second over a 60 s window
/// remember about 6,500.
pub const NONCES_PER_KEY: usize = 20_000;

/// Refusals answered (and logged) one by one each second; more are quiet.
pub const REFUSALS_SPOKEN_PER_SECOND: u32 = 20;

/// How often quiet refusals are summed up in the log, in seconds.
pub const SUMMARY_SECONDS: u64 = 10;

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
    /// Where to send the error reply: only a `reply_to` that passed [`check_reply_to`], and
    /// never for a quiet refusal.
    pub reply_to: Option<String>,
    /// Starts with the kind of refusal: "unsigned request", "malformed request", "unknown key",
    /// "wrong signature", "clock skew", "replayed request", "rate limited", "not allowed",
    /// "invalid reply_to".
    pub reason: String,
    /// One of a flood: neither answered nor logged on its own, only counted (and summed up).
    pub quiet: bool,
    /// A log line summing up the quiet refusals since the last one, when one is due.
    pub summary: Option<String>,
}

impl Refusal {
    fn new() -> Refusal {
        Refusal {
            id: None,
            reply_to: None,
            reason: String::new(),
            quiet: false,
            summary: None,
        }
    }

    /// The kind of refusal: the first two words of the reason ("rate limited").
    fn kind(&self) -> String {
        self.reason
            .split(|c: char| c == ':' || c.is_whitespace())
            .filter(|w| !w.is_empty())
            .take(2)
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Which rate limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// The operator key's own.
    Key,
    /// All keys of the operator's role together.
    Role,
}

impl Limit {
    pub fn name(self) -> &'static str {
        match self {
            Limit::Key => "key",
            Limit::Role => "role",
        }
    }
}

/// What the gate counted of one operator, for `/metrics`.
#[derive(Debug)]
pub struct OperatorCounts {
    pub name: String,
    pub role: Role,
    by_key: AtomicU64,
    by_role: AtomicU64,
}

impl OperatorCounts {
    /// Requests of this operator refused by `limit`.
    pub fn limited(&self, limit: Limit) -> u64 {
        match limit {
            Limit::Key => self.by_key.load(Ordering::Relaxed),
            Limit::Role => self.by_role.load(Ordering::Relaxed),
        }
    }
}

/// The gate's counts, shared with the metrics endpoint (`flotilla_control_requests_rate_limited_total`).
#[derive(Debug, Default)]
pub struct GateCounts {
    pub operators: Vec<OperatorCounts>,
}

/// The nonces of one key: (at, digest of key and nonce), ordered by time for eviction.
#[derive(Debug, Default)]
struct NonceCache {
    by_time: BTreeSet<(u64, Digest)>,
    seen: HashSet<Digest>,
    /// Requests at or before this time are refused: their nonces may have been evicted.
    floor: Option<u64>,
}

impl NonceCache {
    /// Records a used nonce and forgets the ones whose requests the window refuses anyway.
    fn remember(&mut self, digest: Digest, at: u64, oldest_valid: u64) {
        while let Some(&(t, d)) = self.by_time.first() {
            if t >= oldest_valid && self.by_time.len() < NONCES_PER_KEY {
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
}

/// One operator key's memory: its budget and its nonces.
#[derive(Debug)]
struct KeyState {
    bucket: Bucket,
    nonces: NonceCache,
}

fn role_index(role: Role) -> usize {
    match role {
        Role::Viewer => 0,
        Role::Operator => 1,
        Role::Admin => 2,
    }
}

/// Which refusals were answered this second, and what was kept quiet since the last summary.
#[derive(Debug, Default)]
struct Speech {
    second: u64,
    spoken: u32,
    /// (operator, reply_to) told "rate limited" this second.
    told: Vec<(usize, String)>,
    quiet: BTreeMap<String, u64>,
    /// Quiet rate-limited requests by operator name.
    quiet_limited: BTreeMap<String, u64>,
    last_summary: Option<u64>,
}

impl Speech {
    fn roll(&mut self, now: u64) {
        if now != self.second {
            self.second = now;
            self.spoken = 0;
            self.told.clear();
        }
    }

    fn may_speak(&mut self, now: u64) -> bool {
        self.roll(now);
        self.spoken < REFUSALS_SPOKEN_PER_SECOND
    }

    fn summary(&mut self, now: u64) -> Option<String> {
        if self.quiet.is_empty()
            || self
                .last_summary
                .is_some_and(|last| now.saturating_sub(last) < SUMMARY_SECONDS)
        {
            return None;
        }
        let since = self
            .last_summary
            .map_or("since the start".to_owned(), |last| {
                format!("in the last {} s", now.saturating_sub(last))
            });
        self.last_summary = Some(now);
        let total: u64 = self.quiet.values().sum();
        let kinds: Vec<String> = std::mem::take(&mut self.quiet)
            .into_iter()
            .map(|(kind, n)| format!("{n} {kind}"))
            .collect();
        let limited: Vec<String> = std::mem::take(&mut self.quiet_limited)
            .into_iter()
            .map(|(operator, n)| format!("{operator} {n}"))
            .collect();
        let by_operator = if limited.is_empty() {
            String::new()
        } else {
            format!(" (rate limited, by operator: {})", limited.join(", "))
        };
        Some(format!(
            "refused {total} control requests {since} without answering them, more than \
             {REFUSALS_SPOKEN_PER_SECOND} a second: {}{by_operator}",
            kinds.join(", ")
        ))
    }
}

/// The operator keys, their budgets and their replay caches.
#[derive(Debug)]
pub struct Gate {
    operators: Vec<OperatorConfig>,
    /// Operator index by the key's bytes, for a look-up before anything costly.
    by_key: HashMap<[u8; 32], usize>,
    keys: Vec<KeyState>,
    roles: [Bucket; 3],
    limits: ControlLimits,
    window: u64,
    topics: Topics,
    /// When this gate was made (the service started). The nonce caches live in memory, so a
    /// request made before then may have been accepted by the previous run: refused.
    started: u64,
    speech: Speech,
    counts: Arc<GateCounts>,
}

impl Gate {
    /// A gate for a service started at `started` (Unix seconds), with the default rate limits.
    pub fn new(operators: Vec<OperatorConfig>, window: u64, topics: Topics, started: u64) -> Gate {
        let limits = ControlLimits::default();
        let key_rates: Vec<Rate> = operators
            .iter()
            .map(|o| Rate::per_second(limits.key.of(o.role), CONTROL_BURST_SECONDS))
            .collect();
        let counts = Arc::new(GateCounts {
            operators: operators
                .iter()
                .map(|o| OperatorCounts {
                    name: o.name.clone(),
                    role: o.role,
                    by_key: AtomicU64::new(0),
                    by_role: AtomicU64::new(0),
                })
                .collect(),
        });
        Gate {
            by_key: operators
                .iter()
                .enumerate()
                .map(|(i, o)| (o.key.to_bytes(), i))
                .collect(),
            keys: key_rates
                .iter()
                .map(|rate| KeyState {
                    bucket: Bucket::full(rate, started),
                    nonces: NonceCache::default(),
                })
                .collect(),
            roles: [Role::Viewer, Role::Operator, Role::Admin]
                .map(|role| Bucket::full(&Self::role_rate(&limits, role), started)),
            operators,
            limits,
            window,
            topics,
            started,
            speech: Speech::default(),
            counts,
        }
    }

    /// The same gate with these rate limits (`[control] key_rate`, `role_rate`).
    pub fn with_limits(mut self, limits: ControlLimits) -> Gate {
        self.limits = limits;
        for (key, operator) in self.keys.iter_mut().zip(&self.operators) {
            key.bucket = Bucket::full(&Self::key_rate(&limits, operator.role), self.started);
        }
        self.roles = [Role::Viewer, Role::Operator, Role::Admin]
            .map(|role| Bucket::full(&Self::role_rate(&limits, role), self.started));
        self
    }

    fn key_rate(limits: &ControlLimits, role: Role) -> Rate {
        Rate::per_second(limits.key.of(role), CONTROL_BURST_SECONDS)
    }

    fn role_rate(limits: &ControlLimits, role: Role) -> Rate {
        Rate::per_second(limits.role.of(role), CONTROL_BURST_SECONDS)
    }

    /// How many operators are configured.
    pub fn operator_count(&self) -> usize {
        self.operators.len()
    }

    /// What the gate counts, for the metrics endpoint.
    pub fn counts(&self) -> Arc<GateCounts> {
        self.counts.clone()
    }

    /// Runs every check on a control request payload received at `now` (Unix seconds).
    pub fn check(&mut self, payload: &[u8], now: u64) -> Result<Authorized, Refusal> {
        let refusal = match self.judge(payload, now) {
            Ok(authorized) => return Ok(authorized),
            Err(refusal) => refusal,
        };
        Err(self.speak(refusal, now))
    }

    /// Answers and logs a refusal while this second's budget lasts; after that it is quiet.
    fn speak(&mut self, mut refusal: Refusal, now: u64) -> Refusal {
        if !refusal.quiet && self.speech.may_speak(now) {
            self.speech.spoken += 1;
        } else {
            refusal.quiet = true;
            refusal.reply_to = None;
            *self.speech.quiet.entry(refusal.kind()).or_default() += 1;
        }
        refusal.summary = self.speech.summary(now);
        refusal
    }

    /// The limit an operator is over at `now`, if any.
    fn over_limit(&mut self, index: usize, now: u64) -> Option<Limit> {
        let role = self.operators[index].role;
        if !self.keys[index]
            .bucket
            .ready(&Self::key_rate(&self.limits, role), now)
        {
            return Some(Limit::Key);
        }
        if !self.roles[role_index(role)].ready(&Self::role_rate(&self.limits, role), now) {
            return Some(Limit::Role);
        }
        None
    }

    /// The checks, in order; [`Gate::check`] then decides whether a refusal is answered.
    fn judge(&mut self, payload: &[u8], now: u64) -> Result<Authorized, Refusal> {
        let signed: SignedRequest = match serde_json::from_slice(payload) {
            Ok(s) => s,
            Err(e) => return Err(self.unsigned(payload, &e.to_string())),
        };
        let mut refusal = Refusal::new();
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
        // The key's bytes find the operator without decompressing a point: nothing costly
        // happens before the rate limits.
        let index = hex::decode_array::<32>(&signed.key)
            .ok()
            .and_then(|bytes| self.by_key.get(&bytes).copied());
        let Some(index) = index else {
            return match signed.public_key() {
                Err(e) => refuse(refusal, format!("malformed request: {e}")),
                Ok(_) => refuse(
                    refusal,
                    format!(
                        "unknown key {}: no operator of this coordinator has it",
                        signed.key.trim().to_ascii_lowercase()
                    ),
                ),
            };
        };
        let operator = self.operators[index].clone();
        if let Some(limit) = self.over_limit(index, now) {
            return Err(self.limited(index, limit, &signed, refusal, now));
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
        // A nonce this key used is refused before the signature: a genuine request never
        // reuses one, so whatever carries it is a copy or a forgery.
        let digest = nonce_digest(&operator.key.to_bytes(), &request.nonce);
        if self.keys[index].nonces.seen.contains(&digest) {
            return refuse(
                refusal,
                format!(
                    "replayed request: nonce {:?} of operator {} was already used",
                    request.nonce, operator.name
                ),
            );
        }
        if let Err(e) = signed.verify_with(&operator.key) {
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
        if request.at < self.started {
            return refuse(
                refusal,
                format!(
                    "replayed request: made at {}, before the coordinator started at {}; make a new request",
                    request.at, self.started
                ),
            );
        }
        if self.keys[index]
            .nonces
            .floor
            .is_some_and(|floor| request.at <= floor)
        {
            return refuse(
                refusal,
                format!(
                    "replayed request: operator {} made too many requests in the clock window; make a new request (at {} is too old)",
                    operator.name, request.at
                ),
            );
        }
        // A fresh request of this operator: it takes from the budgets, and is remembered
        // whether or not its role allows it, so a copy of it costs nothing more.
        let role = operator.role;
        self.keys[index]
            .bucket
            .take(&Self::key_rate(&self.limits, role), now);
        self.roles[role_index(role)].take(&Self::role_rate(&self.limits, role), now);
        let oldest_valid = now.saturating_sub(self.window);
        self.keys[index]
            .nonces
            .remember(digest, request.at, oldest_valid);
        let needed = request.command.required_role();
        if role < needed {
            return refuse(
                refusal,
                format!(
                    "not allowed: operator {} has role {role}, {} needs {needed}",
                    operator.name,
                    request.command.name()
                ),
            );
        }
        Ok(Authorized {
            operator: operator.name,
            role,
            request,
        })
    }

    /// A request of an operator over `limit`: counted; answered (after its signature verified)
    /// once a second per reply topic while the refusal budget lasts, quiet otherwise.
    fn limited(
        &mut self,
        index: usize,
        limit: Limit,
        signed: &SignedRequest,
        mut refusal: Refusal,
        now: u64,
    ) -> Refusal {
        let counts = &self.counts.operators[index];
        match limit {
            Limit::Key => counts.by_key.fetch_add(1, Ordering::Relaxed),
            Limit::Role => counts.by_role.fetch_add(1, Ordering::Relaxed),
        };
        let operator = &self.operators[index];
        let role = operator.role;
        refusal.reason = match limit {
            Limit::Key => format!(
                "rate limited: operator {} ({role}) sent more than {} requests a second, its key's limit; \
                 further requests are dropped unanswered until it slows down; try again in a second",
                operator.name,
                self.limits.key.of(role)
            ),
            Limit::Role => format!(
                "rate limited: the {role} keys together sent more than {} requests a second, the {role} \
                 role's limit (operator {}); further requests are dropped unanswered until they slow \
                 down; try again in a second",
                self.limits.role.of(role),
                operator.name
            ),
        };
        let reply_to = refusal.reply_to.clone().unwrap_or_default();
        let told = self
            .speech
            .told
            .iter()
            .any(|(i, r)| *i == index && *r == reply_to);
        // Only a genuine request is told, so forgeries cannot use up the one answer a second.
        if !told && self.speech.may_speak(now) && signed.verify_with(&operator.key).is_ok() {
            self.speech.told.push((index, reply_to));
            return refusal;
        }
        *self
            .speech
            .quiet_limited
            .entry(operator.name.clone())
            .or_default() += 1;
        refusal.quiet = true;
        refusal.reply_to = None;
        refusal
    }

    /// A payload that is not a signed request: say so, and answer if it names a valid reply_to.
    fn unsigned(&self, payload: &[u8], parse_error: &str) -> Refusal {
        let mut refusal = Refusal::new();
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

fn nonce_digest(key: &[u8; 32], nonce: &str) -> Digest {
    let mut bytes = key.to_vec();
    bytes.extend_from_slice(nonce.as_bytes());
    flotilla_protocol::sha256(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::config::RoleRates;
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

    fn list() -> Command {
        Command::ListDevices {
            page: Default::default(),
        }
    }

    #[test]
    fn the_nonce_cache_is_bounded_and_never_forgets_into_a_replay() {
        let mut g = gate();
        // Old entries leave when their time falls out of the window.
        g.check(&signed(1, NOW, "a", list()), NOW).expect("ok");
        g.check(&signed(1, NOW + 100, "b", list()), NOW + 100)
            .expect("ok");
        assert_eq!(g.keys[0].nonces.seen.len(), 1, "a fell out of the window");
        assert_eq!(g.keys[0].nonces.floor, None);
        // A full cache forgets its oldest nonce and refuses anything that old from then on.
        let mut g = gate();
        for i in 0..NONCES_PER_KEY as u64 {
            g.keys[0].nonces.remember(
                flotilla_protocol::sha256(&i.to_le_bytes()),
                NOW - 10,
                NOW - 60,
            );
        }
        g.check(&signed(1, NOW, "fresh", list()), NOW).expect("ok");
        assert_eq!(g.keys[0].nonces.seen.len(), NONCES_PER_KEY);
        assert_eq!(g.keys[0].nonces.floor, Some(NOW - 10));
        let r = refused(&mut g, &signed(1, NOW - 10, "other", list()));
        assert!(r.reason.starts_with("replayed request"), "{}", r.reason);
        // Only that key's: the viewer's requests of the same time pass.
        g.check(&signed(2, NOW - 10, "other", list()), NOW)
            .expect("another key is not held to alice's floor");
    }

    /// The attack of issue 19: a viewer floods validly signed requests stamped just inside the
    /// clock window, far more than any cache holds. Its own key pays (rate limited, and at worst
    /// its own nonce floor); the admin's stop, made now, passes, and so does another viewer's
    /// request once the flood's second is over.
    #[test]
    fn a_viewer_flood_never_refuses_another_operator() {
        let mut g = gate().with_limits(ControlLimits {
            // Limits far above the flood, so only the replay memory is in play.
            key: RoleRates {
                viewer: 100_000,
                operator: 100_000,
                admin: 100_000,
            },
            role: RoleRates {
                viewer: 100_000,
                operator: 100_000,
                admin: 100_000,
            },
        });
        let key = key(2);
        let stamped = NOW + 59;
        let mut accepted = 0;
        for i in 0..(NONCES_PER_KEY as u64 + 5_000) {
            // Signing 25,000 requests is the slow part; the gate sees exactly those bytes.
            let request = ControlRequest::new("f", REPLY, stamped, format!("n{i}"), list());
            let payload = serde_json::to_vec(&SignedRequest::sign(&key, &request)).expect("json");
            if g.check(&payload, NOW).is_ok() {
                accepted += 1;
            }
        }
        assert!(accepted >= NONCES_PER_KEY, "{accepted}");
        assert!(g.keys[1].nonces.seen.len() <= NONCES_PER_KEY);
        let stop = Command::StopRollout {
            rollout: "fw".into(),
        };
        let ok = g
            .check(&signed(1, NOW, "stop", stop.clone()), NOW)
            .expect("the admin's stop passes after the flood");
        assert_eq!(ok.operator, "alice");
        assert_eq!(ok.request.command, stop);
    }

    #[test]
    fn a_flooding_key_is_rate_limited_before_its_signature_is_checked() {
        let mut g = gate();
        let limits = ControlLimits::default();
        let burst = u64::from(limits.key.viewer) * CONTROL_BURST_SECONDS;
        for i in 0..burst {
            g.check(&signed(2, NOW, &format!("b{i}"), list()), NOW)
                .unwrap_or_else(|r| panic!("within the burst: {}", r.reason));
        }
        // Over the limit: the first request this second is told why (its signature verified)…
        let r = refused(&mut g, &signed(2, NOW, "over-1", list()));
        assert!(
            r.reason.starts_with("rate limited: operator vic (viewer)"),
            "{}",
            r.reason
        );
        assert_eq!(r.reply_to.as_deref(), Some(REPLY));
        assert!(!r.quiet);
        // …the rest are quiet, forgeries included: not even a signature check tells them apart.
        let mut forged: SignedRequest =
            serde_json::from_slice(&signed(2, NOW, "over-2", list())).expect("json");
        forged.signature = "00".repeat(64);
        let r = refused(&mut g, &serde_json::to_vec(&forged).expect("json"));
        assert!(r.reason.starts_with("rate limited"), "{}", r.reason);
        assert!(r.quiet && r.reply_to.is_none());
        assert_eq!(g.counts().operators[1].limited(Limit::Key), 2);
        // The admin is not held back, and the viewer's budget comes back with time.
        g.check(&signed(1, NOW, "admin", start()), NOW)
            .expect("another key, another role");
        g.check(&signed(2, NOW + 1, "later", list()), NOW + 1)
            .expect("a second later there is room again");
    }

    #[test]
    fn a_role_limit_spans_its_keys_and_no_other_role() {
        let ops = [
            ("alice", Role::Admin, 1),
            ("vic", Role::Viewer, 2),
            ("val", Role::Viewer, 3),
            ("otto", Role::Operator, 4),
        ]
        .into_iter()
        .map(|(name, role, seed)| OperatorConfig {
            name: name.into(),
            role,
            key: key(seed).verifying_key(),
        })
        .collect();
        let limits = ControlLimits {
            key: RoleRates {
                viewer: 2,
                operator: 2,
                admin: 2,
            },
            role: RoleRates {
                viewer: 3,
                operator: 3,
                admin: 3,
            },
        };
        let mut g = Gate::new(ops, 60, Topics::default(), NOW - 3600).with_limits(limits);
        let passed = |g: &mut Gate, seed: u8, n: usize, tag: &str| {
            (0..n)
                .filter(|i| {
                    g.check(&signed(seed, NOW, &format!("{tag}{i}"), list()), NOW)
                        .is_ok()
                })
                .count()
        };
        // Each viewer key may send 20 at once; the two together only 30.
        assert_eq!(passed(&mut g, 2, 25, "vic"), 20);
        assert_eq!(passed(&mut g, 3, 25, "val"), 10);
        let r = refused(&mut g, &signed(3, NOW, "val-more", list()));
        assert!(
            r.reason
                .starts_with("rate limited: the viewer keys together"),
            "{}",
            r.reason
        );
        assert_eq!(g.counts().operators[2].limited(Limit::Role), 16);
        // The operator and the admin roles have budgets of their own.
        assert_eq!(passed(&mut g, 4, 5, "otto"), 5);
        assert_eq!(passed(&mut g, 1, 5, "alice"), 5);
    }

    #[test]
    fn copies_and_forgeries_never_spend_a_keys_budget() {
        let mut g = gate().with_limits(ControlLimits {
            key: RoleRates {
                viewer: 1,
                operator: 1,
                admin: 1,
            },
            ..ControlLimits::default()
        });
        let burst = CONTROL_BURST_SECONDS as usize;
        let genuine = signed(1, NOW, "genuine", list());
        g.check(&genuine, NOW).expect("once");
        let mut forged: SignedRequest =
            serde_json::from_slice(&signed(1, NOW, "forged", list())).expect("json");
        forged.request = forged.request.replace("forged", "forgex");
        let forged = serde_json::to_vec(&forged).expect("json");
        for _ in 0..1000 {
            let r = refused(&mut g, &genuine);
            assert!(r.reason.starts_with("replayed request"), "{}", r.reason);
            let r = refused(&mut g, &forged);
            assert!(r.reason.starts_with("wrong signature"), "{}", r.reason);
        }
        let passed = (0..burst)
            .filter(|i| {
                g.check(&signed(1, NOW, &format!("n{i}"), list()), NOW)
                    .is_ok()
            })
            .count();
        assert_eq!(
            passed,
            burst - 1,
            "the budget, less the one genuine request"
        );
    }

    #[test]
    fn refusals_beyond_the_budget_are_quiet_and_summed_up() {
        let mut g = gate();
        let unsigned =
            serde_json::to_vec(&ControlRequest::new("u", REPLY, NOW, "n", start())).expect("json");
        let refusals: Vec<Refusal> = (0..1000).map(|_| refused(&mut g, &unsigned)).collect();
        let answered = refusals.iter().filter(|r| r.reply_to.is_some()).count();
        assert_eq!(answered, REFUSALS_SPOKEN_PER_SECOND as usize);
        assert!(refusals.iter().all(|r| r.quiet == r.reply_to.is_none()));
        let summaries: Vec<&String> = refusals.iter().filter_map(|r| r.summary.as_ref()).collect();
        assert_eq!(summaries.len(), 1, "one line for the first of them");
        let later = g.check(&unsigned, NOW + 1).expect_err("refused");
        assert!(!later.quiet, "another second, another budget");
        let late = (0..100)
            .map(|_| {
                g.check(&unsigned, NOW + SUMMARY_SECONDS)
                    .expect_err("refused")
            })
            .find_map(|r| r.summary)
            .expect("a summary after ten seconds");
        assert!(
            late.starts_with("refused 979 control requests in the last 10 s")
                && late.contains("unsigned request"),
            "{late}"
        );
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
