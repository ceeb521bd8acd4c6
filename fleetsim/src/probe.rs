//! Control round trips timed without a fleet: how soon a (re)started coordinator answers
//! (`--first-answer`) and how fast an idle one does (`--idle-probes`). Both send the signed,
//! read-only `list_releases` request an operator would, on a connection of their own.

use std::time::{Duration, Instant};

use flotilla_protocol::control::{Command, ControlReply, ControlRequest};
use flotilla_protocol::operator::{new_nonce, SignedRequest};
use flotilla_protocol::{SigningKey, Topics};
use rumqttc::QoS;
use tokio_util::sync::CancellationToken;

use crate::fleet::percentile;
use crate::link::{self, LinkEvent};

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A signed `list_releases` request with this id, answered on `reply_topic`.
fn request(key: &SigningKey, id: String, reply_topic: &str) -> Vec<u8> {
    let request = ControlRequest::new(
        id,
        reply_topic.to_owned(),
        unix_now(),
        new_nonce(),
        Command::ListReleases {
            page: Default::default(),
        },
    );
    serde_json::to_vec(&SignedRequest::sign(key, &request)).unwrap_or_default()
}

/// How long until the coordinator answers a control request: one signed `list_releases` every
/// 20 ms, from the first connection to the first answer, or `None` after `timeout`.
pub async fn first_answer(
    connection: &flotilla_mqtt::Connection,
    topic_root: &str,
    key: &SigningKey,
    timeout: Duration,
) -> Option<Duration> {
    let started = Instant::now();
    let stop = CancellationToken::new();
    let client_id = format!("fleetsim-first-answer-{}", std::process::id());
    let (client, mut events, _) = link::start(connection, &client_id, 100, stop.clone());
    let topics = Topics::new(topic_root);
    let reply_topic = topics.control_reply(&client_id);
    let mut every = tokio::time::interval(Duration::from_millis(20));
    let mut subscribed = false;
    let answered = tokio::time::timeout(timeout, async {
        loop {
            tokio::select! {
                event = events.recv() => match event {
                    None => return false,
                    Some(LinkEvent::Connected) => {
                        subscribed = client.subscribe(&reply_topic, QoS::AtLeastOnce).await.is_ok();
                    }
                    Some(LinkEvent::Publish { topic, payload, .. }) if topic == reply_topic => {
                        if serde_json::from_slice::<ControlReply>(&payload).is_ok_and(|r| r.ok) {
                            return true;
                        }
                    }
                    Some(_) => {}
                },
                _ = every.tick(), if subscribed => {
                    let payload = request(key, format!("fleetsim-first-{}", new_nonce()), &reply_topic);
                    let _ = client
                        .publish(topics.control_request(), QoS::AtLeastOnce, false, payload)
                        .await;
                }
            }
        }
    })
    .await;
    stop.cancel();
    matches!(answered, Ok(true)).then(|| started.elapsed())
}

/// Round trips to an idle coordinator (`--idle-probes`): printed as `name: value` lines.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct IdleFigures {
    pub probe_idle: usize,
    pub probe_idle_p50_ms: Option<f64>,
    pub probe_idle_p99_ms: Option<f64>,
    pub probe_idle_max_ms: Option<f64>,
    /// Requests not answered within `--timeout` each.
    pub probe_idle_unanswered: usize,
}

impl std::fmt::Display for IdleFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.3}"));
        writeln!(f, "probe_idle: {}", self.probe_idle)?;
        writeln!(f, "probe_idle_p50_ms: {}", ms(self.probe_idle_p50_ms))?;
        writeln!(f, "probe_idle_p99_ms: {}", ms(self.probe_idle_p99_ms))?;
        writeln!(f, "probe_idle_max_ms: {}", ms(self.probe_idle_max_ms))?;
        writeln!(f, "probe_idle_unanswered: {}", self.probe_idle_unanswered)
    }
}

/// Why the idle probes could not run.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("no subscription to the reply topic within {0:?}")]
    NotSubscribed(Duration),
    #[error("the MQTT link closed")]
    Closed,
}

/// Sends `count` control requests one at a time, each `gap` after the previous one's answer
/// (or after `each` without one), and times them from the publish to the reply. Nothing else
/// runs on this connection, so the figures are the coordinator's (and the broker's) own.
pub async fn idle(
    connection: &flotilla_mqtt::Connection,
    topic_root: &str,
    key: &SigningKey,
    count: usize,
    gap: Duration,
    each: Duration,
) -> Result<IdleFigures, ProbeError> {
    let stop = CancellationToken::new();
    let _stop_link = stop.clone().drop_guard();
    let client_id = format!("fleetsim-idle-probe-{}", std::process::id());
    let (client, mut events, _) = link::start(connection, &client_id, 10, stop.clone());
    let topics = Topics::new(topic_root);
    let reply_topic = topics.control_reply(&client_id);
    // Connected, then subscribed (the SubAck): from then on a reply cannot be missed.
    let wait = Duration::from_secs(30);
    tokio::time::timeout(wait, async {
        loop {
            match events.recv().await {
                None => return Err(ProbeError::Closed),
                Some(LinkEvent::Connected) => {
                    let _ = client.subscribe(&reply_topic, QoS::AtLeastOnce).await;
                }
                Some(LinkEvent::Subscribed) => return Ok(()),
                Some(_) => {}
            }
        }
    })
    .await
    .map_err(|_| ProbeError::NotSubscribed(wait))??;
    let mut took = Vec::with_capacity(count);
    let mut unanswered = 0;
    for n in 0..count {
        let id = format!("fleetsim-idle-{n}-{}", new_nonce());
        let payload = request(key, id.clone(), &reply_topic);
        let sent = Instant::now();
        let _ = client
            .publish(topics.control_request(), QoS::AtLeastOnce, false, payload)
            .await;
        let answered = tokio::time::timeout(each, async {
            loop {
                match events.recv().await {
                    None => return false,
                    Some(LinkEvent::Publish { topic, payload, .. }) if topic == reply_topic => {
                        let reply = serde_json::from_slice::<ControlReply>(&payload);
                        if reply.as_ref().is_ok_and(|r| r.id == id) {
                            if let Ok(ControlReply {
                                ok: false, error, ..
                            }) = reply
                            {
                                tracing::warn!(?error, "idle probe refused");
                            }
                            return true;
                        }
                    }
                    Some(_) => {}
                }
            }
        })
        .await;
        match answered {
            Ok(true) => took.push(sent.elapsed().as_secs_f64() * 1000.0),
            Ok(false) => return Err(ProbeError::Closed),
            Err(_) => unanswered += 1,
        }
        tokio::time::sleep(gap).await;
    }
    took.sort_by(f64::total_cmp);
    Ok(IdleFigures {
        probe_idle: took.len(),
        probe_idle_p50_ms: percentile(&took, 50.0),
        probe_idle_p99_ms: percentile(&took, 99.0),
        probe_idle_max_ms: took.last().copied(),
        probe_idle_unanswered: unanswered,
    })
}
