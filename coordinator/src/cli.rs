//! The `flotilla` command line: clap definitions and what each subcommand does.
//!
//! `main.rs` only parses, sets up logging and signals, and calls [`run`] (or the demo, which
//! manages its own runtime). Commands that talk to a running coordinator go through
//! [`ControlClient`]; `keygen` and `release …` work on files and need no coordinator, so they
//! can run on an offline signing machine.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use flotilla_protocol::control::{Command, DeviceSummary, ReleaseSummary, RolloutStatus};
use tokio_util::sync::CancellationToken;

use crate::client::{ClientError, ControlClient};
use crate::config::{self, Config, ConfigError};
use crate::keys::{self, KeysError};
use crate::releases::{self, NewRelease, ReleaseError, ReleaseStore};
use crate::service::{self, ServiceError};
use crate::{demo, view};

/// Staged, health-gated software rollouts to fleets of Linux edge devices.
#[derive(Debug, Parser)]
#[command(name = "flotilla", version, about)]
pub struct Cli {
    /// The MQTT broker the coordinator listens on, as HOST:PORT.
    #[arg(
        long,
        global = true,
        env = "FLOTILLA_BROKER",
        default_value = "127.0.0.1:1883"
    )]
    pub broker: String,
    /// Root of every flotilla topic.
    #[arg(long, global = true, default_value = flotilla_protocol::topics::DEFAULT_ROOT)]
    pub topic_root: String,
    #[command(subcommand)]
    pub command: Cmd,
}

#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Generate ed25519 key pairs (release and coordinator keys).
    Keygen(KeygenArgs),
    /// Create, inspect, verify and list signed releases.
    #[command(subcommand)]
    Release(ReleaseCmd),
    /// Run the coordinator service.
    Serve(ServeArgs),
    /// Create and drive rollouts on a running coordinator.
    #[command(subcommand)]
    Rollout(RolloutCmd),
    /// List the devices a running coordinator knows.
    Devices {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Run a self-contained demo: broker, coordinator and simulated devices.
    Demo(demo::DemoArgs),
    /// Show the groups a spec makes of a fleet file, without a coordinator.
    Plan(crate::fleetfile::PlanArgs),
    /// Run a spec against a scripted fleet in virtual time, without a coordinator.
    Simulate(crate::simulate::SimulateArgs),
}

