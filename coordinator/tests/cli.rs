//! The `flotilla` binary as an operator on an offline signing machine uses it: keys, releases,
//! verification, the default config. (Its presence also makes `cargo test --workspace` build
//! the `flotilla` binary that the end-to-end tests in `tests/` run.)

use std::fs;
use std::process::{Command, Output};

fn flotilla(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(args)
        .env_remove("FLOTILLA_OPERATOR_KEY")
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
    // A person reads the times as RFC 3339 (2026-11-27T11:37:27Z), not as Unix seconds.
    let shown = ok(&["release", "inspect", "--data-dir", &d("data"), "fw-2.4.0"]);
    for field in ["created", "expires"] {
        let when = shown
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .map(str::trim)
            .unwrap_or_else(|| panic!("no {field} in:\n{shown}"));
        assert!(
            when.len() == 20 && when.as_bytes()[10] == b'T' && when.ends_with('Z'),
            "{field} {when:?} in:\n{shown}"
        );
    }
    // The block list that adaptive and peer downloads use is named, with its block size: it is
    // the second file in the artifact store.
    let artifact = &inspected["artifacts"][0];
    assert_eq!(artifact["block_size"], 65536, "{inspected}");
    let list = artifact["block_list_sha256"]
        .as_str()
        .expect("the block list's digest");
    assert!(
        dir.path().join("data/artifacts").join(list).is_file(),
        "{inspected}"
    );
    let listed: serde_json::Value = serde_json::from_str(&ok(&[
        "release",
        "list",
        "--data-dir",
        &d("data"),
        "--json",
    ]))
    .expect("list --json");
    assert_eq!(listed[0]["artifacts"][0], *artifact, "{listed}");
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
    let stored = fs::read_dir(dir.path().join("data/artifacts"))
        .expect("artifact store")
        .count();
    assert_eq!(
        stored, 2,
        "one content-addressed artifact and its block list"
    );
    let digest = inspected["artifacts"][0]["sha256"]
        .as_str()
        .expect("the artifact's digest");
    fs::write(dir.path().join("data/artifacts").join(digest), b"app 6.6.6").expect("tamper");
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

/// A block list over 0.1% of its artifact (docs/peers.md) still makes a release, with a
/// warning on stderr naming the artifact, the block size and the overhead.
#[test]
fn release_create_warns_when_a_block_list_is_over_a_tenth_of_a_percent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = |p: &str| dir.path().join(p).to_string_lossy().into_owned();
    ok(&["keygen", "--out", &d("keys")]);
    fs::write(dir.path().join("rootfs.img"), vec![5u8; 1 << 20]).expect("artifact");
    let create = |name: &str, block_size: &str| {
        let out = flotilla(&[
            "release",
            "create",
            "--data-dir",
            &d("data"),
            "--key",
            &d("keys/release.key"),
            "--name",
            name,
            "--version",
            "1.0.0",
            "--counter",
            "1",
            "--artifact",
            &format!("rootfs={}", d("rootfs.img")),
            "--block-size",
            block_size,
        ]);
        assert!(out.status.success(), "{out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(stdout.starts_with("created "), "{stdout}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let warned = create("fw-small-blocks", "1024");
    assert_eq!(
        warned,
        "warning: artifact rootfs.img (1048576 bytes): its block list at 1 KiB blocks is 32768 \
         bytes, 3.1% of the artifact, over the 0.1% bound; --block-size 65536 would make it \
         0.049%\n"
    );
    let quiet = create("fw-default-blocks", "65536");
    assert_eq!(quiet, "", "0.049% is within the bound");
}

#[test]
fn default_config_is_printable() {
    let text = ok(&["serve", "--print-default-config"]);
    assert!(
        text.contains("data_dir") && text.contains("[broker]"),
        "{text}"
    );
}

#[test]
fn serve_help_says_where_each_setting_comes_from() {
    let text = ok(&["serve", "--help"]);
    assert!(
        text.contains("a flag on the command line wins over its environment variable, which wins over the\nconfig file"),
        "{text}"
    );
    for line in [
        "--broker HOST:PORT    FLOTILLA_BROKER                 broker.host, broker.port",
        "--topic-root ROOT     FLOTILLA_TOPIC_ROOT             broker.topic_root",
        "--client-key          FLOTILLA_BROKER_CLIENT_KEY      broker.tls.client_key",
    ] {
        assert!(text.contains(line), "{line} missing from:\n{text}");
    }
}

/// Runs flotilla against a broker address where nothing listens, so a test that got past
/// argument checking would fail with a connection error instead of the expected one.
fn refused(args: &[&str]) -> String {
    let mut all = vec!["--broker", "127.0.0.1:9"];
    all.extend_from_slice(args);
    let out = flotilla(&all);
    assert!(!out.status.success(), "flotilla {args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn operations_commands_check_their_arguments_before_connecting() {
    let err = refused(&["group", "create", "kitchens"]);
    assert!(err.contains("--select"), "{err}");

    let err = refused(&[
        "group", "create", "kitchens", "--select", "site=a", "--label", "tier",
    ]);
    assert!(
        err.contains("--label") && err.contains("expected KEY=VALUE like tier=1"),
        "{err}"
    );
    let err = refused(&["group", "create", "k", "--select", "a=b", "--label", "=1"]);
    assert!(err.contains("expected KEY=VALUE"), "{err}");

    let err = refused(&["devices", "delete"]);
    assert!(err.contains("<ID>"), "{err}");
    let err = refused(&["approve"]);
    assert!(err.contains("<NAME>"), "{err}");
    let err = refused(&["rollout", "retry"]);
    assert!(err.contains("<NAME>"), "{err}");

    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("two-stage.toml");
    let err = refused(&[
        "strategy",
        "create",
        "two-stage",
        "--file",
        &missing.to_string_lossy(),
    ]);
    assert!(
        err.contains("cannot read strategy file") && err.contains("two-stage.toml"),
        "{err}"
    );
}

#[test]
fn help_lists_the_operations_commands() {
    let help = ok(&["--help"]);
    assert!(help.contains("--operator-key"), "{help}");
    for command in [
        "approve",
        "approvals",
        "strategy",
        "group",
        "devices",
        "operator",
    ] {
        assert!(
            help.lines()
                .any(|l| l.trim_start().starts_with(&format!("{command} "))),
            "{command} missing from:\n{help}"
        );
    }
    let devices = ok(&["devices", "--help"]);
    for command in ["pending", "accept", "reject", "revoke", "delete"] {
        assert!(
            devices
                .lines()
                .any(|l| l.trim_start().starts_with(&format!("{command} "))),
            "{command} missing from:\n{devices}"
        );
    }
    let rollout = ok(&["rollout", "--help"]);
    assert!(
        rollout.contains("next") && rollout.contains("retry"),
        "{rollout}"
    );
}

#[test]
fn operator_keygen_writes_a_private_key_and_requests_need_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("ops");
    let text = ok(&[
        "operator",
        "keygen",
        "--out",
        &out.to_string_lossy(),
        "--name",
        "alice",
    ]);
    let public = fs::read_to_string(out.join("alice.pub")).expect("public key");
    assert!(
        text.contains("[[operators]]") && text.contains(public.trim()),
        "{text}"
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = fs::metadata(out.join("alice.key"))
            .expect("secret key")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    let again = flotilla(&[
        "operator",
        "keygen",
        "--out",
        &out.to_string_lossy(),
        "--name",
        "alice",
    ]);
    assert!(!again.status.success(), "no silent overwrite");

    // Without a key, a request is not even sent.
    let err = refused(&["rollout", "status"]);
    assert!(
        err.contains("no operator key")
            && err.contains("--operator-key")
            && err.contains("FLOTILLA_OPERATOR_KEY"),
        "{err}"
    );
}

/// `flotilla … | head`: the reader stops early and closes the pipe. The command ends quietly
/// with exit code 0, not with a panic and a backtrace. 5,000 tokens are far more than a pipe
/// holds, so the write that finds the pipe closed always comes.
#[test]
fn a_closed_pipe_ends_a_command_quietly() {
    {
        let args = ["enrollment", "token", "--count", "5000"];
        let mut child = Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run flotilla");
        drop(child.stdout.take());
        let out = child.wait_with_output().expect("wait");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn rollout_help_describes_every_command_and_flag() {
    let text = ok(&["rollout", "--help"]);
    for (command, words) in [
        ("start", "Start a created rollout"),
        ("pause", "Pause a rollout"),
        ("resume", "Resume a paused rollout"),
        ("stop", "Stop a rollout for good"),
        ("list", "List every rollout, one line each"),
    ] {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(command))
            .unwrap_or_else(|| panic!("no {command} in:\n{text}"));
        assert!(line.contains(words), "{command}: {line}");
    }
    let text = ok(&["rollout", "status", "--help"]);
    for words in [
        "[NAME]  The rollout to show",
        "--json",
        "Print JSON instead of text",
        "--watch",
        "0 finished, 3 failed, 4 stopped",
    ] {
        assert!(text.contains(words), "{words:?} missing from:\n{text}");
    }
    let err = flotilla(&["rollout", "status", "--watch"]);
    assert_eq!(err.status.code(), Some(2), "--watch needs a name");
}

#[test]
fn version_names_the_commit_and_its_date() {
    let out = flotilla(&["--version"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    // "flotilla 0.1.0 (commit 1a2b3c4d5e6f, 2026-11-27)", or "unknown" outside a git checkout.
    let inside = text
        .split_once("(commit ")
        .and_then(|(_, rest)| rest.trim_end().strip_suffix(')'))
        .unwrap_or_else(|| panic!("{text}"));
    let (commit, date) = inside.split_once(", ").unwrap_or_else(|| panic!("{text}"));
    assert!(
        commit == "unknown"
            || (commit.len() == 12 && commit.bytes().all(|b| b.is_ascii_hexdigit())),
        "{text}"
    );
    assert!(date == "unknown" || date.len() == 10, "{text}");
}

#[test]
fn plan_warns_of_a_group_that_selects_no_device() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fleet = dir.path().join("fleet.json");
    std::fs::write(
        &fleet,
        r#"[{"id": "dev-1", "labels": {"env": "prod"}}, {"id": "dev-2", "labels": {"env": "prod"}}]"#,
    )
    .expect("fleet");
    let spec = dir.path().join("spec.toml");
    std::fs::write(
        &spec,
        "name = \"p\"\nrelease = \"fw\"\n[[groups.group]]\nname = \"canary\"\nselect = \"env=canaryy\"\n[[groups.group]]\nname = \"rest\"\n",
    )
    .expect("spec");
    let out = flotilla(&[
        "plan",
        "--spec",
        &spec.to_string_lossy(),
        "--fleet",
        &fleet.to_string_lossy(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning: group canary selects no device: it will start and succeed at once"),
        "{err}"
    );
}
