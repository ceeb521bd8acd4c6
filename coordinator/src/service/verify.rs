//! Verify ahead: device messages are decoded and their self-signatures checked on worker
//! threads, between the MQTT link and the service loop, and handed to the loop in the order
//! they arrived.
//!
//! ```text
//!  Inbox (mqtt.rs) ──> dispatcher task ──round robin──> worker 0 ──┐
//!                      (takes a byte budget              worker 1 ──┼──round robin──> service loop
//!                       per publish)                     worker N ──┘   (Pipeline::recv)
//! ```
//!
//! Every event of the link goes through the workers, publishes and connection events alike.
//! Event `k` goes to worker `k mod N`; each worker is a FIFO; the service takes from worker 0,
//! 1, … N-1, 0, … in turn. So the service sees exactly the order the link saw, with no reorder
//! buffer: a control request never overtakes the states that arrived before it, and a device's
//! report never overtakes its state.
//!
//! What a worker does is pure ([`check`]): for a publish on a device's state, report or fetch
//! topic it decodes the envelope and, for a signed device message, checks the signature
//! against the key the message names (`verify_strict` over the bytes received). Which key is
//! the device's key, and whether the message passes, stays with the enrollment registry on the
//! service task ([`Registry::observe_checked`](crate::service::enrollment::Registry::observe_checked)).
//! Decompressed keys are kept in a bounded [`KeyCache`] shared by the workers, so an enrolled
//! device's key is not decompressed again for every message.
//!
//! Memory stays bounded under a flood: each worker's queues hold at most [`QUEUE_DEPTH`] events,
//! and the publishes inside the pipeline at most [`PIPELINE_BYTES`] of payload. When the
//! pipeline is full the dispatcher stops taking from the link's inbox, which fills up and drops
//! (and counts) publishes as it always did (`mqtt.rs`); nothing is dropped inside the pipeline.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use flotilla_protocol::{
    envelope, DeviceMessage, Message, SignedBlob, Topic, Topics, VerifyingKey, BROKER_PACKET_LIMIT,
};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::service::mqtt::{Events, LinkEvent};
use crate::service::verify_batch::{BatchVerifier, MAX_BATCH};

/// Events each worker's input and output queue holds.
pub const QUEUE_DEPTH: usize = 256;

/// Payload bytes of the publishes inside the pipeline at once (on top of the link's inbox).
pub const PIPELINE_BYTES: usize = 16 * 1024 * 1024;

/// Most worker threads the default picks (one per core up to this many).
pub const DEFAULT_MAX_THREADS: usize = 8;

/// Decompressed device keys kept at most (two generations of half this each, see [`KeyCache`]).
/// A `VerifyingKey` and its map entry take about 250 bytes: about 64 MiB when full.
pub const KEY_CACHE_CAPACITY: usize = 262_144;

/// The default number of workers: the cores available, at most [`DEFAULT_MAX_THREADS`].
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, DEFAULT_MAX_THREADS)
}

/// What a worker made of a publish on a device's state, report or fetch topic.
// The signed variant is the common one; boxing it would add an allocation per message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Checked {
    /// The payload is not an envelope.
    Undecodable(String),
    /// An old unsigned state, report or block request.
    Unsigned,
    /// Another kind of message (its name).
    WrongKind(&'static str),
    /// A signed device message; `verified` is the key it names when the signature verifies
    /// under that key. The signed bytes are decoded by the service ([`decode_verified`]).
    Signed {
        blob: SignedBlob,
        verified: Option<VerifyingKey>,
    },
}

/// Decodes a device topic's payload and checks a signed device message against the key it
/// names (proof only that the sender holds that key). `keys` keeps decompressed keys; `None`
/// decompresses every time.
pub fn check(payload: &[u8], keys: Option<&KeyCache>) -> Checked {
    match decode(payload) {
        Checked::Signed { blob, .. } => {
            let verified = match keys {
                Some(keys) => keys.verify(&blob),
                None => verify_named(&blob, None),
            };
            Checked::Signed { blob, verified }
        }
        other => other,
    }
}

/// [`check`] without the signature check: a signed device message comes back with
/// `verified: None`.
fn decode(payload: &[u8]) -> Checked {
    match envelope::decode(payload) {
        Err(e) => Checked::Undecodable(e.to_string()),
        Ok(Message::Device(blob)) => Checked::Signed {
            blob,
            verified: None,
        },
        Ok(Message::State(_) | Message::Report(_) | Message::Fetch(_)) => Checked::Unsigned,
        Ok(other) => Checked::WrongKind(other.name()),
    }
}

