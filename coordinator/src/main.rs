//! The `flotilla` binary: parse arguments, set up logging and signals, call the library.

use std::process::ExitCode;

use flotilla_coordinator::cli::{self, demo, Cli, Cmd};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::Layer as _;

fn main() -> ExitCode {
    let cli = Cli::parse_args();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(cli.default_log_level()));
    let stderr = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_filter(filter);
    // The demo also logs its coordinator into coordinator.log in its directory.
    let demo_log = matches!(cli.command, Cmd::Demo(_)).then(demo::log_layer);
    tracing_subscriber::registry()
        .with(stderr)
        .with(demo_log)
        .init();

    match run(cli) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            ExitCode::from(1)
        }
    }
}

/// The error and its causes joined with ": ", skipping a cause whose text the message already
/// carries (most of our error messages embed their source, so plain `{:#}` would repeat it).
fn error_chain(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

fn run(cli: Cli) -> anyhow::Result<i32> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if let Cmd::Demo(args) = cli.command {
        return Ok(runtime.block_on(demo::run(args))?);
    }
    runtime.block_on(async {
        let shutdown = CancellationToken::new();
        tokio::spawn(cancel_on_signal(shutdown.clone()));
        Ok(cli::run(cli, shutdown).await?)
    })
}

/// Cancels `shutdown` on SIGINT or SIGTERM so `serve` stops between effects, not in the middle.
async fn cancel_on_signal(shutdown: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut term) = signal(SignalKind::terminate()) else {
            let _ = tokio::signal::ctrl_c().await;
            shutdown.cancel();
            return;
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
    tracing::info!("shutting down");
    shutdown.cancel();
}
