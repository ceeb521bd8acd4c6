//! Site budgets and peer ordering, through specs in each of the four vocabularies: the limits
//! hold at every step, seeds go first, waiting devices fall back to the coordinator after the
//! seed's wait, and a restart in the middle changes nothing.

use std::collections::{BTreeMap, HashMap};

use super::*;
use crate::zoneinfo::SystemZones;
use flotilla_protocol::{ByteCounts, InstalledRelease};

const T0: u64 = 1_850_000_000;

/// `harbour` devices h0.., `quarry` devices q0.., and devices without a site x0...
fn fleet(harbour: usize, quarry: usize, none: usize) -> Vec<(String, Option<&'static str>)> {
    let mut devices = Vec::new();
    devices.extend((0..harbour).map(|i| (format!("h{i:02}"), Some("harbour"))));
    devices.extend((0..quarry).map(|i| (format!("q{i:02}"), Some("quarry"))));
    devices.extend((0..none).map(|i| (format!("x{i:02}"), None)));
    devices
}

fn state(id: &str, site: Option<&str>) -> DeviceState {
    DeviceState {
        device_id: id.into(),
        hardware_id: "pi4".into(),
        labels: site
            .map(|s| vec![("site".to_owned(), s.to_owned())])
            .unwrap_or_default(),
        installed: Some(InstalledRelease {
            name: "fw-1".into(),
            version: "1".into(),
            counter: 1,
        }),
        current: None,
        online: true,
        agent_version: "0.1.0".into(),
        at: T0,
    }
}

