//! What arrives from the link: device messages, retained desired actions read back, control requests and the marker.

use std::collections::HashMap;

use flotilla_protocol::control::{Command, ControlReply, ControlRequest};
use flotilla_protocol::manifest::Manifest;
use flotilla_protocol::operator::Role;
use flotilla_protocol::{
    envelope, ActionBody, BlockReply, DesiredAction, DeviceId, DeviceMessage, Digest, Message,
};
use flotilla_protocol::{Topic, BROKER_PACKET_LIMIT};

use crate::service::effects::{effect_action_id, effect_device};
use crate::service::error::ServiceError;
use crate::service::state::{now, Held, Service};

use crate::service::control_link::Side;
use crate::service::coverage::{self, LoadEnd};
use crate::service::enrollment::{Ignored, Verdict};
use crate::service::http::control::{refusal_status, HttpAnswer, HttpControl, Replier};
use crate::service::http::session::{self, Session};
use crate::service::loading::MarkerSeen;
use crate::service::metrics::Malformed;
use crate::service::mqtt::LinkEvent;
use crate::service::releases::{self};
use crate::service::store::{self};
use crate::service::verify::{self, Arrival, Checked};
use crate::service::warm::RetainedDesired;
use flotilla_rollout::engine::Effect;
use tokio::sync::oneshot;

/// How often a device's retained `desired` topic is repaired at most (see `Service::on_desired`).
pub(super) const REPAIR_INTERVAL: u64 = 5;

impl Service {
    /// Records which digests `device` may fetch under the desired action `body`: the artifacts
    /// and block lists of an install (with or without peers), none for anything else (nothing,
    /// cancel, rollback to a kept release).
    pub(super) fn hold(&mut self, device: &str, body: &ActionBody) {
        let digests = body
            .install()
            .and_then(|install| Manifest::decode(&install.manifest.payload).ok())
            .map(|m| releases::fetchable_digests(&m))
            .unwrap_or_default();
        self.hold_digests(device, digests);
    }

    fn hold_digests(&mut self, device: &str, digests: Vec<Digest>) {
        if digests.is_empty() {
            self.holdings.remove(device);
        } else {
            self.holdings.insert(device.to_owned(), digests);
        }
    }

    /// A device's retained `desired` topic changed (or was read back): only an action signed
    /// with this coordinator's key, for the device of its topic, counts ([`Self::read_desired`]).
    pub(super) fn on_desired(&mut self, id: &DeviceId, payload: &[u8]) -> Vec<Effect> {
        let found = self
            .our_desired_action(id, payload)
            .map(|action| RetainedDesired::of(&action));
        self.read_desired(id.as_str(), found, payload.is_empty())
    }

    /// What a device's retained `desired` topic holds: `found` when it is an action of this
    /// coordinator's for the device, `cleared` when it is empty ([`Self::note_desired`]). Once
    /// loading has ended, when the topic holds something other than the action the engine owes
    /// the device (cleared, overwritten, or an older action replayed) returns the effects that
    /// publish it again, at most once per [`REPAIR_INTERVAL`] per device; while loading, the
    /// reissue at its end does that ([`Self::reissue_unconfirmed`]).
    pub(super) fn read_desired(
        &mut self,
        device: &str,
        found: Option<RetainedDesired>,
        cleared: bool,
    ) -> Vec<Effect> {
        match &found {
            Some(action) => self.note_desired(device, action),
            None => {
                if cleared {
                    self.holdings.remove(device);
                }
                if let Some(confirmed) = &mut self.confirmed {
                    confirmed.remove(device);
                }
            }
        }
        if self.confirmed.is_some() {
            // The reissue when loading ends publishes whatever is owed and not read back.
            return Vec::new();
        }
        // Only the newest action sent to the device is owed (`engine/owed.rs`): an older
        // rollout's cancel is never published over it.
        let Some(wanted) = self.engine.reissue_device(device) else {
            return Vec::new();
        };
        let Some(owed) = effect_action_id(&wanted) else {
            return Vec::new();
        };
        if found.as_ref().is_some_and(|a| a.action_id == owed) {
            return Vec::new();
        }
        let now = now();
        if self
            .repaired
            .get(device)
            .is_some_and(|&at| now < at.saturating_add(REPAIR_INTERVAL))
        {
            return Vec::new();
        }
        self.repaired.insert(device.to_owned(), now);
        self.desired_repairs += 1;
        tracing::warn!(
            %device,
            owed,
            found = found.as_ref().map_or("something else", |a| a.action_id.as_str()),
            repairs_total = self.desired_repairs,
            "the retained desired action is not the one this coordinator published; publishing it again"
        );
        vec![wanted]
    }

