//! What each `flotilla` subcommand does (the arguments are in [`args`](super::args)).
//!
//! `main.rs` only parses, sets up logging and signals, and calls [`run`] (or the demo, which
//! manages its own runtime). Commands that talk to a running coordinator go through
//! [`ControlClient`]; `keygen` and `release …` work on files and need no coordinator, so they
//! can run on an offline signing machine.

use std::path::{Path, PathBuf};
use std::time::Duration;

use flotilla_mqtt::{Connection, ConnectionSpec, RawTls, PASSWORD_ENV};
use flotilla_protocol::control::{
    ApprovalStatus, Command, CoordinatorsInfo, DeviceGroupInfo, EnrollmentInfo, ReleaseSummary,
    RolloutStatus, StrategyInfo,
};
use tokio_util::sync::CancellationToken;

use crate::cli::args::{
    BrokerAuth, Cli, Cmd, DevicesCmd, GroupCmd, KeysCmd, OperatorCmd, ReleaseCmd, RolloutCmd,
    StrategyCmd, DEFAULT_BROKER, GLOBAL_SETTINGS,
};
use crate::cli::client::{ClientError, ControlClient, DEFAULT_TIMEOUT};
use crate::cli::out::{out, outln};
use crate::cli::view;
use crate::service::config::{self, BrokerOverrides, Config, ConfigError, Given};
use crate::service::keys::{self, KeysError};
use crate::service::origins;
use crate::service::release_types;
use crate::service::releases::{self, NewRelease, ReleaseError, ReleaseStore};
use crate::service::{self, ServiceError};

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Keys(#[from] KeysError),
    #[error(transparent)]
    Release(#[from] ReleaseError),
    #[error(transparent)]
    Origins(#[from] crate::service::origins::OriginsError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Service(#[from] Box<ServiceError>),
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Accept(#[from] crate::cli::accept::AcceptError),
    #[error(transparent)]
    Sign(#[from] crate::cli::sign::SignError),
    #[error("{setting} {value:?} is invalid: expected HOST:PORT like 127.0.0.1:1883, or several separated by commas")]
    BrokerAddr {
        /// `--broker` or `FLOTILLA_BROKER`.
        setting: &'static str,
        value: String,
    },
    #[error("{flag} {value:?} is invalid: {reason}")]
    BrokerAuth {
        flag: &'static str,
        value: String,
        reason: String,
    },
    #[error("--embedded-broker {value:?} is invalid: expected IP:PORT like 127.0.0.1:1883")]
    EmbeddedAddr { value: String },
    #[error("--expires-in {value:?} is invalid: {reason}")]
    ExpiresIn { value: String, reason: String },
    #[error("cannot read spec file {path}: {source}")]
    ReadSpec {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read strategy file {path}: {source}")]
    ReadStrategy {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the coordinator's reply to {what} is not what this CLI expects: {source}")]
    Reply {
        what: &'static str,
        source: serde_json::Error,
    },
    #[error(transparent)]
    Store(#[from] crate::cli::store::StoreCmdError),
    #[error("`flotilla demo` is started by main (demo::run), not by cli::run")]
    DemoInRuntime,
    #[error("{flag} is not used by `flotilla serve`: it signs requests to a coordinator (`serve` ignores FLOTILLA_OPERATOR_KEY)")]
    NotForServe { flag: &'static str },
    #[error("no operator key: requests to the coordinator must be signed; pass --operator-key FILE or set FLOTILLA_OPERATOR_KEY (make a key with `flotilla operator keygen --out DIR --name NAME` and list NAME.pub under [[operators]] in the coordinator's config)")]
    NoOperatorKey,
}

/// Parses `HOST:PORT`, or a list of them separated by commas (brokers of one cluster).
pub fn parse_broker(value: &str) -> Result<Vec<(String, u16)>, CliError> {
    parse_broker_from(value, "--broker")
}

/// Parses `HOST:PORT[,HOST:PORT...]` given as `setting` (`--broker` or `FLOTILLA_BROKER`).
fn parse_broker_from(value: &str, setting: &'static str) -> Result<Vec<(String, u16)>, CliError> {
    let err = || CliError::BrokerAddr {
        setting,
        value: value.to_owned(),
    };
    value
        .split(',')
        .map(|one| flotilla_mqtt::parse_host_port(one).map_err(|_| err()))
        .collect()
}

/// Where and how the CLI connects: the global broker flags, kept apart from the subcommand.
#[derive(Debug, Clone)]
struct BrokerTarget {
    broker: Option<String>,
    topic_root: Option<String>,
    auth: BrokerAuth,
    /// The operator's secret key file, which signs every request.
    operator_key: Option<PathBuf>,
    /// Names each global setting by where its value came from (flag or variable).
    origin: Origins,
}

/// Which global settings came from the environment (`Cli::from_env`).
#[derive(Debug, Clone)]
struct Origins(Vec<&'static str>);

impl Origins {
    fn came_from_env(&self, id: &str) -> bool {
        self.0.contains(&id)
    }

    /// The flag, or the environment variable when the value came from there.
    fn of(&self, id: &str) -> &'static str {
        let Some((id, flag, env)) = GLOBAL_SETTINGS.iter().find(|(i, _, _)| *i == id) else {
            return "a setting";
        };
        if self.came_from_env(id) {
            env
        } else {
            flag
        }
    }

    /// `value`, named by where it came from.
    fn given<T>(&self, id: &str, value: Option<T>) -> Option<Given<T>> {
        value.map(|value| Given {
            value,
            from: self.of(id),
        })
    }
}

/// Builds the validated connection from `--broker` and the login flags; errors name the flag.
pub fn connection(broker: &str, auth: &BrokerAuth) -> Result<Connection, CliError> {
    connection_from(broker, auth, &Origins(Vec::new()))
}

/// [`connection`], naming each setting by where it came from (flag or environment variable).
fn connection_from(
    broker: &str,
    auth: &BrokerAuth,
    origin: &Origins,
) -> Result<Connection, CliError> {
    let mut brokers = parse_broker_from(broker, origin.of("broker"))?;
    let (host, port) = brokers.remove(0);
    let tls = (auth.tls
        || auth.ca_file.is_some()
        || auth.client_cert.is_some()
        || auth.client_key.is_some())
    .then(|| RawTls {
        ca_file: auth.ca_file.clone(),
        client_cert: auth.client_cert.clone(),
        client_key: auth.client_key.clone(),
    });
    let spec = ConnectionSpec {
        host,
        port,
        alternates: brokers,
        order: flotilla_mqtt::BrokerOrder::InOrder,
        username: auth.username.clone(),
        password_file: auth.password_file.clone(),
        // Only looked at when there is a username and no password file.
        password_env: (auth.username.is_some() && auth.password_file.is_none())
            .then(|| PASSWORD_ENV.to_owned()),
        tls,
    };
    spec.validate(Path::new("."), &|name| std::env::var(name).ok())
        .map_err(|e| CliError::BrokerAuth {
            flag: match e.field {
                "username" => origin.of("username"),
                "password_file" => origin.of("password_file"),
                "password_env" => PASSWORD_ENV,
                "tls.ca_file" => origin.of("ca_file"),
                "tls.client_cert" => origin.of("client_cert"),
                "tls.client_key" => origin.of("client_key"),
                "host" | "port" => origin.of("broker"),
                _ => origin.of("tls"),
            },
            value: e.value,
            reason: e.reason,
        })
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

use crate::cli::json::to_json;

/// Runs every command except `demo`; returns the exit code. `shutdown` stops `serve`.
pub async fn run(cli: Cli, shutdown: CancellationToken) -> Result<i32, CliError> {
    let target = BrokerTarget {
        broker: cli.broker.clone(),
        topic_root: cli.topic_root.clone(),
        auth: cli.auth.clone(),
        operator_key: cli.operator_key.clone(),
        origin: Origins(cli.from_env.clone()),
    };
    match cli.command {
        Cmd::Enrollment(crate::cli::args::EnrollmentCmd::Token { count }) => {
            for _ in 0..count {
                outln!("{}", crate::service::enrollment::new_token());
            }
            eprintln!(
                "list each token in the coordinator's [enrollment] tokens and give it to one \
                 agent as enrollment_token; it enrolls one device, once"
            );
            Ok(0)
        }
        Cmd::Operator(OperatorCmd::Sign { command }) => {
            let key = target
                .operator_key
                .as_deref()
                .ok_or(CliError::NoOperatorKey)?;
            let root = target
                .topic_root
                .as_deref()
                .unwrap_or(flotilla_protocol::topics::DEFAULT_ROOT);
            outln!("{}", crate::cli::sign::sign(key, root, &command, now())?);
            Ok(0)
        }
        Cmd::Operator(OperatorCmd::Keygen { out, name, force }) => {
            let written = keys::keygen(&out, std::slice::from_ref(&name), force)?;
            for w in &written {
                outln!(
                    "wrote {} (secret, keep it with {name}) and {}",
                    w.secret.display(),
                    w.public.display()
                );
                outln!("  add to the coordinator's config (role: viewer, operator or admin):");
                outln!(
                    "  [[operators]]\n  name = {name:?}\n  role = \"operator\"\n  key = {:?}",
                    w.public_hex
                );
                outln!(
                    "  then: flotilla --operator-key {} rollout status",
                    w.secret.display()
                );
            }
            Ok(0)
        }
        Cmd::Keys(KeysCmd::Rotate {
            version,
            release_keys,
            coordinator_keys,
            root_keys,
            root_threshold,
            signers,
            out,
        }) => {
            let rotation = keys::Rotation {
                version,
                release_keys,
                coordinator_keys,
                root_keys,
                root_threshold,
                signers,
            };
            let signed = keys::rotate(&rotation, &out)?;
            outln!(
                "wrote keys document version {version} to {} with {signed} root signature(s)",
                out.display()
            );
            outln!("  devices accept it with: flotilla-agent keys install --config CONFIG FILE");
            Ok(0)
        }
        Cmd::Keys(KeysCmd::Sign { key, file }) => {
            let count = keys::cosign(&file, &key)?;
            outln!("{} now has {count} signature(s)", file.display());
            Ok(0)
        }
        Cmd::Keygen(args) => {
            let names: Vec<String> = args.name.into_iter().collect();
            for written in keys::keygen(&args.out, &names, args.force)? {
                outln!(
                    "wrote {} and {}",
                    written.secret.display(),
                    written.public.display()
                );
                outln!("  public key {}", written.public_hex);
            }
            Ok(0)
        }
        Cmd::Release(cmd) => release(cmd),
        Cmd::Serve(args) => {
            if args.print_default_config {
                out!("{}", config::DEFAULT_CONFIG);
                return Ok(0);
            }
            let Some(path) = &args.config else {
                return Ok(2);
            };
            // The variable may be set for the other commands; the flag is a mistake worth saying.
            if target.operator_key.is_some() && !target.origin.came_from_env("operator_key") {
                return Err(CliError::NotForServe {
                    flag: "--operator-key",
                });
            }
            let mut overrides = serve_overrides(&target, args.embedded_broker.as_deref())?;
            overrides.insecure_embedded = args.insecure_embedded_broker.then_some(Given {
                value: (),
                from: "--insecure-embedded-broker",
            });
            let config = Config::load_with(path, &overrides)?;
            tracing::info!(
                config = %path.display(),
                broker = %config.broker_addr(),
                topic_root = %config.broker.topic_root,
                embedded = config.broker.embedded.is_some(),
                "broker settings (command line > environment > config file)"
            );
            service::serve(config, shutdown).await.map_err(Box::new)?;
            Ok(0)
        }
        Cmd::Rollout(cmd) => {
            let client = connect(&target).await?;
            rollout(&client, cmd, &shutdown).await
        }
        Cmd::Devices {
            cmd: Some(DevicesCmd::Delete { id }),
            ..
        } => {
            let client = connect(&target).await?;
            client
                .request(
                    Command::DeleteDevice { device: id.clone() },
                    crate::cli::client::DEFAULT_TIMEOUT,
                )
                .await?;
            outln!("deleted device {id}; its retained state is cleared and its desired action replaced by a signed \"nothing to do\"");
            Ok(0)
        }
        Cmd::Devices {
            json,
            page,
            limit: _,
            cmd:
                Some(
                    cmd @ (DevicesCmd::Pending
                    | DevicesCmd::Accept { .. }
                    | DevicesCmd::Reject { .. }
                    | DevicesCmd::Revoke { .. }),
                ),
        } => {
            let client = connect(&target).await?;
            if matches!(cmd, DevicesCmd::Pending) {
                // Filters it has nothing to apply to are refused by the coordinator, named.
                let list = client
                    .pending_devices(page.query(), DEFAULT_TIMEOUT)
                    .await?;
                if json {
                    outln!("{}", to_json(&list));
                } else {
                    out!("{}", view::enrollments_table(&list));
                }
                return Ok(0);
            }
            let (command, what) = match cmd {
                DevicesCmd::Pending => unreachable!("answered above"),
                DevicesCmd::Accept { id, key } => {
                    let key = crate::cli::accept::key_to_pin(&client, &id, key).await?;
                    let key = Some(key);
                    (Command::AcceptDevice { device: id, key }, "accept_device")
                }
                DevicesCmd::Reject { id, key } => {
                    (Command::RejectDevice { device: id, key }, "reject_device")
                }
                DevicesCmd::Revoke { id } => {
                    (Command::RevokeDevice { device: id }, "revoke_device")
                }
                DevicesCmd::Delete { .. } => unreachable!("matched above"),
            };
            let result = client
                .request(command, crate::cli::client::DEFAULT_TIMEOUT)
                .await?;
            if json {
                outln!("{}", to_json(&result));
            } else {
                let info: EnrollmentInfo = serde_json::from_value(result)
                    .map_err(|source| CliError::Reply { what, source })?;
                let key = info.new_key.as_deref().unwrap_or(&info.key);
                outln!("device {} is {} (key {key})", info.device, info.status);
            }
            Ok(0)
        }
        Cmd::Devices {
            json,
            page,
            limit,
            cmd: None,
        } => {
            let client = connect(&target).await?;
            let devices = client
                .list_devices(page.query(), limit, DEFAULT_TIMEOUT)
                .await?;
            if json {
                outln!("{}", to_json(&devices));
            } else {
                out!("{}", view::devices_table(&devices));
            }
            Ok(0)
        }
        Cmd::Approve { name } => {
            let client = connect(&target).await?;
            client
                .request(
                    Command::Approve { name: name.clone() },
                    crate::cli::client::DEFAULT_TIMEOUT,
                )
                .await?;
            outln!("approved {name}");
            Ok(0)
        }
        Cmd::Deny { name, reason } => {
            let client = connect(&target).await?;
            client
                .request(
                    Command::Deny {
                        name: name.clone(),
                        reason,
                    },
                    crate::cli::client::DEFAULT_TIMEOUT,
                )
                .await?;
            outln!("denied {name}; its rollout is stopped");
            Ok(0)
        }
        Cmd::Approvals { json } => {
            let client = connect(&target).await?;
            let command = |page| Command::ListApprovals { page };
            let approvals: Vec<ApprovalStatus> = client
                .all_pages("list_approvals", command, DEFAULT_TIMEOUT)
                .await?;
            if json {
                outln!("{}", to_json(&approvals));
            } else {
                out!("{}", view::approvals_table(&approvals));
            }
            Ok(0)
        }
        Cmd::Status { json } => {
            let client = connect(&target).await?;
            let result = client
                .request(Command::Coordinators, DEFAULT_TIMEOUT)
                .await?;
            let info: CoordinatorsInfo =
                serde_json::from_value(result).map_err(|source| CliError::Reply {
                    what: "coordinators",
                    source,
                })?;
            if json {
                outln!("{}", to_json(&info));
            } else {
                out!("{}", view::coordinators(&info));
            }
            Ok(0)
        }
        Cmd::Strategy(cmd) => strategy(&target, cmd).await,
        Cmd::Group(cmd) => {
            let client = connect(&target).await?;
            group(&client, cmd).await
        }
        Cmd::Demo(_) => Err(CliError::DemoInRuntime),
        Cmd::Plan(args) => Ok(crate::cli::fleetfile::run_plan(&args)),
        Cmd::Completions { shell } => {
            crate::cli::generate::print(&crate::cli::generate::completions(shell));
            Ok(0)
        }
        Cmd::Man => {
            crate::cli::generate::print(&crate::cli::generate::man());
            Ok(0)
        }
        Cmd::Simulate(args) => Ok(crate::cli::simulate::run_simulate(&args)),
        Cmd::Backup(args) => {
            let info = match crate::cli::store::backup_offline(&args, now())? {
                Some(info) => info,
                None => {
                    let client = connect(&target).await?;
                    let result = client.request(Command::Backup, DEFAULT_TIMEOUT).await?;
                    serde_json::from_value(result).map_err(|source| CliError::Reply {
                        what: "backup",
                        source,
                    })?
                }
            };
            if args.json {
                outln!("{}", to_json(&info));
            } else {
                out!("{}", crate::cli::store::describe_backup(&info));
            }
            Ok(0)
        }
        Cmd::Restore(args) => Ok(crate::cli::store::restore(&args, now())?),
        Cmd::Store(cmd) => Ok(crate::cli::store::store(&cmd)?),
    }
}

/// The broker settings `serve` was given on its command line or in the environment; each
/// replaces the config file's (flag > variable > config file > default, `SERVE_PRECEDENCE`).
fn serve_overrides(
    target: &BrokerTarget,
    embedded_broker: Option<&str>,
) -> Result<BrokerOverrides, CliError> {
    let origin = &target.origin;
    let addr = match &target.broker {
        Some(value) => Some(parse_broker_from(value, origin.of("broker"))?),
        None => None,
    };
    let embedded = match embedded_broker {
        Some(value) => Some(Given {
            value: value.parse().map_err(|_| CliError::EmbeddedAddr {
                value: value.to_owned(),
            })?,
            from: "--embedded-broker",
        }),
        None => None,
    };
    let auth = target.auth.clone();
    // The login variables are the CLI's (an operator exports them for `flotilla rollout …`): a
    // coordinator started from the same shell must not log in as the operator, whom the
    // broker's ACL keeps off the device topics. Its login comes from a flag or its config file.
    let login = |id: &'static str| {
        let ignored = origin.came_from_env(id);
        if ignored {
            tracing::info!(
                "ignoring {}: it is the CLI's broker login; `serve` takes its own from {} or the \
                 config file",
                origin.of(id),
                GLOBAL_SETTINGS
                    .iter()
                    .find(|(i, _, _)| *i == id)
                    .map_or("a flag", |(_, flag, _)| *flag)
            );
        }
        !ignored
    };
    let username = auth.username.filter(|_| login("username"));
    let password_file = auth.password_file.filter(|_| login("password_file"));
    Ok(BrokerOverrides {
        addr: origin.given("broker", addr),
        topic_root: origin.given("topic_root", target.topic_root.clone()),
        embedded,
        insecure_embedded: None,
        username: origin.given("username", username),
        password_file: origin.given("password_file", password_file),
        tls: origin.given("tls", auth.tls.then_some(())),
        ca_file: origin.given("ca_file", auth.ca_file),
        client_cert: origin.given("client_cert", auth.client_cert),
        client_key: origin.given("client_key", auth.client_key),
    })
}

/// Loads the operator key (a clear error without one) and connects the control client.
async fn connect(target: &BrokerTarget) -> Result<ControlClient, CliError> {
    let key = keys::load_secret_key(
        target
            .operator_key
            .as_deref()
            .ok_or(CliError::NoOperatorKey)?,
    )?;
    let broker = target.broker.as_deref().unwrap_or(DEFAULT_BROKER);
    let connection = connection_from(broker, &target.auth, &target.origin)?;
    let root = target
        .topic_root
        .as_deref()
        .unwrap_or(flotilla_protocol::topics::DEFAULT_ROOT);
    Ok(ControlClient::connect_with(connection, root, key, DEFAULT_TIMEOUT).await?)
}

/// `strategy …`; the file is read before connecting, so a wrong path fails at once.
async fn strategy(target: &BrokerTarget, cmd: StrategyCmd) -> Result<i32, CliError> {
    let timeout = crate::cli::client::DEFAULT_TIMEOUT;
    let reply = |what: &'static str| move |source| CliError::Reply { what, source };
    let file = match &cmd {
        StrategyCmd::Create { file, .. } => Some(std::fs::read_to_string(file).map_err(
            |source| CliError::ReadStrategy {
                path: file.clone(),
                source,
            },
        )?),
        _ => None,
    };
    let client = connect(target).await?;
    match cmd {
        StrategyCmd::Create { name, .. } => {
            let spec = file.unwrap_or_default();
            client
                .request(
                    Command::CreateStrategy {
                        name: name.clone(),
                        spec,
                    },
                    timeout,
                )
                .await?;
            outln!("stored strategy {name}");
        }
        StrategyCmd::List { json } => {
            let command = |page| Command::ListStrategies { page };
            let all: Vec<StrategyInfo> = client
                .all_pages("list_strategies", command, timeout)
                .await?;
            if json {
                outln!("{}", to_json(&all));
            } else {
                out!("{}", view::strategies_list(&all));
            }
        }
        StrategyCmd::Show { name, json } => {
            let result = client
                .request(Command::ShowStrategy { name }, timeout)
                .await?;
            let info: StrategyInfo =
                serde_json::from_value(result).map_err(reply("show_strategy"))?;
            if json {
                outln!("{}", to_json(&info));
            } else {
                out!("{}", info.spec);
                if !info.spec.ends_with('\n') {
                    outln!();
                }
            }
        }
    }
    Ok(0)
}

async fn group(client: &ControlClient, cmd: GroupCmd) -> Result<i32, CliError> {
    let timeout = crate::cli::client::DEFAULT_TIMEOUT;
    let reply = |what: &'static str| move |source| CliError::Reply { what, source };
    match cmd {
        GroupCmd::Create {
            name,
            select,
            labels,
        } => {
            let command = Command::CreateGroup {
                name,
                select,
                labels: labels.into_iter().collect(),
            };
            let result = client.request(command, timeout).await?;
            let info: DeviceGroupInfo =
                serde_json::from_value(result).map_err(reply("create_group"))?;
            outln!("stored device group {}  select {}", info.name, info.select);
        }
        GroupCmd::List { json } => {
            let command = |page| Command::ListGroups { page };
            let all: Vec<DeviceGroupInfo> =
                client.all_pages("list_groups", command, timeout).await?;
            if json {
                outln!("{}", to_json(&all));
            } else {
                out!("{}", view::groups_table(&all));
            }
        }
        GroupCmd::Delete { name } => {
            client
                .request(Command::DeleteGroup { name: name.clone() }, timeout)
                .await?;
            outln!("deleted device group {name}");
        }
    }
    Ok(0)
}

fn release(cmd: ReleaseCmd) -> Result<i32, CliError> {
    match cmd {
        ReleaseCmd::Create(args) => {
            let expires_in =
                flotilla_rollout::duration::parse_duration(&args.expires_in).map_err(|reason| {
                    CliError::ExpiresIn {
                        value: args.expires_in.clone(),
                        reason,
                    }
                })?;
            let key = keys::load_secret_key(&args.key)?;
            let store = ReleaseStore::new(&args.data_dir);
            // Locations are checked before anything is written: a release name is never reused.
            for value in &args.url {
                let url = value.split_once('=').map(|(_, url)| url);
                let url = url.ok_or_else(|| origins::OriginsError::Spec {
                    value: value.clone(),
                })?;
                flotilla_protocol::origin::OriginUrl::parse(url).map_err(|source| {
                    origins::OriginsError::Url {
                        release: args.name.clone(),
                        source,
                    }
                })?;
            }
            let new = NewRelease {
                name: args.name,
                version: args.version,
                counter: args.counter,
                hardware: args.hardware,
                artifacts: args.artifact,
                artifact_types: args.artifact_type,
                expires_in,
                block_size: (!args.no_blocks).then_some(args.block_size),
            };
            let manifest = store.create(&new, &key, now())?;
            if !args.url.is_empty() {
                let located = origins::parse_specs(&manifest, &args.url)?;
                origins::write(&store, &manifest.release.name, &located)?;
            }
            for line in releases::block_list_overheads(&manifest) {
                eprintln!("warning: {line}");
            }
            for line in release_types::untyped_lookalikes(&manifest, |d| store.artifact_path(d)) {
                eprintln!("hint: {line}");
            }
            outln!(
                "created {}",
                store.release_path(&manifest.release.name).display()
            );
            out!(
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
                (None, Some(dir), Some(name)) => ReleaseStore::new(dir).load_manifest(&name)?,
                // clap's required_unless_present rules make this unreachable; exit as usage error.
                _ => return Ok(2),
            };
            if json {
                outln!("{}", to_json(&releases::summary(&manifest)));
            } else {
                out!("{}", releases::render_manifest(&manifest, &blob.signer));
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
            outln!(
                "release {} verified: signature ok, {} artifact(s) present with the declared size and sha256{}",
                manifest.release.name,
                manifest.release.artifacts.len(),
                if manifest.blocks.is_some() { ", block lists match" } else { "" }
            );
            Ok(0)
        }
        ReleaseCmd::Locate {
            data_dir,
            name,
            target,
            url,
            remove,
        } => {
            let store = ReleaseStore::new(&data_dir);
            let url = if remove { None } else { url };
            origins::set(&store, &name, &target, url.as_deref())?;
            match url {
                Some(url) => outln!("release {name}: target {target} located at {url}"),
                None => outln!("release {name}: target {target} has no HTTP location"),
            }
            Ok(0)
        }
        ReleaseCmd::List { data_dir, json } => {
            let manifests = ReleaseStore::new(&data_dir).manifests()?;
            if json {
                let summaries: Vec<ReleaseSummary> =
                    manifests.iter().map(releases::summary).collect();
                outln!("{}", to_json(&summaries));
            } else if manifests.is_empty() {
                outln!("no releases in {}", data_dir.display());
            } else {
                outln!(
                    "{:24}  {:12}  {:>8}  {:>7}  HARDWARE",
                    "RELEASE",
                    "VERSION",
                    "COUNTER",
                    "BLOCKS"
                );
                for m in &manifests {
                    let s = &m.release;
                    let hw = if s.hardware.is_empty() {
                        "any".to_owned()
                    } else {
                        s.hardware.join(",")
                    };
                    outln!(
                        "{:24}  {:12}  {:>8}  {:>7}  {hw}",
                        s.name,
                        s.version,
                        s.counter,
                        releases::block_size_label(m)
                    );
                }
            }
            Ok(0)
        }
    }
}

async fn rollout(
    client: &ControlClient,
    cmd: RolloutCmd,
    shutdown: &CancellationToken,
) -> Result<i32, CliError> {
    let timeout: Duration = crate::cli::client::DEFAULT_TIMEOUT;
    let (command, json) = match cmd {
        RolloutCmd::Create { spec } => {
            let text = std::fs::read_to_string(&spec).map_err(|source| CliError::ReadSpec {
                path: spec.clone(),
                source,
            })?;
            (Command::CreateRollout { spec: text }, false)
        }
        RolloutCmd::Start { name, wait: true } => {
            client
                .request(
                    Command::StartRollout {
                        rollout: name.clone(),
                    },
                    timeout,
                )
                .await?;
            // The watch's first drawing shows the rollout as the start left it.
            return Ok(
                crate::cli::watch::watch(client, &name, Default::default(), shutdown).await?,
            );
        }
        RolloutCmd::Start { name, wait: false } => (Command::StartRollout { rollout: name }, false),
        RolloutCmd::Pause { name } => (Command::PauseRollout { rollout: name }, false),
        RolloutCmd::Resume { name } => (Command::ResumeRollout { rollout: name }, false),
        RolloutCmd::Stop { name } => (Command::StopRollout { rollout: name }, false),
        RolloutCmd::Delete { name } => {
            client
                .request(
                    Command::DeleteRollout {
                        rollout: name.clone(),
                    },
                    timeout,
                )
                .await?;
            outln!("deleted rollout {name}");
            return Ok(0);
        }
        RolloutCmd::Status {
            name: Some(name),
            watch: true,
            page,
            ..
        } => return Ok(crate::cli::watch::watch(client, &name, page.query(), shutdown).await?),
        RolloutCmd::List { json } => {
            let all = client
                .rollout_summaries(Default::default(), timeout)
                .await?;
            if json {
                outln!("{}", to_json(&all));
            } else {
                out!("{}", view::rollouts_table(&all));
            }
            return Ok(0);
        }
        RolloutCmd::Status {
            name, json, page, ..
        } => {
            let text = match name {
                Some(name) => {
                    let status = client.rollout_status(&name, page.query(), timeout).await?;
                    if json {
                        to_json(&status) + "\n"
                    } else {
                        view::rollout_status_in(&status, view::Paint::for_stdout())
                    }
                }
                None => {
                    // Every rollout's summary; per-device detail is `rollout status NAME`.
                    let all = client.rollout_summaries(page.query(), timeout).await?;
                    if json {
                        to_json(&all) + "\n"
                    } else {
                        view::rollouts_table(&all)
                    }
                }
            };
            out!("{text}");
            return Ok(0);
        }
        RolloutCmd::Next {
            name,
            skip_approval,
        } => (
            Command::TriggerNext {
                rollout: name,
                skip_approval,
            },
            false,
        ),
        RolloutCmd::Retry { rollout, name } => (Command::RetryRollout { rollout, name }, false),
    };
    let result = client.request(command, timeout).await?;
    if json {
        outln!("{}", to_json(&result));
        return Ok(0);
    }
    out!("{}", render_statuses(result)?);
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
    use clap::Parser as _;

    #[test]
    fn broker_addresses() {
        assert_eq!(
            parse_broker("127.0.0.1:1883").expect("ok"),
            [("127.0.0.1".to_owned(), 1883)]
        );
        assert_eq!(
            parse_broker("mqtt.example.com:8883").expect("ok")[0].0,
            "mqtt.example.com"
        );
        assert_eq!(parse_broker("[::1]:1883").expect("ok")[0].0, "::1");
        assert_eq!(
            parse_broker("a.example:1883,b.example:1884").expect("a list"),
            [
                ("a.example".to_owned(), 1883),
                ("b.example".to_owned(), 1884)
            ]
        );
        for bad in [
            "nohost",
            ":1883",
            "host:",
            "host:99999",
            "host:0",
            "a:1883,",
            "a:1883,b",
        ] {
            let err = parse_broker(bad).expect_err(bad);
            assert!(err.to_string().contains(bad), "{err}");
        }
    }

    #[test]
    fn login_flags_build_the_connection_and_errors_name_the_flag() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pw = dir.path().join("pw");
        std::fs::write(&pw, "op-secret\n").expect("write");
        let cli = Cli::try_parse_from([
            "flotilla",
            "--broker",
            "mqtt.example.com:8883",
            "--username",
            "flotilla-operator",
            "--password-file",
            &pw.to_string_lossy(),
            "rollout",
            "status",
        ])
        .expect("parses");
        let c = connection(cli.broker.as_deref().expect("given"), &cli.auth).expect("valid");
        let login = c.options("x").credentials().expect("login");
        assert_eq!(
            (login.username.as_str(), login.password.as_str()),
            ("flotilla-operator", "op-secret")
        );
        assert_eq!(c.tls, None, "no TLS flag, no TLS");

        let auth = |f: fn(&mut BrokerAuth)| {
            let mut a = BrokerAuth::default();
            f(&mut a);
            connection("h:8883", &a).expect_err("refused").to_string()
        };
        let text = auth(|a| {
            a.username = Some("u".into());
            a.password_file = Some("/nonexistent/pw".into());
        });
        assert!(
            text.starts_with("--password-file \"/nonexistent/pw\""),
            "{text}"
        );
        let text = auth(|a| a.ca_file = Some("/nonexistent/ca.crt".into()));
        assert!(
            text.starts_with("--ca-file \"/nonexistent/ca.crt\""),
            "{text}"
        );
        let text = auth(|a| a.client_cert = Some("/nonexistent/c.crt".into()));
        assert!(text.starts_with("--client-key"), "{text}");
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
        assert_eq!(cli.broker.as_deref(), Some("h:1"));
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
