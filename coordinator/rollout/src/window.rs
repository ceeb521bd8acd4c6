//! Maintenance windows: a five-field cron expression for when a window opens, how long it stays
//! open, and the IANA time zone the expression is read in.
//!
//! Cron fields are `minute hour day-of-month month day-of-week` with `*`, lists (`1,15`),
//! ranges (`1-5`), steps (`*/15`, `1-5/2`, `10/20` meaning 10 to the end in steps of 20) and
//! names (`jan`..`dec`, `sun`..`sat`); day-of-week 0 and 7 are Sunday. As in Vixie cron, when
//! both day fields are restricted (neither starts with `*`) a day matches if either does;
//! otherwise both must.
//!
//! A window opens at every matching local wall-clock minute and stays open `duration` real
//! seconds (so a window that spans a DST change is still `duration` long). Local times that a
//! DST change skips open the window at the instant of the change, and local times that a DST
//! change repeats open it only the first time, like cronie.
//!
//! Time zones: `UTC` is built in; any other name is asked for once, in [`Window::parse`], from a
//! [`ZoneSource`] (the service and the CLI pass `zoneinfo::SystemZones`, which reads
//! `$TZDIR/<name>`): the 64-bit section of a TZif v2+ file, extended with its POSIX
//! footer rule up to [`RULE_LAST_YEAR`]. Nothing in this module does I/O; [`Window::is_open`] and
//! [`Window::next_open`] only look at the days a window could span.
//!
//! ```
//! use flotilla_rollout::plan::WindowSpec;
//! use flotilla_rollout::window::Window;
//! use flotilla_rollout::zoneinfo::SystemZones;
//!
//! let nightly = WindowSpec { cron: "0 22 * * mon-fri".into(), duration: 4 * 3600, tz: "UTC".into() };
//! let w = Window::parse(&nightly, &SystemZones).unwrap();
//! // Monday 2027-01-04 23:00 UTC is inside Monday's window, 12:00 is not.
//! assert!(w.is_open(1_799_103_600));
//! assert!(!w.is_open(1_799_064_000));
//! ```

use crate::plan::WindowSpec;
use crate::zoneinfo::ZoneSource;

/// How far ahead [`Window::next_open`] looks.
pub const LOOKAHEAD: u64 = 366 * 86_400;

/// Transitions from a zone's POSIX footer rule are generated up to this year; later times keep
/// the last offset.
pub const RULE_LAST_YEAR: i64 = 2200;

const DAY: i64 = 86_400;
/// Lower bound of the first zone segment; far enough back for any rollout, small enough that
/// adding offsets never overflows.
const BEGINNING: i64 = -(1 << 50);

/// A validated maintenance window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    pub spec: WindowSpec,
    cron: Cron,
    zone: Zone,
}

/// Why a window spec was refused; the text names the field and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct WindowError(pub String);

impl Window {
    /// Validates a window spec and loads its time zone. Errors read
    /// `window.cron: "61 * * * *": minute 61 is not from 0 to 59`; [`Window::parse_all`] names
    /// the index instead (`window[0].cron: …`).
    pub fn parse(spec: &WindowSpec, zones: &dyn ZoneSource) -> Result<Window, WindowError> {
        Self::parse_named("window", spec, zones)
    }

    /// Parses every window of a spec; errors name the window as `window[i]`.
    pub fn parse_all(
        specs: &[WindowSpec],
        zones: &dyn ZoneSource,
    ) -> Result<Vec<Window>, WindowError> {
        specs
            .iter()
            .enumerate()
            .map(|(i, s)| Self::parse_named(&format!("window[{i}]"), s, zones))
            .collect()
    }

    fn parse_named(
        field: &str,
        spec: &WindowSpec,
        zones: &dyn ZoneSource,
    ) -> Result<Window, WindowError> {
        let cron = Cron::parse(&spec.cron)
            .map_err(|e| WindowError(format!("{field}.cron: {:?}: {e}", spec.cron)))?;
        if spec.duration == 0 {
            return Err(WindowError(format!(
                "{field}.duration: 0 is not a duration; a window must stay open at least 1s"
            )));
        }
        if spec.duration > LOOKAHEAD {
            return Err(WindowError(format!(
                "{field}.duration: {}s is longer than 366 days",
                spec.duration
            )));
        }
        let zone = Zone::load(&spec.tz, zones)
            .map_err(|e| WindowError(format!("{field}.tz: {:?}: {e}", spec.tz)))?;
        Ok(Window {
            spec: spec.clone(),
            cron,
            zone,
        })
    }

