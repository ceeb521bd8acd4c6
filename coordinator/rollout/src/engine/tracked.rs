//! The per-device collections of a rollout, each noting what changed since the store last wrote
//! it, so a save writes what changed instead of the whole rollout (`stored.rs`,
//! docs/decisions/0034-per-device-rollout-records.md).
//!
//! Reads go through `Deref` to the plain collection; every change goes through a method here
//! that marks it, so no change can miss the store: the inner collections are private to this
//! module. [`Slots::get_mut`] marks the slot whether or not the caller changes it; an extra
//! write is harmless, a missed one would lose progress at a restart.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Deref;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

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

/// What [`Slots`] holds: something that keeps its own mark (the engine's `Slot`).
pub trait Marked {
    fn mark(&mut self, unsaved: bool);
    fn is_marked(&self) -> bool;
}

/// A group's slots by device id.
#[derive(Debug, Clone)]
pub struct Slots<S> {
    map: BTreeMap<String, S>,
    /// Some slot is marked.
    unsaved: bool,
    /// Devices whose slots were removed since the last save.
    removed: Vec<String>,
}

impl<S: Marked> Slots<S> {
    /// The slot of `device`, marked as changed.
    pub fn get_mut(&mut self, device: &str) -> Option<&mut S> {
        let slot = self.map.get_mut(device)?;
        slot.mark(true);
        self.unsaved = true;
        Some(slot)
    }

    /// Every slot, each marked as changed.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&String, &mut S)> {
        self.unsaved = true;
        self.map.iter_mut().map(|(device, slot)| {
            slot.mark(true);
            (device, slot)
        })
    }

    pub fn insert(&mut self, device: String, mut slot: S) -> Option<S> {
        slot.mark(true);
        self.unsaved = true;
        self.removed.retain(|d| *d != device);
        self.map.insert(device, slot)
    }

    pub fn remove(&mut self, device: &str) -> Option<S> {
        let slot = self.map.remove(device)?;
        self.removed.push(device.to_owned());
        Some(slot)
    }

    /// The slots changed since the last save, and the devices whose slots were removed.
    pub(crate) fn unsaved(&self) -> (impl Iterator<Item = (&String, &S)> + '_, &[String]) {
        let any = self.unsaved;
        let changed = self
            .map
            .iter()
            .filter(move |(_, slot)| any && slot.is_marked());
        (changed, &self.removed)
    }

    pub(crate) fn mark_saved(&mut self) {
        if self.unsaved {
            for slot in self.map.values_mut() {
                slot.mark(false);
            }
        }
        self.unsaved = false;
        self.removed.clear();
    }
}

impl<S> Default for Slots<S> {
    fn default() -> Self {
        Slots {
            map: BTreeMap::new(),
            unsaved: false,
            removed: Vec::new(),
        }
    }
}

impl<S> Deref for Slots<S> {
    type Target = BTreeMap<String, S>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl<S: Marked> FromIterator<(String, S)> for Slots<S> {
    /// New slots, all marked: nothing of them is stored yet.
    fn from_iter<I: IntoIterator<Item = (String, S)>>(iter: I) -> Self {
        let mut slots = Slots::default();
        for (device, slot) in iter {
            slots.insert(device, slot);
        }
        slots
    }
}

impl<S: PartialEq> PartialEq for Slots<S> {
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

impl<'a, S> IntoIterator for &'a Slots<S> {
    type Item = (&'a String, &'a S);
    type IntoIter = std::collections::btree_map::Iter<'a, String, S>;
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

impl<S: Serialize> Serialize for Slots<S> {
    fn serialize<Z: Serializer>(&self, s: Z) -> Result<Z::Ok, Z::Error> {
        self.map.serialize(s)
    }
}

impl<'de, S: Deserialize<'de>> Deserialize<'de> for Slots<S> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Slots {
            map: BTreeMap::deserialize(d)?,
            ..Default::default()
        })
    }
}
plain_serde!(Devices, list, Vec<String>);
plain_serde!(Seen, set, BTreeSet<String>);

#[cfg(test)]
mod tests {
    use super::*;

    /// A slot standing in for the engine's.
    #[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
    struct Slot {
        attempt: u32,
        #[serde(skip)]
        unsaved: Unsaved,
    }

    impl Slot {
        fn scheduled() -> Slot {
            Slot::default()
        }
    }

    impl Marked for Slot {
        fn mark(&mut self, unsaved: bool) {
            self.unsaved = Unsaved(unsaved);
        }
        fn is_marked(&self) -> bool {
            self.unsaved.0
        }
    }

    #[test]
    fn every_change_is_marked_and_a_save_clears_the_marks() {
        let mut slots: Slots<Slot> = [("a".to_owned(), Slot::scheduled())].into_iter().collect();
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
        let slots: Slots<Slot> = [("a".to_owned(), Slot::scheduled())].into_iter().collect();
        let json = serde_json::to_string(&slots).expect("json");
        let back: Slots<Slot> = serde_json::from_str(&json).expect("back");
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
