//! The agent daemon: ties the store, the trust checks, the MQTT link and the state machine
//! together.
//!
//! One loop owns the decisions: it reads [`LinkEvent`]s, verifies desired actions, starts one
//! action task at a time (the state machine), routes block replies to it, and removes reports
//! from the outbox when the broker acknowledges them. On every (re)connect it subscribes,
//! publishes the retained device state and re-sends the outbox; the retained desired action
//! then arrives and is reconciled (a known action id only re-reports its phase). It sends the
//! state again every `[broker] state_refresh` ([`crate::refresh`]), so one the broker lost is
//! back within that. An action found unfinished in the store goes on only once it verifies
//! again ([`crate::resume`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use flotilla_protocol::{ActionBody, DesiredAction, DeviceId, SignedBlob, SigningKey};
use flotilla_targets::{
    AbTarget, FileTarget, MenderModuleTarget, RaucTarget, ScriptTarget, SwupdateTarget,
    TargetError, UpdateTarget,
};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ConfigError, TargetKind};
use crate::consent;
use crate::env::{self, ActionIo, Env};
use crate::error::AgentError;
use crate::fetch::{FetchInput, FetchRequest};
use crate::held::{self, Held};
use crate::identity;
use crate::link::{self, LinkEvent, Outgoing};
use crate::machine;
use crate::peer_serve;
use crate::record::{ActionRecord, State};
use crate::resume;
use crate::trust::{self, Refusal};

/// Builds the configured update targets, by name. The configuration was validated, so this
/// only fails if a target refuses settings that validation let through.
pub fn build_targets(
    config: &Config,
) -> Result<HashMap<String, Arc<dyn UpdateTarget>>, ConfigError> {
    let mut targets = HashMap::new();
    for (i, t) in config.targets.iter().enumerate() {
        let refused = |e: TargetError| ConfigError::Invalid {
            field: format!("target[{i}]"),
            reason: e.to_string(),
        };
        let target: Arc<dyn UpdateTarget> = match &t.kind {
            TargetKind::File { path } => Arc::new(FileTarget::new(path.clone())),
            TargetKind::Ab(ab) => Arc::new(AbTarget::new(ab.clone()).map_err(refused)?),
            TargetKind::Script(script) => {
                Arc::new(ScriptTarget::new(script.clone()).map_err(refused)?)
            }
            TargetKind::MenderModule(module) => {
                Arc::new(MenderModuleTarget::new(module.clone()).map_err(refused)?)
            }
            TargetKind::Swupdate(swu) => {
                Arc::new(SwupdateTarget::new(swu.clone()).map_err(refused)?)
            }
            TargetKind::Rauc(rauc) => Arc::new(RaucTarget::new(rauc.clone()).map_err(refused)?),
        };
        targets.insert(t.name.clone(), target);
    }
    Ok(targets)
}

struct Running {
    action_id: String,
    cancel: CancellationToken,
    inputs: mpsc::Sender<FetchInput>,
    task: JoinHandle<ActionRecord>,
}