    /// Whether the window is open at `unix` (seconds).
    pub fn is_open(&self, unix: u64) -> bool {
        let t = clamp(unix);
        let duration = clamp(self.spec.duration);
        self.prev_start(t, t - duration + 1).is_some()
    }

    /// The first time at or after `unix` when the window is open, looking at most 366 days ahead.
    pub fn next_open(&self, unix: u64) -> Option<u64> {
        if self.is_open(unix) {
            return Some(unix);
        }
        let t = clamp(unix);
        self.next_start(t, t + clamp(LOOKAHEAD))
            .and_then(|s| u64::try_from(s).ok())
    }

    /// When the window that is open at `unix` closes (None when it is closed at `unix`).
    pub fn closes_at(&self, unix: u64) -> Option<u64> {
        let t = clamp(unix);
        let duration = clamp(self.spec.duration);
        let start = self.prev_start(t, t - duration + 1)?;
        u64::try_from(start + duration).ok()
    }

    /// The latest window start in `[lo, t]` (UTC seconds), walking the zone's segments back.
    fn prev_start(&self, t: i64, lo: i64) -> Option<i64> {
        let mut k = self.zone.segment_of(t);
        loop {
            let seg = self.zone.segment(k);
            let hi_utc = t.min(seg.end - 1);
            let lo_utc = lo.max(seg.start);
            if lo_utc <= hi_utc {
                let mut llo = lo_utc + seg.offset;
                if seg.offset < seg.prev_offset {
                    // A repeated hour: its local times already opened the window once.
                    llo = llo.max(seg.start + seg.prev_offset);
                }
                if let Some(local) = self.cron.prev_in(llo, hi_utc + seg.offset) {
                    return Some(local - seg.offset);
                }
                if lo_utc == seg.start && self.gap_matches(&seg) {
                    return Some(seg.start);
                }
            }
            if k == 0 || seg.start <= lo {
                return None;
            }
            k -= 1;
        }
    }

    /// The earliest window start in `[t, hi]` (UTC seconds), walking the zone's segments forward.
    fn next_start(&self, t: i64, hi: i64) -> Option<i64> {
        let mut k = self.zone.segment_of(t);
        loop {
            let seg = self.zone.segment(k);
            let hi_utc = hi.min(seg.end - 1);
            let lo_utc = t.max(seg.start);
            if lo_utc <= hi_utc {
                if lo_utc == seg.start && self.gap_matches(&seg) {
                    return Some(seg.start);
                }
                let mut llo = lo_utc + seg.offset;
                if seg.offset < seg.prev_offset {
                    llo = llo.max(seg.start + seg.prev_offset);
                }
                if let Some(local) = self.cron.next_in(llo, hi_utc + seg.offset) {
                    return Some(local - seg.offset);
                }
            }
            if k + 1 >= self.zone.segments() || seg.end > hi {
                return None;
            }
            k += 1;
        }
    }

    /// Whether the local times skipped at the start of `seg` (clocks moved forward) match.
    fn gap_matches(&self, seg: &Segment) -> bool {
        seg.offset > seg.prev_offset
            && self
                .cron
                .next_in(seg.start + seg.prev_offset, seg.start + seg.offset - 1)
                .is_some()
    }
}

fn clamp(v: u64) -> i64 {
    i64::try_from(v.min(1 << 50)).unwrap_or(1 << 50)
}

// ---------------------------------------------------------------------------------------------
// Cron

/// A parsed five-field cron expression as bit sets.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cron {
    minutes: u64,
    hours: u32,
    /// Bits 1..=31.
    dom: u32,
    /// Bits 1..=12.
    months: u16,
    /// Bits 0..=6, Sunday = 0.
    dow: u8,
    /// Both day fields restricted: a day matches if either does.
    days_or: bool,
    dom_star: bool,
    dow_star: bool,
}

const MONTHS: [&str; 12] = [
    "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
];
const DAYS: [&str; 7] = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"];

