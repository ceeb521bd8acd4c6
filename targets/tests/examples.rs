//! The shipped example scripts work as documented, driven through the script target.
//!
//! `examples/compose-tag.sh` runs here without docker: `COMPOSE_APPLY` is replaced by a command
//! that records each apply, which is what the script's users configure differently anyway.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use flotilla_targets::{ActionContext, ScriptConfig, ScriptTarget, TargetError, UpdateTarget};

struct Compose {
    dir: tempfile::TempDir,
}

impl Compose {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::create_dir(dir.path().join("project")).expect("project");
        Self { dir }
    }

    fn target(&self, health: &str) -> ScriptTarget {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/compose-tag.sh");
        let mut config = ScriptConfig::new(script, self.dir.path().join("state"));
        config.env = BTreeMap::from([
            (
                "COMPOSE_DIR".to_owned(),
                self.project().display().to_string(),
            ),
            ("COMPOSE_SERVICE".to_owned(), "shop".to_owned()),
            (
                "COMPOSE_APPLY".to_owned(),
                "cat flotilla.override.yml >> applied.log 2>/dev/null || echo none >> applied.log"
                    .to_owned(),
            ),
            ("COMPOSE_HEALTH".to_owned(), health.to_owned()),
        ]);
        ScriptTarget::new(config).expect("valid config")
    }

    fn project(&self) -> PathBuf {
        self.dir.path().join("project")
    }

    fn image(&self) -> Option<String> {
        let text = fs::read_to_string(self.project().join("flotilla.override.yml")).ok()?;
        text.lines()
            .find_map(|l| l.trim().strip_prefix("image: "))
            .map(str::to_owned)
    }

    fn artifact(&self, content: &str) -> PathBuf {
        let path = self.dir.path().join("artifact");
        fs::write(&path, content).expect("artifact");
        path
    }

    fn install(&self, t: &ScriptTarget, c: &ActionContext, image: &str) {
        t.check(c).expect("check");
        t.stage(c, &self.artifact(&format!("{image}\n")))
            .expect("stage");
        t.activate(c).expect("activate");
    }
}

fn ctx(id: &str) -> ActionContext {
    ActionContext::new(id, id, "image-ref")
}

#[test]
fn compose_tag_switches_the_service_image_and_rolls_back_to_the_previous_one() {
    let p = Compose::new();
    let t = p.target("true");
    p.install(&t, &ctx("r1"), "registry.example.com/shop:1.0");
    t.confirm(&ctx("r1")).expect("confirm");
    assert_eq!(p.image().as_deref(), Some("registry.example.com/shop:1.0"));
    let override_text =
        fs::read_to_string(p.project().join("flotilla.override.yml")).expect("override");
    assert!(override_text.contains("  shop:\n"), "{override_text}");

    p.install(&t, &ctx("r2"), "registry.example.com/shop:2.0");
    assert_eq!(p.image().as_deref(), Some("registry.example.com/shop:2.0"));
    t.rollback(&ctx("r2")).expect("rollback");
    assert_eq!(p.image().as_deref(), Some("registry.example.com/shop:1.0"));
    let applied = fs::read_to_string(p.project().join("applied.log")).expect("applied");
    assert_eq!(
        applied.matches("image: ").count(),
        3,
        "applied at each switch:\n{applied}"
    );
}

#[test]
fn compose_tag_first_install_rolls_back_to_no_override() {
    let p = Compose::new();
    let t = p.target("true");
    p.install(&t, &ctx("first"), "shop:1.0");
    t.rollback(&ctx("first")).expect("rollback");
    assert_eq!(p.image(), None);
}

#[test]
fn compose_tag_refuses_an_artifact_that_is_not_an_image_reference() {
    let p = Compose::new();
    let t = p.target("true");
    let err = t
        .stage(&ctx("bad"), &p.artifact("shop:1.0; rm -rf /\n"))
        .expect_err("refused");
    assert!(matches!(err, TargetError::Script { .. }), "{err}");
    assert!(
        err.to_string().contains("does not hold an image reference"),
        "{err}"
    );
    assert_eq!(p.image(), None);
}

#[test]
fn compose_tag_confirm_fails_when_the_health_command_does() {
    let p = Compose::new();
    let t = p.target("echo 'shop: 0/1 healthy' >&2; false");
    p.install(&t, &ctx("r1"), "shop:1.0");
    let err = t.confirm(&ctx("r1")).expect_err("unhealthy");
    assert!(err.to_string().contains("not healthy"), "{err}");
    t.rollback(&ctx("r1")).expect("rollback");
    assert_eq!(p.image(), None);
}
