//! The broker-only baseline: the same messages through the same broker without a coordinator.
//!
//! A stand-in takes the coordinator's place on its own MQTT connection: it subscribes to the
//! devices' reports and states as the coordinator does, splits the online devices into groups
//! in id order as `[groups] count = N` does, publishes each device of a group a signed, retained
//! desired action (its own throwaway coordinator and release keys, a manifest of the same shape),
//! and starts the next group once every device of the group sent a final report. The simulated
//! devices are the ordinary ones ([`crate::sim`]), checking the stand-in's signatures. What the
//! stand-in leaves out is the coordinator's own work: checking device signatures, the engine,
//! the store, the decision trace and rollout events.

use flotilla_protocol::{
    envelope, ActionBody, ActionKind, Artifact, DesiredAction, DeviceId, DeviceMessage, Message,
    ReleaseManifest, SignedBlob, SigningKey, Topic, Topics,
};
use rumqttc::QoS;
use tokio_util::sync::CancellationToken;

use crate::fleet::Fleet;
use crate::link::{self, LinkEvent};

/// The stand-in coordinator's key: fixed by the seed, so the devices can be given it.
pub fn coordinator_key(fleet: &Fleet) -> SigningKey {
    SigningKey::from_bytes(&flotilla_protocol::sha256(
        format!("flotilla-fleetsim baseline coordinator {}", fleet.seed).as_bytes(),
    ))
}

/// The groups of `online` slots (in id order): `groups` groups as even as possible, earlier ones
/// taking the remainder one each.
pub fn split(online: &[usize], groups: usize) -> Vec<Vec<usize>> {
    let groups = groups.max(1);
    let (base, extra) = (online.len() / groups, online.len() % groups);
    let mut out = Vec::with_capacity(groups);
    let mut at = 0;
    for g in 0..groups {
        let n = base + usize::from(g < extra);
        out.push(online[at..at + n].to_vec());
        at += n;
    }
    out
}

/// Settings of the stand-in.
#[derive(Debug, Clone)]
pub struct StandIn {
    pub fleet: Fleet,
    pub offline_share: f64,
    pub connection: flotilla_mqtt::Connection,
    pub topic_root: String,
    pub hardware_id: String,
    pub groups: usize,
}

/// Runs the stand-in until every group finished or `stop`.
pub async fn stand_in(settings: StandIn, stop: CancellationToken) {
    let fleet = &settings.fleet;
    let topics = Topics::new(&settings.topic_root);
    let key = coordinator_key(fleet);
    let release_key = SigningKey::from_bytes(&flotilla_protocol::sha256(b"baseline release"));
    let client_id = format!("fleetsim-baseline-{}", std::process::id());
    let (client, mut events, _) = link::start(&settings.connection, &client_id, 1000, stop.clone());
    let online: Vec<usize> = (0..fleet.len())
        .filter(|&s| !fleet.is_offline(s, settings.offline_share))
        .collect();
    let mut registered = vec![false; fleet.len()];
    let mut registered_count = 0;
    let mut finished = vec![false; fleet.len()];
    let groups = split(&online, settings.groups);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let manifest = ReleaseManifest {
        name: "baseline-1.0.0".into(),
        version: "1.0.0".into(),
        counter: 1,
        hardware: vec![settings.hardware_id.clone()],
        artifacts: vec![Artifact {
            name: "app.bin".into(),
            target: "app".into(),
            size: 1 << 20,
            sha256: [0; 32],
        }],
        created_at: now,
        expires_at: now + 86_400,
    };
    let manifest = SignedBlob::sign(&release_key, envelope::to_bytes(&manifest));
    let mut group = 0;
    let mut waiting_for = 0usize;
    loop {
        let event = tokio::select! {
            _ = stop.cancelled() => return,
            e = events.recv() => match e { Some(e) => e, None => return },
        };
        let (topic, payload) = match event {
            LinkEvent::Connected => {
                for filter in &topics.coordinator_filters()[..2] {
                    if let Err(e) = client.subscribe(filter, QoS::AtLeastOnce).await {
                        tracing::warn!("baseline: cannot subscribe: {e}");
                    }
                }
                continue;
            }
            LinkEvent::Lost(reason) => {
                tracing::warn!("baseline: MQTT connection lost: {reason}");
                continue;
            }
            LinkEvent::Subscribed => continue,
            LinkEvent::Publish { topic, payload, .. } => (topic, payload),
        };
        let (id, is_report) = match topics.parse(&topic) {
            Some(Topic::Report(id)) => (id, true),
            Some(Topic::State(id)) => (id, false),
            _ => continue,
        };
        let Some(slot) = fleet.slot(id.as_str()) else {
            continue;
        };
        // Read without checking the device's signature: that is the coordinator's work, which
        // the baseline leaves out.
        let message = match envelope::decode(&payload) {
            Ok(Message::Device(blob)) => {
                envelope::from_bytes::<DeviceMessage>("device message", &blob.payload).ok()
            }
            _ => None,
        };
        let start_next = match message {
            Some(DeviceMessage::State { state, .. }) if !is_report => {
                if state.online && !registered[slot] {
                    registered[slot] = true;
                    registered_count += 1;
                }
                group == 0 && waiting_for == 0 && registered_count == online.len()
            }
            Some(DeviceMessage::Report(report))
                if is_report && report.phase.is_terminal() && !finished[slot] =>
            {
                finished[slot] = true;
                waiting_for = waiting_for.saturating_sub(1);
                waiting_for == 0
            }
            _ => false,
        };
        if !start_next {
            continue;
        }
        // Empty groups (fewer devices than groups) have nothing to wait for.
        let Some(devices) = groups[group.min(groups.len())..]
            .iter()
            .find(|g| !g.is_empty())
        else {
            tracing::info!("baseline: every group finished");
            return;
        };
        group = groups
            .iter()
            .position(|g| std::ptr::eq(g, devices))
            .map_or(groups.len(), |p| p + 1);
        tracing::info!(group, devices = devices.len(), "baseline: group starts");
        waiting_for = devices.len();
        for &slot in devices {
            let Ok(id) = DeviceId::new(fleet.id(slot)) else {
                continue;
            };
            let action = DesiredAction {
                action_id: format!("baseline-{}", id.as_str()),
                device_id: id.to_string(),
                rollout_id: "baseline".into(),
                issued_at: now,
                expires_at: now + 86_400,
                body: ActionBody::Install {
                    manifest: manifest.clone(),
                    kind: ActionKind::Forced,
                    window: None,
                },
            };
            let blob = SignedBlob::sign(&key, envelope::to_bytes(&action));
            let payload = envelope::encode(&Message::Desired(blob));
            if let Err(e) = client
                .publish(topics.desired(&id), QoS::AtLeastOnce, true, payload)
                .await
            {
                tracing::warn!("baseline: cannot queue a desired action: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_as_even_as_possible_earlier_ones_larger() {
        let slots: Vec<usize> = (0..12).collect();
        let sizes: Vec<usize> = split(&slots, 5).iter().map(Vec::len).collect();
        assert_eq!(sizes, [3, 3, 2, 2, 2]);
        assert_eq!(split(&slots, 5)[1], [3, 4, 5]);
        assert_eq!(split(&slots[..2], 3).iter().map(Vec::len).sum::<usize>(), 2);
    }
}
