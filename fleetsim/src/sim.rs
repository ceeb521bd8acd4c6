//! The simulator at run time: N devices behind one MQTT connection.
//!
//! One subscription, `devices/+/desired`, brings every device's desired action; the simulator
//! keeps those of its own id range ([`Fleet::slot`]) and drops the rest, so several simulators
//! can share a broker. Every desired action is checked like the agent checks it: the
//! coordinator's signature over the bytes received, the device id, the expiry; a forgery is
//! counted and refused, never acted on. An install then runs as a task: each phase
//! ([`install_phases`]) is reported (a signed [`Report`] with the device's next `seq`) and
//! followed by the device's signed retained state, as the agent does, spread over the install
//! time (none by default: instant installs). With `--download` the task fetches and checks the
//! release's artifacts before it reports `Downloading` ([`crate::device_fetch`]).
//!
//! What it measures on the way ([`Summary`]): desired actions received and how many arrived
//! twice live (a retained copy delivered on subscribing is not a second send), the rollout's wall
//! time from the first desired action to the last final report, the idle gaps between the last
//! final report and the next desired action (group transitions, when groups run one after the
//! other), and, with a probe key, control request round trips.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use flotilla_protocol::control::{Command, ControlReply, ControlRequest};
use flotilla_protocol::manifest::Manifest;
use flotilla_protocol::operator::{new_nonce, SignedRequest};
use flotilla_protocol::{
    device, envelope, ActionBody, ByteCounts, CurrentAction, DesiredAction, DeviceId,
    DeviceMessage, DeviceState, Digest, InstalledRelease, Message, Phase, Report, SigningKey,
    Topic, Topics, VerifyingKey,
};
use rumqttc::{AsyncClient, QoS};
use tokio_util::sync::CancellationToken;

use crate::device_fetch::{self, ArtifactJob, DownloadMode, Fetcher};
use crate::fleet::{install_phases, percentile, Fleet, Phases};
use crate::link::{self, LinkCounters, LinkEvent};
use crate::sign_ahead::{DeviceSigner, Nonces};

/// Everything a run needs, validated ([`crate::args`]).
#[derive(Debug, Clone)]
pub struct Options {
    pub fleet: Fleet,
    pub connection: flotilla_mqtt::Connection,
    pub topic_root: String,
    /// Desired actions must verify against this key.
    pub coordinator_key: VerifyingKey,
    pub hardware_id: String,
    pub labels: Vec<(String, String)>,
    pub installed: Option<InstalledRelease>,
    pub install_time: Duration,
    pub fail_rate: f64,
    pub offline_share: f64,
    pub phases: Phases,
    /// One enrollment token per device, in slot order.
    pub tokens: Option<Vec<String>>,
    /// Stop once every online device has finished an install.
    pub until_done: bool,
    pub timeout: Option<Duration>,
    pub progress: Option<Duration>,
    pub inflight: u16,
    pub probe: Option<Probe>,
    /// The rollout's groups, to time transitions: `[groups] count = N` over the online
    /// devices in id order.
    pub groups: Option<usize>,
    pub summary: Option<PathBuf>,
    /// Prepare the costly half of the signatures one install per device sends before
    /// connecting ([`crate::sign_ahead`]).
    pub sign_ahead: bool,
    /// Where devices get their bytes, and how many download at once ([`crate::device_fetch`]).
    pub download: DownloadMode,
    pub download_at_once: usize,
}

/// Control round trips measured with a read-only request signed by an operator key.
#[derive(Clone)]
pub struct Probe {
    pub key: SigningKey,
    pub every: Duration,
}

impl std::fmt::Debug for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Probe")
            .field("every", &self.every)
            .finish_non_exhaustive()
    }
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("--tokens: {have} tokens for {want} devices; give one per device")]
    TooFewTokens { have: usize, want: usize },
    #[error("gave up after --timeout {after:?}: {done} of {online} online devices finished")]
    Timeout {
        after: Duration,
        done: u64,
        online: u64,
    },
    #[error("cannot write --summary {path}: {source}")]
    WriteSummary {
        path: PathBuf,
        source: std::io::Error,
    },
}

