//! A passive MQTT observer: subscribes to topic filters and records what it sees, so tests can
//! assert on reports, block requests and events exactly as a third-party integration would see
//! them on the broker.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flotilla_protocol::{envelope, BlockRequest, DesiredAction, Message, Report, Topic, Topics};
use rumqttc::{Event, Packet, QoS};

/// One message seen on the broker.
#[derive(Debug, Clone)]
pub struct WatchedMessage {
    pub topic: String,
    pub payload: Vec<u8>,
}

impl WatchedMessage {
    /// The device-facing message, if this is one; a signed device message is shown as its
    /// content ([`flotilla_protocol::device::plain`]).
    pub fn decode(&self) -> Option<Message> {
        envelope::decode(&self.payload)
            .ok()
            .map(flotilla_protocol::device::plain)
    }
}

/// Records every message on its filters from the moment it is subscribed.
pub struct Watcher {
    seen: Arc<Mutex<Vec<WatchedMessage>>>,
    topics: Topics,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Watcher {
    /// Connects to the loopback broker on `port` (plain TCP) and subscribes to `filters`,
    /// returning once the broker acknowledged the subscriptions.
    pub async fn start(port: u16, filters: &[String]) -> Watcher {
        Self::connect(crate::site::plain(port), filters).await
    }

    /// [`Watcher::start`] over `connection` (credentials, TLS).
    pub async fn connect(connection: flotilla_mqtt::Connection, filters: &[String]) -> Watcher {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut options = connection.options(format!("watcher-{}-{n}", std::process::id()));
        options.set_max_packet_size(
            flotilla_protocol::MAX_PACKET_SIZE,
            flotilla_protocol::MAX_PACKET_SIZE,
        );
        options.set_keep_alive(Duration::from_secs(30));
        let (client, mut eventloop) = flotilla_mqtt::client(options, 1000);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (acked_tx, acked_rx) = tokio::sync::oneshot::channel();
        let record = seen.clone();
        let filters = filters.to_vec();
        let expected = filters.len();
        let task = tokio::spawn(async move {
            let mut acks = 0;
            let mut acked_tx = Some(acked_tx);
            loop {
                match eventloop.poll().await {
                    // Subscribed on every connection: a clean session forgets subscriptions
                    // queued before a connection that dropped before its SubAck, and the
                    // watcher would stay deaf.
                    Ok(Event::Incoming(Packet::ConnAck(_))) => {
                        acks = 0;
                        for filter in &filters {
                            client
                                .subscribe(filter.clone(), QoS::AtLeastOnce)
                                .await
                                .expect("queue subscribe");
                        }
                    }
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        record.lock().expect("watcher lock").push(WatchedMessage {
                            topic: p.topic.clone(),
                            payload: p.payload.to_vec(),
                        });
                    }
                    Ok(Event::Incoming(Packet::SubAck(_))) => {
                        acks += 1;
                        if acks == expected {
                            if let Some(tx) = acked_tx.take() {
                                let _ = tx.send(());
                            }
                        }
                    }
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(20), acked_rx)
            .await
            .expect("watcher subscribed within 20s")
            .expect("watcher task alive");
        Watcher {
            seen,
            topics: Topics::default(),
            task,
        }
    }

    /// Everything seen so far.
    pub fn messages(&self) -> Vec<WatchedMessage> {
        self.seen.lock().expect("watcher lock").clone()
    }

    /// Forgets everything seen so far.
    pub fn clear(&self) {
        self.seen.lock().expect("watcher lock").clear();
    }

    /// The reports seen so far for one device, in arrival order.
    pub fn reports(&self, device: &str) -> Vec<Report> {
        self.messages()
            .iter()
            .filter(|m| matches!(self.topics.parse(&m.topic), Some(Topic::Report(id)) if id.as_str() == device))
            .filter_map(|m| match m.decode() {
                Some(Message::Report(r)) => Some(r),
                _ => None,
            })
            .collect()
    }

    /// The desired actions seen so far, as (device, action id), in arrival order (the
    /// signature is not checked: this is what devices were sent).
    pub fn desired_actions(&self) -> Vec<(String, String)> {
        self.messages()
            .iter()
            .filter_map(
                |m| match (self.topics.parse(&m.topic), envelope::decode(&m.payload)) {
                    (Some(Topic::Desired(id)), Ok(Message::Desired(blob))) => {
                        let action: DesiredAction =
                            envelope::from_bytes("desired action", &blob.payload).ok()?;
                        Some((id.as_str().to_owned(), action.action_id))
                    }
                    _ => None,
                },
            )
            .collect()
    }

    /// The block requests seen so far for one device, in arrival order.
    pub fn fetches(&self, device: &str) -> Vec<BlockRequest> {
        self.messages()
            .iter()
            .filter(|m| matches!(self.topics.parse(&m.topic), Some(Topic::Fetch(id)) if id.as_str() == device))
            .filter_map(|m| match m.decode() {
                Some(Message::Fetch(r)) => Some(r),
                _ => None,
            })
            .collect()
    }

    /// Waits until `done` holds for the recorded messages; panics with `what` after `timeout`.
    pub async fn wait_until<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut done: impl FnMut(&Watcher) -> Option<T>,
    ) -> T {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(value) = done(self) {
                return value;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {timeout:?} waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits for a terminal report of `device` and returns it.
    pub async fn final_report(&self, device: &str, timeout: Duration) -> Report {
        self.wait_until(&format!("a final report from {device}"), timeout, |w| {
            w.reports(device)
                .into_iter()
                .rev()
                .find(|r| r.phase.is_terminal())
        })
        .await
    }
}

/// Drives a test client's event loop for as long as the test runs, reconnecting after any error.
///
/// A loop that stops at the first error drops the event loop, and every later publish on its
/// client fails with a closed request queue: a broker that drops a flooding client for a moment
/// (rumqttd may) would fail the test on the test's own side. Errors are printed, not hidden.
pub fn keep_polling(
    name: &'static str,
    mut eventloop: rumqttc::EventLoop,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            if let Err(e) = eventloop.poll().await {
                eprintln!("{name}: MQTT connection: {e}; reconnecting");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    })
}
