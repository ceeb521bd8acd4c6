//! The `flotilla-fleetsim` binary's command line: the keys file the coordinator reads, and
//! errors that name the flag. (Also makes `cargo test --workspace` build the binary that
//! `tests/tests/scale.rs` runs.)

use std::process::Command;

fn fleetsim(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_flotilla-fleetsim"))
        .args(args)
        .output()
        .expect("run flotilla-fleetsim")
}

#[test]
fn writes_an_authorized_keys_file_for_its_range() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("authorized_devices");
    let out = fleetsim(&[
        "--first",
        "100",
        "--count",
        "3",
        "--write-authorized-keys",
        &path.to_string_lossy(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&path).expect("keys file");
    let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    let ids: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    assert_eq!(ids, ["sim-000100", "sim-000101", "sim-000102"]);
    assert!(lines
        .iter()
        .all(|l| l.split_whitespace().next().map(str::len) == Some(64)));
    // The same seed writes the same keys.
    let again = dir.path().join("again");
    fleetsim(&[
        "--first",
        "100",
        "--count",
        "3",
        "--write-authorized-keys",
        &again.to_string_lossy(),
    ]);
    assert_eq!(std::fs::read_to_string(&again).expect("keys file"), text);
}

#[test]
fn bad_arguments_are_refused_naming_the_flag() {
    let out = fleetsim(&["--count", "3"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--coordinator-key"), "{err}");
    let out = fleetsim(&["--count", "3", "--baseline-groups", "2", "--offline", "2"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--offline \"2\""));
    let out = fleetsim(&["--count", "0", "--baseline-groups", "2"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--count"));
}
