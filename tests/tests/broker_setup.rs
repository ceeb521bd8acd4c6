//! The shipped Mosquitto configuration installs both ways the README says: as a `conf.d`
//! drop-in under Debian's stock main file, and under the shipped whole config `main.conf`
//! (tests/src/secure.rs lays them out in a temporary directory). Mosquitto 2.0.11 refuses a
//! second `persistence_location`, so a drop-in that set one kept the broker from starting.
//! The certificates come from `make-certs.sh` with the CA in a directory of its own.
//!
//! The site broker's `site.conf` and `bridge.conf` (`deploy/mosquitto/site/`) install the same
//! way, as two drop-ins under Debian's stock main file (docs/peers.md): the site broker starts,
//! its bridge (read from `conf.d`, since Mosquitto ignores an `include_dir` in a drop-in)
//! carries a device's state to the central broker, and its state survives a restart.

use flotilla_protocol::{DeviceId, Topics};
use flotilla_tests::bridge::{CentralBroker, SiteBroker, SiteLayout, BRIDGE_USER};
use flotilla_tests::secure::{Layout, COORDINATOR};
use flotilla_tests::{require_mosquitto, Connected, Probe, SecureBroker};

async fn a_login_and_a_certificate_get_in(layout: Layout) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut broker = SecureBroker::start_as(dir.path(), &["dev-a"], layout);

    let (answer, _probe) = Probe::connect(&broker.login(COORDINATOR), COORDINATOR).await;
    assert_eq!(
        answer,
        Connected::Accepted,
        "{layout:?}: the coordinator's login"
    );
    let (answer, _probe) = Probe::connect(&broker.cert_login("dev-a"), "dev-a").await;
    assert_eq!(
        answer,
        Connected::Accepted,
        "{layout:?}: a device certificate"
    );
    let (answer, _) = Probe::connect(&broker.anonymous(), "anon").await;
    assert!(
        matches!(answer, Connected::Refused(_)),
        "{layout:?}: the drop-in's allow_anonymous false holds: {answer:?}"
    );

    // Persistence is on, in the main file's persistence_location: retained desired actions
    // survive a broker restart.
    assert!(broker.stop(), "{layout:?}: mosquitto stops on SIGTERM");
    assert!(
        broker.persistence_dir().join("mosquitto.db").exists(),
        "{layout:?}: the broker saved its state where the main file says"
    );
    // The CA's key stayed in the CA's directory: the broker's has none.
    assert!(dir.path().join("ca/ca.key").exists());
    assert!(!dir.path().join("broker/tls/ca.key").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drop_in_starts_under_debians_stock_main_file() {
    a_login_and_a_certificate_get_in(Layout::DebianMain).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drop_in_starts_under_the_shipped_whole_config() {
    a_login_and_a_certificate_get_in(Layout::ShippedMain).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_site_drop_ins_start_under_debians_stock_main_file() {
    if !require_mosquitto(module_path!()) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let central = CentralBroker::start(&dir.path().join("central"), &[COORDINATOR, BRIDGE_USER]);
    let devices = vec!["harbour-1".to_owned()];
    let mut site = SiteBroker::start_as(
        &dir.path().join("site"),
        central.port,
        &central.password(BRIDGE_USER),
        &devices,
        SiteLayout::DebianMain,
    );
    // The bridge drop-in was read: its link comes up on the central broker.
    site.wait_bridged(central.login(COORDINATOR)).await;

    let (answer, coordinator) = Probe::connect(&central.login(COORDINATOR), COORDINATOR).await;
    let mut coordinator = coordinator.unwrap_or_else(|| panic!("coordinator login: {answer:?}"));
    let state = Topics::default().state(&DeviceId::new("harbour-1").expect("id"));
    assert!(coordinator.subscribe(&state).await);
    let (answer, device) = Probe::connect(&site.login("harbour-1"), "harbour-1").await;
    let mut device = device.unwrap_or_else(|| panic!("a device of the site: {answer:?}"));
    device.publish(&state, b"state of harbour-1", true).await;
    coordinator.until(&state).await;

    // The site drop-in's allow_anonymous false holds under Debian's main file.
    let anonymous = flotilla_mqtt::ConnectionSpec::plain("127.0.0.1", site.port)
        .validate(std::path::Path::new("/"), &|_| None)
        .expect("anonymous connection");
    let (answer, _) = Probe::connect(&anonymous, "anon").await;
    assert!(
        matches!(answer, Connected::Refused(_)),
        "the site broker let an anonymous client in: {answer:?}"
    );

    // persistence true in the drop-in, persistence_location from the main file: the retained
    // state is saved where Debian's main file says.
    assert!(site.stop(), "the site broker stops on SIGTERM");
    assert!(
        site.persistence_dir().join("mosquitto.db").exists(),
        "the site broker saved its state where the main file says"
    );
}
