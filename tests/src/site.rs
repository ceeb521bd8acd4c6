//! A test site: one broker, one coordinator process, any number of agent processes, keys and
//! releases, all inside one temporary directory.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use flotilla_coordinator::cli::client::ControlClient;
use flotilla_coordinator::service::broker::EmbeddedBroker;
use flotilla_protocol::control::{Command as Control, PageQuery, RolloutStatus};
use flotilla_protocol::operator::Role;
use flotilla_protocol::SigningKey;

use crate::secure::{SecureBroker, COORDINATOR, MONITOR, OPERATOR};
use crate::{bin, free_port, mosquitto_binary, Watcher, WAIT};

/// The operator every site has, with role admin; [`Site::client`] and [`Site::flotilla`] sign
/// as this operator.
pub const ADMIN: &str = "admin";
/// How many agents of one site can enroll with a token.
const TOKENS: usize = 64;

/// Which broker a site runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerKind {
    /// rumqttd inside the test process.
    Embedded,
    /// A Mosquitto process with its own config on a free port.
    Mosquitto,
    /// Mosquitto as `deploy/mosquitto/` ships it ([`SecureBroker`]): TLS only, credentials,
    /// the shipped ACL. The coordinator logs in as `flotilla-coordinator` with a password, the
    /// CLI and [`Site::client`] as `flotilla-operator`, agents with a client certificate whose
    /// common name is their device id.
    Secure,
    /// Mosquitto as Debian installs it, without a packet-size limit: any client may leave a
    /// message of any size (retained) for the others.
    Unlimited,
    /// NATS's MQTT listener (MQTT 3.1.1 only), with a message size limit of
    /// [`crate::nats::MAX_PAYLOAD`] ([`crate::nats::start`]).
    Nats,
    /// Three NATS nodes as `deploy/nats/` ships them ([`crate::nats::Cluster`], made by
    /// [`Site::nats_cluster`]): TLS, a password per login, the shipped permissions. The
    /// coordinator and the CLI list the nodes from node 1, agents from where their
    /// `broker_ports` say; the roles log in as on a [`BrokerKind::Secure`] site.
    NatsCluster,
}

/// How an agent of the site behaves.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// Whether its health check passes.
    pub healthy: bool,
    /// Download throttle in bytes per second (0 = unlimited).
    pub max_bytes_per_sec: u64,
    /// Block size of its requests.
    pub block_size: u32,
    /// Soak time of its health checks.
    pub soak: &'static str,
    /// Release keys it trusts; by default the site's release key.
    pub release_keys: Option<Vec<String>>,
    /// The command that runs the agent instead of the workspace's `flotilla-agent` binary, such
    /// as `qemu-aarch64-static -L /usr/aarch64-linux-gnu <arm binary>`; the agent's arguments
    /// follow it.
    pub launcher: Option<Vec<String>>,
    /// Whether the agent's config carries one of the site's one-time enrollment tokens, so the
    /// coordinator accepts it without an operator (the default). Without one, the device stays
    /// pending until `flotilla devices accept` or a pre-authorized key ([`Site::authorize_key`]).
    pub enroll: bool,
    /// The `[[target]]` settings of the `app` target after its name, instead of `kind = "file"`
    /// on [`Site::target_file`] (e.g. a `mender-module` target).
    pub app_target: Option<String>,
    /// TOML appended to the agent's config, such as one more `[[target]]` table.
    pub extra_config: Option<String>,
    /// Broker ports on 127.0.0.1 written as `[broker] hosts`, instead of the site's one broker.
    pub broker_ports: Option<Vec<u16>>,
    /// `[broker] state_refresh`: how often it sends its state unprompted (the agent's default,
    /// 15 minutes, when `None`).
    pub state_refresh: Option<&'static str>,
}

impl Default for AgentOptions {
    fn default() -> Self {
        Self {
            healthy: true,
            max_bytes_per_sec: 0,
            block_size: 16384,
            soak: "1s",
            release_keys: None,
            launcher: None,
            enroll: true,
            app_target: None,
            extra_config: None,
            broker_ports: None,
            state_refresh: None,
        }
    }
}

