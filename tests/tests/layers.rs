//! The layering of docs/architecture.md, checked: inside every crate of the workspace, no module
//! imports one that (through others) imports it back, and no module imports its own ancestor (a
//! re-export in `lib.rs` or a `mod.rs`, which declares the module itself). Crate-level direction
//! is the compiler's job (Cargo refuses dependency cycles) plus `.ci/run`'s check that
//! flotilla-rollout has no runtime, MQTT or store dependency.
//!
//! `cargo test -p flotilla-tests --test layers -- --nocapture` prints every crate's edges.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every crate's source directory, relative to the workspace root.
const CRATES: &[&str] = &[
    "protocol/src",
    "targets/src",
    "agent/src",
    "coordinator/rollout/src",
    "coordinator/src",
];

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
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
            while j < b.len() && !(b[j] == '"' && (1..=hashes).all(|k| at(j + k) == Some('#'))) {
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

/// The path segments at the start of `s` (`a::b::C` -> [a, b, C]), stopping before a group.
fn path_at(s: &str) -> Vec<String> {
    let mut segments = Vec::new();
    let mut rest = s;
    loop {
        let name: String = rest.chars().take_while(|&c| is_ident(c)).collect();
        if name.is_empty() {
            break;
        }
        rest = &rest[name.len()..];
        segments.push(name);
        match rest.strip_prefix("::") {
            Some(r) if !r.starts_with('{') && !r.starts_with('*') => rest = r,
            _ => break,
        }
    }
    segments
}

/// Every path used after `prefix` (`crate::`, `super::`), each `{a, b::c}` group item joined to
/// the path before it.
fn used_paths(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + prefix.len()..];
        if before.is_some_and(|c| is_ident(c) || c == ':') {
            continue;
        }
        let head = path_at(rest);
        let after: String = head.join("::");
        let tail = rest[after.len()..].trim_start_matches("::");
        let Some(group) = tail.strip_prefix('{') else {
            paths.push(head);
            continue;
        };
        let (mut depth, mut expect) = (0, true);
        for (i, c) in group.char_indices() {
            match c {
                '}' if depth == 0 => break,
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => expect = true,
                c if expect && depth == 0 && is_ident(c) => {
                    let mut path = head.clone();
                    path.extend(path_at(&group[i..]));
                    paths.push(path);
                    expect = false;
                }
                _ => {}
            }
        }
    }
    paths
}

/// Every `.rs` file under `dir` with its module path (`cli::commands`; `mod.rs` is its folder's
/// module); `lib.rs` and `main.rs` are the crate roots and left out.
fn modules(src: &Path, dir: &Path, out: &mut Vec<(String, PathBuf)>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            modules(src, &path, out);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let rel = path
            .strip_prefix(src)
            .expect("under src")
            .with_extension("");
        let mut parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if parts.last().is_some_and(|p| p == "mod") {
            parts.pop();
        }
        let name = parts.join("::");
        if name != "lib" && name != "main" {
            out.push((name, path));
        }
    }
}

/// The longest known module that `path` starts with.
fn resolve(path: &[String], known: &BTreeSet<String>) -> Option<String> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|m| known.contains(m))
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

/// The module import graph of one crate: module -> modules it uses. `lib` stands for a
/// re-export from the crate root.
fn graph_of(src: &Path) -> (BTreeSet<String>, BTreeMap<String, BTreeSet<String>>) {
    let mut files = Vec::new();
    modules(src, src, &mut files);
    let known: BTreeSet<String> = files.iter().map(|(m, _)| m.clone()).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, path) in &files {
        let code = code_only(&std::fs::read_to_string(path).expect("read module"));
        let parent: Vec<String> = module
            .split("::")
            .map(str::to_owned)
            .collect::<Vec<_>>()
            .split_last()
            .map(|(_, p)| p.to_vec())
            .unwrap_or_default();
        let mut targets = Vec::new();
        for used in used_paths(&code, "crate::") {
            // Not a module: an item of lib.rs, re-exported or defined there.
            targets.push(resolve(&used, &known).unwrap_or_else(|| "lib".to_owned()));
        }
        for used in used_paths(&code, "super::") {
            // `super::x` from the file's module is a sibling; from an inline `mod tests` it is
            // an item of the file itself, which resolves to no module and is skipped.
            let mut full = parent.clone();
            full.extend(used);
            if let Some(m) = resolve(&full, &known) {
                if full.len() > parent.len() && m.split("::").count() > parent.len() {
                    targets.push(m);
                }
            }
        }
        for to in targets {
            if &to != module {
                graph.entry(module.clone()).or_default().insert(to);
            }
        }
    }
    (known, graph)
}

#[test]
fn the_scan_reads_paths_groups_and_skips_docs_and_strings() {
    let text = "//! [`crate::doc`]\nuse crate::{a::X, b,\n    c::{self, D}};\n\
                fn f() { crate::e::f::g(\"crate::s\"); let _ = r#\"crate::raw\"#; }\n\
                /* crate::block */ use super::h::I;";
    let code = code_only(text);
    let paths: Vec<String> = used_paths(&code, "crate::")
        .into_iter()
        .map(|p| p.join("::"))
        .collect();
    assert_eq!(paths, ["a::X", "b", "c", "e::f::g"]);
    let known: BTreeSet<String> = ["e", "e::f"].iter().map(|s| s.to_string()).collect();
    assert_eq!(
        resolve(&["e".into(), "f".into(), "g".into()], &known),
        Some("e::f".into())
    );
    assert_eq!(
        used_paths(&code, "super::"),
        [vec!["h".to_owned(), "I".to_owned()]]
    );
}

#[test]
fn modules_form_layers_in_every_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut problems = Vec::new();
    for krate in CRATES {
        let (known, graph) = graph_of(&root.join(krate));
        println!("{krate}:");
        for (from, tos) in &graph {
            println!(
                "  {from} -> {}",
                tos.iter().cloned().collect::<Vec<_>>().join(", ")
            );
        }
        assert!(
            known.len() >= 3,
            "{krate}: the scan found its modules: {known:?}"
        );
        for (from, tos) in &graph {
            for to in tos {
                let ancestor = to == "lib" || from.starts_with(&format!("{to}::"));
                if ancestor {
                    problems.push(format!(
                        "{krate}: {from} imports from {to}, which declares it; import from the defining module"
                    ));
                }
            }
        }
        // Files, and the top-level folders they sit in (`cli` may use `service`, never back).
        let top = |m: &str| m.split("::").next().unwrap_or(m).to_owned();
        let mut folders: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (from, tos) in &graph {
            for to in tos.iter().filter(|to| top(to) != top(from)) {
                folders.entry(top(from)).or_default().insert(top(to));
            }
        }
        for (what, graph) in [("modules", &graph), ("top-level modules", &folders)] {
            let mut done = BTreeSet::new();
            for module in graph.keys() {
                if let Some(cycle) = cycle_from(module, graph, &mut done, &mut Vec::new()) {
                    problems.push(format!(
                        "{krate}: {what} import each other in a circle: {}",
                        cycle.join(" -> ")
                    ));
                    break;
                }
            }
        }
    }
    // The scan sees the imports the architecture names.
    let (_, agent) = graph_of(&root.join("agent/src"));
    assert!(agent.get("agent").is_some_and(|t| t.contains("machine")));
    let (_, coordinator) = graph_of(&root.join("coordinator/src"));
    assert!(coordinator
        .get("cli::commands")
        .is_some_and(|t| t.contains("cli::client")));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