pub use crate::summary::Summary;

/// One simulated device.
struct Slot {
    id: DeviceId,
    key: SigningKey,
    signer: DeviceSigner,
    enrollment: Option<Digest>,
    offline: bool,
    seq: u64,
    installed: Option<InstalledRelease>,
    /// What a rollback returns to.
    previous: Option<InstalledRelease>,
    current: Option<CurrentAction>,
    /// Action ids received, to see one sent twice.
    seen: Vec<String>,
    /// The action a signed cancel named.
    cancel: Option<String>,
    finished: bool,
    /// What the current action downloaded, by source, for its final report.
    bytes: Option<ByteCounts>,
}

#[derive(Debug, Default)]
struct Counters {
    desired: AtomicU64,
    duplicates: AtomicU64,
    refused: AtomicU64,
    ready: AtomicU64,
    failed: AtomicU64,
    canceled: AtomicU64,
    finished_devices: AtomicU64,
    reports: AtomicU64,
    states: AtomicU64,
    published: AtomicU64,
    signed_ahead: AtomicU64,
}

/// When one group's desired actions came and its devices finished.
#[derive(Debug, Default, Clone, Copy)]
struct GroupTimes {
    desired: u64,
    first_desired: Option<Instant>,
    last_desired: Option<Instant>,
    last_final: Option<Instant>,
}

/// When a probe was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProbeWhen {
    /// Before the first desired action: the fleet registering.
    Registering,
    /// From the first desired action until every online device finished.
    Rollout,
    /// After the rollout (not counted).
    After,
}

#[derive(Debug, Default)]
struct Timeline {
    in_progress: u64,
    first_desired: Option<Instant>,
    last_desired: Option<Instant>,
    last_final: Option<Instant>,
    /// Per group of `--groups` (one group for the whole range without it).
    groups: Vec<GroupTimes>,
    probe_pending: HashMap<String, (Instant, ProbeWhen)>,
    probe_registering_ms: Vec<f64>,
    probe_rollout_ms: Vec<f64>,
}

