//! The `flotilla-fleetsim` binary: parse arguments, set up logging and signals, run.

use std::process::ExitCode;

use clap::Parser as _;
use flotilla_fleetsim::{args::Args, baseline, download, probe, sim};
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(filter)
        .init();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    if args.first_answer {
        let connection = args.connection()?;
        let key = args
            .probe_key()?
            .ok_or_else(|| anyhow::anyhow!("--first-answer needs --probe-key"))?;
        let timeout = match &args.timeout {
            Some(t) => flotilla_fleetsim::args::parse_duration("--timeout", t)?,
            None => std::time::Duration::from_secs(120),
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        let took = runtime.block_on(probe::first_answer(
            &connection,
            &args.topic_root,
            &key,
            timeout,
        ));
        let took = took.ok_or_else(|| anyhow::anyhow!("no answer within --timeout {timeout:?}"))?;
        println!("first_answer_s: {:.3}", took.as_secs_f64());
        return Ok(());
    }
    if let Some(count) = args.idle_probes {
        let connection = args.connection()?;
        let key = args
            .probe_key()?
            .ok_or_else(|| anyhow::anyhow!("--idle-probes needs --probe-key"))?;
        let each = match &args.timeout {
            Some(t) => flotilla_fleetsim::args::parse_duration("--timeout", t)?,
            None => std::time::Duration::from_secs(5),
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        let figures = runtime.block_on(probe::idle(
            &connection,
            &args.topic_root,
            &key,
            count,
            std::time::Duration::from_millis(20),
            each,
        ))?;
        print!("{figures}");
        return Ok(());
    }
    if args.stream_bytes.is_some() || args.watch_device.is_some() {
        return download(&args);
    }
    let fleet = args.fleet()?;
    if let Some(path) = &args.write_authorized_keys {
        std::fs::write(path, fleet.authorized_keys())
            .map_err(|e| anyhow::anyhow!("--write-authorized-keys {}: {e}", path.display()))?;
        println!("wrote {} device keys to {}", fleet.len(), path.display());
        return Ok(());
    }
    let options = args.options(fleet.clone())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let shutdown = CancellationToken::new();
        let on_signal = shutdown.clone();
        tokio::spawn(async move {
            wait_for_signal().await;
            on_signal.cancel();
        });
        if let Some(groups) = args.baseline_groups {
            let stand_in = baseline::StandIn {
                fleet,
                offline_share: options.offline_share,
                connection: options.connection.clone(),
                topic_root: options.topic_root.clone(),
                hardware_id: options.hardware_id.clone(),
                groups,
            };
            tokio::spawn(baseline::stand_in(stand_in, shutdown.child_token()));
        }
        let summary = sim::run(options, shutdown.clone()).await?;
        print!("{summary}");
        shutdown.cancel();
        Ok(())
    })
}

/// `--stream-bytes` (the baseline) or `--watch-device` (one agent's download).
fn download(args: &Args) -> anyhow::Result<()> {
    let connection = args.connection()?;
    let timeout = match &args.timeout {
        Some(t) => flotilla_fleetsim::args::parse_duration("--timeout", t)?,
        None => std::time::Duration::from_secs(600),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if let Some(bytes) = args.stream_bytes {
        if args.stream_block == 0 {
            anyhow::bail!("--stream-block 0: must be at least 1");
        }
        let figures = runtime.block_on(download::stream(
            &connection,
            &args.topic_root,
            bytes,
            args.stream_block,
            timeout,
        ))?;
        print!("{figures}");
        return Ok(());
    }
    let device = args.watch_device.as_deref().unwrap_or_default();
    let device = flotilla_protocol::DeviceId::new(device)
        .map_err(|e| anyhow::anyhow!("--watch-device {device:?}: {e}"))?;
    let key = args.device_key()?;
    let figures = runtime.block_on(download::watch(
        &connection,
        &args.topic_root,
        &device,
        &key,
        timeout,
    ))?;
    print!("{figures}");
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
