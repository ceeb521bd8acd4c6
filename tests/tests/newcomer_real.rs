//! The README's "Running it for real, against Mosquitto", replayed from the README's own text:
//! every command of its code block, in order, up to `rollout status --watch`, and every config
//! setting it shows (`#   [table] key = value, ...` lines). A step the README adds that this
//! test does not know fails the test, and so does a step that no longer works as written.
//!
//! The substitutions a test must make, and only those:
//! - paths: `~` is a home directory under a temporary directory, and `/etc`, `/var`, `/opt` are
//!   under a root of their own per machine (one for the CA, broker and coordinator host, one per
//!   device); the coordinator's relative paths are in the shell's working directory there;
//! - ports: the listeners 8883 and 8884 are free loopback ports, in the shipped drop-in and in
//!   every setting and address that names them;
//! - `mqtt.example.com` is 127.0.0.1: the broker's certificate gets `IP:127.0.0.1` besides the
//!   README's `DNS:mqtt.example.com`, since no resolver here knows that name;
//! - `mosquitto_passwd` takes the password with `-b` instead of asking for it;
//! - the Debian mosquitto package's main file is written by the test (tests/src/secure.rs has it
//!   byte for byte), with its host paths moved into the root; `chown` and
//!   `systemctl restart mosquitto` start Mosquitto on that main file, as the test's user;
//! - `systemctl restart flotilla` (after the operators) restarts the test's coordinator;
//! - `apt-get install` and `cargo build` are what CI did before the test ran;
//! - files the README copies between machines without a command (the CA certificate, a
//!   device's certificate directory, each login's password file) are copied by the test.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use flotilla_tests::secure::{main_with_paths, DEBIAN_MAIN_CONF, TEST_LINES};
use flotilla_tests::{bin, free_port, mosquitto_binary, WAIT};
use serde_json::Value;

fn readme() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("the repository")
}

/// One line of the README's code block: a command, or a setting shown in a comment.
#[derive(Debug)]
enum Line {
    Command(String),
    /// `#   [table] key = value, ...` (or `[[table]]`): the table and its TOML.
    Setting(String, toml::Table),
}

/// The code block of "Running it for real", continuation lines joined, comments dropped except
/// the settings.
fn steps(readme: &str) -> Vec<Line> {
    let heading = "## Running it for real, against Mosquitto";
    let start = readme.find(heading).expect("the README has the section");
    let section = &readme[start..];
    let block = &section[section.find("```sh\n").expect("its code block") + 6..];
    let block = &block[..block.find("```").expect("the block's end")];
    let mut lines = Vec::new();
    let mut pending = String::new();
    for raw in block.lines() {
        if let Some(setting) = raw.strip_prefix("#   [") {
            let (table, body) = setting.split_once("] ").expect("[table] settings");
            let body = body.replace(", ", "\n");
            let parsed: toml::Table = body
                .parse()
                .unwrap_or_else(|e| panic!("the README's setting {raw:?} is not TOML: {e}"));
            lines.push(Line::Setting(
                table.trim_matches(['[', ']']).to_owned(),
                parsed,
            ));
            continue;
        }
        if raw.trim_start().starts_with('#') || raw.trim().is_empty() {
            continue;
        }
        let text = raw.split("  #").next().unwrap_or(raw).trim_end();
        match text.strip_suffix('\\') {
            Some(part) => pending.push_str(part),
            None => {
                pending.push_str(text);
                lines.push(Line::Command(
                    pending.split_whitespace().collect::<Vec<_>>().join(" "),
                ));
                pending.clear();
            }
        }
    }
    lines
}

/// A device of the README: its id, its filesystem root and its agent settings.
struct Device {
    id: String,
    root: PathBuf,
    settings: Vec<(String, toml::Table)>,
    key: Option<String>,
}

/// Everything the replay started and where, stopped however the test ends.
struct World {
    _tmp: tempfile::TempDir,
    home: PathBuf,
    /// `/` of the CA machine, the broker and the coordinator host.
    host: PathBuf,
    /// The shell's working directory on that host.
    work: PathBuf,
    tls_port: u16,
    mtls_port: u16,
    passwords: BTreeMap<String, String>,
    env: Vec<(String, String)>,
    processes: Vec<(String, PathBuf, Child)>,
    devices: Vec<Device>,
}

