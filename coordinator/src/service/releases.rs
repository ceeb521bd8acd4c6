//! Releases: signed manifests on disk and the content-addressed artifact store behind them.
//!
//! Layout under the coordinator's data directory:
//!
//! ```text
//! {data_dir}/artifacts/{sha256 hex}     artifact bytes, named by their digest
//! {data_dir}/artifacts/{sha256 hex}     an artifact's block list, named by its own digest
//! {data_dir}/releases/{name}.release    postcard SignedBlob of the manifest bytes
//! ```
//!
//! The signed bytes are a [`Manifest`]: the `ReleaseManifest` and, unless the release was made
//! with `--no-blocks`, the block index of every artifact (decision 0024). A block list is
//! content-addressed like an artifact and served by the same block server, so devices fetch it
//! from the coordinator or from a peer the same way. [`ReleaseStore::load_manifest`] checks every
//! block list file against its signed digest, so a release whose list is missing or altered is
//! reported when it is loaded, not when the first device asks for it.
//!
//! Releases are plain files rather than sled entries so that `flotilla release create` works
//! while `flotilla serve` holds the database (sled is single-process), and [`ReleaseStore`]
//! reads them fresh on every lookup so a release created a second ago is usable at once.
//! Every file is written through a temp file, fsync and rename: a crash leaves either the old
//! state or the new one, never a torn manifest or a half-copied artifact under a valid digest.

use std::fs::{self, File};
use std::io::{Read, Write as _};
use std::path::{Path, PathBuf};

use flotilla_protocol::blocks::{
    list_size, BlockIndexRef, BlockList, BlockListError, MAX_BLOCK_SIZE,
};
use flotilla_protocol::control::{ArtifactSummary, ReleaseSummary};
use flotilla_protocol::manifest::{Manifest, ManifestBlocks, ManifestError, ManifestTypes};
use flotilla_protocol::{envelope, hex, Artifact, DecodeError, Digest, IdError, ReleaseManifest};
use flotilla_protocol::{SignatureError, SignedBlob, SigningKey, UnixTime, VerifyingKey};
use sha2::Digest as _;

use crate::service::artifacts::artifact_path;
use crate::service::release_types::{check_content, parse_types, TypeError};

