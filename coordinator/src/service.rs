//! `flotilla serve`: the coordinator service around the sans-I/O engine.
//!
//! One task owns the [`Engine`] and feeds it everything: device states and reports from MQTT,
//! control requests, a one-second tick, and a reissue after every (re)connect. It applies the
//! engine's effects strictly in order, and persistence comes first: a `Save` is written and
//! flushed to sled before any desired action it justifies is published, so after a crash the
//! store never claims less than what devices were told (ADR 0003). A failed save stops the
//! service rather than publish past what is stored.
//!
//! Everything else is plumbing: the optional embedded broker, the MQTT link (`mqtt.rs`), the
//! artifact block server, and signing desired actions with the coordinator key. A malformed
//! payload is logged with its topic and reason, counted, and skipped; it never stops the loop.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use flotilla_protocol::control::{Command, ControlReply, ControlRequest};
use flotilla_protocol::{
    envelope, ActionBody, ActionKind, DesiredAction, DeviceId, Message, SignedBlob,
};
use flotilla_protocol::{SigningKey, Topic, Topics};
use rumqttc::{AsyncClient, QoS};
use tokio_util::sync::CancellationToken;

use crate::artifacts::BlockServer;
use crate::broker::{BrokerError, EmbeddedBroker};
use crate::config::Config;
use crate::engine::{Effect, Engine, ReleaseRef};
use crate::keys::{self, KeysError};
use crate::mqtt::{self, LinkEvent, LinkOptions};
use crate::releases::ReleaseStore;
use crate::spec::RolloutSpec;
use crate::store::{Store, StoreError};

/// How often the engine's timers are evaluated.
const TICK: Duration = Duration::from_secs(1);

/// Why the service stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Broker(#[from] BrokerError),
    #[error("embedded broker start-up task failed: {reason}")]
    BrokerTask { reason: String },
    #[error("cannot load the coordinator key: {0}")]
    Key(#[from] KeysError),
    /// The store's own error already names the path.
    #[error("{source}")]
    OpenStore { path: PathBuf, source: StoreError },
    #[error("cannot load rollouts from {path}: {source}")]
    LoadRollouts { path: PathBuf, source: StoreError },
    #[error("cannot persist rollout {rollout}; stopping before publishing anything it would justify: {source}")]
    Save { rollout: String, source: StoreError },
    #[error("the MQTT link to {addr} stopped unexpectedly")]
    LinkClosed { addr: String },
}

/// Seconds since the Unix epoch.
fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Runs the coordinator until `shutdown` is cancelled.
pub async fn serve(config: Config, shutdown: CancellationToken) -> Result<(), ServiceError> {
    let _broker = match config.broker.embedded {
        // The broker start polls its port with blocking connects; keep that off the runtime.
        Some(addr) => Some(
            tokio::task::spawn_blocking(move || EmbeddedBroker::start(addr))
                .await
                .map_err(|e| ServiceError::BrokerTask {
                    reason: e.to_string(),
                })??,
        ),
        None => None,
    };
    let key = keys::load_secret_key(&config.coordinator_key)?;
    let db = config.data_dir.join("db");
    let store = Store::open(&db).map_err(|source| ServiceError::OpenStore {
        path: db.clone(),
        source,
    })?;
    let rollouts = store
        .load_rollouts()
        .map_err(|source| ServiceError::LoadRollouts {
            path: db.clone(),
            source,
        })?;
    tracing::info!(rollouts = rollouts.len(), data_dir = %config.data_dir.display(), "coordinator starting");
    let engine = Engine::restore(rollouts);

    let topics = Topics::new(&config.broker.topic_root);
    // The link gets its own token: on shutdown the final effects must still be published.
    let link_token = CancellationToken::new();
    let (host, port) = config.connect_to();
    let options = LinkOptions::new(
        &host,
        port,
        "flotilla-coordinator",
        topics.coordinator_filters(),
    );
    let mut link = mqtt::start(options, link_token.clone());
    let releases = ReleaseStore::new(&config.data_dir);
    let mut service = Service {
        engine,
        store,
        key,
        blocks: BlockServer::new(releases.artifacts_dir()),
        releases,
        manifests: HashMap::new(),
        topics,
        client: link.client.clone(),
        validity: config.action_validity,
        addr: config.broker_addr(),
        malformed: 0,
    };

    let mut ticker = tokio::time::interval(TICK);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let result = loop {
        let step = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break Ok(()),
            event = link.events.recv() => match event {
                Some(event) => service.on_link_event(event).await,
                None => Err(ServiceError::LinkClosed { addr: service.addr.clone() }),
            },
            _ = ticker.tick() => {
                let effects = service.engine.tick(now());
                service.apply(effects).await
            }
        };
        if let Err(e) = step {
            break Err(e);
        }
    };
    if result.is_ok() {
        // Persist whatever per-device progress the last tick has not saved yet.
        let effects = service.engine.tick(now());
        service.apply(effects).await?;
    }
    link_token.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(2), link.task).await;
    tracing::info!(
        malformed_payloads = service.malformed,
        "coordinator stopped"
    );
    result
}

