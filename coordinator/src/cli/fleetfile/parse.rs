//! Reading a fleet file (or `flotilla devices --json`) in one streaming pass: every error names
//! the entry's index and field; other fields are read past.

use std::collections::HashMap;
use std::hash::{BuildHasher as _, BuildHasherDefault, Hasher};

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::cli::fleetfile::fleet::*;
use flotilla_rollout::planner::FleetDevice;

/// Parses a fleet file's text: the devices to plan over (those left out are dropped).
pub fn parse_fleet(text: &str) -> Result<Vec<FleetDevice>, FleetError> {
    Ok(parse_fleet_file(text.as_bytes())?.to_fleet_devices())
}

/// Parses a fleet file: a hand-written fleet, or `flotilla devices --json`. The entries are
/// read one at a time into the compact [`Fleet`]; no document tree is built.
pub fn parse_fleet_file(bytes: &[u8]) -> Result<Fleet, FleetError> {
    // A million random lookups in a map of ids cost more than a sort; the map runs only when
    // the sort finds a repeated id, or the file has an error (a repeated id before it is the
    // error to name), and then from the start, as an entry-by-entry check would.
    match read_fleet_file(bytes, false) {
        Ok(fleet) if !fleet.repeats_an_id() => Ok(fleet),
        _ => read_fleet_file(bytes, true),
    }
}

pub(super) fn read_fleet_file(bytes: &[u8], check_duplicates: bool) -> Result<Fleet, FleetError> {
    let mut state = ParseState {
        check_duplicates,
        ..ParseState::default()
    };
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let read = serde::de::DeserializeSeed::deserialize(FileSeed(&mut state), &mut de)
        .and_then(|()| de.end());
    match (read, state.error.take()) {
        (_, Some(error)) => Err(error),
        (Err(e), None) => Err(FleetError::Json(e)),
        (Ok(()), None) => Ok(state.fleet),
    }
}

// ---------------------------------------------------------------------------------------------
// Reading entries one by one

/// What one field of an entry held: only its kind, or the text of a string.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) enum Seen {
    #[default]
    Absent,
    Null,
    Bool,
    Str,
    Other(&'static str),
}

impl Seen {
    pub(super) fn kind(self) -> &'static str {
        match self {
            Seen::Absent | Seen::Null => "null",
            Seen::Bool => "a boolean",
            Seen::Str => "a string",
            Seen::Other(kind) => kind,
        }
    }

    pub(super) fn is_null(self) -> bool {
        matches!(self, Seen::Absent | Seen::Null)
    }
}

/// One scalar field of the entry being read: its kind, and its text when a string.
#[derive(Debug, Default)]
pub(super) struct Scalar {
    pub(super) seen: Seen,
    pub(super) text: String,
}

/// Where a text is in a buffer: start and end.
type Span = (usize, usize);

/// The entry being read, its buffers kept from one entry to the next.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    /// Not an object: its kind.
    pub(super) not_object: Option<&'static str>,
    /// The first unknown key in sorted order (as a JSON object's keys were checked before).
    pub(super) unknown: Option<String>,
    pub(super) id: Scalar,
    pub(super) hardware_id: Scalar,
    pub(super) enrollment: Scalar,
    pub(super) status: [Seen; 5],
    pub(super) labels: Seen,
    /// Label keys and string values, end to end, and where each label's key and value is
    /// (a value that is not a string: its kind).
    pub(super) label_text: String,
    pub(super) label_spans: Vec<(Span, Result<Span, &'static str>)>,
}

impl Scratch {
    pub(super) fn clear(&mut self) {
        self.not_object = None;
        self.unknown = None;
        for s in [&mut self.id, &mut self.hardware_id, &mut self.enrollment] {
            s.seen = Seen::Absent;
            s.text.clear();
        }
        self.status = [Seen::Absent; 5];
        self.labels = Seen::Absent;
        self.label_text.clear();
        self.label_spans.clear();
    }
}

#[derive(Default)]
pub(super) struct ParseState {
    pub(super) fleet: Fleet,
    pub(super) scratch: Scratch,
    /// Entries read so far.
    pub(super) index: usize,
    /// Id hash -> the entry index and where its id is (a device, or one left out). A second
    /// id with the same hash goes to `collisions`.
    pub(super) seen: HashMap<u64, (usize, Place), BuildHasherDefault<Hashed>>,
    pub(super) collisions: Vec<(u64, usize, Place)>,
    /// Whether `seen` is kept; without it, repeated ids are not noticed.
    pub(super) check_duplicates: bool,
    pub(super) hasher: std::hash::RandomState,
    pub(super) error: Option<FleetError>,
}