pub(crate) struct Process {
    child: Child,
    pub(crate) log: PathBuf,
}

impl Process {
    pub(crate) fn spawn(mut command: Command, log: PathBuf) -> Process {
        let out = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("open log file");
        let err = out.try_clone().expect("clone log file");
        command.stdin(Stdio::null()).stdout(out).stderr(err);
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {command:?}: {e}"));
        Process { child, log }
    }

    pub(crate) fn id(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM and waits up to `within` for the process to exit; `None` if it did not
    /// (it is then killed, so nothing is left running).
    pub(crate) fn terminate(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        None
    }
}

/// One broker, coordinator and fleet in a temporary directory. Dropping it kills every process.
pub struct Site {
    pub dir: tempfile::TempDir,
    pub kind: BrokerKind,
    pub port: u16,
    _embedded: Option<EmbeddedBroker>,
    broker: Option<Process>,
    secure: Option<SecureBroker>,
    pub(crate) cluster: Option<crate::nats::Cluster>,
    coordinator: Option<Process>,
    /// Coordinators started by name, beside or instead of `coordinator` (`coordinators.rs`).
    pub(crate) named: BTreeMap<String, Process>,
    pub(crate) agents: BTreeMap<String, Process>,
    agent_options: BTreeMap<String, AgentOptions>,
    /// Operators in the coordinator's config: name and role. `admin` (role admin) always.
    operators: Vec<(String, Role)>,
    /// One-time enrollment tokens the coordinator lists; each agent that enrolls takes one.
    tokens: Vec<String>,
    /// Which agent got which token.
    agent_tokens: BTreeMap<String, String>,
    /// The coordinator serves `/metrics` on this loopback port ([`Site::enable_metrics`]).
    metrics_port: Option<u16>,
    http_port: Option<u16>,
    /// Where agents started from now on connect instead of the site's broker (a site broker
    /// bridged to it, `bridge.rs`).
    pub agent_broker: Option<AgentBroker>,
    /// Broker ports on 127.0.0.1 the coordinator's config lists as `[broker] hosts`, instead of
    /// the site's one broker.
    pub coordinator_broker_ports: Option<Vec<u16>>,
    /// Appended to the coordinator's config from the next [`Site::start_coordinator`] on
    /// (whole sections, such as `[service]`).
    pub coordinator_config: String,
}

/// A broker agents log in to with their device id and a password file of their own.
#[derive(Debug, Clone)]
pub struct AgentBroker {
    pub port: u16,
    /// `{dir}/{device id}` holds each device's password.
    pub password_dir: PathBuf,
}

impl Drop for Site {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump_logs();
            // FLOTILLA_KEEP_FAILED=1 keeps a failed test's directory (logs, stores) to read.
            if std::env::var_os("FLOTILLA_KEEP_FAILED").is_some() {
                self.dir.disable_cleanup(true);
                eprintln!("---- kept {}", self.dir.path().display());
            }
        }
        for p in self.agents.values_mut() {
            p.kill();
        }
        if let Some(p) = self.coordinator.as_mut() {
            p.kill();
        }
        for p in self.named.values_mut() {
            p.kill();
        }
        if let Some(p) = self.broker.as_mut() {
            p.kill();
        }
    }
}

impl Site {
    /// A site with a fresh broker of `kind` and freshly generated release and coordinator keys.
    pub fn new(kind: BrokerKind) -> Site {
        Self::build(kind, "", &[])
    }

    /// A site whose Mosquitto gets `broker_config` after its usual settings (an `acl_file`,
    /// say). Files it names must exist already: write them somewhere of the test's own first.
    pub fn mosquitto_with(broker_config: &str) -> Site {
        Self::build(BrokerKind::Mosquitto, broker_config, &[])
    }

