//! Following a rollout until it ends: `flotilla rollout status NAME --watch` and
//! `flotilla rollout start NAME --wait`.
//!
//! The status is fetched once a second. On a terminal it is redrawn in place (the cursor goes
//! back up over the last drawing, which is cleared); elsewhere (a pipe, a log) each status that
//! differs from the last is printed in full after a blank line, so the output is a readable
//! record. When the rollout reaches an end state the command exits with it (see [`exit_code`]);
//! Ctrl-C stops watching (exit 130) and leaves the rollout as it is; a closed pipe ends it
//! quietly ([`out`]).

use std::time::Duration;

use flotilla_protocol::control::PageQuery;
use tokio_util::sync::CancellationToken;

use crate::cli::client::{ClientError, ControlClient, DEFAULT_TIMEOUT};
use crate::cli::out::{self, out, outln};
use crate::cli::view::{self, Paint};

/// How often the status is fetched again.
pub const POLL: Duration = Duration::from_secs(1);

/// Exit code of a watch that ended because the operator interrupted it (128 + SIGINT).
pub const INTERRUPTED: i32 = 130;

/// The exit code for a rollout in `state`, or `None` while it can still move: 0 finished,
/// 3 failed, 4 stopped. 1 stays the code of an error and 2 of a usage error, as for every
/// command.
pub fn exit_code(state: &str) -> Option<i32> {
    match state {
        "finished" => Some(0),
        "failed" => Some(3),
        "stopped" => Some(4),
        _ => None,
    }
}

/// Follows rollout `name` until it ends or `shutdown` fires; returns the exit code.
pub async fn watch(
    client: &ControlClient,
    name: &str,
    query: PageQuery,
    shutdown: &CancellationToken,
) -> Result<i32, ClientError> {
    let paint = Paint::for_stdout();
    let in_place = paint == Paint::Colour || std::io::IsTerminal::is_terminal(&std::io::stdout());
    let mut drawn: Option<String> = None;
    loop {
        let status = client
            .rollout_status(name, query.clone(), DEFAULT_TIMEOUT)
            .await?;
        let text = view::rollout_status_in(&status, paint);
        if drawn.as_deref() != Some(text.as_str()) {
            match (&drawn, in_place) {
                // Up to the first line of the last drawing, and clear from there down.
                (Some(last), true) => out!("\x1b[{}F\x1b[J", last.lines().count()),
                (Some(_), false) => outln!(),
                (None, _) => {}
            }
            out!("{text}");
            out::flush();
            drawn = Some(text);
        }
        if let Some(code) = exit_code(&status.state) {
            return Ok(code);
        }
        tokio::select! {
            _ = tokio::time::sleep(POLL) => {}
            _ = shutdown.cancelled() => return Ok(INTERRUPTED),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_end_states_end_a_watch_and_each_has_its_code() {
        assert_eq!(exit_code("finished"), Some(0));
        assert_eq!(exit_code("failed"), Some(3));
        assert_eq!(exit_code("stopped"), Some(4));
        for moving in ["ready", "scheduled", "starting", "running", "paused"] {
            assert_eq!(exit_code(moving), None, "{moving}");
        }
    }
}
