//! Fleet files and `flotilla plan`: what a rollout spec would make of a fleet, without a
//! coordinator.
//!
//! A fleet file is a JSON array of devices as their retained state would describe them:
//!
//! ```json
//! [
//!   {"id": "dev-001", "labels": {"env": "canary", "site": "ber"}, "hardware_id": "pi4"},
//!   {"id": "dev-002", "labels": {"env": "prod"}}
//! ]
//! ```
//!
//! `hardware_id` defaults to `any`; `labels` defaults to none. Every error names the entry's
//! index and field, and a device id may appear only once. The same file feeds
//! `flotilla simulate` (the `simulate` module).
//!
//! The output of `flotilla devices --json` is a fleet file as it stands: its other fields
//! (`online`, `installed`, `rollout`, `phase`, `reason`) are read past, and a device whose
//! `enrollment` is not accepted is left out, as the coordinator plans accepted devices only.
//! An accepted device listed as `accepted, no state since restart` is excluded from the plan
//! with the coordinator's reason (or refuses it under `unknown_devices = "refuse"`), as a
//! rollout created on the coordinator would be.
//! A staged spec that names a stored strategy is planned with that strategy's stages from
//! `--strategy-file` (`flotilla strategy show NAME` prints them), so `plan` stays offline
//! (docs/decisions/0018-cli-settings-and-offline-plan.md).

use flotilla_rollout::zoneinfo::SystemZones;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::{BuildHasher as _, BuildHasherDefault, Hasher};
use std::path::{Path, PathBuf};
use std::rc::Rc;

use clap::Args;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use flotilla_rollout::plan::{
    ErrorAction, ErrorCondition, Gate, Pace, Plan, SuccessAction, SuccessCondition, Threshold,
};
use flotilla_rollout::planner::{self, DeviceGroup, FleetDevice, PlanDevice, PlanError};
use flotilla_rollout::selector::Labels;
use flotilla_rollout::spec::{RolloutSpec, SpecError, StagedStrategy};

/// The hardware id of a fleet entry that does not name one.
pub const ANY_HARDWARE: &str = "any";

/// How many device ids the plan table shows per group.
const FIRST_DEVICES: usize = 5;

/// Why a fleet file, a spec or a device-group file could not be used offline.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("cannot read {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("fleet file is not JSON: {0}")]
    Json(serde_json::Error),
    #[error("fleet file: expected a JSON array of devices, found {found}")]
    NotArray { found: &'static str },
    #[error("fleet[{index}]{field}: {problem}")]
    Entry {
        index: usize,
        /// `.id`, `.labels.env`…, empty for the entry itself.
        field: String,
        problem: String,
    },
    #[error("fleet[{index}].id: {id:?} is already used by fleet[{first}]")]
    Duplicate {
        index: usize,
        id: String,
        first: usize,
    },
    #[error("device groups file {path}: {source}")]
    Groups {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("spec {path}: {source}")]
    Spec {
        path: PathBuf,
        source: Box<SpecError>,
    },
    #[error("strategy file {path}: {source}")]
    Strategy {
        path: PathBuf,
        source: Box<SpecError>,
    },
    #[error("spec {path} names the stored strategy {name:?}; give its stages with --strategy-file FILE (`flotilla strategy show {name} > {name}.toml` writes them)")]
    NeedStrategy { path: PathBuf, name: String },
    #[error("--strategy-file {strategy}: spec {spec} does not name a stored strategy (`[staged]` with `strategy = \"NAME\"`); leave --strategy-file out")]
    UnusedStrategy { strategy: PathBuf, spec: PathBuf },
    #[error(transparent)]
    Plan(#[from] PlanError),
}

/// A device of the fleet file that the coordinator would not plan: its enrollment is not
/// accepted (pending, rejected, revoked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeftOut {
    pub id: String,
    pub enrollment: String,
}

