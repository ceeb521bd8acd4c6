//! Enrollment tokens that cannot be guessed, end to end: `flotilla serve` refuses a weak token
//! in its config, naming the field and how to make one; `flotilla enrollment token` makes one
//! it takes; and a flood of guessed token proofs against a real coordinator is checked only
//! within the attempt limits, counted in `/metrics`, named in a warning with its rate, and does
//! not keep a real device with a real token out.

use std::fs;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use flotilla_protocol::{
    device, envelope, DeviceId, DeviceMessage, DeviceState, Message, SigningKey, Topics,
};
use flotilla_tests::{bin, free_port, AgentOptions, BrokerKind, Site, WAIT};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};

#[test]
fn weak_tokens_are_refused_and_generated_ones_are_taken() {
    let out = Command::new(bin("flotilla"))
        .args(["enrollment", "token", "--count", "3"])
        .output()
        .expect("run flotilla enrollment token");
    assert!(out.status.success(), "{out:?}");
    let tokens: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(tokens.len(), 3, "{tokens:?}");
    for token in &tokens {
        assert!(
            token.len() == 64 && token.chars().all(|c| c.is_ascii_hexdigit()),
            "{token}"
        );
    }
    assert!(tokens[0] != tokens[1] && tokens[1] != tokens[2]);

    let dir = tempfile::tempdir().expect("tempdir");
    let serve = |tokens: &[String]| {
        let config = dir.path().join("coordinator.toml");
        fs::write(
            &config,
            format!(
                "data_dir = \"data\"\ncoordinator_key = \"keys/coordinator.key\"\n[broker]\n\
                 port = {}\n[enrollment]\ntokens = {tokens:?}\n",
                free_port()
            ),
        )
        .expect("write config");
        let mut child = Command::new(bin("flotilla"))
            .args(["serve", "--config"])
            .arg(&config)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start flotilla serve");
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                let out = child.wait_with_output().expect("output");
                let text = format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                return (Some(status), text);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return (None, String::new());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    // The 8-character token the config used to take, among good ones.
    let mut weak = tokens.clone();
    weak.push("hunter22".into());
    let (status, text) = serve(&weak);
    assert!(status.is_some_and(|s| !s.success()), "{text}");
    assert!(
        text.contains("enrollment.tokens")
            && text.contains("(token 4 of 4)")
            && text.contains("128 bits")
            && text.contains("flotilla enrollment token")
            && !text.contains("hunter22"),
        "{text}"
    );
    // The generated tokens pass the config; the start then stops at the missing key file.
    let (_, text) = serve(&tokens);
    assert!(!text.contains("enrollment.tokens"), "{text}");
    assert!(text.contains("coordinator.key"), "{text}");
}

/// A state of a made-up device under `key`, with a proof of `token` (a guess).
fn guess(key: &SigningKey, device_id: &str, token: &str) -> Vec<u8> {
    let state = DeviceState {
        device_id: device_id.into(),
        hardware_id: "test-board".into(),
        labels: vec![("env".into(), "lab".into())],
        installed: None,
        current: None,
        online: true,
        agent_version: "guesser".into(),
        at: flotilla_tests::unix_now(),
    };
    let enrollment = Some(device::enrollment_proof(
        token,
        device_id,
        &key.verifying_key(),
    ));
    envelope::encode(&Message::Device(device::sign(
        key,
        &DeviceMessage::State { state, enrollment },
    )))
}

fn attempts(text: &str, result: &str) -> Option<f64> {
    let series = format!("flotilla_enrollment_attempts_total{{result=\"{result}\"}}");
    text.lines()
        .find_map(|line| line.strip_prefix(series.as_str())?.trim().parse().ok())
}

/// How many guesses go to one device id, and how many to as many made-up ids.
const ONE_ID: usize = 1000;
const MANY_IDS: usize = 1000;

/// The attack of issue 19: token proofs guessed as fast as the broker takes them, for one
/// device id and for many. The coordinator checks a handful for the one id and 20 a second
/// (200 at once) in all, counts the rest as limited, warns with the rate of failed attempts,
/// and a real device that comes up after the flood still enrolls with its token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guessed_tokens_are_limited_counted_and_named_in_the_log() {
    let mut site = Site::new(BrokerKind::Embedded);
    let metrics_port = site.enable_metrics();
    site.start_coordinator();
    site.add_agent("lab-1", &[("env", "lab")], AgentOptions::default());
    site.wait_devices(1).await;

    let rogue = SigningKey::from_bytes(&[77; 32]);
    let topics = Topics::default();
    let mut payloads = Vec::new();
    for i in 0..ONE_ID {
        let id = "target-1";
        payloads.push((
            topics.state(&DeviceId::new(id).expect("id")),
            guess(&rogue, id, &format!("{i:032x}")),
        ));
    }
    for i in 0..MANY_IDS {
        let id = format!("ghost-{i:04}");
        payloads.push((
            topics.state(&DeviceId::new(id.as_str()).expect("id")),
            guess(&rogue, &id, &format!("{i:032x}")),
        ));
    }
    let mut options = MqttOptions::new("raw-guesser", "127.0.0.1", site.port);
    options.set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut eventloop) = AsyncClient::new(options, 10_000);
    let sent = payloads.len();
    let acked = tokio::spawn(async move {
        let mut acked = 0;
        while acked < sent {
            match eventloop.poll().await {
                Ok(Event::Incoming(Packet::PubAck(_))) => acked += 1,
                Ok(_) => {}
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    });
    let flooding = Instant::now();
    for (topic, payload) in payloads {
        client
            .publish(topic, QoS::AtLeastOnce, false, payload)
            .await
            .expect("queue a guess");
    }
    tokio::time::timeout(WAIT, acked)
        .await
        .expect("the broker took every guess")
        .expect("poll task");
    eprintln!("{sent} guesses published in {:?}", flooding.elapsed());

    // Every guess reaches the coordinator and is counted, as checked or as limited.
    let deadline = Instant::now() + WAIT;
    let (failed, limited) = loop {
        let text = flotilla_tests::scrape_metrics(metrics_port).await;
        let failed =
            attempts(&text, "failed").expect("flotilla_enrollment_attempts_total in /metrics");
        let limited = attempts(&text, "limited").unwrap_or_default();
        if failed + limited >= sent as f64 {
            break (failed, limited);
        }
        assert!(
            Instant::now() < deadline,
            "only {failed} failed and {limited} limited attempts of {sent} counted:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!("{failed} guesses checked (all failed), {limited} held back by the limits");
    // One device id gets at most a handful of checks a minute; all of them 200 at once, then
    // 20 a second.
    assert!(limited >= (ONE_ID - 20) as f64, "{limited}");
    assert!(failed < (sent / 2) as f64, "{failed}");

    // A warning names the rate of failed attempts.
    let deadline = Instant::now() + WAIT;
    loop {
        let log = fs::read_to_string(site.path("coordinator.log")).unwrap_or_default();
        if let Some(line) = log
            .lines()
            .find(|l| l.contains("WARN") && l.contains("failed enrollment attempts at "))
        {
            assert!(
                line.contains("/s") && line.contains("guessing enrollment tokens"),
                "{line}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no warning naming the rate of failed enrollment attempts:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A real device that comes up now, with a real token, enrolls despite the guesses waiting.
    site.add_agent("lab-2", &[("env", "lab")], AgentOptions::default());
    site.wait_devices(2).await;
}
