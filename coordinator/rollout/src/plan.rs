//! The compiled plan: what every rollout vocabulary turns into, and the only thing the engine
//! reads to drive a rollout.
//!
//! hawkBit deployment groups, Rancher Fleet partitions, KubeFleet rolling updates and KubeFleet
//! staged runs all become the same [`Plan`]: ordered [`PlannedGroup`]s, each with its devices in
//! rollout order, a [`Pace`] (how many devices may start and when), a success and an error
//! condition with actions, and [`Gate`]s before and after; plus the rollout-wide [`Policies`]
//! (action type, timeouts, retries, offline handling, rate limit, maintenance windows, soak).
//! The vocabulary-specific knobs map onto these fields as `docs/rollout-spec.md` describes.
//!
//! Conditions are evaluated here, as pure functions of a group's counts, so that the engine, the
//! simulator and the tests all agree on the numbers and the words of the decision trace.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The planned groups of a rollout and the devices left out, with why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub groups: Vec<PlannedGroup>,
    /// Devices the rollout selector matched but the release cannot be installed on, and devices
    /// a spec lists by id (`devices = [...]`, `pick = { fixed = [...] }`) that are not in the
    /// fleet or not selected by the rollout. Sorted by device id.
    pub excluded: Vec<Excluded>,
    /// Devices selected and compatible but taken by no group; they are not rolled out.
    pub unassigned: Vec<String>,
    /// With a site policy: the sites of the planned devices and their limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sites: Option<SitePlan>,
}

impl Plan {
    /// One warning per group that selects no device: such a group starts and succeeds at once,
    /// which is rarely what its selector meant (a typo in a label, a site with no devices).
    pub fn empty_group_warnings(&self) -> Vec<String> {
        self.groups
            .iter()
            .filter(|g| g.devices.is_empty())
            .map(|g| {
                format!(
                    "group {} selects no device: it will start and succeed at once; check its \
                     select",
                    g.name
                )
            })
            .collect()
    }
}

/// The planned devices by site, with the site policy that will hold them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SitePlan {
    pub policy: SitePolicy,
    /// (site, planned devices of that site), by site name.
    pub sites: Vec<(String, usize)>,
    /// Planned devices without the label: in no site, no site limit applies to them.
    pub without_site: usize,
}

impl SitePlan {
    /// What the policy does to one site, in words: "site harbour: 16 devices, at most 2 busy
    /// at once, one seed fetches first, the others from peers (seed wait 10m)".
    pub fn line(&self, site: &str, devices: usize) -> String {
        let p = &self.policy;
        let mut line = format!("site {site}: {}", crate::text::count(devices, "device"));
        if let Some(n) = p.max_busy {
            line.push_str(&format!(", at most {n} busy"));
        }
        if let Some(n) = p.max_unavailable {
            line.push_str(&format!(", at most {n} unavailable"));
        }
        if p.peers {
            line.push_str(&format!(
                ", one seed fetches first and the others from peers (seed wait {}s)",
                p.seed_wait
            ));
        }
        line
    }
}

impl Plan {
    /// Devices in any group.
    pub fn device_count(&self) -> usize {
        self.groups.iter().map(|g| g.devices.len()).sum()
    }
}

/// A device left out of a rollout, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Excluded {
    pub device: String,
    pub reason: String,
}

/// One group with its devices in rollout order (the order in which they are started).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedGroup {
    pub name: String,
    pub devices: Vec<String>,
    pub pace: Pace,
    pub success: SuccessCondition,
    pub error: Option<ErrorCondition>,
    /// Must be satisfied before the group's first device starts.
    pub before: Gate,
    /// Must be satisfied after the group succeeded, before the next group may start.
    pub after: Gate,
}