    /// Keeps what a device's retained desired action says: its holdings for block requests, its
    /// action sequence above what it was told, and, while a reissue is pending, that this
    /// action is there already.
    pub(super) fn note_desired(&mut self, device: &str, action: &RetainedDesired) {
        self.sequence.observe(device, action.issued_at);
        self.hold_digests(device, action.fetchable.clone());
        self.confirm(device, &action.action_id, action.expires_at);
    }

    /// While a reissue is pending: `device`'s retained `desired` topic holds `action_id`.
    pub(super) fn confirm(&mut self, device: &str, action_id: &str, expires_at: u64) {
        if let Some(confirmed) = &mut self.confirmed {
            confirmed.insert(device.to_owned(), (action_id.to_owned(), expires_at));
        }
    }

    /// Loading ended: publishes again what the engine owes each device whose retained
    /// `desired` topic was not read back holding it (a broker that lost its retained messages,
    /// a leader that died between storing an action and publishing it), and every approval
    /// request. An action read back that expires within half its validity goes out again too,
    /// with a new expiry. Actions read back as they are are not sent twice.
    pub(super) async fn reissue_unconfirmed(&mut self) -> Result<(), ServiceError> {
        let confirmed = self.confirmed.take().unwrap_or_default();
        let fresh_until = now().saturating_add(self.validity / 2);
        let effects: Vec<Effect> = self
            .engine
            .reissue(now())
            .into_iter()
            .filter(|effect| {
                let (Some(device), Some(owed)) = (effect_device(effect), effect_action_id(effect))
                else {
                    return true;
                };
                !confirmed
                    .get(device)
                    .is_some_and(|(id, expires)| *id == owed && *expires > fresh_until)
            })
            .collect();
        let (owed, skipped) = (effects.len(), confirmed.len());
        tracing::info!(
            published_again = owed,
            read_back = skipped,
            "publishing again what devices are owed and the broker does not hold"
        );
        self.apply(effects).await
    }

    /// The desired action in `payload` if this coordinator signed it for `id`. Bytes identical
    /// to the last ones published for the device (the echo of every publish, and after a
    /// restart the retained actions of a whole fleet) are known to be ours without a signature
    /// check; anything else is checked.
    pub(super) fn our_desired_action(
        &mut self,
        id: &DeviceId,
        payload: &[u8],
    ) -> Option<DesiredAction> {
        let Ok(Message::Desired(blob)) = envelope::decode(payload) else {
            return None;
        };
        let ours = self.store.published(id.as_str())
            == Some(store::published_digest(&self.verifying_key, payload));
        let bytes = if ours {
            self.desired_known += 1;
            blob.payload.as_slice()
        } else {
            blob.verify("desired action", &[self.verifying_key]).ok()?
        };
        let action = envelope::from_bytes::<DesiredAction>("desired action", bytes).ok()?;
        (action.device_id == id.as_str()).then_some(action)
    }

    /// Whether `device` holds an action for a release with this artifact: its retained desired
    /// action installs it, or it has a live slot in an active rollout of such a release.
    pub(super) fn may_fetch(&mut self, device: &str, sha256: &Digest) -> bool {
        if self
            .holdings
            .get(device)
            .is_some_and(|held| held.contains(sha256))
        {
            return true;
        }
        let releases: Vec<String> = self
            .engine
            .device_releases(device)
            .into_iter()
            .map(str::to_owned)
            .collect();
        for release in releases {
            if self
                .release_digests(&release)
                .is_some_and(|d| d.contains(sha256))
            {
                return true;
            }
        }
        false
    }

    /// Every digest of a release a device may fetch (artifacts and block lists), cached.
    /// Release names are never reused, so the cache cannot go stale.
    pub(super) fn release_digests(&mut self, release: &str) -> Option<&[Digest]> {
        if !self.release_digests.contains_key(release) {
            match self.releases.load_manifest(release) {
                Ok((_, manifest)) => {
                    let digests = releases::fetchable_digests(&manifest);
                    self.release_digests.insert(release.to_owned(), digests);
                }
                Err(e) => {
                    tracing::error!(%release, error = %e, "release unreadable");
                    return None;
                }
            }
        }
        self.release_digests.get(release).map(Vec::as_slice)
    }