/// What every task of a run shares.
struct Sim {
    opts: Options,
    topics: Topics,
    client: AsyncClient,
    slots: Vec<Mutex<Slot>>,
    counters: Counters,
    link: Arc<LinkCounters>,
    timeline: Mutex<Timeline>,
    online: u64,
    /// The probe's link and where the coordinator answers it.
    probe_client_id: String,
    reply_topic: String,
    /// The group of each slot under `--groups` (all 0 without it).
    group_of: Vec<usize>,
    nonces: Nonces,
    fetcher: Option<Fetcher>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// This process's CPU time so far, user + system, in seconds: fields 14 and 15 of
/// `/proc/self/stat`, in the kernel's USER_HZ (100 on Linux). `None` where there is no /proc.
pub fn own_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// Limits the warnings about refused desired actions: the first few, then a count at the end.
const REFUSALS_LOGGED: u64 = 10;

/// Plays the fleet until `shutdown`, or until every online device finished an install with
/// `until_done`. Returns the run's figures.
pub async fn run(opts: Options, shutdown: CancellationToken) -> Result<Summary, SimError> {
    let fleet = &opts.fleet;
    if let Some(tokens) = &opts.tokens {
        if tokens.len() < fleet.len() {
            return Err(SimError::TooFewTokens {
                have: tokens.len(),
                want: fleet.len(),
            });
        }
    }
    let started = Instant::now();
    let slots: Vec<Mutex<Slot>> = (0..fleet.len())
        .map(|slot| {
            let id = DeviceId::new(fleet.id(slot)).unwrap_or_else(|_| unreachable_id());
            let key = fleet.key(slot);
            let enrollment = opts
                .tokens
                .as_ref()
                .map(|t| device::enrollment_proof(&t[slot], id.as_str(), &key.verifying_key()));
            Mutex::new(Slot {
                offline: fleet.is_offline(slot, opts.offline_share),
                id,
                signer: DeviceSigner::new(&key),
                key,
                enrollment,
                seq: 0,
                installed: opts.installed.clone(),
                previous: None,
                current: None,
                seen: Vec::new(),
                cancel: None,
                finished: false,
                bytes: None,
            })
        })
        .collect();
    let online_slots: Vec<usize> = (0..slots.len())
        .filter(|&s| !lock(&slots[s]).offline)
        .collect();
    let online = online_slots.len() as u64;
    let mut group_of = vec![0; slots.len()];
    let groups = crate::baseline::split(&online_slots, opts.groups.unwrap_or(1));
    for (g, members) in groups.iter().enumerate() {
        for &slot in members {
            group_of[slot] = g;
        }
    }
    let timeline = Timeline {
        groups: vec![GroupTimes::default(); groups.len()],
        ..Timeline::default()
    };
    let keys_s = started.elapsed().as_secs_f64();
    // One install per online device: a report and a state per phase.
    let nonces = if opts.sign_ahead {
        let per_device = 2 * install_phases(opts.phases, 0, false).len();
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let count = online as usize * per_device;
        tokio::task::spawn_blocking(move || Nonces::prepare(count, threads))
            .await
            .unwrap_or_else(|_| Nonces::none())
    } else {
        Nonces::none()
    };
    tracing::info!(
        devices = fleet.len(),
        online,
        keys_s,
        nonces = nonces.len(),
        nonces_s = started.elapsed().as_secs_f64() - keys_s,
        "fleet ready"
    );
    let stop = shutdown.child_token();
    let client_id = format!(
        "fleetsim-{}{}-{}",
        fleet.prefix,
        fleet.first,
        std::process::id()
    );
    let (client, mut events, link_counters) =
        link::start(&opts.connection, &client_id, opts.inflight, stop.clone());
    let topics = Topics::new(&opts.topic_root);
    let fetcher = (opts.download != DownloadMode::None).then(|| {
        Fetcher::new(
            opts.download,
            topics.clone(),
            client.clone(),
            opts.download_at_once,
        )
    });
    // The probe has a connection of its own, as an operator's command line would: its requests
    // do not queue behind the devices' messages in the simulator.
    let probe_client_id = format!("{client_id}-probe");
    let reply_topic = topics.control_reply(&probe_client_id);
    let sim = Arc::new(Sim {
        opts,
        topics,
        client,
        slots,
        counters: Counters::default(),
        link: link_counters,
        timeline: Mutex::new(timeline),
        online,
        probe_client_id,
        reply_topic,
        group_of,
        nonces,
        fetcher,
    });

    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut last_progress = Instant::now();
    let deadline = sim.opts.timeout.map(|t| Instant::now() + t);
    let mut connected_once = false;
    let result = loop {
        tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            event = events.recv() => match event {
                None => break Ok(()),
                Some(LinkEvent::Connected) => {
                    sim.subscribe().await;
                    if !connected_once {
                        connected_once = true;
                        tracing::info!(broker = %sim.opts.connection.describe(), "connected");
                        tokio::spawn(sim.clone().register());
                        if let Some(probe) = sim.opts.probe.clone() {
                            tokio::spawn(sim.clone().probe(probe, stop.clone()));
                        }
                    } else {
                        tracing::warn!("connected again after a loss");
                    }
                }
                Some(LinkEvent::Lost(reason)) => {
                    tracing::warn!("MQTT connection lost: {reason}; reconnecting");
                }
                Some(LinkEvent::Subscribed) => {}
                Some(LinkEvent::Publish { topic, payload, retain }) => {
                    if !sim.fetcher.as_ref().is_some_and(|f| f.on_block(&topic, &payload)) {
                        sim.on_desired(&topic, &payload, retain);
                    }
                }
            },
            _ = tick.tick() => {
                if let Some(every) = sim.opts.progress {
                    if last_progress.elapsed() >= every {
                        last_progress = Instant::now();
                        eprintln!("{}", sim.progress_line(started));
                    }
                }
                if sim.opts.until_done && sim.counters.finished_devices.load(Relaxed) >= sim.online {
                    break Ok(());
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    break Err(SimError::Timeout {
                        after: sim.opts.timeout.unwrap_or_default(),
                        done: sim.counters.finished_devices.load(Relaxed),
                        online: sim.online,
                    });
                }
            }
        }
    };
    // Let the broker take what is queued (bounded), then leave.
    let drain = Instant::now() + Duration::from_secs(10);
    while sim.link.acked.load(Relaxed) < sim.counters.published.load(Relaxed)
        && Instant::now() < drain
        && !shutdown.is_cancelled()
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sim.link.closing.store(true, Relaxed);
    let _ = sim.client.try_disconnect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.cancel();
    let summary = sim.summary();
    if let Some(path) = &sim.opts.summary {
        let text = serde_json::to_string_pretty(&summary).unwrap_or_default();
        std::fs::write(path, text).map_err(|source| SimError::WriteSummary {
            path: path.clone(),
            source,
        })?;
    }
    result.map(|()| summary)
}

