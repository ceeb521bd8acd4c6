//! What the device holds verified, to serve to the peers of its site, and how much of it is kept.
//!
//! The fetcher leaves two files per verified download in `<data_dir>/downloads/`: the artifact,
//! named by its sha256 (`<hex>`, renamed there only after its whole-file digest matched), and its
//! block list (`<hex>.blocks`, written only after it matched the digest the signed manifest
//! names). [`Held`] finds such pairs and serves from them; nothing else in the directory (partial
//! downloads, an artifact without its list) is ever served.
//!
//! A pair is taken up when it is first asked for: the list must have one 32-byte hash per block
//! of the artifact and the artifact's first and last blocks must match their hashes (which also
//! tells the block size, which the files do not record: the manifest default, 64 KiB, is tried
//! first). After that, every block is read again and checked against its hash before it is
//! handed out, so a copy damaged or truncated on disk is caught at the first bad block: that
//! block is not served and the artifact is forgotten (a changed file is looked at again from
//! the start). A list is handed out only after its bytes hash again to the digest asked for.
//!
//! [`prune`] bounds what is kept: when an action ends, the newest pairs stay while their total
//! fits `peers.keep_bytes`; the first pair that does not fit and every older one are removed.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use flotilla_protocol::blocks::{
    block_count, block_range, BlockIndexRef, BlockList, DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
};
use flotilla_protocol::{hex, sha256, BlockRequest, Digest};

/// The suffix of a block list next to its artifact.
pub const LIST_SUFFIX: &str = ".blocks";

/// The longest block list taken up: the list of a 64 GiB artifact at 64 KiB blocks.
const MAX_LIST_BYTES: u64 = 32 << 20;

/// A digest nobody holds triggers a new look at the directory at most this often.
const RESCAN_EVERY: Duration = Duration::from_secs(1);

/// A verified artifact and its block list.
#[derive(Debug)]
pub struct HeldArtifact {
    pub sha256: Digest,
    pub size: u64,
    pub list: BlockList,
    /// The digest of the list's bytes, by which peers ask for the list itself.
    pub list_sha256: Digest,
}

/// Why a request is not served. `dropped` says the held copy failed a check and is no longer
/// served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotServed {
    pub reason: String,
    pub dropped: bool,
}

impl NotServed {
    fn refuse(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            dropped: false,
        }
    }

    fn drop(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            dropped: true,
        }
    }
}

/// Size and modification time of the two files of a pair, so a changed pair is looked at again.
type Stamp = (u64, u64, Option<SystemTime>, Option<SystemTime>);

#[derive(Debug, Default)]
struct Catalog {
    artifacts: HashMap<Digest, Arc<HeldArtifact>>,
    /// list digest -> artifact digest.
    lists: HashMap<Digest, Digest>,
    /// Pairs already looked at (taken up or not), by artifact digest.
    seen: HashMap<Digest, Stamp>,
    scanned_at: Option<Instant>,
}

/// The verified downloads a device serves from.
#[derive(Debug)]
pub struct Held {
    dir: PathBuf,
    catalog: Mutex<Catalog>,
    /// Held while the directory is looked at, so a request that arrives during a look waits
    /// for it instead of being told the digest is not held.
    scanning: Mutex<()>,
}

