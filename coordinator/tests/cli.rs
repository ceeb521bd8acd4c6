//! The `flotilla` binary as an operator on an offline signing machine uses it: keys, releases,
//! verification, the default config. (Its presence also makes `cargo test --workspace` build
//! the `flotilla` binary that the end-to-end tests in `tests/` run.)

use std::fs;
use std::process::{Command, Output};

fn flotilla(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(args)
        .output()
        .expect("run flotilla")
}

fn ok(args: &[&str]) -> String {
    let out = flotilla(args);
    assert!(
        out.status.success(),
        "flotilla {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn keys_release_inspect_and_verify() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = |p: &str| dir.path().join(p).to_string_lossy().into_owned();
    ok(&["keygen", "--out", &d("keys")]);
    for f in [
        "release.key",
        "release.pub",
        "coordinator.key",
        "coordinator.pub",
    ] {
        assert!(dir.path().join("keys").join(f).is_file(), "{f} written");
    }
    let again = flotilla(&["keygen", "--out", &d("keys")]);
    assert!(!again.status.success(), "keygen refuses to overwrite keys");

    fs::write(dir.path().join("app.bin"), b"app 2.4.0").expect("artifact");
    ok(&[
        "release",
        "create",
        "--data-dir",
        &d("data"),
        "--key",
        &d("keys/release.key"),
        "--name",
        "fw-2.4.0",
        "--version",
        "2.4.0",
        "--counter",
        "24",
        "--hardware",
        "pi4",
        "--artifact",
        &format!("app={}", d("app.bin")),
    ]);
    let inspected: serde_json::Value = serde_json::from_str(&ok(&[
        "release",
        "inspect",
        "--data-dir",
        &d("data"),
        "fw-2.4.0",
        "--json",
    ]))
    .expect("inspect --json");
    assert_eq!(inspected["counter"], 24, "{inspected}");
    ok(&[
        "release",
        "verify",
        "--data-dir",
        &d("data"),
        "--key",
        &d("keys/release.pub"),
        "fw-2.4.0",
    ]);

    // The wrong key, and then a tampered artifact, fail verification with the reason.
    let wrong = flotilla(&[
        "release",
        "verify",
        "--data-dir",
        &d("data"),
        "--key",
        &d("keys/coordinator.pub"),
        "fw-2.4.0",
    ]);
    assert!(!wrong.status.success());
    let artifacts: Vec<_> = fs::read_dir(dir.path().join("data/artifacts"))
        .expect("artifact store")
        .collect();
    assert_eq!(artifacts.len(), 1, "one content-addressed artifact");
    fs::write(artifacts[0].as_ref().expect("entry").path(), b"app 6.6.6").expect("tamper");
    let tampered = flotilla(&[
        "release",
        "verify",
        "--data-dir",
        &d("data"),
        "--key",
        &d("keys/release.pub"),
        "fw-2.4.0",
    ]);
    assert!(!tampered.status.success());
    assert!(
        String::from_utf8_lossy(&tampered.stderr).contains("sha256"),
        "{tampered:?}"
    );
}

#[test]
fn default_config_is_printable() {
    let text = ok(&["serve", "--print-default-config"]);
    assert!(
        text.contains("data_dir") && text.contains("[broker]"),
        "{text}"
    );
}
