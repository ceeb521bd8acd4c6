//! `flotilla-agent`: the device daemon's command line. Parses arguments, sets up logging, and
//! calls the library; everything worth testing lives in `flotilla_agent`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use flotilla_agent::log_filter;
use tokio_util::sync::CancellationToken;
use tracing_subscriber::layer::SubscriberExt as _;

#[derive(Debug, Parser)]
#[command(
    name = "flotilla-agent",
    version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("FLOTILLA_BUILD"), ")"),
    about = "flotilla device agent"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the agent until SIGINT or SIGTERM.
    Run {
        #[arg(long)]
        config: PathBuf,
    },
    /// Validate a config file: prints "config ok" or the error (exit status 1).
    CheckConfig {
        #[arg(long)]
        config: PathBuf,
    },
    /// Print the commented default configuration.
    PrintDefaultConfig,
    /// Print this device's public key (hex), making the key on first use, so an operator can
    /// pre-authorize it or compare it before `flotilla devices accept --key`.
    Identity {
        #[arg(long)]
        config: PathBuf,
    },
    /// Show the installed release and the current action (no broker). Works while the agent
    /// runs: it then shows the status as of the agent's last report.
    Status {
        #[arg(long)]
        config: PathBuf,
    },
    /// Give local consent to a soft or time-forced action (default: the one waiting for it).
    Consent {
        #[arg(long)]
        config: PathBuf,
        /// The action to consent to; see `status` for the one that waits.
        action_id: Option<String>,
    },
    /// Key rotation (the agent must be stopped).
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// Install a keys document signed by enough of the device's root keys.
    Install {
        #[arg(long)]
        config: PathBuf,
        /// The signed keys document file.
        file: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (filter, warning) = log_filter::parse(std::env::var("RUST_LOG").ok().as_deref());
    let subscriber = tracing_subscriber::fmt()
        // The builder's own level (INFO by default) would hide what `RUST_LOG` enables below
        // it: the filter decides alone.
        .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
        .with_writer(std::io::stderr)
        // No colour codes: the agent logs to journald or a file, and its release build leaves
        // out tracing-subscriber's `ansi` feature (size; the workspace's Cargo.toml).
        .with_ansi(false)
        .finish()
        .with(filter);
    // Not `.init()`: where tracing-subscriber's `tracing-log` feature is on (a build together
    // with the coordinator, whose embedded broker asks for it), `init` also installs the bridge
    // from the `log` crate, and the agent would differ by how it was built
    // (docs/decisions/0065-one-agent-binary.md). The first and only global subscriber.
    tracing::subscriber::set_global_default(subscriber)
        .expect("no other global subscriber is set before this one");
    if let Some(warning) = warning {
        tracing::warn!("{warning}");
    }
    match real_main(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Library errors already include their cause in their message.
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Writes to standard output; a reader that went away (`flotilla-agent status | head`) ends the
/// command quietly instead of a panic.
fn write_out(text: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_fmt(text).and_then(|()| stdout.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: cannot write to standard output: {e}");
        std::process::exit(1);
    }
}

macro_rules! out {
    ($($arg:tt)*) => { write_out(format_args!($($arg)*)) };
}

macro_rules! outln {
    ($($arg:tt)*) => { write_out(format_args!("{}\n", format_args!($($arg)*))) };
}

fn real_main(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::PrintDefaultConfig => {
            out!("{}", flotilla_agent::DEFAULT_CONFIG);
            Ok(())
        }
        Command::Identity { config } => {
            let config = flotilla_agent::Config::load(&config)?;
            let key = flotilla_agent::identity::public_key(&config.data_dir)?;
            outln!("{key}");
            Ok(())
        }
        Command::CheckConfig { config } => {
            flotilla_agent::Config::load(&config)?;
            outln!("config ok");
            Ok(())
        }
        Command::Status { config } => {
            let config = flotilla_agent::Config::load(&config)?;
            out!("{}", flotilla_agent::status(&config)?);
            Ok(())
        }
        Command::Consent { config, action_id } => {
            let config = flotilla_agent::Config::load(&config)?;
            let (action_id, path) = flotilla_agent::consent(&config, action_id.as_deref())?;
            outln!(
                "consent given to {action_id} ({}); the agent proceeds within a second",
                path.display()
            );
            Ok(())
        }
        Command::Keys {
            command: KeysCommand::Install { config, file },
        } => {
            let config = flotilla_agent::Config::load(&config)?;
            let ring = flotilla_agent::trust::install_keys(&config, &file)?;
            outln!(
                "keys version {} installed: {} release, {} coordinator and {} root key(s), \
                 {} root signature(s) needed for the next; used from the agent's next start",
                ring.version,
                ring.release_keys.len(),
                ring.coordinator_keys.len(),
                ring.root_keys.len(),
                ring.root_threshold
            );
            Ok(())
        }
        Command::Run { config } => {
            let config = flotilla_agent::Config::load(&config)?;
            let runtime = tokio::runtime::Runtime::new()
                .map_err(|e| anyhow::anyhow!("cannot start the async runtime: {e}"))?;
            runtime.block_on(async {
                let shutdown = CancellationToken::new();
                tokio::spawn(wait_for_signal(shutdown.clone()));
                flotilla_agent::run(config, shutdown).await
            })?;
            Ok(())
        }
    }
}

async fn wait_for_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("cannot listen for SIGTERM: {e}");
            let _ = tokio::signal::ctrl_c().await;
            shutdown.cancel();
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("signal received, shutting down");
    shutdown.cancel();
}
