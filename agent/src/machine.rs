//! The update state machine: one action, from accepted to a final phase.
//!
//! ```text
//! Accepted -> [Waiting] -> Downloading{artifact, done} ... -> Verified -> Downloaded (download-only)
//!          Verified -> Staging{0..n} -> Staged -> Activating{0..n} -> Activated -> Confirming
//!          Confirming -> Ready | Failed{reason, rolled_back: true}
//!          Activated -> Applied (no health checks configured: readiness cannot be tracked)
//! any state before Activating{0} -> Canceled (on a signed cancel)
//! any failing step -> Failed{reason, rolled_back}
//!
//! Reboots (a target's activate or rollback answers RebootRequired, e.g. an A/B slot switch):
//! Activating{i} -> AwaitingReboot{i} --(reboot command; the agent is stopped)-->
//!     (next start) confirm the boot -> Activating{i+1} | Activated
//!                                   -> Failed{"...fell back...", rolled_back: true}
//! a rollback that needs a reboot -> Reverting{reason} --(reboot)--> (next start) Failed{reason, true}
//! ```
//!
//! [`step`] is a plain `match` from one state to the next. The driver ([`drive`]) persists each
//! new state (and reports it) *before* calling `step` on it, so whatever side effect a step
//! performs, the state that announces it is already on disk. `Staging{i}` and `Activating{i}`
//! are intents: finding one after a restart means the step was interrupted, and it is only run
//! again if the target says that is safe (otherwise the action is rolled back and Failed).
//!
//! After a kill -9: Downloading resumes at the first byte not yet on disk; Staged activates;
//! Activated and Confirming run the health checks again from the start of the soak.
//!
//! `AwaitingReboot` is persisted before the reboot command runs. A start that finds it never
//! stages or activates again: it asks the target to confirm the boot. The target answers
//! whether the new content runs (go on), the bootloader fell back (Failed, rolled back by the
//! bootloader), or the device has not rebooted yet (the reboot command runs again).
//! `Reverting` works the same way for a rollback whose old content is live only after a reboot:
//! the next start repeats the (repeatable) rollback, which then answers that the old content runs.

use std::sync::Arc;
use std::time::Duration;

use flotilla_protocol::{ActionBody, ActionKind, DesiredAction, ReleaseManifest, UnixTime};
use flotilla_targets::{ActionContext, Activation, TargetError, UpdateTarget};

use crate::consent;
use crate::health::{self, Soak};
use crate::record::{ActionRecord, State};

use crate::download::download;
use crate::env::failed;
use crate::env::{downloads_dir, ActionIo, Env, Next};

/// Runs an action until it reaches a final phase or the agent shuts down. `resumed` says the
/// persisted state was found at startup rather than reached in this process.
pub async fn drive(
    env: &Env,
    mut record: ActionRecord,
    io: &mut ActionIo,
    mut resumed: bool,
) -> ActionRecord {
    while !record.state.is_terminal() {
        if io.shutdown.is_cancelled() {
            return record;
        }
        let next = if io.cancel.is_cancelled() && record.state.is_cancelable() {
            // Discard whatever was staged; nothing was switched over yet.
            let _ = rollback_all(env, &record).await;
            Next::State(State::Canceled)
        } else {
            step(env, &record, io, resumed).await
        };
        resumed = false;
        let Next::State(state) = next else {
            return record;
        };
        let phase_before = record.phase();
        let previous = std::mem::replace(&mut record.state, state);
        if let Err(e) = env.persist_retrying(&record, &io.shutdown).await {
            if record.state.is_terminal() {
                // Nothing more will run; a restart resumes from the recorded state and reaches
                // this end again. Report it, so the coordinator is not kept waiting.
                env.report(&record).await;
                break;
            }
            // The new state is not on disk, so its side effects must not run: end the action
            // from the state that is, undoing whatever it staged.
            let reason = format!(
                "cannot record state {}: {e}; stopped before acting on it",
                record.state.name()
            );
            record.state = previous;
            return abandon(env, record, reason).await;
        }
        if record.phase() != phase_before || matches!(record.state, State::Downloading { .. }) {
            env.report(&record).await;
        }
    }
    consent::clear(&env.config.data_dir, &record.action_id);
    record
}

