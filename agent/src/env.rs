//! What the update state machine works with: the agent's side of it ([`Env`]: config, store,
//! trust state, link, targets), the channels of one running action ([`ActionIo`]) and what a step
//! produces ([`Next`]). Shared by the agent loop, the action task and the peer server.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_protocol::{
    BypassedPeer, CurrentAction, DeviceState, InstalledRelease, ReleaseManifest, Report, UnixTime,
};
use flotilla_targets::UpdateTarget;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::fetch::{FetchInput, FetchRequest};
use crate::link::{LinkHandle, Outgoing};
use crate::record::{ActionRecord, RollbackPoint, State};
use crate::store::{Store, StoreError};
use crate::trust::{self, TrustState};

/// What the machine needs from the rest of the agent; shared by the agent loop and the action
/// task.
pub struct Env {
    pub config: Arc<Config>,
    pub store: Store,
    pub targets: HashMap<String, Arc<dyn UpdateTarget>>,
    pub link: LinkHandle,
    pub trust: Mutex<TrustState>,
}

impl std::fmt::Debug for Env {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Env")
            .field("device_id", &self.config.device_id)
            .finish_non_exhaustive()
    }
}

impl Env {
    /// `max(system time, last trusted time)`.
    pub fn now(&self) -> UnixTime {
        self.trust_state()
            .now(trust::system_now(), self.config.trust.max_clock_skew)
    }

    pub fn trust_state(&self) -> TrustState {
        self.trust.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Records a verified action's issue time as trusted (and as the last accepted action's,
    /// see [`trust::check_issued`]), in sled and the trust file.
    pub fn advance_trusted_time(&self, at: UnixTime) {
        let mut state = self.trust_state();
        if state.accept_action_at(at) {
            self.save_trust(state);
        }
    }

    pub(crate) fn save_trust(&self, state: TrustState) {
        if let Ok(mut t) = self.trust.lock() {
            *t = state.clone();
        }
        if let Err(e) = self.store.set_trust(&state) {
            tracing::error!("{e}");
        }
        if let Err(e) = trust::write_trust_file(&self.config.data_dir, &state) {
            tracing::error!("cannot write trust file: {e}");
        }
    }

    /// Persists a new state of an action (flushed). On an error the state's side effects must
    /// not run: "persist, then act" must never quietly become "act" (see [`drive`]).
    pub fn persist(&self, record: &ActionRecord) -> Result<(), StoreError> {
        self.store.save_action(record).inspect_err(|e| {
            tracing::error!(action = record.action_id, "{e}");
        })?;
        crate::fault::point(&format!("after-{}", record.state.name()));
        Ok(())
    }

    /// [`persist`](Self::persist), tried again after 1 and 2 seconds (a full disk may have
    /// room again once a partial download was removed); the last error if all three fail.
    pub(crate) async fn persist_retrying(
        &self,
        record: &ActionRecord,
        shutdown: &CancellationToken,
    ) -> Result<(), StoreError> {
        let mut wait = Duration::from_secs(1);
        loop {
            let result = self.persist(record);
            if result.is_ok() || wait > Duration::from_secs(2) {
                return result;
            }
            tokio::select! {
                _ = shutdown.cancelled() => return result,
                _ = tokio::time::sleep(wait) => {}
            }
            wait *= 2;
        }
    }

    /// Publishes a report for `record`'s current phase (kept in the outbox until acknowledged),
    /// then the retained device state.
    pub async fn report(&self, record: &ActionRecord) {
        if let Some(report) = self.make_report(record) {
            self.link.send(self.outgoing_report(report)).await;
        }
        self.link
            .send(Outgoing::State(self.device_state(true)))
            .await;
        self.write_status_file();
    }

    /// Refreshes `<data_dir>/status`, the view `flotilla-agent status` and `consent` read while
    /// the agent holds the database.
    pub fn write_status_file(&self) {
        crate::status::write_status_file(&self.config.data_dir, &self.store, &self.trust_state());
    }

    /// How a report goes out: a final report of an action that downloaded something carries
    /// its bytes by source (also when the outbox sends it again).
    pub fn outgoing_report(&self, report: Report) -> Outgoing {
        if report.phase.is_terminal() {
            if let Ok(Some(bytes)) = self.store.action_bytes(&report.action_id) {
                let bypassed = self
                    .store
                    .action_bypassed(&report.action_id)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(peer, reason)| BypassedPeer { peer, reason })
                    .collect();
                return Outgoing::ReportWithBytes {
                    report,
                    bytes,
                    bypassed,
                };
            }
        }
        Outgoing::Report(report)
    }

