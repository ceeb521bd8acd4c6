//! Applying the engine's effects in order: persist, then sign and publish.

use flotilla_protocol::control::ControlReply;
use flotilla_protocol::MAX_PACKET_SIZE;
use flotilla_protocol::{
    envelope, ActionBody, ActionKind, DesiredAction, DeviceId, Message, SignedBlob,
};
use rumqttc::QoS;

use crate::service::error::ServiceError;
use crate::service::state::{now, Service};

use crate::service::grants;
use crate::service::http::control::{reply_status, HttpAnswer, Replier};
use crate::service::store::{self};
use flotilla_rollout::engine::{cancel_action_id, Effect};

impl Service {
    /// Applies effects in the engine's order. A failed save is fatal (see the module doc);
    /// a desired action that cannot be built is logged and skipped.
    pub(super) async fn apply(&mut self, effects: Vec<Effect>) -> Result<(), ServiceError> {
        for effect in effects {
            match effect {
                Effect::Save(name) => {
                    if let Some(rollout) = self.engine.rollout(&name) {
                        if let Err(e) = self.store.save_rollout(rollout) {
                            self.store_failed(&e);
                        }
                    }
                }
                // Nothing may instruct a device ahead of the stored rollout that justifies it;
                // the recovery reissues what each device is owed.
                Effect::Desired { .. }
                | Effect::Rollback { .. }
                | Effect::Cancel { .. }
                | Effect::Forget { .. }
                    if self.health.is_failing() =>
                {
                    self.health.held_back += 1;
                }
                Effect::Desired {
                    device,
                    action_id,
                    rollout,
                    release,
                    action,
                    peers,
                } => {
                    let Some(manifest) = self.manifest(&release) else {
                        continue;
                    };
                    let digests = if peers.is_empty() {
                        Vec::new()
                    } else {
                        match self.release_digests(&release) {
                            Some(d) => d.to_vec(),
                            None => continue,
                        }
                    };
                    // The maintenance window the attempt was sent in, in UTC: the agent holds
                    // to it too, so an action it receives late waits for its window.
                    let window = self.engine.install_window(&rollout, &device);
                    let origins =
                        crate::service::origins::for_action(&self.releases, &release, &manifest);
                    let install = grants::Install {
                        device: &device,
                        action_id: &action_id,
                        rollout: &rollout,
                        manifest,
                        kind: action_kind(action),
                        window,
                        peers: &peers,
                        digests: &digests,
                        origins,
                    };
                    let key = self.key.clone();
                    let body = move |expires_at| grants::install_body(&key, install, expires_at);
                    self.publish_action_with(&device, action_id.clone(), rollout.clone(), body)
                        .await?;
                }
                Effect::Rollback {
                    device,
                    action_id,
                    rollout,
                    undo,
                } => {
                    let body = ActionBody::Rollback { action_id: undo };
                    self.publish_action(&device, action_id, rollout, body)
                        .await?;
                }
                Effect::Approval(approval) => {
                    let bytes = serde_json::to_vec(&approval).unwrap_or_default();
                    self.tell_live("approval", &bytes);
                    self.publish(self.topics.approval_event(&approval.name), true, bytes)
                        .await?;
                }
                Effect::Forget { device } => {
                    let Ok(id) = DeviceId::new(&device) else {
                        tracing::error!(%device, "engine asked to forget an invalid device id; skipped");
                        continue;
                    };
                    self.holdings.remove(&device);
                    // A signed "nothing to do", newer than anything the device was sent, replaces
                    // its retained action: a device that comes back finds no stale action, and a
                    // replayed older action is refused. The empty retained state deletes it, so
                    // nobody sees a stale state.
                    self.publish_action(
                        &device,
                        forget_action_id(&device),
                        String::new(),
                        ActionBody::Nothing,
                    )
                    .await?;
                    self.publish(self.topics.state(&id), true, Vec::new())
                        .await?;
                }
                Effect::Cancel {
                    device,
                    action_id,
                    rollout,
                } => {
                    // A cancel has its own id: an agent never acts twice on an id it knows, so a
                    // cancel under the id of the action it cancels would be dropped as a repeat.
                    let id = cancel_action_id(&action_id);
                    let body = ActionBody::Cancel { action_id };
                    self.publish_action(&device, id, rollout, body).await?;
                }
                Effect::Status(name) => {
                    // Counts and per-group summaries only: a retained message that grew with
                    // the rollout would outgrow what the broker and clients accept.
                    if let Some(status) = self.engine.summary(&name) {
                        let bytes = serde_json::to_vec(&status).unwrap_or_default();
                        self.tell_live("rollout", &bytes);
                        self.publish(self.topics.rollout_event(&name), true, bytes)
                            .await?;
                    }
                }
                Effect::Snapshot(status) => {
                    let bytes = serde_json::to_vec(&status).unwrap_or_default();
                    self.tell_live("rollout", &bytes);
                    self.publish(self.topics.rollout_event(&status.name), true, bytes)
                        .await?;
                }
                Effect::Deleted { rollout, approvals } => {
                    if let Err(e) = self.store.delete_rollout(&rollout) {
                        self.store_failed(&e);
                    }
                    self.publish(self.topics.rollout_event(&rollout), true, Vec::new())
                        .await?;
                    for name in approvals {
                        self.publish(self.topics.approval_event(&name), true, Vec::new())
                            .await?;
                    }
                }
                Effect::Trace(entry) => {
                    self.metrics.traced(&entry);
                    tracing::info!(rollout = %entry.rollout, "{}", entry.message);
                    let bytes = serde_json::to_vec(&entry).unwrap_or_default();
                    self.tell_live("trace", &bytes);
                    self.publish(self.topics.event_log(), false, bytes).await?;
                }
            }
        }
        Ok(())
    }

