//! The download step of an action: artifact by artifact, through the block fetcher (local
//! copies, the grant's peers, the coordinator; every block checked) or the streaming fetcher,
//! persisting progress as it goes.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flotilla_protocol::origin::OriginUrl;
use flotilla_protocol::{ByteCounts, Digest, ReleaseManifest};
use flotilla_targets::UpdateTarget;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::block_list_fetch;
use crate::fetch::{self, FetchError, FetchSpec};
use crate::fetch_blocks::{self, BlockFetch, Sources};
use crate::record::{ActionRecord, State};
use crate::trust::{self};

use crate::env::{downloads_dir, failed, ActionIo, Env, Next};

/// Downloads artifact `index` from `done`, persisting progress and reporting it at most about
/// once a second and at every completed 10%. An artifact whose manifest signs a block list goes
/// through the block fetcher (local copies, the grant's peers, the coordinator; every block
/// checked), one without through the streaming fetcher. Bytes by source are kept per action.
pub(crate) async fn download(
    env: &Env,
    record: &ActionRecord,
    manifest: &ReleaseManifest,
    index: u32,
    done: u64,
    io: &mut ActionIo,
) -> Next {
    let Some(a) = manifest.artifacts.get(index as usize) else {
        return failed(format!("artifact #{index} is not in the manifest"), false);
    };
    let spec = FetchSpec {
        name: a.name.clone(),
        sha256: a.sha256,
        size: a.size,
        dir: downloads_dir(&env.config),
        block_size: env.config.download.block_size,
        in_flight: env.config.download.in_flight,
        max_bytes_per_sec: env.config.download.max_bytes_per_sec,
    };
    let block_index = record
        .action
        .body
        .install()
        .and_then(|install| trust::manifest_blocks(install.manifest))
        .and_then(|m| m.block_index(index as usize).copied());
    let sources = match block_index {
        Some(_) => Sources {
            origin: origin_of(record, &a.sha256),
            ..block_sources(env, record, manifest).await
        },
        None => Sources::default(),
    };
    let total: u64 = manifest
        .artifacts
        .iter()
        .map(|a| a.size)
        .sum::<u64>()
        .max(1);
    let before: u64 = manifest
        .artifacts
        .iter()
        .take(index as usize)
        .map(|a| a.size)
        .sum();
    let latest = Arc::new(AtomicU64::new(done));
    let decile = Arc::new(Notify::new());
    let mut last_flush = done;
    let mut progress_record = record.clone();
    let mut on_progress = {
        let latest = latest.clone();
        let decile = decile.clone();
        let store = env.store.clone();
        move |d: u64, counts: &ByteCounts| {
            let old = latest.swap(d, Ordering::Relaxed);
            progress_record.state = State::Downloading {
                artifact: index,
                done: d,
            };
            // A cheap insert per block; a flush per MiB bounds what a power cut can lose.
            let _ = store.save_action_unflushed(&progress_record);
            let _ = store.set_action_bytes(&progress_record.action_id, counts);
            // Same boundary at which the fetcher syncs the part file, just after it.
            if d >> 20 != last_flush >> 20 {
                let _ = store.flush();
                last_flush = d;
            }
            if (before + old) * 10 / total != (before + d) * 10 / total {
                decile.notify_one();
            }
        }
    };
    let mut counts = env
        .store
        .action_bytes(&record.action_id)
        .ok()
        .flatten()
        .unwrap_or_default();
    // Peers this action stopped asking, kept from one artifact (and one restart) to the next.
    let mut bypassed = env
        .store
        .action_bypassed(&record.action_id)
        .unwrap_or_default();
    // Both a signed cancel and shutdown stop the download.
    let stop = CancellationToken::new();
    let result = {
        let counts = &mut counts;
        let requests = &io.fetch_requests;
        let inputs = &mut io.fetch_inputs;
        let bypassed = &mut bypassed;
        let stop = &stop;
        let spec = &spec;
        let sources = &sources;
        let fetch_fut = async move {
            match block_index {
                Some(block_index) => {
                    let list = block_list_fetch::fetch_block_list(
                        spec,
                        &block_index,
                        counts,
                        requests,
                        inputs,
                        stop,
                    )
                    .await?;
                    let job = BlockFetch {
                        spec,
                        list: &list,
                        sources,
                        bypassed,
                    };
                    fetch_blocks::fetch_blocks(
                        job,
                        counts,
                        requests,
                        inputs,
                        &mut on_progress,
                        stop,
                    )
                    .await
                }
                None => {
                    fetch::fetch(spec, done, counts, requests, inputs, &mut on_progress, stop).await
                }
            }
        };
        tokio::pin!(fetch_fut);
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut reported = done;
        loop {
            tokio::select! {
                r = &mut fetch_fut => break r,
                _ = io.shutdown.cancelled(), if !stop.is_cancelled() => stop.cancel(),
                _ = io.cancel.cancelled(), if !stop.is_cancelled() => stop.cancel(),
                _ = tick.tick() => {}
                _ = decile.notified() => {}
            }
            let now_done = latest.load(Ordering::Relaxed);
            if now_done != reported {
                reported = now_done;
                let mut r = record.clone();
                r.state = State::Downloading {
                    artifact: index,
                    done: now_done,
                };
                env.report_progress(&r);
            }
        }
    };
    if let Err(e) = env.store.set_action_bytes(&record.action_id, &counts) {
        tracing::warn!("{e}");
    }
    if let Err(e) = env.store.set_action_bypassed(&record.action_id, &bypassed) {
        tracing::warn!("{e}");
    }
    match result {
        Ok(_) if (index as usize) + 1 < manifest.artifacts.len() => {
            Next::State(State::Downloading {
                artifact: index + 1,
                done: 0,
            })
        }
        Ok(_) => Next::State(State::Verified),
        Err(FetchError::Canceled) if io.shutdown.is_cancelled() => {
            let _ = env.store.flush();
            Next::Interrupted
        }
        Err(FetchError::Canceled) => {
            // Never resumed: nothing of it stays behind (a shutdown keeps it, above).
            block_list_fetch::discard_partial(&spec, block_index.as_ref());
            Next::State(State::Canceled)
        }
        Err(e) => failed(e.to_string(), false),
    }
}