/// How the devices of a running group are started.
///
/// Every time something changes, the engine starts the next scheduled devices (in order) while
/// all three limits allow it; a device that is started counts as not ready until it reports
/// Ready. With every field `None`, the whole group starts at once (hawkBit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pace {
    /// Most devices started in one batch (Fleet's `maxNew`, 50). After a batch, the next one
    /// starts only when [`Pace::gate`] allows it.
    pub batch: Option<usize>,
    /// A new batch starts only while at most this many of the group's devices are not ready
    /// (Fleet's `maxUnavailable`, resolved against the group's size).
    pub gate: Option<Budget>,
    /// Most devices of the group not ready at the same time, counting the ones about to start
    /// (KubeFleet's rolling `maxUnavailable`, the staged `max_concurrency`). Failed devices count
    /// as not ready, so a failing device holds its slot, as in KubeFleet.
    pub concurrency: Option<usize>,
}

/// A number of devices written as a count or as a share of a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Budget {
    Count(usize),
    Percent(Percent),
}

impl Budget {
    /// The budget for a group of `total` devices; a percentage rounds up (10% of 25 is 3).
    pub fn of(self, total: usize) -> usize {
        match self {
            Budget::Count(n) => n,
            Budget::Percent(p) => p.of_rounded_up(total),
        }
    }
}

impl fmt::Display for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Budget::Count(n) => write!(f, "{n}"),
            Budget::Percent(p) => write!(f, "{p}"),
        }
    }
}

/// Something that must hold before a group starts or after it succeeded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gate {
    /// An operator must approve (`flotilla approve NAME`). The approval request is named
    /// `<rollout>-<group>` after a group and `<rollout>-before-<group>` before it.
    pub approval: bool,
    /// Seconds to wait (after the group succeeded, for an after gate).
    pub wait: u64,
}

impl Gate {
    pub fn is_open(&self) -> bool {
        !self.approval && self.wait == 0
    }
}

/// When a group counts as a success, and what happens then.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SuccessCondition {
    pub threshold: Threshold,
    pub action: SuccessAction,
}

impl Default for SuccessCondition {
    fn default() -> Self {
        Self {
            threshold: Threshold::Share(Percent::HUNDRED),
            action: SuccessAction::Next,
        }
    }
}

/// How many ready devices make a group a success.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Threshold {
    /// At least this share of the group ready (hawkBit).
    Share(Percent),
    /// Every device started and at most this many not ready (Fleet: a partition is Ready when
    /// its NotReady devices are within its `maxUnavailable`).
    AllBut(Budget),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SuccessAction {
    /// Start the next group (after the group's after gate).
    Next,
    /// Pause the rollout until an operator resumes it.
    Pause,
}

/// When a group counts as failed, and what happens then. It holds when at least `min_sample`
/// devices of the group have ended and either the failures (of the counted classes) are
/// strictly more than `percent` of the group, or at least `count`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorCondition {
    pub percent: Option<Percent>,
    pub count: Option<usize>,
    pub min_sample: usize,
    pub classes: FailureClasses,
    pub action: ErrorAction,
}

impl Default for ErrorCondition {
    /// hawkBit's plainest condition: pause on the first failure.
    fn default() -> Self {
        Self {
            percent: Some(Percent::ZERO),
            count: None,
            min_sample: 0,
            classes: FailureClasses::default(),
            action: ErrorAction::Pause,
        }
    }
}

/// Which kinds of failure an error condition counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureClasses {
    /// The device reported Failed (after its retries were used up).
    pub failed: bool,
    /// The device stayed in progress past the rollout's timeout, or went offline past its grace.
    pub timed_out: bool,
    /// The device refused the action (trust, compatibility).
    pub refused: bool,
}

