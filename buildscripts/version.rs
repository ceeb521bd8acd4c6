//! Stamps the build with the commit it came from and that commit's date, for `--version`
//! (`flotilla 0.1.0 (commit 1a2b3c4d5e6f, 2026-11-27)`). Outside a git checkout (a source
//! package) both read "unknown".

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (out.status.success() && !text.is_empty()).then_some(text)
}

fn main() {
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let date = git(&["log", "-1", "--format=%cs"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=FLOTILLA_BUILD={commit}, {date}");
    // Again when HEAD moves: HEAD itself (a checkout) and the branch it names (a commit).
    if let Some(git_dir) = git(&["rev-parse", "--git-dir"]) {
        let head = Path::new(&git_dir).join("HEAD");
        println!("cargo:rerun-if-changed={}", head.display());
        if let Some(branch) = std::fs::read_to_string(&head)
            .ok()
            .and_then(|h| h.strip_prefix("ref: ").map(|r| r.trim().to_owned()))
        {
            println!(
                "cargo:rerun-if-changed={}",
                Path::new(&git_dir).join(branch).display()
            );
        }
    }
    println!("cargo:rerun-if-changed=../buildscripts/version.rs");
}
