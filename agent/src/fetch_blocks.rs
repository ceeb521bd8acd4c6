//! The block fetcher: downloads an artifact whose manifest signs a block list, from several
//! sources, checking every block against its signed hash before it is written.
//!
//! ```text
//! block list   <sha256>.blocks, checked against the manifest's BlockIndexRef (fetched first,
//!              from the coordinator, by its own digest: see crate::block_list_fetch)
//! local        blocks of <sha256>.part that already verify (a resumed download), then blocks
//!              copied from what the device holds (crate::adaptive), counted as `local`
//! peers        each missing block is asked of the grant's peers, in grant order
//! http         the artifact's HTTP(S) origin, if the action names one (crate::http_origin,
//!              decision 0062), once the peers delivered nothing for `fallback_after` or every
//!              peer is bypassed; the origin is bypassed for the artifact on its first bad
//!              block, error status, broken connection, or `peer_timeout` without a block
//!              while it owes some
//! coordinator  once the peers delivered nothing for `fallback_after`, or every peer is
//!              bypassed (bad, silent, unable or slow), and the origin (if any) is bypassed
//! end          the whole file's sha256 is still checked; <sha256>.part -> <sha256>
//! ```
//!
//! Rules per block (a block is one request, since a manifest's block size is at most the
//! largest reply):
//!
//! - A reply is checked against the block's signed hash. A block that matches is written at its
//!   offset and counted to the source whose topic it came on, whoever was asked.
//! - A peer that serves a block failing its hash is bypassed for the rest of the action (logged
//!   naming the peer and the block); so is a peer that leaves a block unanswered for
//!   `peer_timeout`, or answers `Unavailable` [`PEER_UNAVAILABLE_LIMIT`] times in a row.
//! - A slow peer is bypassed too (decision 0035). Every answer a peer gives is timed, from the
//!   request to the reply, less the time this fetcher spent in its own rate limit; a block
//!   costs the peer its own answer plus the `Unavailable` answers it gave since its previous
//!   block. Once its last [`PEER_SLOW_BLOCKS`] blocks (fewer at the start) cost more than
//!   [`PEER_SLOW_BLOCKS`] × `slow_block` in all, it is bypassed ("slow: …"). A peer that is
//!   kept therefore answers at `slow_block` per block on average or better: answering every
//!   block just within `peer_timeout` no longer holds a device, and neither does padding slow
//!   blocks with refusals.
//! - `Unavailable` from a peer is transient (it may be busy serving others): the block is asked
//!   of the next peer; once every peer still in use said so, the peers are asked again after
//!   [`PEER_RETRY`], for as long as the peers make progress. A block goes to the coordinator
//!   once no peer is left, or the peers delivered nothing for `fallback_after`: the bound for
//!   peers that each stay under every limit above (busy, answering slowly) while the download
//!   waits on all of them together.
//! - A bad block from the coordinator is discarded and asked for again after a backoff, at most
//!   [`crate::fetch::BLOCK_ATTEMPTS`] times; an idle coordinator is asked again for everything
//!   outstanding after [`crate::fetch::REPLY_TIMEOUT`], as in the streaming fetcher.
//! - At most `in_flight` requests are outstanding across all sources (once the origin is the
//!   source asked, [`ORIGIN_WINDOW_BYTES`] of blocks, which its workers ask for in runs); the
//!   rate limit counts the bytes fetched over the network (not local copies).
//! - Resumable: the part file is the state. After a kill, its blocks are hashed again and only
//!   the ones that fail are fetched.
//! - The whole file's sha256 is computed on the way, in file order, on a thread of its own
//!   (crate::whole_hash): blocks that arrive ahead of a gap are held in memory up to a bound,
//!   past it read back from the part file once the gap fills, so the check at the end reads
//!   only what was not hashed yet instead of the whole artifact.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Duration;

use flotilla_protocol::blocks::{block_range, BlockList};
use flotilla_protocol::{BlockReply, BlockRequest, ByteCounts, PeerFetch};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::adaptive;
use crate::block_list_fetch;
use crate::fetch::{
    self, count_peer, FetchError, FetchInput, FetchRequest, FetchSpec, Progress, Retries,
    REPLY_TIMEOUT,
};
use crate::http_origin::{OriginEvent, OriginFetcher};
use crate::whole_hash::WholeHash;
use flotilla_protocol::origin::HTTP_SOURCE;

pub use crate::block_sources::{
    Sources, ORIGIN_WINDOW_BYTES, PEER_RETRY, PEER_SLOW_BLOCKS, PEER_UNAVAILABLE_LIMIT,
};

/// The part file is synced whenever the verified bytes cross a multiple of this.
const SYNC_EVERY: u64 = 1 << 20;

/// Where a request went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Coordinator,
    /// Index into `Sources::peers`.
    Peer(usize),
    /// The artifact's HTTP(S) origin.
    Http,
}

/// What to do with a block that is to be asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Choice {
    Ask(Source),
    /// Every peer in use answered `Unavailable` for it: ask them again after [`PEER_RETRY`].
    Later,
}

/// A block asked for and not yet received.
#[derive(Debug, Clone, Copy)]
struct Asked {
    source: Source,
    at: Instant,
    /// `Download::throttled` when it was asked: the rate limit's sleeps since then are the
    /// fetcher's own delay, not the source's.
    throttled: Duration,
}

/// One peer's standing in this action.
#[derive(Debug, Default)]
struct PeerState {
    bypassed: Option<String>,
    /// `Unavailable` answers since its last good block.
    unavailable: u32,
    /// What each of its last [`PEER_SLOW_BLOCKS`] blocks cost: the time of its answer and of
    /// the `Unavailable` answers before it. Oldest first.
    costs: VecDeque<Duration>,
    /// The time of its `Unavailable` answers since its last block, charged to its next one.
    refusing: Duration,
}

/// What the download of one artifact needs from the fetcher's caller.
pub struct BlockFetch<'a> {
    pub spec: &'a FetchSpec,
    pub list: &'a BlockList,
    pub sources: &'a Sources,
    /// Peers bypassed in this action so far, and why: kept from one artifact to the next, so a
    /// peer that served a bad block is not asked again in the same action.
    pub bypassed: &'a mut BTreeMap<String, String>,
}

/// Downloads `job.spec` block by block from the local copies, the peers and the coordinator.
/// `progress` gets the verified bytes so far and `counts`, which every accepted byte is added
/// to by source. Returns the path of the verified artifact.
pub async fn fetch_blocks(
    job: BlockFetch<'_>,
    counts: &mut ByteCounts,
    requests: &mpsc::Sender<FetchRequest>,
    inputs: &mut mpsc::Receiver<FetchInput>,
    progress: &mut Progress<'_>,
    cancel: &CancellationToken,
) -> Result<PathBuf, FetchError> {
    let spec = job.spec;
    let artifact = spec.name.clone();
    std::fs::create_dir_all(&spec.dir).map_err(|source| FetchError::CreateDir {
        artifact: artifact.clone(),
        path: spec.dir.clone(),
        source,
    })?;
    let final_path = spec.final_path();
    if let Ok((digest, size)) = fetch::hash_file(&final_path) {
        if digest == spec.sha256 && size == spec.size {
            progress(spec.size, counts);
            return Ok(final_path);
        }
    }

    // The part file, what of it verifies, and what the device already holds: file work, on the
    // blocking pool.
    let prepared = {
        let part = spec.part_path();
        let list = job.list.clone();
        let size = spec.size;
        let mut candidates = adaptive::downloaded_artifacts(&spec.dir, &spec.sha256);
        candidates.extend(job.sources.local.iter().cloned());
        tokio::task::spawn_blocking(move || {
            block_list_fetch::prepare(&part, &list, size, &candidates)
        })
        .await
        .map_err(|e| FetchError::ReadPart {
            artifact: artifact.clone(),
            path: spec.part_path(),
            source: std::io::Error::other(e.to_string()),
        })?
    };
    let result = match prepared {
        Ok((file, present, copied)) => {
            if copied > 0 {
                counts.local += copied;
                tracing::info!(
                    artifact,
                    bytes = copied,
                    "copied blocks the device already holds"
                );
            }
            Download::new(job, file, present)
                .run(counts, requests, inputs, progress, cancel)
                .await
        }
        Err(source) => Err(FetchError::WritePart {
            artifact: artifact.clone(),
            path: spec.part_path(),
            source,
        }),
    };
    if let Err(FetchError::WritePart { .. }) = &result {
        // Typically a full disk: the partial download must not keep the space.
        let _ = std::fs::remove_file(spec.part_path());
    }
    result
}

