//! End-to-end: who may drive the coordinator. A real coordinator process and agent, and a raw
//! MQTT client that publishes forged control requests as any client of a shared broker could:
//! unsigned, wrongly signed, signed by an unknown key, outside the clock window, replayed, and
//! by a viewer. Each gets an error reply naming why, and the rollout does not move. A signed
//! request of an operator works, and the decision trace names the operator.

use std::fs;
use std::time::Duration;

use flotilla_protocol::control::{Command, ControlReply, ControlRequest, RolloutStatus};
use flotilla_protocol::operator::{new_nonce, Role, SignedRequest};
use flotilla_protocol::{SigningKey, Topics};
use flotilla_tests::{broker_kinds, AgentOptions, BrokerKind, Site, WAIT};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use tokio::sync::mpsc;

const STRATEGY: &str = r#"
[[stage]]
name = "all"
select = "env=lab"
before = { approval = true }
"#;

const RUN: &str = r#"
name = "r1"
release = "fw-2"
[staged]
strategy = "gated"
"#;

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A bare MQTT client on the control topics, with no flotilla code between it and the broker.
struct Raw {
    client: AsyncClient,
    replies: mpsc::Receiver<ControlReply>,
    reply_to: String,
    _task: tokio::task::JoinHandle<()>,
}

impl Raw {
    async fn connect(port: u16) -> Raw {
        let reply_to = Topics::default().control_reply("raw-forger");
        let mut options = MqttOptions::new("raw-forger", "127.0.0.1", port);
        options.set_max_packet_size(1 << 20, 1 << 20);
        let (client, mut eventloop) = AsyncClient::new(options, 100);
        client
            .subscribe(reply_to.clone(), QoS::AtLeastOnce)
            .await
            .expect("queue subscribe");
        let (tx, replies) = mpsc::channel(100);
        let (subscribed_tx, subscribed) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut subscribed_tx = Some(subscribed_tx);
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::SubAck(_))) => {
                        if let Some(tx) = subscribed_tx.take() {
                            let _ = tx.send(());
                        }
                    }
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        let reply: ControlReply =
                            serde_json::from_slice(&p.payload).expect("a reply is JSON");
                        let _ = tx.send(reply).await;
                    }
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(10), subscribed)
            .await
            .expect("subscribed")
            .expect("task alive");
        Raw {
            client,
            replies,
            reply_to,
            _task: task,
        }
    }

    fn request(&self, id: &str, at: u64, command: Command) -> ControlRequest {
        ControlRequest::new(id, self.reply_to.clone(), at, new_nonce(), command)
    }

    /// Publishes a payload and returns the reply with `id`.
    async fn send(&mut self, id: &str, payload: Vec<u8>) -> ControlReply {
        self.client
            .publish(
                Topics::default().control_request(),
                QoS::AtLeastOnce,
                false,
                payload,
            )
            .await
            .expect("queue publish");
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let reply = self.replies.recv().await.expect("reply channel open");
                if reply.id == id {
                    return reply;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no reply to request {id} within 10s"))
    }

    /// Sends a request that must be refused and returns the error text.
    async fn refused(&mut self, id: &str, payload: Vec<u8>) -> String {
        let reply = self.send(id, payload).await;
        assert!(!reply.ok, "request {id} was accepted: {reply:?}");
        reply.error.expect("a refusal says why")
    }
}

fn signed(key: &SigningKey, request: &ControlRequest) -> Vec<u8> {
    serde_json::to_vec(&SignedRequest::sign(key, request)).expect("json")
}

fn start() -> Command {
    Command::StartRollout {
        rollout: "r1".into(),
    }
}

async fn state(site: &Site) -> RolloutStatus {
    site.status("r1").await.expect("r1 status")
}

/// On every broker: Mosquitto drops a client that publishes on a wildcard topic, so it also shows
/// that a hostile `reply_to` never costs the coordinator its link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_and_unauthorized_requests_are_refused_with_a_reason() {
    for kind in broker_kinds() {
        refusals_on(kind).await;
    }
}