impl Default for FailureClasses {
    fn default() -> Self {
        Self {
            failed: true,
            timed_out: true,
            refused: true,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorAction {
    /// Pause the rollout until an operator resumes it.
    Pause,
    /// Stop the rollout for good: unfinished actions are canceled (a staged run is Failed).
    Stop,
    /// Stop, and send every device of the rollout that installed the release back to the release
    /// it kept.
    Rollback,
}

/// Rollout-wide settings, the same for every vocabulary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Policies {
    /// hawkBit's action type of every desired action.
    pub action: ActionType,
    /// Unix seconds before which a started rollout sends nothing (hawkBit `startAt`).
    pub start_at: Option<u64>,
    /// Between overlapping rollouts, the higher weight keeps a device's running action.
    pub weight: u32,
    /// Seconds a device may stay in progress before it counts as timed out. None: forever.
    pub timeout: Option<u64>,
    pub retry: Option<Retry>,
    pub offline: OfflinePolicy,
    pub rate: Option<RateLimit>,
    /// Nothing new starts outside these windows; empty means always.
    pub windows: Vec<WindowSpec>,
    /// Seconds a device must have been Ready before it counts toward its group's success.
    pub soak: u64,
    /// Seconds after which a device whose readiness cannot be tracked (it has no health checks)
    /// counts as available (KubeFleet's `unavailablePeriodSeconds`).
    pub unavailable_period: u64,
    /// How many started groups may be not successful while the next group starts (Fleet's
    /// `maxUnavailablePartitions`); 0 means each group must succeed first.
    pub max_unavailable_groups: Budget,
    /// Devices that register after the rollout started join a last group named `dynamic`.
    pub dynamic: bool,
    /// Per-site limits and peer sharing; devices without the site label form no site.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sites: Option<SitePolicy>,
    /// Accepted devices the coordinator holds no state of when the rollout is created: left out
    /// and named, or a reason not to create it.
    #[serde(default, skip_serializing_if = "UnknownDevices::is_exclude")]
    pub unknown_devices: UnknownDevices,
}

/// What creating a rollout does about accepted devices the coordinator has read no state of
/// since it started (a retained state cleared, dropped by the broker, or never sent): their
/// labels and hardware are unknown, so no selector can tell whether they belong.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownDevices {
    /// Create the rollout without them, each listed as excluded with the reason (in the reply,
    /// the status and the trace). A dynamic rollout takes them when their state arrives.
    #[default]
    Exclude,
    /// Refuse to create the rollout while there are any, naming them: create it again once
    /// they have sent a state.
    Refuse,
}

impl UnknownDevices {
    pub fn is_exclude(&self) -> bool {
        *self == UnknownDevices::Exclude
    }
}

impl Default for Policies {
    fn default() -> Self {
        Self {
            action: ActionType::Forced,
            start_at: None,
            weight: DEFAULT_WEIGHT,
            timeout: None,
            retry: None,
            offline: OfflinePolicy::Wait,
            rate: None,
            windows: Vec::new(),
            soak: 0,
            unavailable_period: 0,
            max_unavailable_groups: Budget::Count(0),
            dynamic: false,
            sites: None,
            unknown_devices: UnknownDevices::Exclude,
        }
    }
}

/// Site budgets and peer ordering, rollout-wide (a site's devices may be in several groups).
///
/// A site is the set of a rollout's devices with the same value of the device label `label`.
/// These limits apply on top of each group's own pace: a device whose start would take its site
/// over a limit waits, and starts when a device of the site finishes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SitePolicy {
    /// The device label whose value names a device's site, e.g. `site`.
    pub label: String,
    /// Most devices of one site busy at once: started and not yet terminal (downloading,
    /// installing, or waiting for a retry). None: no limit.
    pub max_busy: Option<usize>,
    /// Most devices of one site not ready at once, counted as a group's budget counts them
    /// (busy, soaking, or failed). None: no limit.
    pub max_unavailable: Option<usize>,
    /// One device of a site (the seed) fetches from the coordinator first; the others wait for
    /// a device of the site to hold the release's artifacts verified and fetch from it.
    pub peers: bool,
    /// Seconds the other devices of a site wait for the seed before another device becomes
    /// the seed, and after which waiting devices start without peers.
    pub seed_wait: u64,
}

/// How long a site waits for its seed unless the spec says otherwise: ten minutes, long enough
/// to fetch a few hundred megabytes on a slow link, short enough that a dead seed costs little.
pub const DEFAULT_SEED_WAIT: u64 = 600;

/// Most peers named in one desired action: the most recent holders of the site.
pub const MAX_PEERS: usize = 8;

/// The weight of a rollout that does not set one.
pub const DEFAULT_WEIGHT: u32 = 500;

