//! Simulated devices that download (`--download mqtt|http`): between `Accepted` and
//! `Downloading`, a device fetches every artifact of the release its desired action names and
//! checks it ([`crate::artifact_check`]) before it reports `Verified`, as the agent does
//! (`agent/src/fetch.rs`, `fetch_blocks.rs`, `block_list_fetch.rs`, `http_origin.rs`).
//!
//! - **mqtt**: signed [`DeviceMessage::Fetch`] block requests on the device's `fetch` topic,
//!   answered by the coordinator's artifact server on its `block` topic, [`IN_FLIGHT`]
//!   requests outstanding per device. The simulator's one connection subscribes to every
//!   device's `block` topic; [`Fetcher::on_block`] hands each reply to the device waiting for
//!   it and drops the rest.
//! - **http**: range requests to the origin URL the action names for the artifact
//!   (`ActionBody::InstallFromOrigins`), runs of up to [`RUN_BYTES`] on one keep-alive
//!   connection ([`crate::http_range`]); an artifact without an origin is fetched over MQTT,
//!   as the agent falls back to the coordinator.
//! - Either way a block-indexed artifact's block list is fetched first, over MQTT from the
//!   coordinator by its own digest, and checked against the signed index, as the agent does;
//!   every block is then checked against it. Without a block index, the whole artifact's
//!   sha256 is checked at the end.
//! - At most `--download-at-once` devices download at a time; the others wait their turn
//!   (after `Accepted`), so the simulator's memory and CPU stay small whatever the fleet.
//! - Nothing is written to disk and nothing is retried: a bad block, an `Unavailable` reply, an
//!   HTTP error or [`REPLY_TIMEOUT`] without a reply fails the device's action with a reason
//!   naming what was wrong (the agent retries; a benchmark wants to see it).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use flotilla_protocol::blocks::{list_size, BlockIndexRef, BlockList, MAX_BLOCK_SIZE};
use flotilla_protocol::manifest::Manifest;
use flotilla_protocol::origin::{Origin, HTTP_SOURCE};
use flotilla_protocol::{
    device, envelope, hex, BlockReply, BlockRequest, ByteCounts, DeviceId, DeviceMessage, Digest,
    Message, Phase, SigningKey, Topic, Topics,
};
use rumqttc::{AsyncClient, QoS};
use tokio::sync::{mpsc, Semaphore};

use crate::artifact_check::{ArtifactCheck, CheckError};
use crate::http_range::{HttpError, RangeClient};

/// Block requests outstanding per device over MQTT.
pub const IN_FLIGHT: usize = 4;

/// Most bytes asked in one HTTP range request (the agent's run, decision 0068).
pub const RUN_BYTES: u64 = 1024 * 1024;

/// How long a device waits for a block reply before its download fails.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// Where simulated devices get their bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DownloadMode {
    /// Download nothing: installs are instant.
    None,
    /// Block requests to the coordinator over MQTT.
    Mqtt,
    /// Range requests to the action's HTTP origin.
    Http,
}

/// Why a device's download failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(transparent)]
    Check(#[from] CheckError),
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error("artifact {artifact}: block list refused: {reason}")]
    BlockList { artifact: String, reason: String },
    #[error(
        "{what} {digest}: the coordinator answered offset {offset} with unavailable: {reason}"
    )]
    Unavailable {
        what: String,
        digest: String,
        offset: u64,
        reason: String,
    },
    #[error("{what} {digest}: no block reply in {after:?}")]
    NoReply {
        what: String,
        digest: String,
        after: Duration,
    },
}

/// One artifact to fetch.
#[derive(Debug, Clone)]
pub struct ArtifactJob {
    pub name: String,
    pub sha256: Digest,
    pub size: u64,
    pub index: Option<BlockIndexRef>,
    /// The origin the action names for it.
    pub url: Option<String>,
}

/// The artifacts of a release, with the origins a desired action names.
pub fn jobs(manifest: &Manifest, origins: &[Origin]) -> Vec<ArtifactJob> {
    manifest
        .release
        .artifacts
        .iter()
        .enumerate()
        .map(|(i, a)| ArtifactJob {
            name: a.name.clone(),
            sha256: a.sha256,
            size: a.size,
            index: manifest.block_index(i).copied(),
            url: origins
                .iter()
                .find(|o| o.sha256 == a.sha256)
                .map(|o| o.url.clone()),
        })
        .collect()
}

