//! # flotilla-agent
//!
//! The device agent of flotilla: it receives signed desired actions over MQTT, checks them
//! against its trusted keys, downloads the release's artifacts block by block, applies them
//! through update targets, runs health checks over a soak time, and reports every step back.
//!
//! ```text
//!          (desired action, verified)
//! Idle ──> Accepted ──> [Waiting] ──> Downloading{done} ──> Verified ──> Staged ──> Activated
//!   │         │                            │                   │  └──> Downloaded (download-only)
//!   │         └──> Refused{reason}         │                   │
//!   │                                      └──> Failed{reason} │        Confirming (health checks
//!   │   Canceled <── (signed cancel, any state before activation)        over the soak time)
//!   │                                                                      ├──> Ready
//!   └── every state is persisted (sled) before its side effect runs        └──> Failed{rolled_back}
//!
//! A device without health checks goes from Activated straight to Applied: installed, but its
//! readiness cannot be tracked.
//! ```
//!
//! ## Layout
//!
//! One file per concern, in layers: a module imports only modules on lower lines, so no two
//! modules import each other, directly or around a circle (the test `modules_form_layers`
//! checks the second half).
//!
//! ```text
//! agent                              the daemon: the agent loop, one action task at a time
//! machine                            one action, state by state
//! fetch   health   link   consent    what a step uses: blocks, health checks, MQTT, consent
//! trust   status   error             trust checks, keys install; status view; AgentError
//! store                              sled, and opening the agent's state
//! record  trust_state  identity      persisted data: action records; the trust state; device key
//! config  fault                      used from every layer
//! ```
//!
//! - [`agent`]: ties them together: [`run`].
//! - [`machine`]: the persisted update state machine ([`machine::drive`], [`machine::step`]).
//! - [`fetch`]: the pipelined, resumable block fetcher.
//! - [`health`]: health checks over the soak time.
//! - [`link`]: the MQTT link (owns the rumqttc event loop).
//! - [`consent`](mod@consent): local consent files for soft and time-forced actions.
//! - [`trust`]: signature, device, expiry, hardware, replay and counter checks; keys install.
//! - [`status`](mod@status): the local status view and the status file a running agent keeps.
//! - [`error`]: [`AgentError`], what stops the daemon. Other errors live where they arise:
//!   [`ConfigError`], [`store::StoreError`], [`trust::InstallKeysError`], [`StatusError`],
//!   [`ConsentError`].
//! - [`store`]: sled: action records, installed release, rollback point, report sequence,
//!   outbox, trust mirror; [`store::open_data_dir`] opens it with the trust state.
//! - [`record`]: the persisted records of an action: its state, action record, rollback point.
//! - `trust_state` (private, re-exported by [`trust`]): the trust state and the trust file.
//! - [`identity`]: the device's own key (`<data_dir>/device.key`), which signs what it sends.
//! - [`config`]: the TOML configuration, validated into [`Config`].
//! - [`fault`]: `FLOTILLA_FAULT`, crash points for crash-safety tests.
//!
//! ## At run time
//!
//! ```text
//! ┌──────────────────┐ LinkEvent (256) ┌──────────────────┐ FetchInput (256) ┌────────────────┐
//! │ link: poll task  │────────────────>│ agent loop (run) │─────────────────>│ action task    │
//! │ owns the rumqttc │                 │ verify, start or │── cancel token ─>│ machine::drive │
//! │ EventLoop        │                 │ cancel, route    │<─────────────────│ persist, step, │
//! └──────────────────┘                 │ blocks, outbox   │ final record (4) │ report         │
//!          ^ rumqttc requests (64)     └────────┬─────────┘                  └─┬────────┬─────┘
//! ┌──────────────────┐                          │                              │        │
//! │ link: writer task│<── Outgoing (64) ────────┴──────────────────────────────┘        │
//! │ owns AsyncClient │<── Outgoing::Fetch ── forwarder task <── BlockRequest (64) ──────┘
//! └──────────────────┘
//! ```
//!
//! - The link's poll task owns the rumqttc `EventLoop` and does nothing but poll it: publishes
//!   and acknowledgements become [`link::LinkEvent`]s (a block reply that finds the queue full
//!   is dropped; the fetcher asks again). The writer task holds an `AsyncClient` and sends the
//!   [`link::Outgoing`] messages queued through [`link::LinkHandle`] clones.
//! - The agent loop ([`run`], in the caller's task) decides: it verifies desired actions, runs at
//!   most one action task, passes it block replies and reconnects (`FetchInput`), cancels it on
//!   a signed cancel or for a newer action, and removes acknowledged reports from the outbox.
//! - The action task runs [`machine::drive`]: it persists each state before the step that acts
//!   on it and reports through the link itself. Its block requests go through a forwarder task
//!   that ends with the action. Target steps (stage, activate, rollback, reboot) run on the
//!   blocking pool; health checks are child processes.
//! - The caller's shutdown token (the binary cancels it on SIGINT or SIGTERM) stops the agent
//!   loop and the action task at a safe point. The link has its own token, cancelled last, once
//!   the offline state and the last report acknowledgements had a second to go through.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let config = flotilla_agent::Config::load("/etc/flotilla/agent.toml".as_ref())?;
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! flotilla_agent::run(config, shutdown).await?;
//! # Ok(())
//! # }
//! ```