    pub(crate) fn build(kind: BrokerKind, broker_config: &str, devices: &[&str]) -> Site {
        let dir = tempfile::tempdir().expect("temporary directory");
        let mut port = free_port();
        let (mut embedded, mut broker, mut secure, mut cluster) = (None, None, None, None);
        match kind {
            BrokerKind::Embedded => {
                // A port free a moment ago can be taken by another process before the broker
                // binds it: try a few.
                for attempt in 1..=5 {
                    let addr = format!("127.0.0.1:{port}").parse().expect("socket address");
                    match EmbeddedBroker::start(addr) {
                        Ok(started) => {
                            embedded = Some(started);
                            break;
                        }
                        Err(e) if attempt < 5 => {
                            eprintln!("embedded broker on port {port}: {e}; trying another port");
                            port = free_port();
                        }
                        Err(e) => panic!("start embedded broker: {e:?}"),
                    }
                }
            }
            BrokerKind::Mosquitto => {
                broker = Some(start_mosquitto(dir.path(), port, broker_config, true))
            }
            BrokerKind::Unlimited => {
                broker = Some(start_mosquitto(dir.path(), port, broker_config, false))
            }
            BrokerKind::Nats => broker = Some(crate::nats::start(dir.path(), port)),
            BrokerKind::Secure => secure = Some(SecureBroker::start(dir.path(), &[])),
            BrokerKind::NatsCluster => {
                cluster = Some(crate::nats::Cluster::start(
                    &dir.path().join("nats"),
                    devices,
                ))
            }
        }
        let port = secure.as_ref().map_or(port, |s| s.tls_port);
        let port = cluster.as_ref().map_or(port, |c| c.mqtt_ports()[0]);
        let coordinator_broker_ports = cluster.as_ref().map(|c| c.mqtt_ports());
        let mut site = Site {
            dir,
            kind,
            port,
            _embedded: embedded,
            broker,
            secure,
            cluster,
            coordinator: None,
            named: BTreeMap::new(),
            agents: BTreeMap::new(),
            agent_options: BTreeMap::new(),
            operators: Vec::new(),
            tokens: (0..TOKENS)
                .map(|_| flotilla_coordinator::service::enrollment::new_token())
                .collect(),
            agent_tokens: BTreeMap::new(),
            metrics_port: None,
            http_port: None,
            agent_broker: None,
            coordinator_broker_ports,
            coordinator_config: String::new(),
        };
        fs::write(
            site.authorized_keys_file(),
            "# pre-authorized device keys\n",
        )
        .expect("write authorized keys file");
        site.flotilla(&["keygen", "--out", &site.path("keys").to_string_lossy()]);
        site.add_operator(ADMIN, Role::Admin);
        site
    }

    /// Makes an operator key `keys/{name}.key` and lists its public key with `role` in the
    /// coordinator's config from the next [`Site::start_coordinator`] on.
    pub fn add_operator(&mut self, name: &str, role: Role) {
        self.flotilla(&[
            "operator",
            "keygen",
            "--out",
            &self.path("keys").to_string_lossy(),
            "--name",
            name,
        ]);
        self.operators.push((name.to_owned(), role));
    }

    /// The secret key file of an operator made by [`Site::add_operator`].
    pub fn operator_key_file(&self, name: &str) -> PathBuf {
        self.path(&format!("keys/{name}.key"))
    }

    /// The secret key of an operator made by [`Site::add_operator`].
    pub fn operator_key(&self, name: &str) -> SigningKey {
        let text = fs::read_to_string(self.operator_key_file(name)).expect("read operator key");
        flotilla_protocol::signing::secret_key_from_text(&text).expect("operator key")
    }

