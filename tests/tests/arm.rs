//! End-to-end on ARM: the aarch64 build of `flotilla-agent`, run under qemu-user, takes part in
//! a rollout beside an x86-64 agent, through a real Mosquitto broker (the shipped TLS setup: the
//! agents log in with client certificates) and a real coordinator.
//!
//! The ARM binary is `$FLOTILLA_ARM_AGENT`, or else
//! `<target dir>/aarch64-unknown-linux-gnu/release/flotilla-agent` (build it with
//! `cargo build --release -p flotilla-agent --target aarch64-unknown-linux-gnu`). Without it,
//! qemu-aarch64-static, the aarch64 C library or Mosquitto, the test says loudly that it skips
//! and passes, so `cargo test --workspace` works on a machine without ARM tools; with
//! `FLOTILLA_REQUIRE_ARM=1` (set by `.ci/run`'s ARM step) any of them missing fails it.
//!
//! The skip notice goes to the process's stderr itself, not through `eprintln!`: the test
//! harness keeps what a passing test prints with `eprintln!` to itself, so the notice would
//! never show and the skipped test would read as a plain "ok".

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use flotilla_tests::{mosquitto_binary, AgentOptions, BrokerKind, Site, WAIT};

const TARGET: &str = "aarch64-unknown-linux-gnu";
/// The aarch64 C library and loader from Debian's libc6-arm64-cross, for qemu's `-L`.
const SYSROOT: &str = "/usr/aarch64-linux-gnu";

/// The aarch64 agent binary: `FLOTILLA_ARM_AGENT`, `$CARGO_TARGET_DIR/<target>/release`, or the
/// target directory this test executable was built in.
fn arm_agent() -> PathBuf {
    if let Some(path) = std::env::var_os("FLOTILLA_ARM_AGENT") {
        return PathBuf::from(path);
    }
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            // target/debug/deps/arm-<hash> -> target
            let exe = std::env::current_exe().ok()?;
            Some(exe.parent()?.parent()?.parent()?.to_path_buf())
        })
        .unwrap_or_else(|| PathBuf::from("target"));
    target_dir
        .join(TARGET)
        .join("release")
        .join("flotilla-agent")
}

/// The first program named `name` on PATH.
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The command that runs the ARM agent, or why it cannot run here.
fn arm_launcher() -> Result<Vec<String>, String> {
    let agent = arm_agent();
    if !agent.is_file() {
        return Err(format!(
            "no aarch64 agent at {} (cargo build --release -p flotilla-agent --target {TARGET})",
            agent.display()
        ));
    }
    let qemu = on_path("qemu-aarch64-static")
        .ok_or("qemu-aarch64-static is not on PATH (apt-get install qemu-user-static)")?;
    if !Path::new(SYSROOT)
        .join("lib/ld-linux-aarch64.so.1")
        .exists()
    {
        return Err(format!(
            "no aarch64 loader under {SYSROOT} (apt-get install libc6-arm64-cross)"
        ));
    }
    if mosquitto_binary().is_none() {
        return Err("mosquitto is not installed".to_owned());
    }
    Ok(vec![
        qemu.display().to_string(),
        "-L".to_owned(),
        SYSROOT.to_owned(),
        agent.display().to_string(),
    ])
}

/// The launcher, or None after a loud skip message; panics instead when ARM is required.
fn arm_or_skip(test: &str) -> Option<Vec<String>> {
    match arm_launcher() {
        Ok(launcher) => Some(launcher),
        Err(why) if std::env::var_os("FLOTILLA_REQUIRE_ARM").is_some_and(|v| v == "1") => {
            panic!("FLOTILLA_REQUIRE_ARM=1 but the ARM agent cannot run: {why}")
        }
        Err(why) => {
            say_skipped(test, &why);
            None
        }
    }
}

/// Writes the skip notice where the test output shows it even when the test passes.
fn say_skipped(test: &str, why: &str) {
    use std::io::Write as _;
    let notice = format!(
        "\n!!!! SKIPPED {test}: {why}\n\
         !!!! it reports \"ok\" but tested nothing; FLOTILLA_REQUIRE_ARM=1 makes this a failure\n"
    );
    let _ = std::io::stderr().lock().write_all(notice.as_bytes());
}

