//! The streaming fetcher: downloads one artifact from the coordinator as pipelined
//! [`BlockRequest`]s, writing each block to `<data_dir>/downloads/<sha256>.part` at its offset
//! and hashing as it streams. It serves artifacts whose manifest has no block index (and block
//! lists themselves, which are checked against their signed digest); an artifact with a block
//! index goes through [`crate::fetch_blocks`], which checks every block and can use peers.
//!
//! It talks to the artifact server through two channels (requests out, replies in), not to
//! MQTT, so it is tested here against an in-memory server. Both fetchers share the channel
//! types defined here ([`FetchRequest`], [`FetchInput`]). Rules it keeps:
//!
//! - `in_flight` requests outstanding; replies that arrive out of order are buffered until the
//!   gap before them is filled, so the file and the hash only ever grow at the end.
//! - Never more than the declared size: a reply reaching past it fails the download.
//! - Resumable: given the number of contiguous bytes already done, it re-hashes that prefix of
//!   the local file and asks only for what follows.
//! - No reply for [`REPLY_TIMEOUT`]: every outstanding block is asked for again (the broker may
//!   have dropped requests while the connection was down).
//! - A bad reply (`Unavailable`, an empty block, a block longer than asked or past the declared
//!   size) is discarded, and the block is asked for again after a backoff; only after
//!   [`BLOCK_ATTEMPTS`] bad replies for one block does the download fail, naming the last one.
//!   Anyone on the broker can publish on a device's block topic, so one bad reply proves nothing.
//! - A write error (a full disk) removes the partial download before the error is returned.
//! - At the end the sha256 must match; the part file is then renamed to `<sha256>`. A mismatch
//!   (a corrupt block from someone on the broker) discards the download and starts it again, at
//!   most [`DOWNLOAD_ATTEMPTS`] times in all. Without a block index, a corrupt block can only be
//!   found here, after the whole artifact.
//! - Every byte it accepts is counted as the coordinator's in the action's [`ByteCounts`].

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use flotilla_protocol::{hex, BlockReply, BlockRequest, ByteCounts, Digest, PeerFetch};
use sha2::Digest as _;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long to wait for any reply before asking for outstanding blocks again.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// How many bad replies one block may get before the download fails.
pub const BLOCK_ATTEMPTS: u32 = 5;

/// How many times a download that hashed wrong is started again from nothing, in all.
pub const DOWNLOAD_ATTEMPTS: u32 = 3;

/// The wait before asking again for a block that got a bad reply; doubles with each bad reply
/// for that block, up to [`RETRY_MAX`].
pub const RETRY_FIRST: Duration = Duration::from_secs(1);
pub const RETRY_MAX: Duration = Duration::from_secs(30);

/// The part file is synced whenever the download crosses a multiple of this.
const SYNC_EVERY: u64 = 1 << 20;

/// What to download, and how.
#[derive(Debug, Clone)]
pub struct FetchSpec {
    /// The artifact's name in the manifest, for messages.
    pub name: String,
    pub sha256: Digest,
    pub size: u64,
    /// `<data_dir>/downloads`.
    pub dir: PathBuf,
    pub block_size: u32,
    pub in_flight: usize,
    /// 0 = unlimited.
    pub max_bytes_per_sec: u64,
}

impl FetchSpec {
    /// Where blocks are written while the download runs.
    pub fn part_path(&self) -> PathBuf {
        self.dir.join(format!("{}.part", hex::encode(&self.sha256)))
    }

    /// Where the verified artifact ends up.
    pub fn final_path(&self) -> PathBuf {
        self.dir.join(hex::encode(&self.sha256))
    }
}

/// What a fetcher asks the link to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchRequest {
    /// To the coordinator's artifact server, on this device's `fetch` topic.
    Coordinator(BlockRequest),
    /// To a peer, on its `peer-fetch` topic, with this device's grant.
    Peer { peer: String, fetch: PeerFetch },
}