/// Runs the agent until `shutdown` is cancelled.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), AgentError> {
    let (store, trust_state, note) = crate::store::open_data_dir(&config)?;
    if let Some(note) = &note {
        tracing::error!("{note}");
        store.set_last_error(note)?;
    }
    trust::write_trust_file(&config.data_dir, &trust_state).map_err(|source| {
        AgentError::WriteTrustFile {
            path: trust::trust_file(&config.data_dir),
            source,
        }
    })?;
    store.set_trust(&trust_state)?;

    let targets = build_targets(&config)?;
    // Default target state directories live in `<data_dir>/targets/`; the targets create
    // their own directory but need its parent.
    let targets_dir = config.data_dir.join("targets");
    std::fs::create_dir_all(&targets_dir).map_err(|source| AgentError::CreateDataDir {
        path: targets_dir,
        source,
    })?;
    let link_shutdown = CancellationToken::new();
    let key = identity::load_or_create(&config.data_dir)?;
    let peers = peer_serve::inbox(&config.peers);
    let (link, mut events) = link::start_with(
        &config,
        link::Signer::new(&config, key),
        peers.as_ref().map(|(inbox, _)| inbox.clone()),
        link_shutdown.clone(),
    );
    // Once stopping, nothing waits for room in the link: a broker that takes nothing must not
    // hold up the stop (what is not sent is in the outbox, or sent afresh after the restart).
    let link = link.stop_waiting_on(shutdown.clone());
    let env = Arc::new(Env {
        targets,
        config: Arc::new(config),
        store,
        link,
        trust: Mutex::new(trust_state),
    });
    let mut serving = None;
    if let Some((_, requests)) = peers {
        let server = peer_serve::PeerServer::new(
            env.config.device_id.clone(),
            Held::new(env::downloads_dir(&env.config)),
            env.clone(),
        );
        serving = Some(peer_serve::start(
            Arc::new(server),
            &env.config.peers,
            requests,
            env.link.clone(),
            link_shutdown.clone(),
        ));
    }
    tracing::info!(device = %env.config.device_id, "agent started");
    env.write_status_file();
    // systemd (Type=notify, WatchdogSec): ready once the store is open and the link started;
    // the watchdog is pinged from the loop below, so a loop that hangs gets the agent restarted.
    let notifier = crate::notify::Notifier::from_env();
    let mut watchdog = crate::notify::watchdog_ticks(&notifier);

    let mut running: Option<Running> = None;
    // Finished action tasks send their final record here.
    let (done_tx, mut done_rx) = mpsc::channel::<ActionRecord>(4);
    let mut pending: Option<SignedBlob> = None;
    // A damaged database was moved aside: the first action reconciled from the retained desired
    // action carries the note to the coordinator.
    let mut recovered = note;
    // Resume an action interrupted by a crash or restart, once it verifies again.
    match env.store.current() {
        Ok(Some(record)) if !record.state.is_terminal() => {
            running = resume(&env, record, &shutdown, &done_tx).await?;
        }
        Ok(_) => {}
        Err(e) => {
            let note = format!("{e}; the action it describes was not resumed");
            tracing::error!("{note}");
            if let Err(e) = env.store.set_last_error(&note) {
                tracing::warn!("{e}");
            }
            recovered.get_or_insert(note);
        }
    }

    notifier.ready();
    // The state goes out again every `refresh` (never when it is off; the timer then never fires).
    let refresh = env
        .config
        .broker
        .state_refresh
        .map(|every| crate::refresh::period(env.config.device_id.as_str(), every));
    let refresh_on = refresh.is_some();
    let refresh = refresh.unwrap_or(std::time::Duration::from_secs(365 * 24 * 3600));
    let next_refresh = tokio::time::sleep(refresh);
    tokio::pin!(next_refresh);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = watchdog.tick() => notifier.watchdog(),
            _ = &mut next_refresh, if refresh_on => {
                tracing::debug!("sending the state again (state_refresh)");
                env.link.send(Outgoing::State(env.device_state(true))).await;
                next_refresh.as_mut().reset(tokio::time::Instant::now() + refresh);
            }
            Some(record) = done_rx.recv() => {
                if running.as_ref().is_some_and(|r| r.action_id == record.action_id) {
                    running = None;
                }
                if running.is_none() {
                    keep_downloads(&env.config);
                }
                tracing::info!(action = record.action_id, phase = ?record.phase(), "action finished");
                if let Some(blob) = pending.take() {
                    handle_desired(&env, blob, &mut running, &mut pending, &mut recovered, &shutdown, &done_tx).await;
                }
            }
            event = events.recv() => match event {
                None => break,
                Some(LinkEvent::Connected) => {
                    env.link.send(Outgoing::Subscribe).await;
                    env.link.send(Outgoing::State(env.device_state(true))).await;
                    // The state just went out: the next refresh is a whole period away.
                    next_refresh.as_mut().reset(tokio::time::Instant::now() + refresh);
                    for report in env.store.outbox() {
                        env.link.send(env.outgoing_report(report)).await;
                    }
                    if let Some(r) = &running {
                        let _ = r.inputs.try_send(FetchInput::Reconnected);
                    }
                }
                Some(LinkEvent::Desired(blob)) => handle_desired(&env, blob, &mut running, &mut pending, &mut recovered, &shutdown, &done_tx).await,
                Some(LinkEvent::Block(reply)) => {
                    if let Some(r) = &running {
                        // A full queue drops the block; the fetcher asks again.
                        let _ = r.inputs.try_send(FetchInput::Reply(reply));
                    }
                }
                Some(LinkEvent::PeerBlock { peer, reply }) => {
                    if let Some(r) = &running {
                        let _ = r.inputs.try_send(FetchInput::PeerReply { peer, reply });
                    }
                }
                Some(LinkEvent::ReportAcked(seq)) => {
                    if let Err(e) = env.store.outbox_remove(seq) {
                        tracing::warn!("{e}");
                    }
                }
            }
        }
    }

    tracing::info!("shutting down");
    notifier.stopping();
    if let Some(r) = running.take() {
        // The action task sees the shutdown token and stops at a safe point (never inside a
        // target step, which runs to completion on the blocking pool).
        let _ = r.task.await;
    }
    env.link
        .send(Outgoing::State(env.device_state(false)))
        .await;
    // Wait (briefly) for the broker to acknowledge the reports still in flight, so they are not
    // all sent again after the restart, and for the offline state to go out; the outbox and
    // the last will cover whatever does not make it.
    let grace = tokio::time::sleep(std::time::Duration::from_secs(1));
    tokio::pin!(grace);
    let mut outbox_left = env.store.outbox().len();
    while outbox_left > 0 {
        tokio::select! {
            _ = &mut grace => break,
            event = events.recv() => match event {
                Some(LinkEvent::ReportAcked(seq)) => {
                    let _ = env.store.outbox_remove(seq);
                    outbox_left = env.store.outbox().len();
                }
                Some(_) => {}
                None => break,
            },
        }
    }
    tokio::select! {
        _ = &mut grace => {}
        _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => {}
    }
    if let Err(e) = env.store.clear_restarts() {
        tracing::warn!("{e}");
    }
    let _ = env.store.flush();
    link_shutdown.cancel();
    // The peer server holds the agent's state; it ends before `run` returns.
    if let Some(serving) = serving {
        let _ = serving.await;
    }
    Ok(())
}

