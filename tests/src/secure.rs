//! A Mosquitto broker set up the way `deploy/mosquitto/` ships it: TLS only, no anonymous
//! clients, a password file, client certificates on a second listener, and the shipped ACL file
//! itself (not a copy of it). Certificates come from the shipped `make-certs.sh` (openssl CLI),
//! passwords from `mosquitto_passwd`. A missing tool fails the test with a message that says
//! what to install; nothing is skipped.
//!
//! Also: [`Probe`], a bare MQTT client that says what the broker answered (ConnAck, SubAck), so
//! tests can check what a role may do.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use flotilla_mqtt::{Connection, ConnectionSpec, RawTls};
use rumqttc::{AsyncClient, ConnectReturnCode, Event, Packet, QoS, SubscribeReasonCode};

use crate::site::Process;
use crate::{free_port, mosquitto_binary};

/// The broker's user names for the roles of the shipped ACL.
pub const COORDINATOR: &str = "flotilla-coordinator";
/// The coordinator's control connection (decision 0066): its login is the coordinator's with
/// this suffix, with the coordinator's password.
pub const COORDINATOR_CONTROL: &str = "flotilla-coordinator-control";
pub const OPERATOR: &str = "flotilla-operator";
pub const OBSERVER: &str = "flotilla-observer";
/// Reads every flotilla topic, writes nothing: what tests watch with, since the broker keeps
/// one connection per login and a second coordinator login would knock the coordinator off.
pub const MONITOR: &str = "flotilla-monitor";

/// The repository's `deploy/mosquitto` directory.
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/mosquitto")
}

fn run(program: &str, args: &[&str], what: &str) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {program} ({e}); .ci/run installs it"));
    assert!(
        out.status.success(),
        "{what}: {program} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// How the shipped configuration is put together (`deploy/mosquitto/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// The drop-in alone as the whole config, persistence off: what most tests use.
    DropInAlone,
    /// Debian's stock main `/etc/mosquitto/mosquitto.conf` ([`DEBIAN_MAIN_CONF`]) with the
    /// drop-in in its `include_dir`, persistence on: the README's install on a stock Debian.
    DebianMain,
    /// The shipped whole config `main.conf` with the drop-in in its `include_dir`.
    ShippedMain,
}

/// `/etc/mosquitto/mosquitto.conf` as Debian's mosquitto package (2.0.11-1.2+deb12u2, the
/// same in 2.0.11-1.2 and bullseye's 2.0.11-1) ships it, byte for byte.
pub const DEBIAN_MAIN_CONF: &str = "\
# Place your local configuration in /etc/mosquitto/conf.d/
#
# A full description of the configuration file is at
# /usr/share/doc/mosquitto/examples/mosquitto.conf.example

pid_file /run/mosquitto/mosquitto.pid

persistence true
persistence_location /var/lib/mosquitto/

log_dest file /var/log/mosquitto/mosquitto.log

include_dir /etc/mosquitto/conf.d
";

/// A running TLS Mosquitto with the shipped configuration.
pub struct SecureBroker {
    dir: PathBuf,
    /// The CA's own directory (ca.key stays here; the broker's files are in `dir/tls`).
    ca_dir: PathBuf,
    /// TLS with user name and password.
    pub tls_port: u16,
    /// Mutual TLS: the client certificate's common name is the user name.
    pub mtls_port: u16,
    process: Process,
}

impl Drop for SecureBroker {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Ok(log) = fs::read_to_string(&self.process.log) {
                let tail: Vec<&str> = log.lines().rev().take(30).collect();
                eprintln!("---- mosquitto (last {} lines)", tail.len());
                for line in tail.iter().rev() {
                    eprintln!("{line}");
                }
            }
        }
        self.process.kill();
    }
}

impl SecureBroker {
    /// Starts a broker in `dir`, with passwords for the roles and for `devices`.
    pub fn start(dir: &Path, devices: &[&str]) -> SecureBroker {
        SecureBroker::start_as(dir, devices, Layout::DropInAlone)
    }

