//! Every client takes a list of brokers: with the first one down, the coordinator, the agents
//! and the CLI each reach the next, say which one they use, and a rollout goes to the end.

use std::fs;
use std::process::Command;

use flotilla_tests::{bin, free_port, AgentOptions, BrokerKind, Site, ADMIN};

const FIRMWARE: &[u8] = b"firmware 2.0, through the second broker of the list\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_first_broker_down_every_client_uses_the_next_and_a_rollout_finishes() {
    let mut site = Site::new(BrokerKind::Embedded);
    // A port nothing listens on: the first broker of every list, down.
    let down = free_port();
    let up = site.port;
    site.coordinator_broker_ports = Some(vec![down, up]);
    site.release("fw-2", 2, FIRMWARE);
    site.start_coordinator();
    for id in ["dev-01", "dev-02", "dev-03"] {
        let options = AgentOptions {
            broker_ports: Some(vec![down, up]),
            ..AgentOptions::default()
        };
        site.add_agent(id, &[("env", "list")], options);
    }
    site.wait_devices(3).await;

    // The CLI, given the same list.
    let list = format!("127.0.0.1:{down},127.0.0.1:{up}");
    let out = Command::new(bin("flotilla"))
        .args(["--broker", &list, "devices"])
        .env("FLOTILLA_OPERATOR_KEY", site.operator_key_file(ADMIN))
        .env_remove("FLOTILLA_BROKER")
        .output()
        .expect("run flotilla");
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && listed.contains("dev-01") && listed.contains("dev-03"),
        "the CLI reached the second broker: {listed}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    site.create_and_start(
        "name = \"listed\"\nrelease = \"fw-2\"\nselect = \"env=list\"\n[groups]\ncount = 1\n",
    )
    .await;
    let status = site.wait_ended("listed").await;
    assert_eq!(status.state, "finished", "{status:#?}");
    assert_eq!(status.groups[0].ready, 3, "{status:#?}");

    // Each says which broker it uses, and why not the first.
    let coordinator = fs::read_to_string(site.path("coordinator.log")).expect("coordinator log");
    assert!(
        coordinator.contains("using broker 2 of 2")
            && coordinator.contains(&format!("127.0.0.1:{down}")),
        "the coordinator names the broker it uses and the one that did not answer:\n{coordinator}"
    );
    // Devices start from a broker picked by their id, so some may have started with the one
    // that answers; any that started with the one down went on to the next.
    let mut moved = 0;
    for id in ["dev-01", "dev-02", "dev-03"] {
        let log = fs::read_to_string(site.path(&format!("agents/{id}/agent.log"))).expect("log");
        assert!(
            log.contains("using broker 2 of 2"),
            "{id} names its broker:\n{log}"
        );
        if log.contains("before it:") {
            moved += 1;
            assert!(
                log.contains(&format!("cannot reach the broker at 127.0.0.1:{down}")),
                "{log}"
            );
        }
        assert!(
            !log.contains("none of the 2 brokers answered"),
            "{id} never found every broker down:\n{log}"
        );
    }
    eprintln!("{moved} of 3 devices started with the broker that was down");
}
