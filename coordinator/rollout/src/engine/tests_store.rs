//! The engine's stored form through saves as the service makes them (`stored.rs`): a map stands
//! in for the store's tree.

use std::collections::BTreeMap;

use flotilla_protocol::DeviceState;

use super::model::{DevicePhase, ReleaseRef, Rollout};
use super::stored::{FromStored, LIST, SLOT};
use super::Engine;
use crate::spec::RolloutSpec;
use crate::zoneinfo::SystemZones;

/// The store's part for the engine's tests: saves as the service does (the whole rollout at its
/// first save, what changed after that) into a map, and reads back as a restart does.
#[derive(Default)]
pub(crate) struct MemoryStore {
    /// Rollout name -> key suffix ("" for the head) -> value.
    records: BTreeMap<String, BTreeMap<String, Vec<u8>>>,
}

impl MemoryStore {
    pub(crate) fn save(&mut self, engine: &mut Engine, name: &str) {
        let Some(rollout) = engine.rollout(name) else {
            return;
        };
        let full = !self.records.contains_key(name);
        let changes = rollout.stored_changes(full).expect("encodes");
        let records = self.records.entry(name.to_owned()).or_default();
        records.insert(String::new(), changes.head);
        for (key, value) in changes.parts {
            match value {
                Some(v) => records.insert(key, v),
                None => records.remove(&key),
            };
        }
        engine.mark_saved(name);
    }

    /// Saves every rollout (a tick's saves), forgetting those the engine no longer has.
    pub(crate) fn save_all(&mut self, engine: &mut Engine) {
        let names: Vec<String> = engine.rollouts().map(|r| r.name.clone()).collect();
        self.records.retain(|name, _| names.contains(name));
        for name in names {
            self.save(engine, &name);
        }
    }

    /// Every rollout as a restarted coordinator reads it.
    pub(crate) fn load(&self) -> Vec<Rollout> {
        self.records
            .values()
            .map(|records| {
                let parts = records
                    .iter()
                    .filter(|(k, _)| !k.is_empty())
                    .map(|(k, v)| (k.clone(), v.clone()));
                let back = Rollout::from_stored(&records[""], parts).expect("reads");
                assert!(back.skipped.is_empty(), "{:?}", back.skipped);
                back.rollout
            })
            .collect()
    }
}

const NOW: u64 = 1_700_000_000;

/// A started rollout of six devices in two groups, its first devices sent their actions.
fn two_group_rollout() -> Rollout {
    let mut engine = Engine::new(SystemZones);
    for i in 0..6 {
        let state = DeviceState {
            device_id: format!("dev-{i}"),
            hardware_id: "pi4".into(),
            labels: Default::default(),
            installed: None,
            current: None,
            online: true,
            agent_version: "0.1.0".into(),
            at: NOW,
        };
        engine.observe_state(state, NOW);
    }
    let spec = RolloutSpec::from_toml(
        "name = \"r\"\nrelease = \"fw-2\"\n[groups]\ncount = 2\n",
        &SystemZones,
    )
    .expect("spec");
    let release = ReleaseRef {
        name: "fw-2".into(),
        counter: 2,
        hardware: Vec::new(),
    };
    engine.create_rollout(spec, release, NOW).expect("created");
    engine.start("r", NOW).expect("started");
    engine.rollout("r").expect("rollout").clone()
}

fn records(rollout: &Rollout, full: bool) -> (Vec<u8>, BTreeMap<String, Option<Vec<u8>>>) {
    let changes = rollout.stored_changes(full).expect("encodes");
    (changes.head, changes.parts.into_iter().collect())
}

/// Applies a save to a map standing in for the store's tree.
fn apply(store: &mut BTreeMap<String, Vec<u8>>, rollout: &mut Rollout, full: bool) {
    let (head, parts) = records(rollout, full);
    if full {
        store.clear();
    }
    store.insert(String::new(), head);
    for (key, value) in parts {
        match value {
            Some(v) => store.insert(key, v),
            None => store.remove(&key),
        };
    }
    rollout.mark_saved();
}

fn read(store: &BTreeMap<String, Vec<u8>>) -> FromStored {
    let parts = store
        .iter()
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.clone(), v.clone()));
    Rollout::from_stored(&store[""], parts).expect("reads")
}

#[test]
fn a_save_writes_only_what_changed_and_the_records_read_back_equal() {
    let mut rollout = two_group_rollout();
    let mut store = BTreeMap::new();
    apply(&mut store, &mut rollout, true);
    let back = read(&store);
    assert!(!back.inline && back.skipped.is_empty());
    assert_eq!(back.rollout, rollout);

    let (_, parts) = records(&rollout, false);
    assert!(parts.is_empty(), "nothing changed: {:?}", parts.keys());

    let device = rollout.groups[1].devices[0].clone();
    rollout.groups[1].set_phase(&device, DevicePhase::InProgress("downloading".into()));
    let (_, parts) = records(&rollout, false);
    assert_eq!(
        parts.keys().collect::<Vec<_>>(),
        [&format!("{SLOT}{device}")],
        "one device changed"
    );
    apply(&mut store, &mut rollout, false);
    assert_eq!(read(&store).rollout, rollout);

    let gone = rollout.groups[0].devices[0].clone();
    rollout.groups[0].slots.remove(&gone);
    rollout.groups[0].devices.remove(0);
    apply(&mut store, &mut rollout, false);
    assert!(!store.contains_key(&format!("{SLOT}{gone}")));
    assert_eq!(read(&store).rollout, rollout);
}

#[test]
fn a_head_with_its_collections_inline_reads_and_asks_for_a_whole_save() {
    let rollout = two_group_rollout();
    // The layout before per-device records: one JSON document with everything in it.
    let mut old = serde_json::to_value(&rollout).expect("json");
    for (g, group) in rollout.groups.iter().enumerate() {
        old["groups"][g]["slots"] = serde_json::to_value(&group.slots).expect("json");
        old["groups"][g]["devices"] = serde_json::to_value(&group.devices).expect("json");
    }
    let head = serde_json::to_vec(&old).expect("json");
    let back = Rollout::from_stored(&head, Vec::new()).expect("reads");
    assert!(back.inline);
    assert_eq!(back.rollout, rollout);
}

#[test]
fn records_that_fit_no_group_are_skipped_and_named() {
    let mut rollout = two_group_rollout();
    let mut store = BTreeMap::new();
    apply(&mut store, &mut rollout, true);
    store.insert(format!("{SLOT}stray"), b"[9,{}]".to_vec());
    store.insert(format!("{LIST}7"), b"[]".to_vec());
    store.insert(format!("{SLOT}junk"), b"not json".to_vec());
    let back = read(&store);
    assert_eq!(back.rollout, rollout, "the good records still read");
    let keys: Vec<&str> = back.skipped.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys.len(), 3, "{:?}", back.skipped);
}
