//! The service's state and its bookkeeping: counters, store failures and recovery.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use flotilla_protocol::control::ControlRequest;
use flotilla_protocol::{BypassedPeer, ByteCounts, Digest, SignedBlob};
use flotilla_protocol::{SigningKey, Topics, VerifyingKey};
use rumqttc::AsyncClient;

use crate::service::error::ServiceError;

use crate::service::artifacts::BlockServer;
use crate::service::coverage::Coverage;
use crate::service::enrollment::{Ignored, IgnoredLog, Registry};
use crate::service::http::control::Replier;
use crate::service::http::state::LiveEvent;
use crate::service::leadership::Leadership;
use crate::service::loading::Loading;
use crate::service::metrics::{Malformed, Metrics, Totals};
use crate::service::operators::Gate;
use crate::service::releases::ReleaseStore;
use crate::service::sequence::ActionSequence;
use crate::service::store::{Store, StoreError};
use crate::service::store_health::{self, StoreHealth};
use flotilla_rollout::engine::{Effect, Engine};

/// Seconds since the Unix epoch.
pub(super) fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub(super) struct Service {
    pub(super) engine: Engine,
    pub(super) store: Store,
    pub(super) key: SigningKey,
    /// `key`'s public half, decompressed once.
    pub(super) verifying_key: VerifyingKey,
    /// Retained desired actions recognised as this coordinator's by their bytes, without a
    /// signature check (see [`Service::our_desired_action`]).
    pub(super) desired_known: u64,
    pub(super) releases: ReleaseStore,
    /// Signed manifests by release name. Release names are never reused, so a cached blob
    /// cannot go stale, and a group start does not re-read the file once per device.
    pub(super) manifests: HashMap<String, SignedBlob>,
    /// The `issued_at` of the next action per device (see [`ActionSequence`]).
    pub(super) sequence: ActionSequence,
    pub(super) blocks: BlockServer,
    pub(super) topics: Topics,
    pub(super) client: AsyncClient,
    /// The control connection's client (`control_link.rs`): control replies go out on it
    /// while it is up (`replies_up`), so they do not queue behind desired actions; on the main
    /// client otherwise.
    pub(super) replies: Option<AsyncClient>,
    pub(super) replies_up: bool,
    /// Control requests taken from one connection whose copy on the other is still to come
    /// (`None` without a control connection).
    pub(super) twins: Option<crate::service::control_link::Twins>,
    pub(super) validity: u64,
    pub(super) addr: String,
    pub(super) malformed: u64,
    /// When the last malformed-payload line was logged.
    pub(super) malformed_logged: Option<std::time::Instant>,
    /// Publishes dropped because the topic or the size could not go out (see [`Service::publish`]).
    pub(super) unpublishable: u64,
    /// Device id -> when its retained `desired` topic was last repaired.
    pub(super) repaired: HashMap<String, u64>,
    /// Retained `desired` topics found holding something else and published again.
    pub(super) desired_repairs: u64,
    /// Checks who sent each control request and whether they may.
    pub(super) gate: Gate,
    pub(super) refused: u64,
    /// Device keys and enrollment: which signed device messages pass.
    pub(super) registry: Registry,
    /// Device messages ignored (unsigned, another key, not accepted…), counted and rate-limited.
    pub(super) ignored: IgnoredLog,
    /// The digests of each release (artifacts and block lists), for deciding who may fetch what.
    pub(super) release_digests: HashMap<String, Vec<Digest>>,
    /// Device id -> the artifacts of the install its retained desired action (signed with this
    /// coordinator's key) names: what it published itself, and what it reads back from the
    /// retained `desired` topics (after a restart, or another instance with the same key).
    pub(super) holdings: HashMap<String, Vec<Digest>>,
    /// Device id -> the action whose bytes by source were last counted.
    pub(super) bytes_counted: HashMap<String, String>,
    /// Whether the store can be written (`store_health.rs`).
    pub(super) health: StoreHealth,
    pub(super) data_dir: PathBuf,
    /// Counters and timings for the metrics endpoint (`metrics.rs`).
    pub(super) metrics: Metrics,
    /// Whether every retained state is read yet, and the commands waiting for it.
    pub(super) loading: Loading<Held>,
    /// While a reissue is pending (from a (re)connect until loading ends): device id -> the
    /// action id and expiry its retained `desired` topic holds, read back or published since,
    /// so the reissue skips it (`inbound.rs`).
    pub(super) confirmed: Option<HashMap<String, (String, u64)>>,
    /// Whether the retained states cover the accepted devices (`coverage.rs`).
    pub(super) coverage: Coverage,
    /// Without a control connection (`control_link.rs`), whether control requests take the
    /// main link's lane ahead of device traffic (`mqtt.rs`): while
    /// loading. Afterwards they are read in arrival order with everything else.
    pub(super) lane_open: Arc<std::sync::atomic::AtomicBool>,
    /// Whether this coordinator leads (always, on sled; by the lease, on a shared store).
    pub(super) leadership: Arc<dyn Leadership>,
    /// A write was refused because another coordinator leads now: nothing more goes out.
    pub(super) fenced: bool,
    /// Enrollment changes devices made by themselves (a state, a token), not written yet.
    pub(super) unsaved: Unsaved,
    /// Live events for the HTTP API's event streams; sending never waits (nobody listening,
    /// or a listener behind, costs nothing here).
    pub(super) live: tokio::sync::broadcast::Sender<LiveEvent>,
    /// Rollouts reported on since live events were last sent (`live.rs`).
    pub(super) live_changes: crate::service::live_changes::LiveChanges,
}

