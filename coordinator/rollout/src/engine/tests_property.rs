//! A property test: the engine driven by random operator commands, device reports, restarts
//! (every rollout through a serde round trip into [`Engine::restore`]) and clock jumps, with
//! the invariants checked after every step:
//!
//! - no group starts twice;
//! - no group starts while an approval before it is pending, nor before the timed wait of the
//!   group ahead of it ran out (unless an operator's `next` or `resume` passed it);
//! - every group's counters equal a count over its devices and add up to its total, its per-site
//!   counts too;
//! - never more devices of one site busy than the site policy allows (devices carry a `site`
//!   label, some none; rollouts get random site budgets, some with peer sharing), and a device
//!   is told to fetch only from peers of its own site;
//! - no device of a site starts when that takes the site over its unavailable limit;
//! - a stopped or failed rollout sends no install, and a rollback only after the rollback error
//!   action;
//! - once the operators let everything finish, every rollout has ended and every device is in
//!   a final phase;
//! - what the engine owes a device (what a restart or a repair of its retained `desired` topic
//!   publishes) is at most one action, and always the one the device's retained `desired` topic
//!   already holds: the newest action any rollout sent it. Rollouts over the same devices are
//!   created, stopped and started while devices are offline (they read their retained action when
//!   they come back), so an old rollout's cancel is never published over a newer action.
//!
//! A small xorshift generator keeps it dependency-free; a failure prints the seed and the step
//! (`FLOTILLA_SEED=n` runs that one seed; `FLOTILLA_TRACE=d3` adds what is known of device d3).

use std::collections::{BTreeMap, HashMap, HashSet};

use super::advance::{after_approval, before_approval};
use super::*;
use crate::plan::{ErrorAction, ErrorCondition, Percent, PlannedGroup, Retry, SuccessCondition};
use crate::zoneinfo::SystemZones;
use flotilla_protocol::InstalledRelease;

const T0: u64 = 1_900_000_000;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// One simulated agent: the action it runs, how far it got, and one that waits behind it.
#[derive(Default, Clone)]
struct Agent {
    action: Option<String>,
    rollback: bool,
    stage: usize,
    queued: Option<(String, bool)>,
    seq: u64,
    /// Actions it ran to an end: as a real agent, it never applies an action id twice (its
    /// retained `desired` topic may hold one it finished when it comes back online).
    done: HashSet<String>,
}

/// Install phases in order; from index 3 (`activated`) a cancel is ignored.
const STAGES: [&str; 5] = [
    "accepted",
    "downloading",
    "staged",
    "activated",
    "confirming",
];
const POINT_OF_NO_RETURN: usize = 3;

struct World {
    rng: Rng,
    engine: Engine,
    now: u64,
    devices: Vec<String>,
    agents: BTreeMap<String, Agent>,
    /// (rollout, group) -> the time it started, once seen.
    started: HashMap<(String, String), u64>,
    /// Rollouts an operator moved past a gate on purpose (`next`, `resume`).
    forced: HashSet<String>,
    /// Rollouts that had ended before the current step.
    ended: HashSet<String>,
    /// (rollout, device) -> whether it was not yet started at the last check.
    scheduled: HashMap<(String, String), bool>,
    /// Device id -> the last action published on its retained `desired` topic (install,
    /// rollback, cancel, or the "nothing to do" of a forget).
    retained: BTreeMap<String, Effect>,
    /// Devices offline: they miss what is published and read their retained action when they
    /// come back.
    offline: HashSet<String>,
    /// Rollouts created besides `r` and its retries.
    made: usize,
    step: usize,
    seed: u64,
}

/// The site of device `d{i}`: `a` or `b`, and none for every third device.
fn site_of(id: &str) -> Option<&'static str> {
    let i: usize = id.trim_start_matches('d').parse().ok()?;
    match i % 3 {
        2 => None,
        _ if i.is_multiple_of(2) => Some("a"),
        _ => Some("b"),
    }
}

