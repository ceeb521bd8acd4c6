//! Several coordinators of one site, each a `flotilla serve` process with a name, sharing the
//! site's broker, keys and data directory (where releases and artifacts live): the failover
//! tests start two on one PostgreSQL store and kill, stop and cut them off.

use std::fs;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::site::{Process, Site};

impl Site {
    /// Starts `flotilla serve` as coordinator `name`: the site's usual config, then `extra`
    /// (such as a `[store]` section), then [`Site::coordinator_config`]. Its log is
    /// `coordinator-{name}.log`.
    pub fn start_named_coordinator(&mut self, name: &str, extra: &str) {
        let config = self.path(&format!("coordinator-{name}.toml"));
        let text = self.base_coordinator_config() + extra + "\n" + &self.coordinator_config;
        fs::write(&config, text).expect("write coordinator config");
        let command = Self::serve_command(&config);
        let process = Process::spawn(command, self.named_log_path(name));
        if let Some(mut old) = self.named.insert(name.to_owned(), process) {
            old.kill();
        }
    }

    /// The process id of coordinator `name`.
    pub fn named_pid(&self, name: &str) -> u32 {
        self.named
            .get(name)
            .unwrap_or_else(|| panic!("no coordinator {name} was started"))
            .id()
    }

    /// Kills coordinator `name` with SIGKILL and waits for it.
    pub fn kill_named_coordinator(&mut self, name: &str) {
        if let Some(mut p) = self.named.remove(name) {
            p.kill();
        }
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`) to coordinator `name`.
    pub fn signal_named_coordinator(&self, name: &str, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.named_pid(name).to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} coordinator {name}");
    }

    /// Stops coordinator `name` with SIGTERM; whether it exited within `within`.
    pub fn terminate_named_coordinator(&mut self, name: &str, within: Duration) -> bool {
        self.named
            .remove(name)
            .and_then(|mut p| p.terminate(within))
            .is_some()
    }

    fn named_log_path(&self, name: &str) -> PathBuf {
        self.path(&format!("coordinator-{name}.log"))
    }

    /// Everything coordinator `name` logged so far.
    pub fn named_log(&self, name: &str) -> String {
        fs::read_to_string(self.named_log_path(name)).unwrap_or_default()
    }

    /// How many lines of coordinator `name`'s log contain `needle`.
    pub fn named_log_count(&self, name: &str, needle: &str) -> usize {
        self.named_log(name)
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// Waits until coordinator `name`'s log holds `count` lines with `needle`; panics naming
    /// both after `within`.
    pub fn wait_named_log(&self, name: &str, needle: &str, count: usize, within: Duration) {
        let deadline = Instant::now() + within;
        while self.named_log_count(name, needle) < count {
            assert!(
                Instant::now() < deadline,
                "coordinator {name} did not log {needle:?} {count} time(s) within {within:?}; its log:\n{}",
                self.named_log(name)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The first of `names` whose log holds `needle` at least `count` times, waiting up to
    /// `within`.
    pub fn first_to_log(
        &self,
        names: &[&str],
        needle: &str,
        count: usize,
        within: Duration,
    ) -> String {
        let deadline = Instant::now() + within;
        loop {
            if let Some(name) = names
                .iter()
                .find(|n| self.named_log_count(n, needle) >= count)
            {
                return (*name).to_owned();
            }
            assert!(
                Instant::now() < deadline,
                "none of {names:?} logged {needle:?} within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
