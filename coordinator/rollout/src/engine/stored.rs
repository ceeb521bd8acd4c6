//! A rollout's stored form: a head and one record per device, so that saving a rollout writes
//! what changed since the last save, not the whole rollout
//! (docs/decisions/0034-per-device-rollout-records.md).
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
fn read_back(map: BTreeMap<String, Slot>) -> Slots<Slot> {
    let mut slots: Slots<Slot> = map.into_iter().collect();
    slots.mark_saved();
    slots
}