/// The engine and the agents' side: every device's current action and the peers it was given.
struct Sites {
    engine: Engine,
    now: u64,
    fleet: Vec<(String, Option<&'static str>)>,
    seq: HashMap<String, u64>,
    action: HashMap<String, String>,
    /// Desired actions in the order sent: (device, peers).
    sent: Vec<(String, Vec<String>)>,
}

impl Sites {
    fn new(fleet: Vec<(String, Option<&'static str>)>) -> Self {
        let mut engine = Engine::new(SystemZones);
        for (id, site) in &fleet {
            engine.observe_state(state(id, *site), T0);
        }
        Sites {
            engine,
            now: T0,
            fleet,
            seq: HashMap::new(),
            action: HashMap::new(),
            sent: Vec::new(),
        }
    }

    fn take(&mut self, effects: Vec<Effect>) {
        for e in effects {
            if let Effect::Desired {
                device,
                action_id,
                peers,
                ..
            } = e
            {
                self.action.insert(device.clone(), action_id);
                self.sent.push((device, peers));
            }
        }
        self.check();
    }

    fn create_and_start(&mut self, spec: &str) {
        let spec = RolloutSpec::from_toml(spec, &SystemZones).expect("valid spec");
        let release = ReleaseRef {
            name: "fw-2".into(),
            counter: 2,
            hardware: Vec::new(),
        };
        let effects = self
            .engine
            .create_rollout(spec, release, self.now)
            .expect("created");
        self.take(effects);
        let effects = self.engine.start("r", self.now).expect("started");
        self.take(effects);
    }

    fn report(&mut self, device: &str, phase: Phase) {
        let action_id = self.action[device].clone();
        let seq = self.seq.entry(device.to_owned()).or_insert(0);
        *seq += 1;
        let report = Report {
            device_id: device.into(),
            seq: *seq,
            rollout_id: "r".into(),
            action_id,
            phase,
            at: self.now,
        };
        let effects = self.engine.observe_report(report, self.now);
        self.take(effects);
    }

    fn rollout(&self) -> &Rollout {
        self.engine.rollout("r").expect("rollout exists")
    }

    /// Devices of each site started and not finished, by the slots.
    fn busy(&self) -> BTreeMap<String, Vec<String>> {
        let mut busy: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for g in &self.rollout().groups {
            for (d, s) in &g.slots {
                if matches!(
                    s.phase,
                    DevicePhase::InProgress(_) | DevicePhase::Retrying(_)
                ) {
                    let site = s.site.clone().unwrap_or_else(|| "-".into());
                    busy.entry(site).or_default().push(d.clone());
                }
            }
        }
        busy
    }

    /// The site budget holds and the status says what the slots say.
    fn check(&self) {
        let Some(r) = self.engine.rollout("r") else {
            return;
        };
        let Some(limit) = r.spec.policies.sites.as_ref().and_then(|p| p.max_busy) else {
            return;
        };
        let busy = self.busy();
        for (site, devices) in busy.iter().filter(|(s, _)| *s != "-") {
            assert!(
                devices.len() <= limit,
                "site {site}: {devices:?} busy, more than {limit}"
            );
        }
        for s in r.status().sites {
            assert_eq!(
                s.busy,
                busy.get(&s.name).map_or(0, Vec::len),
                "status of site {}",
                s.name
            );
        }
    }

    /// Every busy device finishes Ready, one at a time, until the rollout finishes.
    fn finish_all(&mut self) {
        for _ in 0..200 {
            let next = self.busy().into_values().flatten().next();
            match next {
                Some(d) => self.report(&d, Phase::Ready),
                None => break,
            }
        }
        assert_eq!(self.rollout().state, RolloutState::Finished);
        let phases = self.rollout().device_phases();
        for (id, _) in &self.fleet {
            assert_eq!(phases[id], "ready", "device {id}");
        }
    }

    fn trace(&self) -> Vec<String> {
        self.rollout()
            .trace
            .iter()
            .map(|t| t.message.clone())
            .collect()
    }

    fn restart(&mut self) {
        let stored: Vec<Rollout> = self
            .engine
            .rollouts()
            .map(|r| serde_json::from_str(&serde_json::to_string(r).expect("json")).expect("back"))
            .collect();
        self.engine = Engine::restore(stored, SystemZones);
        for (id, site) in self.fleet.clone() {
            let effects = self.engine.observe_state(state(&id, site), self.now);
            self.take(effects);
        }
        let effects = self.engine.reissue(self.now);
        self.take(effects);
    }
}

const HEAD: &str = "name = \"r\"\nrelease = \"fw-2\"\n";

/// The same site policy, two busy at once per site, in each vocabulary's own words.
fn specs() -> Vec<(&'static str, String)> {
    vec![
        (
            "groups",
            format!("{HEAD}[groups]\ncount = 1\n[groups.sites]\nlabel = \"site\"\nmax_running = 2\n"),
        ),
        (
            "partitions",
            format!("{HEAD}[partitions]\n[partitions.sites]\nlabel = \"site\"\nmax_busy = 2\n"),
        ),
        (
            "rolling",
            format!(
                "{HEAD}[rolling]\nmax_unavailable = \"100%\"\n[rolling.sites]\nlabel = \"site\"\nmax_busy = 2\n"
            ),
        ),
        (
            "staged",
            format!(
                "{HEAD}[staged]\n[[staged.stage]]\nname = \"all\"\nmax_concurrency = 100\n[staged.sites]\nlabel = \"site\"\nmax_concurrency = 2\n"
            ),
        ),
    ]
}

#[test]
fn every_vocabulary_keeps_each_site_within_its_budget() {
    for (vocabulary, spec) in specs() {
        let mut s = Sites::new(fleet(6, 5, 3));
        s.create_and_start(&spec);
        // Two of each site and every device without a site start at once.
        let busy = s.busy();
        assert_eq!(busy["harbour"].len(), 2, "{vocabulary}");
        assert_eq!(busy["quarry"].len(), 2, "{vocabulary}");
        assert_eq!(
            busy["-"].len(),
            3,
            "{vocabulary}: devices without a site are not held"
        );
        let status = s.engine.summary("r").expect("summary");
        let harbour = status
            .sites
            .iter()
            .find(|x| x.name == "harbour")
            .expect("harbour");
        assert_eq!(
            harbour.line(),
            "site harbour: 2 of 2 busy, 4 waiting",
            "{vocabulary}"
        );
        assert_eq!(status.site_count, 2, "{vocabulary}");
        assert!(
            s.trace()
                .iter()
                .any(|m| m.contains("site harbour: 2 of 2 busy")),
            "{vocabulary}: {:?}",
            s.trace()
        );
        s.finish_all();
        // A site's wait is traced when it begins, not once per device or per report: one
        // line for harbour, then one when quarry is the site that holds devices back.
        let waits: Vec<String> = s
            .trace()
            .into_iter()
            .filter(|m| m.starts_with("waiting: site"))
            .collect();
        assert_eq!(waits.len(), 2, "{vocabulary}: {waits:?}");
        assert!(
            waits[0].starts_with("waiting: site harbour: 2 of 2 busy"),
            "{waits:?}"
        );
        assert!(
            waits[1].starts_with("waiting: site quarry: 2 of 2 busy"),
            "{waits:?}"
        );
    }
}

#[test]
fn spec_errors_name_the_vocabulary_field() {
    let bad = [
        (
            format!("{HEAD}[groups]\ncount = 1\n[groups.sites]\nlabel = \"site\"\nmax_busy = 2\n"),
            "groups.sites.max_busy: 2 is not a key of [groups.sites]; this vocabulary calls it max_running",
        ),
        (
            format!("{HEAD}[partitions]\n[partitions.sites]\nlabel = \"site\"\nmax_busy = 0\n"),
            "partitions.sites.max_busy: 0 is not at least 1",
        ),
        (
            format!("{HEAD}[rolling]\n[rolling.sites]\nmax_busy = 2\n"),
            "rolling.sites = { ... } needs label",
        ),
        (
            format!("{HEAD}[rolling]\n[rolling.sites]\nlabel = \"a b\"\nmax_busy = 2\n"),
            "rolling.sites.label: \"a b\" is not a label key",
        ),
        (
            format!("{HEAD}[staged]\n[[staged.stage]]\nname = \"a\"\n[staged.sites]\nlabel = \"site\"\n"),
            "staged.sites.label = \"site\" needs a limit or peer sharing",
        ),
        (
            format!("{HEAD}[groups]\ncount = 1\n[groups.sites]\nlabel = \"site\"\nmax_running = 1\nseed_wait = \"5m\"\n"),
            "groups.sites.seed_wait = \"5m\": seed_wait is only used with peers = true",
        ),
        (
            format!("{HEAD}[groups]\ncount = 1\n[groups.sites]\nlabel = \"site\"\npeers = true\nseed_wait = 0\n"),
            "groups.sites.seed_wait: 0 is not a duration",
        ),
        (
            format!("{HEAD}[groups]\ncount = 1\n[groups.sites]\nlabel = \"site\"\nmax_runing = 1\n"),
            "unknown field `max_runing`",
        ),
    ];
    for (spec, want) in bad {
        let err = RolloutSpec::from_toml(&spec, &SystemZones)
            .expect_err(want)
            .to_string();
        assert!(err.contains(want), "{err:?} does not say {want:?}");
    }
}

#[test]
fn the_unavailable_budget_counts_failed_devices_of_the_site() {
    let mut s = Sites::new(fleet(4, 0, 0));
    s.create_and_start(&format!(
        "{HEAD}[partitions]\n[partitions.sites]\nlabel = \"site\"\nmax_unavailable = 2\n"
    ));
    assert_eq!(s.busy()["harbour"], ["h00", "h01"]);
    s.report(
        "h00",
        Phase::Failed {
            reason: "boom".into(),
            rolled_back: true,
        },
    );
    // h00 failed and still counts as unavailable: one more may start, not two.
    assert_eq!(s.busy()["harbour"], ["h01"]);
    s.report("h01", Phase::Ready);
    assert_eq!(s.busy()["harbour"], ["h02"]);
    let waiting = s.rollout().waiting.clone().unwrap_or_default();
    assert!(
        waiting.contains("site harbour: 2 of 2 unavailable, 1 waiting"),
        "{waiting}"
    );
}

#[test]
fn a_site_held_by_another_groups_devices_opens_when_one_of_them_finishes() {
    let mut s = Sites::new(fleet(4, 2, 0));
    s.create_and_start(&format!(
        "{HEAD}[partitions]\nmax_unavailable_partitions = 1\n\
         [partitions.sites]\nlabel = \"site\"\nmax_busy = 2\n\
         [[partitions.partition]]\nname = \"first\"\ndevices = [\"h00\", \"h01\"]\n\
         [[partitions.partition]]\nname = \"rest\"\nselect = \"site in (harbour,quarry)\"\n"
    ));
    // The second partition runs beside the first: its quarry devices start, its harbour
    // devices wait for the first partition's.
    assert_eq!(s.busy()["harbour"], ["h00", "h01"]);
    assert_eq!(s.busy()["quarry"], ["q00", "q01"]);
    let waiting = s.rollout().waiting.clone().unwrap_or_default();
    assert!(
        waiting.contains("site harbour: 2 of 2 busy, 2 waiting"),
        "{waiting}"
    );
    s.report("h00", Phase::Ready);
    assert_eq!(s.busy()["harbour"], ["h01", "h02"]);
    s.restart();
    s.report("q00", Phase::Ready);
    assert_eq!(s.busy()["harbour"], ["h01", "h02"]);
    s.report("h01", Phase::Ready);
    assert_eq!(s.busy()["harbour"], ["h02", "h03"]);
    s.finish_all();
}

fn sharing(seed_wait: &str) -> String {
    format!(
        "{HEAD}[groups]\ncount = 1\n[groups.sites]\nlabel = \"site\"\nmax_running = 3\npeers = true\nseed_wait = \"{seed_wait}\"\n"
    )
}

#[test]
fn a_seed_fetches_first_and_the_site_then_fetches_from_it() {
    let mut s = Sites::new(fleet(5, 2, 1));
    s.create_and_start(&sharing("10m"));
    // One seed per site, without peers; the device without a site starts as it would.
    let first: Vec<_> = s.sent.clone();
    assert_eq!(
        first,
        [
            ("h00".to_owned(), vec![]),
            ("q00".to_owned(), vec![]),
            ("x00".to_owned(), vec![]),
        ]
    );
    let status = s.engine.summary("r").expect("summary");
    let harbour = status
        .sites
        .iter()
        .find(|x| x.name == "harbour")
        .expect("harbour");
    assert_eq!(harbour.seed.as_deref(), Some("h00"));
    assert_eq!(
        harbour.line(),
        "site harbour: 1 of 3 busy, 4 waiting, seed h00"
    );
    // Downloading is not holding: nobody else starts.
    s.report("h00", Phase::Downloading { done: 1, total: 2 });
    assert_eq!(s.sent.len(), 3);
    // Verified: the next two of the site start, fetching from the seed.
    s.report("h00", Phase::Verified);
    assert_eq!(
        s.sent[3..],
        [
            ("h01".to_owned(), vec!["h00".to_owned()]),
            ("h02".to_owned(), vec!["h00".to_owned()]),
        ]
    );
    // Another site's holder is never named: quarry still waits for its own seed.
    assert!(!s.sent.iter().any(|(d, _)| d == "q01"));
    s.report("h01", Phase::Verified);
    s.report("h00", Phase::Ready);
    assert_eq!(
        s.sent[5],
        ("h03".to_owned(), vec!["h00".to_owned(), "h01".to_owned()]),
        "holders, in the order they came"
    );
    let trace = s.trace();
    assert!(
        trace
            .iter()
            .any(|m| m.contains("site harbour: 4 waiting for seed h00")),
        "{trace:?}"
    );
}

#[test]
fn a_peer_a_device_bypassed_is_no_longer_offered_to_its_site() {
    let mut s = Sites::new(fleet(6, 0, 0));
    s.create_and_start(&sharing("10m"));
    s.report("h00", Phase::Verified);
    assert_eq!(
        s.sent[1..],
        [
            ("h01".to_owned(), vec!["h00".to_owned()]),
            ("h02".to_owned(), vec!["h00".to_owned()]),
        ]
    );
    // h01's final report says the seed served a block that failed its hash.
    let bypassed = [flotilla_protocol::BypassedPeer {
        peer: "h00".into(),
        reason: "block 3 failed its hash".into(),
    }];
    let action = s.action["h01"].clone();
    let effects = s.engine.observe_bypassed("h01", &action, &bypassed, s.now);
    s.take(effects);
    s.report("h01", Phase::Ready);
    assert_eq!(
        s.sent[3],
        ("h03".to_owned(), vec!["h01".to_owned()]),
        "the next device is sent to the other holder only"
    );
    // Across a restart, and when it finishes: the bypassed peer is not offered again.
    s.restart();
    s.report("h00", Phase::Ready);
    s.report("h02", Phase::Ready);
    // (The restart re-sends h02's action as it was; only devices starting now count.)
    let before: Vec<String> = s.sent[..4].iter().map(|(d, _)| d.clone()).collect();
    let later: Vec<&(String, Vec<String>)> = s.sent[4..]
        .iter()
        .filter(|(d, _)| !before.contains(d))
        .collect();
    assert!(!later.is_empty(), "{:?}", s.sent);
    for (device, peers) in later {
        assert!(
            !peers.contains(&"h00".to_owned()),
            "{device} was sent to h00: {peers:?}"
        );
    }
    let trace = s.trace();
    assert!(
        trace
            .iter()
            .any(|m| m == "peer h00 is no longer offered to site harbour: h01 bypassed it"),
        "{trace:?}"
    );
}

#[test]
fn a_failed_seed_is_replaced_and_a_silent_one_is_waited_for_only_so_long() {
    let mut s = Sites::new(fleet(4, 0, 0));
    s.create_and_start(&sharing("5m"));
    assert_eq!(s.sent, [("h00".to_owned(), vec![])]);
    s.report(
        "h00",
        Phase::Failed {
            reason: "download failed".into(),
            rolled_back: false,
        },
    );
    // The next device becomes the seed and fetches from the coordinator.
    assert_eq!(s.sent[1], ("h01".to_owned(), vec![]));
    assert_eq!(s.sent.len(), 2);
    let seed_at = s.now;
    assert_eq!(s.engine.next_timer(), Some(seed_at + 300));
    s.now = seed_at + 299;
    let effects = s.engine.tick(s.now);
    s.take(effects);
    assert_eq!(s.sent.len(), 2, "still within the seed's wait");
    // h01 stays silent past the wait: the others start without peers, from the coordinator.
    s.now = seed_at + 300;
    let effects = s.engine.tick(s.now);
    s.take(effects);
    assert_eq!(
        s.sent[2..],
        [("h02".to_owned(), vec![]), ("h03".to_owned(), vec![])]
    );
}

#[test]
fn a_restart_in_the_middle_keeps_seeds_holders_and_budgets() {
    let mut s = Sites::new(fleet(6, 0, 0));
    s.create_and_start(&sharing("10m"));
    s.report("h00", Phase::Verified);
    assert_eq!(s.sent.len(), 3);
    s.sent.clear();
    s.restart();
    // What is re-sent is what was sent, peers included; nothing new starts.
    let mut resent = s.sent.clone();
    resent.sort();
    assert_eq!(
        resent,
        [
            ("h00".to_owned(), vec![]),
            ("h01".to_owned(), vec!["h00".to_owned()]),
            ("h02".to_owned(), vec!["h00".to_owned()]),
        ]
    );
    let status = s.engine.summary("r").expect("summary");
    assert_eq!(
        status.sites[0].line(),
        "site harbour: 3 of 3 busy, 3 waiting, peers h00"
    );
    s.report("h00", Phase::Ready);
    assert_eq!(
        s.sent.last(),
        Some(&("h03".to_owned(), vec!["h00".to_owned()]))
    );
    s.finish_all();
}

#[test]
fn a_retry_keeps_its_site_slot_and_fetches_from_the_holders() {
    let mut s = Sites::new(fleet(3, 0, 0));
    s.create_and_start(&format!(
        "{HEAD}retry = {{ attempts = 1, backoff = \"30s\" }}\n[rolling]\nmax_unavailable = \"100%\"\n[rolling.sites]\nlabel = \"site\"\nmax_busy = 2\npeers = true\n"
    ));
    s.report("h00", Phase::Verified);
    assert_eq!(s.busy()["harbour"], ["h00", "h01"]);
    s.report(
        "h01",
        Phase::Failed {
            reason: "peer gone".into(),
            rolled_back: false,
        },
    );
    // Waiting for its retry, h01 still holds its place: h02 does not start.
    assert_eq!(s.busy()["harbour"], ["h00", "h01"]);
    s.now += 30;
    let effects = s.engine.tick(s.now);
    s.take(effects);
    assert_eq!(
        s.sent.last(),
        Some(&("h01".to_owned(), vec!["h00".to_owned()])),
        "the retry fetches from the site's holder"
    );
    s.finish_all();
}

#[test]
fn bytes_by_source_add_up_per_site_and_per_rollout() {
    let mut s = Sites::new(fleet(2, 1, 1));
    s.create_and_start(&sharing("10m"));
    s.report("h00", Phase::Ready);
    let bytes = |coordinator, peers: &[(&str, u64)], local| ByteCounts {
        coordinator,
        local,
        peers: peers.iter().map(|(p, n)| (p.to_string(), *n)).collect(),
    };
    let id = |s: &Sites, d: &str| s.action[d].clone();
    s.engine
        .observe_bytes("h00", &id(&s, "h00"), bytes(1000, &[], 24));
    s.engine
        .observe_bytes("h01", &id(&s, "h01"), bytes(10, &[("h00", 990)], 24));
    s.engine
        .observe_bytes("x00", &id(&s, "x00"), bytes(1024, &[], 0));
    // Another device's action id, and an unknown one, are ignored.
    s.engine
        .observe_bytes("q00", &id(&s, "h00"), bytes(5, &[], 0));
    s.engine.observe_bytes("q00", "r@1:q00:7", bytes(5, &[], 0));
    let status = s.engine.summary("r").expect("summary");
    assert_eq!(
        (
            status.bytes.coordinator,
            status.bytes.peers,
            status.bytes.local
        ),
        (2034, 990, 48)
    );
    let harbour = status
        .sites
        .iter()
        .find(|x| x.name == "harbour")
        .expect("harbour");
    assert_eq!(
        (
            harbour.bytes.coordinator,
            harbour.bytes.peers,
            harbour.bytes.local
        ),
        (1010, 990, 48)
    );
    // A report naming ten thousand peers is stored as one sum, not as ten thousand names.
    let before = serde_json::to_string(s.rollout()).expect("json").len();
    let many: Vec<(String, u64)> = (0..10_000).map(|i| (format!("peer-{i}"), 1)).collect();
    let flood = ByteCounts {
        coordinator: 0,
        local: 0,
        peers: many,
    };
    s.engine.observe_bytes("q00", &id(&s, "q00"), flood);
    let after = serde_json::to_string(s.rollout()).expect("json").len();
    assert!(after < before + 100, "{before} -> {after} bytes stored");
    let status = s.engine.summary("r").expect("summary");
    assert_eq!(status.bytes.peers, 990 + 10_000);
    // Kept with the rollout: the sums are the same after a restart.
    s.restart();
    let again = s.engine.summary("r").expect("summary");
    assert_eq!(again.bytes, status.bytes);
    assert_eq!(again.sites, status.sites);
}

#[test]
fn a_dynamic_device_joins_its_site() {
    let mut s = Sites::new(fleet(3, 0, 0));
    s.create_and_start(&format!(
        "{HEAD}[groups]\ncount = 1\ndynamic = true\n[groups.sites]\nlabel = \"site\"\nmax_running = 2\n"
    ));
    assert_eq!(s.busy()["harbour"], ["h00", "h01"]);
    s.fleet.push(("h09".into(), Some("harbour")));
    let effects = s.engine.observe_state(state("h09", Some("harbour")), s.now);
    s.take(effects);
    let status = s.engine.summary("r").expect("summary");
    assert_eq!(
        status.sites[0].line(),
        "site harbour: 2 of 2 busy, 1 waiting"
    );
    assert_eq!(
        status.sites[0].total, 4,
        "the new device is counted in its site"
    );
    s.report("h00", Phase::Ready);
    s.report("h01", Phase::Ready);
    assert_eq!(
        s.busy()["harbour"],
        ["h02"],
        "the dynamic group waits for group-1"
    );
    s.report("h02", Phase::Ready);
    assert_eq!(s.busy()["harbour"], ["h09"]);
    s.report("h09", Phase::Ready);
    assert_eq!(s.rollout().device_phases()["h09"], "ready");
}

#[test]
fn the_summary_lists_a_bounded_number_of_sites() {
    let sites: Vec<&'static str> = (0..30)
        .map(|i| &*Box::leak(format!("s{i:02}").into_boxed_str()))
        .collect();
    let fleet: Vec<_> = sites.iter().map(|s| (format!("d-{s}"), Some(*s))).collect();
    let mut s = Sites::new(fleet);
    s.create_and_start(&format!(
        "{HEAD}[groups]\ncount = 1\n[groups.sites]\nlabel = \"site\"\nmax_running = 1\n"
    ));
    let summary = s.engine.summary("r").expect("summary");
    assert_eq!(
        summary.sites.len(),
        flotilla_protocol::control::SUMMARY_SITES
    );
    assert_eq!(summary.site_count, 30);
    assert_eq!(s.engine.status("r").expect("status").sites.len(), 30);
}
