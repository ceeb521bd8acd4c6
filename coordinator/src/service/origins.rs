//! HTTP(S) locations of a release's artifacts (decision 0062): a plain text file beside the
//! release, `{data_dir}/releases/{name}.origins`, one `TARGET URL` line per artifact.
//!
//! Locations are not in the signed manifest: they change (a CDN moves, a presigned URL expires)
//! and every block a device fetches from one is checked against the block list the release key
//! signed, so where the bytes come from does not matter to trust. `release create --url` and
//! `release locate` write the file; the service reads it fresh for every install it signs, so
//! a location set a second ago goes out with the next desired action, and names it in
//! `ActionBody::InstallFromOrigins` by artifact digest.
//!
//! ```text
//! app https://cdn.example.com/fw/app-2.4.bin
//! rootfs http://10.0.0.5:8080/rootfs-2.4.img
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;

use flotilla_protocol::manifest::Manifest;
use flotilla_protocol::origin::{Origin, OriginUrl, OriginUrlError};
use flotilla_protocol::SignedBlob;

use crate::service::releases::{ReleaseError, ReleaseStore};

/// Why a location could not be read or set; every variant names the release or the file.
#[derive(Debug, thiserror::Error)]
pub enum OriginsError {
    #[error(transparent)]
    Release(#[from] ReleaseError),
    #[error("release {release}: {source}")]
    Url {
        release: String,
        source: OriginUrlError,
    },
    #[error(
        "--url {value:?} must look like TARGET=URL (e.g. app=https://cdn.example.com/app.bin)"
    )]
    Spec { value: String },
    #[error("release {release} has no artifact for target {target:?} (it has: {known})")]
    Target {
        release: String,
        target: String,
        known: String,
    },
    #[error("release {release} has no block lists (made with --no-blocks): devices can only check its artifacts whole, so they fetch them from the coordinator, not from an HTTP origin")]
    NoBlocks { release: String },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} line {line}: {reason}")]
    Line {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Where the locations of release `name` are kept (the name must already be valid).
pub fn origins_path(store: &ReleaseStore, name: &str) -> PathBuf {
    store.releases_dir().join(format!("{name}.origins"))
}

/// The locations of release `name`, by target; empty when it has none.
pub fn load(store: &ReleaseStore, name: &str) -> Result<BTreeMap<String, String>, OriginsError> {
    flotilla_protocol::validate_id("release name", name).map_err(|source| ReleaseError::Name {
        name: name.to_owned(),
        source,
    })?;
    let path = origins_path(store, name);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(source) => return Err(OriginsError::Read { path, source }),
    };
    let mut out = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |reason: String| OriginsError::Line {
            path: path.clone(),
            line: i + 1,
            reason,
        };
        let (target, url) = line
            .split_once(' ')
            .ok_or_else(|| bad("expected `TARGET URL`".to_owned()))?;
        OriginUrl::parse(url.trim()).map_err(|e| bad(e.to_string()))?;
        out.insert(target.to_owned(), url.trim().to_owned());
    }
    Ok(out)
}

/// Sets (or, with `None`, removes) the location of `target`'s artifact in release `name`,
/// after checking the release has that target and block lists and that the URL is `http` or
/// `https`. The file is replaced atomically.
pub fn set(
    store: &ReleaseStore,
    name: &str,
    target: &str,
    url: Option<&str>,
) -> Result<(), OriginsError> {
    let (_, manifest) = store.load_manifest(name)?;
    check(&manifest, target, url)?;
    let mut all = load(store, name)?;
    match url {
        Some(url) => all.insert(target.to_owned(), url.to_owned()),
        None => all.remove(target),
    };
    write(store, name, &all)
}

/// Parses `--url TARGET=URL` values and checks each against `manifest`.
pub fn parse_specs(
    manifest: &Manifest,
    values: &[String],
) -> Result<BTreeMap<String, String>, OriginsError> {
    let mut out = BTreeMap::new();
    for value in values {
        let (target, url) = value.split_once('=').ok_or_else(|| OriginsError::Spec {
            value: value.clone(),
        })?;
        check(manifest, target, Some(url))?;
        out.insert(target.to_owned(), url.to_owned());
    }
    Ok(out)
}

/// Writes the whole location file of release `name`.
pub fn write(
    store: &ReleaseStore,
    name: &str,
    all: &BTreeMap<String, String>,
) -> Result<(), OriginsError> {
    let path = origins_path(store, name);
    let text: String = all
        .iter()
        .map(|(target, url)| format!("{target} {url}\n"))
        .collect();
    crate::service::seal::write_atomic(&path, text.as_bytes())
        .map_err(|source| OriginsError::Write { path, source })
}

fn check(manifest: &Manifest, target: &str, url: Option<&str>) -> Result<(), OriginsError> {
    let release = manifest.release.name.clone();
    if !manifest
        .release
        .artifacts
        .iter()
        .any(|a| a.target == target)
    {
        let known: Vec<&str> = manifest
            .release
            .artifacts
            .iter()
            .map(|a| a.target.as_str())
            .collect();
        return Err(OriginsError::Target {
            release,
            target: target.to_owned(),
            known: known.join(", "),
        });
    }
    if manifest.blocks.is_none() {
        return Err(OriginsError::NoBlocks { release });
    }
    if let Some(url) = url {
        OriginUrl::parse(url).map_err(|source| OriginsError::Url { release, source })?;
    }
    Ok(())
}

/// The locations of release `name`'s artifacts as a desired action names them: by digest.
/// `signed` is the release's signed manifest. Reads only the location file when the release
/// has none; a file that cannot be read is logged and leaves the release without locations
/// (the coordinator serves every byte, as without one).
pub fn for_action(store: &ReleaseStore, name: &str, signed: &SignedBlob) -> Vec<Origin> {
    let by_target = match load(store, name) {
        Ok(m) if m.is_empty() => return Vec::new(),
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(release = name, "ignoring its HTTP locations: {e}");
            return Vec::new();
        }
    };
    let Ok(manifest) = Manifest::decode(&signed.payload) else {
        return Vec::new();
    };
    if manifest.blocks.is_none() {
        return Vec::new();
    }
    manifest
        .release
        .artifacts
        .iter()
        .filter_map(|a| {
            Some(Origin {
                sha256: a.sha256,
                url: by_target.get(&a.target)?.clone(),
            })
        })
        .collect()
}
