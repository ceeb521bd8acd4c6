//! Checking the bytes a simulated device downloads, as the agent does: every block against the
//! signed block list when the manifest has one (`protocol/src/blocks.rs`), or, without one, the
//! whole artifact's sha256 at the end. Pure: bytes in, a verdict out, nothing kept but the
//! hash state and, without a block list, the blocks that arrived ahead of the next one to hash.
//!
//! ```
//! use flotilla_fleetsim::artifact_check::ArtifactCheck;
//! use flotilla_protocol::blocks::{BlockIndexRef, BlockList};
//! let artifact = vec![5u8; 3000];
//! let list = BlockList::compute(&artifact[..], 1024).unwrap();
//! let digest = flotilla_protocol::sha256(&artifact);
//! let mut check = ArtifactCheck::new("app", digest, 3000, Some(list));
//! check.accept(2048, &artifact[2048..]).unwrap();
//! check.accept(0, &artifact[..1024]).unwrap();
//! assert!(check.finish().is_err(), "block 1 is missing");
//! check.accept(1024, &artifact[1024..2048]).unwrap();
//! check.finish().unwrap();
//! ```

use std::collections::BTreeMap;

use flotilla_protocol::blocks::{block_count, block_range, BlockList, DEFAULT_BLOCK_SIZE};
use flotilla_protocol::{hex, Digest};
use sha2::Digest as _;

/// Why a download was refused; every variant names the artifact.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    #[error("artifact {artifact}: block {index} (offset {offset}) does not match its signed hash")]
    BlockHash {
        artifact: String,
        index: u64,
        offset: u64,
    },
    #[error("artifact {artifact}: {got} bytes at offset {offset}, where a block of {want} starts")]
    BlockLength {
        artifact: String,
        offset: u64,
        got: usize,
        want: u32,
    },
    #[error("artifact {artifact}: no block starts at offset {offset}")]
    NotABlock { artifact: String, offset: u64 },
    #[error("artifact {artifact}: {missing} of {blocks} blocks never arrived")]
    Incomplete {
        artifact: String,
        missing: u64,
        blocks: u64,
    },
    #[error("artifact {artifact}: sha256 {got} is not the signed {want}")]
    ArtifactHash {
        artifact: String,
        got: String,
        want: String,
    },
}

/// One artifact's download under check.
#[derive(Debug)]
pub struct ArtifactCheck {
    name: String,
    sha256: Digest,
    size: u64,
    block_size: u32,
    list: Option<BlockList>,
    received: Vec<bool>,
    /// Without a block list: the hash of every byte before `next`, and the blocks after it.
    hasher: sha2::Sha256,
    next: u64,
    ahead: BTreeMap<u64, Vec<u8>>,
}

