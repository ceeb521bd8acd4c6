//! RAUC through the conformance suite, and what only the `rauc` target does: marking slots good
//! after the soak, bad on a rollback, and RAUC's own refusal of a corrupt bundle.

use super::*;

#[path = "../harness/rauc.rs"]
mod rauc_harness;

conformance_suite!(
    rauc,
    rauc_harness::RaucHarness::make,
    requires rauc_harness::rauc_tools
);

/// Runs `test` when the RAUC tools are here; otherwise skips loudly, or fails in CI.
fn with_rauc(test: impl FnOnce()) {
    match rauc_harness::rauc_tools() {
        Ok(()) => test(),
        Err(why) if std::env::var("FLOTILLA_REQUIRE_TOOLS").is_ok_and(|v| v == "1") => {
            panic!("SKIPPED rauc test: {why} (FLOTILLA_REQUIRE_TOOLS=1)")
        }
        Err(why) => {
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr().lock(), "\n!!!! SKIPPED rauc test: {why}");
        }
    }
}

/// The first confirm (from the new boot) marks nothing; the one after the health checks marks
/// the booted slot good through RAUC, and a rollback from there marks it bad and makes the old
/// slot primary again.
#[test]
fn rauc_marks_the_new_slot_good_after_the_soak_and_bad_on_a_later_rollback() {
    with_rauc(|| {
        let h = rauc_harness::RaucHarness::new(Some(ORIGINAL));
        let c = ctx("marks");
        let target = stage_and_activate(&h, &c, NEW);
        assert_eq!(target.kind(), "rauc");
        assert_eq!(
            (h.backend("booted"), h.backend("primary")),
            ("B".into(), "B".into())
        );
        fs::write(h.dir.path().join("state-B"), "unmarked\n").expect("reset");
        target.confirm(&c).expect("confirm from the new boot");
        assert_eq!(
            h.backend("state-B"),
            "unmarked",
            "not marked before the soak"
        );
        target.confirm(&c).expect("confirm after the soak");
        assert_eq!(h.backend("state-B"), "good", "marked good through RAUC");

        let target = h.open();
        assert_eq!(
            target.rollback_activation(&c).expect("rollback"),
            Activation::RebootRequired
        );
        assert_eq!(h.backend("state-B"), "bad");
        assert_eq!(h.backend("primary"), "A");
        h.reboot();
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));
        assert_eq!(
            h.open().rollback_activation(&c).expect("rollback again"),
            Activation::Done,
            "after the reboot the old slot runs"
        );
    })
}

/// A bundle changed after signing is refused by RAUC itself, with its own error, and nothing
/// boots differently; something that is not a bundle at all is refused at stage.
#[test]
fn rauc_refuses_a_corrupt_bundle_with_its_own_error() {
    with_rauc(|| {
        let h = rauc_harness::RaucHarness::new(Some(ORIGINAL));
        let c = ctx("corrupt");
        let bundle = h.bundle("corrupt", NEW);
        let mut bytes = fs::read(&bundle).expect("bundle");
        bytes[200..216].fill(b'X');
        fs::write(&bundle, bytes).expect("corrupt");
        let target = h.open();
        target.check(&c).expect("check");
        target
            .stage(&c, &bundle)
            .expect("it still ends like a bundle");
        let err = target.activate(&c).expect_err("RAUC refuses it");
        let message = err.to_string();
        assert!(matches!(err, TargetError::Rauc { .. }), "{message}");
        assert!(
            message.contains("signature verification failed"),
            "RAUC's own error: {message}"
        );
        assert_eq!(
            target.rollback_activation(&c).expect("rollback"),
            Activation::Done
        );
        h.reboot();
        assert_eq!(h.installed().as_deref(), Some(ORIGINAL));
        assert_eq!(h.backend("primary"), "A");

        let tarball = h.dir.path().join("downloads/app.tar");
        fs::write(&tarball, b"ustar\0 not a RAUC bundle at all").expect("tarball");
        let message = h
            .open()
            .stage(&ctx("tarball"), &tarball)
            .expect_err("not a bundle")
            .to_string();
        assert!(message.contains("not a RAUC bundle"), "{message}");
    })
}