/// A fleet file: the devices a rollout can be planned over, and those left out.
///
/// A device takes under 100 bytes with a few labels: the ids sit end to end in one string, and
/// label keys, label values and hardware ids are interned, as fleets repeat them.
#[derive(Debug, Default)]
pub struct Fleet {
    /// Every planned device's id, end to end.
    ids: String,
    records: Vec<Record>,
    /// Every device's labels as (key, value) name numbers, each device's sorted by key.
    labels: Vec<(u32, u32)>,
    names: Names,
    /// The label key looked up last and its name number: selectors ask for the same few keys
    /// of every device.
    last_key: RefCell<(String, Option<u32>)>,
    pub left_out: Vec<LeftOut>,
}

/// Where one device's id and labels are in its [`Fleet`].
#[derive(Debug, Clone, Copy)]
struct Record {
    id: (usize, usize),
    hardware: u32,
    labels: (usize, usize),
}

/// Interned texts: label keys and values, hardware ids.
#[derive(Debug, Default)]
struct Names {
    texts: Vec<Rc<str>>,
    numbers: HashMap<Rc<str>, u32>,
}

impl Names {
    fn intern(&mut self, text: &str) -> u32 {
        if let Some(&n) = self.numbers.get(text) {
            return n;
        }
        let n = u32::try_from(self.texts.len()).expect("fewer than 2^32 distinct names");
        let text: Rc<str> = Rc::from(text);
        self.texts.push(Rc::clone(&text));
        self.numbers.insert(text, n);
        n
    }

    fn get(&self, n: u32) -> &str {
        &self.texts[n as usize]
    }
}

/// One device of a [`Fleet`], as the planner and the simulator read it.
#[derive(Debug, Clone, Copy)]
pub struct Device<'a> {
    fleet: &'a Fleet,
    record: &'a Record,
}

impl<'a> Device<'a> {
    pub fn id(&self) -> &'a str {
        &self.fleet.ids[self.record.id.0..self.record.id.1]
    }

    pub fn hardware_id(&self) -> &'a str {
        self.fleet.names.get(self.record.hardware)
    }

    /// The device's labels, sorted by key.
    pub fn labels(&self) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        let names = &self.fleet.names;
        self.fleet.labels[self.record.labels.0..self.record.labels.1]
            .iter()
            .map(move |&(k, v)| (names.get(k), names.get(v)))
    }

    /// The device as [`planner::plan`] takes it from the coordinator's registry.
    pub fn to_fleet_device(&self) -> FleetDevice {
        FleetDevice {
            id: self.id().to_owned(),
            labels: self
                .labels()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            hardware_id: self.hardware_id().to_owned(),
        }
    }
}

impl Labels for Device<'_> {
    fn label(&self, key: &str) -> Option<&str> {
        let number = {
            let mut last = self.fleet.last_key.borrow_mut();
            if last.0 != key {
                last.0.clear();
                last.0.push_str(key);
                last.1 = self.fleet.names.numbers.get(key).copied();
            }
            last.1?
        };
        let (start, end) = self.record.labels;
        self.fleet.labels[start..end]
            .iter()
            .find(|(k, _)| *k == number)
            .map(|&(_, v)| self.fleet.names.get(v))
    }
}

impl PlanDevice for Device<'_> {
    type Labels = Self;
    fn id(&self) -> &str {
        Device::id(self)
    }
    fn hardware_id(&self) -> &str {
        Device::hardware_id(self)
    }
    fn labels(&self) -> &Self {
        self
    }
}

/// An id's first 16 bytes as one number, so that most comparisons of ids are of numbers. Ids
/// hold no NUL bytes, so padding with zeros keeps their order.
fn id_prefix(id: &[u8]) -> u128 {
    let mut b = [0u8; 16];
    let n = id.len().min(16);
    b[..n].copy_from_slice(&id[..n]);
    u128::from_be_bytes(b)
}

