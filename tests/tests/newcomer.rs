//! What a newcomer does first, following the README: the demo with `--keep`, then a first own
//! rollout to the demo's fleet ("Your first rollout"), and the README's example spec against
//! agents with the shipped default config. The README's own text is what runs here.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use flotilla_tests::{bin, WAIT};
use serde_json::Value;

fn readme() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The text of the README section that starts with `heading`, up to the next `## `.
fn section(readme: &str, heading: &str) -> String {
    let start = readme
        .find(heading)
        .unwrap_or_else(|| panic!("README has no {heading:?}"));
    let rest = &readme[start + heading.len()..];
    rest[..rest.find("\n## ").unwrap_or(rest.len())].to_owned()
}

/// The text between `open` and the next `close` after it.
fn between<'a>(text: &'a str, open: &str, close: &str) -> &'a str {
    let start = text
        .find(open)
        .unwrap_or_else(|| panic!("no {open:?} in:\n{text}"))
        + open.len();
    let len = text[start..]
        .find(close)
        .unwrap_or_else(|| panic!("no {close:?} after {open:?}"));
    &text[start..start + len]
}

/// Processes started by the test and the kept demo directory, cleaned up however it ends.
struct Kept {
    dir: PathBuf,
    children: Vec<Child>,
}

impl Drop for Kept {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            for log in ["coordinator.log", "serve.log"] {
                let text = fs::read_to_string(self.dir.join(log)).unwrap_or_default();
                eprintln!("---- {log}\n{text}");
            }
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Kept {
    /// Starts a process in the kept directory with its output in `log` there.
    fn spawn(&mut self, program: PathBuf, args: &[&str], log: &str) {
        let out = fs::File::create(self.dir.join(log)).expect("create log");
        let child = Command::new(program)
            .args(args)
            .current_dir(&self.dir)
            .env("RUST_LOG", "info,rumqttd=warn")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("clone log"))
            .stderr(out)
            .spawn()
            .expect("spawn");
        self.children.push(child);
    }
}

/// Runs `flotilla ARGS` in `dir` as the README's shell does after its `export` line.
fn flotilla_in(dir: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    Command::new(bin("flotilla"))
        .args(args)
        .current_dir(dir)
        .env_remove("FLOTILLA_TOPIC_ROOT")
        .envs(env.iter().copied())
        .output()
        .expect("run flotilla")
}

fn ok(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_first_rollout_in_the_readme_reaches_the_kept_demo_fleet() {
    let out = Command::new(bin("flotilla"))
        .args(["demo", "--keep", "--fail", "0", "--devices", "3", "--json"])
        .env("FLOTILLA_AGENT_BIN", bin("flotilla-agent"))
        .output()
        .expect("run flotilla demo");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let dir = PathBuf::from(between(&stderr, "kept ", "\n"));
    let mut kept = Kept {
        dir: dir.clone(),
        children: Vec::new(),
    };
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let port = between(&stderr, "FLOTILLA_BROKER=127.0.0.1:", " ").to_owned();

    // What --keep promises: the coordinator's config and log, and each agent's, with content.
    assert!(dir.join("coordinator.toml").is_file(), "{stderr}");
    let log = fs::read_to_string(dir.join("coordinator.log")).unwrap_or_default();
    assert!(log.contains("INFO"), "coordinator.log: {log:?}");
    for id in ["dev-01", "dev-02", "dev-03"] {
        let agent = dir.join("agents").join(id);
        assert!(agent.join("agent.toml").is_file(), "{id}");
        let log = fs::read_to_string(agent.join("agent.log")).unwrap_or_default();
        assert!(log.contains("INFO"), "{id}'s agent.log: {log:?}");
    }

    // The README's steps, in the kept directory.
    let steps = section(&readme(), "## Your first rollout");
    kept.spawn(
        bin("flotilla"),
        &["serve", "--config", "coordinator.toml"],
        "serve.log",
    );
    for id in ["dev-01", "dev-02", "dev-03"] {
        let config = format!("agents/{id}/agent.toml");
        kept.spawn(
            bin("flotilla-agent"),
            &["run", "--config", &config],
            &format!("{id}.log"),
        );
    }
    let export = between(&steps, "export FLOTILLA_", "   #");
    assert_eq!(
        export,
        "BROKER=127.0.0.1:PORT FLOTILLA_OPERATOR_KEY=keys/demo.key"
    );
    let broker = format!("127.0.0.1:{port}");
    let env = [
        ("FLOTILLA_BROKER", broker.as_str()),
        ("FLOTILLA_OPERATOR_KEY", "keys/demo.key"),
    ];

    let deadline = Instant::now() + WAIT;
    loop {
        let out = flotilla_in(&dir, &env, &["devices", "--json"]);
        let online = serde_json::from_slice::<Vec<Value>>(&out.stdout)
            .map(|list| list.iter().filter(|d| d["online"] == true).count())
            .unwrap_or(0);
        if online == 3 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the kept fleet did not come back online: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    let echo = between(&steps, "echo \"", "\n");
    let (content, file) = echo.split_once("\" > ").expect("echo TEXT > FILE");
    fs::write(dir.join(file), format!("{content}\n")).expect("write the app");
    let create = format!(
        "release create {}",
        between(&steps, "flotilla release create ", "\n")
    );
    let out = flotilla_in(&dir, &env, &create.split_whitespace().collect::<Vec<_>>());
    let warned = String::from_utf8_lossy(&out.stderr).into_owned();
    ok(out, &create);
    assert!(
        !warned.contains("warning"),
        "a one-block list is not worth a warning: {warned}"
    );
    let spec = between(&steps, "cat > first.toml <<'EOF'\n", "EOF\n");
    fs::write(dir.join("first.toml"), spec).expect("write first.toml");

    let fleet = ok(flotilla_in(&dir, &env, &["devices", "--json"]), "devices");
    fs::write(dir.join("fleet.json"), fleet).expect("write fleet.json");
    let plan = ok(
        flotilla_in(
            &dir,
            &env,
            &["plan", "--spec", "first.toml", "--fleet", "fleet.json"],
        ),
        "plan",
    );
    assert!(plan.contains("3 devices in 2 groups"), "{plan}");
    ok(
        flotilla_in(&dir, &env, &["rollout", "create", "--spec", "first.toml"]),
        "rollout create",
    );
    // `--wait` follows the rollout to its end and exits with it: 0 for finished. Off a
    // terminal each new status is printed whole, without colour codes.
    let start = between(&steps, "flotilla rollout start ", "  ");
    let start: Vec<&str> = ["rollout", "start"]
        .into_iter()
        .chain(start.split_whitespace())
        .collect();
    assert_eq!(start, ["rollout", "start", "first", "--wait"]);
    let followed = ok(flotilla_in(&dir, &env, &start), "rollout start --wait");
    assert!(
        followed.starts_with("rollout first  release fw-3  state "),
        "{followed}"
    );
    let last = followed
        .rsplit("\nrollout first ")
        .next()
        .unwrap_or_default();
    assert!(last.contains("state finished"), "{followed}");
    assert!(
        !followed.contains('\x1b'),
        "no escape codes in a pipe: {followed}"
    );
    let list = ok(
        flotilla_in(&dir, &env, &["rollout", "list"]),
        "rollout list",
    );
    assert!(
        list.lines()
            .any(|l| l.starts_with("first ") && l.contains(" finished ")),
        "{list}"
    );
    for id in ["dev-01", "dev-02", "dev-03"] {
        let app = fs::read_to_string(dir.join("agents").join(id).join("app.bin")).expect("app");
        assert_eq!(app, format!("{content}\n"), "{id} runs the first release");
    }
}

#[test]
fn the_demo_prints_no_directory_it_then_removes() {
    let out = Command::new(bin("flotilla"))
        .args(["demo", "--fail", "0", "--devices", "3"])
        .env("FLOTILLA_AGENT_BIN", bin("flotilla-agent"))
        .output()
        .expect("run flotilla demo");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0), "{text}");
    for word in text.split_whitespace() {
        if word.contains("flotilla-demo-") {
            let path = word.trim_matches(|c: char| !(c.is_alphanumeric() || "/-_.".contains(c)));
            assert!(
                Path::new(path).exists(),
                "the demo printed {path}, which no longer exists:\n{text}"
            );
        }
    }
}