/// One transition. Side effects happen here, after the driver persisted `record.state`.
pub async fn step(env: &Env, record: &ActionRecord, io: &mut ActionIo, resumed: bool) -> Next {
    if let ActionBody::Rollback { action_id: undo } = &record.action.body {
        return rollback_step(env, record, undo, io).await;
    }
    let Some(manifest) = record.manifest.clone() else {
        return Next::State(State::Failed {
            reason: "action has no release manifest".into(),
            rolled_back: false,
        });
    };
    let kind = record
        .action
        .body
        .install()
        .map_or(ActionKind::Forced, |install| install.kind);
    match &record.state {
        State::Accepted | State::Waiting { .. } => {
            loop {
                let consented = consent::given(&env.config.data_dir, &record.action_id);
                match wait_reason(&record.action, env.now(), consented) {
                    None => break,
                    Some((reason, _)) => {
                        if !matches!(&record.state, State::Waiting { reason: r } if *r == reason) {
                            return Next::State(State::Waiting { reason });
                        }
                    }
                }
                // Looked at again every second: consent is a file a person writes and then
                // watches being taken up, and a time window or a forced time is seconds-exact.
                tokio::select! {
                    _ = io.shutdown.cancelled() => return Next::Interrupted,
                    _ = io.cancel.cancelled() => return Next::State(State::Canceled),
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
            // Check the targets before fetching anything: a target that cannot take an update
            // now fails fast instead of after a long download.
            for a in &manifest.artifacts {
                let ctx = context(record, &a.name);
                if let Some(target) = env.targets.get(&a.target) {
                    let target = target.clone();
                    if let Err(reason) = blocking(move || target.check(&ctx)).await {
                        return failed(
                            format!("target {} cannot take the update: {reason}", a.target),
                            false,
                        );
                    }
                }
            }
            Next::State(State::Downloading {
                artifact: 0,
                done: 0,
            })
        }
        State::Downloading { artifact, done } => {
            download(env, record, &manifest, *artifact, *done, io).await
        }
        State::Verified => {
            if kind == ActionKind::DownloadOnly {
                Next::State(State::Downloaded)
            } else {
                Next::State(State::Staging { artifact: 0 })
            }
        }
        State::Staging { artifact } => {
            let Some((a, target)) = artifact_target(env, &manifest, *artifact) else {
                return failed(
                    format!("artifact #{artifact} has no configured target"),
                    false,
                );
            };
            if resumed && !target.stage_is_repeatable() {
                let rolled_back = rollback_all(env, record).await.is_ok();
                return failed(
                    format!(
                        "staging artifact {} was interrupted and target {} cannot repeat it",
                        a.name, a.target
                    ),
                    rolled_back,
                );
            }
            let ctx = context(record, &a.name);
            let path = downloads_dir(&env.config).join(flotilla_protocol::hex::encode(&a.sha256));
            if let Err(reason) = blocking(move || target.stage(&ctx, &path)).await {
                let _ = rollback_all(env, record).await;
                return failed(format!("artifact {}: {reason}", a.name), false);
            }
            if (*artifact as usize) + 1 < manifest.artifacts.len() {
                Next::State(State::Staging {
                    artifact: artifact + 1,
                })
            } else {
                Next::State(State::Staged)
            }
        }
        State::Staged => Next::State(State::Activating { artifact: 0 }),
        State::Activating { artifact } => {
            let Some((a, target)) = artifact_target(env, &manifest, *artifact) else {
                return failed(
                    format!("artifact #{artifact} has no configured target"),
                    false,
                );
            };
            if resumed && !target.activate_is_repeatable() {
                let reason = format!(
                    "activating artifact {} was interrupted and target {} cannot repeat it",
                    a.name, a.target
                );
                return revert(env, record, reason).await;
            }
            let ctx = context(record, &a.name);
            match blocking(move || target.activate(&ctx)).await {
                Ok(Activation::Done) => after_activation(&manifest, *artifact),
                // Persisted first; the reboot command runs in the next step.
                Ok(Activation::RebootRequired) => Next::State(State::AwaitingReboot {
                    artifact: *artifact,
                }),
                Err(reason) => revert(env, record, format!("artifact {}: {reason}", a.name)).await,
            }
        }
        State::AwaitingReboot { artifact } => {
            let Some((a, target)) = artifact_target(env, &manifest, *artifact) else {
                return failed(
                    format!("artifact #{artifact} has no configured target"),
                    false,
                );
            };
            if resumed {
                let ctx = context(record, &a.name);
                let confirming = target.clone();
                let confirmed = match blocking_raw(move || confirming.confirm(&ctx)).await {
                    Ok(confirmed) => confirmed,
                    Err(e) => {
                        return revert(env, record, format!("artifact {}: {e}", a.name)).await
                    }
                };
                match confirmed {
                    Ok(()) => {
                        tracing::info!(artifact = a.name, "the new content runs after the reboot");
                        return after_activation(&manifest, *artifact);
                    }
                    // The bootloader already returned to the old content; roll the other
                    // targets back too.
                    Err(e @ TargetError::FellBack { .. }) => {
                        return revert(env, record, e.to_string()).await
                    }
                    Err(e @ TargetError::RebootPending { .. }) => {
                        tracing::warn!(artifact = a.name, "{e}; rebooting again");
                    }
                    Err(e) => {
                        return revert(env, record, format!("artifact {}: {e}", a.name)).await
                    }
                }
            }
            match reboot(target, io).await {
                Ok(next) => next,
                Err(e) => {
                    revert(
                        env,
                        record,
                        format!("artifact {}: the reboot it needs failed: {e}", a.name),
                    )
                    .await
                }
            }
        }
        State::Reverting { reason } => {
            // Rollbacks are repeatable: running them again says which target still needs the
            // reboot, and after the reboot that the old content runs.
            let target = match rollback_all(env, record).await {
                Ok(None) => return failed(reason.clone(), true),
                Ok(Some(target)) => target,
                Err(e) => return failed(format!("{reason}; {e}"), false),
            };
            match reboot(target, io).await {
                Ok(next) => next,
                Err(e) => failed(
                    format!("{reason}; the rollback needs a reboot, which failed: {e}"),
                    false,
                ),
            }
        }
        // Without health checks there is nothing to soak: confirm at once and say so, because
        // "ready" would claim a health the device cannot show.
        State::Activated if env.config.health.checks.is_empty() => {
            finish(env, record, &manifest, State::Applied).await
        }
        State::Activated => Next::State(State::Confirming),
        State::Confirming => match health::soak(
            &env.config.health,
            &record.action_id,
            &manifest.name,
            &io.shutdown,
        )
        .await
        {
            Soak::Interrupted => Next::Interrupted,
            Soak::Unhealthy(reason) => revert(env, record, reason).await,
            Soak::Healthy => finish(env, record, &manifest, State::Ready).await,
        },
        State::Ready
        | State::Failed { .. }
        | State::Refused { .. }
        | State::Canceled
        | State::Downloaded
        | State::Applied => Next::State(record.state.clone()),
        State::RollingBack { .. } => failed("a rollback state in an install".into(), false),
    }
}

/// The steps of a signed rollback of the action `undo`:
/// `Accepted -> RollingBack{point} -> Ready`, or `Failed` when there is nothing to roll back.
async fn rollback_step(env: &Env, record: &ActionRecord, undo: &str, io: &ActionIo) -> Next {
    match &record.state {
        State::Accepted => {
            let point = match env.store.rollback_point() {
                Ok(point) => point,
                Err(e) => return failed(format!("cannot roll back: {e}"), false),
            };
            let installed = env.store.installed().ok().flatten();
            match point {
                Some(p) if p.action_id == undo && installed.as_ref() == Some(&p.release) => {
                    Next::State(State::RollingBack { point: p })
                }
                Some(p) if p.action_id != undo => failed(
                    format!(
                        "nothing to roll back: the installed release was installed by action {}, not {undo}",
                        p.action_id
                    ),
                    false,
                ),
                _ => failed(
                    format!(
                        "nothing to roll back: this device keeps no release from before action {undo}"
                    ),
                    false,
                ),
            }
        }
        State::RollingBack { point } => {
            let (mut nothing, mut errors) = (Vec::new(), Vec::new());
            let mut needs_reboot = None;
            for (artifact, target_name) in point.artifacts.iter().rev() {
                let Some(target) = env.targets.get(target_name).cloned() else {
                    errors.push(format!("target {target_name} is no longer configured"));
                    continue;
                };
                let ctx = ActionContext::new(undo, point.release.name.clone(), artifact.clone());
                let rolling = target.clone();
                match tokio::task::spawn_blocking(move || rolling.rollback_activation(&ctx)).await {
                    Ok(Ok(Activation::Done)) => {}
                    Ok(Ok(Activation::RebootRequired)) => {
                        needs_reboot.get_or_insert(target);
                    }
                    Ok(Err(e @ TargetError::NothingToRollBack { .. })) => {
                        nothing.push(format!("{artifact}: {e}"))
                    }
                    Ok(Err(e)) => errors.push(format!("{artifact}: {e}")),
                    Err(e) => errors.push(format!("{artifact}: target step panicked: {e}")),
                }
            }
            if errors.is_empty() && nothing.len() == point.artifacts.len() {
                return failed(
                    format!("nothing to roll back: {}", nothing.join("; ")),
                    false,
                );
            }
            if !errors.is_empty() || !nothing.is_empty() {
                errors.extend(nothing);
                return failed(
                    format!("rollback of action {undo} failed: {}", errors.join("; ")),
                    false,
                );
            }
            // The state says "rolling back" across the reboot; the next start repeats the
            // rollbacks, which then answer that the old content runs.
            if let Some(target) = needs_reboot {
                return match reboot(target, io).await {
                    Ok(next) => next,
                    Err(e) => failed(
                        format!("rollback of action {undo} needs a reboot, which failed: {e}"),
                        false,
                    ),
                };
            }
            if let Err(e) = env.restore_installed(point) {
                tracing::error!("{e}");
            }
            Next::State(State::Ready)
        }
        other => Next::State(other.clone()),
    }
}

/// Confirms every target and records the release as installed; `done` is the final state
/// (`Ready` after a healthy soak, `Applied` on a device without health checks).
async fn finish(env: &Env, record: &ActionRecord, manifest: &ReleaseManifest, done: State) -> Next {
    for a in &manifest.artifacts {
        let Some(target) = env.targets.get(&a.target).cloned() else {
            continue;
        };
        let ctx = context(record, &a.name);
        if let Err(reason) = blocking(move || target.confirm(&ctx)).await {
            return revert(env, record, format!("artifact {}: {reason}", a.name)).await;
        }
    }
    if let Err(e) = env.set_installed(&record.action_id, manifest) {
        tracing::error!("{e}");
    }
    Next::State(done)
}

/// Ends an action the agent keeps restarting in (a crash loop): rolls the targets back if
/// anything was staged or switched, persists and reports `Failed`.
pub async fn give_up(env: &Env, record: ActionRecord, restarts: u32) -> ActionRecord {
    let reason = format!(
        "gave up after {restarts} restarts in state {}",
        record.state.name()
    );
    abandon(env, record, reason).await
}

/// Ends an action that cannot go on from its current state: rolls the targets back if anything
/// was staged or switched, persists (if it can) and reports `Failed { reason }`.
pub async fn abandon(env: &Env, mut record: ActionRecord, reason: String) -> ActionRecord {
    tracing::error!(action = record.action_id, "{reason}");
    let touched = matches!(
        record.state,
        State::Staging { .. }
            | State::Staged
            | State::Activating { .. }
            | State::Activated
            | State::Confirming
            | State::AwaitingReboot { .. }
            | State::Reverting { .. }
    );
    record.state = if touched {
        match rollback_all(env, &record).await {
            Ok(None) => State::Failed {
                reason,
                rolled_back: true,
            },
            // The caller drives it on: reboot into the old content, then Failed.
            Ok(Some(_)) => State::Reverting { reason },
            Err(e) => State::Failed {
                reason: format!("{reason}; {e}"),
                rolled_back: false,
            },
        }
    } else {
        State::Failed {
            reason,
            rolled_back: false,
        }
    };
    // Reported even when it cannot be recorded (a full disk): the coordinator learns why.
    let _ = env.persist(&record);
    env.report(&record).await;
    consent::clear(&env.config.data_dir, &record.action_id);
    record
}

fn context(record: &ActionRecord, artifact: &str) -> ActionContext {
    ActionContext::new(record.action_id.clone(), record.release_name(), artifact)
}

fn artifact_target(
    env: &Env,
    manifest: &ReleaseManifest,
    index: u32,
) -> Option<(flotilla_protocol::Artifact, Arc<dyn UpdateTarget>)> {
    let a = manifest.artifacts.get(index as usize)?.clone();
    let target = env.targets.get(&a.target)?.clone();
    Some((a, target))
}

/// Runs a target step on the blocking pool; the error is the target's message.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, TargetError> + Send + 'static,
) -> Result<T, String> {
    blocking_raw(f).await?.map_err(|e| e.to_string())
}

/// Like [`blocking`], keeping the target's error so the caller can tell its kinds apart; the
/// outer error says the step panicked.
async fn blocking_raw<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, TargetError> + Send + 'static,
) -> Result<Result<T, TargetError>, String> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| format!("target step panicked: {e}"))
}

