//! `flotilla serve` takes its broker settings from the command line and the environment, not
//! only from its config file: a flag wins over its environment variable, which wins over the
//! config file (docs/operations.md, "Where `flotilla serve` takes its settings").
//!
//! Each coordinator here gets a config file that names a port where nothing listens, so it can
//! only answer the CLI if the setting given outside the file took effect.

use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use flotilla_tests::secure::COORDINATOR;
use flotilla_tests::{bin, free_port, BrokerKind, Site, ADMIN, WAIT};

/// A `flotilla serve` process, killed when dropped.
struct Serve {
    child: Child,
    log: PathBuf,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Serve {
    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// Writes a coordinator config whose broker is `127.0.0.1:<a port where nothing listens>` with
/// the default topic root, and the site's admin operator.
fn config_with_a_dead_broker(site: &Site) -> PathBuf {
    let path = site.path("coordinator.toml");
    let text = format!(
        "data_dir = {:?}\ncoordinator_key = {:?}\n[broker]\nhost = \"127.0.0.1\"\nport = {}\n\
         [[operators]]\nname = {ADMIN:?}\nrole = \"admin\"\nkey_file = {:?}\n",
        site.path("coordinator"),
        site.path("keys/coordinator.key"),
        free_port(),
        site.path(&format!("keys/{ADMIN}.pub")),
    );
    fs::write(&path, text).expect("write coordinator config");
    path
}

/// Starts `flotilla serve --config CONFIG ARGS` with exactly `env` of the FLOTILLA_ variables.
fn serve(site: &Site, config: &PathBuf, args: &[&str], env: &[(&str, String)]) -> Serve {
    let log = site.path(&format!("serve-{}.log", free_port()));
    let out = fs::File::create(&log).expect("create log");
    let mut command = Command::new(bin("flotilla"));
    command.args(["serve", "--config"]).arg(config).args(args);
    for (name, _) in std::env::vars() {
        if name.starts_with("FLOTILLA_") {
            command.env_remove(name);
        }
    }
    command
        .envs(env.iter().map(|(k, v)| (*k, v)))
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("clone log"))
        .stderr(out);
    let child = command.spawn().expect("start flotilla serve");
    Serve { child, log }
}

/// Asks the coordinator for its rollouts through the CLI until it answers; panics with the
/// coordinator's log when it does not answer within [`WAIT`].
fn answers(site: &Site, coordinator: &mut Serve, cli_args: &[&str]) {
    let deadline = Instant::now() + WAIT;
    let mut args = cli_args.to_vec();
    args.extend(["rollout", "status", "--json"]);
    loop {
        let out = site.flotilla_output(&args);
        if out.status.success() {
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(stdout.trim_start().starts_with('['), "{stdout}");
            return;
        }
        if let Ok(Some(status)) = coordinator.child.try_wait() {
            panic!("the coordinator exited ({status}):\n{}", coordinator.log());
        }
        assert!(
            Instant::now() < deadline,
            "the coordinator did not answer `flotilla {args:?}` within {WAIT:?}: {}\ncoordinator log:\n{}",
            String::from_utf8_lossy(&out.stderr),
            coordinator.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn broker_and_topic_root_flags_replace_the_config_file() {
    let site = Site::new(BrokerKind::Embedded);
    let config = config_with_a_dead_broker(&site);
    let broker = format!("127.0.0.1:{}", site.port);
    let mut coordinator = serve(
        &site,
        &config,
        &["--broker", &broker, "--topic-root", "acme"],
        &[],
    );
    answers(&site, &mut coordinator, &["--topic-root", "acme"]);
    // The default root is not where it listens.
    let other = site.flotilla_output(&["rollout", "status"]);
    assert!(
        !other.status.success(),
        "the coordinator answered on the default topic root"
    );
}

#[test]
fn environment_variables_replace_the_config_file_and_flags_win_over_them() {
    let site = Site::new(BrokerKind::Embedded);
    let config = config_with_a_dead_broker(&site);
    let broker = format!("127.0.0.1:{}", site.port);
    let mut coordinator = serve(
        &site,
        &config,
        &[],
        &[
            ("FLOTILLA_BROKER", broker.clone()),
            ("FLOTILLA_TOPIC_ROOT", "from-env".to_owned()),
        ],
    );
    answers(&site, &mut coordinator, &["--topic-root", "from-env"]);
    drop(coordinator);

    // FLOTILLA_BROKER names the dead port; --broker on the command line wins.
    let dead = format!("127.0.0.1:{}", free_port());
    let mut coordinator = serve(
        &site,
        &config,
        &["--broker", &broker],
        &[("FLOTILLA_BROKER", dead)],
    );
    answers(&site, &mut coordinator, &[]);
}

#[test]
fn login_and_tls_flags_replace_the_config_file() {
    // Mosquitto as deploy/mosquitto ships it: TLS only, and the coordinator must log in.
    let site = Site::new(BrokerKind::Secure);
    let config = config_with_a_dead_broker(&site);
    let secure = site.secure();
    let broker = format!("127.0.0.1:{}", secure.tls_port);
    let password = secure.password_file(COORDINATOR);
    let ca = secure.ca_file();
    let mut coordinator = serve(
        &site,
        &config,
        &[
            "--broker",
            &broker,
            "--username",
            COORDINATOR,
            "--password-file",
            &password.to_string_lossy(),
            "--ca-file",
            &ca.to_string_lossy(),
        ],
        &[],
    );
    // The CLI logs in as the operator (Site::flotilla_output adds its login flags).
    answers(&site, &mut coordinator, &[]);
}

/// The README's operator exports FLOTILLA_BROKER_USERNAME and FLOTILLA_BROKER_PASSWORD_FILE for
/// the CLI; a coordinator started from that shell still logs in as itself (its config file),
/// says it ignored them, and answers.
#[test]
fn serve_ignores_the_clis_login_variables() {
    use flotilla_tests::secure::OPERATOR;
    let site = Site::new(BrokerKind::Secure);
    let secure = site.secure();
    let config = site.path("coordinator-login.toml");
    let text = format!(
        "data_dir = {:?}\ncoordinator_key = {:?}\n[broker]\nhost = \"127.0.0.1\"\nport = {}\n\
         username = {COORDINATOR:?}\npassword_file = {:?}\n[broker.tls]\nca_file = {:?}\n\
         [[operators]]\nname = {ADMIN:?}\nrole = \"admin\"\nkey_file = {:?}\n",
        site.path("coordinator"),
        site.path("keys/coordinator.key"),
        secure.tls_port,
        secure.password_file(COORDINATOR),
        secure.ca_file(),
        site.path(&format!("keys/{ADMIN}.pub")),
    );
    fs::write(&config, text).expect("write coordinator config");
    let operator_login = [
        ("FLOTILLA_BROKER_USERNAME", OPERATOR.to_owned()),
        (
            "FLOTILLA_BROKER_PASSWORD_FILE",
            secure.password_file(OPERATOR).display().to_string(),
        ),
    ];
    let mut coordinator = serve(&site, &config, &[], &operator_login);
    answers(&site, &mut coordinator, &[]);
    let log = coordinator.log();
    assert!(
        log.contains("ignoring FLOTILLA_BROKER_USERNAME: it is the CLI's broker login"),
        "{log}"
    );
    assert!(log.contains(&format!("as {COORDINATOR} client=")), "{log}");
}

#[test]
fn settings_that_cannot_apply_are_refused_naming_where_they_came_from() {
    let site = Site::new(BrokerKind::Embedded);
    let config = config_with_a_dead_broker(&site);
    let run = |args: &[&str], env: &[(&str, String)]| {
        let mut coordinator = serve(&site, &config, args, env);
        let deadline = Instant::now() + WAIT;
        let status = loop {
            if let Some(status) = coordinator.child.try_wait().expect("wait") {
                break status;
            }
            assert!(Instant::now() < deadline, "serve {args:?} kept running");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(
            !status.success(),
            "serve {args:?} {env:?} should be refused"
        );
        coordinator.log()
    };
    let text = run(&[], &[("FLOTILLA_BROKER", "nohost".to_owned())]);
    assert!(
        text.contains("FLOTILLA_BROKER \"nohost\" is invalid"),
        "{text}"
    );
    let text = run(&["--topic-root", "a/#"], &[]);
    assert!(text.contains("--topic-root \"a/#\" is invalid"), "{text}");
    let embedded = format!("127.0.0.1:{}", free_port());
    let text = run(
        &["--embedded-broker", &embedded, "--broker", "10.1.2.3:1883"],
        &[],
    );
    assert!(
        text.contains("--broker \"10.1.2.3:1883\"") && text.contains("embedded broker"),
        "{text}"
    );
    let text = run(
        &["--embedded-broker", &embedded],
        &[("FLOTILLA_BROKER_CA_FILE", "ca.crt".to_owned())],
    );
    assert!(
        text.contains("FLOTILLA_BROKER_CA_FILE \"ca.crt\"") && text.contains("embedded broker"),
        "{text}"
    );
    let text = run(
        &["--embedded-broker", &embedded, "--username", "someone"],
        &[],
    );
    assert!(
        text.contains("--username \"someone\"") && text.contains("embedded broker"),
        "{text}"
    );
    let text = run(&["--operator-key", "alice.key"], &[]);
    assert!(
        text.contains("--operator-key is not used by `flotilla serve`"),
        "{text}"
    );
}

/// The embedded broker has no login, TLS or ACL: `serve` refuses to run it on an address other
/// than loopback, saying why, unless the operator insists; then it runs there with a warning.
#[test]
fn an_embedded_broker_beyond_loopback_is_refused_unless_insisted_on() {
    let site = Site::new(BrokerKind::Embedded);
    let config = config_with_a_dead_broker(&site);
    let port = free_port();
    let anywhere = format!("0.0.0.0:{port}");
    let mut refused = serve(&site, &config, &["--embedded-broker", &anywhere], &[]);
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = refused.child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "serve --embedded-broker {anywhere} kept running:\n{}",
            refused.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success());
    let text = refused.log();
    assert!(
        text.contains(&format!("--embedded-broker \"{anywhere}\" is invalid"))
            && text.contains("no login, no TLS and no ACL")
            && text.contains("--insecure-embedded-broker"),
        "{text}"
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "nothing listens on {anywhere}"
    );

    let mut insisted = serve(
        &site,
        &config,
        &["--embedded-broker", &anywhere, "--insecure-embedded-broker"],
        &[],
    );
    let deadline = Instant::now() + WAIT;
    while !insisted
        .log()
        .contains("embedded MQTT broker listening beyond loopback")
    {
        if let Ok(Some(status)) = insisted.child.try_wait() {
            panic!("the coordinator exited ({status}):\n{}", insisted.log());
        }
        assert!(
            Instant::now() < deadline,
            "no warning about the open broker:\n{}",
            insisted.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(insisted.log().contains("WARN"), "{}", insisted.log());
    std::net::TcpStream::connect(("127.0.0.1", port)).expect("the broker listens");
}