impl Fleet {
    /// How many devices can be planned over (those left out not counted).
    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The devices to plan over, in file order.
    pub fn devices(&self) -> Vec<Device<'_>> {
        self.records
            .iter()
            .map(|record| Device {
                fleet: self,
                record,
            })
            .collect()
    }

    /// Whether two devices, planned or left out, have the same id.
    fn repeats_an_id(&self) -> bool {
        let ids = self
            .records
            .iter()
            .map(|r| &self.ids[r.id.0..r.id.1])
            .chain(self.left_out.iter().map(|l| l.id.as_str()));
        let mut keyed: Vec<(u128, &str)> = ids.map(|id| (id_prefix(id.as_bytes()), id)).collect();
        keyed.sort_unstable();
        keyed.windows(2).any(|w| w[0].1 == w[1].1)
    }

    /// Puts the devices in id order, their ids and labels too, as the planner takes them: it
    /// then reads memory in order instead of jumping around a shuffled file.
    pub fn sort_by_id(&mut self) {
        let bytes = self.ids.as_bytes();
        let id = |r: &Record| &bytes[r.id.0..r.id.1];
        let prefix = |r: &Record| id_prefix(id(r));
        let mut keyed: Vec<(u128, usize)> = self
            .records
            .iter()
            .enumerate()
            .map(|(i, r)| (prefix(r), i))
            .collect();
        keyed.sort_unstable_by(|a, b| {
            a.0.cmp(&b.0)
                .then_with(|| id(&self.records[a.1]).cmp(id(&self.records[b.1])))
        });
        let mut ids = String::with_capacity(self.ids.len());
        let mut labels = Vec::with_capacity(self.labels.len());
        let mut records = Vec::with_capacity(self.records.len());
        for (_, i) in keyed {
            let r = self.records[i];
            let id_start = ids.len();
            ids.push_str(&self.ids[r.id.0..r.id.1]);
            let labels_start = labels.len();
            labels.extend_from_slice(&self.labels[r.labels.0..r.labels.1]);
            records.push(Record {
                id: (id_start, ids.len()),
                hardware: r.hardware,
                labels: (labels_start, labels.len()),
            });
        }
        (self.ids, self.labels, self.records) = (ids, labels, records);
    }

    /// The devices to plan over as owned [`FleetDevice`]s.
    pub fn to_fleet_devices(&self) -> Vec<FleetDevice> {
        self.devices().iter().map(Device::to_fleet_device).collect()
    }
}

/// The fields of `flotilla devices --json` (`DeviceSummary`) that planning does not use.
const STATUS_FIELDS: [&str; 5] = ["online", "installed", "rollout", "phase", "reason"];

/// Whether an `enrollment` status text (`accepted`, `accepted, new key pending`, `pending`…)
/// means the coordinator plans the device.
fn is_accepted(enrollment: &str) -> bool {
    enrollment == "accepted" || enrollment.starts_with("accepted,")
}

/// Whether an accepted device's `enrollment` text says the coordinator holds no state of it
/// (`accepted, no state since restart`): listed with no labels, it cannot be planned, and a
/// plan says so as the coordinator does.
fn without_state(enrollment: &str) -> bool {
    is_accepted(enrollment) && enrollment.ends_with(planner::NO_STATE)
}

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