/// What reaches the fetcher from the link.
#[derive(Debug, Clone)]
pub enum FetchInput {
    /// From the coordinator, on this device's `block` topic.
    Reply(BlockReply),
    /// From peer `peer`, on `peer-block/{peer}`: the topic names the source.
    PeerReply { peer: String, reply: BlockReply },
    /// The connection came back: requests sent while it was down may be lost, ask again.
    Reconnected,
}

/// Adds `n` bytes from `peer` to `counts`.
pub fn count_peer(counts: &mut ByteCounts, peer: &str, n: u64) {
    match counts.peers.iter_mut().find(|(p, _)| p == peer) {
        Some((_, total)) => *total += n,
        None => counts.peers.push((peer.to_owned(), n)),
    }
}

/// Why a download failed. The message is what the report's `Failed { reason }` says.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("artifact {artifact}: cannot create download directory {path}: {source}")]
    CreateDir {
        artifact: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("artifact {artifact}: cannot read partial download {path}: {source}")]
    ReadPart {
        artifact: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("artifact {artifact}: cannot write {path}: {source}")]
    WritePart {
        artifact: String,
        path: PathBuf,
        source: std::io::Error,
    },
    /// [`BLOCK_ATTEMPTS`] bad replies for the block at `offset`; `reason` is the last one's.
    #[error("artifact {artifact}: {reason} (block at offset {offset}, {attempts} bad replies)")]
    BadBlock {
        artifact: String,
        offset: u64,
        attempts: u32,
        reason: String,
    },
    /// The finished download does not hash to the manifest's sha256; the message is the
    /// trust check's ([`crate::trust::check_digest`]).
    #[error("{0}")]
    Digest(crate::trust::Refusal),
    #[error("artifact {artifact}: the connection to the artifact server is gone")]
    Closed { artifact: String },
    #[error("download canceled")]
    Canceled,
}

/// Called after every block with the bytes done so far and the action's byte counts.
pub type Progress<'a> = dyn FnMut(u64, &ByteCounts) + Send + 'a;

/// Downloads `spec`, starting after `done` contiguous bytes that an earlier run already wrote.
/// `progress` is called with the new contiguous byte count after every block; the bytes
/// received are added to `counts.coordinator`. Returns the path of the verified artifact.
pub async fn fetch(
    spec: &FetchSpec,
    done: u64,
    counts: &mut ByteCounts,
    requests: &mpsc::Sender<FetchRequest>,
    inputs: &mut mpsc::Receiver<FetchInput>,
    progress: &mut Progress<'_>,
    cancel: &CancellationToken,
) -> Result<PathBuf, FetchError> {
    let artifact = spec.name.clone();
    std::fs::create_dir_all(&spec.dir).map_err(|source| FetchError::CreateDir {
        artifact: artifact.clone(),
        path: spec.dir.clone(),
        source,
    })?;
    let final_path = spec.final_path();
    // A crash between the rename and persisting "Verified" leaves the finished file: check it
    // instead of fetching it again.
    if let Ok(digest) = hash_file(&final_path) {
        if digest.0 == spec.sha256 && digest.1 == spec.size {
            progress(spec.size, counts);
            return Ok(final_path);
        }
    }

    let mut done = done;
    let mut attempt = 1;
    loop {
        match fetch_once(spec, done, counts, requests, inputs, progress, cancel).await {
            Err(FetchError::Digest(refusal)) if attempt < DOWNLOAD_ATTEMPTS => {
                tracing::warn!(
                    artifact,
                    attempt,
                    "{refusal}; discarding the download and fetching it again"
                );
                attempt += 1;
                done = 0;
                progress(0, counts);
            }
            Err(e @ FetchError::WritePart { .. }) => {
                // Typically a full disk: the partial download must not keep the space (nor stop
                // the store from recording why the action failed).
                if let Err(rm) = std::fs::remove_file(spec.part_path()) {
                    if rm.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!(artifact, "cannot remove the partial download: {rm}");
                    }
                }
                return Err(e);
            }
            other => return other,
        }
    }
}

