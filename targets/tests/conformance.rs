//! Conformance suite: every [`UpdateTarget`] goes through the same scenarios.
//!
//! A target kind joins the suite with a [`Harness`] (how to open the target, hand it an artifact
//! and see what the device runs with) and one line of `conformance_suite!`. Each scenario drives
//! the target only through `&dyn UpdateTarget`, the way the agent does, and asserts what a user
//! of the device would notice: what is installed afterwards.
//!
//! "Crash" means what it means for the agent: the process dies, a new one builds a *new* target
//! instance on the same device state and calls the interrupted step again for the same action.
//! A reboot a target asks for is played by the harness (for A/B targets: the bootloader, per the
//! boot script contract in `flotilla_targets::bootctl`) and also restarts the agent.
//!
//! Targets run here: `file`; `ab` with the file, U-Boot (`fw_setenv` on a file-backed
//! environment) and GRUB (`grub-editenv`) backends; `script` with `tests/scripts/copy-target.sh`;
//! `swupdate` with Debian's real SWUpdate on a dual-copy device in miniature (CMS-signed
//! `.swu` images built here with the openssl and cpio CLIs), by `swupdate -i` and through a
//! running daemon's IPC socket (`swupdate_socket`); `rauc` with Debian's real RAUC
//! service on file-backed slots (`harness/rauc.rs`).
//! The U-Boot, GRUB, SWUpdate and RAUC suites need libubootenv-tool, grub-common, swupdate with
//! cpio and openssl, and rauc with squashfs-tools and dbus; without them each test prints a loud SKIPPED line and passes (and fails
//! with `FLOTILLA_REQUIRE_TOOLS=1`, as in CI).

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use flotilla_targets::bootctl::{BootControl, Slot};
use flotilla_targets::{
    AbConfig, AbTarget, ActionContext, Activation, BootControlKind, FileTarget, MenderModuleConfig,
    MenderModuleTarget, ScriptConfig, ScriptTarget, SwupdateConfig, SwupdateTarget, TargetError,
    UpdateTarget,
};

/// How the suite drives and observes one kind of target on one simulated device.
trait Harness {
    /// A fresh target instance on the device's current state, as a (re)started agent builds it.
    fn open(&self) -> Box<dyn UpdateTarget>;

    /// Leaves an artifact with `content` where the downloader would, and returns its path.
    fn artifact(&self, name: &str, content: &[u8]) -> PathBuf;

    /// What the device runs with now, as its user sees it; `None` when nothing is installed.
    fn installed(&self) -> Option<Vec<u8>>;

    /// Simulates the reboot a target asked for with [`Activation::RebootRequired`].
    fn reboot(&self) {}

    /// Makes the confirm path of the release just activated fail the way it fails on a device
    /// (the bootloader falls back to the old slot, the script's `confirm` reports the service
    /// down). Returns false for a target that has no such path: there only the agent's health
    /// checks can fail, and they lead straight to a rollback.
    fn break_confirm(&self) -> bool {
        false
    }

    /// Does rolling back a first install remove what it installed? Mender's `single-file`
    /// module keeps no record of a file that was not there and leaves the new one in place.
    fn rollback_removes_first_install(&self) -> bool {
        true
    }
}

/// Builds a harness whose device starts with `initial` installed (`None`: nothing yet).
type MakeHarness = fn(initial: Option<&[u8]>) -> Box<dyn Harness>;

// Not valid UTF-8 on purpose: a target must restore bytes, not text.
const ORIGINAL: &[u8] = b"original content \xff\x00\xfe of the device\n";
const NEW: &[u8] = b"new release content, longer than the original one\n";

fn ctx(action_id: &str) -> ActionContext {
    ActionContext::new(action_id, "fw-2.4.0", "payload")
}

/// Runs `activate` and, if the target needs it, the reboot; returns the target to use afterwards
/// (a reboot restarts the agent, so it is a new instance).
fn activate(
    h: &dyn Harness,
    target: Box<dyn UpdateTarget>,
    c: &ActionContext,
) -> Box<dyn UpdateTarget> {
    match target.activate(c).expect("activate") {
        Activation::Done => target,
        Activation::RebootRequired => {
            h.reboot();
            h.open()
        }
    }
}

