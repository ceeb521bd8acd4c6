//! The `flotilla` command line's arguments: clap definitions of every subcommand and flag.
//!
//! What each subcommand does is in the `commands` module.

use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{Args, CommandFactory as _, FromArgMatches as _, Parser, Subcommand};

use crate::cli::demo;
use crate::cli::help_scope;

/// The broker the commands that talk to a coordinator use when neither `--broker` nor
/// FLOTILLA_BROKER names one.
pub const DEFAULT_BROKER: &str = "127.0.0.1:1883";

/// Staged, health-gated software rollouts to fleets of Linux edge devices.
#[derive(Debug, Parser)]
#[command(name = "flotilla", version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("FLOTILLA_BUILD"), ")"), about)]
pub struct Cli {
    /// The MQTT broker, as HOST:PORT [default: 127.0.0.1:1883; for `serve`, the config file's
    /// broker.host and broker.port].
    #[arg(long, global = true, env = "FLOTILLA_BROKER", value_name = "HOST:PORT")]
    pub broker: Option<String>,
    /// Root of every flotilla topic [default: flotilla; for `serve`, the config file's
    /// broker.topic_root].
    #[arg(long, global = true, env = "FLOTILLA_TOPIC_ROOT", value_name = "ROOT")]
    pub topic_root: Option<String>,
    /// The operator's secret key file; signs every request to the coordinator
    /// (`flotilla operator keygen` makes one). Not used by `serve`.
    #[arg(
        long,
        global = true,
        env = "FLOTILLA_OPERATOR_KEY",
        value_name = "FILE"
    )]
    pub operator_key: Option<PathBuf>,
    #[command(flatten)]
    pub auth: BrokerAuth,
    #[command(subcommand)]
    pub command: Cmd,
    /// Which of the global settings came from their environment variable rather than the
    /// command line (filled by [`Cli::try_parse_args`]), so that messages name what was used.
    #[arg(skip)]
    pub from_env: Vec<&'static str>,
}

/// The global settings: clap's id, the flag, and the environment variable.
pub const GLOBAL_SETTINGS: [(&str, &str, &str); 9] = [
    ("broker", "--broker", "FLOTILLA_BROKER"),
    ("topic_root", "--topic-root", "FLOTILLA_TOPIC_ROOT"),
    ("operator_key", "--operator-key", "FLOTILLA_OPERATOR_KEY"),
    ("username", "--username", "FLOTILLA_BROKER_USERNAME"),
    (
        "password_file",
        "--password-file",
        "FLOTILLA_BROKER_PASSWORD_FILE",
    ),
    ("ca_file", "--ca-file", "FLOTILLA_BROKER_CA_FILE"),
    ("tls", "--tls", "FLOTILLA_BROKER_TLS"),
    (
        "client_cert",
        "--client-cert",
        "FLOTILLA_BROKER_CLIENT_CERT",
    ),
    ("client_key", "--client-key", "FLOTILLA_BROKER_CLIENT_KEY"),
];