struct Service {
    engine: Engine,
    store: Store,
    key: SigningKey,
    releases: ReleaseStore,
    /// Signed manifests by release name. Release names are never reused, so a cached blob
    /// cannot go stale, and a group start does not re-read the file once per device.
    manifests: HashMap<String, SignedBlob>,
    blocks: BlockServer,
    topics: Topics,
    client: AsyncClient,
    validity: u64,
    addr: String,
    malformed: u64,
}

impl Service {
    fn reject(&mut self, topic: &str, reason: &str) {
        self.malformed += 1;
        tracing::warn!(%topic, %reason, malformed_total = self.malformed, "ignoring malformed payload");
    }

    async fn on_link_event(&mut self, event: LinkEvent) -> Result<(), ServiceError> {
        match event {
            LinkEvent::Connected => {
                // Retained desired actions may have been lost with a broker that restarted
                // without persistence; re-publishing them is idempotent.
                let effects = self.engine.reissue(now());
                self.apply(effects).await
            }
            LinkEvent::Subscribed | LinkEvent::Disconnected { .. } => Ok(()),
            LinkEvent::Publish { topic, payload } => self.on_publish(&topic, &payload).await,
        }
    }

    async fn on_publish(&mut self, topic: &str, payload: &[u8]) -> Result<(), ServiceError> {
        let Some(parsed) = self.topics.parse(topic) else {
            self.reject(topic, "not a flotilla topic");
            return Ok(());
        };
        let id = match &parsed {
            Topic::ControlRequest => return self.on_control(topic, payload).await,
            Topic::State(id) | Topic::Report(id) | Topic::Fetch(id) => id.clone(),
            // Not subscribed to; a broker that forwards it anyway is not worth an error.
            _ => return Ok(()),
        };
        // An empty retained payload is how a device's state gets cleared: not malformed.
        if payload.is_empty() && matches!(parsed, Topic::State(_)) {
            return Ok(());
        }
        let message = match envelope::decode(payload) {
            Ok(m) => m,
            Err(e) => {
                self.reject(topic, &e.to_string());
                return Ok(());
            }
        };
        let now = now();
        match (parsed, message) {
            (Topic::State(_), Message::State(state)) => {
                if state.device_id != id.as_str() {
                    let reason = format!(
                        "state claims device {:?} on device {id}'s topic",
                        state.device_id
                    );
                    self.reject(topic, &reason);
                    return Ok(());
                }
                let effects = self.engine.observe_state(state, now);
                self.apply(effects).await
            }
            (Topic::Report(_), Message::Report(report)) => {
                if report.device_id != id.as_str() {
                    let reason = format!(
                        "report claims device {:?} on device {id}'s topic",
                        report.device_id
                    );
                    self.reject(topic, &reason);
                    return Ok(());
                }
                let effects = self.engine.observe_report(report, now);
                self.apply(effects).await
            }
            (Topic::Fetch(_), Message::Fetch(request)) => {
                let reply = self.blocks.serve(&request);
                let bytes = envelope::encode(&Message::Block(reply));
                self.publish(self.topics.block(&id), false, bytes).await
            }
            (_, other) => {
                let reason = format!("unexpected {} on this topic", other.name());
                self.reject(topic, &reason);
                Ok(())
            }
        }
    }