    pub(super) async fn on_link_event(&mut self, arrival: Arrival) -> Result<(), ServiceError> {
        let Arrival { event, checked } = arrival;
        match event {
            LinkEvent::Connected => {
                self.loading.connected();
                self.lane_open
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                let _timing = self.metrics.connected();
                // What the retained `desired` topics hold is read again; what the broker lost
                // (one restarted without persistence) goes out again once loading ends.
                self.confirmed = Some(HashMap::new());
                Ok(())
            }
            LinkEvent::Disconnected { .. } => {
                self.metrics.disconnected();
                Ok(())
            }
            LinkEvent::Subscribed => {
                // Queued by the broker behind every retained message it delivers on subscribe.
                let nonce = self.loading.subscribed(tokio::time::Instant::now());
                self.publish(self.topics.marker(), false, nonce.into_bytes())
                    .await
            }
            LinkEvent::Publish { topic, payload } => {
                self.on_publish(&topic, &payload, checked).await
            }
        }
    }

    /// One publish from the link. `checked` is what a signature worker made of a device topic's
    /// payload (`verify.rs`); without it the payload is checked here.
    pub(super) async fn on_publish(
        &mut self,
        topic: &str,
        payload: &[u8],
        checked: Option<Checked>,
    ) -> Result<(), ServiceError> {
        self.on_publish_via(Side::Main, topic, payload, checked)
            .await
    }

    /// [`Self::on_publish`] for a publish that came in on `side`: a control request whose copy
    /// from the other connection was taken already is dropped (`control_link.rs`).
    pub(super) async fn on_publish_via(
        &mut self,
        side: Side,
        topic: &str,
        payload: &[u8],
        checked: Option<Checked>,
    ) -> Result<(), ServiceError> {
        if let Some(twins) = &mut self.twins {
            if topic.ends_with("/control/request")
                && topic == self.topics.control_request()
                && twins.is_twin(side, payload)
            {
                return Ok(());
            }
        }
        let _timing = self.metrics.received(&self.topics, topic);
        if payload.len() > BROKER_PACKET_LIMIT {
            let reason = format!(
                "{} bytes, more than the {BROKER_PACKET_LIMIT} bytes a message may have",
                payload.len()
            );
            self.reject(topic, Malformed::TooLarge, &reason);
            return Ok(());
        }
        if topic == coverage::SYS_DROPPED {
            match self
                .coverage
                .broker_dropped(payload, std::time::Instant::now())
            {
                Ok(Some(warning)) => tracing::warn!("{warning}"),
                Ok(None) => {}
                Err(reason) => self.reject(topic, Malformed::Undecodable, &reason),
            }
            return Ok(());
        }
        let Some(parsed) = self.topics.parse(topic) else {
            self.reject(topic, Malformed::UnknownTopic, "not a flotilla topic");
            return Ok(());
        };
        let id = match &parsed {
            Topic::ControlRequest => return self.on_control(topic, payload).await,
            Topic::Marker => return self.on_marker(topic, payload).await,
            Topic::State(id) | Topic::Report(id) | Topic::Fetch(id) => id.clone(),
            Topic::Desired(id) => {
                let id = id.clone();
                let repair = self.on_desired(&id, payload);
                return self.apply(repair).await;
            }
            // Not subscribed to; a broker that forwards it anyway is not worth an error.
            _ => return Ok(()),
        };
        // An empty retained payload is how a device's state gets cleared: not malformed.
        if payload.is_empty() && matches!(parsed, Topic::State(_)) {
            return Ok(());
        }
        let checked = checked.unwrap_or_else(|| verify::check(payload, None));
        let (blob, opened) = match checked {
            Checked::Signed { blob, verified } => {
                let opened = verify::decode_verified(&blob, verified);
                (blob, opened)
            }
            Checked::Undecodable(reason) => {
                self.reject(topic, Malformed::Undecodable, &reason);
                return Ok(());
            }
            Checked::Unsigned => {
                self.ignore(topic, Ignored::Unsigned);
                return Ok(());
            }
            Checked::WrongKind(name) => {
                let reason = format!("unexpected {name} on this topic");
                self.reject(topic, Malformed::WrongKind, &reason);
                return Ok(());
            }
        };
        let expected = match parsed {
            Topic::State(_) => "device state",
            Topic::Report(_) => "report",
            _ => "block request",
        };
        let now = now();
        let verdict = self
            .registry
            .observe_checked(id.as_str(), expected, &blob, opened, now);
        let Some(message) = self.settle(topic, &id, verdict, now) else {
            return Ok(());
        };
        // Only now, signed by the device's accepted key, does anything reach the engine: a
        // forged report's seq never counts.
        match message {
            DeviceMessage::State { state, .. } => {
                let effects = self.engine.observe_state(state, now);
                self.apply(effects).await
            }
            DeviceMessage::Report(report) => {
                self.note_live_report(&report.rollout_id);
                let effects = self.engine.observe_report(report, now);
                self.apply(effects).await
            }
            DeviceMessage::ReportWithBytes {
                report,
                bytes,
                bypassed,
            } => {
                // The bytes first, so the status the report publishes counts them.
                self.note_live_report(&report.rollout_id);
                let mut effects =
                    self.observe_bytes(id.as_str(), &report.action_id, &bytes, &bypassed, now);
                effects.extend(self.engine.observe_report(report, now));
                self.apply(effects).await
            }
            DeviceMessage::Fetch { request, .. } => {
                let reply = if self.may_fetch(id.as_str(), &request.sha256) {
                    self.blocks.serve(&request)
                } else {
                    self.ignore(topic, Ignored::NoAction);
                    BlockReply::Unavailable {
                        sha256: request.sha256,
                        offset: request.offset,
                        reason: format!(
                            "device {id} holds no action for artifact {}",
                            flotilla_protocol::hex::encode(&request.sha256)
                        ),
                    }
                };
                self.metrics.block(&reply);
                let bytes = envelope::encode(&Message::Block(reply));
                self.publish(self.topics.block(&id), false, bytes).await
            }
        }
    }

