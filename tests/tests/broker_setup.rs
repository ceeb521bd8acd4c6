//! The shipped Mosquitto configuration installs both ways the README says: as a `conf.d`
//! drop-in under Debian's stock main file, and under the shipped whole config `main.conf`
//! (tests/src/secure.rs lays them out in a temporary directory). Mosquitto 2.0.11 refuses a
//! second `persistence_location`, so a drop-in that set one kept the broker from starting.
//! The certificates come from `make-certs.sh` with the CA in a directory of its own.

use flotilla_tests::secure::{Layout, COORDINATOR};
use flotilla_tests::{Connected, Probe, SecureBroker};

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
