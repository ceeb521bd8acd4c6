//! The artifact block server: answers an agent's `BlockRequest` from the content-addressed store
//! `{data_dir}/artifacts/{sha256 hex}`.
//!
//! Blocks are served by digest, not by release or file name, so a block is valid for every
//! release that shares the artifact, and a request can only ever reach a file whose name is a
//! digest this server formats itself (no path from the wire touches the file system). Replies
//! are capped at [`MAX_BLOCK`] so one request cannot make the coordinator publish more than an
//! MQTT packet can carry. Every failure becomes `BlockReply::Unavailable` with a reason the
//! agent can log; nothing here panics on any request.

use std::fs::File;
use std::io::{Read as _, Seek as _, SeekFrom};
use std::path::{Path, PathBuf};

use flotilla_protocol::{hex, BlockReply, BlockRequest, Digest};

/// Largest block served, in bytes, whatever the request asks for.
pub const MAX_BLOCK: u32 = 64 * 1024;

/// Serves artifact blocks from one directory.
#[derive(Debug, Clone)]
pub struct BlockServer {
    dir: PathBuf,
}

impl BlockServer {
    /// A server over `artifacts_dir` (files named by their lower-case sha256 hex).
    pub fn new(artifacts_dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: artifacts_dir.into(),
        }
    }

    /// The store path of an artifact.
    pub fn path_of(&self, sha256: &Digest) -> PathBuf {
        artifact_path(&self.dir, sha256)
    }

    /// Answers one request. A request past the end or for an unknown digest gets
    /// `Unavailable` naming the digest and offset; a length of 0 gets an empty block.
    pub fn serve(&self, req: &BlockRequest) -> BlockReply {
        let unavailable = |reason: String| BlockReply::Unavailable {
            sha256: req.sha256,
            offset: req.offset,
            reason,
        };
        let digest = hex::encode(&req.sha256);
        let path = self.path_of(&req.sha256);
        let mut file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return unavailable(format!("no artifact with sha256 {digest}"))
            }
            Err(e) => return unavailable(format!("artifact {digest} cannot be opened: {e}")),
        };
        let size = match file.metadata() {
            Ok(m) => m.len(),
            Err(e) => return unavailable(format!("artifact {digest} cannot be read: {e}")),
        };
        if req.offset > size {
            return unavailable(format!(
                "offset {} is past the end of artifact {digest} ({size} bytes)",
                req.offset
            ));
        }
        // An offset exactly at the end is not an error: it is how a zero-length artifact, or a
        // request for "the rest" of a finished download, looks.
        let want = u64::from(req.length.min(MAX_BLOCK)).min(size - req.offset);
        if let Err(e) = file.seek(SeekFrom::Start(req.offset)) {
            return unavailable(format!(
                "artifact {digest} cannot seek to {}: {e}",
                req.offset
            ));
        }
        // `want` is at most MAX_BLOCK, so the cast cannot truncate.
        let mut data = Vec::with_capacity(want as usize);
        match file.take(want).read_to_end(&mut data) {
            Ok(_) => BlockReply::Data {
                sha256: req.sha256,
                offset: req.offset,
                data,
            },
            Err(e) => unavailable(format!(
                "artifact {digest} read failed at {}: {e}",
                req.offset
            )),
        }
    }
}

/// `{dir}/{sha256 hex}`: the single place that names a file in the store.
pub fn artifact_path(dir: &Path, sha256: &Digest) -> PathBuf {
    dir.join(hex::encode(sha256))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store_with(bytes: &[u8]) -> (tempfile::TempDir, BlockServer, Digest) {
        let dir = tempfile::tempdir().expect("tempdir");
        let digest = flotilla_protocol::sha256(bytes);
        std::fs::write(artifact_path(dir.path(), &digest), bytes).expect("write");
        let server = BlockServer::new(dir.path());
        (dir, server, digest)
    }

    fn data(reply: BlockReply) -> Vec<u8> {
        match reply {
            BlockReply::Data { data, .. } => data,
            other => panic!("expected data, got {other:?}"),
        }
    }

    fn reason(reply: BlockReply) -> String {
        match reply {
            BlockReply::Unavailable { reason, .. } => reason,
            other => panic!("expected unavailable, got {other:?}"),
        }
    }

    #[test]
    fn serves_blocks_that_reassemble_the_artifact() {
        let bytes: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let (_dir, server, sha256) = store_with(&bytes);
        let mut got = Vec::new();
        while (got.len() as u64) < bytes.len() as u64 {
            let block = data(server.serve(&BlockRequest {
                sha256,
                offset: got.len() as u64,
                length: u32::MAX,
            }));
            assert!(!block.is_empty());
            assert!(
                block.len() <= MAX_BLOCK as usize,
                "block of {} bytes",
                block.len()
            );
            got.extend_from_slice(&block);
        }
        assert_eq!(got, bytes);
    }

    #[test]
    fn short_and_empty_requests() {
        let (_dir, server, sha256) = store_with(b"hello world");
        assert_eq!(
            data(server.serve(&BlockRequest {
                sha256,
                offset: 6,
                length: 100
            })),
            b"world"
        );
        assert_eq!(
            data(server.serve(&BlockRequest {
                sha256,
                offset: 0,
                length: 0
            })),
            b""
        );
        assert_eq!(
            data(server.serve(&BlockRequest {
                sha256,
                offset: 11,
                length: 10
            })),
            b""
        );
    }

    #[test]
    fn unknown_digest_and_offsets_past_the_end_are_named() {
        let (_dir, server, sha256) = store_with(b"hello world");
        let r = reason(server.serve(&BlockRequest {
            sha256: [7; 32],
            offset: 0,
            length: 10,
        }));
        assert!(r.contains(&hex::encode(&[7; 32])), "{r}");
        for offset in [12, u64::MAX] {
            let r = reason(server.serve(&BlockRequest {
                sha256,
                offset,
                length: 10,
            }));
            assert!(
                r.contains(&offset.to_string()) && r.contains("past the end"),
                "{r}"
            );
        }
    }
}
