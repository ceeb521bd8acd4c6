//! A site broker bridged to a central one, as `deploy/mosquitto/site/` ships them, for the peer
//! tests and the peer benchmark.
//!
//! ```text
//!  coordinator ── central Mosquitto ◄══ bridge ══► site Mosquitto ── agents of the site
//!                 (any Site broker)     state/report/fetch out,      (log in with their id,
//!                                       desired/block in             the shipped site ACL)
//! ```
//!
//! [`SiteBroker::start`] renders the shipped `site.conf`, `bridge.conf` and `acl` with free ports
//! and temporary paths (plain TCP on loopback instead of TLS; everything else as shipped) and
//! fails the test if a line it rewrites is no longer in the shipped file, so the test keeps
//! exercising what operators install. [`SiteBroker::wait_bridged`] waits for the bridge's link
//! state on the central broker; [`traffic`] sums what crossed the bridge by topic leaf, from a
//! [`Watcher`] on the central broker that sees every device topic the bridge carries.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::secure::{deploy_dir, main_with_paths, DEBIAN_MAIN_CONF, TEST_LINES};
use crate::site::{AgentBroker, Process, SHIPPED_BROKER_TUNING};
use crate::{free_port, mosquitto_binary, WatchedMessage, Watcher, WAIT};

/// The site name the shipped bridge config uses.
pub const SITE: &str = "harbour";
/// The bridge's user on the central broker (the shipped central ACL names it).
pub const BRIDGE_USER: &str = "flotilla-site-harbour";
/// The site broker's read-only monitoring login.
pub const MONITOR: &str = "flotilla-site-monitor";
/// Where the bridge publishes its link state ("1" up, "0" down).
pub const BRIDGE_STATE_TOPIC: &str = "flotilla/v1/sites/harbour/bridge";

/// How the shipped site configuration is put together (`deploy/mosquitto/site/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SiteLayout {
    /// `site.conf` and `bridge.conf` in one file as the whole config, persistence off: what
    /// the peer tests use.
    Alone,
    /// Debian's stock main file with `site.conf` and `bridge.conf` as the drop-ins
    /// `conf.d/flotilla-site.conf` and `conf.d/flotilla-site-bridge.conf`, persistence on: the
    /// install docs/peers.md describes.
    DebianMain,
}

/// A Mosquitto process configured as a site broker, bridged to a central broker.
pub struct SiteBroker {
    pub port: u16,
    pub dir: PathBuf,
    process: Process,
}

impl Drop for SiteBroker {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Ok(text) = fs::read_to_string(&self.process.log) {
                let tail: Vec<&str> = text.lines().rev().take(30).collect();
                eprintln!("---- site broker log (last {} lines)", tail.len());
                for line in tail.iter().rev() {
                    eprintln!("{line}");
                }
            }
        }
        self.process.kill();
    }
}

impl SiteBroker {
    /// Starts a site broker in `dir` on a free port, bridged to the central broker on
    /// `central_port` (logging in as [`BRIDGE_USER`] with `bridge_password`), with a password
    /// for every device in `devices` and for [`MONITOR`].
    pub fn start(
        dir: &Path,
        central_port: u16,
        bridge_password: &str,
        devices: &[String],
    ) -> SiteBroker {
        SiteBroker::start_as(
            dir,
            central_port,
            bridge_password,
            devices,
            SiteLayout::Alone,
        )
    }

    /// [`SiteBroker::start`] with the configuration laid out as `layout` says.
    pub fn start_as(
        dir: &Path,
        central_port: u16,
        bridge_password: &str,
        devices: &[String],
        layout: SiteLayout,
    ) -> SiteBroker {
        let binary = mosquitto_binary().expect("mosquitto binary");
        fs::create_dir_all(dir.join("passwords")).expect("site broker directory");
        let mut users: Vec<&str> = devices.iter().map(String::as_str).collect();
        users.push(MONITOR);
        write_password_file(
            &dir.join("mosquitto.passwd"),
            &dir.join("passwords"),
            &users,
        );
        let port = free_port();
        let site = render_site(dir, port, layout == SiteLayout::DebianMain);
        let bridge = render_bridge(central_port, bridge_password);
        let path = dir.join("site.conf");
        match layout {
            SiteLayout::Alone => {
                let config = format!("{site}log_dest stderr\n{bridge}");
                fs::write(&path, config).expect("write site broker config");
            }
            SiteLayout::DebianMain => {
                let conf_d = dir.join("conf.d");
                let db = dir.join("db");
                fs::create_dir_all(&conf_d).expect("conf.d");
                fs::create_dir_all(&db).expect("persistence directory");
                let mut main = main_with_paths(DEBIAN_MAIN_CONF, dir, &conf_d, &db);
                main.push_str(TEST_LINES);
                fs::write(&path, main).expect("write the main mosquitto.conf");
                fs::write(conf_d.join("flotilla-site.conf"), site).expect("write the site drop-in");
                fs::write(conf_d.join("flotilla-site-bridge.conf"), bridge)
                    .expect("write the bridge drop-in");
            }
        }
        let mut command = Command::new(binary);
        command.arg("-c").arg(&path);
        let process = Process::spawn(command, dir.join("site-broker.log"));
        wait_listening(port);
        SiteBroker {
            port,
            dir: dir.to_owned(),
            process,
        }
    }

