//! NATS's MQTT listener as a site's broker (Debian's `nats-server`): one node, JetStream for
//! retained messages and sessions, anonymous clients on loopback. It speaks MQTT 3.1.1 only,
//! so MQTT 5's Maximum Packet Size cannot protect a client here, and it delivers messages up to
//! its `max_payload`, set well above what flotilla's clients read.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::free_port;
use crate::site::{BrokerKind, Process, Site};

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

/// The repository's `deploy/nats` directory: the shipped cluster configuration.
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/nats")
}

/// The logins of the roles, made beside the devices' in every cluster.
pub const ROLES: [&str; 4] = [
    crate::secure::COORDINATOR,
    crate::secure::OPERATOR,
    crate::secure::OBSERVER,
    crate::secure::MONITOR,
];

fn run(program: &str, args: &[&str], what: &str) -> Vec<u8> {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {program} ({e})"));
    assert!(
        out.status.success(),
        "{what}: {program} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// One node of a [`Cluster`].
pub struct Node {
    /// Its MQTT listener (TLS).
    pub mqtt_port: u16,
    /// NATS's own client protocol, on loopback.
    pub client_port: u16,
    dir: PathBuf,
    process: Option<Process>,
}

/// Three `nats-server` nodes on loopback, each started from the shipped `deploy/nats` files
/// (`node-N.conf`, `cluster.conf`, the `users.conf` that `users.sh` makes, certificates from
/// `make-certs.sh`) with only their ports and paths changed: MQTT over TLS, logins with
/// passwords and the shipped permissions, JetStream replicated over the three.
pub struct Cluster {
    dir: PathBuf,
    pub nodes: Vec<Node>,
    /// One cluster at a time on this machine (see [`one_cluster_at_a_time`]); released after
    /// the nodes are killed.
    _lock: fs::File,
}

/// Waits until no other test on this machine runs a NATS cluster, and keeps it that way until
/// the returned file is dropped. Three clusters at once (nine JetStream nodes electing leaders
/// on a 2-core machine) starve each other: nodes dropped their MQTT clients for seconds after
/// a start or a node's death, and rollouts that take 20 s alone ran past a minute.
fn one_cluster_at_a_time() -> fs::File {
    crate::machine_lock("nats-cluster-tests")
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for (i, node) in self.nodes.iter().enumerate() {
                let log = fs::read_to_string(node.dir.join("nats.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(25).collect();
                eprintln!("---- nats node {} (last {} lines)", i + 1, tail.len());
                for line in tail.iter().rev() {
                    eprintln!("{line}");
                }
            }
        }
        for node in &mut self.nodes {
            if let Some(mut p) = node.process.take() {
                p.kill();
            }
        }
    }
}

impl Cluster {
    /// Starts the three nodes in `dir`, with logins for the roles ([`ROLES`]) and `devices`,
    /// and waits until every node takes MQTT connections and the cluster has a JetStream
    /// leader.
    pub fn start(dir: &Path, devices: &[&str]) -> Cluster {
        assert!(
            binary().is_some(),
            "nats-server is not installed; .ci/run installs it (apt-get install nats-server)"
        );
        let lock = one_cluster_at_a_time();
        let deploy = deploy_dir();
        let script = |name: &str| deploy.join(name).to_string_lossy().into_owned();
        let ca = dir.join("ca");
        run(
            "sh",
            &[&script("make-certs.sh"), &ca.to_string_lossy(), "ca"],
            "make the cluster's CA",
        );
        let secrets = dir.join("secrets").to_string_lossy().into_owned();
        let mut args = vec![script("users.sh"), secrets];
        args.extend(ROLES.iter().chain(devices).map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let users = run("sh", &args, "make the cluster's users");
        let ports: Vec<(u16, u16, u16)> = (0..3)
            .map(|_| (free_port(), free_port(), free_port()))
            .collect();
        let shipped =
            fs::read_to_string(deploy.join("cluster.conf")).expect("read deploy/nats/cluster.conf");
        let mut nodes = Vec::new();
        for (i, (client, route, mqtt)) in ports.iter().enumerate() {
            let node_dir = dir.join(format!("node-{}", i + 1));
            let shared = node_dir.join("nats-flotilla");
            run(
                "sh",
                &[
                    &script("make-certs.sh"),
                    "--out",
                    &shared.join("tls").to_string_lossy(),
                    &ca.to_string_lossy(),
                    "node",
                    "IP:127.0.0.1",
                    "DNS:localhost",
                ],
                "make a node's certificate",
            );
            let mut edits = vec![
                (
                    "/etc/nats-flotilla/".to_owned(),
                    format!("{}/", shared.display()),
                ),
                (
                    "/var/lib/nats/jetstream".to_owned(),
                    node_dir.join("jetstream").display().to_string(),
                ),
                (
                    "listen: 127.0.0.1:4222".to_owned(),
                    format!("listen: 127.0.0.1:{client}"),
                ),
                (
                    "listen: 0.0.0.0:6222".to_owned(),
                    format!("listen: 127.0.0.1:{route}"),
                ),
                (
                    "listen: 0.0.0.0:8883".to_owned(),
                    format!("listen: 127.0.0.1:{mqtt}"),
                ),
            ];
            for (k, (_, other_route, _)) in ports.iter().enumerate() {
                edits.push((
                    format!("nats-{}.example.net:6222", k + 1),
                    format!("127.0.0.1:{other_route}"),
                ));
            }
            let mut config = shipped.clone();
            for (from, to) in edits {
                assert!(
                    config.contains(&from),
                    "deploy/nats/cluster.conf no longer has {from:?}; update tests/src/nats.rs"
                );
                config = config.replace(&from, &to);
            }
            fs::write(shared.join("cluster.conf"), config).expect("write cluster.conf");
            fs::write(shared.join("users.conf"), &users).expect("write users.conf");
            let node_conf = deploy.join(format!("node-{}.conf", i + 1));
            fs::copy(&node_conf, node_dir.join("node.conf")).expect("copy the node's config");
            nodes.push(Node {
                mqtt_port: *mqtt,
                client_port: *client,
                dir: node_dir,
                process: None,
            });
        }
        let mut cluster = Cluster {
            dir: dir.to_owned(),
            nodes,
            _lock: lock,
        };
        for i in 0..3 {
            cluster.spawn(i);
        }
        for i in 0..3 {
            cluster.wait_listening(i);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while !(0..3).any(|i| cluster.log(i).contains("metadata leader")) {
            assert!(
                Instant::now() < deadline,
                "the NATS cluster elected no JetStream leader within 30s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        for i in 0..3 {
            cluster.wait_mqtt_ready(i);
        }
        cluster
    }

    fn spawn(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        let mut command = Command::new(binary().expect("nats-server"));
        command.arg("-c").arg(node.dir.join("node.conf"));
        node.process = Some(Process::spawn(command, node.dir.join("nats.log")));
    }

    fn wait_listening(&self, i: usize) {
        let port = self.nodes[i].mqtt_port;
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "NATS node {} did not listen for MQTT on {port} within 20s:\n{}",
                i + 1,
                self.log(i)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until node `i` keeps an MQTT session: grants a subscription and acknowledges a
    /// retained message (an empty one, which stores nothing). A listening node whose JetStream
    /// is not ready yet accepts the TCP connection and then drops the client, so clients started
    /// too early spend their first seconds reconnecting.
    fn wait_mqtt_ready(&self, i: usize) {
        let port = self.nodes[i].mqtt_port;
        let mut connection = self.login(crate::secure::COORDINATOR, i);
        connection.alternates.clear();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = String::new();
        let ready = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("a runtime for the readiness check");
                    runtime.block_on(async {
                        while Instant::now() < deadline {
                            let client_id = format!("ready-check-{i}");
                            let check = mqtt_round_trip(&connection, &client_id);
                            match tokio::time::timeout(Duration::from_secs(10), check).await {
                                Ok(Ok(())) => return true,
                                Ok(Err(e)) => last = e,
                                Err(_) => last = "no answer within 10s".to_owned(),
                            }
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        false
                    })
                })
                .join()
                .expect("the readiness check")
        });
        assert!(
            ready,
            "NATS node {} (MQTT on {port}) kept no MQTT session within 60s: {last}\n{}",
            i + 1,
            self.log(i)
        );
    }

    /// The MQTT ports of the nodes, node 1 first.
    pub fn mqtt_ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.mqtt_port).collect()
    }

    /// The MQTT ports starting with node `first` (0-based), then the others in turn.
    pub fn ports_from(&self, first: usize) -> Vec<u16> {
        let ports = self.mqtt_ports();
        (0..ports.len())
            .map(|k| ports[(first + k) % ports.len()])
            .collect()
    }

    /// What node `i` (0-based) logged.
    pub fn log(&self, i: usize) -> String {
        fs::read_to_string(self.nodes[i].dir.join("nats.log")).unwrap_or_default()
    }

    /// Kills node `i` (0-based) with SIGKILL, as a crash or a power cut would.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut p) = self.nodes[i].process.take() {
            p.kill();
        }
    }

    /// Starts node `i` (0-based) again, with its JetStream store as it was left, and waits until
    /// it takes MQTT connections.
    pub fn restart(&mut self, i: usize) {
        assert!(self.nodes[i].process.is_none(), "node {} is running", i + 1);
        self.spawn(i);
        self.wait_listening(i);
        self.wait_mqtt_ready(i);
    }

    /// The CA certificate clients check the nodes against.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca/ca.crt")
    }

    /// The file holding `user`'s password (made by `users.sh`).
    pub fn password_file(&self, user: &str) -> PathBuf {
        self.dir.join(format!("secrets/{user}.password"))
    }

    /// `user`'s login over TLS, to the nodes in turn from node `first` (0-based).
    pub fn login(&self, user: &str, first: usize) -> flotilla_mqtt::Connection {
        let mut ports = self.ports_from(first).into_iter();
        let port = ports.next().expect("three nodes");
        flotilla_mqtt::ConnectionSpec {
            alternates: ports.map(|p| ("127.0.0.1".to_owned(), p)).collect(),
            order: Default::default(),
            host: "127.0.0.1".into(),
            port,
            username: Some(user.to_owned()),
            password_file: Some(self.password_file(user)),
            password_env: None,
            tls: Some(flotilla_mqtt::RawTls {
                ca_file: Some(self.ca_file()),
                client_cert: None,
                client_key: None,
            }),
        }
        .validate(Path::new("/"), &|_| None)
        .expect("valid cluster login")
    }

    /// The `flotilla` CLI's flags for `user`'s login: every node, node 1 first.
    pub fn cli_args(&self, user: &str) -> Vec<std::ffi::OsString> {
        let nodes: Vec<String> = self
            .mqtt_ports()
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        [
            "--broker".into(),
            nodes.join(","),
            "--username".into(),
            user.into(),
            "--password-file".into(),
        ]
        .into_iter()
        .map(Into::into)
        .chain([
            self.password_file(user).into_os_string(),
            "--ca-file".into(),
            self.ca_file().into_os_string(),
        ])
        .collect()
    }

    /// The `[broker]` lines of `user`'s login for a config file (after its `hosts`): user name,
    /// password file, and the `[broker.tls]` table with the cluster's CA.
    pub fn login_toml(&self, user: &str) -> String {
        format!(
            "username = {user:?}\npassword_file = {:?}\n[broker.tls]\nca_file = {:?}\n",
            self.password_file(user),
            self.ca_file()
        )
    }
}

