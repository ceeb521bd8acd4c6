//! The web console in a real browser (Debian's headless Chromium through ChromeDriver), against
//! a real coordinator with real agents: log in with an operator key file, watch a rollout move
//! without reloading, pause and resume it, approve and deny from the page, and a viewer who gets
//! no buttons.
//! Screenshots of the pages go to `target/screenshots/`.

use std::time::Duration;

use flotilla_protocol::operator::Role;
use flotilla_tests::webdriver::{require_browser, screenshot_dir, Browser};
use flotilla_tests::{AgentOptions, BrokerKind, Site};

const FIRMWARE: &[u8] = b"firmware 2.0, approved in the console\n";
const WAIT: Duration = Duration::from_secs(60);

fn spec(name: &str, release: &str) -> String {
    format!(
        "name = \"{name}\"\nrelease = \"{release}\"\n\
         [[staged.stage]]\nname = \"canary\"\nselect = \"stage=canary\"\nafter = {{ approval = true }}\n\
         [[staged.stage]]\nname = \"rest\"\nselect = \"stage=rest\"\n"
    )
}

/// Logs in on the console at `url` with the key file of `operator`.
fn log_in(browser: &Browser, site: &Site, url: &str, operator: &str) {
    browser.log_in(url, &site.operator_key_file(operator), operator, WAIT);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_follows_approves_and_denies_in_the_console_and_a_viewer_only_watches() {
    if !require_browser("console") {
        return;
    }
    let mut site = Site::new(BrokerKind::Embedded);
    let port = site.enable_http();
    site.add_operator("olga", Role::Operator);
    site.add_operator("vic", Role::Viewer);
    site.release("fw-2", 2, FIRMWARE);
    site.release("fw-3", 3, b"firmware 3.0, denied in the console\n");
    site.start_coordinator();
    site.add_agent("dev-01", &[("stage", "canary")], AgentOptions::default());
    site.add_agent("dev-02", &[("stage", "rest")], AgentOptions::default());
    site.add_agent("dev-03", &[("stage", "rest")], AgentOptions::default());
    site.wait_devices(3).await;
    site.flotilla(&[
        "rollout",
        "create",
        "--spec",
        &write(&site, "ok", &spec("ok", "fw-2")),
    ]);

    let url = format!("http://127.0.0.1:{port}/console");
    let shots = screenshot_dir();
    let browser = tokio::task::block_in_place(Browser::start);
    tokio::task::block_in_place(|| {
        log_in(&browser, &site, &url, "olga");
        browser.wait_text("[data-rollout=ok]", WAIT, |t| t.contains("ready"));
    });

    // Started from the terminal; the page moves by itself, to the approval gate.
    site.flotilla(&["rollout", "start", "ok"]);
    tokio::task::block_in_place(|| {
        browser.wait_text("[data-rollout=ok]", WAIT, |t| t.contains("1 ready"));
        browser.screenshot(&shots.join("console-rollouts.png"));
        browser.goto(&format!("{url}#/rollouts/ok"));
        browser.wait_text("[data-approval=ok-canary]", WAIT, |t| t.contains("pending"));
        browser.screenshot(&shots.join("console-approval.png"));
        // Paused and resumed from the page's buttons, signed in the browser.
        browser.click_text("#rollout-actions button", "Pause", WAIT);
        browser.wait_text("#rollout-state", WAIT, |t| t == "paused");
        browser.click_text("#rollout-actions button", "Resume", WAIT);
        browser.wait_text("#rollout-state", WAIT, |t| t == "running");
        browser.click_text("[data-approval=ok-canary] button", "Approve", WAIT);
        // Finished without a reload: live events moved the page.
        browser.wait_text("#rollout-state", WAIT, |t| t == "finished");
        browser.wait_text("#trace", WAIT, |t| {
            t.contains("approval ok-canary approved by olga")
        });
        browser.screenshot(&shots.join("console-rollout.png"));
    });

    // The next release, denied from the page: it stops at the gate.
    site.flotilla(&[
        "rollout",
        "create",
        "--spec",
        &write(&site, "no", &spec("no", "fw-3")),
    ]);
    site.flotilla(&["rollout", "start", "no"]);
    tokio::task::block_in_place(|| {
        browser.goto(&format!("{url}#/rollouts/no"));
        browser.wait_text("[data-approval=no-canary]", WAIT, |t| t.contains("pending"));
        browser.click_text(
            "[data-approval=no-canary] button:nth-of-type(2)",
            "Deny",
            WAIT,
        );
        browser.wait_text("#rollout-state", WAIT, |t| t == "stopped");
        browser.wait_text("[data-approval=no-canary]", WAIT, |t| {
            t.contains("denied by olga")
        });
    });
    let status = site.status("no").await.expect("status");
    assert_eq!(status.state, "stopped", "{status:#?}");

    // A viewer sees everything and gets no button; the server would refuse one anyway.
    tokio::task::block_in_place(|| {
        browser.click_text("#logout", "Log out", WAIT);
        log_in(&browser, &site, &url, "vic");
        browser.goto(&format!("{url}#/rollouts/ok"));
        browser.wait_text("#rollout-state", WAIT, |t| t == "finished");
        assert!(
            browser.find("#rollout-actions button").is_none(),
            "no buttons for a viewer"
        );
    });
    let refused = site.flotilla_output(&[
        "--operator-key",
        &site.operator_key_file("vic").to_string_lossy(),
        "rollout",
        "stop",
        "no",
    ]);
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr)
            .contains("not allowed: operator vic has role viewer"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    eprintln!("screenshots in {}", shots.display());
}

fn write(site: &Site, name: &str, text: &str) -> String {
    let path = site.path(&format!("{name}.toml"));
    std::fs::write(&path, text).expect("write spec");
    path.to_string_lossy().into_owned()
}