/// The state of one block-indexed download.
struct Download<'a> {
    spec: &'a FetchSpec,
    list: &'a BlockList,
    sources: &'a Sources,
    bypassed: &'a mut BTreeMap<String, String>,
    file: File,
    present: Vec<bool>,
    /// Bytes of verified blocks in the part file.
    done: u64,
    /// Blocks to ask for, next first.
    queue: VecDeque<u64>,
    asked: BTreeMap<u64, Asked>,
    /// block -> peers already tried for it.
    tried: BTreeMap<u64, BTreeSet<usize>>,
    /// (when, block): blocks to ask the peers for again.
    peer_retries: Vec<(Instant, u64)>,
    peers: Vec<PeerState>,
    retries: Retries,
    started: Instant,
    /// Network bytes since `started`, for the rate limit.
    fetched: u64,
    /// Time spent sleeping in the rate limit, all told.
    throttled: Duration,
    /// The start, or when a peer last delivered a verified block.
    peer_heard: Instant,
    /// Last time the coordinator answered or was asked again: when it has been idle for
    /// [`REPLY_TIMEOUT`], its outstanding blocks are asked for again.
    coordinator_heard: Instant,
    /// The whole file's sha256, on a thread of its own; taken at the end.
    whole: Option<WholeHash>,
    /// The origin's workers while it is in use; `None` without one or once it is bypassed.
    origin: Option<OriginFetcher>,
    /// When the origin last delivered a block, or was asked with nothing outstanding; and
    /// `throttled` then. It is bypassed once it delivers nothing for `peer_timeout`.
    origin_heard: (Instant, Duration),
}

impl<'a> Download<'a> {
    fn new(job: BlockFetch<'a>, file: File, present: Vec<bool>) -> Self {
        let spec = job.spec;
        let list = job.list;
        let done = present
            .iter()
            .enumerate()
            .filter(|(_, p)| **p)
            .map(|(i, _)| u64::from(block_range(i as u64, spec.size, list.block_size()).1))
            .sum();
        let queue = present
            .iter()
            .enumerate()
            .filter(|(_, p)| !**p)
            .map(|(i, _)| i as u64)
            .collect();
        let peers = if job.sources.grant.is_some() {
            job.sources
                .peers
                .iter()
                .map(|name| PeerState {
                    bypassed: job.bypassed.get(name).cloned(),
                    ..PeerState::default()
                })
                .collect()
        } else {
            Vec::new()
        };
        let now = Instant::now();
        Self {
            spec,
            list,
            sources: job.sources,
            bypassed: job.bypassed,
            file,
            present,
            done,
            queue,
            asked: BTreeMap::new(),
            tried: BTreeMap::new(),
            peer_retries: Vec::new(),
            peers,
            retries: Retries::default(),
            started: now,
            fetched: 0,
            throttled: Duration::ZERO,
            peer_heard: now,
            coordinator_heard: now,
            origin_heard: (now, Duration::ZERO),
            whole: Some(WholeHash::new(spec.size, list.block_size())),
            origin: job.sources.origin.clone().map(|url| {
                OriginFetcher::start(
                    url,
                    job.sources.origin_tls.clone(),
                    spec.size,
                    std::sync::Arc::new(list.clone()),
                    spec.in_flight,
                )
            }),
        }
    }

    fn peer_name(&self, i: usize) -> &str {
        &self.sources.peers[i]
    }

    /// Where block `block` should be asked now, while the peers' time lasts: the first peer
    /// in use not yet tried for it, or (every one of them answered `Unavailable`) the peers
    /// again after [`PEER_RETRY`]. Otherwise the coordinator.
    fn source_for(&self, block: u64) -> Choice {
        let after_peers = if self.origin.is_some() {
            Source::Http
        } else {
            Source::Coordinator
        };
        if self.past_peers() {
            return Choice::Ask(after_peers);
        }
        let tried = self.tried.get(&block);
        let mut in_use = false;
        for (i, peer) in self.peers.iter().enumerate() {
            if peer.bypassed.is_none() {
                in_use = true;
                if tried.is_none_or(|t| !t.contains(&i)) {
                    return Choice::Ask(Source::Peer(i));
                }
            }
        }
        if in_use {
            Choice::Later
        } else {
            Choice::Ask(after_peers)
        }
    }

    /// Whether the peers' time is over: they delivered nothing for `fallback_after`, or every
    /// one of them is bypassed (or there are none).
    fn past_peers(&self) -> bool {
        self.peer_heard.elapsed() >= self.sources.fallback_after
            || self.peers.iter().all(|p| p.bypassed.is_some())
    }

    /// How many blocks may be outstanding: `in_flight`, or once the origin is the source asked,
    /// [`ORIGIN_WINDOW_BYTES`] of blocks, so its connections ask for runs of blocks.
    fn window(&self) -> usize {
        let in_flight = self.spec.in_flight.max(1);
        if self.origin.is_some() && self.past_peers() {
            let blocks = ORIGIN_WINDOW_BYTES / u64::from(self.list.block_size().max(1));
            in_flight.max(blocks as usize)
        } else {
            in_flight
        }
    }

    /// Whether any block is outstanding at the origin.
    fn origin_owes(&self) -> bool {
        self.asked.values().any(|a| a.source == Source::Http)
    }

    fn request(&self, block: u64) -> BlockRequest {
        let (offset, length) = block_range(block, self.spec.size, self.list.block_size());
        BlockRequest {
            sha256: self.spec.sha256,
            offset,
            length,
        }
    }

    async fn ask(
        &mut self,
        block: u64,
        source: Source,
        requests: &mpsc::Sender<FetchRequest>,
        cancel: &CancellationToken,
    ) -> Result<(), FetchError> {
        let request = self.request(block);
        let message = match (source, &self.sources.grant) {
            (Source::Peer(i), Some(grant)) => {
                self.tried.entry(block).or_default().insert(i);
                FetchRequest::Peer {
                    peer: self.peer_name(i).to_owned(),
                    fetch: PeerFetch {
                        grant: grant.clone(),
                        request,
                    },
                }
            }
            (Source::Http, _) => match &self.origin {
                Some(origin) => {
                    if !self.origin_owes() {
                        self.origin_heard = (Instant::now(), self.throttled);
                    }
                    origin.ask(request.offset, request.length);
                    self.asked.insert(
                        block,
                        Asked {
                            source,
                            at: Instant::now(),
                            throttled: self.throttled,
                        },
                    );
                    return Ok(());
                }
                None => FetchRequest::Coordinator(request),
            },
            _ => FetchRequest::Coordinator(request),
        };
        let source = match source {
            Source::Http => Source::Coordinator, // the origin was bypassed meanwhile
            other => other,
        };
        fetch::ask(requests, message, &self.spec.name, cancel).await?;
        self.asked.insert(
            block,
            Asked {
                source,
                at: Instant::now(),
                throttled: self.throttled,
            },
        );
        Ok(())
    }