/// Resumes a stored, unfinished action once it verifies again (`resume.rs`). One that does not
/// is ended as Failed with the reason and reported, and no target is touched: its record may be
/// older than what the device runs.
async fn resume(
    env: &Arc<Env>,
    mut record: ActionRecord,
    shutdown: &CancellationToken,
    done: &mpsc::Sender<ActionRecord>,
) -> Result<Option<Running>, AgentError> {
    let checked = resume::check_stored(
        &record,
        &env.config,
        &env.trust_state(),
        trust::system_now(),
    );
    if let Err(Refusal(reason)) = checked {
        tracing::error!(action = record.action_id, "{reason}");
        record.state = State::Failed {
            reason,
            rolled_back: false,
        };
        // Reported even when it cannot be recorded (a full disk): the coordinator learns why.
        let _ = env.persist(&record);
        env.report(&record).await;
        consent::clear(&env.config.data_dir, &record.action_id);
        return Ok(None);
    }
    // Only unclean stops count (a clean shutdown clears the count), and waiting for consent or
    // a time window over many reboots is no crash loop.
    let restarts = if matches!(record.state, State::Waiting { .. }) {
        0
    } else {
        env.store.count_restart(&record)?
    };
    if restarts >= env.config.store.max_restarts {
        let record = machine::give_up(env, record, restarts).await;
        // Rolled back, and the old content is live only after a reboot: drive that.
        return Ok((!record.state.is_terminal())
            .then(|| spawn(env.clone(), record, false, shutdown.clone(), done.clone())));
    }
    tracing::info!(action = record.action_id, state = ?record.state, restarts, "resuming");
    Ok(Some(spawn(
        env.clone(),
        record,
        true,
        shutdown.clone(),
        done.clone(),
    )))
}

fn spawn(
    env: Arc<Env>,
    record: ActionRecord,
    resumed: bool,
    shutdown: CancellationToken,
    done: mpsc::Sender<ActionRecord>,
) -> Running {
    let cancel = CancellationToken::new();
    let (inputs_tx, inputs_rx) = mpsc::channel(256);
    let (req_tx, mut req_rx) = mpsc::channel(64);
    let link = env.link.clone();
    tokio::spawn(async move {
        while let Some(request) = req_rx.recv().await {
            let outgoing = match request {
                FetchRequest::Coordinator(request) => Outgoing::Fetch(request),
                FetchRequest::Peer { peer, fetch } => match DeviceId::new(&peer) {
                    Ok(peer) => Outgoing::PeerFetch { peer, fetch },
                    Err(e) => {
                        // The fetcher bypasses a peer that never answers.
                        tracing::warn!("cannot ask peer {peer:?}: {e}");
                        continue;
                    }
                },
            };
            link.send(outgoing).await;
        }
    });
    let mut io = ActionIo {
        fetch_requests: req_tx,
        fetch_inputs: inputs_rx,
        cancel: cancel.clone(),
        shutdown,
    };
    let action_id = record.action_id.clone();
    let task = tokio::spawn(async move {
        let record = machine::drive(&env, record, &mut io, resumed).await;
        let still_running = !record.state.is_terminal();
        // Only a finished action is announced; one stopped by shutdown resumes after restart.
        if !still_running {
            let _ = done.send(record.clone()).await;
        }
        record
    });
    Running {
        action_id,
        cancel,
        inputs: inputs_tx,
        task,
    }
}