/// Why a release operation failed. Every variant names the file, field or artifact involved.
#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    #[error("release name {name:?} is invalid: {source}")]
    Name { name: String, source: IdError },
    #[error("--artifact {value:?} must look like TARGET=PATH (e.g. app=build/app.bin)")]
    ArtifactSpec { value: String },
    #[error("--artifact {value:?}: target {target:?} is invalid: {source}")]
    ArtifactTarget {
        value: String,
        target: String,
        source: IdError,
    },
    #[error("a release needs at least one --artifact")]
    NoArtifacts,
    #[error(transparent)]
    Type(#[from] TypeError),
    #[error("--expires-in {value:?} is invalid: {reason}")]
    Expiry { value: String, reason: String },
    #[error("release {name} already exists at {path}; release names are never reused")]
    Exists { name: String, path: PathBuf },
    #[error("cannot read artifact {path}: {source}")]
    ReadArtifact {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no release named {name} (looked for {path})")]
    NotFound { name: String, path: PathBuf },
    #[error("cannot read release file {path}: {source}")]
    ReadRelease {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("release file {path} is malformed: {source}")]
    Decode { path: PathBuf, source: DecodeError },
    #[error("release file {path}: {source}")]
    Manifest {
        path: PathBuf,
        source: ManifestError,
    },
    #[error("artifact {name}: cannot compute its block list: {source}")]
    BlockList {
        name: String,
        source: BlockListError,
    },
    #[error("artifact {name}: its block list {path} is missing from the store")]
    BlockListMissing { name: String, path: PathBuf },
    #[error("artifact {name}: its block list {path} does not match the signed manifest: {source}")]
    BlockListMismatch {
        name: String,
        path: PathBuf,
        source: BlockListError,
    },
    #[error("release file {path}: {source}")]
    Signature {
        path: PathBuf,
        source: SignatureError,
    },
    #[error("release file {path} holds release {found:?}, not {expected:?}")]
    WrongName {
        path: PathBuf,
        expected: String,
        found: String,
    },
    #[error("cannot list releases in {path}: {source}")]
    List {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("artifact {name}: {path} is missing from the store")]
    ArtifactMissing { name: String, path: PathBuf },
    #[error("artifact {name}: size mismatch in {path} (manifest says {expected} bytes, store has {found})")]
    ArtifactSize {
        name: String,
        path: PathBuf,
        expected: u64,
        found: u64,
    },
    #[error("artifact {name}: sha256 mismatch in {path} (expected {expected}, got {found})")]
    ArtifactDigest {
        name: String,
        path: PathBuf,
        expected: String,
        found: String,
    },
}

/// What `flotilla release create` needs.
#[derive(Debug, Clone)]
pub struct NewRelease {
    pub name: String,
    pub version: String,
    pub counter: u64,
    pub hardware: Vec<String>,
    /// `TARGET=PATH` pairs as given on the command line.
    pub artifacts: Vec<String>,
    /// `TARGET=TYPE` pairs as given on the command line (`--artifact-type`); an artifact whose
    /// target has none is plain bytes.
    pub artifact_types: Vec<String>,
    /// Seconds from now until the release expires.
    pub expires_in: u64,
    /// The block size of every artifact's block list; `None` makes a manifest without block
    /// lists, which agents older than decision 0024 can read (`--no-blocks`).
    pub block_size: Option<u32>,
}

/// The releases and artifacts under one data directory.
#[derive(Debug, Clone)]
pub struct ReleaseStore {
    data_dir: PathBuf,
}

impl ReleaseStore {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
        }
    }

    pub fn artifacts_dir(&self) -> PathBuf {
        self.data_dir.join("artifacts")
    }

    pub fn releases_dir(&self) -> PathBuf {
        self.data_dir.join("releases")
    }

    /// The file of a release (the name must already be valid).
    pub fn release_path(&self, name: &str) -> PathBuf {
        self.releases_dir().join(format!("{name}.release"))
    }

    /// Where the artifact with this digest lives.
    pub fn artifact_path(&self, sha256: &Digest) -> PathBuf {
        artifact_path(&self.artifacts_dir(), sha256)
    }

    /// Creates a release: copies every artifact into the store, signs the manifest with `key`
    /// and writes it. Refuses an existing name before copying anything.
    pub fn create(
        &self,
        new: &NewRelease,
        key: &SigningKey,
        now: UnixTime,
    ) -> Result<Manifest, ReleaseError> {
        flotilla_protocol::validate_id("release name", &new.name).map_err(|source| {
            ReleaseError::Name {
                name: new.name.clone(),
                source,
            }
        })?;
        if new.artifacts.is_empty() {
            return Err(ReleaseError::NoArtifacts);
        }
        let mut sources = Vec::new();
        for value in &new.artifacts {
            let (target, path) = value
                .split_once('=')
                .filter(|(t, p)| !t.is_empty() && !p.is_empty())
                .ok_or_else(|| ReleaseError::ArtifactSpec {
                    value: value.clone(),
                })?;
            flotilla_protocol::validate_id("artifact target", target).map_err(|source| {
                ReleaseError::ArtifactTarget {
                    value: value.clone(),
                    target: target.to_owned(),
                    source,
                }
            })?;
            sources.push((target.to_owned(), PathBuf::from(path)));
        }
        let targets: Vec<&str> = sources.iter().map(|(t, _)| t.as_str()).collect();
        let types = parse_types(&new.artifact_types, &targets)?;
        for (target, path) in &sources {
            if let Some(ty) = types.get(target) {
                check_content(target, ty, path)?;
            }
        }
        let release_path = self.release_path(&new.name);
        if release_path.exists() {
            return Err(ReleaseError::Exists {
                name: new.name.clone(),
                path: release_path,
            });
        }
        if let Some(block_size) = new.block_size {
            BlockIndexRef {
                block_size,
                sha256: [0; 32],
            }
            .validate()
            .map_err(|source| ReleaseError::BlockList {
                name: "(every artifact)".into(),
                source,
            })?;
        }
        let mut artifacts = Vec::new();
        let mut indexes = Vec::new();
        let mut artifact_types = Vec::new();
        for (target, path) in sources {
            // A target named by two artifacts gets the type on both.
            artifact_types.push(types.get(&target).cloned());
            let (size, sha256) = self.import_artifact(&path)?;
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| target.clone());
            if let Some(block_size) = new.block_size {
                indexes.push(self.store_block_list(&name, &sha256, block_size)?);
            }
            artifacts.push(Artifact {
                name,
                target,
                size,
                sha256,
            });
        }
        let manifest = ReleaseManifest {
            name: new.name.clone(),
            version: new.version.clone(),
            counter: new.counter,
            hardware: new.hardware.clone(),
            artifacts,
            created_at: now,
            expires_at: now.saturating_add(new.expires_in),
        };
        let manifest = Manifest {
            release: manifest,
            blocks: new
                .block_size
                .map(|_| ManifestBlocks { artifacts: indexes }),
            // Only a release that types something gets the section, so a release without types
            // stays readable by agents that predate them.
            types: artifact_types
                .iter()
                .any(Option::is_some)
                .then_some(ManifestTypes {
                    artifacts: artifact_types,
                }),
        };
        let blob = SignedBlob::sign(key, manifest.encode());
        // A concurrent `create` of the same name could have won since the check above; the
        // no-clobber link makes the last step refuse instead of silently replacing it.
        write_atomic(&release_path, &envelope::to_bytes(&blob), false).map_err(|e| match e {
            WriteError::Exists => ReleaseError::Exists {
                name: new.name.clone(),
                path: release_path.clone(),
            },
            WriteError::Io(source) => ReleaseError::Write {
                path: release_path.clone(),
                source,
            },
        })?;
        Ok(manifest)
    }

    /// Hashes every block of a stored artifact and stores the list under its own digest.
    fn store_block_list(
        &self,
        name: &str,
        sha256: &Digest,
        block_size: u32,
    ) -> Result<BlockIndexRef, ReleaseError> {
        let path = self.artifact_path(sha256);
        let file = File::open(&path).map_err(|source| ReleaseError::ReadArtifact {
            path: path.clone(),
            source,
        })?;
        let list =
            BlockList::compute(std::io::BufReader::new(file), block_size).map_err(|source| {
                ReleaseError::BlockList {
                    name: name.to_owned(),
                    source,
                }
            })?;
        let index = BlockIndexRef {
            block_size,
            sha256: flotilla_protocol::sha256(list.as_bytes()),
        };
        let dest = self.artifact_path(&index.sha256);
        // Same digest, same bytes: a list already stored (a shared artifact) is kept as it is.
        match write_atomic(&dest, list.as_bytes(), false) {
            Ok(()) | Err(WriteError::Exists) => Ok(index),
            Err(WriteError::Io(source)) => Err(ReleaseError::Write { path: dest, source }),
        }
    }

    /// Streams a file into the store, hashing while copying. Returns its size and digest.
    pub fn import_artifact(&self, path: &Path) -> Result<(u64, Digest), ReleaseError> {
        let dir = self.artifacts_dir();
        let write_err = |source| ReleaseError::Write {
            path: dir.clone(),
            source,
        };
        fs::create_dir_all(&dir).map_err(write_err)?;
        let mut input = File::open(path).map_err(|source| ReleaseError::ReadArtifact {
            path: path.to_owned(),
            source,
        })?;
        let mut tmp = tempfile::NamedTempFile::new_in(&dir).map_err(write_err)?;
        let mut hasher = sha2::Sha256::new();
        let mut size = 0u64;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = input
                .read(&mut buf)
                .map_err(|source| ReleaseError::ReadArtifact {
                    path: path.to_owned(),
                    source,
                })?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            tmp.write_all(&buf[..n]).map_err(write_err)?;
            size += n as u64;
        }
        let sha256: Digest = hasher.finalize().into();
        let dest = self.artifact_path(&sha256);
        tmp.as_file().sync_all().map_err(write_err)?;
        // Same digest means same bytes: an artifact shared by two releases is stored once.
        tmp.persist(&dest).map_err(|e| ReleaseError::Write {
            path: dest.clone(),
            source: e.error,
        })?;
        fsync_dir(&dir).map_err(write_err)?;
        Ok((size, sha256))
    }

    /// Reads a release fresh from disk: the signed blob exactly as stored (what agents verify)
    /// and its decoded manifest. Does not check the signature: the coordinator forwards the
    /// blob, and agents hold the release keys.
    pub fn load(&self, name: &str) -> Result<(SignedBlob, ReleaseManifest), ReleaseError> {
        self.load_manifest(name).map(|(blob, m)| (blob, m.release))
    }

    /// Like [`ReleaseStore::load`], with the manifest's block indexes; every block list file is
    /// checked against its signed digest and its artifact's size.
    pub fn load_manifest(&self, name: &str) -> Result<(SignedBlob, Manifest), ReleaseError> {
        flotilla_protocol::validate_id("release name", name).map_err(|source| {
            ReleaseError::Name {
                name: name.to_owned(),
                source,
            }
        })?;
        let path = self.release_path(name);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ReleaseError::NotFound {
                    name: name.to_owned(),
                    path,
                })
            }
            Err(source) => return Err(ReleaseError::ReadRelease { path, source }),
        };
        let (blob, manifest) = decode_release(&path, &bytes)?;
        if manifest.release.name != name {
            return Err(ReleaseError::WrongName {
                path,
                expected: name.to_owned(),
                found: manifest.release.name,
            });
        }
        self.check_block_lists(&manifest)?;
        Ok((blob, manifest))
    }

    /// Checks every block list a manifest names is in the store and matches its signed digest.
    pub fn check_block_lists(&self, manifest: &Manifest) -> Result<(), ReleaseError> {
        for (position, artifact) in manifest.release.artifacts.iter().enumerate() {
            let Some(index) = manifest.block_index(position) else {
                continue;
            };
            let path = self.artifact_path(&index.sha256);
            let bytes = match fs::read(&path) {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(ReleaseError::BlockListMissing {
                        name: artifact.name.clone(),
                        path,
                    })
                }
                Err(source) => return Err(ReleaseError::ReadArtifact { path, source }),
            };
            BlockList::from_bytes(&bytes, index, artifact.size).map_err(|source| {
                ReleaseError::BlockListMismatch {
                    name: artifact.name.clone(),
                    path,
                    source,
                }
            })?;
        }
        Ok(())
    }

    /// Names of every release file, sorted.
    pub fn list(&self) -> Result<Vec<String>, ReleaseError> {
        let dir = self.releases_dir();
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(ReleaseError::List { path: dir, source }),
        };
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| ReleaseError::List {
                path: dir.clone(),
                source,
            })?;
            let file = entry.file_name();
            let file = file.to_string_lossy();
            if let Some(name) = file.strip_suffix(".release") {
                if flotilla_protocol::validate_id("release name", name).is_ok() {
                    names.push(name.to_owned());
                }
            }
        }
        names.sort();
        Ok(names)
    }

    /// Summaries of every readable release; unreadable files are logged and skipped so one
    /// corrupt file does not hide the rest.
    pub fn summaries(&self) -> Result<Vec<ReleaseSummary>, ReleaseError> {
        Ok(self.manifests()?.iter().map(summary).collect())
    }

    /// Every readable release's manifest, by name; unreadable ones are logged and skipped.
    pub fn manifests(&self) -> Result<Vec<Manifest>, ReleaseError> {
        let mut out = Vec::new();
        for name in self.list()? {
            match self.load_manifest(&name) {
                Ok((_, manifest)) => out.push(manifest),
                Err(e) => {
                    tracing::warn!(release = %name, error = %e, "skipping unreadable release")
                }
            }
        }
        Ok(out)
    }

    /// Checks a release: the signature against `key` (strict), then every artifact in the
    /// store has the declared size and sha256.
    pub fn verify(&self, path: &Path, key: &VerifyingKey) -> Result<Manifest, ReleaseError> {
        let bytes = fs::read(path).map_err(|source| ReleaseError::ReadRelease {
            path: path.to_owned(),
            source,
        })?;
        let blob: SignedBlob = envelope::from_bytes("release file", &bytes).map_err(|source| {
            ReleaseError::Decode {
                path: path.to_owned(),
                source,
            }
        })?;
        blob.verify("release manifest", std::slice::from_ref(key))
            .map_err(|source| ReleaseError::Signature {
                path: path.to_owned(),
                source,
            })?;
        let manifest =
            Manifest::decode(&blob.payload).map_err(|source| ReleaseError::Manifest {
                path: path.to_owned(),
                source,
            })?;
        for artifact in &manifest.release.artifacts {
            self.check_artifact(artifact)?;
        }
        self.check_block_lists(&manifest)?;
        Ok(manifest)
    }

    fn check_artifact(&self, artifact: &Artifact) -> Result<(), ReleaseError> {
        let path = self.artifact_path(&artifact.sha256);
        let name = artifact.name.clone();
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ReleaseError::ArtifactMissing { name, path })
            }
            Err(source) => return Err(ReleaseError::ReadArtifact { path, source }),
        };
        let found = file
            .metadata()
            .map_err(|source| ReleaseError::ReadArtifact {
                path: path.clone(),
                source,
            })?
            .len();
        if found != artifact.size {
            return Err(ReleaseError::ArtifactSize {
                name,
                path,
                expected: artifact.size,
                found,
            });
        }
        let mut hasher = sha2::Sha256::new();
        let mut reader = file.take(artifact.size);
        std::io::copy(&mut reader, &mut hasher).map_err(|source| ReleaseError::ReadArtifact {
            path: path.clone(),
            source,
        })?;
        let digest: Digest = hasher.finalize().into();
        if digest != artifact.sha256 {
            return Err(ReleaseError::ArtifactDigest {
                name,
                path,
                expected: hex::encode(&artifact.sha256),
                found: hex::encode(&digest),
            });
        }
        Ok(())
    }
}

