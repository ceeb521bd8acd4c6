//! # flotilla-tests
//!
//! The shared harness for flotilla's end-to-end tests: real brokers on free ports (the embedded
//! rumqttd, and Mosquitto when its binary is installed), a real `flotilla serve` process and real
//! `flotilla-agent` processes, each with its own temporary data directory and log file.
//!
//! ```no_run
//! # async fn demo() {
//! use flotilla_tests::{BrokerKind, Site, AgentOptions};
//! let mut site = Site::new(BrokerKind::Embedded);
//! site.release("fw-1", 1, b"new firmware");
//! site.start_coordinator();
//! site.add_agent("dev-1", &[("env", "prod")], AgentOptions::default());
//! site.wait_devices(1).await;
//! # }
//! ```
//!
//! Every agent of a site enrolls with its own one-time token from the coordinator's config, so
//! tests see accepted devices as before; `AgentOptions { enroll: false, .. }` leaves a device
//! pending, and [`Site::authorize_key`] pre-authorizes one's key instead.
//!
//! Nothing here depends on a fixed port or on services already running on the machine. When a
//! test panics, the harness prints the tail of every process's log.

pub mod bridge;
pub mod coordinators;
pub mod disk;
pub mod mqtt;
pub mod nats;
pub mod origin;
pub mod postgres;
pub mod rauc;
pub mod secure;
pub mod site;
mod site_waits;
pub mod swu;
pub mod tcp_proxy;
pub mod webdriver;

pub use disk::Tmpfs;
pub use mqtt::{WatchedMessage, Watcher};
pub use secure::{Connected, Probe, SecureBroker};
pub use site::{AgentBroker, AgentOptions, BrokerKind, Site, ADMIN};

use std::path::PathBuf;
use std::time::Duration;

/// A generous bound for anything a test waits for; tests fail with a message when it passes.
pub const WAIT: Duration = Duration::from_secs(60);

/// A free TCP port on the loopback interface, for a broker or server a test starts.
///
/// The port is free when this returns, but the listener that proves it is closed again, so
/// something else could take it before the test's server binds. Two things make that unlikely:
/// ports come from below the kernel's ephemeral range (32768 and up), where no outgoing
/// connection of a concurrent test is given its local port, and no port is handed out twice in
/// one test process (the tests of one binary run in parallel threads).
pub fn free_port() -> u16 {
    use std::collections::HashSet;
    use std::sync::Mutex;
    static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    const FIRST: u32 = 20_000;
    const COUNT: u32 = 12_000;
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let handed_out = handed_out.get_or_insert_with(HashSet::new);
    // A different walk per process, so parallel test binaries do not try the same ports in turn.
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
        ^ std::process::id().wrapping_mul(2_654_435_761);
    for i in 0..COUNT {
        let port = (FIRST + (seed.wrapping_add(i.wrapping_mul(7_919))) % COUNT) as u16;
        if handed_out.contains(&port) {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            handed_out.insert(port);
            return port;
        }
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address").port()
}

/// The path of a workspace binary (`flotilla`, `flotilla-agent`), next to the test executable's
/// target directory. `cargo test --workspace` builds them before running the tests.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current test executable");
    // target/<profile>/deps/e2e-<hash> -> target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target directory");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} not found; build the workspace binaries first (cargo build --workspace --bins)",
        path.display()
    );
    path
}

/// The Mosquitto broker binary, if installed (Debian puts it in /usr/sbin, often not on PATH).
pub fn mosquitto_binary() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(["/usr/sbin", "/usr/local/sbin"].map(PathBuf::from));
    dirs.into_iter()
        .map(|d| d.join("mosquitto"))
        .find(|p| p.is_file())
}

/// Seconds since the Unix epoch, as devices stamp their states.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The `n`th of a family of device keys, distinct per `family`, the same in every run.
pub fn numbered_key(family: u8, n: u32) -> flotilla_protocol::SigningKey {
    let mut seed = [family; 32];
    seed[..4].copy_from_slice(&n.to_le_bytes());
    flotilla_protocol::SigningKey::from_bytes(&seed)
}

/// An authorized-keys file's text for devices `0..count`: device `n` is `id(n)` with the key
/// `key_of(n)`, one `<public key hex> <id>` line each.
pub fn authorized_keys(
    count: u32,
    key_of: impl Fn(u32) -> flotilla_protocol::SigningKey,
    id: impl Fn(u32) -> String,
) -> String {
    (0..count)
        .map(|n| {
            let public = flotilla_protocol::hex::encode(key_of(n).verifying_key().as_bytes());
            format!("{public} {}\n", id(n))
        })
        .collect()
}

/// The text a coordinator's metrics endpoint on `port` answers `GET /metrics` with (headers
/// included).
pub async fn scrape_metrics(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the metrics port");
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: coordinator\r\n\r\n")
        .await
        .expect("send");
    let mut answer = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut answer))
        .await
        .expect("answered")
        .expect("read");
    String::from_utf8(answer).expect("text")
}

/// Whether a test that needs Mosquitto itself can run: CI (`FLOTILLA_REQUIRE_TOOLS`, set by
/// `.ci/run`, which installs it) fails instead of skipping; elsewhere the skip is loud.
pub fn require_mosquitto(test: &str) -> bool {
    if mosquitto_binary().is_some() {
        return true;
    }
    if std::env::var_os("FLOTILLA_REQUIRE_TOOLS").is_some() || std::env::var_os("CI").is_some() {
        panic!("{test}: mosquitto is not installed; .ci/run must install it");
    }
    eprintln!("SKIPPED {test}: mosquitto is not installed");
    false
}

/// Every broker kind the tests can run against on this machine. CI installs Mosquitto, so a
/// missing binary there is an error rather than a silent skip.
pub fn broker_kinds() -> Vec<BrokerKind> {
    let mut kinds = vec![BrokerKind::Embedded];
    if mosquitto_binary().is_some() {
        kinds.push(BrokerKind::Mosquitto);
    } else if std::env::var_os("CI").is_some() {
        panic!("mosquitto is not installed; .ci/run must install it");
    } else {
        eprintln!("note: mosquitto not installed, testing against the embedded broker only");
    }
    kinds
}

/// Waits until no other test on this machine holds the lock `name` (a file in the temporary
/// directory), and keeps it until the returned file is dropped: for what one machine can run
/// only once at a time (SWUpdate's abstract socket, a NATS cluster's CPU).
pub fn machine_lock(name: &str) -> std::fs::File {
    let path = std::env::temp_dir().join(format!("flotilla-{name}.lock"));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("the lock file {}: {e}", path.display()));
    file.lock()
        .unwrap_or_else(|e| panic!("lock {}: {e}", path.display()));
    file
}