impl Drop for World {
    fn drop(&mut self) {
        for (_, _, child) in &mut self.processes {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            for (name, log, _) in &self.processes {
                let text = fs::read_to_string(log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(25).collect();
                eprintln!("---- {name} (last {} lines)", tail.len());
                for line in tail.iter().rev() {
                    eprintln!("{line}");
                }
            }
        }
    }
}

impl World {
    /// A word of a command as it is on `root`'s machine.
    fn path(&self, word: &str, root: &Path) -> String {
        if let Some(rest) = word.strip_prefix("~/") {
            return self.home.join(rest).display().to_string();
        }
        if let Some(rest) = word.strip_prefix("deploy/") {
            return repo().join("deploy").join(rest).display().to_string();
        }
        for top in ["/etc/", "/var/", "/opt/"] {
            if word.starts_with(top) {
                return format!("{}{word}", root.display());
            }
        }
        word.replace(
            "mqtt.example.com:8883",
            &format!("127.0.0.1:{}", self.tls_port),
        )
    }

    /// A setting's value as it is on a machine: the broker's name and ports, paths.
    fn value(&self, key: &str, value: &toml::Value, files: &Path) -> toml::Value {
        match (key, value) {
            ("host", toml::Value::String(h)) if h == "mqtt.example.com" => "127.0.0.1".into(),
            ("port", toml::Value::Integer(8883)) => i64::from(self.tls_port).into(),
            ("port", toml::Value::Integer(8884)) => i64::from(self.mtls_port).into(),
            (_, toml::Value::String(s)) if s.starts_with(".../") => {
                files.join(&s[4..]).display().to_string().into()
            }
            (_, other) => other.clone(),
        }
    }

    fn run(&self, program: &Path, args: &[String], cwd: &Path) -> Output {
        Command::new(program)
            .args(args)
            .current_dir(cwd)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &self.home)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", program.display()))
    }

    fn spawn(&mut self, name: &str, program: &Path, args: &[String], cwd: &Path) {
        let log = self.host.join(format!("{name}.log"));
        let out = fs::File::create(&log).expect("create a log");
        let child = Command::new(program)
            .args(args)
            .current_dir(cwd)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &self.home)
            .env("RUST_LOG", "info,rumqttd=warn")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("clone the log"))
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", program.display()));
        self.processes.push((name.to_owned(), log, child));
    }

    /// Runs `flotilla ...` of the README in the working directory, as the shell does.
    fn flotilla(&self, line: &str) -> Output {
        let args: Vec<String> = line
            .split_whitespace()
            .skip(1)
            .map(|w| self.path(w, &self.host))
            .collect();
        self.run(&bin("flotilla"), &args, &self.work)
    }
}