#[derive(Debug, Args)]
pub struct KeygenArgs {
    /// Directory to write the key files into.
    #[arg(long)]
    pub out: PathBuf,
    /// Write only NAME.key / NAME.pub instead of release and coordinator keys.
    #[arg(long)]
    pub name: Option<String>,
    /// Replace existing key files.
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, Subcommand)]
pub enum ReleaseCmd {
    /// Import artifacts into the store and write a signed release.
    Create(ReleaseCreateArgs),
    /// Show a release's manifest.
    Inspect {
        #[arg(long, required_unless_present = "file")]
        data_dir: Option<PathBuf>,
        /// Release name (with --data-dir).
        #[arg(required_unless_present = "file")]
        name: Option<String>,
        /// Read this release file instead.
        #[arg(long, conflicts_with_all = ["data_dir", "name"])]
        file: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Check a release's signature and every artifact in the store.
    Verify {
        #[arg(long)]
        data_dir: PathBuf,
        /// The release public key.
        #[arg(long)]
        key: PathBuf,
        name: String,
    },
    /// List the releases in a data directory.
    List {
        #[arg(long)]
        data_dir: PathBuf,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Args)]
pub struct ReleaseCreateArgs {
    #[arg(long)]
    pub data_dir: PathBuf,
    /// The release secret key.
    #[arg(long)]
    pub key: PathBuf,
    /// Release name, e.g. fw-2.4.0.
    #[arg(long)]
    pub name: String,
    #[arg(long)]
    pub version: String,
    /// Monotonic release counter; devices only install a higher one.
    #[arg(long)]
    pub counter: u64,
    /// Compatible hardware id (repeatable); none means any.
    #[arg(long)]
    pub hardware: Vec<String>,
    /// TARGET=PATH (repeatable).
    #[arg(long, required = true)]
    pub artifact: Vec<String>,
    /// How long the release stays installable (s, m, h, d).
    #[arg(long, default_value = "365d")]
    pub expires_in: String,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The coordinator config file.
    #[arg(long, required_unless_present = "print_default_config")]
    pub config: Option<PathBuf>,
    /// Run an embedded broker on this address (overrides the config).
    #[arg(long)]
    pub embedded_broker: Option<String>,
    /// Print the commented default config and exit.
    #[arg(long)]
    pub print_default_config: bool,
}

#[derive(Debug, Subcommand)]
pub enum RolloutCmd {
    /// Create a rollout from a TOML spec file.
    Create {
        #[arg(long)]
        spec: PathBuf,
    },
    Start {
        name: String,
    },
    Pause {
        name: String,
    },
    Resume {
        name: String,
    },
    Stop {
        name: String,
    },
    /// Show one rollout, or all.
    Status {
        name: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Keys(#[from] KeysError),
    #[error(transparent)]
    Release(#[from] ReleaseError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Service(#[from] ServiceError),
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("--broker {value:?} is invalid: expected HOST:PORT like 127.0.0.1:1883")]
    BrokerAddr { value: String },
    #[error("--embedded-broker {value:?} is invalid: expected IP:PORT like 127.0.0.1:1883")]
    EmbeddedAddr { value: String },
    #[error("--expires-in {value:?} is invalid: {reason}")]
    ExpiresIn { value: String, reason: String },
    #[error("cannot read spec file {path}: {source}")]
    ReadSpec {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the coordinator's reply to {what} is not what this CLI expects: {source}")]
    Reply {
        what: &'static str,
        source: serde_json::Error,
    },
    #[error("`flotilla demo` is started by main (demo::run), not by cli::run")]
    DemoInRuntime,
}

/// Parses `HOST:PORT`.
pub fn parse_broker(value: &str) -> Result<(String, u16), CliError> {
    let err = || CliError::BrokerAddr {
        value: value.to_owned(),
    };
    let (host, port) = value.rsplit_once(':').ok_or_else(err)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port: u16 = port.parse().map_err(|_| err())?;
    if host.is_empty() || port == 0 {
        return Err(err());
    }
    Ok((host.to_owned(), port))
}

impl Cli {
    /// The default log filter: `info` for the long-running service, `warn` for one-shot commands.
    /// rumqttd is silenced by default because it logs ordinary client disconnects at ERROR,
    /// which would drown the coordinator's own messages; `RUST_LOG=rumqttd=info` brings it back.
    pub fn default_log_level(&self) -> &'static str {
        match self.command {
            Cmd::Serve(_) => "info,rumqttd=off",
            // The demo draws its own live view; the service's logs would tear it apart.
            _ => "warn,rumqttd=off",
        }
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn to_json<T: serde::Serialize>(value: &T) -> String {
    // The control types are plain structs of strings and numbers: serializing cannot fail.
    serde_json::to_string_pretty(value).unwrap_or_default()
}

/// Runs every command except `demo`; returns the exit code. `shutdown` stops `serve`.
pub async fn run(cli: Cli, shutdown: CancellationToken) -> Result<i32, CliError> {
    match cli.command {
        Cmd::Keygen(args) => {
            let names: Vec<String> = args.name.into_iter().collect();
            for written in keys::keygen(&args.out, &names, args.force)? {
                println!(
                    "wrote {} and {}",
                    written.secret.display(),
                    written.public.display()
                );
                println!("  public key {}", written.public_hex);
            }
            Ok(0)
        }
        Cmd::Release(cmd) => release(cmd),
        Cmd::Serve(args) => {
            if args.print_default_config {
                print!("{}", config::DEFAULT_CONFIG);
                return Ok(0);
            }
            let Some(path) = args.config else {
                return Ok(2);
            };
            let mut config = Config::load(&path)?;
            if let Some(addr) = args.embedded_broker {
                let parsed = addr.parse().map_err(|_| CliError::EmbeddedAddr {
                    value: addr.clone(),
                })?;
                config.broker.embedded = Some(parsed);
            }
            service::serve(config, shutdown).await?;
            Ok(0)
        }
        Cmd::Rollout(cmd) => {
            let (host, port) = parse_broker(&cli.broker)?;
            let client = ControlClient::connect(&host, port, &cli.topic_root).await?;
            rollout(&client, cmd).await
        }
        Cmd::Devices { json } => {
            let (host, port) = parse_broker(&cli.broker)?;
            let client = ControlClient::connect(&host, port, &cli.topic_root).await?;
            let result = client
                .request(Command::ListDevices, crate::client::DEFAULT_TIMEOUT)
                .await?;
            let devices: Vec<DeviceSummary> =
                serde_json::from_value(result).map_err(|source| CliError::Reply {
                    what: "list_devices",
                    source,
                })?;
            if json {
                println!("{}", to_json(&devices));
            } else {
                print!("{}", view::devices_table(&devices));
            }
            Ok(0)
        }
        Cmd::Demo(_) => Err(CliError::DemoInRuntime),
        Cmd::Plan(args) => Ok(crate::fleetfile::run_plan(&args)),
        Cmd::Simulate(args) => Ok(crate::simulate::run_simulate(&args)),
    }
}

fn release(cmd: ReleaseCmd) -> Result<i32, CliError> {
    match cmd {
        ReleaseCmd::Create(args) => {
            let expires_in =
                config::parse_duration(&args.expires_in).map_err(|reason| CliError::ExpiresIn {
                    value: args.expires_in.clone(),
                    reason,
                })?;
            let key = keys::load_secret_key(&args.key)?;
            let store = ReleaseStore::new(&args.data_dir);
            let new = NewRelease {
                name: args.name,
                version: args.version,
                counter: args.counter,
                hardware: args.hardware,
                artifacts: args.artifact,
                expires_in,
            };
            let manifest = store.create(&new, &key, now())?;
            println!("created {}", store.release_path(&manifest.name).display());
            print!(
                "{}",
                releases::render_manifest(&manifest, &key.verifying_key().to_bytes())
            );
            Ok(0)
        }
        ReleaseCmd::Inspect {
            data_dir,
            name,
            file,
            json,
        } => {
            let (blob, manifest) = match (file, data_dir, name) {
                (Some(file), _, _) => releases::read_release_file(&file)?,
                (None, Some(dir), Some(name)) => ReleaseStore::new(dir).load(&name)?,
                // clap's required_unless_present rules make this unreachable; exit as usage error.
                _ => return Ok(2),
            };
            if json {
                println!("{}", to_json(&releases::summary(&manifest)));
            } else {
                print!("{}", releases::render_manifest(&manifest, &blob.signer));
            }
            Ok(0)
        }
        ReleaseCmd::Verify {
            data_dir,
            key,
            name,
        } => {
            let key = keys::load_public_key(&key)?;
            let store = ReleaseStore::new(&data_dir);
            // Validates the name before it becomes a path.
            store.load(&name)?;
            let manifest = store.verify(&store.release_path(&name), &key)?;
            println!(
                "release {} verified: signature ok, {} artifact(s) present with the declared size and sha256",
                manifest.name,
                manifest.artifacts.len()
            );
            Ok(0)
        }
        ReleaseCmd::List { data_dir, json } => {
            let summaries: Vec<ReleaseSummary> = ReleaseStore::new(&data_dir).summaries()?;
            if json {
                println!("{}", to_json(&summaries));
            } else if summaries.is_empty() {
                println!("no releases in {}", data_dir.display());
            } else {
                println!(
                    "{:24}  {:12}  {:>8}  HARDWARE",
                    "RELEASE", "VERSION", "COUNTER"
                );
                for s in &summaries {
                    let hw = if s.hardware.is_empty() {
                        "any".to_owned()
                    } else {
                        s.hardware.join(",")
                    };
                    println!("{:24}  {:12}  {:>8}  {hw}", s.name, s.version, s.counter);
                }
            }
            Ok(0)
        }
    }
}

async fn rollout(client: &ControlClient, cmd: RolloutCmd) -> Result<i32, CliError> {
    let timeout: Duration = crate::client::DEFAULT_TIMEOUT;
    let (command, json) = match cmd {
        RolloutCmd::Create { spec } => {
            let text = std::fs::read_to_string(&spec).map_err(|source| CliError::ReadSpec {
                path: spec.clone(),
                source,
            })?;
            (Command::CreateRollout { spec: text }, false)
        }
        RolloutCmd::Start { name } => (Command::StartRollout { rollout: name }, false),
        RolloutCmd::Pause { name } => (Command::PauseRollout { rollout: name }, false),
        RolloutCmd::Resume { name } => (Command::ResumeRollout { rollout: name }, false),
        RolloutCmd::Stop { name } => (Command::StopRollout { rollout: name }, false),
        RolloutCmd::Status { name, json } => (Command::RolloutStatus { rollout: name }, json),
    };
    let result = client.request(command, timeout).await?;
    if json {
        println!("{}", to_json(&result));
        return Ok(0);
    }
    print!("{}", render_statuses(result)?);
    Ok(0)
}

/// Renders a reply that is one rollout status or a list of them.
pub fn render_statuses(result: serde_json::Value) -> Result<String, CliError> {
    if result.is_array() {
        let statuses: Vec<RolloutStatus> =
            serde_json::from_value(result).map_err(|source| CliError::Reply {
                what: "rollout status",
                source,
            })?;
        Ok(view::rollout_statuses(&statuses))
    } else {
        let status: RolloutStatus =
            serde_json::from_value(result).map_err(|source| CliError::Reply {
                what: "rollout status",
                source,
            })?;
        Ok(view::rollout_status(&status))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_addresses() {
        assert_eq!(
            parse_broker("127.0.0.1:1883").expect("ok"),
            ("127.0.0.1".to_owned(), 1883)
        );
        assert_eq!(
            parse_broker("mqtt.example.com:8883").expect("ok").0,
            "mqtt.example.com"
        );
        assert_eq!(parse_broker("[::1]:1883").expect("ok").0, "::1");
        for bad in ["nohost", ":1883", "host:", "host:99999", "host:0"] {
            let err = parse_broker(bad).expect_err(bad);
            assert!(err.to_string().contains(bad), "{err}");
        }
    }

    #[test]
    fn command_line_parses() {
        let cli = Cli::try_parse_from([
            "flotilla",
            "release",
            "create",
            "--data-dir",
            "d",
            "--key",
            "k",
            "--name",
            "fw",
            "--version",
            "1",
            "--counter",
            "3",
            "--hardware",
            "pi4",
            "--hardware",
            "pi5",
            "--artifact",
            "app=a.bin",
        ])
        .expect("parses");
        match cli.command {
            Cmd::Release(ReleaseCmd::Create(args)) => {
                assert_eq!(args.hardware, vec!["pi4", "pi5"]);
                assert_eq!(args.expires_in, "365d");
            }
            other => panic!("parsed as {other:?}"),
        }
        let cli =
            Cli::try_parse_from(["flotilla", "--broker", "h:1", "rollout", "status", "--json"])
                .expect("parses");
        assert_eq!(cli.broker, "h:1");
        assert!(cli.default_log_level().starts_with("warn"));
        assert!(
            Cli::try_parse_from(["flotilla", "serve"]).is_err(),
            "serve needs --config"
        );
        assert!(Cli::try_parse_from(["flotilla", "serve", "--print-default-config"]).is_ok());
    }

    async fn run_args(args: &[&str]) -> Result<i32, CliError> {
        let cli = Cli::try_parse_from(args).expect("parses");
        run(cli, CancellationToken::new()).await
    }

    #[tokio::test]
    async fn keygen_release_create_and_verify_through_the_cli() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = |name: &str| dir.path().join(name).display().to_string();
        std::fs::write(p("app.bin"), b"payload").expect("write");
        assert_eq!(
            run_args(&["flotilla", "keygen", "--out", &p("keys")])
                .await
                .expect("keygen"),
            0
        );
        let err = run_args(&["flotilla", "keygen", "--out", &p("keys")])
            .await
            .expect_err("no overwrite");
        assert!(err.to_string().contains("release.key"), "{err}");
        let artifact = format!("app={}", p("app.bin"));
        let create = [
            "flotilla",
            "release",
            "create",
            "--data-dir",
            &p("data"),
            "--key",
            &p("keys/release.key"),
            "--name",
            "fw-1",
            "--version",
            "1.0.0",
            "--counter",
            "1",
            "--artifact",
            &artifact,
        ];
        assert_eq!(run_args(&create).await.expect("create"), 0);
        let verify = [
            "flotilla",
            "release",
            "verify",
            "--data-dir",
            &p("data"),
            "--key",
            &p("keys/release.pub"),
            "fw-1",
        ];
        assert_eq!(run_args(&verify).await.expect("verifies"), 0);
        let wrong = [
            "flotilla",
            "release",
            "verify",
            "--data-dir",
            &p("data"),
            "--key",
            &p("keys/coordinator.pub"),
            "fw-1",
        ];
        let err = run_args(&wrong).await.expect_err("wrong key");
        assert!(err.to_string().contains("unknown key"), "{err}");
        let err = run_args(&[
            "flotilla",
            "release",
            "inspect",
            "--data-dir",
            &p("data"),
            "fw-9",
        ])
        .await
        .expect_err("missing");
        assert!(err.to_string().contains("fw-9"), "{err}");
    }
}