/// The value of `key = "value"` in the first line of `text` that sets it.
fn toml_string(text: &str, key: &str) -> String {
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim() == key).then(|| v.trim().trim_matches('"').to_owned())
        })
        .unwrap_or_else(|| panic!("no {key} in:\n{text}"))
}

#[test]
fn the_readme_example_spec_selects_agents_with_the_default_config() {
    let default = ok(
        Command::new(bin("flotilla-agent"))
            .arg("print-default-config")
            .output()
            .expect("run flotilla-agent"),
        "print-default-config",
    );
    let hardware = toml_string(&default, "hardware_id");
    let labels: serde_json::Map<String, Value> = between(&default, "\n[labels]\n", "\n[")
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && l.contains('='))
        .map(|l| {
            let (k, v) = l.split_once('=').expect("key = value");
            (k.trim().to_owned(), Value::from(v.trim().trim_matches('"')))
        })
        .collect();
    let fleet: Vec<Value> = (1..=10)
        .map(|i| serde_json::json!({"id": format!("dev-{i}"), "hardware_id": hardware, "labels": labels}))
        .collect();

    let readme = readme();
    let spec = between(&readme, "```toml\nname = \"fw-2-4\"", "```");
    let dir = tempfile::tempdir().expect("tempdir");
    fs::write(
        dir.path().join("fw-2-4.toml"),
        format!("name = \"fw-2-4\"{spec}"),
    )
    .expect("spec");
    fs::write(
        dir.path().join("fleet.json"),
        serde_json::to_string(&fleet).expect("json"),
    )
    .expect("fleet");
    let plan: Value = serde_json::from_str(&ok(
        Command::new(bin("flotilla"))
            .args([
                "plan",
                "--json",
                "--spec",
                "fw-2-4.toml",
                "--fleet",
                "fleet.json",
            ])
            .current_dir(dir.path())
            .output()
            .expect("run flotilla plan"),
        "plan the README's spec",
    ))
    .expect("plan JSON");
    let planned: usize = plan["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .map(|g| g["devices"].as_array().map_or(0, Vec::len))
        .sum();
    assert_eq!(planned, 10, "every default agent is in a group: {plan:#}");

    // The README's release is for the default agent's hardware.
    let release = readme
        .lines()
        .find(|l| l.contains("--name fw-2.4.0"))
        .expect("the README creates release fw-2.4.0");
    assert!(
        release.contains(&format!("--hardware {hardware} ")),
        "the README's release is not for hardware {hardware}: {release}"
    );
    assert_eq!(toml_string(spec, "release"), "fw-2.4.0");
}
