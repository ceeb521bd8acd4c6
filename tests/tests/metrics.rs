//! The coordinator's `/metrics` endpoint, scraped over HTTP from a real `flotilla serve` that
//! runs a small rollout with real agents: what a Prometheus server would see.

use std::time::{Duration, Instant};

use flotilla_tests::{AgentOptions, BrokerKind, Site, WAIT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const FIRMWARE: &[u8] = b"firmware 3.0, counted\n";
const DEVICES: usize = 4;

/// One HTTP exchange with the coordinator's metrics port: the status line and the body.
async fn get(port: u16, request: &str) -> (String, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the metrics port");
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    let mut answer = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut answer))
        .await
        .expect("the endpoint answers and closes")
        .expect("read the answer");
    let answer = String::from_utf8(answer).expect("the answer is text");
    let (head, body) = answer.split_once("\r\n\r\n").expect("a head and a body");
    (
        head.lines().next().unwrap_or_default().to_owned(),
        body.to_owned(),
    )
}

async fn scrape(port: u16) -> String {
    let (status, body) = get(port, "GET /metrics HTTP/1.1\r\nHost: coordinator\r\n\r\n").await;
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    body
}

/// The samples of metric `name`: the label text between the braces, and the value.
fn samples(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let (labels, value) = match rest.strip_prefix('{') {
                Some(rest) => rest.split_once("} ")?,
                None => ("", rest.strip_prefix(' ')?),
            };
            Some((labels.to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}

/// The value of the one sample of `name` whose labels are exactly `labels`.
fn value(text: &str, name: &str, labels: &str) -> Option<f64> {
    samples(text, name)
        .into_iter()
        .find(|(l, _)| l == labels)
        .map(|(_, v)| v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_a_finished_rollout_its_devices_messages_and_a_malformed_payload() {
    let mut site = Site::new(BrokerKind::Embedded);
    let port = site.enable_metrics();
    site.release("fw-3", 3, FIRMWARE);
    site.start_coordinator();
    for i in 1..=DEVICES {
        site.add_agent(
            &format!("dev-{i:02}"),
            &[("env", "metrics")],
            AgentOptions::default(),
        );
    }
    site.wait_devices(DEVICES).await;

    // Garbage on a device's report topic: dropped, and counted as undecodable.
    site.publish(
        "flotilla/v1/devices/dev-01/report",
        b"not an envelope".to_vec(),
        false,
    )
    .await;

    site.create_and_start(
        "name = \"fw-counted\"\nrelease = \"fw-3\"\nselect = \"env=metrics\"\n[groups]\ncount = 2\n\
         success = { threshold = \"100%\", action = \"next\" }\n",
    )
    .await;
    let status = site
        .wait_status("fw-counted", "the rollout to finish", WAIT, |s| {
            s.state == "finished"
        })
        .await;
    assert_eq!(status.groups.len(), 2, "{status:#?}");

    // The snapshot behind the gauges is taken on the service's tick after a scrape asks.
    let deadline = Instant::now() + WAIT;
    let text = loop {
        let text = scrape(port).await;
        if value(&text, "flotilla_rollouts", "state=\"finished\"") == Some(1.0) {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "the scrape never showed the rollout finished:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    assert_eq!(
        value(&text, "flotilla_rollouts", "state=\"running\""),
        Some(0.0),
        "every state is shown, zero where none is:\n{text}"
    );
    assert_eq!(
        value(
            &text,
            "flotilla_rollout_info",
            "rollout=\"fw-counted\",release=\"fw-3\",state=\"finished\",strategy=\"groups\""
        ),
        Some(1.0),
        "{text}"
    );

    // Devices by phase, per group: every device ready, in the two groups of the rollout.
    let devices = samples(&text, "flotilla_rollout_devices");
    let ready: Vec<&(String, f64)> = devices
        .iter()
        .filter(|(l, _)| l.starts_with("rollout=\"fw-counted\"") && l.ends_with("phase=\"ready\""))
        .collect();
    assert_eq!(ready.len(), 2, "one ready series per group:\n{text}");
    assert_eq!(
        ready.iter().map(|(_, v)| v).sum::<f64>(),
        DEVICES as f64,
        "{text}"
    );
    for group in status.groups.iter().map(|g| &g.name) {
        assert!(
            ready
                .iter()
                .any(|(l, _)| l.contains(&format!("group=\"{group}\""))),
            "group {group} has its own series:\n{text}"
        );
    }
    assert!(
        devices.iter().all(|(l, _)| l.ends_with("phase=\"ready\"")),
        "no device is left in another phase:\n{text}"
    );

    // Messages in and out, by topic kind.
    let received = |kind: &str| {
        value(
            &text,
            "flotilla_messages_received_total",
            &format!("topic=\"{kind}\""),
        )
        .unwrap_or(0.0)
    };
    let published = |kind: &str| {
        value(
            &text,
            "flotilla_messages_published_total",
            &format!("topic=\"{kind}\""),
        )
        .unwrap_or(0.0)
    };
    assert!(received("state") >= DEVICES as f64, "{text}");
    // Each device reports several phases, and the garbage came on a report topic too.
    assert!(received("report") > DEVICES as f64, "{text}");
    assert!(
        received("control_request") >= 2.0,
        "create and start at least:\n{text}"
    );
    assert!(published("desired") >= DEVICES as f64, "{text}");
    assert!(published("control_reply") >= 2.0, "{text}");
    assert!(published("rollout_event") >= 1.0, "{text}");

    // The malformed payload, by reason; nothing else was malformed.
    assert_eq!(
        value(
            &text,
            "flotilla_messages_malformed_total",
            "reason=\"undecodable\""
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        samples(&text, "flotilla_messages_malformed_total")
            .iter()
            .map(|(_, v)| v)
            .sum::<f64>(),
        1.0,
        "{text}"
    );

    // The agents fetched the release in blocks from the coordinator.
    let bytes = value(&text, "flotilla_artifact_block_bytes_served_total", "").unwrap_or(0.0);
    assert!(
        bytes >= (FIRMWARE.len() * DEVICES) as f64,
        "every device's download is counted:\n{text}"
    );

    // Both groups' starts were timed (the first by the start command, the second by the last
    // report of the first), and so were the reports.
    let transitions = value(
        &text,
        "flotilla_update_run_group_transition_seconds_count",
        "",
    )
    .unwrap_or(0.0);
    assert!(transitions >= 2.0, "{text}");
    let decided = value(
        &text,
        "flotilla_rollout_decision_seconds_count",
        "input=\"report\"",
    )
    .unwrap_or(0.0);
    assert!(decided >= received("report"), "{text}");
    assert!(
        value(&text, "flotilla_link_connects_total", "").unwrap_or(0.0) >= 1.0,
        "{text}"
    );
    assert_eq!(
        value(&text, "flotilla_store_failing", ""),
        Some(0.0),
        "{text}"
    );
    assert!(text.trim_end().ends_with("# EOF"), "{text}");

    // The endpoint serves nothing else.
    let (status, _) = get(port, "GET /debug HTTP/1.1\r\n\r\n").await;
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    let (status, _) = get(port, "DELETE /metrics HTTP/1.1\r\n\r\n").await;
    assert_eq!(status, "HTTP/1.1 405 Method Not Allowed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metrics_address_in_use_stops_the_start_with_the_setting_named() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let dir = tempfile::tempdir().expect("tempdir");
    let site = Site::new(BrokerKind::Embedded);
    std::fs::create_dir(dir.path().join("data")).expect("data dir");
    let config = dir.path().join("coordinator.toml");
    std::fs::write(
        &config,
        format!(
            "data_dir = {:?}\ncoordinator_key = {:?}\n[broker]\nport = {}\n[metrics]\nlisten = \"127.0.0.1:{port}\"\n",
            dir.path().join("data"),
            site.path("keys/coordinator.key"),
            site.port,
        ),
    )
    .expect("write config");
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(flotilla_tests::bin("flotilla"))
            .args(["serve", "--config"])
            .arg(&config)
            .env_remove("FLOTILLA_BROKER")
            .output()
            .expect("run flotilla serve")
    })
    .await
    .expect("task");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("metrics.listen") && stderr.contains(&port.to_string()),
        "{stderr}"
    );
    drop(taken);
}

/// Idle connections in every slot of a real coordinator's metrics port, more of them than it
/// serves at once: a scrape that comes after them is still answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_never_keep_a_scrape_out() {
    let mut site = Site::new(BrokerKind::Embedded);
    let port = site.enable_metrics();
    site.start_coordinator();
    let deadline = Instant::now() + WAIT;
    while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        assert!(Instant::now() < deadline, "the metrics port never opened");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut idle = Vec::new();
    for _ in 0..64 {
        idle.push(
            TcpStream::connect(("127.0.0.1", port))
                .await
                .expect("connect an idle client"),
        );
    }
    let text = scrape(port).await;
    assert!(
        text.contains("flotilla_messages_received_total"),
        "the scrape got the metrics:\n{text}"
    );
}