/// Decodes a release file's bytes into the blob and its manifest (with or without block lists).
pub fn decode_release(path: &Path, bytes: &[u8]) -> Result<(SignedBlob, Manifest), ReleaseError> {
    let blob: SignedBlob =
        envelope::from_bytes("release file", bytes).map_err(|source| ReleaseError::Decode {
            path: path.to_owned(),
            source,
        })?;
    let manifest = Manifest::decode(&blob.payload).map_err(|source| ReleaseError::Manifest {
        path: path.to_owned(),
        source,
    })?;
    Ok((blob, manifest))
}

/// Every digest a device installing this release may fetch: each artifact and each block list.
pub fn fetchable_digests(manifest: &Manifest) -> Vec<Digest> {
    let artifacts = manifest.release.artifacts.iter().map(|a| a.sha256);
    let lists = manifest
        .blocks
        .iter()
        .flat_map(|b| b.artifacts.iter().map(|i| i.sha256));
    artifacts.chain(lists).collect()
}

/// Reads a release file anywhere on disk (for `release inspect --file`).
pub fn read_release_file(path: &Path) -> Result<(SignedBlob, Manifest), ReleaseError> {
    let bytes = fs::read(path).map_err(|source| ReleaseError::ReadRelease {
        path: path.to_owned(),
        source,
    })?;
    decode_release(path, &bytes)
}