/// What every download of a run shares.
pub struct Fetcher {
    mode: DownloadMode,
    topics: Topics,
    client: AsyncClient,
    at_once: Semaphore,
    /// The devices waiting for block replies, by device id.
    waiting: Mutex<HashMap<String, mpsc::UnboundedSender<BlockReply>>>,
    pub counters: FetchCounters,
}

/// What the downloads of a run moved.
#[derive(Debug, Default)]
pub struct FetchCounters {
    /// Block data taken from MQTT replies (block lists included) and from HTTP bodies.
    pub mqtt_bytes: AtomicU64,
    pub http_bytes: AtomicU64,
    pub requests: AtomicU64,
    pub http_requests: AtomicU64,
    pub downloads: AtomicU64,
    pub failed: AtomicU64,
}

impl Fetcher {
    pub fn new(mode: DownloadMode, topics: Topics, client: AsyncClient, at_once: usize) -> Self {
        Fetcher {
            mode,
            topics,
            client,
            at_once: Semaphore::new(at_once.max(1)),
            waiting: Mutex::new(HashMap::new()),
            counters: FetchCounters::default(),
        }
    }

    /// The filter for every device's block replies.
    pub fn block_filter(&self) -> String {
        format!("{}/devices/+/block", self.topics.prefix())
    }

    /// A publish that may be a block reply for a waiting device: true if it was one (taken or
    /// dropped), false if the topic is not a `block` topic.
    pub fn on_block(&self, topic: &str, payload: &[u8]) -> bool {
        let Some(Topic::Block(id)) = self.topics.parse(topic) else {
            return false;
        };
        let Ok(Message::Block(reply)) = envelope::decode(payload) else {
            return true;
        };
        let waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = waiting.get(id.as_str()) {
            let _ = tx.send(reply);
        }
        true
    }

    /// Downloads and checks every artifact of `jobs` for device `id`, waiting for a turn
    /// first. Returns the bytes by source, as the agent's final report carries them.
    pub async fn download(
        &self,
        id: &DeviceId,
        key: &SigningKey,
        jobs: &[ArtifactJob],
    ) -> Result<ByteCounts, FetchError> {
        let _turn = self.at_once.acquire().await;
        let (tx, rx) = mpsc::unbounded_channel();
        self.lock_waiting().insert(id.to_string(), tx);
        let mut device = DeviceFetch {
            fetcher: self,
            id,
            key,
            replies: rx,
            counts: ByteCounts::default(),
        };
        let mut result = Ok(());
        for job in jobs {
            result = device.artifact(job).await;
            if result.is_err() {
                break;
            }
        }
        self.lock_waiting().remove(id.as_str());
        let counter = if result.is_ok() {
            &self.counters.downloads
        } else {
            &self.counters.failed
        };
        counter.fetch_add(1, Relaxed);
        result.map(|()| device.counts)
    }

    /// Bytes taken over MQTT and over HTTP, and downloads that failed, so far.
    pub fn totals(&self) -> (u64, u64, u64) {
        let c = &self.counters;
        (
            c.mqtt_bytes.load(Relaxed),
            c.http_bytes.load(Relaxed),
            c.failed.load(Relaxed),
        )
    }

    fn lock_waiting(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, mpsc::UnboundedSender<BlockReply>>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One device's download in progress.
struct DeviceFetch<'a> {
    fetcher: &'a Fetcher,
    id: &'a DeviceId,
    key: &'a SigningKey,
    replies: mpsc::UnboundedReceiver<BlockReply>,
    counts: ByteCounts,
}

impl DeviceFetch<'_> {
    async fn artifact(&mut self, job: &ArtifactJob) -> Result<(), FetchError> {
        let list = match &job.index {
            Some(index) => Some(self.block_list(job, index).await?),
            None => None,
        };
        let mut check = ArtifactCheck::new(&job.name, job.sha256, job.size, list);
        match (&job.url, self.fetcher.mode) {
            (Some(url), DownloadMode::Http) => self.over_http(url, &mut check).await?,
            _ => {
                let blocks = check.blocks();
                let what = format!("artifact {}", job.name);
                self.over_mqtt(&what, job.sha256, &blocks, |offset, data| {
                    check.accept(offset, data).map_err(FetchError::from)
                })
                .await?;
            }
        }
        check.finish()?;
        Ok(())
    }