    /// How long `asked`'s source took to answer it, up to now, less the fetcher's own sleeps
    /// in the rate limit meanwhile (replies wait in the channel while it sleeps).
    fn answer_time(&self, asked: &Asked) -> Duration {
        asked
            .at
            .elapsed()
            .saturating_sub(self.throttled.saturating_sub(asked.throttled))
    }

    /// Charges peer `i` for a block it delivered after `answer` (plus its refusals since its
    /// last block), and bypasses it as slow once its last [`PEER_SLOW_BLOCKS`] blocks cost more
    /// than that many times `slow_block`.
    fn charge(&mut self, i: usize, answer: Duration) {
        let budget = self
            .sources
            .slow_block
            .saturating_mul(PEER_SLOW_BLOCKS as u32);
        let peer = &mut self.peers[i];
        let cost = std::mem::take(&mut peer.refusing) + answer;
        peer.costs.push_back(cost);
        if peer.costs.len() > PEER_SLOW_BLOCKS {
            peer.costs.pop_front();
        }
        let total: Duration = peer.costs.iter().sum();
        if total > budget {
            let reason = format!(
                "slow: its answers for its last {} blocks took {:.1}s, more than \
                 {PEER_SLOW_BLOCKS} × peer_slow_block ({:?})",
                peer.costs.len(),
                total.as_secs_f64(),
                self.sources.slow_block
            );
            self.bypass(i, reason);
        }
    }

    /// Stops asking peer `i` for anything in this action; its outstanding blocks go back to
    /// the front of the queue.
    fn bypass(&mut self, i: usize, reason: String) {
        let Some(peer) = self.peers.get_mut(i) else {
            return;
        };
        if peer.bypassed.is_some() {
            return;
        }
        tracing::warn!(
            artifact = self.spec.name,
            peer = self.sources.peers[i],
            "bypassing peer {} for the rest of this action: {reason}",
            self.sources.peers[i]
        );
        self.bypassed
            .insert(self.sources.peers[i].clone(), reason.clone());
        peer.bypassed = Some(reason);
        let theirs: Vec<u64> = self
            .asked
            .iter()
            .filter(|(_, a)| a.source == Source::Peer(i))
            .map(|(b, _)| *b)
            .collect();
        for block in theirs.into_iter().rev() {
            self.asked.remove(&block);
            self.queue.push_front(block);
        }
    }

    /// Stops using the origin for this artifact (its workers stop); the blocks asked of it go
    /// back to the front of the queue, for the peers' time left or the coordinator.
    fn bypass_origin(&mut self, block: Option<u64>, reason: String) {
        if self.origin.take().is_none() {
            return;
        }
        let origin = self
            .sources
            .origin
            .as_ref()
            .map(|u| format!("{}:{}{}", u.host, u.port, u.path))
            .unwrap_or_default();
        let at = block.map(|b| format!(" at block {b}")).unwrap_or_default();
        tracing::warn!(
            artifact = self.spec.name,
            %origin,
            "bypassing the HTTP origin {origin} for this artifact{at}: {reason}; \
             fetching from the peers or the coordinator"
        );
        let theirs: Vec<u64> = self
            .asked
            .iter()
            .filter(|(_, a)| a.source == Source::Http)
            .map(|(b, _)| *b)
            .collect();
        for block in theirs.into_iter().rev() {
            self.asked.remove(&block);
            self.queue.push_front(block);
        }
    }

    /// When the loop must wake up without a reply: the earliest peer timeout, retry, or
    /// coordinator idle time.
    fn next_deadline(&self) -> Instant {
        let mut at = self.coordinator_heard + REPLY_TIMEOUT;
        for a in self.asked.values() {
            if let Source::Peer(_) = a.source {
                at = at.min(a.at + self.sources.peer_timeout);
            }
        }
        if self.origin_owes() {
            // The rate limit's sleeps since the origin was last heard are not the origin's.
            let (heard, throttled) = self.origin_heard;
            let slept = self.throttled.saturating_sub(throttled);
            at = at.min(heard + self.sources.peer_timeout + slept);
        }
        if let Some(due) = self.retries.next_due() {
            at = at.min(due);
        }
        if let Some(due) = self.peer_retries.iter().map(|(due, _)| *due).min() {
            at = at.min(due);
        }
        at
    }

    async fn run(
        mut self,
        counts: &mut ByteCounts,
        requests: &mpsc::Sender<FetchRequest>,
        inputs: &mut mpsc::Receiver<FetchInput>,
        progress: &mut Progress<'_>,
        cancel: &CancellationToken,
    ) -> Result<PathBuf, FetchError> {
        let artifact = self.spec.name.clone();
        progress(self.done, counts);
        loop {
            // Keep the pipeline full.
            while self.asked.len() < self.window() {
                let Some(block) = self.queue.pop_front() else {
                    break;
                };
                if self.present[block as usize] || self.asked.contains_key(&block) {
                    continue;
                }
                match self.source_for(block) {
                    Choice::Ask(source) => self.ask(block, source, requests, cancel).await?,
                    Choice::Later => {
                        self.tried.remove(&block);
                        self.peer_retries.push((Instant::now() + PEER_RETRY, block));
                    }
                }
            }
            if self.present.iter().all(|p| *p) {
                break;
            }

            let deadline = self.next_deadline();
            let (from_origin, input) = tokio::select! {
                _ = cancel.cancelled() => return Err(FetchError::Canceled),
                input = tokio::time::timeout_at(deadline, inputs.recv()) => (None, input),
                event = next_origin(&mut self.origin) => match event {
                    Some(OriginEvent::Block { offset, data }) => {
                        let sha256 = self.spec.sha256;
                        let reply = BlockReply::Data { sha256, offset, data };
                        (Some(Source::Http), Ok(Some(FetchInput::Reply(reply))))
                    }
                    Some(OriginEvent::Failed { offset, reason }) => {
                        let block = self.list.index_at(offset);
                        self.bypass_origin(block, reason);
                        continue;
                    }
                    None => {
                        self.bypass_origin(None, "its workers stopped".to_owned());
                        continue;
                    }
                },
            };
            let (source, reply) = match input {
                Err(_) => {
                    self.on_timeout(requests, cancel).await?;
                    continue;
                }
                Ok(None) => return Err(FetchError::Closed { artifact }),
                Ok(Some(FetchInput::Reconnected)) => {
                    tracing::debug!(artifact, "reconnected: asking for outstanding blocks again");
                    self.retries.asking_all_again();
                    let outstanding: Vec<(u64, Source)> = self
                        .asked
                        .iter()
                        .filter(|(_, a)| a.source != Source::Http)
                        .map(|(b, a)| (*b, a.source))
                        .collect();
                    for (block, source) in outstanding {
                        self.ask(block, source, requests, cancel).await?;
                    }
                    self.coordinator_heard = Instant::now();
                    continue;
                }
                Ok(Some(FetchInput::Reply(reply))) => {
                    (from_origin.unwrap_or(Source::Coordinator), reply)
                }
                Ok(Some(FetchInput::PeerReply { peer, reply })) => {
                    match self.sources.peers.iter().position(|p| *p == peer) {
                        Some(i) if i < self.peers.len() => (Source::Peer(i), reply),
                        // Not a peer of this action: nothing it sends is used.
                        _ => continue,
                    }
                }
            };
            if source == Source::Coordinator {
                self.coordinator_heard = Instant::now();
            }
            if let Some(written) = self.on_reply(source, reply, counts)? {
                self.fetched += written;
                let before = self.done - written;
                self.done_block(before, counts, progress)?;
                let sleeping = Instant::now();
                fetch::throttle(
                    self.spec.max_bytes_per_sec,
                    self.fetched,
                    self.started,
                    cancel,
                )
                .await?;
                self.throttled += sleeping.elapsed();
            }
        }
        let bypassed: Vec<String> = self
            .peers
            .iter()
            .zip(&self.sources.peers)
            .filter_map(|(state, name)| Some(format!("{name} ({})", state.bypassed.as_ref()?)))
            .collect();
        tracing::info!(
            artifact,
            coordinator = counts.coordinator,
            local = counts.local,
            peers = counts.from_peers(),
            http = counts.from_http(),
            bypassed = bypassed.len(),
            "every block verified{}",
            if bypassed.is_empty() {
                String::new()
            } else {
                format!("; peers bypassed: {}", bypassed.join(", "))
            }
        );
        self.finish()
    }