/// The HTTP(S) origin the action names for the artifact `sha256`, if any and if it is an
/// `http` or `https` URL (anything else is logged and ignored: the coordinator serves it).
fn origin_of(record: &ActionRecord, sha256: &Digest) -> Option<OriginUrl> {
    let install = record.action.body.install()?;
    let origin = install.origins.iter().find(|o| o.sha256 == *sha256)?;
    match OriginUrl::parse(&origin.url) {
        Ok(url) => Some(url),
        Err(e) => {
            tracing::warn!(action = record.action_id, "not using the HTTP origin: {e}");
            None
        }
    }
}

/// Where the blocks of a block-indexed artifact may come from: the peers of the action's grant
/// (when it has one that still verifies) and what the targets hold.
async fn block_sources(env: &Env, record: &ActionRecord, manifest: &ReleaseManifest) -> Sources {
    let me = env.config.device_id.as_str();
    let grant = record.action.body.install().and_then(|i| i.grant).cloned();
    let peers = match &grant {
        Some(blob) => {
            let keys = env.trust_state().ring(&env.config.trust).coordinator_keys;
            match trust::check_grant(blob, &keys, me, &record.action_id) {
                Ok(grant) => grant.sources.into_iter().filter(|p| p != me).collect(),
                Err(refusal) => {
                    tracing::warn!(
                        action = record.action_id,
                        "not asking peers: {refusal}; fetching from the coordinator"
                    );
                    Vec::new()
                }
            }
        }
        None => Vec::new(),
    };
    let targets: Vec<Arc<dyn UpdateTarget>> = manifest
        .artifacts
        .iter()
        .filter_map(|a| env.targets.get(&a.target).cloned())
        .collect();
    let local = tokio::task::spawn_blocking(move || {
        let mut paths: Vec<PathBuf> = Vec::new();
        for target in targets {
            for path in target.block_sources() {
                if !paths.contains(&path) {
                    paths.push(path);
                }
            }
        }
        paths
    })
    .await
    .unwrap_or_default();
    Sources {
        grant: if peers.is_empty() { None } else { grant },
        peers,
        peer_timeout: env.config.download.peer_timeout,
        slow_block: env.config.download.peer_slow_block,
        fallback_after: env.config.download.peer_fallback_after,
        local,
        origin: None,
        origin_tls: env.config.origins.tls.clone(),
    }
}