    async fn on_control(&mut self, topic: &str, payload: &[u8]) -> Result<(), ServiceError> {
        let request: ControlRequest = match serde_json::from_slice(payload) {
            Ok(r) => r,
            Err(e) => {
                self.reject(
                    topic,
                    &format!("control request is not valid JSON for the control API: {e}"),
                );
                return Ok(());
            }
        };
        // Only reply on reply topics: a request must not make the coordinator publish on a
        // device's desired topic or anywhere else.
        if !matches!(
            self.topics.parse(&request.reply_to),
            Some(Topic::ControlReply(_))
        ) {
            let reason = format!(
                "reply_to {:?} is not a control reply topic",
                request.reply_to
            );
            self.reject(topic, &reason);
            return Ok(());
        }
        let reply = match self.command(request.command).await? {
            Ok(result) => ControlReply {
                id: request.id,
                ok: true,
                error: None,
                result,
            },
            Err(error) => ControlReply {
                id: request.id,
                ok: false,
                error: Some(error),
                result: serde_json::Value::Null,
            },
        };
        // A reply is plain data; serializing it cannot fail.
        let bytes = serde_json::to_vec(&reply).unwrap_or_default();
        self.publish(request.reply_to, false, bytes).await
    }

    /// Runs one control command. The outer error stops the service; the inner one is the
    /// operator's mistake and goes back in the reply.
    async fn command(
        &mut self,
        command: Command,
    ) -> Result<Result<serde_json::Value, String>, ServiceError> {
        let now = now();
        let (name, effects) = match command {
            Command::CreateRollout { spec } => {
                let spec = match RolloutSpec::from_toml(&spec) {
                    Ok(s) => s,
                    Err(e) => return Ok(Err(format!("invalid rollout spec: {e}"))),
                };
                let (blob, manifest) = match self.releases.load(&spec.release) {
                    Ok(r) => r,
                    Err(e) => return Ok(Err(e.to_string())),
                };
                self.manifests.insert(manifest.name.clone(), blob);
                let release = ReleaseRef {
                    name: manifest.name.clone(),
                    counter: manifest.counter,
                    hardware: manifest.hardware,
                };
                let name = spec.name.clone();
                (name, self.engine.create_rollout(spec, release, now))
            }
            Command::StartRollout { rollout } => {
                let r = self.engine.start(&rollout, now);
                (rollout, r)
            }
            Command::PauseRollout { rollout } => {
                let r = self.engine.pause(&rollout, now);
                (rollout, r)
            }
            Command::ResumeRollout { rollout } => {
                let r = self.engine.resume(&rollout, now);
                (rollout, r)
            }
            Command::StopRollout { rollout } => {
                let r = self.engine.stop(&rollout, now);
                (rollout, r)
            }
            Command::RolloutStatus {
                rollout: Some(name),
            } => {
                return Ok(match self.engine.status(&name) {
                    Some(status) => Ok(json(&status)),
                    None => Err(format!("no rollout named {name:?}")),
                })
            }
            Command::RolloutStatus { rollout: None } => {
                return Ok(Ok(json(&self.engine.statuses())))
            }
            Command::ListDevices => return Ok(Ok(json(&self.engine.devices()))),
            Command::ListReleases => {
                return Ok(self
                    .releases
                    .summaries()
                    .map(|s| json(&s))
                    .map_err(|e| e.to_string()))
            }
            other => return Ok(Err(format!("command {other:?} is not supported yet"))),
        };
        match effects {
            Ok(effects) => {
                self.apply(effects).await?;
                Ok(match self.engine.status(&name) {
                    Some(status) => Ok(json(&status)),
                    None => Err(format!("no rollout named {name:?}")),
                })
            }
            Err(e) => Ok(Err(e.to_string())),
        }
    }

