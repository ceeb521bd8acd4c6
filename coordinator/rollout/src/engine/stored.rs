//! A rollout's stored form: a head and one record per device, so that saving a rollout writes
//! what changed since the last save, not the whole rollout
//! (docs/decisions/0035-per-device-rollout-records.md).
//!
//! ```text
//! {name}                  the head: the rollout without its per-device collections (JSON)
//! {name}\0s\0{device}     [group index, slot]
//! {name}\0g\0{index}      the group's devices in rollout order
//! {name}\0seen            the devices a dynamic rollout has seen
//! ```
//!
//! The store writes a save's records in one atomic batch, so a head never goes with per-device
//! records of another moment. A head written before this layout carries its collections inline;
//! it still reads, and [`FromStored::inline`] says the next save must write it whole.

use std::collections::BTreeMap;

use super::model::{Rollout, Slot};
use super::tracked::{Devices, Seen, Slots};

/// Key suffix, after the rollout's name, of a device's slot.
pub const SLOT: &str = "\0s\0";
/// Key suffix of a group's device list; the group's index follows in decimal.
pub const LIST: &str = "\0g\0";
/// Key suffix of a dynamic rollout's seen devices.
pub const SEEN: &str = "\0seen";
/// What every per-device record's key starts with after the name.
pub const PARTS: &str = "\0";

/// What one save writes of a rollout.
#[derive(Debug, Default)]
pub struct Changes {
    /// The rollout without its per-device collections, as JSON.
    pub head: Vec<u8>,
    /// Records under the rollout's name by key suffix; `None` removes the record.
    pub parts: Vec<(String, Option<Vec<u8>>)>,
}

/// A rollout read back from its records.
#[derive(Debug)]
pub struct FromStored {
    pub rollout: Rollout,
    /// The head held its collections inline (an older layout): save it whole.
    pub inline: bool,
    /// Records that did not fit the head (no such group, undecodable), by key suffix and why.
    pub skipped: Vec<(String, String)>,
}

impl Rollout {
    /// The records a save writes: with `full` every record of the rollout (the store then
    /// removes any other record under its name first), otherwise the head and what changed
    /// since [`Rollout::mark_saved`].
    pub fn stored_changes(&self, full: bool) -> Result<Changes, serde_json::Error> {
        let mut parts = Vec::new();
        for (gi, group) in self.groups.iter().enumerate() {
            if full || group.devices.is_unsaved() {
                parts.push((
                    format!("{LIST}{gi}"),
                    Some(serde_json::to_vec(&group.devices)?),
                ));
            }
            let slot_record = |device: &String, slot: &Slot| {
                serde_json::to_vec(&(gi, slot)).map(|v| (format!("{SLOT}{device}"), Some(v)))
            };
            if full {
                for (device, slot) in group.slots.iter() {
                    parts.push(slot_record(device, slot)?);
                }
            } else {
                let (changed, removed) = group.slots.unsaved();
                for device in removed {
                    parts.push((format!("{SLOT}{device}"), None));
                }
                for (device, slot) in changed {
                    parts.push(slot_record(device, slot)?);
                }
            }
        }
        if full || self.seen.is_unsaved() {
            let seen = (!self.seen.is_empty())
                .then(|| serde_json::to_vec(&self.seen))
                .transpose()?;
            parts.push((SEEN.to_owned(), seen));
        }
        Ok(Changes {
            head: serde_json::to_vec(self)?,
            parts,
        })
    }

    /// The store holds what [`Rollout::stored_changes`] gave: nothing is changed any more.
    pub fn mark_saved(&mut self) {
        for group in &mut self.groups {
            group.devices.mark_saved();
            group.slots.mark_saved();
        }
        self.seen.mark_saved();
    }

    /// Reads a rollout from its head and its per-device records (key suffix, value), in any
    /// order. A record that does not decode or names no group of the head is skipped and
    /// reported; only a head that does not decode is an error.
    pub fn from_stored(
        head: &[u8],
        parts: impl IntoIterator<Item = (String, Vec<u8>)>,
    ) -> Result<FromStored, serde_json::Error> {
        let mut rollout: Rollout = serde_json::from_slice(head)?;
        let inline = rollout
            .groups
            .iter()
            .any(|g| !g.slots.is_empty() || !g.devices.is_empty())
            || !rollout.seen.is_empty();
        let mut skipped = Vec::new();
        let mut slots: Vec<BTreeMap<String, Slot>> = vec![BTreeMap::new(); rollout.groups.len()];
        for (key, value) in parts {
            let read = if let Some(device) = key.strip_prefix(SLOT) {
                serde_json::from_slice::<(usize, Slot)>(&value)
                    .map_err(|e| e.to_string())
                    .and_then(|(gi, slot)| match slots.get_mut(gi) {
                        Some(group) => {
                            group.insert(device.to_owned(), slot);
                            Ok(())
                        }
                        None => Err(format!("group {gi} is not in the rollout")),
                    })
            } else if let Some(index) = key.strip_prefix(LIST) {
                let group = index
                    .parse::<usize>()
                    .ok()
                    .and_then(|gi| rollout.groups.get_mut(gi));
                match group {
                    Some(group) => serde_json::from_slice::<Devices>(&value)
                        .map(|devices| group.devices = devices)
                        .map_err(|e| e.to_string()),
                    None => Err(format!("group {index} is not in the rollout")),
                }
            } else if key == SEEN {
                serde_json::from_slice::<Seen>(&value)
                    .map(|seen| rollout.seen = seen)
                    .map_err(|e| e.to_string())
            } else {
                Err("not a record of a rollout".to_owned())
            };
            if let Err(why) = read {
                skipped.push((key, why));
            }
        }
        for (group, slots) in rollout.groups.iter_mut().zip(slots) {
            if !slots.is_empty() {
                group.slots = read_back(slots);
            }
        }
        Ok(FromStored {
            rollout,
            inline,
            skipped,
        })
    }
}

/// Slots as the store holds them: unmarked.
fn read_back(map: BTreeMap<String, Slot>) -> Slots {
    let mut slots: Slots = map.into_iter().collect();
    slots.mark_saved();
    slots
}

/// The store's part for the engine's tests: saves as the service does (the whole rollout at its
/// first save, what changed after that) into a map, and reads back as a restart does.
#[cfg(test)]
#[derive(Default)]
pub(crate) struct MemoryStore {
    /// Rollout name -> key suffix ("" for the head) -> value.
    records: BTreeMap<String, BTreeMap<String, Vec<u8>>>,
}

#[cfg(test)]
impl MemoryStore {
    pub(crate) fn save(&mut self, engine: &mut super::Engine, name: &str) {
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
    pub(crate) fn save_all(&mut self, engine: &mut super::Engine) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::model::{DevicePhase, ReleaseRef};
    use crate::engine::Engine;
    use crate::spec::RolloutSpec;
    use crate::zoneinfo::SystemZones;
    use flotilla_protocol::DeviceState;

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
}