impl Held {
    /// Serves from `dir` (`<data_dir>/downloads`).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            catalog: Mutex::default(),
            scanning: Mutex::new(()),
        }
    }

    fn artifact_path(&self, sha256: &Digest) -> PathBuf {
        self.dir.join(hex::encode(sha256))
    }

    fn list_path(&self, sha256: &Digest) -> PathBuf {
        self.dir
            .join(format!("{}{LIST_SUFFIX}", hex::encode(sha256)))
    }

    /// Answers `request` with the bytes to send: a verified block of a held artifact, or part of
    /// a held block list. Blocking file I/O: call it off the async executor.
    pub fn serve(&self, request: &BlockRequest) -> Result<Vec<u8>, NotServed> {
        let (artifact, is_list) = self
            .find(&request.sha256)
            .ok_or_else(|| NotServed::refuse("this device does not hold that digest verified"))?;
        if is_list {
            self.serve_list(&artifact, request)
        } else {
            self.serve_block(&artifact, request)
        }
    }

    /// The held artifact with `digest`, or whose block list has it (`true`).
    fn find(&self, digest: &Digest) -> Option<(Arc<HeldArtifact>, bool)> {
        let lookup = |c: &Catalog| {
            if let Some(a) = c.artifacts.get(digest) {
                return Some((a.clone(), false));
            }
            let a = c.lists.get(digest)?;
            c.artifacts.get(a).map(|a| (a.clone(), true))
        };
        {
            let catalog = self.catalog.lock().ok()?;
            if let Some(found) = lookup(&catalog) {
                return Some(found);
            }
        }
        // One look at a time; a request that waited for another's look finds what it found.
        let _scanning = self.scanning.lock().ok()?;
        {
            let catalog = self.catalog.lock().ok()?;
            if let Some(found) = lookup(&catalog) {
                return Some(found);
            }
            if catalog
                .scanned_at
                .is_some_and(|at| at.elapsed() < RESCAN_EVERY)
            {
                return None;
            }
        }
        self.scan();
        let catalog = self.catalog.lock().ok()?;
        lookup(&catalog)
    }

    /// Looks for pairs in the directory that were not looked at yet (or changed since).
    pub fn scan(&self) {
        if let Ok(mut c) = self.catalog.lock() {
            c.scanned_at = Some(Instant::now());
        }
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut present = std::collections::HashSet::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(LIST_SUFFIX)) else {
                continue;
            };
            let Some(sha256) = parse_digest(stem) else {
                continue;
            };
            let Some(stamp) = self.stamp(&sha256) else {
                continue;
            };
            present.insert(sha256);
            let known = self
                .catalog
                .lock()
                .map(|c| c.seen.get(&sha256) == Some(&stamp))
                .unwrap_or(true);
            if known {
                continue;
            }
            let taken = match self.take_up(sha256, stamp.0) {
                Ok(a) => Some(Arc::new(a)),
                Err(reason) => {
                    tracing::warn!(
                        artifact = hex::encode(&sha256),
                        "not serving this download to peers: {reason}"
                    );
                    None
                }
            };
            if let Ok(mut c) = self.catalog.lock() {
                c.seen.insert(sha256, stamp);
                if let Some(a) = taken {
                    c.lists.insert(a.list_sha256, sha256);
                    c.artifacts.insert(sha256, a);
                }
            }
        }
        // Pairs removed since (pruned) are forgotten, so the catalog stays as small as the
        // directory.
        if let Ok(mut c) = self.catalog.lock() {
            c.seen.retain(|sha256, _| present.contains(sha256));
            c.artifacts.retain(|sha256, _| present.contains(sha256));
            let artifacts = &c.artifacts;
            let kept: HashMap<Digest, Digest> = c
                .lists
                .iter()
                .filter(|(_, a)| artifacts.contains_key(*a))
                .map(|(l, a)| (*l, *a))
                .collect();
            c.lists = kept;
        }
    }

    fn stamp(&self, sha256: &Digest) -> Option<Stamp> {
        let artifact = std::fs::metadata(self.artifact_path(sha256)).ok()?;
        let list = std::fs::metadata(self.list_path(sha256)).ok()?;
        (artifact.is_file() && list.is_file()).then(|| {
            (
                artifact.len(),
                list.len(),
                artifact.modified().ok(),
                list.modified().ok(),
            )
        })
    }

    /// Checks one pair: the list fits the artifact, and its first and last blocks match.
    fn take_up(&self, sha256: Digest, size: u64) -> Result<HeldArtifact, String> {
        let list_path = self.list_path(&sha256);
        let bytes = read_bounded(&list_path, MAX_LIST_BYTES)?;
        if bytes.is_empty() || bytes.len() % 32 != 0 {
            return Err(format!(
                "block list {} is {} bytes, not a whole number of 32-byte hashes",
                list_path.display(),
                bytes.len()
            ));
        }
        let list_sha256 = sha256_of(&bytes);
        let blocks = bytes.len() as u64 / 32;
        let mut file = File::open(self.artifact_path(&sha256)).map_err(|e| e.to_string())?;
        for block_size in block_sizes(size, blocks) {
            let index = BlockIndexRef {
                block_size,
                sha256: list_sha256,
            };
            let Ok(list) = BlockList::from_bytes(&bytes, &index, size) else {
                continue;
            };
            let fits = [0, blocks - 1].iter().all(|&i| {
                read_block(&mut file, &list, size, i).is_ok_and(|data| list.verify(i, &data))
            });
            if fits {
                return Ok(HeldArtifact {
                    sha256,
                    size,
                    list,
                    list_sha256,
                });
            }
        }
        Err(format!(
            "its block list ({blocks} hashes) does not match its {size} bytes at any block size"
        ))
    }

    /// Stops serving `sha256` until its files change.
    pub fn forget(&self, sha256: &Digest) {
        if let Ok(mut c) = self.catalog.lock() {
            if let Some(a) = c.artifacts.remove(sha256) {
                c.lists.remove(&a.list_sha256);
            }
        }
    }

    fn serve_block(
        &self,
        artifact: &HeldArtifact,
        request: &BlockRequest,
    ) -> Result<Vec<u8>, NotServed> {
        let list = &artifact.list;
        let index = list.index_at(request.offset).ok_or_else(|| {
            NotServed::refuse(format!(
                "offset {} is not the start of a block (blocks of {} bytes, {} in all)",
                request.offset,
                list.block_size(),
                list.len()
            ))
        })?;
        let (_, length) = block_range(index, artifact.size, list.block_size());
        if request.length < length {
            return Err(NotServed::refuse(format!(
                "asks for {} bytes of the {length}-byte block at offset {}; blocks are served whole",
                request.length, request.offset
            )));
        }
        let dropped = |reason: String| {
            self.forget(&artifact.sha256);
            tracing::error!(
                artifact = hex::encode(&artifact.sha256),
                "{reason}; no longer served to peers"
            );
            NotServed::drop(reason)
        };
        let path = self.artifact_path(&artifact.sha256);
        let mut file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.forget(&artifact.sha256);
                return Err(NotServed::refuse(
                    "this device does not hold that digest verified (removed)",
                ));
            }
            Err(e) => return Err(dropped(format!("cannot open {}: {e}", path.display()))),
        };
        let on_disk = file.metadata().map(|m| m.len()).unwrap_or(0);
        if on_disk != artifact.size {
            return Err(dropped(format!(
                "held copy is {on_disk} bytes, its block list is for {}",
                artifact.size
            )));
        }
        match read_block(&mut file, list, artifact.size, index) {
            Ok(data) if list.verify(index, &data) => Ok(data),
            Ok(_) => Err(dropped(format!(
                "block {index} (offset {}) of the held copy does not match its hash",
                request.offset
            ))),
            Err(e) => Err(dropped(format!(
                "cannot read block {index} of the held copy: {e}"
            ))),
        }
    }

    fn serve_list(
        &self,
        artifact: &HeldArtifact,
        request: &BlockRequest,
    ) -> Result<Vec<u8>, NotServed> {
        let path = self.list_path(&artifact.sha256);
        let bytes = read_bounded(&path, MAX_LIST_BYTES).map_err(NotServed::refuse)?;
        if sha256_of(&bytes) != artifact.list_sha256 {
            self.forget(&artifact.sha256);
            tracing::error!(
                list = %path.display(),
                "held block list no longer hashes to its digest; no longer served to peers"
            );
            return Err(NotServed::drop(
                "the held block list no longer hashes to its digest",
            ));
        }
        let len = bytes.len() as u64;
        if request.offset >= len || request.length == 0 {
            return Err(NotServed::refuse(format!(
                "range {}+{} is outside the {len}-byte block list",
                request.offset, request.length
            )));
        }
        let end = len.min(request.offset + u64::from(request.length.min(MAX_BLOCK_SIZE)));
        // Both bounds are at most `len`, the length of a Vec.
        Ok(bytes[request.offset as usize..end as usize].to_vec())
    }
}

