//! The per-device collections of a rollout, each noting what changed since the store last wrote
//! it, so a save writes what changed instead of the whole rollout (`stored.rs`,
//! docs/decisions/0035-per-device-rollout-records.md).
//!
//! Reads go through `Deref` to the plain collection; every change goes through a method here
//! that marks it, so no change can miss the store: the inner collections are private to this
//! module. [`Slots::get_mut`] marks the slot whether or not the caller changes it; an extra
//! write is harmless, a missed one would lose progress at a restart.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Deref;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::model::Slot;

/// Whether something changed since the store last wrote it. Never stored, and equal to every
/// other: a rollout read back from the store equals the one written.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unsaved(pub(crate) bool);

impl PartialEq for Unsaved {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Unsaved {}

/// A group's slots by device id.
#[derive(Debug, Clone, Default)]
pub struct Slots {
    map: BTreeMap<String, Slot>,
    /// Some slot is marked.
    unsaved: bool,
    /// Devices whose slots were removed since the last save.
    removed: Vec<String>,
}

impl Slots {
    /// The slot of `device`, marked as changed.
    pub fn get_mut(&mut self, device: &str) -> Option<&mut Slot> {
        let slot = self.map.get_mut(device)?;
        slot.unsaved = Unsaved(true);
        self.unsaved = true;
        Some(slot)
    }

    /// Every slot, each marked as changed.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&String, &mut Slot)> {
        self.unsaved = true;
        self.map.iter_mut().map(|(device, slot)| {
            slot.unsaved = Unsaved(true);
            (device, slot)
        })
    }

    pub fn insert(&mut self, device: String, mut slot: Slot) -> Option<Slot> {
        slot.unsaved = Unsaved(true);
        self.unsaved = true;
        self.removed.retain(|d| *d != device);
        self.map.insert(device, slot)
    }

    pub fn remove(&mut self, device: &str) -> Option<Slot> {
        let slot = self.map.remove(device)?;
        self.removed.push(device.to_owned());
        Some(slot)
    }

    /// The slots changed since the last save, and the devices whose slots were removed.
    pub(crate) fn unsaved(&self) -> (impl Iterator<Item = (&String, &Slot)>, &[String]) {
        let any = self.unsaved;
        let changed = self
            .map
            .iter()
            .filter(move |(_, slot)| any && slot.unsaved.0);
        (changed, &self.removed)
    }

    pub(crate) fn mark_saved(&mut self) {
        if self.unsaved {
            for slot in self.map.values_mut() {
                slot.unsaved = Unsaved(false);
            }
        }
        self.unsaved = false;
        self.removed.clear();
    }
}

impl Deref for Slots {
    type Target = BTreeMap<String, Slot>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl FromIterator<(String, Slot)> for Slots {
    /// New slots, all marked: nothing of them is stored yet.
    fn from_iter<I: IntoIterator<Item = (String, Slot)>>(iter: I) -> Self {
        let mut slots = Slots::default();
        for (device, slot) in iter {
            slots.insert(device, slot);
        }
        slots
    }
}

impl PartialEq for Slots {
    fn eq(&self, other: &Self) -> bool {
        self.map == other.map
    }
}

/// A group's devices in rollout order.
#[derive(Debug, Clone, Default)]
pub struct Devices {
    list: Vec<String>,
    unsaved: bool,
}

impl Devices {
    /// A new list, marked: it is not stored yet.
    pub fn new(list: Vec<String>) -> Self {
        Devices {
            list,
            unsaved: true,
        }
    }

    pub fn push(&mut self, device: String) {
        self.unsaved = true;
        self.list.push(device);
    }

    pub fn remove(&mut self, pos: usize) -> String {
        self.unsaved = true;
        self.list.remove(pos)
    }

    pub(crate) fn is_unsaved(&self) -> bool {
        self.unsaved
    }

    pub(crate) fn mark_saved(&mut self) {
        self.unsaved = false;
    }
}

impl Deref for Devices {
    type Target = [String];
    fn deref(&self) -> &[String] {
        &self.list
    }
}

impl PartialEq for Devices {
    fn eq(&self, other: &Self) -> bool {
        self.list == other.list
    }
}

/// The devices a dynamic rollout has seen.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    set: BTreeSet<String>,
    unsaved: bool,
}

