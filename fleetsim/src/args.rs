//! The command line, and its validation into [`Options`]: every error names the flag.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use flotilla_mqtt::{ConnectionSpec, RawTls};

use crate::device_fetch::DownloadMode;
use crate::fleet::{Fleet, Phases};
use crate::sim::{Options, Probe};

/// Plays N devices over the real protocol against a real broker and coordinator: each signs its
/// states and reports with its own ed25519 key, checks the coordinator's signature on every
/// desired action, and reports the agent's phases. One MQTT connection for the whole range.
#[derive(Debug, Clone, Parser)]
#[command(name = "flotilla-fleetsim", version)]
pub struct Args {
    /// The MQTT broker, as HOST:PORT.
    #[arg(long, default_value = "127.0.0.1:1883")]
    pub broker: String,
    /// MQTT username; the password comes from --password-file or FLOTILLA_BROKER_PASSWORD.
    #[arg(long)]
    pub username: Option<String>,
    #[arg(long)]
    pub password_file: Option<PathBuf>,
    /// Connect with TLS, checking the broker's certificate against this CA file (PEM).
    #[arg(long)]
    pub ca_file: Option<PathBuf>,
    /// Root of every flotilla topic.
    #[arg(long, default_value = flotilla_protocol::topics::DEFAULT_ROOT)]
    pub topic_root: String,

    /// Device ids are this prefix followed by the zero-padded index.
    #[arg(long, default_value = "sim-")]
    pub id_prefix: String,
    /// The first index of this simulator's range.
    #[arg(long, default_value_t = 0)]
    pub first: u64,
    /// How many devices, from --first on.
    #[arg(long, required_unless_present_any = ["first_answer", "idle_probes", "stream_bytes", "watch_device"])]
    pub count: Option<u64>,
    /// Digits of the index in the id.
    #[arg(long, default_value_t = 6)]
    pub id_width: usize,
    /// Keys, offline devices and failures all follow from the seed: the same seed plays the
    /// same fleet.
    #[arg(long, default_value = "fleetsim")]
    pub seed: String,

    /// Write the coordinator's `[enrollment] authorized_keys` file for the range and exit.
    #[arg(long, value_name = "FILE")]
    pub write_authorized_keys: Option<PathBuf>,
    /// Enroll with one-time tokens instead: a file with one token a line, one per device in
    /// id order (the coordinator's `[enrollment] tokens`).
    #[arg(long, value_name = "FILE")]
    pub tokens: Option<PathBuf>,
    /// The coordinator's public key file (`coordinator.pub`): desired actions must verify
    /// against it. Not needed with --baseline-groups.
    #[arg(long, value_name = "FILE")]
    pub coordinator_key: Option<PathBuf>,

    /// Every device's hardware id (the release's hardware list must name it).
    #[arg(long, default_value = "sim-board")]
    pub hardware_id: String,
    /// A label of every device, KEY=VALUE; repeatable.
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
    /// How long an install takes, spread over its phases: `0s` (instant), `500ms`, `30s`, `2m`.
    #[arg(long, default_value = "0s")]
    pub install_time: String,
    /// The share of installs that fail after activating (rolled back), 0 to 1.
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,
    /// The share of devices that are offline (state `online: false`, no answers), 0 to 1.
    #[arg(long, default_value_t = 0.0)]
    pub offline: f64,
    /// Which phases an install reports.
    #[arg(long, value_enum, default_value = "agent")]
    pub phases: Phases,