    /// The artifact's block list, from the coordinator, checked against the signed index.
    async fn block_list(
        &mut self,
        job: &ArtifactJob,
        index: &BlockIndexRef,
    ) -> Result<BlockList, FetchError> {
        let size = list_size(job.size, index.block_size);
        let blocks: Vec<(u64, u32)> = (0..size.div_ceil(u64::from(MAX_BLOCK_SIZE)))
            .map(|i| {
                let offset = i * u64::from(MAX_BLOCK_SIZE);
                (
                    offset,
                    (size - offset).min(u64::from(MAX_BLOCK_SIZE)) as u32,
                )
            })
            .collect();
        let mut bytes = vec![0u8; size as usize];
        let what = format!("block list of artifact {}", job.name);
        self.over_mqtt(&what, index.sha256, &blocks, |offset, data| {
            let start = offset as usize;
            let end = start + data.len();
            if end > bytes.len() {
                return Err(FetchError::BlockList {
                    artifact: job.name.clone(),
                    reason: format!("a reply of {} bytes at offset {offset}", data.len()),
                });
            }
            bytes[start..end].copy_from_slice(data);
            Ok(())
        })
        .await?;
        BlockList::from_bytes(&bytes, index, job.size).map_err(|e| FetchError::BlockList {
            artifact: job.name.clone(),
            reason: e.to_string(),
        })
    }

    /// Asks for `blocks` of `digest` with [`IN_FLIGHT`] requests outstanding and hands each
    /// reply's data to `take`. A reply for another digest or a block not asked is dropped.
    async fn over_mqtt(
        &mut self,
        what: &str,
        digest: Digest,
        blocks: &[(u64, u32)],
        mut take: impl FnMut(u64, &[u8]) -> Result<(), FetchError>,
    ) -> Result<(), FetchError> {
        let mut queue: VecDeque<(u64, u32)> = blocks.iter().copied().collect();
        let mut outstanding: HashMap<u64, u32> = HashMap::new();
        // Replies to an earlier artifact's requests are stale now.
        while self.replies.try_recv().is_ok() {}
        loop {
            while outstanding.len() < IN_FLIGHT {
                let Some((offset, length)) = queue.pop_front() else {
                    break;
                };
                self.request(digest, offset, length).await;
                outstanding.insert(offset, length);
            }
            if outstanding.is_empty() {
                return Ok(());
            }
            let reply = match tokio::time::timeout(REPLY_TIMEOUT, self.replies.recv()).await {
                Ok(Some(reply)) => reply,
                Ok(None) | Err(_) => {
                    return Err(FetchError::NoReply {
                        what: what.to_owned(),
                        digest: hex::encode(&digest),
                        after: REPLY_TIMEOUT,
                    })
                }
            };
            match reply {
                BlockReply::Data {
                    sha256,
                    offset,
                    data,
                } if sha256 == digest && outstanding.contains_key(&offset) => {
                    outstanding.remove(&offset);
                    self.fetcher
                        .counters
                        .mqtt_bytes
                        .fetch_add(data.len() as u64, Relaxed);
                    self.counts.coordinator += data.len() as u64;
                    take(offset, &data)?;
                }
                BlockReply::Unavailable {
                    sha256,
                    offset,
                    reason,
                } if sha256 == digest && outstanding.contains_key(&offset) => {
                    return Err(FetchError::Unavailable {
                        what: what.to_owned(),
                        digest: hex::encode(&digest),
                        offset,
                        reason,
                    });
                }
                _ => {}
            }
        }
    }