/// Ids are validated when the fleet is built ([`Fleet::new`]), so this is never reached.
fn unreachable_id() -> DeviceId {
    DeviceId::new("invalid").unwrap_or_else(|_| std::process::abort())
}

impl Sim {
    async fn subscribe(&self) {
        let blocks = self.fetcher.as_ref().map(Fetcher::block_filter);
        for filter in std::iter::once(self.topics.desired_filter()).chain(blocks) {
            if let Err(e) = self.client.subscribe(filter, QoS::AtLeastOnce).await {
                tracing::warn!("cannot subscribe: {e}");
            }
        }
    }

    /// Publishes every device's retained state once, the first time the link is up, on a
    /// few tasks so signing uses every core.
    async fn register(self: Arc<Self>) {
        let started = Instant::now();
        let tasks = std::thread::available_parallelism().map_or(2, |n| n.get());
        let chunk = self.slots.len().div_ceil(tasks);
        let mut handles = Vec::new();
        for part in 0..tasks {
            let sim = self.clone();
            handles.push(tokio::spawn(async move {
                let end = ((part + 1) * chunk).min(sim.slots.len());
                for slot in part * chunk..end {
                    sim.publish_state(slot, false).await;
                }
            }));
        }
        for h in handles {
            let _ = h.await;
        }
        tracing::info!(
            states = self.slots.len(),
            queued_s = started.elapsed().as_secs_f64(),
            "every device's state is queued"
        );
    }

    fn state_of(&self, slot: &Slot) -> DeviceState {
        DeviceState {
            device_id: slot.id.to_string(),
            hardware_id: self.opts.hardware_id.clone(),
            labels: self.opts.labels.clone(),
            installed: slot.installed.clone(),
            current: slot.current.clone(),
            online: !slot.offline,
            agent_version: concat!("fleetsim-", env!("CARGO_PKG_VERSION")).to_owned(),
            at: unix_now(),
        }
    }

    /// Publishes the device's signed retained state. The first one (registration, before any
    /// rollout) is signed the ordinary way; later ones take a prepared nonce if there is one.
    async fn publish_state(&self, slot: usize, ahead: bool) {
        let (id, blob) = {
            let s = lock(&self.slots[slot]);
            let message = DeviceMessage::State {
                state: self.state_of(&s),
                enrollment: s.enrollment,
            };
            let blob = if ahead {
                self.sign(&s, &message)
            } else {
                device::sign(&s.key, &message)
            };
            (s.id.clone(), blob)
        };
        self.counters.states.fetch_add(1, Relaxed);
        self.publish(self.topics.state(&id), true, "state", blob)
            .await;
    }

    /// Signs a device message, with a prepared nonce while there are any.
    fn sign(&self, slot: &Slot, message: &DeviceMessage) -> flotilla_protocol::SignedBlob {
        let (blob, ahead) = self.nonces.sign(&slot.key, &slot.signer, message);
        if ahead {
            self.counters.signed_ahead.fetch_add(1, Relaxed);
        }
        blob
    }