    /// Starts a broker in `dir` with its configuration laid out as `layout` says.
    pub fn start_as(dir: &Path, devices: &[&str], layout: Layout) -> SecureBroker {
        let binary = mosquitto_binary()
            .expect("mosquitto is not installed; .ci/run installs it (apt-get install mosquitto)");
        let ca_dir = dir.join("ca");
        let dir = dir.join("broker");
        let tls = dir.join("tls");
        let script = deploy_dir().join("make-certs.sh");
        let script = script.to_string_lossy();
        let (tls_s, ca_s) = (tls.to_string_lossy(), ca_dir.to_string_lossy());
        run("sh", &[&script, &ca_s, "ca"], "make the CA");
        // Signed from the CA's directory into the broker's: the broker never holds ca.key.
        run(
            "sh",
            &[
                &script,
                "--out",
                &tls_s,
                &ca_s,
                "server",
                "broker",
                "DNS:localhost",
                "IP:127.0.0.1",
            ],
            "make the broker certificate",
        );
        assert!(
            tls.join("ca.crt").exists() && !tls.join("ca.key").exists(),
            "make-certs.sh --out gives the broker the CA certificate and never its key"
        );
        let passwords = dir.join("passwords");
        fs::write(&passwords, "").expect("password file");
        let secrets = dir.join("secrets");
        fs::create_dir_all(&secrets).expect("secrets directory");
        for user in [COORDINATOR, OPERATOR, OBSERVER, MONITOR]
            .iter()
            .chain(devices)
        {
            let password = format!("pw-{user}-{}", free_port());
            fs::write(secrets.join(format!("{user}.password")), &password).expect("password");
            run(
                "mosquitto_passwd",
                &["-b", &passwords.to_string_lossy(), user, &password],
                "add a broker user",
            );
            // As docs/operations.md says: the control connection's login, the same password.
            if *user == COORDINATOR {
                run(
                    "mosquitto_passwd",
                    &[
                        "-b",
                        &passwords.to_string_lossy(),
                        COORDINATOR_CONTROL,
                        &password,
                    ],
                    "add the coordinator's control login",
                );
            }
        }
        let (tls_port, mtls_port) = (free_port(), free_port());
        let config_path = dir.join("mosquitto.conf");
        match layout {
            Layout::DropInAlone => {
                let mut config = drop_in(&dir, tls_port, mtls_port, false);
                config.push_str(TEST_LINES);
                fs::write(&config_path, config).expect("write mosquitto.conf");
            }
            Layout::DebianMain | Layout::ShippedMain => {
                let main = match layout {
                    Layout::DebianMain => DEBIAN_MAIN_CONF.to_owned(),
                    _ => fs::read_to_string(deploy_dir().join("main.conf"))
                        .expect("read the shipped main.conf"),
                };
                let conf_d = dir.join("conf.d");
                let db = dir.join("db");
                fs::create_dir_all(&conf_d).expect("conf.d");
                fs::create_dir_all(&db).expect("persistence directory");
                let mut main = main_with_paths(&main, &dir, &conf_d, &db);
                main.push_str(TEST_LINES);
                fs::write(&config_path, main).expect("write the main mosquitto.conf");
                fs::write(
                    conf_d.join("flotilla.conf"),
                    drop_in(&dir, tls_port, mtls_port, true),
                )
                .expect("write conf.d/flotilla.conf");
            }
        }
        let mut command = Command::new(binary);
        command.arg("-c").arg(&config_path);
        let process = Process::spawn(command, dir.join("mosquitto.log"));
        let deadline = Instant::now() + Duration::from_secs(10);
        for port in [tls_port, mtls_port] {
            while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
                assert!(
                    Instant::now() < deadline,
                    "mosquitto did not listen on {port} within 10s: {}",
                    fs::read_to_string(&process.log).unwrap_or_default()
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        SecureBroker {
            dir,
            ca_dir,
            tls_port,
            mtls_port,
            process,
        }
    }

    /// Removes `user` from the password file and has the broker read it again (SIGHUP), as an
    /// operator would: from then on that login is refused.
    pub fn remove_login(&self, user: &str) {
        let passwords = self.dir.join("passwords");
        run(
            "mosquitto_passwd",
            &["-D", &passwords.to_string_lossy(), user],
            "remove a broker user",
        );
        run(
            "kill",
            &["-HUP", &self.process.id().to_string()],
            "have the broker reload its password file",
        );
    }

    /// Whether `user` with `password` gets in (a one-off `mosquitto_pub` over TLS).
    pub fn logs_in(&self, user: &str, password: &str) -> bool {
        Command::new("mosquitto_pub")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.tls_port.to_string(),
                "--cafile",
            ])
            .arg(self.ca_file())
            .args([
                "-u",
                user,
                "-P",
                password,
                "-i",
                user,
                "-t",
                "flotilla/v1/probe",
            ])
            .args(["-m", "x", "-q", "1"])
            .output()
            .map(|out| out.status.success())
            .unwrap_or(false)
    }