impl Cron {
    fn parse(text: &str) -> Result<Cron, String> {
        let fields: Vec<&str> = text.split_whitespace().collect();
        if fields.len() != 5 {
            return Err(format!(
                "expected 5 fields (minute hour day-of-month month day-of-week), found {}",
                fields.len()
            ));
        }
        let minutes = field(fields[0], "minute", 0, 59, &[], 0)?;
        let hours = field(fields[1], "hour", 0, 23, &[], 0)?;
        let dom = field(fields[2], "day-of-month", 1, 31, &[], 1)?;
        let months = field(fields[3], "month", 1, 12, &MONTHS, 1)?;
        let mut dow = field(fields[4], "day-of-week", 0, 7, &DAYS, 0)?;
        if dow & (1 << 7) != 0 {
            dow = (dow & !(1 << 7)) | 1;
        }
        let dom_star = fields[2].starts_with('*');
        let dow_star = fields[4].starts_with('*');
        let cron = Cron {
            minutes,
            hours: u32::try_from(hours).unwrap_or(0),
            dom: u32::try_from(dom).unwrap_or(0),
            months: u16::try_from(months).unwrap_or(0),
            dow: u8::try_from(dow).unwrap_or(0),
            days_or: !dom_star && !dow_star,
            dom_star,
            dow_star,
        };
        if !cron.days_or && !dom_star && !cron.any_month_has_day() {
            return Err(format!(
                "day-of-month {:?} never occurs in month {:?}, so the window would never open",
                fields[2], fields[3]
            ));
        }
        Ok(cron)
    }

    /// Whether some selected month has some selected day of the month (Feb 29 counts).
    fn any_month_has_day(&self) -> bool {
        (1..=12u32).any(|m| {
            let len = [31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31][(m - 1) as usize];
            self.months & (1 << m) != 0 && (1..=len).any(|d| self.dom & (1 << d) != 0)
        })
    }

    fn day_matches(&self, day: i64) -> bool {
        let (_, m, d) = civil_from_days(day);
        if self.months & (1 << m) == 0 {
            return false;
        }
        let wd = (day + 4).rem_euclid(7);
        let dom_ok = self.dom & (1 << d) != 0;
        let dow_ok = self.dow & (1 << wd) != 0;
        if self.days_or {
            dom_ok || dow_ok
        } else {
            (self.dom_star || dom_ok) && (self.dow_star || dow_ok)
        }
    }

    /// The earliest matching minute (local naive seconds) in `[lo, hi]`.
    fn next_in(&self, lo: i64, hi: i64) -> Option<i64> {
        if lo > hi {
            return None;
        }
        let start = lo.div_euclid(60) * 60 + if lo.rem_euclid(60) == 0 { 0 } else { 60 };
        let mut day = start.div_euclid(DAY);
        while day * DAY <= hi {
            if self.day_matches(day) {
                let from = if day * DAY >= start {
                    0
                } else {
                    (start - day * DAY) / 60
                };
                if let Some(minute) = self.first_minute_from(from) {
                    let at = day * DAY + minute * 60;
                    return (at <= hi).then_some(at);
                }
            }
            day += 1;
        }
        None
    }

    /// The latest matching minute (local naive seconds) in `[lo, hi]`.
    fn prev_in(&self, lo: i64, hi: i64) -> Option<i64> {
        if lo > hi {
            return None;
        }
        let end = hi.div_euclid(60) * 60;
        let mut day = end.div_euclid(DAY);
        while (day + 1) * DAY > lo {
            if self.day_matches(day) {
                let upto = ((end - day * DAY) / 60).min(1439);
                if let Some(minute) = self.last_minute_upto(upto) {
                    let at = day * DAY + minute * 60;
                    return (at >= lo).then_some(at);
                }
            }
            day -= 1;
        }
        None
    }

    /// First matching minute of the day at or after minute-of-day `from`.
    fn first_minute_from(&self, from: i64) -> Option<i64> {
        let (h0, m0) = (from / 60, from % 60);
        for h in h0..24 {
            if self.hours & (1 << h) == 0 {
                continue;
            }
            let skip = if h == h0 { m0 } else { 0 };
            let mask = self.minutes >> skip;
            if mask != 0 {
                return Some(h * 60 + skip + i64::from(mask.trailing_zeros()));
            }
        }
        None
    }

    /// Last matching minute of the day at or before minute-of-day `upto`.
    fn last_minute_upto(&self, upto: i64) -> Option<i64> {
        let (h0, m0) = (upto / 60, upto % 60);
        for h in (0..=h0).rev() {
            if self.hours & (1 << h) == 0 {
                continue;
            }
            let keep = if h == h0 { m0 } else { 59 };
            let mask = self.minutes & (u64::MAX >> (63 - keep));
            if mask != 0 {
                return Some(h * 60 + 63 - i64::from(mask.leading_zeros()));
            }
        }
        None
    }
}