    /// Like [`report`](Self::report) but never waits; for download progress.
    pub(crate) fn report_progress(&self, record: &ActionRecord) {
        if let Some(report) = self.make_report(record) {
            self.link.try_send(Outgoing::Report(report));
        }
    }

    fn make_report(&self, record: &ActionRecord) -> Option<Report> {
        let seq = match self.store.next_seq() {
            Ok(seq) => seq,
            Err(e) => {
                tracing::error!("cannot report: {e}");
                return None;
            }
        };
        let report = Report {
            device_id: self.config.device_id.to_string(),
            seq,
            action_id: record.action_id.clone(),
            rollout_id: record.rollout_id.clone(),
            phase: record.phase(),
            at: self.now(),
        };
        tracing::info!(action = record.action_id, seq, phase = ?report.phase, "report");
        if let Err(e) = self.store.outbox_put(&report) {
            tracing::error!("{e}");
        }
        Some(report)
    }

    /// This device's self-description.
    pub fn device_state(&self, online: bool) -> DeviceState {
        let current = self.store.current().ok().flatten().map(|r| CurrentAction {
            phase: r.phase(),
            action_id: r.action_id,
            rollout_id: r.rollout_id,
        });
        DeviceState {
            device_id: self.config.device_id.to_string(),
            hardware_id: self.config.hardware_id.clone(),
            labels: self.config.labels.clone(),
            installed: self.store.installed().ok().flatten(),
            current,
            online,
            agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            at: self.now(),
        }
    }

    /// Records `manifest` as installed by `action_id`, first remembering what it replaces so a
    /// signed rollback can return to it.
    pub(crate) fn set_installed(
        &self,
        action_id: &str,
        manifest: &ReleaseManifest,
    ) -> Result<(), StoreError> {
        let release = InstalledRelease {
            name: manifest.name.clone(),
            version: manifest.version.clone(),
            counter: manifest.counter,
        };
        let mut state = self.trust_state();
        // After a crash between these writes the step runs again; the point recorded the first
        // time already holds the true previous release, so it is not overwritten.
        let recorded = self.store.rollback_point()?;
        if recorded.as_ref().is_none_or(|p| p.action_id != action_id) {
            self.store.set_rollback_point(Some(&RollbackPoint {
                action_id: action_id.to_owned(),
                release: release.clone(),
                previous: self.store.installed()?,
                previous_counter: state.installed_counter,
                artifacts: manifest
                    .artifacts
                    .iter()
                    .map(|a| (a.name.clone(), a.target.clone()))
                    .collect(),
            }))?;
        }
        self.store.set_installed(&release)?;
        state.installed_counter = state.installed_counter.max(manifest.counter);
        self.save_trust(state);
        Ok(())
    }

    /// Returns the records to what `point` says was installed before: the only place the
    /// installed counter goes down.
    pub(crate) fn restore_installed(&self, point: &RollbackPoint) -> Result<(), StoreError> {
        self.store.replace_installed(point.previous.as_ref())?;
        let mut state = self.trust_state();
        state.installed_counter = point.previous_counter;
        self.save_trust(state);
        // One step back only: targets keep one previous version.
        self.store.set_rollback_point(None)
    }
}

/// The channels and tokens one running action uses.
#[derive(Debug)]
pub struct ActionIo {
    pub fetch_requests: mpsc::Sender<FetchRequest>,
    pub fetch_inputs: mpsc::Receiver<FetchInput>,
    /// A signed cancel for this action.
    pub cancel: CancellationToken,
    /// The agent is stopping: leave the state as it is, it resumes after the restart.
    pub shutdown: CancellationToken,
}

/// What a step produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    State(State),
    /// Shutdown: stop without changing the persisted state.
    Interrupted,
}

/// A step that failed: `Failed` with the reason, rolled back or not.
pub(crate) fn failed(reason: String, rolled_back: bool) -> Next {
    Next::State(State::Failed {
        reason,
        rolled_back,
    })
}

/// Where downloads live.
pub fn downloads_dir(config: &Config) -> PathBuf {
    config.data_dir.join("downloads")
}