    /// Where the broker keeps its persistence file (`mosquitto.db`) under a main file.
    pub fn persistence_dir(&self) -> PathBuf {
        self.dir.join("db")
    }

    /// Stops the broker with SIGTERM (it then saves its persistence file); whether it exited.
    pub fn stop(&mut self) -> bool {
        self.process.terminate(Duration::from_secs(10)).is_some()
    }

    /// How agents of the site log in ([`crate::Site::agent_broker`]).
    pub fn agent_broker(&self) -> AgentBroker {
        AgentBroker {
            port: self.port,
            password_dir: self.dir.join("passwords"),
        }
    }

    /// A login to the site broker as `user` (a device of the site, or [`MONITOR`]).
    pub fn login(&self, user: &str) -> flotilla_mqtt::Connection {
        login(self.port, user, &self.dir.join("passwords").join(user))
    }

    /// Waits until the bridge reports its link up on the central broker.
    pub async fn wait_bridged(&self, central: flotilla_mqtt::Connection) {
        let watcher = Watcher::connect(central, &[BRIDGE_STATE_TOPIC.to_owned()]).await;
        let deadline = Instant::now() + WAIT;
        loop {
            let up = watcher
                .messages()
                .iter()
                .rev()
                .find(|m| m.topic == BRIDGE_STATE_TOPIC)
                .is_some_and(|m| m.payload == b"1");
            if up {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the bridge of the site broker on port {} did not come up",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A login on the loopback broker at `port` with the password in `password_file`.
pub fn login(port: u16, user: &str, password_file: &Path) -> flotilla_mqtt::Connection {
    flotilla_mqtt::ConnectionSpec {
        username: Some(user.to_owned()),
        password_file: Some(password_file.to_owned()),
        ..flotilla_mqtt::ConnectionSpec::plain("127.0.0.1", port)
    }
    .validate(Path::new("/"), &|_| None)
    .expect("valid login")
}

/// A central broker as `deploy/mosquitto/` ships its access rules: no anonymous logins, the
/// shipped ACL, a password for each of `users`, client ids replaced by user names (plain TCP on
/// loopback instead of TLS).
pub struct CentralBroker {
    pub port: u16,
    pub dir: PathBuf,
    process: Process,
}

impl Drop for CentralBroker {
    fn drop(&mut self) {
        self.process.kill();
    }
}

impl CentralBroker {
    pub fn start(dir: &Path, users: &[&str]) -> CentralBroker {
        let binary = mosquitto_binary().expect("mosquitto binary");
        fs::create_dir_all(dir.join("passwords")).expect("central broker directory");
        write_password_file(&dir.join("mosquitto.passwd"), &dir.join("passwords"), users);
        let port = free_port();
        let acl = deploy_dir()
            .join("acl")
            .canonicalize()
            .expect("the shipped ACL");
        // The shipped listeners' client-id rule, read from the shipped file: what it says about
        // client ids is what this broker does.
        let shipped = fs::read_to_string(deploy_dir().join("mosquitto.conf"))
            .expect("read the shipped mosquitto.conf");
        let client_ids = shipped
            .lines()
            .find(|l| l.starts_with("use_username_as_clientid "))
            .expect("the shipped mosquitto.conf sets use_username_as_clientid");
        let config = format!(
            "listener {port} 127.0.0.1\n{client_ids}\nallow_anonymous false\npassword_file {}\n\
             acl_file {}\npersistence false\nlog_dest stderr\nmax_packet_size {}\n\
             {SHIPPED_BROKER_TUNING}",
            dir.join("mosquitto.passwd").display(),
            acl.display(),
            flotilla_protocol::BROKER_PACKET_LIMIT,
        );
        let path = dir.join("central.conf");
        fs::write(&path, config).expect("write central broker config");
        let mut command = Command::new(binary);
        command.arg("-c").arg(&path);
        let process = Process::spawn(command, dir.join("central-broker.log"));
        wait_listening(port);
        CentralBroker {
            port,
            dir: dir.to_owned(),
            process,
        }
    }

    /// The password of `user` (as written to the password file).
    pub fn password(&self, user: &str) -> String {
        fs::read_to_string(self.dir.join("passwords").join(user)).expect("password")
    }

    pub fn login(&self, user: &str) -> flotilla_mqtt::Connection {
        login(self.port, user, &self.dir.join("passwords").join(user))
    }
}

/// Payload bytes of the messages seen on the central broker, by topic leaf (`state`, `block`,
/// `peer-fetch`...): with a [`Watcher`] on `flotilla/v1/devices/#` of the central broker, what
/// crossed the bridge in either direction.
pub fn traffic(messages: &[WatchedMessage]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for m in messages {
        let leaf = m.topic.split('/').nth(4).unwrap_or("(other)").to_owned();
        *out.entry(leaf).or_insert(0) += m.payload.len() as u64;
    }
    out
}

/// Writes a Mosquitto password file with a password for every user, and each password in
/// `{dir}/{user}` for the clients.
fn write_password_file(file: &Path, dir: &Path, users: &[&str]) {
    let _ = fs::remove_file(file);
    fs::write(file, "").expect("create password file");
    for user in users {
        let password = format!("pw-{user}-{}", free_port());
        fs::write(dir.join(user), &password).expect("write password");
        let status = Command::new("mosquitto_passwd")
            .arg("-b")
            .arg(file)
            .args([*user, &password])
            .status()
            .expect("mosquitto_passwd (from the mosquitto package) must be installed");
        assert!(status.success(), "mosquitto_passwd failed for {user}");
        // The coordinator's control connection logs in with its password (decision 0066).
        if *user == crate::secure::COORDINATOR {
            let status = Command::new("mosquitto_passwd")
                .arg("-b")
                .arg(file)
                .args([crate::secure::COORDINATOR_CONTROL, &password])
                .status()
                .expect("mosquitto_passwd");
            assert!(
                status.success(),
                "mosquitto_passwd failed for the control login"
            );
        }
    }
}

fn wait_listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "mosquitto did not listen on {port} within 10s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Replaces the line starting with `prefix` (which must be there) by `with` (none: drops it).
fn rewrite(text: &mut Vec<String>, file: &str, prefix: &str, with: Option<String>) {
    let at = text
        .iter()
        .position(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("the shipped {file} has no line starting with {prefix:?}"));
    match with {
        Some(line) => text[at] = line,
        None => {
            text.remove(at);
        }
    }
}

fn lines(file: &str) -> Vec<String> {
    fs::read_to_string(deploy_dir().join("site").join(file))
        .unwrap_or_else(|e| panic!("read the shipped deploy/mosquitto/site/{file}: {e}"))
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The shipped `site.conf` for a loopback port and temporary paths (plain TCP instead of TLS),
/// persistence off unless `persist` (where the main file says).
fn render_site(dir: &Path, port: u16, persist: bool) -> String {
    let acl = deploy_dir()
        .join("site/acl")
        .canonicalize()
        .expect("the shipped site ACL");
    let mut site = lines("site.conf");
    let file = "site.conf";
    assert!(
        !site.iter().any(|l| l.starts_with("persistence_location")),
        "site.conf must not set persistence_location: Debian's main file does, and Mosquitto \
         2.0.11 refuses a second one"
    );
    assert!(
        !site.iter().any(|l| l.starts_with("include_dir")),
        "site.conf must not use include_dir: Mosquitto ignores it in a drop-in"
    );
    rewrite(
        &mut site,
        file,
        "password_file ",
        Some(format!(
            "password_file {}",
            dir.join("mosquitto.passwd").display()
        )),
    );
    rewrite(
        &mut site,
        file,
        "acl_file ",
        Some(format!("acl_file {}", acl.display())),
    );
    if !persist {
        rewrite(
            &mut site,
            file,
            "persistence true",
            Some("persistence false".into()),
        );
    }
    rewrite(
        &mut site,
        file,
        "listener 8883",
        Some(format!("listener {port} 127.0.0.1")),
    );
    for tls in ["cafile ", "certfile ", "keyfile ", "tls_version "] {
        rewrite(&mut site, file, tls, None);
    }
    site.join("\n") + "\n"
}

/// The shipped `bridge.conf` to the central broker on a loopback port (plain TCP).
fn render_bridge(central_port: u16, bridge_password: &str) -> String {
    let mut bridge = lines("bridge.conf");
    let file = "bridge.conf";
    rewrite(
        &mut bridge,
        file,
        "address ",
        Some(format!("address 127.0.0.1:{central_port}")),
    );
    rewrite(
        &mut bridge,
        file,
        "remote_password ",
        Some(format!("remote_password {bridge_password}")),
    );
    rewrite(&mut bridge, file, "bridge_cafile ", None);
    // Reconnect quickly in tests; the shipped backoff is for a WAN link.
    rewrite(
        &mut bridge,
        file,
        "restart_timeout ",
        Some("restart_timeout 1 2".into()),
    );
    bridge.join("\n") + "\n"
}