/// Parses one cron field into a bit set over `min..=max`.
fn field(
    text: &str,
    name: &str,
    min: u32,
    max: u32,
    names: &[&str],
    name_base: u32,
) -> Result<u64, String> {
    let mut bits = 0u64;
    for part in text.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((r, s)) => {
                let step: u32 = s
                    .parse()
                    .map_err(|_| format!("{name} step {s:?} is not a number"))?;
                if step == 0 || step > max {
                    return Err(format!("{name} step {step} is not from 1 to {max}"));
                }
                (r, step)
            }
            None => (part, 1),
        };
        let (lo, hi) = if range == "*" {
            (min, max)
        } else if let Some((a, b)) = range.split_once('-') {
            let a = value(a, name, min, max, names, name_base)?;
            let b = value(b, name, min, max, names, name_base)?;
            if a > b {
                return Err(format!("{name} range {range} runs backwards"));
            }
            (a, b)
        } else {
            let v = value(range, name, min, max, names, name_base)?;
            // `10/20` is 10 to the end in steps of 20.
            (v, if part.contains('/') { max } else { v })
        };
        let mut v = lo;
        while v <= hi {
            bits |= 1 << v;
            v += step;
        }
    }
    Ok(bits)
}

fn value(
    text: &str,
    name: &str,
    min: u32,
    max: u32,
    names: &[&str],
    name_base: u32,
) -> Result<u32, String> {
    if text.is_empty() {
        return Err(format!("{name} has an empty value"));
    }
    let lower = text.to_ascii_lowercase();
    if let Some(i) = names.iter().position(|n| *n == lower) {
        return Ok(i as u32 + name_base);
    }
    let v: u32 = text.parse().map_err(|_| {
        if names.is_empty() {
            format!("{name} {text:?} is not a number")
        } else {
            format!(
                "{name} {text:?} is not a number or one of {}",
                names.join(",")
            )
        }
    })?;
    if v < min || v > max {
        return Err(format!("{name} {v} is not from {min} to {max}"));
    }
    Ok(v)
}

// ---------------------------------------------------------------------------------------------
// Calendar

/// A Unix time as an RFC 3339 UTC text an operator can read: `2027-01-15T20:00:00Z`.
pub fn utc_text(unix: u64) -> String {
    let secs = unix as i64;
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let t = secs.rem_euclid(86_400);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        t / 3600,
        t / 60 % 60,
        t % 60
    )
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
pub(crate) fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// (year, month 1..=12, day 1..=31) of a day count since 1970-01-01.
pub(crate) fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

// ---------------------------------------------------------------------------------------------
// Time zones

/// UTC offsets over time: `offsets[i]` applies from `times[i]` on, `initial` before `times[0]`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Zone {
    initial: i64,
    times: Vec<i64>,
    offsets: Vec<i64>,
}

/// A stretch of time with one UTC offset.
struct Segment {
    start: i64,
    end: i64,
    offset: i64,
    prev_offset: i64,
}

impl Zone {
    fn utc() -> Zone {
        Zone {
            initial: 0,
            times: Vec::new(),
            offsets: Vec::new(),
        }
    }

    fn load(name: &str, zones: &dyn ZoneSource) -> Result<Zone, String> {
        if name == "UTC" {
            return Ok(Zone::utc());
        }
        if name.is_empty()
            || name.starts_with('/')
            || name
                .split('/')
                .any(|p| p == ".." || p == "." || p.is_empty())
        {
            return Err("not a time zone name like Europe/Berlin or UTC".into());
        }
        let bytes = zones.tzif(name)?;
        parse_tzif(&bytes).map_err(|e| format!("{name} is not a usable TZif file: {e}"))
    }

    fn segments(&self) -> usize {
        self.times.len() + 1
    }

    /// Index of the segment containing `t`.
    fn segment_of(&self, t: i64) -> usize {
        self.times.partition_point(|&x| x <= t)
    }

