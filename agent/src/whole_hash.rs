//! The whole file's sha256 of a block download (`crate::fetch_blocks`), computed in file order
//! on a thread of its own while verified blocks arrive in any order.
//!
//! ```text
//! fetch_blocks ── block at offset ──> WholeHash ── in order ──> "whole-hash" thread (sha256)
//!                                      │   ahead of the prefix: held in memory, up to
//!                                      │   REORDER_BYTES; past that, read back from the part
//!                                      └── file once the prefix reaches them
//! ```
//!
//! - Every block of the artifact already matched its signed hash when it comes here; the whole
//!   file's digest still has to match the manifest's (a release whose block list describes
//!   other bytes is refused, `fetch_blocks`).
//! - The digest is a second sha256 of every byte. On the fetcher's task it was half the
//!   agent's CPU of an HTTP origin download, on the task every block passes through. Here it
//!   runs beside it, fed by a bounded channel ([`QUEUE_BLOCKS`]): when the thread falls behind,
//!   the fetcher waits, so memory stays bounded on a device whose cores verify blocks faster
//!   than one core can hash the file.
//! - Blocks that arrive ahead of a gap (several origin connections, several peers) are kept in
//!   memory up to [`REORDER_BYTES`] instead of being read back from the part file; blocks the
//!   part file held already (a resumed download, local copies) and those past the bound are
//!   read back, as before.
//! - Without a thread (the system refused one) the hash is computed inline, as before.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use flotilla_protocol::blocks::block_range;
use flotilla_protocol::Digest;
use sha2::Digest as _;

/// Most bytes of verified blocks held in memory ahead of the hashed prefix.
pub const REORDER_BYTES: usize = 512 * 1024;

/// Blocks queued for the hashing thread before the fetcher waits for it.
pub const QUEUE_BLOCKS: usize = 4;

/// The blocks waiting for the thread, and whether the fetcher is done with it. A mutex and a
/// condition variable rather than `std::sync::mpsc`: the agent links them already, where the
/// channel's code alone took the aarch64 agent past its 3 MiB bound.
#[derive(Default)]
struct Queue {
    blocks: Mutex<(VecDeque<Vec<u8>>, bool)>,
    /// Signalled when a block is queued or the queue is closed, and when one is taken.
    changed: Condvar,
}

impl Queue {
    /// Queues `block`, waiting while [`QUEUE_BLOCKS`] are queued.
    fn push(&self, block: Vec<u8>) -> std::io::Result<()> {
        let mut state = self.blocks.lock().map_err(|_| stopped())?;
        while state.0.len() >= QUEUE_BLOCKS {
            state = self.changed.wait(state).map_err(|_| stopped())?;
        }
        state.0.push_back(block);
        self.changed.notify_all();
        Ok(())
    }

    /// No more blocks: the thread finishes once it has hashed what is queued.
    fn close(&self) {
        if let Ok(mut state) = self.blocks.lock() {
            state.1 = true;
        }
        self.changed.notify_all();
    }

    /// The next block; `None` once the queue is closed and empty.
    fn pop(&self) -> Option<Vec<u8>> {
        let mut state = self.blocks.lock().ok()?;
        loop {
            if let Some(block) = state.0.pop_front() {
                self.changed.notify_all();
                return Some(block);
            }
            if state.1 {
                return None;
            }
            state = self.changed.wait(state).ok()?;
        }
    }
}

/// Where the bytes go.
enum Hasher {
    Thread {
        queue: Feeder,
        thread: JoinHandle<sha2::Sha256>,
    },
    Inline(sha2::Sha256),
}

impl Hasher {
    fn start() -> Hasher {
        let queue = Arc::new(Queue::default());
        let blocks = queue.clone();
        let spawned = std::thread::Builder::new()
            .name("whole-hash".to_owned())
            .stack_size(256 * 1024)
            .spawn(move || {
                let mut hash = sha2::Sha256::new();
                while let Some(block) = blocks.pop() {
                    hash.update(&block);
                }
                hash
            });
        match spawned {
            Ok(thread) => Hasher::Thread {
                queue: Feeder(queue),
                thread,
            },
            Err(e) => {
                tracing::debug!("no thread for the whole-file hash ({e}): hashing inline");
                Hasher::Inline(sha2::Sha256::new())
            }
        }
    }

