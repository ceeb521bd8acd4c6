//! systemd's readiness and watchdog notifications (`sd_notify(3)`), in a few lines over a unix
//! datagram socket instead of a crate.
//!
//! Under a unit with `Type=notify` systemd sets `NOTIFY_SOCKET` (a path, or an abstract socket
//! name starting with `@`); with `WatchdogSec=` it also sets `WATCHDOG_USEC` (and
//! `WATCHDOG_PID`, the process meant). The agent sends `READY=1` once it runs, `WATCHDOG=1`
//! from its main loop every half of `WATCHDOG_USEC`, and `STOPPING=1` when it shuts down. A main
//! loop that hangs stops pinging, and systemd kills and restarts the agent. Without the
//! variables every call does nothing, so the agent runs the same outside systemd.
//!
//! ```no_run
//! let notifier = flotilla_agent::notify::Notifier::from_env();
//! notifier.ready();
//! if let Some(every) = notifier.watchdog_interval() {
//!     // call notifier.watchdog() every `every` from the main loop
//! #   let _ = every;
//! }
//! ```

use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// Where notifications go, if anywhere.
#[derive(Debug, Default)]
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr)>,
    watchdog: Option<Duration>,
}

impl Notifier {
    /// From the process environment (`NOTIFY_SOCKET`, `WATCHDOG_USEC`, `WATCHDOG_PID`).
    pub fn from_env() -> Notifier {
        let var = |name| std::env::var(name).ok();
        Notifier::new(
            var("NOTIFY_SOCKET").as_deref(),
            var("WATCHDOG_USEC").as_deref(),
            var("WATCHDOG_PID").as_deref(),
            std::process::id(),
        )
    }

    /// From the variables' values; `pid` is this process's id. A value that makes no sense is
    /// logged and ignored: the agent runs without that notification rather than not at all.
    pub fn new(
        notify_socket: Option<&str>,
        watchdog_usec: Option<&str>,
        watchdog_pid: Option<&str>,
        pid: u32,
    ) -> Notifier {
        let Some(name) = notify_socket.filter(|s| !s.is_empty()) else {
            return Notifier::default();
        };
        let target =
            match socket_address(name).and_then(|addr| Ok((UnixDatagram::unbound()?, addr))) {
                Ok(target) => target,
                Err(e) => {
                    tracing::warn!("NOTIFY_SOCKET={name:?}: {e}; not notifying systemd");
                    return Notifier::default();
                }
            };
        // The watchdog is ours unless WATCHDOG_PID names another process (a child inherited
        // the variables).
        let ours = watchdog_pid.is_none_or(|p| p.trim() == pid.to_string());
        let watchdog = match watchdog_usec
            .filter(|_| ours)
            .map(|u| u.trim().parse::<u64>())
        {
            Some(Ok(usec)) if usec > 0 => Some(Duration::from_micros(usec / 2)),
            Some(_) => {
                tracing::warn!(
                    "WATCHDOG_USEC={watchdog_usec:?} is not a positive number; no watchdog pings"
                );
                None
            }
            None => None,
        };
        Notifier {
            target: Some(target),
            watchdog,
        }
    }

    /// How often to ping the watchdog (half its timeout), if systemd watches this process.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.watchdog
    }

    /// `READY=1`: the agent is up (its store open, its link started).
    pub fn ready(&self) {
        self.send("READY=1");
    }

    /// `WATCHDOG=1`: the main loop is alive.
    pub fn watchdog(&self) {
        if self.watchdog.is_some() {
            self.send("WATCHDOG=1");
        }
    }

    /// `STOPPING=1`: the agent is shutting down.
    pub fn stopping(&self) {
        self.send("STOPPING=1");
    }

    fn send(&self, message: &str) {
        if let Some((socket, addr)) = &self.target {
            if let Err(e) = socket.send_to_addr(message.as_bytes(), addr) {
                tracing::warn!("cannot notify systemd ({message}): {e}");
            }
        }
    }
}