    fn segment(&self, k: usize) -> Segment {
        let offset_of = |k: usize| {
            if k == 0 {
                self.initial
            } else {
                self.offsets[k - 1]
            }
        };
        Segment {
            start: if k == 0 { BEGINNING } else { self.times[k - 1] },
            end: self.times.get(k).copied().unwrap_or(-BEGINNING),
            offset: offset_of(k),
            prev_offset: offset_of(k.saturating_sub(1)),
        }
    }
}

/// Reads the 64-bit section of a TZif v2+ file and extends it with the footer rule.
fn parse_tzif(b: &[u8]) -> Result<Zone, String> {
    struct Header {
        isut: usize,
        isstd: usize,
        leap: usize,
        time: usize,
        types: usize,
        chars: usize,
    }
    let header = |at: usize| -> Result<Header, String> {
        let h = b.get(at..at + 44).ok_or("file is truncated")?;
        if &h[..4] != b"TZif" {
            return Err("missing TZif magic".into());
        }
        let n = |i: usize| {
            u32::from_be_bytes([h[20 + 4 * i], h[21 + 4 * i], h[22 + 4 * i], h[23 + 4 * i]])
                as usize
        };
        Ok(Header {
            isut: n(0),
            isstd: n(1),
            leap: n(2),
            time: n(3),
            types: n(4),
            chars: n(5),
        })
    };
    let v1 = header(0)?;
    if b[4] < b'2' {
        return Err("version 1 files have no 64-bit data; install a current tzdata".into());
    }
    let v1_len = v1.time * 5 + v1.types * 6 + v1.chars + v1.leap * 8 + v1.isstd + v1.isut;
    let at = 44 + v1_len;
    let h = header(at)?;
    let data = at + 44;
    let len = h.time * 9 + h.types * 6 + h.chars + h.leap * 12 + h.isstd + h.isut;
    let body = b.get(data..data + len).ok_or("file is truncated")?;
    if h.types == 0 {
        return Err("no local time types".into());
    }
    let times: Vec<i64> = (0..h.time)
        .map(|i| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&body[i * 8..i * 8 + 8]);
            i64::from_be_bytes(x)
        })
        .collect();
    let idx = &body[h.time * 8..h.time * 9];
    let types = &body[h.time * 9..h.time * 9 + h.types * 6];
    let utoff = |t: usize| -> Result<i64, String> {
        let s = types
            .get(t * 6..t * 6 + 4)
            .ok_or("bad local time type index")?;
        Ok(i64::from(i32::from_be_bytes([s[0], s[1], s[2], s[3]])))
    };
    let mut zone = Zone {
        initial: utoff(0)?,
        times: Vec::new(),
        offsets: Vec::new(),
    };
    let mut last = zone.initial;
    for (i, &t) in times.iter().enumerate() {
        let off = utoff(usize::from(idx[i]))?;
        if off != last && t > BEGINNING {
            zone.times.push(t);
            zone.offsets.push(off);
            last = off;
        }
    }
    let footer = &b[data + len..];
    let footer = std::str::from_utf8(footer).unwrap_or("").trim_matches('\n');
    if !footer.is_empty() {
        let rule = PosixTz::parse(footer)
            .ok_or_else(|| format!("footer rule {footer:?} is not understood"))?;
        rule.extend(&mut zone);
    }
    Ok(zone)
}

/// A POSIX TZ rule such as `CET-1CEST,M3.5.0,M10.5.0/3`.
struct PosixTz {
    std: i64,
    dst: Option<(i64, RuleDate, i64, RuleDate, i64)>,
}

#[derive(Clone, Copy)]
enum RuleDate {
    /// `Jn`: day 1..=365, February 29 never counted.
    Julian(i64),
    /// `n`: day 0..=365, counting February 29.
    Zero(i64),
    /// `Mm.w.d`: weekday d of week w (5 = last) of month m.
    Month(u32, u32, u32),
}