/// Rolls `c` back through [`UpdateTarget::rollback_activation`] and reboots if the target needs
/// it; returns the target to use afterwards.
fn roll_back(
    h: &dyn Harness,
    target: Box<dyn UpdateTarget>,
    c: &ActionContext,
) -> Box<dyn UpdateTarget> {
    match target.rollback_activation(c).expect("rollback") {
        Activation::Done => target,
        Activation::RebootRequired => {
            h.reboot();
            h.open()
        }
    }
}

/// check + stage + activate, as the agent runs them for one action.
fn stage_and_activate(h: &dyn Harness, c: &ActionContext, content: &[u8]) -> Box<dyn UpdateTarget> {
    let target = h.open();
    target.check(c).expect("check");
    target
        .stage(c, &h.artifact(&c.action_id, content))
        .expect("stage");
    activate(h, target, c)
}

mod scenarios {
    use super::*;

    /// Install: staging changes nothing visible; after activate the artifact is what runs, and
    /// confirm keeps it.
    pub fn install(make: MakeHarness) {
        let h = make(Some(ORIGINAL));
        let c = ctx("install-1");
        let target = h.open();
        target.check(&c).expect("check");
        target.stage(&c, &h.artifact("a", NEW)).expect("stage");
        assert_eq!(
            h.installed().as_deref(),
            Some(ORIGINAL),
            "stage must not touch the running system"
        );

        let target = activate(&*h, target, &c);
        assert_eq!(h.installed().as_deref(), Some(NEW));
        target.confirm(&c).expect("confirm");
        assert_eq!(h.installed().as_deref(), Some(NEW));
    }

