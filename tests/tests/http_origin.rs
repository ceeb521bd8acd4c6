//! Artifacts from an HTTP(S) origin (decisions 0062, 0064): a release names where its artifact
//! can be fetched over HTTP (`release create --url`, `release locate`); devices fetch its blocks
//! with range requests from there, check each against the signed block list, and fall back to
//! the coordinator when the origin serves bad bytes, goes silent or fails. An HTTPS origin with
//! a private CA serves the devices that name the CA (`[origins] ca_file`); a redirect is
//! followed within bounds. Bytes by source show `http` in the rollout's status, as
//! `flotilla rollout status` prints it.

use std::fs;

use flotilla_protocol::control::RolloutStatus;
use flotilla_protocol::{Phase, Topics};
use flotilla_tests::origin::{Origin, OriginCerts, Serves};
use flotilla_tests::{AgentOptions, BrokerKind, Site, Watcher, WAIT};

/// An artifact of `kib` KiB that shares no block with another `seed`'s (nor with the factory
/// file), so nothing is copied locally.
fn artifact(kib: u32, seed: u32) -> Vec<u8> {
    (0..kib * 1024)
        .map(|i| ((i / 7 + seed * 31) % 251) as u8 ^ (i >> 16) as u8)
        .collect()
}

fn one_group(name: &str, release: &str) -> String {
    format!(
        r#"
name = "{name}"
release = "{release}"
[groups]
count = 1
success = {{ threshold = "100%", action = "next" }}
error = {{ threshold = "50%", action = "pause" }}
"#
    )
}

/// A site with its coordinator and one device, `dev-1`, whose agent gives a silent source
/// `timeout` per block before it moves on.
async fn site_with_device(options: AgentOptions, timeout: &str) -> Site {
    let mut site = Site::new(BrokerKind::Embedded);
    site.start_coordinator();
    let options = AgentOptions {
        extra_config: Some(format!("peer_timeout = \"{timeout}\"")),
        ..options
    };
    site.add_agent("dev-1", &[("env", "test")], options);
    site.wait_devices(1).await;
    site
}

/// Rolls `release` out to `dev-1` and waits until it finished with the device's bytes counted;
/// checks the device holds `content`.
async fn roll_out(site: &Site, rollout: &str, release: &str, content: &[u8]) -> RolloutStatus {
    site.create_and_start(&one_group(rollout, release)).await;
    let status = site
        .wait_status(rollout, "the rollout to finish with its bytes", WAIT, |s| {
            s.state == "finished" && s.bytes.coordinator + s.bytes.http >= content.len() as u64
        })
        .await;
    assert_eq!(
        fs::read(site.target_file("dev-1")).expect("target"),
        content,
        "{rollout}: the device holds the release"
    );
    status
}

fn agent_log(site: &Site) -> String {
    log_of(site, "dev-1")
}