impl PosixTz {
    fn parse(s: &str) -> Option<PosixTz> {
        let mut p = s;
        skip_name(&mut p)?;
        let std = -offset(&mut p)?;
        if p.is_empty() {
            return Some(PosixTz { std, dst: None });
        }
        skip_name(&mut p)?;
        let dst = if p.starts_with(',') {
            std + 3600
        } else {
            -offset(&mut p)?
        };
        let mut rule = || -> Option<(RuleDate, i64)> {
            p = p.strip_prefix(',')?;
            let date = if let Some(r) = p.strip_prefix('M') {
                p = r;
                let m = number(&mut p)?;
                p = p.strip_prefix('.')?;
                let w = number(&mut p)?;
                p = p.strip_prefix('.')?;
                let d = number(&mut p)?;
                if !(1..=12).contains(&m) || !(1..=5).contains(&w) || d > 6 {
                    return None;
                }
                RuleDate::Month(m as u32, w as u32, d as u32)
            } else if let Some(r) = p.strip_prefix('J') {
                p = r;
                RuleDate::Julian(number(&mut p)?)
            } else {
                RuleDate::Zero(number(&mut p)?)
            };
            let time = if let Some(r) = p.strip_prefix('/') {
                p = r;
                offset(&mut p)?
            } else {
                7200
            };
            Some((date, time))
        };
        let (start, start_time) = rule()?;
        let (end, end_time) = rule()?;
        if !p.is_empty() {
            return None;
        }
        Some(PosixTz {
            std,
            dst: Some((dst, start, start_time, end, end_time)),
        })
    }

    /// Appends the rule's transitions after the zone's last explicit one.
    fn extend(&self, zone: &mut Zone) {
        let Some((dst, start, start_time, end, end_time)) = self.dst else {
            return;
        };
        let last = zone.times.last().copied();
        let first_year = last.map_or(1970, |t| civil_from_days(t.div_euclid(DAY)).0);
        let mut current = zone.offsets.last().copied().unwrap_or(zone.initial);
        for year in first_year..=RULE_LAST_YEAR {
            // The start is written in standard time, the end in daylight time.
            let on = rule_day(start, year) * DAY + start_time - self.std;
            let off = rule_day(end, year) * DAY + end_time - dst;
            let mut pair = [(on, dst), (off, self.std)];
            pair.sort();
            for (t, o) in pair {
                if last.is_some_and(|l| t <= l) || o == current {
                    continue;
                }
                zone.times.push(t);
                zone.offsets.push(o);
                current = o;
            }
        }
    }
}

/// Days since 1970-01-01 of a rule date in `year`.
fn rule_day(date: RuleDate, year: i64) -> i64 {
    let jan1 = days_from_civil(year, 1, 1);
    match date {
        RuleDate::Julian(n) => {
            let n = n.clamp(1, 365);
            jan1 + n - 1 + i64::from(is_leap(year) && n >= 60)
        }
        RuleDate::Zero(n) => jan1 + n,
        RuleDate::Month(m, w, d) => {
            let first = days_from_civil(year, m, 1);
            let wd_first = (first + 4).rem_euclid(7);
            let mut day = first + (i64::from(d) - wd_first).rem_euclid(7) + 7 * (i64::from(w) - 1);
            let next_month = if m == 12 {
                days_from_civil(year + 1, 1, 1)
            } else {
                days_from_civil(year, m + 1, 1)
            };
            while day >= next_month {
                day -= 7;
            }
            day
        }
    }
}

fn skip_name(p: &mut &str) -> Option<()> {
    if let Some(r) = p.strip_prefix('<') {
        let close = r.find('>')?;
        *p = &r[close + 1..];
    } else {
        let n = p
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(p.len());
        if n < 3 {
            return None;
        }
        *p = &p[n..];
    }
    Some(())
}

fn number(p: &mut &str) -> Option<i64> {
    let n = p.find(|c: char| !c.is_ascii_digit()).unwrap_or(p.len());
    let v = p[..n].parse().ok()?;
    *p = &p[n..];
    Some(v)
}