    /// Rollback after failed health checks returns the exact old bytes.
    pub fn rollback(make: MakeHarness) {
        let h = make(Some(ORIGINAL));
        let c = ctx("rollback-1");
        let target = stage_and_activate(&*h, &c, NEW);
        assert_eq!(h.installed().as_deref(), Some(NEW));
        roll_back(&*h, target, &c);
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));
    }

    /// Rollback of a first install removes what was installed.
    pub fn rollback_without_previous(make: MakeHarness) {
        let h = make(None);
        let c = ctx("first-install");
        let target = stage_and_activate(&*h, &c, NEW);
        assert_eq!(h.installed().as_deref(), Some(NEW));
        roll_back(&*h, target, &c);
        if h.rollback_removes_first_install() {
            assert_eq!(h.installed(), None);
        } else {
            assert_eq!(h.installed().as_deref(), Some(NEW), "documented: kept");
        }
    }

    /// The agent dies after stage; the restarted one activates with a new instance.
    pub fn crash_between_stage_and_activate(make: MakeHarness) {
        let h = make(Some(ORIGINAL));
        let c = ctx("crash-after-stage");
        {
            let before_crash = h.open();
            before_crash.check(&c).expect("check");
            before_crash
                .stage(&c, &h.artifact("a", NEW))
                .expect("stage");
        }
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));

        let restarted = activate(&*h, h.open(), &c);
        assert_eq!(h.installed().as_deref(), Some(NEW));
        restarted.confirm(&c).expect("confirm");
        assert_eq!(h.installed().as_deref(), Some(NEW));
    }

    /// The agent dies after stage; the restarted one rolls back (the action was canceled):
    /// the running content is untouched and the staged update never shows up.
    pub fn crash_between_stage_and_rollback(make: MakeHarness) {
        let h = make(Some(ORIGINAL));
        let c = ctx("crash-then-cancel");
        {
            let before_crash = h.open();
            before_crash.check(&c).expect("check");
            before_crash
                .stage(&c, &h.artifact("a", NEW))
                .expect("stage");
        }
        roll_back(&*h, h.open(), &c);
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));
        let err = h
            .open()
            .activate(&c)
            .expect_err("a rolled-back action stays off");
        assert!(
            matches!(
                err,
                TargetError::RolledBack { .. } | TargetError::NotStaged { .. }
            ),
            "{err}"
        );
        h.reboot();
        assert_eq!(
            h.installed().as_deref(),
            Some(ORIGINAL),
            "also after a reboot"
        );
    }

    /// The agent dies right after activate (for reboot targets: the reboot itself); the
    /// restarted one confirms with a new instance and the new content stays.
    pub fn crash_after_activate_then_confirm(make: MakeHarness) {
        let h = make(Some(ORIGINAL));
        let c = ctx("crash-after-activate");
        drop(stage_and_activate(&*h, &c, NEW));
        h.open().confirm(&c).expect("confirm from a new instance");
        assert_eq!(h.installed().as_deref(), Some(NEW));
        h.reboot();
        assert_eq!(
            h.installed().as_deref(),
            Some(NEW),
            "a confirmed update survives a reboot"
        );
    }

    /// The agent dies right after activate; the restarted one rolls back with a new instance
    /// and the exact old content is back.
    pub fn crash_after_activate_then_rollback(make: MakeHarness) {
        let h = make(Some(ORIGINAL));
        let c = ctx("crash-then-rollback");
        drop(stage_and_activate(&*h, &c, NEW));
        roll_back(&*h, h.open(), &c);
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));
        h.reboot();
        assert_eq!(
            h.installed().as_deref(),
            Some(ORIGINAL),
            "a rollback survives a reboot"
        );
    }

    /// Health checks fail: where the target has a confirm path that can fail (bootloader
    /// fallback, a script's confirm), it does; either way the agent rolls back and the old
    /// content is back, and the failed release can no longer be confirmed.
    pub fn failing_health_check(make: MakeHarness) {
        let h = make(Some(ORIGINAL));
        let c = ctx("unhealthy");
        let target = stage_and_activate(&*h, &c, NEW);
        let target = if h.break_confirm() {
            let target = h.open();
            let err = target.confirm(&c).expect_err("the confirm path must fail");
            assert!(
                matches!(
                    err,
                    TargetError::FellBack { .. } | TargetError::Script { .. }
                ),
                "{err}"
            );
            target
        } else {
            target
        };
        let target = roll_back(&*h, target, &c);
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));
        let err = target.confirm(&c).expect_err("rolled back");
        assert!(matches!(err, TargetError::RolledBack { .. }), "{err}");
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));
    }

    /// The agent dies inside activate and calls it again: the second call is a no-op, and a
    /// rollback still returns the ORIGINAL content, not a copy of the new one.
    pub fn activate_twice(make: MakeHarness) {
        let h = make(Some(ORIGINAL));
        if !h.open().activate_is_repeatable() {
            return; // the agent never repeats it; it fails the action instead
        }
        let c = ctx("activate-twice");
        stage_and_activate(&*h, &c, NEW);
        let restarted = activate(&*h, h.open(), &c);
        assert_eq!(h.installed().as_deref(), Some(NEW));
        roll_back(&*h, restarted, &c);
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));
    }

    /// Stage repeated after a crash: the second stage wins and activation installs it.
    pub fn stage_twice(make: MakeHarness) {
        let h = make(Some(ORIGINAL));
        if !h.open().stage_is_repeatable() {
            return;
        }
        let c = ctx("stage-twice");
        h.open()
            .stage(&c, &h.artifact("a", b"partial download"))
            .expect("stage");
        let restarted = h.open();
        restarted
            .stage(&c, &h.artifact("b", NEW))
            .expect("stage again");
        activate(&*h, restarted, &c);
        assert_eq!(h.installed().as_deref(), Some(NEW));
    }

    /// Rollback repeated after a crash inside it ends in the same place.
    pub fn rollback_twice(make: MakeHarness) {
        let h = make(Some(ORIGINAL));
        let c = ctx("rollback-twice");
        let target = stage_and_activate(&*h, &c, NEW);
        roll_back(&*h, target, &c);
        roll_back(&*h, h.open(), &c);
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));
    }

    /// A rollback for an action that never activated must not undo an earlier, healthy update.
    pub fn rollback_of_another_action_changes_nothing(make: MakeHarness) {
        let h = make(Some(ORIGINAL));
        let installed = ctx("healthy");
        stage_and_activate(&*h, &installed, NEW)
            .confirm(&installed)
            .expect("confirm");

        let err = h
            .open()
            .rollback(&ctx("never-ran"))
            .expect_err("nothing to roll back");
        assert!(
            matches!(err, TargetError::NothingToRollBack { .. }),
            "{err}"
        );
        assert_eq!(h.installed().as_deref(), Some(NEW));
    }

    /// A missing artifact is a clear error naming it; nothing is installed or staged.
    pub fn stage_of_missing_artifact(make: MakeHarness) {
        let h = make(Some(ORIGINAL));
        let c = ctx("missing-artifact");
        let target = h.open();
        let missing = h
            .artifact("present", NEW)
            .with_file_name("never-downloaded");

        let err = target.stage(&c, &missing).expect_err("stage must fail");
        assert!(matches!(err, TargetError::Stage { .. }), "{err}");
        let message = err.to_string();
        assert!(
            message.contains(&missing.display().to_string()),
            "names the artifact: {message}"
        );
        assert!(message.contains("No such file"), "says why: {message}");
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));

        let err = target.activate(&c).expect_err("nothing was staged");
        assert!(matches!(err, TargetError::NotStaged { .. }), "{err}");
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));
    }
}