fn state(id: &str) -> DeviceState {
    DeviceState {
        device_id: id.into(),
        hardware_id: "pi4".into(),
        labels: site_of(id)
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

/// The device whose retained `desired` topic an effect publishes on.
fn published_on(e: &Effect) -> Option<&str> {
    match e {
        Effect::Desired { device, .. }
        | Effect::Rollback { device, .. }
        | Effect::Cancel { device, .. }
        | Effect::Forget { device } => Some(device),
        _ => None,
    }
}

/// What a published action is, for messages: `install r@…:d1`, `cancel r@…:d1`…
fn label(e: &Effect) -> String {
    match e {
        Effect::Desired { action_id, .. } => format!("install {action_id}"),
        Effect::Rollback { action_id, .. } => format!("rollback {action_id}"),
        Effect::Cancel { action_id, .. } => format!("cancel {action_id}"),
        Effect::Forget { .. } => "nothing to do".into(),
        other => format!("{other:?}"),
    }
}

impl World {
    fn new(seed: u64) -> Self {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let count = 2 + rng.below(7) as usize;
        let devices: Vec<String> = (0..count).map(|i| format!("d{i}")).collect();
        let mut engine = Engine::new(SystemZones);
        for d in &devices {
            engine.observe_state(state(d), T0);
        }
        let agents = devices
            .iter()
            .map(|d| (d.clone(), Agent::default()))
            .collect();
        let mut world = World {
            rng,
            engine,
            now: T0,
            devices,
            agents,
            started: HashMap::new(),
            forced: HashSet::new(),
            ended: HashSet::new(),
            scheduled: HashMap::new(),
            retained: BTreeMap::new(),
            offline: HashSet::new(),
            made: 0,
            step: 0,
            seed,
        };
        world.create("r");
        world
    }

    fn fail(&self, what: &str) -> ! {
        if let Ok(device) = std::env::var("FLOTILLA_TRACE") {
            self.dump(&device);
        }
        panic!(
            "seed {} step {}: {what}\nrerun with FLOTILLA_SEED={}",
            self.seed, self.step, self.seed
        );
    }

    /// What the engine and the world know of one device (`FLOTILLA_TRACE=d3` prints it with a
    /// failure): its slot in every rollout, the decisions naming it, the agent, the topic.
    fn dump(&self, device: &str) {
        for r in self.engine.rollouts() {
            for g in &r.groups {
                if let Some(s) = g.slots.get(device) {
                    eprintln!(
                        "{} ({}) group {}: {:?}, attempt {}, sent {}",
                        r.name, r.state, g.name, s.phase, s.attempt, s.sent
                    );
                }
            }
            for t in r.trace.iter().filter(|t| t.message.contains(device)) {
                eprintln!("{} at {}: {}", r.name, t.at, t.message);
            }
        }
        let agent = self
            .agents
            .get(device)
            .map(|a| (&a.action, a.rollback, a.stage, &a.queued));
        eprintln!(
            "agent {agent:?}, offline {}, owner {:?}, retained {:?}",
            self.offline.contains(device),
            self.engine.owners.get(device),
            self.retained.get(device).map(label)
        );
    }

    fn create(&mut self, name: &str) {
        let rng = &mut self.rng;
        let groups = 1 + rng.below(4) as usize;
        let mut planned = Vec::new();
        let mut start = 0;
        for gi in 0..groups {
            let left = self.devices.len() - start;
            let take = if gi + 1 == groups {
                left
            } else {
                rng.below(left as u64 + 1) as usize
            };
            let mut g = PlannedGroup {
                name: format!("g{gi}"),
                devices: self.devices[start..start + take].to_vec(),
                pace: Pace::default(),
                success: SuccessCondition::default(),
                error: None,
                before: Gate::default(),
                after: Gate::default(),
            };
            start += take;
            g.before.approval = rng.chance(25);
            g.after.approval = rng.chance(25);
            if rng.chance(25) {
                g.after.wait = 60 * (1 + rng.below(30));
            }
            if rng.chance(30) {
                g.pace.concurrency = Some(1 + rng.below(2) as usize);
            }
            if rng.chance(60) {
                g.error = Some(ErrorCondition {
                    percent: Some(
                        Percent::from_basis_points(100 * (10 + rng.below(60) as u32))
                            .expect("percent"),
                    ),
                    action: match rng.below(3) {
                        0 => ErrorAction::Pause,
                        1 => ErrorAction::Stop,
                        _ => ErrorAction::Rollback,
                    },
                    ..ErrorCondition::default()
                });
            }
            planned.push(g);
        }
        let mut spec = RolloutSpec::from_toml(
            &format!("name = \"{name}\"\nrelease = \"fw-2\"\n[groups]\ncount = 1\n"),
            &SystemZones,
        )
        .expect("valid spec");
        if rng.chance(50) {
            spec.policies.sites = Some(crate::plan::SitePolicy {
                label: "site".into(),
                max_busy: rng.chance(80).then(|| 1 + rng.below(2) as usize),
                max_unavailable: rng.chance(30).then(|| 1 + rng.below(3) as usize),
                peers: rng.chance(50),
                seed_wait: 60 * (1 + rng.below(20)),
            });
        }
        if rng.chance(40) {
            spec.policies.soak = 30 * (1 + rng.below(20));
        }
        if rng.chance(30) {
            spec.policies.weight = 400 + 100 * rng.below(3) as u32;
        }
        if rng.chance(30) {
            spec.policies.offline = crate::plan::OfflinePolicy::Skip;
        }
        if rng.chance(40) {
            spec.policies.timeout = Some(300 * (1 + rng.below(6)));
        }
        if rng.chance(40) {
            spec.policies.retry = Some(Retry {
                attempts: 1 + rng.below(2) as u32,
                backoff: 30,
            });
        }
        let plan = planner::Plan {
            groups: planned,
            excluded: Vec::new(),
            unassigned: Vec::new(),
            sites: None,
        };
        let release = ReleaseRef {
            name: "fw-2".into(),
            counter: 2,
            hardware: Vec::new(),
        };
        if let Ok(effects) = self
            .engine
            .create_planned(spec, release, plan, None, self.now)
        {
            self.take(effects);
        }
    }

    fn take(&mut self, effects: Vec<Effect>) {
        for e in effects {
            let Some(device) = published_on(&e) else {
                continue;
            };
            let device = device.to_owned();
            self.retained.insert(device.clone(), e.clone());
            if !self.offline.contains(&device) {
                self.receive(&device, e);
            }
        }
    }

    /// An online agent reads an action from its `desired` topic.
    fn receive(&mut self, device: &str, e: Effect) {
        match e {
            Effect::Desired { action_id, .. } => self.deliver(device, action_id, false),
            Effect::Rollback { action_id, .. } => self.deliver(device, action_id, true),
            Effect::Cancel { action_id, .. } => {
                let Some(agent) = self.agents.get_mut(device) else {
                    return;
                };
                if agent.queued.as_ref().is_some_and(|(q, _)| *q == action_id) {
                    agent.queued = None;
                }
                if agent.action.as_deref() == Some(action_id.as_str())
                    && !agent.rollback
                    && agent.stage < POINT_OF_NO_RETURN
                {
                    self.report(device, Phase::Canceled);
                    self.finish(device);
                }
            }
            _ => {}
        }
    }

    /// A device goes offline, or comes back and reads its retained `desired` topic.
    fn toggle_online(&mut self, device: &str) {
        let online = self.offline.remove(device);
        if !online {
            self.offline.insert(device.to_owned());
        }
        let mut s = state(device);
        s.online = online;
        if online {
            if let Some(e) = self.retained.get(device).cloned() {
                self.receive(device, e);
            }
        }
        let effects = self.engine.observe_state(s, self.now);
        self.check_effects(&effects);
        self.take(effects);
    }

    /// An agent gets a desired action: it supersedes one that has not passed activation (the
    /// old one ends canceled) and waits behind one that has.
    fn deliver(&mut self, device: &str, action_id: String, rollback: bool) {
        let Some(agent) = self.agents.get_mut(device) else {
            return;
        };
        if agent.action.as_deref() == Some(action_id.as_str()) || agent.done.contains(&action_id) {
            return;
        }
        match &agent.action {
            Some(_) if agent.rollback || agent.stage >= POINT_OF_NO_RETURN => {
                agent.queued = Some((action_id, rollback));
            }
            Some(old) => {
                let old = old.clone();
                agent.done.insert(old);
                self.report(device, Phase::Canceled);
                self.begin(device, action_id, rollback);
            }
            None => self.begin(device, action_id, rollback),
        }
    }

    fn begin(&mut self, device: &str, action_id: String, rollback: bool) {
        if let Some(agent) = self.agents.get_mut(device) {
            agent.action = Some(action_id);
            agent.rollback = rollback;
            agent.stage = 0;
        }
        self.report(device, Phase::Accepted);
    }

    fn finish(&mut self, device: &str) {
        let queued = self.agents.get_mut(device).and_then(|agent| {
            agent.done.extend(agent.action.take());
            agent.queued.take()
        });
        if let Some((id, rollback)) = queued {
            self.begin(device, id, rollback);
        }
    }

    fn report(&mut self, device: &str, phase: Phase) {
        let Some(agent) = self.agents.get_mut(device) else {
            return;
        };
        let Some(action_id) = agent.action.clone() else {
            return;
        };
        agent.seq += 1;
        let report = Report {
            device_id: device.into(),
            seq: agent.seq,
            rollout_id: action_id.split('@').next().unwrap_or_default().to_owned(),
            action_id,
            phase,
            at: self.now,
        };
        let effects = self.engine.observe_report(report, self.now);
        self.check_effects(&effects);
        self.take(effects);
    }

    /// One agent moves one step.
    fn agent_step(&mut self, device: &str) {
        let Some(agent) = self.agents.get(device).cloned() else {
            return;
        };
        if agent.action.is_none() || self.offline.contains(device) {
            return;
        }
        if agent.rollback {
            self.report(device, Phase::Ready);
            self.finish(device);
            return;
        }
        let next = agent.stage + 1;
        if next < STAGES.len() {
            if let Some(a) = self.agents.get_mut(device) {
                a.stage = next;
            }
            let phase = match STAGES[next] {
                "downloading" => Phase::Downloading { done: 1, total: 2 },
                "staged" => Phase::Staged,
                "activated" => Phase::Activated,
                _ => Phase::Confirming,
            };
            self.report(device, phase);
            return;
        }
        let phase = if self.rng.chance(70) {
            Phase::Ready
        } else {
            Phase::Failed {
                reason: "health check failed".into(),
                rolled_back: true,
            }
        };
        self.report(device, phase);
        self.finish(device);
    }

    fn rollout_names(&self) -> Vec<String> {
        self.engine.rollouts().map(|r| r.name.clone()).collect()
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> Option<T> {
        if items.is_empty() {
            return None;
        }
        let i = self.rng.below(items.len() as u64) as usize;
        Some(items[i].clone())
    }

    /// One random step.
    fn step(&mut self) {
        self.step += 1;
        self.ended = self
            .engine
            .rollouts()
            .filter(|r| r.state.is_terminal())
            .map(|r| r.name.clone())
            .collect();
        let now = self.now;
        let roll = self.rng.below(100);
        let Some(name) = self.pick(&self.rollout_names()) else {
            return;
        };
        let result = match roll {
            0..=35 => {
                let device = self.pick(&self.devices.clone());
                if let Some(d) = device {
                    self.agent_step(&d);
                }
                return;
            }
            36..=44 => {
                self.now += 1 + self.rng.below(900);
                let effects = self.engine.tick(self.now);
                self.check_effects(&effects);
                self.take(effects);
                return;
            }
            45..=49 => self.engine.start(&name, now),
            50..=53 => self.engine.pause(&name, now),
            54..=57 => {
                let r = self.engine.resume(&name, now);
                if r.is_ok() {
                    self.forced.insert(name.clone());
                }
                r
            }
            58..=60 => self.engine.stop(&name, now),
            61..=67 => {
                let skip = self.rng.chance(50);
                let r = self.engine.trigger_next_with(&name, "alice", skip, now);
                if r.is_ok() {
                    self.forced.insert(name.clone());
                }
                r
            }
            68..=76 => {
                let pending: Vec<String> = self
                    .engine
                    .approvals()
                    .into_iter()
                    .filter(|a| !a.approved)
                    .map(|a| a.name)
                    .collect();
                match self.pick(&pending) {
                    Some(a) => self.engine.approve(&a, now),
                    None => return,
                }
            }
            77..=79 => {
                let retry = format!("{name}-x");
                let r = self.engine.retry_failed(&name, Some(retry.clone()), now);
                if r.is_ok() && self.rng.chance(70) {
                    let started = self.engine.start(&retry, now);
                    if let Ok(effects) = &started {
                        self.check_effects(effects);
                    }
                    if let Ok(effects) = started {
                        self.take(effects);
                    }
                }
                r
            }
            80..=81 => {
                let Some(d) = self.pick(&self.devices.clone()) else {
                    return;
                };
                let r = self.engine.delete_device(&d, now);
                // The device announces itself again later; it is a new device then.
                let effects = self.engine.observe_state(self.state(&d), now);
                self.take(effects);
                r
            }
            82..=85 => {
                if let Some(d) = self.pick(&self.devices.clone()) {
                    self.toggle_online(&d);
                }
                return;
            }
            86..=90 => {
                // Another rollout over the same devices, started at once or later (a few: the
                // checks go over every rollout after every step).
                if self.made >= 3 {
                    return;
                }
                self.made += 1;
                let name = format!("n{}", self.made);
                self.create(&name);
                if self.rng.chance(60) {
                    self.engine.start(&name, now)
                } else {
                    return;
                }
            }
            _ => {
                self.restart();
                return;
            }
        };
        if let Ok(effects) = result {
            self.check_effects(&effects);
            self.take(effects);
        }
    }

    /// The coordinator restarts: every rollout goes through its stored form.
    fn restart(&mut self) {
        let stored: Vec<Rollout> = self
            .engine
            .rollouts()
            .map(|r| {
                let json = serde_json::to_string(r).expect("serializes");
                serde_json::from_str(&json).expect("round-trips")
            })
            .collect();
        for (a, b) in self.engine.rollouts().zip(&stored) {
            if a != b {
                self.fail(&format!("rollout {} changed in a serde round trip", a.name));
            }
        }
        self.engine = Engine::restore(stored, SystemZones);
        for d in self.devices.clone() {
            let effects = self.engine.observe_state(self.state(&d), self.now);
            self.take(effects);
        }
        let effects = self.engine.reissue(self.now);
        self.check_effects(&effects);
        for e in &effects {
            if let Some(device) = published_on(e) {
                self.check_owed(device, std::slice::from_ref(e), "a restart publishes");
            }
        }
        self.take(effects);
    }

    /// A device's state as it announces it: online unless it is offline.
    fn state(&self, device: &str) -> DeviceState {
        let mut s = state(device);
        s.online = !self.offline.contains(device);
        s
    }

    /// What the engine owes a device (`owed`, reissued or read back by a repair of its
    /// retained `desired` topic) is at most one action, and the one that topic holds.
    fn check_owed(&self, device: &str, owed: &[Effect], how: &str) {
        let held = self.retained.get(device).map(label);
        let owed: Vec<String> = owed.iter().map(label).collect();
        let fine = match owed.as_slice() {
            [] => true,
            [one] => held.as_ref() == Some(one),
            _ => false,
        };
        if !fine {
            let held = held.unwrap_or_else(|| "nothing".into());
            self.fail(&format!(
                "device {device}: its retained desired action is {held}, and {how} {owed:?} \
                 over it: the newest action sent to a device is the one it is owed"
            ));
        }
    }

    /// Effects never install for an ended rollout, and roll back only after the rollback
    /// error action.
    fn check_effects(&self, effects: &[Effect]) {
        for e in effects {
            if let Effect::Desired { device, peers, .. } = e {
                if let Some(p) = peers.iter().find(|p| site_of(p) != site_of(device)) {
                    self.fail(&format!(
                        "device {device} was told to fetch from {p} of another site"
                    ));
                }
            }
            let (rollout, rollback) = match e {
                Effect::Desired { rollout, .. } => (rollout, false),
                Effect::Rollback { rollout, .. } => (rollout, true),
                _ => continue,
            };
            let Some(r) = self.engine.rollout(rollout) else {
                continue;
            };
            // An install sent in the step that ended the rollout must be canceled in it too.
            let canceled_after = |id: &str| {
                effects
                    .iter()
                    .any(|c| matches!(c, Effect::Cancel { action_id, .. } if action_id == id))
            };
            if let Effect::Desired { action_id, .. } = e {
                if r.state.is_terminal()
                    && (self.ended.contains(rollout) || !canceled_after(action_id))
                {
                    self.fail(&format!("rollout {rollout} is {} and sent {e:?}", r.state));
                }
            }
            if rollback && !r.rolled_back {
                self.fail(&format!(
                    "rollout {rollout} was not rolled back and sent {e:?}"
                ));
            }
        }
    }

    fn check(&mut self) {
        for d in &self.devices {
            let owed = self.engine.reissue_device(d);
            self.check_owed(d, owed.as_slice(), "a repair of that topic publishes");
        }
        // Borrowed out of the world while it is checked (cloning every rollout's trace after
        // every step would cost more than the steps).
        let engine = std::mem::replace(&mut self.engine, Engine::new(SystemZones));
        self.check_rollouts(&engine);
        self.engine = engine;
    }

    fn check_rollouts(&mut self, engine: &Engine) {
        for r in engine.rollouts() {
            // Never more devices of a site busy than its budget (a rollback sent by the rollback
            // error action goes to every device that installed, whatever its site).
            if let Some(limit) = r.spec.policies.sites.as_ref().and_then(|p| p.max_busy) {
                let mut busy: BTreeMap<&str, usize> = BTreeMap::new();
                for g in &r.groups {
                    for (d, s) in &g.slots {
                        let working = match &s.phase {
                            DevicePhase::InProgress(p) => p != model::ROLLING_BACK,
                            DevicePhase::Retrying(_) => true,
                            _ => false,
                        };
                        if let (true, Some(site)) = (working, s.site.as_deref()) {
                            if site_of(d) != Some(site) {
                                self.fail(&format!("device {d} is in site {site}"));
                            }
                            *busy.entry(site).or_default() += 1;
                        }
                    }
                }
                if let Some((site, n)) = busy.iter().find(|(_, n)| **n > limit) {
                    self.fail(&format!(
                        "rollout {}: site {site} has {n} devices busy, more than {limit}",
                        r.name
                    ));
                }
            }
            if let Some(limit) = r
                .spec
                .policies
                .sites
                .as_ref()
                .and_then(|p| p.max_unavailable)
            {
                self.check_unavailable(r, limit);
            }
            let summary = r.summary();
            for (gi, g) in r.groups.iter().enumerate() {
                // Counters are a count over the devices and add up.
                let mut counts = crate::conditions::GroupCounts {
                    total: g.slots.len(),
                    ..Default::default()
                };
                for s in g.slots.values() {
                    s.phase.count_in(&mut counts, true);
                }
                if counts != g.counts {
                    self.fail(&format!(
                        "rollout {} group {}: counters {:?} but devices say {counts:?}",
                        r.name, g.name, g.counts
                    ));
                }
                let mut sites = g.clone();
                sites.count_sites();
                let kept: BTreeMap<_, _> =
                    g.cache.sites.iter().filter(|(_, c)| c.total > 0).collect();
                if kept != sites.cache.sites.iter().collect::<BTreeMap<_, _>>() {
                    self.fail(&format!(
                        "rollout {} group {}: site counts {:?} but devices say {:?}",
                        r.name, g.name, g.cache.sites, sites.cache.sites
                    ));
                }
                let status = &summary.groups[gi];
                let sum = status.ready
                    + status.failed
                    + status.in_progress
                    + status.scheduled
                    + status.canceled;
                if sum != status.total {
                    self.fail(&format!(
                        "rollout {} group {}: status adds up to {sum} of {}",
                        r.name, g.name, status.total
                    ));
                }
                let Some(at) = g.started_at else {
                    if !matches!(g.state, GroupState::Scheduled | GroupState::Approval) {
                        self.fail(&format!(
                            "group {} is {} but never started",
                            g.name, g.state
                        ));
                    }
                    continue;
                };
                // No group starts twice.
                let key = (r.name.clone(), g.name.clone());
                match self.started.get(&key) {
                    Some(&first) if first != at => self.fail(&format!(
                        "rollout {} group {} started at {first} and again at {at}",
                        r.name, g.name
                    )),
                    _ => {
                        self.started.insert(key, at);
                    }
                }
                let starts = r
                    .trace
                    .iter()
                    .filter(|t| t.message.starts_with(&format!("group {} started", g.name)))
                    .count();
                if starts > 1 {
                    self.fail(&format!(
                        "rollout {} group {} started {starts} times",
                        r.name, g.name
                    ));
                }
                // No group starts while a gate before it is pending.
                let approved =
                    |name: &str| r.approvals.iter().any(|a| a.name == name && a.approved);
                if g.before.approval && !approved(&before_approval(&r.name, &g.name)) {
                    self.fail(&format!(
                        "rollout {} group {} started without its before approval",
                        r.name, g.name
                    ));
                }
                if gi > 0 {
                    let prev = &r.groups[gi - 1];
                    if prev.after.approval && !approved(&after_approval(&r.name, &prev.name)) {
                        self.fail(&format!(
                            "rollout {} group {} started while the approval after {} is pending",
                            r.name, g.name, prev.name
                        ));
                    }
                    if prev.after.wait > 0 && !self.forced.contains(&r.name) {
                        let due = prev.succeeded_at.map(|s| s + prev.after.wait);
                        if due.is_none_or(|due| at < due) {
                            self.fail(&format!(
                                "rollout {} group {} started at {at} before the timed wait after {} ran out ({due:?})",
                                r.name, g.name, prev.name
                            ));
                        }
                    }
                }
            }
        }
    }

    /// The site's unavailable limit holds back starts: a device of a site starts only while
    /// fewer than `limit` of the site are unavailable (busy, soaking or failed, over every group
    /// of the rollout), so at the end of a step in which one started the site has at most
    /// `limit` unavailable. That is all the engine promises: devices already started may push a
    /// site over later (a late failure of a canceled device, a rollback sent to every device that
    /// installed), and then nothing more of the site starts.
    fn check_unavailable(&mut self, r: &Rollout, limit: usize) {
        let mut unavailable: BTreeMap<&str, usize> = BTreeMap::new();
        let mut started: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for g in &r.groups {
            for (d, s) in &g.slots {
                // A rollout created in this step starts with every device scheduled.
                let was_scheduled = self
                    .scheduled
                    .insert(
                        (r.name.clone(), d.clone()),
                        s.phase == DevicePhase::Scheduled,
                    )
                    .unwrap_or(true);
                let Some(site) = s.site.as_deref() else {
                    continue;
                };
                let not_ready = matches!(
                    s.phase,
                    DevicePhase::InProgress(_) | DevicePhase::Retrying(_) | DevicePhase::Soaking
                ) || s.phase.is_failure();
                if not_ready {
                    *unavailable.entry(site).or_default() += 1;
                }
                if was_scheduled && matches!(s.phase, DevicePhase::InProgress(_)) {
                    started.entry(site).or_default().push(d);
                }
            }
        }
        for (site, devices) in started {
            let n = unavailable.get(site).copied().unwrap_or(0);
            if n > limit {
                self.fail(&format!(
                    "rollout {}: {devices:?} of site {site} started and the site has {n} \
                     devices unavailable, more than {limit}",
                    r.name
                ));
            }
        }
    }

    /// The operators let everything finish: approve, resume, devices report, time passes.
    fn drain(&mut self) {
        let mut away: Vec<String> = self.offline.iter().cloned().collect();
        away.sort();
        for d in away {
            self.toggle_online(&d);
        }
        for _ in 0..400 {
            self.step += 1;
            let mut moved = false;
            for a in self.engine.approvals() {
                if !a.approved && !a.withdrawn {
                    let effects = self.engine.approve(&a.name, self.now).expect("approves");
                    self.take(effects);
                    moved = true;
                }
            }
            for name in self.rollout_names() {
                let state = self.engine.rollout(&name).map(|r| r.state);
                let effects = match state {
                    Some(RolloutState::Paused) => {
                        self.forced.insert(name.clone());
                        self.engine.resume(&name, self.now)
                    }
                    Some(RolloutState::Ready) => self.engine.start(&name, self.now),
                    _ => continue,
                };
                self.take(effects.expect("moves"));
                moved = true;
            }
            for d in self.devices.clone() {
                if self.agents.get(&d).is_some_and(|a| a.action.is_some()) {
                    self.agent_step(&d);
                    moved = true;
                }
            }
            self.check();
            if !moved && self.engine.next_timer().is_none() {
                // A site budget or a group's concurrency held by failed devices holds the rest
                // until an operator acts (Fleet waits, it never fails).
                for name in self.rollout_names() {
                    let held = self.engine.rollout(&name).is_some_and(|r| {
                        r.state == RolloutState::Running
                            && r.waiting.as_deref().is_some_and(|w| {
                                w.contains("unavailable") || w.contains("are not ready")
                            })
                    });
                    if held {
                        let effects = self.engine.stop(&name, self.now).expect("stops");
                        self.take(effects);
                        moved = true;
                    }
                }
            }
            if !moved {
                match self.engine.next_timer() {
                    Some(at) => self.now = self.now.max(at) + 1,
                    None => self.now += 60,
                }
                let effects = self.engine.tick(self.now);
                self.check_effects(&effects);
                self.take(effects);
            }
            let done = self.engine.rollouts().all(|r| {
                r.state.is_terminal() && r.groups.iter().all(|g| g.slots.values().all(finished))
            });
            if done && self.agents.values().all(|a| a.action.is_none()) {
                return;
            }
        }
        let open: Vec<String> = self
            .engine
            .rollouts()
            .flat_map(|r| {
                r.groups.iter().flat_map(move |g| {
                    g.slots
                        .iter()
                        .filter(|(_, s)| !finished(s))
                        .map(move |(d, s)| format!("{}/{}/{d}: {}", r.name, g.name, s.phase.name()))
                })
            })
            .collect();
        let states: Vec<String> = self
            .engine
            .rollouts()
            .map(|r| format!("{} {}", r.name, r.state))
            .collect();
        self.fail(&format!(
            "after the drain: rollouts {states:?}, devices not in a final phase {open:?}"
        ));
    }
}

/// A device's slot is over: its phase is final, or the device was deleted (forgotten, it shows
/// as not started whatever it was doing; the cancel or "nothing to do" it was sent may be the
/// last it hears of the rollout).
fn finished(s: &Slot) -> bool {
    s.deleted || s.phase.is_terminal()
}

fn run(seed: u64, steps: usize) {
    let mut world = World::new(seed);
    world.check();
    for _ in 0..steps {
        world.step();
        world.check();
    }
    world.drain();
}

#[test]
fn random_commands_reports_restarts_and_clock_jumps_keep_the_invariants() {
    if let Some(seed) = std::env::var("FLOTILLA_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        run(seed, 300);
        return;
    }
    for seed in 1..=600 {
        run(seed, 300);
    }
}
