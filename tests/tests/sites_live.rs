//! issue 13: site budgets in a live rollout, in each of the four vocabularies. A real
//! `flotilla serve` on Mosquitto rolls a release out to two simulated sites side by side (two
//! `flotilla-fleetsim` processes, [`PER_SITE`] devices each, labelled `site=a` and `site=b`, each
//! install taking about a second) with a busy limit of [`LIMIT`] per site.
//!
//! What a user would notice: at no status the operator reads is a site over its limit; both
//! sites hold devices back at some point (the budget, not the fleet's pace, sets the speed);
//! the rollout still finishes with every device ready; `flotilla rollout status` prints each
//! site's line, and the decision trace says why devices waited. With an unavailable limit and a
//! release that fails on one site, that site stops after its limit of failures while the other
//! finishes.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use flotilla_protocol::control::{PageQuery, RolloutStatus, TraceKind};
use flotilla_tests::{bin, BrokerKind, Site};

/// Devices of each site.
const PER_SITE: u64 = 12;
/// The busy limit of every site.
const LIMIT: usize = 2;
const SITES: [&str; 2] = ["a", "b"];

/// The simulator exits once every device of its site finished an install.
const UNTIL_DONE: [&str; 3] = ["--until-done", "--timeout", "2m"];

/// A running simulator of one site's devices, and the file its figures go to.
struct Simulator {
    child: Child,
    summary: std::path::PathBuf,
}