/// One `#[test]` per scenario for a target kind, so a failure names both.
macro_rules! conformance_suite {
    ($kind:ident, $make:expr) => {
        conformance_suite!($kind, $make, requires || Ok(()));
    };
    ($kind:ident, $make:expr, requires $requires:expr) => {
        mod $kind {
            use super::*;

            /// Runs `scenario` unless the suite's tools are missing; then it says so loudly
            /// and passes: the machine lacks them, the target is not wrong.
            fn run(scenario: fn(MakeHarness)) {
                let requires: fn() -> Result<(), String> = $requires;
                match requires() {
                    Ok(()) => scenario($make),
                    Err(why) => {
                        let notice =
                            format!("SKIPPED conformance suite {}: {why}", stringify!($kind));
                        // CI installs every tool: there a missing one is a failure.
                        if std::env::var("FLOTILLA_REQUIRE_TOOLS").is_ok_and(|v| v == "1") {
                            panic!("{notice} (FLOTILLA_REQUIRE_TOOLS=1)");
                        }
                        // Straight to stderr: the test harness hides eprintln! of a passing test.
                        use std::io::Write as _;
                        let _ = writeln!(std::io::stderr().lock(), "\n!!!! {notice}");
                    }
                }
            }

            #[test]
            fn install() {
                run(scenarios::install)
            }
            #[test]
            fn rollback() {
                run(scenarios::rollback)
            }
            #[test]
            fn rollback_without_previous() {
                run(scenarios::rollback_without_previous)
            }
            #[test]
            fn crash_between_stage_and_activate() {
                run(scenarios::crash_between_stage_and_activate)
            }
            #[test]
            fn activate_twice() {
                run(scenarios::activate_twice)
            }
            #[test]
            fn stage_twice() {
                run(scenarios::stage_twice)
            }
            #[test]
            fn rollback_twice() {
                run(scenarios::rollback_twice)
            }
            #[test]
            fn rollback_of_another_action_changes_nothing() {
                run(scenarios::rollback_of_another_action_changes_nothing)
            }
            #[test]
            fn stage_of_missing_artifact() {
                run(scenarios::stage_of_missing_artifact)
            }
            #[test]
            fn crash_between_stage_and_rollback() {
                run(scenarios::crash_between_stage_and_rollback)
            }
            #[test]
            fn crash_after_activate_then_confirm() {
                run(scenarios::crash_after_activate_then_confirm)
            }
            #[test]
            fn crash_after_activate_then_rollback() {
                run(scenarios::crash_after_activate_then_rollback)
            }
            #[test]
            fn failing_health_check() {
                run(scenarios::failing_health_check)
            }
        }
    };
}

/// The file target on a file in a fresh temporary directory.
struct FileHarness {
    dir: tempfile::TempDir,
    dest: PathBuf,
}