/// Runs one test of this file in a child process without the ARM agent, as `cargo test` on a
/// machine without ARM tools would, and checks that its output says it skipped.
#[test]
fn a_skipped_arm_test_says_so_in_the_test_output() {
    let test = "arm_agent_binary_is_aarch64_and_runs_under_qemu";
    let output = Command::new(std::env::current_exe().expect("this test executable"))
        .args([test, "--exact"])
        .env("FLOTILLA_ARM_AGENT", "/nonexistent/flotilla-agent")
        .env_remove("FLOTILLA_REQUIRE_ARM")
        .output()
        .expect("run the test executable");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{text}");
    assert!(
        text.contains(&format!(
            "SKIPPED {test}: no aarch64 agent at /nonexistent/flotilla-agent"
        )),
        "the skip is not in the test output:\n{text}"
    );
}

#[test]
fn arm_agent_binary_is_aarch64_and_runs_under_qemu() {
    let Some(launcher) = arm_or_skip("arm_agent_binary_is_aarch64_and_runs_under_qemu") else {
        return;
    };
    // ELF header: e_machine at offset 18 is 183 (EM_AARCH64) for an aarch64 executable.
    let header = fs::read(&launcher[3]).expect("read ARM agent binary");
    assert_eq!(
        &header[..4],
        b"\x7fELF",
        "{} is not an ELF file",
        launcher[3]
    );
    assert_eq!(
        u16::from_le_bytes([header[18], header[19]]),
        183,
        "{} is not an aarch64 executable",
        launcher[3]
    );
    let output = Command::new(&launcher[0])
        .args(&launcher[1..])
        .arg("--version")
        .output()
        .expect("run the ARM agent under qemu");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && text.starts_with("flotilla-agent "),
        "ARM agent --version: {text}{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arm_agent_installs_a_release_through_mosquitto() {
    let Some(launcher) = arm_or_skip("arm_agent_installs_a_release_through_mosquitto") else {
        return;
    };
    // Mosquitto as deploy/mosquitto ships it: the ARM agent logs in over mutual TLS with its
    // client certificate, so rustls and ring run on aarch64 too.
    let mut site = Site::new(BrokerKind::Secure);
    // 600 KiB: several blocks, so the ARM agent's fetcher and hashing really stream.
    let artifact: Vec<u8> = (0..600 * 1024u32).map(|i| (i % 253) as u8).collect();
    site.release("fw-arm", 2, &artifact);
    site.start_coordinator();
    let arm = AgentOptions {
        launcher: Some(launcher.clone()),
        ..AgentOptions::default()
    };
    site.add_agent("arm-01", &[("arch", "arm64")], arm);
    site.add_agent("x86-01", &[("arch", "x86_64")], AgentOptions::default());
    site.wait_devices(2).await;

    site.create_and_start(
        r#"
name = "fw-arm-rollout"
release = "fw-arm"
[groups]
count = 2
success = { threshold = "100%", action = "next" }
error = { threshold = "50%", action = "pause" }
"#,
    )
    .await;
    // Emulation is several times slower than the host: allow it more than the usual bound.
    let status = site
        .wait_status(
            "fw-arm-rollout",
            "the rollout with an ARM agent to finish",
            WAIT * 3,
            |s| s.state == "finished" || s.state == "paused",
        )
        .await;
    assert_eq!(status.state, "finished", "{status:#?}");
    assert!(
        status.groups.iter().all(|g| g.ready == g.total),
        "every device ready: {status:#?}"
    );
    for id in ["arm-01", "x86-01"] {
        assert!(
            fs::read(site.target_file(id)).expect("target file") == artifact,
            "{id} installed the release's artifact byte for byte"
        );
    }

    // The ARM agent's own status command, also under qemu, records the installed release.
    let output = Command::new(&launcher[0])
        .args(&launcher[1..])
        .args(["status", "--config"])
        .arg(site.agent_config("arm-01"))
        .output()
        .expect("run the ARM agent's status command");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        text.contains("installed: fw-arm 2.0.0 (counter 2)"),
        "arm-01 status: {text}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let listed = site.flotilla(&["devices"]);
    assert!(
        listed.contains("arm-01") && listed.contains("fw-arm"),
        "devices table: {listed}"
    );
}