pub mod agent;
pub mod config;
pub mod consent;
pub mod error;
pub mod fault;
pub mod fetch;
pub mod health;
pub mod identity;
pub mod link;
pub mod machine;
pub mod record;
pub mod status;
pub mod store;
pub mod trust;
mod trust_state;

pub use agent::run;
pub use config::{Config, ConfigError, DEFAULT_CONFIG};
pub use consent::{consent, ConsentError};
pub use error::AgentError;
pub use status::{status, StatusError};

#[cfg(test)]
mod tests {
    //! The module layers of the crate doc, checked: no module imports one that (through
    //! others) imports it back. `cargo test -p flotilla-agent modules_form_layers -- --nocapture`
    //! prints the edges.

    use std::collections::{BTreeMap, BTreeSet};
    use std::path::{Path, PathBuf};

    fn is_ident(c: char) -> bool {
        c.is_alphanumeric() || c == '_'
    }

    fn ident(s: &str) -> String {
        s.chars().take_while(|&c| is_ident(c)).collect()
    }

    /// `src` without comments and with every string and char literal emptied, so that paths in
    /// docs ("[`crate::store`]") and messages are not taken for imports.
    fn code_only(src: &str) -> String {
        let b: Vec<char> = src.chars().collect();
        let at = |i: usize| b.get(i).copied();
        let mut out = String::new();
        let mut i = 0;
        while i < b.len() {
            let (c, next) = (b[i], at(i + 1));
            let prev_ident = i > 0 && is_ident(b[i - 1]);
            if c == '/' && next == Some('/') {
                while i < b.len() && b[i] != '\n' {
                    i += 1;
                }
            } else if c == '/' && next == Some('*') {
                let mut depth = 0;
                while i < b.len() {
                    if b[i] == '/' && at(i + 1) == Some('*') {
                        depth += 1;
                        i += 2;
                    } else if b[i] == '*' && at(i + 1) == Some('/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
            } else if c == 'r' && !prev_ident && matches!(next, Some('"' | '#')) {
                let mut j = i + 1;
                while at(j) == Some('#') {
                    j += 1;
                }
                let hashes = j - i - 1;
                if at(j) != Some('"') {
                    out.push(c);
                    i += 1;
                    continue;
                }
                j += 1;
                while j < b.len() && !(b[j] == '"' && (1..=hashes).all(|k| at(j + k) == Some('#')))
                {
                    j += 1;
                }
                out.push_str("\"\"");
                i = j + 1 + hashes;
            } else if c == '"' {
                i += 1;
                while i < b.len() && b[i] != '"' {
                    i += if b[i] == '\\' { 2 } else { 1 };
                }
                out.push_str("\"\"");
                i += 1;
            } else if c == '\'' && (next == Some('\\') || at(i + 2) == Some('\'')) {
                // A char literal ('x', '\n', '\u{..}'); a lifetime ('a) stays.
                i += 2;
                while i < b.len() && b[i] != '\'' {
                    i += 1;
                }
                out.push_str("' '");
                i += 1;
            } else {
                out.push(c);
                i += 1;
            }
        }
        out
    }

    /// The first name after every `crate::` (each item of a `crate::{a, b::C}` group) and after
    /// every `super::super::` (from an inline module, the crate root); plain `super::` is the
    /// file's own module.
    fn used_names(code: &str) -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        for prefix in ["crate::", "super::super::"] {
            let mut rest = code;
            while let Some(at) = rest.find(prefix) {
                let before = rest[..at].chars().next_back();
                rest = &rest[at + prefix.len()..];
                if before.is_some_and(|c| is_ident(c) || c == ':') {
                    continue;
                }
                let Some(group) = rest.strip_prefix('{') else {
                    names.insert(ident(rest));
                    continue;
                };
                let (mut depth, mut expect) = (0, true);
                for (i, c) in group.char_indices() {
                    match c {
                        '}' if depth == 0 => break,
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        ',' if depth == 0 => expect = true,
                        c if expect && is_ident(c) => {
                            names.insert(ident(&group[i..]));
                            expect = false;
                        }
                        _ => {}
                    }
                }
            }
        }
        names
    }

    /// Every `.rs` file under `dir`, with the crate's top-level module it belongs to.
    fn modules(dir: &Path, top: Option<&str>, out: &mut Vec<(String, PathBuf)>) {
        let entries = std::fs::read_dir(dir).expect("read src");
        for entry in entries {
            let path = entry.expect("dir entry").path();
            let stem = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let module = top.map_or(stem.clone(), str::to_owned);
            if path.is_dir() {
                modules(&path, Some(&module), out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push((module, path));
            }
        }
    }

    /// A cycle through `node`'s descendants, if there is one.
    fn cycle_from(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|p| p == node) {
            let mut cycle = path[start..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if !done.insert(node.to_owned()) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = cycle_from(next, graph, done, path) {
                return Some(cycle);
            }
        }
        path.pop();
        None
    }

    #[test]
    fn the_scan_reads_use_groups_and_skips_docs_and_strings() {
        let text = "//! [`crate::doc`]\nuse crate::{a::X, b,\n    c::{self, D}};\n\
                    fn f() { crate::e::g(\"crate::s\"); let _ = r#\"crate::raw\"#; }\n\
                    /* crate::block */ mod t { use super::super::h; }";
        let names: Vec<String> = used_names(&code_only(text)).into_iter().collect();
        assert_eq!(names, ["a", "b", "c", "e", "h"]);
    }

    #[test]
    fn modules_form_layers() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        modules(&src, None, &mut files);
        // lib.rs is the root and re-exports everything; main.rs is the binary's crate.
        files.retain(|(m, _)| m != "lib" && m != "main");
        let known: BTreeSet<String> = files.iter().map(|(m, _)| m.clone()).collect();
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (module, path) in &files {
            let text = std::fs::read_to_string(path).expect("read module");
            for name in used_names(&code_only(&text)) {
                // Anything not a module is a lib.rs re-export (`crate::Config`), which would
                // make the module depend on the root, and the root depends on every module.
                let to = if known.contains(&name) {
                    name
                } else {
                    "lib".to_owned()
                };
                if &to != module {
                    graph.entry(module.clone()).or_default().insert(to);
                }
            }
        }
        for (from, tos) in &graph {
            for to in tos {
                println!("{from} -> {to}");
            }
        }
        assert!(
            ["agent", "machine", "store", "trust"]
                .iter()
                .all(|m| known.contains(*m))
                && graph.get("agent").is_some_and(|t| t.contains("machine")),
            "the scan found the modules and the agent's imports: {graph:?}"
        );
        let users_of_lib: Vec<&String> = graph
            .iter()
            .filter(|(_, tos)| tos.contains("lib"))
            .map(|(from, _)| from)
            .collect();
        assert!(
            users_of_lib.is_empty(),
            "import from the defining module, not a lib.rs re-export: {users_of_lib:?}"
        );
        let mut done = BTreeSet::new();
        for module in &known {
            if let Some(cycle) = cycle_from(module, &graph, &mut done, &mut Vec::new()) {
                panic!(
                    "modules import each other in a circle: {}",
                    cycle.join(" -> ")
                );
            }
        }
    }
}