/// Bad replies so far, and blocks waiting out their backoff before they are asked for again.
#[derive(Default)]
pub(crate) struct Retries {
    /// offset -> bad replies for the block at that offset.
    bad: BTreeMap<u64, u32>,
    /// (when, offset, length) of blocks to ask for again.
    due: Vec<(Instant, u64, u32)>,
    /// Blocks whose latest request already got a bad reply: more bad replies to the same request
    /// (a flood of forged ones) count once.
    spent: std::collections::BTreeSet<u64>,
}

impl Retries {
    /// Counts a bad reply for the block at `offset`; schedules it to be asked for again, or
    /// fails once it had [`BLOCK_ATTEMPTS`] bad replies.
    pub(crate) fn bad_reply(
        &mut self,
        artifact: &str,
        offset: u64,
        length: u32,
        reason: String,
    ) -> Result<(), FetchError> {
        if !self.spent.insert(offset) {
            return Ok(());
        }
        let attempts = self.bad.entry(offset).or_insert(0);
        *attempts += 1;
        if *attempts >= BLOCK_ATTEMPTS {
            return Err(FetchError::BadBlock {
                artifact: artifact.to_owned(),
                offset,
                attempts: *attempts,
                reason,
            });
        }
        let backoff = RETRY_FIRST
            .saturating_mul(1 << (*attempts - 1).min(16))
            .min(RETRY_MAX);
        tracing::debug!(
            artifact,
            offset,
            attempts = *attempts,
            "bad block reply ({reason}); asking again in {backoff:?}"
        );
        self.due.push((Instant::now() + backoff, offset, length));
        Ok(())
    }

    /// When the next retry is due.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        self.due.iter().map(|(at, ..)| *at).min()
    }

    /// The blocks whose backoff is over.
    pub(crate) fn take_due(&mut self) -> Vec<(u64, u32)> {
        let now = Instant::now();
        let (ready, waiting): (Vec<_>, Vec<_>) =
            self.due.drain(..).partition(|(at, ..)| *at <= now);
        self.due = waiting;
        ready
            .into_iter()
            .map(|(_, o, l)| {
                self.spent.remove(&o);
                (o, l)
            })
            .collect()
    }

    /// Every outstanding block is asked for again now.
    pub(crate) fn asking_all_again(&mut self) {
        self.due.clear();
        self.spent.clear();
    }
}