fn read_fleet_file(bytes: &[u8], check_duplicates: bool) -> Result<Fleet, FleetError> {
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
enum Seen {
    #[default]
    Absent,
    Null,
    Bool,
    Str,
    Other(&'static str),
}

impl Seen {
    fn kind(self) -> &'static str {
        match self {
            Seen::Absent | Seen::Null => "null",
            Seen::Bool => "a boolean",
            Seen::Str => "a string",
            Seen::Other(kind) => kind,
        }
    }

    fn is_null(self) -> bool {
        matches!(self, Seen::Absent | Seen::Null)
    }
}

/// One scalar field of the entry being read: its kind, and its text when a string.
#[derive(Debug, Default)]
struct Scalar {
    seen: Seen,
    text: String,
}

/// Where a text is in a buffer: start and end.
type Span = (usize, usize);

/// The entry being read, its buffers kept from one entry to the next.
#[derive(Debug, Default)]
struct Scratch {
    /// Not an object: its kind.
    not_object: Option<&'static str>,
    /// The first unknown key in sorted order (as a JSON object's keys were checked before).
    unknown: Option<String>,
    id: Scalar,
    hardware_id: Scalar,
    enrollment: Scalar,
    status: [Seen; 5],
    labels: Seen,
    /// Label keys and string values, end to end, and where each label's key and value is
    /// (a value that is not a string: its kind).
    label_text: String,
    label_spans: Vec<(Span, Result<Span, &'static str>)>,
}

impl Scratch {
    fn clear(&mut self) {
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
struct ParseState {
    fleet: Fleet,
    scratch: Scratch,
    /// Entries read so far.
    index: usize,
    /// Id hash -> the entry index and where its id is (a device, or one left out). A second
    /// id with the same hash goes to `collisions`.
    seen: HashMap<u64, (usize, Place), BuildHasherDefault<Hashed>>,
    collisions: Vec<(u64, usize, Place)>,
    /// Whether `seen` is kept; without it, repeated ids are not noticed.
    check_duplicates: bool,
    hasher: std::hash::RandomState,
    error: Option<FleetError>,
}

/// Hashes a key that is already a hash by taking it as it is.
#[derive(Default)]
struct Hashed(u64);

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
enum Place {
    Device(usize),
    LeftOut(usize),
}

impl ParseState {
    fn id_at(&self, place: Place) -> &str {
        match place {
            Place::Device(i) => {
                let (a, b) = self.fleet.records[i].id;
                &self.fleet.ids[a..b]
            }
            Place::LeftOut(i) => &self.fleet.left_out[i].id,
        }
    }

    /// The entry index of an earlier device with this id.
    fn first_with(&self, hash: u64, id: &str) -> Option<usize> {
        let (index, place) = *self.seen.get(&hash)?;
        if self.id_at(place) == id {
            return Some(index);
        }
        self.collisions
            .iter()
            .find(|(h, _, p)| *h == hash && self.id_at(*p) == id)
            .map(|(_, index, _)| *index)
    }

    fn remember(&mut self, hash: u64, index: usize, place: Place) {
        if let std::collections::hash_map::Entry::Vacant(v) = self.seen.entry(hash) {
            v.insert((index, place));
        } else {
            self.collisions.push((hash, index, place));
        }
    }

    /// Checks the entry just read, in the order errors were always reported, and adds it.
    fn accept(&mut self) -> Result<(), FleetError> {
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
struct Any<S>(S);

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
struct FileSeed<'s>(&'s mut ParseState);

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
enum Key {
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

struct KeySeed<'a>(&'a mut Option<String>);

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
struct LabelsSink<'a>(&'a mut Scratch);

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
struct Text<'a>(&'a mut String);

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
struct LabelValue<'a>(&'a mut Seen, &'a mut String);

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

fn read(what: &'static str, path: &Path) -> Result<String, FleetError> {
    std::fs::read_to_string(path).map_err(|source| FleetError::Read {
        what,
        path: path.to_owned(),
        source,
    })
}

/// Reads and parses a fleet file, keeping the devices it leaves out.
pub fn load_fleet_file(path: &Path) -> Result<Fleet, FleetError> {
    let bytes = std::fs::read(path).map_err(|source| FleetError::Read {
        what: "fleet file",
        path: path.to_owned(),
        source,
    })?;
    parse_fleet_file(&bytes)
}

/// Reads and validates a rollout spec file.
pub fn load_spec(path: &Path) -> Result<RolloutSpec, FleetError> {
    RolloutSpec::from_toml(&read("spec", path)?, &SystemZones).map_err(|e| FleetError::Spec {
        source: Box::new(e),
        path: path.to_owned(),
    })
}

/// Reads a device-groups file: a JSON array of `{"name", "select", "labels"}` as
/// `flotilla group` stores them.
pub fn load_device_groups(path: &Path) -> Result<Vec<DeviceGroup>, FleetError> {
    serde_json::from_str(&read("device groups file", path)?).map_err(|source| FleetError::Groups {
        path: path.to_owned(),
        source,
    })
}

/// `flotilla plan`.
#[derive(Debug, Args)]
#[command(after_long_help = "\
Plan against the real fleet, still offline:
  flotilla devices --json > fleet.json
  flotilla group list --json > groups.json          # when partitions name device groups
  flotilla strategy show NAME > NAME.toml           # when a [staged] spec names a strategy
  flotilla plan --spec SPEC --fleet fleet.json --groups groups.json --strategy-file NAME.toml")]
pub struct PlanArgs {
    /// The rollout spec (TOML).
    #[arg(long)]
    pub spec: PathBuf,
    /// The fleet: a JSON array of {"id", "labels", "hardware_id"}, or the output of
    /// `flotilla devices --json` (devices not accepted are left out).
    #[arg(long)]
    pub fleet: PathBuf,
    /// Named device groups that partitions refer to (JSON array, as `flotilla group list
    /// --json` prints them).
    #[arg(long)]
    pub groups: Option<PathBuf>,
    /// The stages of the stored strategy a `[staged]` spec names (`strategy = "NAME"`), as
    /// `flotilla strategy show NAME` prints them.
    #[arg(long, value_name = "FILE")]
    pub strategy_file: Option<PathBuf>,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Reads a stored strategy's stages (`flotilla strategy show NAME`) into a staged spec that
/// names the strategy, as the coordinator does when the rollout is created.
fn resolve_strategy(
    spec: &mut RolloutSpec,
    spec_path: &Path,
    strategy_file: Option<&Path>,
) -> Result<(), FleetError> {
    match (
        spec.staged_strategy_name().map(str::to_owned),
        strategy_file,
    ) {
        (None, None) => Ok(()),
        (None, Some(path)) => Err(FleetError::UnusedStrategy {
            strategy: path.to_owned(),
            spec: spec_path.to_owned(),
        }),
        (Some(name), None) => Err(FleetError::NeedStrategy {
            path: spec_path.to_owned(),
            name,
        }),
        (Some(name), Some(path)) => {
            let text = read("strategy file", path)?;
            let strategy =
                StagedStrategy::from_toml(&name, &text).map_err(|e| FleetError::Strategy {
                    path: path.to_owned(),
                    source: Box::new(e),
                })?;
            spec.resolve_strategy(&strategy);
            Ok(())
        }
    }
}

/// Plans a spec over a fleet file; also the devices the file leaves out. The release's
/// hardware list is not known offline, so no device is excluded by hardware.
pub fn plan_files(args: &PlanArgs) -> Result<(Plan, Vec<LeftOut>), FleetError> {
    let mut spec = load_spec(&args.spec)?;
    resolve_strategy(&mut spec, &args.spec, args.strategy_file.as_deref())?;
    let mut fleet = load_fleet_file(&args.fleet)?;
    let groups = match &args.groups {
        Some(path) => load_device_groups(path)?,
        None => Vec::new(),
    };
    fleet.sort_by_id();
    let mut plan = planner::plan(&spec, &fleet.devices(), &[], &groups)?;
    let (unknown, left_out): (Vec<LeftOut>, Vec<LeftOut>) = fleet
        .left_out
        .into_iter()
        .partition(|d| without_state(&d.enrollment));
    let mut unknown: Vec<String> = unknown.into_iter().map(|d| d.id).collect();
    unknown.sort();
    planner::exclude_unknown(&spec, &mut plan, &unknown)?;
    Ok((plan, left_out))
}

/// Runs `flotilla plan`: prints the plan and returns the exit code (1 on error, with the error
/// on stderr). Devices the fleet file leaves out are named on stderr.
pub fn run_plan(args: &PlanArgs) -> i32 {
    let planned = plan_files(args).map(|(plan, left_out)| {
        for d in &left_out {
            eprintln!(
                "left out {}: enrollment {} (the coordinator plans accepted devices only)",
                d.id, d.enrollment
            );
        }
        plan
    });
    match planned {
        Ok(plan) if args.json => match serde_json::to_string_pretty(&plan) {
            Ok(json) => {
                crate::cli::out::outln!("{json}");
                0
            }
            Err(e) => {
                eprintln!("error: cannot encode the plan: {e}");
                1
            }
        },
        Ok(plan) => {
            crate::cli::out::out!("{}", plan_table(&plan));
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// The plan as a table: group, size, pace, conditions, gates and the first devices.
pub fn plan_table(plan: &Plan) -> String {
    let header = [
        "GROUP",
        "SIZE",
        "PACE",
        "SUCCESS",
        "ERROR",
        "GATES",
        "FIRST DEVICES",
    ];
    let rows: Vec<[String; 7]> = plan
        .groups
        .iter()
        .map(|g| {
            let mut first = g
                .devices
                .iter()
                .take(FIRST_DEVICES)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ");
            if g.devices.len() > FIRST_DEVICES {
                let _ = write!(first, ", … (+{})", g.devices.len() - FIRST_DEVICES);
            }
            [
                g.name.clone(),
                g.devices.len().to_string(),
                pace_text(&g.pace),
                success_text(&g.success),
                g.error.as_ref().map_or_else(|| "-".to_owned(), error_text),
                gates_text(&g.before, &g.after),
                if first.is_empty() { "-".into() } else { first },
            ]
        })
        .collect();
    let mut widths = header.map(str::chars).map(Iterator::count);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i == 1 {
                let _ = write!(text, "{cell:>w$}  ");
            } else if i + 1 == cells.len() {
                text.push_str(cell);
            } else {
                let _ = write!(text, "{cell:w$}  ");
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(header.to_vec());
    for row in &rows {
        line(row.iter().map(String::as_str).collect());
    }
    let _ = writeln!(
        out,
        "{} in {}",
        flotilla_rollout::text::count(plan.device_count(), "device"),
        flotilla_rollout::text::count(plan.groups.len(), "group")
    );
    if !plan.unassigned.is_empty() {
        let _ = writeln!(
            out,
            "{} selected but in no group, not rolled out: {}",
            plan.unassigned.len(),
            plan.unassigned.join(", ")
        );
    }
    for e in &plan.excluded {
        let _ = writeln!(out, "excluded {}: {}", e.device, e.reason);
    }
    if let Some(sites) = &plan.sites {
        for (site, devices) in sites.sites.iter().take(PLAN_SITES) {
            let _ = writeln!(out, "{}", sites.line(site, *devices));
        }
        if sites.sites.len() > PLAN_SITES {
            let _ = writeln!(
                out,
                "… {} more sites (--json lists them all)",
                sites.sites.len() - PLAN_SITES
            );
        }
        if sites.without_site > 0 {
            let _ = writeln!(
                out,
                "{} without label {}: in no site, no site limit applies",
                flotilla_rollout::text::count(sites.without_site, "device"),
                sites.policy.label
            );
        }
    }
    out
}

/// Most site lines the plan table prints.
const PLAN_SITES: usize = 50;

fn pace_text(pace: &Pace) -> String {
    let mut parts = Vec::new();
    if let Some(b) = pace.batch {
        parts.push(format!("batches of {b}"));
    }
    if let Some(g) = pace.gate {
        parts.push(format!("next batch at <= {g} not ready"));
    }
    if let Some(c) = pace.concurrency {
        parts.push(format!("<= {c} at a time"));
    }
    if parts.is_empty() {
        "all at once".into()
    } else {
        parts.join(", ")
    }
}

fn success_text(s: &SuccessCondition) -> String {
    let threshold = match s.threshold {
        Threshold::Share(p) => format!(">= {p} ready"),
        Threshold::AllBut(b) => format!("all but {b} ready"),
    };
    let action = match s.action {
        SuccessAction::Next => "next",
        SuccessAction::Pause => "pause",
    };
    format!("{threshold} -> {action}")
}

fn error_text(e: &ErrorCondition) -> String {
    let mut parts = Vec::new();
    if let Some(p) = e.percent {
        parts.push(format!("> {p}"));
    }
    if let Some(c) = e.count {
        parts.push(format!(">= {c}"));
    }
    let mut text = format!("{} failed", parts.join(" or "));
    if e.min_sample > 0 {
        let _ = write!(text, " (after {})", e.min_sample);
    }
    let action = match e.action {
        ErrorAction::Pause => "pause",
        ErrorAction::Stop => "stop",
        ErrorAction::Rollback => "rollback",
    };
    format!("{text} -> {action}")
}

fn gates_text(before: &Gate, after: &Gate) -> String {
    let mut parts = Vec::new();
    for (when, gate) in [("before", before), ("after", after)] {
        if gate.approval {
            parts.push(format!("approval {when}"));
        }
        if gate.wait > 0 {
            parts.push(format!("wait {}s {when}", gate.wait));
        }
    }
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices_with_defaults() {
        let fleet = parse_fleet(
            r#"[{"id": "dev-1", "labels": {"env": "canary"}, "hardware_id": "pi4"},
                {"id": "dev-2"}]"#,
        )
        .expect("valid");
        assert_eq!(fleet.len(), 2);
        assert_eq!(fleet[0].labels["env"], "canary");
        assert_eq!(fleet[0].hardware_id, "pi4");
        assert_eq!(fleet[1].hardware_id, "any");
        assert!(fleet[1].labels.is_empty());
    }

    #[test]
    fn reads_devices_json_and_leaves_out_devices_not_accepted() {
        let fleet = parse_fleet_file(
            br#"[{"id": "a", "hardware_id": "pi4", "labels": {"env": "prod"}, "online": true,
                 "installed": "fw-1", "rollout": null, "phase": "ready", "reason": null,
                 "enrollment": "accepted"},
                {"id": "b", "hardware_id": "pi4", "labels": {}, "online": false,
                 "installed": null, "enrollment": "accepted, new key pending"},
                {"id": "c", "hardware_id": "", "labels": {}, "online": false,
                 "enrollment": "pending"}]"#,
        )
        .expect("devices --json is a fleet file");
        let ids: Vec<&str> = fleet.devices().iter().map(|d| d.id()).collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(
            fleet.left_out,
            [LeftOut {
                id: "c".into(),
                enrollment: "pending".into()
            }]
        );
        let err = parse_fleet(r#"[{"id": "a", "online": "yes"}]"#).expect_err("bad type");
        assert_eq!(
            err.to_string(),
            "fleet[0].online: expected a boolean, found a string"
        );
    }

    #[test]
    fn a_plan_names_accepted_devices_without_a_state_as_the_coordinator_does() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let fleet = dir.path().join("fleet.json");
        std::fs::write(
            &fleet,
            r#"[{"id": "a", "hardware_id": "pi4", "labels": {"env": "prod"},
                 "enrollment": "accepted"},
                {"id": "b", "hardware_id": "", "labels": {}, "online": false,
                 "enrollment": "accepted, no state since restart"},
                {"id": "c", "hardware_id": "", "labels": {}, "enrollment": "pending"}]"#,
        )
        .expect("write fleet");
        let plan_with = |extra: &str| {
            let spec = dir.path().join("spec.toml");
            let text = format!(
                "name = \"r\"\nrelease = \"fw-2\"\nselect = \"env=prod\"\n{extra}[groups]\ncount = 1\n"
            );
            std::fs::write(&spec, text).expect("write spec");
            plan_files(&PlanArgs {
                spec,
                fleet: fleet.clone(),
                groups: None,
                strategy_file: None,
                json: false,
            })
        };
        let (plan, left_out) = plan_with("").expect("plans");
        assert_eq!(plan.groups[0].devices, ["a"]);
        assert_eq!(plan.excluded.len(), 1);
        assert_eq!(plan.excluded[0].device, "b");
        assert_eq!(plan.excluded[0].reason, planner::unknown_reason(false));
        assert!(plan_table(&plan).contains("excluded b: accepted, no state since restart: "));
        assert_eq!(
            left_out.iter().map(|l| l.id.as_str()).collect::<Vec<_>>(),
            ["c"]
        );
        let err = plan_with("unknown_devices = \"refuse\"\n").expect_err("refused");
        assert!(
            err.to_string().starts_with(
                "unknown_devices = \"refuse\": 1 accepted devices have sent no state since the coordinator started, so whether the rollout selects them is unknown (b)"
            ),
            "{err}"
        );
    }

    #[test]
    fn errors_name_the_index_and_field() {
        let err = |text: &str| parse_fleet(text).expect_err("invalid").to_string();
        assert_eq!(
            err(r#"[{"id": "a"}, {"id": "a"}]"#),
            "fleet[1].id: \"a\" is already used by fleet[0]"
        );
        assert_eq!(err(r#"[{"id": "a"}, {}]"#), "fleet[1].id: missing");
        assert_eq!(
            err(r#"[{"id": "b"}, {"id": "a", "enrollment": "pending"}, {"id": "a"}, {"id": 7}]"#),
            "fleet[2].id: \"a\" is already used by fleet[1]",
            "the first error in file order, a repeated id of a device left out too"
        );
        assert_eq!(
            err(r#"[{"id": "a", "labels": {"env": "x", "env": 1}}]"#),
            "fleet[0].labels.env: expected a string, found a number",
            "the last of a repeated key counts, as in a JSON object"
        );
        assert_eq!(
            err(r#"[{"id": 7}]"#),
            "fleet[0].id: expected a string, found a number"
        );
        assert!(
            err(r#"[{"id": "a/b"}]"#).starts_with("fleet[0].id: device id \"a/b\" contains '/'")
        );
        assert_eq!(
            err(r#"[{"id": "a", "labels": {"env": 1}}]"#),
            "fleet[0].labels.env: expected a string, found a number"
        );
        assert!(err(r#"[{"id": "a", "hw": "pi4"}]"#).contains("fleet[0]: unknown field \"hw\""));
        assert_eq!(
            err(r#"{"id": "a"}"#),
            "fleet file: expected a JSON array of devices, found an object"
        );
        assert!(err("[").starts_with("fleet file is not JSON"));
    }

    #[test]
    fn the_compact_fleet_in_id_order_plans_as_the_fleet_devices_do() {
        let text = r#"[{"id": "d", "labels": {"env": "prod", "site": "ber"}},
            {"id": "b", "labels": {"env": "canary"}, "hardware_id": "pi4"},
            {"id": "c", "labels": {"site": "ber", "env": "prod"}},
            {"id": "a", "labels": {"env": "prod"}}, {"id": "e"}]"#;
        let spec = RolloutSpec::from_toml(
            "name = \"r\"\nrelease = \"fw\"\nselect = \"env\"\n[groups]\n\
             [[groups.group]]\nname = \"canary\"\nselect = \"env=canary\"\n\
             [[groups.group]]\nname = \"ber\"\nselect = \"site in (ber)\"\npercent = 50\n\
             [[groups.group]]\nname = \"rest\"\nselect = \"env!=canary\"\n",
            &SystemZones,
        )
        .expect("valid spec");
        let owned = parse_fleet(text).expect("valid");
        let mut fleet = parse_fleet_file(text.as_bytes()).expect("valid");
        fleet.sort_by_id();
        let ids: Vec<&str> = fleet.devices().iter().map(|d| d.id()).collect();
        assert_eq!(ids, ["a", "b", "c", "d", "e"]);
        assert_eq!(
            planner::plan(&spec, &fleet.devices(), &[], &[]).expect("plans"),
            planner::plan(&spec, &owned, &[], &[]).expect("plans")
        );
    }

    #[test]
    fn the_table_shows_groups_sizes_and_conditions() {
        let fleet = parse_fleet(
            r#"[{"id": "c1", "labels": {"env": "canary"}}, {"id": "p1"}, {"id": "p2"}]"#,
        )
        .expect("valid");
        let spec = RolloutSpec::from_toml(
            "name = \"r\"\nrelease = \"fw\"\n[groups]\nerror = { threshold = \"20%\" }\n\
             [[groups.group]]\nname = \"canary\"\nselect = \"env=canary\"\n[[groups.group]]\nname = \"rest\"\n", &SystemZones
        )
        .expect("valid spec");
        let plan = planner::plan(&spec, &fleet, &[], &[]).expect("plans");
        let table = plan_table(&plan);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("GROUP"), "{table}");
        assert!(lines[1].starts_with("canary"), "{table}");
        assert!(lines[1].contains(">= 100% ready -> next"), "{table}");
        assert!(lines[1].contains("> 20% failed -> pause"), "{table}");
        assert!(lines[2].ends_with("p1, p2"), "{table}");
        assert!(table.contains("3 devices in 2 groups"), "{table}");
    }
}