/// Desired messages that failed authentication: counted, and logged at most once a minute so a
/// flood of forgeries cannot flood the log.
struct Unverified {
    count: AtomicU64,
    /// Unix seconds of the last log line.
    logged_at: AtomicU64,
}

static UNVERIFIED: Unverified = Unverified {
    count: AtomicU64::new(0),
    logged_at: AtomicU64::new(0),
};

impl Unverified {
    fn note(&self, reason: &str) {
        let count = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        let now = trust::system_now();
        let last = self.logged_at.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= 60
            && self
                .logged_at
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                unverified_total = count,
                "ignoring a desired action that fails authentication: {reason} \
                 ({count} so far; next line in a minute at the earliest)"
            );
        }
    }
}

/// Verifies and reconciles one desired action.
async fn handle_desired(
    env: &Arc<Env>,
    blob: SignedBlob,
    running: &mut Option<Running>,
    pending: &mut Option<SignedBlob>,
    recovered: &mut Option<String>,
    shutdown: &CancellationToken,
    done: &mpsc::Sender<ActionRecord>,
) {
    let config = &env.config;
    let keys = env.trust_state().ring(&config.trust);
    let action = match trust::verify_desired(&blob, &keys.coordinator_keys) {
        Ok(action) => action,
        Err(Refusal(reason)) => {
            // Neither persisted nor reported under the action id it claims: anyone on the broker
            // can publish here, and a refusal reported for a real action id would fail that
            // action on the coordinator while the device is fine. Logged, at most once a minute.
            UNVERIFIED.note(&reason);
            return;
        }
    };

    // A known action id is never applied again; only its phase is re-reported. An unfinished
    // one that is not running (its record and the current action's were not written together)
    // goes on once it verifies again, as at start.
    let damaged = match env.store.action(&action.action_id) {
        Ok(Some(record)) => {
            if running.is_none() && !record.state.is_terminal() {
                match resume(env, record, shutdown, done).await {
                    Ok(resumed) => *running = resumed,
                    Err(e) => tracing::error!("{e}"),
                }
            } else if running
                .as_ref()
                .is_none_or(|r| r.action_id != record.action_id)
            {
                env.report(&record).await;
            }
            return;
        }
        Ok(None) => None,
        // Treated as a record lost with a damaged database: see `recovered` below.
        Err(e) => {
            tracing::error!("{e}");
            Some(format!("{e}"))
        }
    };

    // "Nothing to do" and cancels are never stored, but they count in the per-device order: once
    // accepted, every action issued before them is a replay (a captured install re-published
    // after `rollout stop` is older than the stop's cancel, decision 0011).
    if matches!(action.body, ActionBody::Nothing | ActionBody::Cancel { .. }) {
        let checked = trust::check_timely(&action, config, &env.trust_state(), trust::system_now());
        if let Err(Refusal(reason)) = checked {
            tracing::debug!(action = %action.action_id, "ignoring desired action: {reason}");
            return;
        }
        env.advance_trusted_time(action.issued_at);
    }

    match &action.body {
        ActionBody::Nothing => {
            tracing::debug!("nothing to do");
            return;
        }
        ActionBody::Cancel { action_id } => {
            match running {
                Some(r) if &r.action_id == action_id => {
                    tracing::info!(action = action_id, "cancel requested");
                    r.cancel.cancel();
                }
                _ => tracing::info!(
                    action = action_id,
                    "cancel for an action that is not running; ignored"
                ),
            }
            return;
        }
        _ => {}
    }

    let system = trust::system_now();
    let mut record = match trust::check_all(&blob, config, &env.trust_state(), system) {
        Err(Refusal(reason)) => refused_record(action, &blob, reason),
        Ok((action, manifest)) => {
            env.advance_trusted_time(action.issued_at);
            ActionRecord {
                action_id: action.action_id.clone(),
                rollout_id: action.rollout_id.clone(),
                state: State::Accepted,
                manifest,
                action,
                signed: Some(blob.clone()),
            }
        }
    };
    if let Some(note) = damaged.or_else(|| recovered.take()) {
        // The records of this action went with a damaged database, or its own is damaged. If
        // it cannot be applied now (typically: its release is already installed, says the
        // trust file), say why in a failure the coordinator sees; otherwise it starts again
        // from the beginning.
        if let State::Refused { reason } = &record.state {
            record.state = State::Failed {
                reason: format!("{note}; this action cannot be resumed: {reason}"),
                rolled_back: false,
            };
        } else {
            tracing::warn!(
                action = record.action_id,
                "{note}; starting this action again from the beginning"
            );
        }
    }
    if let State::Refused { reason } = &record.state {
        tracing::warn!(action = record.action_id, "refused: {reason}");
    } else if let Some(r) = running {
        // One action at a time: a newer one supersedes a running one that has not switched
        // over yet, and waits for one that has. It is checked again when its turn comes (the
        // installed counter may have moved), so nothing about it is persisted yet.
        tracing::info!(
            running = r.action_id,
            new = record.action_id,
            "new action waits for the running one"
        );
        r.cancel.cancel();
        *pending = Some(blob);
        return;
    }
    if running.is_some() {
        if let Err(e) = env.store.save_action_aside(&record) {
            tracing::error!("{e}");
        }
    } else if let Err(e) = env.persist(&record) {
        // Never act on an action that could not be recorded (a full disk).
        record.state = State::Failed {
            reason: format!("cannot record the action: {e}; it was not started"),
            rolled_back: false,
        };
    }
    env.report(&record).await;
    if !record.state.is_terminal() {
        *running = Some(spawn(
            env.clone(),
            record,
            false,
            shutdown.clone(),
            done.clone(),
        ));
    }
}