async fn refusals_on(kind: BrokerKind) {
    let mut site = Site::new(kind);
    site.add_operator("alice", Role::Operator);
    site.add_operator("vic", Role::Viewer);
    site.release("fw-2", 2, b"firmware 2\n");
    site.start_coordinator();
    site.add_agent("lab-1", &[("env", "lab")], AgentOptions::default());
    site.wait_devices(1).await;
    let strategy = site.path("gated.toml");
    fs::write(&strategy, STRATEGY).expect("write strategy");
    site.flotilla(&[
        "strategy",
        "create",
        "gated",
        "--file",
        &strategy.to_string_lossy(),
    ]);
    // A viewer cannot create; an operator can, and the trace says who did.
    let spec = site.path("r1.toml");
    fs::write(&spec, RUN).expect("write spec");
    let as_vic = site.flotilla_output(&[
        "--operator-key",
        &site.operator_key_file("vic").to_string_lossy(),
        "rollout",
        "create",
        "--spec",
        &spec.to_string_lossy(),
    ]);
    assert!(!as_vic.status.success());
    let stderr = String::from_utf8_lossy(&as_vic.stderr);
    assert!(
        stderr.contains("not allowed: operator vic has role viewer, create_rollout needs operator"),
        "{stderr}"
    );
    let alice = site.client_as("alice").await;
    alice
        .request(
            Command::CreateRollout { spec: RUN.into() },
            Duration::from_secs(10),
        )
        .await
        .expect("alice creates r1");

    let alice_key = site.operator_key("alice");
    let mut raw = Raw::connect(site.port).await;

    // Unsigned: the plain request of the first edition.
    let unsigned = serde_json::to_vec(&raw.request("u1", now(), start())).expect("json");
    let err = raw.refused("u1", unsigned).await;
    assert!(err.starts_with("unsigned request"), "{err}");

    // Wrong signature: alice signed a status request; the forger swaps in a start.
    let mut forged = SignedRequest::sign(
        &alice_key,
        &raw.request(
            "w1",
            now(),
            Command::RolloutStatus {
                rollout: Some("r1".into()),
                page: Default::default(),
            },
        ),
    );
    forged.request = serde_json::to_string(&raw.request("w1", now(), start())).expect("json");
    let err = raw
        .refused("w1", serde_json::to_vec(&forged).expect("json"))
        .await;
    assert!(err.starts_with("wrong signature"), "{err}");

    // A key the coordinator does not know.
    let stranger = SigningKey::from_bytes(&[99; 32]);
    let err = raw
        .refused("k1", signed(&stranger, &raw.request("k1", now(), start())))
        .await;
    assert!(err.starts_with("unknown key"), "{err}");

    // Outside the clock window (60 s by default): both times are named.
    let old = now() - 3600;
    let err = raw
        .refused("c1", signed(&alice_key, &raw.request("c1", old, start())))
        .await;
    assert!(
        err.starts_with("clock skew") && err.contains(&old.to_string()),
        "{err}"
    );

    // A viewer's correctly signed start.
    let vic_key = site.operator_key("vic");
    let err = raw
        .refused("v1", signed(&vic_key, &raw.request("v1", now(), start())))
        .await;
    assert_eq!(
        err,
        "not allowed: operator vic has role viewer, start_rollout needs operator"
    );

    // An invalid reply_to gets no reply, and the coordinator keeps answering.
    let mut bad = raw.request("b1", now(), start());
    bad.reply_to = "flotilla/v1/control/reply/#".into();
    raw.client
        .publish(
            Topics::default().control_request(),
            QoS::AtLeastOnce,
            false,
            signed(&alice_key, &bad),
        )
        .await
        .expect("queue");

    // Nothing of that moved the rollout.
    assert_eq!(state(&site).await.state, "ready");

    // Alice's own signed start, through the raw client: it works, and is named.
    let ok = raw
        .send("s1", signed(&alice_key, &raw.request("s1", now(), start())))
        .await;
    assert!(ok.ok, "{ok:?}");
    let status = state(&site).await;
    assert_eq!(status.state, "running");
    let messages: Vec<&str> = status.trace.iter().map(|t| t.message.as_str()).collect();
    assert!(
        messages
            .iter()
            .any(|m| m.contains("rollout started by alice")),
        "{messages:#?}"
    );
    assert!(
        messages.iter().any(|m| m.starts_with("created by alice")),
        "{messages:#?}"
    );

    // Replay: alice's pause, published twice with a resume between. The copy is refused.
    let pause = signed(
        &alice_key,
        &raw.request(
            "p1",
            now(),
            Command::PauseRollout {
                rollout: "r1".into(),
            },
        ),
    );
    assert!(raw.send("p1", pause.clone()).await.ok);
    assert_eq!(state(&site).await.state, "paused");
    alice
        .request(
            Command::ResumeRollout {
                rollout: "r1".into(),
            },
            Duration::from_secs(10),
        )
        .await
        .expect("resumed");
    let err = raw.refused("p1", pause).await;
    assert!(err.starts_with("replayed request"), "{err}");
    let status = state(&site).await;
    assert_eq!(status.state, "running", "the replay did not pause it");

    // The approval is alice's too; the run then finishes.
    alice
        .request(
            Command::Approve {
                name: "r1-before-all".into(),
            },
            Duration::from_secs(10),
        )
        .await
        .expect("approved");
    let status = site
        .wait_status("r1", "r1 to finish", WAIT, |s| s.state == "finished")
        .await;
    assert!(
        status
            .trace
            .iter()
            .any(|t| t.message == "approval r1-before-all approved by alice"),
        "{:#?}",
        status.trace
    );
}