/// Hashes a key that is already a hash by taking it as it is.
#[derive(Default)]
pub(super) struct Hashed(u64);

impl Hasher for Hashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Place {
    Device(usize),
    LeftOut(usize),
}

impl ParseState {
    pub(super) fn id_at(&self, place: Place) -> &str {
        match place {
            Place::Device(i) => {
                let (a, b) = self.fleet.records[i].id;
                &self.fleet.ids[a..b]
            }
            Place::LeftOut(i) => &self.fleet.left_out[i].id,
        }
    }

    /// The entry index of an earlier device with this id.
    pub(super) fn first_with(&self, hash: u64, id: &str) -> Option<usize> {
        let (index, place) = *self.seen.get(&hash)?;
        if self.id_at(place) == id {
            return Some(index);
        }
        self.collisions
            .iter()
            .find(|(h, _, p)| *h == hash && self.id_at(*p) == id)
            .map(|(_, index, _)| *index)
    }

    pub(super) fn remember(&mut self, hash: u64, index: usize, place: Place) {
        if let std::collections::hash_map::Entry::Vacant(v) = self.seen.entry(hash) {
            v.insert((index, place));
        } else {
            self.collisions.push((hash, index, place));
        }
    }

    /// Checks the entry just read, in the order errors were always reported, and adds it.
    pub(super) fn accept(&mut self) -> Result<(), FleetError> {
        let index = self.index;
        self.index += 1;
        let bad = |field: &str, problem: String| FleetError::Entry {
            index,
            field: field.to_owned(),
            problem,
        };
        let e = &self.scratch;
        if let Some(kind) = e.not_object {
            return Err(bad("", format!("expected an object, found {kind}")));
        }
        if let Some(key) = &e.unknown {
            return Err(bad(
                "",
                format!(
                    "unknown field {key:?}; expected id, labels, hardware_id (and the other fields of `flotilla devices --json`)"
                ),
            ));
        }
        for (field, seen) in STATUS_FIELDS.iter().zip(e.status) {
            let online = *field == "online";
            let fine =
                seen.is_null() || (online && seen == Seen::Bool) || (!online && seen == Seen::Str);
            if !fine {
                let expected = if online { "a boolean" } else { "a string" };
                return Err(bad(
                    &format!(".{field}"),
                    format!("expected {expected}, found {}", seen.kind()),
                ));
            }
        }
        let enrollment = match e.enrollment.seen {
            Seen::Absent | Seen::Null => None,
            Seen::Str => Some(e.enrollment.text.as_str()),
            other => {
                return Err(bad(
                    ".enrollment",
                    format!("expected a string, found {}", other.kind()),
                ))
            }
        };
        let id = match e.id.seen {
            Seen::Str => e.id.text.as_str(),
            Seen::Absent => return Err(bad(".id", "missing".into())),
            other => {
                return Err(bad(
                    ".id",
                    format!("expected a string, found {}", other.kind()),
                ))
            }
        };
        flotilla_protocol::ids::validate_id("device id", id)
            .map_err(|e| bad(".id", e.to_string()))?;
        let hash = if self.check_duplicates {
            self.hasher.hash_one(id)
        } else {
            0
        };
        if let Some(first) = self.first_with(hash, id) {
            return Err(FleetError::Duplicate {
                index,
                id: id.to_owned(),
                first,
            });
        }
        if let Some(enrollment) = enrollment.filter(|e| !is_accepted(e) || without_state(e)) {
            let place = Place::LeftOut(self.fleet.left_out.len());
            self.fleet.left_out.push(LeftOut {
                id: id.to_owned(),
                enrollment: enrollment.to_owned(),
            });
            if self.check_duplicates {
                self.remember(hash, index, place);
            }
            return Ok(());
        }
        let labels_start = self.fleet.labels.len();
        let (fleet, e) = (&mut self.fleet, &mut self.scratch);
        match e.labels {
            Seen::Absent | Seen::Null => {}
            Seen::Other("an object") => {
                // As in a JSON object: sorted by key, the last of a repeated key counts.
                let text = &e.label_text;
                let key = |span: &(usize, usize)| &text[span.0..span.1];
                let spans = &mut e.label_spans;
                spans.reverse();
                spans.sort_by(|a, b| key(&a.0).cmp(key(&b.0)));
                spans.dedup_by(|later, first| key(&later.0) == key(&first.0));
                if let Some((k, Err(kind))) = spans.iter().find(|(_, v)| v.is_err()) {
                    return Err(bad(
                        &format!(".labels.{}", key(k)),
                        format!("expected a string, found {kind}"),
                    ));
                }
                for (k, v) in spans.iter() {
                    let v = v.unwrap_or_default();
                    let pair = (fleet.names.intern(key(k)), fleet.names.intern(key(&v)));
                    fleet.labels.push(pair);
                }
            }
            other => {
                return Err(bad(
                    ".labels",
                    format!("expected an object, found {}", other.kind()),
                ))
            }
        }
        let hardware = match e.hardware_id.seen {
            Seen::Absent | Seen::Null => ANY_HARDWARE,
            Seen::Str if !e.hardware_id.text.is_empty() => e.hardware_id.text.as_str(),
            Seen::Str => return Err(bad(".hardware_id", "must not be empty".into())),
            other => {
                return Err(bad(
                    ".hardware_id",
                    format!("expected a string, found {}", other.kind()),
                ))
            }
        };
        let hardware = fleet.names.intern(hardware);
        let id_start = fleet.ids.len();
        fleet.ids.push_str(&e.id.text);
        let place = Place::Device(fleet.records.len());
        fleet.records.push(Record {
            id: (id_start, fleet.ids.len()),
            hardware,
            labels: (labels_start, fleet.labels.len()),
        });
        if self.check_duplicates {
            self.remember(hash, index, place);
        }
        Ok(())
    }
}
/// What a JSON value becomes; every kind not handled is only named, and its content skipped.
trait Sink<'de>: Sized {
    fn other<E: de::Error>(self, kind: &'static str) -> Result<(), E>;
    fn null<E: de::Error>(self) -> Result<(), E> {
        self.other("null")
    }
    fn boolean<E: de::Error>(self) -> Result<(), E> {
        self.other("a boolean")
    }
    fn string<E: de::Error>(self, _text: &str) -> Result<(), E> {
        self.other("a string")
    }
    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        self.other("an object")
    }
    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        self.other("an array")
    }
}

