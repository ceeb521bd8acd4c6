//! Owed actions converge, end to end: Mosquitto, a coordinator process and an agent process.
//!
//! A device offline while rollout `a` sends it an install and is stopped misses `a`'s cancel;
//! rollout `b` then sends it an install. When the device comes back it ends on `b`'s release,
//! and its retained `desired` topic holds `b`'s action from then on: `a`'s cancel is never
//! published over it again, by a repair of the topic or by a coordinator restart (it once was,
//! at every restart, so the topic flipped between the two).

use std::fs;
use std::time::Duration;

use flotilla_protocol::control::Command;
use flotilla_protocol::{envelope, ActionBody, DesiredAction, DeviceId, Message, Topics};
use flotilla_tests::{AgentOptions, BrokerKind, Site, WatchedMessage, Watcher, WAIT};

const ID: &str = "dev-owed";

/// How long the topic is watched for publishes that should not come: longer than two repair
/// intervals of the coordinator (5 s each) after it has read every retained topic back.
const QUIET: Duration = Duration::from_secs(12);

/// The desired action in a message on the device's topic, with whether it is a cancel.
fn action(m: &WatchedMessage) -> Option<(String, bool)> {
    let Some(Message::Desired(blob)) = m.decode() else {
        return None;
    };
    let action: DesiredAction = envelope::from_bytes("desired action", &blob.payload).ok()?;
    let cancel = matches!(action.body, ActionBody::Cancel { .. });
    Some((action.action_id, cancel))
}

/// What the messages seen say, in words: `install a@…:dev-owed`, `cancel …`.
fn described(watcher: &Watcher) -> Vec<String> {
    watcher
        .messages()
        .iter()
        .map(|m| match action(m) {
            Some((id, true)) => format!("cancel {id}"),
            Some((id, false)) => format!("install {id}"),
            None => format!("{} bytes, not a desired action", m.payload.len()),
        })
        .collect()
}

/// Waits until the topic has carried an install (or a cancel) of rollout `rollout`; its id.
async fn seen(watcher: &Watcher, rollout: &str, cancel: bool) -> String {
    let what = format!(
        "{} of rollout {rollout}",
        if cancel { "a cancel" } else { "an install" }
    );
    watcher
        .wait_until(&what, WAIT, |w| {
            w.messages().iter().filter_map(action).find_map(|(id, c)| {
                (c == cancel && id.starts_with(&format!("{rollout}@"))).then_some(id)
            })
        })
        .await
}

/// The action the device's retained `desired` topic holds now, read by a fresh subscriber.
async fn retained(site: &Site, topic: &str) -> String {
    let fresh = Watcher::start(site.port, &[topic.to_owned()]).await;
    fresh
        .wait_until("the retained desired action", WAIT, |w| {
            w.messages().first().map(|m| match action(m) {
                Some((id, true)) => format!("cancel {id}"),
                Some((id, false)) => format!("install {id}"),
                None => "something else".to_owned(),
            })
        })
        .await
}

fn spec(name: &str, release: &str) -> String {
    format!(
        "name = \"{name}\"\nrelease = \"{release}\"\nselect = \"ring=owed\"\n[groups]\ncount = 1\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missed_cancel_is_never_published_over_the_newer_rollouts_action() {
    let mut site = Site::new(BrokerKind::Mosquitto);
    site.release("fw-2", 2, b"firmware two\n");
    site.release("fw-3", 3, b"firmware three\n");
    site.start_coordinator();
    site.add_agent(ID, &[("ring", "owed")], AgentOptions::default());
    site.wait_online(ID, true).await;
    site.kill_agent(ID);
    site.wait_online(ID, false).await;

    let topic = Topics::default().desired(&DeviceId::new(ID).expect("id"));
    let watcher = Watcher::start(site.port, std::slice::from_ref(&topic)).await;
    site.create_and_start(&spec("a", "fw-2")).await;
    let a = seen(&watcher, "a", false).await;
    site.client()
        .await
        .request(
            Command::StopRollout {
                rollout: "a".into(),
            },
            Duration::from_secs(10),
        )
        .await
        .expect("stop a");
    seen(&watcher, "a", true).await;
    site.create_and_start(&spec("b", "fw-3")).await;
    let b = seen(&watcher, "b", false).await;
    let install_b = format!("install {b}");
    assert_eq!(retained(&site, &topic).await, install_b);

    // The device comes back: it finds b's install and ends on b's release.
    watcher.clear();
    site.start_agent(ID);
    let status = site.wait_ended("b").await;
    assert_eq!(status.state, "finished", "{status:#?}");
    assert_eq!(
        fs::read(site.target_file(ID)).expect("target"),
        b"firmware three\n"
    );
    assert_eq!(retained(&site, &topic).await, install_b);

    // A restart re-publishes what devices are owed; this device is owed nothing (its newest
    // action finished), and a's cancel least of all.
    site.kill_coordinator();
    site.start_coordinator();
    site.wait_online(ID, true).await;
    tokio::time::sleep(QUIET).await;
    let published = described(&watcher);
    assert!(
        published.is_empty(),
        "published on {topic} since the device came back (a's install was {a}): {published:?}"
    );
    assert_eq!(retained(&site, &topic).await, install_b);
}
