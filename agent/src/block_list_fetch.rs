//! A block-indexed artifact's block list: fetched from the coordinator by its own digest
//! (through the streaming fetcher, which checks it), checked against the manifest's
//! [`BlockIndexRef`], and kept beside the download as `<sha256>.blocks`; and the partial files
//! a download leaves to resume from, and the part file opened with what already verifies.
//! [`crate::fetch_blocks`] then fetches the blocks the list names.

use flotilla_protocol::blocks::{list_size, BlockIndexRef, BlockList};
use flotilla_protocol::{hex, ByteCounts};
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::adaptive;
use crate::fetch::{self, FetchError, FetchInput, FetchRequest, FetchSpec};

/// Where a block list is kept once verified: `<dir>/<artifact sha256>.blocks`.
pub fn list_path(spec: &FetchSpec) -> PathBuf {
    spec.dir
        .join(format!("{}.blocks", hex::encode(&spec.sha256)))
}

/// Removes the partial files a download of `spec` keeps to resume from: the artifact's `.part`
/// and, for a block-indexed artifact, its block list's. For a download that will not be
/// resumed (its action was canceled); the verified list, `<sha256>.blocks`, stays.
pub fn discard_partial(spec: &FetchSpec, index: Option<&BlockIndexRef>) {
    let list_part = index.map(|index| {
        FetchSpec {
            sha256: index.sha256,
            ..spec.clone()
        }
        .part_path()
    });
    for part in std::iter::once(spec.part_path()).chain(list_part) {
        if let Err(e) = std::fs::remove_file(&part) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!("cannot remove the partial download {}: {e}", part.display());
            }
        }
    }
}

/// Returns the verified block list of `spec`'s artifact: the stored one if it still checks,
/// or one fetched from the coordinator by its digest (through the streaming fetcher, which
/// checks the digest), checked against `index`, then stored as `<sha256>.blocks`.
pub async fn fetch_block_list(
    spec: &FetchSpec,
    index: &BlockIndexRef,
    counts: &mut ByteCounts,
    requests: &mpsc::Sender<FetchRequest>,
    inputs: &mut mpsc::Receiver<FetchInput>,
    cancel: &CancellationToken,
) -> Result<BlockList, FetchError> {
    let path = list_path(spec);
    let refused = |reason: String| {
        FetchError::Digest(crate::trust::Refusal(format!(
            "artifact {}: block list refused: {reason}",
            spec.name
        )))
    };
    if let Ok(bytes) = std::fs::read(&path) {
        if let Ok(list) = BlockList::from_bytes(&bytes, index, spec.size) {
            return Ok(list);
        }
    }
    let list_spec = FetchSpec {
        name: format!("{} (block list)", spec.name),
        sha256: index.sha256,
        size: list_size(spec.size, index.block_size),
        block_size: spec.block_size,
        ..spec.clone()
    };
    let fetched = fetch::fetch(
        &list_spec,
        0,
        counts,
        requests,
        inputs,
        &mut |_, _| {},
        cancel,
    )
    .await?;
    let read_err = |source| FetchError::ReadPart {
        artifact: list_spec.name.clone(),
        path: fetched.clone(),
        source,
    };
    let bytes = std::fs::read(&fetched).map_err(read_err)?;
    let list =
        BlockList::from_bytes(&bytes, index, spec.size).map_err(|e| refused(e.to_string()))?;
    flotilla_targets::fs::atomic_write(&path, list.as_bytes()).map_err(|source| {
        FetchError::WritePart {
            artifact: spec.name.clone(),
            path: path.clone(),
            source,
        }
    })?;
    // Kept only under the artifact's name, where the block server looks for it.
    let _ = std::fs::remove_file(&fetched);
    Ok(list)
}

/// Opens (or creates) the part file at the artifact's size, finds its verified blocks, and
/// copies in what the candidates hold. Returns the file, which blocks are present, and the
/// bytes copied.
pub fn prepare(
    part: &Path,
    list: &BlockList,
    size: u64,
    candidates: &[PathBuf],
) -> std::io::Result<(File, Vec<bool>, u64)> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(part)?;
    let mut present = adaptive::verify_part(&file, list, size)?;
    file.set_len(size)?;
    let limit = size.div_ceil(u64::from(list.block_size())) * u64::from(list.block_size());
    let copied = adaptive::copy_local(&file, list, size, &mut present, candidates, limit)?;
    if copied > 0 {
        file.sync_data()?;
    }
    Ok((file, present, copied))
}