/// One pass over the artifact, from `done` contiguous bytes to the digest check.
async fn fetch_once(
    spec: &FetchSpec,
    done: u64,
    counts: &mut ByteCounts,
    requests: &mpsc::Sender<FetchRequest>,
    inputs: &mut mpsc::Receiver<FetchInput>,
    progress: &mut Progress<'_>,
    cancel: &CancellationToken,
) -> Result<PathBuf, FetchError> {
    let artifact = spec.name.clone();
    let final_path = spec.final_path();
    let part = spec.part_path();
    let (mut file, mut hasher, mut expected) = open_part(spec, done)?;
    let write_err = |source| FetchError::WritePart {
        artifact: artifact.clone(),
        path: part.clone(),
        source,
    };
    let request = |offset: u64, length: u32| BlockRequest {
        sha256: spec.sha256,
        offset,
        length,
    };

    // offset -> requested length, for blocks asked for (or waiting out a backoff) and not yet
    // received.
    let mut outstanding: BTreeMap<u64, u32> = BTreeMap::new();
    // offset -> data, for blocks received ahead of a gap.
    let mut buffered: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut retries = Retries::default();
    let mut next_request = expected;
    let started = Instant::now();
    let start_bytes = expected;

    loop {
        // Keep the pipeline full.
        while outstanding.len() < spec.in_flight && next_request < spec.size {
            let length = (spec.size - next_request).min(u64::from(spec.block_size)) as u32;
            send(requests, request(next_request, length), &artifact, cancel).await?;
            outstanding.insert(next_request, length);
            next_request += u64::from(length);
        }
        if expected == spec.size {
            break;
        }

        let wait = retries
            .next_due()
            .map_or(REPLY_TIMEOUT, |at| {
                at.saturating_duration_since(Instant::now())
            })
            .min(REPLY_TIMEOUT);
        let input = tokio::select! {
            _ = cancel.cancelled() => return Err(FetchError::Canceled),
            input = tokio::time::timeout(wait, inputs.recv()) => input,
        };
        let reply = match input {
            Err(_) if retries.next_due().is_some_and(|at| at <= Instant::now()) => {
                for (offset, length) in retries.take_due() {
                    // The real reply may have come in while this block waited.
                    if outstanding.contains_key(&offset) {
                        send(requests, request(offset, length), &artifact, cancel).await?;
                    }
                }
                continue;
            }
            Err(_) | Ok(Some(FetchInput::Reconnected)) => {
                tracing::debug!(
                    artifact,
                    outstanding = outstanding.len(),
                    "asking for outstanding blocks again"
                );
                retries.asking_all_again();
                for (&offset, &length) in &outstanding {
                    send(requests, request(offset, length), &artifact, cancel).await?;
                }
                continue;
            }
            Ok(None) => return Err(FetchError::Closed { artifact }),
            Ok(Some(FetchInput::Reply(reply))) => reply,
            // Asked nothing of peers.
            Ok(Some(FetchInput::PeerReply { .. })) => continue,
        };
        let (offset, data) = match reply {
            BlockReply::Data { sha256, .. } | BlockReply::Unavailable { sha256, .. }
                if sha256 != spec.sha256 =>
            {
                continue; // a late answer for another download
            }
            BlockReply::Unavailable { offset, reason, .. } => {
                if let Some(&length) = outstanding.get(&offset) {
                    let reason = format!("server cannot provide it: {reason}");
                    retries.bad_reply(&artifact, offset, length, reason)?;
                }
                continue;
            }
            BlockReply::Data { offset, data, .. } => (offset, data),
        };
        let Some(&requested) = outstanding.get(&offset) else {
            continue; // not asked for, or a duplicate of a block already received
        };
        let bad = if data.is_empty() {
            Some("server sent an empty block".to_owned())
        } else if data.len() > requested as usize
            || offset
                .checked_add(data.len() as u64)
                .is_none_or(|end| end > spec.size)
        {
            Some(format!(
                "server sent more than the declared {} bytes",
                spec.size
            ))
        } else {
            None
        };
        if let Some(reason) = bad {
            retries.bad_reply(&artifact, offset, requested, reason)?;
            continue;
        }
        outstanding.remove(&offset);
        counts.coordinator += data.len() as u64;
        if data.len() < requested as usize {
            // A short block: ask for the rest of it separately.
            let rest = offset + data.len() as u64;
            let length = requested - data.len() as u32;
            send(requests, request(rest, length), &artifact, cancel).await?;
            outstanding.insert(rest, length);
        }
        buffered.insert(offset, data);

        let before = expected;
        while let Some(data) = buffered.remove(&expected) {
            file.write_all(&data).map_err(write_err)?;
            hasher.update(&data);
            expected += data.len() as u64;
        }
        if expected != before {
            // Data reaches the disk before the progress that claims it is flushed (the state
            // machine flushes its record every MiB), so a resumed download can trust its prefix.
            if expected / SYNC_EVERY != before / SYNC_EVERY {
                file.sync_data().map_err(write_err)?;
            }
            progress(expected, counts);
            throttle(
                spec.max_bytes_per_sec,
                expected - start_bytes,
                started,
                cancel,
            )
            .await?;
        }
    }

    file.sync_all().map_err(write_err)?;
    drop(file);
    let got: Digest = hasher.finalize().into();
    if let Err(refusal) = crate::trust::check_digest(&artifact, &spec.sha256, &got) {
        // Never resume from bytes that hashed wrong.
        let _ = std::fs::remove_file(&part);
        return Err(FetchError::Digest(refusal));
    }
    flotilla_targets::fs::atomic_rename(&part, &final_path).map_err(|source| {
        FetchError::WritePart {
            artifact: artifact.clone(),
            path: final_path.clone(),
            source,
        }
    })?;
    Ok(final_path)
}