impl FileHarness {
    fn make(initial: Option<&[u8]>) -> Box<dyn Harness> {
        let dir = tempfile::tempdir().expect("tempdir");
        let dest = dir.path().join("etc").join("app.conf");
        fs::create_dir_all(dir.path().join("etc")).expect("etc");
        fs::create_dir_all(dir.path().join("downloads")).expect("downloads");
        if let Some(content) = initial {
            fs::write(&dest, content).expect("seed");
        }
        Box::new(Self { dir, dest })
    }
}

impl Harness for FileHarness {
    fn open(&self) -> Box<dyn UpdateTarget> {
        Box::new(FileTarget::new(self.dest.clone()))
    }

    fn artifact(&self, name: &str, content: &[u8]) -> PathBuf {
        let path = self.dir.path().join("downloads").join(name);
        fs::write(&path, content).expect("write artifact");
        path
    }

    fn installed(&self) -> Option<Vec<u8>> {
        match fs::read(&self.dest) {
            Ok(bytes) => Some(bytes),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => panic!("cannot read {}: {e}", self.dest.display()),
        }
    }
}

conformance_suite!(file, FileHarness::make);

#[test]
fn the_file_target_reports_its_kind() {
    assert_eq!(FileHarness::make(None).open().kind(), "file");
}

/// Reads what is installed at `path`; an empty or missing file is "nothing installed".
fn read_installed(path: &Path) -> Option<Vec<u8>> {
    match fs::read(path) {
        Ok(bytes) if bytes.is_empty() => None,
        Ok(bytes) => Some(bytes),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => panic!("cannot read {}: {e}", path.display()),
    }
}

/// Where an A/B harness keeps its boot-control variables.
#[derive(Debug, Clone, Copy)]
enum Backend {
    File,
    UBoot,
    Grub,
}

/// The A/B target on two image files, with the bootloader played by
/// [`BootControl::simulate_boot`]. Slot `a` runs with the initial content; slot `b` holds stale
/// bytes longer than any new image, so a missing truncation would show.
struct AbHarness {
    dir: tempfile::TempDir,
    config: AbConfig,
}

impl AbHarness {
    fn make(backend: Backend, initial: Option<&[u8]>) -> Box<dyn Harness> {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path();
        fs::create_dir_all(p.join("downloads")).expect("downloads");
        fs::write(p.join("slot-a.img"), initial.unwrap_or_default()).expect("slot a");
        fs::write(p.join("slot-b.img"), [0x5a; 4096]).expect("slot b");
        let bootctl = match backend {
            Backend::File => BootControlKind::File {
                path: p.join("bootenv"),
            },
            Backend::UBoot => {
                // A file-backed U-Boot environment: fw_env.config points at a plain file.
                let config = p.join("fw_env.config");
                fs::write(p.join("uboot-env.bin"), [0u8; 0x4000]).expect("env");
                fs::write(
                    &config,
                    format!("{} 0x0 0x4000\n", p.join("uboot-env.bin").display()),
                )
                .expect("fw_env.config");
                fs::write(p.join("default-env"), "bootdelay=3\n").expect("default env");
                let status = Command::new("fw_setenv")
                    .arg("-c")
                    .arg(&config)
                    .arg("-f")
                    .arg(p.join("default-env"))
                    .args(["bootcmd", "run flotilla_boot"])
                    .status()
                    .expect("fw_setenv runs");
                assert!(status.success(), "initialising the U-Boot environment");
                BootControlKind::UBoot {
                    config: Some(config),
                }
            }
            Backend::Grub => BootControlKind::Grub {
                env_file: p.join("grubenv"),
            },
        };
        // A board set up for flotilla: it boots slot a and its boot script records that.
        bootctl
            .open()
            .store(&[
                ("flotilla_slot", "a".to_owned()),
                ("flotilla_booted", "a".to_owned()),
            ])
            .expect("initial boot environment");
        let config = AbConfig {
            slots: [p.join("slot-a.img"), p.join("slot-b.img")],
            bootctl,
            state_dir: p.join("ab-state"),
            reboot_command: vec!["true".to_owned()],
        };
        Box::new(Self { dir, config })
    }