fn ok(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: exit {:?}\n{}{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Retries `flotilla ...` until `done` says its output is what the step waits for.
fn until(world: &World, line: &str, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let out = world.flotilla(line);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() && done(&text) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{line}: {what} within {WAIT:?}:\n{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// `table` (dotted, like `broker.tls`) of `config`, made when missing.
fn table<'a>(config: &'a mut toml::Table, dotted: &str) -> &'a mut toml::Table {
    dotted.split('.').fold(config, |t, key| {
        t.entry(key)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .expect("a table")
    })
}

/// Mosquitto as Debian's package lays it out, with the README's drop-in, listening.
fn start_broker(world: &mut World) {
    let etc = world.host.join("etc/mosquitto");
    let (conf_d, db) = (etc.join("conf.d"), world.host.join("var/lib/mosquitto"));
    fs::create_dir_all(&db).expect("persistence directory");
    let main = main_with_paths(DEBIAN_MAIN_CONF, &world.host, &conf_d, &db) + TEST_LINES;
    fs::write(etc.join("mosquitto.conf"), main).expect("the main file");
    let drop_in = conf_d.join("flotilla.conf");
    let mut text = fs::read_to_string(&drop_in).expect("the README copied the drop-in");
    for (from, to) in [
        (
            "/etc/mosquitto/flotilla/".to_owned(),
            format!("{}/etc/mosquitto/flotilla/", world.host.display()),
        ),
        (
            "listener 8883\n".to_owned(),
            format!("listener {} 127.0.0.1\n", world.tls_port),
        ),
        (
            "listener 8884\n".to_owned(),
            format!("listener {} 127.0.0.1\n", world.mtls_port),
        ),
    ] {
        assert!(text.contains(&from), "the drop-in has no {from:?}");
        text = text.replace(&from, &to);
    }
    fs::write(&drop_in, text).expect("the drop-in");
    let binary = mosquitto_binary()
        .expect("mosquitto is not installed; .ci/run installs it (apt-get install mosquitto)");
    let args = vec![
        "-c".to_owned(),
        etc.join("mosquitto.conf").display().to_string(),
    ];
    let host = world.host.clone();
    world.spawn("mosquitto", &binary, &args, &host);
    let deadline = Instant::now() + Duration::from_secs(10);
    for port in [world.tls_port, world.mtls_port] {
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "mosquitto listens on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// `flotilla serve --config coordinator.toml`, with the README's [broker] settings.
fn start_coordinator(world: &mut World, settings: &[(String, toml::Table)], config: &str) {
    let work = world.work.clone();
    let mut coordinator: toml::Table = config.parse().expect("the coordinator's config");
    for (name, values) in settings {
        if name == "operators" {
            let entry: toml::Table = values.clone();
            coordinator
                .entry("operators")
                .or_insert_with(|| toml::Value::Array(Vec::new()))
                .as_array_mut()
                .expect("[[operators]]")
                .push(toml::Value::Table(entry));
            continue;
        }
        for (key, value) in values {
            let value = world.value(key, value, &work);
            table(&mut coordinator, name).insert(key.clone(), value);
        }
    }
    fs::write(
        work.join("coordinator.toml"),
        toml::to_string(&coordinator).expect("TOML"),
    )
    .expect("write coordinator.toml");
    if let Some(i) = world.processes.iter().position(|p| p.0 == "coordinator") {
        let (_, _, mut child) = world.processes.remove(i);
        let _ = child.kill();
        let _ = child.wait();
    }
    let args = ["serve", "--config", "coordinator.toml"].map(String::from);
    world.spawn("coordinator", &bin("flotilla"), &args, &work);
}

/// A device's agent.toml: the shipped default with the README's settings for it.
fn write_agent_config(world: &World, device: &Device, default: &str) -> PathBuf {
    let files = device.root.join("etc/flotilla-agent/tls");
    let opt = device.root.join("opt/app/app.bin").display().to_string();
    let mut config: toml::Table = default
        .replace("/opt/app/app.bin", &opt)
        .replace(
            "\"/var/lib/",
            &format!("\"{}/var/lib/", device.root.display()),
        )
        .parse()
        .expect("the agent's default config");
    config.insert("device_id".into(), device.id.clone().into());
    let key = |name: &str| {
        let text = fs::read_to_string(world.work.join("keys").join(name)).expect("a public key");
        toml::Value::Array(vec![text.trim().into()])
    };
    let trust = table(&mut config, "trust");
    trust.insert("release_keys".into(), key("release.pub"));
    trust.insert("coordinator_keys".into(), key("coordinator.pub"));
    for (name, values) in &device.settings {
        for (k, v) in values {
            let value = world.value(k, v, &files);
            table(&mut config, name).insert(k.clone(), value);
        }
    }
    let path = device.root.join("etc/flotilla/agent.toml");
    fs::create_dir_all(path.parent().expect("etc/flotilla")).expect("etc/flotilla");
    fs::create_dir_all(device.root.join("opt/app")).expect("opt/app");
    fs::write(&path, toml::to_string(&config).expect("TOML")).expect("write agent.toml");
    path
}

#[test]
fn running_it_for_real_as_the_readme_says() {
    let readme = readme();
    let lines = steps(&readme);
    let tmp = tempfile::tempdir().expect("tempdir");
    let (home, host) = (tmp.path().join("home"), tmp.path().join("host"));
    let work = host.join("home/admin");
    for dir in [&home, &work] {
        fs::create_dir_all(dir).expect("directories");
    }
    let mut world = World {
        _tmp: tmp,
        home,
        host,
        work,
        tls_port: free_port(),
        mtls_port: free_port(),
        passwords: BTreeMap::new(),
        env: Vec::new(),
        processes: Vec::new(),
        devices: Vec::new(),
    };
    let agent_default = ok(
        Command::new(bin("flotilla-agent"))
            .arg("print-default-config")
            .output()
            .expect("flotilla-agent"),
        "print-default-config",
    );
    let coordinator_default = ok(
        Command::new(bin("flotilla"))
            .args(["serve", "--print-default-config"])
            .output()
            .expect("flotilla"),
        "serve --print-default-config",
    );
    let spec = readme
        .split("```toml\n")
        .find(|b| b.starts_with("name = \"fw-2-4\""))
        .and_then(|b| b.split("```").next())
        .expect("the README's example spec");
    let app = b"fw 2.4.0 for the kitchen\n";

    // Settings before the coordinator starts are its own; [broker] after it starts a device's;
    // [operators] after that are the coordinator's again.
    let mut coordinator_settings: Vec<(String, toml::Table)> = Vec::new();
    let mut operators: Vec<(String, toml::Table)> = Vec::new();
    let mut device_settings: Vec<Vec<(String, toml::Table)>> = Vec::new();
    let mut coordinator_started = false;
    let mut restart_for_operators = false;
    let mut finished = false;

    for line in &lines {
        let command = match line {
            Line::Setting(name, values) if name == "operators" => {
                operators.push((name.clone(), values.clone()));
                restart_for_operators = true;
                continue;
            }
            Line::Setting(name, values) if !coordinator_started => {
                coordinator_settings.push((name.clone(), values.clone()));
                continue;
            }
            Line::Setting(name, values) => {
                if name == "broker" {
                    device_settings.push(Vec::new());
                }
                let device = device_settings
                    .last_mut()
                    .expect("a device's [broker] first");
                device.push((name.clone(), values.clone()));
                continue;
            }
            Line::Command(command) => command.as_str(),
        };
        if restart_for_operators && !command.starts_with("flotilla operator keygen") {
            // "restart the coordinator (`systemctl restart flotilla`)".
            let mut all = coordinator_settings.clone();
            all.extend(operators.iter().cloned());
            start_coordinator(&mut world, &all, &coordinator_default);
            restart_for_operators = false;
        }
        let words: Vec<&str> = command.split_whitespace().collect();
        let host = world.host.clone();
        match words.as_slice() {
            // CI installed these before the test; Debian's package has a main file, conf.d.
            ["apt-get", "install", ..] => {
                fs::create_dir_all(host.join("etc/mosquitto/conf.d")).expect("conf.d");
            }
            ["cargo", "build", ..] => {}
            ["deploy/mosquitto/make-certs.sh", rest @ ..] => {
                let mut args: Vec<String> = std::iter::once(world.path(words[0], &host))
                    .chain(rest.iter().map(|w| world.path(w, &host)))
                    .collect();
                if rest.contains(&"server") {
                    assert!(rest.contains(&"DNS:mqtt.example.com"), "{command}");
                    args.push("IP:127.0.0.1".into());
                }
                ok(world.run(Path::new("sh"), &args, &world.work), command);
            }
            ["install" | "cp", ..] => {
                let args: Vec<String> = words[1..].iter().map(|w| world.path(w, &host)).collect();
                ok(world.run(Path::new(words[0]), &args, &world.work), command);
            }
            ["mosquitto_passwd", args @ .., file, user] => {
                let password = format!("pw-{user}-{}", free_port());
                let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
                all.push("-b".into());
                all.push(world.path(file, &host));
                all.push(user.to_string());
                all.push(password.clone());
                ok(
                    world.run(Path::new("mosquitto_passwd"), &all, &world.work),
                    command,
                );
                world.passwords.insert(user.to_string(), password);
            }
            ["chown", .., "&&", "systemctl", "restart", "mosquitto"] => start_broker(&mut world),
            ["flotilla", "release", "create", ..] => {
                let artifact = command
                    .split("app=")
                    .nth(1)
                    .and_then(|a| a.split_whitespace().next())
                    .expect("--artifact app=FILE");
                let path = world.work.join(artifact);
                fs::create_dir_all(path.parent().expect("build/")).expect("build/");
                fs::write(path, app).expect("the artifact");
                ok(world.flotilla(command), command);
            }
            ["flotilla", "serve", "--config", "coordinator.toml"] => {
                // The coordinator host's files: its password and the CA's certificate.
                let work = world.work.clone();
                fs::create_dir_all(work.join("secrets")).expect("secrets/");
                fs::write(
                    work.join("secrets/broker.password"),
                    &world.passwords["flotilla-coordinator"],
                )
                .expect("password");
                fs::create_dir_all(work.join("tls")).expect("tls/");
                fs::copy(
                    world.home.join("flotilla-ca/ca.crt"),
                    work.join("tls/ca.crt"),
                )
                .expect("ca.crt");
                start_coordinator(&mut world, &coordinator_settings, &coordinator_default);
                coordinator_started = true;
            }
            ["flotilla-agent", "check-config", "--config", _] => {
                // Every device of the README's settings, each on a machine of its own.
                for settings in &device_settings {
                    let broker = &settings[0].1;
                    let id = match broker.get("username") {
                        Some(user) => user.as_str().expect("username").to_owned(),
                        None => {
                            let tls = &settings
                                .iter()
                                .find(|s| s.0 == "broker.tls")
                                .expect("tls")
                                .1;
                            let cert = tls["client_cert"].as_str().expect("client_cert");
                            cert.trim_start_matches(".../")
                                .trim_end_matches(".crt")
                                .to_owned()
                        }
                    };
                    let root = world.host.parent().expect("tmp").join(&id);
                    let files = root.join("etc/flotilla-agent/tls");
                    fs::create_dir_all(&files).expect("the device's tls/");
                    // "copy the directory to the device"; a password device gets the CA's
                    // certificate and its password.
                    match fs::read_dir(world.work.join(&id)) {
                        Ok(entries) => {
                            for e in entries.filter_map(Result::ok) {
                                fs::copy(e.path(), files.join(e.file_name())).expect("copy");
                            }
                        }
                        Err(_) => {
                            fs::copy(world.home.join("flotilla-ca/ca.crt"), files.join("ca.crt"))
                                .expect("ca.crt");
                            let password = world.passwords.get(&id).unwrap_or_else(|| {
                                panic!("the README sets no broker password for {id}")
                            });
                            fs::write(files.join("broker.password"), password).expect("password");
                        }
                    }
                    world.devices.push(Device {
                        id,
                        root,
                        settings: settings.clone(),
                        key: None,
                    });
                }
                assert_eq!(
                    world.devices.len(),
                    2,
                    "a device with a certificate, one with a password"
                );
                for device in &world.devices {
                    let config = write_agent_config(&world, device, &agent_default);
                    let args = [
                        "check-config".to_owned(),
                        "--config".to_owned(),
                        config.display().to_string(),
                    ];
                    let out = ok(
                        world.run(&bin("flotilla-agent"), &args, &device.root),
                        command,
                    );
                    assert!(out.contains("config ok"), "{out}");
                }
            }
            ["flotilla-agent", "run", "--config", config] => {
                for i in 0..world.devices.len() {
                    let root = world.devices[i].root.clone();
                    let args = [
                        "run".to_owned(),
                        "--config".to_owned(),
                        world.path(config, &root),
                    ];
                    let name = world.devices[i].id.clone();
                    world.spawn(&name, &bin("flotilla-agent"), &args, &root);
                }
            }
            ["flotilla-agent", "identity", "--config", config] => {
                // "made on first start": asked until the running agent has made it.
                for i in 0..world.devices.len() {
                    let root = world.devices[i].root.clone();
                    let args = [
                        "identity".to_owned(),
                        "--config".to_owned(),
                        world.path(config, &root),
                    ];
                    let deadline = Instant::now() + WAIT;
                    let key = loop {
                        let out = world.run(&bin("flotilla-agent"), &args, &root);
                        let key = String::from_utf8_lossy(&out.stdout).trim().to_owned();
                        if out.status.success() && key.len() == 64 {
                            break key;
                        }
                        assert!(Instant::now() < deadline, "{command}: {out:?}");
                        std::thread::sleep(Duration::from_millis(200));
                    };
                    world.devices[i].key = Some(key);
                }
            }
            ["export", assignments @ ..] => {
                for assignment in assignments {
                    let (name, value) = assignment.split_once('=').expect("NAME=VALUE");
                    let value = world.path(value, &host);
                    world.env.retain(|(n, _)| n != name);
                    world.env.push((name.to_owned(), value));
                }
                // The operator's copies of the CA's certificate and of its password.
                if let Some((_, file)) = world
                    .env
                    .iter()
                    .find(|(n, _)| n == "FLOTILLA_BROKER_PASSWORD_FILE")
                {
                    let file = PathBuf::from(file);
                    fs::create_dir_all(file.parent().expect("~/.flotilla")).expect("~/.flotilla");
                    fs::write(&file, &world.passwords["flotilla-operator"]).expect("password");
                }
                if let Some((_, file)) = world
                    .env
                    .iter()
                    .find(|(n, _)| n == "FLOTILLA_BROKER_CA_FILE")
                {
                    fs::copy(world.home.join("flotilla-ca/ca.crt"), file).expect("ca.crt");
                }
            }
            ["flotilla", "devices", "pending"] => {
                let ids: Vec<String> = world.devices.iter().map(|d| d.id.clone()).collect();
                until(
                    &world,
                    command,
                    "both devices wait for enrollment",
                    |text| ids.iter().all(|id| text.contains(id.as_str())),
                );
            }
            ["flotilla", "devices", "accept", id, "--key", _] => {
                for device in &world.devices {
                    let key = device.key.as_deref().expect("the device printed its key");
                    let line = command
                        .replace(id, &device.id)
                        .replace(words[5], &key[..16]);
                    ok(world.flotilla(&line), &line);
                }
            }
            ["flotilla", "devices"] => {
                let ids: Vec<String> = world.devices.iter().map(|d| d.id.clone()).collect();
                until(
                    &world,
                    "flotilla devices --json",
                    "both devices online",
                    |text| {
                        serde_json::from_str::<Vec<Value>>(text).is_ok_and(|list| {
                            ids.iter().all(|id| {
                                list.iter()
                                    .any(|d| d["id"] == id.as_str() && d["online"] == true)
                            })
                        })
                    },
                );
                let out = ok(world.flotilla(command), command);
                assert!(ids.iter().all(|id| out.contains(id.as_str())), "{out}");
            }
            ["flotilla", "rollout", "create", "--spec", file] => {
                fs::write(world.work.join(file), spec).expect("the README's spec");
                ok(world.flotilla(command), command);
            }
            ["flotilla", "rollout", "status", name, "--watch"] => {
                let out = world.flotilla(command);
                let text = ok(out, command);
                let last = text
                    .rsplit(&format!("rollout {name}  release "))
                    .next()
                    .unwrap_or_default();
                assert!(last.contains("state finished"), "{text}");
                finished = true;
                break;
            }
            ["flotilla", ..] => {
                ok(world.flotilla(command), command);
            }
            _ => panic!("the README has a step this test does not know: {command}"),
        }
    }
    assert!(
        finished,
        "the README's steps reach `rollout status NAME --watch`"
    );
    for device in &world.devices {
        let installed = fs::read(device.root.join("opt/app/app.bin")).unwrap_or_default();
        assert_eq!(installed, app, "{} runs fw-2.4.0", device.id);
    }
}