/// How the CLI logs in to the broker (docs/security.md, "The broker connection"). The password
/// is never a flag: it comes from `--password-file` or the FLOTILLA_BROKER_PASSWORD variable.
#[derive(Debug, Clone, Default, Args)]
pub struct BrokerAuth {
    /// MQTT username (an operator's, from the broker's password file).
    #[arg(long, global = true, env = "FLOTILLA_BROKER_USERNAME")]
    pub username: Option<String>,
    /// A file holding the password; without it the password is read from the
    /// FLOTILLA_BROKER_PASSWORD environment variable.
    #[arg(long, global = true, env = "FLOTILLA_BROKER_PASSWORD_FILE")]
    pub password_file: Option<PathBuf>,
    /// Connect with TLS, checking the broker's certificate against this CA file (PEM).
    #[arg(long, global = true, env = "FLOTILLA_BROKER_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// Connect with TLS, checking the broker's certificate against the system's roots.
    #[arg(long, global = true, env = "FLOTILLA_BROKER_TLS")]
    pub tls: bool,
    /// Client certificate (PEM) for mutual TLS; needs --client-key.
    #[arg(long, global = true, env = "FLOTILLA_BROKER_CLIENT_CERT")]
    pub client_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, global = true, env = "FLOTILLA_BROKER_CLIENT_KEY")]
    pub client_key: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum KeysCmd {
    /// Write a keys document that replaces the release and coordinator keys (and optionally the
    /// root keys) on devices that accept it: `flotilla-agent keys install FILE` on each device.
    Rotate {
        /// Must be higher than the last version the devices accepted.
        #[arg(long)]
        version: u64,
        /// Public release key files devices trust from now on (repeat for several).
        #[arg(long = "release-key", required = true)]
        release_keys: Vec<PathBuf>,
        /// Public coordinator key files devices trust from now on (repeat for several).
        #[arg(long = "coordinator-key", required = true)]
        coordinator_keys: Vec<PathBuf>,
        /// New public root key files; without them devices keep their root keys.
        #[arg(long = "root-key")]
        root_keys: Vec<PathBuf>,
        /// Root signatures the next keys document will need.
        #[arg(long, default_value_t = 2)]
        root_threshold: u32,
        /// Secret root key files to sign with now (repeat); others can add theirs with
        /// `flotilla keys sign`.
        #[arg(long = "sign", required = true)]
        signers: Vec<PathBuf>,
        /// Where to write the document.
        #[arg(long)]
        out: PathBuf,
    },
    /// Add a root key's signature to a keys document, in place.
    Sign {
        /// The secret root key file.
        #[arg(long)]
        key: PathBuf,
        /// The keys document.
        file: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
pub enum OperatorCmd {
    /// Write an operator's key pair: NAME.key (secret, mode 0600, stays with the operator) and
    /// NAME.pub (for the coordinator's `[[operators]]`).
    Keygen {
        /// Directory to write the key files into.
        #[arg(long)]
        out: PathBuf,
        /// The operator's name, as the coordinator's config and trace will name them.
        #[arg(long)]
        name: String,
        /// Replace existing key files.
        #[arg(long)]
        force: bool,
    },
    /// Print a signed control request (with --operator-key) for the HTTP API: POST it to
    /// /api/v1/control with Content-Type: application/json. Sign right before sending: it is
    /// stamped now and refused when sent twice.
    Sign {
        /// The command as JSON, e.g. '{"command":"start_rollout","rollout":"fw-2"}'
        /// (docs/protocol.md lists the commands and their fields).
        command: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum EnrollmentCmd {
    /// Print fresh one-time enrollment tokens, one a line: 32 random bytes each, in hex.
    ///
    /// List each in the coordinator's `[enrollment] tokens` and put it in one agent's
    /// `enrollment_token`; the agent is accepted on its first state and the token is used up.
    Token {
        /// How many tokens to print.
        #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100_000))]
        count: usize,
    },
}

#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Generate ed25519 key pairs (release and coordinator keys).
    Keygen(KeygenArgs),
    /// Operator keys, which sign control requests.
    #[command(subcommand)]
    Operator(OperatorCmd),
    /// One-time enrollment tokens, which let a device enroll without an operator.
    #[command(subcommand)]
    Enrollment(EnrollmentCmd),
    /// Rotate the keys devices trust: build and co-sign keys documents with the root keys.
    #[command(subcommand)]
    Keys(KeysCmd),
    /// Create, inspect, verify and list signed releases.
    #[command(subcommand)]
    Release(ReleaseCmd),
    /// Run the coordinator service.
    Serve(ServeArgs),
    /// Create and drive rollouts on a running coordinator.
    #[command(subcommand)]
    Rollout(RolloutCmd),
    /// List the devices a running coordinator knows with their enrollment, enroll, or delete one.
    Devices {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        page: PageArgs,
        /// Show at most this many devices (the first in id order).
        #[arg(long, value_name = "N")]
        limit: Option<usize>,
        #[command(subcommand)]
        cmd: Option<DevicesCmd>,
    },
    /// Approve an approval request, e.g. `flotilla approve fw-2-4-canary`.
    Approve {
        /// `<rollout>-<group>` (after a group) or `<rollout>-before-<group>`.
        name: String,
    },
    /// Deny a pending approval request: its rollout stops there (as `rollout stop`), and the
    /// trace names you and your reason, e.g. `flotilla deny fw-2-4-canary --reason "crash loop"`.
    Deny {
        /// `<rollout>-<group>` (after a group) or `<rollout>-before-<group>`.
        name: String,
        /// Why, for the trace.
        #[arg(long)]
        reason: Option<String>,
    },
    /// List approval requests, pending, approved and denied.
    Approvals {
        #[arg(long)]
        json: bool,
    },
    /// Show the coordinators, which one leads, its lease epoch and the lease's age.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Store, list and show staged update strategies that staged rollouts refer to.
    #[command(subcommand)]
    Strategy(StrategyCmd),
    /// Store, list and delete device groups (named selectors) that partitions refer to.
    #[command(subcommand)]
    Group(GroupCmd),
    /// Run a self-contained demo: its own broker, a coordinator and real agent processes on this
    /// machine (the broker, TLS and login flags do not apply: the demo runs its own broker).
    Demo(demo::DemoArgs),
    /// Show the groups a spec makes of a fleet file, without a coordinator.
    Plan(crate::cli::fleetfile::PlanArgs),
    /// Print a shell completion script: `flotilla completions bash > /etc/bash_completion.d/flotilla`.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Print the man page, flotilla(1), in roff: `flotilla man | man -l -`.
    Man,
    /// Run a spec against a scripted fleet in virtual time, without a coordinator.
    Simulate(crate::cli::simulate::SimulateArgs),
    /// Back up the coordinator's store: a running coordinator writes the file into its
    /// `backups/` directory; with --data-dir and --out, a stopped one's store is read directly.
    Backup(crate::cli::store::BackupArgs),
    /// Restore a backup into a stopped coordinator's data directory.
    Restore(crate::cli::store::RestoreArgs),
    /// Check a stopped coordinator's store against its seal, or accept it as it is.
    #[command(subcommand)]
    Store(crate::cli::store::StoreCmd),
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
    /// Set where devices may fetch an artifact of a release over HTTP(S), after signing: a CDN,
    /// an object store's URL, a plain web server that holds the same file. Not signed: every
    /// block is checked against the release's signed block list. The next desired actions
    /// carry it (decision 0062).
    Locate {
        #[arg(long)]
        data_dir: PathBuf,
        /// Release name.
        name: String,
        /// The artifact's target.
        target: String,
        /// An http:// or https:// URL (omit with --remove).
        #[arg(required_unless_present = "remove")]
        url: Option<String>,
        /// Remove the target's location: devices fetch it from peers and the coordinator.
        #[arg(long, conflicts_with = "url")]
        remove: bool,
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
    /// TARGET=TYPE (repeatable): what kind of payload the artifact of TARGET is, so that a
    /// device refuses it before downloading when its target of that name is of another kind.
    /// TYPE is rauc-bundle, swu, or mender:MODULE (e.g. mender:single-file). Without one an
    /// artifact is plain bytes that any target may take. A typed manifest is refused by agents
    /// that predate types (decision 0054).
    #[arg(long, value_name = "TARGET=TYPE")]
    pub artifact_type: Vec<String>,
    /// How long the release stays installable (s, m, h, d, or a compound like 90d12h).
    #[arg(long, default_value = "365d")]
    pub expires_in: String,
    /// Bytes per block of each artifact's block list (1024..=65536). A list holds 32 bytes per
    /// block: 0.049% of the artifact at 65536, 3.1% at 1024. The bound is 0.1%; `release
    /// create` warns, naming the artifact, for every list over it (small blocks, or an
    /// artifact under 32,000 bytes at any block size), unless the list is 4 hashes or fewer,
    /// which cannot matter.
    #[arg(long, default_value_t = flotilla_protocol::blocks::DEFAULT_BLOCK_SIZE)]
    pub block_size: u32,
    /// Sign a manifest without block lists, which agents older than block hashes can read
    /// (decision 0024); devices then check only each artifact's whole-file digest.
    #[arg(long, conflicts_with = "block_size")]
    pub no_blocks: bool,
    /// TARGET=URL (repeatable): an http:// or https:// location devices may fetch TARGET's
    /// artifact from with range requests, each block checked against the signed block list.
    /// Not part of the signed manifest; `release locate` changes it later (decision 0062).
    #[arg(long, value_name = "TARGET=URL", conflicts_with = "no_blocks")]
    pub url: Vec<String>,
}

/// Where `serve` takes each setting from, first match wins. Shown by `flotilla serve --help`
/// and described in docs/operations.md ("Where `flotilla serve` takes its settings").
pub const SERVE_PRECEDENCE: &str = "\
Settings: a flag on the command line wins over its environment variable, which wins over the
config file, which wins over the default. The broker flags replace the config file's [broker]
settings one by one:
  --broker HOST:PORT    FLOTILLA_BROKER                 broker.host, broker.port
  --topic-root ROOT     FLOTILLA_TOPIC_ROOT             broker.topic_root
  --embedded-broker     (no variable)                   broker.embedded
  --insecure-embedded-broker (no variable)              broker.insecure_embedded
  --username            (not read by serve)             broker.username
  --password-file       (not read by serve)             broker.password_file (or password_env)
  --tls                 FLOTILLA_BROKER_TLS             [broker.tls] (on)
  --ca-file             FLOTILLA_BROKER_CA_FILE         broker.tls.ca_file
  --client-cert         FLOTILLA_BROKER_CLIENT_CERT     broker.tls.client_cert
  --client-key          FLOTILLA_BROKER_CLIENT_KEY      broker.tls.client_key
FLOTILLA_BROKER_USERNAME and FLOTILLA_BROKER_PASSWORD_FILE are the CLI's login (an operator's):
`serve` ignores them, so a coordinator started from the operator's shell does not log in as the
operator. A --username without a password file reads the password from FLOTILLA_BROKER_PASSWORD.
Paths given as flags or variables are relative to the working directory, paths in the config
file to the config file's directory. With an embedded broker the coordinator connects to it
over plain loopback TCP: a broker address, login or TLS setting given on the command line or
in the environment is refused then (an address naming the embedded broker itself is fine).
The embedded broker has no login, TLS or ACL: an address other than loopback is refused unless
--insecure-embedded-broker (or broker.insecure_embedded = true) says to run it there anyway.
--operator-key signs requests to a coordinator; `serve` refuses it on its command line and
ignores FLOTILLA_OPERATOR_KEY.";

#[derive(Debug, Args)]
#[command(after_long_help = SERVE_PRECEDENCE)]
pub struct ServeArgs {
    /// The coordinator config file.
    #[arg(long, required_unless_present = "print_default_config")]
    pub config: Option<PathBuf>,
    /// Run an embedded broker on this address (overrides broker.embedded in the config).
    #[arg(long, value_name = "IP:PORT")]
    pub embedded_broker: Option<String>,
    /// Let the embedded broker listen on an address other than loopback, although it has no
    /// login, TLS or ACL (broker.insecure_embedded in the config).
    #[arg(long)]
    pub insecure_embedded_broker: bool,
    /// Print the commented default config and exit.
    #[arg(long)]
    pub print_default_config: bool,
}

/// Paging and filters of the lists a coordinator answers in pages (`devices`, `rollout
/// status`). The CLI fetches every page; these choose the page size and what to list.
#[derive(Debug, Clone, Default, Args)]
pub struct PageArgs {
    /// Devices (or rollouts) per request; the coordinator caps it so a page fits in one message.
    #[arg(long, value_name = "N", default_value_t = crate::cli::client::DEFAULT_PAGE_SIZE,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub page_size: usize,
    /// Only devices whose labels match this selector, e.g. `site=berlin,tier in (1,2)`.
    #[arg(long, value_name = "SELECTOR")]
    pub select: Option<String>,
    /// Only devices in this phase (`ready`, `failed`, `scheduled`, …).
    #[arg(long, value_name = "PHASE")]
    pub phase: Option<String>,
    /// Only devices of this group: a rollout's group (`rollout status NAME`) or a stored
    /// device group (`devices`).
    #[arg(long, value_name = "GROUP")]
    pub group: Option<String>,
    /// Only devices that are connected (`true`) or not (`false`) (`devices`).
    #[arg(long, value_name = "BOOL")]
    pub online: Option<bool>,
    /// Only devices in this enrollment state: accepted, pending, rejected, revoked (`devices`).
    #[arg(long, value_name = "STATE")]
    pub enrollment: Option<String>,
}

impl PageArgs {
    /// The first page's query.
    pub fn query(&self) -> flotilla_protocol::control::PageQuery {
        flotilla_protocol::control::PageQuery {
            limit: Some(self.page_size),
            after: None,
            select: self.select.clone(),
            phase: self.phase.clone(),
            group: self.group.clone(),
            online: self.online,
            enrollment: self.enrollment.clone(),
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum RolloutCmd {
    /// Create a rollout from a TOML spec file; it waits for `rollout start`.
    Create {
        /// The rollout spec (docs/rollout-spec.md).
        #[arg(long)]
        spec: PathBuf,
    },
    /// Start a created rollout: its first group begins now, or at the spec's start time.
    Start {
        /// The rollout's name, as its spec gives it.
        name: String,
        /// Then follow it like `rollout status NAME --watch` until it ends, and exit with its
        /// end state: 0 finished, 3 failed, 4 stopped.
        #[arg(long)]
        wait: bool,
    },
    /// Pause a rollout: no device starts until `rollout resume`; updates already sent go on.
    Pause {
        /// The rollout's name.
        name: String,
    },
    /// Resume a paused rollout where it stopped (a group in error counts as done).
    Resume {
        /// The rollout's name.
        name: String,
    },
    /// Stop a rollout for good: actions not yet taken are canceled, devices not started keep
    /// their release (`rollout retry` makes a new rollout over what is left).
    Stop {
        /// The rollout's name.
        name: String,
    },
    /// Delete a rollout that has ended (stopped, finished, failed) or never started: its record
    /// and trace go, and its name can be used again. Needs the admin role.
    Delete {
        /// The rollout's name.
        name: String,
    },
    /// Show one rollout in full, or every rollout as a compact list (as `rollout list`).
    /// The coordinator answers in pages; this fetches them all.
    Status {
        /// The rollout to show with its groups, approvals and recent decisions; without it,
        /// one line per rollout.
        #[arg(value_name = "NAME")]
        name: Option<String>,
        /// Print JSON instead of text: every field, per-device detail with a name, and each
        /// time both as Unix seconds and as RFC 3339 (`…_rfc3339`).
        #[arg(long)]
        json: bool,
        /// Redraw the status in place until the rollout ends, then exit with its end state:
        /// 0 finished, 3 failed, 4 stopped (1 is an error, as for every command).
        #[arg(long, requires = "name", conflicts_with = "json")]
        watch: bool,
        #[command(flatten)]
        page: PageArgs,
    },
    /// List every rollout, one line each: state, release, groups done, devices ready and
    /// failed.
    List {
        /// Print JSON instead of a table (every rollout's summary).
        #[arg(long)]
        json: bool,
    },
    /// Start the next group now, without waiting for the current group's success condition
    /// or its timed wait.
    ///
    /// An approval in the way (after the current group, or before the group that would start)
    /// refuses with its name, unless --skip-approval is given.
    Next {
        name: String,
        /// Give the approvals in the way in your name; the trace records it ("approval
        /// r-canary given by alice via next").
        #[arg(long)]
        skip_approval: bool,
    },
    /// Create a rollout over the failed, refused and timed-out devices of a rollout.
    Retry {
        #[arg(value_name = "NAME")]
        rollout: String,
        /// Name of the new rollout (default `<NAME>-retry`).
        #[arg(long)]
        name: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum DevicesCmd {
    /// Forget a device and clear its retained topics.
    ///
    /// The device leaves the registry and the groups of unfinished rollouts. A device that is
    /// still running reappears when it next announces itself.
    Delete { id: String },
    /// Devices waiting for an operator: new devices and new keys of known devices.
    Pending,
    /// Accept a pending device (or a known device's new key).
    ///
    /// Compare the key with the one the device prints (`flotilla-agent identity`) and pass it
    /// with --key: the coordinator accepts that key only, and refuses when the waiting key is
    /// another (one that showed up after you looked). Without --key, on a terminal, the waiting
    /// key is shown and you are asked; elsewhere --key is required.
    Accept {
        id: String,
        /// The key to accept: full hex, or at least its first 16 hex digits.
        #[arg(long)]
        key: Option<String>,
    },
    /// Reject a pending device, or a known device's new key (it stays accepted with the old).
    Reject {
        id: String,
        /// The key to reject: full hex, or at least its first 16 hex digits.
        #[arg(long)]
        key: Option<String>,
    },
    /// Revoke an accepted device: it is ignored from now on and leaves unfinished rollouts.
    Revoke { id: String },
}

#[derive(Debug, Subcommand)]
pub enum StrategyCmd {
    /// Store (or replace) a staged strategy from a TOML file of `[[stage]]` entries.
    Create {
        name: String,
        #[arg(long)]
        file: PathBuf,
    },
    List {
        #[arg(long)]
        json: bool,
    },
    /// Print a stored strategy's TOML.
    Show {
        name: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum GroupCmd {
    /// Store (or replace) a device group.
    Create {
        name: String,
        /// Label selector of the group's devices, e.g. "site in (a,b),!quarantined".
        #[arg(long)]
        select: String,
        /// KEY=VALUE label of the group itself (repeatable).
        #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
        labels: Vec<(String, String)>,
    },
    List {
        #[arg(long)]
        json: bool,
    },
    Delete {
        name: String,
    },
}

/// Parses `--label KEY=VALUE`.
pub fn parse_label(value: &str) -> Result<(String, String), String> {
    match value.split_once('=') {
        Some((key, val)) if !key.trim().is_empty() => {
            Ok((key.trim().to_owned(), val.trim().to_owned()))
        }
        _ => Err(format!("expected KEY=VALUE like tier=1, got {value:?}")),
    }
}

impl Cli {
    /// Parses the process's arguments like `Cli::parse`, and notes which global settings came
    /// from the environment.
    pub fn parse_args() -> Cli {
        Self::try_parse_args(std::env::args_os()).unwrap_or_else(|e| e.exit())
    }

    /// The command line's definition, each command's help showing only the global settings it
    /// uses (`help_scope`).
    pub fn command_scoped() -> clap::Command {
        help_scope::scoped(Self::command())
    }

    /// Parses `args` and notes which global settings came from their environment variable.
    pub fn try_parse_args<I, T>(args: I) -> Result<Cli, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let mut command = Self::command_scoped();
        let matches = command.try_get_matches_from_mut(args)?;
        let mut cli = Self::from_arg_matches(&matches).map_err(|e| e.format(&mut command))?;
        cli.from_env = GLOBAL_SETTINGS
            .iter()
            .filter(|(id, _, _)| matches.value_source(id) == Some(ValueSource::EnvVariable))
            .map(|(id, _, _)| *id)
            .collect();
        Ok(cli)
    }

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

#[cfg(test)]
mod help_tests {
    use super::Cli;

    fn help(path: &[&str]) -> String {
        let mut command = Cli::command_scoped();
        command.build();
        let mut sub = &mut command;
        for name in path {
            sub = sub.find_subcommand_mut(name).expect("a command");
        }
        sub.render_long_help().to_string()
    }

    /// Whether `help` lists the option `flag` (as its own line, not a mention in the prose).
    fn lists(help: &str, flag: &str) -> bool {
        help.lines()
            .any(|line| line.trim_start().starts_with(flag) && line.starts_with("  "))
    }

    #[test]
    fn offline_commands_show_no_broker_flags_and_online_ones_do() {
        for path in [
            &["plan"][..],
            &["demo"],
            &["release", "create"],
            &["keygen"],
        ] {
            let text = help(path);
            for flag in ["--broker", "--username", "--tls", "--operator-key"] {
                assert!(!lists(&text, flag), "{path:?} --help lists {flag}:\n{text}");
            }
        }
        let sign = help(&["operator", "sign"]);
        assert!(
            lists(&sign, "--operator-key") && !lists(&sign, "--broker"),
            "{sign}"
        );
        let serve = help(&["serve"]);
        assert!(
            lists(&serve, "--broker") && !lists(&serve, "--operator-key"),
            "{serve}"
        );
        let start = help(&["rollout", "start"]);
        for flag in ["--broker", "--username", "--tls", "--operator-key"] {
            assert!(
                lists(&start, flag),
                "rollout start --help lacks {flag}:\n{start}"
            );
        }
    }

    #[test]
    fn a_hidden_setting_is_still_accepted_so_an_exported_broker_breaks_nothing() {
        let cli = Cli::try_parse_args(["flotilla", "plan", "--help-not-a-flag"]);
        assert!(cli.is_err());
        let cli = Cli::try_parse_args(["flotilla", "--broker", "h:1", "completions", "bash"])
            .expect("a hidden global flag parses");
        assert_eq!(cli.broker.as_deref(), Some("h:1"));
        let cli = Cli::try_parse_args(["flotilla", "completions", "bash", "--broker", "h:2"])
            .expect("after the command too");
        assert_eq!(cli.broker.as_deref(), Some("h:2"));
    }
}