/// The JSON summary of a manifest.
pub fn summary(full: &Manifest) -> ReleaseSummary {
    let manifest = &full.release;
    let block_index = |i: usize| full.blocks.as_ref().and_then(|b| b.artifacts.get(i));
    ReleaseSummary {
        name: manifest.name.clone(),
        version: manifest.version.clone(),
        counter: manifest.counter,
        hardware: manifest.hardware.clone(),
        artifacts: manifest
            .artifacts
            .iter()
            .enumerate()
            .map(|(i, a)| ArtifactSummary {
                name: a.name.clone(),
                target: a.target.clone(),
                size: a.size,
                sha256: hex::encode(&a.sha256),
                block_size: block_index(i).map(|b| b.block_size),
                block_list_sha256: block_index(i).map(|b| hex::encode(&b.sha256)),
                artifact_type: full.artifact_type(i).map(|t| t.to_string()),
            })
            .collect(),
        devices: None,
        rollouts: Vec::new(),
    }
}

/// A manifest as a human-readable table.
pub fn render_manifest(full: &Manifest, signer: &[u8; 32]) -> String {
    let manifest = &full.release;
    let hardware = if manifest.hardware.is_empty() {
        "any".to_owned()
    } else {
        manifest.hardware.join(", ")
    };
    let mut out = format!(
        "release   {}\nversion   {}\ncounter   {}\nhardware  {}\ncreated   {}\nexpires   {}\nsigner    {}\n\n",
        manifest.name,
        manifest.version,
        manifest.counter,
        hardware,
        flotilla_rollout::window::utc_text(manifest.created_at),
        flotilla_rollout::window::utc_text(manifest.expires_at),
        hex::encode(signer),
    );
    let name_w = manifest
        .artifacts
        .iter()
        .map(|a| a.name.len())
        .max()
        .unwrap_or(0)
        .max(8);
    let target_w = manifest
        .artifacts
        .iter()
        .map(|a| a.target.len())
        .max()
        .unwrap_or(0)
        .max(6);
    // "-": plain bytes, which any target may take.
    let types: Vec<String> = (0..manifest.artifacts.len())
        .map(|i| {
            full.artifact_type(i)
                .map_or("-".to_owned(), |t| t.to_string())
        })
        .collect();
    let type_w = types.iter().map(String::len).max().unwrap_or(0).max(4);
    out.push_str(&format!(
        "{:name_w$}  {:target_w$}  {:type_w$}  {:>12}  SHA256\n",
        "ARTIFACT", "TARGET", "TYPE", "SIZE"
    ));
    for (a, ty) in manifest.artifacts.iter().zip(&types) {
        out.push_str(&format!(
            "{:name_w$}  {:target_w$}  {ty:type_w$}  {:>12}  {}\n",
            a.name,
            a.target,
            a.size,
            hex::encode(&a.sha256)
        ));
    }
    if full.blocks.is_none() {
        out.push_str("\nblock lists: none (a manifest agents before block hashes can read)\n");
        return out;
    }
    out.push_str(&format!(
        "\n{:name_w$}  {:>10}  BLOCK LIST SHA256\n",
        "ARTIFACT", "BLOCK SIZE"
    ));
    for (position, a) in manifest.artifacts.iter().enumerate() {
        if let Some(index) = full.block_index(position) {
            out.push_str(&format!(
                "{:name_w$}  {:>10}  {}\n",
                a.name,
                index.block_size,
                hex::encode(&index.sha256)
            ));
        }
    }
    out
}

