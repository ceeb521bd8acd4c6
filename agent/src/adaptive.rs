//! Adaptive downloads: before a block-indexed artifact is fetched, the blocks the device already
//! holds are found and copied into the download, so an image with a small change downloads only
//! the changed blocks (as RAUC's block-hash-index mode does).
//!
//! Two passes over files, both synchronous (run on the blocking pool):
//!
//! 1. [`verify_part`]: the partial download itself. Every block of `<sha256>.part` is hashed and
//!    compared with its signed hash; the ones that match are present. This is what makes a
//!    download resumable per block after a kill, with no state beyond the file: a block torn by
//!    the kill, or never written (a hole reads as zeros), simply fails its hash.
//! 2. [`copy_local`]: candidate files (verified artifacts in `downloads/`, what the targets run
//!    and the other A/B slot, see `UpdateTarget::block_sources`) are read at the manifest's block
//!    size, block-aligned; a block whose sha256 is the signed hash of a missing block is written
//!    there. A copy is checked exactly like a fetched block, so a candidate can be anything.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use flotilla_protocol::blocks::{block_range, BlockList};
use flotilla_protocol::{hex, Digest};
use sha2::Digest as _;

/// Hashes every block of `part` against `list`: `true` for each block that is present and
/// verified. A file shorter than the artifact has its missing tail absent.
pub fn verify_part(part: &File, list: &BlockList, size: u64) -> std::io::Result<Vec<bool>> {
    let bs = list.block_size();
    let mut buf = vec![0u8; bs as usize];
    let len = part.metadata()?.len();
    let mut present = vec![false; list.len() as usize];
    for (i, have) in present.iter_mut().enumerate() {
        let (offset, length) = block_range(i as u64, size, bs);
        if offset + u64::from(length) > len {
            break;
        }
        let block = &mut buf[..length as usize];
        part.read_exact_at(block, offset)?;
        *have = list.verify(i as u64, block);
    }
    Ok(present)
}

/// The verified artifacts in `dir` (files named by a sha256), except `except`: candidates for
/// [`copy_local`].
pub fn downloaded_artifacts(dir: &Path, except: &Digest) -> Vec<PathBuf> {
    let skip = hex::encode(except);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.len() == 64
                && name.bytes().all(|b| b.is_ascii_hexdigit())
                && name != skip
                && e.file_type().is_ok_and(|t| t.is_file())
        })
        .map(|e| e.path())
        .collect();
    found.sort();
    found
}

/// Copies into `part` every missing block (`present[i] == false`) found in `candidates`, reading
/// at most `limit` bytes of each. Marks copied blocks present and returns the bytes copied.
/// A candidate that cannot be read is skipped (logged): it is only a shortcut.
pub fn copy_local(
    part: &File,
    list: &BlockList,
    size: u64,
    present: &mut [bool],
    candidates: &[PathBuf],
    limit: u64,
) -> std::io::Result<u64> {
    let bs = list.block_size();
    // signed hash -> the missing blocks that have it (an image may repeat a block).
    let mut wanted: HashMap<Digest, Vec<u64>> = HashMap::new();
    for (i, _) in present.iter().enumerate().filter(|(_, have)| !**have) {
        if let Some(hash) = list.hash(i as u64) {
            wanted.entry(hash).or_default().push(i as u64);
        }
    }
    let mut copied = 0u64;
    let mut buf = vec![0u8; bs as usize];
    for path in candidates {
        if wanted.is_empty() {
            break;
        }
        let mut file = match File::open(path) {
            Ok(f) => f,
            Err(e) => {
                tracing::debug!(path = %path.display(), "not a source of local blocks: {e}");
                continue;
            }
        };
        let mut read_total = 0u64;
        while read_total < limit && !wanted.is_empty() {
            let n = match read_full(&mut file, &mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => {
                    tracing::debug!(path = %path.display(), "stopped reading local blocks: {e}");
                    break;
                }
            };
            read_total += n as u64;
            let hash: Digest = sha2::Sha256::digest(&buf[..n]).into();
            if let Some(blocks) = wanted.remove(&hash) {
                for i in blocks {
                    let (offset, length) = block_range(i, size, bs);
                    if length as usize != n {
                        continue;
                    }
                    part.write_all_at(&buf[..n], offset)?;
                    present[i as usize] = true;
                    copied += n as u64;
                }
            }
            if n < buf.len() {
                break;
            }
        }
    }
    Ok(copied)
}

/// Reads until `buf` is full or the end of the file.
fn read_full(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_only_blocks_whose_hash_matches_and_reads_back_verified() {
        let dir = tempfile::tempdir().expect("tempdir");
        let new: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let mut old = new.clone();
        old[5000] ^= 1; // block 4 (of 1024 bytes) differs
        let list = BlockList::compute(&new[..], 1024).expect("list");
        let old_path = dir.path().join("old");
        std::fs::write(&old_path, &old).expect("write");
        let part = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(dir.path().join("part"))
            .expect("part");
        part.set_len(new.len() as u64).expect("len");
        let mut present = verify_part(&part, &list, new.len() as u64).expect("verify");
        assert!(
            present.iter().all(|p| !p),
            "a hole is no block of this image"
        );
        let copied = copy_local(
            &part,
            &list,
            new.len() as u64,
            &mut present,
            &[dir.path().join("missing"), old_path],
            u64::MAX,
        )
        .expect("copy");
        assert_eq!(copied, 10_000 - 1024, "all but the changed block");
        assert!(!present[4] && present.iter().filter(|p| **p).count() == 9);
        let again = verify_part(&part, &list, new.len() as u64).expect("verify");
        assert_eq!(again, present, "what was copied verifies after a restart");
    }

    #[test]
    fn only_sha256_named_files_other_than_the_target_are_candidates() {
        let dir = tempfile::tempdir().expect("tempdir");
        let me = [1u8; 32];
        let other = [2u8; 32];
        for name in [
            hex::encode(&me),
            hex::encode(&other),
            format!("{}.part", hex::encode(&other)),
            format!("{}.blocks", hex::encode(&other)),
        ] {
            std::fs::write(dir.path().join(name), b"x").expect("write");
        }
        assert_eq!(
            downloaded_artifacts(dir.path(), &me),
            [dir.path().join(hex::encode(&other))]
        );
    }
}
