//! The signed bytes of a release manifest: the [`ReleaseManifest`] as it has always been encoded,
//! optionally followed by a versioned **extension** that carries each artifact's block index.
//!
//! ```text
//! postcard(ReleaseManifest)                                   a manifest without block hashes
//! postcard(ReleaseManifest) postcard((1u16, ManifestBlocks))  with block hashes (extension 1)
//! ```
//!
//! The release key signs all of it. Why a tail and not a new field: postcard is not
//! self-describing, so a field added to `Artifact` would make every older agent misread the
//! manifest. An older agent reading a manifest with an extension refuses it ("unexpected trailing
//! bytes") instead of misreading it, and nothing is applied; a newer agent reads manifests of
//! either shape. See decision 0024.

use serde::{Deserialize, Serialize};

use crate::blocks::{BlockIndexRef, BlockListError};
use crate::envelope::{self, DecodeError};
use crate::messages::ReleaseManifest;

/// The extension version this crate writes and reads.
pub const EXTENSION_VERSION: u16 = 1;

/// The manifest's extension: one block index per artifact, in the manifest's artifact order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestBlocks {
    pub artifacts: Vec<BlockIndexRef>,
}

/// A decoded manifest with its block indexes, when it has them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub release: ReleaseManifest,
    pub blocks: Option<ManifestBlocks>,
}

/// Why signed manifest bytes could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("release manifest extension version {0} is not supported (this build reads {EXTENSION_VERSION})")]
    ExtensionVersion(u16),
    #[error("release manifest has {indexes} block indexes for {artifacts} artifacts")]
    IndexCount { indexes: usize, artifacts: usize },
    #[error("release manifest block index of artifact {artifact:?}: {error}")]
    Index {
        artifact: String,
        error: BlockListError,
    },
}

impl Manifest {
    /// The bytes the release key signs.
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = envelope::to_bytes(&self.release);
        if let Some(blocks) = &self.blocks {
            bytes.extend(envelope::to_bytes(&(EXTENSION_VERSION, blocks)));
        }
        bytes
    }

    /// Reads signed manifest bytes (after their signature was checked) of either shape.
    pub fn decode(bytes: &[u8]) -> Result<Self, ManifestError> {
        let (release, rest): (ReleaseManifest, &[u8]) =
            postcard::take_from_bytes(bytes).map_err(|e| DecodeError::Malformed {
                what: "release manifest",
                reason: e.to_string(),
            })?;
        if rest.is_empty() {
            return Ok(Self {
                release,
                blocks: None,
            });
        }
        let (version, rest): (u16, &[u8]) =
            postcard::take_from_bytes(rest).map_err(|e| DecodeError::Malformed {
                what: "release manifest extension",
                reason: e.to_string(),
            })?;
        if version != EXTENSION_VERSION {
            return Err(ManifestError::ExtensionVersion(version));
        }
        let blocks: ManifestBlocks = envelope::from_bytes("release manifest extension", rest)?;
        if blocks.artifacts.len() != release.artifacts.len() {
            return Err(ManifestError::IndexCount {
                indexes: blocks.artifacts.len(),
                artifacts: release.artifacts.len(),
            });
        }
        for (artifact, index) in release.artifacts.iter().zip(&blocks.artifacts) {
            index.validate().map_err(|error| ManifestError::Index {
                artifact: artifact.name.clone(),
                error,
            })?;
        }
        Ok(Self {
            release,
            blocks: Some(blocks),
        })
    }

    /// The block index of the artifact at `position` in the manifest, if the manifest has them.
    pub fn block_index(&self, position: usize) -> Option<&BlockIndexRef> {
        self.blocks.as_ref()?.artifacts.get(position)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::Artifact;

    fn release() -> ReleaseManifest {
        ReleaseManifest {
            name: "fw-2.4.0".into(),
            version: "2.4.0".into(),
            counter: 24,
            hardware: vec![],
            artifacts: vec![Artifact {
                name: "rootfs.img".into(),
                target: "rootfs".into(),
                size: 1 << 20,
                sha256: [1; 32],
            }],
            created_at: 1,
            expires_at: 2,
        }
    }

    fn index() -> BlockIndexRef {
        BlockIndexRef {
            block_size: 65_536,
            sha256: [2; 32],
        }
    }

    #[test]
    fn both_shapes_round_trip_and_the_plain_one_is_unchanged() {
        let plain = Manifest {
            release: release(),
            blocks: None,
        };
        assert_eq!(plain.encode(), envelope::to_bytes(&release()));
        assert_eq!(Manifest::decode(&plain.encode()), Ok(plain));
        let extended = Manifest {
            release: release(),
            blocks: Some(ManifestBlocks {
                artifacts: vec![index()],
            }),
        };
        let decoded = Manifest::decode(&extended.encode()).expect("reads");
        assert_eq!(decoded.block_index(0), Some(&index()));
        assert_eq!(decoded, extended);
    }

    #[test]
    fn an_older_reader_refuses_the_extension_instead_of_misreading_it() {
        let extended = Manifest {
            release: release(),
            blocks: Some(ManifestBlocks {
                artifacts: vec![index()],
            }),
        };
        let err = envelope::from_bytes::<ReleaseManifest>("release manifest", &extended.encode())
            .expect_err("refused");
        assert!(err.to_string().contains("trailing bytes"), "{err}");
    }

    #[test]
    fn bad_extensions_are_refused_naming_what_is_wrong() {
        let mut bytes = envelope::to_bytes(&release());
        bytes.extend(envelope::to_bytes(&(
            2u16,
            ManifestBlocks { artifacts: vec![] },
        )));
        assert_eq!(
            Manifest::decode(&bytes),
            Err(ManifestError::ExtensionVersion(2))
        );
        let none = Manifest {
            release: release(),
            blocks: Some(ManifestBlocks { artifacts: vec![] }),
        };
        let err = Manifest::decode(&none.encode()).expect_err("refused");
        assert_eq!(
            err.to_string(),
            "release manifest has 0 block indexes for 1 artifacts"
        );
        let odd = Manifest {
            release: release(),
            blocks: Some(ManifestBlocks {
                artifacts: vec![BlockIndexRef {
                    block_size: 1 << 20,
                    ..index()
                }],
            }),
        };
        let err = Manifest::decode(&odd.encode()).expect_err("refused");
        assert!(err.to_string().contains("rootfs.img"), "{err}");
        let mut trailing = none.encode();
        trailing.push(0);
        assert!(Manifest::decode(&trailing).is_err());
        for cut in 0..bytes.len() {
            let _ = Manifest::decode(&bytes[..cut]);
        }
    }
}