    fn feed(&mut self, data: Vec<u8>) -> std::io::Result<()> {
        match self {
            Hasher::Thread { queue, .. } => queue.0.push(data),
            Hasher::Inline(hash) => {
                hash.update(&data);
                Ok(())
            }
        }
    }

    fn finish(self) -> std::io::Result<Digest> {
        let hash = match self {
            Hasher::Thread { queue, thread } => {
                drop(queue); // closes the queue
                thread.join().map_err(|_| stopped())?
            }
            Hasher::Inline(hash) => hash,
        };
        Ok(hash.finalize().into())
    }
}

/// The fetcher's end of the queue: dropping it (the download finished, canceled or failed)
/// closes the queue, so the thread stops.
struct Feeder(Arc<Queue>);

impl Drop for Feeder {
    fn drop(&mut self) {
        self.0.close();
    }
}

fn stopped() -> std::io::Error {
    std::io::Error::other("the whole-file hashing thread stopped")
}

/// The whole-file hash of an artifact of `size` bytes in blocks of `block_size`.
pub struct WholeHash {
    size: u64,
    block_size: u32,
    /// Bytes handed to the hasher: the file's prefix `0..fed`.
    fed: u64,
    /// Verified blocks past the prefix, by offset, and their bytes in all.
    ahead: BTreeMap<u64, Vec<u8>>,
    ahead_bytes: usize,
    limit: usize,
    hasher: Hasher,
}

impl WholeHash {
    pub fn new(size: u64, block_size: u32) -> WholeHash {
        WholeHash::with_limit(size, block_size, REORDER_BYTES)
    }

    /// With at most `limit` bytes held ahead of the prefix.
    pub fn with_limit(size: u64, block_size: u32, limit: usize) -> WholeHash {
        WholeHash {
            size,
            block_size,
            fed: 0,
            ahead: BTreeMap::new(),
            ahead_bytes: 0,
            limit,
            hasher: Hasher::start(),
        }
    }

    /// `data`, verified and just written at `offset` of `file`; `present[i]` says whether
    /// block `i` is in the file. Hands the hasher the prefix this extends, held blocks and the
    /// file's present blocks included.
    pub fn written(
        &mut self,
        offset: u64,
        data: Vec<u8>,
        file: &File,
        present: &[bool],
    ) -> std::io::Result<()> {
        if offset != self.fed {
            if offset > self.fed && self.ahead_bytes + data.len() <= self.limit {
                self.ahead_bytes += data.len();
                self.ahead.insert(offset, data);
            }
            // Past the bound, the block is read back from the file when the prefix reaches it.
            return Ok(());
        }
        self.fed += data.len() as u64;
        self.hasher.feed(data)?;
        self.feed_present(file, present, false)
    }

    /// Feeds the hasher from the prefix on: held blocks, then blocks present in `file`; (`to_end`,
    /// once every block verified) everything up to the end.
    fn feed_present(&mut self, file: &File, present: &[bool], to_end: bool) -> std::io::Result<()> {
        while self.fed < self.size {
            let (offset, length) = block_range(
                self.fed / u64::from(self.block_size),
                self.size,
                self.block_size,
            );
            let data = if let Some(data) = self.ahead.remove(&offset) {
                self.ahead_bytes -= data.len();
                data
            } else {
                let block = (offset / u64::from(self.block_size)) as usize;
                if !to_end && !present.get(block).copied().unwrap_or(false) {
                    break;
                }
                let mut buf = vec![0; length as usize];
                file.read_exact_at(&mut buf, offset)?;
                buf
            };
            self.fed = offset + data.len() as u64;
            self.hasher.feed(data)?;
        }
        Ok(())
    }