    /// Exit once every online device has finished an install.
    #[arg(long)]
    pub until_done: bool,
    /// Give up (exit 1) after this long: `10m`.
    #[arg(long)]
    pub timeout: Option<String>,
    /// Print a progress line to stderr this often; `0s` for none.
    #[arg(long, default_value = "5s")]
    pub progress: String,
    /// QoS 1 publishes in flight on the connection.
    #[arg(long, default_value_t = 100)]
    pub inflight: u16,
    /// Time control round trips: an operator's secret key file that signs a read-only request
    /// (`list_releases`) every --probe-every.
    #[arg(long, value_name = "FILE")]
    pub probe_key: Option<PathBuf>,
    #[arg(long, default_value = "200ms")]
    pub probe_every: String,
    /// The broker-only baseline: a stand-in coordinator on a second connection runs this many
    /// groups over the online devices, without flotilla's coordinator.
    #[arg(long, value_name = "GROUPS")]
    pub baseline_groups: Option<usize>,
    /// Time group transitions and desired actions per second per group, for a rollout of
    /// `[groups] count = GROUPS` over the online devices of this range (set by
    /// --baseline-groups).
    #[arg(long, value_name = "GROUPS")]
    pub groups: Option<usize>,
    /// Play no devices: send a --probe-key request every 20 ms until the coordinator answers,
    /// print how long that took and exit (how soon a restarted coordinator answers).
    #[arg(long, requires = "probe_key")]
    pub first_answer: bool,
    /// Play no devices: send COUNT --probe-key requests one at a time (the next 20 ms after
    /// the previous answer), print their round trips (p50, p99, max) and exit: an idle
    /// coordinator's, when run before the fleet registers. --timeout bounds each request (5s).
    #[arg(
        long,
        value_name = "COUNT",
        requires = "probe_key",
        conflicts_with = "first_answer"
    )]
    pub idle_probes: Option<usize>,
    /// Prepare the costly half of every signature the devices send for one install each (a
    /// report and a state per phase) before connecting: signing a message then costs a hash
    /// instead of a point multiplication, so the simulator spends its CPU before the rollout,
    /// not during it (64 bytes a signature: 90 MB at 100,000 devices with the agent's phases).
    #[arg(long)]
    pub sign_ahead: bool,
    /// Where each device gets the bytes of the release it installs, between `Accepted` and
    /// `Verified`: `none` (installs are instant), `mqtt` (signed block requests to the
    /// coordinator, as the agent sends them) or `http` (range requests to the origin URL the
    /// desired action names); every block is checked against the signed block list.
    #[arg(
        long,
        value_enum,
        default_value = "none",
        conflicts_with = "baseline_groups"
    )]
    pub download: DownloadMode,
    /// With --download: at most this many devices download at a time; the others wait, after
    /// `Accepted`, for a turn.
    #[arg(long, value_name = "DEVICES", default_value_t = 64)]
    pub download_at_once: usize,
    /// Play no devices: stream this many bytes of block replies (--stream-block each, QoS 1)
    /// from one connection to another through the broker, print how long it took and exit
    /// (the baseline of one agent's download, bench/download.sh).
    #[arg(long, value_name = "BYTES", conflicts_with = "watch_device")]
    pub stream_bytes: Option<u64>,
    /// The block size of --stream-bytes: the artifact server's largest reply.
    #[arg(long, value_name = "BYTES", default_value_t = 65_536)]
    pub stream_block: u32,
    /// Play no devices: watch this real device's desired action and reports until its action
    /// ends (or --timeout), then print when each step was seen and exit. Needs --device-key.
    #[arg(long, value_name = "DEVICE", requires = "device_key")]
    pub watch_device: Option<String>,
    /// The watched device's public key (hex, as `flotilla-agent identity` prints it): only
    /// reports it signed count.
    #[arg(long, value_name = "HEX")]
    pub device_key: Option<String>,
    /// Also write the figures as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub summary: Option<PathBuf>,
}

/// A refused argument: the flag, the value, why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{flag} {value:?}: {reason}")]
pub struct ArgError {
    pub flag: &'static str,
    pub value: String,
    pub reason: String,
}

fn arg_error(
    flag: &'static str,
    value: impl std::fmt::Display,
    reason: impl Into<String>,
) -> ArgError {
    ArgError {
        flag,
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// `500ms`, `30s`, `2m`, `1h`, or plain seconds.
pub fn parse_duration(flag: &'static str, text: &str) -> Result<Duration, ArgError> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: u64 = number.parse().map_err(|_| {
        arg_error(
            flag,
            text,
            "expected a whole number and a unit: 500ms, 30s, 2m, 1h",
        )
    })?;
    let scale = match unit {
        "ms" => 1,
        "" | "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return Err(arg_error(flag, text, "unknown unit; use ms, s, m or h")),
    };
    n.checked_mul(scale)
        .map(Duration::from_millis)
        .ok_or_else(|| arg_error(flag, text, "too long"))
}

fn share(flag: &'static str, value: f64) -> Result<f64, ArgError> {
    if (0.0..=1.0).contains(&value) {
        Ok(value)
    } else {
        Err(arg_error(flag, value, "must be between 0 and 1"))
    }
}

fn read(flag: &'static str, path: &Path) -> Result<String, ArgError> {
    std::fs::read_to_string(path).map_err(|e| arg_error(flag, path.display(), e.to_string()))
}

