//! Per-block hashes of an artifact, so a block from anywhere (the coordinator, a peer, a copy the
//! device already holds) is checked before it is written.
//!
//! An artifact of `size` bytes is cut into blocks of `block_size` bytes (the last one may be
//! shorter). Its **block list** is the sha256 of every block, concatenated: 32 bytes a block,
//! 0.05% of the artifact at the default 64 KiB. The list is a content-addressed file of its own,
//! fetched like an artifact; the signed release manifest carries only its digest and block size
//! ([`BlockIndexRef`], in the manifest's extension, see [`crate::manifest`]), so a desired action
//! stays small whatever the artifact's size.
//!
//! ```
//! use flotilla_protocol::blocks::{BlockList, BlockIndexRef};
//!
//! let artifact = vec![7u8; 100_000];
//! let list = BlockList::compute(&artifact[..], 65_536).unwrap();
//! let index = BlockIndexRef { block_size: 65_536, sha256: flotilla_protocol::sha256(list.as_bytes()) };
//! let checked = BlockList::from_bytes(list.as_bytes(), &index, artifact.len() as u64).unwrap();
//! assert_eq!(checked.len(), 2);
//! assert!(checked.verify(1, &artifact[65_536..]));
//! assert!(!checked.verify(0, &artifact[65_536..]));
//! ```

use std::io::Read;

use serde::{Deserialize, Serialize};
use sha2::Digest as _;

use crate::messages::Digest;

/// The block size `release create` uses unless told otherwise.
pub const DEFAULT_BLOCK_SIZE: u32 = 64 * 1024;

/// The smallest block size a manifest may name.
pub const MIN_BLOCK_SIZE: u32 = 1024;

/// The largest block size a manifest may name: the largest block an artifact server hands out
/// in one reply, so one block is always one request.
pub const MAX_BLOCK_SIZE: u32 = 64 * 1024;

/// Where an artifact's block list is, and how its blocks are cut. Signed as part of the
/// manifest's extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockIndexRef {
    pub block_size: u32,
    /// sha256 of the block list file; the list is fetched by this digest.
    pub sha256: Digest,
}

/// Why a block list or a block index was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockListError {
    #[error("block size {0} is outside {MIN_BLOCK_SIZE}..={MAX_BLOCK_SIZE}")]
    BlockSize(u32),
    #[error("block list is {found} bytes; an artifact of {size} bytes in blocks of {block_size} needs {expected}")]
    Length {
        found: u64,
        expected: u64,
        size: u64,
        block_size: u32,
    },
    #[error("block list does not hash to the digest the manifest signed")]
    Digest,
    #[error("reading the artifact to hash its blocks: {0}")]
    Read(String),
}

impl BlockIndexRef {
    /// Checks the block size is one a manifest may name.
    pub fn validate(&self) -> Result<(), BlockListError> {
        check_block_size(self.block_size)
    }
}

fn check_block_size(block_size: u32) -> Result<(), BlockListError> {
    if (MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&block_size) {
        Ok(())
    } else {
        Err(BlockListError::BlockSize(block_size))
    }
}

/// How many blocks an artifact of `size` bytes has. A zero-length artifact has none.
pub fn block_count(size: u64, block_size: u32) -> u64 {
    size.div_ceil(u64::from(block_size.max(1)))
}

/// The size of the block list of an artifact of `size` bytes.
pub fn list_size(size: u64, block_size: u32) -> u64 {
    block_count(size, block_size) * 32
}

fn digest_of(bytes: &[u8]) -> Digest {
    sha2::Sha256::digest(bytes).into()
}

/// The byte range `(offset, length)` of block `index` in an artifact of `size` bytes.
pub fn block_range(index: u64, size: u64, block_size: u32) -> (u64, u32) {
    let offset = index * u64::from(block_size);
    let length = u64::from(block_size).min(size.saturating_sub(offset));
    // `length` is at most `block_size`, a u32.
    (offset, length as u32)
}

/// A block list whose length matched its artifact (and, when read from elsewhere, whose digest
/// matched the signed one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockList {
    block_size: u32,
    bytes: Vec<u8>,
}

impl BlockList {
    /// Hashes every block of an artifact read from `reader` (exactly its bytes).
    pub fn compute(mut reader: impl Read, block_size: u32) -> Result<Self, BlockListError> {
        check_block_size(block_size)?;
        let mut bytes = Vec::new();
        let mut block = vec![0u8; block_size as usize];
        loop {
            let mut filled = 0;
            while filled < block.len() {
                match reader.read(&mut block[filled..]) {
                    Ok(0) => break,
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(BlockListError::Read(e.to_string())),
                }
            }
            if filled == 0 {
                break;
            }
            bytes.extend_from_slice(&digest_of(&block[..filled]));
            if filled < block.len() {
                break;
            }
        }
        Ok(Self { block_size, bytes })
    }