    /// Applies effects in the engine's order. A failed save is fatal (see the module doc);
    /// a desired action that cannot be built is logged and skipped.
    async fn apply(&mut self, effects: Vec<Effect>) -> Result<(), ServiceError> {
        for effect in effects {
            match effect {
                Effect::Save(name) => {
                    if let Some(rollout) = self.engine.rollout(&name) {
                        self.store
                            .save_rollout(rollout)
                            .map_err(|source| ServiceError::Save {
                                rollout: name.clone(),
                                source,
                            })?;
                    }
                }
                Effect::Desired {
                    device,
                    action_id,
                    rollout,
                    release,
                    action,
                } => {
                    let Some(manifest) = self.manifest(&release) else {
                        continue;
                    };
                    let body = ActionBody::Install {
                        manifest,
                        kind: action_kind(action),
                        window: None,
                    };
                    self.publish_action(&device, action_id, rollout, body)
                        .await?;
                }
                Effect::Rollback { .. } | Effect::Approval(_) | Effect::Forget { .. } => {
                    tracing::warn!(?effect, "not handled yet");
                }
                Effect::Cancel {
                    device,
                    action_id,
                    rollout,
                } => {
                    let body = ActionBody::Cancel {
                        action_id: action_id.clone(),
                    };
                    self.publish_action(&device, action_id, rollout, body)
                        .await?;
                }
                Effect::Status(name) => {
                    if let Some(status) = self.engine.status(&name) {
                        let bytes = serde_json::to_vec(&status).unwrap_or_default();
                        self.publish(self.topics.rollout_event(&name), true, bytes)
                            .await?;
                    }
                }
                Effect::Trace(entry) => {
                    tracing::info!(rollout = %entry.rollout, "{}", entry.message);
                    let bytes = serde_json::to_vec(&entry).unwrap_or_default();
                    self.publish(self.topics.event_log(), false, bytes).await?;
                }
            }
        }
        Ok(())
    }

    /// The stored signed manifest of a release, cached.
    fn manifest(&mut self, release: &str) -> Option<SignedBlob> {
        if let Some(blob) = self.manifests.get(release) {
            return Some(blob.clone());
        }
        match self.releases.load(release) {
            Ok((blob, _)) => {
                self.manifests.insert(release.to_owned(), blob.clone());
                Some(blob)
            }
            Err(e) => {
                tracing::error!(%release, error = %e, "cannot publish desired actions: release unreadable");
                None
            }
        }
    }

    async fn publish_action(
        &mut self,
        device: &str,
        action_id: String,
        rollout_id: String,
        body: ActionBody,
    ) -> Result<(), ServiceError> {
        let Ok(id) = DeviceId::new(device) else {
            tracing::error!(%device, "engine produced an action for an invalid device id; skipped");
            return Ok(());
        };
        let now = now();
        let action = DesiredAction {
            action_id,
            device_id: device.to_owned(),
            rollout_id,
            issued_at: now,
            expires_at: now.saturating_add(self.validity),
            body,
        };
        let blob = SignedBlob::sign(&self.key, envelope::to_bytes(&action));
        let bytes = envelope::encode(&Message::Desired(blob));
        self.publish(self.topics.desired(&id), true, bytes).await
    }

    async fn publish(
        &self,
        topic: String,
        retain: bool,
        payload: Vec<u8>,
    ) -> Result<(), ServiceError> {
        self.client
            .publish(topic, QoS::AtLeastOnce, retain, payload)
            .await
            .map_err(|_| ServiceError::LinkClosed {
                addr: self.addr.clone(),
            })
    }
}

fn json<T: serde::Serialize>(value: &T) -> serde_json::Value {
    // The control types are plain data; converting them to a JSON value cannot fail.
    serde_json::to_value(value).unwrap_or(serde_json::Value::Null)
}

