//! NATS's MQTT listener as a site's broker (Debian's `nats-server`): one node, JetStream for
//! retained messages and sessions, anonymous clients on loopback. It speaks MQTT 3.1.1 only,
//! so MQTT 5's Maximum Packet Size cannot protect a client here, and it delivers messages up to
//! its `max_payload`, set well above what flotilla's clients read.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::free_port;
use crate::site::Process;

/// The largest message this broker takes, in bytes (NATS's `max_payload`; its default is 1 MiB).
pub const MAX_PAYLOAD: usize = 8 << 20;

/// The `nats-server` binary, if installed (Debian puts it in /usr/sbin).
pub fn binary() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(["/usr/sbin", "/usr/local/sbin", "/usr/local/bin"].map(PathBuf::from));
    dirs.into_iter()
        .map(|d| d.join("nats-server"))
        .find(|p| p.is_file())
}

/// Starts `nats-server` in `dir` with its MQTT listener on `mqtt_port` (and its own NATS port,
/// unused by the tests), and waits until the MQTT port takes connections.
pub(crate) fn start(dir: &Path, mqtt_port: u16) -> Process {
    let binary = binary()
        .expect("nats-server is not installed; .ci/run installs it (apt-get install nats-server)");
    let config = dir.join("nats.conf");
    fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:{}\nserver_name: flotilla-test-{mqtt_port}\nmax_payload: {MAX_PAYLOAD}\n\
             jetstream {{ store_dir: {:?} }}\nmqtt {{ listen: 127.0.0.1:{mqtt_port} }}\n",
            free_port(),
            dir.join("jetstream").display().to_string(),
        ),
    )
    .expect("write nats.conf");
    let mut command = Command::new(binary);
    command.arg("-c").arg(&config);
    let process = Process::spawn(command, dir.join("nats.log"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", mqtt_port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "nats-server did not listen for MQTT on {mqtt_port} within 20s: {}",
            fs::read_to_string(&process.log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    process
}
