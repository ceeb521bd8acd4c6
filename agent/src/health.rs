//! Health checks: the commands that decide whether an activated update is Ready.
//!
//! Each check is a program run without a shell, with a timeout, and with
//! `FLOTILLA_ACTION_ID` and `FLOTILLA_RELEASE` in its environment so a check can tell which
//! update it is judging. During the soak time every check runs every `interval`; the update is
//! healthy only if all of them pass on every round until the soak time is over. The first
//! failure ends the soak with a reason naming the check.

use std::process::Stdio;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::{HealthCheck, HealthConfig};

/// Runs one check. `Err` is the reason for the report, e.g.
/// `health check app-runs failed: exit status 1`.
pub async fn run_check(check: &HealthCheck, action_id: &str, release: &str) -> Result<(), String> {
    let mut command = tokio::process::Command::new(&check.command[0]);
    command
        .args(&check.command[1..])
        .env("FLOTILLA_ACTION_ID", action_id)
        .env("FLOTILLA_RELEASE", release)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        // The last line a failing check writes to stderr goes into the report: "why" is what
        // an operator looking at a paused rollout wants first.
        .stderr(Stdio::piped())
        // A check that outlives its timeout must not keep running behind the agent's back.
        .kill_on_drop(true);
    let child = command.spawn().map_err(|e| {
        format!(
            "health check {} failed: cannot run {:?}: {e}",
            check.name, check.command[0]
        )
    })?;
    match tokio::time::timeout(check.timeout, child.wait_with_output()).await {
        Ok(Ok(output)) if output.status.success() => Ok(()),
        Ok(Ok(output)) => {
            let status = output.status;
            use std::os::unix::process::ExitStatusExt as _;
            let how = match (status.code(), status.signal()) {
                (Some(code), _) => format!("exit status {code}"),
                (None, Some(signal)) => format!("killed by signal {signal}"),
                (None, None) => status.to_string(),
            };
            match last_line(&output.stderr) {
                Some(said) => Err(format!("health check {} failed: {how}: {said}", check.name)),
                None => Err(format!("health check {} failed: {how}", check.name)),
            }
        }
        Ok(Err(e)) => Err(format!("health check {} failed: {e}", check.name)),
        Err(_) => Err(format!(
            "health check {} failed: timed out after {:?}",
            check.name, check.timeout
        )),
    }
}

/// The last non-empty line of a check's stderr, at most 200 characters.
fn last_line(stderr: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(stderr);
    let line = text.lines().map(str::trim).rfind(|l| !l.is_empty())?;
    Some(line.chars().take(200).collect())
}

/// Outcome of a soak.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Soak {
    Healthy,
    Unhealthy(String),
    /// The agent is shutting down; the soak starts over after the restart.
    Interrupted,
}

/// Runs every check every `interval` until `soak` has passed (at least one round).
pub async fn soak(
    health: &HealthConfig,
    action_id: &str,
    release: &str,
    shutdown: &CancellationToken,
) -> Soak {
    if health.checks.is_empty() {
        return Soak::Healthy;
    }
    let started = Instant::now();
    loop {
        for check in &health.checks {
            let result = tokio::select! {
                _ = shutdown.cancelled() => return Soak::Interrupted,
                r = run_check(check, action_id, release) => r,
            };
            if let Err(reason) = result {
                return Soak::Unhealthy(reason);
            }
        }
        if started.elapsed() >= health.soak {
            return Soak::Healthy;
        }
        let wait = health
            .interval
            .min(health.soak.saturating_sub(started.elapsed()))
            .max(Duration::from_millis(1));
        tokio::select! {
            _ = shutdown.cancelled() => return Soak::Interrupted,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(name: &str, script: &str) -> HealthCheck {
        HealthCheck {
            name: name.into(),
            command: vec!["/bin/sh".into(), "-c".into(), script.into()],
            timeout: Duration::from_secs(10),
        }
    }

    fn health(checks: Vec<HealthCheck>) -> HealthConfig {
        HealthConfig {
            soak: Duration::ZERO,
            interval: Duration::from_millis(10),
            checks,
        }
    }

    #[tokio::test]
    async fn passing_checks_are_healthy_and_see_the_action() {
        let c = check(
            "env",
            r#"test "$FLOTILLA_ACTION_ID" = act-9 && test "$FLOTILLA_RELEASE" = fw-2"#,
        );
        assert_eq!(
            soak(&health(vec![c]), "act-9", "fw-2", &CancellationToken::new()).await,
            Soak::Healthy
        );
    }

    #[tokio::test]
    async fn failing_check_names_itself_and_the_exit_status() {
        let h = health(vec![check("ok", "true"), check("app-runs", "exit 1")]);
        assert_eq!(
            soak(&h, "a", "r", &CancellationToken::new()).await,
            Soak::Unhealthy("health check app-runs failed: exit status 1".into())
        );
    }

    #[tokio::test]
    async fn failing_check_reports_what_it_said_on_stderr() {
        let c = check(
            "self-test",
            "echo starting >&2; echo 'app crashed: port 80 in use' >&2; exit 2",
        );
        let err = run_check(&c, "a", "r").await.expect_err("fails");
        assert_eq!(
            err,
            "health check self-test failed: exit status 2: app crashed: port 80 in use"
        );
    }

    #[tokio::test]
    async fn missing_program_and_timeout_are_failures() {
        let mut missing = check("gone", "");
        missing.command = vec!["/nonexistent/check".into()];
        let err = run_check(&missing, "a", "r").await.expect_err("cannot run");
        assert!(
            err.starts_with("health check gone failed: cannot run"),
            "{err}"
        );

        let mut slow = check("slow", "sleep 30");
        slow.timeout = Duration::from_millis(200);
        let err = run_check(&slow, "a", "r").await.expect_err("times out");
        assert!(err.contains("timed out"), "{err}");
    }

    #[tokio::test]
    async fn no_checks_is_healthy() {
        assert_eq!(
            soak(&health(vec![]), "a", "r", &CancellationToken::new()).await,
            Soak::Healthy
        );
    }
}
