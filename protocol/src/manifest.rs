//! The signed bytes of a release manifest: the [`ReleaseManifest`] as it has always been encoded,
//! optionally followed by an **extension**: numbered sections, each carrying one thing per
//! artifact that the original encoding has no field for.
//!
//! ```text
//! postcard(ReleaseManifest)                                   a manifest as first defined
//! postcard(ReleaseManifest) postcard((1u16, ManifestBlocks))  with block hashes (section 1)
//! postcard(ReleaseManifest) [postcard((1u16, ManifestBlocks))] postcard((2u16, ManifestTypes))
//!                                                             with artifact types (section 2)
//! ```
//!
//! Sections come in increasing order, each at most once. The release key signs all of it. Why
//! a tail and not a new field: postcard is not self-describing, so a field added to `Artifact`
//! would make every older agent misread the manifest. An older agent reading a section it does
//! not know refuses the manifest ("extension section 2 is not supported", or "unexpected
//! trailing bytes" after a section it knows) instead of misreading it, and nothing is applied; a
//! newer agent reads manifests of every shape. A manifest writes a section only when it has
//! something to say there, so a release without types stays readable by agents that predate
//! them. See decisions 0024 (blocks) and 0054 (types).

use serde::{Deserialize, Serialize};

use crate::artifact_type::{ArtifactType, ArtifactTypeError};
use crate::blocks::{BlockIndexRef, BlockListError};
use crate::envelope::{self, DecodeError};
use crate::messages::ReleaseManifest;

/// The section that carries each artifact's block index.
pub const SECTION_BLOCKS: u16 = 1;
/// The section that carries each artifact's type.
pub const SECTION_TYPES: u16 = 2;

/// Section 1: one block index per artifact, in the manifest's artifact order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestBlocks {
    pub artifacts: Vec<BlockIndexRef>,
}

/// Section 2: one type per artifact, in the manifest's artifact order; `None` for plain bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestTypes {
    pub artifacts: Vec<Option<ArtifactType>>,
}

/// A decoded manifest with its block indexes and artifact types, when it has them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub release: ReleaseManifest,
    pub blocks: Option<ManifestBlocks>,
    pub types: Option<ManifestTypes>,
}

/// Why signed manifest bytes could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("release manifest extension section {0} is not supported (this build reads sections {SECTION_BLOCKS} and {SECTION_TYPES})")]
    UnknownSection(u16),
    #[error("release manifest extension section {section} follows section {previous}: sections come once each, in increasing order")]
    SectionOrder { section: u16, previous: u16 },
    #[error("release manifest has {indexes} block indexes for {artifacts} artifacts")]
    IndexCount { indexes: usize, artifacts: usize },
    #[error("release manifest block index of artifact {artifact:?}: {error}")]
    Index {
        artifact: String,
        error: BlockListError,
    },
    #[error("release manifest has {types} artifact types for {artifacts} artifacts")]
    TypeCount { types: usize, artifacts: usize },
    #[error("release manifest type of artifact {artifact:?}: {error}")]
    Type {
        artifact: String,
        error: ArtifactTypeError,
    },
}

impl Manifest {
    /// A manifest with neither block indexes nor types.
    pub fn plain(release: ReleaseManifest) -> Self {
        Self {
            release,
            blocks: None,
            types: None,
        }
    }