    /// The stored signed manifest of a release, cached.
    pub(super) fn manifest(&mut self, release: &str) -> Option<SignedBlob> {
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

    pub(super) async fn publish_action(
        &mut self,
        device: &str,
        action_id: String,
        rollout_id: String,
        body: ActionBody,
    ) -> Result<(), ServiceError> {
        self.publish_action_with(device, action_id, rollout_id, |_| body)
            .await
    }

    /// Stamps, signs and publishes a desired action whose body depends on its expiry (a peer
    /// grant expires with its action).
    pub(super) async fn publish_action_with(
        &mut self,
        device: &str,
        action_id: String,
        rollout_id: String,
        body: impl FnOnce(u64) -> ActionBody,
    ) -> Result<(), ServiceError> {
        let Ok(id) = DeviceId::new(device) else {
            tracing::error!(%device, "engine produced an action for an invalid device id; skipped");
            return Ok(());
        };
        let issued_at = self.sequence.next(device, now());
        if let Err(e) = self.store.save_issued(device, issued_at) {
            // Still strictly increasing while this process runs; only a restart could repeat it.
            self.store_failed(&e);
        }
        let expires_at = issued_at.saturating_add(self.validity);
        let action = DesiredAction {
            action_id,
            device_id: device.to_owned(),
            rollout_id,
            issued_at,
            expires_at,
            body: body(expires_at),
        };
        self.hold(device, &action.body);
        self.confirm(device, &action.action_id, expires_at);
        let blob = SignedBlob::sign(&self.key, envelope::to_bytes(&action));
        let bytes = envelope::encode(&Message::Desired(blob));
        let digest = store::published_digest(&self.verifying_key, &bytes);
        if let Err(e) = self.store.save_published(device, &digest) {
            // Harmless: the stored digest is of older bytes, which then get their signature checked.
            tracing::debug!(%device, error = %e, "could not record the digest of a published desired action");
        }
        self.publish(self.topics.desired(&id), true, bytes).await
    }

    /// Publishes on the link. A message that cannot go out (a topic with wildcards or U+0000, or
    /// more than [`MAX_PACKET_SIZE`] bytes) is logged, counted and dropped: rumqttc would refuse it,
    /// or the broker would drop the connection over it, and neither may stop the service. Only a
    /// closed link is an error.
    pub(super) async fn publish(
        &mut self,
        topic: String,
        retain: bool,
        payload: Vec<u8>,
    ) -> Result<(), ServiceError> {
        self.publish_on(Via::Main, topic, retain, payload).await
    }

    pub(super) async fn publish_on(
        &mut self,
        via: Via,
        topic: String,
        retain: bool,
        payload: Vec<u8>,
    ) -> Result<(), ServiceError> {
        // The last moment to find out that another coordinator may lead by now: a deposed
        // leader (stopped, or cut off from the database) publishes nothing after it wakes.
        if self.fenced {
            return Err(self.deposed("a store write was fenced off by a newer lease"));
        }
        if !self.leadership.leads() {
            return Err(self.deposed("the lease may have expired"));
        }
        if let Err(why) = publishable(&topic, payload.len()) {
            self.unpublishable += 1;
            tracing::warn!(
                topic = %topic.chars().take(200).collect::<String>(),
                unpublishable_total = self.unpublishable,
                "not publishing: {why}"
            );
            return Ok(());
        }
        self.metrics.published(&self.topics, &topic);
        let client = match (via, &self.replies) {
            (Via::Replies, Some(replies)) if self.replies_up => replies,
            _ => &self.client,
        };
        client
            .publish(topic, QoS::AtLeastOnce, retain, payload)
            .await
            .map_err(|_| ServiceError::LinkClosed {
                addr: self.addr.clone(),
            })
    }

    /// Publishes a control reply; one too large for a message becomes an error reply saying so.
    /// Hands an event to the HTTP API's event streams; never waits, and costs a clone of the
    /// JSON only while someone listens.
    pub(super) fn tell_live(&self, kind: &'static str, json: &[u8]) {
        if self.live.receiver_count() > 0 {
            let text = String::from_utf8_lossy(json).into_owned();
            let _ = self.live.send(std::sync::Arc::new((kind, text)));
        }
    }

    pub(super) async fn reply(
        &mut self,
        to: Replier,
        reply: ControlReply,
    ) -> Result<(), ServiceError> {
        let reply_to = match to {
            Replier::Topic(topic) => topic,
            // An HTTP answer has no message size limit; a client that went away is no error.
            Replier::Http(client) => {
                let status = reply_status(&reply);
                let _ = client.send(HttpAnswer { status, reply });
                return Ok(());
            }
        };
        // A reply is plain data; serializing it cannot fail.
        let mut bytes = serde_json::to_vec(&reply).unwrap_or_default();
        if bytes.len() > MAX_PACKET_SIZE {
            let too_large = ControlReply {
                id: reply.id,
                ok: false,
                error: Some(format!(
                    "the reply is {} bytes, more than the {MAX_PACKET_SIZE} bytes one message may \
                     carry; ask for less",
                    bytes.len()
                )),
                result: serde_json::Value::Null,
                loading: reply.loading,
            };
            bytes = serde_json::to_vec(&too_large).unwrap_or_default();
        }
        self.publish_on(Via::Replies, reply_to, false, bytes).await
    }
}

/// Which connection a publish goes out on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Via {
    Main,
    /// The control connection's while it is up, for control replies (`control_link.rs`).
    Replies,
}