/// Reads any JSON value into a [`Sink`].
pub(super) struct Any<S>(S);

impl<'de, S: Sink<'de>> DeserializeSeed<'de> for Any<S> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de, S: Sink<'de>> Visitor<'de> for Any<S> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.0.null()
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.0.null()
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.0.boolean()
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.0.other("a number")
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.0.other("a number")
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.0.other("a number")
    }
    fn visit_str<E: de::Error>(self, text: &str) -> Result<(), E> {
        self.0.string(text)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        self.0.map(map)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<(), A::Error> {
        self.0.seq(seq)
    }
}

/// The whole file: an array of entries.
pub(super) struct FileSeed<'s>(&'s mut ParseState);

impl<'de> DeserializeSeed<'de> for FileSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        Any(self).deserialize(deserializer)
    }
}

impl<'de> Sink<'de> for FileSeed<'_> {
    fn other<E: de::Error>(self, kind: &'static str) -> Result<(), E> {
        self.0.error = Some(FleetError::NotArray { found: kind });
        Err(E::custom("not an array"))
    }
    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        loop {
            self.0.scratch.clear();
            if seq.next_element_seed(Any(&mut self.0.scratch))?.is_none() {
                return Ok(());
            }
            if let Err(e) = self.0.accept() {
                self.0.error = Some(e);
                return Err(de::Error::custom("bad entry"));
            }
        }
    }
}

/// The keys an entry knows.
pub(super) enum Key {
    Id,
    Labels,
    HardwareId,
    Enrollment,
    Status(usize),
    Unknown,
}