/// Rolls back every target of the action. Targets that never activated it say
/// `NothingToRollBack`, which is fine: they are as they were. Answers the first target whose
/// old content is live only after a reboot, if any.
async fn rollback_all(
    env: &Env,
    record: &ActionRecord,
) -> Result<Option<Arc<dyn UpdateTarget>>, String> {
    let Some(manifest) = &record.manifest else {
        return Ok(None);
    };
    let mut errors = Vec::new();
    let mut needs_reboot = None;
    for a in manifest.artifacts.iter().rev() {
        let Some(target) = env.targets.get(&a.target).cloned() else {
            continue;
        };
        let ctx = context(record, &a.name);
        let rolling = target.clone();
        match tokio::task::spawn_blocking(move || rolling.rollback_activation(&ctx)).await {
            Ok(Ok(Activation::Done)) | Ok(Err(TargetError::NothingToRollBack { .. })) => {}
            Ok(Ok(Activation::RebootRequired)) => {
                needs_reboot.get_or_insert(target);
            }
            Ok(Err(e)) => errors.push(format!("rollback of {} failed: {e}", a.name)),
            Err(e) => errors.push(format!("rollback of {} panicked: {e}", a.name)),
        }
    }
    if errors.is_empty() {
        Ok(needs_reboot)
    } else {
        Err(errors.join("; "))
    }
}

/// Rolls every target back after `reason` and ends the action: `Failed { rolled_back: true }`
/// when the old content runs now, `Reverting` when it runs after a reboot, and
/// `Failed { rolled_back: false }` naming what could not be rolled back.
async fn revert(env: &Env, record: &ActionRecord, reason: String) -> Next {
    match rollback_all(env, record).await {
        Ok(None) => failed(reason, true),
        Ok(Some(_)) => Next::State(State::Reverting { reason }),
        Err(e) => failed(format!("{reason}; {e}"), false),
    }
}

/// The state after artifact `index` was activated (and, if it needed one, rebooted into).
fn after_activation(manifest: &ReleaseManifest, index: u32) -> Next {
    if (index as usize) + 1 < manifest.artifacts.len() {
        Next::State(State::Activating {
            artifact: index + 1,
        })
    } else {
        Next::State(State::Activated)
    }
}

/// Runs `target`'s reboot command; the state that explains the reboot is already persisted.
/// The command only asks for the reboot, which stops the agent: wait for that, leaving the
/// persisted state for the next start.
async fn reboot(target: Arc<dyn UpdateTarget>, io: &ActionIo) -> Result<Next, String> {
    blocking(move || target.reboot()).await?;
    tracing::info!("reboot requested; waiting for the system to stop the agent");
    io.shutdown.cancelled().await;
    Ok(Next::Interrupted)
}