/// The action id an effect publishes on a device's `desired` topic.
pub(super) fn effect_action_id(effect: &Effect) -> Option<String> {
    match effect {
        Effect::Desired { action_id, .. } | Effect::Rollback { action_id, .. } => {
            Some(action_id.clone())
        }
        Effect::Cancel { action_id, .. } => Some(cancel_action_id(action_id)),
        _ => None,
    }
}

/// The device an effect publishes a desired action for.
pub(super) fn effect_device(effect: &Effect) -> Option<&str> {
    match effect {
        Effect::Desired { device, .. }
        | Effect::Rollback { device, .. }
        | Effect::Cancel { device, .. } => Some(device),
        _ => None,
    }
}

/// Why a message cannot be published, if it cannot: rumqttc refuses topics with wildcards, and
/// brokers drop the connection of a client that sends U+0000 in a topic or a packet larger than
/// they accept.
pub(super) fn publishable(topic: &str, payload_len: usize) -> Result<(), String> {
    if topic.is_empty() || topic.len() > usize::from(u16::MAX) {
        return Err(format!("a topic of {} bytes", topic.len()));
    }
    if topic.contains(['+', '#', '\0']) {
        return Err("the topic contains a wildcard or U+0000".into());
    }
    if payload_len > MAX_PACKET_SIZE {
        return Err(format!(
            "{payload_len} bytes, more than the {MAX_PACKET_SIZE} bytes one message may carry"
        ));
    }
    Ok(())
}

/// The action id of the "nothing to do" that replaces a deleted device's action.
pub(super) fn forget_action_id(device: &str) -> String {
    format!("forget:{device}")
}

/// The protocol's action kind for a spec's action type.
pub(super) fn action_kind(action: flotilla_rollout::plan::ActionType) -> ActionKind {
    use flotilla_rollout::plan::ActionType;
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

    /// issue 10, case 1: what rumqttc would refuse (and the service used to take for a dead
    /// link) or a broker would disconnect over is never published.
    #[test]
    fn wildcards_nul_and_oversized_messages_are_not_published() {
        assert!(publishable("flotilla/v1/control/reply/cli-1", 100).is_ok());
        for topic in ["a/#", "a/+/b", "a\0b", ""] {
            assert!(publishable(topic, 1).is_err(), "{topic:?}");
        }
        assert!(publishable(&"t".repeat(70_000), 1).is_err());
        let err = publishable("flotilla/v1/events/log", MAX_PACKET_SIZE + 1).expect_err("too big");
        assert!(err.contains("more than the"), "{err}");
    }
}
