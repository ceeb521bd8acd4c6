//! How often this device sends its retained state unprompted (decision 0072).
//!
//! The agent publishes its state on every (re)connect and on every change. That is enough on a
//! broker that keeps what it was given, but a state can still go missing between the device and
//! the coordinator: a broker restarted without persistence, a cluster node that garbles a
//! retained message it copied from another (Debian's NATS 2.9), or a coordinator whose
//! subscription was being made on one node while the state was published on another, too early
//! for the live message and too early for that node's copy of the retained one. Nothing would
//! send it again until the device's next change, and the coordinator cannot ask for a state of
//! a device it has never heard of. So the agent sends it again every `[broker] state_refresh`.
//!
//! Each device stretches the period by a factor of its own, from its device id, between 0.75 and
//! 1.25: a fleet that connected at the same moment (after a broker restart) sends its first
//! refresh spread over half a period rather than all at once, and stays spread out after that.

use std::time::Duration;

/// The period for device `device_id` when the configured one is `every`: `every` times a
/// factor in [0.75, 1.25) picked by the device id (the FNV-1a spread that also picks its first
/// broker, [`flotilla_mqtt::spread`]), the same at every start.
pub fn period(device_id: &str, every: Duration) -> Duration {
    // In thousandths: 750..1250.
    let factor = 750 + u32::try_from(flotilla_mqtt::spread(device_id, 500)).unwrap_or(0);
    every * factor / 1000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fleet_spreads_its_refreshes_over_half_a_period() {
        let every = Duration::from_secs(900);
        let periods: Vec<Duration> = (0..1000)
            .map(|i| period(&format!("dev-{i}"), every))
            .collect();
        let (min, max) = (
            *periods.iter().min().expect("some"),
            *periods.iter().max().expect("some"),
        );
        assert!(
            min >= every * 3 / 4 && max < every * 5 / 4,
            "{min:?}..{max:?}"
        );
        // Spread, not bunched: each tenth of the range holds some of the thousand devices.
        let span = (every / 2).as_millis();
        let mut tenths = [0u32; 10];
        for p in &periods {
            let at = (p.as_millis() - (every * 3 / 4).as_millis()) * 10 / span;
            tenths[usize::try_from(at).expect("small")] += 1;
        }
        assert!(tenths.iter().all(|&n| n >= 50), "{tenths:?}");
        // The same device gets the same period at every start.
        assert_eq!(period("dev-7", every), period("dev-7", every));
    }
}
