//! The peer block server: answers `Message::PeerFetch` requests from devices of the same site
//! with blocks this device holds verified (decision 0024, docs/peers.md).
//!
//! A request is served only if all of these hold, checked in this order:
//!
//! 1. its grant verifies (`verify_strict`) against a coordinator key this device trusts now
//!    (the keys of the last accepted keys document, else the configured ones), and decodes;
//! 2. the grant names this device among its `sources`;
//! 3. the grant has not expired by the agent's trusted clock (`max(system, last trusted)`);
//! 4. the grant's `digests` include the digest asked for;
//! 5. this device holds that digest verified ([`Held`]), and the block read again from disk
//!    matches its hash in the block list.
//!
//! A request whose grant fails (1) is dropped without a reply and counted: the requester is
//! unknown, and a reply would let anyone make this device publish to any device's topic. Every
//! other refusal gets `BlockReply::Unavailable` naming why, so the requester moves on to its
//! next source at once. Replies go to `peer_block(grant.device_id, this device)`: the topic
//! comes from the signed grant, never from the request.
//!
//! Bounded work: the link queues requests in a [`PeerInbox`] of [`WAITING_PER_SLOT`] places per
//! slot and drops those that find it full; at most `max_concurrent` are handled at once, each reading one
//! block (at most 64 KiB) on the blocking pool; an optional byte rate paces the replies. So a
//! flood of requests costs a bounded amount of memory and CPU and never delays the link or the
//! device's own action.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_protocol::{
    envelope, hex, BlockReply, DeviceId, PeerFetch, PeerGrant, UnixTime, VerifyingKey,
};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::PeersConfig;
use crate::env::Env;
use crate::held::Held;
use crate::link::{LinkHandle, Outgoing, PeerInbox};

/// What the server needs to check a grant: the coordinator keys trusted now and the trusted
/// clock. The agent's [`Env`] provides both.
pub trait GrantTrust: Send + Sync {
    fn coordinator_keys(&self) -> Vec<VerifyingKey>;
    fn now(&self) -> UnixTime;
}

impl GrantTrust for Env {
    fn coordinator_keys(&self) -> Vec<VerifyingKey> {
        self.trust_state().ring(&self.config.trust).coordinator_keys
    }

    fn now(&self) -> UnixTime {
        Env::now(self)
    }
}

/// Counts of what the server did, for logs and tests.
#[derive(Debug, Default)]
pub struct Stats {
    pub served_blocks: AtomicU64,
    pub served_bytes: AtomicU64,
    /// Answered `Unavailable`.
    pub refused: AtomicU64,
    /// Dropped without a reply: the grant did not verify.
    pub unverified: AtomicU64,
    /// Held artifacts no longer served because a block failed its hash.
    pub dropped_copies: AtomicU64,
}

impl Stats {
    fn add(counter: &AtomicU64, n: u64) -> u64 {
        counter.fetch_add(n, Ordering::Relaxed) + n
    }
}

/// What to do with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Send `reply` on `peer_block(to, this device)`.
    Reply { to: DeviceId, reply: BlockReply },
    /// Send nothing: the grant did not verify, so the requester is unknown.
    Drop { reason: String },
}

/// Answers peer requests from what `held` holds.
pub struct PeerServer {
    id: DeviceId,
    held: Held,
    trust: Arc<dyn GrantTrust>,
    pub stats: Stats,
}

impl std::fmt::Debug for PeerServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerServer")
            .field("id", &self.id)
            .field("held", &self.held)
            .finish_non_exhaustive()
    }
}

impl PeerServer {
    pub fn new(id: DeviceId, held: Held, trust: Arc<dyn GrantTrust>) -> Self {
        Self {
            id,
            held,
            trust,
            stats: Stats::default(),
        }
    }