    /// Stores and logs what the registry decided about a device message; the message, if it
    /// may go on.
    fn settle(
        &mut self,
        topic: &str,
        id: &DeviceId,
        verdict: Verdict,
        now: u64,
    ) -> Option<DeviceMessage> {
        // Written with the others of this tick (`Service::save_enrollments`).
        if let Some(token) = &verdict.used_token {
            self.unsaved.tokens.push((token.clone(), now));
        }
        if verdict.changed {
            self.unsaved.devices.insert(id.as_str().to_owned());
        }
        if let Some(note) = &verdict.note {
            tracing::info!(device = %id, "{note}");
        }
        if let Some(why) = verdict.ignored {
            self.ignore(topic, why);
        }
        verdict.accepted
    }

    /// Token proofs the enrollment attempt limits held back, checked now there is room: a
    /// device that enrolls joins the engine as if its state had just arrived.
    pub(super) async fn retry_enrollments(&mut self) -> Result<(), ServiceError> {
        let now = now();
        for (device, verdict) in self.registry.retry_deferred(now) {
            let Ok(id) = DeviceId::new(device) else {
                continue;
            };
            let topic = self.topics.state(&id);
            if let Some(DeviceMessage::State { state, .. }) = self.settle(&topic, &id, verdict, now)
            {
                let effects = self.engine.observe_state(state, now);
                self.apply(effects).await?;
            }
        }
        Ok(())
    }

    pub(super) async fn on_control(
        &mut self,
        topic: &str,
        payload: &[u8],
    ) -> Result<(), ServiceError> {
        self.on_request(topic, payload, None).await
    }

    /// A control request that came over HTTP: the same gate and commands as from MQTT; the
    /// answer goes back to the waiting client, with a status that says what happened.
    pub(super) async fn on_http(&mut self, request: HttpControl) -> Result<(), ServiceError> {
        match request {
            HttpControl::Signed { payload, answer } => {
                self.on_request("(http)", &payload, Some(answer)).await
            }
            HttpControl::Login {
                payload,
                digest,
                answer,
            } => {
                let _ = answer.send(self.login(&payload, &digest));
                Ok(())
            }
            HttpControl::Logout { digest, answer } => {
                let (status, error) = match self.store.delete_sessions(&[digest]) {
                    Ok(()) => (axum::http::StatusCode::OK, None),
                    Err(e) => (
                        axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        Some(format!(
                            "the session ended here but could not be removed from the store: {e}"
                        )),
                    ),
                };
                let reply = ControlReply {
                    id: String::new(),
                    ok: error.is_none(),
                    error,
                    result: serde_json::Value::Null,
                    loading: false,
                };
                let _ = answer.send(HttpAnswer { status, reply });
                Ok(())
            }
            HttpControl::Read {
                operator,
                command,
                answer,
            } => {
                if command.required_role() != Role::Viewer {
                    // The HTTP side sends only reads; a change needs a signed request.
                    let reply = ControlReply {
                        id: String::new(),
                        ok: false,
                        error: Some(format!(
                            "{} changes something: send it as a signed request",
                            command.name()
                        )),
                        result: serde_json::Value::Null,
                        loading: false,
                    };
                    let _ = answer.send(HttpAnswer {
                        status: axum::http::StatusCode::FORBIDDEN,
                        reply,
                    });
                    return Ok(());
                }
                let request =
                    ControlRequest::new(String::new(), String::new(), 0, String::new(), command);
                self.run(request, &operator, Replier::Http(answer)).await
            }
        }
    }

