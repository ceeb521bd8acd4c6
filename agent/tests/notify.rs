//! The agent binary under a systemd `Type=notify` unit with `WatchdogSec`, as systemd would
//! start it: `NOTIFY_SOCKET` names a datagram socket (here one in a temporary directory) and
//! `WATCHDOG_USEC` the watchdog's timeout. The agent says `READY=1` once it runs, pings
//! `WATCHDOG=1` from its loop while it waits for a broker that is not there, and says
//! `STOPPING=1` on SIGTERM. No broker is needed.

mod common;

use std::os::unix::net::UnixDatagram;
use std::process::Stdio;
use std::time::Duration;

use common::{config_text, free_port};

fn receive(socket: &UnixDatagram) -> String {
    let mut buf = [0u8; 256];
    let n = socket
        .recv(&mut buf)
        .expect("a notification from the agent within 30 s");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[test]
fn the_agent_notifies_systemd_that_it_is_ready_pings_the_watchdog_and_says_it_stops() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket_path = dir.path().join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).expect("bind the notify socket");
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    let config = dir.path().join("agent.toml");
    // Nothing listens on the port: the agent runs, retrying its broker.
    std::fs::write(
        &config,
        config_text(free_port(), dir.path(), "notify-1", ""),
    )
    .expect("config");
    let mut agent = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla-agent"))
        .args(["run", "--config"])
        .arg(&config)
        .env("NOTIFY_SOCKET", &socket_path)
        // 0.2 s: a ping every 0.1 s.
        .env("WATCHDOG_USEC", "200000")
        .env_remove("WATCHDOG_PID")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the agent");

    assert_eq!(receive(&socket), "READY=1", "readiness comes first");
    for _ in 0..3 {
        assert_eq!(receive(&socket), "WATCHDOG=1", "the loop keeps pinging");
    }
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &agent.id().to_string()])
        .status();
    let mut seen = Vec::new();
    loop {
        let message = receive(&socket);
        if message == "STOPPING=1" {
            break;
        }
        assert_eq!(
            message, "WATCHDOG=1",
            "only pings until it stops; got {seen:?}"
        );
        seen.push(message);
    }
    let status = agent.wait().expect("the agent exits");
    assert!(status.success(), "the agent stopped cleanly: {status}");
}