    async fn publish(
        &self,
        topic: String,
        retain: bool,
        what: &str,
        blob: flotilla_protocol::SignedBlob,
    ) {
        let payload = envelope::encode(&Message::Device(blob));
        self.counters.published.fetch_add(1, Relaxed);
        if let Err(e) = self
            .client
            .publish(topic, QoS::AtLeastOnce, retain, payload)
            .await
        {
            tracing::warn!("cannot queue a {what}: {e}");
        }
    }

    /// Reports `phase` for the device's current action, then publishes its state, as the agent
    /// does after every step.
    async fn report(&self, slot: usize, phase: Phase) {
        let (id, blob) = {
            let mut s = lock(&self.slots[slot]);
            let Some(current) = s.current.as_mut() else {
                return;
            };
            current.phase = phase.clone();
            let (action_id, rollout_id) = (current.action_id.clone(), current.rollout_id.clone());
            s.seq += 1;
            let bytes = if phase.is_terminal() {
                s.bytes.take()
            } else {
                None
            };
            let report = Report {
                device_id: s.id.to_string(),
                seq: s.seq,
                action_id,
                rollout_id,
                phase,
                at: unix_now(),
            };
            let message = match bytes {
                Some(bytes) => DeviceMessage::ReportWithBytes {
                    report,
                    bytes,
                    bypassed: Vec::new(),
                },
                None => DeviceMessage::Report(report),
            };
            let blob = self.sign(&s, &message);
            (s.id.clone(), blob)
        };
        self.counters.reports.fetch_add(1, Relaxed);
        self.publish(self.topics.report(&id), false, "report", blob)
            .await;
        self.publish_state(slot, true).await;
    }

    fn refuse(&self, id: &str, reason: &str) {
        let n = self.counters.refused.fetch_add(1, Relaxed) + 1;
        if n <= REFUSALS_LOGGED {
            tracing::warn!(device = id, "refused a desired action: {reason}");
        }
    }

    /// A publish on some device's `desired` topic.
    fn on_desired(self: &Arc<Self>, topic: &str, payload: &[u8], retain: bool) {
        let Some(Topic::Desired(id)) = self.topics.parse(topic) else {
            return;
        };
        let Some(slot) = self.opts.fleet.slot(id.as_str()) else {
            return;
        };
        if payload.is_empty() {
            // A cleared retained message: nothing desired.
            return;
        }
        let blob = match envelope::decode(payload) {
            Ok(Message::Desired(blob)) => blob,
            Ok(other) => return self.refuse(id.as_str(), &format!("a {}", other.name())),
            Err(e) => return self.refuse(id.as_str(), &e.to_string()),
        };
        let bytes = match blob.verify("desired action", &[self.opts.coordinator_key]) {
            Ok(bytes) => bytes,
            Err(e) => return self.refuse(id.as_str(), &e.to_string()),
        };
        let action: DesiredAction = match envelope::from_bytes("desired action", bytes) {
            Ok(a) => a,
            Err(e) => return self.refuse(id.as_str(), &e.to_string()),
        };
        if action.device_id != id.as_str() {
            let reason = format!("it is for device {}", action.device_id);
            return self.refuse(id.as_str(), &reason);
        }
        if action.expires_at <= unix_now() {
            let reason = format!("it expired at {}", action.expires_at);
            return self.refuse(id.as_str(), &reason);
        }
        {
            let mut s = lock(&self.slots[slot]);
            if s.offline {
                return;
            }
            if s.seen.contains(&action.action_id) {
                if !retain {
                    self.counters.duplicates.fetch_add(1, Relaxed);
                }
                return;
            }
            s.seen.push(action.action_id.clone());
        }
        if let Some(install) = action.body.install() {
            // The release key's signature is the agent's business; the simulator only needs
            // the release's name, version and size.
            let (jobs, manifest) = match Manifest::decode(&install.manifest.payload) {
                Ok(m) => (device_fetch::jobs(&m, install.origins), m.release),
                Err(e) => return self.refuse(id.as_str(), &e.to_string()),
            };
            let total = manifest.artifacts.iter().map(|a| a.size).sum();
            let release = InstalledRelease {
                name: manifest.name,
                version: manifest.version,
                counter: manifest.counter,
            };
            self.begin(slot, &action.action_id, &action.rollout_id);
            let fails = self
                .opts
                .fleet
                .fails(slot, &action.action_id, self.opts.fail_rate);
            let phases = install_phases(self.opts.phases, total, fails);
            tokio::spawn(self.clone().play(slot, phases, Some(release), jobs));
            return;
        }
        match action.body {
            ActionBody::Nothing
            | ActionBody::Install { .. }
            | ActionBody::InstallWithPeers { .. }
            | ActionBody::InstallFromOrigins { .. } => {}
            ActionBody::Cancel { action_id } => {
                lock(&self.slots[slot]).cancel = Some(action_id);
            }
            ActionBody::Rollback { .. } => {
                self.begin(slot, &action.action_id, &action.rollout_id);
                let back = lock(&self.slots[slot]).previous.clone();
                let phases = vec![Phase::Accepted, Phase::Ready];
                tokio::spawn(self.clone().play(slot, phases, back, Vec::new()));
            }
        }
    }