/// The block sizes an artifact of `size` bytes with `blocks` hashes may have been cut at, most
/// likely first: the default, then powers of two, then (when few) every other one.
fn block_sizes(size: u64, blocks: u64) -> Vec<u32> {
    let fits = |bs: u32| block_count(size, bs) == blocks;
    let mut sizes: Vec<u32> = std::iter::once(DEFAULT_BLOCK_SIZE)
        .chain((10..=16).rev().map(|p| 1u32 << p))
        .filter(|&bs| (MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&bs) && fits(bs))
        .collect();
    let low = size.div_ceil(blocks.max(1)).max(u64::from(MIN_BLOCK_SIZE));
    let high = match blocks {
        0 | 1 => u64::from(MAX_BLOCK_SIZE),
        b => ((size - 1) / (b - 1)).min(u64::from(MAX_BLOCK_SIZE)),
    };
    if low <= high && high - low < 64 {
        for bs in low..=high {
            let bs = bs as u32;
            if fits(bs) && !sizes.contains(&bs) {
                sizes.push(bs);
            }
        }
    }
    sizes.dedup();
    sizes
}

fn read_block(
    file: &mut File,
    list: &BlockList,
    size: u64,
    index: u64,
) -> std::io::Result<Vec<u8>> {
    let (offset, length) = block_range(index, size, list.block_size());
    let mut data = vec![0; length as usize];
    file.seek(SeekFrom::Start(offset))?;
    file.read_exact(&mut data)?;
    Ok(data)
}

fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    let file = File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if bytes.len() as u64 > limit {
        return Err(format!("{} is more than {limit} bytes", path.display()));
    }
    Ok(bytes)
}

fn sha256_of(bytes: &[u8]) -> Digest {
    sha256(bytes)
}

fn parse_digest(text: &str) -> Option<Digest> {
    // Lower-case only: the fetcher's names, and one file per digest.
    if text.len() != 64 || text.bytes().any(|b| b.is_ascii_uppercase()) {
        return None;
    }
    hex::decode_array(text).ok()
}

/// What [`prune`] removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    pub artifacts: Vec<Digest>,
    pub bytes: u64,
}

/// Keeps the newest verified downloads (artifact and block list together, by the newer of
/// their modification times) while their total fits `keep_bytes`; removes the first that does
/// not fit and every older one. Partial downloads and other files are left alone. Call it only
/// while no action is running (one may be staging from these files).
pub fn prune(dir: &Path, keep_bytes: u64) -> Pruned {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Pruned::default();
    };
    // artifact digest -> (newest mtime, bytes)
    let mut pairs: HashMap<Digest, (Option<SystemTime>, u64)> = HashMap::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let stem = name.strip_suffix(LIST_SUFFIX).unwrap_or(name);
        let Some(sha256) = parse_digest(stem) else {
            continue;
        };
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        let pair = pairs.entry(sha256).or_default();
        pair.0 = pair.0.max(meta.modified().ok());
        pair.1 += meta.len();
    }
    let mut newest_first: Vec<_> = pairs.into_iter().collect();
    newest_first.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.0.cmp(&b.0)));
    let mut kept = 0u64;
    let mut over = false;
    let mut pruned = Pruned::default();
    for (sha256, (_, bytes)) in newest_first {
        over = over || kept.saturating_add(bytes) > keep_bytes;
        if !over {
            kept += bytes;
            continue;
        }
        let hex = hex::encode(&sha256);
        for path in [dir.join(&hex), dir.join(format!("{hex}{LIST_SUFFIX}"))] {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!("cannot remove {}: {e}", path.display()),
            }
        }
        pruned.artifacts.push(sha256);
        pruned.bytes += bytes;
    }
    pruned
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Writes `artifact` and its block list (at `block_size`) as the fetcher does; returns the
    /// artifact's digest and the list's.
    pub(crate) fn hold(dir: &Path, artifact: &[u8], block_size: u32) -> (Digest, Digest) {
        std::fs::create_dir_all(dir).expect("dir");
        let list = BlockList::compute(artifact, block_size).expect("list");
        let sha = sha256(artifact);
        std::fs::write(dir.join(hex::encode(&sha)), artifact).expect("artifact");
        std::fs::write(
            dir.join(format!("{}{LIST_SUFFIX}", hex::encode(&sha))),
            list.as_bytes(),
        )
        .expect("list");
        (sha, sha256(list.as_bytes()))
    }

    pub(crate) fn artifact(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 253) as u8).collect()
    }

    fn ask(sha256: Digest, offset: u64, length: u32) -> BlockRequest {
        BlockRequest {
            sha256,
            offset,
            length,
        }
    }

    /// Requests arriving together for a download nobody asked for yet: one looks at the
    /// directory, the others wait for that look instead of being told "not held".
    #[test]
    fn requests_during_the_first_look_are_served_too() {
        for _ in 0..20 {
            let dir = tempfile::tempdir().expect("tempdir");
            let data = artifact(8 * 4096);
            let (sha, _) = hold(dir.path(), &data, 4096);
            let held = Held::new(dir.path());
            std::thread::scope(|s| {
                let asks: Vec<_> = (0..8)
                    .map(|i| {
                        let held = &held;
                        s.spawn(move || held.serve(&ask(sha, i * 4096, 4096)))
                    })
                    .collect();
                for a in asks {
                    let served = a.join().expect("thread");
                    assert!(served.is_ok(), "{:?}", served.err().map(|e| e.reason));
                }
            });
        }
    }

    #[test]
    fn every_block_and_the_list_are_served_as_held() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = artifact(200_000);
        let (sha, list_sha) = hold(dir.path(), &data, DEFAULT_BLOCK_SIZE);
        let held = Held::new(dir.path());
        for i in 0..4u64 {
            let (offset, length) = block_range(i, data.len() as u64, DEFAULT_BLOCK_SIZE);
            let got = held.serve(&ask(sha, offset, length)).expect("served");
            assert_eq!(
                got,
                &data[offset as usize..(offset + u64::from(length)) as usize]
            );
        }
        let list = BlockList::compute(&data[..], DEFAULT_BLOCK_SIZE).expect("list");
        assert_eq!(
            held.serve(&ask(list_sha, 0, 65_536)).expect("list"),
            list.as_bytes()
        );
        assert_eq!(
            held.serve(&ask(list_sha, 32, 32)).expect("list part"),
            &list.as_bytes()[32..64]
        );
        let e = held.serve(&ask(sha, 100, 65_536)).expect_err("unaligned");
        assert!(e.reason.contains("not the start of a block"), "{e:?}");
        let e = held.serve(&ask(sha, 0, 10)).expect_err("partial");
        assert!(e.reason.contains("served whole"), "{e:?}");
    }

    #[test]
    fn the_block_size_is_found_from_the_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = artifact(10_000);
        let (sha, _) = hold(dir.path(), &data, 4096);
        let held = Held::new(dir.path());
        assert_eq!(
            held.serve(&ask(sha, 8192, 4096)).expect("last block"),
            &data[8192..]
        );
    }

    #[test]
    fn an_artifact_without_its_list_or_a_partial_download_is_not_served() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = artifact(70_000);
        let sha = sha256(&data);
        std::fs::write(dir.path().join(hex::encode(&sha)), &data).expect("write");
        std::fs::write(
            dir.path().join(format!("{}.part", hex::encode(&sha))),
            &data,
        )
        .expect("write");
        let held = Held::new(dir.path());
        let e = held.serve(&ask(sha, 0, 65_536)).expect_err("no list");
        assert!(e.reason.contains("does not hold"), "{e:?}");
    }

    #[test]
    fn a_copy_damaged_on_disk_is_never_served_and_is_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = artifact(200_000);
        let (sha, _) = hold(dir.path(), &data, DEFAULT_BLOCK_SIZE);
        let held = Held::new(dir.path());
        assert!(held.serve(&ask(sha, 65_536, 65_536)).is_ok());
        let mut bad = data.clone();
        bad[70_000] ^= 0xff;
        std::fs::write(dir.path().join(hex::encode(&sha)), &bad).expect("damage");
        let e = held
            .serve(&ask(sha, 65_536, 65_536))
            .expect_err("damaged block");
        assert!(
            e.dropped && e.reason.contains("does not match its hash"),
            "{e:?}"
        );
        // Dropped: even an intact block of it is no longer served (until the files change).
        let e = held.serve(&ask(sha, 0, 65_536)).expect_err("dropped");
        assert!(!e.dropped && e.reason.contains("does not hold"), "{e:?}");

        // Truncated after it was taken up.
        let (sha2, _) = hold(dir.path(), &artifact(150_000), DEFAULT_BLOCK_SIZE);
        // A digest asked for again within a second of the last look waits for the next one.
        held.scan();
        assert!(held.serve(&ask(sha2, 0, 65_536)).is_ok());
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join(hex::encode(&sha2)))
            .expect("open");
        f.set_len(100_000).expect("truncate");
        let e = held.serve(&ask(sha2, 0, 65_536)).expect_err("truncated");
        assert!(e.dropped && e.reason.contains("100000 bytes"), "{e:?}");
    }

    #[test]
    fn a_list_that_does_not_fit_its_artifact_is_not_taken_up() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = artifact(200_000);
        let (sha, _) = hold(dir.path(), &data, DEFAULT_BLOCK_SIZE);
        let list_path = dir
            .path()
            .join(format!("{}{LIST_SUFFIX}", hex::encode(&sha)));
        let mut list = std::fs::read(&list_path).expect("read");
        list[0] ^= 1;
        std::fs::write(&list_path, &list).expect("write");
        let held = Held::new(dir.path());
        assert!(held.serve(&ask(sha, 0, 65_536)).is_err());
        assert!(held.serve(&ask(sha256(&list), 0, 65_536)).is_err());
    }

    #[test]
    fn prune_keeps_the_newest_downloads_that_fit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let old = hold(dir.path(), &artifact(100_000), DEFAULT_BLOCK_SIZE).0;
        let set_old = |sha: &Digest, age: u64| {
            let t = SystemTime::now() - Duration::from_secs(age);
            for name in [
                hex::encode(sha),
                format!("{}{LIST_SUFFIX}", hex::encode(sha)),
            ] {
                let f = File::options()
                    .write(true)
                    .open(dir.path().join(name))
                    .expect("open");
                f.set_modified(t).expect("mtime");
            }
        };
        set_old(&old, 100);
        let middle = hold(dir.path(), &artifact(90_000), DEFAULT_BLOCK_SIZE).0;
        set_old(&middle, 50);
        let newest = hold(dir.path(), &artifact(80_000), DEFAULT_BLOCK_SIZE).0;
        std::fs::write(dir.path().join("abc.part"), b"partial").expect("part");

        let pruned = prune(dir.path(), 200_000);
        assert_eq!(pruned.artifacts, vec![old]);
        assert!(dir.path().join(hex::encode(&newest)).exists());
        assert!(dir.path().join(hex::encode(&middle)).exists());
        assert!(!dir.path().join(hex::encode(&old)).exists());
        assert!(!dir
            .path()
            .join(format!("{}{LIST_SUFFIX}", hex::encode(&old)))
            .exists());
        assert!(
            dir.path().join("abc.part").exists(),
            "partial downloads stay"
        );

        let pruned = prune(dir.path(), 0);
        assert_eq!(pruned.artifacts.len(), 2);
        assert_eq!(
            std::fs::read_dir(dir.path()).expect("dir").count(),
            1,
            "only the partial download is left"
        );
    }
}
