//! End-to-end tests of the `ab` and `script` targets through real agent processes and a real
//! mosquitto broker. The test plays the coordinator (signs a release and a desired action,
//! serves the artifact's blocks) and the bootloader: the A/B slots are image files, the boot
//! environment is a plain file (`bootctl = "file"`), and "rebooting" is stopping the agent,
//! playing one or more boots with [`BootControl::simulate_boot`], and starting it again.
//!
//! Skipped with a notice when `mosquitto` is not installed.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::{
    config_text, coordinator, install, release, reports_until, sign_action, start_broker, TIMEOUT,
};
use flotilla_protocol::{ActionKind, Phase, Report, SignedBlob};
use flotilla_targets::bootctl::{BootControl, FileBootControl};
use flotilla_targets::Slot;
use tokio::sync::mpsc;

/// A forced install of release `os-2` whose one artifact goes to target `target`.
fn desired(device: &str, action_id: &str, target: &str, artifact: &[u8]) -> SignedBlob {
    let manifest = release("os", 2, "image.bin", target, artifact);
    sign_action(device, action_id, install(&manifest, ActionKind::Forced))
}

fn image() -> Vec<u8> {
    (0..20_000u32).map(|i| (i % 251) as u8).collect()
}

/// A device with an A/B pair of image files, a boot-environment file, and a reboot command
/// that records each call and exits (as `systemctl reboot` does before the system goes down).
struct Device {
    dir: PathBuf,
    config: PathBuf,
}

impl Device {
    fn new(dir: &Path, port: u16, device: &str) -> Self {
        std::fs::write(dir.join("slot-a.img"), b"release one").expect("slot a");
        std::fs::write(dir.join("slot-b.img"), b"").expect("slot b");
        std::fs::write(dir.join("bootenv"), "flotilla_slot=a\nflotilla_booted=a\n").expect("env");
        let reboot = dir.join("reboot.sh");
        std::fs::write(
            &reboot,
            format!(
                "#!/bin/sh\necho reboot >> {}\n",
                dir.join("reboots").display()
            ),
        )
        .expect("reboot script");
        make_executable(&reboot);
        let rest = format!(
            r#"
[[target]]
name = "rootfs"
kind = "ab"
slots = ["{a}", "{b}"]
bootctl = "file"
bootctl_path = "{env}"
reboot_command = ["{reboot}"]
[health]
soak = "300ms"
interval = "100ms"
[[health.check]]
name = "system-up"
command = ["true"]
[download]
block_size = 4000
"#,
            a = dir.join("slot-a.img").display(),
            b = dir.join("slot-b.img").display(),
            env = dir.join("bootenv").display(),
            reboot = reboot.display(),
        );
        let config = dir.join("agent.toml");
        std::fs::write(&config, config_text(port, dir, device, &rest)).expect("config");
        Self {
            dir: dir.to_path_buf(),
            config,
        }
    }

    fn bootctl(&self) -> FileBootControl {
        FileBootControl::new(self.dir.join("bootenv"))
    }

    fn env(&self) -> String {
        std::fs::read_to_string(self.dir.join("bootenv")).expect("boot env")
    }

