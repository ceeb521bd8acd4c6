//! `flotilla demo`: the whole system on one machine, in one command.
//!
//! It starts the embedded broker on a free port, a coordinator (in this process) and N real
//! `flotilla-agent` processes with temporary data directories and `file` targets; makes keys and
//! a signed release; and runs a three-group rollout with live progress. The first `--fail K`
//! agents have a health check that fails: they roll back and report Failed. One failure in a
//! group of four stays within the 30% error threshold and the rollout goes on; two cross it and
//! the rollout pauses before the next group starts.
//!
//! Exit codes: 0 when the rollout finished, 2 when it ended paused or stopped, 1 on an error.
//!
//! Everything lives in one temporary directory, laid out like a small real site: the
//! coordinator's `coordinator.toml` (which the demo loads and serves, with the embedded broker)
//! and `coordinator.log`, `keys/`, and `agents/<id>/agent.toml` and `agent.log` per agent.
//! `--keep` keeps it, and `flotilla serve --config <dir>/coordinator.toml` with the agents'
//! configs runs the same fleet again (README, "Your first rollout").

use std::collections::BTreeMap;
use std::fs;
use std::io::IsTerminal as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use flotilla_protocol::control::{Command as Control, DeviceSummary, RolloutStatus};
use flotilla_rollout::text::count;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::cli::client::{ClientError, ControlClient};
use crate::cli::demo_cleanup;
use crate::cli::view;
use crate::service;
use crate::service::config::{Config, ConfigError};
use crate::service::keys::{self, KeysError};
use crate::service::releases::{NewRelease, ReleaseError, ReleaseStore};

const ROLLOUT: &str = "demo-fw-2";
const RELEASE: &str = "demo-fw-2.0.0";
const ERROR_THRESHOLD: &str = "30%";
const SUCCESS_THRESHOLD: &str = "75%";

