//! Conformance suite: every [`UpdateTarget`] goes through the same scenarios.
//!
//! A target kind joins the suite with a [`Harness`] (how to open the target, hand it an artifact
//! and see what the device runs with) and one line of `conformance_suite!`. Each scenario drives
//! the target only through `&dyn UpdateTarget`, the way the agent does, and asserts what a user
//! of the device would notice: what is installed afterwards.
//!
//! "Crash" means what it means for the agent: the process dies, a new one builds a *new* target
//! instance on the same device state and calls the interrupted step again for the same action.

use std::fs;
use std::io;
use std::path::PathBuf;

use flotilla_targets::{ActionContext, Activation, FileTarget, TargetError, UpdateTarget};

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
        target.rollback(&c).expect("rollback");
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));
    }

    /// Rollback of a first install removes what was installed.
    pub fn rollback_without_previous(make: MakeHarness) {
        let h = make(None);
        let c = ctx("first-install");
        let target = stage_and_activate(&*h, &c, NEW);
        assert_eq!(h.installed().as_deref(), Some(NEW));
        target.rollback(&c).expect("rollback");
        assert_eq!(h.installed(), None);
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
        restarted.rollback(&c).expect("rollback");
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
        stage_and_activate(&*h, &c, NEW)
            .rollback(&c)
            .expect("rollback");
        h.open().rollback(&c).expect("rollback again");
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
        mod $kind {
            use super::*;

            #[test]
            fn install() {
                scenarios::install($make)
            }
            #[test]
            fn rollback() {
                scenarios::rollback($make)
            }
            #[test]
            fn rollback_without_previous() {
                scenarios::rollback_without_previous($make)
            }
            #[test]
            fn crash_between_stage_and_activate() {
                scenarios::crash_between_stage_and_activate($make)
            }
            #[test]
            fn activate_twice() {
                scenarios::activate_twice($make)
            }
            #[test]
            fn stage_twice() {
                scenarios::stage_twice($make)
            }
            #[test]
            fn rollback_twice() {
                scenarios::rollback_twice($make)
            }
            #[test]
            fn rollback_of_another_action_changes_nothing() {
                scenarios::rollback_of_another_action_changes_nothing($make)
            }
            #[test]
            fn stage_of_missing_artifact() {
                scenarios::stage_of_missing_artifact($make)
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
