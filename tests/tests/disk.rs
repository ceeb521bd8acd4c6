//! issue 10, case 6: a full disk is an error with a reason, never damage and never a stop.
//!
//! Each test puts a process's data directory on a small tmpfs and fills it with a real file, so
//! the writes fail with ENOSPC exactly as on a device or server whose disk ran full.
//! - The coordinator refuses changes naming its store, keeps answering reads, sends devices
//!   nothing it could not store, recovers by itself once there is room, stops on SIGTERM while
//!   the disk is full, and starts again on a full disk.
//! - An agent fails the download with a reason, leaves no partial file, keeps its database, and
//!   installs once there is room.

use std::time::{Duration, Instant};

use flotilla_protocol::control::Command as Control;
use flotilla_tests::{AgentOptions, BrokerKind, Site, Tmpfs, WAIT};

const SPEC: &str = "release = \"fw-2\"\nselect = \"ring=disk\"\n[groups]\ncount = 1\n";

fn spec(name: &str) -> String {
    format!("name = \"{name}\"\n{SPEC}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_changes_keeps_answering_and_recovers() {
    let mut site = Site::new(BrokerKind::Mosquitto);
    let Some(disk) = Tmpfs::mount(
        &site.path("coordinator"),
        "16m",
        "a_full_disk_refuses_changes_keeps_answering_and_recovers",
    ) else {
        return;
    };
    site.release("fw-2", 2, b"firmware two\n");
    site.start_coordinator();
    let devices = ["disk-a", "disk-b"];
    for id in devices {
        site.add_agent(id, &[("ring", "disk")], AgentOptions::default());
    }
    for id in devices {
        site.wait_online(id, true).await;
    }

    let filler = disk.fill(0);
    let client = site.client().await;
    let timeout = Duration::from_secs(10);
    let err = client
        .request(Control::CreateRollout { spec: spec("full") }, timeout)
        .await
        .expect_err("a rollout that cannot be stored is not reported as created")
        .to_string();
    assert!(
        err.contains("could not be stored") && err.contains("No space left on device"),
        "{err}"
    );
    // Reads answer from memory; changes are refused naming the store.
    let status = site.status("full").await.expect("status still answers");
    assert_eq!(status.state, "ready", "{status:#?}");
    let err = client
        .request(
            Control::StartRollout {
                rollout: "full".into(),
            },
            timeout,
        )
        .await
        .expect_err("no change while the store cannot be written")
        .to_string();
    assert!(err.contains("cannot write its store"), "{err}");
    assert!(err.contains("only read still work"), "{err}");

    // Room again: the coordinator finds out by itself and takes changes again.
    std::fs::remove_file(&filler).expect("remove filler");
    let deadline = Instant::now() + WAIT;
    loop {
        let started = client
            .request(
                Control::StartRollout {
                    rollout: "full".into(),
                },
                timeout,
            )
            .await;
        match started {
            Ok(_) => break,
            Err(e) => assert!(
                Instant::now() < deadline,
                "the coordinator did not recover after space returned: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let status = site.wait_ended("full").await;
    assert_eq!(status.state, "finished", "{status:#?}");
    for id in devices {
        assert_eq!(
            std::fs::read(site.target_file(id)).expect("installed"),
            b"firmware two\n"
        );
    }

    // Full again, with a write that failed: SIGTERM still stops it, and it starts again on the
    // full disk with what it had stored.
    let _filler = disk.fill(0);
    let err = client
        .request(
            Control::CreateStrategy {
                name: "two-stage".into(),
                spec: "[[stage]]\nname = \"all\"\n".into(),
            },
            timeout,
        )
        .await
        .expect_err("cannot be stored")
        .to_string();
    assert!(err.contains("No space left on device"), "{err}");
    let exit = site.terminate_coordinator(Duration::from_secs(10));
    assert!(
        exit.is_some(),
        "the coordinator did not stop within 10 s of SIGTERM with its disk full"
    );
    site.start_coordinator();
    let status = site
        .wait_status("full", "the restarted coordinator to answer", WAIT, |_| {
            true
        })
        .await;
    assert_eq!(status.state, "finished", "{status:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_with_a_full_disk_fails_cleanly_and_installs_once_there_is_room() {
    let mut site = Site::new(BrokerKind::Mosquitto);
    let id = "disk-agent";
    let data = site.path(&format!("agents/{id}/data"));
    let Some(disk) = Tmpfs::mount(
        &data,
        "12m",
        "an_agent_with_a_full_disk_fails_cleanly_and_installs_once_there_is_room",
    ) else {
        return;
    };
    let firmware: Vec<u8> = (0..3 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    site.release("fw-2", 2, &firmware);
    site.start_coordinator();
    site.add_agent(id, &[("ring", "disk")], AgentOptions::default());
    site.wait_online(id, true).await;

    let filler = disk.fill(1024 * 1024);
    site.create_and_start(&spec("cramped")).await;
    let status = site.wait_ended("cramped").await;
    let detail = &status.groups[0].device_details[id];
    assert_eq!(detail.phase, "failed", "{status:#?}");
    let reason = detail.reason.clone().unwrap_or_default();
    assert!(reason.contains("No space left on device"), "{reason}");
    let downloads = data.join("downloads");
    let partial: Vec<_> = std::fs::read_dir(&downloads)
        .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(
        partial
            .iter()
            .all(|p| p.extension().is_none_or(|e| e != "part")),
        "a partial download was left behind: {partial:?}"
    );
    let aside: Vec<_> = std::fs::read_dir(&data)
        .expect("data dir")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("db.corrupt"))
        .collect();
    assert!(
        aside.is_empty(),
        "a healthy database was moved aside: {aside:?}"
    );
    site.wait_online(id, true).await;

    std::fs::remove_file(&filler).expect("remove filler");
    let client = site.client().await;
    let retried = client
        .request(
            Control::RetryRollout {
                rollout: "cramped".into(),
                name: None,
            },
            Duration::from_secs(10),
        )
        .await
        .expect("retry");
    let name = retried["name"].as_str().expect("retry name").to_owned();
    client
        .request(
            Control::StartRollout {
                rollout: name.clone(),
            },
            Duration::from_secs(10),
        )
        .await
        .ok();
    let status = site.wait_ended(&name).await;
    assert_eq!(status.state, "finished", "{status:#?}");
    assert_eq!(
        std::fs::read(site.target_file(id)).expect("installed"),
        firmware,
        "the device holds the release's bytes"
    );
}
