//! What `flotilla demo` cleans up when it panics.
//!
//! Release builds abort on a panic (`panic = "abort"` in the workspace's release profile), so no
//! destructor runs: without this module a panic would leave the demo's agent processes running
//! (retrying their vanished broker) and its directory, secret keys included, behind. The demo
//! registers its directory and starts its agents through here; a panic hook, installed for the
//! demo only, stops every registered agent and removes the directory (unless `--keep`), then
//! aborts. It aborts in every build: after the cleanup nothing of the demo is left to go on
//! with, and a debug build behaves as the shipped one does. The embedded broker and the
//! coordinator run inside the demo's process and end with it.
//!
//! `FLOTILLA_DEMO_PANIC_AFTER=agents-started` is a test hook ([`panic_if_asked`]): it makes the
//! demo panic once its agents run, so tests/tests/demo.rs can check this cleanup. It can only
//! make the demo panic; no other command reads it.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Mutex, MutexGuard, Once, PoisonError, TryLockError};
use std::time::Duration;

/// The test hook's variable; its value names the point where the demo panics.
pub const PANIC_AFTER_VAR: &str = "FLOTILLA_DEMO_PANIC_AFTER";

/// What a panic has to clean up: the directory to remove (none with `--keep`) and the agents.
struct Left {
    dir: Option<PathBuf>,
    agents: Vec<Child>,
}

static LEFT: Mutex<Left> = Mutex::new(Left {
    dir: None,
    agents: Vec::new(),
});

static HOOK: Once = Once::new();

fn left() -> MutexGuard<'static, Left> {
    LEFT.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Installs the panic hook (once per process) and registers `dir`, which a panic removes
/// unless `keep`.
pub fn install(dir: &Path, keep: bool) {
    left().dir = (!keep).then(|| dir.to_owned());
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            let stopped = clean_up();
            eprintln!("demo: panicked; {stopped}");
            std::process::abort();
        }));
    });
}

/// The demo ended without a panic and cleaned up itself: nothing is left for the hook.
pub fn forget() {
    let mut left = left();
    left.dir = None;
    stop(&mut left.agents);
}

/// Starts an agent and registers it, under the lock, so a panic on another thread either
/// finds it registered or happens before it starts.
pub fn spawn_agent(command: &mut Command) -> io::Result<()> {
    let mut left = left();
    let child = command.spawn()?;
    left.agents.push(child);
    Ok(())
}

/// Stops every registered agent (the demo's normal end, or an error).
pub fn stop_agents() {
    stop(&mut left().agents);
}

fn stop(agents: &mut Vec<Child>) {
    for mut child in agents.drain(..) {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// The panic hook's cleanup. The lock is only ever held briefly and never across a panic, but
/// the hook must not hang: after a few tries it gives up on the lock and says so.
fn clean_up() -> String {
    let mut left = None;
    for _ in 0..100 {
        match LEFT.try_lock() {
            Ok(guard) => left = Some(guard),
            Err(TryLockError::Poisoned(p)) => left = Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => std::thread::sleep(Duration::from_millis(20)),
        }
        if left.is_some() {
            break;
        }
    }
    let Some(mut left) = left else {
        return "could not stop its agents (busy); stop them with kill".to_owned();
    };
    let agents = left.agents.len();
    stop(&mut left.agents);
    // The demo's own control client's socket directory (TMPDIR/flotilla-mqtt-PID-N).
    flotilla_mqtt::remove_own_guard_dirs();
    let removed = match left.dir.take() {
        Some(dir) => {
            // The coordinator's store may still write into it while it is removed: try again.
            let gone = (0..3).any(|_| {
                let _ = std::fs::remove_dir_all(&dir);
                !dir.exists()
            });
            match gone {
                true => format!(", removed {}", dir.display()),
                false => format!(", could not remove {}", dir.display()),
            }
        }
        None => String::new(),
    };
    format!("stopped {agents} agents{removed}")
}

/// The test hook: panics when [`PANIC_AFTER_VAR`] names `point`.
pub fn panic_if_asked(point: &str) {
    if std::env::var(PANIC_AFTER_VAR).is_ok_and(|v| v == point) {
        panic!("{PANIC_AFTER_VAR}={point}: the demo panics here, as the test hook asks");
    }
}
