//! # flotilla-fleetsim
//!
//! A fleet simulator: N devices over the real protocol, against a real broker and a real
//! coordinator, behind one MQTT connection. Each device signs its retained state and its reports
//! with its own ed25519 key (derived from a seed and its id, so runs repeat and an authorized
//! keys file can be written ahead), enrolls through that file or one-time tokens, checks the
//! coordinator's signature on every desired action and refuses forgeries, and reports the
//! phases the agent reports, with a configurable install time, failure rate and offline share.
//! Id ranges (`--id-prefix`, `--first`, `--count`) let several simulators share a broker.
//!
//! It is what `bench/fleet.sh` and the scale test (`tests/tests/scale.rs`) run, and what an
//! operator can point at a staging coordinator to try a spec (`docs/fleetsim.md`).
//!
//! Layout: `args.rs` (the command line, validated into [`sim::Options`]), `fleet.rs` (who the
//! devices are and how they behave; pure), `sim.rs` (the run), `summary.rs` (its figures),
//! `link.rs` (the MQTT event loop), `baseline.rs` (the broker-only baseline's stand-in coordinator), `sign_ahead.rs` (device
//! signatures with their costly half prepared before connecting), `probe.rs` (control round
//! trips without a fleet: a restart's first answer, an idle coordinator's), `download.rs` (one real
//! agent's download timed from outside, and the same bytes streamed through the broker alone,
//! for `bench/download.sh`), `device_fetch.rs` (devices that download, `--download mqtt|http`),
//! `artifact_check.rs` (their blocks checked against the signed block list) and `http_range.rs`
//! (a minimal range-request client for an `http://` origin).
//!
//! ```
//! use flotilla_fleetsim::fleet::Fleet;
//! let fleet = Fleet::new("sim-", 0, 3, 6, "seed").expect("a valid range");
//! assert_eq!(fleet.id(2), "sim-000002");
//! // The coordinator's `[enrollment] authorized_keys` file for the range:
//! assert_eq!(fleet.authorized_keys().lines().filter(|l| l.ends_with("sim-000001")).count(), 1);
//! ```

pub mod args;
pub mod artifact_check;
pub mod baseline;
pub mod device_fetch;
pub mod download;
pub mod fleet;
pub mod http_range;
pub mod link;
pub mod probe;
pub mod sign_ahead;
pub mod sim;
pub mod summary;
