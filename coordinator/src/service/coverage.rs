//! Whether the broker delivered every accepted device's state: a broker that drops retained
//! states is named, not trusted.
//!
//! After a (re)connect the broker delivers every retained state on subscribe, all queued for the
//! coordinator at once, and a broker that limits what it queues for one client drops whatever is
//! beyond its limit, silently (MQTT gives the subscriber no sign). Mosquitto's limit is
//! `max_queued_messages` (default 1000) above the `max_inflight_messages` in flight (default 20)
//! per client, and `max_queued_bytes` when set: measured with Mosquitto 2.0.11 at its defaults,
//! 1,020 of 3,000 retained states reached the coordinator, and the end-of-retained marker queued
//! behind them was dropped too. The devices whose state was dropped are accepted but unknown to
//! the engine, so no rollout selects them until they send a state again.
//!
//! So once the retained states are in (the marker came back, or its timeout passed;
//! `loading.rs`), the service compares the accepted devices with those it holds a state of
//! ([`check`]); far fewer ([`is_shortfall`]) is a warning naming both counts and the broker
//! setting, counted in `/metrics`. Mosquitto also counts what it dropped in `$SYS`
//! ([`SYS_DROPPED`]), which the coordinator subscribes to: a rise is a warning too, at most once
//! a minute. Other brokers publish nothing there, which changes nothing.
//!
//! Pure but for the atomics a scrape reads ([`CoverageCollector`]).

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// Mosquitto's count of publishes it dropped for its clients' queue limits since it started,
/// published (retained, as decimal text) every `sys_interval` (10 s by default).
pub const SYS_DROPPED: &str = "$SYS/broker/publish/messages/dropped";

/// A shortfall is at least this many devices without a state…
pub const MIN_MISSING: usize = 10;
/// …and at least this share of the accepted devices, in percent.
pub const MIN_MISSING_PERCENT: usize = 1;

/// How often at most a rise of the broker's dropped count is logged.
pub const DROPPED_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// What the broker should be told, in every warning.
const BROKER_SETTINGS: &str = "a broker drops messages beyond the queue it keeps for one client \
    (on Mosquitto, max_queued_messages, default 1000, above max_inflight_messages, default 20, \
    and max_queued_bytes): set max_queued_messages above the fleet's size, as the shipped \
    deploy/mosquitto/mosquitto.conf does (200000), and restart the broker (Mosquitto 2.0.11 kept \
    the old limits across a reload)";

/// Whether `with_state` of `accepted` devices is far fewer: at least [`MIN_MISSING`] devices
/// and [`MIN_MISSING_PERCENT`] of them missing. A few devices that are gone for good (not
/// deleted) are no broker's fault and not worth a warning at every restart; they are still
/// listed as `no state since restart`.
pub fn is_shortfall(accepted: usize, with_state: usize) -> bool {
    let missing = accepted.saturating_sub(with_state);
    missing >= MIN_MISSING && missing * 100 >= accepted * MIN_MISSING_PERCENT
}

/// How the retained states were taken as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadEnd {
    /// The end-of-retained marker came back.
    Marker,
    /// The marker did not come back in time (it may have been dropped with the states).
    Timeout,
}

/// The numbers a scrape shows, shared with the metrics endpoint.
#[derive(Debug)]
struct Stats {
    without_state: AtomicU64,
    shortfalls: AtomicU64,
    /// The broker's own dropped count, -1 until one was seen.
    broker_dropped: AtomicI64,
}

/// What the service keeps about coverage.
#[derive(Debug)]
pub struct Coverage {
    stats: Arc<Stats>,
    /// The broker's dropped count first seen since the coordinator started, the count the last
    /// warning named, and when that was.
    dropped_first: Option<u64>,
    dropped_reported: Option<u64>,
    dropped_logged: Option<Instant>,
}

impl Default for Coverage {
    fn default() -> Self {
        Self::new()
    }
}

impl Coverage {
    pub fn new() -> Self {
        Self {
            stats: Arc::new(Stats {
                without_state: AtomicU64::new(0),
                shortfalls: AtomicU64::new(0),
                broker_dropped: AtomicI64::new(-1),
            }),
            dropped_first: None,
            dropped_reported: None,
            dropped_logged: None,
        }
    }

    /// The collector to register with the metrics endpoint.
    pub fn collector(&self) -> Box<dyn Collector> {
        Box::new(CoverageCollector {
            stats: self.stats.clone(),
        })
    }