impl Seen {
    /// True when `device` was not seen before.
    pub fn insert(&mut self, device: String) -> bool {
        let new = self.set.insert(device);
        self.unsaved |= new;
        new
    }

    pub fn remove(&mut self, device: &str) -> bool {
        let removed = self.set.remove(device);
        self.unsaved |= removed;
        removed
    }

    pub fn extend(&mut self, devices: impl IntoIterator<Item = String>) {
        for device in devices {
            self.insert(device);
        }
    }

    pub(crate) fn is_unsaved(&self) -> bool {
        self.unsaved
    }

    pub(crate) fn mark_saved(&mut self) {
        self.unsaved = false;
    }
}

impl Deref for Seen {
    type Target = BTreeSet<String>;
    fn deref(&self) -> &BTreeSet<String> {
        &self.set
    }
}

impl FromIterator<String> for Seen {
    fn from_iter<I: IntoIterator<Item = String>>(iter: I) -> Self {
        let mut seen = Seen::default();
        seen.extend(iter);
        seen
    }
}

impl PartialEq for Seen {
    fn eq(&self, other: &Self) -> bool {
        self.set == other.set
    }
}

impl<'a> IntoIterator for &'a Slots {
    type Item = (&'a String, &'a Slot);
    type IntoIter = std::collections::btree_map::Iter<'a, String, Slot>;
    fn into_iter(self) -> Self::IntoIter {
        self.map.iter()
    }
}

impl<'a> IntoIterator for &'a Devices {
    type Item = &'a String;
    type IntoIter = std::slice::Iter<'a, String>;
    fn into_iter(self) -> Self::IntoIter {
        self.list.iter()
    }
}

impl<'a> IntoIterator for &'a Seen {
    type Item = &'a String;
    type IntoIter = std::collections::btree_set::Iter<'a, String>;
    fn into_iter(self) -> Self::IntoIter {
        self.set.iter()
    }
}

/// Each collection is stored as its plain form; one read back is unmarked (it is what the store
/// holds).
macro_rules! plain_serde {
    ($ty:ident, $field:ident, $inner:ty) => {
        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                self.$field.serialize(s)
            }
        }

        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                Ok($ty {
                    $field: <$inner>::deserialize(d)?,
                    ..Default::default()
                })
            }
        }
    };
}

plain_serde!(Slots, map, BTreeMap<String, Slot>);
plain_serde!(Devices, list, Vec<String>);
plain_serde!(Seen, set, BTreeSet<String>);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_change_is_marked_and_a_save_clears_the_marks() {
        let mut slots: Slots = [("a".to_owned(), Slot::scheduled())].into_iter().collect();
        assert_eq!(slots.unsaved().0.count(), 1, "a new slot is not stored yet");
        slots.mark_saved();
        assert_eq!(slots.unsaved().0.count(), 0);

        slots.insert("b".into(), Slot::scheduled());
        slots.get_mut("a").expect("a").attempt = 2;
        let changed: Vec<&String> = slots.unsaved().0.map(|(d, _)| d).collect();
        assert_eq!(changed, ["a", "b"]);

        slots.mark_saved();
        slots.remove("a");
        assert_eq!(slots.unsaved().1, ["a".to_owned()]);
        slots.insert("a".into(), Slot::scheduled());
        assert!(slots.unsaved().1.is_empty(), "put back before the save");
    }

    #[test]
    fn read_back_collections_are_unmarked_and_equal_to_the_written_ones() {
        let slots: Slots = [("a".to_owned(), Slot::scheduled())].into_iter().collect();
        let json = serde_json::to_string(&slots).expect("json");
        let back: Slots = serde_json::from_str(&json).expect("back");
        assert_eq!(back, slots);
        assert_eq!(back.unsaved().0.count(), 0);

        let mut seen = Seen::default();
        assert!(seen.insert("a".into()));
        assert!(seen.is_unsaved());
        seen.mark_saved();
        assert!(!seen.insert("a".into()), "seen before");
        assert!(!seen.is_unsaved(), "nothing changed");
        let back: Seen =
            serde_json::from_str(&serde_json::to_string(&seen).expect("json")).expect("back");
        assert_eq!(back, seen);

        let devices = Devices::new(vec!["a".into()]);
        let back: Devices =
            serde_json::from_str(&serde_json::to_string(&devices).expect("json")).expect("back");
        assert_eq!(back, devices);
        assert!(devices.is_unsaved() && !back.is_unsaved());
    }
}