fn log_of(site: &Site, id: &str) -> String {
    fs::read_to_string(site.path(&format!("agents/{id}/agent.log"))).expect("agent log")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_origin_with_a_private_ca_serves_the_devices_that_name_the_ca() {
    let mut site = Site::new(BrokerKind::Embedded);
    site.start_coordinator();
    let certs_dir = site.path("origin-tls");
    fs::create_dir_all(&certs_dir).expect("certs dir");
    let certs = OriginCerts::make(&certs_dir);
    let with_ca = AgentOptions {
        extra_config: Some(format!(
            "peer_timeout = \"1s\"\n[origins]\nca_file = {:?}",
            certs.ca
        )),
        ..AgentOptions::default()
    };
    let without_ca = AgentOptions {
        extra_config: Some("peer_timeout = \"1s\"".to_owned()),
        ..AgentOptions::default()
    };
    site.add_agent("dev-1", &[("env", "test")], with_ca);
    site.add_agent("dev-2", &[("env", "test")], without_ca);
    site.wait_devices(2).await;

    let origin = Origin::start_tls(site.path(""), Serves::Ranges, &certs);
    let fw2 = artifact(512, 2);
    let url = origin.url("fw-2.bin");
    assert!(url.starts_with("https://"), "{url}");
    site.release_with("fw-2", 2, &fw2, &["--url", &format!("app={url}")]);
    site.create_and_start(&one_group("private-ca", "fw-2"))
        .await;
    let size = fw2.len() as u64;
    let status = site
        .wait_status("private-ca", "both devices to finish", WAIT, |s| {
            s.state == "finished" && s.bytes.coordinator + s.bytes.http >= 2 * size
        })
        .await;
    for id in ["dev-1", "dev-2"] {
        assert_eq!(
            fs::read(site.target_file(id)).expect("target"),
            fw2,
            "{id} holds the release"
        );
    }
    // dev-2 cannot use the origin at all, so every byte from http is dev-1's: all of them.
    assert_eq!(status.bytes.http, size, "{:?}", status.bytes);
    assert!(
        status.bytes.coordinator >= size,
        "the coordinator served dev-2: {:?}",
        status.bytes
    );
    assert!(
        !log_of(&site, "dev-1").contains("bypassing the HTTP origin"),
        "dev-1 trusts the origin's certificate"
    );
    let log = log_of(&site, "dev-2");
    let line = log
        .lines()
        .find(|l| l.contains("bypassing the HTTP origin"))
        .unwrap_or_else(|| panic!("dev-2 bypasses the origin: {log}"));
    assert!(
        line.contains("invalid peer certificate") && line.contains("UnknownIssuer"),
        "the log names the certificate failure: {line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_to_another_origin_is_followed_and_a_redirect_loop_falls_back() {
    let site = site_with_device(AgentOptions::default(), "1s").await;

    // The release names the first origin, which answers 302 to the same path on the second.
    let store = Origin::start(site.path(""), Serves::Ranges);
    let front = Origin::start(site.path(""), Serves::RedirectTo(store.port));
    let fw2 = artifact(1024, 2);
    let url = format!("app={}", front.url("fw-2.bin"));
    site.release_with("fw-2", 2, &fw2, &["--url", &url]);
    let status = roll_out(&site, "redirected", "fw-2", &fw2).await;
    assert_eq!(status.bytes.http, fw2.len() as u64, "{:?}", status.bytes);
    let blocks = store.ranges().len();
    assert!(
        store.bytes_asked() >= fw2.len() as u64,
        "the second origin served every block: {:?}",
        store.ranges()
    );
    // Where the redirect led is remembered: one redirect per connection (4 at most), not one
    // per block.
    let redirects = front.redirects();
    assert!(
        (1..=4).contains(&redirects),
        "{redirects} redirects for {blocks} requests"
    );

    // An origin that redirects to itself: the device falls back to the coordinator.
    let looping = Origin::start(site.path(""), Serves::RedirectLoop);
    let fw3 = artifact(256, 3);
    let url = format!("app={}", looping.url("fw-3.bin"));
    site.release_with("fw-3", 3, &fw3, &["--url", &url]);
    let status = roll_out(&site, "loop", "fw-3", &fw3).await;
    assert_eq!(status.bytes.http, 0, "{:?}", status.bytes);
    let log = agent_log(&site);
    let line = log
        .lines()
        .find(|l| l.contains("a redirect loop"))
        .unwrap_or_else(|| panic!("the log names the loop: {log}"));
    assert!(
        line.contains(&format!("127.0.0.1:{}/fw-3.bin", looping.port)),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_fetches_from_a_range_origin_and_from_pythons_http_server() {
    let mut site = site_with_device(AgentOptions::default(), "1s").await;

    // The harness origin, which answers range requests.
    let origin = Origin::start(site.path(""), Serves::Ranges);
    let fw2 = artifact(512, 2);
    let url = format!("app={}", origin.url("fw-2.bin"));
    site.release_with("fw-2", 2, &fw2, &["--url", &url]);
    let status = roll_out(&site, "from-origin", "fw-2", &fw2).await;
    assert_eq!(status.bytes.http, fw2.len() as u64, "{:?}", status.bytes);
    assert!(
        status.bytes.coordinator < 4096,
        "only the block list comes from the coordinator: {:?}",
        status.bytes
    );
    assert!(
        !origin.ranges().is_empty(),
        "the origin was asked for ranges"
    );
    let text = site.flotilla(&["rollout", "status", "from-origin"]);
    assert!(
        text.contains(&format!("{} from http", fw2.len())),
        "`rollout status` shows the bytes from http: {text}"
    );

    // Python's http.server ignores Range: it answers 200 with the whole file, which the agent
    // streams once.
    let dir = site.path("");
    let port = site.start_python_http_server(&dir);
    let fw3 = artifact(512, 3);
    let url = format!("app=http://127.0.0.1:{port}/fw-3.bin");
    site.release_with("fw-3", 3, &fw3, &["--url", &url]);
    let status = roll_out(&site, "from-python", "fw-3", &fw3).await;
    assert_eq!(status.bytes.http, fw3.len() as u64, "{:?}", status.bytes);
    assert!(
        agent_log(&site).contains("ignores range requests"),
        "the agent says it streams the whole file"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_serving_corrupt_blocks_is_bypassed_and_the_device_installs() {
    let site = site_with_device(AgentOptions::default(), "1s").await;
    // Good for the first two blocks (64 KiB each), corrupt from the third on.
    let origin = Origin::start(site.path(""), Serves::CorruptFrom(2 * 65536));
    let fw2 = artifact(512, 2);
    let url = format!("app={}", origin.url("fw-2.bin"));
    site.release_with("fw-2", 2, &fw2, &["--url", &url]);
    let status = roll_out(&site, "corrupt", "fw-2", &fw2).await;
    assert!(
        status.bytes.coordinator >= fw2.len() as u64 - status.bytes.http,
        "the coordinator served what the origin did not: {:?}",
        status.bytes
    );
    assert!(
        status.bytes.http <= 2 * 65536,
        "no corrupt byte was counted as the origin's: {:?}",
        status.bytes
    );
    let log = agent_log(&site);
    let named = format!(
        "bypassing the HTTP origin 127.0.0.1:{}/fw-2.bin",
        origin.port
    );
    let line = log
        .lines()
        .find(|l| l.contains(&named))
        .unwrap_or_else(|| panic!("the log names the origin: {log}"));
    assert!(
        line.contains("at block") && line.contains("signed hash"),
        "the log names the block and why: {line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_that_times_out_or_answers_404_mid_transfer_falls_back_to_the_coordinator() {
    let site = site_with_device(AgentOptions::default(), "1s").await;

    let silent = Origin::start(site.path(""), Serves::Silent);
    let fw2 = artifact(256, 2);
    let url = format!("app={}", silent.url("fw-2.bin"));
    site.release_with("fw-2", 2, &fw2, &["--url", &url]);
    let status = roll_out(&site, "silent", "fw-2", &fw2).await;
    assert_eq!(status.bytes.http, 0, "{:?}", status.bytes);
    assert!(
        agent_log(&site).contains("no answer within 1s"),
        "the log says the origin did not answer"
    );

    // Four requests served, then 404: the device keeps what verified and fetches the rest from
    // the coordinator. The first four requests ask for at most the 4 MiB the device keeps
    // outstanding at an origin (in runs of blocks), so a 6 MiB artifact needs a fifth.
    let failing = Origin::start(site.path(""), Serves::NotFoundAfter(4));
    let fw3 = artifact(6 * 1024, 3);
    let url = format!("app={}", failing.url("fw-3.bin"));
    site.release_with("fw-3", 3, &fw3, &["--url", &url]);
    let status = roll_out(&site, "not-found", "fw-3", &fw3).await;
    assert!(status.bytes.http > 0, "{:?}", status.bytes);
    assert!(status.bytes.http <= 4 << 20, "{:?}", status.bytes);
    assert!(status.bytes.coordinator > 0, "{:?}", status.bytes);
    assert!(
        agent_log(&site).contains("HTTP 404 Not Found"),
        "the log names the status"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_killed_mid_download_from_http_resumes_without_refetching() {
    // 1 MiB at 256 KiB/s: about four seconds of download to interrupt.
    let options = AgentOptions {
        max_bytes_per_sec: 256 * 1024,
        ..AgentOptions::default()
    };
    let mut site = site_with_device(options, "3s").await;
    let origin = Origin::start(site.path(""), Serves::Ranges);
    let fw2 = artifact(1024, 2);
    let url = format!("app={}", origin.url("fw-2.bin"));
    site.release_with("fw-2", 2, &fw2, &["--url", &url]);
    let topics = Topics::default();
    let watcher = Watcher::start(site.port, &[format!("{}/devices/+/#", topics.prefix())]).await;
    site.create_and_start(&one_group("resume", "fw-2")).await;
    let done_before_kill = watcher
        .wait_until("download progress from dev-1", WAIT, |w| {
            w.reports("dev-1").iter().find_map(|r| match r.phase {
                Phase::Downloading { done, total } if done > 0 && done < total => Some(done),
                _ => None,
            })
        })
        .await;
    site.kill_agent("dev-1");
    let asked_before = origin.ranges().len();
    site.start_agent("dev-1");
    let last = watcher.final_report("dev-1", WAIT).await;
    assert_eq!(last.phase, Phase::Ready, "{last:?}");
    assert_eq!(fs::read(site.target_file("dev-1")).expect("target"), fw2);
    // Blocks verify out of order (runs on several connections), so `done` is a count, not a
    // prefix: what the restarted agent asks for is at most what was missing, plus a few blocks
    // of slack for blocks written between the report and the kill that did not make the part
    // file.
    let after = &origin.ranges()[asked_before..];
    let asked_after: u64 = after.iter().map(|(a, b)| b + 1 - a).sum();
    assert!(
        !after.is_empty(),
        "the rest came from the origin after the restart"
    );
    assert!(
        asked_after <= fw2.len() as u64 - done_before_kill + 4 * 65536,
        "{asked_after} of {} bytes asked again after the restart, with {done_before_kill} bytes \
         verified before the kill: {after:?}",
        fw2.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_serves_its_own_store_as_the_origin_set_by_release_locate() {
    let mut site = Site::new(BrokerKind::Embedded);
    let port = site.enable_http();
    site.start_coordinator();
    site.add_agent("dev-1", &[("env", "test")], AgentOptions::default());
    site.wait_devices(1).await;
    let fw2 = artifact(512, 2);
    site.release("fw-2", 2, &fw2);
    let inspect = site.flotilla(&[
        "release",
        "inspect",
        "--data-dir",
        &site.path("coordinator").to_string_lossy(),
        "fw-2",
        "--json",
    ]);
    let summary: serde_json::Value = serde_json::from_str(&inspect).expect("inspect --json");
    let sha = summary["artifacts"][0]["sha256"]
        .as_str()
        .expect("the artifact's sha256")
        .to_owned();
    let url = format!("http://127.0.0.1:{port}/artifacts/{sha}");
    let data_dir = site.path("coordinator");
    let said = site.flotilla(&[
        "release",
        "locate",
        "--data-dir",
        &data_dir.to_string_lossy(),
        "fw-2",
        "app",
        &url,
    ]);
    assert!(said.contains("located at"), "{said}");
    // A location that is not http(s) is refused, naming it.
    let refused = site.flotilla_output(&[
        "release",
        "locate",
        "--data-dir",
        &data_dir.to_string_lossy(),
        "fw-2",
        "app",
        "file:///etc/passwd",
    ]);
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("only http:// and https://"), "{err}");

    let status = roll_out(&site, "from-store", "fw-2", &fw2).await;
    assert_eq!(status.bytes.http, fw2.len() as u64, "{:?}", status.bytes);
}