    fn bootctl(&self) -> Box<dyn BootControl> {
        self.config.bootctl.open()
    }
}

impl Harness for AbHarness {
    fn open(&self) -> Box<dyn UpdateTarget> {
        Box::new(AbTarget::new(self.config.clone()).expect("valid A/B config"))
    }

    fn artifact(&self, name: &str, content: &[u8]) -> PathBuf {
        let path = self.dir.path().join("downloads").join(name);
        fs::write(&path, content).expect("write artifact");
        path
    }

    /// The content of the slot the bootloader booted.
    fn installed(&self) -> Option<Vec<u8>> {
        let env = self.bootctl().read().expect("boot environment");
        let slot = env.running().expect("a booted slot");
        read_installed(&self.config.slots[slot.index()])
    }

    fn reboot(&self) {
        self.bootctl().simulate_boot().expect("boot");
    }

    /// The new slot was tried once (the reboot after activate) and hung before the agent
    /// could confirm it; at the next power-on the bootloader falls back.
    fn break_confirm(&self) -> bool {
        let booted = self.bootctl().simulate_boot().expect("boot");
        assert_eq!(
            booted,
            Some(Slot::A),
            "the bootloader falls back to the old slot"
        );
        true
    }
}

fn tool_runs(program: &str, arg: &str, package: &str) -> Result<(), String> {
    match Command::new(program).arg(arg).output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!("`{program} {arg}` failed ({})", out.status)),
        Err(e) => Err(format!(
            "{program} is not installed ({e}); install it with `apt-get install {package}`"
        )),
    }
}

conformance_suite!(ab_file, |initial| AbHarness::make(Backend::File, initial));
conformance_suite!(
    ab_uboot,
    |initial| AbHarness::make(Backend::UBoot, initial),
    requires || tool_runs("fw_setenv", "-V", "libubootenv-tool")
);
conformance_suite!(
    ab_grub,
    |initial| AbHarness::make(Backend::Grub, initial),
    requires || tool_runs("grub-editenv", "--version", "grub-common")
);

/// The script target with `tests/scripts/copy-target.sh`, which keeps one file.
struct ScriptHarness {
    dir: tempfile::TempDir,
    dest: PathBuf,
}

impl ScriptHarness {
    fn make(initial: Option<&[u8]>) -> Box<dyn Harness> {
        let dir = tempfile::tempdir().expect("tempdir");
        let dest = dir.path().join("etc").join("app.conf");
        fs::create_dir_all(dir.path().join("etc")).expect("etc");
        fs::create_dir_all(dir.path().join("downloads")).expect("downloads");
        if let Some(content) = initial {
            fs::write(&dest, content).expect("seed");
        }
        Box::new(Self { dir, dest })
    }

    fn fail_flag(&self) -> PathBuf {
        self.dir.path().join("service-down")
    }
}

impl Harness for ScriptHarness {
    fn open(&self) -> Box<dyn UpdateTarget> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/copy-target.sh");
        let mut config = ScriptConfig::new(script, self.dir.path().join("state"));
        config.env = BTreeMap::from([
            ("DEST".to_owned(), self.dest.display().to_string()),
            (
                "FAIL_CONFIRM_FILE".to_owned(),
                self.fail_flag().display().to_string(),
            ),
        ]);
        Box::new(ScriptTarget::new(config).expect("valid script config"))
    }

    fn artifact(&self, name: &str, content: &[u8]) -> PathBuf {
        let path = self.dir.path().join("downloads").join(name);
        fs::write(&path, content).expect("write artifact");
        path
    }

    fn installed(&self) -> Option<Vec<u8>> {
        match fs::read(&self.dest) {
            Ok(bytes) => Some(bytes),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => panic!("cannot read {}: {e}", self.dest.display()),
        }
    }

    /// The script's `confirm` finds the service down.
    fn break_confirm(&self) -> bool {
        fs::write(self.fail_flag(), "").expect("flag");
        true
    }
}

conformance_suite!(script, ScriptHarness::make);

#[path = "harness/swupdate.rs"]
mod swupdate_harness;
use swupdate_harness::*;