    /// One signed block request on the device's `fetch` topic.
    async fn request(&self, sha256: Digest, offset: u64, length: u32) {
        let message = DeviceMessage::Fetch {
            device_id: self.id.to_string(),
            request: BlockRequest {
                sha256,
                offset,
                length,
            },
        };
        let payload = envelope::encode(&Message::Device(device::sign(self.key, &message)));
        self.fetcher.counters.requests.fetch_add(1, Relaxed);
        let topic = self.fetcher.topics.fetch(self.id);
        if let Err(e) = self
            .fetcher
            .client
            .publish(topic, QoS::AtLeastOnce, false, payload)
            .await
        {
            tracing::warn!("cannot queue a block request: {e}");
        }
    }

    /// Every block of `check`'s artifact from `url`, in runs of up to [`RUN_BYTES`].
    async fn over_http(&mut self, url: &str, check: &mut ArtifactCheck) -> Result<(), FetchError> {
        let mut client = RangeClient::new(url)?;
        let blocks = check.blocks();
        let per_run = (RUN_BYTES / u64::from(check.block_size())).max(1) as usize;
        for run in blocks.chunks(per_run) {
            let first = run[0].0;
            let length: u64 = run.iter().map(|(_, l)| u64::from(*l)).sum();
            let body = client.get(first, length).await?;
            self.fetcher.counters.http_requests.fetch_add(1, Relaxed);
            self.fetcher
                .counters
                .http_bytes
                .fetch_add(body.len() as u64, Relaxed);
            add_http(&mut self.counts, body.len() as u64);
            for &(offset, len) in run {
                let start = (offset - first) as usize;
                check.accept(offset, &body[start..start + len as usize])?;
            }
        }
        Ok(())
    }
}

/// The phase a device reports when its download failed: failed, nothing changed on the
/// device, the reason naming the artifact and what was wrong with it.
pub fn failed(error: &FetchError) -> Phase {
    Phase::Failed {
        reason: format!("download: {error}"),
        rolled_back: false,
    }
}

fn add_http(counts: &mut ByteCounts, n: u64) {
    match counts
        .peers
        .iter_mut()
        .find(|(name, _)| name == HTTP_SOURCE)
    {
        Some((_, total)) => *total += n,
        None => counts.peers.push((HTTP_SOURCE.to_owned(), n)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_protocol::blocks::BlockIndexRef;
    use flotilla_protocol::manifest::ManifestBlocks;
    use flotilla_protocol::{Artifact, ReleaseManifest};

    #[test]
    fn jobs_name_each_artifacts_index_and_origin() {
        let artifact = |name: &str, b: u8| Artifact {
            name: name.into(),
            target: name.into(),
            size: 1000,
            sha256: [b; 32],
        };
        let mut manifest = Manifest::plain(ReleaseManifest {
            name: "fw".into(),
            version: "1".into(),
            counter: 1,
            hardware: vec![],
            artifacts: vec![artifact("app", 1), artifact("cfg", 2)],
            created_at: 0,
            expires_at: 0,
        });
        let index = |b| BlockIndexRef {
            block_size: 1024,
            sha256: [b; 32],
        };
        manifest.blocks = Some(ManifestBlocks {
            artifacts: vec![index(9), index(8)],
        });
        let origins = [Origin {
            sha256: [2; 32],
            url: "http://o/cfg".into(),
        }];
        let jobs = jobs(&manifest, &origins);
        assert_eq!(jobs.len(), 2);
        assert_eq!(
            (jobs[0].url.as_deref(), jobs[0].index),
            (None, Some(index(9)))
        );
        assert_eq!(jobs[1].url.as_deref(), Some("http://o/cfg"));
        assert_eq!(jobs[1].index, Some(index(8)));
    }

    #[test]
    fn a_refused_block_fails_the_action_naming_the_block() {
        let error = FetchError::from(CheckError::BlockHash {
            artifact: "app".into(),
            index: 3,
            offset: 196_608,
        });
        let phase = failed(&error);
        assert!(phase.is_terminal());
        assert_eq!(
            phase.reason(),
            Some("download: artifact app: block 3 (offset 196608) does not match its signed hash")
        );
    }

    #[test]
    fn http_bytes_count_under_the_http_source() {
        let mut counts = ByteCounts::default();
        add_http(&mut counts, 10);
        add_http(&mut counts, 5);
        assert_eq!(counts.from_http(), 15);
        assert_eq!(counts.from_peers(), 0);
    }
}