    /// Peers that left a block unanswered too long are bypassed; coordinator retries whose
    /// backoff is over are sent; an idle coordinator is asked again for what it owes.
    async fn on_timeout(
        &mut self,
        requests: &mpsc::Sender<FetchRequest>,
        cancel: &CancellationToken,
    ) -> Result<(), FetchError> {
        let now = Instant::now();
        let late: Vec<(u64, usize)> = self
            .asked
            .iter()
            .filter_map(|(b, a)| match a.source {
                Source::Peer(i) if a.at + self.sources.peer_timeout <= now => Some((*b, i)),
                _ => None,
            })
            .collect();
        for (block, i) in late {
            self.bypass(
                i,
                format!(
                    "no answer for block {block} within {:?}",
                    self.sources.peer_timeout
                ),
            );
        }
        let (heard, throttled) = self.origin_heard;
        let origin_idle = heard
            .elapsed()
            .saturating_sub(self.throttled.saturating_sub(throttled));
        let origin_late = self
            .asked
            .iter()
            .find(|(_, a)| a.source == Source::Http)
            .map(|(b, _)| *b)
            .filter(|_| origin_idle >= self.sources.peer_timeout);
        if let Some(block) = origin_late {
            self.bypass_origin(
                Some(block),
                format!("no answer within {:?}", self.sources.peer_timeout),
            );
        }
        let (due, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.peer_retries)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        self.peer_retries = waiting;
        self.queue.extend(due.into_iter().map(|(_, block)| block));
        for (offset, _) in self.retries.take_due() {
            let Some(block) = self.list.index_at(offset) else {
                continue;
            };
            if self
                .asked
                .get(&block)
                .is_some_and(|a| a.source == Source::Coordinator)
            {
                self.ask(block, Source::Coordinator, requests, cancel)
                    .await?;
            }
        }
        if self.coordinator_heard + REPLY_TIMEOUT <= now {
            let owed: Vec<u64> = self
                .asked
                .iter()
                .filter(|(_, a)| a.source == Source::Coordinator)
                .map(|(b, _)| *b)
                .collect();
            if !owed.is_empty() {
                tracing::debug!(
                    artifact = self.spec.name,
                    outstanding = owed.len(),
                    "asking the coordinator for outstanding blocks again"
                );
                self.retries.asking_all_again();
            }
            for block in owed {
                self.ask(block, Source::Coordinator, requests, cancel)
                    .await?;
            }
            self.coordinator_heard = now;
        }
        Ok(())
    }

    /// Handles one reply from `source`. Returns the bytes written when it was a block this
    /// download still needed and it verified.
    fn on_reply(
        &mut self,
        source: Source,
        reply: BlockReply,
        counts: &mut ByteCounts,
    ) -> Result<Option<u64>, FetchError> {
        let (sha256, offset) = match &reply {
            BlockReply::Data { sha256, offset, .. }
            | BlockReply::Unavailable { sha256, offset, .. } => (*sha256, *offset),
        };
        if sha256 != self.spec.sha256 {
            return Ok(None); // a late answer for another download
        }
        let Some(block) = self.list.index_at(offset) else {
            return Ok(None); // no block starts there: not an answer to anything asked
        };
        // How long the source took, if this answers what it was asked.
        let answered_in = self
            .asked
            .get(&block)
            .filter(|a| a.source == source)
            .map(|a| self.answer_time(a));
        let asked_here = answered_in.is_some();
        let data = match reply {
            BlockReply::Unavailable { reason, .. } => {
                if let Some(took) = answered_in {
                    self.unavailable(block, source, reason, took)?;
                }
                return Ok(None);
            }
            BlockReply::Data { data, .. } => data,
        };
        if self.present[block as usize] {
            return Ok(None); // a duplicate
        }
        // The origin's workers checked its blocks against this same list on their own threads
        // (`http_origin`); a block that failed came as a failure, not as a reply.
        if source != Source::Http && !self.list.verify(block, &data) {
            if asked_here {
                self.bad_block(block, source, data.len())?;
            }
            return Ok(None);
        }
        self.file
            .write_all_at(&data, offset)
            .map_err(|source| self.write_err(source))?;
        self.present[block as usize] = true;
        let n = data.len() as u64;
        let hashed = match self.whole.as_mut() {
            Some(whole) => whole.written(offset, data, &self.file, &self.present),
            None => Ok(()),
        };
        hashed.map_err(|source| self.read_err(source))?;
        self.asked.remove(&block);
        self.tried.remove(&block);
        match source {
            Source::Coordinator => counts.coordinator += n,
            Source::Http => {
                count_peer(counts, HTTP_SOURCE, n);
                self.origin_heard = (Instant::now(), self.throttled);
            }
            Source::Peer(i) => {
                count_peer(counts, &self.sources.peers[i], n);
                self.peer_heard = Instant::now();
                self.peers[i].unavailable = 0;
                if let Some(took) = answered_in {
                    self.charge(i, took);
                }
            }
        }
        self.done += n;
        Ok(Some(n))
    }

    fn unavailable(
        &mut self,
        block: u64,
        source: Source,
        reason: String,
        took: Duration,
    ) -> Result<(), FetchError> {
        match source {
            Source::Peer(i) => {
                self.asked.remove(&block);
                self.queue.push_front(block);
                let peer = &mut self.peers[i];
                peer.unavailable += 1;
                peer.refusing += took;
                if peer.unavailable >= PEER_UNAVAILABLE_LIMIT {
                    self.bypass(i, format!("cannot provide blocks: {reason}"));
                }
                Ok(())
            }
            Source::Http => {
                self.bypass_origin(Some(block), reason);
                Ok(())
            }
            Source::Coordinator => {
                let (offset, length) = block_range(block, self.spec.size, self.list.block_size());
                self.retries.bad_reply(
                    &self.spec.name,
                    offset,
                    length,
                    format!("server cannot provide it: {reason}"),
                )
            }
        }
    }

    fn bad_block(&mut self, block: u64, source: Source, len: usize) -> Result<(), FetchError> {
        match source {
            Source::Peer(i) => {
                // The peer stays bypassed; `bypass` puts the block back in the queue.
                self.bypass(
                    i,
                    format!("it served block {block} ({len} bytes), which fails its signed hash"),
                );
                Ok(())
            }
            // Never here: the origin's workers check its blocks (`http_origin`), and one that
            // fails comes as `OriginEvent::Failed`, which bypasses the origin.
            Source::Http => Ok(()),
            Source::Coordinator => {
                tracing::warn!(
                    artifact = self.spec.name,
                    block,
                    "the coordinator's block {block} fails its signed hash; asking again"
                );
                let (offset, length) = block_range(block, self.spec.size, self.list.block_size());
                self.retries.bad_reply(
                    &self.spec.name,
                    offset,
                    length,
                    format!("server sent block {block}, which fails its signed hash"),
                )
            }
        }
    }

    /// After a block was written: syncs at each MiB (before the progress that claims it is
    /// flushed) and reports progress.
    fn done_block(
        &mut self,
        before: u64,
        counts: &ByteCounts,
        progress: &mut Progress<'_>,
    ) -> Result<(), FetchError> {
        if self.done / SYNC_EVERY != before / SYNC_EVERY {
            self.file
                .sync_data()
                .map_err(|source| self.write_err(source))?;
        }
        progress(self.done, counts);
        Ok(())
    }