/// Bounds the verified downloads kept (to serve to peers and to copy blocks from) once no
/// action uses them.
fn keep_downloads(config: &Config) {
    let pruned = held::prune(&env::downloads_dir(config), config.peers.keep_bytes);
    if !pruned.artifacts.is_empty() {
        tracing::info!(
            artifacts = pruned.artifacts.len(),
            bytes = pruned.bytes,
            keep_bytes = config.peers.keep_bytes,
            "removed the oldest verified downloads"
        );
    }
}

fn refused_record(action: DesiredAction, blob: &SignedBlob, reason: String) -> ActionRecord {
    ActionRecord {
        action_id: action.action_id.clone(),
        rollout_id: action.rollout_id.clone(),
        state: State::Refused { reason },
        manifest: None,
        action,
        signed: Some(blob.clone()),
    }
}

/// The retained payload the agent publishes as its last will, signed with `key` (for tests and
/// tools).
pub fn last_will_payload(config: &Config, key: SigningKey) -> Vec<u8> {
    link::Signer::new(config, key).state(link::offline_state(config))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use flotilla_protocol::{
        envelope, ActionKind, Artifact, Message, Phase, ReleaseManifest, Topics,
    };
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;
    use crate::store::{Store, StoreError};
    use crate::trust::tests::key;

    /// Just enough of an MQTT broker for one agent: it accepts the connection, answers
    /// subscriptions and pings, delivers `desired` on the agent's desired topic, counts the
    /// reports published to it and acknowledges them if `acks`; and it goes away, connection
    /// and listener, when `gone` is cancelled.
    struct FakeBroker {
        port: u16,
        reports: Arc<AtomicUsize>,
        heard: Arc<tokio::sync::Notify>,
        gone: CancellationToken,
    }

    impl FakeBroker {
        async fn start(desired: Vec<u8>, desired_topic: String, acks: bool) -> FakeBroker {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("listen");
            let broker = FakeBroker {
                port: listener.local_addr().expect("address").port(),
                reports: Arc::new(AtomicUsize::new(0)),
                heard: Arc::new(tokio::sync::Notify::new()),
                gone: CancellationToken::new(),
            };
            let (reports, heard, gone) = (
                broker.reports.clone(),
                broker.heard.clone(),
                broker.gone.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let socket = tokio::select! {
                        _ = gone.cancelled() => return,
                        accepted = listener.accept() => match accepted {
                            Ok((socket, _)) => socket,
                            Err(_) => return,
                        },
                    };
                    let serve = serve(
                        socket,
                        desired.clone(),
                        desired_topic.clone(),
                        acks,
                        reports.clone(),
                        heard.clone(),
                    );
                    let gone = gone.clone();
                    tokio::spawn(async move {
                        tokio::select! {
                            _ = gone.cancelled() => {}
                            _ = serve => {}
                        }
                    });
                }
            });
            broker
        }

        /// Waits until the agent published `n` reports in all.
        async fn wait_for_reports(&self, n: usize) {
            tokio::time::timeout(Duration::from_secs(60), async {
                while self.reports.load(Ordering::SeqCst) < n {
                    self.heard.notified().await;
                }
            })
            .await
            .expect("the agent's reports reach the broker");
        }
    }

    /// An MQTT packet: fixed header byte and remaining length, then `body`.
    fn packet(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut out = vec![kind];
        let mut len = body.len();
        loop {
            let byte = (len % 128) as u8;
            len /= 128;
            out.push(if len > 0 { byte | 0x80 } else { byte });
            if len == 0 {
                break;
            }
        }
        out.extend_from_slice(body);
        out
    }

    async fn serve(
        mut socket: TcpStream,
        desired: Vec<u8>,
        desired_topic: String,
        acks: bool,
        reports: Arc<AtomicUsize>,
        heard: Arc<tokio::sync::Notify>,
    ) {
        loop {
            let Ok(kind) = socket.read_u8().await else {
                return;
            };
            let mut len = 0usize;
            for shift in [0, 7, 14, 21] {
                let Ok(b) = socket.read_u8().await else {
                    return;
                };
                len |= usize::from(b & 0x7f) << shift;
                if b & 0x80 == 0 {
                    break;
                }
            }
            let mut body = vec![0; len];
            if socket.read_exact(&mut body).await.is_err() {
                return;
            }
            let mut answer = Vec::new();
            match kind >> 4 {
                // CONNECT: accepted.
                1 => answer = packet(0x20, &[0, 0]),
                // PUBLISH (QoS 1 from the agent): a report counts; acknowledged if `acks`.
                3 if len >= 2 => {
                    let topic_len = usize::from(u16::from_be_bytes([body[0], body[1]]));
                    let topic = body.get(2..2 + topic_len).unwrap_or_default();
                    if topic.ends_with(b"/report") {
                        reports.fetch_add(1, Ordering::SeqCst);
                        heard.notify_waiters();
                    }
                    if let (true, Some(pkid)) = (acks, body.get(2 + topic_len..4 + topic_len)) {
                        answer = packet(0x40, pkid);
                    }
                }
                // SUBSCRIBE: granted; the desired action follows its own topic's subscription,
                // as a retained message would.
                8 if len >= 2 => {
                    answer = packet(0x90, &[body[0], body[1], 1]);
                    let filter_len = usize::from(u16::from_be_bytes([
                        body.get(2).copied().unwrap_or(0),
                        body.get(3).copied().unwrap_or(0),
                    ]));
                    if body.get(4..4 + filter_len) == Some(desired_topic.as_bytes()) {
                        let mut publish = (desired_topic.len() as u16).to_be_bytes().to_vec();
                        publish.extend_from_slice(desired_topic.as_bytes());
                        publish.extend_from_slice(&desired);
                        answer.extend(packet(0x31, &publish));
                    }
                }
                // PINGREQ.
                12 => answer = packet(0xd0, &[]),
                _ => {}
            }
            if socket.write_all(&answer).await.is_err() {
                return;
            }
        }
    }

    /// An agent config for the broker at `port` on 127.0.0.1, keeping its data in `dir`, and
    /// the retained desired message that broker delivers: a soft install of 1 MiB, which waits
    /// for local consent.
    fn agent_and_action(dir: &std::path::Path) -> (Config, Vec<u8>, String) {
        let mut config = crate::trust::tests::config();
        config.data_dir = dir.join("data");
        config.targets[0].kind = TargetKind::File {
            path: dir.join("app.bin"),
        };
        config.broker.host = "127.0.0.1".into();
        let bytes = vec![7u8; 1 << 20];
        let now = trust::system_now();
        let manifest = ReleaseManifest {
            name: "app-2".into(),
            version: "2.0".into(),
            counter: 2,
            hardware: vec!["pi4".into()],
            artifacts: vec![Artifact {
                name: "app.bin".into(),
                target: "app".into(),
                size: bytes.len() as u64,
                sha256: flotilla_protocol::sha256(&bytes),
            }],
            created_at: now,
            expires_at: now + 86_400,
        };
        let action = DesiredAction {
            action_id: "act-1".into(),
            device_id: config.device_id.to_string(),
            rollout_id: "r1".into(),
            issued_at: now,
            expires_at: now + 86_400,
            body: ActionBody::Install {
                manifest: SignedBlob::sign(&key(1), envelope::to_bytes(&manifest)),
                kind: ActionKind::Soft,
                window: None,
            },
        };
        let blob = SignedBlob::sign(&key(2), envelope::to_bytes(&action));
        let topic = Topics::new(&config.broker.topic_root).desired(&config.device_id);
        (config, envelope::encode(&Message::Desired(blob)), topic)
    }

    /// Opens the agent's store once the stopped agent's background threads let go of it.
    fn reopen(config: &Config) -> Store {
        for _ in 0..500 {
            match Store::open(&config.data_dir, 1 << 20, 0) {
                Ok((store, _)) => return store,
                Err(StoreError::Locked { .. }) => {
                    std::thread::sleep(std::time::Duration::from_millis(10))
                }
                Err(e) => panic!("{e}"),
            }
        }
        panic!("the store stayed locked after the agent stopped");
    }

    /// Runs the agent until the broker has its two reports (accepted, waiting), calls `then`,
    /// runs it for an hour more, gives consent (the download starts at 0 bytes), runs it for
    /// five hours more, then stops it: it must stop within 5 s, keep the report it could not
    /// send for later, and leave the download to resume.
    async fn six_hours_then_stop(config: Config, broker: &FakeBroker, then: impl FnOnce()) {
        let shutdown = CancellationToken::new();
        let agent = tokio::spawn(run(config.clone(), shutdown.clone()));
        broker.wait_for_reports(2).await;
        then();
        tokio::time::sleep(Duration::from_secs(3600)).await;
        crate::consent::give(&config.data_dir, "act-1", trust::system_now()).expect("consent");
        tokio::time::sleep(Duration::from_secs(5 * 3600)).await;
        shutdown.cancel();
        let stopped = tokio::time::timeout(Duration::from_secs(5), agent)
            .await
            .expect("the agent did not stop within 5 s of shutdown");
        stopped.expect("the agent task").expect("a clean stop");

        let store = reopen(&config);
        let current = store.current().expect("read").expect("the action");
        assert!(
            matches!(
                current.state,
                State::Downloading {
                    artifact: 0,
                    done: 0
                }
            ),
            "resumes the download after the restart: {:?}",
            current.state
        );
        let outbox = store.outbox();
        assert!(
            outbox
                .iter()
                .any(|r| r.action_id == "act-1"
                    && matches!(r.phase, Phase::Downloading { done: 0, .. })),
            "the report that could not go out is kept for later: {outbox:#?}"
        );
    }

    /// issue 19, item 11, in virtual time: an agent mid-download whose broker has been gone
    /// for hours stops within seconds. It used to hang: its block requests, asked again every
    /// 10 s, filled the link's queues within minutes (the MQTT client takes none while it is
    /// not connected), and shutdown waited on the fetcher, which waited for room.
    #[tokio::test(start_paused = true)]
    async fn shutdown_ends_the_agent_however_long_its_broker_has_been_gone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut config, desired, topic) = agent_and_action(dir.path());
        let broker = FakeBroker::start(desired, topic, true).await;
        config.broker.port = broker.port;
        let gone = broker.gone.clone();
        six_hours_then_stop(config, &broker, || gone.cancel()).await;
    }

    /// The same with a broker that stays connected and acknowledges nothing: the client's
    /// in-flight window fills, then the link's queues behind it.
    #[tokio::test(start_paused = true)]
    async fn shutdown_ends_the_agent_on_a_broker_that_acknowledges_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut config, desired, topic) = agent_and_action(dir.path());
        let broker = FakeBroker::start(desired, topic, false).await;
        config.broker.port = broker.port;
        six_hours_then_stop(config, &broker, || {}).await;
    }
}