impl Args {
    /// The device range.
    pub fn fleet(&self) -> Result<Fleet, crate::fleet::FleetError> {
        Fleet::new(
            &self.id_prefix,
            self.first,
            self.count.unwrap_or(0),
            self.id_width,
            &self.seed,
        )
    }

    /// The validated connection settings.
    pub fn connection(&self) -> Result<flotilla_mqtt::Connection, ArgError> {
        let (host, port) = self
            .broker
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.trim_matches(['[', ']']), p.parse::<u16>().ok()?)))
            .ok_or_else(|| arg_error("--broker", &self.broker, "expected HOST:PORT"))?;
        let spec = ConnectionSpec {
            alternates: Vec::new(),
            order: Default::default(),
            host: host.to_owned(),
            port,
            username: self.username.clone(),
            password_file: self.password_file.clone(),
            password_env: (self.username.is_some() && self.password_file.is_none())
                .then(|| flotilla_mqtt::PASSWORD_ENV.to_owned()),
            tls: self.ca_file.as_ref().map(|ca| RawTls {
                ca_file: Some(ca.clone()),
                ..RawTls::default()
            }),
        };
        spec.validate(Path::new("."), &|name| std::env::var(name).ok())
            .map_err(|e| {
                let flag = match e.field {
                    "username" => "--username",
                    "password_file" | "password_env" => "--password-file",
                    "tls.ca_file" => "--ca-file",
                    _ => "--broker",
                };
                arg_error(flag, e.value, e.reason)
            })
    }

    /// The watched device's public key.
    pub fn device_key(&self) -> Result<flotilla_protocol::VerifyingKey, ArgError> {
        let text = self.device_key.as_deref().unwrap_or_default();
        flotilla_protocol::signing::public_key_from_text(text)
            .map_err(|e| arg_error("--device-key", text, e.to_string()))
    }

    /// The probe's operator key, if any.
    pub fn probe_key(&self) -> Result<Option<flotilla_protocol::SigningKey>, ArgError> {
        let Some(path) = &self.probe_key else {
            return Ok(None);
        };
        let text = read("--probe-key", path)?;
        flotilla_protocol::signing::secret_key_from_text(&text)
            .map(Some)
            .map_err(|e| arg_error("--probe-key", path.display(), e.to_string()))
    }

    /// The validated run options. The coordinator key is read here unless it is the baseline's
    /// stand-in (`coordinator_key` then given by the caller).
    pub fn options(&self, fleet: Fleet) -> Result<Options, ArgError> {
        let connection = self.connection()?;
        let coordinator_key = match (&self.coordinator_key, self.baseline_groups) {
            (_, Some(_)) => crate::baseline::coordinator_key(&fleet).verifying_key(),
            (Some(path), None) => {
                let text = read("--coordinator-key", path)?;
                flotilla_protocol::signing::public_key_from_text(&text)
                    .map_err(|e| arg_error("--coordinator-key", path.display(), e.to_string()))?
            }
            (None, None) => {
                return Err(arg_error(
                    "--coordinator-key",
                    "",
                    "required: the coordinator's public key file, to check desired actions",
                ))
            }
        };
        let labels = self
            .labels
            .iter()
            .map(|l| {
                let (k, v) = l
                    .split_once('=')
                    .ok_or_else(|| arg_error("--label", l, "expected KEY=VALUE"))?;
                Ok((k.trim().to_owned(), v.trim().to_owned()))
            })
            .collect::<Result<Vec<_>, ArgError>>()?;
        let tokens = match &self.tokens {
            Some(path) => Some(
                read("--tokens", path)?
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(str::to_owned)
                    .collect(),
            ),
            None => None,
        };
        let probe = match self.probe_key()? {
            Some(key) => {
                let every = parse_duration("--probe-every", &self.probe_every)?;
                if every.is_zero() {
                    return Err(arg_error(
                        "--probe-every",
                        &self.probe_every,
                        "must be more than 0",
                    ));
                }
                Some(Probe { key, every })
            }
            None => None,
        };
        let progress = parse_duration("--progress", &self.progress)?;
        Ok(Options {
            fleet,
            connection,
            topic_root: self.topic_root.clone(),
            coordinator_key,
            hardware_id: self.hardware_id.clone(),
            labels,
            installed: None,
            install_time: parse_duration("--install-time", &self.install_time)?,
            fail_rate: share("--fail-rate", self.fail_rate)?,
            offline_share: share("--offline", self.offline)?,
            phases: self.phases,
            tokens,
            until_done: self.until_done || self.baseline_groups.is_some(),
            timeout: self
                .timeout
                .as_deref()
                .map(|t| parse_duration("--timeout", t))
                .transpose()?,
            progress: (!progress.is_zero()).then_some(progress),
            inflight: self.inflight,
            probe,
            groups: match self.baseline_groups.or(self.groups) {
                Some(0) => {
                    let flag = if self.baseline_groups.is_some() {
                        "--baseline-groups"
                    } else {
                        "--groups"
                    };
                    return Err(arg_error(flag, 0, "must be at least 1"));
                }
                groups => groups,
            },
            summary: self.summary.clone(),
            sign_ahead: self.sign_ahead,
            download: self.download,
            download_at_once: match self.download_at_once {
                0 => return Err(arg_error("--download-at-once", 0, "must be at least 1")),
                n => n,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut argv = vec!["flotilla-fleetsim", "--count", "3"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).expect("arguments")
    }

    #[test]
    fn durations_take_a_unit() {
        assert_eq!(
            parse_duration("--x", "500ms"),
            Ok(Duration::from_millis(500))
        );
        assert_eq!(parse_duration("--x", "2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("--x", "7"), Ok(Duration::from_secs(7)));
        let err = parse_duration("--install-time", "3 weeks").expect_err("bad");
        assert!(
            err.to_string().starts_with("--install-time \"3 weeks\""),
            "{err}"
        );
    }

    #[test]
    fn bad_values_name_their_flag() {
        let a = args(&["--coordinator-key", "/nonexistent/coordinator.pub"]);
        let err = a
            .options(a.fleet().expect("fleet"))
            .expect_err("no key file");
        assert_eq!(err.flag, "--coordinator-key");
        let a = args(&["--baseline-groups", "2", "--fail-rate", "1.5"]);
        let err = a.options(a.fleet().expect("fleet")).expect_err("rate");
        assert_eq!(err.flag, "--fail-rate");
        let a = args(&["--baseline-groups", "2", "--label", "novalue"]);
        let err = a.options(a.fleet().expect("fleet")).expect_err("label");
        assert_eq!(err.flag, "--label");
        let a = args(&["--baseline-groups", "2", "--broker", "localhost"]);
        let err = a.options(a.fleet().expect("fleet")).expect_err("broker");
        assert_eq!(err.flag, "--broker");
        let a = args(&[]);
        let err = a
            .options(a.fleet().expect("fleet"))
            .expect_err("key required");
        assert!(err.reason.contains("required"), "{err}");
    }

    #[test]
    fn devices_download_nothing_unless_told() {
        let key = tempfile::NamedTempFile::new().expect("temp file");
        let fleet = args(&[]).fleet().expect("fleet");
        let public = crate::baseline::coordinator_key(&fleet).verifying_key();
        std::fs::write(
            key.path(),
            flotilla_protocol::hex::encode(public.as_bytes()),
        )
        .expect("writes");
        let path = key.path().to_str().expect("utf-8 path");
        let a = args(&["--coordinator-key", path]);
        let o = a.options(a.fleet().expect("fleet")).expect("options");
        assert_eq!((o.download, o.download_at_once), (DownloadMode::None, 64));
        let a = args(&[
            "--coordinator-key",
            path,
            "--download",
            "http",
            "--download-at-once",
            "8",
        ]);
        let o = a.options(a.fleet().expect("fleet")).expect("options");
        assert_eq!((o.download, o.download_at_once), (DownloadMode::Http, 8));
        let a = args(&[
            "--coordinator-key",
            path,
            "--download",
            "mqtt",
            "--download-at-once",
            "0",
        ]);
        let err = a
            .options(a.fleet().expect("fleet"))
            .expect_err("none at once");
        assert_eq!(err.flag, "--download-at-once");
        let both = [
            "flotilla-fleetsim",
            "--count",
            "3",
            "--baseline-groups",
            "2",
            "--download",
            "mqtt",
        ];
        assert!(
            Args::try_parse_from(both).is_err(),
            "the baseline serves no blocks"
        );
    }

    #[test]
    fn the_baseline_checks_the_stand_in_key_and_runs_until_done() {
        let a = args(&["--baseline-groups", "5", "--label", "ring=a"]);
        let fleet = a.fleet().expect("fleet");
        let o = a.options(fleet.clone()).expect("options");
        assert!(o.until_done);
        assert_eq!(
            o.coordinator_key,
            crate::baseline::coordinator_key(&fleet).verifying_key()
        );
        assert_eq!(o.labels, [("ring".to_owned(), "a".to_owned())]);
    }
}