impl Drop for Simulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The simulator's arguments that name one site's devices: their ids, keys and label.
fn fleet_args(site: &str) -> Vec<String> {
    [
        "--id-prefix",
        &format!("{site}-"),
        "--seed",
        &format!("site-{site}"),
        "--count",
        &PER_SITE.to_string(),
        "--id-width",
        "2",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// Writes both sites' authorized keys, a release for the simulators' hardware, and starts the
/// coordinator.
fn prepare(site: &mut Site) {
    let mut keys = std::fs::read_to_string(site.authorized_keys_file()).expect("keys file");
    for name in SITES {
        let file = site.path(&format!("keys-{name}"));
        let status = Command::new(bin("flotilla-fleetsim"))
            .args(fleet_args(name))
            .arg("--write-authorized-keys")
            .arg(&file)
            .stdout(Stdio::null())
            .status()
            .expect("run flotilla-fleetsim");
        assert!(status.success(), "writing site {name}'s authorized keys");
        keys.push_str(&std::fs::read_to_string(&file).expect("site keys"));
    }
    std::fs::write(site.authorized_keys_file(), keys).expect("write authorized keys");
    site.flotilla(&[
        "release",
        "create",
        "--data-dir",
        &site.path("coordinator").to_string_lossy(),
        "--key",
        &site.path("keys/release.key").to_string_lossy(),
        "--name",
        "fw-2",
        "--version",
        "2.0.0",
        "--counter",
        "2",
        "--hardware",
        "sim-board",
        "--artifact",
        &format!("app={}", site.path("keys/release.pub").display()),
    ]);
    site.start_coordinator();
}

/// Starts the simulator of site `name`'s devices; `behaviour` adds to its arguments (when to
/// exit, how installs end).
fn simulate(site: &Site, name: &str, behaviour: &[&str]) -> Simulator {
    let summary = site.path(&format!("fleetsim-{name}.json"));
    let log = std::fs::File::create(site.path(&format!("fleetsim-{name}.log"))).expect("log");
    let child = Command::new(bin("flotilla-fleetsim"))
        .args(["--broker", &format!("127.0.0.1:{}", site.port)])
        .args(fleet_args(name))
        .args(["--label", &format!("site={name}")])
        .args(["--install-time", "1s", "--progress", "0s"])
        .arg("--coordinator-key")
        .arg(site.path("keys/coordinator.pub"))
        .args(behaviour)
        .arg("--summary")
        .arg(&summary)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start flotilla-fleetsim");
    Simulator { child, summary }
}

/// Runs one rollout with `table` (the vocabulary's tables, sites included) over both sites and
/// checks what the operator sees while it runs and once it has finished.
async fn live_rollout(vocabulary: &str, table: &str) {
    let mut site = Site::new(BrokerKind::Mosquitto);
    prepare(&mut site);
    let mut simulators: Vec<Simulator> = SITES
        .iter()
        .map(|s| simulate(&site, s, &UNTIL_DONE))
        .collect();
    site.wait_devices(SITES.len() * PER_SITE as usize).await;

    let spec = format!("name = \"fw\"\nrelease = \"fw-2\"\n{table}");
    site.create_and_start(&spec).await;

    // Poll the status as an operator would, until the rollout ends.
    let client = site.client().await;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut held_back = std::collections::BTreeSet::new();
    let mut full = std::collections::BTreeSet::new();
    let mut observations = 0;
    let status: RolloutStatus = loop {
        let reply = client
            .rollout_status("fw", PageQuery::default(), Duration::from_secs(5))
            .await;
        if let Ok(status) = reply {
            observations += 1;
            for s in &status.sites {
                assert!(
                    s.busy <= LIMIT,
                    "{vocabulary}: site {} has {} busy, over its limit of {LIMIT}: {:#?}",
                    s.name,
                    s.busy,
                    status.sites
                );
                assert_eq!(s.max_busy, Some(LIMIT), "{vocabulary}: {:#?}", status.sites);
                if s.waiting > 0 {
                    held_back.insert(s.name.clone());
                }
                if s.busy == LIMIT {
                    full.insert(s.name.clone());
                }
            }
            if matches!(
                status.state.as_str(),
                "finished" | "paused" | "failed" | "stopped"
            ) {
                break status;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{vocabulary}: the rollout did not end"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        status.state, "finished",
        "{vocabulary}: {:#?}",
        status.trace
    );
    let ready: usize = status.groups.iter().map(|g| g.ready).sum();
    assert_eq!(
        ready,
        SITES.len() * PER_SITE as usize,
        "{vocabulary}: every device ready"
    );
    assert_eq!(
        held_back.len(),
        SITES.len(),
        "{vocabulary}: both sites held devices back at some point, seen: {held_back:?} in \
         {observations} observations"
    );
    assert_eq!(
        full.len(),
        SITES.len(),
        "{vocabulary}: both sites were seen using their whole budget, seen: {full:?}"
    );
    let names: Vec<&str> = status.sites.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, SITES, "{vocabulary}: the status lists both sites");

    // The trace says a site's budget held devices back: "waiting: site a: 2 of 2 busy, 10
    // waiting" (decision 0025 traces a site's wait when it begins).
    assert!(
        status.trace.iter().any(|e| e.kind == TraceKind::Waiting
            && SITES.iter().any(|s| e
                .message
                .contains(&format!("site {s}: {LIMIT} of {LIMIT} busy")))),
        "{vocabulary}: no site wait in the trace: {:#?}",
        status.trace
    );

    // Each simulator saw every one of its devices install once and end ready.
    for (name, simulator) in SITES.iter().zip(simulators.iter_mut()) {
        let exit = simulator.child.wait().expect("wait for flotilla-fleetsim");
        assert!(
            exit.success(),
            "{vocabulary}: site {name}'s devices did not all finish"
        );
        let figures: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&simulator.summary).expect("fleetsim summary"))
                .expect("summary JSON");
        assert_eq!(
            figures["ready"], PER_SITE,
            "{vocabulary} {name}: {figures:#}"
        );
        assert_eq!(
            figures["desired"], PER_SITE,
            "{vocabulary} {name}: {figures:#}"
        );
    }

    let text = site.flotilla(&["rollout", "status", "fw"]);
    for name in SITES {
        assert!(
            text.lines().any(|l| l.contains(&format!("site {name}: "))
                && l.contains(&format!("of {LIMIT} busy"))),
            "{vocabulary}: no line for site {name}: {text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hawkbit_groups_keep_each_site_within_max_running() {
    live_rollout(
        "groups",
        "[groups]\ncount = 1\n[groups.sites]\nlabel = \"site\"\nmax_running = 2\n",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_partitions_keep_each_site_within_max_busy() {
    live_rollout(
        "partitions",
        "[partitions]\n[partitions.sites]\nlabel = \"site\"\nmax_busy = 2\n",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubefleet_rolling_keeps_each_site_within_max_busy() {
    live_rollout(
        "rolling",
        "[rolling]\nmax_unavailable = \"100%\"\n[rolling.sites]\nlabel = \"site\"\nmax_busy = 2\n",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubefleet_staged_keeps_each_site_within_max_concurrency() {
    live_rollout(
        "staged",
        "[staged]\n[[staged.stage]]\nname = \"all\"\nmax_concurrency = 100\n\
         [staged.sites]\nlabel = \"site\"\nmax_concurrency = 2\n",
    )
    .await;
}

/// Fleet's `maxUnavailable` per site, with a release that fails on every device of site `a`:
/// the site's first two devices fail and keep counting as unavailable, so the rest of site `a`
/// waits for an operator while site `b` installs every device. The status and the trace say
/// which limit holds site `a`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_partitions_hold_a_site_whose_failed_devices_fill_max_unavailable() {
    const UNAVAILABLE: usize = 2;
    let held = PER_SITE as usize - UNAVAILABLE;
    let mut site = Site::new(BrokerKind::Mosquitto);
    prepare(&mut site);
    // Every install of site a fails after activating (rolled back), as a bad release would.
    let _failing = simulate(&site, "a", &["--fail-rate", "1"]);
    let mut healthy = simulate(&site, "b", &UNTIL_DONE);
    site.wait_devices(SITES.len() * PER_SITE as usize).await;
    let spec = format!(
        "name = \"fw\"\nrelease = \"fw-2\"\n[partitions]\n[partitions.sites]\n\
         label = \"site\"\nmax_unavailable = {UNAVAILABLE}\n"
    );
    site.create_and_start(&spec).await;

    let client = site.client().await;
    let deadline = Instant::now() + Duration::from_secs(120);
    let site_of = |status: &RolloutStatus, name: &str| {
        status
            .sites
            .iter()
            .find(|s| s.name == name)
            .cloned()
            .unwrap_or_else(|| panic!("no site {name}: {:#?}", status.sites))
    };
    // Until site b is done and site a holds nothing but its failed devices.
    let status: RolloutStatus = loop {
        let reply = client
            .rollout_status("fw", PageQuery::default(), Duration::from_secs(5))
            .await;
        if let Ok(status) = reply {
            for s in &status.sites {
                assert!(
                    s.unavailable <= UNAVAILABLE,
                    "site {} has {} unavailable, over its limit of {UNAVAILABLE}: {:#?}",
                    s.name,
                    s.unavailable,
                    status.sites
                );
                assert_eq!(s.max_unavailable, Some(UNAVAILABLE), "{:#?}", status.sites);
            }
            let (a, b) = (site_of(&status, "a"), site_of(&status, "b"));
            let ready: usize = status.groups.iter().map(|g| g.ready).sum();
            if a.busy == 0 && b.busy == 0 && ready == PER_SITE as usize {
                break status;
            }
        }
        assert!(Instant::now() < deadline, "site b did not finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let failed: usize = status.groups.iter().map(|g| g.failed).sum();
    assert_eq!(failed, UNAVAILABLE, "{:#?}", status.groups);
    let a = site_of(&status, "a");
    assert_eq!(
        (a.busy, a.unavailable, a.waiting),
        (0, UNAVAILABLE, held),
        "site a is held by its failed devices: {a:#?}"
    );
    assert_eq!(
        status.state, "running",
        "the rollout waits for an operator: {:#?}",
        status.trace
    );
    let wait = format!("site a: {UNAVAILABLE} of {UNAVAILABLE} unavailable, {held} waiting");
    assert!(
        status.waiting.as_deref().is_some_and(|w| w.contains(&wait)),
        "the status says why the rollout waits: {:?}",
        status.waiting
    );
    assert!(
        status.trace.iter().any(|e| e.kind == TraceKind::Waiting
            && e.message.contains(&format!(
                "site a: {UNAVAILABLE} of {UNAVAILABLE} unavailable"
            ))),
        "no wait for site a's unavailable limit in the trace: {:#?}",
        status.trace
    );
    let text = site.flotilla(&["rollout", "status", "fw"]);
    assert!(
        text.lines().any(|l| l.contains(&format!(
            "site a: 0 busy, {UNAVAILABLE} of {UNAVAILABLE} unavailable, {held} waiting"
        ))),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l.contains(&format!(
            "site b: 0 busy, 0 of {UNAVAILABLE} unavailable, 0 waiting"
        ))),
        "{text}"
    );

    // Site b's devices installed once each and ended ready.
    let exit = healthy.child.wait().expect("wait for flotilla-fleetsim");
    assert!(exit.success(), "site b's devices did not all finish");
    let figures: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&healthy.summary).expect("fleetsim summary"))
            .expect("summary JSON");
    assert_eq!(figures["ready"], PER_SITE, "{figures:#}");
}
