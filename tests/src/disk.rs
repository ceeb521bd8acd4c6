//! Small real filesystems for disk-full tests: a tmpfs mounted over a directory, and a filler
//! file that takes its free space.
//!
//! Mounting needs root. Where it is not possible the tests skip with a loud line on stderr,
//! unless `FLOTILLA_REQUIRE_TMPFS=1` (set by `.ci/run`, which runs as root): then they fail.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A tmpfs mounted over a directory; unmounted (lazily) when dropped.
pub struct Tmpfs {
    path: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (such as "16m") over `path` (created if missing). `None`, after
    /// a loud skip line, when this machine cannot; a panic instead when CI requires it.
    pub fn mount(path: &Path, size: &str, test: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(path).expect("mount point");
        let output = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(path)
            .output();
        let failure = match output {
            Ok(out) if out.status.success() => {
                return Some(Tmpfs {
                    path: path.to_owned(),
                })
            }
            Ok(out) => String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            Err(e) => e.to_string(),
        };
        let message = format!(
            "cannot mount a tmpfs at {} ({failure}); disk-full tests need root",
            path.display()
        );
        if std::env::var("FLOTILLA_REQUIRE_TMPFS").is_ok_and(|v| v == "1") {
            panic!("{message} and FLOTILLA_REQUIRE_TMPFS=1 requires them");
        }
        // Straight to stderr: the test harness hides eprintln! of a passing test.
        let _ = writeln!(
            std::io::stderr().lock(),
            "\n!!!! SKIPPED {test}: {message}"
        );
        None
    }

    /// Fills the filesystem with a file until the write fails for lack of space, leaving about
    /// `leave` bytes free (rounded to 64 KiB; 0 fills it to the last byte). Returns the filler's path.
    pub fn fill(&self, leave: u64) -> PathBuf {
        let filler = self.path.join("filler");
        let mut file = std::fs::File::create(&filler).expect("create filler");
        let chunk = vec![0u8; 64 * 1024];
        loop {
            if self.free() <= leave + chunk.len() as u64 {
                break;
            }
            if file.write_all(&chunk).is_err() {
                break;
            }
        }
        if leave == 0 {
            // The last pages, until the filesystem says it is full.
            let page = [0u8; 4096];
            while file.write_all(&page).and_then(|()| file.flush()).is_ok() {}
        }
        let _ = file.sync_all();
        filler
    }

    /// Free bytes on the filesystem.
    pub fn free(&self) -> u64 {
        let out = Command::new("df")
            .args(["--output=avail", "-B1"])
            .arg(&self.path)
            .output()
            .expect("run df");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .nth(1)
            .and_then(|l| l.trim().parse().ok())
            .expect("df prints the free bytes")
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}