    /// The bytes the release key signs.
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = envelope::to_bytes(&self.release);
        if let Some(blocks) = &self.blocks {
            bytes.extend(envelope::to_bytes(&(SECTION_BLOCKS, blocks)));
        }
        if let Some(types) = &self.types {
            bytes.extend(envelope::to_bytes(&(SECTION_TYPES, types)));
        }
        bytes
    }

    /// Reads signed manifest bytes (after their signature was checked) of any shape.
    pub fn decode(bytes: &[u8]) -> Result<Self, ManifestError> {
        let (release, mut rest): (ReleaseManifest, &[u8]) = postcard::take_from_bytes(bytes)
            .map_err(|e| DecodeError::Malformed {
                what: "release manifest",
                reason: e.to_string(),
            })?;
        let mut manifest = Self::plain(release);
        let mut previous = 0;
        while !rest.is_empty() {
            let (section, body): (u16, &[u8]) =
                postcard::take_from_bytes(rest).map_err(|e| DecodeError::Malformed {
                    what: "release manifest extension",
                    reason: e.to_string(),
                })?;
            if section != SECTION_BLOCKS && section != SECTION_TYPES {
                return Err(ManifestError::UnknownSection(section));
            }
            if section <= previous {
                return Err(ManifestError::SectionOrder { section, previous });
            }
            previous = section;
            rest = if section == SECTION_BLOCKS {
                let (blocks, rest) = take("release manifest block indexes", body)?;
                manifest.blocks = Some(blocks);
                rest
            } else {
                let (types, rest) = take("release manifest artifact types", body)?;
                manifest.types = Some(types);
                rest
            };
        }
        manifest.validate()?;
        Ok(manifest)
    }

    fn validate(&self) -> Result<(), ManifestError> {
        let artifacts = &self.release.artifacts;
        if let Some(blocks) = &self.blocks {
            if blocks.artifacts.len() != artifacts.len() {
                return Err(ManifestError::IndexCount {
                    indexes: blocks.artifacts.len(),
                    artifacts: artifacts.len(),
                });
            }
            for (artifact, index) in artifacts.iter().zip(&blocks.artifacts) {
                index.validate().map_err(|error| ManifestError::Index {
                    artifact: artifact.name.clone(),
                    error,
                })?;
            }
        }
        if let Some(types) = &self.types {
            if types.artifacts.len() != artifacts.len() {
                return Err(ManifestError::TypeCount {
                    types: types.artifacts.len(),
                    artifacts: artifacts.len(),
                });
            }
            for (artifact, ty) in artifacts.iter().zip(&types.artifacts) {
                if let Some(ty) = ty {
                    ty.validate().map_err(|error| ManifestError::Type {
                        artifact: artifact.name.clone(),
                        error,
                    })?;
                }
            }
        }
        Ok(())
    }

    /// The block index of the artifact at `position` in the manifest, if the manifest has them.
    pub fn block_index(&self, position: usize) -> Option<&BlockIndexRef> {
        self.blocks.as_ref()?.artifacts.get(position)
    }

    /// The type of the artifact at `position`, if the manifest gives it one.
    pub fn artifact_type(&self, position: usize) -> Option<&ArtifactType> {
        self.types.as_ref()?.artifacts.get(position)?.as_ref()
    }
}