/// A `.swu` whose `sw-description` was changed after signing is refused by SWUpdate itself; the
/// error carries SWUpdate's own words, and the device keeps running what it ran.
#[test]
fn swupdate_refuses_a_tampered_image_with_its_own_error() {
    with_swupdate(|| {
        let h = SwupdateHarness::new(Some(ORIGINAL));
        let c = ctx("tampered");
        let target = h.open();
        assert_eq!(target.kind(), "swupdate");
        target.check(&c).expect("check");
        let forged = h.swu("forged", NEW, true);
        target
            .stage(&c, &forged)
            .expect("it still looks like a .swu");
        let err = target.activate(&c).expect_err("SWUpdate refuses it");
        let message = err.to_string();
        assert!(matches!(err, TargetError::Swupdate { .. }), "{message}");
        assert!(
            message.contains("Signature verification failed"),
            "SWUpdate's own error: {message}"
        );
        h.reboot();
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));
        assert_eq!(h.running_copy(), "a");
        assert_eq!(read_installed(&h.dir.path().join("copy-b/app.conf")), None);
        // The agent rolls back after a failed activation: the bootloader stays on copy a.
        roll_back(&h, h.open(), &c);
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));
    })
}

/// An image for other hardware is refused with SWUpdate's "SW not compatible with hardware"; something
/// that is not a `.swu` at all is refused at stage, before SWUpdate runs.
#[test]
fn swupdate_refuses_foreign_hardware_and_non_swu_artifacts() {
    with_swupdate(|| {
        let h = SwupdateHarness::new(Some(ORIGINAL));
        let mut config = h.config();
        config.args[3] = "board:2.0".to_owned();
        let c = ctx("other-board");
        let target = SwupdateTarget::new(config).expect("config");
        target.stage(&c, &h.artifact("img", NEW)).expect("stage");
        let message = target.activate(&c).expect_err("other hardware").to_string();
        assert!(
            message.contains("SW not compatible with hardware"),
            "SWUpdate's own error: {message}"
        );
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));

        let tarball = h.dir.path().join("downloads/app.tar");
        fs::write(&tarball, b"ustar\0 not a cpio archive").expect("tarball");
        let message = h
            .open()
            .stage(&ctx("tarball"), &tarball)
            .expect_err("not a .swu")
            .to_string();
        assert!(message.contains("not a SWUpdate image"), "{message}");
    })
}

/// Through the daemon's socket, a tampered image is refused with SWUpdate's own error (read from
/// the daemon's status messages), the device keeps its copy, and the daemon takes the next image.
#[test]
fn swupdate_socket_refuses_a_tampered_image_with_its_own_error() {
    with_swupdate(|| {
        let h = SwupdateDaemonHarness::new(Some(ORIGINAL));
        let c = ctx("tampered");
        let target = h.open();
        target.check(&c).expect("check");
        let forged = h.device.swu("forged", NEW, true);
        target
            .stage(&c, &forged)
            .expect("it still looks like a .swu");
        let message = target
            .activate(&c)
            .expect_err("SWUpdate refuses it")
            .to_string();
        assert!(
            message.contains("Signature verification failed"),
            "SWUpdate's own error: {message}"
        );
        h.reboot();
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));
        roll_back(&h, h.open(), &c);

        let c = ctx("good-after-bad");
        let target = stage_and_activate(&h, &c, NEW);
        target.confirm(&c).expect("confirm");
        assert_eq!(h.installed().as_deref(), Some(NEW));
        assert!(
            h.daemon_log().contains("SWUPDATE successful"),
            "the daemon installed it:\n{}",
            h.daemon_log()
        );
    })
}

/// With `socket` set and no daemon listening there, the target installs with `swupdate -i`.
#[test]
fn swupdate_socket_without_a_daemon_falls_back_to_swupdate_i() {
    with_swupdate(|| {
        let h = SwupdateHarness::new(Some(ORIGINAL));
        let mut config = h.config();
        config.socket = Some(h.dir.path().join("no-daemon/sockinstctrl"));
        let c = ctx("fallback");
        let target = SwupdateTarget::new(config.clone()).expect("config");
        target.check(&c).expect("check");
        target.stage(&c, &h.artifact("img", NEW)).expect("stage");
        assert_eq!(
            target.activate(&c).expect("activate"),
            Activation::RebootRequired
        );
        h.reboot();
        let target = SwupdateTarget::new(config).expect("config");
        target.confirm(&c).expect("confirm");
        assert_eq!(h.installed().as_deref(), Some(NEW));
    })
}