/// Checks the signature over the bytes received under the key the blob names (`key`, when it
/// is already decompressed). Returns that key when it verifies.
fn verify_named(blob: &SignedBlob, key: Option<VerifyingKey>) -> Option<VerifyingKey> {
    let key = match key {
        Some(key) => key,
        None => VerifyingKey::from_bytes(&blob.signer).ok()?,
    };
    blob.verify("device message", std::slice::from_ref(&key))
        .ok()?;
    Some(key)
}

/// The device message in a blob whose signature verified under `verified`: what
/// [`flotilla_protocol::device::open_self_signed`] returns, with the check already done. Decoded by the service
/// task, not a worker: the engine and the registry keep parts of it, and memory allocated by
/// worker threads and kept by the service pins the workers' allocator arenas (the coordinator's
/// memory after a 100k rollout doubled when the workers decoded).
pub fn decode_verified(
    blob: &SignedBlob,
    verified: Option<VerifyingKey>,
) -> Option<(VerifyingKey, DeviceMessage)> {
    let key = verified.filter(|key| key.as_bytes() == &blob.signer)?;
    let message = envelope::from_bytes::<DeviceMessage>("device message", &blob.payload).ok()?;
    Some((key, message))
}

/// Whether the service would check this publish's payload (a device topic, not too large, not
/// a cleared state): the same tests, in the same order, as `Service::on_publish`.
fn wants_check(topics: &Topics, topic: &str, payload: &[u8]) -> bool {
    if payload.len() > BROKER_PACKET_LIMIT {
        return false;
    }
    match topics.parse(topic) {
        Some(Topic::State(_)) => !payload.is_empty(),
        Some(Topic::Report(_) | Topic::Fetch(_)) => true,
        _ => false,
    }
}

/// Decompressed device keys by their 32 bytes, bounded: a hostile client can sign messages
/// with a million fresh keys.
///
/// Two generations: lookups hit either; a hit in the older one moves the key to the current
/// one; when the current one is full it becomes the older one and the older one is dropped. A
/// key used at least once per `capacity / 2` new keys stays; a flood of fresh keys costs the
/// enrolled devices a decompression each (what every message cost without the cache), never
/// memory beyond `capacity` keys. Only keys under which a signature verified go in.
#[derive(Debug)]
pub struct KeyCache {
    generations: Mutex<Generations>,
    generation_size: usize,
}

#[derive(Debug, Default)]
struct Generations {
    current: HashMap<[u8; 32], VerifyingKey>,
    previous: HashMap<[u8; 32], VerifyingKey>,
}