    /// What the broker logged so far (its connections and the ones it closed).
    pub fn log(&self) -> String {
        fs::read_to_string(&self.process.log).unwrap_or_default()
    }

    /// Where the broker keeps its persistence file (`mosquitto.db`) with a main file.
    pub fn persistence_dir(&self) -> PathBuf {
        self.dir.join("db")
    }

    /// Stops the broker with SIGTERM (it then saves its persistence file); whether it exited.
    pub fn stop(&mut self) -> bool {
        self.process.terminate(Duration::from_secs(10)).is_some()
    }

    /// The CA certificate clients check the broker against.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("tls/ca.crt")
    }

    /// The file holding `user`'s password.
    pub fn password_file(&self, user: &str) -> PathBuf {
        self.dir.join(format!("secrets/{user}.password"))
    }

    /// A client certificate and key with common name `name`, made on first use.
    pub fn client_cert(&self, name: &str) -> (PathBuf, PathBuf) {
        let (cert, key) = (
            self.dir.join(format!("tls/{name}.crt")),
            self.dir.join(format!("tls/{name}.key")),
        );
        if !cert.exists() {
            let script = deploy_dir().join("make-certs.sh");
            run(
                "sh",
                &[
                    &script.to_string_lossy(),
                    "--out",
                    &self.dir.join("tls").to_string_lossy(),
                    &self.ca_dir.to_string_lossy(),
                    "client",
                    name,
                ],
                "make a client certificate",
            );
        }
        (cert, key)
    }

    /// TLS with `user`'s password, on the password listener.
    pub fn login(&self, user: &str) -> Connection {
        self.spec(self.tls_port, Some(user), None)
            .validate(Path::new("/"), &|_| None)
            .expect("valid login")
    }

    /// TLS with a client certificate for `name` and no password, on the mutual-TLS listener.
    pub fn cert_login(&self, name: &str) -> Connection {
        let cert = self.client_cert(name);
        self.spec(self.mtls_port, None, Some(cert))
            .validate(Path::new("/"), &|_| None)
            .expect("valid certificate login")
    }

    /// TLS without credentials, on the password listener.
    pub fn anonymous(&self) -> Connection {
        self.spec(self.tls_port, None, None)
            .validate(Path::new("/"), &|_| None)
            .expect("valid TLS settings")
    }

    fn spec(
        &self,
        port: u16,
        user: Option<&str>,
        cert: Option<(PathBuf, PathBuf)>,
    ) -> ConnectionSpec {
        ConnectionSpec {
            alternates: Vec::new(),
            order: Default::default(),
            host: "127.0.0.1".into(),
            port,
            username: user.map(str::to_owned),
            password_file: user.map(|u| self.password_file(u)),
            password_env: None,
            tls: Some(RawTls {
                ca_file: Some(self.ca_file()),
                client_cert: cert.as_ref().map(|c| c.0.clone()),
                client_key: cert.map(|c| c.1),
            }),
        }
    }
}

/// What every test broker adds: run as whoever runs the tests (mosquitto started as root
/// switches to the mosquitto user, who cannot read a test's temporary files), log to stderr.
pub const TEST_LINES: &str =
    "\nuser root\nlog_dest stderr\nlog_type error\nlog_type warning\nlog_type notice\n";