async fn send(
    requests: &mpsc::Sender<FetchRequest>,
    request: BlockRequest,
    artifact: &str,
    cancel: &CancellationToken,
) -> Result<(), FetchError> {
    ask(
        requests,
        FetchRequest::Coordinator(request),
        artifact,
        cancel,
    )
    .await
}

/// Queues `request` for the link, waiting while the queue is full, but never past `cancel`: a
/// link that does not drain (no broker, or one that accepts nothing) must not keep a cancel or
/// a shutdown waiting.
pub(crate) async fn ask(
    requests: &mpsc::Sender<FetchRequest>,
    request: FetchRequest,
    artifact: &str,
    cancel: &CancellationToken,
) -> Result<(), FetchError> {
    tokio::select! {
        biased;
        _ = cancel.cancelled() => Err(FetchError::Canceled),
        sent = requests.send(request) => sent.map_err(|_| FetchError::Closed {
            artifact: artifact.to_owned(),
        }),
    }
}

/// Opens the part file for appending after `done` bytes, re-hashing that prefix. If the file
/// is shorter than `done` (its tail was lost in a power cut), resumes from what it has.
fn open_part(spec: &FetchSpec, done: u64) -> Result<(File, sha2::Sha256, u64), FetchError> {
    let path = spec.part_path();
    let read_err = |source| FetchError::ReadPart {
        artifact: spec.name.clone(),
        path: path.clone(),
        source,
    };
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(read_err)?;
    let len = file.metadata().map_err(read_err)?.len();
    let keep = done.min(len).min(spec.size);
    let mut hasher = sha2::Sha256::new();
    let mut remaining = keep;
    let mut buf = vec![0u8; 64 * 1024];
    while remaining > 0 {
        let n = buf.len().min(remaining as usize);
        file.read_exact(&mut buf[..n]).map_err(read_err)?;
        hasher.update(&buf[..n]);
        remaining -= n as u64;
    }
    // Drop anything past the contiguous prefix: it may be a block written out of a torn order.
    if len > keep {
        file.set_len(keep).map_err(read_err)?;
    }
    Ok((file, hasher, keep))
}

/// sha256 and length of a file.
pub(crate) fn hash_file(path: &Path) -> std::io::Result<(Digest, u64)> {
    let mut file = File::open(path)?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        total += n as u64;
    }
    Ok((hasher.finalize().into(), total))
}

/// Sleeps long enough to keep the average rate at or below `max_bytes_per_sec`.
pub(crate) async fn throttle(
    max_bytes_per_sec: u64,
    bytes: u64,
    started: Instant,
    cancel: &CancellationToken,
) -> Result<(), FetchError> {
    if max_bytes_per_sec == 0 {
        return Ok(());
    }
    let due = started + Duration::from_secs_f64(bytes as f64 / max_bytes_per_sec as f64);
    tokio::select! {
        _ = cancel.cancelled() => Err(FetchError::Canceled),
        _ = tokio::time::sleep_until(due) => Ok(()),
    }
}

