//! Artifact types for `flotilla release create` (`--artifact-type TARGET=TYPE`): parsed, checked
//! against each file's first and last bytes before anything is copied, and a hint for a file
//! that looks like a RAUC bundle or a SWUpdate image but was given no type (decision 0054).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use flotilla_protocol::artifact_type::{self, ArtifactType, ArtifactTypeError, Ends, HEAD_LEN};
use flotilla_protocol::manifest::Manifest;
use flotilla_protocol::Digest;

/// Why `--artifact-type` values could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TypeError {
    #[error("--artifact-type {value:?} must look like TARGET=TYPE (e.g. rootfs=rauc-bundle, app=swu, app=mender:single-file)")]
    Spec { value: String },
    #[error("--artifact-type {value:?}: {source}")]
    Type {
        value: String,
        source: ArtifactTypeError,
    },
    #[error("--artifact-type {value:?}: no --artifact has target {target:?} (targets: {targets})")]
    NoSuchTarget {
        value: String,
        target: String,
        targets: String,
    },
    #[error("--artifact-type gives target {target:?} a type twice")]
    Twice { target: String },
    #[error("--artifact-type {target}={ty}: {path} is {reason}")]
    Content {
        target: String,
        ty: ArtifactType,
        path: PathBuf,
        reason: String,
    },
    #[error("cannot read artifact {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
}

/// Parses `TARGET=TYPE` values; every target must be one of `targets` (the artifacts' targets).
pub fn parse_types(
    values: &[String],
    targets: &[&str],
) -> Result<BTreeMap<String, ArtifactType>, TypeError> {
    let mut types = BTreeMap::new();
    for value in values {
        let (target, ty) = value
            .split_once('=')
            .filter(|(t, ty)| !t.is_empty() && !ty.is_empty())
            .ok_or_else(|| TypeError::Spec {
                value: value.clone(),
            })?;
        let ty = ty
            .parse::<ArtifactType>()
            .map_err(|source| TypeError::Type {
                value: value.clone(),
                source,
            })?;
        if !targets.contains(&target) {
            return Err(TypeError::NoSuchTarget {
                value: value.clone(),
                target: target.to_owned(),
                targets: targets.join(", "),
            });
        }
        if types.insert(target.to_owned(), ty).is_some() {
            return Err(TypeError::Twice {
                target: target.to_owned(),
            });
        }
    }
    Ok(types)
}

/// Checks that the file at `path` can be a payload of type `ty` (from its ends only).
pub fn check_content(target: &str, ty: &ArtifactType, path: &Path) -> Result<(), TypeError> {
    let (head, tail, len) = read_ends(path).map_err(|source| TypeError::Read {
        path: path.to_owned(),
        source,
    })?;
    ty.check_content(Ends {
        head: &head,
        tail,
        len,
    })
    .map_err(|reason| TypeError::Content {
        target: target.to_owned(),
        ty: ty.clone(),
        path: path.to_owned(),
        reason,
    })
}

/// One line per untyped artifact of `manifest` that looks like a RAUC bundle or a SWUpdate
/// image, saying which `--artifact-type` would let devices refuse it on a target of the wrong
/// kind before downloading. `path_of` finds an artifact's bytes by digest.
pub fn untyped_lookalikes(
    manifest: &Manifest,
    path_of: impl Fn(&Digest) -> PathBuf,
) -> Vec<String> {
    let mut lines = Vec::new();
    for (position, a) in manifest.release.artifacts.iter().enumerate() {
        if manifest.artifact_type(position).is_some() {
            continue;
        }
        let Ok((head, tail, len)) = read_ends(&path_of(&a.sha256)) else {
            continue;
        };
        if let Some(ty) = artifact_type::sniff(Ends {
            head: &head,
            tail,
            len,
        }) {
            lines.push(format!(
                "artifact {} looks like {}; with --artifact-type {}={ty} a device whose target {:?} is not a {} target refuses it before downloading",
                a.name,
                match ty {
                    ArtifactType::Swu => "a SWUpdate image (.swu)",
                    _ => "a RAUC bundle",
                },
                a.target,
                a.target,
                ty.target_kind(),
            ));
        }
    }
    lines
}

/// The first [`HEAD_LEN`] bytes of a file, its last 8 and its length.
fn read_ends(path: &Path) -> io::Result<(Vec<u8>, Option<[u8; 8]>, u64)> {
    let mut file = File::open(path)?;
    let len = file.metadata()?.len();
    let mut head = Vec::with_capacity(HEAD_LEN);
    (&mut file).take(HEAD_LEN as u64).read_to_end(&mut head)?;
    let tail = if len >= 8 {
        let mut tail = [0u8; 8];
        file.seek(SeekFrom::End(-8))?;
        file.read_exact(&mut tail)?;
        Some(tail)
    } else {
        None
    };
    Ok((head, tail, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn types_name_a_target_of_the_release_once_each() {
        let types = parse_types(
            &values(&["rootfs=rauc-bundle", "app=mender:single-file"]),
            &["rootfs", "app"],
        )
        .expect("parses");
        assert_eq!(types["rootfs"], ArtifactType::RaucBundle);
        assert_eq!(
            types["app"],
            ArtifactType::MenderModule("single-file".into())
        );
        let err = parse_types(&values(&["rootfs"]), &["rootfs"]).expect_err("no type");
        assert!(err.to_string().contains("TARGET=TYPE"), "{err}");
        let err = parse_types(&values(&["rootfs=raucb"]), &["rootfs"]).expect_err("unknown");
        assert!(
            err.to_string().contains("unknown artifact type \"raucb\""),
            "{err}"
        );
        let err = parse_types(&values(&["boot=swu"]), &["rootfs", "app"]).expect_err("target");
        assert_eq!(
            err.to_string(),
            "--artifact-type \"boot=swu\": no --artifact has target \"boot\" (targets: rootfs, app)"
        );
        let err =
            parse_types(&values(&["app=swu", "app=rauc-bundle"]), &["app"]).expect_err("twice");
        assert!(err.to_string().contains("twice"), "{err}");
    }

    #[test]
    fn a_file_of_another_kind_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let text = dir.path().join("notes.txt");
        std::fs::write(&text, "not an image at all, only text\n").expect("write");
        let err = check_content("rootfs", &ArtifactType::Swu, &text).expect_err("refused");
        let err = err.to_string();
        assert!(err.starts_with("--artifact-type rootfs=swu: "), "{err}");
        assert!(
            err.contains("notes.txt is not a SWUpdate image (.swu)"),
            "{err}"
        );
        let err = check_content("rootfs", &ArtifactType::RaucBundle, &text).expect_err("refused");
        assert!(err.to_string().contains("is not a RAUC bundle"), "{err}");
        let module = ArtifactType::MenderModule("single-file".into());
        check_content("app", &module, &text).expect("any payload for a module");
        let missing = check_content("app", &module, &dir.path().join("gone")).expect_err("missing");
        assert!(
            missing.to_string().contains("cannot read artifact"),
            "{missing}"
        );
    }
}
