//! A fleet as `plan` and `simulate` read it: its devices, their labels and hardware, and what
//! was left out of it and why.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::rc::Rc;

use flotilla_rollout::planner::{self, FleetDevice, PlanDevice, PlanError};
use flotilla_rollout::selector::Labels;
use flotilla_rollout::spec::SpecError;

/// The hardware id of a fleet entry that does not name one.
pub const ANY_HARDWARE: &str = "any";

/// How many device ids the plan table shows per group.
pub(super) const FIRST_DEVICES: usize = 5;

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
    pub(super) ids: String,
    pub(super) records: Vec<Record>,
    /// Every device's labels as (key, value) name numbers, each device's sorted by key.
    pub(super) labels: Vec<(u32, u32)>,
    pub(super) names: Names,
    /// The label key looked up last and its name number: selectors ask for the same few keys
    /// of every device.
    pub(super) last_key: RefCell<(String, Option<u32>)>,
    pub left_out: Vec<LeftOut>,
}

/// Where one device's id and labels are in its [`Fleet`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Record {
    pub(super) id: (usize, usize),
    pub(super) hardware: u32,
    pub(super) labels: (usize, usize),
}

/// Interned texts: label keys and values, hardware ids.
#[derive(Debug, Default)]
pub(super) struct Names {
    pub(super) texts: Vec<Rc<str>>,
    pub(super) numbers: HashMap<Rc<str>, u32>,
}

impl Names {
    pub(super) fn intern(&mut self, text: &str) -> u32 {
        if let Some(&n) = self.numbers.get(text) {
            return n;
        }
        let n = u32::try_from(self.texts.len()).expect("fewer than 2^32 distinct names");
        let text: Rc<str> = Rc::from(text);
        self.texts.push(Rc::clone(&text));
        self.numbers.insert(text, n);
        n
    }

    pub(super) fn get(&self, n: u32) -> &str {
        &self.texts[n as usize]
    }
}

/// One device of a [`Fleet`], as the planner and the simulator read it.
#[derive(Debug, Clone, Copy)]
pub struct Device<'a> {
    pub(super) fleet: &'a Fleet,
    pub(super) record: &'a Record,
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
pub(super) fn id_prefix(id: &[u8]) -> u128 {
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
    pub(super) fn repeats_an_id(&self) -> bool {
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
pub(super) const STATUS_FIELDS: [&str; 5] = ["online", "installed", "rollout", "phase", "reason"];

/// Whether an `enrollment` status text (`accepted`, `accepted, new key pending`, `pending`…)
/// means the coordinator plans the device.
pub(super) fn is_accepted(enrollment: &str) -> bool {
    enrollment == "accepted" || enrollment.starts_with("accepted,")
}

/// Whether an accepted device's `enrollment` text says the coordinator holds no state of it
/// (`accepted, no state since restart`): listed with no labels, it cannot be planned, and a
/// plan says so as the coordinator does.
pub(super) fn without_state(enrollment: &str) -> bool {
    is_accepted(enrollment) && enrollment.ends_with(planner::NO_STATE)
}