    /// An action starts on a device: the timeline notes it (a group transition when nothing
    /// was in progress since the last final report).
    fn begin(&self, slot: usize, action_id: &str, rollout_id: &str) {
        let now = Instant::now();
        {
            let mut t = lock(&self.timeline);
            if let Some(g) = t.groups.get_mut(self.group_of[slot]) {
                g.desired += 1;
                g.first_desired.get_or_insert(now);
                g.last_desired = Some(now);
            }
            t.in_progress += 1;
            t.first_desired.get_or_insert(now);
            t.last_desired = Some(now);
        }
        self.counters.desired.fetch_add(1, Relaxed);
        let mut s = lock(&self.slots[slot]);
        s.current = Some(CurrentAction {
            action_id: action_id.to_owned(),
            rollout_id: rollout_id.to_owned(),
            phase: Phase::Accepted,
        });
    }

    /// Reports each phase in turn, the install time spread between them; the last phase is
    /// final. A signed cancel stops the action before it activates.
    async fn play(
        self: Arc<Self>,
        slot: usize,
        phases: Vec<Phase>,
        release: Option<InstalledRelease>,
        jobs: Vec<ArtifactJob>,
    ) {
        let steps = phases.len().saturating_sub(1).max(1) as u32;
        let pause = self.opts.install_time / steps;
        let mut last = Phase::Accepted;
        for (i, phase) in phases.into_iter().enumerate() {
            if i > 0 && !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            let canceled = {
                let s = lock(&self.slots[slot]);
                let current = s.current.as_ref().map(|c| c.action_id.as_str());
                s.cancel.is_some() && s.cancel.as_deref() == current
            };
            if canceled
                && matches!(
                    phase,
                    Phase::Downloading { .. } | Phase::Verified | Phase::Staged
                )
            {
                last = Phase::Canceled;
                self.report(slot, Phase::Canceled).await;
                break;
            }
            if let (Some(f), Phase::Downloading { .. }) = (&self.fetcher, &phase) {
                let (id, key) = {
                    let s = lock(&self.slots[slot]);
                    (s.id.clone(), s.key.clone())
                };
                match f.download(&id, &key, &jobs).await {
                    Ok(bytes) => lock(&self.slots[slot]).bytes = Some(bytes),
                    Err(e) => {
                        last = device_fetch::failed(&e);
                        self.report(slot, last.clone()).await;
                        break;
                    }
                }
            }
            if phase == Phase::Ready {
                let mut s = lock(&self.slots[slot]);
                let before = std::mem::replace(&mut s.installed, release.clone());
                s.previous = before;
            }
            last = phase.clone();
            self.report(slot, phase).await;
        }
        self.finish(slot, &last);
    }