/// Enrollment records and used tokens waiting for the next batch write: one durable write per
/// tick (or per [`Unsaved::LIMIT`] changes) instead of one per device, which is what a fleet
/// enrolling at once needs on a database. A crash loses at most these: a device whose
/// enrollment was lost is pending again and, with a token or a pre-authorized key, enrolls
/// again from its next state (its token was not recorded as used either). An operator's
/// accept, reject or revoke is written before it is answered, never batched.
#[derive(Debug, Default)]
pub(super) struct Unsaved {
    pub(super) devices: std::collections::BTreeSet<String>,
    pub(super) tokens: Vec<(String, u64)>,
}

impl Unsaved {
    /// Changes after which the batch is written at once, without waiting for the tick.
    pub(super) const LIMIT: usize = 2_000;

    pub(super) fn len(&self) -> usize {
        self.devices.len() + self.tokens.len()
    }
}

/// A control request that passed the gate and waits for the registry to be complete.
pub(super) struct Held {
    pub(super) request: ControlRequest,
    pub(super) operator: String,
    /// Where its reply goes.
    pub(super) to: Replier,
}

impl Service {
    /// Counts a malformed payload; logs the first and then at most one line a minute, so a
    /// flood of garbage cannot flood the log.
    pub(super) fn reject(&mut self, topic: &str, why: Malformed, reason: &str) {
        self.malformed += 1;
        self.metrics.malformed(why);
        let now = std::time::Instant::now();
        if self
            .malformed_logged
            .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(60))
        {
            self.malformed_logged = Some(now);
            let topic: String = topic.chars().take(200).collect();
            tracing::warn!(%topic, %reason, malformed_total = self.malformed,
                "ignoring malformed payload (next such line in a minute at the earliest)");
        }
    }

    /// Hands the metrics endpoint a fresh snapshot when a scrape waits for one.
    pub(super) fn refresh_metrics(&self) {
        if self.metrics.wanted() {
            let totals = Totals {
                unpublishable: self.unpublishable,
                desired_repairs: self.desired_repairs,
                store_write_failures: self.health.failures,
                device_actions_held_back: self.health.held_back,
                store_failing: self.health.is_failing(),
                registry_loading: self.loading.is_loading(),
            };
            // The passes over the fleet at most every COUNTS_EVERY, however often scrapes ask.
            let count = self.metrics.counts_due(std::time::Instant::now());
            self.metrics
                .refresh(&self.engine, &self.ignored.total, totals, count);
            if count {
                let (accepted, with_state) = self.coverage_counts();
                self.coverage.set_without_state(accepted - with_state);
            }
        }
    }

    /// Where the bytes of a device's finished action came from. Counted by source for
    /// `/metrics`; this is the one place bytes by source enter the service.
    /// The engine keeps them per rollout and per site, and traces the peers the device bypassed.
    pub(super) fn observe_bytes(
        &mut self,
        device: &str,
        action_id: &str,
        bytes: &ByteCounts,
        bypassed: &[BypassedPeer],
        now: u64,
    ) -> Vec<Effect> {
        // A report sent again (the agent repeats it until it is acknowledged) counts once.
        if self.bytes_counted.get(device).map(String::as_str) == Some(action_id) {
            return Vec::new();
        }
        self.bytes_counted
            .insert(device.to_owned(), action_id.to_owned());
        tracing::debug!(%device, %action_id, coordinator = bytes.coordinator,
            peers = bytes.from_peers(), local = bytes.local, http = bytes.from_http(),
            "bytes by source");
        self.metrics.device_bytes(bytes);
        self.engine.observe_bytes(device, action_id, bytes.clone());
        self.engine
            .observe_bypassed(device, action_id, bypassed, now)
    }

    /// Counts an ignored device message; logs at most one line per interval.
    pub(super) fn ignore(&mut self, topic: &str, why: Ignored) {
        if let Some(line) = self.ignored.count(why, topic, std::time::Instant::now()) {
            tracing::warn!(ignored_total = self.ignored.total(), "{line}");
        }
    }

    /// Writes the enrollment changes devices made since the last batch ([`Unsaved`]), in one
    /// durable write. A failure puts the service into its failing-store mode, whose recovery
    /// writes every enrollment and used token again.
    pub(super) fn save_enrollments(&mut self) {
        if self.unsaved.len() == 0 {
            return;
        }
        let Unsaved { devices, tokens } = std::mem::take(&mut self.unsaved);
        let records: Vec<_> = devices
            .iter()
            .filter_map(|d| self.registry.get(d))
            .collect();
        if let Err(e) = self.store.save_enrollments(&records, &tokens) {
            self.store_failed(&e);
        }
    }

    /// Stores a device's enrollment record. A failure puts the service into its failing-store
    /// mode; the recovery writes every enrollment again.
    /// The error is for an operator's reply.
    pub(super) fn save_enrollment(&mut self, device: &str) -> Result<(), String> {
        let Some(record) = self.registry.get(device) else {
            return Ok(());
        };
        self.store.save_enrollment(record).map_err(|e| {
            self.store_failed(&e);
            format!(
                "cannot store the change: {e}; it holds in memory and is written when the store \
                 can be written again"
            )
        })
    }

    /// A store write under an operator's command failed: the store is failing from now on, and
    /// the operator gets the reason.
    pub(super) fn write_failed(&mut self, error: StoreError) -> String {
        self.store_failed(&error);
        error.to_string()
    }

    /// Why this coordinator stops leading, for the log and the error it stops with.
    pub(super) fn deposed(&self, reason: &str) -> ServiceError {
        ServiceError::Deposed {
            epoch: self.leadership.epoch(),
            reason: reason.to_owned(),
        }
    }

    /// A store write failed: from now on nothing that needs it goes out (`store_health.rs`).
    /// A write fenced off because another coordinator leads stops everything instead.
    pub(super) fn store_failed(&mut self, error: &StoreError) {
        if error.is_fenced() {
            if !self.fenced {
                tracing::warn!(store = %self.store.describe(), %error,
                    "another coordinator leads now: this one publishes nothing more and steps down");
            }
            self.fenced = true;
            return;
        }
        if self.health.fail(error.to_string(), now()) {
            tracing::error!(store = %self.store.describe(), %error,
                "the store cannot be written: refusing changes and holding back device actions until it can");
        }
    }

    /// While the store is failing, tries it again every few seconds: once there is room, it is
    /// reopened, everything in memory is written again, and each device is sent what it is owed.
    pub(super) async fn retry_store(&mut self) -> Result<(), ServiceError> {
        if !self.health.attempt_due(std::time::Instant::now()) {
            return Ok(());
        }
        if let Err(e) = store_health::has_room(&self.data_dir) {
            self.health.fail(
                format!("no room in {}: {e}", self.data_dir.display()),
                now(),
            );
            return Ok(());
        }
        if let Err(e) = self.resave() {
            self.store_failed(&e);
            return Ok(());
        }
        let since = self.health.recovered().unwrap_or_default();
        store_health::ensure_reserve(&self.data_dir);
        tracing::info!(store = %self.store.describe(), failed_for_s = now().saturating_sub(since),
            device_actions_held_back = self.health.held_back,
            "the store can be written again; every rollout and enrollment is saved, reissuing what each device is owed");
        let effects = self.engine.reissue(now());
        self.apply(effects).await
    }

    /// Reopens the store and writes every rollout, enrollment and used token held in memory.
    pub(super) fn resave(&mut self) -> Result<(), StoreError> {
        self.store.reopen()?;
        for rollout in self.engine.rollouts() {
            self.store.save_rollout(rollout)?;
        }
        for record in self.registry.all() {
            self.store.save_enrollment(record)?;
        }
        let now = now();
        for token in self.registry.used_tokens() {
            self.store.use_token(token, now)?;
        }
        Ok(())
    }
}