/// The fetcher's tests, and the pieces of them that the tests of the fetchers above it
/// ([`crate::fetch_blocks`], [`crate::machine`]) use too: a spec, the in-memory server's
/// replies, a part file on a full disk.
#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `data` as `app.bin`, fetched into `dir/downloads` in blocks of 100, three at a time.
    pub(crate) fn spec(dir: &Path, data: &[u8]) -> FetchSpec {
        FetchSpec {
            name: "app.bin".into(),
            sha256: flotilla_protocol::sha256(data),
            size: data.len() as u64,
            dir: dir.join("downloads"),
            block_size: 100,
            in_flight: 3,
            max_bytes_per_sec: 0,
        }
    }

    /// The fetcher's ends of an in-memory server's channels, and its task, which returns every
    /// offset asked for once the requests end.
    type Server = (
        mpsc::Sender<FetchRequest>,
        mpsc::Receiver<FetchInput>,
        tokio::task::JoinHandle<Vec<u64>>,
    );

    /// An in-memory artifact server that answers each request with `answer(request)`, as a
    /// hostile one may; with `reverse`, each batch of pending requests in reverse order, to
    /// exercise the reorder buffer.
    fn serve(
        reverse: bool,
        answer: impl Fn(&BlockRequest) -> BlockReply + Send + 'static,
    ) -> Server {
        let (req_tx, mut req_rx) = mpsc::channel::<FetchRequest>(64);
        let (rep_tx, rep_rx) = mpsc::channel(64);
        let task = tokio::spawn(async move {
            let mut asked = Vec::new();
            while let Some(first) = req_rx.recv().await.map(coordinator) {
                let mut batch = vec![first];
                while let Ok(r) = req_rx.try_recv().map(coordinator) {
                    batch.push(r);
                }
                if reverse {
                    batch.reverse();
                }
                for r in batch {
                    asked.push(r.offset);
                    if rep_tx.send(FetchInput::Reply(answer(&r))).await.is_err() {
                        return asked;
                    }
                }
            }
            asked
        });
        (req_tx, rep_rx, task)
    }

    /// A server of `data` (see [`serve`]); the byte at offset `tamper`, if any, is flipped.
    fn server(data: Vec<u8>, reverse: bool, tamper: Option<usize>) -> Server {
        let sha256 = flotilla_protocol::sha256(&data);
        serve(reverse, move |r| {
            let start = r.offset as usize;
            let mut block = block(&data, r);
            if let Some(at) = tamper {
                if (start..start + block.len()).contains(&at) {
                    block[at - start] ^= 0xff;
                }
            }
            BlockReply::Data {
                sha256,
                offset: r.offset,
                data: block,
            }
        })
    }

    /// The coordinator request inside a fetcher's request; this fetcher asks no peers.
    pub(crate) fn coordinator(request: FetchRequest) -> BlockRequest {
        match request {
            FetchRequest::Coordinator(r) => r,
            FetchRequest::Peer { peer, .. } => panic!("asked peer {peer}"),
        }
    }

    /// The bytes of `data` that `request` asks for, cut short at its end.
    pub(crate) fn block(data: &[u8], request: &BlockRequest) -> Vec<u8> {
        let start = (request.offset as usize).min(data.len());
        let end = (start + request.length as usize).min(data.len());
        data[start..end].to_vec()
    }

    /// The right answer to `request` from a source holding `data`.
    pub(crate) fn reply(data: &[u8], request: &BlockRequest) -> BlockReply {
        BlockReply::Data {
            sha256: request.sha256,
            offset: request.offset,
            data: block(data, request),
        }
    }

    /// Makes `spec`'s part file a link to `/dev/full`, which stands in for a full disk.
    pub(crate) fn part_file_on_full_disk(spec: &FetchSpec) {
        std::fs::create_dir_all(&spec.dir).expect("mkdir");
        std::os::unix::fs::symlink("/dev/full", spec.part_path()).expect("symlink");
    }

    /// Fetches `spec` from `have` contiguous bytes on, reporting no progress and never cancelled.
    async fn fetch_quietly(
        spec: &FetchSpec,
        have: u64,
        requests: &mpsc::Sender<FetchRequest>,
        inputs: &mut mpsc::Receiver<FetchInput>,
    ) -> Result<PathBuf, FetchError> {
        fetch(
            spec,
            have,
            &mut ByteCounts::default(),
            requests,
            inputs,
            &mut |_, _| {},
            &CancellationToken::new(),
        )
        .await
    }

    fn data(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 % 251) as u8).collect()
    }

    /// issue 19, item 11: a link that takes no requests (no broker, or one that acknowledges
    /// nothing) fills the request queue; a cancel or a shutdown still stops the fetcher, which
    /// used to wait for room without looking at its stop token.
    #[tokio::test(start_paused = true)]
    async fn a_full_request_queue_does_not_hold_up_a_cancel() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = data(1050);
        let spec = spec(dir.path(), &bytes);
        // Room for one request, and nobody takes it: the second waits.
        let (tx, _nobody_reads) = mpsc::channel(1);
        let (_replies, mut rx) = mpsc::channel(1);
        let cancel = CancellationToken::new();
        let stop = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            stop.cancel();
        });
        let fetched = tokio::time::timeout(
            Duration::from_secs(3605),
            fetch(
                &spec,
                0,
                &mut ByteCounts::default(),
                &tx,
                &mut rx,
                &mut |_, _| {},
                &cancel,
            ),
        )
        .await
        .expect("the fetcher did not stop within 5 s of the cancel");
        assert!(matches!(fetched, Err(FetchError::Canceled)), "{fetched:?}");
    }

    #[tokio::test]
    async fn downloads_out_of_order_replies_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = data(1050);
        let spec = spec(dir.path(), &bytes);
        let (tx, mut rx, _server) = server(bytes.clone(), true, None);
        let mut seen = Vec::new();
        let path = fetch(
            &spec,
            0,
            &mut ByteCounts::default(),
            &tx,
            &mut rx,
            &mut |d, _| seen.push(d),
            &CancellationToken::new(),
        )
        .await
        .expect("fetch");
        assert_eq!(std::fs::read(&path).expect("read"), bytes);
        assert_eq!(seen.last(), Some(&1050));
        assert!(
            seen.windows(2).all(|w| w[0] < w[1]),
            "progress only grows: {seen:?}"
        );
        assert!(!spec.part_path().exists());
    }

    #[tokio::test]
    async fn resume_does_not_refetch_what_it_has() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = data(1000);
        let spec = spec(dir.path(), &bytes);
        std::fs::create_dir_all(&spec.dir).expect("mkdir");
        // An earlier run wrote 300 contiguous bytes plus a torn partial block after them.
        std::fs::write(spec.part_path(), &bytes[..350]).expect("write");
        let (tx, mut rx, server) = server(bytes.clone(), false, None);
        let path = fetch_quietly(&spec, 300, &tx, &mut rx)
            .await
            .expect("fetch");
        assert_eq!(std::fs::read(&path).expect("read"), bytes);
        drop(tx);
        let asked = server.await.expect("server");
        assert_eq!(
            asked.first(),
            Some(&300),
            "resumes at the first byte it does not have"
        );
        assert!(
            asked.iter().all(|&o| o >= 300),
            "never asks for the prefix again: {asked:?}"
        );
    }

    #[tokio::test]
    async fn tampered_artifact_fails_with_sha_mismatch_after_fetching_it_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = data(500);
        let spec = spec(dir.path(), &bytes);
        let (tx, mut rx, server) = server(bytes, false, Some(123));
        let err = fetch_quietly(&spec, 0, &tx, &mut rx)
            .await
            .expect_err("mismatch");
        let msg = err.to_string();
        assert!(
            msg.starts_with("artifact app.bin: sha256 mismatch (expected "),
            "{msg}"
        );
        assert!(
            !spec.final_path().exists() && !spec.part_path().exists(),
            "nothing verified is left behind"
        );
        drop(tx);
        let asked = server.await.expect("server");
        assert_eq!(
            asked.iter().filter(|&&o| o == 0).count(),
            DOWNLOAD_ATTEMPTS as usize,
            "the artifact was downloaded {DOWNLOAD_ATTEMPTS} times before giving up: {asked:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn more_than_declared_size_is_refused_block_by_block() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = data(150);
        let spec = spec(dir.path(), &bytes);
        // A hostile server pads every block to 200 bytes.
        let (req_tx, mut rep_rx, server) = serve(false, |r| BlockReply::Data {
            sha256: r.sha256,
            offset: r.offset,
            data: vec![0; 200],
        });
        let err = fetch_quietly(&spec, 0, &req_tx, &mut rep_rx)
            .await
            .expect_err("too large");
        assert_eq!(
            err.to_string(),
            "artifact app.bin: server sent more than the declared 150 bytes \
             (block at offset 0, 5 bad replies)"
        );
        assert!(!spec.final_path().exists(), "nothing padded is kept");
        drop(req_tx);
        let asked = server.await.expect("server");
        assert_eq!(
            asked.iter().filter(|&&o| o == 0).count(),
            BLOCK_ATTEMPTS as usize,
            "{asked:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn unavailable_replies_fail_with_their_reason_after_the_retries() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = data(10);
        let spec = spec(dir.path(), &bytes);
        let (req_tx, mut rep_rx, _server) = serve(false, |r| BlockReply::Unavailable {
            sha256: r.sha256,
            offset: r.offset,
            reason: "no such artifact".into(),
        });
        let started = Instant::now();
        let err = fetch_quietly(&spec, 0, &req_tx, &mut rep_rx)
            .await
            .expect_err("unavailable");
        assert_eq!(
            err.to_string(),
            "artifact app.bin: server cannot provide it: no such artifact \
             (block at offset 0, 5 bad replies)"
        );
        // 1 + 2 + 4 + 8 seconds of backoff between the five replies.
        assert_eq!(started.elapsed(), Duration::from_secs(15));
    }

    #[tokio::test(start_paused = true)]
    async fn a_bad_reply_is_discarded_and_the_block_fetched_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = data(300);
        let spec = spec(dir.path(), &bytes);
        // The first answer for each block is bad: an Unavailable for block 0, an empty block 100
        // and an oversized block 200. Every later answer is right.
        let first = std::sync::Mutex::new(std::collections::BTreeSet::new());
        let good = bytes.clone();
        let (tx, mut rx, server) = serve(false, move |r| {
            let sha256 = r.sha256;
            let offset = r.offset;
            let fresh = first.lock().map(|mut f| f.insert(offset)).unwrap_or(false);
            match (fresh, offset) {
                (true, 0) => BlockReply::Unavailable {
                    sha256,
                    offset,
                    reason: "busy".into(),
                },
                (true, 100) => BlockReply::Data {
                    sha256,
                    offset,
                    data: Vec::new(),
                },
                (true, _) => BlockReply::Data {
                    sha256,
                    offset,
                    data: vec![7; 150],
                },
                (false, _) => reply(&good, r),
            }
        });
        let path = fetch_quietly(&spec, 0, &tx, &mut rx)
            .await
            .expect("the download survives one bad reply per block");
        assert_eq!(std::fs::read(&path).expect("read"), bytes);
        drop(tx);
        let asked = server.await.expect("server");
        assert_eq!(
            asked,
            [0, 100, 200, 0, 100, 200],
            "each block asked for twice"
        );
    }

    /// issue 10, case 6: a download that hits a full disk (`/dev/full` stands in for the part
    /// file) fails naming the error, and leaves no partial download behind.
    #[tokio::test]
    async fn a_full_disk_fails_the_download_and_removes_the_part_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = data(300);
        let spec = spec(dir.path(), &bytes);
        part_file_on_full_disk(&spec);
        let (tx, mut rx, _server) = server(bytes, false, None);
        let err = fetch_quietly(&spec, 0, &tx, &mut rx)
            .await
            .expect_err("no space");
        let msg = err.to_string();
        assert!(
            msg.starts_with("artifact app.bin: cannot write ") && msg.contains("No space left"),
            "{msg}"
        );
        assert!(
            std::fs::symlink_metadata(spec.part_path()).is_err(),
            "the partial download is removed"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn lost_requests_are_asked_for_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = data(250);
        let spec = spec(dir.path(), &bytes);
        let (req_tx, mut req_rx) = mpsc::channel::<FetchRequest>(64);
        let (rep_tx, mut rep_rx) = mpsc::channel(64);
        let served = bytes.clone();
        tokio::spawn(async move {
            let mut dropped_first = false;
            while let Some(r) = req_rx.recv().await.map(coordinator) {
                if !dropped_first {
                    dropped_first = true; // the broker lost this one
                    continue;
                }
                if rep_tx
                    .send(FetchInput::Reply(reply(&served, &r)))
                    .await
                    .is_err()
                {
                    break;
                }
            }
        });
        let path = fetch_quietly(&spec, 0, &req_tx, &mut rep_rx)
            .await
            .expect("fetch");
        assert_eq!(std::fs::read(path).expect("read"), bytes);
    }
}