impl KeyCache {
    /// A cache of at most `capacity` keys (at least 2).
    pub fn new(capacity: usize) -> Self {
        Self {
            generations: Mutex::new(Generations::default()),
            generation_size: (capacity / 2).max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Generations> {
        // Nothing panics while holding the lock; a poisoned one still holds consistent data.
        self.generations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keys held now.
    pub fn len(&self) -> usize {
        let g = self.lock();
        g.current.len() + g.previous.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn get(&self, bytes: &[u8; 32]) -> Option<VerifyingKey> {
        let mut g = self.lock();
        if let Some(key) = g.current.get(bytes) {
            return Some(*key);
        }
        let key = g.previous.remove(bytes)?;
        self.insert_locked(&mut g, key);
        Some(key)
    }

    fn insert(&self, key: VerifyingKey) {
        let mut g = self.lock();
        self.insert_locked(&mut g, key);
    }

    fn insert_locked(&self, g: &mut Generations, key: VerifyingKey) {
        if g.current.len() >= self.generation_size {
            g.previous = std::mem::take(&mut g.current);
        }
        g.current.insert(key.to_bytes(), key);
    }

    /// The key `signer` names: from the cache, or decompressed (and not kept until a signature
    /// verified under it: [`KeyCache::remember`]). `None` when the bytes are no key.
    pub fn key_for(&self, signer: &[u8; 32]) -> Option<VerifyingKey> {
        self.get(signer)
            .or_else(|| VerifyingKey::from_bytes(signer).ok())
    }

    /// Keeps `key`, under which a signature verified.
    pub fn remember(&self, key: VerifyingKey) {
        let mut g = self.lock();
        if !g.current.contains_key(key.as_bytes()) {
            self.insert_locked(&mut g, key);
        }
    }

    /// Checks the blob's signature under the key it names, taken from the cache when it is
    /// there, and kept when the signature verifies under it. Returns the key when it verifies.
    pub fn verify(&self, blob: &SignedBlob) -> Option<VerifyingKey> {
        match self.get(&blob.signer) {
            Some(key) => verify_named(blob, Some(key)),
            None => {
                let key = verify_named(blob, None)?;
                self.insert(key);
                Some(key)
            }
        }
    }
}

/// What the service loop takes from the pipeline: a link event in arrival order, and for a
/// publish on a device topic what the worker made of it.
#[derive(Debug)]
pub struct Arrival {
    pub event: LinkEvent,
    pub checked: Option<Checked>,
}

/// The receiving end: [`Pipeline::recv`] gives the link's events in arrival order.
#[derive(Debug)]
pub struct Pipeline {
    collect: Collect<(Arrival, Option<OwnedSemaphorePermit>)>,
}

impl Pipeline {
    /// The next event; `None` once the link has stopped and everything was taken. Cancel-safe.
    pub async fn recv(&mut self) -> Option<Arrival> {
        // The permit is dropped here: the payload leaves the pipeline's byte budget.
        self.collect.recv().await.map(|(arrival, _permit)| arrival)
    }
}

/// Puts `threads` workers between `events` and the returned [`Pipeline`]. Must be called on a
/// tokio runtime (the dispatcher is a task; the workers are threads of their own). Fails only
/// when a thread cannot be started.
pub fn start(
    events: Events,
    topics: Topics,
    threads: usize,
    keys: Arc<KeyCache>,
) -> std::io::Result<Pipeline> {
    let work = move || {
        let topics = topics.clone();
        let keys = Arc::clone(&keys);
        let mut verifier = BatchVerifier::default();
        move |batch: Vec<(LinkEvent, Option<OwnedSemaphorePermit>)>| {
            check_batch(batch, &topics, &keys, &mut verifier)
        }
    };
    let (mut dispatch, collect) = ordered(threads, QUEUE_DEPTH, MAX_BATCH, work)?;
    let budget = Arc::new(Semaphore::new(PIPELINE_BYTES));
    tokio::spawn(async move {
        let mut events = events;
        while let Some(event) = events.recv().await {
            let size = match &event {
                LinkEvent::Publish { topic, payload } => {
                    (topic.len() + payload.len()).min(PIPELINE_BYTES)
                }
                _ => 0,
            };
            // The semaphore is never closed; u32 holds PIPELINE_BYTES.
            let permit = Arc::clone(&budget)
                .acquire_many_owned(size as u32)
                .await
                .ok();
            if dispatch.send((event, permit)).await.is_err() {
                break; // the service is gone
            }
        }
        // Dropping `dispatch` ends the workers after what they hold; the service then sees the
        // end after the last event.
    });
    Ok(Pipeline { collect })
}

/// What a worker makes of the events it took at once: each device message decoded, and their
/// signatures checked together ([`BatchVerifier`]); the events come out in the order they came.
fn check_batch<P>(
    batch: Vec<(LinkEvent, P)>,
    topics: &Topics,
    keys: &KeyCache,
    verifier: &mut BatchVerifier,
) -> Vec<(Arrival, P)> {
    let mut checked: Vec<Option<Checked>> = batch
        .iter()
        .map(|(event, _)| match event {
            LinkEvent::Publish { topic, payload } if wants_check(topics, topic, payload) => {
                Some(decode(payload))
            }
            _ => None,
        })
        .collect();
    let mut signed = Vec::new();
    for (n, checked) in checked.iter().enumerate() {
        if let Some(Checked::Signed { blob, .. }) = checked {
            if let Some(key) = keys.key_for(&blob.signer) {
                signed.push((n, key));
            }
        }
    }
    let ok = {
        let items: Vec<(&SignedBlob, VerifyingKey)> = signed
            .iter()
            .filter_map(|(n, key)| match &checked[*n] {
                Some(Checked::Signed { blob, .. }) => Some((blob, *key)),
                _ => None,
            })
            .collect();
        verifier.verify(&items)
    };
    for ((n, key), ok) in signed.into_iter().zip(ok) {
        if let (true, Some(Checked::Signed { verified, .. })) = (ok, &mut checked[n]) {
            keys.remember(key);
            *verified = Some(key);
        }
    }
    batch
        .into_iter()
        .zip(checked)
        .map(|((event, permit), checked)| (Arrival { event, checked }, permit))
        .collect()
}

/// The sending end of [`ordered`].
#[derive(Debug)]
pub struct Dispatch<I> {
    inputs: Vec<mpsc::Sender<I>>,
    next: usize,
}

/// The receiving end of [`ordered`].
#[derive(Debug)]
pub struct Collect<O> {
    outputs: Vec<mpsc::Receiver<O>>,
    next: usize,
}

/// The pipeline's end is gone.
#[derive(Debug)]
pub struct Closed;

impl<I> Dispatch<I> {
    /// Hands `item` to the next worker, waiting while its queue is full.
    pub async fn send(&mut self, item: I) -> Result<(), Closed> {
        let input = &self.inputs[self.next];
        input.send(item).await.map_err(|_| Closed)?;
        self.next = (self.next + 1) % self.inputs.len();
        Ok(())
    }
}

impl<O> Collect<O> {
    /// The result for the next item in the order they were sent; `None` once the dispatch end
    /// is dropped and every result was taken. Cancel-safe: the turn moves on only when a result
    /// was taken.
    pub async fn recv(&mut self) -> Option<O> {
        let out = self.outputs[self.next].recv().await?;
        self.next = (self.next + 1) % self.outputs.len();
        Some(out)
    }
}

/// `threads` worker threads, each applying a `work` of its own (made by `make_work`) to the
/// items it takes at once (whatever waits in its queue, up to `batch`), each with an input and
/// an output queue of `depth` items: items sent round robin and results taken round robin come
/// out in the order the items went in. `work` returns one result per item, in order. The
/// workers end when the dispatch end is dropped (after their queues) or the collect end is.
/// Fails only when a thread cannot be started.
pub fn ordered<I, O, M, W>(
    threads: usize,
    depth: usize,
    batch: usize,
    make_work: M,
) -> std::io::Result<(Dispatch<I>, Collect<O>)>
where
    I: Send + 'static,
    O: Send + 'static,
    M: Fn() -> W,
    W: FnMut(Vec<I>) -> Vec<O> + Send + 'static,
{
    let threads = threads.max(1);
    let batch = batch.max(1);
    let mut inputs = Vec::with_capacity(threads);
    let mut outputs = Vec::with_capacity(threads);
    for n in 0..threads {
        let (in_tx, mut in_rx) = mpsc::channel::<I>(depth.max(1));
        let (out_tx, out_rx) = mpsc::channel::<O>(depth.max(1));
        let mut work = make_work();
        // Threads that did start end when `inputs` is dropped on an error.
        std::thread::Builder::new()
            .name(format!("flotilla-verify-{n}"))
            .spawn(move || {
                while let Some(first) = in_rx.blocking_recv() {
                    let mut items = Vec::with_capacity(batch);
                    items.push(first);
                    while items.len() < batch {
                        match in_rx.try_recv() {
                            Ok(item) => items.push(item),
                            Err(_) => break,
                        }
                    }
                    for out in work(items) {
                        if out_tx.blocking_send(out).is_err() {
                            return;
                        }
                    }
                }
            })?;
        inputs.push(in_tx);
        outputs.push(out_rx);
    }
    Ok((Dispatch { inputs, next: 0 }, Collect { outputs, next: 0 }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_protocol::{device, BlockRequest, Report, SigningKey};

    #[tokio::test]
    async fn many_items_over_several_workers_come_out_in_the_order_they_went_in() {
        // Uneven work, so workers finish out of step.
        let (mut dispatch, mut collect) = ordered(4, 8, 5, || {
            |items: Vec<u64>| {
                items
                    .into_iter()
                    .map(|n| {
                        if n.is_multiple_of(7) {
                            std::thread::sleep(std::time::Duration::from_micros(200));
                        }
                        n * 3
                    })
                    .collect()
            }
        })
        .expect("threads");
        let sender = tokio::spawn(async move {
            for n in 0..20_000u64 {
                dispatch.send(n).await.expect("workers alive");
            }
        });
        let mut got = Vec::with_capacity(20_000);
        while let Some(n) = collect.recv().await {
            got.push(n);
        }
        sender.await.expect("sent everything");
        let want: Vec<u64> = (0..20_000).map(|n| n * 3).collect();
        assert_eq!(got, want, "results in the order the items were sent");
    }

    #[tokio::test]
    async fn the_link_events_reach_the_service_in_order_with_signatures_checked() {
        let topics = Topics::new("flotilla");
        let (inbox, events) = crate::service::mqtt::inbox_pair(1 << 20);
        let keys = Arc::new(KeyCache::new(64));
        let mut pipeline = start(events, topics.clone(), 3, Arc::clone(&keys)).expect("threads");
        let good = SigningKey::from_bytes(&[7; 32]);
        let id = flotilla_protocol::DeviceId::new("dev-1").expect("id");
        let report = |seq| {
            DeviceMessage::Report(Report {
                device_id: "dev-1".into(),
                seq,
                action_id: "a".into(),
                rollout_id: "r".into(),
                phase: flotilla_protocol::Phase::Verified,
                at: 1,
            })
        };
        let mut sent = Vec::new();
        for seq in 0..300u64 {
            let event = match seq % 5 {
                // A control request between device messages: not checked, never reordered.
                0 => LinkEvent::Publish {
                    topic: format!("flotilla/v1/control/request/{seq}"),
                    payload: vec![1, 2, 3],
                },
                1 => {
                    let mut blob = device::sign(&good, &report(seq));
                    blob.signature[0] ^= 1; // forged
                    LinkEvent::Publish {
                        topic: topics.report(&id),
                        payload: envelope::encode(&Message::Device(blob)),
                    }
                }
                2 => LinkEvent::Publish {
                    topic: topics.report(&id),
                    payload: b"garbage".to_vec(),
                },
                3 => LinkEvent::Disconnected {
                    reason: format!("{seq}"),
                },
                _ => LinkEvent::Publish {
                    topic: topics.report(&id),
                    payload: envelope::encode(&Message::Device(device::sign(&good, &report(seq)))),
                },
            };
            sent.push(event.clone());
            inbox.push(event).expect("pipeline alive");
        }
        for (n, want) in sent.into_iter().enumerate() {
            let got = pipeline.recv().await.expect("every event comes out");
            assert_eq!(got.event, want, "event {n} in arrival order");
            match (n % 5, got.checked) {
                (0 | 3, None) => {}
                (1, Some(Checked::Signed { verified: None, .. })) => {}
                (2, Some(Checked::Undecodable(_))) => {}
                (
                    4,
                    Some(Checked::Signed {
                        blob,
                        verified: Some(key),
                    }),
                ) => {
                    assert_eq!(key, good.verifying_key());
                    let (_, message) = decode_verified(&blob, Some(key)).expect("decodes");
                    assert_eq!(message, report(n as u64));
                }
                (kind, checked) => panic!("event {n} (kind {kind}) checked as {checked:?}"),
            }
        }
        assert_eq!(keys.len(), 1, "only the key that verified is kept");
        drop(inbox);
    }

    #[test]
    fn the_key_cache_stays_bounded_under_many_keys_and_keeps_a_key_in_use() {
        let cache = KeyCache::new(100);
        let fetch = |seed: u32| {
            let mut bytes = [0u8; 32];
            bytes[..4].copy_from_slice(&seed.to_le_bytes());
            bytes[31] = 1;
            let key = SigningKey::from_bytes(&bytes);
            device::sign(
                &key,
                &DeviceMessage::Fetch {
                    device_id: "d".into(),
                    request: BlockRequest {
                        sha256: [0; 32],
                        offset: 0,
                        length: 1,
                    },
                },
            )
        };
        let enrolled = fetch(0);
        for seed in 1..2_000u32 {
            assert!(cache.verify(&fetch(seed)).is_some(), "a fresh key verifies");
            assert!(cache.len() <= 100, "at most the capacity: {}", cache.len());
            if seed % 10 == 0 {
                assert!(cache.verify(&enrolled).is_some());
            }
        }
        assert!(
            cache.get(&enrolled.signer).is_some(),
            "a key in use survives a flood of fresh ones"
        );
        let mut forged = fetch(5_000);
        forged.signature[3] ^= 1;
        assert!(cache.verify(&forged).is_none(), "a forged signature fails");
        assert!(
            cache.get(&forged.signer).is_none(),
            "a key nothing verified under is not kept"
        );
        let mut moved = fetch(5_001);
        moved.signer = enrolled.signer; // a cached key, someone else's signature
        assert!(cache.verify(&moved).is_none(), "a cached key still checks");
    }
}
