//! Browser sessions for the HTTP API (decisions 0055, 0060): an operator proves who they are once
//! with a signed `login` request (the same envelope, gate and roles as every control request),
//! and gets a short-lived cookie for reads (`GET /api/v1/...`) and live events. The cookie never
//! authorizes a change: every change is still a signed control request.
//!
//! The cookie is `HttpOnly` (no script reads it), `SameSite=Strict` (no other site's page sends
//! it), `Secure` behind TLS, and names a random 256-bit token. The coordinator's store keeps
//! only the token's sha256 ([`digest`]) with the operator, role, key and expiry, so a session
//! survives a restart and a failover to a coordinator sharing the store; this table is the
//! leader's copy of it. `DELETE /api/v1/session` ends one (in the store too); a session whose
//! operator is no longer configured with the same role and key is dropped when a coordinator
//! starts leading ([`still_valid`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use flotilla_protocol::hex;
use flotilla_protocol::operator::Role;
use serde::{Deserialize, Serialize};

use crate::service::config::OperatorConfig;
use crate::service::store::Store;

/// The cookie's name.
pub const COOKIE: &str = "flotilla_session";
/// How long a session lasts.
pub const TTL: Duration = Duration::from_secs(8 * 3600);
/// Sessions held at once; opening one more ends the oldest.
pub const MAX_SESSIONS: usize = 10_000;

/// Who a session is for, as the store keeps it under the token's digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Session {
    pub operator: String,
    pub role: Role,
    /// The operator's public key (hex) that signed the login.
    #[serde(default)]
    pub key: String,
    /// Unix time the session ends.
    pub expires: u64,
}

/// What a token names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    Open(Session),
    /// It was a session, and ended at this unix time.
    Expired(u64),
    /// No session (never opened, logged out, revoked).
    Unknown,
}

/// The open sessions, by the sha256 (hex) of their token.
#[derive(Debug, Default)]
pub struct Sessions {
    open: Mutex<HashMap<String, Session>>,
}

/// The sha256 (hex) of a session token: what the store keeps instead of the token.
pub fn digest(token: &str) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(token.as_bytes()).as_slice())
}

/// A fresh token and its digest.
pub fn new_token() -> (String, String) {
    let token = crate::service::tokens::new_token();
    let digest = digest(&token);
    (token, digest)
}

/// Unix time now.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Whether a stored session may still be used at `now` with these operators: not expired, and
/// its operator is configured with the same role and key. Removing an operator, changing its
/// role or rotating its key (and restarting) revokes its sessions.
pub fn still_valid(session: &Session, operators: &[OperatorConfig], now: u64) -> bool {
    session.expires > now
        && operators.iter().any(|o| {
            o.name == session.operator
                && o.role == session.role
                && hex::encode(o.key.as_bytes()) == session.key
        })
}

/// The stored sessions still valid with these operators; the others (expired, revoked) are
/// removed from the store. A store that cannot be read gives none: operators log in again.
pub fn load(store: &Store, operators: &[OperatorConfig]) -> Vec<(String, Session)> {
    let stored: Vec<(String, Session)> = match store.load_sessions() {
        Ok(stored) => stored,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the stored HTTP sessions: operators log in again");
            return Vec::new();
        }
    };
    let now = unix_now();
    let (valid, ended): (Vec<_>, Vec<_>) = stored
        .into_iter()
        .partition(|(_, s)| still_valid(s, operators, now));
    if !ended.is_empty() {
        let digests: Vec<String> = ended.into_iter().map(|(d, _)| d).collect();
        if let Err(e) = store.delete_sessions(&digests) {
            tracing::warn!(error = %e, "cannot remove ended HTTP sessions from the store");
        }
    }
    tracing::info!(sessions = valid.len(), "HTTP sessions kept from the store");
    valid
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A table of these sessions (read from the store), by digest.
    pub fn with(sessions: impl IntoIterator<Item = (String, Session)>) -> Sessions {
        let table = Sessions::default();
        for (digest, session) in sessions {
            table.insert(digest, session);
        }
        table
    }

    /// Adds the session whose token has `digest`; when the table is full, the one that ends
    /// soonest goes.
    pub fn insert(&self, digest: String, session: Session) {
        let now = unix_now();
        let mut open = self.lock();
        if open.len() >= MAX_SESSIONS {
            open.retain(|_, s| s.expires > now);
        }
        if open.len() >= MAX_SESSIONS {
            if let Some(oldest) = open
                .iter()
                .min_by_key(|(_, s)| s.expires)
                .map(|(t, _)| t.clone())
            {
                open.remove(&oldest);
            }
        }
        open.insert(digest, session);
    }

    /// What `token` names now.
    pub fn lookup(&self, token: &str) -> Lookup {
        let digest = digest(token);
        let mut open = self.lock();
        match open.get(&digest) {
            Some(s) if s.expires > unix_now() => Lookup::Open(s.clone()),
            Some(s) => {
                let ended = s.expires;
                open.remove(&digest);
                Lookup::Expired(ended)
            }
            None => Lookup::Unknown,
        }
    }

    /// The session of `token`, if it is open and has not expired.
    pub fn get(&self, token: &str) -> Option<Session> {
        match self.lookup(token) {
            Lookup::Open(s) => Some(s),
            _ => None,
        }
    }

    /// Ends the session of `token`; its digest, if there was one.
    pub fn close(&self, token: &str) -> Option<String> {
        let digest = digest(token);
        self.lock().remove(&digest).map(|_| digest)
    }

    /// How many sessions the table holds.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The session token in a `Cookie` header, if there is one.