/// One entry: an object, or only its kind.
impl<'de> Sink<'de> for &mut Scratch {
    fn other<E: de::Error>(self, kind: &'static str) -> Result<(), E> {
        self.not_object = Some(kind);
        Ok(())
    }
    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut unknown = None;
        while let Some(key) = map.next_key_seed(KeySeed(&mut unknown))? {
            match key {
                Key::Id => map.next_value_seed(Any(&mut self.id))?,
                Key::HardwareId => map.next_value_seed(Any(&mut self.hardware_id))?,
                Key::Enrollment => map.next_value_seed(Any(&mut self.enrollment))?,
                Key::Status(i) => map.next_value_seed(Any(&mut self.status[i]))?,
                Key::Labels => {
                    // A repeated `labels` counts once, as its last value.
                    self.label_text.clear();
                    self.label_spans.clear();
                    map.next_value_seed(Any(LabelsSink(self)))?
                }
                Key::Unknown => {
                    if let Some(key) = unknown.take() {
                        if self.unknown.as_ref().is_none_or(|first| key < *first) {
                            self.unknown = Some(key);
                        }
                    }
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

pub(super) struct KeySeed<'a>(&'a mut Option<String>);

impl<'de> DeserializeSeed<'de> for KeySeed<'_> {
    type Value = Key;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Key, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed<'_> {
    type Value = Key;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a field name")
    }
    fn visit_str<E: de::Error>(self, key: &str) -> Result<Key, E> {
        Ok(match key {
            "id" => Key::Id,
            "labels" => Key::Labels,
            "hardware_id" => Key::HardwareId,
            "enrollment" => Key::Enrollment,
            other => match STATUS_FIELDS.iter().position(|f| *f == other) {
                Some(i) => Key::Status(i),
                None => {
                    *self.0 = Some(other.to_owned());
                    Key::Unknown
                }
            },
        })
    }
}

impl<'de> Sink<'de> for &mut Scalar {
    fn other<E: de::Error>(self, kind: &'static str) -> Result<(), E> {
        self.seen = Seen::Other(kind);
        Ok(())
    }
    fn null<E: de::Error>(self) -> Result<(), E> {
        self.seen = Seen::Null;
        Ok(())
    }
    fn boolean<E: de::Error>(self) -> Result<(), E> {
        self.seen = Seen::Bool;
        Ok(())
    }
    fn string<E: de::Error>(self, text: &str) -> Result<(), E> {
        self.seen = Seen::Str;
        self.text.clear();
        self.text.push_str(text);
        Ok(())
    }
}

impl<'de> Sink<'de> for &mut Seen {
    fn other<E: de::Error>(self, kind: &'static str) -> Result<(), E> {
        *self = Seen::Other(kind);
        Ok(())
    }
    fn null<E: de::Error>(self) -> Result<(), E> {
        *self = Seen::Null;
        Ok(())
    }
    fn boolean<E: de::Error>(self) -> Result<(), E> {
        *self = Seen::Bool;
        Ok(())
    }
    fn string<E: de::Error>(self, _: &str) -> Result<(), E> {
        *self = Seen::Str;
        Ok(())
    }
}

/// An entry's `labels`: an object of strings, or only its kind.
pub(super) struct LabelsSink<'a>(&'a mut Scratch);

impl<'de> Sink<'de> for LabelsSink<'_> {
    fn other<E: de::Error>(self, kind: &'static str) -> Result<(), E> {
        self.0.labels = Seen::Other(kind);
        Ok(())
    }
    fn null<E: de::Error>(self) -> Result<(), E> {
        self.0.labels = Seen::Null;
        Ok(())
    }
    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let e = self.0;
        e.labels = Seen::Other("an object");
        loop {
            let key_start = e.label_text.len();
            if map.next_key_seed(Text(&mut e.label_text))?.is_none() {
                break;
            }
            let key = (key_start, e.label_text.len());
            let mut value = Seen::Absent;
            let start = e.label_text.len();
            map.next_value_seed(Any(LabelValue(&mut value, &mut e.label_text)))?;
            let value = match value {
                Seen::Str => Ok((start, e.label_text.len())),
                other => Err(other.kind()),
            };
            e.label_spans.push((key, value));
        }
        Ok(())
    }
}

/// A label key, appended to the entry's label text.
pub(super) struct Text<'a>(&'a mut String);

impl<'de> DeserializeSeed<'de> for Text<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Text<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a label key")
    }
    fn visit_str<E: de::Error>(self, text: &str) -> Result<(), E> {
        self.0.push_str(text);
        Ok(())
    }
}

/// A label value: its kind, and its text appended when a string.
pub(super) struct LabelValue<'a>(&'a mut Seen, &'a mut String);

impl<'de> Sink<'de> for LabelValue<'_> {
    fn other<E: de::Error>(self, kind: &'static str) -> Result<(), E> {
        *self.0 = Seen::Other(kind);
        Ok(())
    }
    fn string<E: de::Error>(self, text: &str) -> Result<(), E> {
        *self.0 = Seen::Str;
        self.1.push_str(text);
        Ok(())
    }
}