    fn read_err(&self, source: std::io::Error) -> FetchError {
        FetchError::ReadPart {
            artifact: self.spec.name.clone(),
            path: self.spec.part_path(),
            source,
        }
    }

    fn write_err(&self, source: std::io::Error) -> FetchError {
        FetchError::WritePart {
            artifact: self.spec.name.clone(),
            path: self.spec.part_path(),
            source,
        }
    }

    /// Every block verified: the whole-file digest is checked (hashing what was not hashed on
    /// the way), then the file takes its name.
    fn finish(mut self) -> Result<PathBuf, FetchError> {
        self.file
            .sync_all()
            .map_err(|source| self.write_err(source))?;
        let part = self.spec.part_path();
        let final_path = self.spec.final_path();
        let got = match self.whole.take() {
            Some(whole) => whole.finish(&self.file),
            None => Err(std::io::Error::other(
                "the whole-file hash was finished already",
            )),
        }
        .map_err(|source| self.read_err(source))?;
        if let Err(refusal) = crate::trust::check_digest(&self.spec.name, &self.spec.sha256, &got) {
            // Every block matched a list the release key signed, so the release itself is
            // inconsistent: fetching again cannot help.
            let _ = std::fs::remove_file(&part);
            return Err(FetchError::Digest(refusal));
        }
        flotilla_targets::fs::atomic_rename(&part, &final_path).map_err(|source| {
            FetchError::WritePart {
                artifact: self.spec.name.clone(),
                path: final_path.clone(),
                source,
            }
        })?;
        Ok(final_path)
    }
}