/// The shipped drop-in `deploy/mosquitto/mosquitto.conf` with this broker's paths and free
/// loopback ports, persistence off unless `persist`. Every edit must apply, so a change to the
/// shipped file that the tests no longer cover fails here.
fn drop_in(dir: &Path, tls_port: u16, mtls_port: u16, persist: bool) -> String {
    let shipped =
        fs::read_to_string(deploy_dir().join("mosquitto.conf")).expect("read the shipped config");
    assert!(
        !shipped.contains("\npersistence_location"),
        "the drop-in must not set persistence_location: Debian's main file does, and \
         Mosquitto 2.0.11 refuses a second one"
    );
    let acl = deploy_dir().join("acl");
    let acl = acl.canonicalize().expect("the shipped ACL file");
    let mut edits = vec![
        (
            "acl_file /etc/mosquitto/flotilla/acl".to_owned(),
            format!("acl_file {}", acl.display()),
        ),
        (
            "/etc/mosquitto/flotilla/".to_owned(),
            format!("{}/", dir.display()),
        ),
        (
            "listener 8883\n".to_owned(),
            format!("listener {tls_port} 127.0.0.1\n"),
        ),
        (
            "listener 8884\n".to_owned(),
            format!("listener {mtls_port} 127.0.0.1\n"),
        ),
    ];
    if !persist {
        edits.push((
            "persistence true".to_owned(),
            "persistence false".to_owned(),
        ));
    }
    let mut config = shipped;
    for (from, to) in edits {
        assert!(
            config.contains(&from),
            "deploy/mosquitto/mosquitto.conf no longer has {from:?}; update tests/src/secure.rs"
        );
        config = config.replace(&from, &to);
    }
    config
}

/// A main file (Debian's or the shipped `main.conf`) with its host paths moved into `dir`.
/// Every path must be there to move, so a main file that sets something else fails here.
pub fn main_with_paths(main: &str, dir: &Path, conf_d: &Path, db: &Path) -> String {
    let edits = [
        (
            "pid_file /run/mosquitto/mosquitto.pid",
            format!("pid_file {}", dir.join("mosquitto.pid").display()),
        ),
        (
            "persistence_location /var/lib/mosquitto/",
            format!("persistence_location {}/", db.display()),
        ),
        (
            "log_dest file /var/log/mosquitto/mosquitto.log",
            format!("log_dest file {}", dir.join("mosquitto-file.log").display()),
        ),
        (
            "include_dir /etc/mosquitto/conf.d",
            format!("include_dir {}", conf_d.display()),
        ),
    ];
    let mut main = main.to_owned();
    for (from, to) in edits {
        assert!(main.contains(from), "the main file has no {from:?}");
        main = main.replace(from, &to);
    }
    main
}

/// What the broker said to a connection attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Connected {
    Accepted,
    /// A ConnAck with this refusal.
    Refused(ConnectReturnCode),
    /// No ConnAck: the TLS handshake or the socket failed.
    Failed(String),
}

