//! End-to-end: the Python example client (`examples/python/flotilla_client.py`, paho-mqtt and
//! PyNaCl) drives a real coordinator: it creates a staged run, starts it, watches its status
//! events, approves its gate and watches it finish, signing every request with an operator key.
//!
//! It runs Debian's `/usr/bin/python3` (the packages python3-paho-mqtt and python3-nacl install
//! for it; `.ci/run` installs them). A missing interpreter or module fails the test loudly: it
//! never skips.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use flotilla_protocol::operator::Role;
use flotilla_tests::{AgentOptions, BrokerKind, Site};

const PYTHON: &str = "/usr/bin/python3";

const STRATEGY: &str = r#"
[[stage]]
name = "lab"
select = "env=lab"
before = { approval = true }
"#;

const RUN: &str = r#"
name = "py-run"
release = "fw-3"
[staged]
strategy = "gated"
"#;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/python/flotilla_client.py")
}

/// Fails with instructions unless the interpreter and both modules are there.
fn require_python() {
    let out = Command::new(PYTHON)
        .args(["-c", "import paho.mqtt.client, nacl.signing"])
        .output()
        .unwrap_or_else(|e| {
            panic!("{PYTHON} cannot run ({e}); install python3, python3-paho-mqtt and python3-nacl")
        });
    assert!(
        out.status.success(),
        "{PYTHON} lacks paho-mqtt or PyNaCl; apt-get install python3-paho-mqtt python3-nacl\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn python(site: &Site, args: &[&str]) -> Output {
    Command::new(PYTHON)
        .arg(script())
        .args(["--broker", &format!("127.0.0.1:{}", site.port)])
        .arg("--key")
        .arg(site.operator_key_file("py"))
        .args(args)
        .env_remove("FLOTILLA_OPERATOR_KEY")
        .output()
        .expect("run the python client")
}

fn ok(site: &Site, args: &[&str]) -> String {
    let out = python(site, args);
    assert!(
        out.status.success(),
        "flotilla_client.py {args:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_creates_starts_watches_and_approves() {
    require_python();
    let mut site = Site::new(BrokerKind::Embedded);
    site.add_operator("py", Role::Operator);
    site.release("fw-3", 3, b"firmware 3 from python\n");
    site.start_coordinator();
    site.add_agent("lab-1", &[("env", "lab")], AgentOptions::default());
    site.wait_devices(1).await;
    let strategy = site.path("gated.toml");
    fs::write(&strategy, STRATEGY).expect("write strategy");
    site.flotilla(&[
        "strategy",
        "create",
        "gated",
        "--file",
        &strategy.to_string_lossy(),
    ]);
    let spec = site.path("py-run.toml");
    fs::write(&spec, RUN).expect("write spec");
    let spec = spec.to_string_lossy().into_owned();

    let out = ok(&site, &["create", "--spec", &spec]);
    assert!(out.contains("created py-run (ready)"), "{out}");
    let out = ok(&site, &["start", "py-run"]);
    assert!(out.contains("py-run: running"), "{out}");
    let out = ok(
        &site,
        &["watch", "py-run", "--until-approval", "--for", "60"],
    );
    assert!(out.contains("pending approval: py-run-before-lab"), "{out}");
    let out = ok(&site, &["approve", "py-run-before-lab"]);
    assert!(out.contains("approved py-run-before-lab"), "{out}");
    let out = ok(
        &site,
        &[
            "watch",
            "py-run",
            "--until",
            "finished,failed,stopped,paused",
            "--for",
            "60",
        ],
    );
    assert!(
        out.lines()
            .last()
            .is_some_and(|l| l.starts_with("py-run: finished")),
        "{out}"
    );
    assert_eq!(
        fs::read(site.target_file("lab-1")).expect("target"),
        b"firmware 3 from python\n"
    );

    // The status the Python client reads names who did what.
    let status: serde_json::Value =
        serde_json::from_str(&ok(&site, &["status", "py-run"])).expect("status JSON");
    // Its devices come a page at a time, every one of them.
    let devices = status["device_list"].as_array().expect("device_list");
    assert!(
        devices
            .iter()
            .any(|d| d["id"] == "lab-1" && d["phase"] == "ready"),
        "{status}"
    );
    let trace: Vec<&str> = status["trace"]
        .as_array()
        .expect("trace")
        .iter()
        .filter_map(|t| t["message"].as_str())
        .collect();
    for needle in [
        "created by py",
        "rollout started by py",
        "approval py-run-before-lab approved by py",
    ] {
        assert!(
            trace.iter().any(|m| m.contains(needle)),
            "{needle}: {trace:#?}"
        );
    }

    // A refusal comes back as the coordinator's text and exit code 1.
    let out = python(&site, &["approve", "no-such-approval"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("refused: no approval request named"),
        "{stderr}"
    );
}

/// The example logs in as the CLI does on the README's TLS broker: a user name and password over
/// TLS checked against the CA; a wrong password or a plain connection to the TLS port is a
/// clear refusal, not a traceback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_logs_in_over_tls_and_says_why_when_refused() {
    require_python();
    let mut site = Site::new(BrokerKind::Secure);
    site.add_operator("py", Role::Operator);
    site.start_coordinator();
    let secure = site.secure();
    let tls_port = secure.tls_port;
    let run = |extra: &[String]| {
        Command::new(PYTHON)
            .arg(script())
            .args([
                "--broker",
                &format!("127.0.0.1:{tls_port}"),
                "--timeout",
                "5",
            ])
            .arg("--key")
            .arg(site.operator_key_file("py"))
            .args(extra)
            .args(["approve", "no-such-approval"])
            .env_remove("FLOTILLA_OPERATOR_KEY")
            .env_remove("FLOTILLA_BROKER_USERNAME")
            .env_remove("FLOTILLA_BROKER_PASSWORD_FILE")
            .env_remove("FLOTILLA_BROKER_CA_FILE")
            .output()
            .expect("run the python client")
    };
    let login = |password: &std::path::Path| {
        vec![
            "--ca-file".to_owned(),
            secure.ca_file().to_string_lossy().into_owned(),
            "--username".to_owned(),
            flotilla_tests::secure::OPERATOR.to_owned(),
            "--password-file".to_owned(),
            password.to_string_lossy().into_owned(),
        ]
    };
    // Through TLS with the operator's login, the request reaches the coordinator, which answers.
    let out = run(&login(
        &secure.password_file(flotilla_tests::secure::OPERATOR),
    ));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("refused: no approval request named"),
        "the coordinator answered: {err}"
    );
    // A wrong password: the broker's refusal, in words.
    let wrong = site.path("wrong.password");
    fs::write(&wrong, "not the password\n").expect("write");
    let out = run(&login(&wrong));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("refused the connection") && !err.contains("Traceback"),
        "{err}"
    );
    // Plain MQTT to the TLS port: a time-out that says what to check, not a traceback.
    let out = run(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("Traceback"), "{err}");
    assert!(
        err.contains("TLS expected?") || err.contains("refused"),
        "{err}"
    );
}