#[test]
fn every_target_reports_its_kind() {
    assert_eq!(AbHarness::make(Backend::File, None).open().kind(), "ab");
    assert_eq!(ScriptHarness::make(None).open().kind(), "script");
    assert_eq!(
        MenderHarness::make(MenderModule::SingleFile, None)
            .open()
            .kind(),
        "mender-module"
    );
}

/// Which of Debian's Mender update modules a [`MenderHarness`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MenderModule {
    /// `single-file`: the payload is the file; `dest_dir`, `filename`, `permissions` beside it.
    SingleFile,
    /// `directory`: the payload is `update.tar`, unpacked into `dest_dir`.
    Directory,
}

#[path = "harness/mender.rs"]
mod mender_harness;
use mender_harness::*;

conformance_suite!(
    mender_single_file,
    |initial| MenderHarness::make(MenderModule::SingleFile, initial),
    requires || mender_module_installed("single-file")
);
conformance_suite!(
    mender_directory,
    |initial| MenderHarness::make(MenderModule::Directory, initial),
    requires || mender_module_installed("directory")
);

/// A module that fails in `ArtifactInstall`: the agent rolls back, the module's own error is in
/// the reason, and the old content is what runs.
#[test]
fn a_mender_module_failing_in_install_is_rolled_back_with_its_error() {
    let h = MenderHarness::new(MenderModule::SingleFile, Some(ORIGINAL));
    let module = h.dir.path().join("failing-module");
    // Half-installs, then fails, like a module that ran out of space; its rollback restores.
    let dest = h.dest();
    fs::write(
        &module,
        format!(
            r#"#!/bin/sh
echo "$1" >> "$2/../calls"
case "$1" in
  SupportsRollback) echo Yes ;;
  NeedsArtifactReboot) echo No ;;
  ArtifactInstall) cp "{dest}" "$2/tmp/backup"; echo garbage > "{dest}"
                   echo "cannot write {dest}: No space left on device" >&2; exit 1 ;;
  ArtifactRollback) cp "$2/tmp/backup" "{dest}" ;;
esac
exit 0
"#,
            dest = dest.display()
        ),
    )
    .expect("module");
    fs::set_permissions(&module, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let mut config = MenderModuleConfig::new(module, h.dir.path().join("state"));
    config.payload_file = Some("app.conf".into());
    let open = || MenderModuleTarget::new(config.clone()).expect("config");
    let c = ctx("failing-install");
    let target = open();
    target.check(&c).expect("check");
    target.stage(&c, &h.artifact("a", NEW)).expect("stage");
    let err = target.activate(&c).expect_err("ArtifactInstall fails");
    assert!(matches!(err, TargetError::UpdateModule { .. }), "{err}");
    let message = err.to_string();
    assert!(
        message.contains("ArtifactInstall failed: cannot write")
            && message.contains("No space left on device"),
        "the module's own error: {message}"
    );
    // The agent rolls back from a new instance (as after a restart).
    assert_eq!(
        open().rollback_activation(&c).expect("rollback"),
        Activation::Done
    );
    assert_eq!(h.installed().as_deref(), Some(ORIGINAL));
    let calls = fs::read_to_string(h.dir.path().join("state/calls")).expect("calls");
    assert!(
        calls.ends_with("ArtifactInstall\nArtifactRollback\nArtifactFailure\nCleanup\n"),
        "{calls}"
    );
    let err = open().confirm(&c).expect_err("rolled back");
    assert!(matches!(err, TargetError::RolledBack { .. }), "{err}");
}

// RAUC's suite and its own tests, in a file of their own (this one is the suite's core).
#[path = "conformance/rauc.rs"]
mod rauc;