/// A bare MQTT client for checking what a login may do.
pub struct Probe {
    client: AsyncClient,
    task: tokio::task::JoinHandle<()>,
    events: tokio::sync::mpsc::UnboundedReceiver<Packet>,
    /// Connections lost since the broker accepted this one (the probe reconnects after each).
    losses: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Probe {
    /// Connects over `connection` as `client_id` and returns the broker's answer, with the
    /// probe when it was accepted.
    pub async fn connect(connection: &Connection, client_id: &str) -> (Connected, Option<Probe>) {
        let mut options = connection.options(client_id);
        options.set_keep_alive(Duration::from_secs(30));
        // rumqttc's default 10 KiB limit would drop the connection on an artifact block.
        options.set_max_packet_size(
            flotilla_protocol::CLIENT_PACKET_LIMIT,
            flotilla_protocol::CLIENT_PACKET_LIMIT,
        );
        let (client, mut eventloop) = flotilla_mqtt::client(options, 100);
        let first = tokio::time::timeout(crate::WAIT, async {
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                        return match ack.code {
                            ConnectReturnCode::Success => Connected::Accepted,
                            code => Connected::Refused(code),
                        }
                    }
                    Ok(_) => {}
                    Err(rumqttc::ConnectionError::ConnectionRefused(code)) => {
                        return Connected::Refused(code)
                    }
                    Err(e) => return Connected::Failed(e.to_string()),
                }
            }
        })
        .await
        .expect("the broker answered the connection attempt");
        if first != Connected::Accepted {
            return (first, None);
        }
        let (tx, events) = tokio::sync::mpsc::unbounded_channel();
        let losses = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let lost = losses.clone();
        let task = tokio::spawn(async move {
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(packet)) => {
                        if tx.send(packet).is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(_) => {
                        lost.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(100)).await
                    }
                }
            }
        });
        (
            first,
            Some(Probe {
                client,
                task,
                events,
                losses,
            }),
        )
    }

    /// How often the connection dropped since the broker accepted it. A broker drops a client
    /// when another connects with the same client id, so a probe that was knocked off says so
    /// here; read it after a round trip through the probe, which comes after any earlier drop.
    pub fn losses(&self) -> usize {
        self.losses.load(std::sync::atomic::Ordering::SeqCst)
    }

    async fn next(&mut self, what: &str) -> Packet {
        tokio::time::timeout(crate::WAIT, self.events.recv())
            .await
            .unwrap_or_else(|_| panic!("no {what} from the broker within {:?}", crate::WAIT))
            .expect("probe connection alive")
    }

    /// The next publish received within `wait` (other packets are skipped), or `None`.
    pub async fn next_publish(&mut self, wait: Duration) -> Option<(String, Vec<u8>)> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let packet = tokio::time::timeout_at(deadline, self.events.recv())
                .await
                .ok()??;
            if let Packet::Publish(p) = packet {
                return Some((p.topic.clone(), p.payload.to_vec()));
            }
        }
    }

    /// Publishes at QoS 0 without waiting for anything, so a stand-in answering requests never
    /// skips one while it waits.
    pub async fn publish_now(&self, topic: &str, payload: &[u8]) {
        self.client
            .publish(topic, QoS::AtMostOnce, false, payload.to_vec())
            .await
            .expect("queue publish");
    }

    /// Subscribes to `filter` and returns whether the broker granted it.
    pub async fn subscribe(&mut self, filter: &str) -> bool {
        self.client
            .subscribe(filter, QoS::AtLeastOnce)
            .await
            .expect("queue subscribe");
        loop {
            if let Packet::SubAck(ack) = self.next("SubAck").await {
                return ack
                    .return_codes
                    .iter()
                    .all(|c| matches!(c, SubscribeReasonCode::Success(_)));
            }
        }
    }

    /// Publishes at QoS 1 and waits for the PubAck. Mosquitto acknowledges a publish its ACL
    /// denies too (MQTT 3.1.1 has no way to say no), so the PubAck proves only that the broker
    /// processed it; whether it was delivered is for a subscriber to tell.
    pub async fn publish(&mut self, topic: &str, payload: &[u8], retain: bool) {
        self.client
            .publish(topic, QoS::AtLeastOnce, retain, payload.to_vec())
            .await
            .expect("queue publish");
        loop {
            if let Packet::PubAck(_) = self.next("PubAck").await {
                return;
            }
        }
    }

    /// Waits for a publish on `marker` and returns every publish received before it. A broker
    /// delivers one subscriber's messages in order, so when the marker was published after
    /// another message was processed (its PubAck came back), that message, had it been
    /// delivered, is in this list: no waiting for something not to happen.
    pub async fn until(&mut self, marker: &str) -> Vec<(String, Vec<u8>)> {
        let mut before = Vec::new();
        loop {
            if let Packet::Publish(p) = self.next(&format!("publish on {marker}")).await {
                if p.topic == marker {
                    return before;
                }
                before.push((p.topic.clone(), p.payload.to_vec()));
            }
        }
    }
}