/// The origin's next event; never, without an origin in use.
async fn next_origin(origin: &mut Option<OriginFetcher>) -> Option<OriginEvent> {
    match origin {
        Some(origin) => origin.next().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_list_fetch::{fetch_block_list, list_path};
    use crate::fetch::tests::{block, part_file_on_full_disk};
    use flotilla_mqtt::https::OriginTls;
    use flotilla_protocol::blocks::BlockIndexRef;
    use flotilla_protocol::hex;
    use flotilla_protocol::SignedBlob;
    use std::collections::HashMap;
    use std::path::Path;
    use std::sync::{Arc, Mutex};

    const BS: u32 = 1024;

    /// How an in-memory source answers.
    #[derive(Debug, Clone, Copy)]
    enum Serves {
        Good,
        /// Every block with one byte flipped.
        Corrupt,
        /// Never answers.
        Silent,
        /// Answers `Unavailable` to everything.
        Unavailable,
        /// Answers `Unavailable` to this many requests (busy), then serves.
        BusyFirst(usize),
        /// Answers this many requests, then never again.
        DiesAfter(usize),
        /// The first answer for the block at this offset is corrupt, later ones are good.
        CorruptOnceAt(u64),
        /// Serves every block, each after this delay.
        Slow(Duration),
        /// Serves the block at this offset after the delay, every other block at once.
        SlowOnceAt(u64, Duration),
        /// Serves this many requests, then answers `Unavailable` to every request after the
        /// delay.
        BusyAfter(usize, Duration),
        /// Serves every `every`-th request at once and answers `Unavailable` to the others
        /// after `refusing`: never `every` refusals in a row.
        Trickles {
            every: usize,
            refusing: Duration,
        },
    }

    /// Who was asked for which offset: `None` is the coordinator.
    type Asked = Arc<Mutex<Vec<(Option<String>, u64)>>>;

    /// A network of in-memory sources serving `data`: the coordinator and named peers.
    fn network(
        data: Vec<u8>,
        coordinator: Serves,
        peers: &[(&str, Serves)],
    ) -> (
        mpsc::Sender<FetchRequest>,
        mpsc::Receiver<FetchInput>,
        Asked,
    ) {
        let (req_tx, mut req_rx) = mpsc::channel::<FetchRequest>(256);
        let (rep_tx, rep_rx) = mpsc::channel(256);
        let asked: Asked = Arc::default();
        let log = asked.clone();
        let mut behaviour: HashMap<Option<String>, Serves> = peers
            .iter()
            .map(|(p, s)| (Some((*p).to_owned()), *s))
            .collect();
        behaviour.insert(None, coordinator);
        let mut answered: HashMap<Option<String>, usize> = HashMap::new();
        tokio::spawn(async move {
            while let Some(request) = req_rx.recv().await {
                let (who, r) = match request {
                    FetchRequest::Coordinator(r) => (None, r),
                    FetchRequest::Peer { peer, fetch } => (Some(peer), fetch.request),
                };
                log.lock().expect("log").push((who.clone(), r.offset));
                let served = answered.entry(who.clone()).or_default();
                *served += 1;
                let mut block = block(&data, &r);
                let refusal = |reason: &str| {
                    Some(BlockReply::Unavailable {
                        sha256: r.sha256,
                        offset: r.offset,
                        reason: reason.into(),
                    })
                };
                let mut delay = Duration::ZERO;
                let reply = match behaviour.get_mut(&who).copied().unwrap_or(Serves::Silent) {
                    Serves::Unavailable => refusal("not here"),
                    Serves::BusyFirst(n) if *served <= n => refusal("busy"),
                    Serves::Good | Serves::BusyFirst(_) => None,
                    Serves::Slow(after) => {
                        delay = after;
                        None
                    }
                    Serves::SlowOnceAt(at, after) => {
                        if at == r.offset {
                            delay = after;
                        }
                        None
                    }
                    Serves::BusyAfter(n, _) if *served <= n => None,
                    Serves::BusyAfter(_, after) => {
                        delay = after;
                        refusal("busy")
                    }
                    Serves::Trickles { every, .. } if served.is_multiple_of(every) => None,
                    Serves::Trickles { refusing, .. } => {
                        delay = refusing;
                        refusal("busy")
                    }
                    Serves::Corrupt => {
                        block[0] ^= 0xff;
                        None
                    }
                    Serves::Silent => continue,
                    Serves::DiesAfter(n) if *served > n => continue,
                    Serves::DiesAfter(_) => None,
                    Serves::CorruptOnceAt(at) if at == r.offset => {
                        block[0] ^= 0xff;
                        behaviour.insert(who.clone(), Serves::Good);
                        None
                    }
                    Serves::CorruptOnceAt(_) => None,
                };
                let reply = reply.unwrap_or(BlockReply::Data {
                    sha256: r.sha256,
                    offset: r.offset,
                    data: block,
                });
                let input = match who {
                    None => FetchInput::Reply(reply),
                    Some(peer) => FetchInput::PeerReply { peer, reply },
                };
                if !delay.is_zero() {
                    // Answers in its own time, without holding up the other sources.
                    let rep_tx = rep_tx.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        let _ = rep_tx.send(input).await;
                    });
                } else if rep_tx.send(input).await.is_err() {
                    break;
                }
            }
        });
        (req_tx, rep_rx, asked)
    }

    fn image(blocks: usize) -> Vec<u8> {
        (0..blocks * BS as usize - 100)
            .map(|i| (i * 31 % 253) as u8)
            .collect()
    }

    /// `data` as `rootfs.img`, fetched into `dir/downloads` in blocks of [`BS`], four at a time.
    fn spec(dir: &Path, data: &[u8]) -> FetchSpec {
        FetchSpec {
            name: "rootfs.img".into(),
            block_size: BS,
            in_flight: 4,
            ..crate::fetch::tests::spec(dir, data)
        }
    }

    fn sources(peers: &[&str]) -> Sources {
        Sources {
            peers: peers.iter().map(|p| (*p).to_owned()).collect(),
            grant: Some(SignedBlob {
                payload: b"grant".to_vec(),
                signer: [0; 32],
                signature: Vec::new(),
            }),
            peer_timeout: Duration::from_secs(3),
            slow_block: Duration::from_secs(1),
            fallback_after: Duration::from_secs(30),
            local: Vec::new(),
            origin: None,
            origin_tls: OriginTls::default(),
        }
    }

    /// Runs the block fetcher over the network; returns the bytes by source.
    async fn run(
        spec: &FetchSpec,
        data: &[u8],
        sources: &Sources,
        net: (mpsc::Sender<FetchRequest>, mpsc::Receiver<FetchInput>),
    ) -> ByteCounts {
        run_bypassing(spec, data, sources, net).await.0
    }

    /// [`run`], returning the peers bypassed and why as well (what the final report lists).
    async fn run_bypassing(
        spec: &FetchSpec,
        data: &[u8],
        sources: &Sources,
        net: (mpsc::Sender<FetchRequest>, mpsc::Receiver<FetchInput>),
    ) -> (ByteCounts, BTreeMap<String, String>) {
        let list = BlockList::compute(data, BS).expect("list");
        let (tx, mut rx) = net;
        let mut counts = ByteCounts::default();
        let mut bypassed = BTreeMap::new();
        let mut last = 0;
        let path = fetch_blocks(
            BlockFetch {
                spec,
                list: &list,
                sources,
                bypassed: &mut bypassed,
            },
            &mut counts,
            &tx,
            &mut rx,
            &mut |done, _| {
                assert!(done >= last, "progress never goes back");
                last = done;
            },
            &CancellationToken::new(),
        )
        .await
        .expect("fetch");
        assert_eq!(std::fs::read(&path).expect("read"), data, "right bytes");
        assert_eq!(last, data.len() as u64);
        assert!(!spec.part_path().exists());
        assert!(counts.total() <= data.len() as u64, "nothing counted twice");
        (counts, bypassed)
    }

    /// The bytes `peer` delivered.
    fn from(counts: &ByteCounts, peer: &str) -> u64 {
        counts
            .peers
            .iter()
            .find(|(n, _)| n == peer)
            .map_or(0, |(_, b)| *b)
    }

    fn asked_of(asked: &Asked, who: Option<&str>) -> Vec<u64> {
        asked
            .lock()
            .expect("log")
            .iter()
            .filter(|(w, _)| w.as_deref() == who)
            .map(|(_, o)| *o)
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_serving_corrupt_blocks_is_bypassed_and_the_others_serve() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(40);
        let spec = spec(dir.path(), &data);
        let (tx, rx, asked) = network(
            data.clone(),
            Serves::Good,
            &[("bad", Serves::Corrupt), ("good", Serves::Good)],
        );
        let counts = run(&spec, &data, &sources(&["bad", "good"]), (tx, rx)).await;
        assert_eq!(
            counts.peers,
            [("good".to_owned(), data.len() as u64)],
            "every byte came from the good peer, none from the bad one"
        );
        assert_eq!(counts.coordinator, 0);
        let bad = asked_of(&asked, Some("bad"));
        assert!(
            bad.len() <= spec.in_flight,
            "the bad peer is asked nothing after its first bad block: {bad:?}"
        );
    }

    /// A peer bypassed for one artifact is not asked for the action's next one.
    #[tokio::test(start_paused = true)]
    async fn a_bypassed_peer_stays_bypassed_for_the_rest_of_the_action() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut bypassed = BTreeMap::new();
        let sources = sources(&["bad", "good"]);
        for (n, blocks) in [(1u8, 12), (2, 9)] {
            let data: Vec<u8> = image(blocks).iter().map(|b| b ^ n).collect();
            let spec = spec(dir.path(), &data);
            let list = BlockList::compute(&data[..], BS).expect("list");
            let (tx, mut rx, asked) = network(
                data.clone(),
                Serves::Good,
                &[("bad", Serves::Corrupt), ("good", Serves::Good)],
            );
            let path = fetch_blocks(
                BlockFetch {
                    spec: &spec,
                    list: &list,
                    sources: &sources,
                    bypassed: &mut bypassed,
                },
                &mut ByteCounts::default(),
                &tx,
                &mut rx,
                &mut |_, _| {},
                &CancellationToken::new(),
            )
            .await
            .expect("fetch");
            assert_eq!(std::fs::read(path).expect("read"), data);
            let bad = asked_of(&asked, Some("bad"));
            if n == 2 {
                assert!(
                    bad.is_empty(),
                    "asked again for the second artifact: {bad:?}"
                );
            }
        }
        assert!(
            bypassed["bad"].contains("fails its signed hash"),
            "{bypassed:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_peer_is_bypassed_after_the_bound_and_the_coordinator_serves() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(20);
        let spec = spec(dir.path(), &data);
        let (tx, rx, asked) = network(data.clone(), Serves::Good, &[("mute", Serves::Silent)]);
        let started = Instant::now();
        let counts = run(&spec, &data, &sources(&["mute"]), (tx, rx)).await;
        assert_eq!(counts.coordinator, data.len() as u64);
        assert!(counts.peers.is_empty());
        assert_eq!(asked_of(&asked, Some("mute")).len(), spec.in_flight);
        // Virtual time: the only wait was one peer timeout.
        assert_eq!(started.elapsed(), Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_dying_mid_transfer_leaves_the_rest_to_the_next_source() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(30);
        let spec = spec(dir.path(), &data);
        let (tx, rx, _asked) = network(
            data.clone(),
            Serves::Good,
            &[("first", Serves::DiesAfter(10)), ("second", Serves::Good)],
        );
        let counts = run(&spec, &data, &sources(&["first", "second"]), (tx, rx)).await;
        let from = |p: &str| {
            counts
                .peers
                .iter()
                .find(|(n, _)| n == p)
                .map_or(0, |(_, b)| *b)
        };
        assert_eq!(
            from("first"),
            10 * u64::from(BS),
            "ten blocks before it died"
        );
        assert_eq!(counts.total(), data.len() as u64, "byte counts add up");
        assert_eq!(from("second"), data.len() as u64 - 10 * u64::from(BS));
        assert_eq!(counts.coordinator, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_cannot_serve_is_passed_over_block_by_block_then_bypassed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(16);
        let spec = spec(dir.path(), &data);
        let (tx, rx, asked) = network(
            data.clone(),
            Serves::Good,
            &[("busy", Serves::Unavailable), ("good", Serves::Good)],
        );
        let counts = run(&spec, &data, &sources(&["busy", "good"]), (tx, rx)).await;
        assert_eq!(counts.peers, [("good".to_owned(), data.len() as u64)]);
        assert_eq!(counts.total(), data.len() as u64);
        let busy = asked_of(&asked, Some("busy"));
        assert!(
            (PEER_UNAVAILABLE_LIMIT as usize..PEER_UNAVAILABLE_LIMIT as usize + spec.in_flight)
                .contains(&busy.len()),
            "asked until its {PEER_UNAVAILABLE_LIMIT}th Unavailable in a row, then never again: \
             {busy:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_peer_is_asked_again_rather_than_the_coordinator() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(16);
        let spec = spec(dir.path(), &data);
        let (tx, rx, asked) = network(data.clone(), Serves::Good, &[("p", Serves::BusyFirst(4))]);
        let counts = run(&spec, &data, &sources(&["p"]), (tx, rx)).await;
        assert_eq!(counts.peers, [("p".to_owned(), data.len() as u64)]);
        assert_eq!(counts.coordinator, 0);
        assert!(asked_of(&asked, None).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn every_peer_gone_falls_back_to_the_coordinator() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(12);
        let spec = spec(dir.path(), &data);
        let (tx, rx, _asked) = network(
            data.clone(),
            Serves::Good,
            &[("a", Serves::DiesAfter(2)), ("b", Serves::Corrupt)],
        );
        let counts = run(&spec, &data, &sources(&["a", "b"]), (tx, rx)).await;
        assert_eq!(counts.peers, [("a".to_owned(), 2 * u64::from(BS))]);
        assert_eq!(counts.coordinator, data.len() as u64 - 2 * u64::from(BS));
    }

    /// Two peers that stay under every per-peer limit: after three blocks they answer each
    /// request `Unavailable`, slowly but within `peer_timeout`, one request at a time, so
    /// neither says it 8 times in a row before `fallback_after` (30 s) passes, and no block
    /// is charged to them as slow. The bounded fallback is what ends the wait.
    #[tokio::test(start_paused = true)]
    async fn peers_that_deliver_nothing_for_fallback_after_leave_the_rest_to_the_coordinator() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(10);
        let spec = FetchSpec {
            in_flight: 1,
            ..spec(dir.path(), &data)
        };
        let refusing = Duration::from_millis(2900);
        let (tx, rx, asked) = network(
            data.clone(),
            Serves::Good,
            &[
                ("a", Serves::BusyAfter(3, refusing)),
                ("b", Serves::BusyAfter(0, refusing)),
            ],
        );
        let sources = sources(&["a", "b"]);
        let started = Instant::now();
        let (counts, bypassed) = run_bypassing(&spec, &data, &sources, (tx, rx)).await;
        assert_eq!(counts.peers, [("a".to_owned(), 3 * u64::from(BS))]);
        assert_eq!(
            counts.coordinator,
            data.len() as u64 - 3 * u64::from(BS),
            "the coordinator served every block the peers had not"
        );
        assert!(
            bypassed.is_empty(),
            "no peer reached a limit; the fallback left them: {bypassed:?}"
        );
        let refusals = |p| asked_of(&asked, Some(p)).len() - if p == "a" { 3 } else { 0 };
        for p in ["a", "b"] {
            assert!(
                refusals(p) < PEER_UNAVAILABLE_LIMIT as usize,
                "{p} refused {} times",
                refusals(p)
            );
        }
        // Virtual time: the coordinator took over with the first answer after 30 s (a peer
        // answer, then at most one wait before asking the peers again).
        let waited = started.elapsed();
        assert!(
            waited >= sources.fallback_after
                && waited <= sources.fallback_after + refusing + PEER_RETRY,
            "{waited:?}"
        );
    }

    /// Every block just within `peer_timeout`: the peer is bypassed as slow after three of
    /// them, and the next peer serves the rest.
    #[tokio::test(start_paused = true)]
    async fn a_peer_answering_each_block_just_within_the_timeout_is_bypassed_as_slow() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(24);
        let spec = spec(dir.path(), &data);
        let (tx, rx, _asked) = network(
            data.clone(),
            Serves::Good,
            &[
                ("slow", Serves::Slow(Duration::from_millis(2900))),
                ("fast", Serves::Good),
            ],
        );
        let (counts, bypassed) =
            run_bypassing(&spec, &data, &sources(&["slow", "fast"]), (tx, rx)).await;
        assert_eq!(
            bypassed["slow"],
            "slow: its answers for its last 3 blocks took 8.7s, more than 8 × \
             peer_slow_block (1s)"
        );
        assert!(!bypassed.contains_key("fast"), "{bypassed:?}");
        // The blocks it had been asked for when it was bypassed still count if they verify.
        assert_eq!(from(&counts, "slow"), spec.in_flight as u64 * u64::from(BS));
        assert_eq!(
            from(&counts, "fast"),
            data.len() as u64 - from(&counts, "slow")
        );
        assert_eq!(counts.coordinator, 0);
    }

    /// A peer that serves every 4th request at once and answers the others `Unavailable`
    /// slowly never refuses 8 times in a row, and each block it serves resets the fallback
    /// clock; the time of its refusals, charged to its blocks, is what bypasses it.
    #[tokio::test(start_paused = true)]
    async fn a_peer_padding_its_blocks_with_slow_refusals_is_bypassed_as_slow() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(40);
        let spec = spec(dir.path(), &data);
        let (tx, rx, _asked) = network(
            data.clone(),
            Serves::Good,
            &[(
                "trickle",
                Serves::Trickles {
                    every: 4,
                    refusing: Duration::from_millis(2500),
                },
            )],
        );
        let started = Instant::now();
        let (counts, bypassed) =
            run_bypassing(&spec, &data, &sources(&["trickle"]), (tx, rx)).await;
        assert!(bypassed["trickle"].starts_with("slow: "), "{bypassed:?}");
        let served = from(&counts, "trickle");
        assert!(
            served <= PEER_SLOW_BLOCKS as u64 * u64::from(BS),
            "bypassed within its first {PEER_SLOW_BLOCKS} blocks: {served} bytes"
        );
        assert_eq!(counts.coordinator, data.len() as u64 - served);
        assert!(
            started.elapsed() < sources(&[]).fallback_after,
            "long before the fallback would have: {:?}",
            started.elapsed()
        );
    }

    /// An occasional slow block is not slowness: the peer keeps serving.
    #[tokio::test(start_paused = true)]
    async fn one_slow_block_does_not_make_a_peer_slow() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(20);
        let spec = spec(dir.path(), &data);
        let at = 5 * u64::from(BS);
        let (tx, rx, _asked) = network(
            data.clone(),
            Serves::Good,
            &[("p", Serves::SlowOnceAt(at, Duration::from_millis(2900)))],
        );
        let (counts, bypassed) = run_bypassing(&spec, &data, &sources(&["p"]), (tx, rx)).await;
        assert!(bypassed.is_empty(), "{bypassed:?}");
        assert_eq!(counts.peers, [("p".to_owned(), data.len() as u64)]);
    }

    /// The fetcher's own rate limit holds replies back (they wait in the channel while it
    /// sleeps); that time is not the peer's.
    #[tokio::test(start_paused = true)]
    async fn the_fetchers_own_rate_limit_is_not_counted_against_a_peer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(16);
        // One block a second with four asked at once: counted naively, the fourth reply of
        // each round would look 3 s late.
        let spec = FetchSpec {
            max_bytes_per_sec: u64::from(BS),
            ..spec(dir.path(), &data)
        };
        let (tx, rx, _asked) = network(data.clone(), Serves::Good, &[("p", Serves::Good)]);
        let (counts, bypassed) = run_bypassing(&spec, &data, &sources(&["p"]), (tx, rx)).await;
        assert!(bypassed.is_empty(), "{bypassed:?}");
        assert_eq!(counts.peers, [("p".to_owned(), data.len() as u64)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_corrupt_block_from_the_coordinator_is_fetched_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(8);
        let spec = spec(dir.path(), &data);
        let at = 5 * u64::from(BS);
        let (tx, rx, asked) = network(data.clone(), Serves::CorruptOnceAt(at), &[]);
        let counts = run(&spec, &data, &Sources::default(), (tx, rx)).await;
        assert_eq!(
            counts.coordinator,
            data.len() as u64,
            "the bad copy is not counted"
        );
        let coordinator = asked_of(&asked, None);
        assert_eq!(
            coordinator.iter().filter(|&&o| o == at).count(),
            2,
            "{coordinator:?}"
        );
        assert_eq!(coordinator.len(), 9, "only the bad block was asked twice");
    }

    #[tokio::test(start_paused = true)]
    async fn a_resumed_download_fetches_only_the_blocks_that_do_not_verify() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(10);
        let spec = spec(dir.path(), &data);
        std::fs::create_dir_all(&spec.dir).expect("mkdir");
        // A killed run left blocks 0-3 and 7 written, and block 4 torn half-way.
        let mut part = vec![0u8; data.len()];
        let bs = BS as usize;
        for b in [0, 1, 2, 3, 7] {
            part[b * bs..(b + 1) * bs].copy_from_slice(&data[b * bs..(b + 1) * bs]);
        }
        part[4 * bs..4 * bs + 500].copy_from_slice(&data[4 * bs..4 * bs + 500]);
        std::fs::write(spec.part_path(), &part[..8 * bs]).expect("write");
        let (tx, rx, asked) = network(data.clone(), Serves::Good, &[]);
        let counts = run(&spec, &data, &Sources::default(), (tx, rx)).await;
        let mut fetched = asked_of(&asked, None);
        fetched.sort();
        let expected: Vec<u64> = [4, 5, 6, 8, 9].iter().map(|b| b * u64::from(BS)).collect();
        assert_eq!(fetched, expected, "only the missing and torn blocks");
        assert_eq!(counts.coordinator, data.len() as u64 - 5 * u64::from(BS));
        assert_eq!(
            counts.local, 0,
            "blocks of its own part file are not copies"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn blocks_that_match_their_list_but_not_the_artifact_digest_fail_the_download() {
        // A release whose block list describes other bytes than its digest: every block
        // verifies, and only the whole-file digest, hashed on the way, can tell.
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(6);
        let mut spec = spec(dir.path(), &data);
        spec.sha256 = flotilla_protocol::sha256(b"some other artifact");
        let list = BlockList::compute(&data[..], BS).expect("list");
        let (tx, mut rx, _asked) = network(data.clone(), Serves::Good, &[]);
        let result = fetch_blocks(
            BlockFetch {
                spec: &spec,
                list: &list,
                sources: &Sources::default(),
                bypassed: &mut BTreeMap::new(),
            },
            &mut ByteCounts::default(),
            &tx,
            &mut rx,
            &mut |_, _| {},
            &CancellationToken::new(),
        )
        .await;
        assert!(matches!(result, Err(FetchError::Digest(_))), "{result:?}");
        assert!(!spec.part_path().exists(), "the download is discarded");
        assert!(!spec.final_path().exists());
    }

    #[tokio::test(start_paused = true)]
    async fn an_image_with_one_percent_changed_downloads_under_five_percent() {
        let dir = tempfile::tempdir().expect("tempdir");
        let old = image(400);
        let mut new = old.clone();
        for b in [17usize, 203, 350, 399] {
            new[b * BS as usize + 7] ^= 0x5a; // 4 of 400 blocks
        }
        let spec = spec(dir.path(), &new);
        std::fs::create_dir_all(&spec.dir).expect("mkdir");
        // The previous release's download is still there.
        let old_path = spec.dir.join(hex::encode(&flotilla_protocol::sha256(&old)));
        std::fs::write(&old_path, &old).expect("write");
        let (tx, rx, asked) = network(new.clone(), Serves::Good, &[]);
        let counts = run(&spec, &new, &Sources::default(), (tx, rx)).await;
        let size = new.len() as u64;
        println!(
            "adaptive: {} of {size} bytes fetched ({:.2}%), {} copied",
            counts.coordinator,
            counts.coordinator as f64 * 100.0 / size as f64,
            counts.local
        );
        assert!(counts.coordinator * 20 <= size, "{counts:?}");
        assert_eq!(asked_of(&asked, None).len(), 4, "only the changed blocks");
        assert_eq!(counts.local, size - counts.coordinator);
    }

    /// A part file that cannot be written (`/dev/full` stands in for a full disk) fails the
    /// download naming the file, and leaves no partial download behind.
    #[tokio::test(start_paused = true)]
    async fn a_part_file_that_cannot_be_written_fails_and_is_removed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(4);
        let spec = spec(dir.path(), &data);
        part_file_on_full_disk(&spec);
        let list = BlockList::compute(&data[..], BS).expect("list");
        let (tx, mut rx, _asked) = network(data.clone(), Serves::Good, &[]);
        let err = fetch_blocks(
            BlockFetch {
                spec: &spec,
                list: &list,
                sources: &Sources::default(),
                bypassed: &mut BTreeMap::new(),
            },
            &mut ByteCounts::default(),
            &tx,
            &mut rx,
            &mut |_, _| {},
            &CancellationToken::new(),
        )
        .await
        .expect_err("cannot write");
        assert!(
            err.to_string()
                .starts_with("artifact rootfs.img: cannot write "),
            "{err}"
        );
        assert!(
            std::fs::symlink_metadata(spec.part_path()).is_err(),
            "the partial download is removed"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_block_list_is_fetched_checked_and_stored_by_the_artifact_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(10);
        let spec = spec(dir.path(), &data);
        let list = BlockList::compute(&data[..], BS).expect("list");
        let index = BlockIndexRef {
            block_size: BS,
            sha256: flotilla_protocol::sha256(list.as_bytes()),
        };
        let (tx, mut rx, _asked) = network(list.as_bytes().to_vec(), Serves::Good, &[]);
        let mut counts = ByteCounts::default();
        let got = fetch_block_list(
            &spec,
            &index,
            &mut counts,
            &tx,
            &mut rx,
            &CancellationToken::new(),
        )
        .await
        .expect("list");
        assert_eq!(got, list);
        assert_eq!(
            std::fs::read(list_path(&spec)).expect("stored"),
            list.as_bytes()
        );
        assert_eq!(counts.coordinator, list.as_bytes().len() as u64);
        assert!(
            !spec.dir.join(hex::encode(&index.sha256)).exists(),
            "kept only under the artifact's name"
        );
        // A list that does not match the signed index is refused, naming why.
        let forged = BlockIndexRef {
            sha256: [9; 32],
            ..index
        };
        std::fs::remove_file(list_path(&spec)).expect("rm");
        let (tx, mut rx, _asked) = network(list.as_bytes().to_vec(), Serves::Good, &[]);
        let err = fetch_block_list(
            &spec,
            &forged,
            &mut counts,
            &tx,
            &mut rx,
            &CancellationToken::new(),
        )
        .await
        .expect_err("refused");
        assert!(err.to_string().contains("sha256 mismatch"), "{err}");
    }

    /// With an origin and no peers: the origin serves, the coordinator is the fallback.
    async fn with_origin(serves: crate::http_origin::tests::Serves) -> (ByteCounts, u64) {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = image(24);
        let spec = spec(dir.path(), &data);
        let (tx, rx, _) = network(data.clone(), Serves::Good, &[]);
        let sources = Sources {
            origin: Some(crate::http_origin::tests::serve(data.clone(), serves).await),
            peer_timeout: Duration::from_millis(300),
            ..sources(&[])
        };
        let counts = run(&spec, &data, &sources, (tx, rx)).await;
        (counts, data.len() as u64)
    }

    #[tokio::test]
    async fn an_origin_serves_every_block_counted_as_http() {
        use crate::http_origin::tests::Serves as Origin;
        for serves in [Origin::Ranges, Origin::Whole] {
            let (counts, size) = with_origin(serves).await;
            assert_eq!(counts.from_http(), size, "{serves:?}: {counts:?}");
            assert_eq!(counts.coordinator, 0, "{serves:?}");
        }
    }

    #[tokio::test]
    async fn a_bad_silent_or_failing_origin_is_bypassed_and_the_coordinator_serves() {
        use crate::http_origin::tests::Serves as Origin;
        // Every block is asked at once, in one run: the origin breaking off after five blocks
        // and ten bytes has served five.
        let broken_off = Origin::CutAfter(5 * BS as usize + 10);
        for serves in [
            Origin::Corrupt,
            Origin::Silent,
            Origin::NotFoundAfter(0),
            broken_off,
        ] {
            let (counts, size) = with_origin(serves).await;
            assert_eq!(counts.total(), size, "{serves:?}");
            assert!(counts.coordinator > 0, "{serves:?}: {counts:?}");
            let from_origin = if serves == broken_off { 5 * BS } else { 0 };
            assert_eq!(
                counts.from_http(),
                u64::from(from_origin),
                "{serves:?}: {counts:?}"
            );
        }
    }
}
