//! The agent's own commands end quietly when the reader of their output went away
//! (`flotilla-agent print-default-config | head -1`): no panic, no backtrace, exit 0.

use std::process::{Command, Stdio};

#[test]
fn a_closed_output_pipe_ends_a_command_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_flotilla-agent"))
        .arg("print-default-config")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run flotilla-agent");
    // The reader goes away before the agent writes.
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(0), "{err}");
}