/// hawkBit's action types, as the spec names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionType {
    Forced,
    /// The agent waits for local consent.
    Soft,
    /// Download and verify only; success counts Downloaded.
    DownloadOnly,
    /// Soft until this Unix time, forced after it.
    TimeForced {
        at: u64,
    },
}

/// Retries of retryable failures (Failed or timed out, not Refused), each with a new action id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retry {
    /// Retries after the first attempt.
    pub attempts: u32,
    /// Seconds before the first retry; doubles for each further one.
    pub backoff: u64,
}

/// What to do with a device that is offline when its turn comes or while it is in progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OfflinePolicy {
    /// Send the action anyway; the device picks it up when it reconnects.
    Wait,
    /// Leave it out of the group (it counts as skipped, not as failed) and take the next one.
    Skip,
    /// Count it as timed out once it has been offline for this many seconds.
    Fail { grace: u64 },
}

/// Devices started per minute, ramping up exponentially with successes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RateLimit {
    /// Devices per minute at first.
    pub base: f64,
    /// The rate is multiplied by this factor...
    pub factor: f64,
    /// ...every time this many more devices succeeded.
    pub every: u32,
    /// The rate never goes above this (devices per minute). None: no cap.
    pub max: Option<f64>,
}

/// A maintenance window as written in the spec: a five-field cron expression for when it opens,
/// how long it stays open, and the time zone the cron expression is read in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowSpec {
    pub cron: String,
    /// Seconds.
    pub duration: u64,
    /// An IANA zone name such as `Europe/Berlin`, or `UTC`.
    pub tz: String,
}

/// A percentage from 0% to 100% in hundredths of a percent, so that comparisons against device
/// counts are exact integer arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Percent(u32);

impl Percent {
    pub const ZERO: Percent = Percent(0);
    pub const HUNDRED: Percent = Percent(10_000);

    /// From hundredths of a percent; `None` above 100%.
    pub fn from_basis_points(bp: u32) -> Option<Self> {
        (bp <= 10_000).then_some(Percent(bp))
    }

    pub fn basis_points(self) -> u32 {
        self.0
    }

    /// Whether `part` of `whole` is at least this share.
    pub fn reached_by(self, part: usize, whole: usize) -> bool {
        part as u128 * 10_000 >= self.0 as u128 * whole as u128
    }

    /// Whether `part` of `whole` is strictly more than this share.
    pub fn exceeded_by(self, part: usize, whole: usize) -> bool {
        part as u128 * 10_000 > self.0 as u128 * whole as u128
    }

    /// This share of `n`, rounded up.
    pub fn of_rounded_up(self, n: usize) -> usize {
        (n as u128 * self.0 as u128).div_ceil(10_000) as usize
    }

    /// This share of `n`, rounded down.
    pub fn of_rounded_down(self, n: usize) -> usize {
        (n as u128 * self.0 as u128 / 10_000) as usize
    }

    /// Parses "25%", "25", "12.5%" (at most two decimals).
    pub fn parse_text(text: &str) -> Option<Self> {
        let t = text.trim();
        let t = t.strip_suffix('%').unwrap_or(t).trim_end();
        let (int, frac) = t.split_once('.').unwrap_or((t, ""));
        if int.is_empty() || !int.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        if frac.len() > 2
            || !frac.bytes().all(|b| b.is_ascii_digit())
            || (t.contains('.') && frac.is_empty())
        {
            return None;
        }
        let int: u32 = int.parse().ok()?;
        let frac_bp: u32 = format!("{frac:0<2}").parse().ok()?;
        Self::from_basis_points(int.checked_mul(100)?.checked_add(frac_bp)?)
    }
}

impl fmt::Display for Percent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (int, frac) = (self.0 / 100, self.0 % 100);
        match frac {
            0 => write!(f, "{int}%"),
            f2 if f2 % 10 == 0 => write!(f, "{int}.{}%", f2 / 10),
            f2 => write!(f, "{int}.{f2:02}%"),
        }
    }
}