/// Why an install must wait now, and until when (if a time is known). `consented` says the
/// device's user gave local consent to this action.
pub fn wait_reason(
    action: &DesiredAction,
    now: UnixTime,
    consented: bool,
) -> Option<(String, Option<UnixTime>)> {
    let install = action.body.install()?;
    let kind = &install.kind;
    if let Some(w) = &install.window {
        if now < w.not_before {
            return Some((
                format!("outside the time window: opens at {}", w.not_before),
                Some(w.not_before),
            ));
        }
        if now > w.not_after {
            return Some((
                format!("outside the time window: closed at {}", w.not_after),
                None,
            ));
        }
    }
    let ask = format!(
        "waiting for local consent (flotilla-agent consent {})",
        action.action_id
    );
    match kind {
        ActionKind::Forced | ActionKind::DownloadOnly => None,
        ActionKind::Soft | ActionKind::TimeForced { .. } if consented => None,
        ActionKind::Soft => Some((ask, None)),
        ActionKind::TimeForced { at } if now < *at => {
            Some((format!("{ask}; installs anyway at {at}"), Some(*at)))
        }
        ActionKind::TimeForced { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use flotilla_protocol::{
        ActionBody, ActionKind, ByteCounts, DesiredAction, InstalledRelease, ReleaseManifest,
    };
    use flotilla_targets::{ActionContext, Activation, TargetError, UpdateTarget};
    use tokio::sync::mpsc;
    use tokio_util::sync::CancellationToken;

    use crate::consent;
    use crate::fetch::{FetchInput, FetchRequest};

    use crate::config::HealthCheck;
    use crate::link::{LinkHandle, Outgoing};
    use crate::record::{ActionRecord, State};
    use crate::store::Store;
    use crate::trust::{self, TrustState};
    use flotilla_protocol::{Artifact, BlockReply, Phase};
    use std::sync::atomic::AtomicUsize;

    /// A target that counts its steps, to prove what a resumed action does and does not repeat.
    #[derive(Default)]
    struct Counting {
        stage: AtomicUsize,
        activate: AtomicUsize,
        confirm: AtomicUsize,
        rollback: AtomicUsize,
    }

    impl UpdateTarget for Counting {
        fn kind(&self) -> &'static str {
            "counting"
        }
        fn check(&self, _: &ActionContext) -> Result<(), TargetError> {
            Ok(())
        }
        fn stage(&self, _: &ActionContext, _: &std::path::Path) -> Result<(), TargetError> {
            self.stage.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn activate(&self, _: &ActionContext) -> Result<Activation, TargetError> {
            self.activate.fetch_add(1, Ordering::SeqCst);
            Ok(Activation::Done)
        }
        fn confirm(&self, _: &ActionContext) -> Result<(), TargetError> {
            self.confirm.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn rollback(&self, _: &ActionContext) -> Result<(), TargetError> {
            self.rollback.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn activate_is_repeatable(&self) -> bool {
            false
        }
    }

    /// A target that asks for a reboot on activation, like an A/B pair; the test plays the
    /// bootloader with [`Rebooting::boot`].
    #[derive(Default)]
    struct Rebooting {
        activate: AtomicUsize,
        reboot: AtomicUsize,
        rollback: AtomicUsize,
        /// A reboot was asked for and has not happened yet.
        pending: std::sync::atomic::AtomicBool,
        /// The device runs the new content.
        new_runs: std::sync::atomic::AtomicBool,
    }

    impl Rebooting {
        /// The device boots: into the new content, or the bootloader falls back to the old.
        fn boot(&self, new: bool) {
            self.pending.store(false, Ordering::SeqCst);
            self.new_runs.store(new, Ordering::SeqCst);
        }
    }

    impl UpdateTarget for Rebooting {
        fn kind(&self) -> &'static str {
            "rebooting"
        }
        fn check(&self, _: &ActionContext) -> Result<(), TargetError> {
            Ok(())
        }
        fn stage(&self, _: &ActionContext, _: &std::path::Path) -> Result<(), TargetError> {
            Ok(())
        }
        fn activate(&self, _: &ActionContext) -> Result<Activation, TargetError> {
            self.activate.fetch_add(1, Ordering::SeqCst);
            Ok(Activation::RebootRequired)
        }
        fn confirm(&self, ctx: &ActionContext) -> Result<(), TargetError> {
            if self.pending.load(Ordering::SeqCst) {
                return Err(TargetError::RebootPending {
                    action_id: ctx.action_id.clone(),
                    slot: "b".into(),
                    running: "a".into(),
                });
            }
            if !self.new_runs.load(Ordering::SeqCst) {
                return Err(TargetError::FellBack {
                    action_id: ctx.action_id.clone(),
                    tried: "b".into(),
                    booted: "a".into(),
                });
            }
            Ok(())
        }
        fn rollback(&self, ctx: &ActionContext) -> Result<(), TargetError> {
            self.rollback_activation(ctx).map(|_| ())
        }
        fn rollback_activation(&self, _: &ActionContext) -> Result<Activation, TargetError> {
            self.rollback.fetch_add(1, Ordering::SeqCst);
            if self.new_runs.load(Ordering::SeqCst) {
                Ok(Activation::RebootRequired)
            } else {
                Ok(Activation::Done)
            }
        }
        fn reboot(&self) -> Result<(), TargetError> {
            self.reboot.fetch_add(1, Ordering::SeqCst);
            self.pending.store(true, Ordering::SeqCst);
            Ok(())
        }
        fn activate_is_repeatable(&self) -> bool {
            true
        }
    }

    /// Drives `record` until the target's reboot command ran `reboots` times in all, then
    /// stops the agent the way the system does when it goes down.
    async fn drive_until_reboot(
        env: &Env,
        target: &Rebooting,
        record: ActionRecord,
        resumed: bool,
        reboots: usize,
    ) -> ActionRecord {
        let mut io = io(vec![]);
        let shutdown = io.shutdown.clone();
        let (rec, ()) = tokio::join!(drive(env, record, &mut io, resumed), async {
            tokio::time::timeout(Duration::from_secs(30), async {
                while target.reboot.load(Ordering::SeqCst) < reboots {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await
            .expect("the reboot command did not run");
            shutdown.cancel();
        });
        rec
    }

    struct Fixture {
        dir: tempfile::TempDir,
        env: Env,
        outgoing: mpsc::Receiver<Outgoing>,
    }

    fn fixture(target: Option<Arc<dyn UpdateTarget>>, checks: Vec<HealthCheck>) -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = crate::trust::tests::config();
        config.data_dir = dir.path().join("data");
        config.targets[0].kind = crate::config::TargetKind::File {
            path: dir.path().join("app.bin"),
        };
        config.health = crate::config::HealthConfig {
            soak: Duration::ZERO,
            interval: Duration::from_millis(10),
            checks,
        };
        std::fs::create_dir_all(&config.data_dir).expect("mkdir");
        let (store, _) = Store::open(&config.data_dir, 1 << 20, 0).expect("store");
        let target = target.unwrap_or_else(|| {
            Arc::new(flotilla_targets::FileTarget::new(
                dir.path().join("app.bin"),
            ))
        });
        let (tx, rx) = mpsc::channel(10_000);
        let env = Env {
            targets: HashMap::from([("app".to_owned(), target)]),
            config: Arc::new(config),
            store,
            link: LinkHandle::from_channel(tx),
            trust: Mutex::new(TrustState::default()),
        };
        Fixture {
            dir,
            env,
            outgoing: rx,
        }
    }

    fn record(bytes: &[u8], state: State, kind: ActionKind) -> ActionRecord {
        let manifest = ReleaseManifest {
            name: "app-2".into(),
            version: "2.0".into(),
            counter: 4,
            hardware: vec![],
            artifacts: vec![Artifact {
                name: "app.bin".into(),
                target: "app".into(),
                size: bytes.len() as u64,
                sha256: flotilla_protocol::sha256(bytes),
            }],
            created_at: 0,
            expires_at: u64::MAX,
        };
        let signed = flotilla_protocol::SignedBlob::sign(
            &crate::trust::tests::key(1),
            flotilla_protocol::envelope::to_bytes(&manifest),
        );
        ActionRecord {
            action_id: "act-1".into(),
            rollout_id: "r1".into(),
            action: DesiredAction {
                action_id: "act-1".into(),
                device_id: "dev-1".into(),
                rollout_id: "r1".into(),
                issued_at: 0,
                expires_at: u64::MAX,
                body: ActionBody::Install {
                    manifest: signed,
                    kind,
                    window: None,
                },
            },
            manifest: Some(manifest),
            state,
            signed: None,
        }
    }

    /// Channels to an in-memory artifact server serving `bytes`.
    fn io(bytes: Vec<u8>) -> ActionIo {
        let (req_tx, mut req_rx) = mpsc::channel::<FetchRequest>(64);
        let (in_tx, in_rx) = mpsc::channel(64);
        tokio::spawn(async move {
            while let Some(r) = req_rx.recv().await.map(crate::fetch::tests::coordinator) {
                let reply = crate::fetch::tests::reply(&bytes, &r);
                if in_tx.send(FetchInput::Reply(reply)).await.is_err() {
                    break;
                }
            }
        });
        ActionIo {
            fetch_requests: req_tx,
            fetch_inputs: in_rx,
            cancel: CancellationToken::new(),
            shutdown: CancellationToken::new(),
        }
    }

    fn check(script: &str) -> HealthCheck {
        HealthCheck {
            name: "app-runs".into(),
            command: vec!["/bin/sh".into(), "-c".into(), script.into()],
            timeout: Duration::from_secs(10),
        }
    }

    #[tokio::test]
    async fn forced_install_reaches_ready_and_records_the_release() {
        let f = fixture(None, vec![check("true")]);
        let dest = f.dir.path().join("app.bin");
        std::fs::write(&dest, b"old").expect("write");
        let bytes = b"new app version".repeat(500);
        let rec = drive(
            &f.env,
            record(&bytes, State::Accepted, ActionKind::Forced),
            &mut io(bytes.clone()),
            false,
        )
        .await;
        assert_eq!(rec.state, State::Ready);
        assert_eq!(std::fs::read(&dest).expect("read"), bytes);
        assert_eq!(
            f.env.store.installed().expect("read").map(|i| i.counter),
            Some(4)
        );
        assert_eq!(
            crate::trust::read_trust_file(&f.env.config.data_dir).installed_counter,
            4
        );
        assert_eq!(
            f.env.store.current().expect("read").map(|r| r.state),
            Some(State::Ready),
            "final state is persisted"
        );
    }

    /// An install whose manifest signs a block list, with a grant naming peer dev-7: the list
    /// comes from the coordinator, the blocks the installed file already has are copied, the
    /// rest comes from the peer, and the final report says so.
    #[tokio::test]
    async fn a_block_indexed_install_with_peers_reports_bytes_by_source() {
        let mut f = fixture(None, vec![check("true")]);
        let dest = f.dir.path().join("app.bin");
        let bytes: Vec<u8> = (0..20 * 1024u32).map(|i| (i * 13 % 241) as u8).collect();
        let mut old = bytes.clone();
        old[3 * 1024 + 5] ^= 1;
        std::fs::write(&dest, &old).expect("write");
        let list = flotilla_protocol::blocks::BlockList::compute(&bytes[..], 1024).expect("list");
        let mut rec = record(&bytes, State::Accepted, ActionKind::Forced);
        let manifest = flotilla_protocol::manifest::Manifest {
            release: rec.manifest.clone().expect("manifest"),
            blocks: Some(flotilla_protocol::manifest::ManifestBlocks {
                artifacts: vec![flotilla_protocol::blocks::BlockIndexRef {
                    block_size: 1024,
                    sha256: flotilla_protocol::sha256(list.as_bytes()),
                }],
            }),
            types: None,
        };
        let grant = flotilla_protocol::PeerGrant {
            device_id: "dev-1".into(),
            action_id: "act-1".into(),
            rollout_id: "r1".into(),
            sources: vec!["dev-1".into(), "dev-7".into()],
            digests: vec![],
            expires_at: u64::MAX,
        };
        rec.action.body = ActionBody::InstallWithPeers {
            manifest: flotilla_protocol::SignedBlob::sign(
                &crate::trust::tests::key(1),
                manifest.encode(),
            ),
            kind: ActionKind::Forced,
            window: None,
            grant: flotilla_protocol::SignedBlob::sign(
                &crate::trust::tests::key(2),
                flotilla_protocol::envelope::to_bytes(&grant),
            ),
        };
        // The coordinator serves the artifact and its list by digest; dev-7 serves the artifact.
        let files: HashMap<[u8; 32], Vec<u8>> = HashMap::from([
            (flotilla_protocol::sha256(&bytes), bytes.clone()),
            (
                flotilla_protocol::sha256(list.as_bytes()),
                list.as_bytes().to_vec(),
            ),
        ]);
        let (req_tx, mut req_rx) = mpsc::channel::<FetchRequest>(64);
        let (in_tx, in_rx) = mpsc::channel(64);
        tokio::spawn(async move {
            while let Some(request) = req_rx.recv().await {
                let (peer, r) = match request {
                    FetchRequest::Coordinator(r) => (None, r),
                    FetchRequest::Peer { peer, fetch } => (Some(peer), fetch.request),
                };
                let file = &files[&r.sha256];
                let s = (r.offset as usize).min(file.len());
                let e = (s + r.length as usize).min(file.len());
                let reply = BlockReply::Data {
                    sha256: r.sha256,
                    offset: r.offset,
                    data: file[s..e].to_vec(),
                };
                let input = match peer {
                    None => FetchInput::Reply(reply),
                    Some(peer) => FetchInput::PeerReply { peer, reply },
                };
                if in_tx.send(input).await.is_err() {
                    break;
                }
            }
        });
        let mut io = ActionIo {
            fetch_requests: req_tx,
            fetch_inputs: in_rx,
            cancel: CancellationToken::new(),
            shutdown: CancellationToken::new(),
        };
        let rec = drive(&f.env, rec, &mut io, false).await;
        assert_eq!(rec.state, State::Ready);
        assert_eq!(std::fs::read(&dest).expect("read"), bytes);
        let expected = ByteCounts {
            coordinator: list.as_bytes().len() as u64,
            local: 19 * 1024,
            peers: vec![("dev-7".into(), 1024)],
        };
        let mut final_report = None;
        while let Ok(out) = f.outgoing.try_recv() {
            match out {
                Outgoing::ReportWithBytes { report, bytes, .. } => {
                    final_report = Some((report.phase, bytes))
                }
                Outgoing::Report(r) => assert!(!r.phase.is_terminal(), "{r:?} without bytes"),
                _ => {}
            }
        }
        assert_eq!(final_report, Some((Phase::Ready, expected)));
        let blocks = downloads_dir(&f.env.config).join(format!(
            "{}.blocks",
            flotilla_protocol::hex::encode(&flotilla_protocol::sha256(&bytes))
        ));
        assert_eq!(
            std::fs::read(blocks).expect("the verified list is kept"),
            list.as_bytes()
        );
    }

    #[tokio::test]
    async fn without_health_checks_an_install_ends_applied() {
        let f = fixture(None, vec![]);
        let dest = f.dir.path().join("app.bin");
        std::fs::write(&dest, b"old").expect("write");
        let bytes = b"new".to_vec();
        let rec = drive(
            &f.env,
            record(&bytes, State::Accepted, ActionKind::Forced),
            &mut io(bytes.clone()),
            false,
        )
        .await;
        assert_eq!(rec.state, State::Applied);
        assert_eq!(rec.phase(), Phase::Applied);
        assert!(rec.phase().is_terminal());
        assert_eq!(std::fs::read(&dest).expect("read"), bytes);
        assert_eq!(
            f.env.store.installed().expect("read").map(|i| i.counter),
            Some(4),
            "installed release is recorded"
        );
        assert_eq!(
            crate::trust::read_trust_file(&f.env.config.data_dir).installed_counter,
            4
        );
    }

    #[tokio::test]
    async fn failed_health_check_rolls_back() {
        let f = fixture(None, vec![check("exit 3")]);
        let dest = f.dir.path().join("app.bin");
        std::fs::write(&dest, b"old").expect("write");
        let bytes = b"broken".to_vec();
        let rec = drive(
            &f.env,
            record(&bytes, State::Accepted, ActionKind::Forced),
            &mut io(bytes),
            false,
        )
        .await;
        assert_eq!(
            rec.state,
            State::Failed {
                reason: "health check app-runs failed: exit status 3".into(),
                rolled_back: true
            }
        );
        assert_eq!(
            std::fs::read(&dest).expect("read"),
            b"old",
            "previous content is back"
        );
        assert_eq!(f.env.store.installed().expect("read"), None);
    }

    #[tokio::test]
    async fn download_only_stops_at_downloaded() {
        let target = Arc::new(Counting::default());
        let f = fixture(Some(target.clone()), vec![]);
        let bytes = b"payload".to_vec();
        let rec = drive(
            &f.env,
            record(&bytes, State::Accepted, ActionKind::DownloadOnly),
            &mut io(bytes),
            false,
        )
        .await;
        assert_eq!(rec.state, State::Downloaded);
        assert_eq!(target.stage.load(Ordering::SeqCst), 0, "nothing staged");
    }

    #[tokio::test]
    async fn resumed_from_staged_activates_once_without_restaging() {
        let target = Arc::new(Counting::default());
        let f = fixture(Some(target.clone()), vec![]);
        let rec = drive(
            &f.env,
            record(b"x", State::Staged, ActionKind::Forced),
            &mut io(vec![]),
            true,
        )
        .await;
        assert_eq!(rec.state, State::Applied, "no health checks: applied");
        assert_eq!(target.stage.load(Ordering::SeqCst), 0);
        assert_eq!(target.activate.load(Ordering::SeqCst), 1);
        assert_eq!(target.confirm.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn interrupted_activation_of_unrepeatable_target_is_rolled_back() {
        let target = Arc::new(Counting::default());
        let f = fixture(Some(target.clone()), vec![]);
        let rec = drive(
            &f.env,
            record(b"x", State::Activating { artifact: 0 }, ActionKind::Forced),
            &mut io(vec![]),
            true,
        )
        .await;
        match &rec.state {
            State::Failed {
                reason,
                rolled_back: true,
            } => assert!(reason.contains("was interrupted"), "{reason}"),
            other => panic!("expected a rolled-back failure, got {other:?}"),
        }
        assert_eq!(
            target.activate.load(Ordering::SeqCst),
            0,
            "activate is never run twice"
        );
        assert_eq!(target.rollback.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn cancel_before_activation_leaves_target_alone() {
        let target = Arc::new(Counting::default());
        let f = fixture(Some(target.clone()), vec![]);
        let mut io = io(b"x".to_vec());
        io.cancel.cancel();
        let rec = drive(
            &f.env,
            record(b"x", State::Accepted, ActionKind::Forced),
            &mut io,
            false,
        )
        .await;
        assert_eq!(rec.state, State::Canceled);
        assert_eq!(target.activate.load(Ordering::SeqCst), 0);
    }

    /// issue 10, case 6: a state that cannot be recorded (a full disk) is never acted on. Here
    /// `Staged` cannot be saved after staging: the target is not activated, what was staged is
    /// rolled back, and the action fails naming why.
    #[tokio::test(start_paused = true)]
    async fn a_state_that_cannot_be_recorded_is_not_acted_on() {
        let target = Arc::new(Counting::default());
        let f = fixture(Some(target.clone()), vec![]);
        let mut io = io(b"x".to_vec());
        let start = record(b"x", State::Staging { artifact: 0 }, ActionKind::Forced);
        f.env.persist(&start).expect("persist");
        f.env
            .store
            .fail_saves
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let rec = drive(&f.env, start, &mut io, false).await;
        assert_eq!(target.stage.load(Ordering::SeqCst), 1, "staged once");
        assert_eq!(target.activate.load(Ordering::SeqCst), 0, "never activated");
        assert_eq!(target.rollback.load(Ordering::SeqCst), 1, "staging undone");
        match rec.state {
            State::Failed {
                reason,
                rolled_back: true,
            } => assert!(
                reason.starts_with("cannot record state staged: ")
                    && reason.ends_with("stopped before acting on it"),
                "{reason}"
            ),
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn shutdown_keeps_the_persisted_state_for_resumption() {
        let target = Arc::new(Counting::default());
        let f = fixture(Some(target.clone()), vec![]);
        let mut io = io(b"x".to_vec());
        io.shutdown.cancel();
        let start = record(b"x", State::Staged, ActionKind::Forced);
        f.env.persist(&start).expect("persist");
        let rec = drive(&f.env, start, &mut io, true).await;
        assert_eq!(rec.state, State::Staged);
        assert_eq!(
            f.env.store.current().expect("read").map(|r| r.state),
            Some(State::Staged)
        );
        assert_eq!(target.activate.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_reboot_is_awaited_and_the_next_start_confirms_the_boot() {
        let target = Arc::new(Rebooting::default());
        let f = fixture(Some(target.clone()), vec![check("true")]);
        let start = record(b"x", State::Staged, ActionKind::Forced);
        f.env.persist(&start).expect("persist");
        let rec = drive_until_reboot(&f.env, &target, start, false, 1).await;
        assert_eq!(rec.state, State::AwaitingReboot { artifact: 0 });
        assert_eq!(rec.phase(), Phase::Activated);
        assert_eq!(
            f.env.store.current().expect("read").map(|r| r.state),
            Some(State::AwaitingReboot { artifact: 0 }),
            "persisted across the reboot"
        );
        assert_eq!(f.env.store.installed().expect("read"), None);

        target.boot(true);
        let persisted = f.env.store.current().expect("read").expect("kept");
        let rec = drive(&f.env, persisted, &mut io(vec![]), true).await;
        assert_eq!(rec.state, State::Ready);
        assert_eq!(
            target.activate.load(Ordering::SeqCst),
            1,
            "never activated again"
        );
        assert_eq!(target.reboot.load(Ordering::SeqCst), 1, "rebooted once");
        assert_eq!(
            f.env.store.installed().expect("read").map(|i| i.counter),
            Some(4)
        );
    }

    #[tokio::test]
    async fn a_start_before_the_reboot_happened_reboots_again() {
        let target = Arc::new(Rebooting::default());
        target.pending.store(true, Ordering::SeqCst);
        let f = fixture(Some(target.clone()), vec![]);
        let start = record(
            b"x",
            State::AwaitingReboot { artifact: 0 },
            ActionKind::Forced,
        );
        f.env.persist(&start).expect("persist");
        let rec = drive_until_reboot(&f.env, &target, start, true, 1).await;
        assert_eq!(rec.state, State::AwaitingReboot { artifact: 0 });
        assert_eq!(target.activate.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_bootloader_fallback_is_reported_rolled_back() {
        let target = Arc::new(Rebooting::default());
        let f = fixture(Some(target.clone()), vec![check("true")]);
        target.boot(false);
        let rec = drive(
            &f.env,
            record(
                b"x",
                State::AwaitingReboot { artifact: 0 },
                ActionKind::Forced,
            ),
            &mut io(vec![]),
            true,
        )
        .await;
        let State::Failed {
            reason,
            rolled_back: true,
        } = &rec.state
        else {
            panic!("expected a rolled-back failure, got {:?}", rec.state);
        };
        assert!(reason.contains("fell back to slot a"), "{reason}");
        assert_eq!(target.activate.load(Ordering::SeqCst), 0);
        assert_eq!(target.reboot.load(Ordering::SeqCst), 0, "no reboot needed");
        assert_eq!(f.env.store.installed().expect("read"), None);
    }

    #[tokio::test]
    async fn an_unhealthy_update_reboots_into_the_old_content_then_fails() {
        let target = Arc::new(Rebooting::default());
        let f = fixture(Some(target.clone()), vec![check("exit 4")]);
        target.boot(true);
        let start = record(
            b"x",
            State::AwaitingReboot { artifact: 0 },
            ActionKind::Forced,
        );
        f.env.persist(&start).expect("persist");
        let rec = drive_until_reboot(&f.env, &target, start, true, 1).await;
        assert_eq!(
            rec.state,
            State::Reverting {
                reason: "health check app-runs failed: exit status 4".into()
            }
        );
        assert_eq!(
            rec.phase(),
            Phase::Activated,
            "not failed before the reboot"
        );

        target.boot(false);
        let persisted = f.env.store.current().expect("read").expect("kept");
        let rec = drive(&f.env, persisted, &mut io(vec![]), true).await;
        assert_eq!(
            rec.state,
            State::Failed {
                reason: "health check app-runs failed: exit status 4".into(),
                rolled_back: true
            }
        );
        assert_eq!(target.reboot.load(Ordering::SeqCst), 1);
        assert_eq!(f.env.store.installed().expect("read"), None);
    }

    #[test]
    fn soft_and_windowed_actions_wait() {
        let mut action = record(b"x", State::Accepted, ActionKind::Soft).action;
        assert_eq!(
            wait_reason(&action, 10, false).map(|w| w.0),
            Some("waiting for local consent (flotilla-agent consent act-1)".into())
        );
        assert_eq!(wait_reason(&action, 10, true), None, "consent given");
        if let ActionBody::Install { kind, .. } = &mut action.body {
            *kind = ActionKind::TimeForced { at: 50 };
        }
        assert_eq!(
            wait_reason(&action, 10, false),
            Some((
                "waiting for local consent (flotilla-agent consent act-1); installs anyway at 50"
                    .into(),
                Some(50)
            ))
        );
        assert_eq!(
            wait_reason(&action, 10, true),
            None,
            "consent before the time"
        );
        assert_eq!(wait_reason(&action, 50, false), None, "forced at its time");
        if let ActionBody::Install { kind, window, .. } = &mut action.body {
            *kind = ActionKind::Forced;
            *window = Some(flotilla_protocol::TimeWindow {
                not_before: 100,
                not_after: 200,
            });
        }
        assert_eq!(
            wait_reason(&action, 10, false).map(|w| w.0),
            Some("outside the time window: opens at 100".into())
        );
        assert_eq!(wait_reason(&action, 150, false), None);
    }

    /// Polls the store until the current action is in a waiting state.
    async fn until_waiting(env: &Env) {
        tokio::time::timeout(Duration::from_secs(30), async {
            while !matches!(
                env.store.current().ok().flatten().map(|r| r.state),
                Some(State::Waiting { .. })
            ) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the action did not start waiting");
    }

    fn reported_phases(rx: &mut mpsc::Receiver<Outgoing>) -> Vec<Phase> {
        let mut out = Vec::new();
        while let Ok(o) = rx.try_recv() {
            if let Outgoing::Report(r) = o {
                out.push(r.phase);
            }
        }
        out
    }

    #[tokio::test]
    async fn soft_install_waits_for_the_consent_file_then_installs() {
        let mut f = fixture(None, vec![]);
        let dest = f.dir.path().join("app.bin");
        std::fs::write(&dest, b"old").expect("write");
        let bytes = b"soft update".to_vec();
        let start = record(&bytes, State::Accepted, ActionKind::Soft);
        f.env.persist(&start).expect("persist");
        let data_dir = f.env.config.data_dir.clone();
        let consenter = async {
            until_waiting(&f.env).await;
            assert_eq!(
                std::fs::read(&dest).expect("read"),
                b"old",
                "nothing installed yet"
            );
            consent::give(&data_dir, "act-1", 0).expect("consent");
        };
        let mut io = io(bytes.clone());
        let (rec, ()) = tokio::join!(drive(&f.env, start, &mut io, false), consenter);
        assert_eq!(rec.state, State::Applied);
        assert_eq!(std::fs::read(&dest).expect("read"), bytes);
        let phases = reported_phases(&mut f.outgoing);
        assert!(
            phases.contains(&Phase::Waiting {
                reason: "waiting for local consent (flotilla-agent consent act-1)".into()
            }),
            "{phases:?}"
        );
        assert!(
            !consent::given(&data_dir, "act-1"),
            "consent file is cleared"
        );
    }

    #[tokio::test]
    async fn time_forced_install_proceeds_at_its_time_without_consent() {
        let mut f = fixture(None, vec![]);
        let dest = f.dir.path().join("app.bin");
        let bytes = b"forced later".to_vec();
        // Whole seconds on the wall clock: `now + 1` is as little as a millisecond away (at
        // x.999 s), and a loaded machine reached its check after it and never waited. Three
        // leave two whole seconds to reach the check.
        let at = trust::system_now() + 3;
        let rec = tokio::time::timeout(
            Duration::from_secs(30),
            drive(
                &f.env,
                record(&bytes, State::Accepted, ActionKind::TimeForced { at }),
                &mut io(bytes.clone()),
                false,
            ),
        )
        .await
        .expect("installed once its time came");
        assert_eq!(rec.state, State::Applied);
        assert_eq!(std::fs::read(&dest).expect("read"), bytes);
        let phases: Vec<&str> = reported_phases(&mut f.outgoing)
            .iter()
            .map(Phase::name)
            .collect();
        assert_eq!(phases.first(), Some(&"waiting"), "{phases:?}");
        assert!(trust::system_now() >= at, "not installed before its time");
    }

    #[tokio::test(start_paused = true)]
    async fn restart_while_waiting_keeps_waiting() {
        let target = Arc::new(Counting::default());
        let f = fixture(Some(target.clone()), vec![]);
        let start = record(b"x", State::Accepted, ActionKind::Soft);
        f.env.persist(&start).expect("persist");
        // First run: reaches Waiting, then the agent stops.
        let mut first = io(b"x".to_vec());
        let shutdown = first.shutdown.clone();
        let (rec, ()) = tokio::join!(drive(&f.env, start, &mut first, false), async {
            until_waiting(&f.env).await;
            shutdown.cancel();
        });
        assert!(
            matches!(rec.state, State::Waiting { .. }),
            "{:?}",
            rec.state
        );
        // Restarted from the persisted state: an hour later it still waits, nothing fetched.
        let persisted = f.env.store.current().expect("read").expect("kept");
        assert!(matches!(persisted.state, State::Waiting { .. }));
        let mut second = io(b"x".to_vec());
        let shutdown = second.shutdown.clone();
        let (rec, ()) = tokio::join!(drive(&f.env, persisted, &mut second, true), async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            shutdown.cancel();
        });
        assert!(
            matches!(rec.state, State::Waiting { .. }),
            "{:?}",
            rec.state
        );
        assert_eq!(target.stage.load(Ordering::SeqCst), 0, "nothing staged");
        assert!(
            !downloads_dir(&f.env.config).exists(),
            "nothing downloaded while waiting"
        );
    }

    fn rollback_record(action_id: &str, undo: &str) -> ActionRecord {
        let mut r = record(b"", State::Accepted, ActionKind::Forced);
        r.action_id = action_id.into();
        r.action.action_id = action_id.into();
        r.action.body = ActionBody::Rollback {
            action_id: undo.into(),
        };
        r.manifest = None;
        r
    }

    #[tokio::test]
    async fn signed_rollback_restores_the_previous_file_and_release() {
        let f = fixture(None, vec![check("true")]);
        let dest = f.dir.path().join("app.bin");
        std::fs::write(&dest, b"release 1").expect("write");
        let before = InstalledRelease {
            name: "app-1".into(),
            version: "1.0".into(),
            counter: 3,
        };
        f.env.store.set_installed(&before).expect("installed");
        f.env.save_trust(TrustState {
            installed_counter: 3,
            ..TrustState::default()
        });
        let bytes = b"release 2".to_vec();
        let rec = drive(
            &f.env,
            record(&bytes, State::Accepted, ActionKind::Forced),
            &mut io(bytes.clone()),
            false,
        )
        .await;
        assert_eq!(rec.state, State::Ready);
        assert_eq!(f.env.trust_state().installed_counter, 4);

        let rec = drive(
            &f.env,
            rollback_record("rb-1", "act-1"),
            &mut io(vec![]),
            false,
        )
        .await;
        assert_eq!(rec.state, State::Ready, "the rollback action is ready");
        assert_eq!(rec.phase(), Phase::Ready);
        assert_eq!(std::fs::read(&dest).expect("read"), b"release 1");
        assert_eq!(f.env.store.installed().expect("read"), Some(before));
        assert_eq!(
            crate::trust::read_trust_file(&f.env.config.data_dir).installed_counter,
            3,
            "the counter goes back with the release"
        );
        assert_eq!(f.env.store.rollback_point().expect("read"), None);

        // A second rollback of the same install has nothing left to return to.
        let rec = drive(
            &f.env,
            rollback_record("rb-2", "act-1"),
            &mut io(vec![]),
            false,
        )
        .await;
        match &rec.state {
            State::Failed {
                reason,
                rolled_back: false,
            } => assert!(reason.starts_with("nothing to roll back: "), "{reason}"),
            other => panic!("expected a failure, got {other:?}"),
        }
        assert_eq!(std::fs::read(&dest).expect("read"), b"release 1");
    }

    #[tokio::test]
    async fn rollback_with_nothing_kept_fails_cleanly() {
        let target = Arc::new(Counting::default());
        let f = fixture(Some(target.clone()), vec![]);
        let rec = drive(
            &f.env,
            rollback_record("rb-1", "act-0"),
            &mut io(vec![]),
            false,
        )
        .await;
        assert_eq!(
            rec.state,
            State::Failed {
                reason:
                    "nothing to roll back: this device keeps no release from before action act-0"
                        .into(),
                rolled_back: false
            }
        );
        assert_eq!(
            target.rollback.load(Ordering::SeqCst),
            0,
            "no target touched"
        );
        assert_eq!(f.env.store.installed().expect("read"), None);
    }

    #[tokio::test]
    async fn rollback_of_an_older_install_is_refused_as_nothing_to_roll_back() {
        let target = Arc::new(Counting::default());
        let f = fixture(Some(target.clone()), vec![]);
        let rec = drive(
            &f.env,
            record(b"x", State::Staged, ActionKind::Forced),
            &mut io(vec![]),
            false,
        )
        .await;
        assert_eq!(rec.state, State::Applied);
        let rec = drive(
            &f.env,
            rollback_record("rb-1", "act-older"),
            &mut io(vec![]),
            false,
        )
        .await;
        assert_eq!(
            rec.state,
            State::Failed {
                reason: "nothing to roll back: the installed release was installed by action act-1, not act-older".into(),
                rolled_back: false
            }
        );
        assert_eq!(target.rollback.load(Ordering::SeqCst), 0);
    }
}