/// The protocol's action kind for a spec's action type.
fn action_kind(action: crate::plan::ActionType) -> ActionKind {
    use crate::plan::ActionType;
    match action {
        ActionType::Forced => ActionKind::Forced,
        ActionType::Soft => ActionKind::Soft,
        ActionType::DownloadOnly => ActionKind::DownloadOnly,
        ActionType::TimeForced { at } => ActionKind::TimeForced { at },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::ControlClient;
    use crate::config::BrokerConfig;
    use crate::releases::NewRelease;
    use flotilla_protocol::control::{DeviceSummary, RolloutStatus};
    use flotilla_protocol::{DeviceState, VerifyingKey};
    use rumqttc::{Event, EventLoop, MqttOptions, Packet};

    const WAIT: Duration = Duration::from_secs(20);

    struct Harness {
        _dir: tempfile::TempDir,
        config: Config,
        coordinator_pub: VerifyingKey,
        release_blob: SignedBlob,
    }

    fn free_addr() -> std::net::SocketAddr {
        std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
    }

    fn harness() -> Harness {
        let dir = tempfile::tempdir().expect("tempdir");
        let keys_dir = dir.path().join("keys");
        keys::keygen(&keys_dir, &[], false).expect("keygen");
        let data_dir = dir.path().join("data");
        let app = dir.path().join("app.bin");
        std::fs::write(&app, b"new firmware").expect("write");
        let release_key = keys::load_secret_key(&keys_dir.join("release.key")).expect("key");
        let releases = ReleaseStore::new(&data_dir);
        let new = NewRelease {
            name: "fw-1".into(),
            version: "1.0.0".into(),
            counter: 1,
            hardware: vec![],
            artifacts: vec![format!("app={}", app.display())],
            expires_in: 86_400,
        };
        releases.create(&new, &release_key, now()).expect("release");
        let (release_blob, _) = releases.load("fw-1").expect("load");
        let addr = free_addr();
        let config = Config {
            data_dir,
            coordinator_key: keys_dir.join("coordinator.key"),
            broker: BrokerConfig {
                host: "127.0.0.1".into(),
                port: addr.port(),
                topic_root: "flotilla".into(),
                embedded: Some(addr),
            },
            action_validity: 3600,
        };
        let coordinator_pub =
            keys::load_public_key(&keys_dir.join("coordinator.pub")).expect("pub");
        Harness {
            _dir: dir,
            config,
            coordinator_pub,
            release_blob,
        }
    }

    /// Sends a request, retrying while the coordinator is still subscribing (a request sent
    /// before its subscription is lost, by MQTT's design).
    async fn ask(
        client: &ControlClient,
        command: Command,
    ) -> Result<serde_json::Value, crate::client::ClientError> {
        for _ in 0..20 {
            match client
                .request(command.clone(), Duration::from_secs(1))
                .await
            {
                Err(crate::client::ClientError::NoReply { .. }) => continue,
                other => return other,
            }
        }
        client.request(command, Duration::from_secs(1)).await
    }

    fn device_client(port: u16) -> (AsyncClient, EventLoop) {
        let mut o = MqttOptions::new(mqtt::unique_client_id("fake-device"), "127.0.0.1", port);
        o.set_max_packet_size(1 << 20, 1 << 20);
        AsyncClient::new(o, 100)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn creates_and_starts_a_rollout_over_mqtt_and_survives_garbage() {
        let h = harness();
        let topics = Topics::default();
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve(h.config.clone(), shutdown.clone()));
        let port = h.config.broker.port;
        let client = ControlClient::connect("127.0.0.1", port, "flotilla")
            .await
            .expect("client connects");
        let releases = ask(&client, Command::ListReleases)
            .await
            .expect("coordinator answers");
        assert_eq!(releases[0]["name"], "fw-1");

        // A device announces itself (retained state), then garbage arrives on its topics and on
        // the control topic.
        let (device, mut device_el) = device_client(port);
        let id = DeviceId::new("dev-1").expect("id");
        let state = DeviceState {
            device_id: "dev-1".into(),
            hardware_id: "pi4".into(),
            labels: vec![("env".into(), "canary".into())],
            installed: None,
            current: None,
            online: true,
            agent_version: "test".into(),
            at: now(),
        };
        device
            .publish(
                topics.state(&id),
                QoS::AtLeastOnce,
                true,
                envelope::encode(&Message::State(state)),
            )
            .await
            .expect("queue");
        device
            .publish(
                topics.report(&id),
                QoS::AtLeastOnce,
                false,
                b"\xff\xfegarbage".to_vec(),
            )
            .await
            .expect("queue");
        device
            .publish(
                topics.control_request(),
                QoS::AtLeastOnce,
                false,
                b"{not json".to_vec(),
            )
            .await
            .expect("queue");
        device
            .subscribe(topics.desired(&id), QoS::AtLeastOnce)
            .await
            .expect("queue");
        // Drive the fake device's connection until the broker has its messages.
        let mut acks = 0;
        tokio::time::timeout(WAIT, async {
            while acks < 3 {
                if let Event::Incoming(Packet::PubAck(_)) =
                    device_el.poll().await.expect("device connection")
                {
                    acks += 1;
                }
            }
        })
        .await
        .expect("device publishes acknowledged");

        // The coordinator keeps answering, and learned the device despite the garbage.
        let devices: Vec<DeviceSummary> = tokio::time::timeout(WAIT, async {
            loop {
                let value = ask(&client, Command::ListDevices)
                    .await
                    .expect("answers after garbage");
                let devices: Vec<DeviceSummary> = serde_json::from_value(value).expect("devices");
                if !devices.is_empty() {
                    return devices;
                }
            }
        })
        .await
        .expect("device registered");
        assert_eq!(devices[0].id, "dev-1");
        assert!(devices[0].online);

        // Bad input gets a clear refusal naming the problem.
        let err = ask(
            &client,
            Command::CreateRollout {
                spec: "name = \"r\"\nrelease = \"nope\"\n[groups]\ncount = 1\n".into(),
            },
        )
        .await
        .expect_err("unknown release");
        assert!(err.to_string().contains("no release named nope"), "{err}");

        let spec = "name = \"r1\"\nrelease = \"fw-1\"\n[groups]\ncount = 1\n";
        let created: RolloutStatus = serde_json::from_value(
            ask(&client, Command::CreateRollout { spec: spec.into() })
                .await
                .expect("created"),
        )
        .expect("status");
        assert_eq!(
            (
                created.name.as_str(),
                created.release.as_str(),
                created.state.as_str()
            ),
            ("r1", "fw-1", "ready")
        );
        assert_eq!(created.groups.iter().map(|g| g.total).sum::<usize>(), 1);

        let started: RolloutStatus = serde_json::from_value(
            ask(
                &client,
                Command::StartRollout {
                    rollout: "r1".into(),
                },
            )
            .await
            .expect("started"),
        )
        .expect("status");
        assert_eq!(started.state, "running");

        // The device receives a retained, coordinator-signed install of the stored release.
        let desired = tokio::time::timeout(WAIT, async {
            loop {
                if let Event::Incoming(Packet::Publish(p)) =
                    device_el.poll().await.expect("device connection")
                {
                    if p.topic == topics.desired(&id) {
                        return p;
                    }
                }
            }
        })
        .await
        .expect("desired action published");
        let Ok(Message::Desired(blob)) = envelope::decode(&desired.payload) else {
            panic!("not a desired action")
        };
        let bytes = blob
            .verify("desired action", &[h.coordinator_pub])
            .expect("signed by the coordinator key");
        let action: DesiredAction = envelope::from_bytes("desired action", bytes).expect("decodes");
        assert_eq!(action.device_id, "dev-1");
        let action_id = action.action_id.clone();
        assert_eq!(action.rollout_id, "r1");
        assert_eq!(action.expires_at - action.issued_at, 3600);
        match action.body {
            ActionBody::Install { manifest, kind, .. } => {
                assert_eq!(manifest, h.release_blob);
                assert_eq!(kind, ActionKind::Forced);
            }
            other => panic!("expected an install, got {other:?}"),
        }

        // The artifact is served in blocks on the device's own block topic.
        let sha256 = flotilla_protocol::sha256(b"new firmware");
        device
            .subscribe(topics.block(&id), QoS::AtLeastOnce)
            .await
            .expect("queue");
        let fetch = Message::Fetch(flotilla_protocol::BlockRequest {
            sha256,
            offset: 4,
            length: 1000,
        });
        device
            .publish(
                topics.fetch(&id),
                QoS::AtLeastOnce,
                false,
                envelope::encode(&fetch),
            )
            .await
            .expect("queue");
        let block = tokio::time::timeout(WAIT, async {
            loop {
                if let Event::Incoming(Packet::Publish(p)) =
                    device_el.poll().await.expect("device connection")
                {
                    if p.topic == topics.block(&id) {
                        return p;
                    }
                }
            }
        })
        .await
        .expect("block served");
        assert_eq!(
            envelope::decode(&block.payload).expect("decodes"),
            Message::Block(flotilla_protocol::BlockReply::Data {
                sha256,
                offset: 4,
                data: b"firmware".to_vec()
            })
        );

        let err = ask(
            &client,
            Command::StartRollout {
                rollout: "r1".into(),
            },
        )
        .await
        .expect_err("already running");
        assert!(err.to_string().contains("r1"), "{err}");

        shutdown.cancel();
        tokio::time::timeout(WAIT, server)
            .await
            .expect("stops")
            .expect("no panic")
            .expect("clean shutdown");

        // The rollout survived in the store.
        {
            let store = Store::open(h.config.data_dir.join("db")).expect("store reopens");
            let stored = store.load_rollouts().expect("loads");
            assert_eq!(stored.len(), 1);
            assert_eq!(stored[0].name, "r1");
        }

        // A restarted coordinator, on a fresh broker that lost every retained message, still
        // knows the rollout and re-publishes the running group's desired action.
        let mut config = h.config.clone();
        let addr = free_addr();
        config.broker.port = addr.port();
        config.broker.embedded = Some(addr);
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve(config, shutdown.clone()));
        let client = ControlClient::connect("127.0.0.1", addr.port(), "flotilla")
            .await
            .expect("client connects");
        let status: RolloutStatus = serde_json::from_value(
            ask(
                &client,
                Command::RolloutStatus {
                    rollout: Some("r1".into()),
                },
            )
            .await
            .expect("status after restart"),
        )
        .expect("status");
        assert_eq!(status.state, "running");
        let (device, mut device_el) = device_client(addr.port());
        device
            .subscribe(topics.desired(&id), QoS::AtLeastOnce)
            .await
            .expect("queue");
        let reissued = tokio::time::timeout(WAIT, async {
            loop {
                if let Event::Incoming(Packet::Publish(p)) =
                    device_el.poll().await.expect("device connection")
                {
                    if p.topic == topics.desired(&id) {
                        return p;
                    }
                }
            }
        })
        .await
        .expect("desired action reissued after restart");
        let Ok(Message::Desired(blob)) = envelope::decode(&reissued.payload) else {
            panic!("not a desired action")
        };
        let bytes = blob
            .verify("desired action", &[h.coordinator_pub])
            .expect("signed");
        let again: DesiredAction = envelope::from_bytes("desired action", bytes).expect("decodes");
        assert_eq!(
            again.action_id, action_id,
            "same action id, so the agent does not apply it twice"
        );
        shutdown.cancel();
        tokio::time::timeout(WAIT, server)
            .await
            .expect("stops")
            .expect("no panic")
            .expect("clean shutdown");
    }
}
