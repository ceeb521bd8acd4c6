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
//! Time zones are jiff's ([`jiff::tz::TimeZone`]): `UTC` is built in; any other name is asked
//! for once, in [`Window::parse`], from a [`ZoneSource`] (the service and the CLI pass
//! `zoneinfo::SystemZones`, which reads `$TZDIR/<name>`), and its TZif bytes become a zone with
//! [`TimeZone::tzif`], which also follows the file's POSIX rule past its last listed
//! transition. Nothing in this module does I/O. The cron expression is matched against local
//! wall-clock minutes inside each stretch of time with one UTC offset (the zone's transitions
//! bound the stretches), so [`Window::is_open`] and [`Window::next_open`] only look at the days
//! a window could span (decision 0017 says why the cron part is our own).
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

use flotilla_protocol::TimeWindow;
use jiff::tz::{Offset, TimeZone};
use jiff::Timestamp;

use crate::plan::WindowSpec;
use crate::zoneinfo::ZoneSource;

/// How far ahead [`Window::next_open`] looks.
pub const LOOKAHEAD: u64 = 366 * 86_400;

const DAY: i64 = 86_400;
/// The range of instants windows are computed in (about the years -207 to 6325): far enough
/// for any rollout, well inside jiff's timestamp range even after adding a UTC offset, a
/// duration or the lookahead.
const BEGINNING: i64 = -(1 << 36);
const END: i64 = 1 << 37;

/// A validated maintenance window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    pub spec: WindowSpec,
    cron: Cron,
    zone: TimeZone,
}

/// Why a window spec was refused; the text names the field and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct WindowError(pub String);

