//! The console's devices, device, queue and release pages in a real browser (Debian's headless
//! Chromium through ChromeDriver), against a real coordinator with real agents: filter the
//! devices, open a failed device and read its reason, accept a waiting device from the
//! enrollment queue as an admin, while a viewer sees no button and is refused anyway.
//! Screenshots of each page go to `target/screenshots/`.

use std::time::Duration;

use flotilla_protocol::operator::Role;
use flotilla_tests::webdriver::{require_browser, screenshot_dir, Browser};
use flotilla_tests::{AgentOptions, BrokerKind, Site};

const FIRMWARE: &[u8] = b"firmware 2.0, seen from the device pages\n";
const WAIT: Duration = Duration::from_secs(60);

const SPEC: &str = "name = \"fw2\"\nrelease = \"fw-2\"\n\
    [[staged.stage]]\nname = \"all\"\nselect = \"site in (berlin,paris)\"\n";

/// Logs in on the console at `url` with the key file of `operator`.
fn log_in(browser: &Browser, site: &Site, url: &str, operator: &str) {
    browser.log_in(url, &site.operator_key_file(operator), operator, WAIT);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_are_filtered_a_failed_one_says_why_and_only_an_admin_accepts_a_waiting_one() {
    if !require_browser("console_pages") {
        return;
    }
    let mut site = Site::new(BrokerKind::Embedded);
    let port = site.enable_http();
    site.add_operator("ada", Role::Admin);
    site.add_operator("vic", Role::Viewer);
    site.release("fw-2", 2, FIRMWARE);
    site.start_coordinator();
    site.add_agent("dev-01", &[("site", "berlin")], AgentOptions::default());
    let sick = AgentOptions {
        healthy: false,
        ..AgentOptions::default()
    };
    site.add_agent("dev-02", &[("site", "paris")], sick);
    let unenrolled = AgentOptions {
        enroll: false,
        ..AgentOptions::default()
    };
    site.add_agent("dev-03", &[("site", "paris")], unenrolled);
    site.wait_devices(2).await;
    site.wait_for_enrollment("dev-03", "pending").await;
    let spec = site.path("fw2.toml");
    std::fs::write(&spec, SPEC).expect("write spec");
    site.flotilla(&["rollout", "create", "--spec", &spec.to_string_lossy()]);
    site.flotilla(&["rollout", "start", "fw2"]);

    let url = format!("http://127.0.0.1:{port}/console");
    let shots = screenshot_dir();
    let browser = tokio::task::block_in_place(Browser::start);

    // A viewer reads every page and gets no button.
    tokio::task::block_in_place(|| {
        log_in(&browser, &site, &url, "vic");
        browser.goto(&format!("{url}#/queues"));
        browser.wait_text("[data-pending=dev-03]", WAIT, |t| t.contains("pending"));
        assert!(
            browser.find("[data-pending=dev-03] button").is_none(),
            "no accept button for a viewer"
        );
    });
    let key = site.device_key("dev-03").expect("dev-03 made its key");
    let refused = site.flotilla_output(&[
        "--operator-key",
        &site.operator_key_file("vic").to_string_lossy(),
        "devices",
        "accept",
        "dev-03",
        "--key",
        &key[..16],
    ]);
    assert!(!refused.status.success(), "a viewer's accept is refused");
    assert!(
        String::from_utf8_lossy(&refused.stderr)
            .contains("not allowed: operator vic has role viewer"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );

    tokio::task::block_in_place(|| {
        browser.click_text("#logout", "Log out", WAIT);
        log_in(&browser, &site, &url, "ada");

        // The devices page, then filtered by site and phase: the failed device only.
        browser.click_text("#nav a[data-page=device]", "Devices", WAIT);
        browser.wait_text("[data-device=dev-01]", WAIT, |t| t.contains("fw2: ready"));
        browser.wait_text("[data-device=dev-02]", WAIT, |t| t.contains("fw2: failed"));
        browser.wait_text("[data-device=dev-03]", WAIT, |t| t.contains("pending"));
        browser.screenshot(&shots.join("console-devices.png"));
        let site_filter = browser.wait_for("#filter-site", WAIT).expect("site filter");
        browser.send_keys(&site_filter, "paris");
        browser.execute("document.getElementById('filter-phase').value = 'failed';");
        // A live event redraws the list while the operator types: what was typed stays.
        let typed = browser.execute(
            "return refresh().then(() => document.getElementById('filter-site').value + ' ' \
             + document.getElementById('filter-phase').value)",
        );
        assert_eq!(
            typed.as_str(),
            Some("paris failed"),
            "a redraw of the devices list wiped the filters being typed"
        );
        browser.click_text("#filter-apply", "Filter", WAIT);
        browser.wait_text("#devices-rows", WAIT, |t| {
            t.contains("dev-02") && !t.contains("dev-01") && !t.contains("dev-03")
        });

        // The failed device: its action, the step's phase and reason, its key.
        browser.click_text("[data-device=dev-02] a", "dev-02", WAIT);
        browser.wait_text("[data-action=fw2]", WAIT, |t| {
            t.contains("failed") && t.contains("self-test failed")
        });
        let facts = browser.wait_text("#device-facts", WAIT, |t| t.contains("site=paris"));
        assert!(facts.contains("accepted"), "{facts}");
        // An admin may revoke an accepted device; nothing else is offered.
        browser.wait_text("#device-actions", WAIT, |t| t == "Revoke");
        browser.screenshot(&shots.join("console-device.png"));

        // The enrollment queue: accept the waiting device; it leaves the queue, accepted.
        browser.click_text("#nav a[data-page=queues]", "Waiting", WAIT);
        browser.wait_text("[data-pending=dev-03]", WAIT, |t| t.contains(&key[..16]));
        browser.screenshot(&shots.join("console-queues.png"));
        browser.click_text("[data-pending=dev-03] button", "Accept", WAIT);
        browser.wait_text("#enrollment-rows", WAIT, |t| {
            t.contains("no device is waiting")
        });
        browser.goto(&format!("{url}#/devices/dev-03"));
        browser.wait_text("[data-fact=enrollment]", WAIT, |t| {
            t.starts_with("accepted")
        });
        browser.wait_text("[data-fact='key fingerprint']", WAIT, |t| t == &key[..16]);

        // The releases page: the artifact, its size, and who runs it.
        browser.click_text("#nav a[data-page=releases]", "Releases", WAIT);
        browser.wait_text("[data-release=fw-2]", WAIT, |t| {
            t.contains("runs on 1 device") && t.contains("fw2") && t.contains(" B")
        });
        browser.screenshot(&shots.join("console-releases.png"));

        // The same page on a phone's screen.
        browser.set_window_size(390, 844);
        browser.goto(&format!("{url}#/devices"));
        browser.wait_text("[data-device=dev-02]", WAIT, |t| t.contains("failed"));
        browser.screenshot(&shots.join("console-devices-phone.png"));
    });
    site.wait_for_enrollment("dev-03", "accepted").await;
    eprintln!("screenshots in {}", shots.display());
}