    /// Checks bytes fetched from anywhere against the signed index and the artifact's size.
    pub fn from_bytes(
        bytes: &[u8],
        index: &BlockIndexRef,
        artifact_size: u64,
    ) -> Result<Self, BlockListError> {
        index.validate()?;
        let expected = list_size(artifact_size, index.block_size);
        if bytes.len() as u64 != expected {
            return Err(BlockListError::Length {
                found: bytes.len() as u64,
                expected,
                size: artifact_size,
                block_size: index.block_size,
            });
        }
        if digest_of(bytes) != index.sha256 {
            return Err(BlockListError::Digest);
        }
        Ok(Self {
            block_size: index.block_size,
            bytes: bytes.to_vec(),
        })
    }

    /// The list's bytes, as stored and served.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// How many blocks the artifact has.
    pub fn len(&self) -> u64 {
        self.bytes.len() as u64 / 32
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The signed hash of block `index`, if the artifact has that block.
    pub fn hash(&self, index: u64) -> Option<Digest> {
        let start = usize::try_from(index.checked_mul(32)?).ok()?;
        let slice = self.bytes.get(start..start.checked_add(32)?)?;
        slice.try_into().ok()
    }

    /// Whether `data` is block `index`, exactly.
    pub fn verify(&self, index: u64, data: &[u8]) -> bool {
        self.hash(index).is_some_and(|h| h == digest_of(data))
    }

    /// The index of the block that starts at `offset`, if a block starts there.
    pub fn index_at(&self, offset: u64) -> Option<u64> {
        let bs = u64::from(self.block_size);
        (offset.is_multiple_of(bs) && offset / bs < self.len()).then_some(offset / bs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index_of(list: &BlockList) -> BlockIndexRef {
        BlockIndexRef {
            block_size: list.block_size(),
            sha256: digest_of(list.as_bytes()),
        }
    }

    #[test]
    fn every_block_and_only_it_verifies() {
        let artifact: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let list = BlockList::compute(&artifact[..], 4096).expect("hashes");
        assert_eq!(list.len(), 3);
        for i in 0..3 {
            let (offset, length) = block_range(i, artifact.len() as u64, 4096);
            let block = &artifact[offset as usize..offset as usize + length as usize];
            assert!(list.verify(i, block), "block {i}");
            let mut bad = block.to_vec();
            bad[0] ^= 1;
            assert!(!list.verify(i, &bad), "a flipped bit in block {i} passes");
        }
        assert_eq!(block_range(2, 10_000, 4096), (8192, 1808));
        assert!(!list.verify(3, b""), "a block past the end verifies");
        assert_eq!(list.index_at(4096), Some(1));
        assert_eq!(list.index_at(4097), None);
        assert_eq!(list.index_at(12_288), None);
    }

    #[test]
    fn a_list_that_does_not_match_is_refused_naming_why() {
        let artifact = vec![1u8; 5000];
        let list = BlockList::compute(&artifact[..], 1024).expect("hashes");
        let index = index_of(&list);
        assert!(BlockList::from_bytes(list.as_bytes(), &index, 5000).is_ok());
        let err = BlockList::from_bytes(list.as_bytes(), &index, 6000).expect_err("refused");
        assert!(err.to_string().contains("needs 192"), "{err}");
        let mut forged = list.as_bytes().to_vec();
        forged[3] ^= 1;
        assert_eq!(
            BlockList::from_bytes(&forged, &index, 5000),
            Err(BlockListError::Digest)
        );
        let tiny = BlockIndexRef {
            block_size: 16,
            ..index
        };
        assert_eq!(
            BlockList::from_bytes(list.as_bytes(), &tiny, 5000),
            Err(BlockListError::BlockSize(16))
        );
    }

    #[test]
    fn overhead_is_under_a_thousandth_at_the_default_size() {
        let size = 128 * 1024 * 1024;
        let overhead = list_size(size, DEFAULT_BLOCK_SIZE) as f64 / size as f64;
        assert!(overhead <= 0.001, "{overhead}");
        assert_eq!(block_count(0, DEFAULT_BLOCK_SIZE), 0);
        let empty = BlockList::compute(&b""[..], DEFAULT_BLOCK_SIZE).expect("hashes");
        assert!(empty.is_empty());
    }
}
