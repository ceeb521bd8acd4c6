//! One connection per broker login from this machine at a time.
//!
//! A broker that ties the client id to the login (the shipped Mosquitto configuration:
//! `use_username_as_clientid` on every listener) disconnects a login's connection when the same
//! login connects again. Two `flotilla` commands run at once under one login (a script running
//! several, two terminals) would knock each other off, and the one knocked off loses the reply
//! it waits for. So a command that logs in holds a lock named after the broker and the login
//! while it is connected, and a second command waits for the first to finish.
//!
//! The lock is a Unix socket bound in Linux's abstract namespace: binding a name is atomic, and
//! the kernel releases it when the process ends, however it ends, so nothing stale is left
//! behind. Any local user can bind any name, so the wait is bounded: after the wait, the
//! command connects anyway and says so on stderr. Elsewhere than on Linux there is no lock.
//! Commands on different machines are not serialised: give each person and tool its own login
//! (docs/security.md, "One connection per login").

use std::time::Duration;

/// How long a command waits for another one under the same login before connecting anyway:
/// longer than a change waits for its reply ([`super::client::CHANGE_TIMEOUT`]).
pub const WAIT: Duration = Duration::from_secs(60);

/// Held while connected; dropping it lets the next command under the same login connect.
#[derive(Debug)]
pub struct LoginLock {
    _socket: Option<std::os::unix::net::UnixListener>,
}

/// The abstract socket name for `login` at the broker `addr`: a digest, so neither the address
/// nor the login shows in `/proc/net/unix`.
pub fn name(addr: &str, login: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::new()
        .chain_update(addr.as_bytes())
        .chain_update([0])
        .chain_update(login.as_bytes())
        .finalize();
    format!(
        "flotilla-cli-login-{}",
        &flotilla_protocol::hex::encode(&digest)[..32]
    )
}

/// Waits (at most `wait`) until no other process on this machine holds `login`'s connection to
/// `addr`, and takes the lock. Never fails: without the lock, the command connects anyway.
pub async fn acquire(addr: &str, login: &str, wait: Duration) -> LoginLock {
    #[cfg(target_os = "linux")]
    {
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::net::{SocketAddr, UnixListener};
        let name = name(addr, login);
        let deadline = tokio::time::Instant::now() + wait;
        let mut noted = false;
        loop {
            let bound = SocketAddr::from_abstract_name(name.as_bytes())
                .and_then(|a| UnixListener::bind_addr(&a));
            match bound {
                Ok(socket) => {
                    return LoginLock {
                        _socket: Some(socket),
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                    if tokio::time::Instant::now() >= deadline {
                        eprintln!(
                            "note: another command still holds the login {login} at {addr} after \
                             {}s; connecting anyway (the broker may disconnect one of the two)",
                            wait.as_secs()
                        );
                        return LoginLock { _socket: None };
                    }
                    if !noted {
                        noted = true;
                        eprintln!(
                            "note: waiting for another flotilla command logged in as {login} at \
                             {addr} to finish (the broker keeps one connection per login)"
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "no login lock; connecting without it");
                    return LoginLock { _socket: None };
                }
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (addr, login, wait);
        LoginLock { _socket: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_login_is_held_by_one_command_at_a_time() {
        let addr = format!("test-{}", std::process::id());
        let first = acquire(&addr, "alice", WAIT).await;
        assert!(first._socket.is_some(), "the first command holds the lock");
        let other = acquire(&addr, "bob", Duration::ZERO).await;
        assert!(other._socket.is_some(), "another login is not held up");
        let second = acquire(&addr, "alice", Duration::ZERO).await;
        assert!(
            second._socket.is_none(),
            "a second command under the same login does not get it"
        );
        let waiting = tokio::spawn({
            let addr = addr.clone();
            async move { acquire(&addr, "alice", WAIT).await._socket.is_some() }
        });
        drop(first);
        assert!(
            waiting.await.expect("task"),
            "a waiting command takes it when the first is done"
        );
        assert_ne!(name("a:1", "x"), name("a:1", "y"));
        assert_ne!(name("a:1", "x"), name("a:2", "x"));
    }
}