    /// Checks `fetch` and reads what it asks for. Blocking file I/O: call it off the async
    /// executor.
    pub fn answer(&self, fetch: &PeerFetch) -> Answer {
        let keys = self.trust.coordinator_keys();
        let grant = match verify_grant(fetch, &keys) {
            Ok(grant) => grant,
            Err(reason) => {
                let n = Stats::add(&self.stats.unverified, 1);
                if n.is_power_of_two() {
                    tracing::warn!(
                        unverified_total = n,
                        "dropping a peer request whose grant does not verify: {reason}"
                    );
                }
                return Answer::Drop { reason };
            }
        };
        let to = grant.0;
        let request = &fetch.request;
        let refuse = |reason: String| {
            Stats::add(&self.stats.refused, 1);
            tracing::debug!(peer = %to, digest = hex::encode(&request.sha256), "refused: {reason}");
            Answer::Reply {
                to: to.clone(),
                reply: BlockReply::Unavailable {
                    sha256: request.sha256,
                    offset: request.offset,
                    reason,
                },
            }
        };
        let grant = grant.1;
        if !grant.sources.iter().any(|s| s == self.id.as_str()) {
            return refuse(format!(
                "the grant does not name {} among its sources",
                self.id
            ));
        }
        let now = self.trust.now();
        if grant.expires_at <= now {
            return refuse(format!("the grant expired at {}", grant.expires_at));
        }
        if !grant.digests.contains(&request.sha256) {
            return refuse("the grant does not cover this digest".to_owned());
        }
        match self.held.serve(request) {
            Ok(data) => {
                Stats::add(&self.stats.served_blocks, 1);
                Stats::add(&self.stats.served_bytes, data.len() as u64);
                Answer::Reply {
                    to,
                    reply: BlockReply::Data {
                        sha256: request.sha256,
                        offset: request.offset,
                        data,
                    },
                }
            }
            Err(not) => {
                if not.dropped {
                    Stats::add(&self.stats.dropped_copies, 1);
                }
                refuse(not.reason)
            }
        }
    }
}

/// Step 1: the grant verifies against a trusted coordinator key and names a valid device.
fn verify_grant(fetch: &PeerFetch, keys: &[VerifyingKey]) -> Result<(DeviceId, PeerGrant), String> {
    let bytes = fetch
        .grant
        .verify("peer grant", keys)
        .map_err(|e| e.to_string())?;
    let grant: PeerGrant = envelope::from_bytes("peer grant", bytes).map_err(|e| e.to_string())?;
    let to = DeviceId::new(grant.device_id.clone())
        .map_err(|e| format!("peer grant names device {:?}: {e}", grant.device_id))?;
    Ok((to, grant))
}

/// Requests that may wait for a free slot, per slot: a requester keeps a few outstanding, and
/// several requesters ask at once.
pub const WAITING_PER_SLOT: usize = 16;

/// The inbox the link fills for a server with these settings; `None` when serving is off.
pub fn inbox(settings: &PeersConfig) -> Option<(PeerInbox, mpsc::Receiver<PeerFetch>)> {
    settings
        .serve
        .then(|| PeerInbox::new(settings.max_concurrent * WAITING_PER_SLOT))
}

/// Serves the requests arriving in `inbox` until `shutdown` is cancelled: at most
/// `settings.max_concurrent` at once, paced to `settings.max_bytes_per_sec`.
pub fn start(
    server: Arc<PeerServer>,
    settings: &PeersConfig,
    mut inbox: mpsc::Receiver<PeerFetch>,
    link: LinkHandle,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let max_concurrent = settings.max_concurrent.max(1);
    let slots = Arc::new(Semaphore::new(max_concurrent));
    let pacer = Arc::new(Pacer::new(settings.max_bytes_per_sec));
    tokio::spawn(async move {
        loop {
            // A slot first, then a request: while every slot is busy, requests wait in the
            // bounded inbox (and the link drops those beyond it), not here.
            let slot = tokio::select! {
                _ = shutdown.cancelled() => break,
                slot = slots.clone().acquire_owned() => match slot {
                    Ok(slot) => slot,
                    Err(_) => break,
                },
            };
            let fetch = tokio::select! {
                _ = shutdown.cancelled() => break,
                fetch = inbox.recv() => match fetch {
                    Some(fetch) => fetch,
                    None => break,
                },
            };
            let server = server.clone();
            let link = link.clone();
            let pacer = pacer.clone();
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                let _slot = slot;
                let answer = tokio::task::spawn_blocking(move || server.answer(&fetch)).await;
                let Ok(Answer::Reply { to, reply }) = answer else {
                    return;
                };
                if let BlockReply::Data { data, .. } = &reply {
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = pacer.wait(data.len() as u64) => {}
                    }
                }
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = link.send(Outgoing::PeerBlock { to, reply }) => {}
                }
            });
        }
        // Requests in flight end before the server does (each holds its slot to the end), so
        // nothing of the agent outlives a stop: its database is closed when `run` returns.
        let all = u32::try_from(max_concurrent).unwrap_or(u32::MAX);
        let _ = tokio::time::timeout(Duration::from_secs(5), slots.acquire_many(all)).await;
    })
}

