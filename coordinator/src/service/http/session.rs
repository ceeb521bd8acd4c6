//! Browser sessions for the HTTP API (decision 0055): an operator proves who they are once with a
//! signed `login` request (the same envelope, gate and roles as every control request), and gets
//! a short-lived cookie for reads (`GET /api/v1/...`) and live events. The cookie never
//! authorizes a change: every change is still a signed control request.
//!
//! The cookie is `HttpOnly` (no script reads it), `SameSite=Strict` (no other site's page sends
//! it), `Secure` behind TLS, and names a random 256-bit token; the table of sessions lives in
//! memory, so a restart or `DELETE /api/v1/session` ends them.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use flotilla_protocol::operator::Role;

/// The cookie's name.
pub const COOKIE: &str = "flotilla_session";
/// How long a session lasts.
pub const TTL: Duration = Duration::from_secs(8 * 3600);
/// Sessions held at once; opening one more ends the oldest.
pub const MAX_SESSIONS: usize = 10_000;

/// Who a session is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub operator: String,
    pub role: Role,
    expires: Instant,
}

/// The open sessions, by token.
#[derive(Debug, Default)]
pub struct Sessions {
    open: Mutex<HashMap<String, Session>>,
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens a session for `operator` with `role`; returns its token.
    pub fn open(&self, operator: &str, role: Role) -> String {
        let token = crate::service::tokens::new_token();
        let now = Instant::now();
        let mut open = self.lock();
        open.retain(|_, s| s.expires > now);
        if open.len() >= MAX_SESSIONS {
            if let Some(oldest) = open
                .iter()
                .min_by_key(|(_, s)| s.expires)
                .map(|(t, _)| t.clone())
            {
                open.remove(&oldest);
            }
        }
        open.insert(
            token.clone(),
            Session {
                operator: operator.to_owned(),
                role,
                expires: now + TTL,
            },
        );
        token
    }

    /// The session of `token`, if it is open and has not expired.
    pub fn get(&self, token: &str) -> Option<Session> {
        let mut open = self.lock();
        match open.get(token) {
            Some(s) if s.expires > Instant::now() => Some(s.clone()),
            Some(_) => {
                open.remove(token);
                None
            }
            None => None,
        }
    }

    /// Ends the session of `token`; whether there was one.
    pub fn close(&self, token: &str) -> bool {
        self.lock().remove(token).is_some()
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

    #[test]
    fn a_session_is_found_by_its_token_until_it_is_closed() {
        let sessions = Sessions::default();
        let token = sessions.open("alice", Role::Operator);
        assert_eq!(token.len(), 64, "256 random bits in hex");
        let s = sessions.get(&token).expect("open");
        assert_eq!((s.operator.as_str(), s.role), ("alice", Role::Operator));
        assert_ne!(
            sessions.open("alice", Role::Operator),
            token,
            "a new token each time"
        );
        assert!(sessions.get("0".repeat(64).as_str()).is_none());
        assert!(sessions.close(&token));
        assert!(sessions.get(&token).is_none(), "closed");
        assert!(!sessions.close(&token));
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