/// The block size of a manifest's lists for `release list`: "64 KiB", or "none".
pub fn block_size_label(manifest: &Manifest) -> String {
    match manifest.block_index(0) {
        Some(index) => block_size_text(index.block_size),
        None => "none".to_owned(),
    }
}

/// "64 KiB", or "1500 B" for a size that is not a whole number of KiB.
fn block_size_text(block_size: u32) -> String {
    if block_size.is_multiple_of(1024) {
        format!("{} KiB", block_size / 1024)
    } else {
        format!("{block_size} B")
    }
}

/// Block lists of at most this many hashes (32 bytes each) are not worth a warning.
pub const HARMLESS_BLOCKS: u64 = 4;

/// One line per artifact of `full` whose block list is over 0.1% of the artifact (the bound in
/// docs/peers.md; a list is 32 bytes per block, 0.049% of the artifact at 64 KiB blocks),
/// naming the artifact, the block size and the overhead, and whether the largest block size
/// would keep it within the bound. `release create` prints them as warnings: such a list still
/// works, it only costs every device more than the bound (small blocks, or an artifact under
/// 32,000 bytes, where one 32-byte hash is already over 0.1%). A list of at most
/// [`HARMLESS_BLOCKS`] hashes is never named: its few bytes cannot matter, whatever share of a
/// small artifact they are.
pub fn block_list_overheads(full: &Manifest) -> Vec<String> {
    let over = |list: u64, size: u64| u128::from(list) * 1000 > u128::from(size);
    let percent = |list: u64, size: u64| {
        let p = list as f64 * 100.0 / size as f64;
        if p >= 1.0 {
            format!("{p:.1}%")
        } else {
            format!("{p:.3}%")
        }
    };
    let mut lines = Vec::new();
    for (position, a) in full.release.artifacts.iter().enumerate() {
        let Some(index) = full.block_index(position) else {
            continue;
        };
        let list = list_size(a.size, index.block_size);
        if !over(list, a.size) || list <= HARMLESS_BLOCKS * 32 {
            continue;
        }
        let largest = list_size(a.size, MAX_BLOCK_SIZE);
        let hint = if index.block_size == MAX_BLOCK_SIZE || over(largest, a.size) {
            "; no block size keeps an artifact this small within it".to_owned()
        } else {
            format!(
                "; --block-size {MAX_BLOCK_SIZE} would make it {}",
                percent(largest, a.size)
            )
        };
        lines.push(format!(
            "artifact {} ({} bytes): its block list at {} blocks is {} bytes, {} of the \
             artifact, over the 0.1% bound{hint}",
            a.name,
            a.size,
            block_size_text(index.block_size),
            list,
            percent(list, a.size),
        ));
    }
    lines
}

