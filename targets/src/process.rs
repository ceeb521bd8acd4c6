//! Running a helper program with a deadline: boot-control tools, reboot commands and user
//! scripts all go through [`run`].
//!
//! The program runs in its own process group, so a timeout kills it *and* whatever it started
//! (a shell script's `dpkg`, `docker`), not just the shell. Its output is captured with a cap,
//! so a chatty program cannot exhaust the agent's memory, and a program that leaves a daemon
//! holding its stdout open cannot make the caller wait forever.

use std::io::{self, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// Most bytes kept of each output stream; the *last* bytes are kept, where the answer and the
/// final error message are.
const OUTPUT_CAP: usize = 64 * 1024;
/// How long to wait for the output pipes to close after the program exited (a daemon it started
/// may keep them open).
const PIPE_GRACE: Duration = Duration::from_secs(2);

/// What a finished program left behind.
#[derive(Debug)]
pub(crate) struct Output {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Why a program produced no [`Output`].
#[derive(Debug)]
pub(crate) enum RunError {
    /// It could not be started (not found, not executable).
    Spawn(io::Error),
    /// Waiting for it failed.
    Wait(io::Error),
    /// It ran past its deadline and was killed with its process group.
    TimedOut { stderr: Vec<u8> },
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::Spawn(e) => write!(f, "cannot start it: {e}"),
            RunError::Wait(e) => write!(f, "cannot wait for it: {e}"),
            RunError::TimedOut { stderr } => {
                write!(f, "timed out and was killed")?;
                match last_line(stderr) {
                    Some(line) => write!(f, " (last stderr line: {line})"),
                    None => Ok(()),
                }
            }
        }
    }
}

/// Called with each line a program prints, as it prints it (for progress in the agent's log).
pub(crate) type LineSink = Arc<dyn Fn(&str) + Send + Sync>;

/// Runs `cmd` to completion or until `timeout`, feeding it `stdin` (or nothing).
pub(crate) fn run(
    cmd: &mut Command,
    stdin: Option<&[u8]>,
    timeout: Duration,
) -> Result<Output, RunError> {
    run_following(cmd, stdin, timeout, None)
}

/// [`run`], also handing every line of stdout and stderr to `lines` as it arrives.
pub(crate) fn run_following(
    cmd: &mut Command,
    stdin: Option<&[u8]>,
    timeout: Duration,
    lines: Option<LineSink>,
) -> Result<Output, RunError> {
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .process_group(0);
    let mut child = cmd.spawn().map_err(RunError::Spawn)?;
    let stdout = capture(child.stdout.take(), lines.clone());
    let stderr = capture(child.stderr.take(), lines);
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // A program that exits without reading is its own business; its exit status tells.
        let _ = pipe.write_all(input);
    }

    let deadline = Instant::now() + timeout;
    let mut step = Duration::from_millis(5);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(e) => {
                kill_group(&mut child);
                return Err(RunError::Wait(e));
            }
        }
        let now = Instant::now();
        if now >= deadline {
            kill_group(&mut child);
            return Err(RunError::TimedOut {
                stderr: stderr.finish(PIPE_GRACE),
            });
        }
        thread::sleep(step.min(deadline - now));
        step = (step * 2).min(Duration::from_millis(100));
    };
    Ok(Output {
        status,
        stdout: stdout.finish(PIPE_GRACE),
        stderr: stderr.finish(PIPE_GRACE),
    })
}

/// The last non-empty line of `bytes`, trimmed, as text.
pub(crate) fn last_line(bytes: &[u8]) -> Option<String> {
    String::from_utf8_lossy(bytes)
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .map(str::to_owned)
}

/// Kills the child's whole process group, then the child itself (in case the group kill was
/// not possible), and reaps it.
fn kill_group(child: &mut Child) {
    // std has no safe killpg; kill(1) does it without unsafe code.
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    let _ = child.kill();
    let _ = child.wait();
}

/// A stream being read on its own thread into a capped buffer.
struct Capture {
    buf: Arc<Mutex<Vec<u8>>>,
    done: mpsc::Receiver<()>,
}

impl Capture {
    /// Waits up to `grace` for the stream to close and returns what was read.
    fn finish(self, grace: Duration) -> Vec<u8> {
        let _ = self.done.recv_timeout(grace);
        match self.buf.lock() {
            Ok(mut buf) => std::mem::take(&mut *buf),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        }
    }
}