/// Paces replies to a byte rate shared by every request (0 = unlimited).
#[derive(Debug)]
struct Pacer {
    bytes_per_sec: u64,
    next: Mutex<Option<Instant>>,
}

impl Pacer {
    fn new(bytes_per_sec: u64) -> Self {
        Self {
            bytes_per_sec,
            next: Mutex::new(None),
        }
    }

    /// Waits for the turn of `bytes` more bytes.
    async fn wait(&self, bytes: u64) {
        if self.bytes_per_sec == 0 {
            return;
        }
        let cost = Duration::from_secs_f64(bytes as f64 / self.bytes_per_sec as f64);
        let at = {
            let Ok(mut next) = self.next.lock() else {
                return;
            };
            let now = Instant::now();
            let at = next.map_or(now, |n| n.max(now));
            *next = Some(at + cost);
            at
        };
        tokio::time::sleep_until(at).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::held::tests::{artifact, hold};
    use flotilla_protocol::blocks::DEFAULT_BLOCK_SIZE;
    use flotilla_protocol::{BlockRequest, SignedBlob, SigningKey};

    const NOW: UnixTime = 1_000_000;

    struct FixedTrust(Vec<VerifyingKey>);

    impl GrantTrust for FixedTrust {
        fn coordinator_keys(&self) -> Vec<VerifyingKey> {
            self.0.clone()
        }
        fn now(&self) -> UnixTime {
            NOW
        }
    }

    fn coordinator() -> SigningKey {
        SigningKey::from_bytes(&[7; 32])
    }

    fn id(s: &str) -> DeviceId {
        DeviceId::new(s).expect("id")
    }

    fn grant(
        key: &SigningKey,
        sources: &[&str],
        digests: &[[u8; 32]],
        expires_at: u64,
    ) -> SignedBlob {
        SignedBlob::sign(
            key,
            envelope::to_bytes(&PeerGrant {
                device_id: "requester".into(),
                action_id: "a-1".into(),
                rollout_id: "r-1".into(),
                sources: sources.iter().map(|s| s.to_string()).collect(),
                digests: digests.to_vec(),
                expires_at,
            }),
        )
    }

    struct Fixture {
        _dir: tempfile::TempDir,
        dir: std::path::PathBuf,
        data: Vec<u8>,
        sha: [u8; 32],
        list_sha: [u8; 32],
        server: PeerServer,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = artifact(150_000);
        let (sha, list_sha) = hold(dir.path(), &data, DEFAULT_BLOCK_SIZE);
        let server = PeerServer::new(
            id("peer-1"),
            Held::new(dir.path()),
            Arc::new(FixedTrust(vec![coordinator().verifying_key()])),
        );
        Fixture {
            dir: dir.path().to_owned(),
            _dir: dir,
            data,
            sha,
            list_sha,
            server,
        }
    }

    fn fetch(grant: SignedBlob, sha256: [u8; 32], offset: u64) -> PeerFetch {
        PeerFetch {
            grant,
            request: BlockRequest {
                sha256,
                offset,
                length: DEFAULT_BLOCK_SIZE,
            },
        }
    }

    /// The reason of an `Unavailable` sent to the requester, or panics.
    fn refusal(answer: Answer) -> String {
        match answer {
            Answer::Reply {
                to,
                reply: BlockReply::Unavailable { reason, .. },
            } => {
                assert_eq!(
                    to.as_str(),
                    "requester",
                    "refusals go to the grant's device"
                );
                reason
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_granted_held_block_is_served_to_the_grants_device() {
        let f = fixture();
        let g = grant(
            &coordinator(),
            &["peer-0", "peer-1"],
            &[f.sha, f.list_sha],
            NOW + 60,
        );
        match f.server.answer(&fetch(g.clone(), f.sha, 65_536)) {
            Answer::Reply {
                to,
                reply:
                    BlockReply::Data {
                        sha256,
                        offset,
                        data,
                    },
            } => {
                assert_eq!(to.as_str(), "requester");
                assert_eq!((sha256, offset), (f.sha, 65_536));
                assert_eq!(data, &f.data[65_536..131_072]);
            }
            other => panic!("not served: {other:?}"),
        }
        // The block list, by its own digest.
        let Answer::Reply {
            reply: BlockReply::Data { data, .. },
            ..
        } = f.server.answer(&fetch(g, f.list_sha, 0))
        else {
            panic!("list not served");
        };
        assert_eq!(data.len(), 3 * 32);
        assert_eq!(f.server.stats.served_blocks.load(Ordering::Relaxed), 2);
    }

    /// The reply topic comes from the signed grant: a request cannot redirect it. (The request
    /// has no field naming a device at all; a grant re-signed for another device by anyone but
    /// the coordinator does not verify.)
    #[test]
    fn the_reply_goes_to_the_device_the_grant_names() {
        let f = fixture();
        let g = grant(&coordinator(), &["peer-1"], &[f.sha], NOW + 60);
        let Answer::Reply { to, .. } = f.server.answer(&fetch(g, f.sha, 0)) else {
            panic!("no reply");
        };
        assert_eq!(to.as_str(), "requester");
        let topics = flotilla_protocol::Topics::default();
        assert_eq!(
            topics.peer_block(&to, &id("peer-1")),
            format!("{}/devices/requester/peer-block/peer-1", topics.prefix())
        );
    }

    #[test]
    fn a_forged_grant_is_dropped_without_a_reply() {
        let f = fixture();
        // Signed by a key nobody trusts.
        let forged = grant(
            &SigningKey::from_bytes(&[9; 32]),
            &["peer-1"],
            &[f.sha],
            NOW + 60,
        );
        let Answer::Drop { reason } = f.server.answer(&fetch(forged, f.sha, 0)) else {
            panic!("a forged grant was answered");
        };
        assert!(reason.contains("unknown key"), "{reason}");

        // The trusted key's name on someone else's signature.
        let mut tampered = grant(&coordinator(), &["peer-1"], &[f.sha], NOW + 60);
        tampered.payload = envelope::to_bytes(&PeerGrant {
            device_id: "attacker".into(),
            action_id: "a-1".into(),
            rollout_id: "r-1".into(),
            sources: vec!["peer-1".into()],
            digests: vec![f.sha],
            expires_at: NOW + 60,
        });
        let Answer::Drop { reason } = f.server.answer(&fetch(tampered, f.sha, 0)) else {
            panic!("a tampered grant was answered");
        };
        assert!(reason.contains("does not verify"), "{reason}");

        // Garbage where a grant should be, signed: it verifies but does not decode.
        let junk = SignedBlob::sign(&coordinator(), vec![0xff; 10]);
        assert!(matches!(
            f.server.answer(&fetch(junk, f.sha, 0)),
            Answer::Drop { .. }
        ));
        assert_eq!(f.server.stats.unverified.load(Ordering::Relaxed), 3);
        assert_eq!(f.server.stats.served_blocks.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_grant_by_a_key_no_longer_trusted_is_dropped() {
        let f = fixture();
        let old = SigningKey::from_bytes(&[8; 32]);
        let server = PeerServer::new(
            id("peer-1"),
            Held::new(&f.dir),
            // Rotated: only the new key is trusted now.
            Arc::new(FixedTrust(vec![coordinator().verifying_key()])),
        );
        let g = grant(&old, &["peer-1"], &[f.sha], NOW + 60);
        assert!(matches!(
            server.answer(&fetch(g, f.sha, 0)),
            Answer::Drop { .. }
        ));
    }

    #[test]
    fn every_refusal_names_why() {
        let f = fixture();
        let g = |sources: &[&str], digests: &[[u8; 32]], exp| {
            grant(&coordinator(), sources, digests, exp)
        };
        let r = refusal(
            f.server
                .answer(&fetch(g(&["peer-2"], &[f.sha], NOW + 60), f.sha, 0)),
        );
        assert_eq!(r, "the grant does not name peer-1 among its sources");
        let r = refusal(
            f.server
                .answer(&fetch(g(&["peer-1"], &[f.sha], NOW), f.sha, 0)),
        );
        assert_eq!(r, format!("the grant expired at {NOW}"));
        let other = [3u8; 32];
        let r = refusal(
            f.server
                .answer(&fetch(g(&["peer-1"], &[f.sha], NOW + 60), other, 0)),
        );
        assert_eq!(r, "the grant does not cover this digest");
        let r = refusal(
            f.server
                .answer(&fetch(g(&["peer-1"], &[other], NOW + 60), other, 0)),
        );
        assert_eq!(r, "this device does not hold that digest verified");
        assert_eq!(f.server.stats.refused.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn a_held_file_that_no_longer_matches_its_list_is_not_served_and_dropped() {
        let f = fixture();
        let g = grant(&coordinator(), &["peer-1"], &[f.sha], NOW + 60);
        assert!(matches!(
            f.server.answer(&fetch(g.clone(), f.sha, 0)),
            Answer::Reply {
                reply: BlockReply::Data { .. },
                ..
            }
        ));
        let mut bad = f.data.clone();
        bad[1] ^= 0x55;
        std::fs::write(f.dir.join(hex::encode(&f.sha)), &bad).expect("damage");
        let r = refusal(f.server.answer(&fetch(g.clone(), f.sha, 0)));
        assert!(r.contains("does not match its hash"), "{r}");
        assert_eq!(f.server.stats.dropped_copies.load(Ordering::Relaxed), 1);
        // Dropped from what the device serves: an intact block of it is refused too.
        let r = refusal(f.server.answer(&fetch(g, f.sha, 65_536)));
        assert_eq!(r, "this device does not hold that digest verified");
    }

    /// At most `max_concurrent` requests are handled at once and [`WAITING_PER_SLOT`] per slot
    /// wait; the rest are dropped and counted, and every accepted one is answered once the link
    /// drains.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn work_is_bounded_and_the_excess_is_dropped() {
        let f = fixture();
        let settings = PeersConfig {
            serve: true,
            max_concurrent: 2,
            max_bytes_per_sec: 0,
            keep_bytes: 1 << 30,
        };
        let (inbox, rx) = inbox(&settings).expect("serving is on");
        // A link that is full until drained.
        let (tx, mut sent) = mpsc::channel(1);
        tx.try_send(Outgoing::Subscribe).expect("room for one");
        let shutdown = CancellationToken::new();
        let server = Arc::new(f.server);
        let task = start(
            server.clone(),
            &settings,
            rx,
            LinkHandle::from_channel(tx),
            shutdown.clone(),
        );
        let g = grant(&coordinator(), &["peer-1"], &[f.sha], NOW + 60);
        // Fill both slots: both replies wait for the link.
        for _ in 0..2 {
            assert!(inbox.offer(fetch(g.clone(), f.sha, 0)));
        }
        tokio::time::timeout(Duration::from_secs(30), async {
            while server.stats.served_blocks.load(Ordering::Relaxed) < 2 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("both slots busy");
        // Now only the inbox's places are left.
        let waiting = 2 * WAITING_PER_SLOT;
        let accepted = (0..waiting + 8)
            .filter(|_| inbox.offer(fetch(g.clone(), f.sha, 0)))
            .count();
        assert_eq!(accepted, waiting);
        assert_eq!(inbox.dropped(), 8);
        assert!(matches!(sent.recv().await, Some(Outgoing::Subscribe)));
        let mut replies = 0;
        while replies < 2 + waiting {
            let m = tokio::time::timeout(Duration::from_secs(30), sent.recv())
                .await
                .expect("a reply")
                .expect("open");
            assert!(matches!(m, Outgoing::PeerBlock { .. }));
            replies += 1;
        }
        assert_eq!(
            server.stats.served_blocks.load(Ordering::Relaxed),
            2 + waiting as u64
        );
        shutdown.cancel();
        let _ = task.await;
    }

    #[tokio::test(start_paused = true)]
    async fn the_byte_rate_paces_replies() {
        let pacer = Pacer::new(65_536);
        let start = Instant::now();
        for _ in 0..4 {
            pacer.wait(65_536).await;
        }
        // Three blocks' worth of waiting before the fourth may go (virtual time).
        assert_eq!(start.elapsed().as_secs(), 3);
        let unlimited = Pacer::new(0);
        let start = Instant::now();
        unlimited.wait(1 << 30).await;
        assert_eq!(start.elapsed().as_secs(), 0);
    }
}