/// Arguments of `flotilla demo`.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Number of agents to start.
    #[arg(long, default_value_t = 12)]
    pub devices: usize,
    /// Number of agents whose health check fails (the first ones, in the canary group).
    #[arg(long, default_value_t = 1)]
    pub fail: usize,
    /// Print a machine-readable summary on stdout instead of the live view.
    #[arg(long)]
    pub json: bool,
    /// Keep the temporary directory (configs, logs, data) and print its path.
    #[arg(long)]
    pub keep: bool,
    /// The agent binary; by default `flotilla-agent` next to this executable.
    #[arg(long, env = "FLOTILLA_AGENT_BIN")]
    pub agent_bin: Option<PathBuf>,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 180)]
    pub timeout: u64,
}

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("--devices {devices}: the demo needs at least 3 devices for its three groups")]
    TooFewDevices { devices: usize },
    #[error("--fail {fail} is more than --devices {devices}")]
    TooManyFailing { fail: usize, devices: usize },
    #[error("agent binary {path} not found; build it with `cargo build --release --bins` or pass --agent-bin")]
    AgentBinary { path: PathBuf },
    #[error("demo setup: {what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("the demo's coordinator config: {0}")]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Keys(#[from] KeysError),
    #[error(transparent)]
    Release(#[from] ReleaseError),
    #[error(transparent)]
    Control(#[from] ClientError),
    #[error("the coordinator stopped: {0}")]
    Coordinator(String),
    #[error("timed out after {secs}s waiting for {what}")]
    Timeout { what: String, secs: u64 },
    #[error("unexpected reply from the coordinator: {0}")]
    Reply(#[from] serde_json::Error),
    #[error("standard output was closed")]
    ClosedPipe,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DemoError {
    let what = what.into();
    move |source| DemoError::Io { what, source }
}

/// The agents ([`demo_cleanup`] holds them, for a panic), killed when dropped.
struct Agents;

impl Drop for Agents {
    fn drop(&mut self) {
        demo_cleanup::stop_agents();
    }
}

/// The machine-readable summary (`--json`).
#[derive(Debug, Serialize)]
pub struct Summary {
    pub rollout: String,
    pub release: String,
    pub state: String,
    pub groups: Vec<GroupSummary>,
    pub devices: Vec<DeviceOutcome>,
    pub decisions: Vec<String>,
}

/// One group's final state.
#[derive(Debug, Serialize)]
pub struct GroupSummary {
    pub name: String,
    pub state: String,
    pub devices: Vec<String>,
}

/// One device's outcome.
#[derive(Debug, Serialize)]
pub struct DeviceOutcome {
    pub id: String,
    pub group: Option<String>,
    pub phase: String,
    pub installed: Option<String>,
    pub reason: Option<String>,
}

/// Runs the demo; returns its exit code (0 finished, 2 paused or stopped, 130, 143 or 129 when
/// interrupted by SIGINT, SIGTERM or SIGHUP, 0 when its stdout was closed). However it ends,
/// the agents are stopped and the temporary directory, secret keys included, is removed (kept
/// with `--keep`); on a panic, by [`demo_cleanup`]'s hook before the process aborts.
pub async fn run(args: DemoArgs) -> Result<i32, DemoError> {
    check_args(&args)?;
    let dir = tempfile::Builder::new()
        .prefix("flotilla-demo-")
        .tempdir()
        .map_err(io("temporary directory"))?;
    demo_cleanup::install(dir.path(), args.keep);
    let port = free_port().map_err(io("find a free port"))?;
    let shutdown = CancellationToken::new();
    let mut coordinator = None;
    let outcome = tokio::select! {
        result = run_in(&args, dir.path(), port, &shutdown, &mut coordinator) => result,
        (signal, code) = interrupted() => {
            // Leaving the select drops the demo where it stood: the agents are killed.
            eprintln!("demo: {signal}: stopping the agents and the coordinator");
            Ok(code)
        }
    };
    // The coordinator stops before its directory is removed: a store still writing into it
    // would leave the directory, keys included, behind.
    shutdown.cancel();
    if let Some(task) = coordinator {
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    }
    demo_cleanup::forget();
    if args.keep {
        let kept = dir.keep();
        let text = kept_text(&kept, port, args.devices);
        if args.json {
            eprint!("{text}");
        } else {
            // The reader may be gone; the directory is kept all the same.
            let _ = show(&text);
        }
    }
    match outcome {
        // The reader stopped reading (`flotilla demo | head`): everything is cleaned up above,
        // and the demo ends quietly, as every command does on a closed pipe.
        Err(DemoError::ClosedPipe) => Ok(0),
        outcome => outcome,
    }
}

/// Writes `text` to stdout. A closed pipe is an error like any other here, not a panic: the
/// demo must still stop its agents and remove its directory (a panic aborts in a release build
/// and would leave both behind).
fn show(text: &str) -> Result<(), DemoError> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|source| match source.kind() {
            std::io::ErrorKind::BrokenPipe => DemoError::ClosedPipe,
            _ => DemoError::Io {
                what: "write to standard output".into(),
                source,
            },
        })
}

/// What `--keep` leaves, and how to run the same fleet again.
fn kept_text(dir: &Path, port: u16, devices: usize) -> String {
    let d = dir.display();
    format!(
        "kept {d}
  coordinator.toml, coordinator.log        the coordinator's config and log
  agents/dev-NN/agent.toml, agent.log      each of the {devices} agents' config and log
  keys/                                    release, coordinator and operator (demo.key) keys
Run the same fleet again and roll out your own release (README, \"Your first rollout\"):
  cd {d}
  flotilla serve --config coordinator.toml &
  for c in agents/*/agent.toml; do flotilla-agent run --config \"$c\" & done
  export FLOTILLA_BROKER=127.0.0.1:{port} FLOTILLA_OPERATOR_KEY=keys/demo.key
  flotilla devices
"
    )
}

/// The demo's coordinator log file, once the demo's directory exists ([`log_layer`]).
static COORDINATOR_LOG: OnceLock<fs::File> = OnceLock::new();

/// Writes to `coordinator.log` in the demo's directory; drops what is logged before it exists.
struct CoordinatorLog;

impl std::io::Write for CoordinatorLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match COORDINATOR_LOG.get() {
            Some(mut file) => file.write(buf),
            None => Ok(buf.len()),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match COORDINATOR_LOG.get() {
            Some(mut file) => file.flush(),
            None => Ok(()),
        }
    }
}

/// The log layer `main` adds for `flotilla demo`: the coordinator's log at info level (as
/// `flotilla serve` logs) into `coordinator.log`, while the terminal keeps the live view.
pub fn log_layer<S>() -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::Layer as _;
    tracing_subscriber::fmt::layer()
        .with_writer(|| CoordinatorLog)
        .with_ansi(false)
        .with_filter(tracing_subscriber::EnvFilter::new("info,rumqttd=off"))
}

/// The first SIGINT, SIGTERM or SIGHUP (the terminal was closed), with its exit code.
async fn interrupted() -> (&'static str, i32) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let (Ok(mut term), Ok(mut hup)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::hangup()),
        ) {
            return tokio::select! {
                _ = tokio::signal::ctrl_c() => ("SIGINT", 130),
                _ = term.recv() => ("SIGTERM", 143),
                _ = hup.recv() => ("SIGHUP", 129),
            };
        }
    }
    let _ = tokio::signal::ctrl_c().await;
    ("SIGINT", 130)
}

/// Refuses arguments the demo cannot run with, before anything is started.
fn check_args(args: &DemoArgs) -> Result<(), DemoError> {
    if args.devices < 3 {
        return Err(DemoError::TooFewDevices {
            devices: args.devices,
        });
    }
    if args.fail > args.devices {
        return Err(DemoError::TooManyFailing {
            fail: args.fail,
            devices: args.devices,
        });
    }
    Ok(())
}

async fn run_in(
    args: &DemoArgs,
    root: &Path,
    port: u16,
    shutdown: &CancellationToken,
    coordinator_task: &mut Option<tokio::task::JoinHandle<Result<(), service::ServiceError>>>,
) -> Result<i32, DemoError> {
    let agent_bin = agent_binary(args.agent_bin.clone())?;
    let root = root.to_owned();
    let say = |line: String| {
        if args.json {
            eprintln!("{line}");
            Ok(())
        } else {
            show(&format!("{line}\n"))
        }
    };
    let log =
        fs::File::create(root.join("coordinator.log")).map_err(io("create coordinator.log"))?;
    // One demo per process: a second one (only in tests) logs into the first one's file.
    let _ = COORDINATOR_LOG.set(log);

    let addr: SocketAddr = SocketAddr::from(([127, 0, 0, 1], port));
    let keys = keys::keygen(&root.join("keys"), &[], false)?;
    let (release_pub, coordinator_pub) = (keys[0].public_hex.clone(), keys[1].public_hex.clone());
    let release_key = keys::load_secret_key(&keys[0].secret)?;
    // The demo's own operator: an admin whose key signs the demo's control requests.
    let operator = keys::keygen(&root.join("keys"), &["demo".to_owned()], false)?;
    let operator_key = keys::load_secret_key(&operator[0].secret)?;
    let data_dir = root.join("coordinator");
    let artifact = root.join("app-2.0.0.bin");
    fs::write(&artifact, demo_artifact()).map_err(io("write the demo artifact"))?;
    let manifest = ReleaseStore::new(&data_dir).create(
        &NewRelease {
            name: RELEASE.into(),
            version: "2.0.0".into(),
            counter: 2,
            hardware: vec!["demo-board".into()],
            artifacts: vec![format!("app={}", artifact.display())],
            artifact_types: vec![],
            expires_in: 30 * 24 * 3600,
            block_size: Some(flotilla_protocol::blocks::DEFAULT_BLOCK_SIZE),
        },
        &release_key,
        unix_now(),
    )?;
    say(format!(
        "signed release {} ({} bytes, sha256 {}…)",
        manifest.release.name,
        manifest.release.artifacts[0].size,
        &flotilla_protocol::hex::encode(&manifest.release.artifacts[0].sha256)[..16]
    ))?;

    // Each demo device enrolls itself with a one-time token the coordinator lists, so the demo
    // needs no operator to accept devices (`flotilla devices pending` shows how that looks).
    let tokens: Vec<String> = (1..=args.devices)
        .map(|_| crate::service::enrollment::new_token())
        .collect();
    // The coordinator runs from a config file like any other, so the file a kept demo leaves
    // is the one that ran.
    let config_path = root.join("coordinator.toml");
    let http = SocketAddr::from(([127, 0, 0, 1], free_port().map_err(io("find a free port"))?));
    fs::write(&config_path, coordinator_config(addr, http, &tokens))
        .map_err(io("write coordinator.toml"))?;
    let config = Config::load(&config_path)?;
    let coordinator =
        coordinator_task.insert(tokio::spawn(service::serve(config, shutdown.clone())));
    let deadline = Instant::now() + Duration::from_secs(args.timeout);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        if coordinator.is_finished() {
            return Err(DemoError::Coordinator(coordinator_end(coordinator).await));
        }
        if Instant::now() > deadline {
            return Err(DemoError::Timeout {
                what: format!("the embedded broker on {addr}"),
                secs: args.timeout,
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    say(format!(
        "coordinator with an embedded MQTT broker on {addr}; web console on http://{http}/console \
         (log in with the demo's operator key, {}), HTTP API on http://{http}/api/openapi.json",
        // A directory the demo removes at its end is not printed (tests/tests/newcomer.rs).
        if args.keep {
            root.join("keys/demo.key").display().to_string()
        } else {
            "keys/demo.key in its directory; --keep keeps it".to_owned()
        }
    ))?;

    let agents = Agents;
    for i in 1..=args.devices {
        let id = format!("dev-{i:02}");
        let healthy = i > args.fail;
        let keys = AgentKeys {
            release_pub: &release_pub,
            coordinator_pub: &coordinator_pub,
            token: &tokens[i - 1],
        };
        let config = write_agent_config(&root, &id, port, healthy, &keys)?;
        let log = fs::File::create(config.with_file_name("agent.log"))
            .map_err(io("create an agent log"))?;
        let err = log.try_clone().map_err(io("open an agent log"))?;
        // Info, as a real agent logs: what it was told, fetched, installed and reported.
        demo_cleanup::spawn_agent(
            Command::new(&agent_bin)
                .args(["run", "--config"])
                .arg(&config)
                .env("RUST_LOG", "info")
                // The link's size guard keeps its socket directory under TMPDIR; the demo's agents
                // are killed at the end, so theirs goes inside the demo's directory, which is removed.
                .env("TMPDIR", config.parent().unwrap_or(&root))
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(err),
        )
        .map_err(io(format!("start {}", agent_bin.display())))?;
    }
    demo_cleanup::panic_if_asked("agents-started");
    say(format!(
        "started {} agents ({} with a failing health check)",
        args.devices, args.fail
    ))?;

    let client = ControlClient::connect(
        "127.0.0.1",
        port,
        flotilla_protocol::topics::DEFAULT_ROOT,
        operator_key,
    )
    .await?;
    wait_for_devices(&client, args.devices, deadline, args.timeout).await?;
    say(format!("all {} agents registered\n", args.devices))?;

    let spec = demo_spec();
    client
        .request(
            Control::CreateRollout { spec: spec.clone() },
            Duration::from_secs(10),
        )
        .await?;
    client
        .request(
            Control::StartRollout {
                rollout: ROLLOUT.into(),
            },
            Duration::from_secs(10),
        )
        .await?;
    if !args.json {
        show(&format!("rollout spec:\n{}\n", indent(&spec)))?;
    }

    let live = !args.json && std::io::stdout().is_terminal();
    let mut last_view = String::new();
    let status = loop {
        if coordinator.is_finished() {
            return Err(DemoError::Coordinator(coordinator_end(coordinator).await));
        }
        let value = client
            .request(
                Control::RolloutStatus {
                    rollout: Some(ROLLOUT.into()),
                    page: Default::default(),
                },
                Duration::from_secs(10),
            )
            .await?;
        let status: RolloutStatus = serde_json::from_value(value)?;
        // Bars in colour where the view is redrawn on a terminal.
        let paint = match live {
            true => view::Paint::for_stdout(),
            false => view::Paint::Plain,
        };
        let text = view::rollout_status_in(&status, paint);
        if text != last_view {
            if live && !last_view.is_empty() {
                // Move up over the previous view and redraw it in place.
                show(&format!("\x1b[{}A\x1b[J", last_view.lines().count()))?;
            }
            if args.json {
                eprint!("{}", progress_line(&status));
            } else {
                show(&text)?;
                if !live {
                    show("\n")?;
                }
            }
            last_view = text;
        }
        if is_settled(&status) {
            break status;
        }
        if Instant::now() > deadline {
            return Err(DemoError::Timeout {
                what: "the rollout to settle".into(),
                secs: args.timeout,
            });
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };

    let devices: Vec<DeviceSummary> = serde_json::from_value(
        client
            .request(
                Control::ListDevices {
                    page: Default::default(),
                },
                Duration::from_secs(10),
            )
            .await?,
    )?;
    let summary = summarize(&status, &devices);
    if args.json {
        show(&format!("{}\n", serde_json::to_string_pretty(&summary)?))?;
    } else {
        show(&format!("\n{}\n", explain(&summary)))?;
    }

    drop(agents);
    shutdown.cancel();
    if let Some(task) = coordinator_task.take() {
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    }
    Ok(match summary.state.as_str() {
        "finished" => 0,
        _ => 2,
    })
}

/// Why the coordinator task ended.
async fn coordinator_end(
    task: &mut tokio::task::JoinHandle<Result<(), service::ServiceError>>,
) -> String {
    match task.await {
        Ok(Ok(())) => "it exited".to_owned(),
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
    }
}

/// The demo coordinator's config: paths relative to the demo's directory, the embedded
/// broker, one enrollment token per agent, and the `demo` operator (admin).
fn coordinator_config(addr: SocketAddr, http: SocketAddr, tokens: &[String]) -> String {
    format!(
        r#"# The coordinator of `flotilla demo`; `flotilla serve --config coordinator.toml` runs it
# again, with its database in coordinator/ (the devices and rollouts of the demo).
data_dir = "coordinator"
coordinator_key = "keys/coordinator.key"

[broker]
# The demo's broker runs inside the coordinator: plain TCP on loopback, no login.
embedded = "{addr}"

[http]
# The HTTP API (POST /api/v1/control, /api/openapi.json) and /metrics, on loopback.
listen = "{http}"

[actions]
validity = "24h"

[enrollment]
# One token per demo agent; each is used up when its agent first enrolls.
tokens = {tokens:?}

[[operators]]
name = "demo"
role = "admin"
key_file = "keys/demo.pub"
"#
    )
}

fn agent_binary(given: Option<PathBuf>) -> Result<PathBuf, DemoError> {
    let path = match given {
        Some(path) => path,
        None => std::env::current_exe()
            .map_err(io("locate the flotilla executable"))?
            .with_file_name(format!("flotilla-agent{}", std::env::consts::EXE_SUFFIX)),
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(DemoError::AgentBinary { path })
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// 512 KiB of recognisable bytes: big enough that the download goes through many blocks.
fn demo_artifact() -> Vec<u8> {
    let mut bytes = b"flotilla demo application 2.0.0\n".to_vec();
    bytes.extend((0..512 * 1024u32).map(|i| (i % 251) as u8));
    bytes
}

fn demo_spec() -> String {
    format!(
        r#"name = "{ROLLOUT}"
release = "{RELEASE}"
select = "fleet=demo"
[groups]
count = 3
success = {{ threshold = "{SUCCESS_THRESHOLD}", action = "next" }}
error = {{ threshold = "{ERROR_THRESHOLD}", action = "pause" }}
"#
    )
}

/// What a demo agent trusts, and the token it enrolls with.
struct AgentKeys<'a> {
    release_pub: &'a str,
    coordinator_pub: &'a str,
    token: &'a str,
}

fn write_agent_config(
    root: &Path,
    id: &str,
    port: u16,
    healthy: bool,
    keys: &AgentKeys<'_>,
) -> Result<PathBuf, DemoError> {
    let AgentKeys {
        release_pub,
        coordinator_pub,
        token,
    } = keys;
    let dir = root.join("agents").join(id);
    fs::create_dir_all(&dir).map_err(io(format!("create {}", dir.display())))?;
    let target = dir.join("app.bin");
    fs::write(&target, b"flotilla demo application 1.0.0\n")
        .map_err(io("write the installed app"))?;
    let check = if healthy {
        format!("test -s {}", shell_quote(&target))
    } else {
        "echo 'self-test: app 2.0.0 crashed on start' >&2; exit 1".to_owned()
    };
    let text = format!(
        r#"device_id = "{id}"
hardware_id = "demo-board"
data_dir = {data:?}
enrollment_token = "{token}"
[broker]
host = "127.0.0.1"
port = {port}
keep_alive = "5s"
[labels]
fleet = "demo"
[trust]
release_keys = ["{release_pub}"]
coordinator_keys = ["{coordinator_pub}"]
[[target]]
name = "app"
kind = "file"
path = {target:?}
[health]
soak = "2s"
interval = "500ms"
[[health.check]]
name = "self-test"
command = ["/bin/sh", "-c", {check:?}]
timeout = "5s"
[download]
block_size = 65536
in_flight = 4
max_bytes_per_sec = 0
"#,
        data = dir.join("data"),
    );
    let path = dir.join("agent.toml");
    fs::write(&path, text).map_err(io(format!("write {}", path.display())))?;
    Ok(path)
}

fn shell_quote(path: &Path) -> String {
    format!("'{}'", path.display().to_string().replace('\'', r"'\''"))
}

async fn wait_for_devices(
    client: &ControlClient,
    n: usize,
    deadline: Instant,
    secs: u64,
) -> Result<(), DemoError> {
    loop {
        // The coordinator starts in parallel with the agents; until it has subscribed to the
        // control topic a request goes unanswered, so a missing reply means "ask again".
        match client
            .request(
                Control::ListDevices {
                    page: Default::default(),
                },
                Duration::from_secs(2),
            )
            .await
        {
            Ok(value) => {
                let devices: Vec<DeviceSummary> = serde_json::from_value(value)?;
                if devices.iter().filter(|d| d.online).count() >= n {
                    return Ok(());
                }
            }
            Err(ClientError::NoReply { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        if Instant::now() > deadline {
            return Err(DemoError::Timeout {
                what: format!("{n} agents to register"),
                secs,
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Finished or stopped; or paused with nothing left running on any device.
fn is_settled(status: &RolloutStatus) -> bool {
    match status.state.as_str() {
        "finished" | "stopped" => true,
        "paused" => status.groups.iter().all(|g| g.in_progress == 0),
        _ => false,
    }
}

fn progress_line(status: &RolloutStatus) -> String {
    let groups: Vec<String> = status
        .groups
        .iter()
        .map(|g| format!("{} {} {}/{}", g.name, g.state, g.ready + g.failed, g.total))
        .collect();
    format!("{} {}: {}\n", status.name, status.state, groups.join(", "))
}

fn summarize(status: &RolloutStatus, devices: &[DeviceSummary]) -> Summary {
    let mut group_of: BTreeMap<&str, &str> = BTreeMap::new();
    for g in &status.groups {
        for id in g.devices.keys() {
            group_of.insert(id, &g.name);
        }
    }
    let phase_of = |id: &str| {
        status
            .groups
            .iter()
            .find_map(|g| g.devices.get(id).cloned())
            .unwrap_or_else(|| "not in rollout".into())
    };
    Summary {
        rollout: status.name.clone(),
        release: status.release.clone(),
        state: status.state.clone(),
        groups: status
            .groups
            .iter()
            .map(|g| GroupSummary {
                name: g.name.clone(),
                state: g.state.clone(),
                devices: g.devices.keys().cloned().collect(),
            })
            .collect(),
        devices: devices
            .iter()
            .map(|d| DeviceOutcome {
                id: d.id.clone(),
                group: group_of.get(d.id.as_str()).map(|g| (*g).to_owned()),
                phase: phase_of(&d.id),
                installed: d.installed.clone(),
                reason: d.reason.clone(),
            })
            .collect(),
        decisions: view::decision_lines(&status.trace)
            .into_iter()
            .map(|(_, line)| line)
            .collect(),
    }
}

/// The human summary: what happened, and why.
fn explain(summary: &Summary) -> String {
    let total = summary.devices.len();
    let updated = summary
        .devices
        .iter()
        .filter(|d| d.installed.as_deref() == Some(summary.release.as_str()))
        .count();
    let mut out = match summary.state.as_str() {
        "finished" => format!(
            "Rollout {} finished: {updated} of {} now run {}.\n",
            summary.rollout,
            count(total, "device"),
            summary.release
        ),
        state => format!(
            "Rollout {} ended {state}: {updated} of {} run {}; the other groups did not start.\n",
            summary.rollout,
            count(total, "device"),
            summary.release
        ),
    };
    for d in summary
        .devices
        .iter()
        .filter(|d| d.phase == "failed" || d.phase == "refused")
    {
        out.push_str(&format!(
            "  {} ({}) {}: {}; it rolled back and still runs {}.\n",
            d.id,
            d.group.as_deref().unwrap_or("-"),
            d.phase,
            d.reason.as_deref().unwrap_or("no reason given"),
            d.installed.as_deref().unwrap_or("its previous release"),
        ));
    }
    out.push_str(&format!(
        "Each group needs {SUCCESS_THRESHOLD} of its devices ready before the next starts, and pauses the rollout when more than {ERROR_THRESHOLD} fail.\n"
    ));
    out.push_str("Decisions:\n");
    for d in &summary.decisions {
        out.push_str(&format!("  - {d}\n"));
    }
    if summary.state == "paused" {
        out.push_str(&format!(
            "On a real coordinator an operator would now look at the failures and run `flotilla rollout resume {}` or `flotilla rollout stop {}`.\n",
            summary.rollout, summary.rollout
        ));
    }
    out
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_protocol::control::{GroupStatus, TraceEntry};

    fn status(state: &str, in_progress: usize) -> RolloutStatus {
        RolloutStatus {
            name: ROLLOUT.into(),
            release: RELEASE.into(),
            state: state.into(),
            groups: vec![GroupStatus {
                name: "group-1".into(),
                state: "error".into(),
                total: 2,
                ready: 1,
                failed: 1,
                in_progress,
                scheduled: 0,
                devices: [
                    ("dev-01".to_owned(), "failed".to_owned()),
                    ("dev-02".to_owned(), "ready".to_owned()),
                ]
                .into_iter()
                .collect(),
                ..GroupStatus::default()
            }],
            trace: vec![TraceEntry {
                at: 1,
                rollout: ROLLOUT.into(),
                message: "group group-1 paused: 1 of 2 failed > 30%".into(),
                ..TraceEntry::default()
            }],
            ..RolloutStatus::default()
        }
    }

    #[test]
    fn paused_rollout_settles_only_when_nothing_runs() {
        assert!(!is_settled(&status("paused", 1)));
        assert!(is_settled(&status("paused", 0)));
        assert!(!is_settled(&status("running", 0)));
        assert!(is_settled(&status("finished", 0)));
    }

    #[test]
    fn summary_explains_failures_and_the_pause() {
        let devices = vec![DeviceSummary {
            id: "dev-01".into(),
            hardware_id: "demo-board".into(),
            labels: BTreeMap::new(),
            online: true,
            installed: None,
            rollout: Some(ROLLOUT.into()),
            phase: Some("failed".into()),
            reason: Some("health check self-test failed".into()),
            enrollment: None,
            last_seen: None,
            overdue: false,
        }];
        let summary = summarize(&status("paused", 0), &devices);
        assert_eq!(summary.devices[0].group.as_deref(), Some("group-1"));
        let text = explain(&summary);
        assert!(text.contains("ended paused"), "{text}");
        assert!(
            text.contains("dev-01 (group-1) failed: health check self-test failed"),
            "{text}"
        );
        assert!(text.contains("1 of 2 failed > 30%"), "{text}");
        assert!(text.contains("flotilla rollout resume"), "{text}");
    }

    #[test]
    fn refuses_impossible_arguments() {
        let args = DemoArgs {
            devices: 2,
            fail: 0,
            json: false,
            keep: false,
            agent_bin: None,
            timeout: 10,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let err = rt.block_on(run(args)).expect_err("too few devices");
        assert!(err.to_string().contains("at least 3"), "{err}");
    }
}