/// The node of `count` a device with client id `id` dials first when its config lists several
/// (flotilla-mqtt's FNV-1a spread, decision 0057), so a test can order each device's list to
/// start it on the node it wants.
pub fn first_of(id: &str, count: usize) -> usize {
    flotilla_mqtt::spread(id, count)
}

impl Site {
    /// A site on a [`BrokerKind::NatsCluster`] with logins for `devices`.
    pub fn nats_cluster(devices: &[&str]) -> Site {
        Self::build(BrokerKind::NatsCluster, "", devices)
    }

    /// The NATS cluster of a [`BrokerKind::NatsCluster`] site.
    pub fn cluster(&mut self) -> &mut Cluster {
        self.cluster
            .as_mut()
            .expect("a BrokerKind::NatsCluster site")
    }
}

/// Connects as `client_id`, subscribes at QoS 1 and publishes an empty retained message at QoS 1;
/// `Ok` once the broker has acknowledged both.
async fn mqtt_round_trip(
    connection: &flotilla_mqtt::Connection,
    client_id: &str,
) -> Result<(), String> {
    use rumqttc::{Event, Packet, QoS};
    let (client, mut eventloop) = flotilla_mqtt::client(connection.options(client_id), 10);
    let (mut subscribed, mut stored) = (false, false);
    while !(subscribed && stored) {
        match eventloop.poll().await.map_err(|e| e.to_string())? {
            Event::Incoming(Packet::ConnAck(ack)) => {
                if ack.code != rumqttc::ConnectReturnCode::Success {
                    return Err(format!("connection refused: {:?}", ack.code));
                }
                client
                    .subscribe("flotilla/v1/devices/+/state", QoS::AtLeastOnce)
                    .await
                    .map_err(|e| e.to_string())?;
                client
                    .publish(
                        "flotilla/v1/ready-check",
                        QoS::AtLeastOnce,
                        true,
                        Vec::new(),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Event::Incoming(Packet::SubAck(ack)) => {
                if ack
                    .return_codes
                    .iter()
                    .any(|c| matches!(c, rumqttc::SubscribeReasonCode::Failure))
                {
                    return Err("the subscription was refused".to_owned());
                }
                subscribed = true;
            }
            Event::Incoming(Packet::PubAck(_)) => stored = true,
            _ => {}
        }
    }
    let _ = client.try_disconnect();
    Ok(())
}