    /// Checks a signed `login` request with the gate and stores the session it opens under
    /// `digest` (its token's sha256): the session, or the refusal to answer.
    fn login(&mut self, payload: &[u8], digest: &str) -> Result<Session, HttpAnswer> {
        let refused = |status, error: String| HttpAnswer {
            status,
            reply: ControlReply {
                id: String::new(),
                ok: false,
                error: Some(error),
                result: serde_json::Value::Null,
                loading: false,
            },
        };
        match self.gate.check(payload, now()) {
            Ok(authorized) if authorized.request.command == Command::Login => {
                // The gate found the operator by this key; the session remembers it, so rotating
                // the operator's key ends its sessions.
                let key =
                    serde_json::from_slice::<flotilla_protocol::operator::SignedRequest>(payload)
                        .map(|signed| signed.key.to_ascii_lowercase())
                        .unwrap_or_default();
                let opened = Session {
                    operator: authorized.operator,
                    role: authorized.role,
                    key,
                    expires: session::unix_now() + session::TTL.as_secs(),
                };
                if let Err(e) = self.store.save_session(digest, &opened) {
                    tracing::warn!(operator = %opened.operator, error = %e, "cannot store an HTTP session");
                    return Err(refused(
                        axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        format!("the session could not be stored ({e}); try again shortly"),
                    ));
                }
                tracing::info!(operator = %opened.operator, role = %opened.role, "HTTP session opened");
                Ok(opened)
            }
            Ok(authorized) => Err(refused(
                axum::http::StatusCode::BAD_REQUEST,
                format!(
                    "a session opens with a signed login request, not {}",
                    authorized.request.command.name()
                ),
            )),
            Err(refusal) => {
                self.refused += 1;
                self.metrics.refused(&refusal.reason);
                if !refusal.quiet {
                    tracing::warn!(reason = %refusal.reason, "refusing an HTTP login");
                }
                Err(refused(refusal_status(&refusal.reason), refusal.reason))
            }
        }
    }

    /// Checks a signed control request and runs it, or holds it while the fleet loads. The
    /// reply goes to the request's `reply_to` topic, or to `http` when it came over HTTP.
    async fn on_request(
        &mut self,
        topic: &str,
        payload: &[u8],
        http: Option<oneshot::Sender<HttpAnswer>>,
    ) -> Result<(), ServiceError> {
        let authorized = match self.gate.check(payload, now()) {
            Ok(a) => a,
            Err(refusal) => {
                self.refused += 1;
                self.metrics.refused(&refusal.reason);
                // One of a flood is only counted; the gate sums those up now and then.
                if !refusal.quiet {
                    tracing::warn!(%topic, reason = %refusal.reason, replied = refusal.reply_to.is_some() || http.is_some(),
                        refused_total = self.refused, "refusing control request");
                }
                if let Some(summary) = &refusal.summary {
                    tracing::warn!(refused_total = self.refused, "{summary}");
                }
                let reply = ControlReply {
                    id: refusal.id.unwrap_or_default(),
                    ok: false,
                    error: Some(refusal.reason),
                    result: serde_json::Value::Null,
                    loading: false,
                };
                // An HTTP client is always answered (it costs the broker nothing). Over MQTT,
                // only a reply_to that passed the checks (a plain reply topic under the root)
                // is ever published on; otherwise the refusal is logged and counted only.
                if let Some(http) = http {
                    let status = refusal_status(reply.error.as_deref().unwrap_or_default());
                    let _ = http.send(HttpAnswer { status, reply });
                    return Ok(());
                }
                let Some(reply_to) = refusal.reply_to else {
                    return Ok(());
                };
                return self.reply(Replier::Topic(reply_to), reply).await;
            }
        };
        let request = authorized.request;
        let operator = authorized.operator;
        let to = match http {
            Some(http) => Replier::Http(http),
            None => Replier::Topic(request.reply_to.clone()),
        };
        tracing::info!(%operator, role = %authorized.role, command = request.command.name(),
            id = %request.id, over = if matches!(to, Replier::Http(_)) { "http" } else { "mqtt" },
            "control request");
        // A command that changes anything may depend on the whole registry (a rollout plans
        // over every device): it waits until the retained states are read. Reads answer now,
        // marked as loading.
        if self.loading.is_loading() && request.command.required_role() != Role::Viewer {
            let held = self.loading.held();
            return match self.loading.hold(Held {
                request,
                operator,
                to,
            }) {
                Ok(()) => {
                    tracing::info!(
                        held = held + 1,
                        "control request held until every retained device state is read"
                    );
                    Ok(())
                }
                Err(Held { request, to, .. }) => {
                    let reply = ControlReply {
                        id: request.id,
                        ok: false,
                        error: Some(format!(
                            "the coordinator is still reading the fleet's retained states and \
                             already holds {held} commands until it has; try again shortly"
                        )),
                        result: serde_json::Value::Null,
                        loading: true,
                    };
                    self.reply(to, reply).await
                }
            };
        }
        self.run(request, &operator, to).await
    }