impl ArtifactCheck {
    /// `list` is the artifact's block list, already checked against the signed index
    /// ([`BlockList::from_bytes`]); without one, blocks are cut at the default block size.
    pub fn new(name: &str, sha256: Digest, size: u64, list: Option<BlockList>) -> Self {
        let block_size = list
            .as_ref()
            .map_or(DEFAULT_BLOCK_SIZE, BlockList::block_size);
        ArtifactCheck {
            name: name.to_owned(),
            sha256,
            size,
            block_size,
            list,
            received: vec![false; block_count(size, block_size) as usize],
            hasher: sha2::Sha256::new(),
            next: 0,
            ahead: BTreeMap::new(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The blocks to ask for: (offset, length), in order.
    pub fn blocks(&self) -> Vec<(u64, u32)> {
        (0..self.received.len() as u64)
            .map(|i| block_range(i, self.size, self.block_size))
            .collect()
    }

    /// Takes the block that starts at `offset`. A block already taken is ignored (a reply
    /// that came twice); a block that fails its signed hash is refused, naming it.
    pub fn accept(&mut self, offset: u64, data: &[u8]) -> Result<(), CheckError> {
        let bs = u64::from(self.block_size);
        let index = offset / bs;
        if !offset.is_multiple_of(bs) || index >= self.received.len() as u64 {
            return Err(CheckError::NotABlock {
                artifact: self.name.clone(),
                offset,
            });
        }
        let (_, want) = block_range(index, self.size, self.block_size);
        if data.len() != want as usize {
            return Err(CheckError::BlockLength {
                artifact: self.name.clone(),
                offset,
                got: data.len(),
                want,
            });
        }
        if self.received[index as usize] {
            return Ok(());
        }
        match &self.list {
            Some(list) => {
                if !list.verify(index, data) {
                    return Err(CheckError::BlockHash {
                        artifact: self.name.clone(),
                        index,
                        offset,
                    });
                }
            }
            None => {
                self.ahead.insert(offset, data.to_vec());
                while let Some(block) = self.ahead.remove(&self.next) {
                    self.hasher.update(&block);
                    self.next += block.len() as u64;
                }
            }
        }
        self.received[index as usize] = true;
        Ok(())
    }

    /// Every block arrived and, without a block list, the whole artifact hashes to its digest.
    pub fn finish(&self) -> Result<(), CheckError> {
        let missing = self.received.iter().filter(|r| !**r).count() as u64;
        if missing > 0 {
            return Err(CheckError::Incomplete {
                artifact: self.name.clone(),
                missing,
                blocks: self.received.len() as u64,
            });
        }
        if self.list.is_none() {
            let got: Digest = self.hasher.clone().finalize().into();
            if got != self.sha256 {
                return Err(CheckError::ArtifactHash {
                    artifact: self.name.clone(),
                    got: hex::encode(&got),
                    want: hex::encode(&self.sha256),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn artifact(n: u32) -> Vec<u8> {
        (0..n).map(|i| (i * 13 % 251) as u8).collect()
    }

    #[test]
    fn a_block_that_fails_its_signed_hash_is_refused_naming_it() {
        let bytes = artifact(5000);
        let list = BlockList::compute(&bytes[..], 1024).expect("hashes");
        let mut check =
            ArtifactCheck::new("app", flotilla_protocol::sha256(&bytes), 5000, Some(list));
        assert_eq!(check.blocks().len(), 5);
        assert_eq!(check.blocks()[4], (4096, 904));
        let mut bad = bytes[2048..3072].to_vec();
        bad[100] ^= 1;
        let err = check.accept(2048, &bad).expect_err("refused");
        assert_eq!(
            err.to_string(),
            "artifact app: block 2 (offset 2048) does not match its signed hash"
        );
        // The good block is still wanted, and the download is not done without it.
        for (offset, len) in check.blocks() {
            if offset != 2048 {
                let o = offset as usize;
                check
                    .accept(offset, &bytes[o..o + len as usize])
                    .expect("good block");
            }
        }
        assert!(matches!(
            check.finish(),
            Err(CheckError::Incomplete { missing: 1, .. })
        ));
        check.accept(2048, &bytes[2048..3072]).expect("good block");
        check.finish().expect("complete");
    }

    #[test]
    fn blocks_of_the_wrong_length_or_place_are_refused() {
        let bytes = artifact(3000);
        let list = BlockList::compute(&bytes[..], 1024).expect("hashes");
        let mut check =
            ArtifactCheck::new("app", flotilla_protocol::sha256(&bytes), 3000, Some(list));
        let err = check.accept(1024, &bytes[1024..1500]).expect_err("short");
        assert!(
            err.to_string().contains("476 bytes at offset 1024"),
            "{err}"
        );
        let err = check
            .accept(100, &bytes[100..1124])
            .expect_err("not a block");
        assert!(err.to_string().contains("offset 100"), "{err}");
        let err = check.accept(3072, &[]).expect_err("past the end");
        assert!(matches!(err, CheckError::NotABlock { .. }), "{err}");
    }

    #[test]
    fn without_a_block_list_the_whole_artifact_is_hashed_whatever_the_order() {
        let bytes = artifact(200_000);
        let digest = flotilla_protocol::sha256(&bytes);
        let mut check = ArtifactCheck::new("app", digest, 200_000, None);
        let mut blocks = check.blocks();
        assert_eq!(blocks.len(), 4);
        blocks.reverse();
        for (offset, len) in blocks {
            let o = offset as usize;
            check
                .accept(offset, &bytes[o..o + len as usize])
                .expect("taken");
        }
        check.finish().expect("hashes right");

        let mut corrupt = ArtifactCheck::new("app", digest, 200_000, None);
        for (offset, len) in corrupt.blocks() {
            let o = offset as usize;
            let mut block = bytes[o..o + len as usize].to_vec();
            if offset == 65_536 {
                block[0] ^= 1;
            }
            corrupt
                .accept(offset, &block)
                .expect("no list: checked at the end");
        }
        let err = corrupt.finish().expect_err("refused");
        assert!(
            err.to_string().starts_with("artifact app: sha256 "),
            "{err}"
        );
    }
}