pub fn token_in(cookie_header: &str) -> Option<&str> {
    cookie_header
        .split(';')
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.trim())
        .filter(|value| !value.is_empty())
}

/// The `Set-Cookie` value that opens a session (`secure` behind TLS).
pub fn set_cookie(token: &str, secure: bool) -> String {
    format!(
        "{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}{}",
        TTL.as_secs(),
        if secure { "; Secure" } else { "" }
    )
}

/// The `Set-Cookie` value that ends one.
pub fn clear_cookie() -> String {
    format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(operator: &str, role: Role, key: &str, expires: u64) -> Session {
        Session {
            operator: operator.into(),
            role,
            key: key.into(),
            expires,
        }
    }

    #[test]
    fn a_session_is_found_by_its_token_until_it_is_closed_or_expires() {
        let sessions = Sessions::default();
        let (token, digest) = new_token();
        assert_eq!(token.len(), 64, "256 random bits in hex");
        assert_ne!(token, digest, "the table keys by the digest, not the token");
        let later = unix_now() + TTL.as_secs();
        sessions.insert(digest.clone(), session("alice", Role::Operator, "k", later));
        let s = sessions.get(&token).expect("open");
        assert_eq!((s.operator.as_str(), s.role), ("alice", Role::Operator));
        assert_ne!(new_token().0, token, "a new token each time");
        assert!(sessions.get(&digest).is_none(), "the digest is not a token");
        assert_eq!(sessions.close(&token), Some(digest));
        assert_eq!(sessions.lookup(&token), Lookup::Unknown, "closed");
        assert!(sessions.close(&token).is_none());

        let (old, old_digest) = new_token();
        sessions.insert(old_digest, session("alice", Role::Operator, "k", 1000));
        assert_eq!(sessions.lookup(&old), Lookup::Expired(1000));
        assert_eq!(sessions.lookup(&old), Lookup::Unknown, "dropped once seen");
    }

    #[test]
    fn a_stored_session_needs_its_operator_with_the_same_role_and_key() {
        let key = flotilla_protocol::signing::generate_key().verifying_key();
        let other = flotilla_protocol::signing::generate_key().verifying_key();
        let operators = vec![OperatorConfig {
            name: "alice".into(),
            role: Role::Operator,
            key,
        }];
        let hex_key = hex::encode(key.as_bytes());
        let now = unix_now();
        let good = session("alice", Role::Operator, &hex_key, now + 60);
        assert!(still_valid(&good, &operators, now));
        assert!(!still_valid(&good, &operators, now + 60), "expired");
        let renamed = session("bob", Role::Operator, &hex_key, now + 60);
        assert!(!still_valid(&renamed, &operators, now), "operator removed");
        let demoted = session("alice", Role::Admin, &hex_key, now + 60);
        assert!(!still_valid(&demoted, &operators, now), "role changed");
        let rotated = session(
            "alice",
            Role::Operator,
            &hex::encode(other.as_bytes()),
            now + 60,
        );
        assert!(!still_valid(&rotated, &operators, now), "key rotated");
    }

    #[test]
    fn stored_sessions_survive_a_reopen_and_the_ended_ones_are_removed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let key = flotilla_protocol::signing::generate_key().verifying_key();
        let operators = vec![OperatorConfig {
            name: "alice".into(),
            role: Role::Operator,
            key,
        }];
        let hex_key = hex::encode(key.as_bytes());
        let now = unix_now();
        let (token, kept) = new_token();
        {
            let store = Store::open(dir.path().join("db")).expect("open");
            let open = session("alice", Role::Operator, &hex_key, now + 3600);
            store.save_session(&kept, &open).expect("save");
            let expired = session("alice", Role::Operator, &hex_key, now - 1);
            store.save_session(&new_token().1, &expired).expect("save");
            let gone = session("bob", Role::Operator, &hex_key, now + 3600);
            store.save_session(&new_token().1, &gone).expect("save");
        }
        let store = Store::open(dir.path().join("db")).expect("reopen");
        let loaded = load(&store, &operators);
        assert_eq!(loaded.len(), 1, "{loaded:?}");
        assert_eq!(loaded[0].0, kept, "keyed by the digest");
        let table = Sessions::with(loaded);
        assert_eq!(table.get(&token).map(|s| s.operator), Some("alice".into()));
        let left: Vec<(String, Session)> = store.load_sessions().expect("read");
        assert_eq!(left.len(), 1, "expired and revoked ones removed: {left:?}");
        store.delete_sessions(&[kept]).expect("logout");
        assert!(load(&store, &operators).is_empty(), "logged out");
    }

    #[test]
    fn the_cookie_is_http_only_strict_and_read_back_among_others() {
        let cookie = set_cookie("abc", true);
        assert!(cookie.starts_with("flotilla_session=abc; Path=/; HttpOnly; SameSite=Strict"));
        assert!(cookie.ends_with("; Secure"));
        assert!(!set_cookie("abc", false).contains("Secure"));
        assert_eq!(token_in("a=1; flotilla_session=abc; b=2"), Some("abc"));
        assert_eq!(token_in("flotilla_session="), None);
        assert_eq!(token_in("other=abc"), None);
        assert!(clear_cookie().contains("Max-Age=0"));
    }
}