    /// Runs an accepted control request and replies.
    pub(super) async fn run(
        &mut self,
        request: ControlRequest,
        operator: &str,
        to: Replier,
    ) -> Result<(), ServiceError> {
        let loading = self.loading.is_loading();
        let reply = match self.command(request.command, operator).await? {
            Ok(result) => ControlReply {
                id: request.id,
                ok: true,
                error: None,
                result,
                loading,
            },
            Err(error) => ControlReply {
                id: request.id,
                ok: false,
                error: Some(error),
                result: serde_json::Value::Null,
                loading,
            },
        };
        self.reply(to, reply).await
    }

    /// A publish on the marker topic: this connection's marker ends the loading state.
    pub(super) async fn on_marker(
        &mut self,
        topic: &str,
        payload: &[u8],
    ) -> Result<(), ServiceError> {
        match self.loading.marker(payload) {
            MarkerSeen::Complete => {
                tracing::info!(
                    devices = self.engine.device_count(),
                    held = self.loading.held(),
                    "every retained device state is read"
                );
                self.check_coverage(LoadEnd::Marker);
                self.reissue_unconfirmed().await?;
                self.release_held().await
            }
            MarkerSeen::Foreign => {
                self.reject(topic, Malformed::BadMarker, "not this connection's marker");
                Ok(())
            }
        }
    }

    /// The marker did not come back in time: the registry is taken as complete.
    pub(super) async fn marker_overdue(&mut self) -> Result<(), ServiceError> {
        if !self.loading.expire(tokio::time::Instant::now()) {
            return Ok(());
        }
        tracing::warn!(
            timeout = ?self.loading.timeout(),
            devices = self.engine.device_count(),
            held = self.loading.held(),
            "the end-of-retained marker did not come back (an ACL refusing the marker topic, or \
             a broker queue limit that dropped it?); taking the registry as complete, it may \
             miss devices whose states were not read yet"
        );
        self.check_coverage(LoadEnd::Timeout);
        self.reissue_unconfirmed().await?;
        self.release_held().await
    }

    /// The retained states are read: warns when they are far fewer than the accepted devices
    /// (`coverage.rs`).
    fn check_coverage(&mut self, end: LoadEnd) {
        let (accepted, with_state) = self.coverage_counts();
        if let Some(warning) = self.coverage.check(accepted, with_state, end) {
            tracing::warn!(accepted, with_state, "{warning}");
        }
    }

    /// Loading ended: control requests from now on come in arrival order with device traffic,
    /// and the commands held while loading run, in the order they arrived.
    pub(super) async fn release_held(&mut self) -> Result<(), ServiceError> {
        self.lane_open
            .store(false, std::sync::atomic::Ordering::SeqCst);
        while let Some(Held {
            request,
            operator,
            to,
        }) = self.loading.release()
        {
            self.run(request, &operator, to).await?;
        }
        Ok(())
    }
}