/// Decodes one section's body from the front of `bytes`, returning what follows it.
fn take<'a, T: Deserialize<'a>>(
    what: &'static str,
    bytes: &'a [u8],
) -> Result<(T, &'a [u8]), DecodeError> {
    postcard::take_from_bytes(bytes).map_err(|e| DecodeError::Malformed {
        what,
        reason: e.to_string(),
    })
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
        let plain = Manifest::plain(release());
        assert_eq!(plain.encode(), envelope::to_bytes(&release()));
        assert_eq!(Manifest::decode(&plain.encode()), Ok(plain));
        let extended = Manifest {
            blocks: Some(ManifestBlocks {
                artifacts: vec![index()],
            }),
            ..Manifest::plain(release())
        };
        let decoded = Manifest::decode(&extended.encode()).expect("reads");
        assert_eq!(decoded.block_index(0), Some(&index()));
        assert_eq!(decoded.artifact_type(0), None);
        assert_eq!(decoded, extended);
        // Blocks and types, and types alone.
        let typed = Manifest {
            types: Some(ManifestTypes {
                artifacts: vec![Some(ArtifactType::RaucBundle)],
            }),
            ..extended.clone()
        };
        let decoded = Manifest::decode(&typed.encode()).expect("reads");
        assert_eq!(decoded.artifact_type(0), Some(&ArtifactType::RaucBundle));
        assert_eq!(decoded, typed);
        let types_only = Manifest {
            blocks: None,
            ..typed
        };
        assert_eq!(
            Manifest::decode(&types_only.encode()).expect("reads"),
            types_only
        );
    }

    #[test]
    fn section_one_is_byte_for_byte_what_block_hashes_always_wrote() {
        let extended = Manifest {
            blocks: Some(ManifestBlocks {
                artifacts: vec![index()],
            }),
            ..Manifest::plain(release())
        };
        let mut expected = envelope::to_bytes(&release());
        expected.extend(envelope::to_bytes(&(
            1u16,
            extended.blocks.clone().expect("blocks"),
        )));
        assert_eq!(extended.encode(), expected);
    }

    #[test]
    fn a_reader_of_blocks_only_refuses_types_instead_of_misreading_them() {
        // What an agent from before types did: section 1 only, to the end of the bytes.
        let older = |bytes: &[u8]| -> Result<(), String> {
            let (_, rest): (ReleaseManifest, &[u8]) =
                postcard::take_from_bytes(bytes).map_err(|e| e.to_string())?;
            if rest.is_empty() {
                return Ok(());
            }
            let (version, rest): (u16, &[u8]) =
                postcard::take_from_bytes(rest).map_err(|e| e.to_string())?;
            if version != 1 {
                return Err(format!("extension version {version} is not supported"));
            }
            envelope::from_bytes::<ManifestBlocks>("extension", rest)
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        let types = Some(ManifestTypes {
            artifacts: vec![Some(ArtifactType::Swu)],
        });
        let types_only = Manifest {
            types: types.clone(),
            ..Manifest::plain(release())
        };
        let err = older(&types_only.encode()).expect_err("refused");
        assert!(err.contains("version 2"), "{err}");
        let both = Manifest {
            blocks: Some(ManifestBlocks {
                artifacts: vec![index()],
            }),
            types,
            ..Manifest::plain(release())
        };
        let err = older(&both.encode()).expect_err("refused");
        assert!(err.contains("trailing bytes"), "{err}");
        assert_eq!(older(&Manifest::plain(release()).encode()), Ok(()));
    }

    #[test]
    fn an_older_reader_refuses_the_extension_instead_of_misreading_it() {
        let extended = Manifest {
            blocks: Some(ManifestBlocks {
                artifacts: vec![index()],
            }),
            ..Manifest::plain(release())
        };
        let err = envelope::from_bytes::<ReleaseManifest>("release manifest", &extended.encode())
            .expect_err("refused");
        assert!(err.to_string().contains("trailing bytes"), "{err}");
    }

    #[test]
    fn bad_extensions_are_refused_naming_what_is_wrong() {
        let mut bytes = envelope::to_bytes(&release());
        bytes.extend(envelope::to_bytes(&(
            3u16,
            ManifestBlocks { artifacts: vec![] },
        )));
        assert_eq!(
            Manifest::decode(&bytes),
            Err(ManifestError::UnknownSection(3))
        );
        let none = Manifest {
            blocks: Some(ManifestBlocks { artifacts: vec![] }),
            ..Manifest::plain(release())
        };
        let err = Manifest::decode(&none.encode()).expect_err("refused");
        assert_eq!(
            err.to_string(),
            "release manifest has 0 block indexes for 1 artifacts"
        );
        let odd = Manifest {
            types: None,
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
        // Types: one per artifact, valid module names, sections once each and in order.
        let two_types = Manifest {
            types: Some(ManifestTypes {
                artifacts: vec![None, Some(ArtifactType::Swu)],
            }),
            ..Manifest::plain(release())
        };
        let err = Manifest::decode(&two_types.encode()).expect_err("refused");
        assert_eq!(
            err.to_string(),
            "release manifest has 2 artifact types for 1 artifacts"
        );
        let escape = Manifest {
            types: Some(ManifestTypes {
                artifacts: vec![Some(ArtifactType::MenderModule("../../bin/sh".into()))],
            }),
            ..Manifest::plain(release())
        };
        let err = Manifest::decode(&escape.encode()).expect_err("refused");
        assert!(err.to_string().contains("rootfs.img"), "{err}");
        assert!(err.to_string().contains("../../bin/sh"), "{err}");
        let types = ManifestTypes {
            artifacts: vec![None],
        };
        let mut reversed = envelope::to_bytes(&release());
        reversed.extend(envelope::to_bytes(&(SECTION_TYPES, &types)));
        reversed.extend(envelope::to_bytes(&(
            SECTION_BLOCKS,
            &ManifestBlocks {
                artifacts: vec![index()],
            },
        )));
        assert_eq!(
            Manifest::decode(&reversed),
            Err(ManifestError::SectionOrder {
                section: 1,
                previous: 2
            })
        );
        let mut twice = envelope::to_bytes(&release());
        twice.extend(envelope::to_bytes(&(SECTION_TYPES, &types)));
        twice.extend(envelope::to_bytes(&(SECTION_TYPES, &types)));
        assert!(Manifest::decode(&twice).is_err());
        for cut in 0..bytes.len() {
            let _ = Manifest::decode(&bytes[..cut]);
        }
    }
}