    /// Every block verified and written to `file`: the digest of the whole file, hashing what
    /// was not hashed yet.
    pub fn finish(mut self, file: &File) -> std::io::Result<Digest> {
        self.feed_present(file, &[], true)?;
        self.hasher.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: u32 = 1024;

    fn image(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    /// Writes the blocks of `data` in `order` to a part file, through a `WholeHash` holding at
    /// most `limit` bytes ahead; the digest it gives.
    fn hash_in_order(data: &[u8], order: &[u64], limit: usize, present_at_start: &[u64]) -> Digest {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("part");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .expect("part file");
        file.set_len(data.len() as u64).expect("size");
        let blocks = data.len().div_ceil(BS as usize);
        let mut present = vec![false; blocks];
        let range = |b: u64| {
            let (o, l) = block_range(b, data.len() as u64, BS);
            (o, o as usize..o as usize + l as usize)
        };
        for &b in present_at_start {
            let (o, r) = range(b);
            file.write_all_at(&data[r], o).expect("write");
            present[b as usize] = true;
        }
        let mut whole = WholeHash::with_limit(data.len() as u64, BS, limit);
        for &b in order {
            let (o, r) = range(b);
            file.write_all_at(&data[r.clone()], o).expect("write");
            present[b as usize] = true;
            whole
                .written(o, data[r].to_vec(), &file, &present)
                .expect("hash");
        }
        whole.finish(&file).expect("digest")
    }

    #[test]
    fn blocks_in_any_order_give_the_files_digest_held_or_read_back() {
        let data = image(10 * BS as usize + 100);
        let want = flotilla_protocol::sha256(&data);
        let in_order: Vec<u64> = (0..11).collect();
        let reversed: Vec<u64> = (0..11).rev().collect();
        let shuffled = [3, 0, 7, 1, 2, 10, 9, 4, 6, 5, 8];
        for order in [&in_order[..], &reversed, &shuffled] {
            for limit in [REORDER_BYTES, 2 * BS as usize, 0] {
                assert_eq!(
                    hash_in_order(&data, order, limit, &[]),
                    want,
                    "order {order:?}, holding at most {limit} bytes"
                );
            }
        }
    }

    #[test]
    fn blocks_the_part_file_held_already_are_read_back() {
        let data = image(6 * BS as usize);
        let want = flotilla_protocol::sha256(&data);
        // A resumed download: blocks 0, 2 and 5 were in the part file; the rest arrive.
        assert_eq!(
            hash_in_order(&data, &[4, 1, 3], REORDER_BYTES, &[0, 2, 5]),
            want
        );
        assert_eq!(hash_in_order(&data, &[1, 3, 4], 0, &[0, 2, 5]), want);
    }

    #[test]
    fn the_queue_hands_blocks_over_in_order_bounded_and_ends_once_closed() {
        let queue = Arc::new(Queue::default());
        let feeder = Feeder(queue.clone());
        let pusher = std::thread::spawn(move || {
            for i in 0..(QUEUE_BLOCKS as u8 + 5) {
                feeder.0.push(vec![i]).expect("push");
                let queued = feeder.0.blocks.lock().expect("lock").0.len();
                assert!(queued <= QUEUE_BLOCKS, "{queued} queued");
            }
            // Dropping the feeder closes the queue.
        });
        let mut got = Vec::new();
        while let Some(block) = queue.pop() {
            got.extend(block);
        }
        pusher.join().expect("pusher");
        let want: Vec<u8> = (0..(QUEUE_BLOCKS as u8 + 5)).collect();
        assert_eq!(got, want, "every block, in order, and the end once closed");
    }

    #[test]
    fn what_is_held_ahead_stays_within_its_bound() {
        let data = image(8 * BS as usize);
        let dir = tempfile::tempdir().expect("tempdir");
        let file = File::create(dir.path().join("part")).expect("file");
        let mut whole = WholeHash::with_limit(data.len() as u64, BS, 3 * BS as usize);
        let present = vec![true; 8];
        for b in 1..8u64 {
            let o = b * u64::from(BS);
            whole
                .written(
                    o,
                    data[o as usize..o as usize + BS as usize].to_vec(),
                    &file,
                    &present,
                )
                .expect("held");
            assert!(
                whole.ahead_bytes <= 3 * BS as usize,
                "{} held",
                whole.ahead_bytes
            );
        }
        assert_eq!(
            whole.ahead.len(),
            3,
            "blocks 1-3 held, the rest left in the file"
        );
        assert_eq!(whole.fed, 0, "nothing hashed before block 0");
    }
}
