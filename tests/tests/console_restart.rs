//! The web console across a coordinator restart, in a real browser (Debian's headless Chromium
//! through ChromeDriver): the coordinator is killed with SIGKILL while the page watches a
//! rollout; the page says the coordinator is unreachable, and when it is back the same session
//! (kept in the store) carries on: no new login, and the page moves again by itself. A session
//! that ends sends the page to its login, saying why.

use std::time::Duration;

use flotilla_protocol::operator::Role;
use flotilla_tests::webdriver::{require_browser, screenshot_dir, Browser};
use flotilla_tests::{AgentOptions, BrokerKind, Site};

const WAIT: Duration = Duration::from_secs(60);

const SPEC: &str = "name = \"rs\"\nrelease = \"fw-2\"\n\
    [[staged.stage]]\nname = \"canary\"\nselect = \"stage=canary\"\nafter = { approval = true }\n\
    [[staged.stage]]\nname = \"rest\"\nselect = \"stage=rest\"\n";

/// The coordinator's reason on the login form once the session is gone. Which one the page meets
/// depends on a race: a request sent before the logout's answer cleared the cookie still carries
/// it and hears "no such session: it was logged out, ..."; one sent after carries none and hears
/// "no session: log in ...". Either says why; an empty line, or any other text, does not.
fn says_why_the_session_ended(text: &str) -> bool {
    text.starts_with("no such session: it was logged out") || text.starts_with("no session: log in")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_survives_a_coordinator_restart_without_a_new_login() {
    if !require_browser("console_restart") {
        return;
    }
    let mut site = Site::new(BrokerKind::Embedded);
    let port = site.enable_http();
    site.add_operator("olga", Role::Operator);
    site.release("fw-2", 2, b"firmware 2.0, across a restart\n");
    site.start_coordinator();
    site.add_agent("dev-01", &[("stage", "canary")], AgentOptions::default());
    site.add_agent("dev-02", &[("stage", "rest")], AgentOptions::default());
    site.wait_devices(2).await;
    let spec = site.path("rs.toml");
    std::fs::write(&spec, SPEC).expect("write spec");
    site.flotilla(&["rollout", "create", "--spec", &spec.to_string_lossy()]);
    site.flotilla(&["rollout", "start", "rs"]);

    let url = format!("http://127.0.0.1:{port}/console");
    let shots = screenshot_dir();
    let browser = tokio::task::block_in_place(Browser::start);
    tokio::task::block_in_place(|| {
        browser.log_in(&url, &site.operator_key_file("olga"), "olga", WAIT);
        browser.goto(&format!("{url}#/rollouts/rs"));
        browser.wait_text("[data-approval=rs-canary]", WAIT, |t| t.contains("pending"));
        browser.wait_text("#live", WAIT, |t| t == "live");
    });

    // Killed outright: the page says so instead of going quiet.
    site.kill_coordinator();
    tokio::task::block_in_place(|| {
        browser.wait_text("#banner", WAIT, |t| {
            t.contains("coordinator unreachable, retrying")
        });
        browser.screenshot(&shots.join("console-unreachable.png"));
    });

    // Back: the banner goes, the session still holds (no login form), and the page follows
    // again: an approval from the terminal finishes the rollout on the page without a reload.
    site.start_coordinator();
    tokio::task::block_in_place(|| {
        browser.wait_text("#live", WAIT, |t| t == "live");
        assert_eq!(browser.text(&browser.find("#banner").expect("banner")), "");
        assert_eq!(
            browser.execute("return document.getElementById('login').hidden"),
            serde_json::Value::Bool(true),
            "no new login after the restart"
        );
        browser.wait_text("#who", WAIT, |t| t.starts_with("olga"));
    });
    let olga = site.operator_key_file("olga");
    site.flotilla(&[
        "--operator-key",
        &olga.to_string_lossy(),
        "approve",
        "rs-canary",
    ]);
    tokio::task::block_in_place(|| {
        browser.wait_text("#rollout-state", WAIT, |t| t == "finished");
        browser.wait_text("#trace", WAIT, |t| {
            t.contains("approval rs-canary approved by olga")
        });
    });

    // The session ends (logged out elsewhere, here by the API): the page shows its login and
    // the coordinator's reason.
    tokio::task::block_in_place(|| {
        browser.execute("fetch('/api/v1/session', { method: 'DELETE', credentials: 'same-origin' }); return true");
        browser.wait_text("#login-error", WAIT, says_why_the_session_ended);
        assert!(browser.find("#keyfile").is_some(), "the login form");
        browser.screenshot(&shots.join("console-session-ended.png"));
    });

    // Whichever of the page's requests meets the ended session, and in whatever order, the
    // login keeps saying why: a page drawn by a request that was on its way when the stream
    // noticed (each page of the console in turn) must not blank the reason.
    tokio::task::block_in_place(|| {
        for draw in [
            "drawList()",
            "drawRollout('rs')",
            "drawDevices(new URLSearchParams())",
            "drawDevice('dev-01')",
            "drawQueues()",
            "drawReleases(new URLSearchParams())",
        ] {
            let error = browser.execute(&format!(
                "return {draw}.then(() => document.getElementById('login-error').textContent)"
            ));
            let error = error.as_str().unwrap_or_default().to_owned();
            assert!(
                says_why_the_session_ended(&error),
                "after {draw} met the ended session the login says {error:?}, not why it ended"
            );
        }
    });
}