/// How many viewer requests the flood sends: more than the 100,000 nonces the whole coordinator
/// once remembered, so the old shared cache would have filled and refused everyone.
const FLOOD: usize = 110_000;

/// A raw client that publishes a flood (QoS 1) and counts the broker's acknowledgements and the
/// replies on its own reply topic.
struct Flooder {
    client: AsyncClient,
    reply_to: String,
    acked: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    replies: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    _task: tokio::task::JoinHandle<()>,
}

impl Flooder {
    async fn connect(port: u16) -> Flooder {
        use std::sync::atomic::Ordering;
        let reply_to = Topics::default().control_reply("raw-flooder");
        let mut options = MqttOptions::new("raw-flooder", "127.0.0.1", port);
        options.set_max_packet_size(1 << 20, 1 << 20);
        options.set_inflight(1000);
        let (client, mut eventloop) = AsyncClient::new(options, 10_000);
        client
            .subscribe(reply_to.clone(), QoS::AtLeastOnce)
            .await
            .expect("queue subscribe");
        let acked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let replies = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (subscribed_tx, subscribed) = tokio::sync::oneshot::channel();
        let task = tokio::spawn({
            let (acked, replies) = (acked.clone(), replies.clone());
            async move {
                let mut subscribed_tx = Some(subscribed_tx);
                loop {
                    match eventloop.poll().await {
                        Ok(Event::Incoming(Packet::SubAck(_))) => {
                            if let Some(tx) = subscribed_tx.take() {
                                let _ = tx.send(());
                            }
                        }
                        Ok(Event::Incoming(Packet::PubAck(_))) => {
                            acked.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(Event::Incoming(Packet::Publish(_))) => {
                            replies.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => {}
                        Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                    }
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(10), subscribed)
            .await
            .expect("subscribed")
            .expect("task alive");
        Flooder {
            client,
            reply_to,
            acked,
            replies,
            _task: task,
        }
    }

    /// Waits until the broker acknowledged `n` publishes.
    async fn wait_acked(&self, n: usize) {
        let deadline = std::time::Instant::now() + WAIT * 3;
        while self.acked.load(std::sync::atomic::Ordering::Relaxed) < n {
            assert!(
                std::time::Instant::now() < deadline,
                "the broker acknowledged {} of {n} publishes",
                self.acked.load(std::sync::atomic::Ordering::Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Requests of `key`, signed ahead (on every core), each with its own nonce, all made at `at`.
fn signed_flood(key: &SigningKey, reply_to: &str, at: u64, n: usize) -> Vec<Vec<u8>> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let chunk = n.div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    (t * chunk..((t + 1) * chunk).min(n))
                        .map(|i| {
                            let request = ControlRequest::new(
                                format!("flood-{i}"),
                                reply_to,
                                at,
                                format!("flood-nonce-{i}"),
                                Command::ListDevices {
                                    page: Default::default(),
                                },
                            );
                            signed(key, &request)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("signing thread"))
            .collect()
    })
}

/// The attack of issue 19, against a real coordinator over a broker: a viewer key floods
/// validly signed requests stamped just inside the clock window, more than the coordinator
/// once remembered in all. An operator pauses the rollout in the middle of the flood and stops
/// it right after: both are answered and acted on. The viewer's flood costs the viewer: it is
/// rate limited (counted per operator in /metrics) and mostly unanswered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_viewers_flood_never_holds_back_an_operators_pause_and_stop() {
    use std::sync::atomic::Ordering;
    let mut site = Site::new(BrokerKind::Embedded);
    let metrics_port = site.enable_metrics();
    site.add_operator("alice", Role::Operator);
    site.add_operator("vic", Role::Viewer);
    site.release("fw-2", 2, b"firmware 2\n");
    site.start_coordinator();
    site.add_agent("lab-1", &[("env", "lab")], AgentOptions::default());
    site.wait_devices(1).await;
    let strategy = site.path("gated.toml");
    fs::write(&strategy, STRATEGY).expect("write strategy");
    site.flotilla(&[
        "strategy",
        "create",
        "gated",
        "--file",
        &strategy.to_string_lossy(),
    ]);
    let alice = site.client_as("alice").await;
    alice
        .request(
            Command::CreateRollout { spec: RUN.into() },
            Duration::from_secs(10),
        )
        .await
        .expect("alice creates r1");
    alice
        .request(start(), Duration::from_secs(10))
        .await
        .expect("alice starts r1");
    assert_eq!(state(&site).await.state, "running");

    let flooder = Flooder::connect(site.port).await;
    let signing = std::time::Instant::now();
    // Stamped just inside the 60 s clock window, as the attack did.
    let flood = signed_flood(
        &site.operator_key("vic"),
        &flooder.reply_to,
        now() + 55,
        FLOOD,
    );
    eprintln!("signed {FLOOD} viewer requests in {:?}", signing.elapsed());
    let flooding = std::time::Instant::now();
    let publisher = tokio::spawn({
        let client = flooder.client.clone();
        async move {
            for payload in flood {
                client
                    .publish(
                        Topics::default().control_request(),
                        QoS::AtLeastOnce,
                        false,
                        payload,
                    )
                    .await
                    .expect("queue a flood publish");
            }
        }
    });
    // In the middle of the flood: alice pauses the rollout.
    flooder.wait_acked(FLOOD / 2).await;
    let asked = std::time::Instant::now();
    alice
        .request(
            Command::PauseRollout {
                rollout: "r1".into(),
            },
            Duration::from_secs(10),
        )
        .await
        .expect("alice's pause is answered during the flood");
    eprintln!(
        "pause answered {:?} after it was sent, mid-flood",
        asked.elapsed()
    );
    assert_eq!(state(&site).await.state, "paused");
    // After every flood request reached the broker, and so the coordinator before alice's stop.
    publisher.await.expect("flood published");
    flooder.wait_acked(FLOOD).await;
    eprintln!("the broker took the flood in {:?}", flooding.elapsed());
    let asked = std::time::Instant::now();
    alice
        .request(
            Command::StopRollout {
                rollout: "r1".into(),
            },
            Duration::from_secs(10),
        )
        .await
        .expect("alice's stop is answered after the flood");
    eprintln!("stop answered {:?} after it was sent", asked.elapsed());
    let status = state(&site).await;
    assert_eq!(status.state, "stopped");
    assert!(
        status
            .trace
            .iter()
            .any(|t| t.message.contains("stopped by alice")),
        "{:#?}",
        status.trace
    );
    // The flood was refused by the viewer's own limit, and almost none of it was answered.
    let text = flotilla_tests::scrape_metrics(metrics_port).await;
    let limited = metric(
        &text,
        "flotilla_control_requests_rate_limited_total{operator=\"vic\",role=\"viewer\",limit=\"key\"}",
    );
    assert!(limited >= (FLOOD - 10_000) as f64, "{limited}:\n{text}");
    let alice_limited = metric(
        &text,
        "flotilla_control_requests_rate_limited_total{operator=\"alice\",role=\"operator\",limit=\"key\"}",
    );
    assert_eq!(alice_limited, 0.0, "{text}");
    let replies = flooder.replies.load(Ordering::Relaxed);
    eprintln!("{replies} replies to {FLOOD} flood requests; {limited} rate limited");
    assert!(
        replies < FLOOD / 20,
        "{replies} replies to {FLOOD} requests: refusals must not flood the broker"
    );
}

/// The value of the sample written exactly as `series` (name and labels).
fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
}