    /// Records how many accepted devices have no state (a scrape's gauge).
    pub fn set_without_state(&self, without_state: usize) {
        self.stats
            .without_state
            .store(without_state as u64, Ordering::Relaxed);
    }

    /// The retained states are read (`end`): `accepted` devices, `with_state` of them with a
    /// state. Returns the warning to log when that is far fewer.
    pub fn check(&mut self, accepted: usize, with_state: usize, end: LoadEnd) -> Option<String> {
        let missing = accepted.saturating_sub(with_state);
        self.set_without_state(missing);
        if !is_shortfall(accepted, with_state) {
            return None;
        }
        self.stats.shortfalls.fetch_add(1, Ordering::Relaxed);
        let when = match end {
            LoadEnd::Marker => "after reading every retained device state",
            LoadEnd::Timeout => {
                "after the end-of-retained marker did not come back (dropped with the states?)"
            }
        };
        Some(format!(
            "{when}, the coordinator holds the states of {with_state} of {accepted} accepted \
             devices: {missing} have no state since it started and no rollout selects them \
             until they send one (`flotilla devices` lists them as `no state since restart`). \
             The broker may have dropped them: {BROKER_SETTINGS}. Devices that are gone for good \
             can be deleted (`flotilla devices delete ID`)"
        ))
    }

    /// A payload on [`SYS_DROPPED`] at `now`: the broker's count. Returns the warning to log
    /// when the count rose since the coordinator first saw it, or was not zero then, at most
    /// once per [`DROPPED_LOG_INTERVAL`]. A payload that is not a count is an error naming it.
    pub fn broker_dropped(
        &mut self,
        payload: &[u8],
        now: Instant,
    ) -> Result<Option<String>, String> {
        let count: u64 = std::str::from_utf8(payload)
            .ok()
            .filter(|text| text.len() <= 20)
            .and_then(|text| text.trim().parse().ok())
            .ok_or_else(|| {
                let shown: String = String::from_utf8_lossy(payload).chars().take(40).collect();
                format!("{SYS_DROPPED}: {shown:?} is not a count")
            })?;
        self.stats
            .broker_dropped
            .store(i64::try_from(count).unwrap_or(i64::MAX), Ordering::Relaxed);
        let first = *self.dropped_first.get_or_insert(count);
        let news = count > self.dropped_reported.unwrap_or(0);
        let due = self
            .dropped_logged
            .is_none_or(|at| now.duration_since(at) >= DROPPED_LOG_INTERVAL);
        if !news || !due {
            return Ok(None);
        }
        self.dropped_logged = Some(now);
        self.dropped_reported = Some(count);
        Ok(Some(format!(
            "the broker reports {count} messages dropped for its clients' queue limits since it \
             started ({SYS_DROPPED}; the first count the coordinator saw was {first}); states, \
             reports or control requests for this coordinator may be among them: \
             {BROKER_SETTINGS}"
        )))
    }
}

/// Encodes the coverage numbers at scrape time.
#[derive(Debug)]
struct CoverageCollector {
    stats: Arc<Stats>,
}