    fn finish(&self, slot: usize, last: &Phase) {
        let counter = match last {
            Phase::Ready => &self.counters.ready,
            Phase::Canceled => &self.counters.canceled,
            _ => &self.counters.failed,
        };
        counter.fetch_add(1, Relaxed);
        {
            let mut s = lock(&self.slots[slot]);
            if !s.finished {
                s.finished = true;
                self.counters.finished_devices.fetch_add(1, Relaxed);
            }
        }
        let mut t = lock(&self.timeline);
        let now = Instant::now();
        t.in_progress = t.in_progress.saturating_sub(1);
        t.last_final = Some(now);
        if let Some(g) = t.groups.get_mut(self.group_of[slot]) {
            g.last_final = Some(now);
        }
    }

    /// Sends a read-only control request every `probe.every` on a connection of its own and
    /// times the answers: while the fleet registers, then during the rollout.
    async fn probe(self: Arc<Self>, probe: Probe, stop: CancellationToken) {
        let (client, mut events, _) = link::start(
            &self.opts.connection,
            &self.probe_client_id,
            100,
            stop.clone(),
        );
        let mut subscribed = false;
        let mut n = 0u64;
        let mut every = tokio::time::interval(probe.every);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                event = events.recv() => match event {
                    None => return,
                    Some(LinkEvent::Connected) => {
                        if let Err(e) = client.subscribe(&self.reply_topic, QoS::AtLeastOnce).await {
                            tracing::warn!("probe: cannot subscribe: {e}");
                        }
                        continue;
                    }
                    Some(LinkEvent::Subscribed) => {
                        subscribed = true;
                        continue;
                    }
                    Some(LinkEvent::Publish { topic, payload, .. }) => {
                        if topic == self.reply_topic {
                            self.on_reply(&payload);
                        }
                        continue;
                    }
                    Some(LinkEvent::Lost(reason)) => {
                        tracing::warn!("probe: MQTT connection lost: {reason}");
                        continue;
                    }
                },
                _ = every.tick(), if subscribed => {}
            }
            n += 1;
            let id = format!("fleetsim-probe-{n}");
            let request = ControlRequest::new(
                id.clone(),
                self.reply_topic.clone(),
                unix_now(),
                new_nonce(),
                Command::ListReleases {
                    page: Default::default(),
                },
            );
            let signed = SignedRequest::sign(&probe.key, &request);
            let payload = serde_json::to_vec(&signed).unwrap_or_default();
            {
                // During the rollout: from the first desired action until every online device
                // finished.
                let done = self.counters.finished_devices.load(Relaxed) >= self.online;
                let mut t = lock(&self.timeline);
                let when = match (t.first_desired.is_some(), done) {
                    (false, _) => ProbeWhen::Registering,
                    (true, false) => ProbeWhen::Rollout,
                    (true, true) => ProbeWhen::After,
                };
                t.probe_pending.insert(id, (Instant::now(), when));
            }
            if let Err(e) = client
                .publish(
                    self.topics.control_request(),
                    QoS::AtLeastOnce,
                    false,
                    payload,
                )
                .await
            {
                tracing::warn!("cannot queue a control probe: {e}");
            }
        }
    }

    fn on_reply(&self, payload: &[u8]) {
        let Ok(reply) = serde_json::from_slice::<ControlReply>(payload) else {
            tracing::warn!("ignoring a malformed control reply");
            return;
        };
        if !reply.ok {
            tracing::warn!(error = ?reply.error, "control probe refused");
        }
        let mut t = lock(&self.timeline);
        if let Some((sent, when)) = t.probe_pending.remove(&reply.id) {
            let took = ms(sent.elapsed());
            match when {
                ProbeWhen::Registering => t.probe_registering_ms.push(took),
                ProbeWhen::Rollout => t.probe_rollout_ms.push(took),
                ProbeWhen::After => {}
            }
        }
    }

    fn progress_line(&self, started: Instant) -> String {
        let c = &self.counters;
        format!(
            "fleetsim {:>7.1}s: {} desired, {} ready, {} failed, {} in progress, {}/{} online devices done, {} published, {} acked, {} refused, {} duplicates, {} connections lost",
            started.elapsed().as_secs_f64(),
            c.desired.load(Relaxed),
            c.ready.load(Relaxed),
            c.failed.load(Relaxed),
            lock(&self.timeline).in_progress,
            c.finished_devices.load(Relaxed),
            self.online,
            c.published.load(Relaxed),
            self.link.acked.load(Relaxed),
            c.refused.load(Relaxed),
            c.duplicates.load(Relaxed),
            self.link.lost.load(Relaxed),
        )
    }

    fn summary(&self) -> Summary {
        let c = &self.counters;
        let mut guard = lock(&self.timeline);
        let t = &mut *guard;
        let span = match (t.first_desired, t.last_final) {
            (Some(a), Some(b)) if b > a => Some(b - a),
            _ => None,
        };
        let desired = c.desired.load(Relaxed);
        // A transition: the last final report of a group to the next group's first desired
        // action. Desired actions per second: over each group's span, first to last, summed.
        let mut transitions_ms: Vec<f64> = t
            .groups
            .windows(2)
            .filter_map(|w| match (w[0].last_final, w[1].first_desired) {
                (Some(done), Some(next)) => Some(ms(next.saturating_duration_since(done))),
                _ => None,
            })
            .collect();
        let (burst_n, burst_time) = t
            .groups
            .iter()
            .filter_map(|g| match (g.first_desired, g.last_desired) {
                (Some(a), Some(b)) if g.desired > 1 && b > a => Some((g.desired, b - a)),
                _ => None,
            })
            .fold((0, Duration::ZERO), |(n, d), (bn, bd)| (n + bn, d + bd));
        let downloads = self.fetcher.as_ref().map_or((0, 0, 0), Fetcher::totals);
        for v in [
            &mut transitions_ms,
            &mut t.probe_registering_ms,
            &mut t.probe_rollout_ms,
        ] {
            v.sort_by(f64::total_cmp);
        }
        Summary {
            devices: self.slots.len() as u64,
            online: self.online,
            desired,
            desired_duplicates: c.duplicates.load(Relaxed),
            refused: c.refused.load(Relaxed),
            ready: c.ready.load(Relaxed),
            failed: c.failed.load(Relaxed),
            canceled: c.canceled.load(Relaxed),
            finished_devices: c.finished_devices.load(Relaxed),
            reports: c.reports.load(Relaxed),
            states: c.states.load(Relaxed),
            published: c.published.load(Relaxed),
            acked: self.link.acked.load(Relaxed),
            connections_lost: self.link.lost.load(Relaxed),
            rollout_s: span.map(|s| s.as_secs_f64()),
            desired_per_s: (!burst_time.is_zero())
                .then(|| burst_n as f64 / burst_time.as_secs_f64()),
            transitions: transitions_ms.len(),
            transition_p50_ms: percentile(&transitions_ms, 50.0),
            transition_p99_ms: percentile(&transitions_ms, 99.0),
            transition_max_ms: transitions_ms.last().copied(),
            probe_registering: t.probe_registering_ms.len(),
            probe_registering_p50_ms: percentile(&t.probe_registering_ms, 50.0),
            probe_registering_p99_ms: percentile(&t.probe_registering_ms, 99.0),
            probe_rollout: t.probe_rollout_ms.len(),
            probe_rollout_p50_ms: percentile(&t.probe_rollout_ms, 50.0),
            probe_rollout_p99_ms: percentile(&t.probe_rollout_ms, 99.0),
            probe_unanswered: t
                .probe_pending
                .values()
                .filter(|(_, when)| *when != ProbeWhen::After)
                .count(),
            signed_ahead: c.signed_ahead.load(Relaxed),
            nonces_prepared: self.nonces.len() as u64,
            cpu_s: own_cpu_s(),
            download_mqtt_bytes: downloads.0,
            download_http_bytes: downloads.1,
            download_failed: downloads.2,
        }
    }
}