    fn reboots(&self) -> usize {
        std::fs::read_to_string(self.dir.join("reboots"))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    fn slot(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.dir.join(name)).expect("slot")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    fn start(&self) -> tokio::process::Child {
        spawn_agent(&self.config, &self.dir.join("agent.log"))
    }

    /// Waits until the reboot command ran `n` times in all.
    async fn until_reboots(&self, n: usize) {
        let waited = tokio::time::timeout(TIMEOUT, async {
            while self.reboots() < n {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "the reboot command did not run; agent log:\n{}",
            self.log()
        );
    }
}

fn make_executable(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

/// Starts the agent binary, appending its log to `log`.
fn spawn_agent(config: &Path, log: &Path) -> tokio::process::Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("agent log");
    tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla-agent"))
        .args(["run", "--config"])
        .arg(config)
        .env_remove(flotilla_agent::fault::FAULT_VAR)
        .stdout(Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .expect("start agent")
}

/// Stops the agent the way the system does when it goes down for a reboot: SIGTERM, then wait.
async fn stop(mut agent: tokio::process::Child) {
    if let Some(pid) = agent.id() {
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {pid}");
    }
    let exited = tokio::time::timeout(TIMEOUT, agent.wait()).await;
    assert!(exited.is_ok(), "the agent did not stop within 30s");
}

/// Installs the image up to the reboot: returns the device and the stopped agent's reports.
async fn install_until_reboot(
    dir: &Path,
    port: u16,
    device: &str,
    action: &str,
) -> (Device, mpsc::Receiver<Report>, Vec<Report>) {
    let d = Device::new(dir, port, device);
    let bytes = image();
    let mut reports = coordinator(
        port,
        device,
        desired(device, action, "rootfs", &bytes),
        bytes.clone(),
    )
    .await;
    let agent = d.start();
    let seen = reports_until(&mut reports, "activated", |r| {
        r.phase == Phase::Activated || r.phase.is_terminal()
    })
    .await;
    assert_eq!(
        seen.last().map(|r| &r.phase),
        Some(&Phase::Activated),
        "reports: {seen:#?}\nagent log:\n{}",
        d.log()
    );
    d.until_reboots(1).await;
    assert_eq!(
        d.slot("slot-b.img"),
        bytes,
        "the inactive slot holds the image"
    );
    assert_eq!(
        d.slot("slot-a.img"),
        b"release one",
        "the running slot is untouched"
    );
    let env = d.env();
    for line in ["flotilla_slot=b", "upgrade_available=1"] {
        assert!(env.lines().any(|l| l == line), "{line} in {env}");
    }
    stop(agent).await;
    (d, reports, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ab_update_reboots_once_and_is_ready_on_the_new_slot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let (d, mut reports, _) =
        install_until_reboot(dir.path(), broker.port, "ab-ok", "act-ab-ok").await;

    // The bootloader boots the new slot on trial.
    assert_eq!(d.bootctl().simulate_boot().expect("boot"), Some(Slot::B));
    let agent = d.start();
    let seen = reports_until(&mut reports, "final", |r| r.phase.is_terminal()).await;
    assert_eq!(
        seen.last().map(|r| &r.phase),
        Some(&Phase::Ready),
        "reports: {seen:#?}\nagent log:\n{}",
        d.log()
    );
    let phases: Vec<&str> = seen.iter().map(|r| r.phase.name()).collect();
    assert!(phases.contains(&"confirming"), "{phases:?}");
    assert!(
        !phases.contains(&"staged") && !phases.contains(&"downloading"),
        "nothing is staged or fetched again after the reboot: {phases:?}"
    );
    assert_eq!(d.reboots(), 1, "the reboot command ran once");
    let env = d.env();
    for line in ["flotilla_slot=b", "upgrade_available=0"] {
        assert!(
            env.lines().any(|l| l == line),
            "slot b is marked good: {env}"
        );
    }
    // A second power cycle stays on the confirmed slot.
    assert_eq!(d.bootctl().simulate_boot().expect("boot"), Some(Slot::B));
    stop(agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bootloader_fallback_is_reported_failed_and_rolled_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let (d, mut reports, _) =
        install_until_reboot(dir.path(), broker.port, "ab-fall", "act-ab-fall").await;

    // Slot b is tried and hangs before the agent runs; the next boot falls back to slot a.
    assert_eq!(d.bootctl().simulate_boot().expect("boot"), Some(Slot::B));
    assert_eq!(d.bootctl().simulate_boot().expect("boot"), Some(Slot::A));
    let agent = d.start();
    let seen = reports_until(&mut reports, "final", |r| r.phase.is_terminal()).await;
    let Some(Phase::Failed {
        reason,
        rolled_back,
    }) = seen.last().map(|r| r.phase.clone())
    else {
        panic!("expected a failure: {seen:#?}\nagent log:\n{}", d.log());
    };
    assert!(rolled_back, "the bootloader rolled back: {reason}");
    assert!(reason.contains("fell back to slot a"), "{reason}");
    assert_eq!(
        d.reboots(),
        1,
        "no second reboot: the old slot already runs"
    );
    let env = d.env();
    for line in ["flotilla_slot=a", "upgrade_available=0"] {
        assert!(env.lines().any(|l| l == line), "{line} in {env}");
    }
    stop(agent).await;
    let status = flotilla_agent::status(&flotilla_agent::Config::load(&d.config).expect("config"))
        .expect("status");
    assert!(status.contains("installed: nothing recorded"), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_target_installs_through_the_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(broker) = start_broker(dir.path()).await else {
        return;
    };
    let device = "script-ok";
    let dest = dir.path().join("app.conf");
    std::fs::write(&dest, b"old config").expect("old");
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../targets/tests/scripts/copy-target.sh")
        .canonicalize()
        .expect("copy-target.sh");
    let config = dir.path().join("agent.toml");
    let rest = format!(
        r#"
[[target]]
name = "app"
kind = "script"
path = "{script}"
timeouts = {{ stage = "1m", activate = "1m" }}
env = {{ DEST = "{dest}" }}
[health]
soak = "300ms"
interval = "100ms"
[[health.check]]
name = "config-present"
command = ["test", "-s", "{dest}"]
"#,
        script = script.display(),
        dest = dest.display(),
    );
    std::fs::write(&config, config_text(broker.port, dir.path(), device, &rest)).expect("config");
    let bytes = b"listen = 8080\n".repeat(300);
    let mut reports = coordinator(
        broker.port,
        device,
        desired(device, "act-script-1", "app", &bytes),
        bytes.clone(),
    )
    .await;
    let log = dir.path().join("agent.log");
    let agent = spawn_agent(&config, &log);
    let seen = reports_until(&mut reports, "final", |r| r.phase.is_terminal()).await;
    assert_eq!(
        seen.last().map(|r| &r.phase),
        Some(&Phase::Ready),
        "reports: {seen:#?}\nagent log:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert_eq!(std::fs::read(&dest).expect("dest"), bytes);
    let state_dir = dir.path().join("agent-data/targets/app");
    assert!(
        state_dir.join("previous-act-script-1").is_file(),
        "the script kept the old file for rollback in its state directory"
    );
    stop(agent).await;
}