impl Collector for CoverageCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let without = ConstGauge::new(
            i64::try_from(self.stats.without_state.load(Ordering::Relaxed)).unwrap_or(i64::MAX),
        );
        let metric = encoder.encode_descriptor(
            "flotilla_devices_without_state",
            "Accepted devices of which no state was read since the coordinator started",
            None,
            without.metric_type(),
        )?;
        without.encode(metric)?;
        let shortfalls = ConstCounter::new(self.stats.shortfalls.load(Ordering::Relaxed));
        let metric = encoder.encode_descriptor(
            "flotilla_retained_state_shortfalls",
            "Times the retained states read after a (re)connect were far fewer than the \
             accepted devices (a broker that drops them)",
            None,
            shortfalls.metric_type(),
        )?;
        shortfalls.encode(metric)?;
        let dropped = self.stats.broker_dropped.load(Ordering::Relaxed);
        if dropped >= 0 {
            let gauge = ConstGauge::new(dropped);
            let metric = encoder.encode_descriptor(
                "flotilla_broker_messages_dropped",
                "Messages the broker dropped for its clients' queue limits since it started, as \
                 it reports in $SYS/broker/publish/messages/dropped (Mosquitto)",
                None,
                gauge.metric_type(),
            )?;
            gauge.encode(metric)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn far_fewer_is_ten_devices_and_one_percent() {
        assert!(!is_shortfall(0, 0));
        assert!(!is_shortfall(9, 0), "fewer than ten missing");
        assert!(is_shortfall(10, 0));
        assert!(is_shortfall(3000, 1020));
        assert!(!is_shortfall(100_000, 99_001), "999 of 100,000 is under 1%");
        assert!(is_shortfall(100_000, 99_000));
        assert!(!is_shortfall(5, 9), "more states than accepted devices");
    }

    #[test]
    fn a_shortfall_names_both_counts_and_the_broker_setting_and_is_counted() {
        let mut coverage = Coverage::new();
        assert_eq!(coverage.check(3000, 2995, LoadEnd::Marker), None);
        let line = coverage
            .check(3000, 1020, LoadEnd::Timeout)
            .expect("a warning");
        assert!(
            line.contains("1020 of 3000 accepted devices")
                && line.contains("1980 have no state")
                && line.contains("max_queued_messages")
                && line.contains("no state since restart")
                && line.contains("marker did not come back"),
            "{line}"
        );
        assert_eq!(coverage.stats.shortfalls.load(Ordering::Relaxed), 1);
        assert_eq!(coverage.stats.without_state.load(Ordering::Relaxed), 1980);
    }

    #[test]
    fn the_brokers_dropped_count_is_logged_when_it_rises_at_most_once_a_minute() {
        let mut coverage = Coverage::new();
        let t0 = Instant::now();
        assert_eq!(coverage.broker_dropped(b"0", t0), Ok(None));
        let line = coverage
            .broker_dropped(b"1980", t0 + Duration::from_secs(10))
            .expect("a count")
            .expect("it rose");
        assert!(
            line.contains("1980 messages dropped")
                && line.contains("the first count the coordinator saw was 0")
                && line.contains("max_queued_messages"),
            "{line}"
        );
        assert_eq!(
            coverage.broker_dropped(b"2500", t0 + Duration::from_secs(20)),
            Ok(None),
            "once a minute at most"
        );
        assert_eq!(coverage.stats.broker_dropped.load(Ordering::Relaxed), 2500);
        let line = coverage
            .broker_dropped(b"2500", t0 + Duration::from_secs(80))
            .expect("a count")
            .expect("the rise not named yet");
        assert!(line.contains("2500 messages dropped"), "{line}");
        assert_eq!(
            coverage.broker_dropped(b"2500", t0 + Duration::from_secs(200)),
            Ok(None),
            "no rise since"
        );
        for bad in [
            &b"lots"[..],
            b"-1",
            b"",
            &[0xff, 0xfe],
            b"123456789012345678901234",
        ] {
            let err = coverage
                .broker_dropped(bad, t0 + Duration::from_secs(400))
                .expect_err("not a count");
            assert!(err.contains("not a count"), "{err}");
        }
    }

    #[test]
    fn a_broker_that_had_dropped_before_the_coordinator_asked_is_named_once() {
        let mut coverage = Coverage::new();
        let t0 = Instant::now();
        let line = coverage
            .broker_dropped(b"42\n", t0)
            .expect("a count")
            .expect("not zero");
        assert!(
            line.contains("42 messages dropped") && line.contains("saw was 42"),
            "{line}"
        );
        assert_eq!(
            coverage.broker_dropped(b"42", t0 + Duration::from_secs(120)),
            Ok(None)
        );
    }

    #[test]
    fn the_collector_shows_the_numbers_and_the_brokers_count_only_once_seen() {
        let mut coverage = Coverage::new();
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(coverage.collector());
        let text = |registry: &prometheus_client::registry::Registry| {
            let mut out = String::new();
            prometheus_client::encoding::text::encode(&mut out, registry).expect("encodes");
            out
        };
        coverage.check(3000, 1020, LoadEnd::Marker);
        let before = text(&registry);
        assert!(
            before.contains("flotilla_devices_without_state 1980")
                && before.contains("flotilla_retained_state_shortfalls_total 1")
                && !before.contains("flotilla_broker_messages_dropped"),
            "{before}"
        );
        let _ = coverage.broker_dropped(b"1980", Instant::now());
        assert!(text(&registry).contains("flotilla_broker_messages_dropped 1980"));
    }
}