enum WriteError {
    Exists,
    Io(std::io::Error),
}

/// Writes `bytes` to `path` through a temp file in the same directory, fsync, then rename
/// (or, with `overwrite: false`, a no-clobber persist), then fsyncs the directory.
fn write_atomic(path: &Path, bytes: &[u8], overwrite: bool) -> Result<(), WriteError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(WriteError::Io)?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(WriteError::Io)?;
    tmp.write_all(bytes).map_err(WriteError::Io)?;
    tmp.as_file().sync_all().map_err(WriteError::Io)?;
    if overwrite {
        tmp.persist(path).map_err(|e| WriteError::Io(e.error))?;
    } else {
        tmp.persist_noclobber(path).map_err(|e| {
            if e.error.kind() == std::io::ErrorKind::AlreadyExists {
                WriteError::Exists
            } else {
                WriteError::Io(e.error)
            }
        })?;
    }
    fsync_dir(dir).map_err(WriteError::Io)
}

fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    // Makes the rename itself durable; directories can be opened read-only and synced on Unix.
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixture {
        _dir: tempfile::TempDir,
        store: ReleaseStore,
        key: SigningKey,
        app: PathBuf,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        let app = dir.path().join("app.bin");
        fs::write(&app, vec![42u8; 100_000]).expect("write");
        let store = ReleaseStore::new(dir.path().join("data"));
        Fixture {
            store,
            key: SigningKey::from_bytes(&[9; 32]),
            app,
            _dir: dir,
        }
    }

    fn new_release(name: &str, app: &Path) -> NewRelease {
        NewRelease {
            name: name.into(),
            version: "2.4.0".into(),
            counter: 24,
            hardware: vec!["pi4".into()],
            artifacts: vec![format!("app={}", app.display())],
            artifact_types: vec![],
            expires_in: 3600,
            block_size: Some(4096),
        }
    }

    #[test]
    fn create_load_verify_round_trip() {
        let f = fixture();
        let made = f
            .store
            .create(&new_release("fw-2.4.0", &f.app), &f.key, 1_000)
            .expect("create")
            .release;
        assert_eq!(made.artifacts.len(), 1);
        assert_eq!(made.artifacts[0].size, 100_000);
        assert_eq!(
            made.artifacts[0].sha256,
            flotilla_protocol::sha256(&[42u8; 100_000])
        );
        assert_eq!(made.expires_at, 4_600);
        assert_eq!(
            fs::read(f.store.artifact_path(&made.artifacts[0].sha256)).expect("stored"),
            vec![42u8; 100_000]
        );

        let (blob, loaded) = f.store.load_manifest("fw-2.4.0").expect("load");
        let loaded = loaded.release;
        assert_eq!(loaded, made);
        assert!(blob
            .verify("release manifest", &[f.key.verifying_key()])
            .is_ok());
        assert_eq!(f.store.list().expect("list"), vec!["fw-2.4.0".to_owned()]);
        let table = render_manifest(
            &f.store.load_manifest("fw-2.4.0").expect("load").1,
            &blob.signer,
        );
        assert!(
            table.contains("fw-2.4.0") && table.contains("app.bin") && table.contains("100000"),
            "{table}"
        );

        let path = f.store.release_path("fw-2.4.0");
        assert_eq!(
            f.store
                .verify(&path, &f.key.verifying_key())
                .expect("verifies")
                .release,
            made
        );
    }

    #[test]
    fn a_typed_artifact_is_signed_with_its_type_and_shown_by_inspect() {
        let f = fixture();
        let mut new = new_release("fw-typed", &f.app);
        new.artifact_types = vec!["app=mender:single-file".into()];
        let made = f.store.create(&new, &f.key, 0).expect("create");
        let (blob, loaded) = f.store.load_manifest("fw-typed").expect("load");
        assert_eq!(loaded, made);
        assert_eq!(
            loaded.artifact_type(0).map(|t| t.to_string()).as_deref(),
            Some("mender:single-file")
        );
        let table = render_manifest(&loaded, &blob.signer);
        assert!(
            table.contains("TYPE") && table.contains("mender:single-file"),
            "{table}"
        );
        let json = serde_json::to_value(summary(&loaded)).expect("json");
        assert_eq!(json["artifacts"][0]["type"], "mender:single-file");
        // Untyped: no section, "-" in the table, no "type" in the JSON.
        let plain = f
            .store
            .create(&new_release("fw-plain", &f.app), &f.key, 0)
            .expect("create");
        assert_eq!(plain.types, None);
        let table = render_manifest(&plain, &blob.signer);
        let row: Vec<&str> = table
            .lines()
            .find(|l| l.starts_with("app.bin"))
            .expect("a row")
            .split_whitespace()
            .collect();
        assert_eq!(row[..3], ["app.bin", "app", "-"], "{table}");
        let json = serde_json::to_value(summary(&plain)).expect("json");
        assert!(json["artifacts"][0].get("type").is_none(), "{json}");

        // A type the file cannot have is refused before anything is written.
        let mut wrong = new_release("fw-wrong", &f.app);
        wrong.artifact_types = vec!["app=swu".into()];
        let err = f.store.create(&wrong, &f.key, 0).expect_err("not a swu");
        assert!(
            err.to_string().starts_with("--artifact-type app=swu: ")
                && err.to_string().contains("not a SWUpdate image"),
            "{err}"
        );
        assert!(!f.store.release_path("fw-wrong").exists());
        wrong.artifact_types = vec!["boot=rauc-bundle".into()];
        let err = f
            .store
            .create(&wrong, &f.key, 0)
            .expect_err("no such target");
        assert!(
            err.to_string()
                .contains("no --artifact has target \"boot\""),
            "{err}"
        );
    }

    #[test]
    fn refuses_existing_name_and_bad_input() {
        let f = fixture();
        f.store
            .create(&new_release("fw-1", &f.app), &f.key, 0)
            .expect("create");
        let err = f
            .store
            .create(&new_release("fw-1", &f.app), &f.key, 0)
            .expect_err("exists");
        assert!(
            err.to_string().contains("fw-1") && err.to_string().contains("already exists"),
            "{err}"
        );

        let err = f
            .store
            .create(&new_release("fw/1", &f.app), &f.key, 0)
            .expect_err("bad name");
        assert!(err.to_string().contains("fw/1"), "{err}");
        let mut bad = new_release("fw-2", &f.app);
        bad.artifacts = vec!["no-equals-sign".into()];
        let err = f.store.create(&bad, &f.key, 0).expect_err("bad artifact");
        assert!(err.to_string().contains("no-equals-sign"), "{err}");
        bad.artifacts = vec!["app=/does/not/exist".into()];
        let err = f.store.create(&bad, &f.key, 0).expect_err("missing file");
        assert!(err.to_string().contains("/does/not/exist"), "{err}");
        assert!(
            !f.store.release_path("fw-2").exists(),
            "nothing written for a refused release"
        );
    }

    #[test]
    fn verify_fails_on_tampered_artifact_and_wrong_key() {
        let f = fixture();
        let made = f
            .store
            .create(&new_release("fw-3", &f.app), &f.key, 0)
            .expect("create");
        let path = f.store.release_path("fw-3");

        let err = f
            .store
            .verify(&path, &SigningKey::from_bytes(&[1; 32]).verifying_key())
            .expect_err("wrong key");
        assert!(err.to_string().contains("unknown key"), "{err}");

        let stored = f.store.artifact_path(&made.release.artifacts[0].sha256);
        let mut bytes = fs::read(&stored).expect("read");
        bytes[10] ^= 0xff;
        fs::write(&stored, &bytes).expect("tamper");
        let err = f
            .store
            .verify(&path, &f.key.verifying_key())
            .expect_err("tampered");
        assert!(
            err.to_string().contains("sha256 mismatch") && err.to_string().contains("app.bin"),
            "{err}"
        );

        bytes.pop();
        fs::write(&stored, &bytes).expect("truncate");
        let err = f
            .store
            .verify(&path, &f.key.verifying_key())
            .expect_err("short");
        assert!(err.to_string().contains("size mismatch"), "{err}");

        fs::remove_file(&stored).expect("remove");
        let err = f
            .store
            .verify(&path, &f.key.verifying_key())
            .expect_err("missing");
        assert!(err.to_string().contains("missing"), "{err}");
    }

    #[test]
    fn block_lists_over_a_tenth_of_a_percent_are_named_with_their_overhead() {
        let f = fixture();
        // 9 bytes: one hash, 355% of the artifact and 32 bytes; 20,000 bytes at 4 KiB: five
        // hashes, 0.8%, one more than a harmless few.
        let small = f.app.with_file_name("boot.cfg");
        fs::write(&small, [7u8; 9]).expect("write");
        let five = f.app.with_file_name("dtb.bin");
        fs::write(&five, [7u8; 20_000]).expect("write");
        let mut new = new_release("fw-6", &f.app);
        new.artifacts.push(format!("boot={}", small.display()));
        new.artifacts.push(format!("dtb={}", five.display()));
        // 4 KiB blocks: 25 hashes for 100,000 bytes.
        let made = f.store.create(&new, &f.key, 0).expect("create");
        assert_eq!(
            block_list_overheads(&made),
            [
                "artifact app.bin (100000 bytes): its block list at 4 KiB blocks is 800 bytes, \
                 0.800% of the artifact, over the 0.1% bound; --block-size 65536 would make it \
                 0.064%",
                "artifact dtb.bin (20000 bytes): its block list at 4 KiB blocks is 160 bytes, \
                 0.800% of the artifact, over the 0.1% bound; no block size keeps an artifact \
                 this small within it",
            ],
            "a list of a few blocks (boot.cfg's one) is not worth a warning"
        );
        // At 64 KiB blocks the large artifact is within the bound (0.064%) and the others'
        // lists are one hash each; without block lists there is nothing to say.
        new.name = "fw-7".into();
        new.block_size = Some(65536);
        let made = f.store.create(&new, &f.key, 0).expect("create");
        let lines = block_list_overheads(&made);
        assert!(lines.is_empty(), "{lines:?}");
        new.name = "fw-8".into();
        new.block_size = None;
        let made = f.store.create(&new, &f.key, 0).expect("create");
        assert!(block_list_overheads(&made).is_empty());
    }

    #[test]
    fn block_lists_are_stored_signed_and_checked_at_load() {
        let f = fixture();
        let made = f
            .store
            .create(&new_release("fw-5", &f.app), &f.key, 0)
            .expect("create");
        let index = *made.block_index(0).expect("a block list");
        assert_eq!(index.block_size, 4096);
        let list = fs::read(f.store.artifact_path(&index.sha256)).expect("list stored by digest");
        assert_eq!(list.len(), 100_000usize.div_ceil(4096) * 32);
        let checked = BlockList::from_bytes(&list, &index, 100_000).expect("list matches");
        assert!(checked.verify(1, &[42u8; 4096]));
        let (blob, loaded) = f.store.load_manifest("fw-5").expect("load");
        assert_eq!(loaded, made);
        assert_eq!(Manifest::decode(&blob.payload).expect("signed bytes"), made);
        assert_eq!(
            fetchable_digests(&loaded),
            vec![made.release.artifacts[0].sha256, index.sha256]
        );
        let table = render_manifest(&loaded, &blob.signer);
        assert!(
            table.contains("4096") && table.contains(&hex::encode(&index.sha256)),
            "{table}"
        );
        assert_eq!(block_size_label(&loaded), "4 KiB");

        let path = f.store.artifact_path(&index.sha256);
        let mut tampered = list.clone();
        tampered[0] ^= 1;
        fs::write(&path, &tampered).expect("tamper");
        let err = f.store.load("fw-5").expect_err("altered list");
        assert!(
            err.to_string().contains("app.bin")
                && err
                    .to_string()
                    .contains("does not match the signed manifest"),
            "{err}"
        );
        fs::remove_file(&path).expect("remove");
        let err = f.store.load("fw-5").expect_err("missing list");
        assert!(
            err.to_string().contains("block list") && err.to_string().contains("missing"),
            "{err}"
        );
    }

    #[test]
    fn no_blocks_signs_the_manifest_older_agents_read() {
        let f = fixture();
        let mut new = new_release("fw-6", &f.app);
        new.block_size = None;
        f.store.create(&new, &f.key, 0).expect("create");
        let (blob, loaded) = f.store.load_manifest("fw-6").expect("load");
        assert!(loaded.blocks.is_none());
        let plain: ReleaseManifest =
            envelope::from_bytes("release manifest", &blob.payload).expect("old readers read it");
        assert_eq!(plain, loaded.release);
        assert!(render_manifest(&loaded, &blob.signer).contains("block lists: none"));

        new.name = "fw-7".into();
        new.block_size = Some(100);
        let err = f.store.create(&new, &f.key, 0).expect_err("bad block size");
        assert!(err.to_string().contains("block size 100"), "{err}");
        assert!(!f.store.release_path("fw-7").exists());
    }

    #[test]
    fn load_names_missing_and_corrupt_releases() {
        let f = fixture();
        let err = f.store.load("nope").expect_err("missing");
        assert!(err.to_string().contains("no release named nope"), "{err}");
        fs::create_dir_all(f.store.releases_dir()).expect("mkdir");
        fs::write(f.store.release_path("junk"), b"\x01\x02garbage").expect("write");
        let err = f.store.load("junk").expect_err("corrupt");
        assert!(err.to_string().contains("junk.release"), "{err}");
        assert!(f.store.summaries().expect("summaries").is_empty());
    }
}