fn capture(stream: Option<impl Read + Send + 'static>, lines: Option<LineSink>) -> Capture {
    let buf = Arc::new(Mutex::new(Vec::new()));
    let (tx, done) = mpsc::channel();
    if let Some(mut stream) = stream {
        let shared = Arc::clone(&buf);
        thread::spawn(move || {
            let mut chunk = [0u8; 8192];
            // The unfinished last line, for `lines`; capped like the buffer.
            let mut pending = Vec::new();
            loop {
                match stream.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if let Some(sink) = &lines {
                            pending.extend_from_slice(&chunk[..n]);
                            while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                                let line: Vec<u8> = pending.drain(..=end).collect();
                                let text = String::from_utf8_lossy(&line);
                                if !text.trim().is_empty() {
                                    sink(text.trim_end());
                                }
                            }
                            if pending.len() > OUTPUT_CAP {
                                pending.clear();
                            }
                        }
                        let Ok(mut buf) = shared.lock() else { break };
                        buf.extend_from_slice(&chunk[..n]);
                        if buf.len() > OUTPUT_CAP {
                            let excess = buf.len() - OUTPUT_CAP;
                            buf.drain(..excess);
                        }
                    }
                }
            }
            if let Some(sink) = &lines {
                let text = String::from_utf8_lossy(&pending);
                if !text.trim().is_empty() {
                    sink(text.trim_end());
                }
            }
            let _ = tx.send(());
        });
    }
    Capture { buf, done }
}

/// Checks that `path` is an executable file, the program a target runs; `what` names it in the
/// refusal ("the update script").
pub(crate) fn check_executable(
    path: &std::path::Path,
    what: &str,
) -> Result<(), crate::error::TargetError> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|source| crate::error::TargetError::Check {
        path: path.to_owned(),
        source,
    })?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(crate::error::TargetError::NotUpdatable {
            path: path.to_owned(),
            reason: format!("{what} must be an executable file"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", script]);
        cmd
    }

    #[test]
    fn captures_output_and_exit_status() {
        let out = run(
            &mut sh("read x; echo got $x; echo oops >&2; exit 3"),
            Some(b"hello\n"),
            Duration::from_secs(30),
        )
        .expect("runs");
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(out.stdout, b"got hello\n");
        assert_eq!(last_line(&out.stderr).as_deref(), Some("oops"));
    }

    #[test]
    fn a_program_past_its_deadline_is_killed_with_its_children() {
        let dir = tempfile::tempdir().expect("tempdir");
        let witness = dir.path().join("still-running");
        // The grandchild would create the witness file if it survived the kill.
        let script = format!(
            "echo starting >&2; (sleep 1; touch {}) & sleep 60",
            witness.display()
        );
        let err = run(&mut sh(&script), None, Duration::from_millis(300)).expect_err("times out");
        assert!(err.to_string().contains("timed out"), "{err}");
        assert!(err.to_string().contains("starting"), "{err}");
        thread::sleep(Duration::from_secs(2));
        assert!(!witness.exists(), "the grandchild was killed too");
    }

    #[test]
    fn following_hands_over_every_line_of_both_streams() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink_seen = Arc::clone(&seen);
        let sink: LineSink = Arc::new(move |line: &str| {
            sink_seen.lock().expect("lock").push(line.to_owned());
        });
        let out = run_following(
            &mut sh("echo one; echo two >&2; printf three"),
            None,
            Duration::from_secs(30),
            Some(sink),
        )
        .expect("runs");
        assert!(out.status.success());
        let mut seen = seen.lock().expect("lock").clone();
        seen.sort();
        assert_eq!(seen, ["one", "three", "two"]);
    }

    #[test]
    fn a_missing_program_is_a_spawn_error() {
        let err = run(
            &mut Command::new("/nonexistent/flotilla-tool"),
            None,
            Duration::from_secs(5),
        )
        .expect_err("no such program");
        assert!(matches!(err, RunError::Spawn(_)), "{err}");
    }

    #[test]
    fn last_line_skips_trailing_blank_lines() {
        assert_eq!(last_line(b"a\nb\n\n  \n").as_deref(), Some("b"));
        assert_eq!(last_line(b""), None);
    }
}