/// `NOTIFY_SOCKET`'s value as an address: a path, or `@name` for an abstract socket.
fn socket_address(name: &str) -> std::io::Result<SocketAddr> {
    match name.strip_prefix('@') {
        Some(abstract_name) => {
            use std::os::linux::net::SocketAddrExt as _;
            SocketAddr::from_abstract_name(abstract_name.as_bytes())
        }
        None if name.starts_with('/') => SocketAddr::from_pathname(name),
        None => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "neither an absolute path nor an abstract name (@...)",
        )),
    }
}

/// The watchdog's interval as a tokio interval (a tick at once, then every interval); one that
/// never ticks without a watchdog. A loop that falls behind pings late, never in a burst.
pub fn watchdog_ticks(notifier: &Notifier) -> tokio::time::Interval {
    let every = notifier
        .watchdog_interval()
        .unwrap_or(Duration::from_secs(365 * 24 * 3600));
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener(dir: &std::path::Path) -> (UnixDatagram, String) {
        let path = dir.join("notify.sock");
        let socket = UnixDatagram::bind(&path).expect("bind the notify socket");
        socket
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("read timeout");
        (socket, path.to_string_lossy().into_owned())
    }

    fn receive(socket: &UnixDatagram) -> String {
        let mut buf = [0u8; 256];
        let n = socket.recv(&mut buf).expect("a notification");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn ready_watchdog_and_stopping_arrive_on_the_notify_socket() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (socket, path) = listener(dir.path());
        let notifier = Notifier::new(Some(&path), Some("30000000"), None, 7);
        assert_eq!(notifier.watchdog_interval(), Some(Duration::from_secs(15)));
        notifier.ready();
        assert_eq!(receive(&socket), "READY=1");
        notifier.watchdog();
        assert_eq!(receive(&socket), "WATCHDOG=1");
        notifier.stopping();
        assert_eq!(receive(&socket), "STOPPING=1");
    }

    #[test]
    fn an_abstract_socket_name_is_understood() {
        use std::os::linux::net::SocketAddrExt as _;
        let name = format!("flotilla-notify-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).expect("abstract name");
        let socket = UnixDatagram::bind_addr(&addr).expect("bind an abstract socket");
        socket
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("read timeout");
        Notifier::new(Some(&format!("@{name}")), None, None, 7).ready();
        assert_eq!(receive(&socket), "READY=1");
    }

    #[test]
    fn without_notify_socket_or_for_another_pid_there_is_no_watchdog() {
        assert_eq!(
            Notifier::new(None, Some("30000000"), None, 7).watchdog_interval(),
            None
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let (_socket, path) = listener(dir.path());
        let theirs = Notifier::new(Some(&path), Some("30000000"), Some("8"), 7);
        assert_eq!(theirs.watchdog_interval(), None);
        let bad = Notifier::new(Some(&path), Some("soon"), None, 7);
        assert_eq!(bad.watchdog_interval(), None);
        let relative = Notifier::new(Some("notify.sock"), Some("30000000"), None, 7);
        assert_eq!(
            relative.watchdog_interval(),
            None,
            "a relative path is refused"
        );
    }

    /// The ticks the agent loop pings at: virtual time, so no timing in the assertion.
    #[tokio::test(start_paused = true)]
    async fn watchdog_ticks_come_every_half_timeout() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (socket, path) = listener(dir.path());
        socket.set_nonblocking(true).expect("nonblocking");
        let notifier = Notifier::new(Some(&path), Some("4000000"), None, 7);
        let mut ticks = watchdog_ticks(&notifier);
        let start = tokio::time::Instant::now();
        let mut pings = Vec::new();
        while pings.len() < 3 {
            ticks.tick().await;
            notifier.watchdog();
            pings.push(start.elapsed());
        }
        assert_eq!(
            pings,
            [
                Duration::ZERO,
                Duration::from_secs(2),
                Duration::from_secs(4)
            ],
            "WATCHDOG_USEC=4s: a ping at once, then every 2 s"
        );
        for _ in 0..3 {
            let mut buf = [0u8; 32];
            let n = socket.recv(&mut buf).expect("a ping was sent");
            assert_eq!(&buf[..n], b"WATCHDOG=1");
        }
    }
}