/// A stretch of time with one UTC offset, between two transitions of the zone.
struct Segment {
    start: i64,
    end: i64,
    offset: i64,
    prev_offset: i64,
}

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
        let zone = load_zone(&spec.tz, zones)
            .map_err(|e| WindowError(format!("{field}.tz: {:?}: {e}", spec.tz)))?;
        Ok(Window {
            spec: spec.clone(),
            cron,
            zone,
        })
    }

    /// Whether the window is open at `unix` (seconds).
    pub fn is_open(&self, unix: u64) -> bool {
        self.opened_at(unix).is_some()
    }

    /// The first time at or after `unix` when the window is open, looking at most 366 days ahead.
    pub fn next_open(&self, unix: u64) -> Option<u64> {
        if self.is_open(unix) {
            return Some(unix);
        }
        let t = clamp(unix);
        self.next_start(t, t + LOOKAHEAD as i64)
            .and_then(|s| u64::try_from(s).ok())
    }

    /// When the window that is open at `unix` closes (None when it is closed at `unix`).
    pub fn closes_at(&self, unix: u64) -> Option<u64> {
        self.opened_at(unix)
            .map(|start| start.saturating_add(self.spec.duration))
    }

    /// When the window that is open at `unix` opened: its latest start no more than `duration`
    /// before (None when it is closed at `unix`).
    pub fn opened_at(&self, unix: u64) -> Option<u64> {
        let t = clamp(unix);
        let duration = self.spec.duration as i64;
        self.prev_start(t, t - duration + 1)
            .and_then(|s| u64::try_from(s).ok())
    }

    /// The stretch of one UTC offset that contains `t`.
    fn segment_at(&self, t: i64) -> Segment {
        let offset_at = |t: i64| i64::from(self.zone.to_offset(instant(t)).seconds());
        let start = self
            .zone
            .preceding(instant(t + 1))
            .next()
            .map_or(BEGINNING, |tr| tr.timestamp().as_second().max(BEGINNING));
        let end = self
            .zone
            .following(instant(t))
            .next()
            .map_or(END, |tr| tr.timestamp().as_second().min(END));
        let offset = offset_at(t);
        Segment {
            start,
            end,
            offset,
            prev_offset: if start > BEGINNING {
                offset_at(start - 1)
            } else {
                offset
            },
        }
    }

    /// The latest window start in `[lo, t]` (UTC seconds), walking the zone's segments back.
    fn prev_start(&self, t: i64, lo: i64) -> Option<i64> {
        let mut seg = self.segment_at(t);
        loop {
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
            if seg.start <= BEGINNING || seg.start <= lo {
                return None;
            }
            seg = self.segment_at(seg.start - 1);
        }
    }

    /// The earliest window start in `[t, hi]` (UTC seconds), walking the zone's segments forward.
    fn next_start(&self, t: i64, hi: i64) -> Option<i64> {
        let mut seg = self.segment_at(t);
        loop {
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
            if seg.end >= END || seg.end > hi {
                return None;
            }
            seg = self.segment_at(seg.end);
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

/// The time window an install action started at `at` carries to the agent (docs/protocol.md):
/// from the opening of the maintenance windows open at `at` to the last second before the latest
/// of them closes, in absolute UTC, so the agent can hold to it without a time zone database.
/// When none is open at `at` (an action sent before windows gated retries), the next opening's.
/// None without windows, or when none opens within [`LOOKAHEAD`].
pub fn install_window(windows: &[Window], at: u64) -> Option<TimeWindow> {
    let open_at = |t: u64| {
        windows
            .iter()
            .filter_map(|w| Some((w.opened_at(t)?, w.closes_at(t)?)))
            .reduce(|(s1, c1), (s2, c2)| (s1.min(s2), c1.max(c2)))
    };
    let (opened, closes) = open_at(at).or_else(|| {
        let next = windows.iter().filter_map(|w| w.next_open(at)).min()?;
        open_at(next)
    })?;
    Some(TimeWindow {
        not_before: opened,
        not_after: closes.saturating_sub(1),
    })
}

/// The zone `name`: `UTC` built in, any other plain IANA name from `zones` as TZif bytes.
fn load_zone(name: &str, zones: &dyn ZoneSource) -> Result<TimeZone, String> {
    if name == "UTC" {
        return Ok(TimeZone::UTC);
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
    TimeZone::tzif(name, &bytes).map_err(|e| format!("{name} is not a usable TZif file: {e}"))
}

/// Unix seconds as a window computes with them: at most [`END`].
fn clamp(v: u64) -> i64 {
    i64::try_from(v).map_or(END, |v| v.min(END))
}

/// The instant `t` (Unix seconds), kept inside jiff's range.
fn instant(t: i64) -> Timestamp {
    Timestamp::from_second(t.clamp(BEGINNING, END)).unwrap_or(Timestamp::UNIX_EPOCH)
}

/// A Unix time as an RFC 3339 UTC text an operator can read: `2027-01-15T20:00:00Z`.
pub fn utc_text(unix: u64) -> String {
    instant(clamp(unix)).to_string()
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

    /// Whether the local calendar day `day` (days since 1970-01-01) matches.
    fn day_matches(&self, day: i64) -> bool {
        let date = Offset::UTC.to_datetime(instant(day * DAY)).date();
        let (m, d) = (date.month(), date.day());
        if self.months & (1 << m) == 0 {
            return false;
        }
        let wd = date.weekday().to_sunday_zero_offset();
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
    fn utc(y: i16, mo: i8, d: i8, h: i8, mi: i8) -> u64 {
        let at = jiff::civil::date(y, mo, d)
            .at(h, mi, 0, 0)
            .to_zoned(TimeZone::UTC)
            .expect("a valid time");
        u64::try_from(at.timestamp().as_second()).expect("after 1970")
    }

    #[test]
    fn utc_text_is_rfc3339() {
        assert_eq!(utc_text(0), "1970-01-01T00:00:00Z");
        assert_eq!(
            utc_text(utc(2024, 2, 29, 23, 59) + 59),
            "2024-02-29T23:59:59Z"
        );
        assert_eq!(utc_text(1_799_103_600), "2027-01-04T23:00:00Z");
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
    fn install_window_is_the_open_window_in_utc() {
        let nightly = window("0 2 * * *", 3600, "UTC");
        let at = utc(2027, 1, 15, 2, 40);
        let sent = install_window(std::slice::from_ref(&nightly), at).expect("a window");
        assert_eq!(sent.not_before, utc(2027, 1, 15, 2, 0));
        assert_eq!(
            sent.not_after,
            utc(2027, 1, 15, 3, 0) - 1,
            "its last second"
        );
        // Sent while closed, the action carries the next night's window.
        let closed = install_window(std::slice::from_ref(&nightly), utc(2027, 1, 15, 3, 10))
            .expect("a window");
        assert_eq!(closed.not_before, utc(2027, 1, 16, 2, 0));
        // Two windows open at once: from the earlier opening to the later close.
        let evening = window("30 1 * * *", 2 * 3600, "UTC");
        let both = install_window(&[nightly, evening], at).expect("a window");
        assert_eq!(both.not_before, utc(2027, 1, 15, 1, 30));
        assert_eq!(both.not_after, utc(2027, 1, 15, 3, 30) - 1);
        assert_eq!(install_window(&[], at), None, "no windows, no limit");
        // A Berlin window, sent as UTC: 02:00-03:00 CET is 01:00-02:00 UTC.
        let berlin = window("0 2 * * *", 3600, "Europe/Berlin");
        let sent = install_window(&[berlin], utc(2027, 1, 15, 1, 30)).expect("a window");
        assert_eq!(
            (sent.not_before, sent.not_after),
            (utc(2027, 1, 15, 1, 0), utc(2027, 1, 15, 2, 0) - 1)
        );
    }

    #[test]
    fn times_far_outside_any_rollout_do_not_break_a_window() {
        let w = window("0 2 * * *", 3600, "Europe/Berlin");
        for t in [0, u64::MAX, u64::MAX / 2, 1 << 40] {
            let open = w.is_open(t);
            assert_eq!(w.closes_at(t).is_some(), open, "{t}");
            let _ = w.next_open(t);
        }
        assert_eq!(w.next_open(0), Some(3600), "1970-01-01 02:00 CET");
        assert!(
            utc_text(u64::MAX).starts_with("6325-"),
            "{}",
            utc_text(u64::MAX)
        );
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

    /// Zone files from memory: what a test or another caller may hand in instead of the disk.
    struct Bytes(Vec<u8>);

    impl ZoneSource for Bytes {
        fn tzif(&self, _name: &str) -> Result<Vec<u8>, String> {
            Ok(self.0.clone())
        }
    }

    #[test]
    fn footer_rules() {
        // New York's file lists transitions up to 2037; later ones come from its POSIX rule
        // (EST5EDT,M3.2.0,M11.1.0). 02:00 local on the second Sunday of March is skipped, so a
        // 02:00 window opens at the change, 02:00 EST = 07:00 UTC; in July it is 02:00 EDT.
        let w = window("0 2 * * *", 3600, "America/New_York");
        assert_eq!(
            w.next_open(utc(2027, 3, 13, 12, 0)),
            Some(utc(2027, 3, 14, 7, 0))
        );
        assert_eq!(
            w.next_open(utc(2090, 3, 11, 12, 0)),
            Some(utc(2090, 3, 12, 7, 0)),
            "the second Sunday of March 2090, from the footer rule"
        );
        assert!(w.is_open(utc(2090, 7, 1, 6, 30)));
        assert!(!w.is_open(utc(2090, 7, 1, 7, 30)));
        assert_eq!(
            w.opened_at(utc(2090, 7, 1, 6, 30)),
            Some(utc(2090, 7, 1, 6, 0))
        );
        assert_eq!(
            w.closes_at(utc(2090, 7, 1, 6, 30)),
            Some(utc(2090, 7, 1, 7, 0))
        );
    }

    #[test]
    fn zone_bytes_that_are_not_tzif_are_refused() {
        let spec = WindowSpec {
            cron: "0 2 * * *".into(),
            duration: 3600,
            tz: "Europe/Nowhere".into(),
        };
        for bytes in [b"TZif2 but truncated".to_vec(), vec![0u8; 64], Vec::new()] {
            let err = Window::parse(&spec, &Bytes(bytes)).expect_err("not a zone");
            assert!(
                err.to_string().starts_with(
                    "window.tz: \"Europe/Nowhere\": Europe/Nowhere is not a usable TZif file"
                ),
                "{err}"
            );
        }
        // The system's own file, handed in as bytes, is the same zone as the system's.
        let berlin = std::fs::read("/usr/share/zoneinfo/Europe/Berlin").expect("tzdata");
        let from_bytes = Window::parse(
            &WindowSpec {
                tz: "Europe/Berlin".into(),
                ..spec
            },
            &Bytes(berlin),
        )
        .expect("a zone");
        assert_eq!(from_bytes, window("0 2 * * *", 3600, "Europe/Berlin"));
    }
}