/// `[+-]hh[:mm[:ss]]` in seconds, as written (POSIX offsets are positive west of Greenwich).
fn offset(p: &mut &str) -> Option<i64> {
    let sign = if let Some(r) = p.strip_prefix('-') {
        *p = r;
        -1
    } else {
        *p = p.strip_prefix('+').unwrap_or(p);
        1
    };
    let mut secs = number(p)? * 3600;
    for scale in [60, 1] {
        match p.strip_prefix(':') {
            Some(r) => {
                *p = r;
                secs += number(p)? * scale;
            }
            None => break,
        }
    }
    Some(sign * secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zoneinfo::SystemZones;

    fn window(cron: &str, duration: u64, tz: &str) -> Window {
        Window::parse(
            &WindowSpec {
                cron: cron.into(),
                duration,
                tz: tz.into(),
            },
            &SystemZones,
        )
        .expect("valid window")
    }

    fn err(cron: &str, tz: &str) -> String {
        Window::parse_all(
            &[WindowSpec {
                cron: cron.into(),
                duration: 3600,
                tz: tz.into(),
            }],
            &SystemZones,
        )
        .expect_err("invalid")
        .to_string()
    }

    /// Unix seconds of a UTC wall-clock time.
    fn utc(y: i64, mo: u32, d: u32, h: i64, mi: i64) -> u64 {
        u64::try_from(days_from_civil(y, mo, d) * DAY + h * 3600 + mi * 60).expect("after 1970")
    }

    #[test]
    fn calendar_round_trips() {
        for day in [-1000, 0, 10_957, 19_000, 20_000, 60_000] {
            let (y, m, d) = civil_from_days(day);
            assert_eq!(days_from_civil(y, m, d), day);
        }
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(days_from_civil(2024, 2, 29), 19_782);
    }

    #[test]
    fn berlin_window_follows_local_time_across_dst() {
        // 02:00 to 04:00 local every day. Berlin is UTC+1 in winter, UTC+2 in summer.
        let w = window("0 2 * * *", 2 * 3600, "Europe/Berlin");
        // 2027-03-27 (winter): opens 01:00 UTC.
        assert!(!w.is_open(utc(2027, 3, 27, 0, 59)));
        assert!(w.is_open(utc(2027, 3, 27, 1, 0)));
        assert!(w.is_open(utc(2027, 3, 27, 2, 59)));
        assert!(!w.is_open(utc(2027, 3, 27, 3, 0)));
        // 2027-03-28: clocks jump from 02:00 to 03:00 local at 01:00 UTC. 02:00 local never
        // happens, so the window opens at the change, 01:00 UTC (03:00 CEST).
        assert_eq!(
            w.next_open(utc(2027, 3, 27, 12, 0)),
            Some(utc(2027, 3, 28, 1, 0))
        );
        // 2027-03-29 (summer): opens 00:00 UTC.
        assert_eq!(
            w.next_open(utc(2027, 3, 28, 12, 0)),
            Some(utc(2027, 3, 29, 0, 0))
        );
        assert!(w.is_open(utc(2027, 3, 29, 1, 30)));
        assert!(!w.is_open(utc(2027, 3, 29, 2, 0)));
        // 2027-10-31: 02:00-03:00 local happens twice; the window opens only the first time
        // (00:00 UTC) and stays open two real hours.
        assert_eq!(
            w.next_open(utc(2027, 10, 30, 12, 0)),
            Some(utc(2027, 10, 31, 0, 0))
        );
        assert!(w.is_open(utc(2027, 10, 31, 1, 59)));
        assert!(!w.is_open(utc(2027, 10, 31, 2, 0)));
        // Past the file's explicit transitions the footer rule keeps DST going.
        assert!(w.is_open(utc(2060, 7, 1, 0, 0)));
        assert!(w.is_open(utc(2060, 12, 1, 2, 30)));
        assert!(!w.is_open(utc(2060, 7, 1, 2, 30)));
    }

    #[test]
    fn weekday_only_window() {
        // 2027-01-01 is a Friday.
        let w = window("30 9 * * mon-fri", 3600, "UTC");
        assert!(w.is_open(utc(2027, 1, 1, 9, 30)));
        assert!(w.is_open(utc(2027, 1, 1, 10, 29)));
        assert!(!w.is_open(utc(2027, 1, 1, 10, 30)));
        assert!(!w.is_open(utc(2027, 1, 2, 9, 45)), "Saturday");
        assert_eq!(
            w.next_open(utc(2027, 1, 1, 11, 0)),
            Some(utc(2027, 1, 4, 9, 30)),
            "after Friday's window comes Monday's"
        );
        let numeric = window("30 9 * * 1-5", 3600, "UTC");
        assert_eq!(numeric.cron, w.cron);
        let sundays = window("0 0 * * 7", 60, "UTC");
        assert!(sundays.is_open(utc(2027, 1, 3, 0, 0)));
    }

    #[test]
    fn window_crossing_midnight() {
        let w = window("0 22 * * *", 4 * 3600, "UTC");
        assert!(w.is_open(utc(2027, 1, 5, 23, 0)));
        assert!(w.is_open(utc(2027, 1, 6, 1, 59)));
        assert!(!w.is_open(utc(2027, 1, 6, 2, 0)));
        assert_eq!(
            w.closes_at(utc(2027, 1, 6, 1, 0)),
            Some(utc(2027, 1, 6, 2, 0))
        );
        assert_eq!(
            w.next_open(utc(2027, 1, 6, 2, 0)),
            Some(utc(2027, 1, 6, 22, 0))
        );
        // The same window in New York, across the year boundary.
        let ny = window("0 22 31 dec *", 3 * 3600, "America/New_York");
        assert_eq!(
            ny.next_open(utc(2027, 6, 1, 0, 0)),
            Some(utc(2028, 1, 1, 3, 0)),
            "22:00 EST is 03:00 UTC the next day"
        );
        assert!(ny.is_open(utc(2028, 1, 1, 5, 59)));
    }

    #[test]
    fn steps_lists_and_the_day_or_rule() {
        let w = window("*/15 8-17/3 * * *", 60, "UTC");
        assert!(w.is_open(utc(2027, 1, 1, 11, 45)));
        assert!(!w.is_open(utc(2027, 1, 1, 12, 0)), "hours 8, 11, 14, 17");
        // Both day fields restricted: the 1st of the month OR a Monday.
        let w = window("0 0 1 * mon", 60, "UTC");
        assert!(w.is_open(utc(2027, 1, 1, 0, 0)), "Friday the 1st");
        assert!(w.is_open(utc(2027, 1, 4, 0, 0)), "Monday the 4th");
        assert!(!w.is_open(utc(2027, 1, 5, 0, 0)));
        // Day-of-month with `*` day-of-week: only the dates.
        let w = window("0 0 1,15 * *", 60, "UTC");
        assert!(!w.is_open(utc(2027, 1, 4, 0, 0)));
        assert!(w.is_open(utc(2027, 1, 15, 0, 0)));
        // A yearly window is found up to a year ahead, nothing beyond.
        let w = window("0 0 29 feb *", 60, "UTC");
        assert_eq!(
            w.next_open(utc(2027, 6, 1, 0, 0)),
            Some(utc(2028, 2, 29, 0, 0))
        );
        assert_eq!(w.next_open(utc(2028, 3, 1, 0, 0)), None);
    }

    #[test]
    fn bad_input_names_the_field_and_value() {
        assert_eq!(
            err("61 * * * *", "UTC"),
            "window[0].cron: \"61 * * * *\": minute 61 is not from 0 to 59"
        );
        assert!(err("* * * *", "UTC").contains("expected 5 fields"));
        assert!(err("0 0 * foo *", "UTC").contains("month \"foo\" is not a number or one of jan"));
        assert!(err("0 0 5-1 * *", "UTC").contains("range 5-1 runs backwards"));
        assert!(err("*/0 * * * *", "UTC").contains("minute step 0"));
        assert!(err("0 0 31 feb *", "UTC").contains("never occurs"));
        let unknown = err("0 0 * * *", "Mars/Olympus_Mons");
        assert!(
            unknown.starts_with("window[0].tz: \"Mars/Olympus_Mons\": unknown time zone"),
            "{unknown}"
        );
        for bad in ["../etc/passwd", "/etc/localtime", "Europe/../UTC", ""] {
            assert!(
                err("0 0 * * *", bad).contains("not a time zone name"),
                "{bad}"
            );
        }
        let zero = Window::parse(
            &WindowSpec {
                cron: "0 0 * * *".into(),
                duration: 0,
                tz: "UTC".into(),
            },
            &SystemZones,
        )
        .expect_err("zero duration");
        assert!(zero.to_string().starts_with("window.duration: 0"), "{zero}");
    }

    #[test]
    fn footer_rules() {
        let tz = PosixTz::parse("EST5EDT,M3.2.0,M11.1.0").expect("parses");
        assert_eq!(tz.std, -5 * 3600);
        let mut zone = Zone::utc();
        zone.initial = -5 * 3600;
        tz.extend(&mut zone);
        // 2027-03-14 02:00 EST = 07:00 UTC.
        assert!(zone
            .times
            .contains(&(days_from_civil(2027, 3, 14) * DAY + 7 * 3600)));
        assert!(PosixTz::parse("<+03>-3").is_some_and(|t| t.std == 3 * 3600 && t.dst.is_none()));
        assert!(PosixTz::parse("<-03>3<-02>,M3.5.0/-2,M10.5.0/-1").is_some());
        assert!(PosixTz::parse("garbage,").is_none());
    }
}