    /// A path inside the site's directory.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// Runs the `flotilla` CLI against this site's broker and returns its stdout; panics with
    /// its output if it fails.
    pub fn flotilla(&self, args: &[&str]) -> String {
        let output = self.flotilla_output(args);
        assert!(
            output.status.success(),
            "flotilla {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Runs the `flotilla` CLI and returns whatever happened. On a [`BrokerKind::Secure`]
    /// site it logs in as the operator over TLS.
    pub fn flotilla_output(&self, args: &[&str]) -> std::process::Output {
        self.flotilla_command(args).output().expect("run flotilla")
    }

    /// The `flotilla` CLI command of [`Site::flotilla_output`], not started yet.
    pub fn flotilla_command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(bin("flotilla"));
        match &self.cluster {
            Some(cluster) => command.args(cluster.cli_args(OPERATOR)),
            None => command.args(["--broker", &format!("127.0.0.1:{}", self.port)]),
        };
        if let Some(secure) = &self.secure {
            command
                .args(["--username", OPERATOR, "--password-file"])
                .arg(secure.password_file(OPERATOR))
                .arg("--ca-file")
                .arg(secure.ca_file());
        }
        command
            .args(args)
            .env_remove("FLOTILLA_BROKER")
            .env("FLOTILLA_OPERATOR_KEY", self.operator_key_file(ADMIN));
        command
    }

    /// The secure broker of a [`BrokerKind::Secure`] site.
    pub fn secure(&self) -> &SecureBroker {
        self.secure.as_ref().expect("a BrokerKind::Secure site")
    }

    /// How the site's trusted side (the coordinator's login) reaches the broker. On a secure
    /// site the broker keeps one connection per login: a client with this login while the
    /// coordinator runs takes the coordinator's place.
    pub fn connection(&self) -> flotilla_mqtt::Connection {
        self.login(COORDINATOR)
    }

    /// How `user` reaches the site's broker: a login on a secure broker or a NATS cluster
    /// (nodes from node 1), plain TCP otherwise.
    fn login(&self, user: &str) -> flotilla_mqtt::Connection {
        match (&self.secure, &self.cluster) {
            (Some(secure), _) => secure.login(user),
            (None, Some(cluster)) => cluster.login(user, 0),
            (None, None) => plain(self.port),
        }
    }

    /// A watcher on the site's broker that sees what the coordinator may see (on a secure site
    /// as the read-only monitor, beside the coordinator).
    pub async fn watcher(&self, filters: &[String]) -> Watcher {
        Watcher::connect(self.login(MONITOR), filters).await
    }

    /// The hex text of a public key file of the site.
    pub fn public_key(&self, name: &str) -> String {
        fs::read_to_string(self.path(&format!("keys/{name}.pub")))
            .expect("read public key")
            .trim()
            .to_owned()
    }

    /// Creates a signed release with one artifact for target `app` in the coordinator's data
    /// directory and returns the artifact path. Its manifest signs block lists, as `release
    /// create` makes by default; [`Site::release_with`] takes other flags (`--no-blocks`).
    pub fn release(&self, name: &str, counter: u64, content: &[u8]) -> PathBuf {
        self.release_with(name, counter, content, &[])
    }

    /// Creates a signed release with further `release create` flags (none: block lists of the
    /// default block size; `--block-size N`; `--no-blocks`).
    pub fn release_with(
        &self,
        name: &str,
        counter: u64,
        content: &[u8],
        flags: &[&str],
    ) -> PathBuf {
        let artifact = self.path(&format!("{name}.bin"));
        fs::write(&artifact, content).expect("write artifact");
        let mut args = vec![
            "release",
            "create",
            "--data-dir",
            &self.path("coordinator").to_string_lossy(),
            "--key",
            &self.path("keys/release.key").to_string_lossy(),
            "--name",
            name,
            "--version",
            &format!("{counter}.0.0"),
            "--counter",
            &counter.to_string(),
            "--hardware",
            "test-board",
            "--artifact",
            &format!("app={}", artifact.display()),
        ]
        .into_iter()
        .map(str::to_owned)
        .collect::<Vec<_>>();
        args.extend(flags.iter().map(|f| (*f).to_owned()));
        self.flotilla(&args.iter().map(String::as_str).collect::<Vec<_>>());
        artifact
    }

    /// The coordinator's file of pre-authorized device keys (read when it starts).
    pub fn authorized_keys_file(&self) -> PathBuf {
        self.path("authorized_devices")
    }

    /// Pre-authorizes a device: makes the agent's device key in its data directory before it
    /// first starts (the agent reuses it) and lists it, bound to `id`, in the coordinator's
    /// authorized keys file. Takes effect at the coordinator's next (re)start. Returns the
    /// public key in hex.
    pub fn authorize_key(&self, id: &str) -> String {
        let data = self.path(&format!("agents/{id}/data"));
        fs::create_dir_all(&data).expect("agent data directory");
        let key = flotilla_protocol::signing::generate_key();
        flotilla_targets::fs::atomic_write_private(
            data.join("device.key"),
            flotilla_protocol::signing::secret_key_to_text(&key),
        )
        .expect("write device key");
        let public = flotilla_protocol::hex::encode(key.verifying_key().as_bytes());
        let mut text = fs::read_to_string(self.authorized_keys_file()).unwrap_or_default();
        text.push_str(&format!("{public} {id}\n"));
        fs::write(self.authorized_keys_file(), text).expect("write authorized keys file");
        public
    }

    /// The device's public key (hex), once its agent has made it.
    pub fn device_key(&self, id: &str) -> Option<String> {
        let text = fs::read_to_string(self.path(&format!("agents/{id}/data/device.key"))).ok()?;
        let key = flotilla_protocol::signing::secret_key_from_text(&text).ok()?;
        Some(flotilla_protocol::hex::encode(
            key.verifying_key().as_bytes(),
        ))
    }

    /// Turns on the coordinator's metrics endpoint from the next [`Site::start_coordinator`]
    /// on; returns its loopback port.
    pub fn enable_metrics(&mut self) -> u16 {
        *self.metrics_port.get_or_insert_with(free_port)
    }

    /// Turns on the coordinator's HTTP server (`[http] listen`, plain HTTP on loopback) from the
    /// next [`Site::start_coordinator`] on; returns its port.
    pub fn enable_http(&mut self) -> u16 {
        *self.http_port.get_or_insert_with(free_port)
    }

    /// The coordinator config the site writes (followed by [`Site::coordinator_config`]).
    pub(crate) fn base_coordinator_config(&self) -> String {
        let brokers = match &self.coordinator_broker_ports {
            Some(ports) => {
                let hosts: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
                format!("hosts = {hosts:?}\n")
            }
            None => format!("host = \"127.0.0.1\"\nport = {}\n", self.port),
        };
        let mut text = format!(
            "data_dir = {:?}\ncoordinator_key = {:?}\n[broker]\n{brokers}",
            self.path("coordinator"),
            self.path("keys/coordinator.key"),
        );
        if let Some(cluster) = &self.cluster {
            text.push_str(&cluster.login_toml(COORDINATOR));
        }
        if let Some(secure) = &self.secure {
            text.push_str(&format!(
                "username = {COORDINATOR:?}\npassword_file = {:?}\n[broker.tls]\nca_file = {:?}\n",
                secure.password_file(COORDINATOR),
                secure.ca_file()
            ));
        }
        text.push_str(&format!(
            "[enrollment]\nauthorized_keys = {:?}\ntokens = {:?}\n",
            self.authorized_keys_file(),
            self.tokens,
        ));
        for (name, role) in &self.operators {
            text.push_str(&format!(
                "[[operators]]\nname = {name:?}\nrole = \"{role}\"\nkey_file = {:?}\n",
                self.path(&format!("keys/{name}.pub"))
            ));
        }
        if let Some(port) = self.metrics_port {
            text.push_str(&format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n"));
        }
        if let Some(port) = self.http_port {
            text.push_str(&format!("[http]\nlisten = \"127.0.0.1:{port}\"\n"));
        }
        text
    }

    /// `flotilla serve --config {config}`, logging at info, without the environment's broker
    /// settings (`serve` takes those over its config file; the site's config is what counts).
    pub(crate) fn serve_command(config: &Path) -> Command {
        let mut command = Command::new(bin("flotilla"));
        command
            .args(["serve", "--config"])
            .arg(config)
            .env("RUST_LOG", "info");
        for (name, _) in std::env::vars() {
            if name.starts_with("FLOTILLA_BROKER") || name == "FLOTILLA_TOPIC_ROOT" {
                command.env_remove(name);
            }
        }
        command
    }

    /// Starts (or restarts) `flotilla serve`.
    pub fn start_coordinator(&mut self) {
        let config = self.path("coordinator.toml");
        let text = self.base_coordinator_config() + &self.coordinator_config;
        fs::write(&config, text).expect("write coordinator config");
        let command = Self::serve_command(&config);
        self.coordinator = Some(Process::spawn(command, self.path("coordinator.log")));
    }

    /// Kills the coordinator with SIGKILL.
    pub fn kill_coordinator(&mut self) {
        if let Some(mut p) = self.coordinator.take() {
            p.kill();
        }
    }

    /// Stops the coordinator with SIGTERM; its exit status if it exited within `within`.
    pub fn terminate_coordinator(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        self.coordinator
            .take()
            .and_then(|mut p| p.terminate(within))
    }

    /// Stops an agent with SIGTERM; its exit status if it exited within `within`.
    pub fn terminate_agent(
        &mut self,
        id: &str,
        within: Duration,
    ) -> Option<std::process::ExitStatus> {
        self.agents.remove(id).and_then(|mut p| p.terminate(within))
    }

    /// Writes an agent's config and starts it.
    pub fn add_agent(&mut self, id: &str, labels: &[(&str, &str)], options: AgentOptions) {
        if options.enroll && !self.agent_tokens.contains_key(id) {
            let token = self
                .tokens
                .get(self.agent_tokens.len())
                .expect("the site has enough enrollment tokens")
                .clone();
            self.agent_tokens.insert(id.to_owned(), token);
        }
        self.agent_options.insert(id.to_owned(), options);
        self.write_agent_config(id, labels);
        self.start_agent(id);
    }

    /// The file the agent's `app` target installs to.
    pub fn target_file(&self, id: &str) -> PathBuf {
        self.path(&format!("agents/{id}/app.bin"))
    }

    /// The agent's config file.
    pub fn agent_config(&self, id: &str) -> PathBuf {
        self.path(&format!("agents/{id}/agent.toml"))
    }

    fn write_agent_config(&self, id: &str, labels: &[(&str, &str)]) {
        let options = &self.agent_options[id];
        let dir = self.path(&format!("agents/{id}"));
        fs::create_dir_all(&dir).expect("agent directory");
        let target = self.target_file(id);
        if !target.exists() {
            fs::write(&target, b"factory firmware\n").expect("write factory target file");
        }
        let release_keys = options
            .release_keys
            .clone()
            .unwrap_or_else(|| vec![self.public_key("release")]);
        let check = if options.healthy {
            "test -s \"$0\""
        } else {
            "echo self-test failed >&2; exit 1"
        };
        let token = match (options.enroll, self.agent_tokens.get(id)) {
            (true, Some(token)) => format!("enrollment_token = {token:?}\n"),
            _ => String::new(),
        };
        let tls = match &self.secure {
            // Mutual TLS: the certificate's common name (the device id) is the login.
            Some(secure) => {
                let (cert, key) = secure.client_cert(id);
                format!(
                    "[broker.tls]\nca_file = {:?}\nclient_cert = {cert:?}\nclient_key = {key:?}\n",
                    secure.ca_file()
                )
            }
            None => String::new(),
        };
        let (port, login) = match &self.agent_broker {
            Some(broker) => (
                broker.port,
                format!(
                    "username = {id:?}\npassword_file = {:?}\n",
                    broker.password_dir.join(id)
                ),
            ),
            None => (
                self.secure.as_ref().map_or(self.port, |s| s.mtls_port),
                String::new(),
            ),
        };
        // On a NATS cluster: the device's password and the cluster's CA.
        let (login, tls) = match &self.cluster {
            Some(cluster) => (cluster.login_toml(id), String::new()),
            None => (login, tls),
        };
        let brokers = match &options.broker_ports {
            Some(ports) => {
                let hosts: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
                format!("hosts = {hosts:?}")
            }
            None => format!("host = \"127.0.0.1\"\nport = {port}"),
        };
        let brokers = match options.state_refresh {
            Some(every) => format!("{brokers}\nstate_refresh = {every:?}"),
            None => brokers,
        };
        let mut text = format!(
            r#"device_id = "{id}"
hardware_id = "test-board"
data_dir = {data:?}
{token}[broker]
{brokers}
keep_alive = "5s"
{login}{tls}[labels]
"#,
            data = dir.join("data"),
        );
        for (k, v) in labels {
            text.push_str(&format!("{k} = {v:?}\n"));
        }
        text.push_str(&format!(
            r#"[trust]
release_keys = {release_keys:?}
coordinator_keys = [{coordinator:?}]
[[target]]
name = "app"
{app_target}
[health]
soak = "{soak}"
interval = "200ms"
[[health.check]]
name = "self-test"
command = ["/bin/sh", "-c", {check:?}, {target:?}]
timeout = "5s"
[download]
block_size = {block}
in_flight = 4
max_bytes_per_sec = {rate}
"#,
            coordinator = self.public_key("coordinator"),
            app_target = options
                .app_target
                .clone()
                .unwrap_or_else(|| format!("kind = \"file\"\npath = {target:?}")),
            soak = options.soak,
            block = options.block_size,
            rate = options.max_bytes_per_sec,
        ));
        if let Some(extra) = &options.extra_config {
            text.push_str(extra);
            text.push('\n');
        }
        fs::write(self.agent_config(id), text).expect("write agent config");
    }

    /// Starts (or restarts) an agent process.
    pub fn start_agent(&mut self, id: &str) {
        let mut command = match self.agent_options[id].launcher.as_deref() {
            Some([program, args @ ..]) => {
                let mut command = Command::new(program);
                command.args(args);
                command
            }
            _ => Command::new(bin("flotilla-agent")),
        };
        command
            .args(["run", "--config"])
            .arg(self.agent_config(id))
            .env("RUST_LOG", "info");
        let log = self.path(&format!("agents/{id}/agent.log"));
        self.agents
            .insert(id.to_owned(), Process::spawn(command, log));
    }

    /// Kills an agent with SIGKILL, as a power cut would.
    pub fn kill_agent(&mut self, id: &str) {
        if let Some(mut p) = self.agents.remove(id) {
            p.kill();
        }
    }

    /// A control client connected to the site's broker (as the operator on a secure site),
    /// signing as the `admin` operator.
    pub async fn client(&self) -> ControlClient {
        self.client_as(ADMIN).await
    }

    /// A control client signing as operator `name` (see [`Site::add_operator`]).
    pub async fn client_as(&self, name: &str) -> ControlClient {
        ControlClient::connect_with(
            self.login(OPERATOR),
            "flotilla",
            self.operator_key(name),
            WAIT,
        )
        .await
        .expect("connect control client")
    }

    /// Creates a rollout from spec text through the control topic and starts it.
    pub async fn create_and_start(&self, spec: &str) -> RolloutStatus {
        let client = self.client().await;
        let created = client
            .request(
                Control::CreateRollout {
                    spec: spec.to_owned(),
                },
                Duration::from_secs(10),
            )
            .await
            .expect("create rollout");
        // The reply is the rollout's summary; its devices come page by page.
        let created: RolloutStatus = serde_json::from_value(created).expect("rollout status JSON");
        let status = client
            .rollout_status(&created.name, PageQuery::default(), Duration::from_secs(10))
            .await
            .expect("status of the created rollout");
        client
            .request(
                Control::StartRollout {
                    rollout: status.name.clone(),
                },
                Duration::from_secs(10),
            )
            .await
            .expect("start rollout");
        status
    }

    /// The rollout's status from the coordinator with every device (fetched page by page), or
    /// None while it does not answer.
    pub async fn status(&self, name: &str) -> Option<RolloutStatus> {
        let client = self.client().await;
        client
            .rollout_status(name, PageQuery::default(), Duration::from_secs(5))
            .await
            .ok()
    }

    /// Waits until the rollout ends (finished, paused, failed or stopped); its status then.
    pub async fn wait_ended(&self, name: &str) -> RolloutStatus {
        self.wait_status(name, "the rollout to end", WAIT, |s| {
            matches!(
                s.state.as_str(),
                "finished" | "paused" | "failed" | "stopped"
            )
        })
        .await
    }

    /// Polls the rollout's status until `done` holds; panics after `timeout`.
    pub async fn wait_status(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        done: impl Fn(&RolloutStatus) -> bool,
    ) -> RolloutStatus {
        let client = self.client().await;
        let deadline = Instant::now() + timeout;
        let mut last = None;
        loop {
            let reply = client
                .rollout_status(name, PageQuery::default(), Duration::from_secs(5))
                .await;
            if let Ok(status) = reply {
                if done(&status) {
                    return status;
                }
                last = Some(status);
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; last status: {last:#?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn dump_logs(&self) {
        let mut logs: Vec<&Path> = self.agents.values().map(|p| p.log.as_path()).collect();
        let coordinator_log = self.path("coordinator.log");
        logs.push(&coordinator_log);
        logs.extend(self.named.values().map(|p| p.log.as_path()));
        for log in logs {
            if let Ok(text) = fs::read_to_string(log) {
                let lines: Vec<&str> = text.lines().collect();
                let tail_from = lines.len().saturating_sub(40);
                // Warnings from before the tail: a log busy with requests at info can push
                // what went wrong out of the last lines.
                let earlier: Vec<&str> = lines[..tail_from]
                    .iter()
                    .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
                    .copied()
                    .collect();
                if !earlier.is_empty() {
                    let shown = &earlier[earlier.len().saturating_sub(20)..];
                    eprintln!(
                        "---- {} (warnings and errors before its last lines: the last {} of {})",
                        log.display(),
                        shown.len(),
                        earlier.len()
                    );
                    for line in shown {
                        eprintln!("{line}");
                    }
                }
                eprintln!(
                    "---- {} (last {} lines)",
                    log.display(),
                    lines.len() - tail_from
                );
                for line in &lines[tail_from..] {
                    eprintln!("{line}");
                }
            }
        }
    }
}

/// Plain TCP to the loopback `port`.
pub fn plain(port: u16) -> flotilla_mqtt::Connection {
    flotilla_mqtt::Connection::plain("127.0.0.1", port)
}

/// The latency and queue settings of `deploy/mosquitto/mosquitto.conf`, so the plain test broker
/// behaves like the shipped one (`shipped_tuning_matches_the_deploy_config` keeps them equal).
pub const SHIPPED_BROKER_TUNING: &str = "set_tcp_nodelay true\nmax_queued_messages 200000\n\
     max_queued_bytes 0\nmax_inflight_messages 1000\n";

/// A plain Mosquitto on `port`, with the shipped packet-size limit when `limited`, then `extra`.
fn start_mosquitto(dir: &Path, port: u16, extra: &str, limited: bool) -> Process {
    let binary = mosquitto_binary().expect("mosquitto binary");
    let config = dir.join("mosquitto.conf");
    let limit = if limited {
        format!(
            "max_packet_size {}\n",
            flotilla_protocol::BROKER_PACKET_LIMIT
        )
    } else {
        String::new()
    };
    fs::write(
        &config,
        format!(
            "listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nlog_dest stderr\n\
             {limit}{SHIPPED_BROKER_TUNING}{extra}\n"
        ),
    )
    .expect("write mosquitto config");
    let mut command = Command::new(binary);
    command.arg("-c").arg(&config);
    let process = Process::spawn(command, dir.join("mosquitto.log"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "mosquitto did not listen on {port} within 10s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    process
}

impl Site {
    /// Publishes raw bytes on a topic (QoS 1), as any client of the shared broker could.
    pub async fn publish(&self, topic: &str, payload: Vec<u8>, retain: bool) {
        let mut options = self
            .connection()
            .options(format!("publisher-{}", crate::free_port()));
        options.set_max_packet_size(
            flotilla_protocol::MAX_PACKET_SIZE,
            flotilla_protocol::MAX_PACKET_SIZE,
        );
        let (client, mut eventloop) = flotilla_mqtt::client(options, 10);
        client
            .publish(topic, rumqttc::QoS::AtLeastOnce, retain, payload)
            .await
            .expect("queue publish");
        let acked = async {
            loop {
                match eventloop.poll().await {
                    Ok(rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_))) => return,
                    Ok(_) => {}
                    Err(e) => panic!("publish to {topic}: {e}"),
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), acked)
            .await
            .expect("broker acknowledged the publish");
        let _ = client.disconnect().await;
    }
}
